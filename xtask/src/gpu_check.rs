//! `cargo xtask gpu-check`: on a host with a CUDA GPU, runs a real CUDA
//! program (PyTorch, `tests/gpu/torch_steps.py`) under the agent and checks
//! that the CUDA probes attach to the real libcudart/libcuda and that real
//! launches and syncs arrive. CI has no GPU: this is run by hand (or on a
//! lent GPU machine) and reports what it saw.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::deps::{self, Scope};
use crate::util::{self, Guard};

const WORKLOAD: &str = "tests/gpu/torch_steps.py";

pub fn run() -> Result<()> {
    deps::install(Scope::Build)?;
    if !util::is_root() {
        bail!("gpu-check loads eBPF programs: run it as root");
    }
    util::ensure_tracefs()?;
    util::cargo(&["build", "--release", "-p", "tokentrace"])?;
    let agent_bin = util::target_dir().join("release/tokentrace");

    // The workload loads CUDA first, then waits: the agent attaches to the
    // libraries it mapped before the timed loop starts.
    let mut workload = Command::new("python3")
        .arg(util::root().join(WORKLOAD))
        .args(["--seconds", "5", "--wait-for-stdin"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the PyTorch workload")?;
    let pid = workload.id();
    let mut out = BufReader::new(workload.stdout.take().context("workload stdout")?);
    let mut line = String::new();
    out.read_line(&mut line)?;
    if !line.contains("ready") {
        let status = workload.wait()?;
        bail!("the workload did not start (exit {status}): is there a CUDA GPU and PyTorch?");
    }
    let mut stdin = workload.stdin.take().context("workload stdin")?;
    let workload = Guard(workload);

    let mut agent = Command::new(&agent_bin)
        .args([
            "--log-level",
            "info",
            "run",
            "--pid",
            &pid.to_string(),
            "--no-control",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting the agent")?;
    let agent_pid = agent.id();
    let stderr = agent.stderr.take().context("agent stderr")?;
    let agent = Guard(agent);
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut log = Vec::new();
    while !log.iter().any(|l: &String| l.contains("tokentrace: ready")) {
        log.push(
            rx.recv_timeout(Duration::from_secs(60))
                .context("agent never became ready")?,
        );
    }
    // Give the ingest thread a poll interval to attach what discovery found.
    std::thread::sleep(Duration::from_millis(500));
    writeln!(stdin, "go")?;
    line.clear();
    out.read_line(&mut line)?;
    eprintln!("xtask gpu-check: workload: {}", line.trim());
    drop(workload);
    util::status("kill", &["-TERM", &agent_pid.to_string()])?;
    drop(agent);
    log.extend(rx.try_iter());
    let cuda_lines: Vec<&String> = log.iter().filter(|l| l.contains("CUDA")).collect();
    for l in &cuda_lines {
        eprintln!("xtask gpu-check: agent: {l}");
    }
    let summary = log
        .iter()
        .find(|l| l.contains("CUDA syncs"))
        .context("the agent printed no inference summary")?;
    eprintln!("xtask gpu-check: agent: {summary}");
    let syncs: u64 = summary
        .split(" CUDA syncs")
        .next()
        .and_then(|head| head.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .context("unreadable summary")?;
    if !cuda_lines.iter().any(|l| l.contains("probing")) {
        bail!("the agent attached no CUDA probes: which libcudart/libcuda does the process map? (tokentrace check --pid)");
    }
    if syncs == 0 {
        bail!("CUDA probes attached but no sync arrived");
    }
    println!("gpu-check: ok: {syncs} real CUDA syncs seen");
    Ok(())
}
