#!/usr/bin/env node
// Measuring HTTP/2 SSE client (node's built-in `http2`) for the tokentrace
// integration tests: every request is a stream on ONE session (= one
// HTTP/2 connection).
//
//   node tests/clients/h2_client.js --port P [--host 127.0.0.1] [--tls]
//       [--requests N] [--concurrency C] [--tokens T] [--tokens-step S]
//       [--token-delay-ms D] [--ttft-ms F] [--cancel-after K]
//       [--rid-prefix X] [--pause-after N] [--path /v1/chat/completions]
//       [--timeout-ms MS] [--keylog FILE]
//
// C workers share the session; request j goes to worker j % C, each worker
// sends its requests one after another, and all workers start once the
// session is connected. Request j: POST PATH?rid=<prefix><j> with
// x-request-id <prefix><j> and the body {"stream": true, "max_tokens":
// T + j*S, "token_delay_ms": D, "ttft_ms": F}. --tls: h2 over TLS (ALPN h2,
// no certificate checks: the test servers use a throw-away self-signed one).
// --keylog FILE: append the session's TLS secrets to FILE (NSS key log
// format, as SSLKEYLOGFILE) for tests/clients/tls_wire.py.
// --pause-after N (with --concurrency 1): after the first N requests print
// {"paused": N} and wait for a line on stdin, then go on on the same
// session (for an agent started mid-connection). --cancel-after K: reset
// each stream (RST_STREAM CANCEL) once K events arrived.
//
// Times are process.hrtime.bigint() (CLOCK_MONOTONIC, the clock of
// bpf_ktime_get_ns): t_send_ns right before session.request() (the HEADERS
// leave later, in the same turn of the event loop), then the arrival of each
// DATA chunk. A chunk is an SSE event with a data: field (`data: [DONE]`
// excluded), arrival = the DATA that brought its terminating blank line.
//
// One JSON line per request on stdout, in completion order, with the fields
// of tests/clients/stream_client.py the tests read:
//   {"path", "request_id", "status", "response_id", "chunks", "t_send_ns",
//    "chunk_arrival_ns", "server_write_ns" ("x_mono_ns" of each event),
//    "server_req_ns" (response header x-req-mono-ns), "ttft_ns", "e2e_ns",
//    "aborted", "cancelled", "error", "worker", "seq", "body_kind",
//    "done_seen", "client_addr", "expected_chunks"}
// A failed stream is reported (error set); the client exits 0.
'use strict';

const http2 = require('http2');
const readline = require('readline');

function parseArgs(argv) {
  const o = {
    host: '127.0.0.1', port: null, tls: false, requests: 1, concurrency: 1,
    tokens: 12, tokensStep: 0, tokenDelayMs: 15, ttftMs: 40, cancelAfter: null,
    ridPrefix: 'h2-', pauseAfter: null, path: '/v1/chat/completions', timeoutMs: 60000,
    keylog: null,
  };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    const next = () => {
      if (i + 1 >= argv.length) throw new Error(`${a} needs a value`);
      return argv[++i];
    };
    const num = () => {
      const v = Number(next());
      if (!Number.isFinite(v) || v < 0) throw new Error(`${a} needs a number >= 0`);
      return v;
    };
    if (a === '--host') o.host = next();
    else if (a === '--port') o.port = num();
    else if (a === '--tls') o.tls = true;
    else if (a === '--requests') o.requests = num();
    else if (a === '--concurrency') o.concurrency = num();
    else if (a === '--tokens') o.tokens = num();
    else if (a === '--tokens-step') o.tokensStep = num();
    else if (a === '--token-delay-ms') o.tokenDelayMs = num();
    else if (a === '--ttft-ms') o.ttftMs = num();
    else if (a === '--cancel-after') o.cancelAfter = num();
    else if (a === '--rid-prefix') o.ridPrefix = next();
    else if (a === '--pause-after') o.pauseAfter = num();
    else if (a === '--path') o.path = next();
    else if (a === '--timeout-ms') o.timeoutMs = num();
    else if (a === '--keylog') o.keylog = next();
    else throw new Error(`unknown argument ${a}`);
  }
  if (o.port === null) throw new Error('--port is required');
  if (o.concurrency < 1) throw new Error('--concurrency must be at least 1');
  if (o.pauseAfter !== null && o.concurrency !== 1) throw new Error('--pause-after needs --concurrency 1');
  if (o.cancelAfter !== null && o.cancelAfter < 1) throw new Error('--cancel-after must be at least 1');
  return o;
}

const mono = () => process.hrtime.bigint();
const emit = (obj) => process.stdout.write(JSON.stringify(obj) + '\n');

function oneRequest(session, o, j, worker, seq) {
  return new Promise((resolve) => {
    const rid = `${o.ridPrefix}${j}`;
    const path = `${o.path}${o.path.includes('?') ? '&' : '?'}rid=${rid}`;
    const tokens = o.tokens + j * o.tokensStep;
    const rec = {
      path, request_id: rid, status: null, response_id: null, chunks: 0,
      chunk_arrival_ns: [], server_write_ns: [], server_req_ns: null,
      ttft_ns: null, e2e_ns: null, aborted: false, cancelled: false, error: null,
      worker, seq, body_kind: null, done_seen: false, expected_chunks: tokens + 1,
      client_addr: session.socket && session.socket.localAddress
        ? `${session.socket.localAddress}:${session.socket.localPort}` : null,
    };
    const body = JSON.stringify({
      model: 'test-model', stream: true, max_tokens: tokens,
      token_delay_ms: o.tokenDelayMs, ttft_ms: o.ttftMs,
      messages: [{ role: 'user', content: 'hi' }],
    });
    let pending = '';
    let finished = false;
    const t0 = mono();
    rec.t_send_ns = t0.toString();
    const req = session.request({
      ':method': 'POST', ':path': path, 'content-type': 'application/json',
      accept: 'text/event-stream', 'x-request-id': rid,
    });
    const finish = (err) => {
      if (finished) return;
      finished = true;
      const t = mono();
      rec.e2e_ns = Number(t - t0);
      if (rec.chunk_arrival_ns.length > 0) {
        rec.ttft_ns = Number(BigInt(rec.chunk_arrival_ns[0]) - t0);
      }
      rec.chunks = rec.chunk_arrival_ns.length;
      if (err && !rec.cancelled) {
        rec.aborted = true;
        rec.error = String(err);
      }
      // arrival times as numbers (they fit: < 2^53 ns is 104 days of uptime)
      rec.chunk_arrival_ns = rec.chunk_arrival_ns.map(Number);
      rec.t_send_ns = Number(rec.t_send_ns);
      resolve(rec);
    };
    const timer = setTimeout(() => {
      req.close(http2.constants.NGHTTP2_CANCEL);
      finish(new Error(`timeout after ${o.timeoutMs} ms`));
    }, o.timeoutMs);
    req.on('response', (headers) => {
      rec.status = headers[':status'];
      const ct = String(headers['content-type'] || '');
      rec.body_kind = ct.startsWith('text/event-stream') ? 'sse' : 'other';
      const s = headers['x-req-mono-ns'];
      if (typeof s === 'string' && /^\d+$/.test(s)) rec.server_req_ns = Number(s);
    });
    req.setEncoding('utf8');
    req.on('data', (d) => {
      const t = mono();
      pending += d;
      let k;
      while ((k = pending.indexOf('\n\n')) >= 0) {
        const ev = pending.slice(0, k);
        pending = pending.slice(k + 2);
        const data = ev.split('\n').filter((l) => l.startsWith('data:'))
          .map((l) => l.slice(5).replace(/^ /, '')).join('\n');
        if (!ev.split('\n').some((l) => l.startsWith('data:'))) continue;
        if (data === '[DONE]') {
          rec.done_seen = true;
          continue;
        }
        rec.chunk_arrival_ns.push(t.toString());
        let stamp = null;
        try {
          const v = JSON.parse(data);
          if (rec.response_id === null && typeof v.id === 'string') rec.response_id = v.id;
          // node's server sends the stamp as a string (a BigInt), Python's as a number
          if (typeof v.x_mono_ns === 'number' && Number.isSafeInteger(v.x_mono_ns)) stamp = v.x_mono_ns;
          else if (typeof v.x_mono_ns === 'string' && /^\d+$/.test(v.x_mono_ns)) stamp = Number(v.x_mono_ns);
        } catch (_) {
          // not JSON: counted, no stamp
        }
        rec.server_write_ns.push(stamp);
        if (o.cancelAfter !== null && rec.chunk_arrival_ns.length >= o.cancelAfter && !rec.cancelled) {
          rec.cancelled = true;
          clearTimeout(timer);
          req.close(http2.constants.NGHTTP2_CANCEL);
          finish(null);
          return;
        }
      }
    });
    req.on('end', () => { clearTimeout(timer); finish(null); });
    req.on('error', (e) => { clearTimeout(timer); finish(e); });
    req.on('close', () => {
      clearTimeout(timer);
      if (!finished) finish(req.rstCode ? new Error(`stream closed, code ${req.rstCode}`) : null);
    });
    req.end(body);
  });
}

function waitLine() {
  return new Promise((resolve) => {
    const rl = readline.createInterface({ input: process.stdin });
    rl.once('line', () => { rl.close(); resolve(); });
    rl.once('close', resolve);
  });
}

async function main() {
  let o;
  try {
    o = parseArgs(process.argv.slice(2));
  } catch (e) {
    process.stderr.write(`h2_client.js: ${e.message}\n`);
    process.exit(2);
  }
  const scheme = o.tls ? 'https' : 'http';
  const options = o.tls ? { rejectUnauthorized: false } : {};
  if (o.tls && o.keylog !== null) {
    // the session's socket cannot take listeners once it is the session's
    options.createConnection = () => {
      const s = require('tls').connect({
        host: o.host, port: o.port, ALPNProtocols: ['h2'], rejectUnauthorized: false,
      });
      s.on('keylog', (line) => require('fs').appendFileSync(o.keylog, line));
      return s;
    };
  }
  const session = http2.connect(`${scheme}://${o.host}:${o.port}`, options);
  session.on('error', (e) => process.stderr.write(`h2_client.js: session error: ${e}\n`));
  await new Promise((resolve, reject) => {
    session.once('connect', resolve);
    session.once('error', reject);
  });
  const workers = Math.min(o.concurrency, Math.max(o.requests, 1));
  const run = async (w) => {
    let seq = 0;
    for (let j = w; j < o.requests; j += workers) {
      if (o.pauseAfter !== null && j === o.pauseAfter) {
        emit({ paused: j });
        await waitLine();
      }
      emit(await oneRequest(session, o, j, w, seq));
      seq += 1;
    }
  };
  await Promise.all(Array.from({ length: workers }, (_, w) => run(w)));
  session.close();
}

main().catch((e) => {
  process.stderr.write(`h2_client.js: ${e.stack || e}\n`);
  process.exit(1);
});
