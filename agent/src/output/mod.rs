//! Human and machine output of finished timelines, and the end-of-run
//! summary.

mod json;
mod ms_format;
mod summary;
mod text;

pub use json::JsonTimeline;
pub use summary::RunSummary;
pub use text::text_line;

use crate::model::RequestTimeline;

/// Output format of `tokentrace run`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// One readable line per request.
    Text,
    /// One JSON object per request (JSON Lines).
    Json,
}

impl OutputFormat {
    /// The line `tokentrace run` prints for `timeline` (no newline).
    pub fn line(self, timeline: &RequestTimeline) -> String {
        match self {
            OutputFormat::Json => JsonTimeline::new(timeline).to_line(),
            OutputFormat::Text => text_line(timeline),
        }
    }
}
