//! `cargo xtask native`: the C artifacts, built into target/native/.
//!
//! - `libllm_usdt.so`   the `llm` USDT probes behind C functions
//!   (instrument/c), loaded by instrument/python/llm_usdt.py
//! - `libcuda.so.1`, `libcudart.so.12`   stand-in CUDA driver and runtime
//!   (tests/native/fake_cuda.c) with the real symbols, for tests without a GPU
//! - `launch_loop`      a launch-heavy CUDA loop for `cargo xtask bench`
//!
//! Every artifact is written under a temporary name and renamed into place,
//! so a server that has the previous build mapped keeps running. After
//! building, tests/native/check_fake_cuda.py checks the stand-in's timing
//! (sync waits, streams, launch cost), which the eBPF tests rely on.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::util;

const WARNINGS: &[&str] = &["-Wall", "-Wextra", "-Werror"];

/// Shared objects: position independent, only what is marked exported is
/// visible, and no executable stack (recent glibc refuses to dlopen a
/// library that asks for one).
const SHARED: &[&str] = &[
    "-O2",
    "-g",
    "-fPIC",
    "-shared",
    "-fvisibility=hidden",
    "-Wl,-z,noexecstack",
];

fn out_dir() -> PathBuf {
    util::root().join("target/native")
}

fn compiler() -> String {
    std::env::var("CC").unwrap_or_else(|_| "gcc".into())
}

/// Compiles to `out` via a temporary file in the same directory.
fn compile(out: &Path, args: &[&str]) -> Result<()> {
    let tmp = out.with_extension("tmp");
    let cc = compiler();
    let status = Command::new(&cc)
        .args(WARNINGS)
        .args(args)
        .arg("-o")
        .arg(&tmp)
        .current_dir(util::root())
        .status()
        .with_context(|| format!("running {cc} (install it with `cargo xtask deps`)"))?;
    if !status.success() {
        bail!("{cc} failed building {}", out.display());
    }
    std::fs::rename(&tmp, out).with_context(|| format!("moving {} into place", out.display()))
}

/// Builds everything, then checks the stand-in CUDA libraries.
pub fn build_and_check() -> Result<()> {
    build()?;
    let check = util::root().join("tests/native/check_fake_cuda.py");
    util::status(
        "python3",
        &[check.to_str().context("repository path is not UTF-8")?],
    )
    .context("the stand-in CUDA libraries misbehave")
}

pub fn build() -> Result<()> {
    let multiarch = format!(
        "/usr/include/{}-linux-gnu/sys/sdt.h",
        std::env::consts::ARCH
    );
    if !Path::new(&multiarch).exists() && !Path::new("/usr/include/sys/sdt.h").exists() {
        bail!("<sys/sdt.h> is missing: run `cargo xtask deps` (Debian package systemtap-sdt-dev)");
    }
    let dir = out_dir();
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let dir_str = dir.to_str().context("target directory is not UTF-8")?;
    let lib_dir = format!("-L{dir_str}");

    let mut args = SHARED.to_vec();
    args.extend(["-Wl,-soname,libllm_usdt.so", "instrument/c/llm_usdt.c"]);
    compile(&dir.join("libllm_usdt.so"), &args)?;

    let mut args = SHARED.to_vec();
    args.extend([
        "-DFAKECUDA_DRIVER",
        "-Wl,-soname,libcuda.so.1",
        "tests/native/fake_cuda.c",
    ]);
    compile(&dir.join("libcuda.so.1"), &args)?;

    // The runtime finds the driver next to itself ($ORIGIN), wherever
    // target/ is, without LD_LIBRARY_PATH.
    let mut args = SHARED.to_vec();
    args.extend([
        "-DFAKECUDA_RUNTIME",
        "-Wl,-soname,libcudart.so.12",
        "-Wl,--version-script=tests/native/libcudart.map",
        "tests/native/fake_cuda.c",
        &lib_dir,
        "-l:libcuda.so.1",
        "-Wl,-rpath,$ORIGIN",
    ]);
    compile(&dir.join("libcudart.so.12"), &args)?;

    compile(
        &dir.join("launch_loop"),
        &[
            "-O2",
            "-g",
            "-Itests/native",
            "tests/native/launch_loop.c",
            &lib_dir,
            "-l:libcudart.so.12",
            "-l:libcuda.so.1",
            "-Wl,-rpath,$ORIGIN",
        ],
    )?;
    eprintln!(
        "xtask: built libllm_usdt.so, libcuda.so.1, libcudart.so.12, launch_loop in {dir_str}"
    );
    Ok(())
}
