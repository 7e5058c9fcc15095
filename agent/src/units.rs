//! Shared, pipeline-independent helpers every stage may use: the kernel's
//! clock, its offset to the wall clock ([`WallClock`]), and how durations
//! and distributions are printed. Lives below every stage so none has to
//! import from another stage or from the command that wires them.

mod wall_clock;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::event::MonoNs;

pub use wall_clock::WallClock;

/// The kernel's CLOCK_MONOTONIC, the clock of every event timestamp.
pub fn monotonic_now() -> MonoNs {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid out-pointer; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

/// Unix nanoseconds now (CLOCK_REALTIME; 0 before the epoch).
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, nanos)
}

/// A duration in nanoseconds, saturating at `u64::MAX` (about 584 years:
/// only a configured "forever" gets there).
pub fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Milliseconds from nanoseconds, rounded to microseconds for stable output.
pub fn ms(ns: u64) -> f64 {
    (ns as f64 / 1_000.0).round() / 1_000.0
}

/// Nearest-rank percentile of an ascending-sorted slice (`q` in 0..=100).
pub fn percentile(sorted: &[u64], q: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((q / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 50.0), Some(50));
        assert_eq!(percentile(&v, 95.0), Some(95));
        assert_eq!(percentile(&v, 100.0), Some(100));
        assert_eq!(percentile(&v, 0.0), Some(1));
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[7], 99.0), Some(7));
    }

    #[test]
    fn ms_rounds_to_microseconds() {
        assert_eq!(ms(1_234_567), 1.235);
        assert_eq!(ms(0), 0.0);
    }
}
