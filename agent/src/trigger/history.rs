//! The pre-trigger ring: the most recent event batches, so a session a
//! trigger starts can cover the seconds before it fired.
//!
//! Bounded twice: by age (`before`) and by an estimate of the heap it holds
//! (`history_max_mib`); the oldest batches go first either way. The
//! estimate is the mechanism's, not a guess: each event's enum size plus
//! the heap its data event's payload and USDT strings own. A data event's
//! payload is copied out of the buffer its batch shared on the way in (see
//! [`keep`]), so the ring holds exactly those bytes, not the batch buffers
//! they came from.

use std::collections::VecDeque;

use bytes::Bytes;

use crate::event::{Event, MonoNs};

/// Heap an event holds in the ring.
pub fn event_bytes(event: &Event) -> usize {
    std::mem::size_of::<Event>()
        + match event {
            Event::Data(d) => d.payload.len(),
            Event::Accept(c) | Event::Close(c) => c.comm.capacity(),
            Event::Exec(p) | Event::Exit(p) | Event::Fork(p) => {
                p.comm.capacity() + p.filename.capacity()
            }
            Event::Listen(l) => l.comm.capacity(),
            Event::Usdt(u) => u.request_id.capacity(),
            Event::LibraryMapped(_)
            | Event::CudaSync(_)
            | Event::OffCpu(_)
            | Event::SendHold(_)
            | Event::PeerClosed(_)
            | Event::TlsHandshake(_) => 0,
        }
}

/// A copy of `event` that owns its heap: a data event's payload off the
/// ring buffer is a slice of its batch's shared buffer, and keeping the
/// slice would keep the whole buffer for as long as the ring holds it.
fn keep(event: &Event) -> Event {
    match event {
        Event::Data(d) => {
            let mut d = d.clone();
            d.payload = Bytes::copy_from_slice(&d.payload);
            Event::Data(d)
        }
        other => other.clone(),
    }
}

#[derive(Debug)]
struct Batch {
    /// The newest event's time.
    ts: MonoNs,
    bytes: usize,
    events: Vec<Event>,
}

/// Recent event batches, oldest first.
#[derive(Debug)]
pub struct History {
    keep_ns: u64,
    max_bytes: usize,
    bytes: usize,
    batches: VecDeque<Batch>,
    /// Events let go for the byte bound while younger than `keep_ns`.
    evicted_early: u64,
}

/// A snapshot for a session: the batches, and from when they cover.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub batches: Vec<Vec<Event>>,
    /// The oldest event's time (None: empty ring).
    pub from: Option<MonoNs>,
    /// Events the byte bound let go that `before` would have kept.
    pub evicted_early: u64,
}

impl History {
    pub fn new(keep_ns: u64, max_bytes: usize) -> Self {
        Self {
            keep_ns,
            max_bytes,
            bytes: 0,
            batches: VecDeque::new(),
            evicted_early: 0,
        }
    }

    /// Keeps a copy of `batch`, dropping what is too old or over the bound.
    pub fn push(&mut self, batch: &[Event], now: MonoNs) {
        if batch.is_empty() || self.keep_ns == 0 {
            return;
        }
        let bytes = batch.iter().map(event_bytes).sum::<usize>();
        let ts = batch.iter().map(Event::order_ts).max().unwrap_or(now);
        self.batches.push_back(Batch {
            ts,
            bytes,
            events: batch.iter().map(keep).collect(),
        });
        self.bytes += bytes;
        let from = now.saturating_sub(self.keep_ns);
        while let Some(front) = self.batches.front() {
            let too_old = front.ts < from;
            if !too_old && self.bytes <= self.max_bytes {
                break;
            }
            if !too_old {
                self.evicted_early += front.events.len() as u64;
            }
            self.bytes -= front.bytes;
            self.batches.pop_front();
        }
    }

    /// Heap held now (the estimate the bound applies to).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// A copy of what the ring holds (it keeps filling for the next firing).
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            batches: self.batches.iter().map(|b| b.events.clone()).collect(),
            from: self
                .batches
                .iter()
                .flat_map(|b| b.events.iter().map(Event::order_ts))
                .min(),
            evicted_early: self.evicted_early,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{ConnEvent, ConnId, DataEvent, Direction, IoCall};

    fn close(ts: MonoNs) -> Event {
        Event::Close(ConnEvent {
            conn: ConnId {
                pid: 1,
                fd: 3,
                sock_ino: 9,
            },
            tid: 1,
            comm: String::new(),
            ts,
            addrs: None,
            established: None,
        })
    }

    #[test]
    fn keeps_only_the_last_seconds() {
        let mut h = History::new(2_000, usize::MAX);
        for ts in [1_000, 2_000, 3_000, 4_000] {
            h.push(&[close(ts)], ts);
        }
        let s = h.snapshot();
        assert_eq!(
            (s.batches.len(), s.from, s.evicted_early),
            (3, Some(2_000), 0)
        );
    }

    #[test]
    fn the_byte_bound_wins_and_counts_what_it_let_go() {
        let one = event_bytes(&close(0));
        let mut h = History::new(u64::MAX, 3 * one);
        for ts in 1..=5 {
            h.push(&[close(ts)], ts);
        }
        assert!(h.bytes() <= 3 * one);
        let s = h.snapshot();
        assert_eq!((s.batches.len(), s.from, s.evicted_early), (3, Some(3), 2));
    }

    /// A data event off the ring buffer: its payload a slice of `batch`.
    fn write_from(batch: &Bytes, ts: MonoNs) -> Event {
        Event::Data(DataEvent {
            conn: ConnId {
                pid: 1,
                fd: 3,
                sock_ino: 9,
            },
            tid: 1,
            comm: "node".into(),
            ts_enter: ts,
            ts_exit: ts,
            ingress: None,
            marks: Vec::new(),
            direction: Direction::Egress,
            call: IoCall::Writev,
            len: 4,
            payload: batch.slice(0..4),
            addrs: None,
            tcp: None,
        })
    }

    #[test]
    fn a_kept_data_event_owns_its_bytes_not_its_batchs_buffer() {
        let batch = Bytes::from(vec![7u8; 64 * 1024]);
        let mut h = History::new(u64::MAX, usize::MAX);
        h.push(&[write_from(&batch, 1)], 1);
        let kept = h.snapshot();
        let Some(Event::Data(d)) = kept.batches.first().and_then(|b| b.first()) else {
            panic!("the data event was not kept: {kept:?}");
        };
        assert_eq!(&d.payload[..], &[7u8; 4]);
        assert!(
            !batch.as_ptr_range().contains(&d.payload.as_ptr()),
            "the kept payload still points into the 64 KiB batch buffer"
        );
        // The bound counts the 4 bytes kept, as the heap holds them.
        assert_eq!(h.bytes(), std::mem::size_of::<Event>() + 4);
    }
}
