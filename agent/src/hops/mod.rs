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

mod keys;

use std::collections::VecDeque;

use serde::Serialize;

use crate::event::MonoNs;
use crate::model::trace_context::{IdGenerator, RemoteParent};
use crate::model::{JoinKey, RequestTimeline, SpanKind, TraceIds, UpstreamView};

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

#[derive(Debug)]
pub struct Hops {
    ids: IdGenerator,
    /// Server requests waiting for the client request they answered.
    engines: Vec<Node>,
    /// Client requests waiting for the inbound request that caused them.
    clients: Vec<Node>,
    recent: VecDeque<Recent>,
    stats: HopStats,
}

impl Hops {
    pub fn new(ids: IdGenerator) -> Self {
        Self {
            ids,
            engines: Vec::new(),
            clients: Vec::new(),
            recent: VecDeque::new(),
            stats: HopStats::default(),
        }
    }

    pub fn stats(&self) -> &HopStats {
        &self.stats
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
                node.children =
                    take_where(&mut self.engines, |e| keys::same_connection(&node.t, &e.t));
                for child in &mut node.children {
                    child.key = Some(JoinKey::Tcp4tuple);
                }
                match self.recent_parent(&node.t, keys::carried_over) {
                    Some((i, key)) => self.emit_under(i, node, key, out),
                    None => self.hold(node, true, out),
                }
            }
            SpanKind::Server => {
                self.adopt_clients(&mut node);
                let parent = self.recent_parent(&node.t, |p, s| {
                    (p.kind == SpanKind::Client && keys::same_connection(p, s))
                        .then_some(JoinKey::Tcp4tuple)
                });
                if let Some((i, key)) = parent {
                    self.emit_under(i, node, key, out);
                } else if let Some(c) = self
                    .clients
                    .iter_mut()
                    .find(|c| keys::same_connection(&c.t, &node.t))
                {
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
        for node in take_where(&mut self.engines, due) {
            self.stats.unjoined_server_requests += 1;
            self.emit_root(node, out);
        }
        for node in take_where(&mut self.clients, due) {
            self.stats.unjoined_client_requests += 1;
            self.emit_root(node, out);
        }
        let keep_from = now.saturating_sub(HOLD_NS);
        self.recent.retain(|r| r.t.end >= keep_from);
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
        for (i, c) in self.clients.iter().enumerate() {
            let Some(key) = keys::carried_over(inbound, &c.t) else {
                continue;
            };
            let rival = self.recent.iter().any(|r| {
                (r.t.kind == SpanKind::Server && keys::carried_over(&r.t, &c.t) == Some(key))
                    || (r.t.kind == SpanKind::Client
                        && keys::overlap(&r.t, &c.t)
                        && keys::same_value(key, &r.t, &c.t))
            });
            let twin = self.clients.iter().enumerate().any(|(j, o)| {
                j != i && keys::overlap(&o.t, &c.t) && keys::same_value(key, &o.t, &c.t)
            });
            if rival || twin {
                self.stats.ambiguous += 1;
            } else {
                picked.push((i, key));
            }
        }
        let mut adopted = Vec::with_capacity(picked.len());
        for &(i, key) in picked.iter().rev() {
            let mut c = self.clients.remove(i);
            c.key = Some(key);
            adopted.push(c);
        }
        adopted.sort_by_key(|c| c.t.request_start);
        if let Some(first) = adopted.first() {
            node.t.upstream = Some(upstream_view(&node.t, &first.t));
        }
        node.children.extend(adopted);
    }

    /// The one recent request `key_of` ties `t` to; `None` when none does,
    /// or more than one (counted ambiguous).
    fn recent_parent(
        &mut self,
        t: &RequestTimeline,
        key_of: impl Fn(&RequestTimeline, &RequestTimeline) -> Option<JoinKey>,
    ) -> Option<(usize, JoinKey)> {
        let mut found = self
            .recent
            .iter()
            .enumerate()
            .filter_map(|(i, r)| key_of(&r.t, t).map(|k| (i, k)));
        let first = found.next()?;
        if found.next().is_some() {
            self.stats.ambiguous += 1;
            return None;
        }
        Some(first)
    }

    fn hold(&mut self, node: Node, client: bool, out: &mut Vec<RequestTimeline>) {
        if self.engines.len() + self.clients.len() >= MAX_HELD {
            // the oldest held request of either kind goes out unjoined
            let oldest_client = self.clients.first().map(|n| n.held_at);
            let oldest_engine = self.engines.first().map(|n| n.held_at);
            let from_clients = match (oldest_client, oldest_engine) {
                (Some(c), Some(e)) => c <= e,
                (c, _) => c.is_some(),
            };
            if from_clients {
                let n = self.clients.remove(0);
                self.stats.unjoined_client_requests += 1;
                self.emit_root(n, out);
            } else if !self.engines.is_empty() {
                let n = self.engines.remove(0);
                self.stats.unjoined_server_requests += 1;
                self.emit_root(n, out);
            }
        }
        if client {
            self.clients.push(node);
        } else {
            self.engines.push(node);
        }
    }

    /// `node` joins the trace of the recent request `i` by `key`.
    fn emit_under(
        &mut self,
        i: usize,
        mut node: Node,
        key: JoinKey,
        out: &mut Vec<RequestTimeline>,
    ) {
        node.key = Some(key);
        let parent = self.recent[i].ids.clone();
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
        out.push(node.t.clone());
        if may_parent {
            if self.recent.len() >= MAX_RECENT {
                self.recent.pop_front();
            }
            self.recent.push_back(Recent {
                t: node.t,
                ids: ids.clone(),
            });
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
            None => return,
        };
        *slot += 1;
    }
}

/// Removes and returns the nodes `pick` selects, keeping the others in
/// order.
fn take_where(nodes: &mut Vec<Node>, mut pick: impl FnMut(&Node) -> bool) -> Vec<Node> {
    let mut taken = Vec::new();
    let mut kept = Vec::with_capacity(nodes.len());
    for n in nodes.drain(..) {
        if pick(&n) {
            taken.push(n);
        } else {
            kept.push(n);
        }
    }
    *nodes = kept;
    taken
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
