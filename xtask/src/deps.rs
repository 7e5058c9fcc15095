//! Installs what building, the demo and the tests need, when missing.

use anyhow::{bail, Context, Result};

use crate::util::{self, succeeds};

/// Debian packages: clang builds the BPF programs, libelf/zlib link libbpf,
/// bpftool regenerates vmlinux.h, linux-libc-dev has the uapi headers, gcc
/// and systemtap-sdt-dev (<sys/sdt.h>) build the USDT library and the
/// stand-in CUDA libraries (`cargo xtask native`).
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
];

/// Python packages of the test servers, and rotel: the OpenTelemetry
/// collector (a Rust binary shipped in the wheel) the export tests send to.
/// Pinned: the tests parse its debug output.
const PIP_PACKAGES: &[&str] = &["fastapi", "uvicorn", "sse-starlette", "rotel==0.0.1a15"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Only what building the agent needs.
    Build,
    /// Build plus the test servers' Python packages.
    All,
}

fn missing_apt() -> Vec<&'static str> {
    APT_PACKAGES
        .iter()
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

pub fn install(scope: Scope) -> Result<()> {
    let missing = missing_apt();
    if !missing.is_empty() {
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
        util::status("apt-get", &args).context("apt-get install")?;
    }
    if scope == Scope::All
        && !succeeds(
            "python3",
            &["-c", "import fastapi, uvicorn, sse_starlette, rotel"],
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
