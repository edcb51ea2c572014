#!/usr/bin/env bash
# Cluster API and this provider on the local management cluster, installed by the real
# `clusterctl init` from a local clusterctl repository (docs/local-management-cluster.md).
#
#   bash hack/dev/capi.sh            (make dev-up runs it after the cluster, the images and cert-manager)
#
# The repository, _output/dev/clusterctl/, has the layout clusterctl reads from file:// URLs:
#   cluster-api/<v>/core-components.yaml            kustomize build of CAPI's core/config/default
#   bootstrap-kubeadm/<v>/bootstrap-components.yaml       … bootstrap/kubeadm/config/default
#   control-plane-kubeadm/<v>/control-plane-components.yaml … controlplane/kubeadm/config/default
#   infrastructure-kvm/<v>/…                         `make release-manifests` (ours, as released)
# Each with the metadata.yaml of its module. That is what CAPI's own `make release-manifests`
# does, from the module the Go proxy serves, with two edits a release build also makes: the
# manager images are the ones hack/dev/images.sh built (_output/dev/images.env), and their pull
# policy is IfNotPresent (nothing can be pulled here). clusterctl.yaml points clusterctl at these
# files and at the cert-manager that hack/dev/cert-manager.sh prepared.
#
# Idempotent: when every provider already runs at the wanted version and the repository did not
# change, it only waits for them. A changed repository (new images, new manifests) is applied by
# `clusterctl delete --all` (keeping CRDs and objects) and a new `clusterctl init`.
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck source=../versions.env
source "$ROOT/hack/versions.env"
t0=$SECONDS

REPO=$DEV/clusterctl
CONFIG=$REPO/clusterctl.yaml
CAPK_VERSION=v$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -1)
CAPI_SRC=$(GOFLAGS=-mod=mod go mod download -json "sigs.k8s.io/cluster-api@$CAPI_VERSION" | sed -n 's/^\s*"Dir": "\(.*\)",\?$/\1/p')
[[ -d $CAPI_SRC/core/config/default ]] || die "no CAPI sources for $CAPI_VERSION (go mod download failed?)"

[[ -f $DEV/images.env ]] || die "${DEV#"$ROOT"/}/images.env missing: run 'bash hack/dev/images.sh' first"
# shellcheck source=/dev/null
source "$DEV/images.env"
for v in CAPI_CORE_IMAGE CAPI_KUBEADM_BOOTSTRAP_IMAGE CAPI_KUBEADM_CONTROL_PLANE_IMAGE CAPK_CONTROLLER_IMAGE CAPK_LAUNCHER_IMAGE CAPK_TEST_GUEST_IMAGE; do
  [[ -n ${!v:-} ]] || die "$v not set in ${DEV#"$ROOT"/}/images.env (hack/dev/images.sh writes it)"
done

bash "$ROOT/hack/build-capi.sh" clusterctl >/dev/null
bash "$ROOT/hack/release-manifests.sh" >/dev/null
CLUSTERCTL=$BIN/clusterctl

# --- the repository ----------------------------------------------------------------------------------
# component DIR FILE IMAGE: kustomize CAPI's DIR/config/default into REPO/DIR-label/<v>/FILE.
component() {
  local src=$1 dest=$2 image=$3 out
  out=$REPO/$dest
  mkdir -p "$(dirname "$out")"
  "$BIN/kubectl" kustomize "$CAPI_SRC/$src/config/default" |
    sed -E "s#^(\s+image: )gcr\.io/k8s-staging-cluster-api/[a-z-]+:main\$#\1$image#; s#^(\s+imagePullPolicy: )Always\$#\1IfNotPresent#" >"$out.tmp"
  grep -q "image: $image\$" "$out.tmp" || die "no manager image replaced in $src/config/default"
  mv "$out.tmp" "$out"
  cp "$CAPI_SRC/metadata.yaml" "$(dirname "$out")/metadata.yaml"
}
component core "cluster-api/$CAPI_VERSION/core-components.yaml" "$CAPI_CORE_IMAGE"
component bootstrap/kubeadm "bootstrap-kubeadm/$CAPI_VERSION/bootstrap-components.yaml" "$CAPI_KUBEADM_BOOTSTRAP_IMAGE"
component controlplane/kubeadm "control-plane-kubeadm/$CAPI_VERSION/control-plane-components.yaml" "$CAPI_KUBEADM_CONTROL_PLANE_IMAGE"
rm -rf "$REPO/infrastructure-kvm"
mkdir -p "$REPO/infrastructure-kvm"
cp -r "$OUT/release/infrastructure-kvm/$CAPK_VERSION" "$REPO/infrastructure-kvm/"

cert_manager=""
if [[ -f $DEV/cert-manager.env ]]; then
  # shellcheck source=/dev/null
  source "$DEV/cert-manager.env"
  cert_manager="cert-manager:
  url: file://${CERT_MANAGER_COMPONENTS:?}
  version: ${CERT_MANAGER_VERSION:?}"
fi
cat >"$CONFIG" <<EOF
# Written by hack/dev/capi.sh: the local clusterctl repository of the local management cluster.
providers:
  - name: cluster-api
    type: CoreProvider
    url: file://$REPO/cluster-api/$CAPI_VERSION/core-components.yaml
  - name: kubeadm
    type: BootstrapProvider
    url: file://$REPO/bootstrap-kubeadm/$CAPI_VERSION/bootstrap-components.yaml
  - name: kubeadm
    type: ControlPlaneProvider
    url: file://$REPO/control-plane-kubeadm/$CAPI_VERSION/control-plane-components.yaml
  - name: kvm
    type: InfrastructureProvider
    url: file://$REPO/infrastructure-kvm/$CAPK_VERSION/infrastructure-components.yaml
$cert_manager
# Variables of the components (clusterctl reads them from here or the environment).
EXP_KUBEADM_BOOTSTRAP_FORMAT_IGNITION: "true"
CLUSTER_TOPOLOGY: "true"
CAPK_CONTROLLER_IMAGE: "$CAPK_CONTROLLER_IMAGE"
CAPK_LAUNCHER_IMAGE: "$CAPK_LAUNCHER_IMAGE"
CAPK_DEFAULT_NODE_IMAGE: "$CAPK_TEST_GUEST_IMAGE"
# One node with 2 cores: a vCPU requests a tenth of a core, or only one VM would fit.
CAPK_CPU_ALLOCATION_RATIO: "10"
# No KVM here: Kubernetes nodes under TCG need QEMU's translation cache at about 1 GiB.
CAPK_TCG_TRANSLATION_CACHE_MIB: "1024"
# The workload journey shares a directory of the MC node into a worker: its namespace's share,
# /var/lib/capk-e2e/<namespace> (tests/tests/e2e/workload.rs).
CAPK_ALLOWED_HOST_VOLUME_PATHS: "/var/lib/capk-e2e"
# The ClusterClass scenario reaches a cluster from the host through a node port
# (tests/tests/e2e/topology.rs); kube-proxy opens node ports on the bridge address only.
CAPK_ALLOWED_CONTROL_PLANE_SERVICE_TYPES: "NodePort"
EOF
export CLUSTERCTL_DISABLE_VERSIONCHECK=true
# The digest of what init would install; kept as an annotation-free stamp under _output/dev.
digest=$(cat "$CONFIG" "$REPO"/*/*/*.yaml | sha256sum | cut -c1-16)

# --- install -----------------------------------------------------------------------------------------
installed() { # every provider present at the wanted version and the repository unchanged
  [[ -f $RUN/capi.digest && $(<"$RUN/capi.digest") == "$digest" ]] || return 1
  local got
  got=$(kc get providers.clusterctl.cluster.x-k8s.io -A -o 'jsonpath={range .items[*]}{.metadata.name}={.version}{"\n"}{end}' 2>/dev/null | sort | tr '\n' ' ')
  [[ $got == "bootstrap-kubeadm=$CAPI_VERSION cluster-api=$CAPI_VERSION control-plane-kubeadm=$CAPI_VERSION infrastructure-kvm=$CAPK_VERSION " ]]
}
if installed; then
  log "Cluster API $CAPI_VERSION and CAPK $CAPK_VERSION already installed from this repository"
else
  if kc get providers.clusterctl.cluster.x-k8s.io -A -o name 2>/dev/null | grep -q .; then
    log "the repository changed: reinstalling the providers (CRDs and objects stay)"
    "$CLUSTERCTL" delete --config "$CONFIG" --kubeconfig "$KUBECONFIG_ADMIN" --all >>"$LOGS/clusterctl.log" 2>&1 ||
      die "clusterctl delete failed (log ${LOGS#"$ROOT"/}/clusterctl.log)"
  fi
  log "clusterctl init (log ${LOGS#"$ROOT"/}/clusterctl.log)"
  if ! "$CLUSTERCTL" init --config "$CONFIG" --kubeconfig "$KUBECONFIG_ADMIN" \
    --core "cluster-api:$CAPI_VERSION" --bootstrap "kubeadm:$CAPI_VERSION" \
    --control-plane "kubeadm:$CAPI_VERSION" --infrastructure "kvm:$CAPK_VERSION" \
    --wait-providers --wait-provider-timeout 300 >>"$LOGS/clusterctl.log" 2>&1; then
    tail -n 30 "$LOGS/clusterctl.log" >&2
    die "clusterctl init failed (log ${LOGS#"$ROOT"/}/clusterctl.log)"
  fi
  echo "$digest" >"$RUN/capi.digest"
fi
# Images rebuilt under the same tag (…:dev): the running managers still use the old ones, so a
# change of any manager image's digest in containerd restarts the Deployments.
image_digests=$(for i in "$CAPI_CORE_IMAGE" "$CAPI_KUBEADM_BOOTSTRAP_IMAGE" "$CAPI_KUBEADM_CONTROL_PLANE_IMAGE" "$CAPK_CONTROLLER_IMAGE"; do
  ctr_k8s images ls "name==$i" | awk 'NR > 1 {print $1, $3}'
done | sha256sum | cut -c1-16)
if [[ -f $RUN/capi.images && $(<"$RUN/capi.images") != "$image_digests" ]]; then
  log "manager images changed: restarting the Deployments"
  for d in capi-system/capi-controller-manager capi-kubeadm-bootstrap-system/capi-kubeadm-bootstrap-controller-manager \
    capi-kubeadm-control-plane-system/capi-kubeadm-control-plane-controller-manager capkvm-system/capkvm-controller-manager; do
    kc -n "${d%/*}" rollout restart "deployment/${d#*/}" >/dev/null
  done
fi
echo "$image_digests" >"$RUN/capi.images"
for d in capi-system/capi-controller-manager capi-kubeadm-bootstrap-system/capi-kubeadm-bootstrap-controller-manager \
  capi-kubeadm-control-plane-system/capi-kubeadm-control-plane-controller-manager capkvm-system/capkvm-controller-manager; do
  kc -n "${d%/*}" rollout status "deployment/${d#*/}" --timeout=300s >/dev/null ||
    die "deployment $d is not available (kubectl -n ${d%/*} describe deployment ${d#*/})"
done
# Available Deployments are not yet serving webhooks: after a reinstall, cert-manager issues new
# serving certificates and injects their CA, and until the managers' mounted Secrets follow the
# apiserver refuses their webhooks (x509: certificate signed by unknown authority). A server-side
# dry run through each manager's webhooks must reach them (an answer, even a refusal, is fine).
webhooks_serve() {
  local out
  out=$(kc create --dry-run=server -f - 2>&1 <<'YAML'
apiVersion: cluster.x-k8s.io/v1beta2
kind: Cluster
metadata: {name: capk-dev-webhook-probe, namespace: default}
spec: {paused: true}
---
apiVersion: bootstrap.cluster.x-k8s.io/v1beta2
kind: KubeadmConfigTemplate
metadata: {name: capk-dev-webhook-probe, namespace: default}
spec: {template: {spec: {format: cloud-config}}}
---
apiVersion: controlplane.cluster.x-k8s.io/v1beta2
kind: KubeadmControlPlaneTemplate
metadata: {name: capk-dev-webhook-probe, namespace: default}
spec: {template: {spec: {kubeadmConfigSpec: {format: cloud-config}}}}
YAML
  ) && return 0
  grep -q "failed calling webhook" <<<"$out" && { last_webhook_error=$out; return 1; }
  return 0
}
last_webhook_error=""
for _ in $(seq 90); do
  webhooks_serve && break
  sleep 2
done
webhooks_serve || die "Cluster API's webhooks do not answer after 3 minutes: ${last_webhook_error##*$'\n'}"
log "Cluster API $CAPI_VERSION (core, kubeadm bootstrap and control plane) and CAPK $CAPK_VERSION run ($((SECONDS - t0))s)"
echo "$CONFIG"
