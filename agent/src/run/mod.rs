//! `tokentrace run`: wires discovery, probes, ingest, stitching and output
//! together, and ends on --requests, --duration, Ctrl-C or SIGTERM.
//!
//! [`run_with`] connects the stages: validate everything the user can get
//! wrong, start the outputs (exporter, pod metadata, sessions, triggers),
//! start the probes and attach to the processes found, then feed the
//! `Stages` (the pure [`Pipeline`] and what carries out its results)
//! until a stop, drain what the kernel still holds, and shut the outputs
//! down.

mod offline;
mod outputs;
mod probed;
mod sink;

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use regex::Regex;
use tokio::sync::mpsc;

use crate::cli::RunArgs;
use crate::config::Config;
use crate::discover::libraries::{ProbedFiles, UprobeScope};
use crate::discover::{EndpointMatcher, Selector, Tracker};
use crate::ingest::{Batch, Ingest};
use crate::live::LiveFeed;
use crate::model::trace_context::IdGenerator;
use crate::output::RunSummary;
use crate::pipeline::Pipeline;
use crate::probes::{
    ensure_tracefs, kernel_has_task_storage, missing_socket_tracepoints, route_libbpf_logs, whom,
    DataHooks, HostUprobes, ProbeSettings, ThreadState, UprobeMode,
};
use crate::session::SessionHub;
use crate::stitch::StitchStats;
use crate::units::{monotonic_now, nanos};

pub use offline::{RecordReplay, ReplayCounts};
use outputs::Outputs;
use probed::Probed;
use sink::{Printer, Stages, Stop};

const PROC: &str = "/proc";
/// How often idle connections are swept.
const SWEEP_INTERVAL: Duration = Duration::from_secs(1);
/// Batches of events buffered between the ingest thread and stitching (the
/// heap they hold is bounded apart: see `ingest::in_flight`).
const EVENT_CHANNEL_BATCHES: usize = 1024;
/// How long attaching the uprobes of the processes found at start may take.
const ATTACH_TIMEOUT: Duration = Duration::from_secs(60);
/// How long queued spans and a last metrics push may take at exit.
const EXPORT_GRACE: Duration = Duration::from_secs(5);

fn selector(args: &RunArgs) -> Result<Selector> {
    let regex = |flag: &str, pattern: &Option<String>| -> Result<Option<Regex>> {
        pattern
            .as_deref()
            .map(|p| {
                Regex::new(p)
                    .with_context(|| format!("{flag} {p:?} is not a valid regular expression"))
            })
            .transpose()
    };
    Ok(Selector {
        pids: args.pid.clone(),
        ports: args.port.clone(),
        exe: regex("--exe", &args.exe)?,
        comm: regex("--comm", &args.comm)?,
    })
}

fn require_privileges() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "tokentrace run needs root (euid 0): it loads eBPF programs, attaches uprobes to \
             other users' processes and reads their /proc entries; run it with sudo \
             (`tokentrace check` lists what else this host is missing)"
        );
    }
    Ok(())
}

/// What `record` adds to a run.
#[derive(Debug, Default)]
pub struct RunHooks {
    /// Sessions to feed. `None`: the run serves its own control endpoint
    /// (unless `--no-control`).
    pub sessions: Option<SessionHub>,
    /// Do not print timelines.
    pub quiet: bool,
    /// Told once the probes are attached.
    pub ready: Option<tokio::sync::oneshot::Sender<()>>,
    /// Handed the live view's feed once the probes are attached (`top`).
    pub live: Option<std::sync::mpsc::Sender<LiveFeed>>,
    /// Ends the run like a signal would (`top`'s `q`).
    pub stop: Option<tokio::sync::oneshot::Receiver<()>>,
}

pub async fn run(args: RunArgs) -> Result<RunSummary> {
    run_with(args, RunHooks::default()).await
}

/// Config, the `--capture-bytes` override and the selector, all checked
/// before anything starts.
fn validated(args: &RunArgs) -> Result<(Config, Selector)> {
    let mut config = Config::load(args.config.as_deref())?;
    if let Some(bytes) = args.capture_bytes {
        config.capture.bytes = bytes;
    }
    if let Some(mode) = args.probes.uprobe_mode {
        config.discovery.uprobe_mode = mode;
    }
    if let Some(hooks) = args.probes.data_hooks {
        config.capture.data_hooks = hooks;
    }
    if let Some(state) = args.probes.thread_state {
        config.capture.thread_state = state;
    }
    config.discovery.allow_degraded |= args.allow_degraded;
    config.validate()?;
    let selector = selector(args)?;
    if let Some(pid) = selector.missing_pid(Path::new(PROC)) {
        bail!("--pid {pid}: no such process");
    }
    Ok((config, selector))
}

/// The uprobe attach mode for this host and the configured setting,
/// found by trying a uprobe_multi link before anything loads.
fn uprobe_mode(config: &Config) -> Result<UprobeMode> {
    let host = HostUprobes::probe();
    let mode = host.choose(config.discovery.uprobe_mode)?;
    if let Err(why) = &host.multi {
        tracing::debug!("uprobe_multi links unavailable: {why}");
    }
    tracing::info!(
        "uprobes: {mode} (uprobe_multi {}, CAP_SYS_ADMIN {}, tracefs writable {})",
        if host.multi.is_ok() { "yes" } else { "no" },
        if host.sys_admin { "yes" } else { "no" },
        if host.tracefs_writable { "yes" } else { "no" },
    );
    Ok(mode)
}

/// The data path for this kernel and the configured setting.
fn data_hooks(config: &Config) -> Result<DataHooks> {
    let missing = missing_socket_tracepoints();
    let hooks = config.capture.data_hooks.choose(&missing)?;
    if missing.is_empty() {
        tracing::info!("data hooks: {hooks}");
    } else {
        tracing::info!("data hooks: {hooks} (no {} tracepoint)", missing.join(", "));
    }
    Ok(hooks)
}

/// Where per-thread state lives for this kernel and the configured setting.
fn thread_state(config: &Config) -> Result<ThreadState> {
    let state = config
        .capture
        .thread_state
        .choose(kernel_has_task_storage())?;
    tracing::info!("per-thread state: {state}");
    Ok(state)
}

/// Loads the probes; the events they record go to `events_tx`. With
/// `--data-hooks auto`, socket hooks that fail to load or attach (a kernel
/// whose verifier this agent was never run against) give way to the
/// syscall hooks, with a warning that says why.
fn start_ingest(
    config: &Config,
    selector: &Selector,
    uprobe_mode: UprobeMode,
    events_tx: mpsc::Sender<Batch>,
) -> Result<Ingest> {
    let settings = ProbeSettings {
        capture_bytes: config.capture.bytes,
        receive_stamps: config.capture.receive_stamps,
        wakeup_bytes: config.capture.wakeup_threshold(),
        ring_buffer_bytes: config.capture.ring_buffer_bytes,
        agent_pid: std::process::id(),
        min_interval_ns: nanos(config.explain.min_interval),
        report_all_execs: selector.exe.is_some() || selector.comm.is_some(),
        report_listens: selector.is_automatic() || !selector.ports.is_empty(),
        uprobe_mode,
        data_hooks: data_hooks(config)?,
        thread_state: thread_state(config)?,
    };
    let poll = config.capture.poll_interval;
    config.capture.data_hooks.start_with_fallback(
        settings.data_hooks,
        |data_hooks| {
            Ingest::start(
                ProbeSettings {
                    data_hooks,
                    ..settings.clone()
                },
                poll,
                events_tx.clone(),
            )
        },
        |err| {
            tracing::warn!(
                "the socket hooks did not load ({err:#}); using the syscall hooks, which every \
                 syscall on the host pays for (--data-hooks syscall skips this try)"
            )
        },
    )
}

/// Traces the processes running now and attaches their uprobes; returns
/// once they are in place (a request sent after `ready` is seen whole, TLS
/// included). A probe they need that could not be attached is an error,
/// unless the run may be degraded: then the ready line it returns names
/// what is missing.
fn attach_initial(
    tracker: &mut Tracker,
    probed: &mut Probed<'_>,
    endpoints: &[String],
    allow_degraded: bool,
) -> Result<String> {
    let initial = tracker.initial_scan(Path::new(PROC))?;
    let mut changes = Vec::new();
    for &pid in &initial {
        probed.ingest.traced_pids.insert(pid)?;
        changes.extend(probed.files.scan(Path::new(PROC), pid));
    }
    probed.send(changes);
    probed.ingest.wait_for_commands(ATTACH_TIMEOUT)?;
    let missing = probed.ingest.attach_failures.take_blocking();
    if !missing.is_empty() && !allow_degraded {
        bail!(
            "{} probe set(s) the traced processes need could not be attached (each is named \
             above with its cause and fix); not ready. Fix the cause, or pass --allow-degraded \
             to trace without them",
            missing.len()
        );
    }
    if tracker.is_automatic() {
        eprintln!(
            "tokentrace: automatic mode: watching {} listening process(es) for requests to {}",
            initial.len(),
            endpoints.join(", ")
        );
    } else {
        eprintln!("tokentrace: tracing pid(s) {initial:?} and matching processes that start later");
    }
    if missing.is_empty() {
        return Ok("tokentrace: ready".to_string());
    }
    let what: Vec<String> = missing
        .iter()
        .map(|f| format!("{} in {} for {}", f.kind.title(), f.file, whom(f.pid)))
        .collect();
    Ok(format!(
        "tokentrace: ready (degraded, --allow-degraded: not attached: {})",
        what.join("; ")
    ))
}

pub async fn run_with(args: RunArgs, mut hooks: RunHooks) -> Result<RunSummary> {
    require_privileges()?;
    let (config, selector) = validated(&args)?;
    let mut outputs = Outputs::start(&args, &config, &mut hooks).await?;
    ensure_tracefs()?;
    route_libbpf_logs();

    let (events_tx, mut events_rx) = mpsc::channel::<Batch>(EVENT_CHANNEL_BATCHES);
    let mut tracker = Tracker::new(
        selector.clone(),
        EndpointMatcher::new(&config.endpoints),
        std::process::id(),
        config.discovery.demote_after_requests,
    )
    .with_scope(outputs.scope.take());
    let uprobe_mode = uprobe_mode(&config)?;
    let ingest = start_ingest(&config, &selector, uprobe_mode, events_tx)?;
    let uprobe_scope = if args.uprobes_all_processes || config.discovery.uprobes_all_processes {
        UprobeScope::AllProcesses
    } else {
        UprobeScope::Traced
    };
    let mut probed = Probed {
        ingest: &ingest,
        files: ProbedFiles::new(uprobe_scope),
    };
    let allow_degraded = config.discovery.allow_degraded;
    let ready_line = attach_initial(&mut tracker, &mut probed, &config.endpoints, allow_degraded)?;
    // /readyz first: whoever reads the ready line may ask it at once.
    outputs.exporter.set_ready();
    eprintln!("{ready_line}");
    if let Some(ready) = hooks.ready.take() {
        let _ = ready.send(());
    }
    if let (Some(to), Some(feed)) = (hooks.live.take(), &outputs.live) {
        let _ = to.send(feed.clone());
    }

    let mut stages = Stages {
        pipeline: Pipeline::new(
            config.stitch.stitcher_config(),
            nanos(config.explain.stall_threshold),
            nanos(config.explain.history),
        )
        .with_ids(IdGenerator::random())
        .with_tracker(tracker, PathBuf::from(PROC)),
        printer: Printer {
            format: args.output,
            out: io::stdout(),
        },
        summary: RunSummary::default(),
        probed,
        exporter: outputs.exporter,
        request_limit: args.requests,
        finished: Vec::new(),
        sessions: outputs.sessions,
        triggers: outputs.triggers,
        live: outputs.live,
        quiet: hooks.quiet,
        allow_degraded,
    };
    let idle_ns = nanos(config.stitch.idle_timeout);
    let stop = event_loop(
        &mut stages,
        &mut events_rx,
        args.duration,
        hooks.stop.take(),
        idle_ns,
    )
    .await?;
    if matches!(stop, Stop::Duration | Stop::Signal) {
        drain(&mut stages, &mut events_rx).await;
    }
    // Whatever path ended the loop, an ingest thread waiting to send must
    // not block its own join below.
    events_rx.close();
    stages.refresh_gauges();
    let Stages {
        pipeline,
        mut summary,
        exporter,
        sessions,
        triggers,
        ..
    } = stages;
    Outputs::shut_down(exporter, sessions, triggers).await?;
    summary.hops = pipeline.hop_stats().clone();
    finish(summary, pipeline.stats(), &ingest, stop)
}

/// Feeds the stages until a stop: an event batch, the periodic sweep, the
/// deadline or a signal, whichever comes first. The stages' work is
/// synchronous (stdout, BPF map writes, /proc scans); it runs on the thread
/// that `block_on`s the run (main's), not on the runtime's workers, so it
/// never holds up the tasks spawned there (OTLP export, the metrics and
/// control endpoints, the k8s watch). Keep it so: `run_with` is awaited
/// by `block_on`, never spawned.
async fn event_loop(
    stages: &mut Stages<'_>,
    events_rx: &mut mpsc::Receiver<Batch>,
    duration: Option<Duration>,
    mut stop_rx: Option<tokio::sync::oneshot::Receiver<()>>,
    idle_ns: u64,
) -> Result<Stop> {
    let mut sweep = tokio::time::interval(SWEEP_INTERVAL);
    let deadline = duration.map(|d| tokio::time::Instant::now() + d);
    // Both handlers are installed once, before the loop: a signal that
    // arrives while a batch is being processed is kept for the next turn
    // (a `ctrl_c()` future created per turn would miss it).
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .context("installing the SIGINT handler")?;
    loop {
        let until_deadline = async {
            match deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let asked_to_stop = async {
            match &mut stop_rx {
                // a dropped sender asks too: whoever could ask is gone
                Some(rx) => {
                    let _ = rx.await;
                }
                None => std::future::pending().await,
            }
        };
        let stop = tokio::select! {
            batch = events_rx.recv() => match batch {
                Some(batch) => stages.on_batch(&batch),
                None => Some(Stop::IngestEnded),
            },
            _ = sweep.tick() => stages.sweep(monotonic_now(), idle_ns),
            _ = until_deadline => Some(Stop::Duration),
            _ = interrupt.recv() => Some(Stop::Signal),
            _ = terminate.recv() => Some(Stop::Signal),
            () = asked_to_stop => Some(Stop::Signal),
        };
        if let Some(stop) = stop {
            return Ok(stop);
        }
    }
}

/// Everything the kernel recorded before the stop is stitched first (the
/// ingest thread reads the ring buffer a last time); only then are requests
/// still in flight reported, marked as cut by the agent. Received until the
/// thread ends and the channel closes: the thread waits on a full channel
/// (backpressure) rather than drop.
async fn drain(stages: &mut Stages<'_>, events_rx: &mut mpsc::Receiver<Batch>) {
    stages.probed.ingest.request_stop();
    while let Some(batch) = events_rx.recv().await {
        if stages.on_batch(&batch).is_some() {
            break;
        }
    }
    stages.finish(monotonic_now());
}

/// Stops the probes and completes the run's summary with their counters.
fn finish(
    mut summary: RunSummary,
    stitch: &StitchStats,
    ingest: &Ingest,
    stop: Stop,
) -> Result<RunSummary> {
    ingest.stop();
    let losses = ingest.kernel_counters.read().unwrap_or_default();
    summary.kernel_drops = losses.records_lost();
    summary.untraced_forks = losses.traced_full;
    summary.tls_walks_lost = losses.tls_walks_lost;
    summary.tls_queue_full = losses.tls_queue_full;
    summary.ingress_segs_merged = losses.ingress_segs_merged;
    summary.thread_state_misses = losses.thread_state_misses;
    summary.probe_attach_failures = ingest.attach_failures.counts().iter().flatten().sum();
    summary.channel_drops = ingest.stats.channel_drops.load(Ordering::Relaxed);
    summary.channel_waits = ingest.stats.channel_waits.load(Ordering::Relaxed);
    summary.decode_errors = ingest.stats.decode_errors.load(Ordering::Relaxed);
    summary.stitch = stitch.clone();
    if stop == Stop::IngestEnded {
        bail!("the ingest thread stopped unexpectedly (see the log above)");
    }
    Ok(summary)
}
