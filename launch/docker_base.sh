#!/usr/bin/env bash
# Make an image's base, a minimal Debian, without an image registry: debootstrap it from
# Debian's package archive and import it as a local image. The tag names the release.
#
#   launch/docker_base.sh [NAME]   # hvdtrain/debian:bookworm (the CPU image's, the default) or
#                                  # hvdtrain/debian:trixie (the GPU image's)
#
# Needs root and Debian's debootstrap (apt-get install debootstrap). Does nothing when the image
# exists. With a registry, `debian:bookworm-slim` is the same base (make image BASE_IMAGE=...).
set -euo pipefail
name=${1:-hvdtrain/debian:bookworm}
suite=${name##*:}
case "$suite" in
  bookworm | trixie) ;;
  *) echo "docker_base: error: Invalid value for \`NAME\`: received '$name'; expected a tag naming bookworm or trixie" >&2; exit 2 ;;
esac
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
docker=(${DOCKER:-docker})
die() { echo "docker_base: error: $*" >&2; exit 1; }

if "${docker[@]}" image inspect "$name" >/dev/null 2>&1; then
  echo "docker_base: $name exists"
  exit 0
fi
[ "$(id -u)" -eq 0 ] || die "debootstrap needs root; run it as root, or build from a registry's base: make image BASE_IMAGE=debian:bookworm-slim"
command -v debootstrap >/dev/null || die "debootstrap is not installed; run: apt-get install -y debootstrap"
rootfs=$(mktemp -d)
trap 'rm -rf "$rootfs"' EXIT
echo "docker_base: debootstrap $suite from $mirror"
debootstrap --variant=minbase "$suite" "$rootfs" "$mirror" >"$rootfs.log" 2>&1 \
  || { tail -5 "$rootfs.log" >&2; rm -f "$rootfs.log"; die "debootstrap failed (above)"; }
rm -f "$rootfs.log"
# The archive's updates and security updates, as in Debian's own images; no package caches.
printf '%s\n' "deb $mirror $suite main" "deb $mirror $suite-updates main" \
  "deb ${mirror%/debian}/debian-security $suite-security main" >"$rootfs/etc/apt/sources.list"
rm -f "$rootfs"/etc/apt/sources.list.d/*.sources
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
tar -C "$rootfs" -c . | "${docker[@]}" import - "$name" >/dev/null
echo "docker_base: made $name"
