#!/usr/bin/env bash
# Builds pinned upstream binaries from the Go module proxy into _output/bin.
#
#   hack/build-upstream.sh [kube-apiserver] [kubectl] [etcd] ...   (default: the test set)
#
# Technique (`go install pkg@version` refuses k8s.io/kubernetes: its go.mod has replace directives):
# a throwaway wrapper module (hack/lib/common.sh go_wrapper_module) requires k8s.io/kubernetes and
# replaces every staging module (read from that version's own go.mod, about 31) with its published
# v0.Y.Z. Version ldflags (gitVersion, gitMajor, ... on k8s.io/component-base/version and
# k8s.io/client-go/pkg/version) make the binaries report their real version: without them they say
# v0.0.0-master, which clusterctl and kubeadm reject. A binary whose stamp matches the pinned
# version is not rebuilt; GOMODCACHE/GOCACHE make a rebuild after `git clean` a link step.
set -euo pipefail

# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
# shellcheck source=versions.env
source "$ROOT/hack/versions.env"
WRAP=$OUT/src/k8s-wrapper-$KUBERNETES_VERSION
mkdir -p "$BIN"

export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod

targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(kube-apiserver kubectl etcd)

# Package path of each binary inside the wrapper module.
declare -A PKG=(
  [kube-apiserver]=k8s.io/kubernetes/cmd/kube-apiserver
  [kube-controller-manager]=k8s.io/kubernetes/cmd/kube-controller-manager
  [kube-scheduler]=k8s.io/kubernetes/cmd/kube-scheduler
  [kube-proxy]=k8s.io/kubernetes/cmd/kube-proxy
  [kubelet]=k8s.io/kubernetes/cmd/kubelet
  [kubeadm]=k8s.io/kubernetes/cmd/kubeadm
  [kubectl]=k8s.io/kubernetes/cmd/kubectl
  [etcd]=go.etcd.io/etcd/server/v3
)

stamp_ok() { # binary version
  [[ -x $BIN/$1 && -f $BIN/.$1.version && $(cat "$BIN/.$1.version") == "$2" ]]
}

todo=()
for t in "${targets[@]}"; do
  [[ -n ${PKG[$t]:-} ]] || { log "unknown binary '$t' (known: ${!PKG[*]})"; exit 2; }
  want=$KUBERNETES_VERSION; [[ $t == etcd ]] && want=$ETCD_VERSION
  if stamp_ok "$t" "$want"; then log "$t $want already built"; else todo+=("$t"); fi
done
[[ ${#todo[@]} -gt 0 ]] || exit 0

require go:golang

if [[ ! -f $WRAP/go.sum ]]; then
  log "preparing wrapper module for Kubernetes $KUBERNETES_VERSION"
  rm -rf "$WRAP"; mkdir -p "$WRAP"
  # The staging modules (k8s.io/api => ./staging/src/k8s.io/api, …) are published as v0.X.Y.
  go_wrapper_module "$WRAP" capk.local/k8s-wrapper "v0.${KUBERNETES_VERSION#v1.}" \
    "k8s.io/kubernetes@$KUBERNETES_VERSION" "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
  printf 'package main\n\nimport (\n\t_ "k8s.io/kubernetes/cmd/kube-apiserver/app"\n\t_ "go.etcd.io/etcd/server/v3/embed"\n)\n\nfunc main() {}\n' >"$WRAP/tools.go"
  (cd "$WRAP" && go mod tidy >/dev/null)
fi

major=${KUBERNETES_VERSION#v}; major=${major%%.*}
minor=${KUBERNETES_VERSION#v*.}; minor=${minor%%.*}
date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
kube_ldflags=""
for key in gitVersion:$KUBERNETES_VERSION gitMajor:$major gitMinor:$minor gitCommit:module-proxy-$KUBERNETES_VERSION gitTreeState:clean buildDate:$date; do
  for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
    kube_ldflags+=" -X '$pkg.${key%%:*}=${key#*:}'"
  done
done

for t in "${todo[@]}"; do
  start=$SECONDS
  log "building $t (${PKG[$t]})"
  if [[ $t == etcd ]]; then
    (cd "$WRAP" && go build -trimpath -o "$BIN/$t" "${PKG[$t]}")
    echo "$ETCD_VERSION" >"$BIN/.$t.version"
  else
    (cd "$WRAP" && go build -trimpath -ldflags "-s -w $kube_ldflags" -o "$BIN/$t" "${PKG[$t]}")
    echo "$KUBERNETES_VERSION" >"$BIN/.$t.version"
  fi
  log "$t built in $((SECONDS - start))s"
done
