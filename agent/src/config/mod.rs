//! The YAML configuration: an embedded default, optionally replaced by a
//! user file, then overridden by command-line flags (see `cli`).

use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use thiserror::Error;

mod triggers;

pub use triggers::{Metric, Rule, TriggersConfig, CAUSES, DEFAULT_PROFILE_HZ};

/// The configuration compiled into the binary.
pub const DEFAULT_CONFIG: &str = include_str!("../../config/default.yaml");

/// Messages name what failed, not why: the cause is the error's `source`,
/// which the binary prints after it (`{:#}`), so embedding its text too
/// would print it twice.
#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("reading config file {path}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("parsing config {origin}")]
    Parse {
        origin: String,
        source: serde_yaml::Error,
    },
    #[error("invalid config: {0}")]
    Invalid(String),
}

/// Every section is optional in a user file; omitted ones take the
/// built-in defaults below, which a test keeps equal to the embedded file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub capture: CaptureConfig,
    #[serde(default = "default_endpoints")]
    pub endpoints: Vec<String>,
    #[serde(default)]
    pub stitch: StitchSection,
    #[serde(default)]
    pub discovery: DiscoveryConfig,
    #[serde(default)]
    pub export: crate::export::ExportConfig,
    /// Pod scope and pod labels on spans (used in a cluster only).
    #[serde(default)]
    pub kubernetes: crate::k8s::KubernetesConfig,
    #[serde(default)]
    pub explain: ExplainConfig,
    /// SLO triggers: sessions the daemon records by itself.
    #[serde(default)]
    pub triggers: TriggersConfig,
}

/// Stall explanations ("why was this token late").
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExplainConfig {
    /// A chunk whose gap (or send-queue hold) is at least this long gets a
    /// cause breakdown in the timeline's `stalls`.
    #[serde(with = "humantime_serde")]
    pub stall_threshold: Duration,
    /// Off-CPU intervals and send-queue holds shorter than this are not
    /// recorded by the kernel.
    #[serde(with = "humantime_serde")]
    pub min_interval: Duration,
    /// How long inference events (USDT, CUDA syncs, off-CPU) are kept for
    /// requests still streaming.
    #[serde(with = "humantime_serde")]
    pub history: Duration,
}

impl Default for ExplainConfig {
    fn default() -> Self {
        Self {
            stall_threshold: Duration::from_millis(30),
            min_interval: Duration::from_millis(1),
            history: Duration::from_secs(120),
        }
    }
}

fn default_endpoints() -> Vec<String> {
    [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/responses",
        "/generate",
        "/generate_stream",
        "/completion",
        "/api/generate",
        "/api/chat",
        "/invocations",
        // gRPC (the path is /package.Service/Method): Triton and KServe v2
        // (ModelInfer, ModelStreamInfer), TGI's text generation service.
        "/inference.GRPCInferenceService",
        "/generate.v2.TextGenerationService",
    ]
    .map(String::from)
    .to_vec()
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CaptureConfig {
    pub bytes: u32,
    pub wakeup_bytes: u64,
    pub ring_buffer_bytes: u32,
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StitchSection {
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Duration,
    pub max_connections: usize,
    pub max_buffered_bytes: usize,
    /// Request headers whose value identifies a request (`request_id` in
    /// JSON, `http.request.header.<name>` on spans); the first present wins.
    pub request_id_headers: Vec<String>,
}

impl StitchSection {
    /// What the stitcher is built with (header names compared lower-case).
    pub fn stitcher_config(&self) -> crate::stitch::StitchConfig {
        crate::stitch::StitchConfig {
            max_buffered_bytes: self.max_buffered_bytes,
            max_connections: self.max_connections,
            request_id_headers: self
                .request_id_headers
                .iter()
                .map(|h| h.to_ascii_lowercase())
                .collect(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiscoveryConfig {
    pub demote_after_requests: u32,
    /// Uprobes for every process mapping a probed library, not only the
    /// traced ones (untraced processes then pay each probe's trap).
    pub uprobes_all_processes: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            capture: CaptureConfig::default(),
            endpoints: default_endpoints(),
            stitch: StitchSection::default(),
            discovery: DiscoveryConfig::default(),
            explain: ExplainConfig::default(),
            export: crate::export::ExportConfig::default(),
            kubernetes: crate::k8s::KubernetesConfig::default(),
            triggers: TriggersConfig::default(),
        }
    }
}

impl Default for CaptureConfig {
    fn default() -> Self {
        Self {
            bytes: 8192,
            wakeup_bytes: 256 * 1024,
            ring_buffer_bytes: 16 << 20,
            poll_interval: Duration::from_millis(10),
        }
    }
}

impl Default for StitchSection {
    fn default() -> Self {
        Self {
            idle_timeout: Duration::from_secs(300),
            max_connections: 65536,
            max_buffered_bytes: 1 << 20,
            request_id_headers: vec![crate::stitch::DEFAULT_REQUEST_ID_HEADER.to_string()],
        }
    }
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        Self {
            demote_after_requests: 32,
            uprobes_all_processes: false,
        }
    }
}

impl Config {
    /// The embedded default, or `path` parsed on its own (keys it omits keep
    /// their built-in defaults).
    pub fn load(path: Option<&Path>) -> Result<Self, ConfigError> {
        let (text, origin) = match path {
            Some(path) => (
                std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.display().to_string(),
                    source,
                })?,
                path.display().to_string(),
            ),
            None => (DEFAULT_CONFIG.to_string(), "(embedded default)".to_string()),
        };
        let config: Config =
            serde_yaml::from_str(&text).map_err(|source| ConfigError::Parse { origin, source })?;
        config.validate()?;
        Ok(config)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let max = crate::probes::MAX_CAPTURE_BYTES;
        if self.capture.bytes == 0 || self.capture.bytes > max {
            return Err(ConfigError::Invalid(format!(
                "capture.bytes (--capture-bytes) must be between 1 and {max}, got {}",
                self.capture.bytes
            )));
        }
        let ring = self.capture.ring_buffer_bytes;
        if !ring.is_power_of_two() || ring < 4096 {
            return Err(ConfigError::Invalid(format!(
                "capture.ring_buffer_bytes must be a power of two of at least 4096, got {ring}"
            )));
        }
        self.triggers.validate()?;
        if self.capture.poll_interval.is_zero() {
            return Err(ConfigError::Invalid(
                "capture.poll_interval must be above zero".into(),
            ));
        }
        if let Some(bad) = self
            .stitch
            .request_id_headers
            .iter()
            .find(|h| !is_header_name(h))
        {
            return Err(ConfigError::Invalid(format!(
                "stitch.request_id_headers: {bad:?} is not an HTTP header name (letters, digits and !#$%&'*+-.^_`|~ only)"
            )));
        }
        Ok(())
    }
}

/// An RFC 9110 field name (a token).
fn is_header_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_default_parses_and_is_valid() {
        let config = Config::load(None).expect("embedded default config");
        assert_eq!(
            config,
            Config::default(),
            "embedded YAML and built-in defaults diverged"
        );
        assert_eq!(config.capture.bytes, 8192);
        assert!(config.endpoints.iter().any(|e| e == "/v1/chat/completions"));
        assert_eq!(config.capture.poll_interval, Duration::from_millis(10));
    }

    #[test]
    fn partial_file_keeps_other_defaults_and_bad_values_are_named() {
        let partial: Config =
            serde_yaml::from_str("capture:\n  bytes: 512\n").expect("partial config");
        assert_eq!(partial.capture.bytes, 512);
        assert_eq!(partial.stitch.max_connections, 65536);

        let too_big: Config = serde_yaml::from_str("capture:\n  bytes: 999999\n").expect("parses");
        let err = too_big
            .validate()
            .expect_err("cap above the kernel maximum");
        assert!(err.to_string().contains("--capture-bytes"), "{err}");

        let ids: Config = serde_yaml::from_str(
            "stitch:\n  request_id_headers: [X-Correlation-ID, x-request-id]\n",
        )
        .expect("parses");
        ids.validate().expect("valid header names");
        assert_eq!(
            &*ids.stitch.stitcher_config().request_id_headers,
            ["x-correlation-id", "x-request-id"]
        );
        let bad: Config =
            serde_yaml::from_str("stitch:\n  request_id_headers: ['x request']\n").expect("parses");
        let err = bad.validate().expect_err("a space is not allowed");
        assert!(err.to_string().contains("request_id_headers"), "{err}");

        let unknown = serde_yaml::from_str::<Config>("captur:\n  bytes: 1\n");
        assert!(
            unknown.is_err(),
            "a misspelt key must be an error, not ignored"
        );
    }

    #[test]
    fn a_config_error_states_its_cause_once() {
        let err = Config::load(Some(Path::new("/nonexistent/tokentrace.yaml")))
            .expect_err("no such file");
        let shown = format!("{:#}", anyhow::Error::from(err));
        assert_eq!(
            shown.matches("No such file or directory").count(),
            1,
            "{shown}"
        );
        assert!(
            shown.starts_with("reading config file /nonexistent/tokentrace.yaml: "),
            "{shown}"
        );
    }
}
