#!/usr/bin/env node
// OpenAI-style SSE streaming over HTTP/2 with node's built-in `http2` module.
//
// Run:  node tests/servers/h2_sse_server.js --port P [--host 127.0.0.1]
//                                           [--tls-cert C --tls-key K]
//       (--port 0 picks a free port). Prints `READY <port>` on stdout once
//       listening. Without --tls-*: h2c (prior knowledge, no upgrade); with
//       them: TLS with ALPN h2 only (http2.createSecureServer), through the
//       OpenSSL node links statically (and exports: `nm -D $(which node)`).
//
// POST /v1/chat/completions (any query string) with a JSON body
//   {"max_tokens": N (12), "token_delay_ms": D (15), "ttft_ms": F (40),
//    "model": M}
// answers 200, content-type text/event-stream, then N chat.completion.chunk
// events D ms apart (the first F ms after the request), one usage event
// (choices: []) and `data: [DONE]`: N+1 chunks, as tests/servers/stdlib_sse.py.
// Every event is one stream.write (one DATA frame); the stream ends with an
// empty DATA frame carrying END_STREAM. A stream the client resets stops
// being written to. GET /health answers {"status":"ok"}.
//
// Server-side ground truth, CLOCK_MONOTONIC ns (process.hrtime.bigint() is
// uv_hrtime: CLOCK_MONOTONIC, the clock of bpf_ktime_get_ns):
//   * response header x-req-mono-ns: when the 'stream' handler started (after
//     node read and decoded the request HEADERS);
//   * "x_mono_ns" in every data event: taken just before its stream.write.
// The client's x-request-id header is echoed as a response header.
// SIGTERM/SIGINT close the server.
'use strict';

const http2 = require('http2');
const fs = require('fs');
const crypto = require('crypto');
const { parseArgs, numberOr, readJsonBody } = require('./sse_args.js');

const mono = () => process.hrtime.bigint().toString();
const WORDS = ('The quick brown fox jumps over the lazy dog while the model streams ' +
  'tokens one by one to a patient client that measures every gap .').split(' ');

function chatStream(stream, headers, body, tReq) {
  const n = Math.floor(numberOr(body.max_tokens, 12));
  const delay = numberOr(body.token_delay_ms, 15);
  const ttft = numberOr(body.ttft_ms, 40);
  const model = typeof body.model === 'string' ? body.model : 'test-model';
  const id = 'chatcmpl-' + crypto.randomBytes(12).toString('hex');
  const created = Math.floor(Date.now() / 1000);
  const rid = headers['x-request-id'];
  const respHeaders = {
    ':status': 200,
    'content-type': 'text/event-stream',
    'cache-control': 'no-cache',
    'x-req-mono-ns': tReq,
  };
  if (typeof rid === 'string') respHeaders['x-request-id'] = rid;
  stream.respond(respHeaders);
  let i = 0;
  const event = (obj) => {
    obj.x_mono_ns = mono();
    return 'data: ' + JSON.stringify(obj) + '\n\n';
  };
  const step = () => {
    if (stream.destroyed || stream.closed) return;
    if (i < n) {
      const delta = { content: i === 0 ? WORDS[0] : ' ' + WORDS[i % WORDS.length] };
      if (i === 0) delta.role = 'assistant';
      stream.write(event({
        id, object: 'chat.completion.chunk', created, model,
        choices: [{ index: 0, delta, finish_reason: null }],
      }));
      i += 1;
      setTimeout(step, delay);
    } else {
      stream.write(event({
        id, object: 'chat.completion.chunk', created, model, choices: [],
        usage: { prompt_tokens: 12, completion_tokens: n, total_tokens: 12 + n },
      }));
      stream.write('data: [DONE]\n\n');
      stream.end();
    }
  };
  setTimeout(step, ttft);
}

function onStream(stream, headers) {
  const tReq = mono();
  stream.on('error', () => {}); // a reset by the client is expected in tests
  const method = headers[':method'];
  const path = (headers[':path'] || '').split('?')[0];
  if (method === 'GET' && path === '/health') {
    stream.respond({ ':status': 200, 'content-type': 'application/json', 'x-req-mono-ns': tReq });
    stream.end('{"status":"ok"}');
    return;
  }
  if (method !== 'POST' || (path !== '/v1/chat/completions' && path !== '/v1/completions')) {
    stream.respond({ ':status': 404, 'content-type': 'application/json' });
    stream.end('{"error":"not found"}');
    return;
  }
  readJsonBody(stream, (body) => chatStream(stream, headers, body, tReq));
}

function main() {
  let args;
  try {
    args = parseArgs(process.argv.slice(2));
  } catch (e) {
    process.stderr.write(`h2_sse_server.js: ${e.message}\n`);
    process.exit(2);
  }
  const server = args.tlsCert
    ? http2.createSecureServer({
      cert: fs.readFileSync(args.tlsCert),
      key: fs.readFileSync(args.tlsKey),
      allowHTTP1: false,
    })
    : http2.createServer();
  server.on('stream', onStream);
  server.on('sessionError', () => {});
  server.listen(args.port, args.host, () => {
    process.stdout.write(`READY ${server.address().port}\n`);
  });
  const stop = () => {
    server.close();
    setTimeout(() => process.exit(0), 200).unref();
  };
  process.on('SIGTERM', stop);
  process.on('SIGINT', stop);
}

main();
