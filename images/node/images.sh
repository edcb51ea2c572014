#!/usr/bin/env bash
# The container images the node image preloads, as ONE OCI image layout archive that the guest
# imports with a single `ctr -n k8s.io images import` (images/node/rootfs/usr/lib/capk/preload-images):
# the control-plane images under exactly the names `kubeadm config images list` prints for
# $KUBERNETES_VERSION (no registry host is written here: the names come from kubeadm's output),
# the flannel images of the workload clusters' CNI, and a toolbox (Debian's static busybox).
#
# Images are assembled directly as OCI layouts (as hack/dev/pause-image.sh does): reproducible
# tar layers, compressed with zstd (a quarter of the size; containerd unpacks zstd layers, and
# much faster than gzip, which matters under TCG), so images that share a base share its blob,
# stored once in the archive and in containerd.
#
#   images.sh WORKDIR IMAGES_LIST   (IMAGES_LIST: kubeadm's output, one name per line)
#   writes WORKDIR/images/k8s-images.oci.tar and WORKDIR/images/images.txt (the names)
#
# Layers:
#   static   /etc/passwd, /etc/group (root, nonroot 65532), /etc/nsswitch.conf, /tmp, the CA
#            bundle: what the distroless static base of the upstream images gives
#   iptables Debian minbase + iptables/ipset/conntrack/kmod (WORKDIR/iptables-base.tar from
#            rootfs.sh): kube-proxy and flannel program the node's packet filter
#   one layer per program on top.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=../../hack/versions.env
source "$ROOT/hack/versions.env"
WORK=${1:?usage: images.sh WORKDIR IMAGES_LIST}
LIST=${2:?usage: images.sh WORKDIR IMAGES_LIST}
OUT=${CAPK_OUTPUT:-$ROOT/_output}
BIN=$OUT/bin

log() { printf '%s node-image images: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

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
mkdir -p "$stage" "$layout/blobs/sha256"

blob() { # FILE -> digest hex; the file moves into the layout's blobs
  local d
  d=$(sha256sum "$1" | cut -d' ' -f1)
  mv "$1" "$layout/blobs/sha256/$d"
  echo "$d"
}
# layer TAR -> "<diff id> <blob digest>": the tar's digest and that of its zstd blob.
layer() {
  local diff
  diff=$(sha256sum "$1" | cut -d' ' -f1)
  zstd -q -3 -T0 --rm "$1" -o "$1.zst"
  echo "$diff $(blob "$1.zst")"
}
size() { stat -c %s "$layout/blobs/sha256/$1"; }
# tar_dir DIR OUT: a reproducible layer (fixed order, owner, mtime).
tar_dir() { tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$1" -cf "$2" .; }

# --- shared layers ----------------------------------------------------------------------------------
s=$stage/static
mkdir -p "$s/etc/ssl/certs" "$s/tmp" "$s/home/nonroot"
chmod 1777 "$s/tmp"
printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$s/etc/passwd"
printf 'root:x:0:\nnonroot:x:65532:\n' >"$s/etc/group"
printf 'hosts: files dns\n' >"$s/etc/nsswitch.conf"
tar -xOf "$WORK/rootfs.tar" ./etc/ssl/certs/ca-certificates.crt >"$s/etc/ssl/certs/ca-certificates.crt"
tar_dir "$s" "$stage/static.tar"
STATIC=$(layer "$stage/static.tar")
cp "$WORK/iptables-base.tar" "$stage/iptables.tar"
IPTABLES=$(layer "$stage/iptables.tar")

# bin_layer PATH_IN_IMAGE BINARY [FILE_CAPS] -> the layer (see layer) holding just that program,
# with FILE_CAPS (setcap's syntax) as its file capabilities, stored in the tar as the
# security.capability xattr (containerd sets it when it unpacks the layer).
bin_layer() {
  local dir=$stage/bin-$(basename "$1")
  mkdir -p "$dir$(dirname "$1")"
  install -m 0755 "$2" "$dir$1"
  if [[ -n ${3:-} ]]; then
    setcap "$3" "$dir$1"
    tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 --xattrs --xattrs-include=security.capability \
      -C "$dir" -cf "$dir.tar" .
  else
    tar_dir "$dir" "$dir.tar"
  fi
  layer "$dir.tar"
}

manifests=()
names=()
# image NAME CONFIG_JSON_FRAGMENT LAYER...: writes config + manifest, records the name.
image() {
  local name=$1 cfg=$2 diff_ids="" layers="" l f diff digest
  shift 2
  for l in "$@"; do
    read -r diff digest <<<"$l"
    diff_ids+="${diff_ids:+,}\"sha256:$diff\""
    layers+="${layers:+,}{\"mediaType\":\"application/vnd.oci.image.layer.v1.tar+zstd\",\"digest\":\"sha256:$digest\",\"size\":$(size "$digest")}"
  done
  f=$stage/config.json
  printf '{"architecture":"amd64","os":"linux","config":%s,"rootfs":{"type":"layers","diff_ids":[%s]},"history":[{"created_by":"images/node/images.sh"}]}' \
    "$cfg" "$diff_ids" >"$f"
  local config
  config=$(blob "$f")
  f=$stage/manifest.json
  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[%s]}' \
    "$config" "$(size "$config")" "$layers" >"$f"
  local manifest
  manifest=$(blob "$f")
  manifests+=("{\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\"digest\":\"sha256:$manifest\",\"size\":$(size "$manifest"),\"platform\":{\"architecture\":\"amd64\",\"os\":\"linux\"},\"annotations\":{\"io.containerd.image.name\":\"$name\",\"org.opencontainers.image.ref.name\":\"${name##*:}\"}}")
  names+=("$name")
  log "$name"
}
PATH_ENV='"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]'

# --- control plane (static Go programs in /usr/local/bin, as upstream's images) ------------------------
for c in kube-apiserver kube-controller-manager kube-scheduler; do
  image "$(kubeadm_name "$c")" "{$PATH_ENV,\"Entrypoint\":[\"/usr/local/bin/$c\"]}" "$STATIC" "$(bin_layer /usr/local/bin/$c "$BIN/$c")"
done
# etcd: kubeadm names a patch the proxy may not serve; ours is $ETCD_VERSION (see README.md).
image "$(kubeadm_name etcd)" "{$PATH_ENV,\"Entrypoint\":[\"/usr/local/bin/etcd\"],\"Labels\":{\"org.opencontainers.image.version\":\"$ETCD_VERSION\"}}" \
  "$STATIC" "$(bin_layer /usr/local/bin/etcd "$BIN/etcd")"
# CoreDNS runs as nonroot like upstream's image, and like it carries the file capability
# cap_net_bind_service: kubeadm's Deployment adds NET_BIND_SERVICE to the container, but a non-root
# process only gets a capability in its effective set from the file (containerd sets no ambient
# capabilities), and without it `listen tcp :53: bind: permission denied` (seen in make e2e-workload).
image "$(kubeadm_name coredns)" "{$PATH_ENV,\"Entrypoint\":[\"/coredns\"],\"User\":\"65532:65532\",\"Labels\":{\"org.opencontainers.image.version\":\"$COREDNS_VERSION\"}}" \
  "$STATIC" "$(bin_layer /coredns "$BIN/coredns" cap_net_bind_service=+ep)"
# kube-proxy programs iptables: Debian's iptables (nft backend, like the guest's own).
image "$(kubeadm_name kube-proxy)" "{$PATH_ENV,\"Entrypoint\":[\"/usr/local/bin/kube-proxy\"]}" \
  "$IPTABLES" "$(bin_layer /usr/local/bin/kube-proxy "$BIN/kube-proxy")"
# pause: Debian's static catatonit in pause mode (as hack/dev/pause-image.sh).
image "$(kubeadm_name pause)" '{"Entrypoint":["/catatonit","-P"],"WorkingDir":"/","User":"65535:65535"}' \
  "$(bin_layer /catatonit "$catatonit")"

# --- flannel: flanneld at /opt/bin (its DaemonSet's command), the CNI plugin at /flannel --------------
image "$FLANNEL_IMAGE" "{$PATH_ENV,\"Entrypoint\":[\"/opt/bin/flanneld\"]}" "$IPTABLES" "$(bin_layer /opt/bin/flanneld "$BIN/flanneld")"
image "$FLANNEL_CNI_IMAGE" "{$PATH_ENV,\"Entrypoint\":[\"/flannel\"]}" "$IPTABLES" "$(bin_layer /flannel "$BIN/flannel-cni-plugin")"

# --- toolbox: a shell and the tools to look at a cluster from a Pod (nslookup, wget, httpd, nc,
# nsenter), so a workload cluster of this image can be checked with nothing pulled ------------------
t=$stage/toolbox
mkdir -p "$t/bin"
install -m 0755 "$busybox" "$t/bin/busybox"
for a in $("$busybox" --list); do [[ $a == busybox ]] || ln -s busybox "$t/bin/$a"; done
tar_dir "$t" "$t.tar"
image "$TOOLBOX_IMAGE" "{$PATH_ENV,\"Cmd\":[\"/bin/sh\"],\"Labels\":{\"org.opencontainers.image.version\":\"$busybox_version\"}}" \
  "$STATIC" "$(layer "$t.tar")"

index=$(IFS=,; echo "${manifests[*]}")
printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[%s]}\n' "$index" >"$layout/index.json"
echo '{"imageLayoutVersion":"1.0.0"}' >"$layout/oci-layout"
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$layout" -cf "$D/k8s-images.oci.tar.partial" .
mv "$D/k8s-images.oci.tar.partial" "$D/k8s-images.oci.tar"
printf '%s\n' "${names[@]}" >"$D/images.txt"
rm -rf "$stage" "$layout"
log "$(wc -l <"$D/images.txt") images, $(du -h "$D/k8s-images.oci.tar" | cut -f1) in $D/k8s-images.oci.tar"
