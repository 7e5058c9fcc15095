//! HTTP/1.1 request and response heads: parsing with httparse and the
//! message-framing rules of RFC 9112 §6.
//!
//! Only what stitching needs is kept, as owned values, so the buffers the
//! heads were parsed from can be dropped at once.

use thiserror::Error;

/// httparse fills a fixed array; real LLM API heads have a dozen or two.
const MAX_HEADERS: usize = 64;

/// Why a head was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum HeadError {
    #[error("{0}")]
    Syntax(#[from] httparse::Error),
    #[error("invalid Content-Length")]
    ContentLength,
    #[error("Transfer-Encoding without final chunked coding")]
    TransferEncoding,
}

/// How a request body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RequestBody {
    None,
    Fixed(u64),
    Chunked,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RequestHead {
    pub method: String,
    pub path: String,
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
    /// The configured request-id headers present, in config order.
    pub id_headers: Vec<(String, String)>,
    pub body: RequestBody,
    /// Bytes the head took in the buffer it was parsed from.
    pub len: usize,
}

/// How a response body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ResponseBody {
    Empty,
    Fixed(u64),
    Chunked,
    UntilClose,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ResponseHead {
    pub status: u16,
    pub content_type: Option<String>,
    /// `Upgrade: h2c` (with a `101`): HTTP/2 follows on this connection.
    pub upgrade_h2c: bool,
    pub body: ResponseBody,
    /// Bytes the head took in the buffer it was parsed from.
    pub len: usize,
}

impl ResponseHead {
    /// `text/event-stream`: the body is parsed as SSE.
    pub(crate) fn is_sse(&self) -> bool {
        self.content_type.as_deref().is_some_and(|ct| {
            ct.get(..17)
                .is_some_and(|p| p.eq_ignore_ascii_case("text/event-stream"))
        })
    }

    /// 1xx other than 101: an interim response, followed by the real one.
    pub(crate) fn is_interim(&self) -> bool {
        (100..200).contains(&self.status) && self.status != 101
    }
}

/// Longest request-id header value kept (ids are UUIDs or similar; this
/// bounds what a client can make the agent store and export).
pub(crate) const MAX_ID_HEADER_LEN: usize = 256;

/// Parses a request head from the front of `buf`: `Ok(None)` while it is
/// incomplete. `id_headers` are the lower-case names of the request-id
/// headers to keep.
pub(crate) fn parse_request(
    buf: &[u8],
    id_headers: &[String],
) -> Result<Option<RequestHead>, HeadError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let len = match req.parse(buf)? {
        httparse::Status::Complete(len) => len,
        httparse::Status::Partial => return Ok(None),
    };
    let body = if let Some(chunked) = transfer_encoding_chunked(req.headers) {
        if !chunked {
            // RFC 9112 §6.3: the server must reject it; so must we.
            return Err(HeadError::TransferEncoding);
        }
        RequestBody::Chunked
    } else {
        match content_length(req.headers)? {
            None | Some(0) => RequestBody::None,
            Some(n) => RequestBody::Fixed(n),
        }
    };
    Ok(Some(RequestHead {
        method: req.method.unwrap_or_default().to_owned(),
        path: req.path.unwrap_or_default().to_owned(),
        traceparent: header(req.headers, "traceparent"),
        tracestate: header(req.headers, "tracestate"),
        id_headers: id_headers
            .iter()
            .filter_map(|name| {
                let mut value = header(req.headers, name)?;
                if value.is_empty() {
                    return None;
                }
                truncate_at_char(&mut value, MAX_ID_HEADER_LEN);
                Some((name.clone(), value))
            })
            .collect(),
        body,
        len,
    }))
}

/// Parses a response head from the front of `buf`: `Ok(None)` while it is
/// incomplete. `head_request` says the request was `HEAD` (no body,
/// whatever the headers say).
pub(crate) fn parse_response(
    buf: &[u8],
    head_request: bool,
) -> Result<Option<ResponseHead>, HeadError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut headers);
    let len = match resp.parse(buf)? {
        httparse::Status::Complete(len) => len,
        httparse::Status::Partial => return Ok(None),
    };
    let status = resp.code.unwrap_or_default();
    let body = if head_request || (100..200).contains(&status) || status == 204 || status == 304 {
        ResponseBody::Empty
    } else if let Some(chunked) = transfer_encoding_chunked(resp.headers) {
        if chunked {
            ResponseBody::Chunked
        } else {
            ResponseBody::UntilClose
        }
    } else {
        match content_length(resp.headers)? {
            Some(0) => ResponseBody::Empty,
            Some(n) => ResponseBody::Fixed(n),
            None => ResponseBody::UntilClose,
        }
    };
    Ok(Some(ResponseHead {
        status,
        content_type: header(resp.headers, "content-type"),
        upgrade_h2c: header(resp.headers, "upgrade").is_some_and(|u| u.eq_ignore_ascii_case("h2c")),
        body,
        len,
    }))
}

/// Drops the stray CRLFs a peer may send between messages (RFC 9112
/// §2.2): a message starts at its first other byte.
pub(crate) fn skip_blank_lines(bytes: &mut &[u8]) {
    let blank = bytes
        .iter()
        .take_while(|c| matches!(c, b'\r' | b'\n'))
        .count();
    *bytes = &bytes[blank..];
}

/// True when `bytes` begins with a whole, valid request line (method,
/// target, `HTTP/1.x`): where parsing may restart after garbage, and what
/// tells a client connection (it writes requests) from a server one.
pub(crate) fn begins_with_request_line(bytes: &[u8]) -> bool {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    // httparse sets `version` once method, target and version have parsed;
    // an error or a cut after that is about the headers.
    let _ = req.parse(bytes);
    req.version.is_some()
}

/// True when `bytes` begins with a TLS record header (handshake, alert,
/// change-cipher-spec or application data; versions SSL 3.0 to TLS 1.3's
/// legacy 3.3): the ciphertext of a connection whose plaintext, if any, is
/// seen through the OpenSSL probes. No HTTP/1.1 message starts this way.
pub(crate) fn begins_with_tls_record(bytes: &[u8]) -> bool {
    matches!(bytes, [0x14..=0x17, 0x03, 0x00..=0x04, ..])
}

/// True when `bytes` begins with a valid status line prefix
/// (`HTTP/1.x NNN`): where response parsing may restart after garbage.
pub(crate) fn begins_with_status_line(bytes: &[u8]) -> bool {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut headers);
    let _ = resp.parse(bytes);
    resp.code.is_some()
}

/// A parsed head that knows how many bytes it took.
pub(crate) trait ParsedHead {
    fn head_len(&self) -> usize;
}

impl ParsedHead for RequestHead {
    fn head_len(&self) -> usize {
        self.len
    }
}

impl ParsedHead for ResponseHead {
    fn head_len(&self) -> usize {
        self.len
    }
}

/// Why [`collect_head`] gave up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CollectError {
    Malformed(HeadError),
    /// The head would need more than `cap` bytes of buffer.
    TooLarge,
}

/// Adds `bytes` to the head being collected in `buf` and parses it with
/// `parse`. On a complete head, advances `bytes` past it and clears `buf`;
/// otherwise consumes all of `bytes` into `buf`, which never grows past
/// `cap`.
///
/// A head that arrives whole in one syscall, the usual case, is parsed in
/// place without copying.
pub(crate) fn collect_head<T: ParsedHead>(
    buf: &mut Vec<u8>,
    bytes: &mut &[u8],
    cap: usize,
    parse: impl Fn(&[u8]) -> Result<Option<T>, HeadError>,
) -> Result<Option<T>, CollectError> {
    let old = buf.len();
    let parsed = if old == 0 {
        parse(bytes)
    } else {
        let take = bytes.len().min(cap.saturating_sub(old));
        buf.extend_from_slice(&bytes[..take]);
        parse(buf)
    }
    .map_err(CollectError::Malformed)?;
    match parsed {
        Some(head) => {
            // Earlier bytes did not hold a whole head, so it ends in these.
            let used = head.head_len().saturating_sub(old).min(bytes.len());
            *bytes = &bytes[used..];
            buf.clear();
            Ok(Some(head))
        }
        None if old + bytes.len() > cap => Err(CollectError::TooLarge),
        None => {
            if old == 0 {
                buf.extend_from_slice(bytes);
            }
            *bytes = &[];
            Ok(None)
        }
    }
}

/// Cuts `s` to at most `max` bytes, at a character boundary.
fn truncate_at_char(s: &mut String, max: usize) {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
}

fn header(headers: &[httparse::Header<'_>], name: &str) -> Option<String> {
    headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case(name))
        .map(|h| String::from_utf8_lossy(h.value).trim().to_owned())
}

/// `None` without a Transfer-Encoding header; otherwise whether the final
/// coding is `chunked` (the only case where chunked framing applies).
fn transfer_encoding_chunked(headers: &[httparse::Header<'_>]) -> Option<bool> {
    let last = headers
        .iter()
        .rfind(|h| h.name.eq_ignore_ascii_case("transfer-encoding"))?;
    let codings = String::from_utf8_lossy(last.value);
    let final_coding = codings.rsplit(',').next().unwrap_or_default().trim();
    Some(final_coding.eq_ignore_ascii_case("chunked"))
}

/// The Content-Length, if any. Repeated or comma-listed values must agree
/// (RFC 9110 §8.6); anything else is an error, since guessing would
/// misframe every message after this one.
fn content_length(headers: &[httparse::Header<'_>]) -> Result<Option<u64>, HeadError> {
    let mut found = None;
    for h in headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("content-length"))
    {
        let value = std::str::from_utf8(h.value).map_err(|_| HeadError::ContentLength)?;
        for item in value.split(',') {
            let item = item.trim();
            if item.is_empty() || !item.bytes().all(|c| c.is_ascii_digit()) {
                return Err(HeadError::ContentLength);
            }
            let n: u64 = item.parse().map_err(|_| HeadError::ContentLength)?;
            if found.is_some_and(|f| f != n) {
                return Err(HeadError::ContentLength);
            }
            found = Some(n);
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_head_fields_and_body_framing() {
        let raw = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ntraceparent: 00-abc-def-01\r\nTraceState: k=v\r\nContent-Length: 12\r\n\r\nBODY";
        let head = parse_request(raw, &[]).expect("valid").expect("complete");
        assert_eq!(head.method, "POST");
        assert_eq!(head.path, "/v1/chat/completions");
        assert_eq!(head.traceparent.as_deref(), Some("00-abc-def-01"));
        assert_eq!(head.tracestate.as_deref(), Some("k=v"));
        assert_eq!(head.body, RequestBody::Fixed(12));
        assert_eq!(head.len, raw.len() - 4);

        let chunked =
            b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\nContent-Length: 3\r\n\r\n";
        let head = parse_request(chunked, &[])
            .expect("valid")
            .expect("complete");
        assert_eq!(head.body, RequestBody::Chunked);

        let get = parse_request(b"GET / HTTP/1.1\r\n\r\n", &[])
            .expect("valid")
            .expect("complete");
        assert_eq!(get.body, RequestBody::None);
    }

    #[test]
    fn request_id_headers_in_config_order_values_bounded() {
        let long = "é".repeat(200); // 400 bytes
        let raw = format!(
            "GET / HTTP/1.1\r\nX-Request-Id:  abc-1 \r\nX-Correlation-Id: {long}\r\nX-Empty:\r\n\r\n"
        );
        let names = ["x-correlation-id", "x-missing", "x-request-id", "x-empty"].map(String::from);
        let head = parse_request(raw.as_bytes(), &names)
            .expect("valid")
            .expect("complete");
        let got: Vec<(&str, usize)> = head
            .id_headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.len()))
            .collect();
        assert_eq!(got, [("x-correlation-id", 256), ("x-request-id", 5)]);
        assert_eq!(head.id_headers[1].1, "abc-1");
        assert!(head.id_headers[0].1.chars().all(|c| c == 'é'));
    }

    #[test]
    fn request_head_errors() {
        assert_eq!(parse_request(b"GET / HTTP/1.1\r\nHost", &[]), Ok(None));
        assert_eq!(
            parse_request(b"\x16\x03\x01garbage", &[]),
            Err(HeadError::Syntax(httparse::Error::Token))
        );
        for bad in [&b"x"[..], b"-1", b"1, 2", b"", b"99999999999999999999999"] {
            let mut raw = b"POST / HTTP/1.1\r\nContent-Length: ".to_vec();
            raw.extend_from_slice(bad);
            raw.extend_from_slice(b"\r\n\r\n");
            assert_eq!(
                parse_request(&raw, &[]),
                Err(HeadError::ContentLength),
                "{bad:?}"
            );
        }
        assert_eq!(
            parse_request(b"POST / HTTP/1.1\r\nContent-Length: 5, 5\r\n\r\n", &[])
                .expect("valid")
                .map(|h| h.body),
            Some(RequestBody::Fixed(5))
        );
        assert_eq!(
            parse_request(b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", &[]),
            Err(HeadError::TransferEncoding)
        );
    }

    #[test]
    fn response_framing() {
        let body = |raw: &[u8], head: bool| {
            parse_response(raw, head)
                .expect("valid")
                .expect("complete")
                .body
        };
        let ok = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n";
        assert_eq!(body(ok, false), ResponseBody::Fixed(10));
        assert_eq!(body(ok, true), ResponseBody::Empty);
        assert_eq!(
            body(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", false),
            ResponseBody::Empty
        );
        assert_eq!(
            body(b"HTTP/1.1 204 No Content\r\n\r\n", false),
            ResponseBody::Empty
        );
        assert_eq!(
            body(b"HTTP/1.1 304 Not Modified\r\n\r\n", false),
            ResponseBody::Empty
        );
        assert_eq!(
            body(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n",
                false
            ),
            ResponseBody::Chunked
        );
        assert_eq!(
            body(b"HTTP/1.0 200 OK\r\n\r\n", false),
            ResponseBody::UntilClose
        );
    }

    #[test]
    fn response_kinds() {
        let head = parse_response(
            b"HTTP/1.1 200 OK\r\nContent-Type: Text/Event-Stream; charset=utf-8\r\n\r\n",
            false,
        )
        .expect("valid")
        .expect("complete");
        assert!(head.is_sse());
        let interim = parse_response(b"HTTP/1.1 100 Continue\r\n\r\n", false)
            .expect("valid")
            .expect("complete");
        assert!(interim.is_interim());
        assert!(!interim.is_sse());
    }

    #[test]
    fn line_detection() {
        assert!(begins_with_request_line(b"GET /x HTTP/1.1\r\n"));
        assert!(begins_with_request_line(b"POST /x HTTP/1.1"));
        assert!(!begins_with_request_line(b"GET /x HTT"));
        assert!(!begins_with_request_line(b"HTTP/1.1 200 OK\r\n"));
        assert!(!begins_with_request_line(b"{\"model\":1}"));
        assert!(begins_with_status_line(b"HTTP/1.1 200 OK\r\n"));
        assert!(!begins_with_status_line(b"1a3\r\ndata: x"));
        assert!(!begins_with_status_line(b"GET / HTTP/1.1\r\n"));
    }
}
