//! One HTTP/2 stream as the server handles it: the client's request (its
//! HEADERS, DATA and END_STREAM) and the server's response (HEADERS, DATA,
//! trailers), turned into the stream's [`RequestTimeline`].

use crate::event::{ConnId, MonoNs};

use super::super::exchange::{started_timeline, Exchange, RequestStart, Setup};
use super::super::input::Bytes;
use super::super::json_fields::BodyPrefix;
use super::super::response::Content;
use super::super::timeline::{AbortReason, BodyKind, Protocol, RequestTimeline};
use super::grpc::{is_one_message, MessageWalker};
use super::labels::Labels;

#[derive(Debug, Clone)]
enum Body {
    /// No response HEADERS yet.
    Pending,
    /// SSE and plain bodies, through the HTTP/1.1 body content parser.
    Content(Content),
    Grpc(MessageWalker),
}

#[derive(Debug, Clone)]
pub(crate) struct Stream {
    ex: Exchange,
    request_headers_seen: bool,
    response_headers_seen: bool,
    body: Body,
    /// The request body's captured prefix (its `model`); not for gRPC.
    request_prefix: Option<BodyPrefix>,
    /// The current response DATA frame carried bytes (for `chunked`
    /// bodies a chunk is one non-empty DATA frame).
    frame_had_data: bool,
    /// Most bytes kept of a body prefix or an SSE event.
    cap: usize,
    /// A request DATA frame was seen; the first was exactly one gRPC
    /// message.
    request_data_seen: bool,
    request_looks_grpc: bool,
    /// The response's content-type could not be decoded: its first DATA
    /// bytes decide whether it is SSE.
    sniff_sse: bool,
}

impl Stream {
    /// The stream's request and response so far.
    pub(crate) fn exchange(&self) -> &Exchange {
        &self.ex
    }

    /// The client's HEADERS opened stream `id`, its first byte read as
    /// `start` says.
    pub(crate) fn open(
        conn: ConnId,
        id: u32,
        start: RequestStart,
        setup: Setup,
        cap: usize,
    ) -> Self {
        let timeline = RequestTimeline {
            conn,
            protocol: Protocol::H2,
            stream_id: Some(id),
            accept_wait_ns: setup.accept_wait_ns,
            tls_handshake_ns: setup.tls_handshake_ns,
            ..started_timeline(start, start.read)
        };
        Self {
            ex: Exchange {
                seq: u64::from(id),
                timeline,
                response_model: None,
            },
            request_headers_seen: false,
            response_headers_seen: false,
            body: Body::Pending,
            request_prefix: Some(BodyPrefix::new(cap)),
            frame_had_data: false,
            cap,
            request_data_seen: false,
            request_looks_grpc: false,
            sniff_sse: false,
        }
    }

    /// Stream 1 of an `h2c` upgrade: the HTTP/1.1 request that asked for
    /// it, answered over HTTP/2.
    pub(crate) fn upgraded(mut ex: Exchange, cap: usize) -> Self {
        let tl = &mut ex.timeline;
        tl.protocol = Protocol::H2;
        tl.stream_id = Some(1);
        tl.response_start = None;
        tl.status = None;
        tl.content_type = None;
        tl.body_kind = None;
        tl.response_bytes = 0;
        Self {
            ex,
            request_headers_seen: true,
            response_headers_seen: false,
            body: Body::Pending,
            request_prefix: None,
            frame_had_data: false,
            cap,
            request_data_seen: false,
            request_looks_grpc: false,
            sniff_sse: false,
        }
    }

    /// A decoded client header block: the request's labels, or its
    /// trailers.
    pub(crate) fn request_headers(
        &mut self,
        labels: Labels,
        ids: &[String],
        block_len: usize,
        ts: MonoNs,
    ) {
        let tl = &mut self.ex.timeline;
        tl.request_bytes += block_len as u64;
        tl.request_end = ts;
        if self.request_headers_seen {
            return;
        }
        self.request_headers_seen = true;
        if labels.is_grpc() {
            tl.protocol = Protocol::Grpc;
            self.request_prefix = None;
        }
        tl.method = labels.method.clone().unwrap_or_default();
        tl.path = labels.path.clone().unwrap_or_default();
        tl.traceparent = labels.traceparent.clone();
        tl.tracestate = labels.tracestate.clone();
        tl.request_headers = labels.ids_in_order(ids);
    }

    /// Payload of a client DATA frame of `frame_len` bytes; `first` when
    /// it is the frame's first payload.
    pub(crate) fn request_data(
        &mut self,
        bytes: Bytes<'_>,
        first: bool,
        frame_len: u32,
        ts: MonoNs,
    ) {
        if first && !self.request_data_seen {
            self.request_data_seen = true;
            if let Bytes::Known(b) = bytes {
                self.request_looks_grpc = is_one_message(b, frame_len);
            }
        }
        let tl = &mut self.ex.timeline;
        tl.request_bytes += bytes.len();
        tl.request_end = ts;
        if let Some(prefix) = &mut self.request_prefix {
            prefix.push(bytes);
        }
    }

    pub(crate) fn request_frame_end(&mut self, end_stream: bool, ts: MonoNs) {
        self.ex.timeline.request_end = ts;
        if end_stream {
            if let Some(prefix) = self.request_prefix.take() {
                self.ex.timeline.model = prefix.fields().model;
            }
        }
    }

    /// The write of a server HEADERS frame began at `ts`.
    pub(crate) fn server_headers_start(&mut self, ts: MonoNs) {
        if !self.response_headers_seen {
            self.ex.timeline.response_start.get_or_insert(ts);
        }
    }

    /// A decoded server header block: the response head (unless interim),
    /// or the trailers.
    pub(crate) fn response_headers(&mut self, labels: Labels, block_len: usize) {
        let tl = &mut self.ex.timeline;
        tl.response_bytes += block_len as u64;
        if labels.grpc_status.is_some() {
            tl.grpc_status = labels.grpc_status;
            tl.grpc_message_bytes = labels.grpc_message_bytes;
        }
        if self.response_headers_seen {
            return;
        }
        if labels.status.is_some_and(|s| (100..200).contains(&s)) {
            // 100 Continue and friends: the real response follows.
            tl.response_start = None;
            return;
        }
        self.response_headers_seen = true;
        tl.status = labels.status;
        tl.content_type.clone_from(&labels.content_type);
        // Without a content-type (HPACK could not decode it), a request body
        // that is one gRPC message says what the response is.
        let grpc = labels.is_grpc()
            || tl.protocol == Protocol::Grpc
            || (labels.content_type.is_none() && self.request_looks_grpc);
        let kind = if grpc {
            tl.protocol = Protocol::Grpc;
            BodyKind::Grpc
        } else if tl.method.eq_ignore_ascii_case("HEAD") || labels.content_length == Some(0) {
            BodyKind::Empty
        } else if labels.is_sse() {
            BodyKind::Sse
        } else if labels.content_length.is_some() {
            BodyKind::Fixed
        } else {
            BodyKind::Chunked
        };
        tl.body_kind = Some(kind);
        self.sniff_sse = kind == BodyKind::Chunked && labels.content_type.is_none();
        self.body = match kind {
            BodyKind::Grpc => Body::Grpc(MessageWalker::default()),
            kind => Body::Content(Content::new(kind, self.cap)),
        };
    }

    /// A server DATA frame begins at `ts`; `waits` are the flow-control
    /// waits it ended.
    pub(crate) fn data_start(&mut self, waits: Vec<(MonoNs, MonoNs)>) {
        self.ex.timeline.flow_control_waits.extend(waits);
        self.frame_had_data = false;
    }

    /// Payload of a server DATA frame of `frame_len` bytes; `first` when it
    /// is the frame's first payload.
    pub(crate) fn response_data(
        &mut self,
        bytes: Bytes<'_>,
        first: bool,
        frame_len: u32,
        ts: MonoNs,
    ) {
        if bytes.is_empty() {
            return;
        }
        self.frame_had_data = true;
        if std::mem::take(&mut self.sniff_sse) {
            if let Bytes::Known(b) = bytes {
                if looks_like_sse(b) {
                    self.ex.timeline.body_kind = Some(BodyKind::Sse);
                    self.body = Body::Content(Content::new(BodyKind::Sse, self.cap));
                }
            }
        }
        let tl = &mut self.ex.timeline;
        tl.response_bytes += bytes.len();
        tl.first_body_byte.get_or_insert(ts);
        match &mut self.body {
            Body::Grpc(walker) => {
                if first {
                    if let Bytes::Known(b) = bytes {
                        walker.frame_start(b, frame_len);
                    }
                }
                for _ in 0..walker.feed(bytes) {
                    tl.push_chunk(ts);
                }
            }
            Body::Content(content) => content.on_bytes(bytes, ts, &mut self.ex),
            // DATA before any response HEADERS: not a valid response; its
            // bytes are counted, nothing else.
            Body::Pending => {}
        }
    }

    /// The current server DATA frame is complete (its last byte written at
    /// `ts`).
    pub(crate) fn response_frame_end(&mut self, ts: MonoNs) {
        if self.frame_had_data && self.ex.timeline.body_kind == Some(BodyKind::Chunked) {
            self.ex.timeline.push_chunk(ts);
        }
        self.frame_had_data = false;
    }

    /// Some of this stream's bytes may have been in a run the capture did
    /// not keep: its count is a lower bound from here.
    pub(crate) fn mark_inexact(&mut self) {
        self.ex.timeline.chunks_inexact = true;
    }

    /// The server's framing was lost: message boundaries of this stream
    /// are lost too.
    pub(crate) fn response_bytes_lost(&mut self) {
        self.mark_inexact();
        if let Body::Grpc(walker) = &mut self.body {
            walker.lose();
        }
    }

    pub(crate) fn into_timeline(
        mut self,
        end: MonoNs,
        abort: Option<AbortReason>,
    ) -> RequestTimeline {
        match &self.body {
            Body::Content(content) => content.finish(&mut self.ex),
            Body::Grpc(walker) => {
                if walker.inexact {
                    self.ex.timeline.chunks_inexact = true;
                }
            }
            Body::Pending => {}
        }
        self.ex.into_timeline(end, abort)
    }
}

/// Whether a body begins like an event stream: a field line (`data:`,
/// `event:`, `id:`, `retry:`) or a comment (`:`).
fn looks_like_sse(body: &[u8]) -> bool {
    [&b"data:"[..], b"event:", b"id:", b"retry:", b":"]
        .iter()
        .any(|field| body.starts_with(field))
}
