//! The YAML configuration: the embedded default (`crate::defaults`), a
//! user file laid over it, then command-line flags (see `cli`).

use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use thiserror::Error;

use crate::defaults;

mod triggers;

pub use triggers::{Metric, Rule, TriggersConfig, CAUSES, DEFAULT_PROFILE_HZ};

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
        source: defaults::OverlayError,
    },
    #[error("invalid config: {0}")]
    Invalid(String),
}

/// Every key is optional in a user file: it is laid over the embedded
/// default (`crate::defaults`), the only place default values are written.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub capture: CaptureConfig,
    /// Request paths (prefixes) that mark a process as an LLM server in
    /// automatic mode.
    pub endpoints: Vec<String>,
    pub stitch: StitchSection,
    pub discovery: DiscoveryConfig,
    pub export: crate::export::ExportConfig,
    /// Pod scope and pod labels on spans (used in a cluster only).
    pub kubernetes: crate::k8s::KubernetesConfig,
    pub explain: ExplainConfig,
    /// SLO triggers: sessions the daemon records by itself.
    pub triggers: TriggersConfig,
}

/// Stall explanations ("why was this token late").
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
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
        defaults::section("explain")
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CaptureConfig {
    pub bytes: u32,
    /// Unread bytes in the ring buffer that wake the agent; see
    /// [`CaptureConfig::wakeup_threshold`] for what the kernel gets.
    pub wakeup_bytes: u64,
    pub ring_buffer_bytes: u32,
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// Which hooks feed the data path (`auto`: the socket layer's
    /// tracepoints where the kernel has them, else the syscall hooks;
    /// `socket`, `socket_at_return`, `syscall`).
    pub data_hooks: crate::probes::DataHooksSetting,
    /// Where the probes keep per-thread state (`auto`: task storage where
    /// the kernel has it, else maps; `task_storage`, `maps`).
    pub thread_state: crate::probes::ThreadStateSetting,
    /// Incoming segments dated by their receive stamps, which the agent
    /// turns on for the host (see probes::ArrivalStamps).
    pub receive_stamps: bool,
}

impl CaptureConfig {
    /// `wakeup_bytes`, at most a quarter of the ring buffer: the kernel
    /// wakes the agent each time the unread bytes pass a multiple of it, so
    /// a threshold near the ring's size (a ring made smaller, the default
    /// threshold kept) would wake it only once the ring is full, and every
    /// record in between the polls would be dropped.
    pub fn wakeup_threshold(&self) -> u64 {
        self.wakeup_bytes.min(u64::from(self.ring_buffer_bytes / 4))
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
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
#[serde(deny_unknown_fields)]
pub struct DiscoveryConfig {
    pub demote_after_requests: u32,
    /// Uprobes for every process mapping a probed library, not only the
    /// traced ones (untraced processes then pay each probe's trap).
    pub uprobes_all_processes: bool,
    /// How uprobes are attached (`auto`: uprobe_multi links where the
    /// kernel has them; see `tokentrace check`).
    pub uprobe_mode: crate::probes::UprobeModeSetting,
    /// Run (and say ready) even when probes the traced processes need
    /// could not be attached.
    pub allow_degraded: bool,
}

impl Default for Config {
    /// The embedded default configuration.
    fn default() -> Self {
        defaults::section("")
    }
}

impl Default for CaptureConfig {
    fn default() -> Self {
        defaults::section("capture")
    }
}

impl Default for StitchSection {
    fn default() -> Self {
        defaults::section("stitch")
    }
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        defaults::section("discovery")
    }
}

impl Config {
    /// The embedded default, or `path` laid over it (keys it omits keep
    /// their defaults), checked.
    pub fn load(path: Option<&Path>) -> Result<Self, ConfigError> {
        let config = match path {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.display().to_string(),
                    source,
                })?;
                Self::parse(&text, &path.display().to_string())?
            }
            None => Self::default(),
        };
        config.validate()?;
        Ok(config)
    }

    /// A user file's text laid over the embedded default (not yet
    /// validated); `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        defaults::section_with("", text).map_err(|source| ConfigError::Parse {
            origin: origin.to_string(),
            source,
        })
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
        // Each section's Default reads its own part of the file: the paths
        // they name must be the ones the whole file puts them at.
        assert_eq!(config.capture, CaptureConfig::default());
        assert_eq!(config.stitch, StitchSection::default());
        assert_eq!(config.discovery, DiscoveryConfig::default());
        assert_eq!(config.explain, ExplainConfig::default());
        assert_eq!(config.export, crate::export::ExportConfig::default());
        assert_eq!(
            config.export.sampling,
            crate::export::SamplingConfig::default()
        );
        assert_eq!(config.kubernetes, crate::k8s::KubernetesConfig::default());
        assert_eq!(config.triggers, TriggersConfig::default());
        assert!(config.triggers.rules.is_empty(), "no trigger by default");
        assert_eq!(config.triggers.profile_hz, DEFAULT_PROFILE_HZ);
        assert_eq!(config.capture.bytes, 8192);
        assert!(config.endpoints.iter().any(|e| e == "/v1/chat/completions"));
        assert_eq!(config.capture.poll_interval, Duration::from_millis(50));
    }

    #[test]
    fn a_smaller_ring_lowers_the_wakeup_threshold_to_a_quarter_of_it() {
        let parse = |text: &str| Config::parse(text, "test").expect("parses");
        let default = parse("");
        assert_eq!(
            default.capture.wakeup_threshold(),
            default.capture.wakeup_bytes,
            "the default threshold fits the default ring"
        );
        let small_ring = parse("capture:\n  ring_buffer_bytes: 1048576\n");
        assert_eq!(small_ring.capture.wakeup_threshold(), 262_144);
        let low = parse("capture:\n  wakeup_bytes: 4096\n");
        assert_eq!(low.capture.wakeup_threshold(), 4096);
    }

    #[test]
    fn partial_file_keeps_other_defaults_and_bad_values_are_named() {
        let parse = |text: &str| Config::parse(text, "test");
        let partial = parse("capture:\n  bytes: 512\n").expect("partial config");
        assert_eq!(partial.capture.bytes, 512);
        assert_eq!(partial.capture.poll_interval, Duration::from_millis(50));
        assert_eq!(partial.stitch.max_connections, 65536);
        assert_eq!(parse("").expect("empty file"), Config::default());
        let endpoints = parse("endpoints: [/mine]\n").expect("a list");
        assert_eq!(
            endpoints.endpoints,
            ["/mine"],
            "a list replaces the default"
        );

        let too_big = parse("capture:\n  bytes: 999999\n").expect("parses");
        let err = too_big
            .validate()
            .expect_err("cap above the kernel maximum");
        assert!(err.to_string().contains("--capture-bytes"), "{err}");

        let ids = parse("stitch:\n  request_id_headers: [X-Correlation-ID, x-request-id]\n")
            .expect("parses");
        ids.validate().expect("valid header names");
        assert_eq!(
            &*ids.stitch.stitcher_config().request_id_headers,
            ["x-correlation-id", "x-request-id"]
        );
        let bad = parse("stitch:\n  request_id_headers: ['x request']\n").expect("parses");
        let err = bad.validate().expect_err("a space is not allowed");
        assert!(err.to_string().contains("request_id_headers"), "{err}");

        let unknown = parse("captur:\n  bytes: 1\n");
        assert!(
            unknown.is_err(),
            "a misspelt key must be an error, not ignored"
        );
    }

    #[test]
    fn a_bad_value_is_named_by_its_key_path_once() {
        let err = Config::parse("export:\n  retry: {max_backoff: soon}\n", "my.yaml")
            .expect_err("not a duration");
        let shown = format!("{:#}", anyhow::Error::from(err));
        assert!(
            shown.starts_with("parsing config my.yaml: export.retry.max_backoff: "),
            "{shown}"
        );
        assert_eq!(shown.matches("max_backoff").count(), 1, "{shown}");
        let err = Config::parse("capture: [1\n", "my.yaml").expect_err("not YAML");
        let shown = format!("{:#}", anyhow::Error::from(err));
        assert_eq!(shown.matches("line 2 column 1").count(), 1, "{shown}");
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
