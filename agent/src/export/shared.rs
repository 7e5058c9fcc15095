//! State the run loop, the export tasks and the Prometheus endpoint share:
//! the metric aggregation, the export path's counters and the readiness
//! flag. Plain data behind atomics and one mutex; who writes what is the
//! door's ([`super::Exporter`]) and the tasks' business, not this file's.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use super::metrics::{ExportCounters, Metrics};

/// Export-path counters, written by the run loop and the export tasks.
#[derive(Debug, Default)]
pub struct Stats {
    pub enqueued: AtomicU64,
    pub dequeued: AtomicU64,
    pub spans_exported: AtomicU64,
    pub spans_dropped_queue_full: AtomicU64,
    pub spans_dropped_export_failed: AtomicU64,
    pub spans_not_sampled: AtomicU64,
    pub spans_sampled_out: AtomicU64,
    pub metric_exports_failed: AtomicU64,
    /// Heap bytes of the spans in the queue.
    pub queued_bytes: AtomicU64,
    /// Heap bytes of the batch being sent or retried (request and copy).
    pub in_flight_bytes: AtomicU64,
}

/// Set once the agent traces (`/readyz`).
#[derive(Debug, Default)]
pub struct Readiness(AtomicBool);

impl Readiness {
    pub fn set(&self) {
        self.0.store(true, Ordering::Release);
    }

    pub fn clear(&self) {
        self.0.store(false, Ordering::Release);
    }

    pub fn get(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// State the run loop, the export tasks and the Prometheus endpoint share.
#[derive(Debug)]
pub struct Shared {
    pub(super) metrics: Mutex<Metrics>,
    pub(super) stats: Stats,
    pub(super) queue_capacity: u64,
    pub(super) ready: Readiness,
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
