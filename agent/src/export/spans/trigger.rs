//! A trigger's firing → one OTLP span, so the backend that holds the
//! request spans also says when and why the agent started recording.

use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::Span;

use crate::event::MonoNs;
use crate::export::attributes::{kv_f64, kv_int, kv_str};
use crate::model::trace_context::IdGenerator;
use crate::model::Firing;
use crate::units::WallClock;

/// The span's name; its attributes are `tokentrace.trigger.*`.
pub const TRIGGER_SPAN: &str = "tokentrace.trigger";

/// A root span covering the window the rule judged, ending at the firing.
pub fn trigger_span(f: &Firing, at: MonoNs, clock: &WallClock, ids: &mut IdGenerator) -> Span {
    let window_ns = (f.window_s * 1e9) as u64;
    let mut attributes = vec![
        kv_str("tokentrace.trigger.rule", f.rule.clone()),
        kv_str("tokentrace.trigger.metric", f.metric),
        kv_f64("tokentrace.trigger.value", f.value),
        kv_f64("tokentrace.trigger.above", f.above),
        kv_f64("tokentrace.trigger.window_s", f.window_s),
        kv_int("tokentrace.trigger.requests", f.requests as i64),
        kv_f64("tokentrace.trigger.history_s", f.history_s),
        kv_str("tokentrace.trigger.reason", f.describe()),
        kv_str("http.route", f.key.route.clone()),
    ];
    if !f.key.model.is_empty() {
        attributes.push(kv_str("gen_ai.request.model", f.key.model.clone()));
    }
    if let Some(id) = &f.session {
        attributes.push(kv_str("tokentrace.trigger.session", id.clone()));
    }
    if let Some(err) = &f.error {
        attributes.push(kv_str("tokentrace.trigger.error", err.clone()));
    }
    Span {
        trace_id: ids.trace_id().to_vec(),
        span_id: ids.span_id().to_vec(),
        name: TRIGGER_SPAN.to_string(),
        kind: SpanKind::Internal as i32,
        start_time_unix_nano: clock.unix_nanos(at.saturating_sub(window_ns)),
        end_time_unix_nano: clock.unix_nanos(at),
        attributes,
        ..Default::default()
    }
}
