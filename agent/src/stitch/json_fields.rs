//! The few JSON fields stitching reports: `id`, `model` and `usage`.
//!
//! Bodies are often cut: by the capture cap, by the buffer limit, or simply
//! because `model` comes after a long `messages` array. A complete document
//! is parsed with serde_json; a cut one is scanned for top-level keys only,
//! skipping nested values, so that a `"model"` inside a message or an `"id"`
//! inside `choices` (llama.cpp puts `"id"` after `choices` and `created`) is
//! never taken for the top-level one.

use memchr::memchr2;
use serde::Deserialize;
use serde_json::Value;

use super::input::Bytes;
use super::timeline::Usage;

/// Fields found at the top level of one JSON object.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct JsonFields {
    pub id: Option<String>,
    pub model: Option<String>,
    pub usage: Option<Usage>,
}

/// Extracts the fields from a JSON object. `complete` says whether `json`
/// is the whole document; when it is not, or does not parse, the tolerant
/// scan takes over.
pub(crate) fn extract(json: &[u8], complete: bool) -> JsonFields {
    if complete {
        if let Ok(top) = serde_json::from_slice::<TopLevel>(json) {
            return top.into_fields();
        }
    }
    scan_top_level(json)
}

/// The `usage` key, searched for in every SSE event: events without one
/// need no parsing once `id` and `model` are known. Built once: `memmem::find` builds its searcher anew on every call, 3 %
/// of the agent's CPU when every SSE event was checked that way.
static USAGE_KEY: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"usage\""));

/// True when `json` may carry a `usage` value: it mentions the key and not
/// every mention is `"usage": null`. With `stream_options.include_usage`
/// every OpenAI chunk says `"usage":null` until the last one: those need
/// no parsing either (a null usage changes nothing, see
/// [`extract`]), and that is every token of such a stream.
pub(crate) fn may_carry_usage(json: &[u8]) -> bool {
    USAGE_KEY.find_iter(json).any(|at| {
        let after = skip_ws(json, at + b"\"usage\"".len());
        if json.get(after) != Some(&b':') {
            return true;
        }
        let value = skip_ws(json, after + 1);
        !json.get(value..).is_some_and(|v| v.starts_with(b"null"))
    })
}

/// The contiguous captured prefix of a body, kept for field extraction.
///
/// Stops growing at the first uncaptured byte (what follows would not be
/// contiguous) or at `cap` bytes.
#[derive(Debug, Clone)]
pub(crate) struct BodyPrefix {
    bytes: Vec<u8>,
    cut: bool,
    cap: usize,
}

impl BodyPrefix {
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            bytes: Vec::new(),
            cut: false,
            cap,
        }
    }

    pub(crate) fn push(&mut self, piece: Bytes<'_>) {
        if self.cut {
            return;
        }
        match piece {
            Bytes::Known(b) => {
                let room = self.cap.saturating_sub(self.bytes.len());
                if b.len() > room {
                    self.cut = true;
                }
                self.bytes.extend_from_slice(&b[..b.len().min(room)]);
            }
            Bytes::Unknown(0) => {}
            Bytes::Unknown(_) => self.cut = true,
        }
    }

    pub(crate) fn fields(&self) -> JsonFields {
        extract(&self.bytes, !self.cut)
    }
}

/// What a complete document is parsed into; unknown keys are skipped
/// without allocation. `Value` keeps a wrongly typed field (a numeric
/// `id`) from failing the whole parse.
#[derive(Deserialize)]
struct TopLevel {
    id: Option<Value>,
    model: Option<Value>,
    usage: Option<Value>,
}

impl TopLevel {
    fn into_fields(self) -> JsonFields {
        let string = |v: Option<Value>| match v {
            Some(Value::String(s)) => Some(s),
            _ => None,
        };
        JsonFields {
            id: string(self.id),
            model: string(self.model),
            usage: self
                .usage
                .and_then(|u| serde_json::from_value::<RawUsage>(u).ok())
                .and_then(RawUsage::into_usage),
        }
    }
}

#[derive(Deserialize)]
struct RawUsage {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
}

impl RawUsage {
    fn into_usage(self) -> Option<Usage> {
        (self.prompt_tokens.is_some() || self.completion_tokens.is_some()).then_some(Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
        })
    }
}

/// Walks the top-level keys of a possibly cut object. Each value that is
/// complete is looked at (strings and `usage` are decoded with serde_json);
/// the walk stops at the first value that runs past the end.
fn scan_top_level(json: &[u8]) -> JsonFields {
    let mut fields = JsonFields::default();
    let mut pos = skip_ws(json, 0);
    if json.get(pos) != Some(&b'{') {
        return fields;
    }
    pos += 1;
    loop {
        pos = skip_ws(json, pos);
        if json.get(pos) != Some(&b'"') {
            return fields;
        }
        let Some(key_end) = string_end(json, pos) else {
            return fields;
        };
        let key = &json[pos + 1..key_end - 1];
        pos = skip_ws(json, key_end);
        if json.get(pos) != Some(&b':') {
            return fields;
        }
        pos = skip_ws(json, pos + 1);
        let Some(value_end) = value_end(json, pos) else {
            return fields;
        };
        let value = &json[pos..value_end];
        match key {
            b"id" if fields.id.is_none() => fields.id = serde_json::from_slice(value).ok(),
            b"model" if fields.model.is_none() => {
                fields.model = serde_json::from_slice(value).ok();
            }
            b"usage" => {
                fields.usage = serde_json::from_slice::<RawUsage>(value)
                    .ok()
                    .and_then(RawUsage::into_usage);
            }
            _ => {}
        }
        pos = skip_ws(json, value_end);
        if json.get(pos) != Some(&b',') {
            return fields;
        }
        pos += 1;
    }
}

fn skip_ws(json: &[u8], mut pos: usize) -> usize {
    while json.get(pos).is_some_and(u8::is_ascii_whitespace) {
        pos += 1;
    }
    pos
}

/// Index just past the string that opens at `start` (a `"`), or `None` if
/// it runs past the end.
fn string_end(json: &[u8], start: usize) -> Option<usize> {
    let mut pos = start + 1;
    loop {
        let i = pos + memchr2(b'"', b'\\', json.get(pos..)?)?;
        if json[i] == b'"' {
            return Some(i + 1);
        }
        pos = i + 2;
    }
}

/// Index just past the value that starts at `start`, or `None` if it runs
/// past the end (a scalar touching the end may continue, so it counts as
/// cut too).
fn value_end(json: &[u8], start: usize) -> Option<usize> {
    match json.get(start)? {
        b'"' => string_end(json, start),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut pos = start;
            loop {
                match json.get(pos)? {
                    b'"' => {
                        pos = string_end(json, pos)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(pos + 1);
                        }
                    }
                    _ => {}
                }
                pos += 1;
            }
        }
        _ => json[start..]
            .iter()
            .position(|c| matches!(c, b',' | b'}' | b']') || c.is_ascii_whitespace())
            .map(|n| start + n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(p: u64, c: u64) -> Option<Usage> {
        Some(Usage {
            prompt_tokens: Some(p),
            completion_tokens: Some(c),
        })
    }

    #[test]
    fn complete_document_uses_serde() {
        let json = br#"{"id":"chatcmpl-1","object":"chat.completion","model":"llama","usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}"#;
        let f = extract(json, true);
        assert_eq!(f.id.as_deref(), Some("chatcmpl-1"));
        assert_eq!(f.model.as_deref(), Some("llama"));
        assert_eq!(f.usage, usage(5, 7));
    }

    #[test]
    fn nested_keys_are_not_top_level() {
        // llama.cpp style: "id" after choices; a nested "id" and "model"
        // come first.
        let json = br#"{"choices":[{"index":0,"delta":{"id":"nested","model":"m2"}}],"created":1,"id":"chatcmpl-top","model":"m1"}"#;
        for complete in [true, false] {
            let f = extract(json, complete);
            assert_eq!(f.id.as_deref(), Some("chatcmpl-top"), "complete={complete}");
            assert_eq!(f.model.as_deref(), Some("m1"));
        }
    }

    #[test]
    fn cut_document_yields_what_was_complete() {
        let json = br#"{"messages":[{"role":"user","content":"a \"quoted\" {brace"}],"model":"gpt-x","max_tokens":1"#;
        let f = extract(json, false);
        assert_eq!(f.model.as_deref(), Some("gpt-x"));
        assert_eq!(f.id, None);

        let f = extract(br#"{"id":"abc","choices":[{"delta":{"content":"hel"#, false);
        assert_eq!(f.id.as_deref(), Some("abc"));

        // Cut inside the id string itself: nothing.
        assert_eq!(extract(br#"{"id":"ab"#, false), JsonFields::default());
    }

    #[test]
    fn usage_null_or_missing_is_none() {
        assert_eq!(extract(br#"{"id":"x","usage":null}"#, true).usage, None);
        assert_eq!(extract(br#"{"id":"x","usage":null,"#, false).usage, None);
        assert_eq!(
            extract(
                br#"{"usage":{"prompt_tokens":3,"completion_tokens":4},"x":"#,
                false
            )
            .usage,
            usage(3, 4)
        );
    }

    #[test]
    fn wrong_types_and_garbage_do_not_fail() {
        let f = extract(br#"{"id":42,"model":"m"}"#, true);
        assert_eq!((f.id, f.model.as_deref()), (None, Some("m")));
        for junk in [
            &b""[..],
            b"[1,2]",
            b"{",
            b"{\"",
            b"{\"a\"",
            b"{\"a\":",
            b"\xff\xfe",
            b"}}}",
        ] {
            assert_eq!(extract(junk, true), JsonFields::default());
            assert_eq!(extract(junk, false), JsonFields::default());
        }
    }

    #[test]
    fn escaped_strings() {
        let f = extract(br#"{"id":"a\"b\\","model":"\u00e9"}"#, false);
        assert_eq!(f.id.as_deref(), Some("a\"b\\"));
        assert_eq!(f.model.as_deref(), Some("é"));
    }

    #[test]
    fn body_prefix_stops_at_gap_and_cap() {
        let mut p = BodyPrefix::new(8);
        p.push(Bytes::Known(b"{\"id\":"));
        p.push(Bytes::Known(b"\"abcdef\"}"));
        assert!(p.cut);
        assert_eq!(p.bytes.len(), 8);

        let mut p = BodyPrefix::new(1024);
        p.push(Bytes::Known(br#"{"id":"x","#));
        p.push(Bytes::Unknown(10));
        p.push(Bytes::Known(b"ignored"));
        assert_eq!(p.bytes, br#"{"id":"x","#);
        assert_eq!(p.fields().id.as_deref(), Some("x"));
    }

    #[test]
    fn null_usage_is_not_worth_parsing() {
        assert!(!may_carry_usage(br#"{"id":"x","usage":null}"#));
        assert!(!may_carry_usage(
            br#"{"id":"x","usage" : null,"b":{"usage":null}}"#
        ));
        assert!(!may_carry_usage(br#"{"id":"x"}"#));
        assert!(may_carry_usage(br#"{"usage":{"prompt_tokens":1}}"#));
        assert!(may_carry_usage(br#"{"a":{"usage":null},"usage":{"x":1}}"#));
        // cut right after the key: it may be anything
        assert!(may_carry_usage(br#"{"usage""#));
        assert!(may_carry_usage(br#"{"usage":"#));
    }

    #[test]
    fn only_the_quoted_key_counts_as_usage() {
        assert!(!may_carry_usage(br#"{"content":"usage is"}"#));
        assert!(!may_carry_usage(br#"{}"#));
    }
}
