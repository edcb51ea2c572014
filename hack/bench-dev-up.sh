#!/usr/bin/env bash
# `make bench-dev-up`: how long `make dev-up` takes a user, to the sample's two Nodes Ready (or to
# the cluster without a sample, as CAPK_DEV_SAMPLE says), printed as lines `bench-dev-up: ...`
# after the host's calibration (hack/calibrate-host.sh: emulation speed differs between machines
# of the same kind, so compare figures as ratios).
#
#   make bench-dev-up                 in this tree, with its caches as they are:
#       first     make dev-up as the tree is (cold when nothing was built yet; skipped when a
#                 local MC of this tree is up already)
#       restart   make dev-down (state kept), then make dev-up
#       up        make dev-up with everything up
#   CAPK_BENCH_COLD=1 make bench-dev-up
#       first only, from empty caches: a clean clone of HEAD in $CAPK_BENCH_COLD_DIR (default
#       /var/tmp/capk-bench-cold, deleted first and afterwards) with its own Cargo target
#       directory and registry, Go build and module caches; the Debian packages and toolchains are
#       the machine's. Its local MC is torn down at the end; this tree's must not be up.
#
# Each run's output goes to _output/bench-dev-up/<case>.log. The local MC stays up afterwards (not
# in the cold case), as after make dev-up. Root; one local MC per machine.
set -euo pipefail
LOG_NAME=bench-dev-up
# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
[[ $(id -u) == 0 ]] || die "needs root (the local management cluster)"
cd "$ROOT"
WORK=$OUT/bench-dev-up
mkdir -p "$WORK"
RESULTS=()

# timed CASE DIR: `make dev-up` in DIR, its output to $WORK/CASE.log; records the seconds.
timed() {
  local case=$1 dir=$2 start rc=0 ready
  start=$SECONDS
  log "$case: make dev-up in $dir (log ${WORK#"$ROOT"/}/$case.log)"
  (cd "$dir" && make --no-print-directory dev-up) >"$WORK/$case.log" 2>&1 || rc=$?
  if ((rc != 0)); then
    tail -n 30 "$WORK/$case.log" >&2
    die "$case: make dev-up failed (exit $rc) after $((SECONDS - start))s; log ${WORK#"$ROOT"/}/$case.log"
  fi
  ready=$(sed -n 's/.*sample cluster ready in \([0-9]*\)s.*/\1/p' "$WORK/$case.log" | tail -n 1)
  RESULTS+=("bench-dev-up: $case $((SECONDS - start)) s${ready:+ (of which the sample $ready s)}")
  log "${RESULTS[-1]}"
}

bash hack/calibrate-host.sh | tee "$WORK/calibration.log"

if [[ ${CAPK_BENCH_COLD:-0} == 1 ]]; then
  bash hack/dev/leftovers.sh >/dev/null 2>&1 || die "a local management cluster is up on this machine: make dev-down first (the cold run starts its own)"
  COLD=${CAPK_BENCH_COLD_DIR:-/var/tmp/capk-bench-cold}
  [[ $COLD == /*/* ]] || die "CAPK_BENCH_COLD_DIR=$COLD: an absolute path below /"
  rm -rf "$COLD"
  mkdir -p "$COLD"
  git clone --quiet "$ROOT" "$COLD/clone"
  cleanup() {
    (cd "$COLD/clone" && make --no-print-directory dev-down) >"$WORK/cold-down.log" 2>&1 || log "dev-down of the cold clone failed: ${WORK#"$ROOT"/}/cold-down.log"
    rm -rf "$COLD"
  }
  trap cleanup EXIT
  export GOCACHE=$COLD/go-build GOMODCACHE=$COLD/go-mod CARGO_HOME=$COLD/cargo CARGO_TARGET_DIR=$COLD/target
  export CARGO_INCREMENTAL=0
  timed cold "$COLD/clone"
  du -sh "$COLD"/{clone/_output,target,go-build,go-mod,cargo} 2>/dev/null | sed 's/^/bench-dev-up: disk /' | tee -a "$WORK/disk.log"
else
  if bash hack/dev/leftovers.sh >/dev/null 2>&1; then
    timed first "$ROOT"
  else
    log "first: skipped, a local management cluster is up already"
  fi
  log "restart: make dev-down (state kept)"
  make --no-print-directory dev-down >"$WORK/down.log" 2>&1 || die "make dev-down failed: ${WORK#"$ROOT"/}/down.log"
  timed restart "$ROOT"
  timed up "$ROOT"
fi
echo
cat "$WORK/calibration.log"
printf '%s\n' "${RESULTS[@]}"
