//! Where the probes keep per-thread state (`thread_state.bpf.h`): a
//! thread's latest socket read, its OpenSSL or CUDA call in flight, its
//! CUDA work, its last switch-out.
//!
//! In task storage, where the kernel offers it to tracing programs and
//! allocates it from any context (6.4 and later), that state costs memory
//! only for the threads that keep some and goes with the thread. Elsewhere it lives in hash maps keyed by
//! thread id, preallocated to 65,536 threads: ~37 MiB of kernel memory
//! (charged to the agent's memory cgroup) whether one thread is traced or
//! thousands, and the LRU maps among them evict live threads' state once
//! full.

use std::fmt;

use anyhow::{bail, Result};
use serde::Deserialize;

use super::leave_out;

/// Where a run keeps per-thread state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadState {
    /// Task-local storage (`task_*` maps).
    TaskStorage,
    /// Hash maps keyed by thread id.
    Maps,
}

/// The maps of each kind, in the same order: one of each pair is created.
const TASK_STORAGE_MAPS: [&str; 5] = [
    "task_last_read",
    "task_ssl_call",
    "task_cuda_call",
    "task_cuda_work",
    "task_offcpu",
];
const THREAD_MAPS: [&str; 5] = [
    "last_read",
    "ssl_calls",
    "cuda_calls",
    "cuda_work",
    "offcpu_starts",
];

impl ThreadState {
    fn maps(self) -> &'static [&'static str] {
        match self {
            ThreadState::TaskStorage => &TASK_STORAGE_MAPS,
            ThreadState::Maps => &THREAD_MAPS,
        }
    }

    fn other(self) -> ThreadState {
        match self {
            ThreadState::TaskStorage => ThreadState::Maps,
            ThreadState::Maps => ThreadState::TaskStorage,
        }
    }
}

impl fmt::Display for ThreadState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ThreadState::TaskStorage => "task storage",
            ThreadState::Maps => "maps by thread id",
        })
    }
}

/// The `--thread-state` / `capture.thread_state` setting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum ThreadStateSetting {
    /// Task storage where the kernel offers it to tracing programs, else maps.
    #[default]
    Auto,
    /// Task storage; an error where the kernel lacks it.
    #[value(name = "task_storage")]
    TaskStorage,
    /// Hash maps keyed by thread id, preallocated (what kernels before
    /// 6.4 get).
    Maps,
}

impl ThreadStateSetting {
    /// Where per-thread state goes on a kernel that has task storage for
    /// tracing programs (`kernel_has`) or not.
    pub fn choose(self, kernel_has: bool) -> Result<ThreadState> {
        match self {
            ThreadStateSetting::Maps => Ok(ThreadState::Maps),
            ThreadStateSetting::Auto if !kernel_has => Ok(ThreadState::Maps),
            ThreadStateSetting::TaskStorage if !kernel_has => bail!(
                "--thread-state task_storage: this kernel offers tracing programs no task \
                 storage they can create from any context (Linux 6.4 or later; use \
                 --thread-state auto or maps)"
            ),
            ThreadStateSetting::Auto | ThreadStateSetting::TaskStorage => {
                Ok(ThreadState::TaskStorage)
            }
        }
    }
}

/// Whether tracing programs may keep state in task storage here: the
/// kernel allocates its entries from any context a program runs in (see
/// [`allocates_from_any_context`]) and offers both helpers the probes call
/// for it (`bpf_get_current_task_btf`, 5.11, and `bpf_task_storage_get`,
/// 5.12 for tracing programs), probed by loading a two-instruction program
/// (a kprobe's helpers are the uprobes' and the tracepoints'). False where
/// the kernel's BTF cannot be read or the probe cannot load.
pub fn kernel_has_task_storage() -> bool {
    use libbpf_rs::libbpf_sys::{
        libbpf_probe_bpf_helper, BPF_FUNC_get_current_task_btf, BPF_FUNC_task_storage_get,
        BPF_PROG_TYPE_KPROBE,
    };
    let Ok(btf) = libbpf_rs::btf::Btf::from_vmlinux() else {
        return false;
    };
    allocates_from_any_context(&btf)
        && [BPF_FUNC_get_current_task_btf, BPF_FUNC_task_storage_get]
            .into_iter()
            .all(|helper| {
                // SAFETY: a feature probe with no options; it only loads
                // and frees a tiny program.
                unsafe {
                    libbpf_probe_bpf_helper(BPF_PROG_TYPE_KPROBE, helper, std::ptr::null()) == 1
                }
            })
}

/// Whether the kernel creates task storage without taking locks: from
/// BPF's own allocator (`bpf_local_storage_map.selem_ma`, 6.4+) or with
/// `kmalloc_nolock` (6.18+). Before 6.4 a first entry came from
/// `kmalloc(GFP_ATOMIC)`, which may wake kswapd, and `sched_switch`
/// creates entries with the runqueue's lock held: a wake-up onto that
/// runqueue would deadlock the CPU. Those kernels keep the maps.
fn allocates_from_any_context(btf: &libbpf_rs::btf::Btf<'_>) -> bool {
    use libbpf_rs::btf::types::{Func, Struct};
    let own_allocator = btf
        .type_by_name::<Struct<'_>>("bpf_local_storage_map")
        .is_some_and(|map| {
            map.iter()
                .any(|member| member.name.is_some_and(|name| name == "selem_ma"))
        });
    own_allocator
        || btf
            .type_by_name::<Func<'_>>("kmalloc_nolock_noprof")
            .is_some()
}

/// Creates the maps of `state` in `object` and not the other kind's (the
/// programs' code for the other kind is dead once `task_storage` is set in
/// `.rodata`, so the verifier never meets its map).
pub(super) fn select_thread_maps(
    object: &mut libbpf_rs::OpenObject,
    state: ThreadState,
) -> Result<()> {
    let left_out = state.other().maps();
    leave_out::maps(object, |name| left_out.contains(&name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_takes_task_storage_only_where_the_kernel_has_it() {
        let auto = ThreadStateSetting::Auto;
        assert!(matches!(auto.choose(true), Ok(ThreadState::TaskStorage)));
        assert!(matches!(auto.choose(false), Ok(ThreadState::Maps)));
        assert!(matches!(
            ThreadStateSetting::Maps.choose(true),
            Ok(ThreadState::Maps)
        ));
        match ThreadStateSetting::TaskStorage.choose(false) {
            Err(refused) => assert!(refused.to_string().contains("6.4"), "{refused}"),
            Ok(state) => panic!("task_storage on a kernel without it: {state}"),
        }
    }

    #[test]
    fn every_named_map_is_in_the_objects() {
        use libbpf_rs::skel::{OpenSkel, SkelBuilder};
        use std::mem::MaybeUninit;
        let mut names = Vec::new();
        let mut sock = MaybeUninit::uninit();
        let sock = tokentrace_probes::sock::SockSkelBuilder::default()
            .open(&mut sock)
            .expect("opening the socket object");
        names.extend(
            sock.open_object()
                .maps()
                .map(|m| m.name().to_string_lossy().into_owned()),
        );
        let mut infer = MaybeUninit::uninit();
        let infer = tokentrace_probes::infer::InferSkelBuilder::default()
            .open(&mut infer)
            .expect("opening the inference object");
        names.extend(
            infer
                .open_object()
                .maps()
                .map(|m| m.name().to_string_lossy().into_owned()),
        );
        for name in TASK_STORAGE_MAPS.iter().chain(&THREAD_MAPS) {
            assert!(names.iter().any(|n| n == name), "{name} not in {names:?}");
        }
    }
}
