//! All tracked connections, indexed for the three ways events find them:
//! by connection (a hash map: every data event looks its connection up),
//! by (pid, fd) and by pid (a `BTreeSet` of [`ConnId`]s, whose order is
//! pid, fd, inode, serves both, and orders what the table reports), plus
//! a recency index for idle expiry and eviction.
//!
//! A non-TLS (pid, fd) holds at most one connection: every insert first
//! retires the fd's other sockets. So an event whose connection is known
//! has nothing to retire and costs one hash lookup.
//!
//! The recency index is updated lazily: an event only moves its
//! connection's `last_ts`, and an entry found stale at the front of the
//! index (its connection was active since) is re-filed under the true time
//! before anything is decided from it. Every entry's time is at most its
//! connection's true one, so the front, once fresh, is the least recently
//! active connection, as an index updated on every event would say, at a
//! fraction of the cost (two B-tree updates per event otherwise).

use std::collections::BTreeSet;
use std::net::SocketAddr;

use foldhash::HashMap;
use std::ops::RangeInclusive;

use crate::event::{ConnEvent, ConnId, DataEvent, MonoNs, PeerClosedEvent, TlsHandshakeEvent};

use super::connection::{Connection, Limits};
use super::exchange::Setup;
use super::input::Io;
use super::sink::Sink;
use super::timeline::AbortReason;
use super::StitchConfig;
use crate::model::OpenRequest;

#[derive(Debug, Clone)]
pub(crate) struct Connections {
    map: HashMap<ConnId, Connection>,
    /// The keys of `map`, in order.
    ids: BTreeSet<ConnId>,
    /// `(time filed under, id)` of every entry in `map`, oldest first; the
    /// time is the connection's `recency_ts`, at most its `last_ts`.
    by_recency: BTreeSet<(MonoNs, ConnId)>,
    /// Client connections by their (local, remote) endpoints: a server
    /// request whose peer is one of them answers a traced client.
    outbound: HashMap<TcpEnds, ConnId>,
    config: StitchConfig,
    limits: Limits,
}

impl Connections {
    pub(crate) fn new(config: StitchConfig) -> Self {
        let limits = Limits {
            cap: config.max_buffered_bytes,
            id_headers: config.request_id_headers.clone(),
        };
        Self {
            map: HashMap::default(),
            ids: BTreeSet::new(),
            by_recency: BTreeSet::new(),
            outbound: HashMap::default(),
            config,
            limits,
        }
    }

    /// Appends every unfinished request, connections in id order.
    pub(crate) fn open_requests(&self, out: &mut Vec<OpenRequest>) {
        for id in &self.ids {
            if let Some(conn) = self.map.get(id) {
                conn.open_requests(out);
            }
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Returns whether the connection carries TLS records (its plaintext
    /// is a connection of its own), as it stands after these bytes: known
    /// here without a second lookup.
    pub(crate) fn on_data(&mut self, ev: &DataEvent, sink: &mut Sink<'_>) -> bool {
        let ts = Io::of(ev).ts;
        let seen = |conn: &mut Connection, sink: &mut Sink<'_>| {
            conn.on_data(ev, sink);
            (conn.outbound_addrs(), conn.is_ciphertext())
        };
        let (outbound, ciphertext) = if let Some(conn) = self.touch(ev.conn, ts) {
            seen(conn, sink)
        } else {
            self.retire_reused_fd(ev.conn, sink);
            if !self.map.contains_key(&ev.conn) {
                let conn = Connection::adopted(ev, &self.limits);
                self.insert(ev.conn, conn, sink);
            }
            self.touch(ev.conn, ts)
                .map_or((None, false), |conn| seen(conn, sink))
        };
        if let Some(addrs) = outbound {
            self.outbound
                .entry(TcpEnds::of(addrs.local, addrs.remote))
                .or_insert(ev.conn);
        }
        ciphertext
    }

    /// Whether a traced client connection has `local` and `remote` as its
    /// own local and remote endpoints.
    pub(crate) fn has_outbound(&self, local: SocketAddr, remote: SocketAddr) -> bool {
        self.outbound.contains_key(&TcpEnds::of(local, remote))
    }

    pub(crate) fn on_accept(&mut self, ev: &ConnEvent, sink: &mut Sink<'_>) {
        self.retire_reused_fd(ev.conn, sink);
        if self.touch(ev.conn, ev.ts).is_none() {
            let conn = Connection::accepted(ev, &self.limits);
            self.insert(ev.conn, conn, sink);
        }
    }

    /// The client ended a socket: the connection on it, and a TLS connection
    /// of the same process on the same TCP endpoints (a TLS connection is
    /// keyed by its `SSL*`; its addresses tie it to the socket).
    pub(crate) fn on_peer_closed(&mut self, ev: &PeerClosedEvent) {
        if let Some(conn) = self.map.get_mut(&ev.conn) {
            conn.peer_closed(ev.ts, ev.reason);
        }
        let Some(addrs) = ev.addrs else { return };
        for id in self.ids(fd_range(ev.conn.pid, ConnId::TLS_FD)) {
            if let Some(conn) = self.map.get_mut(&id) {
                if conn.addrs() == Some(addrs) {
                    conn.peer_closed(ev.ts, ev.reason);
                }
            }
        }
    }

    /// A TLS handshake completed: the TLS connection starts here, charged
    /// with the handshake and with its socket's accept wait.
    pub(crate) fn on_tls_handshake(&mut self, ev: &TlsHandshakeEvent, sink: &mut Sink<'_>) {
        if self.touch(ev.conn, ev.ts).is_some() {
            return; // a renegotiation, or a handshake call after data
        }
        let accept_wait_ns = ev.socket_fd.and_then(|fd| {
            self.ids(fd_range(ev.conn.pid, fd))
                .iter()
                .find_map(|id| self.map.get(id).and_then(Connection::accept_wait_ns))
        });
        let setup = Setup {
            accept_wait_ns,
            tls_handshake_ns: ev.first_byte.filter(|&t| t <= ev.ts).map(|t| ev.ts - t),
        };
        let conn = Connection::handshaken(ev.conn, ev.addrs, ev.ts, setup, &self.limits);
        self.insert(ev.conn, conn, sink);
    }

    /// The fd was closed: whatever it held, under any inode, is done. For
    /// a TLS connection (SSL_free) only that `SSL*` is.
    pub(crate) fn on_close(&mut self, ev: &ConnEvent, sink: &mut Sink<'_>) {
        let ids = if ev.conn.is_tls() {
            vec![ev.conn]
        } else {
            self.ids(fd_range(ev.conn.pid, ev.conn.fd))
        };
        for id in ids {
            if let Some(conn) = self.remove(id) {
                conn.close(ev.ts, true, sink);
            }
        }
    }

    pub(crate) fn on_exit(&mut self, pid: u32, ts: MonoNs, sink: &mut Sink<'_>) {
        for id in self.ids(pid_range(pid)) {
            if let Some(conn) = self.remove(id) {
                conn.abort(ts, AbortReason::ProcessExited, sink);
            }
        }
    }

    /// Drops connections idle since before `cutoff`. Requests in flight end
    /// at the connection's last event, not at `cutoff`: nothing is known to
    /// have happened after it, and an end at expiry time would make the
    /// idle limit part of every such request's latency.
    pub(crate) fn expire(&mut self, cutoff: MonoNs, sink: &mut Sink<'_>) {
        while let Some((last, id)) = self.least_recent() {
            if last >= cutoff {
                break;
            }
            if let Some(conn) = self.remove(id) {
                conn.abort(last, AbortReason::Idle, sink);
            }
        }
    }

    pub(crate) fn finish(&mut self, now: MonoNs, sink: &mut Sink<'_>) {
        self.by_recency.clear();
        self.outbound.clear();
        let mut map = std::mem::take(&mut self.map);
        for id in std::mem::take(&mut self.ids) {
            if let Some(conn) = map.remove(&id) {
                conn.abort(now, AbortReason::AgentStopped, sink);
            }
        }
    }

    pub(crate) fn forget_process(&mut self, pid: u32) {
        for id in self.ids(pid_range(pid)) {
            self.remove(id);
        }
    }

    /// A new socket on a (pid, fd) we track under another inode: the old
    /// one was closed without us seeing it. It is closed at its last event,
    /// the latest time it is known to have been open.
    /// TLS connections have no fd: a reused `SSL*` is preceded by SSL_free.
    fn retire_reused_fd(&mut self, id: ConnId, sink: &mut Sink<'_>) {
        if id.is_tls() {
            return;
        }
        for old in self.ids(fd_range(id.pid, id.fd)) {
            if old != id {
                if let Some(conn) = self.remove(old) {
                    let last = conn.last_ts;
                    conn.close(last, false, sink);
                }
            }
        }
    }

    /// Adds a connection, first evicting the least recently active ones if
    /// the table is full.
    fn insert(&mut self, id: ConnId, conn: Connection, sink: &mut Sink<'_>) {
        while self.map.len() >= self.config.max_connections.max(1) {
            let Some((last, oldest)) = self.least_recent() else {
                break;
            };
            if let Some(evicted) = self.remove(oldest) {
                sink.evicted_connection();
                evicted.abort(last, AbortReason::Idle, sink);
            }
        }
        let mut conn = conn;
        conn.recency_ts = conn.last_ts;
        self.by_recency.insert((conn.recency_ts, id));
        self.ids.insert(id);
        self.map.insert(id, conn);
    }

    /// The least recently active connection and its last event time,
    /// re-filing stale index entries on the way.
    fn least_recent(&mut self) -> Option<(MonoNs, ConnId)> {
        loop {
            let &(filed, id) = self.by_recency.first()?;
            let Some(conn) = self.map.get_mut(&id) else {
                // Not reachable: entries leave the index with their
                // connection. Dropped rather than looped on.
                self.by_recency.remove(&(filed, id));
                continue;
            };
            if conn.last_ts == filed {
                return Some((filed, id));
            }
            self.by_recency.remove(&(filed, id));
            conn.recency_ts = conn.last_ts;
            self.by_recency.insert((conn.last_ts, id));
        }
    }

    /// Records activity at `ts` (events may be slightly out of order; the
    /// latest time wins). The recency index catches up lazily.
    fn touch(&mut self, id: ConnId, ts: MonoNs) -> Option<&mut Connection> {
        let conn = self.map.get_mut(&id)?;
        conn.last_ts = conn.last_ts.max(ts);
        Some(conn)
    }

    fn remove(&mut self, id: ConnId) -> Option<Connection> {
        let conn = self.map.remove(&id)?;
        if let Some(addrs) = conn.outbound_addrs() {
            let ends = TcpEnds::of(addrs.local, addrs.remote);
            if self.outbound.get(&ends) == Some(&id) {
                self.outbound.remove(&ends);
            }
        }
        self.ids.remove(&id);
        self.by_recency.remove(&(conn.recency_ts, id));
        Some(conn)
    }

    fn ids(&self, range: RangeInclusive<ConnId>) -> Vec<ConnId> {
        self.ids.range(range).copied().collect()
    }
}

/// A TCP connection's (local, remote) endpoints, IPv4-mapped IPv6
/// addresses as IPv4: a dual-stack listener sees `::ffff:127.0.0.1` where
/// its client connected from `127.0.0.1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct TcpEnds(SocketAddr, SocketAddr);

impl TcpEnds {
    fn of(local: SocketAddr, remote: SocketAddr) -> Self {
        let canon = |a: SocketAddr| SocketAddr::new(a.ip().to_canonical(), a.port());
        Self(canon(local), canon(remote))
    }
}

fn fd_range(pid: u32, fd: i32) -> RangeInclusive<ConnId> {
    ConnId {
        pid,
        fd,
        sock_ino: 0,
    }..=ConnId {
        pid,
        fd,
        sock_ino: u64::MAX,
    }
}

fn pid_range(pid: u32) -> RangeInclusive<ConnId> {
    ConnId {
        pid,
        fd: i32::MIN,
        sock_ino: 0,
    }..=ConnId {
        pid,
        fd: i32::MAX,
        sock_ino: u64::MAX,
    }
}
