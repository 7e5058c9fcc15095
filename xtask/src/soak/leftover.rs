//! What a killed agent leaves in the kernel. Before the kill, the BPF
//! programs and links the agent holds are read from its fds
//! (`/proc/PID/fdinfo`: `prog_id`, `link_id`, `event_type`); after it, they
//! must be gone from `bpftool prog/link show`, `bpftool perf show` must list
//! nothing of that pid, and `uprobe_events` (legacy, tracefs-created
//! uprobes; libbpf names them after the pid) must hold none of its.
//! Other developers' agents may run on the same host: only what this agent
//! held is checked, the rest is counted for the report.

use std::collections::BTreeSet;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// BPF objects held by a live agent.
#[derive(Debug, Default)]
pub struct Held {
    pub progs: BTreeSet<u64>,
    pub links: BTreeSet<u64>,
    /// uprobe_multi links, and links whose perf event is a uprobe or
    /// uretprobe.
    pub uprobe_links: usize,
}

pub fn held_by(pid: u32) -> Result<Held> {
    let mut held = Held::default();
    let dir = format!("/proc/{pid}/fd");
    for entry in std::fs::read_dir(&dir).with_context(|| format!("reading {dir}"))? {
        let entry = entry?;
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        let target = target.display().to_string();
        if !target.starts_with("anon_inode:bpf") {
            continue;
        }
        let fdinfo = format!("/proc/{pid}/fdinfo/{}", entry.file_name().to_string_lossy());
        let Ok(info) = std::fs::read_to_string(&fdinfo) else {
            continue;
        };
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| v.trim().to_string())
        };
        if target == "anon_inode:bpf-prog" {
            if let Some(id) = field("prog_id:").and_then(|v| v.parse().ok()) {
                held.progs.insert(id);
            }
        } else if target == "anon_inode:bpf_link" {
            if let Some(id) = field("link_id:").and_then(|v| v.parse().ok()) {
                held.links.insert(id);
            }
            // a perf-event uprobe link names its event type; an
            // uprobe_multi link (the agent's default mode) its link type
            let uprobe =
                |name| field(name).is_some_and(|t| t.contains("uprobe") || t.contains("uretprobe"));
            if uprobe("event_type:") || uprobe("link_type:") {
                held.uprobe_links += 1;
            }
        }
    }
    Ok(held)
}

/// What remained after the kill.
#[derive(Debug, Default)]
pub struct Left {
    pub progs: Vec<u64>,
    pub links: Vec<u64>,
    /// `bpftool perf show` entries of the killed pid.
    pub perf_entries: usize,
    pub uprobe_events: Vec<String>,
    /// Programs of other processes (other agents on the host), for the report.
    pub other_progs: usize,
    /// How long after the kill the kernel was clean (or the timeout).
    pub after_ms: f64,
}

impl Left {
    pub fn clean(&self) -> bool {
        self.progs.is_empty()
            && self.links.is_empty()
            && self.perf_entries == 0
            && self.uprobe_events.is_empty()
    }
}

/// Polls until nothing `pid` held remains (the kernel frees programs after
/// the last reference goes, a little after the process is reaped), or
/// `timeout`.
pub fn wait_gone(pid: u32, held: &Held, killed: Instant, timeout: Duration) -> Result<Left> {
    loop {
        let mut left = look(pid, held)?;
        left.after_ms = killed.elapsed().as_secs_f64() * 1000.0;
        if left.clean() || killed.elapsed() > timeout {
            return Ok(left);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn look(pid: u32, held: &Held) -> Result<Left> {
    let ids = |what: &str| -> Result<Vec<serde_json::Value>> {
        let out = Command::new("bpftool")
            .args([what, "show", "-j"])
            .output()
            .context("running bpftool (apt: linux-tools / bpftool)")?;
        if !out.status.success() {
            bail!(
                "bpftool {what} show failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let text = String::from_utf8_lossy(&out.stdout);
        if text.trim().is_empty() {
            return Ok(Vec::new());
        }
        let v: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("bpftool {what} show -j output"))?;
        Ok(v.as_array().cloned().unwrap_or_default())
    };
    let id = |v: &serde_json::Value| v.get("id").and_then(serde_json::Value::as_u64);
    let progs = ids("prog")?;
    let mut left = Left {
        progs: progs
            .iter()
            .filter_map(id)
            .filter(|i| held.progs.contains(i))
            .collect(),
        links: ids("link")?
            .iter()
            .filter_map(id)
            .filter(|i| held.links.contains(i))
            .collect(),
        perf_entries: ids("perf")?
            .iter()
            .filter(|e| e.get("pid").and_then(serde_json::Value::as_u64) == Some(u64::from(pid)))
            .count(),
        ..Left::default()
    };
    left.other_progs = progs.len() - left.progs.len();
    let events = std::fs::read_to_string("/sys/kernel/tracing/uprobe_events").unwrap_or_default();
    left.uprobe_events = events
        .lines()
        .filter(|l| l.contains(&format!("_{pid}_")))
        .map(str::to_string)
        .collect();
    Ok(left)
}
