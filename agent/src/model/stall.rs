//! A late chunk and what its gap was spent on.

use serde::Serialize;

/// The cause breakdown of one stalled chunk. Every cause is a disjoint part
/// of the gap (earlier causes win where they overlap, in field order), so
/// `queue + preempted + prefill + gpu_sync + flow_control + off_cpu + unexplained = gap`. `socket_ms`
/// is the time the chunk's bytes then sat in the socket's send queue: it
/// comes after the gap, delaying delivery rather than emission.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Stall {
    /// Index of the late chunk (0: the first token, whose gap is TTFT).
    pub chunk: usize,
    /// Gap start, from request start.
    pub start_ms: f64,
    pub gap_ms: f64,
    /// Waiting to be scheduled (`llm:request_queued` → `request_scheduled`).
    pub queue_ms: f64,
    /// Evicted by the engine (`llm:request_preempted` → its next
    /// `request_scheduled`): its KV cache was taken for other requests.
    pub preempted_ms: f64,
    /// Prefill (`llm:prefill_start` → `prefill_end`).
    pub prefill_ms: f64,
    /// Serving threads blocked in CUDA synchronisation calls. GPU time is
    /// inferred from sync waits: uprobes see work enqueued, not executed.
    pub gpu_sync_ms: f64,
    /// HTTP/2: the server's writes of this stream waited for the client's
    /// WINDOW_UPDATE (its flow-control window was used up: the client was
    /// not reading).
    pub flow_control_ms: f64,
    /// Serving threads off-CPU, outside the causes above.
    pub off_cpu_ms: f64,
    /// What the longest off-CPU part was blocked in: futex, sleep, io,
    /// preempted, cuda_sync, or `syscall N`.
    pub off_cpu_reason: Option<String>,
    /// Bytes held in the send queue (Nagle waiting for an ACK, or a full
    /// window) after the write.
    pub socket_ms: f64,
    /// Socket write of the chunk with TCP_NODELAY off.
    pub nagle: bool,
    pub unexplained_ms: f64,
    /// Most requests sharing one engine step in the gap (`llm:batch_step`):
    /// the step served them all and is not charged to one.
    pub batch_fan_in: Option<u64>,
    /// Kernel launches reported by the syncs in the gap.
    pub gpu_launches: u64,
    /// With an `llm:token` mark inside the gap: the part before it, while
    /// the engine made the token (the causes above on that side are the
    /// engine's threads)...
    pub engine_ms: Option<f64>,
    /// ...and the part after it, while the frontend delivered it.
    pub frontend_ms: Option<f64>,
}
