//! Handing decoded batches to stitching: backpressure, not drops.
//!
//! Dropping a batch when the channel is full (what this used to do) loses
//! a slice of *every* connection with data in it: each of them is then out
//! of step with its HTTP framing until it resynchronises, and the requests
//! in flight on all of them come out wrong or not at all. Waiting instead
//! leaves the records in the kernel's ring buffer; if stitching lags long
//! enough for that to fill, the kernel drops single records (counted in
//! `ringbuf_drops`), each of which touches one connection. How often the
//! ingest thread had to wait is counted too (`channel_waits`).

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::mpsc;

use crate::event::Event;

/// What became of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    Sent,
    /// Stitching is gone (the agent is stopping): the batch was dropped
    /// and counted, and the ingest thread should end.
    Closed,
}

/// Sends `batch`, waiting while the channel is full. Must run outside the
/// async runtime (the ingest thread). `waits` counts the batches that had
/// to wait, `dropped` the events of a batch no one will receive.
pub fn deliver(
    events: &mpsc::Sender<Vec<Event>>,
    batch: Vec<Event>,
    waits: &AtomicU64,
    dropped: &AtomicU64,
) -> Delivery {
    let count = batch.len() as u64;
    let batch = match events.try_send(batch) {
        Ok(()) => return Delivery::Sent,
        Err(mpsc::error::TrySendError::Closed(_)) => {
            dropped.fetch_add(count, Ordering::Relaxed);
            return Delivery::Closed;
        }
        Err(mpsc::error::TrySendError::Full(batch)) => batch,
    };
    waits.fetch_add(1, Ordering::Relaxed);
    match events.blocking_send(batch) {
        Ok(()) => Delivery::Sent,
        Err(_) => {
            dropped.fetch_add(count, Ordering::Relaxed);
            Delivery::Closed
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

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

    /// Delivers `events` on another thread; returns its outcome and drop
    /// count, and the wait counter it shares with the caller.
    fn producer(
        tx: mpsc::Sender<Vec<Event>>,
        events: u32,
    ) -> (std::thread::JoinHandle<(Delivery, u64)>, Arc<AtomicU64>) {
        let waits = Arc::new(AtomicU64::new(0));
        let shared = Arc::clone(&waits);
        let handle = std::thread::spawn(move || {
            let dropped = AtomicU64::new(0);
            let outcome = deliver(&tx, batch(events), &shared, &dropped);
            (outcome, dropped.into_inner())
        });
        (handle, waits)
    }

    fn wait_until_blocked(waits: &AtomicU64) {
        while waits.load(Ordering::Relaxed) == 0 {
            std::thread::yield_now();
        }
    }

    #[test]
    fn a_full_channel_waits_for_the_consumer_and_loses_nothing() {
        let (tx, mut rx) = mpsc::channel::<Vec<Event>>(1);
        let (waits, dropped) = (AtomicU64::new(0), AtomicU64::new(0));
        assert_eq!(deliver(&tx, batch(3), &waits, &dropped), Delivery::Sent);
        assert_eq!(waits.load(Ordering::Relaxed), 0, "room: no wait");
        let (handle, producer_waits) = producer(tx, 5);
        wait_until_blocked(&producer_waits);
        let first = rx.blocking_recv().expect("first batch");
        let second = rx.blocking_recv().expect("second batch, after the wait");
        assert_eq!((first.len(), second.len()), (3, 5));
        assert_eq!(handle.join().expect("producer"), (Delivery::Sent, 0));
        assert_eq!(producer_waits.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_closed_channel_counts_the_batch_and_ends_delivery() {
        let (tx, rx) = mpsc::channel::<Vec<Event>>(1);
        let (waits, dropped) = (AtomicU64::new(0), AtomicU64::new(0));
        assert_eq!(deliver(&tx, batch(2), &waits, &dropped), Delivery::Sent);
        // full, and the consumer goes away while the producer waits
        let (handle, producer_waits) = producer(tx.clone(), 4);
        wait_until_blocked(&producer_waits);
        drop(rx);
        assert_eq!(handle.join().expect("producer"), (Delivery::Closed, 4));
        // and a send to a channel already closed
        assert_eq!(deliver(&tx, batch(7), &waits, &dropped), Delivery::Closed);
        assert_eq!(dropped.load(Ordering::Relaxed), 7);
    }
}
