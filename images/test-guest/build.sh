#!/usr/bin/env bash
# Builds the launcher's test guest: Debian's cloud kernel (linux-image-cloud-amd64) and an
# initramfs of busybox-static, the virtio modules it needs, upstream Ignition (built from the Go
# module proxy by build-ignition.sh) with the shared libraries it loads, and Debian's
# useradd/usermod (Ignition runs them for passwd.users). The guest gets its address by DHCP from
# the launcher, reports what it learned on the serial console (lines starting with
# CAPK-TESTGUEST), pings a peer, runs Ignition's fetch/mount/files/umount stages on the config
# from fw_cfg against a tmpfs root, starts the enabled units with run-units.sh (no systemd), and
# powers off on the ACPI power button. It is a test fixture, not a node image: see README.md.
#
# Usage: build.sh OUTDIR   (writes OUTDIR/vmlinuz, OUTDIR/initrd.img, OUTDIR/base.qcow2)
# Env: CAPK_IGNITION_BIN (default OUTDIR/../bin/ignition, from build-ignition.sh).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
LOG_NAME=test-guest
# shellcheck source=../../hack/lib/common.sh
source "$HERE/../../hack/lib/common.sh"
DEST=${1:?usage: build.sh OUTDIR}
mkdir -p "$DEST"

kernel=$(find /boot -maxdepth 1 -name 'vmlinuz-*-cloud-amd64' | sort -V | tail -1)
[[ -n $kernel ]] || die "no /boot/vmlinuz-*-cloud-amd64: apt-get install linux-image-cloud-amd64"
kver=${kernel#/boot/vmlinuz-}
busybox=/bin/busybox
[[ -x $busybox ]] || die "no $busybox: apt-get install busybox-static"
bb_version=$({ "$busybox" --help 2>&1 || true; } | sed -n 1p)
require cpio qemu-img:qemu-utils
ignition=${CAPK_IGNITION_BIN:-$(dirname "$DEST")/bin/ignition}
[[ -x $ignition ]] || die "no $ignition: run images/test-guest/build-ignition.sh"
for t in useradd usermod; do
  [[ -x /usr/sbin/$t ]] || die "no /usr/sbin/$t: apt-get install passwd"
done

stamp="$kver $(cat "$HERE/build.sh" "$HERE/init" "$HERE/udhcpc.sh" "$HERE/run-units.sh" "$HERE/kubeadm" "$HERE/systemctl" "$HERE/hostnamectl" "$ignition" | sha256sum | cut -d' ' -f1) $bb_version"
if [[ -f $DEST/stamp && $(cat "$DEST/stamp") == "$stamp" && -f $DEST/initrd.img && -f $DEST/vmlinuz && -f $DEST/base.qcow2 ]]; then
  log "up to date in $DEST"
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root=$work/root
mkdir -p "$root"/{bin,dev,proc,sys,run,tmp,etc,sysroot,lib/modules,usr/bin,usr/sbin,usr/share/capk}
cp "$busybox" "$root/bin/busybox"
for applet in $("$busybox" --list); do [[ $applet == busybox ]] || ln -sf busybox "$root/bin/$applet"; done
install -m 0755 "$HERE/init" "$root/init"
install -m 0755 "$HERE/udhcpc.sh" "$root/bin/udhcpc.sh"
install -m 0755 "$HERE/run-units.sh" "$root/bin/run-units.sh"
install -m 0755 "$HERE/kubeadm" "$HERE/systemctl" "$HERE/hostnamectl" "$root/usr/share/capk/"

# A dynamically linked program and the shared libraries ldd says it loads, at the same paths.
with_libs() {
  install -m 0755 "$1" "$root$2"
  ldd "$1" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' | while read -r lib; do
    mkdir -p "$root$(dirname "$lib")"
    [[ -e $root$lib ]] || cp -L "$lib" "$root$lib"
  done
}
with_libs "$ignition" /usr/bin/ignition
with_libs /usr/sbin/useradd /usr/sbin/useradd
with_libs /usr/sbin/usermod /usr/sbin/usermod

# Programs the OS image would have and busybox lacks, for the guest's /sysroot, usr-merged (/lib
# and /lib64 paths go under usr/): GNU install (capk-bootstrap's staging script uses it) and
# openssl (the stand-in apiserver of kubeadm init, with a throwaway self-signed certificate), and
# envsubst (Flatcar has it; CABPK Ignition configs use it to fill in the node's name).
skel=$root/usr/share/capk/sysroot
for prog in /usr/bin/install /usr/bin/openssl /usr/bin/envsubst; do
  mkdir -p "$skel/usr/bin"
  cp "$prog" "$skel/usr/bin/"
  ldd "$prog" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' | while read -r lib; do
    case $lib in /usr/*) dest=$skel$lib ;; *) dest=$skel/usr$lib ;; esac
    mkdir -p "$(dirname "$dest")"
    cp -L "$lib" "$dest"
  done
done

mkdir -p "$skel/usr/share/capk-test"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 3650 \
  -subj /CN=capk-test-apiserver-standin -keyout "$skel/usr/share/capk-test/apiserver.key" \
  -out "$skel/usr/share/capk-test/apiserver.crt" 2>/dev/null
# Its public-key pin, as kubeadm prints it in `--discovery-token-ca-cert-hash sha256:<pin>` (the
# stand-in's `kubeadm init` prints the join command; the certificate stands in for the CA).
openssl x509 -pubkey -noout -in "$skel/usr/share/capk-test/apiserver.crt" | openssl pkey -pubin -outform der |
  sha256sum | cut -d' ' -f1 >"$skel/usr/share/capk-test/ca.pin"

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

# Uncompressed: under TCG the kernel needs about 2 s more to gunzip the ~50 MB (mostly Ignition)
# than to copy it.
(cd "$root" && find . | LC_ALL=C sort | cpio -o -H newc --quiet -R 0:0) >"$work/initrd.img"
cp "$kernel" "$work/vmlinuz"
# An empty read-only base so the launcher's overlay path is exercised like a node image's.
qemu-img create -q -f qcow2 "$work/base.qcow2" 256M
mv "$work/initrd.img" "$work/vmlinuz" "$work/base.qcow2" "$DEST/"
echo "$stamp" >"$DEST/stamp"
log "built $DEST (kernel $kver)"
