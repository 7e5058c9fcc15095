//! The pure middle of the agent: events in, explained request timelines
//! out. [`Pipeline`] stitches and explains; [`RecordReplay`] adds what sits
//! on either side of it in `tokentrace run` (decoding ring buffer records,
//! the run summary, rendering each timeline as an output line) with the
//! sinks left to the caller, so the whole userspace path per event can be
//! measured and profiled offline (`cargo xtask bench replay`, fed by
//! [`synthetic`] traffic).
//!
//! No I/O, no clock reads: time comes from the events and from the
//! caller's ticks, so a run is a function of its input.

mod records;
pub mod synthetic;

pub use records::{RecordReplay, ReplayCounts};

use crate::event::{Event, MonoNs};
use crate::explain::Explainer;
use crate::stitch::{RequestTimeline, StitchConfig, StitchStats, Stitcher};

/// A stitcher and the explainer that annotates what it finishes.
#[derive(Debug)]
pub struct Pipeline {
    stitcher: Stitcher,
    explainer: Explainer,
    /// Finished by the stitcher, not yet explained.
    pending: Vec<RequestTimeline>,
}

impl Pipeline {
    pub fn new(stitch: StitchConfig, stall_threshold_ns: u64, history_ns: u64) -> Self {
        Self {
            stitcher: Stitcher::new(stitch),
            explainer: Explainer::new(stall_threshold_ns, history_ns),
            pending: Vec::new(),
        }
    }

    /// Feeds one event (in [`Event::order_ts`] order); the timelines it
    /// finished are appended to `out`, explained.
    pub fn push(&mut self, event: &Event, out: &mut Vec<RequestTimeline>) {
        // The explainer sees an event before the timelines it may finish,
        // as in the run loop.
        self.explainer.observe(event);
        self.stitcher.push(event, &mut self.pending);
        self.explain_pending(out);
    }

    /// The periodic sweep: connections idle past `idle_ns` are dropped
    /// (their requests come out aborted), inference events past the
    /// history window forgotten.
    pub fn tick(&mut self, now: MonoNs, idle_ns: u64, out: &mut Vec<RequestTimeline>) {
        self.stitcher.expire_idle(now, idle_ns, &mut self.pending);
        self.explain_pending(out);
        self.explainer.prune(now);
    }

    /// Ends at `now`: requests in flight come out aborted.
    pub fn finish(&mut self, now: MonoNs, out: &mut Vec<RequestTimeline>) {
        self.stitcher.finish(now, &mut self.pending);
        self.explain_pending(out);
    }

    pub fn stats(&self) -> &StitchStats {
        self.stitcher.stats()
    }

    fn explain_pending(&mut self, out: &mut Vec<RequestTimeline>) {
        for mut timeline in self.pending.drain(..) {
            timeline.stalls = self.explainer.explain(&timeline);
            timeline.engine = self.explainer.engine_view(&timeline);
            out.push(timeline);
        }
    }
}
