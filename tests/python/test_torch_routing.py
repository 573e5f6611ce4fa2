"""gpumem.torch's pool routing and pool lifetimes, against a real gpumemd
(host backend) and a stand-in for PyTorch's caching allocator
(faketorch.py) whose pools allocate through libgpumem's
gpumem_torch_alloc and gpumem_torch_free, as PyTorch's pluggable
allocator does. The stand-in records what PyTorch aborts on: a memory
pool destroyed while a routing or a capture is under way."""

import gc
import os
import subprocess
import sys
import threading

import pytest

from conftest import BUILD, REPO
from faketorch import FakeTorch

import gpumem
import gpumem.torch as gt
from gpumem.torch_memory_saver import TorchMemorySaver

MiB = 1 << 20


def tag_bytes(ctl, name):
    return sum(t["bytes"] for t in ctl.status()["tags"] if t["name"] == name)


def forget_everything():
    """Drop gpumem.torch's pools and client between tests, whatever state
    a failed test left."""
    gt._region_pools.clear()
    gt._mapped_pools.clear()
    gt._doomed.clear()
    gt._reserved.clear()
    gt._all.clear()
    gt._active = 0
    gt._local.__dict__.clear()
    if gt._client is not None:
        gpumem.set_default_client(None)
    gt._client, gt._owns_client = None, False
    gpumem.set_thread_tag(None)


@pytest.fixture(params=["lifo", "fifo"])
def fake(request, monkeypatch, worker):
    """PyTorch stand-in (routing order of PyTorch 2.11, or of earlier
    versions) with the test's worker as the default client. The test must
    leave nothing live: the teardown shuts gpumem.torch down."""
    ft = FakeTorch(order=request.param)
    monkeypatch.setitem(sys.modules, "torch", ft)
    forget_everything()
    gt.init(worker)
    try:
        yield ft
        gc.collect()
        gt.shutdown()
        assert ft.violations == []
        assert not gt._all and all(not r for r in ft.routing.values())
    finally:
        forget_everything()


def pool_of(t):
    return None if t.pool is None else t.pool.id


def test_the_stand_in_aborts_where_pytorch_does(fake):
    # The failure this module must never cause: a pool destroyed while
    # the thread routes to another.
    with gt.region("kv"):
        p = fake.cuda.MemPool()
        del p
    assert len(fake.violations) == 1 and "destroyed while 1 routings" in fake.violations[0]
    fake.violations.clear()


def test_nested_regions_disable_and_the_innermost_wins(fake, controller, tag):
    w, kv = tag("weights"), tag("kv")
    s = TorchMemorySaver()
    s.hook_mode = "torch"
    with gt.region(w, backup=True):
        a = fake.empty(3 * MiB)
        with s.region(kv):
            assert gpumem.thread_tag() == (kv, 0)
            b = fake.empty(5 * MiB)
            with s.disable():
                assert gpumem.thread_tag() == (None, 0)
                c = fake.empty(7 * MiB)
            d = fake.empty(5 * MiB)
        assert gpumem.thread_tag() == (w, gpumem.FLAG_BACKUP)
        e = fake.empty(3 * MiB)
    assert gpumem.thread_tag() == (None, 0)
    f = fake.empty(MiB)
    wp, kp = gt._region_pools[("gpumem", w, True, 0)], gt._region_pools[("gpumem", kv, False, 0)]
    assert [pool_of(a), pool_of(e)] == [wp[0]] * 2
    assert [pool_of(b), pool_of(d)] == [kp[0]] * 2
    # PyTorch's own memory: disable()'s in a pool of PyTorch's allocator
    # made for the block (let go of at its end), the rest in the default pool.
    assert pool_of(c) not in (wp[0], kp[0]) and fake.pools[pool_of(c)].allocator is None
    assert pool_of(f) is None and fake.default_segments == MiB
    # Segments carry the tag of their region, the outer one too after the
    # inner one closed.
    assert tag_bytes(controller, w) >= 6 * MiB
    assert tag_bytes(controller, kv) >= 10 * MiB
    assert all(not r for r in fake.routing.values())
    del a, b, c, d, e, f
    gt.empty_cache()
    assert tag_bytes(controller, w) == 0 and tag_bytes(controller, kv) == 0


def test_a_region_inside_itself_and_on_another_device(fake, tag):
    kv = tag("kv")
    with gt.region(kv):
        with gt.region(kv):  # the same pool, routed once at a time
            a = fake.empty(MiB)
        with gt.region(kv, device=1):  # the outer routing stops on every device
            b = fake.empty(MiB)  # the current device: PyTorch's own
            c = fake.empty(MiB, device="cuda:1")
        d = fake.empty(MiB)
    assert pool_of(a) == pool_of(d) == gt._region_pools[("gpumem", kv, False, 0)][0]
    assert pool_of(b) is None
    assert pool_of(c) == gt._region_pools[("gpumem", kv, False, 1)][0]
    del a, b, c, d


def test_a_capture_inside_a_region_is_the_graphs(fake, controller, tag):
    kv, cg = tag("kv"), tag("graph")
    with gt.region(kv):
        g = fake.cuda.CUDAGraph()
        with gt.cuda_graph(g, tag=cg):
            assert gpumem.thread_tag() == (cg, 0)
            out = fake.empty(2 * MiB)
        after = fake.empty(MiB)
        gp = g.pool()
        assert pool_of(out) == gp and pool_of(after) == gt._region_pools[
            ("gpumem", kv, False, 0)][0]
        assert tag_bytes(controller, cg) >= 2 * MiB
        # The graph goes while the region is open: its pool must stay
        # until nothing is open any more.
        del out, g
        gc.collect()
        assert gp in gt._all
        assert fake.violations == []
    assert gp not in gt._all
    del after
    gt.empty_cache()
    assert tag_bytes(controller, cg) == 0 and tag_bytes(controller, kv) == 0


def test_graphs_sharing_a_pool_and_foreign_handles(fake, tag):
    cg = tag("graph")
    g1, g2 = fake.cuda.CUDAGraph(), fake.cuda.CUDAGraph()
    with gt.cuda_graph(g1, tag=cg):
        o1 = fake.empty(MiB)
    with gt.cuda_graph(g2, tag=cg, pool=g1.pool()):
        o2 = fake.empty(MiB)
    assert g1.pool() == g2.pool() == pool_of(o1) == pool_of(o2)
    with pytest.raises(ValueError, match="not gpumem memory"):
        with gt.cuda_graph(fake.cuda.CUDAGraph(), pool=fake.cuda.graph_pool_handle()):
            pass
    s = TorchMemorySaver()
    s.hook_mode = "torch"
    h = fake.cuda.graph_pool_handle()
    g3, g4 = fake.cuda.CUDAGraph(), fake.cuda.CUDAGraph()
    with s.cuda_graph(g3, pool=h, tag=cg):
        o3 = fake.empty(MiB)
    with s.cuda_graph(g4, pool=h, tag=cg):
        o4 = fake.empty(MiB)
    assert g3.pool() == g4.pool() == pool_of(o3) != h
    del o1, o2, o3, o4, g1, g2, g3, g4
    gt.empty_cache()


def test_empty_cache_hands_back_what_is_free(fake, worker, controller, tag):
    kv = tag("kv")

    def held():  # PyTorch's segments, as the client counts them
        return worker.pool_stats()["allocated_bytes"]

    with gt.region(kv):
        t = fake.empty(16 * MiB)
        u = fake.empty(4 * MiB)
    gt.empty_cache(kv)
    assert held() >= 20 * MiB  # live tensors keep their memory
    del t
    assert held() >= 20 * MiB  # cached by PyTorch in the pool
    gt.empty_cache(kv)
    assert 4 * MiB <= held() < 20 * MiB
    assert tag_bytes(controller, kv) >= 4 * MiB
    del u
    assert held() >= 4 * MiB
    gt.empty_cache()
    assert held() == 0 and tag_bytes(controller, kv) == 0


def test_nothing_lets_go_while_a_block_is_open(fake, daemon, tag):
    kv = tag("kv")
    with gpumem.connect(daemon.sock, name="other") as other:
        with gt.region(kv):
            t = fake.empty(MiB)
            for f in (gt.empty_cache, gt.shutdown, lambda: gt.init(other)):
                with pytest.raises(RuntimeError, match="is open"):
                    f()
        # Live tensors: the client cannot be replaced or forgotten.
        for f in (gt.shutdown, lambda: gt.init(other)):
            with pytest.raises(RuntimeError, match="allocations of .* are live"):
                f()
        assert gt.client() is not other
        del t
        gt.init(other)  # lets the pools go first: their cached segments go back
        assert gt.client() is other
        gt.shutdown()


def test_threads_in_the_same_region(fake, controller, tag):
    kv = tag("kv")
    inside, done, got = threading.Event(), threading.Event(), []

    def engine():
        with gt.region(kv):
            got.append(fake.empty(2 * MiB))
            inside.set()
            done.wait(30)

    th = threading.Thread(target=engine)
    th.start()
    try:
        assert inside.wait(30)
        with gt.region(kv):  # PyTorch routes a pool for one thread at a time
            mine = fake.empty(2 * MiB)
    finally:
        done.set()
        th.join(30)
    assert pool_of(mine) != pool_of(got[0])
    assert len(gt._region_pools[("gpumem", kv, False, 0)]) == 2
    assert tag_bytes(controller, kv) >= 4 * MiB
    del mine, got[:]
    gt.empty_cache()


def test_a_pool_someone_holds_is_kept(fake, tag):
    kv = tag("kv")
    mp = gt.mem_pool(kv)
    gt.empty_cache()
    assert tuple(mp.id) in gt._all  # the caller might drop it inside a region
    with gt.region(kv):
        del mp
        gc.collect()
    gt.empty_cache()
    assert not gt._all


def test_pools_are_kept_at_exit(daemon, tag):
    """A thread still in a region when the interpreter exits: no pool may
    be destroyed during teardown (the stand-in aborts like PyTorch; the
    unused pool of region w would be destroyed first)."""
    code = (
        "import sys, threading\n"
        "sys.path.insert(0, %r)\n"
        "from faketorch import FakeTorch\n"
        "sys.modules['torch'] = ft = FakeTorch(abort=True)\n"
        "import gpumem.torch as gt\n"
        "gt.init(socket=%r, name='exit-test')\n"
        "with gt.region(%r):\n"
        "    pass\n"
        "g = ft.cuda.CUDAGraph()\n"
        "with gt.cuda_graph(g, tag=%r):\n"
        "    out = ft.empty(1 << 20)\n"
        "inside = threading.Event()\n"
        "def engine():\n"
        "    with gt.region(%r):\n"
        "        keep = ft.empty(1 << 20)\n"
        "        inside.set()\n"
        "        threading.Event().wait()\n"
        "threading.Thread(target=engine, daemon=True).start()\n"
        "inside.wait()\n"
        "print('exiting', len(gt._all), flush=True)\n"
    ) % (str(REPO / "tests" / "python"), daemon.sock, tag("w"), tag("graph"), tag("kv"))
    env = {"PYTHONPATH": str(REPO / "python"), "GPUMEM_LIB": str(BUILD / "lib" / "libgpumem.so.1")}
    if "LD_LIBRARY_PATH" in os.environ:  # where libgpumem's own libraries are (the GPU machine's)
        env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "exiting 3\n" and "faketorch" not in r.stderr


def test_generation_tells_a_tensor_its_memory_is_new(fake, controller, tag):
    """gpumem.torch.generation: the generation of the memory behind a
    tensor, the tag's, which each resume that remaps it moves on by one
    (Buffer.generation and Client.generation say the same)."""
    kv = tag("kv")
    with gt.region(kv):
        t = fake.empty(4 * MiB, device="cuda:0")
    c = gt.client()
    assert gt.generation(t) == 0 == c.generation(t.data_ptr())
    for n in (1, 2):
        controller.pause(kv)
        controller.resume(kv)
        assert gt.generation(t) == n
        st = [x for x in controller.status()["tags"] if x["name"] == kv][0]
        assert st["generation"] == n
    with pytest.raises(TypeError):
        gt.generation(object())
    del t


def test_a_buffers_generation(worker, controller, tag):
    kv = tag("kv")
    b = worker.alloc(kv, 2 * MiB)
    assert b.generation == 0
    controller.pause(kv)
    controller.resume(kv)
    assert b.generation == 1 == worker.generation(b.ptr + 5)
    with pytest.raises(gpumem.Error) as e:
        worker.generation(1)
    assert e.value.code == gpumem.ErrorCode.NOT_FOUND
    b.free()
