#!/bin/sh
# The HIP backend, the platform of the bug gpumemd exists for, compiles
# with -Werror against every ROCm header set given, and records which (the
# string gpumemd --version prints). No AMD GPU is needed: this checks the
# build only, of the objects that include the HIP headers.
#   check_hip_headers.sh PREFIX...   (each with PREFIX/include/hip/)
# A PREFIX without headers is skipped, saying so (a node that may not
# download them: GPUMEM_NO_APT).
set -eu
cd "$(dirname "$0")/../.."
. tests/build/lib.sh
fresh_build hip

fail() { echo "FAIL: check_hip_headers: $*"; exit 1; }

for prefix in "$@"; do
  v=$prefix/include/hip/hip_version.h
  if [ ! -f "$v" ]; then
    echo "check_hip_headers: skipped $prefix: no hip/hip_version.h there"
    continue
  fi
  want=$(awk '/#define HIP_VERSION_(MAJOR|MINOR|PATCH) /{printf "%s%s", sep, $3; sep="."}' "$v")
  b=$o/$(echo "$prefix" | tr / _)
  objs=""
  for f in gpu/hip_lib.c gpu/hip_dev.c gpu/hip_va.c gpu/vmm.c gpu/vmm_dev.c gpu/vmm_va.c \
    gpu/gpudev.c gpu/gpuva.c daemon/main.c; do objs="$objs $b/obj/${f%.c}.o"; done
  # shellcheck disable=SC2086
  make -j"$jobs" --no-print-directory O="$b" HIP=1 ROCM_PATH="$prefix" $objs \
    >"$b.log" 2>&1 || { cat "$b.log"; fail "HIP $want headers ($prefix): the build failed"; }
  grep -aq "HIP $want" "$b/obj/gpu/hip_lib.o" ||
    fail "gpu/hip_lib.o built against $prefix does not record HIP $want"
  echo "check_hip_headers: HIP backend compiles with -Werror against HIP $want ($prefix)"
done
