//! `--output json`: one object per finished request.
//!
//! Field names are a public interface (users' scripts read them): add
//! fields, never rename them. Payload text is never included.

use serde::Serialize;

use super::ms_format::MsFormatter;
use crate::model::{AbortReason, BodyKind, JoinKey, Protocol, RequestTimeline, SpanKind, Usage};
use crate::units::ms;

#[derive(Debug, Serialize)]
pub struct JsonTimeline<'a> {
    pub pid: u32,
    pub comm: &'a str,
    pub method: &'a str,
    pub path: &'a str,
    pub status: Option<u16>,
    pub stream: bool,
    pub body: Option<BodyKind>,
    /// From the request's arrival at the host (`request_start_ns`).
    pub ttft_ms: Option<f64>,
    pub e2e_ms: f64,
    /// From the server's read of the request's first byte to its last.
    pub request_read_ms: f64,
    /// Arrival at the host → the server's first read of the request; null
    /// when the request arrived before its socket was tracked.
    pub socket_wait_ms: Option<f64>,
    /// First request of a connection: established → `accept()` returned.
    pub accept_wait_ms: Option<f64>,
    /// First request of a TLS connection: ClientHello arrival → the
    /// client's Finished arrival (the kernel's TLS record walk), else →
    /// `SSL_do_handshake` succeeded.
    pub tls_handshake_ms: Option<f64>,
    /// TTFT counted from the server's read (what the server itself sees).
    pub ttft_from_read_ms: Option<f64>,
    pub chunks: usize,
    pub chunk_offsets_ms: Vec<f64>,
    pub itl_ms: Vec<f64>,
    pub itl_p50_ms: Option<f64>,
    pub itl_p95_ms: Option<f64>,
    pub itl_max_ms: Option<f64>,
    /// (E2E − TTFT) / (chunks − 1), when there are at least two chunks.
    pub tpot_ms: Option<f64>,
    pub aborted: bool,
    pub abort_reason: Option<AbortReason>,
    /// Chunks written at or after the client left (`client_closed` only).
    pub chunks_after_client_closed: u32,
    /// Value of the first configured request-id header (`x-request-id`).
    pub request_id: Option<&'a str>,
    pub response_id: Option<&'a str>,
    pub model: Option<&'a str>,
    pub usage: Option<Usage>,
    pub done: bool,
    /// Kernel CLOCK_MONOTONIC of the request's first byte reaching the host
    /// (the read's exit when that is unknown).
    pub request_start_ns: u64,
    /// Kernel CLOCK_MONOTONIC of the return of the read that brought it.
    pub read_start_ns: u64,
    pub local_addr: Option<String>,
    pub peer_addr: Option<String>,
    pub fd: i32,
    pub request_bytes: u64,
    pub response_bytes: u64,
    pub truncated_writes: u32,
    pub tls: bool,
    /// `http/1.1`, `h2` or `grpc`.
    pub protocol: Protocol,
    /// HTTP/2 stream id.
    pub stream_id: Option<u32>,
    /// gRPC: `grpc-status` of the trailers.
    pub grpc_status: Option<u32>,
    /// gRPC: length of `grpc-message` (never its text).
    pub grpc_message_bytes: Option<u64>,
    /// gRPC: `grpc`, with the service and method of the path.
    pub rpc_system: Option<&'static str>,
    pub rpc_service: Option<&'a str>,
    pub rpc_method: Option<&'a str>,
    /// False when uncaptured bytes hid a frame header or a gRPC message
    /// prefix: `chunks` is then a lower bound.
    pub chunks_exact: bool,
    /// HTTP/2: time this stream's writes waited for the client's
    /// WINDOW_UPDATE; null for HTTP/1.1.
    pub flow_control_ms: Option<f64>,
    /// Late chunks with their cause breakdown (see `model::Stall`).
    pub stalls: &'a [crate::model::Stall],
    /// The engine's account (`llm:*` probes, e.g. vLLM with tokentrace-vllm;
    /// see `model::EngineView`); null without them.
    pub queue_ms: Option<f64>,
    pub prefill_ms: Option<f64>,
    pub batch_fan_in: Option<u64>,
    pub batch_steps: Option<u64>,
    pub preemptions: Option<u64>,
    pub preempted_ms: Option<f64>,
    /// `server` (the process read the request) or `client` (it wrote it:
    /// a gateway's upstream call, timed from the write of its first byte
    /// to the arrival of the response's bytes at the host).
    pub span_kind: SpanKind,
    /// The same ids as the request's spans (lower-case hex): one trace for
    /// a gateway's request, its upstream call and the engine's request.
    pub trace_id: Option<String>,
    pub span_id: Option<String>,
    pub parent_span_id: Option<String>,
    /// What tied this request to its parent hop (`tcp_4tuple`,
    /// `traceparent`, `request_id`, `response_id`); null for a root or a
    /// remote parent.
    pub join_key: Option<&'static str>,
    /// A gateway's request with a joined upstream call: its arrival → the
    /// upstream request written; → the upstream's first chunk arrived
    /// back; → its own first chunk written. They add up to `ttft_ms`.
    pub upstream_wait_ms: Option<f64>,
    pub upstream_ttft_ms: Option<f64>,
    pub gateway_delivery_ms: Option<f64>,
    /// Per chunk, the gateway's emit − the upstream chunk's arrival.
    pub gateway_chunk_delay_p50_ms: Option<f64>,
    pub gateway_chunk_delay_max_ms: Option<f64>,
    pub upstream_peer_addr: Option<String>,
}

/// Lower-case hex, as W3C `traceparent` and the tracing backends write ids.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl<'a> JsonTimeline<'a> {
    pub fn new(t: &'a RequestTimeline) -> Self {
        let stats = t.stats();
        let rpc = t.rpc_service_method();
        let engine = t.engine.as_ref();
        let up = t.upstream.as_ref();
        Self {
            pid: t.conn.pid,
            comm: &t.comm,
            method: &t.method,
            path: &t.path,
            status: t.status,
            stream: t.is_stream(),
            body: t.body_kind,
            ttft_ms: t.ttft_ns().map(ms),
            e2e_ms: ms(t.e2e_ns()),
            request_read_ms: ms(t.request_end.saturating_sub(t.read_start)),
            socket_wait_ms: t.socket_wait_ns().map(ms),
            accept_wait_ms: t.accept_wait_ns.map(ms),
            tls_handshake_ms: t.tls_handshake_ns.map(ms),
            ttft_from_read_ms: t.ttft_from_read_ns().map(ms),
            chunks: t.chunk_ts.len(),
            chunk_offsets_ms: t.chunk_offsets_ns().into_iter().map(ms).collect(),
            itl_ms: stats.itl_ns.iter().copied().map(ms).collect(),
            itl_p50_ms: stats.itl_percentile_ns(50.0).map(ms),
            itl_p95_ms: stats.itl_percentile_ns(95.0).map(ms),
            itl_max_ms: stats.itl_max_ns().map(ms),
            tpot_ms: stats.tpot_ns.map(ms),
            aborted: t.aborted,
            abort_reason: t.abort_reason,
            chunks_after_client_closed: t.chunks_after_client_closed,
            request_id: t.request_id(),
            response_id: t.response_id.as_deref(),
            model: t.model.as_deref(),
            usage: t.usage,
            done: t.done_seen,
            request_start_ns: t.request_start,
            read_start_ns: t.read_start,
            local_addr: t.addrs.map(|a| a.local.to_string()),
            peer_addr: t.addrs.map(|a| a.remote.to_string()),
            fd: t.conn.fd,
            request_bytes: t.request_bytes,
            response_bytes: t.response_bytes,
            truncated_writes: t.truncated_writes,
            tls: t.tls,
            protocol: t.protocol,
            stream_id: t.stream_id,
            grpc_status: t.grpc_status,
            grpc_message_bytes: t.grpc_message_bytes,
            rpc_system: rpc.map(|_| "grpc"),
            rpc_service: rpc.map(|(s, _)| s),
            rpc_method: rpc.map(|(_, m)| m),
            chunks_exact: !t.chunks_inexact,
            flow_control_ms: t.flow_control_ns().map(ms),
            stalls: &t.stalls,
            queue_ms: engine.and_then(|e| e.queue_ms),
            prefill_ms: engine.and_then(|e| e.prefill_ms),
            batch_fan_in: engine.and_then(|e| e.batch_fan_in),
            batch_steps: engine.map(|e| e.batch_steps),
            preemptions: engine.map(|e| e.preemptions),
            preempted_ms: engine.map(|e| e.preempted_ms),
            span_kind: t.kind,
            trace_id: t.trace.as_ref().map(|i| hex(&i.trace_id)),
            span_id: t.trace.as_ref().map(|i| hex(&i.span_id)),
            parent_span_id: t
                .trace
                .as_ref()
                .and_then(|i| i.parent_span_id)
                .map(|p| hex(&p)),
            join_key: t
                .trace
                .as_ref()
                .and_then(|i| i.join_key)
                .map(JoinKey::as_str),
            upstream_wait_ms: up.map(|u| ms(u.wait_ns)),
            upstream_ttft_ms: up.and_then(|u| u.ttft_ns).map(ms),
            gateway_delivery_ms: up.and_then(|u| u.delivery_ns).map(ms),
            gateway_chunk_delay_p50_ms: up.and_then(|u| u.chunk_delay_p50_ns).map(ms),
            gateway_chunk_delay_max_ms: up.and_then(|u| u.chunk_delay_max_ns).map(ms),
            upstream_peer_addr: up.and_then(|u| u.peer).map(|a| a.to_string()),
        }
    }

    pub fn to_line(&self) -> String {
        // Sized up front: a streamed response's two per-chunk arrays are
        // most of the line (~10 bytes a number), and growing to them
        // copied the line over and over.
        let numbers = self.chunk_offsets_ms.len() + self.itl_ms.len();
        let mut line = Vec::with_capacity(1024 + 12 * numbers);
        let mut json = serde_json::Serializer::with_formatter(&mut line, MsFormatter);
        // Serialising plain fields of owned/borrowed data cannot fail, and
        // serde_json writes valid UTF-8.
        match self.serialize(&mut json) {
            Ok(()) => String::from_utf8(line).unwrap_or_default(),
            Err(err) => format!("{{\"error\":\"{err}\"}}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http2_fields_are_present_on_every_line_and_null_for_http1() {
        let h1 = RequestTimeline::default();
        let v: serde_json::Value =
            serde_json::from_str(&JsonTimeline::new(&h1).to_line()).expect("json");
        assert_eq!(v["protocol"], "http/1.1");
        for key in [
            "stream_id",
            "grpc_status",
            "rpc_system",
            "rpc_service",
            "flow_control_ms",
        ] {
            assert!(v[key].is_null(), "{key}: {v}");
        }
        assert_eq!(v["chunks_exact"], true);

        let grpc = RequestTimeline {
            protocol: Protocol::Grpc,
            stream_id: Some(3),
            path: "/inference.GRPCInferenceService/ModelStreamInfer".into(),
            body_kind: Some(BodyKind::Grpc),
            grpc_status: Some(8),
            grpc_message_bytes: Some(17),
            chunks_inexact: true,
            chunk_ts: vec![5, 9],
            ..RequestTimeline::default()
        };
        let v: serde_json::Value =
            serde_json::from_str(&JsonTimeline::new(&grpc).to_line()).expect("json");
        assert_eq!(v["protocol"], "grpc");
        assert_eq!(v["body"], "grpc");
        assert_eq!(v["stream_id"], 3);
        assert_eq!(v["grpc_status"], 8);
        assert_eq!(v["grpc_message_bytes"], 17);
        assert_eq!(v["rpc_system"], "grpc");
        assert_eq!(v["rpc_service"], "inference.GRPCInferenceService");
        assert_eq!(v["rpc_method"], "ModelStreamInfer");
        assert_eq!(v["chunks_exact"], false);
        assert_eq!(v["flow_control_ms"], 0.0);
        assert_eq!(v["chunks"], 2);
    }

    #[test]
    fn engine_fields_are_null_without_marks_and_flat_with_them() {
        let plain = RequestTimeline::default();
        let v: serde_json::Value =
            serde_json::from_str(&JsonTimeline::new(&plain).to_line()).expect("json");
        for key in [
            "queue_ms",
            "prefill_ms",
            "batch_fan_in",
            "batch_steps",
            "preemptions",
            "preempted_ms",
        ] {
            assert!(v[key].is_null(), "{key}: {v}");
        }
        let vllm = RequestTimeline {
            engine: Some(crate::model::EngineView {
                queue_ms: Some(12.5),
                prefill_ms: Some(3.0),
                batch_fan_in: Some(4),
                batch_steps: 16,
                preemptions: 1,
                preempted_ms: 40.0,
            }),
            ..RequestTimeline::default()
        };
        let v: serde_json::Value =
            serde_json::from_str(&JsonTimeline::new(&vllm).to_line()).expect("json");
        assert_eq!(v["queue_ms"], 12.5);
        assert_eq!(v["prefill_ms"], 3.0);
        assert_eq!(v["batch_fan_in"], 4);
        assert_eq!(v["batch_steps"], 16);
        assert_eq!(v["preemptions"], 1);
        assert_eq!(v["preempted_ms"], 40.0);
    }
}
