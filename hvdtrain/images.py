"""Transfer learning with MobileNetV2 on any folder-per-class image dataset, on N processes.

    python -m hvdtrain.images --data-dir pets/            # pets/cat/*.jpg, pets/dog/*.jpg
    horovodrun -np 2 -H localhost:2 python -m hvdtrain.images --data-dir pets/ \\
        --weights mobilenet_v2_weights_tf_dim_ordering_tf_kernels_1.0_224_no_top.h5

Each sub-folder of `--data-dir` is a class (sorted by name); JPEG, PNG, GIF and BMP files
are read and resized to 224x224. A fixed share of each class (`--test-fraction`) is held
out for the final test metric. With `--weights` (a local Keras MobileNetV2 "no top"
weights file) the pretrained base is frozen and only the new head trains; without it the
whole network starts from random weights: ImageNet weights cannot be downloaded on an
offline machine, and this entry point never pretends they were.
"""

import functools
import os

import numpy as np

from hvdtrain import frontends
from hvdtrain.errors import HvdtrainError, invalid_value, one_line
from hvdtrain.errors import main as cli_main
from hvdtrain.recipe.flags import ArgumentParser

__all__ = ["main", "list_images", "build_model"]

PROG = "hvdtrain.images"
SIZE = 224
EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp")


def list_images(data_dir, test_fraction=0.1, seed=0):
    """(train, test, classes): (paths, labels) pairs split per class, and the class names."""
    if not os.path.isdir(data_dir):
        raise invalid_value("--data-dir", data_dir, "a folder with one sub-folder per class")
    classes = sorted(e.name for e in os.scandir(data_dir) if e.is_dir())
    if len(classes) < 2:
        raise invalid_value(
            "--data-dir", data_dir, "at least two class sub-folders (e.g. cat/ and dog/)"
        )
    rng = np.random.default_rng(seed)
    train, test = ([], []), ([], [])
    for label, name in enumerate(classes):
        folder = os.path.join(data_dir, name)
        files = sorted(
            os.path.join(folder, f) for f in os.listdir(folder) if f.lower().endswith(EXTENSIONS)
        )
        if not files:
            raise HvdtrainError(
                f"Invalid value for `--data-dir`: class folder {folder} has no images."
            )
        files = [files[i] for i in rng.permutation(len(files))]
        # At least one test image per class of two or more, unless none is asked for.
        some = test_fraction > 0 and len(files) > 1
        held = max(1, round(len(files) * test_fraction)) if some else 0
        for split, part in ((test, files[:held]), (train, files[held:])):
            split[0].extend(part)
            split[1].extend([label] * len(part))
    as_arrays = lambda s: (np.array(s[0]), np.array(s[1], np.int32))  # noqa: E731
    return as_arrays(train), as_arrays(test), classes


def _decode(path, label):
    import tensorflow as tf

    image = tf.io.decode_image(tf.io.read_file(path), channels=3, expand_animations=False)
    image = tf.image.resize(tf.cast(image, tf.float32), (SIZE, SIZE))
    # MobileNetV2's preprocessing: pixels to [-1, 1].
    return image / 127.5 - 1.0, label


def _augment(path, label):
    import tensorflow as tf

    image, label = _decode(path, label)
    return tf.image.random_flip_left_right(image), label


def build_model(classes, weights=None, keras=None):
    """MobileNetV2 base (frozen when pretrained `weights` are given) + a new logits head, in
    `keras`: `tf.keras` (Keras 2, the default) or the `keras` module (Keras 3)."""
    keras = keras or frontends.keras_module("2")
    base = keras.applications.MobileNetV2(
        input_shape=(SIZE, SIZE, 3), include_top=False, weights=None, pooling="avg"
    )
    if weights:
        try:
            base.load_weights(weights)
        except (OSError, ValueError) as e:  # not HDF5, or another network's weights
            reason = one_line(e)
            raise invalid_value(
                "--weights", weights, f"Keras MobileNetV2 no-top weights (.h5): {reason}"
            ) from None
        base.trainable = False
    inputs = keras.Input((SIZE, SIZE, 3))
    x = base(inputs, training=False if weights else None)
    x = keras.layers.Dropout(0.2)(x)
    return keras.Model(inputs, keras.layers.Dense(classes)(x), name="mobilenet_v2_transfer")


def _compiled(classes, weights, lr, version):
    """`build_model` compiled: Adam(lr), cross-entropy on logits, accuracy."""
    keras = frontends.keras_module(version)
    model = build_model(classes, weights, keras)
    model.compile(  # by keyword: Keras 3's third argument is loss_weights, not metrics
        optimizer=keras.optimizers.Adam(lr),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def main(argv=None):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's INFO lines off
    parser = ArgumentParser(f"python -m {PROG}", __doc__, epochs=5, batch_size=16, lr=1e-3)
    parser.add_argument("--data-dir", required=True, help="one sub-folder of images per class")
    parser.add_argument("--weights", help="local MobileNetV2 no-top weights file (.h5)")
    parser.add_argument(
        "--test-fraction", type=float, default=0.1, help="held out per class (0.1; 0: none)"
    )
    frontends.add_keras_flag(parser)

    def run(argv):
        args = parser.parse_args(argv)
        if not 0 <= args.test_fraction < 1:
            raise invalid_value("--test-fraction", args.test_fraction, "0 <= value < 1")
        if args.weights and not os.path.isfile(args.weights):
            raise invalid_value("--weights", args.weights, "a local MobileNetV2 weights file")
        (x, y), test, classes = list_images(args.data_dir, args.test_fraction, args.seed)
        where = (
            "pretrained weights from " + args.weights
            if args.weights
            else ("random initialisation (no --weights; ImageNet weights are not downloaded)")
        )
        from hvdtrain.data import ArrayData  # TensorFlow: once the flags and files are checked

        data = ArrayData(
            x, y, test if len(test[0]) else None, train_map=_augment, eval_map=_decode,
            source="data-dir",
            notice=f"{len(classes)} classes from {args.data_dir}; {where}",
        )  # fmt: skip
        from hvdtrain.recipe.trainer import fit

        frontends.keras_module(args.keras)  # Keras 3 loaded before fit prepares it
        build = functools.partial(_compiled, len(classes), args.weights, args.lr, args.keras)
        return fit(build, data, args, prog=PROG)

    cli_main(run, argv, PROG)


if __name__ == "__main__":
    main()
