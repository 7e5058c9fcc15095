//! Where the live view's snapshots come from: the agent this process runs
//! (its feed arrives once the probes are attached), or a remote agent's
//! control endpoint.

use std::sync::mpsc;
use std::time::Duration;

use anyhow::{anyhow, Result};

use crate::live::{LiveFeed, TopSnapshot};
use crate::session::remote::RemoteClient;
use crate::units::nanos;

pub enum Source {
    Local {
        feed: Option<LiveFeed>,
        arrives: mpsc::Receiver<LiveFeed>,
    },
    Remote {
        url: String,
        client: Box<RemoteClient>,
        runtime: tokio::runtime::Runtime,
    },
}

impl Source {
    pub fn describe(&self) -> String {
        match self {
            Source::Local { .. } => "tracing this host".to_string(),
            Source::Remote { url, .. } => format!("agent at {url}"),
        }
    }

    /// A snapshot now; `None` while the local agent is still starting.
    pub fn poll(&mut self, window: Duration) -> Result<Option<TopSnapshot>> {
        match self {
            Source::Local { feed, arrives } => {
                if feed.is_none() {
                    match arrives.try_recv() {
                        Ok(arrived) => *feed = Some(arrived),
                        Err(mpsc::TryRecvError::Empty) => return Ok(None),
                        Err(mpsc::TryRecvError::Disconnected) => {
                            return Err(anyhow!("the agent stopped before it was ready"))
                        }
                    }
                }
                Ok(feed.as_ref().map(|f| f.snapshot(nanos(window))))
            }
            Source::Remote {
                client, runtime, ..
            } => runtime.block_on(client.top(window)).map(Some),
        }
    }
}
