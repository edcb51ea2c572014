#!/usr/bin/env bash
# The node image's Debian bookworm trees, as tarballs (nothing is configured here: build.sh lays
# the node's files over them, so a configuration change costs no download):
#
#   minbase.tar        debootstrap --variant=minbase from the Debian mirror apt already uses on
#                      this machine (as images/base/build.sh)
#   rootfs.tar         minbase + `apt-get install --no-install-recommends` of packages.txt in a
#                      chroot (apt resolves the kernel's initramfs alternative to dracut, which
#                      debootstrap's own resolver would not)
#   iptables-base.tar  minbase + iptables, ipset, conntrack, kmod: the base layer of the
#                      kube-proxy and flannel images (images.sh)
#
# Usage: rootfs.sh WORKDIR   (needs root). Each tarball has a .stamp (its recipe version, package
# list and the stamp of minbase); matching ones are kept. Downloaded packages are kept in
# WORKDIR/apt-archives, so a changed package list downloads only what is new.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
LOG_NAME="node-image rootfs"
# shellcheck source=../../hack/lib/common.sh
source "$HERE/../../hack/lib/common.sh"
WORK=${1:?usage: rootfs.sh WORKDIR}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
SUITE=bookworm
# Bump when a step below changes what it produces.
MINBASE_RECIPE=1
ROOTFS_RECIPE=1
IPTABLES_PACKAGES=(iptables ipset conntrack kmod)

[[ $(id -u) == 0 ]] || die "needs root (debootstrap, chroot)"
require debootstrap

mirror() { # the first Debian archive URI apt is configured with (as images/base/build.sh)
  if [[ -n ${DEBIAN_MIRROR:-} ]]; then echo "$DEBIAN_MIRROR"; return; fi
  local u
  u=$(grep -hE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' | grep -v security | head -1)
  [[ -n $u ]] || u=$(grep -hE '^deb ' /etc/apt/sources.list 2>/dev/null | awk '{print $2}' | grep -v security | head -1)
  [[ -n $u ]] || die "no Debian mirror in apt's sources; set DEBIAN_MIRROR"
  echo "$u"
}
MIRROR=$(mirror)
mkdir -p "$WORK" "$WORK/apt-archives/partial"

fresh() { # NAME STAMP: the tarball exists with this stamp
  [[ -f $WORK/$1.tar && -f $WORK/$1.stamp && $(cat "$WORK/$1.stamp") == "$2" ]]
}
mounted=()
build=""
cleanup() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[i]}" 2>/dev/null || true; done
  mounted=()
  [[ -z $build ]] || rm -rf "$build"
}
trap cleanup EXIT
# save NAME STAMP DIR: slim DIR and pack it into NAME.tar.
save() {
  local d=$3
  rm -rf "$d/var/lib/apt/lists/"* "$d/var/cache/apt/"*.bin "$d/var/cache/apt/archives/"*.deb \
    "$d/usr/share/doc/"* "$d/usr/share/man/"* "$d/usr/share/info/"* "$d/var/log/"*.log
  tar --numeric-owner --xattrs --xattrs-include='*' -C "$d" -cf "$WORK/$1.tar.partial" .
  mv "$WORK/$1.tar.partial" "$WORK/$1.tar"
  echo "$2" >"$WORK/$1.stamp"
  log "$1.tar: $(du -h "$WORK/$1.tar" | cut -f1)"
}
# apt_install DIR PACKAGE...: in a chroot of DIR, with no daemon started and the package cache kept.
apt_install() {
  local d=$1 m
  shift
  for m in proc sys dev dev/pts; do
    mount --bind "/$m" "$d/$m"
    mounted+=("$d/$m")
  done
  mount --bind "$WORK/apt-archives" "$d/var/cache/apt/archives"
  mounted+=("$d/var/cache/apt/archives")
  printf '#!/bin/sh\nexit 101\n' >"$d/usr/sbin/policy-rc.d"
  chmod 0755 "$d/usr/sbin/policy-rc.d"
  cp /etc/resolv.conf "$d/etc/resolv.conf"
  printf 'deb %s %s main\ndeb %s %s-updates main\n' "$MIRROR" "$SUITE" "$MIRROR" "$SUITE" >"$d/etc/apt/sources.list"
  if ! chroot "$d" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
    sh -c 'apt-get update && apt-get install -y --no-install-recommends "$@"' apt "$@" >"$WORK/apt.log" 2>&1; then
    tail -30 "$WORK/apt.log" >&2
    die "apt-get install failed (log $WORK/apt.log)"
  fi
  cleanup_mounts
  rm -f "$d/usr/sbin/policy-rc.d"
  # The package's own resolv.conf (systemd-resolved makes it a link) or none: build.sh decides.
  [[ -L $d/etc/resolv.conf ]] || rm -f "$d/etc/resolv.conf"
}
cleanup_mounts() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount "${mounted[i]}"; done
  mounted=()
}
# from_minbase: a fresh tree from minbase.tar (sets $build).
from_minbase() {
  build=$WORK/tree.build
  rm -rf "$build"
  mkdir -p "$build"
  tar --numeric-owner --xattrs --xattrs-include='*' -xf "$WORK/minbase.tar" -C "$build"
}

start=$SECONDS
minbase_stamp="recipe $MINBASE_RECIPE $SUITE $MIRROR"
if ! fresh minbase "$minbase_stamp"; then
  build=$WORK/tree.build
  rm -rf "$build"
  log "debootstrap $SUITE (minbase) from $MIRROR"
  debootstrap --variant=minbase --cache-dir="$WORK/apt-archives" "$SUITE" "$build" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 ||
    { tail -20 "$WORK/debootstrap.log" >&2; die "debootstrap failed (log $WORK/debootstrap.log)"; }
  save minbase "$minbase_stamp" "$build"
  rm -rf "$build"
  build=""
fi

mapfile -t packages < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$HERE/packages.txt" | grep -v '^$')
rootfs_stamp="recipe $ROOTFS_RECIPE minbase $(cat "$WORK/minbase.stamp") packages ${packages[*]}"
if ! fresh rootfs "$rootfs_stamp"; then
  from_minbase
  log "rootfs: installing ${#packages[@]} packages"
  apt_install "$build" "${packages[@]}"
  # dracut's kernel hook made a generic initramfs; build.sh makes the node's own.
  rm -f "$build/boot/initrd.img-"*
  save rootfs "$rootfs_stamp" "$build"
  rm -rf "$build"
  build=""
fi

iptables_stamp="recipe $ROOTFS_RECIPE minbase $(cat "$WORK/minbase.stamp") packages ${IPTABLES_PACKAGES[*]}"
if ! fresh iptables-base "$iptables_stamp"; then
  from_minbase
  log "iptables base: installing ${IPTABLES_PACKAGES[*]}"
  apt_install "$build" "${IPTABLES_PACKAGES[@]}"
  # A container layer: no apt machinery or Debian's package database needed at run time.
  rm -rf "$build/var/cache/apt" "$build/var/lib/apt"
  save iptables-base "$iptables_stamp" "$build"
  rm -rf "$build"
  build=""
fi
log "up to date in $((SECONDS - start))s"
