#!/usr/bin/env bash
# Make the CPU image's base, a minimal Debian 12 (bookworm), without an image registry:
# debootstrap it from Debian's package archive and import it as a local image.
#
#   launch/docker_base.sh [NAME]        # NAME: hvdtrain/debian:bookworm (the Makefile's default)
#
# Needs root and Debian's debootstrap (apt-get install debootstrap). Does nothing when the image
# exists. With a registry, `debian:bookworm-slim` is the same base (make image BASE_IMAGE=...).
set -euo pipefail
name=${1:-hvdtrain/debian:bookworm}
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
echo "docker_base: debootstrap bookworm from $mirror"
debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1 \
  || { tail -5 "$rootfs.log" >&2; rm -f "$rootfs.log"; die "debootstrap failed (above)"; }
rm -f "$rootfs.log"
# The archive's updates and security updates, as in Debian's own images; no package caches.
printf '%s\n' "deb $mirror bookworm main" "deb $mirror bookworm-updates main" \
  "deb ${mirror%/debian}/debian-security bookworm-security main" >"$rootfs/etc/apt/sources.list"
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
tar -C "$rootfs" -c . | "${docker[@]}" import - "$name" >/dev/null
echo "docker_base: made $name"
