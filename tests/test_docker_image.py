"""The CPU image, built and run for real: one container, two containers as two hosts (a run,
then a run whose second container is killed), and what the image holds.

A private Docker daemon (`dockerd --iptables=false --bridge=none`, no networking of its own) is
started for this module and stopped by its pid. Its layers are kept in ~/.cache/hvdtrain/docker,
so a second run rebuilds nothing (a cold build: about 10 minutes here). The base image is
debootstrapped (launch/docker_base.sh): no image registry is needed. Needs root, Debian's
docker.io and debootstrap (`launch/setup_host.sh --test` installs them as root); otherwise the
module is skipped with that one line.
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from conftest import LEGACY_KERAS, ROOT, job_env, tf_version

# The daemon fixture (`docker`) is shared: its name is a parameter of the tests below.
# ruff: noqa: F811
from helpers.docker_daemon import RUN_TIMEOUT, check_no_secret_and_uid_1000, docker, sh  # noqa: F401

# a cold build (Horovod from source) is part of the first test
# The image and its daemon are the module's: its tests stay in one pytest-xdist worker.
pytestmark = [pytest.mark.timeout(2400), pytest.mark.slow, pytest.mark.xdist_group("docker")]

IMAGE = "hvdtrain:cpu"
NETWORK, SUBNET = "hvdtrain-test", "10.232.7.0/24"
# A lost host must end the job within this (docs/fault-tolerance.md).
FAIL_FAST_SECONDS = 90


@pytest.fixture(scope="module")
def image(docker):
    """The CPU image, built by the Makefile's script (cached layers: seconds; cold: minutes)."""
    env = dict(os.environ, DOCKER=" ".join(docker), IMAGE=IMAGE)
    ca = os.environ.get("SSL_CERT_FILE")
    if ca and os.path.isfile(ca):
        env["BUILD_CA"] = ca  # this machine reaches PyPI through its own CA: the build stage only
    sh([os.path.join(ROOT, "launch", "docker_image.sh"), "cpu"], timeout=2200, env=env)
    return IMAGE


def writable_folder(path):
    path.mkdir()
    os.chmod(path, 0o777)  # the image's user (uid 1000) writes there
    return path


def test_one_container_trains_as_the_non_root_user_and_the_export_loads(docker, image, tmp_path):
    out = writable_folder(tmp_path / "out")
    proc = sh([
        *docker, "run", "--rm", "--network", "none", "-v", f"{out}:/out", image, "bash", "-c",
        "id -u && horovodrun -np 2 -H localhost:2 python -m hvdtrain.mnist --epochs 1"
        " --checkpoint-dir /out/ckpt --metrics-json /out/metrics.json",
    ])  # fmt: skip
    assert proc.stdout.splitlines()[0] == "1000", proc.stdout[:500]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "finished" and metrics["size"] == 2
    assert len({r["weights_digest"] for r in metrics["ranks"]}) == 1
    assert (out / "ckpt" / "model.keras").stat().st_uid == 1000
    code = (
        "import sys, numpy as np, tensorflow as tf;"
        "m = tf.keras.models.load_model(sys.argv[1]);"
        "print(m.predict(np.zeros((2, 28, 28, 1)), verbose=0).shape, 'horovod' in sys.modules)"
    )
    export = str(out / "ckpt" / "model.keras")
    if tf_version() >= (2, 16):  # on this host, in plain tf.keras
        loaded = sh([sys.executable, "-c", code, export], timeout=120, env=job_env(**LEGACY_KERAS))
    else:  # Keras 2.15 cannot read what tf-keras 2.21 writes: in a fresh container, no Horovod
        argv = ["run", "--rm", "--network", "none", "-v", f"{out}:/out", image, "python", "-c"]
        loaded = sh([*docker, *argv, code, "/out/ckpt/model.keras"])
    assert loaded.stdout.split() == ["(2,", "10)", "False"], loaded.stderr[-2000:]


@pytest.fixture
def two_hosts(docker, image, tmp_path):
    """Two containers on a user-defined network, each running the image's sshd (port 2222) with
    a key pair mounted at run time; yields (names, {name: its /out folder on this machine})."""
    keys = tmp_path / "ssh"
    keys.mkdir()
    sh(["ssh-keygen", "-q", "-t", "rsa", "-b", "2048", "-N", "", "-f", str(keys / "id_rsa")])
    shutil.copy(keys / "id_rsa.pub", keys / "authorized_keys")
    for path in [keys, *keys.iterdir()]:
        os.chown(path, 1000, 1000)
    names = ["hvdtrain-test-a", "hvdtrain-test-b"]
    outs = {name: writable_folder(tmp_path / name) for name in names}
    sh([*docker, "network", "rm", NETWORK], check=False)
    sh([*docker, "rm", "-f", *names], check=False)
    sh([*docker, "network", "create", "--subnet", SUBNET, NETWORK])
    try:
        for name in names:
            sh([
                *docker, "run", "-d", "--name", name, "--hostname", name, "--network", NETWORK,
                "-v", f"{keys}:/home/hvd/.ssh:ro", "-v", f"{outs[name]}:/out", image,
                "/usr/sbin/sshd", "-De", "-f", "/home/hvd/.sshd_config",
            ])  # fmt: skip
        hostfile = outs[names[0]] / "hosts.txt"
        hostfile.write_text("".join(f"{name} slots=1\n" for name in names))
        yield names, outs
    finally:
        sh([*docker, "rm", "-f", *names], check=False)
        sh([*docker, "network", "rm", NETWORK], check=False)


def launch(docker, first, *args):
    """hvdtrain-run in the first container, with the hostfile naming both (one rank each)."""
    return [
        *docker, "exec", first, "hvdtrain-run", "-np", "2", "--hostfile", "/out/hosts.txt",
        "--", "python", "-m", "hvdtrain.mnist", "--checkpoint-dir", "/out/ckpt",
        "--metrics-json", "/out/metrics.json", *args,
    ]  # fmt: skip


def test_two_containers_train_as_two_hosts_and_a_killed_one_ends_the_job(docker, two_hosts):
    """A whole run across the two containers, then a longer one in the same two, whose second
    container is killed after its first checkpoint (one pair of containers for both)."""
    names, outs = two_hosts
    proc = sh(launch(docker, names[0], "--model", "mlp", "--epochs", "2"))
    metrics = json.loads((outs[names[0]] / "metrics.json").read_text())
    assert metrics["status"] == "finished", proc.stdout[-2000:]
    assert sorted(r["hostname"] for r in metrics["ranks"]) == names
    assert len({r["weights_digest"] for r in metrics["ranks"]}) == 1
    # Rank 0 alone writes: nothing in the second host's folder.
    assert os.listdir(outs[names[1]]) == []

    shutil.rmtree(outs[names[0]] / "ckpt")  # the longer run starts afresh
    job = subprocess.Popen(
        launch(docker, names[0], "--model", "mlp", "--epochs", "200"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        first = outs[names[0]] / "ckpt" / "epoch-0001"
        deadline = time.monotonic() + RUN_TIMEOUT
        while not first.exists():  # mid-run: after the first checkpoint
            assert job.poll() is None, job.communicate()
            assert time.monotonic() < deadline, "no checkpoint within the bound"
            time.sleep(0.2)
        sh([*docker, "kill", names[1]])
        killed = time.monotonic()
        out, err = job.communicate(timeout=FAIL_FAST_SECONDS + 60)
        took = time.monotonic() - killed
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode != 0, out[-2000:]
    assert took < FAIL_FAST_SECONDS, f"the job ended {took:.0f} s after the kill"
    lines = [line for line in err.splitlines() if line.startswith("hvdtrain-run:")]
    assert lines and f"on host {names[1]} was lost" in lines[-1], err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    # Nothing runs on: the surviving container has no rank left.
    ps = sh([*docker, "exec", names[0], "ps", "-eo", "args"], check=False)
    assert "hvdtrain.mnist" not in ps.stdout, ps.stdout
    # Launching again while the host is down: one line naming it, before anything starts.
    again = sh(launch(docker, names[0], "--epochs", "30"), timeout=60, check=False)
    assert again.returncode == 5, again.stderr[-3000:]
    assert f"error: cannot reach {names[1]} (rank 1)" in again.stderr.splitlines()[-1]
    assert "Traceback" not in again.stderr


def test_the_image_holds_no_key_no_build_ca_and_runs_as_uid_1000(docker, image, tmp_path):
    check_no_secret_and_uid_1000(docker, image, tmp_path)
