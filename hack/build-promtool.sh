#!/usr/bin/env bash
# Builds upstream `promtool` (github.com/prometheus/prometheus/cmd/promtool) from the Go module
# proxy into _output/bin/promtool: controller/tests/alerts.rs checks the shipped PrometheusRule
# (manifests/components/monitoring) with `promtool check rules` and runs its unit tests with
# `promtool test rules`. Idempotent: a binary whose stamp matches the pinned version is kept.
set -euo pipefail

# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
# shellcheck source=versions.env
source "$ROOT/hack/versions.env"
PROMETHEUS_MODULE=github.com/prometheus/prometheus
# Prometheus 3.x is published as module versions v0.3XX.Y: v0.316.0 is Prometheus 3.16.0.
release=${PROMETHEUS_VERSION#v0.3}
PROMETHEUS_RELEASE=3.$((10#${release%%.*})).${release#*.}
# No service discovery plugins (cloud SDKs, client-go): promtool checks and tests rules here, which
# needs none of them, and the build is a fraction of the full one.
TAGS=remove_all_sd
STAMP=$BIN/.promtool.version

if [[ -x $BIN/promtool && -f $STAMP && $(cat "$STAMP") == "$PROMETHEUS_VERSION $TAGS" ]]; then
  log "promtool $PROMETHEUS_VERSION already built"
  exit 0
fi

require go:golang

export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod
WRAP=$OUT/src/promtool-$PROMETHEUS_VERSION
mkdir -p "$BIN" "$WRAP"
if [[ ! -f $WRAP/go.sum ]]; then
  go_wrapper_module "$WRAP" capk.local/promtool "$PROMETHEUS_VERSION" "$PROMETHEUS_MODULE@$PROMETHEUS_VERSION"
  printf 'package main\n\nimport _ "%s/cmd/promtool"\n\nfunc main() {}\n' "$PROMETHEUS_MODULE" >"$WRAP/tools.go"
  (cd "$WRAP" && go mod tidy >/dev/null)
fi
log "building promtool $PROMETHEUS_VERSION (Prometheus $PROMETHEUS_RELEASE)"
(cd "$WRAP" && go build -trimpath -tags "$TAGS" -o "$BIN/promtool.tmp" \
  -ldflags "-X github.com/prometheus/common/version.Version=$PROMETHEUS_RELEASE" \
  "$PROMETHEUS_MODULE/cmd/promtool")
mv "$BIN/promtool.tmp" "$BIN/promtool"
echo "$PROMETHEUS_VERSION $TAGS" >"$STAMP"
"$BIN/promtool" --version | head -1
