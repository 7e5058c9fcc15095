//! Stall causes as metric labels.
//!
//! The explainer splits each late chunk's gap into disjoint causes
//! ([`Stall`]); summed per cause as counters of seconds they answer "what
//! is this service's tail latency spent on" over any window
//! (`rate(tokentrace_stall_time_seconds_total[5m])` by `cause`). The time a
//! chunk's bytes then sat in the send queue is `nagle` when the write had
//! TCP_NODELAY off and `socket` otherwise, so Nagle shows as its own cause.

use crate::model::Stall;

/// One cause of stalled time: `cause` from a fixed set; `reason` only for
/// `off_cpu` (futex, sleep, io, preempted, cuda_sync, `syscall N`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StallCause {
    pub cause: &'static str,
    pub reason: Option<String>,
}

impl StallCause {
    fn plain(cause: &'static str) -> Self {
        Self {
            cause,
            reason: None,
        }
    }

    /// (attribute name, value) pairs.
    pub fn attributes(&self) -> Vec<(&'static str, String)> {
        let mut a = vec![("cause", self.cause.to_string())];
        if let Some(reason) = &self.reason {
            a.push(("reason", reason.clone()));
        }
        a
    }
}

/// The stall's time by cause, in seconds; causes with no time left out.
pub fn causes(stall: &Stall) -> Vec<(StallCause, f64)> {
    let socket = if stall.nagle { "nagle" } else { "socket" };
    let parts = [
        (StallCause::plain("queue"), stall.queue_ms),
        (StallCause::plain("preempted"), stall.preempted_ms),
        (StallCause::plain("prefill"), stall.prefill_ms),
        (StallCause::plain("gpu_sync"), stall.gpu_sync_ms),
        (StallCause::plain("flow_control"), stall.flow_control_ms),
        (
            StallCause {
                cause: "off_cpu",
                reason: stall.off_cpu_reason.clone(),
            },
            stall.off_cpu_ms,
        ),
        (StallCause::plain(socket), stall.socket_ms),
        (StallCause::plain("unexplained"), stall.unexplained_ms),
    ];
    parts
        .into_iter()
        .filter(|(_, ms)| *ms > 0.0 && ms.is_finite())
        .map(|(cause, ms)| (cause, ms / 1e3))
        .collect()
}

/// The cause with the most time (the label of the stall-duration
/// histogram); `unexplained` when nothing was attributed.
pub fn dominant(stall: &Stall) -> &'static str {
    causes(stall)
        .into_iter()
        .fold(None::<(&'static str, f64)>, |best, (c, s)| match best {
            Some((_, b)) if b >= s => best,
            _ => Some((c.cause, s)),
        })
        .map_or("unexplained", |(c, _)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stall() -> Stall {
        Stall {
            chunk: 3,
            start_ms: 70.0,
            gap_ms: 150.0,
            gpu_sync_ms: 20.0,
            off_cpu_ms: 100.0,
            off_cpu_reason: Some("futex".into()),
            socket_ms: 4.0,
            nagle: true,
            unexplained_ms: 30.0,
            ..Stall::default()
        }
    }

    #[test]
    fn causes_with_time_are_seconds_and_socket_time_is_nagle_when_it_was() {
        let s = stall();
        let all = causes(&s);
        let got: Vec<(&str, Option<&str>, f64)> = all
            .iter()
            .map(|(c, v)| (c.cause, c.reason.as_deref(), *v))
            .collect();
        assert_eq!(
            got,
            vec![
                ("gpu_sync", None, 0.02),
                ("off_cpu", Some("futex"), 0.1),
                ("nagle", None, 0.004),
                ("unexplained", None, 0.03),
            ]
        );
        assert_eq!(dominant(&s), "off_cpu");
        let mut evicted = s.clone();
        evicted.preempted_ms = 200.0;
        assert_eq!(causes(&evicted)[0], (StallCause::plain("preempted"), 0.2));
        assert_eq!(dominant(&evicted), "preempted");
        let mut plain = s;
        plain.nagle = false;
        plain.off_cpu_ms = 0.0;
        assert_eq!(causes(&plain)[1].0.cause, "socket");
        assert_eq!(dominant(&plain), "unexplained");
    }
}
