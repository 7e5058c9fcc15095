//! The egress half of a server connection: response heads and bodies, and
//! the emit times that make up a timeline.
//!
//! Responses answer the queued requests in order, so everything here works
//! on the front of [`Exchanges`]. A write's captured bytes are parsed and
//! its uncaptured tail consumed by count; see [`super::chunked`] and
//! [`super::sse`] for what is assumed when framing falls in that tail.

use crate::event::{ConnId, MonoNs};

use super::chunked::{ChunkedDecoder, ChunkedError, Piece};
use super::error::{Side, StitchError};
use super::exchange::{Exchange, Exchanges};
use super::http::{self, ResponseBody};
use super::input::{Bytes, Io};
use super::json_fields::{self, BodyPrefix};
use super::sse::SseScanner;
use super::timeline::{AbortReason, BodyKind, RequestTimeline};

/// What a write did to the connection as a whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WriteOutcome {
    Http,
    /// `101 Switching Protocols`: what follows is not HTTP/1.1.
    Upgraded,
    /// `101` with `Upgrade: h2c`: HTTP/2 follows, starting `rest` bytes
    /// before the end of this write. The upgrading request, still at the
    /// front of the queue, is its stream 1.
    UpgradedH2c {
        rest: u64,
    },
}

#[derive(Debug, Clone)]
enum State {
    /// Collecting a head; `start` is the entry of the write that began it.
    Head {
        buf: Vec<u8>,
        start: Option<MonoNs>,
    },
    Body(Body),
    /// After garbage, or a response nobody asked for: writes are dropped
    /// until one begins with a status line while a request is waiting.
    Resync,
}

const NEW_HEAD: State = State::Head {
    buf: Vec::new(),
    start: None,
};

#[derive(Debug, Clone)]
struct Body {
    framing: Framing,
    content: Content,
}

#[derive(Debug, Clone)]
enum Framing {
    Fixed { remaining: u64 },
    Chunked(ChunkedDecoder),
    UntilClose,
}

/// Turns body bytes into emit times and response fields (HTTP/2 streams
/// use it too, for SSE and plain bodies).
#[derive(Debug, Clone)]
pub(crate) struct Content {
    kind: BodyKind,
    /// SSE bodies: events are the chunks and carry the JSON.
    sse: Option<SseScanner>,
    /// Other bodies: the captured prefix, for the JSON fields.
    prefix: Option<BodyPrefix>,
    /// UntilClose: this write already produced its chunk.
    write_counted: bool,
}

#[derive(Debug, Clone)]
pub(crate) struct ResponseReader {
    state: State,
    /// Most bytes buffered for a head, kept of a body prefix or of one SSE
    /// line or event.
    cap: usize,
}

impl ResponseReader {
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            state: NEW_HEAD,
            cap,
        }
    }

    /// Feeds one write. Finished exchanges go to `finished`. On error the
    /// rest of the write is dropped, the response being parsed (if any) is
    /// reported aborted with a parse error (it can no longer be parsed) and
    /// the reader resynchronises.
    pub(crate) fn on_write(
        &mut self,
        io: &Io<'_>,
        conn: ConnId,
        exchanges: &mut Exchanges,
        finished: &mut Vec<RequestTimeline>,
    ) -> Result<WriteOutcome, StitchError> {
        match &mut self.state {
            State::Resync => {
                if exchanges.is_empty() || !http::begins_with_status_line(io.known) {
                    return Ok(WriteOutcome::Http);
                }
                self.state = NEW_HEAD;
            }
            State::Body(body) => body.content.write_counted = false,
            State::Head { .. } => {}
        }
        for mut piece in io.pieces() {
            if !piece.is_empty() && matches!(piece, Bytes::Unknown(_)) {
                // Counted against the response the missing bytes belong to.
                if let Some(front) = exchanges.front_mut() {
                    front.timeline.truncated_writes += 1;
                }
            }
            while !piece.is_empty() {
                match self.step(&mut piece, io.ts, conn, exchanges, finished) {
                    Ok(WriteOutcome::Http) => {}
                    Ok(WriteOutcome::Upgraded) => return Ok(WriteOutcome::Upgraded),
                    Ok(WriteOutcome::UpgradedH2c { .. }) => {
                        let after = match piece {
                            Bytes::Known(_) => io.unknown,
                            Bytes::Unknown(_) => 0,
                        };
                        return Ok(WriteOutcome::UpgradedH2c {
                            rest: piece.len() + after,
                        });
                    }
                    Err(e) => {
                        if self.settle(exchanges) {
                            if let Some(ex) = exchanges.pop_front() {
                                finished
                                    .push(ex.into_timeline(io.ts, Some(AbortReason::ParseError)));
                            }
                        }
                        self.state = State::Resync;
                        return Err(e);
                    }
                }
            }
        }
        Ok(WriteOutcome::Http)
    }

    /// The connection closed at `ts`: a body delimited by the close is
    /// complete.
    pub(crate) fn on_close(
        &mut self,
        ts: MonoNs,
        exchanges: &mut Exchanges,
        finished: &mut Vec<RequestTimeline>,
    ) {
        if let State::Body(Body {
            framing: Framing::UntilClose,
            content,
        }) = &self.state
        {
            if let Some(mut ex) = exchanges.pop_front() {
                content.finish(&mut ex);
                finished.push(ex.into_timeline(ts, None));
            }
            self.state = NEW_HEAD;
        }
    }

    /// The front exchange is about to be reported without a complete
    /// response: moves what its partial body said (an `id` in a cut JSON
    /// body) into it. Returns whether a response had started, i.e. whether
    /// the front exchange is the one this reader was working on.
    pub(crate) fn settle(&mut self, exchanges: &mut Exchanges) -> bool {
        let state = std::mem::replace(&mut self.state, NEW_HEAD);
        match state {
            State::Body(body) => {
                if let Some(front) = exchanges.front_mut() {
                    body.content.finish(front);
                }
                true
            }
            State::Head { buf, start } => !buf.is_empty() || start.is_some(),
            State::Resync => false,
        }
    }

    /// Consumes some of `piece` (at least one byte, or all of it).
    fn step(
        &mut self,
        piece: &mut Bytes<'_>,
        ts: MonoNs,
        conn: ConnId,
        exchanges: &mut Exchanges,
        finished: &mut Vec<RequestTimeline>,
    ) -> Result<WriteOutcome, StitchError> {
        match &mut self.state {
            State::Head { buf, start } => {
                if let Bytes::Known(bytes) = piece {
                    if buf.is_empty() {
                        http::skip_blank_lines(bytes);
                        if bytes.is_empty() {
                            return Ok(WriteOutcome::Http);
                        }
                    }
                }
                let Some(front) = exchanges.front_mut() else {
                    return Err(StitchError::UnexpectedResponse { conn });
                };
                // The response has begun, even if what follows cannot be
                // parsed: a failure from here on aborts this exchange.
                let start = *start.get_or_insert(ts);
                front.timeline.response_start = Some(start);
                let Bytes::Known(bytes) = piece else {
                    return Err(StitchError::HeadNotCaptured {
                        conn,
                        side: Side::Response,
                    });
                };
                let head_request = front.timeline.method.eq_ignore_ascii_case("HEAD");
                let before = bytes.len();
                let parsed = http::collect_head(buf, bytes, self.cap, |b| {
                    http::parse_response(b, head_request)
                });
                front.timeline.response_bytes += (before - bytes.len()) as u64;
                let parsed =
                    parsed.map_err(|e| StitchError::head(conn, Side::Response, self.cap, e))?;
                let Some(head) = parsed else {
                    return Ok(WriteOutcome::Http);
                };
                if head.is_interim() {
                    // 100 Continue and friends: the real response follows.
                    front.timeline.response_start = None;
                    self.state = NEW_HEAD;
                    return Ok(WriteOutcome::Http);
                }
                let tl = &mut front.timeline;
                tl.status = Some(head.status);
                let kind = match head.body {
                    ResponseBody::Empty => BodyKind::Empty,
                    _ if head.is_sse() => BodyKind::Sse,
                    ResponseBody::Fixed(_) => BodyKind::Fixed,
                    ResponseBody::Chunked => BodyKind::Chunked,
                    ResponseBody::UntilClose => BodyKind::UntilClose,
                };
                tl.body_kind = Some(kind);
                tl.content_type = head.content_type.clone();
                let framing = match head.body {
                    ResponseBody::Empty if head.status == 101 && head.upgrade_h2c => {
                        self.state = NEW_HEAD;
                        return Ok(WriteOutcome::UpgradedH2c { rest: 0 });
                    }
                    ResponseBody::Empty => {
                        complete_front(exchanges, ts, finished);
                        self.state = NEW_HEAD;
                        return Ok(if head.status == 101 {
                            WriteOutcome::Upgraded
                        } else {
                            WriteOutcome::Http
                        });
                    }
                    ResponseBody::Fixed(remaining) => Framing::Fixed { remaining },
                    ResponseBody::Chunked => Framing::Chunked(ChunkedDecoder::default()),
                    ResponseBody::UntilClose => Framing::UntilClose,
                };
                self.state = State::Body(Body {
                    framing,
                    content: Content::new(kind, self.cap),
                });
            }
            State::Body(body) => {
                let Some(front) = exchanges.front_mut() else {
                    // Unreachable while the queue is only popped here; drop
                    // rather than misattribute.
                    *piece = Bytes::Known(&[]);
                    self.state = State::Resync;
                    return Ok(WriteOutcome::Http);
                };
                let before = piece.len();
                let done =
                    body.feed(piece, ts, front)
                        .map_err(|source| StitchError::MalformedChunk {
                            conn,
                            side: Side::Response,
                            source,
                        });
                front.timeline.response_bytes += before - piece.len();
                if done? {
                    body.content.finish(front);
                    complete_front(exchanges, ts, finished);
                    self.state = NEW_HEAD;
                }
            }
            State::Resync => *piece = Bytes::Known(&[]),
        }
        Ok(WriteOutcome::Http)
    }
}

impl Body {
    /// Consumes body bytes from `piece`; true when the body is complete.
    fn feed(
        &mut self,
        piece: &mut Bytes<'_>,
        ts: MonoNs,
        ex: &mut Exchange,
    ) -> Result<bool, ChunkedError> {
        match &mut self.framing {
            Framing::Fixed { remaining } => {
                let part = piece.take(*remaining);
                *remaining -= part.len();
                self.content.on_bytes(part, ts, ex);
                Ok(*remaining == 0)
            }
            Framing::UntilClose => {
                let part = piece.take(u64::MAX);
                self.content.on_bytes(part, ts, ex);
                Ok(false)
            }
            Framing::Chunked(decoder) => loop {
                match decoder.next(piece)? {
                    Some(Piece::Data(data)) => self.content.on_bytes(data, ts, ex),
                    Some(Piece::ChunkEnd) => {
                        if self.content.kind == BodyKind::Chunked {
                            ex.timeline.push_chunk(ts);
                        }
                    }
                    Some(Piece::Done) => return Ok(true),
                    None => return Ok(false),
                }
            },
        }
    }
}

impl Content {
    pub(crate) fn new(kind: BodyKind, cap: usize) -> Self {
        let sse = kind == BodyKind::Sse;
        Self {
            kind,
            sse: sse.then(|| SseScanner::new(cap)),
            prefix: (!sse).then(|| BodyPrefix::new(cap)),
            write_counted: false,
        }
    }

    /// De-framed body bytes written at `ts`.
    pub(crate) fn on_bytes(&mut self, mut bytes: Bytes<'_>, ts: MonoNs, ex: &mut Exchange) {
        if bytes.is_empty() {
            return;
        }
        let Exchange {
            timeline: tl,
            response_model,
            ..
        } = ex;
        tl.first_body_byte.get_or_insert(ts);
        match self.kind {
            BodyKind::Fixed if tl.chunk_ts.is_empty() => tl.push_chunk(ts),
            BodyKind::UntilClose if !self.write_counted => {
                self.write_counted = true;
                tl.push_chunk(ts);
            }
            _ => {}
        }
        if let Some(sse) = &mut self.sse {
            while let Some(event) = sse.next(&mut bytes) {
                if event.is_done_marker() {
                    tl.done_seen = true;
                    continue;
                }
                if tl.chunk_ts.is_empty() && event.complete {
                    tl.first_event_hash = Some(fingerprint(event.data));
                }
                tl.push_chunk(ts);
                let want_ids = tl.response_id.is_none() || response_model.is_none();
                if want_ids || json_fields::may_carry_usage(event.data) {
                    let fields = json_fields::extract(event.data, event.complete);
                    absorb(tl, response_model, fields);
                }
            }
        } else if let Some(prefix) = &mut self.prefix {
            prefix.push(bytes);
        }
    }

    /// Moves the fields of a non-SSE body into the exchange.
    pub(crate) fn finish(&self, ex: &mut Exchange) {
        if let Some(prefix) = &self.prefix {
            absorb(&mut ex.timeline, &mut ex.response_model, prefix.fields());
        }
    }
}

/// A fixed hash of an event's data (the same bytes on two hops of one
/// process's run give the same value).
fn fingerprint(data: &[u8]) -> u64 {
    use std::hash::{DefaultHasher, Hasher};
    let mut h = DefaultHasher::new();
    h.write(data);
    h.finish()
}

/// The first `id` and `model` seen win; the last `usage` does (streams
/// report it once, at the end, after `"usage": null` in earlier events).
fn absorb(
    tl: &mut RequestTimeline,
    response_model: &mut Option<String>,
    fields: json_fields::JsonFields,
) {
    if tl.response_id.is_none() {
        tl.response_id = fields.id;
    }
    if response_model.is_none() {
        *response_model = fields.model;
    }
    if fields.usage.is_some() {
        tl.usage = fields.usage;
    }
}

fn complete_front(exchanges: &mut Exchanges, ts: MonoNs, finished: &mut Vec<RequestTimeline>) {
    if let Some(ex) = exchanges.pop_front() {
        finished.push(ex.into_timeline(ts, None));
    }
}
