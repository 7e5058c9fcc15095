#!/usr/bin/env python3
"""Wire times of HTTP requests from a loopback capture, TLS decrypted.

  python3 tests/clients/tls_wire.py --capture FILE --port P [--keylog FILE]

FILE is tests/clients/wire_capture.py's output with --payload (CLOCK_MONOTONIC
receive stamps, payload bytes). Each connection to server port P is
reassembled per direction (by sequence number). A connection whose first
client bytes are a TLS handshake record is decrypted with the client's NSS
key log (SSLKEYLOGFILE format; TLS 1.3 only: AES-GCM and ChaCha20-Poly1305
record protection, RFC 8446 section 5 and 7); any other connection is read
as plaintext. The plaintext is read as HTTP/1.1 (requests one after the
other) or, after the client preface, HTTP/2 frames.

One JSON line per request, the wire's view of it:
  {"client_port", "index" (HTTP/1.1: 0 for the connection's first request;
   HTTP/2: the stream id), "rid" (HTTP/1.1: the X-Request-Id header),
   "t_request": when the first byte of the record (TLS) or packet
   (plaintext) carrying the request's first byte reached the host,
   "t_first_event": the same for the response's first `data: ` byte,
   "t_hello", "t_finished": the ClientHello's and the client Finished's
   record arrival (TLS; the same on every request of a connection)}
and one {"client_port", "error"} per connection it could not read.
"""

import argparse
import json
import struct
import sys

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand

SUITES = {
    0x1301: (AESGCM, 16, hashes.SHA256),
    0x1302: (AESGCM, 32, hashes.SHA384),
    0x1303: (ChaCha20Poly1305, 32, hashes.SHA256),
}
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


class Stream:
    """One direction's bytes, and when each byte's packet reached the host."""

    def __init__(self, packets):
        base = packets[0]["seq"]
        spans = {}
        for p in packets:
            off = (p["seq"] - base) % (1 << 32)
            if off not in spans or p["ts"] < spans[off][1]:
                spans[off] = (bytes.fromhex(p["hex"]), p["ts"])
        self.data = bytearray()
        self.marks = []  # (start offset, end offset, ts)
        for off in sorted(spans):
            payload, ts = spans[off]
            end = off + len(payload)
            if end <= len(self.data):
                continue
            if off > len(self.data):
                raise ValueError(f"capture misses bytes {len(self.data)}..{off}")
            self.data += payload[len(self.data) - off:]
            self.marks.append((off, end, ts))

    def ts_at(self, offset):
        for start, end, ts in self.marks:
            if start <= offset < end:
                return ts
        raise ValueError(f"no packet holds byte {offset}")


def records(stream):
    """(offset, content type, body) of every whole TLS record."""
    d, i = stream.data, 0
    while i + 5 <= len(d):
        length = struct.unpack("!H", d[i + 3:i + 5])[0]
        if i + 5 + length > len(d):
            break
        yield i, d[i], bytes(d[i:i + 5]), bytes(d[i + 5:i + 5 + length])
        i += 5 + length


def expand_label(hash_cls, secret, label, length):
    full = b"tls13 " + label
    info = struct.pack("!H", length) + bytes([len(full)]) + full + b"\x00"
    return HKDFExpand(algorithm=hash_cls(), length=length, info=info).derive(secret)


class Protection:
    """One direction's record protection at one epoch (RFC 8446 5.2, 5.3)."""

    def __init__(self, suite, secret):
        aead, key_len, hash_cls = SUITES[suite]
        self.aead = aead(expand_label(hash_cls, secret, b"key", key_len))
        self.iv = expand_label(hash_cls, secret, b"iv", 12)
        self.seq = 0

    def open(self, header, body):
        nonce = bytes(a ^ b for a, b in zip(self.iv, self.seq.to_bytes(12, "big")))
        self.seq += 1
        inner = self.aead.decrypt(nonce, body, header).rstrip(b"\x00")
        return inner[-1], inner[:-1]


def has_finished(handshake):
    i = 0
    while i + 4 <= len(handshake):
        kind = handshake[i]
        length = int.from_bytes(handshake[i + 1:i + 4], "big")
        if kind == 20:
            return True
        i += 4 + length
    return False


def decrypt(stream, secrets, role, suite, random):
    """Plaintext application data of one direction, as (plaintext offset ->
    ts of the record's first byte) pieces, and the arrival of its Finished."""
    epochs = [secrets.get((random, f"{role}_HANDSHAKE_TRAFFIC_SECRET")),
              secrets.get((random, f"{role}_TRAFFIC_SECRET_0"))]
    if None in epochs:
        raise ValueError(f"the key log lacks the {role} secrets")
    prot = Protection(suite, epochs[0])
    app = False
    plain, pieces, finished = bytearray(), [], None
    for off, ctype, header, body in records(stream):
        if ctype != 23:
            continue  # ClientHello/ServerHello, ChangeCipherSpec
        inner_type, inner = prot.open(header, body)
        if not app:
            if inner_type == 22 and has_finished(inner):
                finished = stream.ts_at(off)
                prot, app = Protection(suite, epochs[1]), True
            continue
        if inner_type == 23:
            pieces.append((len(plain), stream.ts_at(off)))
            plain += inner
    return bytes(plain), pieces, finished


def plain_pieces(stream):
    return bytes(stream.data), [(s, ts) for s, _e, ts in stream.marks]


def ts_of(pieces, offset):
    best = None
    for start, ts in pieces:
        if start <= offset:
            best = ts
        else:
            break
    return best


def http1_requests(data):
    """(offset, rid) of each request, one after the other."""
    out, i = [], 0
    while i < len(data):
        end = data.find(b"\r\n\r\n", i)
        if end < 0:
            break
        head = data[i:end].decode("latin-1")
        rid, length = None, 0
        for line in head.split("\r\n")[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "x-request-id":
                rid = value.strip()
            elif name.strip().lower() == "content-length":
                length = int(value)
        out.append((i, rid))
        i = end + 4 + length
    return out


def http1_first_events(data):
    """Offset of the first `data: ` byte of each response, in order."""
    out, i = [], 0
    while i < len(data):
        end = data.find(b"\r\n\r\n", i)
        if end < 0:
            break
        head = data[i:end].lower()
        j = end + 4
        first = None
        if b"transfer-encoding: chunked" in head:
            while True:
                nl = data.find(b"\r\n", j)
                if nl < 0:
                    return out + [first]
                size = int(data[j:nl].split(b";")[0], 16)
                body = data[nl + 2:nl + 2 + size]
                if first is None and b"data: " in body:
                    first = nl + 2 + body.index(b"data: ")
                j = nl + 2 + size + 2
                if size == 0:
                    break
        else:
            length = 0
            for line in head.split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            body = data[j:j + length]
            if b"data: " in body:
                first = j + body.index(b"data: ")
            j += length
        out.append(first)
        i = j
    return out


def h2_frames(data, start):
    i = start
    while i + 9 <= len(data):
        length = int.from_bytes(data[i:i + 3], "big")
        kind, stream = data[i + 3], struct.unpack("!I", data[i + 5:i + 9])[0] & 0x7FFFFFFF
        yield i, kind, stream, data[i + 9:i + 9 + length]
        i += 9 + length


def requests_of(port, client, server, secrets):
    """The wire view of one connection's requests (see the module doc)."""
    hello = finished = None
    if client.data[:1] == b"\x16":
        (c_off, _t, _h, c_hello), *_ = records(client)
        (_o, _t, _h, s_hello), *_ = records(server)
        random = c_hello[6:38].hex()
        sid_len = s_hello[38]
        suite = struct.unpack("!H", s_hello[39 + sid_len:41 + sid_len])[0]
        hello = client.ts_at(c_off)
        c_plain, c_pieces, finished = decrypt(client, secrets, "CLIENT", suite, random)
        s_plain, s_pieces, _ = decrypt(server, secrets, "SERVER", suite, random)
    else:
        c_plain, c_pieces = plain_pieces(client)
        s_plain, s_pieces = plain_pieces(server)
    out = []
    base = {"client_port": port, "t_hello": hello, "t_finished": finished}
    if c_plain.startswith(H2_PREFACE):
        first_data = {}
        for off, kind, stream, payload in h2_frames(s_plain, 0):
            if kind == 0 and stream not in first_data and b"data: " in payload:
                first_data[stream] = off + 9 + payload.index(b"data: ")
        for off, kind, stream, _p in h2_frames(c_plain, len(H2_PREFACE)):
            if kind == 1:
                ev = first_data.get(stream)
                out.append(dict(base, index=stream, rid=None, t_request=ts_of(c_pieces, off),
                                t_first_event=ts_of(s_pieces, ev) if ev is not None else None))
        return out
    events = http1_first_events(s_plain)
    for k, (off, rid) in enumerate(http1_requests(c_plain)):
        ev = events[k] if k < len(events) else None
        out.append(dict(base, index=k, rid=rid, t_request=ts_of(c_pieces, off),
                        t_first_event=ts_of(s_pieces, ev) if ev is not None else None))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--capture", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--keylog")
    args = ap.parse_args()
    secrets = {}
    if args.keylog:
        with open(args.keylog) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3:
                    secrets[(parts[1].lower(), parts[0])] = bytes.fromhex(parts[2])
    conns = {}
    with open(args.capture) as f:
        for line in f:
            p = json.loads(line)
            if "hex" not in p:
                sys.exit("tls_wire.py: the capture has no payloads (wire_capture.py --payload)")
            client = p["dst"] if p["src"] == args.port else p["src"]
            side = "server" if p["src"] == args.port else "client"
            conns.setdefault(client, {"client": [], "server": []})[side].append(p)
    for port, sides in sorted(conns.items()):
        try:
            if not sides["client"] or not sides["server"]:
                raise ValueError("one direction carried no bytes")
            for side in sides.values():
                side.sort(key=lambda p: p["ts"])
            rows = requests_of(port, Stream(sides["client"]), Stream(sides["server"]), secrets)
        except (ValueError, KeyError, IndexError) as e:
            print(json.dumps({"client_port": port, "error": str(e)}))
            continue
        except Exception as e:  # cryptography's InvalidTag has no message
            print(json.dumps({"client_port": port, "error": f"{type(e).__name__} {e}"}))
            continue
        for row in rows:
            print(json.dumps(row))


if __name__ == "__main__":
    main()
