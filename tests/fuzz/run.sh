#!/bin/sh
# Run each fuzzer for a time: run.sh SECONDS FUZZER...
# Each starts from its seeds (tests/fuzz/corpus/<name>, read only) and what
# it found before (build/fuzz/<name>.corpus), writes crashes to
# build/fuzz/<name>-crash-*, and gets a line: executions, speed, coverage,
# corpus and crashes. Exits 1 if any crashed (after running them all).
set -u
secs=$1
shift
status=0
for f in "$@"; do
  name=$(basename "$f")
  mkdir -p "$f.corpus"
  seeds=tests/fuzz/corpus/$name
  [ -d "$seeds" ] || seeds=
  log=$f.log
  before=$(ls "$f"-crash-* "$f"-timeout-* "$f"-leak-* "$f"-oom-* 2>/dev/null | wc -l)
  "$f" -max_total_time="$secs" -timeout=20 -max_len=4096 -print_final_stats=1 \
    -artifact_prefix="$f-" "$f.corpus" $seeds >"$log" 2>&1
  rc=$?
  after=$(ls "$f"-crash-* "$f"-timeout-* "$f"-leak-* "$f"-oom-* 2>/dev/null | wc -l)
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  ft=$(grep -o 'ft: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  units=$(grep -o 'corp: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  crashes=$((after - before))
  [ $crashes -lt 0 ] && crashes=0
  [ $rc -ne 0 ] && [ $crashes -eq 0 ] && crashes=1
  echo "$name: ${runs:-0} executions in ${secs} s (${speed:-0}/s), cov ${cov:-0} ft ${ft:-0}, corpus ${units:-0}, crashes $crashes (log $log)"
  if [ $rc -ne 0 ]; then
    status=1
    grep -m3 -E 'ERROR|SUMMARY|fuzz_daemon:|Test unit written' "$log" | sed 's/^/  /'
  fi
done
exit $status
