//! On-host profiling sessions, as the `record` and `replay` commands
//! (`crate::record`) and the daemon's control endpoint use them.
//!
//! A session taps the run loop's event stream ([`SessionHub::on_events`]),
//! stitches its own copy of it ([`core`]), optionally samples the traced
//! processes' CPU stacks ([`profile`]) and writes the raw stream
//! ([`rawpb`]), and at its end renders the artifacts in [`ARTIFACTS`]:
//! `report.html`, `trace.json`, `requests.csv`, `requests.jsonl`,
//! `flame.svg` (and the opt-in `raw.pb`).
//!
//! Payload bytes never reach an artifact: reports carry timings, counts and
//! ids only. `raw.pb` is the exception, written only when the user opts in
//! (`--raw`; a daemon also needs `--control-allow-raw`), because replaying
//! the stitching needs the captured bytes.

pub mod control;
pub mod core;
mod csv;
mod flame;
mod hop_order;
mod html;
mod hub;
mod jsonl;
mod perfetto;
pub mod profile;
mod progress;
pub mod rawpb;
pub mod remote;
pub mod replay;
pub mod token;

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

pub use control::ControlArgs;
pub use hub::{
    HubSettings, SelectorSpec, SessionHub, SessionRequest, SessionState, SessionStatus, StartError,
    Triggered,
};
pub use progress::{Progress, ProgressPrinter};

use self::core::Recording;

/// The self-contained HTML report.
pub const REPORT_HTML: &str = "report.html";
/// Chrome/Perfetto trace-event JSON.
pub const TRACE_JSON: &str = "trace.json";
pub const REQUESTS_CSV: &str = "requests.csv";
pub const REQUESTS_JSONL: &str = "requests.jsonl";
/// The on-CPU flame graph.
pub const FLAME_SVG: &str = "flame.svg";
/// The opt-in raw event stream (contains captured payload bytes).
pub const RAW_PB: &str = "raw.pb";

/// Every artifact a session can produce; the control endpoint serves only
/// these names.
pub const ARTIFACTS: [&str; 6] = [
    REPORT_HTML,
    TRACE_JSON,
    REQUESTS_CSV,
    REQUESTS_JSONL,
    FLAME_SVG,
    RAW_PB,
];

/// A written artifact.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Artifact {
    pub name: String,
    pub bytes: u64,
}

/// MIME type of an artifact, for downloads.
pub fn content_type(name: &str) -> &'static str {
    match name.rsplit('.').next() {
        Some("html") => "text/html; charset=utf-8",
        Some("json") => "application/json",
        Some("csv") => "text/csv; charset=utf-8",
        Some("jsonl") => "application/jsonl",
        Some("svg") => "image/svg+xml",
        _ => "application/octet-stream",
    }
}

/// Renders every artifact of `recording` into `dir` (created if missing).
/// `raw.pb`, when recorded, is already there and is listed too.
pub fn write_artifacts(dir: &Path, recording: &Recording) -> Result<Vec<Artifact>> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let flame = flame::render(recording.profile.as_ref(), &recording.meta);
    let files: [(&str, Vec<u8>); 5] = [
        (REQUESTS_CSV, csv::render(recording).into_bytes()),
        (
            REQUESTS_JSONL,
            jsonl::render(&recording.timelines).into_bytes(),
        ),
        (TRACE_JSON, perfetto::render(recording)?),
        (REPORT_HTML, html::render(recording, &flame)?.into_bytes()),
        (FLAME_SVG, flame),
    ];
    for (name, bytes) in &files {
        let path = dir.join(name);
        fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
    }
    list_artifacts(dir)
}

/// The artifacts present in `dir`, in [`ARTIFACTS`] order.
pub fn list_artifacts(dir: &Path) -> Result<Vec<Artifact>> {
    let mut out = Vec::new();
    for name in ARTIFACTS {
        match fs::metadata(dir.join(name)) {
            Ok(meta) => out.push(Artifact {
                name: name.to_string(),
                bytes: meta.len(),
            }),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(err) => {
                return Err(err).with_context(|| format!("reading {}", dir.join(name).display()))
            }
        }
    }
    Ok(out)
}

/// The path of an artifact inside a session directory, for names in
/// [`ARTIFACTS`] only (no path from a request ever reaches the file system).
pub fn artifact_path(dir: &Path, name: &str) -> Option<PathBuf> {
    ARTIFACTS.contains(&name).then(|| dir.join(name))
}

/// This machine's host name, for report headers.
pub fn hostname() -> String {
    fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_every_artifact_and_lists_them() {
        let dir = std::env::temp_dir().join(format!("tt-session-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let rec = core::tests::recording();
        let written = write_artifacts(&dir, &rec).expect("artifacts");
        let names: Vec<&str> = written.iter().map(|a| a.name.as_str()).collect();
        assert_eq!(
            names,
            [
                REPORT_HTML,
                TRACE_JSON,
                REQUESTS_CSV,
                REQUESTS_JSONL,
                FLAME_SVG
            ]
        );
        assert!(written.iter().all(|a| a.bytes > 0));
        assert_eq!(artifact_path(&dir, "../etc/passwd"), None);
        assert_eq!(artifact_path(&dir, RAW_PB), Some(dir.join(RAW_PB)));
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn content_types_follow_extensions() {
        assert_eq!(content_type(REPORT_HTML), "text/html; charset=utf-8");
        assert_eq!(content_type(RAW_PB), "application/octet-stream");
        assert_eq!(content_type(FLAME_SVG), "image/svg+xml");
    }
}
