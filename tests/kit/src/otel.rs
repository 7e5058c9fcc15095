//! The rotel OpenTelemetry collector (PyPI `rotel`, a Rust binary in the
//! wheel) for the export tests: started with its debug output on, which
//! prints every span and metric data point it decoded; a parser of that
//! output; and a scrape of the agent's Prometheus endpoint.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use super::{python, rotel};

// ------------------------------------------------------------------ rotel

/// A running rotel collector, killed on drop.
pub struct Collector {
    child: Child,
    stdout: Arc<Mutex<Vec<String>>>,
    pub grpc_port: u16,
    pub http_port: u16,
    pid_file: PathBuf,
}

/// Keeps every line of the collector's output.
struct KeepAll(Arc<Mutex<Vec<String>>>);

impl rotel::LineSink for KeepAll {
    fn line(&mut self, line: &str) {
        if let Ok(mut v) = self.0.lock() {
            v.push(line.to_string());
        }
    }
}

impl Collector {
    /// Starts rotel on the given ports and waits until both accept.
    pub fn start(grpc_port: u16, http_port: u16) -> Collector {
        let bin = rotel::binary(python()).unwrap_or_else(|e| panic!("{e:#}"));
        let pid_file = std::env::temp_dir().join(format!(
            "tokentrace-test-rotel-{}-{grpc_port}.pid",
            std::process::id()
        ));
        let mut child = rotel::command(
            &bin,
            grpc_port,
            http_port,
            &["traces", "metrics"],
            &["--batch-timeout", "50ms"],
            &pid_file,
        )
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        let stdout = Arc::new(Mutex::new(Vec::new()));
        rotel::read_output(&mut child, || KeepAll(Arc::clone(&stdout)));
        if let Err(e) =
            rotel::wait_listening(&mut child, &[grpc_port, http_port], Duration::from_secs(20))
        {
            let _ = child.kill();
            panic!("{e:#}: {:?}", stdout.lock().map(|v| v.clone()));
        }
        eprintln!(
            "[test] rotel ready: grpc {grpc_port}, http {http_port}, pid {}",
            child.id()
        );
        Collector {
            child,
            stdout,
            grpc_port,
            http_port,
            pid_file,
        }
    }

    pub fn lines(&self) -> Vec<String> {
        self.stdout.lock().map(|v| v.clone()).unwrap_or_default()
    }

    pub fn spans(&self) -> Vec<RecvSpan> {
        parse_spans(&self.lines())
    }

    /// Waits until every trace id in `traces` has a SERVER span.
    pub fn wait_for_traces(&self, traces: &BTreeSet<String>, timeout: Duration) -> Vec<RecvSpan> {
        let deadline = Instant::now() + timeout;
        loop {
            let spans = self.spans();
            let seen: BTreeSet<String> = spans
                .iter()
                .filter(|s| s.kind == "SPAN_KIND_SERVER")
                .map(|s| s.trace_id.clone())
                .collect();
            if traces.is_subset(&seen) || Instant::now() >= deadline {
                return spans;
            }
            thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.pid_file);
        if thread::panicking() {
            let lines = self.lines();
            let start = lines.len().saturating_sub(40);
            eprintln!(
                "---- rotel output tail ----\n{}\n---- end rotel ----",
                lines[start..].join("\n")
            );
        }
    }
}

// ------------------------------------------------- rotel debug output parser

/// One span as rotel printed it.
#[derive(Debug, Clone, Default)]
pub struct RecvSpan {
    pub resource: BTreeMap<String, String>,
    pub trace_id: String,
    pub parent_id: String,
    pub span_id: String,
    pub name: String,
    pub kind: String,
    pub start: u64,
    pub end: u64,
    pub status_code: String,
    pub attrs: BTreeMap<String, String>,
    pub events: Vec<String>,
}

impl RecvSpan {
    /// An attribute's value without its `Type(...)` wrapper.
    pub fn attr(&self, key: &str) -> Option<&str> {
        unwrap_value(self.attrs.get(key)?)
    }

    pub fn attr_f64(&self, key: &str) -> Option<f64> {
        self.attr(key)?.parse().ok()
    }

    pub fn resource_attr(&self, key: &str) -> Option<&str> {
        unwrap_value(self.resource.get(key)?)
    }
}

/// `Str(x)` → `x`, `Double(1.5)` → `1.5`, ...
pub fn unwrap_value(v: &str) -> Option<&str> {
    let open = v.find('(')?;
    v.strip_suffix(')').map(|s| &s[open + 1..])
}

/// `     -> key: Value` → (key, Value).
pub fn arrow_pair(line: &str) -> Option<(String, String)> {
    let rest = line.trim_start().strip_prefix("-> ")?;
    let (k, v) = rest.split_once(": ")?;
    Some((k.to_string(), v.to_string()))
}

#[derive(Clone, Copy, PartialEq)]
enum Section {
    None,
    Resource,
    SpanAttrs,
    Events,
    Other,
}

pub fn parse_spans(lines: &[String]) -> Vec<RecvSpan> {
    let mut spans: Vec<RecvSpan> = Vec::new();
    let mut resource = BTreeMap::new();
    let mut section = Section::None;
    let mut in_spans = false;
    for line in lines {
        let t = line.trim();
        if t.starts_with("ResourceSpans #") {
            in_spans = true;
            resource = BTreeMap::new();
            section = Section::None;
            continue;
        }
        if t.starts_with("ResourceMetrics #") || t.starts_with("ResourceLogs #") {
            in_spans = false;
            continue;
        }
        if !in_spans {
            continue;
        }
        if t == "Resource attributes:" {
            section = Section::Resource;
            continue;
        }
        if t.starts_with("Span #") {
            spans.push(RecvSpan {
                resource: resource.clone(),
                ..Default::default()
            });
            section = Section::Other;
            continue;
        }
        if t == "Attributes:" {
            section = Section::SpanAttrs;
            continue;
        }
        if t == "Events:" || t.starts_with("SpanEvent #") {
            section = Section::Events;
            continue;
        }
        if let Some((k, v)) = arrow_pair(line) {
            match section {
                Section::Resource => {
                    resource.insert(k, v);
                }
                Section::SpanAttrs => {
                    if let Some(s) = spans.last_mut() {
                        s.attrs.insert(k, v);
                    }
                }
                Section::Events if k == "Name" => {
                    if let Some(s) = spans.last_mut() {
                        s.events.push(v);
                    }
                }
                _ => {}
            }
            continue;
        }
        let Some(s) = spans.last_mut() else {
            section = Section::Other;
            continue;
        };
        section = Section::Other;
        let field = |prefix: &str| {
            t.strip_prefix(prefix)
                .map(|r| r.trim_start_matches([' ', ':']).trim().to_string())
        };
        if let Some(v) = field("Trace ID") {
            s.trace_id = v;
        } else if let Some(v) = field("Parent ID") {
            s.parent_id = v;
        } else if let Some(v) = field("ID") {
            s.span_id = v;
        } else if let Some(v) = field("Name") {
            s.name = v;
        } else if let Some(v) = field("Kind") {
            s.kind = v;
        } else if let Some(v) = field("Start time") {
            s.start = v.parse().unwrap_or(0);
        } else if let Some(v) = field("End time") {
            s.end = v.parse().unwrap_or(0);
        } else if let Some(v) = field("Status code") {
            s.status_code = v;
        }
    }
    spans
}

/// Histogram counts of the latest OTLP metrics push that carried `service`:
/// metric name → sum of its data points' counts.
pub fn latest_otlp_histogram_counts(lines: &[String], service: &str) -> BTreeMap<String, u64> {
    let mut latest = BTreeMap::new();
    let mut current: BTreeMap<String, u64> = BTreeMap::new();
    let mut in_service = false;
    let mut in_resource = false;
    let mut metric = String::new();
    for line in lines {
        let t = line.trim();
        if t.starts_with("ResourceMetrics #") || t.starts_with("ResourceSpans #") {
            if in_service && !current.is_empty() {
                latest = std::mem::take(&mut current);
            }
            current.clear();
            in_service = false;
            in_resource = false;
            continue;
        }
        if t == "Resource attributes:" {
            in_resource = true;
            continue;
        }
        if let Some((k, v)) = arrow_pair(line) {
            if in_resource && k == "service.name" && unwrap_value(&v) == Some(service) {
                in_service = true;
            }
            if k == "Name" {
                metric = unwrap_value(&v).unwrap_or(&v).to_string();
            }
            continue;
        }
        in_resource = false;
        if let Some(n) = t.strip_prefix("Count: ") {
            if in_service {
                *current.entry(metric.clone()).or_default() += n.trim().parse::<u64>().unwrap_or(0);
            }
        }
    }
    if in_service && !current.is_empty() {
        latest = current;
    }
    latest
}

// ------------------------------------------------------------ Prometheus

pub fn scrape(port: u16) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .unwrap_or_else(|e| panic!("metrics endpoint :{port}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut text = String::new();
    s.read_to_string(&mut text).expect("read");
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(
        head.starts_with("HTTP/1.1 200"),
        "metrics endpoint answered {head:?}"
    );
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    body.to_string()
}

/// Sum of the samples of `name` whose labels contain every `label="value"`
/// in `with`.
pub fn prom_sum(text: &str, name: &str, with: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (metric, labels) = series.split_once('{').unwrap_or((series, ""));
            (metric == name && with.iter().all(|w| labels.contains(w)))
                .then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

// ------------------------------------------------------------------ helpers

#[cfg(test)]
mod tests {
    use super::prom_sum;

    #[test]
    fn prometheus_samples_are_summed_by_name_and_labels() {
        let text = "# HELP x\nx_total{reason=\"a\"} 2\nx_total{reason=\"b\"} 3\nx_total_other 9\n";
        assert_eq!(prom_sum(text, "x_total", &[]), 5.0);
        assert_eq!(prom_sum(text, "x_total", &["reason=\"b\""]), 3.0);
        assert_eq!(prom_sum(text, "missing", &[]), 0.0);
    }
}
