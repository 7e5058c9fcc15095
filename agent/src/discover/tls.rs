//! Where the OpenSSL a process really uses lives: `libssl.so*` in its
//! memory maps, or its own executable when that exports the SSL symbols.
//! Paths go through `/proc/PID/root` so a library inside a container is
//! found by the host agent. A library file is identified by (device, inode)
//! so it is probed once however many processes map it.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The exported functions the TLS probes attach to. A file qualifies when it
/// defines at least one read and one write function.
pub const READ_SYMBOLS: [&str; 2] = ["SSL_read", "SSL_read_ex"];
pub const WRITE_SYMBOLS: [&str; 2] = ["SSL_write", "SSL_write_ex"];

/// Identity of a library file on the host.
pub type LibraryKey = (u64, u64);

/// One OpenSSL-carrying file, ready to attach to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsLibrary {
    pub key: LibraryKey,
    /// Openable from the agent (through `/proc/PID/root`).
    pub path: PathBuf,
    /// The path as the process sees it.
    pub mapped_as: String,
    /// Which of the probed functions the file defines.
    pub symbols: Vec<&'static str>,
}

/// Executable file-backed mappings of `pid` (path as the process sees it).
fn executable_mappings(proc_root: &Path, pid: u32) -> Vec<String> {
    let Ok(maps) = std::fs::read_to_string(proc_root.join(pid.to_string()).join("maps")) else {
        return Vec::new();
    };
    let mut paths: Vec<String> = maps
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let perms = fields.nth(1)?;
            let path = fields.nth(3)?;
            (perms.contains('x') && path.starts_with('/')).then(|| path.to_string())
        })
        .collect();
    paths.sort();
    paths.dedup();
    paths
}

/// The probed SSL functions `file` defines (not merely imports).
pub fn defined_ssl_symbols(file: &Path) -> Vec<&'static str> {
    use object::{Object, ObjectSymbol};
    let Ok(data) = std::fs::read(file) else {
        return Vec::new();
    };
    let Ok(elf) = object::File::parse(&*data) else {
        return Vec::new();
    };
    let defined: HashSet<&str> = elf
        .dynamic_symbols()
        .filter(|sym| sym.is_definition())
        .filter_map(|sym| sym.name().ok())
        .collect();
    let mut found: Vec<&'static str> = READ_SYMBOLS
        .iter()
        .chain(WRITE_SYMBOLS.iter())
        .copied()
        .filter(|name| defined.contains(name))
        .collect();
    let reads = found.iter().any(|s| READ_SYMBOLS.contains(s));
    let writes = found.iter().any(|s| WRITE_SYMBOLS.contains(s));
    if !(reads && writes) {
        found.clear();
    }
    found
}

fn looks_like_libssl(path: &str) -> bool {
    Path::new(path)
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|name| name.starts_with("libssl.so") || name.starts_with("libssl3.so"))
}

/// Finds the OpenSSL files `pid` has mapped. `known` lists files already
/// inspected (by key) so that big executables are parsed once.
pub fn find_tls_libraries(
    proc_root: &Path,
    pid: u32,
    known: &HashMap<LibraryKey, bool>,
) -> Vec<TlsLibrary> {
    let root = proc_root.join(pid.to_string()).join("root");
    let exe = std::fs::read_link(proc_root.join(pid.to_string()).join("exe"))
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    let mut found = Vec::new();
    for mapped in executable_mappings(proc_root, pid) {
        // A libssl by name, or the main executable (statically linked
        // OpenSSL); other libraries are not worth parsing.
        if !looks_like_libssl(&mapped) && mapped != exe {
            continue;
        }
        let path = root.join(mapped.trim_start_matches('/'));
        let Ok(meta) = std::fs::metadata(&path) else {
            continue;
        };
        let key = (meta.dev(), meta.ino());
        if known.get(&key) == Some(&false) {
            continue;
        }
        let symbols = defined_ssl_symbols(&path);
        if symbols.is_empty() {
            continue;
        }
        found.push(TlsLibrary {
            key,
            path,
            mapped_as: mapped,
            symbols,
        });
    }
    found
}

/// Which traced processes use which OpenSSL file, so that each file is
/// probed once and unprobed when its last user exits.
#[derive(Debug, Default)]
pub struct TlsUsers {
    /// Every file inspected: true when it carries OpenSSL.
    inspected: HashMap<LibraryKey, bool>,
    users: HashMap<LibraryKey, HashSet<u32>>,
}

/// What to do with the probes after a change in users.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TlsChange {
    Attach(TlsLibrary),
    Detach(LibraryKey),
}

impl TlsUsers {
    /// Re-reads `pid`'s maps; new OpenSSL files are to be attached.
    pub fn scan(&mut self, proc_root: &Path, pid: u32) -> Vec<TlsChange> {
        let mut changes = Vec::new();
        for lib in find_tls_libraries(proc_root, pid, &self.inspected) {
            self.inspected.insert(lib.key, true);
            let users = self.users.entry(lib.key).or_default();
            if users.is_empty() {
                changes.push(TlsChange::Attach(lib));
            }
            users.insert(pid);
        }
        changes
    }

    /// `pid` exited: files no traced process uses any more are detached.
    pub fn process_exited(&mut self, pid: u32) -> Vec<TlsChange> {
        let mut changes = Vec::new();
        self.users.retain(|key, users| {
            if users.remove(&pid) && users.is_empty() {
                changes.push(TlsChange::Detach(*key));
                return false;
            }
            true
        });
        changes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn system_libssl() -> Option<PathBuf> {
        [
            "/usr/lib/x86_64-linux-gnu/libssl.so.3",
            "/lib/x86_64-linux-gnu/libssl.so.3",
        ]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
    }

    #[test]
    fn libssl_defines_the_probed_symbols_and_importers_do_not() {
        let libssl = system_libssl()
            .expect("libssl.so.3 is installed on this machine (a dependency of python3/curl)");
        let symbols = defined_ssl_symbols(&libssl);
        for name in ["SSL_read", "SSL_write", "SSL_read_ex", "SSL_write_ex"] {
            assert!(symbols.contains(&name), "{name} missing from {symbols:?}");
        }
        // This test binary imports nothing from libssl and defines none.
        let me = std::env::current_exe().expect("current exe");
        assert!(defined_ssl_symbols(&me).is_empty());
    }

    #[test]
    fn finds_libssl_in_a_process_that_loaded_it_and_tracks_users() {
        let mut child = std::process::Command::new("python3")
            .args([
                "-c",
                "import ssl, sys; print('ok', flush=True); sys.stdin.read()",
            ])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3 runs");
        let mut line = String::new();
        use std::io::BufRead;
        std::io::BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("python prints ok");
        let pid = child.id();
        let mut users = TlsUsers::default();
        let first = users.scan(Path::new("/proc"), pid);
        let _ = child.kill();
        let _ = child.wait();
        let [TlsChange::Attach(lib)] = first.as_slice() else {
            panic!("expected one library to attach, got {first:?}");
        };
        assert!(lib.mapped_as.contains("libssl"), "{lib:?}");
        assert!(lib.path.starts_with(format!("/proc/{pid}/root")));
        assert!(
            users.scan(Path::new("/proc"), pid).is_empty(),
            "already attached: no second attach"
        );
        assert_eq!(users.process_exited(pid), vec![TlsChange::Detach(lib.key)]);
    }
}
