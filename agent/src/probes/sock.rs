//! The socket probe set (`sock.bpf.c`): load, configure, attach, and the
//! handles userspace keeps to steer it (pid filter) and read its counters.

use std::mem::MaybeUninit;

use anyhow::{Context, Result};
use libbpf_rs::skel::{OpenSkel, Skel, SkelBuilder};
use libbpf_rs::{MapCore, MapFlags, MapHandle, OpenObject, RingBuffer, RingBufferBuilder};
use tokentrace_probes::sock::{types, SockSkel, SockSkelBuilder};

/// Largest payload prefix the kernel side can copy (`MAX_CAPTURE` in events.h).
pub const MAX_CAPTURE_BYTES: u32 = 16384;

/// Tunables written into the probes' read-only data before load.
#[derive(Debug, Clone)]
pub struct ProbeSettings {
    /// Payload bytes captured per syscall (at most [`MAX_CAPTURE_BYTES`]).
    pub capture_bytes: u32,
    /// Ring buffer fill level that triggers a wake-up; below it the agent
    /// finds records on its next timed poll.
    pub wakeup_bytes: u64,
    /// Ring buffer size in bytes (power of two, multiple of the page size).
    pub ring_buffer_bytes: u32,
    /// The agent's own pid, never traced.
    pub agent_pid: u32,
    /// Shortest off-CPU interval or send-queue hold the probes report.
    pub min_interval_ns: u64,
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

        let rodata = open
            .maps
            .rodata_data
            .as_deref_mut()
            .context("socket BPF object has no .rodata")?;
        rodata.capture_bytes = settings.capture_bytes.min(MAX_CAPTURE_BYTES);
        rodata.wakeup_bytes = settings.wakeup_bytes;
        rodata.agent_tgid = settings.agent_pid;
        rodata.hold_min_ns = settings.min_interval_ns;

        let cpus = libbpf_rs::num_possible_cpus().context("counting possible CPUs")?;
        let cpus = u32::try_from(cpus).context("CPU count does not fit u32")?;
        open.maps
            .scratch
            .set_max_entries(cpus)
            .context("sizing the per-CPU scratch map")?;
        open.maps
            .events
            .set_max_entries(settings.ring_buffer_bytes)
            .context("sizing the ring buffer (must be a power of two multiple of the page size)")?;

        let mut skel = open.load().context(
            "loading the socket BPF programs into the kernel (needs root or CAP_BPF+CAP_PERFMON; \
             run `tokentrace check` for details)",
        )?;
        let mut links = Vec::new();
        // Every tracepoint program; the OpenSSL uprobes are attached per
        // library file later.
        for program in skel.object_mut().progs_mut() {
            let section = program.section().to_string_lossy();
            if section.starts_with("tracepoint/") || section.starts_with("tp_btf/") {
                let link = program.attach().with_context(|| {
                    format!("attaching {section} (is tracefs mounted? run `tokentrace check`)")
                })?;
                links.push(link);
            }
        }
        Ok(Self { skel, links })
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

    /// The ring buffer and pid filter, for other probe sets to share.
    pub(crate) fn shared_maps(&self) -> (&libbpf_rs::Map<'static>, &libbpf_rs::Map<'static>) {
        (&self.skel.maps.events, &self.skel.maps.traced_tgids)
    }

    /// A handle on the pid filter, usable from another thread.
    pub fn traced_pids(&self) -> Result<TracedPids> {
        let map = MapHandle::try_from(&self.skel.maps.traced_tgids)
            .context("duplicating traced_tgids")?;
        Ok(TracedPids { map })
    }

    /// A handle on the kernel-side loss counters, usable from another thread.
    pub fn counters(&self) -> Result<KernelCounters> {
        let map = MapHandle::try_from(&self.skel.maps.bss).context("duplicating .bss")?;
        Ok(KernelCounters { map })
    }
}

impl Drop for SockProbes {
    fn drop(&mut self) {
        super::detach_all(std::mem::take(&mut self.links));
    }
}

/// The in-kernel pid filter: only processes in it have their sockets traced.
#[derive(Debug)]
pub struct TracedPids {
    map: MapHandle,
}

impl TracedPids {
    pub fn insert(&self, pid: u32) -> Result<()> {
        self.map
            .update(&pid.to_ne_bytes(), &[1u8], MapFlags::ANY)
            .with_context(|| format!("adding pid {pid} to the kernel pid filter"))
    }

    /// Removes `pid`; absent pids are not an error (the kernel removes
    /// exited processes itself).
    pub fn remove(&self, pid: u32) {
        if let Err(err) = self.map.delete(&pid.to_ne_bytes()) {
            tracing::trace!("pid {pid} not in the kernel filter: {err}");
        }
    }
}

/// Losses counted by the probes themselves.
#[derive(Debug)]
pub struct KernelCounters {
    map: MapHandle,
}

/// A snapshot of [`KernelCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelLosses {
    /// Records that did not fit in the ring buffer.
    pub ringbuf_drops: u64,
    /// Data records skipped because the per-CPU staging slot was missing.
    pub scratch_misses: u64,
}

impl KernelCounters {
    pub fn read(&self) -> Result<KernelLosses> {
        let bss = self
            .map
            .lookup(&0u32.to_ne_bytes(), MapFlags::ANY)
            .context("reading the probes' .bss counters")?
            .context("probes' .bss is empty")?;
        let counters = plain::from_bytes::<types::bss>(&bss)
            .map_err(|err| anyhow::anyhow!("probes' .bss has an unexpected layout: {err:?}"))?;
        Ok(KernelLosses {
            ringbuf_drops: counters.ringbuf_drops,
            scratch_misses: counters.scratch_misses,
        })
    }
}

/// One probe of the TLS set: an exported function and the program run on
/// its entry or return.
struct TlsProbe {
    symbol: &'static str,
    retprobe: bool,
}

const TLS_PROBES: [TlsProbe; 11] = [
    TlsProbe {
        symbol: "SSL_read",
        retprobe: false,
    },
    TlsProbe {
        symbol: "SSL_read",
        retprobe: true,
    },
    TlsProbe {
        symbol: "SSL_write",
        retprobe: false,
    },
    TlsProbe {
        symbol: "SSL_write",
        retprobe: true,
    },
    TlsProbe {
        symbol: "SSL_read_ex",
        retprobe: false,
    },
    TlsProbe {
        symbol: "SSL_read_ex",
        retprobe: true,
    },
    TlsProbe {
        symbol: "SSL_write_ex",
        retprobe: false,
    },
    TlsProbe {
        symbol: "SSL_write_ex",
        retprobe: true,
    },
    // Lifecycle: the handshake ties the SSL* to its socket before any
    // data; SSL_free ends the connection. Optional: data works without.
    TlsProbe {
        symbol: "SSL_do_handshake",
        retprobe: false,
    },
    TlsProbe {
        symbol: "SSL_do_handshake",
        retprobe: true,
    },
    TlsProbe {
        symbol: "SSL_free",
        retprobe: false,
    },
];

impl SockProbes {
    /// Attaches the OpenSSL probes to `path` for every process (the pid
    /// filter runs in the programs). Returns the links; dropping them
    /// detaches. A function the file does not define is skipped (OpenSSL
    /// 1.0 has no `_ex` variants); it is an error only if no data function
    /// could be probed.
    pub fn attach_tls(&self, path: &std::path::Path) -> Result<Vec<libbpf_rs::Link>> {
        use libbpf_rs::UprobeOpts;
        let progs = &self.skel.progs;
        let mut links = Vec::new();
        let mut data_probes = 0;
        for probe in &TLS_PROBES {
            let program = match (probe.symbol, probe.retprobe) {
                (_, true) => &progs.ssl_exit,
                ("SSL_read", false) => &progs.ssl_read_enter,
                ("SSL_write", false) => &progs.ssl_write_enter,
                ("SSL_read_ex", false) => &progs.ssl_read_ex_enter,
                ("SSL_write_ex", false) => &progs.ssl_write_ex_enter,
                ("SSL_do_handshake", false) => &progs.ssl_handshake_enter,
                _ => &progs.ssl_free_enter,
            };
            let opts = UprobeOpts {
                func_name: Some(probe.symbol.to_string()),
                retprobe: probe.retprobe,
                ..UprobeOpts::default()
            };
            match program.attach_uprobe_with_opts(-1, path, 0, opts) {
                Ok(link) => {
                    if probe.symbol.starts_with("SSL_read") || probe.symbol.starts_with("SSL_write")
                    {
                        data_probes += 1;
                    }
                    links.push(link);
                }
                Err(err) => {
                    tracing::debug!("{} in {}: not probed: {err}", probe.symbol, path.display())
                }
            }
        }
        if data_probes == 0 {
            anyhow::bail!(
                "{} defines none of SSL_read/SSL_write/SSL_read_ex/SSL_write_ex",
                path.display()
            );
        }
        Ok(links)
    }
}
