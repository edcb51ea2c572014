#!/usr/bin/env bash
# Builds the launcher's test guest from Debian packages only: Debian's cloud kernel
# (linux-image-cloud-amd64) and an initramfs of busybox-static plus the virtio modules it needs.
# The guest gets its address by DHCP from the launcher, reports what it learned on the serial
# console (lines starting with CAPK-TESTGUEST), pings a peer, writes the heartbeat port and powers
# off on the ACPI power button. It is a test fixture, not a node image: no Ignition runs in it.
#
# Usage: build.sh OUTDIR   (writes OUTDIR/vmlinuz, OUTDIR/initrd.img, OUTDIR/base.qcow2)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${1:?usage: build.sh OUTDIR}
mkdir -p "$OUT"

kernel=$(ls /boot/vmlinuz-*-cloud-amd64 2>/dev/null | sort -V | tail -1 || true)
[[ -n $kernel ]] || { echo "test-guest: no /boot/vmlinuz-*-cloud-amd64; apt-get install linux-image-cloud-amd64" >&2; exit 1; }
kver=${kernel#/boot/vmlinuz-}
busybox=/bin/busybox
[[ -x $busybox ]] || { echo "test-guest: apt-get install busybox-static" >&2; exit 1; }
bb_version=$({ "$busybox" --help 2>&1 || true; } | sed -n 1p)
command -v cpio >/dev/null || { echo "test-guest: apt-get install cpio" >&2; exit 1; }
command -v qemu-img >/dev/null || { echo "test-guest: apt-get install qemu-utils" >&2; exit 1; }

stamp="$kver $(cat "$HERE/build.sh" "$HERE/init" "$HERE/udhcpc.sh" | sha256sum | cut -d' ' -f1) $bb_version"
if [[ -f $OUT/stamp && $(cat "$OUT/stamp") == "$stamp" && -f $OUT/initrd.img && -f $OUT/vmlinuz && -f $OUT/base.qcow2 ]]; then
  echo "test-guest: up to date in $OUT"
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root=$work/root
mkdir -p "$root"/{bin,dev,proc,sys,run,tmp,etc,lib/modules}
cp "$busybox" "$root/bin/busybox"
for applet in $("$busybox" --list); do [[ $applet == busybox ]] || ln -sf busybox "$root/bin/$applet"; done
install -m 0755 "$HERE/init" "$root/init"
install -m 0755 "$HERE/udhcpc.sh" "$root/bin/udhcpc.sh"

# Modules in dependency order, flattened into /lib/modules; /etc/modules lists the load order.
: >"$root/etc/modules"
for m in virtio_pci virtio_net virtio_blk virtio_console virtio_rng button evdev pvpanic-pci qemu_fw_cfg; do
  modprobe -S "$kver" --show-depends "$m" | awk '$1 == "insmod" {print $2}'
done | awk '!seen[$0]++' | while read -r ko; do
  name=$(basename "$ko")
  case $name in
    *.ko.xz) xz -dc "$ko" >"$root/lib/modules/${name%.xz}"; name=${name%.xz} ;;
    *.ko.zst) zstd -qdc "$ko" >"$root/lib/modules/${name%.zst}"; name=${name%.zst} ;;
    *) cp "$ko" "$root/lib/modules/$name" ;;
  esac
  echo "$name" >>"$root/etc/modules"
done

(cd "$root" && find . | LC_ALL=C sort | cpio -o -H newc --quiet -R 0:0) | gzip -9 >"$work/initrd.img"
cp "$kernel" "$work/vmlinuz"
# An empty read-only base so the launcher's overlay path is exercised like a node image's.
qemu-img create -q -f qcow2 "$work/base.qcow2" 256M
mv "$work/initrd.img" "$work/vmlinuz" "$work/base.qcow2" "$OUT/"
echo "$stamp" >"$OUT/stamp"
echo "test-guest: built $OUT (kernel $kver)"
