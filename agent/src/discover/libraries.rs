//! Which files of a traced process carry something to probe: OpenSSL
//! (`libssl.so*`, or any other mapped ELF that exports the SSL symbols:
//! node links OpenSSL statically into its executable, other runtimes into
//! a shared library of their own), the CUDA
//! runtime or driver (`libcudart.so*`, `libcuda.so*`), and `llm:*` USDT
//! probes (any mapped file with a `.note.stapsdt` naming provider `llm`),
//! and where in each function the probe goes (`placement`).
//!
//! Paths go through `/proc/PID/root`, so files inside a container are found
//! by the host agent. A file is identified by (device, inode): it is
//! inspected once however many processes map it.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use iced_x86::Register;
use object::{Object, ObjectSection, ObjectSymbol};

use super::elf_reader::ElfReader;
use super::placement::{kernel_emulates_long_nops, Code, Needs, Placement, ARG_REGISTERS};

/// OpenSSL functions the TLS probes stand for. A file qualifies when it
/// defines at least one read and one write function.
pub const TLS_READ_SYMBOLS: [&str; 2] = ["SSL_read", "SSL_read_ex"];
pub const TLS_WRITE_SYMBOLS: [&str; 2] = ["SSL_write", "SSL_write_ex"];

/// Identity of a file on the host.
pub type FileKey = (u64, u64);

/// Which CUDA library a file is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaLibrary {
    /// libcudart: the runtime API (`cuda*`).
    Runtime,
    /// libcuda: the driver API (`cu*`).
    Driver,
}

const RDI: &[Register] = &[Register::RDI];
const NONE: &[Register] = &[];
const ENTRY_ONLY: bool = false;
const WITH_RETURN: bool = true;

/// The probed functions, the argument registers their programs read, and
/// whether their return is probed too.
const TLS_FUNCTIONS: [(&str, &[Register], bool); 6] = [
    ("SSL_read", &[Register::RDI, Register::RSI], WITH_RETURN),
    ("SSL_write", &[Register::RDI, Register::RSI], WITH_RETURN),
    ("SSL_read_ex", &ARG_REGISTERS, WITH_RETURN),
    ("SSL_write_ex", &ARG_REGISTERS, WITH_RETURN),
    // The handshake ties the SSL* to its socket before any data; SSL_free
    // ends the connection. Optional: data works without.
    ("SSL_do_handshake", RDI, WITH_RETURN),
    ("SSL_free", RDI, ENTRY_ONLY),
];
const CUDA_RUNTIME_FUNCTIONS: [(&str, &[Register], bool); 6] = [
    ("cudaLaunchKernel", NONE, ENTRY_ONLY),
    ("cudaGraphLaunch", NONE, ENTRY_ONLY),
    ("cudaMemcpyAsync", &[Register::RDX], ENTRY_ONLY),
    ("cudaStreamSynchronize", RDI, WITH_RETURN),
    ("cudaDeviceSynchronize", NONE, WITH_RETURN),
    ("cudaEventSynchronize", RDI, WITH_RETURN),
];
const CUDA_DRIVER_FUNCTIONS: [(&str, &[Register], bool); 4] = [
    ("cuLaunchKernel", NONE, ENTRY_ONLY),
    ("cuLaunchKernelEx", NONE, ENTRY_ONLY),
    ("cuStreamSynchronize", RDI, WITH_RETURN),
    ("cuCtxSynchronize", NONE, WITH_RETURN),
];

/// One probe to attach: the function it stands for and where it goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Site {
    /// The API function whose calls the probe sees. When an internal
    /// helper is probed instead (OpenSSL's `ssl_read_internal`), the `_ex`
    /// function whose arguments the helper takes.
    pub function: &'static str,
    pub placement: Placement,
    /// A return probe is attached at the same place.
    pub return_probe: bool,
}

/// What a file offers to the probes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FileProbes {
    /// OpenSSL probe sites (empty: not an OpenSSL file).
    pub tls: Vec<Site>,
    pub cuda: Option<CudaLibrary>,
    /// CUDA probe sites of `cuda`.
    pub cuda_sites: Vec<Site>,
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
            let functions: Vec<&str> = self.tls.iter().map(|s| s.function).collect();
            parts.push(format!("OpenSSL ({})", functions.join(", ")));
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

    /// Every uprobe site (OpenSSL, then CUDA).
    pub fn sites(&self) -> impl Iterator<Item = &Site> {
        self.tls.iter().chain(&self.cuda_sites)
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
            let (perms, path) = maps_line(line)?;
            (perms.contains('x') && path.starts_with('/')).then(|| path.to_string())
        })
        .collect();
    paths.sort();
    paths.dedup();
    paths
}

/// `(perms, pathname)` of one `/proc/PID/maps` line. The pathname is
/// everything after the fifth field, spaces included (a file under
/// `/opt/My Models/` is one path); a file replaced on disk keeps its old
/// mapping with ` (deleted)` appended, which is not part of the path.
fn maps_line(line: &str) -> Option<(&str, &str)> {
    // address, perms, offset, dev, inode
    let mut fields = [""; 5];
    let mut rest = line;
    for field in &mut fields {
        rest = rest.trim_start();
        let end = rest.find(char::is_whitespace)?;
        (*field, rest) = rest.split_at(end);
    }
    let path = rest.trim_start();
    let path = path.strip_suffix(" (deleted)").unwrap_or(path);
    (!path.is_empty()).then_some((fields[1], path))
}

fn file_name(path: &str) -> &str {
    Path::new(path)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("")
}

/// `llm` probe names in the `.note.stapsdt` section of a 64-bit ELF file
/// (`align`: the section's `sh_addralign`). Notes are walked by `object`'s
/// note iterator; a malformed one ends the walk with what came before it.
fn llm_usdt_probes(notes: &[u8], endian: object::Endianness, align: u64) -> Vec<String> {
    type Elf64 = object::elf::FileHeader64<object::Endianness>;
    let Ok(mut iter) = object::read::elf::NoteIterator::<Elf64>::new(endian, align, notes) else {
        return Vec::new();
    };
    let mut probes = Vec::new();
    while let Ok(Some(note)) = iter.next() {
        // desc: pc, base, semaphore (3 × 8 bytes), then
        // provider\0name\0args\0.
        let desc = note.desc();
        if note.name() != b"stapsdt" || note.n_type(endian) != NT_STAPSDT || desc.len() <= 24 {
            continue;
        }
        let mut strings = desc[24..].split(|&b| b == 0);
        if let (Some(b"llm"), Some(name)) = (strings.next(), strings.next()) {
            probes.push(String::from_utf8_lossy(name).into_owned());
        }
    }
    probes.sort();
    probes.dedup();
    probes
}

/// The note type of a SystemTap (USDT) probe.
const NT_STAPSDT: u32 = 3;

/// Sites for `functions` the file defines, each at its cheapest place.
fn place_all<'d, R: object::ReadRef<'d>>(
    code: &Code<'d, R>,
    functions: &[(&'static str, &'static [Register], bool)],
) -> Vec<Site> {
    functions
        .iter()
        .filter_map(|&(function, reads, return_probe)| {
            let needs = Needs {
                return_probe,
                reads,
            };
            code.place(function, needs).map(|placement| Site {
                function,
                placement,
                return_probe,
            })
        })
        .collect()
}

/// OpenSSL sites. The data functions go through the internal helpers when
/// the file's bytes show the OpenSSL 1.1/3.0 pattern (`SSL_read` and
/// `SSL_read_ex` first call one helper taking the `_ex` arguments, whose
/// entry is an emulated `push`): one probe there covers both functions at
/// emulated cost. Otherwise the exported functions are probed.
fn tls_sites<'d, R: object::ReadRef<'d>>(code: &Code<'d, R>) -> Vec<Site> {
    let mut sites = place_all(code, &TLS_FUNCTIONS);
    let reads = sites.iter().any(|s| TLS_READ_SYMBOLS.contains(&s.function));
    let writes = sites
        .iter()
        .any(|s| TLS_WRITE_SYMBOLS.contains(&s.function));
    if !(reads && writes) {
        return Vec::new();
    }
    for (ex, plain) in [("SSL_read_ex", "SSL_read"), ("SSL_write_ex", "SSL_write")] {
        if let Some(placement) = code.shared_callee(ex, plain) {
            sites.retain(|s| s.function != ex && s.function != plain);
            sites.push(Site {
                function: ex,
                placement,
                return_probe: true,
            });
        }
    }
    sites
}

/// The file defines (exports) an OpenSSL read and write function in its
/// dynamic symbol table: OpenSSL linked statically into an executable or a
/// library not named libssl (node exports them for its addons). One pass
/// over `.dynsym`, so every mapped file can be asked cheaply; the full
/// symbol search of `placement` runs only for files that pass.
fn exports_openssl<'d, R: object::ReadRef<'d>>(elf: &object::File<'d, R>) -> bool {
    let (mut read, mut write) = (false, false);
    for sym in elf.dynamic_symbols() {
        if !sym.is_definition() {
            continue;
        }
        let Ok(name) = sym.name() else { continue };
        read |= TLS_READ_SYMBOLS.contains(&name);
        write |= TLS_WRITE_SYMBOLS.contains(&name);
        if read && write {
            return true;
        }
    }
    false
}

/// One of OpenSSL's read or write functions the TLS probes stand for.
fn is_openssl_io(name: &str) -> bool {
    TLS_READ_SYMBOLS.contains(&name) || TLS_WRITE_SYMBOLS.contains(&name)
}

/// grpcio's extension module (`cygrpc.*.so` of the PyPI wheels) carries
/// BoringSSL linked in statically and stripped: grpc-core does TLS inside
/// it, on memory BIOs, through functions no symbol names, so nothing can be
/// probed (h2c gRPC is traced from the socket calls). Debian's
/// python3-grpcio links the system libssl instead: its cygrpc imports
/// `SSL_read`/`SSL_write`, and the libssl it maps is probed as usual.
fn is_opaque_grpc_tls<'d, R: object::ReadRef<'d>>(name: &str, elf: &object::File<'d, R>) -> bool {
    if !(name.starts_with("cygrpc.") && name.contains(".so")) {
        return false;
    }
    !elf.dynamic_symbols()
        .any(|sym| sym.name().is_ok_and(is_openssl_io))
}

/// Files `pid` maps whose TLS cannot be traced (no symbols to probe), with
/// why: grpcio wheels' cygrpc with its stripped, statically linked
/// BoringSSL. For `tokentrace check --pid` and the agent's log.
pub fn opaque_tls_files(proc_root: &Path, pid: u32) -> Vec<(String, &'static str)> {
    let root = proc_root.join(pid.to_string()).join("root");
    let mut out = Vec::new();
    for mapped in executable_mappings(proc_root, pid) {
        let name = file_name(&mapped);
        if !name.starts_with("cygrpc.") {
            continue;
        }
        let path = root.join(mapped.trim_start_matches('/'));
        let Ok(reader) = ElfReader::open(&path) else {
            continue;
        };
        let Ok(elf) = reader.parse() else {
            continue;
        };
        if is_opaque_grpc_tls(name, &elf) {
            out.push((
                mapped.clone(),
                "grpcio's BoringSSL is linked in statically and stripped (no SSL symbols): \
                 TLS gRPC served by this process cannot be traced; h2c (plaintext) gRPC is",
            ));
        }
    }
    out
}

/// Inspects one file: which probes it can take and where. Reads only the
/// ELF headers, symbols, the USDT notes and the probed functions' first
/// bytes, not the whole file (CUDA and framework libraries are hundreds of
/// megabytes); see `ElfReader`.
pub fn inspect(path: &Path, is_main_executable: bool) -> FileProbes {
    let Ok(reader) = ElfReader::open(path) else {
        return FileProbes::default();
    };
    let name = file_name(path.to_str().unwrap_or(""));
    let cuda = if name.starts_with("libcudart.so") {
        Some((CudaLibrary::Runtime, &CUDA_RUNTIME_FUNCTIONS[..]))
    } else if name.starts_with("libcuda.so") {
        Some((CudaLibrary::Driver, &CUDA_DRIVER_FUNCTIONS[..]))
    } else {
        None
    };
    let tls_by_name =
        name.starts_with("libssl.so") || name.starts_with("libssl3.so") || is_main_executable;
    // Most mapped files (a vLLM process maps ~100) carry nothing: decided
    // from the section headers and dynamic symbols, before a full parse.
    if !tls_by_name && cuda.is_none() {
        let openssl = |s: &[u8]| std::str::from_utf8(s).is_ok_and(is_openssl_io);
        if reader.glance(b".note.stapsdt", openssl) == Some((false, false)) {
            return FileProbes::default();
        }
    }
    let Ok(elf) = reader.parse() else {
        return FileProbes::default();
    };
    let mut probes = FileProbes::default();
    if let Some(section) = elf.section_by_name(".note.stapsdt").filter(|_| elf.is_64()) {
        if let Ok(data) = section.data() {
            probes.usdt = llm_usdt_probes(data, elf.endianness(), section.align());
        }
    }
    let tls_candidate = tls_by_name || exports_openssl(&elf);
    let code = Code::new(&elf, &reader, kernel_emulates_long_nops());
    if tls_candidate {
        probes.tls = tls_sites(&code);
    }
    if let Some((library, functions)) = cuda {
        let sites = place_all(&code, functions);
        // The launch function identifies the library (a stub libcuda.so
        // without it is not the driver).
        if sites.iter().any(|s| s.function == functions[0].0) {
            probes.cuda = Some(library);
            probes.cuda_sites = sites;
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

/// For which processes uprobes are attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UprobeScope {
    /// Per traced process: breakpoints exist only in traced processes'
    /// memory; attached for each process that maps a probed file.
    #[default]
    Traced,
    /// Once per file for every process (pid -1): one attach per file, but
    /// every process mapping the file takes each probe's trap, traced or
    /// not (the pid filter runs after it). Opt-in.
    AllProcesses,
}

/// Which traced processes use which probed file.
#[derive(Debug, Default)]
pub struct ProbedFiles {
    scope: UprobeScope,
    inspected: HashMap<FileKey, FileProbes>,
    users: HashMap<FileKey, HashSet<u32>>,
}

/// What to do with the probes after a change in users. `pid` None: for
/// every process (`UprobeScope::AllProcesses`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileChange {
    Attach { pid: Option<u32>, file: ProbedFile },
    Detach { pid: Option<u32>, key: FileKey },
}

impl ProbedFiles {
    pub fn new(scope: UprobeScope) -> Self {
        Self {
            scope,
            ..Self::default()
        }
    }

    /// Re-reads `pid`'s maps; files it was not probed in yet are to be
    /// attached (for it, or for everyone on a file's first user).
    pub fn scan(&mut self, proc_root: &Path, pid: u32) -> Vec<FileChange> {
        let mut changes = Vec::new();
        for file in find_probed_files(proc_root, pid, &mut self.inspected) {
            let users = self.users.entry(file.key).or_default();
            let first_user = users.is_empty();
            if !users.insert(pid) {
                continue;
            }
            match self.scope {
                UprobeScope::Traced => changes.push(FileChange::Attach {
                    pid: Some(pid),
                    file,
                }),
                UprobeScope::AllProcesses if first_user => {
                    changes.push(FileChange::Attach { pid: None, file })
                }
                UprobeScope::AllProcesses => {}
            }
        }
        changes
    }

    /// `pid` exited or is no longer traced: its probes are detached (or a
    /// file's, when no traced process uses it any more).
    pub fn process_gone(&mut self, pid: u32) -> Vec<FileChange> {
        let mut changes = Vec::new();
        let scope = self.scope;
        self.users.retain(|&key, users| {
            if !users.remove(&pid) {
                return true;
            }
            match scope {
                UprobeScope::Traced => changes.push(FileChange::Detach {
                    pid: Some(pid),
                    key,
                }),
                UprobeScope::AllProcesses if users.is_empty() => {
                    changes.push(FileChange::Detach { pid: None, key })
                }
                UprobeScope::AllProcesses => {}
            }
            !users.is_empty()
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
        // Debian's OpenSSL 3.0: the four data functions through the two
        // internal helpers, each at an emulated push, with return probes.
        let data: Vec<&Site> = probes
            .tls
            .iter()
            .filter(|s| s.function.starts_with("SSL_read") || s.function.starts_with("SSL_write"))
            .collect();
        assert_eq!(data.len(), 2, "{probes:#?}");
        for site in data {
            assert!(site.function.ends_with("_ex"), "{site:?}");
            assert!(site.placement.emulated && site.return_probe, "{site:?}");
            assert!(site.placement.at.contains("called by"), "{site:?}");
        }
        assert!(probes.tls.iter().any(|s| s.function == "SSL_do_handshake"));
        assert_eq!(probes.cuda, None);
        // This test binary defines no SSL function and has no llm notes.
        let me = std::env::current_exe().expect("current exe");
        assert!(inspect(&me, true).is_empty());
    }

    #[test]
    fn any_elf_exporting_the_ssl_functions_is_an_openssl_file() {
        // OpenSSL inside a file not named libssl that is not the process's
        // executable either (node's, a runtime's own library): a copy of
        // libssl under another name stands for it.
        let libssl = system_libssl().expect("libssl.so.3 is installed on this machine");
        let dir =
            std::env::temp_dir().join(format!("tokentrace-static-ssl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let copy = dir.join("libruntime-with-openssl.so");
        std::fs::copy(&libssl, &copy).expect("copy libssl");
        let probes = inspect(&copy, false);
        let _ = std::fs::remove_dir_all(&dir);
        let functions: Vec<&str> = probes.tls.iter().map(|s| s.function).collect();
        assert!(
            functions.contains(&"SSL_read_ex") && functions.contains(&"SSL_write_ex"),
            "{probes:#?}"
        );
    }

    #[test]
    fn a_cygrpc_without_ssl_symbols_is_opaque_tls_and_one_importing_them_is_not() {
        // This test binary exports no SSL function: as a cygrpc it is the
        // wheel's stripped BoringSSL case; libssl (which defines them) is
        // the case of a cygrpc linked against the system OpenSSL.
        let me = std::env::current_exe().expect("current exe");
        let libssl = system_libssl().expect("libssl.so.3 is installed on this machine");
        for (path, opaque) in [(me, true), (libssl, false)] {
            let data = std::fs::read(&path).expect("read ELF");
            let elf = object::File::parse(&*data).expect("parse ELF");
            assert_eq!(
                is_opaque_grpc_tls("cygrpc.cpython-311-x86_64-linux-gnu.so", &elf),
                opaque,
                "{}",
                path.display()
            );
            assert!(
                !is_opaque_grpc_tls("libfoo.so", &elf),
                "only grpcio's module"
            );
        }
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
        let native = object::Endianness::default();
        assert_eq!(
            llm_usdt_probes(&notes, native, 4),
            vec!["request_start", "token"]
        );
        // Truncated input stops cleanly, keeping the notes before the cut.
        assert_eq!(
            llm_usdt_probes(&notes[..10], native, 4),
            Vec::<String>::new()
        );
        let first = note("llm", "token").len();
        assert_eq!(
            llm_usdt_probes(&notes[..first + 10], native, 4),
            vec!["token"]
        );
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
        let mut files = ProbedFiles::new(UprobeScope::Traced);
        let mut global = ProbedFiles::new(UprobeScope::AllProcesses);
        let first = files.scan(Path::new("/proc"), pid);
        // Two users of the same files: attached for everyone once.
        let global_first = global.scan(Path::new("/proc"), pid);
        let global_second = global.scan(Path::new("/proc"), std::process::id());
        let _ = child.kill();
        let _ = child.wait();
        let libssl: Vec<&ProbedFile> = first
            .iter()
            .filter_map(|c| match c {
                FileChange::Attach { pid: Some(p), file }
                    if *p == pid && !file.probes.tls.is_empty() =>
                {
                    Some(file)
                }
                _ => None,
            })
            .collect();
        let [lib] = libssl.as_slice() else {
            panic!("expected one OpenSSL file to attach for pid {pid}, got {first:?}");
        };
        assert!(lib.mapped_as.contains("libssl"), "{lib:?}");
        assert!(lib.path.starts_with(format!("/proc/{pid}/root")));
        assert!(
            files.scan(Path::new("/proc"), pid).is_empty(),
            "already attached: no second attach"
        );
        assert!(files.process_gone(pid).contains(&FileChange::Detach {
            pid: Some(pid),
            key: lib.key
        }));
        assert!(global_first
            .iter()
            .any(|c| matches!(c, FileChange::Attach { pid: None, file } if file.key == lib.key)));
        assert!(
            !global_second
                .iter()
                .any(|c| matches!(c, FileChange::Attach { file, .. } if file.key == lib.key)),
            "libssl already attached for every process: {global_second:?}"
        );
    }

    #[test]
    fn maps_lines_keep_paths_with_spaces_whole() {
        assert_eq!(
            maps_line(
                "7f2c1000-7f2c2000 r-xp 00001000 fd:01 1234    /opt/My Models/lib/libssl.so.3"
            ),
            Some(("r-xp", "/opt/My Models/lib/libssl.so.3"))
        );
        assert_eq!(
            maps_line(
                "7f2c1000-7f2c2000 r-xp 00001000 fd:01 1234 /usr/lib/libcudart.so.12 (deleted)"
            ),
            Some(("r-xp", "/usr/lib/libcudart.so.12"))
        );
        assert_eq!(
            maps_line("7ffd1000-7ffd2000 rw-p 00000000 00:00 0                          [stack]"),
            Some(("rw-p", "[stack]"))
        );
        assert_eq!(maps_line("7f2c1000-7f2c2000 rw-p 00000000 00:00 0"), None);
        assert_eq!(maps_line("garbage"), None);
    }
}
