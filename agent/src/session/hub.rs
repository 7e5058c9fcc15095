//! Live sessions: the run loop's tap and the worker thread of each session.
//!
//! The run loop hands every event batch to [`SessionHub::on_events`]. With
//! no session running that is one atomic load. With sessions running, each
//! gets a copy of the batch through a bounded queue and never makes the run
//! loop wait: a full queue drops the batch for that session and counts it
//! (the report says so). Everything else a session does (its own
//! stitching, `raw.pb`, CPU sampling, rendering) happens on its own
//! thread, so normal export is not disturbed.
//!
//! At most [`MAX_RUNNING`] sessions run at once, and at most one of them
//! samples CPU: two profilers would double the sampling cost for the same
//! stacks.

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use regex::Regex;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::core::{Profile, RecordingMeta, SessionCore};
use super::profile::{Profiler, DEFAULT_FREQUENCY_HZ, MAX_FREQUENCY_HZ};
use super::rawpb::RawWriter;
use super::{list_artifacts, write_artifacts, Artifact, Progress, RAW_PB};
use crate::config::ExplainConfig;
use crate::discover::{procfs, EndpointMatcher, Selector, Tracker};
use crate::event::{Event, MonoNs};
use crate::stitch::StitchConfig;
use crate::units::{monotonic_now, nanos, WallClock};

/// Sessions running at once.
pub const MAX_RUNNING: usize = 4;
/// Finished daemon sessions kept on disk for download; older ones are
/// deleted when a new one starts.
pub const KEEP_FINISHED: usize = 8;
/// Event batches queued per session before batches are dropped (the run
/// loop's own channel holds the same number).
const QUEUE_BATCHES: usize = 1024;
/// How often a session sweeps idle connections and refreshes its progress.
const TICK: Duration = Duration::from_secs(1);
/// How long a session worker waits for events before checking its clock,
/// stop flag and CPU samples.
const WAIT: Duration = Duration::from_millis(50);
const PROC: &str = "/proc";

/// Which processes a session looks at, within what the agent traces.
/// Empty: everything the agent traces.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SelectorSpec {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pid: Vec<u32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub port: Vec<u16>,
    /// Regex on the executable path or command line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exe: Option<String>,
    /// Regex on the process name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm: Option<String>,
}

impl SelectorSpec {
    pub fn is_empty(&self) -> bool {
        self.pid.is_empty() && self.port.is_empty() && self.exe.is_none() && self.comm.is_none()
    }

    /// The selection as command-line flags, for report headers.
    pub fn describe(&self) -> String {
        if self.is_empty() {
            return "every traced process".to_string();
        }
        let mut parts: Vec<String> = Vec::new();
        parts.extend(self.pid.iter().map(|p| format!("--pid {p}")));
        parts.extend(self.port.iter().map(|p| format!("--port {p}")));
        parts.extend(self.exe.iter().map(|e| format!("--exe {e:?}")));
        parts.extend(self.comm.iter().map(|c| format!("--comm {c:?}")));
        parts.join(" ")
    }

    fn selector(&self) -> Result<Selector, StartError> {
        let regex = |flag: &str, pattern: &Option<String>| {
            pattern
                .as_deref()
                .map(|p| {
                    Regex::new(p).map_err(|err| {
                        StartError::Invalid(format!("{flag} {p:?} is not a valid regex: {err}"))
                    })
                })
                .transpose()
        };
        Ok(Selector {
            pids: self.pid.clone(),
            ports: self.port.clone(),
            exe: regex("exe", &self.exe)?,
            comm: regex("comm", &self.comm)?,
        })
    }
}

fn default_profile_hz() -> u64 {
    DEFAULT_FREQUENCY_HZ
}

/// What to record: the body of `POST /v1/sessions`, and what `record`
/// builds from its flags.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionRequest {
    #[serde(default)]
    pub selector: SelectorSpec,
    /// e.g. `"30s"`; absent: until stopped.
    #[serde(default, with = "humantime_serde")]
    pub duration: Option<Duration>,
    /// CPU sampling frequency; 0 turns the flame graph off.
    #[serde(default = "default_profile_hz")]
    pub profile_hz: u64,
    /// Also write raw.pb (captured payload bytes included).
    #[serde(default)]
    pub raw: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionState {
    Running,
    /// Stopped; rendering the artifacts.
    Finishing,
    Done,
    Failed,
}

/// What the control endpoint reports about a session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionStatus {
    pub id: String,
    pub state: SessionState,
    pub selector: String,
    pub profile_hz: u64,
    pub raw: bool,
    pub progress: Progress,
    /// Present once the session is done.
    pub artifacts: Vec<Artifact>,
    /// Things that went wrong without failing the session (e.g. CPU
    /// sampling could not start).
    pub warnings: Vec<String>,
    pub error: Option<String>,
    /// Started by a daemon trigger: why it fired.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger: Option<String>,
}

/// What a trigger hands a session it starts: why, and the events of the
/// seconds before (admitted first, so the report covers them).
#[derive(Debug, Default)]
pub struct Triggered {
    pub reason: String,
    pub history: Vec<Vec<Event>>,
    /// The oldest history event's time: the session's report starts there.
    pub from: Option<MonoNs>,
    /// History events the ring's byte bound had already let go.
    pub evicted_early: u64,
}

/// Why a session was not started. Each maps to an HTTP status.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum StartError {
    #[error("session {0} is already sampling CPU; at most one CPU-sampling session runs at a time (retry later, or ask for \"profile_hz\": 0)")]
    ProfilerBusy(String),
    #[error("{MAX_RUNNING} sessions are already running; retry when one ends")]
    TooMany,
    #[error("raw.pb holds captured payload bytes: this agent only writes it when started with --control-allow-raw")]
    RawNotAllowed,
    #[error("{0}")]
    Invalid(String),
    #[error("the agent is shutting down")]
    ShuttingDown,
    #[error("{0}")]
    Io(String),
}

impl StartError {
    pub fn http_status(&self) -> u16 {
        match self {
            StartError::ProfilerBusy(_) | StartError::TooMany => 409,
            StartError::RawNotAllowed => 403,
            StartError::Invalid(_) => 400,
            StartError::ShuttingDown => 503,
            StartError::Io(_) => 500,
        }
    }
}

/// How sessions are run on this agent.
#[derive(Debug, Clone)]
pub struct HubSettings {
    pub stitch: StitchConfig,
    pub idle_timeout: Duration,
    pub explain: ExplainConfig,
    /// Where sessions started without an explicit directory write (one
    /// sub-directory per session).
    pub sessions_dir: PathBuf,
    pub allow_raw: bool,
    /// Longest session a request may ask for; `None`: no limit.
    pub max_duration: Option<Duration>,
}

/// One session's state shared between its worker and the hub.
#[derive(Debug)]
struct Shared {
    status: Mutex<SessionStatus>,
    stop: AtomicBool,
    /// Events dropped at the queue since the worker last looked.
    dropped: AtomicU64,
}

impl Shared {
    fn status(&self) -> MutexGuard<'_, SessionStatus> {
        // A worker that panicked while holding the lock left a status that
        // is still worth reading.
        self.status.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[derive(Debug)]
struct Entry {
    id: String,
    shared: Arc<Shared>,
    input: Option<SyncSender<Vec<Event>>>,
    thread: Option<JoinHandle<()>>,
    heavy: bool,
    dir: PathBuf,
    /// Created by the hub under `sessions_dir` (deleted when pruned).
    owned_dir: bool,
    /// Started by a trigger: kept by the triggers' size bound, not by
    /// [`KEEP_FINISHED`].
    triggered: bool,
}

impl Entry {
    fn state(&self) -> SessionState {
        self.shared.status().state
    }

    fn running(&self) -> bool {
        matches!(
            self.state(),
            SessionState::Running | SessionState::Finishing
        )
    }
}

#[derive(Debug)]
struct Inner {
    settings: HubSettings,
    /// Entries with an open input queue: zero means `on_events` returns at
    /// once.
    active: AtomicUsize,
    sessions: Mutex<Vec<Entry>>,
    next_id: AtomicU64,
    closed: AtomicBool,
}

/// The agent's sessions. Cheap to clone; every clone is the same hub.
#[derive(Debug, Clone)]
pub struct SessionHub {
    inner: Arc<Inner>,
}

impl SessionHub {
    pub fn new(settings: HubSettings) -> Self {
        Self {
            inner: Arc::new(Inner {
                settings,
                active: AtomicUsize::new(0),
                sessions: Mutex::new(Vec::new()),
                next_id: AtomicU64::new(1),
                closed: AtomicBool::new(false),
            }),
        }
    }

    fn sessions(&self) -> MutexGuard<'_, Vec<Entry>> {
        self.inner
            .sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The run loop's tap: a copy of the batch to every running session.
    pub fn on_events(&self, batch: &[Event]) {
        if self.inner.active.load(Ordering::Relaxed) == 0 || batch.is_empty() {
            return;
        }
        let mut sessions = self.sessions();
        for entry in sessions.iter_mut() {
            let Some(input) = &entry.input else { continue };
            match input.try_send(batch.to_vec()) {
                Ok(()) => {}
                Err(TrySendError::Full(lost)) => {
                    entry
                        .shared
                        .dropped
                        .fetch_add(lost.len() as u64, Ordering::Relaxed);
                }
                Err(TrySendError::Disconnected(_)) => {
                    entry.input = None;
                    self.inner.active.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Starts a session writing into `dir`, or into a new directory under
    /// the hub's `sessions_dir` when `dir` is `None`.
    pub fn start(
        &self,
        request: SessionRequest,
        dir: Option<PathBuf>,
    ) -> Result<SessionStatus, StartError> {
        self.start_with(request, dir, None)
    }

    /// Starts a session for a trigger, writing into `dir`, beginning with
    /// the trigger's history.
    pub fn start_triggered(
        &self,
        request: SessionRequest,
        dir: PathBuf,
        triggered: Triggered,
    ) -> Result<SessionStatus, StartError> {
        self.start_with(request, Some(dir), Some(triggered))
    }

    fn start_with(
        &self,
        request: SessionRequest,
        dir: Option<PathBuf>,
        triggered: Option<Triggered>,
    ) -> Result<SessionStatus, StartError> {
        if self.inner.closed.load(Ordering::Relaxed) {
            return Err(StartError::ShuttingDown);
        }
        let settings = &self.inner.settings;
        if request.raw && !settings.allow_raw {
            return Err(StartError::RawNotAllowed);
        }
        if request.profile_hz > MAX_FREQUENCY_HZ {
            return Err(StartError::Invalid(format!(
                "profile_hz {} is above {MAX_FREQUENCY_HZ}",
                request.profile_hz
            )));
        }
        match (request.duration, settings.max_duration) {
            (Some(d), _) if d.is_zero() => {
                return Err(StartError::Invalid("duration must be above zero".into()))
            }
            (None, Some(max)) => {
                return Err(StartError::Invalid(format!(
                    "a duration is required (at most {})",
                    humantime::format_duration(max)
                )))
            }
            (Some(d), Some(max)) if d > max => {
                return Err(StartError::Invalid(format!(
                    "duration {} is above the limit of {}",
                    humantime::format_duration(d),
                    humantime::format_duration(max)
                )))
            }
            _ => {}
        }
        let selector = request.selector.selector()?;
        let heavy = request.profile_hz > 0;
        let is_triggered = triggered.is_some();

        let mut sessions = self.sessions();
        let running: Vec<&Entry> = sessions.iter().filter(|e| e.running()).collect();
        if heavy {
            if let Some(busy) = running.iter().find(|e| e.heavy) {
                return Err(StartError::ProfilerBusy(busy.id.clone()));
            }
        }
        if running.len() >= MAX_RUNNING {
            return Err(StartError::TooMany);
        }
        prune(&mut sessions);

        let id = format!(
            "{}-{}",
            std::process::id(),
            self.inner.next_id.fetch_add(1, Ordering::Relaxed)
        );
        let owned_dir = dir.is_none();
        let dir = dir.unwrap_or_else(|| settings.sessions_dir.join(&id));
        std::fs::create_dir_all(&dir).map_err(|err| {
            StartError::Io(format!(
                "creating the session directory {}: {err}",
                dir.display()
            ))
        })?;
        let status = SessionStatus {
            id: id.clone(),
            state: SessionState::Running,
            selector: request.selector.describe(),
            profile_hz: request.profile_hz,
            raw: request.raw,
            progress: Progress {
                duration_ms: request.duration.map(|d| d.as_millis() as u64),
                ..Progress::default()
            },
            artifacts: Vec::new(),
            warnings: Vec::new(),
            error: None,
            trigger: triggered.as_ref().map(|t| t.reason.clone()),
        };
        let shared = Arc::new(Shared {
            status: Mutex::new(status.clone()),
            stop: AtomicBool::new(false),
            dropped: AtomicU64::new(0),
        });
        let (tx, rx) = mpsc::sync_channel(QUEUE_BATCHES);
        let job = Job {
            request,
            selector,
            stitch: settings.stitch.clone(),
            idle_ns: nanos(settings.idle_timeout),
            explain: settings.explain.clone(),
            dir: dir.clone(),
            shared: Arc::clone(&shared),
            input: rx,
            triggered,
        };
        let thread = std::thread::Builder::new()
            .name(format!("tt-session-{id}"))
            .spawn(move || job.run())
            .map_err(|err| StartError::Io(format!("starting the session thread: {err}")))?;
        sessions.push(Entry {
            id,
            shared,
            input: Some(tx),
            thread: Some(thread),
            heavy,
            dir,
            owned_dir,
            triggered: is_triggered,
        });
        self.inner.active.fetch_add(1, Ordering::Relaxed);
        Ok(status)
    }

    pub fn status(&self, id: &str) -> Option<SessionStatus> {
        self.sessions()
            .iter()
            .find(|e| e.id == id)
            .map(|e| e.shared.status().clone())
    }

    pub fn list(&self) -> Vec<SessionStatus> {
        self.sessions()
            .iter()
            .map(|e| e.shared.status().clone())
            .collect()
    }

    /// Asks a session to end now (it then renders its artifacts). False if
    /// there is no such session.
    pub fn stop(&self, id: &str) -> bool {
        let sessions = self.sessions();
        let Some(entry) = sessions.iter().find(|e| e.id == id) else {
            return false;
        };
        entry.shared.stop.store(true, Ordering::Relaxed);
        true
    }

    /// Directories of the sessions still running or rendering.
    pub fn running_dirs(&self) -> Vec<PathBuf> {
        self.sessions()
            .iter()
            .filter(|e| e.running())
            .map(|e| e.dir.clone())
            .collect()
    }

    /// Forgets the finished session written into `dir` (its files were
    /// deleted).
    pub fn forget_dir(&self, dir: &Path) {
        self.sessions().retain(|e| e.running() || e.dir != dir);
    }

    /// The directory of a finished session, for artifact downloads.
    pub fn artifacts_dir(&self, id: &str) -> Option<PathBuf> {
        self.sessions()
            .iter()
            .find(|e| e.id == id && e.state() == SessionState::Done)
            .map(|e| e.dir.clone())
    }

    /// Waits for a session to end and returns its final status.
    pub fn wait(&self, id: &str) -> Option<SessionStatus> {
        let thread = self
            .sessions()
            .iter_mut()
            .find(|e| e.id == id)
            .and_then(|e| e.thread.take());
        if let Some(thread) = thread {
            if thread.join().is_err() {
                tracing::error!("session {id}: its thread panicked");
            }
        }
        self.status(id)
    }

    /// Stops every session and waits for each to write its artifacts. No
    /// session starts afterwards.
    pub fn shutdown(&self) {
        self.inner.closed.store(true, Ordering::Relaxed);
        let threads: Vec<(String, JoinHandle<()>)> = {
            let mut sessions = self.sessions();
            for entry in sessions.iter_mut() {
                entry.shared.stop.store(true, Ordering::Relaxed);
                if entry.input.take().is_some() {
                    self.inner.active.fetch_sub(1, Ordering::Relaxed);
                }
            }
            sessions
                .iter_mut()
                .filter_map(|e| e.thread.take().map(|t| (e.id.clone(), t)))
                .collect()
        };
        for (id, thread) in threads {
            if thread.join().is_err() {
                tracing::error!("session {id}: its thread panicked");
            }
        }
    }
}

/// Forgets finished sessions beyond [`KEEP_FINISHED`], oldest first,
/// deleting the directories the hub created for them.
fn prune(sessions: &mut Vec<Entry>) {
    let finished = sessions
        .iter()
        .filter(|e| !e.running() && !e.triggered)
        .count();
    let mut excess = finished.saturating_sub(KEEP_FINISHED.saturating_sub(1));
    sessions.retain(|e| {
        if excess == 0 || e.running() || e.triggered {
            return true;
        }
        excess -= 1;
        if e.owned_dir {
            if let Err(err) = std::fs::remove_dir_all(&e.dir) {
                tracing::warn!("session {}: removing {}: {err}", e.id, e.dir.display());
            }
        }
        false
    });
}

/// The pid an event belongs to.
fn event_pid(event: &Event) -> u32 {
    match event {
        Event::Data(d) => d.conn.pid,
        Event::Accept(c) | Event::Close(c) => c.conn.pid,
        Event::Exec(p) | Event::Exit(p) | Event::Fork(p) => p.pid,
        Event::Listen(l) => l.pid,
        Event::LibraryMapped(m) => m.pid,
        Event::Usdt(u) => u.pid,
        Event::CudaSync(c) => c.pid,
        Event::OffCpu(o) => o.pid,
        Event::SendHold(h) => h.pid,
        Event::PeerClosed(p) => p.conn.pid,
        Event::TlsHandshake(h) => h.conn.pid,
    }
}

/// The parent of `pid` from `/proc/PID/stat` (the field after the
/// parenthesised comm, which may itself contain spaces and parentheses).
fn parent_pid(proc_root: &Path, pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(proc_root.join(pid.to_string()).join("stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Which events a session admits.
#[derive(Debug)]
enum Scope {
    /// Everything the agent traces.
    All,
    /// Processes the selector picks, their descendants, and processes that
    /// later listen on a selected port.
    Selected {
        selector: Selector,
        decided: HashMap<u32, bool>,
    },
}

/// Ancestors looked at when deciding whether a new pid belongs to a
/// selected process (server → worker → helper is three).
const MAX_ANCESTRY: usize = 8;

impl Scope {
    /// Resolves the selector against the running processes.
    fn new(selector: Selector) -> anyhow::Result<(Self, Vec<u32>)> {
        if selector.is_automatic() {
            return Ok((Scope::All, Vec::new()));
        }
        let mut tracker = Tracker::new(
            selector.clone(),
            EndpointMatcher::new(&[]),
            std::process::id(),
            0,
        );
        let pids = tracker.initial_scan(Path::new(PROC))?;
        let decided = pids.iter().map(|&p| (p, true)).collect();
        Ok((Scope::Selected { selector, decided }, pids))
    }

    fn admits(&mut self, event: &Event) -> bool {
        let Scope::Selected { selector, decided } = self else {
            return true;
        };
        let pid = event_pid(event);
        match event {
            Event::Exec(_) => {
                decided.remove(&pid);
            }
            Event::Listen(l) if selector.matches_port(l.port) => {
                decided.insert(pid, true);
            }
            Event::Exit(_) => return decided.remove(&pid).unwrap_or(false),
            // A child belongs where its parent does.
            Event::Fork(f) => {
                if let Some(&parent) = decided.get(&f.ppid) {
                    decided.insert(pid, parent);
                }
            }
            _ => {}
        }
        if let Some(&known) = decided.get(&pid) {
            return known;
        }
        let admitted = decide(selector, decided, pid);
        decided.insert(pid, admitted);
        admitted
    }
}

fn decide(selector: &Selector, decided: &HashMap<u32, bool>, pid: u32) -> bool {
    let root = Path::new(PROC);
    if procfs::process_info(root, pid).is_some_and(|info| selector.matches_process(&info)) {
        return true;
    }
    let mut current = pid;
    for _ in 0..MAX_ANCESTRY {
        match parent_pid(root, current) {
            Some(parent) if parent > 1 => {
                if decided.get(&parent) == Some(&true) {
                    return true;
                }
                current = parent;
            }
            _ => break,
        }
    }
    !selector.ports.is_empty()
        && procfs::listening_ports(root)
            .get(&pid)
            .is_some_and(|ports| ports.iter().any(|&p| selector.matches_port(p)))
}

/// Everything a session worker needs, moved onto its thread.
struct Job {
    request: SessionRequest,
    selector: Selector,
    stitch: StitchConfig,
    idle_ns: u64,
    explain: ExplainConfig,
    dir: PathBuf,
    shared: Arc<Shared>,
    input: mpsc::Receiver<Vec<Event>>,
    /// What the trigger that started it hands over (its history first).
    triggered: Option<Triggered>,
}

/// A running session's event path.
struct Live<'obj> {
    scope: Scope,
    core: SessionCore,
    raw: Option<RawWriter>,
    /// The first raw.pb write error; the file is abandoned after it.
    raw_error: Option<std::io::Error>,
    profiler: Option<Profiler<'obj>>,
}

impl Live<'_> {
    fn admit(&mut self, batch: &[Event]) {
        for event in batch {
            let selected = self.scope.admits(event);
            // `llm:*` marks join requests by id across processes (an engine
            // process serving a selected frontend): kept for the explainer
            // even from processes the selector did not pick.
            if !selected && !matches!(event, Event::Usdt(_)) {
                continue;
            }
            if let (true, Some(p)) = (selected, self.profiler.as_mut()) {
                p.add_process(event_pid(event));
            }
            if let Some(w) = self.raw.as_mut() {
                if let Err(err) = w.event(event) {
                    self.raw_error = Some(err);
                    self.raw = None;
                }
            }
            self.core.push(event);
        }
    }

    fn tick(&mut self, now: MonoNs) {
        self.core.tick(now);
        if let Some(w) = self.raw.as_mut() {
            if let Err(err) = w.tick(now) {
                self.raw_error = Some(err);
                self.raw = None;
            }
        }
    }
}

/// The wall-clock offset (Unix − monotonic), measured now.
fn wall_offset_ns(now: MonoNs) -> i64 {
    let unix = WallClock::measure().unix_nanos(now);
    i64::try_from(i128::from(unix) - i128::from(now)).unwrap_or(0)
}

impl Job {
    fn run(self) {
        let shared = Arc::clone(&self.shared);
        let result = self.record();
        let mut status = shared.status();
        match result {
            Ok(artifacts) => {
                status.artifacts = artifacts;
                status.state = SessionState::Done;
            }
            Err(err) => {
                tracing::warn!("session {}: {err:#}", status.id);
                status.error = Some(format!("{err:#}"));
                status.state = SessionState::Failed;
            }
        }
    }

    fn warn(&self, message: String) {
        tracing::warn!("{message}");
        self.shared.status().warnings.push(message);
    }

    fn record(mut self) -> anyhow::Result<Vec<Artifact>> {
        let started = monotonic_now();
        let triggered = self.triggered.take();
        // A triggered session's report starts with its history.
        let report_from = triggered
            .as_ref()
            .and_then(|t| t.from)
            .map_or(started, |from| from.min(started));
        let request = &self.request;
        let (scope, initial) = Scope::new(self.selector.clone())?;
        let mut meta = RecordingMeta {
            agent_version: env!("CARGO_PKG_VERSION").to_string(),
            hostname: super::hostname(),
            selector: request.selector.describe(),
            started_ns: report_from,
            ended_ns: started,
            wall_offset_ns: wall_offset_ns(started),
            profile_hz: request.profile_hz,
            idle_timeout_ns: self.idle_ns,
            max_buffered_bytes: self.stitch.max_buffered_bytes as u64,
            max_connections: self.stitch.max_connections as u64,
            stall_threshold_ns: nanos(self.explain.stall_threshold),
            explain_history_ns: nanos(self.explain.history),
        };
        let mut storage = MaybeUninit::uninit();
        let mut profiler = match request.profile_hz {
            0 => None,
            hz => match Profiler::start(&mut storage, hz) {
                Ok(p) => Some(p),
                Err(err) => {
                    self.warn(format!("CPU sampling is off for this session: {err:#}"));
                    None
                }
            },
        };
        if let Some(p) = profiler.as_mut() {
            for &pid in &initial {
                p.add_process(pid);
            }
        }
        let raw = if request.raw {
            Some(RawWriter::create(&self.dir.join(RAW_PB), &meta)?)
        } else {
            None
        };
        let mut live = Live {
            scope,
            core: SessionCore::new(&meta),
            raw,
            raw_error: None,
            profiler,
        };
        if let Some(Triggered {
            history,
            evicted_early: evicted,
            ..
        }) = triggered
        {
            for batch in &history {
                live.admit(batch);
            }
            if evicted > 0 {
                self.warn(format!(
                    "the history before the trigger is shorter than triggers.before: the ring's \
                     bound (triggers.history_max_mib) had let {evicted} events go"
                ));
            }
        }
        let mut ttfts: Vec<u64> = Vec::new();
        let deadline = request.duration.map(|d| started.saturating_add(nanos(d)));
        let tick_ns = nanos(TICK);
        let mut next_tick = started.saturating_add(tick_ns);
        loop {
            let now = monotonic_now();
            if self.shared.stop.load(Ordering::Relaxed) || deadline.is_some_and(|d| now >= d) {
                break;
            }
            match self.input.recv_timeout(WAIT) {
                Ok(batch) => live.admit(&batch),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            live.core
                .dropped(self.shared.dropped.swap(0, Ordering::Relaxed));
            if let Some(p) = &live.profiler {
                p.poll();
            }
            let now = monotonic_now();
            if now >= next_tick {
                next_tick = now.saturating_add(tick_ns);
                live.tick(now);
                ttfts.clear();
                ttfts.extend(live.core.timelines().iter().filter_map(|t| t.ttft_ns()));
                let samples = live.profiler.as_ref().map_or(0, |p| p.samples() as u64);
                let counters = live.core.counters();
                let mut status = self.shared.status();
                let progress = &mut status.progress;
                progress.elapsed_ms = now.saturating_sub(started) / 1_000_000;
                progress.requests = live.core.timelines().len() as u64;
                progress.set_ttft(&ttfts);
                progress.cpu_samples = samples;
                progress.events = counters.events;
                progress.events_dropped = counters.events_dropped;
            }
        }
        // Events already queued happened before the stop: take them too.
        while let Ok(batch) = self.input.try_recv() {
            live.admit(&batch);
        }
        let Live {
            mut core,
            raw,
            raw_error,
            profiler,
            ..
        } = live;
        core.dropped(self.shared.dropped.swap(0, Ordering::Relaxed));
        let now = monotonic_now();
        self.shared.status().state = SessionState::Finishing;
        let (profile, samples_dropped): (Option<Profile>, u64) = match profiler {
            Some(p) => {
                let (profile, dropped) = p.finish();
                (Some(profile), dropped)
            }
            None => (None, 0),
        };
        meta.ended_ns = now;
        let recording = core.finish(now, meta, profile, samples_dropped);
        if let Some(err) = raw_error {
            self.warn(format!("raw.pb is incomplete: writing it failed: {err}"));
        }
        if let Some(w) = raw {
            if let Err(err) = w.finish(now, &recording.counters, recording.profile.as_ref()) {
                self.warn(format!("raw.pb is incomplete: {err}"));
            }
        }
        {
            let mut status = self.shared.status();
            let progress = &mut status.progress;
            progress.elapsed_ms = now.saturating_sub(started) / 1_000_000;
            progress.requests = recording.timelines.len() as u64;
            ttfts.clear();
            ttfts.extend(recording.timelines.iter().filter_map(|t| t.ttft_ns()));
            progress.set_ttft(&ttfts);
            progress.cpu_samples = recording
                .profile
                .as_ref()
                .map_or(0, |p| p.samples.len() as u64);
            progress.events = recording.counters.events;
            progress.events_dropped = recording.counters.events_dropped;
        }
        write_artifacts(&self.dir, &recording)?;
        list_artifacts(&self.dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::core::tests::sse_exchange;

    fn settings(dir: &Path) -> HubSettings {
        HubSettings {
            stitch: StitchConfig::default(),
            idle_timeout: Duration::from_secs(300),
            explain: ExplainConfig::default(),
            sessions_dir: dir.to_path_buf(),
            allow_raw: false,
            max_duration: Some(Duration::from_secs(600)),
        }
    }

    fn request(profile_hz: u64) -> SessionRequest {
        SessionRequest {
            selector: SelectorSpec::default(),
            duration: Some(Duration::from_secs(60)),
            profile_hz,
            raw: false,
        }
    }

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tt-hub-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn a_session_sees_tapped_events_and_renders_its_artifacts() {
        let dir = temp("tap");
        let hub = SessionHub::new(settings(&dir));
        hub.on_events(&sse_exchange(1_000_000_000, 2, "/before")); // no session: ignored
        let status = hub.start(request(0), None).expect("start");
        assert_eq!(status.state, SessionState::Running);
        assert_eq!(status.selector, "every traced process");
        hub.on_events(&sse_exchange(2_000_000_000, 3, "/v1/chat/completions"));
        assert!(hub.artifacts_dir(&status.id).is_none(), "not done yet");
        assert!(hub.stop(&status.id));
        let done = hub.wait(&status.id).expect("status");
        assert_eq!(done.state, SessionState::Done, "{done:?}");
        assert_eq!(done.progress.requests, 1);
        assert_eq!(done.artifacts.len(), 5, "{:?}", done.artifacts);
        let out = hub.artifacts_dir(&status.id).expect("dir");
        let jsonl = std::fs::read_to_string(out.join("requests.jsonl")).expect("jsonl");
        assert!(jsonl.contains("/v1/chat/completions") && !jsonl.contains("/before"));
        hub.on_events(&sse_exchange(3_000_000_000, 1, "/after")); // finished: ignored
        assert_eq!(hub.inner.active.load(Ordering::Relaxed), 0);
        hub.shutdown();
        assert_eq!(hub.start(request(0), None), Err(StartError::ShuttingDown));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn requests_are_validated_and_one_profiler_runs_at_a_time() {
        let dir = temp("limits");
        let hub = SessionHub::new(settings(&dir));
        let raw = SessionRequest {
            raw: true,
            ..request(0)
        };
        assert_eq!(hub.start(raw, None), Err(StartError::RawNotAllowed));
        let long = SessionRequest {
            duration: Some(Duration::from_secs(3600)),
            ..request(0)
        };
        assert!(matches!(hub.start(long, None), Err(StartError::Invalid(_))));
        let endless = SessionRequest {
            duration: None,
            ..request(0)
        };
        assert!(matches!(
            hub.start(endless, None),
            Err(StartError::Invalid(_))
        ));
        let bad = SessionRequest {
            selector: SelectorSpec {
                exe: Some("(".into()),
                ..SelectorSpec::default()
            },
            ..request(0)
        };
        assert!(matches!(hub.start(bad, None), Err(StartError::Invalid(_))));

        // a CPU-sampling session: it counts as the heavy one whether or
        // not sampling could start, and says which it was
        let heavy = hub.start(request(99), None).expect("heavy");
        assert_eq!(
            hub.start(request(49), None),
            Err(StartError::ProfilerBusy(heavy.id.clone()))
        );
        let light = hub
            .start(request(0), None)
            .expect("light sessions run alongside");
        assert_eq!(hub.list().len(), 2);
        hub.shutdown();
        for id in [&heavy.id, &light.id] {
            assert_eq!(hub.status(id).map(|s| s.state), Some(SessionState::Done));
        }
        // As root (CI) sampling must really start; unprivileged it cannot,
        // and the session must say so rather than pass for a profiled one.
        let warnings = hub
            .status(&heavy.id)
            .map(|s| s.warnings)
            .unwrap_or_default();
        let sampling_off = warnings
            .iter()
            .any(|w| w.starts_with("CPU sampling is off for this session"));
        // SAFETY: geteuid has no preconditions and cannot fail.
        let root = unsafe { libc::geteuid() } == 0;
        assert_eq!(
            sampling_off, !root,
            "root: {root}, heavy session warnings: {warnings:?}"
        );
        let light_warnings = hub
            .status(&light.id)
            .map(|s| s.warnings)
            .unwrap_or_default();
        assert!(light_warnings.is_empty(), "{light_warnings:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn selectors_describe_themselves_and_parse_from_json() {
        let spec: SessionRequest =
            serde_json::from_str(r#"{"selector":{"pid":[12],"exe":"uvicorn"},"duration":"30s"}"#)
                .expect("json");
        assert_eq!(spec.duration, Some(Duration::from_secs(30)));
        assert_eq!(spec.profile_hz, DEFAULT_FREQUENCY_HZ);
        assert!(!spec.raw);
        assert_eq!(spec.selector.describe(), "--pid 12 --exe \"uvicorn\"");
        assert!(serde_json::from_str::<SessionRequest>(r#"{"selektor":{}}"#).is_err());
    }

    #[test]
    fn a_selected_scope_admits_its_process_and_children_only() {
        // the agent's own pid is never selected: use a child process
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn sleep");
        let pid = child.id();
        let (mut scope, initial) = Scope::new(Selector {
            pids: vec![pid],
            ..Selector::default()
        })
        .expect("scope");
        assert_eq!(initial, vec![pid]);
        let mut events = sse_exchange(1_000_000, 1, "/x");
        if let Event::Accept(c) = &mut events[0] {
            c.conn.pid = pid;
        }
        assert!(scope.admits(&events[0]));
        if let Event::Accept(c) = &mut events[0] {
            c.conn.pid = 1;
        }
        assert!(!scope.admits(&events[0]), "pid 1 is not selected");
        assert_eq!(parent_pid(Path::new(PROC), pid), Some(std::process::id()));
        let _ = child.kill();
        let _ = child.wait();
    }
}
