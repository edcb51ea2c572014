#!/usr/bin/env bash
# What a local management cluster (hack/dev-up.sh, either MC) left on this machine after
# hack/dev-down.sh: prints each thing and exits 1 when there is any, so that `make dev-down` and the
# CI gate (hack/e2e-gate.sh) fail loudly instead of leaving it for the next run. Looks for:
#
#   - processes: any command line naming a local MC's directory (_output/dev*/) or its containerd
#     socket, and any process in the kubelet's pod cgroups (/kubepods, /capk-mc2: the machine Pods'
#     launchers and QEMUs);
#   - mounts under _output/dev*/ (the pods' network namespaces, volumes, rootfs);
#   - network: the node bridge capk0, links still enslaved to it, our iptables chains (CAPK-DEV-*)
#     and the kubelet's and kube-proxy's (KUBE-*) in any table, IPv4 and IPv6, nftables tables of
#     kube-proxy (when nft is installed; without it kube-proxy makes none), named network
#     namespaces of the CNI (cni-*);
#   - the pod cgroups themselves.
#
#   bash hack/dev/leftovers.sh      (root; read-only)
#
# Another tree's local MC is "left" too: there is one per machine (flock /tmp/capk-devmc.lock).
set -euo pipefail
LOG_NAME=dev-leftovers
# shellcheck source=../lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/common.sh"
[[ $(id -u) == 0 ]] || die "needs root (iptables)"
BRIDGE=capk0

found=0
report() { # WHAT LINES: one block per kind of leftover
  [[ -n $2 ]] || return 0
  found=1
  log "left behind: $1"
  while IFS= read -r line; do printf '    %s\n' "$line" >&2; done <<<"$2"
}

# shellcheck disable=SC2009 # ps: whole command lines, matched as patterns
procs=$(ps -eo pid=,args= | grep -E -e '/_output/dev(-mc2)?/' | grep -v -e grep -e 'leftovers\.sh' -e 'dev-down\.sh' || true)
report "processes of a local MC" "$procs"
# The trees whose local MC these are, for the hint below.
trees=$(grep -oE '[^ ]*/_output/dev(-mc2)?/' <<<"$procs" | sed -E 's#/_output/dev(-mc2)?/$##' | sort -u | tr '\n' ' ' || true)

pods=""
for p in /proc/[0-9]*; do
  grep -qE '^[0-9]+:[^:]*:/(kubepods|capk-mc2)(/|$)' "$p/cgroup" 2>/dev/null || continue
  pods+="${p#/proc/} $(tr '\0' ' ' <"$p/cmdline" 2>/dev/null | cut -c1-160)"$'\n'
done
report "processes in the kubelet's pod cgroups" "${pods%$'\n'}"

report "mounts under a local MC's directory" "$(awk '$5 ~ /\/_output\/dev(-mc2)?\// {print $5}' /proc/self/mountinfo)"

report "the node bridge and its links" "$({ ip -o link show "$BRIDGE" && ip -o link show master "$BRIDGE"; } 2>/dev/null | cut -d' ' -f2 || true)"
report "named network namespaces of the CNI" "$(ip netns list 2>/dev/null | grep -E '^cni-' || true)"

rules=""
for save in iptables-save ip6tables-save; do
  command -v "$save" >/dev/null || continue
  rules+=$("$save" 2>/dev/null | grep -E -- '(^:|-j |-A )(CAPK-DEV|KUBE-)' | sed "s/^/$save: /" || true)
done
report "iptables chains and rules of a local MC (CAPK-DEV-*, KUBE-*)" "$rules"
if command -v nft >/dev/null; then
  report "nftables tables of kube-proxy" "$(nft list tables 2>/dev/null | grep -E 'kube-proxy|capk' || true)"
fi

cgroups=""
for h in /sys/fs/cgroup/*/; do
  for d in kubepods capk-mc2; do [[ -d $h$d ]] && cgroups+="$h$d"$'\n'; done
done
report "pod cgroups" "${cgroups%$'\n'}"

((found == 0)) || die "a local management cluster left the above on this machine: make dev-down in the tree that started it (${trees:-no process names it}), then check again: bash hack/dev/leftovers.sh"
log "nothing of a local management cluster is left on this machine"
