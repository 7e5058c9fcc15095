//! Which kernel hooks feed the data path (reads, writes, accepts, closes):
//! the socket layer's tracepoints or the raw syscall hooks.
//!
//! A program on `sys_enter`/`sys_exit` puts every task on the host on the
//! syscall slow path and runs on every syscall of every process, traced or
//! not: with the agent running, an untraced `getppid()` loop ran 0.65x as
//! fast and 16-byte `send()`s 0.89x (`cargo xtask bench --only kernel`).
//! The socket hooks (`sock_hooks.bpf.h`: `tcp_sendmsg_locked`,
//! `sock_send_length`, `sock_recv_length`, `vm_unmapped_area`, plus close
//! and listen through `inet_sock_set_state`) fire only on socket calls.
//! They need Linux 6.16 (`tcp_sendmsg_locked`); older kernels keep the
//! syscall hooks. The socket hooks see no `accept()`: a connection's accept
//! is dated by the process's first send or receive on it.

use std::fmt;

use anyhow::{bail, Context, Result};
use serde::Deserialize;

/// The hooks a run's data path uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataHooks {
    /// Socket-layer tracepoints: untraced processes pay only on socket
    /// calls (Linux 6.16+).
    Socket,
    /// `sys_enter`/`sys_exit`: every syscall on the host pays; accept()
    /// is dated by its return.
    Syscall,
}

impl DataHooks {
    pub fn name(self) -> &'static str {
        match self {
            DataHooks::Socket => "socket",
            DataHooks::Syscall => "syscall",
        }
    }

    /// The programs of `sock.bpf.c` that only this data path loads.
    fn programs(self) -> &'static [&'static str] {
        match self {
            DataHooks::Socket => &[
                "on_sendmsg_locked",
                "on_send_length",
                "on_recv_length",
                "on_vm_unmapped_area",
            ],
            DataHooks::Syscall => &["enter_syscall", "exit_syscall", "exit_syscall_compat"],
        }
    }
}

impl fmt::Display for DataHooks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The `--data-hooks` / `capture.data_hooks` setting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum DataHooksSetting {
    /// Socket hooks where the kernel has their tracepoints, else syscall.
    #[default]
    Auto,
    Socket,
    Syscall,
}

/// The tracepoints the socket hooks attach to (besides the ones both data
/// paths use), as the kernel's BTF names them (`btf_trace_<name>`).
const SOCKET_TRACEPOINTS: [&str; 4] = [
    "tcp_sendmsg_locked",
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

impl DataHooksSetting {
    /// The data path for this setting on a kernel lacking `missing`.
    pub fn choose(self, missing: &[&str]) -> Result<DataHooks> {
        match self {
            DataHooksSetting::Syscall => Ok(DataHooks::Syscall),
            DataHooksSetting::Auto if missing.is_empty() => Ok(DataHooks::Socket),
            DataHooksSetting::Auto => Ok(DataHooks::Syscall),
            DataHooksSetting::Socket if missing.is_empty() => Ok(DataHooks::Socket),
            DataHooksSetting::Socket => bail!(
                "--data-hooks socket: this kernel has no {} tracepoint (the socket hooks need \
                 Linux 6.16 or later; use --data-hooks auto or syscall)",
                missing.join(", ")
            ),
        }
    }
}

/// Loads the programs of `hooks` and not the other data path's. With the
/// syscall hooks the socket hooks' task storage (`send_starts`) is not
/// created either: kernels before 5.11 have no task storage maps.
pub(super) fn select_data_programs(
    object: &mut libbpf_rs::OpenObject,
    hooks: DataHooks,
) -> Result<()> {
    let other = match hooks {
        DataHooks::Socket => DataHooks::Syscall,
        DataHooks::Syscall => DataHooks::Socket,
    };
    for mut program in object.progs_mut() {
        let name = program.name().to_string_lossy().into_owned();
        if other.programs().contains(&name.as_str()) {
            program.set_autoload(false);
        }
    }
    if hooks == DataHooks::Syscall {
        for mut map in object.maps_mut() {
            if map.name() == "send_starts" {
                map.set_autocreate(false)
                    .context("leaving the socket hooks' send_starts map out")?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_takes_the_socket_hooks_only_when_every_tracepoint_is_there() {
        assert!(matches!(
            DataHooksSetting::Auto.choose(&[]),
            Ok(DataHooks::Socket)
        ));
        assert!(matches!(
            DataHooksSetting::Auto.choose(&["tcp_sendmsg_locked"]),
            Ok(DataHooks::Syscall)
        ));
        assert!(matches!(
            DataHooksSetting::Syscall.choose(&[]),
            Ok(DataHooks::Syscall)
        ));
    }

    #[test]
    fn socket_on_an_old_kernel_names_what_is_missing() {
        let Err(err) = DataHooksSetting::Socket.choose(&["tcp_sendmsg_locked", "sock_send_length"])
        else {
            panic!("--data-hooks socket accepted on a kernel without the tracepoints");
        };
        let err = err.to_string();
        assert!(
            err.contains("tcp_sendmsg_locked, sock_send_length"),
            "{err}"
        );
        assert!(err.contains("6.16"), "{err}");
    }
}
