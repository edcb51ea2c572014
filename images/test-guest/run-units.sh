#!/bin/sh
# Starts the systemd units Ignition enabled in /sysroot, in place of systemd: the test guest has
# no systemd. It does exactly this, and nothing else (images/test-guest/README.md):
# - reads the `enable` lines of Ignition's preset file /etc/systemd/system-preset/20-ignition.preset;
# - .mount units are not started (their filesystems would come from Ignition's disks stage, which
#   this guest does not run; 9p is not in this kernel): each is reported with its What=;
# - services: those wanted by sysinit.target first, then the rest; a unit waits for the enabled
#   units its After= names; ConditionPathExists= (also negated), Type=oneshot|simple,
#   ExecStartPre=, ExecStart=, ExecStopPost=, Restart=always|on-failure, RestartSec= and the `-`
#   prefix are honoured; drop-ins (<unit>.d/*.conf) are read and an empty Exec*= resets the list;
# - each command line runs as `/bin/sh -c LINE` in `chroot /sysroot` with a clean environment
#   (systemd uses no shell; for the lines CABPK and capk-bootstrap write the quoting is the same;
#   systemd's %-specifiers and $VAR expansion are not done);
# - every other key (Environment=, User=, Wants=, Before=, timeouts, ...) is ignored and named on
#   the console.
ROOT=/sysroot
UNITS=$ROOT/etc/systemd/system
PRESET=$ROOT/etc/systemd/system-preset/20-ignition.preset
say() { echo "CAPK-TESTGUEST $*" >/dev/console; }

unit_text() { cat "$UNITS/$1" $(ls "$UNITS/$1.d/"*.conf 2>/dev/null | sort) 2>/dev/null; }

# values KEY UNIT: the values of KEY, one per line; an empty assignment clears the earlier ones.
values() {
  unit_text "$2" | awk -v k="$1" 'index($0, k "=") == 1 {
    v = substr($0, length(k) + 2); if (v == "") n = 0; else l[n++] = v
  } END { for (i = 0; i < n; i++) print l[i] }'
}

ignored_keys() {
  unit_text "$1" | awk -F= '/^[A-Za-z]+=/ { print $1 }' | sort -u |
    grep -vxE 'Description|Documentation|After|ConditionPathExists|Type|ExecStartPre|ExecStart|ExecStopPost|Restart|RestartSec|RemainAfterExit|StandardOutput|StandardError|WantedBy|RequiredBy' |
    tr '\n' ' ' | sed 's/ $//'
}

in_root() { chroot "$ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root "$@"; }

run_line() {
  line=$1 ignore=
  while :; do
    case $line in
      -*) ignore=1; line=${line#-} ;;
      [+!:]*) line=${line#?} ;;
      *) break ;;
    esac
  done
  in_root /bin/sh -c "$line" </dev/null >/dev/console 2>&1
  rc=$?
  [ -n "$ignore" ] && rc=0
  return $rc
}

# run_all KEY UNIT: runs the KEY lines in order, stops at the first failure.
run_all() {
  values "$1" "$2" | while IFS= read -r line; do run_line "$line" || exit 1; done
}

start() {
  u=$1
  for c in $(values ConditionPathExists "$u"); do
    case $c in
      !*) in_root test -e "${c#!}" && { say "unit=$u skipped condition ConditionPathExists=$c"; return 0; } ;;
      *) in_root test -e "$c" || { say "unit=$u skipped condition ConditionPathExists=$c"; return 0; } ;;
    esac
  done
  ign=$(ignored_keys "$u")
  [ -n "$ign" ] && say "unit=$u ignored-keys=$ign"
  type=$(values Type "$u" | tail -1)
  type=${type:-simple}
  say "unit=$u starting type=$type"
  if [ "$type" = oneshot ]; then
    result=success
    { run_all ExecStartPre "$u" && run_all ExecStart "$u"; } || result=failed
    run_all ExecStopPost "$u"
    say "unit=$u finished result=$result"
    return 0
  fi
  restart=$(values Restart "$u" | tail -1)
  sec=$(values RestartSec "$u" | tail -1)
  (
    run_all ExecStartPre "$u" || exit 1
    while :; do
      run_all ExecStart "$u"
      rc=$?
      run_all ExecStopPost "$u"
      case $restart in always) ;; on-failure) [ "$rc" -ne 0 ] || break ;; *) break ;; esac
      say "unit=$u restarting after exit $rc"
      sleep "${sec:-1}"
    done
    say "unit=$u exited rc=$rc"
  ) &
}

[ -f "$PRESET" ] || { say "units none-enabled"; exit 0; }
early= late=
while IFS= read -r line; do
  case $line in enable\ *) ;; *) continue ;; esac
  u=${line#enable }
  case $u in
    *\ *) say "unit=$u not-started reason=instantiated units are not supported" ;;
    *.mount) say "unit=$u not-started reason=mount units are not run (What=$(values What "$u" | tail -1))" ;;
    *.service)
      if [ ! -f "$UNITS/$u" ]; then
        say "unit=$u not-started reason=no unit file (it would come with the OS image)"
      elif values WantedBy "$u" | grep -qw sysinit.target; then early="$early $u"
      else late="$late $u"; fi ;;
    *) say "unit=$u not-started reason=unsupported unit type" ;;
  esac
done <"$PRESET"

# run_phase UNITS...: starts each unit once the enabled units named in its After= have started.
run_phase() {
  pending=" $* "
  while [ -n "$(echo $pending)" ]; do
    next=
    for u in $pending; do
      ready=1
      for a in $(values After "$u"); do
        [ "$a" != "$u" ] && case $pending in *" $a "*) ready= ;; esac
      done
      [ -n "$ready" ] && { next=$u; break; }
    done
    if [ -z "$next" ]; then
      set -- $pending
      next=$1
      say "unit=$next starting despite an After= cycle"
    fi
    rest=
    for x in $pending; do [ "$x" = "$next" ] || rest="$rest $x"; done
    pending="$rest "
    start "$next"
  done
}
run_phase $early
run_phase $late
