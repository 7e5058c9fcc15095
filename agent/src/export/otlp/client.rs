//! OTLP transport: one export request out, a verdict back.
//!
//! gRPC goes through tonic (`TraceService/Export`, `MetricsService/Export`)
//! on a lazily connected channel, so a backend that is down at start-up is
//! not an error and reconnection is automatic. HTTP/protobuf is a plain
//! `POST` of the encoded request through hyper's client. Both classify
//! failures the way the OTLP spec asks: transient ones (connection refused,
//! timeouts, gRPC UNAVAILABLE and friends, HTTP 429/502/503/504) are
//! retryable, the rest are not. Retrying itself is the caller's job
//! ([`super::retry`]), so it can give up under its own budget.
//!
//! After an outage the caller [`OtlpClient::renew`]s the transport: a
//! fresh channel (or connection pool) dials at once, whatever backoff or
//! half-dead connection the old one was left with.
//!
//! Plaintext only: TLS needs a TLS stack in the agent, which this build
//! does not carry; point the agent at a node-local collector (the usual
//! DaemonSet layout) and let that one talk TLS.

use std::fmt;
use std::future::Future;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::http::{HeaderMap, HeaderName, HeaderValue, Request, StatusCode, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_client::MetricsServiceClient;
use opentelemetry_proto::tonic::collector::metrics::v1::{
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_client::TraceServiceClient;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use prost::Message;
use tonic::metadata::MetadataMap;
use tonic::transport::{Channel, Endpoint};

use crate::export::attributes::parse_resource_attributes;
use crate::export::error::{ExportError, HeaderError, ProtocolError};

/// Most bytes of an HTTP response body read (it only carries a
/// partial-success message).
const MAX_RESPONSE_BYTES: usize = 64 * 1024;

/// OTLP wire protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
pub enum OtlpProtocol {
    /// OTLP/gRPC (default port 4317).
    #[value(name = "grpc")]
    #[serde(rename = "grpc")]
    Grpc,
    /// OTLP/HTTP with protobuf bodies (default port 4318).
    #[value(name = "http", alias = "http/protobuf")]
    #[serde(rename = "http/protobuf", alias = "http")]
    HttpProtobuf,
}

impl OtlpProtocol {
    /// Parses the `OTEL_EXPORTER_OTLP_*PROTOCOL` values.
    pub fn from_env_value(value: &str) -> Result<Self, ProtocolError> {
        match value.trim() {
            "grpc" => Ok(OtlpProtocol::Grpc),
            "http/protobuf" | "http" => Ok(OtlpProtocol::HttpProtobuf),
            "http/json" => Err(ProtocolError::Json),
            other => Err(ProtocolError::Unknown(other.to_string())),
        }
    }
}

impl fmt::Display for OtlpProtocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OtlpProtocol::Grpc => "grpc",
            OtlpProtocol::HttpProtobuf => "http/protobuf",
        })
    }
}

/// Where and how one signal is sent.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    pub protocol: OtlpProtocol,
    /// gRPC: the collector's base URL. HTTP: the full URL to POST to.
    pub url: String,
    pub headers: HeaderMap,
    pub timeout: Duration,
}

/// Why an export request failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SendError {
    /// Worth trying again, after `retry_after` if the backend said so.
    Retryable {
        message: String,
        retry_after: Option<Duration>,
    },
    /// The backend refused the data; sending it again will not help.
    Permanent(String),
}

impl fmt::Display for SendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SendError::Retryable { message, .. } => f.write_str(message),
            SendError::Permanent(message) => f.write_str(message),
        }
    }
}

fn retryable(message: String) -> SendError {
    SendError::Retryable {
        message,
        retry_after: None,
    }
}

#[derive(Clone)]
enum Transport {
    Grpc {
        channel: Channel,
        headers: HeaderMap,
    },
    // boxed: the client is several times larger than the channel
    Http {
        client: Box<Client<HttpConnector, Full<Bytes>>>,
        uri: Uri,
        headers: HeaderMap,
    },
}

/// A connection to one OTLP endpoint for one signal.
pub struct OtlpClient {
    target: Target,
    /// Cloned for each export (a channel or pool handle, cheap); replaced
    /// whole by `renew`.
    transport: Mutex<Transport>,
}

impl fmt::Debug for OtlpClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OtlpClient")
            .field("url", &self.target.url)
            .finish_non_exhaustive()
    }
}

impl OtlpClient {
    /// Prepares the client; connects on first use. Must run inside the
    /// tokio runtime (the gRPC channel spawns its connection task there).
    pub fn new(target: &Target) -> Result<Self, ExportError> {
        Ok(Self {
            transport: Mutex::new(transport(target)?),
            target: target.clone(),
        })
    }

    pub fn url(&self) -> &str {
        &self.target.url
    }

    /// The `host:port` the transport dials, for reachability probes.
    pub fn authority(&self) -> Option<String> {
        authority(&self.target.url)
    }

    /// Drops the transport for a new one: the next export dials afresh.
    pub fn renew(&self) {
        match transport(&self.target) {
            Ok(fresh) => {
                *self
                    .transport
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) = fresh
            }
            // the target was valid when the client was made; keep the old one
            Err(err) => tracing::debug!("renewing the OTLP transport: {err}"),
        }
    }

    /// Sends spans; `Ok` carries the number the backend said it rejected.
    pub async fn export_traces(
        &self,
        request: ExportTraceServiceRequest,
    ) -> Result<u64, SendError> {
        let response: ExportTraceServiceResponse = self
            .send(request, |channel, request| async move {
                TraceServiceClient::new(channel).export(request).await
            })
            .await?;
        Ok(rejected(response.partial_success.map(|p| p.rejected_spans)))
    }

    /// Sends metrics; `Ok` carries the number of data points rejected.
    pub async fn export_metrics(
        &self,
        request: ExportMetricsServiceRequest,
    ) -> Result<u64, SendError> {
        let response: ExportMetricsServiceResponse = self
            .send(request, |channel, request| async move {
                MetricsServiceClient::new(channel).export(request).await
            })
            .await?;
        Ok(rejected(
            response.partial_success.map(|p| p.rejected_data_points),
        ))
    }

    /// One export over whichever transport this client has, with the
    /// failure classified per that transport's spec. `grpc` is the signal's
    /// generated service call (the only part that differs by signal); HTTP
    /// needs only the encoded request.
    async fn send<Req, Resp, Call, Fut>(&self, request: Req, grpc: Call) -> Result<Resp, SendError>
    where
        Req: Message,
        Resp: Message + Default,
        Call: FnOnce(Channel, tonic::Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        let transport = self
            .transport
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        match &transport {
            Transport::Grpc { channel, headers } => {
                grpc(channel.clone(), grpc_request(request, headers))
                    .await
                    .map(tonic::Response::into_inner)
                    .map_err(grpc_error)
            }
            Transport::Http {
                client,
                uri,
                headers,
            } => {
                post(
                    client,
                    uri,
                    headers,
                    self.target.timeout,
                    request.encode_to_vec(),
                )
                .await
            }
        }
    }
}

/// A fresh transport for `target`: a lazily connected gRPC channel or an
/// HTTP client with its own (empty) connection pool.
fn transport(target: &Target) -> Result<Transport, ExportError> {
    Ok(match target.protocol {
        OtlpProtocol::Grpc => {
            let endpoint = Endpoint::from_shared(target.url.clone())
                .map_err(|source| ExportError::GrpcEndpoint {
                    url: target.url.clone(),
                    source,
                })?
                .connect_timeout(target.timeout)
                .timeout(target.timeout)
                .tcp_nodelay(true);
            Transport::Grpc {
                channel: endpoint.connect_lazy(),
                headers: target.headers.clone(),
            }
        }
        OtlpProtocol::HttpProtobuf => {
            let uri: Uri = target
                .url
                .parse()
                .map_err(|source| ExportError::HttpEndpoint {
                    url: target.url.clone(),
                    source,
                })?;
            let mut connector = HttpConnector::new();
            connector.set_connect_timeout(Some(target.timeout));
            connector.set_nodelay(true);
            let client = Box::new(Client::builder(TokioExecutor::new()).build(connector));
            Transport::Http {
                client,
                uri,
                headers: target.headers.clone(),
            }
        }
    })
}

/// `host:port` of an `http://` URL (the port defaulted from the scheme).
fn authority(url: &str) -> Option<String> {
    let uri: Uri = url.parse().ok()?;
    let host = uri.host()?;
    let port = uri.port_u16().unwrap_or(match uri.scheme_str() {
        Some("https") => 443,
        _ => 80,
    });
    Some(format!("{host}:{port}"))
}

/// One OTLP/HTTP `POST`, bounded by `timeout` from send to the end of the
/// (size-limited) response body.
async fn post<R: Message + Default>(
    client: &Client<HttpConnector, Full<Bytes>>,
    uri: &Uri,
    headers: &HeaderMap,
    timeout: Duration,
    body: Vec<u8>,
) -> Result<R, SendError> {
    let mut request = Request::post(uri.clone())
        .header("content-type", "application/x-protobuf")
        .body(Full::new(Bytes::from(body)))
        .map_err(|err| SendError::Permanent(format!("building the request: {err}")))?;
    request.headers_mut().extend(headers.clone());
    let exchange = async {
        let response = client
            .request(request)
            .await
            .map_err(|err| retryable(format!("POST {uri}: {err}")))?;
        let status = response.status();
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let body = Limited::new(response.into_body(), MAX_RESPONSE_BYTES)
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        Ok::<_, SendError>((status, retry_after, body))
    };
    let (status, retry_after, body) = tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| retryable(format!("POST {uri}: no response within {timeout:?}")))??;
    classify_http(status, retry_after)?;
    // an empty or non-protobuf 2xx body is a plain success
    Ok(R::decode(body).unwrap_or_default())
}

/// A partial-success rejected count; none, or a negative one (a broken
/// backend), counts as 0.
fn rejected(count: Option<i64>) -> u64 {
    count.map_or(0, |n| u64::try_from(n).unwrap_or(0))
}

fn grpc_request<T>(message: T, headers: &HeaderMap) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    *request.metadata_mut() = MetadataMap::from_headers(headers.clone());
    request
}

/// The OTLP/HTTP spec's status handling.
fn classify_http(status: StatusCode, retry_after: Option<Duration>) -> Result<(), SendError> {
    if status.is_success() {
        return Ok(());
    }
    let message = format!("OTLP HTTP endpoint answered {status}");
    match status.as_u16() {
        429 | 502 | 503 | 504 => Err(SendError::Retryable {
            message,
            retry_after,
        }),
        _ => Err(SendError::Permanent(message)),
    }
}

/// The OTLP/gRPC spec's retryable codes. A status tonic made itself from
/// an error of its own (it carries that error as its source; one the
/// backend sent never does) means no answer came: the connection broke
/// with the request in flight (a collector killed mid-export gave
/// `Unknown: transport error`), so the batch is retried, not dropped.
fn grpc_error(status: tonic::Status) -> SendError {
    use tonic::Code;
    let message = format!(
        "OTLP gRPC export failed: {:?}: {}",
        status.code(),
        status.message()
    );
    if std::error::Error::source(&status).is_some() {
        return retryable(message);
    }
    match status.code() {
        Code::Cancelled
        | Code::DeadlineExceeded
        | Code::ResourceExhausted
        | Code::Aborted
        | Code::OutOfRange
        | Code::Unavailable
        | Code::DataLoss => retryable(message),
        _ => SendError::Permanent(message),
    }
}

/// Parses `OTEL_EXPORTER_OTLP_*HEADERS` (`k=v,k2=v2`, values
/// percent-decoded) into validated HTTP headers.
pub fn parse_headers(s: &str) -> Result<HeaderMap, HeaderError> {
    let mut headers = HeaderMap::new();
    for (k, v) in parse_resource_attributes(s)? {
        insert_header(&mut headers, &k, &v)?;
    }
    Ok(headers)
}

/// Adds one header, validating name and value.
pub fn insert_header(headers: &mut HeaderMap, name: &str, value: &str) -> Result<(), HeaderError> {
    let name = HeaderName::from_bytes(name.trim().to_ascii_lowercase().as_bytes())
        .map_err(|_| HeaderError::Name(name.to_string()))?;
    let value = HeaderValue::from_str(value).map_err(|_| HeaderError::Value(name.clone()))?;
    headers.append(name, value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_statuses_are_classified_as_the_spec_says() {
        assert_eq!(classify_http(StatusCode::OK, None), Ok(()));
        assert_eq!(classify_http(StatusCode::ACCEPTED, None), Ok(()));
        let after = Some(Duration::from_secs(3));
        assert!(matches!(
            classify_http(StatusCode::TOO_MANY_REQUESTS, after),
            Err(SendError::Retryable { retry_after, .. }) if retry_after == after
        ));
        for s in [502, 503, 504] {
            let code = StatusCode::from_u16(s).expect("valid");
            assert!(
                matches!(classify_http(code, None), Err(SendError::Retryable { .. })),
                "{s}"
            );
        }
        for s in [400, 401, 404, 413, 500] {
            let code = StatusCode::from_u16(s).expect("valid");
            assert!(
                matches!(classify_http(code, None), Err(SendError::Permanent(_))),
                "{s}"
            );
        }
    }

    #[test]
    fn grpc_codes_are_classified_as_the_spec_says() {
        assert!(matches!(
            grpc_error(tonic::Status::unavailable("down")),
            SendError::Retryable { .. }
        ));
        assert!(matches!(
            grpc_error(tonic::Status::deadline_exceeded("slow")),
            SendError::Retryable { .. }
        ));
        assert!(matches!(
            grpc_error(tonic::Status::invalid_argument("bad")),
            SendError::Permanent(_)
        ));
        assert!(matches!(
            grpc_error(tonic::Status::unauthenticated("who")),
            SendError::Permanent(_)
        ));
        // A broken connection, as tonic reports it: Unknown, with the
        // transport's error as the source.
        let broken = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        let status = tonic::Status::from_error(Box::new(broken));
        assert_eq!(status.code(), tonic::Code::Unknown);
        assert!(matches!(grpc_error(status), SendError::Retryable { .. }));
        assert!(matches!(
            grpc_error(tonic::Status::unknown("the backend said so")),
            SendError::Permanent(_)
        ));
    }

    #[test]
    fn protocols_and_headers_parse() {
        assert_eq!(OtlpProtocol::from_env_value("grpc"), Ok(OtlpProtocol::Grpc));
        assert_eq!(
            OtlpProtocol::from_env_value(" http/protobuf "),
            Ok(OtlpProtocol::HttpProtobuf)
        );
        assert!(OtlpProtocol::from_env_value("http/json")
            .expect_err("unsupported")
            .to_string()
            .contains("not supported"));
        let h = parse_headers("Authorization=Bearer%20abc,x-tenant=a").expect("valid");
        assert_eq!(
            h.get("authorization").map(|v| v.to_str().ok()),
            Some(Some("Bearer abc"))
        );
        assert_eq!(h.get("x-tenant").map(|v| v.to_str().ok()), Some(Some("a")));
        assert!(parse_headers("bad name=x").is_err());
        assert!(
            parse_headers("k=a%0Ab").is_err(),
            "a newline in a value is rejected"
        );
    }

    #[tokio::test]
    async fn a_dead_http_endpoint_is_a_retryable_error() {
        // a port nothing listens on: bind, read the port, close
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let target = Target {
            protocol: OtlpProtocol::HttpProtobuf,
            url: format!("http://127.0.0.1:{port}/v1/traces"),
            headers: HeaderMap::new(),
            timeout: Duration::from_secs(2),
        };
        let client = OtlpClient::new(&target).expect("client");
        let err = client
            .export_traces(ExportTraceServiceRequest::default())
            .await
            .expect_err("refused");
        assert!(matches!(err, SendError::Retryable { .. }), "{err}");

        let grpc = OtlpClient::new(&Target {
            protocol: OtlpProtocol::Grpc,
            url: format!("http://127.0.0.1:{port}"),
            ..target
        })
        .expect("client");
        let err = grpc
            .export_traces(ExportTraceServiceRequest::default())
            .await
            .expect_err("refused");
        assert!(matches!(err, SendError::Retryable { .. }), "{err}");
    }
}
