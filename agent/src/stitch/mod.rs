//! Stitching: ordered kernel events in, finished request timelines out.
//!
//! Pure and synchronous: no I/O, no clock reads, no tokio.

pub mod timeline;

pub use timeline::{AbortReason, BodyKind, RequestTimeline, Usage};
