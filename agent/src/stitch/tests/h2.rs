//! HTTP/2 and gRPC: streams multiplexed on one connection, gRPC messages,
//! SSE over HTTP/2, resets, flow control, mid-connection attach, the
//! `h2c` upgrade, and what uncaptured or malformed bytes do.

use super::*;
use crate::fuzz::seeds::{grpc_message, h2_frame as frame, hpack_literals};
use crate::model::Protocol;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0;
const HEADERS: u8 = 1;
const RST_STREAM: u8 = 3;
const SETTINGS: u8 = 4;
const GOAWAY: u8 = 7;
const WINDOW_UPDATE: u8 = 8;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;

/// HPACK: each header as a literal without indexing — what a decoder must
/// always read, whatever its table.
fn block(headers: &[(&str, &str)]) -> Vec<u8> {
    hpack_literals(headers, false)
}

fn grpc_request(stream: u32, rid: &str) -> Vec<u8> {
    let mut out = frame(
        HEADERS,
        END_HEADERS,
        stream,
        &block(&[
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/tokentrace.test.Streamer/Generate"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            ("x-request-id", rid),
        ]),
    );
    out.extend(frame(DATA, END_STREAM, stream, &grpc_message(b"{\"n\":3}")));
    out
}

fn grpc_response_headers(stream: u32) -> Vec<u8> {
    frame(
        HEADERS,
        END_HEADERS,
        stream,
        &block(&[(":status", "200"), ("content-type", "application/grpc")]),
    )
}

fn grpc_trailers(stream: u32, status: &str) -> Vec<u8> {
    frame(
        HEADERS,
        END_HEADERS | END_STREAM,
        stream,
        &block(&[("grpc-status", status), ("grpc-message", "done")]),
    )
}

fn client_start() -> Vec<u8> {
    let mut out = PREFACE.to_vec();
    out.extend(frame(SETTINGS, 0, 0, &[]));
    out
}

fn sse_request(stream: u32, rid: &str) -> Vec<u8> {
    frame(
        HEADERS,
        END_HEADERS | END_STREAM,
        stream,
        &block(&[
            (":method", "GET"),
            (":path", &format!("/v1/stream?rid={rid}")),
            ("x-request-id", rid),
        ]),
    )
}

fn sse_headers(stream: u32) -> Vec<u8> {
    frame(
        HEADERS,
        END_HEADERS,
        stream,
        &block(&[(":status", "200"), ("content-type", "text/event-stream")]),
    )
}

fn sse_event(stream: u32, n: u32, last: bool) -> Vec<u8> {
    let body = format!("data: {{\"id\":\"chatcmpl-{stream}\",\"n\":{n}}}\n\n");
    frame(
        DATA,
        if last { END_STREAM } else { 0 },
        stream,
        body.as_bytes(),
    )
}

impl Sim {
    fn read_at(&mut self, ingress: MonoNs, ts: MonoNs, bytes: impl AsRef<[u8]>) {
        self.next_ingress = Some(ingress);
        self.read(ts, bytes);
    }
}

#[test]
fn a_grpc_server_stream_is_one_timeline_with_a_chunk_per_message() {
    let mut sim = Sim::new();
    let mut first = client_start();
    first.extend(grpc_request(1, "rid-1"));
    sim.read_at(5, 10, first);
    let mut w = frame(SETTINGS, 0, 0, &[]);
    w.extend(grpc_response_headers(1));
    sim.write(20, w);
    sim.write(100, frame(DATA, 0, 1, &grpc_message(b"tok1")));
    // Two messages in one frame, then one split across two frames and
    // writes: its completion is the second write.
    let mut two = grpc_message(b"tok2");
    two.extend(grpc_message(b""));
    sim.write(110, frame(DATA, 0, 1, &two));
    let m = grpc_message(b"a longer token");
    sim.write(120, frame(DATA, 0, 1, &m[..7]));
    sim.write(130, frame(DATA, 0, 1, &m[7..]));
    assert!(sim.take().is_empty(), "nothing ends before the trailers");
    sim.write(140, grpc_trailers(1, "0"));
    let t = sim.one();
    assert_eq!(t.protocol, Protocol::Grpc);
    assert_eq!(t.stream_id, Some(1));
    assert_eq!(t.method, "POST");
    assert_eq!(t.path, "/tokentrace.test.Streamer/Generate");
    assert_eq!(
        t.rpc_service_method(),
        Some(("tokentrace.test.Streamer", "Generate"))
    );
    assert_eq!(t.request_id(), Some("rid-1"));
    assert_eq!(t.status, Some(200));
    assert_eq!(t.body_kind, Some(BodyKind::Grpc));
    assert_eq!(t.chunk_ts, vec![100, 110, 110, 130]);
    // The preface and SETTINGS came first in that read and may have arrived
    // before the request (grpcio writes them at connect): the read's oldest
    // byte does not date the HEADERS, the read does.
    assert_eq!(t.request_start, 10);
    assert!(!t.ingress_known);
    assert_eq!(t.read_start, 10);
    assert_eq!(t.ttft_ns(), Some(90));
    assert_eq!(t.response_start, Some(20));
    assert_eq!(t.end, 140);
    assert_eq!(t.grpc_status, Some(0));
    assert_eq!(t.grpc_message_bytes, Some(4));
    assert!(!t.aborted && !t.chunks_inexact);
    assert_eq!(t.flow_control_ns(), Some(0));
    assert_eq!(sim.st.stats().h2_connections, 1);
    assert_eq!(sim.st.stats().parse_errors, 0);
}

#[test]
fn interleaved_streams_on_one_connection_are_never_misattributed() {
    let mut sim = Sim::new();
    sim.read_at(1, 2, client_start());
    // Three requests in one read, answered interleaved, each with its own
    // number of events.
    let mut reqs = Vec::new();
    for id in [1u32, 3, 5] {
        reqs.extend(sse_request(id, &format!("r{id}")));
    }
    sim.read_at(8, 10, reqs);
    let mut ts = 20;
    let counts = [(1u32, 2u32), (3, 5), (5, 3)];
    for id in [1u32, 3, 5] {
        sim.write(ts, sse_headers(id));
        ts += 1;
    }
    for round in 0..5 {
        for (id, n) in counts {
            if round < n {
                sim.write(ts, sse_event(id, round, round + 1 == n));
                ts += 1;
            }
        }
    }
    let mut out = sim.take();
    out.sort_by_key(|t| t.stream_id);
    assert_eq!(out.len(), 3);
    for (t, (id, n)) in out.iter().zip(counts) {
        assert_eq!(t.stream_id, Some(id));
        assert_eq!(t.request_id(), Some(format!("r{id}").as_str()));
        assert_eq!(t.path, format!("/v1/stream?rid=r{id}"));
        assert_eq!(t.protocol, Protocol::H2);
        assert_eq!(t.body_kind, Some(BodyKind::Sse));
        assert_eq!(t.chunk_ts.len() as u32, n, "stream {id}");
        assert_eq!(
            t.response_id.as_deref(),
            Some(format!("chatcmpl-{id}").as_str())
        );
        // The read's arrival (8) is the first request's; the others in it
        // are timed from the read's return (10).
        assert_eq!(t.request_start, if id == 1 { 8 } else { 10 }, "stream {id}");
        assert!(!t.aborted);
    }
}

#[test]
fn a_client_reset_is_client_closed_and_a_server_reset_server_closed() {
    let mut sim = Sim::new();
    let mut r = client_start();
    r.extend(sse_request(1, "a"));
    r.extend(sse_request(3, "b"));
    sim.read_at(1, 2, r);
    sim.write(10, sse_headers(1));
    sim.write(11, sse_headers(3));
    sim.write(20, sse_event(1, 0, false));
    sim.write(21, sse_event(3, 0, false));
    // CANCEL (8) from the client on stream 1.
    sim.read(30, frame(RST_STREAM, 0, 1, &8u32.to_be_bytes()));
    let t = sim.one();
    assert_eq!(t.stream_id, Some(1));
    assert_eq!(t.abort_reason, Some(AbortReason::ClientClosed));
    assert_eq!(t.end, 30);
    // INTERNAL_ERROR (2) from the server on stream 3.
    sim.write(40, frame(RST_STREAM, 0, 3, &2u32.to_be_bytes()));
    let t = sim.one();
    assert_eq!(t.stream_id, Some(3));
    assert_eq!(t.abort_reason, Some(AbortReason::ServerClosed));
    assert_eq!(t.chunk_ts.len(), 1);
}

#[test]
fn goaway_aborts_the_streams_the_server_will_not_process() {
    let mut sim = Sim::new();
    let mut r = client_start();
    r.extend(sse_request(1, "a"));
    r.extend(sse_request(3, "b"));
    sim.read_at(1, 2, r);
    let mut goaway = 1u32.to_be_bytes().to_vec();
    goaway.extend_from_slice(&0u32.to_be_bytes());
    sim.write(10, frame(GOAWAY, 0, 0, &goaway));
    let t = sim.one();
    assert_eq!(t.stream_id, Some(3));
    assert_eq!(t.abort_reason, Some(AbortReason::ServerClosed));
    sim.write(20, sse_headers(1));
    sim.write(21, sse_event(1, 0, true));
    assert!(!sim.one().aborted);
}

#[test]
fn the_connection_closing_ends_open_streams_by_who_left() {
    let mut sim = Sim::new();
    let mut r = client_start();
    r.extend(grpc_request(1, "a"));
    sim.read_at(1, 2, r);
    sim.write(10, grpc_response_headers(1));
    sim.write(20, frame(DATA, 0, 1, &grpc_message(b"x")));
    sim.close(30);
    let t = sim.one();
    assert_eq!(t.abort_reason, Some(AbortReason::ServerClosed));
    assert_eq!(t.chunk_ts, vec![20]);
}

#[test]
fn an_uncaptured_payload_keeps_counts_exact_and_an_uncaptured_frame_header_does_not() {
    let mut sim = Sim::new();
    let mut r = client_start();
    r.extend(grpc_request(1, "a"));
    sim.read_at(1, 2, r);
    sim.write(10, grpc_response_headers(1));
    // One write of two frames; the capture ends inside the second frame's
    // message body: the rest is skipped by count.
    let mut w = frame(DATA, 0, 1, &grpc_message(b"one"));
    let cut = w.len() + 9 + 5 + 10;
    w.extend(frame(DATA, 0, 1, &grpc_message(&[b'x'; 300])));
    sim.write_cut(20, &w, cut);
    // The next write is cut inside the first frame's payload, and a second
    // frame's header is in the uncaptured tail: framing is lost.
    let mut w = frame(DATA, 0, 1, &grpc_message(&[b'y'; 100]));
    w.extend(frame(DATA, 0, 1, &grpc_message(b"hidden")));
    sim.write_cut(30, &w, 20);
    // The next write begins with frames again.
    sim.write(40, frame(DATA, 0, 1, &grpc_message(b"after")));
    sim.write(50, grpc_trailers(1, "0"));
    let t = sim.one();
    assert_eq!(t.chunk_ts, vec![20, 20, 30, 40]);
    assert!(t.chunks_inexact, "the hidden message was not counted");
    assert_eq!(sim.st.stats().chunks_inexact, 1);
    assert_eq!(sim.st.stats().truncated_writes, 2);
}

#[test]
fn tracing_started_mid_connection_recovers_the_streams_that_start_afterwards() {
    let mut sim = Sim::without_accept(StitchConfig::default());
    // Stream 1 was in flight before tracing: its DATA is skipped, counted
    // once.
    sim.write(10, frame(DATA, 0, 1, &grpc_message(b"old")));
    sim.write(11, frame(DATA, 0, 1, &grpc_message(b"old")));
    assert_eq!(sim.st.stats().streams_in_flight_at_start, 1);
    assert_eq!(sim.st.stats().h2_connections, 1);
    // Stream 3 starts now. Its HEADERS refer to an entry the client's
    // encoder inserted before tracing (index 62): unknown, counted, and the
    // timing is whole.
    let mut hdrs = vec![0x83, 0xbe];
    hdrs.extend(block(&[
        (":path", "/pkg.Svc/Method"),
        ("content-type", "application/grpc"),
    ]));
    let mut r = frame(HEADERS, END_HEADERS, 3, &hdrs);
    r.extend(frame(DATA, END_STREAM, 3, &grpc_message(b"")));
    sim.read_at(18, 20, r);
    sim.write(30, grpc_response_headers(3));
    sim.write(40, frame(DATA, 0, 3, &grpc_message(b"new")));
    sim.write(50, frame(DATA, 0, 1, &grpc_message(b"old")));
    sim.write(60, grpc_trailers(3, "0"));
    let t = sim.one();
    assert_eq!(t.stream_id, Some(3));
    assert_eq!(t.method, "POST");
    assert_eq!(t.path, "/pkg.Svc/Method");
    assert_eq!(t.protocol, Protocol::Grpc);
    assert_eq!(t.chunk_ts, vec![40]);
    assert_eq!(t.request_start, 18);
    assert_eq!(sim.st.stats().hpack_unknown_indexes, 1);
    assert_eq!(sim.st.stats().streams_in_flight_at_start, 1);
    assert_eq!(sim.st.stats().parse_errors, 0);
}

#[test]
fn a_used_up_send_window_is_flow_control_time() {
    let mut sim = Sim::new();
    // The client allows 10 bytes per stream.
    let mut r = PREFACE.to_vec();
    r.extend(frame(SETTINGS, 0, 0, &[0, 4, 0, 0, 0, 10]));
    r.extend(sse_request(1, "a"));
    sim.read_at(1, 2, r);
    sim.write(10, sse_headers(1));
    sim.write(20, frame(DATA, 0, 1, b"data: 1\n\n\n"));
    sim.read(70, frame(WINDOW_UPDATE, 0, 1, &100u32.to_be_bytes()));
    sim.write(71, frame(DATA, END_STREAM, 1, b"data: 2\n\n"));
    let t = sim.one();
    assert_eq!(t.flow_control_waits, vec![(20, 70)]);
    assert_eq!(t.flow_control_ns(), Some(50));
    assert_eq!(t.chunk_ts, vec![20, 71]);
}

#[test]
fn an_h2c_upgrade_answers_the_upgrading_request_on_stream_1() {
    let mut sim = Sim::new();
    sim.read_at(
        3,
        5,
        "GET /v1/stream HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n\
         Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\nx-request-id: up-1\r\n\r\n",
    );
    let mut w =
        b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n".to_vec();
    w.extend(frame(SETTINGS, 0, 0, &[]));
    sim.write(10, w);
    sim.read(12, client_start());
    sim.write(20, sse_headers(1));
    sim.write(30, sse_event(1, 0, false));
    sim.write(40, sse_event(1, 1, true));
    let t = sim.one();
    assert_eq!(t.stream_id, Some(1));
    assert_eq!(t.method, "GET");
    assert_eq!(t.request_id(), Some("up-1"));
    assert_eq!(t.status, Some(200));
    assert_eq!(t.chunk_ts, vec![30, 40]);
    assert_eq!(t.request_start, 3);
    assert_eq!(t.response_start, Some(20));
    assert_eq!(sim.st.stats().parse_errors, 0);
}

#[test]
fn a_process_that_writes_the_preface_is_a_client() {
    let mut sim = Sim::new();
    sim.write(10, client_start());
    sim.read(20, frame(SETTINGS, 0, 0, &[]));
    assert!(sim.take().is_empty(), "no call made yet");
    assert_eq!(sim.st.stats().client_connections, 1);
    assert_eq!(sim.st.stats().h2_connections, 0);
}

#[test]
fn malformed_frames_are_a_counted_parse_error_and_streams_still_close() {
    let mut sim = Sim::new();
    let mut r = client_start();
    r.extend(sse_request(1, "a"));
    sim.read_at(1, 2, r);
    sim.write(10, sse_headers(1));
    // A frame longer than the client's 16 KiB limit: garbage.
    sim.write(20, [0xff, 0xff, 0xff, 0, 0, 0, 0, 0, 1, 1, 2, 3]);
    assert_eq!(sim.st.stats().parse_errors, 1);
    // A write that is not frames does not resync; one that is, does.
    sim.write(30, b"garbage that is no frame at all");
    sim.write(40, sse_event(1, 0, true));
    let t = sim.one();
    assert_eq!(t.chunk_ts, vec![40]);
    assert!(t.chunks_inexact);
}

#[test]
fn garbage_after_the_preface_never_panics_and_keeps_memory_bounded() {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for round in 0..200 {
        let mut sim = Sim::new();
        sim.read(2, client_start());
        for i in 0..20 {
            let len = (next() % 64) as usize;
            let mut bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            if i % 3 == 0 {
                // Plausible frame headers with random payloads.
                bytes = frame(
                    (next() % 10) as u8,
                    next() as u8,
                    (next() % 8) as u32,
                    &bytes,
                );
            }
            let ts = 10 + i * 10 + round;
            if next() % 2 == 0 {
                sim.read(ts, &bytes);
            } else {
                let captured = (next() as usize) % (bytes.len() + 1);
                sim.write_cut(ts, &bytes, captured);
            }
        }
        sim.close(1_000);
        for t in sim.take() {
            assert!(t.end >= t.request_start);
        }
    }
}

#[test]
fn a_server_that_sends_its_settings_before_reading_the_preface_is_http2() {
    // grpcio writes SETTINGS and a WINDOW_UPDATE as soon as it accepts.
    let mut sim = Sim::new();
    let mut w = frame(SETTINGS, 0, 0, &[0, 4, 0, 0x40, 0, 0]);
    w.extend(frame(WINDOW_UPDATE, 0, 0, &[0, 0x3f, 0, 1]));
    sim.write(5, w);
    let mut r = client_start();
    r.extend(grpc_request(1, "early"));
    sim.read_at(8, 10, r);
    sim.write(20, grpc_response_headers(1));
    sim.write(30, frame(DATA, 0, 1, &grpc_message(b"t")));
    sim.write(40, grpc_trailers(1, "0"));
    let t = sim.one();
    assert_eq!(t.request_id(), Some("early"));
    assert_eq!(t.chunk_ts, vec![30]);
    assert_eq!(
        t.request_start, 10,
        "after the preface in its read: timed from the read"
    );
    assert_eq!(sim.st.stats().parse_errors, 0);
    assert_eq!(sim.st.stats().h2_connections, 1);
}

#[test]
fn a_call_whose_content_type_hpack_cannot_decode_is_still_grpc_by_its_body() {
    // Attached mid-connection: the client's and the server's content-type
    // are dynamic-table entries from before tracing (indexes 62, 63).
    let mut sim = Sim::without_accept(StitchConfig::default());
    let mut r = frame(HEADERS, END_HEADERS, 5, &[0x83, 0xbe, 0xbf]);
    r.extend(frame(DATA, END_STREAM, 5, &grpc_message(b"{\"n\":2}")));
    sim.read_at(18, 20, r);
    sim.write(30, frame(HEADERS, END_HEADERS, 5, &[0x88, 0xbe]));
    // Two messages in one frame: a chunk each, not one per frame.
    let mut two = grpc_message(b"a");
    two.extend(grpc_message(b"b"));
    sim.write(40, frame(DATA, 0, 5, &two));
    sim.write(50, frame(HEADERS, END_HEADERS | END_STREAM, 5, &[0xbf]));
    let t = sim.one();
    assert_eq!(t.protocol, Protocol::Grpc);
    assert_eq!(t.body_kind, Some(BodyKind::Grpc));
    assert_eq!(t.chunk_ts, vec![40, 40]);
    assert_eq!(t.method, "POST");
    assert_eq!(t.path, "", "the path was an unknown index");
}

#[test]
fn a_tls_connection_first_seen_through_the_servers_settings_still_reads_the_preface() {
    // node over TLS: no accept for the SSL* connection, the server writes
    // SETTINGS first, then the client's preface and request arrive.
    let mut sim = Sim::without_accept(StitchConfig::default());
    sim.write(5, frame(SETTINGS, 0, 0, &[]));
    let mut r = client_start();
    r.extend(sse_request(1, "tls"));
    sim.read_at(8, 10, r);
    sim.write(20, sse_headers(1));
    sim.write(30, sse_event(1, 0, true));
    let t = sim.one();
    assert_eq!(t.request_id(), Some("tls"));
    assert_eq!(t.chunk_ts, vec![30]);
    assert_eq!(sim.st.stats().parse_errors, 0);
}

#[test]
fn a_connection_taken_for_a_server_whose_process_then_writes_the_preface_is_a_client() {
    // nginx grpc_pass upstream: first seen reading grpcio's SETTINGS.
    let mut sim = Sim::without_accept(StitchConfig::default());
    sim.read(5, frame(SETTINGS, 0, 0, &[]));
    let mut w = client_start();
    w.extend(grpc_request(1, "up"));
    sim.write(10, w);
    sim.read(20, grpc_response_headers(1));
    sim.read(30, frame(DATA, 0, 1, &grpc_message(b"t")));
    sim.read(40, grpc_trailers(1, "0"));
    sim.close(50);
    let t = sim.one();
    assert_eq!(
        t.kind,
        SpanKind::Client,
        "the upstream call is a client line"
    );
    assert_eq!(t.request_id(), Some("up"));
    assert_eq!((t.request_start, t.chunk_ts.clone()), (10, vec![30]));
    assert_eq!((t.protocol, t.grpc_status), (Protocol::Grpc, Some(0)));
    let stats = sim.st.stats();
    assert_eq!((stats.client_connections, stats.client_requests), (1, 1));
    assert_eq!((stats.requests_completed, stats.parse_errors), (0, 0));
}

#[test]
fn an_http2_client_call_starts_at_its_write_and_each_frame_is_dated_by_its_arrival() {
    // A gateway opens two calls in one write; their responses come back
    // interleaved in one read whose segments arrived at 21, 30, 35, 40.
    let mut sim = Sim::new();
    let mut w = client_start();
    w.extend(grpc_request(1, "a"));
    w.extend(grpc_request(3, "b"));
    sim.write(10, w);
    let mut r = frame(SETTINGS, 0, 0, &[]);
    r.extend(grpc_response_headers(1));
    let second = r.len();
    r.extend(frame(DATA, 0, 1, &grpc_message(b"a1")));
    let third = r.len();
    r.extend(grpc_response_headers(3));
    r.extend(frame(DATA, 0, 3, &grpc_message(b"b1")));
    let fourth = r.len();
    r.extend(frame(DATA, 0, 1, &grpc_message(b"a2")));
    r.extend(grpc_trailers(1, "0"));
    r.extend(grpc_trailers(3, "8"));
    let mark = |at: usize| u32::try_from(at).expect("small");
    sim.read_marked(
        60,
        &[
            (0, 21),
            (mark(second), 30),
            (mark(third), 35),
            (mark(fourth), 40),
        ],
        r,
    );
    let mut got = sim.take();
    got.sort_by_key(|t| t.stream_id);
    let [a, b] = got.as_slice() else {
        panic!("two calls: {got:?}")
    };
    for t in [a, b] {
        assert_eq!(t.kind, SpanKind::Client);
        assert_eq!(
            t.request_start, 10,
            "a call starts at the write of its HEADERS"
        );
        assert!(!t.aborted);
    }
    assert_eq!(
        (a.request_id(), a.chunk_ts.clone()),
        (Some("a"), vec![30, 40])
    );
    assert_eq!((b.request_id(), b.chunk_ts.clone()), (Some("b"), vec![35]));
    assert_eq!((a.grpc_status, b.grpc_status), (Some(0), Some(8)));
    assert_eq!(a.response_start, Some(21));
    assert_eq!(sim.st.stats().client_requests, 2);
    assert_eq!(sim.st.stats().h2_connections, 0, "server connections only");
}

#[test]
fn an_http2_client_call_reset_by_either_side_says_who() {
    let mut sim = Sim::new();
    let mut w = client_start();
    w.extend(grpc_request(1, "mine"));
    w.extend(grpc_request(3, "theirs"));
    sim.write(10, w);
    sim.read(20, grpc_response_headers(1));
    // the gateway gives up on stream 1 (its caller left) ...
    sim.write(30, frame(RST_STREAM, 0, 1, &8u32.to_be_bytes()));
    // ... the upstream refuses stream 3
    sim.read(40, frame(RST_STREAM, 0, 3, &7u32.to_be_bytes()));
    let mut got = sim.take();
    got.sort_by_key(|t| t.stream_id);
    let reasons: Vec<_> = got.iter().map(|t| (t.stream_id, t.abort_reason)).collect();
    assert_eq!(
        reasons,
        vec![
            (Some(1), Some(AbortReason::ClientClosed)),
            (Some(3), Some(AbortReason::ServerClosed)),
        ]
    );
}

impl Sim {
    /// A read whose bytes `[offset, next offset)` arrived at the given times.
    fn read_marked(&mut self, ts: MonoNs, marks: &[(u32, MonoNs)], bytes: impl AsRef<[u8]>) {
        let len = u32::try_from(bytes.as_ref().len()).expect("test lengths fit");
        self.next_marks = marks
            .iter()
            .enumerate()
            .map(|(i, &(offset, t))| crate::event::IngressMark {
                offset,
                len: marks.get(i + 1).map_or(len, |m| m.0) - offset,
                ts: t,
            })
            .collect();
        self.next_ingress = marks.first().map(|m| m.1);
        self.read(ts, bytes);
    }
}

#[test]
fn headers_after_the_preface_in_one_read_are_dated_by_their_own_segment() {
    // Issue 27: the preface and SETTINGS came at 3, HEADERS of stream 1 at
    // 7 and of stream 3 at 9, all in one read at 20.
    let mut sim = Sim::new();
    let preface = client_start();
    let s1 = sse_request(1, "a");
    let s3 = sse_request(3, "b");
    let o1 = u32::try_from(preface.len()).expect("small");
    let o3 = o1 + u32::try_from(s1.len()).expect("small");
    let mut r = preface;
    r.extend(s1);
    r.extend(s3);
    sim.read_marked(20, &[(0, 3), (o1, 7), (o3, 9)], r);
    for id in [1, 3] {
        sim.write(30, sse_headers(id));
        sim.write(40, sse_event(id, 0, true));
    }
    let mut out = sim.take();
    out.sort_by_key(|t| t.stream_id);
    let starts: Vec<(Option<u32>, u64, Option<u64>)> = out
        .iter()
        .map(|t| (t.stream_id, t.request_start, t.socket_wait_ns()))
        .collect();
    assert_eq!(starts, [(Some(1), 7, Some(13)), (Some(3), 9, Some(11))]);
    // A HEADERS no mark covers (its bytes came before the socket was
    // tracked) stays timed from the read.
    let mut sim = Sim::new();
    let mut r = client_start();
    let o1 = u32::try_from(r.len()).expect("small");
    r.extend(sse_request(1, "a"));
    sim.next_marks = vec![crate::event::IngressMark {
        offset: 0,
        len: o1,
        ts: 3,
    }];
    sim.next_ingress = Some(3);
    sim.read(20, r);
    sim.write(30, sse_headers(1));
    sim.write(40, sse_event(1, 0, true));
    let t = sim.one();
    assert_eq!((t.request_start, t.socket_wait_ns()), (20, None));
}

#[test]
fn a_headers_frame_after_any_other_frame_in_one_read_is_not_dated_by_it() {
    let mut sim = Sim::new();
    let mut r = client_start();
    r.extend(sse_request(1, "a"));
    sim.read_at(1, 2, r);
    sim.write(10, sse_headers(1));
    sim.write(11, sse_event(1, 0, false));
    // The previous call's RST_STREAM and the next call's HEADERS in one
    // read: the read's oldest byte (at 15) is the reset's, not the request's.
    let mut r = frame(RST_STREAM, 0, 1, &8u32.to_be_bytes());
    r.extend(sse_request(3, "b"));
    sim.read_at(15, 40, r);
    sim.write(50, sse_headers(3));
    sim.write(60, sse_event(3, 0, true));
    let mut out = sim.take();
    out.sort_by_key(|t| t.stream_id);
    assert_eq!(out.len(), 2);
    assert_eq!(out[1].stream_id, Some(3));
    assert_eq!(
        out[1].request_start, 40,
        "timed from the read, not the reset's arrival"
    );
    assert!(!out[1].ingress_known);
    // Two requests in one read: the read's arrival is the first one's; the
    // second may have come in a later segment (sent later), so it is timed
    // from the read, never dated before it could have been sent.
    let mut sim = Sim::new();
    sim.read(1, client_start());
    let mut r = sse_request(1, "x");
    r.extend(sse_request(3, "y"));
    sim.read_at(1, 2, r);
    for id in [1, 3] {
        sim.write(10, sse_headers(id));
        sim.write(20, sse_event(id, 0, true));
    }
    let mut out = sim.take();
    out.sort_by_key(|t| t.stream_id);
    let starts: Vec<(Option<u32>, u64, bool)> = out
        .iter()
        .map(|t| (t.stream_id, t.request_start, t.ingress_known))
        .collect();
    assert_eq!(starts, [(Some(1), 1, true), (Some(3), 2, false)]);
}

#[test]
fn an_event_stream_whose_content_type_hpack_cannot_decode_is_still_sse_by_its_body() {
    let mut sim = Sim::without_accept(StitchConfig::default());
    sim.read_at(
        18,
        20,
        frame(HEADERS, END_HEADERS | END_STREAM, 3, &[0x82, 0xbe]),
    );
    // :status 200, content-type from an index the agent never saw.
    sim.write(30, frame(HEADERS, END_HEADERS, 3, &[0x88, 0xbe]));
    sim.write(40, sse_event(3, 0, false));
    sim.write(50, sse_event(3, 1, false));
    sim.write(60, frame(DATA, END_STREAM, 3, b"data: [DONE]\n\n"));
    let t = sim.one();
    assert_eq!(t.body_kind, Some(BodyKind::Sse));
    assert_eq!(t.chunk_ts, vec![40, 50], "[DONE] is no token");
    assert!(t.done_seen);
}

#[test]
fn a_control_frame_read_across_a_capture_gap_is_not_read_from_misaligned_bytes() {
    let mut sim = Sim::new();
    let mut r = client_start();
    r.extend(sse_request(1, "a"));
    sim.read_at(1, 2, r);
    sim.write(10, sse_headers(1));
    // A client SETTINGS of two entries that mean nothing here
    // (MAX_FRAME_SIZE 2^26, ignored; id 0) split across two reads, the
    // first cut after the payload's first byte. Glued across the gap, the
    // bytes would read as INITIAL_WINDOW_SIZE = 0 and stall the stream.
    let payload = [0x00, 0x05, 0x04, 0x00, 0x00, 0x00, 0, 0, 0, 0, 0, 0];
    let settings = frame(SETTINGS, 0, 0, &payload);
    sim.read_cut(20, &settings[..11], 10);
    sim.read(21, &settings[11..]);
    sim.write(30, sse_event(1, 0, false));
    sim.read(40, frame(WINDOW_UPDATE, 0, 1, &1000u32.to_be_bytes()));
    sim.write(50, sse_event(1, 1, true));
    let t = sim.one();
    assert_eq!(t.chunk_ts, vec![30, 50]);
    assert!(
        t.flow_control_waits.is_empty(),
        "{:?}",
        t.flow_control_waits
    );
}

#[test]
fn open_streams_are_reported_by_phase_until_they_end() {
    use crate::model::Phase;
    let phases = |sim: &Sim| -> Vec<(String, Phase)> {
        sim.st
            .open_requests()
            .into_iter()
            .map(|r| (r.path, r.phase))
            .collect()
    };
    let mut sim = Sim::new();
    sim.read_at(1, 2, client_start());
    let mut reqs = sse_request(1, "a");
    reqs.extend(sse_request(3, "b"));
    sim.read_at(8, 10, reqs);
    sim.write(20, sse_headers(1));
    sim.write(21, sse_event(1, 0, false));
    sim.write(22, sse_headers(3));
    assert_eq!(
        phases(&sim),
        vec![
            ("/v1/stream?rid=a".to_string(), Phase::Streaming),
            ("/v1/stream?rid=b".to_string(), Phase::FirstToken),
        ]
    );
    sim.write(23, sse_event(1, 1, true));
    sim.write(24, sse_event(3, 0, true));
    assert_eq!(sim.take().len(), 2);
    assert_eq!(phases(&sim), vec![]);
}
