//! CPU sampling for a session: one `perf_event_open` CPU-clock event per
//! online CPU at the session's frequency, each running `profile.bpf.c`,
//! which copies the kernel and user stacks of profiled processes into its
//! ring buffer. Stacks are deduplicated as they arrive and symbolised with
//! blazesym when the session ends, while the processes' mappings are still
//! there to read.
//!
//! Only sessions that sample load this (at most one at a time, see
//! [`super::hub`]); the always-on tracing path never pays for it.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::rc::Rc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use blazesym::symbolize::source::{Kernel, Process, Source};
use blazesym::symbolize::{Input, Symbolized, Symbolizer};
use blazesym::{MaybeDefault, Pid};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{Link, MapCore, MapFlags, OpenObject, RingBuffer, RingBufferBuilder};
use perf_event::events::Software;
use tokentrace_probes::profile::{types, ProfileSkel, ProfileSkelBuilder};

use super::core::{CpuSample, Profile};
use crate::event::MonoNs;

/// Highest sampling frequency accepted. The kernel caps it too
/// (`perf_event_max_sample_rate`); stack copies are the cost per sample.
pub const MAX_FREQUENCY_HZ: u64 = 1000;
/// Default frequency: 99 Hz, off the 100 Hz beat of timers so samples do
/// not lock step with periodic work.
pub const DEFAULT_FREQUENCY_HZ: u64 = crate::config::DEFAULT_PROFILE_HZ;
/// Name of a frame that could not be symbolised.
const UNKNOWN: &str = "[unknown]";

/// A stack as the kernel reported it, before symbolisation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct RawStack {
    pid: u32,
    comm: String,
    /// Innermost first, as `bpf_get_stack` writes them.
    kernel: Vec<u64>,
    user: Vec<u64>,
}

#[derive(Debug, Clone, Copy)]
struct RawSample {
    ts: MonoNs,
    pid: u32,
    tid: u32,
    stack: u32,
}

/// Samples collected by the ring buffer callback.
#[derive(Debug, Default)]
struct Collector {
    index: HashMap<RawStack, u32>,
    stacks: Vec<RawStack>,
    samples: Vec<RawSample>,
    undecodable: u64,
}

fn frames(stack: &[u64], bytes: i32) -> Vec<u64> {
    let n = usize::try_from(bytes).unwrap_or(0) / std::mem::size_of::<u64>();
    stack
        .iter()
        .take(n)
        .copied()
        .filter(|&ip| ip != 0)
        .collect()
}

fn comm(raw: &[i8]) -> String {
    let bytes: Vec<u8> = raw
        .iter()
        .map(|&c| c as u8)
        .take_while(|&c| c != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

impl Collector {
    fn record(&mut self, data: &[u8]) {
        let Ok(sample) = plain::from_bytes::<types::tt_cpu_sample>(data) else {
            self.undecodable += 1;
            return;
        };
        let key = RawStack {
            pid: sample.hdr.tgid,
            comm: comm(&sample.hdr.comm),
            kernel: frames(&sample.kstack, sample.kstack_bytes),
            user: frames(&sample.ustack, sample.ustack_bytes),
        };
        let next = u32::try_from(self.stacks.len()).unwrap_or(u32::MAX);
        let stack = *self.index.entry(key.clone()).or_insert_with(|| {
            self.stacks.push(key);
            next
        });
        self.samples.push(RawSample {
            ts: sample.hdr.ts_ns,
            pid: sample.hdr.tgid,
            tid: sample.hdr.tid,
            stack,
        });
    }
}

/// CPU sampling in progress. Dropping it stops sampling and unloads the
/// program.
pub struct Profiler<'obj> {
    // Field order is drop order: the consumer, then the links (which close
    // the perf events), then the object.
    ring: RingBuffer<'static>,
    _links: Vec<Link>,
    skel: ProfileSkel<'obj>,
    collected: Rc<RefCell<Collector>>,
    profiled: HashSet<u32>,
    frequency_hz: u64,
}

/// CPUs that are online now (`/sys/devices/system/cpu/online`, e.g.
/// `0-3,6`).
fn online_cpus() -> Result<Vec<usize>> {
    const ONLINE: &str = "/sys/devices/system/cpu/online";
    let text = std::fs::read_to_string(ONLINE).with_context(|| format!("reading {ONLINE}"))?;
    parse_cpu_list(text.trim()).with_context(|| format!("{ONLINE} holds {text:?}"))
}

fn parse_cpu_list(text: &str) -> Result<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in text.split(',').filter(|p| !p.is_empty()) {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let (lo, hi): (usize, usize) = (lo.trim().parse()?, hi.trim().parse()?);
        if hi < lo {
            bail!("range {part} runs backwards");
        }
        cpus.extend(lo..=hi);
    }
    Ok(cpus)
}

impl<'obj> Profiler<'obj> {
    /// Loads `profile.bpf.c` and starts sampling every online CPU at
    /// `frequency_hz`. Nothing is recorded until [`Profiler::add_process`].
    pub fn start(storage: &'obj mut MaybeUninit<OpenObject>, frequency_hz: u64) -> Result<Self> {
        if frequency_hz == 0 || frequency_hz > MAX_FREQUENCY_HZ {
            bail!("--profile-hz {frequency_hz}: use 1 to {MAX_FREQUENCY_HZ} (or 0 for no CPU profile)");
        }
        let open = ProfileSkelBuilder::default()
            .open(storage)
            .context("opening the CPU profiling BPF object")?;
        let skel = open.load().map_err(|err| {
            let message = crate::probes::load_failure("the CPU profiling BPF program", &err);
            anyhow::Error::new(err).context(message)
        })?;
        let mut links = vec![skel
            .progs
            .on_profiled_fork
            .attach()
            .context("attaching the fork tracepoint of the CPU profiler")?];
        for cpu in online_cpus()? {
            let counter = perf_event::Builder::new(Software::CPU_CLOCK)
                .one_cpu(cpu)
                .any_pid()
                .sample_frequency(frequency_hz)
                .build()
                .with_context(|| {
                    format!(
                        "perf_event_open (CPU clock, CPU {cpu}, {frequency_hz} Hz): needs root or \
                         CAP_PERFMON, and kernel.perf_event_paranoid <= 2"
                    )
                })?;
            // SAFETY: into_raw_fd hands over the counter's open fd; the
            // OwnedFd is its only owner from here on.
            let fd = unsafe { OwnedFd::from_raw_fd(counter.into_raw_fd()) };
            let link = skel
                .progs
                .on_cpu_sample
                .attach_perf_event(fd.as_raw_fd())
                .with_context(|| format!("attaching the sampling program to CPU {cpu}"))?;
            // libbpf owns the perf event from here: its link closes it.
            let _ = fd.into_raw_fd();
            links.push(link);
        }
        let collected = Rc::new(RefCell::new(Collector::default()));
        let sink = Rc::clone(&collected);
        let mut builder = RingBufferBuilder::new();
        builder
            .add(&skel.maps.samples, move |data| {
                sink.borrow_mut().record(data);
                0
            })
            .context("registering the CPU sample ring buffer")?;
        let ring = builder
            .build()
            .context("creating the CPU sample consumer")?;
        Ok(Self {
            ring,
            _links: links,
            skel,
            collected,
            profiled: HashSet::new(),
            frequency_hz,
        })
    }

    /// Samples `pid` (and the processes it forks) from now on.
    pub fn add_process(&mut self, pid: u32) {
        if !self.profiled.insert(pid) {
            return;
        }
        if let Err(err) =
            self.skel
                .maps
                .profiled_tgids
                .update(&pid.to_ne_bytes(), &[1u8], MapFlags::ANY)
        {
            tracing::warn!("CPU profile: cannot add pid {pid}: {err}");
        }
    }

    /// Collects the samples waiting in the ring buffer.
    pub fn poll(&self) {
        if let Err(err) = self.ring.poll(Duration::ZERO) {
            tracing::debug!("CPU profile: polling samples: {err}");
        }
    }

    /// Samples collected so far.
    pub fn samples(&self) -> usize {
        self.collected.borrow().samples.len()
    }

    /// Stops sampling and symbolises every stack. Returns the profile and
    /// how many samples the kernel dropped.
    pub fn finish(self) -> (Profile, u64) {
        self.poll();
        let dropped = self
            .skel
            .maps
            .bss_data
            .as_deref()
            .map_or(0, |bss| bss.ringbuf_drops);
        let frequency_hz = self.frequency_hz;
        let collected = std::mem::take(&mut *self.collected.borrow_mut());
        drop(self);
        if collected.undecodable > 0 {
            tracing::warn!("CPU profile: {} undecodable samples", collected.undecodable);
        }
        (symbolize(collected, frequency_hz), dropped)
    }
}

/// A return address points after its call; the call itself (the frame to
/// name) is the byte before. The innermost frame is the interrupted
/// instruction and is taken as is.
fn lookup_addresses(stack: &[u64]) -> impl Iterator<Item = u64> + '_ {
    stack
        .iter()
        .enumerate()
        .map(|(i, &ip)| if i == 0 { ip } else { ip.saturating_sub(1) })
}

/// Symbol names for `addrs` in `source`; unknown ones are [`UNKNOWN`].
fn names(symbolizer: &Symbolizer, source: &Source<'_>, addrs: &[u64]) -> HashMap<u64, String> {
    let mut out = HashMap::with_capacity(addrs.len());
    match symbolizer.symbolize(source, Input::AbsAddr(addrs)) {
        Ok(results) => {
            for (addr, result) in addrs.iter().zip(results) {
                let name = match result {
                    // `;` separates frames in folded stacks.
                    Symbolized::Sym(sym) => sym.name.replace(';', ":"),
                    Symbolized::Unknown(_) => UNKNOWN.to_string(),
                };
                out.insert(*addr, name);
            }
        }
        Err(err) => tracing::warn!("CPU profile: symbolising {source:?} failed: {err}"),
    }
    out
}

fn symbolize(collected: Collector, frequency_hz: u64) -> Profile {
    let symbolizer = Symbolizer::new();
    let mut user: HashMap<u32, HashSet<u64>> = HashMap::new();
    let mut kernel: HashSet<u64> = HashSet::new();
    for stack in &collected.stacks {
        user.entry(stack.pid)
            .or_default()
            .extend(lookup_addresses(&stack.user));
        kernel.extend(lookup_addresses(&stack.kernel));
    }
    let mut user_names: HashMap<u32, HashMap<u64, String>> = HashMap::new();
    for (pid, addrs) in user {
        let addrs: Vec<u64> = addrs.into_iter().collect();
        let source = Source::Process(Process::new(Pid::from(pid)));
        user_names.insert(pid, names(&symbolizer, &source, &addrs));
    }
    let kernel: Vec<u64> = kernel.into_iter().collect();
    let kernel_names = if kernel.is_empty() {
        HashMap::new()
    } else {
        let source = Source::Kernel(Kernel {
            vmlinux: MaybeDefault::None,
            ..Kernel::default()
        });
        names(&symbolizer, &source, &kernel)
    };
    let name = |table: Option<&HashMap<u64, String>>, addr: u64| {
        table
            .and_then(|t| t.get(&addr))
            .cloned()
            .unwrap_or_else(|| UNKNOWN.to_string())
    };
    let stacks = collected
        .stacks
        .iter()
        .map(|stack| {
            let mut frames = vec![if stack.comm.is_empty() {
                format!("pid {}", stack.pid)
            } else {
                stack.comm.replace(';', ":")
            }];
            let user_table = user_names.get(&stack.pid);
            let user: Vec<u64> = lookup_addresses(&stack.user).collect();
            frames.extend(user.iter().rev().map(|&a| name(user_table, a)));
            let kernel: Vec<u64> = lookup_addresses(&stack.kernel).collect();
            frames.extend(
                kernel
                    .iter()
                    .rev()
                    .map(|&a| format!("{}_[k]", name(Some(&kernel_names), a))),
            );
            frames
        })
        .collect();
    let samples = collected
        .samples
        .iter()
        .map(|s| CpuSample {
            ts: s.ts,
            pid: s.pid,
            tid: s.tid,
            stack: s.stack,
        })
        .collect();
    Profile {
        frequency_hz,
        stacks,
        samples,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse() {
        assert_eq!(parse_cpu_list("0-3,6").expect("list"), vec![0, 1, 2, 3, 6]);
        assert_eq!(parse_cpu_list("0").expect("list"), vec![0]);
        assert!(parse_cpu_list("3-1").is_err());
        assert!(parse_cpu_list("x").is_err());
    }

    #[test]
    fn stacks_are_trimmed_to_what_the_kernel_filled() {
        let stack = [10, 20, 30, 0, 0];
        assert_eq!(frames(&stack, 24), vec![10, 20, 30]);
        assert_eq!(frames(&stack, -14), Vec::<u64>::new());
        assert_eq!(
            lookup_addresses(&[100, 200, 300]).collect::<Vec<_>>(),
            vec![100, 199, 299]
        );
    }

    #[test]
    fn symbolises_this_process_own_function() {
        // the address of a function of this test binary, as a sampled
        // user stack would hold it
        let addr = parse_cpu_list as *const () as u64;
        let pid = std::process::id();
        let collected = Collector {
            index: HashMap::new(),
            stacks: vec![RawStack {
                pid,
                comm: "tests".into(),
                kernel: Vec::new(),
                user: vec![addr],
            }],
            samples: vec![RawSample {
                ts: 1,
                pid,
                tid: pid,
                stack: 0,
            }],
            undecodable: 0,
        };
        let profile = symbolize(collected, 99);
        let frames = &profile.stacks[0];
        assert_eq!(frames[0], "tests");
        assert!(frames[1].contains("parse_cpu_list"), "{frames:?}");
        assert_eq!(profile.samples.len(), 1);
    }
}
