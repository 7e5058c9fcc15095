//! Handing decoded batches to stitching: backpressure, not drops.
//!
//! Dropping a batch when the channel is full (what this used to do) loses
//! a slice of *every* connection with data in it: each of them is then out
//! of step with its HTTP framing until it resynchronises, and the requests
//! in flight on all of them come out wrong or not at all. Waiting instead
//! leaves the records in the kernel's ring buffer; if stitching lags long
//! enough for that to fill, the kernel drops single records (counted in
//! `ringbuf_drops`), each of which touches one connection. The ingest
//! thread waits for room in the channel and in the bytes in flight (see
//! [`InFlight`]); how often it had to is counted too (`channel_waits`).

use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use super::in_flight::{Held, InFlight};
use crate::event::Event;

/// How often a wait for bytes in flight checks that stitching still
/// receives: a receiver closed with batches still queued frees no room.
const ABANDON_RECHECK: Duration = Duration::from_millis(20);

/// Decoded events on their way to stitching, with their share of the bytes
/// in flight (given back when the batch is dropped).
#[derive(Debug)]
pub struct Batch {
    events: Vec<Event>,
    _held: Held,
}

impl Deref for Batch {
    type Target = [Event];

    fn deref(&self) -> &[Event] {
        &self.events
    }
}

/// What became of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    Sent,
    /// Stitching is gone (the agent is stopping): the batch was dropped
    /// and counted, and the ingest thread should end.
    Closed,
}

/// Where batches go and what is counted on the way.
pub struct Outlet<'a> {
    pub events: &'a mpsc::Sender<Batch>,
    pub in_flight: &'a Arc<InFlight>,
    /// Batches that had to wait (for bytes in flight or channel room).
    pub waits: &'a AtomicU64,
    /// Events of batches no one will receive.
    pub dropped: &'a AtomicU64,
}

/// Sends `events` (`bytes` of heap), waiting while the bytes in flight or
/// the channel are full. Must run outside the async runtime (the ingest
/// thread).
pub fn deliver(outlet: &Outlet<'_>, events: Vec<Event>, bytes: usize) -> Delivery {
    let count = events.len() as u64;
    let closed = || {
        outlet.dropped.fetch_add(count, Ordering::Relaxed);
        Delivery::Closed
    };
    // Each batch that waits, for either, counts once.
    let mut waited = false;
    let held = match outlet.in_flight.try_hold(bytes) {
        Some(held) => held,
        None => {
            waited = true;
            outlet.waits.fetch_add(1, Ordering::Relaxed);
            let abandoned = || outlet.events.is_closed();
            match outlet.in_flight.hold(bytes, ABANDON_RECHECK, abandoned) {
                Some(held) => held,
                None => return closed(),
            }
        }
    };
    let batch = Batch {
        events,
        _held: held,
    };
    let batch = match outlet.events.try_send(batch) {
        Ok(()) => return Delivery::Sent,
        Err(mpsc::error::TrySendError::Closed(_)) => return closed(),
        Err(mpsc::error::TrySendError::Full(batch)) => batch,
    };
    if !waited {
        outlet.waits.fetch_add(1, Ordering::Relaxed);
    }
    match outlet.events.blocking_send(batch) {
        Ok(()) => Delivery::Sent,
        Err(_) => closed(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Event, LibraryMapped};

    fn batch(n: u32) -> Vec<Event> {
        (0..n)
            .map(|pid| {
                Event::LibraryMapped(LibraryMapped {
                    pid,
                    ts: u64::from(pid),
                })
            })
            .collect()
    }

    /// The ingest thread's side: its channel end, the bytes in flight and
    /// its counters.
    struct Producer {
        tx: mpsc::Sender<Batch>,
        in_flight: Arc<InFlight>,
        waits: Arc<AtomicU64>,
        dropped: Arc<AtomicU64>,
    }

    impl Producer {
        fn new(tx: mpsc::Sender<Batch>, limit: usize) -> Self {
            Self {
                tx,
                in_flight: InFlight::new(limit),
                waits: Arc::default(),
                dropped: Arc::default(),
            }
        }

        fn deliver(&self, events: u32, bytes: usize) -> Delivery {
            let outlet = Outlet {
                events: &self.tx,
                in_flight: &self.in_flight,
                waits: &self.waits,
                dropped: &self.dropped,
            };
            deliver(&outlet, batch(events), bytes)
        }

        /// Delivers on another thread: its outcome once it returns.
        fn deliver_on_thread(
            &self,
            events: u32,
            bytes: usize,
        ) -> std::thread::JoinHandle<Delivery> {
            let producer = Self {
                tx: self.tx.clone(),
                in_flight: Arc::clone(&self.in_flight),
                waits: Arc::clone(&self.waits),
                dropped: Arc::clone(&self.dropped),
            };
            std::thread::spawn(move || producer.deliver(events, bytes))
        }

        fn wait_until_blocked(&self) {
            while self.waits.load(Ordering::Relaxed) == 0 {
                std::thread::yield_now();
            }
        }

        fn counts(&self) -> (u64, u64) {
            (
                self.waits.load(Ordering::Relaxed),
                self.dropped.load(Ordering::Relaxed),
            )
        }
    }

    #[test]
    fn a_full_channel_waits_for_the_consumer_and_loses_nothing() {
        let (tx, mut rx) = mpsc::channel(1);
        let producer = Producer::new(tx, 1 << 20);
        assert_eq!(producer.deliver(3, 10), Delivery::Sent);
        assert_eq!(producer.counts(), (0, 0), "room: no wait");
        let handle = producer.deliver_on_thread(5, 10);
        producer.wait_until_blocked();
        let first = rx.blocking_recv().expect("first batch");
        let second = rx.blocking_recv().expect("second batch, after the wait");
        assert_eq!((first.len(), second.len()), (3, 5));
        assert_eq!(handle.join().expect("producer"), Delivery::Sent);
        assert_eq!(producer.counts(), (1, 0));
    }

    #[test]
    fn bytes_in_flight_hold_the_next_batch_until_stitching_is_done_with_one() {
        let (tx, mut rx) = mpsc::channel(1024);
        let producer = Producer::new(tx, 100);
        assert_eq!(producer.deliver(2, 80), Delivery::Sent);
        let handle = producer.deliver_on_thread(4, 30);
        // received, but still being stitched: its bytes are still held
        let first = rx.blocking_recv().expect("first batch");
        producer.wait_until_blocked();
        assert!(
            rx.try_recv().is_err(),
            "80 + 30 bytes went in flight under a limit of 100"
        );
        drop(first);
        assert_eq!(handle.join().expect("producer"), Delivery::Sent);
        assert_eq!(rx.blocking_recv().expect("second batch").len(), 4);
        assert_eq!(producer.counts(), (1, 0));
    }

    #[test]
    fn a_closed_channel_counts_the_batch_and_ends_delivery() {
        let (tx, rx) = mpsc::channel(1);
        let producer = Producer::new(tx, 1 << 20);
        assert_eq!(producer.deliver(2, 10), Delivery::Sent);
        // full, and the consumer goes away while the producer waits
        let handle = producer.deliver_on_thread(4, 10);
        producer.wait_until_blocked();
        drop(rx);
        assert_eq!(handle.join().expect("producer"), Delivery::Closed);
        // and a send to a channel already closed
        assert_eq!(producer.deliver(7, 10), Delivery::Closed);
        assert_eq!(producer.counts(), (1, 11));
    }

    #[test]
    fn a_receiver_closed_with_batches_queued_does_not_hold_the_producer() {
        let (tx, mut rx) = mpsc::channel(1024);
        let producer = Producer::new(tx, 100);
        assert_eq!(producer.deliver(2, 100), Delivery::Sent);
        let handle = producer.deliver_on_thread(3, 10);
        producer.wait_until_blocked();
        // closed, not dropped: the queued batch keeps its bytes
        rx.close();
        assert_eq!(handle.join().expect("producer"), Delivery::Closed);
        assert_eq!(producer.counts(), (1, 3));
    }
}
