//! Which processes the probes look at: the kernel's pid filter and the
//! uprobes of the files those processes map, kept in step with what the
//! tracker decides and with lifecycle events (library loads, forks, exits).

use std::path::Path;

use crate::discover::libraries::{FileChange, ProbedFiles};
use crate::discover::Change;
use crate::event::Event;
use crate::ingest::{Ingest, ProbeCommand};

use super::PROC;

/// The probes' side of which processes are traced: the kernel pid filter
/// and the uprobes of the files those processes map.
pub(super) struct Probed<'a> {
    pub(super) ingest: &'a Ingest,
    pub(super) files: ProbedFiles,
}

impl Probed<'_> {
    pub(super) fn apply(&mut self, change: Change) {
        match change {
            Change::Trace(pid) => {
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
            Change::Untrace(pid) => {
                self.ingest.traced_pids.remove(pid);
                let changes = self.files.process_gone(pid);
                self.send(changes);
            }
        }
    }

    /// Finds probed files `pid` maps (now, or after it loaded a library).
    fn scan_libraries(&mut self, pid: u32) {
        let changes = self.files.scan(Path::new(PROC), pid);
        self.send(changes);
    }

    pub(super) fn send(&self, changes: Vec<FileChange>) {
        if !changes.is_empty() {
            self.ingest.command(ProbeCommand::Files(changes));
        }
    }

    /// Lifecycle events that change what is probed.
    pub(super) fn on_event(&mut self, event: &Event) {
        match event {
            Event::LibraryMapped(mapped) => self.scan_libraries(mapped.pid),
            // A fork copies the parent's breakpoints but not its uprobes:
            // the child (traced by the kernel from its first instruction)
            // gets its own.
            Event::Fork(fork) => self.scan_libraries(fork.pid),
            Event::Exit(exit) => {
                let changes = self.files.process_gone(exit.pid);
                self.send(changes);
            }
            _ => {}
        }
    }
}
