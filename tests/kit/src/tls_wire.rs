//! The TLS wire reference of the root tests: a loopback capture with
//! payloads (tests/clients/wire_capture.py --payload), the client's TLS key
//! log, and tests/clients/tls_wire.py decrypting one into per-request wire
//! times a machine's load cannot move.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

use super::wire::Capture;
use super::{python, repo_root};

/// One request as the wire saw it (CLOCK_MONOTONIC ns; see tls_wire.py).
#[derive(Debug, Clone)]
pub struct WireRequest {
    pub client_port: u16,
    /// HTTP/1.1: 0 for the connection's first request; HTTP/2: stream id.
    pub index: u64,
    pub rid: Option<String>,
    pub t_request: u64,
    pub t_first_event: Option<u64>,
    pub t_hello: Option<u64>,
    pub t_finished: Option<u64>,
}

/// Stops `capture` and decrypts it with `keylog` (None: plaintext). Panics
/// on a connection tls_wire.py could not read: the reference must be whole.
pub fn wire_requests(capture: Capture, port: u16, keylog: Option<&Path>) -> Vec<WireRequest> {
    let file = capture.finish_file();
    let mut cmd = Command::new(python());
    cmd.arg(repo_root().join("tests/clients/tls_wire.py"))
        .arg("--capture")
        .arg(&file)
        .args(["--port", &port.to_string()]);
    if let Some(k) = keylog {
        cmd.arg("--keylog").arg(k);
    }
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run tls_wire.py: {e}"));
    let _ = std::fs::remove_file(&file);
    assert!(
        out.status.success(),
        "tls_wire.py failed ({}; it needs python3-cryptography, `cargo xtask deps` installs it): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let mut rows = Vec::new();
    let mut errors = Vec::new();
    for line in text.lines() {
        let v: Value = serde_json::from_str(line).expect("tls_wire.py prints JSON lines");
        if let Some(e) = v.get("error") {
            errors.push(format!("client port {}: {e}", v["client_port"]));
            continue;
        }
        let u = |k: &str| v.get(k).and_then(Value::as_u64);
        rows.push(WireRequest {
            client_port: u16::try_from(u("client_port").expect("client_port")).expect("port"),
            index: u("index").expect("index"),
            rid: v.get("rid").and_then(Value::as_str).map(str::to_string),
            t_request: u("t_request").expect("t_request"),
            t_first_event: u("t_first_event"),
            t_hello: u("t_hello"),
            t_finished: u("t_finished"),
        });
    }
    assert!(
        errors.is_empty(),
        "the capture could not be read for {} connections:\n{}",
        errors.len(),
        errors.join("\n")
    );
    rows
}
