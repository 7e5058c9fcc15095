//! bpftrace one-liners on a traced server, the yardstick issue 25 asks the
//! agent's kernel bill to be read against: what the least a user could
//! write to watch a server's sends costs that server, on the same
//! tracepoint as the agent's send hook.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::util::Guard;

/// The one-liners, by what they do per send: keep a sum in the kernel, or
/// ship one record to userspace (as the agent does, without the payload).
pub(super) const ONE_LINERS: [(&str, &str); 2] = [
    (
        "count",
        "tracepoint:sock:sock_send_length /pid == PID/ { @bytes = sum(args->ret); }",
    ),
    (
        "printf",
        "tracepoint:sock:sock_send_length /pid == PID/ { printf(\"%d %d\\n\", tid, args->ret); }",
    ),
];

/// A bpftrace one-liner attached while alive.
pub(super) struct OneLiner {
    pub pid: u32,
    _running: Guard,
}

/// Whether `bpftrace` runs here, installed from apt where it is missing
/// (it is not among the test dependencies, only the bench's): without it
/// the bench has no yardstick to read the agent's bill against.
pub(super) fn ensure_installed() -> bool {
    if runs() {
        return true;
    }
    if let Err(err) = crate::deps::ensure_apt(&["bpftrace"]) {
        eprintln!("xtask: bench without bpftrace one-liners: {err:#}");
        return false;
    }
    runs()
}

fn runs() -> bool {
    Command::new("bpftrace")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

impl OneLiner {
    /// Runs `program` with `PID` replaced by `server_pid`, and waits until
    /// its probe is attached (bpftool's perf list names its tracepoint).
    pub(super) fn attach(program: &str, server_pid: u32) -> Result<Self> {
        let child = Command::new("bpftrace")
            .arg("-e")
            .arg(program.replace("PID", &server_pid.to_string()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting bpftrace")?;
        let pid = child.id();
        let mut running = Guard(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !attached(pid)? {
            if let Some(status) = running.0.try_wait()? {
                bail!("bpftrace exited before attaching ({status}): {program}");
            }
            if Instant::now() > deadline {
                bail!("bpftrace attached nothing within 30 s: {program}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Self {
            pid,
            _running: running,
        })
    }
}

/// Whether process `pid` holds a BPF program on a tracepoint.
fn attached(pid: u32) -> Result<bool> {
    let out = Command::new("bpftool")
        .args(["perf", "list", "--json"])
        .output()
        .context("running `bpftool perf list` (apt: bpftool)")?;
    let list: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("bpftool perf list printed no JSON")?;
    Ok(list.as_array().is_some_and(|entries| {
        entries.iter().any(|e| {
            e.get("pid").and_then(serde_json::Value::as_u64) == Some(u64::from(pid))
                && e.get("fd_type").and_then(serde_json::Value::as_str) == Some("tracepoint")
        })
    }))
}
