#!/usr/bin/env bash
# The host's emulation speed, printed beside every emulation benchmark so that figures from
# different machines compare as ratios (docs/benchmarks.md, "Host calibration"). Boots the test
# guest (images/test-guest) with `capk.calibrate=1` directly under QEMU's TCG, one vCPU and no
# network device, and times the wall clock from QEMU's start to the guest's
# `CAPK-TESTGUEST calibrate` line: kernel boot, modules, then a fixed workload (sha256 of 64 MiB
# of zeros) that the guest also times itself. Prints one line on stdout and writes
# $OUT/calibration.env:
#
#   CAPK_TCG_CALIBRATION_SECONDS            QEMU's start → the guest's line, wall clock
#   CAPK_TCG_CALIBRATION_WORKLOAD_SECONDS   the workload alone, in-guest seconds
#   CAPK_TCG_CALIBRATION_CPU_SECONDS        QEMU's CPU time (user + system) to its exit
#   CAPK_TCG_CALIBRATION_REFERENCE_SECONDS  SECONDS on the reference machine (REFERENCE_* below)
#   CAPK_TCG_CALIBRATION_RATIO              SECONDS / REFERENCE_SECONDS: 2.00 = this host, as
#                                           loaded as it is now, emulates half as fast, so a wait
#                                           sized on the reference machine needs twice as long
#   CAPK_TCG_CALIBRATION_CPU_RATIO          the same from CPU seconds: the machine without the
#                                           other processes that share its cores
#   CAPK_TCG_CALIBRATION_OTHER_CORES        cores the other processes kept busy meanwhile
#   CAPK_TCG_CALIBRATION_LOADAVG            the 1-minute load average when it started
#
# Env: CAPK_QEMU (as the launcher's, default qemu-system-x86_64), CAPK_CALIBRATION_TIMEOUT
# (seconds, default 300).
set -euo pipefail
# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

# The reference: the medians of the quiet runs in docs/benchmarks.md, "Host calibration". Measure
# them again whenever the guest's workload, its kernel or QEMU's arguments below change.
REFERENCE_SECONDS=5.9
REFERENCE_CPU_SECONDS=5.6
REFERENCE_MACHINE="2026-11-28 (AMD EPYC, 2 cores, QEMU 7.2.22)"

GUEST=$OUT/test-guest
QEMU=${CAPK_QEMU:-qemu-system-x86_64}
TIMEOUT=${CAPK_CALIBRATION_TIMEOUT:-300}
MARKER='CAPK-TESTGUEST calibrate '
CONSOLE= # the guest's console, a temporary file
# What measure finds: the figures of the line and of calibration.env.
LOAD="" QEMU_VERSION="" WORKLOAD="" SECONDS_WALL="" CPU="" OTHERS="" RATIO="" CPU_RATIO=""

# check_inputs: QEMU and a test guest that knows capk.calibrate, or die saying what provides them.
check_inputs() {
  command -v "$QEMU" >/dev/null ||
    die "'$QEMU' not found: make packages (Debian package qemu-system-x86), or point CAPK_QEMU at a QEMU"
  local f
  for f in vmlinuz initrd.img; do
    [[ -f $GUEST/$f ]] || die "no test guest ($GUEST/$f missing): make test-guest (part of make test-deps)"
  done
  # The initramfs is an uncompressed cpio (images/test-guest/build.sh), so /init's text is in it.
  grep -qF 'capk.calibrate' "$GUEST/initrd.img" ||
    die "the test guest in $GUEST predates capk.calibrate: make test-guest rebuilds it"
}

# now_us: the wall clock in microseconds.
now_us() { local t=${EPOCHREALTIME/[.,]/}; echo "$((10#$t))"; }

# run_guest CONSOLE: boots the guest with its console on stdout, copied to CONSOLE; prints the
# guest's calibrate line and the microseconds from QEMU's start to it, or nothing when the line
# never came.
run_guest() {
  local console=$1 start line at=
  start=$(now_us)
  while IFS= read -r line; do
    line=${line%$'\r'}
    printf '%s\n' "$line" >>"$console"
    if [[ -z $at && $line == "$MARKER"* ]]; then
      at=$(($(now_us) - start))
      printf '%s %s\n' "$at" "${line#"$MARKER"}"
    fi
  done < <(timeout --kill-after=5 "$TIMEOUT" "$QEMU" \
    -machine q35 -accel tcg,thread=single,tb-size=128 -cpu max -smp 1 -m 256M \
    -nodefaults -no-user-config -display none -nic none -no-reboot -serial stdio \
    -kernel "$GUEST/vmlinuz" -initrd "$GUEST/initrd.img" \
    -append "console=ttyS0 quiet panic=-1 capk.calibrate=1" </dev/null 2>&1; times >"$console.cpu")
  # The process substitution has ended its output, not necessarily written its CPU times yet.
  wait "$!" || true
}

# cpu_seconds TIMES_FILE: user + system seconds of the children in bash's `times` output (its
# second line, `0m7.120s 0m0.460s`), one decimal.
cpu_seconds() {
  sed -n 2p "$1" | awk '{ t = 0; for (i = 1; i <= 2; i++) { split($i, p, /[ms]/); t += p[1] * 60 + p[2] } printf "%.1f", t }'
}

# cpu_jiffies: the host's CPU time so far, all cores, as `TOTAL IDLE` (idle and iowait) in clock ticks.
cpu_jiffies() {
  awk '$1 == "cpu" { t = 0; for (i = 2; i <= 9; i++) t += $i; print t, $5 + $6; exit }' /proc/stat
}

# other_cores BEFORE AFTER QEMU_CPU_SECONDS: how many cores the other processes kept busy between
# two cpu_jiffies, QEMU's own CPU time taken out.
other_cores() {
  awk -v b="$1" -v a="$2" -v q="$3" -v n="$(nproc)" -v hz="$(getconf CLK_TCK)" 'BEGIN {
    split(b, x, " "); split(a, y, " ")
    total = y[1] - x[1]; busy = total - (y[2] - x[2])
    wall = total / n / hz
    printf "%.1f", (busy / hz - q) / wall
  }'
}

# field NAME WORDS...: the value of NAME=value among WORDS.
field() {
  local name=$1 w
  shift
  for w in "$@"; do [[ $w == "$name="* ]] && echo "${w#*=}"; done
  return 0
}

# measure: boots the guest once and sets the figures below, or dies with the console's tail.
measure() {
  local jiffies_before jiffies_after result us rest
  LOAD=$(cut -d' ' -f1 /proc/loadavg)
  QEMU_VERSION=$("$QEMU" --version | sed -n '1s/.*version \([0-9.]*\).*/\1/p')
  CONSOLE=$(mktemp)
  trap 'rm -f "$CONSOLE" "$CONSOLE.cpu"' EXIT
  log "booting the test guest under TCG ($QEMU $QEMU_VERSION, load average $LOAD)"
  jiffies_before=$(cpu_jiffies)
  result=$(run_guest "$CONSOLE")
  jiffies_after=$(cpu_jiffies)
  if [[ -z $result ]]; then
    tail -n 20 "$CONSOLE" >&2
    die "no '${MARKER% }' line within ${TIMEOUT}s from $QEMU (console above; CAPK_CALIBRATION_TIMEOUT raises the limit)"
  fi
  read -r us rest <<<"$result"
  # shellcheck disable=SC2086 # the guest's key=value words
  WORKLOAD=$(field seconds $rest)
  [[ -n $WORKLOAD ]] || die "unexpected line from the guest: $MARKER$rest"
  SECONDS_WALL=$(awk -v us="$us" 'BEGIN { printf "%.1f", us / 1e6 }')
  CPU=$(cpu_seconds "$CONSOLE.cpu")
  OTHERS=$(other_cores "$jiffies_before" "$jiffies_after" "$CPU")
  RATIO=$(awk -v s="$SECONDS_WALL" -v r="$REFERENCE_SECONDS" 'BEGIN { printf "%.2f", s / r }')
  CPU_RATIO=$(awk -v s="$CPU" -v r="$REFERENCE_CPU_SECONDS" 'BEGIN { printf "%.2f", s / r }')
}

# report: the one line on stdout.
report() {
  printf 'host calibration: TCG guest boot+workload %s s (workload %s s in the guest; QEMU %s, %s s of CPU; other processes %s of %s cores, load average %s); reference %s: %s s (%s s of CPU); ratio %s (CPU %s)\n' \
    "$SECONDS_WALL" "$WORKLOAD" "$QEMU_VERSION" "$CPU" "$OTHERS" "$(nproc)" "$LOAD" \
    "$REFERENCE_MACHINE" "$REFERENCE_SECONDS" "$REFERENCE_CPU_SECONDS" "$RATIO" "$CPU_RATIO"
}

# write_env: $OUT/calibration.env, replaced whole.
write_env() {
  mkdir -p "$OUT"
  cat >"$OUT/calibration.env.tmp" <<EOF
# hack/calibrate-host.sh, $(date -u +%Y-%m-%dT%H:%M:%SZ)
CAPK_TCG_CALIBRATION_SECONDS=$SECONDS_WALL
CAPK_TCG_CALIBRATION_WORKLOAD_SECONDS=$WORKLOAD
CAPK_TCG_CALIBRATION_CPU_SECONDS=$CPU
CAPK_TCG_CALIBRATION_REFERENCE_SECONDS=$REFERENCE_SECONDS
CAPK_TCG_CALIBRATION_RATIO=$RATIO
CAPK_TCG_CALIBRATION_CPU_RATIO=$CPU_RATIO
CAPK_TCG_CALIBRATION_OTHER_CORES=$OTHERS
CAPK_TCG_CALIBRATION_LOADAVG=$LOAD
EOF
  mv "$OUT/calibration.env.tmp" "$OUT/calibration.env"
}

main() {
  check_inputs
  measure
  report
  write_env
}

main "$@"
