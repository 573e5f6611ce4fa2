#!/bin/sh
# make install and make uninstall from an already built tree ($GPUMEM_O, the
# Makefile's O): a staged Debian-style install (DESTDIR, PREFIX=/usr,
# multiarch LIBDIR) has a gpumem.pc for where it is installed, no RUNPATH
# into the build tree, gpumem-worker out of bin/, a header and library that
# build and load the README's example, the systemd units, the sysusers file
# and (when built) the man pages; uninstall leaves no file. Then the
# issue's case: `make install PREFIX=dir` after a default build writes a
# gpumem.pc that says dir, not /usr/local, and units whose ExecStart is
# dir's gpumemd.
set -eu
cd "$(dirname "$0")/../.."
o=${GPUMEM_O:-build}
build=$(cd "$o" && pwd)
t=$(mktemp -d "${TMPDIR:-/tmp}/gpumemd-install.XXXXXX")
trap 'rm -rf "$t"' EXIT INT TERM

fail() { echo "FAIL: check_install: $*"; exit 1; }

# make in this tree with this build's variables (MAKEFLAGS is kept), never
# touching the system's loader cache.
mk() {
  make --no-print-directory O="$o" LDCONFIG=: "$@" >"$t/make.log" 2>&1 ||
    { cat "$t/make.log"; fail "make O=$o $* failed"; }
}

multiarch=$(gcc -print-multiarch 2>/dev/null || true)
[ -n "$multiarch" ] || multiarch=x86_64-linux-gnu
libdir=/usr/lib/$multiarch
stage=$t/stage
set -- DESTDIR="$stage" PREFIX=/usr LIBDIR="$libdir"
# The install's make sees the build's flags: its build-config is unchanged.
cp "$o/build-config" "$t/build-config"
mk install "$@"
cmp -s "$o/build-config" "$t/build-config" ||
  fail "make install changed $o/build-config: $(diff "$t/build-config" "$o/build-config")"

# Where things are.
for f in usr/sbin/gpumemd usr/bin/gpumemctl usr/libexec/gpumemd/gpumem-worker \
         usr/include/gpumem.h "${libdir#/}/libgpumem.so.1" "${libdir#/}/libgpumem_preload.so" \
         "${libdir#/}/pkgconfig/gpumem.pc"; do
  [ -f "$stage/$f" ] || fail "$f not installed"
done
[ "$(readlink "$stage$libdir/libgpumem.so")" = libgpumem.so.1 ] ||
  fail "$libdir/libgpumem.so is not a link to libgpumem.so.1"
[ ! -e "$stage/usr/bin/gpumem-worker" ] || fail "gpumem-worker installed in bin/"
[ ! -e "$stage/usr/bin/gpumemd" ] || fail "gpumemd installed in bin/, not sbin/"
readelf -d "$stage$libdir/libgpumem.so.1" | grep -q 'SONAME.*\[libgpumem\.so\.1\]' ||
  fail "libgpumem.so.1 has no soname libgpumem.so.1"

# The units of systemd/ (every service, socket and timer) in
# SYSTEMDUNITDIR, naming the installed programs, the sysusers file as
# gpumem.conf, and the man pages where make built them.
units() { # $1: the directory units are installed in
  for u in systemd/*.service systemd/*.socket systemd/*.timer; do
    [ -f "$u" ] || continue
    [ -f "$1/${u#systemd/}" ] || fail "${u#systemd/} not installed in ${1#"$stage"}"
  done
}
units "$stage/usr/lib/systemd/system"
svc=$stage/usr/lib/systemd/system/gpumemd.service
grep -q '^ExecStart=/usr/sbin/gpumemd ' "$svc" ||
  fail "installed gpumemd.service: $(grep ExecStart "$svc")"
cmp -s systemd/gpumem.sysusers "$stage/usr/lib/sysusers.d/gpumem.conf" ||
  fail "systemd/gpumem.sysusers not installed as /usr/lib/sysusers.d/gpumem.conf"
for page in gpumemd.8 gpumemctl.1 libgpumem.3; do
  dest=$stage/usr/share/man/man${page##*.}/$page
  if [ -f "$o/man/$page" ]; then
    cmp -s "$o/man/$page" "$dest" || fail "man page $page not installed as ${dest#"$stage"}"
  else
    [ ! -e "$dest" ] || fail "man page $page installed, but not built in $o/man"
  fi
done
[ -f "$o/man/gpumemd.8" ] || echo "check_install: man pages not built (no scdoc): not installed"

# The pkg-config file names the prefix and multiarch libdir it was installed
# under.
pc=$stage$libdir/pkgconfig/gpumem.pc
grep -qx 'prefix=/usr' "$pc" || fail "gpumem.pc: $(head -3 "$pc")"
grep -qx "libdir=\${prefix}/lib/$multiarch" "$pc" || fail "gpumem.pc: $(head -3 "$pc")"

# No installed ELF file has a RUNPATH or RPATH, but the preload library's
# $ORIGIN (libgpumem.so.1 is installed next to it).
find "$stage" -type f | while read -r f; do
  head -c 4 "$f" | grep -q 'ELF' || continue
  rp=$(readelf -d "$f" | sed -n 's/.*(R[UN]*PATH).*\[\(.*\)\]/\1/p')
  case "$f:$rp" in
    *:) ;;
    */libgpumem_preload.so:\$ORIGIN) ;;
    *) fail "${f#"$stage"} has RUNPATH or RPATH '$rp'" ;;
  esac
  case "$rp" in *"$build"*|*build/*) fail "${f#"$stage"} has a build-tree RUNPATH '$rp'" ;; esac
done

# The README's example, built against the installed header and library as
# pkg-config gives them, loads libgpumem.so.1 from there: without a daemon
# it fails with the connect error, not a loader error.
flags=$(PKG_CONFIG_PATH="$stage$libdir/pkgconfig" PKG_CONFIG_SYSROOT_DIR="$stage" \
  PKG_CONFIG_ALLOW_SYSTEM_CFLAGS=1 PKG_CONFIG_ALLOW_SYSTEM_LIBS=1 \
  pkg-config --cflags --libs gpumem) || fail "pkg-config gpumem failed"
echo "$flags" | grep -q -- "-L$stage$libdir" || fail "pkg-config gpumem gives '$flags'"
# Its version is the header's.
want=$(sed -n 's/^#define GPUMEM_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)$/\2/p' include/gpumem.h |
  paste -sd.)
have=$(PKG_CONFIG_PATH="$stage$libdir/pkgconfig" pkg-config --modversion gpumem)
[ "$have" = "$want" ] || fail "pkg-config --modversion gpumem says '$have', gpumem.h $want"
cc -std=c11 -Wall -Wextra -Werror examples/worker.c $flags -o "$t/worker" || # $flags: words
  fail "examples/worker.c does not build against the install: cc ... $flags"
# The loader path that puts $1 first and keeps the caller's LD_LIBRARY_PATH
# after it (on some machines libprotobuf-c is found only through it).
ldpath() { # $1: the libdir to load from first
  echo "$1${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}
run_worker() { # $1: the libdir to load from
  rc=0
  out=$(GPUMEM_SOCKET="$t/none.sock" LD_LIBRARY_PATH="$(ldpath "$1")" timeout 10 "$t/worker" 2>&1) || rc=$?
  [ "$rc" -eq 1 ] && echo "$out" | grep -q '^gpumem: ' &&
    ! echo "$out" | grep -q 'error while loading shared libraries' ||
    fail "installed example exited $rc: $out"
  LD_LIBRARY_PATH="$(ldpath "$1")" ldd "$t/worker" | grep -q "libgpumem.so.1 => $1/libgpumem.so.1" ||
    fail "the example does not load $1/libgpumem.so.1: $(LD_LIBRARY_PATH="$(ldpath "$1")" ldd "$t/worker")"
}
run_worker "$stage$libdir"
# The installed programs run from there too.
LD_LIBRARY_PATH="$(ldpath "$stage$libdir")" "$stage/usr/bin/gpumemctl" --help >/dev/null 2>&1 ||
  fail "installed gpumemctl --help failed"

# Uninstall removes every file install put.
mk uninstall "$@"
left=$(find "$stage" ! -type d)
[ -z "$left" ] || fail "make uninstall left: $left"

# After a default build (gpumem.pc of the build tree says /usr/local), an
# install under another PREFIX says that PREFIX.
dir=$t/prefix
mk install PREFIX="$dir"
cmp -s "$o/build-config" "$t/build-config" ||
  fail "make install PREFIX=$dir changed $o/build-config"
pc=$dir/lib/pkgconfig/gpumem.pc
grep -qx "prefix=$dir" "$pc" || fail "make install PREFIX=$dir wrote: $(head -3 "$pc")"
# No sysroot of the caller's (the GPU machine points one at its unpacked
# packages): these paths are the PREFIX's own.
[ "$(PKG_CONFIG_SYSROOT_DIR= PKG_CONFIG_PATH="$dir/lib/pkgconfig" pkg-config --variable=libdir gpumem)" = "$dir/lib" ] ||
  fail "gpumem.pc under PREFIX=$dir: libdir is not $dir/lib"
flags=$(PKG_CONFIG_SYSROOT_DIR= PKG_CONFIG_PATH="$dir/lib/pkgconfig" pkg-config --cflags --libs gpumem)
cc -std=c11 -Wall -Wextra -Werror examples/worker.c $flags -o "$t/worker" || # $flags: words
  fail "examples/worker.c does not build against PREFIX=$dir"
run_worker "$dir/lib"
# The units name the programs where they were installed, and no other.
units "$dir/lib/systemd/system"
svc=$dir/lib/systemd/system/gpumemd.service
grep -q "^ExecStart=$dir/sbin/gpumemd " "$svc" ||
  fail "gpumemd.service under PREFIX=$dir: $(grep ExecStart "$svc")"
! grep -rq '/usr/sbin/\|/usr/bin/\|/usr/libexec/' "$dir/lib/systemd/system" ||
  fail "units under PREFIX=$dir name /usr: $(grep -r '/usr/' "$dir/lib/systemd/system")"
[ -f "$dir/lib/sysusers.d/gpumem.conf" ] || fail "no $dir/lib/sysusers.d/gpumem.conf"
# systemd itself accepts them, run from there (--man=no: the pages are not
# where man looks).
if command -v systemd-analyze >/dev/null 2>&1; then
  systemd-analyze verify --man=no "$dir"/lib/systemd/system/* > "$t/verify.log" 2>&1 &&
    [ ! -s "$t/verify.log" ] ||
    fail "systemd-analyze verify of the installed units: $(cat "$t/verify.log")"
fi
mk uninstall PREFIX="$dir"
left=$(find "$dir" ! -type d)
[ -z "$left" ] || fail "make uninstall PREFIX=$dir left: $left"

echo "check_install: staged and PREFIX installs and uninstalls passed"
