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

use anyhow::{bail, Result};
use serde::Deserialize;

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
}
