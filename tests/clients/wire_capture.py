#!/usr/bin/env python3
"""Loopback packet capture for the request-ingress tests (root; stdlib only).

  python3 tests/clients/wire_capture.py --port P --out FILE [--payload]

An AF_PACKET socket on ``lo`` with kernel receive timestamps (SO_TIMESTAMPNS,
taken when the packet entered the host's receive path, before TCP saw it);
only the receive-side copy of each loopback packet is kept (pkttype
PACKET_HOST), so a time is when the bytes *reached the host*. Prints
``READY`` once capturing; on SIGTERM/SIGINT writes one JSON line per TCP
packet with payload to or from port P and exits:
  {"ts": CLOCK_MONOTONIC ns, "src": port, "dst": port, "seq": n,
   "len": payload bytes, "data_event": payload contains b"data: "}
and, with --payload, "hex": the payload itself (tests/clients/tls_wire.py
decrypts TLS from it).

Clock: the kernel stamps CLOCK_REALTIME; it is converted with the
REALTIME - MONOTONIC offset measured at start (the narrowest of 50 reads
bracketed by monotonic reads: error well under a microsecond), the clock of
bpf_ktime_get_ns. A stepped wall clock during a run would show as a
constant shift of every packet; the tests compare differences too.
"""

import argparse
import json
import signal
import socket
import struct
import sys
import time

ETH_P_ALL = 0x0003
SO_TIMESTAMPNS = 35
SO_RCVBUFFORCE = 33
PACKET_HOST = 0


def wall_offset_ns():
    best = None
    for _ in range(50):
        a = time.monotonic_ns()
        r = time.time_ns()
        b = time.monotonic_ns()
        if best is None or b - a < best[0]:
            best = (b - a, r - (a + b) // 2)
    return best[1]


def parse(frame, port):
    """(src, dst, seq, payload) of an IPv4/IPv6 TCP packet touching `port`."""
    if len(frame) < 14:
        return None
    ethertype = struct.unpack("!H", frame[12:14])[0]
    p = frame[14:]
    if ethertype == 0x0800 and len(p) >= 20 and p[9] == 6:
        ihl = (p[0] & 0x0F) * 4
        total = struct.unpack("!H", p[2:4])[0]
        tcp = p[ihl:total]
    elif ethertype == 0x86DD and len(p) >= 40 and p[6] == 6:
        plen = struct.unpack("!H", p[4:6])[0]
        tcp = p[40:40 + plen]
    else:
        return None
    if len(tcp) < 20:
        return None
    src, dst, seq = struct.unpack("!HHI", tcp[:8])
    if port not in (src, dst):
        return None
    doff = (tcp[12] >> 4) * 4
    return src, dst, seq, tcp[doff:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--payload", action="store_true")
    args = ap.parse_args()
    offset = wall_offset_ns()
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
    s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    s.bind(("lo", 0))
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    s.settimeout(0.05)
    print("READY", flush=True)
    packets = []
    while not stop:
        try:
            frame, anc, _flags, addr = s.recvmsg(65600, 64)
        except socket.timeout:
            continue
        except InterruptedError:
            continue
        if addr[2] != PACKET_HOST:
            continue
        ts = None
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                sec, nsec = struct.unpack("qq", data[:16])
                ts = sec * 1_000_000_000 + nsec - offset
        got = parse(frame, args.port)
        if ts is None or got is None or not got[3]:
            continue
        src, dst, seq, payload = got
        p = {"ts": ts, "src": src, "dst": dst, "seq": seq, "len": len(payload),
             "data_event": b"data: " in payload}
        if args.payload:
            p["hex"] = payload.hex()
        packets.append(p)
    with open(args.out, "w") as f:
        for p in packets:
            f.write(json.dumps(p) + "\n")


if __name__ == "__main__":
    main()
