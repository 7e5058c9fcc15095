//! Explainer tests: a hand-built timeline and the inference events an
//! HTTP frontend (pid 10) and a separate engine (pid 20) would produce.

use super::*;
use crate::event::{
    ConnEvent, CudaSyncCall, CudaSyncEvent, DataEvent, IoCall, OffCpuEvent, SendHoldEvent,
    TcpSendState, UsdtEvent,
};
use crate::model::{BodyKind, RequestTimeline};

const MS: u64 = 1_000_000;
const FRONTEND: u32 = 10;
const WRITER_TID: u32 = 11;
const ENGINE: u32 = 20;
const ENGINE_TID: u32 = 21;
const CONN: ConnId = ConnId {
    pid: FRONTEND,
    fd: 7,
    sock_ino: 99,
};

/// A stream starting at 1000 ms whose chunk i is emitted at `emits[i]` ms.
fn timeline(emits: &[u64]) -> RequestTimeline {
    RequestTimeline {
        conn: CONN,
        comm: "python3".into(),
        addrs: None,
        method: "POST".into(),
        path: "/v1/chat/completions".into(),
        traceparent: None,
        tracestate: None,
        model: None,
        request_start: 1000 * MS,
        read_start: 1000 * MS,
        ingress_known: true,
        accept_wait_ns: None,
        tls_handshake_ns: None,
        request_headers: Vec::new(),
        chunks_after_client_closed: 0,
        request_end: 1000 * MS,
        request_bytes: 100,
        status: Some(200),
        content_type: Some("text/event-stream".into()),
        body_kind: Some(BodyKind::Sse),
        response_start: Some(1001 * MS),
        first_body_byte: emits.first().map(|e| e * MS),
        chunk_ts: emits.iter().map(|e| e * MS).collect(),
        end: emits.last().copied().unwrap_or(1000) * MS,
        response_bytes: 1000,
        done_seen: true,
        aborted: false,
        abort_reason: None,
        response_id: Some("chatcmpl-1".into()),
        usage: None,
        truncated_writes: 0,
        tls: false,
        stalls: Vec::new(),
        ..RequestTimeline::default()
    }
}

fn usdt(probe: LlmProbe, at_ms: u64, args: [u64; 3]) -> Event {
    Event::Usdt(UsdtEvent {
        pid: ENGINE,
        tid: ENGINE_TID,
        ts: at_ms * MS,
        probe,
        request_id: if probe == LlmProbe::BatchStep {
            String::new()
        } else {
            "chatcmpl-1".into()
        },
        args,
    })
}

fn sync(tid: u32, pid: u32, from_ms: u64, to_ms: u64) -> Event {
    Event::CudaSync(CudaSyncEvent {
        pid,
        tid,
        ts_enter: from_ms * MS,
        ts_exit: to_ms * MS,
        call: CudaSyncCall::StreamSynchronize,
        handle: 0,
        kernel_launches: 3,
        graph_launches: 0,
        memcpy_bytes: 0,
    })
}

fn off_cpu(pid: u32, tid: u32, from_ms: u64, to_ms: u64, syscall: Option<u32>) -> Event {
    Event::OffCpu(OffCpuEvent {
        pid,
        tid,
        start: from_ms * MS,
        end: to_ms * MS,
        syscall,
        state: 1,
        in_cuda_sync: false,
    })
}

fn write(at_ms: u64, unsent: u32, nodelay: bool) -> Event {
    Event::Data(DataEvent {
        conn: CONN,
        tid: WRITER_TID,
        comm: "python3".into(),
        ts_enter: at_ms * MS,
        ts_exit: at_ms * MS + 1000,
        ingress: None,
        marks: Vec::new(),
        direction: Direction::Egress,
        call: IoCall::Write,
        len: 10,
        payload: bytes::Bytes::new(),
        addrs: None,
        tcp: Some(TcpSendState {
            nodelay,
            unsent_bytes: unsent,
        }),
    })
}

fn close_ms(x: f64, want: f64) -> bool {
    (x - want).abs() < 0.01
}

#[test]
fn splits_each_late_gap_between_its_causes() {
    let mut ex = Explainer::new(30 * MS, 60_000 * MS);
    // Queue 1000..1200, prefill 1200..1220 (with its own sync), first
    // token at 1230; token 1 at 1240 (on time); token 2 at 1300 after a
    // 50 ms engine sync 1245..1295; token 3 at 1350 after the frontend
    // writer slept 1305..1345; token 4 at 1355 but held by Nagle 40 ms.
    let events = vec![
        write(1001, 0, true),
        usdt(LlmProbe::RequestQueued, 1000, [1, 0, 0]),
        usdt(LlmProbe::RequestScheduled, 1200, [1, 0, 0]),
        usdt(LlmProbe::PrefillStart, 1200, [0; 3]),
        sync(ENGINE_TID, ENGINE, 1205, 1219),
        usdt(LlmProbe::PrefillEnd, 1220, [0; 3]),
        usdt(LlmProbe::BatchStep, 1225, [7, 2, 2]),
        sync(ENGINE_TID, ENGINE, 1245, 1295),
        // The frontend waits on the engine's pipe meanwhile: off-CPU, but
        // covered by the GPU sync, which comes first.
        off_cpu(FRONTEND, WRITER_TID, 1241, 1298, Some(0)),
        off_cpu(FRONTEND, WRITER_TID, 1305, 1345, Some(230)),
        // Another process's sync is not this request's.
        sync(999, 99, 1300, 1350),
        write(1355, 30, false),
        Event::SendHold(SendHoldEvent {
            pid: FRONTEND,
            tid: WRITER_TID,
            sock_ino: CONN.sock_ino,
            write_ts: 1355 * MS,
            release_ts: 1395 * MS,
            held_bytes: 30,
        }),
    ];
    for e in &events {
        ex.observe(e);
    }
    let stalls = ex.explain(&timeline(&[1230, 1240, 1300, 1350, 1355]));
    let chunks: Vec<usize> = stalls.iter().map(|s| s.chunk).collect();
    assert_eq!(chunks, vec![0, 2, 3, 4], "{stalls:#?}");

    let ttft = &stalls[0];
    assert!(close_ms(ttft.gap_ms, 230.0), "{ttft:?}");
    assert!(close_ms(ttft.queue_ms, 200.0), "{ttft:?}");
    assert!(close_ms(ttft.prefill_ms, 20.0), "{ttft:?}");
    assert_eq!(
        ttft.gpu_sync_ms, 0.0,
        "the prefill sync is prefill: {ttft:?}"
    );
    assert_eq!(ttft.batch_fan_in, Some(2));

    let sync_stall = &stalls[1];
    assert!(close_ms(sync_stall.gpu_sync_ms, 50.0), "{sync_stall:?}");
    // 1241..1245 and 1295..1298: the pipe wait outside the sync.
    assert!(close_ms(sync_stall.off_cpu_ms, 7.0), "{sync_stall:?}");
    assert_eq!(sync_stall.off_cpu_reason.as_deref(), Some("io"));
    assert!(close_ms(sync_stall.unexplained_ms, 3.0), "{sync_stall:?}");
    assert_eq!(sync_stall.gpu_launches, 3);

    let sleep_stall = &stalls[2];
    assert!(close_ms(sleep_stall.off_cpu_ms, 40.0), "{sleep_stall:?}");
    assert_eq!(sleep_stall.off_cpu_reason.as_deref(), Some("sleep"));
    assert_eq!(
        sleep_stall.gpu_sync_ms, 0.0,
        "another process's sync: {sleep_stall:?}"
    );

    let nagle = &stalls[3];
    assert!(close_ms(nagle.gap_ms, 5.0), "{nagle:?}");
    assert!(close_ms(nagle.socket_ms, 40.0), "{nagle:?}");
    assert!(nagle.nagle);
}

#[test]
fn nothing_late_means_no_stalls_and_pruning_forgets() {
    let mut ex = Explainer::new(30 * MS, 100 * MS);
    ex.observe(&sync(WRITER_TID, FRONTEND, 1000, 1090));
    assert!(ex.explain(&timeline(&[1010, 1020, 1030])).is_empty());
    ex.prune(2000 * MS);
    let late = ex.explain(&timeline(&[1010, 1100]));
    assert_eq!(late.len(), 1);
    assert_eq!(late[0].gpu_sync_ms, 0.0, "pruned sync must not count");
    ex.observe(&Event::Close(ConnEvent {
        conn: CONN,
        tid: WRITER_TID,
        comm: String::new(),
        ts: 2000 * MS,
        addrs: None,
        established: None,
    }));
}

#[test]
fn token_marks_split_a_gap_between_producer_and_writer() {
    let mut ex = Explainer::new(30 * MS, 60_000 * MS);
    let token = |index: u64, at_ms: u64| usdt(LlmProbe::Token, at_ms, [index, 0, 0]);
    let events = vec![
        write(1001, 0, true),
        token(0, 1009),
        token(1, 1019),
        sync(ENGINE_TID, ENGINE, 1020, 1025),
        token(2, 1025),
        // The engine runs ahead on later tokens while the frontend sleeps
        // before writing token 2: its syncs are not this gap's cause.
        sync(ENGINE_TID, ENGINE, 1026, 1060),
        off_cpu(FRONTEND, WRITER_TID, 1025, 1068, Some(230)),
    ];
    for e in &events {
        ex.observe(e);
    }
    let stalls = ex.explain(&timeline(&[1010, 1020, 1070]));
    let [stall] = stalls.as_slice() else {
        panic!("one late chunk expected: {stalls:#?}")
    };
    assert_eq!(stall.chunk, 2);
    assert!(close_ms(stall.gpu_sync_ms, 5.0), "{stall:?}");
    assert!(close_ms(stall.off_cpu_ms, 43.0), "{stall:?}");
    assert_eq!(stall.off_cpu_reason.as_deref(), Some("sleep"));
    assert!(close_ms(stall.unexplained_ms, 2.0), "{stall:?}");
}

#[test]
fn a_close_seen_before_the_explanation_keeps_the_writer_side() {
    // As in a real server: the frontend's writer thread also fires
    // request_start, and the connection's close is observed (same batch)
    // before the finished timeline is explained.
    let mut ex = Explainer::new(30 * MS, 60_000 * MS);
    let token = |index: u64, at_ms: u64| usdt(LlmProbe::Token, at_ms, [index, 0, 0]);
    let events = vec![
        Event::Usdt(UsdtEvent {
            pid: FRONTEND,
            tid: WRITER_TID,
            ts: 1000 * MS,
            probe: LlmProbe::RequestStart,
            request_id: "chatcmpl-1".into(),
            args: [1, 0, 0],
        }),
        write(1001, 0, true),
        token(0, 1009),
        token(1, 1019),
        // The writer waits for the engine, then sleeps before writing 1.
        off_cpu(FRONTEND, WRITER_TID, 1011, 1020, Some(202)),
        off_cpu(FRONTEND, WRITER_TID, 1020, 1060, Some(230)),
        Event::Close(ConnEvent {
            conn: CONN,
            tid: WRITER_TID,
            comm: String::new(),
            ts: 1070 * MS,
            addrs: None,
            established: None,
        }),
    ];
    for e in &events {
        ex.observe(e);
    }
    let stalls = ex.explain(&timeline(&[1010, 1061]));
    let [stall] = stalls.as_slice() else {
        panic!("one late chunk expected: {stalls:#?}")
    };
    assert!(close_ms(stall.off_cpu_ms, 41.0), "{stall:?}");
    assert_eq!(stall.off_cpu_reason.as_deref(), Some("sleep"), "{stall:?}");
}

#[test]
fn an_idle_thread_that_only_queued_the_request_is_not_a_producer() {
    // The engine's input thread fired request_queued, then waited for the
    // next request (off-CPU in recvfrom, woken now and then) while the
    // engine loop slept 40 ms before token 1: the gap is that sleep.
    const INPUT_TID: u32 = 22;
    let mut ex = Explainer::new(30 * MS, 60_000 * MS);
    let token = |index: u64, at_ms: u64| usdt(LlmProbe::Token, at_ms, [index, 0, 0]);
    let events = vec![
        Event::Usdt(UsdtEvent {
            pid: ENGINE,
            tid: INPUT_TID,
            ts: 1000 * MS,
            probe: LlmProbe::RequestQueued,
            request_id: "chatcmpl-1".into(),
            args: [1, 0, 0],
        }),
        write(1001, 0, true),
        token(0, 1009),
        sync(ENGINE_TID, ENGINE, 1010, 1015),
        off_cpu(ENGINE, ENGINE_TID, 1015, 1055, Some(230)),
        off_cpu(ENGINE, INPUT_TID, 1009, 1057, Some(45)),
        token(1, 1056),
    ];
    for e in &events {
        ex.observe(e);
    }
    let stalls = ex.explain(&timeline(&[1010, 1057]));
    let [stall] = stalls.as_slice() else {
        panic!("one late chunk expected: {stalls:#?}")
    };
    assert!(close_ms(stall.gpu_sync_ms, 5.0), "{stall:?}");
    assert!(close_ms(stall.off_cpu_ms, 40.0), "{stall:?}");
    assert_eq!(stall.off_cpu_reason.as_deref(), Some("sleep"), "{stall:?}");
    assert!(close_ms(stall.unexplained_ms, 2.0), "{stall:?}");
}

#[test]
fn an_http2_flow_control_wait_is_its_own_cause_before_off_cpu() {
    let mut ex = Explainer::new(30 * MS, 60_000 * MS);
    // The writer waits off-CPU (in epoll) for the client's WINDOW_UPDATE:
    // the wait is flow control, not the writer's own off-CPU time.
    for e in [
        write(1001, 0, true),
        off_cpu(FRONTEND, WRITER_TID, 1250, 1340, Some(232)),
    ] {
        ex.observe(&e);
    }
    let mut t = timeline(&[1230, 1240, 1350]);
    t.protocol = crate::model::Protocol::H2;
    t.flow_control_waits = vec![(1245 * MS, 1330 * MS)];
    let stalls = ex.explain(&t);
    let late = stalls
        .iter()
        .find(|s| s.chunk == 2)
        .expect("chunk 2 is late");
    assert!(close_ms(late.flow_control_ms, 85.0), "{late:?}");
    // 1330..1340 of the off-CPU interval is outside the wait.
    assert!(close_ms(late.off_cpu_ms, 10.0), "{late:?}");
    assert!(close_ms(late.unexplained_ms, 15.0), "{late:?}");
}

/// vLLM through tokentrace-vllm: scheduler events dated by `at_ns` (they
/// reach the probes a step late), an empty role chunk before the tokens,
/// two requests sharing batch steps, one preempted and rescheduled.
#[test]
fn engine_view_joins_dated_marks_steps_and_preemption() {
    let mut ex = Explainer::new(30 * MS, 60_000 * MS);
    let at = |probe, fired_ms: u64, value: u64, at_ms: u64| {
        usdt(probe, fired_ms, [value, at_ms * MS, 0])
    };
    let other = |probe, fired_ms: u64, args: [u64; 3]| {
        let Event::Usdt(mut u) = usdt(probe, fired_ms, args) else {
            unreachable!()
        };
        u.request_id = "chatcmpl-2".into();
        Event::Usdt(u)
    };
    let token = |index: u64, at_ms: u64| usdt(LlmProbe::Token, at_ms, [index, 0, 0]);
    let step =
        |id: u64, batch: u64, at_ms: u64| usdt(LlmProbe::BatchStep, at_ms, [id, batch, batch]);
    let events = vec![
        write(1001, 0, true),
        // Fired at 1150 with the first token, dated when they happened.
        at(LlmProbe::RequestQueued, 1150, 2, 1010),
        at(LlmProbe::RequestScheduled, 1150, 2, 1100),
        at(LlmProbe::PrefillStart, 1150, 9, 1100),
        token(0, 1150),
        other(LlmProbe::Token, 1150, [0, 0, 0]),
        at(LlmProbe::PrefillEnd, 1150, 9, 1149),
        step(1, 2, 1151),
        token(1, 1160),
        other(LlmProbe::Token, 1160, [1, 0, 0]),
        step(2, 2, 1161),
        // Evicted at 1165, back at 1300 (learnt with its next token).
        other(LlmProbe::Token, 1170, [2, 0, 0]),
        step(3, 1, 1171),
        at(LlmProbe::RequestPreempted, 1310, 1, 1165),
        at(LlmProbe::RequestScheduled, 1310, 1, 1300),
        token(2, 1310),
        step(4, 1, 1311),
        at(LlmProbe::RequestEnd, 1311, 3, 0),
    ];
    for e in &events {
        ex.observe(e);
    }
    // Chunk 0 is the role chunk, then one chunk per token.
    let t = timeline(&[1152, 1153, 1162, 1312]);
    let view = ex.engine_view(&t).expect("marks for chatcmpl-1");
    assert!(close_ms(view.queue_ms.expect("queue"), 90.0), "{view:?}");
    assert!(
        close_ms(view.prefill_ms.expect("prefill"), 49.0),
        "{view:?}"
    );
    assert_eq!(view.batch_fan_in, Some(2), "{view:?}");
    assert_eq!(view.batch_steps, 3, "steps 1, 2 and 4: {view:?}");
    assert_eq!(view.preemptions, 1);
    assert!(close_ms(view.preempted_ms, 135.0), "{view:?}");

    let stalls = ex.explain(&t);
    let ttft = stalls.iter().find(|s| s.chunk == 0).expect("TTFT is late");
    // Dated marks: the queue is 1010..1100, not their firing time.
    assert!(close_ms(ttft.queue_ms, 90.0), "{ttft:?}");
    assert!(close_ms(ttft.prefill_ms, 49.0), "{ttft:?}");
    assert!(close_ms(ttft.engine_ms.expect("split"), 150.0), "{ttft:?}");
    assert!(close_ms(ttft.frontend_ms.expect("split"), 2.0), "{ttft:?}");
    // The last chunk waited on the preemption: token 2 (chunk 3, behind
    // the role chunk) is split at its own mark though its index differs.
    let late = stalls
        .iter()
        .find(|s| s.chunk == 3)
        .expect("chunk 3 is late");
    assert!(close_ms(late.preempted_ms, 135.0), "{late:?}");
    assert!(close_ms(late.engine_ms.expect("split"), 148.0), "{late:?}");
    assert!(close_ms(late.frontend_ms.expect("split"), 2.0), "{late:?}");
    assert!(close_ms(late.unexplained_ms, 15.0), "{late:?}");
}

#[test]
fn a_request_without_engine_marks_has_no_engine_view() {
    let mut ex = Explainer::new(30 * MS, 60_000 * MS);
    let Event::Usdt(mut u) = usdt(LlmProbe::Token, 1005, [0, 0, 0]) else {
        unreachable!()
    };
    u.request_id = "chatcmpl-other".into();
    ex.observe(&Event::Usdt(u));
    assert_eq!(ex.engine_view(&timeline(&[1010])), None);
}

#[test]
fn an_at_ns_after_the_firing_is_not_believed() {
    let mut ex = Explainer::new(30 * MS, 60_000 * MS);
    // A bogus stamp (later than the probe fired) falls back to the firing.
    ex.observe(&usdt(LlmProbe::RequestQueued, 1000, [1, 5000 * MS, 0]));
    ex.observe(&usdt(LlmProbe::RequestScheduled, 1020, [1, 0, 0]));
    let view = ex.engine_view(&timeline(&[1030])).expect("marks");
    assert!(close_ms(view.queue_ms.expect("queue"), 20.0), "{view:?}");
    assert_eq!(view.batch_steps, 0);
    assert_eq!(view.batch_fan_in, None);
}
