#!/usr/bin/env bash
# A local stand-in for the `rust:1-bookworm` build stage of Dockerfile.controller and
# Dockerfile.launcher, since no image registry is reachable: the base image of build.sh plus gcc
# and libc6-dev from Debian, plus this machine's own Rust toolchain (the one `cargo` here runs,
# without its docs) in /usr/local/rust. Tagged rust:1-bookworm in buildah storage.
#
#   bash images/base/rust.sh      (after images/base/build.sh)
#
# Idempotent: skips when buildah already has the image for this toolchain version.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${CAPK_OUTPUT:-$ROOT/_output}
BASE=localhost/capk/debian-base:bookworm
BUILDAH=(buildah --root "$OUT/buildah/storage" --runroot "$OUT/buildah/run" --storage-driver vfs)

log() { printf '%s rust-image: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
command -v rustc >/dev/null || die "no host Rust toolchain (rustc) to copy"
sysroot=$(rustc --print sysroot)
version=$(rustc --version | awk '{print $2}')
IMAGE=localhost/capk/rust:$version-bookworm
"${BUILDAH[@]}" inspect --type image "$BASE" >/dev/null 2>&1 || die "$BASE missing: run images/base/build.sh first"

start=$SECONDS
if ! "${BUILDAH[@]}" inspect --type image "$IMAGE" >/dev/null 2>&1; then
  ctr=$("${BUILDAH[@]}" from --pull=never "$BASE")
  trap '"${BUILDAH[@]}" rm "$ctr" >/dev/null 2>&1 || true' EXIT
  "${BUILDAH[@]}" run --isolation chroot "$ctr" -- sh -c \
    'apt-get update -q && apt-get install -y -q --no-install-recommends gcc libc6-dev pkg-config >/dev/null && rm -rf /var/lib/apt/lists/*'
  tarball=$OUT/images/base/rust-$version.tar
  mkdir -p "$(dirname "$tarball")"
  tar -C "$sysroot" --exclude=./share/doc --exclude=./share/man -cf "$tarball" .
  "${BUILDAH[@]}" run --isolation chroot "$ctr" -- mkdir -p /usr/local/rust /usr/local/cargo
  "${BUILDAH[@]}" add "$ctr" "$tarball" /usr/local/rust/
  rm -f "$tarball"
  "${BUILDAH[@]}" config --env CARGO_HOME=/usr/local/cargo \
    --env PATH=/usr/local/cargo/bin:/usr/local/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --label org.opencontainers.image.description="Rust $version (this machine's toolchain) on the local Debian bookworm base" "$ctr"
  "${BUILDAH[@]}" run --isolation chroot "$ctr" -- sh -c 'cargo --version && rustc --version'
  "${BUILDAH[@]}" commit --rm "$ctr" "$IMAGE" >/dev/null
  trap - EXIT
fi
"${BUILDAH[@]}" tag "$IMAGE" rust:1-bookworm
log "done in $((SECONDS - start))s: $IMAGE (also rust:1-bookworm in buildah storage)"
