//! Which processes the user asked for.

use regex::Regex;

use super::procfs::ProcessInfo;

/// The process selection given on the command line. Empty = automatic:
/// every process that serves an LLM-style endpoint.
#[derive(Debug, Clone, Default)]
pub struct Selector {
    pub pids: Vec<u32>,
    pub ports: Vec<u16>,
    /// Matched against the executable path and the command line.
    pub exe: Option<Regex>,
    /// Matched against the process name (comm).
    pub comm: Option<Regex>,
}

impl Selector {
    /// No explicit selection: discover servers by the endpoints they serve.
    pub fn is_automatic(&self) -> bool {
        self.pids.is_empty() && self.ports.is_empty() && self.exe.is_none() && self.comm.is_none()
    }

    /// Whether the process matches by pid, name or executable.
    pub fn matches_process(&self, info: &ProcessInfo) -> bool {
        self.pids.contains(&info.pid)
            || self.comm.as_ref().is_some_and(|re| re.is_match(&info.comm))
            || self
                .exe
                .as_ref()
                .is_some_and(|re| re.is_match(&info.exe) || re.is_match(&info.cmdline))
    }

    /// Whether listening on `port` selects a process.
    /// The first `--pid` that names no process under `proc_root`.
    pub fn missing_pid(&self, proc_root: &std::path::Path) -> Option<u32> {
        self.pids
            .iter()
            .copied()
            .find(|pid| !proc_root.join(pid.to_string()).is_dir())
    }

    pub fn matches_port(&self, port: u16) -> bool {
        self.ports.contains(&port)
    }
}

/// Recognises LLM-style request paths (prefix match on whole segments).
#[derive(Debug, Clone)]
pub struct EndpointMatcher {
    prefixes: Vec<String>,
}

impl EndpointMatcher {
    pub fn new(prefixes: &[String]) -> Self {
        Self {
            prefixes: prefixes
                .iter()
                .map(|p| p.trim_end_matches('/').to_string())
                .collect(),
        }
    }

    pub fn matches(&self, target: &str) -> bool {
        let path = target.split(['?', '#']).next().unwrap_or(target);
        self.prefixes.iter().any(|prefix| {
            path.strip_prefix(prefix.as_str())
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(pid: u32, comm: &str, exe: &str, cmdline: &str) -> ProcessInfo {
        ProcessInfo {
            pid,
            comm: comm.into(),
            exe: exe.into(),
            cmdline: cmdline.into(),
        }
    }

    #[test]
    fn selects_by_pid_comm_and_exe_or_cmdline() {
        let selector = Selector {
            pids: vec![7],
            comm: Some(Regex::new("^vllm").expect("regex")),
            exe: Some(Regex::new("uvicorn").expect("regex")),
            ..Selector::default()
        };
        assert!(!selector.is_automatic());
        assert!(selector.matches_process(&info(7, "x", "", "")));
        assert!(selector.matches_process(&info(8, "vllm-engine", "", "")));
        assert!(selector.matches_process(&info(
            9,
            "python3",
            "/usr/bin/python3.11",
            "python3 -m uvicorn app:app"
        )));
        assert!(!selector.matches_process(&info(
            10,
            "python3",
            "/usr/bin/python3.11",
            "python3 worker.py"
        )));
        assert!(Selector::default().is_automatic());
    }

    #[test]
    fn endpoints_match_whole_segments_and_ignore_queries() {
        let m = EndpointMatcher::new(&["/v1/chat/completions".into(), "/generate".into()]);
        assert!(m.matches("/v1/chat/completions"));
        assert!(m.matches("/v1/chat/completions?rid=1"));
        assert!(m.matches("/generate/"));
        assert!(!m.matches("/generated"));
        assert!(!m.matches("/health"));
    }

    #[test]
    fn a_pid_without_a_proc_entry_is_named() {
        let root = std::env::temp_dir().join(format!("tt-proc-{}", std::process::id()));
        std::fs::create_dir_all(root.join("42")).expect("fake /proc/42");
        let selector = Selector {
            pids: vec![42, 999_999],
            ports: Vec::new(),
            exe: None,
            comm: None,
        };
        assert_eq!(selector.missing_pid(&root), Some(999_999));
        let present = Selector {
            pids: vec![42],
            ..selector
        };
        assert_eq!(present.missing_pid(&root), None);
        let _ = std::fs::remove_dir_all(&root);
    }
}
