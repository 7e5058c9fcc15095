//! What the hop join (`crate::hops`) adds to a finished request: which end
//! of its connection the traced process was, its place in a trace, the key
//! that tied it to the request that caused it, and, on a gateway's line,
//! where its first token's time went.

use std::net::SocketAddr;

use serde::Serialize;

/// Which end of its connection the traced process was.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SpanKind {
    /// It read the request and wrote the response.
    #[default]
    Server,
    /// It wrote the request (a gateway's upstream call): start = the write
    /// of its first byte, chunks = when the response's bytes reached the
    /// host.
    Client,
}

/// How a request was tied to the one that caused it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum JoinKey {
    /// Same host: the client's connection and the server's accepted one
    /// are the two ends of one TCP connection, and the server's request
    /// lies within the single client request in flight on it (HTTP/1.1
    /// has one at a time). Exact.
    Tcp4tuple,
    /// Inside a gateway: its outbound request carried the trace id of the
    /// inbound one's `traceparent`.
    Traceparent,
    /// Inside a gateway: its outbound request carried a configured
    /// request-id header with the inbound one's value.
    RequestId,
    /// Inside a gateway: the upstream's response id came back out in the
    /// gateway's own response.
    ResponseId,
    /// Inside a gateway: its first SSE event carried the same data as the
    /// upstream's first (a gateway that forwards events unchanged; weakest:
    /// identical first events of concurrent requests join neither).
    FirstEvent,
}

impl JoinKey {
    pub fn as_str(self) -> &'static str {
        match self {
            JoinKey::Tcp4tuple => "tcp_4tuple",
            JoinKey::Traceparent => "traceparent",
            JoinKey::RequestId => "request_id",
            JoinKey::ResponseId => "response_id",
            JoinKey::FirstEvent => "first_event",
        }
    }
}

/// A request's ids in its trace, the same on its JSON line and its spans.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceIds {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub parent_span_id: Option<[u8; 8]>,
    /// The parent is the caller's span named by `traceparent` (in another
    /// process), not a hop this agent traced.
    pub parent_remote: bool,
    /// W3C trace flags of the trace (bit 0: sampled).
    pub flags: u8,
    pub tracestate: Option<String>,
    /// What tied this request to its parent hop; `None` for a root or a
    /// request whose parent is remote.
    pub join_key: Option<JoinKey>,
}

impl TraceIds {
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }
}

/// On a gateway's request: where its first token's time went, from its
/// first upstream call (the earliest joined client request). The three
/// spans add up to the gateway's TTFT.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UpstreamView {
    /// Gateway arrival → its upstream request's first byte written.
    pub wait_ns: u64,
    /// Upstream request written → the upstream's first chunk reached the
    /// host.
    pub ttft_ns: Option<u64>,
    /// The upstream's first chunk arrived → the gateway wrote its own
    /// first chunk.
    pub delivery_ns: Option<u64>,
    /// Per chunk, the gateway's emit − the upstream chunk's arrival, when
    /// both sides counted the same chunks.
    pub chunk_delay_p50_ns: Option<u64>,
    pub chunk_delay_max_ns: Option<u64>,
    pub peer: Option<SocketAddr>,
}
