//! Root-only: the agent's image (`cargo xtask image`, built from
//! deploy/Dockerfile) run the way the kubelet runs the DaemonSet, every
//! setting taken from the manifest `kubectl kustomize` renders:
//! capabilities (drop ALL, add the four), read-only root filesystem,
//! hostPID, uid 0, the host mounts with their read-only flags, the
//! ConfigMap's config.yaml, the container's args and env; and a seccomp
//! profile with containerd's RuntimeDefault rules for `bpf` and
//! `perf_event_open` (allowed to CAP_BPF / CAP_PERFMON holders; podman's own
//! default allows them only with CAP_SYS_ADMIN), written here from
//! podman's default profile. The privileged overlay
//! (deploy/kubernetes/privileged) runs the same checks.
//!
//! It traces, counted exactly:
//! - a plaintext streaming server on the host;
//! - an HTTPS streaming server inside another container, whose libssl
//!   exists only in that container's filesystem (reached through
//!   /proc/PID/root);
//! - a process firing `llm:*` USDT probes inside another container.
//!
//! and checks exact chunk counts, the host server's request start and TTFT
//! against a loopback capture, `container.id` on the spans of the HTTPS
//! container's process (OTLP to a real collector, rotel), `/readyz` after
//! `ready`. The agent's container runs on the host's network (to reach the
//! collector and be asked /readyz from the host); its other settings are
//! the manifest's. HTTPS timing against the wire is ebpf_tls's.
//!
//! Needs podman, runc and mmdebstrap (apt) and the images `cargo xtask
//! image` builds; `cargo xtask test` provides them. Run as root:
//!   cargo test -p tokentrace --test container_daemonset -- --test-threads=1

use tokentrace_testkit as common;

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use common::tls::TlsDir;
use common::{otel, wire, *};

/// The image `cargo xtask image` builds, and the test-server image it
/// makes beside it (Debian bookworm with python3, whose `_ssl` links the
/// container's own libssl.so.3).
const SERVER_IMAGE: &str = "localhost/tokentrace-test-python:bookworm";

fn agent_image() -> String {
    let manifest = std::fs::read_to_string(repo_root().join("Cargo.toml")).expect("Cargo.toml");
    let version = manifest
        .lines()
        .find_map(|l| l.strip_prefix("version = "))
        .map(|v| v.trim().trim_matches('"').to_string())
        .expect("a version in the workspace Cargo.toml");
    format!("localhost/tokentrace:{version}")
}

/// podman with the options this machine needs (runc: crun refuses the
/// hybrid cgroup layout), as a command line…
fn podman_args() -> Vec<String> {
    [
        "podman",
        "--runtime",
        "runc",
        "--cgroup-manager",
        "cgroupfs",
    ]
    .map(String::from)
    .to_vec()
}

/// … and as a command.
fn podman() -> Command {
    let args = podman_args();
    let mut cmd = Command::new(&args[0]);
    cmd.args(&args[1..]);
    cmd
}

fn require_image(name: &str) {
    let exists = podman()
        .args(["image", "exists", name])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        exists,
        "image {name} is not in podman's store: build it with `cargo xtask image` (`cargo xtask \
         test` does). This test does not skip."
    );
}

/// Removes the container `name` when dropped (a killed `podman run` can
/// leave it running).
struct Container(String);

impl Drop for Container {
    fn drop(&mut self) {
        let _ = podman()
            .args(["rm", "-f", "-t", "2", &self.0])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

fn unique(prefix: &str) -> String {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{prefix}-{}-{n}", std::process::id())
}

/// The manifest `kubectl kustomize DIR` renders, as YAML documents.
fn rendered(dir: &str) -> Vec<serde_yaml::Value> {
    let out = Command::new("kubectl")
        .args(["kustomize", dir])
        .current_dir(repo_root())
        .output()
        .expect("kubectl (installed by `cargo xtask deps`)");
    assert!(
        out.status.success(),
        "kubectl kustomize {dir}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| serde_yaml::Value::deserialize(doc).expect("YAML document"))
        .collect()
}

use serde::Deserialize;

fn kind<'a>(docs: &'a [serde_yaml::Value], kind: &str) -> &'a serde_yaml::Value {
    docs.iter()
        .find(|d| d["kind"].as_str() == Some(kind))
        .unwrap_or_else(|| panic!("no {kind} in the rendered manifest"))
}

/// podman's default seccomp profile with containerd's RuntimeDefault rule
/// for the two calls the agent needs: `bpf` to CAP_BPF holders,
/// `perf_event_open` to CAP_PERFMON holders (podman 4.3 allows both only
/// to CAP_SYS_ADMIN).
fn runtime_default_seccomp(dir: &Path) -> PathBuf {
    let base = std::fs::read_to_string("/usr/share/containers/seccomp.json")
        .expect("podman's default seccomp profile (apt: podman)");
    let mut profile: Value = serde_json::from_str(&base).expect("seccomp.json");
    let calls = ["bpf", "perf_event_open"];
    let rules = profile["syscalls"].as_array_mut().expect("syscalls");
    for rule in rules.iter_mut() {
        if let Some(names) = rule["names"].as_array_mut() {
            names.retain(|n| !calls.contains(&n.as_str().unwrap_or("")));
        }
    }
    rules.retain(|r| r["names"].as_array().is_some_and(|n| !n.is_empty()));
    for (call, cap) in [
        ("bpf", "CAP_BPF"),
        ("bpf", "CAP_SYS_ADMIN"),
        ("perf_event_open", "CAP_PERFMON"),
        ("perf_event_open", "CAP_SYS_ADMIN"),
    ] {
        rules.push(serde_json::json!({
            "names": [call],
            "action": "SCMP_ACT_ALLOW",
            "args": [],
            "includes": {"caps": [cap]},
            "excludes": {},
        }));
    }
    let path = dir.join("seccomp-runtime-default.json");
    std::fs::write(&path, serde_json::to_string_pretty(&profile).expect("JSON"))
        .expect("writing the seccomp profile");
    path
}

/// `podman run` options for the rendered DaemonSet's pod and container.
fn kubelet_options(docs: &[serde_yaml::Value], scratch: &Path) -> (Vec<String>, Vec<String>) {
    let ds = kind(docs, "DaemonSet");
    let pod = &ds["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let sc = &c["securityContext"];
    let mut opts: Vec<String> = Vec::new();
    let mut push = |args: &[&str]| opts.extend(args.iter().map(|a| a.to_string()));
    if pod["hostPID"].as_bool() == Some(true) {
        push(&["--pid", "host"]);
    }
    if sc["privileged"].as_bool() == Some(true) {
        push(&["--privileged"]);
    }
    if let Some(drop) = sc["capabilities"]["drop"].as_sequence() {
        for cap in drop.iter().filter_map(|c| c.as_str()) {
            push(&["--cap-drop", cap]);
        }
    }
    if let Some(add) = sc["capabilities"]["add"].as_sequence() {
        for cap in add.iter().filter_map(|c| c.as_str()) {
            push(&["--cap-add", cap]);
        }
    }
    if sc["readOnlyRootFilesystem"].as_bool() == Some(true) {
        push(&["--read-only"]);
    }
    if sc["allowPrivilegeEscalation"].as_bool() == Some(false) {
        push(&["--security-opt", "no-new-privileges"]);
    }
    let uid = sc["runAsUser"].as_u64().unwrap_or(0);
    let gid = sc["runAsGroup"].as_u64().unwrap_or(uid);
    push(&["--user", &format!("{uid}:{gid}")]);
    match pod["securityContext"]["seccompProfile"]["type"].as_str() {
        Some("Unconfined") => push(&["--security-opt", "seccomp=unconfined"]),
        _ => {
            let profile = runtime_default_seccomp(scratch);
            push(&["--security-opt", &format!("seccomp={}", profile.display())]);
        }
    }
    // Volumes: hostPaths as they are, the ConfigMap as files.
    let volumes = pod["volumes"].as_sequence().expect("volumes");
    let configmaps: Vec<&serde_yaml::Value> = docs
        .iter()
        .filter(|d| d["kind"].as_str() == Some("ConfigMap"))
        .collect();
    for mount in c["volumeMounts"].as_sequence().expect("volumeMounts") {
        let name = mount["name"].as_str().expect("mount name");
        let target = mount["mountPath"].as_str().expect("mountPath");
        let ro = if mount["readOnly"].as_bool() == Some(true) {
            ":ro"
        } else {
            ""
        };
        let volume = volumes
            .iter()
            .find(|v| v["name"].as_str() == Some(name))
            .unwrap_or_else(|| panic!("no volume {name}"));
        let source = if let Some(path) = volume["hostPath"]["path"].as_str() {
            PathBuf::from(path)
        } else if let Some(cm) = volume["configMap"]["name"].as_str() {
            let map = configmaps
                .iter()
                .find(|d| d["metadata"]["name"].as_str() == Some(cm))
                .unwrap_or_else(|| panic!("no ConfigMap {cm}"));
            let dir = scratch.join(format!("configmap-{name}"));
            std::fs::create_dir_all(&dir).expect("configmap dir");
            for (key, value) in map["data"].as_mapping().expect("ConfigMap data") {
                let key = key.as_str().expect("data key");
                std::fs::write(dir.join(key), value.as_str().unwrap_or("")).expect("writing");
            }
            dir
        } else if volume["emptyDir"].is_mapping() {
            let dir = scratch.join(format!("emptydir-{name}"));
            std::fs::create_dir_all(&dir).expect("emptyDir");
            dir
        } else {
            panic!("volume {name}: a kind this test does not map: {volume:?}");
        };
        push(&["-v", &format!("{}:{target}{ro}", source.display())]);
    }
    for env in c["env"].as_sequence().into_iter().flatten() {
        let name = env["name"].as_str().expect("env name");
        let value = match env["value"].as_str() {
            Some(v) => v.to_string(),
            // The downward API's spec.nodeName.
            None if env["valueFrom"]["fieldRef"]["fieldPath"].as_str() == Some("spec.nodeName") => {
                "test-node".to_string()
            }
            None => panic!("env {name}: a source this test does not map"),
        };
        push(&["-e", &format!("{name}={value}")]);
    }
    let args: Vec<String> = c["args"]
        .as_sequence()
        .expect("args")
        .iter()
        .filter_map(|a| a.as_str().map(str::to_string))
        .collect();
    (opts, args)
}

/// A container of [`SERVER_IMAGE`] running `cmd` on the host's network
/// (loopback reaches it), its own pid and mount namespaces, with the
/// repository's tests/ and target/native/ mounted read-only.
fn server_container(name: &str, extra: &[String], cmd: &[&str]) -> Command {
    let mut c = podman();
    c.args(["run", "--rm", "-i", "--name", name, "--network", "host"])
        .args(ULIMITS)
        .arg("-v")
        .arg(format!("{}:/tests:ro", repo_root().join("tests").display()))
        .arg("-v")
        .arg(format!("{}:/native:ro", native_dir().display()))
        .args(extra)
        .arg(SERVER_IMAGE)
        .args(cmd);
    c
}

const ULIMITS: [&str; 4] = [
    "--ulimit",
    "nofile=1024:1024",
    "--ulimit",
    "nproc=1024:1024",
];

/// The host pid of container `name`'s main process.
fn container_pid(name: &str) -> u32 {
    let out = podman()
        .args(["inspect", "--format", "{{.State.Pid}}", name])
        .output()
        .expect("podman inspect");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("no pid for container {name}: {out:?}"))
}

/// The USDT driver (tests/native/probe_driver.py) in a container, held at
/// its gate.
struct UsdtDriver {
    driver: ProbeDriver,
    pid: u32,
    _container: Container,
}

impl UsdtDriver {
    fn start(iterations: u64) -> UsdtDriver {
        let name = unique("tt-usdt");
        let iterations = iterations.to_string();
        let driver = ProbeDriver::start(
            "USDT driver container",
            &mut server_container(
                &name,
                &[],
                &[
                    "python3",
                    "/tests/native/probe_driver.py",
                    "--usdt",
                    "/native/libllm_usdt.so",
                    "--iterations",
                    &iterations,
                ],
            ),
        );
        let pid = container_pid(&name);
        UsdtDriver {
            driver,
            pid,
            _container: Container(name),
        }
    }
}

fn daemonset_scenario(title: &str, overlay: &str) {
    require_root(title);
    let image = agent_image();
    require_image(&image);
    require_image(SERVER_IMAGE);
    let scratch = std::env::temp_dir().join(unique("tt-kubelet"));
    std::fs::create_dir_all(&scratch).expect("scratch dir");
    let docs = rendered(overlay);
    let (options, manifest_args) = kubelet_options(&docs, &scratch);

    // 1. plaintext, on the host
    let host_server = start_server(ServerKind::Stdlib, &[]);
    // 2. HTTPS inside a container, with the container's own libssl
    let tls = TlsDir::new("kubelet");
    let https_name = unique("tt-https");
    let mut https_cmd = server_container(
        &https_name,
        &["-v".into(), format!("{}:/tls:ro", tls.dir.display())],
        &[
            "python3",
            "-u",
            "/tests/servers/stdlib_sse.py",
            "--port",
            "0",
            "--ssl-certfile",
            "/tls/cert.pem",
            "--ssl-keyfile",
            "/tls/key.pem",
        ],
    );
    let (_https_proc, https_port) = start_ready(
        "HTTPS server container",
        &mut https_cmd,
        "podman, and the test-server image",
    );
    let _https_container = Container(https_name.clone());
    let https_pid = container_pid(&https_name);
    let root_libssl =
        std::fs::read_to_string(format!("/proc/{https_pid}/maps")).unwrap_or_default();
    assert!(
        root_libssl.contains("libssl.so"),
        "{title}: the container's python maps no libssl"
    );
    // 3. USDT inside a container
    let usdt = UsdtDriver::start(200);

    // The agent, as the kubelet would run it, but on the host's network:
    // its spans go to a collector on the host's loopback (in a cluster,
    // over the pod network), and /readyz is asked from the host.
    let collector = otel::Collector::start(free_port(), free_port());
    let metrics_port = free_port();
    let agent_name = unique("tt-agent");
    let mut command = podman_args();
    command.extend(
        [
            "run",
            "--rm",
            "-i",
            "--name",
            &agent_name,
            "--network",
            "host",
        ]
        .map(String::from),
    );
    command.extend(ULIMITS.map(String::from));
    command.extend(options);
    command.extend([
        "-e".to_string(),
        format!(
            "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:{}",
            collector.grpc_port
        ),
        "-e".to_string(),
        "OTEL_EXPORTER_OTLP_PROTOCOL=grpc".to_string(),
    ]);
    command.push(image.clone());
    let _agent_container = Container(agent_name.clone());
    // The manifest's args after `run` (its metrics address on a free
    // port), then the processes to trace.
    let mut args: Vec<String> = manifest_args
        .into_iter()
        .skip_while(|a| a == "run")
        .filter(|a| a != "--output=json")
        .map(|a| {
            if a.starts_with("--metrics-addr=") {
                format!("--metrics-addr=127.0.0.1:{metrics_port}")
            } else {
                a
            }
        })
        .collect();
    for pid in [host_server.pid(), https_pid, usdt.pid] {
        args.extend(["--pid".into(), pid.to_string()]);
    }
    let mut agent = start_agent_command(&command, &args, &[]);
    eprintln!(
        "[test] {title}: agent in its container ready after {:.2} s",
        agent.ready_after.as_secs_f64()
    );
    let missing = agent.wait_for_log(
        &[": OpenSSL (", "libllm_usdt.so: USDT llm ("],
        Duration::from_secs(20),
    );
    assert!(
        missing.is_empty(),
        "{title}: probes not attached: {missing:?}\n{}",
        agent.proc.stderr.tail(30)
    );
    assert!(
        agent
            .proc
            .stderr
            .lines()
            .iter()
            .any(|l| l.contains(": OpenSSL (") && l.contains(&format!("pid {https_pid}"))),
        "{title}: no OpenSSL probes for the container's pid {https_pid}"
    );
    let readyz = http_status(metrics_port, "/readyz");
    assert_eq!(readyz, 200, "{title}: /readyz after `ready`");

    let capture = wire::Capture::start(host_server.port);
    // One request per connection: the capture's first payload packet of a
    // connection is its request.
    let plain = run_client(host_server.port, &ClientRun::sse(8, 8, "plain-"));
    let mut secure = ClientRun::sse(8, 2, "tls-");
    secure.tls = true;
    let https = run_client(https_port, &secure);
    let counts = usdt.driver.run();
    let all: Vec<&ClientRecord> = plain.iter().chain(https.iter()).collect();
    let paths: BTreeSet<String> = all.iter().map(|c| c.path.clone()).collect();
    let missing = agent.wait_for_paths(&paths, Duration::from_secs(20));
    let packets = capture.finish();
    let https_spans = wait_for_spans(&collector, https_pid, https.len());
    let stop = agent.stop();
    let mut report = Report::new();
    check_agent_exit(&agent, stop, &mut report);
    report
        .failures
        .extend(missing.iter().map(|p| format!("not reported: {p}")));
    let values = agent.values();
    let mut start = Dist::new("request_start_ns - wire arrival (ms)");
    let mut ttft = Dist::new("agent TTFT - wire TTFT (ms)");
    for c in &all {
        let seen: Vec<&Value> = values
            .iter()
            .filter(|v| str_field(v, "path").as_deref() == Some(c.path.as_str()))
            .collect();
        let [one] = seen[..] else {
            report
                .failures
                .push(format!("{}: reported {} times", c.path, seen.len()));
            continue;
        };
        if one.get("chunks").and_then(Value::as_u64) != Some(c.chunks) {
            report.failures.push(format!(
                "{}: agent chunks {:?}, client {}",
                c.path,
                one.get("chunks"),
                c.chunks
            ));
        }
        let want_pid = if c.tls { https_pid } else { host_server.pid() };
        if one.get("pid").and_then(Value::as_u64) != Some(u64::from(want_pid)) {
            report.failures.push(format!(
                "{}: pid {:?}, expected {want_pid}",
                c.path,
                one.get("pid")
            ));
        }
        if one.get("tls").and_then(Value::as_bool) != Some(c.tls) {
            report
                .failures
                .push(format!("{}: tls {:?}", c.path, one.get("tls")));
        }
        if !c.tls {
            wire_compare(
                c,
                one,
                &packets,
                host_server.port,
                &mut start,
                &mut ttft,
                &mut report,
            );
        }
    }
    for d in [&start, &ttft] {
        eprintln!("[test] {title}: {}", d.summary());
    }
    // Load on the host moves neither side: the kernel's stamps against the
    // device's (ebpf_wire's bound).
    let worst = |d: &Dist| d.max().abs().max(d.min().abs());
    if start.xs.len() != plain.len() || ttft.xs.len() != plain.len() {
        report.failures.push(format!(
            "wire: {} of {} plaintext requests compared",
            ttft.xs.len(),
            plain.len()
        ));
    } else if worst(&ttft) >= WIRE_BOUND_MS || worst(&start) >= WIRE_BOUND_MS {
        report.failures.push(format!(
            "against the wire, beyond {WIRE_BOUND_MS} ms: {}; {}",
            start.summary(),
            ttft.summary()
        ));
    }
    let container_id = container_full_id(&https_name);
    let ids: BTreeSet<Option<&str>> = https_spans
        .iter()
        .map(|s| s.resource_attr("container.id"))
        .collect();
    if https_spans.len() < https.len() || ids != BTreeSet::from([Some(container_id.as_str())]) {
        report.failures.push(format!(
            "spans of the HTTPS container's process: {} (want >= {}), container.id {ids:?}, want {container_id}",
            https_spans.len(),
            https.len()
        ));
    }
    let host_ids: BTreeSet<Option<String>> = collector
        .spans()
        .iter()
        .filter(|s| s.resource_attr("process.pid") == Some(host_server.pid().to_string().as_str()))
        .map(|s| s.resource_attr("container.id").map(str::to_string))
        .collect();
    if host_ids.iter().any(Option::is_some) {
        report.failures.push(format!(
            "the host server's spans carry a container.id: {host_ids:?}"
        ));
    }
    let inference = agent.inference_summary();
    if counts["usdt_tokens"].as_u64() != Some(200)
        || inference.get("usdt_events").and_then(Value::as_u64) != Some(200)
    {
        report
            .failures
            .push(format!("USDT: driver {counts}, agent {inference}"));
    }
    eprintln!(
        "[test] {title}: {} requests, {} HTTPS spans with container.id {container_id}, USDT {counts} / {inference}",
        all.len(),
        https_spans.len()
    );
    let _ = std::fs::remove_dir_all(&scratch);
    report.assert_ok(title);
}

/// Bound on |agent − wire| for request start and TTFT (ebpf_wire's p99
/// bound, here on every request).
const WIRE_BOUND_MS: f64 = 0.5;

/// Adds one plaintext request's request start and TTFT against the
/// loopback capture.
fn wire_compare(
    c: &ClientRecord,
    agent: &Value,
    packets: &[wire::Packet],
    server_port: u16,
    start: &mut Dist,
    ttft: &mut Dist,
    report: &mut Report,
) {
    let client_port = c
        .client_addr
        .as_deref()
        .and_then(|a| a.rsplit_once(':'))
        .and_then(|(_, p)| p.parse::<u16>().ok());
    let Some(client_port) = client_port else {
        report
            .failures
            .push(format!("{}: the client gave no address", c.path));
        return;
    };
    let (Some(w_req), Some(w_ev)) = wire::wire_times(packets, server_port, client_port) else {
        report
            .failures
            .push(format!("{}: not in the capture", c.path));
        return;
    };
    let (Some(rs), Some(at)) = (
        agent.get("request_start_ns").and_then(Value::as_u64),
        agent.get("ttft_ms").and_then(Value::as_f64),
    ) else {
        report
            .failures
            .push(format!("{}: no request_start_ns/ttft_ms: {agent}", c.path));
        return;
    };
    let ms = |a: u64, b: u64| (a as f64 - b as f64) / 1e6;
    start.push(ms(rs, w_req));
    ttft.push(at - ms(w_ev, w_req));
}

/// The full id of container `name`.
fn container_full_id(name: &str) -> String {
    let out = podman()
        .args(["inspect", "--format", "{{.Id}}", name])
        .output()
        .expect("podman inspect");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Waits (20 s) until the collector holds at least `want` spans of `pid`'s
/// resource; returns them.
fn wait_for_spans(collector: &otel::Collector, pid: u32, want: usize) -> Vec<otel::RecvSpan> {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let spans: Vec<otel::RecvSpan> = collector
            .spans()
            .into_iter()
            .filter(|s| s.resource_attr("process.pid") == Some(pid.to_string().as_str()))
            .collect();
        if spans.len() >= want || std::time::Instant::now() >= deadline {
            return spans;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The status of `GET path` on 127.0.0.1:`port`.
fn http_status(port: u16, path: &str) -> u16 {
    use std::io::Read;
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))
        .unwrap_or_else(|e| panic!("connecting to the agent's metrics port {port}: {e}"));
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .expect("request");
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

#[test]
fn root_container_daemonset_as_the_kubelet_runs_it() {
    daemonset_scenario(
        "the image under the DaemonSet's settings",
        "deploy/kubernetes/base",
    );
}

#[test]
fn root_container_privileged_variant_as_the_kubelet_runs_it() {
    daemonset_scenario(
        "the image under the privileged variant",
        "deploy/kubernetes/privileged",
    );
}

/// `tokentrace check` in the image with the DaemonSet's settings: with
/// containerd's RuntimeDefault rules for `bpf`/`perf_event_open` every
/// required line is ok and the uprobes attach as uprobe_multi links; with
/// podman 4.3's own default profile (those calls only for CAP_SYS_ADMIN)
/// nothing loads, which is why the profile above is containerd's.
#[test]
fn root_container_check_under_runtime_default_and_podman_default_seccomp() {
    let title = "tokentrace check in the image";
    require_root(title);
    let image = agent_image();
    require_image(&image);
    let scratch = std::env::temp_dir().join(unique("tt-check"));
    std::fs::create_dir_all(&scratch).expect("scratch dir");
    let docs = rendered("deploy/kubernetes/base");
    let (options, _) = kubelet_options(&docs, &scratch);
    let check = |options: &[String]| -> (bool, String) {
        let out = podman()
            .args(["run", "--rm", "--network", "none"])
            .args(ULIMITS)
            .args(options)
            .arg(&image)
            .arg("check")
            .output()
            .expect("podman run … check");
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        eprintln!("[test] {title}:\n{text}");
        (out.status.success(), text)
    };
    let (ok, text) = check(&options);
    assert!(
        ok && text.contains("tracing can work on this host"),
        "{title}: RuntimeDefault:\n{text}"
    );
    for line in [
        "uprobe_multi   ok",
        "OpenSSL/CUDA   ok",
        "USDT           ok",
    ] {
        assert!(
            text.contains(line),
            "{title}: no {line:?} under the DaemonSet's settings:\n{text}"
        );
    }
    // Where the host's kernel has the socket hooks, the DaemonSet sees them
    // too (it reads the kernel's BTF): its data path costs the node's other
    // processes nothing outside their socket calls.
    if socket_data_hooks() {
        assert!(
            text.contains("socket hooks   ok"),
            "{title}: the host has the socket hooks, the DaemonSet does not:\n{text}"
        );
    }
    assert!(
        text.lines()
            .any(|l| l.starts_with("uprobe perf") && l.contains("missing")),
        "{title}: perf-event uprobes should need CAP_SYS_ADMIN here:\n{text}"
    );
    // The same settings but podman's default seccomp profile.
    let mut podman_default = Vec::new();
    let mut it = options.iter();
    while let Some(o) = it.next() {
        if o == "--security-opt" {
            let value = it.next().expect("a value");
            if !value.starts_with("seccomp=") {
                podman_default.extend([o.clone(), value.clone()]);
            }
        } else {
            podman_default.push(o.clone());
        }
    }
    let (ok, text) = check(&podman_default);
    assert!(
        !ok && text.contains("tracing cannot work on this host"),
        "{title}: podman's default seccomp profile unexpectedly allows bpf(2) without CAP_SYS_ADMIN:\n{text}"
    );
    let _ = std::fs::remove_dir_all(&scratch);
}
