//! Requests in flight on one connection, oldest first.
//!
//! HTTP/1.1 answers requests in the order they arrived, so pipelined
//! requests wait in a FIFO: the request reader appends, the response reader
//! works on the front. A request joins the queue as soon as its head is
//! complete, before its body: the server may answer first (`100 Continue`,
//! an early error).

use std::collections::VecDeque;

use crate::event::{ConnId, MonoNs};

use super::http::RequestHead;
use super::timeline::{AbortReason, RequestTimeline};
use crate::model::{OpenRequest, Phase};

/// When a request began: the read that brought its first byte, and when
/// that byte reached the host if the kernel dated it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RequestStart {
    pub read: MonoNs,
    pub ingress: Option<MonoNs>,
}

impl RequestStart {
    /// The arrival time, if known. An ingress later than the read cannot be
    /// (bytes are read after they arrive) and is ignored.
    pub(crate) fn arrival(&self) -> Option<MonoNs> {
        self.ingress.filter(|&t| t <= self.read)
    }
}

/// A request whose first byte was read at `start.read` (and reached the
/// host at `start.ingress`, if known); `ts` is the read that made it a
/// request (its head, or its HEADERS frame, complete).
pub(crate) fn started_timeline(start: RequestStart, ts: MonoNs) -> RequestTimeline {
    let arrival = start.arrival();
    RequestTimeline {
        request_start: arrival.unwrap_or(start.read),
        read_start: start.read,
        ingress_known: arrival.is_some(),
        request_end: ts,
        end: ts,
        ..RequestTimeline::default()
    }
}

/// What the connection's setup cost, charged to its first request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Setup {
    pub accept_wait_ns: Option<u64>,
    pub tls_handshake_ns: Option<u64>,
}

/// One request and, once it starts, its response.
#[derive(Debug, Clone)]
pub(crate) struct Exchange {
    /// Order of arrival on the connection: how the request reader finds the
    /// request whose body it is still reading.
    pub seq: u64,
    pub timeline: RequestTimeline,
    /// `model` named by the response; the request's takes precedence.
    pub response_model: Option<String>,
}

impl Exchange {
    /// What the in-flight gauges count of this unfinished exchange.
    pub(crate) fn open_request(&self, comm: &str) -> OpenRequest {
        let t = &self.timeline;
        OpenRequest {
            pid: t.conn.pid,
            comm: comm.to_owned(),
            path: t.path.clone(),
            model: t.model.clone().or_else(|| self.response_model.clone()),
            phase: Phase::of(t),
        }
    }

    /// The finished timeline. Process name and addresses are filled in by
    /// the connection, which may learn them after the request started.
    pub(crate) fn into_timeline(self, end: MonoNs, abort: Option<AbortReason>) -> RequestTimeline {
        let mut tl = self.timeline;
        tl.end = end;
        tl.aborted = abort.is_some();
        tl.abort_reason = abort;
        if tl.model.is_none() {
            tl.model = self.response_model;
        }
        tl
    }
}

#[derive(Debug, Clone, Default)]
pub(crate) struct Exchanges {
    queue: VecDeque<Exchange>,
    opened: u64,
    /// Charged to the connection's first request.
    pub setup: Setup,
    /// Chunks of the response last taken off the queue: a streaming
    /// connection's responses are alike, and a chunk list grown from
    /// empty reallocated seven times for 200 tokens (with its page faults,
    /// ~3 % of the agent under the node flood).
    last_chunks: usize,
}

/// The most chunk slots reserved for a response ahead of its chunks.
const MAX_CHUNKS_RESERVED: usize = 4096;

impl Exchanges {
    /// Queues a request whose head arrived in the read at `ts`; returns its
    /// sequence number.
    pub(crate) fn open(
        &mut self,
        conn: ConnId,
        head: RequestHead,
        start: RequestStart,
        ts: MonoNs,
    ) -> u64 {
        let seq = self.opened;
        self.opened += 1;
        let setup = if seq == 0 {
            self.setup
        } else {
            Setup::default()
        };
        self.queue.push_back(Exchange {
            seq,
            response_model: None,
            timeline: RequestTimeline {
                conn,
                method: head.method,
                path: head.path,
                traceparent: head.traceparent,
                tracestate: head.tracestate,
                accept_wait_ns: setup.accept_wait_ns,
                tls_handshake_ns: setup.tls_handshake_ns,
                request_headers: head.id_headers,
                request_end: ts,
                request_bytes: head.len as u64,
                end: ts,
                chunk_ts: Vec::with_capacity(self.last_chunks),
                ..started_timeline(start, ts)
            },
        });
        seq
    }

    /// How many requests this connection has ever queued.
    pub(crate) fn opened(&self) -> u64 {
        self.opened
    }

    pub(crate) fn get_mut(&mut self, seq: u64) -> Option<&mut Exchange> {
        // The request being read is almost always the newest.
        self.queue.iter_mut().rev().find(|e| e.seq == seq)
    }

    pub(crate) fn front_mut(&mut self) -> Option<&mut Exchange> {
        self.queue.front_mut()
    }

    pub(crate) fn pop_front(&mut self) -> Option<Exchange> {
        let ex = self.queue.pop_front()?;
        self.last_chunks = ex.timeline.chunk_ts.len().min(MAX_CHUNKS_RESERVED);
        Some(ex)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    pub(crate) fn len(&self) -> usize {
        self.queue.len()
    }

    /// The queued exchanges, oldest first.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Exchange> {
        self.queue.iter()
    }

    /// Removes every queued exchange, oldest first.
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = Exchange> + '_ {
        self.queue.drain(..)
    }
}
