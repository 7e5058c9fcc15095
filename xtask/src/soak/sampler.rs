//! Once a second: the current agent's RSS and export counters (from its
//! Prometheus endpoint), and the host's load — the soak shares its machine,
//! and the report says how busy it was: the 1-minute load average and
//! whether someone held the root-tests lock (another agent loading BPF,
//! other root tests running).

use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::agent::{rss_kib, scrape};
use tokentrace_testkit::otel::prom_sum;

/// The lock the project's developers hold around root test runs.
const ROOT_TESTS_LOCK: &str = "/tmp/tokentrace-root-tests.lock";

/// Which agent to sample: its label in the report, pid, metrics port.
#[derive(Clone, Copy)]
pub struct Target {
    pub tag: &'static str,
    pub pid: u32,
    pub metrics_port: u16,
}

#[derive(Clone, Debug)]
pub struct Sample {
    pub t: f64,
    pub tag: &'static str,
    pub rss_kib: Option<u64>,
    /// CPU time the agent has used, ns (its process CPU clock).
    pub cpu_ns: Option<u64>,
    /// None when the metrics endpoint did not answer.
    pub queue_len: Option<f64>,
    pub queue_cap: Option<f64>,
    pub exported: f64,
    pub dropped_full: f64,
    pub dropped_failed: f64,
    pub lost_kernel: f64,
    pub lost_agent: f64,
    pub load1: Option<f64>,
    pub lock_held: bool,
}

pub struct Sampler {
    pub target: Arc<Mutex<Option<Target>>>,
    stop: Arc<AtomicBool>,
    handle: JoinHandle<Vec<Sample>>,
}

impl Sampler {
    pub fn start(t0: Instant) -> Sampler {
        let target: Arc<Mutex<Option<Target>>> = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let handle = {
            let target = Arc::clone(&target);
            let stop = Arc::clone(&stop);
            thread::spawn(move || {
                let mut samples = Vec::new();
                let mut next = Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    let current = target.lock().ok().and_then(|t| *t);
                    if let Some(tg) = current {
                        samples.push(sample(t0, tg));
                    }
                    next += Duration::from_secs(1);
                    if let Some(wait) = next.checked_duration_since(Instant::now()) {
                        thread::sleep(wait);
                    }
                }
                samples
            })
        };
        Sampler {
            target,
            stop,
            handle,
        }
    }

    pub fn set(&self, target: Option<Target>) {
        if let Ok(mut t) = self.target.lock() {
            *t = target;
        }
    }

    pub fn stop(self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.join().unwrap_or_default()
    }
}

fn sample(t0: Instant, tg: Target) -> Sample {
    let rss = rss_kib(tg.pid);
    let text = scrape(tg.metrics_port);
    let get = |name: &str, with: &[&str]| text.as_deref().map(|t| prom_sum(t, name, with));
    Sample {
        t: t0.elapsed().as_secs_f64(),
        tag: tg.tag,
        rss_kib: rss,
        cpu_ns: crate::util::cpu_ns(tg.pid).ok(),
        queue_len: get("tokentrace_export_queue_length", &[]),
        queue_cap: get("tokentrace_export_queue_capacity", &[]),
        exported: get("tokentrace_spans_exported_total", &[]).unwrap_or(0.0),
        dropped_full: get("tokentrace_spans_dropped_total", &["reason=\"queue_full\""])
            .unwrap_or(0.0),
        dropped_failed: get(
            "tokentrace_spans_dropped_total",
            &["reason=\"export_failed\""],
        )
        .unwrap_or(0.0),
        lost_kernel: get("tokentrace_events_lost_total", &["where=\"kernel\""]).unwrap_or(0.0),
        lost_agent: get("tokentrace_events_lost_total", &["where=\"agent\""]).unwrap_or(0.0),
        load1: load1(),
        lock_held: lock_held(),
    }
}

fn load1() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Whether anyone holds the root-tests lock (an entry for its inode in
/// /proc/locks). Read only: taking the lock, even briefly, would delay them.
fn lock_held() -> bool {
    let Ok(meta) = std::fs::metadata(ROOT_TESTS_LOCK) else {
        return false;
    };
    let suffix = format!(":{}", meta.ino());
    std::fs::read_to_string("/proc/locks").is_ok_and(|locks| {
        locks
            .lines()
            .filter_map(|l| l.split_whitespace().nth(5))
            .any(|dev_ino| dev_ino.ends_with(&suffix))
    })
}
