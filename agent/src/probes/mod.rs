//! Loading, attaching and detaching the kernel probes: the only module
//! that talks to libbpf. [`ProbeSet`] is what a run owns.

mod arrival_stamps;
mod attach;
mod attached;
mod data_hooks;
mod failures;
mod host;
mod infer;
mod leave_out;
mod set;
mod sock;
mod thread_state;
mod uprobe_mode;
mod uprobe_trial;
mod verifier;

pub use arrival_stamps::ArrivalStamps;
pub use attached::AttachedProbes;
pub use data_hooks::{missing_required, missing_socket_tracepoints, DataHooks, DataHooksSetting};
pub use failures::{whom, AttachFailure, AttachFailures, FailureCounts, FailureReason, ProbeKind};
pub use host::{
    ensure_tracefs, has_capability, load_failure, route_libbpf_logs, TracefsState, CAP_BPF,
    CAP_PERFMON, CAP_SYS_ADMIN,
};
pub use infer::{InferProbes, LLM_PROBES};
pub use set::{FileLinks, ProbeCommand, ProbeSet};
pub use sock::{
    KernelCounters, KernelLosses, ProbeSettings, SockProbes, TracedPids, MAX_CAPTURE_BYTES,
};
pub use thread_state::{kernel_has_task_storage, ThreadState, ThreadStateSetting};
pub use uprobe_mode::{HostUprobes, UprobeMode, UprobeModeSetting};
pub use uprobe_trial::{check_hits, tokentrace_uprobe_check_target, try_uprobe};
pub use verifier::{program_stats, ProgramStats, PRIVATE_STACK_MIN_BYTES};

/// Detaches `links` concurrently. Closing a tracepoint or uprobe perf event
/// waits for RCU grace periods in the kernel; one after the other, the
/// socket probes' 35 links took 2.4 s to detach at exit. The kernel
/// serialises part of the work, but concurrent closes overlap their waits:
/// 1.5 s measured.
pub fn detach_all(links: Vec<libbpf_rs::Link>) {
    const THREADS: usize = 16;
    if links.len() <= 1 {
        return;
    }
    let per_thread = links.len().div_ceil(THREADS);
    let mut links = links;
    std::thread::scope(|scope| {
        while !links.is_empty() {
            let chunk: Vec<libbpf_rs::Link> = links.drain(..per_thread.min(links.len())).collect();
            scope.spawn(move || drop(chunk));
        }
    });
}
