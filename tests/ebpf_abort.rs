//! Root-only: the server dies in the middle of a stream. The agent must
//! report that request with `aborted: true` (abort_reason `process_exited`
//! or `server_closed`: the server, not the client, ended it) within a few seconds: not hang on it, not lose it.
//!
//! Run (as root; CI does):
//!   cargo test -p tokentrace --test ebpf_abort -- --test-threads=1 --nocapture

use tokentrace_testkit as common;

use std::thread;
use std::time::Duration;

use common::*;
use serde_json::Value;

/// The agent must have reported the aborted request this soon after the
/// client saw the connection die.
const REPORT_WITHIN: Duration = Duration::from_secs(5);

fn check_aborted_record(title: &str, agent: &mut Agent, c: &ClientRecord, server_pid: u32) {
    let line = agent.wait_for_path(&c.path, Duration::from_secs(15)).unwrap_or_else(|| {
        panic!(
            "{title}: the agent never reported {} (15 s after the server died): request lost. Agent lines: {:?}",
            c.path,
            agent.values()
        )
    });
    // the client stamped the end of the stream (EOF) on the same clock
    let client_eof_ns = c.t_send_ns.unwrap_or(0) + c.e2e_ns.unwrap_or(0);
    let lag = Duration::from_nanos(line.mono_ns.saturating_sub(client_eof_ns));
    eprintln!(
        "[test] {title}: aborted request read from the agent {:+.3} ms after the client saw the connection end: {}",
        (line.mono_ns as f64 - client_eof_ns as f64) / 1e6,
        line.v
    );
    let a = &line.v;
    let mut f: Vec<String> = Vec::new();
    if lag > REPORT_WITHIN {
        f.push(format!(
            "reported {:.2} s after the abort, expected < {:?}",
            lag.as_secs_f64(),
            REPORT_WITHIN
        ));
    }
    if a.get("aborted").and_then(Value::as_bool) != Some(true) {
        f.push(format!("aborted = {:?}, expected true", a.get("aborted")));
    }
    let reason = str_field(a, "abort_reason");
    if !matches!(
        reason.as_deref(),
        Some("process_exited") | Some("server_closed")
    ) {
        f.push(format!(
            "abort_reason = {reason:?}, expected process_exited or server_closed"
        ));
    }
    if a.get("pid").and_then(Value::as_u64) != Some(u64::from(server_pid)) {
        f.push(format!("pid = {:?}, expected {server_pid}", a.get("pid")));
    }
    if a.get("status").and_then(Value::as_u64) != Some(200) {
        f.push(format!(
            "status = {:?}, expected 200 (headers were sent)",
            a.get("status")
        ));
    }
    if a.get("stream").and_then(Value::as_bool) != Some(true) {
        f.push(format!("stream = {:?}, expected true", a.get("stream")));
    }
    if a.get("chunks").and_then(Value::as_u64) != Some(c.chunks) {
        f.push(format!(
            "chunks = {:?}, client received {}",
            a.get("chunks"),
            c.chunks
        ));
    }
    if str_field(a, "response_id") != c.response_id {
        f.push(format!(
            "response_id = {:?}, client saw {:?}",
            a.get("response_id"),
            c.response_id
        ));
    }
    if let (Some(at), Some(ct)) = (a.get("ttft_ms").and_then(Value::as_f64), c.ttft_ns) {
        // Brackets, which load cannot move (a single request has no
        // distribution to judge closeness by; ebpf_plaintext does that):
        // the agent's TTFT is inside the client's (sent before the read,
        // received after the write) and covers the server's own (handler
        // start to its stamp before the first write).
        let d = ct as f64 / 1e6 - at;
        eprintln!("[test] {title}: client TTFT - agent TTFT = {d:.3} ms");
        if d < -0.01 {
            f.push(format!(
                "agent TTFT {at:.3} ms is longer than the client's {:.3} ms",
                ct as f64 / 1e6
            ));
        }
        if let (Some(h), Some(Some(s0))) = (c.server_req_ns, c.server_write_ns.first()) {
            let st = (*s0 as f64 - h as f64) / 1e6;
            if at < st - 0.01 {
                f.push(format!(
                    "agent TTFT {at:.3} ms is shorter than the server's own {st:.3} ms"
                ));
            }
        }
    } else if c.chunks > 0 {
        f.push(format!(
            "ttft_ms = {:?}, expected a number (the client got {} chunks)",
            a.get("ttft_ms"),
            c.chunks
        ));
    }
    assert!(f.is_empty(), "{title}: {}:\n  {}", c.path, f.join("\n  "));
}

/// Waits until a TCP connection to the local `port` is ESTABLISHED
/// (/proc/net/tcp and tcp6: local port in hex, state 01).
fn wait_for_established(port: u16, timeout: Duration) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    let needle = format!(":{port:04X} ");
    while std::time::Instant::now() < deadline {
        let up = ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
            std::fs::read_to_string(f).is_ok_and(|t| {
                t.lines().skip(1).any(|l| {
                    let cols: Vec<&str> = l.split_whitespace().collect();
                    cols.len() > 3 && format!("{} ", cols[1]).ends_with(&needle) && cols[3] == "01"
                })
            })
        });
        if up {
            return true;
        }
        thread::sleep(Duration::from_millis(5));
    }
    false
}

fn check_exactly_once(title: &str, agent: &Agent, expected: &[&ClientRecord]) {
    let by = by_path(&agent.values());
    let mut f = Vec::new();
    for c in expected {
        let n = by.get(&c.path).map(Vec::len).unwrap_or(0);
        if n != 1 {
            f.push(format!("{}: {n} agent records, expected 1", c.path));
        }
    }
    for (p, v) in &by {
        if !expected.iter().any(|c| &c.path == p) {
            f.push(format!("unexpected agent record for {p:?}: {}", v[0]));
        }
    }
    assert!(f.is_empty(), "{title}:\n  {}", f.join("\n  "));
}

#[test]
fn root_fastapi_server_kills_itself_mid_stream() {
    let title = "fastapi SIGKILLs itself after 5 tokens";
    require_root("root_fastapi_server_kills_itself_mid_stream");
    let mut server = start_server(ServerKind::FastApi, &[]);
    let pid = server.pid();
    let mut agent = start_agent(&Agent::for_pids(&[pid]));

    // two normal requests first, on the same process
    let ok = run_client(server.port, &ClientRun::sse(2, 1, "ok-"));
    let missing = agent.wait_for_paths(&paths(&ok), Duration::from_secs(20));
    assert!(
        missing.is_empty(),
        "{title}: normal requests before the crash not reported: {missing:?}"
    );

    let mut crash = ClientRun::sse(1, 1, "crash-");
    crash.tokens = 40;
    crash.crash_after = Some(5);
    let recs = run_client(server.port, &crash);
    let c = &recs[0];
    assert!(
        c.aborted,
        "{title}: setup: the client should see the stream cut, got {:?}",
        c.raw
    );
    assert_eq!(
        c.chunks, 5,
        "{title}: setup: the client should get exactly 5 chunks before the crash"
    );
    assert!(
        server.proc.wait_timeout(Duration::from_secs(5)).is_some(),
        "{title}: setup: the server should have killed itself"
    );

    check_aborted_record(title, &mut agent, c, pid);
    // no pause: `stop` reads the agent's output to its end (duplicates too)
    let _ = agent.stop(); // it may already have exited with its only target gone
    let expected: Vec<&ClientRecord> = ok.iter().chain(recs.iter()).collect();
    check_exactly_once(title, &agent, &expected);
}

#[test]
fn root_stdlib_server_killed_externally_mid_stream() {
    let title = "stdlib http.server SIGKILLed by the test mid-stream";
    require_root("root_stdlib_server_killed_externally_mid_stream");
    let mut server = start_server(ServerKind::Stdlib, &[]);
    let pid = server.pid();
    let port = server.port;
    let mut agent = start_agent(&Agent::for_pids(&[pid]));

    let ok = run_client(port, &ClientRun::sse(2, 1, "ok-"));
    let missing = agent.wait_for_paths(&paths(&ok), Duration::from_secs(20));
    assert!(
        missing.is_empty(),
        "{title}: normal requests before the kill not reported: {missing:?}"
    );

    // a 200-token stream (≈ 40 + 200×15 ms ≈ 3 s); kill the server 0.3 s
    // after the client's connection is established, i.e. well inside the
    // stream. Not a fixed delay after spawning the client: under load the
    // client's interpreter can take longer than that to start.
    let mut long = ClientRun::sse(1, 1, "killed-");
    long.tokens = 200;
    let client = thread::spawn(move || run_client(port, &long));
    assert!(
        wait_for_established(port, Duration::from_secs(30)),
        "{title}: setup: the client never connected to :{port}"
    );
    thread::sleep(Duration::from_millis(300));
    server.proc.kill();
    let recs = client.join().expect("client thread");
    let c = &recs[0];
    assert!(
        c.aborted,
        "{title}: setup: the client should see the stream cut, got {:?}",
        c.raw
    );
    assert!(
        c.chunks >= 1 && c.chunks < 201,
        "{title}: setup: the kill should land inside the stream (client got {} chunks)",
        c.chunks
    );

    check_aborted_record(title, &mut agent, c, pid);
    let _ = agent.stop(); // reads the agent's output to its end (duplicates too)
    let expected: Vec<&ClientRecord> = ok.iter().chain(recs.iter()).collect();
    check_exactly_once(title, &agent, &expected);
}
