//! One TCP connection of a traced process: its role, its two parsers and
//! the requests in flight between them.

use tracing::debug;

use std::sync::Arc;

use crate::event::{ConnEvent, ConnId, DataEvent, Direction, MonoNs, PeerClose, SockAddrs};

use super::exchange::{Exchanges, Setup};
use super::h2::{self, H2Conn};
use super::http;
use super::input::Io;
use super::request::RequestReader;
use super::response::{ResponseReader, WriteOutcome};
use super::sink::Sink;
use super::timeline::{AbortReason, RequestTimeline};
use crate::model::{OpenRequest, SpanKind};

/// What the traced process is on this connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// No bytes yet.
    Undecided,
    /// It reads requests and writes responses: what we trace (HTTP/1.1,
    /// or HTTP/2 once `h2` is set).
    Server,
    /// Its first bytes out were an HTTP/1.1 request: it is calling another
    /// service (a gateway's upstream). Its requests are parsed from its
    /// writes and the responses from its reads: client timelines.
    Client,
    /// Its first bytes out were the HTTP/2 client preface: calling another
    /// service over HTTP/2 (nginx `grpc_pass`, a gRPC client). `h2` parses
    /// it with the directions turned round: its writes are the client's
    /// frames (a stream starts at the write of its HEADERS), its reads the
    /// server's, each piece dated by when its bytes reached the host.
    ClientH2,
    /// It switched protocols (`101`) to something other than HTTP/2
    /// (WebSocket): no longer HTTP. Ignored until close.
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
    /// Set once the connection is known to speak HTTP/2: from then on it
    /// parses every byte, and the HTTP/1.1 readers are unused.
    h2: Option<Box<H2Conn>>,
    limits: Limits,
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
            h2: None,
            limits: limits.clone(),
        }
    }

    /// Appends the requests this connection serves that are not finished.
    pub(crate) fn open_requests(&self, out: &mut Vec<OpenRequest>) {
        if self.role != Role::Server {
            return;
        }
        match &self.h2 {
            Some(h2) => out.extend(h2.exchanges().map(|ex| ex.open_request(&self.comm))),
            None => out.extend(self.exchanges.iter().map(|ex| ex.open_request(&self.comm))),
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
            self.comm.push_str(&ev.comm);
        }
        let io = Io::of(ev);
        if io.is_empty() {
            return;
        }
        if self.role == Role::Undecided {
            self.role = self.decide_role(ev.direction, &io, sink);
        }
        if self.role == Role::Client {
            self.on_client_data(ev.direction, &io, sink);
            return;
        }
        if self.role == Role::ClientH2 {
            self.on_client_h2_data(ev.direction, &io, sink);
            return;
        }
        if self.role != Role::Server {
            return;
        }
        if ev.direction == Direction::Egress && h2::begins_with_preface(io.known) {
            // Taken for a server from the peer's first bytes (its SETTINGS
            // read before our preface write was seen, e.g. nginx's
            // grpc_pass upstream): the preface it writes makes the traced
            // process the client.
            self.start_client_h2(sink);
            self.on_client_h2_data(ev.direction, &io, sink);
            return;
        }
        if self.h2.is_none() && self.exchanges.opened() == 0 {
            self.detect_h2(ev.direction, &io, sink);
        }
        if self.h2.is_some() {
            self.on_h2_data(ev.direction, &io, sink);
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
        let mut switched_to_h2 = None;
        let result = match ev.direction {
            Direction::Ingress => self.requests.on_read(&io, self.id, &mut self.exchanges),
            Direction::Egress => {
                if io.is_truncated() {
                    sink.truncated_write();
                }
                self.responses
                    .on_write(&io, self.id, &mut self.exchanges, &mut finished)
                    .map(|outcome| match outcome {
                        WriteOutcome::Http => {}
                        WriteOutcome::Upgraded => self.role = Role::Upgraded,
                        WriteOutcome::UpgradedH2c { rest } => switched_to_h2 = Some(rest),
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
        if let Some(rest) = switched_to_h2 {
            self.upgrade_to_h2(sink);
            self.on_h2_data(ev.direction, &io.tail(rest), sink);
        }
    }

    /// What the first bytes on a connection say the traced process is.
    fn decide_role(&mut self, direction: Direction, io: &Io<'_>, sink: &mut Sink<'_>) -> Role {
        let known = io.known;
        if http::begins_with_tls_record(known) {
            sink.ciphertext_connection();
            return Role::Ciphertext;
        }
        if direction == Direction::Egress && http::begins_with_request_line(known) {
            sink.client_connection();
            return Role::Client;
        }
        if direction == Direction::Egress && h2::begins_with_preface(known) {
            self.start_client_h2(sink);
            return Role::ClientH2;
        }
        Role::Server
    }

    /// The traced process wrote the HTTP/2 client preface: from here on it
    /// is the client of this connection.
    fn start_client_h2(&mut self, sink: &mut Sink<'_>) {
        sink.client_connection();
        self.role = Role::ClientH2;
        self.h2 = Some(Box::new(H2Conn::with_preface(
            self.id,
            Setup::default(),
            self.limits.cap,
            Arc::clone(&self.limits.id_headers),
        )));
    }

    pub(crate) fn is_ciphertext(&self) -> bool {
        self.role == Role::Ciphertext
    }

    /// Whether the traced process is the client here (its timelines are
    /// `span_kind: "client"`).
    fn is_client(&self) -> bool {
        matches!(self.role, Role::Client | Role::ClientH2)
    }

    /// An HTTP/2 client connection: its writes go to the parser as the
    /// client's frames, its reads as the server's, a read cut where its
    /// segments' arrivals change so each frame is dated by its own bytes.
    fn on_client_h2_data(&mut self, direction: Direction, io: &Io<'_>, sink: &mut Sink<'_>) {
        let Some(h2) = self.h2.as_mut() else { return };
        let mut finished = Vec::new();
        let result = match direction {
            Direction::Egress => h2.on_io(Direction::Ingress, io, sink, &mut finished),
            Direction::Ingress => io
                .by_arrival()
                .iter()
                .try_for_each(|piece| h2.on_io(Direction::Egress, piece, sink, &mut finished)),
        };
        for timeline in finished {
            self.emit(timeline, sink);
        }
        if let Err(err) = result {
            sink.parse_error(&err);
        }
    }

    /// A client connection: the process's writes are requests (started by
    /// the write of their first byte), its reads the responses, each piece
    /// of a read dated by when its bytes reached the host.
    fn on_client_data(&mut self, direction: Direction, io: &Io<'_>, sink: &mut Sink<'_>) {
        let mut finished = Vec::new();
        let result = match direction {
            Direction::Egress => self.requests.on_read(io, self.id, &mut self.exchanges),
            Direction::Ingress => {
                let mut result = Ok(());
                for piece in io.by_arrival() {
                    let outcome = self.responses.on_write(
                        &piece,
                        self.id,
                        &mut self.exchanges,
                        &mut finished,
                    );
                    match outcome {
                        Ok(WriteOutcome::Http) => {}
                        Ok(WriteOutcome::Upgraded | WriteOutcome::UpgradedH2c { .. }) => {
                            self.role = Role::Upgraded;
                            break;
                        }
                        Err(err) => {
                            result = Err(err);
                            break;
                        }
                    }
                }
                result
            }
        };
        for timeline in finished {
            self.emit(timeline, sink);
        }
        if let Err(err) = result {
            sink.parse_error(&err);
        }
    }

    /// The addresses of a client connection, keyed as the server end sees
    /// them mirrored: what the table indexes so the server's requests can
    /// find the client request they answer.
    pub(crate) fn outbound_addrs(&self) -> Option<SockAddrs> {
        self.is_client().then_some(self.addrs).flatten()
    }

    /// Whether a server connection with no HTTP/1.1 request yet is HTTP/2:
    /// its client preface is read (also over TLS: ALPN `h2`); or the server
    /// writes frames first (its SETTINGS may precede the client's preface,
    /// RFC 9113 §3.4: grpcio does this); or, on a connection that predates
    /// tracing, a syscall is a chain of frames.
    fn detect_h2(&mut self, direction: Direction, io: &Io<'_>, sink: &mut Sink<'_>) {
        let frames = || h2::looks_like_frames(io.known, io.is_truncated());
        let ids = Arc::clone(&self.limits.id_headers);
        let cap = self.limits.cap;
        let conn = if direction == Direction::Ingress && h2::begins_with_preface(io.known) {
            H2Conn::with_preface(self.id, self.exchanges.setup, cap, ids)
        } else if self.adopted && frames() {
            H2Conn::midstream(self.id, cap, ids)
        } else if direction == Direction::Egress && frames() {
            H2Conn::with_preface(self.id, self.exchanges.setup, cap, ids)
        } else {
            return;
        };
        sink.h2_connection();
        self.h2 = Some(Box::new(conn));
    }

    /// `101` + `Upgrade: h2c` was written: the request at the front of the
    /// queue becomes stream 1 of the HTTP/2 connection that follows; any
    /// other queued request cannot be answered any more.
    fn upgrade_to_h2(&mut self, sink: &mut Sink<'_>) {
        sink.h2_connection();
        let Some(request) = self.exchanges.pop_front() else {
            return;
        };
        let ids = Arc::clone(&self.limits.id_headers);
        self.h2 = Some(Box::new(H2Conn::upgraded(
            self.id,
            request,
            self.limits.cap,
            ids,
        )));
    }

    fn on_h2_data(&mut self, direction: Direction, io: &Io<'_>, sink: &mut Sink<'_>) {
        let Some(h2) = self.h2.as_mut() else { return };
        if direction == Direction::Egress && io.is_truncated() {
            sink.truncated_write();
        }
        let mut finished = Vec::new();
        let result = h2.on_io(direction, io, sink, &mut finished);
        for timeline in finished {
            self.emit(timeline, sink);
        }
        if let Err(err) = result {
            sink.parse_error(&err);
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
        let seen = observed && (!self.id.is_tls() || self.addrs.is_some());
        let reason = match (self.is_client(), self.peer.left().is_some()) {
            // a client connection's peer is the server
            (true, true) => AbortReason::ServerClosed,
            (true, false) if seen => AbortReason::ClientClosed,
            (false, true) => AbortReason::ClientClosed,
            (false, false) if seen => AbortReason::ServerClosed,
            _ => AbortReason::ConnectionClosed,
        };
        self.abort(ts, reason, sink);
    }

    /// Reports every request in flight as aborted at `end`.
    pub(crate) fn abort(mut self, end: MonoNs, reason: AbortReason, sink: &mut Sink<'_>) {
        if let Some(h2) = self.h2.as_mut() {
            for timeline in h2.drain(end, reason) {
                self.emit(timeline, sink);
            }
        }
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
        if self.is_client() {
            timeline.kind = SpanKind::Client;
        } else {
            judge_client_exit(&mut timeline, self.peer);
        }
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
