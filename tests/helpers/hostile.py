"""Hostile input, what the tests/test_hostile_*.py files share (one file per concern: the
launcher, the entry points' flags and settings, the files a job reads).

A case is a real process in a fresh folder: (id, argv, environment, set-up steps, exit
status, words in the error line, folders the case may write to); "{d}" in argv is the case's
folder. `check_case` runs it, and it must exit with the status given (2 for a user error),
print exactly one error line (`prog: error: ...` containing the words given) and no
traceback, write nothing outside the folders it names, and end within `BOUND`.
"""

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


def ids(cases):
    """The cases' ids, each once (a repeated id would hide a case)."""
    names = [c[0] for c in cases]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"hostile-input ids repeated: {twice}")
    return names


def one_line(message):
    assert len(str(message).splitlines()) <= 1, repr(message)


def _tree(root):
    return {
        os.path.relpath(os.path.join(d, f), root)
        for d, dirs, files in os.walk(root)
        for f in files + dirs
    }


def check_case(tmp_path, case):
    """Runs `case` (see the module's docstring) and checks what it must do."""
    name, argv, env, steps, status, words, writable = case
    keras3 = name == "keras3" or name.startswith(("keras-mixed", "keras3-compile"))
    if keras3 and tf_version() < (2, 16):  # the cases that need Keras 3 turned on
        pytest.skip("TensorFlow 2.15: tf.keras is always Keras 2, there is no Keras 3 to turn on")
    work = tmp_path / "work"
    work.mkdir()
    for step in steps:
        step(str(work))
    before = _tree(work)
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
    new = _tree(work) - before
    assert all(any(p == w or p.startswith(w + os.sep) for w in writable) for p in new), new
    assert took < BOUND
