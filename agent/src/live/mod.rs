//! What `tokentrace top` shows, made inside the agent: cumulative totals
//! of the metric aggregation per service × model × route (the same
//! [`crate::export::Metrics`] the Prometheus endpoint renders, so the two
//! never disagree), the slowest recently finished requests, and the
//! agent's own line. A [`LiveFeed`] answers [`TopSnapshot`]s; the local
//! `top` reads it in-process, `top --remote` through the control
//! endpoint (`GET /v1/top`). Windows are differences of two snapshots
//! ([`window`]), worked out by the viewer.

mod agent;
mod feed;
mod recent;
mod snapshot;
mod totals;
pub mod window;

pub use agent::agent_status;
pub use feed::LiveFeed;
pub use recent::MAX_WINDOW;
pub use snapshot::{AgentStatus, Buckets, RouteTotals, SlowRequest, StallBrief, TopSnapshot};
