//! The metric aggregation: what the agent counts of the requests it
//! reports and of itself, kept once in memory for both the Prometheus
//! endpoint and OTLP metrics.
//!
//! Owns the latency histograms and request-level counters (`aggregate`),
//! the agent's self-metrics (`self_metrics`), the label sets and their cap
//! (`series`), the normalised `http.route` (`route`) and the stall causes
//! as labels (`stalls`). It does not own how the metrics leave the agent:
//! rendering for a scrape is [`super::prometheus`]'s, the OTLP request
//! [`super::otlp`]'s, and who reads the aggregation when, `Shared`'s.

mod aggregate;
mod route;
mod self_metrics;
mod series;
mod stalls;

pub use aggregate::{
    AgentCounters, ExportCounters, Histogram, Latency, Metrics, SeriesKey, CANCELLATIONS,
    IN_FLIGHT, SOCKET_WAIT, SOCKET_WAIT_DURATION, STALL_DURATION, STALL_TIME, TTFT_BOUNDS,
};
pub use route::normalise as normalise_route;
pub use self_metrics::{self_metrics, Kind};
pub use series::{Keyed, Labels, RouteKey};
pub use stalls::{causes as stall_causes, StallCause};
