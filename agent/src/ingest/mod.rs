//! Ring buffer polling on a dedicated thread: records are decoded into
//! [`Event`]s and handed to the async side in batches over a bounded
//! channel. Losses are counted at every step: in the kernel (ring buffer
//! full), in decoding, and at the channel (consumer too slow).

mod decode;

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use tokio::sync::mpsc;

pub use decode::{decode, DecodeError};

use crate::event::Event;
use crate::probes::{KernelCounters, ProbeSettings, SockProbes, TracedPids};

/// Counters of the userspace half of ingestion.
#[derive(Debug, Default)]
pub struct IngestStats {
    /// Records read from the ring buffer.
    pub records: AtomicU64,
    /// Records that failed to decode.
    pub decode_errors: AtomicU64,
    /// Events dropped because the consumer's channel was full.
    pub channel_drops: AtomicU64,
}

/// A running ingest thread and the handles to steer the probes it owns.
pub struct Ingest {
    pub traced_pids: TracedPids,
    pub kernel_counters: KernelCounters,
    pub stats: Arc<IngestStats>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Ingest {
    /// Loads and attaches the probes on a new thread and starts polling.
    /// Returns once the probes are attached (or failed to).
    pub fn start(
        settings: ProbeSettings,
        poll_interval: Duration,
        events: mpsc::Sender<Vec<Event>>,
    ) -> Result<Self> {
        let stats = Arc::new(IngestStats::default());
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std_mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("tokentrace-ingest".into())
            .spawn({
                let stats = Arc::clone(&stats);
                let stop = Arc::clone(&stop);
                move || run_thread(&settings, poll_interval, &events, &stats, &stop, &ready_tx)
            })
            .context("spawning the ingest thread")?;
        let (traced_pids, kernel_counters) = ready_rx
            .recv()
            .map_err(|_| anyhow!("the ingest thread ended before the probes were attached"))??;
        Ok(Self {
            traced_pids,
            kernel_counters,
            stats,
            stop,
            thread: Some(thread),
        })
    }

    /// Stops polling and detaches the probes.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!("the ingest thread panicked");
            }
        }
    }
}

impl Drop for Ingest {
    fn drop(&mut self) {
        self.stop();
    }
}

type Ready = Result<(TracedPids, KernelCounters)>;

fn run_thread(
    settings: &ProbeSettings,
    poll_interval: Duration,
    events: &mpsc::Sender<Vec<Event>>,
    stats: &IngestStats,
    stop: &AtomicBool,
    ready: &std_mpsc::Sender<Ready>,
) {
    let setup = || -> Result<SockProbes> { SockProbes::load(settings) };
    let probes = match setup() {
        Ok(probes) => probes,
        Err(err) => {
            let _ = ready.send(Err(err));
            return;
        }
    };
    let handles = probes
        .traced_pids()
        .and_then(|pids| Ok((pids, probes.counters()?)));
    let batch = RefCell::new(Vec::new());
    let ring = probes.ring_buffer(|record| {
        stats.records.fetch_add(1, Ordering::Relaxed);
        match decode(record) {
            Ok(event) => batch.borrow_mut().push(event),
            Err(err) => {
                stats.decode_errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("undecodable record: {err}");
            }
        }
        0
    });
    let ring = match (handles, ring) {
        (Ok(handles), Ok(ring)) => {
            if ready.send(Ok(handles)).is_err() {
                return;
            }
            ring
        }
        (Err(err), _) | (_, Err(err)) => {
            let _ = ready.send(Err(err));
            return;
        }
    };

    while !stop.load(Ordering::Relaxed) {
        if let Err(err) = ring.poll(poll_interval) {
            if err.kind() != libbpf_rs::ErrorKind::Interrupted {
                tracing::error!("polling the ring buffer failed: {err}");
                break;
            }
        }
        let ready_events = std::mem::take(&mut *batch.borrow_mut());
        if ready_events.is_empty() {
            continue;
        }
        let count = ready_events.len() as u64;
        match events.try_send(ready_events) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                stats.channel_drops.fetch_add(count, Ordering::Relaxed);
            }
            Err(mpsc::error::TrySendError::Closed(_)) => break,
        }
    }
}
