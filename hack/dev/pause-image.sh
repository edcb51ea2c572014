#!/usr/bin/env bash
# The sandbox ("pause") image, built here from Debian's static catatonit (`catatonit -P` is a
# pause process), committed with buildah and imported into containerd's k8s.io namespace.
# No registry is involved. Idempotent: skips when containerd already has the image.
#
#   hack/dev/pause-image.sh   (needs a running dev containerd; called by hack/dev-up.sh)
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

if ctr_has_image "$PAUSE_IMAGE"; then
  log "pause image $PAUSE_IMAGE already in containerd"
  exit 0
fi
catatonit=$(command -v catatonit) || die "catatonit not found (apt-get install catatonit)"
file -L "$catatonit" | grep -q 'statically linked' || die "$catatonit is not statically linked"

work=$DEV/images/pause
rm -rf "$work"
mkdir -p "$work/rootfs"
install -m 0755 "$catatonit" "$work/rootfs/catatonit"
oci_image_import "$PAUSE_IMAGE" "$work" \
  "hack/dev/pause-image.sh: catatonit $(dpkg-query -W -f='${Version}' catatonit 2>/dev/null || echo unknown)" \
  --entrypoint '["/catatonit","-P"]' --cmd '' --workingdir / --user 65535:65535
log "pause image $PAUSE_IMAGE imported"
