//! Where a uprobe goes in a function so that the kernel emulates the probed
//! instruction instead of single-stepping it.
//!
//! On x86-64 a uprobe replaces the first byte of an instruction with int3.
//! When it fires, the kernel must still execute the instruction it covered:
//! a few it emulates (arch/x86/kernel/uprobes.c: `push reg`, `nop`, `call
//! rel32`, `jmp rel8/rel32`, `jcc`), every other one it single-steps out of
//! line, which costs a second trap: ~10 µs per hit in a VM against ~1 µs
//! (see the design notes, "Uprobe cost and scope"). So the probe goes on an
//! emulated instruction when one is equivalent to the function's entry:
//!
//! - the entry itself, or the instruction after an `endbr64` (which does
//!   nothing to registers or the stack: a return probe still finds the
//!   return address at `[rsp]`);
//! - for an entry probe without a return probe, the first `push`/`call` of a
//!   straight-line prologue, when the instructions before it write none of
//!   the registers the program reads and no branch of the function lands
//!   between the entry and it (so it runs exactly once per call);
//! - otherwise the entry, single-stepped, and said so.
//!
//! The bytes come from the file, never from a running process.

use std::fmt;

use iced_x86::{
    Decoder, DecoderOptions, FlowControl, Formatter, Instruction, InstructionInfoFactory,
    IntelFormatter, Mnemonic, OpAccess, Register,
};
use object::{Object, ObjectSection, ObjectSymbol};

/// Longest prologue searched for an emulated instruction.
const PROLOGUE_BYTES: u64 = 32;
/// Instructions of a prologue the probe may move past.
const PROLOGUE_INSTRUCTIONS: usize = 6;
/// A function longer than this is not decoded whole for the branch check;
/// the probe then stays at the entry (or after endbr64).
const MAX_FUNCTION_BYTES: u64 = 64 * 1024;

/// Argument registers of the System V x86-64 calling convention, in order.
pub const ARG_REGISTERS: [Register; 6] = [
    Register::RDI,
    Register::RSI,
    Register::RDX,
    Register::RCX,
    Register::R8,
    Register::R9,
];

/// What the program attached at a function needs at the probed point.
#[derive(Debug, Clone, Copy)]
pub struct Needs {
    /// A return probe is attached too: the return address must be at `[rsp]`.
    pub return_probe: bool,
    /// Registers the program reads (arguments), unchanged from the entry.
    pub reads: &'static [Register],
}

/// Where one probe is placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Offset of the probed instruction in the file: what the kernel's
    /// uprobe interface takes.
    pub file_offset: u64,
    /// For people: `SSL_read_ex+0`, `cudaLaunchKernel+4`, or a helper.
    pub at: String,
    /// The probed instruction in Intel syntax, `?` if it could not be read.
    pub instruction: String,
    /// The kernel emulates it (cheap hit) rather than single-stepping it.
    pub emulated: bool,
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cost = if self.emulated {
            "emulated"
        } else {
            "single-stepped"
        };
        write!(
            f,
            "{} (file offset {:#x}): {}, {cost}",
            self.at, self.file_offset, self.instruction
        )
    }
}

/// Whether the kernel emulates the instruction starting with `bytes`
/// (mirrors branch_setup_xol_ops and push_setup_xol_ops: no prefixes but
/// REX.B on push). Multi-byte nops (`0f 1f /0`) are emulated since 6.16.
pub fn is_emulated(bytes: &[u8], long_nops: bool) -> bool {
    match bytes {
        [0x50..=0x57, ..] | [0x41, 0x50..=0x57, ..] => true, // push reg
        [0x90, ..] => true,                                  // nop
        [0xe8, ..] | [0xe9, ..] | [0xeb, ..] => true,        // call, jmp
        [0x70..=0x7f, ..] | [0x0f, 0x80..=0x8f, ..] => true, // jcc
        [0x0f, 0x1f, modrm, ..] => long_nops && (modrm >> 3) & 7 == 0,
        _ => false,
    }
}

/// Whether this kernel emulates multi-byte nops (Linux 6.16 and later).
pub fn kernel_emulates_long_nops() -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release.trim().split(['.', '-']);
    let major: u32 = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    let minor: u32 = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    (major, minor) >= (6, 16)
}

/// A function's code, decoded.
struct Function {
    name: String,
    /// Virtual address of the entry.
    address: u64,
    /// File offset of the entry.
    file_offset: u64,
    bytes: Vec<u8>,
    /// Decoded from the entry to the end of `bytes`.
    instructions: Vec<Instruction>,
    /// The whole function was decoded (its size is known): branch targets
    /// inside it can be checked.
    whole: bool,
}

impl Function {
    fn bytes_of(&self, instruction: &Instruction) -> &[u8] {
        let start = (instruction.ip() - self.address) as usize;
        let end = start + instruction.len();
        self.bytes.get(start..end).unwrap_or(&[])
    }

    fn placement(&self, index: usize, long_nops: bool) -> Placement {
        let Some(instruction) = self.instructions.get(index) else {
            return Placement {
                file_offset: self.file_offset,
                at: format!("{}+0", self.name),
                instruction: "?".to_string(),
                emulated: false,
            };
        };
        let offset = instruction.ip() - self.address;
        let mut text = String::new();
        IntelFormatter::new().format(instruction, &mut text);
        Placement {
            file_offset: self.file_offset + offset,
            at: format!("{}+{offset}", self.name),
            instruction: text,
            emulated: is_emulated(self.bytes_of(instruction), long_nops),
        }
    }

    /// Some branch of the function may land in (entry, target]: a direct
    /// one that does, or any indirect one (its targets are unknown).
    fn branch_lands_before(&self, target: u64) -> bool {
        self.instructions.iter().any(|i| match i.flow_control() {
            FlowControl::UnconditionalBranch | FlowControl::ConditionalBranch => {
                let to = i.near_branch_target();
                to > self.address && to <= target
            }
            FlowControl::IndirectBranch => true,
            _ => false,
        })
    }
}

/// An ELF file's code, for placing probes in its exported functions.
pub struct Code<'d, R: object::ReadRef<'d>> {
    elf: &'d object::File<'d, R>,
    /// The file `elf` was parsed from: a function's bytes are read from it
    /// alone (`object`'s section `data_range` reads the whole section:
    /// node's 28 MB `.text` for one prologue).
    data: R,
    long_nops: bool,
}

impl<'d, R: object::ReadRef<'d>> Code<'d, R> {
    pub fn new(elf: &'d object::File<'d, R>, data: R, long_nops: bool) -> Self {
        Self {
            elf,
            data,
            long_nops,
        }
    }

    /// Address and size of the exported function `name`.
    fn symbol(&self, name: &str) -> Option<(u64, u64)> {
        self.elf
            .dynamic_symbols()
            .chain(self.elf.symbols())
            .find(|s| s.is_definition() && s.name() == Ok(name))
            .map(|s| (s.address(), s.size()))
    }

    /// Decodes the function at `address` (`size` 0: unknown).
    fn function(&self, name: String, address: u64, size: u64) -> Option<Function> {
        let section = self.elf.sections().find(|s| {
            let start = s.address();
            address >= start && address < start + s.size()
        })?;
        let (section_offset, _) = section.file_range()?;
        let whole = size > 0 && size <= MAX_FUNCTION_BYTES;
        let wanted = if whole { size } else { PROLOGUE_BYTES };
        let available = section.address() + section.size() - address;
        let file_offset = section_offset + (address - section.address());
        let bytes = self
            .data
            .read_bytes_at(file_offset, wanted.min(available))
            .ok()?
            .to_vec();
        let mut decoder = Decoder::with_ip(64, &bytes, address, DecoderOptions::NONE);
        let mut instructions = Vec::new();
        while decoder.can_decode() {
            let instruction = decoder.decode();
            if instruction.is_invalid() {
                break;
            }
            instructions.push(instruction);
        }
        Some(Function {
            name,
            address,
            file_offset,
            bytes,
            instructions,
            whole,
        })
    }

    /// The cheapest equivalent place for a probe on exported `name`, or
    /// None if the file does not define it.
    pub fn place(&self, name: &str, needs: Needs) -> Option<Placement> {
        let (address, size) = self.symbol(name)?;
        let function = self.function(name.to_string(), address, size)?;
        Some(place_in(&function, needs, self.long_nops))
    }

    /// The internal helper two exported functions both call first, e.g.
    /// OpenSSL 3.0's `ssl_read_internal` behind `SSL_read_ex` and
    /// `SSL_read` (its arguments are those of the `_ex` function). Found
    /// from the bytes: the first `call rel32` of each, within its prologue
    /// region, must be the same target, and that target must take an
    /// emulated probe at its entry (or after endbr64) with a return probe.
    pub fn shared_callee(&self, ex: &str, plain: &str) -> Option<Placement> {
        let target = self.first_call(ex)?;
        if self.first_call(plain)? != target {
            return None;
        }
        let helper = self.function(format!("{target:#x} (called by {plain}, {ex})"), target, 0)?;
        let needs = Needs {
            return_probe: true,
            reads: &ARG_REGISTERS,
        };
        let placement = place_in(&helper, needs, self.long_nops);
        placement.emulated.then_some(placement)
    }

    /// Target of the first direct call in the first 64 bytes of `name`.
    fn first_call(&self, name: &str) -> Option<u64> {
        let (address, _) = self.symbol(name)?;
        let function = self.function(name.to_string(), address, 64)?;
        function
            .instructions
            .iter()
            .find(|i| function.bytes_of(i).first() == Some(&0xe8))
            .map(Instruction::near_branch_target)
    }
}

/// The cheapest place equivalent to `function`'s entry for `needs`.
fn place_in(function: &Function, needs: Needs, long_nops: bool) -> Placement {
    let entry = function.placement(0, long_nops);
    if entry.emulated {
        return entry;
    }
    let first = function.instructions.first();
    let mut start = 0;
    if first.is_some_and(|i| i.mnemonic() == Mnemonic::Endbr64) {
        let after = function.placement(1, long_nops);
        if after.emulated {
            return after;
        }
        start = 1;
    }
    if needs.return_probe || !function.whole {
        return entry;
    }
    let mut info = InstructionInfoFactory::new();
    for (index, instruction) in function
        .instructions
        .iter()
        .enumerate()
        .take(PROLOGUE_INSTRUCTIONS)
        .skip(start)
    {
        if instruction.ip() - function.address >= PROLOGUE_BYTES {
            break;
        }
        let bytes = function.bytes_of(instruction);
        let pushes_or_calls = matches!(bytes, [0x50..=0x57, ..] | [0x41, 0x50..=0x57, ..])
            || matches!(bytes, [0xe8, ..]);
        if index > start && pushes_or_calls {
            if function.branch_lands_before(instruction.ip()) {
                return entry;
            }
            return function.placement(index, long_nops);
        }
        if instruction.flow_control() != FlowControl::Next {
            return entry;
        }
        let writes_a_read_register = info.info(instruction).used_registers().iter().any(|r| {
            matches!(
                r.access(),
                OpAccess::Write
                    | OpAccess::CondWrite
                    | OpAccess::ReadWrite
                    | OpAccess::ReadCondWrite
            ) && needs.reads.contains(&r.register().full_register())
        });
        if writes_a_read_register {
            return entry;
        }
    }
    entry
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn emulated_instructions_are_the_kernels() {
        assert!(is_emulated(&[0x41, 0x55], false), "push r13");
        assert!(is_emulated(&[0x53], false), "push rbx");
        assert!(is_emulated(&[0xe8, 0, 0, 0, 0], false), "call rel32");
        assert!(is_emulated(&[0x74, 0x1b], false), "je rel8");
        assert!(is_emulated(&[0x0f, 0x84, 0, 0, 0, 0], false), "je rel32");
        assert!(is_emulated(&[0x90], false), "nop");
        assert!(!is_emulated(&[0x48, 0x83, 0xec, 0x18], false), "sub rsp");
        assert!(!is_emulated(&[0xf3, 0x0f, 0x1e, 0xfa], true), "endbr64");
        assert!(!is_emulated(&[0x48, 0x85, 0xff], true), "test rdi");
        assert!(!is_emulated(&[0x66, 0xe8, 0, 0], true), "prefixed call");
        assert!(!is_emulated(&[0x48, 0x50], true), "REX.W push");
        assert!(
            is_emulated(&[0x0f, 0x1f, 0x44, 0, 0], true),
            "nopl since 6.16"
        );
        assert!(!is_emulated(&[0x0f, 0x1f, 0x44, 0, 0], false));
    }

    /// A function built from raw bytes at address 0x1000.
    fn function(bytes: &[u8]) -> Function {
        let mut decoder = Decoder::with_ip(64, bytes, 0x1000, DecoderOptions::NONE);
        let mut instructions = Vec::new();
        while decoder.can_decode() {
            instructions.push(decoder.decode());
        }
        Function {
            name: "f".into(),
            address: 0x1000,
            file_offset: 0x1000,
            bytes: bytes.to_vec(),
            instructions,
            whole: true,
        }
    }

    fn place(bytes: &[u8], needs: Needs) -> Placement {
        place_in(&function(bytes), needs, true)
    }

    const COUNT_ONLY: Needs = Needs {
        return_probe: false,
        reads: &[],
    };

    #[test]
    fn entry_probe_moves_past_a_stack_adjustment_to_the_call() {
        // The stand-in cudaLaunchKernel: sub rsp,0x28; call; mov; ...; ret
        let code = [
            0x48, 0x83, 0xec, 0x28, 0xe8, 0x17, 0xff, 0xff, 0xff, 0x31, 0xc0, 0x48, 0x83, 0xc4,
            0x28, 0xc3,
        ];
        let p = place(&code, COUNT_ONLY);
        assert_eq!(p.at, "f+4");
        assert!(p.emulated, "{p}");
        // A return probe needs [rsp] = return address: stays at the entry.
        let p = place(
            &code,
            Needs {
                return_probe: true,
                reads: &[],
            },
        );
        assert_eq!((p.at.as_str(), p.emulated), ("f+0", false));
    }

    #[test]
    fn entry_probe_stays_when_a_read_register_is_written_or_a_branch_intervenes() {
        // mov rdx, rdi; call ...: the program reads rdx.
        let code = [0x48, 0x89, 0xfa, 0xe8, 0, 0, 0, 0, 0xc3];
        let p = place(
            &code,
            Needs {
                return_probe: false,
                reads: &[Register::RDX],
            },
        );
        assert_eq!(p.at, "f+0");
        // test rdi,rdi; je +0x1b; push rbx: a branch before the push.
        let code = [0x48, 0x85, 0xff, 0x74, 0x01, 0x53, 0xc3];
        assert_eq!(place(&code, COUNT_ONLY).at, "f+0");
        // sub rsp,8; L: call ...; jmp L — a loop lands on the call.
        let code = [0x48, 0x83, 0xec, 0x08, 0xe8, 0, 0, 0, 0, 0xeb, 0xf9, 0xc3];
        assert_eq!(place(&code, COUNT_ONLY).at, "f+0");
    }

    #[test]
    fn endbr64_is_skipped_even_for_return_probes() {
        // endbr64; push r15
        let code = [0xf3, 0x0f, 0x1e, 0xfa, 0x41, 0x57, 0xc3];
        let p = place(
            &code,
            Needs {
                return_probe: true,
                reads: &ARG_REGISTERS,
            },
        );
        assert_eq!(p.at, "f+4");
        assert!(p.emulated);
        assert_eq!(p.instruction, "push r15");
    }

    fn system_libssl() -> Option<std::path::PathBuf> {
        [
            "/usr/lib/x86_64-linux-gnu/libssl.so.3",
            "/lib/x86_64-linux-gnu/libssl.so.3",
        ]
        .iter()
        .map(std::path::PathBuf::from)
        .find(|p| p.exists())
    }

    #[test]
    fn libssl_3_data_functions_share_emulated_internal_helpers() {
        let path = system_libssl().expect("libssl.so.3 is installed (python3 depends on it)");
        let bytes = std::fs::read(path).expect("read libssl");
        let elf = object::File::parse(&*bytes).expect("parse libssl");
        let code = Code::new(&elf, &*bytes, false);
        let read = code
            .shared_callee("SSL_read_ex", "SSL_read")
            .expect("SSL_read and SSL_read_ex call one helper first");
        let write = code
            .shared_callee("SSL_write_ex", "SSL_write")
            .expect("SSL_write and SSL_write_ex call one helper first");
        assert!(read.emulated && write.emulated, "{read} / {write}");
        assert!(read.instruction.starts_with("push"), "{read}");
        assert_ne!(read.file_offset, write.file_offset);
        // Mismatched pair: SSL_read's first call is not SSL_write_ex's.
        assert!(code.shared_callee("SSL_write_ex", "SSL_read").is_none());
    }
}
