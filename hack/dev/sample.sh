#!/usr/bin/env bash
# The sample workload cluster of `make dev-up`: `clusterctl generate cluster sample --flavor
# ignition` applied to namespace capk-sample, one control-plane machine, no workers, small VMs.
# The VM boots the node image the local MC was initialised with (CAPK_DEFAULT_NODE_IMAGE: the test
# guest, whose kubeadm only records its arguments, so no workload Node registers; workers would
# wait for a control plane that never initialises, hence none). Waits until the control-plane
# machine's guest has run its bootstrap. Idempotent (kubectl apply).
#
#   CAPK_DEV_SAMPLE=0 make dev-up     skips it (make e2e does)
#   kubectl delete cluster -n capk-sample sample     removes it
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck source=../versions.env
source "$ROOT/hack/versions.env"
NS=capk-sample
NAME=sample
CONFIG=$DEV/clusterctl/clusterctl.yaml
[[ -f $CONFIG ]] || die "${CONFIG#"$ROOT"/} missing: run hack/dev/capi.sh first"

kc get namespace "$NS" >/dev/null 2>&1 || kc create namespace "$NS" >/dev/null
CLUSTERCTL_DISABLE_VERSIONCHECK=true \
  CONTROL_PLANE_MACHINE_CPUS=1 CONTROL_PLANE_MACHINE_MEMORY=256Mi \
  CONTROL_PLANE_VOLUME_SIZE_GB=1 CONTROL_PLANE_DOCKER_VOLUME_SIZE_GB=1 \
  WORKER_MACHINE_CPUS=1 WORKER_MACHINE_MEMORY=256Mi VOLUME_SIZE_GB=1 DOCKER_VOLUME_SIZE_GB=1 \
  "$BIN/clusterctl" generate cluster "$NAME" --config "$CONFIG" --kubeconfig "$KUBECONFIG_ADMIN" \
  --infrastructure kvm --flavor ignition --target-namespace "$NS" \
  --kubernetes-version "$KUBERNETES_VERSION" --control-plane-machine-count 1 --worker-machine-count 0 \
  >"$DEV/sample-cluster.yaml"
# kubectl apply every time (what exists stays as it is). Right after clusterctl init, cainjector
# may not have put the webhooks' CA in place yet: retried.
wait_for "sample cluster applied (${DEV#"$ROOT"/}/sample-cluster.yaml)" 120 kc apply -f "$DEV/sample-cluster.yaml"
cp_ready() {
  [[ $(kc -n "$NS" get kvmmachines -l cluster.x-k8s.io/control-plane \
    -o 'jsonpath={.items[*].status.conditions[?(@.type=="BootstrapCompleted")].status}') == True ]]
}
wait_for "sample control-plane VM bootstrapped" 600 cp_ready
pod=$(kc -n "$NS" get kvmmachines -l cluster.x-k8s.io/control-plane -o 'jsonpath={.items[0].metadata.name}')
cat <<EOF

Sample cluster '$NAME' in namespace $NS: control-plane VM in Pod $pod.
  kubectl -n $NS get cluster,machines,kvmmachines,pods
  $BIN/clusterctl describe cluster $NAME -n $NS --kubeconfig $KUBECONFIG_ADMIN
  kubectl -n $NS logs $pod                 # the guest's console
  kubectl -n $NS exec $pod -- capk-launcher status
EOF
