#!/bin/sh
# Everything GPU in one go, on a machine with an NVIDIA GPU: build with the
# CUDA backend, run the test suites, the GPU checks (judged by the driver's
# own free-memory figure) and the benchmarks. Log: $LOG (default gpu.log).
#   [GPU_BENCH=0] [GPU_SUITES=0] [TMS_SRC=DIR] tests/gpu/run.sh [LOG]
set -u
log=${1:-gpu.log}
# No package registry there: never try apt; no HIP headers there either.
export GPUMEM_NO_APT=1 GPUMEM_NO_HIP_OK=1
cd "$(dirname "$0")/../.."
exec > "$log" 2>&1
set -x
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
make -j8 CUDA_HOME="$CUDA_HOME" WERROR= all || exit 1
nm -D build/lib/libgpumem.so | grep -q gpumem_connect || exit 1
mkdir -p build/tests
cc -std=c11 -D_GNU_SOURCE -O2 -pthread -Iinclude -I"$CUDA_HOME/include" tests/gpu/gpu_check.c \
  -o build/tests/gpu_check -Lbuild/lib -lgpumem -Wl,-rpath,"$PWD/build/lib" \
  -L"$CUDA_HOME/lib64/stubs" -lcuda || exit 1
# The fault checks start, kill and restart their own daemon.
cc -std=c11 -D_GNU_SOURCE -O2 -Wall -Wextra -pthread -Iinclude -I"$CUDA_HOME/include" \
  tests/gpu/gpu_faults.c -o build/tests/gpu_faults -Lbuild/lib -lgpumem \
  -Wl,-rpath,"$PWD/build/lib" -L"$CUDA_HOME/lib64/stubs" -lcuda || exit 1
status=0
# The backend's driver-facing calls, from the gpu/ sources alone.
cc -std=c11 -D_GNU_SOURCE -DHAVE_CUDA -O2 -Wall -Wextra -Werror -I. -I"$CUDA_HOME/include" \
  tests/gpu/backend_probe.c $(ls gpu/*.c | grep -v '^gpu/hip') common/idmap.c common/procstat.c \
  -ldl -lpthread -o build/tests/backend_probe || exit 1
build/tests/backend_probe || status=1
# Sockets and logs in a private directory: gpumemd refuses a socket
# directory that another user could change (/tmp itself).
run=$(mktemp -d "${TMPDIR:-/tmp}/gpumemd-gpu.XXXXXX") || exit 1
sock=$run/gpumemd.sock
build/bin/gpumemd --backend cuda --socket "$sock" --log-level info --verify-backups \
  2>"$run/gpumemd.log" &
daemon=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
nvidia-smi --query-compute-apps=pid,used_memory --format=csv
build/bin/gpumemctl --socket "$sock" status
GPU_CHECK_DAEMON_LOG="$run/gpumemd.log" build/tests/gpu_check build/bin "$sock" || status=1
build/bin/gpumemctl --socket "$sock" status
# What gpu_check's pauses and resumes left in the daemon's counters.
build/bin/gpumemctl --socket "$sock" metrics |
  grep -E '^gpumem_(operations_total|released_bytes_total|restored_bytes_total|operation_duration_seconds_(count|sum)|errors_total)'
# gpumemctl talks to the daemon without loading the GPU driver.
loads=$(LD_DEBUG=libs build/bin/gpumemctl --socket "$sock" status 2>&1 >/dev/null | grep -c 'libcuda\.so')
if [ "$loads" = 0 ]; then echo "PASS gpumemctl loads no GPU driver: libcuda.so opened 0 times"
else echo "FAIL gpumemctl loads no GPU driver: libcuda.so in $loads loader lines"; status=1; fi
kill "$daemon"; wait "$daemon" || status=1
cat "$run/gpumemd.log"
# A stopped worker, workers killed during a pause and a resume, memory held
# outside the daemon by pid, and the daemon killed and restarted under two
# workers: gpu_faults runs its own daemon (the one above is gone), on
# another socket.
build/tests/gpu_faults build/bin "$run/faults.sock" "$run/faults.log" || status=1
cat "$run/faults.log"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv
# The Python package over the CUDA backend.
python3 tests/gpu/python_check.py build/bin/gpumemd || status=1
# Persistent weights: kept after their engine exits, attached by a standby
# (timed against reloading from host memory and from a file), paused and
# resumed with no holder, dropped.
python3 tests/gpu/persistent_check.py build/bin/gpumemd || status=1
# Two uids' workers and a root controller: tag ownership, quotas, what a
# tenant sees, shared tags.
python3 tests/gpu/tenants_check.py build/bin/gpumemd build/lib || status=1
# The preload library under the real CUDA runtime (libcudart from
# CUDA_HOME, else PyTorch's nvidia-cuda-runtime wheel): a C program and
# PyTorch's caching allocator, each with a daemon of its own.
cudart=$(ls "$CUDA_HOME"/lib64/libcudart.so.[0-9]* 2>/dev/null | head -n1)
[ -n "$cudart" ] || cudart=$(python3 -c 'import glob, os, nvidia.cuda_runtime as m
print(sorted(glob.glob(os.path.join(list(m.__path__)[0], "lib", "libcudart.so.*")))[0])' 2>/dev/null)
if [ -n "$cudart" ]; then
  cc -std=c11 -D_GNU_SOURCE -O2 -Wall -Wextra tests/gpu/preload_check.c \
    -o build/tests/preload_check "$cudart" -Wl,-rpath,"$(dirname "$cudart")" || exit 1
  LD_PRELOAD=$PWD/build/lib/libgpumem_preload.so build/tests/preload_check build/bin || status=1
else
  echo "FAIL preload check: no libcudart.so.* in $CUDA_HOME/lib64 or PyTorch's wheel"; status=1
fi
LD_PRELOAD=$PWD/build/lib/libgpumem_preload.so python3 tests/gpu/preload_torch.py build/bin ||
  status=1
# PyTorch on gpumemd: regions, CUDA graphs, preload mode and the
# torch_memory_saver drop-in (needs torch with CUDA; none is installed
# by this script).
if python3 -c 'import torch' 2>/dev/null; then
  python3 tests/gpu/torch_check.py build/bin/gpumemd || status=1
  # A trainer that starts inside a region (TMS_INIT_ENABLE=1), offloaded.
  python3 tests/gpu/tms_trainer.py build/bin || status=1
  # 16 GiB of backups under an 8 GiB budget: refused, or pageable past it.
  python3 tests/gpu/backup_budget.py build/bin || status=1
  # Context release through the driver's checkpoint calls, judged by NVML.
  python3 tests/gpu/release_check.py build/bin/gpumemd || status=1
  # NCCL ranks, one GPU each (two where there are two GPUs, else one
  # rank alone), released.
  python3 tests/gpu/nccl_release.py build/bin/gpumemd || status=1
else
  echo "torch_check: SKIPPED: python3 cannot import torch"
fi
# GPU_BENCH=0 skips the benchmarks (the checks and suites still run).
if [ "${GPU_BENCH:-1}" != 0 ]; then
make CUDA_HOME="$CUDA_HOME" WERROR= build/bench/bench_pause build/bench/bench_rtt \
  build/bench/bench_backup build/bench/bench_scale build/bench/bench_trace \
  build/bench/bench_ctl build/bench/bench_status build/bench/bench_failover >/dev/null
mkdir -p build/bench
: > build/bench/results-gpu.jsonl
bench() { "$@" 3>>build/bench/results-gpu.jsonl 2>/dev/null || status=1; }
bench build/bench/bench_pause --backend cuda --total 64G --chunk 1G --workers 4 --rounds 9 build/bin
bench build/bench/bench_pause --backend cuda --total 16G --chunk 1G --workers 4 --backup build/bin
bench build/bench/bench_pause --backend cuda --total 8G --chunk 2M --workers 4 --rounds 1 build/bin
bench build/bench/bench_backup --backend cuda --size 8G build/bin
bench build/bench/bench_rtt build/bin
bench build/bench/bench_failover --backend cuda --size 16G build/bin
bench build/bench/bench_ctl --backend cuda build/bin
bench build/bench/bench_rtt --backend cuda build/bin
bench build/bench/bench_scale build/bin
bench build/bench/bench_trace --backend cuda build/bin
bench build/bench/bench_scale --backend cuda --sessions 1000 --buffers 20000 build/bin
bench build/bench/bench_status --backend cuda build/bin
CHUNK=1G bench/plot.sh build cuda 4G 8G 16G 32G > /dev/null 2>&1 || status=1
# The RL step against torch_memory_saver, built from its source where
# TMS_SRC names a checkout of it (nothing is fetched here).
if [ -n "${TMS_SRC:-}" ] && bench/tms_build.sh "$TMS_SRC" build/tms >/dev/null; then
  python3 bench/rl_step.py --tms-path build/tms --json build/bench/rl_step.json || status=1
else
  echo "rl_step: SKIPPED: set TMS_SRC to a torch_memory_saver source tree"
fi
cat build/bench/results-gpu.jsonl
fi
# GPU_SUITES=0 skips the test suites (CI runs them on every commit).
if [ "${GPU_SUITES:-1}" != 0 ]; then
  GPUMEM_BUILD=$PWD/build make CUDA_HOME="$CUDA_HOME" WERROR= test || status=1
fi
echo "gpu run status $status"
exit $status
