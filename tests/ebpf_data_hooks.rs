//! Root-only: which kernel programs feed the data path. With the socket
//! hooks (`--data-hooks auto` on Linux 6.3+, or `socket`) the agent must
//! hold no program on `sys_enter`/`sys_exit`, whose mere presence puts every
//! syscall of every process on the slow path, and holds the send-start hook
//! (`tcp_sendmsg_locked`) where the kernel has it (6.16+) unless asked for
//! `socket_at_return`; with `--data-hooks syscall` it holds the syscall
//! hooks and none of the socket hooks. Either way a streaming request is
//! reported whole, its accept included.
//!
//! Run (as root; CI does):
//!   cargo test -p tokentrace --test ebpf_data_hooks -- --test-threads=1 --nocapture

use tokentrace_testkit as common;

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::Value;

const SYSCALL_PROGRAMS: [&str; 2] = ["enter_syscall", "exit_syscall"];
const SOCKET_PROGRAMS: [&str; 3] = [
    "on_send_length", // bpftool shows names cut at 15 characters
    "on_recv_length",
    "on_vm_unmapped_a",
];
/// The send-start hook, on `tcp_sendmsg_locked` (Linux 6.16+).
const SEND_START_PROGRAM: &str = "on_sendmsg_locke";

/// Whether the kernel's BTF names the `tcp_sendmsg_locked` tracepoint, read
/// from /sys/kernel/btf/vmlinux itself (not from the agent's own check).
fn kernel_has_send_start() -> bool {
    let btf = std::fs::read("/sys/kernel/btf/vmlinux")
        .unwrap_or_else(|e| panic!("reading /sys/kernel/btf/vmlinux: {e}"));
    let name = b"btf_trace_tcp_sendmsg_locked\0";
    btf.windows(name.len()).any(|w| w == name)
}

/// `bpftool <object> show id <id>` (object: prog or map), as JSON.
fn bpftool_show(object: &str, id: u64) -> Value {
    let out = Command::new("bpftool")
        .args([object, "show", "id", &id.to_string(), "--json"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run bpftool (apt-get install bpftool): {e}"));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("bpftool {object} show {id}: not JSON: {e}"))
}

/// Names of the BPF programs `pid` holds (as the kernel keeps them: at most
/// 15 characters).
fn program_names(pid: u32) -> BTreeSet<String> {
    program_ids(pid)
        .into_iter()
        .map(|id| str_field(&bpftool_show("prog", id), "name").unwrap_or_default())
        .collect()
}

/// Names of the BPF maps `pid` holds, each once (the probe objects share
/// some).
fn map_names(pid: u32) -> BTreeSet<String> {
    map_ids(pid)
        .into_iter()
        .map(|id| str_field(&bpftool_show("map", id), "name").unwrap_or_default())
        .collect()
}

/// What an agent held while tracing: the names of its BPF programs and
/// maps; and the per-thread state its probes could not create (summary).
struct Held {
    programs: BTreeSet<String>,
    maps: BTreeSet<String>,
    thread_state_misses: u64,
}

/// Traces a stdlib SSE server with `flags`, sends a few streaming
/// requests, and returns what the agent held.
fn held_while_tracing(flags: &[&str]) -> Held {
    let server = start_server(ServerKind::Stdlib, &[]);
    let mut args = Agent::for_pids(&[server.pid()]);
    args.extend(flags.iter().map(|f| f.to_string()));
    let mut agent = start_agent(&args);
    let (programs, maps) = (program_names(agent.proc.pid()), map_names(agent.proc.pid()));
    let mut run = ClientRun::sse(3, 1, "hooks-");
    run.tokens = 3; // 3 token events and the usage event: 4 chunks
    let client = run_client(server.port, &run);
    let all = paths(&client);
    let missing = agent.wait_for_paths(&all, Duration::from_secs(20));
    assert!(missing.is_empty(), "{flags:?}: not reported: {missing:?}");
    for line in agent.values() {
        assert_eq!(
            line.get("chunks").and_then(Value::as_u64),
            Some(4),
            "{flags:?}: {line}"
        );
        assert!(
            line.get("ttft_ms")
                .and_then(Value::as_f64)
                .is_some_and(|t| t > 0.0),
            "{flags:?}: {line}"
        );
    }
    // The first request of the connection has its accept.
    assert!(
        agent
            .values()
            .iter()
            .any(|l| l.get("accept_wait_ms").and_then(Value::as_f64).is_some()),
        "{flags:?}: no request with accept_wait_ms: {:?}",
        agent.values()
    );
    let stop = agent.stop();
    assert!(
        stop.is_some_and(|s| s.success()),
        "{flags:?}: agent exit {stop:?}"
    );
    Held {
        programs,
        maps,
        thread_state_misses: agent
            .summary_part("/tokentrace_summary/thread_state_misses")
            .as_u64()
            .unwrap_or_else(|| panic!("{flags:?}: no thread_state_misses in the summary")),
    }
}

fn holds(names: &BTreeSet<String>, program: &str) -> bool {
    names.iter().any(|n| n.starts_with(program))
}

/// One data path's programs, and its maps only: a map only the other path
/// uses is kernel memory charged to the agent's memory cgroup for nothing
/// (the syscall hooks' `active_io`, 6.5 MiB preallocated; the socket
/// hooks' `send_starts`, task storage kernels before 5.11 lack).
#[test]
fn root_one_data_path_is_loaded() {
    require_root("root_one_data_path_is_loaded");
    let socket = socket_data_hooks();
    let Held {
        programs: auto,
        maps: auto_maps,
        ..
    } = held_while_tracing(&[]);
    eprintln!("[test] socket hooks on this kernel: {socket}; auto loads {auto:?}, {auto_maps:?}");
    let run = format!("auto (socket hooks {socket})");
    if socket {
        assert_data_path(&auto, &SOCKET_PROGRAMS, &SYSCALL_PROGRAMS, &run);
        assert_eq!(
            holds(&auto, SEND_START_PROGRAM),
            kernel_has_send_start(),
            "{run}: the send-start hook is loaded exactly where the kernel has \
             tcp_sendmsg_locked: {auto:?}"
        );
    } else {
        assert_data_path(&auto, &SYSCALL_PROGRAMS, &SOCKET_PROGRAMS, &run);
        assert!(!holds(&auto, SEND_START_PROGRAM), "{run}: {auto:?}");
    }
    // The OpenSSL calls' map, one of its two kinds (see
    // root_per_thread_state_in_task_storage_or_maps), on either path.
    assert!(
        auto_maps.contains("ssl_calls") || auto_maps.contains("task_ssl_call"),
        "{run}: {auto_maps:?}"
    );
    assert_eq!(
        auto_maps.contains("active_io"),
        !socket,
        "{run}: {auto_maps:?}"
    );
    assert_eq!(
        auto_maps.contains("send_starts"),
        socket,
        "{run}: {auto_maps:?}"
    );
    let Held {
        programs: syscall,
        maps: syscall_maps,
        ..
    } = held_while_tracing(&["--data-hooks", "syscall"]);
    let run = "--data-hooks syscall";
    assert_data_path(&syscall, &SYSCALL_PROGRAMS, &SOCKET_PROGRAMS, run);
    assert!(!holds(&syscall, SEND_START_PROGRAM), "{syscall:?}");
    assert!(
        syscall_maps.contains("active_io"),
        "{run}: {syscall_maps:?}"
    );
    assert!(
        !syscall_maps.contains("send_starts"),
        "{run}: {syscall_maps:?}"
    );
}

/// `socket_at_return`: the socket hooks without the send-start hook (one
/// hook less on every socket send of every process; what kernels 6.3 to
/// 6.15 get): each send is dated at its return, and a streaming request is
/// still reported whole.
#[test]
fn root_socket_hooks_without_the_send_start() {
    require_root("root_socket_hooks_without_the_send_start");
    if !socket_data_hooks() {
        eprintln!("[test] no socket hooks on this kernel: socket_at_return is refused");
        let err = refused("socket_at_return");
        assert!(err.contains("6.3"), "{err}");
        return;
    }
    let names = held_while_tracing(&["--data-hooks", "socket_at_return"]).programs;
    let run = "--data-hooks socket_at_return";
    assert_data_path(&names, &SOCKET_PROGRAMS, &SYSCALL_PROGRAMS, run);
    assert!(!holds(&names, SEND_START_PROGRAM), "{run}: {names:?}");
}

/// The stderr of a `tokentrace run --data-hooks <hooks>` that must fail.
fn refused(hooks: &str) -> String {
    let out = Command::new(agent_bin())
        .args([
            "run",
            "--pid",
            "1",
            "--duration",
            "1s",
            "--data-hooks",
            hooks,
        ])
        .output()
        .expect("running tokentrace run");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "--data-hooks {hooks} ran on a kernel without the socket hooks: {err}"
    );
    err
}

/// `names` holds every program of `loaded` and none of `absent`.
fn assert_data_path(names: &BTreeSet<String>, loaded: &[&str], absent: &[&str], run: &str) {
    for p in loaded {
        assert!(holds(names, p), "{run}: {p} not loaded: {names:?}");
    }
    for p in absent {
        assert!(!holds(names, p), "{run}: {p} loaded: {names:?}");
    }
}

/// Asking for the socket hooks where the kernel lacks them is refused with
/// the tracepoints that are missing; where it has them, they are used.
#[test]
fn root_socket_hooks_asked_for_explicitly() {
    require_root("root_socket_hooks_asked_for_explicitly");
    if socket_data_hooks() {
        let names = held_while_tracing(&["--data-hooks", "socket"]).programs;
        for p in SOCKET_PROGRAMS {
            assert!(
                holds(&names, p),
                "--data-hooks socket: {p} not loaded: {names:?}"
            );
        }
        assert_eq!(
            holds(&names, SEND_START_PROGRAM),
            kernel_has_send_start(),
            "--data-hooks socket: {names:?}"
        );
        return;
    }
    let err = refused("socket");
    assert!(err.contains("6.3"), "{err}");
}

/// Where per-thread state lives: in task storage where the kernel offers
/// it to tracing programs and creates it from any context (Linux 6.4+), none of the maps by thread id
/// created (~37 MiB of preallocated kernel memory charged to the agent's
/// cgroup); with `--thread-state maps` those maps and no task storage for
/// it. Either way a streaming request is reported whole.
#[test]
fn root_per_thread_state_in_task_storage_or_maps() {
    require_root("root_per_thread_state_in_task_storage_or_maps");
    let task_storage = kernel_release_at_least(6, 4);
    let auto = held_while_tracing(&[]);
    let by_thread = held_while_tracing(&["--thread-state", "maps"]);
    // A handful of threads: every one got its entries.
    assert_eq!(
        (auto.thread_state_misses, by_thread.thread_state_misses),
        (0, 0),
        "per-thread state the probes could not create (auto, maps)"
    );
    let (auto, maps) = (auto.maps, by_thread.maps);
    for (task_map, thread_map) in [
        ("task_last_read", "last_read"),
        ("task_ssl_call", "ssl_calls"),
        ("task_cuda_call", "cuda_calls"),
        ("task_cuda_work", "cuda_work"),
        ("task_offcpu", "offcpu_starts"),
    ] {
        assert_eq!(
            (auto.contains(task_map), auto.contains(thread_map)),
            (task_storage, !task_storage),
            "auto (kernel with task storage: {task_storage}): {auto:?}"
        );
        assert!(
            maps.contains(thread_map) && !maps.contains(task_map),
            "--thread-state maps: {maps:?}"
        );
    }
}

/// Whether `uname -r` is at least `major.minor`.
fn kernel_release_at_least(major: u32, minor: u32) -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_else(|e| panic!("reading /proc/sys/kernel/osrelease: {e}"));
    let mut parts = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let found = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    found >= (major, minor)
}
