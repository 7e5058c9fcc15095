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
    /// The server closed the socket before the response was complete.
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
    /// Exit time of the read that brought the first byte of the request.
    pub request_start: MonoNs,
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

    /// Time to first token: first chunk emit (first body byte for
    /// non-SSE responses) minus request start.
    pub fn ttft_ns(&self) -> Option<u64> {
        let first = match self.body_kind {
            Some(BodyKind::Sse) => self.chunk_ts.first().copied(),
            _ => self.first_body_byte,
        }?;
        Some(first.saturating_sub(self.request_start))
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
