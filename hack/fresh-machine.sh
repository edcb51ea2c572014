#!/usr/bin/env bash
# A fresh Debian machine inside this one, to try the README's commands as a new user would: a
# debootstrapped Debian (minbase plus git, make and ca-certificates: what a user installs to clone
# and run make) with a mount namespace of its own whose root it is (pivot_root, so that what
# enters a container there, a kubelet's exec probe or kubectl exec, lands in that container and
# not in this machine's root, as it would from a chroot), sharing this machine's kernel, network,
# devices and process table. It gets what
# this machine's image gives every new machine (apt's sources and settings, the CA bundle of the
# network's TLS inspection, the Go settings of the environment) and the Go and Rust toolchains the
# README asks for before the first command (this machine's, read-only); nothing else: none of
# hack/debian-packages.txt, empty Go, Cargo and image caches, a clean clone of HEAD at
# /root/cluster-api-provider-kvm.
#
#   bash hack/fresh-machine.sh [--suite bookworm|trixie] [--keep] -- COMMAND
#     e.g. bash hack/fresh-machine.sh -- 'make dev-up && make dev-down && make check'
#
# The root is $CAPK_FRESH_DIR (default /var/tmp/capk-fresh-<suite>), made anew each run, its mount
# namespace kept in /run/capk-fresh/<its name>.mnt (nsenter --mount=<it> bash: a shell in it); afterwards
# `make dev-down` runs in it, every process of that namespace and their descendants stop, and it is
# unmounted and removed (--keep: left as it is, with whatever runs in it). Root; one local MC per machine, so nothing of
# another must be up.
set -euo pipefail
LOG_NAME=fresh-machine
# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
[[ $(id -u) == 0 ]] || die "needs root (debootstrap, chroot, mounts)"
require debootstrap git

SUITE=bookworm KEEP=0
while (($#)); do
  case $1 in
    --suite) SUITE=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    --) shift; break ;;
    *) die "usage: $0 [--suite bookworm|trixie] [--keep] -- COMMAND" ;;
  esac
done
(($# > 0)) || die "usage: $0 [--suite bookworm|trixie] [--keep] -- COMMAND"
CMD=$*
case $SUITE in bookworm | trixie) ;; *) die "--suite $SUITE: bookworm or trixie" ;; esac
DIR=${CAPK_FRESH_DIR:-/var/tmp/capk-fresh-$SUITE}
[[ $DIR == /*/* ]] || die "CAPK_FRESH_DIR=$DIR: an absolute path below /"
# Where its mount namespace is kept: a persistent mount namespace must sit on a private mount.
NS_DIR=/run/capk-fresh
NS=$NS_DIR/$(basename "$DIR").mnt
bash "$ROOT/hack/dev/leftovers.sh" >/dev/null 2>&1 ||
  die "a local management cluster is up on this machine (hack/dev/leftovers.sh): make dev-down first"
if ! command -v go >/dev/null || ! command -v cargo >/dev/null; then die "this machine has no Go or Rust toolchain to lend"; fi
GOROOT_HOST=$(go env GOROOT)
RUSTUP_HOST=${RUSTUP_HOME:-$HOME/.rustup}
CARGO_BIN_HOST=$(dirname "$(command -v cargo)")
[[ -d $RUSTUP_HOST ]] || die "no rustup home at $RUSTUP_HOST (the toolchain is lent with its rustup proxies)"

# machine_pids: the processes of the fresh machine's mount namespace and their descendants (the
# containers its containerd starts have mount namespaces of their own).
machine_pids() {
  local ns
  [[ -e $NS ]] && ns=$(stat -L -c %i "$NS" 2>/dev/null) || return 0
  ps -e -o pid=,ppid= | while read -r pid ppid; do
    echo "$pid $ppid $(stat -L -c %i "/proc/$pid/ns/mnt" 2>/dev/null || echo -)"
  done | awk -v ns="$ns" '
    { parent[$1] = $2; if ($3 == ns) inside[$1] = 1 }
    END { for (p in parent) { q = p; while (q in parent && !(q in inside) && q > 1) q = parent[q]; if (q in inside) print p } }'
}

# stop_and_unmount: stops the fresh machine's processes (TERM, then KILL), unmounts all below DIR
# and its namespace.
stop_and_unmount() {
  local sig pids
  for sig in TERM KILL; do
    mapfile -t pids < <(machine_pids)
    ((${#pids[@]})) || break
    kill "-$sig" "${pids[@]}" 2>/dev/null || true
    sleep 5
  done
  [[ ! -e $NS ]] || umount "$NS" 2>/dev/null || true
  rm -f "$NS"
  # Deepest first; lazily, as a kubelet's Pod mounts may still be busy for a moment.
  findmnt -rn -o TARGET | grep -E "^$DIR(/|$)" | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
}

if [[ -d $DIR ]]; then
  stop_and_unmount
  rm -rf --one-file-system "$DIR"
fi
mkdir -p "$DIR"
# A new user's machine has what the README asks for: its free disk (a fresh run of make dev-up and
# make check filled 48 GB here, and the local MC then wants 9 GiB more) is checked before the
# hour-long run rather than at its end. CAPK_FRESH_MIN_FREE_GB lowers it for shorter commands.
min_free=${CAPK_FRESH_MIN_FREE_GB:-60}
free_gb=$(($(df -B1 --output=avail "$DIR" | tail -n 1) / 1000000000))
((free_gb >= min_free)) ||
  die "$free_gb GB free on the filesystem of $DIR; the README asks for $min_free GB (CAPK_FRESH_MIN_FREE_GB=N for less)"

mirror=${DEBIAN_MIRROR:-$(grep -hE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' | grep -v security | head -n 1)}
[[ -n $mirror ]] || die "no Debian mirror in apt's sources; set DEBIAN_MIRROR"
start=$SECONDS
log "debootstrap $SUITE (minbase, git, make, ca-certificates) into $DIR"
debootstrap --variant=minbase --include=git,make,ca-certificates "$SUITE" "$DIR" "$mirror" >"$DIR.debootstrap.log" 2>&1 ||
  { tail -n 20 "$DIR.debootstrap.log" >&2; die "debootstrap failed (log $DIR.debootstrap.log)"; }
rm -f "$DIR.debootstrap.log"
log "debootstrap done in $((SECONDS - start))s"
# A machine's / is a mount point (buildah remounts / private before it applies a layer), shared
# with nothing outside but shared inside, as a host's is.
mount --bind "$DIR" "$DIR"
mount --make-private "$DIR"

# What the machine's image gives every machine: apt's settings (the suite's own sources), the CA
# of the network's TLS inspection, DNS.
cp -a /etc/apt/apt.conf.d/. "$DIR/etc/apt/apt.conf.d/"
printf 'Types: deb\nURIs: %s\nSuites: %s %s-updates\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
  "$mirror" "$SUITE" "$SUITE" >"$DIR/etc/apt/sources.list.d/debian.sources"
rm -f "$DIR/etc/apt/sources.list"
cp -a /usr/local/share/ca-certificates/. "$DIR/usr/local/share/ca-certificates/"
chroot "$DIR" update-ca-certificates >/dev/null
cp /etc/resolv.conf "$DIR/etc/resolv.conf"
cp /etc/hosts "$DIR/etc/hosts"

# The toolchains, read-only at the places the README's install commands put them.
mkdir -p "$DIR/usr/local/go" "$DIR/root/.rustup" "$DIR/root/.cargo/bin" "$DIR/src"
mount --bind -o ro "$GOROOT_HOST" "$DIR/usr/local/go"
mount --bind -o ro "$RUSTUP_HOST" "$DIR/root/.rustup"
mount --bind -o ro "$CARGO_BIN_HOST" "$DIR/root/.cargo/bin"
mount -t proc proc "$DIR/proc"
mount --rbind /sys "$DIR/sys"
mount --make-rslave "$DIR/sys"
mount --rbind /dev "$DIR/dev"
mount --make-rslave "$DIR/dev"
mount -t tmpfs -o mode=0755 tmpfs "$DIR/run"

PATH_IN=/usr/local/go/bin:/root/.cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# shellcheck disable=SC2317 # the EXIT trap runs it
finish() {
  local rc=$?
  if ((KEEP)); then
    log "kept $DIR (a shell in it: nsenter --mount=$NS bash; hack/fresh-machine.sh removes it on its next run)"
  else
    log "make dev-down in the fresh machine, then removing it"
    [[ ! -e $NS ]] || nsenter --mount="$NS" /usr/bin/env -i HOME=/root PATH="$PATH_IN" bash -c 'cd /root/cluster-api-provider-kvm 2>/dev/null && make --no-print-directory dev-down' >/dev/null 2>&1 || true
    stop_and_unmount
    rm -rf --one-file-system "$DIR"
  fi
  exit "$rc"
}
trap finish EXIT

# A clean clone of HEAD, as a user clones it.
mount --bind -o ro "$ROOT" "$DIR/src"
chroot "$DIR" git clone --quiet /src /root/cluster-api-provider-kvm
umount "$DIR/src"
log "a clean clone of $(git -C "$ROOT" rev-parse --short HEAD) at /root/cluster-api-provider-kvm; running: $CMD"

# The machine's own mount namespace, with DIR as its root (what a container runtime does): kept
# in $NS so that dev-down enters the same one afterwards.
mkdir -p "$NS_DIR"
if ! mountpoint -q "$NS_DIR"; then
  mount --bind "$NS_DIR" "$NS_DIR"
  mount --make-private "$NS_DIR"
fi
touch "$NS"
# shellcheck disable=SC2016 # the script is the namespace's, $1 its argument
unshare --mount="$NS" --propagation private bash -c '
  set -e
  cd "$1"
  mkdir -p .host
  pivot_root . .host
  umount -l /.host
  rmdir /.host
  mount --make-rshared /' _ "$DIR"

start=$SECONDS
rc=0
nsenter --mount="$NS" /usr/bin/env -i HOME=/root PATH="$PATH_IN" TERM=dumb LANG=C.UTF-8 \
  GOFLAGS="${GOFLAGS:-}" GOTOOLCHAIN="${GOTOOLCHAIN:-auto}" CI="${CI:-}" \
  bash -c "cd /root/cluster-api-provider-kvm && $CMD" || rc=$?
log "'$CMD' exited $rc after $((SECONDS - start))s in the fresh $SUITE machine"
exit "$rc"
