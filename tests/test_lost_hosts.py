"""A host lost mid-run, on two namespace hosts (one rank each): every process of host B is
killed after the first checkpoint. The job must end within BOUND seconds of the fault with one
`hvdtrain-run` line naming B, no traceback, and a relaunch while B is down must stop before
starting anything, naming B."""

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT
from netns_hosts import NamespaceHosts, cannot_make_namespaces

why_not = cannot_make_namespaces()
pytestmark = [pytest.mark.skipif(why_not is not None, reason=why_not or ""), pytest.mark.slow]

BOUND = 60  # seconds from the fault to the end of the job (README, "Fault tolerance")
START_TIMEOUT = 300


@pytest.fixture
def hosts(tmp_path):
    with NamespaceHosts(2, tmp_path / "hosts") as h:
        yield h


def mnist(hosts, hostfile, backend, ckpt, epochs):
    return [
        "hvdtrain-run", "--hostfile", str(hostfile), "--backend", backend,
        "--network-interface", "eth0", "--",
        sys.executable, "-m", "hvdtrain.mnist", "--model", "mlp", "--epochs", str(epochs),
        "--checkpoint-dir", str(ckpt),
    ]  # fmt: skip


def kill_host(hosts, i):
    """SIGKILL every process of namespace host i (its sshd, the sessions, the rank)."""
    pids = subprocess.run(
        ["ip", "netns", "pids", hosts.names[i]], capture_output=True, text=True, timeout=30
    ).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_a_killed_host_ends_the_job_naming_it_and_a_relaunch_stops_before_starting(
    hosts, backend, tmp_path
):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("".join(f"{a} slots=1\n" for a in hosts.addresses))
    ckpt, lost = tmp_path / "ckpt", hosts.addresses[1]
    job = subprocess.Popen(
        hosts._in(0, mnist(hosts, hostfile, backend, ckpt, 500)),
        env=hosts.env(HVDTRAIN_OFFLINE="1", TF_CPP_MIN_LOG_LEVEL="2"),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not (ckpt / "epoch-0001").exists():  # polling for the first checkpoint
            assert job.poll() is None, job.communicate()
            assert time.monotonic() < deadline, "no checkpoint within the bound"
            time.sleep(0.2)
        kill_host(hosts, 1)
        killed = time.monotonic()
        out, err = job.communicate(timeout=BOUND + 60)
        took = time.monotonic() - killed
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    assert job.returncode == 255, (job.returncode, err[-3000:])  # a lost host (README)
    assert took < BOUND, f"the job ended {took:.0f} s after the fault"
    last = [line for line in err.splitlines() if line.startswith("hvdtrain-run:")][-1]
    print(f"{backend}: ended {took:.1f} s after the fault, exit {job.returncode}: {last}")
    assert lost in last and "rank 1" in last, err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    assert (ckpt / "epoch-0001" / "manifest.json").exists()  # the checkpoint kept

    again = hosts.run(0, mnist(hosts, hostfile, backend, ckpt, 500), timeout=60)
    assert again.returncode == 5, again.stderr[-3000:]
    (line,) = again.stderr.splitlines()
    assert line.startswith(f"hvdtrain-run: error: cannot reach {lost} (rank 1):"), line
