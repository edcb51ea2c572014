#!/usr/bin/env bash
# The launcher's test guest (kernel + busybox initramfs with upstream Ignition, and a bootable
# disk holding both) in
# _output/test-guest; Ignition is built once into _output/bin/ignition, the guest is rebuilt only
# when its recipe, Ignition or the installed kernel changed.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bash "$ROOT/images/test-guest/build-ignition.sh" "$ROOT/_output/bin/ignition"
bash "$ROOT/images/test-guest/build.sh" "$ROOT/_output/test-guest"
# The same kernel and initramfs on a bootable disk (SeaBIOS → MBR → SYSLINUX), as Flatcar boots.
bash "$ROOT/images/test-guest/build-disk.sh" "$ROOT/_output/test-guest"
