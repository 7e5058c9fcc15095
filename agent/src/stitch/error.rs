//! Why bytes on a connection could not be stitched.
//!
//! None of these stop stitching: each is counted in
//! [`StitchStats::parse_errors`](super::StitchStats), logged at debug level,
//! and the parser resynchronises. The connection is in every message so a
//! debug log points at the offending socket.

use std::fmt;

use thiserror::Error;

use crate::event::ConnId;

use super::chunked::ChunkedError;
use super::h2::frame::FrameError;
use super::http::{CollectError, HeadError};

/// Which half of an exchange an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Request,
    Response,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Request => "request",
            Side::Response => "response",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum StitchError {
    #[error("malformed HTTP {side} head on {conn}: {source}")]
    MalformedHead {
        conn: ConnId,
        side: Side,
        source: HeadError,
    },
    #[error("HTTP {side} head on {conn} exceeds the {limit}-byte buffer limit")]
    HeadTooLarge {
        conn: ConnId,
        side: Side,
        limit: usize,
    },
    #[error("HTTP {side} head on {conn} was cut by the capture cap")]
    HeadNotCaptured { conn: ConnId, side: Side },
    #[error("malformed chunked {side} body on {conn}: {source}")]
    MalformedChunk {
        conn: ConnId,
        side: Side,
        source: ChunkedError,
    },
    #[error("more than {limit} HTTP requests in flight on {conn}")]
    TooManyInFlight { conn: ConnId, limit: usize },
    #[error("HTTP response on {conn} with no request pending")]
    UnexpectedResponse { conn: ConnId },
    #[error("malformed HTTP/2 frames on {conn}: {source}")]
    Frames { conn: ConnId, source: FrameError },
    #[error("more than {limit} HTTP/2 streams open on {conn}")]
    TooManyStreams { conn: ConnId, limit: usize },
}

impl StitchError {
    pub(crate) fn head(conn: ConnId, side: Side, limit: usize, err: CollectError) -> Self {
        match err {
            CollectError::Malformed(source) => StitchError::MalformedHead { conn, side, source },
            CollectError::TooLarge => StitchError::HeadTooLarge { conn, side, limit },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_connection_and_the_cause() {
        let conn = ConnId {
            pid: 12,
            fd: 7,
            sock_ino: 991,
        };
        let err = StitchError::MalformedHead {
            conn,
            side: Side::Request,
            source: HeadError::Syntax(httparse::Error::Token),
        };
        assert_eq!(
            err.to_string(),
            "malformed HTTP request head on pid 12 fd 7 sock 991: invalid token"
        );
        let err = StitchError::MalformedChunk {
            conn,
            side: Side::Response,
            source: ChunkedError::MissingCrlf(b'x'),
        };
        assert_eq!(
            err.to_string(),
            "malformed chunked response body on pid 12 fd 7 sock 991: expected CRLF after chunk data, found byte 0x78"
        );
    }
}
