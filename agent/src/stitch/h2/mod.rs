//! HTTP/2 server connections: frames in both directions, streams by id,
//! one [`RequestTimeline`] per stream that carried a request.
//!
//! Timing never depends on HPACK (see `design.md`, "HTTP/2 and gRPC"):
//! a stream's request starts with the read that brought the first byte of
//! the client's HEADERS frame (its arrival at the host when the kernel
//! dated it and the HEADERS opens the read, as for HTTP/1.1); its response starts with the write of the
//! server's HEADERS; it ends with the server's END_STREAM (on DATA or on
//! trailers) or an RST_STREAM from either side. HPACK only labels streams.
//!
//! Layout: [`frame`] cuts each direction into frames, [`hpack`] (with
//! [`huffman`]) decodes header blocks into [`labels`], [`stream`] turns one
//! stream's frames into its timeline, [`grpc`] counts gRPC messages, and
//! [`flow`] tracks the send windows that make a server wait.

mod flow;
pub(super) mod frame;
mod grpc;
mod hpack;
mod huffman;
mod huffman_table;
mod labels;
mod stream;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::event::{ConnId, Direction, MonoNs};

use super::error::StitchError;
use super::exchange::{Exchange, RequestStart, Setup};
use super::input::{Bytes, Io};
use super::sink::Sink;
use super::timeline::{AbortReason, RequestTimeline};

use flow::Windows;
use frame::{flags, FrameEvent, FrameHeader, FrameReader, Kind};
use labels::Labels;
use stream::Stream;

/// True when a server's first read begins the client preface (the whole
/// preface, or as much of it as the read brought, at least `PRI `). This
/// is also how HTTP/2 over TLS (ALPN `h2`) shows: the OpenSSL probes see
/// the preface as the first plaintext.
pub(crate) fn begins_with_preface(bytes: &[u8]) -> bool {
    let n = bytes.len().min(frame::PREFACE.len());
    n >= 4 && bytes[..n] == frame::PREFACE[..n]
}

/// True when `bytes`, the captured start of a syscall, is a chain of HTTP/2
/// frames: how a connection that was open before tracing is recognised.
pub(crate) fn looks_like_frames(bytes: &[u8], truncated: bool) -> bool {
    frame::looks_like_frames(bytes, truncated, frame::DEFAULT_MAX_FRAME)
}

/// Most streams tracked at once on one connection; HEADERS for more are a
/// parse error (servers advertise 100-1000 in SETTINGS_MAX_CONCURRENT_STREAMS).
pub const MAX_STREAMS: usize = 1024;

/// Most bytes one stream keeps of a body prefix or an SSE event. A stream
/// gets the connection's buffer limit shared by the streams open when it
/// starts, within these bounds, so a connection holds about its limit
/// whatever the number of streams (and at most `MAX_STREAMS` times the
/// floor).
const STREAM_BUFFER: std::ops::RangeInclusive<usize> = 1024..=16 * 1024;

/// Most bytes of one header block kept for HPACK (bigger blocks lose their
/// labels and clear the decoder's table).
const MAX_HEADER_BLOCK: usize = 64 * 1024;

/// Most bytes of a control frame's payload kept (SETTINGS with 64 entries).
const MAX_CONTROL: usize = 6 * 64;

/// Stream ids of streams skipped because they were in flight when tracing
/// began, remembered so each is counted once.
const MAX_SKIPPED: usize = 1024;

/// One direction of the connection.
#[derive(Debug, Clone)]
struct Half {
    reader: FrameReader,
    hpack: hpack::Decoder,
    /// The frame being read and whether its payload started yet.
    frame: Option<(FrameHeader, bool)>,
    /// The header block being collected (HEADERS or PUSH_PROMISE, then
    /// CONTINUATION).
    block: Option<Block>,
    /// Captured payload of the current control frame: its contiguous
    /// prefix only (a field after uncaptured bytes or past `MAX_CONTROL`
    /// would be read from the wrong offset).
    control: Vec<u8>,
    control_cut: bool,
}

impl Half {
    fn new(reader: FrameReader) -> Self {
        Self {
            reader,
            hpack: hpack::Decoder::default(),
            frame: None,
            block: None,
            control: Vec::new(),
            control_cut: false,
        }
    }
}

#[derive(Debug, Clone)]
struct Block {
    stream: u32,
    /// Flags of the HEADERS frame that opened it (END_STREAM lives there).
    flags: u8,
    push: bool,
    buf: Vec<u8>,
    /// Bytes of the block were not captured: it cannot be decoded.
    lost: bool,
}

#[derive(Debug, Clone)]
pub(crate) struct H2Conn {
    conn: ConnId,
    client: Half,
    server: Half,
    streams: BTreeMap<u32, Stream>,
    windows: Windows,
    /// The highest client stream id opened while traced; streams the
    /// server writes on that are not tracked and not above it were in
    /// flight when tracing began (or already ended).
    last_opened: u32,
    /// The first stream id opened while traced (`None` before any).
    first_opened: Option<u32>,
    /// Adopted mid-connection: streams below `first_opened` predate us.
    midstream: bool,
    skipped: BTreeSet<u32>,
    /// Charged to the connection's first stream.
    setup: Setup,
    opened: u64,
    cap: usize,
    id_headers: Arc<[String]>,
}

impl H2Conn {
    /// A connection whose client preface is the next thing read.
    pub(crate) fn with_preface(conn: ConnId, setup: Setup, cap: usize, ids: Arc<[String]>) -> Self {
        Self::new(
            conn,
            FrameReader::expecting_preface(),
            setup,
            cap,
            ids,
            false,
        )
    }

    /// A connection found mid-way (adopted from data): both directions are
    /// at frame boundaries, HPACK state unknown.
    pub(crate) fn midstream(conn: ConnId, cap: usize, ids: Arc<[String]>) -> Self {
        let reader = FrameReader::at_frame_boundary();
        Self::new(conn, reader, Setup::default(), cap, ids, true)
    }

    /// An HTTP/1.1 connection upgraded with `101` + `Upgrade: h2c`: the
    /// upgrading request is stream 1 (its request already complete), and
    /// the client's preface comes next.
    pub(crate) fn upgraded(
        conn: ConnId,
        request: Exchange,
        cap: usize,
        ids: Arc<[String]>,
    ) -> Self {
        let mut h2 = Self::new(
            conn,
            FrameReader::expecting_preface(),
            Setup::default(),
            cap,
            ids,
            false,
        );
        h2.server = Half::new(FrameReader::at_frame_boundary());
        h2.opened = 1;
        h2.last_opened = 1;
        h2.first_opened = Some(1);
        h2.windows.stream_opened(1, request.timeline.read_start);
        let stream_cap = cap.min(*STREAM_BUFFER.end());
        h2.streams.insert(1, Stream::upgraded(request, stream_cap));
        h2
    }

    fn new(
        conn: ConnId,
        client_reader: FrameReader,
        setup: Setup,
        cap: usize,
        id_headers: Arc<[String]>,
        midstream: bool,
    ) -> Self {
        Self {
            conn,
            client: Half::new(client_reader),
            server: Half::new(FrameReader::at_frame_boundary()),
            streams: BTreeMap::new(),
            windows: Windows::default(),
            last_opened: 0,
            first_opened: None,
            midstream,
            skipped: BTreeSet::new(),
            setup,
            opened: 0,
            cap,
            id_headers,
        }
    }

    /// Feeds one read (`Ingress`, from the client) or write (`Egress`).
    /// Finished streams go to `finished`. A framing error is returned after
    /// the rest of the syscall was dropped; the direction then waits for a
    /// syscall that begins with frames, and streams it may have carried
    /// are marked inexact.
    pub(crate) fn on_io(
        &mut self,
        dir: Direction,
        io: &Io<'_>,
        sink: &mut Sink<'_>,
        finished: &mut Vec<RequestTimeline>,
    ) -> Result<(), StitchError> {
        let half = self.half(dir);
        if half.reader.is_lost() && !half.reader.resync(io.known, io.is_truncated()) {
            return Ok(());
        }
        let total = io.known.len() as u64 + io.unknown;
        let mut after_known = io.unknown;
        for mut piece in io.pieces() {
            loop {
                let event = match self.half(dir).reader.next(&mut piece) {
                    Ok(Some(event)) => event,
                    Ok(None) => break,
                    Err(source) => {
                        self.lose(dir);
                        return Err(StitchError::Frames {
                            conn: self.conn,
                            source,
                        });
                    }
                };
                // Where in this syscall the event's frame began (a Start
                // comes right after its 9-byte header).
                let consumed = total - piece.len() - after_known;
                let at = consumed.saturating_sub(frame::HEADER_LEN as u64);
                self.on_event(dir, event, io, at, sink, finished);
            }
            after_known = 0;
        }
        Ok(())
    }

    fn half(&mut self, dir: Direction) -> &mut Half {
        match dir {
            Direction::Ingress => &mut self.client,
            Direction::Egress => &mut self.server,
        }
    }

    fn on_event(
        &mut self,
        dir: Direction,
        event: FrameEvent<'_>,
        io: &Io<'_>,
        at: u64,
        sink: &mut Sink<'_>,
        finished: &mut Vec<RequestTimeline>,
    ) {
        match event {
            FrameEvent::Start(frame) => {
                let half = self.half(dir);
                half.frame = Some((frame, false));
                half.control.clear();
                half.control_cut = false;
                self.frame_start(dir, frame, io, at, sink);
            }
            FrameEvent::Payload(bytes) => {
                let Some((frame, started)) = self.half(dir).frame else {
                    return;
                };
                self.payload(dir, frame, !started, bytes, io.ts);
                if let Some((_, started)) = &mut self.half(dir).frame {
                    *started = true;
                }
            }
            FrameEvent::PaddingUnknown => {
                if let Some((frame, _)) = self.half(dir).frame {
                    if let Some(s) = self.streams.get_mut(&frame.stream) {
                        s.mark_inexact();
                    }
                }
            }
            FrameEvent::End(frame) => {
                self.half(dir).frame = None;
                self.frame_end(dir, frame, io.ts, sink, finished);
            }
            FrameEvent::Lost => self.lose(dir),
        }
    }

    fn frame_start(
        &mut self,
        dir: Direction,
        frame: FrameHeader,
        io: &Io<'_>,
        at: u64,
        sink: &mut Sink<'_>,
    ) {
        let id = frame.stream;
        match (frame.kind, dir) {
            (Kind::Headers, _) => {
                if dir == Direction::Ingress {
                    // Dated by the segment that carried the frame's first
                    // byte, not the read's oldest: anything before it in
                    // the read (the preface's SETTINGS, another request
                    // sent earlier in a segment of its own) may have
                    // arrived earlier (seen: of 32 grpcio calls started at
                    // once on one connection, one dated 0.073 ms before its
                    // client sent it). Without marks only a HEADERS that
                    // opens the read is dated.
                    self.open_stream(id, io, at, sink);
                } else if let Some(s) = self.streams.get_mut(&id) {
                    s.server_headers_start(io.ts);
                }
                self.half(dir).block = Some(Block {
                    stream: id,
                    flags: frame.flags,
                    push: false,
                    buf: Vec::new(),
                    lost: false,
                });
            }
            (Kind::PushPromise, _) => {
                self.half(dir).block = Some(Block {
                    stream: id,
                    flags: frame.flags,
                    push: true,
                    buf: Vec::new(),
                    lost: false,
                });
            }
            (Kind::Continuation, _) => {
                let half = self.half(dir);
                if half.block.as_ref().is_none_or(|b| b.stream != id) {
                    // A CONTINUATION of a block we did not see start: its
                    // insertions are unknown.
                    half.block = None;
                    half.hpack.clear();
                }
            }
            (Kind::Data, Direction::Egress) => {
                let waited = self.windows.server_data(id, frame.len, io.ts);
                match self.streams.get_mut(&id) {
                    Some(s) => s.data_start(waited),
                    None => self.untracked_stream(id, sink),
                }
            }
            _ => {}
        }
    }

    fn payload(
        &mut self,
        dir: Direction,
        frame: FrameHeader,
        first: bool,
        bytes: Bytes<'_>,
        ts: MonoNs,
    ) {
        match frame.kind {
            Kind::Data => {
                if let Some(s) = self.streams.get_mut(&frame.stream) {
                    match dir {
                        Direction::Ingress => s.request_data(bytes, first, frame.len, ts),
                        Direction::Egress => s.response_data(bytes, first, frame.len, ts),
                    }
                }
            }
            Kind::Headers | Kind::PushPromise | Kind::Continuation => {
                let half = self.half(dir);
                if let Some(block) = &mut half.block {
                    match bytes {
                        Bytes::Known(b) if block.buf.len() + b.len() <= MAX_HEADER_BLOCK => {
                            block.buf.extend_from_slice(b)
                        }
                        _ => block.lost = true,
                    }
                }
            }
            _ => {
                let half = self.half(dir);
                match bytes {
                    Bytes::Known(b)
                        if !half.control_cut && half.control.len() + b.len() <= MAX_CONTROL =>
                    {
                        half.control.extend_from_slice(b)
                    }
                    _ => half.control_cut = true,
                }
            }
        }
    }

    fn frame_end(
        &mut self,
        dir: Direction,
        frame: FrameHeader,
        ts: MonoNs,
        sink: &mut Sink<'_>,
        finished: &mut Vec<RequestTimeline>,
    ) {
        let id = frame.stream;
        let end_stream = frame.has(flags::END_STREAM);
        match frame.kind {
            Kind::Data => match dir {
                Direction::Ingress => {
                    if let Some(s) = self.streams.get_mut(&id) {
                        s.request_frame_end(end_stream, ts);
                    }
                }
                Direction::Egress => {
                    if let Some(s) = self.streams.get_mut(&id) {
                        s.response_frame_end(ts);
                    }
                    if end_stream {
                        self.finish_stream(id, ts, None, finished);
                    }
                }
            },
            Kind::Headers | Kind::PushPromise | Kind::Continuation
                if frame.has(flags::END_HEADERS) =>
            {
                self.header_block_end(dir, ts, sink, finished);
            }
            Kind::RstStream => {
                let reason = match dir {
                    Direction::Ingress => AbortReason::ClientClosed,
                    Direction::Egress => AbortReason::ServerClosed,
                };
                self.finish_stream(id, ts, Some(reason), finished);
            }
            Kind::Settings if !frame.has(flags::ACK) => self.settings(dir, ts),
            Kind::WindowUpdate if dir == Direction::Ingress => {
                if let Some(inc) = self.control_u32(dir, 0) {
                    self.windows.window_update(id, inc & 0x7fff_ffff, ts);
                }
            }
            Kind::GoAway if dir == Direction::Egress => {
                if let Some(last) = self.control_u32(dir, 0) {
                    let last = last & 0x7fff_ffff;
                    let refused: Vec<u32> =
                        self.streams.range(last + 1..).map(|(&k, _)| k).collect();
                    for id in refused {
                        self.finish_stream(id, ts, Some(AbortReason::ServerClosed), finished);
                    }
                }
            }
            _ => {}
        }
    }

    /// The 32-bit big-endian word at `at` of the current control frame.
    fn control_u32(&mut self, dir: Direction, at: usize) -> Option<u32> {
        let half = self.half(dir);
        let b = half.control.get(at..at + 4)?;
        Some(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn settings(&mut self, dir: Direction, ts: MonoNs) {
        let half = self.half(dir);
        let mut updates = Vec::new();
        for entry in half.control.chunks_exact(6) {
            let id = u16::from_be_bytes([entry[0], entry[1]]);
            let value = u32::from_be_bytes([entry[2], entry[3], entry[4], entry[5]]);
            updates.push((id, value));
        }
        for (id, value) in updates {
            match (id, dir) {
                // SETTINGS_MAX_FRAME_SIZE: what this peer accepts, i.e. the
                // limit of the other direction's frames.
                (0x5, _) if (frame::DEFAULT_MAX_FRAME..1 << 24).contains(&value) => {
                    let other = match dir {
                        Direction::Ingress => Direction::Egress,
                        Direction::Egress => Direction::Ingress,
                    };
                    self.half(other).reader.max_frame = value;
                }
                // SETTINGS_INITIAL_WINDOW_SIZE from the client: the server's
                // send window of every stream.
                (0x4, Direction::Ingress) => self.windows.set_initial_stream_window(value, ts),
                _ => {}
            }
        }
    }

    /// `at`: where in the read this HEADERS frame starts; it is dated by
    /// the segment (or TLS record) that carried that byte.
    fn open_stream(&mut self, id: u32, io: &Io<'_>, at: u64, sink: &mut Sink<'_>) {
        if self.streams.contains_key(&id) || id.is_multiple_of(2) || id <= self.last_opened {
            return; // trailers of a request, or a stream we skipped
        }
        if self.streams.len() >= MAX_STREAMS {
            sink.parse_error(&StitchError::TooManyStreams {
                conn: self.conn,
                limit: MAX_STREAMS,
            });
            return;
        }
        self.last_opened = id;
        self.first_opened.get_or_insert(id);
        let setup = if self.opened == 0 {
            self.setup
        } else {
            Setup::default()
        };
        self.opened += 1;
        let start = RequestStart {
            read: io.ts,
            ingress: io.arrival_at(at),
        };
        self.windows.stream_opened(id, io.ts);
        let share = self.cap / (self.streams.len() + 1);
        let cap = share
            .clamp(*STREAM_BUFFER.start(), *STREAM_BUFFER.end())
            .min(self.cap);
        let stream = Stream::open(self.conn, id, start, setup, cap);
        self.streams.insert(id, stream);
    }

    /// The server wrote on a stream we do not track: one that was in
    /// flight when tracing began (counted once), or one that already ended.
    fn untracked_stream(&mut self, id: u32, sink: &mut Sink<'_>) {
        let predates = self.midstream && self.first_opened.is_none_or(|first| id < first);
        if predates && self.skipped.len() < MAX_SKIPPED && self.skipped.insert(id) {
            sink.stream_in_flight_at_start();
        }
    }

    fn header_block_end(
        &mut self,
        dir: Direction,
        ts: MonoNs,
        sink: &mut Sink<'_>,
        finished: &mut Vec<RequestTimeline>,
    ) {
        let ids = Arc::clone(&self.id_headers);
        let half = self.half(dir);
        let Some(block) = half.block.take() else {
            return;
        };
        let mut labels = Labels::default();
        if block.lost {
            half.hpack.clear();
            sink.hpack_lost_block();
        } else {
            let stats = half.hpack.decode(&block.buf, |h| labels.take(h, &ids));
            sink.hpack_unknown_indexes(stats.unknown_indexes);
            if stats.broken {
                sink.hpack_lost_block();
            }
        }
        if block.push {
            return;
        }
        let end_stream = block.flags & flags::END_STREAM != 0;
        let id = block.stream;
        let len = block.buf.len();
        match dir {
            Direction::Ingress => {
                if let Some(s) = self.streams.get_mut(&id) {
                    s.request_headers(labels, &ids, len, ts);
                    if end_stream {
                        s.request_frame_end(true, ts);
                    }
                }
            }
            Direction::Egress => {
                let Some(s) = self.streams.get_mut(&id) else {
                    self.untracked_stream(id, sink);
                    return;
                };
                s.response_headers(labels, len);
                if end_stream {
                    self.finish_stream(id, ts, None, finished);
                }
            }
        }
    }

    fn finish_stream(
        &mut self,
        id: u32,
        ts: MonoNs,
        abort: Option<AbortReason>,
        finished: &mut Vec<RequestTimeline>,
    ) {
        self.windows.stream_closed(id);
        if let Some(s) = self.streams.remove(&id) {
            finished.push(s.into_timeline(ts, abort));
        }
    }

    /// Framing of `dir` was lost: a header block in progress is gone (and
    /// with it the decoder's table alignment); streams whose bytes may have
    /// been in the lost run can no longer be counted exactly.
    fn lose(&mut self, dir: Direction) {
        let half = self.half(dir);
        half.block = None;
        half.frame = None;
        half.hpack.clear();
        for s in self.streams.values_mut() {
            match dir {
                Direction::Egress => s.response_bytes_lost(),
                Direction::Ingress => s.mark_inexact(),
            }
        }
    }

    /// Every stream in flight, aborted at `end` with `reason`, lowest id
    /// first.
    /// The open streams' exchanges, by stream id.
    pub(crate) fn exchanges(&self) -> impl Iterator<Item = &Exchange> {
        self.streams.values().map(Stream::exchange)
    }

    pub(crate) fn drain(&mut self, end: MonoNs, reason: AbortReason) -> Vec<RequestTimeline> {
        std::mem::take(&mut self.streams)
            .into_values()
            .map(|s| s.into_timeline(end, Some(reason)))
            .collect()
    }
}
