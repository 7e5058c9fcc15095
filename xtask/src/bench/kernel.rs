//! The `kernel` section of `cargo xtask bench`: what the probes cost inside
//! the kernel, to the traced server and to everyone else.
//!
//! - **flood**: the SSE flood server (`sse_flood.py`, one send() per chunk)
//!   in rounds alternating without and with the agent: the server's CPU
//!   per chunk (its process CPU clock: all its threads, in ns), the
//!   agent's, and the ratio of (server + agent) traced to the server
//!   untraced; the agent's time from start to `ready` and its peak RSS,
//!   broken down from /proc/PID/smaps (ring buffer and map mmaps, heap,
//!   the rest) and the kernel memory of its maps (fdinfo `memlock`).
//! - **node flood** (`node_flood.rs`): issue 25's workload, node's `http`
//!   with one writev per chunk, as a fixed amount of work per round: the
//!   same ratio, agent and server figures, and BPF time per chunk.
//! - **BPF ns per run**: `kernel.bpf_stats_enabled` on for one more flood
//!   round (traced hits dominate the server's programs) and for untraced
//!   loops while the agent traces an idle process (every hit untraced):
//!   run_time_ns / run_cnt of each of the agent's programs (read from its
//!   prog fds' fdinfo), apart per phase. The stats add their own cost (two
//!   clock reads per run), so the ratios above are measured without them,
//!   and the untraced hits are also given less an empty program's figure
//!   under the stats on the same tracepoints and loops.
//! - **untraced syscall tax**: `sse_flood.py write-loop` (16-byte send()s
//!   and a draining recv() thread, untraced) without / with the agent.
//! - **untraced socket call tax**: `sse_flood.py send-recv-loop` (one
//!   untraced thread: a 16-byte send() and the recv() of it per iteration,
//!   no wake-ups) without / with the agent: what the hooks on the socket
//!   path cost a process nobody traces, apart from the write-loop's GIL
//!   hand-offs, which react to any added latency.
//! - **context-switch tax**: `sse_flood.py pingpong` (two untraced threads
//!   passing a byte over two pipes) without / with the agent.
//! - **connection tax**: `sse_flood.py connect-loop` (one untraced thread
//!   connecting to a loopback listener, accepting and closing both ends)
//!   without / with the agent: the state-change and socket-free programs,
//!   which run a few times per connection, each hit warm (in the other
//!   loops they run only for the loops' own few connections, cold).
//! - **non-I/O syscall tax**: `sse_flood.py syscall-loop` (getppid() in an
//!   untraced thread) without / with the agent: the raw syscall hooks see
//!   every syscall, not only the socket and pipe calls the loops above make;
//!   the socket hooks see none of it.
//! - **tracepoint floor**: each loop above also runs, in the same rounds,
//!   with an empty BPF program on every tracepoint the agent attaches
//!   (`tests/bench/empty_hooks.py`): what any program there costs, apart
//!   from what the agent's programs add to it.
//!
//! The agent runs with `--data-hooks` as the bench was given it (default
//! auto); the section's first line says which data path that was.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::agent::fdinfo;
use super::floor::{agent_tracepoints, EmptyHooks};
use super::untraced::gated_loop;
use super::{cpu_ns, flood_client, median, peak_rss_kib, Options, TracingAgent, FLOOD};
use crate::util::{free_port, start_server, Guard};

mod node_flood;

/// The number after `key` (e.g. `map_id:`) in an fdinfo text.
fn fdinfo_field(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().parse().ok())
}

/// run_time_ns and run_cnt of each of `pid`'s BPF programs, by name.
fn prog_stats(pid: u32) -> Result<BTreeMap<String, (u64, u64)>> {
    let mut by_id: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    for text in fdinfo(pid)? {
        let field = |key: &str| fdinfo_field(&text, key);
        if let (Some(id), Some(ns), Some(cnt)) =
            (field("prog_id:"), field("run_time_ns:"), field("run_cnt:"))
        {
            by_id.insert(id, (ns, cnt));
        }
    }
    let out = Command::new("bpftool")
        .args(["prog", "show", "-j"])
        .output()
        .context("running bpftool prog show")?;
    let progs: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("bpftool prog show -j output")?;
    let mut stats = BTreeMap::new();
    for prog in progs.as_array().into_iter().flatten() {
        let (Some(id), Some(name)) = (prog["id"].as_u64(), prog["name"].as_str()) else {
            continue;
        };
        if let Some(&(ns, cnt)) = by_id.get(&id) {
            let e = stats.entry(name.to_string()).or_insert((0, 0));
            e.0 += ns;
            e.1 += cnt;
        }
    }
    Ok(stats)
}

/// Per-program ns/run between two snapshots, for programs that ran.
fn stats_delta(
    before: &BTreeMap<String, (u64, u64)>,
    after: &BTreeMap<String, (u64, u64)>,
) -> Vec<(String, f64, u64)> {
    let mut rows: Vec<(String, f64, u64)> = after
        .iter()
        .filter_map(|(name, &(ns, cnt))| {
            let (ns0, cnt0) = before.get(name).copied().unwrap_or((0, 0));
            let runs = cnt.saturating_sub(cnt0);
            (runs > 0).then(|| (name.clone(), (ns - ns0) as f64 / runs as f64, runs))
        })
        .collect();
    rows.sort_by_key(|r| std::cmp::Reverse(r.2));
    rows
}

/// What the agent's programs took per chunk of a traced flood, under
/// bpf_stats.
pub(super) struct BpfPerChunk {
    /// Microseconds of BPF time.
    us: f64,
    /// Program runs.
    runs: f64,
}

impl BpfPerChunk {
    fn of(rows: &[(String, f64, u64)], chunks: f64) -> Self {
        let chunks = chunks.max(1.0);
        let ns: f64 = rows.iter().map(|(_, ns, runs)| ns * *runs as f64).sum();
        let runs: u64 = rows.iter().map(|(_, _, runs)| runs).sum();
        Self {
            us: ns / 1e3 / chunks,
            runs: runs as f64 / chunks,
        }
    }

    /// The time less what bpf_stats and the call into BPF cost each run
    /// (`empty_ns`: an empty program's figure under the stats).
    fn without_stats(&self, empty_ns: f64) -> String {
        format!(
            "{:.2} µs ({:.2} runs per chunk)",
            self.us - self.runs * empty_ns / 1e3,
            self.runs
        )
    }
}

fn format_stats(rows: &[(String, f64, u64)]) -> String {
    rows.iter()
        .map(|(name, ns, runs)| format!("{name} {ns:.0} ns x {runs}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The untraced loops of the bpf_stats phase, once each.
fn untraced_loops(opts: &Options) -> Result<()> {
    gated_loop("write-loop", "writes_per_s", opts.seconds)?;
    gated_loop("send-recv-loop", "iterations_per_s", opts.seconds)?;
    gated_loop("pingpong", "round_trips_per_s", opts.seconds)?;
    gated_loop("syscall-loop", "syscalls_per_s", opts.seconds)?;
    gated_loop("connect-loop", "connections_per_s", opts.seconds)?;
    Ok(())
}

/// `kernel.bpf_stats_enabled` = 1 while alive, restored on drop.
struct BpfStats(String);

impl BpfStats {
    fn enable() -> Result<Self> {
        const PATH: &str = "/proc/sys/kernel/bpf_stats_enabled";
        let old = std::fs::read_to_string(PATH).context("reading kernel.bpf_stats_enabled")?;
        std::fs::write(PATH, "1").context("enabling kernel.bpf_stats_enabled")?;
        Ok(Self(old.trim().to_string()))
    }
}

impl Drop for BpfStats {
    fn drop(&mut self) {
        if let Err(err) = std::fs::write("/proc/sys/kernel/bpf_stats_enabled", &self.0) {
            eprintln!("bench: restoring kernel.bpf_stats_enabled: {err}");
        }
    }
}

/// The agent's RSS by kind, from /proc/PID/smaps: (ring buffer + BPF map
/// mmaps, heap and anonymous memory, everything else), in KiB.
fn rss_breakdown(pid: u32) -> Result<(u64, u64, u64)> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))?;
    let (mut bpf, mut anon, mut other) = (0, 0, 0);
    let mut kind = 2;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            // a mapping's header: "start-end perms offset dev inode [path]"
            let path = line.split_whitespace().nth(5).unwrap_or("");
            kind = if path.contains("bpf") {
                0
            } else if path.is_empty() || path == "[heap]" || path.starts_with("[anon") {
                1
            } else {
                2
            };
        } else if let Some(kib) = line.strip_prefix("Rss:") {
            let kib: u64 = kib
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .unwrap_or(0);
            match kind {
                0 => bpf += kib,
                1 => anon += kib,
                _ => other += kib,
            }
        }
    }
    Ok((bpf, anon, other))
}

/// Kernel memory of the agent's maps (fdinfo `memlock`), in KiB, and the
/// largest (the ring buffer). Each map once: the probe objects share the
/// ring buffer and the pid filter, so the agent holds several fds of them.
fn map_memlock_kib(pid: u32) -> Result<(u64, u64)> {
    let mut maps = BTreeMap::new();
    for text in fdinfo(pid)? {
        if let (Some(id), Some(bytes)) = (
            fdinfo_field(&text, "map_id:"),
            fdinfo_field(&text, "memlock:"),
        ) {
            maps.insert(id, bytes / 1024);
        }
    }
    let largest = maps.values().copied().max().unwrap_or(0);
    Ok((maps.values().sum(), largest))
}

/// What one flood round cost: CPU time (ns) of the server and of the
/// agent (0 without one) over the chunks it streamed.
struct FloodRound {
    chunks: f64,
    server_ns: u64,
    agent_ns: u64,
}

impl FloodRound {
    /// µs per chunk: the server untraced (`self`), the server traced and
    /// the agent (`traced`).
    fn per_chunk(&self, traced: &FloodRound) -> (f64, f64, f64) {
        (
            us_per_chunk(self.server_ns, self.chunks),
            us_per_chunk(traced.server_ns, traced.chunks),
            us_per_chunk(traced.agent_ns, traced.chunks),
        )
    }

    /// The server's and the agent's CPU time over `run`, which streams
    /// the chunks it returns.
    fn measure(
        server_pid: u32,
        agent: Option<u32>,
        run: impl FnOnce() -> Result<f64>,
    ) -> Result<Self> {
        let agent_ns = || -> Result<u64> { Ok(agent.map(cpu_ns).transpose()?.unwrap_or(0)) };
        let (server0, agent0) = (cpu_ns(server_pid)?, agent_ns()?);
        let chunks = run()?;
        Ok(Self {
            chunks,
            server_ns: cpu_ns(server_pid)? - server0,
            agent_ns: agent_ns()? - agent0,
        })
    }
}

fn flood_round(
    port: u16,
    server_pid: u32,
    agent: Option<u32>,
    opts: &Options,
) -> Result<FloodRound> {
    FloodRound::measure(server_pid, agent, || {
        Ok(flood_client(port, opts.connections, opts.seconds, false)? * opts.seconds)
    })
}

fn us_per_chunk(ns: u64, chunks: f64) -> f64 {
    ns as f64 / 1e3 / chunks.max(1.0)
}

pub fn run(agent_bin: &Path, opts: &Options, report: &mut String) -> Result<()> {
    // An agent tracing it sees every hit of the untraced loops as untraced.
    let idle = Guard(
        Command::new("sleep")
            .arg("3600")
            .spawn()
            .context("starting an idle process to trace")?,
    );
    // What the agent attaches, read from its links: the data path it took,
    // and where the tracepoint floor puts its empty programs.
    let tracepoints = {
        let agent = TracingAgent::start(agent_bin, idle.0.id())?;
        let names = agent_tracepoints(agent.pid)?;
        agent.stop()?;
        names
    };
    let has = |name: &str| tracepoints.iter().any(|t| t == name);
    let data_path = if has("sys_enter") {
        "syscall"
    } else if has("tcp_sendmsg_locked") {
        "socket"
    } else {
        "socket_at_return"
    };
    let mut out = format!(
        "kernel data path: {data_path} hooks ({})\n",
        match data_path {
            "syscall" => "tp_btf sys_enter/sys_exit: every syscall on the host takes the slow path",
            "socket" => "tcp_sendmsg_locked, sock_send_length, sock_recv_length: no syscall hook",
            _ => "sock_send_length, sock_recv_length: no syscall hook, no send-start hook (each send dated at its return)",
        }
    );
    let port = free_port()?;
    let server = start_server(FLOOD, &["server", "--port", &port.to_string()])?;
    let server_pid = server.0.id();
    flood_client(port, opts.connections, 1.0, false)?; // warm-up

    // ---- flood, alternating, no bpf_stats
    let (mut base, mut server_traced, mut agent_us, mut ratio, mut ready_ms) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut peak = (0u64, (0, 0, 0), (0, 0));
    for round in 0..opts.rounds {
        let b = flood_round(port, server_pid, None, opts)?;
        let started = Instant::now();
        let agent = TracingAgent::start(agent_bin, server_pid)?;
        let ready = started.elapsed().as_secs_f64() * 1e3;
        let t = flood_round(port, server_pid, Some(agent.pid), opts)?;
        std::thread::sleep(Duration::from_millis(300));
        let rss = peak_rss_kib(agent.pid)?;
        if rss >= peak.0 {
            peak = (rss, rss_breakdown(agent.pid)?, map_memlock_kib(agent.pid)?);
        }
        agent.stop()?;
        let (sb, st, ag) = b.per_chunk(&t);
        let line = format!(
            "kernel flood round {round}: server {sb:.2} µs/chunk untraced ({:.0} chunks), {st:.2} traced ({:.0} chunks); agent {ag:.2} µs/chunk; CPU per chunk ratio {:.3}; ready {ready:.0} ms; agent peak RSS {rss} KiB\n",
            b.chunks,
            t.chunks,
            (st + ag) / sb
        );
        eprint!("{line}");
        out.push_str(&line);
        ratio.push((st + ag) / sb);
        base.push(sb);
        server_traced.push(st);
        agent_us.push(ag);
        ready_ms.push(ready);
    }
    let (sb, st, ag) = (
        median(&mut base),
        median(&mut server_traced),
        median(&mut agent_us),
    );
    let (rss, (bpf_kib, anon_kib, other_kib), (memlock, ring)) = peak;
    out.push_str(&format!(
        "kernel flood ({} connection(s), {} s rounds, {} rounds, sse_flood.py: one send() per chunk): flood CPU per chunk ratio {:.3} (median; (server + agent) traced / server untraced); agent {ag:.2} µs per chunk; server {sb:.2} µs per chunk untraced, {st:.2} traced: {:+.2} µs per chunk added; time to ready median {:.0} ms\n",
        opts.connections,
        opts.seconds,
        opts.rounds,
        median(&mut ratio),
        st - sb,
        median(&mut ready_ms),
    ));
    out.push_str(&format!(
        "agent peak RSS {rss} KiB: ring buffer and map mmaps {bpf_kib} KiB, heap and anonymous {anon_kib} KiB, binary and other file mappings {other_kib} KiB (resident at the peak round's end); kernel memory of its maps {memlock} KiB (ring buffer {ring} KiB; task storage entries, a few hundred bytes per traced thread, are allocated as threads need them and not in this figure); about {} KiB without the ring buffer's second mapping (libbpf maps its data pages twice, so that a record that wraps reads in one piece, and the kernel maps every page at mmap: the same memory counted twice)\n",
        rss.saturating_sub(ring)
    ));

    let node_bpf = node_flood::run(agent_bin, opts, &mut out)?;

    // ---- BPF ns per run: traced flood, then untraced loops
    {
        let _stats = BpfStats::enable()?;
        let agent = TracingAgent::start(agent_bin, server_pid)?;
        let before = prog_stats(agent.pid)?;
        let t = flood_round(port, server_pid, Some(agent.pid), opts)?;
        let after = prog_stats(agent.pid)?;
        agent.stop()?;
        let rows = stats_delta(&before, &after);
        let flood_bpf = BpfPerChunk::of(&rows, t.chunks);
        out.push_str(&format!(
            "BPF ns per run, traced flood (bpf_stats on; the server's programs are traced hits, the client's and the host's untraced): {}; BPF time {:.2} µs per chunk\n",
            format_stats(&rows),
            flood_bpf.us
        ));
        let agent = TracingAgent::start(agent_bin, idle.0.id())?;
        let before = prog_stats(agent.pid)?;
        untraced_loops(opts)?;
        let after = prog_stats(agent.pid)?;
        agent.stop()?;
        let untraced = stats_delta(&before, &after);
        // The same loops with the empty program on the same tracepoints:
        // what bpf_stats itself adds to a run (its two clock reads) and the
        // call into a program, so that the agent's figures can be given
        // without them.
        let empty = EmptyHooks::attach(&tracepoints)?;
        let before = prog_stats(empty.pid())?;
        untraced_loops(opts)?;
        let after = prog_stats(empty.pid())?;
        drop(empty);
        let empty_ns = stats_delta(&before, &after)
            .first()
            .map(|row| row.1)
            .context("the empty program never ran under the untraced loops")?;
        out.push_str(&format!(
            "BPF ns per run, untraced hits (bpf_stats on; write-loop, send-recv-loop, pingpong, syscall-loop and connect-loop while the agent traces an idle process): {}\n",
            format_stats(&untraced)
        ));
        out.push_str(&format!(
            "untraced hit without bpf_stats (each program's figure above less an empty program's on the same tracepoints and loops, {empty_ns:.0} ns per run under bpf_stats: the stats' clock reads and the call into BPF; goal <= 50 ns): {}\n",
            untraced
                .iter()
                .map(|(name, ns, _)| format!("{name} {:.0} ns", ns - empty_ns))
                .collect::<Vec<_>>()
                .join(", ")
        ));
        out.push_str(&format!(
            "BPF time per chunk without bpf_stats (each run less the empty program's {empty_ns:.0} ns; goal <= 1 µs): node flood {}, sse flood {}\n",
            node_bpf.map_or("skipped (no node)".to_string(), |b| b.without_stats(empty_ns)),
            flood_bpf.without_stats(empty_ns),
        ));
    }

    // ---- taxes on untraced processes
    out.push_str(&format!(
        "tracepoint floor: the same loops with an empty BPF program (r0 = 0; exit) on each of the agent's tracepoints ({}): what any program there costs\n",
        tracepoints.join(", ")
    ));
    // `hooks_only`: the loop's syscalls move no bytes, so with the syscall
    // hooks all it pays is their two untraced hits (and the slow path they
    // put it on); the socket hooks never see it.
    for (name, mode, key, what, hooks_only) in [
        (
            "untraced syscall tax",
            "write-loop",
            "writes_per_s",
            "write-loop: 16-byte send()s on loopback TCP and a recv() drain thread, untraced",
            false,
        ),
        (
            "untraced socket call tax",
            "send-recv-loop",
            "iterations_per_s",
            "send-recv-loop: one untraced thread, a 16-byte send() on loopback TCP and the recv() of it per iteration",
            false,
        ),
        (
            "context-switch tax",
            "pingpong",
            "round_trips_per_s",
            "pingpong: two untraced threads passing a byte over two pipes",
            false,
        ),
        (
            "connection tax",
            "connect-loop",
            "connections_per_s",
            "connect-loop: one untraced thread connects to a loopback listener, accepts and closes both ends",
            false,
        ),
        (
            "non-I/O syscall tax",
            "syscall-loop",
            "syscalls_per_s",
            "syscall-loop: getppid() in an untraced thread",
            true,
        ),
    ] {
        gated_loop(mode, key, 1.0)?; // warm-up
        let (mut without, mut floor, mut with) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..opts.rounds {
            let b = gated_loop(mode, key, opts.seconds)?;
            let empty = EmptyHooks::attach(&tracepoints)?;
            let f = gated_loop(mode, key, opts.seconds)?;
            drop(empty);
            let agent = TracingAgent::start(agent_bin, idle.0.id())?;
            let w = gated_loop(mode, key, opts.seconds)?;
            agent.stop()?;
            eprintln!(
                "{name} round {round}: {b:.0}/s without agent, {f:.0}/s with empty programs on its tracepoints, {w:.0}/s with it: ratio {:.4} (floor {:.4})",
                w / b,
                f / b
            );
            without.push(b);
            floor.push(f);
            with.push(w);
        }
        let (b, f, w) = (median(&mut without), median(&mut floor), median(&mut with));
        let added_us = 1e6 / w - 1e6 / b;
        let per_hook = match (hooks_only, data_path) {
            (true, "syscall") => format!(
                "; {:.0} ns per untraced syscall hook hit without bpf_stats (enter and exit)",
                added_us * 1e3 / 2.0
            ),
            (true, _) => "; no hook runs for it: the difference is noise".to_string(),
            _ => String::new(),
        };
        out.push_str(&format!(
            "{name} ({what}; {} s rounds, {} rounds): median {b:.0}/s without agent, {w:.0}/s with: ratio {:.4} (goal >= 0.98; {added_us:+.3} µs per iteration{per_hook}); tracepoint floor {:.4} (empty programs on the agent's {} tracepoints: {f:.0}/s), the agent's programs on top of it {:.4}\n",
            opts.seconds,
            opts.rounds,
            w / b,
            f / b,
            tracepoints.len(),
            w / f,
        ));
    }
    drop(idle);
    drop(server);
    print!("{out}");
    report.push_str(&out);
    Ok(())
}
