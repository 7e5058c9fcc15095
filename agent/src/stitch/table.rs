//! All tracked connections, indexed for the three ways events find them:
//! by connection, by (pid, fd) and by pid (a `BTreeMap` keyed by
//! [`ConnId`], whose order is pid, fd, inode, serves all three), plus a
//! recency index for idle expiry and eviction.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::RangeInclusive;

use crate::event::{ConnEvent, ConnId, DataEvent, MonoNs};

use super::connection::Connection;
use super::input::Io;
use super::sink::Sink;
use super::timeline::AbortReason;
use super::StitchConfig;

#[derive(Debug, Clone)]
pub(crate) struct Connections {
    map: BTreeMap<ConnId, Connection>,
    /// `(last event time, id)` of every entry in `map`, oldest first.
    by_recency: BTreeSet<(MonoNs, ConnId)>,
    config: StitchConfig,
}

impl Connections {
    pub(crate) fn new(config: StitchConfig) -> Self {
        Self {
            map: BTreeMap::new(),
            by_recency: BTreeSet::new(),
            config,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    pub(crate) fn on_data(&mut self, ev: &DataEvent, sink: &mut Sink<'_>) {
        self.retire_reused_fd(ev.conn, sink);
        let ts = Io::of(ev).ts;
        if !self.map.contains_key(&ev.conn) {
            let conn = Connection::adopted(ev, self.config.max_buffered_bytes);
            self.insert(ev.conn, conn, sink);
        }
        if let Some(conn) = self.touch(ev.conn, ts) {
            conn.on_data(ev, sink);
        }
    }

    pub(crate) fn on_accept(&mut self, ev: &ConnEvent, sink: &mut Sink<'_>) {
        self.retire_reused_fd(ev.conn, sink);
        if self.touch(ev.conn, ev.ts).is_none() {
            let conn = Connection::accepted(ev, self.config.max_buffered_bytes);
            self.insert(ev.conn, conn, sink);
        }
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
                conn.close(ev.ts, sink);
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
        while let Some(&(last, id)) = self.by_recency.first() {
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
        for conn in std::mem::take(&mut self.map).into_values() {
            conn.abort(now, AbortReason::AgentStopped, sink);
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
                    conn.close(last, sink);
                }
            }
        }
    }

    /// Adds a connection, first evicting the least recently active ones if
    /// the table is full.
    fn insert(&mut self, id: ConnId, conn: Connection, sink: &mut Sink<'_>) {
        while self.map.len() >= self.config.max_connections.max(1) {
            let Some(&(last, oldest)) = self.by_recency.first() else {
                break;
            };
            if let Some(evicted) = self.remove(oldest) {
                sink.evicted_connection();
                evicted.abort(last, AbortReason::Idle, sink);
            }
        }
        self.by_recency.insert((conn.last_ts, id));
        self.map.insert(id, conn);
    }

    /// Records activity at `ts` (events may be slightly out of order; the
    /// latest time wins).
    fn touch(&mut self, id: ConnId, ts: MonoNs) -> Option<&mut Connection> {
        let conn = self.map.get_mut(&id)?;
        if ts > conn.last_ts {
            self.by_recency.remove(&(conn.last_ts, id));
            conn.last_ts = ts;
            self.by_recency.insert((ts, id));
        }
        Some(conn)
    }

    fn remove(&mut self, id: ConnId) -> Option<Connection> {
        let conn = self.map.remove(&id)?;
        self.by_recency.remove(&(conn.last_ts, id));
        Some(conn)
    }

    fn ids(&self, range: RangeInclusive<ConnId>) -> Vec<ConnId> {
        self.map.range(range).map(|(id, _)| *id).collect()
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
