//! HTTP/2 pieces of the root tests (tests/ebpf_http2.rs): the gRPC and node
//! servers and their measuring clients, nginx in front of them, and the
//! bridge from those clients' JSON records to the [`ClientRecord`]s that
//! [`super::compare`] judges (brackets, TTFT and chunk agreement).
//!
//! Both clients stamp with CLOCK_MONOTONIC (Python's `time.monotonic_ns()`,
//! node's `process.hrtime.bigint()`), the clock of the agent's timestamps.

use std::collections::BTreeMap;
use std::io::Write;
use std::process::{ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{
    python, python_on_port, repo_root, spawn_piped, stdout_lines, str_field, ClientRecord, Proc,
};

/// The gRPC method of tests/servers/grpc_stream.py.
pub const GRPC_PATH: &str = "/tokentrace.test.Streamer/Generate";

/// node, the runtime of the HTTP/2 SSE server and client.
pub fn node() -> String {
    std::env::var("TOKENTRACE_TEST_NODE").unwrap_or_else(|_| "node".to_string())
}

/// A test server that printed `READY <port>`.
pub struct H2Server {
    pub proc: Proc,
    pub port: u16,
}

impl H2Server {
    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }
}

/// [`super::start_ready`] for an HTTP/2 server.
fn start_ready(name: &str, cmd: &mut Command, hint: &str) -> H2Server {
    let (proc, port) = super::start_ready(name, cmd, hint);
    H2Server { proc, port }
}

/// tests/servers/grpc_stream.py on a free port (h2c).
pub fn start_grpc_server() -> H2Server {
    let mut cmd = python_on_port("tests/servers/grpc_stream.py", 0);
    start_ready(
        "grpc_stream.py",
        &mut cmd,
        "is grpcio installed? pip install 'grpcio==1.85.1'; `cargo xtask deps` does",
    )
}

/// tests/servers/h2_sse_server.js on a free port: h2c, or TLS (ALPN h2)
/// with `tls` = (certificate, key).
pub fn start_node_server(tls: Option<(&str, &str)>) -> H2Server {
    let script = repo_root().join("tests/servers/h2_sse_server.js");
    let mut cmd = Command::new(node());
    cmd.arg(&script)
        .args(["--host", "127.0.0.1", "--port", "0"]);
    if let Some((cert, key)) = tls {
        cmd.args(["--tls-cert", cert, "--tls-key", key]);
    }
    start_ready(
        "h2_sse_server.js",
        &mut cmd,
        "is node (>= 18) installed? apt-get install nodejs; `cargo xtask deps` does",
    )
}

/// Which measuring client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum H2Client {
    /// tests/clients/grpc_client.py (grpcio).
    Grpc,
    /// tests/clients/h2_client.js (node http2, SSE).
    Node,
}

/// A client run in progress: its stdout lines, and its stdin to resume a
/// `--pause-after` run.
pub struct ClientProc {
    pub proc: Proc,
    stdin: Option<ChildStdin>,
    rx: Receiver<String>,
    pub records: Vec<Value>,
    what: String,
}

/// Starts a client against `port` with `args` (its own flags).
pub fn spawn_client(kind: H2Client, port: u16, args: &[String]) -> ClientProc {
    let (name, mut cmd) = match kind {
        H2Client::Grpc => {
            let mut c = Command::new(python());
            c.arg("-u")
                .arg(repo_root().join("tests/clients/grpc_client.py"));
            ("grpc_client.py", c)
        }
        H2Client::Node => {
            let mut c = Command::new(node());
            c.arg(repo_root().join("tests/clients/h2_client.js"));
            ("h2_client.js", c)
        }
    };
    cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(args);
    let what = format!("{name} {}", args.join(" "));
    eprintln!("[test] client: {what}");
    let mut child = spawn_piped(&mut cmd, Stdio::piped())
        .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
    let stdin = child.stdin.take();
    let rx = stdout_lines(&mut child);
    ClientProc {
        proc: Proc::guard(name, child),
        stdin,
        rx,
        records: Vec::new(),
        what,
    }
}

impl ClientProc {
    fn parse(&self, line: &str) -> Value {
        serde_json::from_str(line).unwrap_or_else(|e| {
            panic!(
                "{} printed a bad JSON line {line:?}: {e}; stderr:\n{}",
                self.what,
                self.proc.stderr.tail(20)
            )
        })
    }

    /// Collects records until the `{"paused": N}` line (60 s).
    pub fn wait_paused(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left.max(Duration::from_millis(1))) {
                Ok(l) if l.trim().is_empty() => {}
                Ok(l) => {
                    let v = self.parse(&l);
                    if v.get("paused").is_some() {
                        return;
                    }
                    self.records.push(v);
                }
                Err(e) => panic!(
                    "{}: no `paused` line ({e:?}); stderr:\n{}",
                    self.what,
                    self.proc.stderr.tail(20)
                ),
            }
        }
    }

    /// Lets a paused client go on.
    pub fn resume(&mut self) {
        let stdin = self.stdin.as_mut().expect("client stdin is piped");
        stdin
            .write_all(b"go\n")
            .and_then(|()| stdin.flush())
            .expect("writing to the client's stdin");
    }

    /// Waits (3 min) for the client to exit 0 and returns every record;
    /// `expected` records must have come.
    pub fn finish(mut self, expected: usize) -> Vec<Value> {
        self.stdin = None;
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            match self.rx.recv_timeout(Duration::from_millis(100)) {
                Ok(l) if l.trim().is_empty() => {}
                Ok(l) => {
                    let v = self.parse(&l);
                    if v.get("paused").is_none() {
                        self.records.push(v);
                    }
                }
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {
                    assert!(
                        Instant::now() < deadline,
                        "{} did not finish within 180 s",
                        self.what
                    );
                }
            }
        }
        let st = self.proc.wait_timeout(Duration::from_secs(20));
        assert!(
            st.is_some_and(|s| s.success()),
            "{} failed ({st:?}); stderr:\n{}",
            self.what,
            self.proc.stderr.tail(40)
        );
        assert_eq!(
            self.records.len(),
            expected,
            "{} printed {} records, expected {expected}",
            self.what,
            self.records.len()
        );
        std::mem::take(&mut self.records)
    }
}

/// Runs a client to completion.
pub fn run_h2_client(kind: H2Client, port: u16, args: &[&str], expected: usize) -> Vec<Value> {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let t = Instant::now();
    let recs = spawn_client(kind, port, &args).finish(expected);
    eprintln!(
        "[test] {} records in {:.2} s",
        recs.len(),
        t.elapsed().as_secs_f64()
    );
    recs
}

/// A client record as [`super::compare`] reads it. `key_by_request_id`:
/// the record's `path` becomes its x-request-id (every gRPC call has the
/// same `:path`; [`rekey_agent`] does the same to the agent's lines), so
/// compare's one-record-per-path matching is by request id. A cancel the
/// client did itself is not an abort of the client's.
pub fn client_record(v: &Value, key_by_request_id: bool, tls: bool) -> ClientRecord {
    let mut record = ClientRecord::from_value(v.clone());
    if key_by_request_id {
        record.path = str_field(v, "request_id").unwrap_or_default();
    }
    // gRPC: HTTP status 200 is implied by any status the client saw
    record.status = record
        .status
        .or_else(|| v.get("grpc_status").and_then(Value::as_u64).map(|_| 200));
    record.tls = tls;
    record
}

/// Agent lines with `path` replaced by `request_id` (see [`client_record`]);
/// the real `:path` is kept as `h2_path`.
pub fn rekey_agent(agent: &[Value]) -> Vec<Value> {
    agent
        .iter()
        .map(|a| {
            let mut a = a.clone();
            let rid = a.get("request_id").cloned().unwrap_or(Value::Null);
            if let Some(o) = a.as_object_mut() {
                let path = o.get("path").cloned().unwrap_or(Value::Null);
                o.insert("h2_path".into(), path);
                o.insert("path".into(), rid);
            }
            a
        })
        .collect()
}

/// Agent lines by `request_id`.
pub fn by_request_id(agent: &[Value]) -> BTreeMap<String, Vec<Value>> {
    super::group_by(agent, "request_id")
}

/// The HTTP/2 fields of the output contract every h2/gRPC line must carry,
/// as the client saw the call: `protocol`, an odd client `stream_id`,
/// `body`, `chunks_exact`, and for gRPC the `rpc_*` split and the status.
/// `path_may_be_unknown`: after a mid-connection attach HPACK may not
/// decode `:path`/`:method` (`""`), but never report a wrong one.
pub fn check_h2_fields(
    a: &Value,
    c: &Value,
    grpc: bool,
    path_may_be_unknown: bool,
    failures: &mut Vec<String>,
) {
    let rid = str_field(c, "request_id").unwrap_or_default();
    let mut f = |what: String| failures.push(format!("{rid}: {what}: {a}"));
    // After a mid-connection attach the content-type can be a dynamic-table
    // reference HPACK cannot resolve: the contract then says `h2` and, for
    // the body, `chunked` (each DATA frame), and no grpc-status. Those are
    // "unknown", not wrong; the counts are still judged by `compare`.
    let want_protocol = if grpc { "grpc" } else { "h2" };
    let protocol = str_field(a, "protocol");
    let unknown_type = path_may_be_unknown && protocol.as_deref() == Some("h2");
    if protocol.as_deref() != Some(want_protocol) && !unknown_type {
        f(format!(
            "protocol {:?}, expected {want_protocol:?}",
            a.get("protocol")
        ));
    }
    match a.get("stream_id").and_then(Value::as_u64) {
        Some(id) if id % 2 == 1 => {}
        other => f(format!(
            "stream_id {other:?}, expected an odd (client-initiated) stream id"
        )),
    }
    let want_body = if grpc { "grpc" } else { "sse" };
    let body = str_field(a, "body");
    if body.as_deref() != Some(want_body) && !(unknown_type && body.as_deref() == Some("chunked")) {
        f(format!("body {:?}, expected {want_body:?}", a.get("body")));
    }
    if a.get("chunks_exact").and_then(Value::as_bool) != Some(true) {
        f(format!(
            "chunks_exact {:?}, expected true",
            a.get("chunks_exact")
        ));
    }
    let want_path = if grpc {
        GRPC_PATH.to_string()
    } else {
        str_field(c, "path").unwrap_or_default()
    };
    let path = str_field(a, "h2_path").or_else(|| str_field(a, "path"));
    let path_ok = path.as_deref() == Some(want_path.as_str())
        || (path_may_be_unknown && path.as_deref().is_none_or(str::is_empty));
    if !path_ok {
        f(format!("path {path:?}, expected {want_path:?}"));
    }
    if grpc {
        let want_status = c.get("grpc_status").and_then(Value::as_u64);
        let got_status = a.get("grpc_status").and_then(Value::as_u64);
        if got_status != want_status && !(path_may_be_unknown && got_status.is_none()) {
            f(format!(
                "grpc_status {:?}, the client got {want_status:?}",
                a.get("grpc_status")
            ));
        }
        // grpc-message: only its length leaves the agent
        let want_len = c.get("grpc_message_bytes").and_then(Value::as_u64);
        let got_len = a.get("grpc_message_bytes").and_then(Value::as_u64);
        if want_len.unwrap_or(0) > 0 && got_len != want_len && !path_may_be_unknown {
            f(format!(
                "grpc_message_bytes {got_len:?}, the client's grpc-message has {want_len:?} bytes"
            ));
        }
        let labels = [
            ("rpc_system", "grpc"),
            ("rpc_service", "tokentrace.test.Streamer"),
            ("rpc_method", "Generate"),
        ];
        for (k, want) in labels {
            let got = str_field(a, k);
            let ok = got.as_deref() == Some(want) || (path_may_be_unknown && got.is_none());
            if !ok {
                f(format!("{k} {got:?}, expected {want:?}"));
            }
        }
    }
}
