//! Root-only: send-queue holds (sock.bpf.c `note_unsent` / `release_hold`)
//! against holds made on purpose with TCP_CORK (tests/servers/cork_server.py),
//! judged by the server's own CLOCK_MONOTONIC stamps, which load cannot
//! move:
//!
//! - a hold whose bytes still wait when a segment from the client arrives
//!   is reported, released no later than the client's byte (the server
//!   stamps after its recv() of it returned);
//! - a hold whose bytes left with no segment coming in (the server pushed
//!   them: TCP_NODELAY on, uncork) is not reported as lasting until the
//!   next segment: its `socket_ms` stays within the cork time. Before the
//!   fix the hold stayed set until the client's (delayed) ACK and was
//!   reported ~40 ms long.
//!
//! The client keeps TCP_QUICKACK off before every read and does not read
//! for 60 ms after event 0, so it ACKs late (delayed ACK, ~40 ms): in the
//! stale case its ACK comes ~35 ms after event 1 was pushed out, the case
//! in which a hold left set after its bytes went out was misreported.
//!
//! Run (as root; CI does):
//!   cargo test -p tokentrace --test ebpf_send_hold -- --test-threads=1 --nocapture

use tokentrace_testkit as common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use common::*;
use serde_json::Value;

/// How long the client waits after event 0, not reading (and in `held`
/// mode then sends its byte, which the corked event 1 waits for).
const CLIENT_WAIT_MS: u64 = 60;

/// The cork server, its port, and its stamp lines.
fn start_cork_server() -> (Proc, u16, mpsc::Receiver<Value>) {
    let server = StampingServer::start(
        "tests/servers/cork_server.py",
        &["--host", "127.0.0.1", "--port", "0"],
    );
    (server.proc, server.port, server.lines)
}

/// Leaves quick-ACK mode: the kernel delays this socket's next ACKs.
fn delay_acks(s: &TcpStream) {
    let off: libc::c_int = 0;
    // SAFETY: setsockopt reads an int from a pointer to our local for the
    // fd we own; a failure is reported, not ignored.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_QUICKACK,
            (&off as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "setsockopt(TCP_QUICKACK, 0) failed");
}

/// One request on its own connection. After event 0 the client waits
/// without reading; in `held` mode it then sends one byte.
fn run_client(port: u16, mode: &str, rid: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect to the cork server");
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("read timeout");
    s.set_nodelay(true).expect("TCP_NODELAY on the client");
    write!(
        s,
        "GET /cork?mode={mode}&rid={rid} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    )
    .expect("send request");
    let mut got = Vec::new();
    let mut waited = false;
    let mut buf = [0u8; 4096];
    loop {
        delay_acks(&s);
        let n = s.read(&mut buf).expect("read the response");
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
        // Not reading meanwhile keeps the ACKs delayed: a read that
        // drains two small pushed segments makes the kernel ACK at once.
        if !waited && String::from_utf8_lossy(&got).contains("\"i\":0") {
            thread::sleep(Duration::from_millis(CLIENT_WAIT_MS));
            if mode == "held" {
                s.write_all(b"x").expect("send the client's byte");
            }
            waited = true;
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// `socket_ms` of chunk `i`'s stall; 0 when the chunk is not listed (with
/// a 1 ms threshold, a chunk with a hold of at least 1 ms would be).
fn socket_ms(line: &Value, i: u64) -> f64 {
    line["stalls"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|s| s["chunk"].as_u64() == Some(i))
        .and_then(|s| s["socket_ms"].as_f64())
        .unwrap_or(0.0)
}

fn stamp(truth: &Value, k: &str) -> f64 {
    truth[k]
        .as_u64()
        .unwrap_or_else(|| panic!("server stamp {k} missing: {truth}")) as f64
        / 1e6
}

/// Runs one request; returns the agent's line and the server's stamps.
fn one_request(
    agent: &mut Agent,
    server: &Proc,
    stamps: &mpsc::Receiver<Value>,
    port: u16,
    mode: &str,
    rid: &str,
) -> (Value, Value) {
    let body = run_client(port, mode, rid);
    assert!(
        body.contains("\"i\":3") && body.ends_with("0\r\n\r\n"),
        "{rid}: incomplete response {body:?}"
    );
    let truth = stamps
        .recv_timeout(Duration::from_secs(10))
        .unwrap_or_else(|_| {
            panic!(
                "{rid}: no stamps from the server: {}",
                server.stderr.tail(20)
            )
        });
    let path = format!("/cork?mode={mode}&rid={rid}");
    let line = agent
        .wait_for_path(&path, Duration::from_secs(20))
        .unwrap_or_else(|| {
            panic!(
                "{rid}: the agent did not report {path}: {}",
                agent.proc.stderr.tail(20)
            )
        })
        .v;
    (line, truth)
}

#[test]
fn root_a_send_hold_is_reported_while_its_bytes_wait_and_not_after_they_left() {
    require_root("root_a_send_hold_is_reported_while_its_bytes_wait_and_not_after_they_left");
    let (server, port, stamps) = start_cork_server();
    let config =
        std::env::temp_dir().join(format!("tokentrace-test-{}-hold.yaml", std::process::id()));
    std::fs::write(&config, "explain:\n  stall_threshold: 1ms\n").expect("write the agent config");
    let mut args = Agent::for_port(port);
    args.extend(["--config".into(), config.display().to_string()]);
    let mut agent = start_agent(&args);
    let mut failures = Vec::new();
    for round in 0..3 {
        for mode in ["held", "stale"] {
            let rid = format!("{mode}-{round}");
            let (line, truth) = one_request(&mut agent, &server, &stamps, port, mode, &rid);
            assert!(
                truth["unsent_after_1"].as_i64().unwrap_or(0) > 0,
                "{rid}: event 1 was sent at once (no hold): {truth}"
            );
            let held = socket_ms(&line, 1);
            if mode == "held" {
                // released by a segment from the client while event 1 was
                // corked, at the latest the client's byte, which had
                // arrived when the server's recv returned (a2)
                let upper = stamp(&truth, "a2") - stamp(&truth, "a0");
                eprintln!("[test] {rid}: chunk 1 socket_ms {held:.3} in (0, {upper:.3}]");
                if !(held > 0.0 && held <= upper) {
                    failures.push(format!(
                        "{rid}: the hold of chunk 1 (corked until the client's byte came) is {held:.3} ms, not in (0, {upper:.3}] ms\n  {}",
                        line["stalls"]
                    ));
                }
            } else {
                assert_eq!(
                    truth["unsent_after_push"].as_i64(),
                    Some(0),
                    "{rid}: event 1 was still unsent after the push: {truth}"
                );
                // pushed out with no segment coming in: the hold ended by b1
                let cork = stamp(&truth, "b1") - stamp(&truth, "b0");
                eprintln!(
                    "[test] {rid}: chunk 1 socket_ms {held:.3}, bytes left within {cork:.3} ms"
                );
                if held > cork {
                    failures.push(format!(
                        "{rid}: chunk 1's bytes left when the server pushed them ({cork:.3} ms after the write began), \
                         but the agent reports them held {held:.3} ms (until a later segment)\n  {}",
                        line["stalls"]
                    ));
                }
            }
        }
    }
    let stop = agent.stop();
    let _ = std::fs::remove_file(&config);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(stop.is_some_and(|s| s.success()), "agent exit {stop:?}");
}
