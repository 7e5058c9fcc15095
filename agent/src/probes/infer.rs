//! The inference probe set (`infer.bpf.c`): `llm:*` USDT, CUDA uprobes and
//! off-CPU tracking. Optional: loaded after the socket probes, sharing
//! their ring buffer and pid filter; if it cannot load, timelines still
//! work, only without explanations.

use std::mem::MaybeUninit;
use std::os::fd::AsFd;
use std::path::Path;

use anyhow::{bail, Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{Link, MapCore, OpenObject, UprobeOpts, UsdtOpts};
use tokentrace_probes::infer::types::tt_llm_probe;
use tokentrace_probes::infer::{InferSkel, InferSkelBuilder};

use super::sock::SockProbes;

/// The `llm` provider's probe names with the cookie the program reads to
/// tell them apart.
pub const LLM_PROBES: [(&str, tt_llm_probe); 8] = [
    ("request_start", tt_llm_probe::TT_LLM_REQUEST_START),
    ("request_queued", tt_llm_probe::TT_LLM_REQUEST_QUEUED),
    ("request_scheduled", tt_llm_probe::TT_LLM_REQUEST_SCHEDULED),
    ("prefill_start", tt_llm_probe::TT_LLM_PREFILL_START),
    ("prefill_end", tt_llm_probe::TT_LLM_PREFILL_END),
    ("token", tt_llm_probe::TT_LLM_TOKEN),
    ("request_end", tt_llm_probe::TT_LLM_REQUEST_END),
    ("batch_step", tt_llm_probe::TT_LLM_BATCH_STEP),
];

/// Which CUDA library a file is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaLibrary {
    /// libcudart: the runtime API (`cuda*`).
    Runtime,
    /// libcuda: the driver API (`cu*`).
    Driver,
}

/// Loaded inference probes; the sched_switch program is attached at load.
pub struct InferProbes {
    skel: InferSkel<'static>,
    _offcpu: Link,
}

impl InferProbes {
    /// Loads `infer.bpf.c` into the ring buffer and pid filter of `sock`.
    pub fn load(
        sock: &SockProbes,
        offcpu_min_ns: u64,
        wakeup_bytes: u64,
        agent_pid: u32,
    ) -> Result<Self> {
        // Loaded once per run; see SockProbes::load for why it is leaked.
        let storage: &'static mut MaybeUninit<OpenObject> =
            Box::leak(Box::new(MaybeUninit::uninit()));
        let mut open = InferSkelBuilder::default()
            .open(storage)
            .context("opening the inference BPF object")?;
        let (events, traced) = sock.shared_maps();
        open.maps
            .events
            .reuse_fd(events.as_fd())
            .context("sharing the ring buffer")?;
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
        let skel = open.load().context("loading the inference BPF programs")?;
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
    /// `.note.stapsdt`), for every process using the file; libbpf honours
    /// USDT semaphores.
    pub fn attach_usdt(&self, file: &Path, probes: &[String]) -> Result<Vec<Link>> {
        let mut links = Vec::new();
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
                .attach_usdt_with_opts(-1, file, "llm", name, opts)
            {
                Ok(link) => links.push(link),
                Err(err) => tracing::warn!("USDT llm:{name} in {}: {err}", file.display()),
            }
        }
        if links.is_empty() {
            bail!("no llm:* probe of {} could be attached", file.display());
        }
        Ok(links)
    }

    /// Attaches the CUDA uprobes to a libcudart or libcuda file.
    pub fn attach_cuda(&self, file: &Path, library: CudaLibrary) -> Result<Vec<Link>> {
        let progs = &self.skel.progs;
        let probes: &[(&str, &libbpf_rs::ProgramMut<'_>, bool)] = match library {
            CudaLibrary::Runtime => &[
                ("cudaLaunchKernel", &progs.cuda_launch_kernel, false),
                ("cudaGraphLaunch", &progs.cuda_graph_launch, false),
                ("cudaMemcpyAsync", &progs.cuda_memcpy_async, false),
                ("cudaStreamSynchronize", &progs.cuda_stream_sync, false),
                ("cudaStreamSynchronize", &progs.cuda_sync_exit, true),
                ("cudaDeviceSynchronize", &progs.cuda_device_sync, false),
                ("cudaDeviceSynchronize", &progs.cuda_sync_exit, true),
                ("cudaEventSynchronize", &progs.cuda_event_sync, false),
                ("cudaEventSynchronize", &progs.cuda_sync_exit, true),
            ],
            CudaLibrary::Driver => &[
                ("cuLaunchKernel", &progs.cuda_launch_kernel, false),
                ("cuLaunchKernelEx", &progs.cuda_launch_kernel, false),
                ("cuStreamSynchronize", &progs.cu_stream_sync, false),
                ("cuStreamSynchronize", &progs.cuda_sync_exit, true),
                ("cuCtxSynchronize", &progs.cu_ctx_sync, false),
                ("cuCtxSynchronize", &progs.cuda_sync_exit, true),
            ],
        };
        let mut links = Vec::new();
        for &(symbol, program, retprobe) in probes {
            let opts = UprobeOpts {
                func_name: Some(symbol.to_string()),
                retprobe,
                ..UprobeOpts::default()
            };
            match program.attach_uprobe_with_opts(-1, file, 0, opts) {
                Ok(link) => links.push(link),
                Err(err) => tracing::debug!("{symbol} in {}: not probed: {err}", file.display()),
            }
        }
        if links.is_empty() {
            bail!(
                "{} defines none of the probed CUDA functions",
                file.display()
            );
        }
        Ok(links)
    }

    /// Records the inference probes lost to a full ring buffer.
    pub fn ringbuf_drops(&self) -> u64 {
        self.skel
            .maps
            .bss
            .lookup(&0u32.to_ne_bytes(), libbpf_rs::MapFlags::ANY)
            .ok()
            .flatten()
            .and_then(|bss| {
                plain::from_bytes::<tokentrace_probes::infer::types::bss>(&bss)
                    .ok()
                    .map(|b| b.ringbuf_drops)
            })
            .unwrap_or(0)
    }
}
