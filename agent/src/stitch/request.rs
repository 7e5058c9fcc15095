//! The ingress half of a server connection: request heads and bodies.
//!
//! Each request joins the connection's [`Exchanges`] as soon as its head is
//! complete; the body is then consumed by count (Content-Length or chunk
//! sizes), so uncaptured body bytes (long prompts beyond the capture cap)
//! cost nothing but the loss of what they said.

use crate::event::ConnId;

use super::chunked::{ChunkedDecoder, Piece};
use super::error::{Side, StitchError};
use std::sync::Arc;

use super::exchange::{Exchanges, RequestStart};
use super::http::{self, RequestBody};
use super::input::{Bytes, Io};
use super::json_fields::BodyPrefix;

#[derive(Debug, Clone)]
enum State {
    /// Collecting a head; `start` is the read of its first byte.
    Head {
        buf: Vec<u8>,
        start: Option<RequestStart>,
    },
    /// Consuming the body of request `seq`.
    Body {
        seq: u64,
        framing: Framing,
        prefix: BodyPrefix,
    },
    /// After garbage: reads are dropped until one begins with a request
    /// line. A read boundary is the only place a new request can be found
    /// with confidence once framing is lost.
    Resync,
}

#[derive(Debug, Clone)]
enum Framing {
    Fixed { remaining: u64 },
    Chunked(ChunkedDecoder),
}

/// Most requests queued on one connection without a complete response.
/// Real clients pipeline a handful at most; the bound keeps a flood of
/// tiny requests in one read from growing the queue without limit.
pub(crate) const MAX_IN_FLIGHT: usize = 256;

const NEW_HEAD: State = State::Head {
    buf: Vec::new(),
    start: None,
};

#[derive(Debug, Clone)]
pub(crate) struct RequestReader {
    state: State,
    /// Most bytes buffered for a head, and kept of a body prefix.
    cap: usize,
    /// Lower-case names of the request-id headers to keep.
    id_headers: Arc<[String]>,
}

impl RequestReader {
    pub(crate) fn new(cap: usize, id_headers: Arc<[String]>) -> Self {
        Self {
            state: NEW_HEAD,
            cap,
            id_headers,
        }
    }

    /// Feeds one read. On error the rest of the read and any partial head
    /// are dropped and the reader resynchronises; requests already queued
    /// stay, since their responses can still be parsed.
    pub(crate) fn on_read(
        &mut self,
        io: &Io<'_>,
        conn: ConnId,
        exchanges: &mut Exchanges,
    ) -> Result<(), StitchError> {
        if matches!(self.state, State::Resync) {
            if !http::begins_with_request_line(io.known) {
                return Ok(());
            }
            self.state = NEW_HEAD;
        }
        let total = io.known.len() as u64 + io.unknown;
        let mut after = io.unknown;
        for mut piece in io.pieces() {
            while !piece.is_empty() {
                // Where in the read this step starts: a request that
                // starts mid-read (pipelined) is dated by its own segment.
                let at = total - piece.len() - after;
                let start = RequestStart {
                    read: io.ts,
                    ingress: io.request_arrival(at),
                };
                if let Err(e) = self.step(&mut piece, start, conn, exchanges) {
                    self.state = State::Resync;
                    return Err(e);
                }
            }
            after = 0;
        }
        Ok(())
    }

    /// Consumes some of `piece` (at least one byte, or all of it).
    fn step(
        &mut self,
        piece: &mut Bytes<'_>,
        read: RequestStart,
        conn: ConnId,
        exchanges: &mut Exchanges,
    ) -> Result<(), StitchError> {
        let ts = read.read;
        match &mut self.state {
            State::Head { buf, start } => {
                let Bytes::Known(bytes) = piece else {
                    return Err(StitchError::HeadNotCaptured {
                        conn,
                        side: Side::Request,
                    });
                };
                if buf.is_empty() {
                    http::skip_blank_lines(bytes);
                    if bytes.is_empty() {
                        return Ok(());
                    }
                }
                let start = *start.get_or_insert(read);
                let names = &self.id_headers;
                let head =
                    http::collect_head(buf, bytes, self.cap, |b| http::parse_request(b, names))
                        .map_err(|e| StitchError::head(conn, Side::Request, self.cap, e))?;
                let Some(head) = head else {
                    return Ok(());
                };
                if exchanges.len() >= MAX_IN_FLIGHT {
                    return Err(StitchError::TooManyInFlight {
                        conn,
                        limit: MAX_IN_FLIGHT,
                    });
                }
                let body = head.body;
                let seq = exchanges.open(conn, head, start, ts);
                self.state = match body {
                    RequestBody::None => NEW_HEAD,
                    RequestBody::Fixed(remaining) => State::Body {
                        seq,
                        framing: Framing::Fixed { remaining },
                        prefix: BodyPrefix::new(self.cap),
                    },
                    RequestBody::Chunked => State::Body {
                        seq,
                        framing: Framing::Chunked(ChunkedDecoder::default()),
                        prefix: BodyPrefix::new(self.cap),
                    },
                };
            }
            State::Body {
                seq,
                framing,
                prefix,
            } => {
                let before = piece.len();
                let done = match framing {
                    Framing::Fixed { remaining } => {
                        let part = piece.take(*remaining);
                        *remaining -= part.len();
                        prefix.push(part);
                        *remaining == 0
                    }
                    Framing::Chunked(decoder) => loop {
                        let next =
                            decoder
                                .next(piece)
                                .map_err(|source| StitchError::MalformedChunk {
                                    conn,
                                    side: Side::Request,
                                    source,
                                })?;
                        match next {
                            Some(Piece::Data(data)) => prefix.push(data),
                            Some(Piece::ChunkEnd) => {}
                            Some(Piece::Done) => break true,
                            None => break false,
                        }
                    },
                };
                if let Some(ex) = exchanges.get_mut(*seq) {
                    let tl = &mut ex.timeline;
                    tl.request_bytes += before - piece.len();
                    tl.request_end = ts;
                    if done {
                        tl.model = prefix.fields().model;
                    }
                }
                if done {
                    self.state = NEW_HEAD;
                }
            }
            State::Resync => *piece = Bytes::Known(&[]),
        }
        Ok(())
    }
}
