"""A scripted gpumemd for tests/build/check_readme.sh: it answers gpumemctl
with the figures README.md's samples show and tests/check_ctl.c plays (a
device of 80 GiB with memory held outside gpumemd, tags in transit and
mixed, a pause that could not release everything), which no host backend
can make. It speaks the wire protocol of proto/gpumemd.proto (a u32 length
and an Envelope per frame) with a protobuf writer of its own, so that it
needs nothing but Python 3.

    python3 readme_fake_daemon.py SOCKET

prints "ready" once it listens, then serves until it is killed.
"""
import os
import socket
import struct
import sys

GiB = 1 << 30
MiB = 1 << 20
WIRE_VERSION = (1, 4)  # common/wire.h
ROLE_WORKER = 1
ACTIVE, PAUSING = 0, 1
NOT_RELEASED = 13


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def u(field, value):
    """A varint field (uint, enum, bool); proto3 leaves out zeros."""
    value = int(value)
    return varint(field << 3) + varint(value) if value else b""


def s(field, text):
    data = text.encode()
    return varint(field << 3 | 2) + varint(len(data)) + data if data else b""


def m(field, body):
    return varint(field << 3 | 2) + varint(len(body)) + body


def device_check(device, released, free_before, free_after, shortfall, residual):
    # Of an 80 GiB device: used_after (field 10) is what free_after leaves.
    return (u(1, device) + u(2, released) + u(3, free_before) + u(4, free_after) +
            u(5, shortfall) + u(6, residual) + u(7, True) + u(10, 80 * GiB - free_after))


def hello_reply():
    # Four devices of 80 GiB, as tests/check_ctl.c's fake_serve has them.
    devs = b"".join(m(5, u(1, i) + u(2, 80 * GiB) + s(5, "host-local:%d" % i)) for i in range(4))
    return (u(1, WIRE_VERSION[0]) + u(2, WIRE_VERSION[1]) + s(3, "host") + u(4, 2 * MiB) +
            devs + u(6, 1))


def status_reply():
    # tests/check_ctl.c: status_names_the_largest_holders_outside_gpumemd,
    # the tags owned by uid 1000.
    dev = u(1, 3) + u(2, 80 * GiB) + u(3, 20 * GiB) + u(4, 40 * GiB) + s(5, "host-local:3") + \
        u(7, 1 * GiB)
    kv = (s(1, "kv_cache") + u(2, PAUSING) + u(3, 16) + u(4, 16 * GiB) + u(6, 8) +
          u(7, 8 * GiB) + u(9, 8) + u(10, 8 * GiB) + u(11, 1000) + u(12, True))
    wt = (s(1, "weights") + u(2, ACTIVE) + u(3, 2) + u(4, 2 * GiB) + u(6, 1) + u(7, 1 * GiB) +
          u(8, True) + u(11, 1000) + u(12, True))
    residual = 55942366003  # 52.1 GiB
    session = (u(1, 7) + u(2, 4121) + s(4, "sglang-tp3") + u(5, ROLE_WORKER) + u(8, residual) +
               u(9, True))
    procs = [
        u(1, 77) + u(2, 3) + u(3, 2 * GiB) + u(5, 2 * GiB) + s(7, "python3"),
        u(1, 4121) + u(2, 3) + u(3, residual) + u(5, residual) + u(6, 7) + s(7, "sglang-tp3"),
        u(1, 99) + u(2, 3) + u(3, 1 * GiB) + u(4, 1 * GiB) + s(7, "quiet"),
    ]
    return (s(1, "host") + u(2, 2 * MiB) + m(3, dev) + m(4, kv) + m(4, wt) + m(5, session) +
            b"".join(m(12, p) for p in procs) + u(13, True))


def pause_error():
    # tests/check_ctl.c: a_failed_pause_says_what_is_held_and_by_whom.
    return (u(1, NOT_RELEASED) + s(2, "2 buffers of tag kv were not released") +
            u(5, 4121) + u(5, 4122) + u(6, 2) + u(7, 8 * GiB) +
            m(8, device_check(0, 8 * GiB, 10 * GiB, 14 * GiB, 4 * GiB, 1 * GiB)))


# Envelope body fields (proto/gpumemd.proto).
ERROR, HELLO, HELLO_REPLY, PAUSE, RESUME, STATUS, STATUS_REPLY = 10, 11, 12, 17, 18, 20, 21
ANSWERS = {HELLO: (HELLO_REPLY, hello_reply), PAUSE: (ERROR, pause_error),
           RESUME: (ERROR, pause_error), STATUS: (STATUS_REPLY, status_reply)}


def read_varint(buf, i):
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def envelope_fields(buf):
    """The request's id and the field number of its body."""
    i, rid, body = 0, 0, None
    while i < len(buf):
        key, i = read_varint(buf, i)
        field, wt = key >> 3, key & 7
        if wt == 0:
            value, i = read_varint(buf, i)
            if field == 1:
                rid = value
        elif wt == 2:
            n, i = read_varint(buf, i)
            i += n
            body = field
        else:
            raise ValueError("wire type %d" % wt)
    return rid, body


def read_full(conn, n):
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def serve(conn):
    while True:
        hdr = read_full(conn, 4)
        if hdr is None:
            return
        payload = read_full(conn, struct.unpack("<I", hdr)[0])
        if payload is None:
            return
        rid, body = envelope_fields(payload)
        if body not in ANSWERS:
            sys.stderr.write("readme_fake_daemon: no answer for body %s\n" % body)
            return
        field, make = ANSWERS[body]
        env = u(1, rid) + m(field, make())
        conn.sendall(struct.pack("<I", len(env)) + env)


def main():
    path = sys.argv[1]
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(path)
    lsock.listen(8)
    print("ready", flush=True)
    while True:
        conn, _ = lsock.accept()
        try:
            serve(conn)
        finally:
            conn.close()


if __name__ == "__main__":
    os.umask(0o077)
    main()
