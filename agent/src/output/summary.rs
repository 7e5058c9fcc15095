//! The end-of-run summary printed to stderr.
//!
//! Latencies go into fixed-size histograms, not sample lists: an agent
//! running as a DaemonSet reports millions of tokens a day, and its summary
//! must not grow with them. 3 significant digits over 1 ns..1 h keep every
//! printed percentile (0.1 ms resolution) what the exact samples give.

use std::fmt;

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::event::Event;
use crate::hops::HopStats;
use crate::model::RequestTimeline;
use crate::stitch::StitchStats;
use crate::units::ms;

/// Largest latency kept exactly; longer ones count as this (an hour-long
/// "stream" is a stuck connection, not a latency).
const MAX_TRACKED_NS: u64 = 3_600_000_000_000;

/// A latency distribution of constant size (~200 KiB: 3 significant
/// digits over 1 ns..1 h).
#[derive(Debug, Clone)]
struct Latencies(Histogram<u64>);

impl Default for Latencies {
    fn default() -> Self {
        // Cannot fail: 1 <= low, high >= 2 * low, sigfig <= 5.
        Latencies(
            Histogram::new_with_bounds(1, MAX_TRACKED_NS, 3)
                .unwrap_or_else(|_| unreachable!("constant histogram bounds are valid")),
        )
    }
}

impl Latencies {
    fn record(&mut self, ns: u64) {
        self.0.saturating_record(ns.clamp(1, MAX_TRACKED_NS));
    }

    fn extend(&mut self, values: impl IntoIterator<Item = u64>) {
        for v in values {
            self.record(v);
        }
    }

    /// Nearest-rank percentile (`q` in 0..=100), to within 0.1 %.
    fn percentile(&self, q: f64) -> Option<u64> {
        (!self.0.is_empty()).then(|| self.0.value_at_percentile(q))
    }
}

/// Aggregates over every reported request, plus loss counters.
#[derive(Debug, Default)]
pub struct RunSummary {
    ttft_ns: Latencies,
    itl_ns: Latencies,
    e2e_ns: Latencies,
    requests: u64,
    aborted: u64,
    chunks: u64,
    pub events: u64,
    pub kernel_drops: u64,
    pub channel_drops: u64,
    pub decode_errors: u64,
    /// Times the ingest thread waited for stitching (backpressure).
    pub channel_waits: u64,
    /// Children of traced processes the kernel's pid filter had no room
    /// for (they run untraced).
    pub untraced_forks: u64,
    /// Probe sets that could not be attached (a process × file × kind).
    pub probe_attach_failures: u64,
    /// TLS connections whose in-kernel record walk gave up, and records
    /// its queue had no room for (see ingress_marks.bpf.h).
    pub tls_walks_lost: u64,
    pub tls_queue_full: u64,
    /// Incoming segments dated by the arrival of a later one, because
    /// their socket's arrival slots were full (see sock_state.bpf.h).
    pub ingress_segs_merged: u64,
    /// Per-thread state the probes needed and could not get (a thread's
    /// latest read, call in flight or switch-out: see thread_state.bpf.h).
    pub thread_state_misses: u64,
    pub stitch: StitchStats,
    /// The hop join's counters.
    pub hops: HopStats,
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
                // counts come from the kernel: saturate, never overflow
                let wait = sync.ts_exit.saturating_sub(sync.ts_enter);
                counts.cuda_sync_wait_ns = counts.cuda_sync_wait_ns.saturating_add(wait);
                let launches = sync.kernel_launches.saturating_add(sync.graph_launches);
                counts.cuda_kernel_launches = counts.cuda_kernel_launches.saturating_add(launches);
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
        self.itl_ns.extend(t.stats().itl_ns.iter().copied());
        self.e2e_ns.record(t.e2e_ns());
    }

    pub fn requests(&self) -> u64 {
        self.requests
    }
}

fn dist(values: &Latencies) -> String {
    let q = |p| {
        values
            .percentile(p)
            .map_or_else(|| "-".into(), |v| format!("{:.1}", ms(v)))
    };
    format!("p50={} p95={} p99={} ms", q(50.0), q(95.0), q(99.0))
}

/// p50/p95/p99 in ms, for the machine-readable summary.
#[derive(Debug, Serialize, PartialEq)]
struct Percentiles {
    p50_ms: Option<f64>,
    p95_ms: Option<f64>,
    p99_ms: Option<f64>,
}

impl Percentiles {
    /// Rounded to 0.1 ms, as the text prints them (the histogram is exact
    /// to 0.1 %, not to the µs).
    fn of(values: &Latencies) -> Self {
        let q = |p| values.percentile(p).map(|v| (ms(v) * 10.0).round() / 10.0);
        Percentiles {
            p50_ms: q(50.0),
            p95_ms: q(95.0),
            p99_ms: q(99.0),
        }
    }
}

/// The summary as one JSON object (`--output json` prints it on stderr as
/// `{"tokentrace_summary": …}`): the same numbers as the text, with names,
/// so nothing has to parse prose.
#[derive(Debug, Serialize)]
struct SummaryJson<'a> {
    requests: u64,
    aborted: u64,
    chunks: u64,
    ttft: Percentiles,
    itl: Percentiles,
    e2e: Percentiles,
    events: u64,
    kernel_drops: u64,
    channel_drops: u64,
    decode_errors: u64,
    channel_waits: u64,
    untraced_forks: u64,
    probe_attach_failures: u64,
    tls_walks_lost: u64,
    tls_queue_full: u64,
    ingress_segs_merged: u64,
    thread_state_misses: u64,
    inference: InferenceJson,
    stitch: &'a StitchStats,
    hops: &'a HopStats,
}

#[derive(Debug, Serialize)]
struct InferenceJson {
    usdt_events: u64,
    cuda_syncs: u64,
    cuda_sync_wait_ns: u64,
    cuda_kernel_launches: u64,
    off_cpu_intervals: u64,
}

impl RunSummary {
    /// One line: `{"tokentrace_summary": {...}}`.
    pub fn to_json_line(&self) -> String {
        let inf = self.inference;
        let body = SummaryJson {
            requests: self.requests,
            aborted: self.aborted,
            chunks: self.chunks,
            ttft: Percentiles::of(&self.ttft_ns),
            itl: Percentiles::of(&self.itl_ns),
            e2e: Percentiles::of(&self.e2e_ns),
            events: self.events,
            kernel_drops: self.kernel_drops,
            channel_drops: self.channel_drops,
            decode_errors: self.decode_errors,
            channel_waits: self.channel_waits,
            untraced_forks: self.untraced_forks,
            probe_attach_failures: self.probe_attach_failures,
            tls_walks_lost: self.tls_walks_lost,
            tls_queue_full: self.tls_queue_full,
            ingress_segs_merged: self.ingress_segs_merged,
            thread_state_misses: self.thread_state_misses,
            inference: InferenceJson {
                usdt_events: inf.usdt_events,
                cuda_syncs: inf.cuda_syncs,
                cuda_sync_wait_ns: inf.cuda_sync_wait_ns,
                cuda_kernel_launches: inf.cuda_kernel_launches,
                off_cpu_intervals: inf.off_cpu_intervals,
            },
            stitch: &self.stitch,
            hops: &self.hops,
        };
        serde_json::json!({ "tokentrace_summary": body }).to_string()
    }
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
        if self.channel_waits > 0 {
            let times = match self.channel_waits {
                1 => "once".to_string(),
                n => format!("{n} times"),
            };
            writeln!(
                f,
                "  backpressure: the ingest thread waited {times} for stitching (records waited in the ring buffer)"
            )?;
        }
        if self.untraced_forks > 0 {
            writeln!(
                f,
                "  untraced: {} forked children (the kernel's pid filter is full: 8192 processes)",
                self.untraced_forks
            )?;
        }
        if self.thread_state_misses > 0 {
            writeln!(
                f,
                "  per-thread state: {} entries the probes could not create (those threads' \
                 off-CPU intervals, CUDA syncs or read dating missed)",
                self.thread_state_misses
            )?;
        }
        if self.probe_attach_failures > 0 {
            writeln!(
                f,
                "  probes: {} probe set(s) could not be attached (the log names each, with cause and fix)",
                self.probe_attach_failures
            )?;
        }
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
            "  stitching: {} parse errors, {} truncated writes, {} client connections ({} client requests), \
             {} TLS ciphertext connections ignored, {} connections evicted",
            self.stitch.parse_errors,
            self.stitch.truncated_writes,
            self.stitch.client_connections,
            self.stitch.client_requests,
            self.stitch.ciphertext_connections,
            self.stitch.evicted_connections
        )?;
        write!(
            f,
            "\n  ingress: {} streams already in flight when tracing began (skipped), \
             {} requests that arrived before their socket was tracked (timed from the read), \
             {} segments dated by a later one (their socket's arrival slots were full)",
            self.stitch.streams_in_flight_at_start,
            self.stitch.requests_without_ingress,
            self.ingress_segs_merged
        )?;
        if self.stitch.tls_untied + self.tls_walks_lost + self.tls_queue_full > 0 {
            write!(
                f,
                "\n  tls: {} requests not tied to their socket (no addresses, timed from the read), \
                 {} record walks given up and {} records unqueued (those requests dated by \
                 their socket read)",
                self.stitch.tls_untied, self.tls_walks_lost, self.tls_queue_full
            )?;
        }
        if self.stitch.h2_connections > 0 {
            write!(
                f,
                "\n  http/2: {} connections, {} HPACK references to entries from before tracing \
                 (labels unknown), {} header blocks lost, {} requests with inexact chunk counts",
                self.stitch.h2_connections,
                self.stitch.hpack_unknown_indexes,
                self.stitch.hpack_lost_blocks,
                self.stitch.chunks_inexact
            )?;
        }
        let h = &self.hops;
        let joined = h.joined_tcp_4tuple
            + h.joined_traceparent
            + h.joined_request_id
            + h.joined_response_id
            + h.joined_first_event;
        if self.stitch.client_requests + joined > 0 {
            write!(
                f,
                "\n  hops: {joined} joined (tcp 4-tuple {}, traceparent {}, request id {}, response id {}, \
                 first event {}), {} client and {} server requests unjoined, {} refused as ambiguous",
                h.joined_tcp_4tuple,
                h.joined_traceparent,
                h.joined_request_id,
                h.joined_response_id,
                h.joined_first_event,
                h.unjoined_client_requests,
                h.unjoined_server_requests,
                h.ambiguous
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{CudaSyncCall, CudaSyncEvent};
    use crate::units::percentile;

    #[test]
    fn histogram_percentiles_match_the_exact_samples_to_the_printed_digit() {
        // a skewed latency mix: 1..40 ms ITLs with a tail to 2 s
        let mut exact: Vec<u64> = Vec::new();
        let mut x: u64 = 12345;
        let mut h = Latencies::default();
        for i in 0..100_000u64 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let v = if i % 100 == 0 {
                (x >> 33) % 2_000_000_000
            } else {
                1_000_000 + (x >> 33) % 39_000_000
            };
            exact.push(v);
            h.record(v);
        }
        exact.sort_unstable();
        for q in [50.0, 95.0, 99.0, 100.0] {
            let want = percentile(&exact, q).unwrap_or_default() as f64;
            let got = h.percentile(q).unwrap_or_default() as f64;
            assert!(
                (got - want).abs() <= want * 0.001 + 1.0,
                "p{q}: histogram {got} vs exact {want}"
            );
        }
        assert_eq!(Latencies::default().percentile(50.0), None);
    }

    #[test]
    fn the_summary_does_not_grow_with_the_samples() {
        let mut h = Latencies::default();
        let before = h.0.distinct_values();
        h.extend((0..1_000_000u64).map(|i| i * 3_600_000));
        assert_eq!(h.0.distinct_values(), before, "fixed bucket array");
        h.record(u64::MAX); // beyond the tracked range: counted at the top
        assert_eq!(h.0.len(), 1_000_001);
        assert_eq!(
            h.percentile(100.0),
            Some(h.0.highest_equivalent(MAX_TRACKED_NS))
        );
    }

    #[test]
    fn backpressure_waits_are_counted_in_words() {
        let text = |waits| {
            RunSummary {
                channel_waits: waits,
                ..RunSummary::default()
            }
            .to_string()
        };
        assert!(!text(0).contains("backpressure"));
        assert!(text(1).contains("the ingest thread waited once for stitching"));
        assert!(text(3).contains("the ingest thread waited 3 times for stitching"));
    }

    #[test]
    fn the_json_line_carries_the_same_counters_as_the_text() {
        let mut summary = RunSummary {
            events: 42,
            ..RunSummary::default()
        };
        summary.stitch.parse_errors = 3;
        summary.stitch.ciphertext_connections = 2;
        summary.e2e_ns.record(5_000_000);
        let line = summary.to_json_line();
        let v: serde_json::Value = serde_json::from_str(&line).expect("json");
        let s = &v["tokentrace_summary"];
        assert_eq!(s["events"], 42);
        assert_eq!(s["stitch"]["parse_errors"], 3);
        assert_eq!(s["stitch"]["ciphertext_connections"], 2);
        assert_eq!(s["stitch"]["client_connections"], 0);
        assert_eq!(s["e2e"]["p50_ms"], 5.0);
        assert!(s["ttft"]["p50_ms"].is_null());
        assert!(summary
            .to_string()
            .contains("2 TLS ciphertext connections ignored"));
    }

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
