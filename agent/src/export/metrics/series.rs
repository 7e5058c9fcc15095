//! Label sets of the request-level counters and gauges, and the cap on
//! how many a metric family may have.
//!
//! Service, route and model name label every request metric; the route is
//! normalised ([`super::route`]) and the model comes from request bodies,
//! so both are only partly under the operator's control. Each family
//! therefore holds at most `max_series` label sets; observations for a new
//! one past the cap go to one overflow series per service (marked
//! `otel.metric.overflow=true`, the OTel SDK's cardinality-limit
//! behaviour) and are counted, so a dashboard can show that the cap was
//! hit instead of silently merging series.

use std::collections::BTreeMap;

use super::route;
use crate::model::RequestTimeline;

/// The service and normalised route of a reported timeline, worked out
/// once per timeline ([`crate::export::Exporter::record`]) and handed on to
/// the metrics, the live view and the triggers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Labels {
    /// `service.name` of the process's resource (its comm when nothing is
    /// exported).
    pub service: String,
    /// The request path with ids replaced ([`route::normalise`]); empty
    /// when the path is unknown.
    pub route: String,
}

impl Labels {
    pub fn new(service: String, t: &RequestTimeline) -> Self {
        Self {
            service,
            route: route::normalise(&t.path),
        }
    }
}

/// Service, route and model of a request: the labels of the request-level
/// counters and gauges.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RouteKey {
    pub service: String,
    /// Normalised request path (`http.route`).
    pub route: Option<String>,
    pub model: Option<String>,
    /// The overflow series (past `max_series`).
    pub overflow: bool,
}

impl RouteKey {
    pub fn new(service: &str, path: &str, model: Option<&str>) -> Self {
        let route = route::normalise(path);
        Self {
            service: service.to_string(),
            route: (!route.is_empty()).then_some(route),
            model: model.map(str::to_owned),
            overflow: false,
        }
    }

    /// The key of a reported timeline, from its [`Labels`].
    pub fn of(labels: &Labels, t: &RequestTimeline) -> Self {
        Self {
            service: labels.service.clone(),
            route: (!labels.route.is_empty()).then(|| labels.route.clone()),
            model: t.model.clone(),
            overflow: false,
        }
    }

    /// The overflow series of `service`.
    pub fn overflow(service: &str) -> Self {
        Self {
            service: service.to_string(),
            route: None,
            model: None,
            overflow: true,
        }
    }

    /// (attribute name, value) pairs in OTel naming, service excluded.
    pub fn attributes(&self) -> Vec<(&'static str, String)> {
        let mut a = Vec::new();
        if let Some(route) = &self.route {
            a.push(("http.route", route.clone()));
        }
        if let Some(model) = &self.model {
            a.push(("gen_ai.request.model", model.clone()));
        }
        if self.overflow {
            a.push(("otel.metric.overflow", "true".to_string()));
        }
        a
    }
}

/// A key made of a [`RouteKey`] and labels of the family's own.
pub trait Keyed: Ord + Clone {
    fn route_key(&self) -> &RouteKey;
    /// The overflow series for this key's service (own labels kept: they
    /// come from a fixed set, such as a stall cause).
    fn overflowed(&self) -> Self;
}

impl Keyed for RouteKey {
    fn route_key(&self) -> &RouteKey {
        self
    }
    fn overflowed(&self) -> Self {
        RouteKey::overflow(&self.service)
    }
}

impl<T: Ord + Clone> Keyed for (RouteKey, T) {
    fn route_key(&self) -> &RouteKey {
        &self.0
    }
    fn overflowed(&self) -> Self {
        (RouteKey::overflow(&self.0.service), self.1.clone())
    }
}

/// One metric family's series: at most `max` label sets plus overflow.
#[derive(Debug, Clone)]
pub struct Capped<K, V> {
    pub series: BTreeMap<K, V>,
    /// Observations that went to an overflow series.
    pub overflowed: u64,
}

impl<K, V> Default for Capped<K, V> {
    fn default() -> Self {
        Self {
            series: BTreeMap::new(),
            overflowed: 0,
        }
    }
}

impl<K: Keyed, V> Capped<K, V> {
    /// The value of `key`'s series, or of its overflow series when `key` is
    /// new and the family already has `max` series.
    pub fn slot(&mut self, key: K, max: usize, new: impl FnOnce() -> V) -> &mut V {
        let key = if self.series.contains_key(&key) || self.series.len() < max {
            key
        } else {
            self.overflowed += 1;
            key.overflowed()
        };
        self.series.entry(key).or_insert_with(new)
    }

    pub fn is_empty(&self) -> bool {
        self.series.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn past_the_cap_new_label_sets_share_one_overflow_series_and_are_counted() {
        let mut c: Capped<RouteKey, u64> = Capped::default();
        for route in ["/a", "/b", "/c", "/a", "/d"] {
            *c.slot(RouteKey::new("s", route, None), 2, || 0) += 1;
        }
        let mut d: Capped<(RouteKey, &str), u64> = Capped::default();
        for (route, cause) in [
            ("/a", "x"),
            ("/b", "x"),
            ("/c", "x"),
            ("/a", "x"),
            ("/d", "y"),
        ] {
            *d.slot((RouteKey::new("s", route, None), cause), 2, || 0) += 1;
        }
        let got: Vec<(Option<&str>, &str, bool, u64)> = d
            .series
            .iter()
            .map(|((k, cause), n)| (k.route.as_deref(), *cause, k.overflow, *n))
            .collect();
        assert_eq!(
            got,
            vec![
                (None, "x", true, 1),
                (None, "y", true, 1),
                (Some("/a"), "x", false, 2),
                (Some("/b"), "x", false, 1),
            ]
        );
        assert_eq!(d.overflowed, 2);
        assert_eq!(c.overflowed, 2);
        assert_eq!(c.series.len(), 3, "two routes and one overflow series");
    }

    #[test]
    fn route_labels_are_normalised() {
        let k = RouteKey::new("s", "/v1/threads/12345/runs?x=1", Some("m"));
        assert_eq!(
            k.attributes(),
            vec![
                ("http.route", "/v1/threads/{id}/runs".to_string()),
                ("gen_ai.request.model", "m".to_string())
            ]
        );
        assert_eq!(RouteKey::new("s", "", None).route, None);
    }
}
