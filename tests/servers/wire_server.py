#!/usr/bin/env python3
"""Single-threaded, sequential SSE server for the request-ingress tests.

Run:  python3 tests/servers/wire_server.py --port 0 [--host 127.0.0.1]
          [--accept-delay-ms D] [--tls CERT KEY]
      Prints ``READY <port>`` on stdout once listening, then one JSON line per
      request it handled (its own CLOCK_MONOTONIC stamps, see below).

One thread, blocking sockets: it accepts ONE connection, serves every request
on it until the client closes, then accepts the next. Concurrent clients
therefore wait in the kernel: in the accept queue (the handshake is done by
the kernel, the request bytes queue on the not-yet-accepted socket) and, on a
kept-alive connection, in the receive queue. listen() backlog is 256.

  --accept-delay-ms D   sleep D ms before every accept() (a slow accepter)
  --hold-accept-ms D    accept each connection D ms after it was queued
  --tls CERT KEY        HTTPS: the accepted socket is wrapped by the stdlib
                        ssl module (socket BIO; the handshake runs in
                        SSL_do_handshake right after accept)
  --hold-first-read-ms D
                        each connection's first recv() copies into a page
                        registered with userfaultfd, and the copy's page
                        fault is resolved D ms after it was raised: the
                        recv holds the socket's lock all that time, so the
                        segments that arrive meanwhile wait in the socket's
                        backlog and TCP processes them only when the recv
                        releases the socket (root, or
                        vm.unprivileged_userfaultfd=1)

GET /stream?rid=R&tokens=N&delay_ms=D&ttft_ms=T
    200 text/event-stream, Content-Length-free, ``Connection: keep-alive``,
    chunked: the head in one send(), then N events ``data: {"i":k,"rid":R}``
    each as ONE send() of one HTTP chunk (T ms before the first, D ms between),
    then the last chunk. TCP_NODELAY is set: every send is a packet.
GET /close-unanswered?rid=R
    reads the request and closes the connection without answering.

Per request, one JSON line on stdout (all CLOCK_MONOTONIC ns, the clock of
bpf_ktime_get_ns):
  {"rid", "path", "t_accept" (accept() returned; null for later requests on
   the connection), "t_accept_call" (just before that accept(); null
   likewise), "t_tls" (--tls: the server's handshake returned; null
   likewise), "t_read" (the recv() that brought the request's first
   byte returned), "t_hold" (--hold-first-read-ms, a connection's first
   request: when its read's page fault was read, so the socket was owned
   by then; else null), "t_write": [stamp just before each event's send()],
   "writes_ok": events whose send() succeeded, "error": null | "EPIPE" | ...}
A client that leaves mid-stream makes a send() fail (EPIPE/ECONNRESET): the
server records it, stops that stream, closes the connection.
"""

import argparse
import ctypes
import json
import mmap
import os
import select
import socket
import ssl
import struct
import sys
import threading
import time
from urllib.parse import parse_qs, urlsplit


def now():
    return time.monotonic_ns()


def emit(record):
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


# userfaultfd (x86-64): the syscall and the ioctls of <linux/userfaultfd.h>.
SYS_USERFAULTFD = 323
UFFD_API = 0xAA
UFFDIO_API = 0xC018AA3F
UFFDIO_REGISTER = 0xC020AA00
UFFDIO_COPY = 0xC028AA03
UFFDIO_REGISTER_MODE_MISSING = 1
UFFD_EVENT_PAGEFAULT = 0x12
PAGE = mmap.PAGESIZE
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]


def ioctl(fd, request, buf):
    if libc.ioctl(fd, request, ctypes.addressof(buf)) != 0:
        raise OSError(ctypes.get_errno(), f"ioctl {request:#x}")


class HeldReads:
    """Buffers whose first write from the kernel waits `hold_s` (see
    --hold-first-read-ms): a thread reads the page faults and resolves each
    one with a zero-filled page, the first of every buffer after the hold."""

    def __init__(self, hold_s):
        self.hold_s = hold_s
        fd = libc.syscall(SYS_USERFAULTFD, 0o2000000)  # O_CLOEXEC, kernel faults too
        if fd < 0:
            raise OSError(ctypes.get_errno(), "userfaultfd")
        self.fd = fd
        api = ctypes.create_string_buffer(struct.pack("QQQ", UFFD_API, 0, 0), 24)
        ioctl(fd, UFFDIO_API, api)
        self.zeros = ctypes.create_string_buffer(PAGE)
        self.unheld = []  # (start, size) of buffers not faulted yet
        self.held_at = {}  # start -> when its held fault was read
        self.lock = threading.Lock()
        threading.Thread(target=self.resolve, daemon=True).start()

    def buffer(self, size=65536):
        """A fresh anonymous mapping registered for missing-page faults."""
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        start = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        reg = ctypes.create_string_buffer(
            struct.pack("QQQQ", start, size, UFFDIO_REGISTER_MODE_MISSING, 0), 32)
        ioctl(self.fd, UFFDIO_REGISTER, reg)
        with self.lock:
            self.unheld.append((start, size))
        return mm, start

    def resolve(self):
        while True:
            msg = os.read(self.fd, 32)
            if len(msg) < 32 or msg[0] != UFFD_EVENT_PAGEFAULT:
                continue
            address = struct.unpack_from("Q", msg, 16)[0]
            page = address & ~(PAGE - 1)
            with self.lock:
                first = [r for r in self.unheld if r[0] <= address < r[0] + r[1]]
                for r in first:
                    self.unheld.remove(r)
                    self.held_at[r[0]] = now()
            if first:
                time.sleep(self.hold_s)
            copy = ctypes.create_string_buffer(
                struct.pack("QQQQq", page, ctypes.addressof(self.zeros), PAGE, 0, 0), 40)
            try:
                ioctl(self.fd, UFFDIO_COPY, copy)
            except OSError:
                pass  # another thread's fault mapped it already


HELD = None  # HeldReads with --hold-first-read-ms


def held_recv(conn):
    """One recv() into a held buffer (see HeldReads): its bytes, and when
    the hold began (its fault was read; null if it never faulted)."""
    mm, start = HELD.buffer()
    n = conn.recv_into(memoryview(mm))
    data = mm[:n]
    mm.close()
    with HELD.lock:
        return data, HELD.held_at.pop(start, None)


def read_request(conn, buf, first=False):
    """Returns (head bytes, rest, t_read of its first byte, t_hold) or None
    at EOF; t_hold: when a held first read's hold began, else None."""
    t_read = t_hold = None
    while b"\r\n\r\n" not in buf:
        if first and HELD:
            data, t_hold = held_recv(conn)
        else:
            data = conn.recv(65536)
        first = False
        if not data:
            return None
        if t_read is None and not buf.strip(b"\r\n"):
            t_read = now()
        buf += data
    head, rest = buf.split(b"\r\n\r\n", 1)
    return head, rest, t_read, t_hold


def serve_connection(conn, accepted, t_tls=None):
    """`accepted`: (just before accept(), accept() returned)."""
    t_accept_call, t_accept = accepted
    buf = b""
    first = True
    while True:
        got = read_request(conn, buf, first)
        first = False
        if got is None:
            return
        head, buf, t_read, t_hold = got
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        target = line.split(" ")[1] if " " in line else "/"
        url = urlsplit(target)
        q = {k: v[0] for k, v in parse_qs(url.query).items()}
        rec = {"rid": q.get("rid"), "path": target, "t_accept_call": t_accept_call,
               "t_accept": t_accept, "t_tls": t_tls, "t_read": t_read, "t_hold": t_hold,
               "t_write": [], "writes_ok": 0,
               "error": None}
        t_accept_call = t_accept = t_tls = None
        if url.path == "/close-unanswered":
            emit(rec)
            return
        tokens = int(q.get("tokens", "4"))
        delay = float(q.get("delay_ms", "2")) / 1e3
        ttft = float(q.get("ttft_ms", "2")) / 1e3
        try:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\nConnection: keep-alive\r\n\r\n")
            time.sleep(ttft)
            for i in range(tokens):
                if i:
                    time.sleep(delay)
                event = ("data: " + json.dumps({"i": i, "rid": rec["rid"]}) + "\n\n").encode()
                frame = b"%x\r\n%s\r\n" % (len(event), event)
                rec["t_write"].append(now())
                conn.sendall(frame)
                rec["writes_ok"] += 1
            conn.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError, OSError) as e:
            rec["error"] = type(e).__name__
            emit(rec)
            return
        emit(rec)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--accept-delay-ms", type=float, default=0.0)
    ap.add_argument("--hold-accept-ms", type=float, default=0.0,
                    help="accept a connection only this long after it arrived")
    ap.add_argument("--tls", nargs=2, metavar=("CERT", "KEY"))
    ap.add_argument("--hold-first-read-ms", type=float, default=0.0)
    args = ap.parse_args()
    global HELD
    if args.hold_first_read_ms:
        HELD = HeldReads(args.hold_first_read_ms / 1e3)
    ctx = None
    if args.tls:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(args.tls[0], args.tls[1])
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((args.host, args.port))
    ls.listen(256)
    print(f"READY {ls.getsockname()[1]}", flush=True)
    while True:
        if args.accept_delay_ms:
            time.sleep(args.accept_delay_ms / 1e3)
        if args.hold_accept_ms:
            # Wait for a connection to be queued, then leave it there.
            select.select([ls], [], [])
            time.sleep(args.hold_accept_ms / 1e3)
        t_accept_call = now()
        conn, _ = ls.accept()
        t_accept = now()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            t_tls = None
            if ctx is not None:
                conn = ctx.wrap_socket(conn, server_side=True)
                t_tls = now()
            serve_connection(conn, (t_accept_call, t_accept), t_tls)
        except (ssl.SSLError, OSError) as e:
            emit({"rid": None, "path": None, "t_accept_call": t_accept_call,
                  "t_accept": t_accept, "t_read": None,
                  "t_write": [], "writes_ok": 0, "error": type(e).__name__})
        finally:
            conn.close()


if __name__ == "__main__":
    main()
