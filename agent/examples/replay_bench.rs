//! The replay benchmark behind `cargo xtask bench replay`: generated
//! ring buffer records of a streaming server (`pipeline::synthetic`) pushed
//! through decode → stitch → explain → summary and output lines, with the
//! output discarded, on this one thread.
//!
//! Records are generated in blocks outside the timed part; only the
//! pipeline's work on them is timed, in wall-clock time and in this
//! thread's CPU time (events per CPU second is the figure a loaded machine
//! moves least). Prints one JSON object.
//!
//! `replay_bench [--events N] [--connections C] [--output json|text] [--seed S]`

use std::io;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use tokentrace::output::OutputFormat;
use tokentrace::pipeline::synthetic::{Records, Traffic, TrafficConfig};
use tokentrace::pipeline::Pipeline;
use tokentrace::run::RecordReplay;
use tokentrace::stitch::StitchConfig;

/// Records generated, then replayed, per block.
const BLOCK: usize = 1 << 16;
/// The run loop's defaults: `explain.stall_threshold`, `explain.history`,
/// `stitch.idle_timeout`.
const STALL_THRESHOLD_NS: u64 = 30_000_000;
const HISTORY_NS: u64 = 120_000_000_000;
const IDLE_NS: u64 = 300_000_000_000;

struct Args {
    events: u64,
    connections: u32,
    format: OutputFormat,
    seed: u64,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        events: 1_000_000,
        connections: 256,
        format: OutputFormat::Json,
        seed: 1,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let bad = |e: std::num::ParseIntError| format!("{flag} {value}: {e}");
        match flag.as_str() {
            "--events" => args.events = value.parse().map_err(bad)?,
            "--connections" => args.connections = value.parse().map_err(bad)?,
            "--seed" => args.seed = value.parse().map_err(bad)?,
            "--output" => {
                args.format = match value.as_str() {
                    "json" => OutputFormat::Json,
                    "text" => OutputFormat::Text,
                    _ => return Err(format!("--output {value}: json or text")),
                }
            }
            _ => {
                return Err(
                    "usage: replay_bench [--events N] [--connections C] [--output json|text] [--seed S]"
                        .into(),
                )
            }
        }
    }
    if args.connections == 0 {
        return Err("--connections must be at least 1".into());
    }
    Ok(args)
}

/// CPU time this thread has used.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid out-pointer; CLOCK_THREAD_CPUTIME_ID exists on
    // every Linux this agent runs on.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn run(args: &Args) -> io::Result<String> {
    let mut traffic = Traffic::new(TrafficConfig {
        connections: args.connections,
        seed: args.seed,
        ..TrafficConfig::default()
    });
    let pipeline = Pipeline::new(StitchConfig::default(), STALL_THRESHOLD_NS, HISTORY_NS);
    let mut replay = RecordReplay::new(pipeline, args.format, io::sink());
    let mut records = Records::default();
    let (mut wall, mut cpu) = (Duration::ZERO, Duration::ZERO);
    let mut pushed = 0u64;
    while pushed < args.events {
        records.clear();
        while records.len() < BLOCK {
            traffic.step(&mut records);
        }
        let (wall0, cpu0) = (Instant::now(), thread_cpu());
        for record in records.iter().take((args.events - pushed) as usize) {
            replay.push_record(record)?;
        }
        // The run loop sweeps once a second; a block is about that long.
        replay.tick(traffic.now(), IDLE_NS)?;
        wall += wall0.elapsed();
        cpu += thread_cpu() - cpu0;
        pushed = replay.counts().records;
    }
    let (wall0, cpu0) = (Instant::now(), thread_cpu());
    let (summary, counts, _) = replay.finish(traffic.now())?;
    wall += wall0.elapsed();
    cpu += thread_cpu() - cpu0;
    let events = counts.records as f64;
    Ok(format!(
        "{{\"events\":{},\"decode_errors\":{},\"parse_errors\":{},\"requests\":{},\"stalls\":{},\"output_bytes\":{},\"simulated_s\":{:.1},\"seconds\":{:.3},\"cpu_seconds\":{:.3},\"events_per_s\":{:.0},\"events_per_cpu_s\":{:.0},\"cpu_ns_per_event\":{:.1}}}",
        counts.records,
        counts.decode_errors,
        summary.stitch.parse_errors,
        counts.requests,
        counts.stalls,
        counts.output_bytes,
        traffic.elapsed_ns() as f64 / 1e9,
        wall.as_secs_f64(),
        cpu.as_secs_f64(),
        events / wall.as_secs_f64(),
        events / cpu.as_secs_f64(),
        cpu.as_nanos() as f64 / events,
    ))
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(args) => args,
        Err(err) => {
            eprintln!("replay_bench: {err}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("replay_bench: {err}");
            ExitCode::FAILURE
        }
    }
}
