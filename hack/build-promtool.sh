#!/usr/bin/env bash
# Builds upstream `promtool` (github.com/prometheus/prometheus/cmd/promtool) from the Go module
# proxy into _output/bin/promtool: controller/tests/alerts.rs checks the shipped PrometheusRule
# (manifests/components/monitoring) with `promtool check rules` and runs its unit tests with
# `promtool test rules`. `hack/build-promtool.sh prometheus` builds the server of the same module
# version (cmd/prometheus) into _output/bin/prometheus, for the local MC's CAPK_DEV_MONITORING=1
# (hack/dev/monitoring.sh). Idempotent: a binary whose stamp matches the pinned version is kept.
#
#   hack/build-promtool.sh [promtool] [prometheus]   (default: promtool)
set -euo pipefail

# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
# shellcheck source=versions.env
source "$ROOT/hack/versions.env"
PROMETHEUS_MODULE=github.com/prometheus/prometheus
# Prometheus 3.x is published as module versions v0.3XX.Y: v0.316.0 is Prometheus 3.16.0.
release=${PROMETHEUS_VERSION#v0.3}
PROMETHEUS_RELEASE=3.$((10#${release%%.*})).${release#*.}
# No service discovery plugins (cloud SDKs, client-go): promtool checks and tests rules here, and
# the local MC's Prometheus scrapes the controller's Service as a static target, which need none
# of them, and the build is a fraction of the full one.
TAGS=remove_all_sd
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(promtool)
todo=()
for t in "${targets[@]}"; do
  [[ $t == promtool || $t == prometheus ]] || die "unknown binary '$t' (known: promtool prometheus)"
  if [[ -x $BIN/$t && -f $BIN/.$t.version && $(cat "$BIN/.$t.version") == "$PROMETHEUS_VERSION $TAGS" ]]; then
    log "$t $PROMETHEUS_VERSION already built"
  else
    todo+=("$t")
  fi
done
[[ ${#todo[@]} -gt 0 ]] || exit 0

require go:golang

export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod
WRAP=$OUT/src/promtool-$PROMETHEUS_VERSION
mkdir -p "$BIN" "$WRAP"
if [[ ! -f $WRAP/go.sum ]]; then
  go_wrapper_module "$WRAP" capk.local/promtool "$PROMETHEUS_VERSION" "$PROMETHEUS_MODULE@$PROMETHEUS_VERSION"
  printf 'package main\n\nimport _ "%s/cmd/promtool"\n\nfunc main() {}\n' "$PROMETHEUS_MODULE" >"$WRAP/tools.go"
  (cd "$WRAP" && go mod tidy >/dev/null)
fi
# The wrapper was tidied for promtool; GOFLAGS=-mod=mod adds what the server needs beyond it.
for t in "${todo[@]}"; do
  start=$SECONDS
  log "building $t $PROMETHEUS_VERSION (Prometheus $PROMETHEUS_RELEASE)"
  # The server's web UI assets are not built in (no `builtinassets` tag): its HTTP API is all the
  # local MC uses.
  (cd "$WRAP" && go build -trimpath -tags "$TAGS" -o "$BIN/$t.tmp" \
    -ldflags "-X github.com/prometheus/common/version.Version=$PROMETHEUS_RELEASE" \
    "$PROMETHEUS_MODULE/cmd/$t")
  mv "$BIN/$t.tmp" "$BIN/$t"
  echo "$PROMETHEUS_VERSION $TAGS" >"$BIN/.$t.version"
  log "$t built in $((SECONDS - start))s: $("$BIN/$t" --version | head -1)"
done
