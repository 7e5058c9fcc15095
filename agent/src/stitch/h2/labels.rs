//! The header fields stitching keeps from a decoded HTTP/2 header block.

use super::super::http::MAX_ID_HEADER_LEN;
use super::hpack::Header;

/// Labels of one header block; `None` where the field was absent or could
/// not be decoded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Labels {
    pub method: Option<String>,
    pub path: Option<String>,
    pub status: Option<u16>,
    pub content_type: Option<String>,
    pub content_length: Option<u64>,
    pub grpc_status: Option<u32>,
    pub grpc_message_bytes: Option<u64>,
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
    /// Values of the configured request-id headers present.
    pub id_headers: Vec<(String, String)>,
}

/// Longest label value kept (paths, content types, trace context).
const MAX_LABEL: usize = 2048;

impl Labels {
    /// Keeps `header` if it is one of ours. `id_names` are lower-case, as
    /// HTTP/2 field names are.
    pub(crate) fn take(&mut self, header: Header<'_>, id_names: &[String]) {
        let (Some(name), Some(value)) = (header.name, header.value) else {
            return;
        };
        let text = || {
            let v = &value[..value.len().min(MAX_LABEL)];
            String::from_utf8_lossy(v).into_owned()
        };
        let number = || std::str::from_utf8(value).ok()?.trim().parse::<u64>().ok();
        match name {
            b":method" => self.method = Some(text()),
            b":path" => self.path = Some(text()),
            b":status" => self.status = number().and_then(|n| u16::try_from(n).ok()),
            b"content-type" => self.content_type = Some(text()),
            b"content-length" => self.content_length = number(),
            b"grpc-status" => self.grpc_status = number().and_then(|n| u32::try_from(n).ok()),
            b"grpc-message" => self.grpc_message_bytes = Some(value.len() as u64),
            b"traceparent" => self.traceparent = Some(text()),
            b"tracestate" => self.tracestate = Some(text()),
            _ => {
                if value.is_empty() || self.id_headers.len() >= id_names.len() {
                    return;
                }
                if let Some(id) = id_names.iter().find(|n| n.as_bytes() == name) {
                    if self.id_headers.iter().any(|(n, _)| n == id) {
                        return;
                    }
                    let v = &value[..value.len().min(MAX_ID_HEADER_LEN)];
                    self.id_headers
                        .push((id.clone(), String::from_utf8_lossy(v).into_owned()));
                }
            }
        }
    }

    /// The request-id headers in config order (the first present wins).
    pub(crate) fn ids_in_order(mut self, id_names: &[String]) -> Vec<(String, String)> {
        self.id_headers
            .sort_by_key(|(n, _)| id_names.iter().position(|x| x == n));
        self.id_headers
    }

    pub(crate) fn is_grpc(&self) -> bool {
        self.content_type.as_deref().is_some_and(|ct| {
            ct.get(..16)
                .is_some_and(|p| p.eq_ignore_ascii_case("application/grpc"))
        })
    }

    pub(crate) fn is_sse(&self) -> bool {
        self.content_type.as_deref().is_some_and(|ct| {
            ct.get(..17)
                .is_some_and(|p| p.eq_ignore_ascii_case("text/event-stream"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h<'a>(name: &'a str, value: &'a str) -> Header<'a> {
        Header {
            name: Some(name.as_bytes()),
            value: Some(value.as_bytes()),
        }
    }

    #[test]
    fn keeps_the_labels_and_the_configured_ids_in_config_order() {
        let ids = vec!["x-request-id".to_string(), "x-correlation-id".to_string()];
        let mut l = Labels::default();
        for header in [
            h(":method", "POST"),
            h(":path", "/tokentrace.test.Streamer/Generate"),
            h("content-type", "application/grpc+proto"),
            h("x-correlation-id", "corr"),
            h("x-request-id", "rid-7"),
            h("grpc-message", "secret text"),
            h(":status", "200"),
            h("grpc-status", "8"),
            h("authorization", "Bearer no"),
        ] {
            l.take(header, &ids);
        }
        l.take(
            Header {
                name: None,
                value: Some(b"x"),
            },
            &ids,
        );
        assert!(l.is_grpc());
        assert_eq!(l.status, Some(200));
        assert_eq!(l.grpc_status, Some(8));
        assert_eq!(l.grpc_message_bytes, Some(11));
        assert_eq!(
            l.clone().ids_in_order(&ids),
            vec![
                ("x-request-id".to_string(), "rid-7".to_string()),
                ("x-correlation-id".to_string(), "corr".to_string())
            ]
        );
    }
}
