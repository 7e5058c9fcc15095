//! The agent under measurement, as every section starts it: `tokentrace
//! [--log-level L] run <selector> --output json` with stdout discarded,
//! waited for until it logs `tokentrace: ready`, its stderr kept for the
//! section to look for attach lines and the closing summary, and stopped
//! with SIGTERM. `cargo xtask bench --data-hooks H` runs every agent with
//! `run --data-hooks H`.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc::Receiver;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::{lines_of, wait_for};
use crate::util::{self, Guard};

/// The `--data-hooks` every agent of this bench runs with (unset: the
/// agent's default, auto).
static DATA_HOOKS: OnceLock<String> = OnceLock::new();

/// Runs every agent of this bench with `run --data-hooks hooks`.
pub(super) fn use_data_hooks(hooks: &str) {
    let _ = DATA_HOOKS.set(hooks.to_string());
}

/// The text of each of `pid`'s /proc/PID/fdinfo entries (fds closed while
/// reading are skipped): where the kernel says what the agent's BPF
/// programs, maps and links are.
pub(super) fn fdinfo(pid: u32) -> Result<Vec<String>> {
    let mut texts = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fdinfo"))? {
        if let Ok(text) = std::fs::read_to_string(entry?.path()) {
            texts.push(text);
        }
    }
    Ok(texts)
}

pub(super) struct TracingAgent {
    guard: Guard,
    pub pid: u32,
    lines: Receiver<String>,
    /// Its stderr lines read so far (all up to `ready`, at least).
    pub log: Vec<String>,
}

impl TracingAgent {
    /// `tokentrace run --pid <server_pid>` at the default log level,
    /// ready within 60 s.
    pub fn start(agent_bin: &Path, server_pid: u32) -> Result<Self> {
        Self::spawn(
            agent_bin,
            None,
            &["--pid", &server_pid.to_string()],
            Duration::from_secs(60),
        )
    }

    /// Starts the agent picking processes by `selector` (`--pid P`, `--exe
    /// RE`) and waits up to `ready_within` for `tokentrace: ready`.
    /// `log_level` (e.g. `info`, for the attach lines) goes before `run`;
    /// without it the agent's default (or `TOKENTRACE_LOG`) holds.
    pub fn spawn(
        agent_bin: &Path,
        log_level: Option<&str>,
        selector: &[&str],
        ready_within: Duration,
    ) -> Result<Self> {
        let mut cmd = Command::new(agent_bin);
        if let Some(level) = log_level {
            cmd.args(["--log-level", level]);
        }
        cmd.arg("run");
        if let Some(hooks) = DATA_HOOKS.get() {
            cmd.args(["--data-hooks", hooks]);
        }
        let mut child = cmd
            .args(selector)
            .args(["--output", "json"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting the agent")?;
        let lines = lines_of(child.stderr.take().context("agent stderr")?);
        let mut agent = TracingAgent {
            pid: child.id(),
            guard: Guard(child),
            lines,
            log: Vec::new(),
        };
        agent
            .wait_for(&["tokentrace: ready"], ready_within)
            .context("the agent did not become ready")?;
        Ok(agent)
    }

    /// Waits for a log line (read before or now) with every one of
    /// `needles`.
    pub fn wait_for(&mut self, needles: &[&str], timeout: Duration) -> Result<String> {
        wait_for(&self.lines, &mut self.log, needles, timeout)
    }

    /// Stops the agent; returns every stderr line it printed (its summary
    /// among the last).
    ///
    /// SIGTERM, not SIGINT: the agent listens for SIGINT only while its run
    /// loop waits (tokio::signal::ctrl_c() made anew each turn), so under an
    /// event flood a SIGINT usually arrives while it handles a batch and is
    /// lost (the agent then runs on). Its SIGTERM listener lives for the
    /// whole run; both stop it the same way.
    pub fn stop(mut self) -> Result<Vec<String>> {
        util::status("kill", &["-TERM", &self.pid.to_string()])?;
        self.guard.0.wait()?;
        // the reader ends at EOF now that the agent has exited; the cap is
        // for a stray child of its holding the pipe open
        let until = Instant::now() + Duration::from_secs(5);
        while let Some(left) = until.checked_duration_since(Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(line) => self.log.push(line),
                Err(_) => break,
            }
        }
        Ok(self.log)
    }
}

/// The summary's lines that contain one of `keys` (`events:`,
/// `requests:`), trimmed and joined with ` | `, for a round's report line.
pub(super) fn summary(lines: &[String], keys: &[&str]) -> String {
    lines
        .iter()
        .filter(|l| keys.iter().any(|k| l.contains(k)))
        .map(|l| l.trim())
        .collect::<Vec<_>>()
        .join(" | ")
}
