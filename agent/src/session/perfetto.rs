//! `trace.json`: the Chrome trace-event format, which ui.perfetto.dev and
//! chrome://tracing open directly.
//!
//! Two groups of tracks:
//! - "Requests" (a synthetic process, [`REQUESTS_PID`]): one track per
//!   request, with a `request` slice holding its phases (`receive`,
//!   `to first token`, `stream`) and one instant per token (chunk) emit.
//!   Late chunks the explainer broke down get a `stall` slice over their
//!   gap, named after the largest cause, with the breakdown in its args.
//! - one process per traced pid, one track per thread: a slice per socket
//!   read/write syscall (enter to exit, bytes in the args), per off-CPU
//!   interval, per CUDA synchronisation wait and per send-queue hold, an
//!   instant per `llm:*` USDT probe and per on-CPU sample (with the
//!   innermost frame).
//!
//! Timestamps are microseconds since the session start (the wall-clock
//! start is in `otherData`); slices on a track nest by time, which is what
//! the viewers expect.

use serde_json::{json, Value};

use super::core::{Recording, SliceKind};
use super::csv::rfc3339;
use crate::event::{Direction, IoCall, MonoNs};
use crate::model::RequestTimeline;
use crate::model::Stall;
use crate::units::ms;

/// Process id of the synthetic "Requests" process. Above any real pid
/// (`pid_max` is at most 2^22).
pub const REQUESTS_PID: u64 = 1 << 30;

struct Clock {
    base: MonoNs,
}

impl Clock {
    /// Microseconds since the session start, with nanosecond precision.
    fn us(&self, ts: MonoNs) -> f64 {
        (ts as f64 - self.base as f64) / 1_000.0
    }

    fn dur(from: MonoNs, to: MonoNs) -> f64 {
        to.saturating_sub(from) as f64 / 1_000.0
    }
}

fn metadata(name: &str, pid: u64, tid: u64, args: Value) -> Value {
    json!({"ph": "M", "name": name, "pid": pid, "tid": tid, "args": args})
}

fn slice(name: &str, pid: u64, tid: u64, ts: f64, dur: f64, args: Value) -> Value {
    json!({"ph": "X", "name": name, "cat": "request", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args})
}

fn call_name(call: IoCall) -> &'static str {
    match call {
        IoCall::Read => "read",
        IoCall::Readv => "readv",
        IoCall::Recvfrom => "recvfrom",
        IoCall::Recvmsg => "recvmsg",
        IoCall::Write => "write",
        IoCall::Writev => "writev",
        IoCall::Sendto => "sendto",
        IoCall::Sendmsg => "sendmsg",
        IoCall::Sendfile => "sendfile",
        IoCall::SslRead => "SSL_read",
        IoCall::SslWrite => "SSL_write",
    }
}

/// The label of a request's track: `#3 POST /v1/chat/completions 200`.
pub fn request_label(index: usize, t: &RequestTimeline) -> String {
    let status = t.status.map_or_else(|| "-".to_string(), |s| s.to_string());
    format!("#{} {} {} {status}", index + 1, t.method, t.path)
}

fn request_events(index: usize, t: &RequestTimeline, clock: &Clock, out: &mut Vec<Value>) {
    let pid = REQUESTS_PID;
    let tid = index as u64 + 1;
    out.push(metadata(
        "thread_name",
        pid,
        tid,
        json!({"name": request_label(index, t)}),
    ));
    out.push(metadata(
        "thread_sort_index",
        pid,
        tid,
        json!({"sort_index": index}),
    ));
    let first = t.ttft_ns().map(|ttft| t.request_start + ttft);
    let mut args = json!({
        "pid": t.conn.pid,
        "fd": t.conn.fd,
        "status": t.status,
        "chunks": t.chunk_ts.len(),
        "ttft_ms": t.ttft_ns().map(ms),
        "e2e_ms": ms(t.e2e_ns()),
        "aborted": t.aborted,
    });
    for (key, value) in [
        ("response_id", t.response_id.as_deref()),
        ("model", t.model.as_deref()),
        ("traceparent", t.traceparent.as_deref()),
    ] {
        if let (Some(value), Some(map)) = (value, args.as_object_mut()) {
            map.insert(key.into(), json!(value));
        }
    }
    if let (Some(reason), Some(map)) = (t.abort_reason, args.as_object_mut()) {
        map.insert("abort_reason".into(), json!(reason));
    }
    let end = t.end.max(t.request_start);
    out.push(slice(
        "request",
        pid,
        tid,
        clock.us(t.request_start),
        Clock::dur(t.request_start, end),
        args,
    ));
    let read_start = t.read_start.clamp(t.request_start, end);
    if read_start > t.request_start {
        out.push(slice(
            "wait in socket",
            pid,
            tid,
            clock.us(t.request_start),
            Clock::dur(t.request_start, read_start),
            json!({}),
        ));
    }
    let request_end = t.request_end.clamp(read_start, end);
    out.push(slice(
        "receive",
        pid,
        tid,
        clock.us(read_start),
        Clock::dur(read_start, request_end),
        json!({"bytes": t.request_bytes}),
    ));
    let first = first.map(|f| f.clamp(request_end, end));
    let wait_end = first.unwrap_or(end);
    out.push(slice(
        "to first token",
        pid,
        tid,
        clock.us(request_end),
        Clock::dur(request_end, wait_end),
        json!({}),
    ));
    if let Some(first) = first {
        out.push(slice(
            "stream",
            pid,
            tid,
            clock.us(first),
            Clock::dur(first, end),
            json!({"bytes": t.response_bytes}),
        ));
    }
    for stall in &t.stalls {
        let start = t.request_start + (stall.start_ms * 1e6) as u64;
        out.push(slice(
            &format!("stall: {}", main_cause(stall)),
            pid,
            tid,
            clock.us(start),
            stall.gap_ms * 1e3,
            serde_json::to_value(stall).unwrap_or(Value::Null),
        ));
    }
    let mut previous: Option<MonoNs> = None;
    for (i, &ts) in t.chunk_ts.iter().enumerate() {
        let gap = previous.map(|p| ms(ts.saturating_sub(p)));
        out.push(json!({
            "ph": "i", "s": "t", "name": "token", "cat": "token",
            "pid": pid, "tid": tid, "ts": clock.us(ts),
            "args": {"index": i, "gap_ms": gap},
        }));
        previous = Some(ts);
    }
}

/// The largest part of a stall's gap, as a short name.
pub fn main_cause(stall: &Stall) -> &'static str {
    [
        ("queue", stall.queue_ms),
        ("preempted", stall.preempted_ms),
        ("prefill", stall.prefill_ms),
        ("GPU sync", stall.gpu_sync_ms),
        ("flow control", stall.flow_control_ms),
        ("off-CPU", stall.off_cpu_ms),
        ("unexplained", stall.unexplained_ms),
        ("socket", stall.socket_ms),
    ]
    .into_iter()
    .fold(("unexplained", 0.0), |best, (name, ms)| {
        if ms > best.1 {
            (name, ms)
        } else {
            best
        }
    })
    .0
}

fn thread_slice(s: &super::core::ThreadSlice, clock: &Clock) -> Value {
    let (name, cat, args) = match s.kind {
        SliceKind::Io {
            call,
            direction,
            len,
        } => {
            let dir = match direction {
                Direction::Ingress => "in",
                Direction::Egress => "out",
            };
            (
                call_name(call).to_string(),
                "syscall",
                json!({"bytes": len, "direction": dir}),
            )
        }
        SliceKind::OffCpu {
            syscall,
            in_cuda_sync,
        } => (
            match syscall {
                Some(nr) => format!("off-CPU (syscall {nr})"),
                None => "off-CPU (preempted)".to_string(),
            },
            "off_cpu",
            json!({"syscall": syscall, "in_cuda_sync": in_cuda_sync}),
        ),
        SliceKind::CudaSync { call, launches } => (
            serde_plain::to_string(&call).unwrap_or_else(|_| "CUDA sync".to_string()),
            "cuda",
            json!({"launches_since_last_sync": launches}),
        ),
        SliceKind::SendHold { bytes } => (
            "send queue hold".to_string(),
            "socket",
            json!({"bytes": bytes}),
        ),
    };
    json!({
        "ph": "X", "name": name, "cat": cat,
        "pid": s.pid, "tid": s.tid, "ts": clock.us(s.start),
        "dur": Clock::dur(s.start, s.end), "args": args,
    })
}

/// The whole trace as JSON bytes.
pub fn render(recording: &Recording) -> anyhow::Result<Vec<u8>> {
    let meta = &recording.meta;
    let clock = Clock {
        base: meta.started_ns,
    };
    let mut events = vec![
        metadata("process_name", REQUESTS_PID, 0, json!({"name": "Requests"})),
        metadata(
            "process_sort_index",
            REQUESTS_PID,
            0,
            json!({"sort_index": -1}),
        ),
    ];
    for (i, t) in recording.timelines.iter().enumerate() {
        request_events(i, t, &clock, &mut events);
    }

    let mut pids: Vec<u32> = recording.threads.names.values().map(|t| t.pid).collect();
    pids.sort_unstable();
    pids.dedup();
    for pid in pids {
        let name = recording
            .threads
            .names
            .get(&pid)
            .or_else(|| recording.threads.names.values().find(|t| t.pid == pid))
            .map_or("", |t| t.comm.as_str());
        events.push(metadata(
            "process_name",
            u64::from(pid),
            0,
            json!({"name": format!("{name} ({pid})")}),
        ));
    }
    for (tid, info) in &recording.threads.names {
        events.push(metadata(
            "thread_name",
            u64::from(info.pid),
            u64::from(*tid),
            json!({"name": format!("{} ({tid})", info.comm)}),
        ));
    }
    for s in &recording.threads.slices {
        events.push(thread_slice(s, &clock));
    }
    for m in &recording.threads.marks {
        let probe = serde_plain::to_string(&m.probe).unwrap_or_default();
        events.push(json!({
            "ph": "i", "s": "t", "name": format!("llm:{probe}"), "cat": "usdt",
            "pid": m.pid, "tid": m.tid, "ts": clock.us(m.ts),
            "args": {"request_id": m.request_id},
        }));
    }
    if let Some(profile) = &recording.profile {
        for sample in &profile.samples {
            events.push(json!({
                "ph": "i", "s": "t", "name": "on-CPU sample", "cat": "cpu",
                "pid": sample.pid, "tid": sample.tid, "ts": clock.us(sample.ts),
                "args": {"frame": profile.leaf(sample)},
            }));
        }
    }
    let trace = json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "tool": format!("tokentrace {}", meta.agent_version),
            "host": meta.hostname,
            "selector": meta.selector,
            "session_start": rfc3339(meta.unix_ns(meta.started_ns)),
            "session_start_monotonic_ns": meta.started_ns,
            "duration_ms": ms(meta.duration_ns()),
            "cpu_profile_hz": meta.profile_hz,
            "events_dropped": recording.counters.events_dropped,
            "thread_slices_dropped": recording.counters.thread_slices_dropped,
        },
    });
    Ok(serde_json::to_vec(&trace)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{CudaSyncCall, CudaSyncEvent, Event, LlmProbe, UsdtEvent};
    use crate::session::core::tests::{meta, recording};
    use crate::session::core::SessionCore;

    #[test]
    fn thread_tracks_show_cuda_syncs_and_usdt_marks() {
        let mut core = SessionCore::new(&meta());
        core.push(&Event::CudaSync(CudaSyncEvent {
            pid: 42,
            tid: 45,
            ts_enter: 1_100_000_000,
            ts_exit: 1_130_000_000,
            call: CudaSyncCall::StreamSynchronize,
            handle: 7,
            kernel_launches: 3,
            graph_launches: 0,
            memcpy_bytes: 0,
        }));
        core.push(&Event::Usdt(UsdtEvent {
            pid: 42,
            tid: 45,
            ts: 1_131_000_000,
            probe: LlmProbe::Token,
            request_id: "chatcmpl-9".into(),
            args: [0, 0, 0],
        }));
        let rec = core.finish(2_000_000_000, meta(), None, 0);
        let trace: Value = serde_json::from_slice(&render(&rec).expect("render")).expect("json");
        let events = trace["traceEvents"].as_array().expect("events");
        let sync = events
            .iter()
            .find(|e| e["cat"] == "cuda")
            .expect("a CUDA slice");
        assert_eq!(sync["name"], "cudaStreamSynchronize");
        assert_eq!(sync["tid"], 45);
        assert_eq!(sync["dur"], 30_000.0);
        assert_eq!(sync["args"]["launches_since_last_sync"], 3);
        let mark = events
            .iter()
            .find(|e| e["cat"] == "usdt")
            .expect("a USDT instant");
        assert_eq!(mark["name"], "llm:token");
        assert_eq!(mark["args"]["request_id"], "chatcmpl-9");
    }

    #[test]
    fn one_track_per_request_with_one_instant_per_token() {
        let rec = recording();
        let trace: Value = serde_json::from_slice(&render(&rec).expect("render")).expect("json");
        let events = trace["traceEvents"].as_array().expect("events");
        let on_request_track = |tid: u64, ph: &str| {
            events
                .iter()
                .filter(|e| e["pid"] == REQUESTS_PID && e["tid"] == tid && e["ph"] == ph)
                .count()
        };
        let tracks: Vec<&Value> = events
            .iter()
            .filter(|e| e["pid"] == REQUESTS_PID && e["name"] == "thread_name")
            .collect();
        assert_eq!(tracks.len(), 2);
        assert_eq!(
            tracks[0]["args"]["name"],
            "#1 POST /v1/chat/completions?rid=0 200"
        );
        assert_eq!(on_request_track(1, "i"), 3);
        assert_eq!(on_request_track(2, "i"), 4);
        assert_eq!(
            on_request_track(2, "X"),
            5,
            "request, receive, wait, stream, and a stall (TTFT over the explainer's threshold)"
        );
        assert!(events.iter().any(|e| e["tid"] == 2
            && e["name"] == "stall: unexplained"
            && e["args"]["chunk"] == 0));
        let request = events
            .iter()
            .find(|e| e["name"] == "request" && e["tid"] == 1)
            .expect("request slice");
        assert_eq!(request["ts"], 100_000.0, "µs since the session start");
        assert!(events
            .iter()
            .any(|e| e["cat"] == "syscall" && e["tid"] == 43 && e["name"] == "write"));
        assert_eq!(
            events.iter().filter(|e| e["cat"] == "cpu").count(),
            3,
            "one instant per CPU sample"
        );
        assert!(events
            .iter()
            .any(|e| e["name"] == "process_name" && e["args"]["name"] == "server (42)"));
    }
}
