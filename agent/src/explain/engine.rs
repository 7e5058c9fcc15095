//! The engine's own account of a request: queue, prefill, preemption and
//! which batch steps served it, from its `llm:*` marks. Engine stamps can
//! arrive after the fact (`at_ns`), so every mark list is kept sorted by
//! time rather than by arrival.

use super::{Explainer, RequestMarks};
use crate::event::MonoNs;
use crate::model::EngineView;
use crate::model::RequestTimeline;
use crate::units::ms;

/// Schedulings and preemptions kept per request: a request thrashing in
/// and out of the KV cache must not grow the marks without bound.
pub(super) const MAX_RESCHEDULES: usize = 64;

/// Inserts `ts` in order; beyond [`MAX_RESCHEDULES`] marks the newest are
/// dropped (the first ones decide queue time and the early preemptions).
pub(super) fn insert_sorted(marks: &mut Vec<MonoNs>, ts: MonoNs) {
    if marks.len() >= MAX_RESCHEDULES {
        return;
    }
    let at = marks.partition_point(|&m| m <= ts);
    marks.insert(at, ts);
}

/// Each preemption, until the next scheduling after it (else the next
/// token after it, else `end`).
pub(super) fn preempted_spans(m: &RequestMarks, end: MonoNs) -> Vec<(MonoNs, MonoNs)> {
    m.preempted
        .iter()
        .map(|&p| {
            let next_scheduled = m
                .rescheduled
                .get(m.rescheduled.partition_point(|&s| s <= p));
            let next_token = || m.tokens.iter().map(|&(_, ts)| ts).find(|&ts| ts > p);
            let until = next_scheduled.copied().or_else(next_token).unwrap_or(end);
            (p, until.max(p))
        })
        .collect()
}

/// Where a late chunk's gap `(start, emit)` splits between engine and
/// frontend: the mark of token `index` when it lies inside, else the last
/// token mark inside. Servers whose chunk i is not token i (vLLM sends an
/// empty role chunk first, and merges tokens when its frontend lags) still
/// split at the last token the engine had made before the chunk went out.
pub(super) fn split_mark(
    m: &RequestMarks,
    index: u64,
    start: MonoNs,
    emit: MonoNs,
) -> Option<MonoNs> {
    let inside = |ts: &MonoNs| *ts > start && *ts < emit;
    m.token(index).filter(inside).or_else(|| {
        m.tokens
            .iter()
            .rev()
            .map(|&(_, ts)| ts)
            .find(|&ts| ts < emit)
            .filter(inside)
    })
}

impl Explainer {
    /// The engine's view of `t`, when its engine fired marks for its id.
    pub fn engine_view(&self, t: &RequestTimeline) -> Option<EngineView> {
        let m = self.requests.get(t.response_id.as_deref()?)?;
        let span = |a: Option<MonoNs>, b: Option<MonoNs>| match (a, b) {
            (Some(a), Some(b)) => Some(ms(b.saturating_sub(a))),
            _ => None,
        };
        let preempted_ns: u64 = preempted_spans(m, t.end)
            .iter()
            .map(|(from, to)| to - from)
            .sum();
        let (batch_steps, batch_fan_in) = self.steps_serving(m);
        Some(EngineView {
            queue_ms: span(m.queued, m.scheduled),
            prefill_ms: span(m.prefill_start, m.prefill_end),
            batch_fan_in,
            batch_steps,
            preemptions: m.preempted.len() as u64,
            preempted_ms: ms(preempted_ns),
        })
    }

    /// The batch steps that produced this request's tokens: the producer
    /// fires `token` for each request of a step, then that step's
    /// `batch_step`, from one thread, so a token's step is the first step
    /// of its process at or after the token's mark. Returns how many
    /// distinct steps, and the largest batch among them.
    fn steps_serving(&self, m: &RequestMarks) -> (u64, Option<u64>) {
        let Some(&(_, first)) = m.tokens.first() else {
            return (0, None);
        };
        let mut pids: Vec<u32> = m.token_threads.iter().map(|&(pid, _)| pid).collect();
        pids.sort_unstable();
        pids.dedup();
        let mut steps: Vec<(MonoNs, u64)> = pids
            .iter()
            .flat_map(|pid| self.steps.ending_after(pid, first.saturating_sub(1)))
            .map(|(_, s)| (s.ts, s.batch_size))
            .collect();
        steps.sort_unstable();
        let mut served: Vec<usize> = m
            .tokens
            .iter()
            .filter_map(|&(_, ts)| {
                let at = steps.partition_point(|&(step_ts, _)| step_ts < ts);
                (at < steps.len()).then_some(at)
            })
            .collect();
        served.sort_unstable();
        served.dedup();
        let fan_in = served.iter().map(|&at| steps[at].1).max();
        (served.len() as u64, fan_in)
    }
}
