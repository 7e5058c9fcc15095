//! Root-only end-to-end tests of recording sessions: `tokentrace record`
//! against a real streaming server under load, `tokentrace replay` of its
//! raw.pb, the HTML report in headless Chromium, `record --remote`
//! against a running daemon (`tokentrace run` with its control endpoint),
//! and the off-CPU slices of a thread id the kernel handed on after its
//! first owner died.
//!
//! Run (as root; CI does):
//!   cargo test -p tokentrace --test session_record -- --test-threads=1 --nocapture
//!
//! Needs python3, a C compiler (the hot function) and Debian's chromium.
//! Artifacts of the last run (the session directory, the screenshot) stay
//! under target/session-tests/ for inspection.

use tokentrace_testkit as common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// The function the hot server burns CPU in (tests/servers/hot_spin.c).
const HOT_FUNCTION: &str = "tokentrace_test_hot_spin";
/// Process id of the "Requests" tracks in trace.json.
const REQUESTS_PID: u64 = 1 << 30;

fn out_root() -> PathBuf {
    repo_root().join("target").join("session-tests")
}

fn fresh_dir(name: &str) -> PathBuf {
    let dir = out_root().join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    dir
}

/// A child killed on drop, with its stderr lines delivered on a channel.
struct Running {
    name: &'static str,
    child: Child,
    lines: Receiver<String>,
    seen: Vec<String>,
}

impl Running {
    fn spawn(name: &'static str, cmd: &mut Command) -> Self {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        let (tx, rx) = mpsc::channel();
        for stream in [
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let tx = tx.clone();
            thread::spawn(move || {
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        Running {
            name,
            child,
            lines: rx,
            seen: Vec::new(),
        }
    }

    /// Waits for a line containing `needle`; returns it.
    fn wait_line(&mut self, needle: &str, timeout: Duration) -> String {
        self.wait_for(needle, |line| line.contains(needle), timeout)
    }

    /// Waits for a line `wanted` accepts (`what` names it in failures).
    fn wait_for(&mut self, what: &str, wanted: impl Fn(&str) -> bool, timeout: Duration) -> String {
        let needle = what;
        let deadline = Instant::now() + timeout;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self
                .lines
                .recv_timeout(left.min(Duration::from_millis(200)))
            {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if wanted(&line) {
                        return line;
                    }
                }
                Err(_) => {
                    if let Ok(Some(st)) = self.child.try_wait() {
                        self.drain();
                        panic!(
                            "{} exited ({st}) before printing {needle:?}; output:\n{}",
                            self.name,
                            self.seen.join("\n")
                        );
                    }
                }
            }
        }
        panic!(
            "{} printed no {needle:?} within {timeout:?}; output:\n{}",
            self.name,
            self.seen.join("\n")
        );
    }

    fn drain(&mut self) {
        while let Ok(line) = self.lines.try_recv() {
            self.seen.push(line);
        }
    }

    fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            self.drain();
            if let Ok(Some(st)) = self.child.try_wait() {
                thread::sleep(Duration::from_millis(200));
                self.drain();
                return st;
            }
            assert!(
                Instant::now() < deadline,
                "{} still running after {timeout:?}; output:\n{}",
                self.name,
                self.seen.join("\n")
            );
            thread::sleep(Duration::from_millis(50));
        }
    }

    fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, sig);
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if thread::panicking() {
            self.drain();
            let start = self.seen.len().saturating_sub(60);
            eprintln!(
                "---- {} output tail ----\n{}\n---- end ----",
                self.name,
                self.seen[start..].join("\n")
            );
        }
    }
}

/// Compiles tests/servers/hot_spin.c into a shared library.
fn build_hot_lib() -> PathBuf {
    let out = out_root().join("libtt_hot.so");
    std::fs::create_dir_all(out_root()).expect("target/session-tests");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args([
            "-O1",
            "-g",
            "-fno-omit-frame-pointer",
            "-shared",
            "-fPIC",
            "-o",
        ])
        .arg(&out)
        .arg(repo_root().join("tests/servers/hot_spin.c"))
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler {cc:?} (apt-get install gcc): {e}"));
    assert!(status.success(), "compiling hot_spin.c failed: {status}");
    out
}

/// The hot server: stdlib_sse.py plus `HOT_FUNCTION` before every chunk.
fn start_hot_server(lib: &Path) -> (Running, u16) {
    let mut server = Running::spawn(
        "hot_sse.py",
        Command::new(python())
            .arg("-u")
            .arg(repo_root().join("tests/servers/hot_sse.py"))
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--burn-ms",
                "4",
                "--hot-lib",
            ])
            .arg(lib)
            .current_dir(repo_root()),
    );
    let ready = server.wait_line("READY ", Duration::from_secs(30));
    let port = ready
        .trim()
        .trim_start_matches("READY ")
        .parse()
        .unwrap_or_else(|_| panic!("bad READY line {ready:?}"));
    (server, port)
}

fn tokentrace(args: &[&str]) -> Command {
    let mut cmd = Command::new(agent_bin());
    for (k, _) in std::env::vars_os() {
        let key = k.to_string_lossy();
        if key.starts_with("TOKENTRACE_") && key != "TOKENTRACE_LOG" {
            cmd.env_remove(&k);
        }
    }
    cmd.args(args).current_dir(repo_root());
    cmd
}

/// `tokentrace record --pid PID --duration 120s --out OUT EXTRA…`, once it
/// is ready (Ctrl-C ends it early; it writes its artifacts then).
fn start_record(pid: u32, out: &Path, extra: &[&str]) -> Running {
    let (pid, out) = (pid.to_string(), out.display().to_string());
    let mut args = vec!["record", "--pid", &pid, "--duration", "120s", "--out", &out];
    args.extend_from_slice(extra);
    let mut record = Running::spawn("tokentrace record", &mut tokentrace(&args));
    record.wait_line("tokentrace: ready", Duration::from_secs(60));
    record
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn sizes(dir: &Path) -> String {
    let mut entries: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter_map(|e| {
                    let len = e.metadata().ok()?.len();
                    Some(format!("{} {} B", e.file_name().to_string_lossy(), len))
                })
                .collect()
        })
        .unwrap_or_default();
    entries.sort();
    entries.join(", ")
}

/// The request count of a `record` progress line
/// (`tokentrace: recording 12s/30s · 143 requests · …`).
fn requests_in_progress(line: &str) -> Option<usize> {
    let rest = line.split("recording ").nth(1)?;
    let field = rest.split(" · ").nth(1)?;
    field.strip_suffix(" requests")?.parse().ok()
}

/// trace.json: request track label → number of token instants.
fn request_tracks(trace: &Value) -> BTreeMap<String, usize> {
    let events = trace["traceEvents"]
        .as_array()
        .expect("trace.json has a traceEvents array");
    let mut names: BTreeMap<u64, String> = BTreeMap::new();
    let mut tokens: BTreeMap<u64, usize> = BTreeMap::new();
    for e in events.iter().filter(|e| e["pid"] == REQUESTS_PID) {
        let tid = e["tid"].as_u64().unwrap_or(0);
        match (e["ph"].as_str(), e["name"].as_str()) {
            (Some("M"), Some("thread_name")) => {
                let label = e["args"]["name"].as_str().unwrap_or_default().to_string();
                assert!(
                    names.insert(tid, label).is_none(),
                    "two names for request track {tid}"
                );
            }
            (Some("i"), Some("token")) => *tokens.entry(tid).or_default() += 1,
            _ => {}
        }
    }
    names
        .into_iter()
        .map(|(tid, label)| (label, tokens.get(&tid).copied().unwrap_or(0)))
        .collect()
}

/// Headless Chromium on `url` with `extra` flags, in a fresh profile.
fn chromium(url: &str, extra: &[String]) -> std::process::Output {
    let chromium = std::env::var("TOKENTRACE_TEST_CHROMIUM").unwrap_or_else(|_| "chromium".into());
    let profile = std::env::temp_dir().join(format!(
        "tt-chromium-{}-{}",
        std::process::id(),
        extra.len()
    ));
    let _ = std::fs::remove_dir_all(&profile);
    let output = Command::new(&chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--enable-logging=stderr",
            "--v=0",
            "--hide-scrollbars",
            "--window-size=1400,2600",
            "--virtual-time-budget=3000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(extra)
        .arg(url)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run {chromium} (apt-get install chromium; CI installs it): {e}")
        });
    let _ = std::fs::remove_dir_all(&profile);
    output
}

/// Renders report.html in headless Chromium: a screenshot kept as a test
/// artifact, no console message at all (the page logs nothing on
/// success), and the script's output present in the DOM.
fn check_report_in_chromium(report: &Path, screenshot: &Path) {
    let url = format!("file://{}", report.display());
    let shot = chromium(&url, &[format!("--screenshot={}", screenshot.display())]);
    let dom = chromium(&url, &["--dump-dom".to_string()]);
    let stderr = format!(
        "{}\n{}",
        String::from_utf8_lossy(&shot.stderr),
        String::from_utf8_lossy(&dom.stderr)
    );
    let console: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("CONSOLE") || l.contains("Uncaught"))
        .collect();
    assert!(
        console.is_empty(),
        "report.html logged to the console:\n{}",
        console.join("\n")
    );
    assert!(
        shot.status.success(),
        "chromium --screenshot failed:\n{stderr}"
    );
    let png = std::fs::metadata(screenshot).map(|m| m.len()).unwrap_or(0);
    assert!(
        png > 10_000,
        "screenshot {} is {png} bytes",
        screenshot.display()
    );
    let dom = String::from_utf8_lossy(&dom.stdout);
    for (what, needle) in [
        ("summary table", "<th>p95</th>"),
        ("waterfall", "class=\"tick\""),
        ("histogram", "class=\"bar\""),
        ("slowest requests", "<th>longest gap</th>"),
    ] {
        assert!(
            dom.contains(needle),
            "the rendered page has no {what} ({needle})"
        );
    }
    eprintln!(
        "[test] report rendered in chromium, screenshot {} ({png} B)",
        screenshot.display()
    );
}

/// Reads report.html's layout from the page Chromium rendered
/// (tests/fixtures/report_probe.html frames it at 1400 px, clicks a
/// waterfall row and "Whole session", and writes what it saw as JSON).
fn report_layout(report: &Path) -> Value {
    let dir = report.parent().expect("report dir");
    let probe = dir.join("report_probe.html");
    std::fs::copy(repo_root().join("tests/fixtures/report_probe.html"), &probe)
        .expect("copy the probe page");
    let out = chromium(
        &format!("file://{}", probe.display()),
        &[
            "--allow-file-access-from-files".to_string(),
            "--dump-dom".to_string(),
        ],
    );
    let dom = String::from_utf8_lossy(&out.stdout);
    let json = dom
        .split_once("<pre id=\"out\">")
        .and_then(|(_, rest)| rest.split_once("</pre>"))
        .map(|(json, _)| {
            json.replace("&amp;", "&")
                .replace("&lt;", "<")
                .replace("&gt;", ">")
        })
        .unwrap_or_else(|| panic!("the probe page wrote nothing:\n{dom}"));
    serde_json::from_str(&json).unwrap_or_else(|e| panic!("probe output {json}: {e}"))
}

/// The report read as a person would: the waterfall opens on the requests'
/// own span (from requests.jsonl, not the page's data) with the session's
/// axis one click away, a clicked row shows its phases, the columns that
/// matter in the slowest-requests table fit at 1400 px without scrolling,
/// and the captions say what the README says TTFT and socket wait are.
fn check_report_reads_at_a_glance(report: &Path, rows: &[Value], idle_s: f64) {
    let layout = report_layout(report);
    let num = |v: &Value| v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"));
    let starts: Vec<f64> = rows
        .iter()
        .map(|r| num(&r["request_start_ns"]) / 1e6)
        .collect();
    let ends: Vec<f64> = rows
        .iter()
        .map(|r| num(&r["request_start_ns"]) / 1e6 + num(&r["e2e_ms"]))
        .collect();
    let first = starts.iter().copied().fold(f64::INFINITY, f64::min);
    let last = ends.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let requests_ms = last - first;
    let width = |v: &Value| num(&v["to_ms"]) - num(&v["from_ms"]);
    let view = &layout["requests"];
    eprintln!(
        "[test] report: requests span {requests_ms:.1} ms; waterfall opens on {:.1}–{:.1} ms ({:?}), whole session {:.1} ms",
        num(&view["from_ms"]),
        num(&view["to_ms"]),
        view["ticks"],
        width(&layout["session"])
    );
    assert!(
        width(view) >= requests_ms - 0.01 && width(view) <= requests_ms * 1.05 + 1.0,
        "the waterfall's default axis ({} ms wide) should span the requests ({requests_ms:.1} ms)",
        width(view)
    );
    assert!(
        width(&layout["session"]) >= requests_ms + idle_s * 1000.0,
        "'Whole session' ({} ms) should show the idle {idle_s} s before the requests too",
        width(&layout["session"])
    );
    let ticks = view["ticks"].as_array().map_or(0, Vec::len);
    assert!(ticks >= 3, "the zoomed axis has {ticks} tick labels");
    let detail = layout["detail"].as_str().unwrap_or_default();
    for part in ["#", "reading", "TTFT", "E2E", "tokens"] {
        assert!(
            detail.contains(part),
            "a clicked row's phases should name {part:?}: {detail}"
        );
    }
    let visible = num(&layout["visible_width"]);
    let columns = layout["columns"].as_array().expect("columns");
    for name in [
        "TTFT",
        "in the socket",
        "to first token",
        "longest gap",
        "in that gap",
    ] {
        let column = columns
            .iter()
            .find(|c| c["name"] == name)
            .unwrap_or_else(|| panic!("no column {name:?} in {columns:?}"));
        assert!(
            num(&column["right"]) <= visible,
            "column {name:?} ends at {} px, past the {visible} px visible without scrolling",
            column["right"]
        );
    }
    // The README's definitions, and the captions that restate them.
    let readme = read(&repo_root().join("README.md"));
    assert!(
        readme.contains("**Request start is when the request's first byte reached the host**"),
        "README's definition of the request start moved: update this check and the report's captions"
    );
    let captions: Vec<&str> = layout["captions"]
        .as_array()
        .expect("captions")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let ttft = captions
        .iter()
        .find(|c| c.starts_with("Requests per TTFT bucket"))
        .expect("the histogram's caption");
    assert!(
        ttft.contains("first byte reaching the host"),
        "the TTFT caption contradicts the README: {ttft}"
    );
    for caption in &captions {
        assert!(
            !caption.contains("read by the server to the first token"),
            "a caption still times TTFT from the server's read: {caption}"
        );
        if caption.contains("in the socket (") {
            assert!(
                caption.contains("arrival at the host → the server's first read")
                    || caption.contains("arrival → the server's first read"),
                "socket wait should be arrival at the host → the server's first read: {caption}"
            );
        }
    }
}

#[test]
fn progress_lines_parse() {
    assert_eq!(
        requests_in_progress(
            "tokentrace: recording 5s/120s · 48 requests · TTFT p50 40.1 ms p95 -"
        ),
        Some(48)
    );
    assert_eq!(requests_in_progress("tokentrace: ready"), None);
}

#[test]
fn root_record_session_under_load_then_replay_and_render() {
    require_root("root_record_session_under_load_then_replay_and_render");
    let lib = build_hot_lib();
    let (server, port) = start_hot_server(&lib);
    let out = fresh_dir("record");
    let mut record = start_record(server.child.id(), &out, &["--raw", "--profile-hz", "199"]);
    // Nothing for a while first: the report must open on the requests, not
    // on the session's empty start.
    let idle = Duration::from_secs(3);
    thread::sleep(idle);

    // Load: 48 streams, 6 at a time, each 12 tokens (+ a usage chunk).
    let mut run = ClientRun::sse(48, 6, "rec-");
    run.token_delay_ms = 10.0;
    run.ttft_ms = 30.0;
    let t0 = Instant::now();
    let client = run_client(port, &run);
    eprintln!(
        "[test] client: {} requests in {:.2} s",
        client.len(),
        t0.elapsed().as_secs_f64()
    );
    assert_eq!(client.len(), 48);
    assert!(
        client.iter().all(|c| c.status == Some(200)),
        "every request succeeded"
    );
    // On a loaded 2-core machine the agent can lag the client by a second
    // or more: stop once the session has seen every request (its progress
    // line, every 5 s when stderr is not a terminal).
    let total = client.len();
    record.wait_for(
        &format!("a progress line with {total} requests"),
        |line| requests_in_progress(line).is_some_and(|n| n >= total),
        Duration::from_secs(60),
    );

    // Ctrl-C ends the session early; the artifacts are still written.
    let stopped = Instant::now();
    record.signal(libc::SIGINT);
    let status = record.wait_exit(Duration::from_secs(60));
    assert!(
        status.success(),
        "record exited with {status}:\n{}",
        record.seen.join("\n")
    );
    eprintln!(
        "[test] record wrote its artifacts {:.2} s after SIGINT: {}",
        stopped.elapsed().as_secs_f64(),
        sizes(&out)
    );
    for name in [
        "report.html",
        "trace.json",
        "requests.csv",
        "requests.jsonl",
        "flame.svg",
        "raw.pb",
    ] {
        let len = std::fs::metadata(out.join(name))
            .map(|m| m.len())
            .unwrap_or(0);
        assert!(len > 0, "{name} missing or empty in {}", out.display());
    }

    // requests.csv: one row per request sent
    let csv = read(&out.join("requests.csv"));
    assert_eq!(
        csv.lines().count() - 1,
        client.len(),
        "requests.csv rows vs requests sent"
    );

    // trace.json: one track per request, one token instant per chunk
    let trace: Value =
        serde_json::from_str(&read(&out.join("trace.json"))).expect("trace.json is JSON");
    let tracks = request_tracks(&trace);
    assert_eq!(tracks.len(), client.len(), "one track per request");
    for c in &client {
        let (label, tokens) = tracks
            .iter()
            .find(|(label, _)| label.contains(&format!(" {} ", c.path)))
            .unwrap_or_else(|| panic!("no track for {}", c.path));
        assert_eq!(
            *tokens as u64, c.chunks,
            "{label}: token instants vs chunks the client received"
        );
    }

    // requests.jsonl: complete, nothing aborted
    let jsonl = read(&out.join("requests.jsonl"));
    let rows: Vec<Value> = jsonl
        .lines()
        .map(|l| serde_json::from_str(l).expect("requests.jsonl line"))
        .collect();
    assert_eq!(rows.len(), client.len());
    assert!(
        rows.iter().all(|r| r["aborted"] == false),
        "no request aborted"
    );

    // flame.svg: the server's hot native function
    let flame = read(&out.join("flame.svg"));
    let hot = flame.matches(HOT_FUNCTION).count();
    assert!(
        hot > 0,
        "flame.svg does not show {HOT_FUNCTION}; it has {} bytes",
        flame.len()
    );

    // replay of raw.pb reproduces the outputs
    let replayed = fresh_dir("replay");
    let raw = out.join("raw.pb").display().to_string();
    let replay_out = replayed.display().to_string();
    let replay = tokentrace(&["replay", &raw, "--out", &replay_out])
        .output()
        .expect("run tokentrace replay");
    assert!(
        replay.status.success(),
        "replay failed: {}",
        String::from_utf8_lossy(&replay.stderr)
    );
    assert_eq!(
        read(&replayed.join("requests.jsonl")),
        jsonl,
        "replayed requests.jsonl"
    );
    assert_eq!(
        read(&replayed.join("requests.csv")),
        csv,
        "replayed requests.csv"
    );
    assert_eq!(
        read(&replayed.join("trace.json")),
        read(&out.join("trace.json")),
        "replayed trace.json"
    );
    assert_eq!(
        read(&replayed.join("flame.svg")),
        flame,
        "replayed flame.svg"
    );

    check_report_in_chromium(&out.join("report.html"), &out_root().join("report.png"));
    check_report_reads_at_a_glance(&out.join("report.html"), &rows, idle.as_secs_f64());
    drop(server);
}

#[test]
fn root_remote_session_against_a_running_daemon() {
    require_root("root_remote_session_against_a_running_daemon");
    let server = start_server(ServerKind::Stdlib, &[]);
    let dir = fresh_dir("remote");
    let token = dir.join("token");
    std::fs::write(&token, "test-token-123\n").expect("token file");
    let mut agent = start_agent(&[
        "--pid".into(),
        server.pid().to_string(),
        "--duration".into(),
        "300s".into(),
        "--control-addr".into(),
        "127.0.0.1:0".into(),
        "--control-token-file".into(),
        token.display().to_string(),
        "--session-dir".into(),
        dir.join("sessions").display().to_string(),
    ]);
    let control = agent
        .proc
        .stderr
        .lines()
        .iter()
        .find_map(|l| {
            l.split("control endpoint at ")
                .nth(1)
                .map(|url| url.trim().to_string())
        })
        .expect("the daemon announces its control endpoint");
    eprintln!("[test] daemon control endpoint {control}");

    let out = dir.join("out");
    let out_arg = out.display().to_string();
    let pid = server.pid().to_string();
    let token_arg = token.display().to_string();
    let mut record = Running::spawn(
        "tokentrace record --remote",
        &mut tokentrace(&[
            "record",
            "--remote",
            &control,
            "--token-file",
            &token_arg,
            "--pid",
            &pid,
            "--duration",
            "120s",
            "--out",
            &out_arg,
        ]),
    );
    record.wait_line("started on", Duration::from_secs(30));
    let mut run = ClientRun::sse(12, 3, "remote-");
    run.token_delay_ms = 10.0;
    let client = run_client(server.port, &run);
    assert_eq!(client.len(), 12);

    // normal output went on undisturbed: every request printed by the
    // daemon (the session got each batch before the daemon stitched it)
    let missing = agent.wait_for_paths(&paths(&client), Duration::from_secs(30));
    assert!(missing.is_empty(), "the daemon did not report {missing:?}");

    // Ctrl-C stops the remote session early; it still renders and the
    // client downloads its artifacts.
    record.signal(libc::SIGINT);

    let status = record.wait_exit(Duration::from_secs(60));
    assert!(
        status.success(),
        "record --remote exited with {status}:\n{}",
        record.seen.join("\n")
    );
    eprintln!("[test] downloaded: {}", sizes(&out));
    for name in [
        "report.html",
        "trace.json",
        "requests.csv",
        "requests.jsonl",
        "flame.svg",
    ] {
        assert!(out.join(name).is_file(), "{name} not downloaded");
    }
    assert!(
        record.seen.iter().any(|l| l.contains("stopping session")),
        "record --remote did not stop the session on SIGINT"
    );
    let csv = read(&out.join("requests.csv"));
    assert_eq!(
        csv.lines().count() - 1,
        client.len(),
        "requests.csv rows; record said:\n{}\nrequests.csv:\n{csv}",
        record.seen.join("\n")
    );
    let tracks = request_tracks(
        &serde_json::from_str(&read(&out.join("trace.json"))).expect("trace.json is JSON"),
    );
    assert_eq!(tracks.len(), client.len());

    // the artifacts stay downloadable from the daemon's session directory
    let sessions: Vec<PathBuf> = std::fs::read_dir(dir.join("sessions"))
        .expect("session dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    assert_eq!(sessions.len(), 1, "{sessions:?}");
    assert!(sessions[0].join("report.html").is_file());

    let stop = agent.stop();
    assert!(stop.is_some_and(|s| s.success()), "daemon exit {stop:?}");
}

/// The unprivileged user the control-endpoint test acts as (created if
/// missing: a system account without a home or a login shell).
const UNPRIVILEGED: &str = "tokentrace-test-nobody";

fn ensure_unprivileged_user() {
    let exists = Command::new("id")
        .arg(UNPRIVILEGED)
        .output()
        .is_ok_and(|o| o.status.success());
    if !exists {
        let out = Command::new("useradd")
            .args([
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                UNPRIVILEGED,
            ])
            .output()
            .expect("running useradd");
        assert!(
            out.status.success(),
            "useradd {UNPRIVILEGED} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Runs `cmd` as the unprivileged user; returns (success, stdout+stderr).
fn as_unprivileged(cmd: &[&str]) -> (bool, String) {
    let out = Command::new("runuser")
        .args(["-u", UNPRIVILEGED, "--"])
        .args(cmd)
        .current_dir("/")
        .env_remove("TOKENTRACE_CONTROL_TOKEN")
        .output()
        .expect("running runuser");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// `tokentrace run` with default control settings: only root gets in. An
/// unprivileged local user can neither read the generated token nor use
/// the endpoint without it (`record --remote` is refused with 401); root,
/// with the token, can.
#[test]
fn root_control_endpoint_refuses_an_unprivileged_user() {
    require_root("root_control_endpoint_refuses_an_unprivileged_user");
    ensure_unprivileged_user();
    let server = start_server(ServerKind::Stdlib, &[]);
    let dir = fresh_dir("control-auth");
    let sessions = dir.join("sessions");
    let mut agent = start_agent(&[
        "--pid".into(),
        server.pid().to_string(),
        "--duration".into(),
        "120s".into(),
        "--control-addr".into(),
        "127.0.0.1:0".into(),
        "--session-dir".into(),
        sessions.display().to_string(),
    ]);
    let stderr = agent.proc.stderr.lines();
    let control = stderr
        .iter()
        .find_map(|l| {
            l.split("control endpoint at ")
                .nth(1)
                .map(|u| u.trim().to_string())
        })
        .expect("the daemon announces its control endpoint");
    let token_path = sessions.join("control.token");
    assert!(
        stderr
            .iter()
            .any(|l| l.contains(&format!("control token in {}", token_path.display()))),
        "the daemon names its token file:\n{}",
        stderr.join("\n")
    );
    // the file is 0600 in a 0700 directory, both root's
    let (read_ok, read_out) = as_unprivileged(&["cat", &token_path.display().to_string()]);
    assert!(
        !read_ok,
        "{UNPRIVILEGED} read the control token: {read_out}"
    );
    eprintln!(
        "[test] {UNPRIVILEGED} reading the token: {}",
        read_out.trim()
    );

    let bin = agent_bin().display().to_string();
    let out = format!("/tmp/tokentrace-test-unpriv-{}", std::process::id());
    let pid = server.pid().to_string();
    let (ok, text) = as_unprivileged(&[
        &bin,
        "record",
        "--remote",
        &control,
        "--pid",
        &pid,
        "--duration",
        "2s",
        "--out",
        &out,
    ]);
    eprintln!("[test] {UNPRIVILEGED}: record --remote: {}", text.trim());
    assert!(!ok, "{UNPRIVILEGED} started a session: {text}");
    assert!(
        text.contains("401"),
        "refused for the token, not something else: {text}"
    );
    assert!(!Path::new(&out).join("report.html").exists());

    // root, with the generated token, gets in
    let token = read(&token_path).trim().to_string();
    let addr = control.trim_start_matches("http://").to_string();
    let mut stream = std::net::TcpStream::connect(&addr).expect("connect");
    use std::io::{Read, Write};
    write!(
        stream,
        "GET /v1/sessions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut reply = String::new();
    stream.read_to_string(&mut reply).expect("reply");
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    let stop = agent.stop();
    assert!(stop.is_some_and(|s| s.success()), "daemon exit {stop:?}");
    let _ = std::fs::remove_dir_all(&out);
}

/// A thread's last switch-out is its death; its off-CPU start must not be
/// kept for it. tests/servers/tid_reuse.py lets a thread die, waits 300 ms
/// and has the kernel hand its id to a new thread of the same process
/// (`ns_last_pid`, root). A start kept from the death made the new
/// thread's first switch-in an off-CPU interval from the old thread's
/// death (~300 ms, before the new thread existed), in the recorded trace
/// and to the explainer.
#[test]
fn root_a_thread_id_reused_after_its_owner_died_inherits_no_off_cpu_time() {
    require_root("root_a_thread_id_reused_after_its_owner_died_inherits_no_off_cpu_time");
    let mut target = Running::spawn(
        "tid_reuse.py",
        Command::new(python())
            .arg("tests/servers/tid_reuse.py")
            .current_dir(repo_root()),
    );
    target.wait_line("READY", Duration::from_secs(30));
    let out = fresh_dir("tid-reuse");
    let mut record = start_record(target.child.id(), &out, &[]);
    target.signal(libc::SIGUSR1);
    let line = target.wait_for(
        "its JSON line",
        |l| l.starts_with('{'),
        Duration::from_secs(60),
    );
    let reuse: Value = serde_json::from_str(&line).expect("tid_reuse.py's JSON line");
    eprintln!("[test] tid_reuse.py: {reuse}");
    let (Some(tid), Some(created)) = (reuse["tid"].as_u64(), reuse["created_ns"].as_u64()) else {
        panic!("no thread id was reused: {reuse}");
    };
    // the records of the last switches reach the session (50 ms polls)
    thread::sleep(Duration::from_millis(500));
    record.signal(libc::SIGINT);
    let status = record.wait_exit(Duration::from_secs(60));
    assert!(status.success(), "record exited with {status}");

    let trace: Value = serde_json::from_str(&read(&out.join("trace.json"))).expect("trace.json");
    let base = trace["otherData"]["session_start_monotonic_ns"]
        .as_u64()
        .expect("session_start_monotonic_ns");
    let pid = u64::from(target.child.id());
    let off_cpu: Vec<(u64, u64)> = trace["traceEvents"]
        .as_array()
        .expect("traceEvents")
        .iter()
        .filter(|e| e["cat"] == "off_cpu" && e["pid"] == pid && e["tid"] == tid)
        .map(|e| {
            let at = |us: &Value| (us.as_f64().expect("a time in µs") * 1_000.0) as u64;
            let start = base + at(&e["ts"]);
            (start, start + at(&e["dur"]))
        })
        .collect();
    eprintln!(
        "[test] off-CPU slices of tid {tid} (ms from the new thread's creation): {:?}",
        off_cpu
            .iter()
            .map(|&(s, e)| (
                (s as f64 - created as f64) / 1e6,
                (e as f64 - created as f64) / 1e6
            ))
            .collect::<Vec<_>>()
    );
    assert!(
        off_cpu.iter().any(|&(_, end)| end < created),
        "the dead thread's 20 ms sleep was not recorded: the session saw no off-CPU time on \
         tid {tid}, so this test would show nothing"
    );
    // The new thread starts after `created`; the old one slept before it.
    let straddling: Vec<_> = off_cpu
        .iter()
        .filter(|&&(start, end)| start < created && end > created)
        .collect();
    assert!(
        straddling.is_empty(),
        "tid {tid}'s new thread was reported off CPU from before it existed (the old thread's \
         death): {straddling:?}, created at {created}"
    );
}
