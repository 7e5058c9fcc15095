//! OTLP export requests from queued spans and aggregated metrics. Pure.

use std::collections::BTreeMap;
use std::sync::Arc;

use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{InstrumentationScope, KeyValue};
use opentelemetry_proto::tonic::metrics::v1::{
    metric, number_data_point, AggregationTemporality, Gauge, Histogram, HistogramDataPoint,
    Metric, NumberDataPoint, ResourceMetrics, ScopeMetrics, Sum,
};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span};

use crate::export::attributes::{kv_int, kv_str};
use crate::export::metrics::{
    self_metrics, ExportCounters, Histogram as Hist, Keyed, Kind, Latency, Metrics, CANCELLATIONS,
    IN_FLIGHT, SOCKET_WAIT, SOCKET_WAIT_DURATION, STALL_DURATION, STALL_TIME,
};
use crate::export::resource::ResourceRules;

/// The spans of one request and the resource of the process that served it.
#[derive(Debug, Clone)]
pub struct TraceItem {
    /// Shared with the resource cache: one allocation per process.
    pub resource: Arc<Resource>,
    pub spans: Vec<Span>,
}

fn scope() -> InstrumentationScope {
    InstrumentationScope {
        name: "tokentrace".to_string(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        ..Default::default()
    }
}

/// One request for a batch: one `ResourceSpans` per process, in first-seen
/// order.
pub fn trace_request(batch: &[TraceItem]) -> ExportTraceServiceRequest {
    let mut groups: Vec<(&Arc<Resource>, Vec<Span>)> = Vec::new();
    for item in batch {
        match groups
            .iter_mut()
            .find(|(r, _)| Arc::ptr_eq(r, &item.resource))
        {
            Some((_, spans)) => spans.extend(item.spans.iter().cloned()),
            None => groups.push((&item.resource, item.spans.clone())),
        }
    }
    ExportTraceServiceRequest {
        resource_spans: groups
            .into_iter()
            .map(|(resource, spans)| ResourceSpans {
                resource: Some(Resource::clone(resource)),
                scope_spans: vec![ScopeSpans {
                    scope: Some(scope()),
                    spans,
                    ..Default::default()
                }],
                ..Default::default()
            })
            .collect(),
    }
}

fn resource_metrics(resource: Resource, metrics: Vec<Metric>) -> ResourceMetrics {
    ResourceMetrics {
        resource: Some(resource),
        scope_metrics: vec![ScopeMetrics {
            scope: Some(scope()),
            metrics,
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// Every metric as cumulative data points at `now_unix_nano`: latency
/// histograms under one resource per service, self-metrics under the
/// agent's resource.
pub fn metrics_request(
    metrics: &Metrics,
    export: &ExportCounters,
    rules: &ResourceRules,
    now_unix_nano: u64,
) -> ExportMetricsServiceRequest {
    let start = metrics.start_unix_nano;
    let cumulative = AggregationTemporality::Cumulative as i32;

    // service → histogram → data points
    let mut by_service: BTreeMap<&str, BTreeMap<Latency, Vec<HistogramDataPoint>>> =
        BTreeMap::new();
    for ((which, key), h) in &metrics.latency {
        // semconv types the status code as an int (Prometheus labels are
        // strings, hence the string form in `SeriesKey::attributes`)
        let attributes: Vec<KeyValue> = key
            .attributes()
            .into_iter()
            .map(|(k, v)| match (k, key.status) {
                ("http.response.status_code", Some(status)) => kv_int(k, i64::from(status)),
                _ => kv_str(k, v),
            })
            .collect();
        by_service
            .entry(&key.service)
            .or_default()
            .entry(*which)
            .or_default()
            .push(histogram_point(attributes, start, now_unix_nano, h));
    }
    // service → the request-level families, in a fixed order
    let mut families: BTreeMap<&str, Vec<Metric>> = BTreeMap::new();
    let point = |attributes: Vec<(&'static str, String)>, value| NumberDataPoint {
        attributes: attributes.into_iter().map(|(k, v)| kv_str(k, v)).collect(),
        start_time_unix_nano: start,
        time_unix_nano: now_unix_nano,
        value: Some(value),
        ..Default::default()
    };
    let int = |n: u64| number_data_point::Value::AsInt(i64::try_from(n).unwrap_or(i64::MAX));
    let counter = |data_points| {
        metric::Data::Sum(Sum {
            data_points,
            aggregation_temporality: cumulative,
            is_monotonic: true,
        })
    };
    add_family(
        &mut families,
        CANCELLATIONS,
        "{request}",
        group(&metrics.cancellations.series, |k, n| {
            point(k.attributes(), int(*n))
        }),
        counter,
    );
    add_family(
        &mut families,
        SOCKET_WAIT,
        "s",
        group(&metrics.socket_wait.series, |k, h| {
            point(k.attributes(), number_data_point::Value::AsDouble(h.sum))
        }),
        counter,
    );
    add_family(
        &mut families,
        STALL_TIME,
        "s",
        group(&metrics.stall_time.series, |(k, cause), s| {
            let mut a = k.attributes();
            a.extend(cause.attributes());
            point(a, number_data_point::Value::AsDouble(*s))
        }),
        counter,
    );
    add_family(
        &mut families,
        IN_FLIGHT,
        "{request}",
        group(&metrics.in_flight.series, |(k, phase), n| {
            let mut a = k.attributes();
            a.push(("phase", phase.as_str().to_string()));
            point(a, int(*n))
        }),
        |data_points| metric::Data::Gauge(Gauge { data_points }),
    );
    let histograms = |data_points| {
        metric::Data::Histogram(Histogram {
            data_points,
            aggregation_temporality: cumulative,
        })
    };
    add_family(
        &mut families,
        SOCKET_WAIT_DURATION,
        "s",
        group(&metrics.socket_wait.series, |k, h| {
            let a = k
                .attributes()
                .into_iter()
                .map(|(k, v)| kv_str(k, v))
                .collect();
            histogram_point(a, start, now_unix_nano, h)
        }),
        histograms,
    );
    add_family(
        &mut families,
        STALL_DURATION,
        "s",
        group(&metrics.stall_duration.series, |(k, cause), h| {
            let mut a = k.attributes();
            a.push(("cause", (*cause).to_string()));
            let a = a.into_iter().map(|(k, v)| kv_str(k, v)).collect();
            histogram_point(a, start, now_unix_nano, h)
        }),
        histograms,
    );
    for service in families.keys() {
        by_service.entry(service).or_default();
    }
    let mut resource_metrics_list: Vec<ResourceMetrics> = by_service
        .into_iter()
        .map(|(service, histograms)| {
            let mut list: Vec<Metric> = histograms
                .into_iter()
                .map(|(which, data_points)| Metric {
                    name: which.name().to_string(),
                    description: which.description().to_string(),
                    unit: "s".to_string(),
                    data: Some(metric::Data::Histogram(Histogram {
                        data_points,
                        aggregation_temporality: cumulative,
                    })),
                    ..Default::default()
                })
                .collect();
            list.extend(families.remove(service).unwrap_or_default());
            resource_metrics(rules.service_resource(service), list)
        })
        .collect();

    let mut own: Vec<Metric> = Vec::new();
    for m in self_metrics(metrics, export) {
        let point = NumberDataPoint {
            attributes: m.attributes.iter().map(|(k, v)| kv_str(k, *v)).collect(),
            start_time_unix_nano: start,
            time_unix_nano: now_unix_nano,
            value: Some(number_data_point::Value::AsInt(
                i64::try_from(m.value).unwrap_or(i64::MAX),
            )),
            ..Default::default()
        };
        let existing = own
            .iter_mut()
            .find(|x| x.name == m.otel_name)
            .and_then(|x| match &mut x.data {
                Some(metric::Data::Sum(s)) => Some(&mut s.data_points),
                Some(metric::Data::Gauge(g)) => Some(&mut g.data_points),
                _ => None,
            });
        if let Some(points) = existing {
            points.push(point);
            continue;
        }
        let data = match m.kind {
            Kind::Counter => metric::Data::Sum(Sum {
                data_points: vec![point],
                aggregation_temporality: cumulative,
                is_monotonic: true,
            }),
            Kind::Gauge => metric::Data::Gauge(Gauge {
                data_points: vec![point],
            }),
        };
        own.push(Metric {
            name: m.otel_name.to_string(),
            description: m.help.to_string(),
            unit: "{item}".to_string(),
            data: Some(data),
            ..Default::default()
        });
    }
    resource_metrics_list.push(resource_metrics(rules.agent_resource(), own));
    ExportMetricsServiceRequest {
        resource_metrics: resource_metrics_list,
    }
}

fn histogram_point(
    attributes: Vec<KeyValue>,
    start: u64,
    now: u64,
    h: &Hist,
) -> HistogramDataPoint {
    HistogramDataPoint {
        attributes,
        start_time_unix_nano: start,
        time_unix_nano: now,
        count: h.count,
        sum: Some(h.sum),
        bucket_counts: h.counts.clone(),
        explicit_bounds: h.bounds.to_vec(),
        min: (h.count > 0).then_some(h.min),
        max: (h.count > 0).then_some(h.max),
        ..Default::default()
    }
}

/// A family's series as data points, grouped by service.
fn group<K: Keyed, V, P>(
    series: &BTreeMap<K, V>,
    point: impl Fn(&K, &V) -> P,
) -> BTreeMap<&str, Vec<P>> {
    let mut out: BTreeMap<&str, Vec<P>> = BTreeMap::new();
    for (k, v) in series {
        out.entry(k.route_key().service.as_str())
            .or_default()
            .push(point(k, v));
    }
    out
}

/// Appends one metric per service that has points of this family.
fn add_family<'a, P>(
    families: &mut BTreeMap<&'a str, Vec<Metric>>,
    (name, description): (&str, &str),
    unit: &str,
    points: BTreeMap<&'a str, Vec<P>>,
    data: impl Fn(Vec<P>) -> metric::Data,
) {
    for (service, data_points) in points {
        families.entry(service).or_default().push(Metric {
            name: name.to_string(),
            description: description.to_string(),
            unit: unit.to_string(),
            data: Some(data(data_points)),
            ..Default::default()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::metrics::{AgentCounters, SeriesKey};

    fn service_of(r: &ResourceMetrics) -> String {
        let kv = r
            .resource
            .as_ref()
            .and_then(|r| r.attributes.iter().find(|kv| kv.key == "service.name"));
        format!("{:?}", kv.and_then(|kv| kv.value.clone()))
    }

    #[test]
    fn spans_are_grouped_by_process_resource() {
        let a = Arc::new(Resource {
            attributes: vec![kv_int("process.pid", 1)],
            ..Default::default()
        });
        let b = Arc::new(Resource {
            attributes: vec![kv_int("process.pid", 2)],
            ..Default::default()
        });
        let span = |name: &str| Span {
            name: name.into(),
            ..Default::default()
        };
        let batch = vec![
            TraceItem {
                resource: Arc::clone(&a),
                spans: vec![span("a1"), span("a1-child")],
            },
            TraceItem {
                resource: Arc::clone(&b),
                spans: vec![span("b1")],
            },
            TraceItem {
                resource: Arc::clone(&a),
                spans: vec![span("a2")],
            },
        ];
        let req = trace_request(&batch);
        assert_eq!(req.resource_spans.len(), 2);
        let names: Vec<Vec<String>> = req
            .resource_spans
            .iter()
            .map(|rs| {
                rs.scope_spans[0]
                    .spans
                    .iter()
                    .map(|s| s.name.clone())
                    .collect()
            })
            .collect();
        assert_eq!(names, vec![vec!["a1", "a1-child", "a2"], vec!["b1"]]);
        assert_eq!(req.resource_spans[0].resource.as_ref(), Some(&*a));
        assert_eq!(
            req.resource_spans[0].scope_spans[0]
                .scope
                .as_ref()
                .map(|s| s.name.as_str()),
            Some("tokentrace")
        );
    }

    #[test]
    fn metrics_are_cumulative_histograms_per_service_plus_agent_counters() {
        let mut m = Metrics::new(10, 100);
        let key = |service: &str| SeriesKey {
            service: service.into(),
            operation: Some("chat"),
            route: None,
            model: Some("m".into()),
            status: Some(200),
            error: None,
            rpc: None,
            overflow: false,
        };
        let mut h = crate::export::metrics::Histogram::new(Latency::TimeToFirstToken.bounds());
        h.observe(0.0123);
        m.latency
            .insert((Latency::TimeToFirstToken, key("svc-a")), h.clone());
        m.latency
            .insert((Latency::RequestDuration, key("svc-a")), h.clone());
        m.latency
            .insert((Latency::TimeToFirstToken, key("svc-b")), h);
        m.agent = AgentCounters {
            events_received: 5,
            ..Default::default()
        };
        let rules = ResourceRules {
            host_name: "h".into(),
            ..Default::default()
        };
        let req = metrics_request(&m, &ExportCounters::default(), &rules, 200);
        let services: Vec<String> = req.resource_metrics.iter().map(service_of).collect();
        assert_eq!(services.len(), 3);
        assert!(
            services[0].contains("svc-a")
                && services[1].contains("svc-b")
                && services[2].contains("tokentrace")
        );

        let a = &req.resource_metrics[0].scope_metrics[0].metrics;
        assert_eq!(
            a.iter().map(|x| x.name.as_str()).collect::<Vec<_>>(),
            vec![
                "gen_ai.server.time_to_first_token",
                "gen_ai.server.request.duration"
            ]
        );
        let Some(metric::Data::Histogram(hist)) = &a[0].data else {
            panic!("histogram expected")
        };
        assert_eq!(
            hist.aggregation_temporality,
            AggregationTemporality::Cumulative as i32
        );
        let p = &hist.data_points[0];
        assert_eq!(
            (p.count, p.start_time_unix_nano, p.time_unix_nano),
            (1, 100, 200)
        );
        assert_eq!(p.bucket_counts.len(), p.explicit_bounds.len() + 1);
        assert_eq!(a[0].unit, "s");
        let keys: Vec<&str> = p.attributes.iter().map(|kv| kv.key.as_str()).collect();
        assert_eq!(p.attributes[2], kv_int("http.response.status_code", 200));
        assert_eq!(
            keys,
            vec![
                "gen_ai.operation.name",
                "gen_ai.request.model",
                "http.response.status_code"
            ]
        );

        let own = &req.resource_metrics[2].scope_metrics[0].metrics;
        let lost = own
            .iter()
            .find(|x| x.name == "tokentrace.events.lost")
            .expect("events.lost");
        let Some(metric::Data::Sum(sum)) = &lost.data else {
            panic!("sum expected")
        };
        assert!(sum.is_monotonic);
        assert_eq!(
            sum.data_points.len(),
            2,
            "kernel and agent points in one metric"
        );
        let queue = own
            .iter()
            .find(|x| x.name == "tokentrace.export.queue.length")
            .expect("queue length");
        assert!(matches!(queue.data, Some(metric::Data::Gauge(_))));
    }
}

#[cfg(test)]
mod family_tests {
    use super::*;
    use crate::export::metrics::Labels;
    use crate::model::{OpenRequest, Phase};

    #[test]
    fn request_level_families_go_under_their_service_with_their_kinds() {
        let mut m = Metrics::new(10, 100);
        let mut t = crate::export::spans::tests::sse();
        t.read_start = t.request_start + 3_000_000;
        t.stalls = vec![crate::model::Stall {
            chunk: 3,
            start_ms: 70.0,
            gap_ms: 150.0,
            queue_ms: 50.0,
            gpu_sync_ms: 100.0,
            gpu_launches: 3,
            ..crate::model::Stall::default()
        }];
        m.record(&Labels::new("svc".into(), &t), &t);
        let open = OpenRequest {
            pid: 1,
            comm: "c".into(),
            path: "/v1/chat/completions".into(),
            model: None,
            phase: Phase::FirstToken,
        };
        m.set_in_flight([("svc", &open)]);
        let rules = ResourceRules {
            host_name: "h".into(),
            ..Default::default()
        };
        let req = metrics_request(&m, &ExportCounters::default(), &rules, 200);
        let svc = &req.resource_metrics[0].scope_metrics[0].metrics;
        let names: Vec<&str> = svc.iter().map(|x| x.name.as_str()).collect();
        assert_eq!(
            names,
            vec![
                "gen_ai.server.time_to_first_token",
                "gen_ai.server.time_per_output_token",
                "gen_ai.server.request.duration",
                "gen_ai.server.inter_token_latency",
                "tokentrace.socket.wait",
                "tokentrace.stall.time",
                "tokentrace.requests.in_flight",
                "tokentrace.socket.wait.duration",
                "tokentrace.stall.duration",
            ]
        );
        let get = |name: &str| svc.iter().find(|x| x.name == name).expect(name);
        let Some(metric::Data::Histogram(itl)) = &get("gen_ai.server.inter_token_latency").data
        else {
            panic!("itl histogram")
        };
        assert_eq!(itl.data_points[0].count, 4);
        let Some(metric::Data::Sum(stall)) = &get("tokentrace.stall.time").data else {
            panic!("stall time sum")
        };
        let values: Vec<(String, Option<number_data_point::Value>)> = stall
            .data_points
            .iter()
            .map(|p| {
                let cause = p
                    .attributes
                    .iter()
                    .find(|kv| kv.key == "cause")
                    .map(|kv| format!("{:?}", kv.value))
                    .unwrap_or_default();
                (cause, p.value)
            })
            .collect();
        assert_eq!(values.len(), 2);
        // series in label order
        assert!(values[0].0.contains("gpu_sync") && values[1].0.contains("queue"));
        assert_eq!(values[0].1, Some(number_data_point::Value::AsDouble(0.1)));
        assert_eq!(values[1].1, Some(number_data_point::Value::AsDouble(0.05)));
        assert!(stall.is_monotonic);
        assert_eq!(get("tokentrace.stall.time").unit, "s");
        let Some(metric::Data::Gauge(g)) = &get("tokentrace.requests.in_flight").data else {
            panic!("in-flight gauge")
        };
        assert_eq!(
            g.data_points[0].value,
            Some(number_data_point::Value::AsInt(1))
        );
        assert!(g.data_points[0]
            .attributes
            .contains(&kv_str("phase", "waiting_first_token")));
        let Some(metric::Data::Histogram(d)) = &get("tokentrace.stall.duration").data else {
            panic!("stall duration histogram")
        };
        assert_eq!(
            (d.data_points[0].count, d.data_points[0].sum),
            (1, Some(0.15))
        );
    }
}
