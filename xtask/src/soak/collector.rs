//! The soak's OTLP backend: rotel (PyPI `rotel`, a Rust OpenTelemetry
//! collector), run as tests/otel_export.rs runs it, printing every span it
//! decoded (`--debug-log traces --debug-log-verbosity detailed`). Its output
//! is read as it comes: every span is counted and the trace id of every
//! SERVER span kept with when it arrived, across all of the collector's lives (it is taken down
//! and started again on the same port).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tokentrace_testkit::rotel;

/// What every collector life received, together.
pub struct Seen {
    t0: Instant,
    pub spans: AtomicU64,
    /// Trace id of every SERVER span -> when its line was read (seconds
    /// since the soak's start): how soon an outage's backlog arrived.
    pub server_traces: Mutex<HashMap<String, f64>>,
}

impl Seen {
    pub fn new(t0: Instant) -> Self {
        Self {
            t0,
            spans: AtomicU64::new(0),
            server_traces: Mutex::new(HashMap::new()),
        }
    }

    pub fn has_trace(&self, trace: &str) -> bool {
        self.arrived_at(trace).is_some()
    }

    /// When the first SERVER span of `trace` reached the collector.
    pub fn arrived_at(&self, trace: &str) -> Option<f64> {
        self.server_traces
            .lock()
            .ok()
            .and_then(|s| s.get(trace).copied())
    }
}

/// A running collector.
pub struct Collector {
    child: Child,
    readers: Vec<JoinHandle<()>>,
    pid_file: PathBuf,
}

impl Collector {
    /// Starts rotel on the given ports and waits until gRPC accepts.
    pub fn start(
        bin: &Path,
        grpc_port: u16,
        http_port: u16,
        seen: &Arc<Seen>,
    ) -> Result<Collector> {
        let pid_file = std::env::temp_dir().join(format!("tokentrace-soak-rotel-{grpc_port}.pid"));
        // Printed as received (--disable-batching): nothing acknowledged is
        // still in a batch when the collector is taken down.
        let mut child = rotel::command(
            bin,
            grpc_port,
            http_port,
            &["traces"],
            &["--disable-batching"],
            &pid_file,
        )
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
        let readers = rotel::read_output(&mut child, || SpanCounter {
            parser: SpanParser::default(),
            seen: Arc::clone(seen),
        });
        if let Err(e) = rotel::wait_listening(&mut child, &[grpc_port], Duration::from_secs(20)) {
            let _ = child.kill();
            return Err(e);
        }
        Ok(Collector {
            child,
            readers,
            pid_file,
        })
    }

    /// Takes the collector down (SIGTERM, SIGKILL after 10 s) and reads its
    /// output to the end.
    pub fn stop(mut self) -> Result<()> {
        let pid = self.child.id();
        crate::util::terminate(&mut self.child, pid, Duration::from_secs(10))?;
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        let _ = std::fs::remove_file(&self.pid_file);
        Ok(())
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One output stream of the collector, its spans counted into `seen`.
struct SpanCounter {
    parser: SpanParser,
    seen: Arc<Seen>,
}

impl rotel::LineSink for SpanCounter {
    fn line(&mut self, line: &str) {
        self.parser.line(line, &self.seen);
    }

    fn end(&mut self) {
        self.parser.finish(&self.seen);
    }
}

/// Streaming reader of rotel's detailed span output: `Span #N` opens a
/// span, `Trace ID : x` and `Kind : SPAN_KIND_SERVER` describe it,
/// attribute lines start with `->`.
#[derive(Default)]
struct SpanParser {
    in_spans: bool,
    open: bool,
    trace: Option<String>,
    server: bool,
}

impl SpanParser {
    fn line(&mut self, line: &str, seen: &Seen) {
        let t = line.trim();
        if t.starts_with("ResourceSpans #") {
            self.finish(seen);
            self.in_spans = true;
            return;
        }
        if t.starts_with("ResourceMetrics #") || t.starts_with("ResourceLogs #") {
            self.finish(seen);
            self.in_spans = false;
            return;
        }
        if !self.in_spans || t.starts_with("->") {
            return;
        }
        if t.starts_with("Span #") {
            self.finish(seen);
            self.open = true;
            return;
        }
        let value = |prefix: &str| {
            t.strip_prefix(prefix)
                .map(|r| r.trim_start_matches([' ', ':']).trim().to_string())
        };
        if let Some(v) = value("Trace ID") {
            self.trace = Some(v);
        } else if let Some(v) = value("Kind") {
            self.server = v == "SPAN_KIND_SERVER";
        }
    }

    fn finish(&mut self, seen: &Seen) {
        if self.open {
            seen.spans.fetch_add(1, Ordering::Relaxed);
            if let (true, Some(trace)) = (self.server, self.trace.take()) {
                let at = seen.t0.elapsed().as_secs_f64();
                if let Ok(mut s) = seen.server_traces.lock() {
                    s.entry(trace).or_insert(at);
                }
            }
        }
        self.open = false;
        self.trace = None;
        self.server = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_are_counted_and_server_trace_ids_kept() {
        let text = "\
ResourceSpans #0
Resource attributes:
     -> service.name: Str(python3)
ScopeSpans #0
Span #0
    Trace ID       : 00000000000000010000000000000002
    Parent ID      : 0000000000000003
    ID             : 1111111111111111
    Name           : POST /v1/chat/completions
    Kind           : SPAN_KIND_SERVER
Attributes:
     -> Kind: Str(not a field)
Span #1
    Trace ID       : 00000000000000010000000000000002
    Kind           : SPAN_KIND_INTERNAL
ResourceMetrics #0
Span #9
    Trace ID       : ffff
    Kind           : SPAN_KIND_SERVER
ResourceSpans #1
Span #0
    Kind           : SPAN_KIND_SERVER
    Trace ID       : 00000000000000010000000000000009
";
        let seen = Seen::new(Instant::now());
        let mut p = SpanParser::default();
        for l in text.lines() {
            p.line(l, &seen);
        }
        p.finish(&seen);
        assert_eq!(seen.spans.load(Ordering::Relaxed), 3);
        assert!(seen.has_trace("00000000000000010000000000000002"));
        assert!(seen.has_trace("00000000000000010000000000000009"));
        assert!(!seen.has_trace("ffff"), "a metrics section holds no spans");
    }
}
