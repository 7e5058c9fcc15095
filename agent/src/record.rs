//! The `record` and `replay` commands (their flags are in `cli`).
//!
//! Local `record` runs the normal pipeline (`run::run_with`) with timeline
//! printing off and one session on the hub it is given; the session ends
//! when the run does (duration or Ctrl-C) and then writes its artifacts.
//! With `--remote` the same session runs on another agent instead. A
//! command, like `run`: it composes the session stage, which knows
//! nothing of it.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::cli::{RecordArgs, ReplayArgs, RunArgs};
use crate::config::Config;
use crate::output::OutputFormat;
use crate::run::{run_with, RunHooks};
use crate::session::remote::{self, RemoteClient};
use crate::session::{
    replay, token, write_artifacts, Artifact, ControlArgs, HubSettings, ProgressPrinter,
    SelectorSpec, SessionHub, SessionRequest, SessionState,
};

impl RecordArgs {
    fn request(&self) -> SessionRequest {
        SessionRequest {
            selector: SelectorSpec {
                pid: self.pid.clone(),
                port: self.port.clone(),
                exe: self.exe.clone(),
                comm: self.comm.clone(),
            },
            duration: None,
            profile_hz: self.profile_hz,
            raw: self.raw,
        }
    }

    fn token(&self) -> Result<Option<String>> {
        token::client_token(self.token_file.as_deref())
    }
}

fn print_artifacts(out: &std::path::Path, artifacts: &[Artifact]) {
    for artifact in artifacts {
        println!(
            "{}\t{} bytes",
            out.join(&artifact.name).display(),
            artifact.bytes
        );
    }
}

/// `tokentrace record`.
pub async fn record(args: RecordArgs) -> Result<()> {
    if args.remote.is_some() {
        return record_remote(args).await;
    }
    let config = Config::load(args.config.as_deref())?;
    let hub = SessionHub::new(HubSettings {
        stitch: config.stitch.stitcher_config(),
        idle_timeout: config.stitch.idle_timeout,
        explain: config.explain.clone(),
        sessions_dir: args.out.clone(),
        allow_raw: true,
        max_duration: None,
    });
    let session = hub
        .start(args.request(), Some(args.out.clone()))
        .map_err(anyhow::Error::msg)?;
    let run_args = RunArgs {
        pid: args.pid.clone(),
        port: args.port.clone(),
        exe: args.exe.clone(),
        comm: args.comm.clone(),
        output: OutputFormat::Text,
        requests: None,
        duration: Some(args.duration),
        config: args.config.clone(),
        capture_bytes: args.capture_bytes,
        uprobes_all_processes: false,
        probes: args.probes.clone(),
        allow_degraded: false,
        export: Box::default(),
        k8s: Box::default(),
        control: Box::new(ControlArgs {
            no_control: true,
            ..ControlArgs::default()
        }),
    };
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let progress = {
        let hub = hub.clone();
        let id = session.id.clone();
        let total = args.duration;
        tokio::spawn(async move {
            if ready_rx.await.is_err() {
                return;
            }
            let since = Instant::now();
            let mut printer = ProgressPrinter::default();
            let mut every = tokio::time::interval(Duration::from_secs(1));
            loop {
                every.tick().await;
                let Some(status) = hub.status(&id) else {
                    return;
                };
                if status.state != SessionState::Running {
                    printer.done();
                    return;
                }
                let mut p = status.progress;
                p.elapsed_ms = since.elapsed().as_millis() as u64;
                p.duration_ms = Some(total.as_millis() as u64);
                printer.show(&p);
            }
        })
    };
    let hooks = RunHooks {
        sessions: Some(hub.clone()),
        quiet: true,
        ready: Some(ready_tx),
        ..RunHooks::default()
    };
    let run = run_with(run_args, hooks).await;
    progress.abort();
    if std::io::stderr().is_terminal() {
        // end the progress line redrawn in place
        eprintln!();
    }
    // Whatever ended the run, the session ends with it and writes what it has.
    let hub_done = hub.clone();
    tokio::task::spawn_blocking(move || hub_done.shutdown())
        .await
        .context("waiting for the session to finish")?;
    let summary = run?;
    eprintln!("{summary}");
    let Some(status) = hub.status(&session.id) else {
        bail!("the session disappeared");
    };
    for warning in &status.warnings {
        eprintln!("tokentrace: warning: {warning}");
    }
    if status.state != SessionState::Done {
        bail!(
            "the session failed: {}",
            status.error.as_deref().unwrap_or("no reason given")
        );
    }
    eprintln!("tokentrace: {}", status.progress.line());
    print_artifacts(&args.out, &status.artifacts);
    Ok(())
}

async fn record_remote(args: RecordArgs) -> Result<()> {
    let url = args.remote.clone().unwrap_or_default();
    let client = RemoteClient::new(&url, args.token()?)?;
    let request = SessionRequest {
        duration: Some(args.duration),
        ..args.request()
    };
    let interrupt = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    let (status, artifacts) = remote::record(&client, &request, &args.out, interrupt).await?;
    for warning in &status.warnings {
        eprintln!("tokentrace: warning: {warning}");
    }
    eprintln!("tokentrace: {}", status.progress.line());
    print_artifacts(&args.out, &artifacts);
    Ok(())
}

/// `tokentrace replay`.
pub fn replay(args: &ReplayArgs) -> Result<()> {
    let (recording, ending) = replay::load(&args.raw)?;
    if let replay::Ending::Truncated(why) = &ending {
        eprintln!(
            "tokentrace: warning: {} is incomplete ({why}); replayed up to its last whole record",
            args.raw.display()
        );
    }
    let artifacts = write_artifacts(&args.out, &recording)?;
    eprintln!(
        "tokentrace: replayed {} requests from {}",
        recording.timelines.len(),
        args.raw.display()
    );
    print_artifacts(&args.out, &artifacts);
    Ok(())
}
