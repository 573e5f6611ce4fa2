"""Python bindings of libgpumem, the client library of gpumemd.

gpumemd is a per-node daemon that owns GPU memory: workers allocate tagged
buffers from it, and an orchestrator pauses and resumes tags for the whole
node, so that the memory is given back to the device between rollouts and
taken again at the same addresses.

    import gpumem

    with gpumem.connect(name="my-engine") as worker:
        kv = worker.alloc("kv_cache", 64 << 20)
        kv.write(0, b"hello")
    with gpumem.connect(role="controller") as ctl:
        print(ctl.pause("kv_cache").bytes)

Device numbers, in arguments and results, are this process's own (as
CUDA_VISIBLE_DEVICES makes them); results also carry ``node_device``, the
daemon's number.

The package binds libgpumem.so.1 with ctypes (no compiled extension). It is
found through $GPUMEM_LIB, else in the build tree next to this package
(<repo>/build/lib), else by the system loader.

Errors: every failure the library or the daemon reports raises
:class:`Error`, carrying the code, its name, the words and (for pause and
resume) the pids and bytes involved. Arguments of the wrong type or range
raise TypeError or ValueError before anything reaches the library.
"""

from __future__ import annotations

import collections.abc
import contextlib
import ctypes
import enum
import math
import os
import re
import sys
import threading
import traceback
import weakref
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
    TypedDict,
    Union,
)

from . import _native
from ._native import (FLAG_ALLOW_PAUSED, FLAG_BACKUP, FLAG_BACKUP_DISK, FLAG_BACKUP_PAGEABLE,
                      FLAG_BACKUP_RELEASE, FLAG_IPC_LEGACY, FLAG_PERSIST)


__version__ = "1.12.0"

__all__ = [
    "Buffer",
    "Client",
    "ErrorCode",
    "Error",
    "Hook",
    "OpResult",
    "connect",
    "default_client",
    "error_name",
    "library_path",
    "set_default_client",
    "set_thread_tag",
    "thread_tag",
    "version",
    "DEFAULT_SOCKET",
    "FLAG_BACKUP",
    "FLAG_IPC_LEGACY",
    "FLAG_ALLOW_PAUSED",
    "FLAG_BACKUP_PAGEABLE",
    "FLAG_BACKUP_DISK",
    "FLAG_PERSIST",
    "FLAG_BACKUP_RELEASE",
]

#: The daemon's socket when neither an argument nor $GPUMEM_SOCKET names one.
DEFAULT_SOCKET = "/run/gpumemd/gpumemd.sock"

_TAG_RE = re.compile(r"[A-Za-z0-9_.-]{1,%d}" % _native.TAG_MAX)
_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1


class ErrorCode(enum.IntEnum):
    """The library's GPUMEM_E_* codes, named as the daemon names them.

    Codes -1..-12, -17..-19 and -21 are the daemon's (``NOT_FOUND`` is the wire's
    ``NOT_FOUND``, GPUMEM_E_NOT_FOUND in C); CONNECT, DISCONNECTED, NOMEM,
    MAP and TIMEOUT are the library's own (GPUMEM_E_CONNECT, ...). The
    names are gpumem_error_name's."""

    INVALID_ARGUMENT = -1
    PROTOCOL_ERROR = -2
    VERSION_MISMATCH = -3
    PERMISSION_DENIED = -4
    NOT_FOUND = -5
    OUT_OF_MEMORY = -6
    TAG_PAUSED = -7
    CLIENT_TIMEOUT = -8
    LIMIT_EXCEEDED = -9
    WRONG_STATE = -10
    BACKEND_ERROR = -11
    INTERNAL = -12
    CONNECT = -13
    DISCONNECTED = -14
    NOMEM = -15
    MAP = -16
    NOT_RELEASED = -17
    RESIDUAL_EXCEEDED = -18
    SHUTTING_DOWN = -19
    TIMEOUT = -20
    RELEASE_REFUSED = -21


def _code_name(code: int) -> str:
    try:
        return ErrorCode(code).name
    except ValueError:
        return "UNKNOWN(%d)" % code


def error_name(code: int) -> str:
    """The library's name of an error code (gpumem_error_name): "TAG_PAUSED",
    "OK" for 0, "UNKNOWN" for a code the library does not know."""
    code = _check_int("code", code, -(1 << 31), (1 << 31) - 1)
    return _text(_native.load().gpumem_error_name(code))


def version() -> Tuple[int, int, int]:
    """The loaded library's version as (major, minor, patch)."""
    v = _native.load().gpumem_version()
    return (v // 10000, v // 100 % 100, v % 100)


def library_path() -> str:
    """The path of the libgpumem this package loaded (for
    torch.cuda.memory.CUDAPluggableAllocator, which loads gpumem_torch_alloc
    and gpumem_torch_free from it)."""
    return _native.library_path()


class DeviceCheck(TypedDict):
    """What the driver showed of one device after a pause or resume
    (device: this process's number, -1 if it cannot see it; node_device:
    the daemon's)."""

    device: int
    node_device: int
    released: int
    free_before: int
    free_after: int
    shortfall: int
    residual: int
    residual_known: bool
    exit_wait_ms: int      # waited for owners that ended to leave the driver
    exit_listed: int       # of them still listed after the wait
    exit_listed_pid: int   # the first of those (0: none)
    used_after: int        # the driver's used memory after it, reserve left out


class OpDetail(TypedDict):
    """Buffers and bytes an operation moved for one tag on one device."""

    tag: str
    device: int
    node_device: int
    buffers: int
    bytes: int


class Error(Exception):
    """A failure reported by libgpumem or by the daemon.

    Attributes:
        code: the (negative) GPUMEM_E_* code, an :class:`ErrorCode` when known.
        code_name: its name: the daemon's ("NOT_FOUND", "CLIENT_TIMEOUT",
            "OUT_OF_MEMORY", ...) or the library's ("CONNECT", "DISCONNECTED").
        message: the daemon's (or the library's) words.
        pids: the processes involved (CLIENT_TIMEOUT, NOT_RELEASED, ...).
        buffers_held, bytes_held: what an owner still holds that it should not.
        bytes_needed, bytes_free: the shortfall of an OUT_OF_MEMORY resume.
        checks: the driver's per-device figures (pause and resume).
        result: the whole :class:`OpResult` of a failed pause or resume, or None.
    """

    def __init__(
        self,
        code: int,
        code_name: str,
        message: str,
        pids: Sequence[int] = (),
        bytes_held: int = 0,
        buffers_held: int = 0,
        bytes_needed: int = 0,
        bytes_free: int = 0,
        checks: Sequence[DeviceCheck] = (),
        result: Optional["OpResult"] = None,
    ) -> None:
        super().__init__(code, code_name, message)
        try:
            self.code: int = ErrorCode(code)
        except ValueError:
            self.code = code
        self.code_name = code_name
        self.message = message
        self.pids: Tuple[int, ...] = tuple(pids)
        self.bytes_held = bytes_held
        self.buffers_held = buffers_held
        self.bytes_needed = bytes_needed
        self.bytes_free = bytes_free
        self.checks: List[DeviceCheck] = list(checks)
        self.result = result

    def __str__(self) -> str:
        s = "%s: %s" % (self.code_name, self.message) if self.message else self.code_name
        if self.pids:
            s += " (pids %s)" % ", ".join(str(p) for p in self.pids)
        return s

    def __repr__(self) -> str:
        return "gpumem.Error(%d, %r, %r, pids=%r)" % (
            int(self.code), self.code_name, self.message, list(self.pids))


def _text(b: Optional[bytes]) -> str:
    """Decode the library's bytes as gpumemctl does in JSON: UTF-8, with
    each byte that is not UTF-8 taken as U+00XX."""
    if not b:
        return ""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        out = []
        i = 0
        while i < len(b):
            for n in (1, 2, 3, 4):
                try:
                    out.append(b[i:i + n].decode("utf-8"))
                    i += n
                    break
                except UnicodeDecodeError:
                    continue
            else:
                out.append(chr(b[i]))
                i += 1
        return "".join(out)


def _last_error(lib: ctypes.CDLL, rc: int) -> Error:
    """An Error from a failed call's code and the thread's last words."""
    name = _text(lib.gpumem_error_name(rc))
    if name == "UNKNOWN":
        name = _code_name(rc)
    words = _text(lib.gpumem_last_error())
    if words.startswith(name + ": "):
        words = words[len(name) + 2:]
    return Error(rc, name, words)


# Argument checks: raised before anything reaches the library.

def _check_int(what: str, v: Any, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError("%s must be an int, not %s" % (what, type(v).__name__))
    if v < lo or v > hi:
        raise ValueError("%s must be in [%d, %d], got %d" % (what, lo, hi, v))
    return int(v)


def _check_bool(what: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError("%s must be a bool, not %s" % (what, type(v).__name__))
    return v


def _check_tag(tag: Any, what: str = "tag") -> bytes:
    if not isinstance(tag, str):
        raise TypeError("%s must be a str, not %s" % (what, type(tag).__name__))
    if not _TAG_RE.fullmatch(tag):
        raise ValueError("invalid %s %r: 1-%d characters of [A-Za-z0-9_.-]"
                         % (what, tag, _native.TAG_MAX))
    return tag.encode("ascii")


def _check_tags(tags: Tuple[Any, ...]) -> List[bytes]:
    """Tags of a pause or resume; none means every tag."""
    if len(tags) > _native.MAX_TAGS:
        raise ValueError("at most %d tags, got %d" % (_native.MAX_TAGS, len(tags)))
    return [_check_tag(t) for t in tags]


def _check_devices(devices: Any) -> List[int]:
    if devices is None:
        return []
    if isinstance(devices, (str, bytes)) or not isinstance(devices, collections.abc.Iterable):
        raise TypeError("devices must be an iterable of ints or None, not %s" % type(devices).__name__)
    out = [_check_int("device", d, 0, _native.MAX_DEVICES - 1) for d in devices]
    if not out:
        raise ValueError("devices is empty (None means every device)")
    if len(out) > _native.MAX_DEVICES:
        raise ValueError("at most %d devices" % _native.MAX_DEVICES)
    return out


def _check_timeout(timeout: Any, what: str = "timeout") -> int:
    """Seconds (None: the default) to whole milliseconds (0 for None)."""
    if timeout is None:
        return 0
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError("%s must be a number of seconds or None, not %s"
                        % (what, type(timeout).__name__))
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError("%s must be a positive number of seconds, got %r" % (what, timeout))
    ms = math.ceil(timeout * 1000)
    if ms > _U32:
        raise ValueError("%s too large: %r seconds" % (what, timeout))
    return ms


def _check_pids(pids: Any) -> List[int]:
    if pids is None:
        return []
    if isinstance(pids, (str, bytes)) or not isinstance(pids, collections.abc.Iterable):
        raise TypeError("pids must be an iterable of ints or None, not %s" % type(pids).__name__)
    out = [_check_int("pid", p, 1, _U32) for p in pids]
    if not out:
        raise ValueError("pids is empty (None means any process)")
    if len(out) > _MAX_PIDS:
        raise ValueError("at most %d pids" % _MAX_PIDS)
    return out


def _check_prefix(prefix: Any) -> Optional[bytes]:
    if prefix is None:
        return None
    if not isinstance(prefix, str):
        raise TypeError("session_prefix must be a str or None, not %s" % type(prefix).__name__)
    b = prefix.encode("utf-8")
    if not b or len(b) > _native.NAME_MAX or any(ord(ch) < 0x20 or ord(ch) == 0x7f
                                                  for ch in prefix):
        raise ValueError("session_prefix must be 1-%d bytes of UTF-8 without control characters"
                         % _native.NAME_MAX)
    return b


def _check_flags(backup: Any, allow_paused: Any, backup_release: Any = False,
                 backup_pageable: Any = False, backup_disk: Any = False) -> int:
    flags = (FLAG_BACKUP if _check_bool("backup", backup) else 0) | (
        FLAG_ALLOW_PAUSED if _check_bool("allow_paused", allow_paused) else 0)
    for what, v, bit in (("backup_release", backup_release, FLAG_BACKUP_RELEASE),
                         ("backup_pageable", backup_pageable, FLAG_BACKUP_PAGEABLE),
                         ("backup_disk", backup_disk, FLAG_BACKUP_DISK)):
        if _check_bool(what, v):
            if not backup:
                raise ValueError("%s=True needs backup=True" % what)
            flags |= bit
    return flags


# As many pids as the daemon takes in one pause or resume scope.
_MAX_PIDS = _native.MAX_PIDS
_I32 = (1 << 31) - 1


def _in_hook() -> bool:
    return getattr(_hook_state, "depth", 0) > 0


_hook_state = threading.local()


class OpResult:
    """What a pause or resume did (``gpumemctl pause --json`` as an object).

    Attributes: buffers, bytes (released or taken again), backup_bytes,
    skipped (buffers that never pause), elapsed_us, backup_us, waited_us (a
    resume's wait for room, :meth:`Client.resume`'s wait), checks (the
    driver's figures per device: :class:`DeviceCheck` dicts), details (per
    tag and device: :class:`OpDetail` dicts), releases (per worker
    process whose device state a pause released or a resume restored:
    dicts of pid, released, moved_to_host, elapsed_us and why), processes
    (a pause: each process the driver lists on the devices it touched, as
    :meth:`Client.status` gives them) and error
    (None, or a dict with code, message, pids, buffers_held, bytes_held,
    bytes_needed and bytes_free).
    """

    __slots__ = ("buffers", "bytes", "backup_bytes", "skipped", "elapsed_us",
                 "backup_us", "waited_us", "checks", "details", "releases", "processes", "error")

    def __init__(self, r: _native.OpReport) -> None:
        self.buffers: int = r.buffers
        self.bytes: int = r.bytes
        self.backup_bytes: int = r.backup_bytes
        self.skipped: int = r.skipped
        self.elapsed_us: int = r.elapsed_us
        self.backup_us: int = r.backup_us
        self.waited_us: int = r.waited_us
        self.checks: List[DeviceCheck] = _checks(r.checks, r.nchecks)
        self.details: List[OpDetail] = [
            OpDetail(tag=_text(d.tag), device=d.device, node_device=d.node_device,
                     buffers=d.buffers, bytes=d.bytes)
            for d in (r.details[i][0] for i in range(r.ndetails))
        ]
        self.releases: List[Dict[str, Any]] = [
            {"pid": x.pid, "released": bool(x.released), "moved_to_host": x.moved_to_host,
             "elapsed_us": x.elapsed_us, "why": _text(x.why)}
            for x in (r.releases[i][0] for i in range(r.nreleases))
        ]
        self.processes: List[Dict[str, Any]] = [
            {"pid": q.pid, "device": q.device, "node_device": q.node_device, "used": q.used,
             "managed": q.managed, "residual": q.residual, "session_id": q.session_id,
             "name": _text(q.name)}
            for q in (r.processes[i][0] for i in range(r.nprocesses))
        ]
        self.error: Optional[Dict[str, Any]] = None
        if r.error:
            self.error = {
                "code": _text(r.code),
                "message": _text(r.message),
                "pids": [r.pids[i] for i in range(r.npids)],
                "buffers_held": r.buffers_held,
                "bytes_held": r.bytes_held,
                "bytes_needed": r.bytes_needed,
                "bytes_free": r.bytes_free,
            }

    def as_dict(self) -> Dict[str, Any]:
        """The same keys, in the same order, as ``gpumemctl pause --json``."""
        return {
            "buffers": self.buffers,
            "bytes": self.bytes,
            "backup_bytes": self.backup_bytes,
            "skipped": self.skipped,
            "elapsed_us": self.elapsed_us,
            "backup_us": self.backup_us,
            "waited_us": self.waited_us,
            "checks": [dict(c) for c in self.checks],
            "details": [dict(d) for d in self.details],
            "releases": [dict(x) for x in self.releases],
            "processes": [dict(q) for q in self.processes],
            "error": dict(self.error) if self.error else None,
        }

    def __getitem__(self, key: str) -> Any:
        return self.as_dict()[key]

    def __repr__(self) -> str:
        return "OpResult(buffers=%d, bytes=%d, backup_bytes=%d, skipped=%d, elapsed_us=%d%s)" % (
            self.buffers, self.bytes, self.backup_bytes, self.skipped, self.elapsed_us,
            ", error=%r" % self.error["code"] if self.error else "")


def _figures(lib: Any, s: Any) -> Dict[str, Any]:
    """What the daemon counted since it started (1.3): operations by
    result, errors by code, bytes released and restored, durations, and
    the operations running and recently done (newest first)."""
    return {
        "uptime_ms": s.uptime_ms,
        "bytes_released": s.bytes_released,
        "bytes_restored": s.bytes_restored,
        "op_counts": [{"op": _text(c.op), "result": _text(c.name), "count": c.count}
                      for c in (s.op_counts[i][0] for i in range(s.nop_counts))],
        "error_counts": [{"code": _text(c.name), "count": c.count}
                         for c in (s.error_counts[i][0] for i in range(s.nerror_counts))],
        "histograms": [{
            "op": _text(h.op), "le_us": [h.le_us[b] for b in range(h.nbuckets)],
            "count": [h.count[b] for b in range(h.nbuckets)], "total": h.total,
            "sum_us": h.sum_us,
        } for h in (s.histograms[i][0] for i in range(s.nhistograms))],
        "recent_ops": [{
            "op": _text(r.op), "tags": [_text(r.tags[k]) for k in range(r.ntags)],
            "pid": r.pid, "done": bool(r.done),
            "result": _text(lib.gpumem_error_name(r.result)),
            "bytes_done": r.bytes_done, "bytes_total": r.bytes_total,
            "copied_bytes": r.copied_bytes, "started_ms": r.started_ms,
            "duration_us": r.duration_us,
        } for r in (s.recent_ops[i][0] for i in range(s.nrecent_ops))],
    }


def _checks(p: Any, n: int) -> List[DeviceCheck]:
    return [
        DeviceCheck(device=k.device, node_device=k.node_device, released=k.released,
                    free_before=k.free_before, free_after=k.free_after,
                    shortfall=k.shortfall, residual=k.residual,
                    residual_known=bool(k.residual_known), exit_wait_ms=k.exit_wait_ms,
                    exit_listed=k.exit_listed, exit_listed_pid=k.exit_listed_pid,
                    used_after=k.used_after)
        for k in (p[i][0] for i in range(n))
    ]


def _buffer_dict(lib: Any, b: Any) -> Dict[str, Any]:
    """One struct gpumem_buffer_info as a dict with the keys of
    ``gpumemctl list --json``."""
    return {
        "id": b.id, "session": b.session_id, "pid": b.pid, "tag": _text(b.tag),
        "device": b.device, "node_device": b.node_device, "size": b.bytes,
        "flags": b.flags, "state": _text(lib.gpumem_state_name(b.state)),
        "name": _text(b.name), "age_ms": b.age_ms, "last_pid": b.last_pid,
        "last_name": _text(b.last_name), "idle_ms": b.idle_ms, "uid": b.uid,
    }


class Buffer:
    """A tagged buffer of daemon memory, made by :meth:`Client.alloc`.

    ``ptr`` stays the same across pause and resume; while the buffer is
    paused (``mapped`` is False) touching the memory faults, and
    :meth:`read` and :meth:`write` raise :class:`Error` (WRONG_STATE). A
    buffer lives until :meth:`free` (or the end of a ``with`` block) or
    until its client is closed; dropping the object does not free it.

    Attributes: ptr (the address, an int), size (bytes, rounded up to the
    granularity), tag, device (this process's numbering), flags.
    """

    def __init__(self, client: "Client", handle: int) -> None:
        lib = client._lib
        self._client = client
        self._h: Optional[int] = handle
        self.ptr: int = lib.gpumem_buffer_ptr(handle) or 0
        self.size: int = lib.gpumem_buffer_size(handle)
        self.tag: str = _text(lib.gpumem_buffer_tag(handle))
        self.device: int = lib.gpumem_buffer_device(handle)
        self.flags: int = lib.gpumem_buffer_flags(handle)
        #: A persistent buffer's name ("" for others; API 1.12).
        self.name: str = _text(lib.gpumem_buffer_name(handle))

    def _handle(self) -> int:
        h = self._h
        if h is None:
            raise ValueError("buffer %s at 0x%x is freed" % (self.tag, self.ptr))
        return h

    @property
    def freed(self) -> bool:
        """True once freed (or its client closed)."""
        return self._h is None

    @property
    def id(self) -> int:
        """The daemon's id (a new one after re-registration with a restarted daemon)."""
        return self._client._lib.gpumem_buffer_id(self._handle())

    @property
    def generation(self) -> int:
        """Its tag's generation when it was last mapped: how many resumes
        had given the tag's buffers new memory. A registration of ``ptr``
        made at another generation (NCCL user buffers, a captured CUDA
        graph) is stale (gpumemd 1.10; 0 before)."""
        return self._client._lib.gpumem_buffer_generation(self._handle())

    @property
    def mapped(self) -> bool:
        """True while memory is mapped behind ``ptr``; False while paused."""
        return bool(self._client._lib.gpumem_buffer_mapped(self._handle()))

    @property
    def registered(self) -> bool:
        """True while the daemon knows the buffer (False while reconnecting)."""
        return bool(self._client._lib.gpumem_buffer_registered(self._handle()))

    @property
    def backup(self) -> bool:
        """True for a BACKUP buffer, whose contents survive a pause."""
        return bool(self.flags & FLAG_BACKUP)

    def _range(self, offset: Any, length: Any) -> Tuple[int, int]:
        offset = _check_int("offset", offset, 0, self.size)
        length = _check_int("length", length, 0, self.size - offset)
        return offset, length

    def read(self, offset: int = 0, length: Optional[int] = None) -> bytes:
        """Copy ``length`` bytes at ``offset`` (default: to the end) to host
        memory through the device (gpumem_buffer_read)."""
        if length is None:
            _check_int("offset", offset, 0, self.size)
            length = self.size - offset
        offset, length = self._range(offset, length)
        h = self._handle()
        buf = ctypes.create_string_buffer(length)
        if length:
            lib = self._client._lib
            rc = lib.gpumem_buffer_read(self._client._ptr(), h, offset, buf, length)
            if rc < 0:
                raise _last_error(lib, rc)
        return buf.raw

    def write(self, offset: int, data: Union[bytes, bytearray, memoryview]) -> None:
        """Copy bytes-like ``data`` into the buffer at ``offset`` through the
        device (gpumem_buffer_write)."""
        if isinstance(data, str) or not isinstance(data, (bytes, bytearray, memoryview)):
            try:
                data = memoryview(data)
            except TypeError:
                raise TypeError("data must be bytes-like, not %s" % type(data).__name__) from None
        mv = memoryview(data)
        if not mv.c_contiguous:
            raise ValueError("data must be C-contiguous")
        mv = mv.cast("B")
        offset, length = self._range(offset, mv.nbytes)
        h = self._handle()
        if not length:
            return
        src: Any = bytes(mv) if mv.readonly else (ctypes.c_char * length).from_buffer(mv)
        lib = self._client._lib
        rc = lib.gpumem_buffer_write(self._client._ptr(), h, offset, src, length)
        if rc < 0:
            raise _last_error(lib, rc)

    def fill32(self, value: int, offset: int = 0, length: Optional[int] = None) -> None:
        """Set ``length`` bytes (default: to the end) at ``offset`` to a
        repeated 32-bit ``value`` on the device; offset and length are
        multiples of 4."""
        value = _check_int("value", value, 0, _U32)
        if length is None:
            _check_int("offset", offset, 0, self.size)
            length = self.size - offset
        offset, length = self._range(offset, length)
        if offset % 4 or length % 4:
            raise ValueError("offset and length must be multiples of 4")
        h = self._handle()
        lib = self._client._lib
        rc = lib.gpumem_buffer_fill32(self._client._ptr(), h, offset, length, value)
        if rc < 0:
            raise _last_error(lib, rc)

    def free(self) -> None:
        """Free the buffer (active or paused); ``ptr`` becomes invalid.
        Freeing a freed buffer does nothing."""
        if self._h is None:
            return
        self._client._free(self)

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self._h is None else ("mapped" if self.mapped else "paused")
        return "<gpumem.Buffer tag=%s device=%d size=%d ptr=0x%x%s %s>" % (
            self.tag, self.device, self.size, self.ptr, " backup" if self.backup else "", state)


#: A hook: called with the buffers of one daemon event.
Hook = Callable[[List[Buffer]], None]

# The C hooks of every connected client, kept until gpumem_disconnect has
# returned: a client object dropped without close() stays connected (as in
# C), and the library's thread may still call its hooks.
_live_hooks: Dict[int, Tuple[Any, Any]] = {}

_ROLES = {"worker": _native.ROLE_WORKER, "controller": _native.ROLE_CONTROLLER}
_ROLE_NAMES = {_native.ROLE_WORKER: "worker", _native.ROLE_CONTROLLER: "controller"}


class Client:
    """A session with gpumemd; make one with :func:`connect`.

    A client is a context manager; :meth:`close` disconnects, and the
    daemon frees every buffer it allocated. Methods may be called from
    several threads, but not :meth:`close` while other calls are in flight,
    and none that talks to the daemon from inside a hook.
    """

    def __init__(self, socket: Union[str, "os.PathLike[str]", None] = None,
                 name: Optional[str] = None, role: str = "worker", *,
                 reconnect: bool = True) -> None:
        if socket is not None and not isinstance(socket, (str, os.PathLike)):
            raise TypeError("socket must be a path or None, not %s" % type(socket).__name__)
        path = os.fsencode(socket) if socket is not None else None
        if path is not None and (not path or b"\0" in path):
            raise ValueError("socket must be a non-empty path without NUL bytes")
        if name is None:
            name = "python"
        if not isinstance(name, str):
            raise TypeError("name must be a str or None, not %s" % type(name).__name__)
        bname = name.encode("utf-8")
        if b"\0" in bname or len(bname) > _native.NAME_MAX:
            raise ValueError("name must be at most %d bytes of UTF-8 without NUL" % _native.NAME_MAX)
        if not isinstance(role, str):
            raise TypeError("role must be 'worker' or 'controller', not %s" % type(role).__name__)
        if role not in _ROLES:
            raise ValueError("role must be 'worker' or 'controller', not %r" % role)
        _check_bool("reconnect", reconnect)
        self._setup(role, name)
        lib = self._lib
        out = _native.c_client_p()
        flags = 0 if reconnect else _native.CONNECT_NO_RECONNECT
        rc = lib.gpumem_connect(path, bname, _ROLES[role], flags, ctypes.byref(out))
        if rc < 0:
            raise _last_error(lib, rc)
        self._c = out.value
        _live_hooks[self._c] = (self._c_pre, self._c_post)

    def _setup(self, role: str, name: str) -> None:
        """The state of a client object, before it has a library client."""
        self._c: Optional[int] = None
        self._borrowed = False
        self._lock = threading.Lock()
        self._buffers: Dict[int, Buffer] = {}
        self._freeing: Dict[int, Buffer] = {}
        # Buffers that only hooks have seen (the library's sub-allocation
        # buffers, or a buffer whose alloc has not returned yet): handed to
        # hooks, never freed or closed through here.
        self._seen: "weakref.WeakValueDictionary[int, Buffer]" = weakref.WeakValueDictionary()
        self._hooks: Dict[str, Optional[Hook]] = {"pre_unmap": None, "post_remap": None}
        self._hook_errors: List[BaseException] = []
        self.role = role
        self.name = name
        self._lib = _native.load()
        # The C hooks are made once and live as long as the client: the
        # library's thread may be about to call one while set_hooks runs.
        me = weakref.ref(self)

        def pre(c: Any, bufs: Any, n: int, user: Any) -> None:
            cl = me()
            if cl is not None:
                cl._run_hook("pre_unmap", bufs, n)

        def post(c: Any, bufs: Any, n: int, user: Any) -> None:
            cl = me()
            if cl is not None:
                cl._run_hook("post_remap", bufs, n)

        self._c_pre = _native.HOOK(pre)
        self._c_post = _native.HOOK(post)

    @classmethod
    def _borrow(cls, ptr: int, name: str) -> "Client":
        """A client object over a library client that Python did not
        connect (the default client): never disconnected from here."""
        self = cls.__new__(cls)
        self._setup("worker", name)
        self._c = ptr
        self._borrowed = True
        _live_hooks[ptr] = (self._c_pre, self._c_post)
        return self

    # Plumbing.

    def _ptr(self) -> int:
        c = self._c
        if c is None:
            raise ValueError("the client is closed")
        return c

    def _talk(self) -> int:
        """The client pointer, for a call that talks to the daemon."""
        if _in_hook():
            raise RuntimeError("a gpumem hook must not call functions that talk to the daemon")
        return self._ptr()

    def _wrap(self, handle: int, own: bool = True) -> Buffer:
        """The one Buffer of a library handle. own: the handle is this
        client's to free (alloc returned it) and joins :attr:`buffers`;
        otherwise (a hook's) the object is only looked up or made: a hook
        also sees the buffers the library sub-allocates from, which must
        never be freed as a whole from here."""
        with self._lock:
            b = self._buffers.get(handle) or self._freeing.get(handle)
            if b is None:
                b = self._seen.pop(handle, None) if own else self._seen.get(handle)
                if b is None:
                    b = Buffer(self, handle)
                if own:
                    self._buffers[handle] = b
                else:
                    self._seen[handle] = b
            return b

    def _free(self, b: Buffer, by_ptr: bool = False) -> None:
        c = self._talk()
        h = b._handle()
        with self._lock:
            if h not in self._buffers:
                raise ValueError("buffer %s at 0x%x is not one this client allocated (a hook "
                                 "shows the buffers the library sub-allocates from too)"
                                 % (b.tag, b.ptr))
            del self._buffers[h]
            self._freeing[h] = b
        rc = (self._lib.gpumem_free_ptr(c, b.ptr) if by_ptr else self._lib.gpumem_free(c, h))
        with self._lock:
            del self._freeing[h]
            # A free that timed out leaves the buffer to the library, which
            # releases it when the daemon answers.
            if rc < 0 and rc != ErrorCode.TIMEOUT:
                self._buffers[h] = b
            else:
                b._h = None
        if rc < 0:
            raise _last_error(self._lib, rc)

    def _run_hook(self, which: str, bufs: Any, n: int) -> None:
        """Run on the library's thread for each unmap and remap event."""
        try:
            buffers = [self._wrap(bufs[i], own=False) for i in range(n)]
        except BaseException as e:  # pragma: no cover (out of memory)
            self._hook_errors.append(e)
            return
        fn = self._hooks.get(which)
        _hook_state.depth = getattr(_hook_state, "depth", 0) + 1
        try:
            if fn is not None:
                fn(buffers)
        except BaseException as e:
            self._hook_errors.append(e)
            sys.stderr.write("gpumem: exception in %s hook (the %s goes on):\n" % (
                which, "unmap" if which == "pre_unmap" else "remap"))
            traceback.print_exc()
        finally:
            _hook_state.depth -= 1
        if which == "pre_unmap" and self._c is not None:
            # What the library does when no hook is set: wait for the devices.
            for d in sorted({b.device for b in buffers}):
                self._lib.gpumem_sync(self._c, d)

    # Properties.

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._c is None

    @property
    def backend(self) -> str:
        """The daemon's backend: "host", "cuda" or "hip"."""
        return _text(self._lib.gpumem_backend(self._ptr()))

    @property
    def granularity(self) -> int:
        """The allocation granularity; sizes are rounded up to a multiple."""
        return self._lib.gpumem_granularity(self._ptr())

    @property
    def device_count(self) -> int:
        """The number of the daemon's devices this process can see (devices
        0..device_count-1 in this process's numbering)."""
        return self._lib.gpumem_device_count(self._ptr())

    @property
    def buffers(self) -> List[Buffer]:
        """The live buffers of this client that Python knows."""
        with self._lock:
            return list(self._buffers.values())

    @property
    def hook_errors(self) -> List[BaseException]:
        """Exceptions raised by hooks (printed to stderr when they happened)."""
        return list(self._hook_errors)

    # Workers.

    def alloc(self, tag: str, size: int, device: int = 0, backup: bool = False, *,
              allow_paused: bool = False, backup_release: bool = False,
              backup_pageable: bool = False, backup_disk: bool = False) -> Buffer:
        """Allocate a buffer of at least ``size`` bytes tagged ``tag`` on
        ``device`` (this process's numbering, as CUDA_VISIBLE_DEVICES makes
        it), mapped and ready. ``backup=True`` makes its contents survive a
        pause; with ``backup_release=True`` the backup's host memory is let
        go of after each resume and made again (counted against the
        daemon's --backup-limit) at the next pause, instead of being kept
        for the buffer's life. ``backup_pageable=True``: the backup is
        pageable host memory, outside --backup-limit, which the daemon
        copies (torch_memory_saver's cpu_backup_backend "mmap").
        ``backup_disk=True``: while paused the backup is in a file of the
        daemon's --backup-dir, in host memory only while a pause or resume
        runs (its host memory lets go as with ``backup_release``; API 1.9).
        ``allow_paused=True`` allows allocating in a paused tag (the buffer
        then starts paused); otherwise that fails with TAG_PAUSED."""
        out = _native.c_buffer_p()
        self._allocate("gpumem_alloc", out, tag, size, device, backup, allow_paused,
                       backup_release, backup_pageable, backup_disk)
        return self._wrap(out.value)

    def alloc_persistent(self, name: str, tag: str, size: int, device: int = 0,
                         backup: bool = False, *, allow_paused: bool = False,
                         backup_release: bool = False, backup_pageable: bool = False,
                         backup_disk: bool = False) -> Buffer:
        """Allocate a persistent buffer named ``name`` (new among this
        uid's), as :meth:`alloc` does (API 1.12). The daemon keeps it,
        memory and contents, when this process frees it (:meth:`Buffer.free`
        lets go of it here only) or ends, charged to this uid; a process of
        this uid takes it again with :meth:`attach`, and only :meth:`drop`
        frees it. A name in use raises an Error with code WRONG_STATE."""
        bname = _check_tag(name, "name")
        out = _native.c_buffer_p()
        btag = _check_tag(tag)
        size = _check_int("size", size, 1, _U64)
        device = _check_int("device", device, 0, _I32)
        flags = _check_flags(backup, allow_paused, backup_release, backup_pageable, backup_disk)
        c = self._talk()
        rc = self._lib.gpumem_alloc_persistent(c, bname, btag, device, size, flags,
                                               ctypes.byref(out))
        if rc < 0:
            raise _last_error(self._lib, rc)
        return self._wrap(out.value)

    def attach(self, name: str, wait: Optional[float] = None) -> Buffer:
        """Take this uid's persistent buffer ``name`` that no process holds:
        mapped at a new address with the contents it had (reserved only
        while its tag is paused, mapped at the resume), with its tag,
        device and flags (API 1.12). NOT_FOUND when there is none of that
        name, WRONG_STATE while a process holds it or a pause or resume has
        it; with ``wait`` (seconds, at most 600), a standby's failover: it
        waits that long for the holder to free it or end, and takes it the
        moment it does (WRONG_STATE if the wait ends first)."""
        bname = _check_tag(name, "name")
        ms = 0
        if wait is not None:
            if not 0 <= wait <= 600:
                raise ValueError("wait: 0 to 600 seconds, not %r" % (wait,))
            ms = int(wait * 1000)
        out = _native.c_buffer_p()
        c = self._talk()
        rc = self._lib.gpumem_attach_wait(c, bname, ms, ctypes.byref(out))
        if rc < 0:
            raise _last_error(self._lib, rc)
        return self._wrap(out.value)

    def drop(self, name: str, uid: Optional[int] = None) -> int:
        """Free the persistent buffer ``name`` that no process holds: this
        uid's, or for a controller ``uid``'s (default: its own). Returns
        the device bytes freed (0 for a paused one) (API 1.12)."""
        bname = _check_tag(name, "name")
        u = os.getuid() if uid is None else _check_int("uid", uid, 0, _U32)
        freed = ctypes.c_uint64(0)
        c = self._talk()
        rc = self._lib.gpumem_drop(c, bname, u, ctypes.byref(freed))
        if rc < 0:
            raise _last_error(self._lib, rc)
        return freed.value

    def _allocate(self, fn: str, out: Any, tag: str, size: int, device: int, backup: bool,
                  allow_paused: bool, backup_release: bool = False,
                  backup_pageable: bool = False, backup_disk: bool = False) -> None:
        """Call the library's ``fn`` (gpumem_alloc or gpumem_malloc) with
        the checked arguments and ``out`` for its result; raise its error."""
        btag = _check_tag(tag)
        size = _check_int("size", size, 1, _U64)
        device = _check_int("device", device, 0, _I32)
        flags = _check_flags(backup, allow_paused, backup_release, backup_pageable, backup_disk)
        c = self._talk()
        rc = getattr(self._lib, fn)(c, btag, device, size, flags, ctypes.byref(out))
        if rc < 0:
            raise _last_error(self._lib, rc)

    def set_hooks(self, pre_unmap: Optional[Hook] = None,
                  post_remap: Optional[Hook] = None) -> None:
        """Set the callables run with the list of :class:`Buffer` of each
        daemon event: ``pre_unmap`` before they are unmapped (the package
        then waits for their devices, as the library does without a hook),
        ``post_remap`` after they are mapped again. None removes a hook.

        Hooks run on the library's thread, which answers the daemon: they
        must return promptly and must not call methods that talk to the
        daemon (those raise RuntimeError there). An exception in a hook is
        printed and kept in :attr:`hook_errors`; the unmap or remap goes on."""
        for what, f in (("pre_unmap", pre_unmap), ("post_remap", post_remap)):
            if f is not None and not callable(f):
                raise TypeError("%s must be callable or None" % what)
        c = self._ptr()
        self._hooks = {"pre_unmap": pre_unmap, "post_remap": post_remap}
        null = _native.HOOK()
        self._lib.gpumem_set_hooks(c, self._c_pre if pre_unmap else null,
                                   self._c_post if post_remap else null, None)

    # Controllers.

    def _op(self, resume: bool, tags: Tuple[Any, ...], devices: Any, timeout: Any,
            max_residual: Any, own: Any, pids: Any, session_prefix: Any,
            release_context: Any = False, wait: Any = None) -> OpResult:
        btags = _check_tags(tags)
        devs = _check_devices(devices)
        opts = _native.op_options_init()
        opts.timeout_ms = _check_timeout(timeout)
        if max_residual is not None:
            # On the wire 0 is "no limit"; here 0 means nothing may remain.
            opts.max_residual = max(1, _check_int("max_residual", max_residual, 0, _U64))
        own = _check_bool("own", own)
        plist = _check_pids(pids)
        prefix = _check_prefix(session_prefix)
        if own and (plist or prefix is not None):
            raise ValueError("own=True covers this client's buffers only: no pids or "
                             "session_prefix")
        opts.scope = _native.SCOPE_OWN if own else _native.SCOPE_NODE
        cpids = (ctypes.c_uint32 * len(plist))(*plist) if plist else None
        opts.pids = cpids
        opts.npids = len(plist)
        opts.session_prefix = prefix
        opts.release_context = int(_check_bool("release_context", release_context))
        opts.wait_ms = _check_timeout(wait, "wait")
        if opts.wait_ms > _native.MAX_WAIT_MS:
            raise ValueError("wait too large: %r seconds (at most %d)"
                             % (wait, _native.MAX_WAIT_MS // 1000))
        c = self._talk()
        ctags = (ctypes.c_char_p * len(btags))(*btags) if btags else None
        cdevs = (ctypes.c_int * len(devs))(*devs) if devs else None
        rep = ctypes.POINTER(_native.OpReport)()
        fn = self._lib.gpumem_resume if resume else self._lib.gpumem_pause
        rc = fn(c, ctags, len(btags), cdevs, len(devs), ctypes.byref(opts), ctypes.byref(rep))
        err = _last_error(self._lib, rc) if rc < 0 else None
        try:
            result = OpResult(rep.contents) if rep else None
        finally:
            self._lib.gpumem_op_report_free(rep)
        if err is None:
            assert result is not None
            return result
        if result is not None and result.error:
            e = result.error
            raise Error(rc, e["code"], e["message"], e["pids"], e["bytes_held"],
                        e["buffers_held"], e["bytes_needed"], e["bytes_free"],
                        result.checks, result)
        raise err

    def pause(self, *tags: str, devices: Optional[Iterable[int]] = None,
              timeout: Optional[float] = None, max_residual: Optional[int] = None,
              own: bool = False, pids: Optional[Iterable[int]] = None,
              session_prefix: Optional[str] = None,
              release_context: bool = False) -> OpResult:
        """Pause the buffers of ``tags`` (none: every tag).

        Scope: by default every session's buffers on the node (controllers
        only), narrowed to the sessions of ``pids`` and to sessions whose
        name starts with ``session_prefix`` when given; ``own=True``
        pauses this client's own buffers only (any role; no pids or
        prefix then). devices: this process's device numbers, None for
        all. timeout: seconds each owner may take to answer (None: the
        daemon's --ack-timeout). max_residual: fail with RESIDUAL_EXCEEDED
        when a device the pause touched still holds more than this many
        bytes outside gpumemd (0: nothing may remain; None: no limit).
        release_context: then release the device state (context, graph
        pools, cached blocks) of each worker process the pause covers that
        connected with release_context (or GPUMEM_RELEASE_CONTEXT=1) and
        maps nothing of the daemon's; :attr:`OpResult.releases` says what
        each moved to host memory, and the resume brings it back. One that
        may not be released raises :class:`Error` RELEASE_REFUSED (the
        pause itself done).
        Pausing a paused tag succeeds and changes nothing; naming nothing
        that exists raises :class:`Error` NOT_FOUND."""
        return self._op(False, tags, devices, timeout, max_residual, own, pids,
                        session_prefix, release_context)

    def resume(self, *tags: str, devices: Optional[Iterable[int]] = None,
               timeout: Optional[float] = None, own: bool = False,
               pids: Optional[Iterable[int]] = None,
               session_prefix: Optional[str] = None,
               wait: Optional[float] = None) -> OpResult:
        """Resume paused buffers selected as :meth:`pause` selects them, all
        or nothing: with too little device memory nothing changes and
        :class:`Error` OUT_OF_MEMORY says how much is needed. wait: seconds
        (at most 600) to wait for the room where a device lacks it (the
        trainer may still be letting go) instead of failing at once;
        :attr:`OpResult.waited_us` says how long it waited (gpumemd 1.10).
        Operations queue behind a waiting resume."""
        return self._op(True, tags, devices, timeout, None, own, pids, session_prefix,
                        wait=wait)

    def set_request_timeout(self, seconds: Optional[float]) -> None:
        """How long each request waits for the daemon's answer before it
        raises :class:`Error` TIMEOUT (None: the library's default, 30 s).
        A pause or resume waits this long on top of its owner timeout."""
        ms = _check_timeout(seconds, "seconds")
        self._lib.gpumem_set_request_timeout(self._ptr(), ms)

    def set_keep_free(self, nbytes: int) -> None:
        """Keep nbytes of a device free: each later allocation of this
        client that takes device memory raises :class:`Error`
        OUT_OF_MEMORY where it would leave less free by the driver's
        figure (0: no margin), as torch_memory_saver's memory_margin_bytes
        does. A daemon older than 1.7 then refuses allocations (VERSION)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise TypeError("nbytes must be an int, not %s" % type(nbytes).__name__)
        if nbytes < 0 or nbytes >= 1 << 64:
            raise ValueError("nbytes must be in 0..2**64-1, got %d" % nbytes)
        self._lib.gpumem_set_keep_free(self._ptr(), nbytes)

    # Sub-allocation (gpumem_malloc).

    def malloc(self, tag: str, size: int, device: int = 0, backup: bool = False,
               allow_paused: bool = False, backup_release: bool = False,
               backup_pageable: bool = False, backup_disk: bool = False) -> int:
        """Allocate ``size`` bytes tagged ``tag`` on ``device`` and return
        the address (an int, aligned to at least 512 bytes). Small
        allocations share daemon buffers of the same tag, device and flags
        (``backup_release``, ``backup_pageable``, ``backup_disk`` as for :meth:`alloc`); a
        pause of the tag
        releases them and the address stays valid. Free with
        :meth:`free_ptr`."""
        out = ctypes.c_void_p()
        self._allocate("gpumem_malloc", out, tag, size, device, backup, allow_paused,
                       backup_release, backup_pageable, backup_disk)
        return out.value or 0

    def free_ptr(self, ptr: int) -> None:
        """Free the allocation that starts at ``ptr`` (from :meth:`malloc`,
        or a :class:`Buffer`'s ptr, which then becomes freed). An address
        that starts no allocation raises :class:`Error` NOT_FOUND."""
        ptr = _check_int("ptr", ptr, 1, _U64)
        with self._lock:
            b = next((x for x in self._buffers.values() if x.ptr == ptr), None)
        if b is not None:
            # The library decides what starts at ptr; the object only
            # follows (a buffer of alloc never holds sub-allocations).
            self._free(b, by_ptr=True)
            return
        rc = self._lib.gpumem_free_ptr(self._talk(), ptr)
        if rc < 0:
            raise _last_error(self._lib, rc)

    def backup_read_into(self, ptr: int, size: int, dst: int) -> None:
        """Copy ``size`` bytes of what the last pause saved of this client's
        paused BACKUP buffer that holds ``[ptr, ptr + size)`` (a buffer's
        address, or one inside it or inside an allocation of
        :meth:`malloc`) to host memory at the address ``dst``, while the
        buffer stays paused. Raises :class:`Error`: NOT_FOUND (no buffer
        of this client holds those bytes), WRONG_STATE (mapped, or no
        backup), BACKEND (the copy failed, or the backend's backups cannot
        be handed out), NOMEM (no memory for the copy). A backup on disk
        is read from the daemon's file; a pageable one is first copied
        whole into memory of this process (gpumemd 1.10)."""
        ptr = _check_int("ptr", ptr, 1, _U64)
        size = _check_int("size", size, 0, _U64)
        dst = _check_int("dst", dst, 1, _U64)
        rc = self._lib.gpumem_backup_read(self._talk(), ptr, size, dst)
        if rc < 0:
            raise _last_error(self._lib, rc)

    def backup_read(self, ptr: int, size: int) -> bytearray:
        """:meth:`backup_read_into` a new bytearray of ``size`` bytes."""
        size = _check_int("size", size, 0, _U64)
        out = bytearray(size)
        if size:
            addr = ctypes.addressof((ctypes.c_char * size).from_buffer(out))
            self.backup_read_into(ptr, size, addr)
        return out

    def generation(self, ptr: int) -> int:
        """The :attr:`Buffer.generation` of this client's buffer that holds
        the address ``ptr`` (inside a buffer, or inside an allocation of
        :meth:`malloc`: a tensor's data pointer). Raises :class:`Error`
        NOT_FOUND when none does."""
        ptr = _check_int("ptr", ptr, 1, _U64)
        g = ctypes.c_uint64()
        rc = self._lib.gpumem_generation(self._talk(), ptr, ctypes.byref(g))
        if rc < 0:
            raise _last_error(self._lib, rc)
        return g.value

    def backup_view(self, ptr: int, size: int) -> memoryview:
        """The same bytes as :meth:`backup_read`, without a copy: a
        read-only memoryview of the backup's host memory, valid until the
        buffer is resumed or freed (reading it after that is undefined)."""
        ptr = _check_int("ptr", ptr, 1, _U64)
        size = _check_int("size", size, 1, _U64)
        host = ctypes.c_void_p()
        rc = self._lib.gpumem_backup_view(self._talk(), ptr, size, ctypes.byref(host))
        if rc < 0:
            raise _last_error(self._lib, rc)
        view = memoryview((ctypes.c_char * size).from_address(host.value))
        return view.cast("B").toreadonly()

    def trim(self) -> int:
        """Give the daemon back every pooled buffer that holds no
        allocation; returns the bytes given back."""
        n = self._lib.gpumem_trim(self._talk())
        if n < 0:
            raise _last_error(self._lib, n)
        return n

    def pool_stats(self) -> Dict[str, int]:
        """The sub-allocation figures: allocations, allocated_bytes,
        pooled_buffers, pooled_bytes and daemon_allocs."""
        st = _native.PoolStats()
        st.size = ctypes.sizeof(st)
        rc = self._lib.gpumem_pool_stats(self._ptr(), ctypes.byref(st))
        if rc < 0:
            raise _last_error(self._lib, rc)
        return {name: getattr(st, name) for name, _ in st._fields_ if name != "size"}

    @contextlib.contextmanager
    def _results(self, fn: str, kind: Any, free: str) -> Iterator[Any]:
        """The ``kind`` of structure that the library's ``fn`` fills for
        this client, freed with its ``free`` when the block ends; the
        library's error is raised."""
        c = self._talk()
        p = ctypes.POINTER(kind)()
        rc = getattr(self._lib, fn)(c, ctypes.byref(p))
        if rc < 0:
            raise _last_error(self._lib, rc)
        try:
            yield p.contents
        finally:
            getattr(self._lib, free)(p)

    def status(self) -> Dict[str, Any]:
        """The daemon's view of the node, as a dict with the keys (and
        order) of ``gpumemctl status --json``."""
        lib = self._lib
        with self._results("gpumem_status", _native.Status, "gpumem_status_free") as s:
            devices = [{
                "index": d.node_device, "device": d.device, "node_device": d.node_device,
                "total": d.total, "free": d.free, "managed": d.managed,
                "unmanaged": d.unmanaged, "reserved": d.reserved,
                "daemon_context": bool(d.daemon_context), "bus_id": _text(d.bus_id),
            } for d in (s.devices[i][0] for i in range(s.ndevices))]
            tags = [{
                "name": _text(t.name), "state": _text(lib.gpumem_state_name(t.state)),
                "buffers": t.buffers, "bytes": t.bytes, "paused_buffers": t.paused_buffers,
                "paused_bytes": t.paused_bytes, "backup_bytes": t.backup_bytes,
                "mixed": bool(t.mixed), "transit_buffers": t.transit_buffers,
                "transit_bytes": t.transit_bytes, "owner_uid": t.owner_uid,
                "owned": bool(t.owned), "shared": bool(t.shared),
                "backup_pinned_bytes": t.backup_pinned_bytes,
                "backup_reserved_bytes": t.backup_reserved_bytes,
                "backup_pageable_bytes": t.backup_pageable_bytes,
                "backup_disk_bytes": t.backup_disk_bytes,
                "generation": t.generation,
            } for t in (s.tags[i][0] for i in range(s.ntags))]
            tenants = [{
                "uid": x.uid, "buffers": x.buffers, "bytes": x.bytes,
                "backup_bytes": x.backup_bytes,
                "device_bytes": [x.device_bytes[d] for d in range(x.ndevice_bytes)],
            } for x in (s.tenants[i][0] for i in range(s.ntenants))]
            sessions = [{
                "id": x.id, "pid": x.pid, "uid": x.uid, "name": _text(x.name),
                "role": _ROLE_NAMES.get(x.role, "none"), "buffers": x.buffers,
                "bytes": x.bytes, "residual": x.residual,
                "residual_known": bool(x.residual_known),
                "release_context": bool(x.release_context),
                "context_released": bool(x.context_released),
                "moved_to_host": x.moved_to_host,
            } for x in (s.sessions[i][0] for i in range(s.nsessions))]
            processes = [{
                "pid": q.pid, "device": q.device, "node_device": q.node_device,
                "used": q.used, "managed": q.managed, "residual": q.residual,
                "session_id": q.session_id, "name": _text(q.name),
            } for q in (s.processes[i][0] for i in range(s.nprocesses))]
            return {
                "version": _text(s.version),
                "backend": _text(s.backend),
                "granularity": s.granularity,
                "devices": devices,
                "tags": tags,
                "sessions": sessions,
                "processes_known": bool(s.processes_known),
                "processes": processes,
                "tenants": tenants,
                "quotas": {
                    "buffers_per_uid": s.max_buffers_per_uid,
                    "device_bytes_per_uid": s.max_device_bytes_per_uid,
                    "backup_bytes_per_uid": s.max_backup_bytes_per_uid,
                },
                "grace": {"left_ms": s.grace_left_ms, "waiting": s.grace_waiting},
                "persistent": [_buffer_dict(self._lib, s.persistent[i][0])
                               for i in range(s.npersistent)],
                "total_persistent": s.total_persistent,
                "last_pause_checks": [dict(k) for k in _checks(s.last_pause_checks,
                                                                 s.nlast_pause_checks)],
                "backups": {
                    "reserved": s.backup_reserved, "ready": s.backup_ready,
                    "limit": s.backup_limit,
                    "last_backup_bytes": s.last_backup_bytes,
                    "last_backup_us": s.last_backup_us,
                    "last_restore_bytes": s.last_restore_bytes,
                    "last_restore_us": s.last_restore_us,
                    "disk_bytes": s.backup_disk_bytes,
                    "disk_free": s.backup_disk_free,
                    "dir": _text(s.backup_dir),
                },
            }

    def stats(self) -> Dict[str, Any]:
        """What the daemon did since it started (API 1.3), from one status
        request: ``uptime_ms``, ``bytes_released`` and ``bytes_restored``,
        ``op_counts`` (op, result, count), ``error_counts`` (code, count),
        ``histograms`` (op, cumulative ``count`` per ``le_us`` bound, the
        last 2**64-1 for +Inf, ``total``, ``sum_us``) and ``recent_ops``:
        the pauses and resumes running now (``done`` False, with
        ``bytes_done`` of ``bytes_total`` so far), then the last 16 done,
        newest first. An older daemon gives zeros and empty lists."""
        with self._results("gpumem_status", _native.Status, "gpumem_status_free") as s:
            return _figures(self._lib, s)

    def share(self, tag: str, shared: bool = True) -> None:
        """Let every uid's buffers join ``tag`` (made if it does not
        exist), or, with ``shared=False``, only its owner's again (API 1.4;
        needs a controller). A tag belongs to the uid whose buffer created
        it: another uid's ``alloc`` in it raises an Error with code
        ``PERMISSION_DENIED`` until it is shared."""
        t = _check_tag(tag)
        s = _check_bool("shared", shared)
        c = self._talk()
        rc = self._lib.gpumem_share(c, t, 1 if s else 0)
        if rc < 0:
            raise _last_error(self._lib, rc)

    def list(self) -> List[Dict[str, Any]]:
        """The buffers this session may see (a controller sees all), as
        dicts with the keys of ``gpumemctl list --json``."""
        lib = self._lib
        with self._results("gpumem_list", _native.BufferList, "gpumem_list_free") as lst:
            return [_buffer_dict(lib, lst.buffers[i][0]) for i in range(lst.nbuffers)]

    def close(self) -> None:
        """Disconnect: every buffer of this client is unmapped and freed by
        the daemon, and every :class:`Buffer` object becomes freed. Closing
        a closed client does nothing. The object :func:`default_client`
        returns for the library's own client only lets go of it: that
        client stays connected, with its buffers."""
        if self._c is None:
            return
        if _in_hook():
            raise RuntimeError("a gpumem hook must not close a client")
        global _default
        with _default_lock:
            if _default is self:
                if not self._borrowed:
                    self._lib.gpumem_set_default_client(None)
                _default = None
            c, self._c = self._c, None
            if self._borrowed:
                _borrowed.pop(c, None)
        if not self._borrowed:
            self._lib.gpumem_disconnect(c)
            _live_hooks.pop(c, None)
        with self._lock:
            for b in list(self._buffers.values()) + list(self._seen.values()):
                b._h = None
            self._buffers.clear()
            self._seen.clear()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._c is None:
            return "<gpumem.Client %s %r closed>" % (self.role, self.name)
        return "<gpumem.Client %s %r backend=%s buffers=%d%s>" % (
            self.role, self.name, self.backend, len(self._buffers),
            " (the library's default client)" if self._borrowed else "")


def connect(socket: Union[str, "os.PathLike[str]", None] = None, name: Optional[str] = None,
            role: str = "worker", *, reconnect: bool = True) -> Client:
    """Connect to gpumemd and return a :class:`Client`.

    socket: the daemon's socket (None: $GPUMEM_SOCKET, else
    /run/gpumemd/gpumemd.sock). name: how status shows this process
    (default "python"). role: "worker" (allocates buffers) or "controller"
    (pauses and resumes tags; needs the daemon's permission). reconnect:
    when the daemon restarts, keep every buffer mapped and re-register it
    with the new daemon (the library's default); False makes calls fail
    with DISCONNECTED from then on.
    """
    return Client(socket, name, role, reconnect=reconnect)


# The process's default client, for gpumem_torch_alloc and the preload
# library; kept here so that the object outlives its registration.
_default: Optional[Client] = None
_default_lock = threading.Lock()
# The objects over library clients that Python did not connect, by pointer.
_borrowed: Dict[int, Client] = {}


def default_client() -> Client:
    """The process's default client (gpumem_default_client): the one
    :func:`set_default_client` made, else the one the library uses, which
    it connects on first use (as a worker, to $GPUMEM_SOCKET, named
    $GPUMEM_NAME, else "pid-<pid>"), as libgpumem_preload.so does. That
    library client is lent, not owned: ``close()`` on its object only
    lets go of it, and it stays connected with its buffers. Raises
    :class:`Error` when no client can be connected."""
    lib = _native.load()
    p = lib.gpumem_default_client()
    if not p:
        raise _last_error(lib, ErrorCode.CONNECT)
    with _default_lock:
        if _default is not None and _default._c == p:
            return _default
        c = _borrowed.get(p)
        if c is None:
            c = Client._borrow(p, os.environ.get("GPUMEM_NAME") or "pid-%d" % os.getpid())
            _borrowed[p] = c
        return c


def set_default_client(client: Optional[Client]) -> None:
    """Make ``client`` the process's default client (None: none), the one
    gpumem_torch_alloc and gpumem_torch_free use. Closing the client
    clears it."""
    global _default
    if client is not None and not isinstance(client, Client):
        raise TypeError("client must be a gpumem.Client or None, not %s"
                        % type(client).__name__)
    lib = _native.load()
    with _default_lock:
        lib.gpumem_set_default_client(client._ptr() if client is not None else None)
        _default = client


def set_thread_tag(tag: Optional[str], backup: bool = False,
                   allow_paused: bool = False, backup_release: bool = False,
                   backup_pageable: bool = False, backup_disk: bool = False) -> None:
    """Set the calling thread's tag (None clears it): gpumem_torch_alloc
    allocates with it and with these flags (as :meth:`Client.alloc`'s)."""
    btag = _check_tag(tag) if tag is not None else None
    flags = _check_flags(backup, allow_paused, backup_release, backup_pageable, backup_disk)
    lib = _native.load()
    rc = lib.gpumem_set_thread_tag(btag, flags)
    if rc < 0:
        raise _last_error(lib, rc)


def thread_tag() -> Tuple[Optional[str], int]:
    """The calling thread's tag (None if none) and its flags."""
    lib = _native.load()
    flags = ctypes.c_uint(0)
    t = lib.gpumem_thread_tag(ctypes.byref(flags))
    return (_text(t) if t is not None else None, flags.value)
