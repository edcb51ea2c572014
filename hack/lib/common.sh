# shellcheck shell=bash
# The shell library of every script in this repository (hack/, images/, test fixtures): one
# log/die/require, the buildah invocation on the project's own image storage, an image made with
# buildah from a tree, and the wrapper module of a Go build from the module proxy. Sourced, not
# run; `set -euo pipefail` stays the caller's:
#
#   # shellcheck source=lib/common.sh
#   source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"     (from hack/; LOG_NAME before it
#                                                              names the log lines, default: the
#                                                              script's file name without .sh)
#
# Sets ROOT (the repository), OUT (_output, or $CAPK_OUTPUT) and BIN ($OUT/bin, where the
# build-*.sh scripts put what they build).

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${CAPK_OUTPUT:-$ROOT/_output}
# shellcheck disable=SC2034 # for the scripts that source this
BIN=$OUT/bin
LOG_NAME=${LOG_NAME:-$(basename "$0" .sh)}

# log MESSAGE...: one line on stderr with the time and the script's name (stdout stays the
# script's output).
log() { printf '%s %s: %s\n' "$(date -u +%H:%M:%S)" "$LOG_NAME" "$*" >&2; }
# die MESSAGE...: log it as an error and exit 1. Say what to do next.
die() {
  log "ERROR: $*"
  exit 1
}

# require TOOL[:PACKAGE]...: every TOOL is on PATH, else die naming the Debian package that has it
# (PACKAGE, default TOOL; hack/debian-packages.txt lists what .ci/run installs).
require() {
  local t
  for t in "$@"; do
    command -v "${t%%:*}" >/dev/null ||
      die "'${t%%:*}' not found: apt-get install ${t#*:} (hack/debian-packages.txt)"
  done
}

# capk_buildah ARGS...: buildah on the one image storage of this project, _output/buildah (vfs:
# works on any filesystem and inside a container), shared by images/base, images/node and hack/dev.
capk_buildah() {
  buildah --root "$OUT/buildah/storage" --runroot "$OUT/buildah/run" --storage-driver vfs "$@"
}

# buildah_image NAME FROM LAYER_TAR CONFIG_FLAG...: commits the image NAME: FROM (an image in
# capk_buildah's storage, or scratch) with the tarball LAYER_TAR unpacked at / as one more layer
# (owners, modes and xattrs such as file capabilities as the tar has them), configured by
# `buildah config` flags (--entrypoint '["/x"]', --user, --label, ...). Image and history times
# are the epoch, so equal inputs give an equal image. Prints nothing.
buildah_image() {
  local name=$1 from=$2 layer=$3 c
  shift 3
  c=$(capk_buildah from --pull=never "$from")
  if ! {
    capk_buildah add --quiet "$c" "$layer" / >/dev/null &&
      capk_buildah config "$@" "$c" &&
      capk_buildah commit --quiet --rm --timestamp 0 "$c" "$name" >/dev/null
  }; then
    capk_buildah rm "$c" >/dev/null 2>&1 || true
    die "buildah could not make $name from $from and ${layer#"$ROOT"/}"
  fi
}

# go_wrapper_module DIR NAME LOCAL_VERSION MODULE@VERSION [MODULE@VERSION...]: writes DIR/go.mod
# of a throwaway main module NAME that requires each MODULE at VERSION, for building upstream
# programs from the Go module proxy (`go install pkg@version` refuses modules with replace
# directives). The first module gives the go directive, and each of its replaces that points into
# its own tree (k8s.io/api => ./staging/src/k8s.io/api; sigs.k8s.io/cluster-api/api => ./api),
# which a dependent module does not inherit, becomes the published module at LOCAL_VERSION (for
# Kubernetes v1.X.Y that is v0.X.Y). The caller adds a Go file importing what it builds and runs
# `go mod tidy`. Needs go and GOFLAGS=-mod=mod.
go_wrapper_module() {
  local dir=$1 name=$2 local_version=$3 first=$4 modfile m
  shift 3
  modfile=$(cd "$dir" && go mod download -json "$first" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')
  [[ -f $modfile ]] || die "go mod download of $first failed (is the Go module proxy reachable? GOPROXY=$(go env GOPROXY))"
  {
    echo "module $name"
    echo
    grep -E '^go [0-9]' "$modfile"
    echo
    for m in "$@"; do echo "require ${m%@*} ${m##*@}"; done
    echo
    # Replaces on one line (`replace A => ./a`) and in a block (`replace (` … `A => ./a` … `)`).
    awk -v v="$local_version" '
      /^replace[[:space:]]*\(/ { block = 1; next }
      block && /^\)/ { block = 0; next }
      {
        line = $0
        if (!block) { if (line !~ /^replace[[:space:]]/) next; sub(/^replace[[:space:]]+/, "", line) }
        n = split(line, f, /[[:space:]]+/)
        if (f[1] == "") { for (i = 1; i < n; i++) f[i] = f[i + 1]; n-- }
        if (n >= 3 && f[2] == "=>" && f[3] ~ /^\.\//) print "replace " f[1] " => " f[1] " " v
      }' "$modfile"
  } >"$dir/go.mod"
}
