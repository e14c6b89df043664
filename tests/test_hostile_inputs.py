"""Hostile input, one table: flags, hostfiles, environment variables, data files,
checkpoint manifests and model files, given to `hvdtrain-run` and the entry points.

Each case is a real process in a fresh folder, and must: exit with the status given (2 for a
user error), print exactly one error line (`prog: error: ...` containing the words given)
and no traceback, write nothing outside the folders it names, and end within a bound.
"""

import gzip
import json
import os
import subprocess
import sys
import time

import pytest
from conftest import BIN, job_env, tf_version

BOUND = 90  # seconds per case; TensorFlow's import is most of it
RUN = [f"{BIN}/hvdtrain-run"]
MNIST = [sys.executable, "-m", "hvdtrain.mnist", "--limit-samples", "256", "--progress", "off"]
IMAGES = [sys.executable, "-m", "hvdtrain.images"]
KERAS3 = MNIST + ["--keras", "3"]


def write(name, content):
    """A set-up step: writes `content` (str or bytes) to `name` in the case's folder."""

    def make(folder):
        path = os.path.join(folder, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content if isinstance(content, bytes) else content.encode())

    return make


def fifo(name):
    return lambda folder: os.mkfifo(os.path.join(folder, name))


def folder(name):
    return lambda folder: os.makedirs(os.path.join(folder, name))


def manifest(name, **fields):
    body = {"epoch": 1, "step": 0, "files": {"state.index": [1, "0" * 64]}, "fingerprint": []}
    return write(f"{name}/manifest.json", json.dumps({**body, **fields}))


# A user's script whose model mixes the two Keras, or is compiled as Keras 2 takes it but
# not Keras 3, in the way its argument names.
MIXED = """import sys
import keras
import numpy as np
import tensorflow as tf
import hvdtrain

def build_model():
    how = sys.argv[1]
    if how == "k2-model-k3-optimizer":
        m = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    elif how == "k3-positional-metrics":  # Keras 3 reads the third as loss_weights
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        m.compile(keras.optimizers.SGD(0.1), "mse", [keras.metrics.MeanAbsoluteError()])
    elif how == "k3-model-k2-layer":
        m = keras.Sequential([keras.Input((4,)), tf.keras.layers.Dense(1)])
        m.compile(optimizer="sgd", loss="mse")
    elif how == "k2-layer-on-k3-input":  # raised inside tf.keras, naming no class
        x = keras.Input((4,))
        m = keras.Model(x, tf.keras.layers.Dense(1)(x))
        m.compile(optimizer="sgd", loss="mse")
    else:  # a Keras 3 layer called on tf.keras tensors: Keras 2 keeps only its variables
        x = tf.keras.Input((4,))
        m = tf.keras.Model(x, keras.layers.Dense(1)(x))
        m.compile(optimizer="sgd", loss="mse")
    return m

x = np.ones((32, 4), "float32")
args = hvdtrain.ArgumentParser(epochs=1, batch_size=8).parse_args(sys.argv[2:])
hvdtrain.fit(build_model, hvdtrain.ArrayData(x, x.sum(1)), args)
"""
MIXED_CASES = [
    (
        f"keras-mixed-{how}",
        [sys.executable, "{d}/mixed.py", how],
        {},
        [write("mixed.py", MIXED)],
        2,
        f"mixing the two Keras ({words}",
        [],
    )
    for how, words in (
        ("k2-model-k3-optimizer", "Keras 2 (tf.keras) refused an object of Keras 3"),
        ("k3-model-k2-layer", "Keras 3 (`import keras`) refused an object of Keras 2"),
        ("k2-layer-on-k3-input", "Keras 2 (tf.keras) refused an object of Keras 3"),
        ("k2-model-k3-layer-call", "a Keras 2 (tf-keras) model holds Variable"),
    )
]
MIXED_CASES.append(
    ("keras3-compile-positional-metrics", [sys.executable, "{d}/mixed.py", "k3-positional-metrics"],
     {}, [write("mixed.py", MIXED)], 2, "`loss_weights`: received [<MeanAbsoluteError", [])
)  # fmt: skip

IDX_IMAGES = gzip.compress(b"\x00\x00\x08\x03" + (5).to_bytes(4, "big") + b"\x00" * 8)

# (id, argv, environment, set-up steps, exit status, words in the error line, folders the
# case may write to). "{d}" in argv is the case's folder.
CASES = [
    # -- hvdtrain-run flags
    ("np-zero", RUN + ["-np", "0", "true"], {}, [], 2, "`-np`: received '0'", []),
    ("np-negative", RUN + ["-np", "-1", "true"], {}, [], 2, "`-np`: received '-1'", []),
    ("np-word", RUN + ["-np", "two", "true"], {}, [], 2, "`-np`: received 'two'", []),
    ("np-huge", RUN + ["-np", "1" + "0" * 23, "true"], {}, [], 2, "at most 65536", []),
    ("np-over-slots", RUN + ["-np", "3", "-H", "a:2", "true"], {}, [], 2, "at most 2", []),
    ("slots-zero", RUN + ["-H", "a:0", "true"], {}, [], 2, "`-H`: received 'a:0'", []),
    ("slots-huge", RUN + ["-H", "a:" + "9" * 23, "true"], {}, [], 2, "from 1 to 1024", []),
    ("host-twice", RUN + ["-H", "a:1,a:1", "true"], {}, [], 2, "listed twice", []),
    ("hosts-empty", RUN + ["-H", ",,", "true"], {}, [], 2, "`-H`: received ',,'", []),
    ("backend", RUN + ["--backend", "pbs", "true"], {}, [], 2, "invalid choice: 'pbs'", []),
    ("srun-no-slurm", RUN + ["--backend", "srun", "true"], {}, [], 2, "SLURM_JOB_ID", []),
    ("ssh-port", RUN + ["--ssh-port", "70000", "true"], {}, [], 2, "from 1 to 65535", []),
    ("ssh-port-0", RUN + ["--ssh-port", "0", "true"], {}, [], 2, "`--ssh-port`", []),
    ("fusion", RUN + ["--fusion-threshold-mb", "-1", "true"], {}, [], 2, "fusion-threshold", []),
    ("cycle-nan", RUN + ["--cycle-time-ms", "nan", "true"], {}, [], 2, "received 'nan'", []),
    ("cycle-inf", RUN + ["--cycle-time-ms", "inf", "true"], {}, [], 2, "received 'inf'", []),
    ("stall-0", RUN + ["--stall-check-warning-time-seconds", "0", "true"], {}, [], 2,
     "stall-check-warning", []),
    ("export-name", RUN + ["-x", "1BAD=2", "true"], {}, [], 2, "Invalid value for `-x`", []),
    ("export-unset", RUN + ["-x", "NOT_SET_ANYWHERE", "true"], {}, [], 2, "a variable set", []),
    ("nic", RUN + ["--network-interface", "eth0;rm", "true"], {}, [], 2, "interface names", []),
    ("timeline", RUN + ["--timeline-filename", "", "true"], {}, [], 2, "timeline-filename", []),
    ("unknown-flag", RUN + ["--bogus", "true"], {}, [], 2, "unrecognized arguments", []),
    ("no-command", RUN, {}, [], 2, "no command to run", []),
    ("max-np", RUN + ["--elastic", "--max-np", "70000", "true"], {}, [], 2, "`--max-np`", []),
    ("min-np-alone", RUN + ["--min-np", "1", "true"], {}, [], 2, "needs --elastic", []),
    ("cooldown", RUN + ["--elastic", "--blacklist-cooldown-range", "20", "10", "true"], {}, [],
     2, "MIN <= MAX", []),
    ("mpi-args-gloo", RUN + ["--backend", "gloo", "--mpi-args=-v", "true"], {}, [], 2,
     "expected --backend mpi", []),
    ("doctor-command", RUN + ["doctor", "-H", "localhost:1", "true"], {}, [], 2,
     "doctor takes no command", []),
    ("timeout", RUN + ["--timeout", "-5", "true"], {}, [], 2, "`--timeout`", []),
    # -- hostfiles
    ("hf-slots-0", RUN + ["--hostfile", "{d}/h", "true"], {}, [write("h", "a slots=0\n")], 2,
     "h:1: slots '0'", []),
    ("hf-slots-x", RUN + ["--hostfile", "{d}/h", "true"], {}, [write("h", "a:x\n")], 2,
     "h:1: slots 'x'", []),
    ("hf-slots-huge", RUN + ["--hostfile", "{d}/h", "true"], {},
     [write("h", "a slots=" + "9" * 30 + "\n")], 2, "from 1 to 1024", []),
    ("hf-twice", RUN + ["--hostfile", "{d}/h", "true"], {}, [write("h", "a\nb:2\na:1\n")], 2,
     "h:3: host 'a' is listed twice", []),
    ("hf-junk", RUN + ["--hostfile", "{d}/h", "true"], {}, [write("h", "a some junk\n")], 2,
     "h:1: cannot read", []),
    ("hf-empty", RUN + ["--hostfile", "{d}/h", "true"], {}, [write("h", "# none\n")], 2,
     "h: no hosts", []),
    ("hf-missing", RUN + ["--hostfile", "{d}/none", "true"], {}, [], 2, "a readable", []),
    ("hf-folder", RUN + ["--hostfile", "{d}/dir", "true"], {}, [folder("dir")], 2,
     "a readable", []),
    ("hf-binary", RUN + ["--hostfile", "{d}/h", "true"], {}, [write("h", b"\x00\xff\xfe\n")], 2,
     "not a text file; expected a hostfile", []),
    ("hf-fifo", RUN + ["--hostfile", "{d}/h", "true"], {}, [fifo("h")], 2, "--hostfile", []),
    ("hf-negative-with-comment", RUN + ["--hostfile", "{d}/h", "true"], {},
     [write("h", "a slots=-1 # ghp_" + "a" * 36 + "\n")], 2, "h:1: slots '-1'", []),
    # -- environment variables
    ("slurm-ntasks", RUN + ["--backend", "srun", "true"],
     {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "abc", "SLURM_JOB_NODELIST": "n1"}, [], 2,
     "SLURM_NTASKS", []),
    ("slurm-nodelist", RUN + ["true"],
     {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node[1-"}, [], 2,
     "SLURM_JOB_NODELIST", []),
    ("stall-env", MNIST, {"HVDTRAIN_STALL_SHUTDOWN_SECONDS": "abc"}, [], 2,
     "HVDTRAIN_STALL_SHUTDOWN_SECONDS", []),
    ("stall-env-negative", MNIST, {"HVDTRAIN_STALL_SHUTDOWN_SECONDS": "-1"}, [], 2,
     "HVDTRAIN_STALL_SHUTDOWN_SECONDS", []),
    ("keras3", MNIST, {"TF_USE_LEGACY_KERAS": "0"}, [], 2, "need Keras 2", []),
    # -- entry point flags (checked before TensorFlow loads)
    ("epochs-0", MNIST + ["--epochs", "0"], {}, [], 2, "`--epochs`: received 0", []),
    ("batch", MNIST + ["--batch-size", "-3"], {}, [], 2, "`--batch-size`: received -3", []),
    ("lr-nan", MNIST + ["--lr", "nan"], {}, [], 2, "`--lr`: received nan", []),
    ("lr-negative", MNIST + ["--lr", "-1"], {}, [], 2, "`--lr`: received -1.0", []),
    ("warmup-inf", MNIST + ["--warmup-epochs", "inf"], {}, [], 2, "`--warmup-epochs`", []),
    ("seed", MNIST + ["--seed", "-1"], {}, [], 2, "`--seed`: received -1", []),
    ("threads", MNIST + ["--threads", "99999"], {}, [], 2, "at most 4096", []),
    ("every", MNIST + ["--checkpoint-every", "-1"], {}, [], 2, "`--checkpoint-every`", []),
    ("metrics-folder", MNIST + ["--metrics-json", "{d}"], {}, [], 2, "not a folder", []),
    ("require-alone", MNIST + ["--require-resume"], {}, [], 2, "--checkpoint-dir with it", []),
    ("progress", MNIST + ["--progress", "loud"], {}, [], 2, "invalid choice: 'loud'", []),
    ("elastic-accumulate", MNIST + ["--elastic", "--accumulate", "2"], {}, [], 2,
     "1 with --elastic", []),
    ("precision", MNIST + ["--mixed-precision", "float8"], {}, [], 2, "invalid choice", []),
    ("int-flag-word", MNIST + ["--epochs", "many"], {}, [], 2, "--epochs", []),
    # -- output paths (before the first step)
    ("metrics-proc", MNIST + ["--metrics-json", "/proc/hvdtrain/m.json"], {}, [], 2,
     "`--metrics-json`", []),
    ("logdir-file", MNIST + ["--log-dir", "{d}/f"], {}, [write("f", "x")], 2, "`--log-dir`", []),
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
    # -- Keras 3 (the model built with `import keras`)
    ("keras-choice", MNIST + ["--keras", "4"], {}, [], 2, "invalid choice: '4'", []),
    ("keras3-backend-jax", KERAS3, {"KERAS_BACKEND": "jax"}, [], 2,
     "`KERAS_BACKEND`: received 'jax'", []),
    ("keras3-metrics-folder", KERAS3 + ["--metrics-json", "{d}"], {}, [], 2, "not a folder", []),
    ("keras3-manifest-format", KERAS3 + ["--checkpoint-dir", "{d}/ck"], {},
     [manifest("ck/epoch-0001", format=99)], 2, "it has format 99", ["ck"]),
    ("keras3-manifest-damaged-required", KERAS3 + ["--checkpoint-dir", "{d}/ck",
     "--require-resume"], {}, [write("ck/epoch-0002/manifest.json", "{broken")], 2,
     "1 checkpoint folder(s)", ["ck"]),
    ("keras3-weights-garbage", IMAGES + ["--data-dir", "{d}/imgs", "--weights", "{d}/w.h5",
     "--keras", "3"], {}, [write("imgs/a/1.png", b"x"), write("imgs/b/1.png", b"x"),
     write("w.h5", b"garbage")], 2, "--weights", []),
    *MIXED_CASES,
    # -- model files
    ("weights-garbage", IMAGES + ["--data-dir", "{d}/imgs", "--weights", "{d}/w.h5"], {},
     [write("imgs/a/1.png", b"x"), write("imgs/b/1.png", b"x"), write("w.h5", b"garbage")], 2,
     "--weights", []),
    ("weights-missing", IMAGES + ["--data-dir", "{d}/imgs", "--weights", "{d}/none.h5"], {},
     [folder("imgs/a"), folder("imgs/b")], 2, "--weights", []),
]  # fmt: skip


def tree(root):
    return {
        os.path.relpath(os.path.join(d, f), root)
        for d, dirs, files in os.walk(root)
        for f in files + dirs
    }


def test_the_table_is_large_and_ids_unique():
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.timeout(BOUND * 2)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hostile_input(tmp_path, case):
    name, argv, env, steps, status, words, writable = case
    keras3 = name == "keras3" or name.startswith(("keras-mixed", "keras3-compile"))
    if keras3 and tf_version() < (2, 16):
        pytest.skip("TensorFlow 2.15: tf.keras is always Keras 2, there is no Keras 3 to turn on")
    work = tmp_path / "work"
    work.mkdir()
    for step in steps:
        step(str(work))
    before = tree(work)
    argv = [a.replace("{d}", str(work)) for a in argv]
    clean = {k: v for k, v in job_env(**env).items() if not k.startswith("SLURM_") or k in env}
    start = time.monotonic()
    proc = subprocess.run(
        argv,
        env=clean,
        cwd=work,
        capture_output=True,
        text=True,
        timeout=BOUND,
        stdin=subprocess.DEVNULL,
    )
    took = time.monotonic() - start
    errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert proc.returncode == status, proc.stderr[-3000:]
    assert len(errors) == 1 and words in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    new = tree(work) - before
    assert all(any(p == w or p.startswith(w + os.sep) for w in writable) for p in new), new
    assert took < BOUND
