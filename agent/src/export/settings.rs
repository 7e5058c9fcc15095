//! Export configuration: the `export:` section of the YAML file, the
//! command-line flags, and the standard `OTEL_*` environment variables,
//! resolved into one [`ExportSettings`].
//!
//! Precedence, highest first: command line, config file, `OTEL_*`
//! variables, the embedded defaults. The file is explicit configuration, like
//! code that configures an SDK, so it beats the ambient environment. No
//! endpoint anywhere means no OTLP export at all (and no error messages).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use hyper::http::HeaderMap;
use serde::Deserialize;

use super::attributes::parse_resource_attributes;
use super::error::ExportError;
use super::otlp::{insert_header, parse_headers, OtlpProtocol, RetryPolicy, Target};
use super::resource::{host_name, ResourceRules};
use super::spans::{Sampling, SamplingConfig, SpanSettings};

/// `export:` in the YAML config. Keys left `null` fall back to the
/// `OTEL_*` environment variables, then to the embedded defaults.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportConfig {
    pub otlp: OtlpConfig,
    /// `host:port` of the Prometheus text endpoint (`--metrics-addr`).
    pub prometheus_addr: Option<SocketAddr>,
    /// How often metrics are pushed over OTLP (`OTEL_METRIC_EXPORT_INTERVAL`).
    #[serde(with = "humantime_serde")]
    pub metrics_interval: Option<Duration>,
    /// Series per latency histogram before new ones go to an overflow series.
    pub max_series: usize,
    /// Requests whose spans may wait for export; more are dropped, counted.
    pub queue_size: usize,
    /// Requests per OTLP export request.
    pub batch_size: usize,
    /// How long a batch waits to fill after its first request.
    #[serde(with = "humantime_serde")]
    pub batch_timeout: Duration,
    pub retry: RetryConfig,
    /// An inter-token gap this long becomes a `tokentrace.stall` span event
    /// (0s: no stall events).
    #[serde(with = "humantime_serde")]
    pub stall_threshold: Duration,
    /// One span event per emitted chunk.
    pub chunk_events: bool,
    /// Most events on one span.
    pub max_span_events: usize,
    /// Tail-based span sampling.
    pub sampling: SamplingConfig,
    /// `service.name` of every traced process (`--service-name`).
    pub service_name: Option<String>,
    /// comm or executable name → `service.name`.
    pub service_names: BTreeMap<String, String>,
    /// Added to every resource (after `OTEL_RESOURCE_ATTRIBUTES`).
    pub resource_attributes: BTreeMap<String, String>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OtlpConfig {
    /// Collector URL (`--otlp-endpoint`, `OTEL_EXPORTER_OTLP_ENDPOINT`).
    pub endpoint: Option<String>,
    /// `grpc` or `http/protobuf` (`--otlp-protocol`).
    pub protocol: Option<OtlpProtocol>,
    pub headers: BTreeMap<String, String>,
    #[serde(with = "humantime_serde")]
    pub timeout: Option<Duration>,
    /// Send spans.
    pub traces: bool,
    /// Send metrics.
    pub metrics: bool,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryConfig {
    #[serde(with = "humantime_serde")]
    pub initial_backoff: Duration,
    #[serde(with = "humantime_serde")]
    pub max_backoff: Duration,
    /// A batch still failing after this long is dropped (and counted) if
    /// the queue behind it is full; with room, it is kept.
    #[serde(with = "humantime_serde")]
    pub max_elapsed: Duration,
}

impl Default for ExportConfig {
    fn default() -> Self {
        crate::defaults::section("export")
    }
}

impl Default for OtlpConfig {
    fn default() -> Self {
        crate::defaults::section("export.otlp")
    }
}

impl Default for RetryConfig {
    fn default() -> Self {
        crate::defaults::section("export.retry")
    }
}

/// Export flags of `tokentrace run`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ExportArgs {
    /// Send spans and metrics to this OTLP collector, e.g. http://localhost:4317
    /// (overrides export.otlp.endpoint and OTEL_EXPORTER_OTLP_ENDPOINT).
    #[arg(long, env = "TOKENTRACE_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,

    /// OTLP protocol [default: OTEL_EXPORTER_OTLP_PROTOCOL, else http/protobuf].
    #[arg(long, value_enum, env = "TOKENTRACE_OTLP_PROTOCOL")]
    pub otlp_protocol: Option<OtlpProtocol>,

    /// Serve Prometheus metrics at http://ADDR/metrics, e.g. 0.0.0.0:9464.
    #[arg(long, env = "TOKENTRACE_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,

    /// service.name of every traced process (default: its comm).
    #[arg(long, env = "TOKENTRACE_SERVICE_NAME")]
    pub service_name: Option<String>,
}

/// Everything the exporter needs, resolved and validated.
#[derive(Debug, Clone, PartialEq)]
pub struct ExportSettings {
    /// `None`: spans are not exported.
    pub traces: Option<Target>,
    /// `None`: metrics are not pushed over OTLP.
    pub metrics: Option<Target>,
    pub prometheus_addr: Option<SocketAddr>,
    pub metrics_interval: Duration,
    pub max_series: usize,
    pub queue_size: usize,
    pub batch_size: usize,
    pub batch_timeout: Duration,
    pub retry: RetryPolicy,
    pub spans: SpanSettings,
    pub sampling: Sampling,
    pub resource: ResourceRules,
}

impl ExportSettings {
    /// Nothing to export: the run loop skips the exporter entirely.
    pub fn is_disabled(&self) -> bool {
        self.traces.is_none() && self.metrics.is_none() && self.prometheus_addr.is_none()
    }
}

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_METRICS_INTERVAL: Duration = Duration::from_secs(10);

/// One OTLP signal, as the spec names its variables.
#[derive(Debug, Clone, Copy)]
enum Signal {
    Traces,
    Metrics,
}

impl Signal {
    fn env(self) -> &'static str {
        match self {
            Signal::Traces => "TRACES",
            Signal::Metrics => "METRICS",
        }
    }

    fn http_path(self) -> &'static str {
        match self {
            Signal::Traces => "v1/traces",
            Signal::Metrics => "v1/metrics",
        }
    }
}

/// `host:4317` → `http://host:4317`; https is refused (see `otlp`).
fn normalise_url(url: &str, origin: &str) -> Result<String, ExportError> {
    let url = url.trim();
    if url.starts_with("https://") {
        return Err(ExportError::Https {
            setting: origin.to_string(),
            url: url.to_string(),
        });
    }
    if url.starts_with("http://") {
        Ok(url.to_string())
    } else if url.contains("://") {
        Err(ExportError::NotHttp {
            setting: origin.to_string(),
            url: url.to_string(),
        })
    } else {
        Ok(format!("http://{url}"))
    }
}

/// `http://h:4318` + `v1/traces` → `http://h:4318/v1/traces` (the spec's
/// rule for the signal-independent endpoint).
fn append_path(base: &str, path: &str) -> String {
    format!("{}/{path}", base.trim_end_matches('/'))
}

fn env_duration_ms(
    env: &dyn Fn(&str) -> Option<String>,
    key: &str,
) -> Result<Option<Duration>, ExportError> {
    env(key)
        .map(|v| {
            v.trim()
                .parse::<u64>()
                .map(Duration::from_millis)
                .map_err(|_| ExportError::NotMillis {
                    var: key.to_string(),
                    value: v,
                })
        })
        .transpose()
}

fn resolve_target(
    config: &ExportConfig,
    args: &ExportArgs,
    env: &dyn Fn(&str) -> Option<String>,
    signal: Signal,
) -> Result<Option<Target>, ExportError> {
    let s = signal.env();
    let enabled = match signal {
        Signal::Traces => config.otlp.traces,
        Signal::Metrics => config.otlp.metrics,
    };
    let exporter_var = format!("OTEL_{s}_EXPORTER");
    let env_exporter = env(&exporter_var).map(|v| v.trim().to_ascii_lowercase());
    if !enabled || env_exporter.as_deref() == Some("none") {
        return Ok(None);
    }
    if let Some(other) = env_exporter.filter(|v| v != "otlp") {
        tracing::warn!(
            "{exporter_var}={other:?} is not supported (only otlp and none); using otlp"
        );
    }

    let protocol_var = format!("OTEL_EXPORTER_OTLP_{s}_PROTOCOL");
    let protocol = match args.otlp_protocol.or(config.otlp.protocol) {
        Some(p) => p,
        None => match env(&protocol_var)
            .map(|v| (protocol_var.clone(), v))
            .or_else(|| {
                env("OTEL_EXPORTER_OTLP_PROTOCOL")
                    .map(|v| ("OTEL_EXPORTER_OTLP_PROTOCOL".to_string(), v))
            }) {
            Some((var, v)) => OtlpProtocol::from_env_value(&v)
                .map_err(|source| ExportError::Protocol { var, source })?,
            None => OtlpProtocol::HttpProtobuf,
        },
    };

    // An explicit endpoint is a base URL; the signal-specific variable is
    // used as is (both per the OTLP exporter spec).
    let endpoint_var = format!("OTEL_EXPORTER_OTLP_{s}_ENDPOINT");
    let (url, is_base) = if let Some(url) = &args.otlp_endpoint {
        (normalise_url(url, "--otlp-endpoint")?, true)
    } else if let Some(url) = &config.otlp.endpoint {
        (normalise_url(url, "export.otlp.endpoint")?, true)
    } else if let Some(url) = env(&endpoint_var).filter(|v| !v.trim().is_empty()) {
        (normalise_url(&url, &endpoint_var)?, false)
    } else if let Some(url) = env("OTEL_EXPORTER_OTLP_ENDPOINT").filter(|v| !v.trim().is_empty()) {
        (normalise_url(&url, "OTEL_EXPORTER_OTLP_ENDPOINT")?, true)
    } else {
        return Ok(None);
    };
    let url = match protocol {
        OtlpProtocol::HttpProtobuf if is_base => append_path(&url, signal.http_path()),
        _ => url,
    };

    let mut headers = HeaderMap::new();
    for var in [
        "OTEL_EXPORTER_OTLP_HEADERS".to_string(),
        format!("OTEL_EXPORTER_OTLP_{s}_HEADERS"),
    ] {
        if let Some(v) = env(&var) {
            let parsed = parse_headers(&v).map_err(|source| ExportError::Headers {
                setting: var.clone(),
                source,
            })?;
            for (name, value) in parsed {
                if let Some(name) = name {
                    headers.insert(name, value);
                }
            }
        }
    }
    for (k, v) in &config.otlp.headers {
        headers.remove(k.to_ascii_lowercase().as_str());
        insert_header(&mut headers, k, v).map_err(|source| ExportError::Headers {
            setting: "export.otlp.headers".to_string(),
            source,
        })?;
    }

    let timeout = match config.otlp.timeout {
        Some(t) => t,
        None => env_duration_ms(env, &format!("OTEL_EXPORTER_OTLP_{s}_TIMEOUT"))?
            .or(env_duration_ms(env, "OTEL_EXPORTER_OTLP_TIMEOUT")?)
            .unwrap_or(DEFAULT_TIMEOUT),
    };
    if timeout.is_zero() {
        return Err(ExportError::ZeroTimeout);
    }
    for var in [
        "OTEL_EXPORTER_OTLP_COMPRESSION".to_string(),
        format!("OTEL_EXPORTER_OTLP_{s}_COMPRESSION"),
    ] {
        if env(&var).is_some_and(|v| !matches!(v.trim(), "" | "none")) {
            tracing::warn!("{var}: compression is not supported; sending uncompressed");
        }
    }
    Ok(Some(Target {
        protocol,
        url,
        headers,
        timeout,
    }))
}

/// Resolves the export settings. Errors name the flag, key or variable to
/// fix.
pub fn resolve(
    config: &ExportConfig,
    args: &ExportArgs,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<ExportSettings, ExportError> {
    let sdk_disabled =
        env("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
    let (traces, metrics) = if sdk_disabled {
        (None, None)
    } else {
        (
            resolve_target(config, args, env, Signal::Traces)?,
            resolve_target(config, args, env, Signal::Metrics)?,
        )
    };

    let mut attributes: BTreeMap<String, String> = BTreeMap::new();
    if let Some(v) = env("OTEL_RESOURCE_ATTRIBUTES") {
        attributes.extend(parse_resource_attributes(&v).map_err(ExportError::ResourceAttributes)?);
    }
    attributes.extend(config.resource_attributes.clone());
    let service_name = args
        .service_name
        .clone()
        .or_else(|| config.service_name.clone())
        .or_else(|| env("OTEL_SERVICE_NAME").filter(|v| !v.trim().is_empty()))
        .or_else(|| attributes.get("service.name").cloned());

    let metrics_interval = match config.metrics_interval {
        Some(d) => d,
        None => {
            env_duration_ms(env, "OTEL_METRIC_EXPORT_INTERVAL")?.unwrap_or(DEFAULT_METRICS_INTERVAL)
        }
    };
    for (setting, zero) in [
        (
            "export.metrics_interval (OTEL_METRIC_EXPORT_INTERVAL)",
            metrics_interval.is_zero(),
        ),
        ("export.queue_size", config.queue_size == 0),
        ("export.batch_size", config.batch_size == 0),
        ("export.max_series", config.max_series == 0),
        (
            "export.retry.initial_backoff",
            config.retry.initial_backoff.is_zero(),
        ),
    ] {
        if zero {
            return Err(ExportError::Zero { setting });
        }
    }
    Ok(ExportSettings {
        traces,
        metrics,
        prometheus_addr: args.metrics_addr.or(config.prometheus_addr),
        metrics_interval,
        max_series: config.max_series,
        queue_size: config.queue_size,
        batch_size: config.batch_size,
        batch_timeout: config.batch_timeout,
        retry: RetryPolicy {
            initial_backoff: config.retry.initial_backoff,
            max_backoff: config.retry.max_backoff.max(config.retry.initial_backoff),
            max_elapsed: config.retry.max_elapsed,
        },
        spans: SpanSettings {
            stall_threshold_ns: crate::units::nanos(config.stall_threshold),
            chunk_events: config.chunk_events,
            max_events: config.max_span_events,
        },
        sampling: Sampling::new(&config.sampling)?,
        resource: ResourceRules {
            service_name,
            service_names: config.service_names.clone(),
            attributes: attributes.into_iter().collect(),
            host_name: host_name(),
        },
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k: &str| map.get(k).cloned()
    }

    fn resolve_with(
        config: &ExportConfig,
        args: &ExportArgs,
        env: &[(&str, &str)],
    ) -> Result<ExportSettings, ExportError> {
        resolve(config, args, &env_of(env))
    }

    #[test]
    fn nothing_configured_exports_nothing() {
        let s = resolve_with(&ExportConfig::default(), &ExportArgs::default(), &[]).expect("valid");
        assert!(s.is_disabled());
        assert_eq!(s.metrics_interval, Duration::from_secs(10));
    }

    #[test]
    fn otel_environment_is_honoured() {
        let s = resolve_with(
            &ExportConfig::default(),
            &ExportArgs::default(),
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/"),
                (
                    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
                    "http://metrics:9999/custom",
                ),
                (
                    "OTEL_EXPORTER_OTLP_HEADERS",
                    "x-tenant=a,authorization=Basic%20xyz",
                ),
                ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-tenant=b"),
                ("OTEL_EXPORTER_OTLP_TIMEOUT", "2500"),
                ("OTEL_METRIC_EXPORT_INTERVAL", "1000"),
                ("OTEL_SERVICE_NAME", "chat"),
                (
                    "OTEL_RESOURCE_ATTRIBUTES",
                    "deployment.environment=prod,service.name=ignored",
                ),
            ],
        )
        .expect("valid");
        let traces = s.traces.expect("traces on");
        assert_eq!(traces.protocol, OtlpProtocol::HttpProtobuf);
        assert_eq!(traces.url, "http://collector:4318/v1/traces");
        assert_eq!(
            traces.headers.get("x-tenant").and_then(|v| v.to_str().ok()),
            Some("b")
        );
        assert_eq!(
            traces
                .headers
                .get("authorization")
                .and_then(|v| v.to_str().ok()),
            Some("Basic xyz")
        );
        assert_eq!(traces.timeout, Duration::from_millis(2500));
        let metrics = s.metrics.expect("metrics on");
        assert_eq!(
            metrics.url, "http://metrics:9999/custom",
            "signal-specific endpoints are used as is"
        );
        assert_eq!(
            metrics
                .headers
                .get("x-tenant")
                .and_then(|v| v.to_str().ok()),
            Some("a")
        );
        assert_eq!(s.metrics_interval, Duration::from_secs(1));
        assert_eq!(s.resource.service_name.as_deref(), Some("chat"));
        assert!(s
            .resource
            .attributes
            .contains(&("deployment.environment".into(), "prod".into())));

        let only_attr = resolve_with(
            &ExportConfig::default(),
            &ExportArgs::default(),
            &[("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attrs")],
        )
        .expect("valid");
        assert_eq!(
            only_attr.resource.service_name.as_deref(),
            Some("from-attrs")
        );
    }

    #[test]
    fn flags_beat_the_file_which_beats_the_environment() {
        let mut config = ExportConfig::default();
        config.otlp.endpoint = Some("file-host:4317".into());
        config.otlp.protocol = Some(OtlpProtocol::Grpc);
        config.service_name = Some("from-file".into());
        let env = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4318"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        ];
        let s = resolve_with(&config, &ExportArgs::default(), &env).expect("valid");
        let t = s.traces.expect("on");
        assert_eq!(
            (t.protocol, t.url.as_str()),
            (OtlpProtocol::Grpc, "http://file-host:4317")
        );
        assert_eq!(s.resource.service_name.as_deref(), Some("from-file"));

        let args = ExportArgs {
            otlp_endpoint: Some("http://cli:4318".into()),
            otlp_protocol: Some(OtlpProtocol::HttpProtobuf),
            metrics_addr: Some("127.0.0.1:9464".parse().expect("addr")),
            service_name: Some("from-cli".into()),
        };
        let s = resolve_with(&config, &args, &env).expect("valid");
        let t = s.traces.expect("on");
        assert_eq!(
            (t.protocol, t.url.as_str()),
            (OtlpProtocol::HttpProtobuf, "http://cli:4318/v1/traces")
        );
        assert_eq!(s.resource.service_name.as_deref(), Some("from-cli"));
        assert_eq!(s.prometheus_addr, args.metrics_addr);
    }

    #[test]
    fn sampling_comes_from_the_config_and_a_bad_rate_is_refused() {
        let yaml = "sampling: {base_rate: 0.25, slow_ttft: 500ms, keep_stalled: false}";
        let config: ExportConfig = crate::defaults::section_with("export", yaml).expect("valid");
        let s = resolve_with(&config, &ExportArgs::default(), &[]).expect("valid");
        assert_eq!(
            s.sampling,
            Sampling::new(&SamplingConfig {
                base_rate: 0.25,
                slow_ttft: Some(Duration::from_millis(500)),
                keep_stalled: false,
                ..SamplingConfig::default()
            })
            .expect("valid")
        );
        assert_eq!(
            resolve_with(&ExportConfig::default(), &ExportArgs::default(), &[])
                .expect("valid")
                .sampling,
            Sampling::keep_all()
        );
        let bad: ExportConfig =
            crate::defaults::section_with("export", "sampling: {base_rate: 2}").expect("yaml");
        let err = resolve_with(&bad, &ExportArgs::default(), &[])
            .expect_err("invalid")
            .to_string();
        assert!(err.contains("export.sampling.base_rate"), "{err}");
    }

    #[test]
    fn signals_can_be_switched_off_and_errors_name_the_source() {
        let env = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_METRICS_EXPORTER", "none"),
        ];
        let s =
            resolve_with(&ExportConfig::default(), &ExportArgs::default(), &env).expect("valid");
        assert!(s.traces.is_some() && s.metrics.is_none());
        let disabled = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_SDK_DISABLED", "true"),
        ];
        assert!(
            resolve_with(&ExportConfig::default(), &ExportArgs::default(), &disabled)
                .expect("valid")
                .is_disabled()
        );

        let err = |env: &[(&str, &str)]| {
            resolve_with(&ExportConfig::default(), &ExportArgs::default(), env)
                .expect_err("invalid")
                .to_string()
        };
        assert!(err(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "https://c:4318")])
            .contains("OTEL_EXPORTER_OTLP_ENDPOINT"));
        assert!(err(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "c:1"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
        ])
        .contains("OTEL_EXPORTER_OTLP_PROTOCOL"));
        assert!(err(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "c:1"),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "5s")
        ])
        .contains("OTEL_EXPORTER_OTLP_TIMEOUT"));
        assert!(err(&[("OTEL_RESOURCE_ATTRIBUTES", "oops")]).contains("OTEL_RESOURCE_ATTRIBUTES"));
        assert!(err(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "c:1"),
            ("OTEL_EXPORTER_OTLP_HEADERS", "a b=c")
        ])
        .contains("OTEL_EXPORTER_OTLP_HEADERS"));
    }
}
