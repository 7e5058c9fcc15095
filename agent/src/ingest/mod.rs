//! Ring buffer polling on a dedicated thread: records are decoded into
//! [`Event`]s and handed to the async side in batches over a bounded
//! channel. Losses are counted at every step: in the kernel (ring buffer
//! full), in decoding, and at the channel (consumer too slow).

mod decode;

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use tokio::sync::mpsc;

pub use decode::{decode, DecodeError};

use crate::discover::libraries::{FileKey, ProbedFile};
use crate::event::Event;
use crate::probes::{InferProbes, KernelCounters, ProbeSettings, SockProbes, TracedPids};

/// Probe changes the ingest thread carries out: it owns the probes, so
/// attaching happens there, between two polls.
#[derive(Debug)]
pub enum ProbeCommand {
    /// Attach what the file offers (OpenSSL, CUDA, `llm:*` USDT).
    Attach(ProbedFile),
    /// Detach everything attached to the file.
    Detach(FileKey),
}

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
    commands: std_mpsc::Sender<ProbeCommand>,
    stop: Arc<AtomicBool>,
    /// Taken (and joined) by the first `stop`; shared so that stopping needs
    /// no exclusive borrow while the run loop holds the handles.
    thread: std::sync::Mutex<Option<JoinHandle<()>>>,
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
        let (commands, commands_rx) = std_mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("tokentrace-ingest".into())
            .spawn({
                let stats = Arc::clone(&stats);
                let stop = Arc::clone(&stop);
                move || {
                    let channels = Channels {
                        events: &events,
                        commands: &commands_rx,
                        ready: &ready_tx,
                    };
                    run_thread(&settings, poll_interval, channels, &stats, &stop);
                }
            })
            .context("spawning the ingest thread")?;
        let (traced_pids, kernel_counters) = ready_rx
            .recv()
            .map_err(|_| anyhow!("the ingest thread ended before the probes were attached"))??;
        Ok(Self {
            traced_pids,
            kernel_counters,
            stats,
            commands,
            stop,
            thread: std::sync::Mutex::new(Some(thread)),
        })
    }

    /// Queues a probe change for the ingest thread (done within one poll
    /// interval). A stopped thread ignores it.
    pub fn command(&self, command: ProbeCommand) {
        if self.commands.send(command).is_err() {
            tracing::debug!("ingest thread gone: probe command dropped");
        }
    }

    /// Stops polling after a last read of the ring buffer (whose events are
    /// still sent), and detaches the probes.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        let thread = self.thread.lock().ok().and_then(|mut slot| slot.take());
        if let Some(thread) = thread {
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

/// The ingest thread's ends of its channels.
struct Channels<'a> {
    events: &'a mpsc::Sender<Vec<Event>>,
    commands: &'a std_mpsc::Receiver<ProbeCommand>,
    ready: &'a std_mpsc::Sender<Ready>,
}

/// The probe sets the ingest thread owns.
struct Probes {
    sock: SockProbes,
    /// None when the inference probes could not load (no uprobes, …).
    infer: Option<InferProbes>,
}

/// Attaches what `file` offers; failures of one kind do not stop the others.
fn attach_file(probes: &Probes, file: &ProbedFile) -> Vec<libbpf_rs::Link> {
    let mut links = Vec::new();
    let mut attached = Vec::new();
    let mut add = |kind: &str, result: Result<Vec<libbpf_rs::Link>>| match result {
        Ok(l) => {
            attached.push(format!("{kind} ({} probes)", l.len()));
            links.extend(l);
        }
        Err(err) => tracing::warn!("{kind}: cannot probe {}: {err:#}", file.mapped_as),
    };
    if !file.probes.tls.is_empty() {
        add("OpenSSL", probes.sock.attach_tls(&file.path));
    }
    match (&probes.infer, file.probes.cuda) {
        (Some(infer), Some(library)) => add("CUDA", infer.attach_cuda(&file.path, library)),
        (None, Some(_)) => {
            tracing::debug!("{}: CUDA library, but no inference probes", file.mapped_as)
        }
        _ => {}
    }
    if !file.probes.usdt.is_empty() {
        if let Some(infer) = &probes.infer {
            add("USDT llm", infer.attach_usdt(&file.path, &file.probes.usdt));
        }
    }
    if !attached.is_empty() {
        tracing::info!("probing {}: {}", file.mapped_as, attached.join(", "));
    }
    links
}

/// Carries out a probe command; the links of attached files live in
/// `file_links` until detached.
fn apply_command(
    probes: &Probes,
    command: ProbeCommand,
    file_links: &mut HashMap<FileKey, Vec<libbpf_rs::Link>>,
) {
    match command {
        ProbeCommand::Attach(file) => {
            if let std::collections::hash_map::Entry::Vacant(slot) = file_links.entry(file.key) {
                slot.insert(attach_file(probes, &file));
            }
        }
        ProbeCommand::Detach(key) => {
            if file_links.remove(&key).is_some() {
                tracing::info!("detached from file {key:?}: no traced process uses it");
            }
        }
    }
}

fn run_thread(
    settings: &ProbeSettings,
    poll_interval: Duration,
    channels: Channels<'_>,
    stats: &IngestStats,
    stop: &AtomicBool,
) {
    let Channels {
        events,
        commands,
        ready,
    } = channels;
    let sock = match SockProbes::load(settings) {
        Ok(probes) => probes,
        Err(err) => {
            let _ = ready.send(Err(err));
            return;
        }
    };
    let infer = match InferProbes::load(
        &sock,
        settings.min_interval_ns,
        settings.wakeup_bytes,
        settings.agent_pid,
    ) {
        Ok(infer) => Some(infer),
        Err(err) => {
            tracing::warn!("inference probes (USDT, CUDA, off-CPU) unavailable: {err:#}");
            None
        }
    };
    let probes = Probes { sock, infer };
    let handles = probes
        .sock
        .traced_pids()
        .and_then(|pids| Ok((pids, probes.sock.counters()?)));
    let batch = RefCell::new(Vec::new());
    let ring = probes.sock.ring_buffer(|record| {
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

    let mut file_links = HashMap::new();
    loop {
        // Read before polling: the last pass after a stop request still
        // drains the ring, so nothing already recorded is lost at exit.
        let stopping = stop.load(Ordering::Relaxed);
        for command in commands.try_iter() {
            apply_command(&probes, command, &mut file_links);
        }
        if !stopping {
            // Wakes early only when the kernel forced a wake-up (a full
            // batch, or a lifecycle event).
            if let Err(err) = ring.poll(poll_interval) {
                if err.kind() != libbpf_rs::ErrorKind::Interrupted {
                    tracing::error!("polling the ring buffer failed: {err}");
                    break;
                }
            }
        }
        // Records written with BPF_RB_NO_WAKEUP raise no epoll event, so a
        // poll that timed out consumed nothing: read whatever is there.
        if let Err(err) = ring.consume() {
            tracing::error!("reading the ring buffer failed: {err}");
            break;
        }
        let ready_events = std::mem::take(&mut *batch.borrow_mut());
        if !ready_events.is_empty() {
            let count = ready_events.len() as u64;
            match events.try_send(ready_events) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(_)) => {
                    stats.channel_drops.fetch_add(count, Ordering::Relaxed);
                }
                Err(mpsc::error::TrySendError::Closed(_)) => break,
            }
        }
        if stopping {
            break;
        }
    }
    // One after the other: among these are USDT links, and libbpf's USDT
    // detach returns spec ids to the object's shared usdt_manager
    // (reallocarray of free_spec_ids) without a lock; detached from several
    // threads at once they corrupted the heap ("realloc(): invalid next
    // size", "double free or corruption" at exit).
    drop(file_links);
}
