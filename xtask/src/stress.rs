//! `cargo xtask test --stress`: the suite while `stress-ng --cpu 1` keeps
//! one core busy for its whole length.
//!
//! The project's tests must hold on a loaded 2-core machine (a CI runner
//! shares its cores; a developer builds while the suite runs): every timing
//! bound is against a reference load cannot move, or derived from a
//! distribution measured under load. This task is how that is checked.

use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

use crate::util::Guard;

/// Starts one CPU hog (`stress-ng --cpu 1`, no time limit) and returns it
/// guarded: it is killed when the guard drops, whatever the suite did.
pub fn start_cpu_hog() -> Result<Guard> {
    let child = Command::new("stress-ng")
        .args(["--cpu", "1", "--quiet"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting stress-ng (apt: stress-ng; `cargo xtask deps` installs it)")?;
    let mut guard = Guard(child);
    // A stress-ng that exits at once (bad option, no permission) would
    // leave the suite running unloaded and passing for the wrong reason.
    std::thread::sleep(std::time::Duration::from_millis(500));
    if let Some(status) = guard.0.try_wait().context("waiting for stress-ng")? {
        bail!("stress-ng exited at once ({status}): the suite would not run under load");
    }
    eprintln!(
        "xtask: stress-ng --cpu 1 (pid {}) keeps one core busy during the suite",
        guard.0.id()
    );
    Ok(guard)
}

/// Splits `--stress` off the arguments given to `cargo xtask test`.
pub fn take_flag(rest: &[String]) -> (bool, Vec<String>) {
    let stress = rest.iter().any(|a| a == "--stress");
    let others = rest.iter().filter(|a| *a != "--stress").cloned().collect();
    (stress, others)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_is_taken_out_and_everything_else_passed_on() {
        let args: Vec<String> = ["--stress", "--nocapture", "otel"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let (stress, rest) = take_flag(&args);
        assert!(stress);
        assert_eq!(rest, vec!["--nocapture".to_string(), "otel".to_string()]);
        let (stress, rest) = take_flag(&rest);
        assert!(!stress);
        assert_eq!(rest.len(), 2);
    }
}
