"""Streams chat completions to a vLLM server at once, one thread each.

usage: python3 vllm_client.py PORT ID:MAX_TOKENS [ID:MAX_TOKENS ...]

Each request sends `X-Request-Id: ID` (vLLM answers with id `chatcmpl-ID`)
and asks for the usage chunk. Prints one JSON line per request: the id seen
in the stream, the SSE events counted (every `data:` event but `[DONE]`;
this is what the agent's `chunks` must equal) and the usage vLLM reported.
The prompt text never matters; the model is random.
"""

import http.client
import json
import sys
import threading


def one(port, rid, max_tokens, out):
    body = json.dumps(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "queue batch engine step"}],
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request(
        "POST",
        "/v1/chat/completions",
        body=body,
        headers={"content-type": "application/json", "x-request-id": rid},
    )
    resp = conn.getresponse()
    events, seen_id, usage, done, buf = 0, None, None, False, b""
    while True:
        data = resp.read1(65536)
        if not data:
            break
        buf += data
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            payload = event.strip()
            if not payload.startswith(b"data:"):
                continue
            payload = payload[5:].strip()
            if payload == b"[DONE]":
                done = True
                continue
            events += 1
            obj = json.loads(payload)
            seen_id = seen_id or obj.get("id")
            if obj.get("usage"):
                usage = obj["usage"]
    conn.close()
    out.append(
        {"request": rid, "status": resp.status, "id": seen_id, "events": events,
         "done": done, "usage": usage}
    )


def main():
    port = int(sys.argv[1])
    out = []
    threads = []
    for spec in sys.argv[2:]:
        rid, max_tokens = spec.rsplit(":", 1)
        t = threading.Thread(target=one, args=(port, rid, int(max_tokens), out))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    for rec in out:
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
