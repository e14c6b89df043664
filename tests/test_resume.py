"""Exact resume: SIGKILL at any moment, rerun the same command, end with the same weights."""

import json
import os
import random
import re
import subprocess
import sys
import time

import pytest
from conftest import kill_job, launch_argv, run_job, run_until, start_job, worker

from hvdtrain.recipe.resume import resume_step

BASE = ["-m", "hvdtrain.mnist", "--deterministic", "--epochs", "2", "--limit-samples", "1024",
        "--checkpoint-every", "4"]  # fmt: skip


def _job(np, tmp_path, name, extra=(), keras="2"):
    ckpt, metrics = tmp_path / name, tmp_path / f"{name}.json"
    args = [*BASE, "--checkpoint-dir", str(ckpt), "--metrics-json", str(metrics), *extra,
            "--keras", keras]  # fmt: skip
    return args, ckpt, metrics


RUN_TIMEOUT = 120  # seconds for one run to reach its kill point
STEPS = 2 * 16  # 2 epochs of 1,024 samples in global batches of 64
_STEP = re.compile(r"epoch (\d+)/\d+: (?:step (\d+)/|(\d+) steps in)")
_RESUMED = re.compile(r"resuming (?:after|at) .*\(global step (\d+)\)")


def _global_step(line):
    found = _STEP.search(line)
    return found and (int(found.group(1)) - 1) * 16 + int(found.group(2) or found.group(3))


def _kill_after(argv, step, delay, marker):
    """Starts argv, SIGKILLs every process of it `delay` s after rank 0 reports global step
    `step`; returns (the global step it resumed at, the last one it reported)."""
    proc, out = start_job(argv)
    resumed, reached = 0, 0
    try:
        while reached < step:  # each line within RUN_TIMEOUT, or the job is killed and fails
            line = out.wait_for(f"{_STEP.pattern}|{_RESUMED.pattern}", RUN_TIMEOUT)
            if at := _RESUMED.search(line):
                resumed = int(at.group(1))
            reached = _global_step(line) or reached
        time.sleep(delay)  # the moment: somewhere in the next step or checkpoint write
    finally:
        kill_job(proc, marker)
    seen = len(out.lines)
    out.rest()
    for line in out.lines[seen:]:  # what it still did before the kill
        reached = _global_step(line) or reached
    return resumed, reached


@pytest.mark.slow
@pytest.mark.timeout(900)  # up to 12 runs; each run of it has its own bound (RUN_TIMEOUT)
# Four on Keras 2 (an epoch's end among them); two on Keras 3, whose resume shares everything
# but the frontend's state (its kill mid-epoch is also in test_recipe.py, under Gloo and MPI).
# Kills at random moments of a user's own script, and of every mode: `hvdtrain-run chaos`
# (test_chaos.py). (Twenty and six until 2026-11-28, then ten and four: CI ran past 90 min.)
@pytest.mark.parametrize("keras, count", [("2", 4), ("3", 2)])
def test_kills_at_seeded_moments_end_bitwise_like_an_uninterrupted_run(keras, count, tmp_path):
    args, _, ref_metrics = _job(2, tmp_path, "reference", keras=keras)
    run_job(2, "gloo", args)
    reference = json.loads(ref_metrics.read_text())

    rng = random.Random(count)  # the moments: global steps, then up to 0.3 s into the next
    kills = {16, *rng.sample(range(1, STEPS), count - 1)}  # an epoch's end among them
    while len(kills) < count:
        kills.add(rng.randrange(1, STEPS))
    kills = sorted(kills)
    extra = ["--progress", "lines", "--progress-seconds", "0.001"]
    args, ckpt, metrics = _job(2, tmp_path, "killed", extra, keras)
    argv = launch_argv(2, "gloo") + [sys.executable, *args]
    redone, reached = 0, 0
    for step in kills:
        resumed, last = _kill_after(argv, step, rng.uniform(0, 0.3), str(ckpt))
        redone += max(0, reached - resumed)
        reached = last
        assert not metrics.exists()
    proc = run_job(2, "gloo", args)
    final = json.loads(metrics.read_text())
    redone += max(0, reached - final["resumed_from"]["optimizer_iterations"])
    print(f"{len(kills)} kills at steps {kills}: {redone} step(s) redone in all")
    assert "resuming after" in proc.stderr
    assert final["optimizer_iterations"] == reference["optimizer_iterations"] == STEPS
    assert final["ranks"][0]["weights_digest"] == reference["ranks"][0]["weights_digest"]
    assert final["ranks"][1]["weights_digest"] == reference["ranks"][1]["weights_digest"]
    assert final["test_loss"] == reference["test_loss"]
    # The epochs' validation figures too. Their training loss and accuracy are Keras' means
    # over the steps this process ran: an epoch resumed mid-way reports its steps since the
    # resume (docs/fault-tolerance.md).
    for key in ("val_loss", "val_accuracy"):
        assert final["history"][key] == reference["history"][key]
    assert len(final["history"]["loss"]) == 2


@pytest.mark.parametrize("keras", ["3"])  # the rule is the trainer's; Keras 2: test_elastic.py
def test_resume_on_another_number_of_ranks_rescales_the_step(keras, tmp_path):
    args, ckpt, metrics = _job(2, tmp_path, "elastic", keras=keras)
    run_until(launch_argv(2, "gloo") + [sys.executable, *args], r"\(epoch 1, step 8 of", str(ckpt))
    proc = run_job(1, "none", args)
    m = json.loads(metrics.read_text())
    # 8 steps x 64 samples on 2 ranks = 16 steps x 32 samples on 1 rank, of 32 per epoch.
    assert m["resumed_from"] == {
        "epoch": 1, "step": 8, "checkpoint": "epoch-0001-step-000008", "optimizer_iterations": 16
    }  # fmt: skip
    assert m["steps_per_epoch"] == 32 and m["optimizer_iterations"] == 64
    assert "The global batch changed" in proc.stderr


def test_resume_step_rule():
    saved = {"epoch": 3, "step": 8, "global_batch": 64}
    assert resume_step(saved, 16, 64) == 3 * 16 + 8
    assert resume_step(saved, 32, 32) == 3 * 32 + 16  # half the ranks: twice the steps
    assert resume_step(saved, 8, 128) == 3 * 8 + 4
    assert resume_step({"epoch": 3, "step": 0}, 10, 64) == 30
    assert resume_step(dict(saved, step=15), 16, 64, accumulate=4) == 3 * 16 + 12
    assert resume_step(dict(saved, step=15), 4, 512) == 3 * 4 + 1


SAVER = """
import sys, tensorflow as tf
from hvdtrain.recipe.checkpoint import CheckpointManager
model = tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(2048),
                             tf.keras.layers.Dense(10)])
opt = tf.keras.optimizers.Adam()
opt.build(model.trainable_variables)
manager = CheckpointManager(sys.argv[1], model, opt, keep=2)
for epoch in range(1, 10_000):
    manager.save(epoch)
    print("saved", epoch, flush=True)
"""


def test_sigkill_during_checkpoint_writes_never_breaks_the_latest(tmp_path):
    import tensorflow as tf

    from hvdtrain.recipe.checkpoint import CheckpointManager

    for attempt in range(3):  # each kill lands at a different point of a write
        d = tmp_path / f"ckpt{attempt}"
        # Killed once it has saved 3 + attempt times: the next save is already under way.
        run_until([sys.executable, "-c", SAVER, str(d)], rf"^saved {3 + attempt}$")
        model = tf.keras.Sequential(
            [tf.keras.Input((64,)), tf.keras.layers.Dense(2048), tf.keras.layers.Dense(10)]
        )
        opt = tf.keras.optimizers.Adam()
        opt.build(model.trainable_variables)
        manager = CheckpointManager(d, model, opt)
        found = manager.latest()
        assert found.epoch >= 3 + attempt
        assert manager.restore(found).epoch == found.epoch


def test_a_full_disk_fails_clearly_and_keeps_the_previous_checkpoint(tmp_path):

    import tensorflow as tf

    from hvdtrain.errors import HvdtrainError
    from hvdtrain.recipe.checkpoint import CheckpointManager

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        small = tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(10)])
        opt = tf.keras.optimizers.Adam()
        opt.build(small.trainable_variables)
        CheckpointManager(disk, small, opt).save(1)
        big = tf.keras.Sequential(
            [tf.keras.Input((64,)), tf.keras.layers.Dense(20_000), tf.keras.layers.Dense(10)]
        )  # ~25 MB with Adam's slots
        big_opt = tf.keras.optimizers.Adam()
        big_opt.build(big.trainable_variables)
        with pytest.raises(HvdtrainError, match="previous checkpoints are kept"):
            CheckpointManager(disk, big, big_opt).save(2)
        assert sorted(os.listdir(disk)) == ["epoch-0001"]
        assert CheckpointManager(disk, small, opt).latest().epoch == 1
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_a_changed_global_batch_names_the_data_own_batch(tmp_path):
    """Data that brings its own batch (a Sequence of 32) resumed on another number of ranks:
    the warning names the batch the run trains with, not --batch-size (which it ignores)."""
    args = [worker("python_data.py"), str(tmp_path / "out"), "--checkpoint-dir",
            str(tmp_path / "ck"), "--batch-size", "64"]  # fmt: skip
    run_job(2, "gloo", [*args, "--epochs", "1"])
    proc = run_job(1, "none", [*args, "--epochs", "2"])
    assert "The global batch changed" in proc.stderr
    assert "written with 2 rank(s) x batch 32; this run has 1 x 32" in proc.stderr
