#!/usr/bin/env bash
# Makes the test guest bootable the way a Flatcar disk boots: firmware (SeaBIOS) → MBR boot code
# → SYSLINUX on a FAT partition → the same kernel and initramfs build.sh made for direct kernel
# boot. No loop devices and no root: sfdisk on a file, mkfs.fat and mtools on the partition
# image, `syslinux` (the mtools installer) for the boot sector.
#
# Usage: build-disk.sh DIR   (reads DIR/vmlinuz and DIR/initrd.img, writes DIR/boot.qcow2)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
LOG_NAME="test-guest disk"
# shellcheck source=../../hack/lib/common.sh
source "$HERE/../../hack/lib/common.sh"
DIR=${1:?usage: build-disk.sh DIR}
export PATH=$PATH:/sbin:/usr/sbin
require sfdisk:fdisk mkfs.fat:dosfstools mcopy:mtools syslinux qemu-img:qemu-utils
mbr=/usr/lib/syslinux/mbr/mbr.bin
[[ -f $mbr ]] || die "no $mbr: apt-get install syslinux-common"

stamp="$(cat "$DIR/stamp" 2>/dev/null) $(sha256sum "$HERE/build-disk.sh" | cut -d' ' -f1)"
if [[ -f $DIR/boot.qcow2 && -f $DIR/boot.stamp && $(cat "$DIR/boot.stamp") == "$stamp" ]]; then
  log "up to date in $DIR"
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# FAT32 partition big enough for kernel + initramfs with room to spare, from 1 MiB on.
need=$(( ($(stat -c %s "$DIR/vmlinuz") + $(stat -c %s "$DIR/initrd.img")) / 1048576 + 32 ))
part_mib=$(( need < 64 ? 64 : need ))
truncate -s "${part_mib}M" "$work/part.img"
mkfs.fat -F 32 -n CAPKBOOT "$work/part.img" >/dev/null
cat >"$work/syslinux.cfg" <<'CFG'
SERIAL 0 115200
DEFAULT capk
PROMPT 0
TIMEOUT 0
LABEL capk
  KERNEL vmlinuz
  INITRD initrd.img
  APPEND console=ttyS0 quiet panic=-1 capk.boot=disk capk.marker-disk=etcdfs
CFG
export MTOOLS_SKIP_CHECK=1
mcopy -i "$work/part.img" "$DIR/vmlinuz" "$DIR/initrd.img" "$work/syslinux.cfg" ::/
syslinux --install "$work/part.img"

truncate -s "$(( part_mib + 1 ))M" "$work/disk.img"
printf 'label: dos\nstart=2048, type=c, bootable\n' | sfdisk -q "$work/disk.img"
dd if="$mbr" of="$work/disk.img" bs=440 count=1 conv=notrunc status=none
dd if="$work/part.img" of="$work/disk.img" bs=1M seek=1 conv=notrunc status=none
qemu-img convert -q -f raw -O qcow2 "$work/disk.img" "$work/boot.qcow2"
mv "$work/boot.qcow2" "$DIR/boot.qcow2"
echo "$stamp" >"$DIR/boot.stamp"
log "built $DIR/boot.qcow2 (FAT32 ${part_mib} MiB, SYSLINUX)"
