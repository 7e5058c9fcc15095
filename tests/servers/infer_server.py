#!/usr/bin/env python3
"""Two-process test inference server: an HTTP frontend and a GPU "engine".

Run:  python3 tests/servers/infer_server.py --port P [--host 127.0.0.1]
                                            [--native-dir DIR]
      (--port 0 picks a free port). Prints ``READY <port>`` on stdout,
      flushed, once listening and once the engine has loaded its libraries.
      Needs `cargo xtask native` (DIR, default target/native, must hold
      libcudart.so.12, libcuda.so.1 and libllm_usdt.so). Standard library
      only. Writes nothing to disk.

Shaped like vLLM: the frontend (ThreadingHTTPServer, HTTP/1.1 keep-alive)
parses requests, names each ``chatcmpl-<uuid hex>`` and streams the tokens
back; the engine, a separate process started by the frontend and connected
to it by a unix socket, owns the "GPU" (the stand-in libcudart.so.12 through
ctypes) and runs ONE request at a time: a request arriving while another
runs waits in the engine's queue. USDT probes of provider llm
(instrument/python/llm_usdt.py): the frontend fires request_start and
request_end, the engine request_queued, request_scheduled, prefill_start,
prefill_end, token and batch_step, all with the id the client sees.

POST /v1/chat/completions  body {"messages", "stream": true, "max_tokens" (16),
    "kernel_ms" (5: GPU time per token), "prefill_ms" (20),
    injected causes (optional, token indices from 0):
    "sync_stall":  {"token": 5, "ms": 50}  an extra kernel of ms before that
                   token's cudaStreamSynchronize: the engine blocks in the
                   sync for kernel_ms + ms
    "sleep_stall": {"token": 9, "ms": 40, "where": "frontend" | "engine"}
                   time.sleep(ms) in that process before the token is
                   emitted (engine: after its sync, before llm:token;
                   frontend: before the token's SSE write)
    "nagle":       {"token": 12}  the frontend clears TCP_NODELAY and writes
                   that event as two writes (chunk-size line, then data and
                   CRLF), so Nagle holds the second until the client ACKs the
                   first (a delayed ACK: ~40 ms on Linux when the client's
                   connection is interactive, see
                   tests/clients/explain_client.py); TCP_NODELAY is set
                   again once the send queue has no unsent bytes (setting it
                   earlier would push the held bytes out at once); events
                   written meanwhile wait with the held bytes}
    The queue stall needs no field: send a second request while one runs;
    it waits for the first one's remaining work (prefill_ms +
    max_tokens * kernel_ms for a request that just started).
    -> text/event-stream, chunked, every SSE event in ONE write (TCP_NODELAY
    on): max_tokens chat.completion.chunk events, one usage event (choices
    []) carrying "x_truth", then "data: [DONE]" (N+1 chunks as the agent
    and tests/clients/stream_client.py count them).
GET /health -> {"status": "ok"}

Every SSE data event carries "x_mono_ns": time.monotonic_ns() (the clock of
bpf_ktime_get_ns, the same in both processes) just before its first write.

"x_truth": the server's own measurements, CLOCK_MONOTONIC ns:
  {"request_id",
   "frontend": {"pid", "tid"},             thread that wrote the response
   "engine":   {"pid", "tid"},             thread that ran the GPU work
   "queue":    {"queued_ns", "scheduled_ns", "wait_ns", "depth"},
   "prefill":  {"start_ns", "end_ns"},     prefill_start .. prefill_end
   "tokens":   {"sync_start_ns": [...], "sync_end_ns": [...],
                "emit_ns": [...]},         per token: the engine's
                                           cudaStreamSynchronize and llm:token
   and for each injected cause, only when requested:
   "sync_stall":  {"token", "ms", "sync_start_ns", "sync_end_ns"}
   "sleep_stall": {"token", "ms", "where", "pid", "tid", "start_ns", "end_ns"}
   "nagle":       {"token", "write_start_ns", "first_write_end_ns",
                   "write_end_ns", "unsent_bytes_after_write" (> 0: held),
                   "sent_ns" (the send queue had no unsent bytes any more,
                   polled every ~0.3 ms), "held_ns" (sent_ns - write_end_ns),
                   "nodelay_restored_ns"}}
"""

import argparse
import ctypes
import fcntl
import json
import os
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "instrument", "python"))

WORDS = (
    "The quick brown fox jumps over the lazy dog while the model streams "
    "tokens one by one to a patient client that measures every gap ."
).split()

# ioctl: bytes in the send queue not yet sent (linux/sockios.h).
SIOCOUTQNSD = 0x894B

mono = time.monotonic_ns


def send_msg(sock, lock, obj):
    data = json.dumps(obj, separators=(",", ":")).encode() + b"\n"
    with lock:
        sock.sendall(data)


def read_msgs(sock):
    """Yields the JSON messages of a newline-delimited stream until EOF."""
    buf = b""
    while True:
        data = sock.recv(65536)
        if not data:
            return
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield json.loads(line)


# =============================================================== engine


class Gpu:
    """The stand-in CUDA runtime, used as an inference engine would."""

    def __init__(self, native_dir):
        lib = ctypes.CDLL(os.path.join(native_dir, "libcudart.so.12"))

        class Dim3(ctypes.Structure):
            _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]

        lib.cudaLaunchKernel.argtypes = (
            ctypes.c_void_p, Dim3, Dim3, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
        )
        lib.cudaMemcpyAsync.argtypes = (
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
        )
        lib.cudaStreamSynchronize.argtypes = (ctypes.c_void_p,)
        lib.cudaStreamCreate.argtypes = (ctypes.POINTER(ctypes.c_void_p),)
        # Reached through libcudart's dependency on the stand-in libcuda.so.1.
        lib.fakecuda_set_kernel_ns.argtypes = (ctypes.c_uint64,)
        self.lib = lib
        self.grid = Dim3(1, 1, 1)
        self.block = Dim3(128, 1, 1)
        # A stream of its own, as engines use, rather than the default one.
        self.stream = ctypes.c_void_p()
        self._check(lib.cudaStreamCreate(ctypes.byref(self.stream)), "cudaStreamCreate")
        # The "sampled token" a decode step leaves in device memory, and the
        # host buffer it is copied to before the step's sync (the
        # .cpu()/.tolist() of a real engine).
        self.device_token = ctypes.c_int32(0)
        self.host_token = ctypes.c_int32(0)

    @staticmethod
    def _check(err, what):
        if err != 0:
            raise RuntimeError(f"{what} failed: cudaError {err}")

    def launch(self, ms):
        """Enqueues a kernel of ms on the engine's stream."""
        self.lib.fakecuda_set_kernel_ns(int(ms * 1e6))
        self._check(
            self.lib.cudaLaunchKernel(None, self.grid, self.block, None, 0, self.stream),
            "cudaLaunchKernel",
        )

    def copy_token(self, value):
        """Device-to-host copy of the sampled token, ordered after the kernels."""
        self.device_token.value = value
        self._check(
            self.lib.cudaMemcpyAsync(
                ctypes.addressof(self.host_token), ctypes.addressof(self.device_token),
                4, 2, self.stream,  # 2 = cudaMemcpyDeviceToHost
            ),
            "cudaMemcpyAsync",
        )

    def sync(self):
        """Blocks until the stream's work is done; returns (start_ns, end_ns)."""
        start = mono()
        self._check(self.lib.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        return start, mono()


class Engine:
    """Runs requests one at a time, in arrival order, on the stand-in GPU."""

    def __init__(self, sock, native_dir):
        import llm_usdt

        self.usdt = llm_usdt
        self.sock = sock
        self.send_lock = threading.Lock()
        self.gpu = Gpu(native_dir)
        self.waiting = []
        self.cond = threading.Condition()
        self.step_id = 0

    def send(self, obj):
        send_msg(self.sock, self.send_lock, obj)

    def receive(self):
        """Reader thread: queues submitted requests; EOF ends the process."""
        for msg in read_msgs(self.sock):
            with self.cond:
                # Under the lock: the worker cannot schedule the request
                # (and fire request_scheduled) before request_queued fired.
                msg["queued_ns"] = mono()
                self.waiting.append(msg)
                msg["depth"] = len(self.waiting)
                self.usdt.request_queued(msg["id"], msg["depth"])
                self.cond.notify()
        # The frontend is gone (exited or killed): so is the work.
        os._exit(0)

    def run(self):
        threading.Thread(target=self.receive, name="engine-rx", daemon=True).start()
        self.send({"ev": "hello", "pid": os.getpid()})
        while True:
            with self.cond:
                while not self.waiting:
                    self.cond.wait()
                req = self.waiting.pop(0)
            try:
                self.serve(req)
            except Exception as e:  # report, keep serving the others
                self.send({"id": req["id"], "ev": "error", "error": f"{type(e).__name__}: {e}"})

    def serve(self, req):
        rid, usdt, gpu = req["id"], self.usdt, self.gpu
        scheduled = mono()
        usdt.request_scheduled(rid, 1)
        n = req["max_tokens"]
        sync_stall = req.get("sync_stall")
        sleep_stall = req.get("sleep_stall")
        truth = {
            "engine": {"pid": os.getpid(), "tid": threading.get_native_id()},
            "queue": {
                "queued_ns": req["queued_ns"],
                "scheduled_ns": scheduled,
                "wait_ns": scheduled - req["queued_ns"],
                "depth": req["depth"],
            },
            "tokens": {"sync_start_ns": [], "sync_end_ns": [], "emit_ns": []},
        }

        usdt.prefill_start(rid, req["prompt_tokens"])
        prefill_start = mono()
        gpu.launch(req["prefill_ms"])
        gpu.sync()
        usdt.prefill_end(rid, req["prompt_tokens"])
        truth["prefill"] = {"start_ns": prefill_start, "end_ns": mono()}

        for i in range(n):
            gpu.launch(req["kernel_ms"])
            stalled = sync_stall is not None and sync_stall["token"] == i
            if stalled:
                gpu.launch(sync_stall["ms"])
            gpu.copy_token(i)
            sync_start, sync_end = gpu.sync()
            if stalled:
                truth["sync_stall"] = dict(sync_stall, sync_start_ns=sync_start, sync_end_ns=sync_end)
            if sleep_stall is not None and sleep_stall["token"] == i:
                start = mono()
                time.sleep(sleep_stall["ms"] / 1000)
                truth["sleep_stall"] = dict(
                    sleep_stall, pid=os.getpid(), tid=threading.get_native_id(),
                    start_ns=start, end_ns=mono(),
                )
            emit = mono()
            usdt.token(rid, i)
            self.step_id += 1
            usdt.batch_step(self.step_id, 1, 1)
            truth["tokens"]["sync_start_ns"].append(sync_start)
            truth["tokens"]["sync_end_ns"].append(sync_end)
            truth["tokens"]["emit_ns"].append(emit)
            self.send({"id": rid, "ev": "token", "index": i})
        self.send({"id": rid, "ev": "done", "truth": truth})


def engine_main(fd, native_dir):
    sock = socket.socket(fileno=fd)
    Engine(sock, native_dir).run()


# ============================================================= frontend


class EngineClient:
    """The frontend's end of the engine socket: submits requests and routes
    the engine's messages to the handler thread of each request."""

    def __init__(self, native_dir):
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--engine-fd", str(child.fileno()),
             "--native-dir", native_dir],
            pass_fds=[child.fileno()],
        )
        child.close()
        self.sock = parent
        self.send_lock = threading.Lock()
        self.routes = {}
        self.routes_lock = threading.Lock()
        self.msgs = read_msgs(parent)
        hello = next(self.msgs, None)
        if hello is None or hello.get("ev") != "hello":
            raise SystemExit("infer_server: the engine process failed to start")
        self.pid = hello["pid"]
        threading.Thread(target=self._dispatch, name="engine-dispatch", daemon=True).start()

    def _dispatch(self):
        for msg in self.msgs:
            with self.routes_lock:
                q = self.routes.get(msg["id"])
            if q is not None:  # None: the client went away, drop the rest
                q.put(msg)
        # The engine died: nothing can be served any more.
        print("infer_server: engine process exited", file=sys.stderr, flush=True)
        os._exit(1)

    def submit(self, job):
        q = queue.Queue()
        with self.routes_lock:
            self.routes[job["id"]] = q
        send_msg(self.sock, self.send_lock, dict(job, op="submit"))
        return q

    def forget(self, rid):
        with self.routes_lock:
            self.routes.pop(rid, None)


class BadRequest(Exception):
    pass


def _cause(body, key, fields, max_tokens):
    """Validates an injected cause: a dict with an in-range "token" and the
    given numeric fields >= 0; None when absent."""
    c = body.get(key)
    if c is None:
        return None
    if not isinstance(c, dict) or not isinstance(c.get("token"), int):
        raise BadRequest(f"{key} needs an integer token")
    if not 0 <= c["token"] < max_tokens:
        raise BadRequest(f"{key}.token must be in 0..max_tokens-1")
    out = {"token": c["token"]}
    for f in fields:
        v = c.get(f)
        if not isinstance(v, (int, float)) or v < 0:
            raise BadRequest(f"{key}.{f} must be a number >= 0")
        out[f] = v
    return out


def parse_job(body):
    """The engine's job for a request body; raises BadRequest."""
    if body.get("stream") is not True:
        raise BadRequest('only "stream": true is served')
    n = body.get("max_tokens", 16)
    if not isinstance(n, int) or n < 1:
        raise BadRequest("max_tokens must be an integer >= 1")
    job = {"max_tokens": n}
    for key, default in (("kernel_ms", 5), ("prefill_ms", 20)):
        v = body.get(key, default)
        if not isinstance(v, (int, float)) or v < 0:
            raise BadRequest(f"{key} must be a number >= 0")
        job[key] = v
    messages = body.get("messages") or []
    words = sum(len(str(m.get("content", "")).split()) for m in messages if isinstance(m, dict))
    job["prompt_tokens"] = max(1, words)
    job["sync_stall"] = _cause(body, "sync_stall", ("ms",), n)
    sleep = _cause(body, "sleep_stall", ("ms",), n)
    if sleep is not None:
        where = body["sleep_stall"].get("where", "engine")
        if where not in ("frontend", "engine"):
            raise BadRequest('sleep_stall.where must be "frontend" or "engine"')
        sleep["where"] = where
    nagle = _cause(body, "nagle", (), n)
    return job, sleep, nagle


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "infer-server/1.0"
    sys_version = ""
    wbufsize = 0  # every wfile.write is one sendall on the socket

    engine = None  # EngineClient, set by main()
    usdt = None  # the llm_usdt module, set by main()

    def setup(self):
        super().setup()
        # As asyncio servers do: every write leaves at once.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format, *args):  # noqa: A002 - keep quiet
        pass

    def _send_json(self, obj, status=200):
        data = json.dumps(obj, separators=(",", ":")).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path.split("?", 1)[0] == "/health":
            self._send_json({"status": "ok"})
        else:
            self._send_json({"error": "not found"}, status=404)

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length > 0 else b""
        if self.path.split("?", 1)[0] != "/v1/chat/completions":
            self._send_json({"error": "not found"}, status=404)
            return
        try:
            body = json.loads(raw) if raw else {}
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            job, sleep, nagle = parse_job(body)
        except (ValueError, BadRequest) as e:
            self._send_json({"error": str(e)}, status=400)
            return
        rid = "chatcmpl-" + uuid.uuid4().hex
        job["id"] = rid
        if sleep is not None and sleep["where"] == "engine":
            job["sleep_stall"] = sleep
            sleep = None
        self.usdt.request_start(rid, job["prompt_tokens"])
        events = self.engine.submit(job)
        try:
            self._stream(rid, job, body.get("model", "test-model"), events, sleep, nagle)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            self.engine.forget(rid)

    # ------------------------------------------------------------ streaming

    def _write_event(self, obj):
        """One SSE event as one chunk in ONE write: size line, data, CRLF."""
        data = b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _write_event_nagle(self, obj, truth):
        """The event as two small writes with TCP_NODELAY cleared: the second
        waits in the send queue until the client ACKs the first. Returns the
        thread that watches the held bytes leave (join it before reading
        truth or closing the socket)."""
        sock = self.connection
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
        truth["write_start_ns"] = obj["x_mono_ns"]
        data = b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
        self.wfile.write(b"%x\r\n" % len(data))
        truth["first_write_end_ns"] = mono()
        self.wfile.write(data + b"\r\n")
        truth["write_end_ns"] = mono()
        truth["unsent_bytes_after_write"] = _unsent(sock)
        watcher = threading.Thread(target=_watch_held_bytes, args=(sock, truth),
                                   name="nagle-watch", daemon=True)
        watcher.start()
        return watcher

    def _stream(self, rid, job, model, events, sleep, nagle):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()  # one write: status line and headers
        created = int(time.time())
        frontend = {"pid": os.getpid(), "tid": threading.get_native_id()}
        watcher = None  # watches the bytes Nagle holds, once they exist
        try:
            sent = 0
            while True:
                msg = events.get()
                if msg["ev"] == "error":
                    self._write_event({"id": rid, "error": msg["error"], "x_mono_ns": mono()})
                    break
                if msg["ev"] == "done":
                    truth = dict(msg["truth"], request_id=rid, frontend=frontend)
                    if sleep is not None:
                        truth["sleep_stall"] = sleep
                    if watcher is not None:
                        watcher.join()
                        truth["nagle"] = nagle
                    self._write_event({
                        "id": rid, "object": "chat.completion.chunk", "created": created,
                        "model": model, "choices": [],
                        "usage": {"prompt_tokens": job["prompt_tokens"], "completion_tokens": sent,
                                  "total_tokens": job["prompt_tokens"] + sent},
                        "x_truth": truth, "x_mono_ns": mono(),
                    })
                    break
                i = msg["index"]
                if sleep is not None and sleep["token"] == i:
                    start = mono()
                    time.sleep(sleep["ms"] / 1000)
                    sleep.update(pid=frontend["pid"], tid=frontend["tid"],
                                 start_ns=start, end_ns=mono())
                word = WORDS[i % len(WORDS)]
                delta = {"content": word if i == 0 else " " + word}
                if i == 0:
                    delta["role"] = "assistant"
                event = {
                    "id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
                    "x_mono_ns": mono(),
                }
                if nagle is not None and nagle["token"] == i:
                    watcher = self._write_event_nagle(event, nagle)
                else:
                    self._write_event(event)
                sent += 1
            self.wfile.write(b"e\r\ndata: [DONE]\n\n\r\n")
            self.wfile.write(b"0\r\n\r\n")
            self.usdt.request_end(rid, sent)
        finally:
            # The watcher uses the socket: it must be done before the
            # connection is closed and its descriptor number reused.
            if watcher is not None:
                watcher.join()


def _watch_held_bytes(sock, truth):
    """Polls the send queue until the bytes Nagle held have left: that
    moment (to within the ~0.3 ms poll period) is the server's own
    measurement of the hold. Only then sets TCP_NODELAY again, since setting
    it pushes held bytes out at once. Events written meanwhile join the
    held bytes, as they would in a server that never set TCP_NODELAY."""
    deadline = mono() + 2_000_000_000  # a peer that stopped ACKing
    while _unsent(sock) > 0 and mono() < deadline:
        time.sleep(0.0002)
    truth["sent_ns"] = mono()
    truth["held_ns"] = truth["sent_ns"] - truth["write_end_ns"]
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    truth["nodelay_restored_ns"] = mono()


def _unsent(sock):
    buf = fcntl.ioctl(sock.fileno(), SIOCOUTQNSD, struct.pack("i", 0))
    return struct.unpack("i", buf)[0]


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    ap.add_argument("--native-dir", default=os.path.join(REPO, "target", "native"),
                    help="where `cargo xtask native` put its libraries")
    ap.add_argument("--engine-fd", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    native_dir = os.path.abspath(args.native_dir)
    for lib in ("libcudart.so.12", "libcuda.so.1", "libllm_usdt.so"):
        if not os.path.exists(os.path.join(native_dir, lib)):
            raise SystemExit(f"infer_server: {native_dir}/{lib} is missing: run `cargo xtask native`")
    # Both processes, the engine through the inherited environment.
    os.environ.setdefault("LLM_USDT_LIB", os.path.join(native_dir, "libllm_usdt.so"))
    if args.engine_fd is not None:
        engine_main(args.engine_fd, native_dir)
        return

    import llm_usdt

    if not llm_usdt.AVAILABLE:
        raise SystemExit(f"infer_server: cannot load {llm_usdt.LIBRARY}")
    # Handler threads wake for every token: a short switch interval keeps one
    # thread holding the GIL from delaying another's write by up to 5 ms.
    sys.setswitchinterval(0.0005)
    Handler.usdt = llm_usdt
    Handler.engine = EngineClient(native_dir)
    srv = Server((args.host, args.port), Handler)
    print(f"READY {srv.server_address[1]}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=srv.shutdown).start())
    try:
        srv.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
        Handler.engine.proc.terminate()
        Handler.engine.proc.wait()


if __name__ == "__main__":
    main()
