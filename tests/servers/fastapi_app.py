#!/usr/bin/env python3
"""FastAPI + uvicorn test server speaking a small OpenAI-compatible API.

Run:  python3 tests/servers/fastapi_app.py --port P [--host 127.0.0.1]
                                           [--ssl-keyfile K --ssl-certfile C]
      (--port 0 picks a free port). Prints ``READY <port>`` on stdout,
      flushed, once the socket is listening. Writes nothing to disk.
      With --ssl-keyfile/--ssl-certfile uvicorn serves HTTPS (asyncio's SSL
      transport: OpenSSL on memory BIOs, the socket I/O done separately by
      the event loop).

Endpoints
---------
POST /v1/chat/completions
    Body: {"model", "messages", "stream": bool, "max_tokens": N,
           "token_delay_ms": 20, "ttft_ms": 50,
           "sse_impl": "starlette" | "sse-starlette",   (default "starlette")
           "crash_after": K}                              (optional)
    stream=true  -> OpenAI-style SSE: N ``chat.completion.chunk`` events (one
                    token each), one usage event (``choices: []``), then
                    ``data: [DONE]``. That is N+1 chunks as the agent and the
                    client count them ([DONE] excluded).
                    sse_impl "starlette" uses starlette's StreamingResponse
                    (events end with "\\n\\n"); "sse-starlette" uses
                    sse_starlette.EventSourceResponse (events end with
                    "\\r\\n\\r\\n", may add ": ping" comments).
    stream=false -> one JSON ``chat.completion`` with Content-Length, sent after
                    sleeping ttft_ms.
    crash_after=K (stream=true) -> after K token events the process SIGKILLs
                    itself (server killed mid-stream).
POST /v1/completions
    Same as /v1/chat/completions but always uses sse-starlette when streaming.
POST /v1/stream-text
    Chunked (Transfer-Encoding: chunked) text/plain stream of N pieces,
    first after ttft_ms, then one every token_delay_ms. N chunks.
GET /health -> {"status": "ok"}

Server-side ground truth, all CLOCK_MONOTONIC ns (time.monotonic_ns(), the
clock of bpf_ktime_get_ns), read back by tests/clients/stream_client.py:
  * response header ``X-Req-Mono-Ns``: taken when the handler starts, i.e.
    after the server's read of the request returned;
  * ``"x_mono_ns"`` in every SSE data event (not [DONE]) and in the
    non-streaming JSON body, and `` @<ns>`` at the end of every text piece:
    taken just before the chunk is handed to the transport (so before the
    write that carries it).
"""

import argparse
import asyncio
import json
import os
import signal
import sys
import time
import uuid

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

try:
    from sse_starlette import EventSourceResponse
except ImportError:  # pragma: no cover - sse-starlette is a test dependency
    EventSourceResponse = None

WORDS = (
    "The quick brown fox jumps over the lazy dog while the model streams "
    "tokens one by one to a patient client that measures every gap ."
).split()

app = FastAPI()


def _new_id(prefix="chatcmpl"):
    return f"{prefix}-{uuid.uuid4().hex}"


def _params(body):
    n = int(body.get("max_tokens", 16) or 16)
    delay = float(body.get("token_delay_ms", 20)) / 1000.0
    ttft = float(body.get("ttft_ms", 50)) / 1000.0
    crash = body.get("crash_after")
    crash = int(crash) if crash is not None else None
    return n, delay, ttft, crash


def _token(i):
    w = WORDS[i % len(WORDS)]
    return w if i == 0 else " " + w


def _crash():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


async def _events(body, rid, model, t_req):
    """Yields the JSON payloads of the data events (without [DONE])."""
    n, delay, ttft, crash = _params(body)
    created = int(time.time())
    await asyncio.sleep(ttft)
    for i in range(n):
        if i > 0:
            await asyncio.sleep(delay)
        if crash is not None and i >= crash:
            _crash()
        delta = {"content": _token(i)}
        if i == 0:
            delta["role"] = "assistant"
        ev = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
        }
        ev["x_req_mono_ns"] = t_req
        ev["x_mono_ns"] = time.monotonic_ns()
        yield json.dumps(ev, separators=(",", ":"))
    await asyncio.sleep(delay)
    if crash is not None and n >= crash:
        _crash()
    usage = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": {"prompt_tokens": 12, "completion_tokens": n, "total_tokens": 12 + n},
    }
    usage["x_req_mono_ns"] = t_req
    usage["x_mono_ns"] = time.monotonic_ns()
    yield json.dumps(usage, separators=(",", ":"))


async def _starlette_sse(body, rid, model, t_req):
    async for payload in _events(body, rid, model, t_req):
        yield f"data: {payload}\n\n".encode()
    yield b"data: [DONE]\n\n"


async def _sse_starlette_gen(body, rid, model, t_req):
    async for payload in _events(body, rid, model, t_req):
        yield {"data": payload}
    yield {"data": "[DONE]"}


def _req_headers(t_req):
    return {"X-Req-Mono-Ns": str(t_req)}


async def _completion(request: Request, force_sse_starlette: bool):
    t_req = time.monotonic_ns()
    body = await request.json()
    rid = _new_id("chatcmpl" if not force_sse_starlette else "cmpl")
    model = body.get("model", "test-model")
    if body.get("stream"):
        impl = "sse-starlette" if force_sse_starlette else body.get("sse_impl", "starlette")
        if impl == "sse-starlette":
            if EventSourceResponse is None:
                return JSONResponse({"error": "sse-starlette not installed"}, status_code=500)
            return EventSourceResponse(
                _sse_starlette_gen(body, rid, model, t_req), ping=600, headers=_req_headers(t_req)
            )
        return StreamingResponse(
            _starlette_sse(body, rid, model, t_req),
            media_type="text/event-stream",
            headers=_req_headers(t_req),
        )
    n, _delay, ttft, _crash_after = _params(body)
    await asyncio.sleep(ttft)
    text = "".join(_token(i) for i in range(n))
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": 12, "completion_tokens": n, "total_tokens": 12 + n},
            "x_req_mono_ns": t_req,
            "x_mono_ns": time.monotonic_ns(),
        },
        headers=_req_headers(t_req),
    )


@app.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await _completion(request, force_sse_starlette=False)


@app.post("/v1/completions")
async def completions(request: Request):
    return await _completion(request, force_sse_starlette=True)


@app.post("/v1/stream-text")
async def stream_text(request: Request):
    t_req = time.monotonic_ns()
    try:
        body = await request.json()
    except Exception:
        body = {}
    n, delay, ttft, _crash_after = _params(body)

    async def gen():
        await asyncio.sleep(ttft)
        for i in range(n):
            if i > 0:
                await asyncio.sleep(delay)
            yield f"piece-{i}{_token(i)} @{time.monotonic_ns()}\n".encode()

    return StreamingResponse(gen(), media_type="text/plain", headers=_req_headers(t_req))


@app.get("/health")
async def health():
    return {"status": "ok"}


class _Server(uvicorn.Server):
    async def startup(self, sockets=None):
        await super().startup(sockets=sockets)
        port = None
        for srv in getattr(self, "servers", []) or []:
            for sock in srv.sockets:
                port = sock.getsockname()[1]
                break
            if port is not None:
                break
        print(f"READY {port if port is not None else self.config.port}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    ap.add_argument("--ssl-keyfile", default=None, help="PEM key: serve HTTPS")
    ap.add_argument("--ssl-certfile", default=None, help="PEM certificate: serve HTTPS")
    args = ap.parse_args()
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        ap.error("--ssl-keyfile and --ssl-certfile go together")
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_keep_alive=60,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
    )
    _Server(config).run()


if __name__ == "__main__":
    main()
