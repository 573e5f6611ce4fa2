#!/bin/sh
# How `make demo` then `make check` once failed on a fresh machine: objects
# built before the HIP headers were installed were not rebuilt after, and
# gpumemd said "unknown backend 'hip'". Here a build without HIP (HIP=0, as
# before the headers) is followed by one that detects them, in the same
# output directory; and a plain make must never install anything.
set -eu
cd "$(dirname "$0")/../.."
. tests/build/lib.sh
fresh_build rebuild
t0=$(date +%s)

fail() { echo "FAIL: check_rebuild: $*"; exit 1; }

# Build only gpumemd into $o; the make output goes to $o/make.log.
build() {
  make -j"$jobs" --no-print-directory O="$o" "$@" "$o/bin/gpumemd" >"$o/make.log" 2>&1 ||
    { cat "$o/make.log"; fail "make O=$o $* failed"; }
}

# gpumemd --backend hip: its exit status in rc, its words in out.
try_hip() {
  rc=0
  out=$(timeout 5 "$o/bin/gpumemd" --backend hip --socket "$o/gpumemd.sock" 2>&1) || rc=$?
}

# A plain make installs nothing; demo and check install before they build.
plan=$(make -n --no-print-directory O="$o" 2>&1)
if echo "$plan" | grep -E 'apt-get|sudo|install-deps'; then
  fail "plain make would install packages"
fi
plan=$(make -n --no-print-directory O="$o" demo 2>&1)
deps_at=$(echo "$plan" | grep -n 'install-deps' | head -1 | cut -d: -f1)
cc_at=$(echo "$plan" | grep -n ' -c ' | head -1 | cut -d: -f1)
[ -n "$deps_at" ] && [ -n "$cc_at" ] && [ "$deps_at" -lt "$cc_at" ] ||
  fail "make demo does not install its packages before it compiles"

# Without the HIP headers, gpumemd has no hip backend.
build HIP=0
grep -q '^HIP=0' "$o/build-config" || fail "HIP=0 not recorded in $o/build-config"
try_hip
[ "$rc" -eq 1 ] && echo "$out" | grep -q "unknown backend 'hip'" ||
  fail "HIP=0 build: gpumemd --backend hip exited $rc: $out"

# With them (make deps installs them), the same output directory is rebuilt
# and gpumemd knows the hip backend: without an AMD GPU it says so.
build
if grep -q '^HIP=0' "$o/build-config"; then
  [ ! -f /usr/include/hip/hip_runtime_api.h ] ||
    fail "the HIP headers are installed, but the build did not find them"
  echo "check_rebuild: no HIP headers here (make deps installs them): HIP half skipped"
  exit 0
fi
try_hip
if echo "$out" | grep -q 'unknown backend'; then
  fail "objects not rebuilt when HIP was found: $out"
fi
[ "$rc" -eq 1 ] && echo "$out" | grep -qE 'no HIP device|hipInit' ||
  [ "$rc" -eq 124 ] || # an AMD GPU: the daemon ran until timeout stopped it
  fail "gpumemd --backend hip exited $rc: $out"

# Nothing changed, nothing is rebuilt: the record is not rewritten.
build
! grep -q '  CC ' "$o/make.log" || fail "a make with nothing changed compiled again: $(cat "$o/make.log")"

echo "check_rebuild: passed in $(($(date +%s) - t0)) s"
