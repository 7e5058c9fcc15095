//! Root-only: tail-based span sampling (`export.sampling`) against a real
//! OTLP collector (rotel, see tests/kit/src/otel.rs). With a 1 % base rate
//! and a TTFT threshold, every request over the threshold has its span at
//! the collector, the others within a binomial bound of 1 %, every span
//! says why it was kept, the dropped requests are counted, and the
//! histograms (Prometheus and OTLP) count every request.
//!
//! Run (as root; CI does):
//!   cargo test -p tokentrace --test otel_sampling -- --test-threads=1 --nocapture

use tokentrace_testkit as common;

use std::collections::BTreeMap;
use std::thread;
use std::time::{Duration, Instant};

use common::otel::*;
use common::*;
use serde_json::Value;

const SLOW_TTFT_MS: f64 = 150.0;
const BASE_RATE: f64 = 0.01;
/// Chance a correct sampler fails the bound, per side.
const TAIL: f64 = 1e-5;

/// The largest `lo` with P(X < lo) <= TAIL and the smallest `hi` with
/// P(X > hi) <= TAIL, for X ~ Binomial(n, p).
fn binomial_bounds(n: usize, p: f64) -> (usize, usize) {
    let mut pmf = Vec::with_capacity(n + 1);
    let mut v = (1.0 - p).powi(i32::try_from(n).expect("small n"));
    for k in 0..=n {
        pmf.push(v);
        v *= (n - k) as f64 / (k + 1) as f64 * p / (1.0 - p);
    }
    let mut below = 0.0;
    let mut lo = 0;
    while lo < n && below + pmf[lo] <= TAIL {
        below += pmf[lo];
        lo += 1;
    }
    let mut above = 0.0;
    let mut hi = n;
    while hi > 0 && above + pmf[hi] <= TAIL {
        above += pmf[hi];
        hi -= 1;
    }
    (lo, hi)
}

#[test]
fn binomial_bounds_bracket_the_mean() {
    let (lo, hi) = binomial_bounds(1500, 0.01);
    // mean 15, sd 3.9: about 4 sd either side
    assert!(
        (1..=4).contains(&lo) && (30..=40).contains(&hi),
        "{lo} {hi}"
    );
}

#[test]
fn root_tail_sampling_keeps_every_slow_request_and_one_percent_of_the_rest() {
    require_root("root_tail_sampling_keeps_every_slow_request_and_one_percent_of_the_rest");
    let collector = Collector::start(free_port(), free_port());
    let server = start_server(ServerKind::FastApi, &[]);
    let metrics_port = free_port();
    // Stalls and aborts keep their spans by default; this run tests the
    // TTFT rule and the base rate, so stalls are not a reason here (the
    // 30 ms stall threshold would catch slow first tokens as stalls).
    let config = std::env::temp_dir().join(format!(
        "tokentrace-test-{}-sampling.yaml",
        std::process::id()
    ));
    std::fs::write(
        &config,
        format!(
            "export:\n  otlp:\n    endpoint: http://127.0.0.1:{}\n    protocol: grpc\n  metrics_interval: 1s\n  batch_timeout: 50ms\n  sampling:\n    base_rate: {BASE_RATE}\n    slow_ttft: {}ms\n    keep_stalled: false\n",
            collector.grpc_port, SLOW_TTFT_MS as u64
        ),
    )
    .expect("write the agent config");
    let mut args = Agent::for_pids(&[server.pid()]);
    args.extend([
        "--config".to_string(),
        config.display().to_string(),
        "--metrics-addr".to_string(),
        format!("127.0.0.1:{metrics_port}"),
    ]);
    let mut agent = start_agent(&args);

    let mut slow = ClientRun::sse(20, 4, "slow-");
    slow.ttft_ms = 250.0;
    slow.tokens = 3;
    slow.token_delay_ms = 5.0;
    let mut fast = ClientRun::sse(1500, 8, "fast-");
    fast.ttft_ms = 1.0;
    fast.tokens = 2;
    fast.token_delay_ms = 1.0;
    let mut client = run_client(server.port, &slow);
    client.extend(run_client(server.port, &fast));
    let missing = agent.wait_for_paths(&paths(&client), Duration::from_secs(60));
    assert!(missing.is_empty(), "the agent did not report {missing:?}");
    let lines = agent.values();
    assert_eq!(lines.len(), client.len(), "one JSON line per request");

    // Slow and fast by what the agent measured (load can slow a fast one).
    let (slow_lines, fast_lines): (Vec<&Value>, Vec<&Value>) = lines
        .iter()
        .partition(|v| v["ttft_ms"].as_f64().is_some_and(|t| t >= SLOW_TTFT_MS));
    assert!(
        slow_lines.len() >= 20,
        "{} requests over {SLOW_TTFT_MS} ms",
        slow_lines.len()
    );
    let id_of = |v: &Value| v["response_id"].as_str().map(str::to_owned);

    // The dropped count settles once every request is through the exporter.
    let expected_total = lines.len() as f64;
    let deadline = Instant::now() + Duration::from_secs(30);
    let (text, sampled_out) = loop {
        let text = scrape(metrics_port);
        let done = prom_sum(&text, "tokentrace_requests_total", &[]);
        let out = prom_sum(&text, "tokentrace_spans_sampled_out_total", &[]);
        if done == expected_total || Instant::now() >= deadline {
            break (text, out as usize);
        }
        thread::sleep(Duration::from_millis(200));
    };
    let kept = lines.len() - sampled_out;
    // Every kept request's SERVER span reaches the collector.
    let deadline = Instant::now() + Duration::from_secs(30);
    let servers = loop {
        let servers: Vec<RecvSpan> = collector
            .spans()
            .into_iter()
            .filter(|s| s.kind == "SPAN_KIND_SERVER")
            .collect();
        if servers.len() >= kept || Instant::now() >= deadline {
            break servers;
        }
        thread::sleep(Duration::from_millis(200));
    };
    let all_spans = collector.spans();
    let by_id: BTreeMap<String, &RecvSpan> = servers
        .iter()
        .filter_map(|s| s.attr("gen_ai.response.id").map(|id| (id.to_string(), s)))
        .collect();

    let mut failures = Vec::new();
    if servers.len() != kept {
        failures.push(format!(
            "{} server spans at the collector, {kept} requests not sampled out",
            servers.len()
        ));
    }
    for v in &slow_lines {
        let span = id_of(v).and_then(|id| by_id.get(&id).copied());
        match span.map(|s| s.attr("tokentrace.sampling.reason")) {
            Some(Some("slow_ttft")) => {}
            other => failures.push(format!(
                "slow request {} (ttft {} ms): span reason {other:?}",
                v["path"], v["ttft_ms"]
            )),
        }
    }
    let fast_kept: Vec<&RecvSpan> = fast_lines
        .iter()
        .filter_map(|v| id_of(v).and_then(|id| by_id.get(&id).copied()))
        .collect();
    for s in &fast_kept {
        if s.attr("tokentrace.sampling.reason") != Some("base_rate") {
            failures.push(format!(
                "fast request span {} kept for {:?}",
                s.trace_id,
                s.attr("tokentrace.sampling.reason")
            ));
        }
    }
    let (lo, hi) = binomial_bounds(fast_lines.len(), BASE_RATE);
    eprintln!(
        "[test] {} slow, {} fast requests; {} fast spans kept (binomial bounds {lo}..={hi}); {sampled_out} sampled out",
        slow_lines.len(),
        fast_lines.len(),
        fast_kept.len()
    );
    if !(lo..=hi).contains(&fast_kept.len()) {
        failures.push(format!(
            "{} of {} fast requests kept, outside {lo}..={hi} for {BASE_RATE}",
            fast_kept.len(),
            fast_lines.len()
        ));
    }
    if sampled_out != fast_lines.len() - fast_kept.len() {
        failures.push(format!(
            "tokentrace_spans_sampled_out_total {sampled_out}, fast requests not kept {}",
            fast_lines.len() - fast_kept.len()
        ));
    }
    let unreasoned = all_spans
        .iter()
        .filter(|s| s.attr("tokentrace.sampling.reason").is_none())
        .count();
    if unreasoned > 0 {
        failures.push(format!(
            "{unreasoned} of {} spans without tokentrace.sampling.reason",
            all_spans.len()
        ));
    }
    // Histograms count every request, sampled or not.
    let count = prom_sum(&text, "gen_ai_server_request_duration_seconds_count", &[]);
    if count != expected_total {
        failures.push(format!(
            "Prometheus request duration count {count}, requests {expected_total}"
        ));
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    let otlp = loop {
        let counts = latest_otlp_histogram_counts(&collector.lines(), "python3");
        let n = counts.get("gen_ai.server.request.duration").copied();
        if n == Some(lines.len() as u64) || Instant::now() >= deadline {
            break n;
        }
        thread::sleep(Duration::from_millis(200));
    };
    if otlp != Some(lines.len() as u64) {
        failures.push(format!(
            "OTLP request duration count {otlp:?}, requests {}",
            lines.len()
        ));
    }
    let stop = agent.stop();
    assert!(stop.is_some_and(|s| s.success()), "agent exit {stop:?}");
    let _ = std::fs::remove_file(&config);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
