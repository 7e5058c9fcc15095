//! The gRPC section of `cargo xtask bench` (`--only grpc`): what tracing
//! costs an HTTP/2 server-streaming flood.
//!
//! tests/servers/grpc_stream.py (grpcio, h2c) streams 64-byte messages with
//! no gap to tests/clients/grpc_client.py: `--connections` concurrent calls
//! (streams) on ONE channel, i.e. one HTTP/2 connection, a fixed number of
//! messages per round (sized from a warm-up run to last `--seconds`).
//! Rounds alternate without the agent and with it tracing the server
//! (`--pid`, JSON output); the figure is the ratio of messages/s and the µs
//! each message costs (1/rate with − 1/rate without). Per message grpcio
//! makes one sendmsg of 2 iovecs (frame header + gRPC prefix, body), or
//! fewer calls when it coalesces: each is a ring buffer record parsed as
//! HTTP/2 frames and gRPC messages by the agent. The agent's own summary
//! must count every message the client received (its `chunks`), else the
//! round fails: a fast agent that misses messages proves nothing.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use super::{
    cpu_ns, cpu_percent, json_number, median, peak_rss_kib, summary, Options, TracingAgent,
};
use crate::util::{self, free_port, start_server};

const SERVER: &str = "tests/servers/grpc_stream.py";
const CLIENT: &str = "tests/clients/grpc_client.py";
const MESSAGE_BYTES: u32 = 64;

/// One flood run: (messages received, messages/s).
fn flood(port: u16, streams: u32, per_call: u64) -> Result<(f64, f64)> {
    let out = Command::new("python3")
        .arg(util::root().join(CLIENT))
        .args(["--port", &port.to_string()])
        .args(["--calls", &streams.to_string()])
        .args(["--concurrency", &streams.to_string()])
        .args(["--messages", &per_call.to_string()])
        .args(["--gap-ms", "0", "--ttft-ms", "0"])
        .args(["--size", &MESSAGE_BYTES.to_string()])
        .args(["--timeout", "300", "--summary"])
        .output()
        .context("running the gRPC flood client")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "gRPC flood client failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let field =
        |k: &str| json_number(&text, k).with_context(|| format!("gRPC client: no {k} in {text}"));
    if field("errors")? > 0.0 {
        bail!("gRPC flood: calls failed: {text}");
    }
    Ok((field("messages")?, field("messages_per_s")?))
}

struct Traced {
    rate: f64,
    cpu_percent: f64,
    rss_kib: u64,
    agent_chunks: f64,
    summary: String,
}

/// A flood with the agent tracing `server_pid`, started and ready first.
fn traced(
    agent_bin: &Path,
    server_pid: u32,
    port: u16,
    streams: u32,
    per_call: u64,
) -> Result<Traced> {
    let agent = TracingAgent::start(agent_bin, server_pid)?;
    let agent_pid = agent.pid;
    let cpu_before = cpu_ns(agent_pid)?;
    let t0 = std::time::Instant::now();
    let (messages, rate) = flood(port, streams, per_call)?;
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu_ns(agent_pid)? - cpu_before;
    std::thread::sleep(Duration::from_millis(300));
    let rss_kib = peak_rss_kib(agent_pid)?;
    let lines = agent.stop()?;
    let json = lines
        .iter()
        .find(|l| l.contains("\"tokentrace_summary\""))
        .with_context(|| format!("no JSON summary from the agent: {lines:?}"))?;
    // the summary's top-level "chunks" (the first key of that name)
    let agent_chunks = json_number(json, "chunks").context("no chunks in the agent summary")?;
    if agent_chunks < messages {
        bail!("the agent counted {agent_chunks} gRPC messages, the client received {messages}: {json}");
    }
    let summary = summary(&lines, &["events:", "http/2:"]);
    Ok(Traced {
        rate,
        cpu_percent: cpu_percent(cpu, secs),
        rss_kib,
        agent_chunks,
        summary,
    })
}

pub fn run(agent_bin: &Path, opts: &Options, report: &mut String) -> Result<()> {
    if !util::succeeds("python3", &["-c", "import grpc"]) {
        bail!("the gRPC section needs grpcio: pip install 'grpcio==1.85.1' (`cargo xtask deps` installs it)");
    }
    let streams = opts.connections.max(1);
    let port = free_port()?;
    let server = start_server(SERVER, &["--port", &port.to_string()])?;
    let server_pid = server.0.id();
    // warm-up, and the size of a round: messages per call for ~--seconds
    let (_, warm_rate) = flood(port, streams, 2000)?;
    let per_call = ((warm_rate * opts.seconds) / f64::from(streams)).max(1000.0) as u64;
    let (mut base, mut with, mut cpu) = (Vec::new(), Vec::new(), Vec::new());
    let mut rss = 0;
    for round in 0..opts.rounds {
        let (_, b) = flood(port, streams, per_call)?;
        let t = traced(agent_bin, server_pid, port, streams, per_call)?;
        let line = format!(
            "grpc round {round}: without agent {b:.0} messages/s, with agent {:.0} messages/s (ratio {:.3}, {:+.2} µs/message); agent counted {:.0} messages; agent CPU {:.1}%, peak RSS {} KiB; {}\n",
            t.rate,
            t.rate / b,
            1e6 / t.rate - 1e6 / b,
            t.agent_chunks,
            t.cpu_percent,
            t.rss_kib,
            t.summary
        );
        eprint!("{line}");
        report.push_str(&line);
        rss = rss.max(t.rss_kib);
        base.push(b);
        with.push(t.rate);
        cpu.push(t.cpu_percent);
    }
    drop(server);
    let (b, t) = (median(&mut base), median(&mut with));
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let result = format!(
        "grpc flood (grpcio server streaming, h2c, {streams} concurrent streams on one connection, {MESSAGE_BYTES}-byte messages, {per_call} per stream per round, {} rounds): median {b:.0} messages/s without agent, {t:.0} with: ratio {:.3} ({:.1}% slower), {:+.2} µs per message; agent CPU median {:.1}% of one core; agent peak RSS {rss} KiB; load average at the end {}\n",
        opts.rounds,
        t / b,
        (1.0 - t / b) * 100.0,
        1e6 / t - 1e6 / b,
        median(&mut cpu),
        load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    );
    print!("{result}");
    report.push_str(&result);
    Ok(())
}
