#!/usr/bin/env bash
# The stub-guest scenarios as a gate (`make check`, `.ci/run`): `make e2e-stub` brings up the local
# management cluster (Cluster API and CAPK by clusterctl init, no sample cluster, no node image)
# and runs the journey and the ClusterClass scenario; afterwards, pass or fail or interrupted,
# `make dev-down` stops everything it started and hack/dev/leftovers.sh must find nothing of it on
# the machine (processes, mounts, bridge, network namespaces, iptables rules, pod cgroups). A
# failure says where its diagnostics are; dev-down keeps them (_output/dev/logs, _output/e2e).
#
#   bash hack/e2e-gate.sh        (root; refuses to start while any local MC runs on this machine:
#                                 there is one per machine, see flock /tmp/capk-devmc.lock)
#   bash hack/e2e-gate.sh --precheck
#                                (only that refusal: `make check` runs it before lint and tests,
#                                 so a running local MC is said at once, not after them)
set -euo pipefail
LOG_NAME=e2e-gate
# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
[[ $(id -u) == 0 ]] || die "needs root (the local management cluster: containerd, kubelet, bridge, iptables)"
cd "$ROOT"

# Never tear down a cluster this run did not start: whatever runs now is someone else's.
bash hack/dev/leftovers.sh >/dev/null 2>&1 || {
  bash hack/dev/leftovers.sh || true
  die "a local management cluster (or what one left) is on this machine; make check's journey starts its own and tears it down afterwards: stop that one first (make dev-down in its tree), then run make check again"
}
[[ ${1:-} != --precheck ]] || exit 0

t0=$SECONDS
started=$(date +%s)
finish() {
  local rc=$? runs
  trap - EXIT INT TERM
  if ((rc != 0)); then
    log "FAILED (exit $rc) after $((SECONDS - t0))s. Diagnostics:"
    runs=$(find "$OUT/e2e" -mindepth 1 -maxdepth 1 -type d -newermt "@$started" 2>/dev/null | sort)
    if [[ -n $runs ]]; then
      log "  the journey's (objects, events, the managers' and machine Pods' logs): ${runs//$'\n'/ }"
    else
      log "  the journey collected none (it did not start, or failed before its first step): see the output above"
    fi
    log "  the local MC's daemons (etcd, kube-apiserver, kubelet, containerd, …): ${OUT#"$ROOT"/}/dev/logs/; clusterctl: ${OUT#"$ROOT"/}/dev/logs/clusterctl.log; image builds: ${OUT#"$ROOT"/}/images/dev/*.build.log"
  fi
  log "tearing the local management cluster down (make dev-down)"
  if ! make --no-print-directory dev-down; then
    log "ERROR: make dev-down failed"
    ((rc != 0)) || rc=1
  fi
  # Checked here too: dev-down may have stopped half-way, or found no cluster of this tree.
  if ! bash hack/dev/leftovers.sh; then
    log "ERROR: the local management cluster left the above behind"
    ((rc != 0)) || rc=1
  fi
  log "done in $((SECONDS - t0))s (exit $rc)"
  exit "$rc"
}
trap finish EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The machine and controller images take the debug binaries `make test` has just built (hack/dev/
# images.sh): make check compiles each binary once.
CAPK_IMAGE_PROFILE=${CAPK_IMAGE_PROFILE:-dev} make --no-print-directory e2e-stub
