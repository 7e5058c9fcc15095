//! The pipeline's products, below every stage that makes or reads them:
//! a finished request ([`RequestTimeline`], made by `stitch`) and the
//! causes of its late chunks ([`Stall`], made by `explain`). Keeping them
//! here lets the explainer consume timelines and the timeline carry its
//! stalls without either stage importing the other.

pub mod in_flight;
mod stall;
pub mod timeline;

pub use in_flight::{OpenRequest, Phase};
pub use stall::Stall;
pub use timeline::{AbortReason, BodyKind, Protocol, RequestTimeline, Usage};
