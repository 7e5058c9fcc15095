//! Which processes to trace, at start-up and as processes come and go.
//!
//! The kernel filter is keyed by pid; this module decides what goes in it.
//! Children forked by a traced process are added by the kernel itself
//! (uvicorn/gunicorn workers), so only exec and listen need handling here.

mod elf_reader;
pub mod libraries;
pub mod placement;
pub mod procfs;
mod selector;

use std::collections::{HashMap, HashSet};
use std::path::Path;

use anyhow::{bail, Result};

pub use selector::{EndpointMatcher, Selector};

use crate::event::Event;
use crate::k8s::PodScope;
use crate::model::RequestTimeline;

/// A change to apply to the kernel pid filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    Trace(u32),
    Untrace(u32),
}

#[derive(Debug, Default)]
struct Served {
    llm_requests: u64,
    other_requests: u64,
}

/// Keeps the set of traced processes in step with the selector.
#[derive(Debug)]
pub struct Tracker {
    selector: Selector,
    endpoints: EndpointMatcher,
    agent_pid: u32,
    demote_after: u32,
    traced: HashSet<u32>,
    served: HashMap<u32, Served>,
    demoted: HashSet<u32>,
    /// `--k8s-namespace`/`--k8s-selector`: processes outside these pods are
    /// never traced, whatever else selects them.
    scope: Option<PodScope>,
}

impl Tracker {
    pub fn new(
        selector: Selector,
        endpoints: EndpointMatcher,
        agent_pid: u32,
        demote_after: u32,
    ) -> Self {
        Self {
            selector,
            endpoints,
            agent_pid,
            demote_after,
            traced: HashSet::new(),
            served: HashMap::new(),
            demoted: HashSet::new(),
            scope: None,
        }
    }

    /// Restricts tracing to the processes of the pods `scope` accepts.
    pub fn with_scope(mut self, scope: Option<PodScope>) -> Self {
        self.scope = scope;
        self
    }

    fn in_scope(&self, pid: u32) -> bool {
        self.scope.as_ref().is_none_or(|s| s.contains(pid))
    }

    pub fn is_automatic(&self) -> bool {
        self.selector.is_automatic()
    }

    /// Processes already running that the selector picks.
    pub fn initial_scan(&mut self, proc_root: &Path) -> Result<Vec<u32>> {
        if let Some(pid) = self.selector.missing_pid(proc_root) {
            bail!("--pid {pid}: no such process");
        }
        let mut picked: Vec<u32> = self.selector.pids.clone();
        // `--pid` covers what the process forks: children it forked before
        // we started (vLLM's EngineCore and Worker, spawned at its start)
        // count as much as later ones.
        for &pid in &self.selector.pids {
            picked.extend(procfs::descendants(proc_root, pid));
        }
        if self.selector.is_automatic() || !self.selector.ports.is_empty() {
            for (pid, ports) in procfs::listening_ports(proc_root) {
                if self.selector.is_automatic()
                    || ports.iter().any(|&p| self.selector.matches_port(p))
                {
                    picked.push(pid);
                }
            }
        }
        if self.selector.exe.is_some() || self.selector.comm.is_some() {
            for pid in procfs::all_pids(proc_root) {
                if procfs::process_info(proc_root, pid)
                    .is_some_and(|info| self.selector.matches_process(&info))
                {
                    picked.push(pid);
                }
            }
        }
        picked.retain(|&pid| pid != self.agent_pid && self.in_scope(pid));
        picked.sort_unstable();
        picked.dedup();
        self.traced.extend(&picked);
        Ok(picked)
    }

    /// Reacts to process lifecycle events from the kernel.
    pub fn on_event(&mut self, event: &Event, proc_root: &Path) -> Option<Change> {
        match event {
            Event::Exec(exec) => {
                self.demoted.remove(&exec.pid);
                if self.traced.contains(&exec.pid) || exec.pid == self.agent_pid {
                    return None;
                }
                if self.selector.exe.is_none() && self.selector.comm.is_none() {
                    return None;
                }
                let info = procfs::process_info(proc_root, exec.pid).unwrap_or_else(|| {
                    procfs::ProcessInfo {
                        pid: exec.pid,
                        comm: exec.comm.clone(),
                        exe: exec.filename.clone(),
                        cmdline: exec.filename.clone(),
                    }
                });
                self.selector
                    .matches_process(&info)
                    .then_some(exec.pid)
                    .filter(|&pid| self.in_scope(pid))
                    .map(|pid| self.trace(pid))
            }
            Event::Listen(listen) => {
                let wanted = if self.selector.is_automatic() {
                    !self.demoted.contains(&listen.pid)
                } else {
                    self.selector.matches_port(listen.port)
                };
                (wanted
                    && listen.pid != self.agent_pid
                    && !self.traced.contains(&listen.pid)
                    && self.in_scope(listen.pid))
                .then(|| self.trace(listen.pid))
            }
            Event::Exit(exit) => {
                // The kernel drops exited processes from its filter itself.
                self.traced.remove(&exit.pid);
                self.served.remove(&exit.pid);
                self.demoted.remove(&exit.pid);
                None
            }
            _ => None,
        }
    }

    fn trace(&mut self, pid: u32) -> Change {
        self.traced.insert(pid);
        Change::Trace(pid)
    }

    /// Whether a finished request is reported. In automatic mode only
    /// requests to LLM endpoints are, and a process that keeps serving
    /// anything else is dropped from tracing.
    /// Whether a request to `path` would be reported once finished (in
    /// automatic mode only the configured endpoints are).
    pub fn reports_path(&self, path: &str) -> bool {
        !self.selector.is_automatic() || self.endpoints.matches(path)
    }

    pub fn review(&mut self, timeline: &RequestTimeline) -> (bool, Option<Change>) {
        if !self.selector.is_automatic() {
            return (true, None);
        }
        if timeline.kind == crate::model::SpanKind::Client {
            // an upstream call says nothing of what the process serves
            return (self.endpoints.matches(&timeline.path), None);
        }
        let pid = timeline.conn.pid;
        let served = self.served.entry(pid).or_default();
        if self.endpoints.matches(&timeline.path) {
            served.llm_requests += 1;
            return (true, None);
        }
        served.other_requests += 1;
        if served.llm_requests == 0 && served.other_requests >= u64::from(self.demote_after) {
            self.traced.remove(&pid);
            self.served.remove(&pid);
            self.demoted.insert(pid);
            tracing::info!(
                "pid {pid} serves no LLM endpoint after {} requests: no longer traced",
                self.demote_after
            );
            return (false, Some(Change::Untrace(pid)));
        }
        (false, None)
    }
}
