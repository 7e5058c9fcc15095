//! `cargo xtask bench`: what the agent costs a streaming server.
//!
//! One run alternates rounds without and with the agent attached to a
//! server that writes SSE events as fast as it can (one send() each, far
//! above 20k writes/s), and reports the ratio of events/s, the agent's CPU
//! and peak RSS, and events it lost. Results go to target/bench/.

use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::deps::{self, Scope};
use crate::util::{self, free_port, start_server, Guard};

const FLOOD: &str = "tests/bench/sse_flood.py";

struct Options {
    rounds: u32,
    seconds: f64,
    connections: u32,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut opts = Options {
        rounds: 4,
        seconds: 3.0,
        connections: 2,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--rounds" => opts.rounds = value.parse()?,
            "--seconds" => opts.seconds = value.parse()?,
            "--connections" => opts.connections = value.parse()?,
            _ => bail!("usage: cargo xtask bench [--rounds N] [--seconds S] [--connections C]"),
        }
    }
    Ok(opts)
}

fn client(port: u16, opts: &Options) -> Result<f64> {
    let out = Command::new("python3")
        .arg(util::root().join(FLOOD))
        .args([
            "client",
            "--port",
            &port.to_string(),
            "--seconds",
            &opts.seconds.to_string(),
            "--connections",
            &opts.connections.to_string(),
        ])
        .output()
        .context("running the flood client")?;
    if !out.status.success() {
        bail!(
            "flood client failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let rate = text
        .split("\"events_per_s\":")
        .nth(1)
        .and_then(|rest| rest.trim().trim_end_matches('}').trim().parse::<f64>().ok())
        .with_context(|| format!("unexpected client output: {text}"))?;
    Ok(rate)
}

/// utime + stime of `pid`, in clock ticks.
fn cpu_ticks(pid: u32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after_comm = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .context("malformed stat")?;
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    // Fields after the comm start at field 3 (state); utime is 14, stime 15.
    let utime: u64 = fields.get(11).context("utime")?.parse()?;
    let stime: u64 = fields.get(12).context("stime")?.parse()?;
    Ok(utime + stime)
}

fn peak_rss_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("VmHWM missing")
}

struct Traced {
    rate: f64,
    cpu_percent: f64,
    rss_kib: u64,
    summary: String,
}

fn traced_round(
    agent_bin: &std::path::Path,
    server_pid: u32,
    port: u16,
    opts: &Options,
) -> Result<Traced> {
    let mut child = Command::new(agent_bin)
        .args(["run", "--pid", &server_pid.to_string(), "--output", "json"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting the agent")?;
    let stderr = child.stderr.take().context("agent stderr")?;
    let agent_pid = child.id();
    let mut agent = Guard(child);
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        use std::io::{BufRead, BufReader};
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    loop {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .context("agent never became ready")?;
        if line.contains("tokentrace: ready") {
            break;
        }
    }
    let ticks_before = cpu_ticks(agent_pid)?;
    let rate = client(port, opts)?;
    let ticks = cpu_ticks(agent_pid)? - ticks_before;
    // Let the agent drain what the last requests produced before stopping it.
    std::thread::sleep(Duration::from_millis(300));
    let rss_kib = peak_rss_kib(agent_pid)?;
    util::status("kill", &["-INT", &agent_pid.to_string()])?;
    agent.0.wait()?;
    let summary: Vec<String> = rx
        .try_iter()
        .filter(|l| l.contains("events:") || l.contains("requests:"))
        .collect();
    let clk_tck = 100.0; // USER_HZ on Linux
    Ok(Traced {
        rate,
        cpu_percent: ticks as f64 / clk_tck / opts.seconds * 100.0,
        rss_kib,
        summary: summary.join(" | "),
    })
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

pub fn run(args: &[String]) -> Result<()> {
    let opts = parse(args)?;
    deps::install(Scope::Build)?;
    if !util::is_root() {
        bail!("the benchmark loads eBPF programs: run it as root");
    }
    util::ensure_tracefs()?;
    util::cargo(&["build", "--release", "-p", "tokentrace"])?;
    let agent_bin = util::root().join("target/release/tokentrace");
    let port = free_port()?;
    let server = start_server(FLOOD, &["server", "--port", &port.to_string()])?;
    let server_pid = server.0.id();

    // Warm-up: first connections and Python's caches.
    client(
        port,
        &Options {
            seconds: 1.0,
            ..opts
        },
    )?;
    let (mut base, mut traced) = (Vec::new(), Vec::new());
    let mut report = String::new();
    for round in 0..opts.rounds {
        let b = client(port, &opts)?;
        let t = traced_round(&agent_bin, server_pid, port, &opts)?;
        let line = format!(
            "round {round}: without agent {:.0} events/s, with agent {:.0} events/s (ratio {:.3}); agent CPU {:.1}%, peak RSS {} KiB; {}\n",
            b,
            t.rate,
            t.rate / b,
            t.cpu_percent,
            t.rss_kib,
            t.summary
        );
        eprint!("{line}");
        report.push_str(&line);
        base.push(b);
        traced.push(t);
    }
    let mut rates: Vec<f64> = traced.iter().map(|t| t.rate).collect();
    let mut cpu: Vec<f64> = traced.iter().map(|t| t.cpu_percent).collect();
    let rss = traced.iter().map(|t| t.rss_kib).max().unwrap_or(0);
    let base_median = median(&mut base);
    let traced_median = median(&mut rates);
    let result = format!(
        "SSE flood ({} connection(s), {} s rounds, {} rounds): median {:.0} events/s without agent, {:.0} with: ratio {:.3} ({:.1}% slower); agent CPU median {:.1}% of one core; agent peak RSS {} KiB\n",
        opts.connections,
        opts.seconds,
        opts.rounds,
        base_median,
        traced_median,
        traced_median / base_median,
        (1.0 - traced_median / base_median) * 100.0,
        median(&mut cpu),
        rss
    );
    print!("{result}");
    report.push_str(&result);
    let dir = util::root().join("target/bench");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("overhead.txt"), report)?;
    Ok(())
}
