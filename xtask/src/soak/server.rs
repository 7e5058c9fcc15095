//! The traced server: tests/servers/fastapi_app.py (FastAPI + uvicorn, one
//! asyncio process) on a fixed port, so a restart brings a new pid on the
//! same port. Started with the real interpreter, not the pyenv shim (a bash
//! script that would be the child, with python its grandchild), so the pid
//! we hold is the pid that serves.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::util;

const SCRIPT: &str = "tests/servers/fastapi_app.py";

/// The interpreter `python3` on PATH resolves to (`sys.executable`).
pub fn real_python() -> Result<PathBuf> {
    let out = Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .context("running python3")?;
    if !out.status.success() {
        bail!("python3 -c 'import sys' failed");
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// A regex for `--exe` that matches this soak's server only (the command
/// line names its port), not other test servers on the host.
pub fn exe_pattern(port: u16) -> String {
    format!(r"fastapi_app\.py --host 127\.0\.0\.1 --port {port}( |$)")
}

pub struct Server {
    child: Child,
    pub pid: u32,
    pub spawned_at: f64,
    pub ready_at: f64,
}

impl Server {
    /// Starts the server on `port` and waits for its `READY` line.
    pub fn start(python: &Path, port: u16, t0: Instant) -> Result<Server> {
        let spawned_at = t0.elapsed().as_secs_f64();
        let mut child = Command::new(python)
            .arg("-u")
            .arg(util::root().join(SCRIPT))
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .current_dir(util::root())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            // uvicorn's access log: a line per request, nobody reads it.
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {SCRIPT}"))?;
        let pid = child.id();
        let stdout = child.stdout.take().context("server stdout")?;
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.starts_with("READY") {
                    let _ = tx.send(t0.elapsed().as_secs_f64());
                }
            }
        });
        let ready_at = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(at) => at,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                bail!("{SCRIPT} on port {port} did not print READY within 60 s");
            }
        };
        Ok(Server {
            child,
            pid,
            spawned_at,
            ready_at,
        })
    }

    /// SIGTERM (uvicorn finishes in-flight responses for a few seconds),
    /// SIGKILL after 10 s; returns when it is reaped.
    pub fn stop(mut self) -> Result<()> {
        util::terminate(&mut self.child, self.pid, Duration::from_secs(10))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
