// What the node SSE test servers (h2_sse_server.js, https_sse_server.js)
// share: their command line and how they read a request's JSON body.
'use strict';

// --port P [--host H] [--tls-cert C --tls-key K]
function parseArgs(argv) {
  const out = { host: '127.0.0.1', port: 8443, tlsCert: null, tlsKey: null };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    const next = () => {
      if (i + 1 >= argv.length) throw new Error(`${a} needs a value`);
      return argv[++i];
    };
    if (a === '--host') out.host = next();
    else if (a === '--port') out.port = Number(next());
    else if (a === '--tls-cert') out.tlsCert = next();
    else if (a === '--tls-key') out.tlsKey = next();
    else throw new Error(`unknown argument ${a}`);
  }
  if (!Number.isInteger(out.port) || out.port < 0 || out.port > 65535) {
    throw new Error('--port must be 0..65535');
  }
  if ((out.tlsCert === null) !== (out.tlsKey === null)) {
    throw new Error('--tls-cert and --tls-key go together');
  }
  return out;
}

function numberOr(v, d) {
  const n = Number(v);
  return Number.isFinite(n) && n >= 0 ? n : d;
}

// Collects a readable's bytes and calls done(object); a missing or bad
// body is {} (the server streams its defaults).
function readJsonBody(readable, done) {
  const parts = [];
  readable.on('data', (d) => parts.push(d));
  readable.on('end', () => {
    let body = {};
    try {
      const v = JSON.parse(Buffer.concat(parts).toString() || '{}');
      if (v && typeof v === 'object') body = v;
    } catch (_) {
      // a bad body streams the defaults
    }
    done(body);
  });
}

module.exports = { parseArgs, numberOr, readJsonBody };
