#!/bin/sh
# README.md's samples are what the programs print today, and every flag it
# uses is in its usage blocks.
#
# Each sample in README.md is marked by an HTML comment on the line before
# its block (indented or fenced):
#   <!-- sample: NAME [excerpt|lines] -->   what a command prints
#   <!-- source: NAME -->                   code this script runs (Python)
# For every NAME this script knows, it makes the output for real (a gpumemd
# of its own on the host backend, real workers, gpumemctl on a terminal
# through script(1), tools/demo.sh for `make demo`; for the figures no host
# backend makes, tests/build/readme_fake_daemon.py plays tests/with_daemon/check_ctl.c's
# to gpumemctl), masks the figures that vary from run to run (pids,
# addresses, timings, clocks, uids, the backup limit, which is half of RAM)
# on both sides, and compares line by line:
#   (none)   the whole output; a line "..." in the sample stands for any lines
#   excerpt  the sample is a run of consecutive lines of the output
#   lines    each line of the sample is a line of the output, in order
# On a difference it fails and prints a diff. A marker it does not know, a
# sample it knows that README.md lacks, and a flag used in README.md that is
# not in the usage block of its program (`gpumemd --help`, `gpumemctl
# --help`, `gpumem-worker --help`, each of which must be what the program
# prints) fail as well. It also runs examples/worker.c, the README's
# example, with its stdout a file: its line must be there while it runs.
# A new sample needs its marker, a step below that
# makes its output, and its name in $known.
#   GPUMEM_O       the build to test (default build; build/asan under SAN=1)
#   GPUMEM_README  the file to check (default README.md), to try the check
#   KEEP=1         keep the temporary directory (its path is printed)
# Needs no network, no GPU and no root (what needs root, Python, tmux or
# script(1) is skipped with a line saying so).
set -eu
cd "$(dirname "$0")/../.."
o=${GPUMEM_O:-build}
case $o in /*) ;; *) o=$(pwd)/$o ;; esac
bin=$o/bin
readme=${GPUMEM_README:-README.md}
# The samples name their sockets; none comes from the caller's environment.
unset GPUMEM_SOCKET GPUMEM_SOCKET_OWNER
t=$(mktemp -d "${TMPDIR:-/tmp}/gpumemd-readme.XXXXXX")
t0=$(date +%s)
pids=""
unsafe_sock=/tmp/gpumemd-check-readme-$$.sock
. ./tools/children.sh
# Stop every process this run started (the daemons exit on SIGTERM).
stop_all() {
  tmux -S "$t/tmux.sock" kill-server 2>/dev/null || true
  children_signal CONT $pids
  children_signal TERM $pids
  for p in $pids; do wait "$p" 2>/dev/null || true; done
  pids=""
}
cleanup() {
  stop_all
  rm -f "$unsafe_sock"
  if [ -n "${KEEP:-}" ]; then echo "check_readme: kept $t"; else rm -rf "$t"; fi
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

status=0
passed=""
# Said on the script's own stdout (fd 3), whatever a step's output goes to.
exec 3>&1
fail() { printf 'FAIL: check_readme: %s\n' "$*" >&3; status=1; }
skip() { printf 'check_readme: %s: skipped: %s\n' "$1" "$2" >&3; }
# A failure that stops the run (a daemon that does not start, a wait that
# times out): the later samples would only fail for the same reason.
daemon_log=""
die() {
  fail "$*"
  if [ -n "$daemon_log" ]; then
    echo "--- the last daemon's log ($daemon_log), its end:" >&3
    tail -5 "$daemon_log" >&3 2>/dev/null || true
  fi
  exit 1
}

# --- Samples out of README.md -------------------------------------------

# Every marker: "sample NAME MODE" or "source NAME -", one a line.
markers() {
  awk '/^[ \t]*<!-- (sample|source): .*-->[ \t]*$/ {
    m = $0
    sub(/^[ \t]*<!-- /, "", m)
    sub(/[ \t]*-->[ \t]*$/, "", m)
    split(m, w, /:?[ \t]+/)
    print w[1], w[2], (w[3] == "" ? "-" : w[3])
  }' "$readme"
}

# The block after the marker of sample NAME (or, with $2 "source", of
# source NAME): a fenced block's lines, or an indented block's (the
# indentation of its first line taken off every line, trailing blank lines
# left out). Empty when README.md has no such marker.
block() {
  awk -v want="$1" -v kind="${2:-sample}" '
    state == 0 && /^[ \t]*<!-- (sample|source): / {
      m = $0
      sub(/^[ \t]*<!-- /, "", m)
      split(m, w, /:?[ \t]+/)
      if (w[1] == kind && w[2] == want) state = 1
      next
    }
    state == 1 && /^[ \t]*$/ { next }
    state == 1 {
      match($0, /^ */)
      ind = RLENGTH
      if (substr($0, ind + 1, 3) == "```") { state = 3; next }
      state = 2
    }
    state == 2 {
      if ($0 ~ /^[ \t]*$/) { blanks++; next }
      match($0, /^ */)
      if (RLENGTH < ind) exit
      for (; blanks > 0; blanks--) print ""
      print substr($0, ind + 1)
      next
    }
    state == 3 {
      if (substr($0, ind + 1) ~ /^```[ \t]*$/) exit
      line = $0
      match(line, /^ */)
      print substr(line, (RLENGTH < ind ? RLENGTH : ind) + 1)
    }' "$readme"
}

# The mode of sample NAME: exact, excerpt or lines.
mode_of() {
  m=$(markers | awk -v n="$1" '$1 == "sample" && $2 == n { print $3; exit }')
  case $m in -|"") echo exact ;; *) echo "$m" ;; esac
}

# The sed -E script that masks what varies in sample NAME's lines.
masks() {
  case $1 in
  demo)
    cat <<'EOF'
s/^(Shmem [a-z ]+: +)[0-9]+ MiB$/\1N MiB/
s/, in [0-9]+\.[0-9]+ ms$/, in T ms/
s/^(backups: [0-9.]+ [KMGT]?i?B reserved of )[0-9.]+ [KMGT]?i?B/\1LIMIT/
s/ at [0-9.]+ GB\/s$/ at R GB\/s/
s/^[0-9]+ +[0-9]+ +(worker|controller) +/ID PID \1 /
s/ uid [0-9]+$/ uid U/
s/^[0-9]+ +([0-9]+ +[0-9.]+ [KMGT]?i?B +[0-9.]+ [KMGT]?i?B)$/U \1/
EOF
    ;;
  demo-worker)
    cat <<'EOF'
s/buffer [0-9]+/buffer N/
s/ptr=0x[0-9a-f]+/ptr=0xADDR/
EOF
    ;;
  gpumemd-version) printf '%s\n' 's/^(backends: host)( .*)?$/\1 .../' ;;
  untrusted) printf '%s\n' 's/ answers as uid [0-9]+( \([^)]*\))?, / answers as uid U (USER), /' ;;
  metrics)
    cat <<'EOF'
s/^(gpumem_uptime_seconds) [0-9.]+$/\1 T/
s/^(gpumem_operation_duration_seconds_(bucket|sum)\{[^}]*\}) [0-9.]+$/\1 N/
EOF
    ;;
  json)
    cat <<'EOF'
s/"(pid|uid|owner_uid|elapsed_us|limit)":[0-9]+/"\1":N/g
s/"bus_id":"host-[0-9a-f]+:/"bus_id":"host-H:/g
EOF
    ;;
  top)
    cat <<'EOF'
s/^(gpumemd [0-9.]+ at )[^,]*(, backend [a-z]+, up )[0-9]+m[0-9]+s +[0-9:]+  q quits$/\1SOCKET\2T  HH:MM:SS  q quits/
s/^(python3) +[0-9]+ /\1 PID /
s/^[0-9][0-9]:[0-9][0-9]:[0-9][0-9] /HH:MM:SS /
s/ +[0-9.]+ m?s +[0-9.-]+ (running|OK)$/ TOOK RATE \1/
EOF
    ;;
  grace) printf '%s\n' 's/^(re-registration grace: )[0-9.]+ s left/\1T s left/' ;;
  restart)
    cat <<'EOF'
s/^(gpumemd\[info\]: journal )[^ ]+: /\1PATH: /
s/^(gpumemd\[info\]: listening on )[^ ]+ /\1SOCKET /
s/^(gpumemd\[info\]: pid )[0-9]+ /\1PID /
EOF
    ;;
  release)
    cat <<'EOF'
s/^pid [0-9]+: /pid PID: /
s/ in [0-9]+\.[0-9]+ ms$/ in T ms/
s/^[0-9]+ +[0-9]+ +(worker|controller) +/ID PID \1 /
EOF
    ;;
  progress) printf '%s\n' 's/^(resuming [^:]*: )[0-9.]+ [KMGT]?i?B( of [0-9.]+ [KMGT]?i?B, )[0-9.]+ s$/\1X\2T s/' ;;
  python-client) printf '%s\n' 's/0x[0-9a-f]+/0xADDR/g' ;;
  python-persistent)
    cat <<'EOF'
s/^(qwen-w0 +)[0-9]+ /\1U /
s/ [0-9.]+ (ms|s|min|h) none for [0-9.]+ (ms|s|min|h); last pid [0-9]+ / T none for T; last pid PID /
s/ of uid [0-9]+:/ of uid U:/
EOF
    ;;
  esac
}

# Lines that come in no fixed order in sample NAME (an extended regex): each
# run of consecutive such lines is sorted on both sides. In the demo, its two
# workers start together, so either may have the first session and tag.
unordered() {
  case $1 in
  demo) printf '%s\n' '^(ID PID |[a-z_]+ +(ACTIVE|PAUSED) )' ;;
  restart) printf '%s\n' '^gpumemd\[info\]: pid PID re-registered ' ;;
  esac
}

# Masked (and sorted where unordered) lines of file $2 for sample $1.
normal() {
  masks "$1" >"$t/masks.sed"
  sed -E -f "$t/masks.sed" "$2" | awk -v re="$(unordered "$1")" '
    function flush(  i, j, x) {
      for (i = 2; i <= n; i++)
        for (j = i; j > 1 && run[j - 1] > run[j]; j--) { x = run[j]; run[j] = run[j - 1]; run[j - 1] = x }
      for (i = 1; i <= n; i++) print run[i]
      n = 0
    }
    re != "" && $0 ~ re { run[++n] = $0; next }
    { flush(); print }
    END { flush() }'
}

# Whether the lines of $2 (the sample, "..." lines standing for any lines)
# match the lines of $3 (the output) in mode $1.
matches() {
  awk -v mode="$1" -v want="$2" -v got="$3" '
    function seg_at(k, i,  j) {
      if (i < 1 || i + len[k] - 1 > ng) return 0
      for (j = 0; j < len[k]; j++) if (e[start[k] + j] != g[i + j]) return 0
      return 1
    }
    BEGIN {
      while ((getline l < want) > 0) w[++nw] = l
      while ((getline l < got) > 0) g[++ng] = l
      ne = 0
      if (mode != "exact") e[++ne] = "..."
      for (i = 1; i <= nw; i++) {
        if (mode == "lines" && i > 1) e[++ne] = "..."
        e[++ne] = w[i]
      }
      if (mode != "exact") e[++ne] = "..."
      ns = 0
      for (i = 1; i <= ne; i++) {
        if (e[i] == "...") continue
        if (i == 1 || e[i - 1] == "...") { start[++ns] = i; len[ns] = 0 }
        len[ns]++
      }
      lead = ne > 0 && e[1] == "..."
      trail = ne > 0 && e[ne] == "..."
      if (ns == 0) exit !(lead || trail || ng == 0)
      pos = 1
      for (k = 1; k <= ns; k++) {
        if (k == 1 && !lead) {
          if (!seg_at(k, 1) || (k == ns && !trail && len[k] != ng)) exit 1
          i = 1
        } else if (k == ns && !trail) {
          i = ng - len[k] + 1
          if (i < pos || !seg_at(k, i)) exit 1
        } else {
          for (i = pos; i + len[k] - 1 <= ng; i++) if (seg_at(k, i)) break
          if (i + len[k] - 1 > ng) exit 1
        }
        pos = i + len[k]
      }
      exit 0
    }'
}

# Compare sample NAME with the output in file $2.
compare() {
  name=$1
  block "$name" >"$t/$name.want"
  if [ ! -s "$t/$name.want" ]; then
    fail "$readme has no block marked <!-- sample: $name -->"
    return
  fi
  mode=$(mode_of "$name")
  normal "$name" "$t/$name.want" >"$t/$name.want.n"
  normal "$name" "$2" >"$t/$name.got.n"
  if matches "$mode" "$t/$name.want.n" "$t/$name.got.n"; then
    passed="$passed $name"
    return
  fi
  fail "sample $name ($mode) differs from what the programs print; masked, - $readme, + the programs:"
  case $mode in
  excerpt) echo "  (the sample must be a run of consecutive lines of the output; \"...\" stands for any lines)" ;;
  lines) echo "  (each line of the sample must be a line of the output, in order)" ;;
  *) echo "  (\"...\" in the sample stands for any lines)" ;;
  esac
  diff -u "$t/$name.want.n" "$t/$name.got.n" | tail -n +3 | sed 's/^/  /' || true
}

# --- Running the programs -------------------------------------------------

# Poll until "$@" succeeds, for at most 30 s (what should take
# milliseconds, on a machine however busy); $what says what was awaited,
# and the file $whose (when set) what the awaited program said (its last
# lines that are not blank).
whose=""
await() {
  deadline=$(($(date +%s) + 30))
  until "$@"; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      [ -z "$whose" ] || what="$what; it said: $(grep -v '^ *$' "$whose" 2>/dev/null | tail -8)"
      die "timed out waiting for $what"
    fi
    sleep 0.05
  done
  whose=""
}
file_has() { grep -Eq -- "$2" "$1" 2>/dev/null; }
# Whether the daemon on $sock lists a persistent buffer that no session holds.
unheld() { "$bin/gpumemctl" --socket "$sock" --json status | grep -q '"persistent":\[{"id":[0-9]*,"session":0,'; }
alive() { kill -0 "$1" 2>/dev/null; }
# The state letter of process $1 (the field after "(COMM)" in /proc/PID/stat;
# COMM may hold ") "), and whether it is T, stopped by a signal.
proc_state() { sed -n 's/.*) \([A-Za-z]\) .*/\1/p' "/proc/$1/stat" 2>/dev/null; }
stopped() { [ "$(proc_state "$1")" = T ]; }
# Stop worker $1 (pid) with SIGSTOP and wait until the kernel says it is.
stop_worker() {
  kill -STOP "$1"
  what="worker $1 to stop (state $(proc_state "$1"))"
  await stopped "$1"
}
# The socket is there, or the daemon (pid $2) has exited.
sock_or_exit() { [ -S "$1" ] || ! alive "$2"; }

# The daemon whose log is $1 listens (its socket file is there from bind(),
# a moment before it listens), or has exited (pid $2).
listens_or_exit() { grep -q '^gpumemd\[info\]: listening on ' "$1" 2>/dev/null || ! alive "$2"; }

# Start gpumemd on the host backend in $t/$1 with the other arguments, and
# wait until it listens; its socket in $sock, its pid in $daemon.
start_daemon() {
  dir=$t/$1
  shift
  mkdir -p "$dir"
  sock=$dir/sock
  daemon_log=$dir/daemon.log
  "$bin/gpumemd" --backend host --socket "$sock" "$@" 2>"$daemon_log" &
  daemon=$!
  pids="$pids $daemon"
  what="gpumemd on $sock"
  await listens_or_exit "$dir/daemon.log" "$daemon"
  alive "$daemon" || die "gpumemd did not start: $(cat "$dir/daemon.log")"
}

# Start gpumem-worker on $sock (arguments: name, tag, size, then any
# others) and wait until it is ready; its pid in $worker.
nworkers=0
start_worker() {
  wname=$1 wtag=$2 wsize=$3
  shift 3
  nworkers=$((nworkers + 1))
  wlog=$t/worker$nworkers-$wname.log
  # A session of its own (setsid: the same pid): a worker stopped below
  # gets no signal sent to this script's process group (the kernel's
  # SIGHUP and SIGCONT to the stopped members of an orphaned group).
  setsid "$bin/gpumem-worker" --socket "$sock" --name "$wname" --tag "$wtag" --size "$wsize" "$@" \
    >"$wlog" 2>&1 &
  worker=$!
  pids="$pids $worker"
  what="worker $wname on $sock" whose=$wlog
  await file_has "$wlog" '^ready$'
}

# gpumemctl on $sock, quietly (steps between the samples' commands).
ctl() {
  "$bin/gpumemctl" --socket "$sock" "$@" >"$t/ctl.out" 2>&1 ||
    die "gpumemctl $*: $(cat "$t/ctl.out")"
}

# script(1) (util-linux) runs a command on a terminal of its own.
have_script=0
if command -v script >/dev/null 2>&1 && script -qec true /dev/null </dev/null >/dev/null 2>&1; then
  have_script=1
fi
# Whether sample $1, whose commands write both to stdout and to stderr, can
# be shown as on a terminal (else it is skipped, saying so).
tty_for() {
  [ "$have_script" = 0 ] || return 0
  skip "$1" "no script(1) with a terminal to show stdout and stderr as they interleave"
  return 1
}

# Print "$ CMD" and what CMD prints on a terminal, stderr and stdout
# interleaved as a terminal shows them (through script(1); without it, both
# on one file, and tty_for skips the samples where that would differ). CMD
# is as README.md shows it (no shell quoting), run from the build;
# gpumemctl gets --socket $sock first
# unless CMD names a socket; the word $map_readme (a path in README.md) is
# $map_real here, and the other way round in what CMD prints.
map_readme="" map_real=""
run_cmd() {
  printf '$ %s\n' "$1"
  set -f
  # shellcheck disable=SC2086 # the words of the command
  set -- $1
  set +f
  prog=$1
  shift
  line="'$bin/$prog'"
  case " $* " in
  *" --socket "*) ;;
  *) [ "$prog" != gpumemctl ] || [ -z "${sock:-}" ] || line="$line --socket '$sock'" ;;
  esac
  for a in "$@"; do
    [ -z "$map_readme" ] || [ "$a" != "$map_readme" ] || a=$map_real
    line="$line '$a'"
  done
  if [ "$have_script" = 1 ]; then
    script -qec "$line" /dev/null </dev/null >"$t/tty.out" 2>&1 || true
  else
    sh -c "$line" </dev/null >"$t/tty.out" 2>&1 || true
  fi
  if [ -n "$map_readme" ]; then
    tr -d '\r' <"$t/tty.out" | sed "s|$(printf '%s' "$map_real" | sed 's/[.[\*^$|]/\\&/g')|$map_readme|g"
  else
    tr -d '\r' <"$t/tty.out"
  fi
}

# Python 3.9 or later for the samples and helpers that need it; where
# libgpumem is built with a sanitizer, Python cannot load it.
py=""
for p in python3 /usr/bin/python3; do
  if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import sys; sys.exit(sys.version_info < (3, 9))' 2>/dev/null; then
    py=$(command -v "$p")
    break
  fi
done
sanitized=0
grep -q -- '-fsanitize' "$o/build-config" 2>/dev/null && sanitized=1
have_tmux=0
command -v tmux >/dev/null 2>&1 && have_tmux=1
tmx() { tmux -S "$t/tmux.sock" -f /dev/null "$@"; }

# --- The samples ----------------------------------------------------------

# make demo (tools/demo.sh, which starts its own daemon and workers) runs
# while the light samples do; its two samples are compared after them,
# before the samples that move GiBs of memory.
# Under a sanitizer a worker reading back 512 MiB takes more than the
# default 10 s to ack its remap.
demo_flags=
[ "$sanitized" = 1 ] && demo_flags="--ack-timeout 120s"
GPUMEM_DEMO_DAEMON_FLAGS=$demo_flags "$(pwd)/tools/demo.sh" "$o" >"$t/demo.raw" 2>&1 &
demo=$!
pids="$pids $demo"

# The usage blocks are the programs' --help, and the version.
for p in gpumemd gpumemctl gpumem-worker; do
  run_cmd "$p --help" >"$t/$p.help"
done
compare gpumemd-help "$t/gpumemd.help"
compare gpumemctl-help "$t/gpumemctl.help"
compare worker-help "$t/gpumem-worker.help"
run_cmd "gpumemd --version" >"$t/version.out"
compare gpumemd-version "$t/version.out"

# examples/worker.c is the worker example, whole.
block examples-worker.c >"$t/worker.c.want"
if cmp -s "$t/worker.c.want" examples/worker.c; then
  passed="$passed examples-worker.c"
else
  fail "the block marked examples-worker.c is not examples/worker.c; - $readme, + the file:"
  diff -u "$t/worker.c.want" examples/worker.c | tail -n +3 | sed 's/^/  /' || true
fi

# A socket right in /tmp is refused, saying why.
if [ "$(ls -ld /tmp | cut -c1-10)" != drwxrwxrwt ]; then
  skip unsafe-socket "/tmp is not the usual sticky directory writable by all"
else
  rc=0
  "$bin/gpumemd" --backend host --socket "$unsafe_sock" >"$t/unsafe.log" 2>&1 &
  p=$!
  pids="$pids $p"
  what="gpumemd refusing a socket in /tmp"
  await sock_or_exit "$unsafe_sock" "$p"
  wait "$p" || rc=$?
  [ "$rc" = 1 ] || fail "gpumemd with its socket in /tmp exited $rc, not 1"
  [ ! -e "$unsafe_sock" ] || fail "gpumemd with its socket in /tmp created it"
  compare unsafe-socket "$t/unsafe.log"
fi

# --backend auto on a node without GPU device nodes: host, saying why.
gpu_nodes=""
for f in /dev/nvidia[0-9]* /dev/kfd; do [ ! -e "$f" ] || gpu_nodes="$gpu_nodes $f"; done
if [ -n "$gpu_nodes" ]; then
  skip backend-auto "this node has GPU device nodes:$gpu_nodes"
else
  mkdir -p "$t/auto"
  "$bin/gpumemd" --socket "$t/auto/sock" --backend auto >"$t/auto/log" 2>&1 &
  p=$!
  pids="$pids $p"
  what="gpumemd --backend auto"
  await listens_or_exit "$t/auto/log" "$p"
  children_signal TERM "$p"
  compare backend-auto "$t/auto/log"
fi

# The re-registration grace while a worker's allocation in a new tag
# waits for it.
start_daemon grace --adopt-grace 60s
"$bin/gpumem-worker" --socket "$sock" --name vllm-rank0 --tag kv_cache --size 4M \
  >"$t/grace/worker.log" 2>&1 &
pids="$pids $!"
grace_waits() {
  "$bin/gpumemctl" --socket "$sock" --json status 2>/dev/null | grep -q '"grace":{"left_ms":[0-9]*,"waiting":1}'
}
what="the worker's allocation waiting for the grace"
await grace_waits
"$bin/gpumemctl" --socket "$sock" status >"$t/grace/status.full" 2>&1
head -n 2 "$t/grace/status.full" >"$t/grace/status.out"
compare grace "$t/grace/status.out"

# A daemon killed with SIGKILL and started again: its journal gives its
# successor the tags and buffers, which the two workers bring back.
start_daemon restart --host-devices 1
start_worker kv kv_cache 4M --count 2
kv=$worker
start_worker weights weights 2M --backup
weights=$worker
"$bin/gpumemctl" --socket "$sock" pause kv_cache >"$t/restart/pause.out" 2>&1 ||
  die "pause before the restart: $(cat "$t/restart/pause.out")"
kill -KILL "$daemon"
wait "$daemon" 2>/dev/null || true
start_daemon restart --host-devices 1
what="the workers re-registering" whose=$daemon_log
await file_has "$daemon_log" 'the grace ends$'
whose=
children_signal TERM "$kv" "$weights"
compare restart "$daemon_log"

# examples/worker.c, its stdout a file: its line is there while it runs
# (flushed), not only once it exits, and it is killed, as a user would.
start_daemon example
GPUMEM_SOCKET=$sock "$o/examples/worker" >"$t/example/worker.out" 2>&1 &
example=$!
pids="$pids $example"
what="examples/worker's line in a file while it runs" whose=$t/example/worker.out
await file_has "$t/example/worker.out" '^kv_cache at 0x[0-9a-f]+, 67108864 bytes$'
children_signal KILL "$example"

# gpumemctl --json failures.
sock=""
if tty_for json-errors; then
  {
    run_cmd "gpumemctl --json status --socket /nowhere"
    run_cmd "gpumemctl --json pause"
  } >"$t/json-errors.out"
  compare json-errors "$t/json-errors.out"
fi

# A daemon another user runs is not trusted: as root, gpumemd runs as
# nobody, and its socket file is given to root so that only the peer check
# can tell.
if [ "$(id -u)" != 0 ] || ! command -v setpriv >/dev/null 2>&1; then
  skip untrusted "needs root and setpriv to run gpumemd as another user"
else
  nobody="setpriv --reuid=65534 --regid=65534 --clear-groups"
  gd=$bin/gpumemd
  if ! $nobody test -x "$gd" 2>/dev/null; then
    mkdir -p "$t/others"
    cp "$gd" "$t/others/gpumemd"
    chmod 755 "$t/others" "$t/others/gpumemd"
    gd=$t/others/gpumemd
  fi
  chmod 755 "$t"
  mkdir -m 700 "$t/x"
  chown 65534:65534 "$t/x"
  $nobody "$gd" --backend host --socket "$t/x/sock" --host-devices 1 --host-device-size 64M \
    2>"$t/x.log" &
  p=$!
  pids="$pids $p"
  what="gpumemd run as nobody"
  await listens_or_exit "$t/x.log" "$p"
  alive "$p" || die "gpumemd as nobody did not start: $(cat "$t/x.log")"
  chown 0:0 "$t/x/sock"
  map_readme=/tmp/x/sock map_real=$t/x/sock
  run_cmd "gpumemctl --socket /tmp/x/sock pause kv_cache" >"$t/untrusted.out"
  map_readme="" map_real=""
  compare untrusted "$t/untrusted.out"
fi

# What only a scripted daemon can show: an 80 GiB device with memory held
# outside gpumemd, tags in transit, a pause that could not release all.
if [ -z "$py" ]; then
  for s in status-holders tags-transit pause-not-released; do skip "$s" "no python3 for the scripted daemon"; done
else
  mkdir -p "$t/fake"
  sock=$t/fake/sock
  "$py" tests/build/readme_fake_daemon.py "$sock" >"$t/fake/ready" 2>"$t/fake/log" &
  p=$!
  pids="$pids $p"
  what="the scripted daemon"
  await file_has "$t/fake/ready" '^ready$'
  "$bin/gpumemctl" --socket "$sock" status >"$t/fake/status" 2>&1 ||
    fail "gpumemctl status against the scripted daemon: $(cat "$t/fake/status" "$t/fake/log")"
  compare status-holders "$t/fake/status"
  compare tags-transit "$t/fake/status"
  run_cmd "gpumemctl pause kv" >"$t/fake/pause"
  compare pause-not-released "$t/fake/pause"
fi

# --json output: a 256 MiB device, kv_cache paused, then a trainer holding
# the rest, so that the resume cannot be served.
if tty_for json; then
  start_daemon json --host-devices 1 --host-device-size 256M
  start_worker vllm-rank0 kv_cache 64M --count 2
  {
    run_cmd "gpumemctl pause --json kv_cache"
    start_worker gpumem-worker trainer 192M
    run_cmd "gpumemctl status --json"
    run_cmd "gpumemctl resume --json kv_cache"
  } >"$t/json.out"
  compare json "$t/json.out"
fi

# Context release: a worker that opted in, paused with --release-context
# (the host backend stops its process), its session in the status, and
# the resume that lets it go on.
if tty_for release; then
  start_daemon release --host-devices 1 --host-device-size 256M
  export GPUMEM_RELEASE_CONTEXT=1
  start_worker vllm-rank0 kv_cache 64M
  unset GPUMEM_RELEASE_CONTEXT
  {
    run_cmd "gpumemctl pause --release-context kv_cache"
    run_cmd "gpumemctl status" | sed -n '1p;/^SESSION/,/vllm-rank0/p'
    run_cmd "gpumemctl resume kv_cache"
  } >"$t/release.out"
  compare release "$t/release.out"
fi

# make demo, and the log of its weights worker.
what="make demo"
wait "$demo" || fail "tools/demo.sh failed: $(cat "$t/demo.raw")"
esc=$(printf '\033')
sed "s/$esc\[[0-9;]*m//g" "$t/demo.raw" >"$t/demo.out"
sed -n '/^Shmem before workers:/,/^Shmem after resume:/p' "$t/demo.out" >"$t/demo.sample"
sed -n '/^worker weights said:$/,/^$/p' "$t/demo.out" | sed '1d;/^$/d' >"$t/demo-worker.sample"
compare demo "$t/demo.sample"
compare demo-worker "$t/demo-worker.sample"

# Python: the client sample, and the orchestrator pausing two engines.
if [ -z "$py" ]; then
  skip python-client "no python3 (3.9 or later)"
  skip python-orchestrator "no python3 (3.9 or later)"
elif [ "$sanitized" = 1 ]; then
  skip python-client "a sanitizer build: python would need its runtime preloaded"
  skip python-orchestrator "a sanitizer build: python would need its runtime preloaded"
else
  for s in python-client python-orchestrator python-persistent; do
    block "$s" source >"$t/$s.py"
    [ -s "$t/$s.py" ] || { fail "$readme has no block marked <!-- source: $s -->"; continue; }
    start_daemon "$s"
    GPUMEM_SOCKET=$sock GPUMEM_LIB=$o/lib/libgpumem.so.1 PYTHONPATH=$(pwd)/python \
      PYTHONDONTWRITEBYTECODE=1 "$py" "$t/$s.py" >"$t/$s.out" 2>&1 ||
      fail "the $s sample exited $?: $(cat "$t/$s.out")"
    if [ "$s" = python-persistent ]; then
      # Once the daemon has seen engine-2's session end, on its own turn.
      what="the daemon holding qwen-w0 alone"
      await unheld
      {
        run_cmd "gpumemctl status" | sed -n '1p;/^PERSISTENT/,$p'
        run_cmd "gpumemctl drop qwen-w0"
      } >>"$t/$s.out"
    fi
    compare "$s" "$t/$s.out"
  done
fi

# metrics after a pause and a resume of 640 MiB (the demo's workers) and a
# pause of a tag that does not exist; then the progress line of a resume
# that waits on a stopped worker, on a terminal.
start_daemon metrics --host-devices 2 --host-device-size 2G
start_worker vllm-rank0 kv_cache 256M --count 2 --no-verify
kv=$worker
start_worker vllm-rank0-weights weights 128M --backup --device 1 --no-verify
ctl pause kv_cache weights
ctl resume kv_cache weights
"$bin/gpumemctl" --socket "$sock" pause no_such_tag >/dev/null 2>&1 && fail "a pause of no tag succeeded"
"$bin/gpumemctl" --socket "$sock" metrics >"$t/metrics.out" 2>&1 || fail "gpumemctl metrics failed"
compare metrics "$t/metrics.out"

if [ "$have_tmux" = 0 ]; then
  skip progress "no tmux for a terminal"
  skip top "no tmux for a terminal"
else
  export LC_ALL=C.UTF-8 TERM=screen
  tmx start-server \; set-option -g remain-on-exit on \; \
    new-session -d -s readme -x 100 -y 24 -n start "echo check_readme"
  ctl pause kv_cache weights
  stop_worker "$kv"
  tmx new-window -t readme -n progress \
    "'$bin/gpumemctl' --socket '$sock' resume kv_cache weights; echo \"resume exited \$?\" | tee '$t/resume.rc'"
  screen_has() { tmx capture-pane -p -t "$1" >"$t/screen" 2>/dev/null && grep -Eq -- "$2" "$t/screen"; }
  # The stopped worker running again (see top_try below) is said at once.
  progress_shown() {
    stopped "$kv" || die "the stopped worker of kv_cache (pid $kv) ran again (state $(proc_state "$kv"))"
    screen_has readme:progress '^resuming '
  }
  what="the progress line of a resume"
  await progress_shown
  grep '^resuming ' "$t/screen" >"$t/progress.out"
  kill -CONT "$kv"
  # The exit status in a file: a pane whose shell ends at once may be
  # dead before its last line is drawn.
  what="the resume to end"
  await file_has "$t/resume.rc" '^resume exited '
  grep -q '^resume exited 0$' "$t/resume.rc" || fail "the resume failed: $(cat "$t/screen")"
  compare progress "$t/progress.out"

  # gpumemctl top, in a 100x24 pane: a worker of draft is stopped, so its
  # pause waits for it; a process holds 192 MiB of device 0 itself. One try
  # leaves the pane in $t/top.out and returns 0, or returns 1 when the
  # stopped worker ran again before top showed its pause (something outside
  # this script sent it SIGCONT: once, on CI, its pause ended in 13 ms),
  # having stopped what it started.
  top_try() {
    before=$pids
    start_daemon top
    start_worker rank0 kv_cache 1G --count 2 --no-verify
    start_worker rank0-weights weights 512M --device 1 --no-verify
    start_worker draft draft 256M --no-verify
    draft=$worker
    # A memfd named as the host backend names device 0's memory, held by a
    # process called python3 (the interpreter itself, not a shim).
    bus=$("$bin/gpumemctl" --socket "$sock" --json status | sed -n 's/.*"bus_id":"\([^"]*:0\)".*/\1/p')
    [ -n "$bus" ] || die "no bus id for device 0 in status --json"
    : >"$t/hog.log"
    "$t/python3" tests/build/hold_memfd.py "gpumem-$bus" 192 >"$t/hog.log" 2>&1 &
    pids="$pids $!"
    what="the process holding memory outside gpumemd"
    await file_has "$t/hog.log" '^holding$'
    ctl pause kv_cache weights
    ctl resume kv_cache weights
    ctl pause kv_cache
    stop_worker "$draft"
    "$bin/gpumemctl" --socket "$sock" pause --timeout 60s draft >"$t/draft.out" 2>&1 &
    pids="$pids $!"
    tmx new-window -t readme -n top "'$bin/gpumemctl' --socket '$sock' top"
    # Ready, or the worker runs again ($top_ran says which); a pause that
    # ends while its worker is stopped is a daemon's bug, said at once.
    top_ran=0
    top_ready() {
      if ! stopped "$draft"; then
        top_ran=1
        return 0
      fi
      ! [ -s "$t/draft.out" ] || die "the pause of draft ended with its worker stopped: $(cat "$t/draft.out")"
      screen_has readme:top ' running$' && grep -q '^python3 ' "$t/screen" &&
        grep -q '^kv_cache  *PAUSED ' "$t/screen"
    }
    what="top showing the tags, the holder and the running pause" whose=$t/screen
    await top_ready
    # The pane's lines, the empty ones at its foot left out.
    awk '{ l[NR] = $0 } NF { n = NR } END { for (i = 1; i <= n; i++) print l[i] }' \
      "$t/screen" >"$t/top.out"
    tmx kill-window -t readme:top
    kill -CONT "$draft"
    [ "$top_ran" = 1 ] || return 0
    echo "check_readme: top: the stopped worker of draft ran again (state $(proc_state "$draft")), its pause said: $(cat "$t/draft.out"); trying again" >&3
    mine=${pids#"$before"}
    children_signal TERM $mine
    for p in $mine; do wait "$p" 2>/dev/null || true; done
    pids=$before
    rm -rf "$t/top"
    return 1
  }
  # Without a terminal top exits at once; its words say whether it could
  # draw at all (the GPU machine's build has no curses).
  if "$bin/gpumemctl" --socket "$sock" top </dev/null 2>&1 >/dev/null |
    grep -q 'built without curses'; then
    skip top "gpumemctl built without curses"
  elif [ -z "$py" ]; then
    skip top "no python3 for the process holding memory outside gpumemd"
  else
    ln -s "$("$py" -c 'import sys; print(sys.executable)')" "$t/python3"
    tries=1
    until top_try; do
      [ "$tries" -lt 3 ] || die "top: the stopped worker of draft ran again in each of 3 tries"
      tries=$((tries + 1))
    done
    compare top "$t/top.out"
  fi
fi

# Every marker is one of the samples above, and each only once.
known=" gpumemd-help gpumemctl-help worker-help gpumemd-version examples-worker.c unsafe-socket"
known="$known backend-auto json-errors untrusted status-holders tags-transit pause-not-released"
known="$known json python-client python-orchestrator metrics progress top demo demo-worker grace"
known="$known release restart python-persistent "
markers | while read -r kind name _; do
  case $known in
  *" $name "*) ;;
  *) echo "FAIL: check_readme: $readme marks a $kind '$name' that this script does not check" ;;
  esac
done >"$t/unknown"
[ ! -s "$t/unknown" ] || { cat "$t/unknown"; status=1; }
markers | awk '{ print $1, $2 }' | sort | uniq -d | while read -r kind name; do
  echo "FAIL: check_readme: $readme marks $kind '$name' more than once"
done >"$t/dups"
[ ! -s "$t/dups" ] || { cat "$t/dups"; status=1; }

# --- Flags ------------------------------------------------------------------

# The long options of a usage block (but its "$ " line) or --help, one a line.
flags_of() { grep -v '^\$ ' "$1" | grep -o -- '--[a-z][a-z0-9-]*' | sort -u; }
block gpumemd-help >"$t/usage.gpumemd"
block gpumemctl-help >"$t/usage.gpumemctl"
block worker-help >"$t/usage.gpumem-worker"
# Each usage block names what --help names, and no more.
for p in gpumemd gpumemctl gpumem-worker; do
  "$bin/$p" --help >"$t/help.$p" 2>&1 || fail "$p --help exited $?"
  flags_of "$t/help.$p" >"$t/hf.$p"
  flags_of "$t/usage.$p" >"$t/uf.$p"
  for f in $(comm -13 "$t/uf.$p" "$t/hf.$p"); do fail "$p --help has $f, which $readme's usage block of $p lacks"; done
  for f in $(comm -23 "$t/uf.$p" "$t/hf.$p"); do fail "$readme's usage block of $p has $f, which $p --help lacks"; done
done
cat "$t/uf.gpumemd" "$t/uf.gpumemctl" "$t/uf.gpumem-worker" | sort -u >"$t/uf.all"

# Where README.md uses a flag: in a command (a code line or code span whose
# first word, after "$ ", "sudo " and VAR=value, is one of ours) it is that
# program's; in a code line of another program (pip, systemctl, cc) that
# one's ("other"); anywhere else (prose, and what the samples show a
# program print) prose's ("-"), which must be one of ours or of the other
# programs README.md runs. Pairs "PROGRAM FLAG", one a line.
awk '
  function scan(text, code,  n, w, i, prog) {
    n = split(text, w, /[][ \t|(),"`]+/)
    prog = "-"
    for (i = 1; i <= n && (w[i] == "" || w[i] == "$" || w[i] == "sudo" || w[i] ~ /^[A-Za-z_][A-Za-z0-9_]*=/); i++) ;
    if (i <= n && (w[i] ~ /(^|\/)gpumemd$/ || w[i] ~ /(^|\/)gpumemctl$/ || w[i] ~ /(^|\/)gpumem-worker$/)) {
      prog = w[i]
      sub(/.*\//, "", prog)
    } else if (code && i <= n && w[i] !~ /^-/) prog = "other"
    if (!code && prog == "other") prog = "-"
    for (; i <= n; i++) if (w[i] ~ /^--[a-z][a-z0-9-]*$/) print prog, w[i]
  }
  /^[ \t]*<!-- sample: / { pending = 1; next }
  /^[ \t]*$/ { blank = 1; next }
  /^[ \t]*```/ { fenced = !fenced; if (pending) sample = 1; blank = 0; code = fenced; next }
  # An indented line is code after a blank line or code (else it is a
  # paragraph going on, as in a nested list).
  fenced || (/^(    |\t)/ && (blank || code)) {
    if (pending) sample = 1
    blank = 0
    code = 1
    line = $0
    sub(/^[ \t]+/, "", line)
    # In a sample only its "$ " lines are commands; the rest is output.
    scan(line, !sample || line ~ /^\$ /)
    next
  }
  {
    pending = sample = blank = code = 0
    rest = $0
    prose = ""
    while (match(rest, /`[^`]+`/)) {
      scan(substr(rest, RSTART + 1, RLENGTH - 2), 0)
      prose = prose " " substr(rest, 1, RSTART - 1)
      rest = substr(rest, RSTART + RLENGTH)
    }
    prose = prose " " rest
    while (match(prose, /--[a-z][a-z0-9-]*/)) {
      print "-", substr(prose, RSTART, RLENGTH)
      prose = substr(prose, RSTART + RLENGTH)
    }
  }' "$readme" | sort -u >"$t/used"
awk '$1 == "other" { print $2 }' "$t/used" | sort -u >"$t/other"
# --help is every program's (the usage blocks are what it prints, each run
# above and exiting 0), though only gpumemd's own usage names it.
while read -r prog flag; do
  if [ "$flag" = --help ] || [ "$prog" = other ]; then continue; fi
  if [ "$prog" = - ]; then
    grep -qxF -- "$flag" "$t/uf.all" && continue
    grep -qxF -- "$flag" "$t/other" && continue
    fail "$readme uses $flag, which no usage block in it has (gpumemd's, gpumemctl's, gpumem-worker's)"
  else
    grep -qxF -- "$flag" "$t/uf.$prog" && continue
    fail "$readme uses $prog $flag, which its usage block of $prog lacks"
  fi
done <"$t/used"
ours=$( (cat "$t/uf.all"; echo --help) | sort -u | awk 'NR == FNR { ours[$1] = 1; next }
  $1 != "other" && ($2 in ours) { print $2 }' - "$t/used" | sort -u | wc -l | tr -d ' ')
theirs=$(tr '\n' ' ' <"$t/other")

# Nothing a sanitizer said, in any program's output or log (the daemons
# and workers stopped first, so that their exit is in).
stop_all
grep -rlE 'ERROR: (Address|Leak|Thread)Sanitizer|runtime error:' "$t" >"$t/sanitizer" 2>/dev/null || true
[ ! -s "$t/sanitizer" ] || fail "a sanitizer spoke in: $(tr '\n' ' ' <"$t/sanitizer")"

# ---------------------------------------------------------------------------
n=$(echo "$passed" | wc -w | tr -d ' ')
if [ "$status" -ne 0 ]; then
  echo "FAIL: check_readme: $readme does not match the programs ($n samples matched:$passed)"
  exit 1
fi
echo "check_readme: $n samples match the programs:$passed"
echo "check_readme: the $ours flags of gpumemd, gpumemctl and gpumem-worker $readme uses are in their usage blocks, which are their --help (other programs': ${theirs% }); passed in $(($(date +%s) - t0)) s"
