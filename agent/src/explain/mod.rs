//! "Why was this token late": joins a finished request's timeline with what
//! the inference probes saw while it was in flight — `llm:*` USDT marks
//! (matched by request id, so an engine in another process counts), CUDA
//! sync waits and off-CPU intervals of the threads that served it, and
//! send-queue holds of its socket — and splits each late chunk's gap into
//! causes.
//!
//! Pure: events in ([`Explainer::observe`]), breakdowns out
//! ([`Explainer::explain`]); the caller supplies time for pruning.

mod engine;
mod history;
mod intervals;

use std::cell::OnceCell;

use foldhash::{HashMap, HashSet};

use crate::model::Stall;

use crate::event::{ConnId, Direction, Event, LlmProbe, MonoNs};
use crate::model::RequestTimeline;
use crate::units::ms;
use history::{Ends, History};
use intervals::Intervals;

/// USDT marks of one request id.
#[derive(Debug, Default)]
struct RequestMarks {
    queued: Option<MonoNs>,
    scheduled: Option<MonoNs>,
    prefill_start: Option<MonoNs>,
    prefill_end: Option<MonoNs>,
    /// Every `request_scheduled` and `request_preempted`, in time order
    /// (at most [`engine::MAX_RESCHEDULES`] each): a preemption lasts until
    /// the next scheduling.
    rescheduled: Vec<MonoNs>,
    preempted: Vec<MonoNs>,
    /// `llm:token` of each token index (the first mark of an index): when
    /// the producer had it. Sorted by index; marks come in index order.
    tokens: Vec<(u64, MonoNs)>,
    /// Threads that fired probes for this request: they serve it.
    threads: HashSet<(u32, u32)>,
    /// Threads that fired `llm:token` for it: they produce its tokens.
    token_threads: HashSet<(u32, u32)>,
    last_ts: MonoNs,
}

#[derive(Debug, Clone, Copy)]
struct Span {
    start: MonoNs,
    end: MonoNs,
}

#[derive(Debug, Clone, Copy)]
struct OffCpu {
    span: Span,
    syscall: Option<u32>,
    preempted: bool,
    in_cuda_sync: bool,
}

#[derive(Debug, Clone, Copy)]
struct SyncWait {
    span: Span,
    launches: u64,
}

#[derive(Debug, Clone, Copy)]
struct Hold {
    write_ts: MonoNs,
    release_ts: MonoNs,
    nodelay: bool,
}

#[derive(Debug, Clone, Copy)]
struct BatchStep {
    ts: MonoNs,
    batch_size: u64,
}

impl Ends for SyncWait {
    fn end(&self) -> MonoNs {
        self.span.end
    }
}

impl Ends for OffCpu {
    fn end(&self) -> MonoNs {
        self.span.end
    }
}

impl Ends for BatchStep {
    fn end(&self) -> MonoNs {
        self.ts
    }
}

impl Ends for Hold {
    fn end(&self) -> MonoNs {
        self.release_ts
    }
}

impl RequestMarks {
    fn token(&self, index: u64) -> Option<MonoNs> {
        self.tokens
            .binary_search_by_key(&index, |&(i, _)| i)
            .ok()
            .map(|at| self.tokens[at].1)
    }

    /// Keeps the first mark of each index.
    fn mark_token(&mut self, index: u64, ts: MonoNs) {
        if self.tokens.last().is_none_or(|&(last, _)| last < index) {
            self.tokens.push((index, ts));
        } else if let Err(at) = self.tokens.binary_search_by_key(&index, |&(i, _)| i) {
            self.tokens.insert(at, (index, ts));
        }
    }
}

/// A thread: (pid, tid).
type Thread = (u32, u32);

/// Recent inference events, bounded by age.
#[derive(Debug)]
pub struct Explainer {
    threshold_ns: u64,
    history_ns: u64,
    requests: HashMap<String, RequestMarks>,
    /// Threads that moved bytes on each connection, each once: a list, not
    /// a set, as a connection has one or a few (a set's hashing on every
    /// data event was 2 % of the agent under the node flood).
    conn_threads: HashMap<ConnId, (Vec<u32>, MonoNs)>,
    /// By thread.
    syncs: History<Thread, SyncWait>,
    off_cpu: History<Thread, OffCpu>,
    /// By process.
    steps: History<u32, BatchStep>,
    /// By socket: (pid, sock_ino).
    holds: History<(u32, u64), Hold>,
    /// Egress writes that left bytes unsent, waiting for their release.
    /// Per socket, the first write that left bytes unsent and whether
    /// TCP_NODELAY was set, until its hold is released: the same one write
    /// the kernel times (one per socket), so this stays bounded.
    unsent_writes: HashMap<(u32, u64), (MonoNs, bool)>,
}

/// How an off-CPU interval is named in a breakdown.
fn off_cpu_reason(o: &OffCpu) -> String {
    if o.in_cuda_sync {
        return "cuda_sync".into();
    }
    if o.preempted {
        return "preempted".into();
    }
    match o.syscall {
        // x86_64 numbers: futex, nanosleep, clock_nanosleep.
        Some(202) => "futex".into(),
        Some(35 | 230) => "sleep".into(),
        // read, write, poll, select, readv, writev, pselect6, ppoll,
        // epoll_wait, epoll_pwait, recvfrom, recvmsg, sendto, sendmsg.
        Some(0 | 1 | 7 | 23 | 19 | 20 | 270 | 271 | 232 | 281 | 441 | 45 | 47 | 44 | 46) => {
            "io".into()
        }
        Some(n) => format!("syscall {n}"),
        None => "preempted".into(),
    }
}

impl Explainer {
    pub fn new(threshold_ns: u64, history_ns: u64) -> Self {
        Self {
            threshold_ns,
            history_ns,
            requests: HashMap::default(),
            conn_threads: HashMap::default(),
            syncs: History::new(),
            off_cpu: History::new(),
            steps: History::new(),
            holds: History::new(),
            unsent_writes: HashMap::default(),
        }
    }

    /// Remembers what the explanation of later timelines needs.
    pub fn observe(&mut self, event: &Event) {
        match event {
            Event::Data(d) => {
                let ts = d.ts_exit;
                let entry = self.conn_threads.entry(d.conn).or_default();
                if !entry.0.contains(&d.tid) {
                    entry.0.push(d.tid);
                }
                entry.1 = ts;
                if let (Direction::Egress, Some(tcp)) = (d.direction, d.tcp) {
                    if tcp.unsent_bytes > 0 {
                        self.unsent_writes
                            .entry((d.conn.pid, d.conn.sock_ino))
                            .or_insert((d.ts_enter, tcp.nodelay));
                    }
                }
            }
            Event::Usdt(u) => {
                if u.probe == LlmProbe::BatchStep {
                    self.steps.push(
                        u.pid,
                        BatchStep {
                            ts: u.ts,
                            batch_size: u.args[1],
                        },
                    );
                    return;
                }
                // Looked up before inserting: a mark of a known request
                // (every token's) costs no copy of its id.
                let marks = match self.requests.get_mut(&u.request_id) {
                    Some(marks) => marks,
                    None => self.requests.entry(u.request_id.clone()).or_default(),
                };
                marks.threads.insert((u.pid, u.tid));
                marks.last_ts = marks.last_ts.max(u.ts);
                if u.probe == LlmProbe::Token {
                    marks.token_threads.insert((u.pid, u.tid));
                    marks.mark_token(u.args[0], u.ts);
                    return;
                }
                // Dated by `at_ns` when the instrumentation learnt of the
                // event late; the earliest mark of a kind is its first.
                let at = u.at();
                let slot = match u.probe {
                    LlmProbe::RequestQueued => &mut marks.queued,
                    LlmProbe::RequestScheduled => {
                        engine::insert_sorted(&mut marks.rescheduled, at);
                        &mut marks.scheduled
                    }
                    LlmProbe::RequestPreempted => {
                        engine::insert_sorted(&mut marks.preempted, at);
                        return;
                    }
                    LlmProbe::PrefillStart => &mut marks.prefill_start,
                    LlmProbe::PrefillEnd => &mut marks.prefill_end,
                    _ => return,
                };
                *slot = Some(slot.map_or(at, |first| first.min(at)));
            }
            Event::CudaSync(c) => self.syncs.push(
                (c.pid, c.tid),
                SyncWait {
                    span: Span {
                        start: c.ts_enter,
                        end: c.ts_exit,
                    },
                    launches: c.kernel_launches.saturating_add(c.graph_launches),
                },
            ),
            Event::OffCpu(o) => self.off_cpu.push(
                (o.pid, o.tid),
                OffCpu {
                    span: Span {
                        start: o.start,
                        end: o.end,
                    },
                    syscall: o.syscall,
                    preempted: o.state == 0,
                    in_cuda_sync: o.in_cuda_sync,
                },
            ),
            Event::SendHold(h) => {
                let nodelay = self
                    .unsent_writes
                    .remove(&(h.pid, h.sock_ino))
                    .is_none_or(|(_, nodelay)| nodelay);
                self.holds.push(
                    (h.pid, h.sock_ino),
                    Hold {
                        write_ts: h.write_ts,
                        release_ts: h.release_ts,
                        nodelay,
                    },
                );
            }
            Event::Close(c) => {
                // The connection's writers are kept (pruned by age like the
                // rest): the close is often observed before the timeline it
                // finishes is explained (same batch), and the writer side
                // must still be known then.
                self.unsent_writes.remove(&(c.conn.pid, c.conn.sock_ino));
            }
            _ => {}
        }
    }

    /// Forgets events older than the history window.
    pub fn prune(&mut self, now: MonoNs) {
        let cutoff = now.saturating_sub(self.history_ns);
        self.syncs.prune(cutoff);
        self.off_cpu.prune(cutoff);
        self.steps.prune(cutoff);
        self.holds.prune(cutoff);
        self.requests.retain(|_, m| m.last_ts >= cutoff);
        self.conn_threads.retain(|_, (_, last)| *last >= cutoff);
        self.unsent_writes.retain(|_, (ts, _)| *ts >= cutoff);
    }

    /// Cause breakdowns of the chunks of `t` that were late.
    ///
    /// When the request's producer fired `llm:token` for a chunk, its gap
    /// is split there: before the mark the producer's threads (the engine)
    /// were making the token, after it the threads writing the connection
    /// (the frontend) were delivering it, and each part is explained by the
    /// threads on that side only. A frontend idle while the engine computes,
    /// or an engine running ahead while the frontend stalls, is then not
    /// blamed. Without marks the whole gap is explained by every serving
    /// thread.
    pub fn explain(&self, t: &RequestTimeline) -> Vec<Stall> {
        // Which chunks were late comes first, and is cheap: most requests
        // have none, and then nothing else is looked at.
        let mut holds: Vec<&Hold> = if t.conn.is_tls() {
            Vec::new()
        } else {
            self.holds
                .of(&(t.conn.pid, t.conn.sock_ino))
                .map(|(_, h)| h)
                .collect()
        };
        // The chunks' gaps follow one another, so one cursor over the holds
        // in write order finds each gap's first hold: a scan of every hold
        // per chunk was chunks × holds (14 % of the agent's CPU under an
        // SSE flood of 2,000-chunk responses).
        holds.sort_by_key(|h| h.write_ts);
        let mut next_hold = 0;
        let late: Vec<Late> = t
            .chunk_ts
            .iter()
            .enumerate()
            .filter_map(|(i, &emit)| {
                let start = if i == 0 {
                    t.request_start
                } else {
                    t.chunk_ts[i - 1]
                };
                let gap = emit.saturating_sub(start);
                while holds.get(next_hold).is_some_and(|h| h.write_ts <= start) {
                    next_hold += 1;
                }
                let hold = holds.get(next_hold).filter(|h| h.write_ts <= emit).copied();
                let socket_ns = hold.map_or(0, |h| h.release_ts.saturating_sub(h.write_ts));
                (gap >= self.threshold_ns || socket_ns >= self.threshold_ns).then_some(Late {
                    chunk: i,
                    start,
                    emit,
                    hold,
                    socket_ns,
                })
            })
            .collect();
        if late.is_empty() {
            return Vec::new();
        }

        let marks = t
            .response_id
            .as_deref()
            .and_then(|id| self.requests.get(id));
        let writers: HashSet<Thread> = self
            .conn_threads
            .get(&t.conn)
            .map(|(tids, _)| tids.iter().map(|&tid| (t.conn.pid, tid)).collect())
            .unwrap_or_default();
        // The threads that produced its tokens when they are known: a thread
        // that only queued the request (an input loop, idle and off-CPU
        // between requests) would make every gap off-CPU.
        let producers: HashSet<Thread> = marks
            .map(|m| {
                let serving = if m.token_threads.is_empty() {
                    &m.threads
                } else {
                    &m.token_threads
                };
                serving.difference(&writers).copied().collect()
            })
            .unwrap_or_default();
        let everyone: HashSet<Thread> = writers.union(&producers).copied().collect();
        let engine_pids: HashSet<u32> = producers.iter().map(|&(pid, _)| pid).collect();
        let mark_span = |a: Option<MonoNs>, b: Option<MonoNs>| match (a, b) {
            (Some(a), Some(b)) => Intervals::union_of([(a, b)]),
            _ => Intervals::default(),
        };
        let queue = marks.map_or_else(Intervals::default, |m| mark_span(m.queued, m.scheduled));
        let preempted = marks.map_or_else(Intervals::default, |m| {
            Intervals::union_of(engine::preempted_spans(m, t.end))
        });
        let flow_control = Intervals::union_of(t.flow_control_waits.iter().copied());
        let prefill = marks.map_or_else(Intervals::default, |m| {
            mark_span(m.prefill_start, m.prefill_end)
        });
        let on_producer_side = if producers.is_empty() {
            &everyone
        } else {
            &producers
        };
        // Events that ended before the earliest gap began share nothing
        // with any gap: only the rest of each thread's history is read.
        let window_start = late
            .iter()
            .map(|l| l.start)
            .min()
            .unwrap_or(t.request_start);
        let sides: [(&HashSet<Thread>, OnceCell<ThreadCauses>); 3] = [
            (on_producer_side, OnceCell::new()),
            (&writers, OnceCell::new()),
            (&everyone, OnceCell::new()),
        ];
        let side = |n: usize| {
            let (threads, causes) = &sides[n];
            causes.get_or_init(|| ThreadCauses::of(self, threads, window_start))
        };

        let mut stalls = Vec::with_capacity(late.len());
        for Late {
            chunk: i,
            start,
            emit,
            hold,
            socket_ns,
        } in late
        {
            let gap = emit.saturating_sub(start);
            let produced = marks.and_then(|m| engine::split_mark(m, i as u64, start, emit));
            let segments: Vec<(MonoNs, MonoNs, &ThreadCauses)> = match produced {
                Some(ts) => vec![(start, ts, side(0)), (ts, emit, side(1))],
                None => vec![(start, emit, side(2))],
            };
            let mut totals = Breakdown::default();
            let mut reasons: Vec<(u64, String)> = Vec::new();
            for (from, to, side) in segments {
                let mut covered = Intervals::default();
                let mut share = |causes: &Intervals| -> (u64, Intervals) {
                    let part = causes.clip(from, to).minus(&covered);
                    covered = Intervals::union_of(covered.iter().chain(part.iter()).copied());
                    (part.total(), part)
                };
                totals.queue += share(&queue).0;
                totals.preempted += share(&preempted).0;
                totals.prefill += share(&prefill).0;
                totals.gpu += share(&side.gpu).0;
                totals.flow_control += share(&flow_control).0;
                let (off_ns, off_part) = share(&side.off);
                totals.off_cpu += off_ns;
                // Only intervals that reach into the segment can share it.
                let reaching = side
                    .off_cpu
                    .iter()
                    .filter(|o| o.span.end > from && o.span.start < to);
                reasons.extend(reaching.filter_map(|o| {
                    let mine = Intervals::union_of([(o.span.start, o.span.end)]);
                    let overlap = off_part.minus(&off_part.minus(&mine)).total();
                    (overlap > 0).then(|| (overlap, off_cpu_reason(o)))
                }));
                totals.launches += side
                    .syncs
                    .iter()
                    .filter(|s| s.span.end > from && s.span.end <= to)
                    .map(|s| s.launches)
                    .sum::<u64>();
            }
            let reason = reasons
                .into_iter()
                .max_by_key(|(overlap, _)| *overlap)
                .map(|(_, r)| r);
            let explained = totals.queue
                + totals.preempted
                + totals.prefill
                + totals.gpu
                + totals.flow_control
                + totals.off_cpu;
            let batch_fan_in = engine_pids
                .iter()
                .flat_map(|pid| self.steps.ending_after(pid, start))
                .filter(|(_, s)| s.ts > start && s.ts <= emit)
                .map(|(_, s)| s.batch_size)
                .max();
            stalls.push(Stall {
                chunk: i,
                start_ms: ms(start.saturating_sub(t.request_start)),
                gap_ms: ms(gap),
                queue_ms: ms(totals.queue),
                preempted_ms: ms(totals.preempted),
                prefill_ms: ms(totals.prefill),
                gpu_sync_ms: ms(totals.gpu),
                flow_control_ms: ms(totals.flow_control),
                off_cpu_ms: ms(totals.off_cpu),
                off_cpu_reason: reason,
                socket_ms: ms(socket_ns),
                nagle: hold.is_some_and(|h| !h.nodelay),
                unexplained_ms: ms(gap.saturating_sub(explained)),
                batch_fan_in,
                gpu_launches: totals.launches,
                engine_ms: produced.map(|ts| ms(ts.saturating_sub(start))),
                frontend_ms: produced.map(|ts| ms(emit.saturating_sub(ts))),
            });
        }
        stalls
    }
}

/// A chunk whose gap, or the send-queue hold after its write, reached the
/// threshold.
struct Late<'a> {
    chunk: usize,
    start: MonoNs,
    emit: MonoNs,
    hold: Option<&'a Hold>,
    socket_ns: u64,
}

/// Nanoseconds of a gap per cause.
#[derive(Debug, Default)]
struct Breakdown {
    queue: u64,
    preempted: u64,
    prefill: u64,
    gpu: u64,
    flow_control: u64,
    off_cpu: u64,
    launches: u64,
}

/// The GPU waits and off-CPU intervals of a set of threads.
struct ThreadCauses<'a> {
    syncs: Vec<&'a SyncWait>,
    gpu: Intervals,
    off_cpu: Vec<&'a OffCpu>,
    off: Intervals,
}

impl<'a> ThreadCauses<'a> {
    /// Of the events of `threads` that ended after `after`, in arrival
    /// order (which decides between equal off-CPU shares).
    fn of(ex: &'a Explainer, threads: &HashSet<Thread>, after: MonoNs) -> Self {
        let mut syncs: Vec<&(u64, SyncWait)> = threads
            .iter()
            .flat_map(|thread| ex.syncs.ending_after(thread, after))
            .collect();
        syncs.sort_unstable_by_key(|(arrival, _)| *arrival);
        let mut off_cpu: Vec<&(u64, OffCpu)> = threads
            .iter()
            .flat_map(|thread| ex.off_cpu.ending_after(thread, after))
            .collect();
        off_cpu.sort_unstable_by_key(|(arrival, _)| *arrival);
        let syncs: Vec<&SyncWait> = syncs.into_iter().map(|(_, s)| s).collect();
        let off_cpu: Vec<&OffCpu> = off_cpu.into_iter().map(|(_, o)| o).collect();
        Self {
            gpu: Intervals::union_of(syncs.iter().map(|s| (s.span.start, s.span.end))),
            off: Intervals::union_of(off_cpu.iter().map(|o| (o.span.start, o.span.end))),
            syncs,
            off_cpu,
        }
    }
}

#[cfg(test)]
mod tests;
