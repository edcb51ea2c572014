#!/usr/bin/env bash
# The sample workload cluster of `make dev-up`, in namespace capk-sample. Idempotent (kubectl apply;
# what exists stays as it is).
#
#   CAPK_DEV_SAMPLE=real (default)  a real workload cluster: `clusterctl generate cluster sample
#       --flavor node-image` with the node image of `make node-image`, one control plane and one
#       worker of 1 vCPU each (2560Mi and 1536Mi of guest memory: what kubeadm and the static Pods
#       need, checked against the host's free memory first). Waits until both Nodes are Ready with
#       the CNI and CoreDNS running, writes the workload kubeconfig to _output/dev/sample.kubeconfig
#       and prints its `kubectl get nodes`. Every wait prints one line per boot step it sees (from
#       the machine's console and conditions) with the time since it began, and a line a minute.
#   CAPK_DEV_SAMPLE=stub            the stand-in: `--flavor ignition` with the test guest, one
#       control-plane VM whose kubeadm only records its arguments (no Node registers), ready in a
#       minute or two.
#   CAPK_DEV_SAMPLE=0               no sample (make e2e and make check do that): one an earlier
#       `make dev-up` made is deleted, since its VMs would take the cores the journeys need.
#
# The sample's machine Pods and control-plane Service live in the MC's machine namespace (what its
# KVMCluster's status.machineNamespace records; capk-machines as shipped), not in capk-sample.
#
#   kubectl delete cluster -n capk-sample sample     removes it
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck source=../versions.env
source "$ROOT/hack/versions.env"
LOG_NAME=sample
NS=capk-sample
NAME=sample
# The controller's machine namespace as shipped (CAPK_MACHINE_NAMESPACE), for a sample whose
# KVMCluster has not recorded its own yet.
MACHINE_NS_DEFAULT=capk-machines
MODE=${CAPK_DEV_SAMPLE:-real}
[[ $MODE == 1 ]] && MODE=real
CONFIG=$DEV/clusterctl/clusterctl.yaml
SAMPLE_KUBECONFIG=$DEV/sample.kubeconfig
# Guest memory of the real sample's machines (MiB), and what each machine Pod adds (QEMU, the
# launcher; docs/benchmarks.md): the host needs this much free memory besides the MC.
CP_MIB=2560
WORKER_MIB=1536
POD_OVERHEAD_MIB=400
# The longest any step may take on an emulated (TCG) node on the reference machine of
# hack/calibrate-host.sh (kubeadm init took 268 s there, and 896 s on a slower machine of the same
# kind), scaled below by this host's calibration ratio when it is slower.
STEP_TIMEOUT=$((45 * 60))
[[ -f $CONFIG ]] || die "${CONFIG#"$ROOT"/} missing: run hack/dev/capi.sh first"

case $MODE in
  real | stub) ;;
  0)
    if kc -n "$NS" get cluster "$NAME" >/dev/null 2>&1; then
      log "CAPK_DEV_SAMPLE=0: deleting the sample cluster an earlier make dev-up made (its VMs would take the cores)"
      kc -n "$NS" delete cluster "$NAME" --timeout=600s >/dev/null ||
        die "the sample did not go within 600s: kubectl -n $NS get cluster,machines,kvmmachines -o wide"
    fi
    rm -f "$DEV/sample.env"
    exit 0
    ;;
  *) die "CAPK_DEV_SAMPLE must be real (default), stub or 0, not '$MODE'" ;;
esac
kc get namespace "$NS" >/dev/null 2>&1 || kc create namespace "$NS" >/dev/null

# $DEV/sample.env records how the sample was made: SAMPLE_MODE when it was applied, then
# SAMPLE_CP and SAMPLE_CP_IP once its control plane is up (real only). A sample of the other mode
# (or of no record) is deleted first: the two flavors' objects cannot be applied over each other.
SAMPLE_ENV=$DEV/sample.env
SAMPLE_MODE="" SAMPLE_CP="" SAMPLE_CP_IP=""
if kc -n "$NS" get cluster "$NAME" >/dev/null 2>&1; then
  # shellcheck disable=SC1090
  [[ ! -f $SAMPLE_ENV ]] || source "$SAMPLE_ENV"
  if [[ $SAMPLE_MODE != "$MODE" ]]; then
    log "the sample was made as '${SAMPLE_MODE:-unrecorded}', not '$MODE': deleting it to make it again"
    kc -n "$NS" delete cluster "$NAME" --timeout=600s >/dev/null ||
      die "the old sample did not go within 600s: kubectl -n $NS get cluster,machines,kvmmachines -o wide"
    rm -f "$SAMPLE_ENV"
    SAMPLE_MODE="" SAMPLE_CP="" SAMPLE_CP_IP=""
  fi
fi

generate() { # FLAVOR WORKERS [VAR=VALUE...]: clusterctl's manifest of the sample on stdout
  local flavor=$1 workers=$2
  shift 2
  env CLUSTERCTL_DISABLE_VERSIONCHECK=true "$@" \
    "$BIN/clusterctl" generate cluster "$NAME" --config "$CONFIG" --kubeconfig "$KUBECONFIG_ADMIN" \
    --infrastructure kvm --flavor "$flavor" --target-namespace "$NS" \
    --kubernetes-version "$KUBERNETES_VERSION" --control-plane-machine-count 1 --worker-machine-count "$workers"
}
# Right after clusterctl init, cainjector may not have put the webhooks' CA in place yet: retried.
apply() { wait_for "sample cluster applied (${1#"$ROOT"/})" 120 kc apply -f "$1"; }

# progress WHAT PROBE STEP: waits until PROBE succeeds (at most STEP_TIMEOUT), logging STEP's
# output (the furthest step reached) whenever it changes and once a minute otherwise.
progress() {
  local what=$1 probe=$2 step_of=$3 start=$SECONDS last="" step said=$SECONDS
  until "$probe" >/dev/null 2>&1; do
    ((SECONDS - start < STEP_TIMEOUT)) ||
      die "timed out after ${STEP_TIMEOUT}s waiting for $what (last: $last); see kubectl -n $NS get cluster,machines,kvmmachines -o wide (each machine's Pod namespace and Pod) and kubectl -n <pod namespace> logs <pod> -c launcher"
    step=$("$step_of" 2>/dev/null || true)
    if [[ $step != "$last" ]]; then
      log "$what: $step ($((SECONDS - start))s)"
      last=$step
      said=$SECONDS
    elif ((SECONDS - said >= 60)); then
      log "$what: still $step ($((SECONDS - start))s)"
      said=$SECONDS
    fi
    sleep 5
  done
  log "$what: ok after $((SECONDS - start))s"
}

# The MC namespace of the sample's machine Pods and control-plane Service: what its KVMCluster
# recorded (status.machineNamespace), else the shipped default.
machine_ns() {
  local ns
  ns=$(kc -n "$NS" get kvmcluster "$NAME" -o 'jsonpath={.status.machineNamespace}' 2>/dev/null || true)
  echo "${ns:-$MACHINE_NS_DEFAULT}"
}

# machine_pod KVMMACHINE: its machine Pod as NAMESPACE/NAME, where the KVMMachine's status says
# (status.podNamespace, status.podName); nothing while it names none.
machine_pod() {
  local at
  [[ -n $1 ]] || return 0
  at=$(kc -n "$NS" get kvmmachine "$1" -o 'jsonpath={.status.podNamespace}/{.status.podName}' 2>/dev/null) || return 0
  [[ $at != */ ]] || return 0
  [[ $at != /* ]] || at=$(machine_ns)$at
  echo "$at"
}

# pod_ip KVMMACHINE: its machine Pod's IP (the VM's); nothing while it has none.
pod_ip() {
  local pod
  pod=$(machine_pod "$1")
  [[ -n $pod ]] || return 0
  kc -n "${pod%%/*}" get pod "${pod#*/}" -o 'jsonpath={.status.podIP}' 2>/dev/null || true
}

# The furthest boot step the console (kubectl logs) of machine Pod $1 (NAMESPACE/NAME) shows.
console_step() {
  local pod=$1 console
  [[ -n $pod ]] || { echo "waiting for the machine Pod"; return; }
  local pod_ns=${pod%%/*} pod_name=${pod#*/}
  # systemd colours its status lines: the escape sequences go before matching.
  if ! console=$(kc -n "$pod_ns" logs "$pod_name" -c launcher 2>/dev/null | sed -E $'s/\x1b\\[[0-9;]*[A-Za-z]//g'); then
    local phase waiting
    phase=$(kc -n "$pod_ns" get pod "$pod_name" -o 'jsonpath={.status.phase}' 2>/dev/null || echo absent)
    # Why a container waits, when it is not just being created (an image the kubelet cannot
    # find is never pulled here: nothing on this MC has a registry).
    waiting=$(kc -n "$pod_ns" get pod "$pod_name" -o 'jsonpath={range .status.initContainerStatuses[*]}{.name}: {.state.waiting.reason} {"\n"}{end}{range .status.containerStatuses[*]}{.name}: {.state.waiting.reason} {"\n"}{end}' 2>/dev/null |
      grep -Ev ': (PodInitializing|ContainerCreating)? $' | grep -E ': [A-Za-z]+ $' | tr '\n' ';' || true)
    case $waiting in
      *ImagePull* | *ErrImage*)
        echo "machine Pod $pod starting ($phase; ${waiting% ;}: an image is gone from the MC's containerd; the kubelet deletes images when free disk falls below 2 %: df -h, free space, make dev-up imports them again)" ;;
      ?*) echo "machine Pod $pod starting ($phase; ${waiting% ;})" ;;
      *) echo "machine Pod $pod starting ($phase)" ;;
    esac
    return
  fi
  local step="launcher started, QEMU starting"
  grep -q 'SYSLINUX' <<<"$console" && step="firmware and bootloader"
  grep -q 'Linux version' <<<"$console" && step="kernel booting, Ignition"
  grep -q -- '- Ignition Complete.' <<<"$console" && step="Ignition done, root filesystem and images"
  grep -q 'Finished capk-preload-imag' <<<"$console" && step="images loaded, kubeadm running"
  grep -Eq 'Finished (capk-runcmd|kubeadm.service)' <<<"$console" && step="kubeadm done, Node starting"
  echo "$pod: $step"
}

cp_machine() { kc -n "$NS" get kvmmachines -l cluster.x-k8s.io/control-plane -o 'jsonpath={.items[0].metadata.name}'; }
cp_bootstrapped() {
  [[ $(kc -n "$NS" get kvmmachines -l cluster.x-k8s.io/control-plane \
    -o 'jsonpath={.items[*].status.conditions[?(@.type=="BootstrapCompleted")].status}') == True ]]
}

# machine_commands POD KUBECTL: what shows the machine Pod POD (NAMESPACE/NAME), and any other, for
# the user to run as KUBECTL: the sample's machine Pods, a console and the launcher's status.
machine_commands() {
  local pod_ns=${1%%/*} pod_name=${1#*/} k=$2
  cat <<EOF
  $k -n $pod_ns get pods -l infrastructure.cluster.x-k8s.io/owner-namespace=$NS
  $k -n $pod_ns logs -f $pod_name -c launcher      # a machine's console
  $k -n $pod_ns exec $pod_name -c launcher -- capk-launcher status
  # any machine's console, where its KVMMachine M says its Pod is:
  $k -n \$($k -n $NS get kvmmachine M -o jsonpath='{.status.podNamespace}') logs \$($k -n $NS get kvmmachine M -o jsonpath='{.status.podName}') -c launcher
EOF
}

if [[ $MODE == stub ]]; then
  generate ignition 0 \
    CONTROL_PLANE_MACHINE_CPUS=1 CONTROL_PLANE_MACHINE_MEMORY=256Mi \
    CONTROL_PLANE_VOLUME_SIZE_GB=1 CONTROL_PLANE_DOCKER_VOLUME_SIZE_GB=1 \
    WORKER_MACHINE_CPUS=1 WORKER_MACHINE_MEMORY=256Mi VOLUME_SIZE_GB=1 DOCKER_VOLUME_SIZE_GB=1 \
    >"$DEV/sample-cluster.yaml"
  echo "SAMPLE_MODE=stub" >"$SAMPLE_ENV"
  apply "$DEV/sample-cluster.yaml"
  wait_for "stand-in control-plane VM bootstrapped" 600 cp_bootstrapped
  pod=$(machine_pod "$(cp_machine)")
  cat <<EOF

Stand-in sample cluster '$NAME' in namespace $NS (CAPK_DEV_SAMPLE=stub): its control-plane VM, in Pod
$pod, boots the test guest, whose kubeadm only records its arguments: no Node registers.
  kubectl -n $NS get cluster,machines,kvmmachines -o wide
$(machine_commands "$pod" kubectl)
  kubectl -n $NS delete cluster $NAME      # removes it
EOF
  exit 0
fi

# --- the real sample ---------------------------------------------------------------------------------
NODE_ENV=$DEV/node-image.env
[[ -f $NODE_ENV ]] || die "${NODE_ENV#"$ROOT"/} missing: the real sample needs the node image in the MC (hack/dev/node-image.sh; not with CAPK_DEV_NODE_IMAGE=0), or use CAPK_DEV_SAMPLE=stub"
# shellcheck disable=SC1090
source "$NODE_ENV"
[[ -n ${CAPK_NODE_IMAGE:-} ]] || die "${NODE_ENV#"$ROOT"/} names no CAPK_NODE_IMAGE: rerun hack/dev/node-image.sh"

# Each machine Pod copies the node image into the node's image cache once, and its disks grow as
# the guest writes.
require_disk 8 "the sample's machines"

# This host's emulation speed against the reference machine, printed, and the waits scaled by it.
bash "$ROOT/hack/calibrate-host.sh" >&2 || die "the host calibration failed (above): bash hack/calibrate-host.sh"
# shellcheck disable=SC1091
source "$OUT/calibration.env"
STEP_TIMEOUT=$(awk -v t="$STEP_TIMEOUT" -v r="${CAPK_TCG_CALIBRATION_RATIO:-1}" 'BEGIN {print int(t * (r > 1 ? r : 1))}')

vars=(
  KVM_NODE_IMAGE="$CAPK_NODE_IMAGE"
  CONTROL_PLANE_MACHINE_CPUS=1 CONTROL_PLANE_MACHINE_MEMORY="${CP_MIB}Mi"
  CONTROL_PLANE_VOLUME_SIZE_GB=8 CONTROL_PLANE_DOCKER_VOLUME_SIZE_GB=4
  WORKER_MACHINE_CPUS=1 WORKER_MACHINE_MEMORY="${WORKER_MIB}Mi" VOLUME_SIZE_GB=8 DOCKER_VOLUME_SIZE_GB=4
  # Emulated control planes renew leases and answer health checks slowly; these are the values
  # make e2e's workload journey runs with (tests/tests/e2e/workload.rs says why each).
  KUBE_LEADER_ELECT_LEASE_DURATION=120s KUBE_LEADER_ELECT_RENEW_DEADLINE=90s KUBE_LEADER_ELECT_RETRY_PERIOD=10s
  KUBE_LIVENESS_FAILURE_THRESHOLD=30 KUBE_ETCD_CPU_REQUEST=250m
)
generate node-image 1 "${vars[@]}" >"$DEV/sample-cluster.yaml"

# A control plane outlives `make dev-down` only on its Pod IP: when the MC comes back, the kubelet
# makes the machine Pods' sandboxes again, with new IPs, and the VM takes the new one while the
# guest's etcd and certificates name the old (its apiserver never answers again). The IP the
# control plane was made with is recorded; a sample whose control plane lost it is made again.
if [[ -n $SAMPLE_CP ]] && kc -n "$NS" get cluster "$NAME" >/dev/null 2>&1; then
  now_ip=$(pod_ip "$SAMPLE_CP")
  if [[ -n $now_ip && $now_ip != "$SAMPLE_CP_IP" ]]; then
    log "the sample's control plane $SAMPLE_CP came back on Pod IP $now_ip, not $SAMPLE_CP_IP (the MC restarted its sandbox); its etcd and certificates name the old IP: deleting the sample to make it again"
    kc -n "$NS" delete cluster "$NAME" --timeout=600s >/dev/null ||
      die "the old sample did not go within 600s: kubectl -n $NS get cluster,machines,kvmmachines -o wide"
    rm -f "$SAMPLE_ENV"
    SAMPLE_CP=""
  fi
fi

started=$SECONDS
if ! kc -n "$NS" get cluster "$NAME" >/dev/null 2>&1; then
  # A new sample: enough free memory for both VMs, then the control plane alone; the worker
  # comes once kubeadm init is done (two emulated VMs booting at once starve the control plane
  # on 2 cores, and kubeadm's API calls time out).
  avail=$(awk '/^MemAvailable:/ {print int($2 / 1024)}' /proc/meminfo)
  need=$((CP_MIB + WORKER_MIB + 2 * POD_OVERHEAD_MIB + 1024))
  ((avail >= need)) ||
    die "the sample's two VMs need about ${need} MiB free and this machine has ${avail} MiB available: free memory, or CAPK_DEV_SAMPLE=stub make dev-up (the stand-in guest, 256 MiB)"
  log "a real workload cluster: 1 control plane (${CP_MIB}Mi) then 1 worker (${WORKER_MIB}Mi), node image $CAPK_NODE_IMAGE"
  generate node-image 0 "${vars[@]}" >"$DEV/sample-control-plane.yaml"
  echo "SAMPLE_MODE=real" >"$SAMPLE_ENV"
  apply "$DEV/sample-control-plane.yaml"
fi

cp_step() { console_step "$(machine_pod "$(cp_machine)")"; }
progress "control plane: kubeadm init" cp_bootstrapped cp_step
if [[ -z $SAMPLE_CP ]]; then
  cp=$(cp_machine)
  printf 'SAMPLE_MODE=real\nSAMPLE_CP=%s\nSAMPLE_CP_IP=%s\n' "$cp" "$(pod_ip "$cp")" >"$SAMPLE_ENV"
fi
apply "$DEV/sample-cluster.yaml"

# The workload kubeconfig, for this machine: the control-plane Service's ClusterIP (kube-proxy runs
# here; the Service is in the machine namespace, labelled with its cluster and owner namespace),
# with the certificate's name kept for TLS.
write_kubeconfig() {
  local ip host tmp
  ip=$(kc -n "$(machine_ns)" get services \
    -l "cluster.x-k8s.io/cluster-name=$NAME,infrastructure.cluster.x-k8s.io/owner-namespace=$NS" \
    -o 'jsonpath={.items[*].spec.clusterIP}')
  [[ $ip != *" "* ]] || return 1
  [[ -n $ip ]] || return 1
  tmp=$(mktemp "$DEV/sample.kubeconfig.XXXXXX")
  chmod 600 "$tmp"
  kc -n "$NS" get secret "$NAME-kubeconfig" -o 'jsonpath={.data.value}' | base64 -d >"$tmp"
  # This MC's kubectl: a fresh machine has no other.
  host=$("$BIN/kubectl" --kubeconfig "$tmp" config view -o 'jsonpath={.clusters[0].cluster.server}' | sed -E 's#^https://##; s#:[0-9]+$##')
  [[ -n $host ]] || return 1
  "$BIN/kubectl" --kubeconfig "$tmp" config set-cluster "$NAME" --server "https://$ip:6443" --tls-server-name "$host" >/dev/null || return 1
  mv "$tmp" "$SAMPLE_KUBECONFIG"
}
wait_for "workload kubeconfig written to ${SAMPLE_KUBECONFIG#"$ROOT"/}" 300 write_kubeconfig
wk() { "$BIN/kubectl" --kubeconfig "$SAMPLE_KUBECONFIG" --request-timeout=30s "$@"; }

worker_machine() { kc -n "$NS" get kvmmachines -l '!cluster.x-k8s.io/control-plane' -o 'jsonpath={.items[0].metadata.name}'; }
ready_nodes() {
  local states
  states=$(wk get nodes -o 'jsonpath={range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}') || return 1
  grep -c '^True$' <<<"$states" || true
}
both_ready() { [[ $(ready_nodes) == 2 ]]; }
nodes_step() {
  local worker
  worker=$(worker_machine 2>/dev/null || true)
  echo "$(ready_nodes 2>/dev/null || echo 0) of 2 Nodes Ready; worker $(console_step "$(machine_pod "$worker")")"
}
progress "worker joined, both Nodes Ready (CNI)" both_ready nodes_step
coredns_ready() {
  local n
  n=$(wk -n kube-system get deployment coredns -o 'jsonpath={.status.readyReplicas}')
  ((${n:-0} >= 1))
}
coredns_step() { echo "CoreDNS $(wk -n kube-system get deployment coredns -o 'jsonpath={.status.readyReplicas}/{.spec.replicas}' 2>/dev/null || echo '?') ready"; }
progress "CoreDNS running" coredns_ready coredns_step
log "sample cluster ready in $((SECONDS - started))s"

cp=$(machine_pod "$(cp_machine)")
kubectl=${BIN#"$ROOT"/}/kubectl
admin="$kubectl --kubeconfig ${KUBECONFIG_ADMIN#"$ROOT"/}"
echo
wk get nodes -o wide
cat <<EOF

Sample cluster '$NAME' in namespace $NS: a real workload cluster (node image $CAPK_NODE_IMAGE).
  $kubectl --kubeconfig ${SAMPLE_KUBECONFIG#"$ROOT"/} get nodes,pods -A    # the workload cluster
  $admin -n $NS get cluster,machines,kvmmachines -o wide
$(machine_commands "$cp" "$admin")
  $admin -n $NS delete cluster $NAME   # deletes it
EOF
