//! Kernel memory of the probes' plain hash maps.
//!
//! A hash map allocates all of its elements when it is created unless it is
//! made with `BPF_F_NO_PREALLOC`, and that memory is charged to the agent's
//! memory cgroup (the DaemonSet's pod) for as long as it runs. `ssl_calls`,
//! `active_io` and `cuda_calls` hold one entry per thread inside an
//! OpenSSL call, a syscall or a CUDA sync: a handful at any time, in maps
//! sized for 65536 (6-7 MiB each preallocated, ~1 MiB of buckets without).
//!
//! Tracing programs may use hash maps that allocate on update since Linux
//! 6.1, whose BPF memory allocator (`struct bpf_mem_alloc`) made it safe in
//! any context they run in; before it such a map loaded with a kernel
//! warning ("trace type BPF program uses run-time allocation"), so older
//! kernels keep them preallocated. The LRU maps must be preallocated on
//! every kernel, and perf_event programs (profile.bpf.c) are left alone.

use std::sync::OnceLock;

use anyhow::{Context, Result};
use libbpf_rs::OpenMapMut;

/// `BPF_F_NO_PREALLOC` (uapi/linux/bpf.h).
const BPF_F_NO_PREALLOC: u32 = 1;

/// Whether this kernel's tracing programs may use hash maps that allocate
/// their elements on update: its BTF has the BPF memory allocator. Read
/// once per process (the BTF is parsed for it).
fn elements_on_update() -> bool {
    static ON_UPDATE: OnceLock<bool> = OnceLock::new();
    *ON_UPDATE.get_or_init(|| {
        libbpf_rs::btf::Btf::from_vmlinux().is_ok_and(|btf| {
            btf.type_by_name::<libbpf_rs::btf::types::Struct<'_>>("bpf_mem_alloc")
                .is_some()
        })
    })
}

/// Makes each of `maps` (plain hash maps of tracing programs) allocate its
/// elements on update where the kernel allows it, before load.
pub(super) fn allocate_on_update<'m, 'obj: 'm>(
    maps: impl IntoIterator<Item = &'m mut OpenMapMut<'obj>>,
) -> Result<()> {
    if !elements_on_update() {
        return Ok(());
    }
    for map in maps {
        let flags = map.map_flags() | BPF_F_NO_PREALLOC;
        map.set_map_flags(flags).with_context(|| {
            format!(
                "making the {} map allocate on update",
                map.name().to_string_lossy()
            )
        })?;
    }
    Ok(())
}
