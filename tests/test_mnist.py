"""`python -m hvdtrain.mnist` end to end: Gloo, MPI and mpirun; resume after SIGKILL; bad input."""

import glob
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import JOB_TIMEOUT, LEGACY_KERAS, job_env, run_job

from hvdtrain.launcher.noise import is_startup_noise

MNIST = ["-m", "hvdtrain.mnist"]


def _rank_lines(output, rank):
    """A rank's lines, but TensorFlow's start-up lines (`hvdtrain.launcher.noise`), which
    every rank prints under plain launchers (docs/getting-started.md)."""
    return [
        line
        for line in output.splitlines()
        if re.match(rf"\[(1,)?{rank}\]<std(out|err)>", line) and not is_startup_noise(line)
    ]


@pytest.mark.parametrize("backend, keras", [("gloo", "2"), ("mpirun", "2"), ("mpi", "3")])
def test_one_epoch_on_two_ranks(backend, keras, tmp_path):
    ckpt, metrics, logs = tmp_path / "ckpt", tmp_path / "m.json", tmp_path / "tb"
    args = [*MNIST, "--epochs", "1", "--checkpoint-dir", str(ckpt), "--metrics-json", str(metrics)]
    args += ["--keras", keras]
    proc = run_job(2, backend, [*args, "--log-dir", str(logs)])
    m = json.loads(metrics.read_text())
    assert m["size"] == 2 and m["epochs"] == 1 and m["global_batch_size"] == 64
    assert m["data_source"] == "embedded" and m["test_samples"] == 500
    assert m["test_accuracy"] > 0.8 and m["train_samples_per_sec"] > 0 and m["wall_seconds"] > 0
    assert sorted(r["local_rank"] for r in m["ranks"]) == [0, 1]
    assert len({r["weights_digest"] for r in m["ranks"]}) == 1
    # Rank 0 alone prints and writes: checkpoints, TensorBoard events, the export.
    assert _rank_lines(proc.stdout + proc.stderr, 0) and not _rank_lines(
        proc.stdout + proc.stderr, 1
    )
    rank0_pid = next(r["pid"] for r in m["ranks"] if r["rank"] == 0)
    manifest = json.loads((ckpt / "epoch-0001" / "manifest.json").read_text())
    assert manifest["written_by"]["pid"] == rank0_pid
    events = glob.glob(str(logs / "**" / "events.out.tfevents.*"), recursive=True)
    assert events and {int(e.split(".")[-3]) for e in events} == {rank0_pid}
    assert sorted(os.listdir(ckpt)) == ["epoch-0001", "model.keras"]


@pytest.mark.parametrize("first, then", [("2", "3"), ("3", "2")])
def test_a_checkpoint_of_one_keras_is_refused_by_the_other_in_one_line(first, then, tmp_path):
    args = [*MNIST, "--epochs", "1", "--limit-samples", "640", "--model", "mlp",
            "--checkpoint-dir", str(tmp_path / "ckpt")]  # fmt: skip
    run_job(1, "none", [*args, "--keras", first])
    before = sorted(os.listdir(tmp_path / "ckpt"))
    proc = run_job(1, "none", [*args, "--epochs", "2", "--keras", then], check=False)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1, proc.stderr[-3000:]
    names = {"2": "Keras 2 (tf-keras)", "3": "Keras 3"}
    assert (
        f"was written by a {names[first]} model; this run builds a {names[then]} one" in errors[0]
    )
    assert sorted(os.listdir(tmp_path / "ckpt")) == before  # the checkpoint left as it was


def test_exported_model_loads_in_plain_keras_without_horovod(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.json"
    args = [*MNIST, "--epochs", "2", "--limit-samples", "640", "--model", "mlp", "--lr-decay",
            "none", "--checkpoint-dir", str(ckpt), "--metrics-json", str(metrics)]  # fmt: skip
    run_job(1, "none", args)
    assert json.loads(metrics.read_text())["lr_final"] == pytest.approx(1e-3)  # kept
    code = (
        "import sys, numpy as np, tensorflow as tf;"
        f"m = tf.keras.models.load_model({str(ckpt / 'model.keras')!r});"
        "print(m.predict(np.zeros((2, 28, 28, 1)), verbose=0).shape, 'horovod' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=job_env(**LEGACY_KERAS),
        timeout=120,
    )
    assert out.stdout.split() == ["(2,", "10)", "False"], out.stderr[-2000:]


def test_the_learning_rate_falls_along_a_half_cosine():
    from hvdtrain.mnist import cosine_decay, parse_args

    rates = [cosine_decay(epoch, 1e-3, 15) for epoch in range(15)]
    assert rates[0] == 1e-3 and all(a > b for a, b in zip(rates[:-1], rates[1:], strict=True))
    assert rates[-1] == pytest.approx(1e-3 * 0.011, rel=0.01)  # 1 % in the last epoch
    assert parse_args([]).lr_decay == "cosine" and parse_args(["--lr-decay", "none"])


def _one_error_line(proc, match, launcher_traceback=False):
    """One error line, non-zero exit, no traceback from hvdtrain (horovodrun --gloo prints
    its own traceback when a rank fails: `launcher_traceback` tolerates that one)."""
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert re.search(match, errors[0]), errors[0]
    output = proc.stderr + proc.stdout
    if launcher_traceback:
        output = "\n".join(_rank_lines(output, 0) + _rank_lines(output, 1))
    assert "Traceback" not in output


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--batch-size", "0"], r"Invalid value for `--batch-size`: received '0'"),
        (["--epochs", "-2"], r"Invalid value for `--epochs`: received '-2'"),
        (["--data-dir", "/nonexistent/dir"], r"`--data-dir`"),
    ],
)
def test_bad_flags_exit_with_one_line(flags, match):
    _one_error_line(run_job(1, "none", [*MNIST, *flags], check=False, timeout=60), match)


def test_malformed_data_dir_and_unwritable_checkpoint_dir(tmp_path):
    (tmp_path / "mnist.npz").write_bytes(b"garbage")
    proc = run_job(1, "none", [*MNIST, "--data-dir", str(tmp_path)], check=False, timeout=120)
    _one_error_line(proc, r"Invalid MNIST file .*mnist.npz")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    proc = run_job(
        1, "none", [*MNIST, "--checkpoint-dir", str(blocker / "ckpt")], check=False, timeout=120
    )
    _one_error_line(proc, r"`--checkpoint-dir`.*expected a writable directory")


def test_checkpoint_of_another_model_is_refused_on_two_ranks_without_a_hang(tmp_path):
    ckpt = tmp_path / "ckpt"
    base = ["--epochs", "1", "--limit-samples", "640", "--checkpoint-dir", str(ckpt)]
    run_job(2, "gloo", [*MNIST, *base, "--model", "mlp"])
    before = sorted(os.listdir(ckpt))
    proc = run_job(
        2, "gloo", [*MNIST, *base, "--model", "convnet"], check=False, timeout=JOB_TIMEOUT
    )
    _one_error_line(proc, r"different model", launcher_traceback=True)
    assert sorted(os.listdir(ckpt)) == before  # nothing overwritten
