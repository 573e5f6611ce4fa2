#!/bin/sh
# make, on a machine that may not have it yet: installs the Debian packages
# gpumemd builds and tests with (make among them, tools/install-deps.sh),
# then runs make with the same arguments.
#   sh make.sh demo      (the same as make demo once make is there)
set -eu
cd "$(dirname "$0")"
o=build
for a in "$@"; do
  case $a in O=*) o=${a#O=} ;; esac
done
sh tools/preflight.sh "$o"
sh tools/install-deps.sh
exec make "$@"
