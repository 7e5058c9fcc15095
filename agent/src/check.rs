//! `tokentrace check`: what this host supports, one line each, found by
//! trying it (loading and attaching a trivial program per probe type), not
//! by reading version numbers.

use std::fmt;
use std::mem::MaybeUninit;
use std::path::Path;

use anyhow::{Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::OpenObject;
use tokentrace_probes::check::CheckSkelBuilder;

use crate::probes::{
    check_hits, ensure_tracefs, has_capability, kernel_has_task_storage, missing_required,
    missing_socket_tracepoints, try_uprobe, HostUprobes, TracefsState, UprobeMode,
    UprobeModeSetting, CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN,
};

/// How much a missing feature matters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Tracing cannot work without it.
    Required,
    /// Some probes (TLS, CUDA, USDT, faster paths) need it.
    Optional,
}

#[derive(Debug, Clone)]
pub struct CheckLine {
    pub name: &'static str,
    pub ok: bool,
    pub need: Need,
    pub detail: String,
    /// What to do when it is missing.
    pub fix: Option<String>,
}

impl fmt::Display for CheckLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let status = match (self.ok, self.need) {
            (true, _) => "ok",
            (false, Need::Required) => "MISSING",
            (false, Need::Optional) => "missing (optional)",
        };
        write!(f, "{:<14} {:<19} {}", self.name, status, self.detail)?;
        if let (false, Some(fix)) = (self.ok, &self.fix) {
            write!(f, "\n{:<14} {:<19} fix: {fix}", "", "")?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy)]
enum Probe {
    Tracepoint,
    TpBtf,
    Kprobe,
    Fentry,
}

/// Loads only `probe`'s program, attaches it, triggers it where it can,
/// and returns how many times it fired (None if it cannot be triggered).
fn try_probe(probe: Probe) -> Result<Option<u64>> {
    let mut storage = MaybeUninit::<OpenObject>::uninit();
    let mut open = CheckSkelBuilder::default()
        .open(&mut storage)
        .context("opening check object")?;
    open.progs
        .check_tracepoint
        .set_autoload(matches!(probe, Probe::Tracepoint));
    open.progs
        .check_tp_btf
        .set_autoload(matches!(probe, Probe::TpBtf));
    open.progs
        .check_kprobe
        .set_autoload(matches!(probe, Probe::Kprobe));
    open.progs
        .check_fentry
        .set_autoload(matches!(probe, Probe::Fentry));
    open.progs.check_uprobe.set_autoload(false);
    open.progs.check_uprobe_multi.set_autoload(false);
    let skel = open.load().context("load")?;
    match probe {
        Probe::Tracepoint => {
            let _link = skel.progs.check_tracepoint.attach().context("attach")?;
            // SAFETY: getppid has no preconditions.
            unsafe { libc::getppid() };
            Ok(Some(check_hits(&skel)?))
        }
        Probe::TpBtf => skel
            .progs
            .check_tp_btf
            .attach()
            .context("attach")
            .map(|_| None),
        Probe::Kprobe => skel
            .progs
            .check_kprobe
            .attach()
            .context("attach")
            .map(|_| None),
        Probe::Fentry => skel
            .progs
            .check_fentry
            .attach()
            .context("attach")
            .map(|_| None),
    }
}

fn probe_line(name: &'static str, probe: Probe, need: Need, fix: &str) -> CheckLine {
    let (ok, detail) = match try_probe(probe) {
        Ok(Some(0)) => (false, "attached but never fired".to_string()),
        Ok(Some(hits)) => (true, format!("loaded, attached and fired ({hits} hit)")),
        Ok(None) => (true, "loaded and attached".to_string()),
        Err(err) => (false, format!("{err:#}")),
    };
    CheckLine {
        name,
        ok,
        need,
        detail,
        fix: Some(fix.to_string()),
    }
}

fn privileges() -> CheckLine {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let bpf = has_capability(CAP_BPF) && has_capability(CAP_PERFMON);
    let admin = has_capability(CAP_SYS_ADMIN);
    CheckLine {
        name: "privileges",
        ok: bpf || admin,
        need: Need::Required,
        detail: format!(
            "euid {}root, CAP_BPF+CAP_PERFMON {}, CAP_SYS_ADMIN {} (what uprobes need: see \
             their lines)",
            if root { "" } else { "non-" },
            if bpf { "yes" } else { "no" },
            if admin { "yes" } else { "no" }
        ),
        fix: Some("run as root (sudo tokentrace …) or grant CAP_BPF, CAP_PERFMON, CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH".into()),
    }
}

fn btf() -> CheckLine {
    let ok = Path::new("/sys/kernel/btf/vmlinux").is_file();
    CheckLine {
        name: "BTF",
        ok,
        need: Need::Required,
        detail: if ok {
            "/sys/kernel/btf/vmlinux".into()
        } else {
            "/sys/kernel/btf/vmlinux not found".into()
        },
        fix: Some(
            "use a kernel built with CONFIG_DEBUG_INFO_BTF=y (every major distribution since 2020)"
                .into(),
        ),
    }
}

/// Whether the data path can use the socket layer's tracepoints (what
/// `--data-hooks auto` picks), or falls back to the syscall hooks.
fn data_hooks() -> CheckLine {
    let missing = missing_socket_tracepoints();
    let required = missing_required(&missing);
    CheckLine {
        name: "socket hooks",
        ok: required.is_empty(),
        need: Need::Optional,
        detail: if missing.is_empty() {
            "tcp_sendmsg_locked, sock_send_length, sock_recv_length: the data path (--data-hooks \
             auto) costs untraced processes nothing outside socket calls"
                .into()
        } else if required.is_empty() {
            "sock_send_length, sock_recv_length: the data path (--data-hooks auto) costs \
             untraced processes nothing outside socket calls; no tcp_sendmsg_locked tracepoint \
             (Linux 6.16): each send is dated at its return, not its start"
                .into()
        } else {
            format!(
                "no {} tracepoint: the data path uses the syscall hooks, which every syscall on \
                 the host pays for",
                required.join(", ")
            )
        },
        fix: Some("Linux 6.3 or later (6.16 dates each send at its start)".into()),
    }
}

/// Whether per-thread state can live in task storage (what
/// `--thread-state auto` picks), or in preallocated maps.
fn task_storage() -> CheckLine {
    let ok = kernel_has_task_storage();
    CheckLine {
        name: "task storage",
        ok,
        need: Need::Optional,
        detail: if ok {
            "per-thread state in task storage: kernel memory only for traced threads".into()
        } else {
            "per-thread state in hash maps by thread id, preallocated (~37 MiB of kernel memory)"
                .into()
        },
        fix: Some("Linux 6.4 or later".into()),
    }
}

fn tracefs() -> CheckLine {
    let (ok, detail) = match ensure_tracefs() {
        Ok(TracefsState::AlreadyMounted(at)) => (true, format!("mounted at {at}")),
        Ok(TracefsState::MountedByAgent) => (
            true,
            "was not mounted: mounted at /sys/kernel/tracing".into(),
        ),
        Err(err) => (false, format!("{err:#}")),
    };
    CheckLine {
        name: "tracefs",
        ok,
        need: Need::Required,
        detail,
        fix: Some("mount -t tracefs nodev /sys/kernel/tracing".into()),
    }
}

fn ring_buffer() -> CheckLine {
    let name = std::ffi::CString::new("tt_check_rb").unwrap_or_default();
    // SAFETY: name is a valid C string; opts may be NULL.
    let fd = unsafe {
        libbpf_rs::libbpf_sys::bpf_map_create(
            libbpf_rs::libbpf_sys::BPF_MAP_TYPE_RINGBUF,
            name.as_ptr(),
            0,
            0,
            4096,
            std::ptr::null(),
        )
    };
    let ok = fd >= 0;
    if ok {
        // SAFETY: fd was just returned by bpf_map_create and is owned here.
        unsafe { libc::close(fd) };
    }
    CheckLine {
        name: "ring buffer",
        ok,
        need: Need::Required,
        detail: if ok {
            "BPF_MAP_TYPE_RINGBUF created".into()
        } else {
            format!(
                "creating a ring buffer map failed: {}",
                std::io::Error::from_raw_os_error(-fd)
            )
        },
        fix: Some("needs Linux 5.8 or later and BPF privileges".into()),
    }
}

/// One line per uprobe attach mode (tried on a function of the agent
/// itself), then the mode `run` takes here and what each probe kind gets.
fn uprobe_lines() -> Vec<CheckLine> {
    let modes = [
        (
            "uprobe_multi",
            UprobeMode::Multi,
            "needs Linux 6.6+ (BPF uprobe_multi links: no CAP_SYS_ADMIN needed)",
        ),
        (
            "uprobe perf",
            UprobeMode::PerfEvent,
            "needs CAP_SYS_ADMIN on kernels patched for CVE-2025-38466 (6.16+, 6.12.39+, 6.6.99+, 6.1.146+, 5.15.189+, 5.10.240+)",
        ),
        (
            "uprobe tracefs",
            UprobeMode::Tracefs,
            "needs tracefs mounted writable (uprobe_events) and CAP_PERFMON",
        ),
    ];
    let trials: Vec<(UprobeMode, Result<u64>)> = modes
        .iter()
        .map(|&(_, mode, _)| (mode, try_uprobe(mode)))
        .collect();
    let mut lines: Vec<CheckLine> = modes
        .iter()
        .zip(&trials)
        .map(|(&(name, _, fix), (_, trial))| {
            let (ok, detail) = match trial {
                Ok(hits) => (true, format!("attached and fired ({hits} hit)")),
                Err(err) => (false, format!("{err:#}")),
            };
            CheckLine {
                name,
                ok,
                need: Need::Optional,
                detail,
                fix: Some(fix.into()),
            }
        })
        .collect();
    let works = |mode: UprobeMode| trials.iter().any(|(m, t)| *m == mode && t.is_ok());
    // modes[0] is uprobe_multi: its trial decides what auto and USDT get.
    let host = HostUprobes::with_multi_trial(&trials[0].1);
    let chosen = host.choose(UprobeModeSetting::Auto).ok();
    let chosen_works = chosen.is_some_and(works);
    let usdt_mode = if host.multi.is_ok() {
        UprobeMode::Multi
    } else {
        UprobeMode::PerfEvent
    };
    let usdt_works = works(usdt_mode);
    let mode_detail = |mode: Option<UprobeMode>, ok: bool| match mode {
        Some(mode) if ok => format!("{mode} (run --uprobe-mode auto)"),
        Some(mode) => format!("{mode} would be tried, and it does not attach here"),
        None => "no mode".into(),
    };
    lines.push(CheckLine {
        name: "OpenSSL/CUDA",
        ok: chosen_works,
        need: Need::Optional,
        detail: mode_detail(chosen, chosen_works),
        fix: Some(
            "one of the uprobe modes above must work: Linux 6.6+, or CAP_SYS_ADMIN, or a \
             writable tracefs"
                .into(),
        ),
    });
    lines.push(CheckLine {
        name: "USDT",
        ok: usdt_works,
        need: Need::Optional,
        detail: format!(
            "{} (libbpf's choice: uprobe_multi where the kernel has it, else perf events)",
            mode_detail(Some(usdt_mode), usdt_works)
        ),
        fix: Some(
            "USDT is attached by libbpf: Linux 6.6+ (uprobe_multi), or CAP_SYS_ADMIN on older \
             patched kernels"
                .into(),
        ),
    });
    lines
}

/// Runs every check. The probe checks need the earlier ones to pass.
pub fn run_checks() -> Vec<CheckLine> {
    // Failures are expected here and reported on their line: libbpf's own
    // account of them is only wanted with --log-level debug.
    fn libbpf_to_debug(_: libbpf_rs::PrintLevel, msg: String) {
        tracing::debug!(target: "libbpf", "{}", msg.trim_end());
    }
    libbpf_rs::set_print(Some((libbpf_rs::PrintLevel::Debug, libbpf_to_debug)));
    let mut lines = vec![privileges(), btf(), tracefs(), ring_buffer()];
    lines.push(probe_line(
        "tracepoints",
        Probe::Tracepoint,
        Need::Required,
        "needs CONFIG_FTRACE_SYSCALLS and a mounted tracefs",
    ));
    lines.push(probe_line(
        "tp_btf",
        Probe::TpBtf,
        Need::Required,
        "needs BTF (CONFIG_DEBUG_INFO_BTF) and Linux 5.5 or later",
    ));
    lines.push(data_hooks());
    lines.push(task_storage());
    lines.extend(uprobe_lines());
    lines.push(probe_line(
        "kprobes",
        Probe::Kprobe,
        Need::Optional,
        "not used by default; needs CONFIG_KPROBES",
    ));
    lines.push(probe_line(
        "fentry",
        Probe::Fentry,
        Need::Optional,
        "not used by default; needs CONFIG_DYNAMIC_FTRACE_WITH_DIRECT_CALLS and an unrestricted lockdown mode",
    ));
    lines
}

/// Kernel release, for the report header.
pub fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// The files `pid` maps that `run` would probe: TLS libraries, CUDA
/// libraries, `llm:*` USDT providers.
pub fn probed_file_lines(pid: u32) -> Vec<String> {
    let proc_root = Path::new("/proc");
    if !proc_root.join(pid.to_string()).is_dir() {
        return vec![format!("pid {pid}: no such process")];
    }
    let files =
        crate::discover::libraries::find_probed_files(proc_root, pid, &mut Default::default());
    let mut lines = Vec::new();
    for file in &files {
        lines.push(format!(
            "pid {pid}: {}: {}",
            file.mapped_as,
            file.probes.describe()
        ));
        // Where each uprobe goes, and what a hit costs there.
        for site in file.probes.sites() {
            let ret = if site.return_probe {
                " + return probe"
            } else {
                ""
            };
            lines.push(format!("    {}{ret} at {}", site.function, site.placement));
        }
        if !file.probes.usdt.is_empty() {
            lines.push("    llm:* USDT sites: nop, emulated".to_string());
        }
    }
    for (mapped, why) in crate::discover::libraries::opaque_tls_files(proc_root, pid) {
        lines.push(format!("pid {pid}: {mapped}: TLS not traceable: {why}"));
    }
    if !files.iter().any(|f| !f.probes.tls.is_empty()) {
        lines.push(format!(
            "pid {pid}: TLS: no OpenSSL loaded (yet: libraries loaded later are found when they are mapped)"
        ));
    }
    lines
}

/// One line per probe program: its object and section, the stack depth
/// the verifier computed (per subprogram) and the instructions it
/// processed; uprobe programs at or over the private-stack threshold are
/// marked (they must disable preemption, see common.bpf.h).
pub fn program_lines() -> Vec<String> {
    let stats = match crate::probes::program_stats() {
        Ok(stats) => stats,
        Err(err) => return vec![format!("programs: cannot load them: {err:#}")],
    };
    stats
        .iter()
        .map(|p| {
            let depths: Vec<String> = p.stack_depths.iter().map(u32::to_string).collect();
            let private = if p.max_stack() >= crate::probes::PRIVATE_STACK_MIN_BYTES {
                if p.is_uprobe() {
                    " private stack on 6.13+, preemptible: must disable preemption"
                } else {
                    " private stack on 6.13+"
                }
            } else {
                ""
            };
            format!(
                "program {}/{} ({}): stack {} bytes, {} insns processed{private}",
                p.object,
                p.name,
                p.section,
                if depths.is_empty() {
                    "?".to_string()
                } else {
                    depths.join("+")
                },
                p.instructions
                    .map_or_else(|| "?".to_string(), |n| n.to_string()),
            )
        })
        .collect()
}
