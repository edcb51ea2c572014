#!/usr/bin/env bash
# The local management cluster: one node, no Docker, no registry
# (docs/local-management-cluster.md).
#
#   make dev-up      (or: bash hack/dev-up.sh)        then: export KUBECONFIG=_output/dev/admin.kubeconfig
#   make dev-down    stops everything this started
#
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler, Debian's containerd (CRI v1) with a
# locally built pause image, kubelet (cgroupfs, cgroup v1, image GC off), a bridge CNI and
# kube-proxy (iptables mode), all as background processes with pid files in _output/dev/run and
# logs in _output/dev/logs. Idempotent: what runs already is left alone; state (etcd, certificates)
# is kept across dev-down/dev-up. Then (unless CAPK_DEV_PROVIDERS=0) the images of this provider,
# Cluster API and cert-manager built here (hack/dev/images.sh, hack/dev/cert-manager.sh), the real
# `clusterctl init` of Cluster API and CAPK from a local repository (hack/dev/capi.sh), and a sample
# workload cluster of the node image with two Ready Nodes (hack/dev/sample.sh; CAPK_DEV_SAMPLE=stub:
# the stand-in test guest instead, CAPK_DEV_SAMPLE=0: none).
# CAPK_DEV_VPA=1: metrics-server and the VerticalPodAutoscaler (hack/dev/vpa.sh);
# CAPK_DEV_MONITORING=1: Prometheus scraping the controller (hack/dev/monitoring.sh).
#
# Network: the apiserver and kubelet listen on the node bridge's address (capk0, 10.240.0.1), the
# rest on loopback. Pods get a default route to the node, as on any real cluster (kubeadm, the
# kubelet and flannel in a VM pick their address from it), but the CNI does no masquerading and
# iptables chains of our own drop anything forwarded off the bridge and anything arriving from
# outside for the pod or service ranges: nothing leaves this machine.
set -euo pipefail
# shellcheck source=dev/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/dev/lib.sh"
t0=$SECONDS

[[ $(id -u) == 0 ]] || die "needs root (containerd, kubelet, bridge and iptables)"
# A fresh machine: the Debian packages and a check of the toolchains, as .ci/run does.
bash "$ROOT/hack/install-packages.sh"
for tool in containerd containerd-shim-runc-v2 runc ctr catatonit iptables ip openssl; do
  command -v "$tool" >/dev/null || die "'$tool' not found after hack/install-packages.sh"
done
[[ -x /usr/lib/cni/bridge && -x /usr/lib/cni/host-local && -x /usr/lib/cni/loopback ]] ||
  die "CNI plugins missing in /usr/lib/cni: apt-get install containernetworking-plugins"

# What a run adds besides its builds (images, etcd, the VMs' disk overlays) is a few GiB.
require_disk 4 "the local MC"

# --- binaries -------------------------------------------------------------------------------------
bash "$ROOT/hack/build-upstream.sh" etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl

mkdir -p "$DEV" "$RUN" "$LOGS"
bash "$ROOT/hack/dev/pki.sh"

# --- host network: the node bridge and our firewall chains -----------------------------------------
if ((MC == 2)); then
  # The second management cluster's node: an address of its own on the first's bridge, whose
  # firewall chains already keep pod traffic on this machine (10.240.1.0/24 is in the cluster
  # range they guard), and its `kubernetes` Service sent to its apiserver (no kube-proxy here).
  { ip link show "$BRIDGE" >/dev/null 2>&1 && iptables -w -S "$FW_CHAIN_FORWARD" >/dev/null 2>&1; } ||
    die "the first local management cluster is not up (no bridge $BRIDGE or chain $FW_CHAIN_FORWARD): make dev-up first"
  ip addr show dev "$BRIDGE" | grep -q "inet $NODE_IP/" || ip addr add "$NODE_IP/${POD_CIDR#*/}" dev "$BRIDGE"
  iptables -w -t nat -N "$NAT_CHAIN_MC2" 2>/dev/null || iptables -w -t nat -F "$NAT_CHAIN_MC2"
  iptables -w -t nat -A "$NAT_CHAIN_MC2" -i "$BRIDGE" -d "$KUBERNETES_SVC_IP/32" -p tcp --dport 443 \
    -j DNAT --to-destination "$NODE_IP:$APISERVER_PORT"
  iptables -w -t nat -C PREROUTING -j "$NAT_CHAIN_MC2" 2>/dev/null || iptables -w -t nat -I PREROUTING 1 -j "$NAT_CHAIN_MC2"
  iptables -w -C "$FW_CHAIN_INPUT" -d "$SERVICE_CIDR" -j DROP 2>/dev/null ||
    iptables -w -A "$FW_CHAIN_INPUT" -d "$SERVICE_CIDR" -j DROP
  # Its Service range on the bridge, as the first's (below).
  ip route replace "$SERVICE_CIDR" dev "$BRIDGE" src "$NODE_IP"
else
# Remember the host's forwarding setting once, so dev-down can restore it.
[[ -f $RUN/ip_forward.orig ]] || cat /proc/sys/net/ipv4/ip_forward >"$RUN/ip_forward.orig"
modprobe br_netfilter 2>/dev/null || true
[[ -f $RUN/bridge-nf-call-iptables.orig ]] || cat /proc/sys/net/bridge/bridge-nf-call-iptables >"$RUN/bridge-nf-call-iptables.orig"
if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
  ip link add "$BRIDGE" type bridge
  log "bridge $BRIDGE created"
fi
ip addr show dev "$BRIDGE" | grep -q "inet $NODE_IP/" || ip addr add "$NODE_IP/${POD_CIDR#*/}" dev "$BRIDGE"
ip link set "$BRIDGE" up
sysctl -qw "net.ipv6.conf.$BRIDGE.disable_ipv6=1" 2>/dev/null || true
# The Service range is routed onto the bridge, so that what this machine sends to a ClusterIP that
# kube-proxy has no rule for yet stays here (unanswered) instead of following the default route
# out of the machine, where whatever answers would keep a kept-alive connection (the apiserver's
# to a just-created APIService) from ever meeting the DNAT rule that comes a second later. The
# route goes with the bridge.
ip route replace "$SERVICE_CIDR" dev "$BRIDGE" src "$NODE_IP"

fw_chain() { # CHAIN HOOK: (re)create our chain and hook it first into HOOK
  iptables -w -N "$1" 2>/dev/null || iptables -w -F "$1"
  iptables -w -C "$2" -j "$1" 2>/dev/null || iptables -w -I "$2" 1 -j "$1"
}
# Forwarding: only bridge-to-bridge (pod <-> pod, service DNAT to a pod). Nothing leaves the bridge.
fw_chain "$FW_CHAIN_FORWARD" FORWARD
iptables -w -A "$FW_CHAIN_FORWARD" -i "$BRIDGE" -o "$BRIDGE" -j RETURN
iptables -w -A "$FW_CHAIN_FORWARD" -s "$CLUSTER_CIDR" -j DROP
iptables -w -A "$FW_CHAIN_FORWARD" -d "$CLUSTER_CIDR" -j DROP
iptables -w -A "$FW_CHAIN_FORWARD" -i "$BRIDGE" -j DROP
iptables -w -A "$FW_CHAIN_FORWARD" -o "$BRIDGE" -j DROP
# Input: the node IP (apiserver, kubelet) and the service range answer only loopback and the bridge.
fw_chain "$FW_CHAIN_INPUT" INPUT
iptables -w -A "$FW_CHAIN_INPUT" -i lo -j RETURN
iptables -w -A "$FW_CHAIN_INPUT" -i "$BRIDGE" -j RETURN
iptables -w -A "$FW_CHAIN_INPUT" -d "$CLUSTER_CIDR" -j DROP
iptables -w -A "$FW_CHAIN_INPUT" -d "$SERVICE_CIDR" -j DROP
# Service traffic between pods on the bridge must pass iptables (kube-proxy DNAT) and be routed
# back onto the bridge; the chains above keep that forwarding on the bridge.
sysctl -qw net.bridge.bridge-nf-call-iptables=1
sysctl -qw net.ipv4.ip_forward=1
fi

# The second cluster has no kube-proxy: its apiserver calls admission and conversion webhooks at
# their endpoints instead of their ClusterIPs.
AGGREGATOR_ROUTING=
((MC == 1)) || AGGREGATOR_ROUTING=1

# Every daemon below runs under capk-supervise.
build_supervisor

# --- etcd and the control plane -----------------------------------------------------------------
start_etcd() {
  start_daemon etcd "$DEV/etcd" "$BIN/etcd" --name=capk-dev --data-dir="$DEV/etcd" \
    --listen-client-urls="http://127.0.0.1:$ETCD_CLIENT_PORT" --advertise-client-urls="http://127.0.0.1:$ETCD_CLIENT_PORT" \
    --listen-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster="capk-dev=http://127.0.0.1:$ETCD_PEER_PORT" --log-level=warn --unsafe-no-fsync
}
serve etcd 60 start_etcd curl -fsS "http://127.0.0.1:$ETCD_CLIENT_PORT/health"

start_apiserver() {
  start_daemon kube-apiserver "--cert-dir=$DEV/apiserver" "$BIN/kube-apiserver" \
    --cert-dir="$DEV/apiserver" \
    --etcd-servers="http://127.0.0.1:$ETCD_CLIENT_PORT" \
    --bind-address="$NODE_IP" --advertise-address="$NODE_IP" --secure-port="$APISERVER_PORT" \
    --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
    --client-ca-file="$PKI/ca.crt" \
    --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" --kubelet-client-key="$PKI/apiserver-kubelet-client.key" \
    --kubelet-preferred-address-types=InternalIP \
    --service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-cluster-ip-range="$SERVICE_CIDR" \
    --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \
    --allow-privileged=true --profiling=false --v=1 \
    --requestheader-client-ca-file="$PKI/front-proxy-ca.crt" --requestheader-allowed-names=front-proxy-client \
    --requestheader-username-headers=X-Remote-User --requestheader-group-headers=X-Remote-Group \
    --requestheader-extra-headers-prefix=X-Remote-Extra- \
    --proxy-client-cert-file="$PKI/front-proxy-client.crt" --proxy-client-key-file="$PKI/front-proxy-client.key" \
    ${AGGREGATOR_ROUTING:+--enable-aggregator-routing=true}
}
# The aggregation layer's front proxy (requestheader and proxy-client flags, as kubeadm sets them),
# for aggregated APIs such as metrics-server's (hack/dev/vpa.sh). An apiserver started before
# dev-up had them is restarted with them.
apiserver_has_front_proxy() {
  local child
  child=$(cat "$RUN/kube-apiserver.child" 2>/dev/null) || return 1
  tr '\0' ' ' <"/proc/$child/cmdline" 2>/dev/null | grep -q -- --proxy-client-cert-file
}
if pid_alive kube-apiserver && ! apiserver_has_front_proxy; then
  log "kube-apiserver runs without the front proxy flags: restarting it"
  stop_daemon kube-apiserver 60
fi
serve kube-apiserver 120 start_apiserver kc get --raw /readyz

start_controller_manager() {
  start_daemon kube-controller-manager "--cert-dir=$DEV/controller-manager" "$BIN/kube-controller-manager" \
    --cert-dir="$DEV/controller-manager" \
    --kubeconfig="$DEV/controller-manager.kubeconfig" \
    --authentication-kubeconfig="$DEV/controller-manager.kubeconfig" --authorization-kubeconfig="$DEV/controller-manager.kubeconfig" \
    --bind-address=127.0.0.1 --leader-elect=false --use-service-account-credentials=true \
    --service-account-private-key-file="$PKI/sa.key" --root-ca-file="$PKI/ca.crt" \
    --cluster-signing-cert-file="$PKI/ca.crt" --cluster-signing-key-file="$PKI/ca.key" \
    --service-cluster-ip-range="$SERVICE_CIDR" --cluster-cidr="$CLUSTER_CIDR" --allocate-node-cidrs=false \
    --cluster-name="$NODE_NAME" --secure-port="$CONTROLLER_MANAGER_PORT" --profiling=false --v=1
}
serve kube-controller-manager 60 start_controller_manager curl -fsSk "https://127.0.0.1:$CONTROLLER_MANAGER_PORT/healthz"

start_scheduler() {
  start_daemon kube-scheduler "--kubeconfig=$DEV/scheduler.kubeconfig" "$BIN/kube-scheduler" \
    --kubeconfig="$DEV/scheduler.kubeconfig" \
    --authentication-kubeconfig="$DEV/scheduler.kubeconfig" --authorization-kubeconfig="$DEV/scheduler.kubeconfig" \
    --bind-address=127.0.0.1 --secure-port="$SCHEDULER_PORT" --leader-elect=false --profiling=false --v=1
}
serve kube-scheduler 60 start_scheduler curl -fsSk "https://127.0.0.1:$SCHEDULER_PORT/healthz"

# --- containerd ---------------------------------------------------------------------------------
mkdir -p "$DEV/containerd" "$DEV/cni/net.d" "$DEV/cni/ipam"
write_config "$DEV/containerd/config.toml" containerd <<EOF
# Generated by hack/dev-up.sh. Debian's containerd 1.6 (CRI v1), state under _output/dev.
version = 2
root = "$DEV/containerd/root"
state = "$DEV/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]

[grpc]
  address = "$CONTAINERD_SOCK"

[debug]
  level = "info"

[plugins."io.containerd.internal.v1.opt"]
  path = "$DEV/containerd/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  # Pod network namespaces under the state dir, not /var/run/netns (dev-down finds them there).
  netns_mounts_under_state_dir = true
  # This machine does not let root lower oom_score_adj (runc then fails with "can't get final
  # child's PID from pipe: EOF" for the sandbox's -998): clamp to containerd's own value.
  restrict_oom_score_adj = true
  max_container_log_line_size = 16384
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$DEV/cni/net.d"
    max_conf_num = 1
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "$DEV/containerd/certs.d"
EOF
# Bridge CNI: no masquerade; the default route leads to the node, whose chains above forward only
# bridge to bridge (pods reach their subnet, the node and services, nothing beyond).
# The second cluster's gateway is the bridge's second address, set above: the bridge plugin would
# refuse it ("already has an IP address different from"), so it only routes through it.
CNI_IS_GATEWAY=true
((MC == 1)) || CNI_IS_GATEWAY=false
write_config "$DEV/cni/net.d/10-capk-dev.conflist" containerd <<EOF
{
  "cniVersion": "1.0.0",
  "name": "$NODE_NAME",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$BRIDGE",
      "isGateway": $CNI_IS_GATEWAY,
      "isDefaultGateway": false,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "dataDir": "$DEV/cni/ipam",
        "ranges": [[{ "subnet": "$POD_CIDR", "gateway": "$NODE_IP" }]],
        "routes": [{ "dst": "0.0.0.0/0" }]
      }
    }
  ]
}
EOF
start_containerd() {
  start_daemon containerd "$DEV/containerd/config.toml" containerd --config "$DEV/containerd/config.toml"
}
serve containerd 60 start_containerd ctr --address "$CONTAINERD_SOCK" version
bash "$ROOT/hack/dev/pause-image.sh"

# --- kubelet --------------------------------------------------------------------------------------
mkdir -p "$DEV/kubelet" "$DEV/pod-logs"
printf 'nameserver %s\nsearch cluster.local\n' "$DNS_SVC_IP" | write_config "$DEV/resolv.conf" kubelet
write_config "$DEV/kubelet-config.yaml" kubelet <<EOF
# Generated by hack/dev-up.sh.
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $KUBELET_HEALTHZ_PORT
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI/ca.crt}
authorization: {mode: Webhook}
containerRuntimeEndpoint: unix://$CONTAINERD_SOCK
cgroupDriver: cgroupfs${CGROUP_ROOT:+
cgroupRoot: $CGROUP_ROOT}
# Kubernetes >= 1.35 refuses cgroup v1 unless told otherwise; this host is cgroup v1.
failCgroupV1: false
failSwapOn: false
# Image GC off: every image here is imported, none can be pulled back (containerd 1.6 cannot pin).
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
# A shared build machine: evict only when really out of space.
evictionHard: {memory.available: 100Mi, nodefs.available: 2%, nodefs.inodesFree: 2%, imagefs.available: 2%}
clusterDomain: cluster.local
clusterDNS: [$DNS_SVC_IP]
resolvConf: $DEV/resolv.conf
podCIDR: $POD_CIDR
podLogsDir: $DEV/pod-logs
serializeImagePulls: false
rotateCertificates: false
serverTLSBootstrap: false
EOF
# The second kubelet's cgroup root, in every v1 hierarchy (cpuset needs its CPUs and memory nodes).
if [[ -n $CGROUP_ROOT ]]; then
  for h in /sys/fs/cgroup/*/; do
    [[ -f ${h}cgroup.procs && $h != */unified/ ]] || continue
    mkdir -p "$h${CGROUP_ROOT#/}"
    if [[ -f ${h}cpuset.cpus ]]; then
      cp "${h}cpuset.cpus" "$h${CGROUP_ROOT#/}/cpuset.cpus"
      cp "${h}cpuset.mems" "$h${CGROUP_ROOT#/}/cpuset.mems"
    fi
  done
fi
start_kubelet() {
  start_daemon kubelet "--config=$DEV/kubelet-config.yaml" "$BIN/kubelet" \
    --config="$DEV/kubelet-config.yaml" --kubeconfig="$DEV/kubelet.kubeconfig" \
    --root-dir="$DEV/kubelet" --cert-dir="$DEV/kubelet/pki" \
    --hostname-override="$NODE_NAME" --node-ip="$NODE_IP" --v=1
}
serve kubelet 120 start_kubelet curl -fsS "http://127.0.0.1:$KUBELET_HEALTHZ_PORT/healthz"

# --- kube-proxy -----------------------------------------------------------------------------------
# The second cluster has none (see lib.sh): two would fight over the same iptables chains.
if ((MC == 1)); then
write_config "$DEV/kube-proxy-config.yaml" kube-proxy <<EOF
# Generated by hack/dev-up.sh.
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $DEV/kube-proxy.kubeconfig}
hostnameOverride: $NODE_NAME
mode: iptables
clusterCIDR: $CLUSTER_CIDR
bindAddress: 127.0.0.1
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
# NodePorts only on the node bridge, never on the uplink.
nodePortAddresses: [$NODE_IP/32]
iptables: {localhostNodePorts: false, masqueradeAll: false}
# Leave the host's conntrack sysctls alone.
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF
start_kube_proxy() {
  start_daemon kube-proxy "--config=$DEV/kube-proxy-config.yaml" "$BIN/kube-proxy" --config="$DEV/kube-proxy-config.yaml" --v=1
}
serve kube-proxy 60 start_kube_proxy curl -fsS http://127.0.0.1:10256/healthz
fi

# --- checks ---------------------------------------------------------------------------------------
node_ready() { [[ $(kc get node "$NODE_NAME" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}') == True ]]; }
wait_for "node $NODE_NAME Ready" 180 node_ready
wait_for "default service account" 60 kc -n default get serviceaccount default

# A fresh smoke pod each time, under a new name: a pod left from an earlier run may still show a
# stale Ready. Never the same name twice: when the scheduler's watch was down (kube-apiserver
# restarted) it misses the deletion, its relist then sees the old, bound pod "updated" into the new,
# unbound one of the same name, and kube-scheduler v1.35 takes that for a pod moved between nodes
# ("Scheduler cache is corrupted") and exits.
kc -n default delete pod -l app.kubernetes.io/name=capk-dev-smoke --ignore-not-found --grace-period=0 --force >/dev/null 2>&1 || true
smoke=capk-dev-smoke-$(date -u +%Y%m%d%H%M%S)
kc apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: $smoke
  namespace: default
  labels: {app.kubernetes.io/name: capk-dev-smoke}
spec:
  automountServiceAccountToken: false
  terminationGracePeriodSeconds: 1
  containers:
  - name: pause
    image: $PAUSE_IMAGE
    imagePullPolicy: Never
EOF
kc wait --for=condition=Ready "pod/$smoke" --timeout=120s >/dev/null || {
  kc describe pod "$smoke" >&2
  die "smoke pod did not become Ready"
}
pod_ip=$(kc get pod "$smoke" -o 'jsonpath={.status.podIP}')
log "smoke pod Running with IP $pod_ip"

# --- cluster DNS: CoreDNS behind kube-dns (10.96.0.10), the cluster domain only ------------------
((MC == 2)) || bash "$ROOT/hack/dev/coredns.sh"

# --- Cluster API, this provider, a sample cluster ----------------------------------------------------
# Images built here (never pulled), cert-manager, then the real `clusterctl init` from a local
# repository, then a sample workload cluster (a real one: both Nodes Ready). Each step skips what is
# done. CAPK_DEV_PROVIDERS=0: the bare cluster only; CAPK_DEV_SAMPLE=0: no sample cluster, =stub:
# the stand-in guest;
# CAPK_DEV_NODE_IMAGE=0: without the Kubernetes node image (make node-image) in containerd, which
# workload clusters of `--flavor node-image` boot (its name: _output/dev/node-image.env).
if [[ ${CAPK_DEV_PROVIDERS:-1} != 0 ]] && ((MC == 2)); then
  # The same managers as the first cluster, copied from its containerd; no VMs run here.
  bash "$ROOT/hack/dev/mc2-images.sh"
  bash "$ROOT/hack/dev/capi.sh" >/dev/null
elif [[ ${CAPK_DEV_PROVIDERS:-1} != 0 ]]; then
  bash "$ROOT/hack/dev/images.sh"
  bash "$ROOT/hack/dev/cert-manager.sh"
  bash "$ROOT/hack/dev/capi.sh" >/dev/null
  # Operating the provider: CAPK_DEV_VPA=1 adds metrics-server and the VPA's
  # recommender, updater and admission controller; CAPK_DEV_MONITORING=1 a Prometheus scraping the
  # controller. Unset, what an earlier run installed stays.
  [[ ${CAPK_DEV_VPA:-0} == 0 ]] || bash "$ROOT/hack/dev/vpa.sh"
  [[ ${CAPK_DEV_MONITORING:-0} == 0 ]] || bash "$ROOT/hack/dev/monitoring.sh"
  [[ ${CAPK_DEV_NODE_IMAGE:-1} == 0 ]] || bash "$ROOT/hack/dev/node-image.sh"
  # CAPK_DEV_SAMPLE=0 deletes a sample an earlier run made (the journeys need the cores).
  bash "$ROOT/hack/dev/sample.sh"
fi

cat <<EOF

Local management cluster is up in $((SECONDS - t0))s ($("$BIN/kube-apiserver" --version), node $NODE_NAME, pod IP $pod_ip).

  export KUBECONFIG=$KUBECONFIG_ADMIN
  $BIN/kubectl get nodes,pods -A

Logs: ${LOGS#"$ROOT"/}/   pid files: ${RUN#"$ROOT"/}/   stop: make dev-down
EOF
