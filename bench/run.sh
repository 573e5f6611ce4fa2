#!/bin/sh
# make bench: run every benchmark; a table on stdout and one JSON object per
# figure in $build/bench/results.jsonl.
set -eu
build=$1
out=$build/bench/results.jsonl
mkdir -p "$build/bench"
: > "$out"
for b in "$build"/bench/bench_*; do
  [ -x "$b" ] || continue
  echo "== $(basename "$b")"
  "$b" "$build/bin" 3>>"$out"
done
echo "results: $out"
"$(dirname "$0")/plot.sh" "$build" host
