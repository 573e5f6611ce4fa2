"""torch_memory_saver's API on gpumemd.

Switching is an import change::

    -from torch_memory_saver import torch_memory_saver
    +from gpumem.torch_memory_saver import torch_memory_saver

or, for code that imports the package (``torch_memory_saver.torch_memory_saver``,
``torch_memory_saver.configure_subprocess()``)::

    -import torch_memory_saver
    +from gpumem import torch_memory_saver

``region``, ``cuda_graph``, ``disable``, ``pause``, ``resume``,
``hook_mode``, ``enabled``, ``memory_margin_bytes``, ``retain_cpu_backup``,
``get_cpu_backup``, ``set_disk_backup_dir`` and ``configure_subprocess``
have torch_memory_saver's names and arguments. What differs (see
docs/python.md): the memory is gpumemd's, so ``gpumemctl status`` shows it
per process and tag and an orchestrator can pause it node-wide;
``pause()`` and ``resume()`` act on this process's own buffers through the
daemon; ``cuda_graph`` works in both hook modes; CPU backups are the
daemon's host memory (``get_cpu_backup`` reads them); tags are limited to
``[A-Za-z0-9_.-]{1,63}``.

A process that starts inside a region (TMS_INIT_ENABLE=1, or
GPUMEM_INIT_REGION=1, "preload" mode) has pause() and resume() without a
tag take the default tag too: everything the preload library served
outside regions, backed up when TMS_INIT_ENABLE_CPU_BACKUP=1 (libgpumem
reads it) or GPUMEM_DEFAULT_FLAGS=backup.

The hook mode: "torch" serves regions through PyTorch's pluggable
allocator (:mod:`gpumem.torch`); "preload" relies on libgpumem_preload.so,
which must be in LD_PRELOAD when the process starts (the setter checks
that it is loaded). The default is "preload" when that library is loaded,
else "torch".

PyTorch is imported on first use, not with this module.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Any, Iterator, Literal, Optional, Set, Tuple

import gpumem
from gpumem import torch as _gt

__all__ = [
    "DISABLED_TAG",
    "HookMode",
    "PRELOAD_LIBRARY",
    "TorchMemorySaver",
    "configure_subprocess",
    "init_region_enabled",
    "preload_library_loaded",
    "preload_library_path",
    "torch_memory_saver",
]

HookMode = Literal["torch", "preload"]

#: The file name of the LD_PRELOAD library.
PRELOAD_LIBRARY = "libgpumem_preload.so"

_DEFAULT_TAG = "default"

#: The tag of what disable() allocates in "preload" mode when the process
#: started inside a region (TMS_INIT_ENABLE=1): pause() leaves it alone.
DISABLED_TAG = "disabled"
_MODES = ("torch", "preload")
_MAX_TAGS = 64  # tags one pause or resume may name

# The tags of every region and graph entered through this module: what
# pause() and resume() without a tag act on.
_tags_used: Set[str] = set()
_tags_lock = threading.Lock()


def _use_tag(tag: str) -> None:
    with _tags_lock:
        _tags_used.add(tag)


def preload_library_path() -> str:
    """The LD_PRELOAD library: $GPUMEM_PRELOAD_LIB, else
    libgpumem_preload.so next to the libgpumem in use."""
    env = os.environ.get("GPUMEM_PRELOAD_LIB")
    if env:
        return env
    return os.path.join(os.path.dirname(os.path.realpath(gpumem.library_path())), PRELOAD_LIBRARY)


def preload_library_loaded() -> bool:
    """True when libgpumem_preload is mapped into this process (it was in
    LD_PRELOAD when the process started)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            for line in f:
                if b"libgpumem_preload" in line.rsplit(b"/", 1)[-1]:
                    return True
    except OSError:  # pragma: no cover (no procfs)
        pass
    return False


@contextlib.contextmanager
def configure_subprocess() -> Iterator[None]:
    """For the duration of the block, put the preload library first in
    $LD_PRELOAD (keeping what is there), so that processes started in it
    can use hook_mode "preload". The previous value comes back on exit."""
    lib = preload_library_path()
    old = os.environ.get("LD_PRELOAD")
    os.environ["LD_PRELOAD"] = lib + ":" + old if old else lib
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = old


def _preload_error() -> RuntimeError:
    return RuntimeError(
        "hook_mode 'preload' needs %s loaded at process start, and it is not (LD_PRELOAD=%r): "
        "start the process with LD_PRELOAD=%s, or from inside "
        "gpumem.torch_memory_saver.configure_subprocess(); or use hook_mode 'torch'"
        % (PRELOAD_LIBRARY, os.environ.get("LD_PRELOAD", ""), preload_library_path()))


def _check_tag(tag: Any) -> str:
    return _gt._check_tag(tag)


_TRUE = ("1", "true", "TRUE", "yes", "YES")
_FALSE = ("0", "false", "FALSE", "no", "NO")


def _env_bool(name: str) -> bool:
    """torch_memory_saver's reading of a boolean variable (unset: False);
    ValueError for another value."""
    v = os.environ.get(name)
    if v is None or v in _FALSE:
        return False
    if v in _TRUE:
        return True
    raise ValueError("%s=%r: use 1, true, yes, 0, false or no" % (name, v))


def init_region_enabled() -> bool:
    """True when the process starts inside a region, as torch_memory_saver's
    TMS_INIT_ENABLE=1 says (or GPUMEM_INIT_REGION=1): in "preload" mode
    every allocation outside a region (the default tag, which the preload
    library serves from the first cudaMalloc, before any Python runs) is
    paused and resumed by pause() and resume() without a tag."""
    return _env_bool("TMS_INIT_ENABLE") or _env_bool("GPUMEM_INIT_REGION")


def _default_tag() -> str:
    """The preload library's tag outside regions."""
    return os.environ.get("GPUMEM_DEFAULT_TAG") or _DEFAULT_TAG


def _check_environment(mode: str) -> bool:
    """Check torch_memory_saver's variables once, at the first use: raise
    for one gpumemd cannot honour here, saying what to use instead.
    Returns whether the process starts inside a region."""
    init = init_region_enabled()
    _env_bool("TMS_INIT_ENABLE_CPU_BACKUP")  # read by libgpumem: backup outside regions
    _env_bool("TMS_RETAIN_CPU_BACKUP")
    if init and mode != "preload":
        raise RuntimeError(
            "TMS_INIT_ENABLE=1 (GPUMEM_INIT_REGION=1) needs hook_mode 'preload': in 'torch' "
            "mode allocations outside a region are PyTorch's own and cannot be paused; start "
            "the process with LD_PRELOAD=%s" % preload_library_path())
    backend = os.environ.get("TMS_INIT_CPU_BACKUP_BACKEND")
    if backend and backend not in ("pinned", "mmap"):
        raise ValueError("TMS_INIT_CPU_BACKUP_BACKEND=%r: use 'pinned' or 'mmap'" % backend)
    _env_bool("TMS_INIT_ENABLE_DISK_BACKUP")  # read by libgpumem: backups on disk
    chunk = os.environ.get("TMS_DISK_BACKUP_CHUNK_MB")
    if chunk and (not chunk.isdigit() or int(chunk) == 0):
        raise ValueError("TMS_DISK_BACKUP_CHUNK_MB=%r: a positive number of MiB (gpumemd "
                         "sizes its own disk requests, so it is otherwise ignored)" % chunk)
    return init


class TorchMemorySaver:
    """torch_memory_saver's object; use the :data:`torch_memory_saver`
    singleton. Every instance works on the same process-wide state (the
    default client of :mod:`gpumem.torch`)."""

    def __init__(self) -> None:
        self._mode: Optional[str] = None
        self._started = False
        self._margin = 0
        self._disk_dir_checked = False
        self._init = False  # the process started inside a region
        self._retain: Optional[bool] = None  # None: TMS_RETAIN_CPU_BACKUP, else True
        self._lock = threading.Lock()

    # Configuration.

    @property
    def hook_mode(self) -> str:
        """"torch" or "preload" (see the module's doc). May be set until the
        first region, graph, pause or resume; setting the mode in use
        again is allowed later."""
        if self._mode is not None:
            return self._mode
        return "preload" if preload_library_loaded() else "torch"

    @hook_mode.setter
    def hook_mode(self, mode: Any) -> None:
        if not isinstance(mode, str):
            raise TypeError("hook_mode must be 'torch' or 'preload', not %s" % type(mode).__name__)
        if mode not in _MODES:
            raise ValueError("hook_mode must be 'torch' or 'preload', not %r" % mode)
        with self._lock:
            if self._started and mode != self.hook_mode:
                raise RuntimeError("hook_mode is %r and cannot change after the first region, "
                                   "graph, pause or resume" % self.hook_mode)
            if mode == "preload" and not preload_library_loaded():
                raise _preload_error()
            self._mode = mode

    @property
    def enabled(self) -> bool:
        """True: the saver is available (as in torch_memory_saver)."""
        return True

    @property
    def memory_margin_bytes(self) -> int:
        """Bytes each allocation in a region must leave free on its device:
        one that would leave less raises PyTorch's out-of-memory error, as
        in torch_memory_saver (the daemon checks the driver's figure;
        Client.set_keep_free). 0: no margin."""
        return self._margin

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError("memory_margin_bytes must be an int, not %s" % type(value).__name__)
        if value < 0 or value >= 1 << 64:
            raise ValueError("memory_margin_bytes must be in 0..2**64-1, got %d" % value)
        self._margin = value
        if _gt._client is not None:  # else the first region or pause applies it
            _gt._client.set_keep_free(value)

    @property
    def retain_cpu_backup(self) -> bool:
        """True (gpumemd's default, unless TMS_RETAIN_CPU_BACKUP says
        otherwise): a backup's host memory is made when the buffer is
        allocated and kept for its life, so that pauses copy at once.
        False (torch_memory_saver's default): it is let go of after each
        resume and made again at the next pause, which then takes longer
        and fails, changing nothing, where the daemon's --backup-limit has
        no room. Applies to backed-up allocations made after it is set."""
        if self._retain is None:
            env = os.environ.get("TMS_RETAIN_CPU_BACKUP")
            return True if env is None else _env_bool("TMS_RETAIN_CPU_BACKUP")
        return self._retain

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: Any) -> None:
        if not isinstance(value, bool):
            raise TypeError("retain_cpu_backup must be a bool, not %s" % type(value).__name__)
        self._retain = value

    def _backup(self, enable_cpu_backup: bool, backend: Optional[str] = None,
                disk: bool = False) -> Any:
        """A region's backup as gpumem.torch takes it: kept or let go of
        (retain_cpu_backup), pinned or pageable (cpu_backup_backend, else
        TMS_INIT_CPU_BACKUP_BACKEND, "mmap": pageable), or on disk (its
        host memory then always lets go)."""
        if not (enable_cpu_backup or disk):
            return False
        backend = backend or os.environ.get("TMS_INIT_CPU_BACKUP_BACKEND") or "pinned"
        return _gt._backup_kind(True, not self.retain_cpu_backup and not disk,
                                backend == "mmap", disk)

    def _start(self) -> str:
        """Fix the hook mode, check the environment and find the default
        client (once)."""
        with self._lock:
            mode = self.hook_mode
            if mode == "preload" and not preload_library_loaded():
                raise _preload_error()
            if not self._started:
                self._init = _check_environment(mode)
            self._mode = mode
            self._started = True
        if mode == "preload" and _gt._client is None:
            # The preload library allocates through the library's default
            # client (connected on its first cudaMalloc): use that one, never
            # a second connection, so that frees find their allocations and
            # an own-scope pause covers them.
            _gt.init(gpumem.default_client())
        else:
            _gt.init()
        disk_dir = os.environ.get("TMS_DISK_BACKUP_DIR")
        if disk_dir and not self._disk_dir_checked:
            self._check_disk_dir("TMS_DISK_BACKUP_DIR", disk_dir)
            self._disk_dir_checked = True
        _gt.client().set_keep_free(self._margin)
        return mode

    # Regions and graphs.

    @contextlib.contextmanager
    def region(self, tag: str = _DEFAULT_TAG, enable_cpu_backup: bool = False,
               enable_disk_backup: bool = False,
               cpu_backup_backend: Optional[str] = None) -> Iterator[None]:
        """Allocations of the calling thread inside the block are gpumemd
        memory tagged ``tag``; ``enable_cpu_backup=True`` keeps their
        contents across a pause; ``enable_disk_backup=True`` keeps them in
        a file of the daemon's --backup-dir while paused (host memory only
        while a pause or resume runs).
        ``cpu_backup_backend``: "pinned" (the default, or
        TMS_INIT_CPU_BACKUP_BACKEND) keeps the backup in the daemon's pinned
        memory; "mmap" in its pageable memory, outside --backup-limit, which
        the daemon copies itself (slower)."""
        self._check_region_args(tag, enable_cpu_backup, enable_disk_backup, cpu_backup_backend)
        _gt._torch()
        mode = self._start()
        if mode == "torch":
            cm = _gt._region(tag, self._backup(enable_cpu_backup, cpu_backup_backend,
                                               enable_disk_backup), None, native=False)
        else:
            cm = _gt._native_region(tag, self._backup(enable_cpu_backup, cpu_backup_backend,
                                                      enable_disk_backup), None)
        with cm:
            _use_tag(tag)
            yield

    @staticmethod
    def _check_region_args(tag: Any, enable_cpu_backup: Any, enable_disk_backup: Any,
                           cpu_backup_backend: Any) -> None:
        _check_tag(tag)
        _gt._check_bool("enable_cpu_backup", enable_cpu_backup)
        _gt._check_bool("enable_disk_backup", enable_disk_backup)
        if cpu_backup_backend is not None:
            if not isinstance(cpu_backup_backend, str):
                raise TypeError("cpu_backup_backend must be a str or None")
            if cpu_backup_backend not in ("pinned", "mmap"):
                raise ValueError("cpu_backup_backend must be 'pinned' or 'mmap', not %r"
                                 % cpu_backup_backend)
            if not enable_cpu_backup:
                raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph: Any, pool: Any = None, stream: Any = None,
                   capture_error_mode: str = "global", tag: str = _DEFAULT_TAG,
                   enable_cpu_backup: bool = False,
                   cpu_backup_backend: Optional[str] = None) -> Iterator[None]:
        """Like ``torch.cuda.graph(cuda_graph, pool, stream,
        capture_error_mode)``, with the graph's memory pool in gpumemd
        memory tagged ``tag``, so that pausing the tag releases it. In
        "torch" mode a ``pool`` that is not gpumem memory (such as
        ``torch.cuda.graph_pool_handle()``) is replaced by one pool of
        gpumem memory per handle, so graphs that share a handle still share
        a pool."""
        self._check_region_args(tag, enable_cpu_backup, False, cpu_backup_backend)
        if capture_error_mode not in _gt._CAPTURE_MODES:
            raise ValueError("capture_error_mode must be one of %s, not %r"
                             % (", ".join(_gt._CAPTURE_MODES), capture_error_mode))
        _gt._torch()
        mode = self._start()
        if mode == "torch":
            cm = _gt._capture(cuda_graph, tag,
                              self._backup(enable_cpu_backup, cpu_backup_backend), pool, stream,
                              capture_error_mode, lenient=True)
        else:
            cm = self._preload_capture(cuda_graph, tag,
                                       self._backup(enable_cpu_backup, cpu_backup_backend), pool,
                                       stream, capture_error_mode)
        with cm:
            _use_tag(tag)
            yield

    @staticmethod
    @contextlib.contextmanager
    def _preload_capture(graph: Any, tag: str, backup: bool, pool: Any, stream: Any,
                         capture_error_mode: str) -> Iterator[None]:
        torch = _gt._torch()
        with _gt._capture_block(tag, backup):
            with torch.cuda.graph(graph, pool=pool, stream=stream,
                                  capture_error_mode=capture_error_mode):
                yield

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        """Inside the block the calling thread's allocations on the current
        device are outside every region: no tag, and an enclosing region's
        routing suspended. They go to a pool made for the block and let go
        of when it ends, so what the block cached goes back then (as in
        torch_memory_saver). In "preload" mode the preload library still
        serves them: tagged $GPUMEM_DEFAULT_TAG (else "default"), or
        "disabled" when the process started inside a region
        (TMS_INIT_ENABLE=1); pause() without a tag leaves them alone."""
        mode = self._start()
        tag = DISABLED_TAG if mode == "preload" and self._init else None
        with _gt._disposable(tag):
            yield

    # Pause and resume.

    def pause(self, tag: Optional[str] = None, *,
              release_context: bool = False) -> Optional[gpumem.OpResult]:
        """Release this process's memory of ``tag``; None: of every tag a
        region or graph of this process used, and, when the process started
        inside a region (TMS_INIT_ENABLE=1, "preload" mode), of what the
        preload library serves outside regions (else that is left alone).
        Pausing what is paused, or a tag
        this process never allocated, changes nothing. Returns the daemon's
        report (None when there was nothing to pause).

        Beyond torch_memory_saver: ``release_context=True`` then releases
        this process's own device state (its CUDA context, graph pools,
        PyTorch's cached blocks) to host memory, as gpumem.torch.pause
        does, if it opted in (GPUMEM_RELEASE_CONTEXT=1) and nothing of it
        is still mapped; the report's ``releases`` say how much moved."""
        if not isinstance(release_context, bool):
            raise TypeError("release_context must be a bool, not %s"
                            % type(release_context).__name__)
        if tag is not None:
            _check_tag(tag)
        self._start()
        tags = self._tags(tag)
        return self._op(_gt.pause, tags, release_context)

    def resume(self, tag: Optional[str] = None) -> Optional[gpumem.OpResult]:
        """Take the memory of ``tag`` (None: as for :meth:`pause`) again at
        the same addresses; raises gpumem.Error OUT_OF_MEMORY, changing
        nothing, when the device cannot hold it."""
        if tag is not None:
            _check_tag(tag)
        self._start()
        tags = self._tags(tag)
        return self._op(_gt.resume, tags)

    @staticmethod
    def _op(fn: Any, tags: Tuple[str, ...],
            release_context: bool = False) -> Optional[gpumem.OpResult]:
        """Run fn over tags, at most _MAX_TAGS a call (the last one asking
        for a context release, where asked); the last report."""
        result = None
        for i in range(0, len(tags), _MAX_TAGS):
            last = i + _MAX_TAGS >= len(tags)
            extra = {"release_context": True} if release_context and last else {}
            result = fn(*tags[i:i + _MAX_TAGS], missing_ok=True, **extra) or result
        return result

    def _tags(self, tag: Any) -> Tuple[str, ...]:
        """The tags that pause(tag) and resume(tag) act on."""
        if tag is not None:
            return (_check_tag(tag),)
        with _tags_lock:
            used = set(_tags_used)
        if self._init:
            used.add(_default_tag())
        return tuple(sorted(used))

    # What gpumemd does differently.

    def get_cpu_backup(self, x: Any, zero_copy: bool = False) -> Any:
        """What the last pause saved of ``x``, a contiguous CUDA tensor in
        a region with ``enable_cpu_backup=True`` whose tag is paused: a CPU
        tensor of its shape and dtype, a copy, or with ``zero_copy=True`` a
        read-only view of the backup's host memory (valid until the tag is
        resumed). None when there is no such backup (the tensor is not
        paused, or was allocated without a backup), as in
        torch_memory_saver. A backup on disk (``enable_disk_backup``) is
        read from the daemon's file, and a pageable one
        (``cpu_backup_backend="mmap"``) is first copied into memory of this
        process, which the view then shows. ValueError for a tensor that is
        not gpumem memory of this process."""
        _gt._check_bool("zero_copy", zero_copy)
        torch = _gt._torch()
        if not isinstance(x, torch.Tensor) or not x.is_cuda:
            raise TypeError("get_cpu_backup takes a CUDA tensor")
        if not x.is_contiguous():
            raise ValueError("get_cpu_backup takes a contiguous tensor (shape %s, stride %s)"
                             % (tuple(x.shape), x.stride()))
        self._start()
        c = _gt.client()
        nbytes = x.numel() * x.element_size()
        if nbytes == 0:
            return torch.empty(x.shape, dtype=x.dtype)
        try:
            if zero_copy:
                view = c.backup_view(x.data_ptr(), nbytes)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "not writable": it is read-only
                    flat = torch.frombuffer(view, dtype=torch.uint8)
                return flat.view(x.dtype).view(x.shape)
            out = torch.empty(x.shape, dtype=x.dtype)
            c.backup_read_into(x.data_ptr(), nbytes, out.data_ptr())
            return out
        except gpumem.Error as e:
            if e.code == gpumem.ErrorCode.WRONG_STATE:
                return None
            if e.code == gpumem.ErrorCode.NOT_FOUND:
                raise ValueError("get_cpu_backup: the tensor at 0x%x is not gpumem memory of "
                                 "this process: %s" % (x.data_ptr(), e)) from e
            raise

    def set_disk_backup_dir(self, path: str) -> None:
        """Where disk backups go: gpumemd writes them (its files, mode
        0600, gone with their buffers) in its own --backup-dir, so path
        must be that directory; a ValueError says which it is otherwise,
        or that the daemon has none."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError("set_disk_backup_dir: path must be a str or os.PathLike")
        self._start()
        self._check_disk_dir("set_disk_backup_dir", os.fspath(path))

    @staticmethod
    def _check_disk_dir(what: str, path: str) -> None:
        """Check that path is the daemon's --backup-dir."""
        theirs = _gt.client().status()["backups"]["dir"]
        if not theirs:
            raise ValueError("%s(%r): this gpumemd keeps no disk backups; start it with "
                             "--backup-dir %s" % (what, path, path))
        try:
            same = os.path.samefile(path, theirs)
        except OSError as e:
            raise ValueError("%s(%r): %s; gpumemd writes disk backups in its --backup-dir, %s"
                             % (what, path, e.strerror, theirs)) from e
        if not same:
            raise ValueError("%s(%r): gpumemd writes disk backups in its own --backup-dir, %s "
                             "(its files, not the process's): set that, or leave it unset"
                             % (what, path, theirs))


#: The process's saver, as ``torch_memory_saver.torch_memory_saver``.
torch_memory_saver = TorchMemorySaver()
