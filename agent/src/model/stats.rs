//! The latency figures every report of a finished timeline shows (the
//! output line, spans, metrics, the run summary, session reports), worked
//! out once per timeline instead of once per consumer: the inter-token
//! gaps are a vector and their percentiles need it sorted, which a busy
//! run would otherwise do four or five times per request.

use std::sync::OnceLock;

use crate::units::percentile;

use super::RequestTimeline;

/// What a finished timeline's reports derive from its emit times.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TimelineStats {
    /// Gaps between successive chunk emits, in emit order.
    pub itl_ns: Vec<u64>,
    /// The same gaps, ascending.
    itl_sorted_ns: Vec<u64>,
    /// (E2E − TTFT) / (chunks − 1), with at least two chunks.
    pub tpot_ns: Option<u64>,
}

impl TimelineStats {
    pub fn of(t: &RequestTimeline) -> Self {
        let itl_ns: Vec<u64> = t
            .chunk_ts
            .windows(2)
            .map(|w| w[1].saturating_sub(w[0]))
            .collect();
        let mut itl_sorted_ns = itl_ns.clone();
        itl_sorted_ns.sort_unstable();
        let chunks = t.chunk_ts.len() as u64;
        let tpot_ns = t
            .ttft_ns()
            .filter(|_| chunks >= 2)
            .map(|ttft| t.e2e_ns().saturating_sub(ttft) / (chunks - 1));
        Self {
            itl_ns,
            itl_sorted_ns,
            tpot_ns,
        }
    }

    /// Nearest-rank percentile of the gaps (`q` in 0..=100).
    pub fn itl_percentile_ns(&self, q: f64) -> Option<u64> {
        percentile(&self.itl_sorted_ns, q)
    }

    pub fn itl_max_ns(&self) -> Option<u64> {
        self.itl_sorted_ns.last().copied()
    }
}

/// [`TimelineStats`] kept with the timeline once asked for. It is derived
/// data, so it takes no part in a timeline's equality (a replayed timeline
/// equals the recorded one whether or not either was reported yet).
#[derive(Debug, Clone, Default)]
pub struct StatsCache(OnceLock<TimelineStats>);

impl StatsCache {
    pub(super) fn get_or_init(&self, t: &RequestTimeline) -> &TimelineStats {
        self.0.get_or_init(|| TimelineStats::of(t))
    }
}

impl PartialEq for StatsCache {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::BodyKind;

    #[test]
    fn gaps_percentiles_and_tpot_come_from_the_emit_times() {
        let t = RequestTimeline {
            request_start: 1_000,
            body_kind: Some(BodyKind::Sse),
            chunk_ts: vec![11_000, 12_000, 15_000, 16_000],
            end: 16_000,
            ..RequestTimeline::default()
        };
        let stats = t.stats();
        assert_eq!(stats.itl_ns, vec![1_000, 3_000, 1_000]);
        assert_eq!(stats.itl_percentile_ns(50.0), Some(1_000));
        assert_eq!(stats.itl_percentile_ns(95.0), Some(3_000));
        assert_eq!(stats.itl_max_ns(), Some(3_000));
        // TTFT 10 µs, E2E 15 µs, 3 gaps after the first token.
        assert_eq!(stats.tpot_ns, Some(5_000 / 3));
        assert!(std::ptr::eq(stats, t.stats()), "computed once, then kept");
    }

    #[test]
    fn one_chunk_has_no_gaps_and_no_tpot() {
        let t = RequestTimeline {
            body_kind: Some(BodyKind::Sse),
            chunk_ts: vec![5],
            end: 9,
            ..RequestTimeline::default()
        };
        assert_eq!(t.stats().itl_ns, Vec::<u64>::new());
        assert_eq!(t.stats().itl_max_ns(), None);
        assert_eq!(t.stats().tpot_ns, None);
    }
}
