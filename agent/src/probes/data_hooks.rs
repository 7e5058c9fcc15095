//! Which kernel hooks feed the data path (reads, writes, accepts, closes):
//! the socket layer's tracepoints or the raw syscall hooks.
//!
//! A program on `sys_enter`/`sys_exit` puts every task on the host on the
//! syscall slow path and runs on every syscall of every process, traced or
//! not: with the agent running, an untraced `getppid()` loop ran 0.65x as
//! fast and 16-byte `send()`s 0.89x (`cargo xtask bench --only kernel`).
//! The socket hooks (`sock_hooks.bpf.h`: `sock_send_length`,
//! `sock_recv_length`, `vm_unmapped_area`, plus close and listen through
//! `inet_sock_set_state`) fire only on socket calls. They need Linux 6.3
//! (`sock_send_length`/`sock_recv_length`); older kernels keep the syscall
//! hooks. Where the kernel also has `tcp_sendmsg_locked` (6.16+) a send is
//! dated at its start, before its first byte is queued; without it (or with
//! `socket_at_return`, one hook less on every socket send of every process)
//! at its return, which for a send that waited for room in the socket
//! buffer is when its last byte was queued. The socket hooks see no
//! `accept()`: a connection's accept is dated by the process's first send
//! or receive on it.

use std::fmt;

use anyhow::{bail, Result};
use serde::Deserialize;

use super::leave_out;

/// The hooks a run's data path uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataHooks {
    /// Socket-layer tracepoints: untraced processes pay only on socket
    /// calls (Linux 6.3+). `send_start`: `tcp_sendmsg_locked` dates each
    /// send at its start (6.16+); without it a send is dated at its return.
    Socket { send_start: bool },
    /// `sys_enter`/`sys_exit`: every syscall on the host pays; accept()
    /// is dated by its return.
    Syscall,
}

/// The send-start program and its tracepoint (Linux 6.16+).
const SEND_START_PROGRAM: &str = "on_sendmsg_locked";
const SEND_START_TRACEPOINT: &str = "tcp_sendmsg_locked";

impl DataHooks {
    pub fn name(self) -> &'static str {
        match self {
            DataHooks::Socket { .. } => "socket",
            DataHooks::Syscall => "syscall",
        }
    }

    /// The programs of `sock.bpf.c` that only this data path loads.
    fn programs(self) -> &'static [&'static str] {
        match self {
            DataHooks::Socket { send_start: true } => &[
                SEND_START_PROGRAM,
                "on_send_length",
                "on_recv_length",
                "on_vm_unmapped_area",
            ],
            DataHooks::Socket { send_start: false } => {
                &["on_send_length", "on_recv_length", "on_vm_unmapped_area"]
            }
            DataHooks::Syscall => &["enter_syscall", "exit_syscall", "exit_syscall_compat"],
        }
    }
}

impl fmt::Display for DataHooks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DataHooks::Socket { send_start: false } => {
                f.write_str("socket (sends dated at their return)")
            }
            _ => f.write_str(self.name()),
        }
    }
}

/// The `--data-hooks` / `capture.data_hooks` setting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum DataHooksSetting {
    /// Socket hooks where the kernel has their tracepoints, else syscall;
    /// the syscall hooks too where the socket hooks fail to load.
    #[default]
    Auto,
    /// Socket hooks, each send dated at its start where the kernel can.
    Socket,
    /// Socket hooks without the send-start hook: one hook less on every
    /// socket send of every process, each send dated at its return.
    #[value(name = "socket_at_return")]
    SocketAtReturn,
    /// The raw syscall hooks, which every syscall on the host pays for.
    Syscall,
}

/// The tracepoints the socket hooks attach to (besides the ones both data
/// paths use), as the kernel's BTF names them (`btf_trace_<name>`); all but
/// the send start's are needed.
const SOCKET_TRACEPOINTS: [&str; 4] = [
    SEND_START_TRACEPOINT,
    "sock_send_length",
    "sock_recv_length",
    "vm_unmapped_area",
];

/// The socket hooks' tracepoints this kernel lacks (all of them when its
/// BTF cannot be read).
pub fn missing_socket_tracepoints() -> Vec<&'static str> {
    let Ok(btf) = libbpf_rs::btf::Btf::from_vmlinux() else {
        return SOCKET_TRACEPOINTS.to_vec();
    };
    SOCKET_TRACEPOINTS
        .into_iter()
        .filter(|name| {
            btf.type_by_name::<libbpf_rs::btf::types::Typedef<'_>>(&format!("btf_trace_{name}"))
                .is_none()
        })
        .collect()
}

/// Of `missing`, the tracepoints the socket hooks cannot do without.
pub fn missing_required(missing: &[&'static str]) -> Vec<&'static str> {
    missing
        .iter()
        .copied()
        .filter(|&name| name != SEND_START_TRACEPOINT)
        .collect()
}

impl DataHooksSetting {
    /// The data path for this setting on a kernel lacking `missing`.
    pub fn choose(self, missing: &[&'static str]) -> Result<DataHooks> {
        let required = missing_required(missing);
        let send_start = !missing.contains(&SEND_START_TRACEPOINT);
        match self {
            DataHooksSetting::Syscall => Ok(DataHooks::Syscall),
            DataHooksSetting::Auto if !required.is_empty() => Ok(DataHooks::Syscall),
            DataHooksSetting::Socket | DataHooksSetting::SocketAtReturn if !required.is_empty() => {
                bail!(
                    "--data-hooks {}: this kernel has no {} tracepoint (the socket hooks need \
                     Linux 6.3 or later; use --data-hooks auto or syscall)",
                    self.name(),
                    required.join(", ")
                )
            }
            DataHooksSetting::SocketAtReturn => Ok(DataHooks::Socket { send_start: false }),
            DataHooksSetting::Auto | DataHooksSetting::Socket => {
                Ok(DataHooks::Socket { send_start })
            }
        }
    }

    /// `start(hooks)`, and under `auto`, where socket hooks fail to load or
    /// attach (a kernel whose verifier this agent was never run against),
    /// `start(Syscall)` after `fell_back` was told why.
    pub fn start_with_fallback<T>(
        self,
        hooks: DataHooks,
        mut start: impl FnMut(DataHooks) -> Result<T>,
        fell_back: impl FnOnce(&anyhow::Error),
    ) -> Result<T> {
        match start(hooks) {
            Err(err) if self == DataHooksSetting::Auto && hooks != DataHooks::Syscall => {
                fell_back(&err);
                start(DataHooks::Syscall)
            }
            started => started,
        }
    }

    /// As written on the command line.
    fn name(self) -> &'static str {
        match self {
            DataHooksSetting::Auto => "auto",
            DataHooksSetting::Socket => "socket",
            DataHooksSetting::SocketAtReturn => "socket_at_return",
            DataHooksSetting::Syscall => "syscall",
        }
    }
}

/// Loads the programs of `hooks` and not the other data path's, nor the
/// map only the other path uses: with the syscall hooks the socket hooks'
/// task storage (`send_starts`; kernels before 5.11 have no task storage
/// maps), with the socket hooks the syscall entries kept for their exits
/// (`active_io`, 6.5 MiB of kernel memory for nothing).
pub(super) fn select_data_programs(
    object: &mut libbpf_rs::OpenObject,
    hooks: DataHooks,
) -> Result<()> {
    leave_out::programs(object, |name| {
        let any_path = DataHooks::Socket { send_start: true }
            .programs()
            .iter()
            .chain(DataHooks::Syscall.programs())
            .any(|p| *p == name);
        any_path && !hooks.programs().contains(&name)
    });
    let other_paths_map = if hooks == DataHooks::Syscall {
        "send_starts"
    } else {
        "active_io"
    };
    leave_out::maps(object, |name| name == other_paths_map)
}

/// Every data program this kernel can load (`tokentrace check
/// --programs`): both paths, less the socket hooks' where their
/// tracepoints are missing.
pub(super) fn select_loadable_programs(object: &mut libbpf_rs::OpenObject) -> Result<()> {
    let missing = missing_socket_tracepoints();
    if !missing_required(&missing).is_empty() {
        return select_data_programs(object, DataHooks::Syscall);
    }
    if missing.contains(&SEND_START_TRACEPOINT) {
        leave_out::programs(object, |name| name == SEND_START_PROGRAM);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_takes_the_socket_hooks_where_their_needed_tracepoints_are() {
        assert!(matches!(
            DataHooksSetting::Auto.choose(&[]),
            Ok(DataHooks::Socket { send_start: true })
        ));
        // 6.3 to 6.15: no send start, sends dated at their return.
        assert!(matches!(
            DataHooksSetting::Auto.choose(&["tcp_sendmsg_locked"]),
            Ok(DataHooks::Socket { send_start: false })
        ));
        assert!(matches!(
            DataHooksSetting::Auto.choose(&["tcp_sendmsg_locked", "sock_send_length"]),
            Ok(DataHooks::Syscall)
        ));
        assert!(matches!(
            DataHooksSetting::Syscall.choose(&[]),
            Ok(DataHooks::Syscall)
        ));
        assert!(matches!(
            DataHooksSetting::SocketAtReturn.choose(&[]),
            Ok(DataHooks::Socket { send_start: false })
        ));
    }

    #[test]
    fn socket_on_an_old_kernel_names_what_is_missing() {
        for setting in [DataHooksSetting::Socket, DataHooksSetting::SocketAtReturn] {
            let Err(err) = setting.choose(&["tcp_sendmsg_locked", "sock_send_length"]) else {
                panic!("{setting:?} accepted on a kernel without the tracepoints");
            };
            let err = err.to_string();
            // Only what the socket hooks cannot do without is named.
            assert!(err.contains("no sock_send_length tracepoint"), "{err}");
            assert!(err.contains("6.3"), "{err}");
        }
    }

    #[test]
    fn only_auto_falls_back_and_only_from_socket_hooks_that_failed() {
        let socket = DataHooks::Socket { send_start: true };
        let fails_on_socket = |hooks: DataHooks| match hooks {
            DataHooks::Socket { .. } => bail!("verifier says no"),
            DataHooks::Syscall => Ok(hooks),
        };
        let mut told = None;
        let started = DataHooksSetting::Auto
            .start_with_fallback(socket, fails_on_socket, |e| told = Some(e.to_string()));
        assert_eq!(started.ok(), Some(DataHooks::Syscall));
        assert_eq!(told.as_deref(), Some("verifier says no"));
        // Asked for by name: the failure is the answer.
        for setting in [DataHooksSetting::Socket, DataHooksSetting::SocketAtReturn] {
            let started = setting
                .start_with_fallback(socket, fails_on_socket, |_| panic!("{setting:?} fell back"));
            assert!(started.is_err(), "{setting:?}");
        }
        // Socket hooks that load are kept; a syscall failure is not retried.
        let mut tries = 0;
        let started = DataHooksSetting::Auto.start_with_fallback(
            DataHooks::Syscall,
            |_| -> Result<()> {
                tries += 1;
                bail!("no tracefs")
            },
            |_| panic!("fell back from the syscall hooks"),
        );
        assert!(started.is_err());
        assert_eq!(tries, 1);
        let started =
            DataHooksSetting::Auto.start_with_fallback(socket, Ok, |_| panic!("fell back"));
        assert_eq!(started.ok(), Some(socket));
    }

    #[test]
    fn each_path_loads_its_own_programs_only() {
        let start = DataHooks::Socket { send_start: true }.programs();
        let at_return = DataHooks::Socket { send_start: false }.programs();
        assert!(start.contains(&SEND_START_PROGRAM));
        assert!(!at_return.contains(&SEND_START_PROGRAM));
        assert!(at_return.iter().all(|p| start.contains(p)));
        assert!(DataHooks::Syscall
            .programs()
            .iter()
            .all(|p| !start.contains(p)));
    }
}
