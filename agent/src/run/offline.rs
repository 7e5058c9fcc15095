//! Ring buffer records through everything `tokentrace run` does with them
//! in userspace, up to the bytes of its output lines, with the sink left to
//! the caller: the whole userspace path per event, measured and profiled
//! offline (`cargo xtask bench replay`, fed by `pipeline::synthetic`
//! traffic) and fuzzed.

use std::io::{self, Write};

use crate::event::MonoNs;
use crate::ingest::decode;
use crate::model::RequestTimeline;
use crate::output::{OutputFormat, RunSummary};

use crate::pipeline::Pipeline;

/// What a replay went through.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReplayCounts {
    pub records: u64,
    pub decode_errors: u64,
    /// Timelines reported (complete or aborted).
    pub requests: u64,
    /// Late chunks the explainer broke down, over all reported timelines.
    pub stalls: u64,
    /// Bytes of output lines written to the sink.
    pub output_bytes: u64,
}

/// Decode → stitch → explain → summary and output lines, into `out`.
///
/// Mirrors the run loop without discovery, probes and export: each
/// finished timeline is explained, recorded in the summary and rendered as
/// the line `--output` would print.
pub struct RecordReplay<W: Write> {
    pipeline: Pipeline,
    summary: RunSummary,
    format: OutputFormat,
    out: W,
    finished: Vec<RequestTimeline>,
    counts: ReplayCounts,
}

impl<W: Write> RecordReplay<W> {
    pub fn new(pipeline: Pipeline, format: OutputFormat, out: W) -> Self {
        Self {
            pipeline,
            summary: RunSummary::default(),
            format,
            out,
            finished: Vec::new(),
            counts: ReplayCounts::default(),
        }
    }

    /// Feeds one ring buffer record. An undecodable one is counted, as the
    /// ingest thread counts it; only the sink's errors are returned.
    pub fn push_record(&mut self, record: &[u8]) -> io::Result<()> {
        self.counts.records += 1;
        match decode(record) {
            Ok(event) => {
                self.summary.events += 1;
                self.summary.observe(&event);
                self.pipeline.push(&event, &mut self.finished);
                self.report()
            }
            Err(_) => {
                self.counts.decode_errors += 1;
                Ok(())
            }
        }
    }

    /// The run loop's periodic sweep at `now`.
    pub fn tick(&mut self, now: MonoNs, idle_ns: u64) -> io::Result<()> {
        self.pipeline.tick(now, idle_ns, &mut self.finished);
        self.report()
    }

    /// Ends the replay at `now` (requests in flight come out aborted) and
    /// returns the summary `tokentrace run` would print.
    pub fn finish(mut self, now: MonoNs) -> io::Result<(RunSummary, ReplayCounts, W)> {
        self.pipeline.finish(now, &mut self.finished);
        self.report()?;
        self.out.flush()?;
        self.summary.decode_errors = self.counts.decode_errors;
        self.summary.stitch = self.pipeline.stats().clone();
        self.summary.hops = self.pipeline.hop_stats().clone();
        Ok((self.summary, self.counts, self.out))
    }

    pub fn counts(&self) -> ReplayCounts {
        self.counts
    }

    fn report(&mut self) -> io::Result<()> {
        for timeline in self.finished.drain(..) {
            if timeline.kind == crate::model::SpanKind::Server {
                self.summary.record(&timeline);
            }
            self.counts.requests += 1;
            self.counts.stalls += timeline.stalls.len() as u64;
            let line = self.format.line(&timeline);
            self.counts.output_bytes += line.len() as u64 + 1;
            writeln!(self.out, "{line}")?;
        }
        Ok(())
    }
}
