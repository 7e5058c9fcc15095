//! Finding out by trying which uprobe modes this host allows: the check
//! object's uprobe attached to a function of the agent itself, in each mode,
//! then called once. Apart from `uprobe_mode` (what a mode is and how one is
//! chosen) because a trial attaches, and attaching needs the mode.

use std::mem::MaybeUninit;
use std::path::Path;

use anyhow::{bail, Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{MapCore, MapFlags, OpenObject, UprobeMultiOpts, UprobeOpts};
use tokentrace_probes::check::{CheckSkel, CheckSkelBuilder};

use super::attach::attach_legacy;
use super::host::{has_capability, CAP_SYS_ADMIN};
use super::uprobe_mode::{HostUprobes, UprobeMode};

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
        UprobeMode::Tracefs => attach_legacy(&skel.progs.check_uprobe, false, 0, exe, offset)
            .context("attach tracefs uprobe")?,
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

    #[test]
    fn own_file_offset_finds_a_function_of_this_executable() {
        let offset = own_file_offset(tokentrace_uprobe_check_target as *const () as usize)
            .expect("the function is mapped");
        assert!(offset > 0);
        assert!(own_file_offset(0).is_err());
    }
}
