#!/usr/bin/env bash
# The launcher's test guest (kernel + busybox initramfs) in _output/test-guest; rebuilt only when
# its recipe or the installed kernel changed.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
exec bash "$ROOT/images/test-guest/build.sh" "$ROOT/_output/test-guest"
