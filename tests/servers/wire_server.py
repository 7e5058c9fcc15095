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
   byte returned), "t_write": [stamp just before each event's send()],
   "writes_ok": events whose send() succeeded, "error": null | "EPIPE" | ...}
A client that leaves mid-stream makes a send() fail (EPIPE/ECONNRESET): the
server records it, stops that stream, closes the connection.
"""

import argparse
import json
import select
import socket
import ssl
import sys
import time
from urllib.parse import parse_qs, urlsplit


def now():
    return time.monotonic_ns()


def emit(record):
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def read_request(conn, buf):
    """Returns (head bytes, rest, t_read of its first byte) or None at EOF."""
    t_read = None
    while b"\r\n\r\n" not in buf:
        data = conn.recv(65536)
        if not data:
            return None
        if t_read is None and not buf.strip(b"\r\n"):
            t_read = now()
        buf += data
    head, rest = buf.split(b"\r\n\r\n", 1)
    return head, rest, t_read


def serve_connection(conn, accepted, t_tls=None):
    """`accepted`: (just before accept(), accept() returned)."""
    t_accept_call, t_accept = accepted
    buf = b""
    while True:
        got = read_request(conn, buf)
        if got is None:
            return
        head, buf, t_read = got
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        target = line.split(" ")[1] if " " in line else "/"
        url = urlsplit(target)
        q = {k: v[0] for k, v in parse_qs(url.query).items()}
        rec = {"rid": q.get("rid"), "path": target, "t_accept_call": t_accept_call,
               "t_accept": t_accept, "t_tls": t_tls, "t_read": t_read, "t_write": [], "writes_ok": 0,
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
    args = ap.parse_args()
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
