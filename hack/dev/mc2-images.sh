#!/usr/bin/env bash
# The images of the second local management cluster (CAPK_DEV_MC=2), copied from the
# first one's containerd: the Cluster API and CAPK managers and cert-manager that
# hack/dev/images.sh and hack/dev/cert-manager.sh built and imported there, under the same names,
# plus the files that name them (images.env, cert-manager.env) for hack/dev/capi.sh. The launcher
# and node images are not copied: machine Pods run in the first cluster, the hosting cluster.
#
#   CAPK_DEV_MC=2 bash hack/dev/mc2-images.sh   (called by `CAPK_DEV_MC=2 hack/dev-up.sh`)
#
# Idempotent: an image whose digest the second containerd already has under that name is skipped.
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
((MC == 2)) || die "only for the second management cluster (CAPK_DEV_MC=2)"
t0=$SECONDS

SOCK1=$DEV1/run/containerd.sock
for f in images.env cert-manager.env; do
  [[ -f $DEV1/$f ]] || die "${DEV1#"$ROOT"/}/$f missing: the first cluster's providers are not built (make dev-up)"
  cmp -s "$DEV1/$f" "$DEV/$f" 2>/dev/null || cp "$DEV1/$f" "$DEV/$f"
done
# shellcheck source=/dev/null
source "$DEV/images.env"
# shellcheck source=/dev/null
source "$DEV/cert-manager.env"

# digest SOCKET NAME: the image's digest in that containerd (k8s.io), empty when it has none.
digest() { ctr --address "$1" -n k8s.io images ls "name==$2" | awk 'NR > 1 {print $3}'; }

mkdir -p "$DEV/images"
# shellcheck disable=SC2086 # CERT_MANAGER_IMAGES is a space-separated list
for img in "$CAPK_CONTROLLER_IMAGE" "$CAPI_CORE_IMAGE" "$CAPI_KUBEADM_BOOTSTRAP_IMAGE" \
  "$CAPI_KUBEADM_CONTROL_PLANE_IMAGE" $CERT_MANAGER_IMAGES; do
  want=$(digest "$SOCK1" "$img")
  [[ -n $want ]] || die "$img is not in the first cluster's containerd (make dev-up builds it)"
  [[ $(digest "$CONTAINERD_SOCK" "$img") == "$want" ]] && continue
  start=$SECONDS
  archive=$DEV/images/copy.tar
  ctr --address "$SOCK1" -n k8s.io images export "$archive" "$img"
  ctr_k8s images import "$archive" >/dev/null
  rm -f "$archive"
  [[ $(digest "$CONTAINERD_SOCK" "$img") == "$want" ]] || die "import did not produce $img at $want"
  log "copied $img from the first cluster's containerd in $((SECONDS - start))s"
done
log "images of the second cluster ready in $((SECONDS - t0))s"
