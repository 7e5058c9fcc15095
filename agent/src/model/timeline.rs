//! The product of stitching: one finished request, with every emit time.

use serde::Serialize;

use crate::event::{ConnId, MonoNs, SockAddrs};

use super::stats::{StatsCache, TimelineStats};

/// How the response body was framed, which decides what a "chunk" is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BodyKind {
    /// `text/event-stream`: a chunk is one SSE `data:` event (`[DONE]` excluded).
    Sse,
    /// `Transfer-Encoding: chunked`, not SSE: a chunk is one non-empty HTTP chunk.
    Chunked,
    /// `Content-Length`: the whole body is one chunk.
    Fixed,
    /// No length, body ends when the connection closes: each write is a chunk.
    UntilClose,
    /// No body (204, 304, HEAD, Content-Length: 0).
    Empty,
    /// gRPC (HTTP/2, `application/grpc`): a chunk is one length-prefixed
    /// message, emitted by the write that carried its last byte.
    Grpc,
}

/// The protocol a request came over.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub enum Protocol {
    #[default]
    #[serde(rename = "http/1.1")]
    Http11,
    /// HTTP/2, not gRPC.
    #[serde(rename = "h2")]
    H2,
    /// gRPC over HTTP/2 (request or response content-type
    /// `application/grpc…`).
    #[serde(rename = "grpc")]
    Grpc,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Http11 => "http/1.1",
            Protocol::H2 => "h2",
            Protocol::Grpc => "grpc",
        }
    }
}

/// Why a request ended without a complete response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AbortReason {
    /// The client left first: its FIN or RST arrived, or a write failed
    /// with EPIPE/ECONNRESET, before the response was complete, and the
    /// connection then ended without completing it; or an RST (a client
    /// that is certainly gone) arrived before the server finished writing
    /// it. A FIN alone before a response that then completes is a
    /// half-close, not a cancellation.
    ClientClosed,
    /// The server closed the connection with this request unanswered or
    /// its response unfinished, while the client was still there.
    ServerClosed,
    /// The connection ended and who ended it is unknown: its fd was reused
    /// before its close was seen (events lost), or a TLS connection whose
    /// socket could not be tied to its `SSL*` (no peer events for it).
    ConnectionClosed,
    /// The server process exited (crashed, was killed) mid-request.
    ProcessExited,
    /// The agent stopped while the request was in flight.
    AgentStopped,
    /// The connection went idle past the stitcher's limit mid-request.
    Idle,
    /// Bytes on the connection could not be parsed as HTTP/1.1 or HTTP/2
    /// frames.
    ParseError,
}

/// Token accounting a stream reported about itself (OpenAI `usage`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
}

/// A request's phases in order (ns), as the report and the live view show
/// them: accept and TLS waits come before the request, apart.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Phases {
    /// Arrival at the host → the server's first read; `None` when the
    /// arrival is unknown.
    pub socket_wait_ns: Option<u64>,
    /// The first read → the read that completed the request.
    pub reading_ns: u64,
    /// Request complete → the first token (queue and prefill, from outside).
    pub to_first_token_ns: Option<u64>,
    /// First token → end of the response.
    pub stream_ns: Option<u64>,
}

/// One HTTP request and its response as the server process handled it.
///
/// All times are kernel monotonic nanoseconds; conversion to wall-clock
/// happens at export.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestTimeline {
    pub conn: ConnId,
    /// Process name (the thread group leader's comm).
    pub comm: String,
    pub addrs: Option<SockAddrs>,
    pub method: String,
    /// Request target as sent (path and query).
    pub path: String,
    /// W3C trace context from the request headers, kept for export.
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
    /// Model named in the request body prefix or the response, when seen.
    pub model: Option<String>,
    /// When the request's first byte reached the host (the kernel's receive
    /// path dated it, possibly before the connection was accepted); the
    /// read's exit (`read_start`) when that is unknown. TTFT, E2E and chunk
    /// offsets count from here.
    pub request_start: MonoNs,
    /// Exit time of the read that brought the first byte of the request.
    pub read_start: MonoNs,
    /// `request_start` came from the kernel's receive path (else it is the
    /// read: the request arrived before its socket was tracked).
    pub ingress_known: bool,
    /// First request of a connection: connection established → `accept()`
    /// returned.
    pub accept_wait_ns: Option<u64>,
    /// First request of a TLS connection: its first byte (the ClientHello)
    /// reached the host → the client's Finished did (the kernel's TLS
    /// record walk), else → `SSL_do_handshake` succeeded.
    pub tls_handshake_ns: Option<u64>,
    /// Values of the configured request-id headers present, in config order
    /// (lower-case names; values only, bounded).
    pub request_headers: Vec<(String, String)>,
    /// Chunks emitted at or after the client left (its FIN or RST), when
    /// the request ended [`AbortReason::ClientClosed`].
    pub chunks_after_client_closed: u32,
    /// Exit time of the read that completed the request (headers + body).
    pub request_end: MonoNs,
    pub request_bytes: u64,
    pub status: Option<u16>,
    pub content_type: Option<String>,
    pub body_kind: Option<BodyKind>,
    /// Entry time of the first write of the response (status line).
    pub response_start: Option<MonoNs>,
    /// Entry time of the write that carried the first body byte.
    pub first_body_byte: Option<MonoNs>,
    /// Emit time (write entry) of every chunk, in order. See [`BodyKind`]
    /// for what a chunk is.
    pub chunk_ts: Vec<MonoNs>,
    /// Entry time of the write that completed the response, or the time of
    /// the event that aborted it.
    pub end: MonoNs,
    pub response_bytes: u64,
    /// SSE stream ended with `data: [DONE]`.
    pub done_seen: bool,
    pub aborted: bool,
    pub abort_reason: Option<AbortReason>,
    /// The `"id"` of the first JSON object of the response, when seen.
    pub response_id: Option<String>,
    /// A hash of the first SSE event's data, when it was captured whole:
    /// a gateway that passes the upstream's events through unchanged is
    /// joined to its upstream call by it. Never exported (it is
    /// completion text's fingerprint, not text).
    pub first_event_hash: Option<u64>,
    pub usage: Option<Usage>,
    /// Writes whose payload was cut by the capture cap; events inside the
    /// missing tail could not be counted.
    pub truncated_writes: u32,
    /// Seen as plaintext inside OpenSSL (SSL_read/SSL_write), not on a socket.
    pub tls: bool,
    pub protocol: Protocol,
    /// HTTP/2 stream id.
    pub stream_id: Option<u32>,
    /// gRPC: `grpc-status` of the trailers (or of a trailers-only response).
    pub grpc_status: Option<u32>,
    /// gRPC: length of `grpc-message` (its text never leaves the agent).
    pub grpc_message_bytes: Option<u64>,
    /// Uncaptured bytes hid a frame header or a message prefix: `chunk_ts`
    /// holds fewer chunks than were sent.
    pub chunks_inexact: bool,
    /// HTTP/2: intervals in which this stream's writes waited for the
    /// client's WINDOW_UPDATE (its send window, or the connection's, was
    /// used up), in order.
    pub flow_control_waits: Vec<(MonoNs, MonoNs)>,
    /// Late chunks and their causes; filled after stitching by the
    /// explainer (empty when nothing was late).
    pub stalls: Vec<super::Stall>,
    /// The engine's own account of the request (queue, prefill, batching,
    /// preemption), when it fires the `llm:*` probes; set by the explainer.
    pub engine: Option<super::EngineView>,
    /// Which end of the connection the traced process was.
    pub kind: super::SpanKind,
    /// Its place in a trace: set by the hop join, before any output.
    pub trace: Option<super::TraceIds>,
    /// A gateway's request: where its first token's time went (set by the
    /// hop join when an upstream call was joined to it).
    pub upstream: Option<super::UpstreamView>,
    /// [`RequestTimeline::stats`], worked out on first use; read it through
    /// that method.
    pub derived: StatsCache,
}

impl RequestTimeline {
    /// Streamed responses: SSE, chunked, or delimited by connection close.
    pub fn is_stream(&self) -> bool {
        matches!(
            self.body_kind,
            Some(BodyKind::Sse | BodyKind::Chunked | BodyKind::UntilClose | BodyKind::Grpc)
        )
    }

    /// Records a chunk emitted by a write entered at `ts`. Chunks come in
    /// byte order, but two threads writing one socket can enter their
    /// writes in the other order (and records from different CPUs reach
    /// the ring buffer in reservation order, not timestamp order): a later
    /// chunk's bytes cannot have left before an earlier chunk's, so its
    /// emit is at least the previous one's. Gaps stay non-negative and add
    /// up to first-to-last.
    pub fn push_chunk(&mut self, ts: MonoNs) {
        let ts = self.chunk_ts.last().map_or(ts, |&last| ts.max(last));
        self.chunk_ts.push(ts);
        self.derived = StatsCache::default();
    }

    /// HTTP/2: total time the stream's writes waited for flow-control
    /// window (overlapping stream and connection waits counted once);
    /// `None` for HTTP/1.1.
    pub fn flow_control_ns(&self) -> Option<u64> {
        if self.protocol == Protocol::Http11 {
            return None;
        }
        let mut waits = self.flow_control_waits.clone();
        waits.sort_unstable();
        let mut total = 0;
        let mut covered_to = 0;
        for (from, to) in waits {
            let from = from.max(covered_to);
            if to > from {
                total += to - from;
                covered_to = to;
            }
        }
        Some(total)
    }

    /// gRPC: `(service, method)` from a `/package.Service/Method` path.
    pub fn rpc_service_method(&self) -> Option<(&str, &str)> {
        if self.protocol != Protocol::Grpc {
            return None;
        }
        let (service, method) = self.path.strip_prefix('/')?.split_once('/')?;
        (!service.is_empty() && !method.is_empty()).then_some((service, method))
    }

    /// Time to first token: first chunk emit (first body byte for
    /// non-SSE responses) minus request start.
    pub fn ttft_ns(&self) -> Option<u64> {
        let first = match self.body_kind {
            Some(BodyKind::Sse | BodyKind::Grpc) => self.chunk_ts.first().copied(),
            _ => self.first_body_byte,
        }?;
        Some(first.saturating_sub(self.request_start))
    }

    /// When the first token (first body byte) left: request start + TTFT.
    pub fn first_token(&self) -> Option<MonoNs> {
        self.ttft_ns()
            .map(|ttft| self.request_start.saturating_add(ttft))
    }

    /// Where the request's time went, one phase after the other from its
    /// arrival: the socket, reading it, to the first token, the stream.
    pub fn phases(&self) -> Phases {
        let first = self.first_token();
        Phases {
            socket_wait_ns: self.socket_wait_ns(),
            reading_ns: self.request_end.saturating_sub(self.read_start),
            to_first_token_ns: first.map(|f| f.saturating_sub(self.request_end)),
            stream_ns: first.map(|f| self.end.saturating_sub(f)),
        }
    }

    /// The longest gap between two chunks: (index of the chunk after it,
    /// ns).
    pub fn longest_gap(&self) -> Option<(usize, u64)> {
        self.stats()
            .itl_ns
            .iter()
            .enumerate()
            .max_by_key(|(_, g)| **g)
            .map(|(i, g)| (i + 1, *g))
    }

    /// Time the request waited in the socket (arrival → the server's read).
    pub fn socket_wait_ns(&self) -> Option<u64> {
        self.ingress_known
            .then(|| self.read_start.saturating_sub(self.request_start))
    }

    /// TTFT counted from the server's read, as the server itself sees it.
    pub fn ttft_from_read_ns(&self) -> Option<u64> {
        let ttft = self.ttft_ns()?;
        Some(ttft.saturating_sub(self.read_start.saturating_sub(self.request_start)))
    }

    /// The first configured request-id header present.
    pub fn request_id(&self) -> Option<&str> {
        self.request_headers.first().map(|(_, v)| v.as_str())
    }

    /// Request start to response end (or abort).
    pub fn e2e_ns(&self) -> u64 {
        self.end.saturating_sub(self.request_start)
    }

    /// Inter-token gaps, their percentiles and TPOT, worked out on the
    /// first call and kept: a timeline changed afterwards (other than by
    /// [`Self::push_chunk`]) keeps the old figures. Only the stitcher
    /// changes a timeline, before it hands it out finished.
    pub fn stats(&self) -> &TimelineStats {
        self.derived.get_or_init(self)
    }

    /// Emit time of every chunk relative to request start.
    pub fn chunk_offsets_ns(&self) -> Vec<u64> {
        self.chunk_ts
            .iter()
            .map(|t| t.saturating_sub(self.request_start))
            .collect()
    }
}
