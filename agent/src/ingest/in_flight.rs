//! The heap of decoded batches between the ingest thread and stitching,
//! bounded in bytes.
//!
//! The channel to stitching counts batches, and a batch is whatever one
//! read of the ring buffer found: a few records after a quiet poll, a
//! megabyte or more in a flood. Counted in batches only, a stitching
//! thread that stalls (stdout a pipe nobody reads) let the ingest thread
//! move the ring's records onto the heap, batch after batch, up to the
//! channel's 1024: in a flood, hundreds of megabytes. Counted in bytes, the
//! ingest thread stops reading once `limit` bytes wait for stitching, and
//! new records wait in the ring buffer, whose memory was fixed at load; what
//! does not fit there the kernel drops and counts (`ringbuf_drops`). So the
//! agent's heap grows by at most `limit` plus the one batch the ingest
//! thread holds while it waits, however long stitching stalls.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

/// Bytes of batches handed to stitching and not yet done with.
#[derive(Debug)]
pub struct InFlight {
    limit: usize,
    held: Mutex<usize>,
    freed: Condvar,
}

/// A batch's share of the bytes in flight, given back when it is dropped
/// (stitching is done with it, or the channel dropped it unread).
#[derive(Debug)]
pub struct Held {
    in_flight: Arc<InFlight>,
    bytes: usize,
}

impl InFlight {
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            limit,
            held: Mutex::new(0),
            freed: Condvar::new(),
        })
    }

    /// Holds `bytes` for a batch if they fit under the limit, or if
    /// nothing else is held (a batch larger than the limit still goes,
    /// alone).
    pub fn try_hold(self: &Arc<Self>, bytes: usize) -> Option<Held> {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        self.take(&mut held, bytes)
    }

    /// [`try_hold`](Self::try_hold), waiting until stitching frees room.
    /// `abandoned` is asked every `recheck` while waiting (None once it
    /// says so): a receiver closed with batches still queued frees nothing.
    pub fn hold(
        self: &Arc<Self>,
        bytes: usize,
        recheck: Duration,
        abandoned: impl Fn() -> bool,
    ) -> Option<Held> {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if let Some(taken) = self.take(&mut held, bytes) {
                return Some(taken);
            }
            if abandoned() {
                return None;
            }
            held = self
                .freed
                .wait_timeout(held, recheck)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    fn take(self: &Arc<Self>, held: &mut usize, bytes: usize) -> Option<Held> {
        if *held > 0 && *held + bytes > self.limit {
            return None;
        }
        *held += bytes;
        Some(Held {
            in_flight: Arc::clone(self),
            bytes,
        })
    }

    /// Bytes held now.
    #[cfg(test)]
    fn held(&self) -> usize {
        *self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let in_flight = &self.in_flight;
        *in_flight
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner) -= self.bytes;
        in_flight.freed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::mpsc;
    use std::thread;

    use super::*;

    const RECHECK: Duration = Duration::from_millis(5);

    #[test]
    fn batches_that_fit_are_held_at_once_and_given_back_when_dropped() {
        let in_flight = InFlight::new(100);
        let a = in_flight.try_hold(60).expect("60 of 100");
        let b = in_flight.try_hold(40).expect("100 of 100");
        assert_eq!(in_flight.held(), 100);
        drop(a);
        assert_eq!(in_flight.held(), 40);
        drop(b);
        assert_eq!(in_flight.held(), 0);
    }

    #[test]
    fn a_batch_over_the_limit_waits_until_stitching_frees_room() {
        let in_flight = InFlight::new(100);
        let first = in_flight.try_hold(70).expect("70 of 100");
        assert!(in_flight.try_hold(50).is_none(), "70 + 50 of 100 held");
        let (tx, rx) = mpsc::channel();
        let producer = thread::spawn({
            let in_flight = Arc::clone(&in_flight);
            move || {
                let room = in_flight.hold(50, RECHECK, || false);
                tx.send(()).expect("test alive");
                room.expect("not abandoned")
            }
        });
        assert!(
            rx.recv_timeout(Duration::from_millis(100)).is_err(),
            "70 + 50 bytes went over a limit of 100 without waiting"
        );
        drop(first);
        let second = producer.join().expect("producer");
        assert_eq!(in_flight.held(), 50);
        drop(second);
    }

    #[test]
    fn a_batch_larger_than_the_limit_goes_alone() {
        let in_flight = InFlight::new(100);
        let big = in_flight
            .try_hold(500)
            .expect("nothing was held: the large batch must not wait");
        assert_eq!(in_flight.held(), 500);
        drop(big);
    }

    #[test]
    fn a_wait_ends_when_the_receiver_is_gone() {
        let in_flight = InFlight::new(100);
        let _kept = in_flight.try_hold(100).expect("100 of 100");
        let gone = Arc::new(AtomicBool::new(false));
        let producer = thread::spawn({
            let (in_flight, gone) = (Arc::clone(&in_flight), Arc::clone(&gone));
            move || {
                in_flight
                    .hold(1, RECHECK, || gone.load(Ordering::Relaxed))
                    .is_none()
            }
        });
        thread::sleep(RECHECK * 4);
        gone.store(true, Ordering::Relaxed);
        assert!(producer.join().expect("producer"), "the wait did not end");
        assert_eq!(in_flight.held(), 100, "an abandoned batch holds nothing");
    }
}
