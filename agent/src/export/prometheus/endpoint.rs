//! The Prometheus text endpoint (`--metrics-addr`, `GET /metrics`).
//!
//! Names follow the OTel → Prometheus mapping: dots become underscores and
//! the unit is a suffix (`gen_ai.server.time_to_first_token` in seconds is
//! `gen_ai_server_time_to_first_token_seconds`); `service.name` becomes the
//! `service_name` label. Text exposition format 0.0.4.
//!
//! Rendered here rather than by `prometheus-client` (0.26: 16 crates of its
//! own): the series live in [`Metrics`], which OTLP export reads too, with
//! our series cap and overflow series; that crate would need them kept a
//! second time in its registry. tests/prometheus_dashboard.rs has a real
//! Prometheus scrape this text.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

use super::health;
use crate::export::metrics::{
    self_metrics, ExportCounters, Histogram, Kind, Metrics, RouteKey, CANCELLATIONS, IN_FLIGHT,
    SOCKET_WAIT, SOCKET_WAIT_DURATION, STALL_DURATION, STALL_TIME,
};
use crate::export::shared::Shared;

const CONTENT_TYPE_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";
/// A scraper that does not finish sending its request head in this time is
/// disconnected.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// A Prometheus metric or label name from an OTel attribute name.
pub fn prom_name(name: &str) -> String {
    let mut out: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if out.starts_with(|c: char| c.is_ascii_digit()) {
        out.insert(0, '_');
    }
    out
}

/// A label value with `\`, `"` and newlines escaped.
fn escape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

fn labels(pairs: &[(String, String)]) -> String {
    if pairs.is_empty() {
        return String::new();
    }
    let inner: Vec<String> = pairs
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
        .collect();
    format!("{{{}}}", inner.join(","))
}

/// The labels of a request-level series: service, route, model, then the
/// family's own.
fn route_labels(key: &RouteKey, own: Vec<(&'static str, String)>) -> Vec<(String, String)> {
    let mut pairs = vec![("service_name".to_string(), key.service.clone())];
    pairs.extend(
        key.attributes()
            .into_iter()
            .chain(own)
            .map(|(k, v)| (prom_name(k), v)),
    );
    pairs
}

fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// `_bucket` (cumulative, with `le`), `_sum` and `_count` lines of one
/// histogram series.
fn histogram(out: &mut String, name: &str, pairs: &[(String, String)], h: &Histogram) {
    let mut cumulative = 0;
    for (i, count) in h.counts.iter().enumerate() {
        cumulative += count;
        let le = h
            .bounds
            .get(i)
            .map_or_else(|| "+Inf".to_string(), |b| b.to_string());
        let mut with_le = pairs.to_vec();
        with_le.push(("le".to_string(), le));
        let _ = writeln!(out, "{name}_bucket{} {cumulative}", labels(&with_le));
    }
    let _ = writeln!(out, "{name}_sum{} {}", labels(pairs), h.sum);
    let _ = writeln!(out, "{name}_count{} {}", labels(pairs), h.count);
}

/// One family of request-level samples, its header only when it has any.
fn family<'a>(
    out: &mut String,
    (otel_name, help): (&str, &str),
    suffix: &str,
    kind: &str,
    samples: impl Iterator<Item = (Vec<(String, String)>, String)> + 'a,
) {
    let name = format!("{}{suffix}", prom_name(otel_name));
    let mut samples = samples.peekable();
    if samples.peek().is_some() {
        header(out, &name, help, kind);
    }
    for (pairs, value) in samples {
        let _ = writeln!(out, "{name}{} {value}", labels(&pairs));
    }
}

/// Renders every metric in the text exposition format.
pub fn render(metrics: &Metrics, export: &ExportCounters) -> String {
    let mut out = String::new();
    let mut family_seen: Option<&str> = None;
    for ((which, key), h) in &metrics.latency {
        let name = format!("{}_seconds", prom_name(which.name()));
        if family_seen != Some(which.name()) {
            family_seen = Some(which.name());
            header(&mut out, &name, which.description(), "histogram");
        }
        let mut pairs = vec![("service_name".to_string(), key.service.clone())];
        pairs.extend(key.attributes().into_iter().map(|(k, v)| (prom_name(k), v)));
        histogram(&mut out, &name, &pairs, h);
    }
    family(
        &mut out,
        CANCELLATIONS,
        "_total",
        "counter",
        metrics
            .cancellations
            .series
            .iter()
            .map(|(key, n)| (route_labels(key, Vec::new()), n.to_string())),
    );
    family(
        &mut out,
        SOCKET_WAIT,
        "_seconds_total",
        "counter",
        metrics
            .socket_wait
            .series
            .iter()
            .map(|(key, h)| (route_labels(key, Vec::new()), h.sum.to_string())),
    );
    family(
        &mut out,
        STALL_TIME,
        "_seconds_total",
        "counter",
        metrics
            .stall_time
            .series
            .iter()
            .map(|((key, cause), s)| (route_labels(key, cause.attributes()), s.to_string())),
    );
    family(
        &mut out,
        IN_FLIGHT,
        "",
        "gauge",
        metrics.in_flight.series.iter().map(|((key, phase), n)| {
            let phase = vec![("phase", phase.as_str().to_string())];
            (route_labels(key, phase), n.to_string())
        }),
    );
    if !metrics.socket_wait.is_empty() {
        let name = format!("{}_seconds", prom_name(SOCKET_WAIT_DURATION.0));
        header(&mut out, &name, SOCKET_WAIT_DURATION.1, "histogram");
        for (key, h) in &metrics.socket_wait.series {
            histogram(&mut out, &name, &route_labels(key, Vec::new()), h);
        }
    }
    if !metrics.stall_duration.is_empty() {
        let name = format!("{}_seconds", prom_name(STALL_DURATION.0));
        header(&mut out, &name, STALL_DURATION.1, "histogram");
        for ((key, cause), h) in &metrics.stall_duration.series {
            let pairs = route_labels(key, vec![("cause", (*cause).to_string())]);
            histogram(&mut out, &name, &pairs, h);
        }
    }
    let mut seen: Option<&str> = None;
    for m in self_metrics(metrics, export) {
        let name = match m.kind {
            Kind::Counter => format!("{}_total", m.prom_name),
            Kind::Gauge => m.prom_name.to_string(),
        };
        if seen != Some(m.prom_name) {
            seen = Some(m.prom_name);
            let kind = match m.kind {
                Kind::Counter => "counter",
                Kind::Gauge => "gauge",
            };
            let _ = writeln!(out, "# HELP {name} {}", m.help);
            let _ = writeln!(out, "# TYPE {name} {kind}");
        }
        let pairs: Vec<(String, String)> = m
            .attributes
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let _ = writeln!(out, "{name}{} {}", labels(&pairs), m.value);
    }
    out
}

fn respond(status: StatusCode, content_type: &'static str, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

fn handle(req: &Request<Incoming>, shared: &Shared) -> Response<Full<Bytes>> {
    if let Some((status, body)) = health::respond(req.method(), req.uri().path(), &shared.ready) {
        return respond(status, "text/plain; charset=utf-8", body.to_string());
    }
    match (req.method(), req.uri().path()) {
        (&Method::GET | &Method::HEAD, "/metrics") => {
            let (metrics, export) = shared.snapshot();
            respond(StatusCode::OK, CONTENT_TYPE_TEXT, render(&metrics, &export))
        }
        (&Method::GET, "/") => respond(
            StatusCode::OK,
            "text/plain; charset=utf-8",
            "tokentrace: metrics are at /metrics\n".to_string(),
        ),
        _ => respond(
            StatusCode::NOT_FOUND,
            "text/plain; charset=utf-8",
            "not found\n".to_string(),
        ),
    }
}

/// Serves scrapes until the task is aborted.
pub async fn serve(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(err) => {
                // EMFILE and the like: back off instead of spinning
                tracing::warn!("metrics endpoint: accept failed: {err}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let shared = Arc::clone(&shared);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let response = handle(&req, &shared);
                async move { Ok::<_, std::convert::Infallible>(response) }
            });
            let served = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service)
                .await;
            if let Err(err) = served {
                tracing::debug!("metrics endpoint: connection ended: {err}");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::metrics::{AgentCounters, Labels, Latency, SeriesKey};

    #[test]
    fn names_and_label_values_are_sanitised() {
        assert_eq!(
            prom_name("gen_ai.server.time_to_first_token"),
            "gen_ai_server_time_to_first_token"
        );
        assert_eq!(
            prom_name("http.response.status_code"),
            "http_response_status_code"
        );
        assert_eq!(prom_name("9lives"), "_9lives");
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    #[test]
    fn renders_cumulative_buckets_sum_count_and_self_metrics() {
        let mut m = Metrics::new(100, 0);
        let key = SeriesKey {
            service: "chat\"api".into(),
            operation: Some("chat"),
            route: None,
            model: Some("m1".into()),
            status: Some(200),
            error: None,
            rpc: None,
            overflow: false,
        };
        let mut h = crate::export::metrics::Histogram::new(&[0.01, 0.1]);
        h.observe(0.005);
        h.observe(0.05);
        h.observe(0.07);
        h.observe(3.0);
        m.latency.insert((Latency::TimeToFirstToken, key), h);
        m.agent = AgentCounters {
            events_received: 10,
            events_lost_kernel: 2,
            ..Default::default()
        };
        let export = ExportCounters {
            spans_dropped_queue_full: 7,
            queue_capacity: 64,
            ..Default::default()
        };
        let text = render(&m, &export);
        let l = "service_name=\"chat\\\"api\",gen_ai_operation_name=\"chat\",gen_ai_request_model=\"m1\",http_response_status_code=\"200\"";
        let expected = format!(
            "# HELP gen_ai_server_time_to_first_token_seconds Time from the first request byte to the first token leaving the server\n\
             # TYPE gen_ai_server_time_to_first_token_seconds histogram\n\
             gen_ai_server_time_to_first_token_seconds_bucket{{{l},le=\"0.01\"}} 1\n\
             gen_ai_server_time_to_first_token_seconds_bucket{{{l},le=\"0.1\"}} 3\n\
             gen_ai_server_time_to_first_token_seconds_bucket{{{l},le=\"+Inf\"}} 4\n\
             gen_ai_server_time_to_first_token_seconds_sum{{{l}}} 3.125\n\
             gen_ai_server_time_to_first_token_seconds_count{{{l}}} 4\n"
        );
        assert!(text.starts_with(&expected), "got:\n{text}");
        assert!(text.contains("# TYPE tokentrace_events_received_total counter\ntokentrace_events_received_total 10\n"));
        assert!(text.contains("tokentrace_events_lost_total{where=\"kernel\"} 2\ntokentrace_events_lost_total{where=\"agent\"} 0\n"));
        assert!(text.contains("tokentrace_spans_dropped_total{reason=\"queue_full\"} 7\n"));
        assert!(text.contains(
            "# TYPE tokentrace_export_queue_capacity gauge\ntokentrace_export_queue_capacity 64\n"
        ));
        assert_eq!(
            text.matches("# TYPE tokentrace_events_lost_total").count(),
            1,
            "one header per family"
        );
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let value = line.rsplit(' ').next().unwrap_or_default();
            assert!(value.parse::<f64>().is_ok(), "bad sample line {line:?}");
        }
    }

    #[test]
    fn the_grafana_dashboard_only_queries_metrics_that_exist() {
        let dashboard = include_str!("../../../../deploy/grafana/tokentrace-dashboard.json");
        let mut m = Metrics::new(100, 0);
        let key = SeriesKey {
            service: "s".into(),
            operation: None,
            route: Some("/v1/chat/completions".into()),
            model: Some("m".into()),
            status: Some(500),
            error: Some("500".into()),
            rpc: None,
            overflow: false,
        };
        for which in Latency::ALL {
            m.latency.insert(
                (which, key.clone()),
                crate::export::metrics::Histogram::new(which.bounds()),
            );
        }
        let mut t = crate::export::spans::tests::sse();
        t.aborted = true;
        t.abort_reason = Some(crate::model::AbortReason::ClientClosed);
        t.read_start = t.request_start + 1;
        t.stalls = vec![crate::model::Stall {
            chunk: 3,
            start_ms: 70.0,
            gap_ms: 150.0,
            off_cpu_ms: 150.0,
            off_cpu_reason: Some("sleep".into()),
            ..crate::model::Stall::default()
        }];
        m.record(&Labels::new("s".into(), &t), &t);
        let open = crate::model::OpenRequest {
            pid: 1,
            comm: "c".into(),
            path: "/v1/chat/completions".into(),
            model: None,
            phase: crate::model::Phase::Streaming,
        };
        m.set_in_flight([("s", &open)]);
        let text = render(&m, &ExportCounters::default());
        let names: std::collections::BTreeSet<&str> = text
            .lines()
            .filter_map(|l| l.split(['{', ' ']).next())
            .filter(|n| !n.starts_with('#'))
            .collect();
        let l = "service_name=\"s\",http_route=\"/v1/chat/completions\",gen_ai_request_model=\"llama-3-8b\"";
        for line in [
            format!("tokentrace_stall_time_seconds_total{{{l},cause=\"off_cpu\",reason=\"sleep\"}} 0.15\n"),
            format!("tokentrace_stall_duration_seconds_count{{{l},cause=\"off_cpu\"}} 1\n"),
            format!("tokentrace_client_cancellations_total{{{l}}} 1\n"),
            format!("tokentrace_socket_wait_seconds_total{{{l}}} 0.000000001\n"),
            "# TYPE tokentrace_requests_in_flight gauge\ntokentrace_requests_in_flight{service_name=\"s\",http_route=\"/v1/chat/completions\",phase=\"streaming\"} 1\n".to_string(),
            "gen_ai_server_inter_token_latency_seconds_count{service_name=\"s\",gen_ai_operation_name=\"chat\",http_route=\"/v1/chat/completions\",gen_ai_request_model=\"llama-3-8b\",http_response_status_code=\"200\",error_type=\"client_closed\"} 4\n".to_string(),
        ] {
            assert!(text.contains(&line), "no {line:?} in:\n{text}");
        }
        let mut checked = 0;
        for word in dashboard.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if word.starts_with("gen_ai_server_") || word.starts_with("tokentrace_") {
                assert!(
                    names.contains(word),
                    "the dashboard queries {word}, which the endpoint does not serve"
                );
                checked += 1;
            }
        }
        assert!(checked > 30, "only {checked} metric references found");
        for label in [
            "service_name",
            "gen_ai_request_model",
            "http_response_status_code",
            "error_type",
            "http_route",
            "phase",
            "cause",
            "reason",
            "metric",
        ] {
            assert!(
                text.contains(&format!("{label}=")),
                "the dashboard filters on {label}"
            );
        }
    }
}
