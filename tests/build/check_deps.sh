#!/bin/sh
# What a newcomer meets before anything is built: tools/install-deps.sh
# names what is missing and, where it cannot install (not root, no sudo),
# the one line root should run, and changes nothing; tools/preflight.sh
# refuses a clone or build directory where programs cannot run (noexec) or
# files cannot be written (read-only); a plain make without a dependency
# says to run make deps. The mounts need root (and a kernel that lets this
# machine mount tmpfs): without, those cases are skipped, saying so.
set -u
cd "$(dirname "$0")/../.."
root=$(pwd)
t=$(mktemp -d "${TMPDIR:-/tmp}/gpumemd-deps.XXXXXX")
mounted=""
cleanup() {
  [ -z "$mounted" ] || umount "$mounted" 2>/dev/null
  rm -rf "$t"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
status=0
fail() { echo "FAIL: check_deps: $*"; status=1; }

# A PATH with the few tools install-deps needs to speak, but no make,
# compiler, pkg-config, python3 or sudo: as on a bare Debian. Its apt-get
# only records that it was called: these cases must never reach it, and
# the test must not install anything if they do.
mkdir -p "$t/bin"
for tool in sh id sed mktemp rm dirname cat tail; do
  p=$(command -v "$tool") && ln -s "$p" "$t/bin/$tool"
done
printf '#!/bin/sh\necho "$*" >>%s/apt.calls\nexit 1\n' "$t" >"$t/bin/apt-get"
chmod 755 "$t/bin/apt-get"
: >"$t/apt.calls"
chmod 666 "$t/apt.calls"

# Not root, no sudo: the list and the line, exit 1, nothing installed.
if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null 2>&1; then
  chmod 755 "$t" "$t/bin"
  cp tools/install-deps.sh "$t/install-deps.sh" && chmod 755 "$t/install-deps.sh"
  rc=0
  out=$(cd / && env -i PATH="$t/bin" HIP=0 \
    "$(command -v setpriv)" --reuid=65534 --regid=65534 --clear-groups "$t/bin/sh" "$t/install-deps.sh" 2>&1) || rc=$?
  want_line="    apt-get update && apt-get install -y make build-essential pkg-config libuv1-dev"
  [ "$rc" = 1 ] || fail "install-deps as nobody without sudo exited $rc: $out"
  echo "$out" | grep -q '^install-deps: missing Debian packages: make build-essential pkg-config ' ||
    fail "install-deps as nobody does not list what is missing: $out"
  echo "$out" | grep -q '^install-deps: you are not root and sudo is not installed$' ||
    fail "install-deps as nobody does not say why it cannot install: $out"
  echo "$out" | grep -qF -- "$want_line" ||
    fail "install-deps as nobody does not give root's line ($want_line): $out"
  echo "$out" | grep -q 'installing' && fail "install-deps as nobody installed: $out"
  echo "check_deps: without root or sudo, install-deps names $(echo "$out" | sed -n 's/^install-deps: missing Debian packages://p' | wc -w) packages and root's apt-get line"
else
  echo "check_deps: not root (or no setpriv): install-deps without sudo not tried"
fi

# GPUMEM_NO_APT: says what is missing, installs nothing, exit 0.
rc=0
out=$(env -i PATH="$t/bin" GPUMEM_NO_APT=1 HIP=0 "$t/bin/sh" tools/install-deps.sh 2>&1) || rc=$?
[ "$rc" = 0 ] && echo "$out" | grep -q 'GPUMEM_NO_APT set: not installing' ||
  fail "install-deps with GPUMEM_NO_APT exited $rc: $out"
[ ! -s "$t/apt.calls" ] || fail "install-deps called apt-get: $(cat "$t/apt.calls")"

# make with a dependency missing says to run make deps (and builds nothing).
rc=0
out=$(make --no-print-directory O="$t/o" PKGS="libuv libgpumem-nonexistent" 2>&1) || rc=$?
[ "$rc" != 0 ] && echo "$out" | grep -q 'missing libgpumem-nonexistent: run make deps first' ||
  fail "make without a dependency exited $rc: $out"
[ ! -d "$t/o/obj" ] || fail "make without a dependency compiled something: $(ls "$t/o/obj")"

# preflight on mounts made here: a noexec clone, a noexec build directory,
# a read-only one.
mkdir -p "$t/mnt"
if [ "$(id -u)" = 0 ] && mount -t tmpfs -o noexec,size=8m tmpfs "$t/mnt" 2>/dev/null; then
  mounted="$t/mnt"
  mkdir -p "$t/mnt/clone/tools"
  cp tools/preflight.sh "$t/mnt/clone/tools/"
  rc=0
  out=$(sh "$t/mnt/clone/tools/preflight.sh" 2>&1) || rc=$?
  [ "$rc" = 1 ] && echo "$out" | grep -q 'cannot be run (a file system mounted noexec' &&
    echo "$out" | grep -q 'nothing was installed or built' ||
    fail "preflight on a noexec clone exited $rc: $out"
  rc=0
  out=$(sh tools/preflight.sh "$t/mnt/build" 2>&1) || rc=$?
  [ "$rc" = 1 ] && echo "$out" | grep -q "programs built in $t/mnt/build could not run there" ||
    fail "preflight with a noexec build directory exited $rc: $out"
  mount -o remount,ro "$t/mnt" 2>/dev/null || fail "cannot remount $t/mnt read-only"
  rc=0
  out=$(sh tools/preflight.sh "$t/mnt/other" 2>&1) || rc=$?
  [ "$rc" = 1 ] && echo "$out" | grep -q "cannot write the build directory $t/mnt/other" ||
    fail "preflight with a read-only build directory exited $rc: $out"
  echo "check_deps: preflight refuses a noexec clone, a noexec build directory and a read-only one"
else
  echo "check_deps: cannot mount a tmpfs here (not root, or not allowed): noexec and read-only clones not tried"
fi
rc=0
out=$(sh tools/preflight.sh "$t/ok" 2>&1) || rc=$?
[ "$rc" = 0 ] && [ -z "$out" ] || fail "preflight on a good build directory exited $rc: $out"
[ "$status" = 0 ] && echo "check_deps: passed"
exit "$status"
