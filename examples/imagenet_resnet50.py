"""ResNet-50 on a folder of images, read by Keras's ImageDataGenerator: the data loading of
Horovod's `examples/keras/keras_imagenet_resnet50.py`, trained through `hvdtrain.fit`.

Horovod's example hands `flow_from_directory`'s iterators to `fit_generator` with
`steps_per_epoch=len(train_iter) // hvd.size()` and a validation of `3 * len(test_iter) //
hvd.size()` random batches per rank ("over-sampling ... helps to increase probability that
every validation example will be evaluated"): each rank draws its batches from its own
shuffle, so ranks see the same images in an epoch and miss others, and the test figures
are of a sample. Here the same iterators go to `hvdtrain.fit` unchanged: each rank loads its
own batches of one shared order, every test image is evaluated exactly once, and the rest
of the recipe (LR x ranks after a warmup, broadcast, rank-0 checkpoints, resume) is
hvdtrain's.

    python examples/imagenet_resnet50.py --train-dir ~/imagenet/train --val-dir ~/imagenet/val
    horovodrun -np 2 -H localhost:2 python examples/imagenet_resnet50.py --train-dir ...
    hvdtrain-run --hostfile hosts.txt -- python examples/imagenet_resnet50.py --train-dir ...
    mpirun -np 2 python examples/imagenet_resnet50.py --train-dir ...

The folders hold one subfolder of images per class (ImageNet's layout). On a CPU, try it
small: `--image-size 32 --epochs 1` (ResNet-50 needs at least 32 pixels).
"""

import os

import tensorflow as tf

import hvdtrain  # before any `from tensorflow.keras... import`: that fixes tf.keras's Keras

ImageDataGenerator = tf.keras.preprocessing.image.ImageDataGenerator

# -- settings: Horovod's example's (https://arxiv.org/abs/1706.02677), each also a flag ----
parser = hvdtrain.ArgumentParser(description=__doc__, epochs=90, batch_size=32, lr=0.0125,
                                 warmup_epochs=5)  # fmt: skip
parser.add_argument("--train-dir", default=os.path.expanduser("~/imagenet/train"))
parser.add_argument("--val-dir", default=os.path.expanduser("~/imagenet/validation"))
parser.add_argument("--image-size", type=int, default=224, help="pixels per side")
parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
parser.add_argument("--wd", type=float, default=0.00005, help="L2 weight decay")
parser.add_argument("--loader-workers", type=int, default=4, help="threads loading images")
args = parser.parse_args()
size = (args.image_size, args.image_size)
preprocess = tf.keras.applications.resnet50.preprocess_input

# The training and validation iterators, as Horovod's example makes them.
train_iter = ImageDataGenerator(
    width_shift_range=0.33,
    height_shift_range=0.33,
    zoom_range=0.5,
    horizontal_flip=True,
    preprocessing_function=preprocess,
).flow_from_directory(args.train_dir, batch_size=args.batch_size, target_size=size)
test_iter = ImageDataGenerator(
    zoom_range=(0.875, 0.875), preprocessing_function=preprocess
).flow_from_directory(args.val_dir, batch_size=args.eval_batch_size, target_size=size,
                      shuffle=False)  # fmt: skip


def build_model():
    """ResNet-50 made for training: L2 weight decay, BatchNorm momentum 0.9 and epsilon 1e-5."""
    model = tf.keras.applications.resnet50.ResNet50(
        weights=None, input_shape=(*size, 3), classes=train_iter.num_classes
    )
    config = model.get_config()
    for layer, layer_config in zip(model.layers, config["layers"], strict=True):
        if hasattr(layer, "kernel_regularizer"):
            regularizer = tf.keras.regularizers.l2(args.wd)
            layer_config["config"]["kernel_regularizer"] = tf.keras.regularizers.serialize(
                regularizer
            )
        if isinstance(layer, tf.keras.layers.BatchNormalization):
            layer_config["config"].update(momentum=0.9, epsilon=1e-5)
    model = tf.keras.Model.from_config(config)
    model.compile(
        # Horovod: the single-process LR; hvdtrain raises it to LR x ranks over the warmup.
        optimizer=tf.keras.optimizers.SGD(args.lr, momentum=args.momentum),
        loss="categorical_crossentropy",
        metrics=["accuracy", "top_k_categorical_accuracy"],
    )
    return model


# Horovod: the after-warmup steps of Horovod's example (LR / 10 at epochs 30, 60 and 80), set
# on every rank as a single-process rate (hvdtrain scales it).
decay = tf.keras.callbacks.LearningRateScheduler(
    lambda epoch, lr: lr if epoch not in (30, 60, 80) else lr / 10
)
# Horovod: each rank loads its own batches of one order (sharded by index, none twice), with
# `loader_workers` threads; every test image is evaluated once, on one rank.
data = hvdtrain.BatchData(train_iter, test=test_iter, workers=args.loader_workers)
hvdtrain.fit(build_model, data, args, callbacks=[decay])
