//! `tokentrace top`: the full-screen live view. One row per service ×
//! model × normalised route over a sliding window, the slowest recent
//! requests (Enter opens one as a waterfall), the agent's own line.
//!
//! Locally it runs the agent in this process (`run`'s selection flags,
//! quiet, no control endpoint) and reads its [`crate::live::LiveFeed`];
//! with `--remote` it polls a running agent's control endpoint. Either
//! way the numbers are windows of the agent's one metric aggregation,
//! the one its Prometheus endpoint serves. The view runs on its own
//! thread; the agent keeps the main one (see `run::event_loop`), and `q`
//! stops it like a signal would: it drains, detaches its probes and
//! prints its summary after the screen is gone.

mod draw;
mod format;
mod source;
mod stderr;
mod terminal;
mod view;
mod waterfall;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use ratatui::crossterm::event::{self, Event, KeyEventKind};

use crate::cli::{RunArgs, TopArgs};
use crate::run::{run_with, RunHooks};
use crate::session::remote::RemoteClient;
use crate::session::token;
use source::Source;
use stderr::StderrCapture;
use terminal::{require_tty, Screen};
use view::View;

/// How often the view takes a snapshot and redraws.
const REFRESH: Duration = Duration::from_secs(1);

pub fn top(args: TopArgs, runtime: tokio::runtime::Runtime) -> Result<()> {
    require_tty()?;
    if args.window.is_zero() || args.window > crate::live::MAX_WINDOW {
        bail!(
            "--window {}: give a duration up to {}",
            humantime::format_duration(args.window),
            humantime::format_duration(crate::live::MAX_WINDOW)
        );
    }
    match &args.remote {
        Some(url) => {
            let client = RemoteClient::new(url, token::client_token(args.token_file.as_deref())?)?;
            let source = Source::Remote {
                url: url.clone(),
                client: Box::new(client),
                runtime,
            };
            show(source, args.window, None, None, &AtomicBool::new(false))
        }
        None => local(&args, &runtime),
    }
}

/// `run`'s arguments for the agent this view runs: the same selection
/// flags (and `TOKENTRACE_*` variables), no control endpoint of its own.
fn run_args(args: &TopArgs) -> Result<RunArgs> {
    #[derive(Parser)]
    struct Run {
        #[command(flatten)]
        run: RunArgs,
    }
    let mut argv = vec!["tokentrace-top".to_string(), "--no-control".to_string()];
    for pid in &args.pid {
        argv.extend(["--pid".to_string(), pid.to_string()]);
    }
    for port in &args.port {
        argv.extend(["--port".to_string(), port.to_string()]);
    }
    for (flag, value) in [("--exe", &args.exe), ("--comm", &args.comm)] {
        if let Some(value) = value {
            argv.extend([flag.to_string(), value.clone()]);
        }
    }
    if let Some(config) = &args.config {
        argv.extend(["--config".to_string(), config.display().to_string()]);
    }
    Ok(Run::try_parse_from(argv)
        .context("tokentrace top's agent arguments")?
        .run)
}

fn local(args: &TopArgs, runtime: &tokio::runtime::Runtime) -> Result<()> {
    let run_args = run_args(args)?;
    let mut capture = StderrCapture::start()?;
    let (feed_tx, feed_rx) = mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
    let ended = Arc::new(AtomicBool::new(false));
    let log = capture.lines();
    let window = args.window;
    let ui = std::thread::Builder::new()
        .name("tokentrace-top".into())
        .spawn({
            let ended = Arc::clone(&ended);
            move || {
                let source = Source::Local {
                    feed: None,
                    arrives: feed_rx,
                };
                show(source, window, Some(stop_tx), Some(log), &ended)
            }
        })
        .context("spawning the view's thread")?;
    let hooks = RunHooks {
        quiet: true,
        live: Some(feed_tx),
        stop: Some(stop_rx),
        ..RunHooks::default()
    };
    let run = runtime.block_on(run_with(run_args, hooks));
    ended.store(true, Ordering::Relaxed);
    let shown = ui
        .join()
        .unwrap_or_else(|_| Err(anyhow::anyhow!("the view's thread panicked")));
    capture.restore();
    let summary = run?;
    eprintln!("{summary}");
    shown
}

/// The view's loop: a snapshot every [`REFRESH`], keys in between, until
/// `q` or the agent ends (`ended`). `stop` asks the local agent to end.
fn show(
    mut source: Source,
    window: Duration,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    log: Option<Arc<Mutex<VecDeque<String>>>>,
    ended: &AtomicBool,
) -> Result<()> {
    let mut screen = Screen::enter()?;
    let mut view = View::new(window);
    let describe = source.describe();
    let mut next = Instant::now();
    let outcome = loop {
        if ended.load(Ordering::Relaxed) {
            break Ok(());
        }
        if Instant::now() >= next {
            next = Instant::now() + REFRESH;
            match source.poll(window) {
                Ok(Some(snapshot)) => {
                    view.push(snapshot);
                    view.status.clear();
                }
                Ok(None) => view.status = "starting the agent…".to_string(),
                Err(err) if log.is_some() => break Err(err),
                Err(err) => view.status = format!("{err:#} (retrying)"),
            }
            let last = log.as_ref().and_then(|log| {
                log.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .back()
                    .cloned()
            });
            if let (true, Some(last)) = (view.status.is_empty(), last) {
                view.status = last;
            }
        }
        screen
            .terminal
            .draw(|f| draw::frame(f, &view, &describe))
            .context("drawing")?;
        let wait = next.saturating_duration_since(Instant::now());
        if event::poll(wait).context("reading the terminal")? {
            match event::read().context("reading the terminal")? {
                Event::Key(key) if key.kind == KeyEventKind::Press => view.key(key),
                _ => {} // a resize redraws on the next turn
            }
        }
        if view.quit {
            break Ok(());
        }
    };
    drop(screen);
    if let Some(stop) = stop {
        if !ended.load(Ordering::Relaxed) {
            println!("tokentrace top: stopping the agent (draining, detaching probes)…");
        }
        let _ = stop.send(());
    }
    outcome
}
