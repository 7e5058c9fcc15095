//! Developer tasks: `cargo xtask <task>`.
//!
//! - `deps`    install what building and testing need (apt, pip), if missing
//! - `demo`    the main job on a bare machine: a bundled example streaming
//!   server, traffic, and the agent tracing it
//! - `native`  the C artifacts (USDT library, stand-in CUDA libraries,
//!   launch loop) into target/native/, and a check of the stand-in
//! - `test`    deps and native, then the whole test suite (unit + root eBPF
//!   integration); `--stress` runs it while `stress-ng --cpu 1` keeps one
//!   core busy
//! - `image`   the agent's container image from deploy/Dockerfile (podman,
//!   base images made locally): `localhost/tokentrace:<version>`
//! - `bench`   overhead of the agent on a ≥20k writes/s streaming server;
//!   `bench replay`: userspace cost per event on generated records
//! - `fuzz`    the property-based fuzz targets for `--minutes N` (default 1)
//! - `soak`    `--minutes N` (default 30) of steady streaming load on the
//!   agent, the OTLP collector down 60 s of every 5 min, then an agent
//!   SIGKILL and server restarts; a pass/fail report (not in CI)
//! - `gpu-check` a real CUDA program (PyTorch) under the agent: real CUDA
//!   launches and syncs must arrive (needs a GPU; CI has none)
//! - `vllm-env` install the CPU build of vLLM into its cached venv
//!   (`$TOKENTRACE_VLLM_VENV`, default /var/cache/tokentrace/vllm-venv)
//! - `vllm-plugin` install the tokentrace-vllm plugin (`--python PY`,
//!   default the venv's) or build its wheel (`--wheel-dir DIR`)
//! - `vmlinux` regenerate ebpf-probes/include/<arch>/vmlinux.h from this kernel

mod bench;
mod demo;
mod deps;
mod fuzz;
mod gpu_check;
mod image;
mod native;
mod soak;
mod stress;
mod util;
mod vllm;

use std::process::ExitCode;

use anyhow::{bail, Result};

fn run(task: &str, rest: &[String]) -> Result<()> {
    match task {
        "deps" => deps::install(deps::Scope::All),
        "demo" => demo::run(rest),
        "native" => {
            deps::install(deps::Scope::Build)?;
            native::build_and_check()
        }
        "test" => {
            let (stress, rest) = stress::take_flag(rest);
            deps::install(deps::Scope::All)?;
            native::build_and_check()?;
            // Real vLLM for tests/ebpf_vllm.rs (installed once per machine).
            vllm::for_tests()?;
            // The agent's image from deploy/Dockerfile, as users build it,
            // and the server image, for tests/container_daemonset.rs.
            image::build()?;
            image::ensure_test_images()?;
            util::ensure_tracefs()?;
            // Build first, unloaded: the hog is for the tests, not rustc.
            util::cargo(&["test", "--workspace", "--no-run"])?;
            let _hog = if stress {
                Some(stress::start_cpu_hog()?)
            } else {
                None
            };
            // Integration tests start servers on loopback and load eBPF
            // programs: one at a time keeps their measurements clean.
            let mut args = vec!["test", "--workspace", "--", "--test-threads=1"];
            args.extend(rest.iter().map(String::as_str));
            util::cargo(&args)
        }
        "image" => image::build().map(|_| ()),
        "bench" => bench::run(rest),
        "fuzz" => fuzz::run(rest),
        "soak" => soak::run(rest),
        "gpu-check" => gpu_check::run(),
        "vmlinux" => deps::vmlinux(),
        "vllm-env" => vllm::ensure_env().map(|venv| eprintln!("xtask: vLLM venv {}", venv.display())),
        "vllm-plugin" => vllm::plugin(rest),
        other => bail!(
            "unknown task {other:?}; tasks: deps, demo, native, test, image, bench, fuzz, soak, gpu-check, vmlinux, vllm-env, vllm-plugin"
        ),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((task, rest)) = args.split_first() else {
        eprintln!(
            "usage: cargo xtask <deps|demo|native|test [--stress]|bench|fuzz [--minutes N]|soak [--minutes N]|gpu-check|vmlinux|vllm-env|vllm-plugin> [args]"
        );
        return ExitCode::from(2);
    };
    match run(task, rest) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("xtask {task}: {err:#}");
            ExitCode::FAILURE
        }
    }
}
