#!/usr/bin/env python3
"""HTTPS server that reads a round of sockets before it runs OpenSSL on any.

Run:  python3 tests/servers/gathering_tls_server.py --cert C --key K --port 0
          [--host 127.0.0.1] [--gather-ms 15]
      Prints ``READY <port>`` once listening.

One thread, select() over every connection, the stdlib ssl module on memory
BIOs (as asyncio's SSL transport: the server reads the socket and feeds
OpenSSL, no socket I/O nests in an OpenSSL call). Each round waits
``--gather-ms`` after select() wakes, reads *every* readable socket, and only
then feeds each connection's bytes to its SSL object: when a connection's
handshake or first SSL_read runs, the thread's latest socket read is
usually another connection's. Event loops that batch their I/O this way
exist; for the probes it is the case where "the thread's latest read" is
the wrong socket.

GET <path> -> 200 text/event-stream, chunked: 3 events ``data: {"i":k}``,
one SSL_write each, then the last chunk; the connection closes.
"""

import argparse
import select
import socket
import ssl
import sys
import time

RESPONSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
)


def chunk(payload: bytes) -> bytes:
    return b"%x\r\n" % len(payload) + payload + b"\r\n"


class Conn:
    def __init__(self, sock, ctx):
        self.sock = sock
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self.tls = ctx.wrap_bio(self.incoming, self.outgoing, server_side=True)
        self.handshaken = False
        self.request = b""
        self.done = False

    def flush(self):
        data = self.outgoing.read()
        if data:
            self.sock.setblocking(True)
            self.sock.sendall(data)
            self.sock.setblocking(False)

    def feed(self, data: bytes):
        """Runs OpenSSL on bytes read earlier in this round."""
        if data:
            self.incoming.write(data)
        else:
            self.incoming.write_eof()
        try:
            if not self.handshaken:
                self.tls.do_handshake()
                self.handshaken = True
            while b"\r\n\r\n" not in self.request:
                self.request += self.tls.read(65536)
        except ssl.SSLWantReadError:
            pass
        except (ssl.SSLError, OSError):
            self.done = True
        self.flush()
        if not self.done and b"\r\n\r\n" in self.request:
            self.respond()

    def respond(self):
        self.tls.write(RESPONSE_HEAD)
        for i in range(3):
            self.tls.write(chunk(b'data: {"i":%d}\n\n' % i))
        self.tls.write(b"0\r\n\r\n")
        self.flush()
        self.done = True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--cert", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--gather-ms", type=float, default=15.0)
    args = ap.parse_args()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(args.cert, args.key)
    listener = socket.create_server((args.host, args.port), backlog=256)
    listener.setblocking(False)
    print(f"READY {listener.getsockname()[1]}", flush=True)
    conns = {}
    while True:
        ready, _, _ = select.select([listener, *conns], [], [], 1.0)
        if not ready:
            continue
        time.sleep(args.gather_ms / 1000.0)
        ready, _, _ = select.select([listener, *conns], [], [], 0)
        round_reads = []
        for s in ready:
            if s is listener:
                while True:
                    try:
                        c, _ = listener.accept()
                    except BlockingIOError:
                        break
                    c.setblocking(False)
                    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    conns[c] = Conn(c, ctx)
                continue
            try:
                round_reads.append((conns[s], s.recv(65536)))
            except BlockingIOError:
                pass
            except OSError:
                round_reads.append((conns[s], b""))
        for conn, data in round_reads:
            conn.feed(data)
            if conn.done or not data:
                del conns[conn.sock]
                conn.sock.close()


if __name__ == "__main__":
    sys.exit(main())
