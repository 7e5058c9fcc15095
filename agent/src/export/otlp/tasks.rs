//! The OTLP export tasks on the runtime, and the run loop's hand-off to
//! them.
//!
//! The span task batches queued spans, encodes them and sends each batch
//! with retry and backoff; the metrics task pushes the cumulative metrics
//! on an interval (and once more at shutdown). [`enqueue`] is the only
//! part the run loop runs: a `try_push` that never waits, counting what
//! does not fit.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::client::{OtlpClient, SendError, Target};
use super::encode::{self, TraceItem};
use super::heap;
use super::queue::{self, QueueReceiver, QueueSender};
use super::reachability::Reachability;
use super::retry::{with_retry, GaveUp, Outage, RetryPolicy};
use crate::export::error::ExportError;
use crate::export::resource::ResourceRules;
use crate::export::shared::{Shared, Stats};
use crate::units::unix_now;

/// Queues spans for export without waiting; a full queue drops them,
/// counted.
pub fn enqueue(stats: &Stats, tx: &QueueSender<TraceItem>, item: TraceItem) {
    let count = item.spans.len() as u64;
    let bytes = heap::spans_bytes(&item.spans);
    match tx.try_push(item) {
        Ok(()) => {
            stats.enqueued.fetch_add(1, Ordering::Relaxed);
            stats.queued_bytes.fetch_add(bytes, Ordering::Relaxed);
        }
        Err(_) => {
            stats
                .spans_dropped_queue_full
                .fetch_add(count, Ordering::Relaxed);
        }
    }
}

/// Starts the span task sending to `target`; spans go in through the
/// returned sender, and the task ends once it is dropped and the queue
/// drained. Fails only on a malformed endpoint.
pub fn spawn_spans(
    target: &Target,
    shared: Arc<Shared>,
    queue_size: usize,
    batch_size: usize,
    linger: Duration,
    retry: RetryPolicy,
) -> Result<(QueueSender<TraceItem>, JoinHandle<()>), ExportError> {
    let client = OtlpClient::new(target)?;
    let (tx, rx) = queue::bounded(queue_size);
    let task = tokio::spawn(export_spans(rx, client, shared, batch_size, linger, retry));
    Ok((tx, task))
}

/// Starts the metrics task pushing to `target` every `interval`; sending
/// on the returned channel makes it push once more and end. Fails only on
/// a malformed endpoint.
pub fn spawn_metrics(
    target: &Target,
    shared: Arc<Shared>,
    rules: ResourceRules,
    interval: Duration,
) -> Result<(oneshot::Sender<()>, JoinHandle<()>), ExportError> {
    let client = OtlpClient::new(target)?;
    let (stop_tx, stop_rx) = oneshot::channel();
    let task = tokio::spawn(export_metrics(client, shared, rules, interval, stop_rx));
    Ok((stop_tx, task))
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

    fn failed(&self, err: &SendError, consequence: &str) {
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
                if let Err(err @ SendError::Retryable { .. }) = &result {
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
