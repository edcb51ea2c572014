#!/usr/bin/env bash
# Every image the local management cluster needs for the Cluster API + CAPK journey, built here and
# imported into the dev containerd (namespace k8s.io), so the kubelet never pulls (Pods
# name concrete tags with imagePullPolicy IfNotPresent). No registry is involved.
#
#   bash hack/dev/images.sh              build what changed, import what containerd lacks
#   bash hack/dev/images.sh --no-import  build only (no running local MC needed)
#
# Images (names also written to _output/dev/images.env as shell variables):
#   localhost/capk/capk-{controller,launcher}:dev   the runtime stage of Dockerfile.controller and
#       Dockerfile.launcher (the files a Docker user builds; FROM debian:bookworm-slim of
#       images/base/) plus the binary cargo built on the host (see below): the manifests' default
#       (canonical) names.
#   localhost/capk/{cluster-api-controller,kubeadm-bootstrap-controller,
#       kubeadm-control-plane-controller}:$CAPI_VERSION   the static Go managers of
#       hack/build-capi.sh at /manager, like upstream's distroless images.
#   localhost/capk/test-guest:<sha256 prefix of the disk>   a node image: the test guest's bootable
#       disk at /disk/image.qcow2, FROM scratch (the machine Pod's init container brings busybox).
#
# Idempotent and cheap when nothing changed: every image carries a label with the hash of its
# inputs (for the Rust images: the stripped binary, the Dockerfile and the base image's id); a
# build runs only when no image with that label exists, an import only when containerd lacks the
# name with that label; cargo itself skips what is fresh. Buildah storage: _output/buildah (vfs),
# as images/base/.
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck source=../versions.env
source "$ROOT/hack/versions.env"

IMPORT=1
case ${1:-} in
  --no-import) IMPORT=0 ;;
  "") ;;
  *) die "usage: $0 [--no-import]" ;;
esac

WORK=$OUT/images/dev
IMAGES_ENV=$DEV/images.env
LABEL=dev.capk.inputs
# Part of the input hashes: a change of how this script builds an image rebuilds it. The Rust
# images take a version of their build command instead (bump it when the buildah flags change),
# so that editing this script does not cost two release builds.
SCRIPT_SUM=$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)
RUST_RECIPE=1

CONTROLLER_IMAGE=localhost/capk/capk-controller:dev
LAUNCHER_IMAGE=localhost/capk/capk-launcher:dev
CAPI_CORE_IMAGE=localhost/capk/cluster-api-controller:$CAPI_VERSION
CAPI_BOOTSTRAP_IMAGE=localhost/capk/kubeadm-bootstrap-controller:$CAPI_VERSION
CAPI_CONTROL_PLANE_IMAGE=localhost/capk/kubeadm-control-plane-controller:$CAPI_VERSION

t0=$SECONDS
[[ $(id -u) == 0 ]] || die "needs root (buildah, containerd)"
require buildah ctr:containerd file git sha256sum:coreutils
if ((IMPORT)); then
  ctr --address "$CONTAINERD_SOCK" version >/dev/null 2>&1 ||
    die "the local MC's containerd does not answer on ${CONTAINERD_SOCK#"$ROOT"/}: make dev-up first (or --no-import)"
fi
mkdir -p "$WORK" "$DEV"
HOST_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
[[ -s $HOST_CA_BUNDLE ]] || die "$HOST_CA_BUNDLE missing: apt-get install ca-certificates"

# --- inputs built elsewhere (each script skips what it already did) --------------------------------
bash "$ROOT/images/base/build.sh"
bash "$ROOT/hack/build-capi.sh" capi-manager kubeadm-bootstrap-manager kubeadm-control-plane-manager >&2
bash "$ROOT/hack/prepare.d/40-test-guest.sh" >&2

# --- helpers --------------------------------------------------------------------------------------
image_id() { capk_buildah inspect --type image --format '{{.FromImageID}}' "$1"; }
# The input label of a buildah image, empty when the image or the label is missing.
image_label() { capk_buildah inspect --type image --format "{{index .OCIv1.Config.Labels \"$LABEL\"}}" "$1" 2>/dev/null || true; }

# drop_replaced OLD_ID NAME: after NAME was rebuilt, remove the image it named before (vfs storage
# keeps full copies), unless another name still refers to it.
drop_replaced() {
  [[ -n $1 && $1 != "$(image_id "$2")" ]] || return 0
  capk_buildah rmi "$1" >/dev/null 2>&1 || true
}

# tree_hash PATH...: git tree id of these paths as they are in the work tree (tracked changes and
# untracked files included, .gitignore'd ones not), via a throwaway index.
tree_hash() {
  local idx
  idx=$(mktemp "$WORK/index.XXXXXX")
  rm -f "$idx"
  (cd "$ROOT" && GIT_INDEX_FILE=$idx git add -A -- "$@" && GIT_INDEX_FILE=$idx git write-tree)
  rm -f "$idx"
}

# import BUILDAH_NAME CONTAINERD_NAME KEY: into containerd's k8s.io namespace unless it has the
# name with this input label already.
import() {
  local src=$1 dst=$2 key=$3 archive
  ((IMPORT)) || return 0
  if ctr_has_image "$dst" "name==$dst,labels.\"$LABEL\"==$key"; then
    log "containerd has $dst"
    return 0
  fi
  local start=$SECONDS
  archive=$WORK/import.tar
  rm -f "$archive"
  capk_buildah push --quiet "$src" "docker-archive:$archive:$dst" >/dev/null
  ctr_k8s images import "$archive" >/dev/null
  rm -f "$archive"
  ctr_k8s images label "$dst" "$LABEL=$key" >/dev/null
  ctr_has_image "$dst" "name==$dst,labels.\"$LABEL\"==$key" || die "import did not produce $dst"
  log "imported $dst into containerd in $((SECONDS - start))s"
}

# --- capk-controller and capk-launcher: the host's cargo build in the Dockerfiles' runtime stage ----
# The binaries are built once, by cargo on the host, into its target directory:
#   CAPK_IMAGE_PROFILE=release (default)  `cargo build --release` of the two binaries;
#   CAPK_IMAGE_PROFILE=dev                the debug binaries of `cargo test --workspace --no-run`,
#       what `make test` has just built (make check's journey uses this: nothing compiles again).
# Each image is the Dockerfile's `runtime` stage (`buildah build --target runtime`: the build stage
# is skipped) plus the binary, stripped, at the path the Dockerfile's last stage copies it to. A
# binary that needs a newer glibc than the runtime stage's Debian has (a host newer than bookworm)
# is not used: the image is then the whole Dockerfile, compiled inside buildah (also
# CAPK_IMAGE_BUILD=dockerfile, to try what a Docker user builds).
IMAGE_PROFILE=${CAPK_IMAGE_PROFILE:-release}
IMAGE_BUILD=${CAPK_IMAGE_BUILD:-host}
[[ $IMAGE_PROFILE == release || $IMAGE_PROFILE == dev ]] || die "CAPK_IMAGE_PROFILE=$IMAGE_PROFILE: release or dev"
[[ $IMAGE_BUILD == host || $IMAGE_BUILD == dockerfile ]] || die "CAPK_IMAGE_BUILD=$IMAGE_BUILD: host or dockerfile"

# The glibc of the runtime stage's base (images/base/'s debootstrap), as x.y.
base_glibc=$(tar -xOf "$OUT/images/base/rootfs.tar" ./var/lib/dpkg/status |
  awk '/^Package: libc6$/ { p = 1 } p && !done && /^Version:/ { split($2, v, "-"); print v[1]; done = 1 }')
[[ $base_glibc =~ ^[0-9]+\.[0-9]+$ ]] || die "no libc6 version in $OUT/images/base/rootfs.tar"

# host_binaries: build both binaries on the host; sets CONTROLLER_BIN and LAUNCHER_BIN.
host_binaries() {
  local target start logfile=$WORK/cargo.build.log
  require cargo strip:binutils
  target=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps --locked | jq -r .target_directory)
  start=$SECONDS
  log "cargo builds capk-controller and capk-launcher ($IMAGE_PROFILE; log ${logfile#"$ROOT"/})"
  if [[ $IMAGE_PROFILE == release ]]; then
    (cd "$ROOT" && cargo build --release --locked -p capk-controller -p capk-launcher \
      --bin capk-controller --bin capk-launcher) >"$logfile" 2>&1 || { tail -n 30 "$logfile" >&2; die "cargo build failed (log ${logfile#"$ROOT"/})"; }
    CONTROLLER_BIN=$target/release/capk-controller LAUNCHER_BIN=$target/release/capk-launcher
  else
    (cd "$ROOT" && cargo test --workspace --locked --no-run) >"$logfile" 2>&1 ||
      { tail -n 30 "$logfile" >&2; die "cargo test --no-run failed (log ${logfile#"$ROOT"/})"; }
    CONTROLLER_BIN=$target/debug/capk-controller LAUNCHER_BIN=$target/debug/capk-launcher
  fi
  log "cargo done in $((SECONDS - start))s"
}

# needs_glibc BINARY: the newest GLIBC_x.y symbol version it links against.
needs_glibc() { objdump -T "$1" | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -V | tail -n 1; }

# host_image NAME DOCKERFILE BINARY: the runtime stage of DOCKERFILE plus BINARY at
# /usr/local/bin/<its name>.
host_image() {
  local name=$1 dockerfile=$2 bin=$3 exe runtime rkey key logfile start old ctr stripped
  exe=$(basename "$bin")
  [[ -x $bin ]] || die "$bin missing after the cargo build"
  runtime=${name%%:*}-runtime:dev
  rkey=$(printf '%s\n' "dockerfile $(sha256sum <"$ROOT/$dockerfile" | cut -d' ' -f1)" \
    "base $(image_id debian:bookworm-slim)" "recipe $RUST_RECIPE" | sha256sum | cut -c1-32)
  if [[ $(image_label "$runtime") != "$rkey" ]]; then
    logfile=$WORK/$(basename "${runtime%%:*}").build.log
    start=$SECONDS
    old=$(image_id "$runtime" 2>/dev/null || true)
    # chroot isolation shares the host's network: apt reaches the Debian mirror of the base's
    # sources.list; the RUN steps see the host's CA bundle (a network that inspects TLS).
    if ! capk_buildah build --pull=never --isolation chroot --network host --layers=false --force-rm \
      --volume "$HOST_CA_BUNDLE:/etc/ssl/certs/ca-certificates.crt:ro" --target runtime \
      --label "$LABEL=$rkey" -f "$ROOT/$dockerfile" -t "$runtime" "$ROOT" >"$logfile" 2>&1; then
      tail -n 30 "$logfile" >&2
      die "buildah build --target runtime of $dockerfile failed (log ${logfile#"$ROOT"/})"
    fi
    drop_replaced "$old" "$runtime"
    log "built $runtime (the runtime stage of $dockerfile) in $((SECONDS - start))s"
  fi
  stripped=$WORK/$exe
  strip --strip-debug -o "$stripped" "$bin"
  key=$(printf '%s\n' "runtime $rkey" "binary $(sha256sum <"$stripped" | cut -d' ' -f1)" | sha256sum | cut -c1-32)
  if [[ $(image_label "$name") == "$key" ]]; then
    log "buildah has $name (inputs $key)"
  else
    old=$(image_id "$name" 2>/dev/null || true)
    ctr=$(capk_buildah from --pull=never "$runtime")
    capk_buildah copy --chown 0:0 --chmod 0755 "$ctr" "$stripped" "/usr/local/bin/$exe" >/dev/null
    capk_buildah config --label "$LABEL=$key" \
      --label "org.opencontainers.image.description=$exe ($IMAGE_PROFILE build of this tree) on the runtime stage of $dockerfile" "$ctr"
    capk_buildah commit --quiet --rm "$ctr" "$name" >/dev/null
    drop_replaced "$old" "$name"
    log "built $name ($IMAGE_PROFILE binary, $(du -h "$stripped" | cut -f1))"
  fi
  rm -f "$stripped"
  import "$name" "$name" "$key"
}

# dockerfile_image NAME DOCKERFILE CRATE_DIR...: the whole Dockerfile, compiled inside buildah. Its
# input key: the crates the binary is built from, of which only src/ counts (tests, benches, fuzz
# targets and docs are not in a release binary; none of the crates has a build script or
# includes a file from elsewhere); every workspace member's Cargo.toml is an input too (cargo
# reads them all).
dockerfile_image() {
  local name=$1 dockerfile=$2 key logfile start old crate
  shift 2
  bash "$ROOT/images/base/rust.sh"
  local manifests=()
  # The members of the workspace, as Cargo.toml lists them (images/flatcar is two levels deep).
  mapfile -t manifests < <(sed -n 's/^members = \[\(.*\)\]$/\1/p' "$ROOT/Cargo.toml" | tr -d '" ' | tr ',' '\n' | sed 's#$#/Cargo.toml#')
  ((${#manifests[@]} > 1)) || die "no workspace members read from Cargo.toml's members = [...]"
  local sources=()
  for crate in "$@"; do sources+=("$crate/src"); done
  key=$(printf '%s\n' "tree $(tree_hash Cargo.toml Cargo.lock "${manifests[@]}" .dockerignore "$dockerfile" "${sources[@]}")" \
    "rust $(image_id rust:1-bookworm)" "base $(image_id debian:bookworm-slim)" "recipe $RUST_RECIPE" | sha256sum | cut -c1-32)
  if [[ $(image_label "$name") == "$key" ]]; then
    log "buildah has $name (inputs $key)"
  else
    logfile=$WORK/$(basename "${name%%:*}").build.log
    log "building $name from $dockerfile inside buildah (log ${logfile#"$ROOT"/})"
    start=$SECONDS
    old=$(image_id "$name" 2>/dev/null || true)
    # As host_image's runtime stage; --pull=never: FROM names resolve to images/base/'s.
    if ! capk_buildah build --pull=never --isolation chroot --network host --layers=false --force-rm \
      --volume "$HOST_CA_BUNDLE:/etc/ssl/certs/ca-certificates.crt:ro" \
      --label "$LABEL=$key" -f "$ROOT/$dockerfile" -t "$name" "$ROOT" >"$logfile" 2>&1; then
      tail -n 30 "$logfile" >&2
      die "buildah build of $dockerfile failed (log ${logfile#"$ROOT"/})"
    fi
    drop_replaced "$old" "$name"
    log "built $name in $((SECONDS - start))s"
  fi
  import "$name" "$name" "$key"
}

if [[ $IMAGE_BUILD == host ]]; then
  host_binaries
  for bin in "$CONTROLLER_BIN" "$LAUNCHER_BIN"; do
    need=$(needs_glibc "$bin")
    if [[ $(printf '%s\n' "$need" "$base_glibc" | sort -V | tail -n 1) != "$base_glibc" ]]; then
      log "$(basename "$bin") needs glibc $need, debian:bookworm-slim has $base_glibc: the images compile inside buildah instead"
      IMAGE_BUILD=dockerfile
    fi
  done
fi
if [[ $IMAGE_BUILD == host ]]; then
  host_image "$CONTROLLER_IMAGE" Dockerfile.controller "$CONTROLLER_BIN"
  host_image "$LAUNCHER_IMAGE" Dockerfile.launcher "$LAUNCHER_BIN"
else
  dockerfile_image "$CONTROLLER_IMAGE" Dockerfile.controller api bootstrap controller readyz
  dockerfile_image "$LAUNCHER_IMAGE" Dockerfile.launcher api bootstrap images/flatcar launcher readyz
fi

# --- Cluster API managers: static binaries at /manager -----------------------------------------------
# What upstream's distroless static:nonroot base image gives them: /etc/passwd and /etc/group with
# nonroot (65532), a world-writable /tmp, the CA bundle (Debian's, from the base image's rootfs).
capi_image() {
  local name=$1 bin=$BIN/$2 key stage old
  [[ -x $bin ]] || die "$bin missing: bash hack/build-capi.sh $2"
  file -L "$bin" | grep -q 'statically linked' || die "$bin is not statically linked (CGO_ENABLED=0 in hack/build-capi.sh)"
  key=$(printf '%s\n' "bin $(sha256sum <"$bin" | cut -d' ' -f1)" "recipe $SCRIPT_SUM" | sha256sum | cut -c1-32)
  if [[ $(image_label "$name") == "$key" ]]; then
    log "buildah has $name"
  else
    old=$(image_id "$name" 2>/dev/null || true)
    stage=$WORK/capi-rootfs
    rm -rf "$stage"
    mkdir -p "$stage/etc/ssl/certs" "$stage/tmp"
    chmod 1777 "$stage/tmp"
    printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$stage/etc/passwd"
    printf 'root:x:0:\nnonroot:x:65532:\n' >"$stage/etc/group"
    tar -xOf "$OUT/images/base/rootfs.tar" ./etc/ssl/certs/ca-certificates.crt >"$stage/etc/ssl/certs/ca-certificates.crt"
    install -m 0755 "$bin" "$stage/manager"
    tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$stage" -cf "$WORK/capi-layer.tar" .
    buildah_image "$name" scratch "$WORK/capi-layer.tar" --entrypoint '["/manager"]' --workingdir / --user 65532:65532 \
      --label "$LABEL=$key" --label "org.opencontainers.image.version=$CAPI_VERSION" \
      --label "org.opencontainers.image.description=Cluster API $2 $CAPI_VERSION, built by hack/build-capi.sh from the Go module proxy"
    rm -rf "$stage" "$WORK/capi-layer.tar"
    drop_replaced "$old" "$name"
    log "built $name"
  fi
  import "$name" "$name" "$key"
}
capi_image "$CAPI_CORE_IMAGE" capi-manager
capi_image "$CAPI_BOOTSTRAP_IMAGE" kubeadm-bootstrap-manager
capi_image "$CAPI_CONTROL_PLANE_IMAGE" kubeadm-control-plane-manager

# --- the node image: the test guest's bootable disk --------------------------------------------------
disk=$OUT/test-guest/boot.qcow2
[[ -f $disk ]] || die "$disk missing: bash hack/prepare.d/40-test-guest.sh"
disk_sum=$(sha256sum "$disk" | cut -d' ' -f1)
TEST_GUEST_IMAGE=localhost/capk/test-guest:${disk_sum:0:12}
key=$(printf '%s\n' "disk $disk_sum" "recipe $SCRIPT_SUM" | sha256sum | cut -c1-32)
if [[ $(image_label "$TEST_GUEST_IMAGE") == "$key" ]]; then
  log "buildah has $TEST_GUEST_IMAGE"
else
  old=$(image_id "$TEST_GUEST_IMAGE" 2>/dev/null || true)
  ctr=$(capk_buildah from --pull=never scratch)
  capk_buildah copy --chown 0:0 --chmod 0644 "$ctr" "$disk" /disk/image.qcow2 >/dev/null
  capk_buildah config --label "$LABEL=$key" \
    --label "org.opencontainers.image.description=CAPK test guest bootable disk (images/test-guest) at /disk/image.qcow2, sha256 $disk_sum" "$ctr"
  capk_buildah commit --quiet --rm "$ctr" "$TEST_GUEST_IMAGE" >/dev/null
  drop_replaced "$old" "$TEST_GUEST_IMAGE"
  log "built $TEST_GUEST_IMAGE"
fi
# Older test-guest tags in buildah storage go (containerd keeps its copies: Pods may use them).
for old in $(capk_buildah images --format '{{.Name}}:{{.Tag}}'); do
  [[ $old == localhost/capk/test-guest:* && $old != "$TEST_GUEST_IMAGE" ]] || continue
  capk_buildah rmi "$old" >/dev/null && log "removed $old from buildah storage"
done
import "$TEST_GUEST_IMAGE" "$TEST_GUEST_IMAGE" "$key"

# --- names for manifests and clusterctl -------------------------------------------------------------
tmp=$(mktemp "$IMAGES_ENV.XXXXXX")
cat >"$tmp" <<EOF
# Written by hack/dev/images.sh: images in the local MC's containerd (never pulled; use
# imagePullPolicy IfNotPresent). The variable names are the ones the manifests substitute.
CAPK_CONTROLLER_IMAGE=$CONTROLLER_IMAGE
CAPK_LAUNCHER_IMAGE=$LAUNCHER_IMAGE
CAPI_CORE_IMAGE=$CAPI_CORE_IMAGE
CAPI_KUBEADM_BOOTSTRAP_IMAGE=$CAPI_BOOTSTRAP_IMAGE
CAPI_KUBEADM_CONTROL_PLANE_IMAGE=$CAPI_CONTROL_PLANE_IMAGE
CAPK_TEST_GUEST_IMAGE=$TEST_GUEST_IMAGE
CAPK_TEST_GUEST_IMAGE_PATH=/disk/image.qcow2
EOF
if [[ -f $IMAGES_ENV ]] && cmp -s "$tmp" "$IMAGES_ENV"; then rm -f "$tmp"; else mv "$tmp" "$IMAGES_ENV"; fi
log "images ready in $((SECONDS - t0))s; names in ${IMAGES_ENV#"$ROOT"/}"
