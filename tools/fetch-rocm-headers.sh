#!/bin/sh
# Download a ROCm HIP header set from a Debian suite into a private prefix,
# never installed system-wide: make check compiles the HIP backend against
# it as well as against the installed one.
#   fetch-rocm-headers.sh DIR [SUITE]   (SUITE: sid, the default)
# DIR/usr/include/hip/ holds the headers afterwards. A second run with the
# headers already there does nothing. Needs a Debian package registry; with
# GPUMEM_NO_APT set it fetches nothing and says so.
set -eu
dir=${1:?usage: fetch-rocm-headers.sh DIR [SUITE]}
suite=${2:-sid}
if [ -f "$dir/usr/include/hip/hip_version.h" ]; then exit 0; fi
if [ -n "${GPUMEM_NO_APT:-}" ]; then
  echo "fetch-rocm-headers: GPUMEM_NO_APT set: not fetching the $suite HIP headers"
  exit 0
fi
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
apt=$(mktemp -d "${TMPDIR:-/tmp}/gpumemd-apt.XXXXXX")
trap 'rm -rf "$apt"' EXIT INT TERM
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
    -o APT::Sandbox::User="$(id -un)" "$@"
}
echo "fetch-rocm-headers: downloading libamdhip64-dev and libhsa-runtime-dev from $suite"
private_apt update >"$apt/update.log" 2>&1 || { cat "$apt/update.log"; exit 1; }
(cd "$apt/debs" && private_apt download libamdhip64-dev libhsa-runtime-dev) >"$apt/dl.log" 2>&1 ||
  { cat "$apt/dl.log"; exit 1; }
for f in "$apt"/debs/*.deb; do dpkg-deb -x "$f" "$dir"; done
[ -f "$dir/usr/include/hip/hip_version.h" ] ||
  { echo "fetch-rocm-headers: no hip/hip_version.h in the $suite packages"; exit 1; }
ls "$apt"/debs
