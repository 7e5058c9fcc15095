#!/usr/bin/env python3
"""Load generator for `cargo xtask bench`: an SSE server that writes events
as fast as it can (one send() per event, chunked framing in the same write)
and a client that reads them as fast as it can.

  python3 tests/bench/sse_flood.py server --port P
      prints READY <port>; GET /v1/chat/completions?events=N streams N
      OpenAI-style chunk events then data: [DONE]; keep-alive.
  python3 tests/bench/sse_flood.py client --port P --seconds S [--connections C] [--events N]
      prints one JSON line {"events", "seconds", "events_per_s", "requests"}.
  TLS: server --tls --certfile C --keyfile K, client --tls: the same over
      HTTPS (stdlib ssl, blocking sockets): the server makes one SSL_write_ex
      per event (its write() nested in it), the client one SSL_read_ex per
      event (one TLS record each). The client checks no certificate.
  python3 tests/bench/sse_flood.py ssl-loop --certfile C --keyfile K --seconds S
      OpenSSL calls alone, no sockets: a server and a client SSLObject on
      memory BIOs in one thread; each iteration is one SSL_write_ex of an
      event and one SSL_read_ex of it. Prints READY <pid>, waits for a line
      on stdin (time to attach a tracer), runs S seconds, prints one JSON line
      {"iterations", "seconds", "ssl_calls", "ssl_calls_per_s"}.
  python3 tests/bench/sse_flood.py write-loop --seconds S
      Small socket writes alone: one thread send()s 16 bytes at a time on a
      loopback TCP connection whose other end a second thread drains.
      Prints READY <pid>, waits for a line on stdin, runs S seconds, prints
      one JSON line {"writes", "seconds", "writes_per_s"}.
  python3 tests/bench/sse_flood.py send-recv-loop --seconds S
      Socket calls alone, one thread: each iteration send()s 16 bytes on a
      loopback TCP connection and recv()s them at the other end (queued by
      the time send() returns): no wake-ups, no lock hand-offs, so the
      iteration's time is the two calls' CPU time (write-loop's two threads
      also measure how their GIL hand-offs react to any added latency).
      Prints READY <pid>, waits for a line on stdin, runs S seconds, prints
      one JSON line {"iterations", "seconds", "iterations_per_s"}.
  python3 tests/bench/sse_flood.py pingpong --seconds S
      Context switches alone: two threads pass one byte back and forth over
      two pipes (each hand-over blocks one thread and wakes the other).
      Prints READY <pid>, waits for a line on stdin, runs S seconds, prints
      one JSON line {"round_trips", "seconds", "round_trips_per_s"}.
  python3 tests/bench/sse_flood.py syscall-loop --seconds S
      Syscalls that move no bytes alone: one thread calls getppid() (a
      syscall every time; glibc caches nothing). Prints READY <pid>, waits
      for a line on stdin, runs S seconds, prints one JSON line
      {"syscalls", "seconds", "syscalls_per_s"}.
  python3 tests/bench/sse_flood.py connect-loop --seconds S
      Connections alone: one thread connects to a loopback listener, accepts
      and closes both ends (the server first), per iteration: every TCP
      state change and socket free of a connection. Prints READY <pid>, waits
      for a line on stdin, runs S seconds, prints one JSON line
      {"connections", "seconds", "connections_per_s"}.
Stdlib only; loopback only; bounded by --seconds.
"""

import argparse
import json
import os
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
        if hasattr(conn, "do_handshake"):
            conn.do_handshake()  # TLS: off the accepting thread
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


def server_context(certfile, keyfile):
    import ssl  # only in TLS modes: plaintext runs keep libssl unmapped

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certfile, keyfile)
    return ctx


def client_context():
    import ssl

    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def server(args):
    ctx = server_context(args.certfile, args.keyfile) if args.tls else None
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", args.port))
    srv.listen(64)
    print("READY %d" % srv.getsockname()[1], flush=True)
    while True:
        conn, _ = srv.accept()
        if ctx is not None:
            conn = ctx.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        threading.Thread(target=serve_conn, args=(conn,), daemon=True).start()


def client_worker(args, deadline, totals, lock):
    sock = socket.create_connection(("127.0.0.1", args.port))
    if args.tls:
        sock = client_context().wrap_socket(sock, server_hostname="localhost")
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


def timed(seconds, batch, per_batch):
    """Runs batch() (per_batch operations) until `seconds` have passed; the
    deadline is checked between batches, so the loop inside stays the work
    measured. Returns (operations, elapsed seconds)."""
    count = 0
    start = time.monotonic()
    deadline = start + seconds
    while True:
        batch()
        count += per_batch
        if time.monotonic() >= deadline:
            break
    return count, time.monotonic() - start


def ssl_loop(args):
    import ssl

    srv_in, srv_out, cli_in, cli_out = (ssl.MemoryBIO() for _ in range(4))
    srv = server_context(args.certfile, args.keyfile).wrap_bio(srv_in, srv_out, server_side=True)
    cli = client_context().wrap_bio(cli_in, cli_out, server_hostname="localhost")

    def pump():
        moved = False
        for src, dst in ((cli_out, srv_in), (srv_out, cli_in)):
            data = src.read()
            if data:
                dst.write(data)
                moved = True
        return moved

    done = {"cli": False, "srv": False}
    for _ in range(100):
        for name, obj in (("cli", cli), ("srv", srv)):
            if not done[name]:
                try:
                    obj.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        if not pump() and all(done.values()):
            break
    if not all(done.values()):
        raise SystemExit("ssl-loop: handshake did not complete")
    # session tickets (TLS 1.3) reach the client before the first event
    try:
        cli.read(65536)
    except ssl.SSLWantReadError:
        pass
    print("READY %d" % os.getpid(), flush=True)
    sys.stdin.readline()
    def batch():
        for _ in range(200):
            srv.write(EVENT)
            cli_in.write(srv_out.read())
            cli.read(65536)

    iterations, elapsed = timed(args.seconds, batch, 200)
    print(json.dumps({
        "iterations": iterations,
        "seconds": elapsed,
        "ssl_calls": 2 * iterations,
        "ssl_calls_per_s": 2 * iterations / elapsed,
    }), flush=True)


def gated(seconds, batch, per_batch, unit):
    """The untraced loops' run: prints READY <pid>, waits for a line on
    stdin (time to attach a tracer), runs batch() for `seconds` (timed()) and
    prints one JSON line {unit, "seconds", unit + "_per_s"}."""
    print("READY %d" % os.getpid(), flush=True)
    sys.stdin.readline()
    count, elapsed = timed(seconds, batch, per_batch)
    print(json.dumps({unit: count, "seconds": elapsed, unit + "_per_s": count / elapsed}), flush=True)


def loopback_pair():
    """A connected loopback TCP pair (sending end with TCP_NODELAY, receiving end)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    out = socket.create_connection(listener.getsockname())
    out.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    inp, _ = listener.accept()
    listener.close()
    return out, inp


def write_loop(args):
    out, inp = loopback_pair()

    def drain():
        while inp.recv(1 << 16):
            pass

    threading.Thread(target=drain, daemon=True).start()
    payload = b"x" * 16
    def batch():
        for _ in range(500):
            out.send(payload)

    gated(args.seconds, batch, 500, "writes")
    out.close()


def send_recv_loop(args):
    out, inp = loopback_pair()
    payload = b"x" * 16

    def batch():
        for _ in range(500):
            out.send(payload)
            inp.recv(65536)

    gated(args.seconds, batch, 500, "iterations")
    out.close()


def pingpong(args):
    ping_r, ping_w = os.pipe()
    pong_r, pong_w = os.pipe()

    def echo():
        while os.read(ping_r, 1) == b"p":
            os.write(pong_w, b"p")

    threading.Thread(target=echo, daemon=True).start()
    def batch():
        for _ in range(200):
            os.write(ping_w, b"p")
            os.read(pong_r, 1)

    gated(args.seconds, batch, 200, "round_trips")
    os.write(ping_w, b"q")


def connect_loop(args):
    """Connections alone: each iteration connects to a loopback listener,
    accepts, and closes both ends: every TCP state change and socket free of
    a connection, in a process nobody traces. The server closes first, so
    the TIME_WAITs are its own and hold no ephemeral port the next connect()
    needs (tens of thousands of them per run)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    addr = listener.getsockname()
    def batch():
        for _ in range(100):
            client = socket.create_connection(addr)
            server, _ = listener.accept()
            server.close()
            client.close()

    gated(args.seconds, batch, 100, "connections")
    listener.close()


def syscall_loop(args):
    getppid = os.getppid
    def batch():
        for _ in range(1000):
            getppid()

    gated(args.seconds, batch, 1000, "syscalls")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("server")
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--tls", action="store_true", help="HTTPS (needs --certfile/--keyfile)")
    s.add_argument("--certfile")
    s.add_argument("--keyfile")
    c = sub.add_parser("client")
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--seconds", type=float, default=3.0)
    c.add_argument("--connections", type=int, default=1)
    c.add_argument("--events", type=int, default=2000)
    c.add_argument("--tls", action="store_true", help="HTTPS, certificate not checked")
    loop = sub.add_parser("ssl-loop")
    loop.add_argument("--certfile", required=True)
    loop.add_argument("--keyfile", required=True)
    loop.add_argument("--seconds", type=float, default=3.0)
    writes = sub.add_parser("write-loop")
    writes.add_argument("--seconds", type=float, default=3.0)
    sr = sub.add_parser("send-recv-loop")
    sr.add_argument("--seconds", type=float, default=3.0)
    pp = sub.add_parser("pingpong")
    pp.add_argument("--seconds", type=float, default=3.0)
    sc = sub.add_parser("syscall-loop")
    sc.add_argument("--seconds", type=float, default=3.0)
    cl = sub.add_parser("connect-loop")
    cl.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    if args.mode == "server":
        if args.tls and not (args.certfile and args.keyfile):
            ap.error("server --tls needs --certfile and --keyfile")
        server(args)
    elif args.mode == "client":
        client(args)
    elif args.mode == "write-loop":
        write_loop(args)
    elif args.mode == "send-recv-loop":
        send_recv_loop(args)
    elif args.mode == "pingpong":
        pingpong(args)
    elif args.mode == "syscall-loop":
        syscall_loop(args)
    elif args.mode == "connect-loop":
        connect_loop(args)
    else:
        ssl_loop(args)


if __name__ == "__main__":
    sys.exit(main())
