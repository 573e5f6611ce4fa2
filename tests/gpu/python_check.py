"""The Python package on a GPU: a worker and a controller in one process,
judged by the driver's free memory (cuMemGetInfo through ctypes).

    python3 tests/gpu/python_check.py build/bin/gpumemd
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import gpumem  # noqa: E402
from gpucheck import cuda_context, driver_free, start_gpumemd  # noqa: E402

GiB = 1 << 30
failures = 0


def check(ok: bool, name: str, detail: str) -> None:
    """Print one PASS or FAIL line."""
    global failures
    failures += not ok
    print("%s python %s: %s" % ("PASS" if ok else "FAIL", name, detail))


def main() -> int:
    d = tempfile.mkdtemp()
    sock = os.path.join(d, "sock")
    daemon = start_gpumemd([sys.argv[1], "--backend", "cuda", "--socket", sock], sock,
                           os.path.join(d, "log"))
    cuda = cuda_context()

    def free() -> int:
        return driver_free(cuda)

    with gpumem.connect(socket=sock, name="py-check") as w, \
            gpumem.connect(socket=sock, role="controller") as c:
        weights = w.alloc("weights", 1 * GiB, backup=True)
        kv = w.alloc("kv_cache", 4 * GiB)
        weights.write(0, b"kept across pause")
        f0 = free()
        r = c.pause("weights", "kv_cache")
        f1 = free()
        check(r.bytes == 5 * GiB and f1 - f0 >= 5 * GiB - (64 << 20) and not kv.mapped,
              "pause", "%d buffers, %.3f GiB; driver free +%.3f GiB; kv mapped %s"
              % (r.buffers, r.bytes / GiB, (f1 - f0) / GiB, kv.mapped))
        r = c.resume("weights", "kv_cache")
        f2 = free()
        back = weights.read(0, 17)
        check(f1 - f2 >= 5 * GiB - (64 << 20) and back == b"kept across pause" and kv.mapped,
              "resume", "driver free -%.3f GiB; backup read back %r; kv mapped %s"
              % ((f1 - f2) / GiB, back, kv.mapped))
        try:
            c.pause("nope")
            check(False, "unknown tag", "pause succeeded")
        except gpumem.Error as e:
            check(e.code_name == "NOT_FOUND", "unknown tag", "%s: %s" % (e.code_name, e.message))
        dv = c.status()["devices"][0]
        check(dv["reserved"] > 0, "status", "reserved %d MiB, unmanaged %d MiB (contexts)"
              % (dv["reserved"] >> 20, dv["unmanaged"] >> 20))
    daemon.terminate()
    check(daemon.wait() == 0, "daemon exit", "status 0 on SIGTERM")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
