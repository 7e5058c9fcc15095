//! Requests still open, as the stitcher sees them at one instant: what the
//! in-flight gauges count. A plain snapshot type so that export can count
//! them without knowing how the stitcher keeps its state.

use super::timeline::{BodyKind, RequestTimeline};

/// Where an open request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// Read (at least its head), no token written yet: prefill and the
    /// engine's queue, as the client feels them.
    FirstToken,
    /// The first token (or body byte) left, the response is not complete.
    Streaming,
}

impl Phase {
    pub const ALL: [Phase; 2] = [Phase::FirstToken, Phase::Streaming];

    /// The phase of an unfinished timeline.
    pub fn of(t: &RequestTimeline) -> Self {
        let first = match t.body_kind {
            Some(BodyKind::Sse | BodyKind::Grpc) => !t.chunk_ts.is_empty(),
            _ => t.first_body_byte.is_some(),
        };
        if first {
            Phase::Streaming
        } else {
            Phase::FirstToken
        }
    }

    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::FirstToken => "waiting_first_token",
            Phase::Streaming => "streaming",
        }
    }
}

/// One open request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenRequest {
    pub pid: u32,
    pub comm: String,
    /// Request target as sent (labels normalise it).
    pub path: String,
    pub model: Option<String>,
    pub phase: Phase,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_streams_once_its_first_token_left() {
        let mut t = RequestTimeline {
            body_kind: Some(BodyKind::Sse),
            first_body_byte: Some(5),
            ..RequestTimeline::default()
        };
        // SSE: the status line and headers are not a token
        assert_eq!(Phase::of(&t), Phase::FirstToken);
        t.push_chunk(7);
        assert_eq!(Phase::of(&t), Phase::Streaming);
        let fixed = RequestTimeline {
            body_kind: Some(BodyKind::Fixed),
            first_body_byte: Some(5),
            ..RequestTimeline::default()
        };
        assert_eq!(Phase::of(&fixed), Phase::Streaming);
        assert_eq!(Phase::of(&RequestTimeline::default()), Phase::FirstToken);
    }
}
