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
