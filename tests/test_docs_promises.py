"""What the docs pages promise, tried as a new user would (issue 37): every ```python block
on README.md and docs/*.md is a whole script run here at -np 2 on small data, or says it is
a fragment (its first line: "# A fragment ..."; tests/test_docs.py parses those); the DatasetData
example's sharding; the export loaded by plain Keras in a fresh Python, as the pages say;
fault-tolerance.md's exit codes and the tests its table names; the lines ranks print."""

import ast
import io
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import BIN, ROOT, job_env, launch_argv
from helpers.image_folders import class_folders

import hvdtrain
from hvdtrain import errors

PAGES = [os.path.join(ROOT, "README.md")] + sorted(
    os.path.join(ROOT, "docs", p)
    for p in os.listdir(os.path.join(ROOT, "docs"))
    if p.endswith(".md")
)
FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
FRAGMENT = "# A fragment"


def _blocks():
    for path in PAGES:
        for i, found in enumerate(FENCE.finditer(open(path).read())):
            yield f"{os.path.relpath(path, ROOT)}#{i}", found.group(1)


BLOCKS = dict(_blocks())


def _tfrecords(folder, prefix, sizes, seed):
    """MNIST-shaped records as the README's `parse` reads them: x [28, 28, 1], y int64."""
    import tensorflow as tf

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i, n in enumerate(sizes):
        with tf.io.TFRecordWriter(os.path.join(folder, f"{prefix}-{i:02d}.tfrecord")) as w:
            for _ in range(n):
                y = int(rng.integers(0, 10))
                x = rng.random((28, 28, 1)).astype("float32") * 0.1
                x[y, :, 0] += 1.0  # a row per class: learnable
                feature = {
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=x.ravel())),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[y])),
                }
                example = tf.train.Example(features=tf.train.Features(feature=feature))
                w.write(example.SerializeToString())


def _readme_data(folder):
    _tfrecords(folder / "data", "train", [300, 340], 0)
    _tfrecords(folder / "data", "test", [100], 1)


def _images(folder):
    """PNG digits in class folders, as your-model.md's `Images` reads them: 10 classes, 20
    images each to train (a short last batch) and 5 to test."""
    class_folders(folder / "images", {"train": 20, "test": 5}, classes=10, side=28, channels=1,
                  ext="png")  # fmt: skip


# The whole scripts: where they are, what they need in their folder, the flags of a short run.
RUNNABLE = {
    "README.md#0": (_readme_data, ["--epochs", "1", "--checkpoint-dir", "ck"]),
    "docs/your-model.md#0": (None, ["--epochs", "1", "--checkpoint-dir", "ck"]),
    "docs/your-model.md#3": (_images, ["--epochs", "1", "--checkpoint-dir", "ck"]),
    "docs/keras3.md#0": (None, ["--epochs", "1", "--checkpoint-dir", "ck"]),
    "docs/from-tf-distribute.md#0": (None, ["--epochs", "1", "--checkpoint-dir", "ck"]),
}


def test_every_python_block_is_run_here_or_says_it_is_a_fragment():
    for where, code in BLOCKS.items():
        fragment = code.lstrip().startswith(FRAGMENT)
        assert fragment != (where in RUNNABLE), (
            f"{where}: a whole script goes in RUNNABLE (it is run at -np 2); a fragment "
            f"starts with {FRAGMENT!r}"
        )
    assert set(RUNNABLE) <= set(BLOCKS), set(RUNNABLE) - set(BLOCKS)


@pytest.fixture(scope="module", autouse=True)
def _one_rank():
    hvdtrain.init(threads=1)


@pytest.mark.parametrize("where", [w for w in RUNNABLE if w in BLOCKS])
def test_a_whole_script_on_the_pages_trains_on_two_ranks_and_resumes(where, shared_jobs, tmp_path):
    """Copied from the page into train.py, run as the page says (-np 2 here, in the module's
    shared job), then the same command again: it resumes."""
    prepare, flags = RUNNABLE[where]
    (tmp_path / "train.py").write_text(BLOCKS[where])
    if prepare:
        prepare(tmp_path)
    job = shared_jobs.get(2, "gloo")
    for _ in range(2):
        proc = job.run_script([tmp_path / "train.py", *flags], cwd=tmp_path, timeout=300)
        out = proc.stdout
        assert "<stderr>:Traceback" not in out, out[-4000:]
    assert "is after epoch 1: all 1 epoch(s) trained" in out, out[-3000:]
    assert (tmp_path / "ck" / "model.keras").exists()


def test_the_fragments_pydataset_line_runs_with_the_pages_own_images(tmp_path, monkeypatch):
    """your-model.md: the fragment's `Images("images/train", 32, workers=4,
    use_multiprocessing=True)` takes the `Images` of the page's script above: a Keras 3
    `PyDataset` (`import keras`: tf.keras is Keras 2 here) that passes Keras's loading
    options on."""
    script = BLOCKS["docs/your-model.md#3"]
    kept = [n for n in ast.parse(script).body if isinstance(n, ast.Import | ast.ImportFrom)]
    kept += [n for n in ast.parse(script).body if isinstance(n, ast.ClassDef)]
    namespace = {}
    exec(compile(ast.Module(kept, []), "your-model.md#3", "exec"), namespace)
    line = next(
        line
        for line in BLOCKS["docs/your-model.md#4"].splitlines()
        if line.startswith("train = Images(") and "workers=" in line
    )
    _images(tmp_path)
    monkeypatch.chdir(tmp_path)
    exec(line, namespace)
    train = namespace["train"]
    assert train.workers == 4 and train.use_multiprocessing
    x, y = train[0]
    assert x.shape == (32, 28, 28, 1) and y.shape == (32,)


def test_exchanging_less_says_which_line_names_the_mode_and_what_bytes_sent_counts():
    """The mode ends the `training on` line, which comes after the data line; under Adam
    `bytes_sent` is more than exchanges x bytes_per_exchange (test_exchange.py measures
    it: the moments are averaged before each checkpoint)."""
    text = " ".join(open(os.path.join(ROOT, "docs", "exchanging-less.md")).read().split())
    assert "The first line names the mode" not in text
    assert "The `training on` line, the one after the data line, ends with the mode" in text
    assert "and a checkpoint it is more than `exchanges` x `bytes_per_exchange`" in text


# -- your-model.md: the DatasetData example ------------------------------------------------
def _page_function(where, name):
    """The source of function `name` defined in the block `where`."""
    code = BLOCKS[where]
    for node in ast.parse(code).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(code, node)
    raise AssertionError(f"{where} defines no {name}")


DATASET_SCRIPT = """
import sys

import tensorflow as tf

import hvdtrain


def parse_csv(line):
    values = tf.io.decode_csv(line, [0.0] * 5)
    return tf.stack(values[:4]), tf.cast(values[4], tf.int64)


{make_dataset}


def build_model():
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(3)])
    model.compile(
        optimizer="adam",
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


args = hvdtrain.ArgumentParser(epochs=1, batch_size=32).parse_args()
hvdtrain.fit(build_model, hvdtrain.DatasetData(make_dataset, num_samples=1800), args)
"""


@pytest.mark.parametrize("sharding", ["the page's", "by files"])
def test_the_datasetdata_example_gives_every_rank_its_share(sharding, tmp_path):
    """3 CSV files of 600 rows at -np 2: the page's make_dataset (samples sharded) trains; the
    one it replaced (files sharded: 1,200 rows and 600) stops in one line that names the
    user's function and says how to shard."""
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        rows = [",".join(f"{v:.3f}" for v in rng.normal(size=4)) + f",{rng.integers(0, 3)}"
                for _ in range(600)]  # fmt: skip
        (data / f"part-{i}.csv").write_text("\n".join(rows) + "\n")
    make_dataset = _page_function("docs/your-model.md#1", "make_dataset")
    if sharding == "by files":
        make_dataset = (
            "def make_dataset(rank, size, seed, epoch):\n"
            '    files = tf.data.Dataset.list_files("data/*.csv", shuffle=False)\n'
            "    files = files.shard(size, rank)  # 3 files: 2 for rank 0, 1 for rank 1\n"
            "    return files.interleave(tf.data.TextLineDataset).map(parse_csv)\n"
        )
    (tmp_path / "train.py").write_text(DATASET_SCRIPT.format(make_dataset=make_dataset))
    argv = [*launch_argv(2, "mpi"), sys.executable, "train.py"]
    proc = subprocess.run(
        argv, env=job_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    if sharding == "the page's":
        assert proc.returncode == 0, proc.stderr[-3000:]
        return
    lines = [line for line in proc.stderr.splitlines() if "data ran out" in line]
    assert proc.returncode != 0 and lines, proc.stderr[-3000:]
    found = re.search(r"gave (\d+) samples where the epoch needs (\d+); make `make_dataset` "
                      r"give every rank at least (\d+) samples each epoch", lines[0])  # fmt: skip
    assert found and int(found[1]) < int(found[2]) == int(found[3]), lines[0]
    assert "shard the samples" in lines[0] and "<stderr>:Traceback" not in proc.stderr


# -- the export, loaded as the pages say ----------------------------------------------------
def test_the_export_loads_in_a_fresh_python_as_the_pages_say(tmp_path):
    """your-model.md: a Keras 2 model's export loads with `tf_keras.models.load_model` in a
    Python without hvdtrain or TF_USE_LEGACY_KERAS, with no warning about its optimizer."""
    import tensorflow as tf

    def build():
        model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(2)])
        model.compile(optimizer=tf.keras.optimizers.Adam(1e-3), loss="mse")
        return model

    path = str(tmp_path / "ck" / "model.keras")
    hvdtrain.export_model(build(), build, path)
    page = open(os.path.join(ROOT, "docs", "your-model.md")).read()
    assert 'import tf_keras; tf_keras.models.load_model("ck/model.keras")' in page
    code = (
        'import tf_keras; m = tf_keras.models.load_model("ck/model.keras"); print(type(m).__name__)'
    )
    env = {k: v for k, v in job_env().items() if k not in ("TF_USE_LEGACY_KERAS", "PYTHONPATH")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0 and "Sequential" in proc.stdout, proc.stderr[-2000:]
    assert "Skipping variable loading" not in proc.stderr


# -- fault-tolerance.md ---------------------------------------------------------------------
FAULTS = os.path.join(ROOT, "docs", "fault-tolerance.md")


def test_every_row_of_the_fault_table_names_a_test_that_exists():
    text = open(FAULTS).read()
    table = text[text.index("| scenario | what happens |") :].split("\n\n", 1)[0]
    rows = table.splitlines()[2:]
    assert len(rows) >= 10
    for row in rows:
        named = re.findall(r"`(test_\w+\.py)::(test_\w+)`", row.split("|")[-2])
        assert named, row
        for file, function in named:
            tree = ast.parse(open(os.path.join(ROOT, "tests", file)).read())
            defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
            assert function in defined, (file, function)


def test_the_exit_codes_of_the_page_are_the_code_s():
    from hvdtrain.recipe.agreement import RanksDisagree
    from hvdtrain.runtime.watchdog import EXIT_CODE

    text = " ".join(open(FAULTS).read().split())
    codes = text[text.index("**Exit codes**") :].split("**", 3)[2]
    for code, cls in ((2, errors.HvdtrainError), (3, errors.TrainingDiverged),
                      (4, errors.OutputsNotWritten), (5, errors.HostUnreachable),
                      (6, RanksDisagree)):  # fmt: skip
        assert cls.exit_code == code and f"; {code} " in codes, (code, cls)
    from hvdtrain.launcher.failures import STALLED

    assert EXIT_CODE == STALLED == 124 and "; 124 a rank made no progress" in codes


EXITS_3 = """import os, sys
rank = os.environ.get("HOROVOD_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK")
sys.exit(3 if rank == "1" else 0)
"""


@pytest.mark.parametrize(
    "launcher, code",
    [("horovodrun", 3), ("horovodrun --mpi", 3), ("horovodrun --gloo", 3), ("mpirun", 3)],
)
def test_what_plain_launchers_exit_with_when_a_rank_fails(launcher, code, tmp_path):
    """fault-tolerance.md: plain horovodrun exits with the failed rank's status under MPI
    (its default here) and under --gloo (one line, no traceback: launch/horovod-patches/0007);
    mpirun with the failed rank's."""
    script = tmp_path / "exits3.py"
    script.write_text(EXITS_3)
    if launcher == "mpirun":
        argv = launch_argv(2, "mpirun")
    else:
        argv = [os.path.join(BIN, "horovodrun"), "-np", "2", "-H", "localhost:2",
                *launcher.split()[1:]]  # fmt: skip
    proc = subprocess.run([*argv, sys.executable, str(script)], env=job_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == code, proc.stderr[-2000:]
    if launcher == "horovodrun --gloo":
        assert proc.stderr.strip().splitlines()[-1].endswith("Process name: 1, Exit code: 3")
        assert "Traceback" not in proc.stderr
    text = " ".join(open(FAULTS).read().split())
    assert ("exits with the first failed rank's status under MPI (its default where Open MPI "
            "is installed, as here) and under `--gloo`") in text  # fmt: skip


# -- what ranks print -----------------------------------------------------------------------
def test_a_line_and_its_end_go_out_in_one_write():
    """A rank's line and its line end in one write: with two, another rank's tagged output
    landed between them ('... using embedded[1,0]<stderr>:')."""

    class Writes(io.StringIO):
        def __init__(self):
            super().__init__()
            self.count = 0

        def write(self, s):
            self.count += 1
            return super().write(s)

    out = Writes()
    errors.write_line("hvdtrain: rank 1 stopped", out)
    assert out.count == 1 and out.getvalue() == "hvdtrain: rank 1 stopped\n"


def test_the_first_progress_figures_leave_the_start_up_out():
    """After a resume mid-epoch (or in a process's first epoch) the first execution traces
    and compiles: the epoch's line times the steps after it, and says so."""
    from hvdtrain.recipe.callbacks import ProgressCallback

    out = io.StringIO()
    progress = ProgressCallback(2, 20, 64, start_step=10, mode="lines", seconds=1e9, stream=out)
    progress.on_epoch_begin(0)
    for batch in range(10):  # 10 steps left of the epoch, 5 per execution
        if batch % 5 == 4:
            progress.on_train_batch_end(batch)
    progress.on_epoch_end(0, {"loss": 0.5})
    assert "epoch 1/2: 5 steps after the first 5 in " in out.getvalue(), out.getvalue()


def test_a_mid_epoch_checkpoint_line_says_what_its_folder_name_means(tmp_path, caplog):
    """epoch-0002-step-000006 is epoch 2, step 6: the folder and the line say it alike."""
    import tensorflow as tf

    from hvdtrain.recipe.callbacks import CheckpointCallback
    from hvdtrain.recipe.checkpoint import CheckpointManager

    hvdtrain.init(threads=1)
    model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1)])
    opt = tf.keras.optimizers.SGD(0.1)
    opt.build(model.trainable_variables)
    callback = CheckpointCallback(CheckpointManager(tmp_path, model, opt), {}, 10, 2)
    callback.set_model(model)
    caplog.set_level("INFO", logger="hvdtrain")
    callback.on_epoch_begin(1)
    for batch in range(6):
        callback.on_train_batch_end(batch)
    assert os.path.isdir(tmp_path / "epoch-0002-step-000006")
    assert any("epoch-0002-step-000006 (epoch 2, step 6 of 10)" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_the_pages_say_what_make_train_runs():
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    ran = re.search(r"^train: setup\n\t(.*?)\n\n", makefile, re.MULTILINE | re.DOTALL).group(1)
    ran = " ".join(ran.replace("\\\n", " ").split())
    for name, value in re.findall(r"^(\w+)\s*\?=\s*(\S+)$", makefile, re.MULTILINE):
        ran = ran.replace(f"$({name})", value)  # the defaults
    for name in ("README.md", os.path.join("docs", "getting-started.md")):
        text = " ".join(open(os.path.join(ROOT, name)).read().replace("\\\n", " ").split())
        for flag in ("--epochs 15", "--checkpoint-dir out/mnist", "--metrics-json"):
            assert flag in ran and flag in text, (name, flag)
        assert "HVDTRAIN_OFFLINE=1 horovodrun -np 2 -H localhost:2 python -m hvdtrain.mnist" in text
    assert "HVDTRAIN_OFFLINE ?= 1" in makefile and "EPOCHS ?= 15" in makefile


def test_an_example_line_run_as_root_with_mpirun_names_the_flag():
    text = open(os.path.join(ROOT, "docs", "getting-started.md")).read()
    if os.getuid() == 0:  # as this machine runs it
        assert "mpirun -np 2 python examples/keras_fit.py" in text
        assert "as root: mpirun --allow-run-as-root" in text
