//! Kernel-side probes of tokentrace, compiled from C into libbpf-rs skeletons.
//!
//! Each `src/bpf/<name>.bpf.c` becomes a module `<name>` holding the generated
//! skeleton (`<Name>SkelBuilder`) and the record types of `events.h`
//! (`types::tt_data_event`, …).

// The skeletons are generated code: lints are for the code we write.
#![allow(
    clippy::all,
    clippy::unwrap_used,
    missing_docs,
    non_camel_case_types,
    non_upper_case_globals
)]

/// Socket syscall probes: accept/read/write/close/listen plus process lifecycle.
pub mod sock {
    include!(concat!(env!("OUT_DIR"), "/sock.skel.rs"));
}

// SAFETY: these are `#[repr(C)]` structs of integers and byte arrays
// generated from events.h / the BPF object's BTF: every bit pattern is a
// valid value, which is what `Plain` requires.
unsafe impl plain::Plain for sock::types::tt_event_header {}
// SAFETY: as above.
unsafe impl plain::Plain for sock::types::tt_data_event {}
// SAFETY: as above.
unsafe impl plain::Plain for sock::types::tt_conn_event {}
// SAFETY: as above.
unsafe impl plain::Plain for sock::types::tt_listen_event {}
// SAFETY: as above.
unsafe impl plain::Plain for sock::types::tt_proc_event {}
// SAFETY: as above.
unsafe impl plain::Plain for sock::types::tt_nagle_event {}
// SAFETY: as above.
unsafe impl plain::Plain for sock::types::bss {}
// SAFETY: as above (the key of `ingress_listeners`).
unsafe impl plain::Plain for sock::types::listen_key {}

/// Probes inside inference processes: `llm:*` USDT, CUDA runtime/driver
/// uprobes, off-CPU intervals. Shares the ring buffer and pid filter of
/// `sock`.
pub mod infer {
    include!(concat!(env!("OUT_DIR"), "/infer.skel.rs"));
}

// SAFETY: as above.
unsafe impl plain::Plain for infer::types::tt_usdt_event {}
// SAFETY: as above.
unsafe impl plain::Plain for infer::types::tt_cuda_sync_event {}
// SAFETY: as above.
unsafe impl plain::Plain for infer::types::tt_offcpu_event {}
// SAFETY: as above.
unsafe impl plain::Plain for infer::types::bss {}

/// CPU sampling of recording sessions: a perf_event program collecting stacks.
pub mod profile {
    include!(concat!(env!("OUT_DIR"), "/profile.skel.rs"));
}

// SAFETY: as above.
unsafe impl plain::Plain for profile::types::tt_cpu_sample {}
// SAFETY: as above.
unsafe impl plain::Plain for profile::types::bss {}

/// Feature probes for `tokentrace check`: one trivial program per attach type.
pub mod check {
    include!(concat!(env!("OUT_DIR"), "/check.skel.rs"));
}
