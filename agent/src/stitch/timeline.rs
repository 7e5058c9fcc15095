//! The product of stitching: one finished request, with every emit time.

use serde::Serialize;

use crate::event::{ConnId, MonoNs, SockAddrs};

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
    /// Bytes on the connection could not be parsed as HTTP/1.1.
    ParseError,
}

/// Token accounting a stream reported about itself (OpenAI `usage`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
}

/// One HTTP request and its response as the server process handled it.
///
/// All times are kernel monotonic nanoseconds; conversion to wall-clock
/// happens at export.
#[derive(Debug, Clone, PartialEq)]
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
    /// reached the host → `SSL_do_handshake` succeeded.
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
    pub usage: Option<Usage>,
    /// Writes whose payload was cut by the capture cap; events inside the
    /// missing tail could not be counted.
    pub truncated_writes: u32,
    /// Seen as plaintext inside OpenSSL (SSL_read/SSL_write), not on a socket.
    pub tls: bool,
    /// Late chunks and their causes; filled after stitching by the
    /// explainer (empty when nothing was late).
    pub stalls: Vec<crate::explain::Stall>,
}

impl RequestTimeline {
    /// Streamed responses: SSE, chunked, or delimited by connection close.
    pub fn is_stream(&self) -> bool {
        matches!(
            self.body_kind,
            Some(BodyKind::Sse | BodyKind::Chunked | BodyKind::UntilClose)
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
    }

    /// Time to first token: first chunk emit (first body byte for
    /// non-SSE responses) minus request start.
    pub fn ttft_ns(&self) -> Option<u64> {
        let first = match self.body_kind {
            Some(BodyKind::Sse) => self.chunk_ts.first().copied(),
            _ => self.first_body_byte,
        }?;
        Some(first.saturating_sub(self.request_start))
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

    /// Gaps between successive chunk emits.
    pub fn itl_ns(&self) -> Vec<u64> {
        self.chunk_ts
            .windows(2)
            .map(|w| w[1].saturating_sub(w[0]))
            .collect()
    }

    /// Emit time of every chunk relative to request start.
    pub fn chunk_offsets_ns(&self) -> Vec<u64> {
        self.chunk_ts
            .iter()
            .map(|t| t.saturating_sub(self.request_start))
            .collect()
    }
}
