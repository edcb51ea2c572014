#!/usr/bin/env bash
# Seeds each fuzz target's corpus from the test fixtures and fuzzes it for a bounded time.
#
#   bootstrap/fuzz/run.sh [SECONDS_PER_TARGET] [TARGET...]     (default: 60 s, every target)
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`) and a nightly toolchain (libFuzzer's coverage
# instrumentation). Corpora and crashes stay under bootstrap/fuzz/{corpus,artifacts} (ignored).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
FIXTURES=$HERE/../tests/fixtures
SECONDS_PER_TARGET=${1:-60}
shift || true
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(cloud_config ignition heartbeat)

command -v cargo-fuzz >/dev/null || { echo "fuzz: cargo-fuzz not found; run: cargo install cargo-fuzz" >&2; exit 1; }
rustup toolchain list 2>/dev/null | grep -q '^nightly' || { echo "fuzz: a nightly toolchain is needed (rustup toolchain install nightly)" >&2; exit 1; }

seed() { # target, files...
  local dir=$HERE/corpus/$1; shift
  mkdir -p "$dir"
  for f in "$@"; do [[ -f $f ]] && cp "$f" "$dir/$(basename "$f")"; done
}
seed cloud_config "$FIXTURES"/handmade/*.cloud-config "$FIXTURES"/cabpk-templates/*.cloud-config
seed ignition "$FIXTURES"/handmade/*.json "$FIXTURES"/cabpk-templates/*.json
mkdir -p "$HERE/corpus/heartbeat"
printf 'capk-heartbeat/1 bootstrap=done uptime=12.5\n' >"$HERE/corpus/heartbeat/seed-done"
# Generated CABPK Secrets hold the data in a JSON string; seed their raw dumps as they are.
for s in "$FIXTURES"/cabpk/*.secret.json; do
  [[ -f $s ]] || continue
  if grep -q '"format": *"ignition"' "$s"; then seed ignition "$s"; else seed cloud_config "$s"; fi
done

cd "$HERE"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HERE/target}
for t in "${targets[@]}"; do
  echo "fuzz: $t for ${SECONDS_PER_TARGET}s"
  # Safe Rust only: AddressSanitizer adds build time and finds nothing panics would not.
  cargo +nightly fuzz run --sanitizer none "$t" "corpus/$t" -- -max_total_time="$SECONDS_PER_TARGET" -max_len=65536
done
