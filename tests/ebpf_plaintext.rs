//! Root-only end-to-end tests: the real agent (`tokentrace run`, real eBPF)
//! against real plaintext HTTP/1.1 test servers, compared with a measuring
//! client on the same CLOCK_MONOTONIC time line.
//!
//! Run (as root; CI does):
//!   cargo test -p tokentrace --test ebpf_plaintext -- --test-threads=1 --nocapture
//!
//! Each test: start a server on a free port, start the agent on its pid,
//! wait for `tokentrace: ready`, run the client (sequential keep-alive
//! requests, then a few concurrent ones), wait for every request's record,
//! SIGINT the agent, then check per request (matched by the unique
//! `?rid=` path): exactly one record, status, stream flag, chunk count,
//! response id, |ΔTTFT| < 2 ms, and every chunk's emit time against the
//! client's arrival and the server's own pre-write timestamp.
//!
//! Tolerances (`Tolerance::light`), all from the physics of one loopback
//! write → read on a 2-core box:
//! * client arrival − agent emit ∈ [−0.2, 5] ms: the emit is the entry of the
//!   server's write, which happens before the client's recv returns (lower
//!   bound is float rounding of `chunk_offsets_ms` only); the upper bound is
//!   the Python client's wake-up + parse latency (measured p50 ≈ 0.1–0.4 ms,
//!   max ≈ 1–3 ms with 4 streams).
//! * agent emit − server stamp ∈ [−0.01, 5] ms: the server reads
//!   CLOCK_MONOTONIC just before handing the event to the socket (uvicorn:
//!   a few coroutine hops; http.server: one sendall).
//! * |client TTFT − agent TTFT| < 2 ms: the difference is the request's
//!   send→read latency plus the first chunk's write→recv latency.

#[path = "common/mod.rs"]
mod common;

use common::*;

fn sse_runs(sse_impl: Option<&'static str>) -> Vec<ClientRun> {
    let mut seq = ClientRun::sse(20, 1, "seq-");
    let mut conc = ClientRun::sse(8, 4, "conc-");
    seq.sse_impl = sse_impl;
    conc.sse_impl = sse_impl;
    vec![seq, conc]
}

fn runs_for(path: &'static str, stream: bool) -> Vec<ClientRun> {
    let mut seq = ClientRun::sse(10, 1, "seq-");
    let mut conc = ClientRun::sse(6, 3, "conc-");
    for r in [&mut seq, &mut conc] {
        r.path = path;
        r.stream = stream;
    }
    vec![seq, conc]
}

const SSE: Expect = Expect {
    stream: true,
    status: 200,
    has_response_id: true,
};
const CHUNKED_TEXT: Expect = Expect {
    stream: true,
    status: 200,
    has_response_id: false,
};
const JSON: Expect = Expect {
    stream: false,
    status: 200,
    has_response_id: true,
};

#[test]
fn root_fastapi_streaming_response_sse() {
    require_root("root_fastapi_streaming_response_sse");
    scenario(
        "fastapi StreamingResponse SSE",
        ServerKind::FastApi,
        &[],
        &sse_runs(None),
        &SSE,
        &Tolerance::light(),
    );
}

#[test]
fn root_fastapi_sse_starlette_event_source_response() {
    require_root("root_fastapi_sse_starlette_event_source_response");
    // sse-starlette frames events with CRLF ("data: …\r\n\r\n")
    scenario(
        "fastapi sse-starlette EventSourceResponse",
        ServerKind::FastApi,
        &[],
        &sse_runs(Some("sse-starlette")),
        &SSE,
        &Tolerance::light(),
    );
}

#[test]
fn root_stdlib_sse_framing_in_separate_writes() {
    require_root("root_stdlib_sse_framing_in_separate_writes");
    // http.server: chunk-size line, event data and CRLF are three sendto()s
    scenario(
        "stdlib http.server SSE, 3 writes per chunk",
        ServerKind::Stdlib,
        &[],
        &sse_runs(None),
        &SSE,
        &Tolerance::light(),
    );
}

#[test]
fn root_fastapi_chunked_text_stream() {
    require_root("root_fastapi_chunked_text_stream");
    scenario(
        "fastapi chunked text/plain stream",
        ServerKind::FastApi,
        &[],
        &runs_for("/v1/stream-text", true),
        &CHUNKED_TEXT,
        &Tolerance::light(),
    );
}

#[test]
fn root_stdlib_chunked_text_stream() {
    require_root("root_stdlib_chunked_text_stream");
    scenario(
        "stdlib chunked text/plain stream, 3 writes per chunk",
        ServerKind::Stdlib,
        &[],
        &runs_for("/v1/stream-text", true),
        &CHUNKED_TEXT,
        &Tolerance::light(),
    );
}

#[test]
fn root_fastapi_non_streaming_json() {
    require_root("root_fastapi_non_streaming_json");
    // Content-Length body: 1 chunk, TTFT = first body byte
    scenario(
        "fastapi non-streaming JSON",
        ServerKind::FastApi,
        &[],
        &runs_for("/v1/chat/completions", false),
        &JSON,
        &Tolerance::light(),
    );
}

#[test]
fn root_stdlib_non_streaming_json() {
    require_root("root_stdlib_non_streaming_json");
    scenario(
        "stdlib non-streaming JSON",
        ServerKind::Stdlib,
        &[],
        &runs_for("/v1/chat/completions", false),
        &JSON,
        &Tolerance::light(),
    );
}

#[test]
fn root_fastapi_selected_by_listening_port() {
    require_root("root_fastapi_selected_by_listening_port");
    // `tokentrace run --port P` must find the uvicorn process listening on P
    scenario_with(
        "fastapi SSE, agent started with --port",
        ServerKind::FastApi,
        &[],
        Selector::Port,
        &[ClientRun::sse(5, 1, "port-")],
        &SSE,
        &Tolerance::light(),
    );
}
