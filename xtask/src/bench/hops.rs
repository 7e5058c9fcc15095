//! The hops section of `cargo xtask bench` (`--only hops`): what tracing a
//! gateway's upstream calls costs the agent.
//!
//! nginx (`proxy_pass` to a keep-alive pool of 4) in front of
//! tests/servers/stdlib_sse.py; tests/clients/hop_client.py sends short
//! streamed requests (2 tokens, no delays) through it as fast as it can
//! (`--connections` × 4 threads, a connection per request). Rounds
//! alternate: the agent tracing the engine only (one line per request),
//! then the engine and nginx's worker (three lines per request: the
//! gateway's, its upstream call, the engine's, joined into one trace).
//! The figures: requests/s of each, the agent's CPU per request of each,
//! and what the gateway's two extra lines (client-side parsing, the hop
//! join) add per request. A round whose summary did not join every
//! request by the 4-tuple fails: a fast join that misses proves nothing.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::{cpu_ns, json_number, median, summary, Options, TracingAgent};
use crate::util::{self, free_port, start_server, Guard};

const ENGINE: &str = "tests/servers/stdlib_sse.py";
const CLIENT: &str = "tests/clients/hop_client.py";
/// nginx's keep-alive connections to the engine.
const POOL: u64 = 4;

/// nginx in the foreground with one worker, its files in `dir`.
struct Nginx {
    master: Guard,
    worker: u32,
    port: u16,
}

impl Drop for Nginx {
    /// SIGTERM first: a SIGKILLed master leaves its worker behind.
    fn drop(&mut self) {
        let _ = util::status("kill", &["-TERM", &self.master.0.id().to_string()]);
        let _ = self.master.0.wait();
    }
}

fn nginx_bin() -> &'static str {
    ["/usr/sbin/nginx", "/usr/local/sbin/nginx"]
        .into_iter()
        .find(|p| Path::new(p).is_file())
        .unwrap_or("nginx")
}

fn start_nginx(dir: &Path, upstream: u16) -> Result<Nginx> {
    let port = free_port()?;
    std::fs::create_dir_all(dir)?;
    let d = dir.display();
    let conf = dir.join("nginx.conf");
    std::fs::write(
        &conf,
        format!(
            "daemon off;\nmaster_process on;\nworker_processes 1;\nuser root;\n\
             pid {d}/nginx.pid;\nerror_log {d}/error.log;\n\
             events {{ worker_connections 1024; }}\n\
             http {{\n  access_log off;\n  client_body_temp_path {d}/client_body;\n\
             proxy_temp_path {d}/proxy;\n  fastcgi_temp_path {d}/fastcgi;\n\
             uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
             upstream engine {{ server 127.0.0.1:{upstream}; keepalive {POOL}; }}\n\
             server {{\n    listen 127.0.0.1:{port};\n    location / {{\n\
             proxy_pass http://engine;\n      proxy_http_version 1.1;\n\
             proxy_set_header Connection \"\";\n      proxy_buffering off;\n    }}\n  }}\n}}\n"
        ),
    )?;
    let master = Command::new(nginx_bin())
        .arg("-p")
        .arg(dir)
        .arg("-c")
        .arg(&conf)
        .arg("-e")
        .arg(dir.join("error.log"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting nginx (apt-get install nginx; `cargo xtask deps` does)")?;
    let master_pid = master.id();
    let master = Guard(master);
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline {
        let children =
            std::fs::read_to_string(format!("/proc/{master_pid}/task/{master_pid}/children"))
                .unwrap_or_default();
        let workers: Vec<u32> = children
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect();
        if let [worker] = workers.as_slice() {
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Ok(Nginx {
                    master,
                    worker: *worker,
                    port,
                });
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("nginx did not start its worker on port {port} within 15 s")
}

/// One client run of `requests` through the gateway: requests/s.
fn load(port: u16, requests: u64, threads: u32) -> Result<f64> {
    let t = Instant::now();
    let out = Command::new("python3")
        .arg(util::root().join(CLIENT))
        .args(["--port", &port.to_string()])
        .args(["--requests", &requests.to_string()])
        .args(["--concurrency", &threads.to_string()])
        .args(["--tokens", "2", "--token-delay-ms", "0", "--ttft-ms", "0"])
        .stdout(Stdio::null())
        .output()
        .context("running hop_client.py")?;
    if !out.status.success() {
        bail!(
            "hop_client.py failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(requests as f64 / t.elapsed().as_secs_f64())
}

/// One traced round: (requests/s, agent CPU µs per request, summary).
fn traced(
    agent_bin: &Path,
    pids: &[u32],
    port: u16,
    requests: u64,
    threads: u32,
) -> Result<(f64, f64, Vec<String>)> {
    let selector: Vec<String> = pids
        .iter()
        .flat_map(|p| ["--pid".to_string(), p.to_string()])
        .collect();
    let selector: Vec<&str> = selector.iter().map(String::as_str).collect();
    let agent = TracingAgent::spawn(agent_bin, None, &selector, Duration::from_secs(60))?;
    let before = cpu_ns(agent.pid)?;
    let rate = load(port, requests, threads)?;
    // what the last requests produced, and the held lines, are handled
    // before the agent stops; both count
    std::thread::sleep(Duration::from_millis(300));
    let ns = cpu_ns(agent.pid)? - before;
    let log = agent.stop()?;
    let us = ns as f64 / 1e3 / requests as f64;
    Ok((rate, us, log))
}

/// The summary's hops counter `key` (its JSON line).
fn hops_counter(log: &[String], key: &str) -> Option<f64> {
    log.iter()
        .find(|l| l.contains("\"tokentrace_summary\""))
        .and_then(|l| json_number(l, key))
}

pub(super) fn run(agent_bin: &Path, opts: &Options, report: &mut String) -> Result<()> {
    let engine_port = free_port()?;
    let engine = start_server(ENGINE, &["--port", &engine_port.to_string()])?;
    let engine_pid = engine.0.id();
    let dir: PathBuf = std::env::temp_dir().join(format!("tt-bench-hops-{}", std::process::id()));
    let nginx = start_nginx(&dir, engine_port)?;
    let threads = opts.connections * 4;
    // warm-up, and the request count for a round of --seconds
    let rate = load(nginx.port, 200, threads)?;
    let requests = ((rate * opts.seconds) as u64).max(200);
    let (mut engine_only, mut both) = (Vec::new(), Vec::new());
    for round in 0..opts.rounds {
        let (r1, us1, _) = traced(agent_bin, &[engine_pid], nginx.port, requests, threads)?;
        let (r2, us2, log) = traced(
            agent_bin,
            &[engine_pid, nginx.worker],
            nginx.port,
            requests,
            threads,
        )?;
        // every gateway request is seen (a connection per request); the
        // engine's first request on each pooled connection may not be (its
        // read began before the agent attached)
        let counter = |k: &str| hops_counter(&log, k).unwrap_or(0.0);
        let engine_seen = counter("requests") - requests as f64;
        let joined = counter("joined_tcp_4tuple");
        if joined != engine_seen
            || engine_seen < (requests - POOL) as f64
            || counter("unjoined_server_requests") > 0.0
        {
            bail!(
                "hops round {round}: {joined} of {engine_seen} engine requests seen ({requests} sent) \
                 joined to their upstream call: {}",
                summary(&log, &["hops:", "requests:"])
            );
        }
        let line = format!(
            "hops round {round}: {requests} requests; engine traced: {r1:.0} req/s, agent {us1:.1} µs/request; \
             engine + gateway traced: {r2:.0} req/s, agent {us2:.1} µs/request ({joined} joined by the 4-tuple)\n"
        );
        eprint!("{line}");
        report.push_str(&line);
        engine_only.push((r1, us1));
        both.push((r2, us2));
    }
    let mut rate1: Vec<f64> = engine_only.iter().map(|r| r.0).collect();
    let mut rate2: Vec<f64> = both.iter().map(|r| r.0).collect();
    let mut us1: Vec<f64> = engine_only.iter().map(|r| r.1).collect();
    let mut us2: Vec<f64> = both.iter().map(|r| r.1).collect();
    let (us1, us2) = (median(&mut us1), median(&mut us2));
    let result = format!(
        "hops (nginx proxy_pass -> stdlib_sse.py, {threads} client threads, {} rounds of {requests} requests): \
         median {:.0} req/s with the engine traced, {:.0} with the gateway too; agent CPU per request \
         {us1:.1} µs (1 line) vs {us2:.1} µs (3 lines, joined): gateway tracing adds {:.1} µs per request\n",
        opts.rounds,
        median(&mut rate1),
        median(&mut rate2),
        us2 - us1
    );
    print!("{result}");
    report.push_str(&result);
    drop(nginx);
    drop(engine);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
