#!/usr/bin/env python3
"""Standard-library-only OpenAI-style streaming server (http.server).

Run:  python3 tests/servers/stdlib_sse.py --port P [--host 127.0.0.1]
                                          [--realistic] [--nagle]
                                          [--iovecs N [--writev] [--shared-buffer]]
                                          [--ssl-certfile C --ssl-keyfile K
                                           [--late-tls]]
      (--port 0 picks a free port). Prints ``READY <port>`` on stdout,
      flushed, once listening. Writes nothing to disk.

HTTP/1.1 with keep-alive (ThreadingHTTPServer, one thread per connection).
Streaming responses use chunked transfer encoding written by hand: for every
chunk the size line, the data and the trailing CRLF go out as THREE separate
unbuffered socket writes (``wbufsize = 0``), the way some real servers
behave. Headers go out in one write.

Endpoints (same as tests/servers/fastapi_app.py):
  POST /v1/chat/completions  body {"model","messages","stream","max_tokens",
                             "token_delay_ms" (20), "ttft_ms" (50),
                             "crash_after" (optional),
                             "stall_at", "stall_ms" (optional: the gap
                             before chunk stall_at is stall_ms instead)}
       stream=true:  N chat.completion.chunk events + 1 usage event
                     (choices: []) + data: [DONE]   -> N+1 chunks
       stream=false: one chat.completion JSON with Content-Length
  POST /v1/stream-text       chunked text/plain, N pieces
  GET  /health

Server-side ground truth, all CLOCK_MONOTONIC ns (time.monotonic_ns(), the
clock of bpf_ktime_get_ns):
  * response header X-Req-Mono-Ns: taken when do_GET/do_POST starts, i.e.
    after the read that brought the request headers returned;
  * "x_mono_ns" in every SSE data event and in the non-streaming JSON body,
    " @<ns>" at the end of every text piece: taken just before the first
    write of that chunk.

--realistic: demo pacing for `cargo xtask demo`: prefill 120-250 ms, inter-
token latency 15-45 ms with jitter (occasional longer stall), model name
"demo-llama-3-8b", realistic token text, max_tokens defaults to 64. Explicit
"ttft_ms"/"token_delay_ms" in a request body still win.

--iovecs N (plaintext only): each chunk (size line, data, CRLF) goes out
as ONE sendmsg() of N iovecs instead (the size line, the data cut into
N - 2 pieces, the CRLF; a piece may be empty), the way writev-based servers
(node, asyncio's writelines) frame theirs, with more pieces than they do.
--writev: the same iovecs in one writev() instead (node's, hyper's and
nginx's call), whose iovec array the socket hooks read from the kernel's
copy rather than from the process.
--shared-buffer: with --iovecs N (at least 4), node's layout of a chunk's
iovecs: the size digits and the data side by side in one buffer, and one
static CRLF buffer sent twice, in the order digits, CRLF, the data in N - 3
pieces, CRLF. The probes read such neighbours and repeats once (a record's
gathered payload).

TCP_NODELAY is set on accepted sockets (as asyncio servers do) unless
--nagle is given; with Nagle on, the 3-write framing can be held back.

TLS (stdlib ssl, blocking sockets: OpenSSL does the socket I/O itself, inside
SSL_read/SSL_write, on the handler's thread):
  --ssl-certfile C --ssl-keyfile K: serve HTTPS on --port. The handshake is
      done by the connection's handler thread.
  ... --late-tls: serve plain HTTP on --port with the ssl module NOT imported
      (libssl is not mapped; http.server would import it through http.client,
      so it is blocked until needed). ``GET /enable-tls`` then imports ssl,
      starts an HTTPS server (same endpoints) on a free port of the same host
      and answers {"tls_port": N} (the same port on later calls). For tests of
      a process that loads OpenSSL after the agent started.

--fork-on-sigusr1: listen, but serve nothing until SIGUSR1; then fork a
    child that serves on the inherited socket (the parent only waits, and
    the child dies with it: PR_SET_DEATHSIG). For tests of a child forked by
    a traced server after the agent started (its uprobes are not inherited).
"""

import sys

# --late-tls: http.server -> http.client imports ssl at module load, which maps
# libssl. Make `import ssl` fail until GET /enable-tls lifts the block.
LATE_TLS = "--late-tls" in sys.argv[1:]
if LATE_TLS:
    sys.modules["ssl"] = None

import argparse
import json
import os
import random
import signal
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TEST_WORDS = (
    "The quick brown fox jumps over the lazy dog while the model streams "
    "tokens one by one to a patient client that measures every gap ."
).split()

DEMO_TEXT = (
    "Time to first token is the delay between the moment a request reaches the "
    "server and the moment the first generated token leaves it. It is dominated "
    "by queueing and by the prefill pass over the prompt, which grows with prompt "
    "length and with how many other requests share the batch. After the first "
    "token, the decode loop emits one token per step, so the inter-token latency "
    "reflects batch size, memory bandwidth and any stall on the host: a garbage "
    "collection pause, a blocked event loop, a full socket buffer, or a slow "
    "client reading the stream. Measuring both per request, from the kernel, "
    "shows which of these made a given response feel slow."
)


def _split_tokens(text):
    out = []
    for i, w in enumerate(text.split(" ")):
        # split long words into two sub-word pieces, like a BPE tokenizer would
        piece = w if i == 0 else " " + w
        if len(w) > 7:
            cut = len(piece) // 2 + 1
            out.extend([piece[:cut], piece[cut:]])
        else:
            out.append(piece)
    return out


DEMO_TOKENS = _split_tokens(DEMO_TEXT)

CONFIG = {"realistic": False, "nodelay": True, "certfile": None, "keyfile": None, "host": None, "iovecs": 0, "writev": False, "shared_buffer": False}

# --shared-buffer: the one CRLF every chunk sends twice (node's crlf_buf).
CRLF = memoryview(b"\r\n")


def node_iovecs(data, iovecs):
    """A chunk's iovecs laid out as node's writev has them: the size digits
    and the data side by side in one buffer, the static CRLF twice."""
    digits = b"%x" % len(data)
    buf = memoryview(digits + data)
    body = buf[len(digits):]
    cuts = [len(data) * k // (iovecs - 3) for k in range(iovecs - 2)]
    pieces = [body[a:b] for a, b in zip(cuts, cuts[1:])]
    return [buf[: len(digits)], CRLF, *pieces, CRLF]
TLS_STATE = {"lock": threading.Lock(), "port": None}


def _new_id():
    return "chatcmpl-" + uuid.uuid4().hex


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "stdlib-sse/1.0"
    sys_version = ""
    wbufsize = 0  # every wfile.write is one sendall on the socket

    def setup(self):
        super().setup()
        if CONFIG["nodelay"]:
            try:
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        if hasattr(self.connection, "do_handshake"):
            # TLS: accepted without handshake (see TlsServer), done here, off
            # the accepting thread
            self.connection.do_handshake()

    def log_message(self, format, *args):  # noqa: A002 - keep quiet
        pass

    # ----------------------------------------------------------------- helpers
    def _read_body(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length > 0 else b""
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError:
            return {}

    def _params(self, body):
        realistic = CONFIG["realistic"]
        n = int(body.get("max_tokens") or (64 if realistic else 16))
        crash = body.get("crash_after")
        crash = int(crash) if crash is not None else None
        if "ttft_ms" in body:
            ttft = float(body["ttft_ms"]) / 1000.0
        elif realistic:
            ttft = random.uniform(0.120, 0.250)
        else:
            ttft = 0.050
        if "token_delay_ms" in body:
            fixed = float(body["token_delay_ms"]) / 1000.0

            def delay(_i):
                return fixed

        elif realistic:
            base = random.uniform(0.018, 0.032)

            def delay(_i):
                if random.random() < 0.03:  # an occasional slower step
                    return random.uniform(0.038, 0.045)
                return min(0.045, max(0.015, random.gauss(base, 0.006)))

        else:

            def delay(_i):
                return 0.020

        if "stall_ms" in body:
            stall_at, stall = int(body.get("stall_at", 1)), float(body["stall_ms"]) / 1000.0
            steady = delay

            def delay(i):
                # delay(i) is the sleep before chunk i
                return stall if i == stall_at else steady(i)

        return n, ttft, delay, crash

    def _token(self, i):
        if CONFIG["realistic"]:
            return DEMO_TOKENS[i % len(DEMO_TOKENS)]
        w = TEST_WORDS[i % len(TEST_WORDS)]
        return w if i == 0 else " " + w

    def _model(self, body):
        if CONFIG["realistic"]:
            return "demo-llama-3-8b"
        return body.get("model", "test-model")

    def _start_chunked(self, content_type):
        self.send_response(200)
        self.send_header("X-Req-Mono-Ns", str(self.t_req))
        self.send_header("Content-Type", content_type)
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()  # one write: status line + headers

    def _write_chunk(self, data):
        iovecs = CONFIG["iovecs"]
        if iovecs:
            # one sendmsg (or writev): size line, the data in iovecs - 2
            # pieces, CRLF
            if CONFIG["shared_buffer"]:
                self._send_all(node_iovecs(data, iovecs))
                return
            cuts = [len(data) * k // (iovecs - 2) for k in range(iovecs - 1)]
            pieces = [data[a:b] for a, b in zip(cuts, cuts[1:])]
            self._send_all([b"%x\r\n" % len(data), *pieces, b"\r\n"])
            return
        # three separate unbuffered writes: size line, data, trailing CRLF
        self.wfile.write(b"%x\r\n" % len(data))
        self.wfile.write(data)
        self.wfile.write(b"\r\n")

    def _send_all(self, buffers):
        """sendmsg() (writev() with --writev) until every byte of `buffers`
        is gone."""
        views = [memoryview(b) for b in buffers]
        while views:
            if CONFIG["writev"]:
                sent = os.writev(self.connection.fileno(), views)
            else:
                sent = self.connection.sendmsg(views)
            while views and sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            if views and sent:
                views[0] = views[0][sent:]

    def _end_chunked(self):
        self.wfile.write(b"0\r\n\r\n")

    def _crash(self):
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def _send_json(self, obj, status=200, stamp=False):
        if stamp:
            obj["x_req_mono_ns"] = self.t_req
            obj["x_mono_ns"] = time.monotonic_ns()
        data = json.dumps(obj, separators=(",", ":")).encode()
        self.send_response(status)
        self.send_header("X-Req-Mono-Ns", str(self.t_req))
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    # ---------------------------------------------------------------- handlers
    def do_GET(self):
        self.t_req = time.monotonic_ns()
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self._send_json({"status": "ok"})
        elif path == "/enable-tls" and LATE_TLS:
            self._send_json({"tls_port": enable_tls()})
        else:
            self._send_json({"error": "not found"}, status=404)

    def do_POST(self):
        self.t_req = time.monotonic_ns()
        path = self.path.split("?", 1)[0]
        body = self._read_body()
        try:
            if path in ("/v1/chat/completions", "/v1/completions"):
                if body.get("stream"):
                    self._chat_stream(body)
                else:
                    self._chat_json(body)
            elif path == "/v1/stream-text":
                self._stream_text(body)
            else:
                self._send_json({"error": "not found"}, status=404)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _chat_stream(self, body):
        n, ttft, delay, crash = self._params(body)
        rid = _new_id()
        model = self._model(body)
        created = int(time.time())
        self._start_chunked("text/event-stream")
        time.sleep(ttft)
        for i in range(n):
            if i > 0:
                time.sleep(delay(i))
            if crash is not None and i >= crash:
                self._crash()
            d = {"content": self._token(i)}
            if i == 0:
                d["role"] = "assistant"
            ev = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": d, "finish_reason": None}],
            }
            ev["x_req_mono_ns"] = self.t_req
            ev["x_mono_ns"] = time.monotonic_ns()
            self._write_chunk(b"data: " + json.dumps(ev, separators=(",", ":")).encode() + b"\n\n")
        time.sleep(delay(n))
        if crash is not None and n >= crash:
            self._crash()
        usage = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [],
            "usage": {"prompt_tokens": 12, "completion_tokens": n, "total_tokens": 12 + n},
        }
        usage["x_req_mono_ns"] = self.t_req
        usage["x_mono_ns"] = time.monotonic_ns()
        self._write_chunk(b"data: " + json.dumps(usage, separators=(",", ":")).encode() + b"\n\n")
        self._write_chunk(b"data: [DONE]\n\n")
        self._end_chunked()

    def _chat_json(self, body):
        n, ttft, _delay, _crash = self._params(body)
        time.sleep(ttft)
        text = "".join(self._token(i) for i in range(n))
        self._send_json(
            {
                "id": _new_id(),
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self._model(body),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "length",
                    }
                ],
                "usage": {"prompt_tokens": 12, "completion_tokens": n, "total_tokens": 12 + n},
            },
            stamp=True,
        )

    def _stream_text(self, body):
        n, ttft, delay, _crash = self._params(body)
        self._start_chunked("text/plain; charset=utf-8")
        time.sleep(ttft)
        for i in range(n):
            if i > 0:
                time.sleep(delay(i))
            self._write_chunk(f"piece-{i}{self._token(i)} @{time.monotonic_ns()}\n".encode())
        self._end_chunked()


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


class TlsServer(Server):
    """Server whose accepted sockets are TLS; the handshake is left to the
    handler thread (Handler.setup)."""

    ssl_context = None

    def get_request(self):
        sock, addr = self.socket.accept()
        return (
            self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False),
            addr,
        )


def tls_server(address):
    if LATE_TLS:
        sys.modules.pop("ssl", None)  # lift the block set at the top
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(CONFIG["certfile"], CONFIG["keyfile"])
    srv = TlsServer(address, Handler)
    srv.ssl_context = ctx
    return srv


def enable_tls():
    """--late-tls: imports ssl, starts the HTTPS server once; returns its port."""
    with TLS_STATE["lock"]:
        if TLS_STATE["port"] is None:
            srv = tls_server((CONFIG["host"], 0))
            threading.Thread(
                target=srv.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True
            ).start()
            TLS_STATE["port"] = srv.server_address[1]
        return TLS_STATE["port"]


def wait_and_fork():
    """Returns in a child forked on SIGUSR1; the parent never returns."""
    import ctypes

    got = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: got.set())
    while not got.wait(0.2):
        pass
    child = os.fork()
    if child == 0:
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        print(f"FORKED {os.getpid()}", flush=True)
        return
    while True:
        time.sleep(3600)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    ap.add_argument("--realistic", action="store_true", help="demo pacing and text")
    ap.add_argument("--nagle", action="store_true", help="do not set TCP_NODELAY")
    ap.add_argument("--ssl-certfile", default=None, help="PEM certificate: serve HTTPS")
    ap.add_argument("--ssl-keyfile", default=None, help="PEM key: serve HTTPS")
    ap.add_argument(
        "--late-tls",
        action="store_true",
        help="plain HTTP on --port, ssl not imported until GET /enable-tls starts HTTPS on another port",
    )
    ap.add_argument(
        "--fork-on-sigusr1",
        action="store_true",
        help="serve only from a child forked on SIGUSR1",
    )
    ap.add_argument(
        "--iovecs",
        type=int,
        default=0,
        help="each chunk as one sendmsg() of this many iovecs (at least 3; plaintext)",
    )
    ap.add_argument(
        "--writev",
        action="store_true",
        help="with --iovecs: one writev() per chunk instead of sendmsg()",
    )
    ap.add_argument(
        "--shared-buffer",
        action="store_true",
        help="with --iovecs: node's iovecs (digits and data in one buffer, one static CRLF twice)",
    )
    args = ap.parse_args()
    if args.writev and not args.iovecs:
        ap.error("--writev needs --iovecs")
    if args.shared_buffer and args.iovecs < 4:
        ap.error("--shared-buffer needs --iovecs 4 or more")
    if args.iovecs and (args.iovecs < 3 or args.ssl_certfile is not None):
        ap.error("--iovecs needs at least 3 and plaintext")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        ap.error("--ssl-keyfile and --ssl-certfile go together")
    if args.late_tls and args.ssl_certfile is None:
        ap.error("--late-tls needs --ssl-certfile and --ssl-keyfile")
    CONFIG["realistic"] = args.realistic
    CONFIG["nodelay"] = not args.nagle
    CONFIG["iovecs"] = args.iovecs
    CONFIG["writev"] = args.writev
    CONFIG["shared_buffer"] = args.shared_buffer
    CONFIG["certfile"], CONFIG["keyfile"] = args.ssl_certfile, args.ssl_keyfile
    CONFIG["host"] = args.host
    if args.ssl_certfile is not None and not args.late_tls:
        srv = tls_server((args.host, args.port))
    else:
        srv = Server((args.host, args.port), Handler)
    print(f"READY {srv.server_address[1]}", flush=True)
    if args.fork_on_sigusr1:
        wait_and_fork()
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=srv.shutdown).start())
    try:
        srv.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()


if __name__ == "__main__":
    main()
