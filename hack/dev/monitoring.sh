#!/usr/bin/env bash
# A real Prometheus in the local management cluster scraping the CAPK controller's /metrics
# (`CAPK_DEV_MONITORING=1 make dev-up`, and `make e2e`).
#
#   bash hack/dev/monitoring.sh   (needs a running local MC with CAPK installed: make dev-up; idempotent)
#
# - Prometheus of the same module version as the promtool that checks the alerts
#   (PROMETHEUS_VERSION in hack/versions.env; hack/build-promtool.sh prometheus, no service
#   discovery plugins), a FROM-scratch image made with buildah (binary_image in lib.sh).
# - Namespace `monitoring`: ServiceAccount `prometheus`, bound to the provider's ClusterRole
#   capkvm-metrics-reader (the one a user binds to their scraper), a Deployment and a Service
#   `prometheus` (9090, cluster-internal; the tests query it through the apiserver's service proxy).
# - No Prometheus Operator: the scrape is a static config of what the shipped ServiceMonitor says
#   (manifests/components/monitoring/monitoring.yaml): the Service capkvm-controller-metrics in
#   capkvm-system, port 8443, HTTPS with the controller's self-signed certificate, authorized by the
#   Pod's own ServiceAccount token (read from its file at each scrape, never in an argument), job
#   name = the Service's name as the operator would set it. The PrometheusRule's groups are loaded
#   as a rule file, so the shipped alerts are evaluated against the real controller.
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck source=../versions.env
source "$ROOT/hack/versions.env"
t0=$SECONDS
WORK=$DEV/monitoring
NS=monitoring
IMAGE=localhost/capk/prometheus:$PROMETHEUS_VERSION

bash "$ROOT/hack/build-promtool.sh" promtool prometheus >&2
kc get clusterrole capkvm-metrics-reader >/dev/null 2>&1 ||
  die "ClusterRole capkvm-metrics-reader missing: CAPK is not installed (make dev-up without CAPK_DEV_PROVIDERS=0)"
digest=$(binary_image "$IMAGE" "$BIN/prometheus" \
  "hack/dev/monitoring.sh: prometheus $PROMETHEUS_VERSION from the Go module proxy" --user 65534 --port 9090)

# --- configuration -----------------------------------------------------------------------------------
mkdir -p "$WORK"
cat >"$WORK/prometheus.yml" <<EOF
# Written by hack/dev/monitoring.sh.
global:
  scrape_interval: 10s
  evaluation_interval: 10s
rule_files: [/etc/prometheus/capk-rules.yaml]
scrape_configs:
  # What manifests/components/monitoring's ServiceMonitor asks of the Prometheus Operator.
  - job_name: capkvm-controller-metrics
    scheme: https
    authorization:
      credentials_file: /var/run/secrets/kubernetes.io/serviceaccount/token
    tls_config:
      insecure_skip_verify: true
    honor_labels: true
    static_configs:
      - targets: [capkvm-controller-metrics.capkvm-system.svc:8443]
EOF
# The PrometheusRule's spec (a rule file, indented under `spec:` in the second document).
awk '/^---$/ { doc++; next } doc == 1 && /^spec:/ { on = 1; next } on && /^[^ #]/ { on = 0 } on { sub(/^  /, ""); print }' \
  "$ROOT/manifests/components/monitoring/monitoring.yaml" >"$WORK/capk-rules.yaml"
grep -q '^groups:' "$WORK/capk-rules.yaml" || die "no rule groups found in manifests/components/monitoring/monitoring.yaml"
"$BIN/promtool" check rules "$WORK/capk-rules.yaml" >/dev/null ||
  die "promtool check rules ${WORK#"$ROOT"/}/capk-rules.yaml failed"
config_digest=$(cat "$WORK/prometheus.yml" "$WORK/capk-rules.yaml" | sha256sum | cut -c1-16)

# --- objects -----------------------------------------------------------------------------------------
kc apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Namespace
metadata: {name: $NS}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: prometheus, namespace: $NS}
---
# The binding a user makes for their scraper (docs/operating.md).
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: capk-dev-prometheus-capkvm-metrics}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: capkvm-metrics-reader}
subjects: [{kind: ServiceAccount, name: prometheus, namespace: $NS}]
EOF
kc -n "$NS" create configmap prometheus --from-file="$WORK/prometheus.yml" --from-file="$WORK/capk-rules.yaml" \
  --dry-run=client -o yaml | kc apply -f - >/dev/null
kc apply -f - >/dev/null <<EOF
apiVersion: apps/v1
kind: Deployment
metadata:
  name: prometheus
  namespace: $NS
  labels: {app.kubernetes.io/name: prometheus}
spec:
  replicas: 1
  strategy: {type: Recreate}
  selector: {matchLabels: {app.kubernetes.io/name: prometheus}}
  template:
    metadata:
      labels: {app.kubernetes.io/name: prometheus}
      annotations: {capk.dev/binary: "$digest", capk.dev/config: "$config_digest"}
    spec:
      serviceAccountName: prometheus
      securityContext:
        runAsNonRoot: true
        runAsUser: 65534
        seccompProfile: {type: RuntimeDefault}
      containers:
      - name: prometheus
        image: $IMAGE
        imagePullPolicy: IfNotPresent
        args:
        - --config.file=/etc/prometheus/prometheus.yml
        # Not /prometheus: the image's binary is /prometheus (binary_image puts it at the root).
        - --storage.tsdb.path=/data
        - --storage.tsdb.retention.time=6h
        - --web.listen-address=:9090
        ports:
        - {name: web, containerPort: 9090}
        readinessProbe:
          httpGet: {path: /-/ready, port: web}
          periodSeconds: 5
        livenessProbe:
          httpGet: {path: /-/healthy, port: web}
          periodSeconds: 20
        resources:
          requests: {cpu: 20m, memory: 64Mi}
          limits: {memory: 512Mi}
        securityContext:
          allowPrivilegeEscalation: false
          readOnlyRootFilesystem: true
          capabilities: {drop: [ALL]}
        volumeMounts:
        - {name: config, mountPath: /etc/prometheus, readOnly: true}
        - {name: data, mountPath: /data}
      volumes:
      - name: config
        configMap: {name: prometheus}
      - name: data
        emptyDir: {}
---
apiVersion: v1
kind: Service
metadata:
  name: prometheus
  namespace: $NS
  labels: {app.kubernetes.io/name: prometheus}
spec:
  selector: {app.kubernetes.io/name: prometheus}
  ports:
  - {name: web, port: 9090, targetPort: web}
EOF
kc -n "$NS" rollout status deployment/prometheus --timeout=180s >/dev/null ||
  die "Prometheus did not become ready: kubectl -n $NS describe pod -l app.kubernetes.io/name=prometheus; kubectl -n $NS logs deployment/prometheus"

# The controller's target is up: HTTPS answered, the token passed TokenReview and the
# SubjectAccessReview for get /metrics.
API=/api/v1/namespaces/$NS/services/http:prometheus:web/proxy/api/v1
target_up() {
  local answer
  answer=$(kc get --raw "$API/query?query=up%7Bjob%3D%22capkvm-controller-metrics%22%7D") &&
    grep -q '"value":\[[0-9.]*,"1"\]' <<<"$answer"
}
start=$SECONDS
until target_up 2>/dev/null; do
  ((SECONDS - start < 120)) ||
    die "Prometheus does not scrape the CAPK controller after 120 s; its target: $(kc get --raw "$API/targets" 2>&1 | grep -o '"lastError":"[^"]*"' | head -1)"
  sleep 2
done
log "Prometheus scrapes the CAPK controller: up{job=\"capkvm-controller-metrics\"} == 1 after $((SECONDS - start))s"
log "Prometheus $PROMETHEUS_VERSION scrapes the CAPK controller ($((SECONDS - t0))s; query: kubectl get --raw '/api/v1/namespaces/$NS/services/http:prometheus:web/proxy/api/v1/query?query=up')"
