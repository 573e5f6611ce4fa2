#!/usr/bin/env python3
"""An RL step on a GPU, done by three implementations in turn, each in an
engine process of its own, with the figures as ratios to upstream
torch_memory_saver measured in the same run:

- tms: upstream torch_memory_saver (built by bench/tms_build.sh), hook mode
  "torch";
- gpumem: the same engine code through gpumem.torch_memory_saver, over a
  gpumemd started here on the CUDA backend;
- gpumem-release: as gpumem, the engine opted in to context release
  (GPUMEM_RELEASE_CONTEXT=1) and pausing with release_context=True;
- gpumem-daemon: as gpumem, with the daemon copying the backups in a
  context it makes for the copies (GPUMEM_DAEMON_COPIES=1, the design
  before protocol 1.7) instead of the engine copying them itself.

The engine holds backed-up weights (region "weights"), a KV cache (region
"kv_cache"), a tensor outside any region and a captured CUDA graph (a
matrix-vector product of a slice of the weights, written into the KV
cache). Each cycle: the engine pauses every tag, node memory is read with
nvidia-smi, a trainer process takes a fraction of the free memory, writes
it and exits, the engine resumes the weights, then the KV cache (the
figure the issue names), and checks that the graph replays to the same
output, the weights hold their checksums, the KV cache is writable and
the outside tensor is intact. The engine times each call itself
(torch.cuda.synchronize() around it); for gpumem the daemon's elapsed_us
comes with it.

    bench/tms_build.sh .gpu-run/tms-src .gpu-run/tms
    python3 bench/rl_step.py --tms-path .gpu-run/tms [--json rl_step.json]

Prints FIGURE lines (min, median and max over the cycles of each phase:
pause, resume_weights, resume_kv, and for gpumem the daemon's elapsed_us
of each as <phase>_daemon; node memory used while paused), RATIO lines
(medians against tms's; <phase>_daemon: the daemon's share against tms's
whole call), GOAL lines (the issue's goals for gpumem-release, PASS or
MISS, never a failure), then one JSON object with everything. Exits
non-zero only when a check failed, or a child (engine, trainer, gpumemd)
hung, crashed or failed a pause or resume. Logs stay in the run
directory it names (rl_step.* under $TMPDIR).
"""
import argparse
import json
import math
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, ".."))

MiB = 1 << 20
GiB = 1 << 30
IMPLS = ("tms", "tms-retain", "gpumem", "gpumem-release", "gpumem-daemon")
PHASES = ("pause", "resume_weights", "resume_kv")
SEED = 20261130
N_WEIGHTS = 8          # weight tensors, weights_gib / N_WEIGHTS each
SAMPLE = 1 << 20       # elements of each weight tensor compared exactly
GRAPH_DIM = 4096       # the graph's matrix is GRAPH_DIM x GRAPH_DIM (at most)
GRAPH_TOKENS = 8       # ... times GRAPH_DIM x GRAPH_TOKENS inputs
KV_CHUNK = 1 << 30     # elements per min/max when the KV cache is checked
IDLE_SLACK_MIB = 16    # the issue: a released node holds at most idle + 16 MiB
PAUSE_GOAL_MS = 500    # ... and release adds at most this to the pause
RESUME_GOAL_MS = 400   # ... and this to the resume, beyond moving the bytes


class Broken(Exception):
    """A child hung, crashed or failed a step: the implementation stops."""


# ------------------------------------------------------------- the engine


def op_fields(res):
    """What a gpumem OpResult says, as JSON (None, as torch_memory_saver
    returns: nothing)."""
    if res is None:
        return {}
    return {"elapsed_us": res.elapsed_us, "buffers": res.buffers, "bytes": res.bytes,
            "backup_bytes": res.backup_bytes, "backup_us": res.backup_us,
            "releases": [dict(x) for x in res.releases]}


class EngineState:
    """An engine's saver, tensors and captured graph (built by __init__),
    and the commands it answers."""

    def __init__(self, impl, args):
        t0 = time.perf_counter()
        self.impl = impl
        self.release = impl == "gpumem-release"
        self.fresh_release = False  # paused with release and not resumed since
        if impl.startswith("tms"):
            import torch_memory_saver as module
            self.tms = module.torch_memory_saver
            where = module.__file__
        else:
            sys.path.insert(0, os.path.join(REPO, "python"))
            import gpumem
            from gpumem.torch_memory_saver import torch_memory_saver
            self.tms = torch_memory_saver
            where = gpumem.__file__
        self.tms.hook_mode = "torch"
        import torch
        self.torch = torch
        torch.cuda.set_device(0)
        if impl == "tms-retain" or (impl == "tms" and args.tms_retain_cpu_backup):
            self.tms.retain_cpu_backup = True
        dt = torch.bfloat16
        per = max(1, int(args.weights_gib * GiB) // N_WEIGHTS // 2)
        gen = torch.Generator(device="cuda")
        self.weights = []
        with self.tms.region("weights", enable_cpu_backup=True):
            for i in range(N_WEIGHTS):
                gen.manual_seed(SEED + i)
                self.weights.append(torch.randn(per, dtype=dt, device="cuda", generator=gen))
        with self.tms.region("kv_cache"):
            self.kv = torch.zeros(max(GRAPH_TOKENS, int(args.kv_gib * GiB) // 2), dtype=dt,
                                  device="cuda")
        self.outside = torch.full((max(1, int(args.outside_gib * GiB) // 4),), 7.0,
                                  dtype=torch.float32, device="cuda")
        self.build_graph(gen, per)
        self.want_sums = self.weight_sums()
        # A first check, so that what it caches exists before the first pause.
        first = self.check()
        if not first["ok"]:
            raise RuntimeError("the check fails before any pause: %s" % json.dumps(first))
        free, total = torch.cuda.mem_get_info()
        self.ready = {
            "ready": True, "pid": os.getpid(), "impl": impl, "module": where,
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "setup_s": time.perf_counter() - t0, "free": free, "total": total,
            "weights_bytes": sum(w.numel() * w.element_size() for w in self.weights),
            "kv_bytes": self.kv.numel() * self.kv.element_size(),
            "outside_bytes": self.outside.numel() * self.outside.element_size(),
            "graph_dim": self.dim,
        }

    def build_graph(self, gen, per):
        """Capture the "generate" step: y = W x for a square slice W of the
        first weight tensor and GRAPH_TOKENS input columns x, y written into
        the head of the KV cache; warmed up on a side stream, captured
        outside any region, replayed once for the reference output."""
        torch = self.torch
        d = max(1, min(GRAPH_DIM, math.isqrt(per), self.kv.numel() // GRAPH_TOKENS))
        self.dim = d
        self.w = self.weights[0][:d * d].view(d, d)
        gen.manual_seed(SEED + N_WEIGHTS)
        self.x = torch.randn(d, GRAPH_TOKENS, dtype=self.w.dtype, device="cuda", generator=gen)
        self.kv_slot = self.kv[:d * GRAPH_TOKENS].view(d, GRAPH_TOKENS)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.kv_slot.copy_(torch.matmul(self.w, self.x))
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=side):
            self.y = torch.matmul(self.w, self.x)
            self.kv_slot.copy_(self.y)
        self.graph.replay()
        torch.cuda.synchronize()
        self.want_y = self.y.clone()

    def weight_sums(self):
        """Per weight tensor: its float32 sum on the device, and an exact
        strided sample on the host with its float64 sum."""
        torch = self.torch
        sums = []
        for t in self.weights:
            sample = t[::max(1, t.numel() // SAMPLE)].cpu()
            sums.append((float(t.sum(dtype=torch.float32).item()),
                         float(sample.double().sum().item()), sample))
        return sums

    def check(self):
        """Replay the graph and judge the state: graph output as before,
        weights' checksums as before, KV cache writable, outside tensor
        intact."""
        torch = self.torch
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.graph.replay()
        torch.cuda.synchronize()
        graph_ok = bool(torch.equal(self.y, self.want_y)) and \
            bool(torch.equal(self.kv_slot, self.want_y))
        sums = self.weight_sums()
        weights_ok = all(a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])
                         for a, b in zip(sums, self.want_sums))
        self.kv.fill_(1.0)
        kv_ok = True
        for i in range(0, self.kv.numel(), KV_CHUNK):
            part = self.kv[i:i + KV_CHUNK]
            kv_ok = kv_ok and part.min().item() == 1.0 and part.max().item() == 1.0
        outside_ok = self.outside.min().item() == 7.0 and self.outside.max().item() == 7.0
        torch.cuda.synchronize()
        bad = [name for name, ok in (("graph", graph_ok), ("weights", weights_ok),
                                     ("kv", kv_ok), ("outside", outside_ok)) if not ok]
        return {"ok": not bad, "wrong": bad, "ms": (time.perf_counter() - t0) * 1e3,
                "weight_sums": [s[0] for s in sums]}

    def pause(self):
        """Pause every tag (with release_context for gpumem-release); a
        refused release is reported, not raised: the buffers are paused."""
        torch = self.torch
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = {"ok": True}
        try:
            res = self.tms.pause(release_context=True) if self.release else self.tms.pause()
        except Exception as e:  # gpumem.Error: the pause is done, the release is not
            name = getattr(e, "code_name", "")
            if not self.release or name not in ("RELEASE_REFUSED", "NOT_RELEASED"):
                raise
            res = getattr(e, "result", None)
            out["release_error"] = "%s: %s" % (name, getattr(e, "message", str(e)))
        if self.release:
            # No CUDA call now: a released process's next one waits for the resume.
            self.fresh_release = True
        else:
            torch.cuda.synchronize()
        out["ms"] = (time.perf_counter() - t0) * 1e3
        out.update(op_fields(res))
        return out

    def resume(self, tag):
        """Resume one tag (the first resume after a release restores the
        process's device state too)."""
        if tag not in ("weights", "kv_cache"):
            return {"ok": False, "error": "no tag %r" % tag}
        torch = self.torch
        if not self.fresh_release:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = self.tms.resume(tag)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        self.fresh_release = False
        out = {"ok": True, "ms": ms}
        out.update(op_fields(res))
        return out


def engine_main(args):
    """The engine process: build the state, say ready, then answer one
    JSON line per command line on stdin. Replies go to the original
    stdout; anything else written to fd 1 (libraries' prints) goes to
    stderr."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def answer(obj):
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    try:
        st = EngineState(args.engine, args)
    except BaseException as e:  # noqa: B902 (reported, then the process ends)
        traceback.print_exc()
        answer({"ready": False, "error": "%s: %s" % (type(e).__name__, e)})
        sys.stderr.flush()
        os._exit(1)
    answer(st.ready)
    while True:
        line = sys.stdin.readline()
        if not line:
            break
        words = line.split()
        if not words:
            continue
        try:
            if words == ["pause"]:
                r = st.pause()
            elif words[0] == "resume" and len(words) == 2:
                r = st.resume(words[1])
            elif words == ["check"]:
                r = st.check()
            elif words == ["quit"]:
                answer({"cmd": "quit", "ok": True})
                sys.stderr.flush()
                os._exit(0)  # no destructors: upstream's free outside a region aborts
            else:
                r = {"ok": False, "error": "unknown command %r" % line.strip()}
        except Exception as e:
            traceback.print_exc()
            r = {"ok": False, "error": "%s: %s" % (type(e).__name__, e)}
        r["cmd"] = " ".join(words)
        answer(r)
    sys.stderr.flush()
    os._exit(0)


# ------------------------------------------------- the driver's children

TRAINER = r'''
import json, os, sys, time, torch
fraction = float(sys.argv[1])
t0 = time.perf_counter()
free, total = torch.cuda.mem_get_info()
want = int(free * fraction) // (2 << 20) * (2 << 20)
chunks, left = [], want
while left > 0:
    n = min(left, 16 << 30)
    chunks.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
    left -= n
for c in chunks:
    c.fill_(0x5a)
torch.cuda.synchronize()
print(json.dumps({"pid": os.getpid(), "free": free, "total": total, "bytes": want,
                  "s": time.perf_counter() - t0}), flush=True)
'''

COPY_PROBE = r'''
import json, sys, time, torch
n = int(sys.argv[1])
d = torch.full((n,), 7, dtype=torch.uint8, device="cuda")
h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
best = {"d2h_s": 1e9, "h2d_s": 1e9}
for _ in range(3):
    for key, dst, src in (("d2h_s", h, d), ("h2d_s", d, h)):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best[key] = min(best[key], time.perf_counter() - t)
best["bytes"] = n
print(json.dumps(best), flush=True)
'''

TMS_PROBE = r'''
import json, torch_memory_saver
from torch_memory_saver.utils import get_binary_path_from_package as find
print(json.dumps({"module": torch_memory_saver.__file__,
                  "torch_so": str(find("torch_memory_saver_hook_mode_torch"))}), flush=True)
'''


def tail(path, n=4000):
    """The last n characters of a log file ("" when unreadable)."""
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def with_tail(msg, log, n=3000):
    """msg naming the log, then the log's tail on lines of its own."""
    t = tail(log, n).rstrip()
    return "%s; log %s" % (msg, log) + ("\n  --- its tail:\n" + t if t else "")


def nvidia_smi(args):
    """nvidia-smi's output lines ([] when it fails)."""
    try:
        r = subprocess.run(["nvidia-smi"] + args, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return r.stdout.splitlines() if r.returncode == 0 else []


def node_used_mib():
    """Device 0's memory used in MiB by NVML (nvidia-smi leaves the driver's
    reserve out); None when nvidia-smi cannot say."""
    out = nvidia_smi(["-i", "0", "--query-gpu=memory.used", "--format=csv,noheader,nounits"])
    try:
        return int(out[0].strip())
    except (IndexError, ValueError):
        return None


def nvml_apps():
    """NVML's compute processes: pid -> MiB used (-1 when not given)."""
    apps = {}
    for line in nvidia_smi(["--query-compute-apps=pid,used_memory",
                            "--format=csv,noheader,nounits"]):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            apps[int(parts[0])] = int(parts[1]) if parts[1].isdigit() else -1
    return apps


def wait_left_nvml(pid, seconds):
    """Wait until NVML no longer lists pid; True if it left in time."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if pid not in nvml_apps():
            return True
        time.sleep(0.05)
    return pid not in nvml_apps()


def run_script(code, argv, env, timeout, log, what):
    """Run python3 -c code with its stderr in log; its last JSON line.
    Raises Broken when it hangs (killed) or fails."""
    with open(log, "w") as lf:
        p = subprocess.Popen([sys.executable, "-c", code] + argv, stdout=subprocess.PIPE,
                             stderr=lf, env=env, text=True, cwd=REPO)
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise Broken("%s hung: not done in %d s (killed); log %s" % (what, timeout, log))
        except BaseException:
            p.kill()
            p.wait()
            raise
    if p.returncode != 0:
        raise Broken(with_tail("%s failed (exit %s)" % (what, p.returncode), log, 2000))
    for line in reversed(out.splitlines()):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    raise Broken("%s printed no result; log %s" % (what, log))


class EngineProc:
    """An engine process, its stdout read with select() against deadlines."""

    def __init__(self, argv, env, log, name):
        self.name = name
        self.log = log
        self.logf = open(log, "w")
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.logf, env=env, cwd=REPO)
        self.fd = self.p.stdout.fileno()
        self.buf = b""
        self.eof = False

    def _line(self, deadline):
        """The next line of its stdout; None at EOF or at the deadline."""
        while b"\n" not in self.buf:
            if self.eof:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            r, _, _ = select.select([self.fd], [], [], left)
            if not r:
                continue
            chunk = os.read(self.fd, 65536)
            if not chunk:
                self.eof = True
                continue
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode(errors="replace")

    def reply(self, timeout, what):
        """Its next JSON object within timeout seconds; Broken (and the
        process killed) when it ends or hangs first."""
        deadline = time.monotonic() + timeout
        while True:
            line = self._line(deadline)
            if line is None:
                break
            try:
                obj = json.loads(line)
            except ValueError:
                obj = None
            if isinstance(obj, dict):
                return obj
            print("  %s says: %s" % (self.name, line), flush=True)
        if self.eof:
            try:
                rc = self.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                rc = "running, stdout closed"
            self.stop()
            raise Broken(with_tail("%s ended (exit %s) before answering %s"
                                   % (self.name, rc, what), self.log))
        self.stop()
        raise Broken(with_tail("%s hung: no answer to %s in %d s (killed)"
                               % (self.name, what, timeout), self.log))

    def ask(self, cmd, timeout):
        """Send one command and return its reply (see reply)."""
        try:
            self.p.stdin.write((cmd + "\n").encode())
            self.p.stdin.flush()
        except OSError:
            pass  # it ended: reply() says how
        return self.reply(timeout, repr(cmd))

    def stop(self):
        """Kill it if it still runs, and reap it."""
        if self.p.poll() is None:
            self.p.kill()
        try:
            self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.p.stdin, self.p.stdout, self.logf):
            try:
                f.close()
            except OSError:
                pass


def start_daemon(args, run_dir, impl):
    """gpumemd on the CUDA backend on a socket of its own; (process, socket,
    log). Broken when it does not come up."""
    if os.path.join(REPO, "tests", "gpu") not in sys.path:
        sys.path.insert(0, os.path.join(REPO, "tests", "gpu"))
    from gpucheck import start_gpumemd
    sock = os.path.join(run_dir, "%s.sock" % impl)
    log = os.path.join(run_dir, "gpumemd-%s.log" % impl)
    argv = [args.daemon, "--backend", "cuda", "--socket", sock, "--log-level", "info"]
    daemon = start_gpumemd(argv, sock, log)
    if daemon.poll() is not None or not os.path.exists(sock):
        if daemon.poll() is None:
            daemon.kill()
        daemon.wait()
        raise Broken(with_tail("gpumemd did not start (%s, exit %s)"
                               % (" ".join(argv), daemon.returncode), log))
    return daemon, sock, log


def stop_daemon(daemon):
    """SIGTERM the daemon and wait for it (kill after 30 s); its exit status."""
    if daemon.poll() is None:
        daemon.send_signal(signal.SIGTERM)
    try:
        return daemon.wait(timeout=30)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()
        return "killed after 30 s"


# ------------------------------------------------------------- the driver


def need_ok(reply, what):
    """The reply, or Broken when it says the step failed."""
    if not reply.get("ok"):
        raise Broken("%s failed: %s" % (what, reply.get("error", json.dumps(reply))))
    return reply


def engine_argv(args, impl):
    """The command line of an engine of impl."""
    argv = [sys.executable, os.path.abspath(__file__), "--engine", impl,
            "--weights-gib", repr(args.weights_gib), "--kv-gib", repr(args.kv_gib),
            "--outside-gib", repr(args.outside_gib)]
    if args.tms_retain_cpu_backup:
        argv.append("--tms-retain-cpu-backup")
    return argv


def tms_env(args):
    """The environment of a tms engine: --tms-path first on PYTHONPATH."""
    env = dict(os.environ)
    if args.tms_path:
        old = env.get("PYTHONPATH")
        env["PYTHONPATH"] = args.tms_path + (os.pathsep + old if old else "")
    return env


def run_impl(args, impl, run_dir, failures):
    """One implementation's engine through --cycles cycles; its record."""
    rec = {"impl": impl, "ok": False, "error": None, "ready": None, "cycles": [],
           "failed_checks": 0}
    daemon = eng = None
    if impl.startswith("tms"):
        env = tms_env(args)
    else:
        env = dict(os.environ)
        env.pop("GPUMEM_RELEASE_CONTEXT", None)
        env.pop("GPUMEM_DAEMON_COPIES", None)
        if impl == "gpumem-release":
            env["GPUMEM_RELEASE_CONTEXT"] = "1"
        if impl == "gpumem-daemon":
            env["GPUMEM_DAEMON_COPIES"] = "1"
    print("== rl_step %s" % impl, flush=True)
    try:
        if not impl.startswith("tms"):
            daemon, sock, dlog = start_daemon(args, run_dir, impl)
            env["GPUMEM_SOCKET"] = sock
            rec["daemon"] = {"pid": daemon.pid, "log": dlog, "idle_mib": node_used_mib()}
        log = os.path.join(run_dir, "engine-%s.log" % impl)
        rec["engine_log"] = log
        eng = EngineProc(engine_argv(args, impl), env, log, "engine %s" % impl)
        ready = eng.reply(args.setup_timeout, "ready")
        rec["ready"] = ready
        if not ready.get("ready"):
            raise Broken(with_tail("engine %s did not set up: %s" % (impl, ready.get("error")),
                                   log))
        print("  engine pid %d ready in %.1f s: %s (torch %s, CUDA %s)"
              % (ready["pid"], ready["setup_s"], ready["module"], ready["torch"], ready["cuda"]),
              flush=True)
        for n in range(1, args.cycles + 1):
            rec["cycles"].append(run_cycle(args, impl, n, eng, daemon, ready["pid"], run_dir,
                                           rec, failures))
        need_ok(eng.ask("quit", args.timeout), "quit")
        try:
            eng.p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise Broken("engine %s did not exit within 60 s of quit" % impl)
        rec["ok"] = rec["failed_checks"] == 0
    except Broken as e:
        rec["error"] = str(e)
        failures.append("%s: %s" % (impl, str(e).splitlines()[0]))
        print("FAIL rl_step %s: %s" % (impl, e), flush=True)
        if daemon is not None:
            print("  gpumemd log %s, its tail:\n%s" % (rec["daemon"]["log"],
                                                     tail(rec["daemon"]["log"], 2000)), flush=True)
    finally:
        if eng is not None:
            eng.stop()
            wait_left_nvml(eng.p.pid, 30)  # its memory back before the next one starts
        if daemon is not None:
            rec["daemon"]["exit"] = stop_daemon(daemon)
    return rec


def run_cycle(args, impl, n, eng, daemon, pid, run_dir, rec, failures):
    """One pause, trainer, resume and check; the cycle's record."""
    def ask(cmd):
        if daemon is not None and daemon.poll() is not None:
            raise Broken("gpumemd died (exit %s) before %r" % (daemon.returncode, cmd))
        return need_ok(eng.ask(cmd, args.timeout), "%s of cycle %d" % (cmd, n))

    cyc = {"cycle": n}
    cyc["pause"] = ask("pause")
    cyc["paused_used_mib"] = node_used_mib()
    apps = nvml_apps()
    cyc["paused_apps"] = {str(k): v for k, v in apps.items()}
    cyc["paused_engine_mib"] = apps.get(pid, 0)
    if daemon is not None:
        cyc["paused_daemon_mib"] = apps.get(daemon.pid, 0)
    if "release_error" in cyc["pause"]:
        print("  cycle %d: release refused: %s" % (n, cyc["pause"]["release_error"]), flush=True)
    tlog = os.path.join(run_dir, "trainer-%s-%d.log" % (impl, n))
    trainer = run_script(TRAINER, [repr(args.trainer_fraction)], dict(os.environ),
                         args.trainer_timeout, tlog, "trainer of cycle %d" % n)
    trainer["left_nvml"] = wait_left_nvml(trainer["pid"], 10)
    cyc["trainer"] = trainer
    cyc["resume_weights"] = ask("resume weights")
    cyc["resume_kv"] = ask("resume kv_cache")
    cyc["check"] = eng.ask("check", args.timeout)
    if "error" in cyc["check"]:
        raise Broken("check of cycle %d failed to run: %s" % (n, cyc["check"]["error"]))
    ok = cyc["check"].get("ok")
    if not ok:
        rec["failed_checks"] += 1
        failures.append("%s: check of cycle %d: wrong %s" % (impl, n, cyc["check"].get("wrong")))
    print("  cycle %d: pause %.1f ms, paused used %s MiB (engine %s MiB), trainer %.1f GiB, "
          "resume weights %.1f ms, kv_cache %.1f ms, check %s"
          % (n, cyc["pause"]["ms"], cyc["paused_used_mib"], cyc["paused_engine_mib"],
             trainer["bytes"] / GiB, cyc["resume_weights"]["ms"], cyc["resume_kv"]["ms"],
             "ok" if ok else "WRONG " + ",".join(cyc["check"].get("wrong", []))), flush=True)
    return cyc


def stats(xs):
    """min, median and max of xs (None when empty)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def summarize(rec):
    """Per phase: the engine's ms, and the daemon's (elapsed_us) where given."""
    # The first cycle makes what later ones reuse (host memory for the
    # backups): it is reported on its own, the phases are the later ones.
    first, cycles = rec["cycles"][:1], rec["cycles"][1:] or rec["cycles"]
    out = {"first_pause": stats([c["pause"]["ms"] for c in first])}
    for ph in PHASES:
        out[ph] = stats([c[ph]["ms"] for c in cycles])
        out[ph + "_daemon"] = stats([c[ph]["elapsed_us"] / 1e3 for c in cycles
                                     if "elapsed_us" in c[ph]])
    out["resume_total"] = stats([c["resume_weights"]["ms"] + c["resume_kv"]["ms"]
                                 for c in cycles])
    out["check"] = stats([c["check"].get("ms") for c in cycles])
    out["paused_used_mib"] = stats([c["paused_used_mib"] for c in cycles])
    out["paused_engine_mib"] = stats([c["paused_engine_mib"] for c in cycles])
    out["paused_daemon_mib"] = stats([c.get("paused_daemon_mib") for c in cycles])
    return out


def releases_of(reply, pid):
    """The engine's entries in a reply's releases."""
    return [x for x in reply.get("releases", []) if x.get("pid") == pid]


def print_figures(results, summary, idle):
    """The FIGURE and RATIO lines; the ratios as a dict."""
    for impl, s in summary.items():
        if s["first_pause"]:
            print("FIGURE rl_step %s first_pause %.1f ms (the phases below: the later cycles)"
                  % (impl, s["first_pause"]["median"]))
        for ph in PHASES:
            for key in (ph, ph + "_daemon"):
                if s[key]:
                    print("FIGURE rl_step %s %s min=%.1f median=%.1f max=%.1f ms"
                          % (impl, key, s[key]["min"], s[key]["median"], s[key]["max"]))
        if s["paused_used_mib"]:
            extra = " engine_mib=%d" % s["paused_engine_mib"]["median"]
            if s["paused_daemon_mib"]:
                extra += " gpumemd_mib=%d" % s["paused_daemon_mib"]["median"]
            print("FIGURE rl_step %s paused_used_mib=%d idle_mib=%s%s (median; max %d)"
                  % (impl, s["paused_used_mib"]["median"], idle, extra,
                     s["paused_used_mib"]["max"]))
    rel = results.get("gpumem-release")
    if rel and rel["ready"]:
        pid = rel["ready"].get("pid")
        for c in rel["cycles"]:
            for what, key in (("release", "pause"), ("restore", "resume_weights")):
                for x in releases_of(c[key], pid):
                    print("FIGURE rl_step gpumem-release %s cycle=%d released=%s moved_to_host=%d "
                          "(%.2f GiB) elapsed_us=%d why=%r"
                          % (what, c["cycle"], x.get("released"), x.get("moved_to_host", 0),
                             x.get("moved_to_host", 0) / GiB, x.get("elapsed_us", 0),
                             x.get("why", "")))
                if what == "release" and not releases_of(c[key], pid):
                    print("FIGURE rl_step gpumem-release release cycle=%d: no entry for the "
                          "engine (%s)" % (c["cycle"], c[key].get("release_error", "none given")))
    ratios = {}
    for base_name, impl in [(b, i) for b in ("tms", "tms-retain")
                            for i in ("gpumem", "gpumem-release", "gpumem-daemon")]:
        base, s = summary.get(base_name), summary.get(impl)
        if not base or not s:
            continue
        # The engine's time against tms's, then the daemon's share of ours
        # against the same (tms has no daemon).
        for key, ph in [(ph, ph) for ph in PHASES] + [(ph + "_daemon", ph) for ph in PHASES]:
            if s[key] and base[ph] and base[ph]["median"] > 0:
                r = s[key]["median"] / base[ph]["median"]
                ratios["%s/%s %s" % (impl, base_name, key)] = r
                print("RATIO rl_step %s/%s %s %.2f" % (impl, base_name, key, r))
    return ratios


def judge_goals(results, summary, idle, copy):
    """The issue's goals for gpumem-release, printed PASS or MISS (never a
    failure); as a dict."""
    goals = {}
    rel = summary.get("gpumem-release")
    if not rel:
        return goals

    def say(name, ok, detail):
        goals[name] = {"pass": ok, "detail": detail}
        print("GOAL rl_step gpumem-release %s: %s (%s)" % (name, "PASS" if ok else "MISS", detail))

    used = rel["paused_used_mib"]
    if used and idle is not None:
        say("paused_used", used["max"] <= idle + IDLE_SLACK_MIB,
            "paused node used at most %d MiB over the cycles, idle %d MiB, goal <= idle + %d MiB"
            % (used["max"], idle, IDLE_SLACK_MIB))
    else:
        print("GOAL rl_step gpumem-release paused_used: not judged (nvidia-smi gave no figure)")
    base = summary.get("gpumem")
    if not base:
        print("GOAL rl_step gpumem-release pause and resume: not judged (needs gpumem in --impls)")
        return goals
    pid = results["gpumem-release"]["ready"]["pid"]
    cycles = results["gpumem-release"]["cycles"]
    not_released = [c["cycle"] for c in cycles
                    if not any(x.get("released") for x in releases_of(c["pause"], pid))]
    steady = cycles[1:] or cycles
    moved = stats([sum(x.get("moved_to_host", 0) for x in releases_of(c["pause"], pid))
                   for c in steady])
    moved_b = moved["median"] if moved else 0
    # The move is the driver's (its checkpoint and restore calls, timed by
    # the daemon around them): what the release adds beyond it is ours.
    driver = {"pause": stats([sum(x.get("elapsed_us", 0) for x in releases_of(c["pause"], pid))
                              / 1e3 for c in steady]),
              "resume": stats([sum(x.get("elapsed_us", 0)
                                   for x in releases_of(c["resume_weights"], pid)) / 1e3
                               for c in steady])}
    for name, key, bw_key, goal in (("pause", "pause", "d2h_s", PAUSE_GOAL_MS),
                                    ("resume", "resume_total", "h2d_s", RESUME_GOAL_MS)):
        if not rel[key] or not base[key]:
            continue
        extra = rel[key]["median"] - base[key]["median"]
        cost = driver[name]["median"] if driver[name] else 0.0
        how = "%.1f ms in the driver's %s calls (%.2f GiB/s)" % (
            cost, "checkpoint" if name == "pause" else "restore",
            moved_b / GiB / (cost / 1e3) if cost else 0.0)
        if copy:
            how += "; a pinned copy of as much takes %.1f ms here" % (
                moved_b / (copy["bytes"] / copy[bw_key]) * 1e3)
        beyond = extra - cost
        if not_released:
            say(name + "_extra", False,
                "the engine's device state was not released in cycles %s (%s)"
                % (not_released, cycles[not_released[0] - 1]["pause"].get("release_error",
                                                                         "no release entry")))
            goals[name + "_extra"].update(extra_ms=extra, move_cost_ms=cost, beyond_ms=beyond,
                                          moved_bytes=moved_b)
            continue
        say(name + "_extra", beyond <= goal,
            "release adds %.1f ms to the %s (median %.1f against gpumem's %.1f); moving the "
            "%d bytes (%.2f GiB) it moved to host costs %s; %.1f ms beyond, goal <= %d ms"
            % (extra, "pause" if name == "pause" else "resume (weights + kv_cache)",
               rel[key]["median"], base[key]["median"], moved_b, moved_b / GiB, how, beyond, goal))
        goals[name + "_extra"].update(extra_ms=extra, move_cost_ms=cost, beyond_ms=beyond,
                                      moved_bytes=moved_b)
    return goals


def parse_args(argv):
    """The command line."""
    ap = argparse.ArgumentParser(description="RL-step pause/resume benchmark: "
                                 "torch_memory_saver against gpumem.torch_memory_saver")
    ap.add_argument("--impls", default=",".join(IMPLS),
                    help="comma-separated, of %s (default all)" % ", ".join(IMPLS))
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--weights-gib", type=float, default=16.0)
    ap.add_argument("--kv-gib", type=float, default=64.0)
    ap.add_argument("--outside-gib", type=float, default=2.0)
    ap.add_argument("--trainer-fraction", type=float, default=0.9,
                    help="of the free memory the trainer takes (default 0.9)")
    ap.add_argument("--daemon", default="build/bin/gpumemd",
                    help="gpumemd binary (relative: to the repository root)")
    ap.add_argument("--tms-path", default=None,
                    help="bench/tms_build.sh's OUTDIR, put on the tms engine's PYTHONPATH")
    ap.add_argument("--tms-retain-cpu-backup", action="store_true",
                    help="set torch_memory_saver's retain_cpu_backup (its default: off)")
    ap.add_argument("--json", default=None, help="write the JSON object here too")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per engine command")
    ap.add_argument("--setup-timeout", type=float, default=600,
                    help="seconds for an engine to become ready")
    ap.add_argument("--trainer-timeout", type=float, default=300)
    ap.add_argument("--engine", choices=IMPLS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    impls = [x.strip() for x in args.impls.split(",") if x.strip()]
    bad = [x for x in impls if x not in IMPLS]
    if bad or not impls:
        ap.error("--impls: unknown %s (choose from %s)" % (",".join(bad) or "(none)",
                                                          ",".join(IMPLS)))
    args.impls = [x for x in IMPLS if x in impls]
    if args.cycles < 1:
        ap.error("--cycles must be >= 1")
    if args.weights_gib <= 0 or args.kv_gib <= 0 or args.outside_gib < 0:
        ap.error("--weights-gib and --kv-gib must be > 0, --outside-gib >= 0")
    if not 0 < args.trainer_fraction < 1:
        ap.error("--trainer-fraction must be between 0 and 1")
    if not os.path.isabs(args.daemon):
        args.daemon = os.path.join(REPO, args.daemon)
    if args.tms_path:
        args.tms_path = os.path.abspath(args.tms_path)
    return args


def main(argv):
    """Run the implementations one after the other and report."""
    args = parse_args(argv)
    if args.engine:
        engine_main(args)  # does not return
    run_dir = tempfile.mkdtemp(prefix="rl_step.")
    failures = []
    skipped = {}
    print("rl_step: weights %g GiB (backed up), kv_cache %g GiB, outside %g GiB, %d cycles, "
          "trainer %.0f%% of free; logs in %s"
          % (args.weights_gib, args.kv_gib, args.outside_gib, args.cycles,
             args.trainer_fraction * 100, run_dir), flush=True)
    impls = list(args.impls)
    if any(i.startswith("tms") for i in impls):
        try:
            if args.tms_path and not os.path.isdir(args.tms_path):
                raise Broken("--tms-path %s is not a directory" % args.tms_path)
            probe = run_script(TMS_PROBE, [], tms_env(args), 120,
                               os.path.join(run_dir, "tms-probe.log"), "import torch_memory_saver")
            print("rl_step: torch_memory_saver %s, %s" % (probe["module"], probe["torch_so"]))
        except Broken as e:
            for i in [i for i in impls if i.startswith("tms")]:
                skipped[i] = str(e)
                impls.remove(i)
            print("SKIP rl_step tms: torch_memory_saver cannot be used (ratios omitted): %s" % e,
                  flush=True)
    if any(not i.startswith("tms") for i in impls) and not os.access(args.daemon, os.X_OK):
        print("FAIL rl_step: no gpumemd at %s (--daemon)" % args.daemon, flush=True)
        failures.append("no gpumemd at %s" % args.daemon)
        impls = [i for i in impls if i.startswith("tms")]
    idle = node_used_mib()
    print("rl_step: idle node uses %s MiB (nvidia-smi, device 0)" % idle, flush=True)
    copy = None
    if "gpumem-release" in impls:
        n = int(min(max(args.outside_gib * GiB, 256 * MiB), 4 * GiB))
        try:
            copy = run_script(COPY_PROBE, [str(n)], dict(os.environ), 120,
                              os.path.join(run_dir, "copy-probe.log"), "copy probe")
            print("FIGURE rl_step copy d2h=%.1f GB/s h2d=%.1f GB/s (%.2f GiB, pinned host memory)"
                  % (n / copy["d2h_s"] / 1e9, n / copy["h2d_s"] / 1e9, n / GiB), flush=True)
        except Broken as e:
            print("rl_step: copy probe failed, release costs not subtracted: %s" % e, flush=True)
    results = {}
    for impl in impls:
        results[impl] = run_impl(args, impl, run_dir, failures)
    summary = {impl: summarize(rec) for impl, rec in results.items() if rec["cycles"]}
    ratios = print_figures(results, summary, idle)
    goals = judge_goals(results, summary, idle, copy)
    report = {
        "bench": "rl_step",
        "config": {k: v for k, v in vars(args).items() if k != "engine"},
        "run_dir": run_dir, "idle_mib": idle, "copy_probe": copy, "skipped": skipped,
        "results": results, "summary": summary, "ratios": ratios, "goals": goals,
        "failures": failures,
    }
    text = json.dumps(report, sort_keys=True)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    for f in failures:
        print("FAIL rl_step %s" % f)
    print("rl_step: %d failures" % len(failures), flush=True)
    print(text, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
