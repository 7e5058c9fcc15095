#!/usr/bin/env python3
"""Client for the stall-explanation scenarios of tests/servers/infer_server.py
(stdlib only; the HTTP/SSE parsing and the timing are stream_client.py's).

  python3 tests/clients/explain_client.py --port P \
      --request '{"max_tokens": 16, "sync_stall": {"token": 5, "ms": 50}}' \
      [--request '{...}' ...] [--stagger-ms 10] [--host 127.0.0.1] [--timeout S]
      [--delay-acks]

Every --request is a JSON object merged over the base body
{"model": "test-model", "messages": [...], "stream": true}, so it sets
max_tokens, kernel_ms, prefill_ms and the injected causes. Each request gets
its own connection, all connected up front; request k is sent stagger-ms
after the response headers of request k-1 arrived. The frontend answers
with headers only once it has handed the request to the engine, so the
engine sees the requests in --request order however loaded the machine is
(the queue scenario: a long request, then one that waits behind it).

One JSON line per request on stdout, in --request order:
  {"index", "status", "response_id", "t_send_ns", "t_first_byte_ns",
   "chunks", "chunk_arrival_ns", "server_write_ns", "delivery_ns", "ttft_ns",
   "e2e_ns", "done_seen", "x_truth", "aborted", "error"}
Times are time.monotonic_ns() (CLOCK_MONOTONIC) as in stream_client.py:
chunk_arrival_ns[i] is the return of the recv() that completed SSE event i
([DONE] excluded), server_write_ns[i] its "x_mono_ns", delivery_ns[i] the
difference (server write to client arrival: where a Nagle hold shows),
x_truth the server's ground truth from the final event. Errors give
aborted: true; the client always exits 0.
"""

import argparse
import json
import os
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stream_client import Aborted, ChunkedDecoder, Conn, SseParser, build_request  # noqa: E402

mono = time.monotonic_ns


class DelayedAckConn(Conn):
    """A connection that keeps its ACKs delayed (--delay-acks): TCP_QUICKACK
    off before every recv(), so reading a small pushed segment does not make
    the kernel ACK it at once. The server's Nagle scenario then holds its
    second small write until the delayed ACK (~40 ms) every time, not only
    when the ACK timing happens to."""

    def recv(self):
        if self.sock is not None:
            try:
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 0)
            except OSError:
                pass
        return super().recv()

PATH = "/v1/chat/completions"


def run_request(conn, body, on_headers):
    rec = {
        "status": None, "response_id": None, "t_send_ns": None, "t_first_byte_ns": None,
        "chunks": 0, "chunk_arrival_ns": [], "server_write_ns": [], "delivery_ns": [],
        "ttft_ns": None, "e2e_ns": None, "done_seen": False, "x_truth": None,
        "aborted": False, "error": None,
    }

    def on_event(payload, t):
        if payload.strip() == b"[DONE]":
            rec["done_seen"] = True
            return
        rec["chunks"] += 1
        rec["chunk_arrival_ns"].append(t)
        try:
            obj = json.loads(payload)
        except ValueError:
            obj = {}
        if rec["response_id"] is None and isinstance(obj.get("id"), str):
            rec["response_id"] = obj["id"]
        written = obj.get("x_mono_ns")
        rec["server_write_ns"].append(written)
        rec["delivery_ns"].append(t - written if isinstance(written, int) else None)
        if "x_truth" in obj:
            rec["x_truth"] = obj["x_truth"]

    try:
        req = build_request("POST", PATH, conn.host, conn.port, body)
        rec["t_send_ns"] = mono()
        try:
            conn.sock.sendall(req)
        except OSError as e:
            raise Aborted(f"send: {e.__class__.__name__}: {e}")
        buf = b""
        while b"\r\n\r\n" not in buf:
            data, t = recv_delaying_acks(conn)
            if not data:
                raise Aborted("eof before the response headers")
            if rec["t_first_byte_ns"] is None:
                rec["t_first_byte_ns"] = t
                on_headers()
            buf += data
        head, rest = buf.split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        rec["status"] = int(lines[0].split(b" ", 2)[1])
        headers = {
            k.strip().lower(): v.strip().lower()
            for k, _, v in (ln.partition(b":") for ln in lines[1:])
        }
        if b"chunked" not in headers.get(b"transfer-encoding", b""):
            raise Aborted(f"status {rec['status']}, not a chunked stream: {rest[:200]!r}")
        sse = SseParser(on_event)
        dec = ChunkedDecoder(sse.feed, lambda _t: None)
        data, t = rest, t
        while dec.feed(data, t) is None:
            data, t = recv_delaying_acks(conn)
            if not data:
                raise Aborted("eof mid-body")
        rec["e2e_ns"] = t - rec["t_send_ns"]
    except Aborted as e:
        rec["aborted"], rec["error"] = True, str(e)
    except Exception as e:  # never crash a worker
        rec["aborted"], rec["error"] = True, f"client error: {e.__class__.__name__}: {e}"
    if rec["chunk_arrival_ns"] and rec["t_send_ns"] is not None:
        rec["ttft_ns"] = rec["chunk_arrival_ns"][0] - rec["t_send_ns"]
    return rec


def recv_delaying_acks(conn):
    """conn.recv() on a socket in delayed-ACK mode.

    TCP_QUICKACK=0 puts the connection in Linux's interactive (ping-pong)
    mode, the state of a reused keep-alive connection: small segments are
    ACKed after up to ~40 ms (or with the next one) instead of at once.
    That is the condition under which Nagle holds a small write, and the
    kernel leaves the mode whenever a delayed ACK fires (a pause in the
    stream), so it is set again before every read. It changes nothing for
    writes the server sends with TCP_NODELAY."""
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 0)
    return conn.recv()


def main():
    ap = argparse.ArgumentParser(description="stall-scenario client for infer_server.py")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--request", action="append", required=True, metavar="JSON",
                    help="body fields of one request (repeat for concurrent requests)")
    ap.add_argument("--stagger-ms", type=float, default=10.0,
                    help="delay from the response headers of one request to the next send")
    ap.add_argument("--timeout", type=float, default=30.0, help="per-recv timeout, seconds")
    ap.add_argument("--delay-acks", action="store_true",
                    help="keep the client's ACKs delayed (TCP_QUICKACK off before every recv)")
    args = ap.parse_args()
    # As in stream_client.py: arrival stamps need the GIL after recv().
    sys.setswitchinterval(0.0002)

    bodies = []
    for text in args.request:
        extra = json.loads(text)
        if not isinstance(extra, dict):
            ap.error("--request must be a JSON object")
        body = {
            "model": "test-model",
            "messages": [{"role": "user", "content": "Say something, one token at a time."}],
            "stream": True,
        }
        body.update(extra)
        bodies.append(json.dumps(body).encode())

    results = [None] * len(bodies)
    answered = [threading.Event() for _ in bodies]
    barrier = threading.Barrier(len(bodies))

    def worker(k):
        conn = (DelayedAckConn if args.delay_acks else Conn)(args.host, args.port, args.timeout)
        try:
            conn.connect()
        except OSError as e:
            results[k] = {"aborted": True, "error": f"connect: {e}"}
        try:
            barrier.wait(timeout=60)
        except threading.BrokenBarrierError:
            pass
        if k > 0:
            answered[k - 1].wait(timeout=args.timeout)
            time.sleep(args.stagger_ms / 1000)
        if results[k] is None:
            results[k] = run_request(conn, bodies[k], answered[k].set)
        # Also on failure: the next request must not wait for headers
        # that will never come.
        answered[k].set()
        conn.close()

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(len(bodies))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for k, rec in enumerate(results):
        sys.stdout.write(json.dumps(dict(rec, index=k)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
