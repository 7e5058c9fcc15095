//! Placing uprobes in one file for one process (or every process), in the
//! run's [`UprobeMode`]. Offsets come from the agent's own ELF reading
//! (`discover::placement`): no symbol lookup by libbpf per attach.

use std::ffi::CString;
use std::path::Path;
use std::ptr::NonNull;

use anyhow::{Context, Result};
use libbpf_rs::{AsRawLibbpf, Link, ProgramMut, UprobeMultiOpts, UprobeOpts};

use super::uprobe_mode::UprobeMode;
use crate::discover::libraries::Site;

/// One probe to place: `program` at `offset`, on entry or on return.
pub(crate) struct Uprobe<'a, 'obj> {
    pub program: &'a ProgramMut<'obj>,
    pub retprobe: bool,
    pub offset: usize,
    /// The probed function, for messages.
    pub function: &'static str,
}

/// The entry probe (and the return probe where the site has one) of each
/// of `sites`; `program_of` names the entry program, `None` skips a site.
pub(crate) fn site_probes<'a, 'obj>(
    sites: &[Site],
    exit: &'a ProgramMut<'obj>,
    mut program_of: impl FnMut(&Site) -> Option<&'a ProgramMut<'obj>>,
) -> Result<Vec<Uprobe<'a, 'obj>>> {
    let mut probes = Vec::new();
    for site in sites {
        let Some(program) = program_of(site) else {
            continue;
        };
        let offset =
            usize::try_from(site.placement.file_offset).context("file offset out of range")?;
        probes.push(Uprobe {
            program,
            retprobe: false,
            offset,
            function: site.function,
        });
        if site.return_probe {
            probes.push(Uprobe {
                program: exit,
                retprobe: true,
                offset,
                function: site.function,
            });
        }
    }
    Ok(probes)
}

/// What [`attach`] placed, and what it could not (function, error).
#[derive(Default)]
pub(crate) struct Attached {
    pub links: Vec<Link>,
    /// Functions whose probes are in place (once per entry or return probe).
    pub functions: Vec<&'static str>,
    pub failed: Vec<(&'static str, anyhow::Error)>,
}

/// Attaches `probes` in `path` for `pid` (None: every process mapping the
/// file). uprobe_multi: one link per program and direction, with all its
/// offsets (each attach takes a kernel lock that stalls fork()
/// system-wide, so fewer is better); the other modes one per probe.
pub(crate) fn attach(
    mode: UprobeMode,
    probes: &[Uprobe<'_, '_>],
    pid: Option<u32>,
    path: &Path,
) -> Result<Attached> {
    let pid = pid
        .map_or(Ok(-1), i32::try_from)
        .context("pid out of range")?;
    let mut done = Attached::default();
    match mode {
        UprobeMode::Multi => {
            for group in multi_groups(probes) {
                let first = &probes[group[0]];
                let opts = UprobeMultiOpts {
                    offsets: group.iter().map(|&i| probes[i].offset).collect(),
                    retprobe: first.retprobe,
                    ..UprobeMultiOpts::default()
                };
                match first
                    .program
                    .attach_uprobe_multi_with_opts(pid, path, "", opts)
                {
                    Ok(link) => {
                        done.links.push(link);
                        done.functions
                            .extend(group.iter().map(|&i| probes[i].function));
                    }
                    Err(err) => {
                        for &i in &group {
                            let err =
                                anyhow::Error::new(same_errno(&err)).context(describe(&probes[i]));
                            done.failed.push((probes[i].function, err));
                        }
                    }
                }
            }
        }
        UprobeMode::PerfEvent | UprobeMode::Tracefs => {
            for probe in probes {
                let attached = if mode == UprobeMode::Tracefs {
                    attach_legacy(probe.program, probe.retprobe, pid, path, probe.offset)
                } else {
                    let opts = UprobeOpts {
                        retprobe: probe.retprobe,
                        ..UprobeOpts::default()
                    };
                    probe
                        .program
                        .attach_uprobe_with_opts(pid, path, probe.offset, opts)
                };
                match attached {
                    Ok(link) => {
                        done.links.push(link);
                        done.functions.push(probe.function);
                    }
                    Err(err) => done.failed.push((
                        probe.function,
                        anyhow::Error::new(err).context(describe(probe)),
                    )),
                }
            }
        }
    }
    Ok(done)
}

/// Indices of `probes` grouped by program and direction, in order.
fn multi_groups(probes: &[Uprobe<'_, '_>]) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (i, probe) in probes.iter().enumerate() {
        let key = (probe.program.name(), probe.retprobe);
        match groups.iter_mut().find(|g| {
            let first = &probes[g[0]];
            (first.program.name(), first.retprobe) == key
        }) {
            Some(group) => group.push(i),
            None => groups.push(vec![i]),
        }
    }
    groups
}

fn describe(probe: &Uprobe<'_, '_>) -> String {
    let kind = if probe.retprobe {
        "return probe"
    } else {
        "probe"
    };
    format!("{kind} on {} at {:#x}", probe.function, probe.offset)
}

/// A legacy tracefs uprobe (libbpf's PROBE_ATTACH_MODE_LEGACY, which
/// libbpf-rs' UprobeOpts does not expose).
pub(crate) fn attach_legacy(
    program: &ProgramMut<'_>,
    retprobe: bool,
    pid: i32,
    path: &Path,
    offset: usize,
) -> libbpf_rs::Result<Link> {
    let path = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| libbpf_rs::Error::from_raw_os_error(libc::EINVAL))?;
    let opts = libbpf_rs::libbpf_sys::bpf_uprobe_opts {
        sz: std::mem::size_of::<libbpf_rs::libbpf_sys::bpf_uprobe_opts>() as _,
        retprobe,
        attach_mode: libbpf_rs::libbpf_sys::PROBE_ATTACH_MODE_LEGACY,
        ..Default::default()
    };
    // SAFETY: the program pointer is valid for the borrow of `program`,
    // path and opts outlive the call.
    let link = unsafe {
        libbpf_rs::libbpf_sys::bpf_program__attach_uprobe_opts(
            program.as_libbpf_object().as_ptr(),
            pid,
            path.as_ptr(),
            offset as _,
            &opts,
        )
    };
    match NonNull::new(link) {
        // SAFETY: a non-NULL link just returned by libbpf, owned from here.
        Some(link) => Ok(unsafe { Link::from_ptr(link) }),
        None => Err(libbpf_rs::Error::from_raw_os_error(
            std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EINVAL),
        )),
    }
}

/// libbpf-rs errors are not Clone; a group failure is reported for each of
/// its functions, so it is rebuilt from its errno.
fn same_errno(err: &libbpf_rs::Error) -> libbpf_rs::Error {
    libbpf_rs::Error::from_raw_os_error(super::failures::errno_of(err).unwrap_or(libc::EINVAL))
}
