//! The hop join: finished requests of one serving path (a gateway's
//! inbound request, the upstream call it made, the engine's request that
//! answered it) put into one trace, with the ids every JSON line and span
//! carries. See `design.md`, "Hops".
//!
//! Requests finish innermost first: the engine writes its last chunk, the
//! gateway reads it (its client request ends), then the gateway finishes
//! its own response. So a request that may have a parent is held until the
//! parent finishes, and the whole tree gets its ids when its root does:
//!
//! - an engine request whose peer is a traced client connection
//!   ([`Hops::push`]'s `answers_traced_client`) waits for that client
//!   request, joined by the TCP 4-tuple ([`JoinKey::Tcp4tuple`]);
//! - a client request waits for the inbound request of its process that
//!   carried over a key ([`keys::carried_over`]).
//!
//! A held request whose parent does not come within [`HOLD_NS`] (a
//! gateway that forwards nothing the agent can match, a client request
//! made on its own) goes out as a root, counted unjoined: never joined on
//! timing alone. A key that two candidates share joins neither.

mod index;
mod keys;

use std::collections::BTreeMap;

use serde::Serialize;

use crate::event::MonoNs;
use crate::model::trace_context::{IdGenerator, RemoteParent};
use crate::model::{JoinKey, RequestTimeline, SpanKind, TraceIds, UpstreamView};
use index::{carried, client_ends, Carried, Ends, Index};

/// How long a request waits for its parent after it finished: a gateway
/// finishes its response a few ms after its upstream call ends; one that
/// makes several calls in turn may take longer.
pub const HOLD_NS: u64 = 10_000_000_000;

/// Most requests held at once; past it the oldest goes out unjoined, so a
/// flood of unjoinable client requests costs bounded memory.
pub const MAX_HELD: usize = 8192;

/// Finished parents kept for requests that finish after them (a gateway
/// that gave up on its upstream call before it ended).
const MAX_RECENT: usize = 4096;

/// Counters since the stage was created.
#[derive(Debug, Default, Clone, Serialize)]
pub struct HopStats {
    /// Requests tied to their parent hop, by the key that tied them.
    pub joined_tcp_4tuple: u64,
    pub joined_traceparent: u64,
    pub joined_request_id: u64,
    pub joined_response_id: u64,
    pub joined_first_event: u64,
    /// Client requests whose inbound request was never found: their own
    /// trace's root.
    pub unjoined_client_requests: u64,
    /// Server requests that answered a traced client whose request was
    /// never found.
    pub unjoined_server_requests: u64,
    /// Joins refused because two candidates shared the key.
    pub ambiguous: u64,
}

/// A held request and what it caused, already tied to it.
#[derive(Debug)]
struct Node {
    t: RequestTimeline,
    /// The key that tied it to its parent, once it has one.
    key: Option<JoinKey>,
    children: Vec<Node>,
    /// When it began to wait (its end).
    held_at: MonoNs,
}

impl Node {
    fn new(t: RequestTimeline) -> Self {
        Self {
            held_at: t.end,
            t,
            key: None,
            children: Vec::new(),
        }
    }
}

/// A request that went out and may still be a parent.
#[derive(Debug)]
struct Recent {
    t: RequestTimeline,
    ids: TraceIds,
}

/// Something with a request in it, filed by [`Store`].
trait HasTimeline {
    fn timeline(&self) -> &RequestTimeline;
}

impl HasTimeline for Node {
    fn timeline(&self) -> &RequestTimeline {
        &self.t
    }
}

impl HasTimeline for Recent {
    fn timeline(&self) -> &RequestTimeline {
        &self.t
    }
}

/// An entry and the keys it is filed under (kept to unfile it).
#[derive(Debug)]
struct Filed<T> {
    item: T,
    ends: Option<Ends>,
    values: Vec<Carried>,
}

/// Requests in arrival order (by the stage's own numbering), filed by
/// connection and by the values they carry.
#[derive(Debug)]
struct Store<T> {
    items: BTreeMap<u64, Filed<T>>,
    by_conn: Index<Ends>,
    by_value: Index<Carried>,
}

impl<T> Default for Store<T> {
    fn default() -> Self {
        Self {
            items: BTreeMap::new(),
            by_conn: Index::default(),
            by_value: Index::default(),
        }
    }
}

impl<T: HasTimeline> Store<T> {
    /// Files `item` under what it carries, and under its connection when
    /// `by_conn` (only what a lookup by connection may want: filing an
    /// engine's own requests there would crowd out its clients').
    fn insert(&mut self, id: u64, item: T, by_conn: bool) {
        let t = item.timeline();
        let ends = client_ends(t).filter(|_| by_conn);
        let values = carried(t);
        if let Some(e) = ends {
            self.by_conn.insert(e, id);
        }
        for v in &values {
            self.by_value.insert(v.clone(), id);
        }
        self.items.insert(id, Filed { item, ends, values });
    }

    fn remove(&mut self, id: u64) -> Option<T> {
        let filed = self.items.remove(&id)?;
        if let Some(e) = &filed.ends {
            self.by_conn.remove(e, id);
        }
        for v in &filed.values {
            self.by_value.remove(v, id);
        }
        Some(filed.item)
    }

    fn get(&self, id: u64) -> Option<&T> {
        self.items.get(&id).map(|f| &f.item)
    }

    fn get_mut(&mut self, id: u64) -> Option<&mut T> {
        self.items.get_mut(&id).map(|f| &mut f.item)
    }

    /// What `id` was filed under by value.
    fn values_of(&self, id: u64) -> &[Carried] {
        self.items.get(&id).map_or(&[], |f| f.values.as_slice())
    }

    fn oldest(&self) -> Option<(u64, &T)> {
        self.items.first_key_value().map(|(&id, f)| (id, &f.item))
    }

    fn len(&self) -> usize {
        self.items.len()
    }

    /// Ids filed under the connection `ends`, oldest first.
    fn on_conn(&self, ends: Option<Ends>) -> Vec<u64> {
        ends.map_or_else(Vec::new, |e| self.by_conn.get(&e).to_vec())
    }

    /// Ids filed under any of `values`, each once, oldest first.
    fn sharing(&self, values: &[Carried]) -> Vec<u64> {
        self.by_value.any_of(values)
    }

    /// Removes and returns, oldest first, what `due` holds for from the
    /// front (entries are numbered as they come, so in about the order
    /// they finished).
    fn pop_due(&mut self, due: impl Fn(&T) -> bool) -> Vec<T> {
        let mut out = Vec::new();
        while let Some((id, item)) = self.oldest() {
            if !due(item) {
                break;
            }
            out.extend(self.remove(id));
        }
        out
    }
}

#[derive(Debug)]
pub struct Hops {
    ids: IdGenerator,
    /// The number the next stored request gets.
    next: u64,
    /// Server requests waiting for the client request they answered.
    engines: Store<Node>,
    /// Client requests waiting for the inbound request that caused them.
    clients: Store<Node>,
    recent: Store<Recent>,
    stats: HopStats,
}

impl Hops {
    pub fn new(ids: IdGenerator) -> Self {
        Self {
            ids,
            next: 0,
            engines: Store::default(),
            clients: Store::default(),
            recent: Store::default(),
            stats: HopStats::default(),
        }
    }

    pub fn stats(&self) -> &HopStats {
        &self.stats
    }

    fn number(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    /// Takes one finished request; what can go out now (with its ids, and
    /// what it held) is appended to `out`. `answers_traced_client`: the far
    /// end of its connection is a traced process's client connection.
    pub fn push(
        &mut self,
        t: RequestTimeline,
        answers_traced_client: bool,
        out: &mut Vec<RequestTimeline>,
    ) {
        let mut node = Node::new(t);
        match node.t.kind {
            SpanKind::Client => {
                for id in self.engines.on_conn(client_ends(&node.t)) {
                    let answers = self
                        .engines
                        .get(id)
                        .is_some_and(|e| keys::same_connection(&node.t, &e.t));
                    if let Some(mut e) = answers.then(|| self.engines.remove(id)).flatten() {
                        e.key = Some(JoinKey::Tcp4tuple);
                        node.children.push(e);
                    }
                }
                let candidates = self.recent.sharing(&carried(&node.t));
                match self.recent_parent(&node.t, candidates, keys::carried_over) {
                    Some((id, key)) => self.emit_under(id, node, key, out),
                    None => self.hold(node, true, out),
                }
            }
            SpanKind::Server => {
                self.adopt_clients(&mut node);
                let ends = client_ends(&node.t);
                let candidates = self.recent.on_conn(ends);
                let parent = self.recent_parent(&node.t, candidates, |p, s| {
                    (p.kind == SpanKind::Client && keys::same_connection(p, s))
                        .then_some(JoinKey::Tcp4tuple)
                });
                let held_client = self.clients.on_conn(ends).into_iter().find(|&id| {
                    self.clients
                        .get(id)
                        .is_some_and(|c| keys::same_connection(&c.t, &node.t))
                });
                if let Some((id, key)) = parent {
                    self.emit_under(id, node, key, out);
                } else if let Some(c) = held_client.and_then(|id| self.clients.get_mut(id)) {
                    node.key = Some(JoinKey::Tcp4tuple);
                    c.children.push(node);
                } else if answers_traced_client {
                    self.hold(node, false, out);
                } else {
                    self.emit_root(node, out);
                }
            }
        }
    }

    /// Releases what waited past [`HOLD_NS`] at `now`, unjoined.
    pub fn expire(&mut self, now: MonoNs, out: &mut Vec<RequestTimeline>) {
        let due = |n: &Node| now.saturating_sub(n.held_at) >= HOLD_NS;
        for node in self.engines.pop_due(due) {
            self.stats.unjoined_server_requests += 1;
            self.emit_root(node, out);
        }
        for node in self.clients.pop_due(due) {
            self.stats.unjoined_client_requests += 1;
            self.emit_root(node, out);
        }
        let keep_from = now.saturating_sub(HOLD_NS);
        self.recent.pop_due(|r| r.t.end < keep_from);
    }

    /// The agent stops: everything held goes out.
    pub fn flush(&mut self, out: &mut Vec<RequestTimeline>) {
        self.expire(MonoNs::MAX, out);
    }

    /// A server request takes the held client requests of its process
    /// that carried one of its keys over. A key another inbound request
    /// (finished earlier, still in the window) also ties, or that another
    /// outbound request in flight at the same time also carries (a
    /// gateway that stamps one id on everything), joins nothing.
    fn adopt_clients(&mut self, node: &mut Node) {
        let inbound = &node.t;
        let mut picked = Vec::new();
        for id in self.clients.sharing(&carried(inbound)) {
            let Some(c) = self.clients.get(id) else {
                continue;
            };
            let Some(key) = keys::carried_over(inbound, &c.t) else {
                continue;
            };
            let values = self.clients.values_of(id);
            let rival = self.recent.sharing(values).into_iter().any(|r| {
                self.recent.get(r).is_some_and(|r| {
                    (r.t.kind == SpanKind::Server && keys::carried_over(&r.t, &c.t) == Some(key))
                        || (r.t.kind == SpanKind::Client
                            && keys::overlap(&r.t, &c.t)
                            && keys::same_value(key, &r.t, &c.t))
                })
            });
            let twin = self.clients.sharing(values).into_iter().any(|j| {
                j != id
                    && self.clients.get(j).is_some_and(|o| {
                        keys::overlap(&o.t, &c.t) && keys::same_value(key, &o.t, &c.t)
                    })
            });
            if rival || twin {
                self.stats.ambiguous += 1;
            } else {
                picked.push((id, key));
            }
        }
        let mut adopted: Vec<Node> = picked
            .into_iter()
            .filter_map(|(id, key)| {
                let mut c = self.clients.remove(id)?;
                c.key = Some(key);
                Some(c)
            })
            .collect();
        adopted.sort_by_key(|c| c.t.request_start);
        if let Some(first) = adopted.first() {
            node.t.upstream = Some(upstream_view(&node.t, &first.t));
        }
        node.children.extend(adopted);
    }

    /// The one recent request among `candidates` that `key_of` ties `t`
    /// to; `None` when none does, or more than one (counted ambiguous).
    fn recent_parent(
        &mut self,
        t: &RequestTimeline,
        candidates: Vec<u64>,
        key_of: impl Fn(&RequestTimeline, &RequestTimeline) -> Option<JoinKey>,
    ) -> Option<(u64, JoinKey)> {
        let found: Vec<(u64, JoinKey)> = candidates
            .into_iter()
            .filter_map(|id| key_of(&self.recent.get(id)?.t, t).map(|k| (id, k)))
            .take(2)
            .collect();
        match found.as_slice() {
            [one] => Some(*one),
            [] => None,
            _ => {
                self.stats.ambiguous += 1;
                None
            }
        }
    }

    fn hold(&mut self, node: Node, client: bool, out: &mut Vec<RequestTimeline>) {
        if self.engines.len() + self.clients.len() >= MAX_HELD {
            // the oldest held request of either kind goes out unjoined
            let oldest_client = self.clients.oldest().map(|(id, n)| (n.held_at, id));
            let oldest_engine = self.engines.oldest().map(|(id, n)| (n.held_at, id));
            match (oldest_client, oldest_engine) {
                (Some(c), e) if e.is_none_or(|e| c.0 <= e.0) => {
                    if let Some(n) = self.clients.remove(c.1) {
                        self.stats.unjoined_client_requests += 1;
                        self.emit_root(n, out);
                    }
                }
                (_, Some(e)) => {
                    if let Some(n) = self.engines.remove(e.1) {
                        self.stats.unjoined_server_requests += 1;
                        self.emit_root(n, out);
                    }
                }
                _ => {}
            }
        }
        let id = self.number();
        if client {
            self.clients.insert(id, node, true);
        } else {
            self.engines.insert(id, node, true);
        }
    }

    /// `node` joins the trace of the recent request `id` by `key`.
    fn emit_under(
        &mut self,
        id: u64,
        mut node: Node,
        key: JoinKey,
        out: &mut Vec<RequestTimeline>,
    ) {
        node.key = Some(key);
        let Some(parent) = self.recent.get(id).map(|r| r.ids.clone()) else {
            self.emit_root(node, out);
            return;
        };
        self.emit_tree(node, Some(&parent), out);
    }

    /// `node` starts its trace: its caller's (`traceparent`) or a new one.
    fn emit_root(&mut self, node: Node, out: &mut Vec<RequestTimeline>) {
        self.emit_tree(node, None, out);
    }

    fn emit_tree(
        &mut self,
        mut node: Node,
        parent: Option<&TraceIds>,
        out: &mut Vec<RequestTimeline>,
    ) {
        let ids = match parent {
            Some(p) => {
                self.count_join(node.key);
                TraceIds {
                    trace_id: p.trace_id,
                    span_id: self.ids.span_id(),
                    parent_span_id: Some(p.span_id),
                    parent_remote: false,
                    flags: p.flags,
                    tracestate: p.tracestate.clone(),
                    join_key: node.key,
                }
            }
            None => self.root_ids(&node.t),
        };
        node.t.trace = Some(ids.clone());
        let children = std::mem::take(&mut node.children);
        let may_parent = node.t.kind == SpanKind::Client || node.t.addrs.is_some();
        // What is kept to join later hops by needs no chunk times (only
        // upstream_view reads them, of requests still held): the copy that
        // goes out takes them instead of a clone (a streaming response's
        // list, cloned per request, was ~2 % of the agent under the node
        // flood with its allocation and page faults).
        let chunk_ts = std::mem::take(&mut node.t.chunk_ts);
        let mut emitted = node.t.clone();
        emitted.chunk_ts = chunk_ts;
        out.push(emitted);
        if may_parent {
            if self.recent.len() >= MAX_RECENT {
                if let Some((oldest, _)) = self.recent.oldest() {
                    self.recent.remove(oldest);
                }
            }
            // only client lines are looked up by connection (a server
            // request's parent is the client request on its connection)
            let by_conn = node.t.kind == SpanKind::Client;
            let id = self.number();
            self.recent.insert(
                id,
                Recent {
                    t: node.t,
                    ids: ids.clone(),
                },
                by_conn,
            );
        }
        for child in children {
            self.emit_tree(child, Some(&ids), out);
        }
    }

    fn root_ids(&mut self, t: &RequestTimeline) -> TraceIds {
        let caller = t
            .traceparent
            .as_deref()
            .and_then(|tp| RemoteParent::parse(tp, t.tracestate.as_deref()));
        match caller {
            Some(p) => TraceIds {
                trace_id: p.trace_id,
                span_id: self.ids.span_id(),
                parent_span_id: Some(p.span_id),
                parent_remote: true,
                flags: p.flags,
                tracestate: p.tracestate,
                join_key: None,
            },
            None => TraceIds {
                trace_id: self.ids.trace_id(),
                span_id: self.ids.span_id(),
                parent_span_id: None,
                parent_remote: false,
                flags: 1,
                tracestate: None,
                join_key: None,
            },
        }
    }

    fn count_join(&mut self, key: Option<JoinKey>) {
        let slot = match key {
            Some(JoinKey::Tcp4tuple) => &mut self.stats.joined_tcp_4tuple,
            Some(JoinKey::Traceparent) => &mut self.stats.joined_traceparent,
            Some(JoinKey::RequestId) => &mut self.stats.joined_request_id,
            Some(JoinKey::ResponseId) => &mut self.stats.joined_response_id,
            Some(JoinKey::FirstEvent) => &mut self.stats.joined_first_event,
            None => return,
        };
        *slot += 1;
    }
}

/// Where a gateway request's first token's time went, from its first
/// upstream call.
fn upstream_view(gateway: &RequestTimeline, upstream: &RequestTimeline) -> UpstreamView {
    let first = |t: &RequestTimeline| t.ttft_ns().map(|d| t.request_start + d);
    let upstream_first = first(upstream);
    let gateway_first = first(gateway);
    let delays: Option<Vec<u64>> = (gateway.chunk_ts.len() == upstream.chunk_ts.len()
        && !gateway.chunk_ts.is_empty())
    .then(|| {
        let mut d: Vec<u64> = gateway
            .chunk_ts
            .iter()
            .zip(&upstream.chunk_ts)
            .map(|(g, u)| g.saturating_sub(*u))
            .collect();
        d.sort_unstable();
        d
    });
    UpstreamView {
        wait_ns: upstream.request_start.saturating_sub(gateway.request_start),
        ttft_ns: upstream.ttft_ns(),
        delivery_ns: upstream_first
            .zip(gateway_first)
            .map(|(u, g)| g.saturating_sub(u)),
        chunk_delay_p50_ns: delays.as_ref().map(|d| d[(d.len() - 1) / 2]),
        chunk_delay_max_ns: delays.as_ref().and_then(|d| d.last().copied()),
        peer: upstream.addrs.map(|a| a.remote),
    }
}

#[cfg(test)]
mod tests;
