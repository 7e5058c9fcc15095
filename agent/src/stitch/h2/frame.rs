//! HTTP/2 framing (RFC 9113 §4): a gap-aware frame reader per direction,
//! and the frame-chain test that recognises HTTP/2 on a connection that was
//! already open when tracing began.
//!
//! Every frame starts with a 9-byte header that says how long it is, so a
//! frame's payload can be skipped exactly even when the capture cap left it
//! uncaptured ([`Bytes::Unknown`]). Framing is lost only when uncaptured
//! bytes cover a frame header; the reader then says so once and waits for
//! the connection to find a syscall that begins with a plausible chain of
//! frames (implementations write whole frames, so a write boundary is where
//! a frame boundary can be found again with confidence).

use thiserror::Error;

use super::super::input::Bytes;

/// What an HTTP/2 client sends first (RFC 9113 §3.4).
pub(crate) const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

pub(crate) const HEADER_LEN: usize = 9;

/// SETTINGS_MAX_FRAME_SIZE until a peer says otherwise.
pub(crate) const DEFAULT_MAX_FRAME: u32 = 16_384;

pub(crate) mod flags {
    pub(crate) const END_STREAM: u8 = 0x1;
    pub(crate) const ACK: u8 = 0x1;
    pub(crate) const END_HEADERS: u8 = 0x4;
    pub(crate) const PADDED: u8 = 0x8;
    pub(crate) const PRIORITY: u8 = 0x20;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Data,
    Headers,
    Priority,
    RstStream,
    Settings,
    PushPromise,
    Ping,
    GoAway,
    WindowUpdate,
    Continuation,
    /// Extension frames must be ignored (RFC 9113 §4.1).
    Other(u8),
}

impl Kind {
    fn of(byte: u8) -> Self {
        match byte {
            0 => Kind::Data,
            1 => Kind::Headers,
            2 => Kind::Priority,
            3 => Kind::RstStream,
            4 => Kind::Settings,
            5 => Kind::PushPromise,
            6 => Kind::Ping,
            7 => Kind::GoAway,
            8 => Kind::WindowUpdate,
            9 => Kind::Continuation,
            other => Kind::Other(other),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FrameHeader {
    pub len: u32,
    pub kind: Kind,
    pub flags: u8,
    pub stream: u32,
    /// The reserved bit of the stream id was set (never by a real peer).
    reserved: bool,
}

impl FrameHeader {
    pub(crate) fn parse(b: &[u8; HEADER_LEN]) -> Self {
        let len = u32::from_be_bytes([0, b[0], b[1], b[2]]);
        let raw = u32::from_be_bytes([b[5], b[6], b[7], b[8]]);
        Self {
            len,
            kind: Kind::of(b[3]),
            flags: b[4],
            stream: raw & 0x7fff_ffff,
            reserved: raw & 0x8000_0000 != 0,
        }
    }

    pub(crate) fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }

    /// Whether the frame's payload starts with a pad length byte.
    fn padded(&self) -> bool {
        matches!(self.kind, Kind::Data | Kind::Headers | Kind::PushPromise)
            && self.has(flags::PADDED)
    }

    /// What the RFC requires of this frame type's stream, length and flags,
    /// checked strictly (no unknown flags, no extension types): a header
    /// that passes is very unlikely to be anything but a real frame. Used
    /// only to recognise HTTP/2 without its preface.
    fn strictly_valid(&self, max_len: u32) -> bool {
        use flags::*;
        let on_stream = self.stream != 0;
        let only = |allowed: u8| self.flags & !allowed == 0;
        !self.reserved
            && self.len <= max_len
            && match self.kind {
                Kind::Data => on_stream && only(END_STREAM | PADDED),
                Kind::Headers => on_stream && only(END_STREAM | END_HEADERS | PADDED | PRIORITY),
                Kind::Priority => on_stream && self.len == 5 && only(0),
                Kind::RstStream => on_stream && self.len == 4 && only(0),
                Kind::Settings => {
                    !on_stream
                        && self.len.is_multiple_of(6)
                        && only(ACK)
                        && (!self.has(ACK) || self.len == 0)
                }
                Kind::PushPromise => on_stream && only(END_HEADERS | PADDED),
                Kind::Ping => !on_stream && self.len == 8 && only(ACK),
                Kind::GoAway => !on_stream && self.len >= 8 && only(0),
                Kind::WindowUpdate => self.len == 4 && only(0),
                Kind::Continuation => on_stream && only(END_HEADERS),
                Kind::Other(_) => false,
            }
    }

    /// What a frame must satisfy to be parsed at all once the connection is
    /// known to be HTTP/2: anything else means the bytes are not frames.
    fn well_formed(&self, max_len: u32) -> Result<(), FrameError> {
        if self.len > max_len {
            return Err(FrameError::TooLong {
                len: self.len,
                max: max_len,
            });
        }
        let needs_stream = matches!(
            self.kind,
            Kind::Data
                | Kind::Headers
                | Kind::Priority
                | Kind::RstStream
                | Kind::PushPromise
                | Kind::Continuation
        );
        let needs_zero = matches!(self.kind, Kind::Settings | Kind::Ping | Kind::GoAway);
        if (needs_stream && self.stream == 0) || (needs_zero && self.stream != 0) {
            return Err(FrameError::WrongStream {
                kind: self.kind,
                stream: self.stream,
            });
        }
        Ok(())
    }
}

/// Bytes that cannot be HTTP/2 frames where frames were expected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum FrameError {
    #[error("the client preface does not match")]
    BadPreface,
    #[error("frame of {len} bytes exceeds the peer's {max}-byte frame size limit")]
    TooLong { len: u32, max: u32 },
    #[error("{kind:?} frame on stream {stream}")]
    WrongStream { kind: Kind, stream: u32 },
}

/// What the reader found next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FrameEvent<'a> {
    /// A frame begins; its payload (padding removed) follows.
    Start(FrameHeader),
    /// Payload bytes of the current frame, without padding.
    Payload(Bytes<'a>),
    /// The pad length byte of the current frame was not captured: what
    /// follows as payload may include up to 255 bytes of padding.
    PaddingUnknown,
    /// The current frame is complete.
    End(FrameHeader),
    /// Uncaptured bytes covered a frame header: frames are lost until
    /// [`FrameReader::resync`] finds them again.
    Lost,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Matching the client preface; `matched` bytes so far.
    Preface {
        matched: usize,
    },
    Header {
        buf: [u8; HEADER_LEN],
        have: usize,
    },
    /// The next byte is the pad length of `frame`.
    PadLength {
        frame: FrameHeader,
    },
    /// `content` payload bytes, then `pad` padding bytes, are left.
    Payload {
        frame: FrameHeader,
        content: u32,
        pad: u32,
    },
    Lost,
}

const NEW_HEADER: State = State::Header {
    buf: [0; HEADER_LEN],
    have: 0,
};

#[derive(Debug, Clone)]
pub(crate) struct FrameReader {
    state: State,
    /// The largest frame the receiving peer accepts (its
    /// SETTINGS_MAX_FRAME_SIZE).
    pub max_frame: u32,
}

impl FrameReader {
    /// The client side of a connection that starts with the preface.
    pub(crate) fn expecting_preface() -> Self {
        Self {
            state: State::Preface { matched: 0 },
            max_frame: DEFAULT_MAX_FRAME,
        }
    }

    /// A direction whose next byte is a frame header.
    pub(crate) fn at_frame_boundary() -> Self {
        Self {
            state: NEW_HEADER,
            max_frame: DEFAULT_MAX_FRAME,
        }
    }

    pub(crate) fn is_lost(&self) -> bool {
        self.state == State::Lost
    }

    /// Called with the captured start of each syscall while framing is
    /// lost: resumes when it begins with a plausible chain of frames.
    pub(crate) fn resync(&mut self, known: &[u8], truncated: bool) -> bool {
        if self.state == State::Lost && looks_like_frames(known, truncated, self.max_frame) {
            self.state = NEW_HEADER;
        }
        self.state != State::Lost
    }

    /// Consumes the front of `input` up to the next event; `Ok(None)` once
    /// `input` is used up. After an error the reader is lost (the rest of
    /// the input is consumed).
    pub(crate) fn next<'a>(
        &mut self,
        input: &mut Bytes<'a>,
    ) -> Result<Option<FrameEvent<'a>>, FrameError> {
        loop {
            if let State::Payload {
                frame,
                content: 0,
                pad: 0,
            } = self.state
            {
                self.state = NEW_HEADER;
                return Ok(Some(FrameEvent::End(frame)));
            }
            if input.is_empty() {
                return Ok(None);
            }
            match &mut self.state {
                State::Lost => {
                    input.take(u64::MAX);
                    return Ok(None);
                }
                State::Preface { matched } => {
                    let Bytes::Known(bytes) = input else {
                        self.state = State::Lost;
                        return Ok(Some(FrameEvent::Lost));
                    };
                    let want = &PREFACE[*matched..];
                    let n = want.len().min(bytes.len());
                    if bytes[..n] != want[..n] {
                        self.state = State::Lost;
                        input.take(u64::MAX);
                        return Err(FrameError::BadPreface);
                    }
                    input.take(n as u64);
                    *matched += n;
                    if *matched == PREFACE.len() {
                        self.state = NEW_HEADER;
                    }
                }
                State::Header { have: 0, .. } if matches!(input, Bytes::Known(b) if b.starts_with(&PREFACE[..4])) =>
                {
                    // A connection taken for one already under way whose
                    // client preface comes now (a TLS connection the agent
                    // first saw through the server's SETTINGS): `PRI ` can
                    // be no frame header (a 5 MB frame of type 0x20).
                    self.state = State::Preface { matched: 0 };
                }
                State::Header { buf, have } => {
                    let Bytes::Known(bytes) = input else {
                        self.state = State::Lost;
                        input.take(u64::MAX);
                        return Ok(Some(FrameEvent::Lost));
                    };
                    let n = (HEADER_LEN - *have).min(bytes.len());
                    buf[*have..*have + n].copy_from_slice(&bytes[..n]);
                    *have += n;
                    input.take(n as u64);
                    if *have < HEADER_LEN {
                        continue;
                    }
                    let frame = FrameHeader::parse(buf);
                    if let Err(e) = frame.well_formed(self.max_frame) {
                        self.state = State::Lost;
                        input.take(u64::MAX);
                        return Err(e);
                    }
                    self.state = if frame.padded() && frame.len > 0 {
                        State::PadLength { frame }
                    } else {
                        State::Payload {
                            frame,
                            content: frame.len,
                            pad: 0,
                        }
                    };
                    return Ok(Some(FrameEvent::Start(frame)));
                }
                State::PadLength { frame } => {
                    let frame = *frame;
                    let rest = frame.len - 1;
                    match input.take(1) {
                        Bytes::Known(b) => {
                            let pad = u32::from(b[0]).min(rest);
                            self.state = State::Payload {
                                frame,
                                content: rest - pad,
                                pad,
                            };
                        }
                        Bytes::Unknown(_) => {
                            self.state = State::Payload {
                                frame,
                                content: rest,
                                pad: 0,
                            };
                            return Ok(Some(FrameEvent::PaddingUnknown));
                        }
                    }
                }
                State::Payload { content, pad, .. } => {
                    if *content > 0 {
                        let part = input.take(u64::from(*content));
                        *content -= part.len() as u32;
                        return Ok(Some(FrameEvent::Payload(part)));
                    }
                    let skipped = input.take(u64::from(*pad));
                    *pad -= skipped.len() as u32;
                }
            }
        }
    }
}

/// True when `bytes` (the captured start of a syscall) is a chain of
/// strictly valid frame headers that ends exactly at its end (or, when the
/// syscall was longer than the capture, runs past it). At least one whole
/// header is required. HTTP/1.1 text never passes: `GET ` reads as a frame
/// of 4.6 MB of type 0x20.
pub(crate) fn looks_like_frames(bytes: &[u8], truncated: bool, max_len: u32) -> bool {
    let mut at = 0usize;
    let mut frames = 0;
    while at < bytes.len() {
        let Some(head) = bytes.get(at..at + HEADER_LEN) else {
            return truncated && frames > 0;
        };
        let mut buf = [0u8; HEADER_LEN];
        buf.copy_from_slice(head);
        let frame = FrameHeader::parse(&buf);
        if !frame.strictly_valid(max_len) {
            return false;
        }
        frames += 1;
        at += HEADER_LEN + frame.len as usize;
    }
    frames > 0 && (at == bytes.len() || truncated)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fuzz::seeds::h2_frame as frame;

    fn events(reader: &mut FrameReader, pieces: &[Bytes<'_>]) -> Vec<String> {
        let mut out = Vec::new();
        for piece in pieces {
            let mut piece = *piece;
            loop {
                match reader.next(&mut piece) {
                    Ok(Some(FrameEvent::Start(f))) => {
                        out.push(format!("start {:?} {} {}", f.kind, f.stream, f.len))
                    }
                    Ok(Some(FrameEvent::Payload(Bytes::Known(b)))) => {
                        out.push(format!("data {:?}", String::from_utf8_lossy(b)))
                    }
                    Ok(Some(FrameEvent::Payload(Bytes::Unknown(n)))) => {
                        out.push(format!("unknown {n}"))
                    }
                    Ok(Some(FrameEvent::End(f))) => out.push(format!("end {}", f.stream)),
                    Ok(Some(FrameEvent::PaddingUnknown)) => out.push("pad?".into()),
                    Ok(Some(FrameEvent::Lost)) => out.push("lost".into()),
                    Ok(None) => break,
                    Err(e) => {
                        out.push(format!("error {e}"));
                        break;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn reads_the_preface_and_frames_split_anywhere() {
        let mut wire = PREFACE.to_vec();
        wire.extend(frame(4, 0, 0, &[]));
        wire.extend(frame(1, 0x5, 1, b"hdrs"));
        wire.extend(frame(0, 0x1, 1, b"hello"));
        for split in 0..wire.len() {
            let mut r = FrameReader::expecting_preface();
            let (a, b) = wire.split_at(split);
            let got = events(&mut r, &[Bytes::Known(a), Bytes::Known(b)]);
            let joined: Vec<String> = got.into_iter().filter(|e| !e.starts_with("data")).collect();
            assert_eq!(
                joined,
                [
                    "start Settings 0 0",
                    "end 0",
                    "start Headers 1 4",
                    "end 1",
                    "start Data 1 5",
                    "end 1"
                ],
                "split at {split}"
            );
        }
    }

    #[test]
    fn padding_is_removed_and_an_uncaptured_payload_is_skipped_exactly() {
        let mut padded = vec![3u8];
        padded.extend_from_slice(b"abc");
        padded.extend_from_slice(&[0, 0, 0]);
        let mut wire = frame(0, flags::PADDED, 3, &padded);
        wire.extend(frame(0, 0, 3, b"0123456789"));
        wire.extend(frame(8, 0, 0, &[0, 0, 1, 0]));
        let mut r = FrameReader::at_frame_boundary();
        // Capture cut after 4 bytes of the second frame's payload.
        let cut = 9 + 7 + 9 + 4;
        let got = events(
            &mut r,
            &[
                Bytes::Known(&wire[..cut]),
                Bytes::Unknown(6),
                Bytes::Known(&wire[cut + 6..]),
            ],
        );
        assert_eq!(
            got,
            [
                "start Data 3 7",
                "data \"abc\"",
                "end 3",
                "start Data 3 10",
                "data \"0123\"",
                "unknown 6",
                "end 3",
                "start WindowUpdate 0 4",
                "data \"\\0\\0\\u{1}\\0\"",
                "end 0"
            ]
        );
    }

    #[test]
    fn an_uncaptured_header_loses_framing_until_a_chain_of_frames_begins_a_syscall() {
        let mut r = FrameReader::at_frame_boundary();
        let got = events(&mut r, &[Bytes::Unknown(100)]);
        assert_eq!(got, ["lost"]);
        assert!(r.is_lost());
        // Mid-frame bytes do not resync; whole frames do.
        assert!(!r.resync(b"\x00\x01\x02garbage", false));
        let wire = frame(0, 1, 5, b"x");
        assert!(r.resync(&wire, false));
        assert_eq!(
            events(&mut r, &[Bytes::Known(&wire)]),
            ["start Data 5 1", "data \"x\"", "end 5"]
        );
    }

    #[test]
    fn oversized_or_misplaced_frames_are_errors() {
        let mut r = FrameReader::at_frame_boundary();
        let big = frame(0, 0, 1, &vec![0; 20_000]);
        assert_eq!(
            events(&mut r, &[Bytes::Known(&big)]),
            ["error frame of 20000 bytes exceeds the peer's 16384-byte frame size limit"]
        );
        let mut r = FrameReader::at_frame_boundary();
        assert_eq!(
            events(&mut r, &[Bytes::Known(&frame(0, 0, 0, b"x"))]),
            ["error Data frame on stream 0"]
        );
        let mut r = FrameReader::expecting_preface();
        assert_eq!(
            events(&mut r, &[Bytes::Known(b"GET / HTTP/1.1\r\n")]),
            ["error the client preface does not match"]
        );
    }

    #[test]
    fn the_frame_chain_test_accepts_frames_and_rejects_http1_and_tls() {
        let mut chain = frame(4, 0, 0, &[0, 3, 0, 0, 0, 100]);
        chain.extend(frame(8, 0, 0, &[0, 1, 0, 0]));
        chain.extend(frame(1, 0x4, 1, b"\x82\x86\x84"));
        assert!(looks_like_frames(&chain, false, DEFAULT_MAX_FRAME));
        assert!(!looks_like_frames(
            &chain[..chain.len() - 1],
            false,
            DEFAULT_MAX_FRAME
        ));
        assert!(looks_like_frames(
            &chain[..chain.len() - 1],
            true,
            DEFAULT_MAX_FRAME
        ));
        assert!(!looks_like_frames(
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
            false,
            DEFAULT_MAX_FRAME
        ));
        assert!(!looks_like_frames(
            b"HTTP/1.1 200 OK\r\n\r\n",
            true,
            DEFAULT_MAX_FRAME
        ));
        assert!(!looks_like_frames(
            &[0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0, 0, 0],
            true,
            DEFAULT_MAX_FRAME
        ));
        assert!(!looks_like_frames(b"", true, DEFAULT_MAX_FRAME));
        // A PING on a stream is not a real frame.
        assert!(!looks_like_frames(
            &frame(6, 0, 1, &[0; 8]),
            false,
            DEFAULT_MAX_FRAME
        ));
    }
}
