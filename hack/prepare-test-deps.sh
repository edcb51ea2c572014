#!/usr/bin/env bash
# Prepares everything the test suite needs that is not a Rust crate: runs hack/prepare.d/*.sh in
# order. Each step skips work that is already done, so a warm run costs seconds.
set -euo pipefail
# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
cd "$ROOT"
for step in hack/prepare.d/*.sh; do
  [[ -e $step ]] || continue
  log "$step"
  bash "$step"
done
