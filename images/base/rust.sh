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
LOG_NAME=rust-image
# shellcheck source=../../hack/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../hack/lib/common.sh"
BASE=localhost/capk/debian-base:bookworm

command -v rustc >/dev/null || die "no host Rust toolchain (rustc) to copy"
sysroot=$(rustc --print sysroot)
version=$(rustc --version | awk '{print $2}')
IMAGE=localhost/capk/rust:$version-bookworm
capk_buildah inspect --type image "$BASE" >/dev/null 2>&1 || die "$BASE missing: run images/base/build.sh first"

start=$SECONDS
if ! capk_buildah inspect --type image "$IMAGE" >/dev/null 2>&1; then
  ctr=$(capk_buildah from --pull=never "$BASE")
  trap 'capk_buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
  capk_buildah run --isolation chroot "$ctr" -- sh -c \
    'apt-get update -q && apt-get install -y -q --no-install-recommends gcc libc6-dev pkg-config >/dev/null && rm -rf /var/lib/apt/lists/*'
  tarball=$OUT/images/base/rust-$version.tar
  mkdir -p "$(dirname "$tarball")"
  tar -C "$sysroot" --exclude=./share/doc --exclude=./share/man -cf "$tarball" .
  capk_buildah run --isolation chroot "$ctr" -- mkdir -p /usr/local/rust /usr/local/cargo
  capk_buildah add "$ctr" "$tarball" /usr/local/rust/
  rm -f "$tarball"
  capk_buildah config --env CARGO_HOME=/usr/local/cargo \
    --env PATH=/usr/local/cargo/bin:/usr/local/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --label org.opencontainers.image.description="Rust $version (this machine's toolchain) on the local Debian bookworm base" "$ctr"
  capk_buildah run --isolation chroot "$ctr" -- sh -c 'cargo --version && rustc --version'
  capk_buildah commit --rm "$ctr" "$IMAGE" >/dev/null
  trap - EXIT
fi
capk_buildah tag "$IMAGE" rust:1-bookworm
log "done in $((SECONDS - start))s: $IMAGE (also rust:1-bookworm in buildah storage)"
