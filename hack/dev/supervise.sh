#!/usr/bin/env bash
# Keeps one daemon of the local management cluster running, as systemd's `Restart=always` would:
#
#   supervise.sh NAME COMMAND [ARGS...]
#
# Runs COMMAND; when it exits for any reason, it is started again after a back-off (1 s, doubled
# up to 30 s, back to 1 s once a run lasted 60 s). Every exit and restart is written to the
# daemon's log (this script's stdout/stderr, which start_daemon points at LOGS/NAME.log) and counted
# in RUN/NAME.restarts; RUN/NAME.child holds the pid of the current run. SIGTERM or SIGINT stops
# the current run and then this script. start_daemon starts it in a session of its own, so
# stop_daemon signals the whole process group (this script and its run) at once.
set -uo pipefail

name=$1
shift
RUN=${CAPK_DEV_RUN:?CAPK_DEV_RUN must name the run directory}

# Descriptors the caller of dev-up left open (3 and up) are not the daemon's: a `flock` held
# around `make dev-up` stayed held by every daemon until dev-down, and a pipe (`make dev-up |
# tee`) would never see its end.
for fd in "/proc/$$/fd"/*; do
  fd=${fd##*/}
  ((fd > 2)) && eval "exec $fd>&-" 2>/dev/null
done

stopping=0
child=0
on_stop() {
  stopping=1
  if ((child > 0)); then kill -TERM "$child" 2>/dev/null; fi
}
trap on_stop TERM INT

stamp() { date -u +%Y-%m-%dT%H:%M:%SZ; }

delay=1
restarts=0
echo 0 >"$RUN/$name.restarts"
while :; do
  started=$SECONDS
  "$@" &
  child=$!
  echo "$child" >"$RUN/$name.child"
  # `wait` returns early (status > 128) when a trapped signal arrives; wait until the run is gone.
  wait "$child"
  rc=$?
  while kill -0 "$child" 2>/dev/null; do
    wait "$child"
    rc=$?
  done
  ((stopping)) && exit 0
  up=$((SECONDS - started))
  ((up >= 60)) && delay=1
  restarts=$((restarts + 1))
  echo "$restarts" >"$RUN/$name.restarts"
  echo "$(stamp) supervise: $name exited with status $rc after ${up}s; restart $restarts in ${delay}s"
  sleep "$delay" &
  wait $! 2>/dev/null
  ((stopping)) && exit 0
  delay=$((delay * 2 > 30 ? 30 : delay * 2))
done
