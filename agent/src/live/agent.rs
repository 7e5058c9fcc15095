//! The agent's own line of the live view: its counters, CPU, memory and
//! probes, sampled by the run loop once a second.

use super::snapshot::AgentStatus;
use crate::export::AgentCounters;
use crate::probes::{AttachFailures, AttachedProbes};

/// The agent's line now: the run's counters, its probes, and the
/// process's own CPU time and resident memory.
pub fn agent_status(
    counters: &AgentCounters,
    attached: &AttachedProbes,
    failures: &AttachFailures,
) -> AgentStatus {
    AgentStatus {
        pid: std::process::id(),
        events_received: counters.events_received,
        events_lost: counters.events_lost_kernel + counters.events_lost_agent,
        cpu_ns: cpu_ns(),
        rss_bytes: rss_bytes(),
        kernel_programs: attached.kernel(),
        uprobe_links: attached.uprobe_links(),
        attach_failures: counters.probe_attach_failures.iter().flatten().sum(),
        failed: failures.recent_lines(),
        open_connections: counters.open_connections,
    }
}

/// User + system time of every thread (getrusage: µs resolution, where
/// /proc's ticks are 10 ms).
fn cpu_ns() -> u64 {
    // SAFETY: rusage is plain data, written whole by the call.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a rusage.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return 0;
    }
    let ns = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1_000;
    ns(usage.ru_utime) + ns(usage.ru_stime)
}

/// Resident set size (/proc/self/statm's second field, in pages).
fn rss_bytes() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(0) as u64;
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * page)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_and_memory_of_this_process_are_read() {
        let before = cpu_ns();
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        assert!(cpu_ns() > before);
        assert!(rss_bytes() > 1 << 20);
    }
}
