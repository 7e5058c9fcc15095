//! The metric aggregation folded to one row per service × model × route:
//! the latency series are keyed finer (operation, status, error type,
//! gRPC method), their histograms add up here.

use std::collections::BTreeMap;

use super::snapshot::RouteTotals;
use crate::export::{Latency, Metrics, RouteKey};
use crate::model::Phase;

pub fn route_totals(metrics: &Metrics) -> Vec<RouteTotals> {
    let mut rows: BTreeMap<RouteKey, RouteTotals> = BTreeMap::new();
    for ((which, series), h) in &metrics.latency {
        let key = RouteKey {
            service: series.service.clone(),
            route: series.route.clone(),
            model: series.model.clone(),
            overflow: series.overflow,
        };
        let r = row(&mut rows, &key);
        match which {
            Latency::TimeToFirstToken => r.ttft.add(h),
            Latency::InterToken => r.itl.add(h),
            Latency::RequestDuration => r.requests += h.count,
            _ => {}
        }
    }
    for (key, n) in &metrics.cancellations.series {
        row(&mut rows, key).cancellations += n;
    }
    for (key, h) in &metrics.socket_wait.series {
        row(&mut rows, key).socket_wait.add(h);
    }
    for ((key, cause), seconds) in &metrics.stall_time.series {
        *row(&mut rows, key)
            .stall_seconds
            .entry(cause.cause.to_string())
            .or_default() += seconds;
    }
    for ((key, phase), n) in &metrics.in_flight.series {
        let r = row(&mut rows, key);
        match phase {
            Phase::FirstToken => r.in_flight_first_token += n,
            Phase::Streaming => r.in_flight_streaming += n,
        }
    }
    rows.into_values().collect()
}

fn row<'a>(rows: &'a mut BTreeMap<RouteKey, RouteTotals>, key: &RouteKey) -> &'a mut RouteTotals {
    rows.entry(key.clone()).or_insert_with(|| RouteTotals {
        service: key.service.clone(),
        model: key.model.clone(),
        route: key.route.clone(),
        overflow: key.overflow,
        ..RouteTotals::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::Labels;

    #[test]
    fn series_of_one_route_fold_into_one_row() {
        let mut m = Metrics::new(100, 0);
        let mut t = super::super::recent::tests::timeline(10_000, 40);
        t.model = Some("m".into());
        m.record(&Labels::new("svc".into(), &t), &t);
        t.status = Some(500);
        m.record(&Labels::new("svc".into(), &t), &t);
        t.path = "/v1/completions".into();
        m.record(&Labels::new("svc".into(), &t), &t);
        let rows = route_totals(&m);
        let got: Vec<(Option<&str>, u64, u64, u64, u64)> = rows
            .iter()
            .map(|r| {
                (
                    r.route.as_deref(),
                    r.requests,
                    r.ttft.count(),
                    r.itl.count(),
                    r.socket_wait.count(),
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (Some("/v1/chat/completions"), 2, 2, 8, 2),
                (Some("/v1/completions"), 1, 1, 4, 1)
            ]
        );
    }
}
