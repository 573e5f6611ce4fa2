"""PyTorch under libgpumem_preload.so: the caching allocator's own
cudaMalloc calls are served by gpumemd, so pausing the default tag frees
the memory of an unmodified program; judged by torch.cuda.mem_get_info.
Skips (exit 0) where torch has no CUDA.

    LD_PRELOAD=$PWD/build/lib/libgpumem_preload.so \
        python3 tests/gpu/preload_torch.py build/bin
"""
import json
import os
import subprocess
import sys
import tempfile
import time

from gpucheck import start_gpumemd

GiB = 1 << 30
failures = 0


def check(ok: bool, name: str, detail: str) -> None:
    """Print one PASS or FAIL line."""
    global failures
    failures += not ok
    print("%s preload torch %s: %s" % ("PASS" if ok else "FAIL", name, detail), flush=True)


def main() -> int:
    bindir = sys.argv[1] if len(sys.argv) > 1 else "build/bin"
    try:
        import torch
    except ImportError:
        print("preload torch: skipped, no torch")
        return 0
    if not torch.cuda.is_available():
        print("preload torch: skipped, torch has no CUDA")
        return 0
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments:True" in conf:
        print("preload torch: skipped, expandable segments use the driver API")
        return 0
    d = tempfile.mkdtemp()
    sock = os.path.join(d, "sock")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    daemon = start_gpumemd([os.path.join(bindir, "gpumemd"), "--backend", "cuda", "--socket", sock],
                           sock, os.path.join(d, "log"), env=env)
    # Read by the preload library on its first allocation.
    os.environ["GPUMEM_SOCKET"] = sock
    os.environ["GPUMEM_DEFAULT_FLAGS"] = "backup"

    def ctl(*args: str) -> str:
        return subprocess.run([os.path.join(bindir, "gpumemctl"), "--socket", sock, *args],
                              env=env, check=True, capture_output=True, text=True).stdout

    def default_bytes() -> int:
        tags = json.loads(ctl("status", "--json"))["tags"]
        return sum(t["bytes"] for t in tags if t["name"] == "default")

    def free() -> int:
        torch.cuda.synchronize()
        time.sleep(0.2)  # releases land asynchronously; the figure is what counts
        return torch.cuda.mem_get_info()[0]

    try:
        torch.zeros(1, device="cuda")
        f0 = free()
        x = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
        x.fill_(7)
        x[-4096:] = torch.arange(4096, device="cuda", dtype=torch.int64).to(torch.uint8)
        managed = default_bytes()
        f1 = free()
        check(managed >= 2 * GiB, "segments come from gpumemd",
              "tag default holds %.3f GiB; driver free -%.3f GiB" % (managed / GiB,
                                                                     (f0 - f1) / GiB))
        ctl("pause", "default")
        f2 = free()
        check(f2 - f1 >= managed - (64 << 20), "pause frees the tensor's memory",
              "driver free +%.3f GiB of %.3f" % ((f2 - f1) / GiB, managed / GiB))
        ctl("resume", "default")
        f3 = free()
        tail = x[-4096:].to(torch.int64).cpu()
        ok = bool((x[:-4096] == 7).all()) and bool((tail == torch.arange(4096) % 256).all())
        check(ok and f2 - f3 >= managed - (64 << 20), "resume restores it",
              "contents %s; driver free -%.3f GiB" % ("kept" if ok else "LOST", (f2 - f3) / GiB))
        del x, tail
        torch.cuda.empty_cache()
        f4 = free()
        check(f4 - f3 >= 2 * GiB - (64 << 20), "empty_cache gives it back",
              "driver free +%.3f GiB" % ((f4 - f3) / GiB))
    finally:
        daemon.terminate()
        daemon.wait()
        print(open(os.path.join(d, "log")).read())
    return failures


if __name__ == "__main__":
    sys.exit(main())
