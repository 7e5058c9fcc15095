//! Real vLLM for the tests and the bench: its CPU build in a venv of its
//! own, installed once per machine (see vllm_env.py for why it takes more
//! than `pip install`), and the tokentrace-vllm plugin built from
//! instrument/vllm.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::{native, util};

/// The installer; run with the system python3.
const VLLM_ENV_SCRIPT: &str = include_str!("vllm_env.py");

/// Where the venv lives: the tests' and the bench's (tests/kit), outside
/// the checkout so every worktree and rerun shares one ~6 GB install.
pub fn venv() -> PathBuf {
    tokentrace_testkit::vllm::venv_dir()
}

/// Installs vLLM into [`venv`] unless a finished install is there.
pub fn ensure_env() -> Result<PathBuf> {
    let venv = venv();
    let dir = venv.to_str().context("vLLM venv path is not UTF-8")?;
    if let Some(parent) = venv.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    let started = Instant::now();
    util::status("python3", &["-c", VLLM_ENV_SCRIPT, dir]).context("installing vLLM")?;
    let took = started.elapsed().as_secs_f64();
    if took > 5.0 {
        eprintln!("xtask: vLLM installed into {dir} in {took:.0} s");
    }
    Ok(venv)
}

/// The plugin package dir, with libllm_usdt.so copied in (from a fresh
/// `cargo xtask native`) so that the package ships it.
pub fn staged_plugin() -> Result<PathBuf> {
    native::build()?;
    let pkg = util::root().join("instrument/vllm");
    let lib = util::target_dir().join("native/libllm_usdt.so");
    let dest = pkg.join("tokentrace_vllm/libllm_usdt.so");
    std::fs::copy(&lib, &dest)
        .with_context(|| format!("copying {} to {}", lib.display(), dest.display()))?;
    Ok(pkg)
}

/// `cargo xtask vllm-plugin [--python PY] [--wheel-dir DIR]`: installs the
/// plugin into PY's environment (default: the test venv), or builds a
/// wheel into DIR.
pub fn plugin(rest: &[String]) -> Result<()> {
    let mut python: Option<PathBuf> = None;
    let mut wheel_dir: Option<PathBuf> = None;
    let mut args = rest.iter();
    while let Some(arg) = args.next() {
        let value = || -> Result<PathBuf> {
            Ok(PathBuf::from(
                args.clone()
                    .next()
                    .with_context(|| format!("{arg} needs a value"))?,
            ))
        };
        match arg.as_str() {
            "--python" => python = Some(value()?),
            "--wheel-dir" => wheel_dir = Some(value()?),
            other => {
                bail!("vllm-plugin: unknown argument {other:?} (--python PY, --wheel-dir DIR)")
            }
        }
        args.next();
    }
    let pkg = staged_plugin()?;
    let pkg = pkg.to_str().context("repository path is not UTF-8")?;
    let python = python.unwrap_or_else(|| venv().join("bin/python"));
    let py = python.to_str().context("python path is not UTF-8")?;
    match wheel_dir {
        Some(dir) => {
            let dir = dir.to_str().context("wheel dir is not UTF-8")?;
            util::status(
                py,
                &["-m", "pip", "wheel", "-q", "--no-deps", "-w", dir, pkg],
            )?;
            eprintln!("xtask: tokentrace-vllm wheel in {dir}");
        }
        None => {
            util::status(
                py,
                &[
                    "-m",
                    "pip",
                    "install",
                    "-q",
                    "--no-deps",
                    "--force-reinstall",
                    pkg,
                ],
            )?;
            eprintln!("xtask: tokentrace-vllm installed for {py}");
        }
    }
    Ok(())
}

/// What tests/ebpf_vllm.rs needs: the venv, and libllm_usdt.so in the
/// plugin dir (the test builds the plugin from there itself, so it always
/// runs the checked-out code).
pub fn for_tests() -> Result<()> {
    ensure_env()?;
    staged_plugin()?;
    Ok(())
}
