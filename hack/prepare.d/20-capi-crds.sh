#!/usr/bin/env bash
# The Cluster API CRDs of the pinned release, taken from its Go module download (not hand-copied):
# core (Cluster, Machine, MachineDeployment, ...), kubeadm bootstrap and kubeadm control plane.
set -euo pipefail
LOG_NAME=capi-crds
# shellcheck source=../lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/common.sh"
# shellcheck source=../versions.env
source "$ROOT/hack/versions.env"
DEST=$OUT/capi/$CAPI_VERSION/crd
if [[ -f $DEST/.complete ]]; then
  log "$CAPI_VERSION already present"
  exit 0
fi
require go:golang
dir=$(cd /tmp && GOFLAGS=-mod=mod go mod download -json "sigs.k8s.io/cluster-api@$CAPI_VERSION" | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
[[ -d $dir ]] || die "download of sigs.k8s.io/cluster-api@$CAPI_VERSION failed"
rm -rf "$DEST"; mkdir -p "$DEST"
for sub in core/config/crd/bases bootstrap/kubeadm/config/crd/bases controlplane/kubeadm/config/crd/bases; do
  cp "$dir/$sub"/*.yaml "$DEST/"
done
chmod u+w "$DEST"/*.yaml
touch "$DEST/.complete"
crds=("$DEST"/*.yaml)
log "${#crds[@]} CRDs of Cluster API $CAPI_VERSION in $DEST"
