//! `cargo xtask image`: the agent's container image, built from
//! deploy/Dockerfile by podman the way users build it with `docker build -f
//! deploy/Dockerfile .` (the same file), and kept in podman's local store
//! as `localhost/tokentrace:<version>`. Its last line names the image, its
//! size and how long the build took.
//!
//! No image registry is reachable here, so the Dockerfile's two bases are
//! made locally when podman does not have them yet, under the names the
//! Dockerfile asks for:
//!
//! - `debian:bookworm-slim`: `mmdebstrap --variant=minbase bookworm`,
//!   slimmed as Docker's own (no docs, manuals or translations; apt keeps
//!   no caches);
//! - `rust:1.95-bookworm`: the same with gcc, binutils, make and
//!   ca-certificates, this machine's Rust toolchain (`rustc --print
//!   sysroot`: bin, lib, libexec) in /usr/local/rust, `CARGO_HOME`
//!   /usr/local/cargo as in the official image, and this machine's CA
//!   bundle (its egress may go through a proxy with a CA of its own). A stand-in for the official
//!   image, which adds nothing the Dockerfile uses beyond these.
//!
//! podman runs with runc (crun refuses this machine's hybrid cgroup
//! layout), the build's containers with ulimits at or under the current
//! ones (no CAP_SYS_RESOURCE here) and the host's network (crates.io and
//! Debian's mirror, for `cargo build` and `apt-get` inside the build).
//!
//! The debug info split off the binary (`debug-symbols` stage) is exported
//! to target/image/tokentrace.debug, for symbolising crash reports.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::{deps, util};

/// What building the image needs from Debian.
const PACKAGES: &[&str] = &["podman", "runc", "mmdebstrap", "uidmap"];
/// The Dockerfile's bases, as podman names them.
const DEBIAN_SLIM: &str = "docker.io/library/debian:bookworm-slim";
const RUST: &str = "docker.io/library/rust:1.95-bookworm";
/// The host's CA bundle, copied into the locally made build base.
const HOST_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
/// The repository of the image in podman's local store.
pub const REPOSITORY: &str = "localhost/tokentrace";

/// `podman` with the options this machine needs on every call.
pub fn podman() -> Command {
    let mut cmd = Command::new("podman");
    cmd.args(["--runtime", "runc", "--cgroup-manager", "cgroupfs"]);
    cmd
}

/// The ulimits a container may get here: at or under the current ones.
pub const ULIMITS: [&str; 4] = [
    "--ulimit",
    "nofile=1024:1024",
    "--ulimit",
    "nproc=1024:1024",
];

fn run(what: &str, cmd: &mut Command) -> Result<String> {
    let out = cmd
        .current_dir(util::root())
        .output()
        .with_context(|| format!("running {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn image_exists(name: &str) -> bool {
    podman()
        .args(["image", "exists", name])
        .status()
        .is_ok_and(|s| s.success())
}

/// The agent crate's version, the image's tag.
fn version() -> Result<String> {
    let manifest =
        std::fs::read_to_string(util::root().join("Cargo.toml")).context("reading Cargo.toml")?;
    manifest
        .lines()
        .find_map(|l| l.strip_prefix("version = "))
        .map(|v| v.trim().trim_matches('"').to_string())
        .context("no version in the workspace Cargo.toml")
}

/// The image name `cargo xtask image` builds.
pub fn name() -> Result<String> {
    Ok(format!("{REPOSITORY}:{}", version()?))
}

/// Makes `name` from a Debian bookworm root filesystem (mmdebstrap) with
/// `extra` options, imported with the `changes` (Dockerfile instructions).
fn ensure_base(name: &str, extra: &[String], changes: &[&str]) -> Result<()> {
    if image_exists(name) {
        return Ok(());
    }
    let dir = util::target_dir().join("image");
    std::fs::create_dir_all(&dir)?;
    let tar = dir.join("rootfs.tar");
    let started = Instant::now();
    eprintln!("xtask: making {name} with mmdebstrap (no registry is reachable)");
    let mut cmd = Command::new("mmdebstrap");
    cmd.args(["--quiet", "--variant=minbase"])
        .args(extra)
        .arg("bookworm")
        .arg(&tar);
    run("mmdebstrap", &mut cmd)?;
    let mut import = podman();
    import.arg("import");
    for change in changes {
        import.args(["--change", change]);
    }
    import.arg(&tar).arg(name);
    run("podman import", &mut import)?;
    let _ = std::fs::remove_file(&tar);
    eprintln!(
        "xtask: {name} made in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// This machine's Rust toolchain (what `cargo` here runs).
fn toolchain() -> Result<PathBuf> {
    let sysroot = run(
        "rustc --print sysroot",
        Command::new("rustc").args(["--print", "sysroot"]),
    )?;
    Ok(PathBuf::from(sysroot))
}

/// What makes Docker's `-slim` Debian images slim (debuerreotype's
/// slimify and the docker-clean apt config): no manuals, docs (but
/// copyrights) or translations from any package installed later, and apt
/// keeping no caches or lists in image layers.
fn slim_options() -> Vec<String> {
    let mut opts: Vec<String> = [
        "path-exclude=/usr/share/man/*",
        "path-exclude=/usr/share/doc/*",
        "path-include=/usr/share/doc/*/copyright",
        "path-exclude=/usr/share/locale/*",
        "path-exclude=/usr/share/info/*",
        "path-exclude=/usr/share/lintian/*",
    ]
    .iter()
    .map(|o| format!("--dpkgopt={o}"))
    .collect();
    opts.push(format!(
        "--customize-hook=printf '%s\\n' {} > \"$1/etc/apt/apt.conf.d/docker-clean\"",
        [
            r#"'DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };'"#,
            r#"'APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };'"#,
            r#"'Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";'"#,
        ]
        .join(" ")
    ));
    opts.push(
        "--customize-hook=rm -rf \"$1\"/var/lib/apt/lists/* \"$1\"/var/cache/apt/*.bin \"$1\"/var/log/*.log"
            .to_string(),
    );
    opts
}

fn ensure_bases() -> Result<()> {
    ensure_base(DEBIAN_SLIM, &slim_options(), &["CMD [\"bash\"]"])?;
    let rust = toolchain()?;
    let parts: Vec<String> = ["bin", "lib", "libexec"]
        .iter()
        .map(|p| rust.join(p))
        .filter(|p| p.exists())
        .map(|p| p.display().to_string())
        .collect();
    if parts.is_empty() {
        bail!("no Rust toolchain at {}", rust.display());
    }
    let extra = vec![
        "--include=ca-certificates,gcc,libc6-dev,binutils,make,pkg-config".to_string(),
        "--customize-hook=mkdir -p \"$1/usr/local/rust\" \"$1/usr/local/cargo\"".to_string(),
        format!(
            "--customize-hook=copy-in {} /usr/local/rust",
            parts.join(" ")
        ),
        // This machine's trust store: where egress goes through a proxy
        // with its own CA, `cargo build` inside the build needs it to
        // reach crates.io, as the host's cargo does.
        format!("--customize-hook=copy-in {HOST_CA_BUNDLE} /etc/ssl/certs"),
    ];
    ensure_base(
        RUST,
        &extra,
        &[
            "ENV CARGO_HOME=/usr/local/cargo",
            "ENV PATH=/usr/local/cargo/bin:/usr/local/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "CMD [\"bash\"]",
        ],
    )
}

fn podman_build(extra: &[&str]) -> Result<()> {
    let mut cmd = podman();
    cmd.args(["build", "--network", "host", "--layers"])
        .args(ULIMITS)
        .args(["--ignorefile", "deploy/Dockerfile.dockerignore"])
        .args(["-f", "deploy/Dockerfile"])
        .args(extra)
        .arg(".");
    let status = cmd
        .current_dir(util::root())
        .status()
        .context("running podman build")?;
    if !status.success() {
        bail!("podman build {} failed with {status}", extra.join(" "));
    }
    Ok(())
}

fn size_mb(name: &str) -> Result<f64> {
    let bytes = run(
        "podman image inspect",
        podman().args(["image", "inspect", "--format", "{{.Size}}", name]),
    )?;
    let bytes: f64 = bytes
        .parse()
        .with_context(|| format!("image size {bytes:?}"))?;
    Ok(bytes / 1e6)
}

/// The image the container tests run their servers in: Debian bookworm
/// with python3 (whose `_ssl` links that filesystem's own libssl.so.3).
pub const TEST_SERVER_IMAGE: &str = "localhost/tokentrace-test-python:bookworm";

/// Makes [`TEST_SERVER_IMAGE`] when podman does not have it.
pub fn ensure_test_images() -> Result<()> {
    deps::ensure_apt(PACKAGES)?;
    ensure_base(
        TEST_SERVER_IMAGE,
        &["--include=python3,ca-certificates".to_string()],
        &["CMD [\"python3\"]"],
    )
}

/// Builds the image (bases first, when missing) and returns its name.
pub fn build() -> Result<String> {
    deps::ensure_apt(PACKAGES)?;
    ensure_bases()?;
    let name = name()?;
    let started = Instant::now();
    podman_build(&["-t", &name])?;
    let built = started.elapsed();
    let debug_dir = util::target_dir().join("image");
    let debug = debug_dir.join("tokentrace.debug");
    podman_build(&[
        "--target",
        "debug-symbols",
        "--output",
        &format!("type=local,dest={}", debug_dir.display()),
    ])?;
    let size = size_mb(&name)?;
    let debug_mb = file_mb(&debug);
    eprintln!(
        "xtask: debug symbols (split off the binary) in {} ({debug_mb:.0} MB)",
        debug.display()
    );
    println!(
        "image {name}: {size:.1} MB, built in {:.0} s",
        built.as_secs_f64()
    );
    Ok(name)
}

fn file_mb(path: &Path) -> f64 {
    std::fs::metadata(path).map_or(0.0, |m| m.len() as f64 / 1e6)
}
