"""A host lost mid-run, on two namespace hosts (one rank each), after the first checkpoint:
every process of host B killed, or B's network cut (MPI and Gloo), and under Elastic B killed,
then back (left out for good here; taken back after a cooldown: test_multihost.py's elastic
chaos test). The job must end within its bound (docs/fault-tolerance.md) with one
`hvdtrain-run` line naming B, no traceback, nothing left on the launch host; a cut B ends its
own rank, and nothing of the job is left there once its network is back; a relaunch while B
is down stops before starting anything, naming B."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, Lines

from hvdtrain.bench.netns import NamespaceHosts, cannot_make_namespaces

why_not = cannot_make_namespaces()
pytestmark = [pytest.mark.skipif(why_not is not None, reason=why_not or ""), pytest.mark.slow]

BOUND = 60  # seconds from the fault to the end of the job (docs/fault-tolerance.md)
RELAUNCH_BOUND = 15  # a relaunch while B is down: ssh's 5 s to connect, and the start
START_TIMEOUT = 300
ELASTIC_ENV = {"HOROVOD_ELASTIC_TIMEOUT": "60", "HOROVOD_GLOO_TIMEOUT_SECONDS": "60"}


@pytest.fixture
def hosts(tmp_path):
    with NamespaceHosts(2, tmp_path / "hosts") as h:
        yield h


def mnist(hosts, hostfile, backend, ckpt, epochs):
    return [
        "hvdtrain-run", "--hostfile", str(hostfile), "--backend", backend,
        "--network-interface", "eth0", "--",
        sys.executable, "-m", "hvdtrain.mnist", "--model", "mlp", "--epochs", str(epochs),
        "--limit-samples", "1280", "--checkpoint-dir", str(ckpt),
    ]  # fmt: skip


def kill_host(hosts, i):
    """SIGKILL every process of namespace host i (its sshd, the sessions, the rank)."""
    for pid in hosts.pids(i):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_and_wait_for_checkpoint(hosts, hostfile, backend, ckpt, **env):
    """The job on host 0 (hvdtrain-run), once its first checkpoint is written."""
    job = subprocess.Popen(
        hosts.inside(0, mnist(hosts, hostfile, backend, ckpt, 500)),
        env=hosts.env(HVDTRAIN_OFFLINE="1", TF_CPP_MIN_LOG_LEVEL="2", **env),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + START_TIMEOUT
    while not (ckpt / "epoch-0001").exists():  # polling for the first checkpoint
        if job.poll() is not None or time.monotonic() > deadline:
            end(job, hosts)
            pytest.fail(f"no checkpoint within {START_TIMEOUT} s: {job.communicate()}")
        time.sleep(0.2)
    return job


def wait_for_end(hosts, job, bound):
    """(exit code, stderr, seconds taken) of `job`, which must end within `bound` + 60 s."""
    since = time.monotonic()
    try:
        _, err = job.communicate(timeout=bound + 60)
    finally:
        end(job, hosts)
    return job.returncode, err, time.monotonic() - since


def end(job, hosts):
    """Ends `job` and whatever it left on host 0 (but its sshd), so nothing holds its pipes."""
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGKILL)
        for pid in set(hosts.pids(0)) - {hosts._sshd[0].pid}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        job.communicate(timeout=60)


def hostfile_of(hosts, tmp_path):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("".join(f"{a} slots=1\n" for a in hosts.addresses))
    return hostfile


def left_on(hosts, i):
    """The command lines of host i's processes but its listening sshd."""
    found = []
    for pid in set(hosts.pids(i)) - {hosts._sshd[i].pid}:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found.append(f.read().replace(b"\0", b" ").decode(errors="replace")[:80])
        except OSError:
            pass  # gone meanwhile
    return found


def training_processes(hosts, i):
    """The pids of host i's processes that run hvdtrain.mnist."""
    found = []
    for pid in hosts.pids(i):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"hvdtrain.mnist" in f.read():
                    found.append(pid)
        except OSError:
            pass
    return found


def check_ending(backend, code, err, took, bound, lost):
    assert code == 255, (code, err[-3000:])  # a lost host (docs/fault-tolerance.md)
    assert took < bound, f"the job ended {took:.0f} s after the fault"
    last = [line for line in err.splitlines() if line.startswith("hvdtrain-run:")][-1]
    print(f"{backend}: ended {took:.1f} s after the fault, exit {code}: {last}")
    assert lost in last and "rank 1" in last, err[-4000:]
    assert "Traceback" not in err, err[-4000:]


def check_relaunch_stops(hosts, hostfile, backend, ckpt, lost):
    since = time.monotonic()
    again = hosts.run(0, mnist(hosts, hostfile, backend, ckpt, 500), timeout=60)
    took = time.monotonic() - since
    assert again.returncode == 5, again.stderr[-3000:]
    (line,) = again.stderr.splitlines()
    assert line.startswith(f"hvdtrain-run: error: cannot reach {lost} (rank 1):"), line
    assert took < RELAUNCH_BOUND, f"the relaunch took {took:.1f} s to stop"


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_a_killed_host_ends_the_job_naming_it_and_a_relaunch_stops_before_starting(
    hosts, backend, tmp_path
):
    hostfile, ckpt, lost = hostfile_of(hosts, tmp_path), tmp_path / "ckpt", hosts.addresses[1]
    job = start_and_wait_for_checkpoint(hosts, hostfile, backend, ckpt)
    kill_host(hosts, 1)
    code, err, took = wait_for_end(hosts, job, BOUND)
    check_ending(backend, code, err, took, BOUND, lost)
    assert training_processes(hosts, 0) == [], "a rank was left running on the launch host"
    assert (ckpt / "epoch-0001" / "manifest.json").exists()  # the checkpoint kept
    check_relaunch_stops(hosts, hostfile, backend, ckpt, lost)


# The network cut, with short timeouts: the watchdog at 2 x 10 s (MPI), Gloo's receive
# timeout at 10 s, then hvdtrain-run's grace of 5 s (+10 s to SIGKILL) and its 5 s ssh probe.
CUT_ENV = {
    "HVDTRAIN_STALL_SHUTDOWN_SECONDS": "10",
    "HOROVOD_GLOO_TIMEOUT_SECONDS": "10",
    "HVDTRAIN_LAUNCHER_GRACE_SECONDS": "5",
}
CUT_BOUND = 75  # docs/fault-tolerance.md: 2 x stall + grace + 10 s + the probe, and margin
BACK_BOUND = 120  # from B's network back to nothing of the job there: TCP's longest backoff


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_a_cut_network_ends_the_job_naming_the_host_and_nothing_runs_on(hosts, backend, tmp_path):
    hostfile, ckpt, lost = hostfile_of(hosts, tmp_path), tmp_path / "ckpt", hosts.addresses[1]
    job = start_and_wait_for_checkpoint(hosts, hostfile, backend, ckpt, **CUT_ENV)
    link = ["ip", "netns", "exec", hosts.names[1], "ip", "link", "set", "eth0"]
    subprocess.run([*link, "down"], check=True, timeout=30)
    cut = time.monotonic()
    code, err, took = wait_for_end(hosts, job, CUT_BOUND)
    check_ending(backend, code, err, took, CUT_BOUND, lost)
    assert training_processes(hosts, 0) == [], "a rank was left running on the launch host"
    assert (ckpt / "epoch-0001" / "manifest.json").exists()
    check_relaunch_stops(hosts, hostfile, backend, ckpt, lost)
    # B's own rank ends by itself (its watchdog, or Gloo's timeout), cut off as it is.
    while training_processes(hosts, 1):  # polling, bounded by the cut's bound
        assert time.monotonic() - cut < CUT_BOUND, "host B's rank is still running"
        time.sleep(0.5)
    print(f"{backend}: B's rank ended by itself {time.monotonic() - cut:.1f} s after the cut")
    # What waits on B for a peer that is gone (its sshd session, Open MPI's daemon) ends once
    # B's network is back: nothing of the job is left there but the sshd that listens.
    subprocess.run([*link, "up"], check=True, timeout=30)
    back = time.monotonic()
    while left_on(hosts, 1):  # polling, bounded
        assert time.monotonic() - back < BACK_BOUND, f"left on B: {left_on(hosts, 1)}"
        time.sleep(0.5)
    print(f"{backend}: nothing left on B {time.monotonic() - back:.1f} s after its network")


def test_elastic_a_killed_host_is_left_out_for_good(hosts, tmp_path):
    """Elastic, host B's every process killed (its sshd too): the job goes on at 1 rank and
    one line says B is left out for the rest of the job. B comes back (its sshd again): the
    job ends at 1 rank, B never used again. (With a cooldown, B taken back after it: the
    elastic chaos test, test_multihost.py.)"""
    hostfile, metrics = hostfile_of(hosts, tmp_path), tmp_path / "m.json"
    epochs = 6  # the convnet: ~2 s an epoch at 1 rank
    argv = [
        "hvdtrain-run", "--elastic", "--min-np", "1", "--hostfile", str(hostfile),
        "--network-interface", "eth0", "--",
        sys.executable, "-m", "hvdtrain.mnist", "--elastic", "--epochs", str(epochs),
        "--limit-samples", "1280", "--commit-every", "5", "--metrics-json", str(metrics),
    ]  # fmt: skip
    job = subprocess.Popen(
        hosts.inside(0, argv),
        env=hosts.env(HVDTRAIN_OFFLINE="1", TF_CPP_MIN_LOG_LEVEL="2", **ELASTIC_ENV),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    out, b = Lines(job), re.escape(hosts.addresses[1])
    try:
        out.wait_for(r"elastic: training on 2 rank\(s\)", START_TIMEOUT)
        out.wait_for(rf"hvdtrain: epoch 1/{epochs}: ", START_TIMEOUT)
        kill_host(hosts, 1)
        fault = time.monotonic()
        out.wait_for(r"elastic: a worker failed; 2 -> 1 rank\(s\)", BOUND)
        reformed = time.monotonic() - fault
        line = out.wait_for(rf"host {b} is left out for the rest of this job", BOUND, True)
        assert "run the job again once the host is fixed" in line, line
        hosts.start_sshd(1)  # B is back
        for _ in range(2):  # the job goes on with B back (Horovod looks for hosts every second)
            out.wait_for(rf"hvdtrain: epoch \d+/{epochs}: ", BOUND)
        code = out.rest(START_TIMEOUT)
    finally:
        end(job, hosts)
    text = "".join(out.lines)
    assert code == 0, text[-6000:]
    assert "EnforceNotMet" not in text and "Traceback" not in text, text[-6000:]
    print(f"elastic, for good: 1 rank {reformed:.1f} s after B was killed")
    m = json.loads(metrics.read_text())
    assert len(m["history"]["loss"]) == epochs
    resets = m["elastic"]["resets"]
    for r in resets:
        assert r["last_commit"] is not None and 0 <= r["redone_steps"] <= 5, r
    said = [int(n) for n in re.findall(r"(-?\d+) step\(s\) to do again", text)]
    assert said == [r["redone_steps"] for r in resets], said  # the log says the same
    # B left out for good, though back: the job ends where it re-formed
    assert m["size"] == 1 and [r["reason"] for r in resets] == ["a worker failed"]
    assert [r["hostname"] for r in m["ranks"]] == [hosts.hostnames[0]]
