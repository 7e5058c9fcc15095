//! `--only vllm`: what the tokentrace-vllm plugin costs real vLLM.
//!
//! Two vLLM servers of the tiny model run side by side, one with the plugin
//! (on PYTHONPATH, built from instrument/vllm) and one without; each round
//! sends the same burst of concurrent streaming requests to: the plain
//! server, the plugin server untraced, and the plugin server with the agent
//! attached (every probe then a uprobe hit). Reported: tokens/s of each, the
//! ratios to the plain server with their spread over the rounds (round to
//! round noise here is ~±10 %), and the server's CPU per token.
//!
//! The plugin's own CPU per token is measured apart, where nothing else
//! runs: tests/bench/vllm_plugin_cost.py drives the real hook over the real
//! libllm_usdt.so on hand-built step records, untraced and traced.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use tokentrace_testkit::vllm::{plugin_site, tiny_model, Vllm};

use super::{cpu_ns, median, Options, TracingAgent};
use crate::util::{self, Guard};
use crate::{native, vllm as env};

/// Requests per burst and tokens per request: 8 concurrent streams keep
/// vLLM's batch full (`--max-num-seqs 8`).
const STREAMS: usize = 8;
const TOKENS: u32 = 128;
const CLIENT: &str = "tests/vllm/vllm_client.py";
const COST: &str = "tests/bench/vllm_plugin_cost.py";

/// CPU time of a process and all its descendants (vLLM's three), ns.
fn tree_cpu_ns(pid: u32) -> u64 {
    let mut total = cpu_ns(pid).unwrap_or(0);
    let children = std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|c| {
            c.split_whitespace()
                .filter_map(|p| p.parse::<u32>().ok())
                .collect::<Vec<_>>()
        })
        .collect::<Vec<_>>();
    for child in children {
        total += tree_cpu_ns(child);
    }
    total
}

/// One burst: (tokens/s, server CPU µs per token).
fn burst(server: &Vllm, round: u32, tag: &str) -> Result<(f64, f64)> {
    let pid = server.pid();
    let cpu0 = tree_cpu_ns(pid);
    let t0 = Instant::now();
    let mut cmd = Command::new("python3");
    cmd.arg(util::root().join(CLIENT))
        .arg(server.port.to_string());
    for i in 0..STREAMS {
        cmd.arg(format!("bench-{tag}-{round}-{i}:{TOKENS}"));
    }
    let out = cmd.output().context("running the vLLM client")?;
    let wall = t0.elapsed().as_secs_f64();
    let cpu = tree_cpu_ns(pid).saturating_sub(cpu0);
    if !out.status.success() {
        bail!(
            "vLLM client failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let tokens: f64 = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["usage"]["completion_tokens"].as_f64())
        .sum();
    if tokens < (STREAMS as f64) * f64::from(TOKENS) {
        bail!(
            "the burst produced {tokens} tokens, expected {}",
            STREAMS as u32 * TOKENS
        );
    }
    Ok((tokens / wall, cpu as f64 / 1e3 / tokens))
}

/// The spread of ratios: "median (min–max)".
fn spread(mut ratios: Vec<f64>) -> String {
    let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{:.3} ({lo:.3}–{hi:.3})", median(&mut ratios))
}

pub fn run(agent_bin: &Path, opts: &Options, report: &mut String) -> Result<()> {
    let venv = env::ensure_env()?;
    let scratch = util::target_dir().join("bench/vllm");
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch)?;
    let python = venv.join("bin/python");
    let model = tiny_model(&venv, &scratch)?;
    // the plugin ships the libllm_usdt.so of a fresh native build; it is
    // installed with --target: on PYTHONPATH it is vLLM's plugin, and the
    // venv itself stays plugin-free for the plain server
    native::build()?;
    let site = plugin_site(&venv, &scratch)?;

    let batch = ["--max-model-len", "512", "--max-num-seqs", "8"];
    let plain = Vllm::start(&venv, &model, &scratch, None, &batch)?;
    let plugged = Vllm::start(&venv, &model, &scratch, Some(&site), &batch)?;
    // Warm-up: first requests compile and cache.
    burst(&plain, 0, "warm")?;
    burst(&plugged, 0, "warm")?;
    let rounds = opts.rounds.max(5);
    let (mut base, mut untraced, mut traced) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        let b = burst(&plain, round, "plain")?;
        let u = burst(&plugged, round, "plugin")?;
        let agent = TracingAgent::start(agent_bin, plugged.pid())?;
        let t = burst(&plugged, round, "traced");
        agent.stop()?;
        let t = t?;
        let line = format!(
            "vllm round {round}: plain {:.0} tok/s ({:.0} µs CPU/token), plugin {:.0} ({:.0}), plugin+agent {:.0} ({:.0})\n",
            b.0, b.1, u.0, u.1, t.0, t.1
        );
        eprint!("{line}");
        report.push_str(&line);
        base.push(b);
        untraced.push(u);
        traced.push(t);
    }
    let ratio =
        |of: &[(f64, f64)]| -> Vec<f64> { of.iter().zip(&base).map(|(x, b)| x.0 / b.0).collect() };
    let mut server_cpu: Vec<f64> = base.iter().map(|b| b.1).collect();
    let server_us = median(&mut server_cpu);
    let (hook_untraced, hook_traced) = plugin_cost(agent_bin, &python, &site)?;
    let result = format!(
        "vLLM (tiny model, CPU, {STREAMS} streams x {TOKENS} tokens, {rounds} alternating rounds): \
         tokens/s ratio to no plugin: plugin {}, plugin + agent attached {}; \
         server CPU {server_us:.0} µs/token; plugin hook CPU {hook_untraced:.3} µs/token untraced \
         ({:.3} % of the server's), {hook_traced:.2} µs/token traced ({:.2} %)\n",
        spread(ratio(&untraced)),
        spread(ratio(&traced)),
        hook_untraced / server_us * 100.0,
        hook_traced / server_us * 100.0,
    );
    print!("{result}");
    report.push_str(&result);
    Ok(())
}

/// µs of CPU per token of the hook alone: (untraced, traced), each the
/// median of 5 one-second runs minus the same loop without the hook.
fn plugin_cost(agent_bin: &Path, python: &Path, site: &Path) -> Result<(f64, f64)> {
    let mut child = Command::new(python)
        .arg(util::root().join(COST))
        .arg(site)
        .args(["8", "1"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the plugin cost loop")?;
    let mut stdin = child.stdin.take().context("stdin")?;
    let mut lines = BufReader::new(child.stdout.take().context("stdout")?).lines();
    let guard = Guard(child);
    let ready = lines.next().context("cost loop ended")??;
    if !ready.starts_with("READY") {
        bail!("cost loop: {ready}");
    }
    let mut measure = |command: &str| -> Result<f64> {
        let mut runs = Vec::new();
        for _ in 0..5 {
            writeln!(stdin, "{command}")?;
            let line = lines.next().context("cost loop ended")??;
            let v: serde_json::Value = serde_json::from_str(&line)?;
            runs.push(v["us_per_token"].as_f64().context("us_per_token")?);
        }
        Ok(median(&mut runs))
    };
    let base = measure("base")?;
    let untraced = measure("run")? - base;
    let agent = TracingAgent::start(agent_bin, guard.0.id())?;
    let traced = measure("run")? - base;
    agent.stop()?;
    Ok((untraced, traced))
}
