#!/usr/bin/env bash
# Build Horovod from the PyPI sdist against the TensorFlow already installed in $PYTHON's
# environment, with TensorFlow, Gloo and MPI (and NCCL when HOROVOD_GPU_OPERATIONS=NCCL is set).
# Shared by the host set-up (launch/setup_host.sh) and the Dockerfile.
#
#   PYTHON=.venv/bin/python launch/install_horovod.sh
#
# Skips the build when the installed Horovod already has the wanted version and frameworks.
set -euo pipefail

PYTHON=${PYTHON:-python3}
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
HOROVOD_VERSION=${HOROVOD_VERSION:-0.28.1}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bindir=$(cd "$(dirname "$PYTHON")" && pwd)

check_build() {
  # horovodrun --check-build prints "[X] TensorFlow", "[X] Gloo", "[X] MPI" for what was built in.
  local out
  out=$("$PYTHON" -m horovod.runner.launch --check-build 2>/dev/null) || return 1
  for fw in TensorFlow Gloo MPI; do
    grep -q "\[X\] $fw" <<<"$out" || return 1
  done
  if [ "${HOROVOD_GPU_OPERATIONS:-}" = NCCL ]; then grep -q "\[X\] NCCL" <<<"$out" || return 1; fi
  return 0
}

installed=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("horovod"))' 2>/dev/null || true)
if [ "$installed" = "$HOROVOD_VERSION" ] && check_build; then
  echo "install_horovod: Horovod $HOROVOD_VERSION already built with TensorFlow, Gloo and MPI; skipping"
  exit 0
fi

echo "install_horovod: building Horovod $HOROVOD_VERSION from source (about 3 minutes)"
export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1
export HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1
export MAKEFLAGS=${MAKEFLAGS:--j$(nproc)}
# Should a CMake 4 be picked up anyway: let it configure Horovod's bundled Gloo.
export CMAKE_POLICY_VERSION_MINIMUM=3.5
# cmake from pip lands in the environment's bin; the build needs it on PATH.
export PATH="$bindir:$PATH"
constraints=()
[ -f "$here/../constraints.txt" ] && constraints=(-c "$here/../constraints.txt")
"$PYTHON" -m pip install --no-build-isolation --no-cache-dir --force-reinstall --no-deps \
  "${constraints[@]}" "horovod==$HOROVOD_VERSION"
# Horovod's own runtime dependencies (cloudpickle, psutil, pyyaml, packaging, cffi).
"$PYTHON" -m pip install "${constraints[@]}" "horovod==$HOROVOD_VERSION"

if ! check_build; then
  echo "install_horovod: error: Horovod was installed but lacks TensorFlow, Gloo or MPI:" >&2
  "$PYTHON" -m horovod.runner.launch --check-build >&2 || true
  echo "install_horovod: rerun with 'pip install -v' to see the compiler's error" >&2
  exit 1
fi
"$PYTHON" -m horovod.runner.launch --check-build
