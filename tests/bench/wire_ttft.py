#!/usr/bin/env python3
"""Agent TTFT vs wire TTFT for any tokentrace binary (root).

  python3 tests/bench/wire_ttft.py --agent target/debug/tokentrace \
      [--rounds 2] [--streams 64]

Runs tests/servers/wire_server.py (one connection at a time: a burst waits
in the kernel), the loopback capture tests/clients/wire_capture.py and
--rounds bursts of --streams concurrent streams (tests/clients/wire_client.py),
with the agent tracing the server. Per request: wire TTFT = first
server->client packet carrying an SSE event - first client->server payload
packet (kernel receive timestamps); prints the distribution of agent
ttft_ms - wire TTFT (ms), and of socket_wait_ms when the agent reports it.
Used for the before/after figures of issue 11 (an agent that starts TTFT at
the server's read is short by the request's wait in the kernel).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pct(xs, p):
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))] if s else float("nan")


def summary(name, xs):
    return (f"{name:<34} n={len(xs):<4} min={pct(xs, 0):9.3f} p50={pct(xs, 50):9.3f} "
            f"p95={pct(xs, 95):9.3f} p99={pct(xs, 99):9.3f} max={pct(xs, 100):9.3f} ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--agent", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--streams", type=int, default=64)
    args = ap.parse_args()
    py = sys.executable
    srv = subprocess.Popen([py, "-u", f"{ROOT}/tests/servers/wire_server.py", "--port", "0"],
                           stdout=subprocess.PIPE, text=True)
    port = int(srv.stdout.readline().split()[1])
    out = tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False).name
    agent = subprocess.Popen([args.agent, "run", "--pid", str(srv.pid), "--output", "json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in agent.stderr:
        if "tokentrace: ready" in line:
            break
    cap = subprocess.Popen([py, "-u", f"{ROOT}/tests/clients/wire_capture.py", "--port",
                            str(port), "--out", out], stdout=subprocess.PIPE, text=True)
    cap.stdout.readline()
    clients = []
    for r in range(args.rounds):
        res = subprocess.run([py, f"{ROOT}/tests/clients/wire_client.py", "--port", str(port),
                              "--connections", str(args.streams), "--tokens", "3", "--delay-ms",
                              "1", "--ttft-ms", "1", "--rid-prefix", f"b{r}-"],
                             capture_output=True, text=True, check=True)
        clients += [json.loads(l) for l in res.stdout.splitlines()]
    time.sleep(1.0)
    cap.send_signal(signal.SIGTERM)
    cap.wait()
    agent.send_signal(signal.SIGINT)
    lines, _ = agent.communicate(timeout=30)
    srv.kill()
    packets = [json.loads(l) for l in open(out)]
    os.unlink(out)
    by_rid = {}
    for l in lines.splitlines():
        try:
            v = json.loads(l)
        except ValueError:
            continue
        path = v.get("path") or ""
        if "rid=" in path:
            by_rid[path.split("rid=")[1].split("&")[0]] = v
    diff, waits = [], []
    for c in clients:
        a = by_rid.get(c["rid"])
        if not a or a.get("ttft_ms") is None:
            continue
        cp = c["client_port"]
        req = min((p["ts"] for p in packets if p["src"] == cp and p["dst"] == port), default=None)
        ev = min((p["ts"] for p in packets if p["src"] == port and p["dst"] == cp
                  and p["data_event"]), default=None)
        if req is None or ev is None:
            continue
        diff.append(a["ttft_ms"] - (ev - req) / 1e6)
        if a.get("socket_wait_ms") is not None:
            waits.append(a["socket_wait_ms"])
    print(f"{args.agent}: {len(diff)} of {len(clients)} requests matched")
    print(summary("agent TTFT - wire TTFT", diff))
    if waits:
        print(summary("socket_wait_ms", waits))


if __name__ == "__main__":
    main()
