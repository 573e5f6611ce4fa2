"""ctypes declarations of libgpumem (include/gpumem.h) and how it is found.

Every struct here mirrors the C header field by field, with the C names,
so that tests can compare the layouts with what a C compiler makes of the
header. Nothing in this module talks to the daemon.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from pathlib import Path
from typing import Dict, List, Optional, Type

# enum gpumem_role
ROLE_WORKER = 1
ROLE_CONTROLLER = 2

# enum gpumem_flag
FLAG_BACKUP = 1
FLAG_IPC_LEGACY = 2
FLAG_ALLOW_PAUSED = 4
FLAG_BACKUP_RELEASE = 8
FLAG_BACKUP_PAGEABLE = 16
FLAG_BACKUP_DISK = 32
FLAG_PERSIST = 64

# enum gpumem_connect_flag
CONNECT_NO_THREAD = 1
CONNECT_NO_RECONNECT = 2

# enum gpumem_scope
SCOPE_NODE = 0
SCOPE_OWN = 1

# GPUMEM_DEFAULT_REQUEST_TIMEOUT_MS
DEFAULT_REQUEST_TIMEOUT_MS = 30000

# The library's limits that the header does not export (common/wire.h).
TAG_MAX = 63
NAME_MAX = 127
MAX_TAGS = 64
MAX_DEVICES = 64
MAX_PIDS = 256  # pids in one pause or resume scope (WIRE_MAX_PIDS)
MAX_WAIT_MS = 600000  # a resume's wait for room (WIRE_MAX_WAIT_MS)

c_client_p = ctypes.c_void_p
c_buffer_p = ctypes.c_void_p


class OpOptions(ctypes.Structure):
    """struct gpumem_op_options."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("timeout_ms", ctypes.c_uint),
        ("max_residual", ctypes.c_uint64),
        ("scope", ctypes.c_int),
        ("pids", ctypes.POINTER(ctypes.c_uint32)),
        ("npids", ctypes.c_size_t),
        ("session_prefix", ctypes.c_char_p),
        ("release_context", ctypes.c_int),
        ("wait_ms", ctypes.c_uint),
    ]


class DeviceCheck(ctypes.Structure):
    """struct gpumem_device_check."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("device", ctypes.c_int),
        ("node_device", ctypes.c_uint),
        ("released", ctypes.c_uint64),
        ("free_before", ctypes.c_uint64),
        ("free_after", ctypes.c_uint64),
        ("shortfall", ctypes.c_uint64),
        ("residual", ctypes.c_uint64),
        ("residual_known", ctypes.c_int),
        ("exit_wait_ms", ctypes.c_uint32),
        ("exit_listed", ctypes.c_uint32),
        ("exit_listed_pid", ctypes.c_uint32),
        ("used_after", ctypes.c_uint64),
    ]


class OpDetail(ctypes.Structure):
    """struct gpumem_op_detail."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("tag", ctypes.c_char_p),
        ("device", ctypes.c_int),
        ("node_device", ctypes.c_uint),
        ("buffers", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
    ]


class ProcessRelease(ctypes.Structure):
    """struct gpumem_process_release."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("pid", ctypes.c_uint32),
        ("released", ctypes.c_int),
        ("moved_to_host", ctypes.c_uint64),
        ("elapsed_us", ctypes.c_uint64),
        ("why", ctypes.c_char_p),
    ]


class ProcessStatus(ctypes.Structure):
    """struct gpumem_process_status."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("pid", ctypes.c_uint32),
        ("device", ctypes.c_int),
        ("node_device", ctypes.c_uint),
        ("used", ctypes.c_uint64),
        ("managed", ctypes.c_uint64),
        ("residual", ctypes.c_uint64),
        ("session_id", ctypes.c_uint64),
        ("name", ctypes.c_char_p),
    ]


class OpReport(ctypes.Structure):
    """struct gpumem_op_report (allocated by the library; read only)."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("error", ctypes.c_int),
        ("code", ctypes.c_char_p),
        ("message", ctypes.c_char_p),
        ("buffers", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("backup_bytes", ctypes.c_uint64),
        ("skipped", ctypes.c_uint64),
        ("elapsed_us", ctypes.c_uint64),
        ("backup_us", ctypes.c_uint64),
        ("bytes_needed", ctypes.c_uint64),
        ("bytes_free", ctypes.c_uint64),
        ("buffers_held", ctypes.c_uint64),
        ("bytes_held", ctypes.c_uint64),
        ("npids", ctypes.c_size_t),
        ("pids", ctypes.POINTER(ctypes.c_uint32)),
        ("nchecks", ctypes.c_size_t),
        ("checks", ctypes.POINTER(ctypes.POINTER(DeviceCheck))),
        ("ndetails", ctypes.c_size_t),
        ("details", ctypes.POINTER(ctypes.POINTER(OpDetail))),
        ("nreleases", ctypes.c_size_t),
        ("releases", ctypes.POINTER(ctypes.POINTER(ProcessRelease))),
        ("nprocesses", ctypes.c_size_t),
        ("processes", ctypes.POINTER(ctypes.POINTER(ProcessStatus))),
        ("waited_us", ctypes.c_uint64),
    ]


class DeviceStatus(ctypes.Structure):
    """struct gpumem_device_status."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("device", ctypes.c_int),
        ("node_device", ctypes.c_uint),
        ("total", ctypes.c_uint64),
        ("free", ctypes.c_uint64),
        ("managed", ctypes.c_uint64),
        ("unmanaged", ctypes.c_uint64),
        ("reserved", ctypes.c_uint64),
        ("daemon_context", ctypes.c_int),
        ("bus_id", ctypes.c_char_p),
    ]


class TagStatus(ctypes.Structure):
    """struct gpumem_tag_status."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("name", ctypes.c_char_p),
        ("state", ctypes.c_int),
        ("buffers", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("backup_bytes", ctypes.c_uint64),
        ("paused_buffers", ctypes.c_uint64),
        ("paused_bytes", ctypes.c_uint64),
        ("mixed", ctypes.c_int),
        ("transit_buffers", ctypes.c_uint64),
        ("transit_bytes", ctypes.c_uint64),
        ("owner_uid", ctypes.c_uint32),
        ("owned", ctypes.c_int),
        ("shared", ctypes.c_int),
        ("backup_pinned_bytes", ctypes.c_uint64),
        ("backup_reserved_bytes", ctypes.c_uint64),
        ("backup_pageable_bytes", ctypes.c_uint64),
        ("backup_disk_bytes", ctypes.c_uint64),
        ("generation", ctypes.c_uint64),
    ]


class SessionStatus(ctypes.Structure):
    """struct gpumem_session_status."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("id", ctypes.c_uint64),
        ("pid", ctypes.c_uint32),
        ("uid", ctypes.c_uint32),
        ("name", ctypes.c_char_p),
        ("role", ctypes.c_int),
        ("buffers", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("residual", ctypes.c_uint64),
        ("residual_known", ctypes.c_int),
        ("release_context", ctypes.c_int),
        ("context_released", ctypes.c_int),
        ("moved_to_host", ctypes.c_uint64),
    ]


class OpRecord(ctypes.Structure):
    """struct gpumem_op_record (1.3)."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("op", ctypes.c_char_p),
        ("ntags", ctypes.c_size_t),
        ("tags", ctypes.POINTER(ctypes.c_char_p)),
        ("pid", ctypes.c_uint32),
        ("done", ctypes.c_int),
        ("result", ctypes.c_int),
        ("bytes_done", ctypes.c_uint64),
        ("bytes_total", ctypes.c_uint64),
        ("copied_bytes", ctypes.c_uint64),
        ("started_ms", ctypes.c_uint64),
        ("duration_us", ctypes.c_uint64),
    ]


class Counter(ctypes.Structure):
    """struct gpumem_counter (1.3)."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("op", ctypes.c_char_p),
        ("name", ctypes.c_char_p),
        ("count", ctypes.c_uint64),
    ]


class Histogram(ctypes.Structure):
    """struct gpumem_histogram (1.3)."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("op", ctypes.c_char_p),
        ("nbuckets", ctypes.c_size_t),
        ("le_us", ctypes.POINTER(ctypes.c_uint64)),
        ("count", ctypes.POINTER(ctypes.c_uint64)),
        ("total", ctypes.c_uint64),
        ("sum_us", ctypes.c_uint64),
    ]


class TenantStatus(ctypes.Structure):
    """struct gpumem_tenant_status (1.4)."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("uid", ctypes.c_uint32),
        ("buffers", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("backup_bytes", ctypes.c_uint64),
        ("ndevice_bytes", ctypes.c_size_t),
        ("device_bytes", ctypes.POINTER(ctypes.c_uint64)),
    ]


class BufferInfo(ctypes.Structure):
    """struct gpumem_buffer_info."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("id", ctypes.c_uint64),
        ("session_id", ctypes.c_uint64),
        ("pid", ctypes.c_uint32),
        ("tag", ctypes.c_char_p),
        ("device", ctypes.c_int),
        ("node_device", ctypes.c_uint),
        ("bytes", ctypes.c_uint64),
        ("flags", ctypes.c_uint),
        ("state", ctypes.c_int),
        ("name", ctypes.c_char_p),
        ("age_ms", ctypes.c_uint64),
        ("last_pid", ctypes.c_uint32),
        ("last_name", ctypes.c_char_p),
        ("idle_ms", ctypes.c_uint64),
        ("uid", ctypes.c_uint32),
    ]


class Status(ctypes.Structure):
    """struct gpumem_status (allocated by the library; read only)."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("backend", ctypes.c_char_p),
        ("granularity", ctypes.c_uint64),
        ("ndevices", ctypes.c_size_t),
        ("ntags", ctypes.c_size_t),
        ("nsessions", ctypes.c_size_t),
        ("devices", ctypes.POINTER(ctypes.POINTER(DeviceStatus))),
        ("tags", ctypes.POINTER(ctypes.POINTER(TagStatus))),
        ("sessions", ctypes.POINTER(ctypes.POINTER(SessionStatus))),
        ("backup_reserved", ctypes.c_uint64),
        ("backup_limit", ctypes.c_uint64),
        ("backup_ready", ctypes.c_uint64),
        ("last_backup_bytes", ctypes.c_uint64),
        ("last_backup_us", ctypes.c_uint64),
        ("last_restore_bytes", ctypes.c_uint64),
        ("last_restore_us", ctypes.c_uint64),
        ("nprocesses", ctypes.c_size_t),
        ("processes", ctypes.POINTER(ctypes.POINTER(ProcessStatus))),
        ("processes_known", ctypes.c_int),
        ("nlast_pause_checks", ctypes.c_size_t),
        ("last_pause_checks", ctypes.POINTER(ctypes.POINTER(DeviceCheck))),
        ("version", ctypes.c_char_p),
        ("uptime_ms", ctypes.c_uint64),
        ("bytes_released", ctypes.c_uint64),
        ("bytes_restored", ctypes.c_uint64),
        ("nop_counts", ctypes.c_size_t),
        ("op_counts", ctypes.POINTER(ctypes.POINTER(Counter))),
        ("nerror_counts", ctypes.c_size_t),
        ("error_counts", ctypes.POINTER(ctypes.POINTER(Counter))),
        ("nhistograms", ctypes.c_size_t),
        ("histograms", ctypes.POINTER(ctypes.POINTER(Histogram))),
        ("nrecent_ops", ctypes.c_size_t),
        ("recent_ops", ctypes.POINTER(ctypes.POINTER(OpRecord))),
        ("fd_limit", ctypes.c_uint64),
        ("fds_open", ctypes.c_uint64),
        ("fds_parked", ctypes.c_uint64),
        ("queued_bytes", ctypes.c_uint64),
        ("connections_refused", ctypes.c_uint64),
        ("ntenants", ctypes.c_size_t),
        ("tenants", ctypes.POINTER(ctypes.POINTER(TenantStatus))),
        ("max_buffers_per_uid", ctypes.c_uint64),
        ("max_device_bytes_per_uid", ctypes.c_uint64),
        ("max_backup_bytes_per_uid", ctypes.c_uint64),
        ("grace_left_ms", ctypes.c_uint64),
        ("grace_waiting", ctypes.c_uint64),
        ("backup_dir", ctypes.c_char_p),
        ("backup_disk_bytes", ctypes.c_uint64),
        ("backup_disk_free", ctypes.c_uint64),
        ("npersistent", ctypes.c_size_t),
        ("persistent", ctypes.POINTER(ctypes.POINTER(BufferInfo))),
        ("total_persistent", ctypes.c_uint64),
    ]


class BufferList(ctypes.Structure):
    """struct gpumem_list (allocated by the library; read only)."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("nbuffers", ctypes.c_size_t),
        ("buffers", ctypes.POINTER(ctypes.POINTER(BufferInfo))),
    ]


class PoolStats(ctypes.Structure):
    """struct gpumem_pool_stats."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("allocations", ctypes.c_uint64),
        ("allocated_bytes", ctypes.c_uint64),
        ("pooled_buffers", ctypes.c_uint64),
        ("pooled_bytes", ctypes.c_uint64),
        ("daemon_allocs", ctypes.c_uint64),
    ]


# The C name of each struct, for the layout test.
STRUCTS: Dict[str, Type[ctypes.Structure]] = {
    "gpumem_op_options": OpOptions,
    "gpumem_device_check": DeviceCheck,
    "gpumem_op_detail": OpDetail,
    "gpumem_op_report": OpReport,
    "gpumem_process_release": ProcessRelease,
    "gpumem_device_status": DeviceStatus,
    "gpumem_tag_status": TagStatus,
    "gpumem_tenant_status": TenantStatus,
    "gpumem_session_status": SessionStatus,
    "gpumem_process_status": ProcessStatus,
    "gpumem_op_record": OpRecord,
    "gpumem_counter": Counter,
    "gpumem_histogram": Histogram,
    "gpumem_status": Status,
    "gpumem_buffer_info": BufferInfo,
    "gpumem_list": BufferList,
    "gpumem_pool_stats": PoolStats,
}

# typedef void (*gpumem_hook)(gpumem_client *, gpumem_buffer *const *, size_t, void *)
HOOK = ctypes.CFUNCTYPE(
    None, c_client_p, ctypes.POINTER(c_buffer_p), ctypes.c_size_t, ctypes.c_void_p
)


def op_options_init() -> OpOptions:
    """GPUMEM_OP_OPTIONS_INIT."""
    return OpOptions(ctypes.sizeof(OpOptions), 0, 0, SCOPE_NODE, None, 0, None)


def _declare(lib: ctypes.CDLL) -> None:
    """Set argtypes and restype of every function the package calls."""
    i, u, u32, u64, sz = ctypes.c_int, ctypes.c_uint, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_size_t
    i64, vp, cp = ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p
    P = ctypes.POINTER
    sig = {
        "gpumem_version": (i, []),
        "gpumem_version_string": (cp, []),
        "gpumem_connect": (i, [cp, cp, i, u, P(c_client_p)]),
        "gpumem_disconnect": (None, [c_client_p]),
        "gpumem_set_request_timeout": (None, [c_client_p, u]),
        "gpumem_set_keep_free": (None, [c_client_p, u64]),
        "gpumem_backend": (cp, [c_client_p]),
        "gpumem_granularity": (u64, [c_client_p]),
        "gpumem_device_count": (u, [c_client_p]),
        "gpumem_alloc": (i, [c_client_p, cp, i, u64, u, P(c_buffer_p)]),
        "gpumem_free": (i, [c_client_p, c_buffer_p]),
        "gpumem_alloc_persistent": (i, [c_client_p, cp, cp, i, u64, u, P(c_buffer_p)]),
        "gpumem_attach": (i, [c_client_p, cp, P(c_buffer_p)]),
        "gpumem_attach_wait": (i, [c_client_p, cp, ctypes.c_uint, P(c_buffer_p)]),
        "gpumem_drop": (i, [c_client_p, cp, u32, P(u64)]),
        "gpumem_buffer_name": (cp, [c_buffer_p]),
        "gpumem_malloc": (i, [c_client_p, cp, i, u64, u, P(vp)]),
        "gpumem_free_ptr": (i, [c_client_p, vp]),
        "gpumem_trim": (i64, [c_client_p]),
        "gpumem_pool_stats": (i, [c_client_p, P(PoolStats)]),
        "gpumem_buffer_ptr": (vp, [c_buffer_p]),
        "gpumem_buffer_size": (u64, [c_buffer_p]),
        "gpumem_buffer_tag": (cp, [c_buffer_p]),
        "gpumem_buffer_device": (i, [c_buffer_p]),
        "gpumem_buffer_id": (u64, [c_buffer_p]),
        "gpumem_buffer_flags": (u, [c_buffer_p]),
        "gpumem_buffer_mapped": (i, [c_buffer_p]),
        "gpumem_buffer_registered": (i, [c_buffer_p]),
        "gpumem_buffer_read": (i, [c_client_p, c_buffer_p, u64, vp, u64]),
        "gpumem_buffer_write": (i, [c_client_p, c_buffer_p, u64, vp, u64]),
        "gpumem_buffer_fill32": (i, [c_client_p, c_buffer_p, u64, u64, u32]),
        "gpumem_sync": (i, [c_client_p, i]),
        "gpumem_backup_read": (i, [c_client_p, vp, u64, vp]),
        "gpumem_generation": (i, [c_client_p, vp, P(u64)]),
        "gpumem_buffer_generation": (u64, [c_buffer_p]),
        "gpumem_backup_view": (i, [c_client_p, vp, u64, P(vp)]),
        "gpumem_set_hooks": (None, [c_client_p, HOOK, HOOK, vp]),
        "gpumem_pause": (i, [c_client_p, P(cp), sz, P(i), sz, P(OpOptions), P(P(OpReport))]),
        "gpumem_resume": (i, [c_client_p, P(cp), sz, P(i), sz, P(OpOptions), P(P(OpReport))]),
        "gpumem_op_report_free": (None, [P(OpReport)]),
        "gpumem_status": (i, [c_client_p, P(P(Status))]),
        "gpumem_share": (i, [c_client_p, ctypes.c_char_p, ctypes.c_int]),
        "gpumem_status_free": (None, [P(Status)]),
        "gpumem_list": (i, [c_client_p, P(P(BufferList))]),
        "gpumem_list_free": (None, [P(BufferList)]),
        "gpumem_strerror": (cp, [i]),
        "gpumem_error_name": (cp, [i]),
        "gpumem_last_error": (cp, []),
        "gpumem_state_name": (cp, [i]),
        "gpumem_set_thread_tag": (i, [cp, u]),
        "gpumem_thread_tag": (cp, [P(u)]),
        "gpumem_set_default_client": (None, [c_client_p]),
        "gpumem_default_client": (c_client_p, []),
    }
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype = res
        f.argtypes = args


def candidates() -> List[str]:
    """Where libgpumem is looked for, in order: $GPUMEM_LIB, the build tree
    next to this package (<repo>/build/lib, when the package is used from
    the source tree), then the system loader's libgpumem.so.1."""
    out: List[str] = []
    env = os.environ.get("GPUMEM_LIB")
    if env:
        return [env]
    repo = Path(__file__).resolve().parent.parent.parent
    for name in ("libgpumem.so.1", "libgpumem.so"):
        p = repo / "build" / "lib" / name
        if p.exists():
            out.append(str(p))
            break
    out.append("libgpumem.so.1")
    found = ctypes.util.find_library("gpumem")
    if found:
        out.append(found)
    return out


_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_path: Optional[str] = None


def _loaded_path(name: str) -> str:
    """The file the loader took for name (a bare soname is looked up in
    /proc/self/maps), else name itself."""
    if os.sep in name:
        return os.path.realpath(name)
    base = os.path.basename(name)
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and os.path.basename(parts[5].strip()).startswith("libgpumem.so"):
                    path = parts[5].strip()
                    if base.startswith("libgpumem") or os.path.basename(path) == base:
                        return path
    except OSError:
        pass
    return name


def library_path() -> str:
    """The path of the libgpumem loaded (loading it first)."""
    load()
    assert _path is not None
    return _path


def load() -> ctypes.CDLL:
    """Load libgpumem once (see candidates()); OSError when not found."""
    global _lib, _path
    with _lock:
        if _lib is not None:
            return _lib
        errors = []
        for path in candidates():
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                errors.append(f"{path}: {e}")
                continue
            _declare(lib)
            _lib = lib
            _path = _loaded_path(path)
            return lib
        raise OSError(
            "cannot load libgpumem (set GPUMEM_LIB to its path): " + "; ".join(errors)
        )
