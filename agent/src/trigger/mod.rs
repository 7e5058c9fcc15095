//! SLO triggers in the daemon: when a rolling-window condition over the
//! reported timelines holds (TTFT p95 over 30 s above X ms, an abort rate,
//! a stall cause's share…), the agent records a session by itself, with
//! the seconds before the firing taken from an in-memory ring of recent
//! events, so the short incident nobody was watching leaves a report.
//!
//! The stage sits after explanation (it reads stalls) and beside export:
//! the run loop hands it every event batch (for the ring) and every
//! reported timeline (for the windows). Sessions run on the session hub's
//! threads like `record --remote` ones; the control endpoint lists them.

mod disk;
mod history;
mod window;

use std::collections::HashMap;

use crate::config::{Rule, TriggersConfig};
use crate::event::{Event, MonoNs};
use crate::model::{Firing, RequestTimeline, TriggerKey as Key};
use crate::session::{SelectorSpec, SessionHub, SessionRequest, StartError, Triggered};
use crate::units::nanos;

use history::History;
use window::{Verdict, Window};

/// Label sets judged per rule; later ones share one "other" window (a path
/// full of ids must not grow the agent without bound).
const MAX_KEYS: usize = 256;
const OTHER: &str = "other";

struct RuleState {
    rule: Rule,
    window_ns: u64,
    windows: HashMap<Key, Window>,
    last_fired: Option<MonoNs>,
}

impl RuleState {
    fn matches(&self, key: &Key) -> bool {
        let want =
            |filter: &Option<String>, value: &str| filter.as_deref().is_none_or(|f| f == value);
        want(&self.rule.service, &key.service)
            && want(&self.rule.route, &key.route)
            && want(&self.rule.model, &key.model)
    }
}

/// The window of `key`, or the shared "other" one once `windows` holds
/// [`MAX_KEYS`] label sets.
fn window_for(windows: &mut HashMap<Key, Window>, key: Key) -> &mut Window {
    let key = if windows.len() >= MAX_KEYS && !windows.contains_key(&key) {
        Key {
            service: OTHER.into(),
            route: OTHER.into(),
            model: OTHER.into(),
        }
    } else {
        key
    };
    windows.entry(key).or_default()
}

/// The daemon's triggers.
pub struct Triggers {
    config: TriggersConfig,
    rules: Vec<RuleState>,
    history: History,
    hub: SessionHub,
}

impl Triggers {
    /// None without rules: nothing is kept or evaluated.
    pub fn new(config: TriggersConfig, hub: SessionHub) -> Option<Self> {
        if config.rules.is_empty() {
            return None;
        }
        let rules = config
            .rules
            .iter()
            .map(|rule| RuleState {
                rule: rule.clone(),
                window_ns: nanos(rule.window),
                windows: HashMap::new(),
                last_fired: None,
            })
            .collect();
        let max_bytes =
            usize::try_from(config.history_max_mib.saturating_mul(1 << 20)).unwrap_or(usize::MAX);
        Some(Self {
            history: History::new(nanos(config.before), max_bytes),
            rules,
            hub,
            config,
        })
    }

    /// Every event batch of the run loop, before it is stitched.
    pub fn on_events(&mut self, batch: &[Event], now: MonoNs) {
        self.history.push(batch, now);
    }

    /// Heap the pre-trigger ring holds now.
    pub fn history_bytes(&self) -> usize {
        self.history.bytes()
    }

    /// A reported timeline of `service`; returns the firings it caused.
    pub fn observe(&mut self, service: &str, route: &str, t: &RequestTimeline) -> Vec<Firing> {
        let key = Key {
            service: service.to_string(),
            route: route.to_string(),
            model: t.model.clone().unwrap_or_default(),
        };
        let now = t.end;
        let mut verdicts: Vec<(usize, Verdict)> = Vec::new();
        for (i, state) in self.rules.iter_mut().enumerate() {
            if !state.matches(&key) {
                continue;
            }
            let rule = &state.rule;
            let window = window_for(&mut state.windows, key.clone());
            window.add(rule, t);
            window.expire(now, state.window_ns);
            let Some(verdict) = window.judge_at(rule, now) else {
                continue;
            };
            let cooled = state
                .last_fired
                .is_none_or(|at| now.saturating_sub(at) >= nanos(self.config.cooldown));
            if verdict.value > rule.above && cooled {
                state.last_fired = Some(now);
                verdicts.push((i, verdict));
            }
        }
        verdicts
            .into_iter()
            .map(|(i, verdict)| self.fire(i, verdict, key.clone(), now))
            .collect()
    }

    fn fire(&mut self, rule: usize, verdict: Verdict, key: Key, now: MonoNs) -> Firing {
        let rule = &self.rules[rule].rule;
        let mut firing = Firing {
            rule: rule.name.clone(),
            metric: rule.metric.as_str(),
            latency: rule.metric.is_latency(),
            value: verdict.value,
            above: rule.above,
            window_s: rule.window.as_secs_f64(),
            requests: verdict.requests,
            key,
            session: None,
            error: None,
            history_s: 0.0,
        };
        let history = self.history.snapshot();
        firing.history_s = history
            .from
            .map_or(0.0, |from| now.saturating_sub(from) as f64 / 1e9);
        let dir = disk::session_dir(&self.config.dir, &rule.name);
        let mut request = SessionRequest {
            selector: SelectorSpec::default(),
            duration: Some(self.config.after),
            profile_hz: self.config.profile_hz,
            raw: false,
        };
        // The ring's copy (up to history_max_mib, made on the run loop)
        // moves into the session; only the retry without CPU sampling
        // (another session samples) takes a second one.
        let triggered = |history: history::Snapshot, reason: String| Triggered {
            reason,
            history: history.batches,
            from: history.from,
            evicted_early: history.evicted_early,
        };
        let reason = firing.describe();
        let mut started = self.hub.start_triggered(
            request.clone(),
            dir.clone(),
            triggered(history, reason.clone()),
        );
        if matches!(started, Err(StartError::ProfilerBusy(_))) {
            request.profile_hz = 0;
            let history = self.history.snapshot();
            started = self
                .hub
                .start_triggered(request, dir, triggered(history, reason));
        }
        match started {
            Ok(status) => firing.session = Some(status.id),
            Err(err) => firing.error = Some(err.to_string()),
        }
        firing
    }

    /// Periodic upkeep: windows of label sets gone quiet are dropped, and
    /// the session directory is held to its size bound.
    pub fn tick(&mut self, now: MonoNs) {
        for state in &mut self.rules {
            let window_ns = state.window_ns;
            state.windows.retain(|_, w| {
                w.expire(now, window_ns);
                !w.is_empty()
            });
        }
        let max = self.config.max_total_mib.saturating_mul(1 << 20);
        disk::prune(&self.config.dir, max, &self.hub);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::window::tests::timeline_with_chunks;
    use super::*;
    use crate::config::{ExplainConfig, Metric};
    use crate::session::HubSettings;
    use crate::stitch::StitchConfig;

    const MS: u64 = 1_000_000;

    fn stream(end: MonoNs, ttft_ms: u64) -> RequestTimeline {
        timeline_with_chunks(end, ttft_ms, &[])
    }

    #[test]
    fn fires_once_per_cooldown_and_records_a_session_with_its_history() {
        let dir = std::env::temp_dir().join(format!("tt-trigger-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let hub = SessionHub::new(HubSettings {
            stitch: StitchConfig::default(),
            idle_timeout: Duration::from_secs(300),
            explain: ExplainConfig::default(),
            sessions_dir: dir.join("remote"),
            allow_raw: false,
            max_duration: None,
        });
        let config = TriggersConfig {
            rules: vec![Rule {
                name: "slow ttft".into(),
                metric: Metric::Ttft,
                percentile: 95.0,
                above: 100.0,
                window: Duration::from_secs(5),
                min_requests: 3,
                cause: None,
                service: None,
                route: Some("/v1/chat/completions".into()),
                model: None,
            }],
            dir: dir.join("triggered"),
            after: Duration::from_millis(100),
            cooldown: Duration::from_secs(60),
            profile_hz: 0,
            ..TriggersConfig::default()
        };
        let mut triggers = Triggers::new(config, hub.clone()).expect("a rule");
        let route = "/v1/chat/completions";
        let mut fired = Vec::new();
        let mut at = 10_000 * MS;
        for ttft in [20, 20, 20, 20, 300, 300, 300, 300, 300, 300, 300, 300] {
            at += 500 * MS;
            fired.extend(triggers.observe("svc", route, &stream(at, ttft)));
            // Another route never counts towards this rule.
            assert!(triggers
                .observe("svc", "/health", &stream(at, 900))
                .is_empty());
        }
        assert_eq!(fired.len(), 1, "{fired:?}");
        let f = &fired[0];
        assert_eq!((f.value, f.key.route.as_str()), (300.0, route));
        assert!(
            f.describe().contains("ttft 300.0 ms > 100 ms"),
            "{}",
            f.describe()
        );
        let id = f
            .session
            .clone()
            .unwrap_or_else(|| panic!("no session: {:?}", f.error));
        let status = hub.wait(&id).expect("the session");
        assert!(status
            .trigger
            .as_deref()
            .is_some_and(|r| r.contains("slow ttft")));
        assert!(!status.artifacts.is_empty(), "{status:?}");
        // Past the cooldown it fires again.
        at += 61_000 * MS;
        let again: Vec<Firing> = (0..3)
            .flat_map(|i| triggers.observe("svc", route, &stream(at + i * 300 * MS, 300)))
            .collect();
        assert_eq!(again.len(), 1);
        hub.shutdown();
        // Bound 0: every finished session goes.
        triggers.config.max_total_mib = 0;
        triggers.tick(at);
        let left = std::fs::read_dir(dir.join("triggered")).map_or(0, |d| d.count());
        assert_eq!(left, 0);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
