//! Where a run's results go, started before the probes (so a bad endpoint
//! or token file fails before anything is attached) and shut down after
//! the last timeline: the exporter, pod metadata and scope, the recording
//! sessions (with the control endpoint that serves them) and the triggers.

use anyhow::{Context, Result};

use crate::cli::RunArgs;
use crate::config::Config;
use crate::export::Exporter;
use crate::k8s::PodScope;
use crate::live::LiveFeed;
use crate::session::control::{self, ControlServer};
use crate::session::SessionHub;
use crate::trigger::Triggers;
use crate::units::monotonic_now;

use super::{RunHooks, EXPORT_GRACE};

pub(super) struct Outputs {
    pub(super) exporter: Exporter,
    /// Which pods' processes are traced (in a cluster, when asked).
    pub(super) scope: Option<PodScope>,
    pub(super) sessions: Option<SessionHub>,
    pub(super) triggers: Option<Triggers>,
    /// What `top` reads (in-process, or through the control endpoint).
    pub(super) live: Option<LiveFeed>,
    /// Serves `sessions` until the run ends (dropped with it).
    _control: Option<ControlServer>,
}

impl Outputs {
    pub(super) async fn start(
        args: &RunArgs,
        config: &Config,
        hooks: &mut RunHooks,
    ) -> Result<Self> {
        let export =
            crate::export::resolve(&config.export, &args.export, &|k| std::env::var(k).ok())?;
        // The live view reads the metric aggregation: `top` in-process, or
        // `top --remote` through the control endpoint.
        let aggregate = hooks.live.is_some() || !args.control.no_control;
        let mut exporter = Exporter::start(export, aggregate).await?;
        // Pod metadata and scope: silently off outside a cluster.
        let kubernetes = crate::k8s::start(&config.kubernetes, &args.k8s).await?;
        if let Some(metadata) = &kubernetes.metadata {
            exporter.set_kubernetes(metadata.clone());
        }
        let live = exporter.shared().map(LiveFeed::new);
        let (sessions, control) = match hooks.sessions.take() {
            Some(hub) => (Some(hub), None),
            None => control::for_run(&args.control, config, live.clone()).await?,
        };
        // Triggers record through a hub even where no control endpoint runs.
        let sessions = sessions.or_else(|| {
            (!config.triggers.rules.is_empty())
                .then(|| SessionHub::new(control::hub_settings(&args.control, config)))
        });
        let triggers = sessions
            .clone()
            .and_then(|hub| Triggers::new(config.triggers.clone(), hub));
        Ok(Self {
            exporter,
            scope: kubernetes.scope,
            sessions,
            triggers,
            live,
            _control: control,
        })
    }

    /// Sessions still running end with the run and write their artifacts
    /// (then count towards the triggers' size bound); queued spans get a
    /// grace period, and the export's summary is printed.
    pub(super) async fn shut_down(
        exporter: Exporter,
        sessions: Option<SessionHub>,
        triggers: Option<Triggers>,
    ) -> Result<()> {
        if let Some(sessions) = sessions {
            tokio::task::spawn_blocking(move || sessions.shutdown())
                .await
                .context("waiting for recording sessions to finish")?;
        }
        if let Some(mut triggers) = triggers {
            triggers.tick(monotonic_now());
        }
        if let Some(export) = exporter.shutdown(EXPORT_GRACE).await {
            eprintln!("{export}");
        }
        Ok(())
    }
}
