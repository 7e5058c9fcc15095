//! Pods as the agent keeps them, and the OTel resource attributes of a
//! process that runs in one.
//!
//! Attribute names follow the OpenTelemetry semantic conventions for
//! Kubernetes (`k8s.pod.name`, `k8s.deployment.name`, …) and containers
//! (`container.id`), so backends that join by them (Tempo, Jaeger, the
//! collector's `k8sattributes` processor) see the names they expect.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{ContainerStatus, Pod};

use super::cgroup::CgroupIds;

/// The label the Deployment controller puts on a ReplicaSet's pods; the
/// ReplicaSet's name is `<deployment>-<this hash>`.
const POD_TEMPLATE_HASH: &str = "pod-template-hash";
/// Pod annotation that names the service explicitly (the OpenTelemetry
/// Operator's convention), for workloads whose name is not the service.
const SERVICE_NAME_ANNOTATION: &str = "resource.opentelemetry.io/service.name";

/// The controller that owns a pod, as far as the pod itself tells.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Workload {
    /// A ReplicaSet created by a Deployment (it carries the pod-template
    /// hash); `deployment` is the ReplicaSet name without it.
    Deployment {
        replicaset: String,
        deployment: String,
    },
    /// A ReplicaSet made by hand, or one whose name does not end in the
    /// hash: no Deployment is claimed.
    ReplicaSet(String),
    StatefulSet(String),
    DaemonSet(String),
    Job(String),
}

impl Workload {
    /// The name `service.name` defaults to.
    pub fn name(&self) -> &str {
        match self {
            Workload::Deployment { deployment, .. } => deployment,
            Workload::ReplicaSet(n)
            | Workload::StatefulSet(n)
            | Workload::DaemonSet(n)
            | Workload::Job(n) => n,
        }
    }

    /// Derived from the controlling owner reference (Deployments are seen
    /// only through their ReplicaSet: stripping the pod-template hash
    /// avoids watching ReplicaSets, and the RBAC that would need).
    fn of_pod(pod: &Pod, labels: &BTreeMap<String, String>) -> Option<Self> {
        let owner = pod
            .metadata
            .owner_references
            .as_deref()?
            .iter()
            .find(|o| o.controller == Some(true))?;
        let name = owner.name.clone();
        Some(match owner.kind.as_str() {
            "ReplicaSet" => {
                let deployment = labels
                    .get(POD_TEMPLATE_HASH)
                    .filter(|hash| !hash.is_empty())
                    .and_then(|hash| name.strip_suffix(hash.as_str()))
                    .and_then(|rest| rest.strip_suffix('-'))
                    .filter(|d| !d.is_empty())
                    .map(str::to_string);
                match deployment {
                    Some(deployment) => Workload::Deployment {
                        replicaset: name,
                        deployment,
                    },
                    None => Workload::ReplicaSet(name),
                }
            }
            "StatefulSet" => Workload::StatefulSet(name),
            "DaemonSet" => Workload::DaemonSet(name),
            "Job" => Workload::Job(name),
            _ => return None,
        })
    }
}

/// What the agent keeps of one pod on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodMeta {
    pub name: String,
    pub namespace: String,
    pub uid: String,
    pub node: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub workload: Option<Workload>,
    /// `resource.opentelemetry.io/service.name`, when the pod sets it.
    pub service_name: Option<String>,
    /// Container id (no runtime scheme) → container name, for every
    /// container the status lists (init and ephemeral ones too).
    pub containers: HashMap<String, String>,
}

impl PodMeta {
    /// `None` for an object without name, namespace or uid (never sent by
    /// a real API server, but nothing from the network is trusted).
    pub fn from_pod(pod: &Pod) -> Option<Self> {
        let meta = &pod.metadata;
        let labels = meta.labels.clone().unwrap_or_default();
        let containers = pod
            .status
            .iter()
            .flat_map(|s| {
                [
                    &s.container_statuses,
                    &s.init_container_statuses,
                    &s.ephemeral_container_statuses,
                ]
            })
            .flat_map(|list| list.iter().flatten())
            .filter_map(container_entry)
            .collect();
        Some(Self {
            name: meta.name.clone().filter(|n| !n.is_empty())?,
            namespace: meta.namespace.clone().filter(|n| !n.is_empty())?,
            uid: meta.uid.clone().filter(|n| !n.is_empty())?,
            node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
            workload: Workload::of_pod(pod, &labels),
            service_name: meta
                .annotations
                .as_ref()
                .and_then(|a| a.get(SERVICE_NAME_ANNOTATION))
                .filter(|s| !s.trim().is_empty())
                .cloned(),
            labels,
            containers,
        })
    }

    /// Resource attributes of a process in this pod. `container_id` comes
    /// from the process's cgroup; `label_keys` are the pod labels the user
    /// asked to copy (as `k8s.pod.label.<key>`). The last entry is the
    /// default `service.name`: the annotation, else the workload, else the
    /// pod name.
    pub fn attributes(
        &self,
        container_id: Option<&str>,
        label_keys: &[String],
    ) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = Vec::with_capacity(12);
        let mut push = |k: &str, v: &str| out.push((k.to_string(), v.to_string()));
        if let Some(id) = container_id {
            push("container.id", id);
            if let Some(name) = self.containers.get(id) {
                push("k8s.container.name", name);
            }
        }
        push("k8s.pod.name", &self.name);
        push("k8s.pod.uid", &self.uid);
        push("k8s.namespace.name", &self.namespace);
        if let Some(node) = &self.node {
            push("k8s.node.name", node);
        }
        match &self.workload {
            Some(Workload::Deployment {
                replicaset,
                deployment,
            }) => {
                push("k8s.replicaset.name", replicaset);
                push("k8s.deployment.name", deployment);
            }
            Some(Workload::ReplicaSet(n)) => push("k8s.replicaset.name", n),
            Some(Workload::StatefulSet(n)) => push("k8s.statefulset.name", n),
            Some(Workload::DaemonSet(n)) => push("k8s.daemonset.name", n),
            Some(Workload::Job(n)) => push("k8s.job.name", n),
            None => {}
        }
        for key in label_keys {
            if let Some(value) = self.labels.get(key) {
                push(&format!("k8s.pod.label.{key}"), value);
            }
        }
        let service = self
            .service_name
            .as_deref()
            .or(self.workload.as_ref().map(Workload::name))
            .unwrap_or(&self.name);
        push("service.name", service);
        out
    }
}

/// `containerd://<id>` → (`<id>`, name). Waiting containers have no id.
fn container_entry(status: &ContainerStatus) -> Option<(String, String)> {
    let raw = status.container_id.as_deref()?;
    let id = raw.split_once("://").map_or(raw, |(_, id)| id);
    (!id.is_empty()).then(|| (id.to_string(), status.name.clone()))
}

/// This node's pods, by uid and by container id.
#[derive(Debug, Default)]
pub struct PodIndex {
    by_uid: HashMap<String, Arc<PodMeta>>,
    by_container: HashMap<String, String>,
}

impl PodIndex {
    /// Adds or replaces a pod (its old container ids are dropped: a
    /// restarted container has a new id).
    pub fn apply(&mut self, pod: PodMeta) {
        self.remove(&pod.uid);
        for id in pod.containers.keys() {
            self.by_container.insert(id.clone(), pod.uid.clone());
        }
        self.by_uid.insert(pod.uid.clone(), Arc::new(pod));
    }

    pub fn remove(&mut self, uid: &str) {
        if let Some(old) = self.by_uid.remove(uid) {
            for id in old.containers.keys() {
                if self.by_container.get(id).is_some_and(|u| u == uid) {
                    self.by_container.remove(id);
                }
            }
        }
    }

    /// Replaces everything (a full re-list after the watch was lost:
    /// pods deleted meanwhile must go).
    pub fn replace_all(&mut self, pods: Vec<PodMeta>) {
        *self = Self::default();
        for pod in pods {
            self.apply(pod);
        }
    }

    /// The pod of a process: by container id (unambiguous), else by the pod
    /// uid in its cgroup path (a container whose status the API has not
    /// reported yet, or a reader whose cgroup namespace hides the pod).
    pub fn lookup(&self, ids: &CgroupIds) -> Option<Arc<PodMeta>> {
        ids.container_id
            .as_ref()
            .and_then(|id| self.by_container.get(id))
            .or(ids.pod_uid.as_ref())
            .and_then(|uid| self.by_uid.get(uid))
            .cloned()
    }

    pub fn len(&self) -> usize {
        self.by_uid.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_uid.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pod as `kubectl get pod -o json` prints it (trimmed to the fields
    /// the agent reads, plus some it must ignore).
    fn pod(owner_kind: &str, owner: &str, labels: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "vllm-7d9f8b6c5d-x2k4p",
                "namespace": "inference",
                "uid": "8a1f0c2e-5b7d-4e3a-9f21-6c0d8e4b2a17",
                "labels": labels,
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Node", "name": "ignored-not-controller", "uid": "u0"},
                    {"apiVersion": "apps/v1", "kind": owner_kind, "name": owner,
                     "uid": "u1", "controller": true, "blockOwnerDeletion": true}
                ]
            },
            "spec": {"nodeName": "gpu-node-3", "containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.8.4"}]},
            "status": {
                "phase": "Running",
                "initContainerStatuses": [{"name": "fetch-model", "containerID": "containerd://1111111111111111111111111111111111111111111111111111111111111111",
                    "image": "x", "imageID": "y", "ready": false, "restartCount": 0}],
                "containerStatuses": [
                    {"name": "vllm", "containerID": "containerd://aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
                     "image": "x", "imageID": "y", "ready": true, "restartCount": 0},
                    {"name": "waiting-sidecar", "image": "x", "imageID": "", "ready": false, "restartCount": 0}
                ]
            }
        }))
        .expect("valid pod JSON")
    }

    const VLLM_ID: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

    fn get<'a>(attrs: &'a [(String, String)], key: &str) -> Option<&'a str> {
        attrs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn deployment_pod_gets_every_attribute_and_the_workload_as_service() {
        let p = pod(
            "ReplicaSet",
            "vllm-7d9f8b6c5d",
            serde_json::json!({"app": "vllm", "pod-template-hash": "7d9f8b6c5d", "team": "ml"}),
        );
        let meta = PodMeta::from_pod(&p).expect("complete pod");
        assert_eq!(meta.containers.len(), 2, "the waiting container has no id");
        let attrs = meta.attributes(Some(VLLM_ID), &["app".into(), "missing".into()]);
        let expect = [
            ("container.id", VLLM_ID),
            ("k8s.container.name", "vllm"),
            ("k8s.pod.name", "vllm-7d9f8b6c5d-x2k4p"),
            ("k8s.pod.uid", "8a1f0c2e-5b7d-4e3a-9f21-6c0d8e4b2a17"),
            ("k8s.namespace.name", "inference"),
            ("k8s.node.name", "gpu-node-3"),
            ("k8s.replicaset.name", "vllm-7d9f8b6c5d"),
            ("k8s.deployment.name", "vllm"),
            ("k8s.pod.label.app", "vllm"),
            ("service.name", "vllm"),
        ];
        let got: Vec<(&str, &str)> = attrs
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(got, expect);
        assert_eq!(
            get(&meta.attributes(None, &[]), "container.id"),
            None,
            "no cgroup id, no container attributes"
        );
    }

    #[test]
    fn other_owners_map_to_their_semconv_names() {
        for (kind, name, key) in [
            ("StatefulSet", "sglang", "k8s.statefulset.name"),
            ("DaemonSet", "node-llm", "k8s.daemonset.name"),
            ("Job", "batch-eval", "k8s.job.name"),
        ] {
            let meta = PodMeta::from_pod(&pod(kind, name, serde_json::json!({}))).expect("pod");
            let attrs = meta.attributes(None, &[]);
            assert_eq!(get(&attrs, key), Some(name), "{kind}");
            assert_eq!(get(&attrs, "service.name"), Some(name), "{kind}");
            assert_eq!(get(&attrs, "k8s.deployment.name"), None);
        }
    }

    #[test]
    fn replicasets_without_the_hash_claim_no_deployment() {
        for labels in [
            serde_json::json!({}),
            serde_json::json!({"pod-template-hash": "zzz"}),
            serde_json::json!({"pod-template-hash": ""}),
        ] {
            let meta = PodMeta::from_pod(&pod("ReplicaSet", "hand-made", labels)).expect("pod");
            assert_eq!(
                meta.workload,
                Some(Workload::ReplicaSet("hand-made".into()))
            );
            let attrs = meta.attributes(None, &[]);
            assert_eq!(get(&attrs, "k8s.deployment.name"), None);
            assert_eq!(get(&attrs, "service.name"), Some("hand-made"));
        }
        // The whole name being the hash leaves no deployment name.
        let meta = PodMeta::from_pod(&pod(
            "ReplicaSet",
            "-abc",
            serde_json::json!({"pod-template-hash": "abc"}),
        ))
        .expect("pod");
        assert_eq!(meta.workload, Some(Workload::ReplicaSet("-abc".into())));
    }

    #[test]
    fn bare_pods_annotation_and_incomplete_objects() {
        let mut p = pod("Node", "n", serde_json::json!({}));
        let meta = PodMeta::from_pod(&p).expect("pod");
        assert_eq!(meta.workload, None);
        assert_eq!(
            get(&meta.attributes(None, &[]), "service.name"),
            Some("vllm-7d9f8b6c5d-x2k4p"),
            "no controller: the pod name"
        );

        p.metadata.annotations = Some(BTreeMap::from([(
            SERVICE_NAME_ANNOTATION.to_string(),
            "chat-api".to_string(),
        )]));
        let meta = PodMeta::from_pod(&p).expect("pod");
        assert_eq!(
            get(&meta.attributes(None, &[]), "service.name"),
            Some("chat-api")
        );

        p.metadata.uid = None;
        assert_eq!(PodMeta::from_pod(&p), None);
    }

    #[test]
    fn index_finds_by_container_then_pod_uid_and_forgets_old_containers() {
        let meta =
            PodMeta::from_pod(&pod("StatefulSet", "sglang", serde_json::json!({}))).expect("pod");
        let uid = meta.uid.clone();
        let mut index = PodIndex::default();
        index.apply(meta.clone());
        assert_eq!(index.len(), 1);

        let by_id = CgroupIds {
            container_id: Some(VLLM_ID.into()),
            pod_uid: None,
        };
        assert_eq!(
            index.lookup(&by_id).map(|p| p.uid.clone()),
            Some(uid.clone())
        );
        let by_uid = CgroupIds {
            container_id: Some("f".repeat(64)),
            pod_uid: Some(uid.clone()),
        };
        assert!(index.lookup(&by_uid).is_some(), "new container, known pod");
        assert!(index.lookup(&CgroupIds::default()).is_none());

        // the container restarted: new id, the old one is forgotten
        let mut restarted = meta.clone();
        restarted.containers = HashMap::from([("b".repeat(64), "vllm".to_string())]);
        index.apply(restarted);
        assert!(index.lookup(&by_id).is_none());

        index.remove(&uid);
        assert!(index.is_empty());
        assert!(index.lookup(&by_uid).is_none());

        index.apply(meta.clone());
        index.replace_all(Vec::new());
        assert!(
            index.lookup(&by_id).is_none(),
            "re-list drops vanished pods"
        );
    }
}
