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
``gpumem_torch_alloc`` and ``gpumem_torch_free``, and one
``torch.cuda.MemPool`` of it per (tag, backup, device). :func:`region`
routes the calling thread's allocations on a device to that pool
(``torch.cuda.use_mem_pool``) and sets the thread's gpumem tag
(:func:`gpumem.set_thread_tag`), which the allocator entry point reads.
The entry points allocate from the process's default client: :func:`init`
connects one (or takes yours) and makes it the default.

PyTorch is imported on first use, not when this module is imported;
without it every function that needs it raises ImportError.

Caveats:

- PyTorch's caching allocator keeps freed blocks in the region's pool for
  later allocations of the same region. Those blocks are daemon memory of
  the region's tag: a pause releases them with the rest, and status counts
  them. ``torch.cuda.empty_cache()`` does not give back the blocks of a
  pool that is still in use; :func:`empty_cache` drops this module's pools
  so that it can.
- While a tag is paused, its tensors must not be touched, and no
  allocation may be made in its region: the caching allocator may hand out
  a cached block of the paused memory (a fault on first use, as with
  torch_memory_saver). A new segment for a paused tag fails with PyTorch's
  out-of-memory error (the daemon answers TAG_PAUSED).
- ``expandable_segments:True`` in PYTORCH_CUDA_ALLOC_CONF and the
  ``cudaMallocAsync`` backend do not work with memory pools of a pluggable
  allocator; :func:`region` refuses them.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import weakref
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

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

_lock = threading.RLock()
_client: Optional[gpumem.Client] = None
_owns_client = False
_allocator: Any = None  # the CUDAPluggableAllocator, made once per process
# Region pools: (kind, tag, backup, device) -> MemPool; kind is "gpumem"
# (the pluggable allocator) or "native" (PyTorch's own, for preload mode).
_pools: Dict[Tuple[str, str, bool, int], Any] = {}
# Pools of our allocator made for CUDA graphs, by id: weak references (the
# graph holds the pool), or the pool itself where it cannot be referenced
# weakly.
_graph_pools: Dict[Tuple[int, int], Any] = {}
# Foreign pool handles given to the lenient capture (torch_memory_saver's
# cuda_graph): each is mapped to one pool of ours, so graphs that share a
# handle share that pool.
_mapped_pools: Dict[Tuple[Any, str, bool, int], Any] = {}
_devices_used: Set[int] = set()
_kept: List[Any] = []  # graph pools that could not be attached to their graph
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
    missing = [n for n in ("MemPool", "use_mem_pool", "graph", "CUDAGraph")
               if not hasattr(cuda, n)]
    if missing or not hasattr(getattr(cuda, "memory", None), "CUDAPluggableAllocator"):
        raise ImportError("gpumem.torch needs torch.cuda.MemPool, torch.cuda.use_mem_pool and "
                          "CUDAPluggableAllocator (PyTorch 2.6 or later); this is torch %s"
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

def init(client: Optional[gpumem.Client] = None, *, socket: Optional[str] = None,
         name: Optional[str] = None) -> gpumem.Client:
    """Make ``client`` (a worker) the process's default client, which the
    allocator entry points use; with no client, connect one to ``socket``
    ($GPUMEM_SOCKET, else the default path) named ``name`` ($GPUMEM_NAME,
    else "torch-<pid>"). Returns the client in use.

    Called again with no arguments it returns the client in use. The client
    can be replaced until the first region or graph made a pool; after that
    RuntimeError (PyTorch frees every block through the client that
    allocated it). :func:`region`, :func:`cuda_graph`, :func:`pause` and
    :func:`resume` call ``init()`` when it has not been called."""
    global _client, _owns_client
    if client is not None and not isinstance(client, gpumem.Client):
        raise TypeError("client must be a gpumem.Client or None, not %s" % type(client).__name__)
    if client is not None and (socket is not None or name is not None):
        raise ValueError("give a client, or socket and name to connect one, not both")
    if socket is not None and not isinstance(socket, (str, os.PathLike)):
        raise TypeError("socket must be a path or None, not %s" % type(socket).__name__)
    if name is not None and not isinstance(name, str):
        raise TypeError("name must be a str or None, not %s" % type(name).__name__)
    with _lock:
        if _client is not None and not _client.closed:
            if client is None and socket is None and name is None:
                return _client
            if client is _client:
                return _client
            if _pools or _graph_pools or _mapped_pools or _kept:
                raise RuntimeError("gpumem.torch already allocates through %r; its client cannot "
                                   "be replaced once a region or graph was used" % (_client,))
        if client is None:
            client = gpumem.connect(socket, name=name or os.environ.get("GPUMEM_NAME")
                                    or "torch-%d" % os.getpid())
            owned = True
        else:
            owned = False
            if client.closed:
                raise ValueError("the client is closed")
            if client.role != "worker":
                raise ValueError("the default client must be a worker, not a %s" % client.role)
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


def shutdown() -> None:
    """Forget the client: clear the process's default client, close it if
    :func:`init` connected it, and drop this module's pools. Tensors made
    in regions must be gone: their memory goes with the client's session."""
    global _client, _owns_client
    with _lock:
        _pools.clear()
        _mapped_pools.clear()
        _graph_pools.clear()
        _kept.clear()
        _devices_used.clear()
        if _client is None:
            return
        c, owned = _client, _owns_client
        _client, _owns_client = None, False
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


def _new_pool(torch: Any, device: int, native: bool) -> Any:
    torch.cuda.init()
    with torch.cuda.device(device):
        if native:
            return torch.cuda.MemPool()
        return torch.cuda.MemPool(_our_allocator(torch).allocator())


def _pool(torch: Any, tag: str, backup: bool, device: int, native: bool = False) -> Any:
    key = ("native" if native else "gpumem", tag, backup, device)
    with _lock:
        p = _pools.get(key)
        if p is None:
            if not native:
                _check_alloc_conf(torch)
                init()
            p = _new_pool(torch, device, native)
            _pools[key] = p
            _devices_used.add(device)
        return p


def mem_pool(tag: str, backup: bool = False, device: Any = None) -> Any:
    """The ``torch.cuda.MemPool`` that :func:`region` uses for ``tag`` on
    ``device``: pass it as ``pool`` to :func:`cuda_graph` with the same tag
    (or to ``torch.cuda.use_mem_pool``, then set the thread tag yourself).
    Each segment is tagged when it is allocated, and PyTorch reuses the
    pool's cached blocks whatever the tag of the moment."""
    _check_tag(tag)
    _check_bool("backup", backup)
    torch = _torch()
    return _pool(torch, tag, backup, _device_index(torch, device))


def _graph_pool_alive(pool_id: Tuple[int, int]) -> bool:
    ref = _graph_pools.get(pool_id)
    if isinstance(ref, weakref.ref):
        if ref() is None:
            del _graph_pools[pool_id]
            return False
        return True
    return ref is not None


def _is_ours(pool_id: Tuple[int, int]) -> bool:
    if _graph_pool_alive(pool_id):
        return True
    return any(k[0] == "gpumem" and tuple(p.id) == pool_id for k, p in _pools.items()) or any(
        tuple(p.id) == pool_id for p in _mapped_pools.values())


@contextlib.contextmanager
def _thread_tag(tag: Optional[str], backup: bool = False) -> Iterator[None]:
    """Set the calling thread's gpumem tag (None: none) for the block."""
    prev, flags = gpumem.thread_tag()
    if tag is None:
        gpumem.set_thread_tag(None)
    else:
        gpumem.set_thread_tag(tag, backup=backup)
    try:
        yield
    finally:
        if prev is None:
            gpumem.set_thread_tag(None)
        else:
            gpumem.set_thread_tag(prev, backup=bool(flags & gpumem.FLAG_BACKUP),
                                  allow_paused=bool(flags & gpumem.FLAG_ALLOW_PAUSED))


def _region_depth() -> int:
    return getattr(_local, "depth", 0)


@contextlib.contextmanager
def _in_region() -> Iterator[None]:
    _local.depth = _region_depth() + 1
    try:
        yield
    finally:
        _local.depth -= 1


@contextlib.contextmanager
def _region(tag: str, backup: bool, device: Any, native: bool) -> Iterator[None]:
    torch = _torch()
    dev = _device_index(torch, device)
    pool = _pool(torch, tag, backup, dev, native)
    with _thread_tag(tag, backup), torch.cuda.use_mem_pool(pool, device=dev), _in_region():
        yield


@contextlib.contextmanager
def region(tag: str, backup: bool = False, device: Any = None) -> Iterator[None]:
    """Serve the calling thread's PyTorch allocations on ``device`` (None:
    the current device) from gpumemd, tagged ``tag``, for the duration of
    the block. ``backup=True``: their contents survive a pause (the daemon
    copies them to host memory); otherwise they are undefined after a
    resume. Tensors keep their ``data_ptr()`` across pause and resume.

    Regions nest; the previous thread tag and pool come back on exit. Only
    the calling thread is affected (PyTorch's autograd threads are not)."""
    _check_tag(tag)
    _check_bool("backup", backup)
    with _region(tag, backup, device, native=False):
        yield


def _graph_pool_id(torch: Any, pool: Any, tag: str, backup: bool, device: int,
                   lenient: bool) -> Tuple[Tuple[int, int], Any]:
    """The pool id to capture into, and the MemPool to keep alive with the graph."""
    if pool is None:
        with _lock:
            _check_alloc_conf(torch)
            init()
            mp = _new_pool(torch, device, native=False)
            try:
                _graph_pools[tuple(mp.id)] = weakref.ref(mp)
            except TypeError:
                _graph_pools[tuple(mp.id)] = mp
            _devices_used.add(device)
        return tuple(mp.id), mp
    if isinstance(pool, torch.cuda.MemPool):
        pid: Tuple[int, int] = tuple(pool.id)  # type: ignore[assignment]
    elif isinstance(pool, tuple) and len(pool) == 2 and all(isinstance(x, int) for x in pool):
        pid = (int(pool[0]), int(pool[1]))
    else:
        raise TypeError("pool must be None, a torch.cuda.MemPool or a pool handle "
                        "(graph.pool()), not %s" % type(pool).__name__)
    with _lock:
        if _is_ours(pid):
            return pid, None
        if not lenient:
            raise ValueError("pool %r is not gpumem memory: pass None, gpumem.torch.mem_pool(...), "
                             "or the pool() of a graph captured by gpumem.torch.cuda_graph" % (pid,))
        key = (pid, tag, backup, device)
        mp = _mapped_pools.get(key)
        if mp is None:
            _check_alloc_conf(torch)
            init()
            mp = _new_pool(torch, device, native=False)
            _mapped_pools[key] = mp
            _devices_used.add(device)
        return tuple(mp.id), mp


def _attach(graph: Any, mp: Any) -> None:
    """Keep a graph's MemPool alive as long as the graph."""
    try:
        setattr(graph, "_gpumem_pool", mp)
    except AttributeError:
        _kept.append(mp)


@contextlib.contextmanager
def _capture(graph: Any, tag: str, backup: bool, pool: Any, stream: Any,
             capture_error_mode: str, lenient: bool) -> Iterator[None]:
    _check_tag(tag)
    _check_bool("backup", backup)
    if capture_error_mode not in _CAPTURE_MODES:
        raise ValueError("capture_error_mode must be one of %s, not %r"
                         % (", ".join(_CAPTURE_MODES), capture_error_mode))
    torch = _torch()
    if not isinstance(graph, torch.cuda.CUDAGraph):
        raise TypeError("graph must be a torch.cuda.CUDAGraph, not %s" % type(graph).__name__)
    dev = int(torch.cuda.current_device())
    pid, mp = _graph_pool_id(torch, pool, tag, backup, dev, lenient)
    if mp is not None:
        _attach(graph, mp)
    with _thread_tag(tag, backup):
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

    ``pool``: None gives the graph a pool of its own (as
    ``torch.cuda.graph`` does); to share one between graphs pass
    ``other_graph.pool()`` of a graph captured here, or
    :func:`mem_pool` (a pool that is not gpumem memory raises
    ValueError)."""
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


def pause(*tags: str, devices: Optional[List[int]] = None, timeout: Optional[float] = None,
          missing_ok: bool = False) -> Optional[gpumem.OpResult]:
    """Pause this process's own buffers of ``tags`` (none: every tag):
    wait for the devices (``torch.cuda.synchronize``), then release the
    memory through the default client's own-scope pause. Each process
    pauses itself; an orchestrator pauses the whole node instead with a
    controller client (``gpumem.connect(role="controller").pause(...)``).

    Pausing what is paused changes nothing. Naming nothing this process
    holds raises gpumem.Error NOT_FOUND, or returns None with
    ``missing_ok=True``."""
    _check_bool("missing_ok", missing_ok)
    for t in tags:
        _check_tag(t)
    c = init()
    _synchronize()
    try:
        return c.pause(*tags, devices=devices, timeout=timeout, own=True)
    except gpumem.Error as e:
        if missing_ok and _not_found(e):
            return None
        raise


def resume(*tags: str, devices: Optional[List[int]] = None, timeout: Optional[float] = None,
           missing_ok: bool = False) -> Optional[gpumem.OpResult]:
    """Resume this process's own paused buffers of ``tags`` (none: every
    tag), all or nothing: with too little free device memory nothing
    changes and gpumem.Error OUT_OF_MEMORY says how much is needed.
    Addresses are the same as before the pause; ``backup=True`` regions
    hold their contents again."""
    _check_bool("missing_ok", missing_ok)
    for t in tags:
        _check_tag(t)
    c = init()
    try:
        return c.resume(*tags, devices=devices, timeout=timeout, own=True)
    except gpumem.Error as e:
        if missing_ok and _not_found(e):
            return None
        raise


def empty_cache(*tags: str) -> int:
    """Give back cached memory: drop this module's region pools of
    ``tags`` (none: all), so that PyTorch frees their unused blocks now
    (and their other blocks when the last tensor in them goes), run
    ``torch.cuda.empty_cache()``, and hand the daemon every sub-allocation
    buffer that no longer holds an allocation (:meth:`gpumem.Client.trim`).
    Returns the bytes handed back to the daemon. Later regions make new
    pools."""
    for t in tags:
        _check_tag(t)
    with _lock:
        for k in [k for k in _pools if not tags or k[1] in tags]:
            del _pools[k]
        if not tags:
            _mapped_pools.clear()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    with _lock:
        c = _client
    if c is None or c.closed:
        return 0
    return int(c.trim())


def _native_region(tag: Optional[str], backup: bool, device: Any) -> Any:
    """A region of PyTorch's own allocator (preload mode): the thread tag
    for the preload library, and a pool of its own so that cached blocks
    of the region and of the rest never mix. tag None: untagged."""
    if tag is None:
        return _untagged()
    return _region(tag, backup, device, native=True)


@contextlib.contextmanager
def _untagged() -> Iterator[None]:
    """No thread tag for the block; inside a region also a fresh pool of
    PyTorch's own allocator, so that nothing comes from the region's."""
    with _thread_tag(None):
        if _region_depth() == 0:
            yield
            return
        torch = _torch()
        with torch.cuda.use_mem_pool(torch.cuda.MemPool()):
            yield
