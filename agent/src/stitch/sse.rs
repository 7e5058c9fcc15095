//! Incremental scanner for `text/event-stream` bodies.
//!
//! What a client sees as a token is an SSE event, dispatched by the blank
//! line that ends it, so the scanner reports events at the byte that
//! dispatches them, whatever way the writes cut the stream: one event per
//! write, several per write, a `data:` line or even the blank line split
//! across writes. Line endings are `\n`, `\r\n` or `\r`, as the
//! [WHATWG spec](https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation)
//! says, including a `\r\n` whose halves land in different writes.
//!
//! Only `data` fields matter for latency; other fields and comments
//! (`: ping`) are parsed so they are not mistaken for data, then dropped.
//!
//! # Unknown runs (truncated captures)
//!
//! An uncaptured write tail ends whatever event was open: the event counts
//! as completed by that write (servers write whole events), with its data
//! marked incomplete. Events wholly inside the tail cannot be seen and are
//! not counted. Scanning resumes at an event boundary with the next write.

use memchr::memchr2;

use super::input::Bytes;

/// One dispatched event that had at least one `data` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SseEvent<'a> {
    /// The `data` lines joined by `\n`, possibly cut (see `complete`).
    pub data: &'a [u8],
    /// False when the data was cut by the capture cap or the buffer limit:
    /// parse it tolerantly.
    pub complete: bool,
}

impl SseEvent<'_> {
    /// `data: [DONE]`, OpenAI's end-of-stream marker: not a token.
    pub(crate) fn is_done_marker(&self) -> bool {
        self.data.trim_ascii() == b"[DONE]"
    }
}

#[derive(Debug, Clone)]
pub(crate) struct SseScanner {
    /// The current line so far (bounded by `cap`).
    line: Vec<u8>,
    line_cut: bool,
    /// The last byte seen was `\r`: a `\n` next is part of the same ending.
    after_cr: bool,
    /// `data` field values of the current event, each followed by `\n`.
    data: Vec<u8>,
    has_data: bool,
    data_cut: bool,
    /// `data` holds the event returned last; cleared on the next call.
    dispatched: bool,
    /// Most bytes kept of the current line and event data together.
    cap: usize,
}

impl SseScanner {
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            line: Vec::new(),
            line_cut: false,
            after_cr: false,
            data: Vec::new(),
            has_data: false,
            data_cut: false,
            dispatched: false,
            cap,
        }
    }

    /// Scans the front of `input` up to and including the next dispatched
    /// data event, advancing `input` past what was used. `None` once
    /// `input` is used up.
    pub(crate) fn next(&mut self, input: &mut Bytes<'_>) -> Option<SseEvent<'_>> {
        if self.dispatched {
            self.data.clear();
            self.has_data = false;
            self.data_cut = false;
            self.dispatched = false;
        }
        match *input {
            Bytes::Unknown(0) => None,
            Bytes::Unknown(_) => {
                *input = Bytes::Unknown(0);
                self.after_cr = false;
                if !self.line.is_empty() {
                    // The rest of this line is in the uncaptured tail.
                    self.line_cut = true;
                    self.end_line();
                }
                if self.has_data {
                    self.data_cut = true;
                    return Some(self.dispatch());
                }
                None
            }
            Bytes::Known(mut bytes) => {
                let dispatch = self.scan(&mut bytes);
                *input = Bytes::Known(bytes);
                if dispatch {
                    Some(self.dispatch())
                } else {
                    None
                }
            }
        }
    }

    /// Consumes lines from `bytes` until one dispatches a data event (true)
    /// or `bytes` runs out (false).
    fn scan(&mut self, bytes: &mut &[u8]) -> bool {
        loop {
            if self.after_cr {
                let Some((&first, rest)) = bytes.split_first() else {
                    return false;
                };
                self.after_cr = false;
                if first == b'\n' {
                    *bytes = rest;
                }
            }
            let Some(i) = memchr2(b'\r', b'\n', bytes) else {
                self.extend_line(bytes);
                *bytes = &[];
                return false;
            };
            self.after_cr = bytes[i] == b'\r';
            let dispatch = if self.line.is_empty() && !self.line_cut {
                // The whole line is in this write (the usual case): read
                // it where it is instead of copying it into `line`.
                let room = self.line_room();
                self.interpret(&bytes[..i.min(room)], i > room)
            } else {
                self.extend_line(&bytes[..i]);
                self.end_line()
            };
            *bytes = &bytes[i + 1..];
            if dispatch {
                return true;
            }
        }
    }

    /// The line and the event's data share one budget of `cap` bytes:
    /// what is left of it for the current line.
    fn line_room(&self) -> usize {
        self.cap.saturating_sub(self.line.len() + self.data.len())
    }

    fn extend_line(&mut self, segment: &[u8]) {
        let room = self.line_room();
        if segment.len() > room {
            self.line_cut = true;
        }
        self.line
            .extend_from_slice(&segment[..segment.len().min(room)]);
    }

    /// Interprets the line gathered in `line`. True when it dispatches an
    /// event with data.
    fn end_line(&mut self) -> bool {
        let line = std::mem::take(&mut self.line);
        let cut = std::mem::replace(&mut self.line_cut, false);
        let dispatch = self.interpret(&line, cut);
        // Keep the allocation for the next line.
        self.line = line;
        self.line.clear();
        dispatch
    }

    /// Interprets a completed line (`cut`: its end was not kept). True when
    /// it dispatches an event with data.
    fn interpret(&mut self, line: &[u8], cut: bool) -> bool {
        if line.is_empty() {
            // A blank line dispatches; without data the event is dropped
            // (and so are its other fields, which we never kept).
            return self.has_data;
        }
        if line[0] != b':' {
            self.field(line, cut);
        }
        false
    }

    fn field(&mut self, line: &[u8], cut: bool) {
        let (name, value) = match line.iter().position(|&c| c == b':') {
            Some(colon) => {
                let value = &line[colon + 1..];
                (&line[..colon], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (line, &[][..]),
        };
        if name != b"data" {
            return;
        }
        self.has_data = true;
        let room = self.cap.saturating_sub(self.data.len());
        if cut || value.len() + 1 > room {
            self.data_cut = true;
        }
        let keep = value.len().min(room);
        self.data.extend_from_slice(&value[..keep]);
        if self.data.len() < self.cap {
            self.data.push(b'\n');
        }
    }

    fn dispatch(&mut self) -> SseEvent<'_> {
        self.dispatched = true;
        let data = self.data.as_slice();
        let data = data.strip_suffix(b"\n").unwrap_or(data);
        SseEvent {
            data,
            complete: !self.data_cut,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Scans `parts` in order; returns (part index, data, complete) per event.
    fn scan(parts: &[Bytes<'_>]) -> Vec<(usize, String, bool)> {
        let mut scanner = SseScanner::new(1 << 20);
        let mut events = Vec::new();
        for (i, part) in parts.iter().enumerate() {
            let mut part = *part;
            while let Some(ev) = scanner.next(&mut part) {
                events.push((
                    i,
                    String::from_utf8_lossy(ev.data).into_owned(),
                    ev.complete,
                ));
            }
            assert!(part.is_empty());
        }
        events
    }

    fn known(parts: &[&'static [u8]]) -> Vec<Bytes<'static>> {
        parts.iter().map(|p| Bytes::Known(p)).collect()
    }

    #[test]
    fn events_dispatch_at_the_blank_line() {
        let events = scan(&known(&[b"data: a\n", b"\n", b"data: b\n\ndata: c\n\n"]));
        assert_eq!(
            events,
            vec![
                (1, "a".to_owned(), true),
                (2, "b".to_owned(), true),
                (2, "c".to_owned(), true)
            ]
        );
    }

    #[test]
    fn all_line_endings_and_split_crlf() {
        let events = scan(&known(&[
            b"data: a\r\n\r",
            b"\ndata: b\r\rdata: c\r",
            b"\n\r\n",
        ]));
        assert_eq!(
            events,
            vec![
                (0, "a".to_owned(), true),
                (1, "b".to_owned(), true),
                (2, "c".to_owned(), true)
            ]
        );
    }

    #[test]
    fn comments_and_dataless_events_are_not_events() {
        let events = scan(&known(&[b": ping\n\nevent: x\nid: 3\n\nretry: 5\n\n"]));
        assert!(events.is_empty());
    }

    #[test]
    fn multi_line_data_and_field_forms() {
        let events = scan(&known(&[b"data:x\ndata\ndata:  y\nevent: e\n\n"]));
        assert_eq!(events, vec![(0, "x\n\n y".to_owned(), true)]);
    }

    #[test]
    fn every_split_point_dispatches_at_the_right_part() {
        let stream = b"data: {\"id\":\"1\"}\r\n\r\n: ping\r\n\r\ndata: [DONE]\r\n\r\n";
        for i in 0..=stream.len() {
            let events = scan(&[Bytes::Known(&stream[..i]), Bytes::Known(&stream[i..])]);
            let first_part = |end: usize| usize::from(i < end);
            // The blank line's `\r` dispatches: bytes 18 and 44.
            assert_eq!(
                events,
                vec![
                    (first_part(19), "{\"id\":\"1\"}".to_owned(), true),
                    (first_part(45), "[DONE]".to_owned(), true)
                ],
                "split at {i}"
            );
        }
    }

    #[test]
    fn unknown_tail_completes_the_open_event() {
        let parts = [
            Bytes::Known(b"data: {\"id\":\"abc\",\"cho"),
            Bytes::Unknown(300),
            Bytes::Known(b"data: next\n\n"),
        ];
        assert_eq!(
            scan(&parts),
            vec![
                (1, "{\"id\":\"abc\",\"cho".to_owned(), false),
                (2, "next".to_owned(), true)
            ]
        );
        // Nothing open: nothing counted.
        assert!(scan(&[Bytes::Known(b"data: a\n\n"), Bytes::Unknown(9)]).len() == 1);
        assert!(scan(&[Bytes::Known(b": pi"), Bytes::Unknown(9)]).is_empty());
    }

    #[test]
    fn long_lines_are_cut_not_grown() {
        let mut scanner = SseScanner::new(8);
        let mut input = Bytes::Known(b"data: 0123456789abcdef\n\n");
        let ev = scanner.next(&mut input).expect("one event");
        // The line itself is cut at 8 bytes: "data: 01".
        assert_eq!((ev.data, ev.complete), (&b"01"[..], false));
        assert!(scanner.line.capacity() <= 64);
    }

    /// A line read where it lies (whole in one write) and one gathered
    /// byte by byte are cut alike by the budget.
    #[test]
    fn whole_and_byte_by_byte_lines_agree_under_any_budget() {
        let stream = b"data: 0123456789\r\n: c\n\ndata:ab\ndata: cdefgh\n\n\ndata: [DONE]\n\n";
        for cap in 0..40 {
            let events = |parts: &[&[u8]]| {
                let mut scanner = SseScanner::new(cap);
                let mut out = Vec::new();
                for part in parts {
                    let mut input = Bytes::Known(part);
                    while let Some(ev) = scanner.next(&mut input) {
                        out.push((ev.data.to_vec(), ev.complete));
                    }
                }
                out
            };
            let bytes: Vec<&[u8]> = stream.chunks(1).collect();
            assert_eq!(events(&[stream]), events(&bytes), "cap {cap}");
        }
    }

    #[test]
    fn done_marker() {
        let ev = SseEvent {
            data: b" [DONE] ",
            complete: true,
        };
        assert!(ev.is_done_marker());
    }
}
