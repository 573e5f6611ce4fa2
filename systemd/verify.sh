#!/bin/sh
# Check the units with systemd-analyze, when it is installed:
#   systemd/verify.sh BUILD_DIR
# `verify` runs on copies whose ExecStart names the built daemon (the
# installed path does not exist on a build machine); `security` must score
# the service at 2.5 or lower.
set -eu
build=$1
if ! command -v systemd-analyze >/dev/null 2>&1; then
  echo "systemd units: skipped: no systemd-analyze here"
  exit 0
fi
here=$(dirname "$0")
tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpumemd-units.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
sed "s|/usr/sbin/gpumemd|$build/bin/gpumemd|" "$here/gpumemd.service" > "$tmp/gpumemd.service"
cp "$here/gpumemd.socket" "$tmp/"
# --man=no: the man page is checked where it is installed, not here.
if ! systemd-analyze verify --man=no "$tmp/gpumemd.service" "$tmp/gpumemd.socket" \
     > "$tmp/verify.log" 2>&1 || [ -s "$tmp/verify.log" ]; then
  cat "$tmp/verify.log"
  echo "systemd units: systemd-analyze verify failed"
  exit 1
fi
if systemd-analyze security --offline=yes "$here/gpumemd.service" > "$tmp/security.log" 2>&1; then
  score=$(sed -n 's/.*Overall exposure level for gpumemd.service: \([0-9.]*\).*/\1/p' "$tmp/security.log")
  if [ -z "$score" ] || ! awk -v s="$score" 'BEGIN { exit !(s <= 2.5) }'; then
    cat "$tmp/security.log"
    echo "systemd units: security exposure ${score:-unknown} is above 2.5"
    exit 1
  fi
  echo "systemd units: verified; security exposure $score"
else
  echo "systemd units: verified; security not scored (systemd-analyze security --offline unsupported)"
fi
