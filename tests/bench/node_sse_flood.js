#!/usr/bin/env node
// Load generator for `cargo xtask bench --only kernel`: issue 25's node SSE
// flood, a fixed amount of work rather than timed rounds.
//
//   node tests/bench/node_sse_flood.js server [--port P]
//       prints READY <port>. GET /v1/chat/completions?tokens=N answers 200
//       text/event-stream (chunked, keep-alive) with N OpenAI-style chunk
//       events, one usage event and `data: [DONE]`. Each event is one
//       res.write in its own event-loop turn (setImmediate), so node writes
//       each chunk with one writev (chunk size, CRLF, event, CRLF): what a
//       node or express streaming endpoint does with a token per turn.
//   node tests/bench/node_sse_flood.js client --port P [--connections C]
//                                             [--requests R] [--tokens N]
//       R requests (400) of N tokens (200) over C keep-alive connections (8),
//       C at a time; fails unless every response is 200 and ends whole.
//       Prints one JSON line {"requests", "chunks", "seconds", "chunks_per_s"}
//       (chunks: the server's res.write calls, N + 2 per request).
//
// Node's built-in `http` only; loopback only.
'use strict';

const http = require('http');

const EVENT = 'data: ' + JSON.stringify({
  id: 'chatcmpl-flood', object: 'chat.completion.chunk', created: 1700000000, model: 'flood',
  choices: [{ index: 0, delta: { content: ' token' }, finish_reason: null }],
}) + '\n\n';

function options(argv, defaults) {
  const out = Object.assign({}, defaults);
  for (let i = 0; i < argv.length; i += 2) {
    const key = argv[i].replace(/^--/, '');
    if (!(key in out) || i + 1 >= argv.length) throw new Error(`bad argument ${argv[i]}`);
    out[key] = Number(argv[i + 1]);
    if (!Number.isInteger(out[key]) || out[key] < 0) throw new Error(`--${key} needs a whole number`);
  }
  return out;
}

function stream(res, tokens) {
  res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-cache' });
  let i = 0;
  const step = () => {
    if (res.destroyed) return;
    if (i < tokens) {
      res.write(EVENT);
      i += 1;
      setImmediate(step);
    } else {
      res.write('data: ' + JSON.stringify({
        id: 'chatcmpl-flood', object: 'chat.completion.chunk', choices: [],
        usage: { prompt_tokens: 12, completion_tokens: tokens, total_tokens: 12 + tokens },
      }) + '\n\n');
      setImmediate(() => res.end('data: [DONE]\n\n'));
    }
  };
  setImmediate(step);
}

function server(opts) {
  const srv = http.createServer((req, res) => {
    const url = new URL(req.url || '/', 'http://flood');
    if (url.pathname !== '/v1/chat/completions') {
      res.writeHead(404).end();
      return;
    }
    req.resume();
    req.on('end', () => stream(res, Math.floor(Number(url.searchParams.get('tokens')) || 0)));
  });
  srv.keepAliveTimeout = 60000;
  srv.listen(opts.port, '127.0.0.1', () => process.stdout.write(`READY ${srv.address().port}\n`));
  const stop = () => srv.close(() => process.exit(0));
  process.on('SIGTERM', stop);
  process.on('SIGINT', stop);
}

function client(opts) {
  const agent = new http.Agent({ keepAlive: true, maxSockets: opts.connections });
  const started = process.hrtime.bigint();
  let issued = 0;
  let done = 0;
  const one = () => {
    if (issued >= opts.requests) return;
    issued += 1;
    const req = http.get({
      host: '127.0.0.1', port: opts.port, agent,
      path: `/v1/chat/completions?tokens=${opts.tokens}`,
    }, (res) => {
      if (res.statusCode !== 200) fail(`status ${res.statusCode}`);
      res.on('data', () => {});
      res.on('aborted', () => fail('response aborted'));
      res.on('end', () => {
        done += 1;
        if (done === opts.requests) finish();
        else one();
      });
    });
    req.on('error', (e) => fail(e.message));
  };
  const finish = () => {
    const seconds = Number(process.hrtime.bigint() - started) / 1e9;
    const chunks = opts.requests * (opts.tokens + 2);
    process.stdout.write(JSON.stringify({
      requests: done, chunks, seconds, chunks_per_s: chunks / seconds,
    }) + '\n');
    agent.destroy();
  };
  for (let c = 0; c < opts.connections; c++) one();
}

function fail(why) {
  process.stderr.write(`node_sse_flood.js: ${why}\n`);
  process.exit(1);
}

function main() {
  const [mode, ...rest] = process.argv.slice(2);
  try {
    if (mode === 'server') server(options(rest, { port: 0 }));
    else if (mode === 'client') {
      client(options(rest, { port: 0, connections: 8, requests: 400, tokens: 200 }));
    } else throw new Error('usage: node_sse_flood.js server|client [--option N ...]');
  } catch (e) {
    fail(e.message);
  }
}

main();
