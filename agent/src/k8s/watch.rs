//! Keeps the pod index in step with the API server: a kube-rs watcher over
//! the pods of this node only (field selector `spec.nodeName=<node>`).
//!
//! The watcher lists, then watches from the list's resourceVersion, and
//! re-lists after a lost watch (410 Gone, API server restart) with
//! backoff. A re-list replaces the index whole, at `InitDone`, so pods
//! deleted while the watch was down do not linger.

use std::pin::pin;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, watcher, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};

use super::pods::PodMeta;
use super::Metadata;

/// The field selector that limits the watch to one node's pods.
fn field_selector(node: &str) -> String {
    format!("spec.nodeName={node}")
}

/// Runs until the task is dropped with the runtime. API errors are logged
/// once per outage (the watcher retries by itself); lookups meanwhile use
/// the last good index.
pub(super) async fn run(client: Client, node: String, metadata: Metadata) {
    let api: Api<Pod> = Api::all(client);
    let config = watcher::Config::default().fields(&field_selector(&node));
    let mut events = pin!(watcher(api, config).default_backoff());
    let mut relist: Option<Vec<PodMeta>> = None;
    let mut failing = false;
    while let Some(item) = events.next().await {
        match item {
            Ok(event) => {
                if failing {
                    tracing::info!("pod watch for node {node}: recovered");
                    failing = false;
                }
                apply(event, &mut relist, &metadata);
            }
            Err(err) if failing => tracing::debug!("pod watch for node {node}: {err}"),
            Err(err) => {
                tracing::warn!(
                    "pod watch for node {node} failed: {err}; retrying with backoff \
                     (the ServiceAccount needs list and watch on pods; spans keep the \
                     pod metadata already known)"
                );
                failing = true;
            }
        }
    }
}

/// Applies one watcher event. `relist` buffers a re-list between `Init`
/// and `InitDone`.
fn apply(event: Event<Pod>, relist: &mut Option<Vec<PodMeta>>, metadata: &Metadata) {
    match event {
        Event::Init => *relist = Some(Vec::new()),
        Event::InitApply(pod) => {
            if let (Some(buffer), Some(meta)) = (relist.as_mut(), PodMeta::from_pod(&pod)) {
                buffer.push(meta);
            }
        }
        Event::InitDone => {
            let pods = relist.take().unwrap_or_default();
            tracing::debug!("pod list: {} pod(s) on this node", pods.len());
            metadata.update(|index| index.replace_all(pods));
            metadata.mark_synced();
        }
        Event::Apply(pod) => {
            if let Some(meta) = PodMeta::from_pod(&pod) {
                metadata.update(|index| index.apply(meta));
            }
        }
        Event::Delete(pod) => {
            if let Some(uid) = pod.metadata.uid.as_deref() {
                metadata.update(|index| index.remove(uid));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The watcher against a stand-in API server that replays responses in
    //! the API server's wire format (`tests/fixtures/k8s/`: a `PodList` of a
    //! containerd node, then watch events: a container restart, a new Job
    //! pod, a deletion and a bookmark).

    use std::convert::Infallible;
    use std::path::PathBuf;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use bytes::Bytes;
    use futures_util::stream;
    use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
    use hyper::body::{Frame, Incoming};
    use hyper::{Request, Response};
    use hyper_util::rt::TokioIo;

    use super::*;

    const LIST: &str = include_str!("../../../tests/fixtures/k8s/pods-node-a.json");
    const WATCH: &str = include_str!("../../../tests/fixtures/k8s/pods-node-a-watch.jsonl");

    const VLLM_OLD: &str = "5d0c3b1e9a8f7e6d5c4b3a29180f7e6d5c4b3a29180f7e6d5c4b3a29180f7e6d";
    const VLLM_NEW: &str = "7e2a9c4f1b3d5e7f9a1c3e5f7b9d1f3a5c7e9b1d3f5a7c9e1b3d5f7a9c1e3b5d";
    const SGLANG: &str = "9b8a7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b";
    const JOB_UID: &str = "3c9e1f27-84b6-4d0a-a5e2-7f1b9c3d5e80";

    type Body = BoxBody<Bytes, Infallible>;

    /// Serves the list, then the recorded watch events on the first watch
    /// and an idle watch after that; records every request's target.
    async fn serve(listener: tokio::net::TcpListener, seen: Arc<Mutex<Vec<String>>>) {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let seen = Arc::clone(&seen);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let target = req.uri().to_string();
                    let watches = {
                        let mut seen = seen.lock().expect("lock");
                        seen.push(target.clone());
                        seen.iter().filter(|t| t.contains("watch=true")).count()
                    };
                    let body: Body = if !target.contains("watch=true") {
                        Full::new(Bytes::from_static(LIST.as_bytes())).boxed()
                    } else {
                        let events = if watches == 1 { WATCH } else { "" };
                        let frames = stream::iter(
                            events
                                .lines()
                                .filter(|l| !l.trim().is_empty())
                                .map(|l| Ok(Frame::data(Bytes::from(format!("{l}\n")))))
                                .collect::<Vec<_>>(),
                        )
                        .chain(stream::pending());
                        BodyExt::boxed(StreamBody::new(frames))
                    };
                    let mut response = Response::new(body);
                    response.headers_mut().insert(
                        hyper::header::CONTENT_TYPE,
                        hyper::header::HeaderValue::from_static("application/json"),
                    );
                    async move { Ok::<_, Infallible>(response) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    }

    fn proc_tree() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tokentrace-watch-{}", std::process::id()));
        let job_uid = JOB_UID.replace('-', "_");
        for (pid, cgroup) in [
            // the vLLM server after its container restarted, seen from a
            // private cgroup namespace: found by container id only
            (100, format!("0::/../cri-containerd-{VLLM_NEW}.scope\n")),
            (101, format!("0::/../cri-containerd-{SGLANG}.scope\n")),
            // a job pod whose container status is not reported yet
            (
                102,
                format!(
                    "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{job_uid}.slice/cri-containerd-{}.scope\n",
                    "c".repeat(64)
                ),
            ),
            (103, format!("0::/../cri-containerd-{VLLM_OLD}.scope\n")),
        ] {
            std::fs::create_dir_all(dir.join(pid.to_string())).expect("tmp dir");
            std::fs::write(dir.join(pid.to_string()).join("cgroup"), cgroup).expect("write");
        }
        dir
    }

    fn get(attrs: &[(String, String)], key: &str) -> Option<String> {
        attrs.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
    }

    async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while !check() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test]
    async fn replays_list_and_watch_of_this_nodes_pods() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let server = tokio::spawn(serve(listener, Arc::clone(&seen)));

        let url = format!("http://{addr}").parse().expect("url");
        let client = Client::try_from(kube::Config::new(url)).expect("client");
        let root = proc_tree();
        let metadata = Metadata::new(root.clone(), vec!["app".into()]);
        let watch = tokio::spawn(run(client, "node-a".into(), metadata.clone()));

        assert!(
            metadata.wait_synced(Duration::from_secs(20)).await,
            "the list fixture must sync the index"
        );
        // After the list (before or after the watch events, depending on
        // timing) the old vLLM container is known at least until MODIFIED.
        eventually("the watch events", || {
            metadata.pod_of_pid(100).is_some() && metadata.pod_of_pid(101).is_none()
        })
        .await;

        let vllm = metadata.attributes_for_pid(100);
        assert_eq!(get(&vllm, "container.id").as_deref(), Some(VLLM_NEW));
        assert_eq!(get(&vllm, "k8s.container.name").as_deref(), Some("vllm"));
        assert_eq!(
            get(&vllm, "k8s.pod.name").as_deref(),
            Some("vllm-6b8d9c7f4-7xq2m")
        );
        assert_eq!(
            get(&vllm, "k8s.namespace.name").as_deref(),
            Some("inference")
        );
        assert_eq!(get(&vllm, "k8s.node.name").as_deref(), Some("node-a"));
        assert_eq!(get(&vllm, "k8s.deployment.name").as_deref(), Some("vllm"));
        assert_eq!(get(&vllm, "k8s.pod.label.app").as_deref(), Some("vllm"));
        assert_eq!(get(&vllm, "service.name").as_deref(), Some("vllm"));

        let deleted = metadata.attributes_for_pid(101);
        assert_eq!(
            deleted,
            vec![("container.id".to_string(), SGLANG.to_string())],
            "DELETED removes the pod"
        );
        let job = metadata.attributes_for_pid(102);
        assert_eq!(get(&job, "k8s.job.name").as_deref(), Some("eval-28471234"));
        assert_eq!(get(&job, "k8s.namespace.name").as_deref(), Some("batch"));
        assert_eq!(
            get(&metadata.attributes_for_pid(103), "k8s.pod.name"),
            None,
            "the container id before the restart is forgotten"
        );
        let daemon = metadata.read_index().len();
        assert_eq!(daemon, 3, "vllm, the tokentrace agent and the job");

        let requests = seen.lock().expect("lock").clone();
        assert!(
            requests.iter().all(|t| t.starts_with("/api/v1/pods?")
                && t.contains("fieldSelector=spec.nodeName%3Dnode-a")),
            "every request is for this node's pods only: {requests:?}"
        );
        assert!(requests
            .iter()
            .any(|t| t.contains("watch=true") && t.contains("resourceVersion=52814")));
        watch.abort();
        server.abort();
        std::fs::remove_dir_all(&root).expect("cleanup");
    }

    #[test]
    fn relist_replaces_the_index_at_init_done() {
        let metadata = Metadata::new(PathBuf::from("/nonexistent"), Vec::new());
        let list: serde_json::Value = serde_json::from_str(LIST).expect("list fixture");
        let pods: Vec<Pod> =
            serde_json::from_value(list["items"].clone()).expect("pods in the list fixture");
        let mut relist = None;
        apply(Event::Apply(pods[0].clone()), &mut relist, &metadata);
        assert_eq!(metadata.read_index().len(), 1);
        apply(Event::Init, &mut relist, &metadata);
        for pod in &pods[1..] {
            apply(Event::InitApply(pod.clone()), &mut relist, &metadata);
        }
        assert_eq!(
            metadata.read_index().len(),
            1,
            "buffered until InitDone: lookups keep the old index meanwhile"
        );
        apply(Event::InitDone, &mut relist, &metadata);
        assert_eq!(
            metadata.read_index().len(),
            pods.len() - 1,
            "the pod missing from the re-list is gone"
        );
        apply(Event::Delete(pods[1].clone()), &mut relist, &metadata);
        assert_eq!(metadata.read_index().len(), pods.len() - 2);
    }
}
