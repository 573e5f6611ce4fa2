#!/usr/bin/env python3
"""Write the seed inputs of fuzz_daemon and fuzz_frame
(tests/fuzz/corpus/<target>/seed-*): for fuzz_daemon, scenarios a client and
a controller play, in the action language that tests/fuzz/fuzz_daemon.c
reads; for fuzz_frame, streams whose frames carry fds. Run from the
repository root; the other files there are what libFuzzer found from these
(merged to the inputs that add coverage)."""
import os
import struct

OUT = "tests/fuzz/corpus/fuzz_daemon"
FRAME_OUT = "tests/fuzz/corpus/fuzz_frame"

# Who: slot (0-3), through the helper process (a peer holding none of the
# daemon's chunks), automatic acks (0 none, 1 OK, 2 failure).
def who(slot, helper=False, auto=0):
    return slot | (helper << 2) | (auto << 3)

WORKER, CONTROLLER = 1, 2

def hello(w, role=WORKER, name=0, id=1, flags=0):
    return [6, w, id, flags, role, name]

def alloc(w, tag=0, dev=0, size=4, flags=0, id=2):
    return [7, w, id, 0, tag, dev | (flags << 2), size]

def free(w, pick=0, id=3):
    return [9, w, id, 0, pick]

def op(w, resume=False, tags=(), devs=(), own=False, timeout=0, id=4):
    b = len(tags) | (len(devs) << 2) | (own << 6)
    return [11 if resume else 10, w, id, 0, b, *tags, *devs, timeout]

def ack(w, code=0, unmap=True, pick=0):
    return [12, w, pick, 0, code | (unmap << 5), 0]

def status(w, id=5):
    return [13, w, id, 0]

def lst(w, id=6):
    return [13 | 0x10, w, id, 0]

def adopt(w, bufs, id=7, extra_flags=0):
    out = [14, w, id, extra_flags, len(bufs)]
    for tag, x, how, pages in bufs:
        out += [tag, x, how, *pages]
    return out

def raw(w, data, stream=False, flags=0, id=0):
    assert len(data) < 0x7f
    return [15, w, id, flags, len(data) | (0x80 if stream else 0), *data]

def pump(n=4):
    return [2, n]

def wait(ms):
    return [5, ms]

def close(slot):
    return [1, slot]

def nread(slot, on):
    return [3, slot | (4 if on else 0)]

def halfclose(slot):
    return [4, slot]

W, C = who(0, True, 1), who(1)
WM = who(2)  # a worker in this process that acks only when told
seeds = {
    "hello": [0] + hello(W),
    "hello-controller": [0] + hello(C, CONTROLLER),
    "hello-twice": [0] + hello(W) + hello(W),
    "hello-bad-version": [0] + [6, W, 1, 0, WORKER | 4, 9, 0],
    "hello-bad-name": [0] + hello(W, name=7),
    "before-hello": [0] + alloc(W),
    "alloc-free": [0] + hello(W) + alloc(W) + free(W),
    "alloc-two-devices": [0] + hello(W) + alloc(W, dev=0, size=0x41) + alloc(W, tag=1, dev=1, size=0x42),
    "alloc-chunks": [1] + hello(W) + alloc(W, size=0x45) + free(W),
    "alloc-too-big": [0] + hello(W) + alloc(W, size=0xff) + [0] * 8,
    "alloc-bad-device": [0] + hello(W) + alloc(W, dev=2),
    "alloc-flags": [0] + hello(W) + alloc(W, flags=1) + alloc(W, flags=2) + alloc(W, flags=4) + alloc(W, flags=3),
    "alloc-limit": [32] + hello(W) + alloc(W) * 5,
    "free-unknown": [0] + hello(W) + free(W, pick=0x3f),
    "pause-resume": [0] + hello(W) + alloc(W) + hello(C, CONTROLLER) + op(C, tags=[0]) + pump()
                    + op(C, resume=True, tags=[0]) + pump(),
    "pause-resume-backup": [0] + hello(W) + alloc(W, flags=1, size=0x41) + hello(C, CONTROLLER)
                           + op(C, tags=[0]) + pump() + op(C, resume=True, tags=[0]) + pump(),
    "pause-verify": [4] + hello(W) + alloc(W, flags=1) + hello(C, CONTROLLER) + op(C) + pump()
                    + op(C, resume=True) + pump(),
    "pause-all-devices": [0] + hello(W) + alloc(W) + alloc(W, dev=1) + hello(C, CONTROLLER)
                         + op(C, devs=[1]) + pump() + op(C, resume=True, devs=[0, 1]) + pump(),
    "pause-own": [0] + hello(W) + alloc(W) + op(W, own=True) + pump() + op(W, resume=True, own=True) + pump(),
    "pause-not-controller": [0] + hello(W) + op(W, tags=[0]),
    "pause-manual-ack": [0] + hello(WM) + alloc(WM) + hello(C, CONTROLLER) + op(C, tags=[0]) + pump()
                        + ack(WM) + pump(),
    "pause-failed-ack": [0] + hello(who(0, True, 2)) + alloc(who(0, True, 2)) + hello(C, CONTROLLER)
                        + op(C, tags=[0]) + pump(),
    "pause-timeout": [8] + hello(WM) + alloc(WM) + hello(C, CONTROLLER) + op(C, tags=[0]) + wait(10) + pump(),
    "pause-worker-leaves": [0] + hello(WM) + alloc(WM) + hello(C, CONTROLLER) + op(C, tags=[0]) + close(2) + pump(),
    "pause-controller-leaves": [0] + hello(W) + alloc(W) + hello(C, CONTROLLER) + op(C, tags=[0]) + close(1) + pump(),
    "alloc-paused": [0] + hello(W) + alloc(W) + hello(C, CONTROLLER) + op(C, tags=[0]) + pump()
                    + alloc(W, flags=4) + alloc(W) + free(W) + op(C, resume=True, tags=[0]) + pump(),
    "ack-stray": [0] + hello(W) + ack(W, code=1),
    "status-list": [0] + hello(C, CONTROLLER) + status(C) + lst(C),
    "status-worker": [0] + hello(W) + alloc(W) + status(W) + lst(W),
    "adopt-good": [0] + hello(W) + adopt(W, [(0, 0, 0, [1]), (1, 1 | 0x40, 0, [2, 3])]) + free(W),
    "adopt-paused": [0] + hello(W) + adopt(W, [(0, 0x20 | 1 << 2, 0, [1])]),
    "adopt-not-memfd": [0] + hello(W) + adopt(W, [(0, 0, 0x01, [1])]),
    "adopt-unsealed": [0] + hello(W) + adopt(W, [(0, 0, 0x02, [1])]),
    "adopt-sparse": [0] + hello(W) + adopt(W, [(0, 0, 0x04, [1])]),
    "adopt-wrong-size": [0] + hello(W) + adopt(W, [(0, 0, 0x80, [1], )]) + [3],
    "adopt-extra-fds": [0] + hello(W) + adopt(W, [(0, 0, 0, [1])], extra_flags=1) + [2],
    "fds-on-hello": [0] + hello(W, flags=3) + [2, 3, 4],
    "fds-wrong-count": [0] + hello(W) + [9, W, 3, 0x05, 0, 7],
    "fds-many": [0] + hello(W) + [9, W, 3, 0x10, 200, 0],
    "fds-own-socket": [0] + hello(W) + [9, W, 3, 0x01, 5, 0],
    "split-frame": [0] + hello(W, flags=8) + alloc(W),
    "raw-garbage": [0] + raw(W, b"\x08\x01\xff\xff\xff"),
    "raw-huge-length": [0] + raw(W, b"\xff\xff\xff\x7f", stream=True),
    "raw-half-frame": [128] + raw(W, b"\x10\x00\x00\x00\x08", stream=True, flags=1) + [2] + wait(10),
    "raw-empty-frame": [0] + raw(W, b""),
    "stop-reading": [64] + hello(W) + nread(0, False) + alloc(W) * 4 + status(W) + pump(8) + nread(0, True) + pump(),
    "half-close": [0] + hello(W) + alloc(W) + halfclose(0) + pump(),
    "sessions-per-uid": [16] + hello(who(0)) + hello(who(1)) + hello(who(2)) + pump(),
    "reconnect": [0] + hello(W) + alloc(W) + close(0) + hello(W) + alloc(W),
}

# fuzz_frame: a step is a control byte (size - 1 in bits 0-5, fds in bit
# 6 with a count byte after it, read in bit 7) and the bytes written.
def step(data, fds=0, read=True):
    ctl = (len(data) - 1) | (0x80 if read else 0)
    out = [ctl]
    if fds:
        ctl |= 0x40
        out = [ctl, fds - 1 if fds <= 4 else 0x80 | (fds - 1)]
    return out + list(data)

def frame(payload):
    return struct.pack("<I", len(payload)) + payload

frame_seeds = {
    "one-frame": step(frame(b"abcd")),
    "fds-with-header": step(frame(b""), fds=2),
    "fds-inside-frame": step(frame(b"abcdefgh")[:6], read=False) + step(frame(b"abcdefgh")[6:], fds=3),
    "fds-two-frames-one-read": step(frame(b"xy"), fds=1, read=False) + step(frame(b"z"), fds=4),
    "fds-in-next-frame": step(frame(b"ab") + frame(b"c")[:2], fds=2, read=False)
                         + step(frame(b"c")[2:]),
    "fds-held-over-limit": sum((step(b"\x00", fds=128, read=False) for _ in range(9)), [])
                           + step(b"\x00"),
    "too-long": step(struct.pack("<I", 4097)),
}

def write(out, seeds):
    os.makedirs(out, exist_ok=True)
    for name, data in seeds.items():
        with open(os.path.join(out, "seed-" + name), "wb") as f:
            f.write(bytes(data))
    print(f"{len(seeds)} seeds in {out}")

write(OUT, seeds)
write(FRAME_OUT, frame_seeds)
