#!/bin/sh
# gpumemctl top and the progress line of pause, through a real terminal:
# tmux runs them in a detached session of a fixed size on a server of this
# run's own, and capture-pane reads the screen back. A daemon on the host
# backend with real workers (and a process holding device memory outside
# gpumemd) gives them something to show. Every wait polls the screen for
# what should appear, with a deadline.
#   GPUMEM_BUILD   the build to test (default build/)
#   GPUMEM_NO_APT  where nothing may be installed: no tmux skips, saying so
set -eu
cd "$(dirname "$0")/../.."
build=${GPUMEM_BUILD:-$(pwd)/build}
bin=$build/bin
ctl=$bin/gpumemctl

if ! command -v tmux >/dev/null 2>&1; then
  if [ -n "${GPUMEM_NO_APT:-}" ]; then
    echo "check_top: skipped: no tmux here and GPUMEM_NO_APT set"
    exit 0
  fi
  echo "FAIL: check_top: tmux is missing (make deps installs it)"
  exit 1
fi

GPUMEM_BUILD=$build
. ./tests/others.sh
. ./tools/children.sh
t=$(mktemp -d "${TMPDIR:-/tmp}/gpumemd-top.XXXXXX")
sock=$t/gpumemd.sock
t0=$(date +%s)
pids=""
cleanup() {
  tmux -S "$t/tmux.sock" kill-server 2>/dev/null || true
  children_signal CONT $pids
  children_signal TERM $pids
  for p in $pids; do wait "$p" 2>/dev/null || true; done
  [ -n "${KEEP:-}" ] || rm -rf "$t"
  others_cleanup
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

fail() {
  echo "FAIL: check_top: $*"
  if [ -s "$t/screen" ]; then echo "--- the screen:"; cat "$t/screen"; echo "---"; fi
  if [ -s "$t/daemon.log" ]; then echo "--- daemon log (end):"; tail -20 "$t/daemon.log"; fi
  exit 1
}

# tmux on this run's own server, never the user's.
tmx() { tmux -S "$t/tmux.sock" -f /dev/null "$@"; }

# Poll until "$@" succeeds, for at most 15 s; $what says what was awaited.
await() {
  deadline=$(($(date +%s) + 15))
  until "$@"; do
    [ "$(date +%s)" -lt "$deadline" ] || fail "timed out waiting for $what"
    sleep 0.05
  done
}

# True when the screen of pane $1 (captured to $t/screen) has a line
# matching the extended regex $2. The pane's history is read too: tmux
# scrolls a line away when it marks a pane dead.
screen_has() {
  tmx capture-pane -p -S - -t "$1" >"$t/screen" 2>/dev/null && grep -Eq -- "$2" "$t/screen"
}

# Wait until pane $1 shows $2; $3 says what that is.
see() {
  what="$3 (/$2/ in pane $1)"
  await screen_has "$1" "$2"
}

# True when pane $1's command has ended.
pane_dead() { [ "$(tmx display -p -t "$1" '#{pane_dead}')" = 1 ]; }

# The text "$1" is not on pane $2's screen now.
not_on_screen() {
  tmx capture-pane -p -t "$2" >"$t/screen"
  ! grep -Fq -- "$1" "$t/screen" || fail "$3"
}

# A file appears with a line matching $2.
file_has() { grep -Eq -- "$2" "$1" 2>/dev/null; }

# Start gpumemd on the host backend, and wait for its socket.
start_daemon() {
  "$bin/gpumemd" --socket "$sock" --backend host --host-devices 2 --host-device-size 2G \
    --log-level info >>"$t/daemon.log" 2>&1 &
  daemon=$!
  pids="$pids $daemon"
  what="gpumemd's socket"
  await test -S "$sock"
}

# Start a worker: name, tag, size, device, then any other options; waits
# until it is ready and leaves its pid in $worker. Each runs in a session
# of its own (setsid: the same pid), so that a worker stopped for a test
# gets no signal sent to this script's process group: the kernel sends
# SIGHUP and SIGCONT to the stopped members of a group that becomes
# orphaned, and a stopped worker that died of it once let a pause through.
start_worker() {
  name=$1 tag=$2 size=$3 dev=$4
  shift 4
  setsid "$bin/gpumem-worker" --socket "$sock" --name "$name" --tag "$tag" --size "$size" \
    --device "$dev" "$@" >"$t/$name.log" 2>&1 &
  worker=$!
  pids="$pids $worker"
  what="worker $name"
  await file_has "$t/$name.log" '^ready$'
}

# gpumemctl top in a tmux window of 100x30: what it shows, how it follows
# the daemon, a resize and a restart, and how it leaves the terminal.
check_view() {
  # --- Top with stdout not a terminal (stdin is one): the error, exit 2.
  # Its exit status goes to a file too: a pane whose shell ends at once
  # was seen dead with the last line never drawn, on a loaded machine.
  tmx new-window -t top -n notty \
    "'$ctl' --socket '$sock' top >'$t/pane.out' 2>'$t/pane.err'; echo \"notty exited \$?\" | tee '$t/notty.rc'"
  what="top with stdout not a terminal exiting 2"
  await file_has "$t/notty.rc" '^notty exited 2$'
  [ ! -s "$t/pane.out" ] || fail "top wrote to a stdout that is not a terminal: $(cat "$t/pane.out")"
  grep -q 'top needs a terminal (its stdout is not one)' "$t/pane.err" ||
    fail "top with stdout not a terminal said: $(cat "$t/pane.err")"

  # --- A terminal type curses does not know: said, exit 2.
  tmx new-window -t top -n badterm \
    "TERM=no-such-term '$ctl' --socket '$sock' top; echo \"badterm exited \$?\""
  see top:badterm '^badterm exited 2$' "top on an unknown terminal type exiting 2"
  grep -q "^gpumemctl: top: cannot drive terminal type 'no-such-term'$" "$t/screen" ||
    fail "top on an unknown terminal type did not say so"

  # --- Top in a 100x30 terminal: the device bars, the tags, the holder.
  printf '%s\n' "stty -g >'$t/stty.before'" "'$ctl' --socket '$sock' top --interval 300ms" \
    'echo "top exited $?"' "stty -g >'$t/stty.after'" 'read -r line' >"$t/top.sh"
  tmx new-window -t top -n view "sh '$t/top.sh'"
  see top:view '^device 0 +\[#+\.+\] +2\.00 GiB$' "device 0's bar"
  see top:view '^ +# managed 0\.25 GiB .*% unmanaged .*\. free ' "device 0's figures"
  see top:view '^device 1 +\[#+\.+\] +2\.00 GiB$' "device 1's bar"
  see top:view '^kv_cache +ACTIVE +256 MiB +0 B +0 B +0 B$' "the kv_cache row"
  see top:view '^weights +ACTIVE +64\.0 MiB +0 B +0 B +0 B$' "the weights row"
  see top:view '^hog\?\[31m +[0-9]+ 0 +64\.0 MiB$' "the process holding memory outside, its name made text by gpumemd"
  see top:view 'no pause or resume since gpumemd started' "an empty list of operations"

  # --- Without a controller's rights (uid nobody), top looks through a plain
  # session, as status does: the devices, and none of root's tags. Ctrl-C
  # quits it (its shell ignores SIGINT, so as to say how top exited).
  others_setup
  nobody_ctl=${GPUMEM_OTHERS_BUILD:-$build}/bin/gpumemctl
  if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null 2>&1 &&
     setpriv --reuid=65534 --regid=65534 --clear-groups test -x "$nobody_ctl"; then
    chmod 755 "$t"
    chmod 666 "$sock"
    tmx new-window -t top -n nobody "trap '' INT; setpriv --reuid=65534 --regid=65534 \
      --clear-groups '$nobody_ctl' --socket '$sock' top; echo \"nobody exited \$?\" | tee '$t/nobody.rc'"
    see top:nobody '^no tags of yours ' "no tags of root's in top run by nobody"
    see top:nobody '^device 0 \[' "the devices in top run by nobody"
    tmx send-keys -t top:nobody C-c
    what="top run by nobody exiting 0 on Ctrl-C"
    await file_has "$t/nobody.rc" '^nobody exited 0$'
  else
    echo "check_top: not root, no setpriv, or nobody cannot run gpumemctl: top without a controller's rights not tried"
  fi

  # --- A pause from outside: the tag turns PAUSED, the pause is listed.
  "$ctl" --socket "$sock" pause kv_cache >"$t/pause.out" 2>&1 || fail "pause: $(cat "$t/pause.out")"
  see top:view '^kv_cache +PAUSED +256 MiB +256 MiB +0 B +0 B$' "kv_cache PAUSED"
  see top:view '^[0-9]{2}:[0-9]{2}:[0-9]{2} pause +kv_cache +256 MiB +[0-9.]+ m?s +[0-9.-]+ OK$' \
    "the pause in the recent list"
  see top:view '^device 0 +\[\.+\] +2\.00 GiB$' "device 0 free after the pause"

  # --- A resize redraws to the new width: the bar still ends with the total.
  tmx resize-window -t top:view -x 72 -y 22
  see top:view '^device 0 +\[\.{20,}\] +2\.00 GiB$' "device 0's bar redrawn at 72 columns"
  awk 'length > 72 { exit 1 }' "$t/screen" || fail "lines wider than the resized window"
  see top:view '^kv_cache +PAUSED ' "the tags after the resize"

  # --- The daemon goes away: said, and asked again until it is back.
  kill "$daemon"
  wait "$daemon" 2>/dev/null || true
  see top:view '^gpumemd not answering: ' "gpumemd not answering"
  see top:view '^retrying every 300 ms' "retrying"
  start_daemon
  see top:view '^kv_cache +PAUSED +256 MiB ' "the tags again from the restarted daemon"
  see top:view '^weights +ACTIVE +64\.0 MiB ' "weights re-registered"
  # The stuck workers too, whole (their hooks ran), before check_progress
  # stops them: one stopped in the middle of its re-registration was once
  # seen to let a pause through on a loaded machine.
  for n in stuck-a stuck-b stuck-c; do
    what="worker $n re-registered"
    await file_has "$t/$n.log" '^re-registered 1 buffers with gpumemd$'
  done

  # --- More tags than rows: the last row says which are shown, and PgDn,
  # End and Home page through them (40 more, of 40 workers).
  pagers=
  for i in $(seq 10 49); do
    start_worker "pager$i" "p$i" 1M 0 --no-verify
    pagers="$pagers $worker"
  done
  see top:view '^tags 1-[0-9]+ of 4[0-9] \(PgDn, PgUp, Home, End\)$' "the tags shown of 40 and more"
  see top:view '^kv_cache +PAUSED ' "the first tag by name on the first page"
  tmx send-keys -t top:view NPage
  see top:view '^tags ([2-9]|[1-9][0-9]+)-[0-9]+ of 4[0-9] ' "the next page"
  tmx send-keys -t top:view End
  see top:view '^weights +ACTIVE ' "the last tag by name on the last page"
  see top:view '^tags [0-9]+-([0-9]+) of \1 ' "the last page's rows up to the last tag"
  tmx send-keys -t top:view Home
  see top:view '^kv_cache +PAUSED ' "the first page again"
  kill $pagers
  for p in $pagers; do wait "$p" 2>/dev/null || true; done
  see top:view '^weights +ACTIVE ' "every tag on one page once the 40 are gone"
  not_on_screen '(PgDn, PgUp, Home, End)' top:view "the row of which tags are shown, once all fit"

  # --- q quits with status 0 and leaves the terminal as it was (the pane's
  # script then waits for a line, so that the live pane can be looked at).
  tmx send-keys -t top:view q
  see top:view '^top exited 0$' "top exiting 0 on q"
  what="the terminal modes after top"
  await test -s "$t/stty.after"
  [ "$(tmx display -p -t top:view '#{alternate_on}')" = 0 ] || fail "still on the alternate screen"
  [ "$(tmx display -p -t top:view '#{cursor_flag}')" = 1 ] || fail "the cursor left hidden"
  cmp -s "$t/stty.before" "$t/stty.after" ||
    fail "terminal modes changed: $(cat "$t/stty.before") -> $(cat "$t/stty.after")"
  not_on_screen 'TAG ' top:view "top's screen left behind after it quit"
  tmx send-keys -t top:view Enter
  what="the pane of top to end"
  await pane_dead top:view
}

# The progress line of pause: a pause that waits on a stopped worker
# (until --timeout), with stderr a file, a terminal, and under --json.
check_progress() {
  # stderr not a terminal: no line at all.
  kill -STOP "$stuck_a"
  rc=0
  "$ctl" --socket "$sock" pause --timeout 2s stuck_a >"$t/stuck_a.out" 2>"$t/stuck_a.err" || rc=$?
  kill -CONT "$stuck_a"
  [ "$rc" -eq 1 ] && grep -q 'CLIENT_TIMEOUT' "$t/stuck_a.err" ||
    fail "pause of a stopped worker's tag exited $rc: $(cat "$t/stuck_a.err")"
  ! grep -q 'pausing' "$t/stuck_a.err" || fail "a progress line on a stderr that is no terminal"

  # On a terminal: the line appears after a second, advances, and is gone
  # when the pause ends. pipe-pane keeps all that was written to the pane.
  kill -STOP "$stuck_b"
  tmx new-window -t top -n progress \
    "'$ctl' --socket '$sock' pause --timeout 3s stuck_b; echo \"pause exited \$?\""
  tmx pipe-pane -t top:progress -o "cat >>'$t/progress.log'"
  see top:progress '^pausing stuck_b: [0-9.]+ [KMG]?i?B of 8\.00 MiB, [0-9]+\.[0-9] s$' \
    "the progress line"
  see top:progress '^pause exited 1$' "the pause failing at its timeout"
  kill -CONT "$stuck_b"
  not_on_screen 'pausing stuck_b' top:progress "the progress line not cleared"
  screen_has top:progress '^gpumemctl: pause failed: CLIENT_TIMEOUT' ||
    fail "the failure not said on a line of its own"
  # What was written, split at each carriage return: the line first after a
  # second, rewritten, then blanked before the failure is said.
  tr '\r' '\n' <"$t/progress.log" | awk '
    /^pausing stuck_b: / { n++; if (n == 1 && $NF != "s") exit 1
                           if (n == 1 && $(NF - 1) + 0 < 1.0) exit 1
                           l = $0; sub(/ +$/, "", l) # its padding blanks a longer one before
                           last = length(l); blank = 0; next }
    n && !blank && /^ +$/ { blank = length($0) >= last; next }
    n && blank && /^gpumemctl: pause failed: CLIENT_TIMEOUT/ { ok = 1 }
    END { exit !(ok && n >= 2) }' ||
    fail "the progress line: not shown after 1 s, rewritten and cleared: $(cat -v "$t/progress.log")"

  # Under --json: no line, even on a terminal.
  kill -STOP "$stuck_c"
  tmx new-window -t top -n json \
    "'$ctl' --socket '$sock' --json pause --timeout 2s stuck_c >/dev/null; echo \"json exited \$?\""
  tmx pipe-pane -t top:json -o "cat >>'$t/json.log'"
  see top:json '^json exited 1$' "the --json pause failing at its timeout"
  kill -CONT "$stuck_c"
  ! grep -q 'pausing' "$t/json.log" || fail "a progress line under --json: $(cat -v "$t/json.log")"
}

# --- Without a terminal, top says so and exits 2, printing nothing else;
# a gpumemctl built without curses says that (and its view is not tried).
rc=0
"$ctl" --socket "$sock" top </dev/null >"$t/notty.out" 2>"$t/notty.err" || rc=$?
curses=1
grep -q 'built without curses' "$t/notty.err" && curses=0
[ "$rc" -eq 2 ] && [ ! -s "$t/notty.out" ] ||
  fail "top without a terminal exited $rc: $(cat "$t/notty.err" "$t/notty.out")"
[ "$curses" = 0 ] || grep -q 'top needs a terminal' "$t/notty.err" ||
  fail "top without a terminal said: $(cat "$t/notty.err")"

# The panes run under C.UTF-8 (names may be UTF-8) with a known TERM.
export LC_ALL=C.UTF-8 TERM=screen
start_daemon
start_worker rank0 kv_cache 128M 0 --count 2
start_worker rank0-weights weights 64M 1 --backup
start_worker stuck-a stuck_a 8M 1
stuck_a=$worker
start_worker stuck-b stuck_b 8M 1
stuck_b=$worker
start_worker stuck-c stuck_c 8M 1
stuck_c=$worker

# A process holding 64 MiB of device 0 outside gpumemd (a memfd named as the
# host backend names device memory), under a name with an escape sequence
# in it: gpumemd makes it text ('?' for ESC) and top shows that.
bus=$("$ctl" --socket "$sock" --json status | sed -n 's/.*"bus_id":"\([^"]*:0\)".*/\1/p')
[ -n "$bus" ] || fail "no bus id for device 0 in status --json"
hog=$t/$(printf 'hog\033[31m')
ln -s "$(python3 -c 'import sys; print(sys.executable)')" "$hog" # the interpreter, not a shim
"$hog" tests/build/hold_memfd.py "gpumem-$bus" 64 >"$t/hog.log" 2>&1 &
pids="$pids $!"
what="the process holding memory outside gpumemd"
await file_has "$t/hog.log" '^holding$'

# One tmux server of this run's own; dead panes stay to be read.
tmx start-server \; set-option -g remain-on-exit on \; \
  new-session -d -s top -x 100 -y 30 -n start "echo gpumemd at $sock"
if [ "$curses" = 1 ]; then
  check_view
else
  echo "check_top: gpumemctl built without curses: top says so; its view not tried"
fi
check_progress

# Nothing a sanitizer said (an ASan build exits 1 on an error: like a
# failed pause), in any pane or file.
for w in $(tmx list-windows -t top -F '#I'); do tmx capture-pane -p -S - -t "top:$w"; done >"$t/panes"
! grep -E 'Sanitizer|runtime error' "$t/panes" "$t"/*.err ||
  fail "a sanitizer spoke"

echo "check_top: passed in $(($(date +%s) - t0)) s"
