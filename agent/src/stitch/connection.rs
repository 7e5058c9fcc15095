//! One TCP connection of a traced process: its role, its two parsers and
//! the requests in flight between them.

use tracing::debug;

use std::sync::Arc;

use crate::event::{ConnEvent, ConnId, DataEvent, Direction, MonoNs, PeerClose, SockAddrs};

use super::exchange::{Exchanges, Setup};
use super::http;
use super::input::Io;
use super::request::RequestReader;
use super::response::{ResponseReader, WriteOutcome};
use super::sink::Sink;
use super::timeline::{AbortReason, RequestTimeline};

/// What the traced process is on this connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// No bytes yet.
    Undecided,
    /// It reads requests and writes responses: what we trace.
    Server,
    /// Its first bytes out were a request: it is calling another service.
    /// Ignored until close.
    Client,
    /// It switched protocols (`101`): no longer HTTP/1.1. Ignored until
    /// close.
    Upgraded,
    /// TLS records on the socket: the plaintext comes from the OpenSSL
    /// probes as its own connection. Ignored until close, so it is neither
    /// parsed nor reported twice.
    Ciphertext,
}

#[derive(Debug, Clone)]
pub(crate) struct Connection {
    id: ConnId,
    comm: String,
    addrs: Option<SockAddrs>,
    /// Time of the latest event; the connection table indexes it.
    pub(crate) last_ts: MonoNs,
    /// The time the table's recency index files it under (see `table`).
    pub(crate) recency_ts: MonoNs,
    role: Role,
    /// Created from data rather than an accept: it predates tracing, so its
    /// first bytes may well be the middle of a message. Errors before its
    /// first whole request are expected and not counted.
    adopted: bool,
    /// An adopted connection whose first bytes were a response already
    /// under way: counted once, skipped.
    midstream_counted: bool,
    peer: PeerState,
    requests: RequestReader,
    responses: ResponseReader,
    exchanges: Exchanges,
}

/// What the kernel said about the client's side of the connection.
#[derive(Debug, Clone, Copy, Default)]
struct PeerState {
    /// First FIN (the client will send no more).
    fin: Option<MonoNs>,
    /// First RST, or a write refused with EPIPE/ECONNRESET: it is gone.
    reset: Option<MonoNs>,
}

impl PeerState {
    /// When the client left, by the first sign of it.
    fn left(&self) -> Option<MonoNs> {
        match (self.fin, self.reset) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

impl Connection {
    pub(crate) fn accepted(ev: &ConnEvent, limits: &Limits) -> Self {
        let mut conn = Self::new(ev.conn, &ev.comm, ev.addrs, ev.ts, false, limits);
        conn.exchanges.setup.accept_wait_ns =
            ev.established.filter(|&t| t <= ev.ts).map(|t| ev.ts - t);
        conn
    }

    /// A TLS connection (keyed by its `SSL*`) whose handshake completed at
    /// `ts`; `setup` is what its first request is charged.
    pub(crate) fn handshaken(
        id: ConnId,
        addrs: Option<SockAddrs>,
        ts: MonoNs,
        setup: Setup,
        limits: &Limits,
    ) -> Self {
        let mut conn = Self::new(id, "", addrs, ts, false, limits);
        conn.exchanges.setup = setup;
        conn
    }

    /// A connection first seen through its data.
    pub(crate) fn adopted(ev: &DataEvent, limits: &Limits) -> Self {
        Self::new(ev.conn, &ev.comm, ev.addrs, Io::of(ev).ts, true, limits)
    }

    fn new(
        id: ConnId,
        comm: &str,
        addrs: Option<SockAddrs>,
        ts: MonoNs,
        adopted: bool,
        limits: &Limits,
    ) -> Self {
        Self {
            id,
            comm: comm.to_owned(),
            addrs,
            last_ts: ts,
            recency_ts: ts,
            role: Role::Undecided,
            adopted,
            midstream_counted: false,
            peer: PeerState::default(),
            requests: RequestReader::new(limits.cap, Arc::clone(&limits.id_headers)),
            responses: ResponseReader::new(limits.cap),
            exchanges: Exchanges::default(),
        }
    }

    pub(crate) fn addrs(&self) -> Option<SockAddrs> {
        self.addrs
    }

    /// This connection's accept wait (for the TLS connection on top of it).
    pub(crate) fn accept_wait_ns(&self) -> Option<u64> {
        self.exchanges.setup.accept_wait_ns
    }

    /// The client closed (FIN) or reset its side at `ts`.
    pub(crate) fn peer_closed(&mut self, ts: MonoNs, how: PeerClose) {
        let slot = if how.is_reset() {
            &mut self.peer.reset
        } else {
            &mut self.peer.fin
        };
        slot.get_or_insert(ts);
    }

    pub(crate) fn on_data(&mut self, ev: &DataEvent, sink: &mut Sink<'_>) {
        if self.addrs.is_none() {
            self.addrs = ev.addrs;
        }
        if self.comm.is_empty() {
            self.comm.clone_from(&ev.comm);
        }
        let io = Io::of(ev);
        if io.is_empty() {
            return;
        }
        if self.role == Role::Undecided {
            self.role = if http::begins_with_tls_record(io.known) {
                sink.ciphertext_connection();
                Role::Ciphertext
            } else if ev.direction == Direction::Egress && http::begins_with_request_line(io.known)
            {
                sink.client_connection();
                Role::Client
            } else {
                Role::Server
            };
        }
        if self.role != Role::Server {
            return;
        }
        if self.adopted
            && !self.midstream_counted
            && ev.direction == Direction::Egress
            && self.exchanges.opened() == 0
        {
            self.midstream_counted = true;
            sink.stream_in_flight_at_start();
        }
        let mut finished = Vec::new();
        let result = match ev.direction {
            Direction::Ingress => self.requests.on_read(&io, self.id, &mut self.exchanges),
            Direction::Egress => {
                if io.is_truncated() {
                    sink.truncated_write();
                }
                self.responses
                    .on_write(&io, self.id, &mut self.exchanges, &mut finished)
                    .map(|outcome| {
                        if outcome == WriteOutcome::Upgraded {
                            self.role = Role::Upgraded;
                        }
                    })
            }
        };
        for timeline in finished {
            self.emit(timeline, sink);
        }
        if let Err(err) = result {
            if self.adopted && self.exchanges.opened() == 0 {
                debug!(error = %err, "stitch: skipping the rest of a message sent before tracing began");
            } else {
                sink.parse_error(&err);
            }
        }
    }

    /// The socket closed at `ts`; `observed` when the close itself was seen
    /// (not inferred from a reused fd). A response delimited by the close is
    /// complete; every other request in flight is aborted, by whoever left
    /// first.
    pub(crate) fn close(mut self, ts: MonoNs, observed: bool, sink: &mut Sink<'_>) {
        let mut finished = Vec::new();
        self.responses
            .on_close(ts, &mut self.exchanges, &mut finished);
        for timeline in finished {
            self.emit(timeline, sink);
        }
        let reason = if self.peer.left().is_some() {
            AbortReason::ClientClosed
        } else if observed && (!self.id.is_tls() || self.addrs.is_some()) {
            AbortReason::ServerClosed
        } else {
            AbortReason::ConnectionClosed
        };
        self.abort(ts, reason, sink);
    }

    /// Reports every request in flight as aborted at `end`.
    pub(crate) fn abort(mut self, end: MonoNs, reason: AbortReason, sink: &mut Sink<'_>) {
        self.responses.settle(&mut self.exchanges);
        let in_flight: Vec<_> = self.exchanges.drain().collect();
        for ex in in_flight {
            self.emit(ex.into_timeline(end, Some(reason)), sink);
        }
    }

    fn emit(&self, mut timeline: RequestTimeline, sink: &mut Sink<'_>) {
        timeline.comm.clone_from(&self.comm);
        timeline.addrs = self.addrs;
        timeline.tls = self.id.is_tls();
        judge_client_exit(&mut timeline, self.peer);
        sink.emit(timeline);
    }
}

/// Limits and settings every connection is built with.
#[derive(Debug, Clone)]
pub(crate) struct Limits {
    /// Most bytes kept per direction.
    pub cap: usize,
    pub id_headers: Arc<[String]>,
}

/// A response the server finished writing after the client had certainly
/// gone (RST, a refused write) did not reach it: a cancellation. Chunks
/// emitted from the client's first sign of leaving are counted for every
/// cancelled request.
fn judge_client_exit(timeline: &mut RequestTimeline, peer: PeerState) {
    if !timeline.aborted && peer.reset.is_some_and(|t| t <= timeline.end) {
        timeline.aborted = true;
        timeline.abort_reason = Some(AbortReason::ClientClosed);
    }
    if timeline.abort_reason != Some(AbortReason::ClientClosed) {
        return;
    }
    if let Some(left) = peer.left() {
        let after = timeline.chunk_ts.iter().filter(|&&t| t >= left).count();
        timeline.chunks_after_client_closed = u32::try_from(after).unwrap_or(u32::MAX);
    }
}
