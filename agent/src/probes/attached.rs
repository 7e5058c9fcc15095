//! How many probes are in place right now: the kernel programs attached at
//! load and the uprobe links of the traced processes' files. The ingest
//! thread writes it (it owns the links); the live view's agent line reads
//! it, beside the failures.

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Default)]
pub struct AttachedProbes {
    kernel: AtomicU64,
    uprobe_links: AtomicU64,
}

impl AttachedProbes {
    pub(super) fn set_kernel(&self, programs: usize) {
        self.kernel.store(programs as u64, Ordering::Relaxed);
    }

    pub(super) fn set_uprobe_links(&self, links: usize) {
        self.uprobe_links.store(links as u64, Ordering::Relaxed);
    }

    /// Kernel programs (tracepoints, sched_switch) attached.
    pub fn kernel(&self) -> u64 {
        self.kernel.load(Ordering::Relaxed)
    }

    /// Uprobe links (OpenSSL, CUDA, USDT) attached for traced processes.
    pub fn uprobe_links(&self) -> u64 {
        self.uprobe_links.load(Ordering::Relaxed)
    }
}
