//! Root-only: 32 concurrent keep-alive SSE streams (32 client workers × 3
//! requests, each worker reusing one connection) against the real agent.
//! Every request must be reported exactly once, with its own response id and
//! chunk count (no misattribution between connections of one process, or
//! between consecutive requests of one connection).
//!
//! Run (as root; CI does):
//!   cargo test -p tokentrace --test ebpf_concurrency -- --test-threads=1 --nocapture
//!
//! Timing: the bracket checks of `Tolerance` (tests/kit/src/lib.rs) hold for every
//! request and chunk regardless of load. What widens under 32 streams on 2
//! cores is how far both outside views are from the agent's request start
//! for the first wave of 32 simultaneous requests. Measured (load average
//! 2–5, other suites sharing the box), ms, p50 / p95 / max:
//!
//!                                        fastapi (uvicorn)     stdlib http.server
//!   request_start − client t_send         2.2 / 77 / 81         0.4 / 18 / 21
//!   server handler start − request_start  1.4 / 71 / 72         0.1 / 2.1 / 2.8
//!   min(|client ΔTTFT|, |server ΔTTFT|)   1.4 / 6.2 / 6.6       0.2 / 1.2 / 1.7
//!   chunk: client arrival − agent emit    0.2 / 0.9 / 3.5       0.1 / 0.9 / 4.0
//!   chunk: agent emit − server stamp      0.02 / 0.08 / 0.3     0.05 / 0.3 / 2.2
//!
//! The requests wait in their sockets until the server reads them (before
//! the agent's request start by design), and uvicorn's one asyncio loop
//! then runs the handler of a burst request only after the other requests'
//! reads, so neither view is close to the read for the first wave (seen: a
//! first-wave request read 103 ms after it was sent, its handler started
//! 29 ms after the read, on a loaded box). So the first wave gets the
//! bracket checks only (`first_wave_exempt`, its distribution is printed);
//! waves 2 and 3 (sent as each worker's previous stream ends) must agree
//! within 15 ms (75 % of them) and 5 ms at the median (light load: 2 / 1 ms),
//! 97 % of the chunks within 20 ms; the chunk medians keep the light-load bound
//! (< 1 ms). The table's rows 1–3 include the first wave. Why 5 ms: with 32
//! streams uvicorn's loop spends about half a core on token events, so even
//! for waves 2–3 a request waits for the loop both before its read (client
//! view) and before its handler (server view): measured p50 of the better
//! of the two 1.6–3.1 ms for fastapi at load average 5 (http.server,
//! one thread per connection: 0.13–0.36 ms).

use tokentrace_testkit as common;

use common::*;

fn loaded() -> Tolerance {
    Tolerance {
        slack_ms: 0.01,
        ttft_abs_ms: 15.0,
        agree_fraction: 0.75,
        ttft_p50_ms: 5.0,
        chunk_close_ms: 20.0,
        chunk_agree_fraction: 0.97,
        arrival_minus_emit_p50_ms: 1.0,
        emit_minus_server_p50_ms: 1.0,
        first_wave_exempt: true,
    }
}

const SSE: Expect = Expect {
    stream: true,
    status: 200,
    has_response_id: true,
};

fn run_32(title: &str, kind: ServerKind) {
    let mut run = ClientRun::sse(96, 32, "c32-");
    run.tokens = 12;
    run.token_delay_ms = 20.0;
    run.ttft_ms = 40.0;
    let report = scenario(title, kind, &[], &[run], &SSE, &loaded());
    assert_eq!(
        report.matched, 96,
        "{title}: every request matched exactly once"
    );
}

#[test]
fn root_fastapi_32_concurrent_keepalive_streams() {
    require_root("root_fastapi_32_concurrent_keepalive_streams");
    run_32(
        "fastapi 32 concurrent keep-alive SSE streams",
        ServerKind::FastApi,
    );
}

#[test]
fn root_stdlib_32_concurrent_keepalive_streams() {
    require_root("root_stdlib_32_concurrent_keepalive_streams");
    run_32(
        "stdlib http.server 32 concurrent keep-alive SSE streams",
        ServerKind::Stdlib,
    );
}
