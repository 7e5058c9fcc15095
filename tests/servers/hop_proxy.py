#!/usr/bin/env python3
"""An async LLM gateway (aiohttp) in front of one upstream, for tests/ebpf_hops.rs.

Run:  python3 tests/servers/hop_proxy.py --port P --upstream-port U
                                         [--pool N | --fresh] [--rewrite]

POST /v1/chat/completions (any query) is sent on to
http://127.0.0.1:U with the same path, body, ``X-Request-Id`` and W3C trace context; the SSE
response is relayed event by event, each event written as soon as it is
complete. Prints ``READY <port>`` once listening.

--fresh     a new upstream connection per request (closed after it);
--pool N    a keep-alive pool of at most N upstream connections (default 4);
--rewrite   forwards no id header and replaces every event's "id" with the
            gateway's own: nothing the gateway carries over names the
            inbound request (the hops can only be joined by the 4-tuple).
"""

import argparse
import asyncio
import json
import uuid

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web


def rewrite_event(raw: bytes, new_id: str) -> bytes:
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
            try:
                obj = json.loads(line[5:])
                if isinstance(obj, dict) and "id" in obj:
                    obj["id"] = new_id
                line = b"data: " + json.dumps(obj).encode()
            except ValueError:
                pass
        out.append(line)
    return b"\n".join(out)


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--upstream-port", type=int, required=True)
    ap.add_argument("--pool", type=int, default=4)
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--rewrite", action="store_true")
    args = ap.parse_args()
    connector = TCPConnector(force_close=True) if args.fresh else TCPConnector(limit=args.pool)
    session = ClientSession(connector=connector, timeout=ClientTimeout(total=120))
    base = f"http://127.0.0.1:{args.upstream_port}"

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {"Content-Type": "application/json"}
        if not args.rewrite:
            for name in ("X-Request-Id", "traceparent", "tracestate"):
                if name in request.headers:
                    headers[name] = request.headers[name]
        own_id = "gw-" + uuid.uuid4().hex
        async with session.post(base + request.path_qs, data=body, headers=headers) as up:
            resp = web.StreamResponse(status=up.status)
            resp.content_type = up.content_type
            await resp.prepare(request)
            event = b""
            async for line in up.content:
                event += line
                if line in (b"\n", b"\r\n"):
                    await resp.write(rewrite_event(event, own_id) if args.rewrite else event)
                    event = b""
            if event:
                await resp.write(event)
            await resp.write_eof()
            return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    print(f"READY {port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
