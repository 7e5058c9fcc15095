//! A tolerant HPACK decoder (RFC 7541), for labels only.
//!
//! Timing never depends on it: frames say when a stream starts and ends.
//! HPACK gives the labels (`:path`, `:status`, content-type, grpc-status,
//! the request-id header), and it is stateful: a decoder that attached to a
//! connection mid-way does not know the dynamic table the peer's encoder
//! built before. So this decoder never fails a header block:
//!
//! - every insertion is made, with a placeholder where the name or value
//!   could not be read, so the indexes of later entries stay right;
//! - what it holds is always the newest part of the peer's table (eviction
//!   is oldest first on both sides), so an index past its end is an entry
//!   from before tracing: reported as unknown and counted;
//! - a header block it could not read to the end (lost bytes, a malformed
//!   instruction) may have inserted entries it did not see: the table is
//!   cleared, and indexes are unknown until new insertions refill it.

use std::collections::VecDeque;

use super::huffman;

/// The peer's table size limit until it says otherwise (SETTINGS default).
pub(crate) const DEFAULT_TABLE_SIZE: usize = 4096;

/// Largest table size honoured: SETTINGS_HEADER_TABLE_SIZE is 32 bits, but
/// memory kept per connection and direction must stay bounded.
const MAX_TABLE_SIZE: usize = 64 * 1024;

/// Longest string literal kept; longer ones are placeholders (their bytes
/// are still skipped exactly).
const MAX_STRING: usize = 8 * 1024;

/// One header as decoded: `None` where the bytes were not available.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header<'a> {
    pub name: Option<&'a [u8]>,
    pub value: Option<&'a [u8]>,
}

/// What went wrong in one block, for the counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct BlockStats {
    /// References to table entries this decoder does not hold.
    pub unknown_indexes: u32,
    /// The block could not be read to its end; the table was cleared.
    pub broken: bool,
}

#[derive(Debug, Clone)]
struct Entry {
    name: Option<Box<[u8]>>,
    value: Option<Box<[u8]>>,
    /// RFC 7541 §4.1 size (name + value + 32); a placeholder's true size is
    /// unknown, so it is charged its known part plus 32.
    size: usize,
}

#[derive(Debug, Clone)]
pub(crate) struct Decoder {
    /// Newest first: dynamic index 62 is `entries[0]`.
    entries: VecDeque<Entry>,
    size: usize,
    max_size: usize,
}

impl Default for Decoder {
    fn default() -> Self {
        Self {
            entries: VecDeque::new(),
            size: 0,
            max_size: DEFAULT_TABLE_SIZE,
        }
    }
}

impl Decoder {
    /// Forgets the dynamic table: a header block was lost, so entries it
    /// inserted are not known and the indexes of what was held are off.
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
        self.size = 0;
    }

    /// Decodes one complete header block, calling `on_header` for each
    /// header in order.
    pub(crate) fn decode(
        &mut self,
        block: &[u8],
        mut on_header: impl FnMut(Header<'_>),
    ) -> BlockStats {
        let mut stats = BlockStats::default();
        let mut input = block;
        while !input.is_empty() {
            if self
                .instruction(&mut input, &mut on_header, &mut stats)
                .is_none()
            {
                stats.broken = true;
                self.clear();
                break;
            }
        }
        stats
    }

    /// Decodes one representation from the front of `input`; `None` when
    /// it is malformed or cut.
    fn instruction(
        &mut self,
        input: &mut &[u8],
        on_header: &mut impl FnMut(Header<'_>),
        stats: &mut BlockStats,
    ) -> Option<()> {
        let first = *input.first()?;
        if first & 0x80 != 0 {
            // Indexed header field (§6.1).
            let index = integer(input, 7)?;
            if index == 0 {
                return None;
            }
            match self.lookup(index) {
                Lookup::Static(name, value) => on_header(Header {
                    name: Some(name),
                    value: Some(value),
                }),
                Lookup::Dynamic(e) => on_header(Header {
                    name: e.name.as_deref(),
                    value: e.value.as_deref(),
                }),
                Lookup::Unknown => {
                    stats.unknown_indexes += 1;
                    on_header(Header {
                        name: None,
                        value: None,
                    });
                }
            }
            return Some(());
        }
        if first & 0xe0 == 0x20 {
            // Dynamic table size update (§6.3).
            let size = integer(input, 5)?;
            self.max_size = usize::try_from(size)
                .unwrap_or(usize::MAX)
                .min(MAX_TABLE_SIZE);
            self.evict(0);
            return Some(());
        }
        // Literals: with incremental indexing (01), without (0000) or never
        // indexed (0001).
        let (prefix, insert) = if first & 0xc0 == 0x40 {
            (6, true)
        } else {
            (4, false)
        };
        let index = integer(input, prefix)?;
        let name: Option<Vec<u8>> = if index == 0 {
            string(input)?
        } else {
            match self.lookup(index) {
                Lookup::Static(name, _) => Some(name.to_vec()),
                Lookup::Dynamic(e) => e.name.as_deref().map(<[u8]>::to_vec),
                Lookup::Unknown => {
                    stats.unknown_indexes += 1;
                    None
                }
            }
        };
        let value = string(input)?;
        on_header(Header {
            name: name.as_deref(),
            value: value.as_deref(),
        });
        if insert {
            self.insert(name, value);
        }
        Some(())
    }

    fn lookup(&self, index: u64) -> Lookup<'_> {
        let Ok(index) = usize::try_from(index) else {
            return Lookup::Unknown;
        };
        if let Some(&(name, value)) = index.checked_sub(1).and_then(|i| STATIC.get(i)) {
            return Lookup::Static(name.as_bytes(), value.as_bytes());
        }
        match index
            .checked_sub(STATIC.len() + 1)
            .and_then(|i| self.entries.get(i))
        {
            Some(e) => Lookup::Dynamic(e),
            None => Lookup::Unknown,
        }
    }

    fn insert(&mut self, name: Option<Vec<u8>>, value: Option<Vec<u8>>) {
        let size = name.as_ref().map_or(0, Vec::len) + value.as_ref().map_or(0, Vec::len) + 32;
        self.evict(size);
        if size > self.max_size {
            // §4.4: an entry larger than the table empties it and is not
            // added.
            return;
        }
        self.size += size;
        self.entries.push_front(Entry {
            name: name.map(Vec::into_boxed_slice),
            value: value.map(Vec::into_boxed_slice),
            size,
        });
    }

    /// Evicts the oldest entries until `incoming` more bytes fit.
    fn evict(&mut self, incoming: usize) {
        while self.size + incoming > self.max_size {
            match self.entries.pop_back() {
                Some(e) => self.size -= e.size,
                None => {
                    self.size = 0;
                    break;
                }
            }
        }
    }
}

enum Lookup<'a> {
    Static(&'a [u8], &'a [u8]),
    Dynamic(&'a Entry),
    Unknown,
}

/// An HPACK integer with an `n`-bit prefix (§5.1), from the front of
/// `input`.
fn integer(input: &mut &[u8], n: u32) -> Option<u64> {
    let (&first, mut rest) = input.split_first()?;
    let max = (1u64 << n) - 1;
    let mut value = u64::from(first) & max;
    if value == max {
        let mut shift = 0u32;
        loop {
            let (&b, tail) = rest.split_first()?;
            rest = tail;
            // Five continuation bytes reach 2^35: more than any length or
            // index here can be.
            if shift > 28 {
                return None;
            }
            value += u64::from(b & 0x7f) << shift;
            shift += 7;
            if b & 0x80 == 0 {
                break;
            }
        }
    }
    *input = rest;
    Some(value)
}

/// A string literal (§5.2) from the front of `input`: `Some(None)` when its
/// bytes were skipped but not kept (too long, or bad Huffman), `None` when
/// the block is cut inside it.
fn string(input: &mut &[u8]) -> Option<Option<Vec<u8>>> {
    let huffman = *input.first()? & 0x80 != 0;
    let len = usize::try_from(integer(input, 7)?).ok()?;
    if len > input.len() {
        return None;
    }
    let (raw, rest) = input.split_at(len);
    *input = rest;
    if len > MAX_STRING {
        return Some(None);
    }
    if !huffman {
        return Some(Some(raw.to_vec()));
    }
    let mut out = Vec::with_capacity(len * 8 / 5);
    Some(huffman::decode(raw, &mut out).ok().map(|()| out))
}

/// The static table (RFC 7541 Appendix A); index 1 is `STATIC[0]`.
const STATIC: [(&str, &str); 61] = [
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
];

#[cfg(test)]
mod tests {
    use super::super::huffman::tests::hex;
    use super::*;

    type Decoded = Vec<(Option<String>, Option<String>)>;

    fn decode(d: &mut Decoder, block: &str) -> (Decoded, BlockStats) {
        let mut out = Vec::new();
        let stats = d.decode(&hex(block), |h| {
            let s = |b: Option<&[u8]>| b.map(|b| String::from_utf8_lossy(b).into_owned());
            out.push((s(h.name), s(h.value)));
        });
        (out, stats)
    }

    fn known(pairs: &[(&str, &str)]) -> Decoded {
        pairs
            .iter()
            .map(|(n, v)| (Some(n.to_string()), Some(v.to_string())))
            .collect()
    }

    #[test]
    fn decodes_the_rfc_request_examples_with_huffman_and_the_dynamic_table() {
        // RFC 7541 C.4.1-C.4.3: three requests on one connection.
        let mut d = Decoder::default();
        let (h, s) = decode(&mut d, "8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff");
        assert_eq!(
            h,
            known(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com")
            ])
        );
        assert_eq!(s, BlockStats::default());
        let (h, _) = decode(&mut d, "8286 84be 5886 a8eb 1064 9cbf");
        assert_eq!(
            h[3],
            (Some(":authority".into()), Some("www.example.com".into()))
        );
        assert_eq!(
            h[4],
            (Some("cache-control".into()), Some("no-cache".into()))
        );
        let (h, s) = decode(
            &mut d,
            "8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf",
        );
        assert_eq!(h[2], (Some(":path".into()), Some("/index.html".into())));
        assert_eq!(
            h[3],
            (Some(":authority".into()), Some("www.example.com".into()))
        );
        assert_eq!(
            h[4],
            (Some("custom-key".into()), Some("custom-value".into()))
        );
        assert_eq!(s.unknown_indexes, 0);
    }

    #[test]
    fn evicts_as_the_rfc_response_examples_do() {
        // RFC 7541 C.5 (table size 256): the third response evicts.
        let mut d = Decoder {
            max_size: 256,
            ..Decoder::default()
        };
        decode(
            &mut d,
            "4803 3330 3258 0770 7269 7661 7465 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 \
             2032 303a 3133 3a32 3120 474d 546e 1768 7474 7073 3a2f 2f77 7777 2e65 7861 6d70 \
             6c65 2e63 6f6d",
        );
        let (h, _) = decode(&mut d, "4803 3330 37c1 c0bf");
        assert_eq!(h[0], (Some(":status".into()), Some("307".into())));
        assert_eq!(h[3].0.as_deref(), Some("location"));
        assert_eq!(d.entries.len(), 4);
        assert_eq!(d.size, 222);
    }

    #[test]
    fn an_index_from_before_tracing_is_unknown_and_counted_not_fatal() {
        // Attached mid-connection: index 62 (0xbe) refers to an entry the
        // peer inserted before we saw anything. The static parts still
        // decode, and a new insertion is then found by its index.
        let mut d = Decoder::default();
        let (h, s) = decode(
            &mut d,
            "82 be 84 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf",
        );
        assert_eq!(h[0], (Some(":method".into()), Some("GET".into())));
        assert_eq!(h[1], (None, None));
        assert_eq!(h[2], (Some(":path".into()), Some("/".into())));
        assert_eq!(
            h[3],
            (Some("custom-key".into()), Some("custom-value".into()))
        );
        assert_eq!(s.unknown_indexes, 1);
        assert!(!s.broken);
        let (h, s) = decode(&mut d, "be bf");
        assert_eq!(
            h[0],
            (Some("custom-key".into()), Some("custom-value".into()))
        );
        assert_eq!(h[1], (None, None));
        assert_eq!(s.unknown_indexes, 1);
    }

    #[test]
    fn a_literal_with_an_unknown_name_is_still_inserted_so_indexes_stay_aligned() {
        let mut d = Decoder::default();
        // 0x7f 0x00 = literal with incremental indexing, name index 63
        // (unknown), value "v".
        let (h, s) = decode(&mut d, "7f00 0176");
        assert_eq!(h, vec![(None, Some("v".into()))]);
        assert_eq!(s.unknown_indexes, 1);
        let (h, _) = decode(&mut d, "be");
        assert_eq!(h, vec![(None, Some("v".into()))]);
    }

    #[test]
    fn a_cut_block_clears_the_table_and_says_so() {
        let mut d = Decoder::default();
        decode(&mut d, "4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf");
        assert_eq!(d.entries.len(), 1);
        // A literal whose value length runs past the end.
        let (h, s) = decode(&mut d, "82 400a 6b");
        assert_eq!(h.len(), 1);
        assert!(s.broken);
        assert!(d.entries.is_empty());
    }

    #[test]
    fn garbage_never_panics_and_never_grows_the_table_past_its_bound() {
        let mut d = Decoder::default();
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..2000 {
            let len = (seed % 200) as usize;
            let block: Vec<u8> = (0..len)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect();
            d.decode(&block, |_| {});
            assert!(d.size <= MAX_TABLE_SIZE);
        }
        // Size updates beyond the bound are clamped.
        decode(&mut d, "3fe1 ffff 0f");
        assert!(d.max_size <= MAX_TABLE_SIZE);
    }

    #[test]
    fn integers_decode_as_in_the_rfc_and_overflow_is_an_error() {
        // C.1.2: 1337 with a 5-bit prefix.
        let bytes = [0x1f, 0x9a, 0x0a];
        let mut input = &bytes[..];
        assert_eq!(integer(&mut input, 5), Some(1337));
        assert!(input.is_empty());
        let bytes = [0x1f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01];
        let mut input = &bytes[..];
        assert_eq!(integer(&mut input, 5), None);
    }
}
