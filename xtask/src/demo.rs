//! `cargo xtask demo`: the agent in automatic mode (embedded default
//! config, no selector) tracing a bundled OpenAI-style streaming server
//! while a client sends it traffic.

use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

use crate::deps::{self, Scope};
use crate::util::{self, free_port, start_server, wait_for_line, Guard};

const SERVER: &str = "tests/servers/stdlib_sse.py";
const CLIENT: &str = "tests/clients/stream_client.py";

pub fn run(args: &[String]) -> Result<()> {
    let requests: u32 = match args {
        [] => 12,
        [flag, n] if flag == "--requests" => n.parse().context("--requests takes a number")?,
        _ => bail!("usage: cargo xtask demo [--requests N]"),
    };
    deps::install(Scope::Build)?;
    if !util::is_root() {
        bail!("the demo loads eBPF programs: run it as root (sudo -E cargo xtask demo)");
    }
    util::cargo(&["build", "--release", "-p", "tokentrace"])?;
    let agent_bin = util::root().join("target/release/tokentrace");

    let port = free_port()?;
    let port_arg = port.to_string();
    eprintln!("xtask demo: starting the example server (stdlib http.server, realistic token pacing) on 127.0.0.1:{port}");
    let _server = start_server(SERVER, &["--port", &port_arg, "--realistic"])?;

    eprintln!("xtask demo: starting `tokentrace run --requests {requests}` (automatic discovery, embedded default config)");
    let mut agent = Command::new(&agent_bin)
        .args(["run", "--requests", &requests.to_string()])
        .stdout(Stdio::inherit())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", agent_bin.display()))?;
    let agent_stderr = agent.stderr.take().context("agent stderr")?;
    let mut agent = Guard(agent);
    wait_for_line(agent_stderr, "tokentrace: ready", true)?;

    eprintln!("xtask demo: sending {requests} streamed chat completions, 3 at a time");
    let client = Command::new("python3")
        .arg(util::root().join(CLIENT))
        .args([
            "--port",
            &port_arg,
            "--requests",
            &requests.to_string(),
            "--concurrency",
            "3",
            "--model",
            "demo-llama-3-8b",
        ])
        .stdout(Stdio::null())
        .status()
        .context("running the demo client")?;
    if !client.success() {
        bail!("the demo client failed: {client}");
    }
    let status = agent.0.wait().context("waiting for the agent")?;
    if !status.success() {
        bail!("the agent exited with {status}");
    }
    Ok(())
}
