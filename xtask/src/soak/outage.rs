//! One collector outage, judged: how soon after the collector was back the
//! backlog reached it, and what was dropped while it was down.
//!
//! The backlog is every request agent A reported while the collector was
//! down; it has drained when the last of their SERVER spans reached the
//! collector (arrival times as the collector's output was read). Spans may
//! be dropped only when the bounded queue had no room: drops with room, an
//! `export_failed` drop (a down collector refuses nothing) or a backlog
//! request that never arrived without a drop to account for it fail the
//! outage, as does a drain slower than [`MAX_DRAIN_S`].

use serde_json::{json, Value};

use super::agent::Report;
use super::sampler::Sample;

/// Longest wait from the collector's return to its last backlog span.
pub const MAX_DRAIN_S: f64 = 2.0;

/// What one outage is judged from.
pub struct Outage<'a> {
    pub down: f64,
    pub up: f64,
    /// When the next outage (or the main phase) begins: drops are counted
    /// up to here.
    pub until: f64,
    pub reports: &'a [Report],
    /// Agent A's samples, in time order.
    pub samples: &'a [&'a Sample],
}

#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub backlog: usize,
    pub arrived: usize,
    pub drained_after_s: Option<f64>,
    pub dropped_queue_full: f64,
    pub dropped_export_failed: f64,
    pub queue_peak: Option<f64>,
    pub queue_capacity: Option<f64>,
    pub failures: Vec<String>,
}

impl Outage<'_> {
    /// `arrived_at`: when a request's SERVER span reached the collector.
    pub fn judge(&self, arrived_at: impl Fn(u64) -> Option<f64>) -> Verdict {
        let backlog: Vec<u64> = self
            .reports
            .iter()
            .filter(|r| r.at >= self.down && r.at < self.up)
            .map(|r| r.rid)
            .collect();
        let arrivals: Vec<f64> = backlog.iter().filter_map(|&rid| arrived_at(rid)).collect();
        let drained_after_s = arrivals
            .iter()
            .copied()
            .fold(None, |m: Option<f64>, t| Some(m.map_or(t, |m| m.max(t))))
            .map(|last| (last - self.up).max(0.0));
        let before = self.samples.iter().rev().find(|s| s.t <= self.down);
        let after = self.samples.iter().rev().find(|s| s.t <= self.until);
        let delta = |f: fn(&Sample) -> f64| match (before, after) {
            (Some(b), Some(a)) => f(a) - f(b),
            _ => 0.0,
        };
        let dropped_queue_full = delta(|s| s.dropped_full);
        let dropped_export_failed = delta(|s| s.dropped_failed);
        let during = self
            .samples
            .iter()
            .filter(|s| s.t >= self.down && s.t <= self.until);
        let queue_peak = during.clone().filter_map(|s| s.queue_len).reduce(f64::max);
        let queue_capacity = during.filter_map(|s| s.queue_cap).reduce(f64::max);
        let was_full = matches!((queue_peak, queue_capacity), (Some(p), Some(c)) if p >= c);

        let mut failures = Vec::new();
        match drained_after_s {
            Some(d) if d > MAX_DRAIN_S => failures.push(format!(
                "backlog drained {d:.2} s after the collector was back (bound {MAX_DRAIN_S} s)"
            )),
            _ => {}
        }
        if dropped_export_failed > 0.0 {
            failures.push(format!(
                "{dropped_export_failed} spans dropped as export_failed: a down collector refuses nothing"
            ));
        }
        if dropped_queue_full > 0.0 && !was_full {
            failures.push(format!(
                "{dropped_queue_full} spans dropped with room in the queue (peak {queue_peak:?} of {queue_capacity:?})"
            ));
        }
        let lost = backlog.len() - arrivals.len();
        if lost > 0 && dropped_queue_full + dropped_export_failed == 0.0 {
            failures.push(format!(
                "{lost} requests of the backlog never reached the collector, and the agent counted no drop"
            ));
        }
        Verdict {
            backlog: backlog.len(),
            arrived: arrivals.len(),
            drained_after_s,
            dropped_queue_full,
            dropped_export_failed,
            queue_peak,
            queue_capacity,
            failures,
        }
    }
}

impl Verdict {
    pub fn json(&self, down_at_s: f64, up_at_s: f64) -> Value {
        json!({"down_at_s": down_at_s, "up_at_s": up_at_s,
               "backlog_requests": self.backlog, "backlog_arrived": self.arrived,
               "drained_after_s": self.drained_after_s,
               "spans_dropped": {"queue_full": self.dropped_queue_full,
                                 "export_failed": self.dropped_export_failed},
               "queue_peak": self.queue_peak, "queue_capacity": self.queue_capacity,
               "pass": self.failures.is_empty(), "failures": self.failures})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t: f64, queue: f64, full: f64, failed: f64) -> Sample {
        Sample {
            t,
            tag: "A",
            rss_kib: None,
            cpu_ns: None,
            queue_len: Some(queue),
            queue_cap: Some(100.0),
            exported: 0.0,
            dropped_full: full,
            dropped_failed: failed,
            lost_kernel: 0.0,
            lost_agent: 0.0,
            load1: None,
            lock_held: false,
        }
    }

    fn report(rid: u64, at: f64) -> Report {
        Report { rid, pid: 1, at }
    }

    #[test]
    fn the_drain_is_the_last_backlog_arrival_and_drops_need_a_full_queue() {
        let reports = [
            report(1, 5.0),
            report(2, 11.0),
            report(3, 12.0),
            report(4, 25.0),
        ];
        let samples = [
            sample(9.0, 0.0, 0.0, 0.0),
            sample(15.0, 40.0, 0.0, 0.0),
            sample(22.0, 0.0, 3.0, 0.0),
        ];
        let refs: Vec<&Sample> = samples.iter().collect();
        let outage = Outage {
            down: 10.0,
            up: 20.0,
            until: 30.0,
            reports: &reports,
            samples: &refs,
        };
        // rid 1 was before the outage, 4 after: only 2 and 3 are its backlog
        let v = outage.judge(|rid| match rid {
            2 => Some(20.4),
            3 => Some(21.1),
            _ => Some(0.0),
        });
        assert_eq!((v.backlog, v.arrived), (2, 2));
        assert!((v.drained_after_s.expect("drained") - 1.1).abs() < 1e-9);
        assert_eq!(v.dropped_queue_full, 3.0);
        assert_eq!(v.failures.len(), 1, "{:?}", v.failures);
        assert!(v.failures[0].contains("with room"), "{:?}", v.failures);

        // a full queue explains the drops; a slow drain still fails
        let samples = [
            sample(9.0, 0.0, 0.0, 0.0),
            sample(15.0, 100.0, 0.0, 0.0),
            sample(22.0, 0.0, 3.0, 0.0),
        ];
        let refs: Vec<&Sample> = samples.iter().collect();
        let outage = Outage {
            samples: &refs,
            ..outage
        };
        let v = outage.judge(|rid| (rid == 2).then_some(23.5));
        assert_eq!((v.backlog, v.arrived), (2, 1));
        assert_eq!(v.failures.len(), 1, "{:?}", v.failures);
        assert!(v.failures[0].contains("3.50 s"), "{:?}", v.failures);
        let ok = outage.judge(|rid| Some(20.0 + rid as f64 * 0.1));
        assert!(ok.failures.is_empty(), "{:?}", ok.failures);
    }

    #[test]
    fn an_unexplained_loss_or_an_export_failure_fails() {
        let reports = [report(2, 11.0)];
        let judge = |samples: &[Sample]| {
            let refs: Vec<&Sample> = samples.iter().collect();
            Outage {
                down: 10.0,
                up: 20.0,
                until: 30.0,
                reports: &reports,
                samples: &refs,
            }
            .judge(|_| None)
        };
        let v = judge(&[sample(9.0, 0.0, 0.0, 0.0), sample(22.0, 0.0, 0.0, 4.0)]);
        assert_eq!(v.drained_after_s, None);
        assert_eq!(v.failures.len(), 1, "{:?}", v.failures);
        assert!(v.failures[0].contains("export_failed"));
        let v = judge(&[sample(9.0, 0.0, 0.0, 0.0), sample(22.0, 0.0, 0.0, 0.0)]);
        assert!(v.failures[0].contains("never reached"), "{:?}", v.failures);
    }
}
