//! The end-of-run summary printed to stderr.

use std::fmt;

use super::{ms, percentile};
use crate::event::Event;
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
    inference: InferenceCounts,
}

/// What the inference probes saw over the run (outside any request too):
/// proof on a GPU host that the CUDA and USDT probes fire.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct InferenceCounts {
    pub usdt_events: u64,
    pub cuda_syncs: u64,
    pub cuda_sync_wait_ns: u64,
    pub cuda_kernel_launches: u64,
    pub off_cpu_intervals: u64,
}

impl RunSummary {
    /// Counts the inference probes' events (every event passes here).
    pub fn observe(&mut self, event: &Event) {
        let counts = &mut self.inference;
        match event {
            Event::Usdt(_) => counts.usdt_events += 1,
            Event::CudaSync(sync) => {
                counts.cuda_syncs += 1;
                counts.cuda_sync_wait_ns += sync.ts_exit.saturating_sub(sync.ts_enter);
                counts.cuda_kernel_launches += sync.kernel_launches + sync.graph_launches;
            }
            Event::OffCpu(_) => counts.off_cpu_intervals += 1,
            _ => {}
        }
    }

    pub fn inference(&self) -> InferenceCounts {
        self.inference
    }

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
        let inf = &self.inference;
        writeln!(
            f,
            "  inference: {} llm:* USDT events, {} CUDA syncs ({:.1} ms blocked, {} kernel launches before them), {} off-CPU intervals",
            inf.usdt_events,
            inf.cuda_syncs,
            ms(inf.cuda_sync_wait_ns),
            inf.cuda_kernel_launches,
            inf.off_cpu_intervals
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{CudaSyncCall, CudaSyncEvent};

    #[test]
    fn counts_cuda_syncs_and_launches_into_the_summary() {
        let mut summary = RunSummary::default();
        let sync = |enter: u64, exit: u64, launches: u64| {
            Event::CudaSync(CudaSyncEvent {
                pid: 1,
                tid: 1,
                ts_enter: enter,
                ts_exit: exit,
                call: CudaSyncCall::StreamSynchronize,
                handle: 0,
                kernel_launches: launches,
                graph_launches: 1,
                memcpy_bytes: 0,
            })
        };
        summary.observe(&sync(0, 2_000_000, 10));
        summary.observe(&sync(5_000_000, 5_500_000, 0));
        let counts = summary.inference();
        assert_eq!(counts.cuda_syncs, 2);
        assert_eq!(counts.cuda_kernel_launches, 12);
        assert_eq!(counts.cuda_sync_wait_ns, 2_500_000);
        let text = summary.to_string();
        assert!(
            text.contains("2 CUDA syncs (2.5 ms blocked, 12 kernel launches before them)"),
            "{text}"
        );
    }
}
