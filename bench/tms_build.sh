#!/bin/sh
# Build upstream torch_memory_saver for bench/rl_step.py with g++ alone (no
# pip, no setuptools, no network): its two shared objects, one per hook
# mode, from the CUDA sources its setup.py lists, named as its wheels name
# them, next to a copy of its Python package.
#   bench/tms_build.sh SRC OUTDIR
# SRC: a torch_memory_saver source tree (a git archive of it). OUTDIR then
# holds torch_memory_saver_hook_mode_{preload,torch}_cuMAJOR.abi3.so and
# torch_memory_saver/, so that PYTHONPATH=OUTDIR imports it (the package
# looks for its .so in its own directory, then in the one above).
# CUDA_HOME (else CUDA_PATH, else nvcc's, else /usr/local/cuda) gives the
# headers and libraries; TMS_CUDA_MAJOR overrides the major in the names;
# CXX overrides g++.
set -eu
if [ $# -ne 2 ]; then
  echo "usage: $0 SRC OUTDIR" >&2
  exit 2
fi
src=$1
out=$2
cxx=${CXX:-g++}

fail() {
  echo "tms_build: $*" >&2
  exit 1
}

for p in setup.py csrc torch_memory_saver/__init__.py; do
  [ -e "$src/$p" ] || fail "$src is not a torch_memory_saver source tree (no $p)"
done

# Where CUDA is, as setup.py finds it.
cuda=${CUDA_HOME:-${CUDA_PATH:-}}
if [ -z "$cuda" ]; then
  if nvcc=$(command -v nvcc 2>/dev/null); then
    cuda=$(dirname "$(dirname "$nvcc")")
  else
    cuda=/usr/local/cuda
  fi
fi
if [ ! -f "$cuda/include/cuda.h" ] || [ ! -f "$cuda/include/cuda_runtime_api.h" ]; then
  fail "no cuda.h and cuda_runtime_api.h in $cuda/include (set CUDA_HOME)"
fi

# The CUDA major in the names: what the package's loader looks for
# (<stem>_cu<major>.*.so, major from torch.version.cuda).
major=${TMS_CUDA_MAJOR:-}
if [ -z "$major" ] && [ -f "$cuda/version.json" ] && command -v python3 >/dev/null 2>&1; then
  major=$(python3 -c 'import json, sys
print(json.load(open(sys.argv[1]))["cuda"]["version"].split(".")[0])' "$cuda/version.json" \
    2>/dev/null) || major=
fi
if [ -z "$major" ] && [ -x "$cuda/bin/nvcc" ]; then
  major=$("$cuda/bin/nvcc" --version | sed -n 's/.*release \([0-9][0-9]*\)\..*/\1/p' | head -n1)
fi
if [ -z "$major" ]; then
  v=$(sed -n 's/^#define CUDA_VERSION \([0-9][0-9]*\).*/\1/p' "$cuda/include/cuda.h" | head -n1)
  [ -n "$v" ] && major=$((v / 1000))
fi
major=${major:-13}
case $major in
  *[!0-9]*|'') fail "CUDA major '$major' is not a number (set TMS_CUDA_MAJOR)" ;;
esac

# The CUDA sources setup.py lists (its common list; the HIP and XPU ones
# are appended to it elsewhere).
srcs=$(sed -n '/sources = \[/,/\]/p' "$src/setup.py" | grep -o "csrc/[A-Za-z0-9_]*\.cpp" |
  tr '\n' ' ' || true)
[ -n "$srcs" ] ||
  srcs="csrc/api_forwarder.cpp csrc/core.cpp csrc/disk_backend.cpp csrc/entrypoint.cpp"
files=
for f in $srcs; do
  [ -f "$src/$f" ] || fail "setup.py lists $f, and $src/$f is missing"
  files="$files $src/$f"
done

# libcudart: CUDA_HOME's, else PyTorch's nvidia wheel. Without the
# unversioned link name, link the versioned file itself.
cudart=
cudart_dir=
for d in "$cuda/lib64" "$cuda/lib" "$cuda/targets/$(uname -m)-linux/lib"; do
  if [ -e "$d/libcudart.so" ]; then
    cudart="-L$d -lcudart"
    cudart_dir=$d
    break
  fi
  # shellcheck disable=SC2012 # the names are the toolkit's
  f=$(ls "$d"/libcudart.so.[0-9]* 2>/dev/null | head -n1 || true)
  if [ -n "$f" ]; then
    cudart=$f
    cudart_dir=$d
    break
  fi
done
if [ -z "$cudart" ] && command -v python3 >/dev/null 2>&1; then
  f=$(python3 -c 'import glob, os, sys, nvidia
found = []
for p in nvidia.__path__:
    found += glob.glob(os.path.join(p, "**", "libcudart.so." + sys.argv[1] + "*"), recursive=True)
print(sorted(found)[0] if found else "")' "$major" 2>/dev/null || true)
  if [ -n "$f" ]; then
    cudart=$f
    cudart_dir=$(dirname "$f")
  fi
fi
[ -n "$cudart" ] || fail "no libcudart.so in $cuda/lib64, $cuda/lib or PyTorch's nvidia wheel"

# libcuda: the stub in CUDA_HOME, else the driver's library.
if [ -e "$cuda/lib64/stubs/libcuda.so" ]; then
  cudadrv="-L$cuda/lib64/stubs -lcuda"
elif [ -e "$cuda/targets/$(uname -m)-linux/lib/stubs/libcuda.so" ]; then
  cudadrv="-L$cuda/targets/$(uname -m)-linux/lib/stubs -lcuda"
else
  f=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
  [ -n "$f" ] || fail "no libcuda.so in $cuda/lib64/stubs and no libcuda.so.1 known to ldconfig"
  cudadrv=$f
fi

command -v "$cxx" >/dev/null 2>&1 || fail "no $cxx here (set CXX)"
mkdir -p "$out"
for mode in preload torch; do
  macro=TMS_HOOK_MODE_$(echo "$mode" | tr '[:lower:]' '[:upper:]')
  name=torch_memory_saver_hook_mode_${mode}_cu${major}.abi3.so
  echo "tms_build: $name (-D$macro=1)"
  # shellcheck disable=SC2086 # word lists on purpose
  "$cxx" -std=c++17 -O3 -fPIC -shared -DUSE_CUDA=1 -D"$macro"=1 -DPy_LIMITED_API=0x03090000 \
    -I"$cuda/include" -I"$src/csrc" $files -o "$out/$name.tmp" \
    -L"$cuda/lib64" $cudart $cudadrv -ldl -Wl,-rpath,"$cudart_dir" ||
    fail "g++ failed for $name"
  mv "$out/$name.tmp" "$out/$name"
done

# What each hook mode must export.
if command -v nm >/dev/null 2>&1; then
  nm -D --defined-only "$out/torch_memory_saver_hook_mode_torch_cu$major.abi3.so" |
    grep -q ' tms_torch_malloc$' || fail "the torch mode object does not export tms_torch_malloc"
  nm -D --defined-only "$out/torch_memory_saver_hook_mode_preload_cu$major.abi3.so" |
    grep -q ' cudaMalloc$' || fail "the preload mode object does not export cudaMalloc"
fi

rm -rf "$out/torch_memory_saver"
cp -R "$src/torch_memory_saver" "$out/torch_memory_saver"
find "$out/torch_memory_saver" -name __pycache__ -type d -prune -exec rm -rf {} +

echo "tms_build: CUDA $cuda (major $major), libcudart $cudart, libcuda $cudadrv"
echo "tms_build: sources: $srcs"
ls -l "$out"/torch_memory_saver_hook_mode_*_cu"$major".abi3.so
echo "tms_build: package $out/torch_memory_saver"

# The import, where PyTorch is there to do it (the package imports torch).
if command -v python3 >/dev/null 2>&1 && python3 -c 'import torch' 2>/dev/null; then
  tv=$(python3 -c 'import torch; print((torch.version.cuda or "").split(".")[0])')
  [ "$tv" = "$major" ] ||
    echo "tms_build: WARNING: PyTorch is built for CUDA '$tv', these objects are cu$major" >&2
  PYTHONPATH=$out${PYTHONPATH:+:$PYTHONPATH} python3 -c 'import torch_memory_saver
from torch_memory_saver.utils import get_binary_path_from_package as p
print("tms_build: import OK:", torch_memory_saver.__file__)
print("tms_build: torch mode object:", p("torch_memory_saver_hook_mode_torch"))' ||
    fail "PYTHONPATH=$out python3 -c 'import torch_memory_saver' failed"
else
  echo "tms_build: python3 cannot import torch here: import not checked"
fi
