#!/usr/bin/env bash
# Builds the cluster add-ons from the Go module proxy into _output/bin (static, CGO off, except
# flanneld: see below):
#
#   coredns               github.com/coredns/coredns@$COREDNS_VERSION
#   flanneld              github.com/flannel-io/flannel@$FLANNEL_VERSION, without its Tencent Cloud VPC
#                         backend (main.go imports every backend; that one's SDK module is not served
#                         by the proxy here). VXLAN, host-gw, wireguard, ipip, ipsec, udp, extension
#                         and alloc are all in. CGO on, as upstream builds it (its udp backend is C).
#   flannel-cni-plugin    github.com/containernetworking/plugins/plugins/meta/flannel@$FLANNEL_CNI_PLUGIN_VERSION
#   metrics-server        sigs.k8s.io/metrics-server/cmd/metrics-server@$METRICS_SERVER_VERSION
#   vpa-recommender, vpa-updater, vpa-admission-controller
#                         k8s.io/autoscaler/vertical-pod-autoscaler/pkg/{recommender,updater,
#                         admission-controller}@$VPA_VERSION
#
#   hack/build-addons.sh [NAME...]   (default: coredns, flanneld and flannel-cni-plugin; the local
#                                     MC's CAPK_DEV_VPA=1 asks for metrics-server and vpa-*)
#
# CoreDNS, the CNI plugin and metrics-server have no replace directives, so `go install
# pkg@version` builds them with the module's own go.sum; the VPA's commands are built in a wrapper
# module (its go.mod has exclude directives, which `go install` refuses); flanneld is built in a writable copy of its module (its go.sum
# pins every dependency) with the one import line removed. A binary whose stamp (version + flags) matches is not rebuilt; Go's module
# and build caches make a rebuild after `git clean` a link step.
set -euo pipefail
# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
# shellcheck source=versions.env
source "$ROOT/hack/versions.env"
mkdir -p "$BIN"
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod

declare -A PKG=(
  [coredns]=github.com/coredns/coredns@$COREDNS_VERSION
  [flanneld]=github.com/flannel-io/flannel@$FLANNEL_VERSION
  [flannel-cni-plugin]=github.com/containernetworking/plugins/plugins/meta/flannel@$FLANNEL_CNI_PLUGIN_VERSION
  [metrics-server]=sigs.k8s.io/metrics-server/cmd/metrics-server@$METRICS_SERVER_VERSION
  [vpa-recommender]=k8s.io/autoscaler/vertical-pod-autoscaler/pkg/recommender@$VPA_VERSION
  [vpa-updater]=k8s.io/autoscaler/vertical-pod-autoscaler/pkg/updater@$VPA_VERSION
  [vpa-admission-controller]=k8s.io/autoscaler/vertical-pod-autoscaler/pkg/admission-controller@$VPA_VERSION
)
# Version strings the programs print (their Makefiles set the same variables).
declare -A LDFLAGS=(
  [coredns]="-X github.com/coredns/coredns/coremain.GitCommit=module-proxy-$COREDNS_VERSION"
  [flanneld]="-X github.com/flannel-io/flannel/pkg/version.Version=$FLANNEL_VERSION"
  [flannel-cni-plugin]="-X github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion=$FLANNEL_CNI_PLUGIN_VERSION"
  [metrics-server]="-X k8s.io/client-go/pkg/version.gitVersion=$METRICS_SERVER_VERSION -X k8s.io/client-go/pkg/version.gitCommit=module-proxy-$METRICS_SERVER_VERSION"
  # The VPA's version is a constant in its source (common/version.go).
  [vpa-recommender]=""
  [vpa-updater]=""
  [vpa-admission-controller]=""
)

# build_flanneld OUTFILE: flannel's module source with main.go's tencentvpc import dropped.
build_flanneld() {
  local dir src=$OUT/src/flannel-$FLANNEL_VERSION
  dir=$(go mod download -json "github.com/flannel-io/flannel@$FLANNEL_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  [[ -f $dir/main.go ]] || die "go mod download of flannel $FLANNEL_VERSION gave no source"
  rm -rf "$src"
  mkdir -p "$(dirname "$src")"
  cp -r "$dir" "$src"
  chmod -R u+w "$src"
  grep -q '"github.com/flannel-io/flannel/pkg/backend/tencentvpc"' "$src/main.go" ||
    die "flannel $FLANNEL_VERSION main.go no longer imports the tencentvpc backend; drop the workaround"
  sed -i '/"github.com\/flannel-io\/flannel\/pkg\/backend\/tencentvpc"/d' "$src/main.go"
  # CGO as upstream builds it (the udp backend is C); the image's Debian base has the glibc it links.
  (cd "$src" && CGO_ENABLED=1 go build -trimpath -ldflags "-s -w ${LDFLAGS[flanneld]}" -o "$1" .)
}

# build_vpa OUTFILE PKG@VERSION: a VPA command, in a wrapper module (go_wrapper_module): the VPA's
# go.mod has exclude directives, which `go install pkg@version` refuses; -mod=mod fills go.sum.
build_vpa() {
  local wrap=$OUT/src/vpa-${2##*@}
  if [[ ! -f $wrap/go.mod ]]; then
    mkdir -p "$wrap"
    go_wrapper_module "$wrap" capk.local/vpa "${2##*@}" "k8s.io/autoscaler/vertical-pod-autoscaler@${2##*@}"
  fi
  (cd "$wrap" && go build -trimpath -ldflags "-s -w" -o "$1" "${2%@*}")
}

targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(coredns flanneld flannel-cni-plugin)
require go:golang

for t in "${targets[@]}"; do
  [[ -n ${PKG[$t]:-} ]] || { log "unknown binary '$t' (known: ${!PKG[*]})"; exit 2; }
  stamp="${PKG[$t]} -s -w ${LDFLAGS[$t]}"
  if [[ -x $BIN/$t && -f $BIN/.$t.version && $(cat "$BIN/.$t.version") == "$stamp" ]]; then
    log "$t already built (${PKG[$t]})"
    continue
  fi
  start=$SECONDS
  log "building $t (${PKG[$t]})"
  gobin=$(mktemp -d "$OUT/.gobin.XXXXXX")
  if [[ $t == flanneld ]]; then
    build_flanneld "$gobin/flanneld"
  elif [[ $t == vpa-* ]]; then
    build_vpa "$gobin/$t" "${PKG[$t]}"
  else
    GOBIN=$gobin go install -trimpath -ldflags "-s -w ${LDFLAGS[$t]}" "${PKG[$t]}"
  fi
  built=("$gobin"/*)
  [[ ${#built[@]} == 1 && -x ${built[0]} ]] || { rm -rf "$gobin"; die "go install of ${PKG[$t]} gave ${built[*]}"; }
  mv "${built[0]}" "$BIN/$t"
  rm -rf "$gobin"
  echo "$stamp" >"$BIN/.$t.version"
  log "$t built in $((SECONDS - start))s"
done
