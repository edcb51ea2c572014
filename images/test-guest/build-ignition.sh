#!/usr/bin/env bash
# Builds upstream Ignition's `ignition` binary (github.com/coreos/ignition/v2, the program Flatcar's
# initramfs runs) from the Go module proxy for the test guest. It links libblkid through CGO, so
# it needs gcc and libblkid-dev (hack/debian-packages.txt); the guest gets the shared libraries it
# loads. Idempotent: a binary whose stamp matches version and flags is kept.
#
# Usage: build-ignition.sh OUTFILE   (default _output/bin/ignition)
set -euo pipefail
LOG_NAME=build-ignition
# shellcheck source=../../hack/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../hack/lib/common.sh"
MODULE=github.com/coreos/ignition/v2
VERSION=${IGNITION_VERSION:-v2.26.0}
OUTFILE=${1:-$ROOT/_output/bin/ignition}
# Build-time distro settings (internal/distro): the test guest has no SELinux and no setfiles, so
# relabelling is off, as in Flatcar's build. Everything else keeps upstream's defaults.
LDFLAGS="-s -w -X $MODULE/internal/version.Raw=$VERSION -X $MODULE/internal/distro.selinuxRelabel=false"
STAMP="$VERSION $LDFLAGS"

if [[ -x $OUTFILE && -f $OUTFILE.stamp && $(cat "$OUTFILE.stamp") == "$STAMP" ]]; then
  log "ignition $VERSION already built ($OUTFILE)"
  exit 0
fi
require go:golang gcc
[[ -f /usr/include/blkid/blkid.h ]] || die "blkid.h not found: apt-get install libblkid-dev"

export GOTOOLCHAIN=local GOFLAGS=-mod=readonly CGO_ENABLED=1
# The command is package .../internal (main); a wrapper module cannot import it, so build inside
# a writable copy of the module as downloaded (its go.sum pins every dependency).
dir=$(go mod download -json "$MODULE@$VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[[ -d $dir ]] || die "go mod download $MODULE@$VERSION gave no directory"
SRC=$ROOT/_output/src/ignition-$VERSION
if [[ ! -f $SRC/go.mod ]]; then
  rm -rf "$SRC"
  mkdir -p "$(dirname "$SRC")"
  cp -r "$dir" "$SRC.tmp"
  chmod -R u+w "$SRC.tmp"
  mv "$SRC.tmp" "$SRC"
fi
mkdir -p "$(dirname "$OUTFILE")"
log "building ignition $VERSION (CGO, libblkid)"
(cd "$SRC" && go build -trimpath -ldflags "$LDFLAGS" -o "$OUTFILE.tmp" ./internal)
mv "$OUTFILE.tmp" "$OUTFILE"
echo "$STAMP" >"$OUTFILE.stamp"
"$OUTFILE" -version
