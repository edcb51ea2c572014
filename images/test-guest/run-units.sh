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
# - StandardOutput= and StandardError= decide where the commands' output goes, with systemd's
#   defaults (DefaultStandardOutput=journal, DefaultStandardError=inherit): `journal`, `kmsg` and
#   `syslog` to the emulated journal only, their `+console` forms to the journal and the console,
#   `tty` to the console, `null` nowhere, `append:`/`file:`/`truncate:` to that file; `inherit`
#   for StandardError= means StandardOutput='s destination. The journal is the file
#   /run/log/journal.txt in the root (journald keeps its volatile journal under /run/log), one
#   line per output line, `<unit>: <line>`; nothing copies it to the console (journald's
#   ForwardToConsole=no). When a oneshot unit finishes, its journal lines are summarised on the
#   console without their text: `journal unit=<u> lines=<n> token-sha256=<digests>`, the sha256
#   of each distinct bootstrap-token-shaped word ([a-z0-9]{6}.[a-z0-9]{16}) in them;
# - every other key (Environment=, User=, Wants=, Before=, timeouts, ...) is ignored and named on
#   the console.
ROOT=/sysroot
UNITS=$ROOT/etc/systemd/system
PRESET=$ROOT/etc/systemd/system-preset/20-ignition.preset
JOURNAL=$ROOT/run/log/journal.txt
mkdir -p "${JOURNAL%/*}"
: >>"$JOURNAL"
chmod 0640 "$JOURNAL"
say() { echo "CAPK-TESTGUEST $*" >/dev/console; }

# shellcheck disable=SC2046,SC2012 # drop-in names have no spaces; none is an empty list
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

# sink UNIT DEST: copies stdin to where systemd sends a unit's output for the setting DEST.
sink() {
  case $2 in
    journal | kmsg | syslog) to_journal "$1" ;;
    journal+console | kmsg+console | syslog+console) to_journal "$1" console ;;
    tty) cat >/dev/console ;;
    null) cat >/dev/null ;;
    append:/*) cat >>"$ROOT${2#append:}" ;;
    file:/* | truncate:/*) cat >"$ROOT${2#*:}" ;;
    *) to_journal "$1" ;;
  esac
}

# to_journal UNIT [console]: appends each line to the journal as `UNIT: line` (and, with
# `console`, writes the line as it is to the console). Line by line, unbuffered, so a line is
# in the journal as soon as the command wrote it.
to_journal() {
  while IFS= read -r l || [ -n "$l" ]; do
    printf '%s: %s\n' "$1" "$l" >>"$JOURNAL"
    [ -n "$2" ] && printf '%s\n' "$l" >/dev/console
  done
}

# output UNIT: the StandardOutput= and StandardError= destinations (systemd's defaults when
# unset; StandardError=inherit resolved to StandardOutput's).
output() {
  out=$(values StandardOutput "$1" | tail -1)
  err=$(values StandardError "$1" | tail -1)
  out=${out:-journal}
  case ${err:-inherit} in inherit) err=$out ;; esac
  echo "$out $err"
}

run_line() {
  line=$1 unit=$2 ignore=
  while :; do
    case $line in
      -*) ignore=1; line=${line#-} ;;
      [+!:]*) line=${line#?} ;;
      *) break ;;
    esac
  done
  # shellcheck disable=SC2046 # the output's words are the positional parameters
  set -- $(output "$unit")
  rcf=$(mktemp /run/run-units.rc.XXXXXX)
  if [ "$1" = "$2" ]; then
    { in_root /bin/sh -c "$line" </dev/null 2>&1; echo $? >"$rcf"; } | sink "$unit" "$1"
  else
    # stdout to fd 3 (the StandardOutput= sink), stderr to the StandardError= sink.
    { { in_root /bin/sh -c "$line" </dev/null; echo $? >"$rcf"; } 2>&1 >&3 3>&- | sink "$unit" "$2"; } 3>&1 | sink "$unit" "$1"
  fi
  rc=$(cat "$rcf")
  rm -f "$rcf"
  [ -n "$ignore" ] && rc=0
  return "${rc:-1}"
}

# run_all KEY UNIT: runs the KEY lines in order, stops at the first failure.
run_all() {
  values "$1" "$2" | while IFS= read -r line; do run_line "$line" "$2" || exit 1; done
}

# journal_report UNIT: how many journal lines UNIT wrote and the sha256 of each distinct
# bootstrap-token-shaped word in them (never the words themselves: they are secrets).
journal_report() {
  lines() { awk -v p="$1: " 'index($0, p) == 1 { print substr($0, length(p) + 1) }' "$JOURNAL"; }
  mine=$(lines "$1" | wc -l)
  digests=$(lines "$1" | tr -c 'a-z0-9.' '\n' | grep -xE '[a-z0-9]{6}[.][a-z0-9]{16}' | sort -u |
    while IFS= read -r t; do printf '%s' "$t" | sha256sum | cut -d' ' -f1; done | tr '\n' ',' | sed 's/,$//')
  say "journal unit=$1 lines=$mine token-sha256=${digests:-none}"
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
    journal_report "$u"
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
early='' late=''
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
  # shellcheck disable=SC2086,SC2116 # $pending is a space-separated list of unit names
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
# shellcheck disable=SC2086 # space-separated lists of unit names
run_phase $early
# shellcheck disable=SC2086
run_phase $late
