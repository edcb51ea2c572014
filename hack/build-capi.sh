#!/usr/bin/env bash
# Builds pinned Cluster API binaries from the Go module proxy into _output/bin.
#
#   hack/build-capi.sh [clusterctl] [capi-manager] [kubeadm-bootstrap-manager] [kubeadm-control-plane-manager]
#   (default: all four)
#
# Technique, as hack/build-upstream.sh does for Kubernetes (`go install pkg@version` refuses a
# module with replace directives; hack/lib/common.sh go_wrapper_module): a throwaway wrapper
# module requires sigs.k8s.io/cluster-api at $CAPI_VERSION (hack/versions.env). That module's own
# go.mod replaces sigs.k8s.io/cluster-api/api with ./api, which a dependent module does not
# inherit, so the wrapper replaces it with the published sigs.k8s.io/cluster-api/api of the same
# version. Version ldflags (the ones CAPI's hack/scripts/release/version.sh sets) make
# `clusterctl version` and the managers report $CAPI_VERSION. A binary whose stamp
# (_output/bin/.NAME.version) matches the pinned version is not rebuilt; GOMODCACHE/GOCACHE make a
# rebuild after `git clean` a link step.
set -euo pipefail

# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
# shellcheck source=versions.env
source "$ROOT/hack/versions.env"
WRAP=$OUT/src/capi-wrapper-$CAPI_VERSION
mkdir -p "$BIN"

export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod

# Package path of each binary (the Makefile targets of CAPI itself: manager-core,
# manager-kubeadm-bootstrap, manager-kubeadm-control-plane, clusterctl).
declare -A PKG=(
  [clusterctl]=sigs.k8s.io/cluster-api/cmd/clusterctl
  [capi-manager]=sigs.k8s.io/cluster-api/core
  [kubeadm-bootstrap-manager]=sigs.k8s.io/cluster-api/bootstrap/kubeadm
  [kubeadm-control-plane-manager]=sigs.k8s.io/cluster-api/controlplane/kubeadm
)
ALL=(clusterctl capi-manager kubeadm-bootstrap-manager kubeadm-control-plane-manager)

stamp_ok() { # binary version
  [[ -x $BIN/$1 && -f $BIN/.$1.version && $(cat "$BIN/.$1.version") == "$2" ]]
}

targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=("${ALL[@]}")

todo=()
for t in "${targets[@]}"; do
  [[ -n ${PKG[$t]:-} ]] || { log "unknown binary '$t' (known: ${ALL[*]})"; exit 2; }
  if stamp_ok "$t" "$CAPI_VERSION"; then log "$t $CAPI_VERSION already built"; else todo+=("$t"); fi
done
[[ ${#todo[@]} -gt 0 ]] || exit 0

require go:golang

prepare_wrapper() {
  log "preparing wrapper module for Cluster API $CAPI_VERSION"
  rm -rf "$WRAP"; mkdir -p "$WRAP"
  go_wrapper_module "$WRAP" capk.local/capi-wrapper "$CAPI_VERSION" \
    "sigs.k8s.io/cluster-api@$CAPI_VERSION" "sigs.k8s.io/cluster-api/api@$CAPI_VERSION"
  # Main packages cannot be imported; their setup packages pull in the same dependency graph.
  printf 'package main\n\nimport (\n\t_ "sigs.k8s.io/cluster-api/cmd/clusterctl/cmd"\n\t_ "sigs.k8s.io/cluster-api/core/setup"\n\t_ "sigs.k8s.io/cluster-api/bootstrap/kubeadm/setup"\n\t_ "sigs.k8s.io/cluster-api/controlplane/kubeadm/setup"\n)\n\nfunc main() {}\n' >"$WRAP/tools.go"
  (cd "$WRAP" && go mod tidy >/dev/null)
}
[[ -f $WRAP/go.sum ]] || prepare_wrapper

major=${CAPI_VERSION#v}; major=${major%%.*}
minor=${CAPI_VERSION#v*.}; minor=${minor%%.*}
date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
ldflags="-s -w"
for key in gitVersion:$CAPI_VERSION gitMajor:$major gitMinor:$minor gitCommit:module-proxy-$CAPI_VERSION \
  gitTreeState:clean gitReleaseCommit:module-proxy-$CAPI_VERSION buildDate:$date; do
  ldflags+=" -X 'sigs.k8s.io/cluster-api/version.${key%%:*}=${key#*:}'"
done

for t in "${todo[@]}"; do
  start=$SECONDS
  log "building $t (${PKG[$t]})"
  (cd "$WRAP" && go build -trimpath -ldflags "$ldflags" -o "$BIN/$t.tmp" "${PKG[$t]}")
  mv "$BIN/$t.tmp" "$BIN/$t"
  echo "$CAPI_VERSION" >"$BIN/.$t.version"
  log "$t built in $((SECONDS - start))s"
done
