#!/usr/bin/env python3
"""Measuring gRPC client for tests/servers/grpc_stream.py (grpcio, h2c).

  python3 tests/clients/grpc_client.py --port P [--host 127.0.0.1]
      [--calls N] [--concurrency C] [--messages M] [--messages-step D]
      [--gap-ms G] [--ttft-ms F] [--size S] [--status NAME --status-after K]
      [--cancel-after K] [--rid-prefix X] [--pause-after N] [--timeout S]

Every call goes over ONE channel = one HTTP/2 connection (a single target,
a local subchannel pool): C worker threads share it, call j going to worker
j % C, and the workers start together (barrier) once the channel is
connected. Call j asks for M + j*D messages (so concurrent calls can be
told apart by their count), with x-request-id metadata "<prefix><j>".

--pause-after N (with --concurrency 1): after the first N calls, print
``{"paused": N}`` and wait for a line on stdin before the rest, on the same
connection (for an agent started mid-connection).
--summary: print only one line at the end, {"calls", "messages", "errors",
"seconds", "messages_per_s"} (from the workers' start to the last call's end;
for `cargo xtask bench --only grpc`).
--cancel-after K: cancel each call (RST_STREAM CANCEL) once K messages
arrived. --status NAME --status-after K: the server ends each call with that
status after K messages.

Times are time.monotonic_ns() (CLOCK_MONOTONIC, the clock of
bpf_ktime_get_ns): t_send_ns right before the call is started, the arrival
of every message when the response iterator hands it over, t_end_ns when the
final status is known (or the cancel was issued).

One JSON line per call on stdout, in completion order:
  {"request_id", "path", "call", "worker", "seq", "t_send_ns",
   "chunk_arrival_ns" (one per message), "chunks", "server_write_ns" (the
   server's "mono_ns" stamp in each message), "server_req_ns" (initial
   metadata x-req-mono-ns, the handler's start), "ttft_ns", "e2e_ns",
   "grpc_status" (numeric code), "grpc_code" (name), "grpc_message_bytes",
   "cancelled", "expected_messages", "error"}
The client never crashes on a failed call (error set) and exits 0.
"""

import argparse
import json
import sys
import threading
import time

import grpc

METHOD = "/tokentrace.test.Streamer/Generate"
mono = time.monotonic_ns


def one_call(stub, args, j, worker, seq):
    n = args.messages + j * args.messages_step
    req = {"messages": n, "gap_ms": args.gap_ms, "ttft_ms": args.ttft_ms, "size": args.size}
    if args.status is not None:
        req["status"] = args.status
        req["status_after"] = args.status_after
    rid = f"{args.rid_prefix}{j}"
    rec = {
        "request_id": rid,
        "path": METHOD,
        "call": j,
        "worker": worker,
        "seq": seq,
        "expected_messages": n,
        "chunk_arrival_ns": [],
        "server_write_ns": [],
        "server_req_ns": None,
        "cancelled": False,
        "error": None,
    }
    body = json.dumps(req).encode()
    rec["t_send_ns"] = mono()
    call = stub(body, metadata=(("x-request-id", rid),), timeout=args.timeout)
    try:
        for msg in call:
            t = mono()
            rec["chunk_arrival_ns"].append(t)
            try:
                rec["server_write_ns"].append(int(json.loads(msg)["mono_ns"]))
            except (ValueError, KeyError, TypeError):
                rec["server_write_ns"].append(None)
            if rec["server_req_ns"] is None:
                rec["server_req_ns"] = req_stamp(call.initial_metadata())
            if args.cancel_after is not None and len(rec["chunk_arrival_ns"]) >= args.cancel_after:
                rec["cancelled"] = True
                call.cancel()
                break
    except grpc.RpcError:
        pass  # the status is read below
    t_end = mono()
    code = call.code()
    rec["grpc_code"] = code.name if code is not None else None
    rec["grpc_status"] = code.value[0] if code is not None else None
    details = call.details()
    rec["grpc_message_bytes"] = len(details.encode()) if details else 0
    if rec["server_req_ns"] is None:
        rec["server_req_ns"] = req_stamp(call.trailing_metadata() or ())
    arr = rec["chunk_arrival_ns"]
    rec["chunks"] = len(arr)
    rec["ttft_ns"] = arr[0] - rec["t_send_ns"] if arr else None
    rec["t_end_ns"] = t_end
    rec["e2e_ns"] = t_end - rec["t_send_ns"]
    expected_code = args.status or "OK"
    if rec["cancelled"]:
        expected_code = "CANCELLED"
    if rec["grpc_code"] != expected_code:
        rec["error"] = f"status {rec['grpc_code']} ({details!r}), expected {expected_code}"
    return rec


def req_stamp(md):
    for k, v in md or ():
        if k == "x-req-mono-ns":
            try:
                return int(v)
            except ValueError:
                return None
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--calls", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--messages", type=int, default=8)
    ap.add_argument("--messages-step", type=int, default=0)
    ap.add_argument("--gap-ms", type=float, default=20.0)
    ap.add_argument("--ttft-ms", type=float, default=20.0)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--status", default=None, help="grpc.StatusCode name the server ends with")
    ap.add_argument("--status-after", type=int, default=0)
    ap.add_argument("--cancel-after", type=int, default=None)
    ap.add_argument("--rid-prefix", default="grpc-")
    ap.add_argument("--pause-after", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--summary", action="store_true", help="one summary line instead of records")
    args = ap.parse_args()
    if args.calls < 0 or args.concurrency < 1:
        ap.error("--calls >= 0 and --concurrency >= 1")
    if args.pause_after is not None and args.concurrency != 1:
        ap.error("--pause-after needs --concurrency 1")
    if args.cancel_after is not None and args.cancel_after < 1:
        ap.error("--cancel-after must be at least 1")

    channel = grpc.insecure_channel(
        f"{args.host}:{args.port}",
        options=[("grpc.use_local_subchannel_pool", 1), ("grpc.enable_retries", 0)],
    )
    grpc.channel_ready_future(channel).result(timeout=args.timeout)
    stub = channel.unary_stream(METHOD, request_serializer=None, response_deserializer=None)
    out_lock = threading.Lock()

    def emit(obj):
        with out_lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    workers = min(args.concurrency, max(args.calls, 1))
    started = []
    barrier = threading.Barrier(workers, action=lambda: started.append(mono()))
    totals = {"calls": 0, "messages": 0, "errors": 0}
    if args.summary:

        def emit(obj):  # noqa: F811 - counts instead of printing
            if "paused" in obj:
                return
            with out_lock:
                totals["calls"] += 1
                totals["messages"] += obj.get("chunks", 0)
                totals["errors"] += obj.get("error") is not None

    def worker(w):
        barrier.wait()
        for seq, j in enumerate(range(w, args.calls, workers)):
            if args.pause_after is not None and j == args.pause_after:
                emit({"paused": j})
                sys.stdin.readline()
            try:
                rec = one_call(stub, args, j, w, seq)
            except Exception as e:  # noqa: BLE001 - report, never crash
                rec = {"request_id": f"{args.rid_prefix}{j}", "call": j, "error": repr(e)}
            emit(rec)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if args.summary:
        secs = (mono() - started[0]) / 1e9 if started else 0.0
        totals["seconds"] = secs
        totals["messages_per_s"] = totals["messages"] / secs if secs > 0 else 0.0
        print(json.dumps(totals), flush=True)
    channel.close()


if __name__ == "__main__":
    main()
