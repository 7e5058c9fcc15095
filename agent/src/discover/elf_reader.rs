//! Reads an ELF file for `object` without holding it whole: the ranges
//! `object` asks for (headers, symbol arrays, a function's bytes) are read
//! as asked, and each string table is read whole on its first lookup.
//!
//! Why not `object::read::ReadCache`: it reads and keeps every string on
//! its own, one read(2) and one allocation per symbol name. Looking for
//! OpenSSL's exports in node's 75,000 dynamic symbols held 35 MB of heap
//! at once and took the agent's peak RSS from 58 to 93 MB when it attached
//! to a node server; here the same search holds node's `.dynstr` (5 MB) as
//! one block. Not an mmap: a file another process truncates while it is
//! mapped would kill the agent with SIGBUS.

use std::cell::RefCell;
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::Path;

use object::elf::{FileHeader64, SHN_UNDEF, SHT_DYNSYM, SHT_STRTAB};
use object::read::elf::{FileHeader, SectionHeader, SectionTable, Sym};
use object::{Endianness, ReadRef};

/// String tables past this size are looked up string by string instead.
const MAX_TABLE_BYTES: u64 = 256 << 20;
/// The longest string looked up outside a known string table.
const MAX_LOOSE_STRING: u64 = 4096;

pub struct ElfReader {
    file: File,
    len: u64,
    held: RefCell<Held>,
}

/// What was read. Entries are only ever added: the slices handed out point
/// into their boxes, which stay where they are until the reader is dropped.
#[derive(Default)]
struct Held {
    /// Exact ranges, by (offset, size).
    ranges: HashMap<(u64, u64), Box<[u8]>>,
    /// String tables known from the section headers: start by end offset
    /// (`object` looks a string up as `start + offset .. end`).
    table_starts: HashMap<u64, u64>,
    /// String tables read whole, by end offset.
    tables: HashMap<u64, Box<[u8]>>,
    /// Strings outside known tables, by (offset, delimiter).
    loose: HashMap<(u64, u8), Box<[u8]>>,
}

impl ElfReader {
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = File::open(path)?;
        let len = file.metadata()?.len();
        Ok(Self {
            file,
            len,
            held: RefCell::default(),
        })
    }

    /// Parses the file; its string tables are then read whole when first
    /// looked up.
    pub fn parse(&self) -> object::Result<object::File<'_, &Self>> {
        let elf = object::File::parse(self)?;
        let tables = match &elf {
            object::File::Elf32(f) => string_tables(f.elf_section_table(), f.endian()),
            object::File::Elf64(f) => string_tables(f.elf_section_table(), f.endian()),
            _ => Vec::new(),
        };
        self.held.borrow_mut().table_starts.extend(tables);
        Ok(elf)
    }

    /// A look at a 64-bit file's section headers and dynamic symbols only,
    /// without `parse`, which reads the whole `.symtab` array up front
    /// (12.7 MB in torch's `libtorch_cpu.so`): whether it has a section
    /// named `section`, and whether it defines a dynamic symbol that
    /// `wanted` accepts. None where the file is not a 64-bit ELF file.
    pub fn glance(&self, section: &[u8], wanted: impl Fn(&[u8]) -> bool) -> Option<(bool, bool)> {
        let header = FileHeader64::<Endianness>::parse(self).ok()?;
        let endian = header.endian().ok()?;
        let sections = header.sections(endian, self).ok()?;
        self.held
            .borrow_mut()
            .table_starts
            .extend(string_tables(&sections, endian));
        let has_section = sections.section_by_name(endian, section).is_some();
        let symbols = sections.symbols(endian, self, SHT_DYNSYM).ok()?;
        let strings = symbols.strings();
        let defines = symbols.iter().any(|sym| {
            sym.st_shndx(endian) != SHN_UNDEF && sym.name(endian, strings).is_ok_and(&wanted)
        });
        Some((has_section, defines))
    }

    /// Bytes read and held so far.
    #[cfg(test)]
    fn held_bytes(&self) -> usize {
        let held = self.held.borrow();
        held.ranges
            .values()
            .chain(held.tables.values())
            .chain(held.loose.values())
            .map(|bytes| bytes.len())
            .sum()
    }

    fn read(&self, offset: u64, size: u64) -> Result<Box<[u8]>, ()> {
        let mut bytes = Vec::new();
        let size = usize::try_from(size).map_err(|_| ())?;
        bytes.try_reserve_exact(size).map_err(|_| ())?;
        bytes.resize(size, 0);
        self.file
            .read_exact_at(&mut bytes, offset)
            .map_err(|_| ())?;
        Ok(bytes.into_boxed_slice())
    }
}

/// (end, start) file offsets of the string tables among `sections`.
fn string_tables<'d, Elf: FileHeader, R: ReadRef<'d>>(
    sections: &SectionTable<'d, Elf, R>,
    endian: Elf::Endian,
) -> Vec<(u64, u64)> {
    sections
        .iter()
        .filter(|s| s.sh_type(endian) == SHT_STRTAB)
        .filter_map(|s| s.file_range(endian))
        .filter(|&(_, size)| size > 0 && size <= MAX_TABLE_BYTES)
        .map(|(start, size)| (start + size, start))
        .collect()
}

/// A slice of a box `held` keeps until the reader is dropped.
fn extend<'a>(bytes: &[u8]) -> &'a [u8] {
    // SAFETY: every box in `Held` lives, unmoved and unchanged, as long as
    // the `ElfReader` (entries are never removed or replaced), and `'a` is
    // the lifetime of the `&'a ElfReader` the slice is handed out through.
    unsafe { std::mem::transmute::<&[u8], &'a [u8]>(bytes) }
}

impl<'a> ReadRef<'a> for &'a ElfReader {
    fn len(self) -> Result<u64, ()> {
        Ok(self.len)
    }

    fn read_bytes_at(self, offset: u64, size: u64) -> Result<&'a [u8], ()> {
        if size == 0 {
            return Ok(&[]);
        }
        if offset.checked_add(size).is_none_or(|end| end > self.len) {
            return Err(());
        }
        let held = &mut *self.held.borrow_mut();
        if let Some(bytes) = held.ranges.get(&(offset, size)) {
            return Ok(extend(bytes));
        }
        let bytes = self.read(offset, size)?;
        Ok(extend(held.ranges.entry((offset, size)).or_insert(bytes)))
    }

    fn read_bytes_at_until(self, range: Range<u64>, delimiter: u8) -> Result<&'a [u8], ()> {
        if range.start > range.end || range.end > self.len {
            return Err(());
        }
        let held = &mut *self.held.borrow_mut();
        if let Some(&start) = held
            .table_starts
            .get(&range.end)
            .filter(|&&s| s <= range.start)
        {
            let table = match held.tables.entry(range.end) {
                Entry::Occupied(entry) => entry.into_mut(),
                Entry::Vacant(entry) => entry.insert(self.read(start, range.end - start)?),
            };
            let from = usize::try_from(range.start - start).map_err(|_| ())?;
            let rest = &table[from..];
            let len = memchr::memchr(delimiter, rest).ok_or(())?;
            return Ok(extend(&rest[..len]));
        }
        if let Some(bytes) = held.loose.get(&(range.start, delimiter)) {
            return Ok(extend(bytes));
        }
        let window = self.read(range.start, (range.end - range.start).min(MAX_LOOSE_STRING))?;
        let len = memchr::memchr(delimiter, &window).ok_or(())?;
        let string = window[..len].to_vec().into_boxed_slice();
        Ok(extend(
            held.loose.entry((range.start, delimiter)).or_insert(string),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object::{Object, ObjectSection, ObjectSymbol};

    /// This test binary: a real ELF file with `.symtab`, `.strtab` and a
    /// dynamic symbol table.
    fn this_binary() -> std::path::PathBuf {
        std::env::current_exe().expect("current_exe")
    }

    fn names<'d, R: ReadRef<'d>>(elf: &object::File<'d, R>) -> Vec<String> {
        elf.dynamic_symbols()
            .chain(elf.symbols())
            .filter_map(|s| s.name().ok().map(str::to_string))
            .collect()
    }

    #[test]
    fn symbols_read_as_from_the_whole_file() {
        let path = this_binary();
        let whole = std::fs::read(&path).expect("read");
        let reference = names(&object::File::parse(&*whole).expect("parse"));
        let reader = ElfReader::open(&path).expect("open");
        let elf = reader.parse().expect("parse");
        assert!(reference.len() > 1000, "{} symbols", reference.len());
        assert_eq!(names(&elf), reference);
    }

    /// The glance sees definitions, not imports, and section names.
    #[test]
    fn glance_tells_defined_dynamic_symbols_from_imported_ones() {
        let libc = Path::new("/lib/x86_64-linux-gnu/libc.so.6");
        let reader = ElfReader::open(libc).expect("libc");
        assert_eq!(
            reader.glance(b".text", |n| n == b"malloc"),
            Some((true, true))
        );
        assert_eq!(
            reader.glance(b".no-such-section", |n| n == b"SSL_read"),
            Some((false, false))
        );
        // This binary imports malloc from libc: undefined here.
        let this = ElfReader::open(&this_binary()).expect("open");
        assert_eq!(
            this.glance(b".text", |n| n == b"malloc"),
            Some((true, false))
        );
        let not_elf = ElfReader::open(Path::new("/proc/self/cmdline")).expect("open");
        assert_eq!(not_elf.glance(b".text", |_| true), None);
    }

    /// Every name looked up, and the reader holds the symbol and string
    /// tables once (plus headers), not a copy per string.
    #[test]
    fn holds_each_string_table_once() {
        let path = this_binary();
        let reader = ElfReader::open(&path).expect("open");
        let elf = reader.parse().expect("parse");
        let n = names(&elf).len();
        let tables: usize = elf
            .sections()
            .filter(|s| {
                matches!(
                    s.name(),
                    Ok(".dynsym" | ".dynstr" | ".symtab" | ".strtab" | ".shstrtab")
                )
            })
            .map(|s| usize::try_from(s.size()).expect("size"))
            .sum();
        let held = reader.held_bytes();
        assert!(
            held <= tables + 64 * 1024,
            "{n} names: held {held} bytes, the tables are {tables}"
        );
        assert!(
            reader.held.borrow().loose.len() < 64,
            "strings read one by one"
        );
    }
}
