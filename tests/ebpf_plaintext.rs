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
//! Timing checks (see `Tolerance` in tests/kit/src/lib.rs): every agent timestamp
//! must lie in its physical bracket (client send ≤ request start ≤ server
//! handler start; server pre-write stamp ≤ chunk emit ≤ client arrival), for
//! every request and chunk; per request the agent's TTFT must agree within
//! 2 ms with the client's or the server's own measure; per chunk the emit
//! within 5 ms of the client's arrival or the server's stamp; medians < 1 ms.

use tokentrace_testkit as common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::*;

fn sse_runs(sse_impl: Option<&'static str>) -> Vec<ClientRun> {
    let mut seq = ClientRun::sse(20, 1, "seq-");
    let mut conc = ClientRun::sse(8, 4, "conc-");
    seq.sse_impl = sse_impl;
    conc.sse_impl = sse_impl;
    vec![seq, conc]
}

fn runs_for(path: &'static str, stream: bool) -> Vec<ClientRun> {
    let mut seq = ClientRun::sse(20, 1, "seq-");
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

/// Each chunk as one sendmsg() of 12 iovecs (size line, the event in ten
/// pieces, CRLF): more iovecs than the probes copy inline (4), so the walk
/// takes its first iovecs from one read of the process's array and the rest
/// one by one, and every event must still be counted and timed whole.
#[test]
fn root_stdlib_sse_one_sendmsg_of_many_iovecs() {
    require_root("root_stdlib_sse_one_sendmsg_of_many_iovecs");
    scenario(
        "stdlib http.server SSE, one sendmsg of 12 iovecs per chunk",
        ServerKind::Stdlib,
        &["--iovecs", "12"],
        &sse_runs(None),
        &SSE,
        &Tolerance::light(),
    );
}

/// The same 12 iovecs per chunk in one writev(): where the send-start hook
/// runs (6.16+), the socket hooks read the iovec array from the kernel's
/// copy of it instead of the process's, the first 4 inline and the rest one
/// by one; every event must still be counted and timed whole.
#[test]
fn root_stdlib_sse_one_writev_of_many_iovecs() {
    require_root("root_stdlib_sse_one_writev_of_many_iovecs");
    scenario(
        "stdlib http.server SSE, one writev of 12 iovecs per chunk",
        ServerKind::Stdlib,
        &["--iovecs", "12", "--writev"],
        &sse_runs(None),
        &SSE,
        &Tolerance::light(),
    );
}

/// node's writev of a chunk (size digits and event side by side in one
/// buffer, one static CRLF twice): the probes read the two stretches of
/// memory once each and the agent puts the 4 pieces back in order.
#[test]
fn root_stdlib_sse_node_iovecs_read_once() {
    require_root("root_stdlib_sse_node_iovecs_read_once");
    scenario(
        "stdlib http.server SSE, node's 4 iovecs per writev",
        ServerKind::Stdlib,
        &["--iovecs", "4", "--writev", "--shared-buffer"],
        &sse_runs(None),
        &SSE,
        &Tolerance::light(),
    );
}

/// The same layout in 12 iovecs of a sendmsg (the iovec array read from
/// the process): the 4 inline pieces gathered, the 8 after them in order.
#[test]
fn root_stdlib_sse_shared_buffer_sendmsg_of_many_iovecs() {
    require_root("root_stdlib_sse_shared_buffer_sendmsg_of_many_iovecs");
    scenario(
        "stdlib http.server SSE, 12 iovecs over one buffer per sendmsg",
        ServerKind::Stdlib,
        &["--iovecs", "12", "--shared-buffer"],
        &sse_runs(None),
        &SSE,
        &Tolerance::light(),
    );
}

/// The syscall hooks' exit program gathers too (its writev's iovec array
/// from the process).
#[test]
fn root_stdlib_sse_shared_buffer_through_the_syscall_hooks() {
    require_root("root_stdlib_sse_shared_buffer_through_the_syscall_hooks");
    scenario_with(
        "stdlib http.server SSE, node's iovecs, --data-hooks syscall",
        ServerKind::Stdlib,
        &["--iovecs", "6", "--writev", "--shared-buffer"],
        Selector::PidWith(&["--data-hooks", "syscall"]),
        &sse_runs(None),
        &SSE,
        &Tolerance::light(),
    );
}

/// The syscall hooks, the data path of kernels without the socket hooks'
/// tracepoints (before 6.3), chosen here by hand: the same brackets hold.
#[test]
fn root_stdlib_sse_through_the_syscall_hooks() {
    require_root("root_stdlib_sse_through_the_syscall_hooks");
    stdlib_sse_with(&["--data-hooks", "syscall"]);
}

/// The socket hooks without the send-start hook, the data path of kernels
/// 6.3 to 6.15 (no `tcp_sendmsg_locked`), chosen here by hand: each send is
/// dated at its return, after its bytes were queued (on loopback, after the
/// client's socket got them), and the same brackets hold.
#[test]
fn root_stdlib_sse_with_sends_dated_at_their_return() {
    require_root("root_stdlib_sse_with_sends_dated_at_their_return");
    stdlib_sse_with(&["--data-hooks", "socket_at_return"]);
}

/// The stdlib SSE scenario (3 writes per chunk) with the agent's `flags`,
/// judged by the same brackets as the default data path.
fn stdlib_sse_with(flags: &'static [&'static str]) {
    scenario_with(
        &format!(
            "stdlib http.server SSE, 3 writes per chunk, {}",
            flags.join(" ")
        ),
        ServerKind::Stdlib,
        &[],
        Selector::PidWith(flags),
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

#[test]
fn root_agent_exits_by_itself_after_n_requests() {
    require_root("root_agent_exits_by_itself_after_n_requests");
    // CLI contract: `--requests N` prints N timelines and exits 0 (the demo
    // relies on it)
    let server = start_server(ServerKind::Stdlib, &[]);
    let mut agent = start_agent(&[
        "--pid".to_string(),
        server.pid().to_string(),
        "--requests".into(),
        "3".into(),
    ]);
    let mut run = ClientRun::sse(5, 1, "n-");
    run.tokens = 4;
    let recs = run_client(server.port, &run);
    let st = agent.proc.wait_timeout(Duration::from_secs(10));
    if st.is_none() {
        eprintln!(
            "[test] tokentrace --requests 3 still running 10 s after the client finished; {} JSON lines so far. Threads:\n    {}",
            agent.values().len(),
            threads_report(agent.proc.pid())
        );
    }
    let _ = agent.stop();
    let st = st.unwrap_or_else(|| {
        panic!("tokentrace run --requests 3 still running 10 s after 5 requests finished")
    });
    assert!(
        st.success(),
        "tokentrace run --requests 3 exited with {st}; stderr:\n{}",
        agent.proc.stderr.tail(20)
    );
    let got: Vec<String> = agent
        .values()
        .iter()
        .filter_map(|v| str_field(v, "path"))
        .collect();
    let first3: BTreeSet<String> = recs.iter().take(3).map(|c| c.path.clone()).collect();
    assert_eq!(
        got.len(),
        3,
        "expected exactly 3 timelines before exiting, got {got:?}"
    );
    assert_eq!(
        got.iter().cloned().collect::<BTreeSet<_>>(),
        first3,
        "the 3 timelines should be the first 3 requests"
    );
}
