//! The pure middle of the agent: events in, explained request timelines
//! out (joined into traces across hops by [`crate::hops`]), used alike by `tokentrace run`, recording sessions and replays.
//! [`Pipeline`] stitches and explains; in a run it also holds the
//! discovery [`Tracker`], which decides which processes are traced and
//! which finished requests are reported, and hands what the probes must do
//! about it back as [`ProbeChange`]s for the run to carry out.
//! [`synthetic`] makes ring buffer records of LLM traffic for benchmarks
//! and tests (`run::RecordReplay` takes them through the whole run).
//!
//! No clock reads, and no I/O but one: matching an exec'd process by
//! `--exe`/`--comm` reads its /proc entry (its resolved executable and
//! command line are not in the event). Time comes from the events and the
//! caller's ticks, so a session or replay is a function of its input.

pub mod synthetic;
#[cfg(test)]
mod tests;

use std::path::PathBuf;

use crate::discover::{Change, Tracker};
use crate::event::{Event, MonoNs};
use crate::explain::Explainer;
use crate::hops::{HopStats, Hops};
use crate::model::trace_context::IdGenerator;
use crate::model::OpenRequest;
use crate::model::RequestTimeline;
use crate::model::SpanKind;
use crate::stitch::{StitchConfig, StitchStats, Stitcher};

/// What the probes must do about the traced processes, in the order the
/// events that call for it came.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeChange {
    /// Start tracing a process (the kernel's pid filter, what it forked
    /// before, the uprobes of the files it maps).
    Trace(u32),
    /// Stop tracing it: it serves no LLM endpoint.
    Untrace(u32),
    /// It mapped a library, or was just forked: find the probed files it
    /// maps (a fork copies breakpoints, not uprobes).
    Rescan(u32),
    /// It exited: its uprobes go.
    Exited(u32),
}

/// Discovery in a run: the tracker and where it reads /proc.
#[derive(Debug)]
struct Discovery {
    tracker: Tracker,
    proc_root: PathBuf,
    /// Not yet taken by the caller.
    changes: Vec<ProbeChange>,
}

/// A stitcher and the explainer that annotates what it finishes, and in a
/// run the tracker that decides what is traced and reported.
#[derive(Debug)]
pub struct Pipeline {
    stitcher: Stitcher,
    explainer: Explainer,
    hops: Hops,
    discovery: Option<Discovery>,
    /// Finished by the stitcher, not yet reviewed and explained.
    pending: Vec<RequestTimeline>,
}

impl Pipeline {
    /// Reports every request it finishes (a session, a replay). Its trace
    /// and span ids come from a fixed seed, so the same input gives the
    /// same output; [`Self::with_ids`] gives others.
    pub fn new(stitch: StitchConfig, stall_threshold_ns: u64, history_ns: u64) -> Self {
        Self {
            stitcher: Stitcher::new(stitch),
            explainer: Explainer::new(stall_threshold_ns, history_ns),
            hops: Hops::new(IdGenerator::with_seed(0)),
            discovery: None,
            pending: Vec::new(),
        }
    }

    /// Trace and span ids from `ids` (a run's: random; a session's: seeded
    /// by its start, so its replay names the same ids).
    pub fn with_ids(mut self, ids: IdGenerator) -> Self {
        self.hops = Hops::new(ids);
        self
    }

    /// A run's pipeline: `tracker` decides which processes are traced
    /// (reading `proc_root` for an exec it must match) and which finished
    /// requests are reported; what the probes must do comes out of
    /// [`Self::take_probe_changes`].
    pub fn with_tracker(mut self, tracker: Tracker, proc_root: PathBuf) -> Self {
        self.discovery = Some(Discovery {
            tracker,
            proc_root,
            changes: Vec::new(),
        });
        self
    }

    /// Feeds one event (in [`Event::order_ts`] order); the timelines it
    /// finished (and the tracker reports) are appended to `out`, explained.
    pub fn push(&mut self, event: &Event, out: &mut Vec<RequestTimeline>) {
        if let Some(discovery) = &mut self.discovery {
            discovery.on_event(event);
        }
        // The explainer sees an event before the timelines it may finish.
        self.explainer.observe(event);
        self.stitcher.push(event, &mut self.pending);
        self.explain_pending(out);
    }

    /// What the probes must do, in order, since the last call.
    pub fn take_probe_changes(&mut self) -> Vec<ProbeChange> {
        self.discovery
            .as_mut()
            .map(|d| std::mem::take(&mut d.changes))
            .unwrap_or_default()
    }

    /// Requests in flight the run would report, for the in-flight gauges.
    pub fn open_requests(&self) -> Vec<OpenRequest> {
        let mut open = self.stitcher.open_requests();
        if let Some(discovery) = &self.discovery {
            open.retain(|r| discovery.tracker.reports_path(&r.path));
        }
        open
    }

    pub fn open_connections(&self) -> usize {
        self.stitcher.open_connections()
    }

    /// The periodic sweep: connections idle past `idle_ns` are dropped
    /// (their requests come out aborted), inference events past the
    /// history window forgotten.
    pub fn tick(&mut self, now: MonoNs, idle_ns: u64, out: &mut Vec<RequestTimeline>) {
        self.stitcher.expire_idle(now, idle_ns, &mut self.pending);
        self.explain_pending(out);
        self.hops.expire(now, out);
        self.explainer.prune(now);
    }

    /// Ends at `now`: requests in flight come out aborted.
    pub fn finish(&mut self, now: MonoNs, out: &mut Vec<RequestTimeline>) {
        self.stitcher.finish(now, &mut self.pending);
        self.explain_pending(out);
        self.hops.flush(out);
    }

    /// The hop join's counters.
    pub fn hop_stats(&self) -> &HopStats {
        self.hops.stats()
    }

    pub fn stats(&self) -> &StitchStats {
        self.stitcher.stats()
    }

    fn explain_pending(&mut self, out: &mut Vec<RequestTimeline>) {
        for mut timeline in self.pending.drain(..) {
            if let Some(discovery) = &mut self.discovery {
                let (report, untraced) = discovery.review(&timeline);
                if let Some(pid) = untraced {
                    self.stitcher.forget_process(pid);
                }
                if !report {
                    continue;
                }
            }
            if timeline.kind == SpanKind::Server {
                // stall causes and the engine's account are the server's
                timeline.stalls = self.explainer.explain(&timeline);
                timeline.engine = self.explainer.engine_view(&timeline);
            }
            let answers = timeline
                .addrs
                .is_some_and(|a| self.stitcher.answers_traced_client(&a));
            self.hops.push(timeline, answers, out);
        }
    }
}

impl From<Change> for ProbeChange {
    fn from(change: Change) -> Self {
        match change {
            Change::Trace(pid) => ProbeChange::Trace(pid),
            Change::Untrace(pid) => ProbeChange::Untrace(pid),
        }
    }
}

impl Discovery {
    fn on_event(&mut self, event: &Event) {
        if let Some(change) = self.tracker.on_event(event, &self.proc_root) {
            self.changes.push(change.into());
        }
        match event {
            Event::LibraryMapped(mapped) => self.changes.push(ProbeChange::Rescan(mapped.pid)),
            Event::Fork(fork) => self.changes.push(ProbeChange::Rescan(fork.pid)),
            Event::Exit(exit) => self.changes.push(ProbeChange::Exited(exit.pid)),
            _ => {}
        }
    }

    /// Whether a finished request is reported, and the process the tracker
    /// stopped tracing because of it.
    fn review(&mut self, timeline: &RequestTimeline) -> (bool, Option<u32>) {
        let (report, change) = self.tracker.review(timeline);
        let Some(change) = change else {
            return (report, None);
        };
        self.changes.push(change.into());
        match change {
            Change::Untrace(pid) => (report, Some(pid)),
            Change::Trace(_) => (report, None),
        }
    }
}
