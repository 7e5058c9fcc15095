//! The traced side of the soak: one `tokentrace run` (JSON lines on stdout,
//! info log on stderr, Prometheus endpoint, OTLP/gRPC or HTTP to the collector), its
//! reports timestamped as they arrive, and the probes of its memory and
//! counters.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// One request the agent reported.
#[derive(Clone, Debug)]
pub struct Report {
    pub rid: u64,
    pub pid: u32,
    /// When its JSON line reached us (seconds since the soak's start).
    pub at: f64,
}

type Lines = Arc<Mutex<Vec<(f64, String)>>>;

/// The OTLP protocol the soak's agents export with (`--protocol`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    Grpc,
    Http,
}

impl Protocol {
    pub fn parse(value: &str) -> Option<Self> {
        match value {
            "grpc" => Some(Protocol::Grpc),
            "http" => Some(Protocol::Http),
            _ => None,
        }
    }

    /// As `--otlp-protocol` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Grpc => "grpc",
            Protocol::Http => "http",
        }
    }
}

/// Where the agent sends OTLP: the collector's port for `protocol`.
#[derive(Clone, Copy, Debug)]
pub struct Otlp {
    pub protocol: Protocol,
    pub port: u16,
}

pub struct Agent {
    child: Child,
    pub pid: u32,
    pub ready_at: f64,
    reports: Arc<Mutex<Vec<Report>>>,
    other_lines: Arc<Mutex<Vec<String>>>,
    log: Lines,
    t0: Instant,
    readers: Vec<JoinHandle<()>>,
}

/// What a stopped (or killed) agent left: its reports and log.
pub struct Finished {
    pub reports: Vec<Report>,
    /// JSON lines that named no soak request (the first 1000), for the
    /// post-mortem of requests the soak counted as unseen.
    pub other_lines: Vec<String>,
    /// When the process was reaped (seconds since the soak's start).
    pub reaped_at: f64,
    pub log: Vec<(f64, String)>,
    pub exit: String,
}

fn first_log(log: &[(f64, String)], needle: &str) -> Option<f64> {
    log.iter()
        .find(|(_, l)| l.contains(needle))
        .map(|(t, _)| *t)
}

impl Agent {
    /// Starts the agent with `selector` (e.g. `--port 8000`) and waits for
    /// its `tokentrace: ready` line.
    pub fn start(
        bin: &Path,
        selector: &[String],
        otlp: Otlp,
        metrics_port: u16,
        t0: Instant,
    ) -> Result<Agent> {
        let mut child = Command::new(bin)
            .arg("run")
            .args(selector)
            .args(["--output", "json", "--log-level", "info", "--no-control"])
            .args([
                "--otlp-endpoint",
                &format!("http://127.0.0.1:{}", otlp.port),
            ])
            .args(["--otlp-protocol", otlp.protocol.name()])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let pid = child.id();
        let reports = Arc::new(Mutex::new(Vec::new()));
        let other_lines = Arc::new(Mutex::new(Vec::new()));
        let log: Lines = Arc::new(Mutex::new(Vec::new()));
        let stdout = child.stdout.take().context("agent stdout")?;
        let stderr = child.stderr.take().context("agent stderr")?;
        let (ready_tx, ready_rx) = mpsc::channel();
        let readers = vec![
            {
                let reports = Arc::clone(&reports);
                let other = Arc::clone(&other_lines);
                thread::spawn(move || read_reports(stdout, &reports, &other, t0))
            },
            {
                let log = Arc::clone(&log);
                thread::spawn(move || read_log(stderr, &log, t0, ready_tx))
            },
        ];
        let mut agent = Agent {
            child,
            pid,
            ready_at: 0.0,
            reports,
            other_lines,
            log,
            t0,
            readers,
        };
        match ready_rx.recv_timeout(Duration::from_secs(120)) {
            Ok(at) => agent.ready_at = at,
            Err(_) => {
                let tail = agent.log_tail(20);
                let _ = agent.child.kill();
                bail!("the agent did not get ready within 120 s:\n{tail}");
            }
        }
        Ok(agent)
    }

    pub fn reports(&self) -> Vec<Report> {
        self.reports.lock().map(|v| v.clone()).unwrap_or_default()
    }

    pub fn first_log(&self, needle: &str) -> Option<f64> {
        first_log(
            &self.log.lock().map(|v| v.clone()).unwrap_or_default(),
            needle,
        )
    }

    fn log_tail(&self, n: usize) -> String {
        let log = self.log.lock().map(|v| v.clone()).unwrap_or_default();
        let start = log.len().saturating_sub(n);
        log[start..]
            .iter()
            .map(|(_, l)| l.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// SIGKILL: no chance to detach anything. Returns when it is reaped.
    pub fn kill9(self) -> Result<(f64, Finished)> {
        let at = self.t0.elapsed().as_secs_f64();
        crate::util::status("kill", &["-KILL", &self.pid.to_string()])?;
        Ok((at, self.finish()?))
    }

    /// SIGTERM: the agent flushes its export queue and prints its summary.
    pub fn stop(self) -> Result<Finished> {
        crate::util::status("kill", &["-TERM", &self.pid.to_string()])?;
        self.finish()
    }

    fn finish(mut self) -> Result<Finished> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(st) = self.child.try_wait()? {
                break st;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                break self.child.wait()?;
            }
            thread::sleep(Duration::from_millis(5));
        };
        let reaped_at = self.t0.elapsed().as_secs_f64();
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        Ok(Finished {
            reports: self.reports(),
            other_lines: self
                .other_lines
                .lock()
                .map(|v| v.clone())
                .unwrap_or_default(),
            reaped_at,
            log: self.log.lock().map(|v| v.clone()).unwrap_or_default(),
            exit: status.to_string(),
        })
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn read_reports(
    stdout: impl Read,
    reports: &Mutex<Vec<Report>>,
    other: &Mutex<Vec<String>>,
    t0: Instant,
) {
    for line in BufReader::new(stdout).lines().map_while(Result::ok) {
        let at = t0.elapsed().as_secs_f64();
        if let Some((rid, pid)) = parse_report(&line) {
            if let Ok(mut v) = reports.lock() {
                v.push(Report { rid, pid, at });
            }
        } else if let Ok(mut v) = other.lock() {
            if v.len() < 1000 {
                v.push(line);
            }
        }
    }
}

/// `rid` (from `?rid=soak-N` in the path) and `pid` of a soak request's
/// JSON line; None for anything else.
fn parse_report(line: &str) -> Option<(u64, u32)> {
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    let path = v.get("path")?.as_str()?;
    let rid = path.split_once("rid=soak-")?.1;
    let rid = rid.split(['&', ' ']).next()?.parse().ok()?;
    let pid = u32::try_from(v.get("pid")?.as_u64()?).ok()?;
    Some((rid, pid))
}

/// Keeps the log (bounded: the soak's log is a few lines a minute; a
/// chatty agent keeps its first 100k) and signals the ready line.
fn read_log(stderr: impl Read, log: &Lines, t0: Instant, ready: mpsc::Sender<f64>) {
    for line in BufReader::new(stderr).lines().map_while(Result::ok) {
        let at = t0.elapsed().as_secs_f64();
        if line.contains("tokentrace: ready") {
            let _ = ready.send(at);
        }
        if let Ok(mut v) = log.lock() {
            if v.len() < 100_000 {
                v.push((at, line));
            }
        }
    }
}

/// The agent's Prometheus text, or None when it does not answer.
pub fn scrape(port: u16) -> Option<String> {
    let (status, body) = tokentrace_testkit::http::get(port, "/metrics", Duration::from_secs(5))?;
    (status == 200).then_some(body)
}

/// Resident set size of `pid` in KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn soak_reports_are_recognised_by_their_rid() {
        let line = r#"{"pid":42,"path":"/v1/chat/completions?rid=soak-17","ttft_ms":1.0}"#;
        assert_eq!(parse_report(line), Some((17, 42)));
        assert_eq!(
            parse_report(r#"{"pid":42,"path":"/v1/chat/completions?rid=0-1"}"#),
            None
        );
        assert_eq!(parse_report("not json"), None);
        assert_eq!(
            parse_report(r#"{"pid":-1,"path":"/x?rid=soak-1"}"#),
            None,
            "a pid that is not a u32"
        );
    }
}
