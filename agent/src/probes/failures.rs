//! Uprobes the traced processes need and that could not be attached: one
//! line each naming the probe, the file, the errno, the cause and the fix;
//! counted by kind and reason for `tokentrace_probe_attach_failures_total`
//! and the summary; and what readiness is judged by.

use std::sync::Mutex;

use super::uprobe_mode::UprobeMode;

/// Which probe set a failure belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ProbeKind {
    OpenSsl,
    Cuda,
    Usdt,
}

impl ProbeKind {
    pub const ALL: [ProbeKind; 3] = [ProbeKind::OpenSsl, ProbeKind::Cuda, ProbeKind::Usdt];

    /// The `kind` label.
    pub fn label(self) -> &'static str {
        match self {
            ProbeKind::OpenSsl => "openssl",
            ProbeKind::Cuda => "cuda",
            ProbeKind::Usdt => "usdt",
        }
    }

    /// For messages.
    pub fn title(self) -> &'static str {
        match self {
            ProbeKind::OpenSsl => "OpenSSL",
            ProbeKind::Cuda => "CUDA",
            ProbeKind::Usdt => "USDT llm",
        }
    }
}

/// Why an attach failed, from its errno (the `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FailureReason {
    /// EACCES/EPERM: a capability, a read-only tracefs.
    Permission,
    /// ENOENT/ESRCH: the file or the process went away meanwhile.
    Gone,
    /// EOPNOTSUPP/ENOSYS/EINVAL: the kernel lacks the attach type.
    Unsupported,
    Other,
}

impl FailureReason {
    pub const ALL: [FailureReason; 4] = [
        FailureReason::Permission,
        FailureReason::Gone,
        FailureReason::Unsupported,
        FailureReason::Other,
    ];

    pub fn label(self) -> &'static str {
        match self {
            FailureReason::Permission => "permission",
            FailureReason::Gone => "gone",
            FailureReason::Unsupported => "unsupported",
            FailureReason::Other => "other",
        }
    }

    fn of(errno: Option<i32>) -> Self {
        match errno {
            Some(libc::EACCES | libc::EPERM | libc::EROFS) => FailureReason::Permission,
            Some(libc::ENOENT | libc::ESRCH) => FailureReason::Gone,
            Some(libc::EOPNOTSUPP | libc::ENOSYS | libc::EINVAL) => FailureReason::Unsupported,
            _ => FailureReason::Other,
        }
    }
}

/// One probe kind of one file that could not be attached for a process.
#[derive(Debug, Clone)]
pub struct AttachFailure {
    pub kind: ProbeKind,
    pub reason: FailureReason,
    pub mode: UprobeMode,
    /// None: for every process.
    pub pid: Option<u32>,
    /// The file as the process maps it.
    pub file: String,
    /// The first probe that failed (function or USDT name).
    pub probe: String,
    pub errno: Option<i32>,
    /// The error as libbpf reported it.
    pub error: String,
}

impl AttachFailure {
    /// From the error of the first failed probe of `kind` in `file`.
    pub fn new(
        kind: ProbeKind,
        mode: UprobeMode,
        pid: Option<u32>,
        file: &str,
        probe: &str,
        error: &anyhow::Error,
    ) -> Self {
        let errno = error
            .chain()
            .find_map(|cause| cause.downcast_ref::<libbpf_rs::Error>())
            .and_then(errno_of);
        AttachFailure {
            kind,
            reason: FailureReason::of(errno),
            mode,
            pid,
            file: file.to_string(),
            probe: probe.to_string(),
            errno,
            error: format!("{error:#}"),
        }
    }

    /// A failure that leaves a process without probes it needs. A process
    /// or file that went away meanwhile does not: there is nothing left to
    /// trace.
    pub fn blocks_readiness(&self) -> bool {
        self.reason != FailureReason::Gone
    }

    /// Why, and what to do about it.
    pub fn cause_and_fix(&self) -> (String, String) {
        match (self.reason, self.mode) {
            (FailureReason::Permission, UprobeMode::PerfEvent) => (
                "perf-event uprobes need CAP_SYS_ADMIN on kernels patched for CVE-2025-38466 \
                 (6.16+, 6.12.39+, 6.6.99+, 6.1.146+, 5.15.189+, 5.10.240+)"
                    .into(),
                "run on Linux 6.6+ (uprobe_multi links need no CAP_SYS_ADMIN: \
                 --uprobe-mode auto), or mount tracefs writable and use --uprobe-mode tracefs, \
                 or grant CAP_SYS_ADMIN (Helm: --set privileged=true)"
                    .into(),
            ),
            (FailureReason::Permission, UprobeMode::Tracefs) => (
                "tracefs uprobes need uprobe_events writable and CAP_PERFMON for the \
                 tracepoint perf event"
                    .into(),
                "mount the host's /sys/kernel/tracing read-write into the agent's container, \
                 or run on Linux 6.6+ (--uprobe-mode auto uses uprobe_multi links)"
                    .into(),
            ),
            (FailureReason::Permission, UprobeMode::Multi) => (
                "the kernel refused the uprobe_multi link".into(),
                "grant CAP_BPF and CAP_PERFMON (the DaemonSet's set), and check that no LSM \
                 (SELinux, AppArmor, lockdown) denies BPF links"
                    .into(),
            ),
            (FailureReason::Unsupported, mode) => (
                format!("this kernel does not support {mode} uprobes here"),
                format!(
                    "use --uprobe-mode auto (chooses what `tokentrace check` reports working); \
                     {mode} needs {}",
                    mode.needs()
                ),
            ),
            (FailureReason::Gone, _) => (
                "the process or the file went away before the probes were attached".into(),
                "none needed: a restarted process is traced again when it is found".into(),
            ),
            (FailureReason::Other, mode) => (
                format!("the {mode} attach failed"),
                "run `tokentrace check --pid PID` and `--log-level debug` for libbpf's account"
                    .into(),
            ),
        }
    }

    /// The one line printed for it.
    pub fn line(&self) -> String {
        let whom = whom(self.pid);
        let errno = match self.errno {
            Some(errno) => format!("{} ({errno})", errno_name(errno)),
            None => "no errno".into(),
        };
        let (cause, fix) = self.cause_and_fix();
        format!(
            "cannot attach the {} probes ({}) to {} for {whom} ({} mode): {errno}: {}; cause: \
             {cause}; fix: {fix}",
            self.kind.title(),
            self.probe,
            self.file,
            self.mode,
            self.error
        )
    }
}

/// Whom probes attached with `pid` serve: a pid, or every process.
pub fn whom(pid: Option<u32>) -> String {
    pid.map_or_else(|| "every process".to_string(), |p| format!("pid {p}"))
}

/// The errno behind a libbpf-rs error: its kind is too coarse (EACCES and
/// EPERM are one kind), its message carries std's "(os error N)".
pub(crate) fn errno_of(err: &libbpf_rs::Error) -> Option<i32> {
    let text = format!("{err:#}");
    let at = text.rfind("(os error ")?;
    let rest = &text[at + "(os error ".len()..];
    rest.split(')').next()?.parse().ok()
}

fn errno_name(errno: i32) -> &'static str {
    match errno {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::ESRCH => "ESRCH",
        libc::EACCES => "EACCES",
        libc::EBUSY => "EBUSY",
        libc::EINVAL => "EINVAL",
        libc::EROFS => "EROFS",
        libc::ENOSYS => "ENOSYS",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::E2BIG => "E2BIG",
        libc::ENOMEM => "ENOMEM",
        _ => "errno",
    }
}

/// Failures since the run started: new ones for the run loop to judge,
/// and counts by (kind, reason).
#[derive(Debug, Default)]
pub struct AttachFailures {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    new: Vec<AttachFailure>,
    /// The last [`RECENT_LINES`] failures' lines, oldest first.
    recent: std::collections::VecDeque<String>,
    counts: [[u64; FailureReason::ALL.len()]; ProbeKind::ALL.len()],
}

/// Failure lines kept for the live view.
const RECENT_LINES: usize = 8;

/// Counts of failures by [`ProbeKind::ALL`] × [`FailureReason::ALL`].
pub type FailureCounts = [[u64; FailureReason::ALL.len()]; ProbeKind::ALL.len()];

impl AttachFailures {
    /// Logs `failure` (its one line, at error level) and keeps it.
    pub fn record(&self, failure: AttachFailure) {
        if failure.blocks_readiness() {
            tracing::error!("{}", failure.line());
        } else {
            tracing::info!("{}", failure.line());
        }
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        let kind = ProbeKind::ALL.iter().position(|k| *k == failure.kind);
        let reason = FailureReason::ALL.iter().position(|r| *r == failure.reason);
        if let (Some(k), Some(r)) = (kind, reason) {
            inner.counts[k][r] += 1;
        }
        if inner.recent.len() == RECENT_LINES {
            inner.recent.pop_front();
        }
        inner.recent.push_back(failure.line());
        inner.new.push(failure);
    }

    /// The failures recorded since the last call that leave a process
    /// without probes it needs ([`AttachFailure::blocks_readiness`]).
    pub fn take_blocking(&self) -> Vec<AttachFailure> {
        let new = self
            .inner
            .lock()
            .map(|mut inner| std::mem::take(&mut inner.new))
            .unwrap_or_default();
        new.into_iter()
            .filter(AttachFailure::blocks_readiness)
            .collect()
    }

    /// The last few failures' lines, oldest first.
    pub fn recent_lines(&self) -> Vec<String> {
        self.inner
            .lock()
            .map(|inner| inner.recent.iter().cloned().collect())
            .unwrap_or_default()
    }

    pub fn counts(&self) -> FailureCounts {
        self.inner
            .lock()
            .map(|inner| inner.counts)
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(errno: i32, mode: UprobeMode) -> AttachFailure {
        let err = anyhow::Error::new(libbpf_rs::Error::from_raw_os_error(errno))
            .context("probe on ssl_read_internal at 0x1234");
        AttachFailure::new(
            ProbeKind::OpenSsl,
            mode,
            Some(42),
            "/usr/lib/x86_64-linux-gnu/libssl.so.3",
            "ssl_read_internal",
            &err,
        )
    }

    #[test]
    fn a_perf_event_eacces_names_the_capability_the_kernel_and_the_fix() {
        let f = failure(libc::EACCES, UprobeMode::PerfEvent);
        assert_eq!(f.errno, Some(libc::EACCES));
        assert_eq!(f.reason, FailureReason::Permission);
        assert!(f.blocks_readiness());
        let line = f.line();
        for part in [
            "OpenSSL",
            "ssl_read_internal",
            "libssl.so.3",
            "pid 42",
            "EACCES (13)",
            "CAP_SYS_ADMIN",
            "CVE-2025-38466",
            "Linux 6.6+",
            "perf_event mode",
        ] {
            assert!(line.contains(part), "{part:?} missing from {line}");
        }
    }

    #[test]
    fn a_process_gone_meanwhile_does_not_block_readiness() {
        let f = failure(libc::ENOENT, UprobeMode::Multi);
        assert_eq!(f.reason, FailureReason::Gone);
        assert!(!f.blocks_readiness());
    }

    #[test]
    fn failures_are_counted_by_kind_and_reason_and_taken_once() {
        let failures = AttachFailures::default();
        failures.record(failure(libc::EPERM, UprobeMode::Tracefs));
        failures.record(failure(libc::EACCES, UprobeMode::Tracefs));
        failures.record(failure(libc::EINVAL, UprobeMode::Multi));
        let counts = failures.counts();
        assert_eq!(counts[0][0], 2, "openssl/permission");
        assert_eq!(counts[0][2], 1, "openssl/unsupported");
        assert_eq!(failures.take_blocking().len(), 3);
        assert!(failures.take_blocking().is_empty());
        assert_eq!(failures.counts(), counts);
    }
}
