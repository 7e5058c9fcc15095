//! Root-only end-to-end tests of OpenTelemetry export: the real agent (real
//! eBPF) traces a real streaming server and exports to a real OTLP
//! collector, rotel (PyPI `rotel`, a Rust OpenTelemetry collector; `pip
//! install rotel`). rotel receives over OTLP/gRPC and OTLP/HTTP and, with
//! `--debug-log traces --debug-log metrics --debug-log-verbosity detailed`,
//! prints every span and metric data point it decoded to stdout, which the
//! test parses. Nothing on the receiving side is ours.
//!
//! Run (as root; CI does):
//!   cargo test -p tokentrace --test otel_export -- --test-threads=1 --nocapture
//!
//! What is checked, per request (matched by the caller's trace id):
//! * exactly one SERVER span, in the caller's trace, child of the caller's
//!   span, with the HTTP / GenAI / tokentrace attributes, `tokentrace.ttft_ms`
//!   equal to `--output json`'s `ttft_ms`, phase spans as its children;
//! * the monotonic → wall conversion agrees with the client's own clocks
//!   within 0.1 ms (measured: a few µs), and for sequential requests the span
//!   starts within 1 ms of the client's own span (CLOCK_REALTIME just before
//!   `send`) and ends within 1 ms of the client's last `recv` (median; the
//!   Python client's wake-up latency is the spread). Concurrent requests
//!   wait in the server before it reads them: their spans rightly start
//!   later, so only their conversion is checked;
//! * Prometheus and OTLP histogram counts equal the number of requests;
//! * with a dead backend, memory stays bounded, drops are counted, and spans
//!   flow again once the backend is up;
//! * a collector down longer than the retry budget, then back on its ports:
//!   nothing dropped while the queue had room, and every agent (gRPC and
//!   HTTP) drained within 2 s of its return.

use tokentrace_testkit as common;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::otel::*;
use common::*;
use serde_json::Value;

fn trace_ids(traceparent: &str) -> (String, String) {
    let parts: Vec<&str> = traceparent.split('-').collect();
    assert_eq!(parts.len(), 4, "client traceparent {traceparent:?}");
    (parts[1].to_string(), parts[2].to_string())
}

fn write_config(name: &str, yaml: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!(
        "tokentrace-test-{}-{name}.yaml",
        std::process::id()
    ));
    std::fs::write(&path, yaml).expect("write the agent config");
    path
}

fn agent_args(server_pid: u32, extra: &[String]) -> Vec<String> {
    let mut args = Agent::for_pids(&[server_pid]);
    args.extend(extra.iter().cloned());
    args
}

fn quantile(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return f64::NAN;
    }
    s[((q * s.len() as f64).ceil() as usize).clamp(1, s.len()) - 1]
}

fn traced_runs(prefix: &str) -> Vec<ClientRun> {
    let mut seq = ClientRun::sse(12, 1, &format!("{prefix}seq-"));
    let mut conc = ClientRun::sse(8, 4, &format!("{prefix}conc-"));
    seq.traceparent = true;
    conc.traceparent = true;
    vec![seq, conc]
}

/// Checks the exported spans of every client request against the client's
/// record and the agent's JSON line. Returns the failures.
fn check_spans(
    client: &[ClientRecord],
    agent_lines: &[Value],
    spans: &[RecvSpan],
    server_pid: u32,
    service: &str,
) -> Vec<String> {
    let mut f = Vec::new();
    let json = by_path(agent_lines);
    let mut start_offsets = Vec::new();
    let mut conversion = Vec::new();
    let mut end_offsets = Vec::new();
    for c in client {
        let p = &c.path;
        let Some(tp) = c.raw.get("traceparent").and_then(Value::as_str) else {
            f.push(format!("{p}: the client sent no traceparent"));
            continue;
        };
        let (trace, parent) = trace_ids(tp);
        let servers: Vec<&RecvSpan> = spans
            .iter()
            .filter(|s| s.trace_id == trace && s.kind == "SPAN_KIND_SERVER")
            .collect();
        if servers.len() != 1 {
            f.push(format!(
                "{p}: {} server spans in trace {trace}, expected exactly one",
                servers.len()
            ));
            continue;
        }
        let s = servers[0];
        let Some(j) = json.get(p).and_then(|v| v.first()) else {
            f.push(format!("{p}: no --output json line"));
            continue;
        };
        let mut expect = |what: &str, got: Option<&str>, want: &str| {
            if got != Some(want) {
                f.push(format!("{p}: {what} is {got:?}, expected {want:?}"));
            }
        };
        expect("parent span id", Some(&s.parent_id), &parent);
        expect("span name", Some(&s.name), "POST /v1/chat/completions");
        expect("service.name", s.resource_attr("service.name"), service);
        expect(
            "process.pid",
            s.resource_attr("process.pid"),
            &server_pid.to_string(),
        );
        expect("http.request.method", s.attr("http.request.method"), "POST");
        expect(
            "http.response.status_code",
            s.attr("http.response.status_code"),
            "200",
        );
        expect("url.path", s.attr("url.path"), "/v1/chat/completions");
        expect(
            "gen_ai.operation.name",
            s.attr("gen_ai.operation.name"),
            "chat",
        );
        expect(
            "gen_ai.request.model",
            s.attr("gen_ai.request.model"),
            "test-model",
        );
        expect(
            "gen_ai.response.id",
            s.attr("gen_ai.response.id"),
            c.response_id.as_deref().unwrap_or("<none>"),
        );
        expect(
            "tokentrace.chunks",
            s.attr("tokentrace.chunks"),
            &c.chunks.to_string(),
        );
        expect("tokentrace.aborted", s.attr("tokentrace.aborted"), "false");
        expect(
            "server.port",
            s.attr("server.port"),
            j.get("local_addr")
                .and_then(Value::as_str)
                .and_then(|a| a.rsplit(':').next())
                .unwrap_or("?"),
        );
        let ttft_json = j.get("ttft_ms").and_then(Value::as_f64);
        if s.attr_f64("tokentrace.ttft_ms") != ttft_json || ttft_json.is_none() {
            f.push(format!(
                "{p}: span tokentrace.ttft_ms {:?} != --output json ttft_ms {ttft_json:?}",
                s.attr("tokentrace.ttft_ms")
            ));
        }
        for key in [
            "tokentrace.itl_p50_ms",
            "tokentrace.itl_p95_ms",
            "tokentrace.itl_max_ms",
            "tokentrace.e2e_ms",
        ] {
            let jkey = key.trim_start_matches("tokentrace.");
            if s.attr_f64(key) != j.get(jkey).and_then(Value::as_f64) {
                f.push(format!(
                    "{p}: {key} {:?} != json {jkey} {:?}",
                    s.attr(key),
                    j.get(jkey)
                ));
            }
        }
        let children: Vec<&str> = spans
            .iter()
            .filter(|x| x.trace_id == trace && x.parent_id == s.span_id)
            .map(|x| x.name.as_str())
            .collect();
        if !children.contains(&"wait for first token") || !children.contains(&"stream") {
            f.push(format!(
                "{p}: phase spans {children:?}, expected wait for first token and stream"
            ));
        }
        // timing: the client's own span starts at t_send_unix_ns
        let (Some(send_unix), Some(send_mono), Some(rs)) = (
            c.raw.get("t_send_unix_ns").and_then(Value::as_u64),
            c.t_send_ns,
            j.get("request_start_ns").and_then(Value::as_u64),
        ) else {
            f.push(format!("{p}: missing client or agent timestamps"));
            continue;
        };
        let start_ms = (s.start as f64 - send_unix as f64) / 1e6;
        let mono_ms = (rs as f64 - send_mono as f64) / 1e6;
        conversion.push(start_ms - mono_ms);
        // Concurrent requests queue in the server before it reads them, so
        // their server spans really do start later: alignment is judged on
        // the sequential ones, conversion on all.
        //
        // Per request, brackets that load cannot move: the span starts
        // after the client sent (and, read from the wire or the socket, no
        // later than the server's handler started: `X-Req-Mono-Ns`, carried
        // into wall time through the client's own clock pair), and ends
        // no later than the client's last recv returned. How close it sits
        // to the client is a distribution, judged by its median below: a
        // sequential request can wait in the socket while the box is busy
        // (seen: 3.2 ms with `stress-ng --cpu 1`, p50 0.1 ms).
        let wall = |mono: u64| send_unix as f64 / 1e6 + (mono as f64 - send_mono as f64) / 1e6;
        if start_ms < -0.05 {
            f.push(format!(
                "{p}: span starts {:.3} ms before the client sent the request",
                -start_ms
            ));
        }
        if let Some(h) = c.server_req_ns {
            let after_handler = s.start as f64 / 1e6 - wall(h);
            if after_handler > 0.05 {
                f.push(format!(
                    "{p}: span starts {after_handler:.3} ms after the server's handler started"
                ));
            }
        }
        if let Some(e2e) = c.e2e_ns {
            let end_gap = (send_unix + e2e) as f64 / 1e6 - s.end as f64 / 1e6;
            if end_gap < -0.05 {
                f.push(format!(
                    "{p}: span ends {:.3} ms after the client received the end of the response",
                    -end_gap
                ));
            }
            if p.contains("seq-") {
                end_offsets.push(end_gap);
            }
        }
        if p.contains("seq-") {
            start_offsets.push(start_ms);
        }
    }
    let q = |v: &[f64]| {
        format!(
            "p50 {:.3} p95 {:.3} max {:.3} ms (n={})",
            quantile(v, 0.5),
            quantile(v, 0.95),
            quantile(v, 1.0),
            v.len()
        )
    };
    eprintln!(
        "[test] sequential requests: span start - client send (wall): {}",
        q(&start_offsets)
    );
    eprintln!(
        "[test] conversion error (wall - monotonic): {}",
        q(&conversion.iter().map(|x| x.abs()).collect::<Vec<_>>())
    );
    eprintln!(
        "[test] sequential requests: client end - span end (wall): {}",
        q(&end_offsets)
    );
    // The agent converts with one offset for the whole run: a real
    // conversion error shifts every request alike, while a client
    // preempted between its two clock reads shifts one. So the median is
    // judged (measured: p50 0.000-0.001 ms, max 0.004 ms, quiet and with
    // `stress-ng --cpu 1`).
    let conv_p50 = quantile(&conversion.iter().map(|x| x.abs()).collect::<Vec<_>>(), 0.5);
    if conversion.is_empty() || conv_p50 >= 0.1 {
        f.push(format!(
            "wall-clock conversion off by a median {conv_p50:.3} ms (span start - send in wall time vs in monotonic time; want < 0.1 ms)"
        ));
    }
    // Medians of the client-side gaps. The brackets above hold per request,
    // whatever the load; these judge closeness, so each bound comes from
    // what load does to it. Span start - client send, with `stress-ng --cpu
    // 1`: p50 0.006-0.10 ms (p95 3.2 ms: a request waiting in the socket).
    // Client end - span end is the server's last write, uvicorn's
    // terminating chunk and a Python client's wake-up: p50 0.34-0.42 ms with
    // one core kept busy, 0.014-0.018 ms with both, 1.084 ms (p95 2.2) in
    // one CI run with one core kept busy. Its bound, 5 ms, is a third of the
    // stream's 15 ms token gap: a span that ended a token early still fails.
    const START_P50_MS: f64 = 1.0;
    const END_P50_MS: f64 = 5.0;
    if start_offsets.is_empty()
        || end_offsets.is_empty()
        || quantile(&start_offsets, 0.5) >= START_P50_MS
        || quantile(&end_offsets, 0.5) >= END_P50_MS
    {
        f.push(format!(
            "span start - client send: {}; client end - span end: {} (want p50s under {START_P50_MS} and {END_P50_MS} ms)",
            q(&start_offsets),
            q(&end_offsets)
        ));
    }
    f
}

/// `tokentrace_spans_dropped_total` for one reason, from a Prometheus scrape.
fn spans_dropped(text: &str, reason: &str) -> f64 {
    prom_sum(
        text,
        "tokentrace_spans_dropped_total",
        &[&format!("reason=\"{reason}\"")],
    )
}

fn assert_no_failures(title: &str, failures: &[String]) {
    assert!(
        failures.is_empty(),
        "{title}: {} failure(s):\n  {}",
        failures.len(),
        failures
            .iter()
            .take(40)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n  ")
    );
}

// ------------------------------------------------------------------- tests

#[test]
fn root_otlp_grpc_spans_join_the_callers_trace_and_histograms_count_every_request() {
    require_root("root_otlp_grpc_spans_join_the_callers_trace_and_histograms_count_every_request");
    let collector = Collector::start(free_port(), free_port());
    let server = start_server(ServerKind::FastApi, &[]);
    let metrics_port = free_port();
    let config = write_config(
        "grpc",
        "export:\n  metrics_interval: 1s\n  batch_timeout: 100ms\n",
    );
    let mut agent = start_agent(&agent_args(
        server.pid(),
        &[
            "--config".into(),
            config.display().to_string(),
            "--otlp-endpoint".into(),
            format!("http://127.0.0.1:{}", collector.grpc_port),
            "--otlp-protocol".into(),
            "grpc".into(),
            "--metrics-addr".into(),
            format!("127.0.0.1:{metrics_port}"),
        ],
    ));

    let mut client = Vec::new();
    for run in traced_runs("grpc-") {
        client.extend(run_client(server.port, &run));
    }
    let n = client.len();
    let missing = agent.wait_for_paths(&paths(&client), Duration::from_secs(20));
    assert!(missing.is_empty(), "the agent did not report {missing:?}");

    // Prometheus: one observation per request in each histogram
    let text = scrape(metrics_port);
    let svc = "service_name=\"python3\"";
    for (metric, want) in [
        ("gen_ai_server_request_duration_seconds_count", n),
        ("gen_ai_server_time_to_first_token_seconds_count", n),
        ("gen_ai_server_time_per_output_token_seconds_count", n),
    ] {
        let got = prom_sum(
            &text,
            metric,
            &[
                svc,
                "gen_ai_request_model=\"test-model\"",
                "http_response_status_code=\"200\"",
            ],
        );
        assert_eq!(
            got, want as f64,
            "{metric}: Prometheus count {got}, requests sent {want}\n{text}"
        );
    }
    let inf = prom_sum(
        &text,
        "gen_ai_server_time_to_first_token_seconds_bucket",
        &[svc, "le=\"+Inf\""],
    );
    assert_eq!(inf, n as f64, "+Inf bucket equals the count");
    // every bucket holds exactly the requests whose --output json TTFT is
    // at most its bound (the server sleeps 40 ms first: none below 0.03)
    let ttfts: Vec<f64> = agent
        .values()
        .iter()
        .filter_map(|v| v.get("ttft_ms").and_then(Value::as_f64))
        .collect();
    assert_eq!(ttfts.len(), n);
    for le in ["0.03", "0.04", "0.05", "0.06", "0.08", "0.1", "0.25", "1"] {
        let bound: f64 = le.parse().expect("bound");
        let got = prom_sum(
            &text,
            "gen_ai_server_time_to_first_token_seconds_bucket",
            &[svc, &format!("le=\"{le}\"")],
        );
        let want = ttfts.iter().filter(|t| **t / 1000.0 <= bound).count();
        assert_eq!(
            got, want as f64,
            "TTFT bucket le={le}: {got}, JSON TTFTs at most {le} s: {want}"
        );
    }
    assert_eq!(prom_sum(&text, "tokentrace_requests_total", &[]), n as f64);

    // spans, in rotel
    let traces: BTreeSet<String> = client
        .iter()
        .filter_map(|c| {
            c.raw
                .get("traceparent")
                .and_then(Value::as_str)
                .map(|tp| trace_ids(tp).0)
        })
        .collect();
    assert_eq!(traces.len(), n, "one fresh trace per request");
    let spans = collector.wait_for_traces(&traces, Duration::from_secs(20));
    let failures = check_spans(&client, &agent.values(), &spans, server.pid(), "python3");

    // OTLP metrics: the latest cumulative push counts every request
    let deadline = Instant::now() + Duration::from_secs(15);
    let counts = loop {
        let counts = latest_otlp_histogram_counts(&collector.lines(), "python3");
        if counts.get("gen_ai.server.request.duration") == Some(&(n as u64))
            || Instant::now() >= deadline
        {
            break counts;
        }
        thread::sleep(Duration::from_millis(200));
    };
    for metric in [
        "gen_ai.server.request.duration",
        "gen_ai.server.time_to_first_token",
        "gen_ai.server.time_per_output_token",
    ] {
        assert_eq!(
            counts.get(metric),
            Some(&(n as u64)),
            "OTLP {metric} count in rotel: {counts:?}"
        );
    }

    let stop = agent.stop();
    assert!(
        stop.is_some_and(|s| s.success()),
        "agent exit {stop:?}: {}",
        agent.proc.stderr.tail(20)
    );
    let export_line = agent
        .proc
        .stderr
        .lines()
        .into_iter()
        .find(|l| l.starts_with("tokentrace export"));
    eprintln!("[test] {export_line:?}");
    assert!(
        export_line
            .is_some_and(|l| l.contains("0 dropped (queue full), 0 dropped (export failed)")),
        "{}",
        agent.proc.stderr.tail(20)
    );
    let _ = std::fs::remove_file(config);
    assert_no_failures("OTLP/gRPC spans", &failures);
}

#[test]
fn root_otlp_http_protobuf_configured_by_otel_environment() {
    require_root("root_otlp_http_protobuf_configured_by_otel_environment");
    let collector = Collector::start(free_port(), free_port());
    let server = start_server(ServerKind::Stdlib, &[]);
    let endpoint = format!("http://127.0.0.1:{}", collector.http_port);
    let mut agent = start_agent_with_env(
        &Agent::for_pids(&[server.pid()]),
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ("OTEL_SERVICE_NAME", "chat-api"),
            (
                "OTEL_RESOURCE_ATTRIBUTES",
                "deployment.environment=ci,team=llm%20serving",
            ),
            ("OTEL_METRICS_EXPORTER", "none"),
        ],
    );
    let mut run = ClientRun::sse(6, 1, "http-seq-");
    run.traceparent = true;
    let mut client = run_client(server.port, &run);
    // one request without trace context starts a new trace of its own
    let untraced = run_client(server.port, &ClientRun::sse(1, 1, "http-untraced-"));
    let mut all = client.clone();
    all.extend(untraced.iter().cloned());
    let missing = agent.wait_for_paths(&paths(&all), Duration::from_secs(20));
    assert!(missing.is_empty(), "the agent did not report {missing:?}");

    let traces: BTreeSet<String> = client
        .iter()
        .filter_map(|c| {
            c.raw
                .get("traceparent")
                .and_then(Value::as_str)
                .map(|tp| trace_ids(tp).0)
        })
        .collect();
    let spans = collector.wait_for_traces(&traces, Duration::from_secs(20));
    let mut failures = check_spans(&client, &agent.values(), &spans, server.pid(), "chat-api");
    for s in spans.iter().filter(|s| s.kind == "SPAN_KIND_SERVER") {
        if s.resource_attr("deployment.environment") != Some("ci")
            || s.resource_attr("team") != Some("llm serving")
        {
            failures.push(format!(
                "resource of {} lacks OTEL_RESOURCE_ATTRIBUTES: {:?}",
                s.trace_id, s.resource
            ));
        }
    }
    // the untraced request: a root server span (no parent) in a new trace
    let deadline = Instant::now() + Duration::from_secs(10);
    let roots = loop {
        let roots: Vec<RecvSpan> = collector
            .spans()
            .into_iter()
            .filter(|s| {
                s.kind == "SPAN_KIND_SERVER"
                    && s.parent_id.is_empty()
                    && !traces.contains(&s.trace_id)
            })
            .collect();
        if !roots.is_empty() || Instant::now() >= deadline {
            break roots;
        }
        thread::sleep(Duration::from_millis(100));
    };
    if roots.len() != 1 {
        failures.push(format!(
            "{} root server spans for the untraced request, expected 1",
            roots.len()
        ));
    }
    client.clear();
    let stop = agent.stop();
    assert!(stop.is_some_and(|s| s.success()), "agent exit {stop:?}");
    assert!(
        !collector
            .lines()
            .iter()
            .any(|l| l.contains("ResourceMetrics")),
        "OTEL_METRICS_EXPORTER=none must switch metric export off"
    );
    assert_no_failures("OTLP/HTTP spans", &failures);
}

/// What the agent may add to its RSS with a dead backend, and how that
/// number was made.
struct MemoryBound {
    total: f64,
    explain: String,
}

/// Allocator slack: what glibc malloc keeps resident beyond the bytes in
/// use — per-thread arenas (the tokio workers, the ingest and export
/// threads each get one under contention) each keeping their high-water
/// mark, and fragmentation between the queue's many small allocations.
/// Measured with this test's load on the 2-core machine as RSS growth
/// minus the agent's own peak queue bytes: 3.1 MiB quiet, 5.7 MiB with
/// `stress-ng --cpu 1` (loaded, more threads allocate at once, so more
/// arenas are touched). About twice the loaded figure: 12 MiB.
const ALLOCATOR_SLACK_MIB: f64 = 12.0;

/// The mechanism's bound: the queue holds `queue` requests, the export
/// task one batch of `batch` (its request and the copy each attempt
/// sends), all of it in the agent's own accounting
/// (`tokentrace_export_queue_bytes`, heap bytes of the span messages,
/// its peak over the run); the end-of-run summary keeps a fixed-size
/// histogram; plus measured allocator slack. An unbounded queue fails it:
/// every dropped request would stay (with `queue_size: 1000000` the same
/// run grew RSS by 47 MiB).
fn memory_bound_mib(queue_bytes_peak: f64, queue: u64, batch: u64) -> MemoryBound {
    let queue_mib = queue_bytes_peak / (1024.0 * 1024.0);
    MemoryBound {
        total: queue_mib + ALLOCATOR_SLACK_MIB,
        explain: format!(
            "queue + batch in flight {queue_mib:.1} MiB (agent's peak export_queue_bytes, {queue} requests + 2x{batch}) + allocator slack {ALLOCATOR_SLACK_MIB} MiB"
        ),
    }
}

#[test]
fn root_otlp_backend_down_memory_bounded_drops_counted_then_recovers() {
    require_root("root_otlp_backend_down_memory_bounded_drops_counted_then_recovers");
    const REQUESTS: u32 = 1000;
    const TOKENS: u32 = 200;
    const QUEUE: u64 = 64;
    const BATCH: u64 = 32;
    let grpc_port = free_port();
    let metrics_port = free_port();
    let server = start_server(ServerKind::FastApi, &[]);
    // A small queue, per-chunk events (tens of KiB of span data per
    // request) and quick retries. The memory bound is derived from the
    // mechanism, not from a past measurement: see `memory_bound_mib`. A
    // short stall-explanation history keeps that (separately bounded)
    // buffer out of this test's measurement.
    let config = write_config(
        "down",
        &format!(
            "export:\n  queue_size: {QUEUE}\n  batch_size: {BATCH}\n  batch_timeout: 50ms\n  chunk_events: true\n  max_span_events: 256\n  metrics_interval: 1s\n  retry:\n    initial_backoff: 200ms\n    max_backoff: 1s\n    max_elapsed: 3s\nexplain:\n  history: 2s\n"
        ),
    );
    let mut agent = start_agent(&agent_args(
        server.pid(),
        &[
            "--config".into(),
            config.display().to_string(),
            "--otlp-endpoint".into(),
            format!("http://127.0.0.1:{grpc_port}"),
            "--otlp-protocol".into(),
            "grpc".into(),
            "--metrics-addr".into(),
            format!("127.0.0.1:{metrics_port}"),
        ],
    ));
    let agent_pid = agent.proc.pid();

    // warm up (allocator arenas, connection tables), then measure
    let mut warm = ClientRun::sse(50, 8, "warm-");
    (warm.tokens, warm.token_delay_ms, warm.ttft_ms) = (TOKENS, 0.0, 0.0);
    let mut sent = run_client(server.port, &warm);
    let warm_missing = agent.wait_for_paths(&paths(&sent), Duration::from_secs(30));
    assert!(
        warm_missing.is_empty(),
        "warm-up requests not reported: {}",
        warm_missing.len()
    );
    let base = status_kib(agent_pid, "VmRSS").expect("agent RSS");

    let sampling = Arc::new(Mutex::new((base, true)));
    let sampler = {
        let sampling = Arc::clone(&sampling);
        thread::spawn(move || {
            let mut queue_max = 0.0f64;
            let mut bytes_max = 0.0f64;
            loop {
                let Ok(mut s) = sampling.lock() else { break };
                if !s.1 {
                    break;
                }
                s.0 = s.0.max(status_kib(agent_pid, "VmRSS").unwrap_or(0));
                drop(s);
                if let Ok(mut c) = TcpStream::connect(("127.0.0.1", metrics_port)) {
                    let _ = write!(
                        c,
                        "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                    );
                    let mut t = String::new();
                    let _ = c.read_to_string(&mut t);
                    queue_max = queue_max.max(prom_sum(&t, "tokentrace_export_queue_length", &[]));
                    bytes_max = bytes_max.max(prom_sum(&t, "tokentrace_export_queue_bytes", &[]));
                }
                thread::sleep(Duration::from_millis(100));
            }
            (queue_max, bytes_max)
        })
    };
    let t0 = Instant::now();
    let mut load = ClientRun::sse(REQUESTS, 8, "down-");
    (load.tokens, load.token_delay_ms, load.ttft_ms) = (TOKENS, 0.0, 0.0);
    let loaded = run_client(server.port, &load);
    let missing = agent.wait_for_paths(&paths(&loaded), Duration::from_secs(60));
    eprintln!(
        "[test] {} streamed requests ({TOKENS} tokens) in {:.1} s",
        loaded.len(),
        t0.elapsed().as_secs_f64()
    );
    if let Ok(mut s) = sampling.lock() {
        s.1 = false;
    }
    let (queue_max, queue_bytes_max) = sampler.join().expect("sampler");
    let peak = sampling.lock().map(|s| s.0).unwrap_or(0);
    sent.extend(loaded);
    assert!(
        missing.is_empty(),
        "{} of {REQUESTS} requests not reported",
        missing.len()
    );

    let text = scrape(metrics_port);
    let dropped_full = spans_dropped(&text, "queue_full");
    let dropped_failed = spans_dropped(&text, "export_failed");
    let exported = prom_sum(&text, "tokentrace_spans_exported_total", &[]);
    let queued = prom_sum(&text, "tokentrace_export_queue_length", &[]);
    let capacity = prom_sum(&text, "tokentrace_export_queue_capacity", &[]);
    let requests = prom_sum(&text, "tokentrace_requests_total", &[]);
    let growth_mib = (peak.saturating_sub(base)) as f64 / 1024.0;
    let bound = memory_bound_mib(queue_bytes_max, QUEUE, BATCH);
    eprintln!(
        "[test] backend down: RSS growth beyond the queue's own bytes (allocator slack and the rest): {:.1} MiB",
        growth_mib - queue_bytes_max / (1024.0 * 1024.0)
    );
    eprintln!(
        "[test] backend down: RSS {:.1} MiB -> peak {:.1} MiB (+{growth_mib:.1} MiB; bound {:.1} MiB = {}); queue max {queue_max}/{capacity}; \
         spans dropped: {dropped_full} queue full, {dropped_failed} export failed; exported {exported}; queued {queued}",
        base as f64 / 1024.0,
        peak as f64 / 1024.0,
        bound.total,
        bound.explain,
    );
    assert_eq!(
        requests,
        f64::from(REQUESTS + 50),
        "every request is counted in the metrics"
    );
    assert_eq!(exported, 0.0, "nothing can be exported to a dead endpoint");
    assert!(
        dropped_full > 0.0,
        "a full queue must drop and count spans\n{text}"
    );
    assert_eq!(
        dropped_failed, 0.0,
        "a dead backend refuses nothing: batches given up on to make room count as queue_full\n{text}"
    );
    assert!(
        queue_max <= capacity && capacity == QUEUE as f64,
        "queue length {queue_max} above capacity {capacity}"
    );
    assert!(
        queue_bytes_max > 0.0,
        "tokentrace_export_queue_bytes never rose with a full queue\n{text}"
    );
    assert!(
        growth_mib < bound.total,
        "agent RSS grew by {growth_mib:.1} MiB with a dead backend (bound {:.1} MiB = {})",
        bound.total,
        bound.explain
    );

    // the backend comes up: the agent drains its backlog (the queue is
    // full of spans retried from before), then spans of new requests
    // arrive. Requests sent before the drain would race the backlog for
    // the 64 queue slots and be dropped as queue_full, by design.
    let collector = Collector::start(grpc_port, free_port());
    let t_start = Instant::now();
    let drained = loop {
        let text = scrape(metrics_port);
        let queued = prom_sum(&text, "tokentrace_export_queue_length", &[]);
        let exported = prom_sum(&text, "tokentrace_spans_exported_total", &[]);
        if queued == 0.0 && exported > 0.0 {
            break true;
        }
        if t_start.elapsed() > Duration::from_secs(30) {
            break false;
        }
        thread::sleep(Duration::from_millis(100));
    };
    eprintln!(
        "[test] backend up: backlog drained: {drained} after {:.1} s",
        t_start.elapsed().as_secs_f64()
    );
    assert!(
        drained,
        "the agent did not resume exporting within 30 s of the backend coming up"
    );
    let mut after = ClientRun::sse(10, 2, "after-");
    after.traceparent = true;
    let after_recs = run_client(server.port, &after);
    let traces: BTreeSet<String> = after_recs
        .iter()
        .filter_map(|c| {
            c.raw
                .get("traceparent")
                .and_then(Value::as_str)
                .map(|tp| trace_ids(tp).0)
        })
        .collect();
    let t_up = Instant::now();
    let spans = collector.wait_for_traces(&traces, Duration::from_secs(30));
    let seen: BTreeSet<String> = spans
        .iter()
        .filter(|s| s.kind == "SPAN_KIND_SERVER")
        .map(|s| s.trace_id.clone())
        .collect();
    let arrived = traces.intersection(&seen).count();
    eprintln!(
        "[test] backend up: {arrived}/{} new traces arrived within {:.1} s",
        traces.len(),
        t_up.elapsed().as_secs_f64()
    );
    assert_eq!(
        arrived,
        traces.len(),
        "spans of requests made after the backend came up must arrive"
    );
    let stop = agent.stop();
    assert!(stop.is_some_and(|s| s.success()), "agent exit {stop:?}");
    let _ = std::fs::remove_file(config);
}

/// One agent of the outage test: its protocol, metrics port and process.
struct OutageAgent {
    protocol: &'static str,
    metrics_port: u16,
    agent: Agent,
}

/// Issue 26: a collector down longer than `max_elapsed`, then back on the
/// same ports, with one agent per protocol tracing the same server. Before
/// the fix, each agent dropped a batch as `export_failed` after
/// `max_elapsed` with its queue nearly empty, and resumed only when its
/// backoff (up to 5 s ±20 %) ran out: on a soak, once 69 s. Now a batch
/// is kept while the queue has room, and the agent's probe of the
/// backend's port cuts the wait short: every span of the outage reaches
/// the collector within 2 s of its return, counted by the agent's own
/// metrics (polled every 50 ms) and checked at the collector by trace id.
#[test]
fn root_otlp_outage_drains_within_2s_and_keeps_spans_while_the_queue_has_room() {
    require_root("root_otlp_outage_drains_within_2s_and_keeps_spans_while_the_queue_has_room");
    // longer than max_elapsed (5 s) plus the backoff cap (5 s): the old
    // code had given up on a batch and sat in its longest backoff
    const OUTAGE: Duration = Duration::from_secs(15);
    const DRAIN_BOUND: Duration = Duration::from_secs(2);
    let (grpc_port, http_port) = (free_port(), free_port());
    let server = start_server(ServerKind::FastApi, &[]);
    let config = write_config(
        "outage",
        "export:\n  metrics_interval: 1s\n  retry:\n    initial_backoff: 500ms\n    max_backoff: 5s\n    max_elapsed: 5s\n",
    );
    let mut collector = Some(Collector::start(grpc_port, http_port));
    let mut agents: Vec<OutageAgent> = [("grpc", grpc_port), ("http", http_port)]
        .into_iter()
        .map(|(protocol, port)| {
            let metrics_port = free_port();
            let agent = start_agent_with_env(
                &agent_args(
                    server.pid(),
                    &[
                        "--config".into(),
                        config.display().to_string(),
                        "--otlp-endpoint".into(),
                        format!("http://127.0.0.1:{port}"),
                        "--otlp-protocol".into(),
                        protocol.into(),
                        "--metrics-addr".into(),
                        format!("127.0.0.1:{metrics_port}"),
                    ],
                ),
                // tells the two agents' spans apart at the collector
                &[(
                    "OTEL_RESOURCE_ATTRIBUTES",
                    &format!("tokentrace.test.exporter={protocol}"),
                )],
            );
            OutageAgent {
                protocol,
                metrics_port,
                agent,
            }
        })
        .collect();
    let traced = |prefix: &str, n: u32| {
        let mut run = ClientRun::sse(n, 4, prefix);
        run.traceparent = true;
        run_client(server.port, &run)
    };
    let trace_set = |recs: &[ClientRecord]| -> BTreeSet<String> {
        recs.iter()
            .filter_map(|c| c.raw.get("traceparent").and_then(Value::as_str))
            .map(|tp| trace_ids(tp).0)
            .collect()
    };
    let exported = |a: &OutageAgent| {
        prom_sum(
            &scrape(a.metrics_port),
            "tokentrace_spans_exported_total",
            &[],
        )
    };

    // warm: both agents export while the collector is up
    let warm = traced("outage-warm-", 8);
    for a in &mut agents {
        let missing = a
            .agent
            .wait_for_paths(&paths(&warm), Duration::from_secs(30));
        assert!(missing.is_empty(), "{}: warm-up not reported", a.protocol);
    }
    let seen = collector
        .as_ref()
        .expect("up")
        .wait_for_traces(&trace_set(&warm), Duration::from_secs(20));
    assert!(!seen.is_empty(), "warm-up spans reached the collector");

    // the collector goes away; requests go on
    drop(collector.take());
    let down_at = Instant::now();
    let during = traced("outage-during-", 40);
    for a in &mut agents {
        let missing = a
            .agent
            .wait_for_paths(&paths(&during), Duration::from_secs(30));
        assert!(
            missing.is_empty(),
            "{}: {} requests made during the outage not reported",
            a.protocol,
            missing.len()
        );
    }
    let before: Vec<f64> = agents.iter().map(exported).collect();
    if let Some(rest) = OUTAGE.checked_sub(down_at.elapsed()) {
        thread::sleep(rest);
    }

    // back on the same ports: every agent drains within the bound
    let back = Collector::start(grpc_port, http_port);
    let up_at = Instant::now();
    let mut drained: Vec<Option<Duration>> = vec![None; agents.len()];
    while drained.iter().any(Option::is_none) && up_at.elapsed() < Duration::from_secs(30) {
        for (i, a) in agents.iter().enumerate() {
            let text = scrape(a.metrics_port);
            let queued = prom_sum(&text, "tokentrace_export_queue_length", &[]);
            let now_exported = prom_sum(&text, "tokentrace_spans_exported_total", &[]);
            // 40 requests, at least one span each
            if drained[i].is_none() && queued == 0.0 && now_exported >= before[i] + 40.0 {
                drained[i] = Some(up_at.elapsed());
            }
        }
        thread::sleep(Duration::from_millis(50));
    }
    let outage_s = up_at.duration_since(down_at).as_secs_f64();
    let wanted = trace_set(&during);
    let arrived_from = |spans: &[RecvSpan], protocol: &str| -> BTreeSet<String> {
        spans
            .iter()
            .filter(|s| s.kind == "SPAN_KIND_SERVER")
            .filter(|s| s.resource_attr("tokentrace.test.exporter") == Some(protocol))
            .map(|s| s.trace_id.clone())
            .collect()
    };
    // what the agents counted as exported is printed by rotel as it goes
    let deadline = Instant::now() + Duration::from_secs(20);
    let spans = loop {
        let spans = back.spans();
        let complete = agents
            .iter()
            .all(|a| wanted.is_subset(&arrived_from(&spans, a.protocol)));
        if complete || Instant::now() > deadline {
            break spans;
        }
        thread::sleep(Duration::from_millis(200));
    };
    let mut failures = Vec::new();
    for (a, drain) in agents.iter().zip(&drained) {
        let text = scrape(a.metrics_port);
        let dropped_full = spans_dropped(&text, "queue_full");
        let dropped_failed = spans_dropped(&text, "export_failed");
        let capacity = prom_sum(&text, "tokentrace_export_queue_capacity", &[]);
        eprintln!(
            "[test] {}: outage {outage_s:.1} s; drained {:?} after the collector was back; \
             spans dropped: {dropped_full} queue full, {dropped_failed} export failed (queue capacity {capacity}, 40 requests queued)",
            a.protocol,
            drain.map(|d| format!("{:.2} s", d.as_secs_f64()))
        );
        match drain {
            Some(d) if *d <= DRAIN_BOUND => {}
            other => failures.push(format!(
                "{}: backlog drained after {other:?}, bound {DRAIN_BOUND:?}",
                a.protocol
            )),
        }
        if dropped_full + dropped_failed > 0.0 {
            failures.push(format!(
                "{}: {} spans dropped with room in the queue ({dropped_full} queue full, {dropped_failed} export failed)",
                a.protocol,
                dropped_full + dropped_failed
            ));
        }
        let missing = wanted.difference(&arrived_from(&spans, a.protocol)).count();
        if missing > 0 {
            failures.push(format!(
                "{}: {missing} of {} requests made during the outage have no SERVER span at the collector",
                a.protocol,
                during.len(),
            ));
        }
    }
    assert_no_failures("OTLP outage", &failures);
    for mut a in agents {
        let stop = a.agent.stop();
        assert!(stop.is_some_and(|s| s.success()), "agent exit {stop:?}");
    }
    drop(back);
    let _ = std::fs::remove_file(config);
}
