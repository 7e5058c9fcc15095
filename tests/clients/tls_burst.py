#!/usr/bin/env python3
"""Bursts of HTTPS connections opened at the same moment.

  python3 tests/clients/tls_burst.py --port P --rounds R --conns N [--prefix X]

Per round, N threads start together (a barrier): each connects, completes
the TLS handshake, sends ``GET /stream?rid=<prefix>-<round>-<i>`` and reads
to EOF. TCP_NODELAY on every socket (a small request after the handshake
must not wait for a delayed ACK). One JSON line per request: {"path",
"client_addr": the client's own "ip:port" of that connection, "ok": response
complete, "t_sent": CLOCK_MONOTONIC ns just after sendall()}. No
certificate checks.
"""

import argparse
import json
import socket
import ssl
import threading
import time


def one(port, path, barrier, out):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    barrier.wait()
    raw = socket.create_connection(("127.0.0.1", port))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ip, cport = raw.getsockname()[:2]
    s = ctx.wrap_socket(raw, server_hostname="localhost")
    s.sendall(b"GET %s HTTP/1.1\r\nHost: localhost\r\n\r\n" % path.encode())
    t_sent = time.monotonic_ns()
    got = b""
    while True:
        try:
            d = s.recv(65536)
        except (ssl.SSLError, OSError):
            break
        if not d:
            break
        got += d
    s.close()
    out.append({"path": path, "client_addr": f"{ip}:{cport}", "ok": got.endswith(b"0\r\n\r\n"),
                "t_sent": t_sent})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--conns", type=int, default=8)
    ap.add_argument("--prefix", default="burst")
    args = ap.parse_args()
    out = []
    for r in range(args.rounds):
        barrier = threading.Barrier(args.conns)
        threads = [
            threading.Thread(target=one, args=(args.port, f"/stream?rid={args.prefix}-{r}-{i}", barrier, out))
            for i in range(args.conns)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for rec in out:
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
