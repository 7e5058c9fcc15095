//! Where stitching results and counters go during one call into the
//! [`Stitcher`](super::Stitcher).

use tracing::debug;

use super::error::StitchError;
use super::timeline::RequestTimeline;
use super::StitchStats;
use crate::model::SpanKind;

pub(crate) struct Sink<'a> {
    out: &'a mut Vec<RequestTimeline>,
    stats: &'a mut StitchStats,
}

impl<'a> Sink<'a> {
    pub(crate) fn new(out: &'a mut Vec<RequestTimeline>, stats: &'a mut StitchStats) -> Self {
        Self { out, stats }
    }

    /// Reports a finished request: each request comes through here exactly
    /// once, complete or aborted.
    pub(crate) fn emit(&mut self, timeline: RequestTimeline) {
        if timeline.kind == SpanKind::Client {
            self.stats.client_requests += 1;
            self.out.push(timeline);
            return;
        }
        if timeline.aborted {
            self.stats.requests_aborted += 1;
        } else {
            self.stats.requests_completed += 1;
        }
        if !timeline.ingress_known {
            self.stats.requests_without_ingress += 1;
        }
        if timeline.tls && timeline.addrs.is_none() {
            self.stats.tls_untied += 1;
        }
        if timeline.chunks_inexact {
            self.stats.chunks_inexact += 1;
        }
        self.out.push(timeline);
    }

    pub(crate) fn parse_error(&mut self, err: &StitchError) {
        self.stats.parse_errors += 1;
        debug!(error = %err, "stitch: unparsable bytes dropped");
    }

    pub(crate) fn client_connection(&mut self) {
        self.stats.client_connections += 1;
    }

    pub(crate) fn ciphertext_connection(&mut self) {
        self.stats.ciphertext_connections += 1;
    }

    pub(crate) fn truncated_write(&mut self) {
        self.stats.truncated_writes += 1;
    }

    pub(crate) fn stream_in_flight_at_start(&mut self) {
        self.stats.streams_in_flight_at_start += 1;
    }

    pub(crate) fn h2_connection(&mut self) {
        self.stats.h2_connections += 1;
    }

    pub(crate) fn hpack_unknown_indexes(&mut self, n: u32) {
        self.stats.hpack_unknown_indexes += u64::from(n);
    }

    pub(crate) fn hpack_lost_block(&mut self) {
        self.stats.hpack_lost_blocks += 1;
    }

    pub(crate) fn evicted_connection(&mut self) {
        self.stats.evicted_connections += 1;
    }
}
