//! Running rotel (PyPI `rotel`, a Rust OpenTelemetry collector in the
//! wheel) as the OTLP backend of the export tests and of `cargo xtask
//! soak`: where its binary is, its command line, its output read line by
//! line as it comes, and the wait for its receivers. What each reader makes
//! of the lines (all kept, or spans counted) is the caller's.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// rotel's binary, inside the `rotel` package of `python`.
pub fn binary(python: impl AsRef<OsStr>) -> Result<PathBuf> {
    let python = python.as_ref();
    let out = Command::new(python)
        .args([
            "-c",
            "import os, rotel; print(os.path.join(os.path.dirname(rotel.__file__), 'rotel-agent'))",
        ])
        .output()
        .with_context(|| format!("cannot run {}", python.to_string_lossy()))?;
    if !out.status.success() {
        bail!(
            "the rotel collector is not installed (`cargo xtask deps` and .ci/run install rotel==0.0.1a15): {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// rotel exporting nowhere (blackhole) but printing what it decoded
/// (`--debug-log` each of `debug_logs`, detailed), with its OTLP gRPC and
/// HTTP receivers on loopback; `extra` adds flags (batching).
pub fn command(
    bin: &Path,
    grpc_port: u16,
    http_port: u16,
    debug_logs: &[&str],
    extra: &[&str],
    pid_file: &Path,
) -> Command {
    let mut cmd = Command::new(bin);
    cmd.args(["start", "--exporter", "blackhole"])
        .args(["--otlp-grpc-endpoint", &format!("127.0.0.1:{grpc_port}")])
        .args(["--otlp-http-endpoint", &format!("127.0.0.1:{http_port}")]);
    for log in debug_logs {
        cmd.args(["--debug-log", log]);
    }
    cmd.args(["--debug-log-verbosity", "detailed"])
        .args(extra)
        .arg("--pid-file")
        .arg(pid_file)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// What one of the collector's output streams is read into.
pub trait LineSink: Send + 'static {
    fn line(&mut self, line: &str);
    /// The stream ended (the collector exited).
    fn end(&mut self) {}
}

/// Reads the child's stdout and stderr, each on a thread of its own, into
/// a sink made by `sink` for each stream; the threads end with the child.
pub fn read_output<S: LineSink>(child: &mut Child, sink: impl Fn() -> S) -> Vec<JoinHandle<()>> {
    let streams: [Option<Box<dyn Read + Send>>; 2] = [
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
    ];
    streams
        .into_iter()
        .flatten()
        .map(|stream| {
            let mut sink = sink();
            thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    sink.line(&line);
                }
                sink.end();
            })
        })
        .collect()
}

/// Waits until each of `ports` accepts a connection; an error when the
/// child exits first or `timeout` passes.
pub fn wait_listening(child: &mut Child, ports: &[u16], timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    for &port in ports {
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Some(st) = child.try_wait()? {
                bail!("rotel exited ({st}) before listening on {port}");
            }
            if Instant::now() > deadline {
                bail!(
                    "rotel is not listening on {port} after {} s",
                    timeout.as_secs()
                );
            }
            thread::sleep(Duration::from_millis(50));
        }
    }
    Ok(())
}
