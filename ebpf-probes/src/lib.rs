//! Kernel-side probes of tokentrace, compiled from C into libbpf-rs skeletons.
//!
//! Each `src/bpf/<name>.bpf.c` becomes a module `<name>` holding the generated
//! skeleton (`<Name>SkelBuilder`) and the record types of `events.h`
//! (`types::data_event`, …).

#![allow(clippy::all, missing_docs, non_camel_case_types, non_upper_case_globals)]

/// Socket syscall probes: accept/read/write/close/listen plus process lifecycle.
pub mod sock {
    include!(concat!(env!("OUT_DIR"), "/sock.skel.rs"));
}
