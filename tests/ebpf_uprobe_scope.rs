//! Root-only: the OpenSSL uprobes exist only in traced processes.
//!
//! - A process that maps the same libssl but is not traced runs none of the
//!   agent's programs however many SSL calls it makes (the BPF programs' run
//!   counts, `kernel.bpf_stats_enabled`, read with bpftool): its memory has
//!   no breakpoint, so it takes no trap either. The opt-in global mode is
//!   the control: there the same calls do run the programs (the pid filter
//!   returns early, after the trap).
//! - A child forked by a traced HTTPS server after the agent started gets
//!   its own uprobes (a fork copies breakpoints, not probes) and its TLS
//!   requests are reported.
//!
//! Run as root: cargo test -p tokentrace --test ebpf_uprobe_scope -- --test-threads=1

use tokentrace_testkit as common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use common::tls::TlsDir;
use common::*;

const AGENT_ENV: &[(&str, &str)] = &[("TOKENTRACE_LOG", "info")];

/// Turns on the kernel's per-program run counters for the test's life.
struct BpfStats {
    before: String,
}

impl BpfStats {
    const PATH: &'static str = "/proc/sys/kernel/bpf_stats_enabled";

    fn enable() -> Self {
        let before = std::fs::read_to_string(Self::PATH)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", Self::PATH));
        std::fs::write(Self::PATH, "1")
            .unwrap_or_else(|e| panic!("cannot enable {}: {e}", Self::PATH));
        BpfStats { before }
    }
}

impl Drop for BpfStats {
    fn drop(&mut self) {
        let _ = std::fs::write(Self::PATH, self.before.trim());
    }
}

/// Total run count of the agent's OpenSSL programs (`ssl_*`), from
/// `bpftool prog show --json`, counting only programs `agent_pid` holds.
fn ssl_program_runs(agent_pid: u32) -> u64 {
    let ids = program_ids(agent_pid);
    let out = Command::new("bpftool")
        .args(["prog", "show", "--json"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run bpftool (apt-get install bpftool): {e}"));
    assert!(
        out.status.success(),
        "bpftool failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let progs: Vec<Value> = serde_json::from_slice(&out.stdout).expect("bpftool prints JSON");
    let mut runs = 0;
    let mut found = 0;
    for prog in &progs {
        let name = prog.get("name").and_then(Value::as_str).unwrap_or("");
        let ours = prog
            .get("id")
            .and_then(Value::as_u64)
            .is_some_and(|id| ids.contains(&id));
        if ours && name.starts_with("ssl_") {
            found += 1;
            runs += prog.get("run_cnt").and_then(Value::as_u64).unwrap_or(0);
        }
    }
    assert!(
        found >= 6,
        "bpftool shows {found} ssl_* programs of the agent (pid {agent_pid})"
    );
    runs
}

/// `sse_flood.py ssl-loop`: SSL_write_ex + SSL_read_ex on memory BIOs in an
/// untraced process for `seconds`; returns the SSL calls it made.
fn untraced_ssl_loop(tls: &TlsDir, seconds: f64) -> u64 {
    let mut child = Command::new(python())
        .arg(repo_root().join("tests/bench/sse_flood.py"))
        .args(["ssl-loop", "--certfile", tls.cert(), "--keyfile", tls.key()])
        .args(["--seconds", &seconds.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 runs the ssl loop");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("READY line");
    assert!(line.starts_with("READY"), "ssl-loop printed {line:?}");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(b"go\n")
        .expect("start the loop");
    line.clear();
    out.read_line(&mut line).expect("result line");
    let _ = child.wait();
    let result: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
    result["ssl_calls"].as_u64().expect("ssl_calls")
}

/// An HTTPS server traced by pid, an untraced process doing SSL calls.
fn untraced_runs(global: bool) -> (u64, u64) {
    let tls = TlsDir::new(if global { "scope-global" } else { "scope" });
    let server = start_server(
        ServerKind::Stdlib,
        &["--ssl-certfile", tls.cert(), "--ssl-keyfile", tls.key()],
    );
    let mut args = Agent::for_pids(&[server.pid()]);
    if global {
        args.push("--uprobes-all-processes".into());
    }
    let mut agent = start_agent_with_env(&args, AGENT_ENV);
    let missing = agent.wait_for_log(&["probing", "libssl"], Duration::from_secs(30));
    assert!(
        missing.is_empty(),
        "agent never attached libssl: {}",
        agent.proc.stderr.tail(20)
    );
    let before = ssl_program_runs(agent.proc.pid());
    let calls = untraced_ssl_loop(&tls, 1.0);
    let after = ssl_program_runs(agent.proc.pid());
    // The traced server's calls do run them (the control for the counter).
    let mut run = ClientRun::sse(2, 1, "scope-");
    run.tls = true;
    run.tokens = 3;
    run_client(server.port, &run);
    let served = ssl_program_runs(agent.proc.pid());
    assert!(
        served > after,
        "the traced server's SSL calls ran no program ({after} -> {served})"
    );
    agent.stop();
    eprintln!(
        "[test] global={global}: {calls} SSL calls of an untraced process, {} program runs",
        after - before
    );
    (calls, after - before)
}

#[test]
fn root_untraced_process_on_the_same_libssl_runs_no_probe() {
    require_root("root_untraced_process_on_the_same_libssl_runs_no_probe");
    let _stats = BpfStats::enable();
    let (calls, runs) = untraced_runs(false);
    assert!(calls > 1000, "the loop made only {calls} SSL calls");
    assert_eq!(
        runs, 0,
        "an untraced process's {calls} SSL calls ran the agent's programs {runs} times"
    );
    // Control: attached for every process, the same calls hit every probe.
    let (calls, runs) = untraced_runs(true);
    assert!(
        runs >= calls,
        "global mode: {calls} SSL calls of an untraced process ran the programs only {runs} times"
    );
}

/// The Python interpreter running the server: `pid` itself, or the child a
/// launcher (pyenv's shim) started.
fn python_process(pid: u32) -> u32 {
    let is_python = |p: u32| {
        std::fs::read_link(format!("/proc/{p}/exe"))
            .is_ok_and(|exe| exe.to_string_lossy().contains("python"))
    };
    let mut current = pid;
    for _ in 0..4 {
        if is_python(current) {
            return current;
        }
        match child_pids(current).first() {
            Some(&child) => current = child,
            None => break,
        }
    }
    panic!("no python process at or under pid {pid}");
}

#[test]
fn root_tls_child_forked_after_the_agent_started_is_traced() {
    require_root("root_tls_child_forked_after_the_agent_started_is_traced");
    let tls = TlsDir::new("fork");
    let server = start_server(
        ServerKind::Stdlib,
        &[
            "--ssl-certfile",
            tls.cert(),
            "--ssl-keyfile",
            tls.key(),
            "--fork-on-sigusr1",
        ],
    );
    let mut agent = start_agent_with_env(&Agent::for_pids(&[server.pid()]), AGENT_ENV);
    let python = python_process(server.pid());
    // SAFETY: kill(2) on the test's own server process.
    unsafe { libc::kill(python as libc::pid_t, libc::SIGUSR1) };
    let child = (0..200)
        .find_map(|_| {
            std::thread::sleep(Duration::from_millis(25));
            child_pids(python).first().copied()
        })
        .expect("the server forked a child within 5 s");
    let needle = format!("for pid {child}");
    let missing = agent.wait_for_log(&["libssl", &needle], Duration::from_secs(10));
    assert!(
        missing.is_empty(),
        "the agent did not attach the OpenSSL probes for the forked child {child}: {}",
        agent.proc.stderr.tail(20)
    );
    let mut run = ClientRun::sse(3, 1, "fork-");
    run.tls = true;
    run.tokens = 4;
    let client = run_client(server.port, &run);
    let paths = paths(&client);
    let missing = agent.wait_for_paths(&paths, Duration::from_secs(20));
    let stop = agent.stop();
    assert!(
        missing.is_empty(),
        "requests served by the child not reported: {missing:?}"
    );
    let mut report = Report::new();
    check_agent_exit(&agent, stop, &mut report);
    report.assert_ok("forked TLS child");
    for v in agent.values() {
        assert_eq!(v["pid"].as_u64(), Some(u64::from(child)), "{v}");
        assert_eq!(v["tls"].as_bool(), Some(true), "{v}");
        assert_eq!(v["chunks"].as_u64(), Some(5), "4 tokens + usage: {v}");
    }
}
