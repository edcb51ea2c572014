#!/usr/bin/env bash
# cert-manager for the local management cluster, built here, never pulled: clusterctl init
# installs cert-manager first, and no registry is reachable here.
#
#   bash hack/dev/cert-manager.sh          binaries, images, components YAML, _output/dev/cert-manager.env
#   bash hack/dev/cert-manager.sh apply    the same, then install it with kubectl and wait for it
#   bash hack/dev/cert-manager.sh ensure   the same, then run clusterctl's own cert-manager step
#                                          (cert-manager/clusterctl-ensure.go: CertManagerClient.
#                                          EnsureInstalled of the pinned CAPI, as `clusterctl init`
#                                          runs it) with a clusterctl.yaml naming the local file
#   bash hack/dev/cert-manager.sh verify   smoke test on the running cert-manager (own namespace,
#                                          cleaned up): self-signed Issuer + Certificate Ready, and
#                                          cainjector fills caBundle of a CRD and a webhook configuration
#
# 1. hack/build-cert-manager.sh: controller, cainjector, webhook, acmesolver and helm from the Go
#    module proxy ($CERT_MANAGER_VERSION, $HELM_VERSION in hack/versions.env).
# 2. One image per binary, laid out as upstream's hack/containers/Containerfile.* (static binary in
#    /app/cmd/NAME/NAME, USER 1000, licence in /licenses) on a scratch base with what the distroless
#    static base gives them (CA bundle, /etc/passwd, /tmp), committed with buildah and imported into
#    the dev containerd's k8s.io namespace as localhost/capk/cert-manager-NAME:$CERT_MANAGER_VERSION.
# 3. The release's cert-manager.yaml rendered the way upstream's make/manifests.mk does it (`helm
#    template` of the module's chart with installCRDs, creator=static, no startupapicheck, namespace
#    first, then CRDs, then the rest), with the local image names (pull policy IfNotPresent).
#    It is written in the layout clusterctl reads from a file:// URL
#    ({base}/cert-manager/{version}/cert-manager.yaml), and _output/dev/cert-manager.env names it
#    for hack/dev/capi.sh's clusterctl.yaml:
#        cert-manager:
#          url: file://$CERT_MANAGER_COMPONENTS
#          version: $CERT_MANAGER_VERSION
# Idempotent: images present in containerd are not rebuilt, an unchanged YAML is not rewritten.
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck source=../versions.env
source "$ROOT/hack/versions.env"
t0=$SECONDS

MODE=${1:-prepare}
case $MODE in prepare | apply | ensure | verify) ;; *) die "usage: $0 [prepare|apply|ensure|verify]" ;; esac

V=$CERT_MANAGER_VERSION
WORK=$DEV/cert-manager
REPO=$WORK/repository
COMPONENTS=$REPO/cert-manager/$V/cert-manager.yaml
SRC=$OUT/src/cert-manager-$V
NAMES=(controller cainjector webhook acmesolver)
image_of() { echo "localhost/capk/cert-manager-$1:$V"; }

# --- verify: exercise a running cert-manager the way Cluster API uses it ----------------------------
verify() {
  local ns=capk-cert-manager-verify crd=capkcmverifies.verify.capk.dev vwc=capk-cert-manager-verify t=$SECONDS
  cleanup() {
    kc delete validatingwebhookconfiguration "$vwc" --ignore-not-found --wait=false >/dev/null 2>&1 || true
    kc delete crd "$crd" --ignore-not-found --wait=false >/dev/null 2>&1 || true
    kc delete namespace "$ns" --ignore-not-found --wait=false >/dev/null 2>&1 || true
  }
  trap cleanup EXIT
  cleanup
  kc wait --for=delete "namespace/$ns" --timeout=60s >/dev/null 2>&1 || true
  for d in cert-manager cert-manager-cainjector cert-manager-webhook; do
    kc -n cert-manager rollout status "deployment/$d" --timeout=180s >/dev/null || die "deployment cert-manager/$d not available"
  done
  # The webhook must answer before cert-manager objects can be created (clusterctl's own check).
  local objs
  objs=$(
    cat <<EOF
apiVersion: v1
kind: Namespace
metadata: {name: $ns}
---
apiVersion: cert-manager.io/v1
kind: Issuer
metadata: {name: selfsigned, namespace: $ns}
spec: {selfSigned: {}}
---
apiVersion: cert-manager.io/v1
kind: Certificate
metadata: {name: serving-cert, namespace: $ns}
spec:
  dnsNames: [verify-webhook.$ns.svc, verify-webhook.$ns.svc.cluster.local]
  secretName: serving-cert
  issuerRef: {kind: Issuer, name: selfsigned}
---
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: $crd
  annotations: {cert-manager.io/inject-ca-from: $ns/serving-cert}
spec:
  group: verify.capk.dev
  names: {kind: CapkCmVerify, listKind: CapkCmVerifyList, plural: capkcmverifies, singular: capkcmverify}
  scope: Namespaced
  conversion:
    strategy: Webhook
    webhook:
      conversionReviewVersions: [v1]
      clientConfig:
        service: {name: verify-webhook, namespace: $ns, path: /convert, port: 443}
  versions:
  - {name: v1alpha1, served: true, storage: false, schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}}
  - {name: v1, served: true, storage: true, schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}}
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata:
  name: $vwc
  annotations: {cert-manager.io/inject-ca-from: $ns/serving-cert}
webhooks:
- name: verify.capk.dev
  admissionReviewVersions: [v1]
  sideEffects: None
  failurePolicy: Ignore
  clientConfig:
    service: {name: verify-webhook, namespace: $ns, path: /validate, port: 443}
  rules:
  - {apiGroups: [verify.capk.dev], apiVersions: [v1], operations: [CREATE], resources: [capkcmverifies]}
EOF
  )
  mkdir -p "$WORK"
  printf '%s\n' "$objs" >"$WORK/verify.yaml"
  wait_for "cert-manager webhook admits an Issuer and a Certificate" 180 kc apply -f "$WORK/verify.yaml"
  kc -n "$ns" wait --for=condition=Ready issuer/selfsigned --timeout=120s >/dev/null || die "Issuer not Ready"
  kc -n "$ns" wait --for=condition=Ready certificate/serving-cert --timeout=120s >/dev/null || {
    kc -n "$ns" describe certificate serving-cert >&2
    die "Certificate not Ready"
  }
  local ca
  ca=$(kc -n "$ns" get secret serving-cert -o 'jsonpath={.data.ca\.crt}')
  [[ -n $ca ]] || die "secret $ns/serving-cert has no ca.crt"
  log "Issuer and Certificate Ready, secret $ns/serving-cert issued"
  # shellcheck disable=SC2317 # called by wait_for
  crd_ca() { [[ $(kc get crd "$crd" -o 'jsonpath={.spec.conversion.webhook.clientConfig.caBundle}') == "$ca" ]]; }
  # shellcheck disable=SC2317
  vwc_ca() { [[ $(kc get validatingwebhookconfiguration "$vwc" -o 'jsonpath={.webhooks[0].clientConfig.caBundle}') == "$ca" ]]; }
  wait_for "cainjector: CRD conversion webhook caBundle = the Certificate's CA" 120 crd_ca
  wait_for "cainjector: ValidatingWebhookConfiguration caBundle = the Certificate's CA" 120 vwc_ca
  cleanup
  trap - EXIT
  rm -f "$WORK/verify.yaml"
  log "cert-manager $V verified in $((SECONDS - t)) s (test objects deleted)"
}
if [[ $MODE == verify ]]; then
  verify
  exit 0
fi

# --- binaries ---------------------------------------------------------------------------------------
bash "$ROOT/hack/build-cert-manager.sh"
[[ -f $SRC/deploy/charts/cert-manager/values.yaml ]] || die "no chart in ${SRC#"$ROOT"/} (hack/build-cert-manager.sh copies the module there)"

# --- images -----------------------------------------------------------------------------------------
ctr_k8s version >/dev/null 2>&1 || die "the dev containerd does not answer on ${CONTAINERD_SOCK#"$ROOT"/}: make dev-up first"
have=$(ctr_k8s images ls -q)
for n in "${NAMES[@]}"; do
  img=$(image_of "$n")
  if grep -qxF "$img" <<<"$have"; then
    log "image $img already in containerd"
    continue
  fi
  require buildah
  start=$SECONDS
  d=$WORK/images/$n
  rm -rf "$d"
  mkdir -p "$d/rootfs/app/cmd/$n" "$d/rootfs/licenses" "$d/rootfs/etc/ssl/certs" "$d/rootfs/tmp"
  install -m 0755 "$BIN/cert-manager-$n" "$d/rootfs/app/cmd/$n/$n"
  install -m 0644 "$SRC/LICENSE" "$d/rootfs/licenses/LICENSE"
  [[ -f /etc/ssl/certs/ca-certificates.crt ]] && install -m 0644 /etc/ssl/certs/ca-certificates.crt "$d/rootfs/etc/ssl/certs/"
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$d/rootfs/etc/passwd"
  printf 'root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n' >"$d/rootfs/etc/group"
  chmod 1777 "$d/rootfs/tmp"
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$d/rootfs" -cf "$d/rootfs.tar" .
  buildah_image "$img" scratch "$d/rootfs.tar" --entrypoint "[\"/app/cmd/$n/$n\"]" --cmd '' --user 1000 \
    --label "org.opencontainers.image.title=cert-manager-$n" --label "org.opencontainers.image.version=$V" \
    --label "org.opencontainers.image.description=cert-manager $n $V built from the Go module proxy by hack/dev/cert-manager.sh" \
    --label org.opencontainers.image.licenses=Apache-2.0
  capk_buildah push --quiet "$img" "oci-archive:$d/image.oci.tar:$img" >/dev/null
  ctr_k8s images import --base-name "${img%:*}" "$d/image.oci.tar" >/dev/null
  rm -rf "$d"
  ctr_has_image "$img" || die "import did not produce $img"
  log "image $img built and imported in $((SECONDS - start))s"
done

# --- components YAML ----------------------------------------------------------------------------------
# The chart as upstream's make/manifests.mk packages it: templates, the CRDs wrapped in
# `if .Values.installCRDs` as templates/crds.yaml, Chart.yaml with version and appVersion set.
chart=$WORK/chart/cert-manager
rm -rf "$WORK/chart"
mkdir -p "$chart/templates"
cp "$SRC"/deploy/charts/cert-manager/templates/* "$chart/templates/"
cp "$SRC/deploy/charts/cert-manager/values.yaml" "$chart/values.yaml"
sed -e "s/^version: .*/version: $V/" -e "s/^appVersion: .*/appVersion: $V/" -e 's/{{IS_PRERELEASE}}/false/' \
  "$SRC/deploy/charts/cert-manager/Chart.template.yaml" >"$chart/Chart.yaml"
{
  echo '{{- if .Values.installCRDs }}'
  bash "$SRC/hack/concat-yaml.sh" "$SRC"/deploy/crds/*.yaml
  echo '{{- end }}'
} >"$chart/templates/crds.yaml"

export HELM_CACHE_HOME=$WORK/helm/cache HELM_CONFIG_HOME=$WORK/helm/config HELM_DATA_HOME=$WORK/helm/data
helm_template() {
  "$BIN/helm" template --api-versions="" --namespace=cert-manager --set=creator=static --set=startupapicheck.enabled=false \
    --set="image.repository=$(image_of controller | cut -d: -f1)" \
    --set="cainjector.image.repository=$(image_of cainjector | cut -d: -f1)" \
    --set="webhook.image.repository=$(image_of webhook | cut -d: -f1)" \
    --set="acmesolver.image.repository=$(image_of acmesolver | cut -d: -f1)" \
    "$@" cert-manager "$chart" | sed -e '1{/^---$/d;}'
}
mkdir -p "$(dirname "$COMPONENTS")"
tmp=$(mktemp "$COMPONENTS.XXXXXX")
{
  echo "# cert-manager $V: upstream's release cert-manager.yaml, rendered from the chart of"
  echo "# github.com/cert-manager/cert-manager@$V (Go module proxy) by hack/dev/cert-manager.sh"
  echo "# with helm $HELM_VERSION and the images built here. Licensed under the Apache License 2.0."
  cat "$SRC/deploy/manifests/namespace.yaml"
  echo "---"
  helm_template --set=installCRDs=true --show-only templates/crds.yaml
  echo "---"
  helm_template --set=installCRDs=false
} >"$tmp"
for n in "${NAMES[@]}"; do grep -qF "$(image_of "$n")" "$tmp" || die "rendered YAML does not use $(image_of "$n")"; done
grep -q 'quay\.io' "$tmp" && die "rendered YAML still names an upstream registry image"
if [[ -f $COMPONENTS ]] && cmp -s "$tmp" "$COMPONENTS"; then
  rm -f "$tmp"
else
  chmod 0644 "$tmp"
  mv "$tmp" "$COMPONENTS"
  log "rendered ${COMPONENTS#"$ROOT"/} ($(grep -c '^kind:' "$COMPONENTS") objects)"
fi

env_tmp=$(mktemp "$DEV/cert-manager.env.XXXXXX")
cat >"$env_tmp" <<EOF
# Written by hack/dev/cert-manager.sh. For clusterctl.yaml:
#   cert-manager:
#     url: file://\$CERT_MANAGER_COMPONENTS
#     version: \$CERT_MANAGER_VERSION
CERT_MANAGER_VERSION=$V
CERT_MANAGER_COMPONENTS=$COMPONENTS
CERT_MANAGER_IMAGES="$(for n in "${NAMES[@]}"; do printf '%s ' "$(image_of "$n")"; done | sed 's/ $//')"
EOF
chmod 0644 "$env_tmp"
if [[ -f $DEV/cert-manager.env ]] && cmp -s "$env_tmp" "$DEV/cert-manager.env"; then rm -f "$env_tmp"; else mv "$env_tmp" "$DEV/cert-manager.env"; fi

if [[ $MODE == ensure ]]; then
  require go:golang
  export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod
  ens=$OUT/src/clusterctl-ensure-$CAPI_VERSION
  if [[ ! -f $ens/go.sum ]]; then
    # A wrapper module of the pinned Cluster API, as hack/build-capi.sh makes its own.
    rm -rf "$ens"
    mkdir -p "$ens"
    go_wrapper_module "$ens" capk.local/clusterctl-ensure "$CAPI_VERSION" \
      "sigs.k8s.io/cluster-api@$CAPI_VERSION" "sigs.k8s.io/cluster-api/api@$CAPI_VERSION"
    cp "$ROOT/hack/dev/cert-manager/clusterctl-ensure.go" "$ens/main.go"
    (cd "$ens" && go mod tidy >/dev/null)
  fi
  cp "$ROOT/hack/dev/cert-manager/clusterctl-ensure.go" "$ens/main.go"
  (cd "$ens" && go build -trimpath -o clusterctl-ensure .)
  cat >"$WORK/clusterctl.yaml" <<EOF
# Written by hack/dev/cert-manager.sh ensure: only the cert-manager part of the dev clusterctl.yaml.
cert-manager:
  url: file://$COMPONENTS
  version: $V
EOF
  log "clusterctl's cert-manager step (CertManagerClient.EnsureInstalled, CAPI $CAPI_VERSION)"
  CLUSTERCTL_DISABLE_VERSIONCHECK=true "$ens/clusterctl-ensure" "$WORK/clusterctl.yaml" "$KUBECONFIG_ADMIN" ||
    die "clusterctl's cert-manager step failed"
fi
if [[ $MODE == apply ]]; then
  kc apply --server-side --force-conflicts -f "$COMPONENTS" >/dev/null
  for d in cert-manager cert-manager-cainjector cert-manager-webhook; do
    kc -n cert-manager rollout status "deployment/$d" --timeout=300s >/dev/null || die "deployment cert-manager/$d not available"
  done
  log "cert-manager $V applied and its deployments are available"
fi
log "cert-manager $V ready to install in $((SECONDS - t0))s: ${COMPONENTS#"$ROOT"/} (clusterctl.yaml: cert-manager.url file://$COMPONENTS, version $V)"
