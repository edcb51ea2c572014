#!/usr/bin/env bash
# Builds upstream Ignition's `ignition` binary (github.com/coreos/ignition/v2, the program Flatcar's
# initramfs runs) from the Go module proxy for the test guest. It links libblkid through CGO, so
# it needs gcc and libblkid-dev (hack/debian-packages.txt); the guest gets the shared libraries it
# loads. Idempotent: a binary whose stamp matches version and flags is kept.
#
# Usage: build-ignition.sh OUTFILE   (default _output/bin/ignition)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
MODULE=github.com/coreos/ignition/v2
VERSION=${IGNITION_VERSION:-v2.26.0}
OUT=${1:-$ROOT/_output/bin/ignition}
# Build-time distro settings (internal/distro): the test guest has no SELinux and no setfiles, so
# relabelling is off, as in Flatcar's build. Everything else keeps upstream's defaults.
LDFLAGS="-s -w -X $MODULE/internal/version.Raw=$VERSION -X $MODULE/internal/distro.selinuxRelabel=false"
STAMP="$VERSION $LDFLAGS"

if [[ -x $OUT && -f $OUT.stamp && $(cat "$OUT.stamp") == "$STAMP" ]]; then
  echo "build-ignition: ignition $VERSION already built ($OUT)"
  exit 0
fi
command -v go >/dev/null || { echo "build-ignition: 'go' not found; install Go (Debian: apt-get install golang)" >&2; exit 1; }
command -v gcc >/dev/null || { echo "build-ignition: 'gcc' not found; apt-get install gcc" >&2; exit 1; }
[[ -f /usr/include/blkid/blkid.h ]] || { echo "build-ignition: blkid.h not found; apt-get install libblkid-dev" >&2; exit 1; }

export GOTOOLCHAIN=local GOFLAGS=-mod=readonly CGO_ENABLED=1
# The command is package .../internal (main); a wrapper module cannot import it, so build inside
# a writable copy of the module as downloaded (its go.sum pins every dependency).
dir=$(go mod download -json "$MODULE@$VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[[ -d $dir ]] || { echo "build-ignition: go mod download $MODULE@$VERSION gave no directory" >&2; exit 1; }
SRC=$ROOT/_output/src/ignition-$VERSION
if [[ ! -f $SRC/go.mod ]]; then
  rm -rf "$SRC"
  mkdir -p "$(dirname "$SRC")"
  cp -r "$dir" "$SRC.tmp"
  chmod -R u+w "$SRC.tmp"
  mv "$SRC.tmp" "$SRC"
fi
mkdir -p "$(dirname "$OUT")"
echo "build-ignition: building ignition $VERSION (CGO, libblkid)"
(cd "$SRC" && go build -trimpath -ldflags "$LDFLAGS" -o "$OUT.tmp" ./internal)
mv "$OUT.tmp" "$OUT"
echo "$STAMP" >"$OUT.stamp"
"$OUT" -version
