"""Trainer offload through gpumem.torch_memory_saver in preload mode, as
Megatron under slime or miles runs it: TMS_INIT_ENABLE=1 and
TMS_INIT_ENABLE_CPU_BACKUP=1, so every allocation of the process, made
before and outside any region, is paused by pause() with its contents.

A child process under LD_PRELOAD builds a model and Adam's state, runs a
forward and backward pass, copies every parameter and optimizer tensor to
the host, pauses, works inside disable(), resumes, and must find every
tensor as it was and compute the same loss; get_cpu_backup reads a
paused weight both ways (pinned, pageable and disk backups). Judged by the driver's free
figure (torch.cuda.mem_get_info) in the child. Skips (exit 0) without
torch with CUDA.

    python3 tests/gpu/tms_trainer.py build/bin
"""
import json
import os
import subprocess
import sys
import tempfile

from gpucheck import start_gpumemd

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20
GiB = 1 << 30

TRAINER = r'''
import json, time, torch
import gpumem
from gpumem.torch_memory_saver import torch_memory_saver as tms

def held():
    """What the default tag's backups hold, by the daemon: host memory
    (pinned and pageable) and disk."""
    with gpumem.connect(name="look", role="controller") as ctl:
        tags = [t for t in ctl.status()["tags"] if t["name"] == "default"]
        return (sum(t["backup_pinned_bytes"] + t["backup_pageable_bytes"] for t in tags),
                sum(t["backup_disk_bytes"] for t in tags))

def pinned():
    """Bytes the default tag's backups hold, in host memory or on disk."""
    return sum(held())

def used():
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free

torch.manual_seed(0)
torch.zeros(1, device="cuda")
out = {"context": used()}
# About 1 GiB of weights, 2 GiB of Adam's moments, outside any region.
model = torch.nn.Sequential(*[torch.nn.Linear(8192, 8192, bias=False) for _ in range(4)]).cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
x = torch.randn(2048, 8192, device="cuda")

def train_step():
    opt.zero_grad(set_to_none=False)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss.item()

train_step()
with torch.no_grad():
    loss = model(x).square().mean().item()
tensors = list(model.parameters()) + [p.grad for p in model.parameters()]
tensors += [t for s in opt.state.values() for t in s.values() if t.is_cuda]
saved = [t.detach().cpu().clone() for t in tensors]
out["trained"] = used()
t0 = time.monotonic()
r = tms.pause()
out["pause_ms"] = (time.monotonic() - t0) * 1000
out["pinned_paused"] = pinned()
out["host_paused"], out["disk_paused"] = held()
out["paused_bytes"] = r.bytes
out["paused"] = used()
w = model[0].weight
try:
    copy, view = tms.get_cpu_backup(w), tms.get_cpu_backup(w, zero_copy=True)
    out["backup_copy"] = copy is not None and torch.equal(copy, saved[0])
    out["backup_view"] = view is not None and torch.equal(view, saved[0])
    del view
except gpumem.Error as e:
    out["backup_copy"] = out["backup_view"] = "refused: %s" % e
with tms.disable():
    y = torch.full((1 << 30,), 53, dtype=torch.uint8, device="cuda")
    out["disabled_mean"] = y.float().mean().item()
    out["in_disable"] = used()
    del y
out["after_disable"] = used()
t0 = time.monotonic()
tms.resume()
out["resume_ms"] = (time.monotonic() - t0) * 1000
out["pinned_resumed"] = pinned()
out["resumed"] = used()
out["backup_after_resume"] = tms.get_cpu_backup(w) is None
out["same_tensors"] = all(torch.equal(t.cpu(), s) for t, s in zip(tensors, saved))
with torch.no_grad():
    out["same_loss"] = model(x).square().mean().item() == loss
train_step()  # training goes on
print(json.dumps(out))
'''

failures = 0


def check(ok: bool, name: str, detail: str) -> None:
    """Print one PASS or FAIL line."""
    global failures
    failures += not ok
    print("%s tms trainer %s: %s" % ("PASS" if ok else "FAIL", name, detail), flush=True)


def run_trainer(child: dict, how: str) -> None:
    """Run TRAINER in a child with the environment child; check its figures."""
    r = subprocess.run([sys.executable, "-c", TRAINER], env=child, capture_output=True,
                       text=True, timeout=300)
    if r.returncode != 0:
        check(False, how + ": runs", "exit %d: %s" % (r.returncode, r.stderr[-2000:]))
        return
    m = json.loads(r.stdout.strip().splitlines()[-1])
    held = m["trained"] - m["context"]
    check(m["paused_bytes"] >= 3 * GiB, how + ": pause() covers what was allocated outside regions",
          "%.3f GiB paused of %.3f GiB held" % (m["paused_bytes"] / GiB, held / GiB))
    check(m["paused"] <= m["context"] + 200 * MiB, how + ": memory used falls to the context",
          "used %.0f MiB after the context, %.0f MiB trained, %.0f MiB paused"
          % (m["context"] / MiB, m["trained"] / MiB, m["paused"] / MiB))
    check(m["disabled_mean"] == 53 and m["in_disable"] >= m["paused"] + GiB - 64 * MiB
          and m["after_disable"] <= m["paused"] + 10 * MiB,
          how + ": disable() works while paused and gives its memory back",
          "mean %s; %.0f MiB inside, %.0f MiB after"
          % (m["disabled_mean"], m["in_disable"] / MiB, m["after_disable"] / MiB))
    check(abs(m["resumed"] - m["trained"]) <= 64 * MiB, how + ": resume() takes it again",
          "%.0f MiB against %.0f MiB trained" % (m["resumed"] / MiB, m["trained"] / MiB))
    check(m["backup_copy"] is True and m["backup_view"] is True and m["backup_after_resume"],
          how + ": get_cpu_backup reads a paused weight (copy and zero_copy)",
          "copy %s, view %s, None after resume %s"
          % (m["backup_copy"], m["backup_view"], m["backup_after_resume"]))
    disk = child.get("TMS_INIT_ENABLE_DISK_BACKUP") == "1"
    if disk:
        check(m["host_paused"] == 0 and m["disk_paused"] >= m["paused_bytes"],
              how + ": while paused the backups are on disk, none in host memory",
              "%.3f GiB on disk, %.3f GiB in host memory"
              % (m["disk_paused"] / GiB, m["host_paused"] / GiB))
    check(m["same_tensors"] and m["same_loss"], how + ": the same weights, moments and loss",
          "tensors %s, loss %s" % (m["same_tensors"], m["same_loss"]))
    release = child.get("TMS_RETAIN_CPU_BACKUP") == "0" or disk
    kept = m["pinned_resumed"] == (0 if release else m["pinned_paused"])
    check(m["pinned_paused"] >= m["paused_bytes"] and kept,
          how + ": the backups' %s is %s after the resume"
          % ("disk" if disk else "host memory", "let go of" if release else "kept"),
          "%.3f GiB while paused, %.3f GiB after; pause %.0f ms, resume %.0f ms"
          % (m["pinned_paused"] / GiB, m["pinned_resumed"] / GiB, m["pause_ms"], m["resume_ms"]))


def main() -> int:
    bindir = sys.argv[1] if len(sys.argv) > 1 else "build/bin"
    try:
        import torch
    except ImportError:
        print("tms trainer: skipped, no torch")
        return 0
    if not torch.cuda.is_available():
        print("tms trainer: skipped, torch has no CUDA")
        return 0
    d = tempfile.mkdtemp()
    sock = os.path.join(d, "sock")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    backups = os.path.join(d, "backups")
    os.mkdir(backups, 0o700)
    daemon = start_gpumemd([os.path.join(bindir, "gpumemd"), "--backend", "cuda", "--socket", sock,
                            "--backup-dir", backups], sock, os.path.join(d, "log"), env=env)
    child = dict(env, GPUMEM_SOCKET=sock, TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1",
                 PYTHONPATH=os.path.join(REPO, "python"),
                 GPUMEM_LIB=os.path.join(os.path.dirname(bindir), "lib", "libgpumem.so.1"),
                 LD_PRELOAD=os.path.join(os.path.dirname(bindir), "lib", "libgpumem_preload.so"))
    try:
        # The worker copies its backups (the default), then the daemon does
        # (the backup is then handed for reading by a BackupRequest).
        for how, extra in (("owner copies", {}), ("daemon copies", {"GPUMEM_DAEMON_COPIES": "1"}),
                           ("retain_cpu_backup off", {"TMS_RETAIN_CPU_BACKUP": "0"}),
                           ("cpu_backup_backend mmap", {"TMS_INIT_CPU_BACKUP_BACKEND": "mmap"}),
                           ("disk backup", {"TMS_INIT_ENABLE_DISK_BACKUP": "1",
                                            "TMS_DISK_BACKUP_DIR": backups})):
            run_trainer(dict(child, **extra), how)
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
