//! The Prometheus side: the text endpoint (`--metrics-addr`, `GET
//! /metrics`) and, beside it, `/healthz` and `/readyz` for Kubernetes
//! probes.
//!
//! Owns rendering the aggregation as Prometheus text and answering HTTP
//! on the listener. It does not own the aggregation itself
//! ([`super::metrics`]), the readiness flag it reports (set by the run
//! loop through [`super::Exporter`], kept in `Shared`), or binding the
//! address (the door does that, so a bad address fails the start).

mod endpoint;
pub mod health;

pub use endpoint::serve;
