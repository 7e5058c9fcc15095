//! Root-only: the agent run with exactly the capabilities the DaemonSet
//! grants (uid 0, bounding set read from deploy/kubernetes/base/
//! daemonset.yaml: BPF, PERFMON, SYS_PTRACE, DAC_READ_SEARCH; no
//! CAP_SYS_ADMIN), as `setpriv` gives them to the agent's process.
//!
//! On kernels patched for CVE-2025-38466 perf-event uprobes need
//! CAP_SYS_ADMIN; the agent attaches uprobe_multi links instead (kernel
//! 6.6+, this machine's 6.18). Each test counts what the probes must have
//! seen exactly:
//!
//! - HTTPS on a dynamic libssl (uvicorn) and on the OpenSSL inside node's
//!   executable: every request reported, chunk counts equal to the client's;
//! - the stand-in CUDA runtime (target/native/libcudart.so.12) and NVIDIA's
//!   real libcudart from its PyPI wheel (no GPU: each call returns an
//!   error, but it is a real call into the real library): launches and
//!   syncs counted one for one; `llm:token` USDT probes one for one;
//! - `ready` only after the probes are attached;
//! - without CAP_PERFMON, or forced onto perf-event uprobes (which need
//!   CAP_SYS_ADMIN here): the error line with errno, cause and fix, no
//!   `ready`, a non-zero exit; with --allow-degraded a ready line that says
//!   what is missing.
//!
//! Needs `cargo xtask native` and the vLLM venv (its torch brings NVIDIA's
//! CUDA runtime wheel); `cargo xtask test` provides both. Run as root:
//!   cargo test -p tokentrace --test ebpf_capabilities -- --test-threads=1

use tokentrace_testkit as common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use common::h2::*;
use common::tls::TlsDir;
use common::*;

const AGENT_ENV: &[(&str, &str)] = &[("TOKENTRACE_LOG", "info")];

/// The capabilities the DaemonSet's container adds after dropping ALL, as
/// the manifest says (not a copy of the list).
fn daemonset_capabilities() -> Vec<String> {
    let path = repo_root().join("deploy/kubernetes/base/daemonset.yaml");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let doc: serde_yaml::Value =
        serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let caps = &doc["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"];
    assert_eq!(
        caps["drop"],
        serde_yaml::Value::Sequence(vec!["ALL".into()]),
        "{}: the container no longer drops ALL capabilities; this test assumes it does",
        path.display()
    );
    let add: Vec<String> = caps["add"]
        .as_sequence()
        .unwrap_or_else(|| panic!("{}: no capabilities.add list", path.display()))
        .iter()
        .filter_map(|c| c.as_str().map(str::to_string))
        .collect();
    assert!(
        !add.is_empty(),
        "{}: capabilities.add is empty",
        path.display()
    );
    add
}

/// `setpriv` keeping only `caps` (uid stays 0) for the command after it.
fn setpriv(caps: &[String]) -> Vec<String> {
    let set: Vec<String> = caps
        .iter()
        .map(|c| format!("+{}", c.to_ascii_lowercase()))
        .collect();
    vec![
        "setpriv".into(),
        "--bounding-set".into(),
        format!("-all,{}", set.join(",")),
        "--inh-caps".into(),
        "-all".into(),
        "--".into(),
    ]
}

/// The DaemonSet's set without `cap`.
fn without(cap: &str) -> Vec<String> {
    daemonset_capabilities()
        .into_iter()
        .filter(|c| c != cap)
        .collect()
}

const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

fn effective_caps(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or_else(|| panic!("no CapEff for pid {pid}"))
}

/// The agent under the DaemonSet's capabilities; checks that it holds
/// them (and not CAP_SYS_ADMIN), that it chose uprobe_multi links, and
/// that `ready` came after every probe line it printed before it.
fn start_capped_agent(args: &[String]) -> Agent {
    let agent = start_agent_under(&setpriv(&daemonset_capabilities()), args, AGENT_ENV);
    let caps = effective_caps(agent.proc.pid());
    assert!(
        caps & (1 << CAP_SYS_ADMIN) == 0 && caps & (1 << CAP_BPF) != 0 && caps & (1 << CAP_PERFMON) != 0,
        "the agent's effective capabilities {caps:#x} are not the DaemonSet's (BPF+PERFMON, no SYS_ADMIN)"
    );
    let lines = agent.proc.stderr.lines();
    assert!(
        lines.iter().any(|l| l.contains("uprobes: uprobe_multi")),
        "the agent did not choose uprobe_multi links without CAP_SYS_ADMIN; stderr:\n{}",
        agent.proc.stderr.tail(30)
    );
    let ready = lines
        .iter()
        .position(|l| l.contains("tokentrace: ready"))
        .expect("start_agent returned before ready");
    assert!(
        !lines[..ready].iter().any(|l| l.contains("cannot attach")),
        "an attach failed before `ready`; stderr:\n{}",
        agent.proc.stderr.tail(30)
    );
    agent
}

/// Waits (15 s) for the agent's `probing <file>: <kind> (` line.
fn wait_probing(agent: &mut Agent, needle: &str) {
    let missing = agent.wait_for_log(&[needle], Duration::from_secs(15));
    assert!(
        missing.is_empty(),
        "no `{needle}` line from the agent within 15 s; stderr:\n{}",
        agent.proc.stderr.tail(30)
    );
}

/// Every client request reported once with the client's chunk count.
fn assert_exact(title: &str, client: &[(String, u64)], agent: &[Value]) {
    let mut failures = Vec::new();
    for (key, chunks) in client {
        let seen: Vec<&Value> = agent
            .iter()
            .filter(|v| {
                str_field(v, "path").is_some_and(|p| p.ends_with(key.as_str()))
                    || str_field(v, "request_id").as_deref() == Some(key.as_str())
            })
            .collect();
        match seen[..] {
            [one] => {
                if one.get("chunks").and_then(Value::as_u64) != Some(*chunks) {
                    failures.push(format!(
                        "{key}: agent chunks {:?}, client {chunks}",
                        one.get("chunks")
                    ));
                }
                if one.get("tls").and_then(Value::as_bool) != Some(true) {
                    failures.push(format!("{key}: not marked tls: {one}"));
                }
            }
            _ => failures.push(format!("{key}: reported {} times", seen.len())),
        }
    }
    assert!(
        failures.is_empty(),
        "{title}: {} of {} requests wrong under the DaemonSet's capabilities:\n{}",
        failures.len(),
        client.len(),
        failures.join("\n")
    );
    eprintln!(
        "[test] {title}: {} of {} requests exact",
        client.len(),
        client.len()
    );
}

/// uvicorn/FastAPI serving HTTPS through the system libssl.so.3, with the
/// certificate directory it reads (keep it for the server's life).
fn https_uvicorn(tag: &str) -> (TlsDir, Server) {
    let tls = TlsDir::new(tag);
    let server = start_server(
        ServerKind::FastApi,
        &["--ssl-keyfile", tls.key(), "--ssl-certfile", tls.cert()],
    );
    (tls, server)
}

#[test]
fn root_daemonset_caps_https_on_a_dynamic_libssl() {
    let title = "DaemonSet capabilities: uvicorn HTTPS (libssl.so.3)";
    require_root(title);
    let (_tls, server) = https_uvicorn("caps-uvicorn");
    let mut agent = start_capped_agent(&Agent::for_pids(&[server.pid()]));
    wait_probing(&mut agent, ": OpenSSL (");
    let mut run = ClientRun::sse(12, 3, "caps-");
    run.tls = true;
    let client = run_client(server.port, &run);
    assert_eq!(client.len(), 12, "the client's run failed");
    let paths = paths(&client);
    let missing = agent.wait_for_paths(&paths, Duration::from_secs(20));
    let stop = agent.stop();
    assert!(missing.is_empty(), "{title}: not reported: {missing:?}");
    let mut exit = Report::new();
    check_agent_exit(&agent, stop, &mut exit);
    exit.assert_ok(title);
    let expected: Vec<(String, u64)> = client.iter().map(|c| (c.path.clone(), c.chunks)).collect();
    assert_exact(title, &expected, &agent.values());
}

#[test]
fn root_daemonset_caps_https_on_the_openssl_inside_node() {
    let title = "DaemonSet capabilities: node HTTPS (OpenSSL in the executable)";
    require_root(title);
    let tls = TlsDir::new("caps-node");
    let server = start_node_server(Some((tls.cert(), tls.key())));
    let mut agent = start_capped_agent(&Agent::for_pids(&[server.pid()]));
    wait_probing(&mut agent, ": OpenSSL (");
    let client = run_h2_client(
        H2Client::Node,
        server.port,
        &[
            "--tls",
            "--requests",
            "8",
            "--tokens",
            "6",
            "--rid-prefix",
            "caps-",
        ],
        8,
    );
    let ids: BTreeSet<String> = client
        .iter()
        .filter_map(|c| str_field(c, "request_id"))
        .collect();
    assert_eq!(ids.len(), 8, "the client's run failed: {client:?}");
    agent.wait_until(Duration::from_secs(20), |lines| {
        let seen: BTreeSet<String> = lines
            .iter()
            .filter_map(|l| str_field(&l.v, "request_id"))
            .collect();
        ids.is_subset(&seen)
    });
    let stop = agent.stop();
    let mut exit = Report::new();
    check_agent_exit(&agent, stop, &mut exit);
    exit.assert_ok(title);
    let expected: Vec<(String, u64)> = client
        .iter()
        .filter_map(|c| Some((str_field(c, "request_id")?, c.get("chunks")?.as_u64()?)))
        .collect();
    assert_exact(title, &expected, &agent.values());
}

/// NVIDIA's CUDA runtime from its PyPI wheel, which the vLLM venv's torch
/// installs (nvidia/*/lib/libcudart.so.*).
fn real_libcudart() -> PathBuf {
    let venv = common::vllm::venv();
    let lib = venv.join("lib");
    let found = walk(&lib, 6).into_iter().find(|p| {
        p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("libcudart.so."))
            && p.components().any(|c| c.as_os_str() == "nvidia")
    });
    found.unwrap_or_else(|| {
        panic!(
            "no nvidia/*/lib/libcudart.so.* under {}: the vLLM venv's torch brings NVIDIA's CUDA \
             runtime wheel (`cargo xtask vllm-env`). This test does not skip.",
            lib.display()
        )
    })
}

fn walk(dir: &Path, depth: usize) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() && depth > 0 {
            out.extend(walk(&path, depth - 1));
        } else {
            out.push(path);
        }
    }
    out
}

/// Runs the driver on `cudart` (and the USDT library) traced by a capped
/// agent; every launch, sync and token probe must have been seen.
fn cuda_and_usdt_exact(title: &str, cudart: &Path, usdt: bool) {
    require_root(title);
    const ITERATIONS: u64 = 200;
    let usdt_lib = native_dir().join("libllm_usdt.so");
    let iterations = ITERATIONS.to_string();
    let mut args = vec![
        "--cudart",
        cudart.to_str().expect("UTF-8 path"),
        "--iterations",
        &iterations,
    ];
    if usdt {
        args.extend(["--usdt", usdt_lib.to_str().expect("UTF-8 path")]);
    }
    let driver = ProbeDriver::start(
        "probe_driver.py",
        Command::new(python())
            .arg(repo_root().join("tests/native/probe_driver.py"))
            .args(&args),
    );
    let mut agent = start_capped_agent(&Agent::for_pids(&[driver.proc.pid()]));
    let name = cudart
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .to_string();
    wait_probing(&mut agent, &format!("{name}: CUDA ("));
    if usdt {
        wait_probing(&mut agent, "libllm_usdt.so: USDT llm (");
    }
    let counts = driver.run();
    eprintln!("[test] {title}: driver {counts}");
    // The records of the last calls are in the ring buffer: SIGINT drains it.
    std::thread::sleep(Duration::from_millis(300));
    let stop = agent.stop();
    let mut exit = Report::new();
    check_agent_exit(&agent, stop, &mut exit);
    exit.assert_ok(title);
    let inference = agent.inference_summary();
    let seen = |k: &str| inference.get(k).and_then(Value::as_u64);
    assert_eq!(counts["launches"].as_u64(), Some(ITERATIONS), "{counts}");
    assert_eq!(
        seen("cuda_syncs"),
        counts["syncs"].as_u64(),
        "{title}: CUDA syncs seen by the agent vs made: {inference}"
    );
    assert_eq!(
        seen("cuda_kernel_launches"),
        counts["launches"].as_u64(),
        "{title}: kernel launches seen by the agent vs made: {inference}"
    );
    if usdt {
        assert_eq!(
            counts["usdt_tokens"].as_u64(),
            Some(ITERATIONS),
            "{title}: the llm:token semaphore was not set by the attach: {counts}"
        );
        assert_eq!(
            seen("usdt_events"),
            Some(ITERATIONS),
            "{title}: llm:* USDT events seen vs fired: {inference}"
        );
    }
}

#[test]
fn root_daemonset_caps_stand_in_cuda_and_usdt_counted_exactly() {
    let cudart = native_dir().join("libcudart.so.12");
    cuda_and_usdt_exact(
        "DaemonSet capabilities: stand-in libcudart + llm USDT",
        &cudart,
        true,
    );
}

#[test]
fn root_daemonset_caps_nvidia_libcudart_from_pypi_counted_exactly() {
    let cudart = real_libcudart();
    eprintln!("[test] NVIDIA's libcudart: {}", cudart.display());
    cuda_and_usdt_exact(
        "DaemonSet capabilities: NVIDIA's libcudart (PyPI wheel)",
        &cudart,
        false,
    );
}

/// Runs `tokentrace run` under `wrapper` expecting it to give up: returns
/// its exit status and stderr.
fn run_to_exit(wrapper: &[String], args: &[String]) -> (std::process::ExitStatus, String) {
    let mut cmd = Command::new("timeout");
    cmd.arg("60")
        .args(wrapper)
        .arg(agent_bin())
        .arg("run")
        .args(args);
    for (k, _) in std::env::vars_os() {
        let key = k.to_string_lossy();
        if key.starts_with("TOKENTRACE_") || key.starts_with("OTEL_") {
            cmd.env_remove(&k);
        }
    }
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .expect("running tokentrace");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    eprintln!("[test] {:?} exit {}; stderr:\n{stderr}", args, out.status);
    (out.status, stderr)
}

#[test]
fn root_daemonset_caps_missing_probes_are_an_error_not_ready() {
    let title = "DaemonSet capabilities: probes that cannot attach";
    require_root(title);
    let (_tls, server) = https_uvicorn("caps-refused");
    let pid = server.pid().to_string();
    let daemonset = setpriv(&daemonset_capabilities());

    // Perf-event uprobes need CAP_SYS_ADMIN on this kernel: one line naming
    // the probe, the file, the errno, the cause and the fix; no ready.
    let perf = ["--pid", &pid, "--uprobe-mode", "perf_event"].map(String::from);
    let (status, stderr) = run_to_exit(&daemonset, &perf);
    assert!(
        !status.success(),
        "{title}: exit {status} with perf-event uprobes refused"
    );
    assert!(
        !stderr.contains("tokentrace: ready"),
        "{title}: said ready:\n{stderr}"
    );
    let line = stderr
        .lines()
        .find(|l| l.contains("cannot attach the OpenSSL probes"))
        .unwrap_or_else(|| panic!("{title}: no attach failure line:\n{stderr}"));
    for part in [
        "libssl",
        &format!("pid {pid}"),
        "EACCES (13)",
        "CAP_SYS_ADMIN",
        "fix:",
        "perf_event mode",
    ] {
        assert!(
            line.contains(part),
            "{title}: {part:?} missing from: {line}"
        );
    }

    // Degraded on purpose: ready, and the line says what is missing.
    let mut degraded = perf.to_vec();
    degraded.extend(["--allow-degraded".into(), "--duration".into(), "2s".into()]);
    let (status, stderr) = run_to_exit(&daemonset, &degraded);
    assert!(
        status.success(),
        "{title}: --allow-degraded run failed ({status})"
    );
    assert!(
        stderr
            .lines()
            .any(|l| l.starts_with("tokentrace: ready (degraded")
                && l.contains("OpenSSL in ")
                && l.contains(&format!("for pid {pid}"))),
        "{title}: no degraded ready line naming OpenSSL for pid {pid}:\n{stderr}"
    );
    assert!(
        stderr.contains("probes: 1 probe set(s) could not be attached"),
        "{title}: the summary does not count the failure:\n{stderr}"
    );

    // Without CAP_PERFMON nothing loads: the cause is named, no ready.
    let plain = ["--pid", &pid].map(String::from);
    let (status, stderr) = run_to_exit(&setpriv(&without("PERFMON")), &plain);
    assert!(
        !status.success(),
        "{title}: exit {status} without CAP_PERFMON"
    );
    assert!(
        !stderr.contains("tokentrace: ready"),
        "{title}: said ready without CAP_PERFMON:\n{stderr}"
    );
    assert!(
        stderr.contains("permission denied") && stderr.contains("CAP_PERFMON"),
        "{title}: the refusal without CAP_PERFMON does not name it:\n{stderr}"
    );
}

fn bpftool(args: &[&str]) -> String {
    let out = Command::new("bpftool")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run bpftool (apt-get install bpftool): {e}"));
    assert!(
        out.status.success(),
        "bpftool {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Whether the instructions of an xlated dump call `function`. Its source
/// lines come along as `; …` comments, and a kept instruction can carry the
/// line of a call the verifier dropped: only a call instruction counts.
fn calls(xlated: &str, function: &str) -> bool {
    let call = format!(" call {function}#");
    xlated
        .lines()
        .any(|l| !l.trim_start().starts_with(';') && l.contains(&call))
}

/// Kernels 6.13+ run uprobe programs preemptible, on a per-CPU private
/// stack when they need 64 bytes or more: such a program must disable
/// preemption, as must every program staging records in the per-CPU
/// scratch slot (ssl_exit and the syscall exits; the socket hooks' send
/// and receive returns where the kernel lacks the dynptr user read, before
/// 6.16). Where the socket hooks build their records in place (reading the
/// payload with `bpf_probe_read_user_dynptr`) they must not pay for the guard: their
/// tracepoints run non-preemptible, and it would be two kfunc calls per
/// traced send and read. The stack depths come from the verifier
/// (`tokentrace check --programs`, printed here); the guard is looked for
/// in the instructions the kernel runs (`bpftool prog dump xlated` of the
/// programs the capped agent holds).
#[test]
fn root_daemonset_caps_deep_or_scratch_programs_disable_preemption() {
    let title = "uprobe programs under preemption";
    require_root(title);
    let out = Command::new(agent_bin())
        .args(["check", "--programs"])
        .output()
        .expect("running tokentrace check --programs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let programs: Vec<&str> = text.lines().filter(|l| l.starts_with("program ")).collect();
    eprintln!("[test] verifier stack depths:\n{}", programs.join("\n"));
    // sock (raw syscall hooks, socket and process tracepoints, OpenSSL),
    // infer (CUDA, USDT, sched_switch) and profile: 27 on 6.18.
    assert!(
        programs.len() > 20,
        "{title}: too few program lines:\n{text}"
    );
    let mut must_guard: BTreeSet<String> = BTreeSet::new();
    for line in &programs {
        // program sock/ssl_exit (uretprobe): stack 192 bytes, …
        let (name, rest) = line["program ".len()..]
            .split_once(' ')
            .unwrap_or_else(|| panic!("{title}: unparsable: {line}"));
        let name = name.rsplit('/').next().unwrap_or(name).to_string();
        let stack = rest
            .split_once("stack ")
            .and_then(|(_, s)| s.split_once(" bytes"))
            .map(|(depths, _)| depths.to_string())
            .unwrap_or_else(|| panic!("{title}: no stack depth from the verifier: {line}"));
        assert!(
            !stack.contains('?'),
            "{title}: no stack depth from the verifier: {line}"
        );
        // Without a private stack (kernels before 6.13, and 6.18 builds
        // seen here that give tp_btf programs none) the verifier adds the
        // frames of a call chain and refuses more than 512 bytes; the sum
        // over all subprograms (each rounded to 16, as the JIT does) bounds
        // every chain. exit_syscall once reached 672 and did not load.
        let combined: u32 = stack
            .split('+')
            .filter_map(|d| d.parse::<u32>().ok())
            .map(|d| d.div_ceil(16) * 16)
            .sum();
        assert!(
            combined <= 512,
            "{title}: {name}'s frames add up to {combined} bytes, over the 512 a kernel without private stacks allows: {line}"
        );
        let uprobe = rest.starts_with("(uprobe") || rest.starts_with("(uretprobe");
        let deep = stack
            .split('+')
            .any(|d| d.parse::<u32>().is_ok_and(|d| d >= 64));
        // ssl_exit and the data paths' returns may stage records (syscall
        // hooks: exit_syscall; socket hooks: on_send_length, on_recv_length,
        // on kernels before 6.16: told apart below).
        if (uprobe && deep)
            || name == "ssl_exit"
            || name.starts_with("exit_") && !name.starts_with("exit_accept")
            || name == "on_send_length"
            || name == "on_recv_length"
        {
            must_guard.insert(name);
        }
    }
    assert!(
        must_guard.contains("ssl_exit") && must_guard.contains("exit_syscall"),
        "{title}: {must_guard:?}"
    );

    let (_tls, server) = https_uvicorn("caps-preempt");
    let mut agent = start_capped_agent(&Agent::for_pids(&[server.pid()]));
    wait_probing(&mut agent, ": OpenSSL (");
    // Found loaded and guarded, or (socket hooks) found building in place
    // without the guard.
    let mut checked = BTreeSet::new();
    for id in program_ids(agent.proc.pid()) {
        let id = id.to_string();
        let show: Value = serde_json::from_str(&bpftool(&["prog", "show", "id", &id, "--json"]))
            .expect("bpftool prints JSON");
        let name = str_field(&show, "name").unwrap_or_default();
        if !must_guard.contains(&name) {
            continue;
        }
        let xlated = bpftool(&["prog", "dump", "xlated", "id", &id]);
        let disables = calls(&xlated, "bpf_preempt_disable");
        let enables = calls(&xlated, "bpf_preempt_enable");
        let socket_hook = name == "on_send_length" || name == "on_recv_length";
        // Direct where the dynptr user read is called: the verifier drops
        // the way a kernel does not take (the staged one from 6.16).
        if socket_hook && calls(&xlated, "bpf_probe_read_user_dynptr") {
            assert!(
                !disables && !enables,
                "{title}: {name} builds its records in place yet disables preemption: two \
                 kfunc calls per traced send or read for nothing"
            );
            checked.insert(name);
            continue;
        }
        assert!(
            disables && enables,
            "{title}: {name} (stack or scratch needs it) does not disable and re-enable preemption"
        );
        checked.insert(name);
    }
    let _ = agent.stop();
    // The agent loads one data path: the syscall hooks' exit or the socket
    // hooks' send and receive returns, whichever `--data-hooks auto` chose.
    let data_path: BTreeSet<String> = must_guard
        .iter()
        .filter(|name| {
            ["exit_syscall", "on_send_length", "on_recv_length"]
                .iter()
                .any(|p| name.starts_with(p))
        })
        .cloned()
        .collect();
    let expected: BTreeSet<String> = must_guard
        .difference(&data_path)
        .cloned()
        .chain(data_path.intersection(&checked).cloned())
        .collect();
    assert!(
        checked.contains("exit_syscall")
            || checked.contains("on_send_length") && checked.contains("on_recv_length"),
        "{title}: no data path's returns found checked in the agent: {checked:?}"
    );
    assert_eq!(
        checked, expected,
        "{title}: programs that must be guarded but were not found loaded in the agent"
    );
    eprintln!("[test] {title}: checked {checked:?}");
}
