//! Export of finished timelines: OTLP spans and metrics (gRPC or
//! HTTP/protobuf), and a Prometheus text endpoint.
//!
//! The run loop calls [`Exporter::record`] for every reported timeline. That
//! call never waits on I/O: it updates the metric aggregation under a short
//! lock, turns the timeline into spans (pure CPU) and `try_push`es them into
//! a bounded queue, counting what does not fit. Background tasks on the
//! runtime do the network work: the span task batches, encodes and sends
//! with retry and backoff; the metrics task pushes cumulative metrics on an
//! interval; the Prometheus task answers scrapes.
//!
//! Spans are built from `opentelemetry-proto` messages rather than through
//! the OpenTelemetry SDK: the SDK ties one resource to one tracer provider
//! (and its own batch queue and thread), while tokentrace reports for many
//! processes at once, with timestamps taken from the kernel rather than
//! from "now". Building `ResourceSpans` directly gives one queue with one
//! memory bound for all processes, exact timestamps, and ids and parents
//! that unit tests can check.
//!
//! Memory bound with a dead backend: `queue_size` requests of at most four
//! spans and `max_span_events` events each, plus one batch being retried
//! (its request and the copy each attempt sends). What that comes to is
//! reported as `tokentrace_export_queue_bytes` (heap bytes, see `heap`).

mod clock;
mod encode;
mod error;
pub mod health;
mod heap;
mod metrics;
mod otlp;
mod prometheus;
mod queue;
mod reachability;
mod resource;
mod retry;
mod route;
mod sampling;
mod series;
mod settings;
mod spans;
mod stalls;
mod trigger_span;

use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub use crate::model::trace_context::{IdGenerator, RemoteParent};
pub use clock::WallClock;
pub use error::ExportError;
pub use metrics::{
    AgentCounters, ExportCounters, Histogram, Latency, Metrics, SeriesKey, TTFT_BOUNDS,
};
pub use otlp::OtlpProtocol;
pub use route::normalise as normalise_route;
pub use sampling::{Sampling, SamplingConfig};
pub use series::RouteKey;
pub use settings::{resolve, ExportArgs, ExportConfig, ExportSettings};
pub use spans::{timeline_spans, SpanSettings};
pub use stalls::{causes as stall_causes, StallCause};

use encode::TraceItem;
use otlp::OtlpClient;
use queue::{QueueReceiver, QueueSender};
use reachability::Reachability;
use resource::kv_str;
use resource::{ResourceCache, ResourceRules};
use retry::{with_retry, GaveUp, Outage, RetryPolicy};
use spans::{trace_spans, Trace};

use crate::event::MonoNs;
use crate::model::Firing;
use crate::model::OpenRequest;
use crate::model::RequestTimeline;

/// The wall-clock offset is measured again when a timeline ends this long
/// after the last measurement, to follow steps of the system clock.
const CLOCK_REFRESH_NS: u64 = 60_000_000_000;

/// Export-path counters, written by the run loop and the export tasks.
#[derive(Debug, Default)]
struct Stats {
    enqueued: AtomicU64,
    dequeued: AtomicU64,
    spans_exported: AtomicU64,
    spans_dropped_queue_full: AtomicU64,
    spans_dropped_export_failed: AtomicU64,
    spans_not_sampled: AtomicU64,
    spans_sampled_out: AtomicU64,
    metric_exports_failed: AtomicU64,
    /// Heap bytes of the spans in the queue.
    queued_bytes: AtomicU64,
    /// Heap bytes of the batch being sent or retried (request and copy).
    in_flight_bytes: AtomicU64,
}

impl Stats {
    /// Queues spans for export without waiting; a full queue drops them,
    /// counted.
    fn enqueue(&self, tx: &QueueSender<TraceItem>, item: TraceItem) {
        let count = item.spans.len() as u64;
        let bytes = heap::spans_bytes(&item.spans);
        match tx.try_push(item) {
            Ok(()) => {
                self.enqueued.fetch_add(1, Ordering::Relaxed);
                self.queued_bytes.fetch_add(bytes, Ordering::Relaxed);
            }
            Err(_) => {
                self.spans_dropped_queue_full
                    .fetch_add(count, Ordering::Relaxed);
            }
        }
    }
}

/// State the run loop, the export tasks and the Prometheus endpoint share.
#[derive(Debug)]
pub struct Shared {
    metrics: Mutex<Metrics>,
    stats: Stats,
    queue_capacity: u64,
    ready: health::Readiness,
}

impl Shared {
    /// A consistent copy of the metrics and the export counters.
    pub fn snapshot(&self) -> (Metrics, ExportCounters) {
        let metrics = self
            .metrics
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let s = &self.stats;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let export = ExportCounters {
            spans_exported: get(&s.spans_exported),
            spans_dropped_queue_full: get(&s.spans_dropped_queue_full),
            spans_dropped_export_failed: get(&s.spans_dropped_export_failed),
            spans_not_sampled: get(&s.spans_not_sampled),
            spans_sampled_out: get(&s.spans_sampled_out),
            queue_length: get(&s.enqueued).saturating_sub(get(&s.dequeued)),
            queue_capacity: self.queue_capacity,
            queue_bytes: get(&s.queued_bytes).saturating_add(get(&s.in_flight_bytes)),
            metric_exports_failed: get(&s.metric_exports_failed),
        };
        (metrics, export)
    }
}

/// The span side of the exporter: conversion state and the queue.
struct SpanPipe {
    tx: QueueSender<TraceItem>,
    clock: WallClock,
    ids: IdGenerator,
    settings: SpanSettings,
    sampling: Sampling,
}

/// What the run loop holds: [`Exporter::record`] per timeline,
/// [`Exporter::observe_agent`] now and then, [`Exporter::shutdown`] at the end.
pub struct Exporter {
    /// `None` when nothing is exported: `record` is free.
    active: Option<Active>,
}

struct Active {
    shared: Arc<Shared>,
    resources: ResourceCache,
    spans: Option<SpanPipe>,
    span_task: Option<JoinHandle<()>>,
    metrics_task: Option<(oneshot::Sender<()>, JoinHandle<()>)>,
    prometheus_task: Option<JoinHandle<()>>,
    targets: Vec<String>,
}

/// Totals printed when the run ends.
#[derive(Debug, Clone)]
pub struct ExportSummary {
    targets: Vec<String>,
    counters: ExportCounters,
}

impl fmt::Display for ExportSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.counters;
        write!(
            f,
            "tokentrace export ({}): {} spans exported, {} dropped (queue full), {} dropped (export failed), {} not sampled, {} sampled out, {} left in queue",
            self.targets.join(", "),
            c.spans_exported,
            c.spans_dropped_queue_full,
            c.spans_dropped_export_failed,
            c.spans_not_sampled,
            c.spans_sampled_out,
            c.queue_length
        )
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, crate::units::nanos)
}

impl Exporter {
    /// An exporter that exports nothing.
    pub fn disabled() -> Self {
        Self { active: None }
    }

    /// Starts the export tasks on the current runtime. Fails when the
    /// Prometheus address cannot be bound or an endpoint is malformed;
    /// a backend that is down is not an error (spans wait, then drop).
    /// With `aggregate`, the metrics are kept even when nothing exports
    /// them: the live view (`tokentrace top`) reads them ([`Self::shared`]).
    pub async fn start(settings: ExportSettings, aggregate: bool) -> Result<Self, ExportError> {
        if settings.is_disabled() && !aggregate {
            return Ok(Self::disabled());
        }
        let shared = Arc::new(Shared {
            metrics: Mutex::new(Metrics::new(settings.max_series, unix_now())),
            stats: Stats::default(),
            queue_capacity: settings.queue_size as u64,
            ready: health::Readiness::default(),
        });
        let mut targets = Vec::new();

        let prometheus_task = match settings.prometheus_addr {
            Some(addr) => {
                let listener = tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|source| ExportError::Listen { addr, source })?;
                targets.push(format!("prometheus http://{addr}/metrics"));
                Some(tokio::spawn(prometheus::serve(
                    listener,
                    Arc::clone(&shared),
                )))
            }
            None => None,
        };

        let (spans, span_task) = match &settings.traces {
            Some(target) => {
                let client = OtlpClient::new(target)?;
                targets.push(format!("spans {} {}", target.protocol, target.url));
                let (tx, rx) = queue::bounded(settings.queue_size);
                let task = tokio::spawn(export_spans(
                    rx,
                    client,
                    Arc::clone(&shared),
                    settings.batch_size,
                    settings.batch_timeout,
                    settings.retry,
                ));
                let pipe = SpanPipe {
                    tx,
                    clock: WallClock::measure(),
                    ids: IdGenerator::random(),
                    settings: settings.spans.clone(),
                    sampling: settings.sampling.clone(),
                };
                (Some(pipe), Some(task))
            }
            None => (None, None),
        };

        let metrics_task = match &settings.metrics {
            Some(target) => {
                let client = OtlpClient::new(target)?;
                targets.push(format!("metrics {} {}", target.protocol, target.url));
                let (stop_tx, stop_rx) = oneshot::channel();
                let task = tokio::spawn(export_metrics(
                    client,
                    Arc::clone(&shared),
                    settings.resource.clone(),
                    settings.metrics_interval,
                    stop_rx,
                ));
                Some((stop_tx, task))
            }
            None => None,
        };

        if !targets.is_empty() {
            tracing::info!("exporting to {}", targets.join(", "));
        }
        Ok(Self {
            active: Some(Active {
                shared,
                resources: ResourceCache::new(settings.resource, PathBuf::from("/proc")),
                spans,
                span_task,
                metrics_task,
                prometheus_task,
                targets,
            }),
        })
    }

    /// Records one reported request: metrics now, spans into the queue.
    /// Never blocks on export.
    pub fn record(&mut self, t: &RequestTimeline) {
        let Some(active) = &mut self.active else {
            return;
        };
        let process = active.resources.get(t.conn.pid, &t.comm);
        if t.kind == crate::model::SpanKind::Server {
            // the request metrics are the server's; an upstream call is a
            // span only
            active
                .shared
                .metrics
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .record(&process.service, t);
        }

        let Some(pipe) = &mut active.spans else {
            return;
        };
        if t.end.saturating_sub(pipe.clock.measured_at()) > CLOCK_REFRESH_NS {
            pipe.clock = WallClock::measure();
        }
        let stats = &active.shared.stats;
        let Some(trace) = Trace::of(t, &mut pipe.ids) else {
            stats.spans_not_sampled.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let Some(reason) = pipe
            .sampling
            .decide(t, trace.parent_sampled(), &trace.trace_id)
        else {
            stats.spans_sampled_out.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let mut spans = trace_spans(t, &trace, &pipe.clock, &mut pipe.ids, &pipe.settings);
        for span in &mut spans {
            span.attributes
                .push(kv_str(sampling::REASON_ATTRIBUTE, reason.as_str()));
        }
        let resource = Arc::clone(&process.resource);
        stats.enqueue(&pipe.tx, TraceItem { resource, spans });
    }

    /// The metric aggregation and export counters, for the live view;
    /// `None` when the exporter neither exports nor aggregates.
    pub fn shared(&self) -> Option<Arc<Shared>> {
        self.active.as_ref().map(|a| Arc::clone(&a.shared))
    }

    /// The service a process's telemetry goes under (`service.name` of
    /// its resource; the comm when export is off).
    pub fn service_of(&mut self, pid: u32, comm: &str) -> String {
        match &mut self.active {
            Some(active) => active.resources.get(pid, comm).service.clone(),
            None => comm.to_string(),
        }
    }

    /// Exports a trigger's firing as a span, under the resource of the
    /// process whose request made it fire. Never blocks on export.
    pub fn record_trigger(&mut self, f: &Firing, pid: u32, comm: &str, at: MonoNs) {
        let Some(active) = &mut self.active else {
            return;
        };
        let resource = Arc::clone(&active.resources.get(pid, comm).resource);
        let Some(pipe) = &mut active.spans else {
            return;
        };
        let spans = vec![trigger_span::trigger_span(
            f,
            at,
            &pipe.clock,
            &mut pipe.ids,
        )];
        active
            .shared
            .stats
            .enqueue(&pipe.tx, TraceItem { resource, spans });
    }

    /// Replaces the in-flight gauges with a sample of the open requests
    /// (each counted under its process's service).
    pub fn observe_in_flight(&mut self, open: &[OpenRequest]) {
        let Some(active) = &mut self.active else {
            return;
        };
        let services: Vec<String> = open
            .iter()
            .map(|r| active.resources.get(r.pid, &r.comm).service.clone())
            .collect();
        active
            .shared
            .metrics
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .set_in_flight(services.iter().map(String::as_str).zip(open));
    }

    /// Marks the agent ready (`/readyz`): probes attached, processes scanned.
    pub fn set_ready(&self) {
        if let Some(active) = &self.active {
            active.shared.ready.set();
        }
    }

    /// Marks the agent not ready again: probes a traced process needs
    /// could not be attached.
    pub fn set_unready(&self) {
        if let Some(active) = &self.active {
            active.shared.ready.clear();
        }
    }

    /// Adds container and Kubernetes attributes (and the workload's name
    /// as the default `service.name`) to traced processes' resources.
    pub fn set_kubernetes(&mut self, metadata: crate::k8s::Metadata) {
        if let Some(active) = &mut self.active {
            active.resources.set_kubernetes(metadata);
        }
    }

    /// Updates the agent's self-metrics from the run loop's counters.
    pub fn observe_agent(&self, counters: AgentCounters) {
        if let Some(active) = &self.active {
            active
                .shared
                .metrics
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .agent = counters;
        }
    }

    /// Flushes queued spans and a last metrics push, for at most `grace`,
    /// then stops every task. `None` when nothing was exported.
    pub async fn shutdown(self, grace: Duration) -> Option<ExportSummary> {
        let active = self.active?;
        // closing the queue lets the span task drain it and end
        drop(active.spans);
        let deadline = tokio::time::Instant::now() + grace;
        if let Some(task) = active.span_task {
            finish(task, deadline, "span export").await;
        }
        if let Some((stop, task)) = active.metrics_task {
            let _ = stop.send(());
            finish(task, deadline, "metrics export").await;
        }
        if let Some(task) = active.prometheus_task {
            task.abort();
        }
        if active.targets.is_empty() {
            return None; // aggregated for the live view only
        }
        let (_, counters) = active.shared.snapshot();
        Some(ExportSummary {
            targets: active.targets,
            counters,
        })
    }
}

async fn finish(mut task: JoinHandle<()>, deadline: tokio::time::Instant, what: &str) {
    if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
        tracing::warn!("{what} did not finish before the shutdown deadline; stopping it");
        task.abort();
    }
}

/// Logs export failures once per outage, not once per batch. Atomic, so
/// the span task can note a failure from inside a retried attempt.
struct Health {
    what: &'static str,
    url: String,
    failing: AtomicBool,
}

impl Health {
    fn new(what: &'static str, url: &str) -> Self {
        Self {
            what,
            url: url.to_string(),
            failing: AtomicBool::new(false),
        }
    }

    fn ok(&self) {
        if self.failing.swap(false, Ordering::Relaxed) {
            tracing::warn!("{} to {}: recovered", self.what, self.url);
        }
    }

    fn failed(&self, err: &otlp::SendError, consequence: &str) {
        if self.failing.swap(true, Ordering::Relaxed) {
            tracing::debug!("{} to {} failed: {err}", self.what, self.url);
        } else {
            tracing::warn!("{} to {} failed: {err}; {consequence}", self.what, self.url);
        }
    }
}

async fn export_spans(
    mut rx: QueueReceiver<TraceItem>,
    client: OtlpClient,
    shared: Arc<Shared>,
    batch_size: usize,
    linger: Duration,
    retry: RetryPolicy,
) {
    let stats = &shared.stats;
    let health = Health::new("span export", client.url());
    let reach = Reachability::new(client.authority());
    while let Some(batch) = rx.next_batch(batch_size, linger).await {
        stats
            .dequeued
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        let spans: u64 = batch.iter().map(|item| item.spans.len() as u64).sum();
        let bytes: u64 = batch
            .iter()
            .map(|item| heap::spans_bytes(&item.spans))
            .sum();
        let request = encode::trace_request(&batch);
        drop(batch);
        // the request and the copy an attempt sends replace the items
        stats.in_flight_bytes.store(2 * bytes, Ordering::Relaxed);
        let _ = stats
            .queued_bytes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |q| {
                Some(q.saturating_sub(bytes))
            });
        let outage = Outage {
            comes_back: || reach.comes_back(),
            queue_full: || rx.is_full(),
        };
        let outcome = with_retry(retry, outage, |renew| {
            if renew {
                client.renew();
            }
            let attempt = client.export_traces(request.clone());
            let health = &health;
            async move {
                let result = attempt.await;
                if let Err(err @ otlp::SendError::Retryable { .. }) = &result {
                    health.failed(
                        err,
                        "spans wait in the export queue; once it is full, the oldest batch \
                         and new spans are dropped (tokentrace_spans_dropped_total)",
                    );
                }
                result
            }
        })
        .await;
        drop(request);
        stats.in_flight_bytes.store(0, Ordering::Relaxed);
        match outcome {
            Ok(rejected) => {
                health.ok();
                let rejected = rejected.min(spans);
                stats
                    .spans_exported
                    .fetch_add(spans - rejected, Ordering::Relaxed);
                if rejected > 0 {
                    stats
                        .spans_dropped_export_failed
                        .fetch_add(rejected, Ordering::Relaxed);
                    tracing::warn!("the OTLP backend rejected {rejected} of {spans} spans");
                }
            }
            Err(GaveUp::Refused(err, attempts)) => {
                stats
                    .spans_dropped_export_failed
                    .fetch_add(spans, Ordering::Relaxed);
                tracing::warn!(
                    "span export to {}: dropped {spans} spans the backend refused after {attempts} attempt(s): {err}",
                    client.url()
                );
            }
            Err(GaveUp::NoRoom(err, attempts)) => {
                stats
                    .spans_dropped_queue_full
                    .fetch_add(spans, Ordering::Relaxed);
                tracing::debug!(
                    "dropped {spans} spans after {attempts} attempt(s) to make room: {err}"
                );
            }
        }
    }
}

async fn export_metrics(
    client: OtlpClient,
    shared: Arc<Shared>,
    rules: ResourceRules,
    interval: Duration,
    mut stop: oneshot::Receiver<()>,
) {
    let health = Health::new("metrics export", client.url());
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let last = tokio::select! {
            _ = ticker.tick() => false,
            _ = &mut stop => true,
        };
        let (metrics, export) = shared.snapshot();
        let request = encode::metrics_request(&metrics, &export, &rules, unix_now());
        // Cumulative data: a lost push is repaired by the next one, so no
        // retry queue is needed here.
        match client.export_metrics(request).await {
            Ok(_) => health.ok(),
            Err(err) => {
                shared
                    .stats
                    .metric_exports_failed
                    .fetch_add(1, Ordering::Relaxed);
                health.failed(&err, "the next push carries the same cumulative data");
                // dial afresh for the next push, whatever state the
                // transport's own reconnect logic is in
                client.renew();
            }
        }
        if last {
            return;
        }
    }
}
