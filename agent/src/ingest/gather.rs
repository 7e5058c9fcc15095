//! The payload of a data record whose probe gathered its iovecs: pieces
//! that lay inside or right after one another in the sender's memory were
//! read from it once (a user copy costs more to set up than to move a few
//! bytes), so the record carries each stretch of memory once and says
//! where every piece of the payload lies in it (`gather_*` in events.h).
//! The payload is put back in order here, where it costs a copy the
//! decoder makes anyway, instead of in the kernel.

use std::ops::Range;

use bytes::{Bytes, BytesMut};
use tokentrace_probes::sock::types::tt_data_event;

use super::DecodeError;

/// The payload `raw` stands for, from its `captured` bytes `data`: written
/// at the end of `out` and split off it (the batch's shared buffer).
pub(super) fn payload(
    raw: &tt_data_event,
    data: &[u8],
    out: &mut BytesMut,
) -> Result<Bytes, DecodeError> {
    let pieces = usize::from(raw.gather_segs);
    if pieces == 0 {
        out.extend_from_slice(data);
        return Ok(out.split().freeze());
    }
    if pieces > raw.gather_off.len() {
        return Err(DecodeError::Gather(format!(
            "{pieces} pieces, more than the {} a record holds",
            raw.gather_off.len()
        )));
    }
    let tail = usize::from(raw.gather_tail);
    let rest = data.get(tail..).ok_or_else(|| {
        DecodeError::Gather(format!(
            "the rest starts at {tail}, past the {} captured bytes",
            data.len()
        ))
    })?;
    let mut total = rest.len();
    for (piece, range) in ranges(raw, pieces).enumerate() {
        if range.end > data.len() {
            return Err(DecodeError::Gather(format!(
                "piece {piece} at {range:?} lies past the {} captured bytes",
                data.len()
            )));
        }
        total += range.len();
    }
    if total > raw.len as usize {
        return Err(DecodeError::Gather(format!(
            "{total} payload bytes, more than the {} moved",
            raw.len
        )));
    }
    out.reserve(total);
    for range in ranges(raw, pieces) {
        out.extend_from_slice(&data[range]);
    }
    out.extend_from_slice(rest);
    Ok(out.split().freeze())
}

/// Where the first `pieces` pieces lie in the captured bytes.
fn ranges(raw: &tt_data_event, pieces: usize) -> impl Iterator<Item = Range<usize>> + '_ {
    raw.gather_off[..pieces]
        .iter()
        .zip(&raw.gather_len[..pieces])
        .map(|(&off, &len)| usize::from(off)..usize::from(off) + usize::from(len))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gathered(raw: &tt_data_event, data: &[u8]) -> Result<Bytes, DecodeError> {
        payload(raw, data, &mut BytesMut::new())
    }

    /// node's writev of one SSE chunk: size line and event in one buffer,
    /// the same CRLF twice, as the probe lays them out.
    fn node_chunk() -> (tt_data_event, Vec<u8>) {
        let mut raw = tt_data_event::default();
        let event = b"data: {\"token\":1}\n\n";
        let size = format!("{:x}", event.len());
        let mut data = size.as_bytes().to_vec();
        data.extend_from_slice(event);
        data.extend_from_slice(b"\r\n");
        let crlf = data.len() - 2;
        raw.gather_segs = 4;
        raw.gather_off = [0, crlf as u16, size.len() as u16, crlf as u16];
        raw.gather_len = [size.len() as u16, 2, event.len() as u16, 2];
        raw.gather_tail = data.len() as u16;
        raw.len = (size.len() + event.len() + 4) as u32;
        raw.captured = data.len() as u32;
        (raw, data)
    }

    #[test]
    fn gathered_pieces_come_back_in_order_then_the_rest() {
        let (mut raw, mut data) = node_chunk();
        assert_eq!(
            gathered(&raw, &data).expect("a well-formed gather"),
            &b"13\r\ndata: {\"token\":1}\n\n\r\n"[..]
        );
        // Iovecs past the inline ones follow the windows, in order.
        data.extend_from_slice(b"more");
        raw.len += 4;
        assert_eq!(
            gathered(&raw, &data).expect("a well-formed gather"),
            &b"13\r\ndata: {\"token\":1}\n\n\r\nmore"[..]
        );
    }

    #[test]
    fn an_ungathered_record_is_its_bytes() {
        let raw = tt_data_event::default();
        assert_eq!(gathered(&raw, b"abc").expect("plain bytes"), &b"abc"[..]);
    }

    #[test]
    fn a_gather_that_points_outside_the_bytes_is_refused() {
        let (raw, data) = node_chunk();
        let mut past = raw;
        past.gather_len[2] += 1;
        assert!(gathered(&past, &data).is_err(), "piece past the bytes");
        let mut tail = raw;
        tail.gather_tail = data.len() as u16 + 1;
        assert!(gathered(&tail, &data).is_err(), "rest past the bytes");
        let mut many = raw;
        many.gather_segs = 5;
        assert!(gathered(&many, &data).is_err(), "more pieces than fields");
        let mut moved = raw;
        moved.len -= 1;
        assert!(
            gathered(&moved, &data).is_err(),
            "more than the syscall moved"
        );
    }
}
