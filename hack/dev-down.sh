#!/usr/bin/env bash
# Stops the local management cluster that hack/dev-up.sh started, in order: kubelet, the pods'
# containers and sandboxes, containerd, kube-proxy (and its iptables rules), our firewall chains and
# bridge, the control plane, etcd. Unmounts what the kubelet and containerd left under _output/dev
# and checks that nothing of ours is left (hack/dev/leftovers.sh). Idempotent.
#
#   make dev-down                      keep state (etcd, certificates, images): the next dev-up is warm
#   bash hack/dev-down.sh --purge      also delete _output/dev (built binaries in _output/bin stay)
#   CAPK_DEV_MC=2 bash hack/dev-down.sh   only the second management cluster (the first stops it
#                                         too, before itself); it leaves the first one's kube-proxy,
#                                         kubelet chains, firewall, bridge and sysctls alone
set -euo pipefail
# shellcheck source=dev/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/dev/lib.sh"
purge=false
[[ ${1:-} == --purge ]] && purge=true
[[ $(id -u) == 0 ]] || die "needs root"
# The second management cluster lives on the first one's bridge: it goes first.
if ((MC == 1)) && [[ -d $OUT/dev-mc2 ]]; then
  CAPK_DEV_MC=2 bash "${BASH_SOURCE[0]}" "$@"
fi
[[ -d $DEV ]] || { log "nothing to stop (no ${DEV#"$ROOT"/})"; exit 0; }

stop_daemon kubelet 30

# Containers and sandboxes: kill every task in containerd's k8s.io namespace, then remove the
# containers (and their snapshots). CRI's own sandbox records are containerd containers too.
if pid_alive containerd && ctr --address "$CONTAINERD_SOCK" version >/dev/null 2>&1; then
  for id in $(ctr_k8s tasks ls -q 2>/dev/null); do
    ctr_k8s tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true
  done
  for id in $(ctr_k8s tasks ls -q 2>/dev/null); do
    for _ in 1 2 3 4 5 6 7 8 9 10; do
      ctr_k8s tasks delete "$id" >/dev/null 2>&1 && break
      sleep 0.3
    done
  done
  n=0
  for id in $(ctr_k8s containers ls -q 2>/dev/null); do
    if ctr_k8s containers delete "$id" >/dev/null 2>&1; then n=$((n + 1)); else log "could not delete container $id"; fi
  done
  log "removed $n containers"
fi
stop_daemon containerd 30

# Shims of ours that outlived containerd (their command line names our socket).
for pid in $(pgrep -f containerd-shim-runc-v2 || true); do
  if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$CONTAINERD_SOCK"; then
    log "killing leftover shim $pid"
    kill -KILL "$pid" 2>/dev/null || true
  fi
done

if ((MC == 2)); then
  # What the second cluster added to the host's firewall: its DNAT chain and its service range's rule.
  while iptables -w -t nat -D PREROUTING -j "$NAT_CHAIN_MC2" 2>/dev/null; do :; done
  iptables -w -t nat -F "$NAT_CHAIN_MC2" 2>/dev/null || true
  iptables -w -t nat -X "$NAT_CHAIN_MC2" 2>/dev/null || true
  while iptables -w -D "$FW_CHAIN_INPUT" -d "$SERVICE_CIDR" -j DROP 2>/dev/null; do :; done
  ip route del "$SERVICE_CIDR" dev "$BRIDGE" 2>/dev/null || true
else
stop_daemon kube-proxy
if [[ -x $BIN/kube-proxy ]]; then
  "$BIN/kube-proxy" --cleanup >>"$LOGS/kube-proxy-cleanup.log" 2>&1 || log "kube-proxy --cleanup failed (see logs/kube-proxy-cleanup.log)"
fi

# The kubelet's own chains (KUBE-FIREWALL, its canary, the iptables-mode hint), IPv4 and IPv6; kube-proxy --cleanup
# leaves them. Nothing else on this machine runs a kubelet.
for ipt in iptables ip6tables; do
  for table in filter nat mangle; do
    for chain in KUBE-FIREWALL KUBE-KUBELET-CANARY KUBE-IPTABLES-HINT; do
      "$ipt" -w -t "$table" -S "$chain" >/dev/null 2>&1 || continue
      { "$ipt" -w -t "$table" -S | grep -E -- "-j $chain( |\$)" || true; } | sed 's/^-A /-D /' | while read -r rule; do
        # shellcheck disable=SC2086 # the rule is iptables' own -S output, one word per argument
        "$ipt" -w -t "$table" $rule 2>/dev/null || true
      done
      "$ipt" -w -t "$table" -F "$chain" 2>/dev/null || true
      "$ipt" -w -t "$table" -X "$chain" 2>/dev/null || true
    done
  done
done

# Our firewall chains.
for hook_chain in "FORWARD:$FW_CHAIN_FORWARD" "INPUT:$FW_CHAIN_INPUT"; do
  hook=${hook_chain%%:*} chain=${hook_chain#*:}
  while iptables -w -D "$hook" -j "$chain" 2>/dev/null; do :; done
  iptables -w -F "$chain" 2>/dev/null || true
  iptables -w -X "$chain" 2>/dev/null || true
done
fi

# Unmount what pods left (netns, shm, tokens, rootfs) under _output/dev, deepest first.
awk -v d="$DEV/" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r | while read -r m; do
  umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || log "could not unmount $m"
done

stop_daemon kube-scheduler
stop_daemon kube-controller-manager
stop_daemon kube-apiserver 30
stop_daemon etcd 30

# After the control plane: the apiserver talks to itself on the bridge's address until it stops.
if ((MC == 2)); then
  ip addr del "$NODE_IP/${POD_CIDR#*/}" dev "$BRIDGE" 2>/dev/null || true
  rm -rf "$DEV/cni/ipam"
else
# The bridge (veth ends went with their network namespaces) and the pods' IP allocations.
for v in $(ip -o link show master "$BRIDGE" 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1); do
  ip link delete "$v" 2>/dev/null || true
done
if ip link show "$BRIDGE" >/dev/null 2>&1; then
  ip link delete "$BRIDGE"
  log "bridge $BRIDGE deleted"
fi
rm -rf "$DEV/cni/ipam"
# The host's sysctls as they were before the first dev-up.
for s in net.ipv4.ip_forward net.bridge.bridge-nf-call-iptables; do
  f=$RUN/${s##*.}.orig
  [[ -f $f ]] || continue
  sysctl -qw "$s=$(<"$f")"
  rm -f "$f"
done
fi

# The kubelet's (cgroupfs driver) pod cgroups, empty by now: deepest first (the second
# cluster's with their root).
pods_cgroup=kubepods
((MC == 1)) || pods_cgroup=${CGROUP_ROOT#/}
for h in /sys/fs/cgroup/*/; do
  [[ -d $h$pods_cgroup ]] || continue
  find "$h$pods_cgroup" -depth -type d -exec rmdir {} + 2>/dev/null || true
done

# Paths outside _output/dev that the kubelet and containerd hard-code: the device-plugin socket
# (not under --root-dir) and runc's/the shims' state. Removed only when nothing else is in them.
((MC == 2)) || rm -f /var/lib/kubelet/device-plugins/kubelet.sock
for d in /var/lib/kubelet/device-plugins /var/lib/kubelet /run/containerd/runc/k8s.io /run/containerd/runc /run/containerd/s /run/containerd; do
  if [[ -d $d ]]; then rmdir "$d" 2>/dev/null || true; fi
done

# Nothing of ours may be left running.
# shellcheck disable=SC2009 # ps: the whole command line is shown and matched as fixed strings
left=$(ps -eo pid=,args= | grep -F -e "$DEV/" -e "$CONTAINERD_SOCK" | grep -v -e grep -e "hack/dev-down.sh" || true)
if [[ -n $left ]]; then
  log "processes left behind:"
  echo "$left" >&2
  exit 1
fi

if $purge; then
  rm -rf "$DEV"
  log "removed ${DEV#"$ROOT"/}"
fi
# Nor anything else of it (mounts, bridge, namespaces, iptables rules, pod cgroups), once both
# clusters are down.
((MC == 2)) || bash "$ROOT/hack/dev/leftovers.sh"
log "local management cluster $NODE_NAME is down"
