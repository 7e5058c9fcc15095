//! Kubernetes metadata: which container, pod and workload a traced process
//! belongs to, for span resources and for `--k8s-namespace` /
//! `--k8s-selector` scopes.
//!
//! pid → `/proc/PID/cgroup` → container id and pod uid ([`cgroup`]) → the
//! pod, from an in-memory index of this node's pods ([`pods`]) that a
//! kube-rs watcher keeps current ([`watch`], field selector
//! `spec.nodeName=$NODE_NAME`: an agent on a 100-pod node never holds the
//! cluster's other pods, and the API server filters for it).
//!
//! Outside a cluster (no `KUBERNETES_SERVICE_HOST`, or no service-account
//! token) all of this is off without a word: lookups return nothing. Only an
//! explicit `--k8s-namespace`/`--k8s-selector` there is an error.

pub mod cgroup;
pub mod pods;
mod scope;
mod watch;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use serde::Deserialize;

pub use pods::{PodIndex, PodMeta, Workload};
pub use scope::{LabelSelector, PodFilter, PodScope, SelectorError};

/// Where the kubelet mounts the pod's service-account token.
const SERVICE_ACCOUNT_TOKEN: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";
/// The DaemonSet passes the node name through the downward API in this
/// variable (`fieldRef: spec.nodeName`).
const NODE_NAME_ENV: &str = "NODE_NAME";
/// How long a scoped run waits for the first list of this node's pods
/// before giving up (it could select nothing without it).
const SCOPE_SYNC_TIMEOUT: Duration = Duration::from_secs(60);

/// `kubernetes:` in the YAML config.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesConfig {
    /// Trace only processes in pods of these namespaces (`--k8s-namespace`).
    pub namespaces: Vec<String>,
    /// Trace only processes in pods whose labels match this selector
    /// (`--k8s-selector`), e.g. `app=vllm`.
    pub selector: Option<String>,
    /// Pod labels copied onto resources as `k8s.pod.label.<key>`. Empty by
    /// default: every label would be a new series dimension in backends.
    pub pod_labels: Vec<String>,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        crate::defaults::section("kubernetes")
    }
}

/// Kubernetes flags of `tokentrace run`; they replace the config's values.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct K8sArgs {
    /// Trace only processes in pods of this namespace (repeatable, or comma-separated).
    #[arg(
        long = "k8s-namespace",
        env = "TOKENTRACE_K8S_NAMESPACE",
        value_delimiter = ','
    )]
    pub namespaces: Vec<String>,

    /// Trace only processes in pods whose labels match, e.g. app=vllm,tier!=canary.
    #[arg(long = "k8s-selector", env = "TOKENTRACE_K8S_SELECTOR")]
    pub selector: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum K8sError {
    #[error(transparent)]
    Selector(#[from] SelectorError),
    #[error(
        "{flag} needs the Kubernetes API, but tokentrace is not running in a pod with a \
         service account (no KUBERNETES_SERVICE_HOST or no {SERVICE_ACCOUNT_TOKEN}); \
         deploy it with deploy/helm/tokentrace or deploy/kubernetes, or drop the flag"
    )]
    NotInCluster { flag: &'static str },
    #[error(
        "{flag} needs this node's name: set {NODE_NAME_ENV} from the downward API \
         (env: valueFrom: fieldRef: fieldPath: spec.nodeName), as deploy/ does"
    )]
    NoNodeName { flag: &'static str },
    #[error("Kubernetes API client: {0}")]
    Client(String),
    #[error(
        "no list of node {node}'s pods within {timeout:?} (check the log for API errors; \
         the ServiceAccount needs list and watch on pods), so {filter} selects nothing"
    )]
    NotSynced {
        node: String,
        timeout: Duration,
        filter: PodFilter,
    },
}

/// The pod index and how processes are looked up in it. Cheap to clone:
/// the exporter's resource cache and the selector's scope share one.
#[derive(Clone)]
pub struct Metadata {
    shared: Arc<Shared>,
}

struct Shared {
    index: RwLock<PodIndex>,
    /// Bumped on every index change, so caches of "no pod yet" answers
    /// know when asking again can give another answer.
    generation: AtomicU64,
    synced: tokio::sync::watch::Sender<bool>,
    proc_root: PathBuf,
    label_keys: Vec<String>,
}

impl Metadata {
    fn new(proc_root: PathBuf, label_keys: Vec<String>) -> Self {
        Self {
            shared: Arc::new(Shared {
                index: RwLock::new(PodIndex::default()),
                generation: AtomicU64::new(0),
                synced: tokio::sync::watch::Sender::new(false),
                proc_root,
                label_keys,
            }),
        }
    }

    /// The pod `pid` runs in, if the index knows it.
    pub fn pod_of_pid(&self, pid: u32) -> Option<Arc<PodMeta>> {
        let ids = cgroup::read(&self.shared.proc_root, pid)?;
        self.read_index().lookup(&ids)
    }

    /// Resource attributes of `pid`: `container.id`, `k8s.*` and a default
    /// `service.name` (the workload's name) when its pod is known; only
    /// `container.id` for a container of no known pod; nothing for a host
    /// process.
    pub fn attributes_for_pid(&self, pid: u32) -> Vec<(String, String)> {
        let Some(ids) = cgroup::read(&self.shared.proc_root, pid) else {
            return Vec::new();
        };
        match self.read_index().lookup(&ids) {
            Some(pod) => pod.attributes(ids.container_id.as_deref(), &self.shared.label_keys),
            None => ids
                .container_id
                .map(|id| vec![("container.id".to_string(), id)])
                .unwrap_or_default(),
        }
    }

    /// Changes with every update of the index.
    pub fn generation(&self) -> u64 {
        self.shared.generation.load(Ordering::Acquire)
    }

    /// Waits until the first complete list of this node's pods is in, for
    /// at most `timeout`. Whether it is.
    pub async fn wait_synced(&self, timeout: Duration) -> bool {
        let mut rx = self.shared.synced.subscribe();
        let synced = tokio::time::timeout(timeout, rx.wait_for(|synced| *synced)).await;
        matches!(synced, Ok(Ok(_)))
    }

    fn read_index(&self) -> std::sync::RwLockReadGuard<'_, PodIndex> {
        self.shared
            .index
            .read()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn update(&self, change: impl FnOnce(&mut PodIndex)) {
        change(
            &mut self
                .shared
                .index
                .write()
                .unwrap_or_else(PoisonError::into_inner),
        );
        self.shared.generation.fetch_add(1, Ordering::AcqRel);
    }

    fn mark_synced(&self) {
        self.shared.synced.send_replace(true);
    }
}

impl std::fmt::Debug for Metadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metadata")
            .field("pods", &self.read_index().len())
            .field("generation", &self.generation())
            .finish()
    }
}

#[cfg(test)]
impl Metadata {
    /// A handle over a fake `/proc` with an index the test fills, for
    /// tests of the modules that consume metadata.
    pub(crate) fn for_tests(proc_root: PathBuf) -> Self {
        Self::new(proc_root, Vec::new())
    }

    pub(crate) fn add_pod_for_tests(&self, pod: PodMeta) {
        self.update(|index| index.apply(pod));
    }
}

/// What [`start`] set up.
#[derive(Default)]
pub struct Kubernetes {
    /// `None` outside a cluster.
    pub metadata: Option<Metadata>,
    /// `None` unless namespaces or a label selector were given.
    pub scope: Option<PodScope>,
}

/// Where the agent runs, as far as starting the watcher is concerned.
struct Environment {
    in_cluster: bool,
    node_name: Option<String>,
}

impl Environment {
    fn detect() -> Self {
        Self {
            in_cluster: std::env::var_os("KUBERNETES_SERVICE_HOST").is_some()
                && Path::new(SERVICE_ACCOUNT_TOKEN).is_file(),
            node_name: std::env::var(NODE_NAME_ENV)
                .ok()
                .filter(|n| !n.trim().is_empty()),
        }
    }
}

/// The pod filter that flags and config ask for (flags replace the
/// config's value of the same setting).
pub fn pod_filter(config: &KubernetesConfig, args: &K8sArgs) -> Result<PodFilter, K8sError> {
    let namespaces = if args.namespaces.is_empty() {
        &config.namespaces
    } else {
        &args.namespaces
    };
    let selector = args.selector.as_ref().or(config.selector.as_ref());
    Ok(PodFilter {
        namespaces: namespaces
            .iter()
            .map(|n| n.trim().to_string())
            .filter(|n| !n.is_empty())
            .collect(),
        labels: selector
            .map(|s| LabelSelector::parse(s))
            .transpose()?
            .unwrap_or_default(),
    })
}

/// Starts pod metadata when running in a cluster (spawning the watcher on
/// the current tokio runtime) and builds the pod scope, if one was asked
/// for. A scope waits for the first list of pods, so that the initial
/// process scan sees them.
pub async fn start(config: &KubernetesConfig, args: &K8sArgs) -> Result<Kubernetes, K8sError> {
    let filter = pod_filter(config, args)?;
    let flag = if filter.namespaces.is_empty() {
        "--k8s-selector"
    } else {
        "--k8s-namespace"
    };
    let env = Environment::detect();
    if !env.in_cluster {
        if !filter.is_empty() {
            return Err(K8sError::NotInCluster { flag });
        }
        tracing::debug!("not in a Kubernetes pod: no pod metadata");
        return Ok(Kubernetes::default());
    }
    let Some(node) = env.node_name else {
        if !filter.is_empty() {
            return Err(K8sError::NoNodeName { flag });
        }
        tracing::warn!(
            "running in Kubernetes but {NODE_NAME_ENV} is not set: spans get no pod metadata \
             (set it from the downward API, fieldPath spec.nodeName)"
        );
        return Ok(Kubernetes::default());
    };
    let client = kube::Client::try_default()
        .await
        .map_err(|e| K8sError::Client(e.to_string()))?;
    let metadata = Metadata::new(PathBuf::from("/proc"), config.pod_labels.clone());
    tokio::spawn(watch::run(client, node.clone(), metadata.clone()));
    tracing::info!("watching the pods of node {node} for span metadata");

    let scope = if filter.is_empty() {
        None
    } else {
        if !metadata.wait_synced(SCOPE_SYNC_TIMEOUT).await {
            return Err(K8sError::NotSynced {
                node,
                timeout: SCOPE_SYNC_TIMEOUT,
                filter,
            });
        }
        tracing::info!("tracing only processes in pods of {filter}");
        Some(PodScope::new(filter, metadata.clone()))
    };
    Ok(Kubernetes {
        metadata: Some(metadata),
        scope,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

    fn proc_tree(name: &str, cgroups: &[(u32, String)]) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("tokentrace-k8s-{name}-{}", std::process::id()));
        for (pid, text) in cgroups {
            std::fs::create_dir_all(dir.join(pid.to_string())).expect("tmp dir");
            std::fs::write(dir.join(pid.to_string()).join("cgroup"), text).expect("write");
        }
        dir
    }

    #[test]
    fn flags_replace_config_and_bad_selectors_fail() {
        let config = KubernetesConfig {
            namespaces: vec!["from-file".into()],
            selector: Some("app=file".into()),
            pod_labels: Vec::new(),
        };
        let f = pod_filter(&config, &K8sArgs::default()).expect("valid");
        assert_eq!(f.to_string(), "namespace from-file, labels app=file");
        let args = K8sArgs {
            namespaces: vec!["a".into(), " ".into()],
            selector: Some("app=vllm".into()),
        };
        let f = pod_filter(&config, &args).expect("valid");
        assert_eq!(f.to_string(), "namespace a, labels app=vllm");
        let bad = K8sArgs {
            selector: Some("app in (x)".into()),
            ..K8sArgs::default()
        };
        assert!(matches!(
            pod_filter(&config, &bad),
            Err(K8sError::Selector(_))
        ));
        let parse = |yaml| crate::defaults::section_with::<KubernetesConfig>("kubernetes", yaml);
        let parsed = parse("namespaces: [llm]\npod_labels: [app]\n").expect("yaml");
        assert_eq!(parsed.namespaces, vec!["llm".to_string()]);
        assert!(parse("namespace: [x]\n").is_err());
    }

    #[tokio::test]
    async fn outside_a_cluster_nothing_starts_and_a_scope_is_an_error() {
        // The test environment is not a pod (CI runs on a plain machine).
        if Environment::detect().in_cluster {
            panic!("this test must not run inside a Kubernetes pod");
        }
        let none = start(&KubernetesConfig::default(), &K8sArgs::default())
            .await
            .expect("silently off");
        assert!(none.metadata.is_none() && none.scope.is_none());
        let scoped = K8sArgs {
            namespaces: vec!["llm".into()],
            ..K8sArgs::default()
        };
        let err = start(&KubernetesConfig::default(), &scoped)
            .await
            .err()
            .expect("a scope needs the API");
        assert!(err.to_string().contains("--k8s-namespace"), "{err}");
    }

    #[tokio::test]
    async fn attributes_and_scope_follow_the_index() {
        let uid = "8a1f0c2e-5b7d-4e3a-9f21-6c0d8e4b2a17";
        let root = proc_tree(
            "attrs",
            &[
                (10, format!("0::/kubepods/burstable/pod{uid}/{ID}\n")),
                (
                    11,
                    format!("0::/system.slice/docker-{}.scope\n", "b".repeat(64)),
                ),
                (12, "0::/system.slice/sshd.service\n".to_string()),
            ],
        );
        let metadata = Metadata::new(root.clone(), vec!["app".into()]);
        assert!(!metadata.wait_synced(Duration::from_millis(1)).await);
        assert_eq!(
            metadata.attributes_for_pid(10),
            vec![("container.id".to_string(), ID.to_string())],
            "before the pod is known: the container only"
        );
        let before = metadata.generation();
        metadata.update(|index| {
            index.apply(PodMeta {
                name: "vllm-0".into(),
                namespace: "llm".into(),
                uid: uid.into(),
                node: Some("n1".into()),
                labels: [("app".to_string(), "vllm".to_string())].into(),
                workload: Some(Workload::StatefulSet("vllm".into())),
                service_name: None,
                containers: [(ID.to_string(), "server".to_string())].into(),
            })
        });
        metadata.mark_synced();
        assert!(metadata.wait_synced(Duration::from_millis(1)).await);
        assert!(metadata.generation() > before);
        let attrs = metadata.attributes_for_pid(10);
        assert!(attrs.contains(&("k8s.statefulset.name".into(), "vllm".into())));
        assert!(attrs.contains(&("k8s.pod.label.app".into(), "vllm".into())));
        assert!(attrs.contains(&("k8s.container.name".into(), "server".into())));
        assert_eq!(
            metadata.attributes_for_pid(11).len(),
            1,
            "container.id only"
        );
        assert!(metadata.attributes_for_pid(12).is_empty(), "host process");
        assert!(metadata.attributes_for_pid(13).is_empty(), "gone");

        let scope = |ns: &[&str], sel: &str| {
            PodScope::new(
                PodFilter {
                    namespaces: ns.iter().map(|s| s.to_string()).collect(),
                    labels: LabelSelector::parse(sel).expect("selector"),
                },
                metadata.clone(),
            )
        };
        assert!(scope(&["llm"], "").contains(10));
        assert!(scope(&[], "app=vllm").contains(10));
        assert!(!scope(&["other"], "").contains(10));
        assert!(!scope(&[], "app=tgi").contains(10));
        assert!(!scope(&[], "").contains(11), "no pod: outside any scope");
        std::fs::remove_dir_all(&root).expect("cleanup");
    }
}
