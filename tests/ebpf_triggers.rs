//! Root tests of the daemon's SLO triggers (`triggers:` in the config):
//! a real server (tests/servers/wire_server.py, whose TTFT the client sets
//! per request), the real agent with a config file, real sessions on disk.
//!
//! Nothing here is timed against the client: whether a rule fires depends
//! on TTFTs of 20 vs 300 ms (the server sleeps them), far from a 150 ms
//! bound however loaded the machine is; the history check compares the
//! session's own request stamps with the agent's firing.

use tokentrace_testkit as common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

use common::*;

fn fresh_dir(name: &str) -> PathBuf {
    let dir = repo_root().join("target").join("trigger-tests").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    dir
}

/// One keep-alive connection sending `/stream` requests one after another,
/// each with the TTFT `ttft_ms(elapsed)` asks for, until `total` passes.
/// Returns (rid, ttft asked) per request answered.
fn drive(port: u16, total: Duration, ttft_ms: impl Fn(Duration) -> u64) -> Vec<(String, u64)> {
    let mut conn = TcpStream::connect(("127.0.0.1", port)).expect("connect to the server");
    conn.set_nodelay(true).expect("TCP_NODELAY");
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    let t0 = Instant::now();
    let mut done = Vec::new();
    let mut buf = Vec::new();
    while t0.elapsed() < total {
        let ttft = ttft_ms(t0.elapsed());
        let rid = format!("trig-{}", done.len());
        write!(
            conn,
            "GET /stream?rid={rid}&tokens=3&delay_ms=2&ttft_ms={ttft} HTTP/1.1\r\nHost: t\r\n\r\n"
        )
        .expect("send a request");
        buf.clear();
        let mut chunk = [0u8; 4096];
        while !buf.ends_with(b"0\r\n\r\n") {
            let n = conn.read(&mut chunk).expect("read the response");
            assert!(n > 0, "the server closed the connection");
            buf.extend_from_slice(&chunk[..n]);
        }
        done.push((rid, ttft));
    }
    done
}

fn write_config(
    dir: &Path,
    triggered: &Path,
    cooldown: &str,
    after: &str,
    max_mib: u64,
) -> PathBuf {
    let path = dir.join("tokentrace.yaml");
    let yaml = format!(
        "triggers:\n  dir: {}\n  before: 8s\n  after: {after}\n  cooldown: {cooldown}\n  \
         max_total_mib: {max_mib}\n  profile_hz: 0\n  rules:\n    - name: ttft-p95\n      \
         metric: ttft\n      percentile: 95\n      above: 150\n      window: 4s\n      min_requests: 5\n",
        triggered.display()
    );
    std::fs::write(&path, yaml).expect("write the config");
    path
}

fn session_dirs(root: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root)
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default();
    dirs.sort();
    dirs
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| {
                    let p = e.path();
                    if p.is_dir() {
                        dir_bytes(&p)
                    } else {
                        e.metadata().map_or(0, |m| m.len())
                    }
                })
                .sum()
        })
        .unwrap_or(0)
}

/// SIGINT, and the agent must exit cleanly (its sessions written).
fn stop_cleanly(agent: &mut Agent) {
    let stop = agent.stop();
    let mut exit = Report::new();
    check_agent_exit(agent, stop, &mut exit);
    assert!(exit.failures.is_empty(), "{:?}", exit.failures);
}

fn firings(agent: &Agent) -> Vec<String> {
    agent
        .proc
        .stderr
        .lines()
        .into_iter()
        .filter(|l| l.contains("trigger \"ttft-p95\""))
        .collect()
}

/// TTFT ~20 ms for 9 s, ~300 ms for 10 s, then ~20 ms again: exactly one
/// session (cooldown 120 s), written by the trigger while the agent runs,
/// whose report holds the jump and at least 5 s of requests before the
/// firing (from the pre-trigger ring).
#[test]
fn root_ttft_jump_records_exactly_one_session_with_the_seconds_before() {
    require_root("root_ttft_jump_records_exactly_one_session_with_the_seconds_before");
    let dir = fresh_dir("jump");
    let triggered = dir.join("triggered");
    let config = write_config(&dir, &triggered, "120s", "5s", 64);
    let server = StampingServer::start("tests/servers/wire_server.py", &[]);
    let mut args = Agent::for_pids(&[server.proc.pid()]);
    args.extend(["--config".to_string(), config.display().to_string()]);
    let mut agent = start_agent(&args);
    let sent = drive(server.port, Duration::from_secs(24), |t| {
        if (9..19).contains(&t.as_secs()) {
            300
        } else {
            20
        }
    });
    // The session (5 s after the firing) is written while the agent runs.
    let deadline = Instant::now() + Duration::from_secs(30);
    let report = loop {
        let done: Vec<PathBuf> = session_dirs(&triggered)
            .into_iter()
            .filter(|d| d.join("requests.jsonl").exists())
            .collect();
        if !done.is_empty() || Instant::now() > deadline {
            break done;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    stop_cleanly(&mut agent);
    let fired = firings(&agent);
    eprintln!("[test] {} requests sent; firings: {fired:#?}", sent.len());
    let dirs = session_dirs(&triggered);
    assert_eq!(
        dirs.len(),
        1,
        "sessions written: {dirs:?}; firings {fired:?}"
    );
    assert_eq!(
        report.len(),
        1,
        "no finished session while the agent ran: {dirs:?}"
    );
    assert_eq!(fired.len(), 1, "the cooldown let it fire again: {fired:?}");
    assert!(fired[0].contains("recording session"), "{}", fired[0]);

    let jsonl = std::fs::read_to_string(dirs[0].join("requests.jsonl")).expect("requests.jsonl");
    let lines: Vec<Value> = jsonl
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let ttft_of = |rid: &str| sent.iter().find(|(r, _)| r == rid).map(|&(_, t)| t);
    let asked: Vec<(u64, u64)> = lines
        .iter()
        .filter_map(|l| {
            let path = str_field(l, "path")?;
            let rid = path.split("rid=").nth(1)?.split('&').next()?.to_string();
            Some((l["request_start_ns"].as_u64()?, ttft_of(&rid)?))
        })
        .collect();
    let first_slow = asked
        .iter()
        .filter(|(_, t)| *t == 300)
        .map(|(s, _)| *s)
        .min()
        .expect("the session holds requests after the jump");
    let earliest = asked.iter().map(|(s, _)| *s).min().unwrap_or(first_slow);
    let before_s = (first_slow - earliest) as f64 / 1e9;
    let fast_before = asked
        .iter()
        .filter(|(s, t)| *t == 20 && *s < first_slow)
        .count();
    eprintln!(
        "[test] session {}: {} requests, {fast_before} fast ones in the {before_s:.1} s before the jump",
        dirs[0].display(),
        lines.len()
    );
    // The firing came after the first slow request ended, so history from
    // ≥ 5 s before that request's start is ≥ 5 s before the firing.
    assert!(
        before_s >= 5.0,
        "the report starts only {before_s:.1} s before the jump"
    );
    assert!(
        fast_before >= 10,
        "{fast_before} requests before the jump in the report"
    );
    let report_html = std::fs::read_to_string(dirs[0].join("report.html")).expect("report.html");
    assert!(
        report_html.contains("trig-"),
        "report.html lists no request"
    );
}

/// Cooldown 1 s and a 1 MiB bound: the rule fires again and again while
/// TTFT stays high, and the directory never keeps more than the bound
/// (oldest sessions deleted first) once they are finished.
#[test]
fn root_many_firings_stay_within_the_disk_bound() {
    require_root("root_many_firings_stay_within_the_disk_bound");
    let dir = fresh_dir("bound");
    let triggered = dir.join("triggered");
    let config = write_config(&dir, &triggered, "1s", "1s", 1);
    let server = StampingServer::start("tests/servers/wire_server.py", &[]);
    let mut args = Agent::for_pids(&[server.proc.pid()]);
    args.extend(["--config".to_string(), config.display().to_string()]);
    let mut agent = start_agent(&args);
    let mut max_seen = 0u64;
    let sent = drive(server.port, Duration::from_secs(12), |_| 300);
    for _ in 0..20 {
        max_seen = max_seen.max(dir_bytes(&triggered));
        std::thread::sleep(Duration::from_millis(200));
    }
    stop_cleanly(&mut agent);
    let fired = firings(&agent);
    let dirs = session_dirs(&triggered);
    let total = dir_bytes(&triggered);
    let sizes: Vec<u64> = dirs.iter().map(|d| dir_bytes(d)).collect();
    eprintln!(
        "[test] {} requests, {} firings, {} sessions kept ({sizes:?} bytes), {total} bytes at the end, {max_seen} at most while running",
        sent.len(),
        fired.len(),
        dirs.len()
    );
    assert!(
        fired.len() >= 3,
        "fired {} times with a 1 s cooldown: {fired:?}",
        fired.len()
    );
    assert!(dirs.len() < fired.len(), "nothing was deleted: {dirs:?}");
    assert!(
        total <= 1 << 20,
        "{total} bytes kept, bound 1 MiB: {dirs:?}"
    );
}
