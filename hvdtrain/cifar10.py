"""Train a ResNet on CIFAR-10 on N processes with Horovod.

    python -m hvdtrain.cifar10 --model resnet-small --epochs 1
    horovodrun -np 2 -H localhost:2 python -m hvdtrain.cifar10 --data-dir ~/data/cifar10
    hvdtrain-run --hostfile hosts.txt -- python -m hvdtrain.cifar10 --model resnet50

Data, the first that is found: `--data-dir` (the CIFAR-10 python batches, either the
folder `cifar-10-batches-py` or the archive `cifar-10-python.tar.gz`); Keras' cache
(~/.keras/datasets/cifar-10-batches-py); a download through Keras by local rank 0 of each
host (skipped when HVDTRAIN_OFFLINE=1); otherwise random images of the right shape,
announced as such: for benchmarking only, the accuracy means nothing.

Training uses the usual augmentation (random 32x32 crops of the 4-pixel padded image,
horizontal flips) and per-channel normalisation; SGD with momentum 0.9.
"""

import functools
import os
import pickle
import tarfile

import numpy as np

from hvdtrain import frontends
from hvdtrain.data import sources
from hvdtrain.errors import HvdtrainError, invalid_value
from hvdtrain.errors import main as cli_main
from hvdtrain.recipe.flags import ArgumentParser

__all__ = ["main", "load_cifar10", "build_model"]

PROG = "hvdtrain.cifar10"
MEAN = np.array([0.4914, 0.4822, 0.4465], np.float32)
STD = np.array([0.2470, 0.2435, 0.2616], np.float32)
_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]


class _ArraysOnly(pickle.Unpickler):
    """Unpickles the CIFAR batches (dicts of bytes, lists and numpy arrays) and nothing else:
    a pickle that names any other callable is refused instead of run."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),  # numpy 1 wrote these names (the real files)
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "_reconstruct"),  # and numpy 2 these
        ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }

    def find_class(self, module, name):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        if module.startswith("numpy.core.") and hasattr(np, "_core"):
            module = "numpy._core." + module[len("numpy.core.") :]  # numpy 2: no deprecation
        return super().find_class(module, name)


def _read_batch(f, where):
    try:
        batch = _ArraysOnly(f, encoding="bytes").load()
        x = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        y = np.asarray(batch[b"labels"], dtype=np.int32)
    except (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError) as e:
        raise HvdtrainError(f"Invalid CIFAR-10 batch {where}: {e}.") from None
    if len(x) != len(y) or (len(y) and (y.min() < 0 or y.max() > 9)):
        raise HvdtrainError(f"Invalid CIFAR-10 batch {where}: images and labels disagree.")
    return x.transpose(0, 2, 3, 1), y


def _load_folder(folder):
    found = {}
    for name in [*_TRAIN, "test_batch"]:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise HvdtrainError(
                f"Invalid value for `--data-dir`: {folder!r} lacks the CIFAR-10 batch {name}; "
                "expected the folder cifar-10-batches-py or cifar-10-python.tar.gz."
            )
        with open(path, "rb") as f:
            found[name] = _read_batch(f, path)
    return found


def _load_archive(path):
    found = {}
    try:
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                name = os.path.basename(member.name)
                if member.isfile() and name in [*_TRAIN, "test_batch"]:
                    found[name] = _read_batch(tar.extractfile(member), f"{path}:{member.name}")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise HvdtrainError(f"Invalid CIFAR-10 archive {path}: {e}.") from None
    missing = [n for n in [*_TRAIN, "test_batch"] if n not in found]
    if missing:
        raise HvdtrainError(f"Invalid CIFAR-10 archive {path}: missing {', '.join(missing)}.")
    return found


def load_cifar10(source, data_dir=None, synthetic_size=(2048, 512)):
    """Loads CIFAR-10 as uint8 [n, 32, 32, 3] images and int32 labels.

    `source` is "data-dir", "keras-cache" or "synthetic".
    Returns ((x_train, y_train), (x_test, y_test)).
    """
    if source == "synthetic":
        rng = np.random.default_rng(0)
        n_train, n_test = synthetic_size
        x = rng.integers(0, 256, (n_train + n_test, 32, 32, 3), dtype=np.uint8)
        y = rng.integers(0, 10, n_train + n_test).astype(np.int32)
        return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])
    if source == "keras-cache":
        found = _load_folder(keras_cache_path())
    else:
        folder = os.path.join(data_dir, "cifar-10-batches-py")
        archive = os.path.join(data_dir, "cifar-10-python.tar.gz")
        if os.path.isdir(folder):
            found = _load_folder(folder)
        elif os.path.isfile(archive):
            found = _load_archive(archive)
        else:
            found = _load_folder(data_dir)
    x = np.concatenate([found[n][0] for n in _TRAIN])
    y = np.concatenate([found[n][1] for n in _TRAIN])
    return (x, y), found["test_batch"]


def keras_cache_path():
    return os.path.join(sources.keras_datasets_dir(), "cifar-10-batches-py")


def build_model(name="resnet-small", keras=None):
    """ResNet-50 (Keras applications, random init) or a ResNet-20 for CPU runs; logits. In
    `keras`: `tf.keras` (Keras 2, the default) or the `keras` module (Keras 3)."""
    keras = keras or frontends.keras_module("2")
    if name == "resnet50":
        return keras.applications.ResNet50(
            weights=None, input_shape=(32, 32, 3), classes=10, classifier_activation=None
        )
    layers = keras.layers
    inputs = keras.Input((32, 32, 3))
    x = layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    x = layers.ReLU()(layers.BatchNormalization()(x))
    for stage, width in enumerate((16, 32, 64)):
        for block in range(3):
            stride = 2 if stage and block == 0 else 1
            shortcut = x
            y = layers.Conv2D(width, 3, strides=stride, padding="same", use_bias=False)(x)
            y = layers.ReLU()(layers.BatchNormalization()(y))
            y = layers.Conv2D(width, 3, padding="same", use_bias=False)(y)
            y = layers.BatchNormalization()(y)
            if stride != 1 or shortcut.shape[-1] != width:
                shortcut = layers.Conv2D(width, 1, strides=stride, use_bias=False)(shortcut)
                shortcut = layers.BatchNormalization()(shortcut)
            x = layers.ReLU()(layers.Add()([shortcut, y]))
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(10)(x), name="resnet20")


def _augment(x, y):
    import tensorflow as tf

    x = tf.image.convert_image_dtype(x, tf.float32)
    x = tf.image.pad_to_bounding_box(x, 4, 4, 40, 40)
    x = tf.image.random_crop(x, (32, 32, 3))
    x = tf.image.random_flip_left_right(x)
    return (x - MEAN) / STD, y


def _normalise(x, y):
    import tensorflow as tf

    return (tf.image.convert_image_dtype(x, tf.float32) - MEAN) / STD, y


def _load(args):
    def load():
        from hvdtrain.data import ArrayData

        source = sources.choose_source(
            args.data_dir, keras_cache_path(), _download, "synthetic", PROG
        )
        (x, y), test = load_cifar10(source, args.data_dir)
        notice = {
            "data-dir": f"CIFAR-10 from {args.data_dir}",
            "keras-cache": "CIFAR-10 from Keras' cache",
            "synthetic": "SYNTHETIC random images (no CIFAR-10 found): for benchmarking "
            "only, the accuracy means nothing",
        }[source]
        return ArrayData(x, y, test, train_map=_augment, eval_map=_normalise, source=source,
                         notice=notice)  # fmt: skip

    return load


def _download():
    import tensorflow as tf

    tf.keras.datasets.cifar10.load_data()


def _compiled(name, lr, version):
    """`build_model(name)` compiled: SGD with momentum 0.9, cross-entropy on logits."""
    keras = frontends.keras_module(version)
    model = build_model(name, keras)
    model.compile(  # by keyword: Keras 3's third argument is loss_weights, not metrics
        optimizer=keras.optimizers.SGD(lr, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def main(argv=None):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's INFO lines off
    parser = ArgumentParser(f"python -m {PROG}", __doc__, epochs=30, batch_size=64, lr=0.05)
    parser.add_argument("--model", choices=["resnet-small", "resnet50"], default="resnet-small")
    parser.add_argument("--data-dir", help="folder with the CIFAR-10 python batches")
    frontends.add_keras_flag(parser)

    def run(argv):
        args = parser.parse_args(argv)
        if args.data_dir and not os.path.isdir(args.data_dir):
            raise invalid_value("--data-dir", args.data_dir, "an existing folder")
        from hvdtrain.recipe.trainer import fit  # TensorFlow loads here, once the flags are good

        frontends.keras_module(args.keras)  # Keras 3 loaded before fit prepares it
        build = functools.partial(_compiled, args.model, args.lr, args.keras)
        return fit(build, _load(args), args, prog=PROG)

    cli_main(run, argv, PROG)


if __name__ == "__main__":
    main()
