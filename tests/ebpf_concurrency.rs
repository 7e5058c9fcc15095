//! Root-only: 32 concurrent keep-alive SSE streams (32 client workers × 3
//! requests, each worker reusing one connection) against the real agent.
//! Every request must be reported exactly once, with its own response id and
//! chunk count (no misattribution between connections of one process, or
//! between consecutive requests of one connection).
//!
//! Run (as root; CI does):
//!   cargo test -p tokentrace --test ebpf_concurrency -- --test-threads=1 --nocapture
//!
//! Timing under this load (32 streams, the server, the 32-thread Python
//! client and the agent on 2 cores). Measured over 3 runs per server
//! (ms; see `Tolerance` in common/mod.rs for the decomposition):
//!
//!                                           fastapi p50/p95/max    stdlib p50/p95/max
//!   read wait (request_start − t_send)      3–6 / 40–135 / 136     0.1–0.2 / 4–50 / 61
//!   1st chunk: arrival − agent emit         0.1 / 0.35–0.5 / 5.3   0.1 / 0.6–1.6 / 4.8
//!   every chunk: arrival − agent emit       0.1 / 0.8–1.4 / 8.8    0.07 / 0.4–0.5 / 4.8
//!   agent emit − server's pre-write stamp   0.02 / 0.08 / 0.26     0.05 / 0.2–0.25 / 3.6
//!
//! The read wait is the first wave of 32 simultaneous requests queueing in
//! their sockets until the server reads them (one asyncio loop parses them
//! one by one; http.server is still starting handler threads): that time is
//! before the agent's request start by design, so it is bounded only loosely
//! (250 ms) and |ΔTTFT| is not asserted as a whole here. The agent-owned
//! part of the TTFT, 1st-chunk delivery (arrival − emit), keeps the light-load
//! bound of 2 ms for 90% of requests (outlier budget) and p95, with a hard
//! 10 ms per request; every chunk: hard 20 ms, p99 ≤ 8 ms (measured ≤ 3.1),
//! p50 < 1 ms; emit vs the server's stamp: ≤ 20 ms (measured ≤ 3.6).

#[path = "common/mod.rs"]
mod common;

use common::*;

fn loaded() -> Tolerance {
    Tolerance {
        ttft_abs_ms: 2.0,
        outlier_frac: 0.1,
        hard_ms: 10.0,
        read_wait_max_ms: 250.0,
        arrival_minus_emit_min_ms: -0.2,
        arrival_minus_emit_max_ms: 20.0,
        arrival_minus_emit_p50_ms: 1.0,
        arrival_minus_emit_p99_ms: 8.0,
        emit_minus_server_min_ms: -0.01,
        emit_minus_server_max_ms: 20.0,
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
    let p95 = report.first_delivery.pct(95.0);
    assert!(
        p95 < 2.0,
        "{title}: p95 of 1st chunk arrival - agent emit = {p95:.3} ms, expected < 2 ms"
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
