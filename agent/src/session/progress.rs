//! The live progress of a session: what `record` prints once a second and
//! what the control endpoint reports while a session runs.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::units::{ms, percentile};

/// A snapshot of a running (or finished) session.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    pub elapsed_ms: u64,
    /// `None`: runs until stopped.
    pub duration_ms: Option<u64>,
    pub requests: u64,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p95_ms: Option<f64>,
    pub cpu_samples: u64,
    pub events: u64,
    pub events_dropped: u64,
}

impl Progress {
    /// TTFT percentiles of `ttfts` (nanoseconds, any order).
    pub fn set_ttft(&mut self, ttfts: &[u64]) {
        let mut sorted = ttfts.to_vec();
        sorted.sort_unstable();
        self.ttft_p50_ms = percentile(&sorted, 50.0).map(ms);
        self.ttft_p95_ms = percentile(&sorted, 95.0).map(ms);
    }

    /// One line: `recording 12s/30s · 143 requests · TTFT p50 45.2 ms p95 80.1 ms · 2400 CPU samples`.
    pub fn line(&self) -> String {
        let secs = |ms: u64| ms / 1000;
        let time = match self.duration_ms {
            Some(total) => format!("{}s/{}s", secs(self.elapsed_ms), secs(total)),
            None => format!("{}s", secs(self.elapsed_ms)),
        };
        let q = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.1} ms"));
        let mut line = format!(
            "recording {time} · {} requests · TTFT p50 {} p95 {}",
            self.requests,
            q(self.ttft_p50_ms),
            q(self.ttft_p95_ms)
        );
        if self.cpu_samples > 0 {
            line.push_str(&format!(" · {} CPU samples", self.cpu_samples));
        }
        if self.events_dropped > 0 {
            line.push_str(&format!(" · {} events dropped", self.events_dropped));
        }
        line
    }
}

/// Prints progress lines to stderr: redrawn in place on a terminal, one
/// line every [`PIPE_EVERY`] otherwise (logs and CI stay readable).
pub struct ProgressPrinter {
    tty: bool,
    last: Option<Instant>,
    drawn: bool,
}

/// How often a non-terminal gets a progress line.
const PIPE_EVERY: Duration = Duration::from_secs(5);

impl Default for ProgressPrinter {
    fn default() -> Self {
        Self {
            tty: std::io::stderr().is_terminal(),
            last: None,
            drawn: false,
        }
    }
}

impl ProgressPrinter {
    pub fn show(&mut self, progress: &Progress) {
        let mut err = std::io::stderr().lock();
        if self.tty {
            let _ = write!(err, "\r\x1b[2K{}", progress.line());
            self.drawn = true;
        } else if self.last.is_none_or(|at| at.elapsed() >= PIPE_EVERY) {
            let _ = writeln!(err, "tokentrace: {}", progress.line());
            self.last = Some(Instant::now());
        }
        let _ = err.flush();
    }

    /// Ends the redrawn line so later output starts on a fresh one.
    pub fn done(&mut self) {
        if self.drawn {
            let _ = writeln!(std::io::stderr());
            self.drawn = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_shows_time_requests_and_ttft() {
        let mut p = Progress {
            elapsed_ms: 12_400,
            duration_ms: Some(30_000),
            requests: 143,
            ..Progress::default()
        };
        assert_eq!(
            p.line(),
            "recording 12s/30s · 143 requests · TTFT p50 - p95 -"
        );
        p.set_ttft(&[80_100_000, 45_200_000, 45_000_000]);
        p.cpu_samples = 2400;
        p.events_dropped = 3;
        p.duration_ms = None;
        assert_eq!(
            p.line(),
            "recording 12s · 143 requests · TTFT p50 45.2 ms p95 80.1 ms · 2400 CPU samples · 3 events dropped"
        );
    }
}
