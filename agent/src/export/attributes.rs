//! OTLP attributes: how one is written (`kv_*`), the `key=value,...`
//! lists the user gives (`OTEL_RESOURCE_ATTRIBUTES`, OTLP headers) and
//! their parse errors, and the attribute values that spans and metrics
//! both carry (`gen_ai.operation.name`, `error.type`), so the two never
//! disagree.

use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, ArrayValue, KeyValue};

use crate::model::RequestTimeline;

fn kv(key: &str, value: any_value::Value) -> KeyValue {
    KeyValue {
        key: key.to_string(),
        value: Some(AnyValue { value: Some(value) }),
        ..Default::default()
    }
}

/// A string attribute.
pub fn kv_str(key: &str, value: impl Into<String>) -> KeyValue {
    kv(key, any_value::Value::StringValue(value.into()))
}

/// A string-array attribute.
pub fn kv_str_array(key: &str, values: impl IntoIterator<Item = String>) -> KeyValue {
    let values = values
        .into_iter()
        .map(|v| AnyValue {
            value: Some(any_value::Value::StringValue(v)),
        })
        .collect();
    kv(key, any_value::Value::ArrayValue(ArrayValue { values }))
}

/// An integer attribute.
pub fn kv_int(key: &str, value: i64) -> KeyValue {
    kv(key, any_value::Value::IntValue(value))
}

/// A floating-point attribute.
pub fn kv_f64(key: &str, value: f64) -> KeyValue {
    kv(key, any_value::Value::DoubleValue(value))
}

/// A boolean attribute.
pub fn kv_bool(key: &str, value: bool) -> KeyValue {
    kv(key, any_value::Value::BoolValue(value))
}

/// An entry of a `key=value,...` list that does not parse; it names the
/// entry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AttributeError {
    #[error("{0:?} is not key=value")]
    NotKeyValue(String),
    #[error("{0:?} has an empty key")]
    EmptyKey(String),
    #[error("{0:?} has a bad %-escape")]
    BadEscape(String),
}

/// Parses `OTEL_RESOURCE_ATTRIBUTES` (`key1=value1,key2=value2`, values
/// percent-decoded). Errors name the offending entry.
pub fn parse_resource_attributes(s: &str) -> Result<Vec<(String, String)>, AttributeError> {
    let mut out = Vec::new();
    for entry in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (k, v) = entry
            .split_once('=')
            .ok_or_else(|| AttributeError::NotKeyValue(entry.to_string()))?;
        let key = k.trim();
        if key.is_empty() {
            return Err(AttributeError::EmptyKey(entry.to_string()));
        }
        let value =
            percent_decode(v.trim()).ok_or_else(|| AttributeError::BadEscape(entry.to_string()))?;
        out.push((key.to_string(), value));
    }
    Ok(out)
}

/// Decodes `%XX` escapes (the W3C Baggage value encoding the OTel spec
/// uses for these variables).
pub fn percent_decode(s: &str) -> Option<String> {
    let raw = s.as_bytes();
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        if raw[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(raw[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// `gen_ai.operation.name` from the request path, for the OpenAI-, Anthropic-,
/// TGI-, llama.cpp- and Ollama-style endpoints; `None` for anything else.
pub fn operation_name(path: &str) -> Option<&'static str> {
    let path = path
        .split(['?', '#'])
        .next()
        .unwrap_or(path)
        .trim_end_matches('/');
    const CHAT: &[&str] = &[
        "/chat/completions",
        "/api/chat",
        "/v1/messages",
        "/v1/responses",
    ];
    const TEXT: &[&str] = &[
        "/completions",
        "/completion",
        "/generate",
        "/generate_stream",
        "/api/generate",
    ];
    const EMBED: &[&str] = &["/embeddings", "/api/embed", "/api/embeddings"];
    if CHAT.iter().any(|s| path.ends_with(s)) {
        Some("chat")
    } else if TEXT.iter().any(|s| path.ends_with(s)) {
        Some("text_completion")
    } else if EMBED.iter().any(|s| path.ends_with(s)) {
        Some("embeddings")
    } else {
        None
    }
}

/// `error.type` of a request: why it was aborted, or its 5xx status.
pub fn error_type(t: &RequestTimeline) -> Option<String> {
    if t.aborted {
        return Some(
            t.abort_reason
                .and_then(|r| serde_plain::to_string(&r).ok())
                .unwrap_or_else(|| "aborted".into()),
        );
    }
    // gRPC server errors (semantic conventions: UNKNOWN, DEADLINE_EXCEEDED,
    // UNIMPLEMENTED, INTERNAL, UNAVAILABLE, DATA_LOSS).
    if let Some(code) = t.grpc_status.filter(|c| [2, 4, 12, 13, 14, 15].contains(c)) {
        return Some(code.to_string());
    }
    t.status.filter(|s| *s >= 500).map(|s| s.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_otel_resource_attributes() {
        let got =
            parse_resource_attributes("k8s.namespace.name=llm, team=a%2Cb ,,x=").expect("valid");
        assert_eq!(
            got,
            vec![
                ("k8s.namespace.name".to_string(), "llm".to_string()),
                ("team".to_string(), "a,b".to_string()),
                ("x".to_string(), String::new()),
            ]
        );
        assert!(parse_resource_attributes("novalue")
            .expect_err("no =")
            .to_string()
            .contains("novalue"));
        assert!(parse_resource_attributes("=v").is_err());
        assert!(parse_resource_attributes("k=%zz").is_err());
        assert_eq!(percent_decode("a%20b"), Some("a b".into()));
    }

    #[test]
    fn operation_names_follow_the_endpoint() {
        assert_eq!(operation_name("/v1/chat/completions?x=1"), Some("chat"));
        assert_eq!(operation_name("/v1/messages"), Some("chat"));
        assert_eq!(operation_name("/api/chat"), Some("chat"));
        assert_eq!(operation_name("/v1/completions"), Some("text_completion"));
        assert_eq!(operation_name("/generate_stream"), Some("text_completion"));
        assert_eq!(operation_name("/v1/embeddings"), Some("embeddings"));
        assert_eq!(operation_name("/health"), None);
    }
}
