//! What `tokentrace run` prints when the user got something wrong: the
//! cause once (a context does not repeat its source's text, which the
//! error chain prints anyway), and nothing started before the check (no
//! control endpoint address, no "ready"). Runs the real binary; `run` checks
//! for root before anything else, so these need root like the eBPF tests.

use tokentrace_testkit as common;

use std::process::{Command, Output};

use common::{agent_bin, require_root};

fn run(args: &[&str], env: &[(&str, &str)]) -> (Output, String) {
    let mut command = Command::new(agent_bin());
    command.arg("run").args(args).env_remove("RUST_LOG");
    for (k, v) in env {
        command.env(k, v);
    }
    let output = command.output().expect("running tokentrace");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    (output, stderr)
}

/// Failed with each of `causes` printed exactly once and nothing started.
fn assert_refused(args: &[&str], env: &[(&str, &str)], causes: &[&str]) {
    let (output, stderr) = run(args, env);
    assert!(
        !output.status.success(),
        "{args:?} must fail, got {:?}; stderr:\n{stderr}",
        output.status
    );
    for cause in causes {
        assert_eq!(
            stderr.matches(cause).count(),
            1,
            "{args:?}: {cause:?} must be printed once; stderr:\n{stderr}"
        );
    }
    for started in ["control endpoint at", "tokentrace: ready", "tracing pid"] {
        assert!(
            !stderr.contains(started),
            "{args:?}: {started:?} printed before the input was checked; stderr:\n{stderr}"
        );
    }
}

#[test]
fn root_a_missing_config_file_is_named_with_its_cause_once() {
    require_root("root_a_missing_config_file_is_named_with_its_cause_once");
    assert_refused(
        &["--config", "/nonexistent/tokentrace.yaml"],
        &[],
        &["No such file or directory"],
    );
}

#[test]
fn root_a_bad_config_value_is_named_by_its_key_once() {
    require_root("root_a_bad_config_value_is_named_by_its_key_once");
    let dir = std::env::temp_dir().join(format!("tokentrace-cli-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("bad.yaml");
    std::fs::write(&path, "capture:\n  bytes: lots\n").expect("write config");
    let path = path.to_str().expect("utf-8 path");
    assert_refused(
        &["--config", path],
        &[],
        &["capture.bytes", "invalid type: string \"lots\""],
    );
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

#[test]
fn root_a_pid_that_does_not_exist_is_refused_before_anything_starts() {
    require_root("root_a_pid_that_does_not_exist_is_refused_before_anything_starts");
    // Pids are below pid_max: this one cannot exist.
    let pid_max = std::fs::read_to_string("/proc/sys/kernel/pid_max").expect("pid_max");
    let pid = pid_max.trim();
    assert_refused(
        &["--pid", pid],
        &[],
        &[&format!("--pid {pid}: no such process")],
    );
}

#[test]
fn root_a_bad_otlp_variable_is_named_once() {
    require_root("root_a_bad_otlp_variable_is_named_once");
    assert_refused(
        &["--otlp-endpoint", "http://127.0.0.1:4317"],
        &[("OTEL_EXPORTER_OTLP_PROTOCOL", "bogus")],
        &["unknown OTLP protocol \"bogus\""],
    );
}
