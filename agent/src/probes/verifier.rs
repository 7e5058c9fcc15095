//! What the kernel's verifier says of each program (`tokentrace check
//! --programs`): instructions processed and stack depth. The stack depth
//! matters on kernels 6.13+: programs with 64 bytes or more run on a
//! per-CPU private stack, which uprobe programs (preemptible there) share
//! between tasks unless they disable preemption.

use std::mem::MaybeUninit;
use std::sync::Mutex;

use anyhow::{Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::OpenObject;
use tokentrace_probes::infer::InferSkelBuilder;
use tokentrace_probes::sock::SockSkelBuilder;

use super::thread_state::{
    kernel_has_task_storage, select_thread_maps, ThreadState, ThreadStateSetting,
};

/// Programs with this much stack or more get a private per-CPU stack
/// (kernel 6.13+, `BPF_PRIV_STACK_MIN_SIZE`).
pub const PRIVATE_STACK_MIN_BYTES: u32 = 64;

/// One loaded program, as the verifier reported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProgramStats {
    pub object: &'static str,
    pub name: String,
    pub section: String,
    /// Stack bytes of the main program and each subprogram.
    pub stack_depths: Vec<u32>,
    pub instructions: Option<u64>,
}

impl ProgramStats {
    pub fn max_stack(&self) -> u32 {
        self.stack_depths.iter().copied().max().unwrap_or(0)
    }

    /// Entered from uprobes (preemptible on 6.13+).
    pub fn is_uprobe(&self) -> bool {
        self.section.starts_with("uprobe")
            || self.section.starts_with("uretprobe")
            || self.section.starts_with("usdt")
    }
}

/// libbpf's debug messages while the objects load (the load logs among them).
static LOGS: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn collect(_level: libbpf_rs::PrintLevel, msg: String) {
    if let Ok(mut logs) = LOGS.lock() {
        logs.push(msg);
    }
}

/// Loads the socket and inference objects with the verifier's statistics
/// on (log level 4) and returns each program's. Nothing is attached.
pub fn program_stats() -> Result<Vec<ProgramStats>> {
    LOGS.lock().map(|mut l| l.clear()).ok();
    libbpf_rs::set_print(Some((libbpf_rs::PrintLevel::Debug, collect)));
    let mut sock = MaybeUninit::<OpenObject>::uninit();
    let mut infer = MaybeUninit::<OpenObject>::uninit();
    // The per-thread state as `--thread-state auto` keeps it on this kernel.
    let thread_state = ThreadStateSetting::Auto.choose(kernel_has_task_storage())?;
    let task_storage = thread_state == ThreadState::TaskStorage;
    let loaded = load_with_stats(SockSkelBuilder::default(), &mut sock, "sock", |open| {
        super::sock::select_iov_programs(open.open_object_mut());
        // Both data paths where the kernel has the socket hooks' tracepoints.
        super::data_hooks::select_loadable_programs(open.open_object_mut())?;
        select_thread_maps(open.open_object_mut(), thread_state)?;
        rodata(open.maps.rodata_data.as_deref_mut())?.task_storage = task_storage;
        Ok(())
    })
    .and_then(|sock| {
        let infer = load_with_stats(InferSkelBuilder::default(), &mut infer, "infer", |open| {
            select_thread_maps(open.open_object_mut(), thread_state)?;
            rodata(open.maps.rodata_data.as_deref_mut())?.task_storage = task_storage;
            Ok(())
        })?;
        Ok(sock.into_iter().chain(infer).collect::<Vec<_>>())
    });
    // libbpf's messages go back to the log whether or not both loaded.
    libbpf_rs::set_print(None);
    let sections = loaded?;
    let logs = LOGS.lock().map(|l| l.join("")).unwrap_or_default();
    Ok(sections
        .into_iter()
        .map(|(object, (name, section))| {
            let log = load_log(&logs, &name).unwrap_or_default();
            ProgramStats {
                object,
                stack_depths: stack_depths(log),
                instructions: processed(log),
                name,
                section,
            }
        })
        .collect())
}

/// An object's `.rodata`, which every object has.
fn rodata<T>(rodata: Option<&mut T>) -> Result<&mut T> {
    rodata.context("BPF object has no .rodata")
}

/// Loads the object `builder` opens, after `configure`, with every
/// program's verifier statistics on (their load logs go to [`LOGS`]);
/// returns each program's object, name and section.
fn load_with_stats<'obj, B: SkelBuilder<'obj>>(
    builder: B,
    storage: &'obj mut MaybeUninit<OpenObject>,
    object: &'static str,
    configure: impl FnOnce(&mut B::Output) -> Result<()>,
) -> Result<Vec<(&'static str, (String, String))>> {
    let mut open = builder
        .open(storage)
        .with_context(|| format!("opening the {object} BPF object"))?;
    configure(&mut open)?;
    let programs = open
        .open_object_mut()
        .progs_mut()
        .filter(|program| program.autoload())
        .map(|mut program| {
            program.set_log_level(4);
            (object, name_and_section(&program))
        })
        .collect();
    open.load()
        .with_context(|| format!("loading the {object} BPF object"))?;
    Ok(programs)
}

fn name_and_section(program: &libbpf_rs::OpenProgramMut<'_>) -> (String, String) {
    (
        program.name().to_string_lossy().into_owned(),
        program.section().to_string_lossy().into_owned(),
    )
}

/// The load log libbpf printed for program `name`.
fn load_log<'a>(logs: &'a str, name: &str) -> Option<&'a str> {
    let begin = format!("prog '{name}': -- BEGIN PROG LOAD LOG --\n");
    let start = logs.find(&begin)? + begin.len();
    let end = logs[start..].find("-- END PROG LOAD LOG --")?;
    Some(&logs[start..start + end])
}

/// `stack depth 40+0+16`: one number per subprogram.
fn stack_depths(log: &str) -> Vec<u32> {
    log.lines()
        .find_map(|l| l.strip_prefix("stack depth "))
        .map(|depths| {
            depths
                .trim()
                .split('+')
                .filter_map(|d| d.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// `processed 123 insns (limit 1000000) …`.
fn processed(log: &str) -> Option<u64> {
    log.lines()
        .find_map(|l| l.strip_prefix("processed "))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "libbpf: prog 'ssl_exit': -- BEGIN PROG LOAD LOG --\n\
        func#0 @0\nverification time 812 usec\nstack depth 96+0\n\
        processed 1433 insns (limit 1000000) max_states_per_insn 4 total_states 120 \
        peak_states 120 mark_read 30\n-- END PROG LOAD LOG --\n\
        libbpf: prog 'ssl_free_enter': -- BEGIN PROG LOAD LOG --\nstack depth 24\n\
        processed 50 insns (limit 1000000)\n-- END PROG LOAD LOG --\n";

    #[test]
    fn stack_depths_and_instructions_are_read_per_program() {
        let exit = load_log(LOG, "ssl_exit").expect("ssl_exit's log");
        assert_eq!(stack_depths(exit), [96, 0]);
        assert_eq!(processed(exit), Some(1433));
        let free = load_log(LOG, "ssl_free_enter").expect("ssl_free_enter's log");
        assert_eq!(stack_depths(free), [24]);
        assert_eq!(processed(free), Some(50));
        assert!(load_log(LOG, "ssl_read_enter").is_none());
    }
}
