//! Decoding of HPACK's Huffman-coded string literals (RFC 7541 §5.2).
//!
//! The code is canonical: the codes of one bit length are consecutive
//! integers, assigned in symbol order, each length's first code following
//! the previous length's last. So a decoder needs, per length, the first
//! code and where its symbols start in the (length, symbol)-sorted list: a
//! few hundred bytes, built once. Header values are short and decoded once
//! per stream, so a bit-at-a-time walk is fast enough.

use std::sync::OnceLock;

use super::huffman_table::CODES;

const EOS: u16 = 256;
const MAX_LEN: usize = 30;

struct Canonical {
    /// Symbols sorted by (bit length, code).
    symbols: Vec<u16>,
    /// Per bit length: the first code, how many codes, and the index of the
    /// first one in `symbols`.
    first_code: [u32; MAX_LEN + 1],
    count: [u32; MAX_LEN + 1],
    first_index: [u32; MAX_LEN + 1],
}

fn canonical() -> &'static Canonical {
    static TABLE: OnceLock<Canonical> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut symbols: Vec<u16> = (0..=EOS).collect();
        symbols.sort_by_key(|&s| {
            let (code, len) = CODES[usize::from(s)];
            (len, code)
        });
        let mut table = Canonical {
            symbols,
            first_code: [0; MAX_LEN + 1],
            count: [0; MAX_LEN + 1],
            first_index: [0; MAX_LEN + 1],
        };
        for (i, &s) in table.symbols.iter().enumerate() {
            let (code, len) = CODES[usize::from(s)];
            let len = usize::from(len);
            if table.count[len] == 0 {
                table.first_code[len] = code;
                table.first_index[len] = i as u32;
            }
            table.count[len] += 1;
        }
        table
    })
}

/// The string is not a valid Huffman encoding: a code for EOS, or padding
/// longer than 7 bits or not all ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HuffmanError;

/// Decodes `input` into `out` (appended).
pub(crate) fn decode(input: &[u8], out: &mut Vec<u8>) -> Result<(), HuffmanError> {
    let table = canonical();
    let mut code: u32 = 0;
    let mut len = 0usize;
    for &byte in input {
        for shift in (0..8).rev() {
            code = (code << 1) | u32::from((byte >> shift) & 1);
            len += 1;
            if len > MAX_LEN {
                return Err(HuffmanError);
            }
            let offset = code.wrapping_sub(table.first_code[len]);
            if table.count[len] > 0 && code >= table.first_code[len] && offset < table.count[len] {
                let symbol = table.symbols[(table.first_index[len] + offset) as usize];
                if symbol == EOS {
                    return Err(HuffmanError);
                }
                out.push(symbol as u8);
                code = 0;
                len = 0;
            }
        }
    }
    // What is left must be padding: the most significant bits of EOS (all
    // ones), at most 7 of them.
    let padding_ok = len <= 7 && code == (1u32 << len) - 1;
    if padding_ok {
        Ok(())
    } else {
        Err(HuffmanError)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Bytes from hex digits, spaces ignored (the RFC's examples).
    pub(in super::super) fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex digits"))
            .collect()
    }

    fn decoded(s: &str) -> Result<Vec<u8>, HuffmanError> {
        let mut out = Vec::new();
        decode(&hex(s), &mut out).map(|()| out)
    }

    #[test]
    fn the_table_is_the_canonical_code_the_rfc_describes() {
        // Canonical: in (length, symbol) order, each code is the previous
        // plus one, shifted left by the growth in length.
        let mut order: Vec<usize> = (0..CODES.len()).collect();
        order.sort_by_key(|&s| (CODES[s].1, s));
        let mut next = 0u32;
        let mut prev_len = CODES[order[0]].1;
        for &s in &order {
            let (code, len) = CODES[s];
            next <<= len - prev_len;
            assert_eq!(code, next, "symbol {s}");
            next += 1;
            prev_len = len;
        }
        // Complete: the code space is used up exactly (Kraft equality).
        assert_eq!(next, 1 << 30);
    }

    #[test]
    fn decodes_the_rfc_examples() {
        // RFC 7541 C.4 and C.6.
        assert_eq!(
            decoded("f1e3 c2e5 f23a 6ba0 ab90 f4ff").expect("decodes"),
            b"www.example.com"
        );
        assert_eq!(decoded("a8eb 1064 9cbf").expect("decodes"), b"no-cache");
        assert_eq!(
            decoded("25a8 49e9 5ba9 7d7f").expect("decodes"),
            b"custom-key"
        );
        assert_eq!(
            decoded("25a8 49e9 5bb8 e8b4 bf").expect("decodes"),
            b"custom-value"
        );
        assert_eq!(decoded("6402").expect("decodes"), b"302");
        assert_eq!(decoded("aec3 771a 4b").expect("decodes"), b"private");
        assert_eq!(
            decoded("d07a be94 1054 d444 a820 0595 040b 8166 e082 a62d 1bff").expect("decodes"),
            b"Mon, 21 Oct 2013 20:13:21 GMT"
        );
        assert_eq!(decoded("").expect("decodes"), b"");
    }

    #[test]
    fn rejects_bad_padding_and_eos() {
        // '0' is 00000 (5 bits); three zero bits of padding are not EOS bits.
        assert_eq!(decoded("00"), Err(HuffmanError));
        // A whole byte of ones is 8 bits of padding: too long.
        assert_eq!(decoded("ff"), Err(HuffmanError));
        // EOS itself (30 ones) in the middle.
        assert_eq!(decoded("ffff ffff"), Err(HuffmanError));
    }
}
