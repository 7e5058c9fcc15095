#!/usr/bin/env node
// OpenAI-style SSE streaming over HTTPS/1.1 with node's built-in `https`
// module: OpenSSL inside the node executable, on node's own memory BIO
// (TLSWrap), the shape of issue 27's first measurements.
//
// Run:  node tests/servers/https_sse_server.js --port P --tls-cert C --tls-key K
//                                              [--host 127.0.0.1]
//       (--port 0 picks a free port). Prints `READY <port>` once listening.
//
// POST /v1/chat/completions with a JSON body
//   {"max_tokens": N (12), "token_delay_ms": D (15), "ttft_ms": F (40)}
// answers 200, text/event-stream (chunked, keep-alive), then N
// chat.completion.chunk events D ms apart (the first F ms after the
// request), one usage event and `data: [DONE]`: N+1 chunks, as
// tests/servers/h2_sse_server.js. Every event is one res.write. The client's
// x-request-id is echoed. SIGTERM/SIGINT close the server.
'use strict';

const https = require('https');
const fs = require('fs');
const crypto = require('crypto');
const { parseArgs, numberOr, readJsonBody } = require('./sse_args.js');

function stream(req, res, body) {
  const n = Math.floor(numberOr(body.max_tokens, 12));
  const delay = numberOr(body.token_delay_ms, 15);
  const ttft = numberOr(body.ttft_ms, 40);
  const id = 'chatcmpl-' + crypto.randomBytes(12).toString('hex');
  const headers = { 'content-type': 'text/event-stream', 'cache-control': 'no-cache' };
  const rid = req.headers['x-request-id'];
  if (typeof rid === 'string') headers['x-request-id'] = rid;
  res.writeHead(200, headers);
  let i = 0;
  const chunk = (choices, extra) => 'data: ' + JSON.stringify(Object.assign({
    id, object: 'chat.completion.chunk', model: 'test-model', choices,
  }, extra || {})) + '\n\n';
  const step = () => {
    if (res.destroyed) return;
    if (i < n) {
      res.write(chunk([{ index: 0, delta: { content: ' tok' + i }, finish_reason: null }]));
      i += 1;
      setTimeout(step, delay);
    } else {
      res.write(chunk([], { usage: { prompt_tokens: 12, completion_tokens: n, total_tokens: 12 + n } }));
      res.end('data: [DONE]\n\n');
    }
  };
  setTimeout(step, ttft);
}

function onRequest(req, res) {
  const path = (req.url || '').split('?')[0];
  if (req.method !== 'POST' || path !== '/v1/chat/completions') {
    res.writeHead(404, { 'content-type': 'application/json' });
    res.end('{"error":"not found"}');
    return;
  }
  readJsonBody(req, (body) => stream(req, res, body));
}

function main() {
  let args;
  try {
    args = parseArgs(process.argv.slice(2));
    if (args.tlsCert === null) throw new Error('--tls-cert and --tls-key are required');
  } catch (e) {
    process.stderr.write(`https_sse_server.js: ${e.message}\n`);
    process.exit(2);
  }
  const server = https.createServer({
    cert: fs.readFileSync(args.tlsCert),
    key: fs.readFileSync(args.tlsKey),
  }, onRequest);
  server.keepAliveTimeout = 30000;
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
