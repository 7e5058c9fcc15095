use super::*;
use crate::event::{ConnId, SockAddrs};

fn conn(pid: u32, fd: i32) -> ConnId {
    ConnId {
        pid,
        fd,
        sock_ino: u64::from(pid) * 100 + fd as u64,
    }
}

fn request(
    kind: SpanKind,
    pid: u32,
    local: &str,
    remote: &str,
    start: u64,
    chunks: &[u64],
    end: u64,
) -> RequestTimeline {
    let mut t = RequestTimeline {
        conn: conn(pid, 5),
        kind,
        addrs: Some(SockAddrs {
            local: local.parse().expect("address"),
            remote: remote.parse().expect("address"),
        }),
        request_start: start,
        read_start: start,
        request_end: start,
        body_kind: Some(crate::model::BodyKind::Sse),
        end,
        ..RequestTimeline::default()
    };
    for &c in chunks {
        t.push_chunk(c);
    }
    t
}

/// Gateway (pid 1) in :80, out 40000 → :8000; engine (pid 2) on :8000.
fn path(start: u64, id: &str) -> [RequestTimeline; 3] {
    let mut gateway = request(
        SpanKind::Server,
        1,
        "127.0.0.1:80",
        "127.0.0.1:5000",
        start,
        &[start + 400, start + 600],
        start + 700,
    );
    let mut client = request(
        SpanKind::Client,
        1,
        "127.0.0.1:40000",
        "127.0.0.1:8000",
        start + 100,
        &[start + 350, start + 550],
        start + 650,
    );
    let engine = request(
        SpanKind::Server,
        2,
        "127.0.0.1:8000",
        "127.0.0.1:40000",
        start + 110,
        &[start + 300, start + 500],
        start + 600,
    );
    gateway.request_headers = vec![("x-request-id".into(), id.into())];
    client.request_headers = vec![("x-request-id".into(), id.into())];
    [gateway, client, engine]
}

fn ids(t: &RequestTimeline) -> &TraceIds {
    t.trace
        .as_ref()
        .expect("every request that goes out has ids")
}

#[test]
fn gateway_client_and_engine_share_one_trace_nested() {
    let mut hops = Hops::new(IdGenerator::with_seed(3));
    let [gateway, client, engine] = path(1000, "r1");
    let mut out = Vec::new();
    // innermost first, as they finish
    hops.push(engine, true, &mut out);
    assert!(out.is_empty(), "the engine waits for its client request");
    hops.push(client, false, &mut out);
    assert!(out.is_empty(), "the client request waits for its gateway");
    hops.push(gateway, false, &mut out);
    assert_eq!(out.len(), 3);
    let (g, c, e) = (&out[0], &out[1], &out[2]);
    assert_eq!(
        (g.kind, c.kind, e.conn.pid),
        (SpanKind::Server, SpanKind::Client, 2)
    );
    assert_eq!(ids(g).trace_id, ids(c).trace_id);
    assert_eq!(ids(c).trace_id, ids(e).trace_id);
    assert_eq!(ids(g).parent_span_id, None);
    assert_eq!(ids(c).parent_span_id, Some(ids(g).span_id));
    assert_eq!(ids(e).parent_span_id, Some(ids(c).span_id));
    assert_eq!(ids(c).join_key, Some(JoinKey::RequestId));
    assert_eq!(ids(e).join_key, Some(JoinKey::Tcp4tuple));
    let up = g.upstream.expect("the gateway's breakdown");
    assert_eq!(up.wait_ns, 100);
    assert_eq!(up.ttft_ns, Some(250));
    assert_eq!(up.delivery_ns, Some(50));
    assert_eq!(
        up.wait_ns + up.ttft_ns.unwrap_or(0) + up.delivery_ns.unwrap_or(0),
        g.ttft_ns().unwrap_or(1)
    );
    assert_eq!(
        (up.chunk_delay_p50_ns, up.chunk_delay_max_ns),
        (Some(50), Some(50))
    );
    assert_eq!(hops.stats().joined_request_id, 1);
    assert_eq!(hops.stats().joined_tcp_4tuple, 1);
}

#[test]
fn a_callers_traceparent_roots_the_trace() {
    let mut hops = Hops::new(IdGenerator::with_seed(3));
    let [mut gateway, client, engine] = path(1000, "r1");
    gateway.traceparent = Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into());
    let mut out = Vec::new();
    hops.push(engine, true, &mut out);
    hops.push(client, false, &mut out);
    hops.push(gateway, false, &mut out);
    let g = ids(&out[0]);
    assert_eq!(hex(&g.trace_id), "0af7651916cd43dd8448eb211c80319c");
    assert_eq!(
        g.parent_span_id.map(|p| hex(&p)).as_deref(),
        Some("b7ad6b7169203331")
    );
    assert!(g.parent_remote);
    assert!(out.iter().all(|t| ids(t).trace_id == g.trace_id));
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn a_key_two_concurrent_requests_share_joins_nothing() {
    let mut hops = Hops::new(IdGenerator::with_seed(3));
    let [g1, mut c1, e1] = path(1000, "same");
    let [g2, mut c2, mut e2] = path(1050, "same");
    // second path on its own upstream connection
    c2.addrs = Some(SockAddrs {
        local: "127.0.0.1:40001".parse().expect("address"),
        remote: "127.0.0.1:8000".parse().expect("address"),
    });
    e2.addrs = Some(SockAddrs {
        local: "127.0.0.1:8000".parse().expect("address"),
        remote: "127.0.0.1:40001".parse().expect("address"),
    });
    c1.response_id = Some("x".into());
    c2.response_id = Some("x".into());
    let mut out = Vec::new();
    for (t, answers) in [
        (e1, true),
        (e2, true),
        (c1, false),
        (c2, false),
        (g1, false),
        (g2, false),
    ] {
        hops.push(t, answers, &mut out);
    }
    // the gateways went out, their clients wait
    assert_eq!(out.len(), 2);
    assert!(out.iter().all(|t| ids(t).parent_span_id.is_none()));
    assert!(hops.stats().ambiguous > 0);
    hops.expire(1000 + HOLD_NS + 10_000, &mut out);
    assert_eq!(out.len(), 6);
    assert_eq!(hops.stats().unjoined_client_requests, 2);
    // each engine still joined its own client exactly (4-tuple)
    for e in out.iter().filter(|t| t.conn.pid == 2) {
        let parent = out
            .iter()
            .find(|t| Some(ids(t).span_id) == ids(e).parent_span_id)
            .expect("the engine's parent went out");
        assert_eq!(parent.kind, SpanKind::Client);
        assert_eq!(
            parent.addrs.expect("addrs").local,
            e.addrs.expect("addrs").remote
        );
    }
}

#[test]
fn a_server_nobody_traced_calls_goes_out_at_once() {
    let mut hops = Hops::new(IdGenerator::with_seed(3));
    let [_, _, engine] = path(1000, "r1");
    let mut out = Vec::new();
    hops.push(engine, false, &mut out);
    assert_eq!(out.len(), 1);
    assert!(ids(&out[0]).parent_span_id.is_none());
}

#[test]
fn held_requests_are_bounded() {
    let mut hops = Hops::new(IdGenerator::with_seed(3));
    let mut out = Vec::new();
    for i in 0..(MAX_HELD as u64 + 10) {
        let [_, client, _] = path(1000 + i * 1000, &i.to_string());
        hops.push(client, false, &mut out);
    }
    assert_eq!(out.len(), 10, "the oldest went out unjoined");
    assert_eq!(hops.stats().unjoined_client_requests, 10);
    hops.flush(&mut out);
    assert_eq!(out.len(), MAX_HELD + 10);
}

#[test]
fn a_pooled_connection_reused_for_thousands_of_requests_joins_each_exactly() {
    // One keep-alive upstream connection (the same 4-tuple every time),
    // 10,000 requests one after another: each engine request is tied to
    // the client request in flight on it, never to an earlier one.
    let mut hops = Hops::new(IdGenerator::with_seed(3));
    let mut out = Vec::new();
    let n = 10_000u64;
    for i in 0..n {
        let [gateway, client, engine] = path(1000 + i * 1000, &format!("r{i}"));
        hops.push(engine, true, &mut out);
        hops.push(client, false, &mut out);
        hops.push(gateway, false, &mut out);
    }
    assert_eq!(out.len() as u64, 3 * n, "nothing left waiting");
    for trio in out.chunks(3) {
        let [g, c, e] = trio else { unreachable!() };
        assert_eq!(ids(c).parent_span_id, Some(ids(g).span_id));
        assert_eq!(ids(e).parent_span_id, Some(ids(c).span_id));
        assert_eq!(e.request_start, c.request_start + 10);
    }
    let s = hops.stats();
    assert_eq!((s.joined_tcp_4tuple, s.joined_request_id), (n, n));
    assert_eq!((s.ambiguous, s.unjoined_client_requests), (0, 0));
}

#[test]
fn a_gateway_passing_events_through_unchanged_is_joined_by_its_first_event() {
    let mut hops = Hops::new(IdGenerator::with_seed(3));
    let mut out = Vec::new();
    let [mut gateway, mut client, engine] = path(1000, "");
    // it forwards no id header and the events carry no id
    gateway.request_headers.clear();
    client.request_headers.clear();
    gateway.first_event_hash = Some(0xfeed);
    client.first_event_hash = Some(0xfeed);
    hops.push(engine, true, &mut out);
    hops.push(client, false, &mut out);
    hops.push(gateway, false, &mut out);
    assert_eq!(out.len(), 3);
    assert_eq!(ids(&out[1]).join_key, Some(JoinKey::FirstEvent));
    assert_eq!(ids(&out[1]).parent_span_id, Some(ids(&out[0]).span_id));
    assert_eq!(hops.stats().joined_first_event, 1);
}

#[test]
fn identical_first_events_of_concurrent_requests_join_neither() {
    let mut hops = Hops::new(IdGenerator::with_seed(3));
    let mut out = Vec::new();
    let [mut g1, mut c1, _] = path(1000, "");
    let [mut g2, mut c2, _] = path(1050, "");
    c2.addrs = Some(SockAddrs {
        local: "127.0.0.1:40001".parse().expect("address"),
        remote: "127.0.0.1:8000".parse().expect("address"),
    });
    for t in [&mut g1, &mut c1, &mut g2, &mut c2] {
        t.request_headers.clear();
        t.first_event_hash = Some(0x1); // "data: {\"token\":\"Hello\"}" on both
    }
    for t in [c1, c2, g1, g2] {
        hops.push(t, false, &mut out);
    }
    assert!(out.iter().all(|t| ids(t).join_key.is_none()));
    assert!(hops.stats().ambiguous > 0);
    assert_eq!(hops.stats().joined_first_event, 0);
}
