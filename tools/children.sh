# Sourced by the scripts that start programs in the background
# (tools/demo.sh, tests/build/check_top.sh, tests/build/check_readme.sh).
# children_signal SIGNAL PID... signals only those of the pids that are
# still this shell's children (running, or exited and not yet waited for).
# A pid the shell has already waited for may be another program's by now
# (a busy machine reuses pids within seconds: once, another run's worker
# stopped for a test was sent SIGCONT this way), and is left alone.
children_signal() {
  _children_sig=$1
  shift
  for _children_p in "$@"; do
    # /proc/PID/stat: "PID (COMM) STATE PPID ..."; COMM may hold ") ".
    _children_ppid=$(sed -n 's/.*) [A-Za-z] \([0-9]*\) .*/\1/p' "/proc/$_children_p/stat" \
      2>/dev/null) || _children_ppid=""
    [ "$_children_ppid" != "$$" ] || kill -s "$_children_sig" "$_children_p" 2>/dev/null || true
  done
}
