//! The run loop's synchronous part: each event batch goes to the
//! sessions, the triggers' ring and the [`Pipeline`]; what the pipeline
//! hands back is carried out here, in order: the probes' changes (kernel
//! pid filter, uprobes, /proc scans) and the reported timelines (counted,
//! exported, judged by the triggers, printed).

use std::io::{self, Write};
use std::sync::atomic::Ordering;

use crate::event::{Event, MonoNs};
use crate::export::{AgentCounters, Exporter, Labels};
use crate::live::{agent_status, LiveFeed};
use crate::model::RequestTimeline;
use crate::output::{OutputFormat, RunSummary};
use crate::pipeline::Pipeline;
use crate::session::SessionHub;
use crate::trigger::Triggers;
use crate::units::monotonic_now;

use super::probed::Probed;

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
    /// One write per line: stdout's line buffer is 1 KiB, so `writeln!`
    /// sent a JSON timeline (4 KiB at 200 chunks) and its newline in two.
    fn print(&mut self, timeline: &RequestTimeline) -> io::Result<()> {
        let mut line = self.format.line(timeline);
        line.push('\n');
        let mut out = self.out.lock();
        out.write_all(line.as_bytes())?;
        out.flush()
    }
}

/// The pipeline, and where its results go.
pub(super) struct Stages<'a> {
    pub(super) pipeline: Pipeline,
    pub(super) printer: Printer,
    pub(super) summary: RunSummary,
    pub(super) probed: Probed<'a>,
    pub(super) exporter: Exporter,
    pub(super) request_limit: Option<u64>,
    pub(super) finished: Vec<RequestTimeline>,
    /// Recording sessions tapping the event stream.
    pub(super) sessions: Option<SessionHub>,
    /// SLO triggers starting sessions by themselves.
    pub(super) triggers: Option<Triggers>,
    /// The live view's slowest requests and agent line.
    pub(super) live: Option<LiveFeed>,
    /// Timelines are not printed (`record` shows progress instead).
    pub(super) quiet: bool,
    /// Probes that fail to attach after start leave readiness alone.
    pub(super) allow_degraded: bool,
}

impl Stages<'_> {
    pub(super) fn on_batch(&mut self, batch: &[Event]) -> Option<Stop> {
        self.summary.events += batch.len() as u64;
        if let Some(sessions) = &self.sessions {
            sessions.on_events(batch);
        }
        if let Some(triggers) = &mut self.triggers {
            triggers.on_events(batch, monotonic_now());
        }
        for event in batch {
            self.summary.observe(event);
            self.pipeline.push(event, &mut self.finished);
        }
        self.report()
    }

    /// Carries out the probes' changes, then reports finished timelines.
    pub(super) fn report(&mut self) -> Option<Stop> {
        for change in self.pipeline.take_probe_changes() {
            self.probed.apply(change);
        }
        for timeline in std::mem::take(&mut self.finished) {
            let served = timeline.kind == crate::model::SpanKind::Server;
            // the service and route are worked out once, by the exporter
            let labels = self.exporter.record(&timeline);
            if served {
                self.summary.record(&timeline);
                if let Some(live) = &self.live {
                    live.record(&labels, &timeline);
                }
                self.judge(&labels, &timeline);
            }
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
    fn judge(&mut self, labels: &Labels, timeline: &RequestTimeline) {
        let Some(triggers) = &mut self.triggers else {
            return;
        };
        for firing in triggers.observe(&labels.service, &labels.route, timeline) {
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

    /// The run's counters, for the exporter's self-metrics.
    fn agent_counters(&self) -> AgentCounters {
        let ingest = self.probed.ingest;
        let kernel = ingest.kernel_counters.read().unwrap_or_default();
        let stitch = self.pipeline.stats();
        AgentCounters {
            events_received: self.summary.events,
            events_lost_kernel: kernel.records_lost(),
            untraced_forks: kernel.traced_full,
            events_lost_agent: ingest.stats.channel_drops.load(Ordering::Relaxed),
            decode_errors: ingest.stats.decode_errors.load(Ordering::Relaxed),
            parse_errors: stitch.parse_errors,
            truncated_writes: stitch.truncated_writes,
            open_connections: self.pipeline.open_connections() as u64,
            probe_attach_failures: ingest.attach_failures.counts(),
        }
    }

    /// The periodic sweep: idle connections end, old inference events and
    /// quiet trigger windows are dropped, and the exporter's gauges are
    /// refreshed.
    pub(super) fn sweep(&mut self, now: MonoNs, idle_ns: u64) -> Option<Stop> {
        self.pipeline.tick(now, idle_ns, &mut self.finished);
        if let Some(triggers) = &mut self.triggers {
            triggers.tick(now);
        }
        self.refresh_gauges();
        self.report()
    }

    /// The exporter's self-metrics and in-flight gauges, as of now.
    pub(super) fn refresh_gauges(&mut self) {
        // A process found after start whose probes could not be attached
        // is traced without them: not ready any more (the failure's line
        // is in the log), unless the run may be degraded.
        let failed = self.probed.ingest.attach_failures.take_blocking();
        if !self.allow_degraded && !failed.is_empty() {
            self.exporter.set_unready();
        }
        let counters = self.agent_counters();
        if let Some(live) = &self.live {
            let ingest = self.probed.ingest;
            live.set_agent(agent_status(
                &counters,
                &ingest.attached,
                &ingest.attach_failures,
            ));
        }
        self.exporter.observe_agent(counters);
        let open = self.pipeline.open_requests();
        self.exporter.observe_in_flight(&open);
    }

    /// The agent stopped: requests still in flight come out cut by it.
    pub(super) fn finish(&mut self, now: MonoNs) {
        self.pipeline.finish(now, &mut self.finished);
        self.report();
    }
}
