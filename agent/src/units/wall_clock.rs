//! Kernel monotonic time → Unix wall-clock time, for span timestamps
//! (`export`) and a recording's wall-clock offset (`session`).
//!
//! Every event carries `bpf_ktime_get_ns()` (CLOCK_MONOTONIC). OTLP wants
//! Unix nanoseconds, and the spans must line up with the caller's own spans
//! (stamped from CLOCK_REALTIME) to well within a millisecond. The offset
//! between the two clocks is measured here, once per [`WallClock`], from
//! several tightly bracketed reads: the pair with the smallest bracket bounds
//! the error by half that bracket (tens of nanoseconds with the vDSO).
//!
//! CLOCK_MONOTONIC is slewed together with CLOCK_REALTIME, so the offset only
//! moves when the wall clock is stepped (settimeofday, an NTP step); the
//! exporter re-measures it periodically to follow such steps.

use crate::event::MonoNs;

/// Paired reads taken per measurement; the tightest one wins.
const SAMPLES: usize = 16;

/// A measured `CLOCK_REALTIME − CLOCK_MONOTONIC` offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WallClock {
    /// Unix nanoseconds minus monotonic nanoseconds.
    offset_ns: i128,
    /// Half the bracket of the read pair the offset came from.
    uncertainty_ns: u64,
    /// Monotonic time of the measurement, to know when to re-measure.
    measured_at: MonoNs,
}

fn read(clock: libc::clockid_t) -> i128 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer and both clock ids always exist on
    // Linux, so clock_gettime cannot fail.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    i128::from(ts.tv_sec) * 1_000_000_000 + i128::from(ts.tv_nsec)
}

impl WallClock {
    /// Measures the offset now: of [`SAMPLES`] reads of REALTIME bracketed by
    /// two MONOTONIC reads, keeps the one with the shortest bracket and
    /// assumes REALTIME was read at its midpoint.
    pub fn measure() -> Self {
        let mut best: Option<(i128, i128, i128)> = None;
        for _ in 0..SAMPLES {
            let before = read(libc::CLOCK_MONOTONIC);
            let real = read(libc::CLOCK_REALTIME);
            let after = read(libc::CLOCK_MONOTONIC);
            if best.is_none_or(|(b, _, a)| after - before < a - b) {
                best = Some((before, real, after));
            }
        }
        // SAMPLES > 0, so `best` is set; the fallback only satisfies the type.
        let (before, real, after) = best.unwrap_or((0, 0, 0));
        let mid = before + (after - before) / 2;
        Self {
            offset_ns: real - mid,
            uncertainty_ns: u64::try_from((after - before) / 2).unwrap_or(u64::MAX),
            measured_at: u64::try_from(mid).unwrap_or(0),
        }
    }

    /// A clock with a known offset (tests, replays).
    pub fn with_offset(offset_ns: i128, measured_at: MonoNs) -> Self {
        Self {
            offset_ns,
            uncertainty_ns: 0,
            measured_at,
        }
    }

    /// Unix nanoseconds of a monotonic timestamp (0 if it would precede the
    /// epoch, which only a nonsensical offset can cause).
    pub fn unix_nanos(&self, mono: MonoNs) -> u64 {
        u64::try_from(i128::from(mono) + self.offset_ns).unwrap_or(0)
    }

    /// Unix nanoseconds minus monotonic nanoseconds.
    pub fn offset_ns(&self) -> i128 {
        self.offset_ns
    }

    /// Error bound of the measurement, in nanoseconds.
    pub fn uncertainty_ns(&self) -> u64 {
        self.uncertainty_ns
    }

    /// Monotonic time at which the offset was measured.
    pub fn measured_at(&self) -> MonoNs {
        self.measured_at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measured_offset_matches_the_system_clocks_within_a_few_microseconds() {
        let clock = WallClock::measure();
        assert!(
            clock.uncertainty_ns() < 50_000,
            "bracket {} ns",
            clock.uncertainty_ns()
        );
        let mono = read(libc::CLOCK_MONOTONIC);
        let real = read(libc::CLOCK_REALTIME);
        let converted = clock.unix_nanos(u64::try_from(mono).expect("positive"));
        let err = (i128::from(converted) - real).abs();
        // the two reads above are a few hundred ns apart at most
        assert!(err < 100_000, "conversion off by {err} ns");
    }

    #[test]
    fn conversion_is_a_pure_shift() {
        let clock = WallClock::with_offset(1_700_000_000_000_000_000, 5);
        assert_eq!(clock.unix_nanos(0), 1_700_000_000_000_000_000);
        assert_eq!(clock.unix_nanos(1_234), 1_700_000_000_000_001_234);
        assert_eq!(clock.measured_at(), 5);
        let negative = WallClock::with_offset(-10, 0);
        assert_eq!(negative.unix_nanos(3), 0, "before the epoch saturates to 0");
    }
}
