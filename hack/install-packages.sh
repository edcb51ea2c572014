#!/usr/bin/env bash
# What a fresh Debian machine needs before `make dev-up` or `make check`, installed or checked in
# one place (both commands and .ci/run call this):
#
#   - the Debian packages in hack/debian-packages.txt that are not installed yet (`apt-get update`
#     first, and only when one is missing: a warm machine costs a dpkg query);
#   - the toolchains, which Debian's own packages are too old for: Go >= GO_MIN (a newer one may
#     come from the Go module proxy through GOTOOLCHAIN), Rust >= RUST_MIN with rustfmt and clippy
#     (rustup). A missing or old one stops here with the command that installs it.
#
#   bash hack/install-packages.sh            (root: apt-get)
#   bash hack/install-packages.sh --check    (only say what is missing; exit 1 if anything is)
set -euo pipefail
# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
cd "$ROOT"

GO_MIN=1.26
RUST_MIN=1.89

# version_at_least HAVE WANT: dotted versions compared number by number.
version_at_least() {
  [[ $(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1) == "$2" ]]
}

mapfile -t pkgs < <(sed -e 's/#.*//' -e '/^\s*$/d' hack/debian-packages.txt)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
done
if ((${#missing[@]} > 0)); then
  if [[ ${1:-} == --check ]]; then
    log "missing Debian packages: ${missing[*]} (bash hack/install-packages.sh installs them)"
    exit 1
  fi
  [[ $(id -u) == 0 ]] || die "Debian packages missing (${missing[*]}): run this as root"
  log "installing ${#missing[@]} Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

problems=()
if ! command -v go >/dev/null; then
  problems+=("Go >= $GO_MIN not found: install Go's own release (Debian 12's golang is older) and put its bin on PATH")
else
  have=$(go env GOVERSION 2>/dev/null | sed 's/^go//')
  version_at_least "${have:-0}" "$GO_MIN" ||
    problems+=("Go $have is older than $GO_MIN: export GOTOOLCHAIN=go$GO_MIN.0 (fetched through the Go module proxy) or install a newer Go")
fi
if ! command -v cargo >/dev/null || ! command -v rustc >/dev/null; then
  problems+=("Rust >= $RUST_MIN not found: install Rust with rustup (Debian 12's rustc is older), then rustup default stable")
else
  have=$(rustc --version | awk '{print $2}')
  version_at_least "$have" "$RUST_MIN" ||
    problems+=("Rust $have is older than $RUST_MIN: rustup update stable")
  cargo fmt --version >/dev/null 2>&1 || problems+=("rustfmt missing: rustup component add rustfmt")
  cargo clippy --version >/dev/null 2>&1 || problems+=("clippy missing: rustup component add clippy")
fi
if ((${#problems[@]} > 0)); then
  for p in "${problems[@]}"; do log "ERROR: $p"; done
  exit 1
fi
