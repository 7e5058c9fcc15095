//! Issue 25's own flood, in the kernel section: a node `http` SSE server
//! that writes each chunk with one writev (chunk size, CRLF, event, CRLF),
//! 8 keep-alive connections, requests of 200 tokens
//! (`tests/bench/node_sse_flood.js`).
//!
//! A fixed amount of work per round, not a timed one: the timed
//! `sse_flood.py` flood saturates both cores, so with the agent on them
//! the client slows, the server's sends coalesce in fuller segments and
//! its CPU per chunk moves by ±20 % between rounds. Here every round
//! streams the same requests and the CPU they took is compared, as the
//! issue measured it. The server (~5 µs per chunk) is heavier than
//! `sse_flood.py`'s (~2.4 µs), as real servers are.
//!
//! Each round also runs the flood under bpftrace one-liners on the
//! agent's send tracepoint (`bpftrace.rs`), where bpftrace is installed:
//! the server's added cost with the least a user could trace it with.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};

use super::{prog_stats, stats_delta, BpfStats, FloodRound};
use crate::bench::bpftrace::{self, OneLiner, ONE_LINERS};
use crate::bench::{cpu_ticks, json_number, median, peak_rss_kib, Options, TracingAgent};
use crate::util::{self, free_port, start_server};

const NODE_FLOOD: &str = "tests/bench/node_sse_flood.js";
const CONNECTIONS: u32 = 8;
const TOKENS: u32 = 200;

/// One client run of `requests` requests: the chunks the server wrote.
fn client(port: u16, requests: u32) -> Result<(f64, f64)> {
    let out = Command::new("node")
        .arg(util::root().join(NODE_FLOOD))
        .arg("client")
        .args(["--port", &port.to_string()])
        .args(["--connections", &CONNECTIONS.to_string()])
        .args(["--requests", &requests.to_string()])
        .args(["--tokens", &TOKENS.to_string()])
        .output()
        .context("running the node flood client")?;
    if !out.status.success() {
        bail!(
            "node flood client failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let number = |key| {
        json_number(&text, key).with_context(|| format!("node flood client printed {text:?}"))
    };
    Ok((number("chunks")?, number("seconds")?))
}

/// CPU ticks of the server and of the agent (if any) over one client run.
fn round(port: u16, requests: u32, server_pid: u32, agent: Option<u32>) -> Result<FloodRound> {
    let server0 = cpu_ticks(server_pid)?;
    let agent0 = agent.map(cpu_ticks).transpose()?.unwrap_or(0);
    let (chunks, _) = client(port, requests)?;
    // The agent reads the last records after the client has them.
    if agent.is_some() {
        std::thread::sleep(std::time::Duration::from_millis(300));
    }
    Ok(FloodRound {
        chunks,
        server_ticks: cpu_ticks(server_pid)? - server0,
        agent_ticks: agent.map(cpu_ticks).transpose()?.unwrap_or(0) - agent0,
    })
}

/// Appends the node flood's lines to `out`.
pub(super) fn run(agent_bin: &Path, opts: &Options, out: &mut String) -> Result<()> {
    if Command::new("node").arg("--version").output().is_err() {
        out.push_str(
            "node flood: skipped: no `node` on PATH (apt install nodejs, or cargo xtask deps)\n",
        );
        return Ok(());
    }
    let port = free_port()?;
    let server = start_server(NODE_FLOOD, &["server", "--port", &port.to_string()])?;
    let server_pid = server.0.id();
    // Warm-up (node's JIT), and the request count that fills a round.
    let (chunks, seconds) = client(port, 400)?;
    let requests = ((chunks / seconds * opts.seconds) / f64::from(TOKENS + 2)).max(100.0) as u32;

    let (mut ratio, mut base, mut traced, mut agent_us) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut peak_rss = 0;
    let with_bpftrace = bpftrace::available();
    // Per one-liner: (server traced, bpftrace, ratio) µs per chunk, by round.
    let mut one_liners: Vec<Vec<(f64, f64, f64)>> = vec![Vec::new(); ONE_LINERS.len()];
    for n in 0..opts.rounds {
        let b = round(port, requests, server_pid, None)?;
        let agent = TracingAgent::start(agent_bin, server_pid)?;
        let t = round(port, requests, server_pid, Some(agent.pid))?;
        peak_rss = peak_rss.max(peak_rss_kib(agent.pid)?);
        agent.stop()?;
        let (sb, st, ag) = b.per_chunk(&t);
        let line = format!(
            "node flood round {n}: server {sb:.2} µs/chunk untraced, {st:.2} traced; agent {ag:.2} µs/chunk; CPU per chunk ratio {:.3}\n",
            (st + ag) / sb
        );
        eprint!("{line}");
        out.push_str(&line);
        ratio.push((st + ag) / sb);
        base.push(sb);
        traced.push(st);
        agent_us.push(ag);
        if !with_bpftrace {
            continue;
        }
        for ((name, program), rounds) in ONE_LINERS.iter().zip(&mut one_liners) {
            let one_liner = OneLiner::attach(program, server_pid)?;
            let t = round(port, requests, server_pid, Some(one_liner.pid))?;
            drop(one_liner);
            let (_, st, bt) = b.per_chunk(&t);
            let line = format!(
                "node flood round {n}, bpftrace {name}: server {st:.2} µs/chunk traced; bpftrace {bt:.2} µs/chunk; CPU per chunk ratio {:.3}\n",
                (st + bt) / sb
            );
            eprint!("{line}");
            out.push_str(&line);
            rounds.push((st, bt, (st + bt) / sb));
        }
    }
    let bpf_us = {
        let _stats = BpfStats::enable()?;
        let agent = TracingAgent::start(agent_bin, server_pid)?;
        let before = prog_stats(agent.pid)?;
        let t = round(port, requests, server_pid, Some(agent.pid))?;
        let after = prog_stats(agent.pid)?;
        agent.stop()?;
        let ns: f64 = stats_delta(&before, &after)
            .iter()
            .map(|(_, ns, runs)| ns * *runs as f64)
            .sum();
        ns / 1e3 / t.chunks.max(1.0)
    };
    let (sb, st) = (median(&mut base), median(&mut traced));
    let agent_added = st - sb;
    out.push_str(&format!(
        "node flood (issue 25's workload: node http, one writev per chunk, {CONNECTIONS} keep-alive connections, {requests} requests x {TOKENS} tokens per round, {} rounds): flood CPU per chunk ratio {:.3} (median; (server + agent) traced / server untraced; goal <= 1.05); agent {:.2} µs per chunk; server {sb:.2} µs per chunk untraced, {st:.2} traced: {agent_added:+.2} µs per chunk added; BPF time {bpf_us:.2} µs per chunk (bpf_stats round); agent peak RSS {peak_rss} KiB (VmHWM, attach included)\n",
        opts.rounds,
        median(&mut ratio),
        median(&mut agent_us),
    ));
    if !with_bpftrace {
        out.push_str("node flood, bpftrace one-liners: skipped: no `bpftrace` on PATH (apt install bpftrace)\n");
    }
    for ((name, program), rounds) in ONE_LINERS.iter().zip(&one_liners) {
        if rounds.is_empty() {
            continue;
        }
        let column = |pick: fn(&(f64, f64, f64)) -> f64| {
            median(&mut rounds.iter().map(pick).collect::<Vec<_>>())
        };
        let (bst, bt, r) = (column(|x| x.0), column(|x| x.1), column(|x| x.2));
        out.push_str(&format!(
            "node flood, bpftrace {name} one-liner (`{program}`, PID the server): CPU per chunk ratio {r:.3} (median; (server + bpftrace) / server untraced); bpftrace {bt:.2} µs per chunk; server {bst:.2} µs per chunk traced: {:+.2} µs per chunk added (the agent: {agent_added:+.2})\n",
            bst - sb,
        ));
    }
    drop(server);
    Ok(())
}
