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
}

impl Exchanges {
    /// Queues a request whose head arrived in the read at `ts`; returns its
    /// sequence number.
    pub(crate) fn open(
        &mut self,
        conn: ConnId,
        head: RequestHead,
        start: MonoNs,
        ts: MonoNs,
    ) -> u64 {
        let seq = self.opened;
        self.opened += 1;
        self.queue.push_back(Exchange {
            seq,
            response_model: None,
            timeline: RequestTimeline {
                conn,
                comm: String::new(),
                addrs: None,
                method: head.method,
                path: head.path,
                traceparent: head.traceparent,
                tracestate: head.tracestate,
                model: None,
                request_start: start,
                request_end: ts,
                request_bytes: head.len as u64,
                status: None,
                content_type: None,
                body_kind: None,
                response_start: None,
                first_body_byte: None,
                chunk_ts: Vec::new(),
                end: ts,
                response_bytes: 0,
                done_seen: false,
                aborted: false,
                abort_reason: None,
                response_id: None,
                usage: None,
                truncated_writes: 0,
                tls: false,
                stalls: Vec::new(),
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
        self.queue.pop_front()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    pub(crate) fn len(&self) -> usize {
        self.queue.len()
    }

    /// Removes every queued exchange, oldest first.
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = Exchange> + '_ {
        self.queue.drain(..)
    }
}
