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
//! reported as `tokentrace_export_queue_bytes` (heap bytes, see `otlp/heap.rs`).

mod attributes;
mod error;
mod metrics;
mod otlp;
mod prometheus;
mod resource;
mod settings;
mod shared;
mod spans;

use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub use error::ExportError;
pub use metrics::{
    normalise_route, stall_causes, AgentCounters, ExportCounters, Histogram, Labels, Latency,
    Metrics, RouteKey, SeriesKey, StallCause, TTFT_BOUNDS,
};
pub use otlp::OtlpProtocol;
pub use prometheus::health;
pub use settings::{resolve, ExportArgs, ExportConfig, ExportSettings};
pub use shared::Shared;
pub use spans::{timeline_spans, Sampling, SamplingConfig, SpanSettings};

use attributes::kv_str;
use otlp::{QueueSender, TraceItem};
use resource::ResourceCache;
use shared::{Readiness, Stats};
use spans::{trace_spans, trigger_span, Trace, REASON_ATTRIBUTE};

use crate::event::MonoNs;
use crate::model::trace_context::IdGenerator;
use crate::model::Firing;
use crate::model::OpenRequest;
use crate::model::RequestTimeline;
use crate::units::{unix_now, WallClock};

/// The wall-clock offset is measured again when a timeline ends this long
/// after the last measurement, to follow steps of the system clock.
const CLOCK_REFRESH_NS: u64 = 60_000_000_000;

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
            ready: Readiness::default(),
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
                let (tx, task) = otlp::spawn_spans(
                    target,
                    Arc::clone(&shared),
                    settings.queue_size,
                    settings.batch_size,
                    settings.batch_timeout,
                    settings.retry,
                )?;
                targets.push(format!("spans {} {}", target.protocol, target.url));
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
                let stop_and_task = otlp::spawn_metrics(
                    target,
                    Arc::clone(&shared),
                    settings.resource.clone(),
                    settings.metrics_interval,
                )?;
                targets.push(format!("metrics {} {}", target.protocol, target.url));
                Some(stop_and_task)
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
    /// Never blocks on export. Returns what the request is labelled with
    /// (its process's service, its normalised route), worked out here
    /// once, for the live view and the triggers; with export off the
    /// service is the comm.
    pub fn record(&mut self, t: &RequestTimeline) -> Labels {
        let Some(active) = &mut self.active else {
            return Labels::new(t.comm.clone(), t);
        };
        let process = active.resources.get(t.conn.pid, &t.comm);
        let labels = Labels::new(process.service.clone(), t);
        if t.kind == crate::model::SpanKind::Server {
            // the request metrics are the server's; an upstream call is a
            // span only
            active
                .shared
                .metrics
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .record(&labels, t);
        }

        let Some(pipe) = &mut active.spans else {
            return labels;
        };
        if t.end.saturating_sub(pipe.clock.measured_at()) > CLOCK_REFRESH_NS {
            pipe.clock = WallClock::measure();
        }
        let stats = &active.shared.stats;
        let Some(trace) = Trace::of(t, &mut pipe.ids) else {
            stats.spans_not_sampled.fetch_add(1, Ordering::Relaxed);
            return labels;
        };
        let Some(reason) = pipe
            .sampling
            .decide(t, trace.parent_sampled(), &trace.trace_id)
        else {
            stats.spans_sampled_out.fetch_add(1, Ordering::Relaxed);
            return labels;
        };
        let mut spans = trace_spans(t, &trace, &pipe.clock, &mut pipe.ids, &pipe.settings);
        for span in &mut spans {
            span.attributes
                .push(kv_str(REASON_ATTRIBUTE, reason.as_str()));
        }
        let resource = Arc::clone(&process.resource);
        otlp::enqueue(stats, &pipe.tx, TraceItem { resource, spans });
        labels
    }

    /// The metric aggregation and export counters, for the live view;
    /// `None` when the exporter neither exports nor aggregates.
    pub fn shared(&self) -> Option<Arc<Shared>> {
        self.active.as_ref().map(|a| Arc::clone(&a.shared))
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
        let spans = vec![trigger_span(f, at, &pipe.clock, &mut pipe.ids)];
        otlp::enqueue(
            &active.shared.stats,
            &pipe.tx,
            TraceItem { resource, spans },
        );
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
