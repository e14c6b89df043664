#!/usr/bin/env bash
# Build hvdtrain's CPU or GPU image from the one Dockerfile (what `make image` and
# `make image-gpu` run).
#
#   launch/docker_image.sh cpu          # hvdtrain:cpu on hvdtrain/debian:bookworm (made by
#                                       # launch/docker_base.sh when missing)
#   launch/docker_image.sh gpu          # hvdtrain:gpu on hvdtrain/debian:trixie (made the same way)
#   BASE_IMAGE=nvidia/cuda:12.5.1-devel-ubuntu24.04 PYTHON_VERSION=3.12 launch/docker_image.sh gpu
#   BUILD_CA=/path/ca.crt launch/docker_image.sh cpu   # behind a TLS-inspecting proxy
#
# Variables: IMAGE (the tag), BASE_IMAGE (e.g. debian:bookworm-slim from a registry), BUILD_CA (a
# PEM file trusted by the build stage only, never in the image), DOCKER (the docker command, e.g.
# "docker -H unix:///run/other.sock"). The classic builder (DOCKER_BUILDKIT=0) unless set: BuildKit
# needs the buildx plugin, which Debian 12's docker.io lacks.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
kind=${1:-cpu}
docker=(${DOCKER:-docker})
die() { echo "docker_image: error: $*" >&2; exit 1; }

case "$kind" in
  cpu) image=${IMAGE:-hvdtrain:cpu} base=${BASE_IMAGE:-hvdtrain/debian:bookworm}
       args=(--build-arg "BASE_IMAGE=$base" --build-arg PYTHON_VERSION=3.11
             --build-arg TENSORFLOW_PACKAGE=tensorflow-cpu --build-arg HOROVOD_GPU_OPERATIONS=) ;;
  gpu) image=${IMAGE:-hvdtrain:gpu} base=${BASE_IMAGE:-hvdtrain/debian:trixie}
       args=(--build-arg "BASE_IMAGE=$base" ${PYTHON_VERSION:+--build-arg "PYTHON_VERSION=$PYTHON_VERSION"}) ;;
  *) die "Invalid value for \`kind\`: received '$kind'; expected cpu or gpu" ;;
esac
"${docker[@]}" version >/dev/null 2>&1 || die "no Docker daemon answers ('${docker[*]} version' fails); start one, or set DOCKER"
if [ -z "${BASE_IMAGE:-}" ]; then
  DOCKER="${docker[*]}" "$root/launch/docker_base.sh" "$base"
fi
ca="$root/launch/docker-ca/build-ca.crt"
if [ -n "${BUILD_CA:-}" ]; then
  [ -r "$BUILD_CA" ] || die "Invalid value for \`BUILD_CA\`: received '$BUILD_CA'; expected a readable PEM file"
  cp "$BUILD_CA" "$ca"
  trap 'rm -f "$ca"' EXIT
fi
start=$(date +%s)
DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-0} "${docker[@]}" build --network host -t "$image" "${args[@]}" "$root"
echo "docker_image: built $image in $(( $(date +%s) - start )) s"
