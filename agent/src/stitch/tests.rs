//! Stitcher-level tests: hand-built events in, timelines out.
//!
//! Times are small made-up integers; each test picks them so that every
//! field it checks can only come from one event.

use std::net::{Ipv4Addr, SocketAddr};

use super::*;
use crate::event::{
    ConnEvent, ConnId, DataEvent, Direction, IoCall, ListenEvent, ProcEvent, SockAddrs,
};
use crate::model::{AbortReason, BodyKind, RequestTimeline, SpanKind, Usage};

const PID: u32 = 4242;
const COMM: &str = "vllm";

fn conn_id(fd: i32, sock_ino: u64) -> ConnId {
    ConnId {
        pid: PID,
        fd,
        sock_ino,
    }
}

fn addrs() -> SockAddrs {
    SockAddrs {
        local: SocketAddr::from((Ipv4Addr::LOCALHOST, 8000)),
        remote: SocketAddr::from((Ipv4Addr::LOCALHOST, 51234)),
    }
}

/// Drives a [`Stitcher`] with hand-built events on one connection (or
/// another one given explicitly), collecting its output.
struct Sim {
    st: Stitcher,
    out: Vec<RequestTimeline>,
    conn: ConnId,
    /// Ingress time the next read reports (the kernel's arrival stamp).
    next_ingress: Option<MonoNs>,
    /// Arrival marks the next read reports.
    next_marks: Vec<crate::event::IngressMark>,
}

impl Sim {
    /// A connection accepted at time 1.
    fn new() -> Self {
        Self::with_config(StitchConfig::default())
    }

    fn with_config(config: StitchConfig) -> Self {
        let mut sim = Self::without_accept(config);
        sim.accept_on(sim.conn, 1);
        sim
    }

    /// A connection the agent never saw accepted.
    fn without_accept(config: StitchConfig) -> Self {
        Self {
            st: Stitcher::new(config),
            out: Vec::new(),
            conn: conn_id(7, 991),
            next_ingress: None,
            next_marks: Vec::new(),
        }
    }

    fn push(&mut self, event: Event) {
        self.st.push(&event, &mut self.out);
    }

    fn accept_on(&mut self, conn: ConnId, ts: MonoNs) {
        self.push(Event::Accept(ConnEvent {
            conn,
            tid: PID,
            comm: COMM.to_owned(),
            ts,
            addrs: Some(addrs()),
            established: None,
        }));
    }

    fn data_on(
        &mut self,
        conn: ConnId,
        direction: Direction,
        ts: MonoNs,
        payload: &[u8],
        len: usize,
    ) {
        let (ts_enter, ts_exit, call) = match direction {
            // Reads are timed by their exit, writes by their entry: the
            // other end is set apart so a mix-up shows.
            Direction::Ingress => (ts - 1, ts, IoCall::Read),
            Direction::Egress => (ts, ts + 1, IoCall::Writev),
        };
        let ingress = match direction {
            Direction::Ingress => self.next_ingress.take(),
            Direction::Egress => None,
        };
        let marks = match direction {
            Direction::Ingress => std::mem::take(&mut self.next_marks),
            Direction::Egress => Vec::new(),
        };
        self.push(Event::Data(DataEvent {
            conn,
            tid: PID + 1,
            comm: COMM.into(),
            ts_enter,
            ts_exit,
            ingress,
            marks,
            direction,
            call,
            len: u32::try_from(len).expect("test lengths fit"),
            payload: bytes::Bytes::copy_from_slice(payload),
            addrs: None,
            tcp: None,
        }));
    }

    fn read_on(&mut self, conn: ConnId, ts: MonoNs, bytes: impl AsRef<[u8]>) {
        let bytes = bytes.as_ref();
        self.data_on(conn, Direction::Ingress, ts, bytes, bytes.len());
    }

    fn read(&mut self, ts: MonoNs, bytes: impl AsRef<[u8]>) {
        let bytes = bytes.as_ref();
        self.data_on(self.conn, Direction::Ingress, ts, bytes, bytes.len());
    }

    fn write(&mut self, ts: MonoNs, bytes: impl AsRef<[u8]>) {
        let bytes = bytes.as_ref();
        self.data_on(self.conn, Direction::Egress, ts, bytes, bytes.len());
    }

    /// A write of `bytes` of which only the first `captured` were captured.
    fn write_cut(&mut self, ts: MonoNs, bytes: impl AsRef<[u8]>, captured: usize) {
        let bytes = bytes.as_ref();
        self.data_on(
            self.conn,
            Direction::Egress,
            ts,
            &bytes[..captured],
            bytes.len(),
        );
    }

    fn read_cut(&mut self, ts: MonoNs, bytes: impl AsRef<[u8]>, captured: usize) {
        let bytes = bytes.as_ref();
        self.data_on(
            self.conn,
            Direction::Ingress,
            ts,
            &bytes[..captured],
            bytes.len(),
        );
    }

    fn close(&mut self, ts: MonoNs) {
        self.push(Event::Close(ConnEvent {
            conn: self.conn,
            tid: PID,
            comm: COMM.to_owned(),
            ts,
            addrs: None,
            established: None,
        }));
    }

    fn exit(&mut self, pid: u32, ts: MonoNs) {
        self.push(Event::Exit(ProcEvent {
            pid,
            ppid: 1,
            comm: COMM.to_owned(),
            ts,
            filename: String::new(),
            exit_code: 9,
        }));
    }

    fn take(&mut self) -> Vec<RequestTimeline> {
        std::mem::take(&mut self.out)
    }

    /// The one timeline output so far.
    #[track_caller]
    fn one(&mut self) -> RequestTimeline {
        let mut out = self.take();
        assert_eq!(out.len(), 1, "expected one timeline, got {out:#?}");
        out.remove(0)
    }
}

// ---- Message builders ----

fn chat_request(model: &str, stream: bool) -> Vec<u8> {
    let body = format!(
        r#"{{"messages":[{{"role":"user","content":"say \"model\": hi"}}],"model":"{model}","stream":{stream}}}"#
    );
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost:8000\r\n\
         traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n\
         tracestate: congo=t61rcWkgMzE\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn get_request(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").into_bytes()
}

const SSE_CHUNKED_HEAD: &str = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n";

/// One OpenAI chat-completion chunk as an SSE event.
fn token_event(id: &str, token: &str) -> String {
    format!(
        "data: {{\"id\":\"{id}\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"served-model\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{token}\"}}}}],\"usage\":null}}\n\n"
    )
}

fn usage_event(id: &str, prompt: u64, completion: u64) -> String {
    format!(
        "data: {{\"id\":\"{id}\",\"choices\":[],\"usage\":{{\"prompt_tokens\":{prompt},\"completion_tokens\":{completion},\"total_tokens\":{}}}}}\n\n",
        prompt + completion
    )
}

const DONE_EVENT: &str = "data: [DONE]\n\n";

/// One HTTP chunk carrying `payload`.
fn chunk(payload: impl AsRef<[u8]>) -> Vec<u8> {
    let payload = payload.as_ref();
    let mut out = format!("{:x}\r\n", payload.len()).into_bytes();
    out.extend_from_slice(payload);
    out.extend_from_slice(b"\r\n");
    out
}

const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

fn json_response(body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A complete chunked SSE response, one event per HTTP chunk, built while
/// recording where each counted event is dispatched (the index of its
/// final byte in the whole response) and where the body starts.
struct BuiltResponse {
    bytes: Vec<u8>,
    dispatch_at: Vec<usize>,
    first_body_byte: usize,
}

fn build_sse_response(events: &[String]) -> BuiltResponse {
    let mut bytes = SSE_CHUNKED_HEAD.as_bytes().to_vec();
    let mut dispatch_at = Vec::new();
    let mut first_body_byte = None;
    for event in events {
        let framed = chunk(event);
        let size_line = framed.len() - event.len() - 2;
        first_body_byte.get_or_insert(bytes.len() + size_line);
        if !event.contains("[DONE]") {
            dispatch_at.push(bytes.len() + size_line + event.len() - 1);
        }
        bytes.extend_from_slice(&framed);
    }
    bytes.extend_from_slice(LAST_CHUNK);
    BuiltResponse {
        bytes,
        dispatch_at,
        first_body_byte: first_body_byte.unwrap_or_default(),
    }
}

fn standard_events() -> Vec<String> {
    vec![
        token_event("chatcmpl-42", ""),
        token_event("chatcmpl-42", "Hello"),
        token_event("chatcmpl-42", " world"),
        usage_event("chatcmpl-42", 12, 3),
        DONE_EVENT.to_owned(),
    ]
}

// ---- Streaming (SSE) ----

#[test]
fn openai_sse_over_chunked_one_event_per_write() {
    let mut sim = Sim::new();
    let request = chat_request("llama-3-8b", true);
    sim.read(100, &request);
    sim.write(200, SSE_CHUNKED_HEAD);
    let events = standard_events();
    for (i, event) in events.iter().enumerate() {
        sim.write(300 + 100 * i as u64, chunk(event));
    }
    assert!(sim.out.is_empty(), "not finished before the last chunk");
    sim.write(900, LAST_CHUNK);

    let tl = sim.one();
    assert_eq!(tl.conn, sim.conn);
    assert_eq!(tl.comm, COMM);
    assert_eq!(tl.addrs, Some(addrs()));
    assert_eq!(
        (tl.method.as_str(), tl.path.as_str()),
        ("POST", "/v1/chat/completions")
    );
    assert_eq!(
        tl.traceparent.as_deref(),
        Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    );
    assert_eq!(tl.tracestate.as_deref(), Some("congo=t61rcWkgMzE"));
    assert_eq!(
        tl.model.as_deref(),
        Some("llama-3-8b"),
        "request model wins"
    );
    assert_eq!((tl.request_start, tl.request_end), (100, 100));
    assert_eq!(tl.request_bytes, request.len() as u64);
    assert_eq!(tl.status, Some(200));
    assert_eq!(tl.body_kind, Some(BodyKind::Sse));
    assert_eq!(
        tl.content_type.as_deref(),
        Some("text/event-stream; charset=utf-8")
    );
    assert_eq!(tl.response_start, Some(200));
    assert_eq!(tl.first_body_byte, Some(300));
    assert_eq!(
        tl.chunk_ts,
        vec![300, 400, 500, 600],
        "[DONE] is not a chunk"
    );
    assert_eq!(tl.ttft_ns(), Some(200));
    assert_eq!(tl.stats().itl_ns, vec![100, 100, 100]);
    assert_eq!(tl.end, 900);
    assert_eq!(tl.e2e_ns(), 800);
    assert!(tl.done_seen);
    assert!(!tl.aborted);
    assert_eq!(tl.abort_reason, None);
    assert_eq!(tl.response_id.as_deref(), Some("chatcmpl-42"));
    assert_eq!(
        tl.usage,
        Some(Usage {
            prompt_tokens: Some(12),
            completion_tokens: Some(3)
        })
    );
    let expected_bytes = SSE_CHUNKED_HEAD.len()
        + events.iter().map(|e| chunk(e).len()).sum::<usize>()
        + LAST_CHUNK.len();
    assert_eq!(tl.response_bytes, expected_bytes as u64);
    assert_eq!(tl.truncated_writes, 0);

    let stats = sim.st.stats();
    assert_eq!((stats.requests_completed, stats.requests_aborted), (1, 0));
    assert_eq!(stats.parse_errors, 0);
    assert_eq!(sim.st.open_connections(), 1);
}

#[test]
fn model_falls_back_to_the_response() {
    let mut sim = Sim::new();
    sim.read(100, get_request("/stream"));
    sim.write(200, SSE_CHUNKED_HEAD);
    sim.write(300, chunk(token_event("id-1", "x")));
    sim.write(400, LAST_CHUNK);
    assert_eq!(sim.one().model.as_deref(), Some("served-model"));
}

#[test]
fn one_write_carrying_several_events() {
    let mut sim = Sim::new();
    sim.read(100, chat_request("m", true));
    sim.write(200, SSE_CHUNKED_HEAD);
    // asyncio coalescing: three events in one chunk, then two chunks in
    // one write.
    let three = [
        token_event("c1", "a"),
        token_event("c1", "b"),
        token_event("c1", "c"),
    ]
    .concat();
    sim.write(300, chunk(three));
    let mut two = chunk(token_event("c1", "d"));
    two.extend(chunk(token_event("c1", "e")));
    sim.write(400, two);
    let mut last = chunk(DONE_EVENT);
    last.extend_from_slice(LAST_CHUNK);
    sim.write(500, last);
    let tl = sim.one();
    assert_eq!(tl.chunk_ts, vec![300, 300, 300, 400, 400]);
    assert_eq!((tl.end, tl.done_seen), (500, true));
}

#[test]
fn data_line_split_across_writes() {
    let mut sim = Sim::new();
    sim.read(100, chat_request("m", true));
    sim.write(200, SSE_CHUNKED_HEAD);
    // One chunk whose event is cut in the middle of its data line: the
    // chunk-size line announces the whole event, the data arrives in two
    // writes.
    let event = token_event("split-id", "tok");
    let framed = chunk(&event);
    let cut = 30;
    sim.write(300, &framed[..cut]);
    sim.write(400, &framed[cut..]);
    // And a `data:` line split across two HTTP chunks.
    let event = token_event("split-id", "tok2");
    sim.write(500, chunk(&event[..10]));
    sim.write(600, chunk(&event[10..]));
    sim.write(700, LAST_CHUNK);
    let tl = sim.one();
    assert_eq!(tl.chunk_ts, vec![400, 600]);
    assert_eq!(tl.first_body_byte, Some(300));
    assert_eq!(tl.response_id.as_deref(), Some("split-id"));
}

#[test]
fn every_split_point_of_a_whole_response() {
    let built = build_sse_response(&standard_events());
    let request = chat_request("m", true);
    let unsplit = {
        let mut sim = Sim::new();
        sim.read(100, &request);
        sim.write(1000, &built.bytes);
        sim.one()
    };
    assert_eq!(unsplit.chunk_ts, vec![1000; 4]);
    for i in 1..built.bytes.len() {
        let mut sim = Sim::new();
        sim.read(100, &request);
        sim.write(1000, &built.bytes[..i]);
        sim.write(2000, &built.bytes[i..]);
        let tl = sim.one();
        let at = |byte: usize| if byte < i { 1000 } else { 2000 };
        let expected: Vec<MonoNs> = built.dispatch_at.iter().map(|&d| at(d)).collect();
        assert_eq!(tl.chunk_ts, expected, "split at {i}");
        assert_eq!(
            tl.first_body_byte,
            Some(at(built.first_body_byte)),
            "split at {i}"
        );
        assert_eq!(tl.response_start, Some(1000));
        assert_eq!(tl.end, 2000);
        let same = |t: &RequestTimeline| {
            (
                t.response_id.clone(),
                t.usage,
                t.done_seen,
                t.response_bytes,
                t.status,
                t.body_kind,
                t.aborted,
            )
        };
        assert_eq!(same(&tl), same(&unsplit), "split at {i}");
    }
    assert_eq!(unsplit.response_bytes, built.bytes.len() as u64);
}

#[test]
fn every_byte_in_its_own_write() {
    let built = build_sse_response(&standard_events());
    let mut sim = Sim::new();
    sim.read(100, chat_request("m", true));
    for (i, byte) in built.bytes.iter().enumerate() {
        sim.write(1000 + i as u64, [*byte]);
    }
    let tl = sim.one();
    let expected: Vec<MonoNs> = built.dispatch_at.iter().map(|&d| 1000 + d as u64).collect();
    assert_eq!(tl.chunk_ts, expected);
    assert_eq!(
        tl.first_body_byte,
        Some(1000 + built.first_body_byte as u64)
    );
    assert_eq!(tl.end, 1000 + built.bytes.len() as u64 - 1);
    assert_eq!(tl.response_id.as_deref(), Some("chatcmpl-42"));
}

#[test]
fn chunk_framing_in_separate_tiny_writes() {
    let mut sim = Sim::new();
    sim.read(100, chat_request("m", true));
    sim.write(200, SSE_CHUNKED_HEAD);
    let mut t = 300;
    for event in standard_events() {
        // `1a3\r\n`, the event, `\r\n`: three sends.
        sim.write(t, format!("{:x}\r\n", event.len()));
        sim.write(t + 10, &event);
        sim.write(t + 20, "\r\n");
        t += 100;
    }
    sim.write(t, "0\r\n");
    sim.write(t + 10, "\r\n");
    let tl = sim.one();
    assert_eq!(tl.chunk_ts, vec![310, 410, 510, 610]);
    assert_eq!(tl.first_body_byte, Some(310));
    assert_eq!(tl.end, t + 10);
    assert!(tl.done_seen);
}

#[test]
fn writev_style_head_and_first_chunk_together() {
    let mut sim = Sim::new();
    sim.read(100, chat_request("m", true));
    // Node-style: the head and the first chunk go out in one writev.
    let mut first = SSE_CHUNKED_HEAD.as_bytes().to_vec();
    first.extend(chunk(token_event("w", "a")));
    sim.write(200, first);
    sim.write(300, chunk(token_event("w", "b")));
    let mut tail = chunk(DONE_EVENT);
    tail.extend_from_slice(LAST_CHUNK);
    sim.write(400, tail);
    let tl = sim.one();
    assert_eq!(tl.response_start, Some(200));
    assert_eq!(tl.chunk_ts, vec![200, 300]);
    assert_eq!(tl.ttft_ns(), Some(100));
}

#[test]
fn crlf_line_endings_comments_and_dataless_events() {
    let mut sim = Sim::new();
    sim.read(100, chat_request("m", true));
    sim.write(200, SSE_CHUNKED_HEAD);
    sim.write(300, chunk(": ping\r\n\r\n"));
    sim.write(400, chunk("event: start\r\nid: 1\r\n\r\n"));
    sim.write(500, chunk("data: {\"id\":\"crlf\"}\r\n\r\n"));
    sim.write(600, chunk(": ping - 2024-01-01\r\n\r\n"));
    sim.write(
        700,
        chunk("event: token\r\ndata: {\"t\":1}\r\ndata: more\r\n\r\n"),
    );
    // A bare-CR stream too.
    sim.write(800, chunk("data: {\"t\":2}\r\r"));
    sim.write(900, chunk("data: [DONE]\r\n\r\n"));
    sim.write(1000, LAST_CHUNK);
    let tl = sim.one();
    assert_eq!(tl.chunk_ts, vec![500, 700, 800]);
    assert_eq!(tl.first_body_byte, Some(300), "a comment is a body byte");
    assert_eq!(tl.ttft_ns(), Some(400), "but not a token");
    assert_eq!(tl.response_id.as_deref(), Some("crlf"));
    assert!(tl.done_seen);
}

#[test]
fn sse_without_chunked_encoding() {
    // Content-Length SSE and close-delimited SSE (HTTP/1.0 style).
    let body = [token_event("f", "a"), token_event("f", "b")].concat();
    let mut sim = Sim::new();
    sim.read(100, get_request("/fixed"));
    sim.write(
        200,
        format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: {}\r\n\r\n",
            body.len()
        ),
    );
    let (a, b) = body.split_at(body.len() / 2 + 7);
    sim.write(300, a);
    sim.write(400, b);
    let tl = sim.one();
    assert_eq!(tl.body_kind, Some(BodyKind::Sse));
    assert_eq!((tl.chunk_ts.clone(), tl.end), (vec![300, 400], 400));

    let mut sim = Sim::new();
    sim.read(100, get_request("/until-close"));
    sim.write(
        200,
        "HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n",
    );
    sim.write(300, token_event("u", "a"));
    sim.write(400, token_event("u", "b"));
    sim.write(500, "data: [DONE]\n\n");
    assert!(sim.out.is_empty());
    sim.close(600);
    let tl = sim.one();
    assert_eq!(tl.body_kind, Some(BodyKind::Sse));
    assert_eq!(tl.chunk_ts, vec![300, 400]);
    assert_eq!((tl.end, tl.aborted, tl.done_seen), (600, false, true));
}

// ---- Other bodies ----

#[test]
fn non_streaming_json_is_one_fixed_chunk() {
    let body = r#"{"id":"chatcmpl-9","object":"chat.completion","model":"m-resp","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9}}"#;
    let response = json_response(body);
    let head_len = response.len() - body.len();
    let mut sim = Sim::new();
    sim.read(100, chat_request("m-req", false));
    sim.write(500, &response[..head_len]);
    sim.write(600, &response[head_len..head_len + 20]);
    sim.write(700, &response[head_len + 20..]);
    let tl = sim.one();
    assert_eq!(tl.body_kind, Some(BodyKind::Fixed));
    assert!(!tl.is_stream());
    assert_eq!(tl.response_start, Some(500));
    assert_eq!(tl.first_body_byte, Some(600));
    assert_eq!(tl.chunk_ts, vec![600]);
    assert_eq!(tl.ttft_ns(), Some(500));
    assert_eq!(tl.end, 700);
    assert_eq!(tl.response_id.as_deref(), Some("chatcmpl-9"));
    assert_eq!(tl.model.as_deref(), Some("m-req"));
    assert_eq!(
        tl.usage,
        Some(Usage {
            prompt_tokens: Some(7),
            completion_tokens: Some(2)
        })
    );
    assert_eq!(tl.response_bytes, response.len() as u64);
}

#[test]
fn chunked_stream_that_is_not_sse() {
    let mut sim = Sim::new();
    sim.read(100, get_request("/ndjson"));
    sim.write(
        200,
        "HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n",
    );
    sim.write(300, chunk("{\"id\":\"nd-1\",\"t\":\"a\"}\n"));
    let data = chunk("{\"t\":\"b\"}\n");
    sim.write(400, &data[..6]);
    sim.write(450, &data[6..]);
    let mut two = chunk("x");
    two.extend(chunk("y"));
    sim.write(500, two);
    sim.write(600, LAST_CHUNK);
    let tl = sim.one();
    assert_eq!(tl.body_kind, Some(BodyKind::Chunked));
    assert_eq!(tl.chunk_ts, vec![300, 450, 500, 500]);
    assert_eq!(tl.first_body_byte, Some(300));
    assert_eq!(tl.ttft_ns(), Some(200));
    assert_eq!(tl.end, 600);
    assert_eq!(tl.response_id.as_deref(), Some("nd-1"));
}

#[test]
fn until_close_counts_writes_and_completes_at_close() {
    let mut sim = Sim::new();
    sim.read(100, get_request("/raw"));
    sim.write(200, "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n");
    sim.write(300, "tok1 ");
    sim.write(400, "tok2 ");
    sim.write(500, "tok3");
    assert!(sim.out.is_empty());
    sim.close(650);
    let tl = sim.one();
    assert_eq!(tl.body_kind, Some(BodyKind::UntilClose));
    assert_eq!(tl.chunk_ts, vec![300, 400, 500]);
    assert_eq!((tl.end, tl.aborted), (650, false));
    assert_eq!(sim.st.stats().requests_completed, 1);
    assert_eq!(sim.st.open_connections(), 0);
}

#[test]
fn head_and_no_content_responses_are_empty() {
    let mut sim = Sim::new();
    sim.read(100, "HEAD /v1/models HTTP/1.1\r\nHost: x\r\n\r\n");
    sim.write(200, "HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n");
    let tl = sim.one();
    assert_eq!(tl.body_kind, Some(BodyKind::Empty));
    assert_eq!(
        (tl.end, tl.first_body_byte, tl.ttft_ns()),
        (200, None, None)
    );
    assert!(tl.chunk_ts.is_empty());

    // The next request on the connection is unaffected by the 1234.
    sim.read(300, "DELETE /x HTTP/1.1\r\n\r\n");
    sim.write(400, "HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n");
    sim.read(500, get_request("/empty"));
    sim.write(600, "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n");
    let out = sim.take();
    assert_eq!(out.len(), 2);
    assert_eq!((out[0].status, out[0].end), (Some(204), 400));
    assert_eq!((out[1].body_kind, out[1].end), (Some(BodyKind::Empty), 600));
}

#[test]
fn hundred_continue_is_skipped() {
    let body = r#"{"model":"cont","prompt":"x"}"#;
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let mut sim = Sim::new();
    sim.read(100, &head);
    sim.write(150, "HTTP/1.1 100 Continue\r\n\r\n");
    sim.read(200, body);
    sim.write(300, json_response(r#"{"id":"after-continue"}"#));
    let tl = sim.one();
    assert_eq!(tl.status, Some(200));
    assert_eq!((tl.request_start, tl.request_end), (100, 200));
    assert_eq!(
        tl.response_start,
        Some(300),
        "the final response's first write"
    );
    assert_eq!(tl.model.as_deref(), Some("cont"));
    assert_eq!(tl.response_id.as_deref(), Some("after-continue"));
    assert_eq!(sim.st.stats().parse_errors, 0);
}

// ---- Requests ----

#[test]
fn request_split_at_every_byte() {
    let request = chat_request("split-model", true);
    for i in 1..request.len() {
        let mut sim = Sim::new();
        sim.read(100, &request[..i]);
        sim.read(200, &request[i..]);
        sim.write(300, json_response("{}"));
        let tl = sim.one();
        assert_eq!(
            (tl.request_start, tl.request_end),
            (100, 200),
            "split at {i}"
        );
        assert_eq!(tl.model.as_deref(), Some("split-model"), "split at {i}");
        assert!(tl.traceparent.is_some(), "split at {i}");
        assert_eq!(tl.request_bytes, request.len() as u64);
    }
}

#[test]
fn chunked_request_body() {
    let mut sim = Sim::new();
    let mut request =
        b"POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    request.extend(chunk(r#"{"model":"#));
    request.extend(chunk(r#""chunky","stream":true}"#));
    request.extend_from_slice(LAST_CHUNK);
    sim.read(100, &request[..70]);
    sim.read(200, &request[70..]);
    sim.write(300, json_response("{}"));
    let tl = sim.one();
    assert_eq!(tl.model.as_deref(), Some("chunky"));
    assert_eq!(tl.request_end, 200);
    assert_eq!(tl.request_bytes, request.len() as u64);
}

#[test]
fn truncated_request_body_is_counted_by_length() {
    // A long prompt beyond the capture cap: the body is consumed by count
    // and the next request on the connection still parses.
    let request = chat_request("cut", true);
    let head_len = request
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a head")
        + 4;
    let mut sim = Sim::new();
    sim.read_cut(100, &request, head_len + 20);
    sim.write(200, json_response(r#"{"id":"r1"}"#));
    sim.read(300, get_request("/next"));
    sim.write(400, json_response(r#"{"id":"r2"}"#));
    let out = sim.take();
    assert_eq!(out.len(), 2);
    assert_eq!(out[0].request_bytes, request.len() as u64);
    assert_eq!(out[0].model, None, "model was past the captured prefix");
    assert_eq!(out[0].truncated_writes, 0, "reads are not writes");
    assert_eq!(out[1].path, "/next");
    assert_eq!(sim.st.stats().parse_errors, 0);
}

#[test]
fn open_requests_are_snapshotted_by_phase_without_being_consumed() {
    use crate::model::Phase;
    let mut sim = Sim::new();
    let mut reads = chat_request("m1", true);
    reads.extend(get_request("/second"));
    sim.read(100, reads);
    sim.write(200, SSE_CHUNKED_HEAD);
    let waiting = |sim: &Sim| -> Vec<(String, Option<String>, Phase, u32)> {
        sim.st
            .open_requests()
            .into_iter()
            .map(|r| (r.path, r.model, r.phase, r.pid))
            .collect()
    };
    let first = |phase| {
        (
            "/v1/chat/completions".to_string(),
            Some("m1".to_string()),
            phase,
            PID,
        )
    };
    let second = ("/second".to_string(), None, Phase::FirstToken, PID);
    // the response head is not a token
    assert_eq!(
        waiting(&sim),
        vec![first(Phase::FirstToken), second.clone()]
    );
    sim.write(300, chunk(&standard_events()[0]));
    assert_eq!(waiting(&sim), vec![first(Phase::Streaming), second]);
    assert!(sim.out.is_empty(), "a snapshot reports nothing");
    sim.write(400, LAST_CHUNK);
    sim.write(500, json_response(r#"{"id":"x"}"#));
    assert_eq!(sim.take().len(), 2);
    assert_eq!(waiting(&sim), vec![]);
}

#[test]
fn pipelined_requests_in_one_read() {
    let mut sim = Sim::new();
    let mut reads = get_request("/first");
    reads.extend(chat_request("second-model", false));
    reads.extend(get_request("/third"));
    sim.read(100, reads);
    // The first two responses coalesced in one write, the third split.
    let mut writes = json_response(r#"{"id":"one"}"#);
    writes.extend(json_response(r#"{"id":"two"}"#));
    sim.write(200, writes);
    let third = json_response(r#"{"id":"three"}"#);
    sim.write(300, &third[..10]);
    sim.write(400, &third[10..]);
    let out = sim.take();
    let summary: Vec<_> = out
        .iter()
        .map(|t| {
            (
                t.path.as_str(),
                t.response_id.as_deref(),
                t.request_start,
                t.response_start,
                t.end,
            )
        })
        .collect();
    assert_eq!(
        summary,
        vec![
            ("/first", Some("one"), 100, Some(200), 200),
            ("/v1/chat/completions", Some("two"), 100, Some(200), 200),
            ("/third", Some("three"), 100, Some(300), 400),
        ]
    );
    assert_eq!(out[1].model.as_deref(), Some("second-model"));
    let per_response: Vec<u64> = out.iter().map(|t| t.response_bytes).collect();
    let expected = [
        json_response(r#"{"id":"one"}"#).len() as u64,
        json_response(r#"{"id":"two"}"#).len() as u64,
        third.len() as u64,
    ];
    assert_eq!(per_response, expected);
}

#[test]
fn keep_alive_sequence() {
    let mut sim = Sim::new();
    for i in 0..5u64 {
        let t = 1000 * (i + 1);
        sim.read(t, chat_request(&format!("m{i}"), true));
        sim.write(t + 100, SSE_CHUNKED_HEAD);
        sim.write(t + 200, chunk(token_event(&format!("id{i}"), "x")));
        sim.write(t + 300, chunk(DONE_EVENT));
        sim.write(t + 400, LAST_CHUNK);
    }
    let out = sim.take();
    assert_eq!(out.len(), 5);
    for (i, tl) in out.iter().enumerate() {
        let t = 1000 * (i as u64 + 1);
        assert_eq!(tl.model.as_deref(), Some(format!("m{i}").as_str()));
        assert_eq!(tl.response_id.as_deref(), Some(format!("id{i}").as_str()));
        assert_eq!((tl.request_start, tl.end), (t, t + 400));
        assert_eq!(tl.chunk_ts, vec![t + 200]);
    }
    assert_eq!(sim.st.stats().requests_completed, 5);
}

// ---- Connection lifecycle ----

#[test]
fn close_mid_stream_aborts() {
    let mut sim = Sim::new();
    sim.read(100, chat_request("m", true));
    sim.write(200, SSE_CHUNKED_HEAD);
    sim.write(300, chunk(token_event("partial", "a")));
    sim.write(400, chunk(token_event("partial", "b")));
    sim.close(500);
    let tl = sim.one();
    assert!(tl.aborted);
    // No FIN or RST from the client came first: the server closed it.
    assert_eq!(tl.abort_reason, Some(AbortReason::ServerClosed));
    assert_eq!(tl.end, 500);
    assert_eq!(tl.chunk_ts, vec![300, 400]);
    assert_eq!(tl.response_id.as_deref(), Some("partial"));
    assert!(!tl.done_seen);
    assert_eq!(sim.st.stats().requests_aborted, 1);
    assert_eq!(sim.st.open_connections(), 0);
}

#[test]
fn close_reports_requests_without_any_response() {
    let mut sim = Sim::new();
    let mut reads = get_request("/a");
    reads.extend(get_request("/b"));
    sim.read(100, reads);
    sim.write(200, json_response("{}"));
    sim.close(300);
    let out = sim.take();
    assert_eq!(out.len(), 2);
    assert!(!out[0].aborted);
    assert_eq!(out[1].path, "/b");
    assert_eq!(out[1].abort_reason, Some(AbortReason::ServerClosed));
    assert_eq!((out[1].status, out[1].end), (None, 300));
}

#[test]
fn process_exit_aborts_every_connection_of_the_pid() {
    let mut sim = Sim::new();
    let other = conn_id(8, 992);
    let other_pid = ConnId {
        pid: PID + 1,
        ..other
    };
    sim.read(100, chat_request("m", true));
    sim.write(200, SSE_CHUNKED_HEAD);
    sim.read_on(other, 150, get_request("/o"));
    sim.read_on(other_pid, 160, get_request("/p"));
    sim.exit(PID, 900);
    let out = sim.take();
    assert_eq!(out.len(), 2);
    assert!(out
        .iter()
        .all(|t| t.abort_reason == Some(AbortReason::ProcessExited) && t.end == 900));
    assert_eq!(
        sim.st.open_connections(),
        1,
        "the other pid's connection stays"
    );
}

#[test]
fn finish_aborts_in_flight_requests_at_now() {
    let mut sim = Sim::new();
    sim.read(100, chat_request("m", true));
    sim.write(200, SSE_CHUNKED_HEAD);
    sim.write(300, chunk(token_event("f", "a")));
    let mut out = Vec::new();
    sim.st.finish(5000, &mut out);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].abort_reason, Some(AbortReason::AgentStopped));
    assert_eq!((out[0].end, out[0].chunk_ts.clone()), (5000, vec![300]));
    assert_eq!(sim.st.open_connections(), 0);
}

#[test]
fn expire_idle_frees_quiet_connections() {
    let mut sim = Sim::new();
    sim.read(100, chat_request("m", true));
    sim.write(200, SSE_CHUNKED_HEAD);
    let busy = conn_id(9, 993);
    sim.accept_on(busy, 900);
    let mut out = Vec::new();
    sim.st.expire_idle(1000, 800, &mut out);
    assert!(out.is_empty(), "an event at 200 is not idle since 200");
    sim.st.expire_idle(1000, 799, &mut out);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].abort_reason, Some(AbortReason::Idle));
    assert_eq!(out[0].end, 200, "ends at the last event seen");
    assert_eq!(sim.st.open_connections(), 1);
}

#[test]
fn fd_reuse_after_close() {
    let mut sim = Sim::new();
    sim.read(100, get_request("/old"));
    sim.write(200, json_response(r#"{"id":"old"}"#));
    sim.close(300);
    sim.conn = conn_id(7, 5555);
    sim.accept_on(sim.conn, 400);
    sim.read(500, get_request("/new"));
    sim.write(600, json_response(r#"{"id":"new"}"#));
    let out = sim.take();
    assert_eq!(out.len(), 2);
    assert_eq!(out[1].conn.sock_ino, 5555);
    assert_eq!(out[1].response_id.as_deref(), Some("new"));
    assert!(out.iter().all(|t| !t.aborted));
}

#[test]
fn fd_reuse_without_close_event() {
    let mut sim = Sim::new();
    sim.read(100, chat_request("m", true));
    sim.write(200, SSE_CHUNKED_HEAD);
    sim.write(300, chunk(token_event("lost", "a")));
    // The close was missed; a new socket shows up on the same fd.
    sim.conn = conn_id(7, 6666);
    sim.read(1000, get_request("/new"));
    let old = sim.one();
    assert_eq!(old.conn.sock_ino, 991);
    assert_eq!(old.abort_reason, Some(AbortReason::ConnectionClosed));
    assert_eq!(old.end, 300, "closed at its last event");
    sim.write(1100, json_response("{}"));
    let new = sim.one();
    assert_eq!((new.path.as_str(), new.aborted), ("/new", false));
    assert_eq!(sim.st.open_connections(), 1);
}

#[test]
fn eviction_beyond_max_connections() {
    let config = StitchConfig {
        max_connections: 2,
        ..StitchConfig::default()
    };
    let mut sim = Sim::with_config(config);
    sim.read(100, get_request("/oldest"));
    sim.read_on(conn_id(8, 2), 200, get_request("/b"));
    sim.read_on(conn_id(9, 3), 300, get_request("/c"));
    let tl = sim.one();
    assert_eq!(tl.path, "/oldest");
    assert_eq!((tl.abort_reason, tl.end), (Some(AbortReason::Idle), 100));
    assert_eq!(sim.st.stats().evicted_connections, 1);
    assert_eq!(sim.st.open_connections(), 2);
}

#[test]
fn forget_process_drops_state_silently() {
    let mut sim = Sim::new();
    sim.read(100, get_request("/x"));
    sim.st.forget_process(PID);
    assert_eq!(sim.st.open_connections(), 0);
    sim.close(200);
    assert!(sim.take().is_empty());
    assert_eq!(sim.st.stats().requests_aborted, 0);
}

#[test]
fn client_role_connection_gives_client_timelines() {
    let mut sim = Sim::new();
    // The server calls out to another service on this socket.
    sim.write(100, chat_request("upstream", true));
    sim.read(
        200,
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n",
    );
    sim.read(250, "12\r\ndata: {\"id\":\"a\"}\n\n\r\n");
    sim.read(270, "12\r\ndata: {\"id\":\"a\"}\n\n\r\n0\r\n\r\n");
    sim.write(300, get_request("/again"));
    sim.close(400);
    let out = sim.take();
    assert_eq!(out.len(), 2, "{out:#?}");
    let first = &out[0];
    assert_eq!(first.kind, SpanKind::Client);
    assert_eq!(first.request_start, 100, "start = the request's write");
    assert!(!first.ingress_known);
    assert_eq!(first.chunk_ts, vec![250, 270], "chunks = the reads' bytes");
    assert_eq!(first.response_id.as_deref(), Some("a"));
    assert!(!first.aborted);
    // the second request never got its response: the process closed it
    assert_eq!(out[1].path, "/again");
    assert_eq!(out[1].abort_reason, Some(AbortReason::ClientClosed));
    let stats = sim.st.stats();
    assert_eq!(stats.client_connections, 1);
    assert_eq!(stats.client_requests, 2);
    assert_eq!(stats.parse_errors, 0);
    assert_eq!(
        stats.requests_aborted, 0,
        "client requests are counted apart"
    );
}

#[test]
fn upgraded_connection_is_ignored_after_101() {
    let mut sim = Sim::new();
    sim.read(
        100,
        "GET /ws HTTP/1.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
    );
    sim.write(
        200,
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n",
    );
    sim.write(300, [0x81, 0x05, b'h', b'e', b'l', b'l', b'o']);
    sim.read(400, [0x81, 0x85, 1, 2, 3, 4, 5]);
    sim.close(500);
    let tl = sim.one();
    assert_eq!((tl.status, tl.end, tl.aborted), (Some(101), 200, false));
    assert_eq!(sim.st.stats().parse_errors, 0);
}

// ---- Garbage, truncation, limits ----

#[test]
fn garbage_request_bytes_then_valid_request() {
    let mut sim = Sim::new();
    // Binary junk (not a TLS record: those mark a ciphertext connection,
    // see the TLS tests below).
    sim.read(100, b"\x00\x01\x02binary junk\xff\xfe");
    sim.read(150, b"more junk bytes \x00\x01");
    assert_eq!(sim.st.stats().parse_errors, 1, "one error per garbage run");
    sim.read(200, get_request("/ok"));
    sim.write(300, json_response(r#"{"id":"ok"}"#));
    let tl = sim.one();
    assert_eq!((tl.path.as_str(), tl.request_start), ("/ok", 200));
    assert_eq!(tl.response_id.as_deref(), Some("ok"));
    assert_eq!(sim.st.stats().parse_errors, 1);
}

#[test]
fn ingress_garbage_keeps_a_request_whose_response_still_parses() {
    let mut sim = Sim::new();
    sim.read(100, chat_request("m", true));
    sim.write(200, SSE_CHUNKED_HEAD);
    sim.read(250, "NOT HTTP \x00\x01\x02\r\n\r\n");
    sim.write(300, chunk(token_event("still", "a")));
    sim.write(400, LAST_CHUNK);
    let tl = sim.one();
    assert!(!tl.aborted);
    assert_eq!(tl.chunk_ts, vec![300]);
    assert_eq!(sim.st.stats().parse_errors, 1);
}

#[test]
fn egress_garbage_aborts_the_response_with_parse_error() {
    let mut sim = Sim::new();
    let mut reads = chat_request("m", true);
    reads.extend(get_request("/queued"));
    sim.read(100, reads);
    sim.write(200, SSE_CHUNKED_HEAD);
    sim.write(300, chunk(token_event("g", "a")));
    sim.write(400, "zz-not-a-chunk-size\r\n");
    let tl = sim.one();
    assert_eq!(tl.abort_reason, Some(AbortReason::ParseError));
    assert_eq!((tl.end, tl.chunk_ts.clone()), (400, vec![300]));
    // The rest of the broken response is dropped, the queued request's
    // response is found at the next status line.
    sim.write(500, chunk(token_event("g", "b")));
    sim.write(600, json_response(r#"{"id":"queued"}"#));
    let tl = sim.one();
    assert_eq!((tl.path.as_str(), tl.aborted), ("/queued", false));
    assert_eq!(tl.response_id.as_deref(), Some("queued"));
    assert_eq!(sim.st.stats().parse_errors, 1);
}

#[test]
fn response_without_request_is_an_error() {
    let mut sim = Sim::new();
    sim.write(100, json_response("{}"));
    sim.write(200, "more of it");
    assert_eq!(sim.st.stats().parse_errors, 1);
    assert!(sim.take().is_empty());
    // Responses resume once a request is waiting.
    sim.read(300, get_request("/x"));
    sim.write(400, json_response("{}"));
    assert!(!sim.one().aborted);
}

#[test]
fn connection_predating_the_agent_is_adopted_quietly() {
    let mut sim = Sim::without_accept(StitchConfig::default());
    // The agent starts in the middle of a stream: its tail, then the
    // client's next request.
    sim.write(100, chunk(token_event("before", "x")));
    sim.write(110, LAST_CHUNK);
    sim.read(200, get_request("/after"));
    sim.write(300, json_response("{}"));
    let tl = sim.one();
    assert_eq!(tl.path, "/after");
    assert_eq!(tl.comm, COMM);
    assert_eq!(sim.st.stats().parse_errors, 0);
    assert_eq!(sim.st.open_connections(), 1);
}

#[test]
fn oversized_head_is_dropped_at_the_limit() {
    let config = StitchConfig {
        max_buffered_bytes: 256,
        ..StitchConfig::default()
    };
    let mut sim = Sim::with_config(config);
    sim.read(100, "GET / HTTP/1.1\r\n");
    for i in 0..20 {
        sim.read(
            110 + i,
            "X-Filler: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n",
        );
    }
    assert_eq!(sim.st.stats().parse_errors, 1);
    sim.read(200, get_request("/fine"));
    sim.write(300, json_response("{}"));
    assert_eq!(sim.one().path, "/fine");
}

#[test]
fn pipelining_flood_is_bounded() {
    let mut sim = Sim::new();
    let flood: Vec<u8> = (0..request::MAX_IN_FLIGHT + 10)
        .flat_map(|i| get_request(&format!("/{i}")))
        .collect();
    sim.read(100, flood);
    assert_eq!(sim.st.stats().parse_errors, 1);
    sim.close(200);
    let out = sim.take();
    assert_eq!(out.len(), request::MAX_IN_FLIGHT);
    assert!(out
        .iter()
        .all(|t| t.abort_reason == Some(AbortReason::ServerClosed)));
}

#[test]
fn heads_cut_by_the_capture_cap() {
    let mut sim = Sim::new();
    let request = chat_request("m", true);
    sim.read_cut(100, &request, 40);
    assert_eq!(sim.st.stats().parse_errors, 1);
    sim.read(200, get_request("/ok"));
    let response = json_response(r#"{"id":"cut-head"}"#);
    sim.write_cut(300, &response, 20);
    let tl = sim.one();
    assert_eq!(
        (tl.path.as_str(), tl.abort_reason),
        ("/ok", Some(AbortReason::ParseError))
    );
    assert_eq!((tl.response_start, tl.truncated_writes), (Some(300), 1));
    assert_eq!(sim.st.stats().parse_errors, 2);
}

#[test]
fn truncated_write_inside_an_event() {
    let mut sim = Sim::new();
    sim.read(100, chat_request("m", true));
    sim.write(200, SSE_CHUNKED_HEAD);
    // An event longer than the capture cap: cut after its id.
    let big = format!(
        "data: {{\"id\":\"cut-id\",\"choices\":[{{\"delta\":{{\"content\":\"{}\"}}}}]}}\n\n",
        "x".repeat(5000)
    );
    sim.write_cut(300, chunk(&big), 64);
    sim.write(400, chunk(token_event("cut-id", "y")));
    // Several events coalesced, the cut falling in the second: the first
    // counts, the cut one counts at this write, the third is unseen.
    let coalesced = [
        token_event("cut-id", "a"),
        token_event("cut-id", "b"),
        token_event("cut-id", "c"),
    ]
    .concat();
    let framed = chunk(&coalesced);
    let cut = framed.len() - 2 - 2 * token_event("cut-id", "c").len() + 10;
    sim.write_cut(500, &framed, cut);
    sim.write(600, chunk(DONE_EVENT));
    sim.write(700, LAST_CHUNK);
    let tl = sim.one();
    assert_eq!(tl.chunk_ts, vec![300, 400, 500, 500]);
    assert_eq!(tl.response_id.as_deref(), Some("cut-id"));
    assert_eq!(tl.truncated_writes, 2);
    assert_eq!(tl.response_bytes, {
        let total: usize = [
            SSE_CHUNKED_HEAD.len(),
            chunk(&big).len(),
            chunk(token_event("cut-id", "y")).len(),
            framed.len(),
            chunk(DONE_EVENT).len(),
            LAST_CHUNK.len(),
        ]
        .iter()
        .sum();
        total as u64
    });
    assert!(!tl.aborted && tl.done_seen);
    assert_eq!(sim.st.stats().truncated_writes, 2);
    assert_eq!(sim.st.stats().parse_errors, 0);
}

#[test]
fn truncated_write_with_framing_in_the_lost_tail() {
    let mut sim = Sim::new();
    sim.read(100, chat_request("m", true));
    sim.write(200, SSE_CHUNKED_HEAD);
    // Two whole chunks in one write, cut inside the first: the second
    // chunk's framing is in the uncaptured tail. Framing resumes at the
    // next write.
    let mut two = chunk(token_event("t", "a"));
    two.extend(chunk(token_event("t", "b")));
    sim.write_cut(300, &two, 40);
    sim.write(400, chunk(token_event("t", "c")));
    // The last event and the terminating chunk in one cut write: the
    // five-byte tail after the event's chunk is taken as `0\r\n\r\n`.
    let mut last = chunk(usage_event("t", 1, 2));
    last.extend_from_slice(LAST_CHUNK);
    sim.write_cut(500, &last, 30);
    let tl = sim.one();
    assert_eq!(tl.chunk_ts, vec![300, 400, 500]);
    assert_eq!((tl.end, tl.aborted, tl.truncated_writes), (500, false, 2));
    assert_eq!(tl.usage, None, "the usage event was not captured");
}

#[test]
fn truncated_fixed_body_still_completes() {
    let body = format!(r#"{{"id":"long-json","text":"{}"}}"#, "z".repeat(3000));
    let response = json_response(&body);
    let mut sim = Sim::new();
    sim.read(100, get_request("/json"));
    sim.write_cut(200, &response, 120);
    let tl = sim.one();
    assert_eq!((tl.end, tl.aborted), (200, false));
    assert_eq!(tl.response_id.as_deref(), Some("long-json"));
    assert_eq!(tl.response_bytes, response.len() as u64);
    assert_eq!(tl.truncated_writes, 1);
}

#[test]
fn zero_length_and_other_events_are_harmless() {
    let mut sim = Sim::new();
    sim.read(100, "");
    sim.push(Event::Listen(ListenEvent {
        pid: PID,
        comm: COMM.to_owned(),
        ts: 101,
        port: 8000,
    }));
    sim.push(Event::Exec(ProcEvent {
        pid: PID,
        ppid: 1,
        comm: COMM.to_owned(),
        ts: 102,
        filename: "/usr/bin/python3".to_owned(),
        exit_code: 0,
    }));
    // A payload longer than the length it claims is clamped.
    sim.data_on(sim.conn, Direction::Ingress, 200, &get_request("/ok"), 1);
    sim.close(300);
    sim.close(301);
    assert!(sim.take().is_empty());
    assert_eq!(sim.st.open_connections(), 0);
}

// ---- Fuzzing ----

/// A deterministic generator: a 64-bit LCG (Knuth's MMIX constants), high
/// bits used.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Feeds `bytes` in random pieces with random truncation, on the given
/// connection and direction or on random ones, with closes, exits and
/// expiry mixed in.
fn feed_randomly(
    rng: &mut Lcg,
    sim: &mut Sim,
    target: Option<(ConnId, Direction)>,
    bytes: &[u8],
    mut ts: MonoNs,
) -> MonoNs {
    let mut pos = 0;
    while pos < bytes.len() {
        let n = 1 + rng.below(64.min(bytes.len() - pos));
        let piece = &bytes[pos..pos + n];
        pos += n;
        ts += 1 + rng.below(5) as u64;
        let (conn, direction) = target.unwrap_or_else(|| {
            let conn = conn_id(7 + rng.below(2) as i32, 991 + rng.below(2) as u64);
            let direction = if rng.below(2) == 0 {
                Direction::Ingress
            } else {
                Direction::Egress
            };
            (conn, direction)
        });
        let captured = if rng.below(8) == 0 { rng.below(n) } else { n };
        sim.data_on(conn, direction, ts, &piece[..captured], n);
        match rng.below(200) {
            0 => sim.close(ts),
            1 => sim.exit(PID, ts),
            2 => {
                let mut out = Vec::new();
                sim.st.expire_idle(ts, rng.below(20) as u64, &mut out);
                sim.out.extend(out);
            }
            _ => {}
        }
    }
    ts
}

/// Stops the stitcher and checks that every request came out exactly
/// once (the counters see each emission once) and nothing is left.
fn finish_and_check(sim: &mut Sim, now: MonoNs) {
    let mut out = Vec::new();
    sim.st.finish(now, &mut out);
    sim.out.extend(out);
    let stats = sim.st.stats();
    assert_eq!(
        (stats.requests_completed + stats.requests_aborted) as usize,
        sim.out.len()
    );
    assert_eq!(sim.st.open_connections(), 0);
    for tl in &sim.out {
        assert!(tl.end >= tl.request_start, "{tl:#?}");
        assert!(tl.chunk_ts.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(tl.aborted, tl.abort_reason.is_some());
    }
}

#[test]
fn fuzz_random_bytes_never_panic() {
    let mut rng = Lcg(0x5eed);
    let config = StitchConfig {
        max_buffered_bytes: 512,
        max_connections: 3,
        ..StitchConfig::default()
    };
    let mut sim = Sim::with_config(config);
    let mut ts = 10;
    for _ in 0..300 {
        let len = rng.below(600);
        let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        ts = feed_randomly(&mut rng, &mut sim, None, &bytes, ts);
    }
    finish_and_check(&mut sim, ts + 1);
}

#[test]
fn fuzz_mutated_http_never_panics_and_reports_each_request_once() {
    let mut rng = Lcg(42);
    let messages: Vec<(Direction, Vec<u8>)> = vec![
        (Direction::Ingress, chat_request("fz", true)),
        (
            Direction::Egress,
            build_sse_response(&standard_events()).bytes,
        ),
        (Direction::Ingress, get_request("/plain")),
        (Direction::Egress, b"HTTP/1.1 100 Continue\r\n\r\n".to_vec()),
        (
            Direction::Egress,
            json_response(r#"{"id":"x","usage":{"prompt_tokens":1}}"#),
        ),
        (
            Direction::Ingress,
            b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
                .to_vec(),
        ),
        (
            Direction::Egress,
            b"HTTP/1.1 200 OK\r\n\r\nuntil close".to_vec(),
        ),
    ];
    let mut sim = Sim::new();
    let mut ts = 10;
    for _ in 0..300 {
        for (direction, message) in &messages {
            let mut bytes = message.clone();
            if rng.below(3) == 0 {
                for _ in 0..1 + rng.below(4) {
                    let i = rng.below(bytes.len());
                    bytes[i] = match rng.below(4) {
                        0 => b'\r',
                        1 => b'\n',
                        2 => b'0' + rng.below(10) as u8,
                        _ => rng.next() as u8,
                    };
                }
            }
            let target = Some((sim.conn, *direction));
            ts = feed_randomly(&mut rng, &mut sim, target, &bytes, ts);
        }
        // Ends the close-delimited response.
        ts += 1;
        sim.close(ts);
    }
    finish_and_check(&mut sim, ts + 1);
    let stats = sim.st.stats();
    assert!(stats.requests_completed > 100, "{stats:?}");
    assert!(stats.parse_errors > 0, "{stats:?}");
}

// ---- Request ingress, who closed, request ids: see tests/wire.rs ----

mod h2;
mod wire;

// ---- TLS ----

/// A plaintext connection seen through OpenSSL: fd -1, keyed by the SSL*.
fn tls_conn(ssl: u64) -> ConnId {
    conn_id(ConnId::TLS_FD, ssl)
}

fn sse_response(id: &str, tokens: usize) -> Vec<u8> {
    let mut body = String::new();
    for i in 0..tokens {
        body.push_str(&token_event(id, &format!("t{i}")));
    }
    body.push_str("data: [DONE]\n\n");
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

#[test]
fn tls_ciphertext_on_a_socket_is_ignored_not_parsed() {
    let mut sim = Sim::new();
    // A ClientHello, then application data records, both ways.
    sim.read(10, [0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc]);
    sim.write(20, [0x16, 0x03, 0x03, 0x00, 0x7a, 0x02, 0x00]);
    sim.read(30, [0x17, 0x03, 0x03, 0x00, 0x40, 0xde, 0xad]);
    sim.write(40, [0x17, 0x03, 0x03, 0x01, 0x00, 0xbe, 0xef]);
    sim.close(50);
    assert!(
        sim.take().is_empty(),
        "ciphertext must not produce timelines"
    );
    assert_eq!(
        sim.st.stats().parse_errors,
        0,
        "ciphertext is not a parse error"
    );
    assert_eq!(sim.st.stats().ciphertext_connections, 1);
}

#[test]
fn tls_connections_are_keyed_by_ssl_pointer_and_closed_by_ssl_free() {
    let mut sim = Sim::without_accept(StitchConfig::default());
    let (a, b) = (tls_conn(0x5555_0000_1000), tls_conn(0x5555_0000_2000));
    // Two concurrent TLS streams in one process: neither retires the other.
    sim.read_on(a, 10, chat_request("m", true));
    sim.read_on(b, 11, chat_request("m", true));
    sim.data_on(
        a,
        Direction::Egress,
        20,
        &sse_response("a", 2),
        sse_response("a", 2).len(),
    );
    sim.data_on(
        b,
        Direction::Egress,
        21,
        &sse_response("b", 3),
        sse_response("b", 3).len(),
    );
    let mut out = sim.take();
    out.sort_by_key(|t| t.conn.sock_ino);
    assert_eq!(out.len(), 2, "{out:#?}");
    assert!(out.iter().all(|t| t.tls && !t.aborted));
    assert_eq!(out[0].response_id.as_deref(), Some("a"));
    assert_eq!(out[0].chunk_ts.len(), 2);
    assert_eq!(out[1].response_id.as_deref(), Some("b"));
    assert_eq!(out[1].chunk_ts.len(), 3);

    // SSL_free of `a` mid-request aborts only `a`'s request.
    sim.read_on(a, 30, chat_request("m", true));
    sim.read_on(b, 31, chat_request("m", true));
    sim.push(Event::Close(ConnEvent {
        conn: a,
        tid: PID,
        comm: COMM.to_owned(),
        ts: 40,
        addrs: None,
        established: None,
    }));
    let aborted = sim.one();
    assert_eq!(aborted.conn, a);
    assert_eq!(aborted.abort_reason, Some(AbortReason::ConnectionClosed));
    sim.data_on(
        b,
        Direction::Egress,
        50,
        &sse_response("b2", 1),
        sse_response("b2", 1).len(),
    );
    let done = sim.one();
    assert_eq!((done.conn, done.aborted), (b, false));
}

// ---- Event order: what ingest guarantees and what it does not ----
//
// Ingest hands events on in ring buffer order: the order in which the
// probes *reserved* their records, on whatever CPU they ran. A data
// record is reserved after its syscall, so per socket it follows the order
// in which the bytes went through (the socket lock serialises them), but
// timestamps are read before the reservation: records of different CPUs
// can arrive out of timestamp order, by the time between a probe's
// clock read and its reserve. Nothing sorts them. So stitching must only
// need byte order per connection, never global time order.

/// Two connections whose records arrive interleaved and out of time order
/// (conn B's earlier request after conn A's later events): each timeline
/// is built from its own connection's bytes, with its own times.
#[test]
fn connections_interleaved_out_of_time_order_stitch_independently() {
    let mut sim = Sim::new();
    let a = sim.conn;
    let b = conn_id(8, 992);
    sim.accept_on(b, 2);
    let events = standard_events();
    let write_on = |sim: &mut Sim, conn, ts, bytes: &[u8]| {
        sim.data_on(conn, Direction::Egress, ts, bytes, bytes.len());
    };
    // A's request and head at 1000.., then B's (earlier) at 500..
    sim.read_on(a, 1_000, chat_request("m", true));
    write_on(&mut sim, a, 1_100, SSE_CHUNKED_HEAD.as_bytes());
    sim.read_on(b, 500, chat_request("m", true));
    write_on(&mut sim, b, 600, SSE_CHUNKED_HEAD.as_bytes());
    for (i, event) in events.iter().enumerate() {
        let i = i as u64;
        // B's chunk i arrives before A's although it is 500 ns earlier...
        write_on(&mut sim, b, 700 + 100 * i, &chunk(event));
        write_on(&mut sim, a, 1_200 + 100 * i, &chunk(event));
    }
    // ...and A finishes first in arrival order
    write_on(&mut sim, a, 2_000, LAST_CHUNK);
    write_on(&mut sim, b, 1_500, LAST_CHUNK);
    let out = sim.take();
    assert_eq!(out.len(), 2, "{out:#?}");
    let (ta, tb) = (&out[0], &out[1]);
    assert_eq!((ta.conn, tb.conn), (a, b));
    assert_eq!(ta.chunk_ts, vec![1_200, 1_300, 1_400, 1_500]);
    assert_eq!(tb.chunk_ts, vec![700, 800, 900, 1_000]);
    assert_eq!((ta.ttft_ns(), tb.ttft_ns()), (Some(200), Some(200)));
    assert_eq!((ta.e2e_ns(), tb.e2e_ns()), (1_000, 1_000));
    assert_eq!(sim.st.stats().parse_errors, 0);
}

/// Two threads writing one socket (an event loop's executor threads): the
/// bytes arrive in socket order, but the second chunk's write was entered
/// before the first's (it waited for the socket lock). Every event is
/// still counted once, and no gap is negative: the late-stamped chunk's
/// emit is the previous chunk's.
#[test]
fn two_writers_on_one_connection_with_swapped_entry_times() {
    let mut sim = Sim::new();
    sim.read(100, chat_request("m", true));
    sim.write(200, SSE_CHUNKED_HEAD);
    let events = standard_events();
    // chunk 1 entered at 450, chunk 2 (its bytes after chunk 1's) at 400
    let times = [300u64, 450, 400, 600, 700];
    for (event, ts) in events.iter().zip(times) {
        sim.write(ts, chunk(event));
    }
    sim.write(800, LAST_CHUNK);
    let tl = sim.one();
    assert_eq!(tl.chunk_ts, vec![300, 450, 450, 600]);
    assert_eq!(tl.stats().itl_ns, vec![150, 0, 150]);
    assert_eq!(
        tl.stats().itl_ns.iter().sum::<u64>(),
        tl.chunk_ts[3] - tl.chunk_ts[0],
        "gaps add up to first-to-last"
    );
    assert_eq!(tl.response_id.as_deref(), Some("chatcmpl-42"));
    assert!(tl.done_seen && !tl.aborted);
    assert_eq!(sim.st.stats().parse_errors, 0);
}

/// A request read whose record arrives after the first response write's
/// (two threads: one read the request, another wrote; their records were
/// reserved on two CPUs in the other order). The bytes then do not match
/// HTTP order on the connection: the response has no request. That is
/// counted and the connection recovers for its next request; nothing
/// panics and nothing is misattributed.
#[test]
fn a_response_record_before_its_request_record_is_counted_and_recovered() {
    let mut sim = Sim::new();
    let events = standard_events();
    let response = build_sse_response(&events).bytes;
    sim.write(200, &response);
    sim.read(100, chat_request("m", true));
    assert!(
        sim.take().is_empty(),
        "no timeline from the orphaned response"
    );
    assert!(sim.st.stats().parse_errors >= 1, "{:?}", sim.st.stats());
    // the next exchange on the connection, in order, is stitched whole
    // (the request read above is still pending and gets this response)
    sim.write(300, &response);
    let tl = sim.one();
    assert_eq!(tl.request_start, 100);
    assert_eq!(tl.chunk_ts.len(), 4);
    assert!(tl.done_seen && !tl.aborted);
}
