//! The default output: one readable line per request.

use crate::model::{EngineView, Stall};
use crate::model::{Protocol, RequestTimeline};
use crate::units::ms;

fn fmt_ms(ns: Option<u64>) -> String {
    ns.map_or_else(|| "-".to_string(), |ns| format!("{:.1}ms", ms(ns)))
}

/// The largest share of a stall, named as in the JSON fields.
fn main_cause(stall: &Stall) -> String {
    let off_cpu = match &stall.off_cpu_reason {
        Some(reason) => format!("off_cpu: {reason}"),
        None => "off_cpu".to_string(),
    };
    let socket = if stall.nagle {
        "socket: nagle"
    } else {
        "socket"
    }
    .to_string();
    [
        (stall.queue_ms, "queue".to_string()),
        (stall.preempted_ms, "preempted".to_string()),
        (stall.prefill_ms, "prefill".to_string()),
        (stall.gpu_sync_ms, "gpu_sync".to_string()),
        (stall.flow_control_ms, "flow_control".to_string()),
        (stall.off_cpu_ms, off_cpu),
        (stall.socket_ms, socket),
        (stall.unexplained_ms, "unexplained".to_string()),
    ]
    .into_iter()
    .max_by(|a, b| a.0.total_cmp(&b.0))
    .map(|(_, name)| name)
    .unwrap_or_default()
}

/// The engine's account: ` queue=1.2ms prefill=3.4ms batch_fan_in=4 preempted=1 (20.0ms)`.
fn engine_part(e: &EngineView) -> String {
    let mut part = String::new();
    if let Some(q) = e.queue_ms {
        part.push_str(&format!(" queue={q:.1}ms"));
    }
    if let Some(p) = e.prefill_ms {
        part.push_str(&format!(" prefill={p:.1}ms"));
    }
    if let Some(n) = e.batch_fan_in {
        part.push_str(&format!(" batch_fan_in={n}"));
    }
    if e.preemptions > 0 {
        part.push_str(&format!(
            " preempted={} ({:.1}ms)",
            e.preemptions, e.preempted_ms
        ));
    }
    part
}

/// `python3[4242] POST /v1/chat/completions 200 sse ttft=52.1ms itl p50=20.1ms p95=21.3ms max=25.0ms chunks=33 e2e=712.3ms id=chatcmpl-1`
pub fn text_line(t: &RequestTimeline) -> String {
    let stats = t.stats();
    let kind = match t.body_kind {
        Some(kind) => serde_plain::to_string(&kind).unwrap_or_default(),
        None => "-".to_string(),
    };
    let kind = match t.protocol {
        Protocol::H2 => format!("h2/{kind}"),
        Protocol::Http11 | Protocol::Grpc => kind,
    };
    let mut line = format!(
        "{}[{}] {} {} {} {} ttft={} itl p50={} p95={} max={} chunks={} e2e={}",
        t.comm,
        t.conn.pid,
        t.method,
        t.path,
        t.status.map_or_else(|| "-".to_string(), |s| s.to_string()),
        kind,
        fmt_ms(t.ttft_ns()),
        fmt_ms(stats.itl_percentile_ns(50.0)),
        fmt_ms(stats.itl_percentile_ns(95.0)),
        fmt_ms(stats.itl_max_ns()),
        t.chunk_ts.len(),
        fmt_ms(Some(t.e2e_ns())),
    );
    if let Some(wait) = t.socket_wait_ns() {
        line.push_str(&format!(" socket_wait={}", fmt_ms(Some(wait))));
    }
    if let Some(status) = t.grpc_status {
        line.push_str(&format!(" grpc_status={status}"));
    }
    if let Some(wait) = t.flow_control_ns().filter(|&w| w > 0) {
        line.push_str(&format!(" flow_control={}", fmt_ms(Some(wait))));
    }
    if t.chunks_inexact {
        line.push_str(" chunks_inexact");
    }
    if let Some(id) = t.request_id() {
        line.push_str(&format!(" request_id={id}"));
    }
    if let Some(id) = &t.response_id {
        line.push_str(&format!(" id={id}"));
    }
    if let Some(engine) = &t.engine {
        line.push_str(&engine_part(engine));
    }
    if let Some(worst) = t.stalls.iter().max_by(|a, b| a.gap_ms.total_cmp(&b.gap_ms)) {
        line.push_str(&format!(
            " stalls={} worst=chunk {} {:.1}ms ({})",
            t.stalls.len(),
            worst.chunk,
            worst.gap_ms.max(worst.socket_ms),
            main_cause(worst)
        ));
    }
    if t.aborted {
        let reason = t
            .abort_reason
            .and_then(|r| serde_plain::to_string(&r).ok())
            .unwrap_or_else(|| "unknown".into());
        line.push_str(&format!(" ABORTED({reason})"));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::ConnId;
    use crate::model::BodyKind;

    #[test]
    fn line_names_the_worst_stall_and_its_main_cause() {
        let stall = |chunk, gap_ms, gpu_sync_ms, off_cpu_ms| Stall {
            chunk,
            gap_ms,
            gpu_sync_ms,
            off_cpu_ms,
            off_cpu_reason: Some("sleep".into()),
            ..Stall::default()
        };
        let t = RequestTimeline {
            conn: ConnId {
                pid: 7,
                fd: 3,
                sock_ino: 1,
            },
            comm: "python3".into(),
            addrs: None,
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            traceparent: None,
            tracestate: None,
            model: None,
            request_start: 0,
            read_start: 0,
            ingress_known: true,
            accept_wait_ns: None,
            tls_handshake_ns: None,
            request_headers: Vec::new(),
            chunks_after_client_closed: 0,
            request_end: 0,
            request_bytes: 0,
            status: Some(200),
            content_type: None,
            body_kind: Some(BodyKind::Sse),
            response_start: None,
            first_body_byte: Some(10_000_000),
            chunk_ts: vec![10_000_000, 65_000_000, 110_000_000],
            end: 110_000_000,
            response_bytes: 0,
            done_seen: true,
            aborted: false,
            abort_reason: None,
            response_id: Some("chatcmpl-9".into()),
            usage: None,
            truncated_writes: 0,
            tls: false,
            stalls: vec![stall(1, 55.0, 50.0, 5.0), stall(2, 45.0, 0.0, 40.0)],
            ..RequestTimeline::default()
        };
        let line = text_line(&t);
        assert!(
            line.ends_with("id=chatcmpl-9 stalls=2 worst=chunk 1 55.0ms (gpu_sync)"),
            "{line}"
        );
        assert!(line.contains("chunks=3"), "{line}");

        let mut preempted = stall(1, 55.0, 0.0, 5.0);
        preempted.preempted_ms = 45.0;
        let vllm = RequestTimeline {
            engine: Some(EngineView {
                queue_ms: Some(12.0),
                prefill_ms: Some(3.25),
                batch_fan_in: Some(4),
                batch_steps: 2,
                preemptions: 1,
                preempted_ms: 45.0,
            }),
            stalls: vec![preempted],
            ..t
        };
        let line = text_line(&vllm);
        assert!(
            line.ends_with(
                "id=chatcmpl-9 queue=12.0ms prefill=3.2ms batch_fan_in=4 preempted=1 (45.0ms) \
                 stalls=1 worst=chunk 1 55.0ms (preempted)"
            ),
            "{line}"
        );
    }
}
