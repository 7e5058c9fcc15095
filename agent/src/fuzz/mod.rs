//! Property-based fuzzing of everything that parses kernel- or
//! peer-controlled bytes: the raw ring buffer records (`ingest::decode`),
//! and through the stitcher the HTTP/1.1 head parser, the chunked decoder,
//! the SSE scanner, the JSON field extractor, and the HTTP/2 frame reader,
//! HPACK decoder and gRPC message walker. Stable Rust: proptest.
//!
//! Inputs are realistic captures, then mutated: the synthetic vLLM/uvicorn
//! traffic as the probes would record it (`pipeline::synthetic`), and
//! response byte streams of the servers the design lists (OpenAI-style SSE
//! over chunked encoding, llama.cpp's field order, TGI, plain JSON,
//! chunked text), split into arbitrary writes. Properties: nothing panics;
//! a connection fed endlessly never holds more than its buffer limit.
//!
//! `cargo test` runs a short bounded pass (a fixed number of cases per
//! target); `cargo xtask fuzz --minutes N` sets `TOKENTRACE_FUZZ_SECONDS`
//! and each target runs until its share of the time is spent, printing
//! its executions.

mod alloc_meter;
pub(crate) mod seeds;
mod targets;

use std::time::{Duration, Instant};

use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

/// How long each target runs when `TOKENTRACE_FUZZ_SECONDS` is set.
fn budget() -> Option<Duration> {
    std::env::var("TOKENTRACE_FUZZ_SECONDS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .map(Duration::from_secs)
}

/// Runs `check` on values of `strategy`: `cases` of them in a normal test
/// run, or as many as fit in the fuzz budget. A failing case is shrunk and
/// reported by proptest (paste it into a regression test in `targets`).
pub(crate) fn fuzz<S: Strategy>(name: &str, cases: u32, strategy: S, check: impl Fn(S::Value))
where
    S::Value: std::fmt::Debug,
{
    let config = Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    };
    match budget() {
        None => {
            // The test suite's short run is the same every time: a suite
            // must not go red by drawing a rare input (exploring is the
            // budgeted run's job, below, with a new seed each time).
            let rng = TestRng::deterministic_rng(config.rng_algorithm);
            let mut runner = TestRunner::new_with_rng(config, rng);
            let result = runner.run(&strategy, |v| {
                check(v);
                Ok(())
            });
            if let Err(err) = result {
                panic!("fuzz target {name}: {err}");
            }
        }
        Some(budget) => {
            // A new seed every budgeted run (printed with a failure).
            let seed = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            let mut seed_bytes = [0u8; 32];
            seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
            let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes);
            let mut runner = TestRunner::new_with_rng(config, rng);
            let start = Instant::now();
            let mut executions = 0u64;
            while start.elapsed() < budget {
                let tree = match strategy.new_tree(&mut runner) {
                    Ok(tree) => tree,
                    Err(err) => panic!("fuzz target {name}: generating a case: {err}"),
                };
                let value = tree.current();
                let shown = format!("{value:?}");
                let outcome =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(value)));
                if outcome.is_err() {
                    panic!(
                        "fuzz target {name}: case {executions} (seed {seed}) panicked; input: {}",
                        shown.chars().take(4000).collect::<String>()
                    );
                }
                executions += 1;
            }
            eprintln!(
                "fuzz {name}: {executions} executions in {:.1} s",
                start.elapsed().as_secs_f64()
            );
        }
    }
}
