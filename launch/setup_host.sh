#!/usr/bin/env bash
# Install everything hvdtrain needs on this host into ./.venv (idempotent: a second run only checks).
#
#   launch/setup_host.sh          # what `make train` runs first
#   launch/setup_host.sh --test   # what `make test` runs: also sshd, iproute2, SLURM and munge
#                                 # (the multi-host and SLURM tests; skipped when not root)
#
# Steps: Debian's Open MPI (apt, only if missing) -> Python 3.11 venv -> pinned Python packages
# (constraints.txt keeps numpy<2) -> Horovod built from source (launch/install_horovod.sh) -> hvdtrain.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv=${HVDTRAIN_VENV:-.venv}
stamp="$venv/.hvdtrain-setup"
inputs=(setup.cfg pyproject.toml constraints.txt launch/setup_host.sh launch/install_horovod.sh)

apt_install() {
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup_host: error: missing system packages ($*); run: sudo apt-get install -y $*" >&2
    exit 1
  fi
  echo "setup_host: apt-get install $*"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}
need=()
command -v mpirun >/dev/null || need+=(openmpi-bin)
command -v mpicc >/dev/null || need+=(libopenmpi-dev)
command -v ssh >/dev/null || need+=(openssh-client)
if [ "${1:-}" = --test ]; then
  [ -x /usr/sbin/sshd ] || need+=(openssh-server)
  command -v ip >/dev/null || need+=(iproute2)
  command -v slurmctld >/dev/null || need+=(slurm-wlm)
  command -v munged >/dev/null || need+=(munge)
fi
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ] && [ "${1:-}" = --test ] && command -v mpicc >/dev/null; then
    echo "setup_host: not root: skipping ${need[*]} (their tests will be skipped)"
  else
    apt_install "${need[@]}"
  fi
fi

if [ -f "$stamp" ] && [ "$(cat "${inputs[@]}" | sha256sum)" = "$(cat "$stamp")" ] \
   && "$venv/bin/python" -c 'import horovod.tensorflow, hvdtrain' 2>/dev/null; then
  exit 0
fi

python=${PYTHON:-python3.11}
if ! command -v "$python" >/dev/null; then
  echo "setup_host: error: $python not found; hvdtrain needs Python 3.11 (set PYTHON=/path/to/python3.11)" >&2
  exit 1
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade "pip<25" >/dev/null
"${pip[@]}" install -q -c constraints.txt \
  "tensorflow-cpu==2.15.1" "numpy<2" cmake wheel setuptools packaging
PYTHON="$venv/bin/python" launch/install_horovod.sh
# mpi4py against the same Open MPI (compiled here with mpicc), hvdtrain and its test tools.
"${pip[@]}" install -q -c constraints.txt -e ".[test]"
"$venv/bin/python" -c 'import numpy, tensorflow, horovod.tensorflow, mpi4py, hvdtrain' \
  || { echo "setup_host: error: the environment does not import; see the messages above" >&2; exit 1; }
cat "${inputs[@]}" | sha256sum >"$stamp"
echo "setup_host: ready ($venv)"
