//! `/healthz` and `/readyz` beside `/metrics`, for Kubernetes probes.
//!
//! Liveness: the endpoint answers, so the runtime that also drives the run
//! loop and the export tasks is not wedged. Readiness: the run loop has
//! loaded and attached the eBPF programs and scanned the running processes
//! ([`crate::export::Exporter::set_ready`]); before that, a node's agent shows as
//! not ready instead of silently tracing nothing.

use hyper::{Method, StatusCode};

use crate::export::shared::Readiness;

pub const LIVENESS_PATH: &str = "/healthz";
pub const READINESS_PATH: &str = "/readyz";

/// Status and body for a health path; `None` for any other request.
pub fn respond(
    method: &Method,
    path: &str,
    ready: &Readiness,
) -> Option<(StatusCode, &'static str)> {
    if !matches!(*method, Method::GET | Method::HEAD) {
        return None;
    }
    match path {
        LIVENESS_PATH => Some((StatusCode::OK, "ok\n")),
        READINESS_PATH if ready.get() => Some((StatusCode::OK, "ready\n")),
        READINESS_PATH => Some((
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: eBPF programs not attached yet, or probes a traced process needs failed to attach (see the agent's log)\n",
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn liveness_always_readiness_after_set() {
        let ready = Readiness::default();
        assert_eq!(
            respond(&Method::GET, "/healthz", &ready).map(|r| r.0),
            Some(StatusCode::OK)
        );
        assert_eq!(
            respond(&Method::GET, "/readyz", &ready).map(|r| r.0),
            Some(StatusCode::SERVICE_UNAVAILABLE)
        );
        ready.set();
        assert_eq!(
            respond(&Method::HEAD, "/readyz", &ready).map(|r| r.0),
            Some(StatusCode::OK)
        );
        assert_eq!(respond(&Method::POST, "/healthz", &ready), None);
        assert_eq!(respond(&Method::GET, "/metrics", &ready), None);
    }
}
