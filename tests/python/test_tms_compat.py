"""gpumem.torch and the torch_memory_saver-compatible module, the parts that
need no PyTorch, against a real gpumemd on the host backend.

Allocations are made through gpumem_torch_alloc, the C entry point that
PyTorch's pluggable allocator calls inside a region, with the thread tag
a region sets (on the host backend the memory is host memory, so the
test can read and write it)."""

import ctypes
import os
import subprocess
import sys
import threading
import warnings

import pytest

from conftest import BUILD, REPO, wait_for
from faketorch import FakeTorch

import gpumem
import gpumem.torch as gt
from gpumem import torch_memory_saver as tms_module
from gpumem.torch_memory_saver import TorchMemorySaver

MiB = 1 << 20


def lib():
    """libgpumem as PyTorch's CUDAPluggableAllocator loads it."""
    so = ctypes.CDLL(gpumem.library_path())
    so.gpumem_torch_alloc.restype = ctypes.c_void_p
    so.gpumem_torch_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    so.gpumem_torch_free.restype = None
    so.gpumem_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                     ctypes.c_void_p]
    return so


def torch_alloc(tag, size, backup=False, device=0):
    """What the allocator does for PyTorch inside region(tag, backup)."""
    prev = gpumem.thread_tag()
    gpumem.set_thread_tag(tag, backup=backup)
    try:
        p = lib().gpumem_torch_alloc(size, device, None)
    finally:
        if prev[0] is None:
            gpumem.set_thread_tag(None)
        else:
            gpumem.set_thread_tag(prev[0], backup=bool(prev[1] & gpumem.FLAG_BACKUP))
    assert p, "gpumem_torch_alloc refused: %s" % gpumem.thread_tag()
    return p


def tag_status(ctl, name):
    for t in ctl.status()["tags"]:
        if t["name"] == name:
            return t
    raise AssertionError("no tag %s in status" % name)


def device_free(ctl, device=0):
    return ctl.status()["devices"][device]["free"]


def run_python(code, env_extra=None):
    """Run code in a fresh python3 with this checkout's package and library."""
    env = dict(os.environ)
    env["PYTHONPATH"] = "%s:%s" % (REPO / "python", REPO / "tests" / "python")
    env["GPUMEM_LIB"] = str(BUILD / "lib" / "libgpumem.so.1")
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.fixture
def saver(worker):
    """A TorchMemorySaver whose default client is the test's worker."""
    gt.init(worker)
    try:
        yield TorchMemorySaver()
    finally:
        gt.shutdown()
        gpumem.set_thread_tag(None)


@pytest.fixture
def fake_torch(monkeypatch):
    """faketorch's stand-in as the process's torch, for disable()."""
    ft = FakeTorch()
    monkeypatch.setitem(sys.modules, "torch", ft)
    return ft


# Without PyTorch.

NO_TORCH = "import sys; sys.modules['torch'] = None\n"


def test_modules_import_without_torch():
    r = run_python(NO_TORCH + (
        "import gpumem.torch, gpumem.torch_memory_saver as m\n"
        "from gpumem.torch_memory_saver import torch_memory_saver, configure_subprocess\n"
        "from gpumem import torch_memory_saver as pkg\n"
        "assert pkg.torch_memory_saver is torch_memory_saver\n"
        "assert torch_memory_saver.enabled is True\n"
        "assert sys.modules['torch'] is None\n"
        "print('ok')\n"))
    assert r.returncode == 0, r.stderr
    assert r.stdout == "ok\n"


@pytest.mark.parametrize("call", [
    "torch_memory_saver.region('kv_cache')",
    "torch_memory_saver.region(tag='weights', enable_cpu_backup=True)",
    "torch_memory_saver.cuda_graph(object())",
    "gt.region('kv_cache')",
    "gt.cuda_graph(object())",
])
def test_region_without_torch_is_an_import_error(call, daemon):
    r = run_python(NO_TORCH + (
        "import gpumem.torch as gt\n"
        "from gpumem.torch_memory_saver import torch_memory_saver\n"
        "try:\n"
        "    with %s:\n"
        "        pass\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n") % call, {"GPUMEM_SOCKET": daemon.sock})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ImportError: gpumem.torch needs PyTorch"), r.stdout


# Arguments.

def test_arguments_are_checked_first(fake_torch):
    s = TorchMemorySaver()
    for bad, exc in [((5,), TypeError), (("kv cache",), ValueError), (("",), ValueError)]:
        with pytest.raises(exc):
            with s.region(*bad):
                pass
    with pytest.raises(TypeError):
        with s.region("kv", enable_cpu_backup=1):
            pass
    with pytest.raises(ValueError, match="requires enable_cpu_backup"):
        with s.region("kv", cpu_backup_backend="mmap"):
            pass
    with pytest.raises(ValueError):
        with s.region("kv", enable_cpu_backup=True, cpu_backup_backend="disk"):
            pass
    with pytest.raises(TypeError):
        with s.region("kv", enable_disk_backup="yes"):
            pass
    with pytest.raises(ValueError, match="capture_error_mode"):
        with s.cuda_graph(object(), capture_error_mode="strict"):
            pass
    with pytest.raises(TypeError):
        s.pause(3)
    with pytest.raises(ValueError):
        s.resume("a/b")
    with pytest.raises(TypeError):
        with gt.region("kv", backup="yes"):
            pass
    with pytest.raises(ValueError, match="capture_error_mode"):
        with gt.cuda_graph(object(), capture_error_mode="strict"):
            pass
    with pytest.raises(TypeError):
        gt.pause("kv", missing_ok=1)
    with pytest.raises(TypeError):
        gt.init("socket")
    with pytest.raises(ValueError):
        gt.init(gpumem.Client.__new__(gpumem.Client), socket="x")
    with pytest.raises(TypeError, match="takes a CUDA tensor"):
        s.get_cpu_backup(object())
    with pytest.raises(TypeError, match="zero_copy"):
        s.get_cpu_backup(object(), zero_copy=1)
    with pytest.raises(TypeError):
        s.set_disk_backup_dir(5)


def test_memory_margin_and_retain_cpu_backup():
    s = TorchMemorySaver()
    with pytest.raises(TypeError):
        s.memory_margin_bytes = "1G"
    with pytest.raises(TypeError):
        s.memory_margin_bytes = True
    with pytest.raises(ValueError):
        s.memory_margin_bytes = -1
    with pytest.raises(ValueError):
        s.memory_margin_bytes = 1 << 64
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.memory_margin_bytes = 1 << 30
        assert s.memory_margin_bytes == 1 << 30
        s.memory_margin_bytes = 0
    assert s.retain_cpu_backup is True  # gpumemd's default (TMS_RETAIN_CPU_BACKUP unset)
    s.retain_cpu_backup = False
    assert s.retain_cpu_backup is False
    with pytest.raises(TypeError):
        s.retain_cpu_backup = 1


def daemon_backup_bytes(pid):
    """The kernel's figure of the backup memory a host-backend daemon
    holds: the sizes of its open backup memfds."""
    total = 0
    for fd in os.listdir("/proc/%d/fd" % pid):
        path = "/proc/%d/fd/%s" % (pid, fd)
        try:
            if os.readlink(path).startswith("/memfd:gpumem-backup"):
                total += os.stat(path).st_size
        except OSError:
            pass  # closed meanwhile
    return total


@pytest.mark.parametrize("daemon_copies", [False, True])
def test_backups_that_let_go(make_daemon, fake_torch, monkeypatch, daemon_copies):
    """retain_cpu_backup=False: the backup's host memory exists only while
    paused (status and the daemon's memfds agree), and the contents come
    back each time, whichever side copies."""
    d = make_daemon()
    if daemon_copies:
        monkeypatch.setenv("GPUMEM_DAEMON_COPIES", "1")
    with gpumem.connect(d.sock, name="engine") as w, \
            gpumem.connect(d.sock, name="ctl", role="controller") as ctl:
        gt.init(w)
        try:
            s = TorchMemorySaver()
            s.hook_mode = "torch"
            s.retain_cpu_backup = False
            with s.region("weights", enable_cpu_backup=True):
                t = fake_torch.empty(4 * MiB, device="cuda:0")
            with s.region("kept", enable_cpu_backup=True):
                s.retain_cpu_backup = True
            for round in range(2):
                ctypes.memset(t.data_ptr(), 0x50 + round, 4 * MiB)
                st = tag_status(ctl, "weights")
                assert (st["backup_pinned_bytes"], st["backup_reserved_bytes"]) == (0, 0)
                assert daemon_backup_bytes(d.proc.pid) == 0
                s.pause("weights")
                st = tag_status(ctl, "weights")
                assert st["backup_pinned_bytes"] == st["backup_reserved_bytes"] == st["bytes"]
                assert st["bytes"] >= 4 * MiB
                assert daemon_backup_bytes(d.proc.pid) == st["backup_pinned_bytes"]
                assert ctl.status()["backups"]["reserved"] == st["bytes"]
                s.resume("weights")
                assert ctypes.string_at(t.data_ptr() + 4 * MiB - 1, 1) == bytes([0x50 + round])
                with open("/proc/self/maps") as f:  # nor does the worker keep it mapped
                    assert "/memfd:gpumem-backup" not in f.read()
            st = tag_status(ctl, "weights")
            assert (st["backup_pinned_bytes"], st["backup_reserved_bytes"]) == (0, 0)
            assert daemon_backup_bytes(d.proc.pid) == 0
            del t
        finally:
            gt.shutdown()


def test_memory_margin_is_enforced(saver, worker, controller):
    """memory_margin_bytes: an allocation in a region that would leave less
    than the margin free on its device is refused (PyTorch would raise its
    out-of-memory error), one that leaves enough goes through."""
    free = device_free(controller)
    saver.memory_margin_bytes = free - 2 * MiB  # for the default client: the worker
    with pytest.raises(gpumem.Error) as e:
        worker.alloc("margin", 4 * MiB)
    assert e.value.code_name == "OUT_OF_MEMORY" and "to keep free" in str(e.value)
    b = worker.alloc("margin", 2 * MiB)
    b.free()
    saver.memory_margin_bytes = 0
    b = worker.alloc("margin", 4 * MiB)
    b.free()


def test_controller_cannot_be_the_default_client(controller):
    with pytest.raises(ValueError, match="worker"):
        gt.init(controller)


# Hook modes.

def test_hook_mode_validation():
    s = TorchMemorySaver()
    assert not tms_module.preload_library_loaded()
    assert s.hook_mode == "torch"
    with pytest.raises(TypeError):
        s.hook_mode = None
    with pytest.raises(ValueError, match="'torch' or 'preload'"):
        s.hook_mode = "cuda"
    with pytest.raises(RuntimeError) as e:
        s.hook_mode = "preload"
    msg = str(e.value)
    assert "LD_PRELOAD" in msg and "configure_subprocess" in msg
    assert tms_module.preload_library_path() in msg
    assert s.hook_mode == "torch"
    s.hook_mode = "torch"
    assert s.hook_mode == "torch"


def test_hook_mode_is_fixed_once_started(saver, fake_torch):
    saver.hook_mode = "torch"
    with saver.disable():  # starts the saver
        pass
    saver.hook_mode = "torch"
    with pytest.raises(RuntimeError, match="cannot change"):
        saver.hook_mode = "preload"


def test_hook_mode_preload_when_the_library_is_preloaded(daemon):
    path = tms_module.preload_library_path()
    if not os.path.exists(path):
        pytest.skip("no %s: build it first" % path)
    r = run_python(NO_TORCH + (
        "from gpumem import torch_memory_saver as m\n"
        "s = m.TorchMemorySaver()\n"
        "assert m.preload_library_loaded()\n"
        "assert s.hook_mode == 'preload', s.hook_mode\n"
        "s.hook_mode = 'preload'\n"
        "s.hook_mode = 'torch'\n"
        "s.hook_mode = 'preload'\n"
        "print(s.pause())\n"), {"LD_PRELOAD": path, "GPUMEM_SOCKET": daemon.sock})
    assert r.returncode == 0, r.stderr
    assert r.stdout == "None\n"


def test_preload_mode_uses_the_librarys_default_client(daemon):
    """The preload library allocated before the saver started: the saver
    takes that same client (no second connection), so frees and an
    own-scope pause find those allocations."""
    preload = tms_module.preload_library_path()
    stub = BUILD / "tests" / "libcudart_stub.so"
    if not os.path.exists(preload) or not stub.exists():
        pytest.skip("no %s or %s: build them first (make test)" % (preload, stub))
    r = run_python(NO_TORCH + (
        "import ctypes, os\n"
        "ctypes.CDLL(%r, mode=ctypes.RTLD_GLOBAL)\n"
        "rt = ctypes.CDLL(None)\n"
        "rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]\n"
        "rt.cudaFree.argtypes = [ctypes.c_void_p]\n"
        "p = ctypes.c_void_p()\n"
        "assert rt.cudaMalloc(ctypes.byref(p), 1 << 20) == 0\n"
        "import gpumem, gpumem.torch as gt\n"
        "from faketorch import FakeTorch\n"
        "sys.modules['torch'] = FakeTorch()\n"
        "from gpumem.torch_memory_saver import torch_memory_saver as tms\n"
        "assert tms.hook_mode == 'preload'\n"
        "with tms.disable():\n"
        "    pass\n"
        "c = gt.client()\n"
        "assert c._borrowed and c._c == c._lib.gpumem_default_client()\n"
        "assert c.pool_stats()['allocations'] == 1\n"
        "assert rt.cudaFree(p) == 0\n"
        "assert c.pool_stats()['allocations'] == 0\n"
        "ctl = gpumem.connect(name='ctl', role='controller')\n"
        "print(sorted(x['name'] for x in ctl.status()['sessions']\n"
        "             if x['pid'] == os.getpid() and x['role'] == 'worker'))\n") % str(stub),
        {"LD_PRELOAD": preload, "GPUMEM_SOCKET": daemon.sock, "GPUMEM_NAME": "preloaded"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == "['preloaded']\n"  # one worker session: the library's


def test_configure_subprocess(monkeypatch):
    path = tms_module.preload_library_path()
    assert path.endswith("/libgpumem_preload.so")
    assert os.path.dirname(path) == os.path.dirname(os.path.realpath(gpumem.library_path()))
    monkeypatch.setenv("LD_PRELOAD", "/opt/other.so")
    with tms_module.configure_subprocess():
        assert os.environ["LD_PRELOAD"] == path + ":/opt/other.so"
        child = subprocess.run([sys.executable, "-c",
                                "import os; print(os.environ['LD_PRELOAD'])"],
                               capture_output=True, text=True, timeout=30)
        assert child.stdout.strip() == path + ":/opt/other.so"
    assert os.environ["LD_PRELOAD"] == "/opt/other.so"
    monkeypatch.delenv("LD_PRELOAD")
    with pytest.raises(KeyError):
        with tms_module.configure_subprocess():
            assert os.environ["LD_PRELOAD"] == path
            raise KeyError("inside")
    assert "LD_PRELOAD" not in os.environ
    monkeypatch.setenv("GPUMEM_PRELOAD_LIB", "/elsewhere/libgpumem_preload.so")
    assert tms_module.preload_library_path() == "/elsewhere/libgpumem_preload.so"


# Pause and resume of the process's own buffers.

def test_pause_and_resume_release_own_buffers(daemon, saver, worker, controller, tag):
    import gpumem as g

    kv, weights = tag("kv"), tag("weights")
    p = torch_alloc(kv, 64 * MiB)
    q = torch_alloc(weights, 8 * MiB, backup=True)
    ctypes.memmove(q, b"weights kept", 12)
    ctypes.memset(p, 0x5A, 64 * MiB)
    with g.connect(daemon.sock, name="other-engine") as other:
        theirs = other.alloc(kv, 16 * MiB)
        free0 = device_free(controller)

        r = saver.pause(kv)
        assert r is not None and r.bytes >= 64 * MiB
        t = tag_status(controller, kv)
        assert t["paused_bytes"] >= 64 * MiB and t["mixed"]  # theirs stays active
        assert theirs.mapped
        assert tag_status(controller, weights)["state"] == "ACTIVE"
        assert device_free(controller) - free0 >= 64 * MiB

        assert saver.pause(kv).bytes == 0  # paused already: nothing changes
        saver.resume(kv)
        assert tag_status(controller, kv)["state"] == "ACTIVE"
        assert device_free(controller) == free0
        ctypes.memset(p, 0x33, 64 * MiB)  # mapped again, at the same address
        assert ctypes.string_at(p + 64 * MiB - 4, 4) == b"\x33" * 4

        # Every tag of this process, through gpumem.torch: the other
        # engine's buffer is not this process's.
        r = gt.pause()
        assert r.bytes >= 72 * MiB
        assert tag_status(controller, weights)["state"] == "PAUSED"
        assert theirs.mapped
        gt.resume()
        assert ctypes.string_at(q, 12) == b"weights kept"
        assert tag_status(controller, weights)["state"] == "ACTIVE"
        theirs.free()
    lib().gpumem_torch_free(p, 64 * MiB, 0, None)
    lib().gpumem_torch_free(q, 8 * MiB, 0, None)
    assert gt.empty_cache() >= 0


def test_pause_of_nothing(saver, worker, controller, tag):
    kv = tag("kv")
    p = torch_alloc(kv, 4 * MiB)
    # No region was entered: pause() without a tag has nothing to pause.
    assert saver.pause() is None and saver.resume() is None
    assert tag_status(controller, kv)["state"] == "ACTIVE"
    # A tag this process never used: nothing to do, no error.
    assert saver.pause(tag("never")) is None
    assert saver.resume(tag("never")) is None
    # gpumem.torch says so unless told not to.
    with pytest.raises(gpumem.Error) as e:
        gt.pause(tag("never"))
    assert e.value.code == gpumem.ErrorCode.NOT_FOUND
    assert gt.pause(tag("never"), missing_ok=True) is None
    lib().gpumem_torch_free(p, 4 * MiB, 0, None)


def test_resume_without_room_changes_nothing(make_daemon, tag):
    d = make_daemon()
    kv = tag("kv")
    with gpumem.connect(d.sock, name="engine") as w, \
            gpumem.connect(d.sock, name="ctl", role="controller") as ctl:
        gt.init(w)
        try:
            s = TorchMemorySaver()
            p = torch_alloc(kv, 160 * MiB)
            s.pause(kv)
            with gpumem.connect(d.sock, name="trainer") as trainer:
                hog = trainer.alloc("train", 160 * MiB)
                with pytest.raises(gpumem.Error) as e:
                    s.resume(kv)
                assert e.value.code == gpumem.ErrorCode.OUT_OF_MEMORY
                assert tag_status(ctl, kv)["state"] == "PAUSED"
                hog.free()
            s.resume(kv)
            assert tag_status(ctl, kv)["state"] == "ACTIVE"
            ctypes.memset(p, 1, 160 * MiB)
            lib().gpumem_torch_free(p, 160 * MiB, 0, None)
        finally:
            gt.shutdown()


def test_disable_inside_a_region_reuses_one_pool(saver, fake_torch):
    """Inside an open region no pool can be let go of: disable() then
    keeps one pool per thread and device for the next disable(), and lets
    go of it after the first that ends with no region open."""
    before = len(fake_torch.pools)
    saver.hook_mode = "torch"
    with saver.region("outer"):
        for _ in range(20):
            with saver.disable():
                t = fake_torch.empty(MiB, device="cuda:0")
                del t
        assert len(fake_torch.pools) - before <= 2  # the region's and one disable() pool
    with saver.disable():
        pass
    assert not gt._disable_pools and len(fake_torch.pools) - before <= 1
    # A pool kept by another thread, which then ended, goes with empty_cache.
    def kept():
        with saver.region("outer"):
            with saver.disable():
                pass
    t = threading.Thread(target=kept)
    t.start()
    t.join()
    assert len(gt._disable_pools) == 1
    gt.empty_cache()
    assert not gt._disable_pools


def test_disable_clears_the_thread_tag(saver, fake_torch):
    gpumem.set_thread_tag("outer", backup=True)
    with saver.disable():
        assert gpumem.thread_tag() == (None, 0)
        # The block's allocations go to a pool of its own, let go of after.
        t = fake_torch.empty(MiB, device="cuda:0")
        assert t.pool is not None and t.pool.allocator is None
        pool = t.pool.id
        del t
    assert pool not in fake_torch.pools
    assert gpumem.thread_tag() == ("outer", gpumem.FLAG_BACKUP)
    with pytest.raises(RuntimeError):
        with saver.disable():
            raise RuntimeError("inside")
    assert gpumem.thread_tag() == ("outer", gpumem.FLAG_BACKUP)


def test_init_connects_and_shutdown_closes(daemon, controller, tag):
    c = gt.init(socket=daemon.sock, name="torch-test")
    try:
        assert gt.init() is c and gt.client() is c
        assert any(s["name"] == "torch-test" for s in controller.status()["sessions"])
        kv = tag("kv")
        p = torch_alloc(kv, 2 * MiB)
        assert tag_status(controller, kv)["buffers"] >= 1
        # What PyTorch allocated is live: the client stays.
        with pytest.raises(RuntimeError, match="1 allocations .* are live"):
            gt.shutdown()
        with gpumem.connect(daemon.sock, name="another") as other:
            with pytest.raises(RuntimeError, match="cannot replace its client"):
                gt.init(other)
        assert gt.client() is c and not c.closed
        lib().gpumem_torch_free(p, 2 * MiB, 0, None)
    finally:
        gt.shutdown()
    assert c.closed

    def gone():
        return all(t["name"] != kv or t["buffers"] == 0 for t in controller.status()["tags"])
    wait_for(gone, what="the closed client's buffers to go")


# Trainer offload: the process starts inside a region (TMS_INIT_ENABLE=1).

# The start of a program under the preload library (_preload_env): the
# stand-in runtime loaded, as rt, and no PyTorch.
STUB_PROGRAM = NO_TORCH + r'''
import ctypes, os, sys
ctypes.CDLL(os.environ["STUB"], mode=ctypes.RTLD_GLOBAL)
rt = ctypes.CDLL(None)
rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
rt.cudaFree.argtypes = [ctypes.c_void_p]
MiB = 1 << 20
'''

TRAINER = STUB_PROGRAM + r'''
import zlib

def cuda_malloc(n):
    p = ctypes.c_void_p()
    rc = rt.cudaMalloc(ctypes.byref(p), n)
    if rc:
        raise MemoryError("cudaMalloc: %d" % rc)
    return p.value

# Weights and optimizer state, allocated before any Python of gpumem runs
# and outside any region.
weights, moments = cuda_malloc(16 * MiB), cuda_malloc(32 * MiB)
ctypes.memmove(weights, os.urandom(16 * MiB), 16 * MiB)
ctypes.memset(moments, 0, 32 * MiB)

def step():
    """A forward and backward pass: activations made from the weights,
    their gradient folded into the moments; the loss is a checksum of
    what the pass read and wrote."""
    act = cuda_malloc(8 * MiB)
    ctypes.memmove(act, weights, 8 * MiB)
    grad = zlib.crc32(ctypes.string_at(act, 8 * MiB)).to_bytes(4, "little")
    rt.cudaFree(act)
    ctypes.memmove(moments, grad, 4)
    return zlib.crc32(ctypes.string_at(moments, 32 * MiB),
                      zlib.crc32(ctypes.string_at(weights, 16 * MiB)))

loss = step()

import gpumem
from faketorch import FakeTorch
sys.modules["torch"] = FakeTorch()
from gpumem.torch_memory_saver import torch_memory_saver as tms
ctl = gpumem.connect(name="ctl", role="controller")

def tag(name):
    return next((t for t in ctl.status()["tags"] if t["name"] == name), None)

def device_free():
    return ctl.status()["devices"][0]["free"]

free0 = device_free()
r = tms.pause()
assert r.bytes >= 48 * MiB, r
assert tag("default")["state"] == "PAUSED", tag("default")
assert device_free() - free0 >= 48 * MiB
with tms.disable():
    assert gpumem.thread_tag() == ("disabled", 0)
    scratch = cuda_malloc(8 * MiB)  # work while paused: not in a paused tag
    ctypes.memset(scratch, 7, 8 * MiB)
    assert ctypes.string_at(scratch + 8 * MiB - 1, 1) == b"\x07"
    assert tag("disabled")["state"] == "ACTIVE"
    rt.cudaFree(scratch)
assert tms.pause().bytes == 0  # paused already; "disabled" is left alone
tms.resume()
assert tag("default")["state"] == "ACTIVE"
assert device_free() == free0, (device_free() - free0, ctl.status())
assert step() == loss, "the pass after the resume differs"
print("same")
'''


def _preload_env(daemon, **extra):
    preload = tms_module.preload_library_path()
    stub = BUILD / "tests" / "libcudart_stub.so"
    if not os.path.exists(preload) or not stub.exists():
        pytest.skip("no %s or %s: build them first (make test)" % (preload, stub))
    env = {"LD_PRELOAD": preload, "GPUMEM_SOCKET": daemon.sock, "STUB": str(stub)}
    env.update(extra)
    return env


@pytest.mark.parametrize("names", [("TMS_INIT_ENABLE", "TMS_INIT_ENABLE_CPU_BACKUP"),
                                   ("GPUMEM_INIT_REGION", None),
                                   ("GPUMEM_INIT_REGION", "TMS_INIT_ENABLE_CPU_BACKUP")])
def test_trainer_starts_inside_a_region(make_daemon, names):
    """Weights and optimizer state allocated before and outside any region
    are paused by pause() (memory given back, by the daemon's figure),
    with their contents; work in disable() runs meanwhile; after resume()
    the same pass gives the same loss."""
    init, backup = names
    extra = {init: "1"}
    if backup:
        extra[backup] = "1"
    else:
        extra["GPUMEM_DEFAULT_FLAGS"] = "backup"
    r = run_python(TRAINER, _preload_env(make_daemon(), **extra))
    assert r.returncode == 0, r.stderr
    assert r.stdout == "same\n"


def test_without_the_initial_region_pause_leaves_the_default_tag(make_daemon):
    r = run_python(STUB_PROGRAM + (
        "p = ctypes.c_void_p()\n"
        "assert rt.cudaMalloc(ctypes.byref(p), 1 << 20) == 0\n"
        "from gpumem.torch_memory_saver import torch_memory_saver as tms\n"
        "print(tms.pause())\n"), _preload_env(make_daemon(), TMS_INIT_ENABLE_CPU_BACKUP="1"))
    assert r.returncode == 0, r.stderr
    assert r.stdout == "None\n"


@pytest.mark.parametrize("env,error", [
    ({"TMS_INIT_ENABLE": "maybe"}, "TMS_INIT_ENABLE='maybe': use 1, true, yes"),
    ({"TMS_INIT_ENABLE_DISK_BACKUP": "maybe"}, "TMS_INIT_ENABLE_DISK_BACKUP='maybe'"),
    ({"TMS_DISK_BACKUP_DIR": "/tmp"}, "this gpumemd keeps no disk backups; start it with "
                                      "--backup-dir /tmp"),
    ({"TMS_DISK_BACKUP_CHUNK_MB": "-3"}, "TMS_DISK_BACKUP_CHUNK_MB='-3': a positive number"),
    ({"TMS_INIT_CPU_BACKUP_BACKEND": "cuda"}, "use 'pinned' or 'mmap'"),
])
def test_torch_memory_savers_variables_are_checked(daemon, env, error):
    r = run_python(NO_TORCH + (
        "from gpumem.torch_memory_saver import torch_memory_saver as tms\n"
        "tms.hook_mode = 'torch'\n"
        "try:\n"
        "    tms.pause()\n"
        "except (ValueError, NotImplementedError) as e:\n"
        "    print(e)\n"), dict(env, GPUMEM_SOCKET=daemon.sock))
    assert r.returncode == 0, r.stderr
    assert error in r.stdout, r.stdout


def test_the_initial_region_needs_preload_mode(daemon):
    r = run_python(NO_TORCH + (
        "from gpumem.torch_memory_saver import torch_memory_saver as tms\n"
        "try:\n"
        "    tms.pause()\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"), {"GPUMEM_SOCKET": daemon.sock, "TMS_INIT_ENABLE": "1"})
    assert r.returncode == 0, r.stderr
    assert "needs hook_mode 'preload'" in r.stdout and "LD_PRELOAD=" in r.stdout


def test_a_bad_initial_region_variable_fails_the_allocation(make_daemon):
    """libgpumem reads TMS_INIT_ENABLE(_CPU_BACKUP) itself, before any Python:
    a value it does not know fails the allocation (the runtime's
    out-of-memory error), saying why, and allocates nothing."""
    r = run_python(STUB_PROGRAM + (
        "p = ctypes.c_void_p()\n"
        "print(rt.cudaMalloc(ctypes.byref(p), 1 << 20))\n"
        "rt.gpumem_last_error.restype = ctypes.c_char_p\n"
        "print(rt.gpumem_last_error().decode())\n"),
        _preload_env(make_daemon(), TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="sure"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("2\nTMS_INIT_ENABLE_CPU_BACKUP: 'sure' is not 1"), r.stdout


def test_an_mmap_backup_is_pageable(make_daemon, fake_torch):
    """cpu_backup_backend="mmap": the backup is the daemon's pageable
    memory (status says so), the daemon copies it, and the contents come
    back; read while paused, it is copied into memory of the reader's."""
    d = make_daemon()
    with gpumem.connect(d.sock, name="engine") as w, \
            gpumem.connect(d.sock, name="ctl", role="controller") as ctl:
        gt.init(w)
        try:
            s = TorchMemorySaver()
            s.hook_mode = "torch"
            with s.region("weights", enable_cpu_backup=True, cpu_backup_backend="mmap"):
                t = fake_torch.empty(4 * MiB, device="cuda:0")
            ctypes.memset(t.data_ptr(), 0x77, 4 * MiB)
            st = tag_status(ctl, "weights")
            assert st["backup_reserved_bytes"] == 0
            s.pause("weights")
            st = tag_status(ctl, "weights")
            assert st["backup_pageable_bytes"] == st["bytes"] >= 4 * MiB
            assert st["backup_pinned_bytes"] == 0
            # read while paused: copied into memory of this process
            assert w.backup_read(t.data_ptr(), 16) == b"\x77" * 16
            assert w.backup_view(t.data_ptr() + 4 * MiB - 16, 16).tobytes() == b"\x77" * 16
            s.resume("weights")
            assert ctypes.string_at(t.data_ptr() + 4 * MiB - 1, 1) == b"\x77"
            del t
        finally:
            gt.shutdown()


def test_a_disk_backup_is_in_the_daemons_backup_dir(make_daemon, fake_torch, tmp_path):
    """enable_disk_backup=True: paused, the backup is in the daemon's
    --backup-dir (status says so, no host memory holds it), reads from
    there while paused, and the contents come back; set_disk_backup_dir takes that directory and
    names it when given another."""
    backups = tmp_path / "backups"
    backups.mkdir(mode=0o700)
    d = make_daemon("--backup-dir", str(backups))
    with gpumem.connect(d.sock, name="engine") as w, \
            gpumem.connect(d.sock, name="ctl", role="controller") as ctl:
        gt.init(w)
        try:
            s = TorchMemorySaver()
            s.hook_mode = "torch"
            s.set_disk_backup_dir(str(backups))
            with pytest.raises(ValueError, match="its own --backup-dir, %s" % backups):
                s.set_disk_backup_dir(str(tmp_path))
            with s.region("weights", enable_disk_backup=True):
                t = fake_torch.empty(4 * MiB, device="cuda:0")
            ctypes.memset(t.data_ptr(), 0x5d, 4 * MiB)
            s.pause("weights")
            st = tag_status(ctl, "weights")
            assert st["backup_disk_bytes"] == st["bytes"] >= 4 * MiB
            assert st["backup_pinned_bytes"] == st["backup_reserved_bytes"] == 0
            backups_status = ctl.status()["backups"]
            assert backups_status["dir"] == str(backups)
            assert backups_status["disk_bytes"] == st["bytes"]
            assert list(backups.iterdir()) == []
            # read while paused, from the daemon's file
            assert w.backup_read(t.data_ptr() + 8, 8) == b"\x5d" * 8
            view = w.backup_view(t.data_ptr(), 4 * MiB)
            assert view.readonly and view[4 * MiB - 1] == 0x5d
            del view
            s.resume("weights")
            assert ctypes.string_at(t.data_ptr() + 4 * MiB - 1, 1) == b"\x5d"
            assert tag_status(ctl, "weights")["backup_disk_bytes"] == 0
            del t
        finally:
            gt.shutdown()


def test_the_initial_region_can_back_up_to_disk(make_daemon, tmp_path):
    """TMS_INIT_ENABLE_DISK_BACKUP=1 under the preload library: what the
    process allocates outside regions has its backup on disk while
    paused, and comes back whole."""
    backups = tmp_path / "backups"
    backups.mkdir(mode=0o700)
    d = make_daemon("--backup-dir", str(backups))
    r = run_python(STUB_PROGRAM + (
        "p = ctypes.c_void_p()\n"
        "assert rt.cudaMalloc(ctypes.byref(p), 4 * MiB) == 0\n"
        "ctypes.memset(p, 0x3c, 4 * MiB)\n"
        "from gpumem.torch_memory_saver import torch_memory_saver as tms\n"
        "import gpumem\n"
        "ctl = gpumem.connect(name='ctl', role='controller')\n"
        "tms.pause()\n"
        "t = [x for x in ctl.status()['tags'] if x['name'] == 'default'][0]\n"
        "print(t['backup_disk_bytes'] >= 4 * MiB, t['backup_pinned_bytes'])\n"
        "tms.resume()\n"
        "print(ctypes.string_at(p.value + 4 * MiB - 1, 1))\n"),
        _preload_env(d, TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_DISK_BACKUP="1",
                     TMS_DISK_BACKUP_DIR=str(backups)))
    assert r.returncode == 0, r.stderr
    assert r.stdout == "True 0\nb'<'\n", r.stdout


def test_two_devices_in_one_process(make_daemon):
    """Preload mode, one process, regions on two devices: pause() and
    resume() take both (by the daemon's per-device figures), and
    gpumem.torch's devices= pauses and resumes one of them alone."""
    r = run_python(STUB_PROGRAM + r'''
import gpumem
from faketorch import FakeTorch
sys.modules["torch"] = FakeTorch()
import gpumem.torch as gt
from gpumem.torch_memory_saver import torch_memory_saver as tms
ctl = gpumem.connect(name="ctl", role="controller")

def free():
    return [d["free"] for d in ctl.status()["devices"]]

ptrs = []
for dev in (0, 1):
    assert rt.cudaSetDevice(dev) == 0
    with tms.region("kv", enable_cpu_backup=True):
        p = ctypes.c_void_p()
        assert rt.cudaMalloc(ctypes.byref(p), 8 * MiB) == 0
        ctypes.memset(p, 0x40 + dev, 8 * MiB)
        ptrs.append(p.value)
f0 = free()
tms.pause()
f1 = free()
assert all(f1[d] - f0[d] >= 8 * MiB for d in (0, 1)), (f0, f1)
tms.resume()
assert free() == f0
gt.pause("kv", devices=[1])
f2 = free()
assert f2[0] == f0[0] and f2[1] - f0[1] >= 8 * MiB, (f0, f2)
gt.resume("kv", devices=[1])
assert free() == f0
assert [ctypes.string_at(p + 8 * MiB - 1, 1) for p in ptrs] == [b"\x40", b"\x41"]
print("both")
''', _preload_env(make_daemon()))
    assert r.returncode == 0, r.stderr
    assert r.stdout == "both\n"
