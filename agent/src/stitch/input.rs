//! What one syscall gave the parsers: captured bytes, then bytes known only
//! by count.
//!
//! The probes capture a bounded prefix of each read or write but always
//! report its true length. Every parser therefore takes [`Bytes`], which is
//! either captured bytes or an *unknown run*: bytes that were moved but not
//! captured. Counting (Content-Length, chunk sizes, byte totals) works the
//! same on both; only framing that falls inside an unknown run needs a guess,
//! and each parser documents its own.

use crate::event::{DataEvent, Direction, IngressMark, MonoNs};

/// A run of bytes from one read or write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bytes<'a> {
    /// Captured bytes.
    Known(&'a [u8]),
    /// This many bytes were moved but not captured (the capture cap cut the
    /// payload). Always the tail of a syscall.
    Unknown(u64),
}

impl<'a> Bytes<'a> {
    pub(crate) fn len(&self) -> u64 {
        match self {
            Bytes::Known(b) => b.len() as u64,
            Bytes::Unknown(n) => *n,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Splits off and returns up to `n` bytes from the front.
    pub(crate) fn take(&mut self, n: u64) -> Bytes<'a> {
        match self {
            Bytes::Known(b) => {
                let k = usize::try_from(n).unwrap_or(usize::MAX).min(b.len());
                let (head, tail) = b.split_at(k);
                *b = tail;
                Bytes::Known(head)
            }
            Bytes::Unknown(m) => {
                let k = n.min(*m);
                *m -= k;
                Bytes::Unknown(k)
            }
        }
    }
}

/// One read or write as the parsers see it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Io<'a> {
    /// The time stitching uses for this syscall: exit for reads (arrival),
    /// entry for writes (emit).
    pub ts: MonoNs,
    /// Ingress: when the read's oldest byte reached the host, if known.
    pub ingress: Option<MonoNs>,
    /// Ingress: when each range of the syscall's bytes arrived (offsets
    /// from the syscall's start, not this view's).
    pub marks: &'a [IngressMark],
    /// Where this view starts in the syscall (a tail after a protocol
    /// switch).
    pub base: u64,
    /// The captured prefix, never longer than the true length.
    pub known: &'a [u8],
    /// Bytes moved after the captured prefix.
    pub unknown: u64,
}

impl<'a> Io<'a> {
    pub(crate) fn of(ev: &'a DataEvent) -> Self {
        let len = u64::from(ev.len);
        // A payload longer than the syscall moved cannot be trusted past
        // `len`; clamp rather than fail.
        let known_len = usize::try_from(len)
            .unwrap_or(usize::MAX)
            .min(ev.payload.len());
        let known = &ev.payload[..known_len];
        let ts = match ev.direction {
            Direction::Ingress => ev.ts_exit,
            Direction::Egress => ev.ts_enter,
        };
        Io {
            ts,
            ingress: ev.ingress,
            marks: &ev.marks,
            base: 0,
            known,
            unknown: len - known.len() as u64,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.known.is_empty() && self.unknown == 0
    }

    /// The last `rest` bytes of this syscall (what follows a protocol
    /// switch inside it).
    pub(crate) fn tail(&self, rest: u64) -> Io<'a> {
        let total = self.known.len() as u64 + self.unknown;
        let skip = total.saturating_sub(rest);
        let skip_known = usize::try_from(skip)
            .unwrap_or(usize::MAX)
            .min(self.known.len());
        Io {
            known: &self.known[skip_known..],
            unknown: self.unknown.min(rest),
            base: self.base + skip,
            ..*self
        }
    }

    /// When the byte at `at` (from this view's start) reached the host:
    /// the mark covering it; without marks, the read's oldest byte's
    /// arrival for the syscall's first byte only.
    pub(crate) fn arrival_at(&self, at: u64) -> Option<MonoNs> {
        let offset = self.base + at;
        if self.marks.is_empty() {
            return self.ingress.filter(|_| offset == 0);
        }
        DataEvent::arrival_at(self.marks, offset)
    }

    /// The arrival of a request that starts at `at`: as `arrival_at`, but a
    /// read without marks dates every request in it by its oldest byte
    /// (HTTP/1.1's behaviour before marks existed).
    pub(crate) fn request_arrival(&self, at: u64) -> Option<MonoNs> {
        if self.marks.is_empty() {
            return self.ingress;
        }
        self.arrival_at(at)
    }

    /// The syscall cut where its bytes' arrival changes, each piece dated
    /// by when its bytes reached the host: how a client's read of several
    /// response chunks yields each chunk's own arrival. Bytes no mark
    /// covers are dated by the read's exit (the latest they can have
    /// arrived); a read without marks, by its oldest byte's arrival when
    /// known.
    pub(crate) fn by_arrival(&self) -> Vec<Io<'a>> {
        let piece = |from: u64, to: u64, ts: MonoNs| {
            let known_len = self.known.len() as u64;
            let k = |at: u64| usize::try_from(at.min(known_len)).unwrap_or(usize::MAX);
            Io {
                ts: ts.min(self.ts),
                ingress: None,
                marks: &[],
                base: 0,
                known: &self.known[k(from)..k(to)],
                unknown: to.max(known_len) - from.max(known_len),
            }
        };
        let total = self.known.len() as u64 + self.unknown;
        if self.marks.is_empty() {
            return vec![piece(0, total, self.ingress.unwrap_or(self.ts))];
        }
        let mut out = Vec::new();
        let mut at = 0;
        while at < total {
            let offset = self.base + at;
            let covering = self.marks.iter().find(|m| {
                let start = u64::from(m.offset);
                (start..start + u64::from(m.len)).contains(&offset)
            });
            let (to, ts) = match covering {
                Some(m) => (u64::from(m.offset) + u64::from(m.len) - self.base, m.ts),
                None => {
                    let next = self
                        .marks
                        .iter()
                        .map(|m| u64::from(m.offset))
                        .filter(|&start| start > offset)
                        .min()
                        .map_or(total, |start| start - self.base);
                    (next, self.ts)
                }
            };
            let to = to.min(total).max(at + 1);
            out.push(piece(at, to, ts));
            at = to;
        }
        out
    }

    pub(crate) fn is_truncated(&self) -> bool {
        self.unknown > 0
    }

    /// The syscall's bytes in order: the captured prefix, then the unknown
    /// tail.
    pub(crate) fn pieces(&self) -> [Bytes<'a>; 2] {
        [Bytes::Known(self.known), Bytes::Unknown(self.unknown)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn take_splits_known_and_unknown() {
        let mut b = Bytes::Known(b"hello");
        assert_eq!(b.take(2), Bytes::Known(b"he"));
        assert_eq!(b.take(10), Bytes::Known(b"llo"));
        assert!(b.is_empty());

        let mut u = Bytes::Unknown(7);
        assert_eq!(u.take(3), Bytes::Unknown(3));
        assert_eq!(u.len(), 4);
        assert_eq!(u.take(u64::MAX), Bytes::Unknown(4));
        assert!(u.is_empty());
    }

    fn read(payload: &[u8], len: u32, marks: Vec<IngressMark>) -> DataEvent {
        DataEvent {
            direction: Direction::Ingress,
            ts_enter: 50,
            ts_exit: 100,
            ingress: marks.first().map(|m| m.ts),
            marks,
            len,
            payload: bytes::Bytes::copy_from_slice(payload),
            conn: crate::event::ConnId::default(),
            tid: 1,
            comm: "".into(),
            call: crate::event::IoCall::Read,
            addrs: None,
            tcp: None,
        }
    }

    #[test]
    fn by_arrival_dates_each_segment_and_the_uncovered_rest_by_the_read() {
        let mark = |offset, len, ts| IngressMark { offset, len, ts };
        // two segments, then 4 bytes no mark covers, 2 of them uncaptured
        let ev = read(b"aaabbbbcc", 11, vec![mark(0, 3, 10), mark(3, 4, 20)]);
        let io = Io::of(&ev);
        let got: Vec<(MonoNs, &[u8], u64)> = io
            .by_arrival()
            .iter()
            .map(|p| (p.ts, p.known, p.unknown))
            .collect();
        assert_eq!(
            got,
            vec![
                (10, &b"aaa"[..], 0),
                (20, &b"bbbb"[..], 0),
                (100, &b"cc"[..], 2)
            ]
        );
        // no marks: one piece, dated by the oldest byte when known
        let mut ev = read(b"abc", 3, Vec::new());
        ev.ingress = Some(7);
        let pieces = Io::of(&ev).by_arrival();
        assert_eq!(pieces.len(), 1);
        assert_eq!((pieces[0].ts, pieces[0].known), (7, &b"abc"[..]));
        // a mark later than the read's exit cannot be: clamped
        let ev = read(b"ab", 2, vec![mark(0, 2, 500)]);
        assert_eq!(Io::of(&ev).by_arrival()[0].ts, 100);
    }
}
