//! What `tokentrace top` itself costs: `top --remote` (its own process,
//! in a tmux terminal, redrawing every second) against an agent tracing
//! the SSE flood server under a flood of short requests (4 events each,
//! a few thousand requests/s on this VM), its CPU beside the agent's over
//! the same seconds (schedstat, ns). The local view draws in the agent's
//! process; the remote one also pays the control endpoint's snapshot, so
//! it is the upper bound of both.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use super::{cpu_ns, json_number, median, Options, TracingAgent, FLOOD};
use crate::util::{self, free_port, start_server};

const SESSION: &str = "tt-bench-top";
const EVENTS_PER_REQUEST: u32 = 4;

/// The detached tmux session `top` runs in; killed on drop.
struct Terminal;

impl Drop for Terminal {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["kill-session", "-t", SESSION])
            .output();
    }
}

fn pid_of(pattern: &str) -> Result<u32> {
    let out = Command::new("pgrep")
        .args(["-f", "-n", pattern])
        .output()
        .context("pgrep")?;
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .with_context(|| format!("no process matching {pattern:?}"))
}

/// One flood client run: (requests/s, seconds).
fn flood(port: u16, opts: &Options) -> Result<(f64, f64)> {
    let out = Command::new("python3")
        .arg(util::root().join(FLOOD))
        .arg("client")
        .args(["--port", &port.to_string()])
        .args(["--seconds", &opts.seconds.to_string()])
        .args(["--connections", &(opts.connections * 2).to_string()])
        .args(["--events", &EVENTS_PER_REQUEST.to_string()])
        .output()
        .context("running the flood client")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let requests = json_number(&text, "requests").context("client output")?;
    let seconds = json_number(&text, "seconds").context("client output")?;
    Ok((requests / seconds, seconds))
}

pub(super) fn run(agent_bin: &Path, opts: &Options, report: &mut String) -> Result<()> {
    let port = free_port()?;
    let server = start_server(FLOOD, &["server", "--port", &port.to_string()])?;
    let dir = std::env::temp_dir().join(format!("tt-bench-top-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let token = dir.join("control.token");
    std::fs::write(&token, "bench-top\n")?;
    let token = token.display().to_string();
    let session_dir = dir.join("sessions").display().to_string();
    let server_pid = server.0.id().to_string();
    let mut agent = TracingAgent::spawn(
        agent_bin,
        None,
        &[
            "--pid",
            &server_pid,
            "--control-addr",
            "127.0.0.1:0",
            "--control-token-file",
            &token,
            "--session-dir",
            &session_dir,
        ],
        Duration::from_secs(60),
    )?;
    let line = agent.wait_for(&["control endpoint at"], Duration::from_secs(10))?;
    let url = line
        .split_once("control endpoint at ")
        .map(|(_, u)| u.trim().to_string())
        .context("control endpoint line")?;
    let _ = Command::new("tmux")
        .args(["kill-session", "-t", SESSION])
        .output();
    let command = format!(
        "{} top --remote {url} --token-file {token} --window 30s",
        agent_bin.display()
    );
    let started = Command::new("tmux")
        .args([
            "new-session",
            "-d",
            "-s",
            SESSION,
            "-x",
            "200",
            "-y",
            "50",
            &command,
        ])
        .status()
        .context("tmux (cargo xtask deps installs it)")?;
    if !started.success() {
        bail!("tmux new-session failed: {started}");
    }
    let _terminal = Terminal;
    std::thread::sleep(Duration::from_secs(2));
    let top = pid_of(&format!("top --remote {url}"))?;
    let (mut rates, mut top_pct, mut agent_pct) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..opts.rounds {
        let (top0, agent0) = (cpu_ns(top)?, cpu_ns(agent.pid)?);
        let (rate, seconds) = flood(port, opts)?;
        let (top_ns, agent_ns) = (cpu_ns(top)? - top0, cpu_ns(agent.pid)? - agent0);
        let pct = |ns: u64| ns as f64 / 1e9 / seconds * 100.0;
        println!(
            "top round {}: {rate:.0} requests/s; top --remote {:.2}% of a core, agent {:.1}%",
            round + 1,
            pct(top_ns),
            pct(agent_ns)
        );
        rates.push(rate);
        top_pct.push(pct(top_ns));
        agent_pct.push(pct(agent_ns));
    }
    let screen = Command::new("tmux")
        .args(["capture-pane", "-p", "-t", SESSION])
        .output()
        .context("tmux capture-pane")?;
    if !String::from_utf8_lossy(&screen.stdout).contains("requests") {
        bail!(
            "top's screen shows no table:\n{}",
            String::from_utf8_lossy(&screen.stdout)
        );
    }
    drop(agent.stop()?);
    let (rate, top, agent) = (
        median(&mut rates),
        median(&mut top_pct),
        median(&mut agent_pct),
    );
    let line = format!(
        "top CPU: top --remote {top:.2}% of a core at {rate:.0} requests/s ({EVENTS_PER_REQUEST} events each), the agent {agent:.1}%: top/agent {:.3} (median of {} rounds)\n",
        top / agent.max(1e-9),
        opts.rounds
    );
    print!("{line}");
    report.push_str(&line);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
