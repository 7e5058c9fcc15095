//! A window of the live view: the difference of two cumulative snapshots,
//! as Prometheus' `rate()` and `histogram_quantile()` would work it out
//! from the same series.

use std::collections::BTreeMap;

use super::snapshot::{Buckets, RouteTotals, TopSnapshot};

/// One row of the services table, over a window.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RouteRow {
    pub service: String,
    pub model: Option<String>,
    pub route: Option<String>,
    pub overflow: bool,
    /// Requests finished in the window.
    pub requests: u64,
    pub requests_per_s: f64,
    pub in_flight_first_token: u64,
    pub in_flight_streaming: u64,
    /// Milliseconds.
    pub ttft_p50: Option<f64>,
    pub ttft_p95: Option<f64>,
    pub ttft_p99: Option<f64>,
    pub itl_p50: Option<f64>,
    pub itl_p99: Option<f64>,
    pub socket_wait_p95: Option<f64>,
    pub cancellations: u64,
    pub cancellations_per_s: f64,
    /// Seconds of stalled gaps in the window, and each cause's share of
    /// them, largest first.
    pub stall_seconds: f64,
    pub stall_share: Vec<(String, f64)>,
}

/// What a window covers: its rows and how long it really is (shorter than
/// asked while the agent is younger, or the viewer's history shorter).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Window {
    pub seconds: f64,
    pub rows: Vec<RouteRow>,
}

/// The window from `base` to `now`. Without a base (a window reaching
/// back past the agent's start), it counts from zero at `now.started_ns`.
pub fn window(base: Option<&TopSnapshot>, now: &TopSnapshot) -> Window {
    let since = base.map_or(now.started_ns, |b| b.at_ns);
    let seconds = (now.at_ns.saturating_sub(since) as f64 / 1e9).max(1e-3);
    let before: BTreeMap<_, &RouteTotals> = base
        .map(|b| b.routes.iter().map(|r| (key(r), r)).collect())
        .unwrap_or_default();
    let empty = RouteTotals::default();
    // series seen once stay at zero in the aggregation (a drained route
    // reads 0 on a dashboard); a row with nothing in the window is noise
    let rows = now
        .routes
        .iter()
        .map(|r| row(before.get(&key(r)).copied().unwrap_or(&empty), r, seconds))
        .filter(|r| r.requests > 0 || r.in_flight_first_token > 0 || r.in_flight_streaming > 0)
        .collect();
    Window { seconds, rows }
}

type Key<'a> = (&'a str, Option<&'a str>, Option<&'a str>, bool);

fn key(r: &RouteTotals) -> Key<'_> {
    (
        &r.service,
        r.model.as_deref(),
        r.route.as_deref(),
        r.overflow,
    )
}

fn row(before: &RouteTotals, now: &RouteTotals, seconds: f64) -> RouteRow {
    let ttft = delta(&before.ttft, &now.ttft);
    let itl = delta(&before.itl, &now.itl);
    let socket = delta(&before.socket_wait, &now.socket_wait);
    let requests = now.requests.saturating_sub(before.requests);
    let cancellations = now.cancellations.saturating_sub(before.cancellations);
    let mut stalls: Vec<(String, f64)> = now
        .stall_seconds
        .iter()
        .map(|(cause, s)| {
            let was = before.stall_seconds.get(cause).copied().unwrap_or(0.0);
            (cause.clone(), (s - was).max(0.0))
        })
        .filter(|(_, s)| *s > 0.0)
        .collect();
    let stall_seconds: f64 = stalls.iter().map(|(_, s)| s).sum();
    for (_, s) in &mut stalls {
        *s /= stall_seconds;
    }
    stalls.sort_by(|a, b| b.1.total_cmp(&a.1));
    let ms = |b: &Buckets, q: f64| quantile(b, q).map(|s| s * 1e3);
    RouteRow {
        service: now.service.clone(),
        model: now.model.clone(),
        route: now.route.clone(),
        overflow: now.overflow,
        requests,
        requests_per_s: requests as f64 / seconds,
        in_flight_first_token: now.in_flight_first_token,
        in_flight_streaming: now.in_flight_streaming,
        ttft_p50: ms(&ttft, 0.5),
        ttft_p95: ms(&ttft, 0.95),
        ttft_p99: ms(&ttft, 0.99),
        itl_p50: ms(&itl, 0.5),
        itl_p99: ms(&itl, 0.99),
        socket_wait_p95: ms(&socket, 0.95),
        cancellations,
        cancellations_per_s: cancellations as f64 / seconds,
        stall_seconds,
        stall_share: stalls,
    }
}

/// `now - before`, bucket by bucket.
fn delta(before: &Buckets, now: &Buckets) -> Buckets {
    if before.counts.len() != now.counts.len() {
        return now.clone();
    }
    Buckets {
        bounds: now.bounds.clone(),
        counts: now
            .counts
            .iter()
            .zip(&before.counts)
            .map(|(n, b)| n.saturating_sub(*b))
            .collect(),
        sum: (now.sum - before.sum).max(0.0),
    }
}

/// The `q`-quantile by linear interpolation inside the bucket holding
/// rank `q × count`, as Prometheus' `histogram_quantile` does; the first
/// bucket starts at 0, and a rank in the overflow bucket answers the
/// highest bound. `None` without observations.
pub fn quantile(b: &Buckets, q: f64) -> Option<f64> {
    let count = b.count();
    if count == 0 || b.bounds.is_empty() {
        return None;
    }
    let rank = q * count as f64;
    let mut below = 0u64;
    for (i, &n) in b.counts.iter().enumerate() {
        if n > 0 && (below + n) as f64 >= rank {
            let Some(&upper) = b.bounds.get(i) else {
                return b.bounds.last().copied();
            };
            let lower = if i == 0 { 0.0 } else { b.bounds[i - 1] };
            let into = ((rank - below as f64) / n as f64).clamp(0.0, 1.0);
            return Some(lower + (upper - lower) * into);
        }
        below += n;
    }
    b.bounds.last().copied()
}

/// The bucket `(lower, upper]` (seconds) that holds `value`: how far a
/// quantile read off the histogram may be from the exact one.
pub fn bucket_of(bounds: &[f64], value: f64) -> (f64, f64) {
    let i = bounds.partition_point(|&b| b < value);
    let lower = if i == 0 { 0.0 } else { bounds[i - 1] };
    (lower, bounds.get(i).copied().unwrap_or(f64::INFINITY))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::Histogram;

    fn buckets(values: &[f64]) -> Buckets {
        let mut h = Histogram::new(crate::export::TTFT_BOUNDS);
        for &v in values {
            h.observe(v);
        }
        let mut b = Buckets::default();
        b.add(&h);
        b
    }

    #[test]
    fn quantiles_fall_in_the_bucket_of_the_exact_value() {
        let values: Vec<f64> = (1..=1000).map(|i| f64::from(i) * 0.0003).collect();
        let b = buckets(&values);
        for q in [0.5, 0.95, 0.99] {
            let exact = values[(q * 1000.0_f64).ceil() as usize - 1];
            let got = quantile(&b, q).expect("observations");
            let (lo, hi) = bucket_of(crate::export::TTFT_BOUNDS, exact);
            assert!(
                got > lo && got <= hi,
                "q{q}: {got} not in ({lo}, {hi}] of {exact}"
            );
        }
        assert_eq!(quantile(&Buckets::default(), 0.5), None);
        // everything above the last bound: the last bound
        assert_eq!(quantile(&buckets(&[100.0, 200.0]), 0.5), Some(60.0));
    }

    #[test]
    fn a_window_is_the_difference_of_two_snapshots() {
        let totals = |requests, ttft: &[f64], stall: f64| RouteTotals {
            service: "svc".into(),
            route: Some("/v1/chat/completions".into()),
            requests,
            ttft: buckets(ttft),
            stall_seconds: [("off_cpu".to_string(), stall), ("socket".to_string(), 0.5)]
                .into_iter()
                .collect(),
            in_flight_streaming: 3,
            ..RouteTotals::default()
        };
        let base = TopSnapshot {
            at_ns: 10_000_000_000,
            routes: vec![totals(10, &[0.5; 10], 1.0)],
            ..TopSnapshot::default()
        };
        let mut later = [0.5; 10].to_vec();
        later.extend([0.02; 30]);
        let now = TopSnapshot {
            at_ns: 20_000_000_000,
            routes: vec![totals(40, &later, 2.5)],
            ..TopSnapshot::default()
        };
        let w = window(Some(&base), &now);
        assert_eq!(w.seconds, 10.0);
        let r = &w.rows[0];
        assert_eq!((r.requests, r.requests_per_s), (30, 3.0));
        let p50 = r.ttft_p50.expect("p50");
        assert!(p50 > 15.0 && p50 <= 20.0, "{p50}");
        assert_eq!(r.stall_seconds, 1.5);
        assert_eq!(r.stall_share, vec![("off_cpu".to_string(), 1.0)]);
        assert_eq!(r.in_flight_streaming, 3);
        // no base: from the agent's start
        let w = window(None, &now);
        assert_eq!(w.rows[0].requests, 40);
        assert_eq!(w.seconds, 20.0);
    }
}
