//! OTLP export: spans and metrics out to a collector over gRPC or
//! HTTP/protobuf, in bounded memory, with retry.
//!
//! Owns the transport (`client`: one request out, a verdict back, and the
//! endpoint and header parsing), encoding requests from spans and
//! aggregated metrics (`encode`), the bounded span queue (`queue`) and its
//! heap accounting (`heap`), retry with backoff under a time budget
//! (`retry`), noticing that a backend which was down is back
//! (`reachability`), and the tasks that drive them (`tasks`). It does not
//! own what is sent: spans are built in [`super::spans`], metrics
//! aggregated in [`super::metrics`], resources named in
//! [`super::resource`]; nor the settings that pick the endpoints
//! ([`super::settings`]) or their errors ([`super::error`]).

mod client;
mod encode;
mod heap;
mod queue;
mod reachability;
mod retry;
mod tasks;

pub use client::{insert_header, parse_headers, OtlpProtocol, Target};
pub use encode::TraceItem;
pub use queue::QueueSender;
pub use retry::RetryPolicy;
pub use tasks::{enqueue, spawn_metrics, spawn_spans};
