//! Root-only: request ingress from the wire, setup waits and who ended a
//! request, against references the machine's load cannot move:
//!
//! * a loopback packet capture (tests/clients/wire_capture.py: AF_PACKET,
//!   kernel receive timestamps) — when the request's first byte and the
//!   first SSE event reached the host;
//! * the server's own CLOCK_MONOTONIC stamps (tests/servers/wire_server.py:
//!   a single-threaded server that serves one connection at a time, so a
//!   burst waits in the kernel: accept queue, then receive queue).
//!
//! Run (as root; CI does):
//!   cargo test -p tokentrace --test ebpf_wire -- --test-threads=1 --nocapture

use tokentrace_testkit as common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::mpsc::Receiver;
use std::thread;
use std::time::{Duration, Instant};

use common::wire::{wire_times, Capture, Packet};
use common::*;
use serde_json::Value;

/// The bounds: per request, agent vs wire, at p99.
const TTFT_P99_MS: f64 = 0.5;
const SOCKET_WAIT_P99_MS: f64 = 0.5;

// ----------------------------------------------------------------- helpers

/// tests/servers/wire_server.py with its per-request JSON stamps.
struct WireServer {
    proc: Proc,
    port: u16,
    lines: Receiver<Value>,
}

impl WireServer {
    fn start(extra: &[&str]) -> Self {
        let StampingServer { proc, port, lines } =
            StampingServer::start("tests/servers/wire_server.py", extra);
        WireServer { proc, port, lines }
    }

    /// Server records by rid, waiting until `n` have arrived.
    fn records(&self, n: usize) -> BTreeMap<String, Value> {
        let mut out = BTreeMap::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        while out.len() < n && Instant::now() < deadline {
            if let Ok(v) = self.lines.recv_timeout(Duration::from_millis(100)) {
                if let Some(rid) = str_field(&v, "rid") {
                    out.insert(rid, v);
                }
            }
        }
        assert_eq!(
            out.len(),
            n,
            "server reported {} of {n} requests",
            out.len()
        );
        out
    }
}

fn run_wire_client(port: u16, args: &[&str]) -> Vec<Value> {
    let out = Command::new(python())
        .arg(repo_root().join("tests/clients/wire_client.py"))
        .args(["--port", &port.to_string()])
        .args(args)
        .output()
        .expect("run wire_client.py");
    assert!(
        out.status.success(),
        "wire_client.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let recs: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    for r in &recs {
        assert!(
            r.get("error").is_none_or(Value::is_null) || args.contains(&"--close-after"),
            "client error: {r}"
        );
    }
    recs
}

fn ms_field(v: &Value, k: &str) -> Option<f64> {
    v.get(k).and_then(Value::as_f64)
}

fn u64_field(v: &Value, k: &str) -> Option<u64> {
    v.get(k).and_then(Value::as_u64)
}

fn ms_between(a: u64, b: u64) -> f64 {
    (a as f64 - b as f64) / 1e6
}

/// The rid of an agent line (`rid=` in its path).
fn rid_of(v: &Value) -> Option<String> {
    let path = str_field(v, "path")?;
    Some(path.split("rid=").nth(1)?.split('&').next()?.to_string())
}

/// Agent lines by rid, once every one of `rids` is in (30 s at most).
fn agent_by_rid(agent: &mut Agent, rids: &[String]) -> BTreeMap<String, Value> {
    agent.wait_until(Duration::from_secs(30), |lines| {
        rids.iter().all(|r| {
            lines
                .iter()
                .any(|l| rid_of(&l.v).as_deref() == Some(r.as_str()))
        })
    });
    agent
        .values()
        .into_iter()
        .filter_map(|v| Some((rid_of(&v)?, v)))
        .collect()
}

struct TlsDir {
    dir: PathBuf,
}

impl TlsDir {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "tokentrace-wire-tls-{}-{}",
            std::process::id(),
            mono_now_ns()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let out = Command::new("openssl")
            .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
            .arg("ec_paramgen_curve:prime256v1")
            .args(["-nodes", "-days", "2", "-subj", "/CN=localhost", "-keyout"])
            .arg(dir.join("key.pem"))
            .arg("-out")
            .arg(dir.join("cert.pem"))
            .output()
            .expect("run the openssl CLI (apt-get install openssl; `cargo xtask deps` does)");
        assert!(out.status.success(), "openssl req failed");
        TlsDir { dir }
    }

    fn args(&self) -> Vec<String> {
        vec![
            "--tls".into(),
            self.dir.join("cert.pem").display().to_string(),
            self.dir.join("key.pem").display().to_string(),
        ]
    }
}

impl Drop for TlsDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

// ------------------------------------------------------------------- tests

/// 64 concurrent streams into a server that serves one connection at a
/// time: each request waits in the kernel (not accepted yet) for up to
/// hundreds of ms. TTFT must count from the request's arrival on the wire,
/// socket_wait_ms must be the wire-to-read delay, accept_wait_ms the time
/// in the accept queue, and request_id the X-Request-Id header.
#[test]
fn burst_into_a_sequential_server_is_timed_from_the_wire() {
    require_root("burst_into_a_sequential_server_is_timed_from_the_wire");
    let server = WireServer::start(&[]);
    // Socket hooks date the accept by the server's first read (no accept()
    // hook): the reference moves from accept()'s return to that read's.
    let accepted_at = if socket_data_hooks() {
        "t_read"
    } else {
        "t_accept"
    };
    let mut agent = start_agent(&Agent::for_pids(&[server.proc.pid()]));
    let capture = Capture::start(server.port);
    let mut clients = Vec::new();
    const ROUNDS: usize = 2;
    const STREAMS: usize = 64;
    for round in 0..ROUNDS {
        let prefix = format!("b{round}-");
        clients.extend(run_wire_client(
            server.port,
            &[
                "--connections",
                &STREAMS.to_string(),
                "--tokens",
                "3",
                "--delay-ms",
                "1",
                "--ttft-ms",
                "1",
                "--rid-prefix",
                &prefix,
                "--request-id-header",
            ],
        ));
    }
    let srv = server.records(ROUNDS * STREAMS);
    let rids: Vec<String> = clients.iter().filter_map(|c| str_field(c, "rid")).collect();
    let lines = agent_by_rid(&mut agent, &rids);
    let packets = capture.finish();
    let stop = agent.stop();

    let mut ttft = Dist::new("agent TTFT - wire TTFT");
    let mut wait = Dist::new("socket_wait - (server read - wire arrival)");
    let mut start = Dist::new("request_start - wire arrival");
    let mut accept = Dist::new(&format!(
        "accept_wait - (server {accepted_at} - client connect)"
    ));
    let mut waited = Dist::new("socket_wait_ms");
    let mut from_read = Dist::new("ttft_from_read - wire TTFT (before: main's TTFT)");
    let mut failures = Vec::new();
    for c in &clients {
        let rid = str_field(c, "rid").expect("rid");
        let Some(a) = lines.get(&rid) else {
            failures.push(format!("{rid}: not reported by the agent"));
            continue;
        };
        let s = &srv[&rid];
        let port = u16::try_from(u64_field(c, "client_port").expect("client port")).expect("port");
        let (Some(w_req), Some(w_ev)) = wire_times(&packets, server.port, port) else {
            failures.push(format!("{rid}: not in the capture"));
            continue;
        };
        let wire_ttft = ms_between(w_ev, w_req);
        let (Some(at), Some(sw), Some(rs), Some(tfr)) = (
            ms_field(a, "ttft_ms"),
            ms_field(a, "socket_wait_ms"),
            u64_field(a, "request_start_ns"),
            ms_field(a, "ttft_from_read_ms"),
        ) else {
            failures.push(format!(
                "{rid}: ttft/socket_wait/request_start missing: {a}"
            ));
            continue;
        };
        ttft.push(at - wire_ttft);
        from_read.push(tfr - wire_ttft);
        start.push(ms_between(rs, w_req));
        waited.push(sw);
        let t_read = u64_field(s, "t_read").expect("server t_read");
        wait.push(sw - ms_between(t_read, w_req));
        if let (Some(aw), Some(t_acc), Some(t_conn)) = (
            ms_field(a, "accept_wait_ms"),
            u64_field(s, accepted_at),
            u64_field(c, "t_connect"),
        ) {
            accept.push(aw - ms_between(t_acc, t_conn));
        } else {
            failures.push(format!("{rid}: no accept_wait_ms on a first request: {a}"));
        }
        let want = format!("req-{rid}");
        if str_field(a, "request_id").as_deref() != Some(want.as_str()) {
            failures.push(format!(
                "{rid}: request_id {:?}, sent {want}",
                a.get("request_id")
            ));
        }
    }
    for d in [&ttft, &wait, &start, &accept, &waited, &from_read] {
        eprintln!("[test] {}", d.summary());
    }
    check_agent_exit_quiet(stop);
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
    let p99 = |d: &Dist| d.pct(99.0).abs().max(d.pct(1.0).abs());
    assert!(
        p99(&ttft) < TTFT_P99_MS,
        "|agent TTFT - wire TTFT| p99 {:.3} ms >= {TTFT_P99_MS} ms: {}",
        p99(&ttft),
        ttft.summary()
    );
    assert!(
        p99(&wait) < SOCKET_WAIT_P99_MS,
        "|socket_wait - wire-to-read| p99 {:.3} ms >= {SOCKET_WAIT_P99_MS} ms: {}",
        p99(&wait),
        wait.summary()
    );
    // The burst really waited in the kernel (else this proves nothing).
    assert!(
        waited.pct(50.0) > 20.0,
        "median socket wait {:.3} ms: the requests did not queue",
        waited.pct(50.0)
    );
    // accept_wait vs the client's connect return and the server's accept
    // return, both stamped in user space just after the syscall: 64 client
    // threads on 2 cores get preempted before their stamp (seen: p99 2 ms,
    // max 13 ms), so only the median is held to 1 ms.
    assert!(
        accept.pct(50.0).abs() < 1.0,
        "accept_wait off: {}",
        accept.summary()
    );
}

/// A server that sleeps 40 ms before each accept, serving one connection
/// at a time: of 4 connections opened at once, the k-th accepted waited at
/// least k sleeps in the accept queue, shown as accept_wait_ms on its first
/// request.
#[test]
fn a_slow_accepter_shows_accept_wait() {
    require_root("a_slow_accepter_shows_accept_wait");
    let server = WireServer::start(&["--accept-delay-ms", "40"]);
    // Socket hooks date the accept by the server's first read, which the
    // server stamps on its return (`t_read`): the bracket's upper end.
    let accepted_at = if socket_data_hooks() {
        "t_read"
    } else {
        "t_accept"
    };
    let mut agent = start_agent(&Agent::for_pids(&[server.proc.pid()]));
    let clients = run_wire_client(
        server.port,
        &[
            "--connections",
            "4",
            "--tokens",
            "1",
            "--rid-prefix",
            "slow-",
        ],
    );
    let srv = server.records(4);
    let rids: Vec<String> = clients.iter().filter_map(|c| str_field(c, "rid")).collect();
    let lines = agent_by_rid(&mut agent, &rids);
    let stop = agent.stop();
    check_agent_exit_quiet(stop);
    let mut waits = Vec::new();
    for c in &clients {
        let rid = str_field(c, "rid").expect("rid");
        let a = lines
            .get(&rid)
            .unwrap_or_else(|| panic!("{rid} not reported"));
        let aw = ms_field(a, "accept_wait_ms").unwrap_or_else(|| panic!("no accept_wait_ms: {a}"));
        waits.push(aw);
        let s = &srv[&rid];
        let stamp = |r: &Value, k: &str| u64_field(r, k).unwrap_or_else(|| panic!("no {k}: {r}"));
        // The connection queued between connect()'s start and return, and
        // accept() returned between its own call and return: a bracket that
        // a preempted stamp only widens (under load a one-sided stamp was
        // seen 5+ ms late).
        let at_most = ms_between(stamp(s, accepted_at), stamp(c, "t_connect_call"));
        let at_least = ms_between(stamp(s, "t_accept_call"), stamp(c, "t_connect")).max(0.0);
        eprintln!("[test] {rid}: accept_wait {aw:.3} ms, client and server stamps bracket it in [{at_least:.3}, {at_most:.3}] ms");
        assert!(
            aw >= at_least - 0.5 && aw <= at_most + 0.5,
            "{rid}: accept_wait {aw:.3} ms outside [{at_least:.3}, {at_most:.3}] ms (server accept() call/return vs client connect() return/call)"
        );
    }
    waits.sort_by(f64::total_cmp);
    for (k, w) in waits.iter().enumerate() {
        assert!(
            *w >= 40.0 * k as f64 - 1.0,
            "the connection accepted {k}th waited {w:.3} ms, less than {k} accept delays: {waits:?}"
        );
    }
}

/// HTTPS: tls_handshake_ms (ClientHello arrival → SSL_do_handshake
/// returned) against the client's do_handshake() duration, one idle
/// connection at a time.
#[test]
fn tls_handshake_matches_the_clients_measurement() {
    require_root("tls_handshake_matches_the_clients_measurement");
    let tls = TlsDir::new();
    let args = tls.args();
    let server = WireServer::start(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let mut agent = start_agent_with_env(
        &Agent::for_pids(&[server.proc.pid()]),
        &[("TOKENTRACE_LOG", "info")],
    );
    let mut clients = Vec::new();
    for i in 0..8 {
        let prefix = format!("tls{i}-");
        clients.extend(run_wire_client(
            server.port,
            &[
                "--connections",
                "1",
                "--tls",
                "--tokens",
                "2",
                "--rid-prefix",
                &prefix,
            ],
        ));
    }
    let rids: Vec<String> = clients.iter().filter_map(|c| str_field(c, "rid")).collect();
    let served = server.records(rids.len());
    let lines = agent_by_rid(&mut agent, &rids);
    let stop = agent.stop();
    check_agent_exit_quiet(stop);
    let mut diff = Dist::new("tls_handshake - client handshake");
    for c in &clients {
        let rid = str_field(c, "rid").expect("rid");
        let a = lines
            .get(&rid)
            .unwrap_or_else(|| panic!("{rid} not reported"));
        assert_eq!(a.get("tls").and_then(Value::as_bool), Some(true), "{a}");
        let hs =
            ms_field(a, "tls_handshake_ms").unwrap_or_else(|| panic!("no tls_handshake_ms: {a}"));
        let client = u64_field(c, "handshake_ns").expect("client handshake") as f64 / 1e6;
        diff.push(hs - client);
        // Bracket on stamps load cannot reorder: the ClientHello left after
        // the client's do_handshake() began, and the server's
        // SSL_do_handshake returned before its own stamp after wrap_socket.
        let began = u64_field(c, "t_handshake").expect("client t_handshake");
        let done = served
            .get(&rid)
            .and_then(|r| u64_field(r, "t_tls"))
            .unwrap_or_else(|| panic!("server record of {rid} without t_tls: {served:?}"));
        let outer = done.saturating_sub(began) as f64 / 1e6;
        assert!(
            hs <= outer,
            "{rid}: tls_handshake_ms {hs:.3} exceeds the client start → server done bracket {outer:.3} ms: {a}"
        );
        assert!(
            ms_field(a, "socket_wait_ms").is_some(),
            "TLS request without socket_wait_ms: {a}"
        );
        assert!(
            ms_field(a, "accept_wait_ms").is_some(),
            "TLS request without accept_wait_ms: {a}"
        );
    }
    eprintln!("[test] {}", diff.summary());
    assert!(
        diff.pct(50.0).abs() < 1.0,
        "median |tls_handshake - client's handshake| >= 1 ms: {}",
        diff.summary()
    );
    // Per handshake, the bracket above: the agent's interval can exceed the
    // client's own by the server's wake-up lag, which load moves (5.2 ms
    // seen with two other developers building), so it is bounded by the
    // server's stamp, not by the client's duration.
}

/// A client that walks away after 2 events while the server keeps writing:
/// client_closed, with the chunks written after it left.
fn client_closes_mid_stream(tls: Option<&TlsDir>) {
    let args: Vec<String> = tls.map(TlsDir::args).unwrap_or_default();
    let server = WireServer::start(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let mut agent = start_agent(&Agent::for_pids(&[server.proc.pid()]));
    let mut client_args = vec![
        "--connections",
        "1",
        "--tokens",
        "40",
        "--delay-ms",
        "15",
        "--close-after",
        "2",
        "--rid-prefix",
        "gone-",
    ];
    if tls.is_some() {
        client_args.push("--tls");
    }
    let clients = run_wire_client(server.port, &client_args);
    let s = server.records(1).remove("gone-0").expect("server record");
    let lines = agent_by_rid(&mut agent, &["gone-0".to_string()]);
    let stop = agent.stop();
    check_agent_exit_quiet(stop);
    let a = lines
        .get("gone-0")
        .unwrap_or_else(|| panic!("not reported: {:?}", agent.values()));
    eprintln!("[test] client {} / server {s} / agent {a}", clients[0]);
    assert!(
        s.get("error").is_some_and(|e| !e.is_null()),
        "the server never noticed: {s}"
    );
    assert_eq!(a.get("aborted").and_then(Value::as_bool), Some(true), "{a}");
    assert_eq!(
        str_field(a, "abort_reason").as_deref(),
        Some("client_closed"),
        "{a}"
    );
    let writes_ok = u64_field(&s, "writes_ok").expect("writes_ok");
    assert_eq!(
        u64_field(a, "chunks"),
        Some(writes_ok),
        "chunks vs the server's successful writes: {a}"
    );
    let after = u64_field(a, "chunks_after_client_closed").expect("chunks_after_client_closed");
    assert!(
        after >= 1,
        "the server wrote after the client left, agent counted {after}: {a}"
    );
    assert!(
        writes_ok - after >= 2,
        "the client received 2 events before leaving, yet {after} of {writes_ok} counted after: {a}"
    );
}

#[test]
fn client_closing_mid_stream_is_client_closed() {
    require_root("client_closing_mid_stream_is_client_closed");
    client_closes_mid_stream(None);
}

#[test]
fn client_closing_mid_stream_over_tls_is_client_closed() {
    require_root("client_closing_mid_stream_over_tls_is_client_closed");
    let tls = TlsDir::new();
    client_closes_mid_stream(Some(&tls));
}

/// The server reads a request and closes the connection unanswered.
#[test]
fn server_closing_unanswered_is_server_closed() {
    require_root("server_closing_unanswered_is_server_closed");
    let server = WireServer::start(&[]);
    let mut agent = start_agent(&Agent::for_pids(&[server.proc.pid()]));
    run_wire_client(
        server.port,
        &[
            "--connections",
            "1",
            "--path",
            "/close-unanswered",
            "--rid-prefix",
            "shut-",
        ],
    );
    server.records(1);
    let lines = agent_by_rid(&mut agent, &["shut-0".to_string()]);
    let stop = agent.stop();
    check_agent_exit_quiet(stop);
    let a = lines
        .get("shut-0")
        .unwrap_or_else(|| panic!("not reported: {:?}", agent.values()));
    assert_eq!(a.get("aborted").and_then(Value::as_bool), Some(true), "{a}");
    assert_eq!(
        str_field(a, "abort_reason").as_deref(),
        Some("server_closed"),
        "{a}"
    );
    assert_eq!(a.get("status"), Some(&Value::Null), "{a}");
}

/// A client that sends its request and leaves before the server has
/// accepted the connection: the FIN arrives while nobody owns the socket,
/// is kept, and reported at the accept; the server then reads the request
/// and closes unanswered — the client, not the server, ended it. The server
/// accepts each connection 500 ms after it was queued, and the order (the
/// client's close before the server's accept) is checked on both sides'
/// own CLOCK_MONOTONIC stamps, so machine load cannot undo the scenario.
#[test]
fn a_client_gone_before_accept_is_client_closed() {
    require_root("a_client_gone_before_accept_is_client_closed");
    let server = WireServer::start(&["--hold-accept-ms", "500"]);
    let mut agent = start_agent(&Agent::for_pids(&[server.proc.pid()]));
    let client = run_wire_client(
        server.port,
        &[
            "--connections",
            "1",
            "--path",
            "/close-unanswered",
            "--close-after-send",
            "--rid-prefix",
            "left-",
        ],
    );
    let served = server.records(1);
    let lines = agent_by_rid(&mut agent, &["left-0".to_string()]);
    let stop = agent.stop();
    check_agent_exit_quiet(stop);
    let closed = client
        .first()
        .and_then(|c| c.get("t_close"))
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("client record without t_close: {client:?}"));
    let accepted = served
        .get("left-0")
        .and_then(|r| r.get("t_accept"))
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("server record without t_accept: {served:?}"));
    assert!(
        closed < accepted,
        "precondition: the client closed at {closed}, after the accept at {accepted}"
    );
    let a = lines
        .get("left-0")
        .unwrap_or_else(|| panic!("not reported: {:?}", agent.values()));
    assert_eq!(
        str_field(a, "abort_reason").as_deref(),
        Some("client_closed"),
        "{a}"
    );
}

/// The agent starts while streams are in flight: those are skipped and
/// counted (their request was never seen); requests that start afterwards
/// are reported with their wire arrival.
#[test]
fn streams_in_flight_at_start_are_skipped_and_counted() {
    require_root("streams_in_flight_at_start_are_skipped_and_counted");
    let server = start_server(ServerKind::Stdlib, &[]);
    let port = server.port;
    let early = thread::spawn(move || {
        run_client(
            port,
            &ClientRun {
                tokens: 300,
                token_delay_ms: 20.0,
                ..ClientRun::sse(3, 3, "early-")
            },
        )
    });
    thread::sleep(Duration::from_millis(500));
    let mut agent = start_agent(&Agent::for_pids(&[server.pid()]));
    let early = early.join().expect("early client");
    assert!(
        early.iter().all(|c| !c.aborted),
        "early streams must complete"
    );
    let late = run_client(port, &ClientRun::sse(4, 4, "late-"));
    let missing = agent.wait_for_paths(&paths(&late), Duration::from_secs(20));
    assert!(
        missing.is_empty(),
        "late requests not reported: {missing:?}"
    );
    let stop = agent.stop();
    let summary = agent.proc.stderr.lines().join("\n");
    check_agent_exit_quiet(stop);
    for v in agent.values() {
        let path = str_field(&v, "path").unwrap_or_default();
        assert!(
            !path.contains("early-"),
            "a stream already in flight was reported: {v}"
        );
        if path.contains("late-") {
            assert!(
                ms_field(&v, "socket_wait_ms").is_some(),
                "late request without ingress: {v}"
            );
            assert_eq!(
                v.get("aborted").and_then(Value::as_bool),
                Some(false),
                "{v}"
            );
        }
    }
    let counted = summary
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find_map(|v| {
            v.pointer("/tokentrace_summary/stitch/streams_in_flight_at_start")?
                .as_u64()
        })
        .unwrap_or_else(|| panic!("no tokentrace_summary JSON line on stderr:\n{summary}"));
    assert_eq!(
        counted, 3,
        "streams in flight at start, summary:\n{summary}"
    );
}

/// 16 requests pipelined on each of 2 connections, 2 ms apart, one segment
/// each, while the server spends 100 ms on the first: the other 15 wait in
/// the receive queue, more segments than a socket has arrival slots (8).
/// The ones with a slot are dated by their own segment; the rest share the
/// last slot, dated by its newest segment: late, counted in the summary,
/// and never before the request reached the host (the old policy dated
/// them by the slot's first segment: 2-28 ms before they were sent).
#[test]
fn pipelined_requests_past_the_arrival_slots_are_never_dated_before_they_arrived() {
    require_root("pipelined_requests_past_the_arrival_slots_are_never_dated_before_they_arrived");
    const PIPELINE: usize = 16;
    const SLOTS: usize = 8;
    let server = WireServer::start(&[]);
    let mut agent = start_agent(&Agent::for_pids(&[server.proc.pid()]));
    let capture = Capture::start(server.port);
    let clients = run_wire_client(
        server.port,
        &[
            "--connections",
            "2",
            "--pipeline",
            &PIPELINE.to_string(),
            "--gap-ms",
            "2",
            "--ttft-ms",
            "100",
            "--tokens",
            "2",
            "--delay-ms",
            "1",
            "--rid-prefix",
            "pl",
        ],
    );
    let srv = server.records(clients.len());
    let rids: Vec<String> = clients.iter().filter_map(|c| str_field(c, "rid")).collect();
    let lines = agent_by_rid(&mut agent, &rids);
    let packets = capture.finish();
    let stop = agent.stop();
    check_agent_exit_quiet(stop);
    let merged = agent
        .summary_part("/tokentrace_summary/ingress_segs_merged")
        .as_u64()
        .expect("ingress_segs_merged in the summary");

    let mut segments = 0;
    let mut exact = Dist::new("request_start - wire arrival, requests with a slot");
    let mut late = Dist::new("request_start - wire arrival, requests past the slots");
    let mut failures = Vec::new();
    for c in &clients {
        let rid = str_field(c, "rid").expect("rid");
        let (Some(port), Some(offset)) = (u64_field(c, "client_port"), u64_field(c, "offset"))
        else {
            failures.push(format!("{rid}: client record without port/offset: {c}"));
            continue;
        };
        let port = u16::try_from(port).expect("port");
        let k: usize = rid
            .rsplit('-')
            .next()
            .and_then(|k| k.parse().ok())
            .expect("k");
        if k == 0 {
            segments += packets
                .iter()
                .filter(|p| p.src == port && p.dst == server.port)
                .count();
        }
        let wire = match packet_with_byte(&packets, port, server.port, offset) {
            Ok(wire) => wire,
            Err(err) => {
                failures.push(format!("{rid}: {err}"));
                continue;
            }
        };
        // The precondition: the request waited in the receive queue behind
        // the first one (the server stamps each event just before its send).
        let first_rid = format!("{}0", rid.trim_end_matches(|ch: char| ch.is_ascii_digit()));
        let busy_until = srv[&first_rid]["t_write"][1].as_u64().expect("t_write");
        if k > 0 && wire.ts > busy_until {
            failures.push(format!(
                "{rid}: reached the host {:.3} ms after the server finished the first request: \
                 the client did not pipeline in time",
                ms_between(wire.ts, busy_until)
            ));
        }
        let start = match request_start(&lines, &rid) {
            Ok(start) => start,
            Err(err) => {
                failures.push(err);
                continue;
            }
        };
        let d = ms_between(start, wire.ts);
        // The packet's receive stamp, the capture's own (without one,
        // tcp_probe's time, after it): never before it (0.05 ms allows the
        // two clock conversions).
        if d < -0.05 {
            failures.push(format!(
                "{rid}: request_start {:.3} ms before its first byte reached the host",
                -d
            ));
        }
        // The last slot takes the later segments' bytes and their arrival:
        // the first 7 unread requests keep their own segment's.
        if k < SLOTS - 1 {
            exact.push(d);
            if d > TTFT_P99_MS {
                failures.push(format!(
                    "{rid}: had its own arrival slot, dated {d:.3} ms after its segment"
                ));
            }
        } else {
            late.push(d);
        }
    }
    eprintln!("[test] {}", exact.summary());
    eprintln!("[test] {}", late.summary());
    eprintln!("[test] ingress_segs_merged: {merged}");
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // Per connection, every segment past the first 9 went into the last
    // slot (past the first 8 on the connection not accepted yet, whose
    // first request had not been read to free its slot).
    let want = segments.saturating_sub(2 * (SLOTS + 1)) as u64;
    assert!(
        merged >= want.max(1),
        "ingress_segs_merged {merged} < {}: the segments past the slots ({segments} in all) were \
         not counted",
        want.max(1)
    );
}

/// The agent's `request_start_ns` for `rid`.
fn request_start(lines: &BTreeMap<String, Value>, rid: &str) -> Result<u64, String> {
    lines
        .get(rid)
        .and_then(|a| u64_field(a, "request_start_ns"))
        .ok_or_else(|| format!("{rid}: no request_start_ns from the agent"))
}

/// The captured client → server packet of connection `client_port` that
/// carried byte `offset` of what the client sent on it.
fn packet_with_byte(
    packets: &[Packet],
    client_port: u16,
    server_port: u16,
    offset: u64,
) -> Result<&Packet, &'static str> {
    let mut sent = packets
        .iter()
        .filter(|p| p.src == client_port && p.dst == server_port);
    let first = sent.clone().next().ok_or("connection not in the capture")?;
    let seq = first
        .seq
        .wrapping_add(u32::try_from(offset).expect("offset"));
    sent.find(|p| seq.wrapping_sub(p.seq) < p.len)
        .ok_or("its first byte is not in the capture")
}

/// A request that reaches the host while the server is inside a read on
/// its connection waits in the socket's backlog: TCP, and so `tcp_probe`,
/// sees it only when that read releases the socket. Each connection's
/// first read is held `HOLD_MS` by a page fault in the middle of its copy
/// (tests/servers/wire_server.py --hold-first-read-ms, userfaultfd) while
/// the client pipelines more requests behind it; they must be dated by
/// their arrival, not by the release (the CI run that failed on
/// tls_handshake_ms had a client's Finished dated 1.2 ms late this way).
/// First without a capture, so nothing but the agent's own stamping socket
/// asks the kernel for receive stamps (unless another process on the host
/// does), judged against the client's send stamps; then against the
/// capture, which shows the kernel's stamp itself. Last, an agent with
/// `capture.receive_stamps: false` dates them by the release, as before.
#[test]
fn requests_backlogged_behind_a_held_read_are_dated_by_their_arrival() {
    require_root("requests_backlogged_behind_a_held_read_are_dated_by_their_arrival");
    const HOLD_MS: u64 = 100;
    /// Between the pipelined sends: the server's read must reach its fault
    /// first (under load it can take milliseconds to wake).
    const GAP_MS: u64 = 10;
    const PIPELINE: usize = 4;
    let server = WireServer::start(&["--hold-first-read-ms", &HOLD_MS.to_string()]);
    let config = std::env::temp_dir().join(format!(
        "tokentrace-test-{}-no-stamps.yaml",
        std::process::id()
    ));
    std::fs::write(&config, "capture:\n  receive_stamps: false\n").expect("write the config");
    let mut failures = Vec::new();
    let mut judged_per_pass = Vec::new();
    let mut from_send = Dist::new("backlogged: request_start - client send, no capture");
    let mut from_stamp = Dist::new("backlogged: request_start - packet's receive stamp");
    let mut unstamped = Dist::new("backlogged, receive_stamps off: request_start - client send");
    let mut waited = Dist::new("backlogged: held read returned - client send");
    for stamps in [true, false] {
        let mut args = Agent::for_pids(&[server.proc.pid()]);
        if !stamps {
            args.extend(["--config".into(), config.display().to_string()]);
        }
        let mut agent = start_agent(&args);
        let passes: &[bool] = if stamps { &[false, true] } else { &[false] };
        for &captured in passes {
            let prefix = match (stamps, captured) {
                (true, false) => "bl",
                (true, true) => "blw",
                (false, _) => "bln",
            };
            let capture = captured.then(|| Capture::start(server.port));
            let clients = run_wire_client(
                server.port,
                &[
                    "--connections",
                    "1",
                    "--pipeline",
                    &PIPELINE.to_string(),
                    "--gap-ms",
                    &GAP_MS.to_string(),
                    "--ttft-ms",
                    "1",
                    "--tokens",
                    "2",
                    "--delay-ms",
                    "1",
                    "--rid-prefix",
                    prefix,
                ],
            );
            let srv = server.records(clients.len());
            let rids: Vec<String> = clients.iter().filter_map(|c| str_field(c, "rid")).collect();
            let lines = agent_by_rid(&mut agent, &rids);
            let packets = capture.map(Capture::finish);
            // The hold began (the socket owned from before then), and the
            // held read returned (the backlog was processed just before).
            let first = &srv[&format!("{prefix}0-0")];
            let held = first["t_hold"]
                .as_u64()
                .expect("the first request's t_hold");
            let released = first["t_read"]
                .as_u64()
                .expect("the first request's t_read");
            let mut judged = 0;
            for c in &clients {
                let rid = str_field(c, "rid").expect("rid");
                if rid.ends_with("-0") {
                    continue; // read by the held read itself, not backlogged
                }
                let sent = u64_field(c, "t_send").expect("t_send");
                // Sent before the hold began (the server slow to reach its
                // read), a request waited in the receive queue, not the
                // backlog: nothing to judge here.
                if sent <= held {
                    eprintln!(
                        "[test] {rid}: sent {:.3} ms before the hold began: not backlogged",
                        ms_between(held, sent)
                    );
                    continue;
                }
                // The precondition: sent well inside the hold.
                if sent + HOLD_MS * 1_000_000 / 4 > released {
                    failures.push(format!(
                        "{rid}: sent {:.3} ms before the held read returned: the client did not \
                         pipeline in time",
                        ms_between(released, sent)
                    ));
                    continue;
                }
                let start = match request_start(&lines, &rid) {
                    Ok(start) => start,
                    Err(err) => {
                        failures.push(err);
                        continue;
                    }
                };
                judged += 1;
                waited.push(ms_between(released, sent));
                // Dated by TCP's processing it is within microseconds of the
                // release; by its arrival, within microseconds of its send.
                let halfway = sent + (released - sent) / 2;
                let Some(packets) = &packets else {
                    let (dist, late) = if stamps {
                        (&mut from_send, start < sent || start > halfway)
                    } else {
                        (&mut unstamped, start < halfway)
                    };
                    dist.push(ms_between(start, sent));
                    if late {
                        failures.push(format!(
                            "{rid} (receive stamps {}): request_start {:.3} ms after its send, \
                             the read holding the socket returned {:.3} ms after it",
                            if stamps { "on" } else { "off" },
                            ms_between(start, sent),
                            ms_between(released, sent)
                        ));
                    }
                    continue;
                };
                let port = u16::try_from(u64_field(c, "client_port").expect("port")).expect("port");
                let offset = u64_field(c, "offset").expect("offset");
                let wire = match packet_with_byte(packets, port, server.port, offset) {
                    Ok(wire) => wire,
                    Err(err) => {
                        failures.push(format!("{rid}: {err}"));
                        continue;
                    }
                };
                // The same kernel stamp, converted by each side's measured
                // clock offset (errors well under a microsecond).
                from_stamp.push(ms_between(start, wire.ts));
                if ms_between(start, wire.ts).abs() > 0.01 {
                    failures.push(format!(
                        "{rid}: request_start {:.3} ms from its packet's receive stamp (the read \
                         holding the socket returned {:.3} ms after the packet)",
                        ms_between(start, wire.ts),
                        ms_between(released, wire.ts)
                    ));
                }
            }
            judged_per_pass.push(judged);
        }
        let stop = agent.stop();
        check_agent_exit_quiet(stop);
    }
    for d in [&waited, &from_send, &from_stamp, &unstamped] {
        eprintln!("[test] {}", d.summary());
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // A pass judges its requests sent after the hold began: all of them
    // unless the server took over a gap to reach its read.
    assert!(
        judged_per_pass.len() == 3 && judged_per_pass.iter().all(|&n| n + 1 >= PIPELINE - 1),
        "backlogged requests judged per pass: {judged_per_pass:?} (want 3 passes of at least {})",
        PIPELINE - 2
    );
}

fn check_agent_exit_quiet(stop: Option<std::process::ExitStatus>) {
    assert!(
        stop.is_some_and(|s| s.success()),
        "the agent did not exit cleanly: {stop:?}"
    );
}
