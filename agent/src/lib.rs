//! tokentrace: per-request TTFT and inter-token latency of LLM inference
//! servers, from eBPF probes on sockets.
//!
//! Pipeline: `discover` (which processes) → `probes` (load, attach) →
//! `ingest` (decode ring buffer records into [`event::Event`]) → `stitch`
//! (pure: events → [`stitch::RequestTimeline`]) → `explain` → `export` /
//! `output`. What the stages hand each other lives at the bottom: `event`
//! (decoded records), `model` (timelines and their stalls), `units`.

pub mod check;
pub mod cli;
pub mod config;
pub mod defaults;
pub mod discover;
pub mod event;
pub mod explain;
pub mod export;
#[cfg(test)]
mod fuzz;
pub mod hops;
pub mod ingest;
pub mod k8s;
pub mod live;
pub mod model;
pub mod output;
pub mod pipeline;
pub mod probes;
pub mod record;
pub mod run;
pub mod session;
pub mod stitch;
pub mod top;
pub mod trigger;
pub mod units;
