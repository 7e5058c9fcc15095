//! Latency histograms and agent counters, aggregated in the agent.
//!
//! One aggregation feeds both the Prometheus endpoint and OTLP metrics, so
//! the two always agree. Histograms are cumulative (OTLP cumulative
//! temporality, like Prometheus): a failed OTLP push loses nothing, the next
//! one carries every observation so far.
//!
//! Latency series are keyed by service, `gen_ai.operation.name`,
//! `http.route`, `gen_ai.request.model`, `http.response.status_code` and
//! `error.type`; the request-level counters and gauges (cancellations,
//! socket wait, stall time by cause, requests in flight by phase) by
//! service, route and model ([`RouteKey`]). Routes are normalised and model
//! names come from request bodies, so the number of series is capped: past
//! `max_series`, observations go to one overflow series marked
//! `otel.metric.overflow=true` (the OTel SDK's cardinality-limit behaviour)
//! and are counted (`tokentrace.metric.overflow`).

use std::collections::BTreeMap;

use super::series::{Capped, Labels, RouteKey};
use super::stalls::{self, StallCause};
use crate::export::attributes::{error_type, operation_name};
use crate::model::RequestTimeline;
use crate::model::{OpenRequest, Phase};

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
/// Bucket bounds (seconds) of `gen_ai.server.inter_token_latency`: every
/// gap, so finer below 100 ms where decode steps live, and up to 10 s for
/// the stalls people alert on.
pub const ITL_BOUNDS: &[f64] = &[
    0.001, 0.002, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
];
/// Bucket bounds (seconds) of `tokentrace.stall.duration`: stalls start at
/// `explain.stall_threshold` (30 ms by default).
pub const STALL_BOUNDS: &[f64] = &[
    0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0,
];
/// Bucket bounds (seconds) of `tokentrace.socket.wait.duration`: a request
/// read at once waits tens of µs, one behind a busy event loop seconds.
pub const SOCKET_WAIT_BOUNDS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];
/// Bucket bounds (seconds) of `gen_ai.server.request.duration`.
pub const DURATION_BOUNDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0,
    600.0,
];

/// One of the latency histograms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Latency {
    TimeToFirstToken,
    TimePerOutputToken,
    RequestDuration,
    /// Every gap between successive chunks (the per-request mean is TPOT).
    InterToken,
    /// The engine's queue wait and prefill of a request (`llm:*` probes,
    /// e.g. vLLM with tokentrace-vllm): where TTFT went inside the engine.
    EngineQueue,
    EnginePrefill,
}

impl Latency {
    pub const ALL: [Latency; 6] = [
        Latency::TimeToFirstToken,
        Latency::TimePerOutputToken,
        Latency::RequestDuration,
        Latency::InterToken,
        Latency::EngineQueue,
        Latency::EnginePrefill,
    ];

    /// The OTel semantic-convention metric name.
    pub fn name(self) -> &'static str {
        match self {
            Latency::TimeToFirstToken => "gen_ai.server.time_to_first_token",
            Latency::TimePerOutputToken => "gen_ai.server.time_per_output_token",
            Latency::RequestDuration => "gen_ai.server.request.duration",
            // not (yet) in the GenAI conventions: named like its siblings
            Latency::InterToken => "gen_ai.server.inter_token_latency",
            Latency::EngineQueue => "tokentrace.engine.queue.duration",
            Latency::EnginePrefill => "tokentrace.engine.prefill.duration",
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
            Latency::InterToken => {
                "Gap between successive output chunks of a streamed response, every gap"
            }
            Latency::EngineQueue => {
                "Time a request waited for the engine's scheduler (llm:request_queued -> request_scheduled)"
            }
            Latency::EnginePrefill => {
                "Time the engine spent on a request's prompt (llm:prefill_start -> prefill_end)"
            }
        }
    }

    pub fn bounds(self) -> &'static [f64] {
        match self {
            Latency::TimeToFirstToken => TTFT_BOUNDS,
            Latency::TimePerOutputToken => TPOT_BOUNDS,
            Latency::RequestDuration => DURATION_BOUNDS,
            Latency::InterToken => ITL_BOUNDS,
            Latency::EngineQueue | Latency::EnginePrefill => TTFT_BOUNDS,
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
    /// Normalised request path (`http.route`).
    pub route: Option<String>,
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
            route: None,
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
        if let Some(route) = &self.route {
            a.push(("http.route", route.clone()));
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
/// Seconds requests waited in the socket (arrival → the server's read).
/// Its rate is the mean number of requests waiting there (Little's law).
pub const SOCKET_WAIT: (&str, &str) = (
    "tokentrace.socket.wait",
    "Time requests waited in the socket's receive queue before the server read them",
);
/// The same waits as a histogram, for their percentiles (`tokentrace top`).
pub const SOCKET_WAIT_DURATION: (&str, &str) = (
    "tokentrace.socket.wait.duration",
    "Time each request waited in the socket's receive queue before the server read it",
);
/// Seconds of stalled chunk gaps, by cause.
pub const STALL_TIME: (&str, &str) = (
    "tokentrace.stall.time",
    "Time of late chunks' gaps spent on each cause (disjoint parts of each gap; socket/nagle: send-queue time after it)",
);
/// Histogram of stalled gaps, labelled with their largest cause.
pub const STALL_DURATION: (&str, &str) = (
    "tokentrace.stall.duration",
    "Gap before each late chunk (at least explain.stall_threshold), by its largest cause",
);
/// Requests read but not finished, by phase (sampled every second).
pub const IN_FLIGHT: (&str, &str) = (
    "tokentrace.requests.in_flight",
    "Requests being served, by phase: waiting for the first token, or streaming",
);
/// Observations that went to an overflow series, by metric.
pub const OVERFLOW: (&str, &str) = (
    "tokentrace.metric.overflow",
    "Observations recorded in a metric's overflow series (otel_metric_overflow) because it had export.max_series label sets",
);

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
    /// Probe sets that could not be attached, by kind and reason.
    pub probe_attach_failures: crate::probes::FailureCounts,
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
    /// Requests whose spans tail sampling dropped (`export.sampling`).
    pub spans_sampled_out: u64,
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
    /// Latency observations that went to an overflow series.
    pub latency_overflowed: BTreeMap<Latency, u64>,
    /// Requests recorded (reported by the run loop).
    pub requests: u64,
    /// Client cancellations by service, route and model.
    pub cancellations: Capped<RouteKey, u64>,
    /// Time in the socket's receive queue: the counter of seconds is its
    /// sum.
    pub socket_wait: Capped<RouteKey, Histogram>,
    /// Seconds of stalled gaps by cause.
    pub stall_time: Capped<(RouteKey, StallCause), f64>,
    /// Stalled gaps by their largest cause.
    pub stall_duration: Capped<(RouteKey, &'static str), Histogram>,
    /// Open requests at the last sample. Label sets seen once stay, at 0,
    /// so a drained service reads 0 rather than vanishing.
    pub in_flight: Capped<(RouteKey, Phase), u64>,
    pub agent: AgentCounters,
}

impl Metrics {
    pub fn new(max_series: usize, start_unix_nano: u64) -> Self {
        Self {
            max_series,
            series: BTreeMap::new(),
            start_unix_nano,
            latency: BTreeMap::new(),
            latency_overflowed: BTreeMap::new(),
            requests: 0,
            cancellations: Capped::default(),
            socket_wait: Capped::default(),
            stall_time: Capped::default(),
            stall_duration: Capped::default(),
            in_flight: Capped::default(),
            agent: AgentCounters::default(),
        }
    }

    /// Adds `values` (seconds) to the `which` histogram of `key`: one key
    /// clone and one lookup for all of them (a stream's inter-token gaps
    /// are hundreds per request).
    pub(super) fn observe(
        &mut self,
        which: Latency,
        key: &SeriesKey,
        values: impl IntoIterator<Item = f64>,
    ) {
        let mut values = values.into_iter().peekable();
        if values.peek().is_none() {
            return;
        }
        let series = self.series.entry(which).or_default();
        let full_key = (which, key.clone());
        let slot = if self.latency.contains_key(&full_key) || *series < self.max_series {
            full_key
        } else {
            *self.latency_overflowed.entry(which).or_default() += 1;
            (which, SeriesKey::overflow(&key.service))
        };
        let histogram = self.latency.entry(slot).or_insert_with(|| {
            *series += 1;
            Histogram::new(which.bounds())
        });
        for seconds in values {
            histogram.observe(seconds);
        }
    }

    /// Records one reported request under its `labels`. TTFT and TPOT describe
    /// successful responses only (as the GenAI conventions define them);
    /// the duration histogram counts every request, the inter-token one
    /// every gap of every streamed response (a slow gap before the client
    /// gave up is exactly what it is for; `error.type` tells them apart).
    pub fn record(&mut self, labels: &Labels, t: &RequestTimeline) {
        let route = RouteKey::of(labels, t);
        let key = SeriesKey {
            service: labels.service.clone(),
            operation: operation_name(&t.path),
            route: route.route.clone(),
            model: t.model.clone(),
            status: t.status,
            error: error_type(t),
            rpc: t
                .rpc_service_method()
                .map(|(s, m)| (s.to_string(), m.to_string())),
            overflow: false,
        };
        self.requests += 1;
        let max = self.max_series;
        if t.abort_reason == Some(crate::model::AbortReason::ClientClosed) {
            *self.cancellations.slot(route.clone(), max, || 0) += 1;
        }
        let secs = |ns: u64| ns as f64 / 1e9;
        if let Some(wait) = t.socket_wait_ns() {
            self.socket_wait
                .slot(route.clone(), max, || Histogram::new(SOCKET_WAIT_BOUNDS))
                .observe(secs(wait));
        }
        for stall in &t.stalls {
            for (cause, seconds) in stalls::causes(stall) {
                *self.stall_time.slot((route.clone(), cause), max, || 0.0) += seconds;
            }
            self.stall_duration
                .slot((route.clone(), stalls::dominant(stall)), max, || {
                    Histogram::new(STALL_BOUNDS)
                })
                .observe(stall.gap_ms / 1e3);
        }
        if t.is_stream() {
            let gaps = t.stats().itl_ns.iter().map(|&gap| secs(gap));
            self.observe(Latency::InterToken, &key, gaps);
        }
        if let Some(engine) = &t.engine {
            if let Some(q) = engine.queue_ms {
                self.observe(Latency::EngineQueue, &key, [q / 1e3]);
            }
            if let Some(p) = engine.prefill_ms {
                self.observe(Latency::EnginePrefill, &key, [p / 1e3]);
            }
        }
        let e2e = t.e2e_ns();
        self.observe(Latency::RequestDuration, &key, [secs(e2e)]);
        if t.aborted {
            return;
        }
        let Some(ttft) = t.ttft_ns() else { return };
        self.observe(Latency::TimeToFirstToken, &key, [secs(ttft)]);
        let chunks = t.chunk_ts.len() as u64;
        if t.is_stream() && chunks >= 2 {
            self.observe(
                Latency::TimePerOutputToken,
                &key,
                [secs(e2e.saturating_sub(ttft)) / (chunks - 1) as f64],
            );
        }
    }
}

impl Metrics {
    /// Replaces the in-flight gauges with one sample: `open` requests, each
    /// with the service of its process.
    pub fn set_in_flight<'a>(
        &mut self,
        open: impl IntoIterator<Item = (&'a str, &'a OpenRequest)>,
    ) {
        for n in self.in_flight.series.values_mut() {
            *n = 0;
        }
        let max = self.max_series;
        for (service, r) in open {
            let key = RouteKey::new(service, &r.path, r.model.as_deref());
            *self.in_flight.slot((key, r.phase), max, || 0) += 1;
        }
    }
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
        use crate::model::AbortReason;
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
            m.record(&Labels::new("svc".into(), &t), &t);
        }
        let got: Vec<(Option<&str>, Option<&str>, bool, u64)> = m
            .cancellations
            .series
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
    fn the_engines_queue_and_prefill_are_histograms_only_where_it_reported_them() {
        let mut m = Metrics::new(10, 0);
        let mut t = crate::export::spans::tests::sse();
        m.record(&Labels::new("svc".into(), &t), &t);
        t.engine = Some(crate::model::EngineView {
            queue_ms: Some(250.0),
            prefill_ms: Some(12.0),
            ..crate::model::EngineView::default()
        });
        m.record(&Labels::new("svc".into(), &t), &t);
        let of = |which: Latency| -> Vec<(u64, f64)> {
            m.latency
                .iter()
                .filter(|((w, _), _)| *w == which)
                .map(|(_, h)| (h.count, h.sum))
                .collect()
        };
        assert_eq!(of(Latency::EngineQueue), vec![(1, 0.25)]);
        assert_eq!(of(Latency::EnginePrefill), vec![(1, 0.012)]);
        assert_eq!(of(Latency::RequestDuration)[0].0, 2);
    }

    #[test]
    fn every_gap_is_an_itl_sample_and_stall_time_is_counted_by_cause() {
        let mut m = Metrics::new(100, 0);
        let mut t = crate::export::spans::tests::sse();
        t.path = "/v1/threads/123/runs?x=1".into();
        t.read_start = t.request_start + 2_000_000;
        t.stalls = vec![crate::model::Stall {
            chunk: 3,
            start_ms: 70.0,
            gap_ms: 150.0,
            off_cpu_ms: 120.0,
            off_cpu_reason: Some("futex".into()),
            unexplained_ms: 30.0,
            ..crate::model::Stall::default()
        }];
        m.record(&Labels::new("svc".into(), &t), &t);
        m.record(&Labels::new("svc".into(), &t), &t);
        let itl: Vec<(&SeriesKey, &Histogram)> = m
            .latency
            .iter()
            .filter(|((l, _), _)| *l == Latency::InterToken)
            .map(|((_, k), h)| (k, h))
            .collect();
        assert_eq!(itl.len(), 1);
        let (key, h) = itl[0];
        assert_eq!(key.route.as_deref(), Some("/v1/threads/{id}/runs"));
        // gaps 15, 15, 150, 15 ms, twice
        assert_eq!(h.count, 8);
        assert!((h.sum - 2.0 * 0.195).abs() < 1e-9, "{}", h.sum);
        assert_eq!((h.min, h.max), (0.015, 0.15));
        let route = RouteKey::new("svc", "/v1/threads/{id}/runs", Some("llama-3-8b"));
        let stall_time: Vec<(&str, Option<&str>, f64)> = m
            .stall_time
            .series
            .iter()
            .map(|((k, c), s)| {
                assert_eq!(k, &route);
                (c.cause, c.reason.as_deref(), *s)
            })
            .collect();
        assert_eq!(
            stall_time,
            vec![
                ("off_cpu", Some("futex"), 0.24),
                ("unexplained", None, 0.06)
            ]
        );
        let durations: Vec<(&str, u64, f64)> = m
            .stall_duration
            .series
            .iter()
            .map(|((_, c), h)| (*c, h.count, h.sum))
            .collect();
        assert_eq!(durations, vec![("off_cpu", 2, 0.3)]);
        let wait = m.socket_wait.series.get(&route).map(|h| (h.count, h.sum));
        assert!(
            wait.is_some_and(|(n, w)| n == 2 && (w - 0.004).abs() < 1e-12),
            "{wait:?}"
        );
    }

    #[test]
    fn in_flight_gauges_are_replaced_per_sample_and_drained_series_read_zero() {
        let mut m = Metrics::new(100, 0);
        let open = |path: &str, phase| OpenRequest {
            pid: 1,
            comm: "c".into(),
            path: path.into(),
            model: Some("m".into()),
            phase,
        };
        let a = open("/v1/chat/completions?rid=1", Phase::FirstToken);
        let b = open("/v1/chat/completions?rid=2", Phase::Streaming);
        let c = open("/v1/chat/completions?rid=3", Phase::Streaming);
        m.set_in_flight([("svc", &a), ("svc", &b), ("svc", &c)]);
        let values = |m: &Metrics| -> Vec<(Phase, u64)> {
            m.in_flight
                .series
                .iter()
                .map(|((k, p), n)| {
                    assert_eq!(k.route.as_deref(), Some("/v1/chat/completions"));
                    (*p, *n)
                })
                .collect()
        };
        assert_eq!(
            values(&m),
            vec![(Phase::FirstToken, 1), (Phase::Streaming, 2)]
        );
        m.set_in_flight([("svc", &c)]);
        assert_eq!(
            values(&m),
            vec![(Phase::FirstToken, 0), (Phase::Streaming, 1)]
        );
        m.set_in_flight(std::iter::empty());
        assert_eq!(
            values(&m),
            vec![(Phase::FirstToken, 0), (Phase::Streaming, 0)]
        );
    }
}
