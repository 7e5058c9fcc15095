//! A trigger's firing (made by `trigger`, exported by `export`): which rule
//! judged which window over what bound, and the session recording it.

/// The labels a window is kept for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TriggerKey {
    pub service: String,
    pub route: String,
    pub model: String,
}

/// Why a rule fired, for the log line, the session and the exported event.
#[derive(Debug, Clone, PartialEq)]
pub struct Firing {
    pub rule: String,
    /// The rule's metric (`ttft`, `abort_rate`, …).
    pub metric: &'static str,
    /// A latency in ms (else a share in 0–1).
    pub latency: bool,
    pub value: f64,
    pub above: f64,
    pub window_s: f64,
    pub requests: usize,
    pub key: TriggerKey,
    /// The session recording it; None when it could not start (`error`).
    pub session: Option<String>,
    pub error: Option<String>,
    /// Seconds of history the session starts with.
    pub history_s: f64,
}

impl Firing {
    /// One line: what crossed which bound where.
    pub fn describe(&self) -> String {
        let what = if self.latency {
            format!("{} {:.1} ms > {} ms", self.metric, self.value, self.above)
        } else {
            format!("{} {:.3} > {}", self.metric, self.value, self.above)
        };
        format!(
            "trigger {:?}: {what} over {:.0} s ({} requests) on service={} route={} model={}",
            self.rule,
            self.window_s,
            self.requests,
            self.key.service,
            self.key.route,
            self.key.model
        )
    }
}
