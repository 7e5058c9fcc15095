#!/usr/bin/env python3
"""gRPC server-streaming test server (grpcio, h2c: HTTP/2 without TLS).

Run:  python3 tests/servers/grpc_stream.py --port P [--host 127.0.0.1]
                                           [--workers 64] [--stamps FILE]
      (--port 0 picks a free port). Prints ``READY <port>`` on stdout,
      flushed, once listening.

One method, ``/tokentrace.test.Streamer/Generate`` (server streaming), served
through ``grpc.method_handlers_generic_handler`` with bytes in and out: no
generated code, no grpcio-tools. The request is a JSON object:

  {"messages": N (default 8), "gap_ms": G (20), "ttft_ms": F (G),
   "size": S (64, bytes per message, at least the stamp JSON),
   "status": "RESOURCE_EXHAUSTED" (a grpc.StatusCode name; default OK),
   "status_after": K (messages sent before that status; default N),
   "message": "text of grpc-message" (with a non-OK status)}

The server waits F ms, then sends min(N, K) messages G ms apart and ends the
call with the status. Every message is the JSON
``{"i": i, "mono_ns": T}`` padded with spaces to S bytes, where T is
time.monotonic_ns() (CLOCK_MONOTONIC, the clock of bpf_ktime_get_ns) taken
just before the handler yields the message. grpcio serializes and writes it
afterwards, on its own threads, so T is a lower bound of the write, not the
write itself: the client's arrival is the upper one.

Initial metadata ``x-req-mono-ns``: time.monotonic_ns() when the handler
started (after grpcio read and parsed the request), sent before the first
message (trailers-only responses, a status with K = 0, carry it in the
trailers instead). The client's ``x-request-id`` metadata is echoed back as
initial metadata ``x-request-id``.

--stamps FILE appends one line per message, ``<x-request-id> <i> <T>``, for
diagnostics (written after the yield returns, so it costs the stream
nothing). --workers: size of the handler thread pool = how many calls can
stream at once (the test with 32 concurrent streams needs more than 32).
SIGTERM/SIGINT stop the server (grace 0).
"""

import argparse
import json
import signal
import threading
import time
from concurrent import futures

import grpc

SERVICE = "tokentrace.test.Streamer"
METHOD = "Generate"

mono = time.monotonic_ns


class Stamps:
    """Optional per-message stamp log (--stamps)."""

    def __init__(self, path):
        self.lock = threading.Lock()
        self.f = open(path, "a", buffering=1) if path else None

    def write(self, rid, i, t):
        if self.f is not None:
            with self.lock:
                self.f.write(f"{rid} {i} {t}\n")


def parse_request(raw):
    try:
        req = json.loads(raw or b"{}")
    except ValueError:
        req = None
    if not isinstance(req, dict):
        return None
    return req


def make_generate(stamps):
    def generate(request, context):
        t_handler = mono()
        req = parse_request(request)
        if req is None:
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details("request must be a JSON object")
            return
        meta = dict(context.invocation_metadata())
        rid = meta.get("x-request-id", "-")
        n = int(req.get("messages", 8))
        gap = float(req.get("gap_ms", 20)) / 1000.0
        ttft = float(req.get("ttft_ms", req.get("gap_ms", 20))) / 1000.0
        size = int(req.get("size", 64))
        status_name = req.get("status")
        code = grpc.StatusCode.OK
        if status_name is not None:
            code = getattr(grpc.StatusCode, str(status_name), None)
            if not isinstance(code, grpc.StatusCode):
                context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
                context.set_details(f"unknown status {status_name!r}")
                return
        k = int(req.get("status_after", n))
        sent = min(n, k)
        if sent > 0:
            context.send_initial_metadata(
                (("x-req-mono-ns", str(t_handler)), ("x-request-id", rid))
            )
        else:
            context.set_trailing_metadata((("x-req-mono-ns", str(t_handler)),))
        time.sleep(ttft)
        for i in range(sent):
            if i > 0:
                time.sleep(gap)
            if not context.is_active():
                return  # the client cancelled
            t = mono()
            body = json.dumps({"i": i, "mono_ns": t}, separators=(",", ":")).encode()
            if len(body) < size:
                body += b" " * (size - len(body))
            yield body
            stamps.write(rid, i, t)
        if code != grpc.StatusCode.OK:
            context.set_code(code)
            context.set_details(str(req.get("message", f"{code.name} after {sent} messages")))

    return generate


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    ap.add_argument("--workers", type=int, default=64, help="handler threads (concurrent calls)")
    ap.add_argument("--stamps", default=None, help="append '<rid> <i> <mono_ns>' per message")
    args = ap.parse_args()
    if args.workers < 1:
        ap.error("--workers must be at least 1")
    stamps = Stamps(args.stamps)
    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            METHOD: grpc.unary_stream_rpc_method_handler(
                make_generate(stamps),
                request_deserializer=None,
                response_serializer=None,
            )
        },
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=args.workers),
        handlers=(handler,),
        maximum_concurrent_rpcs=None,
    )
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    if port == 0:
        raise SystemExit(f"cannot listen on {args.host}:{args.port}")
    server.start()
    print(f"READY {port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.2):
        pass
    server.stop(0).wait(5)


if __name__ == "__main__":
    main()
