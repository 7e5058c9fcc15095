//! The live view's wire format: one cumulative snapshot of the agent, as
//! JSON (`GET /v1/top`) or in-process.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::export::Histogram;

/// Everything `top` draws from, at one instant of the agent.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TopSnapshot {
    /// The agent's CLOCK_MONOTONIC at the snapshot (ns).
    pub at_ns: u64,
    /// When the agent's aggregation started (ns, same clock): a window
    /// reaching back past it counts from zero.
    pub started_ns: u64,
    /// Cumulative totals since `started_ns`, per service × model × route.
    pub routes: Vec<RouteTotals>,
    /// The slowest requests that finished within the asked window.
    pub slowest: Vec<SlowRequest>,
    pub agent: AgentStatus,
}

/// Cumulative totals of one service × model × normalised route.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RouteTotals {
    pub service: String,
    pub model: Option<String>,
    /// `None`: no path (gRPC without one, or the overflow series).
    pub route: Option<String>,
    /// The series past `export.max_series`, all such routes together.
    pub overflow: bool,
    /// Requests finished (every one, failed or cut too).
    pub requests: u64,
    pub cancellations: u64,
    /// Successful responses' TTFT (seconds).
    pub ttft: Buckets,
    /// Every gap between chunks of streamed responses (seconds).
    pub itl: Buckets,
    /// Arrival at the host → the server's first read (seconds).
    pub socket_wait: Buckets,
    /// Seconds of late chunks' gaps by cause (`off_cpu`, `gpu_sync`, …;
    /// reasons merged).
    pub stall_seconds: BTreeMap<String, f64>,
    /// Open now: waiting for the first token, and streaming.
    pub in_flight_first_token: u64,
    pub in_flight_streaming: u64,
}

/// An explicit-bucket histogram: `counts[i]` counts values in
/// `(bounds[i-1], bounds[i]]`, the last one values above every bound.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Buckets {
    pub bounds: Vec<f64>,
    pub counts: Vec<u64>,
    pub sum: f64,
}

impl Buckets {
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Adds `h` (same bounds; an empty `self` takes them).
    pub fn add(&mut self, h: &Histogram) {
        if self.bounds.is_empty() {
            self.bounds = h.bounds.to_vec();
            self.counts = vec![0; h.counts.len()];
        }
        if self.counts.len() != h.counts.len() {
            return; // another family's bounds: never merged by the caller
        }
        for (mine, theirs) in self.counts.iter_mut().zip(&h.counts) {
            *mine += theirs;
        }
        self.sum += h.sum;
    }
}

/// One of the slowest recent requests: where its time went, its worst
/// gap, and what the waterfall draws.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SlowRequest {
    /// When it finished (agent CLOCK_MONOTONIC, ns).
    pub end_ns: u64,
    /// Arrival of its first byte on the host (ns, same clock).
    pub request_start_ns: u64,
    pub service: String,
    pub pid: u32,
    pub comm: String,
    pub method: String,
    /// Normalised path (query and ids left out).
    pub route: String,
    pub model: Option<String>,
    pub status: Option<u16>,
    pub request_id: Option<String>,
    pub abort_reason: Option<String>,
    /// The longest wait the client saw: TTFT or the worst gap, whichever
    /// is longer (what "slowest" ranks by).
    pub delay_ms: f64,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: f64,
    pub socket_wait_ms: Option<f64>,
    pub accept_wait_ms: Option<f64>,
    pub tls_handshake_ms: Option<f64>,
    /// The first read → the read that completed the request.
    pub reading_ms: f64,
    /// Request complete → the first token.
    pub to_first_token_ms: Option<f64>,
    /// First token → end of the response.
    pub stream_ms: Option<f64>,
    pub chunks: u64,
    /// Emit time of each chunk from the request start (the first
    /// [`super::recent::MAX_CHUNK_OFFSETS`]).
    pub chunk_offsets_ms: Vec<f32>,
    /// The longest gap between two chunks, and its chunk's index.
    pub worst_gap_ms: Option<f64>,
    pub worst_gap_chunk: Option<usize>,
    /// The largest cause of that gap, when it was late enough to be
    /// explained (`explain.stall_threshold`).
    pub worst_gap_cause: Option<String>,
    /// Its late chunks, each with its largest cause.
    pub stalls: Vec<StallBrief>,
}

/// A late chunk, for the waterfall.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StallBrief {
    pub chunk: usize,
    pub start_ms: f64,
    pub gap_ms: f64,
    /// The largest cause; `off_cpu (futex)` style with a reason.
    pub cause: String,
    /// Every cause with its ms, largest first.
    pub causes: Vec<(String, f64)>,
}

/// The agent's own line.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AgentStatus {
    pub pid: u32,
    pub events_received: u64,
    /// Records the kernel could not put in the ring buffer, and events the
    /// agent dropped.
    pub events_lost: u64,
    /// CPU time of the agent process so far (ns, user + system).
    pub cpu_ns: u64,
    pub rss_bytes: u64,
    pub kernel_programs: u64,
    pub uprobe_links: u64,
    /// Probe sets that could not be attached.
    pub attach_failures: u64,
    /// The last few failures' one-line descriptions.
    pub failed: Vec<String>,
    pub open_connections: u64,
}
