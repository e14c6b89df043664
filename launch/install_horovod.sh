#!/usr/bin/env bash
# Build Horovod 0.28.1 from its PyPI sdist, with hvdtrain's patch (launch/horovod-0.28.1.patch),
# against the TensorFlow already installed in $PYTHON's environment: TensorFlow, Gloo and MPI
# (and NCCL when HOROVOD_GPU_OPERATIONS=NCCL is set). Shared by the host set-up
# (launch/setup_host.sh) and the Dockerfile.
#
#   PYTHON=.venv/bin/python launch/install_horovod.sh
#
# Steps: download the sdist (pip, no build), check its SHA-256, check that every hunk of the
# patch applies exactly (`patch --dry-run --fuzz=0`: a clear error otherwise), apply it, build
# (`--no-build-isolation`, so against this TensorFlow), then require TensorFlow, Gloo and MPI
# (and NCCL if asked) in the build. Skips everything when this patched version is already
# built with them. The patch is needed from TensorFlow 2.16 on and harmless before.
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
patch_file="$here/horovod-$HOROVOD_VERSION.patch"
# The build records the patch it carries; a changed patch means a rebuild.
PATCH_SHA256=$(sha256sum "$patch_file" | cut -d' ' -f1)
export PATCH_SHA256
bindir=$(cd "$(dirname "$PYTHON")" && pwd)
die() { echo "install_horovod: error: $*" >&2; exit 1; }

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
marker = os.path.join(root, ".hvdtrain-patch")
if os.path.exists(marker) and open(marker).read().strip() == os.environ["PATCH_SHA256"]:
    names.append("patched")
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

installed=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("horovod"))' 2>/dev/null || true)
if [ "$installed" = "$HOROVOD_VERSION" ] && has_all "$(built || true)" "${wanted[@]}" patched; then
  echo "install_horovod: Horovod $HOROVOD_VERSION (with $(basename "$patch_file")) already built with ${wanted[*]}; skipping"
  exit 0
fi

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
  || die "the Horovod $HOROVOD_VERSION sdist has SHA-256 $sum; expected $SDIST_SHA256 (the file the patch was made for)"
tar -xzf "$sdist" -C "$work"
src="$work/horovod-$HOROVOD_VERSION"
if ! check=$(patch -d "$src" -p1 --fuzz=0 --forward --batch --dry-run <"$patch_file" 2>&1); then
  echo "$check" >&2
  die "$patch_file does not apply to this Horovod sdist (a hunk above FAILED); nothing was changed"
fi
patch -d "$src" -p1 --fuzz=0 --forward --batch --quiet <"$patch_file"
echo "install_horovod: applied $(grep -c '^@@' "$patch_file") hunks of $(basename "$patch_file")"

echo "install_horovod: building Horovod $HOROVOD_VERSION from source (about 8 minutes on 2 cores)"
export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1
export HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1
export MAKEFLAGS=${MAKEFLAGS:--j$(nproc)}
# Should a CMake 4 be picked up anyway: let it configure Horovod's bundled Gloo.
export CMAKE_POLICY_VERSION_MINIMUM=3.5
# cmake from pip lands in the environment's bin; the build needs it on PATH.
export PATH="$bindir:$PATH"
constraints=()  # the stack's pins (setup_host.sh passes them), else the project's
CONSTRAINTS=${CONSTRAINTS:-$here/../constraints.txt}
[ -f "$CONSTRAINTS" ] && constraints=(-c "$CONSTRAINTS")
"$PYTHON" -m pip install -q --no-build-isolation --no-cache-dir --force-reinstall --no-deps "$src"
# Horovod's own runtime dependencies (cloudpickle, psutil, pyyaml, packaging, cffi).
"$PYTHON" -m pip install -q "${constraints[@]}" cloudpickle psutil pyyaml packaging cffi
"$PYTHON" -c 'import importlib.util, os
root = importlib.util.find_spec("horovod").submodule_search_locations[0]
open(os.path.join(root, ".hvdtrain-patch"), "w").write(os.environ["PATCH_SHA256"] + "\n")'

have=$(built || true)
echo "install_horovod: Horovod $HOROVOD_VERSION built with: ${have/ patched/} (frameworks by their extension libraries)"
if ! has_all "$have" "${wanted[@]}" patched; then
  die "Horovod was installed but lacks one of ${wanted[*]}; rerun with 'pip install -v' to see the compiler's error"
fi
