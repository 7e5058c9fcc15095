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

use super::metrics::{self_metrics, ExportCounters, Kind, Latency, Metrics, CANCELLATIONS};
use super::resource::{kv_int, kv_str, ResourceRules};

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
        let point = HistogramDataPoint {
            attributes,
            start_time_unix_nano: start,
            time_unix_nano: now_unix_nano,
            count: h.count,
            sum: Some(h.sum),
            bucket_counts: h.counts.clone(),
            explicit_bounds: h.bounds.to_vec(),
            min: (h.count > 0).then_some(h.min),
            max: (h.count > 0).then_some(h.max),
            ..Default::default()
        };
        by_service
            .entry(&key.service)
            .or_default()
            .entry(*which)
            .or_default()
            .push(point);
    }
    let mut cancellations: BTreeMap<&str, Vec<NumberDataPoint>> = BTreeMap::new();
    for (key, n) in &metrics.cancellations {
        by_service.entry(&key.service).or_default();
        cancellations
            .entry(&key.service)
            .or_default()
            .push(NumberDataPoint {
                attributes: key
                    .attributes()
                    .into_iter()
                    .map(|(k, v)| kv_str(k, v))
                    .collect(),
                start_time_unix_nano: start,
                time_unix_nano: now_unix_nano,
                value: Some(number_data_point::Value::AsInt(
                    i64::try_from(*n).unwrap_or(i64::MAX),
                )),
                ..Default::default()
            });
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
            if let Some(data_points) = cancellations.remove(service) {
                list.push(Metric {
                    name: CANCELLATIONS.0.to_string(),
                    description: CANCELLATIONS.1.to_string(),
                    unit: "{request}".to_string(),
                    data: Some(metric::Data::Sum(Sum {
                        data_points,
                        aggregation_temporality: cumulative,
                        is_monotonic: true,
                    })),
                    ..Default::default()
                });
            }
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
