#!/bin/sh
# Download a ROCm HIP header set from a Debian suite into a private prefix,
# never installed system-wide: make check compiles the HIP backend against
# it as well as against the installed one.
#   fetch-rocm-headers.sh [--optional] DIR [SUITE]   (SUITE: sid, the default)
# DIR/usr/include/hip/ holds the headers afterwards. A second run with the
# headers already there does nothing. Needs a Debian package registry that
# serves SUITE; with GPUMEM_NO_APT set it fetches nothing and says so.
# --optional (make check): where the registry or its SUITE index cannot be
# had, say that the headers were skipped and why, and exit 0; without it
# (make check-hip-headers), that is a failure.
set -eu
optional=0
if [ "${1:-}" = --optional ]; then optional=1; shift; fi
dir=${1:?usage: fetch-rocm-headers.sh [--optional] DIR [SUITE]}
suite=${2:-sid}
if [ -f "$dir/usr/include/hip/hip_version.h" ]; then exit 0; fi
if [ -n "${GPUMEM_NO_APT:-}" ]; then
  echo "fetch-rocm-headers: GPUMEM_NO_APT set: not fetching the $suite HIP headers"
  exit 0
fi
# Cannot fetch: the log's last lines, then skip (--optional) or fail.
unavailable() { # $1: what failed, $2: its log
  if [ "$optional" = 1 ]; then
    # The cause is in update's log when update only warned (no network:
    # "Temporary failure resolving"), else in the failed step's own.
    why=$(cat "$apt/update.log" "$2" 2>/dev/null | grep -E '^(E:|W: Failed)' | head -n 1 |
      sed -E 's/^(E|W): *//; s/  +/: /')
    echo "fetch-rocm-headers: skipped: $1${why:+ ($why)}, so the HIP backend is not compiled against the $suite headers here (make check-hip-headers runs it where the registry serves $suite)"
    exit 0
  fi
  [ "$2" = "$apt/update.log" ] || grep -E '^(E|W|Err):' "$apt/update.log" | sed 's/^/    /'
  tail -n 5 "$2" | sed 's/^/    /'
  echo "FAIL: fetch-rocm-headers: $1"
  exit 1
}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
apt=$(mktemp -d "${TMPDIR:-/tmp}/gpumemd-apt.XXXXXX")
trap 'rm -rf "$apt"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/debs"
: >"$apt/status"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $suite main" \
  >"$apt/sources.list"
# apt-get with every state and cache path in $apt: the system's package
# lists and its installed packages are neither read nor changed.
private_apt() {
  apt-get -q -o Dir::Etc::SourceList="$apt/sources.list" -o Dir::Etc::SourceParts=/dev/null \
    -o Dir::State::Lists="$apt/lists" -o Dir::Cache="$apt/cache" \
    -o Dir::State::status="$apt/status" -o Debug::NoLocking=1 \
    -o Dir::Etc::Preferences=/dev/null -o Dir::Etc::PreferencesParts=/dev/null \
    -o APT::Sandbox::User="$(id -un)" -o Acquire::Check-Valid-Until=false "$@"
}
echo "fetch-rocm-headers: downloading libamdhip64-dev and libhsa-runtime-dev from $suite"
private_apt update >"$apt/update.log" 2>&1 || unavailable "apt-get update of $suite failed" "$apt/update.log"
# apt-get update succeeds with an index it could not read (it warns): then
# no package is found, which download says.
(cd "$apt/debs" && private_apt download libamdhip64-dev libhsa-runtime-dev) >"$apt/dl.log" 2>&1 ||
  unavailable "the $suite HIP packages could not be downloaded" "$apt/dl.log"
for f in "$apt"/debs/*.deb; do dpkg-deb -x "$f" "$dir"; done
[ -f "$dir/usr/include/hip/hip_version.h" ] ||
  { echo "fetch-rocm-headers: no hip/hip_version.h in the $suite packages"; exit 1; }
ls "$apt"/debs
