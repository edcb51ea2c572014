#!/usr/bin/env bash
# Builds the Kubernetes node image (`make node-image`): a bootable qcow2 of Debian bookworm with
# kubelet/kubeadm/kubectl at $KUBERNETES_VERSION, containerd, the control-plane and flannel images
# preloaded, and upstream Ignition in the initramfs; and the same disk as a container-image node
# image (FROM scratch, /disk/image.qcow2). See README.md for what is in it and why.
#
#   bash images/node/build.sh
#
# Outputs (under _output/node-image/):
#   node-<k8s version>-<hash>.qcow2 and node.qcow2 (a link to it)   the disk
#   node-image.env   CAPK_NODE_IMAGE=localhost/capk/node:<k8s version>-<hash>, its path in the
#                    image, the qcow2 path, the preloaded image names
# and the container image in buildah's storage (_output/buildah, as hack/dev/images.sh).
#
# Nothing is downloaded except Debian packages (debootstrap/apt) and Go modules (the proxy). The
# hash covers every input (recipe files, the Debian root's stamp, every binary); when the qcow2 and
# the container image of that hash exist, the build does nothing.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
LOG_NAME=node-image
# shellcheck source=../../hack/lib/common.sh
source "$HERE/../../hack/lib/common.sh"
# shellcheck source=../../hack/versions.env
source "$ROOT/hack/versions.env"
WORK=$OUT/node-image
IGNITION_MODULE=github.com/coreos/ignition/v2
IGNITION_VERSION=${IGNITION_VERSION:-v2.26.0}
# Virtual size of the image's root partition; the guest grows it to the launcher's disk size.
ROOT_MIB=4096
LABEL=dev.capk.inputs

[[ $(id -u) == 0 ]] || die "needs root (debootstrap, chroot for dracut, buildah)"
export PATH=$PATH:/usr/sbin:/sbin
require debootstrap buildah mke2fs:e2fsprogs mkfs.fat:dosfstools mcopy:mtools syslinux sfdisk:fdisk \
  qemu-img:qemu-utils zstd catatonit containerd ctr:containerd setcap:libcap2-bin getcap:libcap2-bin file \
  flock:util-linux go:golang
MBR=/usr/lib/syslinux/mbr/mbr.bin
[[ -f $MBR ]] || die "no $MBR: apt-get install syslinux-common"
t0=$SECONDS
mkdir -p "$WORK"

# --- 1. programs (each script skips what it already built) ---------------------------------------------
# The Kubernetes binaries share build-upstream.sh's wrapper module with other builds: one at a time.
flock "$OUT/.build-upstream.lock" bash "$ROOT/hack/build-upstream.sh" \
  kubelet kubeadm kubectl kube-apiserver kube-controller-manager kube-scheduler kube-proxy etcd >&2
bash "$ROOT/hack/build-addons.sh" >&2
IGNITION_VERSION=$IGNITION_VERSION bash "$ROOT/images/test-guest/build-ignition.sh" "$BIN/ignition" >&2

# --- 2. the Debian root and the iptables base layer -----------------------------------------------------
bash "$HERE/rootfs.sh" "$WORK"

# --- 3. the input hash --------------------------------------------------------------------------------
ignition_src=$(cd "$WORK" && GOTOOLCHAIN=local GOFLAGS=-mod=mod go mod download -json "$IGNITION_MODULE@$IGNITION_VERSION" |
  sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[[ -d $ignition_src/dracut/30ignition ]] || die "no dracut/30ignition in $IGNITION_MODULE@$IGNITION_VERSION ($ignition_src)"
programs=(kubelet kubeadm kubectl kube-apiserver kube-controller-manager kube-scheduler kube-proxy etcd coredns flanneld flannel-cni-plugin ignition)
key=$(
  {
    (cd "$HERE" && find . -type f ! -name '*.md' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum)
    cat "$ROOT/hack/versions.env" "$ROOT/hack/lib/common.sh" "$WORK/rootfs.stamp" "$WORK/iptables-base.stamp"
    for p in "${programs[@]}"; do echo "$p $(sha256sum <"$BIN/$p" | cut -d' ' -f1)"; done
    echo "catatonit $(sha256sum <"$(command -v catatonit)" | cut -d' ' -f1)"
    echo "busybox $(sha256sum <"$(command -v busybox)" | cut -d' ' -f1)"
    containerd --version # it writes the containerd seed
    (cd "$ignition_src/dracut/30ignition" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum)
  } | sha256sum | cut -c1-12
)
TAG=$KUBERNETES_VERSION-$key
IMAGE=localhost/capk/node:$TAG
QCOW2=$WORK/node-$TAG.qcow2
ENV_FILE=$WORK/node-image.env

write_env() {
  local tmp
  tmp=$(mktemp "$ENV_FILE.XXXXXX")
  chmod 0644 "$tmp"
  cat >"$tmp" <<EOF
# Written by images/node/build.sh (make node-image): the Kubernetes node image.
CAPK_NODE_IMAGE=$IMAGE
CAPK_NODE_IMAGE_PATH=/disk/image.qcow2
CAPK_NODE_IMAGE_QCOW2=$QCOW2
CAPK_NODE_KUBERNETES_VERSION=$KUBERNETES_VERSION
CAPK_NODE_PRELOADED_IMAGES="$(tr '\n' ' ' <"$WORK/images/images.txt" | sed 's/ $//')"
EOF
  mv "$tmp" "$ENV_FILE"
  ln -sfn "$(basename "$QCOW2")" "$WORK/node.qcow2"
}

if [[ -f $QCOW2 && -f $WORK/images/images.txt ]] &&
  [[ $(capk_buildah inspect --type image --format "{{index .OCIv1.Config.Labels \"$LABEL\"}}" "$IMAGE" 2>/dev/null) == "$key" ]]; then
  write_env
  log "up to date: $IMAGE ($QCOW2) in $((SECONDS - t0))s"
  exit 0
fi
log "building $IMAGE"

# --- 4. the preloaded images ----------------------------------------------------------------------------
"$BIN/kubeadm" config images list --kubernetes-version "$KUBERNETES_VERSION" >"$WORK/kubeadm-images.txt"
bash "$HERE/images.sh" "$WORK" "$WORK/kubeadm-images.txt"
PAUSE_IMAGE=$(grep -E '/pause:' "$WORK/images/images.txt") || die "no pause image in $WORK/images/images.txt"

# The same images imported and unpacked by this host's containerd (Debian's, the package the image
# installs) into a private root: before containerd first starts, the guest links that root's layers
# into its empty containerd disk and copies the rest (capk-seed-containerd.service) instead of
# importing the archive, which hashes and decompresses every layer (214 s on a control plane under
# TCG, 452 s on a worker beside it).
SEED=$WORK/containerd-seed
SEED_RUN=$WORK/containerd-seed.run
seed_pid=
stop_seed_containerd() {
  [[ -n $seed_pid ]] || return 0
  kill "$seed_pid" 2>/dev/null || true
  wait "$seed_pid" 2>/dev/null || true
  seed_pid=
}
rm -rf "$SEED" "$SEED_RUN"
mkdir -p "$SEED/root" "$SEED_RUN"
printf '%s\n' 'version = 2' "root = \"$SEED/root\"" "state = \"$SEED_RUN/state\"" \
  'disabled_plugins = ["io.containerd.grpc.v1.cri"]' '[grpc]' "  address = \"$SEED_RUN/containerd.sock\"" \
  '[plugins."io.containerd.internal.v1.opt"]' "  path = \"$SEED_RUN/opt\"" >"$SEED_RUN/config.toml"
containerd --config "$SEED_RUN/config.toml" >"$SEED_RUN/containerd.log" 2>&1 &
seed_pid=$!
trap stop_seed_containerd EXIT
seed_ctr=(ctr --address "$SEED_RUN/containerd.sock" --namespace k8s.io)
for _ in $(seq 100); do "${seed_ctr[@]}" version >/dev/null 2>&1 && break; sleep 0.1; done
"${seed_ctr[@]}" version >/dev/null 2>&1 || die "the seed containerd did not start (log $SEED_RUN/containerd.log)"
"${seed_ctr[@]}" images import --snapshotter overlayfs "$WORK/images/k8s-images.oci.tar" >/dev/null
seeded=$("${seed_ctr[@]}" images ls -q)
while read -r name; do
  grep -qxF "$name" <<<"$seeded" || die "$name missing from the seed containerd after the import"
done <"$WORK/images/images.txt"
# CoreDNS binds :53 as non-root through its file capability: the xattr must survive the layer
# tar and containerd's unpack (and mke2fs -d below copies xattrs too).
coredns_file=$(find "$SEED/root/io.containerd.snapshotter.v1.overlayfs/snapshots" -maxdepth 3 -name coredns -type f | head -1)
[[ -n $coredns_file && $(getcap "$coredns_file") == *cap_net_bind_service* ]] ||
  die "the seed's CoreDNS lacks cap_net_bind_service (${coredns_file:-not found})"
# The layers' compressed blobs are not needed once unpacked (containerd's CRI option
# discard_unpacked_layers does the same after a pull): the manifests and configs stay, so the image
# list, the CRI's image status and the unpacked snapshots do too, and the guest copies less. The
# archive in /usr/share/capk/images still has every blob for a re-import.
blobs=$SEED/root/io.containerd.content.v1.content/blobs/sha256
layers=$(find "$blobs" -type f -size -64k -exec grep -ahoE 'layer\.v1\.tar\+zstd","digest":"sha256:[0-9a-f]{64}' {} + |
  sed 's/.*sha256://' | sort -u)
[[ -n $layers ]] || die "no layer found in the seed's manifests"
for d in $layers; do "${seed_ctr[@]}" content rm "sha256:$d" >/dev/null; done
[[ $("${seed_ctr[@]}" images ls -q | grep -vc '^sha256:') == $(wc -l <"$WORK/images/images.txt") ]] ||
  die "the seed lost images when its layer blobs were removed"
stop_seed_containerd
trap - EXIT
# containerd removes a deleted blob's file only at its next garbage collection.
for d in $layers; do rm -f "$blobs/$d"; done
rm -rf "$SEED_RUN"
log "containerd seed: $(wc -l <"$WORK/images/images.txt") images unpacked, $(du -sh "$SEED/root" | cut -f1)"

# --- 5. the root tree -------------------------------------------------------------------------------------
R=$WORK/root
mounted=()
cleanup() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[i]}" 2>/dev/null || true; done
}
trap cleanup EXIT
rm -rf "$R"
mkdir -p "$R"
tar --numeric-owner --xattrs --xattrs-include='*' -xf "$WORK/rootfs.tar" -C "$R"
cp -a "$HERE/rootfs/." "$R/"
chown -R 0:0 "$R/etc/modules-load.d" "$R/etc/sysctl.d" "$R/etc/systemd/network" "$R/usr/lib/capk" "$R/usr/lib/systemd/system"
install -m 0755 "$BIN/kubelet" "$BIN/kubeadm" "$BIN/kubectl" "$R/usr/bin/"
# CNI plugins where kubelet/containerd and flannel's DaemonSet look: Debian's, plus flannel's.
mkdir -p "$R/opt/cni/bin" "$R/etc/cni/net.d"
for p in "$R"/usr/lib/cni/*; do ln -sfn "/usr/lib/cni/$(basename "$p")" "$R/opt/cni/bin/$(basename "$p")"; done
install -m 0755 "$BIN/flannel-cni-plugin" "$R/opt/cni/bin/flannel"
mkdir -p "$R/usr/share/capk/images"
cp "$WORK/images/k8s-images.oci.tar" "$WORK/images/images.txt" "$R/usr/share/capk/images/"
cp -a "$SEED/root" "$R/usr/share/capk/containerd-seed"
# containerd as kubeadm expects: CRI v1 with the systemd cgroup driver (kubeadm's kubelet default)
# and the sandbox image kubeadm names (preloaded, so nothing is pulled for a Pod sandbox).
mkdir -p "$R/etc/containerd"
cat >"$R/etc/containerd/config.toml" <<EOF
# Written by images/node/build.sh.
version = 2

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"

  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"

    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = true

  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/opt/cni/bin"
    conf_dir = "/etc/cni/net.d"
EOF
# First boot: systemd applies presets (Ignition's 20-ignition.preset among them) when the machine
# id is "uninitialized", and commits a new id once the boot succeeded.
printf 'uninitialized\n' >"$R/etc/machine-id"
rm -f "$R/var/lib/dbus/machine-id" "$R/etc/hostname"
ln -sfn ../run/systemd/resolve/stub-resolv.conf "$R/etc/resolv.conf"
# Ignition's dracut module as released, with the binary where its module-setup.sh takes it from.
mkdir -p "$R/usr/lib/dracut/modules.d"
cp -r "$ignition_src/dracut/30ignition" "$R/usr/lib/dracut/modules.d/30ignition"
chmod -R u+w "$R/usr/lib/dracut/modules.d/30ignition"
# Go module zips keep no file modes: give the generator and the helper their executable bit back
# (systemd skips a generator it cannot execute, and Ignition would never run).
chmod 0755 "$R/usr/lib/dracut/modules.d/30ignition/"{ignition-generator,ignition-kargs-helper.sh,module-setup.sh}
install -m 0755 "$BIN/ignition" "$R/usr/lib/dracut/modules.d/30ignition/ignition"
cp -r "$HERE/dracut/50capk" "$R/usr/lib/dracut/modules.d/50capk"
chown -R 0:0 "$R/usr/lib/dracut/modules.d"

for d in proc sys dev; do
  mount --bind "/$d" "$R/$d"
  mounted+=("$R/$d")
done
in_root() { chroot "$R" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin "$@"; }
in_root systemctl enable containerd.service kubelet.service capk-preload-images.service capk-firstboot-done.service \
  capk-growroot.service systemd-networkd.service systemd-networkd-wait-online.service systemd-resolved.service \
  systemd-timesyncd.service capk-etc-hosts.service >/dev/null 2>&1
# Groups that Flatcar has and CAPI templates name in passwd.users (Ignition's useradd fails on a
# group that does not exist); Debian already has adm, sudo and systemd-journal.
for g in docker wheel; do in_root getent group "$g" >/dev/null || in_root groupadd --system "$g"; done
# Flatcar's built-in user `core` (uid 500), which CAPI's Flatcar-style bootstrap data names as the
# owner of files: Ignition fails on a file whose owner does not exist. No password (locked).
in_root getent passwd core >/dev/null ||
  in_root useradd --uid 500 --user-group --create-home --shell /bin/bash \
    --groups sudo,docker,wheel,adm,systemd-journal --comment "CoreOS Admin" core
in_root systemctl disable apt-daily.timer apt-daily-upgrade.timer dpkg-db-backup.timer cni-dhcp.socket cni-dhcp.service >/dev/null 2>&1 || true
# No login prompt on the serial console: it is the machine Pod's log, there is no password to log
# in with, and systemd stops printing unit status to a console a getty holds (the log would end
# at "login:" while the node keeps booting).
in_root systemctl mask serial-getty@ttyS0.service >/dev/null 2>&1
kver=$(find "$R/lib/modules" -mindepth 1 -maxdepth 1 -printf '%f\n' | sort -V | tail -1)
[[ -n $kver && -f $R/boot/vmlinuz-$kver ]] || die "no kernel in the root ($R/boot)"
log "initramfs for $kver (dracut: systemd, Ignition's module, 50capk)"
if ! in_root dracut --force --no-hostonly --no-hostonly-cmdline --no-early-microcode --no-compress \
  --add "ignition capk" --omit "plymouth i18n resume lvm mdraid dmraid crypt multipath nfs iscsi nbd cifs fcoe fcoe-uefi" \
  "/boot/initrd.cpio" "$kver" >"$WORK/dracut.log" 2>&1; then
  tail -30 "$WORK/dracut.log" >&2
  die "dracut failed (log $WORK/dracut.log)"
fi
for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount "${mounted[i]}"; done
mounted=()
lsinitrd_modules=$(grep -c 'Including module' "$WORK/dracut.log" || true)
grep -q "Including module: ignition" "$WORK/dracut.log" || die "dracut did not include Ignition's module (log $WORK/dracut.log)"
initrd_files=$(cd "$R/boot" && cpio -it --quiet <initrd.cpio)
for f in etc/systemd/system/ignition-disks.service.d/10-capk-gomaxprocs.conf etc/systemd/journald.conf.d/10-capk-console.conf; do
  grep -qxF "$f" <<<"$initrd_files" || die "the initramfs lacks $f (dracut/50capk's install())"
done
# zstd: a third of the size for SYSLINUX to read through BIOS calls, and fast to unpack under TCG.
zstd -q -f -10 -T0 "$R/boot/initrd.cpio" -o "$WORK/initrd.img"
rm -f "$R/boot/initrd.cpio" "$R/boot/initrd.img-"*
cp "$R/boot/vmlinuz-$kver" "$WORK/vmlinuz"

# tsc=reliable: under TCG the guest would keep time with the emulated HPET (README.md here,
# "Other boot-time units of the image").
CMDLINE="root=LABEL=capk-root rw console=ttyS0,115200 net.ifnames=0 apparmor=0 ignition.platform.id=qemu tsc=reliable"
syslinux_cfg() { # extra kernel arguments
  cat <<EOF
SERIAL 0 115200
DEFAULT capk
PROMPT 0
TIMEOUT 0
LABEL capk
  KERNEL vmlinuz
  INITRD initrd.img
  APPEND $CMDLINE$1
EOF
}
syslinux_cfg "" >"$R/usr/lib/capk/syslinux.cfg"
syslinux_cfg " ignition.firstboot" >"$WORK/syslinux.cfg"

# --- 6. the disk: MBR + SYSLINUX on FAT32 (as images/test-guest/build-disk.sh) + ext4 root -----------
log "disk: ext4 root ($ROOT_MIB MiB virtual) from the tree, FAT32 boot partition, MBR"
rm -f "$WORK/root.img" "$WORK/boot.img" "$WORK/disk.img"
mke2fs -q -t ext4 -L capk-root -d "$R" -E lazy_itable_init=1,lazy_journal_init=1 "$WORK/root.img" "${ROOT_MIB}M" ||
  die "mke2fs -d failed"
boot_mib=$(( ($(stat -c %s "$WORK/vmlinuz") + $(stat -c %s "$WORK/initrd.img")) / 1048576 + 32 ))
((boot_mib >= 64)) || boot_mib=64
truncate -s "${boot_mib}M" "$WORK/boot.img"
mkfs.fat -F 32 -n CAPK-BOOT "$WORK/boot.img" >/dev/null
export MTOOLS_SKIP_CHECK=1
mcopy -i "$WORK/boot.img" "$WORK/vmlinuz" "$WORK/initrd.img" "$WORK/syslinux.cfg" ::/
syslinux --install "$WORK/boot.img"
truncate -s "$((1 + boot_mib + ROOT_MIB))M" "$WORK/disk.img"
printf 'label: dos\nstart=2048, size=%s, type=c, bootable\nstart=%s, type=83\n' \
  "$((boot_mib * 2048))" "$((2048 + boot_mib * 2048))" | sfdisk -q "$WORK/disk.img"
dd if="$MBR" of="$WORK/disk.img" bs=440 count=1 conv=notrunc status=none
dd if="$WORK/boot.img" of="$WORK/disk.img" bs=1M seek=1 conv=notrunc,sparse status=none
dd if="$WORK/root.img" of="$WORK/disk.img" bs=1M seek=$((1 + boot_mib)) conv=notrunc,sparse status=none
rm -f "$WORK"/node-*.qcow2.partial
qemu-img convert -q -f raw -O qcow2 "$WORK/disk.img" "$QCOW2.partial"
rm -f "$WORK/root.img" "$WORK/boot.img" "$WORK/disk.img"
rm -rf "$R"
# Older disks go; the new one replaces them.
for old in "$WORK"/node-*.qcow2; do [[ $old == "$QCOW2" ]] || rm -f "$old"; done
mv "$QCOW2.partial" "$QCOW2"

# --- 7. the container-image node image ------------------------------------------------------------------
old=$(capk_buildah images --format '{{.Name}}:{{.Tag}}' | grep '^localhost/capk/node:' || true)
ctr=$(capk_buildah from --pull=never scratch)
capk_buildah copy --chown 0:0 --chmod 0644 "$ctr" "$QCOW2" /disk/image.qcow2 >/dev/null
capk_buildah config --label "$LABEL=$key" --label "org.opencontainers.image.version=$KUBERNETES_VERSION" \
  --label "org.opencontainers.image.description=CAPK Kubernetes $KUBERNETES_VERSION node image (images/node) at /disk/image.qcow2" "$ctr"
capk_buildah commit --quiet --rm "$ctr" "$IMAGE" >/dev/null
for o in $old; do [[ $o == "$IMAGE" ]] || capk_buildah rmi "$o" >/dev/null 2>&1 || true; done

write_env
log "built $IMAGE in $((SECONDS - t0))s: qcow2 $(du -h --apparent-size "$QCOW2" | cut -f1) (allocated $(du -h "$QCOW2" | cut -f1)), $lsinitrd_modules dracut modules, initrd $(du -h "$WORK/initrd.img" | cut -f1)"
