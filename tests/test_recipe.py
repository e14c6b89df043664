"""`hvdtrain.fit` with a user's own model and data, on the public API alone: the script is
tests/workers/recipe.py (BatchNorm, dropout, a sigmoid output; arrays, TFRecord files, a
tf.data pipeline), run as `horovodrun -np 2` under Gloo and MPI.

- kill rank 1 mid-epoch, run the same command again: bitwise the weights of an
  uninterrupted run, for arrays, TFRecord files and a Keras `Sequence` / `PyDataset` with
  augmentation drawn from np.random, on both Keras; also between two exchanges of weights
  under `--sync local` and `--sync diloco`;
- every record read exactly once per epoch across the ranks, equal steps, with files of
  uneven sizes: shared files and per-host files; a resume mid-epoch reads the same records;
- a user script's mistakes: one line, exit 2, no traceback.
"""

import importlib.util
import json
import os
import socket

import pytest
from conftest import ours, run_job, worker

RECIPE = worker("recipe.py")
_spec = importlib.util.spec_from_file_location("recipe", RECIPE)
recipe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recipe)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The worker's 600 training and 101 test samples as TFRecord files of uneven sizes."""
    folder = tmp_path_factory.mktemp("tfrecord")
    recipe.write_tfrecords(str(folder), "train", [50, 130, 200, 220], seed=0)
    recipe.write_tfrecords(str(folder), "test", [40, 61], seed=1)
    return folder


def train(backend, form, files, out, *extra, check=True, jobs=None):
    """form: arrays, tfrecord, batches (a Sequence), keras3 (arrays, the model in Keras 3),
    keras3-tfrecord or keras3-batches (a PyDataset), each with "+local" or "+diloco" for
    `--sync` (every 4 steps, checkpoints at exchanges), ":overlap" after it for
    `--sync-overlap`; in a shared job of `jobs` where one is given."""
    form, _, sync = form.partition("+")
    if sync:  # checkpoints every 4 steps: step 24 is one, step 25 lies between two exchanges
        sync, _, overlap = sync.partition(":")
        extra = ("--sync", sync, "--sync-every", "4", "--checkpoint-every", "4", *extra)
        extra = ("--sync-overlap", *extra) if overlap else extra
    if form.startswith("keras3"):
        form, extra = form.partition("-")[2] or "arrays", ("--keras", "3", *extra)
    args = [RECIPE, "--data", form, "--files", str(files), "--deterministic",
            "--checkpoint-every", "2", "--epochs", "3", "--checkpoint-dir", str(out / "ckpt"),
            "--metrics-json", str(out / "m.json"), *extra]  # fmt: skip
    if jobs is not None:
        proc = jobs.get(2, backend).run_script(args, check=check)
    else:
        proc = run_job(2, backend, args, check=check)
    metrics = json.loads((out / "m.json").read_text()) if check else None
    return proc, metrics


# Each backend, data form, Keras and --sync mode at least once, each Keras under each
# backend. The synchronous mode's other pairs: the seeded kills of test_resume.py (Keras 2 and
# 3, arrays, at every moment of a step) and `hvdtrain-run chaos` (test_chaos.py).
KILLS = [
    ("gloo", "keras3-tfrecord"),  # killed between two exchanges of weights
    ("mpi", "keras3+diloco"),
    ("mpi", "batches+local:overlap"),  # an exchange in flight when killed
    ("gloo", "keras3-batches+diloco:overlap"),
]


def _read(out):
    path = out / "m.json"
    return json.loads(path.read_text()) if path.exists() else None


@pytest.fixture(scope="module")
def kills(files, shared_jobs, tmp_path_factory):
    """(backend, form) -> (the killed job, an uninterrupted Gloo run's metrics, (its resume,
    the resume's metrics)). The kills first, each its own job; then the uninterrupted runs
    and the Gloo resumes in one shared Gloo job, the MPI resumes in one shared MPI job: six
    jobs, not twelve."""
    runs = {}
    for backend, form in KILLS:
        out = tmp_path_factory.mktemp(f"kill-{backend}-{form}")
        killed, _ = train(backend, form, files, out, "--kill-at", "25", check=False)
        runs[backend, form] = [out, killed]
    for backend in ("gloo", "mpi"):
        for (b, form), run in runs.items():
            if backend == "gloo":  # the uninterrupted runs, for both backends
                ref = tmp_path_factory.mktemp(f"ref-{form}")
                train("gloo", form, files, ref, check=False, jobs=shared_jobs)
                run.append(_read(ref))
            if b == backend:
                proc, _ = train(b, form, files, run[0], check=False, jobs=shared_jobs)
                run.append((proc, _read(run[0])))
    return {key: tuple(run[1:]) for key, run in runs.items()}


@pytest.mark.parametrize("backend, form", KILLS)
def test_kill_mid_epoch_then_resume_is_bitwise_an_uninterrupted_run(backend, form, kills):
    """Against the Gloo run's weights for both backends: MPI's sums of two ranks' gradients
    are Gloo's, bit for bit."""
    killed, ref, (proc, resumed) = kills[backend, form]
    # 600 samples, 2 ranks, batch 16: 18 steps per epoch; checkpoints every 2 steps.
    assert ref and ref["steps_per_epoch"] == 18 and ref["size"] == 2, ref
    # BatchNorm statistics averaged, the weights identical on both ranks, checked.
    assert len({r["weights_digest"] for r in ref["ranks"]}) == 1
    assert ref["test_samples"] == 101 and 0.5 < ref["test"]["auc"] <= 1.0

    output = killed.stdout + killed.stderr
    assert killed.returncode != 0 and "rank 1: killing itself after step 25" in output
    # global step 24 of 18 per epoch: epoch-0002-step-000006
    assert "epoch-0002-step-000006 (epoch 2, step 6 of 18)" in output
    assert proc.returncode == 0 and resumed, (proc.stdout + proc.stderr)[-6000:]
    assert resumed["resumed_from"] == {
        "epoch": 2, "step": 6, "checkpoint": "epoch-0002-step-000006", "optimizer_iterations": 24
    }  # fmt: skip
    assert resumed["ranks"][0]["weights_digest"] == ref["ranks"][0]["weights_digest"]
    assert resumed["test"] == ref["test"]


def _records(folder, name, sizes, start=0):
    """Files of records {"id": int64}, ids counted from `start`; returns the next id."""
    import tensorflow as tf

    folder.mkdir(parents=True, exist_ok=True)
    for i, n in enumerate(sizes):
        with tf.io.TFRecordWriter(str(folder / f"{name}-{i}.tfrecord")) as w:
            for j in range(start, start + n):
                feature = {"id": tf.train.Feature(int64_list=tf.train.Int64List(value=[j]))}
                w.write(
                    tf.train.Example(
                        features=tf.train.Features(feature=feature)
                    ).SerializeToString()
                )
        start += n
    return start


def cover(jobs, backend, hosts, folder, out, *extra):
    out.mkdir()
    jobs.get(2, backend, hosts).run_script([worker("records_cover.py"), folder, out, *extra])
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _check_epochs(ranks, total):
    steps = {r["steps"] for r in ranks}
    assert len(steps) == 1, steps  # the same steps on every rank
    for epoch in range(3):
        seen = [i for r in ranks for i in r["epochs"][epoch]]
        assert sorted(seen) == list(range(total)), (epoch, sorted(seen))  # each exactly once
    orders = [[i for r in ranks for i in r["epochs"][e]] for e in range(3)]
    assert orders[0] != orders[1] != orders[2]  # reshuffled every epoch
    for r in ranks:  # a resume at step 3 of epoch 2 continues with the same records
        steps = r["steps"]
        assert r["resumed"] == r["epochs"][1][3 * 4 :] + r["epochs"][2]


# The scenarios below in the order of their shared jobs, each job started once: MPI's (left
# by `kills`), Gloo's, then Gloo's on two host names and MPI's again.
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_every_record_once_per_epoch_from_shared_files_of_uneven_sizes(
    backend, shared_jobs, tmp_path
):
    folder = tmp_path / "data"
    total = _records(folder, "train", [7, 13, 20, 31, 9])  # 80 records: 10 steps of 4 per rank
    _records(folder, "test", [5, 12], start=1000)
    ranks = cover(shared_jobs, backend, "localhost:2", folder, tmp_path / "out")
    assert [r["steps"] for r in ranks] == [10, 10] and ranks[0]["total"] == total
    _check_epochs(ranks, total)
    test = sorted(i for r in ranks for i in r["test"])
    assert test == list(range(1000, 1017))  # each test record once over the ranks


def test_a_tf_data_pipeline_of_the_user_trains_and_agrees(files, shared_jobs, tmp_path):
    _, m = train("gloo", "dataset", files, tmp_path, jobs=shared_jobs)
    assert m["data_source"] == "tf.data" and m["steps_per_epoch"] == 18
    assert len({r["weights_digest"] for r in m["ranks"]}) == 1


@pytest.mark.parametrize(
    "backend, hosts", [("gloo", "localhost:1,127.0.0.1:1"), ("mpi", "localhost:2")]
)
def test_every_record_once_per_epoch_from_per_host_files(backend, hosts, shared_jobs, tmp_path):
    """Gloo: two hosts (two names of this machine), each with its own files of uneven sizes,
    one rank each. MPI: one host, its files split between its two local ranks."""
    folder = tmp_path / "data"
    if backend == "gloo":
        end = _records(folder / "localhost", "train", [7, 13])
        total = _records(folder / "127.0.0.1", "train", [9, 11], start=end)
    else:
        total = _records(folder / "shared", "train", [7, 13, 9, 11])
        for name in {"localhost", "127.0.0.1", socket.gethostname()}:
            os.symlink(folder / "shared", folder / name)
    ranks = cover(shared_jobs, backend, hosts, folder, tmp_path / "out", "--per-host")
    assert [r["steps"] for r in ranks] == [5, 5] and ranks[0]["total"] == total == 40
    _check_epochs(ranks, total)
    if backend == "gloo":  # each rank read its own host's records only
        assert set(ranks[0]["epochs"][0]) == set(range(20))
        assert set(ranks[1]["epochs"][0]) == set(range(20, 40))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--epochs", "0"], "Invalid value for `--epochs`: received '0'; expected a positive "
         "integer, e.g. --epochs 1."),
        (["--data", "tfrecord", "--files", "/no/such/dir"],
         "Invalid value for `train files`: received '/no/such/dir/train-*.tfrecord'; expected a "
         "pattern that matches files."),
        (["--bogus"], "unrecognized arguments: --bogus. See `recipe.py --help`."),
        (["--sync", "local", "--accumulate", "2"], "Invalid value for `--accumulate`: received "
         "2; expected 1 with --sync local: its local steps already exchange less (a larger "
         "--sync-every, or --batch-size, gives what accumulating would)."),
    ],
)  # fmt: skip
def test_a_user_scripts_mistakes_are_one_line_and_exit_2(flags, message):
    """Each mistake alone, and those past the flags' parsing under -np 2 too (the flags'
    own mistakes on two ranks under every launcher:
    test_a_mistake_that_rank_0_reaches_last_is_still_its_one_line)."""
    if not message.startswith(("Invalid value for `--", "unrecognized")):
        proc = run_job(2, "mpi", [RECIPE, *flags], check=False)
        lines = [line for line in proc.stderr.splitlines() if "error:" in line]
        assert proc.returncode != 0
        assert len(lines) == 1 and lines[0].endswith(f"recipe.py: error: {message}"), proc.stderr
        assert "Traceback" not in proc.stderr
    alone = run_job(1, "none", [RECIPE, *flags], check=False)
    assert alone.returncode == 2 and ours(alone.stderr) == [f"recipe.py: error: {message}"]


@pytest.mark.parametrize("backend", ["mpirun", "mpi", "gloo"])
@pytest.mark.parametrize(
    "phase, words",
    [("args", "error: unrecognized arguments: --phase args --delay 4 --bogus. See "
              "`late_line.py --help`."),
     ("setup", "error: the same mistake on every rank; fix it so")],
)  # fmt: skip
def test_a_mistake_that_rank_0_reaches_last_is_still_its_one_line(backend, phase, words):
    """Issue 49: every rank makes the mistake, rank 0 4 s after the others (a loaded node, a
    slower import). The others used to wait 3 s and exit 2, and the launcher ended the job,
    rank 0 before it printed: Open MPI's banner alone, in 4 of 6 tries under plain mpirun on
    a loaded machine, and here every time. Before `hvd.init()` (a bad flag) and after it (a
    set-up mistake every rank agrees on), under mpirun, horovodrun --mpi and --gloo."""
    proc = run_job(2, backend, [worker("late_line.py"), "--phase", phase, "--delay", "4",
                                "--bogus"], check=False, timeout=120)  # fmt: skip
    output = proc.stdout + proc.stderr
    lines = [line for line in output.splitlines() if "error:" in line]
    assert proc.returncode != 0
    assert len(lines) == 1 and lines[0].endswith(f"late_line.py: {words}"), output[-3000:]
