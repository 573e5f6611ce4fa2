#!/bin/sh
# make, on a machine that may not have it yet: installs the Debian packages
# gpumemd builds and tests with (make among them, tools/install-deps.sh),
# then runs make with the same arguments.
#   sh make.sh demo      (the same as make demo once make is there)
set -eu
cd "$(dirname "$0")"
# O, HIP and ROCM_PATH, from the environment or as make arguments, are
# what preflight and install-deps look at too.
o=${O:-build}
for a in "$@"; do
  case $a in
  O=*) o=${a#O=} ;;
  HIP=* | ROCM_PATH=*) export "${a?}" ;;
  esac
done
sh tools/preflight.sh "$o"
sh tools/install-deps.sh
exec make "$@"
