#!/usr/bin/env bash
# Install Horovod 0.28.1 with hvdtrain's patch series (launch/horovod-patches/, applied in
# order) into $PYTHON's environment, built against the TensorFlow installed there: TensorFlow,
# Gloo and MPI (and NCCL when HOROVOD_GPU_OPERATIONS=NCCL is set). Shared by the host set-up
# (launch/setup_host.sh) and the Dockerfile.
#
#   PYTHON=.venv/bin/python launch/install_horovod.sh
#   PYTHON=.venv/bin/python WHEEL_DIR=dist launch/install_horovod.sh   # also the wheel into dist/
#                                                                     # (make horovod-wheel)
#
# The build is a wheel, made once per key (Horovod's version, the patches, TensorFlow, Python,
# MPI, GPU operations: launch/horovod_wheel.py) and kept in a per-user cache,
# HVDTRAIN_WHEEL_CACHE (default ${XDG_CACHE_HOME:-~/.cache}/hvdtrain/wheels/<key>/, with its
# SHA-256 beside it). A set-up whose key is cached installs that wheel (seconds); a cached
# wheel that is damaged or not this key's, or whose Horovod then lacks TensorFlow, Gloo or MPI,
# is named in one line and built again, never used. HVDTRAIN_WHEEL_NO_BUILD=1: install from
# the cache or fail, never build. Two set-ups of the same key at once: the second waits for the
# first (a lock per key in the cache), then installs its wheel.
#
# A build: download the sdist (pip, no build), check its SHA-256, check that every patch
# applies exactly (`patch --dry-run --fuzz=0`: a clear error otherwise), apply them, give the
# source the key's version (0.28.1+hvdtrain.<short key>), `pip wheel` it (no build isolation,
# so against this TensorFlow), install it, then require TensorFlow, Gloo and MPI (and NCCL if
# asked) in the build before the wheel goes into the cache. Skips everything when this
# environment already has the key's Horovod with them. The patches are needed from
# TensorFlow 2.16 on and harmless before.
set -euo pipefail

PYTHON=${PYTHON:-python3}
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
# Keras 2 (tf_keras) for tf.keras from TensorFlow 2.16 on; on older ones the variable would ask
# for a tf_keras that is not installed.
tf_version=$("$PYTHON" -c 'import importlib.metadata as m
for n in ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "intel-tensorflow"):
    try:
        print(m.version(n)); break
    except m.PackageNotFoundError:
        pass' 2>/dev/null || true)
[ -n "$tf_version" ] || { echo "install_horovod: error: no TensorFlow installed for $PYTHON; install it first" >&2; exit 1; }
case "$tf_version" in
  1.* | 2.[0-9].* | 2.1[0-5].*) ;;
  *) export TF_USE_LEGACY_KERAS=1 ;;
esac
HOROVOD_VERSION=0.28.1
SDIST_SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
patches=("$here"/horovod-patches/*.patch)  # in order: 0001-..., 0002-...
[ -f "${patches[0]}" ] || { echo "install_horovod: error: no patches in $here/horovod-patches" >&2; exit 1; }
cache=${HVDTRAIN_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdtrain/wheels}
bindir=$(cd "$(dirname "$PYTHON")" && pwd)
die() { echo "install_horovod: error: $*" >&2; exit 1; }
wheel_tool() { "$PYTHON" "$here/horovod_wheel.py" "$@"; }
# One set-up per key at a time, from the look-up to the store: this script runs again under the
# key's lock (horovod_wheel.py locked), so a second set-up beside it waits here, then finds the
# first one's wheel in the cache and builds nothing.
if [ -z "${HVDTRAIN_WHEEL_LOCK:-}" ]; then
  exec "$PYTHON" "$here/horovod_wheel.py" locked "$cache" "${patches[@]}" -- \
    bash "$here/$(basename "${BASH_SOURCE[0]}")" "$@"
fi
version=$(wheel_tool version "${patches[@]}")  # 0.28.1+hvdtrain.<short key>

# What was really built: frameworks by their extension libraries (horovodrun --check-build
# only tries `import horovod.torch`, which can succeed with no PyTorch extension built),
# controllers and operations as --check-build reports them.
built() {
  "$PYTHON" - <<'EOF'
import glob, importlib.util, os, re, subprocess, sys
spec = importlib.util.find_spec("horovod")
root = spec.submodule_search_locations[0] if spec else None
if root is None:
    sys.exit(1)
names = []
for framework, lib in (("TensorFlow", "tensorflow/mpi_lib"), ("PyTorch", "torch/mpi_lib_v2"),
                       ("MXNet", "mxnet/mpi_lib")):
    if glob.glob(os.path.join(root, lib + "*.so")):
        names.append(framework)
out = subprocess.run([sys.executable, "-m", "horovod.runner.launch", "--check-build"],
                     capture_output=True, text=True).stdout
section = None
for line in out.splitlines():
    if line.strip().endswith(":"):
        section = line.strip()
    found = re.match(r"\s*\[X\]\s+(\S+)", line)
    if found and section != "Available Frameworks:":
        names.append(found.group(1))
print(" ".join(dict.fromkeys(names)))
EOF
}

wanted=(TensorFlow Gloo MPI)
[ "${HOROVOD_GPU_OPERATIONS:-}" = NCCL ] && wanted+=(NCCL)
has_all() {  # has_all "built list" name...: every name is in the list
  local list=" $1 " name
  shift
  for name in "$@"; do [[ "$list" == *" $name "* ]] || return 1; done
}
installed() { "$PYTHON" -c 'import importlib.metadata as m; print(m.version("horovod"))' 2>/dev/null || true; }
export_wheel() {  # the cached wheel into WHEEL_DIR, when asked
  [ -n "${WHEEL_DIR:-}" ] || return 0
  mkdir -p "$WHEEL_DIR"
  cp "$1" "$WHEEL_DIR/"
  echo "install_horovod: wrote $WHEEL_DIR/$(basename "$1")"
}
install_wheel() {
  "$PYTHON" -m pip install -q --no-deps --force-reinstall "$1" 2> >(grep -v "^WARNING: Location" >&2)
  # Horovod's own runtime dependencies (cloudpickle, psutil, pyyaml, packaging, cffi).
  local constraints=()  # the stack's pins (setup_host.sh passes them), else the project's
  CONSTRAINTS=${CONSTRAINTS:-$here/../constraints.txt}
  [ -f "$CONSTRAINTS" ] && constraints=(-c "$CONSTRAINTS")
  "$PYTHON" -m pip install -q "${constraints[@]}" cloudpickle psutil pyyaml packaging cffi \
    2> >(grep -v "^WARNING: Location" >&2)
}

if [ "$(installed)" = "$version" ] && has_all "$(built || true)" "${wanted[@]}"; then
  if [ -z "${WHEEL_DIR:-}" ]; then
    echo "install_horovod: Horovod $version already built with ${wanted[*]}; skipping"
    exit 0
  fi
  if cached=$(wheel_tool find "$cache" "${patches[@]}"); then
    echo "install_horovod: Horovod $version already built with ${wanted[*]}; its wheel from $cache"
    export_wheel "$cached"
    exit 0
  fi
fi

# From the cache: the wheel is checked (hash, zip, version, key) before, and Horovod after.
if cached=$(wheel_tool find "$cache" "${patches[@]}"); then
  echo "install_horovod: installing Horovod $version from the cache ($cached)"
  install_wheel "$cached"
  have=$(built || true)
  if [ "$(installed)" = "$version" ] && has_all "$have" "${wanted[@]}"; then
    echo "install_horovod: Horovod $version installed from the cache with: $have (no build)"
    export_wheel "$cached"
    exit 0
  fi
  echo "install_horovod: the cached wheel $cached is not used: installed, Horovod $(installed) has only '$have' of ${wanted[*]}; building again" >&2
  wheel_tool drop "$cache" "${patches[@]}"
fi
[ "${HVDTRAIN_WHEEL_NO_BUILD:-0}" = 1 ] \
  && die "no usable wheel for Horovod $version in $cache, and HVDTRAIN_WHEEL_NO_BUILD=1"

command -v patch >/dev/null || die "the 'patch' program is missing; install it (apt-get install patch)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "install_horovod: downloading the Horovod $HOROVOD_VERSION sdist"
"$PYTHON" -m pip download -q --no-deps --no-binary :all: --no-build-isolation -d "$work" \
  "horovod==$HOROVOD_VERSION" 2> >(grep -v "^WARNING: Location" >&2)
sdist="$work/horovod-$HOROVOD_VERSION.tar.gz"
[ -f "$sdist" ] || die "pip did not download $sdist"
sum=$(sha256sum "$sdist" | cut -d' ' -f1)
[ "$sum" = "$SDIST_SHA256" ] \
  || die "the Horovod $HOROVOD_VERSION sdist has SHA-256 $sum; expected $SDIST_SHA256 (the file the patches were made for)"
tar -xzf "$sdist" -C "$work"
src="$work/horovod-$HOROVOD_VERSION"
hunks=0
for patch_file in "${patches[@]}"; do
  if ! check=$(patch -d "$src" -p1 --fuzz=0 --forward --batch --dry-run <"$patch_file" 2>&1); then
    echo "$check" >&2
    die "$patch_file does not apply to this Horovod sdist after the ones before it (a hunk above FAILED); nothing was installed"
  fi
  patch -d "$src" -p1 --fuzz=0 --forward --batch --quiet <"$patch_file"
  hunks=$((hunks + $(grep -c '^@@' "$patch_file")))
done
echo "install_horovod: applied ${#patches[@]} patches ($hunks hunks) of launch/horovod-patches"
wheel_tool stamp "$src" "${patches[@]}"

echo "install_horovod: building the Horovod $version wheel from source (about 8 minutes on 2 cores)"
export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1
export HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1
export MAKEFLAGS=${MAKEFLAGS:--j$(nproc)}
# Should a CMake 4 be picked up anyway: let it configure Horovod's bundled Gloo.
export CMAKE_POLICY_VERSION_MINIMUM=3.5
# cmake from pip lands in the environment's bin; the build needs it on PATH.
export PATH="$bindir:$PATH"
"$PYTHON" -m pip wheel -q --no-build-isolation --no-cache-dir --no-deps -w "$work/dist" "$src" \
  2> >(grep -v "^WARNING: Location" >&2)
wheel=$(ls "$work"/dist/horovod-*.whl 2>/dev/null | head -1)
[ -n "$wheel" ] || die "pip wheel made no Horovod wheel; rerun with 'pip wheel -v' to see the compiler's error"
install_wheel "$wheel"
have=$(built || true)
echo "install_horovod: Horovod $(installed) built with: $have (frameworks by their extension libraries)"
if [ "$(installed)" != "$version" ] || ! has_all "$have" "${wanted[@]}"; then
  die "Horovod was installed but lacks one of ${wanted[*]}; rerun with 'pip wheel -v' to see the compiler's error"
fi
cached=$(wheel_tool store "$cache" "$wheel" "${patches[@]}")
echo "install_horovod: kept $cached for the next set-up with this key"
export_wheel "$cached"
