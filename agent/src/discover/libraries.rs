//! Which files of a traced process carry something to probe: OpenSSL
//! (`libssl.so*`, or an executable exporting the SSL symbols), the CUDA
//! runtime or driver (`libcudart.so*`, `libcuda.so*`), and `llm:*` USDT
//! probes (any mapped file with a `.note.stapsdt` naming provider `llm`).
//!
//! Paths go through `/proc/PID/root`, so files inside a container are found
//! by the host agent. A file is identified by (device, inode): it is
//! inspected once and probed once however many processes map it, and
//! unprobed when its last traced user exits.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use object::read::ReadCache;
use object::{Object, ObjectSection, ObjectSymbol};

use crate::probes::CudaLibrary;

/// OpenSSL functions the TLS probes attach to. A file qualifies when it
/// defines at least one read and one write function.
pub const TLS_READ_SYMBOLS: [&str; 2] = ["SSL_read", "SSL_read_ex"];
pub const TLS_WRITE_SYMBOLS: [&str; 2] = ["SSL_write", "SSL_write_ex"];

/// Identity of a file on the host.
pub type FileKey = (u64, u64);

/// What a file offers to the probes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FileProbes {
    /// OpenSSL data functions the file defines.
    pub tls: Vec<&'static str>,
    pub cuda: Option<CudaLibrary>,
    /// Names of the `llm:*` USDT probes in the file.
    pub usdt: Vec<String>,
}

impl FileProbes {
    pub fn is_empty(&self) -> bool {
        self.tls.is_empty() && self.cuda.is_none() && self.usdt.is_empty()
    }

    /// One line for logs and `tokentrace check`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if !self.tls.is_empty() {
            parts.push(format!("OpenSSL ({})", self.tls.join(", ")));
        }
        match self.cuda {
            Some(CudaLibrary::Runtime) => parts.push("CUDA runtime".to_string()),
            Some(CudaLibrary::Driver) => parts.push("CUDA driver".to_string()),
            None => {}
        }
        if !self.usdt.is_empty() {
            parts.push(format!("USDT llm:{{{}}}", self.usdt.join(",")));
        }
        parts.join("; ")
    }
}

/// A file to probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbedFile {
    pub key: FileKey,
    /// Openable from the agent (through `/proc/PID/root`).
    pub path: PathBuf,
    /// The path as the process sees it.
    pub mapped_as: String,
    pub probes: FileProbes,
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

fn file_name(path: &str) -> &str {
    Path::new(path)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("")
}

/// `llm` probe names in an ELF `.note.stapsdt` section.
fn llm_usdt_probes(notes: &[u8]) -> Vec<String> {
    const NT_STAPSDT: u32 = 3;
    let word = |at: usize| -> Option<u32> {
        notes
            .get(at..at + 4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_ne_bytes)
    };
    let align4 = |n: usize| (n + 3) & !3;
    let mut probes = Vec::new();
    let mut at = 0;
    while let (Some(namesz), Some(descsz), Some(kind)) = (word(at), word(at + 4), word(at + 8)) {
        let name_start = at + 12;
        let desc_start = name_start + align4(namesz as usize);
        let desc_end = desc_start + descsz as usize;
        let Some(desc) = notes.get(desc_start..desc_end) else {
            break;
        };
        // desc: pc, base, semaphore (3 × 8 bytes on 64-bit), then
        // provider\0name\0args\0.
        if kind == NT_STAPSDT && desc.len() > 24 {
            let mut strings = desc[24..].split(|&b| b == 0);
            if let (Some(provider), Some(name)) = (strings.next(), strings.next()) {
                if provider == b"llm" {
                    probes.push(String::from_utf8_lossy(name).into_owned());
                }
            }
        }
        at = align4(desc_end);
    }
    probes.sort();
    probes.dedup();
    probes
}

/// Inspects one file: which probes it can take. Reads only the ELF
/// headers, dynamic symbols and the USDT notes, not the whole file (CUDA
/// and framework libraries are hundreds of megabytes).
pub fn inspect(path: &Path, is_main_executable: bool) -> FileProbes {
    let Ok(file) = std::fs::File::open(path) else {
        return FileProbes::default();
    };
    let cache = ReadCache::new(file);
    let Ok(elf) = object::File::parse(&cache) else {
        return FileProbes::default();
    };
    let name = file_name(path.to_str().unwrap_or(""));
    let mut probes = FileProbes::default();
    if let Some(section) = elf.section_by_name(".note.stapsdt") {
        if let Ok(data) = section.data() {
            probes.usdt = llm_usdt_probes(data);
        }
    }
    let tls_candidate =
        name.starts_with("libssl.so") || name.starts_with("libssl3.so") || is_main_executable;
    let cuda_candidate = name.starts_with("libcudart.so") || name.starts_with("libcuda.so");
    if tls_candidate || cuda_candidate {
        let defined: HashSet<String> = elf
            .dynamic_symbols()
            .filter(|sym| sym.is_definition())
            .filter_map(|sym| sym.name().ok().map(str::to_string))
            .collect();
        if tls_candidate {
            let tls: Vec<&'static str> = TLS_READ_SYMBOLS
                .iter()
                .chain(TLS_WRITE_SYMBOLS.iter())
                .copied()
                .filter(|s| defined.contains(*s))
                .collect();
            let reads = tls.iter().any(|s| TLS_READ_SYMBOLS.contains(s));
            let writes = tls.iter().any(|s| TLS_WRITE_SYMBOLS.contains(s));
            if reads && writes {
                probes.tls = tls;
            }
        }
        if name.starts_with("libcudart.so") && defined.contains("cudaLaunchKernel") {
            probes.cuda = Some(CudaLibrary::Runtime);
        } else if name.starts_with("libcuda.so") && defined.contains("cuLaunchKernel") {
            probes.cuda = Some(CudaLibrary::Driver);
        }
    }
    probes
}

/// The files `pid` maps that carry probes. `inspected` caches verdicts by
/// file so a big library is parsed once per agent run.
pub fn find_probed_files(
    proc_root: &Path,
    pid: u32,
    inspected: &mut HashMap<FileKey, FileProbes>,
) -> Vec<ProbedFile> {
    let root = proc_root.join(pid.to_string()).join("root");
    let exe = std::fs::read_link(proc_root.join(pid.to_string()).join("exe"))
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    let mut found = Vec::new();
    for mapped in executable_mappings(proc_root, pid) {
        let path = root.join(mapped.trim_start_matches('/'));
        let Ok(meta) = std::fs::metadata(&path) else {
            continue;
        };
        let key = (meta.dev(), meta.ino());
        let probes = inspected
            .entry(key)
            .or_insert_with(|| inspect(&path, mapped == exe))
            .clone();
        if !probes.is_empty() {
            found.push(ProbedFile {
                key,
                path,
                mapped_as: mapped,
                probes,
            });
        }
    }
    found
}

/// Which traced processes use which probed file.
#[derive(Debug, Default)]
pub struct ProbedFiles {
    inspected: HashMap<FileKey, FileProbes>,
    users: HashMap<FileKey, HashSet<u32>>,
}

/// What to do with the probes after a change in users.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileChange {
    Attach(ProbedFile),
    Detach(FileKey),
}

impl ProbedFiles {
    /// Re-reads `pid`'s maps; files not probed yet are to be attached.
    pub fn scan(&mut self, proc_root: &Path, pid: u32) -> Vec<FileChange> {
        let mut changes = Vec::new();
        for file in find_probed_files(proc_root, pid, &mut self.inspected) {
            let users = self.users.entry(file.key).or_default();
            if users.is_empty() {
                changes.push(FileChange::Attach(file));
            }
            users.insert(pid);
        }
        changes
    }

    /// `pid` exited: files no traced process uses any more are detached.
    pub fn process_exited(&mut self, pid: u32) -> Vec<FileChange> {
        let mut changes = Vec::new();
        self.users.retain(|key, users| {
            if users.remove(&pid) && users.is_empty() {
                changes.push(FileChange::Detach(*key));
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
    fn libssl_defines_the_probed_symbols_and_other_files_do_not() {
        let libssl = system_libssl()
            .expect("libssl.so.3 is installed on this machine (a dependency of python3/curl)");
        let probes = inspect(&libssl, false);
        for name in ["SSL_read", "SSL_write", "SSL_read_ex", "SSL_write_ex"] {
            assert!(probes.tls.contains(&name), "{name} missing from {probes:?}");
        }
        assert_eq!(probes.cuda, None);
        // This test binary defines no SSL function and has no llm notes.
        let me = std::env::current_exe().expect("current exe");
        assert!(inspect(&me, true).is_empty());
    }

    #[test]
    fn parses_llm_probes_from_stapsdt_notes() {
        fn note(provider: &str, name: &str) -> Vec<u8> {
            let mut desc = vec![0u8; 24];
            desc.extend_from_slice(format!("{provider}\0{name}\0-8@%rdi\0").as_bytes());
            let mut out = Vec::new();
            out.extend_from_slice(&8u32.to_ne_bytes());
            out.extend_from_slice(&(desc.len() as u32).to_ne_bytes());
            out.extend_from_slice(&3u32.to_ne_bytes());
            out.extend_from_slice(b"stapsdt\0");
            out.extend_from_slice(&desc);
            while out.len() % 4 != 0 {
                out.push(0);
            }
            out
        }
        let mut notes = note("llm", "token");
        notes.extend(note("python", "function__entry"));
        notes.extend(note("llm", "request_start"));
        notes.extend(note("llm", "token"));
        assert_eq!(llm_usdt_probes(&notes), vec!["request_start", "token"]);
        // Truncated input stops cleanly.
        assert_eq!(llm_usdt_probes(&notes[..10]), Vec::<String>::new());
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
        let mut files = ProbedFiles::default();
        let first = files.scan(Path::new("/proc"), pid);
        let _ = child.kill();
        let _ = child.wait();
        let libssl: Vec<&ProbedFile> = first
            .iter()
            .filter_map(|c| match c {
                FileChange::Attach(f) if !f.probes.tls.is_empty() => Some(f),
                _ => None,
            })
            .collect();
        let [lib] = libssl.as_slice() else {
            panic!("expected one OpenSSL file to attach, got {first:?}");
        };
        assert!(lib.mapped_as.contains("libssl"), "{lib:?}");
        assert!(lib.path.starts_with(format!("/proc/{pid}/root")));
        assert!(
            files.scan(Path::new("/proc"), pid).is_empty(),
            "already attached: no second attach"
        );
        assert!(files
            .process_exited(pid)
            .contains(&FileChange::Detach(lib.key)));
    }
}
