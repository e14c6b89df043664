"""A small model with BatchNorm trained through `hvdtrain.fit` under any `--sync`, for the
tests of exchanging less (`hvdtrain.exchange`):

    horovodrun -np 2 -H localhost:2 python tests/workers/exchange_checks.py --out OUT \
        --sync local --sync-every 4 --steps-per-execution 1 [--keras 3] [--optimizer sgd]

Each rank writes OUT/rank<r>.npz (its final weights, trainable and not) and OUT/trace.json
(rank 0): for every step, whether the ranks' trainable weights were the same after it (a
checksum gathered from every rank at every step: give --steps-per-execution 1). With
`--slow-rank R --slow-ms T` rank R's model sleeps T ms in each step (a slower rank; no trace
then: the ranks of --sync-balance take unequal steps); with `--stop-at E,S` rank 0's callback
stops training after the S-th step of epoch E (1-based; no trace either). `--data batches`
gives the same samples as a `Sequence` (Keras 2) or `PyDataset` (Keras 3) in batches,
`--data files` as TFRecord files of unequal sizes (`hvdtrain.FileData`) in OUT/files.
"""

import json
import os
import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hvdtrain
from hvdtrain.recipe.agreement import weights_checksums

SAMPLES, FEATURES, CLASSES = 320, 12, 4


def main():
    parser = hvdtrain.ArgumentParser(description=__doc__, epochs=2, batch_size=16)
    parser.add_argument("--keras", choices=["2", "3"], default="2")
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="adam")
    parser.add_argument("--out", required=True)
    parser.add_argument("--slow-rank", type=int, default=None)
    parser.add_argument("--slow-ms", type=float, default=0.0)
    parser.add_argument("--stop-at", default=None)
    parser.add_argument("--data", choices=["arrays", "batches", "files"], default="arrays")
    args = parser.parse_args()
    if args.keras == "3":
        import keras as k
    else:
        k = tf.keras

    def slow(x):  # the slower rank's steps: a sleep in the traced step (a slower device)
        if hvd.rank() != args.slow_rank:
            return x
        pause = tf.py_function(lambda: time.sleep(args.slow_ms / 1000) or 0.0, [], tf.float32)
        pause.set_shape(())
        return x + 0.0 * pause

    def build_model():
        model = k.Sequential(
            [
                k.Input((FEATURES,)),
                *([k.layers.Lambda(slow)] if args.slow_rank is not None else []),
                k.layers.Dense(16, activation="relu"),
                k.layers.BatchNormalization(),
                k.layers.Dense(CLASSES),
            ]
        )
        opt = k.optimizers.SGD(0.05) if args.optimizer == "sgd" else k.optimizers.Adam(1e-2)
        loss = k.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(opt, loss, metrics=["accuracy"])
        return model

    rng = np.random.default_rng(1)
    x = rng.normal(size=(SAMPLES, FEATURES)).astype("float32")
    y = (x[:, :CLASSES].argmax(1)).astype("int64")
    trace = []

    class Trace(k.callbacks.Callback):  # every rank: a collective
        def on_train_batch_end(self, batch, logs=None):
            mine = [c for _, c in weights_checksums(self.model)]
            gathered = hvd.allgather_object(mine, name="test.trace")
            trace.append(all(g == gathered[0] for g in gathered))

    stop = [int(v) for v in args.stop_at.split(",")] if args.stop_at else None

    class Stop(k.callbacks.Callback):  # a stop asked within an epoch, on rank 0
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if stop and hvd.rank() == 0 and [self.epoch + 1, batch + 1] == stop:
                self.model.stop_training = True

    kept = k.callbacks.LambdaCallback()  # its `model`: the one fit trains
    data = hvdtrain.ArrayData(x, y, test=(x[:64], y[:64]))
    if args.data == "batches":  # a Sequence (Keras 2) or PyDataset (Keras 3) of the same
        base = k.utils.PyDataset if args.keras == "3" else tf.keras.utils.Sequence

        class Batches(base):
            def __init__(self, n):
                super().__init__()
                self.n = n

            def __len__(self):
                return self.n // args.batch_size

            def __getitem__(self, i):
                part = slice(i * args.batch_size, (i + 1) * args.batch_size)
                return x[part], y[part]

        data = hvdtrain.BatchData(Batches(SAMPLES), test=Batches(64))
    if args.data == "files":
        data = hvdtrain.FileData(_files(x, y, args.out), _parse, test=None)
    checks = [Stop()] if stop or args.slow_rank is not None else [Trace()]
    hvdtrain.fit(build_model, data, args, callbacks=[*checks, kept])
    os.makedirs(args.out, exist_ok=True)
    weights = [np.asarray(v.numpy()) for v in kept.model.weights]
    np.savez(os.path.join(args.out, f"rank{hvd.rank()}.npz"), *weights)
    if hvd.rank() == 0:
        with open(os.path.join(args.out, "trace.json"), "w") as f:
            json.dump(trace, f)


def _files(x, y, out):
    """The samples in 3 TFRecord files of unequal sizes, each written whole by every rank
    (the same bytes: a rank never lists a file another one is still writing)."""
    folder = os.path.join(out, "files")
    os.makedirs(folder, exist_ok=True)
    for name, part in (("a", slice(0, 100)), ("b", slice(100, 130)), ("c", slice(130, None))):
        path = os.path.join(folder, f"{name}.tfrecord")
        with tf.io.TFRecordWriter(f"{path}.{hvd.rank()}") as w:
            for xi, yi in zip(x[part], y[part], strict=True):
                feature = {
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=xi)),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[yi])),
                }
                w.write(
                    tf.train.Example(
                        features=tf.train.Features(feature=feature)
                    ).SerializeToString()
                )
        os.replace(f"{path}.{hvd.rank()}", path)
    return os.path.join(folder, "*.tfrecord")


def _parse(record):
    spec = {
        "x": tf.io.FixedLenFeature([FEATURES], tf.float32),
        "y": tf.io.FixedLenFeature([], tf.int64),
    }
    example = tf.io.parse_single_example(record, spec)
    return example["x"], example["y"]


if __name__ == "__main__":
    main()
