//! The soak's arithmetic, pure: the RSS slope, coverage gaps and the
//! delivery windows of the collector's up time.

use std::collections::HashSet;

use super::load::Sent;

/// Least-squares slope of `(seconds, MiB)` samples, in MiB per hour; None
/// with fewer than two distinct times.
pub fn slope_mib_per_hour(samples: &[(f64, f64)]) -> Option<f64> {
    let n = samples.len() as f64;
    if samples.len() < 2 {
        return None;
    }
    let mean_t = samples.iter().map(|s| s.0).sum::<f64>() / n;
    let mean_m = samples.iter().map(|s| s.1).sum::<f64>() / n;
    let (mut num, mut den) = (0.0, 0.0);
    for (t, m) in samples {
        num += (t - mean_t) * (m - mean_m);
        den += (t - mean_t) * (t - mean_t);
    }
    (den > 0.0).then(|| num / den * 3600.0)
}

/// Least-squares slope shared by several spans of time, each with its own
/// level (the pooled within-window slope), in MiB per hour: how RSS moves
/// while the load is steady, leaving out the steps between the windows.
/// None without two samples at distinct times in some window.
pub fn pooled_slope_mib_per_hour(samples: &[(f64, f64)], windows: &[Window]) -> Option<f64> {
    let (mut num, mut den) = (0.0, 0.0);
    for w in windows {
        let pts: Vec<(f64, f64)> = samples
            .iter()
            .copied()
            .filter(|s| s.0 >= w.from && s.0 < w.to)
            .collect();
        if pts.len() < 2 {
            continue;
        }
        let n = pts.len() as f64;
        let mt = pts.iter().map(|p| p.0).sum::<f64>() / n;
        let mm = pts.iter().map(|p| p.1).sum::<f64>() / n;
        for (t, m) in &pts {
            num += (t - mt) * (m - mm);
            den += (t - mt) * (t - mt);
        }
    }
    (den > 0.0).then(|| num / den * 3600.0)
}

/// Requests (answered ok by the server) that no agent reported, among those
/// sent in `[from, to)`.
#[derive(Debug, PartialEq)]
pub struct Gap {
    pub checked: usize,
    pub uncovered: usize,
    /// From the start of the last covered request before the first
    /// uncovered one to the start of the first covered request after the
    /// last uncovered one: the interval of request starts nobody saw, to the
    /// resolution of the request interval. 0 when all were covered; None
    /// when the uncovered run has no covered request on one side.
    pub gap_ms: Option<f64>,
    /// Start of the first and last uncovered request.
    pub first_uncovered: Option<f64>,
    pub last_uncovered: Option<f64>,
    /// Covered requests between the first and last uncovered one: the
    /// losses were not one interruption.
    pub covered_inside: usize,
    /// Start times of the unseen requests (the first 50), for the report.
    pub unseen_at: Vec<f64>,
}

pub fn coverage(sent: &[Sent], covered: &HashSet<u64>, from: f64, to: f64) -> Gap {
    let window: Vec<&Sent> = sent
        .iter()
        .filter(|s| s.ok && s.sent >= from && s.sent < to)
        .collect();
    let is_covered = |s: &&Sent| covered.contains(&s.rid);
    let first = window.iter().position(|s| !is_covered(s));
    let last = window.iter().rposition(|s| !is_covered(s));
    let (Some(first), Some(last)) = (first, last) else {
        return Gap {
            checked: window.len(),
            uncovered: 0,
            gap_ms: Some(0.0),
            first_uncovered: None,
            last_uncovered: None,
            covered_inside: 0,
            unseen_at: Vec::new(),
        };
    };
    let inside = &window[first..=last];
    let uncovered = inside.iter().filter(|s| !is_covered(s)).count();
    let before = first.checked_sub(1).map(|i| window[i].sent);
    let after = window.get(last + 1).map(|s| s.sent);
    Gap {
        checked: window.len(),
        uncovered,
        gap_ms: before.zip(after).map(|(b, a)| (a - b) * 1000.0),
        first_uncovered: Some(window[first].sent),
        last_uncovered: Some(window[last].sent),
        covered_inside: inside.len() - uncovered,
        unseen_at: inside
            .iter()
            .filter(|s| !is_covered(s))
            .take(50)
            .map(|s| s.sent)
            .collect(),
    }
}

/// A span of time in which the agent's exports should reach the collector.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Window {
    pub from: f64,
    pub to: f64,
}

/// The windows in which every reported request's span must arrive: from
/// when the agent's export queue was first empty after the collector came
/// up (the backlog of the outage drained: until then a full queue drops the
/// newest, by design) to `margin` before the collector went down (a batch
/// may wait `batch_timeout` in the agent and then meet a dead collector).
/// `ups` are (up, down) times; `queue_empty` the times the agent reported
/// an empty queue.
pub fn delivery_windows(ups: &[(f64, f64)], queue_empty: &[f64], margin: f64) -> Vec<Window> {
    ups.iter()
        .filter_map(|&(up, down)| {
            let drained = queue_empty.iter().copied().find(|&t| t >= up)?;
            let to = down - margin;
            (drained < to).then_some(Window { from: drained, to })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slope_of_a_line_and_of_a_flat_series() {
        let line: Vec<(f64, f64)> = (0..100)
            .map(|i| (i as f64 * 10.0, 50.0 + i as f64 * 0.01))
            .collect();
        // 0.01 MiB per 10 s = 3.6 MiB/h
        let s = slope_mib_per_hour(&line).expect("slope");
        assert!((s - 3.6).abs() < 1e-9, "{s}");
        let flat: Vec<(f64, f64)> = (0..10).map(|i| (i as f64, 7.0)).collect();
        assert_eq!(slope_mib_per_hour(&flat), Some(0.0));
        assert_eq!(slope_mib_per_hour(&[(1.0, 2.0)]), None);
        assert_eq!(slope_mib_per_hour(&[(1.0, 2.0), (1.0, 3.0)]), None);
    }

    fn sent(rid: u64, at: f64, ok: bool) -> Sent {
        Sent {
            rid,
            sent: at,
            done: at + 0.5,
            ok,
        }
    }

    #[test]
    fn a_gap_runs_from_the_last_covered_start_to_the_next() {
        let all: Vec<Sent> = (0..10).map(|i| sent(i, i as f64 * 0.1, i != 7)).collect();
        // 3, 4, 5 unseen; 7 failed at the server (not a coverage question)
        let covered: HashSet<u64> = [0, 1, 2, 6, 8, 9].into_iter().collect();
        let g = coverage(&all, &covered, 0.0, 10.0);
        assert_eq!(g.checked, 9);
        assert_eq!(g.uncovered, 3);
        assert_eq!(g.covered_inside, 0);
        let gap = g.gap_ms.expect("covered on both sides");
        assert!((gap - 400.0).abs() < 1e-6, "{gap}");
        assert_eq!(g.first_uncovered, Some(0.30000000000000004));
    }

    #[test]
    fn full_coverage_is_a_zero_gap_and_scattered_losses_are_told() {
        let all: Vec<Sent> = (0..10).map(|i| sent(i, i as f64, true)).collect();
        let every: HashSet<u64> = (0..10).collect();
        assert_eq!(coverage(&all, &every, 0.0, 100.0).gap_ms, Some(0.0));
        let scattered: HashSet<u64> = [0, 1, 3, 5, 6, 7, 8, 9].into_iter().collect();
        let g = coverage(&all, &scattered, 0.0, 100.0);
        assert_eq!((g.uncovered, g.covered_inside), (2, 1));
        let open_end: HashSet<u64> = (0..8).collect();
        assert_eq!(coverage(&all, &open_end, 0.0, 100.0).gap_ms, None);
    }

    #[test]
    fn the_pooled_slope_ignores_steps_between_windows() {
        // flat inside each window, a 10 MiB step between them: no slope
        let mut samples: Vec<(f64, f64)> = (0..100).map(|i| (i as f64, 50.0)).collect();
        samples.extend((200..300).map(|i| (i as f64, 60.0)));
        let w = [
            Window {
                from: 0.0,
                to: 100.0,
            },
            Window {
                from: 200.0,
                to: 300.0,
            },
        ];
        assert_eq!(pooled_slope_mib_per_hour(&samples, &w), Some(0.0));
        assert!(
            slope_mib_per_hour(&samples).is_some_and(|s| s > 100.0),
            "the plain fit sees the step"
        );
        // a leak inside the windows shows: 1 MiB per 1000 s = 3.6 MiB/h
        let leaking: Vec<(f64, f64)> = samples.iter().map(|&(t, m)| (t, m + t / 1000.0)).collect();
        let s = pooled_slope_mib_per_hour(&leaking, &w).expect("slope");
        assert!((s - 3.6).abs() < 1e-9, "{s}");
        assert_eq!(
            pooled_slope_mib_per_hour(
                &samples,
                &[Window {
                    from: 500.0,
                    to: 600.0
                }]
            ),
            None
        );
    }

    #[test]
    fn windows_start_when_the_backlog_drained_and_end_before_the_outage() {
        let ups = [(0.0, 240.0), (300.0, 540.0), (600.0, 601.0)];
        let empty = [0.5, 100.0, 303.0, 310.0];
        let w = delivery_windows(&ups, &empty, 2.0);
        assert_eq!(
            w,
            vec![
                Window {
                    from: 0.5,
                    to: 238.0
                },
                Window {
                    from: 303.0,
                    to: 538.0
                }
            ],
            "the last up time never drained (and is shorter than the margin)"
        );
    }
}
