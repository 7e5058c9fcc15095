//! What the inference engine itself reported about one request.

use serde::Serialize;

/// A request as its engine saw it, from the `llm:*` probes joined by
/// request id (for vLLM: the tokentrace-vllm plugin, whose times are vLLM's
/// own scheduler stamps, so these agree with vLLM's metrics). Each field is
/// absent when the engine fired none of the probes it is made from.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct EngineView {
    /// Waiting to be scheduled: first `llm:request_queued` → first
    /// `request_scheduled` (vLLM's `queued_time`).
    pub queue_ms: Option<f64>,
    /// First `llm:prefill_start` → first `prefill_end` (vLLM: scheduled →
    /// the step that produced the first token, its `prefill_time`).
    pub prefill_ms: Option<f64>,
    /// Most requests that shared one engine step with this one
    /// (`llm:batch_step` after this request's `llm:token` on that thread).
    pub batch_fan_in: Option<u64>,
    /// Engine steps that produced tokens of this request.
    pub batch_steps: u64,
    /// Times the engine evicted it (`llm:request_preempted`).
    pub preemptions: u64,
    /// Time spent evicted: each preemption → the request's next
    /// `request_scheduled` (or its next token, or its end).
    pub preempted_ms: f64,
}
