//! `--k8s-namespace` / `--k8s-selector`: which pods' processes may be
//! traced at all.
//!
//! A scope restricts; it does not pick. Inside it, processes are still
//! chosen by `--pid/--port/--exe/--comm`, or by automatic discovery when
//! none is given, so `--k8s-selector app=vllm` alone traces the LLM servers
//! of the vLLM pods and not their sidecars' health checks.

use std::collections::BTreeMap;
use std::fmt;

use super::Metadata;

/// One requirement of an equality-based label selector.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    Exists(String),
    NotExists(String),
}

/// A Kubernetes equality-based label selector (`app=vllm,tier!=canary,gpu`,
/// `!legacy`): every requirement must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector {
    requirements: Vec<Requirement>,
}

/// A selector string that is not an equality-based label selector.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--k8s-selector {selector:?}: {reason} (use key=value, key!=value, key or !key, joined by commas)")]
pub struct SelectorError {
    selector: String,
    reason: Reason,
}

/// What is wrong with one term of a selector.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum Reason {
    #[error("{0:?}: set-based requirements (in, notin) are not supported")]
    SetBased(String),
    #[error("{0:?} is not a label key")]
    Key(String),
    #[error("{0:?} is not a label value")]
    Value(String),
}

impl LabelSelector {
    pub fn parse(s: &str) -> Result<Self, SelectorError> {
        let err = |reason: Reason| SelectorError {
            selector: s.to_string(),
            reason,
        };
        let mut requirements = Vec::new();
        for term in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            if term.contains(['(', ')']) || term.split_whitespace().count() > 1 {
                return Err(err(Reason::SetBased(term.to_string())));
            }
            let requirement = if let Some((k, v)) = term.split_once("!=") {
                Requirement::NotEquals(key(k).map_err(&err)?, value(v).map_err(&err)?)
            } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                Requirement::Equals(key(k).map_err(&err)?, value(v).map_err(&err)?)
            } else if let Some(k) = term.strip_prefix('!') {
                Requirement::NotExists(key(k).map_err(&err)?)
            } else {
                Requirement::Exists(key(term).map_err(&err)?)
            };
            requirements.push(requirement);
        }
        Ok(Self { requirements })
    }

    pub fn is_empty(&self) -> bool {
        self.requirements.is_empty()
    }

    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.requirements.iter().all(|r| match r {
            Requirement::Equals(k, v) => labels.get(k) == Some(v),
            Requirement::NotEquals(k, v) => labels.get(k) != Some(v),
            Requirement::Exists(k) => labels.contains_key(k),
            Requirement::NotExists(k) => !labels.contains_key(k),
        })
    }
}

fn key(k: &str) -> Result<String, Reason> {
    let k = k.trim();
    let valid = !k.is_empty()
        && k.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'/'));
    if valid {
        Ok(k.to_string())
    } else {
        Err(Reason::Key(k.to_string()))
    }
}

fn value(v: &str) -> Result<String, Reason> {
    let v = v.trim();
    let valid = v
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if valid {
        Ok(v.to_string())
    } else {
        Err(Reason::Value(v.to_string()))
    }
}

impl fmt::Display for LabelSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let terms: Vec<String> = self
            .requirements
            .iter()
            .map(|r| match r {
                Requirement::Equals(k, v) => format!("{k}={v}"),
                Requirement::NotEquals(k, v) => format!("{k}!={v}"),
                Requirement::Exists(k) => k.clone(),
                Requirement::NotExists(k) => format!("!{k}"),
            })
            .collect();
        f.write_str(&terms.join(","))
    }
}

/// The namespaces and labels a traced process's pod must have.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodFilter {
    /// Empty: any namespace.
    pub namespaces: Vec<String>,
    pub labels: LabelSelector,
}

impl PodFilter {
    pub fn is_empty(&self) -> bool {
        self.namespaces.is_empty() && self.labels.is_empty()
    }

    pub fn matches(&self, namespace: &str, labels: &BTreeMap<String, String>) -> bool {
        (self.namespaces.is_empty() || self.namespaces.iter().any(|n| n == namespace))
            && self.labels.matches(labels)
    }
}

impl fmt::Display for PodFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ns = if self.namespaces.is_empty() {
            "any namespace".to_string()
        } else {
            format!("namespace {}", self.namespaces.join("|"))
        };
        if self.labels.is_empty() {
            f.write_str(&ns)
        } else {
            write!(f, "{ns}, labels {}", self.labels)
        }
    }
}

/// A [`PodFilter`] bound to the live pod index: what `discover::Selector`
/// asks about each candidate process.
#[derive(Clone)]
pub struct PodScope {
    filter: PodFilter,
    metadata: Metadata,
}

impl PodScope {
    pub fn new(filter: PodFilter, metadata: Metadata) -> Self {
        Self { filter, metadata }
    }

    /// Whether `pid` runs in a pod the filter accepts. A process in no
    /// known pod (a host process, or a pod the watch has not seen yet) is
    /// outside the scope.
    pub fn contains(&self, pid: u32) -> bool {
        self.metadata
            .pod_of_pid(pid)
            .is_some_and(|pod| self.filter.matches(&pod.namespace, &pod.labels))
    }
}

impl fmt::Debug for PodScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PodScope({})", self.filter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn equality_and_existence_requirements() {
        let s = LabelSelector::parse(" app=vllm , tier!=canary,gpu, !legacy,x==y").expect("valid");
        assert_eq!(s.to_string(), "app=vllm,tier!=canary,gpu,!legacy,x=y");
        let ok = labels(&[("app", "vllm"), ("gpu", ""), ("x", "y")]);
        assert!(s.matches(&ok));
        let mut canary = ok.clone();
        canary.insert("tier".into(), "canary".into());
        assert!(!s.matches(&canary));
        let mut legacy = ok.clone();
        legacy.insert("legacy".into(), "true".into());
        assert!(!s.matches(&legacy));
        assert!(
            !s.matches(&labels(&[("app", "vllm"), ("x", "y")])),
            "gpu must exist"
        );
        assert!(LabelSelector::parse("")
            .expect("empty")
            .matches(&labels(&[])));
        assert!(LabelSelector::parse("app.kubernetes.io/name=vllm").is_ok());
    }

    #[test]
    fn bad_selectors_name_the_flag_and_the_term() {
        for bad in ["app in (a,b)", "=v", "a=b c", "a=b/c", "k!"] {
            let err = LabelSelector::parse(bad).expect_err(bad).to_string();
            assert!(err.contains("--k8s-selector"), "{err}");
        }
    }

    #[test]
    fn tracker_traces_only_processes_in_scope() {
        use crate::discover::{Change, EndpointMatcher, Selector, Tracker};
        use crate::event::{Event, ListenEvent, ProcEvent};

        let uid = "8a1f0c2e-5b7d-4e3a-9f21-6c0d8e4b2a17";
        let dir = std::env::temp_dir().join(format!("tokentrace-scope-{}", std::process::id()));
        for (pid, cgroup) in [
            (
                10,
                format!("0::/kubepods/burstable/pod{uid}/{}\n", "a".repeat(64)),
            ),
            (11, "0::/system.slice/sshd.service\n".to_string()),
        ] {
            std::fs::create_dir_all(dir.join(pid.to_string())).expect("tmp dir");
            std::fs::write(dir.join(pid.to_string()).join("cgroup"), cgroup).expect("write");
        }
        let metadata = Metadata::for_tests(dir.clone());
        metadata.add_pod_for_tests(crate::k8s::PodMeta {
            name: "vllm-0".into(),
            namespace: "llm".into(),
            uid: uid.into(),
            node: None,
            labels: labels(&[("app", "vllm")]),
            workload: None,
            service_name: None,
            containers: Default::default(),
        });
        let scope = PodScope::new(
            PodFilter {
                namespaces: vec!["llm".into()],
                labels: LabelSelector::default(),
            },
            metadata,
        );
        let selector = Selector {
            comm: Some(regex::Regex::new("^python").expect("regex")),
            ports: vec![8000],
            ..Selector::default()
        };
        let mut tracker =
            Tracker::new(selector, EndpointMatcher::new(&[]), 1, 32).with_scope(Some(scope));
        let exec = |pid| {
            Event::Exec(ProcEvent {
                pid,
                ppid: 1,
                comm: "python3".into(),
                ts: 0,
                filename: "/usr/bin/python3".into(),
                exit_code: 0,
            })
        };
        let listen = |pid| {
            Event::Listen(ListenEvent {
                pid,
                comm: "python3".into(),
                ts: 0,
                port: 8000,
            })
        };
        // /proc/PID/comm is missing in the fake tree: the event's names count
        assert_eq!(tracker.on_event(&exec(10), &dir), Some(Change::Trace(10)));
        assert_eq!(tracker.on_event(&exec(11), &dir), None, "host process");
        assert_eq!(tracker.on_event(&listen(11), &dir), None, "host process");
        assert_eq!(tracker.on_event(&listen(12), &dir), None, "gone: no pod");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn filter_combines_namespaces_and_labels() {
        let f = PodFilter {
            namespaces: vec!["inference".into(), "staging".into()],
            labels: LabelSelector::parse("app=vllm").expect("valid"),
        };
        let vllm = labels(&[("app", "vllm")]);
        assert!(f.matches("inference", &vllm));
        assert!(f.matches("staging", &vllm));
        assert!(!f.matches("default", &vllm));
        assert!(!f.matches("inference", &labels(&[("app", "tgi")])));
        assert!(PodFilter::default().matches("any", &labels(&[])));
        assert_eq!(
            f.to_string(),
            "namespace inference|staging, labels app=vllm"
        );
    }
}
