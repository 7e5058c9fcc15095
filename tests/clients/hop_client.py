#!/usr/bin/env python3
"""Streams chat completions through a gateway, for tests/ebpf_hops.rs.

Run:  python3 tests/clients/hop_client.py --host H --port P --requests N
                                          [--concurrency C] [--tokens K]
                                          [--rid-prefix X] [--traceparent]

Each request: POST /v1/chat/completions?rid=<prefix><i> with
``X-Request-Id: <prefix><i>`` (and, with --traceparent, a fresh sampled W3C
``traceparent``), stream=true, K tokens. One JSON line per request on
stdout: {"rid", "path", "status", "events" (SSE data events, [DONE]
excluded), "traceparent"}. Exits 1 if any request failed.
"""

import argparse
import http.client
import json
import os
import sys
import threading


def one(args, i, out, lock):
    rid = f"{args.rid_prefix}{i}"
    path = f"/v1/chat/completions?rid={rid}"
    body = json.dumps({
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": args.tokens,
        "token_delay_ms": args.token_delay_ms,
        "ttft_ms": args.ttft_ms,
    })
    headers = {"Content-Type": "application/json", "X-Request-Id": rid}
    tp = None
    if args.traceparent:
        tp = f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01"
        headers["traceparent"] = tp
    conn = http.client.HTTPConnection(args.host, args.port, timeout=60)
    conn.request("POST", path, body=body, headers=headers)
    resp = conn.getresponse()
    events = 0
    for line in resp:
        line = line.strip()
        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
            events += 1
    conn.close()
    rec = {"rid": rid, "path": path, "status": resp.status, "events": events, "traceparent": tp}
    with lock:
        out.append(rec)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--token-delay-ms", type=float, default=10.0)
    ap.add_argument("--ttft-ms", type=float, default=30.0)
    ap.add_argument("--rid-prefix", default="")
    ap.add_argument("--traceparent", action="store_true")
    args = ap.parse_args()
    out, lock = [], threading.Lock()
    todo = list(range(args.requests))
    failed = []

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            try:
                one(args, i, out, lock)
            except Exception as e:  # reported, and the run fails
                with lock:
                    failed.append(f"request {i}: {e!r}")

    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rec in sorted(out, key=lambda r: r["rid"]):
        print(json.dumps(rec), flush=True)
    if failed or any(r["status"] != 200 for r in out):
        print("\n".join(failed), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
