//! Root-only: a real Prometheus (Debian's `prometheus` package) scrapes the
//! agent every second while streaming traffic runs against the FastAPI
//! server; then every PromQL query of the Grafana dashboard is evaluated
//! through Prometheus' HTTP API and must return series with plausible
//! values, and the scraped counts must equal what the agent's JSON lines
//! show (every inter-token gap, every stall, the cancellation, the socket
//! wait), with the in-flight gauges back at 0 once the load is over.
//!
//! Run (as root; CI does):
//!   cargo test -p tokentrace --test prometheus_dashboard -- --test-threads=1 --nocapture

use tokentrace_testkit as common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

const SERVICE: &str = "python3";
const ROUTE: &str = "/v1/chat/completions";
/// Gaps of 40 ms, above `explain.stall_threshold` (30 ms): every gap of
/// these streams is a stall.
const TOKEN_DELAY_MS: f64 = 40.0;
/// Concurrent client connections: the in-flight gauges can never exceed it.
const CONCURRENCY: u32 = 4;

/// A Prometheus server scraping one target every second, killed on drop.
struct Prometheus {
    /// Kills the server when the test ends.
    _proc: Proc,
    port: u16,
    started: Instant,
    _dir: TempDir,
}

/// A directory removed on drop.
struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Prometheus {
    fn start(target_port: u16) -> Self {
        let dir = std::env::temp_dir().join(format!("tokentrace-prom-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("data")).expect("prometheus temp dir");
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: tokentrace\n    static_configs:\n      \
                 - targets: ['127.0.0.1:{target_port}']\n"
            ),
        )
        .expect("prometheus config");
        let port = free_port();
        let mut cmd = Command::new("prometheus");
        cmd.arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let started = Instant::now();
        let child = cmd.spawn().unwrap_or_else(|e| {
            panic!("cannot start prometheus ({e}): apt-get install prometheus (Debian's package)")
        });
        let mut proc = Proc::guard("prometheus", child);
        let deadline = Instant::now() + Duration::from_secs(60);
        while http_get(port, "/-/ready").is_none_or(|(status, _)| status != 200) {
            assert!(
                proc.try_exit().is_none(),
                "prometheus exited before it was ready: {}",
                proc.stderr.tail(20)
            );
            assert!(
                Instant::now() < deadline,
                "prometheus not ready within 60 s: {}",
                proc.stderr.tail(20)
            );
            thread::sleep(Duration::from_millis(100));
        }
        let prom = Prometheus {
            _proc: proc,
            port,
            started,
            _dir: TempDir(dir),
        };
        // Its discovery hands new targets to the scrape loop only every
        // 5 s: traffic before the first scrape would never be seen live.
        while prom.scalar("up{job=\"tokentrace\"}") < 1.0 {
            assert!(
                Instant::now() < deadline,
                "prometheus did not scrape the agent within 60 s"
            );
            thread::sleep(Duration::from_millis(200));
        }
        eprintln!(
            "[test] prometheus scraping :{target_port} after {:.2} s",
            started.elapsed().as_secs_f64()
        );
        prom
    }

    /// An instant query; the vector's (labels, value) pairs.
    fn query(&self, promql: &str) -> Vec<(Value, f64)> {
        let path = format!("/api/v1/query?query={}", percent_encode(promql));
        let (status, body) = http_get(self.port, &path)
            .unwrap_or_else(|| panic!("prometheus did not answer {promql:?}"));
        let v: Value = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("prometheus answered {status} {body:?}: {e}"));
        assert_eq!(
            v.get("status").and_then(Value::as_str),
            Some("success"),
            "query {promql:?}: {body}"
        );
        let data = &v["data"];
        assert_eq!(
            data["resultType"].as_str(),
            Some("vector"),
            "query {promql:?}: {body}"
        );
        data["result"]
            .as_array()
            .map(|r| {
                r.iter()
                    .map(|s| {
                        let value = s["value"][1]
                            .as_str()
                            .and_then(|x| x.parse::<f64>().ok())
                            .unwrap_or(f64::NAN);
                        (s["metric"].clone(), value)
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The sum of an instant query's values (0 with no series).
    fn scalar(&self, promql: &str) -> f64 {
        self.query(promql).iter().map(|(_, v)| v).sum()
    }

    /// Polls until `promql` sums to `want` within `tolerance` (Prometheus
    /// has scraped the agent's latest state), or 30 s pass; returns the
    /// last value.
    fn wait_for(&self, promql: &str, want: f64, tolerance: f64) -> f64 {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let got = self.scalar(promql);
            if (got - want).abs() <= tolerance || Instant::now() >= deadline {
                return got;
            }
            thread::sleep(Duration::from_millis(250));
        }
    }
}

fn percent_encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `GET path` on loopback: (status, body), `None` when nothing answers.
fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    Some((
        status,
        if chunked {
            dechunk(body)
        } else {
            body.to_string()
        },
    ))
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// A streaming request whose client resets the connection after the first
/// event: the agent reports it `client_closed`.
fn cancelled_request(port: u16, rid: &str) {
    let body = r#"{"model":"test-model","stream":true,"max_tokens":200,"token_delay_ms":20,"ttft_ms":20,"messages":[{"role":"user","content":"hi"}]}"#;
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect to the server");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        s,
        "POST {ROUTE}?rid={rid} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send the request");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data:") {
        let n = s.read(&mut buf).expect("read the stream");
        assert!(n > 0, "the server closed before the first event");
        seen.extend_from_slice(&buf[..n]);
    }
    // SO_LINGER 0: the close sends an RST, a client that is certainly gone
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    use std::os::fd::AsRawFd;
    // SAFETY: a valid socket fd and a correctly sized `linger` value.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            std::ptr::addr_of!(linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "setsockopt SO_LINGER");
}

/// Whether every bucket rate under `histogram_quantile(q, inner)` is 0 for
/// the series `labels` (the quantile of nothing is NaN).
fn no_observations(prom: &Prometheus, promql: &str, labels: &Value) -> bool {
    let Some(inner) = promql
        .split_once(", ")
        .map(|(_, rest)| rest)
        .and_then(|rest| rest.strip_suffix(')'))
    else {
        return false;
    };
    let same = |m: &Value| {
        labels
            .as_object()
            .is_some_and(|l| l.iter().all(|(k, v)| m.get(k) == Some(v)))
    };
    let buckets: Vec<f64> = prom
        .query(inner)
        .into_iter()
        .filter(|(m, _)| same(m))
        .map(|(_, v)| v)
        .collect();
    !buckets.is_empty() && buckets.iter().all(|v| *v == 0.0)
}

fn f64_of(v: &Value, k: &str) -> f64 {
    v.get(k).and_then(Value::as_f64).unwrap_or(0.0)
}

/// (panel title, PromQL) or (series selector, label name).
type Labelled = (String, String);

/// Every PromQL query of the dashboard, with Grafana's variables replaced:
/// `$service` by the traced server's service, `$model`/`$route` by "all",
/// `$__rate_interval` by a window covering the whole test. The template
/// variables' `label_values(selector, label)` become (selector, label).
fn dashboard_queries(window: &str) -> (Vec<Labelled>, Vec<Labelled>) {
    let text =
        std::fs::read_to_string(repo_root().join("deploy/grafana/tokentrace-dashboard.json"))
            .expect("read the dashboard");
    let d: Value = serde_json::from_str(&text).expect("dashboard JSON");
    let fill = |e: &str| {
        e.replace("$__rate_interval", window)
            .replace("$service", SERVICE)
            .replace("$model", ".*")
            .replace("$route", ".*")
    };
    let mut panels = Vec::new();
    for p in d["panels"].as_array().expect("panels") {
        let title = p["title"].as_str().unwrap_or_default();
        for t in p["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = t["expr"].as_str() {
                panels.push((title.to_string(), fill(expr)));
            }
        }
    }
    let mut variables = Vec::new();
    for v in d["templating"]["list"].as_array().expect("templating") {
        let Some(q) = v["query"]["query"].as_str() else {
            continue;
        };
        let inner = q
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
            .unwrap_or_else(|| panic!("variable query {q:?} is not label_values(…)"));
        let (selector, label) = inner
            .rsplit_once(',')
            .unwrap_or_else(|| panic!("variable query {q:?} names no label"));
        variables.push((fill(selector.trim()), label.trim().to_string()));
    }
    (panels, variables)
}

#[test]
fn root_every_dashboard_panel_returns_plausible_series_from_a_real_prometheus() {
    require_root("root_every_dashboard_panel_returns_plausible_series_from_a_real_prometheus");
    let server = start_server(ServerKind::FastApi, &[]);
    let metrics_port = free_port();
    let mut args = Agent::for_pids(&[server.pid()]);
    args.extend([
        "--metrics-addr".to_string(),
        format!("127.0.0.1:{metrics_port}"),
    ]);
    let mut agent = start_agent(&args);
    let prom = Prometheus::start(metrics_port);

    let mut run = ClientRun::sse(24, CONCURRENCY, "prom-");
    run.token_delay_ms = TOKEN_DELAY_MS;
    // 20 tokens: each request streams for ~0.8 s, the load lasts several
    // scrapes and in-flight samples
    run.tokens = 20;
    // first, so that its series are in many scrapes before the panels are
    // evaluated
    cancelled_request(server.port, "prom-cancel");
    let cancel_path = format!("{ROUTE}?rid=prom-cancel");
    // reported, so no longer in flight when the load starts: the peak
    // bound below is the load's alone
    assert!(
        agent
            .wait_for_path(&cancel_path, Duration::from_secs(30))
            .is_some(),
        "the agent did not report the cancelled request"
    );
    let client = run_client(server.port, &run);
    let mut want_paths = paths(&client);
    want_paths.insert(cancel_path);
    let missing = agent.wait_for_paths(&want_paths, Duration::from_secs(30));
    assert!(missing.is_empty(), "the agent did not report {missing:?}");
    let lines = agent.values();
    assert_eq!(
        lines.len(),
        want_paths.len(),
        "one line per request: {lines:?}"
    );

    // What the agent's JSON lines say, to compare with what was scraped.
    let gaps: usize = lines
        .iter()
        .map(|v| v["itl_ms"].as_array().map_or(0, Vec::len))
        .sum();
    let stalls: Vec<&Value> = lines
        .iter()
        .flat_map(|v| v["stalls"].as_array().into_iter().flatten())
        .collect();
    let stall_seconds: f64 = stalls
        .iter()
        .map(|s| {
            [
                "queue_ms",
                "prefill_ms",
                "gpu_sync_ms",
                "flow_control_ms",
                "off_cpu_ms",
                "socket_ms",
                "unexplained_ms",
            ]
            .iter()
            .map(|k| f64_of(s, k))
            .sum::<f64>()
                / 1e3
        })
        .sum();
    let socket_wait: f64 = lines
        .iter()
        .map(|v| f64_of(v, "socket_wait_ms") / 1e3)
        .sum();
    let cancelled = lines
        .iter()
        .filter(|v| v["abort_reason"].as_str() == Some("client_closed"))
        .count();
    assert_eq!(
        cancelled, 1,
        "the reset request is the only client_closed one: {lines:?}"
    );
    assert!(
        stalls.len() >= client.len(),
        "every 40 ms gap is a stall (30 ms threshold): {} stalls for {} requests",
        stalls.len(),
        client.len()
    );
    eprintln!(
        "[test] agent JSON: {} requests, {gaps} gaps, {} stalls ({stall_seconds:.3} s), socket wait {socket_wait:.4} s",
        lines.len(),
        stalls.len()
    );

    let svc = format!("{{service_name=\"{SERVICE}\"}}");
    // JSON milliseconds have 3 decimals: each summed field may be 0.5 µs off
    let rounding = |fields: usize| fields as f64 * 0.5e-6 + 1e-9;
    for (promql, want, tolerance) in [
        (
            "sum(tokentrace_requests_total)".to_string(),
            lines.len() as f64,
            0.0,
        ),
        (
            format!("sum(gen_ai_server_request_duration_seconds_count{svc})"),
            lines.len() as f64,
            0.0,
        ),
        (
            format!("sum(gen_ai_server_inter_token_latency_seconds_count{svc})"),
            gaps as f64,
            0.0,
        ),
        (
            format!("sum(tokentrace_stall_duration_seconds_count{svc})"),
            stalls.len() as f64,
            0.0,
        ),
        (
            format!("sum(tokentrace_stall_time_seconds_total{svc})"),
            stall_seconds,
            rounding(7 * stalls.len()),
        ),
        (
            format!("sum(tokentrace_socket_wait_seconds_total{svc})"),
            socket_wait,
            rounding(lines.len()),
        ),
        (
            format!("sum(tokentrace_client_cancellations_total{svc})"),
            cancelled as f64,
            0.0,
        ),
        // the agent samples open requests every second; once it has seen
        // the last one finish, both phases read 0
        (format!("sum(tokentrace_requests_in_flight{svc})"), 0.0, 0.0),
    ] {
        let got = prom.wait_for(&promql, want, tolerance);
        assert!(
            (got - want).abs() <= tolerance,
            "{promql} = {got}, the agent's JSON lines say {want} (± {tolerance})"
        );
    }
    // During the load the gauge saw requests, never more than the client's
    // connections.
    let window = format!("{}s", prom.started.elapsed().as_secs() + 30);
    let peak = prom.scalar(&format!(
        "max_over_time(sum(tokentrace_requests_in_flight{svc})[{window}:1s])"
    ));
    assert!(
        (1.0..=f64::from(CONCURRENCY)).contains(&peak),
        "peak requests in flight {peak}, expected 1..={CONCURRENCY}"
    );
    let phases: Vec<String> = prom
        .query(&format!("tokentrace_requests_in_flight{svc}"))
        .iter()
        .filter_map(|(m, _)| m["phase"].as_str().map(str::to_owned))
        .collect();
    assert!(
        phases.iter().any(|p| p == "streaming"),
        "phases seen: {phases:?}"
    );

    // Two more scrapes: a series first scraped in the last one has a single
    // sample, which `rate` cannot use.
    let scrapes = format!("count_over_time(up{{job=\"tokentrace\"}}[{window}])");
    let seen = prom.scalar(&scrapes);
    let deadline = Instant::now() + Duration::from_secs(30);
    while prom.scalar(&scrapes) < seen + 2.0 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(200));
    }

    let (panels, variables) = dashboard_queries(&window);
    assert!(panels.len() >= 30, "only {} panel queries", panels.len());
    let mut failures = Vec::new();
    let mut empty_quantiles = 0;
    for (title, promql) in &panels {
        let series = prom.query(promql);
        if series.is_empty() {
            failures.push(format!("{title}: no series from {promql}"));
        }
        let quantile = promql.starts_with("histogram_quantile");
        for (labels, value) in &series {
            if quantile && value.is_nan() && no_observations(&prom, promql, labels) {
                // Prometheus' answer for a label set whose buckets did not
                // grow in the window (its series appeared with its count)
                empty_quantiles += 1;
                continue;
            }
            if !value.is_finite() || *value < 0.0 {
                failures.push(format!("{title}: {value} for {labels} from {promql}"));
            }
            // a quantile is a latency: between 0 and the largest bound
            if quantile && !(*value > 0.0 && *value <= 600.0) {
                failures.push(format!(
                    "{title}: quantile {value} for {labels} from {promql}"
                ));
            }
        }
        if quantile && !series.iter().any(|(_, v)| v.is_finite()) {
            failures.push(format!("{title}: no finite quantile from {promql}"));
        }
    }
    for (selector, label) in &variables {
        let values: Vec<String> = prom
            .query(selector)
            .iter()
            .filter_map(|(m, _)| m[label.as_str()].as_str().map(str::to_owned))
            .collect();
        if values.is_empty() {
            failures.push(format!("variable: no {label} on {selector}"));
        }
    }
    eprintln!(
        "[test] {} panel queries and {} variables evaluated, {} failures, {empty_quantiles} quantile series of nothing (NaN)",
        panels.len(),
        variables.len(),
        failures.len()
    );
    let stop = agent.stop();
    assert!(
        stop.is_some_and(|s| s.success()),
        "agent exit {stop:?}: {}",
        agent.proc.stderr.tail(20)
    );
    drop(prom);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
