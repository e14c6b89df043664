"""MNIST loading: every on-disk layout, and clear errors for bad files."""

import gzip

import numpy as np
import pytest

from hvdtrain.data.mnist import load_mnist, read_idx
from hvdtrain.errors import HvdtrainError


def _idx(array, ndim_code):
    header = bytes([0, 0, 8, ndim_code]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def _write_idx_dir(path, n_train=12, n_test=4, gz=True):
    rng = np.random.default_rng(0)
    files = {
        "train-images-idx3-ubyte": _idx(rng.integers(0, 256, (n_train, 28, 28)), 3),
        "train-labels-idx1-ubyte": _idx(rng.integers(0, 10, n_train), 1),
        "t10k-images-idx3-ubyte": _idx(rng.integers(0, 256, (n_test, 28, 28)), 3),
        "t10k-labels-idx1-ubyte": _idx(rng.integers(0, 10, n_test), 1),
    }
    for name, raw in files.items():
        if gz:
            (path / f"{name}.gz").write_bytes(gzip.compress(raw))
        else:
            (path / name).write_bytes(raw)


@pytest.mark.parametrize("gz", [True, False])
def test_idx_files_gzipped_or_not(tmp_path, gz):
    _write_idx_dir(tmp_path, gz=gz)
    (x, y), (xt, yt) = load_mnist("data-dir", str(tmp_path))
    assert x.shape == (12, 28, 28, 1) and x.dtype == np.float32 and 0 <= x.min() <= x.max() <= 1
    assert y.shape == (12,) and xt.shape == (4, 28, 28, 1) and yt.shape == (4,)


def test_keras_npz(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(
        tmp_path / "mnist.npz",
        x_train=rng.integers(0, 256, (10, 28, 28), dtype=np.uint8),
        y_train=rng.integers(0, 10, 10, dtype=np.uint8),
        x_test=rng.integers(0, 256, (3, 28, 28), dtype=np.uint8),
        y_test=rng.integers(0, 10, 3, dtype=np.uint8),
    )
    (x, _), (xt, _) = load_mnist("data-dir", str(tmp_path))
    assert x.shape == (10, 28, 28, 1) and xt.shape == (3, 28, 28, 1)


def test_embedded_digits_are_real_mnist_with_a_balanced_held_out_split():
    (x, y), (xt, yt) = load_mnist("embedded")
    assert x.shape == (4500, 28, 28, 1) and xt.shape == (500, 28, 28, 1)
    assert np.bincount(yt).tolist() == [50] * 10
    assert 0.1 < x.mean() < 0.2  # real digits: mostly black background


def test_truncated_idx_file_is_a_clear_error(tmp_path):
    _write_idx_dir(tmp_path, gz=False)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(HvdtrainError, match="truncated or damaged"):
        load_mnist("data-dir", str(tmp_path))


@pytest.mark.parametrize(
    "content, match",
    [(b"not an idx file at all", "bad magic number"), (b"\x1f\x8b garbage", "bad magic")],
)
def test_malformed_idx_is_rejected(tmp_path, content, match):
    path = tmp_path / "x-idx3-ubyte"
    path.write_bytes(content)
    with pytest.raises(HvdtrainError, match=match):
        read_idx(str(path))


def test_corrupt_npz_and_missing_files(tmp_path):
    (tmp_path / "mnist.npz").write_bytes(b"PK\x03\x04 this is not a zip")
    with pytest.raises(HvdtrainError, match="not a readable .npz"):
        load_mnist("data-dir", str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(HvdtrainError, match="missing: train-images-idx3-ubyte"):
        load_mnist("data-dir", str(empty))


def test_a_tf_data_pipeline_given_whole_or_batched_is_refused_saying_what_to_pass():
    """MirroredStrategy's fit takes the whole dataset, batched; DatasetData wants a function
    of (rank, size, seed, epoch) giving this rank's samples, unbatched."""
    import tensorflow as tf

    import hvdtrain

    samples = tf.data.Dataset.from_tensor_slices((np.zeros((64, 2), "float32"), np.zeros(64)))
    for given, what in (
        (samples.shuffle(64).batch(8).prefetch(2), "a batched tf.data.Dataset (.batch(8))"),
        ((samples.batch(8), samples.batch(8)), "a batched tf.data.Dataset (.batch(8))"),
        (samples, "a tf.data.Dataset"),
    ):
        with pytest.raises(HvdtrainError) as raised:
            hvdtrain.as_data(given)
        assert str(raised.value).startswith(
            f"Invalid value for `data`: received {what!r}; expected "
            "hvdtrain.DatasetData(make_dataset, num_samples=N), with make_dataset(rank, size, "
            "seed, epoch) returning this rank's samples for one epoch, unbatched"
        ), str(raised.value)

    def batched(rank, size, seed, epoch):
        return samples.shard(size, rank).shuffle(64, seed=seed + epoch).batch(8).prefetch(2)

    data = hvdtrain.DatasetData(batched, num_samples=64)
    with pytest.raises(HvdtrainError, match=r"returned a batched tf.data.Dataset \(.batch\(8\)\); "
                       r"expected this rank's samples for one epoch, unbatched"):  # fmt: skip
        data.train_dataset(8, hvdtrain.Placement(), seed=0, start_step=0, steps=4, epochs=1)
    unbatched = hvdtrain.DatasetData(lambda r, s, seed, e: samples.batch(8).unbatch(), 64)
    ds = unbatched.train_dataset(8, hvdtrain.Placement(), seed=0, start_step=0, steps=4, epochs=1)
    assert [x.shape[0] for x, _ in ds] == [8] * 4
