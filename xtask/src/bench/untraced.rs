//! The `untraced` section of `cargo xtask bench`: what processes the agent
//! does not trace pay while it runs. Rounds alternate without and with an
//! agent tracing some other process:
//!
//! - **untraced syscall tax**: `sse_flood.py write-loop` (16-byte send()s on
//!   loopback TCP, a thread draining the other end) while the agent traces
//!   an idle process: every send and recv still runs the syscall
//!   tracepoints' pid checks;
//! - **untraced tax (CUDA)**: target/native/launch_loop on the stand-in
//!   libcudart while the agent traces another launch_loop holding at its
//!   gate (same file, probes attached for that process only).
//!
//! The TLS untraced tax (an untraced process using the traced server's
//! libssl) is measured in the TLS section.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};

use super::{finish_loop_now, json_number, lines_of, median, start_loop, wait_for, Options, FLOOD};
use crate::util::{self, Guard};

/// A `tokentrace run` tracing `pid`, ready (and with uprobes attached when
/// `uprobes_in` names a file the process maps).
struct Agent {
    guard: Guard,
    pid: u32,
}

impl Agent {
    fn start(agent_bin: &Path, pid: u32, uprobes_in: Option<&str>) -> Result<Self> {
        let mut child = Command::new(agent_bin)
            .args(["--log-level", "info", "run", "--pid", &pid.to_string()])
            .args(["--output", "json"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting the agent")?;
        let log = lines_of(child.stderr.take().context("agent stderr")?);
        let agent = Agent {
            pid: child.id(),
            guard: Guard(child),
        };
        let mut seen = Vec::new();
        if let Some(file) = uprobes_in {
            wait_for(&log, &mut seen, &["probing", file], Duration::from_secs(60))?;
        }
        wait_for(
            &log,
            &mut seen,
            &["tokentrace: ready"],
            Duration::from_secs(60),
        )?;
        Ok(agent)
    }

    fn stop(mut self) -> Result<()> {
        util::status("kill", &["-TERM", &self.pid.to_string()])?;
        self.guard.0.wait()?;
        Ok(())
    }
}

/// One write-loop run: writes/s.
fn write_loop(seconds: f64) -> Result<f64> {
    let mut child = Command::new("python3")
        .arg(util::root().join(FLOOD))
        .args(["write-loop", "--seconds", &seconds.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the write loop")?;
    let mut out = BufReader::new(child.stdout.take().context("write-loop stdout")?);
    let mut stdin = child.stdin.take().context("write-loop stdin")?;
    let _guard = Guard(child);
    let mut line = String::new();
    out.read_line(&mut line)?;
    anyhow::ensure!(line.starts_with("READY"), "write-loop printed {line:?}");
    stdin.write_all(b"go\n")?;
    line.clear();
    out.read_line(&mut line)?;
    json_number(&line, "writes_per_s").with_context(|| format!("write-loop printed {line:?}"))
}

pub fn run(agent_bin: &Path, opts: &Options, report: &mut String) -> Result<()> {
    // ---- syscalls
    let idle = Guard(
        Command::new("sleep")
            .arg("3600")
            .spawn()
            .context("starting an idle process to trace")?,
    );
    write_loop(1.0)?; // warm-up
    let (mut base, mut with) = (Vec::new(), Vec::new());
    for round in 0..opts.rounds {
        let b = write_loop(opts.seconds)?;
        let agent = Agent::start(agent_bin, idle.0.id(), None)?;
        let w = write_loop(opts.seconds)?;
        agent.stop()?;
        eprintln!("untraced write-loop round {round}: {b:.0} writes/s without agent, {w:.0} with: ratio {:.4}", w / b);
        base.push(b);
        with.push(w);
    }
    let (b, w) = (median(&mut base), median(&mut with));
    let syscalls = format!(
        "untraced syscall tax (write-loop: 16-byte send()s on loopback TCP in an untraced process, {} s rounds, {} rounds): median {b:.0} writes/s without agent, {w:.0} with: ratio {:.4} ({:+.3} µs per write incl. the drain's recv)\n",
        opts.seconds,
        opts.rounds,
        w / b,
        1e6 / w - 1e6 / b,
    );
    drop(idle);

    // ---- CUDA
    crate::native::build()?;
    let loop_bin = util::root().join("target/native/launch_loop");
    finish_loop_now(&loop_bin, opts)?; // warm-up
    let (mut base, mut with) = (Vec::new(), Vec::new());
    for round in 0..opts.rounds {
        let b = finish_loop_now(&loop_bin, opts)?.rate;
        // The traced loop holds at its gate: it maps libcudart and has its
        // probes, but launches nothing.
        let (traced, _out) = start_loop(&loop_bin, opts)?;
        let agent = Agent::start(agent_bin, traced.0.id(), Some("libcudart.so.12: CUDA"))?;
        let w = finish_loop_now(&loop_bin, opts)?.rate;
        agent.stop()?;
        drop(traced);
        eprintln!("untraced launch_loop round {round}: {b:.0} launches/s without agent, {w:.0} with: ratio {:.4}", w / b);
        base.push(b);
        with.push(w);
    }
    let (b, w) = (median(&mut base), median(&mut with));
    let cuda = format!(
        "untraced tax (CUDA: launch_loop untraced while the agent traces another launch_loop on the same stand-in libcudart.so.12, {} s runs, {} rounds): median {b:.0} launches/s without agent, {w:.0} with: ratio {:.4}\n",
        opts.launch_seconds,
        opts.rounds,
        w / b,
    );
    print!("{syscalls}{cuda}");
    report.push_str(&syscalls);
    report.push_str(&cuda);
    Ok(())
}
