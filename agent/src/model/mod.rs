//! The pipeline's products, below every stage that makes or reads them:
//! a finished request ([`RequestTimeline`], made by `stitch`) and the
//! causes of its late chunks ([`Stall`], made by `explain`), and a
//! trigger's [`Firing`] (made by `trigger`, exported by `export`). Keeping
//! them here lets the explainer consume timelines and the timeline carry
//! its stalls, and the exporter export firings, without a stage importing
//! the one that consumes it. The ids of a request's trace
//! ([`trace_context`]) live here too: the hop join assigns them, JSON
//! lines and spans carry them.

mod engine;
mod firing;
mod hop;
pub mod in_flight;
mod stall;
mod stats;
pub mod timeline;
pub mod trace_context;

pub use engine::EngineView;
pub use firing::{Firing, TriggerKey};
pub use hop::{JoinKey, SpanKind, TraceIds, UpstreamView};
pub use in_flight::{OpenRequest, Phase};
pub use stall::Stall;
pub use stats::{StatsCache, TimelineStats};
pub use timeline::{AbortReason, BodyKind, Phases, Protocol, RequestTimeline, Usage};
