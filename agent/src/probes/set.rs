//! The probes a run owns, from load to detach: the socket probes, the
//! inference probes when they load, and the uprobe links of the files the
//! traced processes map. The ingest thread holds them (attaching happens
//! between two reads of the ring buffer) and drops them at its end.

use std::collections::{HashMap, HashSet};
use std::sync::{mpsc as std_mpsc, Arc};

use anyhow::Result;

use crate::discover::libraries::{FileChange, FileKey, ProbedFile};

use super::attach::Attached;
use super::{
    ArrivalStamps, AttachFailure, AttachFailures, AttachedProbes, InferProbes, KernelCounters,
    ProbeKind, ProbeSettings, SockProbes, TracedPids, UprobeMode,
};

/// Probe changes for the thread that holds the [`ProbeSet`], carried out
/// between two reads of the ring buffer (the thread is woken for them).
#[derive(Debug)]
pub enum ProbeCommand {
    /// Attach or detach uprobes, in order, in one batch: each attach takes
    /// a kernel lock that stalls fork() system-wide, so they are not spread
    /// over many wake-ups.
    Files(Vec<FileChange>),
    /// Answered once every command sent before it is carried out.
    Barrier(std_mpsc::Sender<()>),
}

/// The loaded probe sets.
pub struct ProbeSet {
    sock: SockProbes,
    /// Why the inference probes could not load, when they did not: the
    /// CUDA and USDT probes of the files that need them are failures then.
    infer: Result<InferProbes>,
    uprobe_mode: UprobeMode,
    failures: Arc<AttachFailures>,
    attached: Arc<AttachedProbes>,
}

/// Uprobe links attached for files, by (pid, file): pid None for links of
/// every process. Dropping it detaches them: drop it on the thread that
/// attached them, after the last command (see [`ProbeSet::apply`]).
#[derive(Default)]
pub struct FileLinks(HashMap<(Option<u32>, FileKey), Vec<libbpf_rs::Link>>);

impl ProbeSet {
    /// Loads the socket probes (an error is fatal) and the inference probes
    /// (without them the run goes on: no USDT, CUDA or off-CPU events).
    pub fn load(settings: &ProbeSettings) -> Result<Self> {
        let sock = SockProbes::load(settings)?;
        let infer = InferProbes::load(
            &sock,
            settings.min_interval_ns,
            settings.wakeup_bytes,
            settings.agent_pid,
            settings.uprobe_mode,
            settings.thread_state,
        );
        if let Err(err) = &infer {
            tracing::warn!("inference probes (USDT, CUDA, off-CPU) unavailable: {err:#}");
        }
        let attached = Arc::new(AttachedProbes::default());
        // the inference probes attach one program (sched_switch) at load
        attached.set_kernel(sock.attached_programs() + usize::from(infer.is_ok()));
        Ok(Self {
            sock,
            infer,
            uprobe_mode: settings.uprobe_mode,
            failures: Arc::default(),
            attached,
        })
    }

    /// The attach failures of this run, shared with the run loop.
    pub fn failures(&self) -> Arc<AttachFailures> {
        Arc::clone(&self.failures)
    }

    /// What is attached now, shared with the run loop.
    pub fn attached(&self) -> Arc<AttachedProbes> {
        Arc::clone(&self.attached)
    }

    /// A consumer of the events ring buffer (both probe sets write it),
    /// calling `callback` with each raw record.
    pub fn ring_buffer<'a, F>(&'a self, callback: F) -> Result<libbpf_rs::RingBuffer<'a>>
    where
        F: FnMut(&[u8]) -> i32 + 'a,
    {
        self.sock.ring_buffer(callback)
    }

    /// Receive stamping for the ingress dating (see [`ArrivalStamps`]).
    pub fn arrival_stamps(&self) -> Result<ArrivalStamps> {
        self.sock.arrival_stamps()
    }

    /// The handles the run steers and reads the probes by: the kernel's pid
    /// filter and the loss counters of both probe sets.
    pub fn handles(&self) -> Result<(TracedPids, KernelCounters)> {
        let pids = self.sock.traced_pids()?;
        let counters = self.sock.counters()?;
        let counters = match self.infer.as_ref().map(InferProbes::bss_handle) {
            Ok(Ok(bss)) => counters.with_infer(bss),
            Ok(Err(err)) => {
                tracing::warn!("inference probes' drop counter unreadable: {err:#}");
                counters
            }
            Err(_) => counters,
        };
        Ok((pids, counters))
    }

    /// Attaches what `file` offers for `pid` (None: every process);
    /// failures of one kind do not stop the others, and each is recorded.
    fn attach_file(&self, pid: Option<u32>, file: &ProbedFile) -> Vec<libbpf_rs::Link> {
        let mut links = Vec::new();
        let mut attached = Vec::new();
        let mode = self.uprobe_mode;
        let mut add = |kind: ProbeKind, result: Result<Attached>| {
            let failure = |probe: &str, err: &anyhow::Error| {
                AttachFailure::new(kind, mode, pid, &file.mapped_as, probe, err)
            };
            let done = match result {
                Ok(done) => done,
                Err(err) => return self.failures.record(failure("-", &err)),
            };
            // A kind is in place when its essential probes are: for
            // OpenSSL a data function (handshake and free only refine).
            let in_place = match kind {
                ProbeKind::OpenSsl => done
                    .functions
                    .iter()
                    .any(|f| f.starts_with("SSL_read") || f.starts_with("SSL_write")),
                ProbeKind::Cuda | ProbeKind::Usdt => !done.functions.is_empty(),
            };
            match (in_place, done.failed.first()) {
                (false, Some((probe, err))) => self.failures.record(failure(probe, err)),
                (false, None) => self.failures.record(failure(
                    "-",
                    &anyhow::anyhow!("no probe site found in the file"),
                )),
                (true, _) => {
                    for (probe, err) in &done.failed {
                        tracing::warn!(
                            "{}: {probe} not probed in {} ({mode} mode): {err:#}",
                            kind.title(),
                            file.mapped_as
                        );
                    }
                    attached.push(format!("{} ({} probes)", kind.title(), done.links.len()));
                    links.extend(done.links);
                }
            }
        };
        let path = &file.path;
        if !file.probes.tls.is_empty() {
            add(
                ProbeKind::OpenSsl,
                self.sock.attach_tls(mode, pid, path, &file.probes.tls),
            );
        }
        let inference = |kind: ProbeKind| -> Result<&InferProbes> {
            self.infer.as_ref().map_err(|err| {
                anyhow::anyhow!("the inference probes did not load: {err:#}")
                    .context(format!("{} probes", kind.title()))
            })
        };
        if file.probes.cuda.is_some() {
            let result = inference(ProbeKind::Cuda)
                .and_then(|infer| infer.attach_cuda(mode, pid, path, &file.probes.cuda_sites));
            add(ProbeKind::Cuda, result);
        }
        if !file.probes.usdt.is_empty() {
            let result = inference(ProbeKind::Usdt)
                .and_then(|infer| infer.attach_usdt(pid, path, &file.probes.usdt));
            add(ProbeKind::Usdt, result);
        }
        if !attached.is_empty() {
            let whom = super::whom(pid);
            tracing::info!(
                "probing {}: {} for {whom} ({mode} uprobes)",
                file.mapped_as,
                attached.join(", ")
            );
        }
        links
    }

    /// Carries out a probe command; attached links live in `file_links` until
    /// detached. USDT links among them are detached one after the other on
    /// one thread: libbpf's USDT detach returns spec ids to the object's
    /// shared usdt_manager without a lock, and detached from several
    /// threads at once they corrupted the heap ("realloc(): invalid next
    /// size", "double free or corruption" at exit).
    pub fn apply(&self, command: ProbeCommand, file_links: &mut FileLinks) {
        match command {
            ProbeCommand::Files(changes) => {
                let started = std::time::Instant::now();
                let (mut attached, mut processes) = (0usize, HashSet::new());
                for change in changes {
                    match change {
                        FileChange::Attach { pid, file } => {
                            if let std::collections::hash_map::Entry::Vacant(slot) =
                                file_links.0.entry((pid, file.key))
                            {
                                let links = self.attach_file(pid, &file);
                                attached += links.len();
                                processes.insert(pid);
                                slot.insert(links);
                            }
                        }
                        FileChange::Detach { pid, key } => {
                            // Dropping the links detaches them.
                            if file_links.0.remove(&(pid, key)).is_some() {
                                let whom = super::whom(pid);
                                tracing::debug!("detached file {key:?} for {whom}");
                            }
                        }
                    }
                }
                self.attached
                    .set_uprobe_links(file_links.0.values().map(Vec::len).sum());
                if attached > 0 {
                    let elapsed = started.elapsed();
                    tracing::info!(
                        "attached {attached} uprobe links for {} process(es) in {:.1} ms",
                        processes.len(),
                        elapsed.as_secs_f64() * 1e3
                    );
                }
            }
            ProbeCommand::Barrier(done) => {
                let _ = done.send(());
            }
        }
    }
}
