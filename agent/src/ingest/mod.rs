//! Ring buffer polling on a dedicated thread: records are decoded into
//! [`Event`]s and handed to the async side in batches over a bounded
//! channel. Losses are counted at every step: in the kernel (ring buffer
//! full), in decoding, and at the channel (consumer too slow). The thread
//! holds the run's [`ProbeSet`] (loaded, attached and detached by
//! `probes`) and carries out its [`ProbeCommand`]s between reads.

mod decode;
mod deliver;
mod gather;
mod in_flight;
mod wakeup;

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use bytes::BytesMut;
use tokio::sync::mpsc;

use decode::decode_into;
pub use decode::{decode, DecodeError};
pub use deliver::Batch;
use deliver::{deliver, Delivery, Outlet};
use in_flight::InFlight;

use crate::event::Event;
use crate::probes::{
    AttachFailures, AttachedProbes, FileLinks, KernelCounters, ProbeCommand, ProbeSet,
    ProbeSettings, TracedPids,
};

/// The least a batch's payload buffer starts with: a batch after a quiet
/// one still gets its few records' payloads in one allocation.
const MIN_BATCH_PAYLOADS: usize = 4096;

/// What the ring buffer callback returns to end a read early on a full
/// batch. libbpf hands it back from the read, and nothing else makes a read
/// negative: only a callback's error does.
const STOP_READING: i32 = -libc::ENOBUFS;

/// The least heap that decoded batches may hold on their way to stitching
/// (see [`in_flight_limit`]).
const MIN_IN_FLIGHT_BYTES: usize = 4 << 20;

/// A batch stops growing past this share of the bytes in flight (see
/// [`in_flight_limit`]): the rest of the ring waits for the next batch.
const BATCHES_IN_FLIGHT: usize = 4;

/// The heap decoded batches may hold on their way to stitching: a quarter
/// of the ring buffer (4 MiB by default), room for the default wake-up's
/// records twice over (2 MiB), so that the ingest thread does not wait
/// while stitching keeps up. When stitching stalls, records wait in the
/// ring instead, whose memory is fixed.
fn in_flight_limit(ring_buffer_bytes: u32) -> usize {
    (ring_buffer_bytes as usize / 4).max(MIN_IN_FLIGHT_BYTES)
}

/// Counters of the userspace half of ingestion.
#[derive(Debug, Default)]
pub struct IngestStats {
    /// Records that failed to decode.
    pub decode_errors: AtomicU64,
    /// Events dropped at the channel: only once stitching is gone (the
    /// agent stopping); a full channel makes the ingest thread wait.
    pub channel_drops: AtomicU64,
    /// Batches that found the channel or the bytes in flight full and
    /// waited for stitching
    /// (backpressure; the ring buffer holds what arrives meanwhile).
    pub channel_waits: AtomicU64,
}

/// A running ingest thread and the handles to steer the probes it owns.
pub struct Ingest {
    pub traced_pids: TracedPids,
    pub kernel_counters: KernelCounters,
    pub stats: Arc<IngestStats>,
    /// Uprobes the traced processes need that could not be attached.
    pub attach_failures: Arc<AttachFailures>,
    /// Programs and uprobe links in place now.
    pub attached: Arc<AttachedProbes>,
    commands: std_mpsc::Sender<ProbeCommand>,
    wake: wakeup::Notifier,
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
        events: mpsc::Sender<Batch>,
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
        let (traced_pids, kernel_counters, wake, attach_failures, attached) = ready_rx
            .recv()
            .map_err(|_| anyhow!("the ingest thread ended before the probes were attached"))??;
        Ok(Self {
            traced_pids,
            kernel_counters,
            stats,
            attach_failures,
            attached,
            commands,
            wake,
            stop,
            thread: std::sync::Mutex::new(Some(thread)),
        })
    }

    /// Queues a probe change for the ingest thread and wakes it. A stopped
    /// thread ignores it.
    pub fn command(&self, command: ProbeCommand) {
        if self.commands.send(command).is_err() {
            tracing::debug!("ingest thread gone: probe command dropped");
        }
        self.wake.notify();
    }

    /// Waits until every probe command queued so far is carried out (at
    /// most `timeout`): whatever they attached is in place on return.
    pub fn wait_for_commands(&self, timeout: Duration) -> Result<()> {
        let (done, wait) = std_mpsc::channel();
        self.command(ProbeCommand::Barrier(done));
        wait.recv_timeout(timeout)
            .map_err(|_| anyhow!("the ingest thread did not attach the probes within {timeout:?}"))
    }

    /// Asks the thread to read the ring buffer a last time, send what it
    /// holds and end; returns at once. The caller keeps receiving until
    /// the channel closes (the thread waits while it is full).
    pub fn request_stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        self.wake.notify();
    }

    /// Stops polling after a last read of the ring buffer (whose events are
    /// still sent), and detaches the probes. The receiving end must be
    /// drained or closed first: a thread waiting on a full channel would
    /// never be joined.
    pub fn stop(&self) {
        self.request_stop();
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

/// Room for the batch after one of `len` records in `capacity`.
fn next_batch_room(len: usize, capacity: usize) -> usize {
    (len + len / 4).max(capacity - capacity.div_ceil(8))
}

type Ready = Result<(
    TracedPids,
    KernelCounters,
    wakeup::Notifier,
    Arc<AttachFailures>,
    Arc<AttachedProbes>,
)>;

/// The ingest thread's ends of its channels.
struct Channels<'a> {
    events: &'a mpsc::Sender<Batch>,
    commands: &'a std_mpsc::Receiver<ProbeCommand>,
    ready: &'a std_mpsc::Sender<Ready>,
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
    let probes = match ProbeSet::load(settings) {
        Ok(probes) => probes,
        Err(err) => {
            let _ = ready.send(Err(err));
            return;
        }
    };
    let handles = probes.handles();
    // Before ready: segments are dated by their receive stamps from the
    // start. Without them (turned off, or failing) the run goes on, its
    // segments dated when TCP processed them (see probes::ArrivalStamps).
    let mut arrival_stamps = if settings.receive_stamps {
        probes
            .arrival_stamps()
            .inspect_err(|err| {
                tracing::warn!("no receive stamps, ingress dated by TCP processing: {err:#}")
            })
            .ok()
    } else {
        None
    };
    let batch = RefCell::new(Vec::new());
    // The payloads of the batch being read, one buffer for them all: an
    // allocation per record, freed on the stitching thread, cost more than
    // the rest of decoding (glibc's malloc and free were 12-18 % of the
    // agent under the node flood). Each batch gets its own buffer, so the
    // two threads never share one's reference count while both run.
    let payloads = RefCell::new(BytesMut::with_capacity(MIN_BATCH_PAYLOADS));
    let payload_bytes = Cell::new(0usize);
    let payload_capacity = Cell::new(MIN_BATCH_PAYLOADS);
    let in_flight_bytes = in_flight_limit(settings.ring_buffer_bytes);
    let in_flight = InFlight::new(in_flight_bytes);
    // One read of the ring decodes this much at most, then hands it on and
    // reads again: without the bound, a read after stitching lagged took
    // the whole ring (16 MiB of records) into one batch (+15.7 MB of peak
    // RSS after tests/ebpf_backpressure.rs's stall, +5.1 MB with it). What
    // waits meanwhile waits in the ring, whose memory is fixed.
    let batch_limit = in_flight_bytes / BATCHES_IN_FLIGHT;
    let outlet = Outlet {
        events,
        in_flight: &in_flight,
        waits: &stats.channel_waits,
        dropped: &stats.channel_drops,
    };
    let ring = probes.ring_buffer(|record| {
        match decode_into(record, &mut payloads.borrow_mut()) {
            Ok(event) => {
                if let Event::Data(data) = &event {
                    payload_bytes.set(payload_bytes.get() + data.payload.len());
                }
                let mut batch = batch.borrow_mut();
                batch.push(event);
                if batch.len() * std::mem::size_of::<Event>() + payload_bytes.get() >= batch_limit {
                    // Ends this read after the record (libbpf counts it read).
                    return STOP_READING;
                }
            }
            Err(err) => {
                stats.decode_errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("undecodable record: {err}");
            }
        }
        0
    });
    let waiting = ring.as_ref().ok().map(|ring| {
        wakeup::Wakeup::new(ring.epoll_fd()).context("creating the ingest thread's wake-up")
    });
    let (ring, wakeup) = match (handles, ring, waiting) {
        (Ok((pids, counters)), Ok(ring), Some(Ok((wakeup, notifier)))) => {
            if ready
                .send(Ok((
                    pids,
                    counters,
                    notifier,
                    probes.failures(),
                    probes.attached(),
                )))
                .is_err()
            {
                return;
            }
            (ring, wakeup)
        }
        (Err(err), _, _) | (_, Err(err), _) | (_, _, Some(Err(err))) => {
            let _ = ready.send(Err(err));
            return;
        }
        (_, _, None) => return,
    };

    let mut file_links = FileLinks::default();
    // The last read ended on a full batch and left records behind.
    let mut unread = false;
    loop {
        // Read before waiting: the last pass after a stop request still
        // drains the ring, so nothing already recorded is lost at exit.
        let stopping = stop.load(Ordering::Relaxed);
        for command in commands.try_iter() {
            probes.apply(command, &mut file_links);
        }
        // Records left behind by a full batch are read on at once.
        if !stopping && !unread {
            // Wakes early when the kernel forced a wake-up (a full batch, or
            // a lifecycle event) or a probe command came.
            if let Err(err) = wakeup.wait(poll_interval) {
                tracing::error!("waiting for the ring buffer failed: {err}");
                break;
            }
        }
        // Records written with BPF_RB_NO_WAKEUP raise no epoll event, so a
        // poll that timed out consumed nothing: read whatever is there.
        let read = ring.consume_raw();
        unread = read == STOP_READING;
        if read < 0 && !unread {
            let err = std::io::Error::from_raw_os_error(-read);
            tracing::error!("reading the ring buffer failed: {err}");
            break;
        }
        if let Some(stamps) = &mut arrival_stamps {
            stamps.refresh();
        }
        // The next batch starts with room for this one's size and a
        // quarter, or for most of the last room if that is more: grown from
        // empty, a batch of thousands of records was reallocated and moved
        // a dozen times per pass (realloc was 8 % of this thread under the
        // node flood), and sized by the last batch alone, a large batch
        // after a small one (passes alternate) still moved every record
        // several times. The room decays by an eighth per smaller pass, so
        // one burst does not hold memory for long, and a batch far smaller
        // than its room gives the rest back before it queues (a shrinking
        // realloc moves nothing): what waits in the channel, and is counted
        // against the in-flight bound, is what the batch needs.
        let ready_events = {
            let mut batch = batch.borrow_mut();
            let room = next_batch_room(batch.len(), batch.capacity());
            if batch.is_empty() {
                batch.shrink_to(room);
                Vec::new()
            } else {
                let mut full = std::mem::replace(&mut *batch, Vec::with_capacity(room));
                if full.capacity() > 2 * full.len() {
                    full.shrink_to_fit();
                }
                full
            }
        };
        if !ready_events.is_empty() {
            // The next batch's payloads start in a buffer of this one's size.
            let used = payload_bytes.replace(0);
            let next = used.max(MIN_BATCH_PAYLOADS);
            *payloads.borrow_mut() = BytesMut::with_capacity(next);
            // The batch's heap: its events and its payloads' buffer (process
            // and file names are a few dozen bytes, on lifecycle records only).
            let buffer = payload_capacity.replace(next).max(used);
            let bytes = ready_events.capacity() * std::mem::size_of::<Event>() + buffer;
            if deliver(&outlet, ready_events, bytes) == Delivery::Closed {
                break;
            }
        }
        if stopping && !unread {
            break;
        }
    }
    // On this thread, one after the other (see ProbeSet::apply), before
    // the probe sets they belong to.
    drop(file_links);
}

#[cfg(test)]
mod tests {
    use super::next_batch_room;

    #[test]
    fn batch_room_follows_growth_and_decays_to_nothing() {
        // A larger batch sets the room; a smaller one keeps most of it.
        assert_eq!(next_batch_room(1000, 1024), 1250);
        assert_eq!(next_batch_room(10, 1250), 1250 - 157);
        // Idle passes shrink it to nothing, however small it got.
        let mut room = 1250;
        let mut passes = 0;
        while room > 0 {
            room = next_batch_room(0, room);
            passes += 1;
        }
        assert!(passes < 100, "{passes} idle passes to release the room");
    }
}
