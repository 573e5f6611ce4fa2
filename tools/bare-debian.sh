#!/bin/bash
# The README's commands as a newcomer runs them, on a bare Debian: a
# debootstrap root of SUITE (made once, kept as a tarball), a clone of this
# repository's HEAD in it, and each command run in the clone in turn.
#   tools/bare-debian.sh SUITE MODE CMD...
#   SUITE: bookworm | trixie   (the root: $GPUMEM_BARE_DIR/SUITE.tar, made
#          with debootstrap from deb.debian.org when missing)
#   MODE:  root    - the clone in /root/gpumemd (/root mode 0700), as root
#          sudoer  - user dev (useradd -m) with passwordless sudo, the clone
#                    in /home/dev/gpumemd owned by dev, as dev
#          nosudo  - user dev, no sudo installed, as dev
#   CMD:   one shell command each, run in the clone in order (as typed);
#          stops at the first that fails unless KEEP_GOING=1.
# e.g.  tools/bare-debian.sh bookworm root 'sh make.sh demo' 'make check'
# Needs root and debootstrap. Each run extracts a fresh root (removed after
# unless KEEP_ROOT=1); the output, each command's exit status and seconds
# go to $GPUMEM_BARE_DIR/logs/. GPUMEM_BARE_DIR: default /var/tmp/gpumemd-bare.
set -u
BASE=${GPUMEM_BARE_DIR:-/var/tmp/gpumemd-bare}
SRC=$(cd "$(dirname "$0")/.." && pwd)
SUITE=${1:?suite}; MODE=${2:?mode}; shift 2
[ $# -ge 1 ] || { echo "usage: $0 SUITE MODE CMD..." >&2; exit 2; }
case $MODE in root|sudoer|nosudo) ;; *) echo "bad mode $MODE" >&2; exit 2;; esac
TAR=$BASE/$SUITE.tar
[ "$(id -u)" = 0 ] || { echo "bare-debian: must run as root" >&2; exit 2; }
if [ ! -f "$TAR" ]; then
  command -v debootstrap >/dev/null || { echo "bare-debian: needs debootstrap (apt-get install debootstrap)" >&2; exit 2; }
  mkdir -p "$BASE"
  fresh=$(mktemp -d "$BASE/debootstrap.XXXXXX")
  echo "bare-debian: debootstrap $SUITE into $fresh (once)"
  debootstrap "$SUITE" "$fresh" http://deb.debian.org/debian >"$BASE/debootstrap-$SUITE.log" 2>&1 ||
    { tail -5 "$BASE/debootstrap-$SUITE.log"; rm -rf "$fresh"; exit 2; }
  printf 'deb http://deb.debian.org/debian %s main\ndeb http://deb.debian.org/debian %s-updates main\ndeb http://deb.debian.org/debian-security %s-security main\n' \
    "$SUITE" "$SUITE" "$SUITE" >"$fresh/etc/apt/sources.list"
  rm -rf "$fresh"/var/lib/apt/lists/* "$fresh"/var/cache/apt/archives/*.deb
  tar -cpf "$TAR.new" -C "$fresh" --numeric-owner . && mv "$TAR.new" "$TAR"
  rm -rf "$fresh"
fi

mkdir -p "$BASE/logs"
TS=$(date +%Y%m%d-%H%M%S)
LOG=$BASE/logs/$SUITE-$MODE-$TS-$$.log
n=1; while [ -e "$BASE/run-$SUITE-$n" ]; do n=$((n+1)); done
ROOT=$BASE/run-$SUITE-$n
mkdir "$ROOT" || exit 2

exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!

MOUNTS=()
cleanup() {
  local rc=$?
  for ((i=${#MOUNTS[@]}-1; i>=0; i--)); do
    umount -l "${MOUNTS[i]}" 2>/dev/null || echo "bare-debian: umount ${MOUNTS[i]} failed"
  done
  if [ "${KEEP_ROOT:-0}" != 1 ]; then
    # only remove if nothing is still mounted below it
    if ! grep -q " $ROOT/" /proc/mounts; then rm -rf --one-file-system "$ROOT"; fi
  else
    echo "bare-debian: kept root $ROOT"
  fi
  echo "bare-debian: log $LOG"
  exec >&- 2>&-
  wait "$TEE_PID" 2>/dev/null
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

echo "bare-debian: suite=$SUITE mode=$MODE src=$SRC root=$ROOT log=$LOG"
echo "bare-debian: src HEAD $(git -C "$SRC" log -1 --oneline 2>/dev/null)"
t0=$(date +%s)
tar -xpf "$TAR" -C "$ROOT" --numeric-owner || exit 2
echo "bare-debian: extracted in $(( $(date +%s)-t0 ))s"

for m in proc sys dev dev/pts dev/shm; do
  mkdir -p "$ROOT/$m"
  case $m in
    proc) mount -t proc proc "$ROOT/proc" ;;
    sys) mount --rbind /sys "$ROOT/sys"; mount --make-rslave "$ROOT/sys" ;;
    *) mount --bind "/$m" "$ROOT/$m" ;;
  esac || exit 2
  MOUNTS+=("$ROOT/$m")
done
cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf" 2>/dev/null || true
# As the installer does on a real machine: the host name resolves (sudo warns otherwise).
grep -qw "$(hostname)" "$ROOT/etc/hosts" || echo "127.0.1.1 $(hostname)" >> "$ROOT/etc/hosts"

inroot() { chroot "$ROOT" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
             HOME=/root TERM="${TERM:-xterm}" LANG=C.UTF-8 /bin/sh -c "$1"; }

# Clone outside (git is not in a bare root), then copy in.
CLONE=$(mktemp -d /tmp/gpumemd-bare-clone.XXXXXX)
git clone -q --no-local "$SRC" "$CLONE/gpumemd" || exit 2

if [ "$MODE" = root ]; then
  chmod 0700 "$ROOT/root"
  cp -a "$CLONE/gpumemd" "$ROOT/root/gpumemd"
  chown -R 0:0 "$ROOT/root/gpumemd"
  USER_NAME=root; HOMEDIR=/root
else
  if [ "$MODE" = sudoer ]; then
    t1=$(date +%s)
    echo "bare-debian: installing sudo in the root"
    inroot 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq sudo >/dev/null' || exit 2
    echo "bare-debian: sudo installed in $(( $(date +%s)-t1 ))s"
  fi
  inroot 'useradd -m -s /bin/bash dev' || exit 2
  if [ "$MODE" = sudoer ]; then
    echo 'dev ALL=(ALL) NOPASSWD:ALL' > "$ROOT/etc/sudoers.d/dev"
    chmod 0440 "$ROOT/etc/sudoers.d/dev"
  fi
  uid=$(chroot "$ROOT" id -u dev); gid=$(chroot "$ROOT" id -g dev)
  cp -a "$CLONE/gpumemd" "$ROOT/home/dev/gpumemd"
  chown -R "$uid:$gid" "$ROOT/home/dev/gpumemd"
  USER_NAME=dev; HOMEDIR=/home/dev
fi
rm -rf "$CLONE"
WORK=$HOMEDIR/gpumemd

rc=0; i=0
for cmd in "$@"; do
  i=$((i+1))
  echo "================================================================"
  echo "bare-debian: [$i] ($USER_NAME in $WORK) \$ $cmd"
  echo "================================================================"
  ts=$(date +%s)
  if [ "$USER_NAME" = root ]; then
    chroot "$ROOT" /usr/bin/env -i \
      PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      HOME=/root USER=root LOGNAME=root SHELL=/bin/bash TERM="${TERM:-xterm}" \
      /bin/bash -c "cd '$WORK' && $cmd" </dev/null
  else
    chroot --userspec="$uid:$gid" --groups="$(chroot "$ROOT" id -G dev | tr ' ' ,)" "$ROOT" /usr/bin/env -i \
      PATH=/usr/local/bin:/usr/bin:/bin HOME=/home/dev USER=dev LOGNAME=dev SHELL=/bin/bash \
      TERM="${TERM:-xterm}" \
      /bin/bash -c "cd '$WORK' && $cmd" </dev/null
  fi
  rc=$?
  echo "bare-debian: [$i] exit code $rc, elapsed $(( $(date +%s)-ts ))s: $cmd"
  if [ $rc -ne 0 ] && [ "${KEEP_GOING:-0}" != 1 ]; then break; fi
done
echo "bare-debian: total elapsed $(( $(date +%s)-t0 ))s, final exit code $rc"
exit $rc
