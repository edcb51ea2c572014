#!/usr/bin/env bash
# The Kubernetes node image (images/node, `make node-image`) in the local management cluster's
# containerd (namespace k8s.io), so a KVMMachineTemplate can name it as a container-image node
# image with imagePullPolicy IfNotPresent; no registry is involved. Writes its name to
# _output/dev/node-image.env (CAPK_NODE_IMAGE, CAPK_NODE_IMAGE_PATH).
#
#   bash hack/dev/node-image.sh   (builds the image first when it is missing or stale; needs a
#                                  running local MC: make dev-up)
#
# Idempotent: the tag carries the hash of the image's inputs, and the import runs only when
# containerd lacks that name. Other tags of localhost/capk/node are removed from containerd.
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

NODE_ENV=$OUT/node-image/node-image.env
DEV_ENV=$DEV/node-image.env

[[ $(id -u) == 0 ]] || die "needs root (buildah, containerd)"
ctr --address "$CONTAINERD_SOCK" version >/dev/null 2>&1 ||
  die "the local MC's containerd does not answer on ${CONTAINERD_SOCK#"$ROOT"/}: make dev-up first"
# Cheap when nothing changed (the build's input-hash stamp).
bash "$ROOT/images/node/build.sh"
[[ -f $NODE_ENV ]] || die "$NODE_ENV missing after images/node/build.sh"
# shellcheck disable=SC1090
source "$NODE_ENV"

if ctr_has_image "$CAPK_NODE_IMAGE"; then
  log "containerd has $CAPK_NODE_IMAGE"
else
  start=$SECONDS
  archive=$OUT/node-image/import.tar
  rm -f "$archive"
  capk_buildah push --quiet "$CAPK_NODE_IMAGE" "docker-archive:$archive:$CAPK_NODE_IMAGE" >/dev/null
  ctr_k8s images import "$archive" >/dev/null
  rm -f "$archive"
  ctr_has_image "$CAPK_NODE_IMAGE" || die "import did not produce $CAPK_NODE_IMAGE"
  log "imported $CAPK_NODE_IMAGE into containerd in $((SECONDS - start))s"
fi

# Superseded node images go: each is 2 GB of the MC node's image filesystem, and three of them put
# the local MC's kubelet into DiskPressure, whose 5-minute transition period left the next
# cluster's machine Pods unschedulable (FailedScheduling for 293 s). A running container keeps its
# snapshot when its image's name is removed.
stale=$(ctr_k8s images ls -q 'name~=^localhost/capk/node:') || die "containerd does not list its images"
for old in $stale; do
  [[ $old == "$CAPK_NODE_IMAGE" ]] && continue
  ctr_k8s images rm "$old" >/dev/null
  log "removed the superseded node image $old from containerd"
done

mkdir -p "$DEV"
tmp=$(mktemp "$DEV_ENV.XXXXXX")
chmod 0644 "$tmp"
cat >"$tmp" <<EOF
# Written by hack/dev/node-image.sh: the Kubernetes node image in the local MC's containerd (never
# pulled; use imagePullPolicy IfNotPresent).
CAPK_NODE_IMAGE=$CAPK_NODE_IMAGE
CAPK_NODE_IMAGE_PATH=$CAPK_NODE_IMAGE_PATH
EOF
if [[ -f $DEV_ENV ]] && cmp -s "$tmp" "$DEV_ENV"; then rm -f "$tmp"; else mv "$tmp" "$DEV_ENV"; fi
log "node image ready: $CAPK_NODE_IMAGE (name in ${DEV_ENV#"$ROOT"/})"
