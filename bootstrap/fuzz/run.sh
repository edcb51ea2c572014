#!/usr/bin/env bash
# Seeds each fuzz target's corpus from the test fixtures and fuzzes every target for a bounded
# time; exits non-zero when any target finds a crash, a panic, a timeout or runs out of memory.
# Targets live in two fuzz crates: bootstrap/fuzz (bootstrap data, heartbeat line) and
# launcher/fuzz (heartbeat_stream: the launcher's capped line framer on the guest's port;
# control_request: the control socket's request parser).
#
#   bootstrap/fuzz/run.sh [SECONDS_PER_TARGET] [TARGET...]     (default: 20 s, every target)
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`) and a nightly toolchain (`rustup toolchain install
# nightly`; libFuzzer's coverage instrumentation). Everything it writes stays in ignored
# directories of each fuzz crate: target/ (build), corpus/ (seeds + what libFuzzer finds),
# artifacts/ (crashing inputs, per-run logs); bootstrap/fuzz/last-run.txt is the summary printed
# at the end.
set -euo pipefail
LOG_NAME=fuzz
# shellcheck source=../../hack/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../hack/lib/common.sh"
HERE=$ROOT/bootstrap/fuzz
FIXTURES=$HERE/../tests/fixtures
SECONDS_PER_TARGET=${1:-20}
[[ $SECONDS_PER_TARGET =~ ^[0-9]+$ ]] || die "SECONDS_PER_TARGET must be a number, not '$SECONDS_PER_TARGET'"
shift || true
LAUNCHER=$ROOT/launcher/fuzz
ALL=(cloud_config ignition secret write_file heartbeat heartbeat_stream control_request)
# The fuzz crate holding a target.
crate_of() {
  case $1 in
    heartbeat_stream | control_request) echo "$LAUNCHER" ;;
    *) echo "$HERE" ;;
  esac
}
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=("${ALL[@]}")

command -v cargo-fuzz >/dev/null || die "cargo-fuzz not found; run: cargo install cargo-fuzz"
rustup toolchain list 2>/dev/null | grep -q '^nightly' || die "a nightly toolchain is needed; run: rustup toolchain install nightly"

seed() { # target, files...
  local dir=$HERE/corpus/$1; shift
  mkdir -p "$dir"
  for f in "$@"; do [[ -f $f ]] && cp "$f" "$dir/seed-$(basename "$f")"; done
  return 0
}
# The bootstrap data of a CABPK Secret dump (`.value`), for the cloud_config/ignition targets.
secret_value() { # file
  if command -v jq >/dev/null; then jq -j .value "$1"
  elif command -v python3 >/dev/null; then python3 -c 'import json,sys; sys.stdout.write(json.load(open(sys.argv[1]))["value"])' "$1"
  else return 1; fi
}

shopt -s nullglob
seed cloud_config "$FIXTURES"/handmade/*.cloud-config "$FIXTURES"/cabpk-templates/*.cloud-config
seed ignition "$FIXTURES"/handmade/*.json "$FIXTURES"/cabpk-templates/*.json
seed secret "$FIXTURES"/cabpk/*.secret.json
for s in "$FIXTURES"/cabpk/*.secret.json; do
  case $s in
    */cloud-config-*) t=cloud_config ;;
    *) t=ignition ;;
  esac
  mkdir -p "$HERE/corpus/$t"
  secret_value "$s" >"$HERE/corpus/$t/seed-$(basename "$s" .secret.json)" ||
    log "neither jq nor python3 found; $(basename "$s") seeds only the secret target"
done
# write_file: first byte picks the encoding (see fuzz_targets/write_file.rs).
mkdir -p "$HERE/corpus/write_file" "$HERE/corpus/heartbeat"
printf '\000plain text\n' >"$HERE/corpus/write_file/seed-plain"
printf '\002%s' "$(printf 'hello from base64\n' | base64 -w0)" >"$HERE/corpus/write_file/seed-base64"
{ printf '\004'; printf 'gzip and base64\n' | gzip -9n | base64 -w0; } >"$HERE/corpus/write_file/seed-gzip-base64"
{ printf '\006'; printf 'raw gzip\n' | gzip -9n; } >"$HERE/corpus/write_file/seed-gzip"
printf 'capk-heartbeat/1 bootstrap=done uptime=12.5\n' >"$HERE/corpus/heartbeat/seed-done"
# heartbeat_stream: byte 0 = line cap - 1, byte 1 = read size - 1, then the stream.
mkdir -p "$LAUNCHER/corpus/heartbeat_stream" "$LAUNCHER/corpus/control_request"
printf '\077\007capk-heartbeat/1 bootstrap=pending uptime=1.0\nnoise\ncapk-heartbeat/1 bootstrap=done uptime=2.5\n' \
  >"$LAUNCHER/corpus/heartbeat_stream/seed-beats"
{ printf '\007\003'; head -c 300 /dev/zero | tr '\0' x; printf '\ncapk-heartbeat/1 bootstrap=done uptime=3\n'; } \
  >"$LAUNCHER/corpus/heartbeat_stream/seed-too-long"
printf '{"op":"probe","kind":"readiness"}' >"$LAUNCHER/corpus/control_request/seed-probe"
printf '{"op":"status"}' >"$LAUNCHER/corpus/control_request/seed-status"
printf '{"op":"qmp","command":"query-status"}' >"$LAUNCHER/corpus/control_request/seed-qmp"

# Each crate keeps its instrumented build in its own ignored target/, whatever the caller exported.
in_crate() { # target, command...
  local dir; dir=$(crate_of "$1"); shift
  (cd "$dir" && CARGO_TARGET_DIR=$dir/target "$@")
}
# Safe Rust only, except the launcher's ioctl code, which no target reaches: AddressSanitizer
# adds build time and finds nothing panics would not.
log "building ${targets[*]}"
start=$SECONDS
for t in "${targets[@]}"; do
  in_crate "$t" cargo +nightly fuzz build --sanitizer none "$t"
done
log "built in $((SECONDS - start))s"

summary=$HERE/last-run.txt
{
  echo "# bootstrap/fuzz/run.sh $SECONDS_PER_TARGET s per target, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  printf '%-17s %-7s %12s %8s %8s %9s\n' target result executions exec/s corpus coverage
} >"$summary"
failed=()
for t in "${targets[@]}"; do
  dir=$(crate_of "$t")
  mkdir -p "$dir/artifacts/$t" "$dir/corpus/$t"
  logf=$dir/artifacts/$t/last-run.log
  log "$t for ${SECONDS_PER_TARGET}s (log: ${logf#"$ROOT/"})"
  rc=0
  in_crate "$t" cargo +nightly fuzz run --sanitizer none "$t" "corpus/$t" -- \
    -max_total_time="$SECONDS_PER_TARGET" -max_len=65536 -timeout=20 -rss_limit_mb=2048 \
    -print_final_stats=1 >"$logf" 2>&1 || rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$logf" | tail -n 1)
  speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$logf" | tail -n 1)
  done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$logf" | tail -n 1 || true)
  corpus=$(sed -n 's/.* corp: \([0-9]*\).*/\1/p' <<<"$done_line")
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$done_line")
  result=ok
  if [[ $rc != 0 ]]; then
    result=FAILED
    failed+=("$t")
    log "$t FAILED (exit $rc); the end of its log:"
    tail -n 30 "$logf" >&2
  fi
  printf '%-17s %-7s %12s %8s %8s %9s\n' "$t" "$result" "${execs:-?}" "${speed:-?}" "${corpus:-?}" "${cov:-?}" >>"$summary"
done
cat "$summary"
if [[ ${#failed[@]} -gt 0 ]]; then
  die "failures in ${failed[*]}; crashing inputs are in {bootstrap,launcher}/fuzz/artifacts/<target>/; reproduce with: cd {bootstrap,launcher}/fuzz && cargo +nightly fuzz run --sanitizer none <target> artifacts/<target>/<file>"
fi
