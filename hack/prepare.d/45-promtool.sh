#!/usr/bin/env bash
# promtool for the alert tests of the monitoring component (controller/tests/alerts.rs).
exec bash "$(dirname "${BASH_SOURCE[0]}")/../build-promtool.sh"
