//! Compiles every `src/bpf/*.bpf.c` into a libbpf-rs skeleton in `OUT_DIR`.
//!
//! `vmlinux.h` is committed per architecture under `include/<arch>/`;
//! `cargo xtask vmlinux` regenerates it from the running kernel's BTF.

use std::env;
use std::ffi::OsStr;
use std::path::PathBuf;

use libbpf_cargo::SkeletonBuilder;

const BPF_DIR: &str = "src/bpf";

fn main() {
    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let arch = env::var("CARGO_CFG_TARGET_ARCH").expect("cargo sets CARGO_CFG_TARGET_ARCH");
    let vmlinux_dir = manifest_dir.join("include").join(&arch);
    let bpf_dir = manifest_dir.join(BPF_DIR);

    // The directory itself, so that a new .bpf.c file triggers a rebuild.
    println!("cargo:rerun-if-changed={}", bpf_dir.display());
    println!(
        "cargo:rerun-if-changed={}",
        vmlinux_dir.join("vmlinux.h").display()
    );

    let mut sources: Vec<PathBuf> = std::fs::read_dir(&bpf_dir)
        .expect("ebpf-probes/src/bpf exists")
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.to_str().is_some_and(|p| p.ends_with(".bpf.c")))
        .collect();
    sources.sort();

    for source in sources {
        println!("cargo:rerun-if-changed={}", source.display());
        let file_name = source
            .file_name()
            .and_then(OsStr::to_str)
            .expect("utf-8 file name");
        let stem = file_name.trim_end_matches(".bpf.c");
        let skel = out_dir.join(format!("{stem}.skel.rs"));
        SkeletonBuilder::new()
            .source(&source)
            .clang_args([
                OsStr::new("-I"),
                vmlinux_dir.as_os_str(),
                OsStr::new("-I"),
                bpf_dir.as_os_str(),
                // usdt.bpf.h includes <sys/sdt.h>-style headers from the multiarch dir.
                OsStr::new("-I/usr/include/x86_64-linux-gnu"),
                OsStr::new("-Wall"),
            ])
            .build_and_generate(&skel)
            .unwrap_or_else(|err| {
                panic!("building BPF skeleton for {}: {err:#}", source.display())
            });
    }
}
