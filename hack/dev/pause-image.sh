#!/usr/bin/env bash
# The sandbox ("pause") image, built here from Debian's static catatonit (`catatonit -P` is a
# pause process), as an OCI image archive imported into containerd's k8s.io namespace.
# No registry is involved. Idempotent: skips when containerd already has the image.
#
#   hack/dev/pause-image.sh   (needs a running dev containerd; called by hack/dev-up.sh)
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

if ctr_k8s images ls -q | grep -qxF "$PAUSE_IMAGE"; then
  log "pause image $PAUSE_IMAGE already in containerd"
  exit 0
fi
catatonit=$(command -v catatonit) || die "catatonit not found (apt-get install catatonit)"
file -L "$catatonit" | grep -q 'statically linked' || die "$catatonit is not statically linked"

work=$DEV/images/pause
rm -rf "$work"
mkdir -p "$work/rootfs" "$work/oci/blobs/sha256"
install -m 0755 "$catatonit" "$work/rootfs/catatonit"
# Reproducible layer: fixed order, owner and mtime.
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$work/rootfs" -cf "$work/layer.tar" .

blob() { # FILE -> prints digest hex, copies into blobs/
  local d
  d=$(sha256sum "$1" | cut -d' ' -f1)
  cp "$1" "$work/oci/blobs/sha256/$d"
  echo "$d"
}
size() { stat -c %s "$1"; }

layer=$(blob "$work/layer.tar")
cat >"$work/config.json" <<JSON
{"architecture":"amd64","os":"linux","config":{"Entrypoint":["/catatonit","-P"],"WorkingDir":"/","User":"65535:65535"},"rootfs":{"type":"layers","diff_ids":["sha256:$layer"]},"history":[{"created_by":"hack/dev/pause-image.sh: catatonit $(dpkg-query -W -f='${Version}' catatonit 2>/dev/null || echo unknown)"}]}
JSON
config=$(blob "$work/config.json")
cat >"$work/manifest.json" <<JSON
{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:$config","size":$(size "$work/config.json")},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"sha256:$layer","size":$(size "$work/layer.tar")}]}
JSON
manifest=$(blob "$work/manifest.json")
cat >"$work/oci/index.json" <<JSON
{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:$manifest","size":$(size "$work/manifest.json"),"platform":{"architecture":"amd64","os":"linux"},"annotations":{"io.containerd.image.name":"$PAUSE_IMAGE","org.opencontainers.image.ref.name":"${PAUSE_IMAGE##*:}"}}]}
JSON
echo '{"imageLayoutVersion":"1.0.0"}' >"$work/oci/oci-layout"
tar -C "$work/oci" -cf "$work/pause.tar" .
ctr_k8s images import "$work/pause.tar"
ctr_k8s images ls -q | grep -qxF "$PAUSE_IMAGE" || die "import did not produce $PAUSE_IMAGE"
log "pause image $PAUSE_IMAGE imported"
