//! `tokentrace run`: wires discovery, probes, ingest, stitching and output
//! together, and ends on --requests, --duration, Ctrl-C or SIGTERM.

use std::io::{self, Write};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use regex::Regex;
use tokio::sync::mpsc;

use crate::cli::RunArgs;
use crate::config::Config;
use crate::discover::libraries::{FileChange, ProbedFiles, UprobeScope};
use crate::discover::{Change, EndpointMatcher, Selector, Tracker};
use crate::event::Event;
use crate::explain::Explainer;
use crate::export::{AgentCounters, Exporter};
use crate::ingest::{Ingest, ProbeCommand};
use crate::output::{text_line, JsonTimeline, OutputFormat, RunSummary};
use crate::probes::{ensure_tracefs, route_libbpf_logs, ProbeSettings};
use crate::session::SessionHub;
use crate::stitch::{RequestTimeline, Stitcher};
use crate::trigger::Triggers;
use crate::units::monotonic_now;

const PROC: &str = "/proc";
/// How often idle connections are swept.
const SWEEP_INTERVAL: Duration = Duration::from_secs(1);
/// Batches of events buffered between the ingest thread and stitching.
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

/// Writes timelines in the chosen format; a closed stdout ends the run.
struct Printer {
    format: OutputFormat,
    out: io::Stdout,
}

impl Printer {
    fn print(&mut self, timeline: &RequestTimeline) -> io::Result<()> {
        let line = match self.format {
            OutputFormat::Json => JsonTimeline::new(timeline).to_line(),
            OutputFormat::Text => text_line(timeline),
        };
        let mut out = self.out.lock();
        writeln!(out, "{line}")?;
        out.flush()
    }
}

/// The probes' side of which processes are traced: the kernel pid filter
/// and the uprobes of the files those processes map.
struct Probed<'a> {
    ingest: &'a Ingest,
    files: ProbedFiles,
}

impl Probed<'_> {
    fn apply(&mut self, change: Change) {
        match change {
            Change::Trace(pid) => {
                match self.ingest.traced_pids.insert(pid) {
                    Ok(()) => tracing::info!("tracing pid {pid}"),
                    Err(err) => tracing::warn!("{err:#}"),
                }
                let mut changes = self.files.scan(Path::new(PROC), pid);
                // The kernel adds what a traced process forks from now on;
                // what it forked before its exec or listen event reached us
                // (nginx's master forks its workers within milliseconds of
                // exec) is only found in /proc, now that later forks are
                // covered.
                for child in crate::discover::procfs::descendants(Path::new(PROC), pid) {
                    match self.ingest.traced_pids.insert(child) {
                        Ok(()) => tracing::info!("tracing pid {child}, forked by {pid}"),
                        Err(err) => tracing::warn!("{err:#}"),
                    }
                    changes.extend(self.files.scan(Path::new(PROC), child));
                }
                self.send(changes);
            }
            Change::Untrace(pid) => {
                self.ingest.traced_pids.remove(pid);
                let changes = self.files.process_gone(pid);
                self.send(changes);
            }
        }
    }

    /// Finds probed files `pid` maps (now, or after it loaded a library).
    fn scan_libraries(&mut self, pid: u32) {
        let changes = self.files.scan(Path::new(PROC), pid);
        self.send(changes);
    }

    fn send(&self, changes: Vec<FileChange>) {
        if !changes.is_empty() {
            self.ingest.command(ProbeCommand::Files(changes));
        }
    }

    /// Lifecycle events that change what is probed.
    fn on_event(&mut self, event: &Event) {
        match event {
            Event::LibraryMapped(mapped) => self.scan_libraries(mapped.pid),
            // A fork copies the parent's breakpoints but not its uprobes:
            // the child (traced by the kernel from its first instruction)
            // gets its own.
            Event::Fork(fork) => self.scan_libraries(fork.pid),
            Event::Exit(exit) => {
                let changes = self.files.process_gone(exit.pid);
                self.send(changes);
            }
            _ => {}
        }
    }
}

/// Stitching and reporting, fed by the run loop.
struct Pipeline<'a> {
    tracker: Tracker,
    stitcher: Stitcher,
    printer: Printer,
    summary: RunSummary,
    probed: Probed<'a>,
    explainer: Explainer,
    exporter: Exporter,
    request_limit: Option<u64>,
    finished: Vec<RequestTimeline>,
    /// Recording sessions tapping the event stream.
    sessions: Option<SessionHub>,
    /// SLO triggers starting sessions by themselves.
    triggers: Option<Triggers>,
    /// Timelines are not printed (`record` shows progress instead).
    quiet: bool,
}

impl Pipeline<'_> {
    fn on_batch(&mut self, batch: &[Event]) -> Option<Stop> {
        self.summary.events += batch.len() as u64;
        if let Some(sessions) = &self.sessions {
            sessions.on_events(batch);
        }
        if let Some(triggers) = &mut self.triggers {
            triggers.on_events(batch, monotonic_now());
        }
        for event in batch {
            if let Some(change) = self.tracker.on_event(event, Path::new(PROC)) {
                self.probed.apply(change);
            }
            self.probed.on_event(event);
            self.summary.observe(event);
            self.explainer.observe(event);
            self.stitcher.push(event, &mut self.finished);
        }
        self.report()
    }

    /// Prints finished timelines the tracker wants reported.
    fn report(&mut self) -> Option<Stop> {
        for mut timeline in std::mem::take(&mut self.finished) {
            let (report, change) = self.tracker.review(&timeline);
            if let Some(change) = change {
                self.probed.apply(change);
                if let Change::Untrace(pid) = change {
                    self.stitcher.forget_process(pid);
                }
            }
            if !report {
                continue;
            }
            timeline.stalls = self.explainer.explain(&timeline);
            self.summary.record(&timeline);
            self.exporter.record(&timeline);
            self.judge(&timeline);
            if !self.quiet && self.printer.print(&timeline).is_err() {
                return Some(Stop::OutputClosed);
            }
            if self
                .request_limit
                .is_some_and(|n| self.summary.requests() >= n)
            {
                return Some(Stop::RequestLimit);
            }
        }
        None
    }

    /// Hands a reported timeline to the triggers; a firing is logged and
    /// exported.
    fn judge(&mut self, timeline: &RequestTimeline) {
        let Some(triggers) = &mut self.triggers else {
            return;
        };
        let service = self.exporter.service_of(timeline.conn.pid, &timeline.comm);
        let route = crate::export::normalise_route(&timeline.path);
        for firing in triggers.observe(&service, &route, timeline) {
            let ring_mib = triggers.history_bytes() as f64 / f64::from(1u32 << 20);
            match (&firing.session, &firing.error) {
                (Some(id), _) => tracing::warn!(
                    "{}: recording session {id} (history {:.1} s, {ring_mib:.1} MiB in the ring)",
                    firing.describe(),
                    firing.history_s
                ),
                (None, err) => tracing::warn!(
                    "{}: no session recorded: {}",
                    firing.describe(),
                    err.as_deref().unwrap_or("unknown")
                ),
            }
            self.exporter
                .record_trigger(&firing, timeline.conn.pid, &timeline.comm, timeline.end);
        }
    }

    /// Open requests the tracker would report, for the in-flight gauges.
    fn open_requests(&self) -> Vec<crate::model::OpenRequest> {
        let mut open = self.stitcher.open_requests();
        open.retain(|r| self.tracker.reports_path(&r.path));
        open
    }

    /// The run's counters, for the exporter's self-metrics.
    fn agent_counters(&self) -> AgentCounters {
        let ingest = self.probed.ingest;
        let kernel = ingest.kernel_counters.read().unwrap_or_default();
        let stitch = self.stitcher.stats();
        AgentCounters {
            events_received: self.summary.events,
            events_lost_kernel: kernel.records_lost(),
            untraced_forks: kernel.traced_full,
            events_lost_agent: ingest.stats.channel_drops.load(Ordering::Relaxed),
            decode_errors: ingest.stats.decode_errors.load(Ordering::Relaxed),
            parse_errors: stitch.parse_errors,
            truncated_writes: stitch.truncated_writes,
            open_connections: self.stitcher.open_connections() as u64,
        }
    }
}

/// Why the run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    RequestLimit,
    Duration,
    Signal,
    OutputClosed,
    IngestEnded,
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
}

pub async fn run(args: RunArgs) -> Result<RunSummary> {
    run_with(args, RunHooks::default()).await
}

pub async fn run_with(args: RunArgs, mut hooks: RunHooks) -> Result<RunSummary> {
    require_privileges()?;
    let mut config = Config::load(args.config.as_deref())?;
    if let Some(bytes) = args.capture_bytes {
        config.capture.bytes = bytes;
    }
    config.validate()?;
    // Everything the user can get wrong is checked before anything starts
    // (exporter, control endpoint, probes).
    let selector = selector(&args)?;
    if let Some(pid) = selector.missing_pid(Path::new(PROC)) {
        bail!("--pid {pid}: no such process");
    }
    let export = crate::export::resolve(&config.export, &args.export, &|k| std::env::var(k).ok())
        .map_err(anyhow::Error::msg)?;
    let mut exporter = Exporter::start(export).await.map_err(anyhow::Error::msg)?;
    // Pod metadata and scope: silently off outside a cluster.
    let kubernetes = crate::k8s::start(&config.kubernetes, &args.k8s).await?;
    if let Some(metadata) = &kubernetes.metadata {
        exporter.set_kubernetes(metadata.clone());
    }
    let (sessions, _control) = match hooks.sessions.take() {
        Some(hub) => (Some(hub), None),
        None => crate::session::control::for_run(&args.control, &config).await?,
    };
    // Triggers record through a hub even where no control endpoint runs.
    let sessions = sessions.or_else(|| {
        (!config.triggers.rules.is_empty()).then(|| {
            SessionHub::new(crate::session::control::hub_settings(
                &args.control,
                &config,
            ))
        })
    });
    let triggers = sessions
        .clone()
        .and_then(|hub| Triggers::new(config.triggers.clone(), hub));
    ensure_tracefs()?;
    route_libbpf_logs();

    let agent_pid = std::process::id();
    let (events_tx, mut events_rx) = mpsc::channel::<Vec<Event>>(EVENT_CHANNEL_BATCHES);
    let report_all_execs = selector.exe.is_some() || selector.comm.is_some();
    let report_listens = selector.is_automatic() || !selector.ports.is_empty();
    let mut tracker = Tracker::new(
        selector,
        EndpointMatcher::new(&config.endpoints),
        agent_pid,
        config.discovery.demote_after_requests,
    )
    .with_scope(kubernetes.scope);
    let ingest = Ingest::start(
        ProbeSettings {
            capture_bytes: config.capture.bytes,
            wakeup_bytes: config.capture.wakeup_bytes,
            ring_buffer_bytes: config.capture.ring_buffer_bytes,
            agent_pid,
            min_interval_ns: u64::try_from(config.explain.min_interval.as_nanos())
                .unwrap_or(u64::MAX),
            report_all_execs,
            report_listens,
        },
        config.capture.poll_interval,
        events_tx,
    )?;
    let initial = tracker.initial_scan(Path::new(PROC))?;
    let uprobe_scope = if args.uprobes_all_processes || config.discovery.uprobes_all_processes {
        UprobeScope::AllProcesses
    } else {
        UprobeScope::Traced
    };
    let mut probed = Probed {
        ingest: &ingest,
        files: ProbedFiles::new(uprobe_scope),
    };
    let mut initial_changes = Vec::new();
    for &pid in &initial {
        ingest.traced_pids.insert(pid)?;
        initial_changes.extend(probed.files.scan(Path::new(PROC), pid));
    }
    // One batch, and `ready` only once it is in place: a request sent after
    // `ready` is seen whole, TLS included.
    probed.send(initial_changes);
    ingest.wait_for_commands(ATTACH_TIMEOUT)?;
    if tracker.is_automatic() {
        eprintln!(
            "tokentrace: automatic mode: watching {} listening process(es) for requests to {}",
            initial.len(),
            config.endpoints.join(", ")
        );
    } else {
        eprintln!("tokentrace: tracing pid(s) {initial:?} and matching processes that start later");
    }
    eprintln!("tokentrace: ready");
    if let Some(ready) = hooks.ready.take() {
        let _ = ready.send(());
    }
    exporter.set_ready();

    let mut pipeline = Pipeline {
        tracker,
        stitcher: Stitcher::new(config.stitch.stitcher_config()),
        printer: Printer {
            format: args.output,
            out: io::stdout(),
        },
        summary: RunSummary::default(),
        probed,
        explainer: Explainer::new(
            u64::try_from(config.explain.stall_threshold.as_nanos()).unwrap_or(u64::MAX),
            u64::try_from(config.explain.history.as_nanos()).unwrap_or(u64::MAX),
        ),
        exporter,
        request_limit: args.requests,
        finished: Vec::new(),
        sessions,
        triggers,
        quiet: hooks.quiet,
    };
    let idle_ns = u64::try_from(config.stitch.idle_timeout.as_nanos()).unwrap_or(u64::MAX);
    let mut sweep = tokio::time::interval(SWEEP_INTERVAL);
    let deadline = args.duration.map(|d| tokio::time::Instant::now() + d);
    // Both handlers are installed once, before the loop: a signal that
    // arrives while a batch is being processed is kept for the next turn
    // (a `ctrl_c()` future created per turn would miss it).
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .context("installing the SIGINT handler")?;

    let stop = loop {
        let until_deadline = async {
            match deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let stop = tokio::select! {
            batch = events_rx.recv() => match batch {
                Some(batch) => pipeline.on_batch(&batch),
                None => Some(Stop::IngestEnded),
            },
            _ = sweep.tick() => {
                let now = monotonic_now();
                pipeline.stitcher.expire_idle(now, idle_ns, &mut pipeline.finished);
                pipeline.explainer.prune(now);
                if let Some(triggers) = &mut pipeline.triggers {
                    triggers.tick(now);
                }
                pipeline.exporter.observe_agent(pipeline.agent_counters());
                let open = pipeline.open_requests();
                pipeline.exporter.observe_in_flight(&open);
                pipeline.report()
            }
            _ = until_deadline => Some(Stop::Duration),
            _ = interrupt.recv() => Some(Stop::Signal),
            _ = terminate.recv() => Some(Stop::Signal),
        };
        if let Some(stop) = stop {
            break stop;
        }
    };

    if matches!(stop, Stop::Duration | Stop::Signal) {
        // Everything the kernel recorded before the stop is stitched first
        // (the ingest thread reads the ring buffer a last time); only then
        // are requests still in flight reported, marked as cut by the agent.
        // Received until the thread ends and the channel closes: the
        // thread waits on a full channel (backpressure) rather than drop.
        pipeline.probed.ingest.request_stop();
        while let Some(batch) = events_rx.recv().await {
            if pipeline.on_batch(&batch).is_some() {
                break;
            }
        }
        pipeline
            .stitcher
            .finish(monotonic_now(), &mut pipeline.finished);
        pipeline.report();
    }
    // Whatever path ended the loop, an ingest thread waiting to send must
    // not block its own join below.
    events_rx.close();
    pipeline.exporter.observe_agent(pipeline.agent_counters());
    let open = pipeline.open_requests();
    pipeline.exporter.observe_in_flight(&open);
    let Pipeline {
        stitcher,
        mut summary,
        exporter,
        sessions,
        triggers,
        ..
    } = pipeline;
    if let Some(sessions) = sessions {
        // Sessions still running end with the run and write their artifacts.
        tokio::task::spawn_blocking(move || sessions.shutdown())
            .await
            .context("waiting for recording sessions to finish")?;
    }
    if let Some(mut triggers) = triggers {
        // The sessions just written count towards the size bound too.
        triggers.tick(monotonic_now());
    }
    if let Some(export) = exporter.shutdown(EXPORT_GRACE).await {
        eprintln!("{export}");
    }
    ingest.stop();
    let losses = ingest.kernel_counters.read().unwrap_or_default();
    summary.kernel_drops = losses.records_lost();
    summary.untraced_forks = losses.traced_full;
    summary.channel_drops = ingest.stats.channel_drops.load(Ordering::Relaxed);
    summary.channel_waits = ingest.stats.channel_waits.load(Ordering::Relaxed);
    summary.decode_errors = ingest.stats.decode_errors.load(Ordering::Relaxed);
    summary.stitch = stitcher.stats().clone();
    if stop == Stop::IngestEnded {
        bail!("the ingest thread stopped unexpectedly (see the log above)");
    }
    Ok(summary)
}
