//! `cargo xtask bench`: what the agent costs a streaming server, and what
//! its CUDA probes cost a launch-heavy process.
//!
//! SSE: one run alternates rounds without and with the agent attached to a
//! server that writes SSE events as fast as it can (one send() each, far
//! above 20k writes/s), and reports the ratio of events/s, the agent's CPU
//! and peak RSS, and events it lost.
//!
//! CUDA: rounds of target/native/launch_loop (`cargo xtask native`:
//! zero-length kernels on the stand-in libcudart.so.12, a sync every 1000
//! launches) alone, then traced by `tokentrace run --exe launch_loop`
//! started first: the loop is found at exec, and it holds its first launch
//! (`--gate`) until the agent has logged the libcudart.so.12 uprobes as
//! attached, so every timed launch pays for them. Reports the ratio of
//! launches/s and the cost each probe adds to a launch.
//!
//! TLS (`tls.rs`): the SSE flood over HTTPS, and OpenSSL calls alone, with
//! and without the OpenSSL uprobes: ratios and µs per event and per call.
//!
//! Replay (`replay.rs`, `cargo xtask bench replay`): the agent's userspace
//! cost per event on generated records, without the kernel or root.
//!
//! Untraced (`untraced.rs`): what processes the agent does not trace pay:
//! small socket writes, and CUDA launches on a library a traced process
//! also uses.
//!
//! gRPC (`grpc.rs`): a grpcio server-streaming flood over one HTTP/2
//! connection with and without the agent: ratio and µs per message.
//!
//! vLLM (`vllm.rs`): real vLLM's tokens/s with the tokentrace-vllm plugin,
//! untraced and traced, against vLLM without it, and the plugin's CPU per
//! token (needs `cargo xtask vllm-env`; installed on first use).
//!
//! The uprobe sections (CUDA, TLS, untraced CUDA, attach scale) run every
//! uprobe attach mode side by side in each round (`--uprobe-mode
//! uprobe_multi|perf_event|tracefs`), so their ratios compare in one run.
//!
//! Kernel (`kernel.rs`): the probes' cost inside the kernel: flood CPU per
//! chunk (server + agent against the untraced server), BPF ns per run of
//! each program (traced and untraced hits apart), the untraced syscall and
//! context-switch taxes, peak RSS broken down, time to ready.
//!
//! Hops (`hops.rs`): the agent's CPU per request through nginx with the
//! engine traced, and with the gateway's upstream calls traced and joined.
//!
//! Top (`top.rs`): the CPU of `tokentrace top --remote` beside the agent's
//! at thousands of requests/s.
//!
//! `--only sse|cuda|tls|untraced|grpc|hops|vllm|kernel|top` runs those sections (a
//! comma list: `--only sse,kernel`); `--agent PATH` benches that agent
//! binary instead of building this tree's; `--baseline-agent PATH` also
//! runs the node flood (kernel section) with another agent binary in the
//! same rounds, alternating, and compares the two (this VM's load moves
//! more between bench runs than most changes do). Results go to
//! target/bench/.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::deps::{self, Scope};
use crate::native;
use crate::util::{self, cpu_ns, cpu_percent, free_port, start_server, Guard};
use agent::{summary, TracingAgent};

mod agent;
mod bpftrace;
mod floor;
mod grpc;
mod hops;
mod kernel;
mod replay;
mod tls;
mod top;
mod untraced;
mod vllm;

const FLOOD: &str = "tests/bench/sse_flood.py";

const USAGE: &str = "usage: cargo xtask bench [--rounds N] [--seconds S] [--connections C] \
                     [--launch-seconds S] [--only sse|cuda|tls|untraced|grpc|hops|vllm|kernel|top[,...]] [--agent PATH] \
                     [--baseline-agent PATH] [--data-hooks auto|socket|socket_at_return|syscall] \
                     | cargo xtask bench replay [...]";

#[derive(Clone)]
struct Options {
    /// The agent binary to bench (default: this tree's, built in release).
    agent: Option<std::path::PathBuf>,
    /// Another agent binary the node flood also runs, round by round.
    baseline_agent: Option<std::path::PathBuf>,
    rounds: u32,
    seconds: f64,
    connections: u32,
    /// Length of each launch_loop run.
    launch_seconds: f64,
    sse: bool,
    cuda: bool,
    tls: bool,
    untraced: bool,
    grpc: bool,
    hops: bool,
    vllm: bool,
    kernel: bool,
    top: bool,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut opts = Options {
        agent: None,
        baseline_agent: None,
        rounds: 4,
        seconds: 3.0,
        connections: 2,
        launch_seconds: 2.0,
        sse: true,
        cuda: true,
        tls: true,
        untraced: true,
        grpc: true,
        hops: true,
        vllm: true,
        kernel: true,
        top: true,
    };
    for (flag, value) in flag_values(args)? {
        match flag {
            "--rounds" => opts.rounds = value.parse()?,
            "--seconds" => opts.seconds = value.parse()?,
            "--connections" => opts.connections = value.parse()?,
            "--launch-seconds" => opts.launch_seconds = value.parse()?,
            "--agent" => opts.agent = Some(value.into()),
            "--baseline-agent" => opts.baseline_agent = Some(value.into()),
            "--data-hooks" => {
                if !["auto", "socket", "socket_at_return", "syscall"].contains(&value) {
                    bail!(
                        "--data-hooks: {value:?} is not auto, socket, socket_at_return or syscall\n{USAGE}"
                    );
                }
                agent::use_data_hooks(value);
            }
            "--only" => {
                let only: Vec<&str> = value.split(',').map(str::trim).collect();
                const SECTIONS: [&str; 9] = [
                    "sse", "cuda", "tls", "untraced", "grpc", "hops", "vllm", "kernel", "top",
                ];
                if let Some(bad) = only.iter().find(|s| !SECTIONS.contains(s)) {
                    bail!(
                        "--only: unknown section {bad:?}; sections: {}\n{USAGE}",
                        SECTIONS.join(", ")
                    );
                }
                let on = |name: &str| only.contains(&name);
                opts.sse = on("sse");
                opts.cuda = on("cuda");
                opts.tls = on("tls");
                opts.untraced = on("untraced");
                opts.grpc = on("grpc");
                opts.hops = on("hops");
                opts.vllm = on("vllm");
                opts.kernel = on("kernel");
                opts.top = on("top");
            }
            _ => bail!("{USAGE}"),
        }
    }
    if opts.rounds == 0 || opts.launch_seconds.is_nan() || opts.launch_seconds < 1.0 {
        bail!("--rounds must be >= 1 and --launch-seconds >= 1 (a launch_loop run long enough to time)");
    }
    Ok(opts)
}

/// The `--flag value` pairs of a bench command line (every flag takes a
/// value).
fn flag_values(args: &[String]) -> Result<Vec<(&str, &str)>> {
    let mut it = args.iter();
    let mut pairs = Vec::new();
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        pairs.push((flag.as_str(), value.as_str()));
    }
    Ok(pairs)
}

/// One sse_flood.py client run against `port` (HTTPS with `tls`): events/s.
fn flood_client(port: u16, connections: u32, seconds: f64, tls: bool) -> Result<f64> {
    let what = if tls {
        "TLS flood client"
    } else {
        "flood client"
    };
    let mut cmd = Command::new("python3");
    cmd.arg(util::root().join(FLOOD)).arg("client");
    if tls {
        cmd.arg("--tls");
    }
    let out = cmd
        .args(["--port", &port.to_string()])
        .args(["--seconds", &seconds.to_string()])
        .args(["--connections", &connections.to_string()])
        .output()
        .with_context(|| format!("running the {what}"))?;
    if !out.status.success() {
        bail!("{what} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    json_number(&text, "events_per_s").with_context(|| format!("unexpected client output: {text}"))
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
    let agent = TracingAgent::start(agent_bin, server_pid)?;
    let agent_pid = agent.pid;
    let cpu_before = cpu_ns(agent_pid)?;
    let rate = flood_client(port, opts.connections, opts.seconds, false)?;
    let cpu = cpu_ns(agent_pid)? - cpu_before;
    // Let the agent drain what the last requests produced before stopping it.
    std::thread::sleep(Duration::from_millis(300));
    let rss_kib = peak_rss_kib(agent_pid)?;
    let summary = summary(&agent.stop()?, &["events:", "requests:"]);
    Ok(Traced {
        rate,
        cpu_percent: cpu_percent(cpu, opts.seconds),
        rss_kib,
        summary,
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
    if args.first().map(String::as_str) == Some("replay") {
        return replay::run(&args[1..]);
    }
    let opts = parse(args)?;
    deps::install(Scope::Build)?;
    if !util::is_root() {
        bail!("the benchmark loads eBPF programs: run it as root");
    }
    util::ensure_tracefs()?;
    let agent_bin = match &opts.agent {
        Some(path) => {
            anyhow::ensure!(path.is_file(), "--agent {}: no such file", path.display());
            path.clone()
        }
        None => {
            util::cargo(&["build", "--release", "-p", "tokentrace"])?;
            util::target_dir().join("release/tokentrace")
        }
    };
    let mut report = String::new();
    if opts.sse {
        sse(&agent_bin, &opts, &mut report)?;
    }
    if opts.cuda {
        native::build()?;
        cuda(&agent_bin, &opts, &mut report)?;
    }
    if opts.tls {
        tls::run(&agent_bin, &opts, &mut report)?;
    }
    if opts.untraced {
        untraced::run(&agent_bin, &opts, &mut report)?;
    }
    if opts.grpc {
        grpc::run(&agent_bin, &opts, &mut report)?;
    }
    if opts.hops {
        hops::run(&agent_bin, &opts, &mut report)?;
    }
    if opts.vllm {
        vllm::run(&agent_bin, &opts, &mut report)?;
    }
    if opts.kernel {
        kernel::run(&agent_bin, &opts, &mut report)?;
    }
    if opts.top {
        top::run(&agent_bin, &opts, &mut report)?;
    }
    let dir = util::root().join("target/bench");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("overhead.txt"), report)?;
    Ok(())
}

fn sse(agent_bin: &Path, opts: &Options, report: &mut String) -> Result<()> {
    let opts = opts.clone();
    let port = free_port()?;
    let server = start_server(FLOOD, &["server", "--port", &port.to_string()])?;
    let server_pid = server.0.id();

    // Warm-up: first connections and Python's caches.
    flood_client(port, opts.connections, 1.0, false)?;
    let (mut base, mut traced) = (Vec::new(), Vec::new());
    for round in 0..opts.rounds {
        let b = flood_client(port, opts.connections, opts.seconds, false)?;
        let t = traced_round(agent_bin, server_pid, port, &opts)?;
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
    Ok(())
}

// ------------------------------------------------------------------- CUDA

/// One launch_loop run's JSON line.
struct LoopRun {
    launches: f64,
    syncs: f64,
    seconds: f64,
    rate: f64,
}

/// The number after `"key":` in a one-line JSON object.
fn json_number(text: &str, key: &str) -> Option<f64> {
    let rest = text.split(&format!("\"{key}\":")).nth(1)?;
    let end = rest.find([',', '}']).unwrap_or(rest.len());
    rest[..end].trim().parse().ok()
}

/// Lines of a child's stream, as they come.
fn lines_of(reader: impl std::io::Read + Send + 'static) -> Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(reader).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Waits for a line containing every one of `needles` (all lines read are
/// appended to `seen`).
fn wait_for(
    rx: &Receiver<String>,
    seen: &mut Vec<String>,
    needles: &[&str],
    timeout: Duration,
) -> Result<String> {
    let deadline = Instant::now() + timeout;
    if let Some(l) = seen.iter().find(|l| needles.iter().all(|n| l.contains(n))) {
        return Ok(l.clone());
    }
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx.recv_timeout(left).with_context(|| {
            format!(
                "no line with {needles:?} within {timeout:?}; so far:\n  {}",
                seen.join("\n  ")
            )
        })?;
        seen.push(line.clone());
        if needles.iter().all(|n| line.contains(n)) {
            return Ok(line);
        }
    }
}

/// Starts launch_loop held at its gate; returns the child, its stdout lines
/// and its pid once it has loaded the CUDA libraries.
fn start_loop(loop_bin: &Path, opts: &Options) -> Result<(Guard, Receiver<String>)> {
    let mut child = Command::new(loop_bin)
        .args(["--seconds", &opts.launch_seconds.to_string(), "--gate"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", loop_bin.display()))?;
    let out = lines_of(child.stdout.take().context("launch_loop stdout")?);
    let guard = Guard(child);
    let first = out
        .recv_timeout(Duration::from_secs(30))
        .context("launch_loop printed nothing within 30 s")?;
    if json_number(&first, "ready").is_none() {
        bail!("launch_loop: expected {{\"ready\":PID}}, got {first:?}");
    }
    Ok((guard, out))
}

/// Opens the gate and waits for the loop's result line.
fn finish_loop(mut guard: Guard, out: Receiver<String>, opts: &Options) -> Result<LoopRun> {
    {
        let stdin = guard.0.stdin.as_mut().context("launch_loop stdin")?;
        stdin.write_all(b"go\n")?;
        stdin.flush()?;
    }
    let limit = Duration::from_secs_f64(opts.launch_seconds * 3.0 + 60.0);
    let line = out
        .recv_timeout(limit)
        .with_context(|| format!("launch_loop gave no result within {limit:?}"))?;
    let status = guard.0.wait()?;
    if !status.success() {
        bail!("launch_loop failed ({status}): {line}");
    }
    let field =
        |k: &str| json_number(&line, k).with_context(|| format!("launch_loop: no {k} in {line:?}"));
    Ok(LoopRun {
        launches: field("launches")?,
        syncs: field("syncs")?,
        seconds: field("seconds")?,
        rate: field("launches_per_s")?,
    })
}

struct CudaTraced {
    run: LoopRun,
    events: String,
    cpu_percent: f64,
}

/// launch_loop traced from its first launch: the agent (`--exe
/// launch_loop`) is ready before the loop starts, finds it at exec, and the
/// loop launches nothing until the agent logged its libcudart.so.12
/// uprobes as attached.
fn cuda_traced_round(
    agent_bin: &Path,
    loop_bin: &Path,
    opts: &Options,
    mode: &str,
) -> Result<CudaTraced> {
    let mut agent = TracingAgent::spawn(
        agent_bin,
        Some("info"),
        &["--exe", "launch_loop", "--uprobe-mode", mode],
        Duration::from_secs(60),
    )?;

    let (guard, out) = start_loop(loop_bin, opts)?;
    let loop_pid = guard.0.id();
    let attach = Duration::from_secs(30);
    agent
        .wait_for(&["tracing pid", &loop_pid.to_string()], attach)
        .context("the agent did not pick up launch_loop at exec")?;
    agent
        .wait_for(&["probing", "libcudart.so.12: CUDA"], attach)
        .context("the agent did not attach its CUDA uprobes to libcudart.so.12")?;
    let agent_pid = agent.pid;
    let cpu_before = cpu_ns(agent_pid)?;
    let run = finish_loop(guard, out, opts)?;
    let cpu = cpu_ns(agent_pid)? - cpu_before;
    std::thread::sleep(Duration::from_millis(300));
    let seen = agent.stop()?;
    let events = seen
        .iter()
        .find(|l| l.contains("events:"))
        .map(|l| l.trim().to_string())
        .unwrap_or_else(|| "no event summary".into());
    // Every sync is one event (entry + return uprobes): fewer means the
    // probes missed part of the run.
    let received = events
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse::<f64>().ok())
        .unwrap_or(0.0);
    if received < run.syncs {
        bail!(
            "the agent received {received} events for {} cudaStreamSynchronize calls: its CUDA probes did not see the whole run ({events})",
            run.syncs
        );
    }
    Ok(CudaTraced {
        run,
        events,
        cpu_percent: cpu_percent(cpu, opts.launch_seconds),
    })
}

fn cuda(agent_bin: &Path, opts: &Options, report: &mut String) -> Result<()> {
    let loop_bin = util::root().join("target/native/launch_loop");
    // Warm-up: page cache, CPU frequency.
    finish_loop_now(&loop_bin, opts)?;
    let modes = tls::UPROBE_MODES;
    let mut base = Vec::new();
    let mut traced: Vec<Vec<CudaTraced>> = modes.iter().map(|_| Vec::new()).collect();
    for round in 0..opts.rounds {
        let b = finish_loop_now(&loop_bin, opts)?;
        for (i, mode) in modes.iter().enumerate() {
            let t = cuda_traced_round(agent_bin, &loop_bin, opts, mode)?;
            let line = format!(
                "cuda round {round} ({mode} uprobes): without agent {:.0} launches/s ({:.0} in {:.2} s), with agent {:.0} launches/s ({:.0} in {:.2} s, {:.0} syncs): ratio {:.4}; agent CPU {:.1}%; {}\n",
                b.rate,
                b.launches,
                b.seconds,
                t.run.rate,
                t.run.launches,
                t.run.seconds,
                t.run.syncs,
                t.run.rate / b.rate,
                t.cpu_percent,
                t.events
            );
            eprint!("{line}");
            report.push_str(&line);
            traced[i].push(t);
        }
        base.push(b.rate);
    }
    let b = median(&mut base);
    for (i, mode) in modes.iter().enumerate() {
        let mut rates: Vec<f64> = traced[i].iter().map(|t| t.run.rate).collect();
        let mut cpu: Vec<f64> = traced[i].iter().map(|t| t.cpu_percent).collect();
        let t = median(&mut rates);
        let result = format!(
            "traced cost ({mode} uprobes; CUDA probes, launch_loop: zero-length kernels on the stand-in libcudart.so.12, a sync per 1000 launches, {} s runs, {} rounds): median {:.0} launches/s without agent, {:.0} with: ratio {:.4}; each probed cudaLaunchKernel costs {:.2} us more ({:.3} us -> {:.3} us); agent CPU median {:.1}% of one core\n",
            opts.launch_seconds,
            opts.rounds,
            b,
            t,
            t / b,
            1e6 / t - 1e6 / b,
            1e6 / b,
            1e6 / t,
            median(&mut cpu)
        );
        print!("{result}");
        report.push_str(&result);
    }
    Ok(())
}

/// An untraced launch_loop run (through the same gate).
fn finish_loop_now(loop_bin: &Path, opts: &Options) -> Result<LoopRun> {
    let (guard, out) = start_loop(loop_bin, opts)?;
    finish_loop(guard, out, opts)
}
