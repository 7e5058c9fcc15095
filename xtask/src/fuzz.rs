//! `cargo xtask fuzz --minutes N`: the property-based fuzz targets
//! (agent/src/fuzz/) for N minutes in all, shared evenly, each printing its
//! executions. `cargo test` runs the same targets for a fixed, small
//! number of cases.

use anyhow::{bail, Context, Result};

use crate::util;

/// The targets, by test name (one share of the time each).
const TARGETS: &[&str] = &[
    "fuzz::targets::fuzz_raw_records_decode_and_stitch",
    "fuzz::targets::fuzz_decode_arbitrary_bytes",
    "fuzz::targets::fuzz_http_chunked_sse_json_streams",
    "fuzz::targets::fuzz_http2_frames_hpack_grpc_streams",
    "fuzz::targets::fuzz_one_connection_fed_endlessly_stays_within_its_buffer_limit",
];

fn minutes(rest: &[String]) -> Result<f64> {
    match rest {
        [] => Ok(1.0),
        [flag, n] if flag == "--minutes" => {
            let m: f64 = n
                .parse()
                .with_context(|| format!("--minutes {n:?}: not a number"))?;
            if !m.is_finite() || m <= 0.0 {
                bail!("--minutes must be above 0, got {m}");
            }
            Ok(m)
        }
        other => bail!("usage: cargo xtask fuzz [--minutes N] (got {other:?})"),
    }
}

pub fn run(rest: &[String]) -> Result<()> {
    let minutes = minutes(rest)?;
    let per_target = ((minutes * 60.0) / TARGETS.len() as f64).ceil().max(1.0) as u64;
    eprintln!(
        "xtask: fuzzing {} targets for {per_target} s each ({minutes} min)",
        TARGETS.len()
    );
    // Read by the fuzz harness in the test binary (agent/src/fuzz/mod.rs).
    std::env::set_var("TOKENTRACE_FUZZ_SECONDS", per_target.to_string());
    for target in TARGETS {
        util::cargo(&[
            "test",
            "-p",
            "tokentrace",
            "--lib",
            "--",
            "--exact",
            target,
            "--nocapture",
            "--test-threads=1",
        ])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minutes_default_to_one_and_are_checked() {
        assert_eq!(minutes(&[]).ok(), Some(1.0));
        let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(minutes(&args(&["--minutes", "5"])).ok(), Some(5.0));
        assert!(minutes(&args(&["--minutes", "0"])).is_err());
        assert!(minutes(&args(&["--minutes", "x"])).is_err());
        assert!(minutes(&args(&["5"])).is_err());
    }
}
