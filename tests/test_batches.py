"""Batches made in Python through `hvdtrain.fit` (issue 48): a Keras 3 `PyDataset`, a Keras 2
`Sequence` (ImageDataGenerator's `flow` and `flow_from_directory`), generators. In this
process: which batches a rank loads (the building blocks, as rank 0 and rank 1 of 2), the
hooks, resume, loader workers, the mistakes. On 2 real ranks (tests/workers/python_data.py in
the module's shared job): every form trains, each batch loaded by one rank, the test set
exact. Bitwise resume after a kill: tests/test_recipe.py (`batches`); every other setting:
tests/test_settings_matrix.py (`batches`)."""

import json
import re
import subprocess
import sys
import traceback

import numpy as np
import pytest
import tensorflow as tf
from conftest import BIN, job_env, run_job, worker
from helpers.image_folders import class_folders

import hvdtrain
from hvdtrain.data import Placement
from hvdtrain.data.batches import BatchData
from hvdtrain.errors import HvdtrainError

WORKER = worker("python_data.py")


@pytest.fixture(scope="module", autouse=True)
def _one_rank():
    hvdtrain.init(threads=1)


def _keras(version):
    if version == "3":
        import keras

        return keras
    return tf.keras


def sequence(n=10, batch=4, base=None, **kwargs):
    """A Sequence of `n` samples whose x is the sample's id (and noise from np.random)."""
    base = base or tf.keras.utils.Sequence

    class Ids(base):
        def __init__(self):
            super().__init__(**kwargs)
            self.ends, self.begins, self.loaded = 0, 0, []

        def __len__(self):
            return -(-n // batch)

        def __getitem__(self, i):
            self.loaded.append(i)
            ids = np.arange(i * batch, min(n, (i + 1) * batch))
            noise = np.random.uniform(0, 0.1, len(ids))
            return np.stack([ids, noise], 1).astype("float32"), ids.astype("float32")

        def on_epoch_begin(self):
            self.begins += 1

        def on_epoch_end(self):
            self.ends += 1

    return Ids()


def ids_of(dataset, steps):
    return [[int(v) for v in y.numpy()] for _, y in dataset.take(steps)]


def prepared(data, rank=0, size=2, seed=0):
    place = Placement(rank, size)
    data.prepare(place, seed)
    return data, place


# -- which batches a rank loads -----------------------------------------------------------
def test_ranks_take_disjoint_batches_in_an_order_drawn_each_epoch_the_same_on_every_rank():
    """22 samples in batches of 4: 5 full batches and a short one; 2 ranks take 2 each."""
    orders = {}
    for rank in (0, 1):
        data, place = prepared(BatchData(sequence(22)), rank)
        assert data.batch_size == 4 and data.steps_per_epoch(4, place) == 2
        orders[rank] = [data.order(e, 0, place) for e in range(3)]
        assert data.num_samples == 22 and "2 left out each epoch" in data.describe()
    for epoch in range(3):
        a, b = orders[0][epoch], orders[1][epoch]
        assert len(a) == len(b) == 2 and not set(a) & set(b) and set(a + b) <= set(range(5))
    assert len({tuple(o[0] + o[1]) for o in zip(*orders.values(), strict=True)}) > 1  # shuffled
    plain, place = prepared(BatchData(sequence(22), shuffle=False), 1)
    assert plain.order(0, 0, place) == plain.order(1, 0, place) == [1, 3]


def test_balanced_shares_of_indexed_batches_load_each_batch_once_an_epoch():
    """`--sync-balance` (`BatchData.train_share`): unequal runs of an epoch's order over all
    ranks load each of its full batches once, call the epoch's hooks once per share, and
    draw another order the next epoch; a generator's batches are not shared out."""
    seq = sequence(42)  # 10 full batches of 4 and a short one
    data, _ = prepared(BatchData(seq), 0)
    assert data.shares

    def ids(epoch, first, steps):
        return [v for b in ids_of(data.train_share(4, seed=3, epoch=epoch, first=first,
                                                   steps=steps), steps) for v in b]  # fmt: skip

    epoch0 = ids(0, 0, 7) + ids(0, 7, 3)
    assert sorted(epoch0) == list(range(40))  # each full batch's samples once
    assert seq.begins == seq.ends == 2
    assert ids(0, 7, 3) == epoch0[28:]  # a share is a run of the epoch's order
    assert ids(1, 0, 10) != epoch0
    assert not BatchData(lambda: iter([])).shares


@pytest.mark.parametrize("version", ["2", "3"])
def test_a_rank_loads_only_its_batches_calls_the_hooks_and_resumes_mid_epoch(version):
    base = tf.keras.utils.Sequence if version == "2" else _keras("3").utils.PyDataset
    seq = sequence(22, base=base)
    data, place = prepared(BatchData(seq), 1)
    seq.loaded.clear()
    ds = data.train_dataset(4, place, seed=0, start_step=0, steps=2, epochs=3)
    seen = ids_of(ds, 6)
    expected = [data.order(e, 0, place) for e in range(3)]
    assert seen == [list(range(4 * i, 4 * i + 4)) for o in expected for i in o]
    assert seq.loaded == [i for o in expected for i in o]  # nothing else loaded
    assert seq.ends == 3 and (version == "2" or seq.begins == 3)
    # Resumed at global step 3 (epoch 2, step 1) in a new process: the same batches on.
    again = sequence(22, base=base)
    data, place = prepared(BatchData(again), 1)
    ds = data.train_dataset(4, place, seed=0, start_step=3, steps=2, epochs=3)
    assert ids_of(ds, 3) == seen[3:] and again.ends == 3  # the one before epoch 2, once


def test_augmentation_from_np_random_is_the_same_again_and_drawn_per_batch():
    def noise(start_step, **loading):
        data, place = prepared(BatchData(sequence(40), **loading), 0)
        ds = data.train_dataset(4, place, seed=3, start_step=start_step, steps=5, epochs=2)
        return [x.numpy()[:, 1].tolist() for x, _ in ds]

    whole = noise(0)
    assert noise(7) == whole[7:]  # a resume draws what the uninterrupted run drew
    assert noise(0, workers=2, use_multiprocessing=True) == whole  # processes: seeded alike
    assert len({tuple(n) for n in whole}) == len(whole)


@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_loader_workers_load_the_same_batches_in_order(processes):
    data, place = prepared(BatchData(sequence(200, 4), workers=2, use_multiprocessing=processes,
                                     max_queue_size=3), 0)  # fmt: skip
    plain, _ = prepared(BatchData(sequence(200, 4)), 0)
    ds = data.train_dataset(4, place, seed=0, start_step=0, steps=25, epochs=2)
    ref = plain.train_dataset(4, place, seed=0, start_step=0, steps=25, epochs=2)
    assert ids_of(ds, 50) == ids_of(ref, 50)
    crowded = data.loader_warning(Placement(0, 64, 0, 64))
    assert "64 rank(s) of this host run 128 loader" in crowded and "\n" not in crowded
    assert data.loader_warning(Placement(0, 1, 0, 1)) is None


def test_imagedatagenerator_iterators_shuffle_their_samples_alike_on_every_rank():
    """Its `flow` shuffles its samples with np.random in `on_epoch_end` and at the first batch:
    each rank's own seed would give each rank another order, and the ranks' batches would
    overlap."""
    from tensorflow.keras.preprocessing.image import ImageDataGenerator

    x = np.zeros((40, 2, 2, 1), "float32")
    loaded = {0: [], 1: []}
    for rank in (0, 1):
        np.random.seed(100 + rank)  # as hvdtrain seeds each rank
        flow = ImageDataGenerator().flow(x, np.arange(40), batch_size=4, shuffle=True)
        data, place = prepared(BatchData(flow), rank)
        ds = data.train_dataset(4, place, seed=0, start_step=0, steps=5, epochs=2)
        loaded[rank] = [sorted(y) for y in ids_of(ds, 10)]
    for epoch in (slice(0, 5), slice(5, 10)):
        ids = sum(loaded[0][epoch] + loaded[1][epoch], [])
        assert sorted(ids) == list(range(40))  # each sample once in the epoch
    assert loaded[0][:5] != loaded[0][5:]


# -- generators ---------------------------------------------------------------------------
def _batches(n, rank=0, size=1, start=0):
    for i in range(start + rank * 4, start + n, 4 * size):
        yield np.arange(i, i + 4, dtype="float32")[:, None], np.arange(i, i + 4)


def test_generator_functions_are_counted_and_sharded_or_shard_themselves():
    data, place = prepared(BatchData(lambda: _batches(40)), 1)  # each rank every 2nd batch
    assert data._steps == 5 and "counted" in data.describe()
    ds = data.train_dataset(4, place, seed=0, start_step=0, steps=5, epochs=2)
    assert [b[0] for b in ids_of(ds, 10)] == [4, 12, 20, 28, 36] * 2
    own, place = prepared(BatchData(lambda rank, size: _batches(40, rank, size)), 1)
    ds = own.train_dataset(4, place, seed=0, start_step=2, steps=5, epochs=1)
    assert [b[0] for b in ids_of(ds, 3)] == [20, 28, 36]  # resumed at step 2


def test_a_generator_object_is_one_stream_over_the_epochs():
    def endless():
        start = 0
        while True:
            yield from _batches(40, start=start)
            start += 40

    data, place = prepared(BatchData(endless(), steps_per_epoch=3), 1)
    ds = data.train_dataset(4, place, seed=0, start_step=2, steps=3, epochs=2)
    # Rank 1 of 2 takes the odd batches: steps 2 to 5 are batches 5, 7, 9 and 11 of it.
    assert [b[0] for b in ids_of(ds, 5)] == [20, 28, 36, 44]
    with pytest.raises(HvdtrainError, match="generator object.*steps_per_epoch=N"):
        hvdtrain.fit(lambda: _model(tf.keras, 1), endless())


# -- through hvdtrain.fit, each Keras -----------------------------------------------------
def _model(k, inputs=2):
    model = k.Sequential([k.Input((inputs,)), k.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    return model


@pytest.mark.parametrize("version", ["2", "3"])
def test_fit_takes_the_object_unchanged_with_its_test_set(version):
    k = _keras(version)
    base = tf.keras.utils.Sequence if version == "2" else k.utils.PyDataset
    train, test = sequence(22, base=base), sequence(11, 3, base=base)
    out = hvdtrain.fit(lambda: _model(k), (train, test), epochs=2)
    assert out["batch_size"] == 4 and out["steps_per_epoch"] == 5
    assert out["samples_per_epoch"] == 20 and out["train_samples"] == 22
    assert out["test_samples"] == 11 and train.ends == 2  # the test set's short batch counted

    def batches():
        yield from _batches(24)

    for gen in (batches, lambda: _batches(24)):  # a generator function, or one returned
        out = hvdtrain.fit(lambda: _model(k, 1), gen, epochs=1)
        assert out["steps_per_epoch"] == 6 and out["data_source"] == "generator"


BAD = {  # what the data does wrong -> words the one line must hold
    "raises": ("Ids[3] raised KeyError: 'no file' in __getitem__ (test_batches.py:", None),
    "shape": ("Ids[3] is", "give every batch the same dtypes and shapes"),
    "dtype": ("float64", "give every batch the same dtypes and shapes"),
    "structure": ("Ids[3]: expected a tuple (x,), (x, y)", "received a tuple of 4"),
    "empty": ("Ids is empty", None),
    "not-a-batch": ("Ids[0]: expected a tuple (x,), (x, y)", None),
}


@pytest.mark.parametrize("version", ["2", "3"])
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_batches_are_one_line_naming_the_batch(case, version):
    k = _keras(version)
    base = tf.keras.utils.Sequence if version == "2" else k.utils.PyDataset

    class Ids(base):
        def __len__(self):
            return 0 if case == "empty" else 6

        def __getitem__(self, i):
            x, y = np.ones((4, 2), "float32"), np.zeros(4, "float32")
            if case == "not-a-batch":
                return "x"
            if i == 3 and case == "raises":
                raise KeyError("no file")
            if i == 3 and case == "shape":
                x = x[:, :1]
            if i == 3 and case == "dtype":
                x = x.astype("float64")
            if i == 3 and case == "structure":
                return x, y, y, y
            return x, y

    with pytest.raises(HvdtrainError) as e:
        hvdtrain.fit(lambda: _model(k), Ids(), epochs=1)
    first, fix = BAD[case]
    assert first in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert fix is None or fix in str(e.value)


@pytest.mark.parametrize("version", ["2", "3"])
def test_a_bug_in_your_getitem_is_itself_naming_the_batch_and_your_line(version):
    """A typo in `__getitem__` (batch 3, read while training) is not a one-line user error:
    the NameError itself comes out of `fit`, with its traceback, marked with the batch and
    the place, for the hook of uncaught errors (exit 1, its traceback once per host)."""
    k = _keras(version)
    base = tf.keras.utils.Sequence if version == "2" else k.utils.PyDataset

    class Ids(base):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            x = np.ones((4, 2), "float32") * (scale if i == 3 else 1)  # noqa: F821
            return x, np.zeros(4, "float32")

    with pytest.raises(NameError) as e:
        hvdtrain.fit(lambda: _model(k), Ids(), epochs=1)
    assert e.value.hvdtrain_what == "Ids[3]"
    assert e.value.hvdtrain_where.startswith("__getitem__ (test_batches.py:")
    assert any(f.name == "__getitem__" for f in traceback.extract_tb(e.value.__traceback__))


def test_a_generators_batch_is_named_in_its_own_count():
    """Rank 1 of 2 takes every 2nd batch of a generator of (): the generator's batch 21 (the
    rank's 11th) is named 21, as the user counts what the generator yields; a wrong shape
    too."""

    def typo():
        for i, batch in enumerate(_batches(200)):
            if i == 21:
                raise TypeError("a bug of mine")
            yield batch

    with pytest.raises(TypeError) as e:
        prepared(BatchData(typo), 1)
    assert e.value.hvdtrain_what == "typo's batch 21"

    def shape():
        for i, (x, y) in enumerate(_batches(200)):
            yield (np.ones((4, 2), "float32") if i == 21 else x), y

    with pytest.raises(HvdtrainError, match=r"^shape's batch 21 is"):
        prepared(BatchData(shape), 1)


def test_a_generator_that_ends_early_says_how_many_batches_the_epoch_needs():
    calls = []

    def shorter():  # 6 batches the first time (counted), 3 after
        calls.append(1)
        yield from _batches(24 if len(calls) == 1 else 12)

    with pytest.raises(HvdtrainError, match=r"gave 3 batch\(es\) in epoch 1 where the epoch "
                                            r"needs 6; make it yield at least 6"):  # fmt: skip
        hvdtrain.fit(lambda: _model(tf.keras, 1), shorter, epochs=1)


# -- on 2 real ranks ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Small JPEGs in class folders: 80 to train, 22 to test."""
    return class_folders(tmp_path_factory.mktemp("images"), {"train": 40, "test": 11})


def _loads(out, rank):
    """{(split, epoch): [what the rank loaded]} from the worker's record."""
    found = {}
    for line in (out / f"loads-{rank}.txt").read_text().splitlines():
        split, epoch, item = line.split(" ", 2)
        found.setdefault((split, int(epoch)), []).append(item)
    return found


FORMS = {  # the worker's flags -> (Keras, batches per rank and epoch, test samples)
    "pydataset-threads": (["--form", "pydataset", "--workers", "2"], 15, 301),
    "pydataset-processes": (["--form", "pydataset", "--workers", "2", "--processes"], 15, 301),
    "images": (["--form", "images"], 5, 22),
    "sharded-generator": (["--form", "sharded"], 15, 301),
    "generator-object": (["--form", "object"], 15, 301),
}


@pytest.mark.parametrize("form", FORMS)
def test_each_form_trains_on_two_ranks_each_batch_loaded_once(form, images, shared_jobs, tmp_path):
    flags, steps, tested = FORMS[form]
    out = tmp_path / "out"
    shared_jobs.get(2, "gloo").run_script(
        [WORKER, out, *flags, "--images", images, "--epochs", "2"]
    )
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert len({d for r in ranks for d in (x["weights_digest"] for x in r["ranks"])}) == 1
    assert ranks[0]["steps_per_epoch"] == steps and ranks[0]["test_samples"] == tested
    loads = [_loads(out, r) for r in range(2)]
    if form == "generator-object":  # every rank reads the one stream, takes its share
        return
    if form == "sharded-generator":  # no epochs in its record: what each rank read, ever
        mine = [{i for (split, _), items in load.items() if split == "train" for i in items}
                for load in loads]  # fmt: skip
        assert not mine[0] & mine[1] and len(mine[0] | mine[1]) >= 2 * steps
        return
    for epoch in (0, 1):
        mine = [loads[r].get(("train", epoch), []) for r in range(2)]
        if epoch == 0:  # the first and last batch are read on every rank to know them
            mine = [m[16:] if form == "images" else m[2:] for m in mine]
        assert not set(mine[0]) & set(mine[1]), (epoch, mine)
        per_batch = 8 if form == "images" else 1
        assert len(mine[0]) == len(mine[1]) == steps * per_batch, (epoch, mine)


def test_ranks_that_build_different_data_stop_together_in_one_line(shared_jobs, tmp_path):
    """The same `HvdtrainError` on every rank (a script prints it as one line, exit 2)."""
    replies = shared_jobs.get(2, "gloo").run(
        "python_data:main", argv=[tmp_path, "--form", "sequence", "--bad", "length"], check=False
    )
    words = "the ranks' Batches have different lengths (rank 0: 31, rank 1: 30 batches)"
    for reply in replies:
        assert reply["error"].startswith(f"HvdtrainError: {words}"), reply
        assert "\n" not in reply["error"]


@pytest.mark.timeout(180)
def test_a_batch_that_fails_on_one_rank_mid_epoch_ends_the_job_in_one_line(tmp_path):
    """Batch 7 raises on the rank that loads it while the other waits in the allreduce: no
    hang, exit 2."""
    proc = run_job(2, "mpi", [WORKER, tmp_path, "--form", "sequence", "--bad", "raises"],
                   check=False, timeout=150)  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    assert "Traceback" not in text
    assert "Batches[7] raised KeyError: 'no image for batch 7'" in text


AGREED = {  # a mistake every rank meets before training -> its flags, status, the one line's
    # words for the status (a pattern: a user error's are its own error line's)
    "typo": (["--form", "sequence", "--bad", "typo"], 1, "an error in the program"),
    "shape": (["--form", "generator", "--bad", "shape"], 2, r".*'s batch \d+ is .*float32.*"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
@pytest.mark.parametrize("case", sorted(AGREED))
def test_a_mistake_in_your_data_under_hvdtrain_run_names_its_line_and_no_innocent_rank(
    case, backend, tmp_path
):
    """A typo in `__getitem__` on batch 0, read by every rank: the line of the typo, its
    traceback once; a generator's wrong shape: one line naming the batch in the generator's
    own count. Open MPI's banners are left out, and hvdtrain-run's last line names a rank
    that printed the error the user reads, or says every rank failed alike."""
    flags, code, meaning = AGREED[case]
    proc = subprocess.run(
        [f"{BIN}/hvdtrain-run", "--backend", backend, "-np", "2", "--", sys.executable, WORKER,
         tmp_path, "--epochs", "1", *flags],
        capture_output=True, text=True, timeout=240, env=job_env(),
    )  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode == code, text[-4000:]
    assert "Primary job" not in text and "mpirun detected" not in text, text[-4000:]
    last = proc.stderr.strip().splitlines()[-1]
    named = re.fullmatch(
        rf"hvdtrain-run: (?:every rank failed alike|rank ([01]) on host \S+ failed first): exit "
        rf"status {code} \({meaning}\); the job was ended",
        last,
    )
    assert named, text[-4000:]
    if case == "typo":
        assert text.count("the error below was raised in your code: __getitem__ "
                          "(python_data.py:") == 1, text[-4000:]  # fmt: skip
        assert text.count("Traceback (most recent call last):") == 1, text[-4000:]
        failed = (
            r"hvdtrain: rank ([01]) failed: Batches\[0\] raised NameError: name "
            r"'scale_factor' is not defined in __getitem__ \(python_data.py:\d+\)"
        )
        ranks = set(re.findall(failed, text))
        assert ranks and (named.group(1) is None or named.group(1) in ranks), text[-4000:]
    else:
        assert "Traceback" not in text, text[-4000:]
        assert "python_data.py: error: rank 1: <lambda>'s batch 3 is ('float32[32, 4]'" in text
        assert named.group(1) in (None, "0"), last  # rank 0 printed it


def test_keras_prints_its_set_up_lines_on_rank_0_only(images, shared_jobs, tmp_path):
    """`flow_from_directory` built in a generator function that hvdtrain calls prints
    `Found 80 images belonging to 2 classes.` on rank 0 alone."""
    proc = shared_jobs.get(2, "gloo").run_script(
        [WORKER, tmp_path, "--form", "images-function", "--images", images, "--epochs", "1"]
    )
    found = [line for line in proc.stdout.splitlines() if "Found 80 images" in line]
    assert found and all(line.startswith("[0]") for line in found), proc.stdout[-4000:]


@pytest.mark.parametrize("version", ["2", "3"])
def test_a_rank_without_a_test_batch_evaluates_nothing_and_waits_for_the_others(version):
    """A test set of one batch on 2 ranks: rank 1's share is empty (Keras raised "Expected
    input data to be non-empty" there, and rank 0 waited for it in the sum of the metrics)."""
    data, place = prepared(BatchData(sequence(22), test=sequence(3)), 1)
    empty = data.eval_dataset(4, place)
    assert int(empty.cardinality()) == 0
    out = hvdtrain.evaluate(_model(_keras(version)), empty)
    assert out["samples"] == 0
