//! Tail-based span sampling (`export.sampling`).
//!
//! The agent sees each request whole before it exports anything, so it can
//! decide on the outcome, as a tail-sampling collector does, without
//! buffering traces: slow, aborted, cancelled and stalled requests always
//! keep their spans; of the rest, a fixed fraction. Metrics are recorded
//! before the decision and count every request.
//!
//! The fraction is decided from the trace id (its rightmost 56 bits, the
//! part W3C Trace Context level 2 makes random, compared with
//! `rate * 2^56`, as OTel's consistent-probability samplers do), so the
//! decision is a pure function of the request: reproducible in tests, and
//! the same for every span of a trace.
//!
//! A caller's `traceparent` with the sampled flag set keeps the span (its
//! trace is being recorded); with the flag clear the caller decided not to
//! record the trace and no span is made, whatever the outcome, as before
//! (`tokentrace.spans.not_sampled`).

use std::time::Duration;

use serde::Deserialize;

use crate::export::error::ExportError;
use crate::model::{AbortReason, RequestTimeline};

/// The span attribute that says why a request's spans were kept.
pub const REASON_ATTRIBUTE: &str = "tokentrace.sampling.reason";

/// `export.sampling:` in the YAML config.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingConfig {
    /// Fraction (0 to 1) of the requests no rule keeps whose spans are
    /// exported anyway.
    pub base_rate: f64,
    /// Keep requests whose TTFT is at least this (null: no TTFT rule).
    #[serde(with = "humantime_serde")]
    pub slow_ttft: Option<Duration>,
    /// Keep requests whose end-to-end time is at least this.
    #[serde(with = "humantime_serde")]
    pub slow_e2e: Option<Duration>,
    /// Keep requests with an inter-token gap at least this long.
    #[serde(with = "humantime_serde")]
    pub slow_itl: Option<Duration>,
    /// Keep requests the server or the connection aborted.
    pub keep_aborted: bool,
    /// Keep requests the client cancelled (`client_closed`).
    pub keep_cancelled: bool,
    /// Keep requests with a stall (a gap of at least
    /// `explain.stall_threshold`).
    pub keep_stalled: bool,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        crate::defaults::section("export.sampling")
    }
}

/// Why a request's spans were exported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Cancelled,
    Aborted,
    SlowTtft,
    SlowE2e,
    SlowItl,
    Stalled,
    /// The caller's `traceparent` had the sampled flag.
    ParentSampled,
    /// Chosen by `base_rate`.
    Base,
}

impl Reason {
    /// The value of `tokentrace.sampling.reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Cancelled => "cancelled",
            Reason::Aborted => "aborted",
            Reason::SlowTtft => "slow_ttft",
            Reason::SlowE2e => "slow_e2e",
            Reason::SlowItl => "slow_itl",
            Reason::Stalled => "stalled",
            Reason::ParentSampled => "parent_sampled",
            Reason::Base => "base_rate",
        }
    }
}

/// Resolved `export.sampling`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// Trace ids whose rightmost 56 bits are below this are kept by the
    /// base rate (2^56: every one).
    base_threshold: u64,
    slow_ttft_ns: Option<u64>,
    slow_e2e_ns: Option<u64>,
    slow_itl_ns: Option<u64>,
    keep_aborted: bool,
    keep_cancelled: bool,
    keep_stalled: bool,
}

const RANDOM_BITS: u32 = 56;

impl Sampling {
    /// Validates the config: a base rate outside 0..=1 is an error.
    pub fn new(c: &SamplingConfig) -> Result<Self, ExportError> {
        if !(0.0..=1.0).contains(&c.base_rate) {
            return Err(ExportError::SamplingRate(c.base_rate));
        }
        let ns = |d: Option<Duration>| d.map(crate::units::nanos);
        let full = 1u64 << RANDOM_BITS;
        Ok(Self {
            // exact for 1.0: every id is below 2^56
            base_threshold: (c.base_rate * full as f64) as u64,
            slow_ttft_ns: ns(c.slow_ttft),
            slow_e2e_ns: ns(c.slow_e2e),
            slow_itl_ns: ns(c.slow_itl),
            keep_aborted: c.keep_aborted,
            keep_cancelled: c.keep_cancelled,
            keep_stalled: c.keep_stalled,
        })
    }

    /// Keeps every span (the default config).
    pub fn keep_all() -> Self {
        Self {
            base_threshold: 1 << RANDOM_BITS,
            slow_ttft_ns: None,
            slow_e2e_ns: None,
            slow_itl_ns: None,
            keep_aborted: true,
            keep_cancelled: true,
            keep_stalled: true,
        }
    }

    /// Why `t`'s spans are kept, or `None` to drop them. `parent_sampled`:
    /// the caller's `traceparent` had the sampled flag; `trace_id`: the
    /// trace the spans would go in.
    pub fn decide(
        &self,
        t: &RequestTimeline,
        parent_sampled: bool,
        trace_id: &[u8; 16],
    ) -> Option<Reason> {
        let at_least = |v: Option<u64>, limit: Option<u64>| match (v, limit) {
            (Some(v), Some(limit)) => v >= limit,
            _ => false,
        };
        if t.aborted {
            let cancelled = t.abort_reason == Some(AbortReason::ClientClosed);
            if cancelled && self.keep_cancelled {
                return Some(Reason::Cancelled);
            }
            if !cancelled && self.keep_aborted {
                return Some(Reason::Aborted);
            }
        }
        if at_least(t.ttft_ns(), self.slow_ttft_ns) {
            return Some(Reason::SlowTtft);
        }
        if at_least(Some(t.e2e_ns()), self.slow_e2e_ns) {
            return Some(Reason::SlowE2e);
        }
        if at_least(t.stats().itl_max_ns(), self.slow_itl_ns) {
            return Some(Reason::SlowItl);
        }
        if self.keep_stalled && !t.stalls.is_empty() {
            return Some(Reason::Stalled);
        }
        if parent_sampled {
            return Some(Reason::ParentSampled);
        }
        (random_bits(trace_id) < self.base_threshold).then_some(Reason::Base)
    }
}

/// The rightmost 56 bits of a trace id.
fn random_bits(trace_id: &[u8; 16]) -> u64 {
    let mut b = [0u8; 8];
    b[1..].copy_from_slice(&trace_id[9..]);
    u64::from_be_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::trace_context::IdGenerator;

    fn config() -> SamplingConfig {
        SamplingConfig {
            base_rate: 0.01,
            slow_ttft: Some(Duration::from_millis(200)),
            slow_e2e: Some(Duration::from_secs(2)),
            slow_itl: Some(Duration::from_millis(100)),
            ..SamplingConfig::default()
        }
    }

    #[test]
    fn outcomes_keep_their_spans_in_rule_order() {
        let s = Sampling::new(&config()).expect("valid");
        // 40 ms TTFT, gaps of 15 ms but one of 150 ms, 235 ms in all
        let never = [0xff; 16];
        let slow = crate::export::spans::tests::sse();
        assert_eq!(s.decide(&slow, false, &never), Some(Reason::SlowItl));
        // A timeline's gaps are worked out once, when first read: the cases
        // below change it only in ways that keep its gaps (15 ms, 15 ms).
        let mut t = crate::export::spans::tests::sse();
        t.chunk_ts.truncate(3);
        assert_eq!(s.decide(&t, false, &never), None, "fast: base rate");
        assert_eq!(s.decide(&t, true, &never), Some(Reason::ParentSampled));
        assert_eq!(s.decide(&t, false, &[0; 16]), Some(Reason::Base));
        t.stalls.push(crate::model::Stall {
            chunk: 1,
            gap_ms: 40.0,
            unexplained_ms: 40.0,
            ..crate::model::Stall::default()
        });
        assert_eq!(s.decide(&t, true, &never), Some(Reason::Stalled));
        t.end = t.request_start + 2_000_000_000;
        assert_eq!(s.decide(&t, false, &never), Some(Reason::SlowE2e));
        t.chunk_ts.iter_mut().for_each(|c| *c += 160_000_000);
        assert_eq!(s.decide(&t, false, &never), Some(Reason::SlowTtft));
        t.aborted = true;
        t.abort_reason = Some(AbortReason::ServerClosed);
        assert_eq!(s.decide(&t, false, &never), Some(Reason::Aborted));
        t.abort_reason = Some(AbortReason::ClientClosed);
        assert_eq!(s.decide(&t, false, &never), Some(Reason::Cancelled));
        let off = Sampling::new(&SamplingConfig {
            keep_cancelled: false,
            keep_stalled: false,
            ..config()
        })
        .expect("valid");
        assert_eq!(off.decide(&t, false, &never), Some(Reason::SlowTtft));
    }

    #[test]
    fn the_base_rate_is_a_fraction_of_trace_ids_within_a_binomial_bound() {
        let s = Sampling::new(&config()).expect("valid");
        let mut t = crate::export::spans::tests::sse();
        t.chunk_ts.truncate(3);
        let mut ids = IdGenerator::with_seed(7);
        let n = 100_000;
        let kept = (0..n)
            .filter(|_| s.decide(&t, false, &ids.trace_id()).is_some())
            .count();
        // mean 1000, sd ~31.5: 5 sd either side
        assert!((843..=1157).contains(&kept), "{kept} of {n} kept at 1 %");
        let all = Sampling::keep_all();
        assert_eq!(
            Sampling::new(&SamplingConfig::default()).expect("valid"),
            all
        );
        assert!((0..1000).all(|_| all.decide(&t, false, &ids.trace_id()).is_some()));
        let none = Sampling::new(&SamplingConfig {
            base_rate: 0.0,
            ..config()
        })
        .expect("valid");
        assert!((0..1000).all(|_| none.decide(&t, false, &ids.trace_id()).is_none()));
    }

    #[test]
    fn a_rate_outside_zero_to_one_is_an_error() {
        for rate in [-0.1, 1.5, f64::NAN] {
            let err = Sampling::new(&SamplingConfig {
                base_rate: rate,
                ..SamplingConfig::default()
            });
            assert!(
                err.as_ref()
                    .is_err_and(|e| e.to_string().contains("export.sampling.base_rate")),
                "{rate}: {err:?}"
            );
        }
    }
}
