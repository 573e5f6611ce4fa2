"""PyTorch tensors in gpumemd's memory: tagged regions, CUDA graphs, pause
and resume from inside the process.

    import torch
    import gpumem.torch as gt

    gt.init()                                    # or gt.init(gpumem.connect(...))
    with gt.region("weights", backup=True):
        model = build_model().cuda()             # weights: daemon memory, kept across pauses
    with gt.region("kv_cache"):
        kv = torch.empty(n, device="cuda")       # KV cache: daemon memory, dropped by a pause
    gt.pause()                                   # this process's buffers, every tag
    ...                                          # another process uses the memory
    gt.resume()                                  # same addresses; weights hold their values

How it works: one ``torch.cuda.memory.CUDAPluggableAllocator`` over the
libgpumem in use (:func:`gpumem.library_path`) with the entry points
``gpumem_torch_alloc`` and ``gpumem_torch_free``, and ``torch.cuda.MemPool``
objects of it per (tag, backup, device). :func:`region` routes the calling
thread's allocations on a device to such a pool (what
``torch.cuda.use_mem_pool`` does) and sets the thread's gpumem tag
(:func:`gpumem.set_thread_tag`), which the allocator entry point reads.
The entry points allocate from the process's default client: :func:`init`
connects one (or takes yours) and makes it the default.

Regions, :func:`cuda_graph` captures and torch_memory_saver's ``disable()``
nest per thread: the innermost one decides alone where the thread's
allocations go, on every device (an outer region's routing is suspended
while an inner block is open, and comes back when it closes).

PyTorch aborts the process when a memory pool is destroyed while any
allocation routing or graph capture is under way. This module therefore
keeps every pool it made, and lets one go only while none of its regions,
captures or ``disable()`` blocks is open in any thread, and only when it
holds the last reference; at interpreter exit it keeps them all.

PyTorch is imported on first use, not when this module is imported;
without it every function that needs it raises ImportError.

Caveats:

- PyTorch's caching allocator keeps freed blocks in the region's pool for
  later allocations of the same region. Those blocks are daemon memory of
  the region's tag: a pause releases them with the rest, and status counts
  them. ``torch.cuda.empty_cache()`` does not give back the blocks of a
  pool that is still in use; :func:`empty_cache` lets this module's pools
  go so that it can.
- While a tag is paused, its tensors must not be touched, and no
  allocation may be made in its region: the caching allocator may hand out
  a cached block of the paused memory (a fault on first use, as with
  torch_memory_saver). A new segment for a paused tag fails with PyTorch's
  out-of-memory error (the daemon answers TAG_PAUSED).
- ``expandable_segments:True`` in PYTORCH_CUDA_ALLOC_CONF and the
  ``cudaMallocAsync`` backend do not work with memory pools of a pluggable
  allocator; :func:`region` refuses them.
- The thread tag is one per thread: a new segment gets the tag of the
  innermost open region, whatever its device.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import os
import re
import sys
import threading
import weakref
from typing import (Any, Callable, Deque, Dict, Iterable, Iterator, List, Optional, Set,
                    Tuple)

import gpumem

__all__ = [
    "ALLOC_FN",
    "FREE_FN",
    "client",
    "cuda_graph",
    "empty_cache",
    "init",
    "mem_pool",
    "pause",
    "region",
    "resume",
    "shutdown",
]

#: The allocation entry point of libgpumem that PyTorch calls.
ALLOC_FN = "gpumem_torch_alloc"
#: The free entry point of libgpumem that PyTorch calls.
FREE_FN = "gpumem_torch_free"

_CAPTURE_MODES = ("global", "thread_local", "relaxed")
_TAG_RE = re.compile(r"[A-Za-z0-9_.-]{1,63}")
# What routes the current thread's allocations on a device to a pool and
# back (torch.cuda.use_mem_pool's own calls; PyTorch 2.8 and later).
_ROUTING = ("_cuda_beginAllocateCurrentThreadToPool", "_cuda_endAllocateToPool",
            "_cuda_releasePool")

PoolId = Tuple[int, int]

_lock = threading.RLock()
_client: Optional[gpumem.Client] = None
_owns_client = False
_allocator: Any = None  # the CUDAPluggableAllocator, made once per process


class _Pool:
    """A MemPool this module made; ``mp`` is the one reference that
    decides when PyTorch may destroy it."""

    __slots__ = ("mp", "id", "device", "kind")

    def __init__(self, mp: Any, device: int, kind: str) -> None:
        self.mp = mp
        self.id: PoolId = (int(mp.id[0]), int(mp.id[1]))
        self.device = device
        self.kind = kind  # "gpumem" (our allocator) or "native" (PyTorch's own)


# Every pool this module made and still holds, by id.
_all: Dict[PoolId, _Pool] = {}
# Region pools by (kind, tag, backup, device): more than one when threads
# are in the same region at once (PyTorch routes a pool for one thread).
_region_pools: Dict[Tuple[str, str, bool, int], List[PoolId]] = {}
# Foreign pool handles given to the lenient capture (torch_memory_saver's
# cuda_graph): each is mapped to one pool of ours, so graphs that share a
# handle share that pool.
_mapped_pools: Dict[Tuple[Any, str, bool, int], PoolId] = {}
# Pools a thread's open blocks use: id -> [thread ident, number of blocks].
_reserved: Dict[PoolId, List[int]] = {}
# Pools to let go of at the next safe point (appended to without the lock,
# from the finalizers of graphs).
_doomed: Deque[PoolId] = collections.deque()
_active = 0  # open regions, captures and disable() blocks, all threads
_exiting = False
_devices_used: Set[int] = set()
_local = threading.local()



# Arguments.

def _check_tag(tag: Any) -> str:
    if not isinstance(tag, str):
        raise TypeError("tag must be a str, not %s" % type(tag).__name__)
    if not _TAG_RE.fullmatch(tag):
        raise ValueError("invalid tag %r: 1-63 characters of [A-Za-z0-9_.-]" % tag)
    return tag


def _check_bool(what: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError("%s must be a bool, not %s" % (what, type(v).__name__))
    return v


def _torch() -> Any:
    """Import PyTorch, or raise ImportError saying what needs it."""
    try:
        import torch
    except ImportError as e:
        raise ImportError("gpumem.torch needs PyTorch with CUDA (import torch failed: %s)" % e) from e
    cuda = getattr(torch, "cuda", None)
    missing = [n for n in ("MemPool", "graph", "CUDAGraph") if not hasattr(cuda, n)]
    missing += [n for n in _ROUTING if not hasattr(getattr(torch, "_C", None), n)]
    if missing or not hasattr(getattr(cuda, "memory", None), "CUDAPluggableAllocator"):
        raise ImportError("gpumem.torch needs torch.cuda.MemPool, per-thread pool routing and "
                          "CUDAPluggableAllocator (PyTorch 2.8 or later); this is torch %s"
                          % getattr(torch, "__version__", "?"))
    return torch


def _device_index(torch: Any, device: Any) -> int:
    """None (the current device), an int, "cuda:N" or a torch.device."""
    if device is None:
        return int(torch.cuda.current_device())
    if isinstance(device, bool):
        raise TypeError("device must be an int, a str, a torch.device or None, not bool")
    if isinstance(device, int):
        idx = device
    elif isinstance(device, (str, torch.device)):
        d = torch.device(device)
        if d.type != "cuda":
            raise ValueError("device must be a CUDA device, not %r" % str(d))
        idx = int(torch.cuda.current_device()) if d.index is None else d.index
    else:
        raise TypeError("device must be an int, a str, a torch.device or None, not %s"
                        % type(device).__name__)
    n = torch.cuda.device_count()
    if idx < 0 or idx >= n:
        raise ValueError("device %d does not exist here (%d CUDA devices)" % (idx, n))
    return idx


def _check_alloc_conf(torch: Any) -> None:
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        conf = os.environ.get(var, "").replace(" ", "").lower()
        if "expandable_segments:true" in conf:
            raise RuntimeError("gpumem.torch cannot serve a memory pool with expandable segments "
                               "(%s has expandable_segments:True): PyTorch's pools of a pluggable "
                               "allocator do not support them" % var)
    backend = getattr(torch.cuda, "get_allocator_backend", lambda: "native")()
    if backend != "native":
        raise RuntimeError("gpumem.torch needs PyTorch's native caching allocator, not %r "
                           "(memory pools need it)" % backend)


# The client.

def _open_blocks_error(what: str) -> RuntimeError:
    return RuntimeError("%s while a region, cuda_graph capture or disable() block of "
                        "gpumem.torch is open (%d, in any thread)" % (what, _active))


def _live_allocations(c: gpumem.Client) -> int:
    """Allocations the client has made through gpumem_malloc and not
    freed: PyTorch's segments among them."""
    try:
        return int(c.pool_stats()["allocations"])
    except (gpumem.Error, ValueError):
        return 0


def _check_can_let_go(c: Optional[gpumem.Client], what: str) -> None:
    """Refuse to replace or forget the client while PyTorch may hold its
    memory: frees go to the default client of the moment."""
    if _active:
        raise _open_blocks_error(what)
    if c is None or c.closed:
        return
    n = _live_allocations(c)
    if n:
        raise RuntimeError(
            "%s while %d allocations of %r are live (PyTorch frees each through the default "
            "client): delete the tensors and graphs made in regions, then call "
            "gpumem.torch.empty_cache()" % (what, n, c))


def _same_client(a: gpumem.Client, b: Optional[gpumem.Client]) -> bool:
    return b is not None and (a is b or (a._c is not None and a._c == b._c))


def init(client: Optional[gpumem.Client] = None, *, socket: Optional[str] = None,
         name: Optional[str] = None) -> gpumem.Client:
    """Make ``client`` (a worker) the process's default client, which the
    allocator entry points use; with no client, connect one to ``socket``
    ($GPUMEM_SOCKET, else the default path) named ``name`` ($GPUMEM_NAME,
    else "torch-<pid>"). Returns the client in use.

    Called again with no arguments it returns the client in use. Replacing
    the client lets go of the pools made so far (as :func:`shutdown`), and
    raises RuntimeError while a region, capture or ``disable()`` block is
    open, or while the client in use still has live allocations (PyTorch
    frees every block through the default client of the moment: delete the
    tensors and graphs made in regions first). :func:`region`,
    :func:`cuda_graph`, :func:`pause` and :func:`resume` call ``init()``
    when it has not been called."""
    global _client, _owns_client
    if client is not None and not isinstance(client, gpumem.Client):
        raise TypeError("client must be a gpumem.Client or None, not %s" % type(client).__name__)
    if client is not None and (socket is not None or name is not None):
        raise ValueError("give a client, or socket and name to connect one, not both")
    if socket is not None and not isinstance(socket, (str, os.PathLike)):
        raise TypeError("socket must be a path or None, not %s" % type(socket).__name__)
    if name is not None and not isinstance(name, str):
        raise TypeError("name must be a str or None, not %s" % type(name).__name__)
    if client is not None:
        if client.closed:
            raise ValueError("the client is closed")
        if client.role != "worker":
            raise ValueError("the default client must be a worker, not a %s" % client.role)
    with _lock:
        if _client is not None and not _client.closed:
            if client is None and socket is None and name is None:
                return _client
            if client is not None and _same_client(client, _client):
                return _client
            if _active:
                raise _open_blocks_error("gpumem.torch cannot replace its client")
            _let_go_of_pools()
            _check_can_let_go(_client, "gpumem.torch cannot replace its client")
        if client is None:
            client = gpumem.connect(socket, name=name or os.environ.get("GPUMEM_NAME")
                                    or "torch-%d" % os.getpid())
            owned = True
        else:
            owned = False
        old, old_owned = _client, _owns_client
        gpumem.set_default_client(client)
        _client, _owns_client = client, owned
        if old is not None and old_owned and old is not client:
            old.close()
        return client


def client() -> gpumem.Client:
    """The client the allocator entry points use (connected by
    :func:`init` on first use)."""
    return init()


def generation(tensor: Any) -> int:
    """The generation of the gpumem memory behind ``tensor`` (a CUDA
    tensor allocated in a region or pool of this process): how many
    resumes had given its tag's buffers new memory when it was last
    mapped. The address stays across a resume, the memory behind it does
    not: an NCCL user-buffer registration or a captured CUDA graph made at
    another generation is stale and must be made again. ValueError for a
    tensor that is not gpumem memory of this process."""
    torch = _torch()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError("generation takes a tensor")
    try:
        return client().generation(tensor.data_ptr())
    except gpumem.Error as e:
        if e.code == gpumem.ErrorCode.NOT_FOUND:
            raise ValueError("the tensor at 0x%x is not gpumem memory of this process"
                             % tensor.data_ptr()) from e
        raise


def shutdown() -> None:
    """Let go of every pool and of the client: give PyTorch's cached
    blocks back (as :func:`empty_cache`), clear the process's default
    client and close it if :func:`init` connected it.

    Raises RuntimeError while a region, capture or ``disable()`` block is
    open (changing nothing), or, keeping the client, while it still has
    live allocations once the pools are let go of (tensors or graphs made
    in regions: delete them first)."""
    global _client, _owns_client
    with _lock:
        if _active:
            raise _open_blocks_error("gpumem.torch cannot shut down")
        _let_go_of_pools()
        c = _client
        _check_can_let_go(c, "gpumem.torch cannot shut down")
        _devices_used.clear()
        if c is None:
            return
        owned = _owns_client
        _client, _owns_client = None, False
        if not c.closed:
            gpumem.set_default_client(None)
            if owned:
                c.close()


# Pools.

def _our_allocator(torch: Any) -> Any:
    """The CUDAPluggableAllocator over libgpumem (one per process)."""
    global _allocator
    with _lock:
        if _allocator is None:
            path = gpumem.library_path()
            _allocator = torch.cuda.memory.CUDAPluggableAllocator(path, ALLOC_FN, FREE_FN)
        return _allocator


def _new_pool(torch: Any, device: int, native: bool) -> PoolId:
    """Make a MemPool (of our allocator, or PyTorch's own) and keep it."""
    torch.cuda.init()
    with torch.cuda.device(device):
        if native:
            mp = torch.cuda.MemPool()
        else:
            mp = torch.cuda.MemPool(_our_allocator(torch).allocator())
    p = _Pool(mp, device, "native" if native else "gpumem")
    with _lock:
        _all[p.id] = p
        _devices_used.add(device)
    return p.id


def _region_pool(torch: Any, tag: str, backup: bool, device: int, native: bool,
                 free_for: Optional[int]) -> PoolId:
    """A region pool of (tag, backup, device): the first that no other
    thread than ``free_for`` uses now (None: the first), made when none
    is."""
    key = ("native" if native else "gpumem", tag, backup, device)
    with _lock:
        ids = _region_pools.setdefault(key, [])
        for pid in ids:
            r = _reserved.get(pid)
            if free_for is None or r is None or r[0] == free_for:
                return pid
        if not native:
            _check_alloc_conf(torch)
            init()
        pid = _new_pool(torch, device, native)
        ids.append(pid)
        return pid


def mem_pool(tag: str, backup: bool = False, device: Any = None) -> Any:
    """The ``torch.cuda.MemPool`` that :func:`region` uses for ``tag`` on
    ``device``: pass it as ``pool`` to :func:`cuda_graph` with the same tag.
    Each segment is tagged when it is allocated, and PyTorch reuses the
    pool's cached blocks whatever the tag of the moment. Route to it with
    :func:`region`, not ``torch.cuda.use_mem_pool``: this module cannot see
    that context, and dropping a pool while it is open aborts the process."""
    _check_tag(tag)
    _check_bool("backup", backup)
    torch = _torch()
    dev = _device_index(torch, device)
    with _lock:
        _flush()
        return _all[_region_pool(torch, tag, backup, dev, False, None)].mp


def _is_ours(pool_id: PoolId) -> bool:
    p = _all.get(pool_id)
    return p is not None and p.kind == "gpumem"


def _flush() -> None:
    """Let go of the doomed pools, where that is safe now: no block of
    this module open in any thread, and no other reference to the pool
    (whoever holds one could drop it at an unsafe moment). Called with
    the lock held."""
    if _active or _exiting:
        return
    for _ in range(len(_doomed)):
        pid = _doomed.popleft()
        p = _all.get(pid)
        if p is None:
            continue
        # References: p.mp and getrefcount's argument.
        if pid in _reserved or sys.getrefcount(p.mp) > 2:
            _doomed.append(pid)
            continue
        del _all[pid]
        p.mp = None  # PyTorch releases the pool's free blocks now


def _keep_at_exit() -> None:
    """At interpreter exit, keep every pool for good: a pool destroyed
    during teardown while some thread still routes or captures would
    abort the process. The process's memory goes with it anyway."""
    global _exiting
    _exiting = True
    for p in list(_all.values()):
        if p.mp is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(p.mp))


atexit.register(_keep_at_exit)


def _doom(ids: Iterable[PoolId]) -> None:
    """Queue pools for :func:`_flush` (once each). Lock held."""
    queued = set(_doomed)
    for pid in ids:
        if pid not in queued:
            _doomed.append(pid)
            queued.add(pid)


def _let_go_of_pools() -> None:
    """Let go of every pool that is safe to (see :func:`_flush`) and of
    the cached blocks of those PyTorch no longer uses. Lock held, no block
    open."""
    _doom(list(_all))
    _region_pools.clear()
    _mapped_pools.clear()
    _disable_pools.clear()
    _flush()
    _torch_empty_cache()


def _torch_empty_cache() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# Routing: a stack of open blocks per thread.

# A block's pools: (device, pool) routes the thread's allocations on the
# device to the pool; (None, pool) only keeps other threads off the pool.
Routes = List[Tuple[Optional[int], PoolId]]


class _Block:
    """One open region, capture or disable() block of a thread and its
    pools (no route: PyTorch's default pool, or a capture's own)."""

    __slots__ = ("routes", "on")

    def __init__(self) -> None:
        self.routes: Routes = []
        self.on = False


def _blocks() -> List[_Block]:
    b = getattr(_local, "blocks", None)
    if b is None:
        b = _local.blocks = []
    return b


def _routes(block: _Block) -> List[Tuple[int, PoolId]]:
    return [(d, p) for d, p in block.routes if d is not None]


def _route_on(block: _Block) -> None:
    """Route as torch.cuda.use_mem_pool does on entry."""
    routes = _routes(block)
    if block.on or not routes:
        block.on = True
        return
    C = _torch()._C
    done: List[Tuple[int, PoolId]] = []
    try:
        for dev, pid in routes:
            C._cuda_beginAllocateCurrentThreadToPool(dev, pid)
            done.append((dev, pid))
    except BaseException:
        for dev, pid in reversed(done):
            C._cuda_endAllocateToPool(dev, pid)
            C._cuda_releasePool(dev, pid)
        raise
    block.on = True


def _route_off(block: _Block) -> None:
    """Stop routing as torch.cuda.use_mem_pool does on exit."""
    routes = _routes(block)
    if not block.on:
        return
    block.on = False
    if not routes:
        return
    C = _torch()._C
    for dev, pid in reversed(routes):
        C._cuda_endAllocateToPool(dev, pid)
        C._cuda_releasePool(dev, pid)


def _reserve(pid: PoolId) -> None:
    r = _reserved.get(pid)
    if r is None:
        _reserved[pid] = [threading.get_ident(), 1]
    else:
        r[1] += 1


def _unreserve(block: _Block) -> None:
    for _, pid in block.routes:
        r = _reserved.get(pid)
        if r is not None:
            r[1] -= 1
            if r[1] <= 0:
                del _reserved[pid]


@contextlib.contextmanager
def _block(choose: Optional[Callable[[], Routes]] = None) -> Iterator[None]:
    """Open a block on the calling thread: suspend the routing of the
    enclosing one, route to the pools ``choose`` returns (called with the
    lock held; none: no pool), and undo both on exit."""
    global _active
    blocks = _blocks()
    block = _Block()
    with _lock:
        outer = blocks[-1] if blocks else None
        if outer is not None:
            _route_off(outer)
        try:
            if choose is not None:
                block.routes = choose()
                for _, pid in block.routes:
                    _reserve(pid)
            _route_on(block)
        except BaseException:
            _unreserve(block)
            if outer is not None:
                _route_on(outer)
            raise
        blocks.append(block)
        _active += 1
    try:
        yield
    finally:
        with _lock:
            try:
                top = blocks[-1] is block
                try:
                    _route_off(block)
                finally:
                    blocks.remove(block)
                    _unreserve(block)
                    if top and blocks:
                        _route_on(blocks[-1])
            finally:
                _active -= 1
                _flush()


# A region's backup, as this module passes it around (and keys pools by):
# False (none), True (kept for the buffer's life), or gpumem's backup flags
# (FLAG_BACKUP with any of FLAG_BACKUP_RELEASE, FLAG_BACKUP_PAGEABLE and
# FLAG_BACKUP_DISK).
_POLICY = gpumem.FLAG_BACKUP_RELEASE | gpumem.FLAG_BACKUP_PAGEABLE | gpumem.FLAG_BACKUP_DISK


def _backup_kind(backup: bool, backup_release: bool = False,
                 backup_pageable: bool = False, backup_disk: bool = False) -> Any:
    """A region's backup from the public arguments."""
    _check_bool("backup", backup)
    release = _check_bool("backup_release", backup_release)
    pageable = _check_bool("backup_pageable", backup_pageable)
    disk = _check_bool("backup_disk", backup_disk)
    if (release or pageable or disk) and not backup:
        raise ValueError("backup_release, backup_pageable and backup_disk need backup=True")
    if not (release or pageable or disk):
        return backup
    return (gpumem.FLAG_BACKUP | (gpumem.FLAG_BACKUP_RELEASE if release else 0)
            | (gpumem.FLAG_BACKUP_PAGEABLE if pageable else 0)
            | (gpumem.FLAG_BACKUP_DISK if disk else 0))


def _is_backup_kind(backup: Any) -> bool:
    """Whether backup is one _backup_kind makes."""
    if isinstance(backup, bool):
        return True
    return isinstance(backup, int) and backup & gpumem.FLAG_BACKUP and not (
        backup & ~(gpumem.FLAG_BACKUP | _POLICY))


@contextlib.contextmanager
def _thread_tag(tag: Optional[str], backup: Any = False) -> Iterator[None]:
    """Set the calling thread's gpumem tag (None: none) and backup (as
    _backup_kind makes it) for the block."""
    prev, flags = gpumem.thread_tag()
    if tag is None:
        gpumem.set_thread_tag(None)
    else:
        b = int(backup)
        gpumem.set_thread_tag(tag, backup=bool(b & gpumem.FLAG_BACKUP),
                              backup_release=bool(b & gpumem.FLAG_BACKUP_RELEASE),
                              backup_pageable=bool(b & gpumem.FLAG_BACKUP_PAGEABLE),
                              backup_disk=bool(b & gpumem.FLAG_BACKUP_DISK))
    try:
        yield
    finally:
        if prev is None:
            gpumem.set_thread_tag(None)
        else:
            gpumem.set_thread_tag(prev, backup=bool(flags & gpumem.FLAG_BACKUP),
                                  allow_paused=bool(flags & gpumem.FLAG_ALLOW_PAUSED),
                                  backup_release=bool(flags & gpumem.FLAG_BACKUP_RELEASE),
                                  backup_pageable=bool(flags & gpumem.FLAG_BACKUP_PAGEABLE),
                                  backup_disk=bool(flags & gpumem.FLAG_BACKUP_DISK))


@contextlib.contextmanager
def _region(tag: str, backup: bool, device: Any, native: bool) -> Iterator[None]:
    torch = _torch()
    dev = _device_index(torch, device)
    if not native:
        _check_alloc_conf(torch)
        init()
    me = threading.get_ident()

    def choose() -> Routes:
        return [(dev, _region_pool(torch, tag, backup, dev, native, me))]

    with _thread_tag(tag, backup), _block(choose):
        yield


@contextlib.contextmanager
def region(tag: str, backup: bool = False, device: Any = None, *,
           backup_release: bool = False, backup_pageable: bool = False,
           backup_disk: bool = False) -> Iterator[None]:
    """Serve the calling thread's PyTorch allocations on ``device`` (None:
    the current device) from gpumemd, tagged ``tag``, for the duration of
    the block. ``backup=True``: their contents survive a pause (the daemon
    copies them to host memory); otherwise they are undefined after a
    resume. Tensors keep their ``data_ptr()`` across pause and resume.

    Regions nest: the innermost decides alone (the enclosing region's
    routing and tag are suspended, on every device, and come back on
    exit). Only the calling thread is affected (PyTorch's autograd
    threads are not); threads may be in the same region at once.
    ``backup_release=True`` (with ``backup``): the backups' host memory is
    let go of after each resume and made again at the next pause;
    ``backup_pageable=True``: it is pageable memory, not pinned;
    ``backup_disk=True``: it is in the daemon's --backup-dir while paused
    (as Client.alloc's)."""
    _check_tag(tag)
    kind = _backup_kind(backup, backup_release, backup_pageable, backup_disk)
    with _region(tag, kind, device, native=False):
        yield


def _graph_pool_id(torch: Any, graph: Any, pool: Any, tag: str, backup: bool, device: int,
                   lenient: bool) -> PoolId:
    """The pool to capture into: a new one that goes with the graph, one
    of ours, or (lenient) the one mapped to a foreign handle."""
    if pool is None:
        with _lock:
            _check_alloc_conf(torch)
            init()
            pid = _new_pool(torch, device, native=False)
        try:
            weakref.finalize(graph, _doomed.append, pid).atexit = False
        except TypeError:
            pass  # a graph that cannot be referenced weakly keeps its pool for good
        return pid
    if isinstance(pool, torch.cuda.MemPool):
        pid: PoolId = (int(pool.id[0]), int(pool.id[1]))
    elif isinstance(pool, tuple) and len(pool) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) for x in pool):
        pid = (int(pool[0]), int(pool[1]))
    else:
        raise TypeError("pool must be None, a torch.cuda.MemPool or a pool handle "
                        "(graph.pool()), not %s" % type(pool).__name__)
    with _lock:
        if _is_ours(pid):
            return pid
        if not lenient:
            raise ValueError("pool %r is not gpumem memory: pass None, gpumem.torch.mem_pool(...), "
                             "or the pool() of a graph captured by gpumem.torch.cuda_graph" % (pid,))
        key = (pid, tag, backup, device)
        mine = _mapped_pools.get(key)
        if mine is None or mine not in _all:
            _check_alloc_conf(torch)
            init()
            mine = _new_pool(torch, device, native=False)
            _mapped_pools[key] = mine
        return mine


@contextlib.contextmanager
def _capture(graph: Any, tag: str, backup: bool, pool: Any, stream: Any,
             capture_error_mode: str, lenient: bool) -> Iterator[None]:
    _check_tag(tag)
    if not _is_backup_kind(backup):
        _check_bool("backup", backup)
    if capture_error_mode not in _CAPTURE_MODES:
        raise ValueError("capture_error_mode must be one of %s, not %r"
                         % (", ".join(_CAPTURE_MODES), capture_error_mode))
    torch = _torch()
    if not isinstance(graph, torch.cuda.CUDAGraph):
        raise TypeError("graph must be a torch.cuda.CUDAGraph, not %s" % type(graph).__name__)
    dev = int(torch.cuda.current_device())
    with _lock:
        _flush()
        pid = _graph_pool_id(torch, graph, pool, tag, backup, dev, lenient)
    # The capture routes to the graph's pool by itself; the block keeps an
    # enclosing region from catching the capture's allocations.
    with _thread_tag(tag, backup), _block(lambda: [(None, pid)]):
        with torch.cuda.graph(graph, pool=pid, stream=stream,
                              capture_error_mode=capture_error_mode):
            yield


@contextlib.contextmanager
def cuda_graph(graph: Any, tag: str = "cuda_graph", backup: bool = False, pool: Any = None,
               stream: Any = None, capture_error_mode: str = "global") -> Iterator[None]:
    """Capture into ``graph`` like ``torch.cuda.graph(graph, pool, stream,
    capture_error_mode)``, with the graph's memory pool (the intermediate
    and output tensors of the captured work) in gpumemd memory tagged
    ``tag``: a pause of the tag releases it, and after the resume the graph
    replays correctly (its addresses stay). Inputs and outputs that must
    keep their values across a pause belong in a ``backup=True`` region.
    Inside a region the capture is not the region's: the region's routing
    is suspended for the capture.

    ``pool``: None gives the graph a pool of its own (as
    ``torch.cuda.graph`` does), let go of after the graph is gone; to
    share one between graphs pass ``other_graph.pool()`` of a graph
    captured here, or :func:`mem_pool` (a pool that is not gpumem memory
    raises ValueError)."""
    with _capture(graph, tag, backup, pool, stream, capture_error_mode, lenient=False):
        yield


# Pause and resume.

def _synchronize() -> None:
    """Wait for the devices this module allocated on (when torch is loaded)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    for d in sorted(_devices_used) or [torch.cuda.current_device()]:
        torch.cuda.synchronize(d)


def _not_found(e: gpumem.Error) -> bool:
    return int(e.code) == int(gpumem.ErrorCode.NOT_FOUND)


def _own_op(op: str, tags: Tuple[str, ...], devices: Optional[List[int]],
            timeout: Optional[float], missing_ok: bool,
            release_context: bool = False) -> Optional[gpumem.OpResult]:
    """The default client's own-scope ``op`` ("pause", after the devices
    are synchronized, or "resume") of ``tags``; None where ``missing_ok``
    and it names nothing this process holds."""
    _check_bool("missing_ok", missing_ok)
    for t in tags:
        _check_tag(t)
    c = init()
    if op == "pause":
        _synchronize()
    extra = {"release_context": True} if release_context else {}
    try:
        return getattr(c, op)(*tags, devices=devices, timeout=timeout, own=True, **extra)
    except gpumem.Error as e:
        if missing_ok and _not_found(e):
            return None
        raise


def pause(*tags: str, devices: Optional[List[int]] = None, timeout: Optional[float] = None,
          missing_ok: bool = False, release_context: bool = False) -> Optional[gpumem.OpResult]:
    """Pause this process's own buffers of ``tags`` (none: every tag):
    wait for the devices (``torch.cuda.synchronize``), then release the
    memory through the default client's own-scope pause. Each process
    pauses itself; an orchestrator pauses the whole node instead with a
    controller client (``gpumem.connect(role="controller").pause(...)``).

    ``release_context=True`` then releases this process's own device state
    (its CUDA context, graph pools, PyTorch's cached blocks) to host
    memory once none of its buffers is mapped, if it opted in
    (GPUMEM_RELEASE_CONTEXT=1 before the first connection): the result's
    ``releases`` say how much moved, and its next CUDA call waits for
    :func:`resume`.

    Pausing what is paused changes nothing. Naming nothing this process
    holds raises gpumem.Error NOT_FOUND, or returns None with
    ``missing_ok=True``."""
    _check_bool("release_context", release_context)
    return _own_op("pause", tags, devices, timeout, missing_ok, release_context)


def resume(*tags: str, devices: Optional[List[int]] = None, timeout: Optional[float] = None,
           missing_ok: bool = False) -> Optional[gpumem.OpResult]:
    """Resume this process's own paused buffers of ``tags`` (none: every
    tag), all or nothing: with too little free device memory nothing
    changes and gpumem.Error OUT_OF_MEMORY says how much is needed.
    Addresses are the same as before the pause; ``backup=True`` regions
    hold their contents again."""
    return _own_op("resume", tags, devices, timeout, missing_ok)


def empty_cache(*tags: str) -> int:
    """Give back cached memory: let go of this module's region pools of
    ``tags`` (none: all, and the pools mapped to foreign graph pool
    handles), so that PyTorch frees their unused blocks now (and their
    other blocks once the last tensor in them is gone and the cache is
    emptied again), run ``torch.cuda.empty_cache()``, and hand the daemon
    every sub-allocation buffer that no longer holds an allocation
    (:meth:`gpumem.Client.trim`). Returns the bytes handed back by the
    trim. Later regions make new pools; a graph's own pool goes after the
    graph. Raises RuntimeError while a region, capture or ``disable()``
    block is open in any thread (PyTorch cannot let go of a pool then).
    Do not call it while another thread captures a graph or routes to a
    pool of its own outside this module."""
    for t in tags:
        _check_tag(t)
    with _lock:
        if _active:
            raise _open_blocks_error("gpumem.torch.empty_cache() cannot run")
        for key in [k for k in _region_pools if not tags or k[1] in tags]:
            _doom(_region_pools.pop(key))
        if not tags:
            _doom(_mapped_pools.values())
            _mapped_pools.clear()
            _doom(_disable_pools.values())
            _disable_pools.clear()
        _flush()
        _torch_empty_cache()
        c = _client
    if c is None or c.closed:
        return 0
    return int(c.trim())


def _native_region(tag: str, backup: bool, device: Any) -> Any:
    """A region of PyTorch's own allocator (preload mode): the thread tag
    for the preload library, and a pool of its own so that cached blocks
    of the region and of the rest never mix."""
    return _region(tag, backup, device, native=True)


# disable()'s pools, by (thread, device): one each, reused by the next
# disable() of that thread and device until it can be let go of.
_disable_pools: Dict[Tuple[int, int], PoolId] = {}


@contextlib.contextmanager
def _disposable(tag: Optional[str]) -> Iterator[None]:
    """torch_memory_saver's ``disable()``: the calling thread's allocations
    on the current device go to a pool of PyTorch's own allocator for such
    blocks, with the thread tag ``tag`` for the preload library (None:
    none), and the enclosing region's routing suspended. The pool is let go
    of when the block ends, so what the block cached goes back then; where
    another block is still open (a pool cannot be dropped then), it is kept
    for the thread's next disable() on the device and let go of after the
    first one that ends with none open."""
    torch = _torch()
    dev = int(torch.cuda.current_device())
    key = (threading.get_ident(), dev)
    with _lock:
        pid = _disable_pools.get(key)
    if pid is None:
        pid = _new_pool(torch, dev, native=True)
        with _lock:
            _disable_pools[key] = pid
    try:
        with _thread_tag(tag), _block(lambda: [(dev, pid)]):
            yield
    finally:
        with _lock:
            # With no block open, every kept disable() pool can go (other
            # threads' too: a thread that ended never comes back for its).
            gone = not _active
            if gone:
                _doom(list(_disable_pools.values()))
                _disable_pools.clear()
                _flush()
            c = _client
        if gone and c is not None and not c.closed:
            try:
                c.trim()  # the library's pooled slabs that the block emptied
            except gpumem.Error:
                pass  # none could go back now (a pause holds them): they stay pooled


@contextlib.contextmanager
def _capture_block(tag: str, backup: bool) -> Iterator[None]:
    """For a capture made elsewhere (torch_memory_saver's preload mode):
    the thread tag, with the enclosing region's routing suspended."""
    with _thread_tag(tag, backup), _block():
        yield
