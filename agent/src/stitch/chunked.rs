//! Incremental decoder for `Transfer-Encoding: chunked` bodies.
//!
//! Servers split the framing anywhere: some write `1a3\r\n`, the payload and
//! `\r\n` as three syscalls, others coalesce many chunks in one write. The
//! decoder therefore keeps all of its state between calls and never needs
//! to see a whole line at once; it holds no buffer, so hostile input cannot
//! make it grow.
//!
//! It reports where each chunk's data ends ([`Piece::ChunkEnd`]) because, for
//! a chunked stream that is not SSE, a chunk is the unit of emission.
//!
//! # Unknown runs (truncated captures)
//!
//! Inside chunk data, uncaptured bytes are consumed as data: the chunk size
//! says how many there are. Where framing would fall inside an uncaptured
//! tail, the decoder assumes the write ended on a chunk boundary (servers
//! write whole chunks) and resumes framing at the next write. Under that
//! assumption a tail of exactly the five bytes `0\r\n\r\n` after a chunk
//! boundary can only be the terminating chunk (the smallest data chunk
//! takes six), so such a tail ends the body; so does any tail once the
//! terminating chunk or its trailers have begun.

use thiserror::Error;

use super::input::Bytes;

/// Length of the terminating chunk with no trailers: `0\r\n\r\n`.
const TERMINATOR_LEN: u64 = 5;

/// Why a chunked body could not be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum ChunkedError {
    #[error("invalid byte {0:#04x} in chunk size line")]
    InvalidSize(u8),
    #[error("chunk size does not fit in 64 bits")]
    SizeOverflow,
    #[error("expected CRLF after chunk data, found byte {0:#04x}")]
    MissingCrlf(u8),
}

/// What the decoder found next in its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Piece<'a> {
    /// Body bytes (de-chunked).
    Data(Bytes<'a>),
    /// The data of one non-empty chunk is complete.
    ChunkEnd,
    /// The terminating chunk and trailers are complete; bytes after this
    /// belong to whatever follows the body.
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// In a chunk-size line: hex digits, then (once `in_ext`) optional
    /// whitespace and extensions up to LF.
    Size {
        value: u64,
        digits: u32,
        in_ext: bool,
    },
    Data {
        remaining: u64,
    },
    /// After chunk data: CRLF (a bare LF is tolerated).
    DataEnd {
        seen_cr: bool,
    },
    /// After the terminating `0` line: trailer lines up to an empty line.
    Trailer {
        line_start: bool,
    },
    Done,
}

const SIZE_START: State = State::Size {
    value: 0,
    digits: 0,
    in_ext: false,
};

#[derive(Debug, Clone)]
pub(crate) struct ChunkedDecoder {
    state: State,
    /// A chunk's data completed while producing the last [`Piece::Data`];
    /// reported by the next call so each piece stays one value.
    chunk_end_pending: bool,
}

impl Default for ChunkedDecoder {
    fn default() -> Self {
        Self {
            state: SIZE_START,
            chunk_end_pending: false,
        }
    }
}

impl ChunkedDecoder {
    /// Decodes from the front of `input`, advancing it past what was used.
    ///
    /// Returns `Ok(None)` once `input` is used up (call again with the next
    /// bytes), and `Ok(Some(Piece::Done))` exactly once, leaving the bytes
    /// after the body in `input`. After `Done`, always `Ok(None)`.
    pub(crate) fn next<'a>(
        &mut self,
        input: &mut Bytes<'a>,
    ) -> Result<Option<Piece<'a>>, ChunkedError> {
        if self.chunk_end_pending {
            self.chunk_end_pending = false;
            return Ok(Some(Piece::ChunkEnd));
        }
        loop {
            if self.state == State::Done || input.is_empty() {
                return Ok(None);
            }
            if let State::Data { remaining } = self.state {
                let data = input.take(remaining);
                let left = remaining - data.len();
                if left == 0 {
                    self.state = State::DataEnd { seen_cr: false };
                    self.chunk_end_pending = true;
                } else {
                    self.state = State::Data { remaining: left };
                }
                return Ok(Some(Piece::Data(data)));
            }
            match *input {
                Bytes::Unknown(n) => {
                    *input = Bytes::Unknown(0);
                    self.skip_unknown(n);
                }
                Bytes::Known(bytes) => {
                    let used = self.framing(bytes)?;
                    *input = Bytes::Known(&bytes[used..]);
                }
            }
            if self.state == State::Done {
                return Ok(Some(Piece::Done));
            }
        }
    }

    /// Consumes framing bytes (not chunk data) from the front of `bytes`,
    /// stopping when chunk data starts, the body ends or `bytes` runs out.
    /// Returns how many bytes it used.
    fn framing(&mut self, bytes: &[u8]) -> Result<usize, ChunkedError> {
        for (i, &c) in bytes.iter().enumerate() {
            match &mut self.state {
                State::Size {
                    value,
                    digits,
                    in_ext,
                } => {
                    if c == b'\n' {
                        if *digits == 0 {
                            return Err(ChunkedError::InvalidSize(c));
                        }
                        self.state = if *value == 0 {
                            State::Trailer { line_start: true }
                        } else {
                            State::Data { remaining: *value }
                        };
                        return Ok(i + 1);
                    }
                    if *in_ext {
                        continue;
                    }
                    match hex_value(c) {
                        Some(d) => {
                            *value = value
                                .checked_mul(16)
                                .and_then(|v| v.checked_add(d))
                                .ok_or(ChunkedError::SizeOverflow)?;
                            *digits += 1;
                        }
                        None if *digits > 0 && matches!(c, b';' | b' ' | b'\t' | b'\r') => {
                            *in_ext = true;
                        }
                        None => return Err(ChunkedError::InvalidSize(c)),
                    }
                }
                State::DataEnd { seen_cr } => match c {
                    b'\r' if !*seen_cr => *seen_cr = true,
                    b'\n' => self.state = SIZE_START,
                    _ => return Err(ChunkedError::MissingCrlf(c)),
                },
                State::Trailer { line_start } => match c {
                    b'\n' if *line_start => {
                        self.state = State::Done;
                        return Ok(i + 1);
                    }
                    b'\n' => *line_start = true,
                    b'\r' => {}
                    _ => *line_start = false,
                },
                State::Data { .. } | State::Done => return Ok(i),
            }
        }
        Ok(bytes.len())
    }

    /// An uncaptured write tail met outside chunk data. See the module docs
    /// for the assumption made here.
    fn skip_unknown(&mut self, n: u64) {
        self.state = match self.state {
            State::DataEnd { seen_cr } => {
                let crlf_left = if seen_cr { 1 } else { 2 };
                if n < crlf_left {
                    State::DataEnd { seen_cr: true }
                } else if n - crlf_left == TERMINATOR_LEN {
                    State::Done
                } else {
                    SIZE_START
                }
            }
            State::Size { digits: 0, .. } if n == TERMINATOR_LEN => State::Done,
            // `0` already seen: the rest of the terminating chunk.
            State::Size {
                value: 0,
                digits: 1..,
                ..
            } => State::Done,
            State::Size { .. } => SIZE_START,
            State::Trailer { .. } | State::Done => State::Done,
            // Data is consumed before unknown runs reach here.
            data @ State::Data { .. } => data,
        };
    }
}

fn hex_value(c: u8) -> Option<u64> {
    char::from(c).to_digit(16).map(u64::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decodes `inputs` in order, returning the de-chunked known bytes, the
    /// unknown byte count, the number of chunk ends, whether `Done` was seen
    /// and the bytes left after it.
    fn decode(inputs: &[Bytes<'_>]) -> Result<(Vec<u8>, u64, usize, bool, u64), ChunkedError> {
        let mut dec = ChunkedDecoder::default();
        let (mut data, mut unknown, mut ends, mut done, mut left) = (Vec::new(), 0, 0, false, 0);
        for input in inputs {
            let mut input = *input;
            while let Some(piece) = dec.next(&mut input)? {
                match piece {
                    Piece::Data(Bytes::Known(b)) => data.extend_from_slice(b),
                    Piece::Data(Bytes::Unknown(n)) => unknown += n,
                    Piece::ChunkEnd => ends += 1,
                    Piece::Done => done = true,
                }
            }
            left += input.len();
        }
        Ok((data, unknown, ends, done, left))
    }

    #[test]
    fn decodes_whole_body_with_extensions_and_trailers() {
        let body = b"5;name=value\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: 1\r\n\r\nNEXT";
        let (data, unknown, ends, done, left) = decode(&[Bytes::Known(body)]).expect("valid");
        assert_eq!(data, b"hello world");
        assert_eq!((unknown, ends, done, left), (0, 2, true, 4));
    }

    #[test]
    fn every_split_of_every_byte_gives_the_same_result() {
        let body = b"1A \r\n0123456789abcdefghijklmnop\r\n3\r\nxyz\r\n0\r\n\r\n";
        let whole = decode(&[Bytes::Known(body)]).expect("valid");
        for i in 0..=body.len() {
            for j in i..=body.len() {
                let parts = [
                    Bytes::Known(&body[..i]),
                    Bytes::Known(&body[i..j]),
                    Bytes::Known(&body[j..]),
                ];
                assert_eq!(decode(&parts).expect("valid"), whole, "split at {i},{j}");
            }
        }
    }

    #[test]
    fn tolerates_bare_lf() {
        let (data, _, ends, done, _) = decode(&[Bytes::Known(b"2\nab\n0\n\n")]).expect("valid");
        assert_eq!((data.as_slice(), ends, done), (&b"ab"[..], 1, true));
    }

    #[test]
    fn rejects_bad_framing() {
        assert_eq!(
            decode(&[Bytes::Known(b"zz\r\n")]),
            Err(ChunkedError::InvalidSize(b'z'))
        );
        assert_eq!(
            decode(&[Bytes::Known(b"\r\n")]),
            Err(ChunkedError::InvalidSize(b'\r'))
        );
        assert_eq!(
            decode(&[Bytes::Known(b"2\r\nabX")]),
            Err(ChunkedError::MissingCrlf(b'X'))
        );
        assert_eq!(
            decode(&[Bytes::Known(b"11111111111111111\r\n")]),
            Err(ChunkedError::SizeOverflow)
        );
    }

    #[test]
    fn unknown_run_inside_data_counts_as_data() {
        // "a\r\n0123456789\r\n" with only "a\r\n01" captured, then the next
        // write resumes at a chunk boundary.
        let parts = [
            Bytes::Known(b"a\r\n01"),
            Bytes::Unknown(10),
            Bytes::Known(b"2\r\nzz\r\n0\r\n\r\n"),
        ];
        let (data, unknown, ends, done, left) = decode(&parts).expect("valid");
        assert_eq!(data, b"01zz");
        assert_eq!((unknown, ends, done, left), (8, 2, true, 0));
    }

    #[test]
    fn unknown_tail_of_exactly_the_terminator_ends_the_body() {
        let parts = [Bytes::Known(b"3\r\nab"), Bytes::Unknown(1 + 2 + 5)];
        let (_, unknown, ends, done, _) = decode(&parts).expect("valid");
        assert_eq!((unknown, ends, done), (1, 1, true));

        let parts = [Bytes::Known(b"3\r\nabc\r\n0"), Bytes::Unknown(4)];
        assert!(decode(&parts).expect("valid").3);
    }

    #[test]
    fn unknown_framing_resumes_at_next_write() {
        // The unknown tail holds more whole chunks; framing resumes.
        let parts = [
            Bytes::Known(b"3\r\nabc\r\n1"),
            Bytes::Unknown(40),
            Bytes::Known(b"1\r\nz\r\n"),
        ];
        let (data, _, ends, done, _) = decode(&parts).expect("valid");
        assert_eq!((data.as_slice(), ends, done), (&b"abcz"[..], 2, false));
    }
}
