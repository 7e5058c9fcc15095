//! Spans: what the agent reports to a tracing backend. Pure: no I/O, no
//! clock reads.
//!
//! Owns turning a request timeline into its SERVER span and phase spans
//! (`timeline`), a trigger's firing into one span (`trigger`), and the
//! tail sampling that decides which requests keep theirs (`sampling`). It
//! does not own the attributes' encoding ([`super::attributes`]), the
//! resource a span goes under ([`super::resource`]), or how spans are
//! queued and sent ([`super::otlp`]).

mod sampling;
mod timeline;
mod trigger;

pub use sampling::{Sampling, SamplingConfig, REASON_ATTRIBUTE};
#[cfg(test)]
pub(crate) use timeline::tests;
pub use timeline::{timeline_spans, trace_spans, SpanSettings, Trace};
pub use trigger::trigger_span;
