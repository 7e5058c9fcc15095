#!/usr/bin/env python3
"""Send-queue holds made on purpose with TCP_CORK, for the hold tests.

Run:  python3 tests/servers/cork_server.py --port 0 [--host 127.0.0.1]
      Prints ``READY <port>`` once listening, then, per request served, one
      JSON line of its own CLOCK_MONOTONIC stamps (ns, the clock of
      bpf_ktime_get_ns). Serves connections one after another.

GET /cork?mode=M&rid=R -> 200 text/event-stream, chunked, four SSE events,
each ONE send() of one HTTP chunk, TCP_NODELAY off. First the head and event
0 together (stamp ``t_e0`` just before); the client ACKs them late (delayed
ACK, ~40 ms). Then event 1:
  mode=held: a HOLD RELEASED BY A SEGMENT: TCP_CORK on, stamp ``a0``, send
     event 1 (it stays in the send queue: corked), stamp ``a1``; recv(1):
     the client sends one byte a while after it read event 0. Segments from
     the client (its delayed ACK, its byte) arrive while event 1 is still
     unsent; stamp ``a2`` once recv returns (the byte arrived before),
     TCP_CORK off, ``a3``.
  mode=stale: a HOLD THAT ENDS UNSEEN: TCP_CORK on, stamp ``b0``, send event
     1, sleep ``--cork-ms``, TCP_NODELAY on and TCP_CORK off (event 1 leaves
     inside those calls, with no segment coming in; uncorking alone would
     leave it to Nagle while event 0 is unacknowledged), stamp ``b1``,
     TCP_NODELAY off again. The client's next segment (its delayed ACK)
     comes later, after the bytes left; the server waits 100 ms for it.
Then events 2 and 3 and the last chunk. The two modes use separate
connections: the release of one case never meets the other's hold.
``unsent_after_1``: SIOCOUTQNSD right after event 1's send (bytes not yet
sent: > 0 shows the hold happened); ``unsent_after_push``: right after b1
(0: event 1 had left).
"""

import argparse
import fcntl
import json
import socket
import struct
import sys
import time

SIOCOUTQNSD = 0x894B


def unsent(sock):
    buf = fcntl.ioctl(sock.fileno(), SIOCOUTQNSD, struct.pack("i", 0))
    return struct.unpack("i", buf)[0]


def chunk(payload: bytes) -> bytes:
    return b"%x\r\n" % len(payload) + payload + b"\r\n"


def event(i: int, rid: str) -> bytes:
    return chunk(b'data: {"i":%d,"rid":"%s"}\n\n' % (i, rid.encode()))


def read_head(conn) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        part = conn.recv(4096)
        if not part:
            return b""
        data += part
    return data


def serve(conn, args):
    head = read_head(conn)
    if not head:
        return None
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    path = line.split(" ")[1] if " " in line else "/"
    rid = path.split("rid=", 1)[1] if "rid=" in path else "-"
    mono = time.monotonic_ns
    cork = lambda on: conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, on)
    nodelay = lambda on: conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, on)
    truth = {"rid": rid, "path": path}
    resp_head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    truth["t_e0"] = mono()
    conn.sendall(resp_head + event(0, rid))
    cork(1)
    if "mode=held" in path:
        truth["a0"] = mono()
        conn.sendall(event(1, rid))
        truth["a1"] = mono()
        truth["unsent_after_1"] = unsent(conn)
        got = conn.recv(1)
        truth["a2"] = mono()
        truth["client_byte"] = got.decode("latin-1")
        cork(0)
        truth["a3"] = mono()
    else:
        truth["b0"] = mono()
        conn.sendall(event(1, rid))
        truth["unsent_after_1"] = unsent(conn)
        time.sleep(args.cork_ms / 1000.0)
        nodelay(1)
        cork(0)
        truth["b1"] = mono()
        truth["unsent_after_push"] = unsent(conn)
        nodelay(0)
        time.sleep(0.1)
    conn.sendall(event(2, rid))
    conn.sendall(event(3, rid) + b"0\r\n\r\n")
    return truth


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--cork-ms", type=float, default=5.0)
    args = ap.parse_args()
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((args.host, args.port))
    srv.listen(16)
    print(f"READY {srv.getsockname()[1]}", flush=True)
    while True:
        conn, _ = srv.accept()
        with conn:
            truth = serve(conn, args)
            # the client reads to EOF: close only after it has everything
            try:
                conn.shutdown(socket.SHUT_WR)
                while conn.recv(4096):
                    pass
            except OSError:
                pass
        if truth is not None:
            print(json.dumps(truth), flush=True)


if __name__ == "__main__":
    sys.exit(main())
