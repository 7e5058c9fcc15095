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
}
