"""A host-memory budget for backups on a GPU: gpumemd --backup-limit 8G
with 16 GiB of backed-up weights (16 buffers of 1 GiB). Without
--backup-overflow the ninth buffer is refused, naming the limit; with
--backup-overflow pageable the first 8 GiB are pinned at allocation and
the rest pageable, made at the pause; the pause and the resume keep every
buffer's contents, and the status figures agree with the kernel's: the
daemon's RssAnon grows by the pageable bytes, and MemAvailable falls by
at least as much. Skips (exit 0) without a CUDA device.

    python3 tests/gpu/backup_budget.py build/bin
"""
import os
import sys
import tempfile
import time

from gpucheck import start_gpumemd

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "python"))
GiB = 1 << 30
failures = 0


def check(ok: bool, name: str, detail: str) -> None:
    """Print one PASS or FAIL line."""
    global failures
    failures += not ok
    print("%s backup budget %s: %s" % ("PASS" if ok else "FAIL", name, detail), flush=True)


def kb(path: str, key: str) -> int:
    """A "Key: N kB" figure of a /proc file, in bytes."""
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return -1


def run(bindir: str, overflow: bool) -> None:
    import gpumem
    d = tempfile.mkdtemp()
    sock = os.path.join(d, "sock")
    argv = [os.path.join(bindir, "gpumemd"), "--backend", "cuda", "--socket", sock,
            "--backup-limit", "8G"] + (["--backup-overflow", "pageable"] if overflow else [])
    daemon = start_gpumemd(argv, sock, os.path.join(d, "log"))
    try:
        w = gpumem.connect(sock, name="weights")
        ctl = gpumem.connect(sock, name="ctl", role="controller")
        bufs = []
        refused = None
        for i in range(16):
            try:
                b = w.alloc("weights", GiB, backup=True)
            except gpumem.Error as e:
                refused = (i, e)
                break
            b.fill32(0x1000 + i, GiB - 8, 8)
            bufs.append(b)
        if not overflow:
            check(refused is not None and refused[0] == 8 and
                  refused[1].code == gpumem.ErrorCode.LIMIT_EXCEEDED and
                  "--backup-limit" in str(refused[1]),
                  "past the limit without --backup-overflow: refused",
                  "buffer %s: %s" % (refused[0] if refused else None, refused[1] if refused else
                                     "none refused"))
            return
        # The pinned backups are made in the background: wait for them.
        end = time.monotonic() + 60
        while time.monotonic() < end:
            s = ctl.status()["backups"]
            if s["ready"] >= s["reserved"]:
                break
            time.sleep(0.1)
        avail0, anon0 = kb("/proc/meminfo", "MemAvailable"), kb("/proc/%d/status" % daemon.pid,
                                                                  "RssAnon")
        t0 = time.monotonic()
        r = ctl.pause("weights")
        pause_ms = (time.monotonic() - t0) * 1000
        t = next(t for t in ctl.status()["tags"] if t["name"] == "weights")
        avail1, anon1 = kb("/proc/meminfo", "MemAvailable"), kb("/proc/%d/status" % daemon.pid,
                                                                  "RssAnon")
        check(len(bufs) == 16 and t["backup_pinned_bytes"] == 8 * GiB and
              t["backup_pageable_bytes"] == 8 * GiB and t["backup_reserved_bytes"] == 8 * GiB,
              "16 GiB of backups: 8 pinned, 8 pageable",
              "pinned %.2f GiB, pageable %.2f GiB, reserved %.2f GiB; pause %.0f ms"
              % (t["backup_pinned_bytes"] / GiB, t["backup_pageable_bytes"] / GiB,
                 t["backup_reserved_bytes"] / GiB, pause_ms))
        grew = anon1 - anon0
        check(abs(grew - t["backup_pageable_bytes"]) <= 256 << 20 and
              avail0 - avail1 >= t["backup_pageable_bytes"] - (256 << 20),
              "the kernel's figures agree",
              "gpumemd RssAnon +%.2f GiB, MemAvailable -%.2f GiB, backed up %.2f GiB"
              % (grew / GiB, (avail0 - avail1) / GiB, r.backup_bytes / GiB))
        t0 = time.monotonic()
        ctl.resume("weights")
        resume_ms = (time.monotonic() - t0) * 1000
        same = all(b.read(GiB - 8, 8) == (0x1000 + i).to_bytes(4, "little") * 2
                   for i, b in enumerate(bufs))
        check(same, "every buffer's contents after the resume", "resume %.0f ms" % resume_ms)
        for b in bufs:
            b.free()
        w.close()
        ctl.close()
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)


def main() -> int:
    bindir = sys.argv[1] if len(sys.argv) > 1 else "build/bin"
    if not os.path.exists("/dev/nvidiactl"):
        print("backup budget: skipped, no NVIDIA device")
        return 0
    os.environ.setdefault("GPUMEM_LIB", os.path.join(os.path.dirname(bindir), "lib",
                                                     "libgpumem.so.1"))
    run(bindir, overflow=False)
    run(bindir, overflow=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
