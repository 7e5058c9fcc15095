//! Host preparation the probes depend on: tracefs and libbpf's log routing.

use std::path::Path;

use anyhow::{bail, Context, Result};

const TRACEFS: &str = "/sys/kernel/tracing";
const DEBUGFS_TRACING: &str = "/sys/kernel/debug/tracing";

/// Where tracefs was found, or that the agent had to mount it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TracefsState {
    AlreadyMounted(&'static str),
    MountedByAgent,
}

/// Tracepoint attachment resolves event ids through tracefs, which a fresh
/// machine may not have mounted. Mount it at /sys/kernel/tracing if needed.
pub fn ensure_tracefs() -> Result<TracefsState> {
    for dir in [TRACEFS, DEBUGFS_TRACING] {
        if Path::new(dir).join("events").is_dir() {
            return Ok(TracefsState::AlreadyMounted(dir));
        }
    }
    let target = std::ffi::CString::new(TRACEFS).context("tracefs path")?;
    let fstype = std::ffi::CString::new("tracefs").context("tracefs type")?;
    let source = std::ffi::CString::new("nodev").context("tracefs source")?;
    // SAFETY: all pointers are valid NUL-terminated strings that outlive the
    // call; `data` may be NULL for tracefs.
    let rc = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        bail!(
            "tracefs is not mounted and mounting it at {TRACEFS} failed ({err}); \
             run `mount -t tracefs nodev {TRACEFS}` as root, or in a container mount the \
             host's /sys/kernel/tracing"
        );
    }
    if !Path::new(TRACEFS).join("events").is_dir() {
        bail!("mounted tracefs at {TRACEFS} but it has no events/ directory: kernel built without CONFIG_FTRACE?");
    }
    Ok(TracefsState::MountedByAgent)
}

pub const CAP_SYS_ADMIN: u32 = 21;
pub const CAP_PERFMON: u32 = 38;
pub const CAP_BPF: u32 = 39;

/// Whether this process holds capability `bit` (its effective set).
pub fn has_capability(bit: u32) -> bool {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << bit) != 0)
}

/// Sends libbpf's own messages (verifier logs, attach failures) to `tracing`.
pub fn route_libbpf_logs() {
    fn forward(level: libbpf_rs::PrintLevel, msg: String) {
        let msg = msg.trim_end();
        match level {
            libbpf_rs::PrintLevel::Warn => tracing::warn!(target: "libbpf", "{msg}"),
            libbpf_rs::PrintLevel::Info => tracing::debug!(target: "libbpf", "{msg}"),
            libbpf_rs::PrintLevel::Debug => tracing::trace!(target: "libbpf", "{msg}"),
        }
    }
    libbpf_rs::set_print(Some((libbpf_rs::PrintLevel::Debug, forward)));
}

/// What to say when the kernel refused to load `what`: only a refusal for
/// lack of privilege is about root or capabilities; the verifier or missing
/// BTF fail otherwise, and libbpf's log (routed to ours) says how.
pub fn load_failure(what: &str, err: &libbpf_rs::Error) -> String {
    if err.kind() == libbpf_rs::ErrorKind::PermissionDenied {
        format!("loading {what} into the kernel: permission denied (needs root, or CAP_BPF and CAP_PERFMON; `tokentrace check` lists what is missing)")
    } else {
        format!("loading {what} into the kernel: the kernel rejected it (the libbpf log above says why: verifier, BTF); `tokentrace check` lists what this kernel supports")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shown(err: libbpf_rs::Error) -> String {
        let message = load_failure("the socket BPF programs", &err);
        format!("{:#}", anyhow::Error::new(err).context(message))
    }

    #[test]
    fn only_a_permission_error_talks_about_privileges() {
        let denied = shown(libbpf_rs::Error::from_raw_os_error(libc::EPERM));
        assert!(denied.contains("needs root, or CAP_BPF"), "{denied}");
        let rejected = shown(libbpf_rs::Error::from_raw_os_error(libc::EINVAL));
        assert!(rejected.contains("the kernel rejected it"), "{rejected}");
        assert!(!rejected.contains("root"), "{rejected}");
        // The cause is printed once, after the context.
        assert_eq!(
            rejected.matches("Invalid argument").count(),
            1,
            "{rejected}"
        );
    }
}
