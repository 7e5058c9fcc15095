use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use opentelemetry_proto::tonic::trace::v1::Span;

use super::*;
use crate::event::{ConnId, SockAddrs};
use crate::model::trace_context::hex;
use crate::model::{AbortReason, BodyKind, Usage};

const MS: u64 = 1_000_000;
/// Monotonic 1000 s ↔ Unix 1_700_000_000 s.
const OFFSET: i128 = 1_700_000_000_000_000_000 - 1_000_000_000_000;
const T0: u64 = 1_000_000_000_000;
const TP: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

fn clock() -> WallClock {
    WallClock::with_offset(OFFSET, T0)
}

fn settings() -> SpanSettings {
    SpanSettings {
        stall_threshold_ns: 100 * MS,
        chunk_events: false,
        max_events: 64,
    }
}

/// An SSE stream: request read in 1 ms, first event at 40 ms, then one
/// every 15 ms except a 150 ms stall before chunk 3, `[DONE]` at the end.
pub(crate) fn sse() -> RequestTimeline {
    let chunks = [40, 55, 70, 220, 235].map(|ms| T0 + ms * MS).to_vec();
    RequestTimeline {
        conn: ConnId {
            pid: 4242,
            fd: 9,
            sock_ino: 77,
        },
        comm: "python3".into(),
        addrs: Some(SockAddrs {
            local: "127.0.0.1:8000".parse().expect("addr"),
            remote: "127.0.0.1:51234".parse().expect("addr"),
        }),
        method: "POST".into(),
        path: "/v1/chat/completions?rid=secret-ish".into(),
        traceparent: Some(TP.into()),
        tracestate: Some("vendor=1".into()),
        model: Some("llama-3-8b".into()),
        request_start: T0,
        read_start: T0,
        ingress_known: true,
        accept_wait_ns: None,
        tls_handshake_ns: None,
        request_headers: Vec::new(),
        chunks_after_client_closed: 0,
        request_end: T0 + MS,
        request_bytes: 300,
        status: Some(200),
        content_type: Some("text/event-stream".into()),
        body_kind: Some(BodyKind::Sse),
        response_start: Some(T0 + 2 * MS),
        first_body_byte: Some(T0 + 40 * MS),
        chunk_ts: chunks,
        end: T0 + 240 * MS,
        response_bytes: 2000,
        done_seen: true,
        aborted: false,
        abort_reason: None,
        response_id: Some("chatcmpl-1".into()),
        usage: Some(Usage {
            prompt_tokens: Some(12),
            completion_tokens: Some(5),
        }),
        truncated_writes: 0,
        tls: false,
        stalls: Vec::new(),
        ..RequestTimeline::default()
    }
}

fn attr<'a>(span: &'a Span, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.as_ref())
}

fn unix(ms: u64) -> u64 {
    1_700_000_000_000_000_000 + ms * MS
}

#[test]
fn server_span_joins_the_callers_trace() {
    let spans = timeline_spans(
        &sse(),
        &clock(),
        &mut IdGenerator::with_seed(1),
        &settings(),
    );
    let server = &spans[0];
    assert_eq!(hex(&server.trace_id), "0af7651916cd43dd8448eb211c80319c");
    assert_eq!(hex(&server.parent_span_id), "b7ad6b7169203331");
    assert_eq!(server.trace_state, "vendor=1");
    assert_eq!(server.kind, SpanKind::Server as i32);
    assert_eq!(
        server.flags,
        0x01 | 0x100 | 0x200,
        "sampled, parent is remote"
    );
    assert_eq!(
        server.name, "POST /v1/chat/completions",
        "no query in the name"
    );
    assert_eq!(
        (server.start_time_unix_nano, server.end_time_unix_nano),
        (unix(0), unix(240))
    );
    assert_eq!(server.span_id.len(), 8);
    assert_eq!(server.status, None);
}

#[test]
fn phases_are_children_of_the_server_span() {
    let spans = timeline_spans(
        &sse(),
        &clock(),
        &mut IdGenerator::with_seed(1),
        &settings(),
    );
    let server_id = spans[0].span_id.clone();
    let phases: Vec<(&str, u64, u64)> = spans[1..]
        .iter()
        .map(|s| {
            assert_eq!(s.parent_span_id, server_id);
            assert_eq!(s.trace_id, spans[0].trace_id);
            assert_eq!(s.kind, SpanKind::Internal as i32);
            assert_eq!(s.flags, 0x01 | 0x100, "local parent");
            (
                s.name.as_str(),
                s.start_time_unix_nano,
                s.end_time_unix_nano,
            )
        })
        .collect();
    assert_eq!(
        phases,
        vec![
            ("read request", unix(0), unix(1)),
            ("wait for first token", unix(1), unix(40)),
            ("stream", unix(40), unix(240)),
        ]
    );
    let ids: std::collections::HashSet<Vec<u8>> = spans.iter().map(|s| s.span_id.clone()).collect();
    assert_eq!(ids.len(), spans.len(), "span ids are distinct");
}

#[test]
fn socket_wait_is_a_phase_and_ids_are_header_attributes() {
    let mut t = sse();
    // Arrived 3 ms before the server read it; the server span starts there.
    t.request_start = T0 - 3 * MS;
    t.accept_wait_ns = Some(2 * MS);
    t.request_headers = vec![("x-request-id".into(), "req-42".into())];
    t.aborted = true;
    t.abort_reason = Some(AbortReason::ClientClosed);
    t.chunks_after_client_closed = 2;
    let spans = timeline_spans(&t, &clock(), &mut IdGenerator::with_seed(1), &settings());
    assert_eq!(spans[0].start_time_unix_nano, unix(0) - 3_000_000);
    let phases: Vec<(&str, u64, u64)> = spans[1..3]
        .iter()
        .map(|s| {
            (
                s.name.as_str(),
                s.start_time_unix_nano,
                s.end_time_unix_nano,
            )
        })
        .collect();
    assert_eq!(
        phases,
        vec![
            ("wait in socket", unix(0) - 3_000_000, unix(0)),
            ("read request", unix(0), unix(1)),
        ]
    );
    let header = attr(&spans[0], "http.request.header.x-request-id");
    let Some(Value::ArrayValue(values)) = header else {
        panic!("a string array, got {header:?}")
    };
    assert_eq!(
        values.values[0].value,
        Some(Value::StringValue("req-42".into()))
    );
    assert_eq!(
        attr(&spans[0], "tokentrace.socket_wait_ms"),
        Some(&Value::DoubleValue(3.0))
    );
    assert_eq!(
        attr(&spans[0], "tokentrace.accept_wait_ms"),
        Some(&Value::DoubleValue(2.0))
    );
    assert_eq!(
        attr(&spans[0], "tokentrace.chunks_after_client_closed"),
        Some(&Value::IntValue(2))
    );
    assert_eq!(
        attr(&spans[0], "error.type"),
        Some(&Value::StringValue("client_closed".into()))
    );
}

#[test]
fn attributes_match_the_json_output_and_semconv() {
    let t = sse();
    let spans = timeline_spans(&t, &clock(), &mut IdGenerator::with_seed(1), &settings());
    let s = &spans[0];
    let json = JsonTimeline::new(&t);
    let f = |v: f64| Some(Value::DoubleValue(v));
    let str_ = |v: &str| Some(Value::StringValue(v.into()));
    let int = |v: i64| Some(Value::IntValue(v));
    assert_eq!(
        attr(s, "tokentrace.ttft_ms").cloned(),
        f(json.ttft_ms.expect("ttft"))
    );
    assert_eq!(attr(s, "tokentrace.ttft_ms").cloned(), f(40.0));
    assert_eq!(attr(s, "tokentrace.itl_p50_ms").cloned(), f(15.0));
    assert_eq!(attr(s, "tokentrace.itl_max_ms").cloned(), f(150.0));
    assert_eq!(
        attr(s, "tokentrace.tpot_ms").cloned(),
        f(json.tpot_ms.expect("tpot"))
    );
    assert_eq!(attr(s, "tokentrace.chunks").cloned(), int(5));
    assert_eq!(attr(s, "tokentrace.body").cloned(), str_("sse"));
    assert_eq!(
        attr(s, "tokentrace.aborted").cloned(),
        Some(Value::BoolValue(false))
    );
    assert_eq!(
        attr(s, "tokentrace.tls").cloned(),
        Some(Value::BoolValue(false))
    );
    assert_eq!(attr(s, "http.request.method").cloned(), str_("POST"));
    assert_eq!(attr(s, "url.path").cloned(), str_("/v1/chat/completions"));
    assert_eq!(attr(s, "http.response.status_code").cloned(), int(200));
    assert_eq!(attr(s, "server.port").cloned(), int(8000));
    assert_eq!(attr(s, "client.port").cloned(), int(51234));
    assert_eq!(attr(s, "gen_ai.operation.name").cloned(), str_("chat"));
    assert_eq!(attr(s, "gen_ai.request.model").cloned(), str_("llama-3-8b"));
    assert_eq!(attr(s, "gen_ai.response.id").cloned(), str_("chatcmpl-1"));
    assert_eq!(attr(s, "gen_ai.usage.input_tokens").cloned(), int(12));
    assert_eq!(attr(s, "gen_ai.usage.output_tokens").cloned(), int(5));
    assert!(attr(s, "error.type").is_none());
    let text = format!("{spans:?}");
    assert!(
        !text.contains("secret-ish"),
        "the query string never leaves the agent"
    );
}

#[test]
fn stalls_become_events_and_chunk_events_are_opt_in_and_capped() {
    let spans = timeline_spans(
        &sse(),
        &clock(),
        &mut IdGenerator::with_seed(1),
        &settings(),
    );
    let events = &spans[0].events;
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].name, "tokentrace.stall");
    assert_eq!(
        events[0].time_unix_nano,
        unix(70),
        "at the start of the gap"
    );
    let stall_ms = events[0]
        .attributes
        .iter()
        .find(|kv| kv.key == "tokentrace.stall_ms");
    assert_eq!(
        stall_ms.and_then(|kv| kv.value.clone()?.value),
        Some(Value::DoubleValue(150.0))
    );

    let mut s = settings();
    s.chunk_events = true;
    let spans = timeline_spans(&sse(), &clock(), &mut IdGenerator::with_seed(1), &s);
    let names: Vec<&str> = spans[0].events.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(
        names.iter().filter(|n| **n == "tokentrace.chunk").count(),
        5
    );
    let times: Vec<u64> = spans[0].events.iter().map(|e| e.time_unix_nano).collect();
    assert!(
        times.windows(2).all(|w| w[0] <= w[1]),
        "events in time order"
    );

    s.max_events = 2;
    let spans = timeline_spans(&sse(), &clock(), &mut IdGenerator::with_seed(1), &s);
    assert_eq!(spans[0].events.len(), 2);
    assert_eq!(spans[0].dropped_events_count, 4);

    s.stall_threshold_ns = 0;
    s.chunk_events = false;
    assert!(
        timeline_spans(&sse(), &clock(), &mut IdGenerator::with_seed(1), &s)[0]
            .events
            .is_empty()
    );
}

#[test]
fn without_traceparent_a_new_sampled_root_trace_starts() {
    let mut t = sse();
    t.traceparent = Some("garbage".into());
    let spans = timeline_spans(&t, &clock(), &mut IdGenerator::with_seed(1), &settings());
    assert_eq!(spans[0].parent_span_id, Vec::<u8>::new());
    assert_eq!(spans[0].trace_id.len(), 16);
    assert_ne!(spans[0].trace_id, vec![0; 16]);
    assert_eq!(
        spans[0].trace_state, "",
        "tracestate without a valid traceparent is dropped"
    );
    assert_eq!(spans[0].flags, 0x01 | 0x100);
    let other = timeline_spans(&t, &clock(), &mut IdGenerator::with_seed(2), &settings());
    assert_ne!(spans[0].trace_id, other[0].trace_id);
}

#[test]
fn an_unsampled_caller_gets_no_spans() {
    let mut t = sse();
    t.traceparent = Some(TP.replace("-01", "-00"));
    assert!(timeline_spans(&t, &clock(), &mut IdGenerator::with_seed(1), &settings()).is_empty());
}

#[test]
fn aborted_and_failed_requests_are_errors() {
    let mut t = sse();
    t.aborted = true;
    t.abort_reason = Some(AbortReason::ConnectionClosed);
    t.chunk_ts.truncate(2);
    t.end = T0 + 60 * MS;
    let spans = timeline_spans(&t, &clock(), &mut IdGenerator::with_seed(1), &settings());
    let status = spans[0].status.clone().expect("status");
    assert_eq!(status.code, StatusCode::Error as i32);
    assert_eq!(status.message, "connection_closed");
    assert_eq!(
        attr(&spans[0], "error.type"),
        Some(&Value::StringValue("connection_closed".into()))
    );
    assert_eq!(
        attr(&spans[0], "tokentrace.abort_reason"),
        Some(&Value::StringValue("connection_closed".into()))
    );

    // aborted before any token: no stream phase, waiting runs to the abort
    let mut t = sse();
    t.aborted = true;
    t.abort_reason = Some(AbortReason::ProcessExited);
    t.chunk_ts.clear();
    t.first_body_byte = None;
    t.end = T0 + 30 * MS;
    let spans = timeline_spans(&t, &clock(), &mut IdGenerator::with_seed(1), &settings());
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        vec![
            "POST /v1/chat/completions",
            "read request",
            "wait for first token"
        ]
    );
    assert_eq!(spans[2].end_time_unix_nano, unix(30));
    assert!(attr(&spans[0], "tokentrace.ttft_ms").is_none());

    let mut t = sse();
    t.status = Some(503);
    let spans = timeline_spans(&t, &clock(), &mut IdGenerator::with_seed(1), &settings());
    assert_eq!(
        spans[0].status.as_ref().map(|s| s.code),
        Some(StatusCode::Error as i32)
    );
    t.status = Some(404);
    let spans = timeline_spans(&t, &clock(), &mut IdGenerator::with_seed(1), &settings());
    assert_eq!(
        spans[0].status, None,
        "4xx is the client's error, not the server span's"
    );
}

#[test]
fn non_streaming_responses_have_a_write_phase() {
    let mut t = sse();
    t.body_kind = Some(BodyKind::Fixed);
    t.chunk_ts = vec![T0 + 40 * MS];
    t.end = T0 + 41 * MS;
    let spans = timeline_spans(&t, &clock(), &mut IdGenerator::with_seed(1), &settings());
    assert_eq!(
        spans.last().map(|s| s.name.as_str()),
        Some("write response")
    );
    assert_eq!(
        attr(&spans[0], "tokentrace.stream"),
        Some(&Value::BoolValue(false))
    );
}

#[test]
fn grpc_streams_carry_rpc_attributes_and_failed_calls_are_errors() {
    let mut t = sse();
    t.protocol = crate::model::Protocol::Grpc;
    t.stream_id = Some(7);
    t.path = "/tokentrace.test.Streamer/Generate".into();
    t.body_kind = Some(BodyKind::Grpc);
    t.grpc_status = Some(0);
    t.flow_control_waits = vec![(t.request_start, t.request_start + 3 * MS)];
    let spans = timeline_spans(&t, &clock(), &mut IdGenerator::with_seed(1), &settings());
    let s = &spans[0];
    let str_ = |v: &str| Some(Value::StringValue(v.into()));
    let int = |v: i64| Some(Value::IntValue(v));
    assert_eq!(attr(s, "protocol").cloned(), str_("grpc"));
    assert_eq!(attr(s, "network.protocol.version").cloned(), str_("2"));
    assert_eq!(attr(s, "rpc.system").cloned(), str_("grpc"));
    assert_eq!(
        attr(s, "rpc.service").cloned(),
        str_("tokentrace.test.Streamer")
    );
    assert_eq!(attr(s, "rpc.method").cloned(), str_("Generate"));
    assert_eq!(attr(s, "grpc.status").cloned(), int(0));
    assert_eq!(attr(s, "rpc.grpc.status_code").cloned(), int(0));
    assert_eq!(attr(s, "tokentrace.h2.stream_id").cloned(), int(7));
    assert_eq!(
        attr(s, "tokentrace.flow_control_ms").cloned(),
        Some(Value::DoubleValue(3.0))
    );
    assert_eq!(attr(s, "tokentrace.body").cloned(), str_("grpc"));
    assert!(attr(s, "error.type").is_none());
    // UNAVAILABLE is a server error; NOT_FOUND (5) is the caller's.
    t.grpc_status = Some(14);
    let spans = timeline_spans(&t, &clock(), &mut IdGenerator::with_seed(1), &settings());
    assert_eq!(attr(&spans[0], "error.type").cloned(), str_("14"));
    t.grpc_status = Some(5);
    let spans = timeline_spans(&t, &clock(), &mut IdGenerator::with_seed(1), &settings());
    assert!(attr(&spans[0], "error.type").is_none());
    // HTTP/1.1 spans say so and carry none of this.
    let spans = timeline_spans(
        &sse(),
        &clock(),
        &mut IdGenerator::with_seed(1),
        &settings(),
    );
    assert_eq!(attr(&spans[0], "protocol").cloned(), str_("http/1.1"));
    assert!(attr(&spans[0], "rpc.system").is_none());
}
