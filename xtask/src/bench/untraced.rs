//! The `untraced` section of `cargo xtask bench`: what processes the agent
//! does not trace pay while it runs. Rounds alternate without and with an
//! agent tracing some other process:
//!
//! - **untraced syscall tax**: `sse_flood.py write-loop` (16-byte send()s on
//!   loopback TCP, a thread draining the other end) while the agent traces
//!   an idle process: every send and recv still runs the syscall
//!   tracepoints' pid checks, and (TCP_NODELAY: a segment per send) the
//!   receiving socket's `tcp_probe` hook its one `sock_states` lookup;
//! - **untraced tax (CUDA)**: target/native/launch_loop on the stand-in
//!   libcudart while the agent traces another launch_loop holding at its
//!   gate (same file, probes attached for that process only).
//!
//! - **attach scale**: 100 idle Python processes that imported `ssl`,
//!   picked up by `--exe`: time to `ready` (every process's OpenSSL uprobes
//!   attached), the attach batch as the agent logs it, the agent's RSS and
//!   the host's slab growth (approximate: other activity moves it too).
//!
//! The CUDA tax and the attach scale are measured in each uprobe attach
//! mode (uprobe_multi, perf_event, tracefs) side by side.
//!
//! The TLS untraced tax (an untraced process using the traced server's
//! libssl) is measured in the TLS section.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};

use super::{finish_loop_now, json_number, median, start_loop, Options, TracingAgent, FLOOD};
use crate::util::{self, Guard};

/// A `tokentrace run` picking processes by `selector` (`--pid P`, `--exe
/// RE`), ready (and with uprobes attached when `uprobes_in` names a file a
/// picked process maps).
fn start_agent(
    agent_bin: &Path,
    selector: &[&str],
    uprobes_in: Option<&str>,
) -> Result<TracingAgent> {
    let limit = Duration::from_secs(120);
    let mut agent = TracingAgent::spawn(agent_bin, Some("info"), selector, limit)?;
    if let Some(file) = uprobes_in {
        agent.wait_for(&["probing", file], limit)?;
    }
    Ok(agent)
}

/// One write-loop run: writes/s.
pub(super) fn write_loop(seconds: f64) -> Result<f64> {
    gated_loop("write-loop", "writes_per_s", seconds)
}

/// One run of a gated sse_flood.py loop (`write-loop`, `pingpong`): the
/// JSON number `key` of its result line.
pub(super) fn gated_loop(mode: &str, key: &str, seconds: f64) -> Result<f64> {
    let mut child = Command::new("python3")
        .arg(util::root().join(FLOOD))
        .args([mode, "--seconds", &seconds.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting the {mode} loop"))?;
    let mut out = BufReader::new(child.stdout.take().context("loop stdout")?);
    let mut stdin = child.stdin.take().context("loop stdin")?;
    let _guard = Guard(child);
    let mut line = String::new();
    out.read_line(&mut line)?;
    anyhow::ensure!(line.starts_with("READY"), "{mode} printed {line:?}");
    stdin.write_all(b"go\n")?;
    line.clear();
    out.read_line(&mut line)?;
    json_number(&line, key).with_context(|| format!("{mode} printed {line:?}"))
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
        let agent = start_agent(agent_bin, &["--pid", &idle.0.id().to_string()], None)?;
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
    let modes = super::tls::UPROBE_MODES;
    let mut base = Vec::new();
    let mut with: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    for round in 0..opts.rounds {
        let b = finish_loop_now(&loop_bin, opts)?.rate;
        for (i, mode) in modes.iter().enumerate() {
            // The traced loop holds at its gate: it maps libcudart and has
            // its probes, but launches nothing.
            let (traced, _out) = start_loop(&loop_bin, opts)?;
            let agent = start_agent(
                agent_bin,
                &["--pid", &traced.0.id().to_string(), "--uprobe-mode", mode],
                Some("libcudart.so.12: CUDA"),
            )?;
            let w = finish_loop_now(&loop_bin, opts)?.rate;
            agent.stop()?;
            drop(traced);
            eprintln!("untraced launch_loop round {round} ({mode} uprobes): {b:.0} launches/s without agent, {w:.0} with: ratio {:.4}", w / b);
            with[i].push(w);
        }
        base.push(b);
    }
    let b = median(&mut base);
    let mut cuda = String::new();
    for (i, mode) in modes.iter().enumerate() {
        let w = median(&mut with[i]);
        cuda.push_str(&format!(
            "untraced tax ({mode} uprobes; CUDA: launch_loop untraced while the agent traces another launch_loop on the same stand-in libcudart.so.12, {} s runs, {} rounds): median {b:.0} launches/s without agent, {w:.0} with: ratio {:.4}\n",
            opts.launch_seconds,
            opts.rounds,
            w / b,
        ));
    }
    let mut scale = String::new();
    for mode in modes {
        scale.push_str(&attach_scale(agent_bin, 100, mode)?);
    }
    print!("{syscalls}{cuda}{scale}");
    report.push_str(&syscalls);
    report.push_str(&cuda);
    report.push_str(&scale);
    Ok(())
}

/// `key:` of /proc/meminfo or /proc/PID/status, in kB.
fn kib(file: &str, key: &str) -> Result<u64> {
    let text = std::fs::read_to_string(file)?;
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|rest| rest.trim_start_matches(':').split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("no {key} in {file}"))
}

fn attach_scale(agent_bin: &Path, processes: usize, mode: &str) -> Result<String> {
    const MARKER: &str = "tokentrace-bench-attach-scale";
    // The interpreter itself, not a launcher script (pyenv's shim would be
    // picked by the pattern too).
    let python = ["/usr/bin/python3", "python3"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .unwrap_or("python3");
    let mut idle = Vec::new();
    for _ in 0..processes {
        let mut child = Command::new(python)
            .args([
                "-c",
                "import ssl, sys, time; print('ok', flush=True); time.sleep(600)",
                MARKER,
            ])
            .stdout(Stdio::piped())
            .spawn()
            .context("starting an idle Python process")?;
        let out = child.stdout.take().context("stdout")?;
        idle.push((Guard(child), BufReader::new(out)));
    }
    for (_, out) in &mut idle {
        let mut line = String::new();
        out.read_line(&mut line)?;
    }
    let slab_before = kib("/proc/meminfo", "Slab")?;
    let started = std::time::Instant::now();
    let agent = start_agent(agent_bin, &["--exe", MARKER, "--uprobe-mode", mode], None)?;
    let ready = started.elapsed();
    std::thread::sleep(Duration::from_millis(500));
    let rss = kib(&format!("/proc/{}/status", agent.pid), "VmRSS")?;
    let slab_after = kib("/proc/meminfo", "Slab")?;
    let batch = agent
        .log
        .iter()
        .find(|l| l.contains("uprobe links for"))
        .map(|l| l.split("INFO").last().unwrap_or(l).trim().to_string())
        .unwrap_or_else(|| "no attach line".into());
    agent.stop()?;
    drop(idle);
    Ok(format!(
        "attach scale ({mode} uprobes; {processes} idle Python processes with libssl, --exe): ready after {:.0} ms; {batch}; agent RSS {rss} KiB; host slab {:+} KiB\n",
        ready.as_secs_f64() * 1e3,
        slab_after as i64 - slab_before as i64,
    ))
}
