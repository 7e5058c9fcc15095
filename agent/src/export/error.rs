//! Why the export settings could not be resolved or the exporter not
//! started. Each message names the flag, config key or `OTEL_*` variable to
//! fix. Where a library error is the cause (a socket that cannot be bound,
//! a URI that does not parse, a bad header list) it is the `source`, not
//! part of the message, so `{:#}` prints it once.

use std::net::SocketAddr;

use thiserror::Error;

use hyper::http::HeaderName;

use super::attributes::AttributeError;

#[derive(Debug, Error)]
pub enum ExportError {
    #[error(
        "{setting}: {url:?} uses https, but this build of tokentrace sends OTLP in plaintext only; \
         send to a collector on the node (http://) and let it forward over TLS"
    )]
    Https { setting: String, url: String },
    #[error("{setting}: {url:?} is not an http:// URL")]
    NotHttp { setting: String, url: String },
    #[error("{var}={value:?} is not a number of milliseconds")]
    NotMillis { var: String, value: String },
    #[error("{var}")]
    Protocol {
        var: String,
        #[source]
        source: ProtocolError,
    },
    #[error("{setting}")]
    Headers {
        setting: String,
        #[source]
        source: HeaderError,
    },
    #[error("OTEL_RESOURCE_ATTRIBUTES")]
    ResourceAttributes(#[source] AttributeError),
    #[error("the OTLP timeout must be above zero")]
    ZeroTimeout,
    #[error("{setting} must be above zero")]
    Zero { setting: &'static str },
    #[error("export.sampling.base_rate must be between 0 and 1, got {0}")]
    SamplingRate(f64),
    #[error("--metrics-addr {addr}: cannot listen")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid OTLP gRPC endpoint {url:?}")]
    GrpcEndpoint {
        url: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("invalid OTLP HTTP endpoint {url:?}")]
    HttpEndpoint {
        url: String,
        #[source]
        source: hyper::http::uri::InvalidUri,
    },
}

/// An `OTEL_EXPORTER_OTLP_*PROTOCOL` value this build cannot send with.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ProtocolError {
    #[error("OTLP http/json is not supported: use grpc or http/protobuf")]
    Json,
    #[error("unknown OTLP protocol {0:?}: use grpc or http/protobuf")]
    Unknown(String),
}

/// A header list entry that is not a valid HTTP header. The value itself
/// is never shown: it may be a credential.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HeaderError {
    #[error(transparent)]
    Entry(#[from] AttributeError),
    #[error("{0:?} is not a valid header name")]
    Name(String),
    #[error("the value of header {0} is not valid")]
    Value(HeaderName),
}

#[cfg(test)]
mod tests {
    use super::super::{resolve, ExportArgs, ExportConfig, Exporter};
    use super::*;

    fn shown(err: ExportError) -> String {
        format!("{:#}", anyhow::Error::from(err))
    }

    #[test]
    fn a_bad_otlp_protocol_states_its_cause_once() {
        let env = |k: &str| match k {
            "OTEL_EXPORTER_OTLP_ENDPOINT" => Some("collector:4318".to_string()),
            "OTEL_EXPORTER_OTLP_PROTOCOL" => Some("carrier-pigeon".to_string()),
            _ => None,
        };
        let err = resolve(&ExportConfig::default(), &ExportArgs::default(), &env)
            .expect_err("unknown protocol");
        let shown = shown(err);
        assert_eq!(
            shown,
            "OTEL_EXPORTER_OTLP_PROTOCOL: unknown OTLP protocol \"carrier-pigeon\": \
             use grpc or http/protobuf"
        );
        assert_eq!(shown.matches("carrier-pigeon").count(), 1, "{shown}");
    }

    #[tokio::test]
    async fn an_unusable_metrics_addr_states_its_cause_once() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = taken.local_addr().expect("local addr");
        let args = ExportArgs {
            metrics_addr: Some(addr),
            ..ExportArgs::default()
        };
        let settings =
            resolve(&ExportConfig::default(), &args, &|_: &str| None).expect("valid settings");
        let Err(err) = Exporter::start(settings, false).await else {
            panic!("{addr} is taken, yet the exporter started");
        };
        let cause = std::error::Error::source(&err)
            .expect("the io error is the source")
            .to_string();
        let shown = shown(err);
        assert_eq!(
            shown,
            format!("--metrics-addr {addr}: cannot listen: {cause}")
        );
        assert_eq!(shown.matches(&cause).count(), 1, "{shown}");
    }
}
