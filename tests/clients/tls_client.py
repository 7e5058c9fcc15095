#!/usr/bin/env python3
"""Keep-alive HTTPS streaming client for the TLS wire tests (stdlib only).

  python3 tests/clients/tls_client.py --port P --connections N --requests R
      --keylog FILE [--rid-prefix X] [--tokens T] [--delay-ms D] [--ttft-ms F]

N threads each open one TLS 1.3 connection (TCP_NODELAY, no certificate
checks) and wait at a barrier; then each sends R streamed requests one
after the other on it: POST /v1/chat/completions with
``X-Request-Id: <prefix><conn>-<k>`` and a JSON body {"stream": true,
"max_tokens": T, "token_delay_ms": D, "ttft_ms": F}, reading each chunked
SSE response to its end before the next. The TLS secrets go to FILE
(NSS key log format, as SSLKEYLOGFILE) so tests/clients/tls_wire.py can
decrypt a capture of the connections.

One JSON line per request on stdout, CLOCK_MONOTONIC ns:
  {"rid", "client_port", "index" (0: the connection's first request),
   "t_send" (just before sendall), "t_first" (the first `data: ` read),
   "events", "ok", "error"}
"""

import argparse
import json
import socket
import ssl
import sys
import threading
import time


def read_until(sock, buf, marker):
    while marker not in buf:
        d = sock.recv(65536)
        if not d:
            raise ConnectionError("connection closed mid-response")
        buf += d
    i = buf.index(marker) + len(marker)
    return buf[:i], buf[i:]


def read_exact(sock, buf, n):
    while len(buf) < n:
        d = sock.recv(65536)
        if not d:
            raise ConnectionError("connection closed mid-response")
        buf += d
    return buf[:n], buf[n:]


def one_response(sock, buf, rec):
    """Reads one response (chunked or Content-Length); returns leftover bytes."""
    head, buf = read_until(sock, buf, b"\r\n\r\n")
    lower = head.lower()
    body_parts = []

    def seen(part):
        if rec["t_first"] is None and b"data: " in part:
            rec["t_first"] = time.monotonic_ns()
        body_parts.append(part)

    if b"transfer-encoding: chunked" in lower:
        while True:
            line, buf = read_until(sock, buf, b"\r\n")
            size = int(line.strip().split(b";")[0], 16)
            data, buf = read_exact(sock, buf, size + 2)
            if size == 0:
                break
            seen(data[:size])
    else:
        length = 0
        for h in lower.split(b"\r\n"):
            if h.startswith(b"content-length:"):
                length = int(h.split(b":", 1)[1])
        data, buf = read_exact(sock, buf, length)
        seen(data)
    body = b"".join(body_parts)
    rec["events"] = body.count(b"data: ")
    rec["ok"] = head.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in body
    return buf


def run_conn(i, args, ctx, barrier, out, lock):
    try:
        serve_conn(i, args, ctx, barrier, out, lock)
    except (OSError, ssl.SSLError, threading.BrokenBarrierError) as e:
        barrier.abort()
        with lock:
            out.append({"rid": f"{args.rid_prefix}{i}-setup", "error": repr(e), "ok": False})


def serve_conn(i, args, ctx, barrier, out, lock):
    raw = socket.create_connection(("127.0.0.1", args.port), timeout=args.timeout)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    port = raw.getsockname()[1]
    sock = ctx.wrap_socket(raw, server_hostname="localhost")
    barrier.wait()
    buf = b""
    body = json.dumps({"stream": True, "max_tokens": args.tokens,
                       "token_delay_ms": args.delay_ms, "ttft_ms": args.ttft_ms}).encode()
    for k in range(args.requests):
        rid = f"{args.rid_prefix}{i}-{k}"
        rec = {"rid": rid, "client_port": port, "index": k, "t_send": None, "t_first": None,
               "events": 0, "ok": False, "error": None}
        req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
               b"Content-Type: application/json\r\nX-Request-Id: %s\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (rid.encode(), len(body), body))
        try:
            rec["t_send"] = time.monotonic_ns()
            sock.sendall(req)
            buf = one_response(sock, buf, rec)
        except (OSError, ssl.SSLError, ValueError) as e:
            rec["error"] = repr(e)
        with lock:
            out.append(rec)
        if rec["error"]:
            break
    sock.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--keylog", required=True)
    ap.add_argument("--rid-prefix", default="t")
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--delay-ms", type=float, default=5)
    ap.add_argument("--ttft-ms", type=float, default=10)
    ap.add_argument("--timeout", type=float, default=30)
    args = ap.parse_args()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.keylog_filename = args.keylog
    barrier = threading.Barrier(args.connections, timeout=args.timeout)
    out, lock = [], threading.Lock()
    threads = [threading.Thread(target=run_conn, args=(i, args, ctx, barrier, out, lock))
               for i in range(args.connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rec in out:
        print(json.dumps(rec))
    sys.exit(0 if all(r["ok"] for r in out) and len(out) == args.connections * args.requests else 1)


if __name__ == "__main__":
    main()
