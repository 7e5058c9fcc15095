//! The inference probe set (`infer.bpf.c`): `llm:*` USDT, CUDA uprobes and
//! off-CPU tracking. Optional: loaded after the socket probes, sharing
//! their ring buffer and pid filter; if it cannot load, timelines still
//! work, only without explanations.

use std::mem::MaybeUninit;
use std::os::fd::AsFd;
use std::path::Path;

use anyhow::{Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{Link, OpenObject, UsdtOpts};
use tokentrace_probes::infer::types::tt_llm_probe;
use tokentrace_probes::infer::{InferSkel, InferSkelBuilder};

use super::attach::{self, Attached};
use super::sock::SockProbes;
use super::thread_state::{select_thread_maps, ThreadState};
use super::uprobe_mode::UprobeMode;
use crate::discover::libraries::Site;

/// The `llm` provider's probe names with the cookie the program reads to
/// tell them apart.
pub const LLM_PROBES: [(&str, tt_llm_probe); 9] = [
    ("request_start", tt_llm_probe::TT_LLM_REQUEST_START),
    ("request_queued", tt_llm_probe::TT_LLM_REQUEST_QUEUED),
    ("request_scheduled", tt_llm_probe::TT_LLM_REQUEST_SCHEDULED),
    ("prefill_start", tt_llm_probe::TT_LLM_PREFILL_START),
    ("prefill_end", tt_llm_probe::TT_LLM_PREFILL_END),
    ("token", tt_llm_probe::TT_LLM_TOKEN),
    ("request_end", tt_llm_probe::TT_LLM_REQUEST_END),
    ("batch_step", tt_llm_probe::TT_LLM_BATCH_STEP),
    ("request_preempted", tt_llm_probe::TT_LLM_REQUEST_PREEMPTED),
];

/// Loaded inference probes; the sched_switch program is attached at load.
pub struct InferProbes {
    skel: InferSkel<'static>,
    _offcpu: Link,
}

impl InferProbes {
    /// Loads `infer.bpf.c` into the ring buffer and pid filter of `sock`,
    /// its CUDA programs for uprobes in `uprobe_mode` (the USDT program's
    /// attach type is libbpf's choice: uprobe_multi where the kernel has it).
    pub fn load(
        sock: &SockProbes,
        offcpu_min_ns: u64,
        wakeup_bytes: u64,
        agent_pid: u32,
        uprobe_mode: UprobeMode,
        thread_state: ThreadState,
    ) -> Result<Self> {
        // Loaded once per run; see SockProbes::load for why it is leaked.
        let storage: &'static mut MaybeUninit<OpenObject> =
            Box::leak(Box::new(MaybeUninit::uninit()));
        let mut open = InferSkelBuilder::default()
            .open(storage)
            .context("opening the inference BPF object")?;
        super::uprobe_mode::prepare_uprobes(open.open_object_mut(), uprobe_mode);
        select_thread_maps(open.open_object_mut(), thread_state)?;
        let (events, flags, traced) = sock.shared_maps();
        open.maps
            .events
            .reuse_fd(events.as_fd())
            .context("sharing the ring buffer")?;
        open.maps
            .traced_flags
            .reuse_fd(flags.as_fd())
            .context("sharing the pid filter array")?;
        open.maps
            .traced_tgids
            .reuse_fd(traced.as_fd())
            .context("sharing the pid filter")?;
        let rodata = open
            .maps
            .rodata_data
            .as_deref_mut()
            .context("inference BPF object has no .rodata")?;
        rodata.offcpu_min_ns = offcpu_min_ns;
        rodata.wakeup_bytes = wakeup_bytes;
        rodata.agent_tgid = agent_pid;
        rodata.task_storage = thread_state == ThreadState::TaskStorage;
        let skel = open.load().map_err(|err| {
            let message = super::load_failure("the inference BPF programs", &err);
            anyhow::Error::new(err).context(message)
        })?;
        let offcpu = skel
            .progs
            .on_sched_switch
            .attach()
            .context("attaching tp_btf/sched_switch")?;
        Ok(Self {
            skel,
            _offcpu: offcpu,
        })
    }

    /// Attaches the `llm:*` probes `file` defines (names from its
    /// `.note.stapsdt`) for `pid` (None: every process using the file);
    /// libbpf honours USDT semaphores. USDT sites are `nop`s: emulated.
    pub(crate) fn attach_usdt(
        &self,
        pid: Option<u32>,
        file: &Path,
        probes: &[String],
    ) -> Result<Attached> {
        let pid = pid
            .map_or(Ok(-1), i32::try_from)
            .context("pid out of range")?;
        let mut done = Attached::default();
        for (name, cookie) in LLM_PROBES {
            if !probes.iter().any(|p| p == name) {
                continue;
            }
            let opts = UsdtOpts {
                cookie: u64::from(cookie.0),
                ..UsdtOpts::default()
            };
            match self
                .skel
                .progs
                .llm_probe
                .attach_usdt_with_opts(pid, file, "llm", name, opts)
            {
                Ok(link) => {
                    done.links.push(link);
                    done.functions.push(name);
                }
                Err(err) => done.failed.push((
                    name,
                    anyhow::Error::new(err).context(format!("USDT llm:{name}")),
                )),
            }
        }
        Ok(done)
    }

    /// Attaches the CUDA uprobes at `sites` of a libcudart or libcuda file
    /// for `pid` (None: every process) in `mode`.
    pub(crate) fn attach_cuda(
        &self,
        mode: UprobeMode,
        pid: Option<u32>,
        file: &Path,
        sites: &[Site],
    ) -> Result<Attached> {
        let progs = &self.skel.progs;
        let probes = attach::site_probes(sites, &progs.cuda_sync_exit, |site| {
            let program = match site.function {
                "cudaLaunchKernel" | "cuLaunchKernel" | "cuLaunchKernelEx" => {
                    &progs.cuda_launch_kernel
                }
                "cudaGraphLaunch" => &progs.cuda_graph_launch,
                "cudaMemcpyAsync" => &progs.cuda_memcpy_async,
                "cudaStreamSynchronize" => &progs.cuda_stream_sync,
                "cudaDeviceSynchronize" => &progs.cuda_device_sync,
                "cudaEventSynchronize" => &progs.cuda_event_sync,
                "cuStreamSynchronize" => &progs.cu_stream_sync,
                "cuCtxSynchronize" => &progs.cu_ctx_sync,
                other => {
                    tracing::debug!("no CUDA program for {other}");
                    return None;
                }
            };
            Some(program)
        })?;
        attach::attach(mode, &probes, pid, file)
    }

    /// A handle on the inference probes' `.bss` (their ring buffer drop
    /// counter), for [`KernelCounters`](super::KernelCounters) to read
    /// from any thread.
    pub fn bss_handle(&self) -> Result<libbpf_rs::MapHandle> {
        libbpf_rs::MapHandle::try_from(&self.skel.maps.bss).context("duplicating infer .bss")
    }
}
