//! The default output: one readable line per request.

use super::{ms, percentile};
use crate::stitch::RequestTimeline;

fn fmt_ms(ns: Option<u64>) -> String {
    ns.map_or_else(|| "-".to_string(), |ns| format!("{:.1}ms", ms(ns)))
}

/// `python3[4242] POST /v1/chat/completions 200 sse ttft=52.1ms itl p50=20.1ms p95=21.3ms max=25.0ms chunks=33 e2e=712.3ms id=chatcmpl-1`
pub fn text_line(t: &RequestTimeline) -> String {
    let mut itl = t.itl_ns();
    itl.sort_unstable();
    let kind = match t.body_kind {
        Some(kind) => serde_json::to_value(kind)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default(),
        None => "-".to_string(),
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
        fmt_ms(percentile(&itl, 50.0)),
        fmt_ms(percentile(&itl, 95.0)),
        fmt_ms(itl.last().copied()),
        t.chunk_ts.len(),
        fmt_ms(Some(t.e2e_ns())),
    );
    if let Some(id) = &t.response_id {
        line.push_str(&format!(" id={id}"));
    }
    if t.aborted {
        let reason = t
            .abort_reason
            .and_then(|r| serde_json::to_value(r).ok())
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_else(|| "unknown".into());
        line.push_str(&format!(" ABORTED({reason})"));
    }
    line
}
