//! How this host lets the agent place uprobes, and which of the three ways
//! a run uses.
//!
//! Kernels patched for CVE-2025-38466 (upstream 6.16; 5.10.240, 5.15.189,
//! 6.1.146, 6.6.99, 6.12.39, 6.15.7) require CAP_SYS_ADMIN to open a perf
//! event on the uprobe PMU, the path libbpf takes by default. A DaemonSet
//! holding only CAP_BPF and CAP_PERFMON has two other ways: a BPF
//! `uprobe_multi` link (kernel 6.6+; the link itself checks no capability)
//! and a legacy tracefs uprobe (`uprobe_events`, needs tracefs writable).
//! The mode is chosen once, before the programs load: a program loaded for
//! uprobe_multi links cannot be attached through a perf event, and back.

use std::fmt;
use std::mem::MaybeUninit;
use std::path::Path;

use anyhow::{bail, Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{MapCore, MapFlags, OpenObject, UprobeMultiOpts, UprobeOpts};
use serde::Deserialize;
use tokentrace_probes::check::{CheckSkel, CheckSkelBuilder};

use super::host::{has_capability, CAP_SYS_ADMIN};

/// How uprobes are attached in a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum UprobeMode {
    /// One BPF `uprobe_multi` link per program and file (kernel 6.6+):
    /// no CAP_SYS_ADMIN, one link for every offset of a program.
    Multi,
    /// A perf event per probe on the uprobe PMU (libbpf's default): needs
    /// CAP_SYS_ADMIN on kernels with the CVE-2025-38466 fix.
    PerfEvent,
    /// A legacy tracefs uprobe per probe (`uprobe_events`): needs tracefs
    /// mounted writable; an agent killed with SIGKILL leaves its
    /// `libbpf_<pid>_*` entries behind.
    Tracefs,
}

impl UprobeMode {
    pub fn name(self) -> &'static str {
        match self {
            UprobeMode::Multi => "uprobe_multi",
            UprobeMode::PerfEvent => "perf_event",
            UprobeMode::Tracefs => "tracefs",
        }
    }

    /// What the mode needs of the host, for messages.
    pub fn needs(self) -> &'static str {
        match self {
            UprobeMode::Multi => "Linux 6.6+, CAP_BPF + CAP_PERFMON",
            UprobeMode::PerfEvent => {
                "CAP_SYS_ADMIN on kernels patched for CVE-2025-38466 (6.16+, 6.12.39+, 6.6.99+, \
                 6.1.146+, 5.15.189+, 5.10.240+); CAP_PERFMON before"
            }
            UprobeMode::Tracefs => "tracefs mounted writable, CAP_PERFMON",
        }
    }
}

impl fmt::Display for UprobeMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The `--uprobe-mode` / `discovery.uprobe_mode` setting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum UprobeModeSetting {
    /// uprobe_multi where the kernel has it, else perf events with
    /// CAP_SYS_ADMIN, else tracefs when writable, else perf events.
    #[default]
    Auto,
    #[value(name = "uprobe_multi")]
    #[serde(rename = "uprobe_multi")]
    Multi,
    #[value(name = "perf_event")]
    #[serde(rename = "perf_event")]
    PerfEvent,
    Tracefs,
}

/// Loads uprobe programs of an open object for `mode`: uprobe_multi links
/// take only programs loaded with that attach type, perf-event and tracefs
/// uprobes only programs loaded without it.
pub(super) fn prepare_uprobes(object: &mut libbpf_rs::OpenObject, mode: UprobeMode) {
    if mode != UprobeMode::Multi {
        return;
    }
    for mut program in object.progs_mut() {
        let section = program.section().to_string_lossy();
        if section == "uprobe" || section == "uretprobe" {
            program.set_attach_type(libbpf_rs::ProgramAttachType::TraceUprobeMulti);
        }
    }
}

/// What this host allows, found by trying.
#[derive(Debug, Clone)]
pub struct HostUprobes {
    /// A uprobe_multi link on a function of the agent fired, or why not.
    pub multi: std::result::Result<(), String>,
    pub sys_admin: bool,
    /// `uprobe_events` of the mounted tracefs is writable.
    pub tracefs_writable: bool,
}

impl HostUprobes {
    /// Tries a uprobe_multi link and looks at the capabilities and tracefs.
    pub fn probe() -> Self {
        Self::with_multi_trial(&try_uprobe(UprobeMode::Multi))
    }

    /// The same, given a uprobe_multi trial ([`try_uprobe`]) already made.
    pub fn with_multi_trial(multi: &Result<u64>) -> Self {
        HostUprobes {
            multi: multi
                .as_ref()
                .map(|_hits| ())
                .map_err(|err| format!("{err:#}")),
            sys_admin: has_capability(CAP_SYS_ADMIN),
            tracefs_writable: tracefs_writable(),
        }
    }

    /// The mode `setting` gives on this host; an explicit mode the host
    /// cannot have is an error.
    pub fn choose(&self, setting: UprobeModeSetting) -> Result<UprobeMode> {
        match setting {
            UprobeModeSetting::Auto => Ok(if self.multi.is_ok() {
                UprobeMode::Multi
            } else if self.sys_admin || !self.tracefs_writable {
                // Without CAP_SYS_ADMIN this still works on kernels without
                // the CVE fix; where it does not, the attach failure says why.
                UprobeMode::PerfEvent
            } else {
                UprobeMode::Tracefs
            }),
            UprobeModeSetting::Multi => match &self.multi {
                Ok(()) => Ok(UprobeMode::Multi),
                Err(why) => bail!(
                    "--uprobe-mode uprobe_multi: this kernel does not attach uprobe_multi links \
                     ({why}); they need Linux 6.6 or later (use --uprobe-mode auto)"
                ),
            },
            UprobeModeSetting::PerfEvent => Ok(UprobeMode::PerfEvent),
            UprobeModeSetting::Tracefs => Ok(UprobeMode::Tracefs),
        }
    }
}

/// Whether the legacy tracefs interface can take new uprobes.
fn tracefs_writable() -> bool {
    ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"]
        .into_iter()
        .map(|dir| Path::new(dir).join("uprobe_events"))
        .filter(|file| file.exists())
        .any(|file| {
            let Ok(path) = std::ffi::CString::new(file.as_os_str().as_encoded_bytes()) else {
                return false;
            };
            // SAFETY: path is a valid NUL-terminated string.
            unsafe { libc::access(path.as_ptr(), libc::W_OK) == 0 }
        })
}

/// A function of this executable for the uprobe checks to attach to.
#[no_mangle]
#[inline(never)]
pub extern "C" fn tokentrace_uprobe_check_target(x: u64) -> u64 {
    std::hint::black_box(x).wrapping_add(1)
}

/// The file offset of `address` in the agent's own executable, from
/// /proc/self/maps (no symbol table needed: the release binary may be
/// stripped).
fn own_file_offset(address: usize) -> Result<usize> {
    let maps = std::fs::read_to_string("/proc/self/maps").context("reading /proc/self/maps")?;
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(_perms), Some(offset)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let Some((start, end)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end), Ok(offset)) = (
            usize::from_str_radix(start, 16),
            usize::from_str_radix(end, 16),
            usize::from_str_radix(offset, 16),
        ) else {
            continue;
        };
        if (start..end).contains(&address) {
            return Ok(address - start + offset);
        }
    }
    bail!("address {address:#x} is in no mapping of /proc/self/maps")
}

/// Loads the check object's program for `mode`, attaches it to
/// [`tokentrace_uprobe_check_target`] for this process, calls that and
/// returns how many times the program ran.
pub fn try_uprobe(mode: UprobeMode) -> Result<u64> {
    let mut storage = MaybeUninit::<OpenObject>::uninit();
    let mut open = CheckSkelBuilder::default()
        .open(&mut storage)
        .context("opening check object")?;
    for mut program in open.open_object_mut().progs_mut() {
        let wanted = match mode {
            UprobeMode::Multi => "check_uprobe_multi",
            UprobeMode::PerfEvent | UprobeMode::Tracefs => "check_uprobe",
        };
        let name = program.name().to_string_lossy().into_owned();
        program.set_autoload(name == wanted);
    }
    let skel = open.load().context("load")?;
    let offset = own_file_offset(tokentrace_uprobe_check_target as *const () as usize)?;
    let exe = Path::new("/proc/self/exe");
    let _link = match mode {
        UprobeMode::Multi => skel
            .progs
            .check_uprobe_multi
            .attach_uprobe_multi_with_opts(
                0,
                exe,
                "",
                UprobeMultiOpts {
                    offsets: vec![offset],
                    ..UprobeMultiOpts::default()
                },
            )
            .context("attach uprobe_multi link")?,
        UprobeMode::PerfEvent => skel
            .progs
            .check_uprobe
            .attach_uprobe_with_opts(0, exe, offset, UprobeOpts::default())
            .context("attach perf-event uprobe")?,
        UprobeMode::Tracefs => {
            super::attach::attach_legacy(&skel.progs.check_uprobe, false, 0, exe, offset)
                .context("attach tracefs uprobe")?
        }
    };
    tokentrace_uprobe_check_target(1);
    hits(&skel)
}

fn hits(skel: &CheckSkel<'_>) -> Result<u64> {
    let hits = check_hits(skel)?;
    if hits == 0 {
        bail!("attached but never fired");
    }
    Ok(hits)
}

/// How many times the check object's programs ran (its `.bss` counter).
pub fn check_hits(skel: &CheckSkel<'_>) -> Result<u64> {
    let bss = skel
        .maps
        .bss
        .lookup(&0u32.to_ne_bytes(), MapFlags::ANY)?
        .context("empty .bss")?;
    let bytes: [u8; 8] = bss.get(..8).context("short .bss")?.try_into()?;
    Ok(u64::from_ne_bytes(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(multi: bool, sys_admin: bool, tracefs_writable: bool) -> HostUprobes {
        HostUprobes {
            multi: if multi { Ok(()) } else { Err("EINVAL".into()) },
            sys_admin,
            tracefs_writable,
        }
    }

    #[test]
    fn auto_prefers_uprobe_multi_then_sys_admin_then_writable_tracefs() {
        let auto = UprobeModeSetting::Auto;
        assert_eq!(
            host(true, false, false)
                .choose(auto)
                .expect("auto always chooses"),
            UprobeMode::Multi
        );
        assert_eq!(
            host(true, true, true)
                .choose(auto)
                .expect("auto always chooses"),
            UprobeMode::Multi
        );
        assert_eq!(
            host(false, true, true)
                .choose(auto)
                .expect("auto always chooses"),
            UprobeMode::PerfEvent
        );
        assert_eq!(
            host(false, false, true)
                .choose(auto)
                .expect("auto always chooses"),
            UprobeMode::Tracefs
        );
        // Nothing else left: perf events work on kernels without the fix.
        assert_eq!(
            host(false, false, false)
                .choose(auto)
                .expect("auto always chooses"),
            UprobeMode::PerfEvent
        );
    }

    #[test]
    fn an_explicit_uprobe_multi_the_kernel_lacks_is_an_error() {
        let err = host(false, true, true)
            .choose(UprobeModeSetting::Multi)
            .expect_err("uprobe_multi is missing");
        assert!(format!("{err:#}").contains("Linux 6.6"), "{err:#}");
        assert_eq!(
            host(false, false, false)
                .choose(UprobeModeSetting::Tracefs)
                .expect("tracefs can be asked for"),
            UprobeMode::Tracefs
        );
    }

    #[test]
    fn own_file_offset_finds_a_function_of_this_executable() {
        let offset = own_file_offset(tokentrace_uprobe_check_target as *const () as usize)
            .expect("the function is mapped");
        assert!(offset > 0);
        assert!(own_file_offset(0).is_err());
    }
}
