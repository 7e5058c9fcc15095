//! `tokentrace top` on a real terminal (tmux), against a real streaming
//! server under load: what the screen shows is checked against the agent's
//! own JSON lines for the same window, a request with an injected stall
//! must be in the slowest list with its cause, and `q` must end a local
//! `top` cleanly with its programs gone. Needs root and tmux (apt).

use tokentrace_testkit as common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use common::{
    agent_bin, python, repo_root, require_root, run_client, start_agent, start_server, Agent,
    ClientRun, ServerKind,
};

/// TTFT, ITL and socket-wait bucket bounds (seconds), as the agent's
/// metrics keep them (export/metrics.rs): a percentile read off them is
/// exact to its bucket.
const TTFT_BOUNDS: &[f64] = &[
    0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.125, 0.15,
    0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0,
];
const ITL_BOUNDS: &[f64] = &[
    0.001, 0.002, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
];
const SOCKET_WAIT_BOUNDS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];
const ROUTE: &str = "/v1/chat/completions";
const STALL_MS: f64 = 400.0;

/// A detached tmux session running one command in a 180×40 terminal.
struct Tmux {
    name: String,
}

impl Tmux {
    fn start(name: &str, command: &str) -> Self {
        let _ = Command::new("tmux")
            .args(["kill-session", "-t", name])
            .output();
        let status = Command::new("tmux")
            .args([
                "new-session",
                "-d",
                "-s",
                name,
                "-x",
                "180",
                "-y",
                "40",
                command,
            ])
            .status()
            .unwrap_or_else(|e| {
                panic!("cannot run tmux (apt-get install tmux; CI installs it): {e}")
            });
        assert!(status.success(), "tmux new-session failed: {status}");
        // the pane stays after the command ends, so its last screen can be read
        let _ = Command::new("tmux")
            .args(["set-option", "-t", name, "remain-on-exit", "on"])
            .status();
        Self { name: name.into() }
    }

    fn screen(&self) -> String {
        let out = Command::new("tmux")
            .args(["capture-pane", "-p", "-t", &self.name])
            .output()
            .expect("tmux capture-pane");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn keys(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", &self.name];
        args.extend(keys);
        let status = Command::new("tmux")
            .args(&args)
            .status()
            .expect("tmux send-keys");
        assert!(status.success());
    }

    /// Waits until `ready` holds for the screen; returns the last screen.
    fn wait(&self, what: &str, timeout: Duration, ready: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let screen = self.screen();
            if ready(&screen) {
                return screen;
            }
            assert!(
                Instant::now() < deadline,
                "the screen did not show {what} within {timeout:?}:\n{screen}"
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["kill-session", "-t", &self.name])
            .output();
    }
}

fn out_dir() -> PathBuf {
    let dir = repo_root().join("target/ebpf_top");
    std::fs::create_dir_all(&dir).expect("target/ebpf_top");
    dir
}

/// The fields of the services table's row of `route` (box borders off).
fn route_row(screen: &str, route: &str) -> Option<Vec<String>> {
    screen
        .lines()
        .map(|l| l.trim_matches(|c: char| c == '│' || c.is_whitespace()))
        .find(|l| l.split_whitespace().nth(2) == Some(route))
        .map(|l| l.split_whitespace().map(str::to_string).collect())
}

/// The seconds the title says the window covers.
fn covered_seconds(screen: &str) -> f64 {
    screen
        .split_once("(covering ")
        .and_then(|(_, rest)| rest.split_once(" s)"))
        .and_then(|(n, _)| n.parse().ok())
        .unwrap_or_else(|| panic!("no '(covering N s)' in the title:\n{screen}"))
}

/// The buckets `(lower, upper]` the q-quantile of `values` (ms) may be read
/// from: those of the values at the nearest ranks around q × n.
fn allowed_buckets(values: &[f64], q: f64, bounds: &[f64]) -> Vec<(f64, f64)> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    let rank = (q * n as f64).ceil() as usize;
    [rank.saturating_sub(1), rank, rank + 1]
        .into_iter()
        .filter(|r| (1..=n).contains(r))
        .map(|r| {
            let v = sorted[r - 1] / 1e3;
            let i = bounds.partition_point(|&b| b < v);
            let lower = if i == 0 { 0.0 } else { bounds[i - 1] };
            (
                lower * 1e3,
                bounds.get(i).map_or(f64::INFINITY, |b| b * 1e3),
            )
        })
        .collect()
}

fn check_percentile(name: &str, shown: &str, values: &[f64], q: f64, bounds: &[f64]) {
    let shown: f64 = shown
        .parse()
        .unwrap_or_else(|_| panic!("{name}: {shown:?} is not a number"));
    let allowed = allowed_buckets(values, q, bounds);
    // the screen rounds to 0.1 ms (whole ms from 100 up)
    let slack = if shown >= 100.0 { 0.5 } else { 0.05 };
    assert!(
        allowed
            .iter()
            .any(|(lo, hi)| shown >= lo - slack && shown <= hi + slack),
        "{name}: the screen shows {shown} ms, the agent's JSON lines put it in {allowed:?} ms ({} values)",
        values.len()
    );
    eprintln!("[test] {name}: screen {shown} ms, JSON buckets {allowed:?}");
}

fn numbers(lines: &[Value], key: &str) -> Vec<f64> {
    lines.iter().filter_map(|v| v[key].as_f64()).collect()
}

/// One streamed request whose gap before chunk 4 is [`STALL_MS`] (the
/// server sleeps: off-CPU), with `x-request-id: stalled-1`.
fn stalled_request(port: u16) {
    let script = format!(
        r#"
import http.client, json
c = http.client.HTTPConnection("127.0.0.1", {port}, timeout=30)
body = json.dumps({{"stream": True, "max_tokens": 8, "token_delay_ms": 10,
                   "ttft_ms": 20, "stall_at": 4, "stall_ms": {STALL_MS}}})
c.request("POST", "{ROUTE}?rid=stalled-1", body,
          {{"content-type": "application/json", "x-request-id": "stalled-1"}})
r = c.getresponse()
assert r.status == 200, r.status
r.read()
"#
    );
    let status = Command::new(python())
        .args(["-c", &script])
        .status()
        .expect("python3");
    assert!(status.success(), "the stalled request failed: {status}");
}

fn control_url(agent: &Agent) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let line = agent.proc.stderr.lines().into_iter().find_map(|l| {
            l.split_once("control endpoint at ")
                .map(|(_, url)| url.to_string())
        });
        if let Some(url) = line {
            return url.trim().to_string();
        }
        assert!(
            Instant::now() < deadline,
            "the agent printed no control endpoint address:\n{}",
            agent.proc.stderr.tail(20)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn write_token(dir: &Path) -> PathBuf {
    let path = dir.join("control.token");
    std::fs::write(&path, "top-test-token\n").expect("token file");
    path
}

#[test]
fn root_top_remote_shows_the_agents_window_and_the_stalled_request() {
    require_root("root_top_remote_shows_the_agents_window_and_the_stalled_request");
    let server = start_server(ServerKind::Stdlib, &[]);
    let dir = out_dir();
    let token = write_token(&dir);
    let mut args = Agent::for_port(server.port);
    args.extend([
        "--control-addr".to_string(),
        "127.0.0.1:0".to_string(),
        "--control-token-file".to_string(),
        token.display().to_string(),
        "--session-dir".to_string(),
        dir.join("sessions").display().to_string(),
    ]);
    let mut agent = start_agent(&args);
    let url = control_url(&agent);
    let tmux = Tmux::start(
        "tt-top-remote",
        &format!(
            "{} top --remote {url} --token-file {} --window 5m",
            agent_bin().display(),
            token.display()
        ),
    );
    tmux.wait("the agent's line", Duration::from_secs(20), |s| {
        s.contains("kernel programs")
    });

    let mut run = ClientRun::sse(120, 4, "top-");
    run.tokens = 10;
    run.token_delay_ms = 8.0;
    run.ttft_ms = 25.0;
    let records = run_client(server.port, &run);
    assert_eq!(records.len(), 120, "the client's own records");
    stalled_request(server.port);

    let paths: BTreeSet<String> = records
        .iter()
        .map(|r| r.path.clone())
        .chain([format!("{ROUTE}?rid=stalled-1")])
        .collect();
    let missing = agent.wait_for_paths(&paths, Duration::from_secs(30));
    assert!(missing.is_empty(), "the agent did not report {missing:?}");
    let lines: Vec<Value> = agent
        .values()
        .into_iter()
        .filter(|v| v["path"].as_str().is_some_and(|p| p.starts_with(ROUTE)))
        .collect();
    let n = lines.len();
    let screen = tmux.wait(
        &format!("N = {n} on the {ROUTE} row"),
        Duration::from_secs(20),
        |s| {
            route_row(s, ROUTE)
                .is_some_and(|f| f.get(4).map(String::as_str) == Some(&n.to_string()))
        },
    );
    std::fs::write(dir.join("remote_screen.txt"), &screen).expect("screen capture");
    eprintln!("[test] top --remote, after the load:\n{screen}");

    let row = route_row(&screen, ROUTE).expect("the route's row");
    // SERVICE MODEL ROUTE REQ/S N WAIT1ST STREAM TTFT50 TTFT95 TTFT99 ITL50 ITL99 SOCK95 CANC/S STALLS…
    let covered = covered_seconds(&screen);
    let rate: f64 = row[3].parse().expect("REQ/S");
    let want_rate = n as f64 / covered;
    assert!(
        (rate - want_rate).abs() <= 0.05 + want_rate / covered.max(1.0),
        "REQ/S {rate} for {n} requests over the {covered} s the window covers ({want_rate:.2})"
    );
    assert_eq!(
        (row[5].as_str(), row[6].as_str()),
        ("0", "0"),
        "nothing in flight: {row:?}"
    );
    let ok: Vec<Value> = lines
        .iter()
        .filter(|v| v["status"] == 200 && v["aborted"] != true)
        .cloned()
        .collect();
    let ttft = numbers(&ok, "ttft_ms");
    assert_eq!(ttft.len(), n, "every request succeeded");
    check_percentile("TTFT p50", &row[7], &ttft, 0.5, TTFT_BOUNDS);
    check_percentile("TTFT p95", &row[8], &ttft, 0.95, TTFT_BOUNDS);
    check_percentile("TTFT p99", &row[9], &ttft, 0.99, TTFT_BOUNDS);
    let itl: Vec<f64> = lines
        .iter()
        .flat_map(|v| v["itl_ms"].as_array().cloned().unwrap_or_default())
        .filter_map(|g| g.as_f64())
        .collect();
    check_percentile("ITL p50", &row[10], &itl, 0.5, ITL_BOUNDS);
    check_percentile("ITL p99", &row[11], &itl, 0.99, ITL_BOUNDS);
    let socket = numbers(&lines, "socket_wait_ms");
    check_percentile(
        "socket wait p95",
        &row[12],
        &socket,
        0.95,
        SOCKET_WAIT_BOUNDS,
    );
    assert_eq!(row[13], "0.0", "no cancellations: {row:?}");
    let stalls = row[14..].join(" ");
    assert!(
        stalls.contains("off_cpu"),
        "stall share names off_cpu: {stalls}"
    );

    // the stalled request: first in the slowest list, its gap and cause
    let stalled = screen
        .lines()
        .find(|l| l.contains("stalled-1"))
        .unwrap_or_else(|| panic!("the stalled request is not in the slowest list:\n{screen}"));
    let fields: Vec<&str> = stalled
        .trim_matches(|c: char| c == '│' || c.is_whitespace())
        .split_whitespace()
        .collect();
    // TTFT SOCKET ACCEPT TLS READ TO1ST STREAM GAP CAUSE…
    let gap: f64 = fields[7].parse().expect("GAP");
    let json_gap = lines
        .iter()
        .find(|v| v["request_id"] == "stalled-1")
        .and_then(|v| v["itl_max_ms"].as_f64())
        .expect("the stalled request's itl_max_ms");
    assert!(
        gap >= STALL_MS && (gap - json_gap).abs() <= 0.5,
        "the stalled request's gap: screen {gap} ms, JSON itl_max_ms {json_gap} ms"
    );
    assert!(
        fields[8].starts_with("off_cpu"),
        "the stalled gap's cause should be off_cpu (the server slept): {stalled}"
    );
    let first_slow = screen
        .lines()
        .skip_while(|l| !l.contains("GAP CAUSE"))
        .nth(1)
        .unwrap_or_default();
    assert!(
        first_slow.contains("stalled-1"),
        "the stalled request should lead the slowest list: {first_slow}"
    );

    // Enter opens its waterfall, with the late chunk and its causes
    tmux.keys(&["Tab", "Enter"]);
    let waterfall = tmux.wait("the waterfall", Duration::from_secs(5), |s| {
        s.contains("late chunk 4")
    });
    eprintln!("[test] waterfall:\n{waterfall}");
    std::fs::write(dir.join("remote_waterfall.txt"), &waterfall).expect("waterfall capture");
    assert!(waterfall.contains("stalled-1") && waterfall.contains("off_cpu"));
    tmux.keys(&["Escape", "q"]);
    drop(tmux);
    let st = agent.stop();
    assert!(st.is_some_and(|s| s.success()), "agent exit: {st:?}");
}

#[test]
fn root_top_local_quits_on_q_and_leaves_no_probe_attached() {
    require_root("root_top_local_quits_on_q_and_leaves_no_probe_attached");
    let server = start_server(ServerKind::Stdlib, &[]);
    let dir = out_dir();
    let exit_file = dir.join("local_exit");
    let _ = std::fs::remove_file(&exit_file);
    let stderr_file = dir.join("local_stderr.txt");
    let tmux = Tmux::start(
        "tt-top-local",
        &format!(
            "{} top --port {} 2>{}; echo $? > {}; sleep 60",
            agent_bin().display(),
            server.port,
            stderr_file.display(),
            exit_file.display()
        ),
    );
    let screen = tmux.wait("the agent ready", Duration::from_secs(60), |s| {
        s.contains("kernel programs") && !s.contains(" 0 kernel programs")
    });
    let top_pid = {
        let out = Command::new("pgrep")
            .args(["-f", &format!("top --port {}", server.port)])
            .output()
            .expect("pgrep");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.trim().parse::<u32>().ok())
            .find(|pid| {
                std::fs::read_link(format!("/proc/{pid}/exe"))
                    .is_ok_and(|exe| exe.ends_with("tokentrace"))
            })
            .unwrap_or_else(|| panic!("no tokentrace top process:\n{screen}"))
    };
    let programs = common::program_ids(top_pid);
    assert!(!programs.is_empty(), "top's agent holds no BPF programs");

    let run = ClientRun::sse(20, 2, "local-");
    assert_eq!(run_client(server.port, &run).len(), 20);
    let screen = tmux.wait("the 20 requests", Duration::from_secs(20), |s| {
        route_row(s, ROUTE).is_some_and(|f| f.get(4).map(String::as_str) == Some("20"))
    });
    std::fs::write(dir.join("local_screen.txt"), &screen).expect("screen capture");

    tmux.keys(&["q"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !exit_file.exists() {
        assert!(
            Instant::now() < deadline,
            "top did not exit within 30 s of q:\n{}",
            tmux.screen()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(200));
    let code = std::fs::read_to_string(&exit_file).unwrap_or_default();
    let stderr = std::fs::read_to_string(&stderr_file).unwrap_or_default();
    assert_eq!(code.trim(), "0", "top's exit status; stderr:\n{stderr}");
    assert!(
        stderr.contains("requests: 20"),
        "the agent's summary after the view, with its 20 requests:\n{stderr}"
    );
    let after = tmux.screen();
    assert!(
        after.contains("stopping the agent") && !after.contains("q quit"),
        "q should leave the alternate screen and say the agent stops:\n{after}"
    );
    let left: Vec<u64> = programs
        .iter()
        .copied()
        .filter(|id| {
            Command::new("bpftool")
                .args(["prog", "show", "id", &id.to_string()])
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .collect();
    assert!(
        left.is_empty(),
        "programs of top's agent still loaded: {left:?}"
    );
}

#[test]
fn top_without_a_terminal_refuses_and_names_run_output_json() {
    let out = Command::new(agent_bin())
        .args(["top", "--port", "1"])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("tokentrace top");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "top | cat must fail: {stderr}");
    assert!(
        stderr.contains("needs a terminal") && stderr.contains("run --output json"),
        "{stderr}"
    );
}
