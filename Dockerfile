# hvdtrain for GPU nodes: CUDA 12.2 + cuDNN 8.9 (what TensorFlow 2.15 was built against), Python 3.11,
# TensorFlow 2.15.1, Open MPI, NCCL, and Horovod 0.28.1 built from source with NCCL by the same
# script as the host set-up (launch/install_horovod.sh).
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

# cuDNN 8.9 ships in the `cudnn8` tags of CUDA 12.2.x (the image holds cuDNN 8.9.6 and NCCL 2.19.3).
ARG CUDA_IMAGE_TAG=12.2.2-cudnn8-devel-ubuntu22.04
FROM nvidia/cuda:${CUDA_IMAGE_TAG}

# setup.cfg requires Python 3.11; the two pins below must agree with constraints.txt.
ARG PYTHON_VERSION=3.11
ARG TENSORFLOW_VERSION=2.15.1
ARG HOROVOD_VERSION=0.28.1
# The version the base image already installs and holds (apt-mark hold); another one needs the
# --allow-change-held-packages below. Not named NCCL_VERSION: the base image sets that as ENV,
# which would override an ARG of the same name.
ARG NCCL_PACKAGE_VERSION=2.19.3-1+cuda12.2
ARG SSH_PORT=2222
ARG HVD_UID=1000
# Build-time only (ARGs are not kept in the image).
ARG DEBIAN_FRONTEND=noninteractive
ARG PIP_NO_CACHE_DIR=1
ARG PIP_DISABLE_PIP_VERSION_CHECK=1

SHELL ["/bin/bash", "-euo", "pipefail", "-c"]

# Ubuntu's own packages (Python 3.11 from jammy's universe, Open MPI 4.1) follow security updates,
# and old versions leave the archive, so they are not pinned; NCCL, the one the build links
# against, is. Jammy's Open MPI is not CUDA-aware, which Horovod does not need: GPU tensors go
# through NCCL, MPI only coordinates.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends --allow-change-held-packages --allow-downgrades \
        build-essential \
        "python${PYTHON_VERSION}" "python${PYTHON_VERSION}-dev" "python${PYTHON_VERSION}-venv" \
        openmpi-bin libopenmpi-dev \
        "libnccl2=${NCCL_PACKAGE_VERSION}" "libnccl-dev=${NCCL_PACKAGE_VERSION}" \
        openssh-client openssh-server \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv
ENV PATH=/opt/venv/bin:$PATH
# The plain `tensorflow` wheel is the CUDA build; it uses the image's CUDA 12.2, cuDNN 8.9 and NCCL
# instead of the pip copies that `tensorflow[and-cuda]` would add (about 3 GB, a second NCCL).
# numpy<2 comes from constraints.txt, as on the host. The build tools are the ones the host set-up
# installs (Horovod needs cmake>=3.13; Ubuntu's venv can start with an older setuptools than the
# host's 65).
COPY constraints.txt /opt/hvdtrain/constraints.txt
RUN "python${PYTHON_VERSION}" -m venv "$VIRTUAL_ENV" \
    && pip install --no-cache-dir "pip<25" \
    && pip install --no-cache-dir -c /opt/hvdtrain/constraints.txt \
        "tensorflow==${TENSORFLOW_VERSION}" "numpy<2" \
        "cmake>=3.13,<4" "wheel<1" "setuptools>=65,<81" "packaging>=20"

# Horovod with TensorFlow, Gloo, MPI and NCCL, built by the host's script, which fails the build
# unless `horovodrun --check-build` shows all four (HOROVOD_VERSION comes from the ARG above).
# No GPU or driver exists at build time: like Horovod's own images, put the CUDA stub libcuda
# (its soname link libcuda.so.1 is made by ldconfig) in the loader cache for the build only;
# the final `ldconfig` drops it again, so at run time the driver's libcuda (mounted by the NVIDIA
# container toolkit) is the only one.
COPY launch/install_horovod.sh /opt/hvdtrain/launch/install_horovod.sh
RUN ldconfig /usr/local/cuda/lib64/stubs \
    && HOROVOD_GPU_OPERATIONS=NCCL PYTHON="$VIRTUAL_ENV/bin/python" \
        /opt/hvdtrain/launch/install_horovod.sh \
    && ldconfig

# hvdtrain itself. setup.cfg lists tensorflow-cpu (the host's wheel), which would overwrite the CUDA
# build's files, so hvdtrain goes in with --no-deps and then its other requirements, read back from
# its own metadata so that setup.cfg stays their only list.
COPY . /opt/hvdtrain
RUN pip install --no-cache-dir --no-deps /opt/hvdtrain \
    && python -c 'import importlib.metadata as m; print("\n".join(r for r in m.requires("hvdtrain") if not r.startswith("tensorflow-cpu")))' \
        >/tmp/hvdtrain-requirements.txt \
    && pip install --no-cache-dir -c /opt/hvdtrain/constraints.txt -r /tmp/hvdtrain-requirements.txt \
    && rm /tmp/hvdtrain-requirements.txt

# The finished environment: still the CUDA build of TensorFlow and numpy<2, and Horovod's check.
RUN ldconfig /usr/local/cuda/lib64/stubs \
    && python -c 'import numpy, tensorflow as tf, horovod.tensorflow, mpi4py, hvdtrain; assert tf.test.is_built_with_cuda(), "tensorflow is not the CUDA build"; assert int(numpy.__version__.split(".")[0]) < 2, numpy.__version__' \
    && horovodrun --check-build \
    && ldconfig

# Multi-node: ssh between containers without prompts (the launcher's ~/.ssh may be a read-only
# Secret, hence no known_hosts file), on a port a non-root sshd can open. ssh sessions do not get
# the image's ENV, so the sshd sets PATH for the processes mpirun starts there. Open MPI's shared
# memory transport cannot use CMA inside containers without CAP_SYS_PTRACE; copy through shared
# memory instead.
RUN printf '%s\n' 'Host *' '    StrictHostKeyChecking no' '    UserKnownHostsFile /dev/null' \
        "    Port ${SSH_PORT}" >/etc/ssh/ssh_config.d/hvdtrain.conf \
    && mkdir -p /run/sshd \
    && groupadd --gid "${HVD_UID}" hvd \
    && useradd --create-home --uid "${HVD_UID}" --gid hvd --shell /bin/bash hvd \
    && install -d -m 700 -o hvd -g hvd /home/hvd/.ssh \
    && printf '%s\n' "Port ${SSH_PORT}" 'HostKey /home/hvd/.ssh/id_rsa' 'PidFile /home/hvd/sshd.pid' \
        'StrictModes no' "SetEnv PATH=${PATH}" >/home/hvd/.sshd_config
ENV OMPI_MCA_btl_vader_single_copy_mechanism=none

# Numeric, so that Kubernetes' runAsNonRoot can tell that it is not root.
USER ${HVD_UID}:${HVD_UID}
WORKDIR /home/hvd
CMD ["python", "-m", "hvdtrain.mnist", "--help"]
