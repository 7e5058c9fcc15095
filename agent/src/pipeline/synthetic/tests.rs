use super::*;
use crate::ingest::decode;
use crate::model::{BodyKind, RequestTimeline};
use crate::output::OutputFormat;
use crate::pipeline::Pipeline;
use crate::run::RecordReplay;
use crate::stitch::StitchConfig;

const THRESHOLD_NS: u64 = 30_000_000;

fn small() -> TrafficConfig {
    TrafficConfig {
        connections: 6,
        min_tokens: 3,
        max_tokens: 9,
        stall_every: 10,
        requests_per_connection: 2,
        ..TrafficConfig::default()
    }
}

/// Generated records of `steps` steps, decoded and stitched.
fn stitched(config: TrafficConfig, steps: usize) -> (Vec<RequestTimeline>, Pipeline) {
    let mut traffic = Traffic::new(config);
    let mut records = Records::default();
    for _ in 0..steps {
        traffic.step(&mut records);
    }
    let mut pipeline = Pipeline::new(StitchConfig::default(), THRESHOLD_NS, 120_000_000_000);
    let mut out = Vec::new();
    let mut last = 0;
    for record in records.iter() {
        let event = decode(record).unwrap_or_else(|e| panic!("generated record: {e}"));
        assert!(event.order_ts() >= last, "records out of order");
        last = event.order_ts();
        pipeline.push(&event, &mut out);
    }
    (out, pipeline)
}

#[test]
fn every_generated_stream_stitches_whole() {
    let (timelines, pipeline) = stitched(small(), 300);
    let stats = pipeline.stats();
    assert_eq!(stats.parse_errors, 0);
    assert_eq!(stats.requests_aborted, 0);
    // 6 clients, 300 steps of 20 ms, at most 9 tokens plus a think time of
    // at most 200 ms: every client finishes more than a handful.
    assert!(timelines.len() > 6 * 5, "{} requests", timelines.len());
    for t in &timelines {
        assert_eq!(t.status, Some(200));
        assert_eq!(t.body_kind, Some(BodyKind::Sse));
        assert!(t.done_seen);
        let usage = t.usage.unwrap_or_else(|| panic!("no usage in {t:?}"));
        let tokens = usage.completion_tokens.expect("completion tokens");
        assert!((3..=9).contains(&tokens));
        // one chunk per token, plus the usage chunk; [DONE] is not one
        assert_eq!(t.chunk_ts.len() as u64, tokens + 1);
        assert_eq!(t.model.as_deref(), Some(MODEL));
        assert!(t.traceparent.is_some());
        let id = t.response_id.as_deref().expect("response id");
        assert!(id.starts_with("chatcmpl-"), "{id}");
    }
    // clients reconnect after 2 requests: a later socket on a reused fd
    let fd = timelines[0].conn.fd;
    let inodes: std::collections::BTreeSet<u64> = timelines
        .iter()
        .filter(|t| t.conn.fd == fd)
        .map(|t| t.conn.sock_ino)
        .collect();
    assert!(inodes.len() >= 2, "{inodes:?}");
}

#[test]
fn slow_steps_come_out_as_stalls_with_their_cause() {
    let (timelines, _) = stitched(small(), 300);
    let stalls: Vec<_> = timelines.iter().flat_map(|t| t.stalls.iter()).collect();
    // GPU-slow steps: the engine's sync covers most of an 80 ms step.
    assert!(
        stalls.iter().any(|s| s.gpu_sync_ms > 40.0),
        "no GPU stall: {stalls:?}"
    );
    // Frontend-slow steps: written 50 ms after the tokens were ready, the
    // writer preempted for that long.
    assert!(
        stalls
            .iter()
            .any(|s| s.off_cpu_ms >= 45.0 && s.off_cpu_reason.as_deref() == Some("preempted")),
        "no preempted writer: {stalls:?}"
    );
    // Normal steps are 20 ms apart: under the threshold, never a stall.
    for s in &stalls {
        assert!(s.gap_ms >= 30.0, "{s:?}");
    }
}

#[test]
fn record_replay_renders_one_line_per_request() {
    let mut traffic = Traffic::new(small());
    let mut records = Records::default();
    for _ in 0..200 {
        traffic.step(&mut records);
    }
    let pipeline = Pipeline::new(StitchConfig::default(), THRESHOLD_NS, 120_000_000_000);
    let mut replay = RecordReplay::new(pipeline, OutputFormat::Json, Vec::new());
    for record in records.iter() {
        replay.push_record(record).expect("a Vec sink");
    }
    replay.push_record(&[1, 2, 3]).expect("a Vec sink");
    let (summary, counts, out) = replay.finish(traffic.now()).expect("a Vec sink");
    assert_eq!(counts.records, records.len() as u64 + 1);
    assert_eq!(counts.decode_errors, 1);
    assert_eq!(summary.events, records.len() as u64);
    let text = String::from_utf8(out).expect("utf-8 lines");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len() as u64, counts.requests);
    assert_eq!(summary.requests(), counts.requests);
    assert_eq!(counts.output_bytes, text.len() as u64);
    // the streams cut by the end come out aborted
    assert!(lines
        .iter()
        .any(|l| l.contains("\"abort_reason\":\"agent_stopped\"")));
    assert!(lines.iter().all(|l| l.starts_with("{\"pid\":4100,")));
}
