#!/usr/bin/env bash
# A Debian bookworm base image built here, never pulled: debootstrap (minbase) from the Debian
# mirror apt already uses on this machine, committed with buildah (vfs storage, chroot isolation)
# and tagged so that `FROM debian:bookworm-slim` in Dockerfile.controller / Dockerfile.launcher
# resolves to it locally (`buildah bud --pull=never`). With a running local MC (make dev-up) the
# image is also imported into containerd's k8s.io namespace.
#
#   bash images/base/build.sh        output: _output/images/base/, buildah storage in _output/buildah
#
# Idempotent: skips debootstrap when the rootfs tarball exists, the commit when buildah has the
# image, the import when containerd has it. DEBIAN_MIRROR overrides the mirror taken from apt.
set -euo pipefail
LOG_NAME=base-image
# shellcheck source=../../hack/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../hack/lib/common.sh"
WORK=$OUT/images/base
SUITE=bookworm
IMAGE=localhost/capk/debian-base:$SUITE
ALIASES=(debian:bookworm-slim debian:bookworm)
CONTAINERD_SOCK=$OUT/dev/run/containerd.sock

[[ $(id -u) == 0 ]] || die "needs root (debootstrap)"
require debootstrap buildah

mirror() { # the first Debian archive URI apt is configured with
  if [[ -n ${DEBIAN_MIRROR:-} ]]; then echo "$DEBIAN_MIRROR"; return; fi
  local u
  u=$(grep -hE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' | grep -v security | head -1)
  [[ -n $u ]] || u=$(grep -hE '^deb ' /etc/apt/sources.list 2>/dev/null | awk '{print $2}' | grep -v security | head -1)
  [[ -n $u ]] || die "no Debian mirror in apt's sources; set DEBIAN_MIRROR"
  echo "$u"
}

mkdir -p "$WORK"
start=$SECONDS
if [[ ! -f $WORK/rootfs.tar ]]; then
  rm -rf "$WORK/rootfs"
  log "debootstrap $SUITE (minbase) from $(mirror)"
  debootstrap --variant=minbase --include=ca-certificates "$SUITE" "$WORK/rootfs" "$(mirror)" >"$WORK/debootstrap.log" 2>&1 ||
    { tail -20 "$WORK/debootstrap.log" >&2; die "debootstrap failed (log $WORK/debootstrap.log)"; }
  # Slim it like the -slim images: no apt lists, caches, docs or logs.
  rm -rf "$WORK/rootfs/var/lib/apt/lists/"* "$WORK/rootfs/var/cache/apt/"*.bin "$WORK/rootfs/var/cache/apt/archives/"*.deb \
    "$WORK/rootfs/usr/share/doc/"* "$WORK/rootfs/usr/share/man/"* "$WORK/rootfs/var/log/"*.log
  tar --numeric-owner --xattrs -C "$WORK/rootfs" -cf "$WORK/rootfs.tar.partial" .
  mv "$WORK/rootfs.tar.partial" "$WORK/rootfs.tar"
  rm -rf "$WORK/rootfs"
  log "rootfs.tar: $(du -h "$WORK/rootfs.tar" | cut -f1) in $((SECONDS - start))s"
fi

if ! capk_buildah inspect --type image "$IMAGE" >/dev/null 2>&1; then
  ctr=$(capk_buildah from --pull=never scratch)
  capk_buildah add "$ctr" "$WORK/rootfs.tar" /
  capk_buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd /bin/bash --label org.opencontainers.image.description="Debian $SUITE minbase, debootstrapped by images/base/build.sh" "$ctr"
  capk_buildah commit --rm "$ctr" "$IMAGE" >/dev/null
  log "committed $IMAGE"
fi
for a in "${ALIASES[@]}"; do capk_buildah tag "$IMAGE" "$a"; done

if [[ -S $CONTAINERD_SOCK ]] && ctr --address "$CONTAINERD_SOCK" version >/dev/null 2>&1; then
  # The list is read before grep: `ctr … | grep -q` fails under pipefail when ctr gets SIGPIPE.
  if ! grep -qxF "$IMAGE" <<<"$(ctr --address "$CONTAINERD_SOCK" -n k8s.io images ls -q)"; then
    rm -f "$WORK/base.oci.tar"
    capk_buildah push "$IMAGE" "oci-archive:$WORK/base.oci.tar:$IMAGE" >/dev/null
    ctr --address "$CONTAINERD_SOCK" -n k8s.io images import --base-name localhost/capk/debian-base "$WORK/base.oci.tar"
    rm -f "$WORK/base.oci.tar"
  fi
  log "containerd has $IMAGE"
else
  log "no local MC running: not imported into containerd (make dev-up, then run this again)"
fi
log "done in $((SECONDS - start))s: $IMAGE (also tagged ${ALIASES[*]} in buildah storage)"
