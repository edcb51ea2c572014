#!/usr/bin/env bash
# Builds _output/bin/cabpk-render (hack/cabpk-render/main.go) against the pinned Cluster API
# release (hack/versions.env CAPI_VERSION) from the Go module proxy. The controller's manifest
# tests run every flavor's KubeadmConfigSpec through it to get the bootstrap data CABPK would
# write. Same wrapper-module technique as hack/build-capi.sh (whose module cache and build cache
# it shares, so after `make test-deps` built clusterctl this is mostly a link). Idempotent: a
# binary whose stamp matches the pinned version and the source's hash is kept.
set -euo pipefail

# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
# shellcheck source=versions.env
source "$ROOT/hack/versions.env"
SRC=$ROOT/hack/cabpk-render/main.go
WRAP=$OUT/src/cabpk-render-$CAPI_VERSION
STAMP=$BIN/.cabpk-render.version

want="$CAPI_VERSION $(sha256sum "$SRC" | cut -c1-16)"
if [[ -x $BIN/cabpk-render && -f $STAMP && $(cat "$STAMP") == "$want" ]]; then
  log "cabpk-render ($want) already built"
  exit 0
fi

require go:golang
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod
mkdir -p "$BIN" "$WRAP"
if [[ ! -f $WRAP/go.sum ]]; then
  log "preparing the module for Cluster API $CAPI_VERSION"
  # The upstream module replaces its ./api with the local directory; the wrapper takes the
  # published one.
  go_wrapper_module "$WRAP" capk.local/cabpk-render "$CAPI_VERSION" \
    "sigs.k8s.io/cluster-api@$CAPI_VERSION" "sigs.k8s.io/cluster-api/api@$CAPI_VERSION"
  cp "$SRC" "$WRAP/main.go"
  (cd "$WRAP" && go mod tidy >/dev/null)
fi
cp "$SRC" "$WRAP/main.go"
start=$SECONDS
log "building cabpk-render against Cluster API $CAPI_VERSION"
(cd "$WRAP" && go build -trimpath -ldflags "-s -w" -o "$BIN/cabpk-render.tmp" .)
mv "$BIN/cabpk-render.tmp" "$BIN/cabpk-render"
echo "$want" >"$STAMP"
log "cabpk-render built in $((SECONDS - start))s"
