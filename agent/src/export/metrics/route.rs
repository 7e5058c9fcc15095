//! `http.route` for metric labels: the request path with ids replaced.
//!
//! A metric label must have few values, but request paths often carry ids
//! (`/v1/threads/thread_abc123/runs/run_9f…`, `/v1/chat/completions/chatcmpl-…`,
//! `/v1/files/1234`): one series per request would exhaust the series cap
//! with garbage and bury the real routes in the overflow series. Without
//! the server's route table, a path segment that looks like an id becomes
//! `{id}`, the placeholder the OTel HTTP conventions use for route
//! templates. The rules err on the side of keeping a segment: a word such
//! as `completions` or `v1` never matches.

/// What an id-like segment is replaced with.
pub const ID: &str = "{id}";

/// Segments longer than this are ids (or garbage) whatever they contain.
const MAX_SEGMENT: usize = 64;
/// Mixed letters and digits from this length on are an id
/// (`chatcmpl-9f3a…`, `thread_abc123xyz`, base64url tokens).
const MIN_TOKEN: usize = 12;
/// Pure hex from this length on is an id (hashes, object ids).
const MIN_HEX: usize = 16;

/// The path without query or fragment, each id-like segment replaced by
/// `{id}`. Empty when the path is (HTTP/2 streams whose `:path` was
/// unknown).
pub fn normalise(path: &str) -> String {
    let path = path.split(['?', '#']).next().unwrap_or_default();
    let mut out = String::with_capacity(path.len());
    for (i, segment) in path.split('/').enumerate() {
        if i > 0 {
            out.push('/');
        }
        out.push_str(if is_id(segment) { ID } else { segment });
    }
    out
}

fn is_id(segment: &str) -> bool {
    if segment.is_empty() {
        return false;
    }
    let b = segment.as_bytes();
    if b.len() > MAX_SEGMENT || b.iter().all(u8::is_ascii_digit) || is_uuid(b) {
        return true;
    }
    if b.len() >= MIN_HEX && b.iter().all(u8::is_ascii_hexdigit) {
        return true;
    }
    let token_chars = b
        .iter()
        .all(|&c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_');
    b.len() >= MIN_TOKEN
        && token_chars
        && b.iter().any(u8::is_ascii_digit)
        && b.iter().any(u8::is_ascii_alphabetic)
}

/// `8-4-4-4-12` hex digits.
fn is_uuid(b: &[u8]) -> bool {
    const DASHES: [usize; 4] = [8, 13, 18, 23];
    b.len() == 36
        && b.iter().enumerate().all(|(i, c)| {
            if DASHES.contains(&i) {
                *c == b'-'
            } else {
                c.is_ascii_hexdigit()
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_in_path_segments_become_placeholders() {
        for (path, route) in [
            ("/v1/chat/completions?rid=7", "/v1/chat/completions"),
            ("/v1/threads/123", "/v1/threads/{id}"),
            (
                "/v1/threads/3f2b8c1e-9a7d-4e21-b1c4-0d5e6f7a8b9c/runs",
                "/v1/threads/{id}/runs",
            ),
            (
                "/v1/threads/thread_abc123XYZ789/runs/run_9f8e7d6c5b4a",
                "/v1/threads/{id}/runs/{id}",
            ),
            (
                "/v1/chat/completions/chatcmpl-6c1f2e9a8b7d",
                "/v1/chat/completions/{id}",
            ),
            ("/blobs/deadbeefdeadbeef00", "/blobs/{id}"),
            ("/v2/models/llama/infer", "/v2/models/llama/infer"),
            (
                "/inference.GRPCInferenceService/ModelInfer",
                "/inference.GRPCInferenceService/ModelInfer",
            ),
            ("/generate_stream", "/generate_stream"),
            ("/", "/"),
            ("", ""),
        ] {
            assert_eq!(normalise(path), route, "{path}");
        }
        let long = format!("/x/{}", "a".repeat(65));
        assert_eq!(normalise(&long), "/x/{id}");
    }

    #[test]
    fn words_and_short_versions_are_kept() {
        // no digit, or too short to be a token: route words
        for segment in [
            "completions",
            "v1",
            "api",
            "text-generation",
            "abc123",
            "deadbeef",
        ] {
            assert!(!is_id(segment), "{segment}");
        }
        // a uuid with a wrong dash position is not one, but is a token
        assert!(!is_uuid(b"3f2b8c1e9-a7d-4e21-b1c4-0d5e6f7a8b9c"));
    }
}
