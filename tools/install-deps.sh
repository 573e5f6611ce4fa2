#!/bin/sh
# Install the Debian packages gpumemd builds and tests with, if missing.
#   install-deps.sh [bench|fuzz|deb]   (also gnuplot for make bench's plot,
#                                       clang and its sanitizer runtimes for make
#                                       fuzz, or for make deb dpkg-dev, debhelper,
#                                       lintian and debian/control's Build-Depends)
# Run by make.sh (before make itself is there), make deps, demo and check;
# never by a plain make. It says what is missing before it changes anything,
# and stops, saying what to run, where it cannot install: no root and no
# sudo, no apt-get, a registry it cannot reach, an apt that is broken.
set -eu
what=${1:-}
need=""
add() { need="$need $1"; }
if [ "$what" = bench ]; then
  command -v gnuplot >/dev/null 2>&1 || add gnuplot-nox
fi
if [ "$what" = fuzz ]; then
  command -v clang >/dev/null 2>&1 || add clang
  ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1 ||
    add libclang-rt-dev
fi
if [ "$what" = deb ]; then
  command -v dpkg-buildpackage >/dev/null 2>&1 || add dpkg-dev
  command -v dh >/dev/null 2>&1 || add debhelper
  command -v lintian >/dev/null 2>&1 || add lintian
fi
have_pkg() { command -v pkg-config >/dev/null 2>&1 && pkg-config --exists "$1" 2>/dev/null; }
command -v make >/dev/null 2>&1 || add make
command -v cc >/dev/null 2>&1 || add build-essential
command -v pkg-config >/dev/null 2>&1 || add pkg-config
have_pkg libuv || add libuv1-dev
have_pkg libprotobuf-c || add libprotobuf-c-dev
command -v protoc-c >/dev/null 2>&1 || add protobuf-c-compiler
have_pkg check || add check
have_pkg libxxhash || add libxxhash-dev
have_pkg libsystemd || add libsystemd-dev
# liburing: disk backups' io_uring (without it, pread and pwrite).
have_pkg liburing || add liburing-dev
# tmux, the terminal tests/build/check_top.sh drives gpumemctl top in.
command -v tmux >/dev/null 2>&1 || add tmux
# ncursesw for gpumemctl top.
have_pkg ncursesw || add libncurses-dev
# scdoc turns man/*.scd into the man pages (make builds them where it is).
command -v scdoc >/dev/null 2>&1 || add scdoc
# groff, which check_man renders the pages with to catch their warnings.
command -v groff >/dev/null 2>&1 || add groff-base
# systemd-analyze, for make check's verify of the units in systemd/.
command -v systemd-analyze >/dev/null 2>&1 || add systemd
# pytest for tests/python (make test runs it with python3, else /usr/bin/python3).
python3 -c 'import pytest' 2>/dev/null || /usr/bin/python3 -c 'import pytest' 2>/dev/null ||
  add python3-pytest
# HIP headers and runtime: the hip backend builds against them everywhere,
# unless the build says HIP=0 or they are under ROCM_PATH.
if [ "${HIP:-}" != 0 ] && [ ! -f "${ROCM_PATH:-/opt/rocm}/include/hip/hip_runtime_api.h" ]; then
  [ -f /usr/include/hip/hip_runtime_api.h ] || add libamdhip64-dev
fi
# make deb: whether dpkg finds debian/control's Build-Depends installed.
root=$(cd "$(dirname "$0")/.." && pwd)
builddeps_met() {
  [ "$what" != deb ] || (cd "$root" && dpkg-checkbuilddeps >/dev/null 2>&1)
}
[ -z "$need" ] && builddeps_met && exit 0

say() { echo "install-deps: $*"; }
if [ -n "$need" ]; then
  say "missing Debian packages:$need"
fi
if [ "$what" = deb ] && ! command -v dpkg-checkbuilddeps >/dev/null 2>&1; then
  say "debian/control's Build-Depends: not checked yet (dpkg-dev is missing); apt-get build-dep installs them"
elif ! builddeps_met; then
  say "missing: debian/control's Build-Depends (apt-get build-dep $root)"
fi
if [ -n "${GPUMEM_NO_APT:-}" ]; then
  say "GPUMEM_NO_APT set: not installing"
  exit 0
fi

# What root would run, said whole wherever this script cannot run it.
line="apt-get update"
[ -z "$need" ] || line="$line && apt-get install -y$need"
builddeps_met || line="$line && apt-get build-dep -y $root"
stop() {
  say "$1"
  say "as root, run:"
  echo "    $line"
  say "then run the same command again"
  exit 1
}
command -v apt-get >/dev/null 2>&1 ||
  stop "no apt-get here: gpumemd's make demo and make check install with apt-get (Debian 12 or later)"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || stop "you are not root and sudo is not installed"
  # sudo -n succeeds without asking where no password is needed (or one
  # was given lately); otherwise ask once, on a terminal only.
  if ! sudo -n true 2>/dev/null; then
    if [ -t 0 ]; then
      say "sudo asks for your password to install them"
      sudo -v || stop "sudo refused ($(id -un) may not run apt-get through sudo)"
    else
      stop "you are not root and sudo needs a password, with no terminal to ask on"
    fi
  fi
  sudo="sudo"
fi
apt() { $sudo env DEBIAN_FRONTEND=noninteractive apt-get "$@"; }
log=$(mktemp "${TMPDIR:-/tmp}/gpumemd-apt.XXXXXX")
updlog=$(mktemp "${TMPDIR:-/tmp}/gpumemd-apt.XXXXXX")
trap 'rm -f "$log" "$updlog"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
# A stale list still installs what it has; a registry out of reach shows
# in the install that follows, which stops before changing anything. apt's
# update exits 0 when it could not fetch an index (it only warns): its
# warnings are shown when the install then fails.
if ! apt update -qq >"$updlog" 2>&1; then
  say "apt-get update failed (trying with the package lists already here):"
  sed 's/^/    /' "$updlog"
  : >"$updlog"
fi
# Stop after a failed apt-get: its words (and update's warnings), and
# what root should run first when dpkg itself is left half done.
apt_failed() { # $1: what failed
  sed 's/^/    /' "$log"
  if grep -q '^[WE]:\|^Err:' "$updlog"; then
    say "apt-get update had said:"
    grep '^[WE]:\|^Err:' "$updlog" | sed 's/^/    /'
  fi
  if grep -q "dpkg --configure -a" "$log"; then
    line="dpkg --configure -a && $line"
  fi
  stop "$1"
}
if [ -n "$need" ]; then
  say "installing$need"
  # shellcheck disable=SC2086
  if ! apt install -y -qq $need >"$log" 2>&1; then
    apt_failed "apt-get install failed (above): nothing was built"
  fi
fi
if ! builddeps_met; then
  say "installing debian/control's Build-Depends"
  if ! apt build-dep -y -qq "$root" >"$log" 2>&1; then
    apt_failed "apt-get build-dep failed (above)"
  fi
fi
say "installed"
