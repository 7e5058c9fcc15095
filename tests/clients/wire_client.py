#!/usr/bin/env python3
"""Burst client for the request-ingress tests (stdlib only, raw sockets).

  python3 tests/clients/wire_client.py --port P --connections N
      [--tokens T] [--delay-ms D] [--ttft-ms F] [--path /stream]
      [--rid-prefix X] [--tls] [--close-after K] [--close-after-send]
      [--request-id-header] [--pipeline K --gap-ms G]
      [--timeout S]

N threads each open ONE connection (and, with --tls, finish the handshake),
wait at a barrier, then all send one request at once:
GET PATH?rid=<prefix><i>&tokens=T&delay_ms=D&ttft_ms=F. --request-id-header
adds ``X-Request-Id: req-<prefix><i>``. --close-after K closes the socket
right after the K-th event arrived (a client that walks away mid-stream);
--close-after-send closes it right after sending the request (a client that
gives up before the server even accepted it). --pipeline K sends K requests
on each connection (rids <prefix><i>-<k>), each as one send() with
TCP_NODELAY, G ms apart, without waiting for the responses, then reads the K
responses: a server busy with the first finds the others queued in its
receive buffer, one segment each.

One JSON line per connection (--pipeline: per request) on stdout, CLOCK_MONOTONIC ns
(time.monotonic_ns, the clock of bpf_ktime_get_ns):
  {"rid", "client_port", "t_connect_call" (just before connect()),
   "t_connect" (connect() returned),
   "handshake_ns" (TLS: do_handshake() duration, else null), "t_handshake"
   (TLS: just before do_handshake()),
   "t_send" (just before the request's sendall), "events" (received),
   "t_close" (just before close() with --close-after, else null),
   "error"; --pipeline adds "offset": the request's first byte's offset in
   what the connection sent}
"""

import argparse
import json
import socket
import ssl
import sys
import threading
import time


def release(barrier):
    """A thread that failed lets the others past the barrier (they fail too)."""
    try:
        barrier.abort()
    except Exception:
        pass


def run_one(i, args, barrier, out):
    rid = f"{args.rid_prefix}{i}"
    rec = {"rid": rid, "client_port": None, "t_connect_call": None, "t_connect": None, "handshake_ns": None,
           "t_send": None, "events": 0, "t_close": None, "error": None}
    sock = None
    try:
        rec["t_connect_call"] = time.monotonic_ns()
        raw = socket.create_connection(("127.0.0.1", args.port), timeout=args.timeout)
        rec["t_connect"] = time.monotonic_ns()
        rec["client_port"] = raw.getsockname()[1]
        sock = raw
        if args.tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            sock = ctx.wrap_socket(raw, do_handshake_on_connect=False)
            t0 = time.monotonic_ns()
            rec["t_handshake"] = t0
            sock.do_handshake()
            rec["handshake_ns"] = time.monotonic_ns() - t0
        barrier.wait()
        headers = "Host: x\r\n"
        if args.request_id_header:
            headers += f"X-Request-Id: req-{rid}\r\n"
        req = (f"GET {args.path}?rid={rid}&tokens={args.tokens}&delay_ms={args.delay_ms}"
               f"&ttft_ms={args.ttft_ms} HTTP/1.1\r\n{headers}\r\n").encode()
        rec["t_send"] = time.monotonic_ns()
        sock.sendall(req)
        if args.close_after_send:
            rec["t_close"] = time.monotonic_ns()
        buf = b""
        while not args.close_after_send:
            data = sock.recv(65536)
            if not data:
                break
            buf += data
            rec["events"] = buf.count(b"data: ")
            if args.close_after and rec["events"] >= args.close_after:
                rec["t_close"] = time.monotonic_ns()
                break
            if buf.endswith(b"0\r\n\r\n"):
                break
    except (OSError, threading.BrokenBarrierError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
        release(barrier)
    finally:
        if sock is not None:
            sock.close()
    out[i] = rec


def run_pipeline(i, args, barrier, out):
    """--pipeline: K requests on one connection, sent before any response."""
    recs = [{"rid": f"{args.rid_prefix}{i}-{k}", "client_port": None, "t_send": None,
             "offset": None, "events": 0, "error": None} for k in range(args.pipeline)]
    sock = None
    try:
        sock = socket.create_connection(("127.0.0.1", args.port), timeout=args.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for r in recs:
            r["client_port"] = sock.getsockname()[1]
        barrier.wait()
        offset = 0
        for k, r in enumerate(recs):
            if k:
                time.sleep(args.gap_ms / 1000)
            req = (f"GET {args.path}?rid={r['rid']}&tokens={args.tokens}&delay_ms={args.delay_ms}"
                   f"&ttft_ms={args.ttft_ms} HTTP/1.1\r\nHost: x\r\n\r\n").encode()
            r["offset"] = offset
            r["t_send"] = time.monotonic_ns()
            sock.sendall(req)
            offset += len(req)
        buf = b""
        while buf.count(b"\r\n0\r\n\r\n") < len(recs):
            data = sock.recv(65536)
            if not data:
                raise OSError("connection closed before every response ended")
            buf += data
        for r, body in zip(recs, buf.split(b"\r\n0\r\n\r\n")):
            r["events"] = body.count(b"data: ")
    except (OSError, threading.BrokenBarrierError) as e:
        for r in recs:
            r["error"] = f"{type(e).__name__}: {e}"
        release(barrier)
    finally:
        if sock is not None:
            sock.close()
    out[i] = recs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--connections", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--delay-ms", type=float, default=2.0)
    ap.add_argument("--ttft-ms", type=float, default=2.0)
    ap.add_argument("--path", default="/stream")
    ap.add_argument("--rid-prefix", default="")
    ap.add_argument("--tls", action="store_true")
    ap.add_argument("--close-after", type=int, default=0)
    ap.add_argument("--close-after-send", action="store_true")
    ap.add_argument("--request-id-header", action="store_true")
    ap.add_argument("--pipeline", type=int, default=0)
    ap.add_argument("--gap-ms", type=float, default=2.0)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    barrier = threading.Barrier(args.connections)
    out = [None] * args.connections
    target = run_pipeline if args.pipeline else run_one
    threads = [threading.Thread(target=target, args=(i, args, barrier, out))
               for i in range(args.connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rec in out:
        for r in (rec if args.pipeline else [rec]):
            sys.stdout.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
