//! Heap bytes held by queued spans, so the export queue's memory with a
//! dead backend is a number the agent reports (`tokentrace_export_queue_bytes`)
//! rather than a guess: `queue_size` requests of this many bytes each, plus
//! the batch being retried, is the bound the design promises.
//!
//! Counts what the proto messages own on the heap (capacities, not lengths,
//! since capacity is what the allocator handed out) plus a malloc header per
//! allocation; not the allocator's free-list slack, which is measured
//! outside (tests/otel_export.rs).

use std::mem::size_of;

use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, KeyValue};
use opentelemetry_proto::tonic::trace::v1::Span;

/// glibc's per-chunk overhead on 64-bit (the size field; chunks are
/// 16-byte aligned, which `alloc` rounds to).
const MALLOC_HEADER: usize = 8;

/// Bytes one heap allocation of `capacity` elements of `T` takes.
fn alloc<T>(capacity: usize) -> usize {
    let bytes = capacity * size_of::<T>();
    if bytes == 0 {
        return 0;
    }
    (bytes + MALLOC_HEADER).div_ceil(16) * 16
}

fn string(s: &String) -> usize {
    alloc::<u8>(s.capacity())
}

fn any_value(v: &AnyValue) -> usize {
    match &v.value {
        Some(any_value::Value::StringValue(s)) => string(s),
        Some(any_value::Value::BytesValue(b)) => alloc::<u8>(b.capacity()),
        Some(any_value::Value::ArrayValue(a)) => {
            alloc::<AnyValue>(a.values.capacity()) + a.values.iter().map(any_value).sum::<usize>()
        }
        Some(any_value::Value::KvlistValue(l)) => key_values(&l.values),
        _ => 0,
    }
}

fn key_values(kvs: &Vec<KeyValue>) -> usize {
    alloc::<KeyValue>(kvs.capacity())
        + kvs
            .iter()
            .map(|kv| string(&kv.key) + kv.value.as_ref().map_or(0, any_value))
            .sum::<usize>()
}

/// Heap bytes of one span and everything it owns.
pub fn span_bytes(s: &Span) -> usize {
    let ids = alloc::<u8>(s.trace_id.capacity())
        + alloc::<u8>(s.span_id.capacity())
        + alloc::<u8>(s.parent_span_id.capacity());
    let strings = string(&s.name)
        + string(&s.trace_state)
        + s.status.as_ref().map_or(0, |st| string(&st.message));
    let events = alloc::<opentelemetry_proto::tonic::trace::v1::span::Event>(s.events.capacity())
        + s.events
            .iter()
            .map(|e| string(&e.name) + key_values(&e.attributes))
            .sum::<usize>();
    let links = alloc::<opentelemetry_proto::tonic::trace::v1::span::Link>(s.links.capacity())
        + s.links
            .iter()
            .map(|l| {
                alloc::<u8>(l.trace_id.capacity())
                    + alloc::<u8>(l.span_id.capacity())
                    + string(&l.trace_state)
                    + key_values(&l.attributes)
            })
            .sum::<usize>();
    ids + strings + key_values(&s.attributes) + events + links
}

/// Heap bytes of one request's spans (the `Vec` and what each span owns).
pub fn spans_bytes(spans: &Vec<Span>) -> u64 {
    let bytes = alloc::<Span>(spans.capacity()) + spans.iter().map(span_bytes).sum::<usize>();
    bytes as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry_proto::tonic::trace::v1::span::Event;

    fn kv(key: &str, value: &str) -> KeyValue {
        KeyValue {
            key: key.to_string(),
            value: Some(AnyValue {
                value: Some(any_value::Value::StringValue(value.to_string())),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn counts_every_owned_allocation_by_capacity() {
        let empty = Span::default();
        assert_eq!(span_bytes(&empty), 0, "an empty span owns nothing");
        let mut name = String::with_capacity(100);
        name.push_str("POST /v1/chat/completions");
        let one = Span {
            name,
            ..Default::default()
        };
        assert_eq!(span_bytes(&one), 112, "100 bytes + header, 16-aligned");

        let event = Event {
            name: "tokentrace.chunk".into(),
            attributes: vec![kv("tokentrace.chunk.index", "1")],
            ..Default::default()
        };
        let with_events = Span {
            events: vec![event.clone(); 200],
            ..Default::default()
        };
        let per_event = alloc::<u8>(16) + alloc::<KeyValue>(1) + alloc::<u8>(22) + alloc::<u8>(1);
        assert_eq!(
            span_bytes(&with_events),
            alloc::<Event>(200) + 200 * per_event
        );
        // doubling the events doubles what they own (plus the larger array)
        let twice = Span {
            events: vec![event; 400],
            ..Default::default()
        };
        assert_eq!(span_bytes(&twice), alloc::<Event>(400) + 400 * per_event);
    }
}
