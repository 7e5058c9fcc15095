//! The pure heart of a session: the events it admitted in, a
//! [`Recording`] out.
//!
//! A session stitches its own copy of the event stream instead of taking
//! the run loop's timelines. That costs a second stitcher while a session
//! runs, and buys two properties the run loop's timelines cannot give:
//! the session's requests are exactly a function of the events (and clock
//! ticks) it saw, so `tokentrace replay raw.pb` reproduces them bit for
//! bit; and a session never touches the state that normal export reports
//! from, so starting or stopping one cannot disturb it. Requests already
//! in flight when a session starts are handled as the stitcher handles
//! connections that predate tracing; requests still in flight at its end
//! come out aborted with reason `agent_stopped`. The session also runs its
//! own [`Explainer`](crate::explain::Explainer) over the same events, so its late chunks carry the
//! same cause breakdowns (`stalls`) the run loop computes.
//!
//! No I/O and no clock reads: the live worker ([`super::hub`]) and
//! [`super::replay`] drive it with the same calls.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::event::{CudaSyncCall, Direction, Event, IoCall, LlmProbe, MonoNs};
use crate::model::trace_context::IdGenerator;
use crate::model::RequestTimeline;
use crate::pipeline::Pipeline;
use crate::stitch::{StitchConfig, StitchStats};

/// Slices (syscalls, off-CPU intervals, CUDA syncs, send-queue holds) and
/// marks kept for the per-thread tracks of `trace.json`. Past it they are
/// counted, not kept: a 30 s session of a busy server stays within tens of
/// megabytes.
pub const MAX_THREAD_SLICES: usize = 200_000;

/// What a session is and how it was set up: enough to render every
/// artifact and to replay it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordingMeta {
    /// The agent version that recorded it.
    pub agent_version: String,
    pub hostname: String,
    /// What the session traced, as the user gave it (`--pid 12`, `all
    /// traced processes`).
    pub selector: String,
    /// CLOCK_MONOTONIC when the session started and ended.
    pub started_ns: MonoNs,
    pub ended_ns: MonoNs,
    /// Unix ns minus monotonic ns, measured when the session started: every
    /// artifact converts with this one offset, so a replay renders the same.
    pub wall_offset_ns: i64,
    /// CPU sampling frequency; 0 when the session did not sample.
    pub profile_hz: u64,
    /// The stitching limits the session ran with.
    pub idle_timeout_ns: u64,
    pub max_buffered_bytes: u64,
    pub max_connections: u64,
    /// The explainer's settings the session ran with.
    pub stall_threshold_ns: u64,
    pub explain_history_ns: u64,
}

impl RecordingMeta {
    /// Unix nanoseconds of a monotonic timestamp.
    pub fn unix_ns(&self, mono: MonoNs) -> i128 {
        i128::from(mono) + i128::from(self.wall_offset_ns)
    }

    pub fn stitch_config(&self) -> StitchConfig {
        StitchConfig {
            max_buffered_bytes: usize::try_from(self.max_buffered_bytes).unwrap_or(usize::MAX),
            max_connections: usize::try_from(self.max_connections).unwrap_or(usize::MAX),
            ..StitchConfig::default()
        }
    }

    pub fn duration_ns(&self) -> u64 {
        self.ended_ns.saturating_sub(self.started_ns)
    }
}

/// Losses and volumes of one session, shown in the report so a reader
/// knows how complete it is.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionCounters {
    /// Events the session admitted (after its selector).
    pub events: u64,
    /// Events the session never saw because its queue was full (the run
    /// loop does not wait for a slow session).
    pub events_dropped: u64,
    /// Slices and marks not kept for thread tracks ([`MAX_THREAD_SLICES`]).
    pub thread_slices_dropped: u64,
    /// CPU samples the kernel could not queue (ring buffer full).
    pub samples_dropped: u64,
    pub parse_errors: u64,
    pub truncated_writes: u64,
}

/// What a thread was doing over a stretch of time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SliceKind {
    /// A read- or write-family call on a socket.
    Io {
        call: IoCall,
        direction: Direction,
        len: u32,
    },
    /// Off-CPU: blocked in `syscall` (None: preempted while runnable).
    OffCpu {
        syscall: Option<u32>,
        in_cuda_sync: bool,
    },
    /// Waiting in a CUDA synchronisation call.
    CudaSync { call: CudaSyncCall, launches: u64 },
    /// Bytes it wrote sat in the socket's send queue until an ACK.
    SendHold { bytes: u32 },
}

/// A stretch of one thread's time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadSlice {
    pub pid: u32,
    pub tid: u32,
    pub start: MonoNs,
    pub end: MonoNs,
    pub kind: SliceKind,
}

/// An `llm:*` USDT probe a thread fired.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadMark {
    pub pid: u32,
    pub tid: u32,
    pub ts: MonoNs,
    pub probe: LlmProbe,
    pub request_id: String,
}

/// A thread seen doing socket I/O or on a CPU sample.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ThreadInfo {
    pub pid: u32,
    pub comm: String,
}

/// Per-thread activity for `trace.json`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Threads {
    /// Keyed by tid; the pid is in the value.
    pub names: BTreeMap<u32, ThreadInfo>,
    pub slices: Vec<ThreadSlice>,
    pub marks: Vec<ThreadMark>,
}

impl Threads {
    pub fn note(&mut self, pid: u32, tid: u32, comm: &str) {
        self.names.entry(tid).or_insert_with(|| ThreadInfo {
            pid,
            comm: comm.to_string(),
        });
    }
}

/// A symbolised CPU profile: every sample and the stacks they point at.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Profile {
    pub frequency_hz: u64,
    /// Folded frames, outermost first; the first frame is the thread's
    /// name, kernel frames end in `_[k]`.
    pub stacks: Vec<Vec<String>>,
    pub samples: Vec<CpuSample>,
}

/// One on-CPU sample, pointing into [`Profile::stacks`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuSample {
    pub ts: MonoNs,
    pub pid: u32,
    pub tid: u32,
    pub stack: u32,
}

impl Profile {
    /// `frame;frame;… count` lines, the input of inferno (and of
    /// `flamegraph.pl`), sorted so output is deterministic.
    pub fn folded(&self) -> Vec<String> {
        let mut counts: BTreeMap<String, u64> = BTreeMap::new();
        for sample in &self.samples {
            if let Some(stack) = self.stacks.get(sample.stack as usize) {
                *counts.entry(stack.join(";")).or_default() += 1;
            }
        }
        counts
            .into_iter()
            .map(|(stack, n)| format!("{stack} {n}"))
            .collect()
    }

    /// Innermost frame of a sample's stack.
    pub fn leaf(&self, sample: &CpuSample) -> Option<&str> {
        self.stacks
            .get(sample.stack as usize)
            .and_then(|s| s.last())
            .map(String::as_str)
    }
}

/// Everything the artifacts are rendered from.
#[derive(Debug, Clone, PartialEq)]
pub struct Recording {
    pub meta: RecordingMeta,
    /// Finished requests, in the order the stitcher finished them.
    pub timelines: Vec<RequestTimeline>,
    pub threads: Threads,
    pub profile: Option<Profile>,
    pub counters: SessionCounters,
}

/// Stitches a session's events and keeps what the artifacts need.
#[derive(Debug)]
pub struct SessionCore {
    pipeline: Pipeline,
    timelines: Vec<RequestTimeline>,
    threads: Threads,
    counters: SessionCounters,
    idle_ns: u64,
}

impl SessionCore {
    /// A core with the stitching and explaining settings of `meta`.
    pub fn new(meta: &RecordingMeta) -> Self {
        Self {
            pipeline: Pipeline::new(
                meta.stitch_config(),
                meta.stall_threshold_ns,
                meta.explain_history_ns,
            )
            .with_ids(IdGenerator::with_seed(
                meta.started_ns ^ meta.wall_offset_ns as u64,
            )),
            timelines: Vec::new(),
            threads: Threads::default(),
            counters: SessionCounters::default(),
            idle_ns: meta.idle_timeout_ns,
        }
    }

    /// Feeds one admitted event.
    pub fn push(&mut self, event: &Event) {
        self.counters.events += 1;
        self.thread_activity(event);
        self.pipeline.push(event, &mut self.timelines);
    }

    fn slice(&mut self, pid: u32, tid: u32, start: MonoNs, end: MonoNs, kind: SliceKind) {
        if self.threads.slices.len() >= MAX_THREAD_SLICES {
            self.counters.thread_slices_dropped += 1;
            return;
        }
        self.threads.slices.push(ThreadSlice {
            pid,
            tid,
            start,
            end: end.max(start),
            kind,
        });
    }

    fn thread_activity(&mut self, event: &Event) {
        match event {
            Event::Data(d) => {
                self.threads.note(d.conn.pid, d.tid, &d.comm);
                let kind = SliceKind::Io {
                    call: d.call,
                    direction: d.direction,
                    len: d.len,
                };
                self.slice(d.conn.pid, d.tid, d.ts_enter, d.ts_exit, kind);
            }
            Event::OffCpu(o) => {
                let kind = SliceKind::OffCpu {
                    syscall: o.syscall,
                    in_cuda_sync: o.in_cuda_sync,
                };
                self.slice(o.pid, o.tid, o.start, o.end, kind);
            }
            Event::CudaSync(c) => {
                let kind = SliceKind::CudaSync {
                    call: c.call,
                    launches: c.kernel_launches.saturating_add(c.graph_launches),
                };
                self.slice(c.pid, c.tid, c.ts_enter, c.ts_exit, kind);
            }
            Event::SendHold(h) => {
                let kind = SliceKind::SendHold {
                    bytes: h.held_bytes,
                };
                self.slice(h.pid, h.tid, h.write_ts, h.release_ts, kind);
            }
            Event::Usdt(u) => {
                if self.threads.marks.len() + self.threads.slices.len() >= MAX_THREAD_SLICES {
                    self.counters.thread_slices_dropped += 1;
                    return;
                }
                self.threads.marks.push(ThreadMark {
                    pid: u.pid,
                    tid: u.tid,
                    ts: u.ts,
                    probe: u.probe,
                    request_id: u.request_id.clone(),
                });
            }
            Event::Accept(_)
            | Event::Close(_)
            | Event::Exec(_)
            | Event::Exit(_)
            | Event::Fork(_)
            | Event::Listen(_)
            | Event::LibraryMapped(_)
            | Event::PeerClosed(_)
            | Event::TlsHandshake(_) => {}
        }
    }

    /// The periodic sweep: connections idle past the limit are dropped,
    /// inference events past the history window forgotten.
    pub fn tick(&mut self, now: MonoNs) {
        self.pipeline.tick(now, self.idle_ns, &mut self.timelines);
    }

    /// Requests finished so far.
    pub fn timelines(&self) -> &[RequestTimeline] {
        &self.timelines
    }

    pub fn counters(&self) -> &SessionCounters {
        &self.counters
    }

    /// Counts events that never reached the session.
    pub fn dropped(&mut self, events: u64) {
        self.counters.events_dropped += events;
    }

    /// Ends the session at `now`: requests in flight come out aborted.
    pub fn finish(
        mut self,
        now: MonoNs,
        meta: RecordingMeta,
        profile: Option<Profile>,
        samples_dropped: u64,
    ) -> Recording {
        self.pipeline.finish(now, &mut self.timelines);
        let StitchStats {
            parse_errors,
            truncated_writes,
            ..
        } = *self.pipeline.stats();
        self.counters.parse_errors = parse_errors;
        self.counters.truncated_writes = truncated_writes;
        self.counters.samples_dropped = samples_dropped;
        if let Some(profile) = &profile {
            for sample in &profile.samples {
                let comm = profile
                    .stacks
                    .get(sample.stack as usize)
                    .and_then(|s| s.first())
                    .map_or("", String::as_str);
                self.threads.note(sample.pid, sample.tid, comm);
            }
        }
        Recording {
            meta,
            timelines: self.timelines,
            threads: self.threads,
            profile,
            counters: self.counters,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::event::{ConnEvent, ConnId, DataEvent, OffCpuEvent, SockAddrs};

    pub(crate) fn meta() -> RecordingMeta {
        RecordingMeta {
            agent_version: "0.1.0".into(),
            hostname: "node-1".into(),
            selector: "--pid 42".into(),
            started_ns: 1_000_000_000,
            ended_ns: 3_000_000_000,
            wall_offset_ns: 1_700_000_000_000_000_000,
            profile_hz: 99,
            idle_timeout_ns: 300_000_000_000,
            max_buffered_bytes: 1 << 20,
            max_connections: 1024,
            stall_threshold_ns: 30_000_000,
            explain_history_ns: 120_000_000_000,
        }
    }

    const CONN: ConnId = ConnId {
        pid: 42,
        fd: 7,
        sock_ino: 99,
    };

    fn addrs() -> Option<SockAddrs> {
        SockAddrs::from_raw(
            2,
            8000,
            50000,
            [127, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            [127, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        )
    }

    fn data(ts: MonoNs, direction: Direction, payload: &[u8]) -> Event {
        let (call, enter, exit) = match direction {
            Direction::Ingress => (IoCall::Read, ts - 1_000, ts),
            Direction::Egress => (IoCall::Write, ts, ts + 1_000),
        };
        Event::Data(DataEvent {
            conn: CONN,
            tid: 43,
            comm: "server".into(),
            ts_enter: enter,
            ts_exit: exit,
            ingress: None,
            marks: Vec::new(),
            direction,
            call,
            len: payload.len() as u32,
            payload: bytes::Bytes::copy_from_slice(payload),
            addrs: addrs(),
            tcp: None,
        })
    }

    /// One SSE request on a fresh connection: `tokens` events 10 ms apart,
    /// starting at `start` (first token 50 ms after the request).
    pub(crate) fn sse_exchange(start: MonoNs, tokens: usize, path: &str) -> Vec<Event> {
        let mut events = vec![Event::Accept(ConnEvent {
            conn: CONN,
            tid: 43,
            comm: "server".into(),
            ts: start - 10_000,
            addrs: addrs(),
            established: None,
        })];
        let req = format!("POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{{}}");
        events.push(data(start, Direction::Ingress, req.as_bytes()));
        let bodies: Vec<String> = (0..tokens)
            .map(|i| format!("data: {{\"id\":\"chatcmpl-{i}\"}}\n\n"))
            .collect();
        let length: usize = bodies.iter().map(String::len).sum();
        let head = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: {length}\r\n\r\n"
        );
        events.push(data(start + 1_000_000, Direction::Egress, head.as_bytes()));
        for (i, body) in bodies.iter().enumerate() {
            events.push(data(
                start + 50_000_000 + i as u64 * 10_000_000,
                Direction::Egress,
                body.as_bytes(),
            ));
        }
        events.push(Event::Close(ConnEvent {
            conn: CONN,
            tid: 43,
            comm: "server".into(),
            ts: start + 60_000_000 + tokens as u64 * 10_000_000,
            addrs: addrs(),
            established: None,
        }));
        events
    }

    pub(crate) fn recording() -> Recording {
        let mut core = SessionCore::new(&meta());
        for (i, start) in [1_100_000_000u64, 1_500_000_000].iter().enumerate() {
            for event in sse_exchange(*start, 3 + i, &format!("/v1/chat/completions?rid={i}")) {
                core.push(&event);
            }
        }
        let profile = Profile {
            frequency_hz: 99,
            stacks: vec![
                vec!["server".into(), "main".into(), "hot_loop".into()],
                vec!["server".into(), "main".into(), "sys_write_[k]".into()],
            ],
            samples: vec![
                CpuSample {
                    ts: 1_150_000_000,
                    pid: 42,
                    tid: 43,
                    stack: 0,
                },
                CpuSample {
                    ts: 1_160_000_000,
                    pid: 42,
                    tid: 43,
                    stack: 0,
                },
                CpuSample {
                    ts: 1_165_000_000,
                    pid: 42,
                    tid: 44,
                    stack: 1,
                },
            ],
        };
        core.finish(3_000_000_000, meta(), Some(profile), 0)
    }

    #[test]
    fn stitches_admitted_events_and_keeps_thread_slices() {
        let rec = recording();
        assert_eq!(rec.timelines.len(), 2);
        assert_eq!(rec.timelines[0].chunk_ts.len(), 3);
        assert_eq!(rec.timelines[1].chunk_ts.len(), 4);
        assert!(rec.timelines.iter().all(|t| !t.aborted));
        assert_eq!(rec.threads.slices.len(), 2 * 2 + 3 + 4);
        // a 50 ms TTFT is over the explainer's 30 ms threshold: chunk 0 is
        // explained (nothing seen: unexplained)
        assert!(rec
            .timelines
            .iter()
            .all(|t| t.stalls.len() == 1 && t.stalls[0].chunk == 0));
        assert_eq!(
            rec.threads.names.len(),
            2,
            "tid 43 from I/O, 44 from samples"
        );
        assert_eq!(rec.counters.events, 2 * 4 + 3 + 4);
    }

    #[test]
    fn requests_in_flight_at_the_end_come_out_aborted() {
        let mut core = SessionCore::new(&meta());
        let events = sse_exchange(1_100_000_000, 3, "/v1/chat/completions");
        for event in &events[..4] {
            core.push(event);
        }
        let rec = core.finish(2_000_000_000, meta(), None, 0);
        assert_eq!(rec.timelines.len(), 1);
        assert!(rec.timelines[0].aborted);
        assert_eq!(rec.timelines[0].end, 2_000_000_000);
    }

    #[test]
    fn late_chunks_get_the_explainers_breakdown() {
        let mut core = SessionCore::new(&meta());
        let mut events = sse_exchange(1_100_000_000, 3, "/v1/chat/completions");
        // the last token 100 ms late; the writer thread off-CPU for 80 ms of it
        let last = events.len() - 2;
        if let Event::Data(d) = &mut events[last] {
            d.ts_enter += 100_000_000;
            d.ts_exit += 100_000_000;
        }
        let gap_start = 1_100_000_000 + 60_000_000;
        events.insert(
            last,
            Event::OffCpu(OffCpuEvent {
                pid: 42,
                tid: 43,
                start: gap_start + 10_000_000,
                end: gap_start + 90_000_000,
                syscall: Some(202),
                state: 1,
                in_cuda_sync: false,
            }),
        );
        if let Some(Event::Close(c)) = events.last_mut() {
            c.ts += 100_000_000;
        }
        for event in &events {
            core.push(event);
        }
        let rec = core.finish(2_000_000_000, meta(), None, 0);
        let stalls = &rec.timelines[0].stalls;
        let late = stalls
            .iter()
            .find(|s| s.chunk == 2)
            .unwrap_or_else(|| panic!("no stall for chunk 2: {stalls:?}"));
        assert_eq!(late.gap_ms, 110.0);
        assert_eq!(late.off_cpu_ms, 80.0);
        assert_eq!(late.off_cpu_reason.as_deref(), Some("futex"));
        assert!(rec.threads.slices.iter().any(|s| matches!(
            s.kind,
            SliceKind::OffCpu {
                syscall: Some(202),
                ..
            }
        )));
    }

    #[test]
    fn folded_stacks_count_samples_per_stack() {
        let rec = recording();
        let profile = rec.profile.expect("profile");
        assert_eq!(
            profile.folded(),
            vec!["server;main;hot_loop 2", "server;main;sys_write_[k] 1"]
        );
        assert_eq!(profile.leaf(&profile.samples[2]), Some("sys_write_[k]"));
    }
}
