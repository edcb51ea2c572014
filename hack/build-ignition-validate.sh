#!/usr/bin/env bash
# Builds upstream `ignition-validate` (github.com/coreos/ignition/v2, pure Go in validate/) from the
# Go module proxy into _output/bin/ignition-validate. The tests of capk-bootstrap run every config
# they generate through it. Idempotent: a binary whose stamp matches the pinned version is kept.
set -euo pipefail

# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
# Pinned here rather than in versions.env: only this script and its test use it.
IGNITION_MODULE=github.com/coreos/ignition/v2
IGNITION_VERSION=${IGNITION_VERSION:-v2.26.0}
STAMP=$BIN/.ignition-validate.version

if [[ -x $BIN/ignition-validate && -f $STAMP && $(cat "$STAMP") == "$IGNITION_VERSION" ]]; then
  log "ignition-validate $IGNITION_VERSION already built"
  exit 0
fi

require go:golang

export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod
WRAP=$OUT/src/ignition-validate-$IGNITION_VERSION
mkdir -p "$BIN" "$WRAP"
# A throwaway main module pins the exact version (go install pkg@version would too, but a wrapper
# keeps go.sum next to the build for inspection and works the same way as build-upstream.sh).
if [[ ! -f $WRAP/go.sum ]]; then
  go_wrapper_module "$WRAP" capk.local/ignition-validate "$IGNITION_VERSION" "$IGNITION_MODULE@$IGNITION_VERSION"
  printf 'package main\n\nimport _ "%s/validate"\n\nfunc main() {}\n' "$IGNITION_MODULE" >"$WRAP/tools.go"
  (cd "$WRAP" && go mod tidy >/dev/null)
fi
log "building ignition-validate $IGNITION_VERSION"
(cd "$WRAP" && go build -trimpath -o "$BIN/ignition-validate.tmp" \
  -ldflags "-X $IGNITION_MODULE/internal/version.Raw=$IGNITION_VERSION" "$IGNITION_MODULE/validate")
mv "$BIN/ignition-validate.tmp" "$BIN/ignition-validate"
echo "$IGNITION_VERSION" >"$STAMP"
"$BIN/ignition-validate" --version
