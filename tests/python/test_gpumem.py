"""The gpumem Python package against a real gpumemd on the host backend."""

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref

import pytest

from conftest import REPO, wait_for

import gpumem
from gpumem import _native

MiB = 1 << 20


def fds():
    return sorted(os.listdir("/proc/self/fd"))


def tag_status(ctl, name):
    for t in ctl.status()["tags"]:
        if t["name"] == name:
            return t
    return None


# The header, as a C compiler reads it.

C_ERRORS = {
    "INVALID": "INVALID_ARGUMENT", "PROTOCOL": "PROTOCOL_ERROR", "VERSION": "VERSION_MISMATCH",
    "PERMISSION": "PERMISSION_DENIED", "NOT_FOUND": "NOT_FOUND", "OUT_OF_MEMORY": "OUT_OF_MEMORY",
    "TAG_PAUSED": "TAG_PAUSED", "CLIENT_TIMEOUT": "CLIENT_TIMEOUT", "LIMIT": "LIMIT_EXCEEDED",
    "WRONG_STATE": "WRONG_STATE", "BACKEND": "BACKEND_ERROR", "INTERNAL": "INTERNAL",
    "CONNECT": "CONNECT", "DISCONNECTED": "DISCONNECTED", "NOMEM": "NOMEM", "MAP": "MAP",
    "NOT_RELEASED": "NOT_RELEASED", "RESIDUAL": "RESIDUAL_EXCEEDED",
    "SHUTTING_DOWN": "SHUTTING_DOWN", "TIMEOUT": "TIMEOUT", "RELEASE_REFUSED": "RELEASE_REFUSED",
}


def test_struct_layouts_and_constants_match_the_header(tmp_path):
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("cc")
    if not cc:
        pytest.skip("no C compiler")
    lines = ['#include <stddef.h>', '#include <stdio.h>', '#include "gpumem.h"',
             "int main(void) {"]
    for cname, st in _native.STRUCTS.items():
        lines.append('printf("%s %%zu\\n", sizeof(struct %s));' % (cname, cname))
        for field, _ in st._fields_:
            lines.append('printf("%s.%s %%zu\\n", offsetof(struct %s, %s));'
                         % (cname, field, cname, field))
    lines.append("struct gpumem_op_options o = GPUMEM_OP_OPTIONS_INIT;")
    lines.append('printf("init %zu %u %llu\\n", o.size, o.timeout_ms, '
                 '(unsigned long long)o.max_residual);')
    for c in C_ERRORS:
        lines.append('printf("E_%s %%d\\n", GPUMEM_E_%s);' % (c, c))
    for c in ("ROLE_WORKER", "ROLE_CONTROLLER", "BACKUP", "IPC_LEGACY", "ALLOW_PAUSED",
              "CONNECT_NO_RECONNECT"):
        lines.append('printf("%s %%d\\n", (int)GPUMEM_%s);' % (c, c))
    lines.append('printf("socket %s\\n", GPUMEM_DEFAULT_SOCKET);')
    lines.append("return 0; }")
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "layout"
    subprocess.run([cc, "-std=c11", "-I", str(REPO / "include"), str(src), "-o", str(exe)],
                   check=True)
    got = dict(line.split(" ", 1) for line in
               subprocess.run([str(exe)], capture_output=True, text=True,
                              check=True).stdout.splitlines())
    for cname, st in _native.STRUCTS.items():
        assert int(got[cname]) == ctypes.sizeof(st), cname
        for field, _ in st._fields_:
            assert int(got["%s.%s" % (cname, field)]) == getattr(st, field).offset, (cname, field)
    init = _native.op_options_init()
    assert got["init"] == "%d %d %d" % (init.size, init.timeout_ms, init.max_residual)
    for c, name in C_ERRORS.items():
        assert gpumem.ErrorCode[name] == int(got["E_" + c])
    assert len(gpumem.ErrorCode) == len(C_ERRORS)
    assert int(got["ROLE_WORKER"]) == _native.ROLE_WORKER
    assert int(got["ROLE_CONTROLLER"]) == _native.ROLE_CONTROLLER
    assert int(got["BACKUP"]) == gpumem.FLAG_BACKUP
    assert int(got["IPC_LEGACY"]) == gpumem.FLAG_IPC_LEGACY
    assert int(got["ALLOW_PAUSED"]) == gpumem.FLAG_ALLOW_PAUSED
    assert int(got["CONNECT_NO_RECONNECT"]) == _native.CONNECT_NO_RECONNECT
    assert got["socket"] == gpumem.DEFAULT_SOCKET


def test_library_lookup_order(monkeypatch):
    monkeypatch.setenv("GPUMEM_LIB", "/some/where/libgpumem.so.1")
    assert _native.candidates() == ["/some/where/libgpumem.so.1"]
    monkeypatch.delenv("GPUMEM_LIB")
    found = _native.candidates()
    assert "libgpumem.so.1" in found
    tree = REPO / "build" / "lib" / "libgpumem.so.1"
    if tree.exists():
        assert found[0] == str(tree)


def test_dropped_client_keeps_its_hooks_alive(daemon, tag):
    import gc

    w = gpumem.connect(daemon.sock, name="dropped")
    seen = []
    w.set_hooks(lambda bufs: seen.append(len(bufs)))
    kt = tag("dropped")
    w.alloc(kt, MiB)
    gone = weakref.ref(w)
    del w
    gc.collect()
    assert gone() is None  # the client object is gone; its session and hooks are not
    with gpumem.connect(daemon.sock, role="controller") as ctl:
        assert ctl.pause(kt).buffers == 1
        assert ctl.resume(kt).buffers == 1


# Buffers across pause and resume.

def test_backup_keeps_contents_and_plain_buffer_is_unmapped(worker, controller, tag):
    wt, kt = tag("weights"), tag("kv")
    weights = worker.alloc(wt, 3 * MiB, backup=True)
    kv = worker.alloc(kt, 1 * MiB)
    gran = worker.granularity
    assert weights.size == 4 * MiB and kv.size == 2 * MiB and gran == 2 * MiB
    assert weights.tag == wt and weights.device == 0 and weights.backup and not kv.backup
    assert weights.mapped and kv.mapped and weights.id != kv.id and weights.ptr
    pattern = os.urandom(weights.size)
    weights.write(0, pattern)
    kv.write(100, bytearray(b"scratch"))
    assert kv.read(100, 7) == b"scratch"
    # The host backend's memory is this process's memory: ptr is real.
    assert ctypes.string_at(kv.ptr + 100, 7) == b"scratch"
    wptr, kptr = weights.ptr, kv.ptr

    r = controller.pause(kt)
    assert (r.buffers, r.bytes, r.backup_bytes) == (1, 2 * MiB, 0)
    assert not kv.mapped and weights.mapped
    assert tag_status(controller, kt)["state"] == "PAUSED"
    assert tag_status(controller, wt)["state"] == "ACTIVE"
    with pytest.raises(gpumem.Error) as e:
        kv.read(0, 1)
    assert e.value.code_name == "WRONG_STATE" and e.value.code == gpumem.ErrorCode.WRONG_STATE

    r = controller.pause(wt, kt)  # kv again: a paused tag stays paused
    assert (r.buffers, r.bytes, r.backup_bytes) == (1, 4 * MiB, 4 * MiB)
    assert r.elapsed_us > 0 and r.error is None
    assert [c["device"] for c in r.checks] == [0] and r.checks[0]["released"] == 4 * MiB
    assert r.checks[0]["free_after"] - r.checks[0]["free_before"] == 4 * MiB
    assert r.details == [{"tag": wt, "device": 0, "node_device": 0, "buffers": 1,
                          "bytes": 4 * MiB}]
    assert r.checks[0]["node_device"] == 0
    assert r["bytes"] == 4 * MiB and r.as_dict()["error"] is None
    assert not weights.mapped and not kv.mapped
    t = tag_status(controller, wt)
    assert (t["state"], t["paused_bytes"], t["backup_bytes"]) == ("PAUSED", 4 * MiB, 4 * MiB)
    # What the pause saved, read while paused: a copy and a view.
    assert worker.backup_read(wptr + 12345, 1000) == pattern[12345:13345]
    view = worker.backup_view(wptr, weights.size)
    assert view.readonly and view == pattern
    del view
    with pytest.raises(gpumem.Error) as e:
        worker.backup_read(kptr, 8)
    assert e.value.code == gpumem.ErrorCode.WRONG_STATE and "without GPUMEM_BACKUP" in str(e.value)
    with pytest.raises(gpumem.Error) as e:
        worker.backup_read(wptr + weights.size - 4, 8)
    assert e.value.code == gpumem.ErrorCode.NOT_FOUND
    with pytest.raises(ValueError):
        worker.backup_read(wptr, -1)

    r = controller.resume(wt, kt)
    assert (r.buffers, r.bytes, r.backup_bytes) == (2, 6 * MiB, 4 * MiB)
    assert r.checks[0]["released"] == 6 * MiB
    assert weights.mapped and kv.mapped
    assert (weights.ptr, kv.ptr) == (wptr, kptr)
    assert weights.read() == pattern
    with pytest.raises(gpumem.Error) as e:
        worker.backup_read(wptr, 8)  # mapped: the memory holds the contents
    assert e.value.code == gpumem.ErrorCode.WRONG_STATE
    assert kv.read(100, 7) == bytes(7)  # not backed up: zeroed on the host backend
    kv.fill32(0xDEADBEEF, 8, 8)
    assert kv.read(8, 8) == (0xDEADBEEF).to_bytes(4, "little") * 2
    for b in (weights, kv):
        b.free()
        assert b.freed
    assert tag_status(controller, wt) is None


def test_buffer_is_a_context_manager_and_free_is_idempotent(worker, controller, tag):
    with worker.alloc(tag("ctx"), MiB) as b:
        assert b in worker.buffers and not b.freed
        ident = b.id
        assert any(x["id"] == ident for x in controller.list())
    assert b.freed and b not in worker.buffers
    assert not any(x["id"] == ident for x in controller.list())
    b.free()
    with pytest.raises(ValueError):
        b.read(0, 1)
    with pytest.raises(ValueError):
        _ = b.mapped


def test_status_has_the_keys_of_gpumemctl(daemon, worker, controller, tag):
    kt, wt = tag("kv"), tag("w")
    worker.alloc(kt, MiB)
    worker.alloc(wt, MiB, device=1, backup=True)
    controller.pause(kt)
    # The backup's host memory is made in the background: once it is, the
    # two statuses below see the same figures.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(
            t["name"] == wt and t["backup_pinned_bytes"] for t in controller.status()["tags"]):
        pass
    mine = controller.status()
    theirs = daemon.ctl("status")

    def keys(a, b, where):
        assert type(a) is type(b), where
        if isinstance(a, dict):
            assert list(a) == list(b), where
            for k in a:
                keys(a[k], b[k], where + "." + k)
        elif isinstance(a, list):
            if a and b:
                ka = {tuple(x) for x in a if isinstance(x, dict)}
                kb = {tuple(x) for x in b if isinstance(x, dict)}
                assert ka == kb, where
                keys(a[0], b[0], where + "[0]")

    keys(mine, theirs, "status")
    for k in ("devices", "tags", "sessions", "last_pause_checks"):
        assert mine[k] and theirs[k], k  # so that their elements were compared
    assert mine["tags"] == theirs["tags"]
    assert mine["devices"] == theirs["devices"]
    assert mine["backend"] == "host" and mine["granularity"] == 2 * MiB
    names = {s["name"]: s for s in mine["sessions"]}
    assert names["pytest-worker"]["role"] == "worker"
    assert names["pytest-worker"]["pid"] == os.getpid()
    assert names["pytest-controller"]["role"] == "controller"
    assert [c["device"] for c in mine["last_pause_checks"]] == [0]
    assert mine["backups"]["reserved"] >= 2 * MiB
    controller.resume(kt)


def test_stats_count_operations_and_keep_their_record(worker, controller, tag):
    kt = tag("kv")
    worker.alloc(kt, 2 * MiB)
    before = controller.stats()
    controller.pause(kt)
    controller.resume(kt)
    after = controller.stats()
    assert after["bytes_released"] - before["bytes_released"] == 2 * MiB
    assert after["bytes_restored"] - before["bytes_restored"] == 2 * MiB
    ok = {(c["op"], c["result"]): c["count"] for c in after["op_counts"]}
    was = {(c["op"], c["result"]): c["count"] for c in before["op_counts"]}
    assert ok[("pause", "OK")] == was[("pause", "OK")] + 1
    assert ok[("resume", "OK")] == was[("resume", "OK")] + 1
    assert [h["op"] for h in after["histograms"]] == ["pause", "resume"]
    assert all(h["le_us"][-1] == 2**64 - 1 and h["count"][-1] == h["total"]
               for h in after["histograms"])
    last = after["recent_ops"][0]
    assert (last["op"], last["tags"], last["done"], last["result"]) == ("resume", [kt], True, "OK")
    assert last["bytes_done"] == last["bytes_total"] == 2 * MiB
    assert last["pid"] == os.getpid()
    assert after["uptime_ms"] >= before["uptime_ms"]


# Errors.

def test_unknown_tag_is_not_found(worker, controller, tag):
    for op in (controller.pause, controller.resume):
        with pytest.raises(gpumem.Error) as e:
            op(tag("no-such-tag"))
        err = e.value
        assert err.code_name == "NOT_FOUND"
        assert err.code == gpumem.ErrorCode.NOT_FOUND == -5
        assert tag("no-such-tag") in err.message and str(err).startswith("NOT_FOUND: ")
        assert err.result is not None and err.result.error["code"] == "NOT_FOUND"
        assert err.pids == ()
    with pytest.raises(gpumem.Error) as e:
        worker.pause(tag("x"))  # a worker may not
    assert e.value.code_name == "PERMISSION_DENIED"


def test_share_marks_a_tag_and_status_counts_the_uid(worker, controller, tag):
    b = worker.alloc(tag("own"), 4 << 20)
    controller.share(tag("common"))
    tags = {t["name"]: t for t in controller.status()["tags"]}
    assert tags[tag("common")]["shared"] and not tags[tag("common")]["owned"]
    assert tags[tag("own")]["owner_uid"] == os.getuid() and not tags[tag("own")]["shared"]
    mine = [t for t in worker.status()["tenants"] if t["uid"] == os.getuid()]
    assert len(mine) == 1 and mine[0]["bytes"] >= b.size
    controller.share(tag("common"), shared=False)
    assert tag("common") not in {t["name"] for t in controller.status()["tags"]}
    with pytest.raises(gpumem.Error) as e:
        worker.share(tag("common"))
    assert e.value.code_name == "PERMISSION_DENIED"
    with pytest.raises(ValueError):
        controller.share("bad tag")
    b.free()


def test_a_persistent_buffer_outlives_its_client(daemon, worker, controller, tag):
    name, t = tag("w0"), tag("weights")
    b = worker.alloc_persistent(name, t, 4 * MiB, backup=True)
    assert b.name == name and b.flags & gpumem.FLAG_PERSIST
    b.write(0, b"\x5a" * 4096)
    try:
        b.free()
        with gpumem.connect(daemon.sock, name="engine-2") as w2:
            again = w2.attach(name)
            assert again.tag == t and again.read(0, 4096) == b"\x5a" * 4096
            mine = [x for x in controller.status()["persistent"] if x["name"] == name]
            assert len(mine) == 1 and mine[0]["pid"] == os.getpid() and mine[0]["uid"] == os.getuid()
            with pytest.raises(gpumem.Error) as e:
                controller.drop(name)
            assert e.value.code_name == "WRONG_STATE"
        # Its client is gone: the daemon keeps it, and says who held it last
        # (once it has seen the session end, on a turn of its own).
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
                x["pid"] for x in controller.status()["persistent"] if x["name"] == name):
            pass
        ours = [x for x in daemon.ctl("status")["persistent"] if x["name"] == name]
        theirs = [x for x in controller.status()["persistent"] if x["name"] == name]
        assert list(ours[0]) == list(theirs[0])
        assert theirs[0]["pid"] == 0 and theirs[0]["last_name"] == "engine-2"
        assert [x["name"] for x in controller.list() if x["id"] == theirs[0]["id"]] == [name]
        with pytest.raises(gpumem.Error) as e:
            worker.alloc_persistent(name, t, 4 * MiB)
        assert e.value.code_name == "WRONG_STATE"
        assert controller.drop(name) == 4 * MiB
        with pytest.raises(gpumem.Error) as e:
            worker.attach(name)
        assert e.value.code_name == "NOT_FOUND"
        with pytest.raises(gpumem.Error) as e:
            controller.drop(name)
        assert e.value.code_name == "NOT_FOUND"
    finally:
        try:
            controller.drop(name)
        except gpumem.Error:
            pass
    with pytest.raises(ValueError):
        worker.attach("bad name")


def test_a_standby_attach_waits_for_the_holder(daemon, worker, tag):
    name, t = tag("w0"), tag("weights")
    b = worker.alloc_persistent(name, t, 4 * MiB)
    b.write(0, b"\x6b" * 4096)
    got = {}
    with gpumem.connect(daemon.sock, name="standby") as standby:
        with pytest.raises(gpumem.Error) as e:
            standby.attach(name, wait=0.05)
        assert e.value.code_name == "WRONG_STATE" and "waited" in e.value.message
        with pytest.raises(ValueError):
            standby.attach(name, wait=601)

        def take():
            got["b"] = standby.attach(name, wait=30)

        t_standby = threading.Thread(target=take)
        t_standby.start()
        b.free()  # the holder lets go: the waiting attach is served
        t_standby.join(60)
        assert not t_standby.is_alive()
        assert got["b"].read(0, 4096) == b"\x6b" * 4096
        got["b"].free()
        standby.drop(name)


def test_connect_failure(tmp_path):
    with pytest.raises(gpumem.Error) as e:
        gpumem.connect(str(tmp_path / "nothing-here"))
    assert e.value.code_name == "CONNECT" and e.value.code == -13 and e.value.message


class Recorder:
    """The library, noting every function called through it."""

    def __init__(self, lib):
        self._lib = lib
        self.calls = []

    def __getattr__(self, name):
        f = getattr(self._lib, name)

        def call(*a):
            self.calls.append(name)
            return f(*a)

        return call


def test_bad_arguments_raise_before_any_request(worker, controller, tag, monkeypatch):
    b = worker.alloc(tag("buf"), MiB)
    before = controller.list()
    for c in (worker, controller):
        monkeypatch.setattr(c, "_lib", Recorder(c._lib))
    ok = tag("ok")
    bad = [
        (TypeError, worker.alloc, (123, MiB), {}),
        (TypeError, worker.alloc, (b"bytes", MiB), {}),
        (ValueError, worker.alloc, ("", MiB), {}),
        (ValueError, worker.alloc, ("has space", MiB), {}),
        (ValueError, worker.alloc, ("slash/", MiB), {}),
        (ValueError, worker.alloc, ("x" * 64, MiB), {}),
        (ValueError, worker.alloc, ("k\u00e9", MiB), {}),
        (ValueError, worker.alloc, ("kv\n", MiB), {}),
        (ValueError, worker.alloc, (ok, 0), {}),
        (ValueError, worker.alloc, (ok, -1), {}),
        (ValueError, worker.alloc, (ok, 1 << 64), {}),
        (TypeError, worker.alloc, (ok, 1.5), {}),
        (TypeError, worker.alloc, (ok, True), {}),
        (TypeError, worker.alloc, (ok, "1M"), {}),
        (ValueError, worker.alloc, (ok, MiB), {"device": -1}),
        (TypeError, worker.alloc, (ok, MiB), {"device": "0"}),
        (TypeError, worker.alloc, (ok, MiB), {"device": None}),
        (TypeError, worker.alloc, (ok, MiB), {"backup": 1}),
        (TypeError, controller.pause, (1,), {}),
        (TypeError, controller.pause, ([ok],), {}),
        (ValueError, controller.pause, ("a b",), {}),
        (ValueError, controller.pause, (*["t%d" % i for i in range(65)],), {}),
        (ValueError, controller.pause, (ok,), {"devices": [-1]}),
        (ValueError, controller.pause, (ok,), {"devices": [64]}),
        (ValueError, controller.pause, (ok,), {"devices": []}),
        (TypeError, controller.pause, (ok,), {"devices": "0"}),
        (TypeError, controller.pause, (ok,), {"devices": 0}),
        (TypeError, controller.pause, (ok,), {"devices": [0.0]}),
        (ValueError, controller.pause, (ok,), {"timeout": 0}),
        (ValueError, controller.pause, (ok,), {"timeout": -1}),
        (ValueError, controller.pause, (ok,), {"timeout": float("nan")}),
        (ValueError, controller.pause, (ok,), {"timeout": float("inf")}),
        (TypeError, controller.pause, (ok,), {"timeout": "1"}),
        (ValueError, controller.pause, (ok,), {"max_residual": -1}),
        (TypeError, controller.pause, (ok,), {"max_residual": 1.0}),
        (ValueError, controller.resume, (ok,), {"timeout": 0}),
        (TypeError, controller.pause, (ok,), {"own": 1}),
        (ValueError, controller.pause, (ok,), {"own": True, "pids": [1]}),
        (ValueError, controller.pause, (ok,), {"own": True, "session_prefix": "rank"}),
        (ValueError, controller.pause, (ok,), {"pids": [0]}),
        (ValueError, controller.pause, (ok,), {"pids": [1 << 32]}),
        (ValueError, controller.pause, (ok,), {"pids": []}),
        (TypeError, controller.pause, (ok,), {"pids": 5}),
        (TypeError, controller.pause, (ok,), {"pids": "5"}),
        (TypeError, controller.resume, (ok,), {"session_prefix": b"rank"}),
        (ValueError, controller.resume, (ok,), {"session_prefix": ""}),
        (ValueError, controller.resume, (ok,), {"session_prefix": "a\nb"}),
        (ValueError, controller.resume, (ok,), {"session_prefix": "x" * 128}),
        (ValueError, controller.set_request_timeout, (0,), {}),
        (TypeError, controller.set_request_timeout, ("1",), {}),
        (ValueError, worker.malloc, (ok, 0), {}),
        (TypeError, worker.malloc, (ok, MiB), {"device": "0"}),
        (TypeError, worker.malloc, (ok, MiB), {"backup": "yes"}),
        (ValueError, worker.free_ptr, (0,), {}),
        (TypeError, worker.free_ptr, (None,), {}),
        (TypeError, gpumem.set_thread_tag, (5,), {}),
        (ValueError, gpumem.set_thread_tag, ("a b",), {}),
        (TypeError, gpumem.set_default_client, ("client",), {}),
        (ValueError, b.read, (-1, 1), {}),
        (ValueError, b.read, (0, b.size + 1), {}),
        (ValueError, b.read, (b.size + 1,), {}),
        (TypeError, b.read, ("0", 1), {}),
        (ValueError, b.write, (b.size, b"x"), {}),
        (ValueError, b.write, (-1, b"x"), {}),
        (TypeError, b.write, (0, "text"), {}),
        (TypeError, b.write, (0, 5), {}),
        (ValueError, b.fill32, (1,), {"offset": 2, "length": 4}),
        (ValueError, b.fill32, (1 << 32,), {}),
        (TypeError, worker.set_hooks, ("not callable",), {}),
        (ValueError, gpumem.connect, (), {"role": "admin"}),
        (TypeError, gpumem.connect, (), {"role": 2}),
        (TypeError, gpumem.connect, (), {"name": 5}),
        (ValueError, gpumem.connect, (), {"name": "x" * 128}),
        (ValueError, gpumem.connect, (), {"name": "a\0b"}),
        (TypeError, gpumem.connect, (5,), {}),
        (ValueError, gpumem.connect, ("",), {}),
        (TypeError, gpumem.connect, (), {"reconnect": "yes"}),
    ]
    for exc, fn, args, kw in bad:
        with pytest.raises(exc):
            fn(*args, **kw)
    assert worker._lib.calls == [] and controller._lib.calls == []
    monkeypatch.undo()
    assert controller.list() == before and b.mapped
    assert all(not x.freed for x in worker.buffers)


def test_client_timeout_carries_the_pids(worker, controller, tag):
    kt = tag("slow")
    b = worker.alloc(kt, MiB)
    entered, release = threading.Event(), threading.Event()

    def slow(bufs):
        entered.set()
        release.wait(10)

    worker.set_hooks(pre_unmap=slow)
    try:
        with pytest.raises(gpumem.Error) as e:
            controller.pause(kt, timeout=0.2)
    finally:
        release.set()
    err = e.value
    assert entered.is_set()
    assert err.code_name == "CLIENT_TIMEOUT" and err.code == gpumem.ErrorCode.CLIENT_TIMEOUT
    assert err.pids == (os.getpid(),)
    assert err.buffers_held == 1 and err.bytes_held == b.size
    assert err.result.error["pids"] == [os.getpid()]
    assert str(os.getpid()) in str(err)
    # The late answer settles the pause.
    wait_for(lambda: (tag_status(controller, kt) or {}).get("state") == "PAUSED", 5,
             "the late unmap to settle")
    assert not b.mapped
    worker.set_hooks()
    assert controller.resume(kt).buffers == 1 and b.mapped


def test_hooks_get_the_right_buffers(worker, controller, tag):
    at, other = tag("a"), tag("other")
    a1 = worker.alloc(at, MiB, backup=True)
    a2 = worker.alloc(at, MiB, device=1)
    o = worker.alloc(other, MiB)
    a1.write(0, b"kept")
    calls = []

    def pre(bufs):
        calls.append(("pre", list(bufs), [b.mapped for b in bufs], threading.current_thread()))
        try:
            worker.status()
        except RuntimeError as e:
            calls.append(("refused", str(e)))

    def post(bufs):
        calls.append(("post", list(bufs), [b.mapped for b in bufs], threading.current_thread()))
        calls.append(("read", a1.read(0, 4)))

    worker.set_hooks(pre_unmap=pre, post_remap=post)
    controller.pause(at)
    assert len(calls) == 2
    kind, bufs, mapped, thread = calls[0]
    assert kind == "pre" and thread is not threading.main_thread()
    assert sorted(map(id, bufs)) == sorted(map(id, (a1, a2)))  # the same objects
    assert mapped == [True, True] and o not in bufs
    assert calls[1][0] == "refused" and "hook" in calls[1][1]
    assert not a1.mapped and not a2.mapped and o.mapped

    controller.resume(at)
    assert [c[0] for c in calls[2:]] == ["post", "read"]
    kind, bufs, mapped, thread = calls[2]
    assert sorted(map(id, bufs)) == sorted(map(id, (a1, a2))) and mapped == [True, True]
    assert calls[3][1] == b"kept"

    # A hook that raises: kept and printed; the pause goes on.
    def boom(bufs):
        raise KeyError("boom")

    worker.set_hooks(pre_unmap=boom)
    assert controller.pause(other).buffers == 1 and not o.mapped
    assert isinstance(worker.hook_errors[-1], KeyError)
    worker.set_hooks(None, None)
    controller.resume(other)
    n = len(calls)
    controller.pause(at)
    controller.resume(at)
    assert len(calls) == n  # no hooks any more
    assert a1.read(0, 4) == b"kept"


def test_no_fd_leak(daemon, tag):
    before = fds()
    for _ in range(2):
        with gpumem.connect(daemon.sock, name="leak") as w, \
                gpumem.connect(daemon.sock, role="controller") as c:
            w.set_hooks(lambda bufs: None, lambda bufs: None)
            kt = tag("leak")
            bufs = [w.alloc(kt, 3 * MiB, backup=True), w.alloc(kt, MiB, device=1)]
            bufs[0].write(0, b"x" * 1000)
            c.pause(kt)
            c.status()
            c.resume(kt)
            assert bufs[0].read(0, 1000) == b"x" * 1000
            bufs[1].free()
        assert bufs[0].freed and w.closed and c.closed
        with pytest.raises(ValueError):
            w.alloc(kt, MiB)
        w.close()  # again: nothing
    assert fds() == before


def test_daemon_gone_is_an_error_and_buffers_stay(make_daemon, tag):
    d = make_daemon()
    w = gpumem.connect(d.sock, name="orphan", reconnect=False)
    b = w.alloc(tag("kept"), MiB)
    b.write(0, b"still here")
    d.stop()  # SIGTERM, exit 0

    def gone():
        try:
            w.status()
        except gpumem.Error as e:
            return e
        return None

    err = wait_for(gone, 5, "the client to see the daemon gone")
    assert err.code_name in ("DISCONNECTED", "SHUTTING_DOWN")
    assert b.read(0, 10) == b"still here"  # mappings stay valid
    w.close()
    assert b.freed


# API 1.2: version, error names, request timeouts, scopes, sub-allocation.

def test_version_error_names_and_library_path():
    # The library the package loads is of the package's own version.
    assert gpumem.version() == tuple(int(x) for x in gpumem.__version__.split("."))
    assert gpumem.error_name(-7) == "TAG_PAUSED" and gpumem.error_name(0) == "OK"
    assert gpumem.error_name(-20) == "TIMEOUT" and gpumem.error_name(-99) == "UNKNOWN"
    assert all(gpumem.error_name(int(c)) == c.name for c in gpumem.ErrorCode)
    path = gpumem.library_path()
    assert os.path.isfile(path)
    assert os.path.realpath(path) == os.path.realpath(os.environ["GPUMEM_LIB"])
    with pytest.raises(TypeError):
        gpumem.error_name("x")


def test_unanswered_request_times_out_and_the_late_answer_is_dropped(make_daemon, tag):
    d = make_daemon()
    w = gpumem.connect(d.sock, name="impatient")
    w.set_request_timeout(0.2)
    kt = tag("late")
    d.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(gpumem.Error) as e:
            w.alloc(kt, MiB)
        took = time.monotonic() - t0
    finally:
        d.proc.send_signal(signal.SIGCONT)
    assert e.value.code == gpumem.ErrorCode.TIMEOUT and e.value.code_name == "TIMEOUT"
    assert "did not answer in 0.2 s" in e.value.message
    assert 0.19 <= took < 5
    w.set_request_timeout(None)
    # The daemon made the buffer late; the library gave it back.
    wait_for(lambda: not any(b["tag"] == kt for b in d.ctl("list")), 5,
             "the late buffer to be freed")
    assert w.list() == [] and w.buffers == []
    b = w.alloc(kt, MiB)
    assert b.mapped
    w.close()


def test_worker_pauses_and_resumes_its_own_buffers(worker, controller, daemon, tag):
    kt = tag("own")
    mine = worker.alloc(kt, MiB, backup=True)
    mine.write(0, b"mine")
    with gpumem.connect(daemon.sock, name="other-rank") as other:
        theirs = other.alloc(kt, MiB)
        try:
            r = worker.pause(kt, own=True)
        except gpumem.Error as e:
            if e.code_name == "PERMISSION_DENIED":
                pytest.skip("this gpumemd has no pause scopes yet: %s" % e)
            raise
        assert (r.buffers, r.bytes) == (1, mine.size)
        assert not mine.mapped and theirs.mapped
        assert worker.pause(own=True).buffers == 0  # every tag of its own: nothing left
        r = worker.resume(own=True)
        assert r.buffers == 1 and mine.mapped and mine.read(0, 4) == b"mine"
        # A controller's pause of one session by pid.
        r = controller.pause(kt, pids=[os.getpid()], session_prefix="other-")
        assert r.buffers == 1 and not theirs.mapped and mine.mapped
        controller.resume(kt, session_prefix="other-")
        assert theirs.mapped


def test_malloc_free_ptr_trim_and_pool_stats(worker, tag):
    kt = tag("pool")
    ptrs = [worker.malloc(kt, 1000 + i) for i in range(8)]
    assert all(p % 512 == 0 for p in ptrs) and len(set(ptrs)) == 8
    ctypes.memmove(ptrs[3], b"hello", 5)
    assert ctypes.string_at(ptrs[3], 5) == b"hello"
    st = worker.pool_stats()
    assert st["allocations"] == 8 and st["allocated_bytes"] >= sum(1000 + i for i in range(8))
    assert st["pooled_buffers"] >= 1 and st["daemon_allocs"] >= 1
    for p in ptrs:
        worker.free_ptr(p)
    with pytest.raises(gpumem.Error) as e:
        worker.free_ptr(ptrs[0] + 512)
    assert e.value.code_name == "NOT_FOUND"
    assert worker.pool_stats()["allocations"] == 0
    assert worker.trim() >= worker.granularity
    assert worker.pool_stats()["pooled_bytes"] == 0
    b = worker.alloc(kt, MiB)
    worker.free_ptr(b.ptr)  # a whole buffer, by address
    assert b.freed and b not in worker.buffers


def test_free_ptr_frees_one_allocation_after_hooks_saw_its_buffer(worker, controller, tag):
    kt = tag("slab")
    seen = []
    worker.set_hooks(pre_unmap=lambda bufs: seen.extend(bufs))
    p = worker.malloc(kt, MiB)
    q = worker.malloc(kt, MiB)  # the same sub-allocation buffer as p
    ctypes.memset(q, 0x5A, MiB)
    controller.pause(kt)
    controller.resume(kt)
    slab = [b for b in seen if b.tag == kt]
    assert slab and slab[0].ptr <= p < slab[0].ptr + slab[0].size
    assert worker.buffers == []  # the library's own buffers are not the caller's
    worker.free_ptr(p)  # the first allocation: its address is the buffer's too
    st = worker.pool_stats()
    assert st["allocations"] == 1 and st["pooled_buffers"] >= 1
    ctypes.memset(q, 0x33, MiB)  # q is still there, mapped
    assert ctypes.string_at(q + MiB - 4, 4) == b"\x33" * 4
    with pytest.raises(ValueError, match="not one this client allocated"):
        slab[0].free()
    assert worker.pool_stats()["allocations"] == 1
    worker.set_hooks(None, None)
    worker.free_ptr(q)
    assert worker.pool_stats()["allocations"] == 0
    worker.trim()


def test_error_codes_are_one_list_in_header_library_and_package():
    """Every GPUMEM_E_* of the header has a name and words in the library's
    table, the Python ErrorCode with the same value has that name, and
    neither knows a code the header does not."""
    header = (REPO / "include" / "gpumem.h").read_text()
    codes = {int(v): n for n, v in re.findall(r"^\s*(GPUMEM_E_\w+) = (-\d+),", header, re.M)}
    assert len(codes) == 21, codes
    assert {int(c) for c in gpumem.ErrorCode} == set(codes)
    for value, cname in codes.items():
        name = gpumem.error_name(value)
        assert name == gpumem.ErrorCode(value).name, (cname, name)
        assert name != "UNKNOWN", cname
        assert _native.load().gpumem_strerror(value) not in (b"unknown error", b"success"), cname
    known = {v for v in range(-64, 0) if gpumem.error_name(v) != "UNKNOWN"}
    assert known == set(codes)


def test_wire_limits_match_the_library():
    wire = (REPO / "common" / "wire.h").read_text()
    defines = dict(re.findall(r"#define (WIRE_\w+) (\d+)", wire))
    assert int(defines["WIRE_TAG_MAX"]) == _native.TAG_MAX
    assert int(defines["WIRE_NAME_MAX"]) == _native.NAME_MAX
    assert int(defines["WIRE_MAX_TAGS"]) == _native.MAX_TAGS
    limits = (REPO / "common" / "limits.h").read_text()
    assert int(re.search(r"#define GPUMEM_MAX_DEVICES (\d+)", limits).group(1)) == _native.MAX_DEVICES
    assert int(defines["WIRE_MAX_PIDS"]) == _native.MAX_PIDS == gpumem._MAX_PIDS
    assert int(defines["WIRE_MAX_WAIT_MS"]) == _native.MAX_WAIT_MS


def test_too_many_pids_are_refused_before_the_daemon(controller):
    with pytest.raises(ValueError, match="at most %d pids" % _native.MAX_PIDS):
        controller.pause("x", pids=list(range(1, _native.MAX_PIDS + 2)))


def test_default_client_is_the_librarys_and_lent(daemon):
    """In a fresh process: the library connects its default client on
    first use; Python wraps it without owning it."""
    code = (
        "import gpumem\n"
        "c = gpumem.default_client()\n"
        "lib = c._lib\n"
        "assert c is gpumem.default_client() and c._c == lib.gpumem_default_client()\n"
        "assert c.role == 'worker' and c.name == 'lent-test', c.name\n"
        "ptr = c.malloc('lent', 4096)\n"
        "c.close()\n"
        "assert c.closed and lib.gpumem_default_client()  # still connected\n"
        "d = gpumem.default_client()\n"
        "assert d is not c and d._c == lib.gpumem_default_client()\n"
        "d.free_ptr(ptr)  # the allocation is the library client's\n"
        "w = gpumem.connect(name='mine')\n"
        "gpumem.set_default_client(w)\n"
        "assert gpumem.default_client() is w\n"
        "w.close()\n"
        "assert gpumem.default_client()._c == d._c  # the library's again\n"
        "print('ok', len([s for s in gpumem.connect(role='controller').status()['sessions']\n"
        "                 if s['name'] == 'lent-test']))\n")
    env = dict(os.environ, GPUMEM_SOCKET=daemon.sock, GPUMEM_NAME="lent-test",
               PYTHONPATH=str(REPO / "python"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "ok 1\n"


def test_default_client_without_a_daemon(tmp_path):
    code = ("import gpumem\n"
            "try:\n"
            "    gpumem.default_client()\n"
            "except gpumem.Error as e:\n"
            "    print(e.code_name)\n")
    env = dict(os.environ, GPUMEM_SOCKET=str(tmp_path / "none"), PYTHONPATH=str(REPO / "python"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "CONNECT\n"


def test_thread_tags_and_the_default_client(daemon, worker):
    assert gpumem.thread_tag() == (None, 0)
    gpumem.set_thread_tag("weights", backup=True)
    assert gpumem.thread_tag() == ("weights", gpumem.FLAG_BACKUP)
    seen = []
    t = threading.Thread(target=lambda: seen.append(gpumem.thread_tag()))
    t.start()
    t.join()
    assert seen == [(None, 0)]  # a tag belongs to its thread
    gpumem.set_thread_tag(None)
    assert gpumem.thread_tag() == (None, 0)
    lib = worker._lib
    gpumem.set_default_client(worker)
    assert lib.gpumem_default_client() == worker._ptr()
    with gpumem.connect(daemon.sock, name="default") as c:
        gpumem.set_default_client(c)
        assert lib.gpumem_default_client() == c._ptr()
    assert gpumem._default is None  # closing the default client cleared it


def _proc_state(pid):
    """The state letter of /proc/PID/stat ("T": stopped)."""
    with open("/proc/%d/stat" % pid) as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_release_context_through_the_package(make_daemon):
    """A Python worker opted in by GPUMEM_RELEASE_CONTEXT=1 is released by
    a controller's pause(release_context=True) (the host backend stops the
    process), the result and the status say so, and resume() brings it
    back; a pause asking a worker that did not opt in raises
    RELEASE_REFUSED with the reason, its buffer paused all the same."""
    import gpumem

    d = make_daemon()
    code = ("import os, sys, gpumem\n"
            "c = gpumem.connect(sys.argv[1], name=sys.argv[2])\n"
            "b = c.alloc('kv', 4 << 20)\n"
            "print('ready', flush=True)\n"
            "sys.stdin.read()\n")
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"), GPUMEM_RELEASE_CONTEXT="1")
    opted = subprocess.Popen([sys.executable, "-c", code, d.sock, "opted"], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    env.pop("GPUMEM_RELEASE_CONTEXT")
    other = subprocess.Popen([sys.executable, "-c", code, d.sock, "other"], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert opted.stdout.readline() == "ready\n"
        assert other.stdout.readline() == "ready\n"
        with gpumem.connect(d.sock, name="ctl", role="controller") as c:
            with pytest.raises(gpumem.Error) as e:
                c.pause("kv", release_context=True)
            assert e.value.code_name == "RELEASE_REFUSED"
            assert "did not opt in" in e.value.message
            by_pid = {x["pid"]: x for x in e.value.result.releases}
            assert by_pid[opted.pid]["released"] and by_pid[opted.pid]["why"] == ""
            assert not by_pid[other.pid]["released"]
            assert _proc_state(opted.pid) == "T" and _proc_state(other.pid) != "T"
            ses = {s["pid"]: s for s in c.status()["sessions"]}
            assert ses[opted.pid]["release_context"] and ses[opted.pid]["context_released"]
            assert not ses[other.pid]["release_context"]
            r = c.resume("kv")
            assert [x["pid"] for x in r.releases] == [opted.pid]
            assert r.as_dict()["releases"][0]["released"] is False
            assert _proc_state(opted.pid) != "T"
            with pytest.raises(TypeError):
                c.pause("kv", release_context="yes")
    finally:
        for p in (opted, other):
            p.stdin.close()
            p.wait(timeout=10)


def test_a_resume_can_wait_for_room(worker, controller, tag):
    """resume(wait=...): with room it does not wait (waited_us 0, in the
    JSON keys too); a bad wait is refused before any request; a wait on a
    pause is a TypeError (pause has no such argument)."""
    kv = tag("kv")
    b = worker.alloc(kv, 2 * MiB)
    controller.pause(kv)
    r = controller.resume(kv, wait=5)
    assert r.buffers == 1 and r.waited_us == 0 and r.as_dict()["waited_us"] == 0
    for bad, err in ((0, ValueError), (601, ValueError), ("1", TypeError)):
        with pytest.raises(err):
            controller.resume(kv, wait=bad)
    with pytest.raises(TypeError):
        controller.pause(kv, wait=1)
    b.free()
