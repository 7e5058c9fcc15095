//! The TLS section of `cargo xtask bench`: what the OpenSSL uprobes cost.
//!
//! A uprobe traps into the kernel on every call of the probed function (and
//! a uretprobe on its return) in the processes it is attached for: the
//! traced ones (or every process mapping the library with
//! `--uprobes-all-processes`). So the section measures, with a throw-away
//! self-signed certificate (openssl CLI, in target/bench/tls/):
//!
//! 1. traced cost: the SSE flood of the plaintext section over HTTPS
//!    (`sse_flood.py --tls`, stdlib ssl, blocking sockets), rounds without
//!    and with the agent tracing the server: events/s ratio, agent CPU and
//!    peak RSS, and the µs each event costs (1/rate with − 1/rate without).
//!    Per event the server makes one SSL_write_ex (a uprobe + uretprobe on
//!    OpenSSL's write helper, one ring buffer record, its nested write()
//!    seen by the syscall tracepoints and not reported); the client is not
//!    traced and has no breakpoint;
//! 2. untraced tax: OpenSSL calls alone (`sse_flood.py ssl-loop`: one
//!    thread, a server and a client SSL object on memory BIOs, one
//!    SSL_write_ex and one SSL_read_ex per iteration, no syscalls), rounds
//!    with no agent, with the agent tracing another process that uses the
//!    same libssl (what every untraced process pays), and tracing the loop:
//!    µs per SSL call each way.
//!
//! Results go to target/bench/overhead.txt with the other sections'.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};

use super::{
    cpu_ns, cpu_percent, flood_client, json_number, median, peak_rss_kib, summary, Options,
    TracingAgent, FLOOD,
};

/// Median; NaN for no sample (every round excluded).
fn med(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        f64::NAN
    } else {
        median(values)
    }
}
use crate::util::{self, free_port, start_server, Guard};

fn path_str(p: &Path) -> Result<&str> {
    p.to_str()
        .with_context(|| format!("non-UTF-8 path {}", p.display()))
}

/// The agent tracing `pid` with its uprobes attached in `mode`
/// (`--uprobe-mode`), once it is ready and its OpenSSL probes are
/// attached (it logs "probing …: OpenSSL (N probes)" at info level).
fn start_agent(agent_bin: &Path, pid: u32, mode: &str) -> Result<TracingAgent> {
    let limit = Duration::from_secs(60);
    let selector = ["--pid", &pid.to_string(), "--uprobe-mode", mode];
    let mut agent = TracingAgent::spawn(agent_bin, Some("info"), &selector, limit)?;
    agent
        .wait_for(&["probing ", "OpenSSL ("], limit)
        .context("the agent attached no OpenSSL probes")?;
    Ok(agent)
}

/// Stops the agent; returns its summary's event and request lines.
fn stop_agent(agent: TracingAgent) -> Result<String> {
    Ok(summary(&agent.stop()?, &["events:", "requests:"]))
}

/// `sse_flood.py ssl-loop`, handshake done, waiting for its go.
struct SslLoop {
    _child: Guard,
    pid: u32,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl SslLoop {
    fn spawn(cert: &Path, key: &Path, seconds: f64) -> Result<SslLoop> {
        let mut child = Command::new("python3")
            .arg(util::root().join(FLOOD))
            .args(["ssl-loop", "--certfile", path_str(cert)?])
            .args(["--keyfile", path_str(key)?])
            .args(["--seconds", &seconds.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting ssl-loop")?;
        let stdin = child.stdin.take().context("ssl-loop stdin")?;
        let mut stdout = BufReader::new(child.stdout.take().context("ssl-loop stdout")?);
        let child = Guard(child);
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        let pid = line
            .strip_prefix("READY ")
            .and_then(|p| p.trim().parse().ok())
            .with_context(|| format!("ssl-loop printed {line:?}, not READY <pid>"))?;
        Ok(SslLoop {
            _child: child,
            pid,
            stdin,
            stdout,
        })
    }

    /// Runs the timed loop: SSL calls per second.
    fn go(mut self) -> Result<f64> {
        self.stdin.write_all(b"go\n")?;
        self.stdin.flush()?;
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        json_number(&line, "ssl_calls_per_s")
            .with_context(|| format!("unexpected ssl-loop output: {line:?}"))
    }
}

/// Other tokentrace agents running on the box. Their OpenSSL uprobes trap
/// in every process that maps the same libssl, traced or not, so while one
/// runs there is no uprobe-free baseline (seen: ssl-loop at 87k SSL calls/s
/// instead of 940k).
fn other_agents() -> Vec<String> {
    let mut found = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return found;
    };
    for e in dir.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let exe = std::fs::read_link(e.path().join("exe")).unwrap_or_default();
        let is_agent = exe
            .file_name()
            .is_some_and(|f| f.to_string_lossy().starts_with("tokentrace"));
        if is_agent && pid != std::process::id() {
            let cmd = std::fs::read(e.path().join("cmdline"))
                .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
                .unwrap_or_default();
            found.push(format!("pid {pid}: {}", cmd.trim()));
        }
    }
    found
}

/// µs one unit costs more at `slow` units/s than at `fast`.
/// Every uprobe attach mode, measured side by side in each round.
pub(super) const UPROBE_MODES: [&str; 3] = ["uprobe_multi", "perf_event", "tracefs"];

fn extra_us(fast: f64, slow: f64) -> f64 {
    1e6 / slow - 1e6 / fast
}

pub fn run(agent_bin: &Path, opts: &Options, out: &mut String) -> Result<()> {
    let dir = util::root().join("target/bench/tls");
    let (cert, key) = tokentrace_testkit::tls::self_signed(&dir)?;
    let mut report = String::new();
    let mut say = |line: String| {
        eprint!("{line}");
        report.push_str(&line);
    };
    // A round counts only when no other agent ran at its start or end;
    // up to 3 × --rounds attempts are made to collect --rounds of them.
    let max_attempts = opts.rounds * 3;
    let mut excluded = 0u32;
    let mut busy = |when: &str, say: &mut dyn FnMut(String)| -> bool {
        let others = other_agents();
        if !others.is_empty() {
            say(format!(
                "  {when}: another tokentrace agent is running ({}): its uprobes run in every process, round excluded\n",
                others.join("; ")
            ));
            excluded += 1;
            std::thread::sleep(Duration::from_secs(5));
        }
        !others.is_empty()
    };

    // ---- 1. the SSE flood over HTTPS
    let port = free_port()?;
    let server = start_server(
        FLOOD,
        &[
            "server",
            "--port",
            &port.to_string(),
            "--tls",
            "--certfile",
            path_str(&cert)?,
            "--keyfile",
            path_str(&key)?,
        ],
    )?;
    let server_pid = server.0.id();
    flood_client(port, opts.connections, 1.0, true)?; // warm-up
    let mut base = Vec::new();
    let mut with: Vec<Vec<f64>> = vec![Vec::new(); UPROBE_MODES.len()];
    let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); UPROBE_MODES.len()];
    let mut rss = 0;
    let mut round = 0;
    while base.len() < opts.rounds as usize && round < max_attempts {
        round += 1;
        if busy(&format!("TLS round {round}"), &mut say) {
            continue;
        }
        let b = flood_client(port, opts.connections, opts.seconds, true)?;
        let mut traced = Vec::new();
        for mode in UPROBE_MODES {
            let agent = start_agent(agent_bin, server_pid, mode)?;
            let cpu_before = cpu_ns(agent.pid)?;
            let t = flood_client(port, opts.connections, opts.seconds, true)?;
            let cpu = cpu_ns(agent.pid)? - cpu_before;
            std::thread::sleep(Duration::from_millis(300));
            rss = rss.max(peak_rss_kib(agent.pid)?);
            let summary = stop_agent(agent)?;
            let cpu_percent = cpu_percent(cpu, opts.seconds);
            say(format!(
                "TLS round {round}: without agent {b:.0} events/s, with agent ({mode} uprobes) {t:.0} events/s (ratio {:.3}, +{:.2} µs/event); agent CPU {cpu_percent:.1}%; {summary}\n",
                t / b,
                extra_us(b, t)
            ));
            traced.push((t, cpu_percent));
        }
        if busy(&format!("end of TLS round {round}"), &mut say) {
            continue;
        }
        base.push(b);
        for (i, (t, c)) in traced.into_iter().enumerate() {
            with[i].push(t);
            cpu[i].push(c);
        }
    }
    let b = med(&mut base);
    let mut flood = String::new();
    for (i, mode) in UPROBE_MODES.iter().enumerate() {
        let t = med(&mut with[i]);
        flood.push_str(&format!(
            "traced cost ({mode} uprobes): TLS SSE flood (HTTPS, {} connection(s), {} s rounds, {} clean rounds): median {b:.0} events/s without agent, {t:.0} with: ratio {:.3} ({:.1}% slower), +{:.2} µs per event \
             (per event: the server's traced SSL_write_ex, a uprobe + uretprobe on OpenSSL's write helper; the untraced client's SSL_read_ex has no breakpoint); agent CPU median {:.1}% of one core; agent peak RSS {rss} KiB (all modes)\n",
            opts.connections,
            opts.seconds,
            base.len(),
            t / b,
            (1.0 - t / b) * 100.0,
            extra_us(b, t),
            med(&mut cpu[i]),
        ));
    }

    // ---- 2. OpenSSL calls alone
    let mut none = Vec::new();
    let mut untraced: Vec<Vec<f64>> = vec![Vec::new(); UPROBE_MODES.len()];
    let mut traced: Vec<Vec<f64>> = vec![Vec::new(); UPROBE_MODES.len()];
    let mut round = 0;
    while none.len() < opts.rounds as usize && round < max_attempts {
        round += 1;
        if busy(&format!("ssl-loop round {round}"), &mut say) {
            continue;
        }
        let n = SslLoop::spawn(&cert, &key, opts.seconds)?.go()?;
        let mut per_mode = Vec::new();
        for mode in UPROBE_MODES {
            // the agent probes libssl for the flood server; the loop is not traced
            let agent = start_agent(agent_bin, server_pid, mode)?;
            let u = SslLoop::spawn(&cert, &key, opts.seconds)?.go()?;
            stop_agent(agent)?;
            let lp = SslLoop::spawn(&cert, &key, opts.seconds)?;
            let agent = start_agent(agent_bin, lp.pid, mode)?;
            let tr = lp.go()?;
            let summary = stop_agent(agent)?;
            say(format!(
                "ssl-loop round {round} ({mode} uprobes): {n:.0} SSL calls/s without agent; {u:.0} untraced ({:+.2} µs/call); {tr:.0} traced ({:+.2} µs/call); {summary}\n",
                extra_us(n, u),
                extra_us(n, tr)
            ));
            per_mode.push((u, tr));
        }
        if busy(&format!("end of ssl-loop round {round}"), &mut say) {
            continue;
        }
        none.push(n);
        for (i, (u, tr)) in per_mode.into_iter().enumerate() {
            untraced[i].push(u);
            traced[i].push(tr);
        }
    }
    let n = med(&mut none);
    let mut calls = String::new();
    for (i, mode) in UPROBE_MODES.iter().enumerate() {
        let (u, tr) = (med(&mut untraced[i]), med(&mut traced[i]));
        calls.push_str(&format!(
            "OpenSSL calls alone ({mode} uprobes; ssl-loop: one thread, memory BIOs, {} s rounds, {} clean rounds): median {n:.0} SSL calls/s without agent ({:.2} µs/call); \
             untraced tax (this process not traced, the agent tracing another process on the same libssl): {u:.0} (ratio {:.3}, +{:.2} µs per SSL call); traced: {tr:.0} (ratio {:.3}, +{:.2} µs per SSL call)\n",
            opts.seconds,
            none.len(),
            1e6 / n,
            u / n,
            extra_us(n, u),
            tr / n,
            extra_us(n, tr),
        ));
    }
    drop(server);
    let warning = if excluded > 0 || base.is_empty() || none.is_empty() {
        format!(
            "note: {excluded} round(s) excluded because another tokentrace agent was running (no uprobe-free baseline then){}\n",
            if base.is_empty() || none.is_empty() {
                "; NO clean round in a section: rerun on a quiet box"
            } else {
                ""
            }
        )
    } else {
        String::new()
    };
    print!("{warning}{flood}{calls}");
    report.push_str(&flood);
    report.push_str(&calls);
    out.push_str(&report);
    Ok(())
}
