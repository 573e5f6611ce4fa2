"""PyTorch processes with an NCCL communicator between them, one GPU each
(two ranks on the two-H200 machine; one rank alone where there is one
GPU, a communicator of one), and what context release does to them:

- facts: the NCCL version, whether it has ncclCommSuspend, what NVML and
  /proc show of each rank (its device files, the devices it is listed on);
- driver: the checkpoint calls made directly on rank 0 (lock with a time
  limit, checkpoint, restore, unlock), each in a child with a watchdog,
  and whether rank 1's state can be read meanwhile; then an all-reduce;
- daemon: gpumemd's pause with release_context over every rank (each a
  gpumem worker that opted in): the answer must come, say why where it
  refuses, and leave every rank able to all-reduce after the resume;
- suspend: the same after each rank suspended its communicator with NCCL's
  own ncclCommSuspend(NCCL_SUSPEND_MEM), resumed after.

    python3 tests/gpu/nccl_release.py build/bin/gpumemd

Every wait has a limit; a child that hangs is killed and reported. Prints
FACT, PASS and FAIL lines; exits non-zero on a failure.
"""
import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "python"))

import gpumem  # noqa: E402
from gpucheck import start_gpumemd  # noqa: E402

failures = 0
WORLD = 2  # ranks: one per GPU, at most two (main sets it)

# One rank: commands on stdin, one answer line each on stdout.
RANK = r'''
import ctypes, json, os, sys, time, torch
import torch.distributed as dist
sys.path.insert(0, os.path.join(sys.argv[1], "python"))
rank = int(sys.argv[2])
use_gpumem = sys.argv[3] == "gpumem"
world = int(sys.argv[4])
torch.cuda.set_device(rank)
dev = torch.device("cuda", rank)
dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
if use_gpumem:
    import gpumem.torch as gt
    with gt.region("kv_cache"):
        kv = torch.zeros(64 << 20, device=dev)
x = torch.ones(1 << 20, device=dev)
dist.all_reduce(x)
torch.cuda.synchronize()
pg = dist.distributed_c10d._get_default_group()
backend = pg._get_backend(dev)

def nccl_lib():
    for line in open("/proc/self/maps"):
        if "libnccl" in line:
            return ctypes.CDLL(line.split()[-1])
    return None

def suspend(on):
    if hasattr(backend, "suspend"):
        (backend.suspend if on else backend.resume)()
        return "ProcessGroupNCCL." + ("suspend" if on else "resume")
    lib = nccl_lib()
    comm = ctypes.c_void_p(backend._comm_ptr())
    if on:
        rc = lib.ncclCommSuspend(comm, 1)
    else:
        rc = lib.ncclCommResume(comm)
    if rc != 0:
        raise RuntimeError("nccl rc %d" % rc)
    return "ncclComm" + ("Suspend" if on else "Resume")

lib = nccl_lib()
facts = {"nccl": ".".join(map(str, torch.cuda.nccl.version())),
         "has_suspend": bool(lib is not None and hasattr(lib, "ncclCommSuspend")),
         "pg_suspend": hasattr(backend, "suspend"), "pid": os.getpid()}
print("ready " + json.dumps(facts), flush=True)
for line in sys.stdin:
    cmd = line.strip()
    try:
        if cmd == "allreduce":
            y = torch.full((1 << 20,), float(rank + 1), device=dev)
            dist.all_reduce(y)
            want = world * (world + 1) / 2.0
            ok = float(y[0].item()) == want and float(y[-1].item()) == want
            out = "ok" if ok else "WRONG %r" % float(y[0].item())
        elif cmd in ("suspend", "unsuspend"):
            torch.cuda.synchronize()
            free0 = torch.cuda.mem_get_info(dev)[0]
            how = suspend(cmd == "suspend")
            torch.cuda.synchronize()
            out = "ok %s free %+d MiB" % (how, (torch.cuda.mem_get_info(dev)[0] - free0) >> 20)
        else:
            out = "unknown " + cmd
    except Exception as e:  # reported, judged by the driver
        out = "ERROR %s: %s" % (type(e).__name__, e)
    print(out, flush=True)
'''

# The driver's checkpoint calls on one pid, run in a child with a watchdog.
CKPT = r'''
import ctypes, sys, time
cuda = ctypes.CDLL("libcuda.so.1")
cuda.cuInit(0)
op, pid = sys.argv[1], int(sys.argv[2])
class Lock(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("r0", ctypes.c_uint), ("r1", ctypes.c_uint64 * 7)]
args = (ctypes.c_uint64 * 16)()
t0 = time.monotonic()
if op == "state":
    s = ctypes.c_int(-1)
    rc = cuda.cuCheckpointProcessGetState(pid, ctypes.byref(s))
    print("rc=%d state=%d ms=%.1f" % (rc, s.value, (time.monotonic() - t0) * 1e3), flush=True)
    sys.exit(0)
if op == "lock":
    rc = cuda.cuCheckpointProcessLock(pid, ctypes.byref(Lock(5000)))
elif op == "checkpoint":
    rc = cuda.cuCheckpointProcessCheckpoint(pid, ctypes.byref(args))
elif op == "restore":
    rc = cuda.cuCheckpointProcessRestore(pid, ctypes.byref(args))
else:
    rc = cuda.cuCheckpointProcessUnlock(pid, ctypes.byref(args))
print("rc=%d ms=%.1f" % (rc, (time.monotonic() - t0) * 1e3), flush=True)
'''


def check(ok, name, detail):
    """Print one PASS or FAIL line."""
    global failures
    failures += not ok
    print("%s nccl %s: %s" % ("PASS" if ok else "FAIL", name, detail), flush=True)


def fact(name, detail):
    """Print one FACT line: what was seen, judged by nobody."""
    print("FACT nccl %s: %s" % (name, detail), flush=True)


def free_port():
    """A TCP port on the loopback that nobody listens on now."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Ranks:
    """One rank process per GPU (WORLD of them); use_gpumem: each a gpumem
    worker that opted in."""

    def __init__(self, sock, use_gpumem):
        port = free_port()
        self.ps = []
        for r in range(WORLD):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       GPUMEM_SOCKET=sock or "", GPUMEM_RELEASE_CONTEXT="1")
            self.ps.append(subprocess.Popen(
                [sys.executable, "-c", RANK, REPO, str(r), "gpumem" if use_gpumem else "-",
                 str(WORLD)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
        said = self.read_all(120)
        self.facts = [json.loads(s[len("ready "):]) if s.startswith("ready ") else None
                      for s in said]
        self.pids = [f["pid"] if f else None for f in self.facts]

    def read_all(self, timeout):
        """One line from each rank, or 'no answer' where none came in time."""
        end = time.monotonic() + timeout
        out = [None] * len(self.ps)
        while None in out and time.monotonic() < end:
            waiting = [p.stdout for i, p in enumerate(self.ps) if out[i] is None]
            r, _, _ = select.select(waiting, [], [], max(0, end - time.monotonic()))
            for f in r:
                i = [p.stdout for p in self.ps].index(f)
                out[i] = f.readline().strip() or "ended"
        return [o if o is not None else "no answer in %d s" % timeout for o in out]

    def both(self, cmd, timeout=30):
        """Send cmd to every rank (a collective needs them all); their answers."""
        for p in self.ps:
            if p.poll() is None:
                p.stdin.write(cmd + "\n")
                p.stdin.flush()
        return self.read_all(timeout)

    def stop(self):
        for p in self.ps:
            if p.poll() is None:
                p.kill()
            p.wait()


def ckpt(op, pid, timeout=30):
    """One checkpoint call on pid from a child: its output, or 'hung'."""
    p = subprocess.Popen([sys.executable, "-c", CKPT, op, str(pid)], stdout=subprocess.PIPE,
                         text=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        return out.strip() or "rc=? (exit %d)" % p.returncode
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return "hung (killed after %d s)" % timeout


def where_listed():
    """NVML's compute processes: pid -> [(gpu index, MiB)]."""
    q = lambda *a: subprocess.run(["nvidia-smi"] + list(a), capture_output=True,
                                  text=True).stdout.splitlines()
    bus = {}
    for line in q("--query-gpu=index,pci.bus_id", "--format=csv,noheader"):
        i, b = [x.strip() for x in line.split(",")]
        bus[b] = int(i)
    seen = {}
    for line in q("--query-compute-apps=pid,gpu_bus_id,used_memory",
                  "--format=csv,noheader,nounits"):
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit():
            seen.setdefault(int(parts[0]), []).append((bus.get(parts[1], parts[1]), parts[2]))
    return seen


def device_files(pid):
    """How many mappings of each /dev/nvidia* file pid has."""
    n = {}
    try:
        for line in open("/proc/%d/maps" % pid):
            f = line.split()[-1] if len(line.split()) >= 6 else ""
            if f.startswith("/dev/nvidia"):
                n[f] = n.get(f, 0) + 1
    except OSError as e:
        return str(e)
    return n


def timed_call(fn, timeout):
    """fn() in a thread: (result or exception, seconds), or ('hung', timeout)."""
    box = {}

    def run():
        t0 = time.monotonic()
        try:
            box["r"] = fn()
        except Exception as e:  # the caller reports it
            box["r"] = e
        box["s"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return (box["r"], box["s"]) if "r" in box else ("hung", timeout)


def describe(r):
    """A pause's or resume's outcome in one line."""
    if isinstance(r, gpumem.Error):
        return "%s: %s; releases %s" % (r.code_name, r.message,
                                        json.dumps(getattr(r.result, "releases", None)))
    if isinstance(r, gpumem.OpResult):
        return "ok; releases %s" % json.dumps(r.releases)
    return repr(r)


def driver_direct():
    """The checkpoint calls made directly on rank 0 of a plain NCCL pair."""
    ranks = Ranks(None, False)
    try:
        check(None not in ranks.pids, "plain ranks start", "%s" % ranks.facts)
        if None in ranks.pids:
            return
        fact("versions", json.dumps(ranks.facts[0]))
        seen = where_listed()
        for r, pid in enumerate(ranks.pids):
            fact("rank %d listed" % r, "NVML lists pid %d on %s; its device files %s"
                 % (pid, seen.get(pid), device_files(pid)))
        p0 = ranks.pids[0]
        fact("driver state rank 0", ckpt("state", p0))
        lock = ckpt("lock", p0)
        fact("driver lock rank 0 (5 s limit)", lock)
        if WORLD > 1:
            fact("driver state rank 1 while rank 0 is locked", ckpt("state", ranks.pids[1], 15))
        if lock.startswith("rc=0"):
            cp = ckpt("checkpoint", p0, 60)
            fact("driver checkpoint rank 0", cp)
            fact("NVML after the checkpoint", "rank 0 listed %s"
                 % where_listed().get(p0))
            fact("driver state rank 0 after it", ckpt("state", p0))
            if cp.startswith("rc=0"):
                fact("driver restore rank 0", ckpt("restore", p0, 60))
            fact("driver unlock rank 0", ckpt("unlock", p0))
        fact("driver state rank 0 at the end", ckpt("state", p0))
        ar = ranks.both("allreduce", 30)
        fact("all-reduce after the driver's calls", ar)
    finally:
        ranks.stop()


def daemon_release(daemon, sock, nccl_suspend):
    """gpumemd's pause with release over every rank, then resume and all-reduce."""
    ranks = Ranks(sock, True)
    c = gpumem.connect(sock, name="nccl-ctl", role="controller")
    what = "after ncclCommSuspend" if nccl_suspend else "with a live communicator"
    try:
        check(None not in ranks.pids, "gpumem ranks start (%s)" % what, "%s" % ranks.facts)
        if None in ranks.pids:
            return
        f0 = ranks.facts[0]
        if nccl_suspend and not (f0["has_suspend"] or f0["pg_suspend"]):
            fact("ncclCommSuspend", "NCCL %s has no ncclCommSuspend (NCCL 2.29.7 and later "
                 "have it) and PyTorch's process group no suspend: not tried" % f0["nccl"])
            return
        if nccl_suspend:
            said = ranks.both("suspend", 60)
            fact("ncclCommSuspend", said)
            if not all(s.startswith("ok") for s in said):
                check(False, "NCCL suspends", said)
                return
        r, secs = timed_call(lambda: c.pause(release_context=True), 120)
        check(r != "hung", "the pause answers (%s)" % what, "%.1f s: %s" % (secs, describe(r)))
        if r == "hung":
            return
        fact("NVML after the pause (%s)" % what, "%s" % {p: where_listed().get(p)
                                                         for p in ranks.pids})
        r2, secs2 = timed_call(lambda: c.resume(), 120)
        check(r2 != "hung" and not isinstance(r2, Exception), "the resume (%s)" % what,
              "%.1f s: %s" % (secs2, describe(r2)))
        if nccl_suspend:
            fact("ncclCommResume", ranks.both("unsuspend", 60))
        ar = ranks.both("allreduce", 30)
        check(ar == ["ok"] * WORLD, "every rank all-reduces after it (%s)" % what, ar)
        if isinstance(r, gpumem.OpResult):
            released = [x for x in r.releases if x["released"]]
            fact("released (%s)" % what, "%d of %d ranks" % (len(released), WORLD))
    finally:
        c.close()
        ranks.stop()
        if daemon.poll() is not None:
            check(False, "the daemon runs on", "exit %s" % daemon.returncode)


def main():
    global WORLD
    gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.count("GPU ")
    if gpus < 1:
        print("nccl_release: needs a GPU")
        return 2
    WORLD = min(gpus, 2)
    fact("ranks", "%d (one per GPU; a communicator of one rank where there is one GPU)" % WORLD)
    driver_direct()
    run = tempfile.mkdtemp(prefix="gpumemd-nccl.")
    sock = os.path.join(run, "sock")
    argv = [daemon_bin, "--backend", "cuda", "--socket", sock, "--log-level", "info"]
    for n, susp in enumerate((False, True)):
        daemon = start_gpumemd(argv, sock, os.path.join(run, "daemon%d.log" % n))
        try:
            daemon_release(daemon, sock, susp)
        finally:
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
                try:
                    daemon.wait(30)
                except subprocess.TimeoutExpired:
                    check(False, "the daemon stops on SIGTERM", "killed after 30 s")
                    daemon.kill()
                    daemon.wait()
        log = open(os.path.join(run, "daemon%d.log" % n)).read()
        print("\n".join(log.splitlines()[-25:]), flush=True)
    print("nccl_release: %d failures" % failures, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    daemon_bin = sys.argv[1]
    sys.exit(main())
