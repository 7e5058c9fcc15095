//! The probes as a tracer finds them: `.note.stapsdt` entries of this test
//! binary, which links the crate like any server would.

use object::elf::FileHeader64;
use object::read::elf::{FileHeader, SectionHeader};
use object::{Endian, Endianness};

/// Note type of SystemTap SDT probe descriptors (owner "stapsdt").
const NT_STAPSDT: u32 = 3;

const RID_PROBES: [&str; 8] = [
    "request_start",
    "request_queued",
    "request_scheduled",
    "prefill_start",
    "prefill_end",
    "token",
    "request_end",
    "request_preempted",
];

struct Note {
    provider: String,
    name: String,
    semaphore: u64,
    args: String,
}

/// Descriptor of an NT_STAPSDT note (64-bit): pc, base, semaphore, then
/// NUL-terminated provider, name and argument format.
fn parse(endian: Endianness, desc: &[u8]) -> Note {
    let word = |i: usize| {
        let bytes: [u8; 8] = desc[i * 8..i * 8 + 8].try_into().expect("8 bytes");
        endian.read_u64_bytes(bytes)
    };
    let mut strings = desc[24..]
        .split(|&b| b == 0)
        .map(|s| String::from_utf8_lossy(s).into_owned());
    Note {
        semaphore: word(2),
        provider: strings.next().expect("provider"),
        name: strings.next().expect("name"),
        args: strings.next().expect("arguments"),
    }
}

fn stapsdt_notes() -> Vec<Note> {
    let exe = std::env::current_exe().expect("test binary path");
    let data = std::fs::read(&exe).expect("reading the test binary");
    let header = FileHeader64::<Endianness>::parse(&*data).expect("64-bit ELF");
    let endian = header.endian().expect("endianness");
    let sections = header.sections(endian, &*data).expect("section table");
    let mut out = Vec::new();
    for section in sections.iter() {
        let Some(mut notes) = section.notes(endian, &*data).expect("note section") else {
            continue;
        };
        while let Some(note) = notes.next().expect("note") {
            if note.name() == b"stapsdt" && note.n_type(endian) == NT_STAPSDT {
                out.push(parse(endian, note.desc()));
            }
        }
    }
    out
}

#[test]
fn binary_holds_the_eight_llm_probes_with_semaphores() {
    // Calling every probe keeps it in the binary whatever the linker would
    // drop, and runs the disabled path (nothing is attached here).
    for name in RID_PROBES {
        match name {
            "request_start" => llm_usdt::request_start("chatcmpl-test", 12),
            "request_queued" => llm_usdt::request_queued("chatcmpl-test", 1),
            "request_scheduled" => llm_usdt::request_scheduled("chatcmpl-test", 1),
            "prefill_start" => llm_usdt::prefill_start("chatcmpl-test", 12),
            "prefill_end" => llm_usdt::prefill_end("chatcmpl-test", 12),
            "token" => llm_usdt::token("chatcmpl-test", 0),
            "request_end" => llm_usdt::request_end("chatcmpl-test", 1),
            "request_preempted" => llm_usdt::request_preempted("chatcmpl-test", 1),
            other => unreachable!("{other}"),
        }
    }
    llm_usdt::batch_step(1, 1, 1);

    let notes: Vec<Note> = stapsdt_notes()
        .into_iter()
        .filter(|n| n.provider == "llm")
        .collect();
    let mut names: Vec<&str> = notes.iter().map(|n| n.name.as_str()).collect();
    names.sort_unstable();
    let mut expected: Vec<&str> = RID_PROBES.iter().copied().chain(["batch_step"]).collect();
    expected.sort_unstable();
    assert_eq!(names, expected, "one llm note per probe");

    for note in &notes {
        assert_ne!(note.semaphore, 0, "{} has no semaphore", note.name);
        let args: Vec<&str> = note.args.split_whitespace().collect();
        let want = if note.name == "batch_step" { 3 } else { 2 };
        assert_eq!(args.len(), want, "{}: arguments {:?}", note.name, note.args);
        for arg in args {
            // 8-byte values; the sign marker does not matter to readers.
            assert!(
                arg.trim_start_matches('-').starts_with("8@"),
                "{}: argument {arg} is not 8 bytes",
                note.name
            );
        }
    }
}
