//! Root-only: real vLLM (the CPU build, API server + EngineCore + Worker)
//! serving a tiny model made here, traced by the agent attached after vLLM
//! started (its EngineCore and Worker were forked before).
//!
//! With the tokentrace-vllm plugin (instrument/vllm), one server with
//! `--max-num-seqs 2` and a KV cache of 10 blocks of 32 tokens (9 usable:
//! two 200-token requests need 14) takes three concurrent requests: two run
//! together and share every step, the third is queued behind
//! `--max-num-seqs`, and the KV cache runs out, so vLLM preempts. The agent
//! must agree with vLLM's own numbers, which come from the same scheduler
//! stamps (`/metrics`: the sums of its per-request `queued_time` and
//! `prefill_time`, its preemption counter):
//!
//! - Σ `queue_ms` and Σ `prefill_ms` within 1 ms of vLLM's sums (each is
//!   exact to microseconds; the two requests that were not queued add
//!   ~0.05 ms, so this bounds the queued one's own figure);
//! - Σ `preemptions` = vLLM's count (> 0), and the preemption time shows as
//!   the `preempted_ms` cause of the late chunks;
//! - `batch_steps` = the tokens of each request (one step per token),
//!   `batch_fan_in` 2 for the two that ran together, never more than
//!   `--max-num-seqs`;
//! - chunk counts exactly the client's SSE events.
//!
//! Without the plugin, a second server: chunk counts still exact, and no
//! engine fields. Fails (never skips) without root or without vLLM
//! (`cargo xtask vllm-env`; `cargo xtask test` installs it). Run as root:
//!   cargo test -p tokentrace --test ebpf_vllm -- --test-threads=1 --nocapture

use tokentrace_testkit as common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::Value;

use common::vllm::{plugin_site, tiny_model, venv, Scratch, Vllm};
use common::{require_root, start_agent, Agent};

const CHAT: &str = "/v1/chat/completions";
const MAX_TOKENS: u32 = 200;

fn f64_of(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number: {v}"))
}

fn u64_of(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} is not an integer: {v}"))
}

/// Waits until vLLM's finished-request count reaches `count` (it updates
/// its stats as the last chunk goes out, racing the client's return).
fn wait_for_finished(server: &Vllm, count: f64) {
    let t0 = Instant::now();
    while server.metric("vllm:request_queue_time_seconds_count") < count {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "vLLM never counted {count} finished requests"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The agent's line of each client request, checked for an exact chunk
/// count; in the order of `ids`.
fn lines_of(agent: &mut Agent, client: &[Value], ids: &[&str]) -> Vec<Value> {
    let wanted: BTreeSet<String> = ids.iter().map(|id| format!("chatcmpl-{id}")).collect();
    let missing = agent.wait_for_values("response_id", &wanted, Duration::from_secs(60));
    assert!(missing.is_empty(), "no agent line for {missing:?}");
    ids.iter()
        .map(|id| {
            let rid = format!("chatcmpl-{id}");
            let rec = client
                .iter()
                .find(|c| c["id"].as_str() == Some(rid.as_str()))
                .unwrap_or_else(|| panic!("no client record with id {rid}: {client:?}"));
            assert_eq!(rec["status"], 200, "{rec}");
            assert_eq!(rec["done"], true, "{rec}");
            assert_eq!(
                rec["usage"]["completion_tokens"], MAX_TOKENS,
                "the tiny model never stops early: {rec}"
            );
            let values = agent.values();
            let lines: Vec<&Value> = values
                .iter()
                .filter(|v| v["response_id"].as_str() == Some(rid.as_str()))
                .collect();
            let [line] = lines.as_slice() else {
                panic!("expected one agent line for {rid}, got {lines:?}")
            };
            assert_eq!(line["path"], CHAT, "{line}");
            assert_eq!(
                line["chunks"], rec["events"],
                "{rid}: agent chunks vs the client's SSE events ({rec})"
            );
            assert_eq!(line["chunks_exact"], true, "{line}");
            (*line).clone()
        })
        .collect()
}

#[test]
fn root_vllm_with_the_plugin_queue_prefill_preemption_and_batching_match_vllm() {
    require_root("root_vllm_with_the_plugin_queue_prefill_preemption_and_batching_match_vllm");
    let venv = venv();
    let scratch = Scratch::new("plugin");
    let model = tiny_model(&venv, &scratch.0).unwrap_or_else(|e| panic!("{e:#}"));
    let site = plugin_site(&venv, &scratch.0).unwrap_or_else(|e| panic!("{e:#}"));
    let server = Vllm::start(
        &venv,
        &model,
        &scratch.0,
        Some(&site),
        &[
            "--max-model-len",
            "256",
            "--max-num-seqs",
            "2",
            "--block-size",
            "32",
            "--num-gpu-blocks-override",
            "10",
        ],
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    // A 1 ms threshold: every gap a preemption lies in gets its breakdown.
    let config = scratch.0.join("agent.yaml");
    std::fs::write(&config, "explain:\n  stall_threshold: 1ms\n").expect("write the agent config");
    let mut args = Agent::for_pids(&[server.pid()]);
    args.extend(["--config".into(), config.display().to_string()]);
    let mut agent = start_agent(&args);

    let before = |name: &str| server.metric(name);
    let (queue0, prefill0, count0, preempt0) = (
        before("vllm:request_queue_time_seconds_sum"),
        before("vllm:request_prefill_time_seconds_sum"),
        before("vllm:request_queue_time_seconds_count"),
        before("vllm:num_preemptions_total"),
    );
    let ids = ["vq-1", "vq-2", "vq-3"];
    let requests: Vec<(&str, u32)> = ids.iter().map(|id| (*id, MAX_TOKENS)).collect();
    let client = server.stream(&requests);
    wait_for_finished(&server, count0 + 3.0);
    let vllm_queue_ms = (server.metric("vllm:request_queue_time_seconds_sum") - queue0) * 1e3;
    let vllm_prefill_ms = (server.metric("vllm:request_prefill_time_seconds_sum") - prefill0) * 1e3;
    let vllm_preemptions = server.metric("vllm:num_preemptions_total") - preempt0;
    assert_eq!(
        server.metric("vllm:request_queue_time_seconds_count") - count0,
        3.0,
        "only this test's requests ran"
    );

    let lines = lines_of(&mut agent, &client, &ids);
    agent.stop();
    let armed = "tokentrace-vllm: llm:* probes armed in the engine";
    assert!(
        server.proc.stderr.lines().iter().any(|l| l.contains(armed)),
        "vLLM's log has no {armed:?}:\n{}",
        server.proc.stderr.tail(40)
    );
    for l in &lines {
        eprintln!(
            "[test] {}: queue {} prefill {} fan-in {} steps {} preemptions {} ({} ms) chunks {}",
            l["response_id"],
            l["queue_ms"],
            l["prefill_ms"],
            l["batch_fan_in"],
            l["batch_steps"],
            l["preemptions"],
            l["preempted_ms"],
            l["chunks"]
        );
    }
    eprintln!(
        "[test] vLLM: queue Σ {vllm_queue_ms:.3} ms, prefill Σ {vllm_prefill_ms:.3} ms, {vllm_preemptions} preemptions"
    );

    // Queue and prefill: vLLM's own stamps, so within 1 ms of its sums.
    let queue: Vec<f64> = lines.iter().map(|l| f64_of(l, "queue_ms")).collect();
    let agent_queue: f64 = queue.iter().sum();
    assert!(
        (agent_queue - vllm_queue_ms).abs() < 1.0,
        "Σ queue_ms {agent_queue:.3} vs vLLM's {vllm_queue_ms:.3} ({queue:?})"
    );
    // One request waited for a whole 200-token request to finish.
    let longest = queue.iter().copied().fold(0.0, f64::max);
    assert!(
        longest > 50.0,
        "no request was queued behind --max-num-seqs: {queue:?}"
    );
    let agent_prefill: f64 = lines.iter().map(|l| f64_of(l, "prefill_ms")).sum();
    assert!(
        (agent_prefill - vllm_prefill_ms).abs() < 1.0,
        "Σ prefill_ms {agent_prefill:.3} vs vLLM's {vllm_prefill_ms:.3}"
    );

    // Preemption: vLLM's count, and the time as a cause of late chunks.
    assert!(
        vllm_preemptions > 0.0,
        "the small KV cache forced no preemption"
    );
    let agent_preemptions: u64 = lines.iter().map(|l| u64_of(l, "preemptions")).sum();
    assert_eq!(agent_preemptions as f64, vllm_preemptions, "{lines:?}");
    for l in &lines {
        let preempted = f64_of(l, "preempted_ms");
        let stalls = l["stalls"].as_array().expect("stalls");
        let in_stalls: f64 = stalls.iter().map(|s| f64_of(s, "preempted_ms")).sum();
        for s in stalls {
            assert!(
                f64_of(s, "preempted_ms") <= f64_of(s, "gap_ms") + 0.01,
                "a cause larger than its gap: {s}"
            );
        }
        // Every chunk gap of 1 ms or more is broken down and a preempted
        // request sends nothing while it waits: its stalls hold (nearly) all
        // of the preemption, never more.
        assert!(
            in_stalls <= preempted + 0.01 && in_stalls >= preempted * 0.8 - 2.0,
            "{}: preempted {preempted:.3} ms, in stalls {in_stalls:.3} ms",
            l["response_id"]
        );
        if u64_of(l, "preemptions") == 0 {
            assert_eq!(preempted, 0.0, "{l}");
        } else {
            assert!(preempted > 0.0, "{l}");
        }
    }

    // Batching: one step per token; the two that ran together shared steps.
    let fan_in: Vec<u64> = lines.iter().map(|l| u64_of(l, "batch_fan_in")).collect();
    for l in &lines {
        assert_eq!(u64_of(l, "batch_steps"), u64::from(MAX_TOKENS), "{l}");
    }
    assert!(
        fan_in.iter().all(|&n| n <= 2),
        "more than --max-num-seqs: {fan_in:?}"
    );
    assert!(
        fan_in.iter().filter(|&&n| n == 2).count() >= 2,
        "two requests ran together: {fan_in:?}"
    );

    // Late chunks split between engine and frontend at a token mark.
    let mut split = 0;
    for s in lines
        .iter()
        .flat_map(|l| l["stalls"].as_array().cloned().unwrap_or_default())
    {
        if let (Some(engine), Some(frontend)) = (s["engine_ms"].as_f64(), s["frontend_ms"].as_f64())
        {
            assert!(
                (engine + frontend - f64_of(&s, "gap_ms")).abs() < 0.01,
                "engine + frontend is the gap: {s}"
            );
            split += 1;
        }
    }
    assert!(split > 0, "no late chunk was split at an llm:token mark");
    drop(server);
}

#[test]
fn root_vllm_without_the_plugin_chunks_are_exact_and_no_engine_fields() {
    require_root("root_vllm_without_the_plugin_chunks_are_exact_and_no_engine_fields");
    let venv = venv();
    let scratch = Scratch::new("plain");
    let model = tiny_model(&venv, &scratch.0).unwrap_or_else(|e| panic!("{e:#}"));
    let server = Vllm::start(
        &venv,
        &model,
        &scratch.0,
        None,
        &["--max-model-len", "512", "--max-num-seqs", "8"],
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    let mut agent = start_agent(&Agent::for_pids(&[server.pid()]));
    let ids = ["vp-1", "vp-2", "vp-3", "vp-4"];
    let requests: Vec<(&str, u32)> = ids.iter().map(|id| (*id, MAX_TOKENS)).collect();
    let client = server.stream(&requests);
    let lines = lines_of(&mut agent, &client, &ids);
    agent.stop();
    for l in &lines {
        for key in ["queue_ms", "prefill_ms", "batch_fan_in", "preemptions"] {
            assert!(l[key].is_null(), "{key} without the plugin: {l}");
        }
    }
    drop(server);
}
