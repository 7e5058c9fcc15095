//! Which processes the probes look at: the kernel's pid filter and the
//! uprobes of the files those processes map, kept in step with the
//! pipeline's [`ProbeChange`]s (what the tracker decides, library loads,
//! forks, exits).

use std::path::Path;

use crate::discover::libraries::{FileChange, ProbedFiles};
use crate::ingest::Ingest;
use crate::pipeline::ProbeChange;
use crate::probes::ProbeCommand;

use super::PROC;

/// The probes' side of which processes are traced: the kernel pid filter
/// and the uprobes of the files those processes map.
pub(super) struct Probed<'a> {
    pub(super) ingest: &'a Ingest,
    pub(super) files: ProbedFiles,
}

impl Probed<'_> {
    pub(super) fn apply(&mut self, change: ProbeChange) {
        match change {
            ProbeChange::Trace(pid) => {
                match self.ingest.traced_pids.insert(pid) {
                    Ok(()) => tracing::info!("tracing pid {pid}"),
                    Err(err) => tracing::warn!("{err:#}"),
                }
                let mut changes = self.files.scan(Path::new(PROC), pid);
                // The kernel adds what a traced process forks from now on;
                // what it forked before its exec or listen event reached us
                // (nginx's master forks its workers within milliseconds of
                // exec) is only found in /proc, now that later forks are
                // covered.
                for child in crate::discover::procfs::descendants(Path::new(PROC), pid) {
                    match self.ingest.traced_pids.insert(child) {
                        Ok(()) => tracing::info!("tracing pid {child}, forked by {pid}"),
                        Err(err) => tracing::warn!("{err:#}"),
                    }
                    changes.extend(self.files.scan(Path::new(PROC), child));
                }
                self.send(changes);
            }
            ProbeChange::Untrace(pid) => {
                self.ingest.traced_pids.remove(pid);
                let changes = self.files.process_gone(pid);
                self.send(changes);
            }
            ProbeChange::Rescan(pid) => {
                let changes = self.files.scan(Path::new(PROC), pid);
                self.send(changes);
            }
            // The kernel drops an exited process from its filter itself.
            ProbeChange::Exited(pid) => {
                let changes = self.files.process_gone(pid);
                self.send(changes);
            }
        }
    }

    pub(super) fn send(&self, changes: Vec<FileChange>) {
        if !changes.is_empty() {
            self.ingest.command(ProbeCommand::Files(changes));
        }
    }
}
