"""Hostile files a job reads: MNIST's files (IDX, `.npz`), record files, image folders,
checkpoint folders and their manifests, model weights.

Properties (hypothesis), in this process: any file either gives something sane or raises
`HvdtrainError` with a one-line message; nothing else escapes, nothing hangs
(pytest-timeout), nothing is written. Loading is safe by construction: IDX files are parsed
by hand, `.npz` goes through `np.load(allow_pickle=False)`, checkpoints are
`tf.train.Checkpoint` + a JSON manifest (no pickle), and hvdtrain never loads a `.keras` file
(it only exports one; a user's `tf.keras.models.load_model` keeps Keras' safe_mode on by
default). Cases, as real processes (`CASES`, tests/helpers/hostile.py): exit 2 with one error
line, no traceback, nothing written outside the folders named, within a bound.
"""

import gzip
import io
import json
import os
import shutil

import numpy as np
import pytest
from helpers.hostile import (
    BOUND,
    IMAGES,
    KERAS3,
    MNIST,
    check_case,
    folder,
    ids,
    manifest,
    one_line,
    write,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hvdtrain.data.mnist import load_mnist, read_idx
from hvdtrain.errors import HvdtrainError

pytestmark = pytest.mark.timeout(120)
SLOW_OK = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]


def fresh(tmp_path_factory, name):
    return tmp_path_factory.mktemp(name)


# -- MNIST files -----------------------------------------------------------------------


def idx_bytes(ndim, dims, data_len, magic_type=0x08):
    header = bytes([0, 0, magic_type, ndim]) + b"".join(d.to_bytes(4, "big") for d in dims)
    return header + bytes(data_len)


IDX = st.one_of(
    st.binary(max_size=300),
    st.builds(
        idx_bytes,
        st.sampled_from([0, 1, 2, 3, 4]),
        st.lists(st.sampled_from([0, 1, 2, 4, 28, 2**31, 2**32 - 1]), max_size=4),
        st.integers(0, 2000),
        st.sampled_from([0x08, 0x08, 0x09, 0x0D]),
    ),
)


def gzipped(data, damage):
    raw = gzip.compress(data)
    if damage:  # keep the gzip header, garble the deflate stream or cut it short
        cut = len(raw) * damage // 4
        raw = raw[:10] + bytes(b ^ 0x5A for b in raw[10:cut]) + raw[cut:]
    return raw


@settings(max_examples=300, deadline=None)
@given(data=IDX, gz=st.booleans(), damage=st.integers(0, 3))
@example(data=idx_bytes(3, [2**31, 2**31, 4], 0), gz=False, damage=0)  # 2**64 wraps to 0
@example(data=idx_bytes(3, [2, 28, 28], 2 * 28 * 28), gz=True, damage=2)
@example(data=idx_bytes(3, [0, 0x8103091C, 0xFDFDFDFD], 0), gz=False, damage=0)  # found on 3.12
def test_read_idx(tmp_path_factory, data, gz, damage):
    path = fresh(tmp_path_factory, "idx") / ("f.idx.gz" if gz else "f.idx")
    path.write_bytes(gzipped(data, damage) if gz else data)
    try:
        array = read_idx(str(path))
    except HvdtrainError as e:
        one_line(e)
        return
    assert array.dtype == np.uint8 and array.ndim in (1, 3)


def npz_bytes(arrays):
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def full(dtype, shape, fill):
    with np.errstate(invalid="ignore"):  # nan cast to an integer type: any value will do
        return np.full(shape, fill).astype(dtype)


ARRAY = st.builds(
    full,
    st.sampled_from(["uint8", "int64", "int8", "float32", "float64", "bool", "<U2", "complex64"]),
    st.sampled_from([(0,), (3,), (3, 28, 28), (2, 28, 28), (3, 28), (3, 28, 28, 1), ()]),
    st.sampled_from([0, 3, 9, 10, -1, 0.5, 255, 300, float("nan")]),
)


def npy_bytes(array):
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


PREFIXES = [b"", b"PK\x03\x04", b"\x93NUMPY\x01\x00", b"\x1f\x8b\x08"]
NPZ = st.one_of(
    st.tuples(st.sampled_from(PREFIXES), st.binary(max_size=300)).map(b"".join),
    st.dictionaries(
        st.sampled_from(["x_train", "y_train", "x_test", "y_test", "other"]), ARRAY, max_size=5
    ).map(npz_bytes),
    ARRAY.map(npy_bytes),  # a plain .npy named mnist.npz
)


@settings(max_examples=300, deadline=None, suppress_health_check=SLOW_OK)
@given(NPZ)
@example(npy_bytes(np.zeros((2, 28, 28), np.uint8)))
def test_load_mnist_npz(tmp_path_factory, blob):
    folder = fresh(tmp_path_factory, "npz")
    (folder / "mnist.npz").write_bytes(blob)
    check_mnist(folder)


def check_mnist(folder):
    before = sorted(os.listdir(folder))
    try:
        (x, y), (xt, yt) = load_mnist("data-dir", str(folder))
    except HvdtrainError as e:
        one_line(e)
    else:
        for images, labels in ((x, y), (xt, yt)):
            assert images.dtype == np.float32 and images.shape[1:] == (28, 28, 1)
            assert labels.dtype == np.int32 and len(labels) == len(images)
            assert np.all((images >= 0) & (images <= 1)), "images outside [0, 1]"
            assert np.all((labels >= 0) & (labels <= 9))
    assert sorted(os.listdir(folder)) == before  # nothing written


IDX_NAMES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
             "t10k-labels-idx1-ubyte"]  # fmt: skip


@settings(max_examples=100, deadline=None, suppress_health_check=SLOW_OK)
@given(st.lists(st.one_of(IDX, st.builds(idx_bytes, st.just(1), st.just([2]), st.just(2))),
                min_size=4, max_size=4), st.booleans())  # fmt: skip
def test_load_mnist_idx_folder(tmp_path_factory, files, gz):
    folder = fresh(tmp_path_factory, "idxdir")
    for name, data in zip(IDX_NAMES, files, strict=True):
        if gz:
            (folder / f"{name}.gz").write_bytes(gzip.compress(data))
        else:
            (folder / name).write_bytes(data)
    check_mnist(folder)


def test_good_idx_folder_still_loads(tmp_path):
    rng = np.random.default_rng(0)
    for name, n, image in zip(IDX_NAMES, (6, 6, 4, 4), (True, False, True, False), strict=True):
        dims = [n, 28, 28] if image else [n]
        data = rng.integers(0, 256 if image else 10, size=dims, dtype=np.uint8)
        (tmp_path / name).write_bytes(idx_bytes(len(dims), dims, 0) + data.tobytes())
    (x, y), (xt, yt) = load_mnist("data-dir", str(tmp_path))
    assert x.shape == (6, 28, 28, 1) and yt.shape == (4,)


def test_npz_with_pickled_objects_is_refused(tmp_path):
    """allow_pickle=False: an object array (a pickle inside the .npz) is never loaded."""
    arrays = {k: np.array([{"a": 1}], dtype=object) for k in ("x_train", "y_train")}
    np.savez(tmp_path / "mnist.npz", x_test=np.zeros((1, 28, 28)), y_test=np.zeros(1), **arrays)
    with pytest.raises(HvdtrainError, match="Invalid MNIST file .*pickle"):
        load_mnist("data-dir", str(tmp_path))


# -- checkpoints -----------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
FILE_NAMES = st.sampled_from(
    ["state.index", "../escape", "/dev/zero", "/etc/hostname", ".", "", "fifo", "sub/x", "a\x00"]
)


def manifest_strategy():
    entry = st.one_of(
        st.tuples(st.integers(-1, 100), st.text("0123456789abcdef", max_size=64)).map(list),
        JSON,
    )
    crafted = st.fixed_dictionaries(
        {"files": st.one_of(st.dictionaries(FILE_NAMES, entry, max_size=3), JSON)},
        optional={"epoch": JSON | st.integers(), "fingerprint": JSON, "format": JSON},
    )
    return st.one_of(
        st.binary(max_size=200),
        JSON.map(lambda v: json.dumps(v).encode()),
        crafted.map(lambda v: json.dumps(v).encode()),
        st.just(b"[" * 100_000),  # nesting deeper than json's recursion limit
    )


def make_checkpoint_dir(root, manifest, extra):
    ckpt = root / "ckpt" / "epoch-0001"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_bytes(manifest)
    (ckpt / "state.index").write_bytes(extra)
    os.mkfifo(ckpt / "fifo")  # reading it would block forever
    (root / "ckpt" / "epoch-bad").mkdir()
    (root / "ckpt" / "epoch-0002").write_bytes(b"a file, not a folder")
    return root / "ckpt"


def snapshot(folder):
    return sorted(
        (os.path.relpath(os.path.join(d, f), folder), os.lstat(os.path.join(d, f)).st_size)
        for d, _, files in os.walk(folder)
        for f in files
    )


def test_a_record_file_that_cannot_be_read_is_one_line_that_says_why(tmp_path):
    """Counting a file's records: a GZIP TFRecord file read as plain says to pass
    `compression="GZIP"` (and counts with it), a file that is not TFRecord names the record
    TensorFlow stopped at; neither carries TensorFlow's function and op names."""
    import tensorflow as tf

    from hvdtrain.data.files import count_records

    packed = str(tmp_path / "train-0.tfrecord")
    with tf.io.TFRecordWriter(packed, options="GZIP") as w:
        for i in range(3):
            w.write(tf.train.Example().SerializeToString() + bytes([i]))
    garbage = tmp_path / "train-1.tfrecord"
    garbage.write_bytes(b"not a TFRecord file at all")
    with pytest.raises(HvdtrainError) as gz:
        count_records([packed])
    with pytest.raises(HvdtrainError) as junk:
        count_records([str(garbage)])
    assert str(gz.value).startswith(f"Invalid data file {packed}: cannot read it (")
    assert 'it is GZIP-compressed: pass compression="GZIP"' in str(gz.value)
    assert "corrupted record at 0" in str(junk.value) and "GZIP" not in str(junk.value)
    for said in (str(gz.value), str(junk.value)):
        one_line(said)
        assert "function_node" not in said and "[Op:" not in said and "name:" not in said, said
    assert count_records([packed], compression="GZIP") == [3]


@settings(max_examples=200, deadline=None, suppress_health_check=SLOW_OK)
@given(manifest=manifest_strategy(), extra=st.binary(max_size=50))
@example(manifest=json.dumps({"epoch": 1, "files": {"/dev/zero": [0, ""]}}).encode(), extra=b"")
@example(manifest=json.dumps({"epoch": 1, "files": {"fifo": [0, ""]}}).encode(), extra=b"")
@example(manifest=json.dumps({"epoch": 1, "files": []}).encode(), extra=b"")
@example(manifest=json.dumps({"files": {}}).encode(), extra=b"")
@example(manifest=b"[" * 100_000, extra=b"")
def test_checkpoint_latest(tmp_path_factory, manifest, extra):
    from hvdtrain.recipe.checkpoint import CheckpointManager

    root = fresh(tmp_path_factory, "ckpt")
    folder = make_checkpoint_dir(root, manifest, extra)
    os.mkfifo(folder / "epoch-0003")  # not a folder either
    before = snapshot(root)
    try:
        found = CheckpointManager(str(folder), None, None).latest()
    except HvdtrainError as e:
        one_line(e)
        found = None
    if found is not None:  # only a checkpoint whose every file checks out
        path, files = found.path, found.files
        assert found.epoch == 1 and isinstance(files, dict)
        assert files and all(os.path.isfile(os.path.join(path, n)) for n in files)
        assert all(os.path.dirname(n) == "" and n not in (".", "..") for n in files)
    assert snapshot(root) == before  # latest() writes nothing


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real checkpoint of a tiny Keras model, and a manager of the same model."""
    import tensorflow as tf

    from hvdtrain.recipe.checkpoint import CheckpointManager

    def build():
        model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(2)])
        optimizer = tf.keras.optimizers.Adam(0.01)
        optimizer.build(model.trainable_variables)
        return model, optimizer

    folder = tmp_path_factory.mktemp("real") / "ckpt"
    CheckpointManager(str(folder), *build()).save(1)
    return folder, CheckpointManager(str(folder), *build())


@settings(max_examples=25, deadline=None, suppress_health_check=SLOW_OK)
@given(
    fields=st.dictionaries(st.sampled_from(["epoch", "fingerprint", "format", "logs"]), JSON),
    drop=st.sampled_from([None, "epoch", "fingerprint"]),
    garble=st.sampled_from([None, "state.index", "state.data-00000-of-00001"]),
)
@example(fields={"fingerprint": [["Dense", [[3, 5], [5]]]]}, drop=None, garble=None)
@example(fields={"epoch": "one"}, drop=None, garble=None)
def test_checkpoint_restore(saved, tmp_path_factory, fields, drop, garble):
    """Manifest fields rewritten (with the file digests kept right, as an attacker would)
    or a state file replaced: restoring gives the checkpoint or one HvdtrainError."""
    from hvdtrain.recipe.checkpoint import CheckpointManager, _sha256

    original, manager = saved
    folder = fresh(tmp_path_factory, "restore") / "ckpt"
    shutil.copytree(original, folder)
    path = folder / "epoch-0001"
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.update(fields)
    if drop:
        manifest.pop(drop, None)
    if garble:
        (path / garble).write_bytes(b"\x00garbage" * 8)
        manifest["files"][garble] = [os.path.getsize(path / garble), _sha256(path / garble)]
    (path / "manifest.json").write_text(json.dumps(manifest))
    mine = CheckpointManager(str(folder), manager.model, manager.optimizer)
    try:
        found = mine.latest()
        if found is not None:
            assert mine.restore(found).epoch == 1
    except HvdtrainError as e:
        one_line(e)


# -- real processes --------------------------------------------------------------------

IDX_IMAGES = gzip.compress(b"\x00\x00\x08\x03" + (5).to_bytes(4, "big") + b"\x00" * 8)

CASES = [
    # -- data files
    ("data-dir-missing", MNIST + ["--data-dir", "{d}/none"], {}, [], 2, "an existing folder", []),
    ("data-idx-truncated", MNIST + ["--data-dir", "{d}/mnist"], {},
     [write("mnist/train-images-idx3-ubyte.gz", IDX_IMAGES)], 2, "--data-dir", []),
    ("data-npz-garbage", MNIST + ["--data-dir", "{d}/mnist"], {},
     [write("mnist/mnist.npz", b"PK\x03\x04 not a zip")], 2, "mnist.npz", []),
    ("images-empty", IMAGES + ["--data-dir", "{d}/imgs"], {}, [folder("imgs")], 2,
     "--data-dir", []),
    # -- checkpoint manifests
    ("manifest-format", MNIST + ["--checkpoint-dir", "{d}/ck"], {},
     [manifest("ck/epoch-0001", format=99)], 2, "it has format 99", ["ck"]),
    ("manifest-damaged-required", MNIST + ["--checkpoint-dir", "{d}/ck", "--require-resume"],
     {}, [write("ck/epoch-0002/manifest.json", "{broken"), manifest("ck/epoch-0007")], 2,
     "2 checkpoint folder(s)", ["ck"]),
    ("ckpt-dir-is-file", MNIST + ["--checkpoint-dir", "{d}/f"], {}, [write("f", "x")], 2,
     "`--checkpoint-dir`", []),
    ("keras3-manifest-format", KERAS3 + ["--checkpoint-dir", "{d}/ck"], {},
     [manifest("ck/epoch-0001", format=99)], 2, "it has format 99", ["ck"]),
    ("keras3-manifest-damaged-required", KERAS3 + ["--checkpoint-dir", "{d}/ck",
     "--require-resume"], {}, [write("ck/epoch-0002/manifest.json", "{broken")], 2,
     "1 checkpoint folder(s)", ["ck"]),
    # -- model files
    ("weights-garbage", IMAGES + ["--data-dir", "{d}/imgs", "--weights", "{d}/w.h5"], {},
     [write("imgs/a/1.png", b"x"), write("imgs/b/1.png", b"x"), write("w.h5", b"garbage")], 2,
     "--weights", []),
    ("weights-missing", IMAGES + ["--data-dir", "{d}/imgs", "--weights", "{d}/none.h5"], {},
     [folder("imgs/a"), folder("imgs/b")], 2, "--weights", []),
    ("keras3-weights-garbage", IMAGES + ["--data-dir", "{d}/imgs", "--weights", "{d}/w.h5",
     "--keras", "3"], {}, [write("imgs/a/1.png", b"x"), write("imgs/b/1.png", b"x"),
     write("w.h5", b"garbage")], 2, "--weights", []),
]  # fmt: skip


@pytest.mark.timeout(BOUND * 2)
@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_hostile_input(tmp_path, case):
    check_case(tmp_path, case)
