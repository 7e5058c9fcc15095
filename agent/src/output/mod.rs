//! Human and machine output of finished timelines, and the end-of-run
//! summary.

mod json;
mod summary;
mod text;

pub use json::JsonTimeline;
pub use summary::RunSummary;
pub use text::text_line;

/// Output format of `tokentrace run`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// One readable line per request.
    Text,
    /// One JSON object per request (JSON Lines).
    Json,
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
