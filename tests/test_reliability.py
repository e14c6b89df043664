"""Nothing lost to a bad path, a diverging run or a damaged checkpoint folder.

Real processes (`python -m hvdtrain.mnist`, tests/workers/recipe.py), one rank or two under
`horovodrun --gloo`; each asserts the exit status, one line of error without a traceback,
and what is on disk afterwards.
"""

import hashlib
import json
import os
import re
import subprocess
import sys
import time

import pytest
from conftest import job_env, run_job, worker

MNIST = ["-m", "hvdtrain.mnist", "--limit-samples", "512", "--progress", "off"]
RECIPE = worker("recipe.py")
STARTUP = 60  # seconds for 2 ranks to start (TensorFlow's import) on a loaded machine


def strict_json(path):
    def refuse(name):
        raise ValueError(f"{path} is not valid JSON: {name}")

    with open(path) as f:
        return json.loads(f.read(), parse_constant=refuse)


def error_lines(proc):
    """The error lines; no rank printed a traceback (horovodrun's own, after a rank failed,
    is the launcher's)."""
    text = (proc.stdout + proc.stderr).splitlines()
    tagged = [line.split(">:", 1)[1] for line in text if re.match(r"\[\d+\]<std...>:", line)]
    assert not any(line.startswith("Traceback") for line in tagged or text), proc.stderr[-3000:]
    return [line for line in proc.stderr.splitlines() if ": error: " in line]


def digest(folder):
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        h.update(name.encode() + open(os.path.join(folder, name), "rb").read())
    return h.hexdigest()


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "flag, path, words",
    [
        ("--metrics-json", "/proc/hvdtrain/m.json", "`--metrics-json`: received '/proc/hvdtrain"),
        ("--log-dir", "/proc/hvdtrain-tb", "`--log-dir`: received '/proc/hvdtrain-tb'"),
        ("--metrics-json", "{file}/m.json", "expected a file hvdtrain can write"),
    ],
)
def test_a_bad_output_path_fails_before_the_first_step(tmp_path, flag, path, words):
    (tmp_path / "file").write_text("a file, not a folder")
    ckpt = tmp_path / "ckpt"
    path = path.format(file=tmp_path / "file")
    proc = run_job(1, "none", [*MNIST, "--checkpoint-dir", str(ckpt), flag, path], check=False)
    lines = error_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1 and words in lines[0], proc.stderr[-2000:]
    assert "training on" not in proc.stderr and os.listdir(ckpt) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_history_is_kept_across_resumes_and_a_diverging_run_stops_on_every_rank(tmp_path):
    """Epoch 1, then resumed for epoch 2, then the finished job run again: the metrics JSON
    holds both epochs each time. Then `--lr 1e30` for a third epoch: every rank stops at the
    same step (no hang), exit status 3 from the ranks, one error line, the epoch-2
    checkpoint untouched and nothing written after it, the metrics JSON valid with
    `status: diverged` and the two good epochs."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.json"
    args = [*MNIST, "--checkpoint-dir", str(ckpt), "--metrics-json", str(metrics)]
    for epochs, resumed in ((1, False), (2, True), (2, True)):
        run_job(2, "gloo", [*args, "--epochs", str(epochs)])
        out = strict_json(metrics)
        assert out["status"] == "finished" and bool(out["resumed_from"]) == resumed
        assert len(out["history"]["loss"]) == len(out["history"]["val_accuracy"]) == 2 or (
            epochs == 1 and len(out["history"]["loss"]) == 1
        )
    good = digest(ckpt / "epoch-0002")
    proc = run_job(2, "gloo", [*args, "--epochs", "3", "--lr", "1e30"], check=False)
    lines = error_lines(proc)
    assert proc.returncode != 0 and "Exit code: 3" in proc.stderr + proc.stdout
    assert len(lines) == 1 and "training diverged: the weights at epoch 3" in lines[0], lines
    assert sorted(os.listdir(ckpt)) == ["epoch-0001", "epoch-0002", "model.keras"]
    assert digest(ckpt / "epoch-0002") == good
    out = strict_json(metrics)
    assert out["status"] == "diverged" and "training diverged" in out["error"]
    assert len(out["history"]["loss"]) == 2


@pytest.mark.timeout(300)
def test_a_diverging_keras3_run_stops_on_every_rank_and_keeps_the_checkpoint(tmp_path):
    """The same stop on the Keras 3 path: a good epoch, then `--lr 1e30`."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.json"
    args = [*MNIST, "--keras", "3", "--checkpoint-dir", str(ckpt), "--metrics-json", str(metrics)]
    run_job(2, "gloo", [*args, "--epochs", "1"])
    good = digest(ckpt / "epoch-0001")
    proc = run_job(2, "gloo", [*args, "--epochs", "2", "--lr", "1e30"], check=False)
    lines = error_lines(proc)
    assert proc.returncode != 0 and "Exit code: 3" in proc.stderr + proc.stdout
    assert len(lines) == 1 and "training diverged: the " in lines[0], lines
    assert "at epoch 2" in lines[0], lines
    assert sorted(os.listdir(ckpt)) == ["epoch-0001", "model.keras"]
    assert digest(ckpt / "epoch-0001") == good
    out = strict_json(metrics)
    assert out["status"] == "diverged" and out["keras"] == "Keras 3"


@pytest.mark.timeout(200)
def test_a_failed_write_after_training_keeps_the_model_and_says_what_was_written(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "out" / "m.json"
    proc = run_job(
        1,
        "none",
        [RECIPE, "--epochs", "1", "--checkpoint-dir", str(ckpt), "--metrics-json", str(metrics),
         "--spoil-metrics-folder"],
        check=False,
    )  # fmt: skip
    lines = error_lines(proc)
    assert proc.returncode == 4 and len(lines) == 1, proc.stderr[-3000:]
    assert f"could not write the metrics {metrics}" in lines[0]
    assert f"written: the model {ckpt / 'model.keras'}" in lines[0]
    assert (ckpt / "model.keras").is_file() and (ckpt / "epoch-0001").is_dir()


@pytest.mark.timeout(200)
def test_require_resume_refuses_a_folder_of_damaged_checkpoints(tmp_path):
    ckpt = tmp_path / "ckpt"
    for name in ("epoch-0002", "epoch-9999"):
        (ckpt / name).mkdir(parents=True)
        (ckpt / name / "manifest.json").write_text("{damaged")
    proc = run_job(
        1, "none", [*MNIST, "--checkpoint-dir", str(ckpt), "--require-resume"], check=False
    )
    lines = error_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert f"nothing to resume from in --checkpoint-dir {ckpt}: 2 checkpoint folder(s)" in lines[0]
    assert "(epoch-9999, epoch-0002)" in lines[0]
    assert sorted(os.listdir(ckpt)) == ["epoch-0002", "epoch-9999"]
    # Without --require-resume: one warning says so, training starts over, the folders stay.
    proc = run_job(1, "none", [*MNIST, "--epochs", "1", "--checkpoint-dir", str(ckpt)])
    found = [line for line in proc.stderr.splitlines() if "no usable checkpoint" in line]
    assert len(found) == 1 and f"no usable checkpoint in {ckpt}: 2 checkpoint" in found[0], found
    assert "(epoch-9999, epoch-0002)" in found[0] and "starting from scratch" in found[0], found
    assert "--require-resume refuses to start over" in found[0], found
    assert "skipping damaged" not in proc.stderr  # one line, not one per folder
    assert sorted(os.listdir(ckpt)) == ["epoch-0001", "epoch-0002", "epoch-9999", "model.keras"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_a_rank_stuck_loading_its_data_ends_the_job(tmp_path, backend):
    """Before the first collective (in the user's data function), rank 1 never returns.
    Horovod's stall shutdown acts first (after one stall time), marking rank 1 with `!`,
    under Gloo too since hvdtrain's patch (before, the run's watchdog ended it after 10
    stall times there). The whole job is bounded: 12 stall times (36 s, when the waiting
    rank's watchdog would give up) after the set-up began, and the start."""
    since = time.monotonic()
    proc = run_job(
        2,
        backend,
        [RECIPE, "--stall-in-data", "--checkpoint-dir", str(tmp_path / "ckpt")],
        check=False,
        HVDTRAIN_STALL_SHUTDOWN_SECONDS="3",
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "rank 1: stalling while loading the data" in text
    assert "1!: [HorovodAllgather]" in text and "rank 0 stopped: Horovod was shut down" in text
    assert os.listdir(tmp_path / "ckpt") == []
    took = time.monotonic() - since
    assert took < 36 + STARTUP, f"the stuck job took {took:.0f} s to end"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("keras", ["3"])  # Keras 2: test_resume.py's full disk
def test_a_full_disk_during_a_checkpoint_ends_every_rank_and_keeps_the_previous(tmp_path, keras):
    """A 4 MB tmpfs as --checkpoint-dir, filled when epoch 2 begins: the epoch-2 checkpoint
    fails on rank 0 with one line; every rank exits non-zero (no hang); epoch 1's
    checkpoint is intact and still the one a resume takes."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        proc = run_job(
            2,
            "gloo",
            [
                RECIPE,
                "--epochs",
                "3",
                "--checkpoint-dir",
                str(disk),
                "--fill-disk-at-epoch",
                "2",
                "--keras",
                keras,
            ],
            check=False,
        )
        text = proc.stdout + proc.stderr
        lines = error_lines(proc)
        assert proc.returncode != 0 and "rank 0: the disk is full" in text, text[-3000:]
        assert len(lines) == 1 and f"Could not write checkpoint {disk}/epoch-0002" in lines[0]
        assert "The previous checkpoints are kept" in lines[0]
        # Rank 1 ends too: by itself with a non-zero status, or, when horovodrun's SIGTERM to
        # the remaining workers comes first, after its own line saying why it stopped.
        ended = re.search(r"Process 1 exit with status code [1-9]", text)
        assert ended or "[1]<stderr>:hvdtrain: rank 1 stopped: " in text, text[-3000:]
        # Rank 0 leaves at once with its line: the others are not left waiting in the next
        # step's collective until Horovod's stall check (which once ended this job).
        assert "waiting for remainder of ranks" not in text, text[-3000:]
        assert sorted(os.listdir(disk)) == ["epoch-0001", "filler"]
        (disk / "filler").unlink()
        again = run_job(
            2, "gloo", [RECIPE, "--epochs", "1", "--checkpoint-dir", str(disk), "--keras", keras]
        )
        # Epoch 1's checkpoint is all of an --epochs 1 job: evaluated, not trained again.
        assert "is after epoch 1: all 1 epoch(s) trained" in again.stdout + again.stderr
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)  # -l: even while busy


@pytest.mark.timeout(240)
@pytest.mark.skipif(os.getuid() != 0, reason="needs root for `unshare --uts` (a hostname)")
def test_an_unresolvable_hostname_under_gloo_is_one_line_not_a_segfault():
    """Horovod's Gloo dies with SIGSEGV (exit 139, no word) when the host's own name does not
    resolve; `hvdtrain.init` says so first, on each rank: one line, exit 2. MPI is unaffected."""
    name = "hvdtrain-unresolvable-7q"
    launch = [os.path.join(os.path.dirname(sys.executable), "hvdtrain-run"), "-np", "2"]
    script = (
        f"hostname {name} && exec {' '.join(launch)} --backend gloo -- "
        f"{sys.executable} {' '.join(MNIST)} --epochs 1"
    )
    proc = subprocess.run(
        ["unshare", "--uts", "sh", "-c", script],
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = error_lines(proc)
    assert lines and f"this host's name '{name}' does not resolve" in lines[0], proc.stderr
    assert "/etc/hosts" in lines[0] and "SIGSEGV" in lines[0]
