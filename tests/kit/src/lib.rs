//! The test kit: what the root-only integration tests (`tests/*.rs`, 21
//! binaries of the agent crate) and `cargo xtask` (bench, soak, demo, …)
//! share. It owns starting and waiting for the real processes they measure:
//! the Python test servers (`READY <port>`), the agent (`tokentrace run`,
//! which loads eBPF and so needs root, ready at `tokentrace: ready`), vLLM
//! ([`vllm`]), the rotel OTLP collector ([`otel`]), nginx ([`nginx`]), the
//! measuring clients; throw-away TLS certificates ([`tls`]); free ports;
//! the children's output kept for failure reports; and the comparisons the
//! tests make of what the agent saw with what the client measured.
//!
//! It does not depend on the agent crate (a change in `agent/src` rebuilds
//! no kit): the agent is the binary [`agent_bin`] finds at run time.
//!
//! Errors: what xtask calls returns `anyhow::Result` with context; the
//! test-facing helpers on top of it panic with that message (a test fails,
//! never skips).
//!
//! Every child process lives in a guard that SIGKILLs it on drop, so nothing
//! outlives a panicking test. When a test panics, the guards print the tail
//! of the agent's and the server's stderr.
//!
//! Clocks: the client stamps with Python's `time.monotonic_ns()`
//! (CLOCK_MONOTONIC), the agent with `bpf_ktime_get_ns()` (CLOCK_MONOTONIC):
//! both are on one time line, so per-chunk times compare directly.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use serde_json::Value;

pub mod h2;
pub mod http;
pub mod nginx;
pub mod otel;
pub mod rotel;
pub mod tls;
pub mod tls_wire;
pub mod vllm;
pub mod wire;

/// Panics unless running as root: these tests load eBPF programs. They must
/// fail, not skip, when run unprivileged (CI runs them as root).
pub fn require_root(test: &str) {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert!(
        euid == 0,
        "{test} needs root: run as root (CI does), e.g. `sudo -E cargo test -p tokentrace --test <name> -- --test-threads=1`; \
         it loads eBPF programs into the kernel (euid is {euid}). It does not skip."
    );
}

/// A KiB figure of `pid`'s /proc status (`field`: "VmRSS", "VmHWM", ...);
/// None when the process or the field is gone.
pub fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Ids of the BPF programs `pid` holds open (`prog_id:` in its fdinfo).
pub fn program_ids(pid: u32) -> std::collections::BTreeSet<u64> {
    fdinfo_ids(pid, "prog_id:")
}

/// Ids of the BPF maps `pid` holds open (`map_id:` in its fdinfo), each
/// once however many fds of it the process has.
pub fn map_ids(pid: u32) -> std::collections::BTreeSet<u64> {
    fdinfo_ids(pid, "map_id:")
}

/// The `field` ids found in the fdinfo of `pid`'s open files.
fn fdinfo_ids(pid: u32, field: &str) -> std::collections::BTreeSet<u64> {
    let dir = format!("/proc/{pid}/fdinfo");
    let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{dir}: {e}"));
    entries
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .filter_map(|info| {
            info.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|id| id.trim().parse().ok())
        })
        .collect()
}

/// CLOCK_MONOTONIC in ns, the clock of bpf_ktime_get_ns and of Python's
/// time.monotonic_ns().
pub fn mono_now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_MONOTONIC) failed");
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

/// A TCP port nothing listens on now (the kernel picked it for a socket
/// that is closed again).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding a free port")
}

/// The workspace root: the nearest directory holding a `[workspace]`
/// Cargo.toml above the running package's manifest directory (cargo sets
/// `CARGO_MANIFEST_DIR` when it runs a test or `cargo xtask`), else above
/// this kit's own (tests/kit, when a binary is run by hand). The run-time
/// value comes first: a binary shared through a target directory may have
/// been built from another checkout.
pub fn repo_root() -> PathBuf {
    let kit = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let starts = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .into_iter()
        .chain([kit.clone()]);
    for start in starts {
        let root = start.ancestors().find(|dir| {
            std::fs::read_to_string(dir.join("Cargo.toml"))
                .is_ok_and(|toml| toml.lines().any(|l| l.trim() == "[workspace]"))
        });
        if let Some(root) = root {
            return root.to_path_buf();
        }
    }
    // tests/kit -> the repository
    kit.ancestors().nth(2).map_or(kit.clone(), PathBuf::from)
}

/// Where cargo puts builds: `$CARGO_TARGET_DIR` (relative to the workspace
/// root when relative), else `<root>/target`.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => repo_root().join(dir),
        _ => repo_root().join("target"),
    }
}

pub fn python() -> String {
    std::env::var("TOKENTRACE_TEST_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

/// The agent under test: `TOKENTRACE_TEST_AGENT` (another build's binary,
/// to measure it with the same tests), else the `tokentrace` cargo built
/// beside the running test (which is `<target>/<profile>/deps/<test>-<hash>`;
/// cargo builds the agent's binary into `<target>/<profile>` for its
/// integration tests). Panics saying how to get one when it is missing.
pub fn agent_bin() -> PathBuf {
    if let Some(agent) = std::env::var_os("TOKENTRACE_TEST_AGENT").filter(|a| !a.is_empty()) {
        return PathBuf::from(agent);
    }
    let exe = std::env::current_exe().expect("the running test's path (/proc/self/exe)");
    let beside = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(|profile| profile.join("tokentrace"));
    match beside {
        Some(bin) if bin.is_file() => bin,
        _ => panic!(
            "no tokentrace binary beside the running test ({}): run the tests through \
             `cargo test -p tokentrace` (it builds the binary), or set TOKENTRACE_TEST_AGENT \
             to an agent binary",
            exe.display()
        ),
    }
}

/// Whether an agent run with `--data-hooks auto` (the default) takes the
/// socket hooks on this kernel, as `tokentrace check` says ("socket hooks
/// ok"): then a connection's accept is dated by the server's first read or
/// write on it, not by accept()'s return.
pub fn socket_data_hooks() -> bool {
    let agent = agent_bin();
    let out = Command::new(&agent)
        .arg("check")
        .output()
        .unwrap_or_else(|e| panic!("running {} check: {e}", agent.display()));
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("socket hooks"))
        .unwrap_or_else(|| panic!("tokentrace check printed no socket hooks line:\n{text}"));
    line["socket hooks".len()..].trim_start().starts_with("ok ")
}

/// Lines of a child's stream, kept for failure reports.
#[derive(Clone, Default)]
pub struct LogTail(Arc<Mutex<Vec<String>>>);

impl LogTail {
    fn push(&self, line: String) {
        if let Ok(mut v) = self.0.lock() {
            v.push(line);
        }
    }
    pub fn lines(&self) -> Vec<String> {
        self.0.lock().map(|v| v.clone()).unwrap_or_default()
    }
    pub fn tail(&self, n: usize) -> String {
        let v = self.lines();
        let start = v.len().saturating_sub(n);
        v[start..].join("\n")
    }
}

/// A child process that is SIGKILLed and reaped on drop.
pub struct Proc {
    pub name: String,
    pub child: Child,
    pub stderr: LogTail,
    exited: Option<ExitStatus>,
}

impl Proc {
    /// Spawns `cmd` (stdin null, stdout discarded, stderr kept in the
    /// tail) as a guarded child.
    pub fn spawn(name: &str, cmd: &mut Command) -> Proc {
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Proc::guard(name, child)
    }

    /// Guards a child the caller spawned itself (to read its stdout);
    /// its stderr, if piped, is kept in the tail.
    pub fn guard(name: &str, mut child: Child) -> Proc {
        let stderr = pump_stderr(name, &mut child);
        Proc {
            name: name.to_string(),
            child,
            stderr,
            exited: None,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn signal(&self, sig: i32) {
        if self.exited.is_none() {
            // SAFETY: plain kill(2) on our own child's pid.
            unsafe {
                libc::kill(self.child.id() as libc::pid_t, sig);
            }
        }
    }

    pub fn try_exit(&mut self) -> Option<ExitStatus> {
        if self.exited.is_none() {
            if let Ok(Some(st)) = self.child.try_wait() {
                self.exited = Some(st);
            }
        }
        self.exited
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.try_exit() {
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn kill(&mut self) {
        if self.try_exit().is_none() {
            let _ = self.child.kill();
            if let Ok(st) = self.child.wait() {
                self.exited = Some(st);
            }
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let was_running = self.try_exit().is_none();
        self.kill();
        if thread::panicking() {
            eprintln!(
                "---- {} (pid {}, {}) stderr tail ----\n{}\n---- end {} ----",
                self.name,
                self.child.id(),
                if was_running {
                    "killed by the test guard"
                } else {
                    "had exited"
                },
                self.stderr.tail(60),
                self.name
            );
        }
    }
}

fn pump_stderr(name: &str, child: &mut Child) -> LogTail {
    let tail = LogTail::default();
    if let Some(err) = child.stderr.take() {
        let t = tail.clone();
        let name = name.to_string();
        thread::Builder::new()
            .name(format!("{name}-stderr"))
            .spawn(move || {
                for line in BufReader::new(err).lines() {
                    match line {
                        Ok(l) => t.push(l),
                        Err(_) => break,
                    }
                }
            })
            .expect("spawn stderr reader thread");
    }
    tail
}

/// Which test server to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerKind {
    /// tests/servers/fastapi_app.py (FastAPI + uvicorn, asyncio).
    FastApi,
    /// tests/servers/stdlib_sse.py (http.server, threads, framing in
    /// separate writes).
    Stdlib,
}

pub struct Server {
    pub proc: Proc,
    pub port: u16,
    pub kind: ServerKind,
}

impl Server {
    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }
}

/// Starts a test server on a free port (`--port 0`) and waits for its
/// `READY <port>` line.
pub fn start_server(kind: ServerKind, extra: &[&str]) -> Server {
    let script = match kind {
        ServerKind::FastApi => "tests/servers/fastapi_app.py",
        ServerKind::Stdlib => "tests/servers/stdlib_sse.py",
    };
    let mut cmd = python_on_port(script, 0);
    cmd.args(extra);
    let (proc, port) = start_ready(
        script,
        &mut cmd,
        "is fastapi/uvicorn/sse-starlette installed? pip install fastapi uvicorn sse-starlette",
    );
    Server { proc, port, kind }
}

/// `python3 -u <repo>/<script> --host 127.0.0.1 --port <port>`: how every
/// Python test server (port 0: a free one) and measuring client starts.
pub fn python_on_port(script: &str, port: u16) -> Command {
    let mut cmd = Command::new(python());
    cmd.arg("-u").arg(repo_root().join(script)).args([
        "--host",
        "127.0.0.1",
        "--port",
        &port.to_string(),
    ]);
    cmd
}

/// The lines a child prints on stdout, through a channel.
pub fn stdout_lines(child: &mut Child) -> Receiver<String> {
    let out = child.stdout.take().expect("stdout is piped");
    let (tx, rx) = mpsc::channel::<String>();
    thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(l) = line else { break };
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    rx
}

/// `cmd` spawned in the repository root with `stdin`, and stdout and
/// stderr piped: the caller reads stdout, [`Proc::guard`] keeps stderr.
pub fn spawn_piped(cmd: &mut Command, stdin: Stdio) -> std::io::Result<Child> {
    cmd.current_dir(repo_root())
        .stdin(stdin)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
}

/// Spawns `cmd` (in the repository root) as the guarded child `name` and
/// waits (30 s) for its `READY <port>` line; lines before it are passed
/// over. `hint` says what to install or build when it does not come.
pub fn start_ready(name: &str, cmd: &mut Command, hint: &str) -> (Proc, u16) {
    let mut child = spawn_piped(cmd, Stdio::null())
        .unwrap_or_else(|e| panic!("cannot start {name}: {e} ({hint})"));
    let rx = stdout_lines(&mut child);
    let mut proc = Proc::guard(name, child);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left.max(Duration::from_millis(1))) {
            Ok(line) => {
                if let Some(p) = line.strip_prefix("READY ") {
                    let port: u16 = p
                        .trim()
                        .parse()
                        .unwrap_or_else(|_| panic!("{name}: bad READY line {line:?}"));
                    eprintln!("[test] {name} ready on port {port}, pid {}", proc.pid());
                    return (proc, port);
                }
            }
            Err(e) => {
                let st = proc.wait_timeout(Duration::from_secs(2));
                panic!(
                    "{name} printed no READY line within 30 s ({e:?}, exit {st:?}; {hint}); stderr:\n{}",
                    proc.stderr.tail(40)
                );
            }
        }
    }
}

/// One JSON line of `tokentrace run --output json`, with its arrival time.
#[derive(Debug, Clone)]
pub struct AgentLine {
    pub at: Instant,
    /// CLOCK_MONOTONIC ns when the test read the line (same clock as the
    /// client's stamps and the agent's `request_start_ns`).
    pub mono_ns: u64,
    pub v: Value,
}

pub struct Agent {
    pub proc: Proc,
    rx: Receiver<AgentLine>,
    /// Server lines.
    pub lines: Vec<AgentLine>,
    /// Client lines (`span_kind: "client"`): traced processes' upstream
    /// calls.
    pub client_lines: Vec<AgentLine>,
    pub non_json: LogTail,
    pub ready_after: Duration,
}

/// Starts `tokentrace run <args> --output json` and waits (60 s) for
/// `tokentrace: ready` on its stderr.
pub fn start_agent(args: &[String]) -> Agent {
    start_agent_with_env(args, &[])
}

/// [`start_agent`] with extra environment variables. Inherited
/// `TOKENTRACE_*` (but the log level) and `OTEL_*` variables are removed
/// first, so a developer's or CI's environment cannot change what runs.
pub fn start_agent_with_env(args: &[String], env: &[(&str, &str)]) -> Agent {
    start_agent_under(&[], args, env)
}

/// [`start_agent_with_env`] run through `wrapper` (e.g. `setpriv … --`,
/// to hold only the capabilities a DaemonSet grants).
pub fn start_agent_under(wrapper: &[String], args: &[String], env: &[(&str, &str)]) -> Agent {
    let mut command = wrapper.to_vec();
    command.push(agent_bin().display().to_string());
    start_agent_command(&command, args, env)
}

/// `command run <args> --output json` (`command`: the agent's binary and
/// what runs it, e.g. `podman run … IMAGE`), waited for as
/// [`start_agent`] does.
pub fn start_agent_command(command: &[String], args: &[String], env: &[(&str, &str)]) -> Agent {
    let mut full: Vec<String> = vec!["run".into()];
    full.extend(args.iter().cloned());
    full.extend(["--output".to_string(), "json".to_string()]);
    eprintln!("[test] {} {}", command.join(" "), full.join(" "));
    let t0 = Instant::now();
    let (program, before) = command
        .split_first()
        .expect("a command to run the agent with");
    let mut cmd = Command::new(program);
    cmd.args(before);
    let bin = program;
    scrub_agent_env(&mut cmd);
    cmd.envs(env.iter().copied()).args(&full);
    let mut child =
        spawn_piped(&mut cmd, Stdio::null()).unwrap_or_else(|e| panic!("cannot start {bin}: {e}"));

    // stderr: keep every line, signal readiness
    let stderr = LogTail::default();
    let (ready_tx, ready_rx) = mpsc::channel::<()>();
    if let Some(err) = child.stderr.take() {
        let t = stderr.clone();
        thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(err).lines() {
                let Ok(l) = line else { break };
                // Kept before it is signalled: whoever is told `ready`
                // finds the line (and every one before it) in the tail.
                let is_ready = !sent && l.contains("tokentrace: ready");
                t.push(l);
                if is_ready {
                    let _ = ready_tx.send(());
                    sent = true;
                }
            }
        });
    }
    // stdout: one JSON object per line
    let non_json = LogTail::default();
    let (tx, rx) = mpsc::channel::<AgentLine>();
    if let Some(out) = child.stdout.take() {
        let nj = non_json.clone();
        thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(l) = line else { break };
                let at = Instant::now();
                let mono_ns = mono_now_ns();
                if l.trim().is_empty() {
                    continue;
                }
                match serde_json::from_str::<Value>(&l) {
                    Ok(v) if v.is_object() => {
                        if tx.send(AgentLine { at, mono_ns, v }).is_err() {
                            break;
                        }
                    }
                    _ => nj.push(l),
                }
            }
        });
    }
    let mut proc = Proc {
        name: "tokentrace".into(),
        child,
        stderr,
        exited: None,
    };
    let deadline = t0 + Duration::from_secs(60);
    loop {
        match ready_rx.recv_timeout(Duration::from_millis(100)) {
            Ok(()) => break,
            Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => {
                if let Some(st) = proc.try_exit() {
                    panic!(
                        "tokentrace exited ({st}) before printing `tokentrace: ready`; stderr:\n{}",
                        proc.stderr.tail(60)
                    );
                }
                if Instant::now() >= deadline {
                    panic!(
                        "tokentrace printed no `tokentrace: ready` on stderr within 60 s; stderr:\n{}",
                        proc.stderr.tail(60)
                    );
                }
            }
        }
    }
    let ready_after = t0.elapsed();
    eprintln!(
        "[test] agent ready after {:.2} s",
        ready_after.as_secs_f64()
    );
    Agent {
        proc,
        rx,
        lines: Vec::new(),
        client_lines: Vec::new(),
        non_json,
        ready_after,
    }
}

/// Removes the inherited `TOKENTRACE_*` (but the log level) and `OTEL_*`
/// variables from an agent's command: the CLI reads them as overrides, and a
/// developer's or CI's environment must not change what a test runs.
pub fn scrub_agent_env(cmd: &mut Command) {
    for (k, _) in std::env::vars_os() {
        let key = k.to_string_lossy();
        if (key.starts_with("TOKENTRACE_") && key != "TOKENTRACE_LOG") || key.starts_with("OTEL_") {
            cmd.env_remove(&k);
        }
    }
}

impl Agent {
    /// The `inference` part of the summary the agent printed at exit (its
    /// `{"tokentrace_summary": …}` line on stderr).
    pub fn inference_summary(&self) -> Value {
        self.summary_part("/tokentrace_summary/inference")
    }

    /// The part at JSON `pointer` of the summary the agent printed at exit.
    pub fn summary_part(&self, pointer: &str) -> Value {
        self.proc
            .stderr
            .lines()
            .iter()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find_map(|v| v.pointer(pointer).cloned())
            .unwrap_or_else(|| {
                panic!(
                    "no tokentrace_summary JSON line on the agent's stderr:\n{}",
                    self.proc.stderr.tail(30)
                )
            })
    }

    /// Standard arguments: trace the server's pid, stop by itself after 5
    /// minutes at the latest (the tests stop it with SIGINT much earlier).
    pub fn for_pids(pids: &[u32]) -> Vec<String> {
        let mut a = Vec::new();
        for p in pids {
            a.push("--pid".to_string());
            a.push(p.to_string());
        }
        a.push("--duration".into());
        a.push("300s".into());
        a
    }

    /// Trace the processes listening on `port` (`--port`).
    pub fn for_port(port: u16) -> Vec<String> {
        vec![
            "--port".into(),
            port.to_string(),
            "--duration".into(),
            "300s".into(),
        ]
    }

    fn drain(&mut self) {
        while let Ok(l) = self.rx.try_recv() {
            self.take(l);
        }
    }

    /// Collects lines until every path in `paths` has been reported or the
    /// timeout passes. Returns the paths still missing.
    pub fn wait_for_paths(
        &mut self,
        paths: &BTreeSet<String>,
        timeout: Duration,
    ) -> BTreeSet<String> {
        self.wait_for_values("path", paths, timeout)
    }

    /// Collects lines until one has each of `wanted` as its string field
    /// `key` (e.g. every `response_id`), or the timeout passes. Returns
    /// the values still missing.
    pub fn wait_for_values(
        &mut self,
        key: &str,
        wanted: &BTreeSet<String>,
        timeout: Duration,
    ) -> BTreeSet<String> {
        self.wait_for(
            timeout,
            |agent| {
                let seen: BTreeSet<String> = agent
                    .lines
                    .iter()
                    .filter_map(|l| str_field(&l.v, key))
                    .collect();
                wanted.difference(&seen).cloned().collect()
            },
            BTreeSet::is_empty,
        )
    }

    /// Waits for the first line whose `path` is `path`.
    pub fn wait_for_path(&mut self, path: &str, timeout: Duration) -> Option<AgentLine> {
        self.wait_for_field("path", path, timeout)
    }

    /// Waits for the first line whose string field `key` is `value`.
    fn wait_for_field(&mut self, key: &str, value: &str, timeout: Duration) -> Option<AgentLine> {
        self.wait_for(
            timeout,
            |agent| {
                agent
                    .lines
                    .iter()
                    .find(|l| str_field(&l.v, key).as_deref() == Some(value))
                    .cloned()
            },
            Option::is_some,
        )
    }

    /// The one wait loop of the helpers above and below: collects the
    /// agent's lines and judges them with `judge` until `done` holds for its
    /// verdict or `timeout` passes. If the agent exits meanwhile, what it
    /// printed before exiting is read (up to 2 s for the reader to reach
    /// EOF) and judged once more. Returns the last verdict.
    fn wait_for<T>(
        &mut self,
        timeout: Duration,
        judge: impl Fn(&Agent) -> T,
        done: impl Fn(&T) -> bool,
    ) -> T {
        let deadline = Instant::now() + timeout;
        loop {
            self.drain();
            let verdict = judge(self);
            if done(&verdict) || Instant::now() >= deadline {
                return verdict;
            }
            if self.proc.try_exit().is_some() {
                let until = Instant::now() + Duration::from_secs(2);
                while Instant::now() < until {
                    match self.rx.recv_timeout(Duration::from_millis(50)) {
                        Ok(l) => self.take(l),
                        Err(RecvTimeoutError::Disconnected) => break,
                        Err(RecvTimeoutError::Timeout) => {}
                    }
                }
                return judge(self);
            }
            if let Ok(l) = self.rx.recv_timeout(Duration::from_millis(50)) {
                self.take(l);
            }
        }
    }

    /// SIGINT, wait up to 15 s for exit, collect the remaining lines.
    pub fn stop(&mut self) -> Option<ExitStatus> {
        let t0 = Instant::now();
        let already = self.proc.try_exit();
        self.proc.signal(libc::SIGINT);
        let st = self.proc.wait_timeout(Duration::from_secs(15));
        match already {
            Some(s) => eprintln!("[test] agent had already exited ({s}) before SIGINT"),
            None => eprintln!(
                "[test] agent exited {:.2} s after SIGINT: {st:?}",
                t0.elapsed().as_secs_f64()
            ),
        }
        // The stdout reader ends at EOF: once the agent has exited, every
        // line it printed is read, however slow the box. The cap is for an
        // agent that did not exit (it is killed below).
        let cap = if st.is_some() || already.is_some() {
            Duration::from_secs(60)
        } else {
            Duration::from_secs(2)
        };
        let until = Instant::now() + cap;
        loop {
            match self.rx.recv_timeout(Duration::from_millis(50)) {
                Ok(l) => self.take(l),
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {
                    if Instant::now() >= until {
                        break;
                    }
                }
            }
        }
        if st.is_none() {
            eprintln!(
                "[test] tokentrace did not exit within 15 s of SIGINT; killing it. Threads:\n    {}",
                threads_report(self.proc.pid())
            );
            self.proc.kill();
        }
        st
    }

    /// The server lines (the requests the traced processes served).
    pub fn values(&self) -> Vec<Value> {
        self.lines.iter().map(|l| l.v.clone()).collect()
    }

    /// Every line, the traced processes' upstream calls
    /// (`span_kind: "client"`) included.
    pub fn all_values(&self) -> Vec<Value> {
        self.lines
            .iter()
            .chain(&self.client_lines)
            .map(|l| l.v.clone())
            .collect()
    }

    /// Files a line: upstream calls apart, so the suites that judge what a
    /// server served (one line per client request) see only those.
    fn take(&mut self, l: AgentLine) {
        if l.v.get("span_kind").and_then(Value::as_str) == Some("client") {
            self.client_lines.push(l);
        } else {
            self.lines.push(l);
        }
    }
}

/// Thread names, states and wait channels of a process, for hang reports.
pub fn threads_report(pid: u32) -> String {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return format!("(no /proc/{pid}/task)");
    };
    for t in dir.flatten() {
        let p = t.path();
        let comm = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
        let wchan = std::fs::read_to_string(p.join("wchan")).unwrap_or_default();
        let stat = std::fs::read_to_string(p.join("stat")).unwrap_or_default();
        let state = stat
            .rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().next())
            .unwrap_or("?")
            .to_string();
        let stack = std::fs::read_to_string(p.join("stack")).unwrap_or_default();
        let top: Vec<&str> = stack.lines().take(4).collect();
        out.push(format!(
            "tid {} {:<16} state {state} wchan {wchan} {}",
            t.file_name().to_string_lossy(),
            comm.trim(),
            top.join(" <- ")
        ));
    }
    out.sort();
    out.join("\n    ")
}

/// The CLI contract after SIGINT: exit status 0, only JSON on stdout.
pub fn check_agent_exit(agent: &Agent, stop: Option<ExitStatus>, report: &mut Report) {
    match stop {
        Some(s) if s.success() => {}
        other => report.failures.push(format!(
            "tokentrace should exit 0 after SIGINT, got {other:?} (None = still running after 15 s); stderr tail:\n{}",
            agent.proc.stderr.tail(20)
        )),
    }
    let nj = agent.non_json.lines();
    if !nj.is_empty() {
        report.failures.push(format!(
            "tokentrace printed non-JSON lines on stdout with --output json: {nj:?}"
        ));
    }
}

// ------------------------------------------------------------------ client

/// One request as tests/clients/stream_client.py measured it.
#[derive(Debug, Clone)]
pub struct ClientRecord {
    pub path: String,
    pub status: Option<u64>,
    pub response_id: Option<String>,
    pub chunks: u64,
    pub t_send_ns: Option<u64>,
    pub chunk_arrival_ns: Vec<u64>,
    pub server_write_ns: Vec<Option<u64>>,
    /// Server handler start (`X-Req-Mono-Ns`), after its read of the request.
    pub server_req_ns: Option<u64>,
    pub ttft_ns: Option<u64>,
    pub e2e_ns: Option<u64>,
    pub aborted: bool,
    pub error: Option<String>,
    pub body_kind: Option<String>,
    /// Worker-local sequence number of the request.
    pub seq: Option<u64>,
    /// Concurrency of the client run this request belonged to.
    pub concurrency: u32,
    /// The client spoke TLS to the server (`ClientRun::tls`); the agent's
    /// record must say the same.
    pub tls: bool,
    /// The client's end of the connection, "ip:port" (the server's peer).
    pub client_addr: Option<String>,
    pub raw: Value,
}

impl ClientRecord {
    /// The fields every measuring client prints under the same names
    /// (stream_client.py here, the HTTP/2 clients through [`h2::client_record`]).
    fn from_value(v: Value) -> Self {
        let u64s = |k: &str| -> Vec<u64> {
            v.get(k)
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(Value::as_u64).collect())
                .unwrap_or_default()
        };
        ClientRecord {
            path: str_field(&v, "path").unwrap_or_default(),
            status: v.get("status").and_then(Value::as_u64),
            response_id: str_field(&v, "response_id"),
            chunks: v.get("chunks").and_then(Value::as_u64).unwrap_or(0),
            t_send_ns: v.get("t_send_ns").and_then(Value::as_u64),
            chunk_arrival_ns: u64s("chunk_arrival_ns"),
            server_write_ns: v
                .get("server_write_ns")
                .and_then(Value::as_array)
                .map(|a| a.iter().map(Value::as_u64).collect())
                .unwrap_or_default(),
            server_req_ns: v.get("server_req_ns").and_then(Value::as_u64),
            ttft_ns: v.get("ttft_ns").and_then(Value::as_u64),
            e2e_ns: v.get("e2e_ns").and_then(Value::as_u64),
            aborted: v.get("aborted").and_then(Value::as_bool).unwrap_or(false),
            error: str_field(&v, "error"),
            body_kind: str_field(&v, "body_kind"),
            seq: v.get("seq").and_then(Value::as_u64),
            concurrency: 1,
            tls: false,
            client_addr: str_field(&v, "client_addr"),
            raw: v,
        }
    }
}

/// Arguments of one client run.
#[derive(Debug, Clone)]
pub struct ClientRun {
    pub path: &'static str,
    pub requests: u32,
    pub concurrency: u32,
    pub stream: bool,
    pub tokens: u32,
    pub token_delay_ms: f64,
    pub ttft_ms: f64,
    pub crash_after: Option<u32>,
    pub sse_impl: Option<&'static str>,
    pub rid_prefix: String,
    /// Send a fresh sampled W3C `traceparent` with every request (the
    /// client reports it in its record).
    pub traceparent: bool,
    /// HTTPS (`--tls`: stdlib ssl, no certificate checks).
    pub tls: bool,
}

impl ClientRun {
    pub fn sse(requests: u32, concurrency: u32, prefix: &str) -> Self {
        ClientRun {
            path: "/v1/chat/completions",
            requests,
            concurrency,
            stream: true,
            tokens: 12,
            token_delay_ms: 15.0,
            ttft_ms: 40.0,
            crash_after: None,
            sse_impl: None,
            rid_prefix: prefix.to_string(),
            traceparent: false,
            tls: false,
        }
    }
}

/// Runs the client to completion (3 min limit) and returns its records.
pub fn run_client(port: u16, run: &ClientRun) -> Vec<ClientRecord> {
    let mut cmd = python_on_port("tests/clients/stream_client.py", port);
    cmd.args(["--path", run.path])
        .args(["--requests", &run.requests.to_string()])
        .args(["--concurrency", &run.concurrency.to_string()])
        .arg(if run.stream {
            "--stream"
        } else {
            "--no-stream"
        })
        .args(["--tokens", &run.tokens.to_string()])
        .args(["--token-delay-ms", &run.token_delay_ms.to_string()])
        .args(["--ttft-ms", &run.ttft_ms.to_string()])
        .args(["--rid-prefix", &run.rid_prefix]);
    if let Some(k) = run.crash_after {
        cmd.args(["--crash-after", &k.to_string()]);
    }
    if run.traceparent {
        cmd.arg("--traceparent");
    }
    if run.tls {
        cmd.arg("--tls");
    }
    if let Some(s) = run.sse_impl {
        cmd.args(["--sse-impl", s]);
    }
    let records = run_to_records(
        "stream_client.py",
        &mut cmd,
        Duration::from_secs(180),
        run.requests as usize,
        run,
    );
    records
        .into_iter()
        .map(|v| {
            let mut r = ClientRecord::from_value(v);
            r.concurrency = run.concurrency;
            r.tls = run.tls;
            r
        })
        .collect()
}

/// Runs a measuring client (`name`, for messages) to completion within
/// `limit` and returns the JSON records it printed on stdout, one a line.
/// It must exit 0 and print exactly `expected` records; `what` (the run's
/// arguments) goes into the timeout message.
pub fn run_to_records(
    name: &str,
    cmd: &mut Command,
    limit: Duration,
    expected: usize,
    what: &dyn std::fmt::Debug,
) -> Vec<Value> {
    let mut child = spawn_piped(cmd, Stdio::null())
        .unwrap_or_else(|e| panic!("cannot start the client {name}: {e}"));
    let mut out = child.stdout.take().expect("client stdout is piped");
    // read concurrently, so a client with much to say never blocks on a
    // full pipe while we wait for it to exit
    let reader = thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let mut proc = Proc::guard(name, child);
    let Some(st) = proc.wait_timeout(limit) else {
        panic!(
            "{name} did not finish within {} s ({what:?})",
            limit.as_secs()
        );
    };
    let stdout = reader.join().unwrap_or_default();
    assert!(
        st.success(),
        "{name} failed ({st}); stderr:\n{}",
        proc.stderr.tail(40)
    );
    let records: Vec<Value> = stdout
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("{name} printed a bad JSON line {l:?}: {e}"))
        })
        .collect();
    assert_eq!(
        records.len(),
        expected,
        "{name} printed {} records for {expected} requests; stderr:\n{}",
        records.len(),
        proc.stderr.tail(40)
    );
    records
}

// ------------------------------------------------------------- comparison

pub fn str_field(v: &Value, k: &str) -> Option<String> {
    v.get(k).and_then(Value::as_str).map(str::to_string)
}

fn f64_field(v: &Value, k: &str) -> Option<f64> {
    v.get(k).and_then(Value::as_f64)
}

/// min/p50/p95/max of a sample, for the logs.
#[derive(Debug, Default, Clone)]
pub struct Dist {
    pub name: String,
    pub xs: Vec<f64>,
}

impl Dist {
    pub fn new(name: &str) -> Self {
        Dist {
            name: name.to_string(),
            xs: Vec::new(),
        }
    }
    pub fn push(&mut self, x: f64) {
        self.xs.push(x);
    }
    fn sorted(&self) -> Vec<f64> {
        let mut s = self.xs.clone();
        s.sort_by(|a, b| a.total_cmp(b));
        s
    }
    pub fn pct(&self, p: f64) -> f64 {
        let s = self.sorted();
        if s.is_empty() {
            return f64::NAN;
        }
        let i = ((p / 100.0) * (s.len() - 1) as f64).round() as usize;
        s[i.min(s.len() - 1)]
    }
    pub fn max(&self) -> f64 {
        self.sorted().last().copied().unwrap_or(f64::NAN)
    }
    pub fn min(&self) -> f64 {
        self.sorted().first().copied().unwrap_or(f64::NAN)
    }
    pub fn summary(&self) -> String {
        format!(
            "{:<44} n={:<5} min={:>8.3} p50={:>8.3} p95={:>8.3} p99={:>8.3} max={:>8.3} ms",
            self.name,
            self.xs.len(),
            self.min(),
            self.pct(50.0),
            self.pct(95.0),
            self.pct(99.0),
            self.max()
        )
    }
}

/// Bounds the comparison asserts (all in milliseconds).
///
/// Brackets, not distances. Every agent timestamp has a physical bracket
/// measured by someone else on the same clock (CLOCK_MONOTONIC):
///
///   client t_send  ≤  agent request_start  ≤  server handler start
///     (the client sends before the server's read returns; the server's
///     handler runs after it; `X-Req-Mono-Ns`)
///   server stamp   ≤  agent chunk emit     ≤  client arrival
///     (the server stamps just before the write; the agent takes the write's
///     entry; the client's recv returns after it)
///
/// A correct agent is inside every bracket whatever the scheduling noise,
/// so these are asserted for every request and every chunk (with `slack_ms`
/// for the agent's µs rounding). Noise only widens brackets. How tight the
/// agent is inside them is then measured two ways: against the client (what
/// users see: includes the request's wait in the socket before the server
/// reads it, and the client's wake-up) and against the server's own stamps
/// (the design's "server-side truth for tight assertions"). Neither is a
/// reference load cannot move: a Python server preempted between its read
/// and its handler's stamp, or between its stamp and its write, moves the
/// server-side one; the client's wake-up moves the other. So agreement is
/// judged on the distribution, not per request: at least `agree_fraction`
/// of the requests must have the better of the two within `ttft_abs_ms`
/// (client TTFT − agent TTFT, or agent TTFT − (server first-chunk stamp −
/// handler start)), and at least `chunk_agree_fraction` of the chunks an
/// emit within `chunk_close_ms` of the client's arrival or of the server's
/// stamp; the rest are printed as outliers. Medians must stay tight
/// (`*_p50_ms`), so a box too noisy to prove anything fails loudly.
#[derive(Debug, Clone)]
pub struct Tolerance {
    /// Rounding slack on bracket checks (the agent prints ms with 3
    /// decimals).
    pub slack_ms: f64,
    /// Per request: min(|client TTFT − agent TTFT|, |agent TTFT − server
    /// TTFT|) below this, for `agree_fraction` of the requests.
    pub ttft_abs_ms: f64,
    pub agree_fraction: f64,
    /// p50 over requests of that minimum.
    pub ttft_p50_ms: f64,
    /// Per chunk: min(client arrival − emit, emit − server stamp) below
    /// this, for `chunk_agree_fraction` of the chunks.
    pub chunk_close_ms: f64,
    pub chunk_agree_fraction: f64,
    /// p50 over chunks of client arrival − agent emit, and of agent emit −
    /// server stamp.
    pub arrival_minus_emit_p50_ms: f64,
    pub emit_minus_server_p50_ms: f64,
    /// The first request of every worker (and so of every connection) gets
    /// the bracket checks only, not the TTFT agreement bounds: in a burst of
    /// concurrent first requests no outside view is near the server's read
    /// (see ebpf_concurrency.rs), and the first request of a fresh TLS
    /// connection pays its session set-up in the server (seen: read 4.4 ms
    /// after the send, handler 3.2 ms after the read, on a quiet box).
    pub first_wave_exempt: bool,
}

impl Tolerance {
    /// Light load (≤ 4 concurrent streams) on a 2-core machine. Measured on
    /// a quiet box (8 scenarios, fastapi + http.server): |client ΔTTFT| p50
    /// 0.08–0.3 ms, max 0.7 ms apart from single 3–7 ms hiccups; chunk
    /// arrival − emit p50 0.1–0.2 ms, p99 ≤ 2 ms; emit − server stamp p50
    /// 0.02–0.2 ms. With other builds and test suites sharing the 2 cores,
    /// client-side deltas of 17–60 ms were seen (client starved), while the
    /// server-side ones stayed under 5 ms — mostly: with builds loading the
    /// box (load average 8) a TLS scenario had 1 of 28 requests at 4.5 ms
    /// both ways (nginx and the client both late). With `stress-ng --cpu 1`
    /// (ebpf_plaintext, ebpf_tls): up to 2 of 23-28 requests per scenario
    /// off both ways (a Python server preempted between its read and its
    /// handler's stamp, or its stamp and its write, while the client also
    /// waited), and up to 2 of 364 chunks (0.5 %); with a fuzz run busy on
    /// the other core as well, 3 of 23 requests (13 %). Hence fractions,
    /// not every request, with room over what was measured: 25 % and 3 %.
    pub fn light() -> Self {
        Tolerance {
            slack_ms: 0.01,
            ttft_abs_ms: 2.0,
            // 5-7 of 20-28 requests may be outliers
            agree_fraction: 0.75,
            ttft_p50_ms: 1.0,
            chunk_close_ms: 5.0,
            chunk_agree_fraction: 0.97,
            arrival_minus_emit_p50_ms: 1.0,
            emit_minus_server_p50_ms: 1.0,
            // The first request of each connection is bracket-checked only,
            // as in the TLS and concurrency suites: under `--stress` a fresh
            // uvicorn connection's handler started 7.6 ms after the read
            // the agent dates the request by, while the starved client was
            // 3.7 ms late too, so neither outside view was within 2 ms. The
            // first-token emit is still checked against the server's stamp
            // per chunk, and the request start against both brackets.
            first_wave_exempt: true,
        }
    }
}

/// What every matched request must look like.
#[derive(Debug, Clone)]
pub struct Expect {
    pub stream: bool,
    pub status: u64,
    /// The response carries an `"id"` (OpenAI JSON / SSE) the agent must
    /// report exactly.
    pub has_response_id: bool,
}

#[derive(Debug, Default)]
pub struct Report {
    pub failures: Vec<String>,
    pub matched: usize,
    /// client TTFT − agent TTFT
    pub ttft_client: Dist,
    /// agent TTFT − server TTFT (handler start → first chunk stamp)
    pub ttft_server: Dist,
    /// per request, the smaller of |client Δ| and |server Δ|
    pub ttft_best: Dist,
    /// agent request_start − client t_send
    pub read_wait: Dist,
    /// server handler start − agent request_start
    pub handler_after_read: Dist,
    pub arrival_minus_emit: Dist,
    pub emit_minus_server: Dist,
    /// client e2e − agent e2e (printed only)
    pub e2e_signed: Dist,
    /// Requests over `ttft_abs_ms` client-side that server-side truth vouches for.
    pub client_outliers: Vec<String>,
    /// Requests over `ttft_abs_ms` both ways, and how many requests were
    /// judged (first-wave exemptions excluded).
    pub ttft_outliers: Vec<String>,
    pub ttft_judged: usize,
    /// Chunks farther than `chunk_close_ms` from both references, and how
    /// many chunks were judged.
    pub chunk_outliers: Vec<String>,
    pub chunks_judged: usize,
    /// `ttft_best` of first-wave requests exempted by `first_wave_exempt`.
    pub first_wave_best: Dist,
}

impl Report {
    pub fn new() -> Self {
        Report {
            ttft_client: Dist::new("TTFT: client - agent"),
            ttft_server: Dist::new("TTFT: agent from read - server (handler->1st)"),
            ttft_best: Dist::new("TTFT: min(|client d|, |server d|)"),
            read_wait: Dist::new("agent request_start - client t_send"),
            handler_after_read: Dist::new("server handler start - agent req start"),
            arrival_minus_emit: Dist::new("chunk: client arrival - agent emit"),
            emit_minus_server: Dist::new("chunk: agent emit - server stamp"),
            e2e_signed: Dist::new("e2e: client - agent"),
            first_wave_best: Dist::new("TTFT: min(..), first wave (not asserted)"),
            ..Default::default()
        }
    }

    pub fn print(&self, title: &str) {
        eprintln!("==== {title}: {} requests matched ====", self.matched);
        for d in [
            &self.ttft_client,
            &self.ttft_server,
            &self.ttft_best,
            &self.first_wave_best,
            &self.read_wait,
            &self.handler_after_read,
            &self.arrival_minus_emit,
            &self.emit_minus_server,
            &self.e2e_signed,
        ] {
            if !d.xs.is_empty() {
                eprintln!("  {}", d.summary());
            }
        }
        for (what, outliers, judged) in [
            (
                "request(s) off both ways (not failures within the agreement fraction)",
                &self.ttft_outliers,
                self.ttft_judged,
            ),
            (
                "chunk(s) far from both references",
                &self.chunk_outliers,
                self.chunks_judged,
            ),
        ] {
            if !outliers.is_empty() {
                eprintln!(
                    "  {} of {judged} {what}:\n    {}",
                    outliers.len(),
                    outliers
                        .iter()
                        .take(10)
                        .cloned()
                        .collect::<Vec<_>>()
                        .join("\n    ")
                );
            }
        }
        if !self.client_outliers.is_empty() {
            eprintln!(
                "  {} request(s) over the TTFT bound client-side, within it server-side (client starved or request queued in the socket):\n    {}",
                self.client_outliers.len(),
                self.client_outliers.join("\n    ")
            );
        }
    }

    /// Median checks: the brackets must be tight enough to mean something;
    /// and the agreement fractions.
    pub fn apply_budgets(&mut self, tol: &Tolerance) {
        for (what, outliers, judged, fraction) in [
            (
                "requests",
                &self.ttft_outliers,
                self.ttft_judged,
                tol.agree_fraction,
            ),
            (
                "chunks",
                &self.chunk_outliers,
                self.chunks_judged,
                tol.chunk_agree_fraction,
            ),
        ] {
            // how many may be outliers: the fraction's complement, rounded down
            let allowed = ((1.0 - fraction) * judged as f64 + 1e-9).floor() as usize;
            if outliers.len() > allowed {
                self.failures.push(format!(
                    "{} of {judged} {what} outside the agreement bound (at most {allowed} may be, {:.0} % must agree):\n    {}",
                    outliers.len(),
                    fraction * 100.0,
                    outliers.iter().take(20).cloned().collect::<Vec<_>>().join("\n    ")
                ));
            }
        }
        for (d, bound) in [
            (&self.ttft_best, tol.ttft_p50_ms),
            (&self.arrival_minus_emit, tol.arrival_minus_emit_p50_ms),
            (&self.emit_minus_server, tol.emit_minus_server_p50_ms),
        ] {
            if !d.xs.is_empty() {
                let p50 = d.pct(50.0);
                if p50 > bound {
                    self.failures.push(format!(
                        "p50 of {} is {p50:.3} ms > {bound} ms (agent mis-timing, or a box too loaded to measure)",
                        d.name
                    ));
                }
            }
        }
    }

    /// Panics with every failure (first 40) when there is any.
    pub fn assert_ok(&self, title: &str) {
        if !self.failures.is_empty() {
            let n = self.failures.len();
            let shown: Vec<&str> = self.failures.iter().take(40).map(String::as_str).collect();
            panic!("{title}: {n} check(s) failed:\n  {}", shown.join("\n  "));
        }
    }
}

/// Groups agent records by `path`.
pub fn by_path(agent: &[Value]) -> BTreeMap<String, Vec<Value>> {
    group_by(agent, "path")
}

/// Groups agent records by the string field `key` (`<no KEY>` for records
/// without it).
pub fn group_by(agent: &[Value], key: &str) -> BTreeMap<String, Vec<Value>> {
    let mut m: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for v in agent {
        m.entry(str_field(v, key).unwrap_or_else(|| format!("<no {key}>")))
            .or_default()
            .push(v.clone());
    }
    m
}

/// Compares every client request with the agent's record of it: exactly one
/// agent record per client path, no agent record for a path the client did
/// not send, equal chunk counts and response ids, `tls` as the client spoke
/// (`ClientRecord::tls`), TTFT and per-chunk times within `tol`.
pub fn compare(
    client: &[ClientRecord],
    agent: &[Value],
    server_pid: u32,
    expect: &Expect,
    tol: &Tolerance,
    report: &mut Report,
) {
    let f = &mut report.failures;
    let agent_by_path = by_path(agent);
    let client_paths: BTreeSet<&str> = client.iter().map(|c| c.path.as_str()).collect();
    assert_eq!(
        client_paths.len(),
        client.len(),
        "client paths must be unique"
    );
    for (p, recs) in &agent_by_path {
        if !client_paths.contains(p.as_str()) {
            f.push(format!(
                "agent reported {} record(s) for a path the client never sent: {p:?}: {}",
                recs.len(),
                recs[0]
            ));
        }
    }
    for c in client {
        let p = &c.path;
        if c.aborted || c.error.is_some() {
            f.push(format!(
                "{p}: the client itself failed ({:?}); the test setup is broken",
                c.error
            ));
            continue;
        }
        let Some(recs) = agent_by_path.get(p) else {
            f.push(format!("{p}: no agent record (lost request)"));
            continue;
        };
        if recs.len() != 1 {
            f.push(format!(
                "{p}: {} agent records, expected exactly one: {recs:?}",
                recs.len()
            ));
            continue;
        }
        let a = &recs[0];
        report.matched += 1;
        let ctx = |what: String| format!("{p}: {what}");

        if a.get("pid").and_then(Value::as_u64) != Some(u64::from(server_pid)) {
            f.push(ctx(format!(
                "pid {:?}, expected {server_pid}",
                a.get("pid")
            )));
        }
        if a.get("status").and_then(Value::as_u64) != Some(expect.status) {
            f.push(ctx(format!(
                "status {:?}, expected {}",
                a.get("status"),
                expect.status
            )));
        }
        if c.status != Some(expect.status) {
            f.push(ctx(format!(
                "client saw status {:?}, expected {}",
                c.status, expect.status
            )));
        }
        if str_field(a, "method").as_deref() != Some("POST") {
            f.push(ctx(format!("method {:?}, expected POST", a.get("method"))));
        }
        if a.get("stream").and_then(Value::as_bool) != Some(expect.stream) {
            f.push(ctx(format!(
                "stream {:?}, expected {}",
                a.get("stream"),
                expect.stream
            )));
        }
        if a.get("aborted").and_then(Value::as_bool) != Some(false) {
            f.push(ctx(format!(
                "aborted {:?} (reason {:?}), expected false",
                a.get("aborted"),
                a.get("abort_reason")
            )));
        }
        if a.get("tls").and_then(Value::as_bool) != Some(c.tls) {
            f.push(ctx(format!(
                "tls {:?}, expected {} ({})",
                a.get("tls"),
                c.tls,
                if c.tls {
                    "the client spoke TLS"
                } else {
                    "plaintext"
                }
            )));
        }
        let a_chunks = a.get("chunks").and_then(Value::as_u64);
        if a_chunks != Some(c.chunks) {
            f.push(ctx(format!(
                "agent chunks {a_chunks:?} != client chunks {}",
                c.chunks
            )));
        }
        let a_rid = str_field(a, "response_id");
        if expect.has_response_id && c.response_id.is_none() {
            f.push(ctx("client saw no response id".into()));
        }
        if a_rid != c.response_id {
            f.push(ctx(format!(
                "agent response_id {a_rid:?} != client {:?}",
                c.response_id
            )));
        }
        let offsets: Vec<f64> = a
            .get("chunk_offsets_ms")
            .and_then(Value::as_array)
            .map(|xs| xs.iter().filter_map(Value::as_f64).collect())
            .unwrap_or_default();
        if offsets.len() as u64 != a_chunks.unwrap_or(u64::MAX) {
            f.push(ctx(format!(
                "chunk_offsets_ms has {} entries, chunks is {a_chunks:?}",
                offsets.len()
            )));
        }
        let itl_len = a.get("itl_ms").and_then(Value::as_array).map(Vec::len);
        if itl_len != Some(offsets.len().saturating_sub(1)) {
            f.push(ctx(format!(
                "itl_ms has {itl_len:?} entries for {} chunks",
                offsets.len()
            )));
        }
        let Some(rs) = a.get("request_start_ns").and_then(Value::as_u64) else {
            f.push(ctx(format!("no request_start_ns: {a}")));
            continue;
        };
        let Some(t_send) = c.t_send_ns else { continue };
        let slack = tol.slack_ms;
        let ms = |a: u64, b: u64| (a as f64 - b as f64) / 1e6;
        // bracket: client t_send <= request_start <= server handler start
        let wait = ms(rs, t_send);
        report.read_wait.push(wait);
        if wait < -slack {
            f.push(ctx(format!(
                "agent request_start_ns is {:.3} ms BEFORE the client sent the request (must be CLOCK_MONOTONIC, the request's arrival at the host)",
                -wait
            )));
        }
        if let Some(h) = c.server_req_ns {
            let hr = ms(h, rs);
            report.handler_after_read.push(hr);
            if hr < -slack {
                f.push(ctx(format!(
                    "agent request_start_ns is {:.3} ms AFTER the server's handler started (request start is the arrival of the request's first byte, before any read)",
                    -hr
                )));
            }
        }
        // TTFT, measured both ways
        let stamp0 = c.server_write_ns.first().copied().flatten();
        match (f64_field(a, "ttft_ms"), c.ttft_ns) {
            (Some(at), Some(ct)) => {
                let ct = ct as f64 / 1e6;
                let dc = ct - at;
                report.ttft_client.push(dc);
                if dc < -slack {
                    f.push(ctx(format!("agent TTFT {at:.3} ms > client TTFT {ct:.3} ms: outside the client's bracket")));
                }
                // The server's handler starts after its read: compare with
                // the agent's TTFT counted from that read (`ttft_ms` also
                // holds the request's wait in the socket before it).
                let at_read = f64_field(a, "ttft_from_read_ms").unwrap_or(at);
                let ds = match (c.server_req_ns, stamp0) {
                    (Some(h), Some(s0)) => {
                        let st = ms(s0, h);
                        let ds = at_read - st;
                        report.ttft_server.push(ds);
                        if ds < -slack {
                            f.push(ctx(format!(
                                "agent TTFT from the read {at_read:.3} ms < server TTFT {st:.3} ms (handler start -> 1st chunk stamp): outside the server's bracket"
                            )));
                        }
                        Some(ds)
                    }
                    _ => None,
                };
                let best = ds.map_or(dc.abs(), |ds| dc.abs().min(ds.abs()));
                let exempt = tol.first_wave_exempt && c.seq == Some(0);
                if exempt {
                    report.first_wave_best.push(best);
                } else {
                    report.ttft_best.push(best);
                }
                let line = format!(
                    "client TTFT {ct:.3}, agent TTFT {at:.3} (from the read {at_read:.3}): client - agent {dc:.3}, agent - server {}, read wait {wait:.3}",
                    ds.map_or("n/a".to_string(), |d| format!("{d:.3}"))
                );
                if exempt {
                    // bracket-checked above; agreement not asserted
                } else {
                    report.ttft_judged += 1;
                    if best >= tol.ttft_abs_ms {
                        report.ttft_outliers.push(ctx(format!(
                            "TTFT off by >= {} ms both client- and server-side: {line}",
                            tol.ttft_abs_ms
                        )));
                    } else if dc.abs() >= tol.ttft_abs_ms {
                        report.client_outliers.push(ctx(line));
                    }
                }
            }
            (at, ct) => f.push(ctx(format!("TTFT missing: agent {at:?}, client {ct:?}"))),
        }
        // e2e, printed only (the final write is the terminating chunk)
        if let (Some(ae), Some(ce)) = (f64_field(a, "e2e_ms"), c.e2e_ns) {
            report.e2e_signed.push(ce as f64 / 1e6 - ae);
        }
        // every chunk: server stamp <= emit <= client arrival
        for (i, off) in offsets.iter().enumerate() {
            let Some(&arr) = c.chunk_arrival_ns.get(i) else {
                break;
            };
            let ae = ms(arr, rs) - off;
            report.arrival_minus_emit.push(ae);
            if ae < -slack {
                f.push(ctx(format!(
                    "chunk {i}: agent emit is {:.3} ms AFTER the client received it",
                    -ae
                )));
            }
            let es = c
                .server_write_ns
                .get(i)
                .copied()
                .flatten()
                .map(|sw| off - ms(sw, rs));
            if let Some(es) = es {
                report.emit_minus_server.push(es);
                if es < -slack {
                    f.push(ctx(format!(
                        "chunk {i}: agent emit is {:.3} ms BEFORE the server stamped it (just before its write)",
                        -es
                    )));
                }
            }
            let close = es.map_or(ae, |es| es.min(ae));
            report.chunks_judged += 1;
            if close > tol.chunk_close_ms {
                report.chunk_outliers.push(ctx(format!(
                    "chunk {i}: agent emit {ae:.3} ms before the client's arrival and {} after the server's stamp: neither within {} ms",
                    es.map_or("n/a".to_string(), |e| format!("{e:.3} ms")),
                    tol.chunk_close_ms
                )));
            }
        }
    }
}

/// The paths of a client run, as a set.
pub fn paths(recs: &[ClientRecord]) -> BTreeSet<String> {
    recs.iter().map(|c| c.path.clone()).collect()
}

/// One scenario end to end: server + agent + client runs, compare, print,
/// assert. `runs` are executed one after another against the same agent.
pub fn scenario(
    title: &str,
    kind: ServerKind,
    server_args: &[&str],
    runs: &[ClientRun],
    expect: &Expect,
    tol: &Tolerance,
) -> Report {
    scenario_with(title, kind, server_args, Selector::Pid, runs, expect, tol)
}

/// How the agent is told which process to trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Selector {
    /// `--pid <server pid>`
    Pid,
    /// `--port <server port>`
    Port,
    /// `--pid <server pid>` and these flags (e.g. `--data-hooks syscall`)
    PidWith(&'static [&'static str]),
}

pub fn scenario_with(
    title: &str,
    kind: ServerKind,
    server_args: &[&str],
    selector: Selector,
    runs: &[ClientRun],
    expect: &Expect,
    tol: &Tolerance,
) -> Report {
    let server = start_server(kind, server_args);
    let agent_args = match selector {
        Selector::Pid => Agent::for_pids(&[server.pid()]),
        Selector::Port => Agent::for_port(server.port),
        Selector::PidWith(flags) => {
            let mut args = Agent::for_pids(&[server.pid()]);
            args.extend(flags.iter().map(|f| f.to_string()));
            args
        }
    };
    let mut agent = start_agent(&agent_args);
    let mut client: Vec<ClientRecord> = Vec::new();
    for r in runs {
        let t = Instant::now();
        let recs = run_client(server.port, r);
        eprintln!(
            "[test] client run {:?} x{} (c={}): {} records in {:.2} s",
            r.rid_prefix,
            r.requests,
            r.concurrency,
            recs.len(),
            t.elapsed().as_secs_f64()
        );
        client.extend(recs);
    }
    let all = paths(&client);
    let missing = agent.wait_for_paths(&all, Duration::from_secs(20));
    if !missing.is_empty() {
        eprintln!(
            "[test] {} of {} requests not reported 20 s after the client finished",
            missing.len(),
            all.len()
        );
    }
    // No pause for duplicates: `stop` reads the agent's stdout to its end,
    // and the agent drains the ring buffer and reports everything it holds
    // before it exits, so a duplicate record is in `values()` either way.
    let stop = agent.stop();
    let mut report = Report::new();
    compare(
        &client,
        &agent.values(),
        server.pid(),
        expect,
        tol,
        &mut report,
    );
    report.print(title);
    report.apply_budgets(tol);
    check_agent_exit(&agent, stop, &mut report);
    report.assert_ok(title);
    report
}

// ----------------------------------------------------- inference server

/// The directory `cargo xtask native` built into (`<target>/native`): next
/// to the directory of the agent binary under test (so a worktree or a
/// `CARGO_TARGET_DIR` elsewhere works), else `<repo>/target/native`. Panics
/// with what to run when the stand-in CUDA libraries or the USDT provider
/// are missing.
pub fn native_dir() -> PathBuf {
    const NEEDED: [&str; 3] = ["libcudart.so.12", "libcuda.so.1", "libllm_usdt.so"];
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(target) = agent_bin().parent().and_then(|p| p.parent()) {
        candidates.push(target.join("native"));
    }
    candidates.push(repo_root().join("target/native"));
    for dir in &candidates {
        if NEEDED.iter().all(|f| dir.join(f).is_file()) {
            return dir.clone();
        }
    }
    panic!(
        "the native test artifacts ({}) are missing from {}: build them with `cargo xtask native` \
         (`cargo xtask test` does it before the tests)",
        NEEDED.join(", "),
        candidates
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(" and ")
    );
}

/// Direct children of `pid` (`/proc/<pid>/task/*/children`).
pub fn child_pids(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for t in tasks.flatten() {
        let text = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
        out.extend(
            text.split_whitespace()
                .filter_map(|c| c.parse::<u32>().ok()),
        );
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// A test server (Python, `tests/servers/…`) that prints `READY <port>` and
/// then one JSON object per line (its own CLOCK_MONOTONIC stamps).
pub struct StampingServer {
    pub proc: Proc,
    pub port: u16,
    /// The server's JSON lines, in order.
    pub lines: Receiver<Value>,
}

impl StampingServer {
    /// Starts `script` (relative to the repository root) with `args`.
    pub fn start(script: &str, args: &[&str]) -> Self {
        let path = repo_root().join(script);
        let mut child = spawn_piped(
            Command::new(python()).arg("-u").arg(&path).args(args),
            Stdio::null(),
        )
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", path.display()));
        let out = child.stdout.take().expect("piped stdout");
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let proc = Proc::guard(&name, child);
        let (port_tx, port_rx) = mpsc::channel();
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Some(p) = line.strip_prefix("READY ") {
                    let _ = port_tx.send(p.trim().parse::<u16>().ok());
                } else if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    let _ = tx.send(v);
                }
            }
        });
        let port = port_rx
            .recv_timeout(Duration::from_secs(30))
            .ok()
            .flatten()
            .unwrap_or_else(|| panic!("{name} printed no READY <port>: {}", proc.stderr.tail(20)));
        StampingServer { proc, port, lines }
    }
}

/// tests/servers/infer_server.py: an HTTP frontend and its engine child
/// (the stand-in GPU, `llm:*` USDT probes). Dropping it SIGKILLs the
/// frontend; the engine exits when its socket to the frontend closes.
pub struct InferServer {
    pub proc: Proc,
    pub port: u16,
    pub engine_pid: u32,
}

impl InferServer {
    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    /// Frontend and engine.
    pub fn pids(&self) -> [u32; 2] {
        [self.pid(), self.engine_pid]
    }
}

/// Starts tests/servers/infer_server.py on a free port with the native
/// artifacts of [`native_dir`], waits (30 s) for `READY <port>` (printed
/// once the engine is up) and finds the engine process among its children.
pub fn start_infer_server() -> InferServer {
    const SCRIPT: &str = "tests/servers/infer_server.py";
    let native = native_dir();
    let mut cmd = python_on_port(SCRIPT, 0);
    cmd.arg("--native-dir").arg(&native);
    let (proc, port) = start_ready(
        SCRIPT,
        &mut cmd,
        "are the native artifacts current? `cargo xtask native` rebuilds them",
    );
    // READY comes after the engine's hello: the child exists by now.
    let engines: Vec<u32> = child_pids(proc.pid())
        .into_iter()
        .filter(|c| {
            std::fs::read(format!("/proc/{c}/cmdline"))
                .map(|cmd| String::from_utf8_lossy(&cmd).contains("--engine-fd"))
                .unwrap_or(false)
        })
        .collect();
    let [engine_pid] = engines[..] else {
        panic!(
            "{SCRIPT} (pid {}): expected one engine child (--engine-fd), found {engines:?}; children {:?}",
            proc.pid(),
            child_pids(proc.pid())
        );
    };
    eprintln!(
        "[test] {SCRIPT} ready on port {port}: frontend pid {}, engine pid {engine_pid}, native dir {}",
        proc.pid(),
        native.display()
    );
    InferServer {
        proc,
        port,
        engine_pid,
    }
}

/// Runs tests/clients/explain_client.py with one `--request` per body (in
/// order, each after the previous one's response headers plus
/// `stagger_ms`) and returns its records, one per request.
pub fn run_explain_client(port: u16, requests: &[Value], stagger_ms: f64) -> Vec<Value> {
    run_explain_client_with(port, requests, stagger_ms, &[])
}

/// `run_explain_client` with extra client flags (e.g. `--delay-acks`).
pub fn run_explain_client_with(
    port: u16,
    requests: &[Value],
    stagger_ms: f64,
    extra: &[&str],
) -> Vec<Value> {
    let mut cmd = python_on_port("tests/clients/explain_client.py", port);
    cmd.args(["--stagger-ms", &stagger_ms.to_string()])
        .args(extra);
    for r in requests {
        cmd.arg("--request").arg(r.to_string());
    }
    run_to_records(
        "explain_client.py",
        &mut cmd,
        Duration::from_secs(120),
        requests.len(),
        &requests,
    )
}

impl Agent {
    /// Waits for the first record whose `response_id` is `id`.
    pub fn wait_for_response_id(&mut self, id: &str, timeout: Duration) -> Option<AgentLine> {
        self.wait_for_field("response_id", id, timeout)
    }

    /// Collects lines until `done` holds for them or the timeout passes;
    /// returns whether it held.
    pub fn wait_until(&mut self, timeout: Duration, done: impl Fn(&[AgentLine]) -> bool) -> bool {
        self.wait_for(timeout, |agent| done(&agent.lines), |held| *held)
    }

    /// Waits until every one of `needles` occurs in some stderr line (the
    /// agent's log); returns those still missing at the timeout.
    pub fn wait_for_log(&mut self, needles: &[&str], timeout: Duration) -> Vec<String> {
        self.wait_for(
            timeout,
            |agent| {
                let lines = agent.proc.stderr.lines();
                needles
                    .iter()
                    .filter(|n| !lines.iter().any(|l| l.contains(**n)))
                    .map(|n| n.to_string())
                    .collect()
            },
            Vec::is_empty,
        )
    }
}

/// tests/native/probe_driver.py started by `cmd` (this host's Python, or a
/// container's), held at its gate: its libraries are mapped, it has made
/// no call yet.
pub struct ProbeDriver {
    pub proc: Proc,
    stdout: BufReader<std::process::ChildStdout>,
}

impl ProbeDriver {
    /// Spawns `cmd` (stdio piped) and waits for the driver's `{"ready": …}`.
    pub fn start(name: &str, cmd: &mut Command) -> ProbeDriver {
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        let mut stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        let proc = Proc::guard(name, child);
        let mut line = String::new();
        stdout
            .read_line(&mut line)
            .expect("reading probe_driver.py");
        assert!(
            line.contains("\"ready\""),
            "{name}: {line:?}; stderr:\n{}",
            proc.stderr.tail(20)
        );
        ProbeDriver { proc, stdout }
    }

    /// Opens the gate; returns the driver's own count once it exited.
    pub fn run(mut self) -> Value {
        let stdin = self.proc.child.stdin.as_mut().expect("piped stdin");
        writeln!(stdin, "go").expect("opening the gate");
        let mut line = String::new();
        self.stdout
            .read_line(&mut line)
            .expect("reading probe_driver.py");
        let status = self.proc.wait_timeout(Duration::from_secs(60));
        assert!(
            status.is_some_and(|s| s.success()),
            "probe_driver.py failed: {status:?}; stderr:\n{}",
            self.proc.stderr.tail(20)
        );
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("probe_driver.py: {e}: {line:?}"))
    }
}
