"""Persistent buffers on a GPU, judged by the driver's free memory
(cuMemGetInfo) and by the contents: an engine process fills 16 GiB of
persistent weights and exits; the daemon keeps them; a standby process
attaches them (timed: the failover), against reloading the same bytes from
pinned host memory and from a file in the same run; a pause and a resume
with no holder release and make them again with their contents; a drop
frees them.

    python3 tests/gpu/persistent_check.py build/bin/gpumemd [GIB]
"""
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import gpumem  # noqa: E402
from gpucheck import cuda_context, driver_free, start_gpumemd  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
failures = 0

ENGINE = r"""
import sys
sys.path.insert(0, sys.argv[3])
import gpumem
with gpumem.connect(socket=sys.argv[1], name="engine-1") as w:
    b = w.alloc_persistent("weights-0", "weights", int(sys.argv[2]), backup=True)
    b.fill32(0x5eed0001)
    b.write(0, b"layer 0 of the weights")
print("filled", b.size)
"""


def check(ok: bool, name: str, detail: str) -> None:
    """Print one PASS or FAIL line."""
    global failures
    failures += not ok
    print("%s persistent %s: %s" % ("PASS" if ok else "FAIL", name, detail), flush=True)


def same(b: "gpumem.Buffer") -> bool:
    """Whether the buffer holds what the engine wrote: its first bytes, and
    the fill at eight places through it."""
    if b.read(0, 22) != b"layer 0 of the weights":
        return False
    word = (0x5eed0001).to_bytes(4, "little") * (1 << 18)
    return all(b.read(off, len(word)) == word
               for off in (b.size // 8 * k + MiB for k in range(8)))


def reloads(size: int, d: str):
    """Seconds to bring size bytes to the device from pinned host memory and
    from a file (written here, its pages dropped from the cache first), with
    PyTorch; None where PyTorch is missing."""
    try:
        import torch
    except ImportError:
        return None, None
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    host.fill_(7)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    dev.copy_(host)  # the first copy maps the pinned memory for the device: not timed
    torch.cuda.synchronize()
    t = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    from_host = time.perf_counter() - t
    path = os.path.join(d, "weights.bin")
    host.numpy().tofile(path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    t = time.perf_counter()
    view = memoryview(host.numpy())
    got = 0
    while got < size:
        n = os.readv(fd, [view[got:got + 256 * MiB]])
        if n <= 0:
            break
        got += n
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    from_disk = time.perf_counter() - t
    os.close(fd)
    os.unlink(path)
    del dev, host
    torch.cuda.empty_cache()
    return from_host, from_disk


def main() -> int:
    size = int(float(sys.argv[2]) * GiB) if len(sys.argv) > 2 else 16 * GiB
    d = tempfile.mkdtemp()
    sock = os.path.join(d, "sock")
    daemon = start_gpumemd([sys.argv[1], "--backend", "cuda", "--socket", sock], sock,
                           os.path.join(d, "log"))
    cuda = cuda_context()
    pkg = os.path.join(os.path.dirname(__file__), "..", "..", "python")
    f0 = driver_free(cuda)
    out = subprocess.run([sys.executable, "-c", ENGINE, sock, str(size), pkg],
                         capture_output=True, text=True, timeout=300)
    f1 = driver_free(cuda)
    check(out.returncode == 0 and f0 - f1 >= size - 64 * MiB, "outlives its engine",
          "engine exited %d; driver free -%.3f GiB after it ended (%s)"
          % (out.returncode, (f0 - f1) / GiB, (out.stdout + out.stderr).strip()[-200:]))
    with gpumem.connect(socket=sock, name="standby") as w, \
            gpumem.connect(socket=sock, role="controller") as c:
        t = time.perf_counter()
        b = w.attach("weights-0")
        attach_s = time.perf_counter() - t
        ok = same(b)
        check(ok and b.size == size, "failover attach",
              "%.3f GiB attached in %.1f ms, contents %s" % (b.size / GiB, attach_s * 1e3,
                                                              "equal" if ok else "DIFFER"))
        from_host, from_disk = reloads(size, d)
        if from_host is not None:
            print("bench persistent attach %.3f GiB: %.1f ms; reload from pinned host memory "
                  "%.1f ms (ratio %.3f); from a file %.1f ms (ratio %.3f)"
                  % (size / GiB, attach_s * 1e3, from_host * 1e3, attach_s / from_host,
                     from_disk * 1e3, attach_s / from_disk), flush=True)
        b.free()  # lets go of it; the daemon keeps it
        f2 = driver_free(cuda)
        r = c.pause("weights")
        f3 = driver_free(cuda)
        check(r.bytes == size and f3 - f2 >= size - 64 * MiB, "pause with no holder",
              "%.3f GiB released, driver free +%.3f GiB" % (r.bytes / GiB, (f3 - f2) / GiB))
        r = c.resume("weights")
        f4 = driver_free(cuda)
        b = w.attach("weights-0")
        ok = same(b)
        check(f3 - f4 >= size - 64 * MiB and ok, "resume with no holder",
              "driver free -%.3f GiB, contents after attach %s"
              % ((f3 - f4) / GiB, "equal" if ok else "DIFFER"))
        b.free()
        f5 = driver_free(cuda)
        freed = c.drop("weights-0")
        f6 = driver_free(cuda)
        check(freed == size and f6 - f5 >= size - 64 * MiB, "drop",
              "%.3f GiB freed, driver free +%.3f GiB" % (freed / GiB, (f6 - f5) / GiB))
    daemon.terminate()
    check(daemon.wait() == 0, "daemon exit", "status 0 on SIGTERM")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
