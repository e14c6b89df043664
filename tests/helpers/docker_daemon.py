"""The Docker images' tests share these (tests/test_docker_image.py, tests/test_gpu_image.py):
a private Docker daemon for the module (`docker`), `sh`, and what an image must not hold."""

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import tarfile
import time

import pytest

# HVDTRAIN_DOCKER_DATA: another layer store (e.g. one where an image was built by hand).
DATA_ROOT = os.environ.get("HVDTRAIN_DOCKER_DATA") or os.path.expanduser("~/.cache/hvdtrain/docker")
RUN_TIMEOUT = 420


def cannot_run_docker():
    """Why this machine cannot run a Docker daemon for the tests, or None."""
    if os.geteuid() != 0:
        return "Docker's daemon needs root here"
    for tool, package in (("dockerd", "docker.io"), ("docker", "docker.io"), ("debootstrap",) * 2):
        if not shutil.which(tool):
            hint = f"apt-get install {package}, or launch/setup_host.sh --test as root"
            return f"`{tool}` is not installed ({hint})"
    return None


@pytest.fixture(scope="module")
def docker(tmp_path_factory):
    """The docker command (argv) of a daemon started for this module."""
    reason = cannot_run_docker()
    if reason:
        pytest.skip(reason)
    run = tmp_path_factory.mktemp("dockerd")
    sock = f"unix://{run}/docker.sock"
    os.makedirs(DATA_ROOT, exist_ok=True)
    with open(run / "dockerd.log", "w") as log:
        daemon = subprocess.Popen(
            ["dockerd", "--iptables=false", "--bridge=none", "--data-root", DATA_ROOT,
             "--exec-root", str(run / "exec"), "--pidfile", str(run / "dockerd.pid"),
             "--host", sock],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    cmd = ["docker", "-H", sock]
    try:
        deadline = time.monotonic() + 60
        while subprocess.run([*cmd, "version"], capture_output=True).returncode != 0:
            if daemon.poll() is not None or time.monotonic() > deadline:
                pytest.fail("dockerd did not start:\n" + (run / "dockerd.log").read_text()[-3000:])
            time.sleep(0.5)  # polling the daemon's socket until it answers
        yield cmd
    finally:
        daemon.terminate()
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()
        # The daemon leaves its network namespace mounted under its exec root.
        with open("/proc/mounts") as mounts:
            points = [line.split()[1] for line in mounts if f" {run}/" in line]
        for point in reversed(points):
            subprocess.run(["umount", "-l", point], capture_output=True)


def sh(argv, timeout=RUN_TIMEOUT, check=True, **kwargs):
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and proc.returncode != 0:
        output = f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        pytest.fail(f"{argv} exited {proc.returncode}\n{output}")
    return proc


# A PEM private key: the header and a line of base64 (binaries hold the header text alone).
PEM_KEY = re.compile(rb"-----BEGIN [A-Z ]*PRIVATE KEY-----\r?\n[A-Za-z0-9+/=]{40,}")


def _layer_files(saved):
    """(path, data) for every regular file of every layer of a `docker save` tar."""
    with tarfile.open(saved) as outer:
        manifest = json.load(outer.extractfile("manifest.json"))
        for layer in manifest[0]["Layers"]:
            with tarfile.open(fileobj=outer.extractfile(layer)) as inner:
                for member in inner:
                    if member.isfile():
                        yield member.name, inner.extractfile(member).read()


def _machine_cas():
    """The first base64 line of each certificate authority this machine added to its own."""
    found = []
    for path in glob.glob("/usr/local/share/ca-certificates/**/*.crt", recursive=True):
        lines = open(path, "rb").read().splitlines()
        body = [line for line in lines if line and not line.startswith(b"-----")]
        if body:
            found.append((path, body[0]))
    return found


def check_no_secret_and_uid_1000(docker, image, tmp_path):
    """The image's user is 1000:1000; its layers and history hold no private key, no build CA,
    no ssh host key; `hvdtrain-run doctor` passes inside it."""
    config = json.loads(sh([*docker, "image", "inspect", image]).stdout)[0]["Config"]
    assert config["User"] == "1000:1000"
    assert not [e for e in config["Env"] if e.startswith(("PIP_CERT=", "SSL_CERT"))]
    history = sh([*docker, "history", "--no-trunc", "--format", "{{.CreatedBy}}", image]).stdout
    assert "hvdtrain-build" not in history and "BEGIN" not in history
    saved = tmp_path / "image.tar"
    sh([*docker, "save", "-o", str(saved), image], timeout=1200)
    cas = _machine_cas()
    keys, found_cas, names = [], [], []
    for name, data in _layer_files(saved):
        if PEM_KEY.search(data) and not data.startswith(b"\x7fELF"):  # libgnutls: self-tests
            keys.append(name)
        found_cas += [(name, path) for path, line in cas if line in data]
        if "hvdtrain-build" in name or name.startswith("etc/ssh/ssh_host_"):
            names.append(name)
    assert keys == [] and names == [] and found_cas == [], (keys, names, found_cas)
    doctor = sh([*docker, "run", "--rm", "--network", "host", image, "hvdtrain-run", "doctor"])
    assert "doctor: ok" in doctor.stdout, doctor.stdout + doctor.stderr
