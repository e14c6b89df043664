"""The GPU image (`make image-gpu`), built for real and checked on this machine, which has no
GPU: Horovod's build has NCCL and every library it needs resolves, MNIST trains on 2 ranks
inside it on CPU (TensorFlow's CUDA build runs there when it sees no GPU), and it holds no
secret. A cold build takes about 21 minutes here, so this is its own target, not CI's:

    make test-gpu-image

What only a GPU node can check (the driver, NCCL over NVLink or InfiniBand) is what
`hvdtrain-run doctor --gpu` checks there; here it must find no driver and pass the rest.
"""

import json
import os

import pytest
from conftest import ROOT

# The daemon fixture (`docker`) is shared: its name is a parameter of the tests below.
# ruff: noqa: F811
from helpers.docker_daemon import check_no_secret_and_uid_1000, docker, sh  # noqa: F401

pytestmark = [pytest.mark.gpu_image, pytest.mark.timeout(3600)]

IMAGE = "hvdtrain:gpu"


@pytest.fixture(scope="module")
def image(docker):
    env = dict(os.environ, DOCKER=" ".join(docker), IMAGE=IMAGE)
    ca = os.environ.get("SSL_CERT_FILE")
    if ca and os.path.isfile(ca):
        env["BUILD_CA"] = ca  # the build stage only
    sh([os.path.join(ROOT, "launch", "docker_image.sh"), "gpu"], timeout=3000, env=env)
    return IMAGE


def in_image(docker, image, script, **kwargs):  # noqa: F811
    return sh([*docker, "run", "--rm", "--network", "host", image, "bash", "-c", script], **kwargs)


def test_horovod_has_nccl_and_every_library_resolves(docker, image):  # noqa: F811
    build = in_image(docker, image, "horovodrun --check-build").stdout
    for name in ("TensorFlow", "MPI", "Gloo", "NCCL"):
        assert f"[X] {name}" in build, build
    library = "/opt/venv/lib/python3*/site-packages/horovod/tensorflow/mpi_lib*.so"
    ldd = in_image(docker, image, f"ldd {library}").stdout
    missing = [line for line in ldd.splitlines() if "not found" in line]
    # TensorFlow's own libraries are loaded by `import tensorflow` first, not by the loader.
    assert all("libtensorflow_" in line for line in missing), ldd
    assert "site-packages/nvidia/nccl/lib/libnccl.so.2" in ldd, ldd
    # Every symbol bound at load: none left undefined (TensorFlow 2.21 dropped one Horovod used).
    probe = (
        "import json, tensorflow as tf, horovod.tensorflow as hvd; "
        "print(json.dumps([tf.test.is_built_with_cuda(), hvd.nccl_built()]))"
    )
    out = in_image(docker, image, f"LD_BIND_NOW=1 python -c '{probe}'").stdout
    cuda, nccl = json.loads(out.strip().splitlines()[-1])
    assert cuda and nccl >= 22707, out  # NCCL >= 2.27.7, what TensorFlow 2.21 asks for


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_mnist_trains_on_two_ranks_inside_on_cpu(docker, image, backend):  # noqa: F811
    script = (
        f"horovodrun -np 2 -H localhost:2 --{backend} python -m hvdtrain.mnist --epochs 1 "
        "--checkpoint-dir /tmp/ck --metrics-json /tmp/m.json >/tmp/log 2>&1 "
        "|| { tail -30 /tmp/log; exit 1; }; cat /tmp/m.json"
    )
    out = in_image(docker, image, script, timeout=900).stdout
    metrics = json.loads(out[out.index("{") :])
    assert metrics["status"] == "finished" and metrics["size"] == 2, metrics
    assert metrics["test_samples"] == 500, metrics
    assert len({r["weights_digest"] for r in metrics["ranks"]}) == 1, metrics["ranks"]


def test_the_gpu_image_holds_no_secret_and_runs_as_uid_1000(docker, image, tmp_path):  # noqa: F811
    check_no_secret_and_uid_1000(docker, image, tmp_path)


def test_the_gpu_node_check_finds_no_driver_and_passes_the_rest(docker, image):  # noqa: F811
    """`hvdtrain-run doctor --gpu -np 2` inside the image on this GPU-less machine: the
    driver row is the one problem; TensorFlow is the CUDA build, Horovod has NCCL, MNIST
    and the sweep run on 2 ranks (on CPU); the image asks for CUDA and nvidia-smi and carries
    InfiniBand's user-space drivers."""
    proc = in_image(docker, image, "hvdtrain-run doctor --gpu -np 2", check=False, timeout=900)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "Traceback" not in out + proc.stderr
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "nvidia-smi not found" in rows["driver"]
    assert "(CUDA 12" in rows["tensorflow"] and "Horovod with NCCL 2" in rows["tensorflow"]
    assert " ok " in rows["tensorflow"] and " ok " in rows["mnist"], out
    assert out.splitlines()[-1] == "doctor --gpu: problem in driver"
    env = in_image(docker, image, "echo $NVIDIA_DRIVER_CAPABILITIES; ls /usr/lib/*/libibverbs/")
    assert env.stdout.splitlines()[0] == "compute,utility"
    assert "libmlx5-rdmav" in env.stdout, env.stdout
