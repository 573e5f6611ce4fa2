#!/bin/sh
# Before anything is installed or built: can this clone build and run
# gpumemd? The tree's scripts must run (not a noexec mount) and the build
# directory must be writable and allow programs to run.
#   preflight.sh [BUILD_DIR]   (default build, as the Makefile's O)
# Run by make.sh and make deps as `sh tools/preflight.sh`, so that it can
# speak even where nothing in the tree may be executed.
set -u
[ "${1:-}" = --probe ] && exit 0
cd "$(dirname "$0")/.."
root=$(pwd)
o=${1:-build}
stop() {
  echo "preflight: $1" >&2
  echo "preflight: nothing was installed or built" >&2
  exit 1
}
"$root/tools/preflight.sh" --probe 2>/dev/null ||
  stop "the scripts in $root cannot be run (a file system mounted noexec, or files without their execute bits): clone gpumemd onto a file system that allows programs, e.g. under your home directory"
mkdir -p "$o" 2>/dev/null && [ -w "$o" ] ||
  stop "cannot write the build directory $o (a read-only file system?): clone gpumemd where you can write, or give make O=/a/writable/dir"
probe="$o/.preflight.$$"
printf '#!/bin/sh\nexit 0\n' >"$probe" 2>/dev/null && chmod 755 "$probe" ||
  { rm -f "$probe"; stop "cannot write files into $o (a full or read-only file system?)"; }
if ! "$probe" 2>/dev/null; then
  rm -f "$probe"
  stop "programs built in $o could not run there (a file system mounted noexec): give make O=/a/dir/that/allows/programs"
fi
rm -f "$probe"
