//! Loading, attaching and detaching the kernel probes: the only module
//! that talks to libbpf. [`ProbeSet`] is what a run owns.

use std::path::Path;

use anyhow::{Context, Result};

use crate::discover::libraries::Site;

mod host;
mod infer;
mod set;
mod sock;

pub use host::{ensure_tracefs, load_failure, route_libbpf_logs, TracefsState};
pub use infer::{InferProbes, LLM_PROBES};
pub use set::{FileLinks, ProbeCommand, ProbeSet};
pub use sock::{
    KernelCounters, KernelLosses, ProbeSettings, SockProbes, TracedPids, MAX_CAPTURE_BYTES,
};

/// Attaches `entry` (and `exit` as a return probe) at `site` of `path`, for
/// `pid` (None: every process mapping the file). The file offset comes from
/// the agent's own ELF reading (`discover::placement`): no symbol lookup
/// by libbpf per attach.
pub(crate) fn attach_site(
    entry: &libbpf_rs::ProgramMut<'_>,
    exit: Option<&libbpf_rs::ProgramMut<'_>>,
    site: &Site,
    pid: Option<u32>,
    path: &Path,
) -> Result<Vec<libbpf_rs::Link>> {
    let pid = pid
        .map_or(Ok(-1), i32::try_from)
        .context("pid out of range")?;
    let offset = usize::try_from(site.placement.file_offset).context("file offset out of range")?;
    let mut links = Vec::with_capacity(2);
    for (program, retprobe) in [(Some(entry), false), (exit, true)] {
        let Some(program) = program else { continue };
        let opts = libbpf_rs::UprobeOpts {
            retprobe,
            ..libbpf_rs::UprobeOpts::default()
        };
        let link = program
            .attach_uprobe_with_opts(pid, path, offset, opts)
            .with_context(|| {
                let kind = if retprobe { "return probe" } else { "probe" };
                format!("{kind} on {} at {}", site.function, site.placement.at)
            })?;
        links.push(link);
    }
    Ok(links)
}

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
