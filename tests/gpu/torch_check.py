"""PyTorch on gpumemd, on a GPU: a small transformer built here (no
downloads) with its weights in a backed-up region and its KV cache in a
region, generating greedily; the process pauses itself, a "trainer"
process fills the freed memory and exits, the process resumes, and the
generation must equal an uninterrupted one. Judged by the driver's free
memory (torch.cuda.mem_get_info, here and in the trainer) and by the
daemon's reports. Phases, each a process of its own:

- torch: gpumem.torch (pluggable allocator), plus a process whose pool is
  allocated outside any region and served by libgpumem_preload.so
  (GPUMEM_DEFAULT_TAG=compress_state), paused node-wide by a controller;
  then nested regions with disable() and a capture inside them, the
  cache given back by empty_cache(), and shutdown();
- graph: one decode step captured with gpumem.torch.cuda_graph, replayed
  across a pause of its pool, then everything given back;
- tms: the same flow through gpumem.torch_memory_saver (hook_mode torch),
  with disable() inside a region, a partial pause and a graph captured
  inside a region;
- tms-preload: the same through hook_mode preload (LD_PRELOAD).

    python3 tests/gpu/torch_check.py build/bin/gpumemd

It prints PASS and FAIL lines, SKIP when PyTorch or CUDA is missing, and
exits non-zero on a failure.
"""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "python"))
# cuBLAS: the same results run after run on one stream.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import gpumem  # noqa: E402
from gpucheck import start_gpumemd  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
SLACK = 64 * MiB  # driver free memory vs released bytes
VOCAB, DIM, LAYERS, HEADS, MAX_SEQ = 1000, 512, 4, 8, 128
BATCH, PROMPT, N1, N2 = 8, 16, 24, 24
KV_FRACTION = 0.5  # of free device memory, as an engine's static KV pool

failures = 0
phase_name = "driver"


def check(ok, name, detail):
    """Print one PASS or FAIL line."""
    global failures
    failures += not ok
    print("%s torch %s %s: %s" % ("PASS" if ok else "FAIL", phase_name, name, detail), flush=True)


def gib(n):
    return "%.2f GiB" % (n / GiB)


# The model.

def make_model(torch):
    """A 4-layer decoder with a deterministic init (on the CPU)."""
    nn = torch.nn
    F = torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
            self.qkv = nn.Linear(DIM, 3 * DIM)
            self.proj = nn.Linear(DIM, DIM)
            self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, DIM)
            self.pos = nn.Embedding(MAX_SEQ, DIM)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.lnf = nn.LayerNorm(DIM)
            self.head = nn.Linear(DIM, VOCAB)
            self.register_buffer("positions", torch.arange(MAX_SEQ))

        def step(self, kv, tok, pos):
            """Logits [B, VOCAB] for tokens tok [B] at position pos (a 0-dim
            device tensor), writing K and V at pos; attention over the whole
            cache, masked, so that every step runs the same kernels (and can
            be captured)."""
            b, s, dh = tok.shape[0], MAX_SEQ, DIM // HEADS
            x = self.emb(tok) + self.pos(pos)
            here = (self.positions == pos).view(1, s, 1)
            seen = (self.positions <= pos).view(1, 1, 1, s)
            for i, blk in enumerate(self.blocks):
                q, k, v = blk.qkv(blk.ln1(x)).split(DIM, dim=-1)
                kc, vc = kv[i, 0], kv[i, 1]
                kc.copy_(torch.where(here, k.unsqueeze(1), kc))
                vc.copy_(torch.where(here, v.unsqueeze(1), vc))
                qh = q.view(b, HEADS, 1, dh)
                kh = kc.view(b, s, HEADS, dh).transpose(1, 2)
                vh = vc.view(b, s, HEADS, dh).transpose(1, 2)
                att = (qh @ kh.transpose(-1, -2)) * (dh ** -0.5)
                att = att.masked_fill(~seen, float("-inf")).softmax(-1)
                x = x + blk.proj((att @ vh).reshape(b, DIM))
                x = x + blk.fc2(F.gelu(blk.fc1(blk.ln2(x))))
            return self.head(self.lnf(x))

    torch.manual_seed(1234)
    return TinyLM().eval()


def kv_shape():
    return (LAYERS, 2, BATCH, MAX_SEQ, DIM)


def kv_pool_elems(torch):
    """float32 elements of a pool of KV_FRACTION of the free memory."""
    free, _ = torch.cuda.mem_get_info()
    n = int(free * KV_FRACTION) // 4
    need = 1
    for x in kv_shape():
        need *= x
    return max(n // (2 * MiB // 4) * (2 * MiB // 4), need)


def model_and_kv(torch, region, backup, zeros=True):
    """The model moved to the current device in region("weights", **backup)
    and the KV cache's pool made in region("kv_cache"), zeroed there (or
    just after it where not zeros): (dev, model, n, pool, kv), n the
    pool's elements and kv its view in kv_shape()."""
    dev = torch.device("cuda", torch.cuda.current_device())
    model = make_model(torch)
    with region("weights", **backup):
        model = model.to(dev)
    n = kv_pool_elems(torch)
    with region("kv_cache"):
        pool = (torch.zeros if zeros else torch.empty)(n, dtype=torch.float32, device=dev)
    if not zeros:
        pool.zero_()
    kv = pool[:LAYERS * 2 * BATCH * MAX_SEQ * DIM].view(kv_shape())
    return dev, model, n, pool, kv


def prompts(torch):
    g = torch.Generator().manual_seed(99)
    return torch.randint(0, VOCAB, (BATCH, PROMPT), generator=g).cuda()


def generate(torch, stepper, kv, between=None):
    """Greedy: feed the prompt, make N1 tokens, run between(), feed every
    token again into a cleared cache (the cache's contents are dropped by a
    pause), make N2 more. Returns (tokens [B, PROMPT+N1+N2], logits)."""
    seq = list(prompts(torch).unbind(1))
    out = []

    def feed():
        kv.zero_()
        lg = None
        for t, tok in enumerate(seq):
            lg = stepper(tok, t)
        return lg

    def make(n, lg):
        for _ in range(n):
            nxt = lg.argmax(-1)
            out.append(lg.float().cpu())
            seq.append(nxt)
            lg = stepper(nxt, len(seq) - 1)
        return lg

    with torch.no_grad():
        make(N1, feed())
        if between is not None:
            between()
        make(N2, feed())
        torch.cuda.synchronize()
    return torch.stack(seq, 1).cpu(), torch.stack(out)


def eager_stepper(torch, model, kv):
    dev = kv.device

    def step(tok, t):
        return model.step(kv, tok, torch.tensor(t, device=dev))
    return step


def compare(torch, name, ref, got):
    (t0, l0), (t1, l1) = ref, got
    diff = (l0 - l1).abs().max().item()
    check(torch.equal(t0, t1) and diff == 0.0, name,
          "%d tokens per sequence equal to the uninterrupted run: %s; logits max |diff| %g"
          % (t1.shape[1], torch.equal(t0, t1), diff))


# Other processes.

def child_env():
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env["PYTHONPATH"] = os.path.join(REPO, "python")
    return env


def run_trainer():
    """A trainer that takes 90% of the free memory, writes it and exits."""
    out = subprocess.run([sys.executable, __file__, "--trainer"], env=child_env(),
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        return {"ok": False, "bytes": 0, "free": 0, "error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def trainer_main():
    import torch
    free, total = torch.cuda.mem_get_info()
    n = int(free * 0.9) // MiB * MiB
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
    x.fill_(0xAB)
    torch.cuda.synchronize()
    ok = bool((x[::16 * MiB] == 0xAB).all().item()) and int(x[-1].item()) == 0xAB
    print(json.dumps({"free": free, "total": total, "bytes": n, "ok": ok}))
    return 0


def preload_child_main():
    """Outside any region: a pool that only the preload library catches."""
    import torch
    pool = torch.empty(4 * GiB, dtype=torch.uint8, device="cuda")
    pool.fill_(7)
    torch.cuda.synchronize()
    print("ready %d %d" % (pool.data_ptr(), pool.numel()), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "check":
            ptr = pool.data_ptr()
            pool.fill_(9)
            torch.cuda.synchronize()
            ok = bool((pool[::MiB] == 9).all().item())
            print("checked %d %s" % (ptr, ok), flush=True)
        elif cmd == "exit":
            return 0
    return 0


def tag_line(ctl):
    return ", ".join("%s %s %s%s" % (t["name"], t["state"], gib(t["bytes"]),
                                     " (paused %s)" % gib(t["paused_bytes"])
                                     if t["paused_bytes"] else "")
                     for t in ctl.status()["tags"])


def tag_of(ctl, name):
    for t in ctl.status()["tags"]:
        if t["name"] == name:
            return t
    return {"name": name, "state": "NONE", "bytes": 0, "paused_bytes": 0, "buffers": 0}


def cycle(torch, ctl, name, pause, resume, expect, extra=None):
    """Pause, run the trainer, resume; check the driver's figures.
    expect: bytes the pause must release at least. extra: (pause, resume)
    of a controller, run next to this process's own."""
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    r = pause()
    rx = extra[0]() if extra else None
    free1 = torch.cuda.mem_get_info()[0]
    released = (r.bytes if r else 0) + (rx.bytes if rx else 0)
    nv = sum(c["free_after"] - c["free_before"] for c in (r.checks if r else []))
    check(r is not None and r.bytes >= expect and free1 - free0 >= released - SLACK,
          name + " pause", "released %s (%s backed up) in %.1f ms; driver free %s -> %s "
          "(+%s; daemon's NVML +%s); %s" % (
              gib(released), gib(r.backup_bytes if r else 0),
              (r.elapsed_us if r else 0) / 1e3, gib(free0), gib(free1), gib(free1 - free0),
              gib(nv), tag_line(ctl)))
    t = run_trainer()
    check(t["ok"] and t["bytes"] > free0, name + " trainer",
          "a separate process saw %s free and wrote %s (more than the %s free before the "
          "pause)%s" % (gib(t["free"]), gib(t["bytes"]), gib(free0),
                       "" if t["ok"] else ": " + t.get("error", "bad contents")))
    if extra:
        extra[1]()
    r2 = resume()
    free2 = torch.cuda.mem_get_info()[0]
    check(r2 is not None and free1 - free2 >= released - SLACK, name + " resume",
          "took %s again in %.1f ms; driver free %s -> %s; %s" % (
              gib(free1 - free2), (r2.elapsed_us if r2 else 0) / 1e3, gib(free1), gib(free2),
              tag_line(ctl)))


def weights_kept(torch, name, model, saved, ptrs):
    same = all(torch.equal(p.detach().cpu(), saved[k]) for k, p in model.state_dict().items())
    ptr_same = all(p.data_ptr() == ptrs[k] for k, p in model.state_dict().items())
    check(same and ptr_same, name, "%d weight tensors equal after resume: %s; "
          "same data_ptr(): %s" % (len(saved), same, ptr_same))


def snapshot(model):
    sd = model.state_dict()
    return {k: v.detach().cpu().clone() for k, v in sd.items()}, {k: v.data_ptr() for k, v in sd.items()}


# Phases.

def phase_torch(sock):
    import torch
    import gpumem.torch as gt
    from gpumem.torch_memory_saver import preload_library_path
    ctl = gpumem.connect(sock, name="torch-check-ctl", role="controller")
    preload = preload_library_path()
    child = None
    if not os.path.exists(preload):
        check(False, "preload", "no %s" % preload)
    else:
        env = child_env()
        env.update(LD_PRELOAD=preload, GPUMEM_DEFAULT_TAG="compress_state",
                   GPUMEM_NAME="preload-pool", GPUMEM_SOCKET=sock)
        child = subprocess.Popen([sys.executable, __file__, "--preload-child"], env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = child.stdout.readline().split()
        st = ctl.status()
        sess = [s for s in st["sessions"] if s["name"] == "preload-pool"]
        t = tag_of(ctl, "compress_state")
        ok = len(ready) == 3 and ready[0] == "ready" and t["bytes"] >= 4 * GiB and sess
        check(ok, "preload", "a torch.empty(4 GiB) outside any region, in a process started "
              "with LD_PRELOAD=%s: tag compress_state %s, session %s"
              % (os.path.basename(preload), gib(t["bytes"]),
                 sess[0]["name"] + " " + gib(sess[0]["bytes"]) if sess else "missing"))
        if not ok:
            child.stdin.close()
            child.wait()
            child = None

    gt.init(name="torch-check")
    dev, model, n, pool, kv = model_and_kv(torch, gt.region, {"backup": True}, zeros=False)
    w, k = tag_of(ctl, "weights"), tag_of(ctl, "kv_cache")
    check(w["bytes"] >= sum(p.numel() * 4 for p in model.parameters()) and k["bytes"] >= n * 4,
          "regions", "weights %s (backup), kv_cache %s: daemon memory tagged by region"
          % (gib(w["bytes"]), gib(k["bytes"])))
    step = eager_stepper(torch, model, kv)
    ref = generate(torch, step, kv)
    saved, ptrs = snapshot(model)
    kv_ptr = pool.data_ptr()

    extra = None
    if child is not None:
        extra = (lambda: ctl.pause("compress_state"), lambda: ctl.resume("compress_state"))
    got = generate(torch, step, kv, lambda: cycle(
        torch, ctl, "own", gt.pause, gt.resume, n * 4, extra))
    compare(torch, "generation", ref, got)
    weights_kept(torch, "weights", model, saved, ptrs)
    check(pool.data_ptr() == kv_ptr, "kv address", "kv_cache data_ptr 0x%x before and 0x%x "
          "after" % (kv_ptr, pool.data_ptr()))
    if child is not None:
        child.stdin.write("check\n")
        child.stdin.flush()
        ans = child.stdout.readline().split()
        check(len(ans) == 3 and ans[1] == ready[1] and ans[2] == "True", "preload resume",
              "the preload process's pool at the same address (%s) and writable: %s"
              % (ans[1:2], ans[2:3]))
        child.stdin.write("exit\n")
        child.stdin.flush()
        check(child.wait(timeout=60) == 0, "preload exit", "status %s" % child.returncode)

    nesting(torch, gt, ctl, dev)

    # The cache: freed blocks stay in the region's pool until empty_cache().
    # step holds kv (a view of pool) too.
    before = tag_of(ctl, "kv_cache")["bytes"]
    del kv, pool, step
    cached = tag_of(ctl, "kv_cache")["bytes"]
    back = gt.empty_cache("kv_cache")
    after = tag_of(ctl, "kv_cache")["bytes"]
    check(cached == before and before - after >= n * 4 - SLACK, "empty_cache",
          "kv_cache %s, still %s once the pool's tensors were freed (cached by PyTorch), %s "
          "after empty_cache() (trim handed back %s)"
          % (gib(before), gib(cached), gib(after), gib(back)))
    keep = [model]
    del model
    shutdown_check(torch, gt, ctl, ["weights", "kv_cache", "nest_outer", "nest_inner",
                                    "nest_graph"], keep)
    ctl.close()


def shutdown_check(torch, gt, ctl, tags, keep):
    """Refused while the tensors in keep (the last references to them)
    live; once they are gone, empty_cache() gives every byte of the tags
    back and shutdown() works."""
    try:
        gt.shutdown()
        refused = "not refused"
    except RuntimeError as e:
        refused = "refused (%s...)" % str(e)[:60]
    keep.clear()
    import gc
    gc.collect()
    torch.cuda.synchronize()
    # cuBLAS keeps a workspace per stream, made on first use: one made in
    # a capture sits in the graph's pool.
    getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
    gt.empty_cache()
    left = {t: tag_of(ctl, t)["bytes"] for t in tags}
    try:
        gt.shutdown()
        done = "shut down"
    except RuntimeError as e:
        done = "shutdown failed: %s" % e
    check(refused.startswith("refused") and not any(left.values()) and done == "shut down",
          "shutdown", "with tensors live: %s; after they went and empty_cache(): %s; %s"
          % (refused, ", ".join("%s %s" % (t, gib(b)) for t, b in left.items()), done))


def nesting(torch, gt, ctl, dev):
    """Regions inside regions, disable() and a capture inside them: each
    allocation in the pool of the innermost block, each segment with its
    tag, and no pool destroyed under an open block (PyTorch aborts then)."""
    from gpumem.torch_memory_saver import torch_memory_saver as tms
    size = 32 * MiB

    def pool_of(t):
        p = t.data_ptr()
        for name in ("nest_outer", "nest_inner"):
            for sg in torch.cuda.memory_snapshot(gt.mem_pool(name).id):
                if sg["address"] <= p < sg["address"] + sg["total_size"]:
                    return name
        for sg in torch.cuda.memory_snapshot(g.pool()):
            if sg["address"] <= p < sg["address"] + sg["total_size"]:
                return "graph"
        return "torch"

    g = torch.cuda.CUDAGraph()
    with gt.region("nest_outer"):
        a = torch.empty(size, dtype=torch.uint8, device=dev)
        with gt.region("nest_inner"):
            b = torch.empty(size, dtype=torch.uint8, device=dev)
            with tms.disable():
                c = torch.empty(size, dtype=torch.uint8, device=dev)
            x = torch.ones(size // 4, device=dev)
            with gt.cuda_graph(g, tag="nest_graph"):
                y = x * 2
            z = torch.empty(size, dtype=torch.uint8, device=dev)
        d = torch.empty(size, dtype=torch.uint8, device=dev)
        with gt.region("nest_inner"):
            with gt.region("nest_outer"):
                e = torch.empty(size, dtype=torch.uint8, device=dev)
    g.replay()
    torch.cuda.synchronize()
    got = {k: pool_of(t) for k, t in dict(a=a, b=b, c=c, x=x, y=y, z=z, d=d, e=e).items()}
    want = dict(a="nest_outer", b="nest_inner", c="torch", x="nest_inner", y="graph",
                z="nest_inner", d="nest_outer", e="nest_outer")
    tags = {t: tag_of(ctl, t)["bytes"] for t in ("nest_outer", "nest_inner", "nest_graph")}
    ok = (got == want and bool((y == 2).all().item()) and tags["nest_outer"] >= 3 * size
          and tags["nest_inner"] >= 2 * size and tags["nest_graph"] > 0
          and gpumem.thread_tag() == (None, 0))
    check(ok, "nesting", "pools %s; tags %s" % (
        " ".join("%s:%s%s" % (k, v, "" if v == want[k] else "(want %s)" % want[k])
                 for k, v in got.items()),
        ", ".join("%s %s" % (t, gib(b)) for t, b in tags.items())))


def capture(torch, model, kv, graph_ctx):
    """Warm up and capture one decode step; returns the stepper."""
    dev = kv.device
    static_tok = torch.zeros(BATCH, dtype=torch.long, device=dev)
    static_pos = torch.zeros((), dtype=torch.long, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(3):
            model.step(kv, static_tok, static_pos)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), graph_ctx(g):
        static_out = model.step(kv, static_tok, static_pos)

    def step(tok, t):
        static_tok.copy_(tok)
        static_pos.fill_(t)
        g.replay()
        return static_out.clone()
    return g, step


def phase_graph(sock):
    import torch
    import gpumem.torch as gt
    ctl = gpumem.connect(sock, name="torch-check-ctl", role="controller")
    gt.init(name="torch-check-graph")
    dev, model, n, pool, kv = model_and_kv(torch, gt.region, {"backup": True})
    g, gstep = capture(torch, model, kv, lambda g: gt.cuda_graph(g, tag="cuda_graph"))
    t = tag_of(ctl, "cuda_graph")
    check(t["bytes"] > 0, "capture", "graph pool in daemon memory: tag cuda_graph %s in %d "
          "buffers" % (gib(t["bytes"]), t["buffers"]))
    estep = eager_stepper(torch, model, kv)
    with torch.no_grad():
        tok = prompts(torch)[:, 0]
        kv.zero_()
        e = estep(tok, 0)
        kv.zero_()
        r = gstep(tok, 0)
    check(torch.allclose(e, r, atol=1e-4, rtol=1e-4), "replay",
          "graph step vs eager step: max |diff| %g" % (e - r).abs().max().item())
    ref = generate(torch, gstep, kv)
    got = generate(torch, gstep, kv, lambda: cycle(
        torch, ctl, "own", gt.pause, gt.resume, n * 4))
    compare(torch, "graph generation", ref, got)
    keep = [model]
    del g, gstep, estep, kv, pool, model
    shutdown_check(torch, gt, ctl, ["weights", "kv_cache", "cuda_graph"], keep)
    ctl.close()


def phase_tms(sock, preload):
    import torch
    from gpumem.torch_memory_saver import torch_memory_saver as tms
    os.environ["GPUMEM_SOCKET"] = sock
    ctl = gpumem.connect(sock, name="torch-check-ctl", role="controller")
    if preload:
        check(tms.hook_mode == "preload", "hook_mode", "default %r with the preload library "
              "loaded" % tms.hook_mode)
    else:
        tms.hook_mode = "torch"
    dev, model, n, pool, kv = model_and_kv(torch, tms.region, {"enable_cpu_backup": True})

    # disable(): allocations inside are not the region's.
    import gpumem.torch as gt
    kv0, d0 = tag_of(ctl, "kv_cache")["bytes"], tag_of(ctl, "default")["bytes"]
    a0 = gt.client().pool_stats()["allocated_bytes"]
    with tms.region("kv_cache"):
        with tms.disable():
            x = torch.empty(256 * MiB, dtype=torch.uint8, device=dev)
        y = torch.empty(256 * MiB, dtype=torch.uint8, device=dev)
    kv_grew = tag_of(ctl, "kv_cache")["bytes"] - kv0
    d_grew = tag_of(ctl, "default")["bytes"] - d0
    a_grew = gt.client().pool_stats()["allocated_bytes"] - a0
    if preload:
        # Every cudaMalloc is the preload library's: x has the default tag.
        check(kv_grew >= 256 * MiB and d_grew >= 256 * MiB, "disable",
              "256 MiB in the region: kv_cache +%d MiB; 256 MiB under disable(): default "
              "+%d MiB" % (kv_grew >> 20, d_grew >> 20))
    else:
        check(kv_grew >= 256 * MiB and 256 * MiB <= a_grew < 512 * MiB and d_grew == 0,
              "disable", "256 MiB in the region and 256 MiB under disable(): kv_cache +%d MiB, "
              "gpumem allocations +%d MiB (PyTorch's own allocator served the other)"
              % (kv_grew >> 20, a_grew >> 20))
    del x, y

    # Captured inside a region (its static inputs are the region's), as
    # engines that wrap their graph runner in a region do.
    with tms.region("weights", enable_cpu_backup=True):
        g, gstep = capture(torch, model, kv, lambda g: tms.cuda_graph(
            g, pool=torch.cuda.graph_pool_handle(), tag="cuda_graph"))
    check(tag_of(ctl, "cuda_graph")["bytes"] > 0, "capture", "tag cuda_graph %s"
          % gib(tag_of(ctl, "cuda_graph")["bytes"]))
    with torch.no_grad():
        tok = prompts(torch)[:, 0]
        kv.zero_()
        g_before = gstep(tok, 0)

    # A partial pause: only kv_cache.
    r = tms.pause("kv_cache")
    st = (tag_of(ctl, "kv_cache")["state"], tag_of(ctl, "weights")["state"])
    tms.resume("kv_cache")
    check(r is not None and r.bytes >= n * 4 and st == ("PAUSED", "ACTIVE"), "pause tag",
          "pause('kv_cache'): %s released; kv_cache %s, weights %s"
          % (gib(r.bytes if r else 0), st[0], st[1]))

    step = eager_stepper(torch, model, kv)
    ref = generate(torch, step, kv)
    saved, ptrs = snapshot(model)

    def between():
        cycle(torch, ctl, "pause()", tms.pause, tms.resume, n * 4)
        if preload:
            d = tag_of(ctl, "default")
            check(d["state"] == "ACTIVE", "outside regions", "tag default (allocations "
                  "outside regions, caught by the preload library) %s, %s: pause() left it"
                  % (d["state"], gib(d["bytes"])))
    got = generate(torch, step, kv, between)
    compare(torch, "generation", ref, got)
    weights_kept(torch, "weights", model, saved, ptrs)
    with torch.no_grad():
        kv.zero_()
        g_after = gstep(tok, 0)
    check(torch.equal(g_before, g_after), "graph", "a graph captured by cuda_graph() replays "
          "the same logits after pause() and resume(): %s" % torch.equal(g_before, g_after))
    ctl.close()


PHASES = ("torch", "graph", "tms", "tms-preload")


def phase_main(name, sock):
    global phase_name
    phase_name = name
    try:
        if name == "torch":
            phase_torch(sock)
        elif name == "graph":
            phase_graph(sock)
        else:
            phase_tms(sock, preload=(name == "tms-preload"))
    except Exception as e:  # a failure, not a crash of the whole run
        import traceback
        traceback.print_exc()
        check(False, "error", "%s: %s" % (type(e).__name__, e))
    return 1 if failures else 0


def driver(gpumemd):
    try:
        import torch
    except ImportError as e:
        print("SKIP torch: PyTorch is not installed here (%s)" % e)
        return 0
    if not torch.cuda.is_available():
        print("SKIP torch: torch %s sees no CUDA device" % torch.__version__)
        return 0
    print("torch %s, CUDA %s, %s" % (torch.__version__, torch.version.cuda,
                                      torch.cuda.get_device_name(0)), flush=True)
    d = tempfile.mkdtemp(prefix="gpumem-torch.")
    sock = os.path.join(d, "sock")
    log = os.path.join(d, "log")
    daemon = start_gpumemd([gpumemd, "--backend", "cuda", "--socket", sock], sock, log)
    from gpumem.torch_memory_saver import preload_library_path
    for name in PHASES:
        env = child_env()
        env["GPUMEM_SOCKET"] = sock
        if name == "tms-preload":
            env["LD_PRELOAD"] = preload_library_path()
        rc = subprocess.call([sys.executable, __file__, "--phase", name, sock], env=env,
                             timeout=900)
        check(rc == 0, "phase " + name, "exit status %d" % rc)
    daemon.terminate()
    check(daemon.wait() == 0, "daemon exit", "status %s on SIGTERM" % daemon.returncode)
    if failures:
        with open(log) as f:
            sys.stdout.write(f.read()[-20000:])
    return 1 if failures else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--trainer"]:
        sys.exit(trainer_main())
    if sys.argv[1:2] == ["--preload-child"]:
        sys.exit(preload_child_main())
    if sys.argv[1:2] == ["--phase"]:
        sys.exit(phase_main(sys.argv[2], sys.argv[3]))
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(driver(sys.argv[1]))
