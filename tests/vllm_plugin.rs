//! The tokentrace-vllm plugin's own tests (instrument/vllm/tests, Python
//! unittest against hand-built vLLM records): they need neither vLLM nor
//! root, so they run everywhere `cargo test` does.

use std::path::PathBuf;
use std::process::Command;

#[test]
fn the_plugins_step_hook_fires_what_vllm_records_say() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .expect("repository root");
    let python = std::env::var("TOKENTRACE_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(&python)
        .args(["-m", "unittest", "discover", "-v", "-s"])
        .arg(root.join("instrument/vllm/tests"))
        .current_dir(&root)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python}: {e}"));
    let log = String::from_utf8_lossy(&out.stderr);
    eprintln!("{log}");
    assert!(
        out.status.success(),
        "the plugin's unittests failed:\n{log}"
    );
    assert!(
        log.contains("Ran ") && !log.contains("Ran 0 tests"),
        "no tests ran:\n{log}"
    );
}
