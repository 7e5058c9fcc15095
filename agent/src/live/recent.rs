//! The slowest requests of the last minutes, in bounded memory: finished
//! requests go into 5-second buckets that keep only their `KEEP` slowest
//! (by [`SlowRequest::delay_ms`]). The slowest `KEEP` of any window are
//! then exact: each of them is among the slowest `KEEP` of its own bucket.
//! At most `MAX_WINDOW / BUCKET_NS × KEEP` requests are held, each with
//! at most [`MAX_CHUNK_OFFSETS`] chunk times and [`MAX_STALLS`] stalls.

use std::collections::VecDeque;
use std::time::Duration;

use super::snapshot::{SlowRequest, StallBrief};
use crate::event::MonoNs;
use crate::export::{stall_causes, Labels};
use crate::model::{RequestTimeline, Stall};

/// The longest window `top` may ask for.
pub const MAX_WINDOW: Duration = Duration::from_secs(600);
/// Requests kept per bucket, and at most returned for a window.
pub const KEEP: usize = 12;
/// Chunk emit times kept per request for the waterfall.
pub const MAX_CHUNK_OFFSETS: usize = 512;
/// Stalls kept per request.
pub const MAX_STALLS: usize = 32;
const BUCKET_NS: u64 = 5_000_000_000;

#[derive(Debug, Default)]
pub struct Recent {
    /// (bucket start, its slowest, slowest first), oldest first.
    buckets: VecDeque<(MonoNs, Vec<SlowRequest>)>,
}

impl Recent {
    /// Keeps `t` if it is among its bucket's slowest; drops buckets older
    /// than [`MAX_WINDOW`].
    pub fn record(&mut self, labels: &Labels, t: &RequestTimeline) {
        let slow = brief(labels, t);
        let start = t.end - t.end % BUCKET_NS;
        if self.buckets.back().is_none_or(|(s, _)| *s < start) {
            self.buckets
                .push_back((start, Vec::with_capacity(KEEP + 1)));
        }
        // a timeline may end slightly out of order: into its own bucket
        let Some((_, bucket)) = self.buckets.iter_mut().rev().find(|(s, _)| *s <= start) else {
            return; // older than every bucket kept
        };
        if bucket.len() == KEEP && bucket.last().is_some_and(|l| l.delay_ms >= slow.delay_ms) {
            return;
        }
        let at = bucket.partition_point(|r| r.delay_ms >= slow.delay_ms);
        bucket.insert(at, slow);
        bucket.truncate(KEEP);
        let horizon = t
            .end
            .saturating_sub(crate::units::nanos(MAX_WINDOW) + BUCKET_NS);
        while self.buckets.front().is_some_and(|(s, _)| *s < horizon) {
            self.buckets.pop_front();
        }
    }

    /// The slowest requests that ended in `(now - window, now]`, slowest
    /// first, at most [`KEEP`].
    pub fn slowest(&self, now: MonoNs, window_ns: u64) -> Vec<SlowRequest> {
        let since = now.saturating_sub(window_ns);
        let mut all: Vec<&SlowRequest> = self
            .buckets
            .iter()
            .filter(|(start, _)| start + BUCKET_NS > since)
            .flat_map(|(_, b)| b.iter())
            .filter(|r| r.end_ns > since && r.end_ns <= now)
            .collect();
        all.sort_by(|a, b| b.delay_ms.total_cmp(&a.delay_ms));
        all.into_iter().take(KEEP).cloned().collect()
    }

    /// Requests held (for the memory bound's test).
    #[cfg(test)]
    fn held(&self) -> usize {
        self.buckets.iter().map(|(_, b)| b.len()).sum()
    }
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

/// Largest cause first; `off_cpu (futex)` style names.
fn causes(stall: &Stall) -> Vec<(String, f64)> {
    let mut causes: Vec<(String, f64)> = stall_causes(stall)
        .into_iter()
        .map(|(c, seconds)| {
            let name = match &c.reason {
                Some(reason) => format!("{} ({reason})", c.cause),
                None => c.cause.to_string(),
            };
            (name, seconds * 1e3)
        })
        .collect();
    causes.sort_by(|a, b| b.1.total_cmp(&a.1));
    causes
}

fn stall_brief(stall: &Stall) -> StallBrief {
    let causes = causes(stall);
    StallBrief {
        chunk: stall.chunk,
        start_ms: stall.start_ms,
        gap_ms: stall.gap_ms,
        cause: causes
            .first()
            .map_or_else(|| "unexplained".to_string(), |(c, _)| c.clone()),
        causes,
    }
}

/// What the live view keeps of a finished request.
fn brief(labels: &Labels, t: &RequestTimeline) -> SlowRequest {
    let ttft = t.ttft_ns();
    let phases = t.phases();
    let worst = t.longest_gap();
    let worst_cause = worst.and_then(|(chunk, _)| {
        t.stalls
            .iter()
            .find(|s| s.chunk == chunk)
            .map(|s| stall_brief(s).cause)
    });
    let delay = ttft.unwrap_or(0).max(worst.map_or(0, |(_, g)| g));
    SlowRequest {
        end_ns: t.end,
        request_start_ns: t.request_start,
        service: labels.service.clone(),
        pid: t.conn.pid,
        comm: t.comm.clone(),
        method: t.method.clone(),
        route: labels.route.clone(),
        model: t.model.clone(),
        status: t.status,
        request_id: t.request_id().map(str::to_owned),
        abort_reason: t
            .abort_reason
            .map(|r| serde_plain::to_string(&r).unwrap_or_default()),
        delay_ms: ms(if delay == 0 { t.e2e_ns() } else { delay }),
        ttft_ms: ttft.map(ms),
        e2e_ms: ms(t.e2e_ns()),
        socket_wait_ms: phases.socket_wait_ns.map(ms),
        accept_wait_ms: t.accept_wait_ns.map(ms),
        tls_handshake_ms: t.tls_handshake_ns.map(ms),
        reading_ms: ms(phases.reading_ns),
        to_first_token_ms: phases.to_first_token_ns.map(ms),
        stream_ms: phases.stream_ns.map(ms),
        chunks: t.chunk_ts.len() as u64,
        chunk_offsets_ms: t
            .chunk_ts
            .iter()
            .take(MAX_CHUNK_OFFSETS)
            .map(|c| ms(c.saturating_sub(t.request_start)) as f32)
            .collect(),
        worst_gap_ms: worst.map(|(_, g)| ms(g)),
        worst_gap_chunk: worst.map(|(c, _)| c),
        worst_gap_cause: worst_cause,
        stalls: t.stalls.iter().take(MAX_STALLS).map(stall_brief).collect(),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A streamed response ending at `end_ms`: first token after
    /// `ttft_ms`, then chunks 10, 20, 30, 40 ms apart.
    pub(crate) fn timeline(end_ms: u64, ttft_ms: u64) -> RequestTimeline {
        let ms = 1_000_000;
        let end = end_ms * ms;
        let start = end - (ttft_ms + 100) * ms;
        let first = start + ttft_ms * ms;
        RequestTimeline {
            comm: "python3".into(),
            method: "POST".into(),
            path: "/v1/chat/completions?rid=7".into(),
            request_start: start,
            read_start: start,
            request_end: start + ms / 10,
            ingress_known: true,
            status: Some(200),
            body_kind: Some(crate::model::BodyKind::Sse),
            chunk_ts: [0, 10, 30, 60, 100].map(|d| first + d * ms).to_vec(),
            end,
            ..RequestTimeline::default()
        }
    }

    #[test]
    fn the_slowest_of_a_window_are_exact_and_memory_is_bounded() {
        let mut recent = Recent::default();
        // 20 minutes of 50 requests a second, TTFT 1..=50 ms
        let mut all = Vec::new();
        for i in 0..60_000u64 {
            let end = 1_000_000 + i * 20;
            let ttft = 1 + (i * 7919) % 50;
            let t = timeline(end, ttft);
            recent.record(&Labels::new("svc".into(), &t), &t);
            all.push((end, ttft));
        }
        let now = 1_000_000 + 59_999 * 20;
        let window = 30_000_000_000;
        let got: Vec<f64> = recent
            .slowest(now * 1_000_000, window)
            .iter()
            .map(|r| r.ttft_ms.unwrap_or_default())
            .collect();
        let mut want: Vec<f64> = all
            .iter()
            .filter(|(end, _)| end * 1_000_000 > now * 1_000_000 - window)
            .map(|(_, t)| *t as f64)
            .collect();
        want.sort_by(|a, b| b.total_cmp(a));
        want.truncate(KEEP);
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 0.01, "slowest {got:?}, want {want:?}");
        }
        assert_eq!(got.len(), KEEP);
        let max_held = (MAX_WINDOW.as_nanos() as usize / BUCKET_NS as usize + 2) * KEEP;
        assert!(recent.held() <= max_held, "{} > {max_held}", recent.held());
    }

    #[test]
    fn a_stalled_gap_is_the_worst_gap_with_its_cause() {
        let mut t = timeline(5_000, 20);
        let gaps: Vec<u64> = t.chunk_ts.windows(2).map(|w| w[1] - w[0]).collect();
        let chunk = 1 + gaps
            .iter()
            .enumerate()
            .max_by_key(|(_, g)| **g)
            .expect("gaps")
            .0;
        t.stalls = vec![Stall {
            chunk,
            start_ms: 10.0,
            gap_ms: 150.0,
            off_cpu_ms: 120.0,
            off_cpu_reason: Some("sleep".into()),
            unexplained_ms: 30.0,
            ..Stall::default()
        }];
        let r = brief(&Labels::new("svc".into(), &t), &t);
        assert_eq!(r.worst_gap_chunk, Some(chunk));
        assert_eq!(r.worst_gap_cause.as_deref(), Some("off_cpu (sleep)"));
        assert_eq!(r.stalls[0].causes[1], ("unexplained".to_string(), 30.0));
        assert_eq!(r.chunks as usize, t.chunk_ts.len());
    }
}
