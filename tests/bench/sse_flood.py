#!/usr/bin/env python3
"""Load generator for `cargo xtask bench`: an SSE server that writes events
as fast as it can (one send() per event, chunked framing in the same write)
and a client that reads them as fast as it can.

  python3 tests/bench/sse_flood.py server --port P
      prints READY <port>; GET /v1/chat/completions?events=N streams N
      OpenAI-style chunk events then data: [DONE]; keep-alive.
  python3 tests/bench/sse_flood.py client --port P --seconds S [--connections C] [--events N]
      prints one JSON line {"events", "seconds", "events_per_s", "requests"}.
Stdlib only; loopback only; bounded by --seconds.
"""

import argparse
import json
import socket
import sys
import threading
import time

EVENT = (
    b'data: {"id":"chatcmpl-flood","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"flood","choices":[{"index":0,"delta":{"content":" token"},"finish_reason":null}]}\n\n'
)
CHUNK = b"%x\r\n%s\r\n" % (len(EVENT), EVENT)
DONE = b"data: [DONE]\n\n"
DONE_CHUNK = b"%x\r\n%s\r\n0\r\n\r\n" % (len(DONE), DONE)
HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"transfer-encoding: chunked\r\ncache-control: no-cache\r\n\r\n"
)


def serve_conn(conn):
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = b""
    try:
        while True:
            while b"\r\n\r\n" not in buf:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
            head, buf = buf.split(b"\r\n\r\n", 1)
            target = head.split(b" ", 2)[1]
            events = 1000
            if b"events=" in target:
                events = int(target.split(b"events=", 1)[1].split(b"&", 1)[0])
            conn.sendall(HEAD)
            for _ in range(events):
                conn.sendall(CHUNK)
            conn.sendall(DONE_CHUNK)
    except OSError:
        return
    finally:
        conn.close()


def server(args):
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", args.port))
    srv.listen(64)
    print("READY %d" % srv.getsockname()[1], flush=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve_conn, args=(conn,), daemon=True).start()


def client_worker(args, deadline, totals, lock):
    sock = socket.create_connection(("127.0.0.1", args.port))
    req = b"GET /v1/chat/completions?events=%d HTTP/1.1\r\nhost: bench\r\n\r\n" % args.events
    requests = 0
    end_marker = b"0\r\n\r\n"
    try:
        while time.monotonic() < deadline:
            sock.sendall(req)
            tail = b""
            while True:
                data = sock.recv(262144)
                if not data:
                    raise OSError("server closed")
                tail = (tail + data)[-16:]
                if tail.endswith(end_marker):
                    break
            requests += 1
    finally:
        sock.close()
        with lock:
            totals["requests"] += requests


def client(args):
    totals = {"requests": 0}
    lock = threading.Lock()
    start = time.monotonic()
    deadline = start + args.seconds
    threads = [
        threading.Thread(target=client_worker, args=(args, deadline, totals, lock))
        for _ in range(args.connections)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    # Only completed requests count: each carried exactly --events events.
    events = totals["requests"] * args.events
    print(json.dumps({
        "events": events,
        "requests": totals["requests"],
        "seconds": elapsed,
        "events_per_s": events / elapsed,
    }), flush=True)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("server")
    s.add_argument("--port", type=int, default=0)
    c = sub.add_parser("client")
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--seconds", type=float, default=3.0)
    c.add_argument("--connections", type=int, default=1)
    c.add_argument("--events", type=int, default=2000)
    args = ap.parse_args()
    server(args) if args.mode == "server" else client(args)


if __name__ == "__main__":
    sys.exit(main())
