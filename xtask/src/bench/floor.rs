//! The tracepoint floor of the kernel section's taxes: empty BPF programs on
//! the tracepoints the agent attaches (`tests/bench/empty_hooks.py`), so a
//! tax can be split into what any program there costs (the tracepoint's
//! call into BPF) and what the agent's programs add to it.

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

use super::agent::fdinfo;
use crate::util::{self, Guard};

const EMPTY_HOOKS: &str = "tests/bench/empty_hooks.py";

/// The tracepoints `pid`'s BPF links are attached to (fdinfo `tp_name`:
/// raw tracepoints, tp_btf programs and perf-event tracepoints alike),
/// sorted, without repeats.
pub(super) fn agent_tracepoints(pid: u32) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for text in fdinfo(pid)? {
        if !text.contains("link_type:") {
            continue;
        }
        if let Some(name) = text.lines().find_map(|l| l.strip_prefix("tp_name:")) {
            names.push(name.trim().to_string());
        }
    }
    names.sort();
    names.dedup();
    if names.is_empty() {
        bail!("agent {pid} holds no tracepoint link (fdinfo tp_name)");
    }
    Ok(names)
}

/// Empty programs attached to tracepoints while alive.
pub(super) struct EmptyHooks {
    attached: Guard,
}

impl EmptyHooks {
    pub(super) fn attach(tracepoints: &[String]) -> Result<Self> {
        let mut child = Command::new("python3")
            .arg(util::root().join(EMPTY_HOOKS))
            .args(tracepoints)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting empty_hooks.py")?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().context("empty_hooks.py stdout")?)
            .read_line(&mut line)?;
        let mut stderr = child.stderr.take().context("empty_hooks.py stderr")?;
        let guard = Guard(child);
        if !line.starts_with("READY") {
            let mut why = String::new();
            stderr.read_to_string(&mut why)?;
            bail!("empty_hooks.py attached nothing: {}", why.trim());
        }
        Ok(Self { attached: guard })
    }

    /// The process holding the empty program (its fdinfo has the
    /// program's bpf_stats).
    pub(super) fn pid(&self) -> u32 {
        self.attached.0.id()
    }
}
