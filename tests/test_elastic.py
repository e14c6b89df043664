"""Elastic training (`--elastic`): the `hvdtrain-run --elastic` command builder, Horovod's
elastic pitfalls in one process, and real jobs on this host under horovodrun --gloo: a
worker killed mid-training, a worker that joins later.

Horovod blacklists the host of a worker that fails, and a job whose workers were all on that
host ends; the kill test therefore runs its two workers as two hosts of this machine,
`localhost` and `127.0.0.1` (both run without ssh).
"""

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import ROOT, Lines, job_env, worker

from hvdtrain.errors import HvdtrainError
from hvdtrain.launcher import cli
from hvdtrain.launcher import elastic as launcher
from hvdtrain.launcher.commands import LaunchConfig
from hvdtrain.launcher.hosts import Host

RUN = os.path.join(os.path.dirname(sys.executable), "hvdtrain-run")
CMD = ("python", "-m", "hvdtrain.mnist", "--elastic")
JOB_TIMEOUT = 420  # a whole elastic job, kills and joins included; a hang fails the test
# Small jobs: 1280 samples of batch 32 are 20 steps per epoch on 2 ranks, 40 on 1.
TRAIN = ["--epochs", "3", "--limit-samples", "1280", "--threads", "1", "--commit-every", "5"]
QUIET = ("env", "HOROVOD_LOG_LEVEL=WARNING")  # the workers' Horovod core as without --log-level
ELASTIC_ENV = {"HOROVOD_ELASTIC_TIMEOUT": "60", "HOROVOD_GLOO_TIMEOUT_SECONDS": "60"}


# -- the command builder (no processes) ---------------------------------------------------
def _config(argv, environ=None):
    args = cli.parse_args(argv)
    environ = {"PATH": "/usr/bin"} if environ is None else environ
    return launcher.make_config(args, environ, cli.make_config, cli.resolve_hosts, "/venv/py")


def _argv(argv, environ=None):
    config, spec = _config(argv, environ)
    out, env = launcher.build_command(config, spec, {"PATH": "/usr/bin"}, program="horovodrun")
    return out, spec


def test_discovery_script_is_passed_as_given():
    argv, spec = _argv(
        ["--elastic", "--min-np", "2", "--max-np", "8", "--host-discovery-script", "./d.sh",
         "--network-interface", "eth0", "--", *CMD]
    )  # fmt: skip
    assert argv == [
        "horovodrun", "--gloo", "-np", "2", "--min-np", "2", "--max-np", "8",
        "--host-discovery-script", "./d.sh", "--log-level", "INFO", "--network-interfaces",
        "eth0", *QUIET, *CMD,
    ]  # fmt: skip
    assert spec.warnings == ()


def test_hostfile_becomes_a_live_discovery_command(tmp_path):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("# two dialects\nnode1 slots=4\nnode2:2\n")
    argv, _ = _argv(
        ["--elastic", "--hostfile", str(hostfile), "--elastic-timeout", "60", "--reset-limit",
         "3", "--blacklist-cooldown-range", "10", "120", "--", *CMD]
    )  # fmt: skip
    discover = f"/venv/py -m hvdtrain.launcher.elastic --hostfile {hostfile}"
    assert argv == [
        "horovodrun", "--gloo", "-np", "1", "--min-np", "1", "--max-np", "6",
        "--host-discovery-script", discover, "--elastic-timeout", "60", "--reset-limit", "3",
        "--blacklist-cooldown-range", "10", "120", "--log-level", "INFO", *QUIET, *CMD,
    ]  # fmt: skip
    # What Horovod reads each second: the file as it is then.
    out = subprocess.run(
        [sys.executable, "-m", "hvdtrain.launcher.elastic", "--hostfile", str(hostfile)],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert out.stdout == "node1:4\nnode2:2\n" and out.returncode == 0
    hostfile.write_text("node1 slots=4\nnode3\n")
    out = subprocess.run(
        ["sh", "-c", discover.replace("/venv/py", sys.executable)],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert out.stdout == "node1:4\nnode3:1\n"


def test_hosts_and_this_host_become_printf_and_one_host_gets_lo_and_a_warning():
    argv, spec = _argv(["--elastic", "-np", "2", "-H", "a:2,b:2", "--", *CMD])
    assert argv == [
        "horovodrun", "--gloo", "-np", "2", "--min-np", "1", "--max-np", "4",
        "--host-discovery-script", r"printf '%s\n' a:2 b:2", "--log-level", "INFO", *QUIET,
        *CMD,
    ]  # fmt: skip
    argv, spec = _argv(["--elastic", "--max-np", "2", "--", *CMD])
    assert argv == [
        "horovodrun", "--gloo", "-np", "1", "--min-np", "1", "--max-np", "2",
        "--host-discovery-script", r"printf '%s\n' localhost:2", "--log-level", "INFO",
        "--network-interfaces", "lo", *QUIET, *CMD,
    ]  # fmt: skip
    assert "blacklists its whole host" in spec.warnings[0]
    out = subprocess.run(["sh", "-c", argv[9]], capture_output=True, text=True, timeout=60)
    assert out.stdout == "localhost:2\n"


def test_dry_run_prints_the_elastic_line():
    out = subprocess.run(
        [RUN, "--dry-run", "--elastic", "-H", "localhost:1,127.0.0.1:1", "--", *CMD],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "--gloo -np 1 --min-np 1 --max-np 2 --host-discovery-script" in out.stdout
    assert "--log-level INFO --network-interfaces lo env HOROVOD_LOG_LEVEL=WARNING" in out.stdout
    assert "warning" not in out.stderr  # two host names: a failure blacklists one of them


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--min-np", "2"], "--min-np needs --elastic"),
        (["--elastic", "--backend", "mpi"], "gloo with --elastic"),
        (["--elastic", "-np", "5", "-H", "a:2,b:2"], "from --min-np 1 to --max-np 4"),
        (["--elastic", "--min-np", "3", "--max-np", "2", "-H", "a:2,b:2"], "at most --max-np"),
        (["--elastic", "--max-np", "9", "-H", "a:2,b:2"], "at most 4, the total slots"),
        (["--elastic", "-H", "a:2", "--host-discovery-script", "d.sh"], "both name the hosts"),
        (["--elastic", "-H", "node1:4"], "needs --network-interface"),
        (["--elastic", "--min-np", "0"], "`--min-np`: received '0'; expected a positive integer"),
        (["--elastic", "--blacklist-cooldown-range", "9", "3"], "MIN <= MAX"),
    ],
)
def test_bad_elastic_options(argv, match):
    with pytest.raises(HvdtrainError, match=match):
        _config([*argv, "--", *CMD])


def test_builder_keeps_every_other_horovodrun_option():
    config = LaunchConfig(
        backend="gloo", np=2, hosts=(Host("a", 2),), command=CMD,
        tunables={"cycle_time_ms": 2.5}, ssh_port=2222,
    )  # fmt: skip
    spec = launcher.ElasticSpec(min_np=1, max_np=None, discovery="d.sh")
    argv, _ = launcher.build_command(config, spec, {}, program="horovodrun")
    assert argv == [
        "horovodrun", "--gloo", "-np", "2", "--min-np", "1", "--host-discovery-script", "d.sh",
        "--log-level", "INFO", "--cycle-time-ms", "2.5", "-p", "2222", *QUIET, *CMD,
    ]  # fmt: skip


def test_entry_point_flags():
    from hvdtrain import mnist

    args = mnist.parse_args(["--elastic", "--commit-every", "3"])
    assert args.elastic and args.commit_every == 3
    assert not mnist.parse_args([]).elastic
    with pytest.raises(HvdtrainError, match="`--accumulate`.*1 with --elastic"):
        mnist.parse_args(["--elastic", "--accumulate", "2"])
    with pytest.raises(HvdtrainError, match="`--commit-every`"):
        mnist.parse_args(["--elastic", "--commit-every", "0"])


# -- Horovod's pitfalls, one process ------------------------------------------------------
def test_horovod_elastic_pitfalls_and_their_fixes(tmp_path):
    out = tmp_path / "checks.json"
    proc = subprocess.run(
        [sys.executable, worker("elastic_checks.py"), str(out)],
        # Gloo alone: a reset shuts Horovod down and starts it again, which MPI cannot.
        env=job_env(HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo"),
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    close = pytest.approx
    # From 2 ranks to 1: the rate must halve (0.02 -> 0.01).
    assert r["lr_steps_schedule_given"] == [close(0.02), close(0.02)]  # a copy was changed
    assert r["lr_steps_repointed"] == [close(0.02), close(0.02)]  # the traced step kept it
    assert r["lr_steps_hvdtrain"] == [close(0.02), close(0.01)]
    # fit(initial_epoch=1) runs epoch 2: 2 epochs done (horovod#2844: Horovod says 3).
    assert r["horovod_state"]["epoch"] == 3 and r["hvdtrain_state"]["epoch"] == 2
    # 3 steps after a restart 2 steps into the epoch: 5 done (Horovod: index 2).
    assert r["horovod_state"]["batch"] == 2 and r["hvdtrain_state"]["batch"] == 5
    # A non-Horovod UnknownError: Horovod's run() returns None, hvdtrain's raises it.
    assert r["horovod_run_returns"] == "None"
    assert r["hvdtrain_run_raises"] == "UnknownError: a bug in a loader"
    # A broadcast failing while rank 0's state is synchronised: fatal, then rolled back.
    assert r["horovod_sync_failure"] == "UnknownError" and r["hvdtrain_sync_failure"] == "trained"


# -- real elastic jobs --------------------------------------------------------------------
class Job:
    """`hvdtrain-run ...` in its own session; its output read line by line in a thread."""

    def __init__(self, argv, marker, **env):
        self.marker = marker
        self.proc = subprocess.Popen(
            [RUN, *argv],
            env=job_env(**ELASTIC_ENV, **env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            start_new_session=True,
        )
        self.start = time.monotonic()
        self.out = Lines(self.proc, on_fail=self.kill)
        self.wait_for = self.out.wait_for  # new lines only: waits for the event, not a time

    def finish(self, timeout=JOB_TIMEOUT):
        """Waits for the end of the job and its output; returns the exit code."""
        code = self.out.rest(timeout)
        self.seconds = time.monotonic() - self.start
        return code

    def output(self):
        return "".join(self.out.lines)

    def workers(self):
        """The training processes of this job (python -m hvdtrain.mnist, with our marker)."""
        found = []
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if cmd[1:3] == ["-m", "hvdtrain.mnist"] and any(self.marker in a for a in cmd):
                found.append(p)
        return found

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in self.workers():
            with contextlib.suppress(psutil.NoSuchProcess):  # ended meanwhile (killpg above)
                p.kill()


def _env_rank(process):
    return int(process.environ().get("HOROVOD_RANK", "-1"))


@pytest.fixture
def jobs():
    started = []
    yield started
    for job in started:  # nothing outlives a test, even a failed one
        job.kill()


def discovery(hosts, first):
    """A discovery script printing the file `hosts`, which starts as `first`."""
    hosts.write_text(first)
    script = hosts.with_name("discover.sh")
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    return script


def set_hosts(hosts, text):
    """The discovery script sees one file or the other, never half."""
    tmp = hosts.with_suffix(".new")
    tmp.write_text(text)
    os.replace(tmp, hosts)


@pytest.mark.parametrize("victim, keras", [(1, "2"), (0, "3")])  # each victim, each Keras
def test_killed_worker_training_goes_on_from_the_last_commit(victim, keras, tmp_path, jobs):
    metrics, ckpt = tmp_path / "m.json", tmp_path / "ckpt"
    job = Job(
        ["--elastic", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1", "--", sys.executable,
         "-m", "hvdtrain.mnist", "--elastic", *TRAIN, "--checkpoint-every", "7",
         "--checkpoint-dir", str(ckpt), "--metrics-json", str(metrics), "--keras", keras],
        marker=str(metrics),
    )  # fmt: skip
    jobs.append(job)
    job.wait_for(r"elastic: training on 2 rank\(s\)")
    # Between two commits (every 5 steps): global step 28 of 20 per epoch.
    job.wait_for(r"saved checkpoint .*epoch-0002-step-000008 \(epoch 2, step 8 of 20\)")
    workers = {_env_rank(p): p for p in job.workers()}
    assert sorted(workers) == [0, 1], job.output()
    survivor = workers[1 - victim].pid
    lost = workers[victim].environ()["HOROVOD_HOSTNAME"]  # localhost or 127.0.0.1
    workers[victim].send_signal(signal.SIGKILL)
    code = job.finish()
    out = job.output()
    assert code == 0, out[-6000:]
    print(f"kill of rank {victim}: {job.seconds:.0f} s")

    m = json.loads(metrics.read_text())
    e = m["elastic"]
    assert m["keras"].startswith(f"Keras {keras}")
    # Training went on alone: one rank, steps, LR and global batch for one rank.
    assert m["size"] == 1 and [r["pid"] for r in m["ranks"]] == [survivor]
    assert m["steps_per_epoch"] == 40 and m["global_batch_size"] == 32
    assert m["lr_scaled"] == pytest.approx(1e-3)
    assert m["lr_final"] == pytest.approx(1e-3 * 0.25)  # the main job's cosine decay, epoch 3
    assert m["warmup_steps"] == 40 and m["optimizer_iterations"] == 3 * 40
    assert len(m["history"]["loss"]) == 3 and m["test_accuracy"] > 0.5
    # One reset, back to the last commit and no further.
    (reset,) = e["resets"]
    assert reset["reason"] == "a worker failed"
    assert (reset["size_before"], reset["size_after"]) == (2, 1)
    assert reset["restored"] == {k: reset["last_commit"][k] for k in ("epoch", "batch", "step")}
    assert reset["last_commit"]["step"] >= 20 + 5  # the commit before epoch 2, step 8
    redone = reset["interrupted_at"]["step"] - reset["restored"]["step"]
    assert redone == reset["redone_steps"] and 0 <= redone <= 5  # --commit-every 5
    print(f"steps done again after the kill: {redone}; {reset}")
    # Each start follows the size: steps, global batch, LR; the samples seen are kept.
    before, after = e["starts"][-2:]
    assert (before["size"], before["steps_per_epoch"], before["lr_scaled"]) == (2, 20, 2e-3)
    assert (after["size"], after["steps_per_epoch"], after["lr_scaled"]) == (1, 40, 1e-3)
    assert after["rank"] == 0 and after["epoch"] == reset["restored"]["epoch"]
    assert after["batch"] == min(reset["restored"]["batch"] * 2, 39)
    assert after["step"] == after["epoch"] * 40 + after["batch"]
    assert "elastic: a worker failed; 2 -> 1 rank(s)" in out
    assert f"hvdtrain-run: host {lost} is left out for the rest of this job" in out, out[-3000:]
    assert "INFO:root:" not in out  # the driver's other INFO lines are left out
    assert "Horovod initialized" not in out  # and the workers' core did not log at INFO
    # Rank 0's checkpoints went on, written by whoever was rank 0: the survivor at the end.
    final = json.loads((ckpt / "epoch-0003" / "manifest.json").read_text())
    assert final["written_by"]["pid"] == survivor and final["size"] == 1
    assert os.path.exists(ckpt / "model.keras")


@pytest.mark.parametrize("keras", [pytest.param("2", marks=pytest.mark.slow), "3"])
def test_worker_that_joins_is_synchronised_and_trains(keras, tmp_path, jobs):
    metrics, hosts = tmp_path / "m.json", tmp_path / "hosts.txt"
    script = discovery(hosts, "localhost:1\n")
    job = Job(
        ["--elastic", "--min-np", "1", "--max-np", "2", "--host-discovery-script", str(script),
         "--network-interface", "lo", "--", sys.executable, "-m", "hvdtrain.mnist",
         "--elastic", *TRAIN, "--epochs", "4", "--limit-samples", "2560",
         "--metrics-json", str(metrics), "--keras", keras],
        marker=str(metrics),
    )  # fmt: skip
    jobs.append(job)
    job.wait_for(r"elastic: training on 1 rank\(s\)")
    joined_at = time.monotonic()
    set_hosts(hosts, "localhost:2\n")
    job.wait_for(r"elastic: hosts changed; 1 -> 2 rank\(s\)")
    join_seconds = time.monotonic() - joined_at
    code = job.finish()
    out = job.output()
    assert code == 0, out[-6000:]
    print(f"join: {job.seconds:.0f} s in all, {join_seconds:.0f} s from the new host to 2 ranks")

    m = json.loads(metrics.read_text())
    e = m["elastic"]
    assert m["keras"].startswith(f"Keras {keras}")
    assert m["size"] == 2 and sorted(r["rank"] for r in m["ranks"]) == [0, 1]
    assert len({r["pid"] for r in m["ranks"]}) == 2
    # The new worker got rank 0's weights and optimizer state, and trained in step with it.
    assert len({r["weights_digest"] for r in m["ranks"]}) == 1
    assert len({r["optimizer_digest"] for r in m["ranks"]}) == 1
    (reset,) = e["resets"]
    assert reset["reason"] == "hosts changed" and reset["redone_steps"] == 0
    assert (reset["size_before"], reset["size_after"]) == (1, 2)
    assert reset["restored"] == {k: reset["last_commit"][k] for k in ("epoch", "batch", "step")}
    before, after = e["starts"]
    assert (before["size"], before["steps_per_epoch"], before["lr_scaled"]) == (1, 80, 1e-3)
    assert (after["size"], after["steps_per_epoch"], after["lr_scaled"]) == (2, 40, 2e-3)
    assert after["batch"] == reset["restored"]["batch"] // 2  # the same samples seen
    assert m["steps_per_epoch"] == 40 and m["lr_scaled"] == pytest.approx(2e-3)
    assert m["optimizer_iterations"] == 4 * 40 and len(m["history"]["loss"]) == 4


@pytest.mark.slow
@pytest.mark.parametrize("keras", ["3"])  # Keras 2 joins in the test above
def test_a_worker_that_joined_finishes_alone_with_the_whole_jobs_record(keras, tmp_path, jobs):
    """One worker starts, a second joins (another host name of this machine), the first is
    killed: the one that joined ends the job as rank 0, and its metrics describe the whole
    job (every epoch, both resets, the job's wall time), not only its own process."""
    metrics, hosts = tmp_path / "m.json", tmp_path / "hosts.txt"
    script = discovery(hosts, "localhost:1\n")
    job = Job(
        ["--elastic", "--min-np", "1", "--max-np", "2", "--host-discovery-script", str(script),
         "--network-interface", "lo", "--", sys.executable, "-m", "hvdtrain.mnist", "--elastic",
         *TRAIN, "--epochs", "6", "--keras", keras,
         "--metrics-json", str(metrics)],
        marker=str(metrics),
    )  # fmt: skip
    jobs.append(job)
    job.wait_for(r"elastic: training on 1 rank\(s\)")
    training = time.monotonic()
    (first,) = job.workers()
    job.wait_for(r"hvdtrain: epoch 1/6: ")  # an epoch at 1 rank
    set_hosts(hosts, "localhost:1\n127.0.0.1:1\n")
    alone = time.monotonic() - training  # before this, the second worker did not exist
    job.wait_for(r"elastic: hosts changed; 1 -> 2 rank\(s\)")
    job.wait_for(r"hvdtrain: epoch \d/6: ")  # an epoch at 2 ranks, committed
    first.kill()
    code = job.finish()
    out = job.output()
    assert code == 0, out[-6000:]
    m = json.loads(metrics.read_text())
    e = m["elastic"]
    (last,) = m["ranks"]
    assert last["pid"] != first.pid and m["size"] == 1  # the worker that joined
    assert m["keras"].startswith(f"Keras {keras}")
    assert [(r["reason"], r["size_before"], r["size_after"]) for r in e["resets"]] == [
        ("hosts changed", 1, 2),
        ("a worker failed", 2, 1),
    ]
    assert all(0 <= r["redone_steps"] <= 5 for r in e["resets"]), e["resets"]
    assert len(m["history"]["loss"]) == 6 and m["optimizer_iterations"] == 6 * 40
    assert e["commits"] >= 6 and e["last_commit"]["epoch"] == 6
    # The job's wall time began with the first worker, before the second one existed.
    job_wall, own = m["wall_seconds"], e["process_wall_seconds"]
    assert job_wall - own > alone - 1, (job_wall, own, alone)
    print(f"job {job_wall:.0f} s; the last worker's own process {own:.0f} s")


@pytest.mark.slow
@pytest.mark.parametrize("keras, data", [("2", "arrays")])  # Keras 3's elastic: the join, the kill
def test_elastic_recipe_of_a_users_script_with_the_watchdog_on(keras, data, tmp_path, jobs):
    """A user's script (tests/workers/recipe.py: its own model and data, arrays or a Keras 3
    `PyDataset`) through `hvdtrain.fit(elastic=True)`, several steps per execution: rank 1
    stops making progress mid-epoch; its watchdog ends it after the stall time, and rank 0
    goes on alone from the last commit (a `PyDataset` then sharded over 1 rank)."""
    metrics = tmp_path / "m.json"
    job = Job(
        ["--elastic", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1", "--", sys.executable,
         worker("recipe.py"), "--elastic", "--epochs", "3", "--commit-every", "5",
         "--stall-at", "20", "--threads", "1", "--metrics-json", str(metrics), "--keras", keras,
         "--data", data],
        marker=str(metrics),
        HVDTRAIN_STALL_SHUTDOWN_SECONDS="5",
    )  # fmt: skip
    jobs.append(job)
    job.wait_for(r"rank 1: stalling after step 20")
    job.wait_for(r"hvdtrain: rank 1 made no progress for \d+ s")
    job.wait_for(r"elastic: a worker failed; 2 -> 1 rank\(s\)")
    assert job.finish() == 0, job.output()[-6000:]
    m = json.loads(metrics.read_text())
    assert m["size"] == 1 and m["steps_per_execution"] > 1  # both in the elastic run
    assert m["keras"].startswith(f"Keras {keras}")
    (reset,) = m["elastic"]["resets"]
    assert 0 <= reset["redone_steps"] <= 5 + m["steps_per_execution"] - 1
    assert m["optimizer_iterations"] == 3 * m["steps_per_epoch"] and m["test_samples"] == 101


def test_launch_args_namespace_is_not_mutated():
    args = cli.parse_args(["--elastic", "-H", "localhost:2", "--", *CMD])
    before = dict(vars(args))
    launcher.make_config(args, {}, cli.make_config, cli.resolve_hosts)
    assert vars(args) == before and isinstance(args, argparse.Namespace)
