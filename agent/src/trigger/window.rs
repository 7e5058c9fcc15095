//! Rolling windows of per-request samples, one per rule and label set.

use std::collections::VecDeque;

use crate::event::MonoNs;
use crate::model::{AbortReason, RequestTimeline, Stall};
use crate::units::ms;

use crate::config::{Metric, Rule};

/// Milliseconds of `stall` charged to `cause` (`nagle`: the socket hold of
/// a chunk written with Nagle on; `socket`: the other holds).
pub fn cause_ms(stall: &Stall, cause: &str) -> Option<f64> {
    Some(match cause {
        "queue" => stall.queue_ms,
        "preempted" => stall.preempted_ms,
        "prefill" => stall.prefill_ms,
        "gpu_sync" => stall.gpu_sync_ms,
        "flow_control" => stall.flow_control_ms,
        "off_cpu" => stall.off_cpu_ms,
        "socket" if !stall.nagle => stall.socket_ms,
        "nagle" if stall.nagle => stall.socket_ms,
        "socket" | "nagle" => 0.0,
        "unexplained" => stall.unexplained_ms,
        _ => return None,
    })
}

/// One value a request contributes. A request may contribute several
/// (every ITL gap) or none (no first token); `weight` is what shares
/// divide by.
#[derive(Debug, Clone, Copy)]
struct Sample {
    ts: MonoNs,
    value: f64,
    weight: f64,
}

/// Bound on samples per window, whatever the rate (oldest go first): a
/// window judges the recent past, it need not hold every gap of a flood.
const MAX_SAMPLES: usize = 65_536;

/// The values of one rule's window for one label set.
#[derive(Debug, Default)]
pub struct Window {
    samples: VecDeque<Sample>,
    /// Request end times, for `min_requests`.
    requests: VecDeque<MonoNs>,
    /// When [`Window::judge_at`] last looked.
    judged: Option<MonoNs>,
}

/// A window is judged at most this often: a percentile over a busy window
/// (tens of thousands of ITL gaps) costs a pass over all of them, too much
/// per request at thousands of requests per second; a firing is then at
/// most this late.
const JUDGE_EVERY_NS: u64 = 250_000_000;

/// What a judged window found.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub value: f64,
    pub requests: usize,
}

impl Window {
    /// Adds what `t` contributes to `rule`'s metric.
    pub fn add(&mut self, rule: &Rule, t: &RequestTimeline) {
        let ts = t.end;
        self.requests.push_back(ts);
        let mut push = |value: f64, weight: f64| {
            if self.samples.len() == MAX_SAMPLES {
                self.samples.pop_front();
            }
            self.samples.push_back(Sample { ts, value, weight });
        };
        match rule.metric {
            Metric::Ttft => {
                if let Some(ttft) = t.ttft_ns() {
                    push(ms(ttft), 1.0);
                }
            }
            Metric::Itl => t.stats().itl_ns.iter().for_each(|&g| push(ms(g), 1.0)),
            Metric::E2e => push(ms(t.e2e_ns()), 1.0),
            Metric::AbortRate => push(if t.aborted { 1.0 } else { 0.0 }, 1.0),
            Metric::ClientClosedRate => {
                let closed = t.abort_reason == Some(AbortReason::ClientClosed);
                push(if closed { 1.0 } else { 0.0 }, 1.0)
            }
            Metric::StallShare => {
                let cause = rule.cause.as_deref().unwrap_or_default();
                for stall in &t.stalls {
                    let total = stall.gap_ms + stall.socket_ms;
                    push(cause_ms(stall, cause).unwrap_or(0.0), total);
                }
            }
        }
    }

    /// Forgets what ended before `now - window`.
    pub fn expire(&mut self, now: MonoNs, window_ns: u64) {
        let from = now.saturating_sub(window_ns);
        while self.samples.front().is_some_and(|s| s.ts < from) {
            self.samples.pop_front();
        }
        while self.requests.front().is_some_and(|&ts| ts < from) {
            self.requests.pop_front();
        }
    }

    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// [`Window::judge`], unless the window was judged less than
    /// [`JUDGE_EVERY_NS`] before `now`.
    pub fn judge_at(&mut self, rule: &Rule, now: MonoNs) -> Option<Verdict> {
        if self
            .judged
            .is_some_and(|at| now.saturating_sub(at) < JUDGE_EVERY_NS)
        {
            return None;
        }
        self.judged = Some(now);
        self.judge(rule)
    }

    /// The window's value for `rule`, once it holds `min_requests`.
    pub fn judge(&self, rule: &Rule) -> Option<Verdict> {
        let requests = self.requests.len();
        if requests < rule.min_requests || self.samples.is_empty() {
            return None;
        }
        let value = if rule.metric.is_latency() {
            // Percentiles over µs integers: exact enough for ms thresholds.
            let mut us: Vec<u64> = self
                .samples
                .iter()
                .map(|s| (s.value * 1000.0) as u64)
                .collect();
            // Nearest rank, as units::percentile, without sorting all.
            let rank = ((rule.percentile / 100.0) * us.len() as f64).ceil() as usize;
            let index = rank.clamp(1, us.len()) - 1;
            let (_, at, _) = us.select_nth_unstable(index);
            *at as f64 / 1000.0
        } else {
            let weight: f64 = self.samples.iter().map(|s| s.weight).sum();
            if weight <= 0.0 {
                return None;
            }
            self.samples.iter().map(|s| s.value).sum::<f64>() / weight
        };
        Some(Verdict { value, requests })
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::model::BodyKind;

    const MS: u64 = 1_000_000;

    /// An SSE stream that ends at `end` ns: first token `ttft_ms` after its
    /// start, then chunks `gaps_ms` apart.
    pub(in crate::trigger) fn timeline_with_chunks(
        end: MonoNs,
        ttft_ms: u64,
        gaps_ms: &[u64],
    ) -> RequestTimeline {
        let total: u64 = ttft_ms + gaps_ms.iter().sum::<u64>();
        let start = end.saturating_sub(total * MS);
        let mut at = start + ttft_ms * MS;
        let mut chunks = vec![at];
        for g in gaps_ms {
            at += g * MS;
            chunks.push(at);
        }
        RequestTimeline {
            request_start: start,
            read_start: start,
            request_end: start,
            status: Some(200),
            body_kind: Some(BodyKind::Sse),
            response_start: Some(start + ttft_ms * MS),
            first_body_byte: Some(start + ttft_ms * MS),
            chunk_ts: chunks,
            end,
            ..RequestTimeline::default()
        }
    }

    fn rule(metric: Metric, above: f64) -> Rule {
        Rule {
            name: "r".into(),
            metric,
            percentile: 95.0,
            above,
            window: std::time::Duration::from_secs(30),
            min_requests: 3,
            cause: None,
            service: None,
            route: None,
            model: None,
        }
    }

    #[test]
    fn ttft_percentile_needs_min_requests_and_expires() {
        let r = rule(Metric::Ttft, 100.0);
        let mut w = Window::default();
        for (i, ttft_ms) in [20u64, 30, 300].into_iter().enumerate() {
            let end = 1_000 * MS * (i as u64 + 1);
            w.add(&r, &timeline_with_chunks(end, ttft_ms, &[5, 5]));
            if i < 2 {
                assert_eq!(w.judge(&r), None, "below min_requests");
            }
        }
        let v = w.judge(&r).expect("three requests");
        // Judged again within 250 ms of the last look: not yet.
        assert!(w.judge_at(&r, 3_000 * MS).is_some());
        assert_eq!(w.judge_at(&r, 3_200 * MS), None);
        assert!(w.judge_at(&r, 3_300 * MS).is_some());
        assert_eq!((v.value, v.requests), (300.0, 3));
        // They ended 2.5, 1.5 and 0.5 s before now: a 1.2 s window keeps the last.
        w.expire(3_500 * MS, 1_200 * MS);
        assert_eq!(w.requests.len(), 1);
        assert_eq!(w.judge(&r), None);
    }

    #[test]
    fn itl_takes_every_gap_and_rates_are_shares() {
        let r = rule(Metric::Itl, 10.0);
        let mut w = Window::default();
        for i in 0..3u64 {
            w.add(
                &r,
                &timeline_with_chunks(1_000 * MS * (i + 1), 10, &[1, 1, 1, 50]),
            );
        }
        // 12 gaps, 3 of them 50 ms: p95 is 50, p50 would be 1.
        assert_eq!(w.judge(&r).map(|v| v.value), Some(50.0));
        let r = rule(Metric::AbortRate, 0.5);
        let mut w = Window::default();
        for i in 0..4u64 {
            let mut t = timeline_with_chunks(1_000 * MS * (i + 1), 10, &[1]);
            t.aborted = i == 0;
            w.add(&r, &t);
        }
        assert_eq!(w.judge(&r).map(|v| v.value), Some(0.25));
    }
}
