//! Request timeline → OTLP spans. Pure: no I/O, no clock reads.
//!
//! One SERVER span per request, from the arrival of the first request byte
//! at the host to the write that completed the response (or the abort),
//! with child INTERNAL spans for the phases the kernel lets us see:
//!
//! ```text
//! POST /v1/chat/completions   |------------------------------------------|
//!   wait in socket            |--|         (arrival -> the server's read)
//!   read request                 |--|
//!   wait for first token            |-------|
//!   stream                                  |----------------------------|
//! ```
//!
//! The numbers on the span (`tokentrace.*`) are computed by the same code
//! as `--output json` ([`JsonTimeline`]), so a backend and the JSON lines
//! never disagree. Payload text never appears: only lengths, counts, times,
//! and the model / response id fields the stitcher extracted.
//!
//! Sampling follows the caller (parent-based, like an SDK's default
//! sampler): a `traceparent` with the sampled flag clear yields no spans,
//! since the rest of that trace is not recorded either. Tail sampling of
//! the others (`export.sampling`) is [`super::sampling`]'s.

use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::trace::v1::span::{Event, SpanKind};
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use opentelemetry_proto::tonic::trace::v1::{Span, Status};

use crate::event::MonoNs;
use crate::export::attributes::{
    error_type, kv_bool, kv_f64, kv_int, kv_str, kv_str_array, operation_name,
};
use crate::model::trace_context::{IdGenerator, RemoteParent};
use crate::model::{Protocol, RequestTimeline};
use crate::output::JsonTimeline;
use crate::units::{ms, WallClock};

/// `SpanFlags`: the span's flags say whether its parent is remote.
const FLAG_HAS_IS_REMOTE: u32 = 0x100;
/// `SpanFlags`: the parent span lives in another process.
const FLAG_IS_REMOTE: u32 = 0x200;
/// W3C "sampled" trace flag.
const SAMPLED: u8 = 0x01;

/// What goes into spans besides the fixed attributes.
#[derive(Debug, Clone, PartialEq)]
pub struct SpanSettings {
    /// An inter-token gap at least this long becomes a `tokentrace.stall`
    /// event. 0 disables stall events.
    pub stall_threshold_ns: u64,
    /// One `tokentrace.chunk` event per emitted chunk (can be thousands).
    pub chunk_events: bool,
    /// Most events on one span; the rest are counted as dropped.
    pub max_events: usize,
}

struct Ctx<'a> {
    clock: &'a WallClock,
    trace_id: Vec<u8>,
    trace_state: String,
    trace_flags: u32,
}

impl Ctx<'_> {
    fn span(
        &self,
        span_id: [u8; 8],
        parent: Vec<u8>,
        name: &str,
        kind: SpanKind,
        start: MonoNs,
        end: MonoNs,
    ) -> Span {
        Span {
            trace_id: self.trace_id.clone(),
            span_id: span_id.to_vec(),
            trace_state: self.trace_state.clone(),
            parent_span_id: parent,
            flags: self.trace_flags | FLAG_HAS_IS_REMOTE,
            name: name.to_string(),
            kind: kind as i32,
            start_time_unix_nano: self.clock.unix_nanos(start),
            end_time_unix_nano: self.clock.unix_nanos(end.max(start)),
            ..Default::default()
        }
    }
}

/// The trace a request's spans go in: its caller's, or a new one.
#[derive(Debug, Clone)]
pub struct Trace {
    pub trace_id: [u8; 16],
    pub parent: Option<RemoteParent>,
    /// The ids the hop join gave the request (its JSON line shows them):
    /// the request's own span id, and its parent hop's span.
    pub span_id: Option<[u8; 8]>,
    pub local_parent: Option<[u8; 8]>,
}

impl Trace {
    /// The ids the hop join assigned ([`RequestTimeline::trace`]); without
    /// them, the caller's trace from the request's `traceparent`, else a
    /// new trace id. `None` when the caller's trace is not sampled.
    pub fn of(t: &RequestTimeline, ids: &mut IdGenerator) -> Option<Self> {
        if let Some(tr) = &t.trace {
            if !tr.sampled() {
                return None;
            }
            let remote = tr.parent_span_id.filter(|_| tr.parent_remote);
            return Some(Self {
                trace_id: tr.trace_id,
                parent: remote.map(|span_id| RemoteParent {
                    trace_id: tr.trace_id,
                    span_id,
                    flags: tr.flags,
                    tracestate: tr.tracestate.clone(),
                }),
                span_id: Some(tr.span_id),
                local_parent: tr.parent_span_id.filter(|_| !tr.parent_remote),
            });
        }
        let parent = t
            .traceparent
            .as_deref()
            .and_then(|tp| RemoteParent::parse(tp, t.tracestate.as_deref()));
        match parent {
            Some(p) if !p.sampled() => None,
            Some(p) => Some(Self {
                trace_id: p.trace_id,
                parent: Some(p),
                span_id: None,
                local_parent: None,
            }),
            None => Some(Self {
                trace_id: ids.trace_id(),
                parent: None,
                span_id: None,
                local_parent: None,
            }),
        }
    }

    /// The caller's `traceparent` asked for the trace to be recorded.
    pub fn parent_sampled(&self) -> bool {
        self.parent.as_ref().is_some_and(RemoteParent::sampled)
    }
}

/// The spans of one finished request: the server span first, then its
/// phases. Empty when the caller's trace is not sampled.
pub fn timeline_spans(
    t: &RequestTimeline,
    clock: &WallClock,
    ids: &mut IdGenerator,
    settings: &SpanSettings,
) -> Vec<Span> {
    match Trace::of(t, ids) {
        Some(trace) => trace_spans(t, &trace, clock, ids, settings),
        None => Vec::new(),
    }
}

/// The spans of one finished request in `trace`.
pub fn trace_spans(
    t: &RequestTimeline,
    trace: &Trace,
    clock: &WallClock,
    ids: &mut IdGenerator,
    settings: &SpanSettings,
) -> Vec<Span> {
    let parent = &trace.parent;
    let (trace_id, parent_id, trace_state, trace_flags) = match parent {
        Some(p) => (
            p.trace_id.to_vec(),
            p.span_id.to_vec(),
            p.tracestate.clone().unwrap_or_default(),
            u32::from(p.flags),
        ),
        None => (
            trace.trace_id.to_vec(),
            trace.local_parent.map(|p| p.to_vec()).unwrap_or_default(),
            t.trace
                .as_ref()
                .and_then(|i| i.tracestate.clone())
                .unwrap_or_default(),
            u32::from(SAMPLED),
        ),
    };
    let ctx = Ctx {
        clock,
        trace_id,
        trace_state,
        trace_flags,
    };

    let server_id = trace.span_id.unwrap_or_else(|| ids.span_id());
    let kind = match t.kind {
        crate::model::SpanKind::Server => SpanKind::Server,
        crate::model::SpanKind::Client => SpanKind::Client,
    };
    let route = t.path.split(['?', '#']).next().unwrap_or_default();
    let name = if route.is_empty() {
        t.method.clone()
    } else {
        format!("{} {route}", t.method)
    };
    let mut server = ctx.span(server_id, parent_id, &name, kind, t.request_start, t.end);
    if parent.is_some() {
        server.flags |= FLAG_IS_REMOTE;
    }
    server.attributes = server_attributes(t);
    let (events, dropped) = events(t, clock, settings);
    server.events = events;
    server.dropped_events_count = dropped;
    if let Some(error) = error_type(t) {
        server.status = Some(Status {
            code: StatusCode::Error as i32,
            message: error,
        });
    }

    let mut spans = vec![server];
    let parent = server_id.to_vec();
    if t.read_start > t.request_start {
        spans.push(ctx.span(
            ids.span_id(),
            parent.clone(),
            "wait in socket",
            SpanKind::Internal,
            t.request_start,
            t.read_start,
        ));
    }
    if t.request_end > t.read_start {
        spans.push(ctx.span(
            ids.span_id(),
            parent.clone(),
            "read request",
            SpanKind::Internal,
            t.read_start,
            t.request_end,
        ));
    }
    let first = t.first_token();
    let wait_end = first.unwrap_or(t.end);
    if wait_end > t.request_end {
        spans.push(ctx.span(
            ids.span_id(),
            parent.clone(),
            "wait for first token",
            SpanKind::Internal,
            t.request_end,
            wait_end,
        ));
    }
    if let Some(first) = first.filter(|&f| t.end > f) {
        let phase = if t.is_stream() {
            "stream"
        } else {
            "write response"
        };
        spans.push(ctx.span(
            ids.span_id(),
            parent,
            phase,
            SpanKind::Internal,
            first,
            t.end,
        ));
    }
    spans
}

fn server_attributes(t: &RequestTimeline) -> Vec<KeyValue> {
    let j = JsonTimeline::new(t);
    let route = t.path.split(['?', '#']).next().unwrap_or_default();
    let mut a = vec![
        kv_str("http.request.method", t.method.clone()),
        kv_str("url.path", route),
        kv_str("network.protocol.name", "http"),
        kv_str(
            "network.protocol.version",
            if t.protocol == Protocol::Http11 {
                "1.1"
            } else {
                "2"
            },
        ),
        kv_str("network.transport", "tcp"),
        kv_str("protocol", t.protocol.as_str()),
    ];
    if let Some(id) = t.stream_id {
        a.push(kv_int("tokentrace.h2.stream_id", i64::from(id)));
    }
    if let (Some(service), Some(method)) = (j.rpc_service, j.rpc_method) {
        a.push(kv_str("rpc.system", "grpc"));
        a.push(kv_str("rpc.service", service));
        a.push(kv_str("rpc.method", method));
    }
    if let Some(status) = t.grpc_status {
        a.push(kv_int("grpc.status", i64::from(status)));
        a.push(kv_int("rpc.grpc.status_code", i64::from(status)));
    }
    if let Some(v) = j.flow_control_ms {
        a.push(kv_f64("tokentrace.flow_control_ms", v));
    }
    if t.chunks_inexact {
        a.push(kv_bool("tokentrace.chunks_exact", false));
    }
    if let Some(status) = t.status {
        a.push(kv_int("http.response.status_code", i64::from(status)));
    }
    if let Some(addrs) = t.addrs {
        // the server is the local end of a server span, the peer of a
        // client span (semantic conventions: server.* and client.* name
        // the two ends, whichever side reports)
        let (server, client) = match t.kind {
            crate::model::SpanKind::Server => (addrs.local, addrs.remote),
            crate::model::SpanKind::Client => (addrs.remote, addrs.local),
        };
        a.push(kv_str("server.address", server.ip().to_string()));
        a.push(kv_int("server.port", i64::from(server.port())));
        a.push(kv_str("client.address", client.ip().to_string()));
        a.push(kv_int("client.port", i64::from(client.port())));
        if t.kind == crate::model::SpanKind::Client {
            a.push(kv_str("network.peer.address", server.ip().to_string()));
            a.push(kv_int("network.peer.port", i64::from(server.port())));
        }
    }
    if let Some(key) = t.trace.as_ref().and_then(|i| i.join_key) {
        a.push(kv_str("tokentrace.join_key", key.as_str()));
    }
    for (name, v) in [
        ("tokentrace.upstream_wait_ms", j.upstream_wait_ms),
        ("tokentrace.upstream_ttft_ms", j.upstream_ttft_ms),
        ("tokentrace.gateway_delivery_ms", j.gateway_delivery_ms),
        (
            "tokentrace.gateway_chunk_delay_p50_ms",
            j.gateway_chunk_delay_p50_ms,
        ),
        (
            "tokentrace.gateway_chunk_delay_max_ms",
            j.gateway_chunk_delay_max_ms,
        ),
    ] {
        if let Some(v) = v {
            a.push(kv_f64(name, v));
        }
    }
    if let Some(error) = error_type(t) {
        a.push(kv_str("error.type", error));
    }
    if let Some(op) = operation_name(&t.path) {
        a.push(kv_str("gen_ai.operation.name", op));
    }
    if let Some(model) = &t.model {
        a.push(kv_str("gen_ai.request.model", model.clone()));
    }
    if let Some(id) = &t.response_id {
        a.push(kv_str("gen_ai.response.id", id.clone()));
    }
    if let Some(usage) = t.usage {
        if let Some(n) = usage.prompt_tokens {
            a.push(kv_int(
                "gen_ai.usage.input_tokens",
                i64::try_from(n).unwrap_or(i64::MAX),
            ));
        }
        if let Some(n) = usage.completion_tokens {
            a.push(kv_int(
                "gen_ai.usage.output_tokens",
                i64::try_from(n).unwrap_or(i64::MAX),
            ));
        }
    }
    if let Some(v) = j.ttft_ms {
        a.push(kv_f64("tokentrace.ttft_ms", v));
    }
    a.push(kv_f64("tokentrace.e2e_ms", j.e2e_ms));
    a.push(kv_f64("tokentrace.request_read_ms", j.request_read_ms));
    for (name, value) in &t.request_headers {
        // Semantic conventions: `http.request.header.<key>` is a string[].
        a.push(kv_str_array(
            &format!("http.request.header.{name}"),
            [value.clone()],
        ));
    }
    for (key, v) in [
        ("tokentrace.socket_wait_ms", j.socket_wait_ms),
        ("tokentrace.accept_wait_ms", j.accept_wait_ms),
        ("tokentrace.tls_handshake_ms", j.tls_handshake_ms),
        ("tokentrace.ttft_from_read_ms", j.ttft_from_read_ms),
        ("tokentrace.itl_p50_ms", j.itl_p50_ms),
        ("tokentrace.itl_p95_ms", j.itl_p95_ms),
        ("tokentrace.itl_max_ms", j.itl_max_ms),
        ("tokentrace.tpot_ms", j.tpot_ms),
        ("tokentrace.queue_ms", j.queue_ms),
        ("tokentrace.prefill_ms", j.prefill_ms),
        ("tokentrace.preempted_ms", j.preempted_ms),
    ] {
        if let Some(v) = v {
            a.push(kv_f64(key, v));
        }
    }
    for (key, v) in [
        ("tokentrace.batch_fan_in", j.batch_fan_in),
        ("tokentrace.batch_steps", j.batch_steps),
        ("tokentrace.preemptions", j.preemptions),
    ] {
        if let Some(v) = v {
            a.push(kv_int(key, i64::try_from(v).unwrap_or(i64::MAX)));
        }
    }
    a.push(kv_int(
        "tokentrace.chunks",
        i64::try_from(j.chunks).unwrap_or(i64::MAX),
    ));
    a.push(kv_bool("tokentrace.stream", j.stream));
    if let Some(body) = j.body.and_then(|b| serde_plain::to_string(&b).ok()) {
        a.push(kv_str("tokentrace.body", body));
    }
    a.push(kv_bool("tokentrace.done", j.done));
    a.push(kv_bool("tokentrace.aborted", j.aborted));
    if let Some(reason) = j.abort_reason.and_then(|r| serde_plain::to_string(&r).ok()) {
        a.push(kv_str("tokentrace.abort_reason", reason));
    }
    if j.abort_reason == Some(crate::model::AbortReason::ClientClosed) {
        a.push(kv_int(
            "tokentrace.chunks_after_client_closed",
            i64::from(j.chunks_after_client_closed),
        ));
    }
    a.push(kv_int(
        "tokentrace.request_bytes",
        i64::try_from(j.request_bytes).unwrap_or(i64::MAX),
    ));
    a.push(kv_int(
        "tokentrace.response_bytes",
        i64::try_from(j.response_bytes).unwrap_or(i64::MAX),
    ));
    if j.truncated_writes > 0 {
        a.push(kv_int(
            "tokentrace.truncated_writes",
            i64::from(j.truncated_writes),
        ));
    }
    a.push(kv_int("tokentrace.fd", i64::from(t.conn.fd)));
    a.push(kv_bool("tokentrace.tls", j.tls));
    a
}

/// Stall events (and, opted in, one event per chunk), in time order, capped
/// at `max_events`; returns the events and how many were dropped.
fn events(t: &RequestTimeline, clock: &WallClock, settings: &SpanSettings) -> (Vec<Event>, u32) {
    let mut all: Vec<(MonoNs, Event)> = Vec::new();
    if settings.stall_threshold_ns > 0 {
        for (i, w) in t.chunk_ts.windows(2).enumerate() {
            let gap = w[1].saturating_sub(w[0]);
            if gap >= settings.stall_threshold_ns {
                let mut attributes = vec![
                    kv_f64("tokentrace.stall_ms", ms(gap)),
                    kv_int(
                        "tokentrace.chunk_index",
                        i64::try_from(i + 1).unwrap_or(i64::MAX),
                    ),
                ];
                // The engine/frontend split of the explainer's stall of
                // this chunk, when an `llm:token` mark fell inside it.
                if let Some(stall) = t.stalls.iter().find(|s| s.chunk == i + 1) {
                    for (key, v) in [
                        ("tokentrace.engine_ms", stall.engine_ms),
                        ("tokentrace.frontend_ms", stall.frontend_ms),
                    ] {
                        if let Some(v) = v {
                            attributes.push(kv_f64(key, v));
                        }
                    }
                    if stall.preempted_ms > 0.0 {
                        attributes.push(kv_f64("tokentrace.preempted_ms", stall.preempted_ms));
                    }
                }
                all.push((
                    w[0],
                    Event {
                        name: "tokentrace.stall".into(),
                        attributes,
                        ..Default::default()
                    },
                ));
            }
        }
    }
    if settings.chunk_events {
        for (i, &ts) in t.chunk_ts.iter().enumerate() {
            let attributes = vec![kv_int(
                "tokentrace.chunk_index",
                i64::try_from(i).unwrap_or(i64::MAX),
            )];
            all.push((
                ts,
                Event {
                    name: "tokentrace.chunk".into(),
                    attributes,
                    ..Default::default()
                },
            ));
        }
    }
    all.sort_by_key(|(ts, _)| *ts);
    let dropped = u32::try_from(all.len().saturating_sub(settings.max_events)).unwrap_or(u32::MAX);
    all.truncate(settings.max_events);
    let events = all
        .into_iter()
        .map(|(ts, mut e)| {
            e.time_unix_nano = clock.unix_nanos(ts);
            e
        })
        .collect();
    (events, dropped)
}

#[cfg(test)]
pub(crate) mod tests;
