#!/usr/bin/env bash
# The container images the node image preloads, as ONE OCI image layout archive that the guest
# imports with a single `ctr -n k8s.io images import` (images/node/rootfs/usr/lib/capk/preload-images):
# the control-plane images under exactly the names `kubeadm config images list` prints for
# $KUBERNETES_VERSION (no registry host is written here: the names come from kubeadm's output),
# the flannel images of the workload clusters' CNI, and a toolbox (Debian's static busybox).
#
# Each image is committed with buildah (hack/lib/common.sh buildah_image) from reproducible tar
# layers, and all of them are pushed into one OCI image layout with zstd-compressed layers (a
# quarter of the size; containerd unpacks zstd layers, and much faster than gzip, which matters
# under TCG), so images that share a base share its blob, stored once in the archive and in
# containerd. The images are removed from buildah's storage afterwards: the archive is the output.
#
# Layers:
#   static   /etc/passwd, /etc/group (root, nonroot 65532), /etc/nsswitch.conf, /tmp, the CA
#            bundle: what the distroless static base of the upstream images gives
#   iptables Debian minbase + iptables/ipset/conntrack/kmod (WORKDIR/iptables-base.tar from
#            rootfs.sh): kube-proxy and flannel program the node's packet filter
#   one layer per program on top.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
LOG_NAME="node-image images"
# shellcheck source=../../hack/lib/common.sh
source "$HERE/../../hack/lib/common.sh"
# shellcheck source=../../hack/versions.env
source "$ROOT/hack/versions.env"
WORK=${1:?usage: images.sh WORKDIR IMAGES_LIST}
LIST=${2:?usage: images.sh WORKDIR IMAGES_LIST}
require buildah zstd setcap:libcap2-bin

# The name kubeadm prints for REPO (the last path element before the tag).
kubeadm_name() {
  local n
  n=$(awk -v r="$1" '{ split($0, p, ":"); k = p[1]; sub(/.*\//, "", k); if (k == r) print }' "$LIST")
  [[ -n $n ]] || die "kubeadm config images list printed no $1 image (list: $(tr '\n' ' ' <"$LIST"))"
  echo "$n"
}
# Names of the CNI images: not kubeadm's, chosen here; localhost/ so no lookup leaves the node.
FLANNEL_IMAGE=localhost/capk/flannel:$FLANNEL_VERSION
FLANNEL_CNI_IMAGE=localhost/capk/flannel-cni-plugin:$FLANNEL_CNI_PLUGIN_VERSION

catatonit=$(command -v catatonit) || die "catatonit not found (apt-get install catatonit)"
file -L "$catatonit" | grep -q 'statically linked' || die "$catatonit is not statically linked"
busybox=$(command -v busybox) || die "busybox not found (apt-get install busybox-static)"
file -L "$busybox" | grep -q 'statically linked' || die "$busybox is not statically linked (apt-get install busybox-static)"
# "BusyBox v1.35.0 (Debian ...) multi-call binary." -> v1.35.0
busybox_version=$("$busybox" 2>&1 | sed -n '1s/^BusyBox \(v[0-9.]*\).*/\1/p')
[[ -n $busybox_version ]] || die "cannot read the version of $busybox"
TOOLBOX_IMAGE=localhost/capk/toolbox:busybox-$busybox_version
for b in kube-apiserver kube-controller-manager kube-scheduler kube-proxy etcd coredns flanneld flannel-cni-plugin; do
  [[ -x $BIN/$b ]] || die "$BIN/$b missing (images/node/build.sh builds it first)"
done
[[ -f $WORK/iptables-base.tar ]] || die "$WORK/iptables-base.tar missing (images/node/rootfs.sh)"

D=$WORK/images
stage=$D/stage
layout=$D/oci
rm -rf "$stage" "$layout"
mkdir -p "$stage"

# tar_dir DIR OUT: a reproducible layer (fixed order, owner, mtime).
tar_dir() { tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$1" -cf "$2" .; }

# Images made here, in buildah's storage until the end: the two bases, then the preloaded images.
built=()
remove_built() { # the newest first: the bases go when nothing is made from them any more
  local i
  for ((i = ${#built[@]} - 1; i >= 0; i--)); do capk_buildah rmi "${built[i]}" >/dev/null 2>&1 || true; done
}
trap remove_built EXIT
BASE_STATIC=localhost/capk/node-image-build/static:latest
BASE_IPTABLES=localhost/capk/node-image-build/iptables:latest

# --- shared layers ----------------------------------------------------------------------------------
s=$stage/static
mkdir -p "$s/etc/ssl/certs" "$s/tmp" "$s/home/nonroot"
chmod 1777 "$s/tmp"
printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$s/etc/passwd"
printf 'root:x:0:\nnonroot:x:65532:\n' >"$s/etc/group"
printf 'hosts: files dns\n' >"$s/etc/nsswitch.conf"
tar -xOf "$WORK/rootfs.tar" ./etc/ssl/certs/ca-certificates.crt >"$s/etc/ssl/certs/ca-certificates.crt"
tar_dir "$s" "$stage/static.tar"
buildah_image "$BASE_STATIC" scratch "$stage/static.tar" --created-by "images/node/images.sh: static"
built+=("$BASE_STATIC")
buildah_image "$BASE_IPTABLES" scratch "$WORK/iptables-base.tar" --created-by "images/node/images.sh: iptables"
built+=("$BASE_IPTABLES")

# bin_layer PATH_IN_IMAGE BINARY [FILE_CAPS] -> a layer tarball holding just that program, with
# FILE_CAPS (setcap's syntax) as its file capabilities, stored in the tar as the
# security.capability xattr (containerd sets it when it unpacks the layer).
bin_layer() {
  local dir
  dir=$stage/bin-$(basename "$1")
  mkdir -p "$dir$(dirname "$1")"
  install -m 0755 "$2" "$dir$1"
  if [[ -n ${3:-} ]]; then
    setcap "$3" "$dir$1"
    tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 --xattrs --xattrs-include=security.capability \
      -C "$dir" -cf "$dir.tar" .
  else
    tar_dir "$dir" "$dir.tar"
  fi
  echo "$dir.tar"
}

names=()
# image NAME FROM LAYER_TAR CONFIG_FLAG...: commits NAME (see buildah_image), records the name.
image() {
  local name=$1
  buildah_image "$@" --created-by images/node/images.sh
  built+=("$name")
  names+=("$name")
  log "$name"
}
PATH_ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# --- control plane (static Go programs in /usr/local/bin, as upstream's images) ------------------------
for c in kube-apiserver kube-controller-manager kube-scheduler; do
  image "$(kubeadm_name "$c")" "$BASE_STATIC" "$(bin_layer "/usr/local/bin/$c" "$BIN/$c")" \
    --env "$PATH_ENV" --entrypoint "[\"/usr/local/bin/$c\"]" --cmd ''
done
# etcd: kubeadm names a patch the proxy may not serve; ours is $ETCD_VERSION (see README.md).
image "$(kubeadm_name etcd)" "$BASE_STATIC" "$(bin_layer /usr/local/bin/etcd "$BIN/etcd")" \
  --env "$PATH_ENV" --entrypoint '["/usr/local/bin/etcd"]' --cmd '' --label "org.opencontainers.image.version=$ETCD_VERSION"
# CoreDNS runs as nonroot like upstream's image, and like it carries the file capability
# cap_net_bind_service: kubeadm's Deployment adds NET_BIND_SERVICE to the container, but a non-root
# process only gets a capability in its effective set from the file (containerd sets no ambient
# capabilities), and without it `listen tcp :53: bind: permission denied` (seen in make e2e-workload).
image "$(kubeadm_name coredns)" "$BASE_STATIC" "$(bin_layer /coredns "$BIN/coredns" cap_net_bind_service=+ep)" \
  --env "$PATH_ENV" --entrypoint '["/coredns"]' --cmd '' --user 65532:65532 \
  --label "org.opencontainers.image.version=$COREDNS_VERSION"
# kube-proxy programs iptables: Debian's iptables (nft backend, like the guest's own).
image "$(kubeadm_name kube-proxy)" "$BASE_IPTABLES" "$(bin_layer /usr/local/bin/kube-proxy "$BIN/kube-proxy")" \
  --env "$PATH_ENV" --entrypoint '["/usr/local/bin/kube-proxy"]' --cmd ''
# pause: Debian's static catatonit in pause mode (as hack/dev/pause-image.sh).
image "$(kubeadm_name pause)" scratch "$(bin_layer /catatonit "$catatonit")" \
  --entrypoint '["/catatonit","-P"]' --cmd '' --workingdir / --user 65535:65535

# --- flannel: flanneld at /opt/bin (its DaemonSet's command), the CNI plugin at /flannel --------------
image "$FLANNEL_IMAGE" "$BASE_IPTABLES" "$(bin_layer /opt/bin/flanneld "$BIN/flanneld")" \
  --env "$PATH_ENV" --entrypoint '["/opt/bin/flanneld"]' --cmd ''
image "$FLANNEL_CNI_IMAGE" "$BASE_IPTABLES" "$(bin_layer /flannel "$BIN/flannel-cni-plugin")" \
  --env "$PATH_ENV" --entrypoint '["/flannel"]' --cmd ''

# --- toolbox: a shell and the tools to look at a cluster from a Pod (nslookup, wget, httpd, nc,
# nsenter), so a workload cluster of this image can be checked with nothing pulled ------------------
t=$stage/toolbox
mkdir -p "$t/bin"
install -m 0755 "$busybox" "$t/bin/busybox"
for a in $("$busybox" --list); do [[ $a == busybox ]] || ln -s busybox "$t/bin/$a"; done
tar_dir "$t" "$t.tar"
image "$TOOLBOX_IMAGE" "$BASE_STATIC" "$t.tar" \
  --env "$PATH_ENV" --cmd '["/bin/sh"]' --label "org.opencontainers.image.version=$busybox_version"

# One layout for all: a pushed layer whose blob the layout has already is not written again.
for name in "${names[@]}"; do
  capk_buildah push --quiet --compression-format zstd --compression-level 3 "$name" "oci:$layout:$name" >/dev/null ||
    die "buildah push of $name into the OCI layout failed"
done
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$layout" -cf "$D/k8s-images.oci.tar.partial" .
mv "$D/k8s-images.oci.tar.partial" "$D/k8s-images.oci.tar"
printf '%s\n' "${names[@]}" >"$D/images.txt"
rm -rf "$stage" "$layout"
log "$(wc -l <"$D/images.txt") images, $(du -h "$D/k8s-images.oci.tar" | cut -f1) in $D/k8s-images.oci.tar"
