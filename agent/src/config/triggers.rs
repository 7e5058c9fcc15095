//! The `triggers:` section (read by `crate::trigger`): rolling-window
//! conditions over the timelines the daemon already has, and what a firing
//! records.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::ConfigError;

/// CPU sampling of recording sessions (`record --profile-hz`, triggered
/// sessions): 99 Hz, off the 100 Hz timer tick so samples do not alias it.
pub const DEFAULT_PROFILE_HZ: u64 = 99;

/// The stall causes `stall_share` can name (the JSON `stalls` fields).
pub const CAUSES: [&str; 9] = [
    "queue",
    "preempted",
    "prefill",
    "gpu_sync",
    "flow_control",
    "off_cpu",
    "socket",
    "nagle",
    "unexplained",
];

/// What a trigger measures over its window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// Time to first token, ms (streams only).
    Ttft,
    /// Inter-token gaps, ms (every gap of every stream in the window).
    Itl,
    /// Request start to last byte, ms.
    E2e,
    /// Share of requests (0–1) that ended aborted, whoever closed.
    AbortRate,
    /// Share of requests (0–1) the client gave up on (`client_closed`).
    ClientClosedRate,
    /// Share (0–1) of the window's stall time charged to `cause`.
    StallShare,
}

impl Metric {
    pub fn as_str(self) -> &'static str {
        match self {
            Metric::Ttft => "ttft",
            Metric::Itl => "itl",
            Metric::E2e => "e2e",
            Metric::AbortRate => "abort_rate",
            Metric::ClientClosedRate => "client_closed_rate",
            Metric::StallShare => "stall_share",
        }
    }

    /// Latencies are compared as a percentile, the rest as a share.
    pub fn is_latency(self) -> bool {
        matches!(self, Metric::Ttft | Metric::Itl | Metric::E2e)
    }
}

/// One condition, evaluated per (service, route, model).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Names the rule in logs, session ids and the exported event.
    pub name: String,
    pub metric: Metric,
    /// Latency metrics: which percentile of the window (default 95).
    #[serde(default = "default_percentile")]
    pub percentile: f64,
    /// Fires when the window's value is above this: ms for latencies, a
    /// share in 0–1 otherwise.
    pub above: f64,
    #[serde(default = "default_window", with = "humantime_serde")]
    pub window: Duration,
    /// Requests a window needs before it is judged (a lone slow request is
    /// not an incident).
    #[serde(default = "default_min_requests")]
    pub min_requests: usize,
    /// `stall_share`: the cause (`gpu_sync`, `off_cpu`, `socket`, `nagle`,
    /// `queue`, `preempted`, `prefill`, `flow_control`, …; the JSON `stalls` causes).
    #[serde(default)]
    pub cause: Option<String>,
    /// Only this service / normalised route / model (absent: any).
    #[serde(default)]
    pub service: Option<String>,
    #[serde(default)]
    pub route: Option<String>,
    #[serde(default)]
    pub model: Option<String>,
}

fn default_percentile() -> f64 {
    95.0
}

fn default_window() -> Duration {
    Duration::from_secs(30)
}

fn default_min_requests() -> usize {
    10
}

/// The whole section. Without rules nothing is kept or evaluated.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TriggersConfig {
    pub rules: Vec<Rule>,
    /// Where triggered sessions are written, one directory each.
    pub dir: PathBuf,
    /// Bound on the total size of `dir`'s sessions: the oldest finished
    /// ones are deleted first.
    pub max_total_mib: u64,
    /// History recorded before the firing (from an in-memory ring of the
    /// most recent events).
    #[serde(with = "humantime_serde")]
    pub before: Duration,
    /// How long the session records after the firing.
    #[serde(with = "humantime_serde")]
    pub after: Duration,
    /// After a rule fired, it does not fire again for this long.
    #[serde(with = "humantime_serde")]
    pub cooldown: Duration,
    /// Bound on the pre-trigger ring's memory; the oldest events go first
    /// (the session then covers less than `before`, and says so).
    pub history_max_mib: u64,
    /// CPU sampling of the triggered session (0: no flame graph). Falls
    /// back to none when another session is sampling.
    pub profile_hz: u64,
}

impl Default for TriggersConfig {
    fn default() -> Self {
        crate::defaults::section("triggers")
    }
}

impl TriggersConfig {
    /// Values serde cannot check alone, with the fix in the message.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for rule in &self.rules {
            let name = &rule.name;
            if rule.metric.is_latency() && !(rule.percentile > 0.0 && rule.percentile <= 100.0) {
                return Err(ConfigError::Invalid(format!(
                    "triggers: rule {name:?}: percentile {} is not in (0, 100]",
                    rule.percentile
                )));
            }
            if !rule.metric.is_latency() && !(0.0..1.0).contains(&rule.above) {
                return Err(ConfigError::Invalid(format!(
                    "triggers: rule {name:?}: {} is a share: `above` must be in [0, 1), not {}",
                    rule.metric.as_str(),
                    rule.above
                )));
            }
            if (rule.metric == Metric::StallShare) != rule.cause.is_some() {
                return Err(ConfigError::Invalid(format!(
                    "triggers: rule {name:?}: `cause` goes with metric stall_share, and only with it"
                )));
            }
            if let Some(cause) = rule.cause.as_deref() {
                if !CAUSES.contains(&cause) {
                    return Err(ConfigError::Invalid(format!(
                        "triggers: rule {name:?}: unknown cause {cause:?} (one of {})",
                        CAUSES.join(", ")
                    )));
                }
            }
            if rule.window.is_zero() || rule.min_requests == 0 {
                return Err(ConfigError::Invalid(format!(
                    "triggers: rule {name:?}: window and min_requests must be above zero"
                )));
            }
        }
        if !self.rules.is_empty() && self.after.is_zero() && self.before.is_zero() {
            return Err(ConfigError::Invalid(
                "triggers: before and after are both zero: a session would be empty".into(),
            ));
        }
        Ok(())
    }
}
