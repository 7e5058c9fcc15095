//! gRPC length-prefixed messages (the gRPC over HTTP/2 protocol): a 1-byte
//! compressed flag and a 4-byte big-endian length, then the message.
//!
//! What a client receives as a streamed token is a message, so the walker
//! reports each message completion, wherever DATA frames and writes cut the
//! stream: grpc-core puts several messages in one frame, grpc-go gives each
//! message frames of its own. Message bodies are skipped by count, so an
//! uncaptured body costs nothing; an uncaptured prefix loses the message
//! boundaries, and the walker then waits for a DATA frame whose first bytes
//! read as a prefix (most implementations start a frame with a message)
//! and says the count is no longer exact.

use super::super::input::Bytes;

const PREFIX_LEN: usize = 5;

/// Largest message length believed when re-finding boundaries (gRPC's
/// default receive limit is 4 MiB).
const MAX_RESYNC_MESSAGE: u32 = 4 << 20;

/// Whether a DATA frame of `frame_len` bytes that begins with `first` is
/// exactly one gRPC message (what a gRPC client sends as a request): how a
/// call is recognised when HPACK could not say its content-type (tracing
/// started mid-connection).
pub(crate) fn is_one_message(first: &[u8], frame_len: u32) -> bool {
    let Some(prefix) = first.get(..PREFIX_LEN) else {
        return false;
    };
    let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]);
    prefix[0] <= 1 && u64::from(len) + PREFIX_LEN as u64 == u64::from(frame_len)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Prefix { buf: [u8; PREFIX_LEN], have: usize },
    Body { remaining: u64 },
    Lost,
}

const NEW_PREFIX: State = State::Prefix {
    buf: [0; PREFIX_LEN],
    have: 0,
};

#[derive(Debug, Clone)]
pub(crate) struct MessageWalker {
    state: State,
    /// Boundaries were lost at least once: counts are a lower bound.
    pub inexact: bool,
}

impl Default for MessageWalker {
    fn default() -> Self {
        Self {
            state: NEW_PREFIX,
            inexact: false,
        }
    }
}

impl MessageWalker {
    /// A DATA frame of the stream begins with `first` (its captured start)
    /// and carries `len` bytes: where boundaries are lost, a frame that
    /// begins with a believable prefix re-finds them.
    pub(crate) fn frame_start(&mut self, first: &[u8], len: u32) {
        if self.state != State::Lost || first.len() < PREFIX_LEN {
            return;
        }
        let msg_len = u32::from_be_bytes([first[1], first[2], first[3], first[4]]);
        if first[0] <= 1 && msg_len <= MAX_RESYNC_MESSAGE && len >= PREFIX_LEN as u32 {
            self.state = NEW_PREFIX;
        }
    }

    /// Message bytes (DATA payload, in order); returns how many messages
    /// they completed.
    pub(crate) fn feed(&mut self, mut input: Bytes<'_>) -> u32 {
        let mut done = 0;
        while !input.is_empty() {
            match &mut self.state {
                State::Lost => {
                    input.take(u64::MAX);
                }
                State::Prefix { buf, have } => {
                    let Bytes::Known(bytes) = input else {
                        self.state = State::Lost;
                        self.inexact = true;
                        continue;
                    };
                    let n = (PREFIX_LEN - *have).min(bytes.len());
                    buf[*have..*have + n].copy_from_slice(&bytes[..n]);
                    *have += n;
                    input.take(n as u64);
                    if *have == PREFIX_LEN {
                        let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]);
                        if len == 0 {
                            done += 1;
                            self.state = NEW_PREFIX;
                        } else {
                            self.state = State::Body {
                                remaining: u64::from(len),
                            };
                        }
                    }
                }
                State::Body { remaining } => {
                    let part = input.take(*remaining);
                    *remaining -= part.len();
                    if *remaining == 0 {
                        done += 1;
                        self.state = NEW_PREFIX;
                    }
                }
            }
        }
        done
    }

    /// Message boundaries were lost (the bytes of this stream in a run the
    /// capture did not keep).
    pub(crate) fn lose(&mut self) {
        self.state = State::Lost;
        self.inexact = true;
    }

    /// A message was begun but not finished.
    #[cfg(test)]
    pub(crate) fn mid_message(&self) -> bool {
        match self.state {
            State::Prefix { have, .. } => have > 0,
            State::Body { .. } => true,
            State::Lost => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fuzz::seeds::grpc_message as message;

    #[test]
    fn counts_messages_however_the_bytes_are_cut() {
        let mut stream = message(b"token one");
        stream.extend(message(b""));
        stream.extend(message(b"three"));
        for cut in 0..stream.len() {
            let mut w = MessageWalker::default();
            let (a, b) = stream.split_at(cut);
            let n = w.feed(Bytes::Known(a)) + w.feed(Bytes::Known(b));
            assert_eq!(n, 3, "cut at {cut}");
            assert!(!w.inexact && !w.mid_message());
        }
    }

    #[test]
    fn an_uncaptured_body_is_skipped_exactly() {
        let stream = message(&[7; 100]);
        let mut w = MessageWalker::default();
        assert_eq!(w.feed(Bytes::Known(&stream[..20])), 0);
        assert_eq!(w.feed(Bytes::Unknown(85)), 1);
        assert!(!w.inexact);
        assert_eq!(w.feed(Bytes::Known(&message(b"x"))), 1);
    }

    #[test]
    fn an_uncaptured_prefix_makes_the_count_inexact_until_a_frame_starts_a_message() {
        let mut w = MessageWalker::default();
        assert_eq!(w.feed(Bytes::Unknown(50)), 0);
        assert!(w.inexact);
        // Not a prefix: the compressed flag is 7.
        w.frame_start(&[7, 0, 0, 0, 1, 0], 6);
        assert_eq!(w.feed(Bytes::Known(&[7, 0, 0, 0, 1, 0])), 0);
        let m = message(b"ok");
        w.frame_start(&m, m.len() as u32);
        assert_eq!(w.feed(Bytes::Known(&m)), 1);
        assert!(w.inexact, "stays a lower bound once lost");
    }
}
