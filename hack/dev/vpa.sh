#!/usr/bin/env bash
# metrics-server and the VerticalPodAutoscaler (recommender, updater, admission controller) in the
# local management cluster (`CAPK_DEV_VPA=1 make dev-up`, and `make e2e`), so that the
# provider's shipped VPA object (manifests/components/vpa) meets a real VPA.
#
#   bash hack/dev/vpa.sh     (needs a running local MC with cert-manager: make dev-up; idempotent)
#
# 1. The four binaries from the Go module proxy (hack/build-addons.sh; METRICS_SERVER_VERSION and
#    VPA_VERSION in hack/versions.env), each a FROM-scratch image made with buildah and imported
#    into containerd (binary_image in lib.sh): localhost/capk/metrics-server:<v>,
#    localhost/capk/vpa-{recommender,updater,admission-controller}:<v>.
# 2. Upstream's own manifests from the same module downloads, as their READMEs install them:
#    metrics-server's manifests/overlays/release and the VPA's deploy/ (CRDs, RBAC, the three
#    Deployments in kube-system, the vpa-webhook Service), through a kustomization under
#    _output/dev/vpa that changes only what this cluster needs:
#    - the images (the local names; their pull policy is already IfNotPresent);
#    - metrics-server's --kubelet-insecure-tls: the kubelet serves a self-signed certificate here
#      (serverTLSBootstrap off), as on kind and most kubeadm clusters without a CSR approver;
#    - the admission controller's serving certificate from cert-manager (which the local MC runs
#      for Cluster API) instead of upstream's gencerts.sh: a self-signed root, a CA Issuer and a
#      Certificate for vpa-webhook.kube-system.svc into the Secret upstream mounts
#      (vpa-tls-certs), read under cert-manager's key names. The admission controller registers
#      its MutatingWebhookConfiguration itself with that CA (upstream's default) and rereads a
#      renewed certificate (--reload-cert, upstream's Deployment).
#    Everything else stays upstream's, including the recommender's floors (25m CPU, 250 MiB memory
#    per Pod) and the updater's one-minute loop, so what a user's VPA would do is what happens here.
# 3. Waits until the metrics API serves the node's usage and the webhook is registered.
#
# The aggregated metrics API needs the apiserver's front proxy (requestheader flags and
# front-proxy-client certificate), which hack/dev-up.sh always configures, as kubeadm does.
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck source=../versions.env
source "$ROOT/hack/versions.env"
t0=$SECONDS
WORK=$DEV/vpa

bash "$ROOT/hack/build-addons.sh" metrics-server vpa-recommender vpa-updater vpa-admission-controller >&2

module_dir() { # MODULE@VERSION: its directory in the Go module cache
  local dir
  dir=$(GOFLAGS=-mod=mod go mod download -json "$1" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
  [[ -d $dir ]] || die "go mod download of $1 gave no source (is the Go module proxy reachable?)"
  echo "$dir"
}
ms_src=$(module_dir "sigs.k8s.io/metrics-server@$METRICS_SERVER_VERSION")
vpa_src=$(module_dir "k8s.io/autoscaler/vertical-pod-autoscaler@$VPA_VERSION")
[[ -f $ms_src/manifests/overlays/release/kustomization.yaml && -f $vpa_src/deploy/kustomization.yaml ]] ||
  die "metrics-server $METRICS_SERVER_VERSION or VPA $VPA_VERSION has no manifests where upstream keeps them"

# --- images ------------------------------------------------------------------------------------------
MS_IMAGE=localhost/capk/metrics-server:$METRICS_SERVER_VERSION
digests=$(binary_image "$MS_IMAGE" "$BIN/metrics-server" \
  "hack/dev/vpa.sh: metrics-server $METRICS_SERVER_VERSION from the Go module proxy" --user 65534)
for c in recommender updater admission-controller; do
  digests+=" $(binary_image "localhost/capk/vpa-$c:$VPA_VERSION" "$BIN/vpa-$c" \
    "hack/dev/vpa.sh: VPA $c $VPA_VERSION from the Go module proxy" --user 65534)"
done

# --- manifests ---------------------------------------------------------------------------------------
# Kustomize takes bases only by relative path: the module cache, seen from WORK.
mkdir -p "$WORK"
ms_rel=$(realpath --relative-to="$WORK" "$ms_src/manifests/overlays/release")
vpa_rel=$(realpath --relative-to="$WORK" "$vpa_src/deploy")
cat >"$WORK/certificates.yaml" <<EOF
# The admission controller's serving certificate, from cert-manager (written by hack/dev/vpa.sh).
apiVersion: cert-manager.io/v1
kind: Issuer
metadata: {name: vpa-selfsigned, namespace: kube-system}
spec: {selfSigned: {}}
---
apiVersion: cert-manager.io/v1
kind: Certificate
metadata: {name: vpa-ca, namespace: kube-system}
spec:
  isCA: true
  commonName: vpa-webhook-ca
  secretName: vpa-ca
  privateKey: {algorithm: ECDSA, size: 256}
  issuerRef: {name: vpa-selfsigned, kind: Issuer}
---
apiVersion: cert-manager.io/v1
kind: Issuer
metadata: {name: vpa-ca, namespace: kube-system}
spec: {ca: {secretName: vpa-ca}}
---
apiVersion: cert-manager.io/v1
kind: Certificate
metadata: {name: vpa-webhook, namespace: kube-system}
spec:
  secretName: vpa-tls-certs
  dnsNames: [vpa-webhook.kube-system.svc]
  privateKey: {algorithm: ECDSA, size: 256}
  issuerRef: {name: vpa-ca, kind: Issuer}
EOF
# The image names upstream's manifests give each container, read from them (rendered once without
# the replacements below), so that nothing here names their registry.
cat >"$WORK/kustomization.yaml" <<EOF
resources:
  - $ms_rel
  - $vpa_rel
EOF
"$BIN/kubectl" kustomize "$WORK" 2>/dev/null >"$WORK/upstream.yaml" ||
  die "kustomize of upstream's manifests in ${WORK#"$ROOT"/} failed: $("$BIN/kubectl" kustomize "$WORK" 2>&1 | tail -3)"
# upstream_image NAME: upstream's image name (without the tag) of the container image NAME.
upstream_image() {
  local found
  found=$(sed -n "s#^[ -]*image: \(.*/$1\):[^/]*\$#\1#p" "$WORK/upstream.yaml" | sort -u)
  [[ -n $found && $found != *$'\n'* ]] || die "upstream's manifests name no single image .../$1 (found: ${found:-none})"
  echo "$found"
}
up_ms=$(upstream_image metrics-server)
up_recommender=$(upstream_image vpa-recommender)
up_updater=$(upstream_image vpa-updater)
up_admission=$(upstream_image vpa-admission-controller)
cat >"$WORK/kustomization.yaml" <<EOF
# Written by hack/dev/vpa.sh: upstream's metrics-server and VPA manifests, local images.
resources:
  - $ms_rel
  - $vpa_rel
  - certificates.yaml
images:
  - {name: $up_ms, newName: ${MS_IMAGE%:*}, newTag: $METRICS_SERVER_VERSION}
  - {name: $up_recommender, newName: localhost/capk/vpa-recommender, newTag: $VPA_VERSION}
  - {name: $up_updater, newName: localhost/capk/vpa-updater, newTag: $VPA_VERSION}
  - {name: $up_admission, newName: localhost/capk/vpa-admission-controller, newTag: $VPA_VERSION}
patches:
  - target: {kind: Deployment, name: metrics-server}
    patch: |
      - {op: add, path: /spec/template/spec/containers/0/args/-, value: --kubelet-insecure-tls}
  - target: {kind: Deployment, name: vpa-admission-controller}
    patch: |
      - {op: add, path: /spec/template/spec/containers/0/args/-, value: --client-ca-file=/etc/tls-certs/ca.crt}
      - {op: add, path: /spec/template/spec/containers/0/args/-, value: --tls-cert-file=/etc/tls-certs/tls.crt}
      - {op: add, path: /spec/template/spec/containers/0/args/-, value: --tls-private-key=/etc/tls-certs/tls.key}
  # A rebuilt binary under the same tag rolls its Deployment.
  - target: {kind: Deployment, namespace: kube-system}
    patch: |
      apiVersion: apps/v1
      kind: Deployment
      metadata: {name: any}
      spec: {template: {metadata: {annotations: {capk.dev/binaries: "${digests// /-}"}}}}
EOF
"$BIN/kubectl" kustomize "$WORK" 2>/dev/null >"$WORK/components.yaml" ||
  die "kustomize of ${WORK#"$ROOT"/} failed: $("$BIN/kubectl" kustomize "$WORK" 2>&1 | tail -3)"
for image in "$MS_IMAGE" "localhost/capk/vpa-recommender:$VPA_VERSION" "localhost/capk/vpa-updater:$VPA_VERSION" \
  "localhost/capk/vpa-admission-controller:$VPA_VERSION"; do
  grep -q "image: $image\$" "$WORK/components.yaml" || die "upstream's manifests no longer name the image replaced by $image"
done
for up in "$up_ms" "$up_recommender" "$up_updater" "$up_admission"; do
  ! grep -q "image: $up:" "$WORK/components.yaml" || die "upstream's image $up is left in ${WORK#"$ROOT"/}/components.yaml"
done

# cert-manager's webhook admits Issuers and Certificates only once it serves (right after
# clusterctl init it may not yet): retry the apply for a while.
start=$SECONDS
until err=$(kc apply --server-side --force-conflicts -f "$WORK/components.yaml" 2>&1 >/dev/null); do
  ((SECONDS - start < 120)) || die "kubectl apply of ${WORK#"$ROOT"/}/components.yaml failed for 120 s: $err"
  sleep 2
done

# --- ready -------------------------------------------------------------------------------------------
for d in metrics-server vpa-recommender vpa-updater vpa-admission-controller; do
  kc -n kube-system rollout status "deployment/$d" --timeout=300s >/dev/null ||
    die "deployment kube-system/$d is not available (kubectl -n kube-system describe deployment $d; kubectl -n kube-system logs deployment/$d)"
done
kc wait --for=condition=Available apiservice/v1beta1.metrics.k8s.io --timeout=120s >/dev/null ||
  die "the metrics API is not available: kubectl get apiservice v1beta1.metrics.k8s.io -o yaml; kubectl -n kube-system logs deployment/metrics-server"
node_usage() { kc get --raw "/apis/metrics.k8s.io/v1beta1/nodes/$NODE_NAME" | grep -q '"memory"'; }
wait_for "the metrics API serves $NODE_NAME's usage (kubectl top node)" 120 node_usage
webhook_registered() { [[ -n $(kc get mutatingwebhookconfiguration vpa-webhook-config -o 'jsonpath={.webhooks[0].clientConfig.caBundle}') ]]; }
wait_for "the VPA admission controller's webhook registered" 120 webhook_registered
log "metrics-server $METRICS_SERVER_VERSION and VPA $VPA_VERSION run ($((SECONDS - t0))s)"
