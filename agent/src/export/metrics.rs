//! Latency histograms and agent counters, aggregated in the agent.
//!
//! One aggregation feeds both the Prometheus endpoint and OTLP metrics, so
//! the two always agree. Histograms are cumulative (OTLP cumulative
//! temporality, like Prometheus): a failed OTLP push loses nothing, the next
//! one carries every observation so far.
//!
//! Series are keyed by service, `gen_ai.operation.name`,
//! `gen_ai.request.model`, `http.response.status_code` and `error.type`.
//! The model name comes from request bodies, so the number of series is
//! capped: past `max_series`, observations go to one overflow series marked
//! `otel.metric.overflow=true` (the OTel SDK's cardinality-limit behaviour).

use std::collections::BTreeMap;

use super::spans::{error_type, operation_name};
use crate::stitch::RequestTimeline;

/// Bucket bounds (seconds) of `gen_ai.server.time_to_first_token`: 1 ms
/// steps where interactive TTFT lives, then coarser up to a minute.
pub const TTFT_BOUNDS: &[f64] = &[
    0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.125, 0.15,
    0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0,
];
/// Bucket bounds (seconds) of `gen_ai.server.time_per_output_token`.
pub const TPOT_BOUNDS: &[f64] = &[
    0.001, 0.002, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
];
/// Bucket bounds (seconds) of `gen_ai.server.request.duration`.
pub const DURATION_BOUNDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0,
    600.0,
];

/// One of the three latency histograms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Latency {
    TimeToFirstToken,
    TimePerOutputToken,
    RequestDuration,
}

impl Latency {
    pub const ALL: [Latency; 3] = [
        Latency::TimeToFirstToken,
        Latency::TimePerOutputToken,
        Latency::RequestDuration,
    ];

    /// The OTel semantic-convention metric name.
    pub fn name(self) -> &'static str {
        match self {
            Latency::TimeToFirstToken => "gen_ai.server.time_to_first_token",
            Latency::TimePerOutputToken => "gen_ai.server.time_per_output_token",
            Latency::RequestDuration => "gen_ai.server.request.duration",
        }
    }

    pub fn description(self) -> &'static str {
        match self {
            Latency::TimeToFirstToken => {
                "Time from the first request byte to the first token leaving the server"
            }
            Latency::TimePerOutputToken => {
                "Time per output chunk after the first: (duration - TTFT) / (chunks - 1)"
            }
            Latency::RequestDuration => {
                "Time from the first request byte to the end of the response"
            }
        }
    }

    pub fn bounds(self) -> &'static [f64] {
        match self {
            Latency::TimeToFirstToken => TTFT_BOUNDS,
            Latency::TimePerOutputToken => TPOT_BOUNDS,
            Latency::RequestDuration => DURATION_BOUNDS,
        }
    }
}

/// Explicit-bucket histogram; `counts[i]` counts values in
/// `(bounds[i-1], bounds[i]]`, the last one values above every bound.
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    pub bounds: &'static [f64],
    pub counts: Vec<u64>,
    pub count: u64,
    pub sum: f64,
    pub min: f64,
    pub max: f64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len() + 1],
            count: 0,
            sum: 0.0,
            min: f64::INFINITY,
            max: f64::NEG_INFINITY,
        }
    }

    pub fn observe(&mut self, value: f64) {
        let i = self.bounds.partition_point(|&b| b < value);
        self.counts[i] += 1;
        self.count += 1;
        self.sum += value;
        self.min = self.min.min(value);
        self.max = self.max.max(value);
    }
}

/// Attributes of one latency series.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SeriesKey {
    pub service: String,
    pub operation: Option<&'static str>,
    pub model: Option<String>,
    pub status: Option<u16>,
    pub error: Option<String>,
    /// gRPC: (service, method) of the call.
    pub rpc: Option<(String, String)>,
    /// The overflow series of an over-limit histogram.
    pub overflow: bool,
}

impl SeriesKey {
    fn overflow(service: &str) -> Self {
        Self {
            service: service.to_string(),
            operation: None,
            model: None,
            status: None,
            error: None,
            rpc: None,
            overflow: true,
        }
    }

    /// (attribute name, value) pairs in OTel naming, service excluded
    /// (a resource attribute in OTLP, a label in Prometheus).
    pub fn attributes(&self) -> Vec<(&'static str, String)> {
        let mut a = Vec::new();
        if let Some(op) = self.operation {
            a.push(("gen_ai.operation.name", op.to_string()));
        }
        if let Some(model) = &self.model {
            a.push(("gen_ai.request.model", model.clone()));
        }
        if let Some(status) = self.status {
            a.push(("http.response.status_code", status.to_string()));
        }
        if let Some(error) = &self.error {
            a.push(("error.type", error.clone()));
        }
        if let Some((service, method)) = &self.rpc {
            a.push(("rpc.system", "grpc".to_string()));
            a.push(("rpc.service", service.clone()));
            a.push(("rpc.method", method.clone()));
        }
        if self.overflow {
            a.push(("otel.metric.overflow", "true".to_string()));
        }
        a
    }
}

/// Name and help of the per-service counter of requests the client
/// cancelled (abort_reason `client_closed`).
pub const CANCELLATIONS: (&str, &str) = (
    "tokentrace.client.cancellations",
    "Requests the client abandoned before the response was complete (FIN/RST first, or a refused write)",
);

/// Attributes of one cancellation series.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CancelKey {
    pub service: String,
    /// Request path without query (`http.route`).
    pub route: Option<String>,
    pub model: Option<String>,
    /// The overflow series (past `max_series`).
    pub overflow: bool,
}

impl CancelKey {
    /// (attribute name, value) pairs in OTel naming, service excluded.
    pub fn attributes(&self) -> Vec<(&'static str, String)> {
        let mut a = Vec::new();
        if let Some(route) = &self.route {
            a.push(("http.route", route.clone()));
        }
        if let Some(model) = &self.model {
            a.push(("gen_ai.request.model", model.clone()));
        }
        if self.overflow {
            a.push(("otel.metric.overflow", "true".to_string()));
        }
        a
    }
}

/// Counters of the agent itself, sampled by the run loop.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AgentCounters {
    /// Events decoded from the ring buffer.
    pub events_received: u64,
    /// Records the kernel could not put in the ring buffer.
    pub events_lost_kernel: u64,
    /// Decoded events the agent dropped (only when stopping: a full channel
    /// to stitching makes ingest wait instead).
    pub events_lost_agent: u64,
    pub decode_errors: u64,
    pub parse_errors: u64,
    pub truncated_writes: u64,
    pub open_connections: u64,
    /// Children of traced processes the full in-kernel pid filter could
    /// not take: they run untraced.
    pub untraced_forks: u64,
}

/// Counters of the export path itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExportCounters {
    pub spans_exported: u64,
    /// Requests whose spans did not fit in the export queue.
    pub spans_dropped_queue_full: u64,
    /// Spans of batches given up on after retries, or rejected.
    pub spans_dropped_export_failed: u64,
    /// Requests whose caller's trace is not sampled.
    pub spans_not_sampled: u64,
    pub queue_length: u64,
    pub queue_capacity: u64,
    /// Heap bytes the queue and the batch in flight hold.
    pub queue_bytes: u64,
    pub metric_exports_failed: u64,
}

/// Every latency series plus the counters; shared behind a mutex by the
/// run loop (writer), the Prometheus endpoint and the OTLP metrics task.
#[derive(Debug, Clone)]
pub struct Metrics {
    max_series: usize,
    /// Series per histogram, to enforce `max_series` without a scan.
    series: BTreeMap<Latency, usize>,
    /// Unix nanoseconds of the start of the cumulative period.
    pub start_unix_nano: u64,
    pub latency: BTreeMap<(Latency, SeriesKey), Histogram>,
    /// Requests recorded (reported by the run loop).
    pub requests: u64,
    /// Client cancellations by service, route and model (at most
    /// `max_series` series, then one overflow series per service).
    pub cancellations: BTreeMap<CancelKey, u64>,
    pub agent: AgentCounters,
}

impl Metrics {
    pub fn new(max_series: usize, start_unix_nano: u64) -> Self {
        Self {
            max_series,
            series: BTreeMap::new(),
            start_unix_nano,
            latency: BTreeMap::new(),
            requests: 0,
            cancellations: BTreeMap::new(),
            agent: AgentCounters::default(),
        }
    }

    fn observe(&mut self, which: Latency, key: &SeriesKey, seconds: f64) {
        let series = self.series.entry(which).or_default();
        let full_key = (which, key.clone());
        let slot = if self.latency.contains_key(&full_key) || *series < self.max_series {
            full_key
        } else {
            (which, SeriesKey::overflow(&key.service))
        };
        self.latency
            .entry(slot)
            .or_insert_with(|| {
                *series += 1;
                Histogram::new(which.bounds())
            })
            .observe(seconds);
    }

    /// Records one reported request of `service`. TTFT and TPOT describe
    /// successful responses only (as the GenAI conventions define them);
    /// the duration histogram counts every request.
    pub fn record(&mut self, service: &str, t: &RequestTimeline) {
        let key = SeriesKey {
            service: service.to_string(),
            operation: operation_name(&t.path),
            model: t.model.clone(),
            status: t.status,
            error: error_type(t),
            rpc: t
                .rpc_service_method()
                .map(|(s, m)| (s.to_string(), m.to_string())),
            overflow: false,
        };
        self.requests += 1;
        if t.abort_reason == Some(crate::stitch::AbortReason::ClientClosed) {
            self.count_cancellation(service, t);
        }
        let secs = |ns: u64| ns as f64 / 1e9;
        let e2e = t.e2e_ns();
        self.observe(Latency::RequestDuration, &key, secs(e2e));
        if t.aborted {
            return;
        }
        let Some(ttft) = t.ttft_ns() else { return };
        self.observe(Latency::TimeToFirstToken, &key, secs(ttft));
        let chunks = t.chunk_ts.len() as u64;
        if t.is_stream() && chunks >= 2 {
            self.observe(
                Latency::TimePerOutputToken,
                &key,
                secs(e2e.saturating_sub(ttft)) / (chunks - 1) as f64,
            );
        }
    }
}

impl Metrics {
    fn count_cancellation(&mut self, service: &str, t: &RequestTimeline) {
        let route = t.path.split(['?', '#']).next().unwrap_or_default();
        let mut key = CancelKey {
            service: service.to_string(),
            route: (!route.is_empty()).then(|| route.to_string()),
            model: t.model.clone(),
            overflow: false,
        };
        if !self.cancellations.contains_key(&key) && self.cancellations.len() >= self.max_series {
            key = CancelKey {
                service: service.to_string(),
                route: None,
                model: None,
                overflow: true,
            };
        }
        *self.cancellations.entry(key).or_default() += 1;
    }
}

/// Whether a self-metric only goes up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
}

/// One agent self-metric value, named for both OTLP and Prometheus.
#[derive(Debug, Clone, PartialEq)]
pub struct SelfMetric {
    pub otel_name: &'static str,
    /// Prometheus family name (counters get `_total` when rendered).
    pub prom_name: &'static str,
    pub help: &'static str,
    pub kind: Kind,
    pub attributes: Vec<(&'static str, &'static str)>,
    pub value: u64,
}

/// The agent's self-metrics, in a fixed order.
pub fn self_metrics(metrics: &Metrics, export: &ExportCounters) -> Vec<SelfMetric> {
    let agent = &metrics.agent;
    use Kind::{Counter, Gauge};
    let m =
        |otel_name, prom_name, help, kind, attributes: &[(&'static str, &'static str)], value| {
            SelfMetric {
                otel_name,
                prom_name,
                help,
                kind,
                attributes: attributes.to_vec(),
                value,
            }
        };
    vec![
        m(
            "tokentrace.events.received",
            "tokentrace_events_received",
            "Kernel events decoded",
            Counter,
            &[],
            agent.events_received,
        ),
        m(
            "tokentrace.events.lost",
            "tokentrace_events_lost",
            "Events lost before stitching",
            Counter,
            &[("where", "kernel")],
            agent.events_lost_kernel,
        ),
        m(
            "tokentrace.events.lost",
            "tokentrace_events_lost",
            "Events lost before stitching",
            Counter,
            &[("where", "agent")],
            agent.events_lost_agent,
        ),
        m(
            "tokentrace.forks.untraced",
            "tokentrace_forks_untraced",
            "Children of traced processes left untraced: the kernel's pid filter (8192) was full",
            Counter,
            &[],
            agent.untraced_forks,
        ),
        m(
            "tokentrace.decode.errors",
            "tokentrace_decode_errors",
            "Ring buffer records that could not be decoded",
            Counter,
            &[],
            agent.decode_errors,
        ),
        m(
            "tokentrace.parse.errors",
            "tokentrace_parse_errors",
            "Byte runs that were not parseable HTTP/1.1",
            Counter,
            &[],
            agent.parse_errors,
        ),
        m(
            "tokentrace.truncated_writes",
            "tokentrace_truncated_writes",
            "Writes longer than the capture cap",
            Counter,
            &[],
            agent.truncated_writes,
        ),
        m(
            "tokentrace.connections.open",
            "tokentrace_connections_open",
            "Connections being stitched",
            Gauge,
            &[],
            agent.open_connections,
        ),
        m(
            "tokentrace.requests",
            "tokentrace_requests",
            "Requests reported",
            Counter,
            &[],
            metrics.requests,
        ),
        m(
            "tokentrace.export.queue.length",
            "tokentrace_export_queue_length",
            "Requests waiting for span export",
            Gauge,
            &[],
            export.queue_length,
        ),
        m(
            "tokentrace.export.queue.capacity",
            "tokentrace_export_queue_capacity",
            "Size of the span export queue",
            Gauge,
            &[],
            export.queue_capacity,
        ),
        m(
            "tokentrace.export.queue.bytes",
            "tokentrace_export_queue_bytes",
            "Heap bytes of the spans waiting for export and of the batch being sent",
            Gauge,
            &[],
            export.queue_bytes,
        ),
        m(
            "tokentrace.spans.exported",
            "tokentrace_spans_exported",
            "Spans accepted by the OTLP backend",
            Counter,
            &[],
            export.spans_exported,
        ),
        m(
            "tokentrace.spans.dropped",
            "tokentrace_spans_dropped",
            "Spans not exported",
            Counter,
            &[("reason", "queue_full")],
            export.spans_dropped_queue_full,
        ),
        m(
            "tokentrace.spans.dropped",
            "tokentrace_spans_dropped",
            "Spans not exported",
            Counter,
            &[("reason", "export_failed")],
            export.spans_dropped_export_failed,
        ),
        m(
            "tokentrace.spans.not_sampled",
            "tokentrace_spans_not_sampled",
            "Requests whose caller's trace is not sampled",
            Counter,
            &[],
            export.spans_not_sampled,
        ),
        m(
            "tokentrace.metric_exports.failed",
            "tokentrace_metric_exports_failed",
            "OTLP metric pushes that failed",
            Counter,
            &[],
            export.metric_exports_failed,
        ),
    ]
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_upper_inclusive() {
        let mut h = Histogram::new(&[0.01, 0.02]);
        for v in [0.005, 0.01, 0.0100001, 0.02, 5.0] {
            h.observe(v);
        }
        assert_eq!(h.counts, vec![2, 2, 1]);
        assert_eq!(h.count, 5);
        assert!((h.sum - 5.0450001).abs() < 1e-9);
        assert_eq!(h.min, 0.005);
        assert_eq!(h.max, 5.0);
    }

    #[test]
    fn bounds_are_strictly_increasing() {
        for l in Latency::ALL {
            assert!(l.bounds().windows(2).all(|w| w[0] < w[1]), "{}", l.name());
        }
    }

    #[test]
    fn client_cancellations_are_counted_by_route_and_model() {
        use crate::stitch::AbortReason;
        let mut m = Metrics::new(2, 0);
        let mut t = crate::export::spans::tests::sse();
        t.aborted = true;
        for (path, model, reason) in [
            ("/v1/chat/completions?rid=1", "a", AbortReason::ClientClosed),
            ("/v1/chat/completions?rid=2", "a", AbortReason::ClientClosed),
            ("/v1/completions", "b", AbortReason::ClientClosed),
            ("/v1/completions", "b", AbortReason::ServerClosed),
            ("/v1/other", "c", AbortReason::ClientClosed),
        ] {
            t.path = path.into();
            t.model = Some(model.into());
            t.abort_reason = Some(reason);
            m.record("svc", &t);
        }
        let got: Vec<(Option<&str>, Option<&str>, bool, u64)> = m
            .cancellations
            .iter()
            .map(|(k, n)| (k.route.as_deref(), k.model.as_deref(), k.overflow, *n))
            .collect();
        assert_eq!(
            got,
            vec![
                (None, None, true, 1),
                (Some("/v1/chat/completions"), Some("a"), false, 2),
                (Some("/v1/completions"), Some("b"), false, 1),
            ]
        );
    }

    #[test]
    fn series_beyond_the_limit_go_to_the_overflow_series() {
        let mut m = Metrics::new(2, 0);
        let key = |model: &str| SeriesKey {
            service: "s".into(),
            operation: Some("chat"),
            model: Some(model.into()),
            status: Some(200),
            error: None,
            rpc: None,
            overflow: false,
        };
        for model in ["a", "b", "c", "d", "a"] {
            m.observe(Latency::RequestDuration, &key(model), 0.1);
        }
        let counts: Vec<(Option<String>, bool, u64)> = m
            .latency
            .iter()
            .map(|((_, k), h)| (k.model.clone(), k.overflow, h.count))
            .collect();
        assert_eq!(
            counts,
            vec![
                (None, true, 2),
                (Some("a".into()), false, 2),
                (Some("b".into()), false, 1)
            ]
        );
    }
}
