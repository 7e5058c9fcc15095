//! The socket probe set (`sock.bpf.c`): load, configure, attach, and the
//! handles userspace keeps to steer it (pid filter) and read its counters.

use std::mem::MaybeUninit;
use std::path::Path;

use anyhow::{Context, Result};
use libbpf_rs::skel::{OpenSkel, Skel, SkelBuilder};
use libbpf_rs::{MapCore, MapFlags, MapHandle, OpenObject, RingBuffer, RingBufferBuilder};
use tokentrace_probes::sock::{types, SockSkel, SockSkelBuilder};

use super::arrival_stamps::ArrivalStamps;
use super::attach::{self, Attached};
use super::data_hooks::{select_data_programs, DataHooks};
use super::thread_state::{select_thread_maps, ThreadState};
use super::uprobe_mode::UprobeMode;
use crate::discover::libraries::Site;

/// Largest payload prefix the kernel side can copy (`MAX_CAPTURE` in events.h).
pub const MAX_CAPTURE_BYTES: u32 = 16384;

/// Tunables written into the probes' read-only data before load.
#[derive(Debug, Clone)]
pub struct ProbeSettings {
    /// Payload bytes captured per syscall (at most [`MAX_CAPTURE_BYTES`]).
    pub capture_bytes: u32,
    /// Date incoming segments by their receive stamps (see
    /// [`super::ArrivalStamps`]); without, by when TCP processed them.
    pub receive_stamps: bool,
    /// Ring buffer fill level that triggers a wake-up; below it the agent
    /// finds records on its next timed poll.
    pub wakeup_bytes: u64,
    /// Ring buffer size in bytes (power of two, multiple of the page size).
    pub ring_buffer_bytes: u32,
    /// The agent's own pid, never traced.
    pub agent_pid: u32,
    /// Shortest off-CPU interval or send-queue hold the probes report.
    pub min_interval_ns: u64,
    /// Report every exec on the host (selection by executable or name),
    /// not only traced processes'.
    pub report_all_execs: bool,
    /// Report every listen() on the host (selection by port, automatic).
    pub report_listens: bool,
    /// How uprobes (OpenSSL, CUDA) are attached; the programs are loaded
    /// for it.
    pub uprobe_mode: UprobeMode,
    /// Which hooks feed the data path; only its programs are loaded.
    pub data_hooks: DataHooks,
    /// Where per-thread state lives; only that kind's maps are created.
    pub thread_state: ThreadState,
}

/// Loaded and attached socket probes. Dropping it detaches every program.
pub struct SockProbes {
    skel: SockSkel<'static>,
    /// Tracepoint links, detached in parallel on drop (see `detach_all`).
    links: Vec<libbpf_rs::Link>,
}

impl SockProbes {
    /// Opens, configures, loads and attaches `sock.bpf.c`.
    pub fn load(settings: &ProbeSettings) -> Result<Self> {
        // The skeleton borrows its OpenObject storage for its whole life. The
        // agent loads this probe set once per run, so the storage is leaked
        // rather than threaded through a self-referential struct.
        let storage: &'static mut MaybeUninit<OpenObject> =
            Box::leak(Box::new(MaybeUninit::uninit()));
        let mut open = SockSkelBuilder::default()
            .open(storage)
            .context("opening the socket BPF object")?;

        super::uprobe_mode::prepare_uprobes(open.open_object_mut(), settings.uprobe_mode);
        select_iov_programs(open.open_object_mut());
        select_data_programs(open.open_object_mut(), settings.data_hooks)?;
        select_thread_maps(open.open_object_mut(), settings.thread_state)?;
        let rodata = open
            .maps
            .rodata_data
            .as_deref_mut()
            .context("socket BPF object has no .rodata")?;
        rodata.capture_bytes = settings.capture_bytes.min(MAX_CAPTURE_BYTES);
        rodata.wakeup_bytes = settings.wakeup_bytes;
        rodata.agent_tgid = settings.agent_pid;
        rodata.hold_min_ns = settings.min_interval_ns;
        rodata.report_all_execs = settings.report_all_execs;
        rodata.report_listens = settings.report_listens;
        rodata.socket_hooks = matches!(settings.data_hooks, DataHooks::Socket { .. });
        rodata.task_storage = settings.thread_state == ThreadState::TaskStorage;

        let cpus = libbpf_rs::num_possible_cpus().context("counting possible CPUs")?;
        let cpus = u32::try_from(cpus).context("CPU count does not fit u32")?;
        open.maps
            .scratch
            .set_max_entries(cpus)
            .context("sizing the per-CPU scratch map")?;
        open.maps
            .traced_flags
            .set_max_entries(pid_flag_slots(max_pid()))
            .context("sizing the pid filter array")?;
        open.maps
            .tls_tgids
            .set_max_entries(pid_flag_slots(max_pid()))
            .context("sizing the OpenSSL process array")?;
        open.maps
            .events
            .set_max_entries(settings.ring_buffer_bytes)
            .context("sizing the ring buffer (must be a power of two multiple of the page size)")?;

        let mut skel = open.load().map_err(|err| {
            let message = super::load_failure("the socket BPF programs", &err);
            anyhow::Error::new(err).context(message)
        })?;
        let mut links = Vec::new();
        // Every tracepoint program; the OpenSSL uprobes are attached per
        // process and library file later.
        for program in skel.object_mut().progs_mut() {
            let section = program.section().to_string_lossy();
            if !program.autoload() {
                // the twin not loaded on this kernel (select_iov_programs),
                // the other data path (select_data_programs)
                continue;
            }
            if section.starts_with("tracepoint/") || section.starts_with("tp_btf/") {
                let link = program.attach().with_context(|| {
                    format!("attaching {section} (is tracefs mounted? run `tokentrace check`)")
                })?;
                links.push(link);
            }
        }
        Ok(Self { skel, links })
    }

    /// Kernel programs attached at load.
    pub fn attached_programs(&self) -> usize {
        self.links.len()
    }

    /// A ring buffer consumer calling `callback` with each raw record.
    pub fn ring_buffer<'a, F>(&'a self, callback: F) -> Result<RingBuffer<'a>>
    where
        F: FnMut(&[u8]) -> i32 + 'a,
    {
        let mut builder = RingBufferBuilder::new();
        builder
            .add(&self.skel.maps.events, callback)
            .context("registering the events ring buffer")?;
        builder.build().context("creating the ring buffer consumer")
    }

    /// The ring buffer and the pid filter's array and hash, for other
    /// probe sets to share.
    pub(crate) fn shared_maps(
        &self,
    ) -> (
        &libbpf_rs::Map<'static>,
        &libbpf_rs::Map<'static>,
        &libbpf_rs::Map<'static>,
    ) {
        (
            &self.skel.maps.events,
            &self.skel.maps.traced_flags,
            &self.skel.maps.traced_tgids,
        )
    }

    /// A handle on the pid filter, usable from another thread.
    pub fn traced_pids(&self) -> Result<TracedPids> {
        let map = MapHandle::try_from(&self.skel.maps.traced_tgids)
            .context("duplicating traced_tgids")?;
        let listeners = MapHandle::try_from(&self.skel.maps.ingress_listeners)
            .context("duplicating ingress_listeners")?;
        let flags = MmapArray::of(&self.skel.maps.traced_flags).context("mapping traced_flags")?;
        let ports = MmapArray::of(&self.skel.maps.port_refs).context("mapping port_refs")?;
        Ok(TracedPids {
            map,
            listeners,
            flags,
            ports,
        })
    }

    /// Receive stamping for the ingress dating, its offset written once.
    pub fn arrival_stamps(&self) -> Result<ArrivalStamps> {
        let offset =
            MapHandle::try_from(&self.skel.maps.data_wall).context("duplicating .data.wall")?;
        ArrivalStamps::start(offset)
    }

    /// A handle on the kernel-side loss counters, usable from another thread.
    pub fn counters(&self) -> Result<KernelCounters> {
        let map = MapHandle::try_from(&self.skel.maps.bss).context("duplicating .bss")?;
        Ok(KernelCounters { map, infer: None })
    }
}

impl Drop for SockProbes {
    fn drop(&mut self) {
        super::detach_all(std::mem::take(&mut self.links));
    }
}

/// Whether the kernel has the bpf_loop helper (5.17+).
fn has_bpf_loop() -> bool {
    // SAFETY: a feature probe with no options; it only loads and frees a
    // tiny program.
    let rc = unsafe {
        libbpf_rs::libbpf_sys::libbpf_probe_bpf_helper(
            libbpf_rs::libbpf_sys::BPF_PROG_TYPE_TRACEPOINT,
            libbpf_rs::libbpf_sys::BPF_FUNC_loop,
            std::ptr::null(),
        )
    };
    rc == 1
}

/// The syscall exit program comes twice (sock.bpf.c `exit_syscall`): with a
/// bpf_loop iovec walk where the kernel has bpf_loop (verified in a few
/// thousand instructions instead of ~800k), else the `_compat` twin, whose
/// bpf_loop-free code older kernels accept. Exactly one of the pair loads.
pub(crate) fn select_iov_programs(object: &mut libbpf_rs::OpenObject) {
    let with_loop = has_bpf_loop();
    for mut program in object.progs_mut() {
        let name = program.name().to_string_lossy().into_owned();
        if name.starts_with("exit_syscall") {
            program.set_autoload(name.ends_with("_compat") != with_loop);
        }
    }
}

/// The largest pid this host hands out (`/proc/sys/kernel/pid_max`), at
/// most the kernel's own limit (PID_MAX_LIMIT, 4M on 64-bit).
fn max_pid() -> u32 {
    const PID_MAX_LIMIT: u32 = 4 << 20;
    std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .unwrap_or(PID_MAX_LIMIT)
        .clamp(1, PID_MAX_LIMIT)
}

/// Elements of `traced_flags` for pids below `pid_max`: each holds the
/// flag bytes of 8 pids.
fn pid_flag_slots(pid_max: u32) -> u32 {
    pid_max.div_ceil(8)
}

/// The memory of a BPF_F_MMAPABLE array map, mapped shared: writes are
/// seen by the probes at once, with no syscall.
#[derive(Debug)]
struct MmapArray {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    /// The map stays alive while it is mapped.
    _map: MapHandle,
}

// SAFETY: the mapping is plain shared memory, only accessed through
// atomics (see `byte` and `word`); the pointer is valid until Drop.
unsafe impl Send for MmapArray {}
// SAFETY: as above: every access is atomic.
unsafe impl Sync for MmapArray {}

impl MmapArray {
    fn of(map: &libbpf_rs::Map<'_>) -> Result<Self> {
        use std::os::fd::{AsFd, AsRawFd};
        let handle = MapHandle::try_from(map).context("duplicating the map")?;
        let elem = (map.value_size() as usize).next_multiple_of(8);
        let len = elem * map.max_entries() as usize;
        // SAFETY: mapping `len` bytes of a BPF array's fd, which the kernel
        // allows for BPF_F_MMAPABLE arrays (rounded up to a page); the
        // result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                handle.as_fd().as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error()).context("mmap of a BPF array");
        }
        let ptr = std::ptr::NonNull::new(ptr.cast::<u8>()).context("mmap returned NULL")?;
        Ok(Self {
            ptr,
            len,
            _map: handle,
        })
    }

    /// The byte at `offset`, if inside the mapping.
    fn byte(&self, offset: usize) -> Option<&std::sync::atomic::AtomicU8> {
        // SAFETY: in bounds of the live mapping; AtomicU8 has u8's layout.
        (offset < self.len).then(|| unsafe {
            &*self
                .ptr
                .as_ptr()
                .add(offset)
                .cast::<std::sync::atomic::AtomicU8>()
        })
    }

    /// The 4-byte word at `offset` (a multiple of 4), if inside.
    fn word(&self, offset: usize) -> Option<&std::sync::atomic::AtomicU32> {
        // SAFETY: in bounds, and aligned: the mapping is page-aligned and
        // offset a multiple of 4; AtomicU32 has u32's layout.
        (offset.is_multiple_of(4) && offset + 4 <= self.len).then(|| unsafe {
            &*self
                .ptr
                .as_ptr()
                .add(offset)
                .cast::<std::sync::atomic::AtomicU32>()
        })
    }
}

impl Drop for MmapArray {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `of` mapped; no reference into it
        // outlives `self`.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// The in-kernel pid filter: only processes in it have their sockets traced.
/// One byte per pid in an mmapped array (`traced_flags`), a hash
/// (`traced_tgids`) for pids past it.
#[derive(Debug)]
pub struct TracedPids {
    map: MapHandle,
    /// Listening endpoints of traced processes (`ingress_listeners`).
    listeners: MapHandle,
    flags: MmapArray,
    /// `port_refs`: the softirq hooks' first check, by local port.
    ports: MmapArray,
}

impl TracedPids {
    /// Traces `pid`, and marks the TCP ports it already listens on so that
    /// connections to them are dated from their first packet, before any
    /// accept (the probes mark listeners themselves at later listen() and
    /// accept() calls). Marks stay until the agent exits.
    pub fn insert(&self, pid: u32) -> Result<()> {
        use std::sync::atomic::Ordering;
        match self.flags.byte(pid as usize) {
            Some(flag) => flag.store(1, Ordering::Release),
            None => self
                .map
                .update(&pid.to_ne_bytes(), &[1u8], MapFlags::ANY)
                .with_context(|| {
                    format!(
                        "adding pid {pid} to the kernel pid filter (it holds {} processes past \
                         pid_max at start; if it is full, select fewer with --pid/--exe/--port)",
                        self.map.max_entries()
                    )
                })?,
        }
        let Some((netns, ports)) =
            crate::discover::procfs::listeners_of(std::path::Path::new("/proc"), pid)
        else {
            return Ok(()); // gone already; its exit will be seen
        };
        for port in ports {
            let key = types::listen_key {
                netns,
                port,
                _pad: 0,
            };
            // SAFETY: listen_key is a plain repr(C) struct generated from
            // the BPF object's BTF.
            let key = unsafe { plain::as_bytes(&key) };
            if let Err(err) = self.listeners.update(key, &[1u8], MapFlags::ANY) {
                tracing::warn!("marking port {port} of pid {pid} for ingress timing: {err}");
            }
            // struct port_ref { listener, socks }: 8 bytes per port.
            if let Some(listener) = self.ports.word(usize::from(port) * 8) {
                listener.store(1, Ordering::Release);
            }
        }
        Ok(())
    }

    /// Removes `pid`; absent pids are not an error (the kernel removes
    /// exited processes itself).
    pub fn remove(&self, pid: u32) {
        if let Some(flag) = self.flags.byte(pid as usize) {
            flag.store(0, std::sync::atomic::Ordering::Release);
            return;
        }
        if let Err(err) = self.map.delete(&pid.to_ne_bytes()) {
            tracing::trace!("pid {pid} not in the kernel filter: {err}");
        }
    }
}

/// Losses counted by the probes themselves: the socket probes' `.bss`
/// and, when they loaded, the inference probes' (their own ring buffer
/// reserve failures).
#[derive(Debug)]
pub struct KernelCounters {
    map: MapHandle,
    infer: Option<MapHandle>,
}

/// A snapshot of [`KernelCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelLosses {
    /// Records that did not fit in the ring buffer.
    pub ringbuf_drops: u64,
    /// Data records skipped because the per-CPU staging slot was missing
    /// (kernels before 6.16, which stage records).
    pub scratch_misses: u64,
    /// Forked children of traced processes the full pid filter could not
    /// take (untraced).
    pub traced_full: u64,
    /// Inference records (USDT, CUDA, off-CPU) that did not fit in the
    /// ring buffer.
    pub infer_ringbuf_drops: u64,
    /// TLS record walks given up, records their queues had no room for.
    pub tls_walks_lost: u64,
    pub tls_queue_full: u64,
    /// Incoming segments dated together with later ones: a socket's
    /// arrival slots were all unread (see sock_state.bpf.h).
    pub ingress_segs_merged: u64,
    /// Per-thread state a thread needed and could not get (see
    /// thread_state.bpf.h), of both probe objects.
    pub thread_state_misses: u64,
}

impl KernelLosses {
    /// Every record lost in the kernel, of any probe.
    pub fn records_lost(&self) -> u64 {
        self.ringbuf_drops + self.scratch_misses + self.infer_ringbuf_drops
    }
}

impl KernelCounters {
    /// Also reads the inference probes' drop counter from `infer_bss`.
    pub fn with_infer(self, infer_bss: MapHandle) -> Self {
        KernelCounters {
            infer: Some(infer_bss),
            ..self
        }
    }

    pub fn read(&self) -> Result<KernelLosses> {
        let bss = self
            .map
            .lookup(&0u32.to_ne_bytes(), MapFlags::ANY)
            .context("reading the probes' .bss counters")?
            .context("probes' .bss is empty")?;
        let counters = plain::from_bytes::<types::bss>(&bss)
            .map_err(|err| anyhow::anyhow!("probes' .bss has an unexpected layout: {err:?}"))?;
        let (infer_ringbuf_drops, infer_thread_state_misses) = match &self.infer {
            None => (0, 0),
            Some(map) => {
                let bss = map
                    .lookup(&0u32.to_ne_bytes(), MapFlags::ANY)
                    .context("reading the inference probes' .bss counters")?
                    .context("inference probes' .bss is empty")?;
                let infer = plain::from_bytes::<tokentrace_probes::infer::types::bss>(&bss)
                    .map_err(|err| {
                        anyhow::anyhow!("inference probes' .bss has an unexpected layout: {err:?}")
                    })?;
                (infer.ringbuf_drops, infer.thread_state_misses)
            }
        };
        Ok(KernelLosses {
            ringbuf_drops: counters.ringbuf_drops,
            scratch_misses: counters.scratch_misses,
            traced_full: counters.traced_full,
            infer_ringbuf_drops,
            tls_walks_lost: counters.tls_walk_lost,
            tls_queue_full: counters.tls_queue_full,
            ingress_segs_merged: counters.ingress_segs_merged,
            thread_state_misses: counters.thread_state_misses + infer_thread_state_misses,
        })
    }
}

impl SockProbes {
    /// Attaches the OpenSSL probes at `sites` of `path` for `pid` (None:
    /// every process) in `mode`; what failed is in the result.
    pub(crate) fn attach_tls(
        &self,
        mode: UprobeMode,
        pid: Option<u32>,
        path: &Path,
        sites: &[Site],
    ) -> Result<Attached> {
        let progs = &self.skel.progs;
        let probes = attach::site_probes(sites, &progs.ssl_exit, |site| {
            let program = match site.function {
                "SSL_read" => &progs.ssl_read_enter,
                "SSL_write" => &progs.ssl_write_enter,
                "SSL_read_ex" => &progs.ssl_read_ex_enter,
                "SSL_write_ex" => &progs.ssl_write_ex_enter,
                "SSL_do_handshake" => &progs.ssl_handshake_enter,
                "SSL_free" => &progs.ssl_free_enter,
                other => {
                    tracing::debug!("no OpenSSL program for {other}");
                    return None;
                }
            };
            Some(program)
        })?;
        attach::attach(mode, &probes, pid, path)
    }
}
