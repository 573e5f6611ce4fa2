#!/bin/sh
# Check the units with systemd-analyze, when it is installed:
#   systemd/verify.sh BUILD_DIR
# `verify` runs on copies whose ExecStart names the built programs (the
# installed paths do not exist on a build machine); `security` must score
# gpumemd.service and gpumem-metrics.service at 2.5 or lower.
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
sed "s|/usr/bin/gpumemctl|$build/bin/gpumemctl|" "$here/gpumem-metrics.service" \
  > "$tmp/gpumem-metrics.service"
cp "$here/gpumemd.socket" "$here/gpumem-metrics.timer" "$tmp/"
# --man=no: the man page is checked where it is installed, not here.
if ! systemd-analyze verify --man=no "$tmp/gpumemd.service" "$tmp/gpumemd.socket" \
       "$tmp/gpumem-metrics.service" "$tmp/gpumem-metrics.timer" \
     > "$tmp/verify.log" 2>&1 || [ -s "$tmp/verify.log" ]; then
  cat "$tmp/verify.log"
  echo "systemd units: systemd-analyze verify failed"
  exit 1
fi
# The exposure systemd-analyze gives unit $1 (empty if it cannot score).
score_of() {
  systemd-analyze security --offline=yes "$here/$1" > "$tmp/security.log" 2>&1 || return 0
  sed -n "s/.*Overall exposure level for $1: \([0-9.]*\).*/\1/p" "$tmp/security.log"
}
if systemd-analyze security --offline=yes "$here/gpumemd.service" > /dev/null 2>&1; then
  scores=
  for unit in gpumemd.service gpumem-metrics.service; do
    score=$(score_of "$unit")
    if [ -z "$score" ] || ! awk -v s="$score" 'BEGIN { exit !(s <= 2.5) }'; then
      cat "$tmp/security.log"
      echo "systemd units: $unit: security exposure ${score:-unknown} is above 2.5"
      exit 1
    fi
    scores="$scores${scores:+, }$unit $score"
  done
  echo "systemd units: verified; security exposure $scores"
else
  echo "systemd units: verified; security not scored (systemd-analyze security --offline unsupported)"
fi
