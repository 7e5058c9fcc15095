//! What /proc says about processes: names, executables, command lines and
//! listening TCP ports (per network namespace, so containers are seen).
//!
//! Our own readers, not the `procfs` crate: the agent needs five small
//! reads, each a few lines here, under a root that tests point at a fake
//! tree. procfs-core 0.18 parses the same fields (6 crates, 7 s to build),
//! but its maps parser keeps a replaced file's ` (deleted)` suffix in the
//! path, which `libraries::maps_line` has to strip anyway.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Identity of one process as a selector sees it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ProcessInfo {
    pub pid: u32,
    pub comm: String,
    /// Resolved `/proc/PID/exe` (empty when unreadable, e.g. kernel threads).
    pub exe: String,
    /// Command line, arguments joined by spaces.
    pub cmdline: String,
}

/// Reads identity fields of `pid` from `proc_root` (normally `/proc`).
/// `None` if the process is gone.
pub fn process_info(proc_root: &Path, pid: u32) -> Option<ProcessInfo> {
    let dir = proc_root.join(pid.to_string());
    let comm = fs::read_to_string(dir.join("comm"))
        .ok()?
        .trim_end()
        .to_string();
    let exe = fs::read_link(dir.join("exe"))
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    let cmdline = fs::read(dir.join("cmdline"))
        .map(|raw| {
            raw.split(|&b| b == 0)
                .filter(|part| !part.is_empty())
                .map(|part| String::from_utf8_lossy(part).into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default();
    Some(ProcessInfo {
        pid,
        comm,
        exe,
        cmdline,
    })
}

/// Every numeric entry of `proc_root`.
pub fn all_pids(proc_root: &Path) -> Vec<u32> {
    let Ok(entries) = fs::read_dir(proc_root) else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    pids.sort_unstable();
    pids
}

/// Parent pid from the text of `/proc/PID/stat` (the field after the state,
/// which follows the parenthesised comm; the comm may contain ") ").
pub fn parse_ppid(stat: &str) -> Option<u32> {
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Every live descendant of `pid` (children, their children, …), in
/// breadth-first order. Processes that exit meanwhile are skipped.
pub fn descendants(proc_root: &Path, pid: u32) -> Vec<u32> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for p in all_pids(proc_root) {
        let ppid = fs::read_to_string(proc_root.join(p.to_string()).join("stat"))
            .ok()
            .and_then(|stat| parse_ppid(&stat));
        if let Some(ppid) = ppid {
            children.entry(ppid).or_default().push(p);
        }
    }
    let mut out = Vec::new();
    let mut seen = HashSet::from([pid]);
    let mut queue = std::collections::VecDeque::from([pid]);
    while let Some(parent) = queue.pop_front() {
        for &child in children.get(&parent).map(Vec::as_slice).unwrap_or(&[]) {
            if seen.insert(child) {
                out.push(child);
                queue.push_back(child);
            }
        }
    }
    out
}

/// Parses `/proc/net/tcp` or `tcp6` text: inode → port of LISTEN sockets.
pub fn parse_listening(table: &str) -> HashMap<u64, u16> {
    const TCP_LISTEN: &str = "0A";
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // sl local rem st tx:rx tr:when retrnsmt uid timeout inode ...
            if fields.len() < 10 || fields[3] != TCP_LISTEN {
                return None;
            }
            let port_hex = fields[1].rsplit(':').next()?;
            let port = u16::from_str_radix(port_hex, 16).ok()?;
            let inode = fields[9].parse().ok()?;
            Some((inode, port))
        })
        .collect()
}

/// Socket inodes among the open fds of `pid`.
fn socket_inodes(proc_root: &Path, pid: u32) -> Vec<u64> {
    let Ok(entries) = fs::read_dir(proc_root.join(pid.to_string()).join("fd")) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| {
            let target = fs::read_link(e.ok()?.path()).ok()?;
            let text = target.to_str()?;
            text.strip_prefix("socket:[")?
                .strip_suffix(']')?
                .parse()
                .ok()
        })
        .collect()
}

/// The listening TCP ports of one process and the inode number of its
/// network namespace (what the kernel's `net->ns.inum` holds): the probes
/// date requests to those listeners from their first packet. `None` if the
/// process is gone.
pub fn listeners_of(proc_root: &Path, pid: u32) -> Option<(u32, Vec<u16>)> {
    use std::os::unix::fs::MetadataExt;
    let dir = proc_root.join(pid.to_string());
    let netns = u32::try_from(fs::metadata(dir.join("ns/net")).ok()?.ino()).ok()?;
    let mut table = HashMap::new();
    for name in ["net/tcp", "net/tcp6"] {
        if let Ok(text) = fs::read_to_string(dir.join(name)) {
            table.extend(parse_listening(&text));
        }
    }
    let mut ports: Vec<u16> = socket_inodes(proc_root, pid)
        .into_iter()
        .filter_map(|ino| table.get(&ino).copied())
        .collect();
    ports.sort_unstable();
    ports.dedup();
    Some((netns, ports))
}

/// Listening TCP ports per pid, for every process under `proc_root`.
///
/// Each network namespace's tables are read once, through the first
/// process found in it, so servers in containers are included.
pub fn listening_ports(proc_root: &Path) -> HashMap<u32, Vec<u16>> {
    let mut by_netns: HashMap<PathBuf, HashMap<u64, u16>> = HashMap::new();
    let mut result: HashMap<u32, Vec<u16>> = HashMap::new();
    for pid in all_pids(proc_root) {
        let dir = proc_root.join(pid.to_string());
        let Ok(netns) = fs::read_link(dir.join("ns/net")) else {
            continue;
        };
        let listening = by_netns.entry(netns).or_insert_with(|| {
            let mut table = HashMap::new();
            for name in ["net/tcp", "net/tcp6"] {
                if let Ok(text) = fs::read_to_string(dir.join(name)) {
                    table.extend(parse_listening(&text));
                }
            }
            table
        });
        if listening.is_empty() {
            continue;
        }
        let mut ports: Vec<u16> = socket_inodes(proc_root, pid)
            .into_iter()
            .filter_map(|ino| listening.get(&ino).copied())
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        if !ports.is_empty() {
            ports.sort_unstable();
            result.insert(pid, ports);
        }
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    const TCP: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 15455 1 0000000000000000 100 0 0 10 0
   1: 0100007F:1F40 0100007F:8D9C 01 00000000:00000000 00:00000000 00000000     0        0 15458 1 0000000000000000 20 4 30 10 -1
";

    #[test]
    fn parses_only_listening_sockets() {
        let table = parse_listening(TCP);
        assert_eq!(table.len(), 1);
        assert_eq!(table.get(&15455), Some(&8000));
    }

    #[test]
    fn listeners_of_this_process_include_a_socket_it_listens_on() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let (netns, ports) =
            listeners_of(Path::new("/proc"), std::process::id()).expect("we exist");
        assert!(ports.contains(&port), "{port} not in {ports:?}");
        assert_ne!(netns, 0);
        assert_eq!(listeners_of(Path::new("/proc"), u32::MAX), None);
    }

    #[test]
    fn parent_pid_after_a_comm_with_parentheses() {
        assert_eq!(
            parse_ppid("4242 (nginx: a) b) S 4240 4242 4242 0 -1"),
            Some(4240)
        );
        assert_eq!(parse_ppid("garbage"), None);
    }

    #[test]
    fn finds_a_child_and_a_grandchild() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & wait"])
            .spawn()
            .expect("spawn sh");
        let me = std::process::id();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let (found, grandchildren) = loop {
            let d = descendants(Path::new("/proc"), me);
            let grandchildren = descendants(Path::new("/proc"), child.id());
            if d.contains(&child.id())
                && !grandchildren.is_empty()
                && grandchildren.iter().all(|g| d.contains(g))
            {
                break (true, grandchildren);
            }
            if std::time::Instant::now() >= deadline {
                break (false, grandchildren);
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        for g in &grandchildren {
            let _ = std::process::Command::new("kill")
                .arg(g.to_string())
                .status();
        }
        let _ = child.kill();
        let _ = child.wait();
        assert!(
            found,
            "sh (pid {}) and its sleep not both found",
            child.id()
        );
    }

    #[test]
    fn finds_own_process_and_a_real_listener() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let me = std::process::id();
        let ports = listening_ports(Path::new("/proc"));
        assert!(
            ports.get(&me).is_some_and(|p| p.contains(&port)),
            "own listener on {port} not found: {:?}",
            ports.get(&me)
        );
        let info = process_info(Path::new("/proc"), me).expect("own /proc entry");
        assert_eq!(info.pid, me);
        assert!(!info.comm.is_empty());
        assert!(!info.exe.is_empty());
    }
}
