//! The agent's side of the live view: the run loop writes into it, the
//! viewer (in-process, or the control endpoint for `top --remote`) asks it
//! for snapshots.

use std::sync::{Arc, Mutex, PoisonError};

use super::recent::Recent;
use super::snapshot::{AgentStatus, TopSnapshot};
use super::totals::route_totals;
use crate::export::{Labels, Shared};
use crate::model::RequestTimeline;
use crate::units::monotonic_now;

/// Cheap to clone: every clone is the same feed.
#[derive(Clone)]
pub struct LiveFeed {
    metrics: Arc<Shared>,
    state: Arc<Mutex<State>>,
}

struct State {
    started_ns: u64,
    recent: Recent,
    agent: AgentStatus,
}

impl LiveFeed {
    /// A feed over the exporter's aggregation (`metrics`), started now.
    pub fn new(metrics: Arc<Shared>) -> Self {
        Self {
            metrics,
            state: Arc::new(Mutex::new(State {
                started_ns: monotonic_now(),
                recent: Recent::default(),
                agent: AgentStatus::default(),
            })),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A request the server finished (the metrics have it already: the
    /// exporter recorded it).
    pub fn record(&self, labels: &Labels, t: &RequestTimeline) {
        self.state().recent.record(labels, t);
    }

    pub fn set_agent(&self, status: AgentStatus) {
        self.state().agent = status;
    }

    /// The totals now and the slowest requests of the last `window_ns`.
    pub fn snapshot(&self, window_ns: u64) -> TopSnapshot {
        let (metrics, _) = self.metrics.snapshot();
        let at_ns = monotonic_now();
        let state = self.state();
        TopSnapshot {
            at_ns,
            started_ns: state.started_ns,
            routes: route_totals(&metrics),
            slowest: state.recent.slowest(at_ns, window_ns),
            agent: state.agent.clone(),
        }
    }
}
