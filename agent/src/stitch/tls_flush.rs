//! When a memory-BIO TLS server's bytes really left. Node (and any server
//! that feeds OpenSSL through memory BIOs) only encrypts into a buffer in
//! `SSL_write`; its event loop writes the ciphertext to the socket later,
//! outside any SSL call, so the kernel sees that write as data on a
//! ciphertext socket. Usually within tens of µs; under load 1–6 ms later
//! (seen against the loopback capture: 32 handshakes in one burst behind a
//! CPU hog, a first event's record 5.9 ms after its `SSL_write`).
//!
//! A chunk of such a connection is dated by the first ciphertext write on
//! its socket at or after its `SSL_write`: the earliest its record can have
//! left, never earlier than before. A finished request waits (at most
//! [`HOLD_NS`]) for the write that carries its last bytes. Socket-BIO
//! servers (nginx, llama.cpp) write their ciphertext inside the SSL call,
//! where it is not reported as data: their sockets have no ciphertext
//! writes here and their requests pass straight through.

use std::collections::{HashMap, VecDeque};

use crate::event::{MonoNs, SockAddrs};
use crate::model::RequestTimeline;

/// Longest a finished request waits for its last bytes' write.
pub(crate) const HOLD_NS: u64 = 100_000_000;

/// Ciphertext writes remembered per socket: the newest, within
/// [`KEEP_NS`]. A request's chunks are at most this many flushes apart
/// from its end when it comes out (it is dated when it finishes).
const WRITES_PER_SOCKET: usize = 4096;

/// How long a socket's writes are kept after they happened: well past the
/// longest request worth dating chunk by chunk, then the oldest go.
const KEEP_NS: u64 = 600_000_000_000;

/// Most finished requests waiting at once (more go out as they are).
const MAX_HELD: usize = 4096;

type Socket = (u32, SockAddrs);

/// One socket's ciphertext writes.
#[derive(Debug, Clone, Default)]
struct Writes {
    /// Entry times, oldest first.
    ts: VecDeque<MonoNs>,
    /// The newest write forgotten: an emit at or before it cannot be
    /// dated (its write may be among the forgotten).
    forgot: MonoNs,
}

impl Writes {
    fn last(&self) -> Option<MonoNs> {
        self.ts.back().copied()
    }

    /// The first write at or after `ts`; `ts` itself when that is not
    /// known.
    fn at_or_after(&self, ts: MonoNs) -> MonoNs {
        if ts <= self.forgot {
            return ts;
        }
        let i = self.ts.partition_point(|&w| w < ts);
        self.ts.get(i).copied().unwrap_or(ts)
    }

    fn forget_front(&mut self) {
        if let Some(ts) = self.ts.pop_front() {
            self.forgot = self.forgot.max(ts);
        }
    }
}

#[derive(Debug, Clone, Default)]
pub(crate) struct TlsFlush {
    writes: HashMap<Socket, Writes>,
    /// Finished requests whose last bytes' write has not been seen.
    held: VecDeque<RequestTimeline>,
}

impl TlsFlush {
    /// A ciphertext write on a socket of `pid` entered at `ts`: requests
    /// it completes go to `out`.
    pub(crate) fn ciphertext_write(
        &mut self,
        pid: u32,
        addrs: SockAddrs,
        ts: MonoNs,
        out: &mut Vec<RequestTimeline>,
    ) {
        let writes = self.writes.entry((pid, addrs)).or_default();
        if writes.last().is_some_and(|last| last > ts) {
            return; // out of order: never date by a stamp before a later one
        }
        if writes.ts.len() >= WRITES_PER_SOCKET {
            writes.forget_front();
        }
        writes.ts.push_back(ts);
        let mut i = 0;
        while i < self.held.len() {
            let done = socket_of(&self.held[i]) == Some((pid, addrs)) && self.held[i].end <= ts;
            if done {
                if let Some(mut t) = self.held.remove(i) {
                    self.date(&mut t);
                    out.push(t);
                }
            } else {
                i += 1;
            }
        }
    }

    /// A finished request: dated and passed on when its socket's writes
    /// cover it (or its socket has none: not a memory-BIO server), held
    /// otherwise.
    pub(crate) fn finished(&mut self, mut t: RequestTimeline, out: &mut Vec<RequestTimeline>) {
        let Some(writes) = socket_of(&t).and_then(|s| self.writes.get(&s)) else {
            out.push(t);
            return;
        };
        if writes.last().is_some_and(|last| last >= t.end) || self.held.len() >= MAX_HELD {
            self.date(&mut t);
            out.push(t);
        } else {
            self.held.push_back(t);
        }
    }

    /// Releases what waited past [`HOLD_NS`] at `now` (dated by the
    /// writes seen), and forgets writes older than [`KEEP_NS`].
    pub(crate) fn expire(&mut self, now: MonoNs, out: &mut Vec<RequestTimeline>) {
        while self
            .held
            .front()
            .is_some_and(|t| now.saturating_sub(t.end) >= HOLD_NS)
        {
            if let Some(mut t) = self.held.pop_front() {
                self.date(&mut t);
                out.push(t);
            }
        }
        let keep_from = now.saturating_sub(KEEP_NS);
        self.writes.retain(|_, w| {
            while w.ts.front().is_some_and(|&ts| ts < keep_from) {
                w.forget_front();
            }
            !w.ts.is_empty()
        });
    }

    /// The agent stops: every held request goes out.
    pub(crate) fn flush(&mut self, out: &mut Vec<RequestTimeline>) {
        self.expire(MonoNs::MAX, out);
    }

    /// Moves each of `t`'s emits to the first ciphertext write at or after
    /// it (those after the last write seen stay as they are).
    fn date(&self, t: &mut RequestTimeline) {
        let Some(writes) = socket_of(t).and_then(|s| self.writes.get(&s)) else {
            return;
        };
        let at_or_after = |ts: MonoNs| writes.at_or_after(ts);
        let chunks: Vec<MonoNs> = t.chunk_ts.iter().map(|&c| at_or_after(c)).collect();
        t.chunk_ts.clear();
        for c in chunks {
            t.push_chunk(c);
        }
        t.response_start = t.response_start.map(at_or_after);
        t.first_body_byte = t.first_body_byte.map(at_or_after);
        t.end = at_or_after(t.end).max(t.chunk_ts.last().copied().unwrap_or(0));
        t.derived = Default::default();
    }
}

/// The socket a TLS request's bytes went out on, when it is tied to one.
fn socket_of(t: &RequestTimeline) -> Option<Socket> {
    t.tls.then_some(())?;
    t.addrs.map(|a| (t.conn.pid, a))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::ConnId;

    fn addrs() -> SockAddrs {
        SockAddrs {
            local: "127.0.0.1:443".parse().expect("address"),
            remote: "127.0.0.1:50000".parse().expect("address"),
        }
    }

    fn tls_request(chunks: &[MonoNs]) -> RequestTimeline {
        let mut t = RequestTimeline {
            conn: ConnId {
                pid: 7,
                fd: ConnId::TLS_FD,
                sock_ino: 0x5510,
            },
            tls: true,
            addrs: Some(addrs()),
            request_start: 10,
            response_start: Some(20),
            end: *chunks.last().expect("chunks"),
            body_kind: Some(crate::model::BodyKind::Sse),
            ..RequestTimeline::default()
        };
        for &c in chunks {
            t.push_chunk(c);
        }
        t
    }

    #[test]
    fn a_memory_bio_servers_chunks_are_dated_by_the_writes_that_carried_them() {
        let mut flush = TlsFlush::default();
        let mut out = Vec::new();
        // the handshake's ciphertext went out by the event loop
        flush.ciphertext_write(7, addrs(), 5, &mut out);
        // SSL_write at 20 (headers), 30, 40; the loop flushed at 25, 33 and 55
        flush.ciphertext_write(7, addrs(), 25, &mut out);
        flush.ciphertext_write(7, addrs(), 33, &mut out);
        flush.finished(tls_request(&[30, 40]), &mut out);
        assert!(out.is_empty(), "its last record has not left yet");
        flush.ciphertext_write(7, addrs(), 55, &mut out);
        let [t] = out.as_slice() else {
            panic!("one request: {out:?}")
        };
        assert_eq!(t.chunk_ts, vec![33, 55]);
        assert_eq!((t.response_start, t.end), (Some(25), 55));
        assert_eq!(t.ttft_ns(), Some(23));
    }

    #[test]
    fn a_socket_with_no_ciphertext_writes_passes_straight_through() {
        // socket-BIO (nginx): the ciphertext is written inside SSL_write
        let mut flush = TlsFlush::default();
        let mut out = Vec::new();
        flush.finished(tls_request(&[30, 40]), &mut out);
        assert_eq!(out[0].chunk_ts, vec![30, 40]);
    }

    #[test]
    fn a_request_whose_last_write_never_comes_goes_out_after_the_hold() {
        let mut flush = TlsFlush::default();
        let mut out = Vec::new();
        flush.ciphertext_write(7, addrs(), 35, &mut out);
        flush.finished(tls_request(&[30, 40]), &mut out);
        flush.expire(40 + HOLD_NS - 1, &mut out);
        assert!(out.is_empty());
        flush.expire(40 + HOLD_NS, &mut out);
        assert_eq!(out[0].chunk_ts, vec![35, 40], "the last stays as it was");
    }
}
