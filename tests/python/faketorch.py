"""A stand-in for the parts of PyTorch that gpumem.torch uses, for tests
on machines without PyTorch or a GPU.

It models the CUDA caching allocator's pool routing as PyTorch 2.11 has
it (c10/cuda/CUDACachingAllocator.cpp), the points that decide whether
gpumem.torch is right:

- one list of routings per device ("captures underway"); a pool can be
  routed to once at a time (a second begin fails); an allocation goes to
  the pool of the last matching routing (order="lifo", PyTorch 2.11) or
  the first (order="fifo", earlier versions);
- a pool's use count: one for the MemPool object, one per routing or
  capture; destroying the MemPool releases its count and then empties its
  cache, which for a pool no longer used synchronizes, and that aborts
  when any routing or capture is under way on the device. Here that is
  recorded in ``violations`` (or aborts the process, abort=True);
- freed blocks stay cached in their pool; ``cuda.empty_cache()`` gives
  back the free segments of pools no longer used.

Segments of a pool made with a pluggable allocator are allocated and
freed through that library's entry points (libgpumem's
gpumem_torch_alloc and gpumem_torch_free), so the daemon sees them as
PyTorch's would be seen. Memory is whatever the daemon's backend gives;
nothing here touches it.
"""

import contextlib
import ctypes
import itertools
import os
import threading
import types


class FakeTorch(types.ModuleType):
    """The module object to put in sys.modules["torch"]."""

    def __init__(self, order="lifo", abort=False, devices=2):
        super().__init__("torch")
        assert order in ("lifo", "fifo")
        self.__version__ = "2.11.0+fake"
        self._order = order
        self._abort = abort
        self._devices = devices
        self._mu = threading.RLock()
        self._ids = itertools.count(1)
        self.violations = []           # what PyTorch would have aborted on
        self.routing = {d: [] for d in range(devices)}   # device -> [(pool id, filter)]
        self.pools = {}                # pool id -> _PrivatePool
        self.default_segments = 0      # bytes PyTorch's own allocator holds
        self._tls = threading.local()
        fake = self

        class device:  # noqa: N801 (torch's name)
            def __init__(self, d, index=None):
                if isinstance(d, device):
                    self.type, self.index = d.type, d.index
                    return
                if isinstance(d, int):
                    self.type, self.index = "cuda", d
                    return
                t, _, i = str(d).partition(":")
                self.type = t
                self.index = int(i) if i else index

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return None

        self.device = device
        self.Tensor = _Tensor
        cuda = types.ModuleType("torch.cuda")
        self.cuda = cuda
        cuda.current_device = lambda: getattr(fake._tls, "device", 0)
        cuda.device_count = lambda: fake._devices
        cuda.init = lambda: None
        cuda.is_initialized = lambda: True
        cuda.synchronize = lambda d=None: None
        cuda.get_allocator_backend = lambda: "native"
        cuda.device = device
        cuda.empty_cache = self._empty_cache
        cuda.MemPool = _make_mempool(self)
        cuda.CUDAGraph = _make_graph(self)
        cuda.graph = _make_graph_ctx(self)
        cuda.graph_pool_handle = lambda: (0, next(self._ids))
        memory = types.ModuleType("torch.cuda.memory")
        memory.CUDAPluggableAllocator = _make_pluggable()
        cuda.memory = memory
        C = types.SimpleNamespace()
        C._cuda_beginAllocateCurrentThreadToPool = self._begin_thread
        C._cuda_endAllocateToPool = self._end
        C._cuda_releasePool = self._release
        self._C = C

        @contextlib.contextmanager
        def use_mem_pool(pool, device=None):
            dev = cuda.current_device() if device is None else int(device)
            C._cuda_beginAllocateCurrentThreadToPool(dev, pool.id)
            try:
                yield
            finally:
                C._cuda_endAllocateToPool(dev, pool.id)
                C._cuda_releasePool(dev, pool.id)

        cuda.use_mem_pool = use_mem_pool

    # The allocator's pool bookkeeping.

    def _violate(self, what, _write=os.write, _abort=os.abort):
        # (Bound early: this also runs while the interpreter tears down.)
        if self._abort:
            _write(2, ("faketorch: %s\n" % what).encode())
            _abort()
        self.violations.append(what)

    def _incref(self, pid):
        p = self.pools[pid]
        assert p.use_count > 0, "routing to a pool nobody holds"
        p.use_count += 1

    def _begin(self, dev, pid, filt):
        with self._mu:
            if any(r[0] == pid for r in self.routing[dev]):
                raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
            if pid not in self.pools:  # a capture's new pool
                self.pools[pid] = _PrivatePool(pid, dev, None)
            else:
                self._incref(pid)
            self.routing[dev].append((pid, filt))

    def _begin_thread(self, dev, pid):
        me = threading.get_ident()
        self._begin(dev, tuple(pid), lambda: threading.get_ident() == me)

    def _end(self, dev, pid):
        pid = tuple(pid)
        with self._mu:
            for i, r in enumerate(self.routing[dev]):
                if r[0] == pid:
                    del self.routing[dev][i]
                    return
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    def _release(self, dev, pid):
        with self._mu:
            p = self.pools[tuple(pid)]
            p.use_count -= 1
            assert p.use_count >= 0

    def _empty_pool(self, pid):
        """MemPool's destructor: emptyCache(id) after its release."""
        with self._mu:
            p = self.pools.get(pid)
            if p is None or p.use_count:
                return
            if self.routing[p.device]:
                self._violate("a pool was destroyed while %d routings or captures were "
                              "under way on device %d" % (len(self.routing[p.device]), p.device))
                return
            p.release_free()
            if not p.segments:
                del self.pools[pid]

    def _empty_cache(self):
        with self._mu:
            for pid, p in list(self.pools.items()):
                if p.use_count == 0:
                    p.release_free()
                    if not p.segments:
                        del self.pools[pid]

    def _pool_for(self, dev):
        routes = self.routing[dev]
        for pid, filt in (reversed(routes) if self._order == "lifo" else routes):
            if filt():
                return self.pools[pid]
        return None

    # Tensors.

    def empty(self, n, dtype=None, device=None):
        """n bytes on device ("cuda", "cuda:N" or an int)."""
        d = self.device(device if device is not None else "cuda")
        dev = self.cuda.current_device() if d.index is None else d.index
        with self._mu:
            pool = self._pool_for(dev)
            if pool is None:
                self.default_segments += n
                return _Tensor(self, None, 0, n, dev)
            seg = pool.take(n)
            return _Tensor(self, pool, seg, n, dev)

    def _free_tensor(self, t):
        with self._mu:
            if t.pool is None:
                self.default_segments -= t.size
            else:
                t.pool.give(t.ptr)


class _Tensor:
    def __init__(self, fake, pool, ptr, size, device):
        self._fake, self.pool, self.ptr, self.size, self.device = fake, pool, ptr, size, device

    def data_ptr(self):
        return self.ptr

    def __del__(self):
        self._fake._free_tensor(self)


class _PrivatePool:
    """A private pool: segments (ptr -> [size, in use]) and its allocator."""

    def __init__(self, pid, device, allocator):
        self.id, self.device, self.allocator = pid, device, allocator
        self.use_count = 1
        self.segments = {}
        self.native_next = 1 << 40

    def take(self, n):
        for ptr, s in self.segments.items():
            if not s[1] and s[0] >= n:
                s[1] = True
                return ptr
        if self.allocator is not None:
            ptr = self.allocator.alloc(n, self.device, None)
            if not ptr:
                raise RuntimeError("CUDA out of memory (the pluggable allocator returned NULL)")
        else:
            ptr, self.native_next = self.native_next, self.native_next + n
        self.segments[ptr] = [n, True]
        return ptr

    def give(self, ptr):
        self.segments[ptr][1] = False

    def release_free(self):
        for ptr, s in list(self.segments.items()):
            if not s[1]:
                if self.allocator is not None:
                    self.allocator.free(ptr, s[0], self.device, None)
                del self.segments[ptr]


def _make_pluggable():
    class _Allocator:
        def __init__(self, path, alloc_fn, free_fn):
            lib = ctypes.CDLL(path)
            self.alloc = getattr(lib, alloc_fn)
            self.alloc.restype = ctypes.c_void_p
            self.alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            self.free = getattr(lib, free_fn)
            self.free.restype = None
            self.free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                  ctypes.c_void_p]

    class CUDAPluggableAllocator:
        def __init__(self, path, alloc_fn, free_fn):
            self._allocator = _Allocator(path, alloc_fn, free_fn)

        def allocator(self):
            return self._allocator

    return CUDAPluggableAllocator


def _make_mempool(fake):
    class MemPool:
        def __init__(self, allocator=None, use_on_oom=False, no_split=False):
            self._fake = fake
            self._device = fake.cuda.current_device()
            self._id = (0, next(fake._ids))
            with fake._mu:
                fake.pools[self._id] = _PrivatePool(self._id, self._device, allocator)

        @property
        def id(self):
            return self._id

        def use_count(self):
            return fake.pools[self._id].use_count

        def __del__(self, _fake=fake):
            _fake._release(self._device, self._id)
            _fake._empty_pool(self._id)

    return MemPool


def _make_graph(fake):
    class CUDAGraph:
        def __init__(self):
            self._pool = None

        def pool(self):
            return self._pool

        def __del__(self, _fake=fake):
            if self._pool is not None:
                _fake._release(self._device, self._pool)

    return CUDAGraph


def _make_graph_ctx(fake):
    class graph:  # noqa: N801 (torch's name)
        def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
            self.g = cuda_graph
            self.pool = tuple(pool) if pool is not None else (0, next(fake._ids))

        def __enter__(self):
            fake._empty_cache()
            dev = fake.cuda.current_device()
            me = threading.get_ident()
            fake._begin(dev, self.pool, lambda: threading.get_ident() == me)
            self.g._pool, self.g._device = self.pool, dev
            self.dev = dev

        def __exit__(self, *exc):
            fake._end(self.dev, self.pool)

    return graph
