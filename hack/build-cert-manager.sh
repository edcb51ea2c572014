#!/usr/bin/env bash
# Builds pinned cert-manager binaries (and the Helm that renders its chart) from the Go module
# proxy into _output/bin.
#
#   hack/build-cert-manager.sh      -> _output/bin/cert-manager-{controller,cainjector,webhook,acmesolver}
#                                      _output/bin/helm
#
# Why $CERT_MANAGER_VERSION (hack/versions.env) is v1.11.x: from v1.12 on, cert-manager's
# cmd/controller, cmd/cainjector, cmd/webhook and cmd/acmesolver are Go modules of their own,
# which the Go module proxy reachable here does not serve. The main module up to v1.11.x still
# holds them, together with deploy/crds and the Helm chart (deploy/charts/cert-manager) that the
# release's cert-manager.yaml is rendered from.
#
# The main module's go.mod has a replace directive (github.com/miekg/dns), so `go install
# pkg@version` refuses it: the module is copied to _output/src and built there, as upstream's
# Makefile does (CGO off, -trimpath, `-w -s` and pkg/util.AppVersion/AppGitCommit ldflags).
# Helm is built with `go install` at $HELM_VERSION, the version upstream's make/tools.mk pins for
# this release. A binary whose stamp (_output/bin/.NAME.version) matches is not rebuilt.
set -euo pipefail

# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
# shellcheck source=versions.env
source "$ROOT/hack/versions.env"
SRC=$OUT/src/cert-manager-$CERT_MANAGER_VERSION
mkdir -p "$BIN"

export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod

stamp_ok() { # binary version
  [[ -x $BIN/$1 && -f $BIN/.$1.version && $(cat "$BIN/.$1.version") == "$2" ]]
}

CMDS=(controller cainjector webhook acmesolver)
todo=()
for c in "${CMDS[@]}"; do
  stamp_ok "cert-manager-$c" "$CERT_MANAGER_VERSION" || todo+=("$c")
done
need_helm=true
stamp_ok helm "$HELM_VERSION" && need_helm=false
if [[ ${#todo[@]} -eq 0 && $need_helm == false ]]; then
  log "cert-manager $CERT_MANAGER_VERSION and helm $HELM_VERSION already built"
  exit 0
fi

require go:golang

if [[ ${#todo[@]} -gt 0 ]]; then
  if [[ ! -f $SRC/.complete ]]; then
    log "copying github.com/cert-manager/cert-manager@$CERT_MANAGER_VERSION to ${SRC#"$ROOT"/}"
    moddir=$(cd "$OUT" && go mod download -json "github.com/cert-manager/cert-manager@$CERT_MANAGER_VERSION" |
      sed -n 's/.*"Dir": "\(.*\)",/\1/p')
    [[ -f $moddir/go.mod && -d $moddir/cmd/controller ]] ||
      die "github.com/cert-manager/cert-manager@$CERT_MANAGER_VERSION has no cmd/controller (only <= v1.11.x do)"
    rm -rf "$SRC"
    mkdir -p "$(dirname "$SRC")"
    cp -r "$moddir" "$SRC"
    chmod -R u+w "$SRC"
    touch "$SRC/.complete"
  fi
  ldflags="-w -s -X github.com/cert-manager/cert-manager/pkg/util.AppVersion=$CERT_MANAGER_VERSION"
  ldflags+=" -X github.com/cert-manager/cert-manager/pkg/util.AppGitCommit=module-proxy-$CERT_MANAGER_VERSION"
  start=$SECONDS
  pkgs=()
  for c in "${todo[@]}"; do pkgs+=("./cmd/$c"); done
  log "building ${todo[*]} ($CERT_MANAGER_VERSION, $(go env GOVERSION))"
  rm -rf "$SRC/_build"
  mkdir -p "$SRC/_build"
  # One `go build` for all packages: the shared dependency graph compiles once.
  (cd "$SRC" && go build -trimpath -ldflags "$ldflags" -o _build/ "${pkgs[@]}")
  for c in "${todo[@]}"; do
    mv "$SRC/_build/$c" "$BIN/cert-manager-$c"
    echo "$CERT_MANAGER_VERSION" >"$BIN/.cert-manager-$c.version"
  done
  log "cert-manager ${todo[*]} built in $((SECONDS - start))s"
fi

if [[ $need_helm == true ]]; then
  start=$SECONDS
  log "building helm $HELM_VERSION"
  gobin=$OUT/src/helm-$HELM_VERSION
  rm -rf "$gobin"
  mkdir -p "$gobin"
  # Helm's Makefile sets these: `helm version` reports the pinned version, and the default
  # Kubernetes version of `helm template` follows its client-go (v0.26 -> 1.26; unset it would be
  # 1.20, below the chart's kubeVersion ">= 1.21.0-0").
  kv=$(sed -n 's/^[[:space:]]*k8s.io\/client-go v0\.\([0-9]*\)\..*/\1/p' \
    "$(go mod download -json "helm.sh/helm/v3@$HELM_VERSION" | sed -n 's/.*"GoMod": "\(.*\)",/\1/p')")
  [[ -n $kv ]] || die "cannot read helm $HELM_VERSION's client-go version"
  hldflags="-w -s -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.metadata="
  hldflags+=" -X helm.sh/helm/v3/internal/version.gitCommit=module-proxy-$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
  for p in pkg/lint/rules pkg/chartutil; do
    hldflags+=" -X helm.sh/helm/v3/$p.k8sVersionMajor=1 -X helm.sh/helm/v3/$p.k8sVersionMinor=$kv"
  done
  GOBIN=$gobin GOFLAGS='' go install -trimpath -ldflags "$hldflags" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  mv "$gobin/helm" "$BIN/helm"
  echo "$HELM_VERSION" >"$BIN/.helm.version"
  log "helm built in $((SECONDS - start))s"
fi
