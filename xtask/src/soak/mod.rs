//! `cargo xtask soak --minutes N` (root; not in CI): the agent under a
//! steady streaming load for N minutes, with faults, then a report.
//!
//! Phases, each judged pass/fail in the report (report.rs):
//! 1. **steady load** — tests/servers/fastapi_app.py streams SSE at
//!    `--rate` requests/min (2000), traced by `tokentrace run --port P`
//!    exporting OTLP/gRPC to a real collector (rotel), which is taken down
//!    `--down-seconds` (60) of every `--cycle-seconds` (300). Agent RSS is
//!    sampled every second: the least-squares slope in MiB/hour while the
//!    load is steady and the collector up, pooled over the windows after
//!    the first outage (bounded buffers raise RSS in steps at outages, at
//!    each new high-water mark of the backlog; a per-request leak shows
//!    inside the windows; see report.rs). Spans of requests reported while the collector is
//!    up (after the outage's backlog drained) must all reach it; what the
//!    agent drops is counted by its own counters. Each outage is judged
//!    on its own (outage.rs): its backlog reached the collector within 2 s
//!    of its return, and nothing was dropped while the queue had room.
//!    `--protocol grpc|http` picks the OTLP transport (default grpc).
//! 2. **server restart under `--port`** — SIGTERM, a new process (new pid)
//!    on the same port: how long until the agent traces it, and which
//!    requests it missed.
//! 3. **agent SIGKILL mid-stream** — nothing the agent held (programs,
//!    links, uprobes) may stay in the kernel; restarted (now with `--exe`),
//!    the gap in coverage in ms.
//! 4. **server restart under `--exe`** — as 2, with the exec selector.
//!
//! The machine is shared: the report carries the load average and how often
//! the root-tests lock was held while the soak ran. Results: stdout and
//! target/soak/report-PROTOCOL.json (`--out`).

mod agent;
mod collector;
mod leftover;
mod load;
mod measure;
mod outage;
mod report;
mod sampler;
mod server;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::deps::{self, Scope};
use crate::util::{self, free_port};
use agent::{Agent, Finished, Otlp, Protocol};
use collector::{Collector, Seen};
use sampler::{Sample, Sampler, Target};
use server::Server;

const USAGE: &str = "usage: cargo xtask soak [--minutes N] [--rate REQ_PER_MIN] [--cycle-seconds S] \
                     [--down-seconds S] [--tokens N] [--max-slope MIB_PER_H] [--protocol grpc|http] \
                     [--release | --agent PATH] [--out FILE]";

#[derive(Clone, Debug)]
pub struct Options {
    pub minutes: f64,
    pub rate: u32,
    pub cycle_s: f64,
    pub down_s: f64,
    pub tokens: u32,
    pub max_slope: f64,
    pub protocol: Protocol,
    pub release: bool,
    pub agent: Option<PathBuf>,
    pub out: Option<PathBuf>,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut o = Options {
        minutes: 30.0,
        rate: 2000,
        cycle_s: 300.0,
        down_s: 60.0,
        tokens: 32,
        max_slope: 2.0,
        protocol: Protocol::Grpc,
        release: false,
        agent: None,
        out: None,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        if flag == "--release" {
            o.release = true;
            continue;
        }
        let value = it
            .next()
            .with_context(|| format!("{flag} needs a value; {USAGE}"))?;
        let num = || -> Result<f64> {
            let v: f64 = value
                .parse()
                .with_context(|| format!("{flag} {value:?}: not a number"))?;
            if !v.is_finite() || v <= 0.0 {
                bail!("{flag} must be above 0, got {value}");
            }
            Ok(v)
        };
        match flag.as_str() {
            "--minutes" => o.minutes = num()?,
            "--rate" => o.rate = num()? as u32,
            "--cycle-seconds" => o.cycle_s = num()?,
            "--down-seconds" => o.down_s = num()?,
            "--tokens" => o.tokens = num()? as u32,
            "--max-slope" => o.max_slope = num()?,
            "--protocol" => {
                o.protocol = Protocol::parse(value)
                    .with_context(|| format!("--protocol {value:?}: grpc or http; {USAGE}"))?
            }
            "--agent" => o.agent = Some(PathBuf::from(value)),
            "--out" => o.out = Some(PathBuf::from(value)),
            _ => bail!("unknown flag {flag:?}; {USAGE}"),
        }
    }
    if o.down_s >= o.cycle_s {
        bail!(
            "--down-seconds ({}) must be shorter than --cycle-seconds ({})",
            o.down_s,
            o.cycle_s
        );
    }
    if o.rate == 0 || o.tokens == 0 {
        bail!("--rate and --tokens must be at least 1");
    }
    Ok(o)
}

/// The times and facts the report is computed from.
pub struct Run {
    pub opts: Options,
    pub agent_bin: PathBuf,
    pub salt: u64,
    pub load_start: f64,
    pub main_end: f64,
    /// (up, down) of each collector life that agent A exported to.
    pub ups: Vec<(f64, f64)>,
    pub outages: Vec<(f64, f64)>,
    pub restart_port: Restart,
    pub kill: Kill,
    pub restart_exe: Restart,
    pub sent: Vec<load::Sent>,
    pub samples: Vec<Sample>,
    pub a: Finished,
    pub b: Finished,
    pub b_ready_at: f64,
    pub seen: Arc<Seen>,
    pub end: f64,
}

pub struct Restart {
    pub old_pid: u32,
    pub stop_at: f64,
    pub new: (u32, f64, f64),
    /// When the agent logged `tracing pid NEW`.
    pub traced_at: Option<f64>,
    pub phase_end: f64,
}

pub struct Kill {
    pub held: leftover::Held,
    pub at: f64,
    pub left: leftover::Left,
    /// Spans the collector had received when agent A was dead.
    pub collector_spans: u64,
    /// Agent A's Prometheus text just before the kill.
    pub a_last: String,
}

fn sleep_until(t0: Instant, at: f64) {
    let now = t0.elapsed().as_secs_f64();
    if at > now {
        std::thread::sleep(Duration::from_secs_f64(at - now));
    }
}

fn now(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64()
}

pub fn run(args: &[String]) -> Result<()> {
    let opts = parse(args)?;
    if !util::is_root() {
        bail!("the soak loads eBPF programs: run it as root");
    }
    deps::install(Scope::All)?;
    util::ensure_tracefs()?;
    let agent_bin = match &opts.agent {
        Some(p) => p.clone(),
        None if opts.release => {
            util::cargo(&["build", "--release", "-p", "tokentrace"])?;
            util::target_dir().join("release/tokentrace")
        }
        None => {
            util::cargo(&["build", "-p", "tokentrace"])?;
            util::target_dir().join("debug/tokentrace")
        }
    };
    let python = server::real_python()?;
    let rotel = tokentrace_testkit::rotel::binary(&python)?;
    let run = soak(&opts, &agent_bin, &python, &rotel)?;
    let (json, text, pass) = report::build(&run);
    let dir = util::target_dir().join("soak");
    std::fs::create_dir_all(&dir)?;
    for (tag, done) in [("A", &run.a), ("B", &run.b)] {
        let protocol = opts.protocol.name();
        let path = dir.join(format!("agent-{tag}-{protocol}-other-lines.jsonl"));
        std::fs::write(&path, done.other_lines.join("\n") + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        let log: String = done
            .log
            .iter()
            .map(|(t, l)| format!("[{t:9.3} s] {l}\n"))
            .collect();
        let path = dir.join(format!("agent-{tag}-{protocol}.log"));
        std::fs::write(&path, log).with_context(|| format!("writing {}", path.display()))?;
    }
    print!("{text}");
    let out = opts.out.clone().unwrap_or_else(|| {
        util::target_dir().join(format!("soak/report-{}.json", opts.protocol.name()))
    });
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&out, serde_json::to_string_pretty(&json)? + "\n")
        .with_context(|| format!("writing {}", out.display()))?;
    println!("report: {}", out.display());
    if !pass {
        bail!("the soak failed (see the phases marked FAIL above)");
    }
    Ok(())
}

fn soak(
    opts: &Options,
    agent_bin: &std::path::Path,
    python: &std::path::Path,
    rotel: &std::path::Path,
) -> Result<Run> {
    let t0 = Instant::now();
    let salt = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    let (port, grpc, http) = (free_port()?, free_port()?, free_port()?);
    let (metrics_a, metrics_b) = (free_port()?, free_port()?);
    let seen = Arc::new(Seen::new(t0));
    let otlp = Otlp {
        protocol: opts.protocol,
        port: match opts.protocol {
            Protocol::Grpc => grpc,
            Protocol::Http => http,
        },
    };
    let mut server = Server::start(python, port, t0)?;
    let mut collector = Some(Collector::start(rotel, grpc, http, &seen)?);
    let mut up_since = now(t0);
    let a = Agent::start(
        agent_bin,
        &["--port".into(), port.to_string()],
        otlp,
        metrics_a,
        t0,
    )?;
    eprintln!(
        "soak: server pid {} on :{port}, agent pid {} (--port), collector on :{} ({}); {} min at {}/min",
        server.pid, a.pid, otlp.port, opts.protocol.name(), opts.minutes, opts.rate
    );
    let sampler = Sampler::start(t0);
    sampler.set(Some(Target {
        tag: "A",
        pid: a.pid,
        metrics_port: metrics_a,
    }));
    let load = load::Load::start(
        load::Spec {
            port,
            per_minute: opts.rate,
            tokens: opts.tokens,
            token_delay_ms: 20,
            ttft_ms: 50,
            salt,
        },
        t0,
    );
    let load_start = now(t0);
    let main_end = load_start + opts.minutes * 60.0;

    // 1. steady load, collector down `down_s` of every `cycle_s`
    let (mut ups, mut outages) = (Vec::new(), Vec::new());
    let mut cycle_start = load_start;
    while cycle_start < main_end {
        let down_at = cycle_start + opts.cycle_s - opts.down_s;
        if down_at >= main_end {
            break;
        }
        sleep_until(t0, down_at);
        if let Some(c) = collector.take() {
            c.stop()?;
        }
        let down = now(t0);
        ups.push((up_since, down));
        eprintln!("soak: [{:>6.0} s] collector down", down - load_start);
        sleep_until(t0, (cycle_start + opts.cycle_s).min(main_end));
        collector = Some(Collector::start(rotel, grpc, http, &seen)?);
        up_since = now(t0);
        outages.push((down, up_since));
        eprintln!("soak: [{:>6.0} s] collector up", up_since - load_start);
        cycle_start += opts.cycle_s;
    }
    sleep_until(t0, main_end);

    // 2. the server restarted under --port
    let (restart_port, s) = restart(server, python, port, t0, &a)?;
    server = s;

    // 3. agent A SIGKILLed mid-stream, B started with --exe
    let held = leftover::held_by(a.pid)?;
    let a_last = agent::scrape(metrics_a).unwrap_or_default();
    let a_pid = a.pid;
    sampler.set(None);
    let killed = Instant::now();
    let (kill_at, a_done) = a.kill9()?;
    ups.push((up_since, kill_at));
    let left = leftover::wait_gone(a_pid, &held, killed, Duration::from_secs(5))?;
    let collector_spans = seen.spans.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!(
        "soak: agent A killed; {} programs, {} links ({} uprobes) held; left after {:.0} ms: {:?}",
        held.progs.len(),
        held.links.len(),
        held.uprobe_links,
        left.after_ms,
        (
            left.progs.len(),
            left.links.len(),
            left.perf_entries,
            left.uprobe_events.len()
        )
    );
    let b = Agent::start(
        agent_bin,
        &["--exe".into(), server::exe_pattern(port)],
        otlp,
        metrics_b,
        t0,
    )?;
    let b_ready_at = b.ready_at;
    sampler.set(Some(Target {
        tag: "B",
        pid: b.pid,
        metrics_port: metrics_b,
    }));
    sleep_until(t0, now(t0) + 10.0);
    let kill = Kill {
        held,
        at: kill_at,
        left,
        collector_spans,
        a_last,
    };

    // 4. the server restarted under --exe
    let (restart_exe, s) = restart(server, python, port, t0, &b)?;
    let sent = load.stop();
    sleep_until(t0, now(t0) + 2.0);
    sampler.set(None);
    let samples = sampler.stop();
    let b_done = b.stop()?;
    // what B flushed at exit reaches the collector
    sleep_until(t0, now(t0) + 3.0);
    if let Some(c) = collector.take() {
        c.stop()?;
    }
    s.stop()?;
    Ok(Run {
        opts: opts.clone(),
        agent_bin: agent_bin.to_path_buf(),
        salt,
        load_start,
        main_end,
        ups,
        outages,
        restart_port,
        kill,
        restart_exe,
        sent,
        samples,
        a: a_done,
        b: b_done,
        b_ready_at,
        seen,
        end: now(t0),
    })
}

/// Stops the server, starts a new one on the same port, and lets the load
/// run 10 s against it.
fn restart(
    server: Server,
    python: &std::path::Path,
    port: u16,
    t0: Instant,
    agent: &Agent,
) -> Result<(Restart, Server)> {
    let old_pid = server.pid;
    let stop_at = now(t0);
    server.stop()?;
    let new = Server::start(python, port, t0)?;
    sleep_until(t0, new.ready_at + 10.0);
    let traced_at = agent.first_log(&format!("tracing pid {}", new.pid));
    eprintln!(
        "soak: server {old_pid} -> {} (ready {:.0} ms after spawn), traced at {:?}",
        new.pid,
        (new.ready_at - new.spawned_at) * 1000.0,
        traced_at.map(|t| ((t - new.spawned_at) * 1000.0).round())
    );
    Ok((
        Restart {
            old_pid,
            stop_at,
            new: (new.pid, new.spawned_at, new.ready_at),
            traced_at,
            phase_end: now(t0),
        },
        new,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn options_default_to_the_issue_and_are_checked() {
        let o = parse(&[]).expect("defaults");
        assert_eq!(
            (o.minutes, o.rate, o.cycle_s, o.down_s),
            (30.0, 2000, 300.0, 60.0)
        );
        let o = parse(&args(&[
            "--minutes",
            "2",
            "--cycle-seconds",
            "60",
            "--down-seconds",
            "15",
        ]))
        .expect("short run");
        assert_eq!((o.minutes, o.cycle_s, o.down_s), (2.0, 60.0, 15.0));
        assert!(parse(&args(&["--minutes", "0"])).is_err());
        assert!(parse(&args(&["--minutes"])).is_err());
        assert!(
            parse(&args(&["--down-seconds", "300"])).is_err(),
            "down as long as the cycle"
        );
        assert!(parse(&args(&["--bogus", "1"])).is_err());
        assert!(parse(&args(&["--release"])).expect("release").release);
    }
}
