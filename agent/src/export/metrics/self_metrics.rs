//! The agent's self-metrics (`tokentrace.*` counters and gauges of its
//! own events, drops, export path and probe failures), named once for both
//! OTLP and Prometheus, in a fixed order.

use super::aggregate::{
    ExportCounters, Latency, Metrics, CANCELLATIONS, IN_FLIGHT, OVERFLOW, SOCKET_WAIT,
    SOCKET_WAIT_DURATION, STALL_DURATION, STALL_TIME,
};

/// Whether a self-metric only goes up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
}

/// One agent self-metric value, named for both OTLP and Prometheus.
#[derive(Debug, Clone, PartialEq)]
pub struct SelfMetric {
    pub otel_name: &'static str,
    /// Prometheus family name (counters get `_total` when rendered).
    pub prom_name: &'static str,
    pub help: &'static str,
    pub kind: Kind,
    pub attributes: Vec<(&'static str, &'static str)>,
    pub value: u64,
}

/// The agent's self-metrics, in a fixed order.
pub fn self_metrics(metrics: &Metrics, export: &ExportCounters) -> Vec<SelfMetric> {
    let agent = &metrics.agent;
    use Kind::{Counter, Gauge};
    let m =
        |otel_name, prom_name, help, kind, attributes: &[(&'static str, &'static str)], value| {
            SelfMetric {
                otel_name,
                prom_name,
                help,
                kind,
                attributes: attributes.to_vec(),
                value,
            }
        };
    let overflowed = |family: &str| match family {
        f if f == CANCELLATIONS.0 => metrics.cancellations.overflowed,
        f if f == SOCKET_WAIT.0 || f == SOCKET_WAIT_DURATION.0 => metrics.socket_wait.overflowed,
        f if f == STALL_TIME.0 => metrics.stall_time.overflowed,
        f if f == STALL_DURATION.0 => metrics.stall_duration.overflowed,
        f if f == IN_FLIGHT.0 => metrics.in_flight.overflowed,
        f => Latency::ALL
            .into_iter()
            .find(|l| l.name() == f)
            .and_then(|l| metrics.latency_overflowed.get(&l).copied())
            .unwrap_or(0),
    };
    let families = Latency::ALL.map(Latency::name).into_iter().chain([
        CANCELLATIONS.0,
        SOCKET_WAIT.0,
        SOCKET_WAIT_DURATION.0,
        STALL_TIME.0,
        STALL_DURATION.0,
        IN_FLIGHT.0,
    ]);
    let overflow = families.map(|family| {
        m(
            OVERFLOW.0,
            "tokentrace_metric_overflow",
            OVERFLOW.1,
            Counter,
            &[("metric", family)],
            overflowed(family),
        )
    });
    let mut list = vec![
        m(
            "tokentrace.events.received",
            "tokentrace_events_received",
            "Kernel events decoded",
            Counter,
            &[],
            agent.events_received,
        ),
        m(
            "tokentrace.events.lost",
            "tokentrace_events_lost",
            "Events lost before stitching",
            Counter,
            &[("where", "kernel")],
            agent.events_lost_kernel,
        ),
        m(
            "tokentrace.events.lost",
            "tokentrace_events_lost",
            "Events lost before stitching",
            Counter,
            &[("where", "agent")],
            agent.events_lost_agent,
        ),
        m(
            "tokentrace.forks.untraced",
            "tokentrace_forks_untraced",
            "Children of traced processes left untraced: the kernel's pid filter (8192) was full",
            Counter,
            &[],
            agent.untraced_forks,
        ),
        m(
            "tokentrace.decode.errors",
            "tokentrace_decode_errors",
            "Ring buffer records that could not be decoded",
            Counter,
            &[],
            agent.decode_errors,
        ),
        m(
            "tokentrace.parse.errors",
            "tokentrace_parse_errors",
            "Byte runs that were not parseable HTTP/1.1",
            Counter,
            &[],
            agent.parse_errors,
        ),
        m(
            "tokentrace.truncated_writes",
            "tokentrace_truncated_writes",
            "Writes longer than the capture cap",
            Counter,
            &[],
            agent.truncated_writes,
        ),
        m(
            "tokentrace.connections.open",
            "tokentrace_connections_open",
            "Connections being stitched",
            Gauge,
            &[],
            agent.open_connections,
        ),
        m(
            "tokentrace.requests",
            "tokentrace_requests",
            "Requests reported",
            Counter,
            &[],
            metrics.requests,
        ),
        m(
            "tokentrace.export.queue.length",
            "tokentrace_export_queue_length",
            "Requests waiting for span export",
            Gauge,
            &[],
            export.queue_length,
        ),
        m(
            "tokentrace.export.queue.capacity",
            "tokentrace_export_queue_capacity",
            "Size of the span export queue",
            Gauge,
            &[],
            export.queue_capacity,
        ),
        m(
            "tokentrace.export.queue.bytes",
            "tokentrace_export_queue_bytes",
            "Heap bytes of the spans waiting for export and of the batch being sent",
            Gauge,
            &[],
            export.queue_bytes,
        ),
        m(
            "tokentrace.spans.exported",
            "tokentrace_spans_exported",
            "Spans accepted by the OTLP backend",
            Counter,
            &[],
            export.spans_exported,
        ),
        m(
            "tokentrace.spans.dropped",
            "tokentrace_spans_dropped",
            "Spans not exported",
            Counter,
            &[("reason", "queue_full")],
            export.spans_dropped_queue_full,
        ),
        m(
            "tokentrace.spans.dropped",
            "tokentrace_spans_dropped",
            "Spans not exported",
            Counter,
            &[("reason", "export_failed")],
            export.spans_dropped_export_failed,
        ),
        m(
            "tokentrace.spans.not_sampled",
            "tokentrace_spans_not_sampled",
            "Requests whose caller's trace is not sampled",
            Counter,
            &[],
            export.spans_not_sampled,
        ),
        m(
            "tokentrace.spans.sampled_out",
            "tokentrace_spans_sampled_out",
            "Requests whose spans tail sampling (export.sampling) dropped; metrics still count them",
            Counter,
            &[],
            export.spans_sampled_out,
        ),
        m(
            "tokentrace.metric_exports.failed",
            "tokentrace_metric_exports_failed",
            "OTLP metric pushes that failed",
            Counter,
            &[],
            export.metric_exports_failed,
        ),
    ];
    list.extend(overflow);
    for (k, kind) in crate::probes::ProbeKind::ALL.into_iter().enumerate() {
        for (r, reason) in crate::probes::FailureReason::ALL.into_iter().enumerate() {
            list.push(m(
                "tokentrace.probe.attach_failures",
                "tokentrace_probe_attach_failures",
                "Probe sets (a process, a file, a kind) that could not be attached",
                Counter,
                &[("kind", kind.label()), ("reason", reason.label())],
                agent.probe_attach_failures[k][r],
            ));
        }
    }
    list
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::metrics::SeriesKey;

    #[test]
    fn series_beyond_the_limit_go_to_the_overflow_series() {
        let mut m = Metrics::new(2, 0);
        let key = |model: &str| SeriesKey {
            service: "s".into(),
            operation: Some("chat"),
            route: None,
            model: Some(model.into()),
            status: Some(200),
            error: None,
            rpc: None,
            overflow: false,
        };
        for model in ["a", "b", "c", "d", "a"] {
            m.observe(Latency::RequestDuration, &key(model), [0.1]);
        }
        let counts: Vec<(Option<String>, bool, u64)> = m
            .latency
            .iter()
            .map(|((_, k), h)| (k.model.clone(), k.overflow, h.count))
            .collect();
        assert_eq!(
            counts,
            vec![
                (None, true, 2),
                (Some("a".into()), false, 2),
                (Some("b".into()), false, 1)
            ]
        );
        assert_eq!(
            m.latency_overflowed.get(&Latency::RequestDuration),
            Some(&2)
        );
        let overflow = self_metrics(&m, &ExportCounters::default())
            .into_iter()
            .find(|s| {
                s.otel_name == OVERFLOW.0
                    && s.attributes == [("metric", "gen_ai.server.request.duration")]
            })
            .map(|s| s.value);
        assert_eq!(overflow, Some(2));
    }
}
