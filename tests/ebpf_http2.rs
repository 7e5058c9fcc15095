//! Root-only end-to-end tests of HTTP/2 and gRPC (issue 12): the real agent
//! (`tokentrace run --output json`, real eBPF) against real HTTP/2 servers,
//! each with a client that records every message's arrival on the agent's
//! clock (CLOCK_MONOTONIC).
//!
//! Run (as root; CI does):
//!   cargo test -p tokentrace --test ebpf_http2 -- --test-threads=1 --nocapture
//!
//! Needs grpcio (pip, pinned in .ci/run and `cargo xtask deps`), node (apt
//! nodejs; its `http2` module is built in), nginx and the openssl CLI.
//!
//! Servers and what each shows:
//!   * grpcio server streaming (tests/servers/grpc_stream.py, h2c), called by
//!     tests/clients/grpc_client.py over ONE channel (one connection):
//!     sequential and concurrent calls, a non-OK final status, 32 concurrent
//!     streams with distinct message counts, a client cancel, and the agent
//!     started while the connection is open;
//!   * node's http2 SSE server (tests/servers/h2_sse_server.js), h2c and TLS
//!     (node's statically linked OpenSSL, found in the executable), called by
//!     tests/clients/h2_client.js over one session;
//!   * nginx `listen … ssl http2` in front of the HTTP/1.1 SSE server (two
//!     timelines per request), and nginx `grpc_pass` in front of grpcio.
//!
//! Matching: gRPC calls all share one `:path`, so records are matched by
//! their x-request-id (`request_id`); SSE requests by their unique path.
//! Timing is judged by `common::compare` with `Tolerance::light()`:
//! brackets per request (client send ≤ agent request start ≤ the server
//! handler's own stamp) and per message (server stamp before the write ≤
//! agent emit ≤ client arrival), TTFT within 2 ms of the client's or the
//! server's own measure for 75 % of the requests and medians within 1 ms,
//! which is what survived `stress-ng --cpu 1` for the HTTP/1.1 suites. A
//! grpcio message's stamp is taken before the handler yields it and grpcio
//! writes it later on its own threads, so the server side of that bracket
//! is looser than stdlib's, never wrong.

use tokentrace_testkit as common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde_json::Value;

use common::h2::*;
use common::nginx::Nginx;
use common::tls::TlsDir;
use common::*;

/// The agent's log level: `info` names the files it attaches OpenSSL
/// probes to.
const AGENT_ENV: &[(&str, &str)] = &[("TOKENTRACE_LOG", "info")];

const STREAM: Expect = Expect {
    stream: true,
    status: 200,
    has_response_id: false,
};
const SSE: Expect = Expect {
    stream: true,
    status: 200,
    has_response_id: true,
};

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_string()
}

fn assert_no_failures(title: &str, failures: &[String]) {
    let load = loadavg();
    eprintln!("[test] {title}: load average {load}");
    if !failures.is_empty() {
        let shown: Vec<&str> = failures.iter().take(40).map(String::as_str).collect();
        panic!(
            "{title}: {} check(s) failed:\n  {}\n(load average {load})",
            failures.len(),
            shown.join("\n  ")
        );
    }
}

/// Waits until the agent reported every id in `ids` (by `request_id`);
/// returns the ids still missing.
fn wait_for_ids(agent: &mut Agent, ids: &BTreeSet<String>, timeout: Duration) -> BTreeSet<String> {
    agent.wait_until(timeout, |lines| {
        let seen: BTreeSet<String> = lines
            .iter()
            .filter_map(|l| str_field(&l.v, "request_id"))
            .collect();
        ids.is_subset(&seen)
    });
    let seen: BTreeSet<String> = agent
        .values()
        .iter()
        .filter_map(|v| str_field(v, "request_id"))
        .collect();
    ids.difference(&seen).cloned().collect()
}

fn request_ids(client: &[Value]) -> BTreeSet<String> {
    client
        .iter()
        .filter_map(|c| str_field(c, "request_id"))
        .collect()
}

/// Waits for every call's line, stops the agent, checks the exit contract.
fn finish(agent: &mut Agent, client: &[Value], failures: &mut Vec<String>) {
    let ids = request_ids(client);
    let missing = wait_for_ids(agent, &ids, Duration::from_secs(20));
    if !missing.is_empty() {
        eprintln!(
            "[test] {} of {} calls not reported 20 s after the client finished: {missing:?}",
            missing.len(),
            ids.len()
        );
    }
    let stop = agent.stop();
    let mut exit = Report::new();
    check_agent_exit(agent, stop, &mut exit);
    failures.extend(exit.failures);
}

/// `compare` over the records of one server (`pid`), gRPC matched by
/// request id, plus the HTTP/2 fields of every matched line.
fn judge(
    title: &str,
    client: &[Value],
    agent: &[Value],
    pid: u32,
    grpc: bool,
    tls: bool,
    failures: &mut Vec<String>,
) {
    let tol = if grpc {
        grpcio_tolerance()
    } else if tls {
        node_tls_tolerance()
    } else {
        Tolerance::light()
    };
    judge_with(title, client, agent, pid, grpc, tls, &tol, failures);
}

/// grpcio: neither outside view is next to its writes. The server's stamp
/// is taken before the handler yields, and grpc-core's own threads write
/// the message later; the client's arrival comes through grpc-core's
/// threads to Python. Medians measured under `stress-ng --cpu 1`: TTFT best
/// of the two 0.57-1.20 ms, client arrival − emit 0.41-1.21 ms (a 1 ms
/// light-load median failed twice in a stressed full run). Medians get
/// 2 ms; per-request bounds, per-chunk bounds and brackets stay.
fn grpcio_tolerance() -> Tolerance {
    Tolerance {
        ttft_p50_ms: 2.0,
        arrival_minus_emit_p50_ms: 2.0,
        ..Tolerance::light()
    }
}

/// node's `http2` over TLS: the server-side view starts at the read, and
/// node decrypts the record and parses the frames before the handler's
/// stamp; the client is node too, on the same two cores. In a CI run (load
/// average 2.6) the best of the two views had min 0.55, p50 1.07 ms. The
/// medians get 2 ms here; the load-proof bound for this server (agent −
/// wire TTFT from the decrypted loopback capture, within 0.2 ms) is
/// ebpf_tls_wire.rs's.
fn node_tls_tolerance() -> Tolerance {
    Tolerance {
        ttft_p50_ms: 2.0,
        ..Tolerance::light()
    }
}

#[allow(clippy::too_many_arguments)]
fn judge_with(
    title: &str,
    client: &[Value],
    agent: &[Value],
    pid: u32,
    grpc: bool,
    tls: bool,
    tol: &Tolerance,
    failures: &mut Vec<String>,
) {
    let recs: Vec<ClientRecord> = client.iter().map(|c| client_record(c, grpc, tls)).collect();
    let keyed = if grpc {
        rekey_agent(agent)
    } else {
        agent.to_vec()
    };
    let mut report = Report::new();
    compare(
        &recs,
        &keyed,
        pid,
        if grpc { &STREAM } else { &SSE },
        tol,
        &mut report,
    );
    report.print(title);
    report.apply_budgets(tol);
    failures.extend(report.failures.iter().map(|f| format!("[{title}] {f}")));
    let by_rid = by_request_id(&keyed);
    for c in client {
        let rid = str_field(c, "request_id").unwrap_or_default();
        if let Some([a]) = by_rid.get(&rid).map(Vec::as_slice) {
            check_h2_fields(a, c, grpc, false, failures);
        } else if !grpc {
            failures.push(format!(
                "[{title}] {rid}: expected one agent line with request_id {rid:?}, got {:?}",
                by_rid.get(&rid)
            ));
        }
    }
}

/// One gRPC server traced by pid; the client runs one after another (each
/// its own channel = connection); every call judged.
fn grpc_scenario(title: &str, runs: &[(Vec<String>, usize)]) {
    require_root(title);
    let server = start_grpc_server();
    let mut agent = start_agent_with_env(&Agent::for_pids(&[server.pid()]), AGENT_ENV);
    let mut client = Vec::new();
    for (args, n) in runs {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        client.extend(run_h2_client(H2Client::Grpc, server.port, &args, *n));
    }
    let mut failures = Vec::new();
    finish(&mut agent, &client, &mut failures);
    judge(
        title,
        &client,
        &agent.values(),
        server.pid(),
        true,
        false,
        &mut failures,
    );
    assert_no_failures(title, &failures);
}

fn args(s: &str) -> Vec<String> {
    s.split_whitespace().map(str::to_string).collect()
}

// --------------------------------------------------------------- gRPC

#[test]
fn root_h2_grpc_server_streaming() {
    grpc_scenario(
        "grpcio server streaming, sequential and concurrent calls on one connection",
        &[
            (
                args("--calls 12 --messages 10 --gap-ms 15 --ttft-ms 30 --rid-prefix seq-"),
                12,
            ),
            (
                args(
                    "--calls 8 --concurrency 4 --messages 6 --messages-step 1 --gap-ms 15 \
                     --ttft-ms 30 --rid-prefix conc-",
                ),
                8,
            ),
            // a non-OK final status after 3 messages: grpc_status 8 and the
            // grpc-message length in the trailers
            (
                args(
                    "--calls 4 --messages 6 --status RESOURCE_EXHAUSTED --status-after 3 \
                     --gap-ms 15 --ttft-ms 30 --rid-prefix exhausted-",
                ),
                4,
            ),
        ],
    );
}

/// 32 concurrent streams on ONE connection, call j asking for 3 + j
/// messages: every agent line must carry its own call's request id and
/// message count, on one connection (one peer address) with 32 distinct
/// stream ids. The streams start in one burst, so `compare` checks them by
/// brackets only (each is its worker's first call: `first_wave_exempt`).
#[test]
fn root_h2_grpc_32_concurrent_streams_one_connection() {
    let title = "grpcio, 32 concurrent streams on one connection";
    require_root(title);
    let server = start_grpc_server();
    let mut agent = start_agent_with_env(&Agent::for_pids(&[server.pid()]), AGENT_ENV);
    let client = run_h2_client(
        H2Client::Grpc,
        server.port,
        &[
            "--calls",
            "32",
            "--concurrency",
            "32",
            "--messages",
            "3",
            "--messages-step",
            "1",
            "--gap-ms",
            "10",
            "--ttft-ms",
            "20",
            "--rid-prefix",
            "c32-",
        ],
        32,
    );
    let mut failures = Vec::new();
    finish(&mut agent, &client, &mut failures);
    let values = agent.values();
    judge_with(
        title,
        &client,
        &values,
        server.pid(),
        true,
        false,
        &burst_tolerance(),
        &mut failures,
    );
    let by_rid = by_request_id(&values);
    let mut peers = BTreeSet::new();
    let mut streams = BTreeSet::new();
    for c in &client {
        let rid = str_field(c, "request_id").unwrap_or_default();
        let want = c.get("expected_messages").and_then(Value::as_u64);
        if c.get("chunks").and_then(Value::as_u64) != want {
            failures.push(format!(
                "{rid}: the client got {:?} messages, asked for {want:?}",
                c.get("chunks")
            ));
        }
        let Some([a]) = by_rid.get(&rid).map(Vec::as_slice) else {
            failures.push(format!(
                "{rid}: expected exactly one agent line, got {:?}",
                by_rid.get(&rid)
            ));
            continue;
        };
        if a.get("chunks").and_then(Value::as_u64) != want {
            failures.push(format!(
                "{rid}: agent chunks {:?}, the call had {want:?} messages (misattributed?)",
                a.get("chunks")
            ));
        }
        peers.insert(str_field(a, "peer_addr"));
        streams.insert(a.get("stream_id").and_then(Value::as_u64));
    }
    if peers.len() != 1 {
        failures.push(format!(
            "expected the 32 calls on one connection (one peer address), got {peers:?}"
        ));
    }
    if streams.len() != 32 || streams.contains(&None) {
        failures.push(format!("expected 32 distinct stream ids, got {streams:?}"));
    }
    assert_no_failures(title, &failures);
}

/// `Tolerance::light()` for 32 streams in one burst: the client is 32
/// Python threads taking turns at the GIL on 2 cores, so its arrival stamps
/// lag the agent's emits by more than with 4 streams (measured on a quiet
/// box, load 2: client arrival - emit p50 1.18 ms, p95 7.3 ms, while emit -
/// server stamp stayed p50 0.08 ms, p95 0.5 ms). The per-chunk bound (the
/// closer of the two references within 5 ms for 97 % of the messages) and
/// the brackets stay; only the client-side median gets room.
fn burst_tolerance() -> Tolerance {
    Tolerance {
        arrival_minus_emit_p50_ms: 5.0,
        ..Tolerance::light()
    }
}

/// Checks of a cancelled call's line (gRPC or SSE over h2), by request id.
fn check_cancelled(
    client: &[Value],
    agent: &[Value],
    pid: u32,
    got: u64,
    asked: u64,
    failures: &mut Vec<String>,
) {
    let by_rid = by_request_id(agent);
    for c in client {
        let rid = str_field(c, "request_id").unwrap_or_default();
        if c.get("cancelled").and_then(Value::as_bool) != Some(true) {
            failures.push(format!("{rid}: the client did not cancel: {c}"));
            continue;
        }
        let Some([a]) = by_rid.get(&rid).map(Vec::as_slice) else {
            failures.push(format!(
                "{rid}: expected exactly one agent line, got {:?}",
                by_rid.get(&rid)
            ));
            continue;
        };
        if a.get("pid").and_then(Value::as_u64) != Some(u64::from(pid)) {
            failures.push(format!("{rid}: pid {:?}, expected {pid}", a.get("pid")));
        }
        if a.get("aborted").and_then(Value::as_bool) != Some(true)
            || str_field(a, "abort_reason").as_deref() != Some("client_closed")
        {
            failures.push(format!(
                "{rid}: aborted {:?} abort_reason {:?}, expected true / \"client_closed\": {a}",
                a.get("aborted"),
                a.get("abort_reason")
            ));
        }
        let chunks = a.get("chunks").and_then(Value::as_u64).unwrap_or(0);
        if chunks < got || chunks >= asked {
            failures.push(format!(
                "{rid}: agent chunks {chunks}, expected >= {got} (the client got them) and < {asked} (cancelled)"
            ));
        }
        let rs = a.get("request_start_ns").and_then(Value::as_u64);
        let send = c.get("t_send_ns").and_then(Value::as_u64);
        let first = c
            .get("chunk_arrival_ns")
            .and_then(Value::as_array)
            .and_then(|a| a.first())
            .and_then(Value::as_u64);
        match (rs, send, first) {
            (Some(rs), Some(send), Some(first)) if send <= rs + 10_000 && rs <= first => {}
            _ => failures.push(format!(
                "{rid}: request_start_ns {rs:?} outside [client send {send:?}, first arrival {first:?}]"
            )),
        }
    }
}

/// The agent starts after the client's connection is up and has done 2
/// calls (each a stream on it, HPACK tables filled); the 6 calls that start
/// afterwards must be timed exactly (compare's brackets and bounds) and
/// their messages counted. HPACK may no longer decode the labels a call
/// refers to by dynamic-table index (`:path`, `x-request-id`), so calls are
/// matched to lines by time: a call's line is the one whose request start
/// lies between the call's send and its end; labels are either right or
/// unknown, never wrong.
#[test]
fn root_h2_grpc_agent_started_mid_connection() {
    let title = "grpcio, agent started mid-connection";
    require_root(title);
    let server = start_grpc_server();
    let mut client = spawn_client(
        H2Client::Grpc,
        server.port,
        &args("--calls 8 --pause-after 2 --messages 8 --gap-ms 15 --ttft-ms 30 --rid-prefix mid-"),
    );
    client.wait_paused();
    let mut agent = start_agent_with_env(&Agent::for_pids(&[server.pid()]), AGENT_ENV);
    client.resume();
    let records = client.finish(8);
    let after: Vec<Value> = records
        .iter()
        .filter(|c| c.get("call").and_then(Value::as_u64).unwrap_or(0) >= 2)
        .cloned()
        .collect();
    assert_eq!(after.len(), 6, "6 calls after the pause: {records:?}");
    mid_connection_judge(title, &mut agent, &records, &after, server.pid(), true);
}

/// Matches lines to calls by time (see above), then judges with `compare`.
fn mid_connection_judge(
    title: &str,
    agent: &mut Agent,
    records: &[Value],
    after: &[Value],
    pid: u32,
    grpc: bool,
) {
    let t_end = |c: &Value| {
        let send = c.get("t_send_ns").and_then(Value::as_u64).unwrap_or(0);
        send + c.get("e2e_ns").and_then(Value::as_u64).unwrap_or(0)
    };
    let n = after.len();
    agent.wait_until(Duration::from_secs(20), |lines| lines.len() >= n);
    let mut failures = Vec::new();
    let stop = agent.stop();
    let mut exit = Report::new();
    check_agent_exit(agent, stop, &mut exit);
    failures.extend(exit.failures);
    let before_start: Vec<&Value> = records
        .iter()
        .filter(|c| c.get("call").and_then(Value::as_u64).unwrap_or(0) < 2)
        .collect();
    let mut keyed = Vec::new();
    for a in agent.values() {
        let rs = a
            .get("request_start_ns")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        let owner: Vec<&Value> = after
            .iter()
            .filter(|c| {
                c.get("t_send_ns")
                    .and_then(Value::as_u64)
                    .unwrap_or(u64::MAX)
                    <= rs + 10_000
                    && rs <= t_end(c)
            })
            .collect();
        let [c] = owner.as_slice() else {
            let old = before_start.iter().any(|c| rs <= t_end(c));
            failures.push(format!(
                "agent line with request start {rs} matches {} of the calls after the agent started{}: {a}",
                owner.len(),
                if old { " (it belongs to a call that ended before the agent started)" } else { "" }
            ));
            continue;
        };
        let rid = str_field(c, "request_id").unwrap_or_default();
        let mut a = a.clone();
        // labels: right or unknown (HPACK after attach), never wrong
        let got_rid = str_field(&a, "request_id");
        if got_rid.as_deref().is_some_and(|r| r != rid) {
            failures.push(format!(
                "{rid}: the line timed as this call says request_id {got_rid:?}"
            ));
        }
        check_h2_fields(
            &{
                let mut v = a.clone();
                if let Some(o) = v.as_object_mut() {
                    let p = o.get("path").cloned().unwrap_or(Value::Null);
                    o.insert("h2_path".into(), p);
                }
                v
            },
            c,
            grpc,
            true,
            &mut failures,
        );
        if let Some(o) = a.as_object_mut() {
            o.insert("request_id".into(), Value::String(rid.clone()));
            let m = o
                .get("method")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            if m.is_empty() {
                o.insert("method".into(), Value::String("POST".into()));
            } else if m != "POST" {
                failures.push(format!("{rid}: method {m:?}, expected POST or unknown"));
            }
        }
        keyed.push(a);
    }
    let client: Vec<ClientRecord> = after
        .iter()
        .map(|c| client_record(c, true, false))
        .collect();
    let keyed = rekey_agent(&keyed);
    let tol = grpcio_tolerance();
    let mut report = Report::new();
    compare(
        &client,
        &keyed,
        pid,
        if grpc { &STREAM } else { &SSE },
        &tol,
        &mut report,
    );
    report.print(title);
    report.apply_budgets(&tol);
    failures.extend(report.failures);
    assert_no_failures(title, &failures);
}

// ------------------------------------------------------- node http2 SSE

fn node_runs(tls: bool) -> Vec<(Vec<String>, usize)> {
    let t = if tls { " --tls" } else { "" };
    vec![
        (
            args(&format!("--requests 12 --tokens 10 --rid-prefix seq-{t}")),
            12,
        ),
        (
            args(&format!(
                "--requests 8 --concurrency 4 --tokens 6 --tokens-step 1 --rid-prefix conc-{t}"
            )),
            8,
        ),
    ]
}

fn node_scenario(title: &str, tls: Option<&TlsDir>) {
    require_root(title);
    let server = start_node_server(tls.map(|d| (d.cert(), d.key())));
    if tls.is_some() {
        // node's OpenSSL is linked into the executable: `check` must place
        // the probes there, and the agent must attach them
        let text = check_pid(server.pid());
        assert!(
            text.lines()
                .any(|l| l.starts_with(&format!("pid {}: ", server.pid()))
                    && l.contains("OpenSSL (")
                    && l.contains("SSL_read")
                    && l.contains("SSL_write")),
            "`tokentrace check --pid {}` lists no OpenSSL in node:\n{text}",
            server.pid()
        );
    }
    let mut agent = start_agent_with_env(&Agent::for_pids(&[server.pid()]), AGENT_ENV);
    if tls.is_some() {
        let missing = agent.wait_for_log(&["OpenSSL ("], Duration::from_secs(10));
        assert!(
            missing.is_empty(),
            "the agent attached no OpenSSL probes to node within 10 s; stderr:\n{}",
            agent.proc.stderr.tail(20)
        );
    }
    let mut client = Vec::new();
    for (a, n) in node_runs(tls.is_some()) {
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        client.extend(run_h2_client(H2Client::Node, server.port, &a, n));
    }
    // a cancel: 2 requests reset after 3 of 11 events
    let cancel_args = format!(
        "--requests 2 --tokens 10 --token-delay-ms 20 --cancel-after 3 --rid-prefix cancel-{}",
        if tls.is_some() { " --tls" } else { "" }
    );
    let cancel = run_h2_client(
        H2Client::Node,
        server.port,
        &cancel_args.split_whitespace().collect::<Vec<_>>(),
        2,
    );
    let mut all = client.clone();
    all.extend(cancel.iter().cloned());
    let mut failures = Vec::new();
    finish(&mut agent, &all, &mut failures);
    let values = agent.values();
    let (cancelled, rest): (Vec<Value>, Vec<Value>) = values
        .into_iter()
        .partition(|v| str_field(v, "request_id").is_some_and(|r| r.starts_with("cancel-")));
    judge(
        title,
        &client,
        &rest,
        server.pid(),
        false,
        tls.is_some(),
        &mut failures,
    );
    check_cancelled(&cancel, &cancelled, server.pid(), 3, 11, &mut failures);
    // Issue 27: every stream's HEADERS arrived while the socket was
    // tracked (the server was traced before the client connected), the
    // first streams after the preface included: each is dated by the
    // segment (or TLS record) that carried it.
    let undated: Vec<String> = rest
        .iter()
        .filter(|a| a.get("socket_wait_ms").is_none_or(Value::is_null))
        .map(|a| {
            format!(
                "{} stream {:?} addr {:?}",
                str_field(a, "request_id").unwrap_or_default(),
                a.get("stream_id"),
                a.get("peer_addr")
            )
        })
        .collect();
    eprintln!(
        "{title}: {} of {} streams without socket_wait_ms",
        undated.len(),
        rest.len()
    );
    if !undated.is_empty() {
        failures.push(format!(
            "{} of {} streams have socket_wait_ms null: {undated:?}",
            undated.len(),
            rest.len()
        ));
    }
    for a in rest.iter().chain(&cancelled) {
        if a.get("tls").and_then(Value::as_bool) != Some(tls.is_some()) {
            failures.push(format!(
                "tls {:?}, expected {}: {a}",
                a.get("tls"),
                tls.is_some()
            ));
        }
    }
    assert_no_failures(title, &failures);
}

/// `tokentrace check --pid PID`: stdout + stderr.
fn check_pid(pid: u32) -> String {
    let out = std::process::Command::new(agent_bin())
        .args(["check", "--pid", &pid.to_string()])
        .output()
        .expect("running tokentrace check");
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn root_h2_node_sse_h2c() {
    node_scenario("node http2 SSE, h2c", None);
}

// ---------------------------------------------------------------- nginx

/// Bounds for nginx's own hop. Neither outside view is next to nginx: the
/// client's TTFT adds node's TLS + HTTP/2 receive path (client - agent p50
/// 1.4 ms already against node's own h2c server), the server-side one is
/// the upstream's (handler start -> first stamp), which leaves out nginx's
/// connect to the upstream and its proxying (measured at load 2.3: best of
/// the two p50 1.5 ms, 1 of 15 requests above 2 ms both ways). The TTFT
/// bound gets 3 ms and the median 2.5 ms; brackets and chunk bounds stay.
fn proxy_tolerance() -> Tolerance {
    Tolerance {
        ttft_abs_ms: 3.0,
        ttft_p50_ms: 2.5,
        ..Tolerance::light()
    }
}

/// nginx grpc_pass in front of grpcio: the proxy's bounds, and for the
/// client's arrivals (behind nginx's forwarding) the room grpcio's get,
/// plus the hop (measured under stress: arrival − grpcio's emit p50
/// 1.21 ms).
fn grpc_proxy_tolerance() -> Tolerance {
    Tolerance {
        arrival_minus_emit_p50_ms: 2.5,
        ..proxy_tolerance()
    }
}

/// nginx `listen … ssl http2` in front of the HTTP/1.1 SSE server: every
/// request has two timelines, nginx's (h2 over TLS, protocol `h2`) and the
/// upstream's (HTTP/1.1, plaintext), each judged against the client.
#[test]
fn root_h2_nginx_tls_h2_in_front_of_http1_sse() {
    let title = "nginx ssl http2 -> http.server SSE";
    require_root(title);
    let tls = TlsDir::new("nginx-h2");
    let upstream = start_server(ServerKind::Stdlib, &[]);
    let block = format!(
        "    server {{\n        listen 127.0.0.1:{{port}} ssl http2;\n\
         ssl_certificate {};\n        ssl_certificate_key {};\n\
         location / {{\n            proxy_pass http://127.0.0.1:{};\n\
         proxy_http_version 1.1;\n            proxy_buffering off;\n        }}\n    }}",
        tls.cert(),
        tls.key(),
        upstream.port
    );
    let nginx = Nginx::start(&tls.dir, &block);
    let pids = [nginx.master.pid(), nginx.worker, upstream.pid()];
    let mut agent = start_agent_with_env(&Agent::for_pids(&pids), AGENT_ENV);
    let missing = agent.wait_for_log(&["OpenSSL ("], Duration::from_secs(10));
    assert!(missing.is_empty(), "no OpenSSL probes attached to nginx");
    let mut client = Vec::new();
    for (a, n) in node_runs(true) {
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        client.extend(run_h2_client(H2Client::Node, nginx.port, &a, n));
    }
    let mut failures = Vec::new();
    finish(&mut agent, &client, &mut failures);
    let (at_nginx, rest): (Vec<Value>, Vec<Value>) = agent
        .values()
        .into_iter()
        .partition(|v| v.get("pid").and_then(Value::as_u64) == Some(u64::from(nginx.worker)));
    judge_with(
        &format!("{title}: nginx (h2, TLS)"),
        &client,
        &at_nginx,
        nginx.worker,
        false,
        true,
        &proxy_tolerance(),
        &mut failures,
    );
    // the upstream's hop: HTTP/1.1, same events; its request id is the
    // header nginx passes on
    let recs: Vec<ClientRecord> = client
        .iter()
        .map(|c| client_record(c, false, false))
        .collect();
    let tol = Tolerance::light();
    let mut report = Report::new();
    compare(&recs, &rest, upstream.pid(), &SSE, &tol, &mut report);
    report.print(&format!("{title}: upstream (HTTP/1.1)"));
    report.apply_budgets(&tol);
    failures.extend(report.failures);
    for v in &rest {
        if str_field(v, "protocol").as_deref() != Some("http/1.1") {
            failures.push(format!(
                "upstream line with protocol {:?}, expected \"http/1.1\": {v}",
                v.get("protocol")
            ));
        }
    }
    assert_no_failures(title, &failures);
}

/// The suite's clients must be able to tell a wrong count: the gRPC client
/// reports what arrived, not what was asked for (no agent, no root needed).
#[test]
fn grpc_client_counts_what_arrived() {
    let server = start_grpc_server();
    let recs = run_h2_client(
        H2Client::Grpc,
        server.port,
        &[
            "--calls",
            "2",
            "--messages",
            "5",
            "--status",
            "ABORTED",
            "--status-after",
            "2",
            "--gap-ms",
            "1",
            "--ttft-ms",
            "1",
        ],
        2,
    );
    for r in &recs {
        assert_eq!(r.get("chunks").and_then(Value::as_u64), Some(2), "{r}");
        assert_eq!(
            r.get("grpc_code").and_then(Value::as_str),
            Some("ABORTED"),
            "{r}"
        );
        assert!(r.get("error").is_some_and(Value::is_null), "{r}");
    }
}

/// OpenSSL linked statically into node's executable: `tokentrace check
/// --pid` places the probes in the executable itself, the agent attaches
/// them there for the node process, and they deliver the plaintext: the
/// HTTP/2 preface read through them makes an h2 connection, and every line
/// the agent reports for node says `tls: true`. (Counts and timing over
/// TLS are judged by `root_h2_node_sse_tls_static_openssl`.)
#[test]
fn root_h2_node_tls_openssl_found_in_the_executable() {
    let title = "node TLS: OpenSSL found in the executable";
    require_root(title);
    let tls = TlsDir::new("node-exe");
    let server = start_node_server(Some((tls.cert(), tls.key())));
    let pid = server.pid();
    let exe = std::fs::read_link(format!("/proc/{pid}/exe"))
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    assert!(
        !maps.contains("libssl"),
        "node (pid {pid}) maps a libssl: this node is not the statically linked case"
    );
    let text = check_pid(pid);
    assert!(
        text.lines()
            .any(|l| l.starts_with(&format!("pid {pid}: {exe}: OpenSSL ("))
                && l.contains("SSL_read")
                && l.contains("SSL_write")),
        "`tokentrace check --pid {pid}` places no OpenSSL probes in {exe}:\n{text}"
    );
    let mut agent = start_agent_with_env(&Agent::for_pids(&[pid]), AGENT_ENV);
    let needle = format!("probing {exe}: OpenSSL (");
    let missing = agent.wait_for_log(&[needle.as_str()], Duration::from_secs(10));
    assert!(
        missing.is_empty(),
        "the agent did not attach OpenSSL probes to {exe} within 10 s; stderr:\n{}",
        agent.proc.stderr.tail(20)
    );
    let client = run_h2_client(
        H2Client::Node,
        server.port,
        &[
            "--tls",
            "--requests",
            "4",
            "--tokens",
            "3",
            "--rid-prefix",
            "exe-",
        ],
        4,
    );
    let ids = request_ids(&client);
    wait_for_ids(&mut agent, &ids, Duration::from_secs(10));
    let stop = agent.stop();
    let mut failures = Vec::new();
    let mut exit = Report::new();
    check_agent_exit(&agent, stop, &mut exit);
    failures.extend(exit.failures);
    let values = agent.values();
    if values.is_empty() {
        failures.push("the agent reported no request over node's TLS".into());
    }
    for v in &values {
        if v.get("tls").and_then(Value::as_bool) != Some(true)
            || str_field(v, "protocol").as_deref() != Some("h2")
        {
            failures.push(format!("expected tls: true, protocol h2: {v}"));
        }
    }
    let summary = agent.proc.stderr.lines().into_iter().find_map(|l| {
        serde_json::from_str::<Value>(l.trim())
            .ok()
            .and_then(|v| v.get("tokentrace_summary").cloned())
    });
    let h2 = summary
        .as_ref()
        .and_then(|s| s.get("stitch"))
        .and_then(|s| s.get("h2_connections"))
        .and_then(Value::as_u64);
    if h2 != Some(1) {
        failures.push(format!(
            "summary h2_connections {h2:?}, expected 1 (the client's one TLS session): {summary:?}"
        ));
    }
    assert_no_failures(title, &failures);
}

// ------------------------- cancels, TLS through node, mid-connection SSE, grpc_pass

/// The client cancels every call after 3 of 20 messages (RST_STREAM
/// CANCEL): `aborted: true`, `abort_reason: "client_closed"`, at least the
/// 3 messages the client got and fewer than the 20 asked for, the request
/// start inside the client's bracket.
#[test]
fn root_h2_grpc_client_cancel() {
    let title = "grpcio, client cancels after 3 messages";
    require_root(title);
    let server = start_grpc_server();
    let mut agent = start_agent_with_env(&Agent::for_pids(&[server.pid()]), AGENT_ENV);
    let client = run_h2_client(
        H2Client::Grpc,
        server.port,
        &[
            "--calls",
            "4",
            "--messages",
            "20",
            "--gap-ms",
            "20",
            "--cancel-after",
            "3",
            "--rid-prefix",
            "cancel-",
        ],
        4,
    );
    let mut failures = Vec::new();
    finish(&mut agent, &client, &mut failures);
    check_cancelled(&client, &agent.values(), server.pid(), 3, 20, &mut failures);
    assert_no_failures(title, &failures);
}

#[test]
fn root_h2_node_sse_tls_static_openssl() {
    let tls = TlsDir::new("node-h2");
    node_scenario("node http2 SSE over TLS (OpenSSL inside node)", Some(&tls));
}

#[test]
fn root_h2_node_sse_agent_started_mid_connection() {
    let title = "node http2 SSE, agent started mid-connection";
    require_root(title);
    let server = start_node_server(None);
    let mut client = spawn_client(
        H2Client::Node,
        server.port,
        &args("--requests 8 --pause-after 2 --tokens 8 --rid-prefix mid-"),
    );
    client.wait_paused();
    let mut agent = start_agent_with_env(&Agent::for_pids(&[server.pid()]), AGENT_ENV);
    client.resume();
    let mut records = client.finish(8);
    for r in records.iter_mut() {
        // the node client has no call index: its request id's number is it
        let j = str_field(r, "request_id")
            .and_then(|s| s.trim_start_matches("mid-").parse::<u64>().ok());
        if let (Some(o), Some(j)) = (r.as_object_mut(), j) {
            o.insert("call".into(), Value::from(j));
        }
    }
    let after: Vec<Value> = records
        .iter()
        .filter(|c| c.get("call").and_then(Value::as_u64).unwrap_or(0) >= 2)
        .cloned()
        .collect();
    assert_eq!(after.len(), 6, "6 requests after the pause: {records:?}");
    mid_connection_judge(title, &mut agent, &records, &after, server.pid(), false);
}

/// nginx `grpc_pass` (h2c on both sides) in front of grpcio: two gRPC
/// timelines per call (nginx's worker and the grpcio server), each with the
/// call's message count and status; nginx's upstream connection is an
/// HTTP/2 client (it writes the preface): its lines are client lines, kept
/// apart from these (tests/ebpf_hops.rs judges them).
#[test]
fn root_h2_nginx_grpc_pass() {
    let title = "nginx grpc_pass -> grpcio";
    require_root(title);
    let dir = TlsDir::new("nginx-grpc");
    let upstream = start_grpc_server();
    let block = format!(
        "    server {{\n        listen 127.0.0.1:{{port}} http2;\n\
         location / {{\n            grpc_pass grpc://127.0.0.1:{};\n        }}\n    }}",
        upstream.port
    );
    let nginx = Nginx::start(&dir.dir, &block);
    let pids = [nginx.master.pid(), nginx.worker, upstream.pid()];
    let mut agent = start_agent_with_env(&Agent::for_pids(&pids), AGENT_ENV);
    let mut client = run_h2_client(
        H2Client::Grpc,
        nginx.port,
        &args("--calls 10 --messages 8 --gap-ms 15 --ttft-ms 30 --rid-prefix seq-")
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
        10,
    );
    client.extend(run_h2_client(
        H2Client::Grpc,
        nginx.port,
        &args(
            "--calls 8 --concurrency 4 --messages 5 --messages-step 1 --status RESOURCE_EXHAUSTED \
             --status-after 4 --gap-ms 15 --ttft-ms 30 --rid-prefix conc-",
        )
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>(),
        8,
    ));
    let mut failures = Vec::new();
    finish(&mut agent, &client, &mut failures);
    let mut per_pid: BTreeMap<u64, Vec<Value>> = BTreeMap::new();
    for v in agent.values() {
        per_pid
            .entry(v.get("pid").and_then(Value::as_u64).unwrap_or(0))
            .or_default()
            .push(v);
    }
    // Neither outside view is next to either hop: the client is behind
    // nginx, and grpcio's own stamps are taken before its threads write:
    // both timelines get the proxy bounds (brackets and counts stay).
    let nginx_lines = per_pid.remove(&u64::from(nginx.worker)).unwrap_or_default();
    judge_with(
        &format!("{title}: nginx"),
        &client,
        &nginx_lines,
        nginx.worker,
        true,
        false,
        &grpc_proxy_tolerance(),
        &mut failures,
    );
    // The grpcio hop's concurrent calls get no TTFT agreement bound: behind
    // nginx the client's TTFT holds nginx's forwarding, and grpcio's
    // handler stamp comes after its thread pool's queue, both ~4 ms under
    // `stress-ng --cpu 1` for the second wave of 4 (seen: agent 34.1-35.2 ms,
    // client 38.3-40.1 ms, handler→first 30.4-30.8 ms). Their brackets,
    // counts and per-chunk emit checks stay; the sequential calls keep every
    // bound.
    let grpcio_lines = per_pid
        .remove(&u64::from(upstream.pid()))
        .unwrap_or_default();
    for (prefix, tolerance) in [
        ("seq-", grpc_proxy_tolerance()),
        (
            "conc-",
            Tolerance {
                ttft_abs_ms: f64::INFINITY,
                ttft_p50_ms: f64::INFINITY,
                ..grpc_proxy_tolerance()
            },
        ),
    ] {
        let with_prefix = |lines: &[Value]| -> Vec<Value> {
            lines
                .iter()
                .filter(|v| str_field(v, "request_id").is_some_and(|r| r.starts_with(prefix)))
                .cloned()
                .collect()
        };
        judge_with(
            &format!("{title}: grpcio {prefix}*"),
            &with_prefix(&client),
            &with_prefix(&grpcio_lines),
            upstream.pid(),
            true,
            false,
            &tolerance,
            &mut failures,
        );
    }
    for (pid, lines) in per_pid {
        failures.push(format!(
            "{} line(s) from pid {pid}, neither the nginx worker nor grpcio: {:?}",
            lines.len(),
            lines.first()
        ));
    }
    assert_no_failures(title, &failures);
}
