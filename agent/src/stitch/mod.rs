//! Stitching: ordered kernel events in, finished request timelines out.
//!
//! Pure and synchronous: no I/O, no clock reads, no tokio. The caller feeds
//! events in [`Event::order_ts`] order and passes the current time where
//! time matters ([`Stitcher::expire_idle`], [`Stitcher::finish`]), so every
//! behaviour is reproducible from a list of hand-built events.
//!
//! Server side, a traced process reads requests and writes responses, and
//! each response write is an emit time: HTTP/1.1 (with chunked and SSE
//! bodies) and HTTP/2 (streams, gRPC messages, SSE over HTTP/2). See
//! `design.md`, "Stitching rules" and "HTTP/2 and gRPC".
//!
//! Layout: [`table`] finds connections, [`connection`] runs one and tells
//! the protocols apart; for HTTP/1.1 [`request`] and [`response`] parse its
//! two directions with [`http`], [`chunked`], [`sse`] and [`json_fields`];
//! an HTTP/2 connection is [`h2`]'s.

mod chunked;
mod connection;
mod error;
mod exchange;
mod h2;
mod http;
mod input;
mod json_fields;
mod request;
mod response;
mod sink;
mod sse;
mod table;
mod tls_flush;

#[cfg(test)]
mod tests;

use std::sync::Arc;

use serde::Serialize;

use crate::event::{Direction, Event, MonoNs, SockAddrs};

pub use chunked::ChunkedError;
pub use error::{Side, StitchError};
pub use h2::frame::FrameError;
pub use h2::MAX_STREAMS as H2_MAX_STREAMS;
pub use http::HeadError;

use crate::model::timeline;
use crate::model::RequestTimeline;

use sink::Sink;
use table::Connections;
use tls_flush::TlsFlush;

/// Memory bounds of a [`Stitcher`].
#[derive(Debug, Clone)]
pub struct StitchConfig {
    /// Most bytes kept per connection and direction: a head being collected,
    /// or a body prefix kept for its JSON fields, or the current SSE line
    /// and event data. A head that needs more is a parse error; a body or
    /// event past it is still counted, its fields read from what was kept.
    pub max_buffered_bytes: usize,
    /// Most connections tracked; beyond it the least recently active one is
    /// evicted.
    pub max_connections: usize,
    /// Request headers whose values identify a request (`request_id`,
    /// `http.request.header.<name>`), lower-case, first present wins.
    pub request_id_headers: Arc<[String]>,
}

/// The request-id header read when the config names none.
pub const DEFAULT_REQUEST_ID_HEADER: &str = "x-request-id";

impl Default for StitchConfig {
    fn default() -> Self {
        Self {
            max_buffered_bytes: 1 << 20,
            max_connections: 65_536,
            request_id_headers: Arc::from([DEFAULT_REQUEST_ID_HEADER.to_string()]),
        }
    }
}

/// Counters since the stitcher was created.
#[derive(Debug, Default, Clone, Serialize)]
pub struct StitchStats {
    pub requests_completed: u64,
    pub requests_aborted: u64,
    /// Byte runs that were not HTTP/1.1 where HTTP was expected, and were
    /// dropped.
    pub parse_errors: u64,
    /// Server writes whose payload the capture cap cut short.
    pub truncated_writes: u64,
    /// Connections on which the traced process was the client (its
    /// upstream calls, HTTP/1.1 or HTTP/2): they give client timelines.
    pub client_connections: u64,
    /// Client requests finished (`span_kind: "client"`).
    pub client_requests: u64,
    /// Sockets carrying TLS records; ignored (their plaintext, when the
    /// OpenSSL probes see it, is a connection of its own).
    pub ciphertext_connections: u64,
    /// Connections dropped to stay under `max_connections`.
    pub evicted_connections: u64,
    /// Responses already being written when tracing began (their request
    /// was never seen): skipped, not reported.
    pub streams_in_flight_at_start: u64,
    /// Requests whose first byte arrived before their socket was tracked:
    /// reported, with start = the server's read (no `socket_wait_ms`).
    pub requests_without_ingress: u64,
    /// TLS requests whose `SSL*` was never tied to its socket: no
    /// addresses, timed from the read (0 for the servers of the suite;
    /// ebpf_tls_wire.rs holds it there).
    pub tls_untied: u64,
    /// Connections recognised as HTTP/2 (preface, `h2c` upgrade, or frames
    /// on a connection that predates tracing).
    pub h2_connections: u64,
    /// HPACK references to table entries the agent never saw (inserted
    /// before tracing began): those labels are unknown; timing is not
    /// affected.
    pub hpack_unknown_indexes: u64,
    /// HPACK header blocks that could not be decoded (bytes not captured,
    /// or malformed); the decoder's table was reset.
    pub hpack_lost_blocks: u64,
    /// Requests whose chunk count is a lower bound (`chunks_exact: false`):
    /// uncaptured bytes hid a frame header or a gRPC message prefix.
    pub chunks_inexact: u64,
}

/// Turns the event stream of traced processes into [`RequestTimeline`]s.
#[derive(Debug, Clone)]
pub struct Stitcher {
    connections: Connections,
    /// Memory-BIO TLS requests wait here for the writes that carried them.
    tls_flush: TlsFlush,
    stats: StitchStats,
}

impl Stitcher {
    pub fn new(config: StitchConfig) -> Self {
        Self {
            connections: Connections::new(config),
            tls_flush: TlsFlush::default(),
            stats: StitchStats::default(),
        }
    }

    /// Feeds one event; events arrive sorted by [`Event::order_ts`].
    /// Finished timelines are pushed to `out`.
    pub fn push(&mut self, event: &Event, out: &mut Vec<RequestTimeline>) {
        let before = out.len();
        let sink = &mut Sink::new(out, &mut self.stats);
        let mut ciphertext = false;
        match event {
            Event::Data(ev) => ciphertext = self.connections.on_data(ev, sink),
            Event::Accept(ev) => self.connections.on_accept(ev, sink),
            Event::Close(ev) => self.connections.on_close(ev, sink),
            Event::Exit(ev) => self.connections.on_exit(ev.pid, ev.ts, sink),
            Event::PeerClosed(ev) => self.connections.on_peer_closed(ev),
            Event::TlsHandshake(ev) => self.connections.on_tls_handshake(ev, sink),
            // None changes a connection: exec keeps sockets open (unless
            // CLOEXEC, which brings close events); the others are not data
            // (the explainer uses the inference ones).
            Event::Exec(_)
            | Event::Fork(_)
            | Event::Listen(_)
            | Event::LibraryMapped(_)
            | Event::Usdt(_)
            | Event::CudaSync(_)
            | Event::OffCpu(_)
            | Event::SendHold(_) => {}
        }
        self.through_tls_flush(before, out);
        if let Event::Data(ev) = event {
            let ciphertext_out = ev.direction == Direction::Egress && ciphertext;
            if let Some(addrs) = ev.addrs.filter(|_| ciphertext_out) {
                self.tls_flush
                    .ciphertext_write(ev.conn.pid, addrs, ev.ts_enter, out);
            }
        }
    }

    /// What came out from `before` on passes through [`TlsFlush`] (which
    /// may hold a memory-BIO TLS request until its bytes' write).
    fn through_tls_flush(&mut self, before: usize, out: &mut Vec<RequestTimeline>) {
        if out.len() == before {
            return;
        }
        for t in out.split_off(before) {
            self.tls_flush.finished(t, out);
        }
    }

    /// Connections with no event since `now - idle_ns`: in-flight requests
    /// come out aborted ([`AbortReason::Idle`]), ending at the connection's
    /// last event, and their state is freed.
    pub fn expire_idle(&mut self, now: MonoNs, idle_ns: u64, out: &mut Vec<RequestTimeline>) {
        let before = out.len();
        let sink = &mut Sink::new(out, &mut self.stats);
        self.connections.expire(now.saturating_sub(idle_ns), sink);
        self.through_tls_flush(before, out);
        self.tls_flush.expire(now, out);
    }

    /// Agent stopping: every in-flight request comes out aborted
    /// ([`AbortReason::AgentStopped`]) with end = `now`.
    pub fn finish(&mut self, now: MonoNs, out: &mut Vec<RequestTimeline>) {
        let before = out.len();
        let sink = &mut Sink::new(out, &mut self.stats);
        self.connections.finish(now, sink);
        self.through_tls_flush(before, out);
        self.tls_flush.flush(out);
    }

    /// Stops tracking every connection of a process (the agent stopped
    /// tracing it). No output.
    pub fn forget_process(&mut self, pid: u32) {
        self.connections.forget_process(pid);
    }

    pub fn stats(&self) -> &StitchStats {
        &self.stats
    }

    /// The requests read but not finished, for the in-flight gauges: a
    /// snapshot, so export needs nothing of the stitcher's state.
    pub fn open_requests(&self) -> Vec<crate::model::OpenRequest> {
        let mut out = Vec::new();
        self.connections.open_requests(&mut out);
        out
    }

    pub fn open_connections(&self) -> usize {
        self.connections.len()
    }

    /// Whether the far end of a server connection with `addrs` is a
    /// traced process's client connection (same host): its requests are
    /// that client's upstream calls.
    pub fn answers_traced_client(&self, addrs: &SockAddrs) -> bool {
        self.connections.has_outbound(addrs.remote, addrs.local)
    }
}
