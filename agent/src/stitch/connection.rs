//! One TCP connection of a traced process: its role, its two parsers and
//! the requests in flight between them.

use tracing::debug;

use crate::event::{ConnEvent, ConnId, DataEvent, Direction, MonoNs, SockAddrs};

use super::exchange::Exchanges;
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
    requests: RequestReader,
    responses: ResponseReader,
    exchanges: Exchanges,
}

impl Connection {
    pub(crate) fn accepted(ev: &ConnEvent, cap: usize) -> Self {
        Self::new(ev.conn, &ev.comm, ev.addrs, ev.ts, false, cap)
    }

    /// A connection first seen through its data.
    pub(crate) fn adopted(ev: &DataEvent, cap: usize) -> Self {
        Self::new(ev.conn, &ev.comm, ev.addrs, Io::of(ev).ts, true, cap)
    }

    fn new(
        id: ConnId,
        comm: &str,
        addrs: Option<SockAddrs>,
        ts: MonoNs,
        adopted: bool,
        cap: usize,
    ) -> Self {
        Self {
            id,
            comm: comm.to_owned(),
            addrs,
            last_ts: ts,
            recency_ts: ts,
            role: Role::Undecided,
            adopted,
            requests: RequestReader::new(cap),
            responses: ResponseReader::new(cap),
            exchanges: Exchanges::default(),
        }
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

    /// The socket closed at `ts`. A response delimited by the close is
    /// complete; every other request in flight is aborted.
    pub(crate) fn close(mut self, ts: MonoNs, sink: &mut Sink<'_>) {
        let mut finished = Vec::new();
        self.responses
            .on_close(ts, &mut self.exchanges, &mut finished);
        for timeline in finished {
            self.emit(timeline, sink);
        }
        self.abort(ts, AbortReason::ConnectionClosed, sink);
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
        sink.emit(timeline);
    }
}
