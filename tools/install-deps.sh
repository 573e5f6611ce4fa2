#!/bin/sh
# Install the Debian packages gpumemd builds and tests with, if missing.
#   install-deps.sh [bench|fuzz|deb]   (also gnuplot for make bench's plot,
#                                       clang and its sanitizer runtimes for make
#                                       fuzz, or for make deb dpkg-dev, debhelper,
#                                       lintian and debian/control's Build-Depends)
# Run by make deps, demo and check; never by a plain make.
set -e
need=""
if [ "${1:-}" = bench ]; then
  command -v gnuplot >/dev/null 2>&1 || need="$need gnuplot-nox"
fi
if [ "${1:-}" = fuzz ]; then
  command -v clang >/dev/null 2>&1 || need="$need clang"
  ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1 ||
    need="$need libclang-rt-dev"
fi
if [ "${1:-}" = deb ]; then
  command -v dpkg-buildpackage >/dev/null 2>&1 || need="$need dpkg-dev"
  command -v dh >/dev/null 2>&1 || need="$need debhelper"
  command -v lintian >/dev/null 2>&1 || need="$need lintian"
fi
have_pkg() { pkg-config --exists "$1" 2>/dev/null; }
command -v cc >/dev/null 2>&1 || need="$need build-essential"
command -v pkg-config >/dev/null 2>&1 || need="$need pkg-config"
have_pkg libuv || need="$need libuv1-dev"
have_pkg libprotobuf-c || need="$need libprotobuf-c-dev"
command -v protoc-c >/dev/null 2>&1 || need="$need protobuf-c-compiler"
have_pkg check || need="$need check"
have_pkg libxxhash || need="$need libxxhash-dev"
have_pkg libsystemd || need="$need libsystemd-dev"
# tmux, the terminal tests/build/check_top.sh drives gpumemctl top in.
command -v tmux >/dev/null 2>&1 || need="$need tmux"
# ncursesw for gpumemctl top.
have_pkg ncursesw || need="$need libncurses-dev"
# scdoc turns man/*.scd into the man pages (make builds them where it is).
command -v scdoc >/dev/null 2>&1 || need="$need scdoc"
# systemd-analyze, for make check's verify of the units in systemd/.
command -v systemd-analyze >/dev/null 2>&1 || need="$need systemd"
# pytest for tests/python (make test runs it with python3, else /usr/bin/python3).
python3 -c 'import pytest' 2>/dev/null || /usr/bin/python3 -c 'import pytest' 2>/dev/null ||
  need="$need python3-pytest"
# HIP headers and runtime: the hip backend builds against them everywhere,
# unless the build says HIP=0 or they are under ROCM_PATH.
if [ "${HIP:-}" != 0 ] && [ ! -f "${ROCM_PATH:-/opt/rocm}/include/hip/hip_runtime_api.h" ]; then
  [ -f /usr/include/hip/hip_runtime_api.h ] || need="$need libamdhip64-dev"
fi
# make deb: whether dpkg finds debian/control's Build-Depends installed.
root=$(cd "$(dirname "$0")/.." && pwd)
builddeps_met() {
  [ "${1:-}" != deb ] || (cd "$root" && dpkg-checkbuilddeps >/dev/null 2>&1)
}
[ -z "$need" ] && builddeps_met "${1:-}" && exit 0
if [ -n "${GPUMEM_NO_APT:-}" ]; then
  builddeps_met "${1:-}" || need="$need (Build-Depends of debian/control)"
  echo "install-deps: missing$need (GPUMEM_NO_APT set: not installing)"
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
if [ -n "$need" ]; then
  echo "install-deps: installing$need"
  # shellcheck disable=SC2086
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need
fi
if ! builddeps_met "${1:-}"; then
  echo "install-deps: installing debian/control's Build-Depends"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get build-dep -y -qq "$root"
fi
