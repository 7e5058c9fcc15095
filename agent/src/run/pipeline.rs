//! The run loop's synchronous middle: each event batch goes to the
//! sessions, the triggers' ring, the tracker, the probes' bookkeeping and
//! the stitcher; each finished timeline the tracker wants is explained,
//! counted, exported, judged by the triggers and printed.

use std::io::{self, Write};
use std::path::Path;
use std::sync::atomic::Ordering;

use crate::discover::{Change, Tracker};
use crate::event::{Event, MonoNs};
use crate::explain::Explainer;
use crate::export::{AgentCounters, Exporter};
use crate::output::{text_line, JsonTimeline, OutputFormat, RunSummary};
use crate::session::SessionHub;
use crate::stitch::{RequestTimeline, Stitcher};
use crate::trigger::Triggers;
use crate::units::monotonic_now;

use super::probed::Probed;
use super::PROC;

/// Why the run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stop {
    RequestLimit,
    Duration,
    Signal,
    OutputClosed,
    IngestEnded,
}

/// Writes timelines in the chosen format; a closed stdout ends the run.
pub(super) struct Printer {
    pub(super) format: OutputFormat,
    pub(super) out: io::Stdout,
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

/// Stitching and reporting, fed by the run loop.
pub(super) struct Pipeline<'a> {
    pub(super) tracker: Tracker,
    pub(super) stitcher: Stitcher,
    pub(super) printer: Printer,
    pub(super) summary: RunSummary,
    pub(super) probed: Probed<'a>,
    pub(super) explainer: Explainer,
    pub(super) exporter: Exporter,
    pub(super) request_limit: Option<u64>,
    pub(super) finished: Vec<RequestTimeline>,
    /// Recording sessions tapping the event stream.
    pub(super) sessions: Option<SessionHub>,
    /// SLO triggers starting sessions by themselves.
    pub(super) triggers: Option<Triggers>,
    /// Timelines are not printed (`record` shows progress instead).
    pub(super) quiet: bool,
}

impl Pipeline<'_> {
    pub(super) fn on_batch(&mut self, batch: &[Event]) -> Option<Stop> {
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
    pub(super) fn report(&mut self) -> Option<Stop> {
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
            timeline.engine = self.explainer.engine_view(&timeline);
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

    /// The periodic sweep: idle connections end, old inference events and
    /// quiet trigger windows are dropped, and the exporter's gauges are
    /// refreshed.
    pub(super) fn sweep(&mut self, now: MonoNs, idle_ns: u64) -> Option<Stop> {
        self.stitcher.expire_idle(now, idle_ns, &mut self.finished);
        self.explainer.prune(now);
        if let Some(triggers) = &mut self.triggers {
            triggers.tick(now);
        }
        self.refresh_gauges();
        self.report()
    }

    /// The exporter's self-metrics and in-flight gauges, as of now.
    pub(super) fn refresh_gauges(&mut self) {
        self.exporter.observe_agent(self.agent_counters());
        let open = self.open_requests();
        self.exporter.observe_in_flight(&open);
    }

    /// The agent stopped: requests still in flight come out cut by it.
    pub(super) fn finish(&mut self, now: MonoNs) {
        self.stitcher.finish(now, &mut self.finished);
        self.report();
    }
}
