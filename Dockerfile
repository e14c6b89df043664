# hvdtrain for GPU nodes: CUDA 12.5 (what TensorFlow 2.21 was built against), Python 3.12 (Ubuntu
# 24.04's), TensorFlow 2.21 with its pip CUDA libraries (cuDNN 9, NCCL 2.27) and Keras 2 from
# tf-keras, Open MPI, and Horovod 0.28.1 built from source with NCCL, with hvdtrain's patch, by the
# same script as the host set-up (launch/install_horovod.sh).
#
#   docker build -t hvdtrain .
#   docker run --rm --gpus all --ipc=host hvdtrain \
#       horovodrun -np 4 -H localhost:4 python -m hvdtrain.mnist
#
# The image runs as the non-root user `hvd` (uid 1000, home /home/hvd). For several nodes, each
# worker container runs `/usr/sbin/sshd -De -f /home/hvd/.sshd_config` (port 2222) with a key pair
# and authorized_keys in /home/hvd/.ssh; the image's ssh client connects to port 2222.
# Kubeflow's MPI Operator (MPIJob v2beta1) does exactly that: set `sshAuthMountPath: /home/hvd/.ssh`
# (its default, /root/.ssh, is for images that run as root), `runAsUser: 1000`, and give the workers
# the sshd command above.

# The CUDA toolkit (nvcc and headers) that Horovod's GPU code compiles with: 12.5, the version that
# TensorFlow 2.21's CUDA libraries on pip are (its `and-cuda` extra asks for cuda-runtime >= 12.5.82,
# cuDNN >= 9.3, NCCL >= 2.27.7). Ubuntu 24.04 brings Python 3.12 and gcc 13 (the patch adds the
# includes gcc 13 needs).
ARG CUDA_IMAGE_TAG=12.5.1-devel-ubuntu24.04
FROM nvidia/cuda:${CUDA_IMAGE_TAG}

# The pins below must agree with constraints.txt (tests/test_dockerfile.py checks).
ARG PYTHON_VERSION=3.12
ARG TENSORFLOW_VERSION=2.21.0
# The NCCL that TensorFlow 2.21 asks for; Horovod is built against the same pip copy, so one NCCL
# is loaded in each rank.
ARG NCCL_PIP_VERSION=2.27.7
ARG SSH_PORT=2222
ARG HVD_UID=1000
# Build-time only (ARGs are not kept in the image).
ARG DEBIAN_FRONTEND=noninteractive
ARG PIP_NO_CACHE_DIR=1
ARG PIP_DISABLE_PIP_VERSION_CHECK=1

SHELL ["/bin/bash", "-euo", "pipefail", "-c"]

# Ubuntu's own packages (Python 3.12, Open MPI 4.1, patch) follow security updates, and old
# versions leave the archive, so they are not pinned. Ubuntu's Open MPI is not CUDA-aware, which
# Horovod does not need: GPU tensors go through NCCL, MPI only coordinates.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        build-essential patch \
        "python${PYTHON_VERSION}" "python${PYTHON_VERSION}-dev" "python${PYTHON_VERSION}-venv" \
        openmpi-bin libopenmpi-dev \
        openssh-client openssh-server \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv
ENV PATH=/opt/venv/bin:$PATH
# Keras 2 for tf.keras in every process of the image (Horovod has no Keras 3 path).
ENV TF_USE_LEGACY_KERAS=1
# TensorFlow's CUDA build with the CUDA libraries it was tested with, from pip (`and-cuda`), and
# Keras 2 without its `tensorflow` requirement (already met). numpy and the rest come from
# constraints.txt, as on the host; the build tools are the host set-up's.
COPY constraints.txt /opt/hvdtrain/constraints.txt
RUN "python${PYTHON_VERSION}" -m venv "$VIRTUAL_ENV" \
    && pip install --no-cache-dir "pip<25" \
    && grep -v '^tensorflow-cpu==' /opt/hvdtrain/constraints.txt >/tmp/constraints.txt \
    && pip install --no-cache-dir -c /tmp/constraints.txt \
        "tensorflow[and-cuda]==${TENSORFLOW_VERSION}" "nvidia-nccl-cu12==${NCCL_PIP_VERSION}" \
        numpy cmake "wheel<1" "setuptools>=65,<81" "packaging>=20" \
    && pip install --no-cache-dir --no-deps -c /tmp/constraints.txt "tf-keras==${TENSORFLOW_VERSION}" \
    && rm /tmp/constraints.txt

# Horovod with TensorFlow, Gloo, MPI and NCCL, built by the host's script, which applies the patch
# and fails the build unless Horovod has all four. NCCL is pip's (the wheel ships headers and
# libnccl.so.2; the link name is added for the build). No GPU or driver exists at build time: like
# Horovod's own images, put the CUDA stub libcuda in the loader cache for the build only; the
# final `ldconfig` drops it again, so at run time the driver's libcuda is the only one.
COPY launch/install_horovod.sh launch/horovod-0.28.1.patch /opt/hvdtrain/launch/
RUN nccl="$("$VIRTUAL_ENV/bin/python" -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))')" \
    && ln -sf libnccl.so.2 "$nccl/lib/libnccl.so" \
    && ldconfig /usr/local/cuda/lib64/stubs \
    && HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_HOME="$nccl" HOROVOD_NCCL_LINK=SHARED \
        PYTHON="$VIRTUAL_ENV/bin/python" CONSTRAINTS=/opt/hvdtrain/constraints.txt \
        /opt/hvdtrain/launch/install_horovod.sh \
    && ldconfig
# Horovod's library finds pip's NCCL at run time even when TensorFlow has not loaded it first.
ENV LD_LIBRARY_PATH=/opt/venv/lib/python${PYTHON_VERSION}/site-packages/nvidia/nccl/lib

# hvdtrain itself, without dependencies (TensorFlow is the CUDA build above), then its other
# requirements from its own metadata, so that setup.cfg stays their only list.
COPY . /opt/hvdtrain
RUN pip install --no-cache-dir --no-deps /opt/hvdtrain \
    && python -c 'import importlib.metadata as m; print("\n".join(m.requires("hvdtrain")))' \
        >/tmp/hvdtrain-requirements.txt \
    && pip install --no-cache-dir -c /opt/hvdtrain/constraints.txt -r /tmp/hvdtrain-requirements.txt \
    && rm /tmp/hvdtrain-requirements.txt

# The finished environment: the CUDA build of TensorFlow, Keras 2 as tf.keras, Horovod's check.
RUN ldconfig /usr/local/cuda/lib64/stubs \
    && python -c 'import tensorflow as tf, horovod.tensorflow.keras, mpi4py, hvdtrain, hvdtrain.compat as c; assert tf.test.is_built_with_cuda(), "tensorflow is not the CUDA build"; c.require_keras2()' \
    && horovodrun --check-build \
    && ldconfig

# Multi-node: ssh between containers without prompts (the launcher's ~/.ssh may be a read-only
# Secret, hence no known_hosts file), on a port a non-root sshd can open. ssh sessions do not get
# the image's ENV, so the sshd sets PATH and Keras 2 for the processes mpirun starts there. Open
# MPI's shared memory transport cannot use CMA inside containers without CAP_SYS_PTRACE; copy
# through shared memory instead.
RUN printf '%s\n' 'Host *' '    StrictHostKeyChecking no' '    UserKnownHostsFile /dev/null' \
        "    Port ${SSH_PORT}" >/etc/ssh/ssh_config.d/hvdtrain.conf \
    && mkdir -p /run/sshd \
    && (userdel --remove ubuntu 2>/dev/null || true) \
    && groupadd --gid "${HVD_UID}" hvd \
    && useradd --create-home --uid "${HVD_UID}" --gid hvd --shell /bin/bash hvd \
    && install -d -m 700 -o hvd -g hvd /home/hvd/.ssh \
    && printf '%s\n' "Port ${SSH_PORT}" 'HostKey /home/hvd/.ssh/id_rsa' 'PidFile /home/hvd/sshd.pid' \
        'StrictModes no' \
        "SetEnv PATH=${PATH} TF_USE_LEGACY_KERAS=1 LD_LIBRARY_PATH=${LD_LIBRARY_PATH}" \
        >/home/hvd/.sshd_config
ENV OMPI_MCA_btl_vader_single_copy_mechanism=none

# Numeric, so that Kubernetes' runAsNonRoot can tell that it is not root.
USER ${HVD_UID}:${HVD_UID}
WORKDIR /home/hvd
CMD ["python", "-m", "hvdtrain.mnist", "--help"]
