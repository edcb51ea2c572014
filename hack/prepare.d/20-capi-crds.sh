#!/usr/bin/env bash
# The Cluster API CRDs of the pinned release, taken from its Go module download (not hand-copied):
# core (Cluster, Machine, MachineDeployment, ...), kubeadm bootstrap and kubeadm control plane.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# shellcheck source=../versions.env
source "$ROOT/hack/versions.env"
DEST=${CAPK_OUTPUT:-$ROOT/_output}/capi/$CAPI_VERSION/crd
if [[ -f $DEST/.complete ]]; then
  echo "capi-crds: $CAPI_VERSION already present"
  exit 0
fi
command -v go >/dev/null || { echo "capi-crds: 'go' not found; install Go" >&2; exit 1; }
dir=$(cd /tmp && GOFLAGS=-mod=mod go mod download -json "sigs.k8s.io/cluster-api@$CAPI_VERSION" | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
[[ -d $dir ]] || { echo "capi-crds: download of sigs.k8s.io/cluster-api@$CAPI_VERSION failed" >&2; exit 1; }
rm -rf "$DEST"; mkdir -p "$DEST"
for sub in core/config/crd/bases bootstrap/kubeadm/config/crd/bases controlplane/kubeadm/config/crd/bases; do
  cp "$dir/$sub"/*.yaml "$DEST/"
done
chmod u+w "$DEST"/*.yaml
touch "$DEST/.complete"
echo "capi-crds: $(ls "$DEST"/*.yaml | wc -l) CRDs of Cluster API $CAPI_VERSION in $DEST"
