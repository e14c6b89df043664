"""`hvdtrain-run doctor`: the probe command, the comparison and the lines (pure), then a
real run against this host and a stand-in `ssh` that runs the probe here."""

import base64
import os
import platform
import re
import shlex
import subprocess
import sys

import pytest

from hvdtrain.launcher.doctor import (
    MARKER,
    PROBE,
    final_line,
    host_line,
    host_problems,
    parse_probe,
    probe_argv,
    run_probe,
)

RUN = os.path.join(os.path.dirname(sys.executable), "hvdtrain-run")
GOOD = {
    "hostname": "n1",
    "executable": "/venv/bin/python",
    "python": "3.11.2",
    "tensorflow": "2.15.1",
    "horovod": "0.28.1",
    "hvdtrain": "0.1.0",
    "build": {"TensorFlow": True, "PyTorch": False, "Gloo": True, "MPI": True, "NCCL": False},
    "gpus": 4,
}


def test_probe_reads_versions_without_importing_tensorflow():
    assert "importlib.metadata" in PROBE and "--check-build" in PROBE
    assert not re.search(r"^\s*(import|from)\s+(tensorflow|horovod)", PROBE, re.MULTILINE)


def test_probe_argv_local_and_ssh():
    local = probe_argv("localhost", "/venv/bin/python", local=True)
    assert local[:2] == ["/venv/bin/python", "-c"] and MARKER in local[2]
    argv = probe_argv("node1", "/opt/py", local=False, ssh_port=2222, ssh_identity_file="/k")
    assert argv[:5] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]
    assert argv[5:10] == ["-p", "2222", "-i", "/k", "node1"]
    python, flag, code = shlex.split(argv[10])
    assert (python, flag) == ("/opt/py", "-c")
    encoded = re.search(r"b64decode\('([A-Za-z0-9+/=]+)'\)", code).group(1)
    assert base64.b64decode(encoded).decode() == local[2]  # the same probe, shell-proof


def test_parse_probe():
    report = parse_probe(0, f'Welcome to node1\n{MARKER}{{"python": "3.11.2"}}\n', "", True)
    assert report == {"python": "3.11.2"}
    assert parse_probe(255, "", "ssh: connect to host n port 22: Connection refused\n", True) == {
        "error": "ssh failed: ssh: connect to host n port 22: Connection refused"
    }
    assert parse_probe(127, "", "sh: 1: /x/python: not found\n", True)["error"] == (
        "probe failed (exit 127): sh: 1: /x/python: not found"
    )
    assert parse_probe(None, "", "", False) == {"error": "the probe timed out"}


def test_host_problems():
    assert host_problems(GOOD, GOOD, slots=4) == []
    other = dict(GOOD, python="3.10.12", horovod="0.28.0", hvdtrain=None, gpus=2)
    other["build"] = dict(GOOD["build"], MPI=False)
    assert host_problems(other, GOOD, slots=4) == [
        "hvdtrain not installed for /venv/bin/python",
        "Python 3.10.12 (launch host: 3.11.2)",
        "Horovod 0.28.0 (launch host: 0.28.1)",
        "Horovod built without MPI",
        "4 slots but 2 GPUs (one process per GPU)",
    ]
    assert host_problems(dict(GOOD, python="3.11.9", gpus=0), GOOD, slots=8) == []  # CPU host
    # Another build of Horovod (its local version is the wheel's key, docs/horovod-wheel.md):
    # unpatched, or patched for another key; its ranks may send no rendezvous token.
    built = dict(GOOD, horovod="0.28.1+hvdtrain.0123456789ab")
    other_build = (
        "is not the launch host's build (0.28.1+hvdtrain.0123456789ab); install the launch "
        "host's wheel there (make horovod-wheel, docs/horovod-wheel.md)"
    )
    assert host_problems(GOOD, built) == [f"Horovod 0.28.1 {other_build}"]
    assert host_problems(dict(GOOD, horovod="0.28.1+hvdtrain.ba9876543210"), built) == [
        f"Horovod 0.28.1+hvdtrain.ba9876543210 {other_build}"
    ]
    assert host_problems(built, built) == []
    assert host_problems({"error": "ssh failed: x"}, GOOD) == ["ssh failed: x"]
    broken = dict(GOOD, build={}, check_build_error="exit 1: boom")
    assert host_problems(broken) == ["horovodrun --check-build failed: exit 1: boom"]
    unnamed = dict(GOOD, hostname_resolves=False)
    assert host_problems(unnamed, GOOD) == [
        "hostname 'n1' does not resolve; add it to /etc/hosts or DNS"
    ]


def test_lines():
    assert host_line("n1", GOOD, [], slots=4) == (
        "n1: ok (Python 3.11.2, TensorFlow 2.15.1, Horovod 0.28.1 [TensorFlow Gloo MPI], "
        "hvdtrain 0.1.0, 4 GPUs, 4 slots)"
    )
    assert host_line("n2", {}, ["a", "b"]) == "n2: problem: a; b"
    # A one-line hostfile is one host (issue 51: it said "2 hosts ready")
    assert final_line([("launch host n0", []), ("n1", [])]) == (
        "doctor: ok: 1 host ready and matching the launch host"
    )
    assert final_line([("launch host n0", []), ("n1", ["x"]), ("n2", ["y"])]) == (
        "doctor: problem on n1, n2 (of 2 hosts and the launch host)"
    )


def test_missing_python_is_a_problem_not_a_crash():
    report = run_probe(probe_argv("localhost", "/no/such/python", local=True), timeout=30)
    assert report == {"error": "cannot run /no/such/python: No such file or directory"}


FAKE_SSH = """#!/bin/sh
# Stand-in for ssh: skips the options, fails for nohost.invalid, runs the rest here.
while [ $# -gt 0 ]; do
  case "$1" in -o|-p|-i) shift 2 ;; *) break ;; esac
done
host=$1; shift
if [ "$host" = nohost.invalid ]; then
  echo "ssh: Could not resolve hostname $host: Name or service not known" >&2
  exit 255
fi
exec sh -c "$*"
"""


@pytest.mark.timeout(300)
def test_doctor_for_real(tmp_path):
    """Runs the real probe (horovodrun --check-build included) on this host, directly and
    through the ssh stand-in, plus an unreachable host: exit 1, one line each."""
    (tmp_path / "ssh").write_text(FAKE_SSH)
    (tmp_path / "ssh").chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    hosts = "localhost:1,fakenode:1,nohost.invalid:1"
    proc = subprocess.run(
        [RUN, "doctor", "-H", hosts], capture_output=True, text=True, timeout=280, env=env
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert len(lines) == 5, lines
    python = re.escape(platform.python_version())
    assert re.match(rf"launch host \S+: ok \(Python {python}, TensorFlow 2\.", lines[0]), lines
    # The set-up's wheel: its local version names the build (docs/horovod-wheel.md).
    assert re.search(r"Horovod 0\.28\.1\+hvdtrain\.[0-9a-f]{12} \[", lines[0]), lines[0]
    assert "Gloo" in lines[0] and "MPI" in lines[0]
    # What was really built: --check-build claims PyTorch here (horovod.torch imports), but
    # no PyTorch extension exists.
    assert "PyTorch" not in lines[0], lines[0]
    assert lines[1].startswith("localhost: ok (") and lines[1].endswith(", 1 slot)")
    assert lines[2].startswith("fakenode: ok (")
    assert lines[3] == (
        "nohost.invalid: problem: ssh failed: "
        "ssh: Could not resolve hostname nohost.invalid: Name or service not known"
    )
    assert lines[4] == "doctor: problem on nohost.invalid (of 3 hosts and the launch host)"
    assert "Traceback" not in proc.stderr
