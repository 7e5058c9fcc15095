//! Process helpers shared by the tasks.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// The workspace root (xtask lives one level below it).
/// `cargo xtask` sets CARGO_MANIFEST_DIR when it runs the task; the
/// compile-time value is only a fallback, since a binary shared through a
/// target directory may have been built from another checkout.
pub fn root() -> PathBuf {
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    manifest_dir
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Where cargo puts builds: `$CARGO_TARGET_DIR` (relative to the workspace
/// root when relative), else target/.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => root().join(dir),
        _ => root().join("target"),
    }
}

/// Runs a command to completion in the workspace root; non-zero is an error.
pub fn status(program: &str, args: &[&str]) -> Result<()> {
    let status = Command::new(program)
        .args(args)
        .current_dir(root())
        .status()
        .with_context(|| format!("running {program}"))?;
    if !status.success() {
        bail!("{program} {} failed with {status}", args.join(" "));
    }
    Ok(())
}

/// SIGTERM to `pid` (the process behind `child`, or `child` itself), then
/// SIGKILL to `child` if it has not exited after `grace`; returns once it is
/// reaped.
pub fn terminate(
    child: &mut std::process::Child,
    pid: u32,
    grace: std::time::Duration,
) -> Result<()> {
    status("kill", &["-TERM", &pid.to_string()])?;
    let deadline = std::time::Instant::now() + grace;
    while child.try_wait()?.is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = child.wait();
    Ok(())
}

pub fn cargo(args: &[&str]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    status(&cargo, args)
}

/// True when `program` runs and exits 0.
pub fn succeeds(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// Mounts tracefs if the machine has not (the agent does this too; the
/// tests' own helpers read it, so the task makes sure up front).
pub fn ensure_tracefs() -> Result<()> {
    if Path::new("/sys/kernel/tracing/events").is_dir() || !is_root() {
        return Ok(());
    }
    status("mount", &["-t", "tracefs", "nodev", "/sys/kernel/tracing"])
}

/// A child process killed (and reaped) when dropped.
pub struct Guard(pub Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts a test/demo server script (python3, or node for a `.js`) and
/// waits for its `READY <port>` line.
pub fn start_server(script: &str, args: &[&str]) -> Result<Guard> {
    use std::io::{BufRead, BufReader};
    let interpreter = if script.ends_with(".js") {
        "node"
    } else {
        "python3"
    };
    let mut child = Command::new(interpreter)
        .arg(root().join(script))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {script}"))?;
    let stdout = child.stdout.take().context("server stdout")?;
    let guard = Guard(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.starts_with("READY") {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(30))
        .with_context(|| format!("{script} did not print READY within 30 s"))?;
    Ok(guard)
}

/// Waits until `stderr` of the agent shows its ready line.
pub fn wait_for_line(
    reader: impl std::io::Read + Send + 'static,
    needle: &'static str,
    echo: bool,
) -> Result<()> {
    use std::io::{BufRead, BufReader};
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(reader).lines().map_while(Result::ok) {
            if echo {
                eprintln!("{line}");
            }
            if line.contains(needle) {
                let _ = tx.send(());
            }
        }
    });
    let start = Instant::now();
    rx.recv_timeout(Duration::from_secs(120))
        .with_context(|| format!("no {needle:?} after {:?}", start.elapsed()))
}

/// A free TCP port on loopback.
pub fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("binding a probe socket")?;
    Ok(listener.local_addr()?.port())
}

/// CPU time process `pid` has used (all its threads, those gone
/// included), ns: its CPU-time clock, which any process may read. /proc's
/// stat counts 10 ms ticks, ±7 % of the agent's ~150 ms in a flood round
/// from the quantisation alone; per-thread schedstat misses exited threads.
pub fn cpu_ns(pid: u32) -> Result<u64> {
    // MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED), include/linux/posix-timers.h
    let clock = (!(pid as libc::clockid_t) << 3) | 2;
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a timespec the call may write.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("reading the CPU clock of pid {pid}"));
    }
    Ok(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
}

/// `ns` of CPU time over `seconds` of wall time, as a percentage of one core.
pub fn cpu_percent(ns: u64, seconds: f64) -> f64 {
    ns as f64 / 1e9 / seconds * 100.0
}
