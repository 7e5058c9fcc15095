//! serde_json's compact formatter, with the numbers of a timeline line
//! written from integers.
//!
//! Every number a timeline line carries in milliseconds comes from
//! [`crate::units::ms`]: whole microseconds over 1000. A streamed
//! response's line is mostly two of them per chunk (`chunk_offsets_ms`,
//! `itl_ms`), and the shortest-round-trip float formatting took ~5 % of
//! the agent's CPU under a flood. Such a value is printed here as its
//! integer part, a dot and up to three decimals: the same text the float
//! formatting gives (its shortest decimal is exactly that one while it has
//! at most 15 significant digits). Any other float goes to serde_json's own
//! formatting.

use std::io;

use serde_json::ser::{CompactFormatter, Formatter};

/// Largest microsecond count written from integers: 10^15 µs (31 years),
/// 15 significant digits, well inside the exact range.
const MAX_MICROS: f64 = 1e15;

/// [`CompactFormatter`] with [`write_ms`] for floats.
pub(super) struct MsFormatter;

impl Formatter for MsFormatter {
    fn write_f64<W: ?Sized + io::Write>(&mut self, writer: &mut W, value: f64) -> io::Result<()> {
        match whole_micros(value) {
            Some(micros) => write_ms(writer, micros),
            None => CompactFormatter.write_f64(writer, value),
        }
    }
}

/// `value` × 1000 when that is a whole number below [`MAX_MICROS`] and
/// `value` is not negative (nor -0.0).
///
/// The candidate is the scaled value plus a half, truncated, not
/// `f64::round` (a libm call on a CPU not assumed to have SSE4.1: 2 % of
/// the agent's samples under the node flood). It is only a candidate: the
/// check that it divides back to `value` exactly is what makes the integer
/// path safe, so a different rounding of a value that is no whole number
/// of microseconds anyway cannot change what is printed.
fn whole_micros(value: f64) -> Option<u64> {
    if value.is_sign_negative() || !value.is_finite() {
        return None;
    }
    let scaled = value * 1000.0;
    if scaled >= MAX_MICROS {
        return None;
    }
    let micros = (scaled + 0.5) as u64;
    (micros as f64 / 1000.0 == value).then_some(micros)
}

/// `micros` / 1000 as a decimal: "12.5", "0.001", "3.0", written at once
/// (one `write_all` per number: the writer is the line's buffer). The
/// digits are put in place from the last one back, in one buffer: an
/// integer formatter's output copied after the fact was two more small
/// `memcpy` calls per number (~3.5 % of the agent's samples under the node
/// flood, two numbers per chunk).
fn write_ms<W: ?Sized + io::Write>(writer: &mut W, micros: u64) -> io::Result<()> {
    // below MAX_MICROS: at most 12 digits before the point, 4 from it on
    let mut text = [0u8; 20];
    let mut at = text.len();
    let mut put = |byte: u8| {
        at -= 1;
        text[at] = byte;
    };
    // ".0" for a whole number, else the fraction without trailing zeros
    let frac = micros % 1000;
    let (mut digits, count) = if frac.is_multiple_of(100) {
        (frac / 100, 1)
    } else if frac.is_multiple_of(10) {
        (frac / 10, 2)
    } else {
        (frac, 3)
    };
    for _ in 0..count {
        put(b'0' + (digits % 10) as u8);
        digits /= 10;
    }
    put(b'.');
    let mut whole = micros / 1000;
    loop {
        put(b'0' + (whole % 10) as u8);
        whole /= 10;
        if whole == 0 {
            break;
        }
    }
    writer.write_all(&text[at..])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::ms;

    fn ours(value: f64) -> String {
        let mut out = Vec::new();
        MsFormatter.write_f64(&mut out, value).expect("write");
        String::from_utf8(out).expect("utf-8")
    }

    fn serde_json_s(value: f64) -> String {
        serde_json::to_string(&value).expect("json")
    }

    #[test]
    fn millisecond_values_print_as_the_float_formatting_prints_them() {
        let mut ns: Vec<u64> = vec![
            0,
            1,
            499,
            500,
            999,
            1_000,
            1_500,
            10_000,
            100_000,
            999_999,
            1_000_000,
            1_000_500,
            12_345_678,
            60_000_000_000,
            86_400_000_000_000,
            999_999_999_999_999,
        ];
        // and a spread of every magnitude, from a fixed seed
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ns.push(x >> (x % 50 + 14));
        }
        let mut integer_path = 0;
        for n in ns {
            let value = ms(n);
            integer_path += usize::from(whole_micros(value).is_some());
            assert_eq!(ours(value), serde_json_s(value), "{n} ns = {value} ms");
        }
        assert!(
            integer_path > 190_000,
            "only {integer_path} values took the integer path"
        );
    }

    #[test]
    fn other_floats_keep_serde_json_formatting() {
        for value in [
            -0.0,
            -1.5,
            0.0001,
            1e-7,
            0.1 + 0.2,
            1e15,
            1e20,
            f64::MAX,
            123.456_789,
        ] {
            assert_eq!(ours(value), serde_json_s(value), "{value}");
        }
        assert_eq!(whole_micros(0.1 + 0.2), None);
        assert_eq!(whole_micros(-2.0), None);
        assert_eq!(whole_micros(2.5), Some(2_500));
    }
}
