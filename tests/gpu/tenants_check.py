"""Tenants on a GPU: two uids' workers (processes of their own, real CUDA
memory), a root controller, judged by the driver's free memory.

    python3 tests/gpu/tenants_check.py build/bin/gpumemd build/lib [host]

Alice (uid 1000) owns tag kv; Bob (uid 1001) may not join it, does not see
it, and cannot fail its pause; a device quota per uid holds; a shared tag
takes both. Needs root (to run the workers as other uids). With "host"
it runs on the host backend, without the driver's figures (to try it
where there is no GPU).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
import gpumem  # noqa: E402
from gpucheck import cuda_context, driver_free, start_gpumemd  # noqa: E402

MiB = 1 << 20
failures = 0

# A worker: allocates what its argument says, prints one JSON line of
# results, then keeps its buffers (its library answers pauses) until stdin
# closes.
WORKER = r"""
import json, sys, gpumem
sock, plan = sys.argv[1], json.loads(sys.argv[2])
out, keep = {}, []
with gpumem.connect(socket=sock, name="tenant") as w:
    for name, tag, size in plan:
        try:
            keep.append(w.alloc(tag, size))
            out[name] = "OK"
        except gpumem.Error as e:
            out[name] = e.code_name + ": " + e.message
    s = w.status()
    out["tags"] = sorted(t["name"] for t in s["tags"])
    out["uids"] = sorted({x["uid"] for x in s["sessions"]})
    out["tenants"] = [(t["uid"], t["bytes"]) for t in s["tenants"]]
    print(json.dumps(out), flush=True)
    sys.stdin.read()
"""


def check(ok: bool, name: str, detail: str) -> None:
    """Print one PASS or FAIL line."""
    global failures
    failures += not ok
    print("%s tenants %s: %s" % ("PASS" if ok else "FAIL", name, detail))


def worker(root: str, sock: str, uid: int, plan: list) -> tuple:
    """Start a worker as uid; returns the process and its JSON line."""
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "python"),
               GPUMEM_LIB=os.path.join(root, "lib", "libgpumem.so"))
    # Another uid may not reach this interpreter (a pyenv under /root).
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    p = subprocess.Popen([python, "-c", WORKER, sock, json.dumps(plan)], user=uid,
                         group=uid, extra_groups=[], env=env, cwd=root, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    return p, json.loads(line) if line else {}


def main() -> int:
    if os.geteuid() != 0:
        print("tenants_check: SKIPPED: needs root to run workers as other uids")
        return 0
    root = tempfile.mkdtemp(prefix="gpumemd-tenants.")
    os.chmod(root, 0o755)
    shutil.copytree(os.path.join(HERE, "..", "..", "python"), os.path.join(root, "python"))
    shutil.copytree(sys.argv[2], os.path.join(root, "lib"), symlinks=True)
    os.environ["GPUMEM_LIB"] = os.path.join(root, "lib", "libgpumem.so")
    sock = os.path.join(root, "sock")
    host = sys.argv[3:] == ["host"]
    daemon = start_gpumemd([sys.argv[1], "--backend", "host" if host else "cuda", "--socket", sock,
                            "--socket-mode", "0666", "--max-device-bytes-per-uid", "1G"], sock,
                           os.path.join(root, "log"))
    if not host:
        cuda = cuda_context()

    def free() -> int:
        """The driver's free memory on device 0 (the host run: the daemon's)."""
        if host:
            return c.status()["devices"][0]["free"]
        return driver_free(cuda)

    alice, a = worker(root, sock, 1000, [["kv", "kv", 512 * MiB], ["over", "kv2", 1024 * MiB]])
    check(a.get("kv") == "OK" and a.get("over", "").startswith("LIMIT_EXCEEDED"),
          "device quota", "alice: kv %s; 1 GiB more: %s" % (a.get("kv"), a.get("over")))
    bob, b = worker(root, sock, 1001, [["join", "kv", 64 * MiB], ["own", "bobs", 64 * MiB]])
    check(b.get("join", "").startswith("PERMISSION_DENIED") and b.get("own") == "OK",
          "tag ownership", "bob into alice's kv: %s" % b.get("join"))
    check(b.get("tags") == ["bobs"] and b.get("uids") == [1001]
          and b.get("tenants") == [[1001, 64 * MiB]],
          "isolation", "bob sees tags %s, uids %s, tenants %s"
          % (b.get("tags"), b.get("uids"), b.get("tenants")))
    with gpumem.connect(socket=sock, role="controller") as c:
        f0 = free()
        r = c.pause("kv")
        f1 = free()
        tenants = {t["uid"]: t["bytes"] for t in c.status()["tenants"]}
        check(r.buffers == 1 and r.bytes == 512 * MiB and f1 - f0 >= 512 * MiB - 64 * MiB
              and tenants.get(1000) == 512 * MiB,
              "pause of alice's tag", "%d buffer, %d MiB; driver free +%d MiB; alice still "
              "counted %d MiB while paused" % (r.buffers, r.bytes >> 20, (f1 - f0) >> 20,
                                                tenants.get(1000, 0) >> 20))
        r = c.resume("kv")
        f2 = free()
        check(r.buffers == 1 and f1 - f2 >= 512 * MiB - 64 * MiB, "resume",
              "driver free -%d MiB" % ((f1 - f2) >> 20))
        c.share("kv")
        bob2, b2 = worker(root, sock, 1001, [["join", "kv", 64 * MiB]])
        check(b2.get("join") == "OK", "shared tag", "bob into shared kv: %s" % b2.get("join"))
        r = c.pause("kv")
        check(r.buffers == 2 and r.bytes == 576 * MiB, "pause of a shared tag",
              "%d buffers, %d MiB" % (r.buffers, r.bytes >> 20))
        c.resume("kv")
    for p in (alice, bob, bob2):
        p.stdin.close()
        p.wait()
    daemon.terminate()
    check(daemon.wait() == 0, "daemon exit", "status 0 on SIGTERM")
    shutil.rmtree(root, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
