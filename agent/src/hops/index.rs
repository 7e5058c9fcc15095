//! Finding a request's possible relatives without walking every request
//! held or recently gone out: each is filed under the keys that can tie it
//! (its connection's ends, the values it carried), so one finished request
//! costs a few lookups whatever the request rate.

use std::collections::HashMap;
use std::hash::Hash;
use std::net::SocketAddr;

use super::keys;
use crate::model::trace_context::RemoteParent;
use crate::model::RequestTimeline;

/// Most requests remembered under one key. A key that this many requests
/// share is a connection reused for requests one after another (only the
/// latest can be the one in flight) or an id the gateway stamps on
/// everything (ambiguous with two): the oldest are forgotten by the index,
/// so a lookup costs at most this many comparisons.
pub(super) const MAX_PER_KEY: usize = 64;

/// A client connection's ends, (local, remote), IPv4-mapped addresses as
/// IPv4; a server request is filed and found under its connection's ends
/// mirrored, so both ends of one connection meet under one key.
pub(super) type Ends = (SocketAddr, SocketAddr);

/// A value a gateway can carry from its inbound request to the outbound
/// one it caused, scoped to the process (only a process's own requests
/// join inside it).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) enum Carried {
    Trace(u32, [u8; 16]),
    Header(u32, String, String),
    Response(u32, String),
    FirstEvent(u32, u64),
}

/// The client's view of `t`'s connection: its own ends for a client
/// request, mirrored for a server request.
pub(super) fn client_ends(t: &RequestTimeline) -> Option<Ends> {
    let (local, remote) = keys::ends(t)?;
    Some(match t.kind {
        crate::model::SpanKind::Client => (local, remote),
        crate::model::SpanKind::Server => (remote, local),
    })
}

/// Every value `t` carries that [`keys::carried_over`] or
/// [`keys::same_value`] can match on.
pub(super) fn carried(t: &RequestTimeline) -> Vec<Carried> {
    let pid = t.conn.pid;
    let mut out = Vec::new();
    if let Some(p) = t
        .traceparent
        .as_deref()
        .and_then(|tp| RemoteParent::parse(tp, None))
    {
        out.push(Carried::Trace(pid, p.trace_id));
    }
    for (name, value) in &t.request_headers {
        if !value.is_empty() {
            out.push(Carried::Header(pid, name.clone(), value.clone()));
        }
    }
    if let Some(id) = t.response_id.as_ref().filter(|id| !id.is_empty()) {
        out.push(Carried::Response(pid, id.clone()));
    }
    if let Some(h) = t.first_event_hash {
        out.push(Carried::FirstEvent(pid, h));
    }
    out
}

/// Request ids (the stage's own numbering, oldest first) filed by key.
#[derive(Debug)]
pub(super) struct Index<K> {
    by_key: HashMap<K, Vec<u64>>,
}

impl<K: Eq + Hash + Clone> Default for Index<K> {
    fn default() -> Self {
        Self {
            by_key: HashMap::new(),
        }
    }
}

impl<K: Eq + Hash + Clone> Index<K> {
    pub(super) fn insert(&mut self, key: K, id: u64) {
        let ids = self.by_key.entry(key).or_default();
        if ids.len() >= MAX_PER_KEY {
            ids.remove(0);
        }
        ids.push(id);
    }

    pub(super) fn remove(&mut self, key: &K, id: u64) {
        if let Some(ids) = self.by_key.get_mut(key) {
            ids.retain(|&i| i != id);
            if ids.is_empty() {
                self.by_key.remove(key);
            }
        }
    }

    pub(super) fn get(&self, key: &K) -> &[u64] {
        self.by_key.get(key).map_or(&[], Vec::as_slice)
    }

    /// The ids filed under any of `keys`, each once, oldest first.
    pub(super) fn any_of<'a>(&self, keys: impl IntoIterator<Item = &'a K>) -> Vec<u64>
    where
        K: 'a,
    {
        let mut ids: Vec<u64> = keys
            .into_iter()
            .flat_map(|k| self.get(k).iter().copied())
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_remembers_its_latest_requests_and_lookups_stay_bounded() {
        let mut index = Index::default();
        for id in 0..(MAX_PER_KEY as u64 + 5) {
            index.insert("conn", id);
        }
        let ids = index.get(&"conn");
        assert_eq!(ids.len(), MAX_PER_KEY);
        assert_eq!(ids.first(), Some(&5), "the oldest were forgotten");
        index.insert("other", 10);
        index.insert("other", 70);
        // 10 is under both keys, counted once
        assert_eq!(index.any_of([&"conn", &"other"]).len(), MAX_PER_KEY + 1);
        for id in 0..100 {
            index.remove(&"conn", id);
        }
        assert!(index.get(&"conn").is_empty());
        assert_eq!(index.by_key.len(), 1, "empty keys are dropped");
    }
}
