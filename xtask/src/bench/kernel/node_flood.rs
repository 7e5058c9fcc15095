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

use super::{prog_stats, stats_delta, BpfPerChunk, BpfStats, FloodRound};
use crate::bench::bpftrace::{self, OneLiner, ONE_LINERS};
use crate::bench::{json_number, median, peak_rss_kib, Options, TracingAgent};
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

/// CPU time of the server and of the agent (if any) over one client run.
fn round(port: u16, requests: u32, server_pid: u32, agent: Option<u32>) -> Result<FloodRound> {
    FloodRound::measure(server_pid, agent, || {
        let (chunks, _) = client(port, requests)?;
        // The agent reads the last records after the client has them.
        if agent.is_some() {
            std::thread::sleep(std::time::Duration::from_millis(300));
        }
        Ok(chunks)
    })
}

/// An agent's rounds of the flood: per round, the server's µs per chunk
/// untraced and traced, the agent's, and their ratio.
#[derive(Default)]
struct AgentRounds {
    base: Vec<f64>,
    traced: Vec<f64>,
    agent_us: Vec<f64>,
    ratio: Vec<f64>,
    peak_rss: u64,
}

impl AgentRounds {
    /// Traces one round with `agent_bin` (its untraced twin was `b`);
    /// returns its line, `label` first.
    fn round(
        &mut self,
        agent_bin: &Path,
        flood: (u16, u32, u32),
        b: &FloodRound,
        label: &str,
    ) -> Result<String> {
        let (port, requests, server_pid) = flood;
        let agent = TracingAgent::start(agent_bin, server_pid)?;
        let t = round(port, requests, server_pid, Some(agent.pid))?;
        self.peak_rss = self.peak_rss.max(peak_rss_kib(agent.pid)?);
        agent.stop()?;
        let (sb, st, ag) = b.per_chunk(&t);
        self.base.push(sb);
        self.traced.push(st);
        self.agent_us.push(ag);
        self.ratio.push((st + ag) / sb);
        Ok(format!(
            "{label}: server {sb:.2} µs/chunk untraced, {st:.2} traced; agent {ag:.2} µs/chunk; CPU per chunk ratio {:.3}\n",
            (st + ag) / sb
        ))
    }

    /// Medians: (ratio, agent µs, server untraced, server traced).
    fn medians(&self) -> (f64, f64, f64, f64) {
        let m = |v: &Vec<f64>| median(&mut v.clone());
        (
            m(&self.ratio),
            m(&self.agent_us),
            m(&self.base),
            m(&self.traced),
        )
    }
}

/// BPF time per chunk over one round with `agent_bin` (bpf_stats on).
fn bpf_per_chunk(agent_bin: &Path, flood: (u16, u32, u32)) -> Result<BpfPerChunk> {
    let (port, requests, server_pid) = flood;
    let _stats = BpfStats::enable()?;
    let agent = TracingAgent::start(agent_bin, server_pid)?;
    let before = prog_stats(agent.pid)?;
    let t = round(port, requests, server_pid, Some(agent.pid))?;
    let after = prog_stats(agent.pid)?;
    agent.stop()?;
    Ok(BpfPerChunk::of(&stats_delta(&before, &after), t.chunks))
}

/// Appends the node flood's lines to `out`; the BPF time per chunk of
/// this agent's bpf_stats round (none without node).
pub(super) fn run(
    agent_bin: &Path,
    opts: &Options,
    out: &mut String,
) -> Result<Option<BpfPerChunk>> {
    if Command::new("node").arg("--version").output().is_err() {
        out.push_str(
            "node flood: skipped: no `node` on PATH (apt install nodejs, or cargo xtask deps)\n",
        );
        return Ok(None);
    }
    let port = free_port()?;
    let server = start_server(NODE_FLOOD, &["server", "--port", &port.to_string()])?;
    let server_pid = server.0.id();
    // Warm-up (node's JIT), and the request count that fills a round.
    let (chunks, seconds) = client(port, 400)?;
    let requests = ((chunks / seconds * opts.seconds) / f64::from(TOKENS + 2)).max(100.0) as u32;
    let flood = (port, requests, server_pid);

    let mut this = AgentRounds::default();
    let mut baseline = opts
        .baseline_agent
        .as_ref()
        .map(|bin| (bin, AgentRounds::default()));
    let with_bpftrace = bpftrace::ensure_installed();
    // Per one-liner: (server traced, bpftrace, ratio) µs per chunk, by round.
    let mut one_liners: Vec<Vec<(f64, f64, f64)>> = vec![Vec::new(); ONE_LINERS.len()];
    for n in 0..opts.rounds {
        let b = round(port, requests, server_pid, None)?;
        let label = format!("node flood round {n}");
        // The two agents take turns going first: drift in the host's load
        // within a round favours neither.
        let baseline_first = n % 2 == 1;
        let mut lines = Vec::new();
        if let Some((bin, rounds)) = baseline.as_mut().filter(|_| baseline_first) {
            lines.push(rounds.round(bin, flood, &b, &format!("{label}, baseline agent"))?);
        }
        lines.push(this.round(agent_bin, flood, &b, &label)?);
        if let Some((bin, rounds)) = baseline.as_mut().filter(|_| !baseline_first) {
            lines.push(rounds.round(bin, flood, &b, &format!("{label}, baseline agent"))?);
        }
        for line in lines {
            eprint!("{line}");
            out.push_str(&line);
        }
        if !with_bpftrace {
            continue;
        }
        for ((name, program), rounds) in ONE_LINERS.iter().zip(&mut one_liners) {
            let one_liner = OneLiner::attach(program, server_pid)?;
            let t = round(port, requests, server_pid, Some(one_liner.pid))?;
            drop(one_liner);
            let (sb, st, bt) = b.per_chunk(&t);
            let line = format!(
                "node flood round {n}, bpftrace {name}: server {st:.2} µs/chunk traced; bpftrace {bt:.2} µs/chunk; CPU per chunk ratio {:.3}\n",
                (st + bt) / sb
            );
            eprint!("{line}");
            out.push_str(&line);
            rounds.push((st, bt, (st + bt) / sb));
        }
    }
    let bpf = bpf_per_chunk(agent_bin, flood)?;
    let bpf_us = bpf.us;
    let (ratio, agent_us, sb, st) = this.medians();
    let agent_added = st - sb;
    out.push_str(&format!(
        "node flood (issue 25's workload: node http, one writev per chunk, {CONNECTIONS} keep-alive connections, {requests} requests x {TOKENS} tokens per round, {} rounds): flood CPU per chunk ratio {ratio:.3} (median; (server + agent) traced / server untraced; goal <= 1.05); agent {agent_us:.2} µs per chunk; server {sb:.2} µs per chunk untraced, {st:.2} traced: {agent_added:+.2} µs per chunk added; BPF time {bpf_us:.2} µs per chunk (bpf_stats round); agent peak RSS {} KiB (VmHWM, attach included)\n",
        opts.rounds, this.peak_rss,
    ));
    if let Some((bin, rounds)) = &baseline {
        out.push_str(&compare(
            bin,
            rounds,
            &this,
            bpf_per_chunk(bin, flood)?.us,
            bpf_us,
        ));
    }
    if !with_bpftrace {
        out.push_str("node flood, bpftrace one-liners: skipped: no `bpftrace` on PATH, and apt could not install it\n");
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
    Ok(Some(bpf))
}

/// The baseline agent's figures, and this agent's against them paired by
/// round (the two traced the same rounds, one after the other).
fn compare(
    bin: &Path,
    baseline: &AgentRounds,
    this: &AgentRounds,
    baseline_bpf_us: f64,
    bpf_us: f64,
) -> String {
    let (ratio, agent_us, sb, st) = baseline.medians();
    let paired = |new: &[f64], old: &[f64]| {
        let mut r: Vec<f64> = new.iter().zip(old).map(|(n, o)| n / o).collect();
        let (lo, hi) = r
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        format!("{:.3}x (median; rounds {lo:.3}-{hi:.3})", median(&mut r))
    };
    format!(
        "node flood, baseline agent ({}): flood CPU per chunk ratio {ratio:.3} (median); agent {agent_us:.2} µs per chunk; server {sb:.2} µs per chunk untraced, {st:.2} traced: {:+.2} µs per chunk added; BPF time {baseline_bpf_us:.2} µs per chunk (bpf_stats round); agent peak RSS {} KiB\n\
         node flood, this agent against the baseline, round by round: agent µs per chunk {}; server traced µs per chunk {}; BPF time per chunk {:.3}x (one round each)\n",
        bin.display(),
        st - sb,
        baseline.peak_rss,
        paired(&this.agent_us, &baseline.agent_us),
        paired(&this.traced, &baseline.traced),
        bpf_us / baseline_bpf_us,
    )
}
