//! Root-only: HTTPS timelines against the decrypted wire (issue 27).
//!
//! The client (tests/clients/tls_client.py, TLS 1.3) writes its TLS secrets
//! to a key log; a loopback capture with payloads
//! (tests/clients/wire_capture.py --payload, kernel receive stamps) is
//! decrypted by tests/clients/tls_wire.py into, per request, when the record
//! that carried its first byte reached the host and when the record with the
//! first SSE event did, and per connection the ClientHello's and the client
//! Finished's arrival. The agent's TTFT, request start and
//! `tls_handshake_ms` are held to those, first requests of a connection
//! (the ones that follow a handshake) and later ones apart, for servers
//! whose OpenSSL sits behind a memory BIO (node's TLSWrap, Python asyncio's
//! `MemoryBIO` under uvicorn) or a socket BIO (nginx), over HTTP/1.1 and
//! HTTP/2 (node's `http2`, TLS and h2c: the first streams' HEADERS share a
//! read with the client preface), with 4 and 32 concurrent connections.
//!
//! Run (as root; CI does):
//!   cargo test -p tokentrace --test ebpf_tls_wire -- --test-threads=1 --nocapture

use tokentrace_testkit as common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::nginx::{tls_proxy_block, Nginx};
use common::tls::TlsDir;
use common::tls_wire::{wire_requests, WireRequest};
use common::wire::Capture;
use common::*;
use serde_json::Value;

/// The bounds, per request, agent vs wire.
const TTFT_P99_MS: f64 = 0.5;
const NEVER_LONGER_MS: f64 = 0.1;
const HANDSHAKE_MS: f64 = 0.5;

/// One client run: `connections` keep-alive connections, `requests` on each.
struct Load {
    connections: usize,
    requests: usize,
}

const LOADS: [Load; 2] = [
    Load {
        connections: 4,
        requests: 3,
    },
    Load {
        connections: 32,
        requests: 2,
    },
];

/// tests/clients/tls_client.py against `port`; its JSON lines.
fn run_tls_client(port: u16, load: &Load, prefix: &str, keylog: &Path) -> Vec<Value> {
    let out = Command::new(python())
        .arg(repo_root().join("tests/clients/tls_client.py"))
        .args(["--port", &port.to_string()])
        .args(["--connections", &load.connections.to_string()])
        .args(["--requests", &load.requests.to_string()])
        .args(["--rid-prefix", prefix])
        .arg("--keylog")
        .arg(keylog)
        .output()
        .unwrap_or_else(|e| panic!("cannot run tls_client.py: {e}"));
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert!(
        out.status.success(),
        "tls_client.py failed ({}): {}\n{}",
        out.status,
        lines
            .iter()
            .filter(|v| !v["error"].is_null())
            .map(Value::to_string)
            .collect::<Vec<_>>()
            .join("\n"),
        String::from_utf8_lossy(&out.stderr)
    );
    lines
}

fn ms(a: u64, b: u64) -> f64 {
    (a as f64 - b as f64) / 1e6
}

/// What one load showed, kept apart for first and later requests.
struct Verdict {
    first: Dist,
    later: Dist,
    start: Dist,
    handshake: Dist,
    failures: Vec<String>,
}

impl Verdict {
    fn new() -> Self {
        Verdict {
            first: Dist::new("first requests: agent TTFT - wire TTFT"),
            later: Dist::new("later requests: agent TTFT - wire TTFT"),
            start: Dist::new("request_start - wire arrival of its record"),
            handshake: Dist::new("tls_handshake_ms - wire ClientHello..Finished"),
            failures: Vec::new(),
        }
    }

    /// Holds an agent line to its wire request. `first`: it came with the
    /// connection's first bytes after the handshake (HTTP/1.1: the first
    /// request; HTTP/2: the first streams, sent with the preface); `tls`:
    /// its handshake is held to the wire too.
    fn judge(&mut self, w: &WireRequest, a: Option<&Value>, first: bool, tls: bool) {
        let rid = w
            .rid
            .clone()
            .unwrap_or_else(|| format!("port {} stream {}", w.client_port, w.index));
        let Some(a) = a else {
            self.failures
                .push(format!("{rid}: not reported by the agent"));
            return;
        };
        let Some(ev) = w.t_first_event else {
            self.failures
                .push(format!("{rid}: no SSE event on the wire"));
            return;
        };
        let wire_ttft = ms(ev, w.t_request);
        let (Some(ttft), Some(start)) = (
            a.get("ttft_ms").and_then(Value::as_f64),
            a.get("request_start_ns").and_then(Value::as_u64),
        ) else {
            self.failures.push(format!("{rid}: no ttft_ms: {a}"));
            return;
        };
        let d = ttft - wire_ttft;
        if d > NEVER_LONGER_MS {
            self.failures.push(format!(
                "{rid} (request {} of its connection): agent TTFT {ttft:.3} ms > wire {wire_ttft:.3} ms + {NEVER_LONGER_MS} (socket_wait_ms {})",
                w.index, a["socket_wait_ms"]
            ));
        }
        if first {
            self.first.push(d);
        } else {
            self.later.push(d);
        }
        self.start.push(ms(start, w.t_request));
        for k in ["peer_addr", "local_addr", "socket_wait_ms"] {
            if a[k].is_null() {
                self.failures.push(format!("{rid}: {k} is null: {a}"));
            }
        }
        if first && tls && (w.index == 0 || w.index == 1) {
            let (Some(h), Some(f)) = (w.t_hello, w.t_finished) else {
                self.failures
                    .push(format!("{rid}: no handshake on the wire"));
                return;
            };
            match a.get("tls_handshake_ms").and_then(Value::as_f64) {
                Some(got) => self.handshake.push(got - ms(f, h)),
                None => self.failures.push(format!(
                    "{rid}: first request without tls_handshake_ms: {a}"
                )),
            }
        }
    }

    /// `tls`: the handshakes are judged too.
    fn check(self, title: &str, tls: bool) {
        for d in [&self.first, &self.later, &self.start, &self.handshake] {
            eprintln!("[test] {title}: {}", d.summary());
        }
        assert!(
            self.failures.is_empty(),
            "{title}: {} failures:\n{}",
            self.failures.len(),
            self.failures.join("\n")
        );
        let p99 = |d: &Dist| d.pct(99.0).abs().max(d.pct(1.0).abs());
        for d in [&self.first, &self.later] {
            assert!(d.pct(50.0).is_finite(), "{title}: nothing measured");
            // Agent TTFT shorter than the wire's: the agent dates an emit by
            // when the server handed its record to the kernel (a socket-BIO
            // SSL_write's first socket write; for a memory BIO, node, the
            // event loop's first socket write after the SSL_write, a lower
            // bound when earlier records were still queued). Bytes the
            // kernel sends later (a writer preempted inside its write, a
            // segment Nagle holds) reach the wire later: under `stress-ng
            // --cpu 1`, one nginx response of 8 left 1.7 ms after its write,
            // and node h2 flushed 3 first streams of one connection 0.58 ms
            // after their records were written (before both fixes: 5.9 ms).
            // Up to 2 % of the requests (at least one flush: the streams it
            // carried have one delta) may be early by more than the bound;
            // each is printed. Late (agent > wire + 0.1 ms) is never
            // allowed (judged above).
            let early: Vec<f64> =
                d.xs.iter()
                    .copied()
                    .filter(|&x| x <= -TTFT_P99_MS)
                    .collect();
            let mut flushes = early.clone();
            flushes.sort_by(f64::total_cmp);
            flushes.dedup_by(|a, b| (*a - *b).abs() < 0.001);
            let allowed = (d.xs.len() / 50).max(1);
            if !early.is_empty() {
                eprintln!(
                    "[test] {title}: {} request(s) with agent TTFT shorter than the wire's by more than {TTFT_P99_MS} ms (allowed {allowed} flushes): {early:?}",
                    early.len()
                );
            }
            let rest = Dist {
                name: d.name.clone(),
                xs: d.xs.iter().copied().filter(|&x| x > -TTFT_P99_MS).collect(),
            };
            assert!(
                flushes.len() <= allowed && p99(&rest) < TTFT_P99_MS,
                "{title}: |agent - wire| p99 {:.3} ms >= {TTFT_P99_MS} ({} early past it in {} flushes, {allowed} allowed): {}",
                p99(d),
                early.len(),
                flushes.len(),
                d.summary()
            );
        }
        assert!(
            !tls || p99(&self.handshake) < HANDSHAKE_MS,
            "{title}: tls_handshake_ms off the wire: {}",
            self.handshake.summary()
        );
    }
}

/// Runs every load against a TLS server on `port` traced by `agent`,
/// judging the agent lines `mine` selects.
fn run_loads(title: &str, port: u16, agent: &mut Agent, mine: impl Fn(&Value) -> bool) {
    for (n, load) in LOADS.iter().enumerate() {
        let title = format!("{title}, {} connections", load.connections);
        let keylog = std::env::temp_dir().join(format!(
            "tokentrace-keylog-{}-{}",
            std::process::id(),
            mono_now_ns()
        ));
        let capture = Capture::start_with_payload(port);
        let prefix = format!("w{n}-");
        let client = run_tls_client(port, load, &prefix, &keylog);
        let rids: std::collections::BTreeSet<String> =
            client.iter().filter_map(|c| str_field(c, "rid")).collect();
        // every rid on a line of the judged process (nginx's upstream
        // reports the forwarded X-Request-Id too, earlier than nginx)
        agent.wait_until(Duration::from_secs(30), |lines| {
            let seen: std::collections::BTreeSet<String> = lines
                .iter()
                .filter(|l| mine(&l.v))
                .filter_map(|l| str_field(&l.v, "request_id"))
                .collect();
            rids.is_subset(&seen)
        });
        let wire = wire_requests(capture, port, Some(&keylog));
        let _ = std::fs::remove_file(&keylog);
        let lines: BTreeMap<String, Value> = agent
            .values()
            .into_iter()
            .filter(|v| mine(v))
            .filter_map(|v| Some((str_field(&v, "request_id")?, v)))
            .collect();
        let mut verdict = Verdict::new();
        let mut seen = 0;
        for w in wire
            .iter()
            .filter(|w| w.rid.as_deref().is_some_and(|r| r.starts_with(&prefix)))
        {
            seen += 1;
            verdict.judge(
                w,
                lines.get(w.rid.as_deref().unwrap_or_default()),
                w.index == 0,
                true,
            );
        }
        if seen != rids.len() {
            verdict.failures.push(format!(
                "the wire shows {seen} of the client's {} requests",
                rids.len()
            ));
        }
        verdict.check(&title, true);
    }
}

/// HTTP/2 loads: `connections` sessions (one h2_client.js each) of
/// `requests` streams, `concurrency` at a time.
struct H2Load {
    connections: usize,
    requests: usize,
    concurrency: usize,
}

const H2_LOADS: [H2Load; 2] = [
    H2Load {
        connections: 4,
        requests: 6,
        concurrency: 3,
    },
    H2Load {
        connections: 32,
        requests: 4,
        concurrency: 2,
    },
];

/// Every H2 load against tests/servers/h2_sse_server.js on `port` (TLS when
/// `tls`), judged per stream against the capture (TLS: decrypted with the
/// clients' key log). The first `concurrency` streams of a session leave
/// with the client preface: they are its first requests.
fn run_h2_loads(title: &str, port: u16, tls: bool, agent: &mut Agent) {
    for (n, load) in H2_LOADS.iter().enumerate() {
        let title = format!("{title}, {} connections", load.connections);
        let keylog = std::env::temp_dir().join(format!(
            "tokentrace-keylog-h2-{}-{}",
            std::process::id(),
            mono_now_ns()
        ));
        let capture = Capture::start_with_payload(port);
        let mut clients = Vec::new();
        for c in 0..load.connections {
            let mut cmd = Command::new("node");
            cmd.arg(repo_root().join("tests/clients/h2_client.js"))
                .args(["--host", "127.0.0.1", "--port", &port.to_string()])
                .args(["--requests", &load.requests.to_string()])
                .args(["--concurrency", &load.concurrency.to_string()])
                .args(["--tokens", "4", "--token-delay-ms", "5", "--ttft-ms", "10"])
                .args(["--rid-prefix", &format!("h{n}-{c}-")]);
            if tls {
                cmd.arg("--tls").arg("--keylog").arg(&keylog);
            }
            let child = cmd
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("cannot run h2_client.js: {e}"));
            clients.push(child);
        }
        let mut rids = std::collections::BTreeSet::new();
        for child in clients {
            let out = child
                .wait_with_output()
                .unwrap_or_else(|e| panic!("h2_client.js: {e}"));
            assert!(out.status.success(), "h2_client.js failed: {out:?}");
            for v in String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            {
                assert!(v["error"].is_null(), "{title}: a stream failed: {v}");
                rids.extend(str_field(&v, "request_id"));
            }
        }
        agent.wait_for_values("request_id", &rids, Duration::from_secs(30));
        let wire = wire_requests(capture, port, tls.then_some(keylog.as_path()));
        let _ = std::fs::remove_file(&keylog);
        let lines: BTreeMap<(String, u64), Value> = agent
            .values()
            .into_iter()
            .filter(|v| {
                str_field(v, "request_id").is_some_and(|r| r.starts_with(&format!("h{n}-")))
            })
            .filter_map(|v| {
                let peer = str_field(&v, "peer_addr").unwrap_or_default();
                let port = peer.rsplit(':').next()?.to_string();
                Some(((port, v.get("stream_id")?.as_u64()?), v))
            })
            .collect();
        let mut verdict = Verdict::new();
        if wire.len() != rids.len() {
            verdict.failures.push(format!(
                "the wire shows {} streams, the clients ran {}",
                wire.len(),
                rids.len()
            ));
        }
        for w in &wire {
            let first = w.index < 2 * load.concurrency as u64;
            let a = lines.get(&(w.client_port.to_string(), w.index));
            verdict.judge(w, a, first, tls);
        }
        verdict.check(&title, tls);
    }
}

/// Node's `http2` over TLS (ALPN h2): first streams come in the record
/// that carries the client preface and SETTINGS.
#[test]
fn root_tls_wire_node_h2() {
    require_root("root_tls_wire_node_h2");
    let tls = TlsDir::new("wire-h2");
    let server = common::h2::start_node_server(Some((tls.cert(), tls.key())));
    let mut agent = start_agent(&Agent::for_pids(&[server.pid()]));
    run_h2_loads("node h2 over TLS", server.port, true, &mut agent);
    stop_quietly(&mut agent);
}

/// h2c: the first streams' HEADERS share a read with the client preface;
/// each is dated by the segment that carried it (no `socket_wait_ms: null`).
#[test]
fn root_wire_node_h2c_first_streams() {
    require_root("root_wire_node_h2c_first_streams");
    let server = common::h2::start_node_server(None);
    let mut agent = start_agent(&Agent::for_pids(&[server.pid()]));
    run_h2_loads("node h2c", server.port, false, &mut agent);
    stop_quietly(&mut agent);
}

fn node_https(tls: &TlsDir) -> (Proc, u16) {
    start_ready(
        "https_sse_server.js",
        Command::new("node")
            .arg(repo_root().join("tests/servers/https_sse_server.js"))
            .args([
                "--port",
                "0",
                "--tls-cert",
                tls.cert(),
                "--tls-key",
                tls.key(),
            ]),
        "apt-get install nodejs (`cargo xtask deps` does)",
    )
}

/// Stops the agent: a clean exit, and its summary counts no TLS request
/// left untied and no record walk given up.
fn stop_quietly(agent: &mut Agent) {
    let st = agent.stop();
    assert!(
        st.is_some_and(|s| s.success()),
        "the agent did not exit cleanly: {st:?}\n{}",
        agent.proc.stderr.tail(30)
    );
    for (what, pointer) in [
        (
            "untied TLS requests",
            "/tokentrace_summary/stitch/tls_untied",
        ),
        ("TLS walks given up", "/tokentrace_summary/tls_walks_lost"),
        ("TLS records unqueued", "/tokentrace_summary/tls_queue_full"),
    ] {
        let n = agent.summary_part(pointer);
        eprintln!("[test] {what}: {n}");
        assert_eq!(n, 0, "{what}: {n}");
    }
}

/// Node's `https` (OpenSSL in the executable, TLSWrap's memory BIO: the
/// ciphertext reaches OpenSSL from node's buffers, not from a socket).
#[test]
fn root_tls_wire_node_https_memory_bio() {
    require_root("root_tls_wire_node_https_memory_bio");
    let tls = TlsDir::new("wire-node");
    let (server, port) = node_https(&tls);
    let mut agent = start_agent(&Agent::for_pids(&[server.pid()]));
    run_loads("node https", port, &mut agent, |_| true);
    stop_quietly(&mut agent);
}

/// uvicorn over asyncio's `ssl` (Python's MemoryBIO under an event loop).
#[test]
fn root_tls_wire_uvicorn() {
    require_root("root_tls_wire_uvicorn");
    let tls = TlsDir::new("wire-uvicorn");
    let server = start_server(
        ServerKind::FastApi,
        &["--ssl-keyfile", tls.key(), "--ssl-certfile", tls.cert()],
    );
    let mut agent = start_agent(&Agent::for_pids(&[server.pid()]));
    run_loads("uvicorn https", server.port, &mut agent, |_| true);
    stop_quietly(&mut agent);
}

/// nginx terminating TLS (socket BIO) in front of a plaintext server, both
/// traced; nginx's own lines (`tls: true`) are held to the wire.
#[test]
fn root_tls_wire_nginx_socket_bio() {
    require_root("root_tls_wire_nginx_socket_bio");
    let tls = TlsDir::new("wire-nginx");
    let upstream = start_server(ServerKind::Stdlib, &[]);
    let nginx = Nginx::start(&tls.dir, &tls_proxy_block(&tls, upstream.port));
    let mut agent = start_agent(&Agent::for_pids(&[nginx.worker, upstream.pid()]));
    run_loads("nginx https", nginx.port, &mut agent, |v| v["tls"] == true);
    stop_quietly(&mut agent);
}
