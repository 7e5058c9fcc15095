//! The end-of-run summary printed to stderr.

use std::fmt;

use super::{ms, percentile};
use crate::stitch::{RequestTimeline, StitchStats};

/// Aggregates over every reported request, plus loss counters.
#[derive(Debug, Default)]
pub struct RunSummary {
    ttft_ns: Vec<u64>,
    itl_ns: Vec<u64>,
    e2e_ns: Vec<u64>,
    requests: u64,
    aborted: u64,
    chunks: u64,
    pub events: u64,
    pub kernel_drops: u64,
    pub channel_drops: u64,
    pub decode_errors: u64,
    pub stitch: StitchStats,
}

impl RunSummary {
    pub fn record(&mut self, t: &RequestTimeline) {
        self.requests += 1;
        self.aborted += u64::from(t.aborted);
        self.chunks += t.chunk_ts.len() as u64;
        self.ttft_ns.extend(t.ttft_ns());
        self.itl_ns.extend(t.itl_ns());
        self.e2e_ns.push(t.e2e_ns());
    }

    pub fn requests(&self) -> u64 {
        self.requests
    }
}

fn dist(values: &[u64]) -> String {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    let q = |p| percentile(&sorted, p).map_or_else(|| "-".into(), |v| format!("{:.1}", ms(v)));
    format!("p50={} p95={} p99={} ms", q(50.0), q(95.0), q(99.0))
}

impl fmt::Display for RunSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "tokentrace summary")?;
        writeln!(
            f,
            "  requests: {} ({} aborted), chunks: {}",
            self.requests, self.aborted, self.chunks
        )?;
        writeln!(f, "  TTFT: {}", dist(&self.ttft_ns))?;
        writeln!(f, "  ITL:  {}", dist(&self.itl_ns))?;
        writeln!(f, "  E2E:  {}", dist(&self.e2e_ns))?;
        writeln!(
            f,
            "  events: {} received, {} lost in kernel, {} lost in agent, {} undecodable",
            self.events, self.kernel_drops, self.channel_drops, self.decode_errors
        )?;
        write!(
            f,
            "  stitching: {} parse errors, {} truncated writes, {} client connections ignored, \
             {} TLS ciphertext connections ignored, {} connections evicted",
            self.stitch.parse_errors,
            self.stitch.truncated_writes,
            self.stitch.client_connections,
            self.stitch.ciphertext_connections,
            self.stitch.evicted_connections
        )
    }
}
