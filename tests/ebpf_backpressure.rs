//! Root-only: a stitching thread that cannot keep up does not turn the
//! ring buffer's records into heap. The agent's stdout is a pipe this test
//! stops reading (stitching blocks in its write) while the node SSE flood
//! (tests/bench/node_sse_flood.js) streams 1500 requests, ~300,000 data
//! records, ~75 MB of decoded events:
//!
//! - the agent's memory outside its BPF maps grows by at most the bytes of
//!   decoded batches it lets wait for stitching (a quarter of the ring
//!   buffer, 4 MiB by default) plus the batch the ingest thread holds
//!   while it waits, and slack (`HEAP_GROWTH_BOUND`, 10 MiB). Before the
//!   bound, the ingest thread queued up to 1024 batches: this stall grew
//!   the agent's heap by 116 MB (from 59 to 173 MB in all);
//! - so does its peak once stdout is read again and the full ring is read
//!   (VmHWM): one read of the ring is cut into batches of a quarter of the
//!   bytes in flight. Before that cut, the read after the stall took the
//!   whole ring into one batch;
//! - what the ring buffer could not hold is counted as lost in the kernel,
//!   and the waits in `channel_waits`: the summary says so;
//! - once stdout is read again, requests on new connections are reported
//!   whole (16 of 37 tokens each).
//!
//! Run (as root; CI does):
//!   cargo test -p tokentrace --test ebpf_backpressure -- --test-threads=1 --nocapture

use tokentrace_testkit as common;

use std::io::{BufRead, BufReader};
use std::process::{ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use common::h2::node;
use common::*;
use serde_json::Value;

const FLOOD: &str = "tests/bench/node_sse_flood.js";
/// The agent's default ring buffer (capture.ring_buffer_bytes).
const RING_BUFFER_BYTES: u64 = 16 << 20;
/// Decoded batches allowed to wait for stitching: a quarter of the ring.
const IN_FLIGHT_BYTES: u64 = RING_BUFFER_BYTES / 4;
/// The most one batch holds: a quarter of the bytes in flight, passed by
/// its last record (a payload of at most 16 KiB, capture.bytes' ceiling),
/// in a vector up to twice the events' size (room kept from a larger batch
/// before).
const BATCH_BYTES: u64 = 2 * (IN_FLIGHT_BYTES / 4 + (16 << 10));
/// Growth allowed while stitching is stalled, and at the peak after: the
/// bytes in flight; the batch the ingest thread holds while it waits; and
/// 4 MiB of slack for the allocator and stitching's own state. Seen:
/// ~1 MiB stalled. Without the bound on bytes in flight: 116 MiB; without
/// the one on a batch, the peak grew by the whole ring read in one batch.
const HEAP_GROWTH_BOUND: u64 = IN_FLIGHT_BYTES + BATCH_BYTES + (4 << 20);
/// The post-stall requests: 37 tokens, reported as 38 chunks (the usage
/// event is one too).
const AFTER_TOKENS: &str = "37";
const AFTER_CHUNKS: u64 = 38;
const AFTER_REQUESTS: usize = 16;

/// The flood client's run of `requests` requests of `tokens` tokens.
fn flood(port: u16, requests: usize, tokens: &str) -> Value {
    let out = Command::new(node())
        .current_dir(repo_root())
        .args([FLOOD, "client", "--port", &port.to_string()])
        .args(["--requests", &requests.to_string(), "--tokens", tokens])
        .stderr(Stdio::inherit())
        .output()
        .expect("run the flood client");
    assert!(out.status.success(), "flood client failed: {}", out.status);
    let v: Value = serde_json::from_slice(&out.stdout).expect("the client's JSON line");
    eprintln!("[test] flood client: {v}");
    v
}

/// Resident KiB of `pid` outside its BPF map mappings (the ring buffer and
/// mmapable arrays, whose size is fixed at load), and in them.
fn rss_kib(pid: u32) -> (u64, u64) {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).expect("read smaps");
    let (mut other, mut bpf, mut in_bpf) = (0, 0, false);
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let Some(first) = words.next() else { continue };
        if first == "Rss:" {
            let n: u64 = words.next().and_then(|n| n.parse().ok()).unwrap_or(0);
            if in_bpf {
                bpf += n;
            } else {
                other += n;
            }
        } else if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            in_bpf = line.contains("anon_inode:bpf");
        }
    }
    (other, bpf)
}

/// Reads the agent's JSON lines while `reading` is set; stops reading
/// (stitching then blocks in its stdout write) while it is not.
fn read_gated(out: ChildStdout, reading: Arc<AtomicBool>) -> mpsc::Receiver<Value> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let mut lines = BufReader::new(out).lines();
        loop {
            while !reading.load(Ordering::Relaxed) {
                thread::sleep(Duration::from_millis(10));
            }
            let Some(Ok(line)) = lines.next() else { break };
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                if tx.send(v).is_err() {
                    break;
                }
            }
        }
    });
    rx
}

#[test]
fn root_a_stalled_stitcher_bounds_the_agents_heap_and_counts_kernel_drops() {
    require_root("ebpf_backpressure");
    let mut cmd = Command::new(node());
    cmd.args([FLOOD, "server", "--port", "0"]);
    let (server, port) = start_ready("node_sse_flood.js server", &mut cmd, "is nodejs installed?");

    let mut cmd = Command::new(agent_bin());
    scrub_agent_env(&mut cmd);
    cmd.args([
        "run",
        "--pid",
        &server.pid().to_string(),
        "--output",
        "json",
    ]);
    let mut child = spawn_piped(&mut cmd, Stdio::null()).expect("start the agent");
    let out = child.stdout.take().expect("piped stdout");
    let mut agent = Proc::guard("tokentrace", child);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !agent
        .stderr
        .lines()
        .iter()
        .any(|l| l.contains("tokentrace: ready"))
    {
        assert!(agent.try_exit().is_none(), "the agent exited before ready");
        assert!(
            Instant::now() < deadline,
            "the agent was not ready within 60 s"
        );
        thread::sleep(Duration::from_millis(50));
    }
    let reading = Arc::new(AtomicBool::new(true));
    let lines = read_gated(out, Arc::clone(&reading));

    // Warm: the ring buffer's pages and the stitching tables touched once.
    flood(port, 300, "200");
    thread::sleep(Duration::from_millis(500));
    let (warm_heap, warm_bpf) = rss_kib(agent.pid());

    reading.store(false, Ordering::Relaxed);
    let stalled = flood(port, 1500, "200");
    thread::sleep(Duration::from_secs(1));
    let (stalled_heap, stalled_bpf) = rss_kib(agent.pid());
    let growth = stalled_heap.saturating_sub(warm_heap);
    eprintln!(
        "[test] agent RSS outside BPF maps: {warm_heap} KiB warm, {stalled_heap} KiB stalled \
         (+{growth} KiB; BPF maps {warm_bpf} -> {stalled_bpf} KiB); {} chunks streamed while stalled",
        stalled["chunks"]
    );
    assert!(
        growth * 1024 <= HEAP_GROWTH_BOUND,
        "the agent's heap grew by {growth} KiB while stitching was stalled: more than the bytes \
         in flight ({} KiB), the largest batch and slack allow ({} KiB)",
        IN_FLIGHT_BYTES / 1024,
        HEAP_GROWTH_BOUND / 1024
    );

    // Read again: what waited is stitched, new connections are whole.
    reading.store(true, Ordering::Relaxed);
    flood(port, AFTER_REQUESTS, AFTER_TOKENS);
    let path = format!("/v1/chat/completions?tokens={AFTER_TOKENS}");
    let mut after = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while after.len() < AFTER_REQUESTS && Instant::now() < deadline {
        if let Ok(v) = lines.recv_timeout(Duration::from_millis(200)) {
            if v["path"] == path.as_str() {
                after.push(v);
            }
        }
    }
    assert_eq!(
        after.len(),
        AFTER_REQUESTS,
        "requests after the stall: {after:?}"
    );
    for v in &after {
        assert_eq!(v["chunks"], AFTER_CHUNKS, "{v}");
        assert_eq!(v["done"], true, "{v}");
    }
    // The ring was full when the stall ended (its pages are all resident in
    // `stalled_bpf`), and everything it held has been read since.
    let peak = status_kib(agent.pid(), "VmHWM").expect("VmHWM in the agent's status");
    let peak_growth = peak.saturating_sub(warm_heap + stalled_bpf);
    eprintln!("[test] agent peak RSS after the stall: +{peak_growth} KiB over the warm heap and the full ring");
    assert!(
        peak_growth * 1024 <= HEAP_GROWTH_BOUND,
        "the agent's peak RSS grew by {peak_growth} KiB once it read the full ring: more than \
         the bytes in flight, one batch and slack allow ({} KiB)",
        HEAP_GROWTH_BOUND / 1024
    );

    agent.signal(libc::SIGINT);
    let status = agent.wait_timeout(Duration::from_secs(30));
    assert!(
        status.is_some_and(|s| s.success()),
        "the agent did not stop cleanly: {status:?}"
    );
    let summary = agent
        .stderr
        .lines()
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find_map(|v| v.get("tokentrace_summary").cloned())
        .expect("the agent's JSON summary on stderr");
    eprintln!(
        "[test] summary: kernel_drops {} channel_waits {} channel_drops {} events {}",
        summary["kernel_drops"],
        summary["channel_waits"],
        summary["channel_drops"],
        summary["events"]
    );
    assert!(
        summary["kernel_drops"].as_u64() > Some(0),
        "~75 MB of records met a 16 MiB ring while stitching was stalled, yet no loss was counted"
    );
    assert!(summary["channel_waits"].as_u64() > Some(0), "{summary}");
    assert_eq!(summary["channel_drops"], 0, "{summary}");
    drop(server);
}
