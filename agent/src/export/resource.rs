//! OTLP resources: one per traced process, one for the agent itself.
//!
//! A span belongs to the process that served the request, not to the agent
//! that saw it, so each traced process gets its own resource: `service.name`,
//! `process.pid`, `process.executable.name`, `host.name`, plus the
//! user's `OTEL_RESOURCE_ATTRIBUTES` / `export.resource_attributes`, and
//! in a cluster `container.id` and the `k8s.*` attributes of its pod
//! (`crate::k8s`; the user's attributes win on a clash).
//!
//! `service.name` of a traced process, first match wins:
//! 1. `export.service_names` entry for its comm or executable name;
//! 2. `--service-name` / `export.service_name` / `OTEL_SERVICE_NAME` /
//!    `service.name` in `OTEL_RESOURCE_ATTRIBUTES` (one name for all);
//! 3. `OTEL_SERVICE_NAME` in the traced process's own environment, so the
//!    spans land next to the ones the server's SDK (if any) reports;
//! 4. in Kubernetes, its pod's workload (Deployment, StatefulSet, …) name;
//! 5. its comm (what `ps` shows; servers set it with setproctitle).
//!
//! Metrics use a per-service resource without `process.pid`: cumulative
//! series must survive restarts of the server process.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::resource::v1::Resource;

use super::attributes::{kv_int, kv_str};
use crate::k8s::Metadata;

/// `service.name` of the agent's own (self-)metrics.
pub const AGENT_SERVICE_NAME: &str = "tokentrace";
/// Processes remembered; past it the cache starts over (pids are reused,
/// and a long-running agent must not grow with every pid it ever saw).
const MAX_CACHED_PROCESSES: usize = 4096;
/// Most bytes of `/proc/PID/environ` read when looking for
/// `OTEL_SERVICE_NAME`.
const MAX_ENVIRON_BYTES: usize = 256 * 1024;

/// How resources are named: the user's settings plus the host name.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ResourceRules {
    /// One `service.name` for every traced process (rule 2 above).
    pub service_name: Option<String>,
    /// comm or executable name → `service.name` (rule 1).
    pub service_names: BTreeMap<String, String>,
    /// Added to every resource, traced processes' and the agent's.
    pub attributes: Vec<(String, String)>,
    pub host_name: String,
}

/// What the resource of one traced process is made of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessInfo {
    pub pid: u32,
    pub comm: String,
    /// File name of `/proc/PID/exe`, when readable.
    pub executable: Option<String>,
    /// `OTEL_SERVICE_NAME` from the process's environment, when set.
    pub env_service_name: Option<String>,
    /// `container.id`, `k8s.*` and a default `service.name` from
    /// `k8s::Metadata::attributes_for_pid`; outside a cluster only
    /// `container.id`, for a process in a container.
    pub kubernetes: Vec<(String, String)>,
}

impl ProcessInfo {
    /// Reads the executable and environment of `pid` under `proc_root`
    /// (`/proc`). A process that is gone, or unreadable, still gets a
    /// resource from its pid and comm.
    pub fn read(proc_root: &Path, pid: u32, comm: &str) -> Self {
        let dir = proc_root.join(pid.to_string());
        let executable = std::fs::read_link(dir.join("exe"))
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            // a replaced binary reads as "name (deleted)"
            .map(|n| n.trim_end_matches(" (deleted)").to_string());
        let env_service_name = read_bounded(&dir.join("environ"), MAX_ENVIRON_BYTES)
            .and_then(|raw| env_value(&raw, "OTEL_SERVICE_NAME"));
        Self {
            pid,
            comm: comm.to_string(),
            executable,
            env_service_name,
            kubernetes: Vec::new(),
        }
    }

    fn kubernetes_service_name(&self) -> Option<&String> {
        self.kubernetes
            .iter()
            .find(|(k, _)| k == "service.name")
            .map(|(_, v)| v)
    }
}

fn read_bounded(path: &Path, max: usize) -> Option<Vec<u8>> {
    use std::io::Read;
    let file = std::fs::File::open(path).ok()?;
    let mut buf = Vec::new();
    file.take(max as u64).read_to_end(&mut buf).ok()?;
    Some(buf)
}

/// The value of `key` in a NUL-separated environment block. Only this one
/// variable is ever looked at: the rest of a process's environment (tokens,
/// passwords) is never kept or logged.
fn env_value(environ: &[u8], key: &str) -> Option<String> {
    environ.split(|&b| b == 0).find_map(|entry| {
        let rest = entry.strip_prefix(key.as_bytes())?.strip_prefix(b"=")?;
        let value = std::str::from_utf8(rest).ok()?.trim();
        (!value.is_empty()).then(|| value.to_string())
    })
}

impl ResourceRules {
    /// `service.name` of a traced process (see the module doc for the order).
    pub fn service_name(&self, info: &ProcessInfo) -> String {
        let mapped = self.service_names.get(&info.comm).or_else(|| {
            info.executable
                .as_ref()
                .and_then(|e| self.service_names.get(e))
        });
        mapped
            .or(self.service_name.as_ref())
            .or(info.env_service_name.as_ref())
            .or(info.kubernetes_service_name())
            .cloned()
            .unwrap_or_else(|| info.comm.clone())
    }

    fn common(&self, service: String) -> Vec<KeyValue> {
        let mut attrs = vec![kv_str("service.name", service)];
        if !self.host_name.is_empty() {
            attrs.push(kv_str("host.name", self.host_name.clone()));
        }
        for (k, v) in &self.attributes {
            if k != "service.name" {
                attrs.push(kv_str(k, v.clone()));
            }
        }
        attrs
    }

    /// The resource of a traced process's spans.
    pub fn process_resource(&self, info: &ProcessInfo) -> Resource {
        let mut attrs = self.common(self.service_name(info));
        attrs.push(kv_int("process.pid", i64::from(info.pid)));
        if let Some(exe) = &info.executable {
            attrs.push(kv_str("process.executable.name", exe.clone()));
        }
        attrs.push(kv_str("process.command", info.comm.clone()));
        for (k, v) in &info.kubernetes {
            if !attrs.iter().any(|kv| &kv.key == k) {
                attrs.push(kv_str(k, v.clone()));
            }
        }
        Resource {
            attributes: attrs,
            ..Default::default()
        }
    }

    /// The resource of a service's metrics (no pid: see the module doc).
    pub fn service_resource(&self, service: &str) -> Resource {
        Resource {
            attributes: self.common(service.to_string()),
            ..Default::default()
        }
    }

    /// The resource of the agent's self-metrics.
    pub fn agent_resource(&self) -> Resource {
        let mut attrs = self.common(AGENT_SERVICE_NAME.to_string());
        attrs.push(kv_int("process.pid", i64::from(std::process::id())));
        attrs.push(kv_str("service.version", env!("CARGO_PKG_VERSION")));
        Resource {
            attributes: attrs,
            ..Default::default()
        }
    }
}

/// Process resources by pid, each built once. A pid whose comm changed
/// (exec, or pid reuse) is looked up again.
#[derive(Debug)]
pub struct ResourceCache {
    rules: ResourceRules,
    proc_root: PathBuf,
    kubernetes: Option<Metadata>,
    by_pid: HashMap<u32, Entry>,
}

#[derive(Debug)]
struct Entry {
    comm: String,
    /// The pod index generation this entry was built at, when the process's
    /// pod was not known then: a later generation may know it (the watch
    /// lags a new pod by a moment).
    podless_at: Option<u64>,
    process: CachedProcess,
}

/// A traced process's resource and the service it maps to.
#[derive(Debug, Clone)]
pub struct CachedProcess {
    pub service: String,
    /// Shared by every queued span batch of this process.
    pub resource: Arc<Resource>,
}

impl ResourceCache {
    pub fn new(rules: ResourceRules, proc_root: PathBuf) -> Self {
        Self {
            rules,
            proc_root,
            kubernetes: None,
            by_pid: HashMap::new(),
        }
    }

    /// Looks processes up in this pod index from now on.
    pub fn set_kubernetes(&mut self, metadata: Metadata) {
        self.kubernetes = Some(metadata);
        self.by_pid.clear();
    }

    pub fn get(&mut self, pid: u32, comm: &str) -> &CachedProcess {
        let generation = self.kubernetes.as_ref().map(Metadata::generation);
        let stale = self.by_pid.get(&pid).is_none_or(|e| {
            e.comm != comm || (e.podless_at.is_some() && e.podless_at != generation)
        });
        if stale {
            if self.by_pid.len() >= MAX_CACHED_PROCESSES {
                self.by_pid.clear();
            }
            let mut info = ProcessInfo::read(&self.proc_root, pid, comm);
            info.kubernetes = match &self.kubernetes {
                Some(k8s) => k8s.attributes_for_pid(pid),
                None => container_of(&self.proc_root, pid),
            };
            let has_pod = info.kubernetes.iter().any(|(k, _)| k == "k8s.pod.uid");
            let entry = Entry {
                comm: comm.to_string(),
                podless_at: generation.filter(|_| !has_pod),
                process: CachedProcess {
                    service: self.rules.service_name(&info),
                    resource: Arc::new(self.rules.process_resource(&info)),
                },
            };
            self.by_pid.insert(pid, entry);
        }
        &self.by_pid[&pid].process
    }
}

/// Outside a cluster a process in a container (Docker, podman, a bare
/// containerd) is still named by its container's id, from its cgroup.
fn container_of(proc_root: &Path, pid: u32) -> Vec<(String, String)> {
    crate::k8s::cgroup::read(proc_root, pid)
        .and_then(|ids| ids.container_id)
        .map(|id| vec![("container.id".to_string(), id)])
        .unwrap_or_default()
}

/// This host's name, for `host.name`.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use opentelemetry_proto::tonic::common::v1::any_value;

    use super::*;

    fn attr<'a>(r: &'a Resource, key: &str) -> Option<&'a any_value::Value> {
        r.attributes
            .iter()
            .find(|kv| kv.key == key)
            .and_then(|kv| kv.value.as_ref()?.value.as_ref())
    }

    fn info(comm: &str, exe: Option<&str>, env: Option<&str>) -> ProcessInfo {
        ProcessInfo {
            pid: 42,
            comm: comm.into(),
            executable: exe.map(Into::into),
            env_service_name: env.map(Into::into),
            kubernetes: Vec::new(),
        }
    }

    #[test]
    fn service_name_precedence() {
        let mut rules = ResourceRules {
            host_name: "h".into(),
            ..Default::default()
        };
        assert_eq!(
            rules.service_name(&info("python3", Some("python3.11"), None)),
            "python3"
        );
        assert_eq!(
            rules.service_name(&info("python3", None, Some("chat-api"))),
            "chat-api"
        );
        rules.service_name = Some("llm".into());
        assert_eq!(
            rules.service_name(&info("python3", None, Some("chat-api"))),
            "llm"
        );
        rules
            .service_names
            .insert("python3.11".into(), "vllm".into());
        assert_eq!(
            rules.service_name(&info("python3", Some("python3.11"), None)),
            "vllm"
        );
        rules
            .service_names
            .insert("python3".into(), "by-comm".into());
        assert_eq!(
            rules.service_name(&info("python3", Some("python3.11"), None)),
            "by-comm"
        );
    }

    #[test]
    fn process_resource_has_the_semconv_attributes() {
        let rules = ResourceRules {
            host_name: "node-1".into(),
            attributes: vec![
                ("deployment.environment".into(), "prod".into()),
                ("service.name".into(), "x".into()),
            ],
            ..Default::default()
        };
        let r = rules.process_resource(&info("uvicorn", Some("python3.11"), None));
        assert_eq!(
            attr(&r, "service.name"),
            Some(&any_value::Value::StringValue("uvicorn".into()))
        );
        assert_eq!(
            attr(&r, "process.pid"),
            Some(&any_value::Value::IntValue(42))
        );
        assert_eq!(
            attr(&r, "process.executable.name"),
            Some(&any_value::Value::StringValue("python3.11".into()))
        );
        assert_eq!(
            attr(&r, "host.name"),
            Some(&any_value::Value::StringValue("node-1".into()))
        );
        assert_eq!(
            attr(&r, "deployment.environment"),
            Some(&any_value::Value::StringValue("prod".into()))
        );
        let names = r
            .attributes
            .iter()
            .filter(|kv| kv.key == "service.name")
            .count();
        assert_eq!(
            names, 1,
            "service.name from the attribute list must not duplicate the key"
        );
        let m = rules.service_resource("uvicorn");
        assert_eq!(attr(&m, "process.pid"), None);
        let a = rules.agent_resource();
        assert_eq!(
            attr(&a, "service.name"),
            Some(&any_value::Value::StringValue("tokentrace".into()))
        );
    }

    #[test]
    fn reads_exe_and_only_otel_service_name_from_proc() {
        let dir = std::env::temp_dir().join(format!("tokentrace-proc-{}", std::process::id()));
        let pdir = dir.join("77");
        std::fs::create_dir_all(&pdir).expect("tmp dir");
        std::fs::write(
            pdir.join("environ"),
            b"SECRET=x\0OTEL_SERVICE_NAME=chat-api\0HOME=/\0",
        )
        .expect("write");
        let _ = std::fs::remove_file(pdir.join("exe"));
        std::os::unix::fs::symlink("/usr/bin/python3.11", pdir.join("exe")).expect("symlink");
        let got = ProcessInfo::read(&dir, 77, "python3");
        assert_eq!(got.executable.as_deref(), Some("python3.11"));
        assert_eq!(got.env_service_name.as_deref(), Some("chat-api"));
        let gone = ProcessInfo::read(&dir, 78, "python3");
        assert_eq!(gone, info("python3", None, None).with_pid(78));

        let mut cache = ResourceCache::new(ResourceRules::default(), dir.clone());
        assert_eq!(cache.get(77, "python3").service, "chat-api");
        std::fs::write(pdir.join("environ"), b"OTEL_SERVICE_NAME=renamed\0").expect("write");
        assert_eq!(
            cache.get(77, "python3").service,
            "chat-api",
            "cached while comm is unchanged"
        );
        assert_eq!(
            cache.get(77, "vllm").service,
            "renamed",
            "a new comm is looked up again"
        );
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    impl ProcessInfo {
        fn with_pid(mut self, pid: u32) -> Self {
            self.pid = pid;
            self
        }
    }

    #[test]
    fn outside_a_cluster_a_containers_process_carries_its_container_id() {
        let dir =
            std::env::temp_dir().join(format!("tokentrace-podman-res-{}", std::process::id()));
        let id = "12f7b361cb783a201bb63543718fb0485e265491013a28468208e01774cc404d";
        for (pid, cgroup) in [
            // podman with the cgroupfs manager on a hybrid host
            (60, format!("9:name=systemd:/libpod_parent/libpod-{id}\n8:pids:/libpod_parent/libpod-{id}\n")),
            // a process on the host
            (61, "0::/user.slice/user-0.slice/session-1.scope\n".to_string()),
        ] {
            std::fs::create_dir_all(dir.join(pid.to_string())).expect("tmp dir");
            std::fs::write(dir.join(format!("{pid}/cgroup")), cgroup).expect("write");
        }
        let mut cache = ResourceCache::new(ResourceRules::default(), dir.clone());
        let container = Arc::clone(&cache.get(60, "python3").resource);
        assert_eq!(
            attr(&container, "container.id"),
            Some(&any_value::Value::StringValue(id.into()))
        );
        let host = Arc::clone(&cache.get(61, "python3").resource);
        assert_eq!(attr(&host, "container.id"), None);
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn kubernetes_attributes_and_workload_service_name() {
        let dir = std::env::temp_dir().join(format!("tokentrace-k8s-res-{}", std::process::id()));
        let uid = "8a1f0c2e-5b7d-4e3a-9f21-6c0d8e4b2a17";
        let id = "a".repeat(64);
        std::fs::create_dir_all(dir.join("50")).expect("tmp dir");
        std::fs::write(
            dir.join("50/cgroup"),
            format!("0::/kubepods/burstable/pod{uid}/{id}\n"),
        )
        .expect("write");
        let metadata = Metadata::for_tests(dir.clone());
        let rules = ResourceRules {
            attributes: vec![("k8s.namespace.name".into(), "from-user".into())],
            ..Default::default()
        };
        let mut cache = ResourceCache::new(rules.clone(), dir.clone());
        cache.set_kubernetes(metadata.clone());
        let before = Arc::clone(&cache.get(50, "python3").resource);
        assert_eq!(cache.get(50, "python3").service, "python3");
        assert_eq!(
            attr(&before, "container.id"),
            Some(&any_value::Value::StringValue(id.clone())),
            "container known before its pod"
        );

        metadata.add_pod_for_tests(crate::k8s::PodMeta {
            name: "vllm-6b8d9c7f4-7xq2m".into(),
            namespace: "inference".into(),
            uid: uid.into(),
            node: Some("node-a".into()),
            labels: Default::default(),
            workload: Some(crate::k8s::Workload::Deployment {
                replicaset: "vllm-6b8d9c7f4".into(),
                deployment: "vllm".into(),
            }),
            service_name: None,
            containers: Default::default(),
        });
        let after = cache.get(50, "python3").clone();
        assert_eq!(
            after.service, "vllm",
            "looked up again once the pod is known"
        );
        let r = &after.resource;
        assert_eq!(
            attr(r, "k8s.deployment.name"),
            Some(&any_value::Value::StringValue("vllm".into()))
        );
        assert_eq!(
            attr(r, "k8s.namespace.name"),
            Some(&any_value::Value::StringValue("from-user".into())),
            "the user's attributes win"
        );
        assert_eq!(
            r.attributes
                .iter()
                .filter(|kv| kv.key == "service.name")
                .count(),
            1
        );

        // the process's own OTEL_SERVICE_NAME beats the workload
        let mut own = info("python3", None, Some("chat-api"));
        own.kubernetes = vec![("service.name".into(), "vllm".into())];
        assert_eq!(rules.service_name(&own), "chat-api");
        own.env_service_name = None;
        assert_eq!(rules.service_name(&own), "vllm");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
