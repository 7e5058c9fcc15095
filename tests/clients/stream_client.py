#!/usr/bin/env python3
"""Measuring HTTP/1.1 client for the tokentrace integration tests (stdlib only,
raw sockets: no http libraries, so every byte and every recv is ours).

  python3 tests/clients/stream_client.py --port P --path /v1/chat/completions \
      --requests N --concurrency C [--stream | --no-stream] [--tokens T] \
      [--token-delay-ms D] [--ttft-ms F] [--crash-after K] [--host 127.0.0.1] \
      [--sse-impl starlette|sse-starlette] [--rid-prefix X] [--timeout S] [--tls]

C worker threads, each with ONE keep-alive connection reused for its share of
the N requests (request i goes to worker i % C). Workers connect first and
start together (barrier); with --tls each connects and finishes its TLS
handshake before the barrier. Request target = PATH?rid=<prefix><worker>-<seq>, so
every request has a unique path the agent reports back.

Times are time.monotonic_ns() (CLOCK_MONOTONIC, the clock of the kernel's
bpf_ktime_get_ns): t_send_ns just before sendall() of the request, then the
return of every recv().

What a chunk is (must match the agent):
  * text/event-stream: each event with a data: field, "data: [DONE]" excluded;
    arrival = the recv that brought the event's terminating blank line.
  * chunked, not SSE: each non-empty HTTP chunk; arrival = the recv that
    completed its data.
  * Content-Length body: 1 chunk (0 if the body is empty); arrival = the recv
    that brought the first body byte.
  * body delimited by connection close: each recv is a chunk (best effort).

One JSON line per request on stdout:
  {"path", "status", "response_id", "chunks", "t_send_ns", "chunk_arrival_ns",
   "ttft_ns", "e2e_ns", "aborted", "error",
   # extras:
   "worker", "seq", "body_kind", "content_type", "done_seen",
   "t_first_byte_ns", "server_write_ns", "traceparent", "t_send_unix_ns",
   "client_addr"}
t_send_unix_ns is time.time_ns() (CLOCK_REALTIME) read right before t_send_ns:
the client's own span starts there, as an OTel SDK would stamp it.
--tls: HTTPS. The socket is wrapped with the stdlib ssl module (no
certificate or host name checks: the test servers use a throw-away self-signed
certificate); every time above is then the SSLSocket call's (t_send_ns before
the sendall that encrypts, arrivals at the return of the recv that decrypted).
Extra "client_addr": the connection's local "ip:port" (the peer address the
server-side agent should report; null when not connected).
--traceparent sends "traceparent: 00-<random trace id>-<random span id>-01"
and "tracestate: tokentrace-test=1"; the record's "traceparent" holds it.
Server-side ground truth from the test servers (CLOCK_MONOTONIC ns, null when
absent): server_req_ns = response header X-Req-Mono-Ns (handler start, after
the server's read of the request); server_write_ns[i] = the server's stamp
taken just before writing chunk i ("x_mono_ns" of an SSE event or of a JSON
body, trailing " @<ns>" of a text/plain piece). A reset / EOF / timeout mid-response gives aborted: true;
the client never crashes on it and always exits 0.
"""

import argparse
import json
import re
import secrets
import socket
import sys
import threading
import time

mono = time.monotonic_ns
STAMP_RE = re.compile(rb" @(\d+)\n?$")


class Aborted(Exception):
    pass


def tls_context():
    # imported only for --tls: plaintext runs keep the process free of libssl
    import ssl

    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


class Conn:
    def __init__(self, host, port, timeout, tls_ctx=None):
        self.host, self.port, self.timeout = host, port, timeout
        self.tls_ctx = tls_ctx
        self.sock = None
        self.pending = b""
        self.pending_t = None

    def connect(self):
        self.close()
        s = socket.create_connection((self.host, self.port), timeout=self.timeout)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(self.timeout)
        if self.tls_ctx is not None:
            try:
                s = self.tls_ctx.wrap_socket(s, server_hostname=self.host)
            except OSError:
                s.close()
                raise
        self.sock = s
        self.pending = b""
        self.pending_t = None

    def close(self):
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock = None

    def recv(self):
        """Returns (data, t_ns). b"" means EOF. Raises Aborted on error."""
        if self.pending:
            d, t = self.pending, self.pending_t
            self.pending, self.pending_t = b"", None
            return d, t
        try:
            d = self.sock.recv(262144)
        except socket.timeout:
            raise Aborted("timeout")
        except OSError as e:
            raise Aborted(f"recv: {e.__class__.__name__}: {e}")
        return d, mono()


class ChunkedDecoder:
    """Incremental Transfer-Encoding: chunked decoder."""

    def __init__(self, on_data, on_chunk):
        self.on_data, self.on_chunk = on_data, on_chunk
        self.state = "size"
        self.buf = b""
        self.remaining = 0
        self.size = 0

    def feed(self, data, t):
        """Returns leftover bytes once the terminating chunk and trailers are
        consumed, else None."""
        self.buf += data
        while True:
            if self.state == "size":
                i = self.buf.find(b"\r\n")
                if i < 0:
                    return None
                line = self.buf[:i]
                self.buf = self.buf[i + 2 :]
                try:
                    self.size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise Aborted(f"bad chunk size line {line[:40]!r}")
                if self.size == 0:
                    self.state = "trailer"
                else:
                    self.state, self.remaining = "data", self.size
            elif self.state == "data":
                if not self.buf:
                    return None
                take = self.buf[: self.remaining]
                self.buf = self.buf[len(take) :]
                self.remaining -= len(take)
                self.on_data(take, t)
                if self.remaining == 0:
                    self.on_chunk(t)
                    self.state = "crlf"
            elif self.state == "crlf":
                if len(self.buf) < 2:
                    return None
                self.buf = self.buf[2:]
                self.state = "size"
            elif self.state == "trailer":
                i = self.buf.find(b"\r\n")
                if i < 0:
                    return None
                line = self.buf[:i]
                self.buf = self.buf[i + 2 :]
                if line == b"":
                    self.state = "done"
                    rest, self.buf = self.buf, b""
                    return rest
            else:
                return self.buf


class SseParser:
    """Incremental text/event-stream parser (\\n, \\r\\n and \\r line ends)."""

    def __init__(self, on_event):
        self.on_event = on_event
        self.buf = b""
        self.data = []
        self.has_data = False

    def feed(self, data, t):
        self.buf += data
        while True:
            n_i = self.buf.find(b"\n")
            r_i = self.buf.find(b"\r")
            if n_i < 0 and r_i < 0:
                return
            if r_i >= 0 and (n_i < 0 or r_i < n_i):
                if r_i + 1 == len(self.buf):
                    return  # lone CR at the end: wait, an LF may follow
                m = r_i
                end = r_i + 2 if self.buf[r_i + 1 : r_i + 2] == b"\n" else r_i + 1
            else:
                m, end = n_i, n_i + 1
            line = self.buf[:m]
            self.buf = self.buf[end:]
            if line == b"":
                if self.has_data:
                    self.on_event(b"\n".join(self.data), t)
                self.data, self.has_data = [], False
            elif line.startswith(b":"):
                continue
            else:
                field, _, value = line.partition(b":")
                if value.startswith(b" "):
                    value = value[1:]
                if field == b"data":
                    self.data.append(value)
                    self.has_data = True


def build_request(method, target, host, port, body, traceparent=None):
    head = [
        f"{method} {target} HTTP/1.1",
        f"Host: {host}:{port}",
        "User-Agent: tokentrace-stream-client/1",
        "Accept: text/event-stream, application/json, */*",
    ]
    if traceparent is not None:
        head.append(f"traceparent: {traceparent}")
        head.append("tracestate: tokentrace-test=1")
    if body is not None:
        head.append("Content-Type: application/json")
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + (body or b"")


def do_request(conn, method, target, body, traceparent=None):
    rec = {
        "path": target,
        "traceparent": traceparent,
        "t_send_unix_ns": None,
        "status": None,
        "response_id": None,
        "chunks": 0,
        "t_send_ns": None,
        "chunk_arrival_ns": [],
        "ttft_ns": None,
        "e2e_ns": None,
        "aborted": False,
        "error": None,
        "body_kind": None,
        "content_type": None,
        "done_seen": False,
        "t_first_byte_ns": None,
        "server_write_ns": [],
        "server_req_ns": None,
        "client_addr": None,
    }
    keep_alive = True
    try:
        if conn.sock is None:
            try:
                conn.connect()
            except OSError as e:
                raise Aborted(f"connect: {e.__class__.__name__}: {e}")
        try:
            ip, port = conn.sock.getsockname()[:2]
            rec["client_addr"] = f"{ip}:{port}"
        except OSError:
            pass
        req = build_request(method, target, conn.host, conn.port, body, traceparent)
        rec["t_send_unix_ns"] = time.time_ns()
        rec["t_send_ns"] = mono()
        try:
            conn.sock.sendall(req)
        except OSError as e:
            raise Aborted(f"send: {e.__class__.__name__}: {e}")

        # ---- status line + headers
        buf = b""
        t = None
        while True:
            data, t = conn.recv()
            if not data:
                raise Aborted("eof before response headers" if not buf else "eof in headers")
            if rec["t_first_byte_ns"] is None:
                rec["t_first_byte_ns"] = t
            buf += data
            i = buf.find(b"\r\n\r\n")
            if i >= 0:
                break
        head, rest = buf[:i], buf[i + 4 :]
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
            raise Aborted(f"bad status line {lines[0][:60]!r}")
        status = int(parts[1])
        rec["status"] = status
        headers = {}
        for ln in lines[1:]:
            k, _, v = ln.partition(b":")
            headers[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
        try:
            rec["server_req_ns"] = int(headers["x-req-mono-ns"])
        except (KeyError, ValueError):
            pass
        ctype = headers.get("content-type", "")
        rec["content_type"] = ctype or None
        is_sse = ctype.split(";")[0].strip().lower() == "text/event-stream"
        te = headers.get("transfer-encoding", "").lower()
        conn_hdr = headers.get("connection", "").lower()
        if "close" in conn_hdr or parts[0] == b"HTTP/1.0":
            keep_alive = False

        # ---- body
        state = {"first_json": None, "t_end": t}

        def note_json(payload):
            if rec["response_id"] is not None or state["first_json"] is not None:
                return None
            try:
                obj = json.loads(payload)
            except ValueError:
                state["first_json"] = False
                return None
            state["first_json"] = True
            if isinstance(obj, dict) and isinstance(obj.get("id"), str):
                rec["response_id"] = obj["id"]
            return obj

        def on_sse_event(payload, t_ev):
            if payload.strip() == b"[DONE]":
                rec["done_seen"] = True
                return
            rec["chunks"] += 1
            rec["chunk_arrival_ns"].append(t_ev)
            srv = None
            try:
                obj = json.loads(payload)
                if rec["response_id"] is None and state["first_json"] is None:
                    state["first_json"] = True
                    if isinstance(obj.get("id"), str):
                        rec["response_id"] = obj["id"]
                srv = obj.get("x_mono_ns") if isinstance(obj, dict) else None
            except ValueError:
                if state["first_json"] is None:
                    state["first_json"] = False
            rec["server_write_ns"].append(srv)

        sse = SseParser(on_sse_event) if is_sse else None
        body_bytes = bytearray()
        cur_chunk = bytearray()

        def on_data(d, t_d):
            if sse is not None:
                sse.feed(d, t_d)
                return
            if len(body_bytes) < 1 << 20:
                body_bytes.extend(d)
            if len(cur_chunk) < 1 << 16:
                cur_chunk.extend(d)

        def on_chunk(t_c):
            if sse is None:
                rec["chunks"] += 1
                rec["chunk_arrival_ns"].append(t_c)
                m = STAMP_RE.search(bytes(cur_chunk))
                rec["server_write_ns"].append(int(m.group(1)) if m else None)
                cur_chunk.clear()

        no_body = method == "HEAD" or status in (204, 304) or 100 <= status < 200
        if no_body:
            rec["body_kind"] = "empty"
            conn.pending, conn.pending_t = rest, t
        elif "chunked" in te:
            rec["body_kind"] = "sse" if is_sse else "chunked"
            dec = ChunkedDecoder(on_data, on_chunk)
            data, t_d = rest, t
            while True:
                left = dec.feed(data, t_d) if data else None
                if left is not None:
                    state["t_end"] = t_d
                    conn.pending, conn.pending_t = left, t_d
                    break
                data, t_d = conn.recv()
                if not data:
                    raise Aborted("eof mid-body (chunked)")
        elif "content-length" in headers:
            length = int(headers["content-length"])
            rec["body_kind"] = "sse" if is_sse else ("fixed" if length > 0 else "empty")
            got = 0
            data, t_d = rest, t
            first = True
            while got < length:
                if data:
                    take = data[: length - got]
                    if first and not is_sse:
                        rec["chunks"] = 1
                        rec["chunk_arrival_ns"].append(t_d)
                        first = False
                    on_data(take, t_d)
                    got += len(take)
                    if got >= length:
                        state["t_end"] = t_d
                        conn.pending, conn.pending_t = data[len(take) :], t_d
                        break
                data, t_d = conn.recv()
                if not data:
                    raise Aborted("eof mid-body (content-length)")
            if length == 0:
                conn.pending, conn.pending_t = rest, t
        else:
            rec["body_kind"] = "sse" if is_sse else "until_close"
            keep_alive = False
            data, t_d = rest, t
            while True:
                if data:
                    if sse is None:
                        rec["chunks"] += 1
                        rec["chunk_arrival_ns"].append(t_d)
                    on_data(data, t_d)
                    state["t_end"] = t_d
                data, t_d = conn.recv()
                if not data:
                    break
        if sse is None and body_bytes:
            obj = note_json(bytes(body_bytes))
            if rec["body_kind"] == "fixed":
                srv = obj.get("x_mono_ns") if isinstance(obj, dict) else None
                rec["server_write_ns"] = [srv if isinstance(srv, int) else None]
        rec["e2e_ns"] = state["t_end"] - rec["t_send_ns"]
    except Aborted as e:
        rec["aborted"] = True
        rec["error"] = str(e)
        if rec["t_send_ns"] is not None:
            rec["e2e_ns"] = mono() - rec["t_send_ns"]
        keep_alive = False
    except Exception as e:  # never crash the worker
        rec["aborted"] = True
        rec["error"] = f"client error: {e.__class__.__name__}: {e}"
        if rec["t_send_ns"] is not None:
            rec["e2e_ns"] = mono() - rec["t_send_ns"]
        keep_alive = False
    if rec["chunk_arrival_ns"] and rec["t_send_ns"] is not None:
        rec["ttft_ns"] = rec["chunk_arrival_ns"][0] - rec["t_send_ns"]
    if not keep_alive:
        conn.close()
    return rec


def main():
    ap = argparse.ArgumentParser(description="measuring streaming HTTP/1.1 client")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--path", default="/v1/chat/completions")
    ap.add_argument("--method", default=None, help="default POST (GET for /health)")
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--stream", dest="stream", action="store_true", default=True)
    ap.add_argument("--no-stream", dest="stream", action="store_false")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--token-delay-ms", type=float, default=None)
    ap.add_argument("--ttft-ms", type=float, default=None)
    ap.add_argument("--crash-after", type=int, default=None)
    ap.add_argument("--sse-impl", default=None, help="starlette | sse-starlette (fastapi_app.py)")
    ap.add_argument("--model", default="test-model")
    ap.add_argument("--rid-prefix", default="", help="prefix of the rid query value")
    ap.add_argument("--timeout", type=float, default=30.0, help="per-recv timeout, seconds")
    ap.add_argument("--traceparent", action="store_true",
                    help="send a fresh sampled W3C traceparent (and a tracestate) with every request")
    ap.add_argument("--tls", action="store_true",
                    help="HTTPS (stdlib ssl, certificate and host name not checked)")
    args = ap.parse_args()
    # Arrival stamps are taken after recv() returns, which needs the GIL:
    # a short switch interval keeps one worker's parsing from delaying
    # another worker's stamp by up to the default 5 ms.
    sys.setswitchinterval(0.0002)

    method = args.method or ("GET" if args.path.startswith("/health") else "POST")
    body_obj = {
        "model": args.model,
        "messages": [{"role": "user", "content": "Say something, one token at a time."}],
        "stream": args.stream,
        "max_tokens": args.tokens,
    }
    if args.token_delay_ms is not None:
        body_obj["token_delay_ms"] = args.token_delay_ms
    if args.ttft_ms is not None:
        body_obj["ttft_ms"] = args.ttft_ms
    if args.crash_after is not None:
        body_obj["crash_after"] = args.crash_after
    if args.sse_impl is not None:
        body_obj["sse_impl"] = args.sse_impl
    body = json.dumps(body_obj).encode() if method in ("POST", "PUT") else None

    conc = max(1, min(args.concurrency, max(1, args.requests)))
    shares = [0] * conc
    for i in range(args.requests):
        shares[i % conc] += 1
    out_lock = threading.Lock()
    barrier = threading.Barrier(conc)
    sep = "&" if "?" in args.path else "?"
    tls_ctx = tls_context() if args.tls else None

    def worker(w):
        conn = Conn(args.host, args.port, args.timeout, tls_ctx)
        try:
            conn.connect()
        except OSError:
            conn.close()  # do_request reports the connect error per request
        try:
            barrier.wait(timeout=60)
        except threading.BrokenBarrierError:
            pass
        for seq in range(shares[w]):
            target = f"{args.path}{sep}rid={args.rid_prefix}{w}-{seq}"
            traceparent = None
            if args.traceparent:
                traceparent = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
            rec = do_request(conn, method, target, body, traceparent)
            rec["worker"], rec["seq"] = w, seq
            line = json.dumps(rec)
            with out_lock:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
        conn.close()

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(conc)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
