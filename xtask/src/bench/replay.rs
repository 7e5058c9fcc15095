//! `cargo xtask bench replay`: the agent's userspace cost per event,
//! without the kernel. Generated records of a streaming server (many
//! keep-alive connections, chunked SSE responses in separate writes, CUDA
//! syncs, off-CPU intervals and `llm:*` marks) go through decode → stitch →
//! explain → summary and output lines (discarded) on one core, in the
//! release build of the agent library (agent/examples/replay_bench.rs).
//! Reports events/s and CPU per event, the median of several runs.
//!
//! No root needed: nothing is loaded into the kernel.

use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::util;

const USAGE: &str =
    "usage: cargo xtask bench replay [--events N] [--connections C] [--runs R] [--output json|text]";

/// The figure the issue asks for: at least this many events/s on one core.
const TARGET_EVENTS_PER_S: f64 = 1_000_000.0;

struct Options {
    events: u64,
    connections: u32,
    runs: u32,
    output: String,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut opts = Options {
        events: 2_000_000,
        connections: 256,
        runs: 3,
        output: "json".into(),
    };
    for (flag, value) in super::flag_values(args)? {
        match flag {
            "--events" => opts.events = value.parse()?,
            "--connections" => opts.connections = value.parse()?,
            "--runs" => opts.runs = value.parse()?,
            "--output" if value == "json" || value == "text" => opts.output = value.to_string(),
            _ => bail!("{USAGE}"),
        }
    }
    if opts.runs == 0 || opts.events < 1_000_000 {
        bail!("--runs must be >= 1 and --events >= 1000000 (the figure is for a million events or more)");
    }
    Ok(opts)
}

/// One run's JSON line: events/s and CPU ns per event.
struct Run {
    line: String,
    events_per_s: f64,
    cpu_ns_per_event: f64,
}

fn number(line: &str, key: &str) -> Result<f64> {
    super::json_number(line, key)
        .with_context(|| format!("replay_bench printed no number for {key}: {line}"))
}

/// Runs the benchmark pinned to `cpu`.
fn run_once(bin: &std::path::Path, cpu: usize, opts: &Options) -> Result<Run> {
    let out = Command::new("taskset")
        .args(["-c", &cpu.to_string()])
        .arg(bin)
        .args(["--events", &opts.events.to_string()])
        .args(["--connections", &opts.connections.to_string()])
        .args(["--output", &opts.output])
        .output()
        .context("running replay_bench under taskset (util-linux)")?;
    if !out.status.success() {
        bail!(
            "replay_bench failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let line = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if number(&line, "decode_errors")? != 0.0 || number(&line, "parse_errors")? != 0.0 {
        bail!("the generated traffic did not decode and stitch cleanly: {line}");
    }
    Ok(Run {
        events_per_s: number(&line, "events_per_s")?,
        cpu_ns_per_event: number(&line, "cpu_ns_per_event")?,
        line,
    })
}

pub fn run(args: &[String]) -> Result<()> {
    let opts = parse(args)?;
    util::cargo(&[
        "build",
        "--release",
        "-p",
        "tokentrace",
        "--example",
        "replay_bench",
    ])?;
    let bin = util::target_dir().join("release/examples/replay_bench");
    // The last CPU: on a small machine the first ones take interrupts and
    // most other work.
    let cpu = std::thread::available_parallelism().map_or(0, |n| n.get() - 1);
    let mut report = String::new();
    let mut runs = Vec::new();
    for i in 0..opts.runs {
        let run = run_once(&bin, cpu, &opts)?;
        let line = format!("replay run {i} (cpu {cpu}): {}\n", run.line);
        eprint!("{line}");
        report.push_str(&line);
        runs.push(run);
    }
    let mut rates: Vec<f64> = runs.iter().map(|r| r.events_per_s).collect();
    let mut cpu_ns: Vec<f64> = runs.iter().map(|r| r.cpu_ns_per_event).collect();
    let rate = super::median(&mut rates);
    let result = format!(
        "replay ({} events, {} connections, output {}, {} runs on one core): median {:.0} events/s, {:.0} ns of CPU per event (target >= {:.0} events/s: {})\n",
        opts.events,
        opts.connections,
        opts.output,
        opts.runs,
        rate,
        super::median(&mut cpu_ns),
        TARGET_EVENTS_PER_S,
        if rate >= TARGET_EVENTS_PER_S { "met" } else { "NOT met" }
    );
    print!("{result}");
    report.push_str(&result);
    let dir = util::root().join("target/bench");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("replay.txt"), report)?;
    Ok(())
}
