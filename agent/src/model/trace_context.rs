//! W3C trace context from request headers, and fresh span/trace ids.
//!
//! The `traceparent` value comes from the traced server's request bytes, so
//! it is untrusted input: parsing follows the W3C Trace Context rules
//! (level 1) strictly and anything invalid is ignored, which starts a new
//! trace exactly as a compliant server SDK would.

use std::collections::hash_map::{DefaultHasher, RandomState};
use std::hash::{BuildHasher, Hash, Hasher};

/// `tracestate` longer than this is not propagated (W3C: at most 32 entries;
/// vendors may drop it rather than truncate when it is oversized).
const MAX_TRACESTATE_BYTES: usize = 512;

/// The caller's span, as named by its `traceparent` header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteParent {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    /// W3C trace flags; bit 0 is "sampled".
    pub flags: u8,
    /// The `tracestate` header, when it is valid enough to pass on.
    pub tracestate: Option<String>,
}

impl RemoteParent {
    /// The caller recorded (sampled) its side of the trace.
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }

    /// Parses `traceparent` (and keeps `tracestate`, which is only
    /// meaningful next to a valid `traceparent`). `None` when absent or
    /// invalid.
    pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Option<Self> {
        let value = traceparent.trim_matches([' ', '\t']);
        let mut parts = value.split('-');
        let version = parts.next()?;
        let trace_id = parts.next()?;
        let span_id = parts.next()?;
        let flags = parts.next()?;
        let version = hex_exact::<1>(version)?;
        // Version ff is forbidden; version 00 has exactly four fields, and
        // later versions may append fields after another dash.
        if version[0] == 0xff || (version[0] == 0 && parts.next().is_some()) {
            return None;
        }
        let trace_id = hex_exact::<16>(trace_id)?;
        let span_id = hex_exact::<8>(span_id)?;
        let flags = hex_exact::<1>(flags)?[0];
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        let tracestate = tracestate
            .map(|s| s.trim_matches([' ', '\t']))
            .filter(|s| !s.is_empty() && s.len() <= MAX_TRACESTATE_BYTES && s.is_ascii())
            .map(str::to_owned);
        Some(Self {
            trace_id,
            span_id,
            flags,
            tracestate,
        })
    }
}

/// Decodes exactly `N` bytes of lowercase hex (W3C forbids uppercase).
fn hex_exact<const N: usize>(s: &str) -> Option<[u8; N]> {
    let raw = s.as_bytes();
    if raw.len() != 2 * N {
        return None;
    }
    let nibble = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut out = [0u8; N];
    for (i, pair) in raw.chunks_exact(2).enumerate() {
        out[i] = (nibble(pair[0])? << 4) | nibble(pair[1])?;
    }
    Some(out)
}

/// Span and trace ids: SipHash of a per-agent random seed and a counter.
///
/// Unique per agent run (a counter never repeats) and unpredictable across
/// runs (the seed comes from the OS through `RandomState`), without pulling
/// in a random number generator for 24 bytes per request. A fixed seed makes
/// ids reproducible in tests.
#[derive(Debug, Clone)]
pub struct IdGenerator {
    seed: u64,
    counter: u64,
}

impl IdGenerator {
    pub fn random() -> Self {
        Self::with_seed(RandomState::new().hash_one(std::process::id()))
    }

    pub fn with_seed(seed: u64) -> Self {
        Self { seed, counter: 0 }
    }

    fn next_u64(&mut self) -> u64 {
        loop {
            self.counter = self.counter.wrapping_add(1);
            let mut h = DefaultHasher::new();
            (self.seed, self.counter).hash(&mut h);
            let v = h.finish();
            // all-zero ids are invalid in OTLP and W3C
            if v != 0 {
                return v;
            }
        }
    }

    pub fn span_id(&mut self) -> [u8; 8] {
        self.next_u64().to_be_bytes()
    }

    pub fn trace_id(&mut self) -> [u8; 16] {
        let hi = self.next_u64().to_be_bytes();
        let lo = self.next_u64().to_be_bytes();
        let mut id = [0u8; 16];
        id[..8].copy_from_slice(&hi);
        id[8..].copy_from_slice(&lo);
        id
    }
}

/// Lowercase hex of an id.
#[cfg(test)]
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TP: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    #[test]
    fn parses_a_valid_traceparent_and_keeps_tracestate() {
        let p = RemoteParent::parse(TP, Some("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"))
            .expect("valid");
        assert_eq!(hex(&p.trace_id), "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(hex(&p.span_id), "b7ad6b7169203331");
        assert!(p.sampled());
        assert_eq!(
            p.tracestate.as_deref(),
            Some("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE")
        );
        let unsampled = RemoteParent::parse(&TP.replace("-01", "-00"), None).expect("valid");
        assert!(!unsampled.sampled());
        assert_eq!(unsampled.tracestate, None);
        assert!(
            RemoteParent::parse(&format!(" {TP}\t"), None).is_some(),
            "OWS is allowed"
        );
    }

    #[test]
    fn rejects_invalid_traceparents() {
        let bad = [
            "",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
            "00-0af7651916cd43dd8448eb211c8031-b7ad6b7169203331-01",
            "0-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319g-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1",
        ];
        for b in bad {
            assert_eq!(RemoteParent::parse(b, None), None, "{b:?} must be rejected");
        }
        // a future version may carry more fields
        let future = "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-what-ever";
        assert!(RemoteParent::parse(future, None).is_some());
        // an oversized or non-ASCII tracestate is dropped, the parent kept
        let long = "a=".to_string() + &"b".repeat(600);
        assert_eq!(
            RemoteParent::parse(TP, Some(&long))
                .expect("valid")
                .tracestate,
            None
        );
        assert_eq!(
            RemoteParent::parse(TP, Some("k=vé"))
                .expect("valid")
                .tracestate,
            None
        );
    }

    #[test]
    fn ids_are_nonzero_unique_and_reproducible_with_a_seed() {
        let mut a = IdGenerator::with_seed(7);
        let mut b = IdGenerator::with_seed(7);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..1000 {
            let s = a.span_id();
            assert_ne!(s, [0; 8]);
            assert_eq!(s, b.span_id());
            assert!(seen.insert(s.to_vec()));
            let t = a.trace_id();
            assert_ne!(t, [0; 16]);
            assert_eq!(t, b.trace_id());
            assert!(seen.insert(t.to_vec()));
        }
        let mut c = IdGenerator::with_seed(8);
        assert_ne!(IdGenerator::with_seed(7).span_id(), c.span_id());
        assert_ne!(
            IdGenerator::random().trace_id(),
            IdGenerator::random().trace_id()
        );
    }
}
