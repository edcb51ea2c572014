# shellcheck shell=bash
# shellcheck disable=SC2034 # settings for the scripts that source this file
# Shared settings and helpers of the local management cluster (hack/dev-up.sh, hack/dev-down.sh,
# hack/dev/*.sh), on top of hack/lib/common.sh (ROOT, OUT, BIN, log, die, capk_buildah).
# Sourced, not run. Everything lives under _output/dev; nothing listens outside loopback and the
# node's own bridge, and nothing routes pod traffic off this machine.

LOG_NAME=dev
# shellcheck source=../lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/common.sh"

# CAPK_DEV_MC=2: the second management cluster (the target of `clusterctl move`), a
# second node beside the first on the same bridge: its own etcd, control plane, containerd and
# kubelet (own root, socket, ports and cgroup root), pods in 10.240.1.0/24, services in
# 10.98.0.0/16. It has no kube-proxy and no CoreDNS of its own: one DNAT rule sends its
# `kubernetes` Service to its apiserver, its apiserver reaches webhooks at their endpoints
# (--enable-aggregator-routing) and its pods resolve names with the first cluster's CoreDNS, where
# the control-plane Services of clusters it manages (hosted in the first) live.
MC=${CAPK_DEV_MC:-1}
case $MC in
  1)
    DEV=$OUT/dev
    NODE_NAME=capk-dev
    NODE_IP=10.240.0.1
    POD_CIDR=10.240.0.0/24
    SERVICE_CIDR=10.96.0.0/16
    KUBERNETES_SVC_IP=10.96.0.1
    ETCD_CLIENT_PORT=2379
    ETCD_PEER_PORT=2380
    CONTROLLER_MANAGER_PORT=10257
    SCHEDULER_PORT=10259
    KUBELET_HEALTHZ_PORT=10248
    # The kubelet's default cgroup root (/): its pods under /kubepods.
    CGROUP_ROOT=
    ;;
  2)
    DEV=$OUT/dev-mc2
    NODE_NAME=capk-dev-mc2
    NODE_IP=10.240.1.1
    POD_CIDR=10.240.1.0/24
    SERVICE_CIDR=10.98.0.0/16
    KUBERNETES_SVC_IP=10.98.0.1
    ETCD_CLIENT_PORT=2479
    ETCD_PEER_PORT=2480
    CONTROLLER_MANAGER_PORT=10357
    SCHEDULER_PORT=10359
    KUBELET_HEALTHZ_PORT=10348
    # Apart from the first kubelet's /kubepods: a kubelet kills what it finds in pod cgroups it
    # does not know.
    CGROUP_ROOT=/capk-mc2
    # The first cluster, which this one needs (bridge, firewall, DNS).
    DEV1=$OUT/dev
    ;;
  *)
    echo "CAPK_DEV_MC must be 1 or 2, not $MC" >&2
    exit 1
    ;;
esac
PKI=$DEV/pki
RUN=$DEV/run
LOGS=$DEV/logs

# The node's bridge: its address is the node IP, the apiserver's advertise/bind address and the
# pods' gateway. It exists only on this machine; pods' default route ends at it (see dev-up.sh's
# chains). Both management clusters' nodes and pods share it.
BRIDGE=capk0
CLUSTER_CIDR=10.240.0.0/16
# The first cluster's CoreDNS (kube-dns), the cluster DNS of both.
DNS_SVC_IP=10.96.0.10
APISERVER_PORT=6443
CONTAINERD_SOCK=$RUN/containerd.sock
# iptables chains of our own (filter table), hooked first into INPUT and FORWARD; the second
# cluster's DNAT of its `kubernetes` Service (nat table), hooked into PREROUTING.
FW_CHAIN_FORWARD=CAPK-DEV-FORWARD
FW_CHAIN_INPUT=CAPK-DEV-INPUT
NAT_CHAIN_MC2=CAPK-DEV-MC2

# The pause image: Debian's static catatonit in pause mode, built here (hack/dev/pause-image.sh).
# "localhost/" so that no lookup could ever leave this machine.
PAUSE_IMAGE=localhost/capk/pause:catatonit-0.1

export KUBECONFIG_ADMIN=$DEV/admin.kubeconfig

# pid_alive NAME: the pid file's process exists and still runs the binary we started.
pid_alive() {
  local f=$RUN/$1.pid pid
  [[ -f $f ]] || return 1
  pid=$(<"$f")
  [[ -n $pid && -r /proc/$pid/cmdline ]] || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "$(<"$RUN/$1.cmd")"
}

# SUPERVISOR: the daemons' supervisor (capk-supervise, hack/dev/supervise), which build_supervisor
# builds at the start of dev-up and copies out of Cargo's target directory: a daemon started later
# never waits for a cargo build that holds that directory.
SUPERVISOR=$DEV/bin/capk-supervise

build_supervisor() {
  local target
  require cargo jq
  target=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps --locked | jq -r .target_directory)
  (cd "$ROOT" && cargo build -q --locked -p capk-supervise) || die "cargo build -p capk-supervise failed"
  mkdir -p "${SUPERVISOR%/*}"
  # A new file moved over the old one: supervisors that run keep theirs.
  install -m 0755 "$target/debug/capk-supervise" "$SUPERVISOR.new"
  mv -f "$SUPERVISOR.new" "$SUPERVISOR"
}

# start_daemon NAME MATCH BINARY ARGS...: a supervised background process (capk-supervise:
# restarted with back-off whenever it exits, like systemd's Restart=always) with a pid file and a
# log file, unless it already runs. MATCH is a string its command line contains (checked on later
# runs). The pid file names the supervisor, which leads a process group of its own.
start_daemon() {
  local name=$1 match=$2
  shift 2
  if pid_alive "$name"; then
    log "$name already running (pid $(<"$RUN/$name.pid"), $(daemon_restarts "$name") restarts)"
    return 0
  fi
  mkdir -p "$RUN" "$LOGS"
  printf '%s' "$match" >"$RUN/$name.cmd"
  rm -f "$RUN/$name.child"
  # setsid: own session and process group, so a Ctrl-C in the calling shell does not reach it and
  # stop_daemon can signal the supervisor and its run together.
  [[ -x $SUPERVISOR ]] || die "$SUPERVISOR missing: hack/dev-up.sh builds it (make dev-up)"
  CAPK_DEV_RUN=$RUN setsid "$SUPERVISOR" "$name" "$@" </dev/null >>"$LOGS/$name.log" 2>&1 &
  local pid=$!
  echo "$pid" >"$RUN/$name.pid"
  sleep 0.5
  if ! kill -0 "$pid" 2>/dev/null || [[ $(daemon_restarts "$name") != 0 ]]; then
    tail -n 20 "$LOGS/$name.log" >&2
    stop_daemon "$name" 5
    die "$name exited at once (log ${LOGS#"$ROOT"/}/$name.log)"
  fi
  log "$name started (pid $pid, log ${LOGS#"$ROOT"/}/$name.log)"
}

# daemon_restarts NAME: how often the supervisor restarted NAME since it started.
daemon_restarts() { cat "$RUN/$1.restarts" 2>/dev/null || echo 0; }

# serve NAME TIMEOUT_S START_FN CHECK...: START_FN starts NAME (start_daemon, a no-op when it runs),
# then wait until CHECK (its health check) succeeds. A daemon whose process runs but does not serve
# (hung, or crash-looping under its supervisor) is stopped and started again once and given
# TIMEOUT_S more; still failing is fatal, with the end of its log.
serve() {
  local name=$1 timeout=$2 start_fn=$3 attempt start
  shift 3
  for attempt in 1 2; do
    "$start_fn"
    start=$SECONDS
    until "$@" >/dev/null 2>&1; do
      ((SECONDS - start < timeout)) || break
      sleep 0.5
    done
    if "$@" >/dev/null 2>&1; then
      log "$name serving after $((SECONDS - start))s ($(daemon_restarts "$name") restarts)"
      return 0
    fi
    tail -n 20 "$LOGS/$name.log" >&2
    if ((attempt == 1)); then
      log "$name is not serving after ${timeout}s ($(daemon_restarts "$name") restarts; check: $*): restarting it"
      stop_daemon "$name" 30
    fi
  done
  die "$name is not serving after a restart ($(daemon_restarts "$name") restarts; check: $*; log ${LOGS#"$ROOT"/}/$name.log)"
}

# running PID: the process exists and is not a zombie waiting for its (re)parent to reap it.
running() {
  local state
  state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
  [[ -n $state && $state != Z ]]
}

# stop_daemon NAME [TIMEOUT]: SIGTERM to the supervisor's process group (it and the daemon), wait,
# then SIGKILL the group. Only the process group of our pid file.
stop_daemon() {
  local name=$1 timeout=${2:-20} pid child i
  if pid_alive "$name"; then
    pid=$(<"$RUN/$name.pid")
    child=$(cat "$RUN/$name.child" 2>/dev/null || true)
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < timeout * 10; i++)); do
      running "$pid" || { [[ -n $child ]] && running "$child"; } || break
      sleep 0.1
    done
    if running "$pid" || { [[ -n $child ]] && running "$child"; }; then
      log "$name (pid $pid) did not stop in ${timeout}s; SIGKILL"
      kill -KILL -- "-$pid" 2>/dev/null || true
      if [[ -n $child ]]; then kill -KILL "$child" 2>/dev/null || true; fi
      sleep 0.5
    fi
    log "$name stopped"
  fi
  rm -f "$RUN/$name.pid" "$RUN/$name.cmd" "$RUN/$name.child"
}

# wait_for DESCRIPTION TIMEOUT_S COMMAND...: poll until COMMAND succeeds.
wait_for() {
  local what=$1 timeout=$2 start=$SECONDS
  shift 2
  until "$@" >/dev/null 2>&1; do
    ((SECONDS - start < timeout)) || die "timed out after ${timeout}s waiting for $what"
    sleep 0.5
  done
  log "$what: ok after $((SECONDS - start))s"
}

# write_config FILE DAEMON < content: replace FILE only when the content differs (kube-proxy exits
# when its config file changes under it), and then stop DAEMON if it runs so it restarts with it.
write_config() {
  local file=$1 daemon=$2 tmp
  tmp=$(mktemp "$file.XXXXXX")
  cat >"$tmp"
  if [[ -f $file ]] && cmp -s "$tmp" "$file"; then
    rm -f "$tmp"
    return 0
  fi
  mv "$tmp" "$file"
  if pid_alive "$daemon"; then
    log "${file#"$ROOT"/} changed: restarting $daemon"
    stop_daemon "$daemon" 30
  fi
}

kc() { "$BIN/kubectl" --kubeconfig "$KUBECONFIG_ADMIN" "$@"; }

# require_disk GIB WHO: dies unless the filesystem of $OUT has GIB GiB free above the 2 % where the
# MC's kubelet evicts Pods and deletes images (kubelet-config.yaml, hack/dev-up.sh), which nothing
# here can pull back: said at once, not as an ImagePullBackOff later. WHO is what needs it.
require_disk() {
  local gib=$1 who=$2 size avail need
  mkdir -p "$OUT"
  read -r size avail < <(df -B1 --output=size,avail "$OUT" | tail -n 1)
  need=$((size / 50 + gib * 1024 * 1024 * 1024))
  ((avail >= need)) ||
    die "$((avail / 1024 / 1024)) MiB free on the filesystem of ${OUT#"$ROOT"/}; $who needs $((need / 1024 / 1024)) MiB ($gib GiB above the 2 % where the MC's kubelet deletes images): free some space (df -h $OUT) and run make dev-up again"
}
ctr_k8s() { ctr --address "$CONTAINERD_SOCK" -n k8s.io "$@"; }

# ctr_has_image NAME [FILTER...]: whether containerd (k8s.io) lists NAME (among the images FILTER
# selects). The list is read in full before it is searched: `ctr … | grep -q` under pipefail
# fails when grep exits at the first match and ctr then dies of SIGPIPE, so a present image
# looked missing.
ctr_has_image() {
  local name=$1 list
  shift
  list=$(ctr_k8s images ls -q "$@") || return 1
  grep -qxF -- "$name" <<<"$list"
}

# oci_image_import NAME WORK CREATED_BY CONFIG_FLAG...: WORK/rootfs as the one layer of the image
# NAME (reproducible tar: fixed order, owner and mtime), configured by `buildah config` flags (e.g.
# --entrypoint '["/x"]') with CREATED_BY as its history, committed with buildah and imported into
# containerd's k8s.io namespace. No registry is involved.
oci_image_import() {
  local name=$1 work=$2 created_by=$3
  shift 3
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$work/rootfs" -cf "$work/layer.tar" .
  buildah_image "$name" scratch "$work/layer.tar" --created-by "$created_by" "$@"
  rm -f "$work/image.oci.tar"
  capk_buildah push --quiet "$name" "oci-archive:$work/image.oci.tar:$name" >/dev/null
  # --base-name: the archive's reference (the full NAME) is kept as the image's name.
  ctr_k8s images import --base-name "${name%:*}" "$work/image.oci.tar" >/dev/null
  rm -f "$work/layer.tar" "$work/image.oci.tar"
  ctr_has_image "$name" || die "import did not produce $name"
}

# binary_image IMAGE BINARY CREATED_BY CONFIG_FLAG...: IMAGE in containerd (k8s.io) made of the one
# static BINARY at /NAME (its file name; the entrypoint) and an empty /tmp, configured by `buildah
# config` flags, unless containerd already has IMAGE labelled with BINARY's digest: a rebuilt
# binary is imported again. Prints that digest (for a Pod annotation that rolls a Deployment).
binary_image() {
  local image=$1 binary=$2 created_by=$3 digest work
  shift 3
  digest=$(sha256sum "$binary" | cut -c1-16)
  if ! ctr_has_image "$image" "name==$image,labels.\"capk.binary\"==$digest" 2>/dev/null; then
    work=$DEV/images/$(basename "$binary")
    rm -rf "$work"
    mkdir -p "$work/rootfs/tmp"
    chmod 1777 "$work/rootfs/tmp"
    install -m 0755 "$binary" "$work/rootfs/$(basename "$binary")"
    oci_image_import "$image" "$work" "$created_by" --entrypoint "[\"/$(basename "$binary")\"]" --cmd '' --workingdir / "$@"
    ctr_k8s images label "$image" "capk.binary=$digest" >/dev/null
    rm -rf "$work"
    log "image $image imported"
  fi
  echo "$digest"
}
