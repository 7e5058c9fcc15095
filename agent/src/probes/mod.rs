//! Loading and attaching the kernel probes: the only module that talks to
//! libbpf.

mod host;
mod infer;
mod sock;

pub use host::{ensure_tracefs, route_libbpf_logs, TracefsState};
pub use infer::{CudaLibrary, InferProbes, LLM_PROBES};
pub use sock::{
    KernelCounters, KernelLosses, ProbeSettings, SockProbes, TracedPids, MAX_CAPTURE_BYTES,
};

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
