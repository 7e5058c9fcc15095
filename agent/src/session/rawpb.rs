//! `raw.pb`: the session's raw event stream in the protobuf format
//! documented in `raw.proto` (next to this file), for offline analysis,
//! bug reports and `tokentrace replay`.
//!
//! The message types are generated from `raw.proto` at build time (protox
//! and prost-build, no system `protoc`); this file converts between them
//! and the agent's own types. The writer streams records as the session
//! processes them, so memory does not grow with the session; the reader
//! yields them one at a time and stops cleanly at a truncated tail.

use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;

use anyhow::{bail, Context, Result};

use super::core::{CpuSample, Profile as CoreProfile, RecordingMeta, SessionCounters};
use crate::event;

/// The first bytes of every raw.pb file.
pub const MAGIC: &[u8; 8] = b"TTRAWPB1";
/// `Header.version` this agent writes and reads.
pub const VERSION: u32 = 1;
/// Largest record accepted when reading (a data event carries at most the
/// 16 KiB capture; a profile can be large).
const MAX_RECORD_BYTES: u64 = 256 << 20;

/// The messages of `raw.proto`, generated at build time (see `build.rs`).
mod pb {
    include!(concat!(env!("OUT_DIR"), "/tokentrace.raw.v1.rs"));
}

use pb::{
    event as event_kind, Conn, ConnId, CudaSync, CudaSyncCall, Data, Direction, Event, IoCall,
    LibraryMapped, Listen, LlmProbe, OffCpu, PeerClose, PeerClosed, Proc, Sample, SendHold,
    SockAddrs, Stack, TcpSendState, TlsHandshake, Usdt,
};
pub use pb::{record, Finish, Header, Profile, Record, Tick};

impl From<&RecordingMeta> for Header {
    fn from(m: &RecordingMeta) -> Self {
        Self {
            version: VERSION,
            agent_version: m.agent_version.clone(),
            hostname: m.hostname.clone(),
            selector: m.selector.clone(),
            started_ns: m.started_ns,
            wall_offset_ns: m.wall_offset_ns,
            profile_hz: m.profile_hz,
            idle_timeout_ns: m.idle_timeout_ns,
            max_buffered_bytes: m.max_buffered_bytes,
            max_connections: m.max_connections,
            stall_threshold_ns: m.stall_threshold_ns,
            explain_history_ns: m.explain_history_ns,
        }
    }
}

impl Header {
    /// The recording's metadata; `ended_ns` is set from the Finish record.
    pub fn meta(&self) -> RecordingMeta {
        RecordingMeta {
            agent_version: self.agent_version.clone(),
            hostname: self.hostname.clone(),
            selector: self.selector.clone(),
            started_ns: self.started_ns,
            ended_ns: self.started_ns,
            wall_offset_ns: self.wall_offset_ns,
            profile_hz: self.profile_hz,
            idle_timeout_ns: self.idle_timeout_ns,
            max_buffered_bytes: self.max_buffered_bytes,
            max_connections: self.max_connections,
            stall_threshold_ns: self.stall_threshold_ns,
            explain_history_ns: self.explain_history_ns,
        }
    }
}

fn conn_id(c: event::ConnId) -> ConnId {
    ConnId {
        pid: c.pid,
        fd: c.fd,
        sock_ino: c.sock_ino,
    }
}

fn from_conn_id(c: Option<ConnId>) -> Result<event::ConnId> {
    let c = c.context("event without a connection id")?;
    Ok(event::ConnId {
        pid: c.pid,
        fd: c.fd,
        sock_ino: c.sock_ino,
    })
}

fn ip_bytes(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    }
}

fn addrs(a: Option<event::SockAddrs>) -> Option<SockAddrs> {
    a.map(|a| SockAddrs {
        local_ip: ip_bytes(a.local.ip()),
        local_port: u32::from(a.local.port()),
        remote_ip: ip_bytes(a.remote.ip()),
        remote_port: u32::from(a.remote.port()),
    })
}

fn ip_from(bytes: &[u8]) -> Result<IpAddr> {
    if let Ok(v4) = <[u8; 4]>::try_from(bytes) {
        return Ok(IpAddr::from(v4));
    }
    if let Ok(v6) = <[u8; 16]>::try_from(bytes) {
        return Ok(IpAddr::from(v6));
    }
    bail!("an IP address of {} bytes", bytes.len())
}

fn from_addrs(a: Option<SockAddrs>) -> Result<Option<event::SockAddrs>> {
    let Some(a) = a else { return Ok(None) };
    let port = |p: u32| u16::try_from(p).context("a port above 65535");
    Ok(Some(event::SockAddrs {
        local: SocketAddr::new(ip_from(&a.local_ip)?, port(a.local_port)?),
        remote: SocketAddr::new(ip_from(&a.remote_ip)?, port(a.remote_port)?),
    }))
}

/// Both directions of an enum's mapping onto its raw.pb twin, from one
/// list of variant pairs: `$to` (model → wire) cannot miss a variant (the
/// match is exhaustive), `$from` refuses `Unspecified` and unknown values.
macro_rules! wire_enum {
    ($to:ident, $from:ident, $what:literal, $model:ident => $wire:ident { $($m:ident <=> $w:ident),+ $(,)? }) => {
        fn $to(value: event::$model) -> $wire {
            match value {
                $(event::$model::$m => $wire::$w,)+
            }
        }

        fn $from(raw: i32) -> Result<event::$model> {
            Ok(match $wire::try_from(raw) {
                $(Ok($wire::$w) => event::$model::$m,)+
                Ok($wire::Unspecified) | Err(_) => bail!("unknown {} {raw}", $what),
            })
        }
    };
}

wire_enum!(io_call, from_io_call, "I/O call", IoCall => IoCall {
    Read <=> Read,
    Readv <=> Readv,
    Recvfrom <=> Recvfrom,
    Recvmsg <=> Recvmsg,
    Write <=> Write,
    Writev <=> Writev,
    Sendto <=> Sendto,
    Sendmsg <=> Sendmsg,
    Sendfile <=> Sendfile,
    SslRead <=> SslRead,
    SslWrite <=> SslWrite,
});

wire_enum!(llm_probe, from_llm_probe, "llm probe", LlmProbe => LlmProbe {
    RequestStart <=> RequestStart,
    RequestQueued <=> RequestQueued,
    RequestScheduled <=> RequestScheduled,
    PrefillStart <=> PrefillStart,
    PrefillEnd <=> PrefillEnd,
    Token <=> Token,
    RequestEnd <=> RequestEnd,
    BatchStep <=> BatchStep,
    RequestPreempted <=> RequestPreempted,
});

wire_enum!(cuda_call, from_cuda_call, "CUDA sync call", CudaSyncCall => CudaSyncCall {
    StreamSynchronize <=> CudaStreamSynchronize,
    DeviceSynchronize <=> CudaDeviceSynchronize,
    EventSynchronize <=> CudaEventSynchronize,
    CuStreamSynchronize <=> CuStreamSynchronize,
    CuCtxSynchronize <=> CuCtxSynchronize,
});

wire_enum!(peer_close, from_peer_close, "peer close reason", PeerClose => PeerClose {
    Fin <=> Fin,
    Rst <=> Rst,
    WriteEpipe <=> WriteEpipe,
    WriteEconnreset <=> WriteEconnreset,
});

fn conn_event(c: &event::ConnEvent) -> Conn {
    Conn {
        conn: Some(conn_id(c.conn)),
        tid: c.tid,
        comm: c.comm.clone(),
        ts_ns: c.ts,
        addrs: addrs(c.addrs),
        established_ns: c.established,
    }
}

fn from_conn_event(c: Conn) -> Result<event::ConnEvent> {
    Ok(event::ConnEvent {
        conn: from_conn_id(c.conn)?,
        tid: c.tid,
        comm: c.comm,
        ts: c.ts_ns,
        addrs: from_addrs(c.addrs)?,
        established: c.established_ns,
    })
}

fn proc_event(p: &event::ProcEvent) -> Proc {
    Proc {
        pid: p.pid,
        ppid: p.ppid,
        comm: p.comm.clone(),
        ts_ns: p.ts,
        filename: p.filename.clone(),
        exit_code: p.exit_code,
    }
}

fn from_proc_event(p: Proc) -> event::ProcEvent {
    event::ProcEvent {
        pid: p.pid,
        ppid: p.ppid,
        comm: p.comm,
        ts: p.ts_ns,
        filename: p.filename,
        exit_code: p.exit_code,
    }
}

impl From<&event::Event> for Event {
    fn from(e: &event::Event) -> Self {
        use event_kind::Kind;
        let kind = match e {
            event::Event::Data(d) => Kind::Data(Data {
                conn: Some(conn_id(d.conn)),
                tid: d.tid,
                comm: d.comm.to_string(),
                ts_enter_ns: d.ts_enter,
                ts_exit_ns: d.ts_exit,
                direction: match d.direction {
                    event::Direction::Ingress => Direction::Ingress,
                    event::Direction::Egress => Direction::Egress,
                } as i32,
                call: io_call(d.call) as i32,
                len: d.len,
                payload: d.payload.to_vec(),
                addrs: addrs(d.addrs),
                tcp: d.tcp.map(|t| TcpSendState {
                    nodelay: t.nodelay,
                    unsent_bytes: t.unsent_bytes,
                }),
                ingress_ns: d.ingress,
            }),
            event::Event::Accept(c) => Kind::Accept(conn_event(c)),
            event::Event::Close(c) => Kind::Close(conn_event(c)),
            event::Event::Exec(p) => Kind::Exec(proc_event(p)),
            event::Event::Exit(p) => Kind::Exit(proc_event(p)),
            event::Event::Fork(p) => Kind::Fork(proc_event(p)),
            event::Event::Listen(l) => Kind::Listen(Listen {
                pid: l.pid,
                comm: l.comm.clone(),
                ts_ns: l.ts,
                port: u32::from(l.port),
            }),
            event::Event::LibraryMapped(m) => Kind::LibraryMapped(LibraryMapped {
                pid: m.pid,
                ts_ns: m.ts,
            }),
            event::Event::Usdt(u) => Kind::Usdt(Usdt {
                pid: u.pid,
                tid: u.tid,
                ts_ns: u.ts,
                probe: llm_probe(u.probe) as i32,
                request_id: u.request_id.clone(),
                args: u.args.to_vec(),
            }),
            event::Event::CudaSync(c) => Kind::CudaSync(CudaSync {
                pid: c.pid,
                tid: c.tid,
                ts_enter_ns: c.ts_enter,
                ts_exit_ns: c.ts_exit,
                call: cuda_call(c.call) as i32,
                handle: c.handle,
                kernel_launches: c.kernel_launches,
                graph_launches: c.graph_launches,
                memcpy_bytes: c.memcpy_bytes,
            }),
            event::Event::OffCpu(o) => Kind::OffCpu(OffCpu {
                pid: o.pid,
                tid: o.tid,
                start_ns: o.start,
                end_ns: o.end,
                syscall: o.syscall,
                state: o.state,
                in_cuda_sync: o.in_cuda_sync,
            }),
            event::Event::SendHold(h) => Kind::SendHold(SendHold {
                pid: h.pid,
                tid: h.tid,
                sock_ino: h.sock_ino,
                write_ts_ns: h.write_ts,
                release_ts_ns: h.release_ts,
                held_bytes: h.held_bytes,
            }),
            event::Event::PeerClosed(p) => Kind::PeerClosed(PeerClosed {
                conn: Some(conn_id(p.conn)),
                ts_ns: p.ts,
                reason: peer_close(p.reason) as i32,
                addrs: addrs(p.addrs),
            }),
            event::Event::TlsHandshake(h) => Kind::TlsHandshake(TlsHandshake {
                conn: Some(conn_id(h.conn)),
                socket_fd: h.socket_fd,
                ts_ns: h.ts,
                first_byte_ns: h.first_byte,
                addrs: addrs(h.addrs),
            }),
        };

        Self { kind: Some(kind) }
    }
}

impl TryFrom<Event> for event::Event {
    type Error = anyhow::Error;

    fn try_from(e: Event) -> Result<Self> {
        use event_kind::Kind;
        Ok(match e.kind.context("event of an unknown kind")? {
            Kind::Data(d) => event::Event::Data(event::DataEvent {
                conn: from_conn_id(d.conn)?,
                tid: d.tid,
                comm: d.comm.into(),
                ts_enter: d.ts_enter_ns,
                ts_exit: d.ts_exit_ns,
                ingress: d.ingress_ns,
                // Recordings keep only the oldest byte's arrival.
                marks: Vec::new(),
                direction: match Direction::try_from(d.direction) {
                    Ok(Direction::Ingress) => event::Direction::Ingress,
                    Ok(Direction::Egress) => event::Direction::Egress,
                    Err(_) => bail!("unknown direction {}", d.direction),
                },
                call: from_io_call(d.call)?,
                len: d.len,
                payload: d.payload.into(),
                addrs: from_addrs(d.addrs)?,
                tcp: d.tcp.map(|t| event::TcpSendState {
                    nodelay: t.nodelay,
                    unsent_bytes: t.unsent_bytes,
                }),
            }),
            Kind::Accept(c) => event::Event::Accept(from_conn_event(c)?),
            Kind::Close(c) => event::Event::Close(from_conn_event(c)?),
            Kind::Exec(p) => event::Event::Exec(from_proc_event(p)),
            Kind::Exit(p) => event::Event::Exit(from_proc_event(p)),
            Kind::Fork(p) => event::Event::Fork(from_proc_event(p)),
            Kind::Listen(l) => event::Event::Listen(event::ListenEvent {
                pid: l.pid,
                comm: l.comm,
                ts: l.ts_ns,
                port: u16::try_from(l.port).context("a listening port above 65535")?,
            }),
            Kind::LibraryMapped(m) => event::Event::LibraryMapped(event::LibraryMapped {
                pid: m.pid,
                ts: m.ts_ns,
            }),
            Kind::Usdt(u) => event::Event::Usdt(event::UsdtEvent {
                pid: u.pid,
                tid: u.tid,
                ts: u.ts_ns,
                probe: from_llm_probe(u.probe)?,
                args: <[u64; 3]>::try_from(u.args.as_slice()).map_err(|_| {
                    anyhow::anyhow!("a USDT event with {} arguments, not 3", u.args.len())
                })?,
                request_id: u.request_id,
            }),
            Kind::CudaSync(c) => event::Event::CudaSync(event::CudaSyncEvent {
                pid: c.pid,
                tid: c.tid,
                ts_enter: c.ts_enter_ns,
                ts_exit: c.ts_exit_ns,
                call: from_cuda_call(c.call)?,
                handle: c.handle,
                kernel_launches: c.kernel_launches,
                graph_launches: c.graph_launches,
                memcpy_bytes: c.memcpy_bytes,
            }),
            Kind::OffCpu(o) => event::Event::OffCpu(event::OffCpuEvent {
                pid: o.pid,
                tid: o.tid,
                start: o.start_ns,
                end: o.end_ns,
                syscall: o.syscall,
                state: o.state,
                in_cuda_sync: o.in_cuda_sync,
            }),
            Kind::SendHold(h) => event::Event::SendHold(event::SendHoldEvent {
                pid: h.pid,
                tid: h.tid,
                sock_ino: h.sock_ino,
                write_ts: h.write_ts_ns,
                release_ts: h.release_ts_ns,
                held_bytes: h.held_bytes,
            }),
            Kind::PeerClosed(p) => event::Event::PeerClosed(event::PeerClosedEvent {
                conn: from_conn_id(p.conn)?,
                ts: p.ts_ns,
                reason: from_peer_close(p.reason)?,
                addrs: from_addrs(p.addrs)?,
            }),
            Kind::TlsHandshake(h) => event::Event::TlsHandshake(event::TlsHandshakeEvent {
                conn: from_conn_id(h.conn)?,
                socket_fd: h.socket_fd,
                ts: h.ts_ns,
                first_byte: h.first_byte_ns,
                addrs: from_addrs(h.addrs)?,
            }),
        })
    }
}

impl From<&CoreProfile> for Profile {
    fn from(p: &CoreProfile) -> Self {
        Self {
            frequency_hz: p.frequency_hz,
            stacks: p
                .stacks
                .iter()
                .map(|frames| Stack {
                    frames: frames.clone(),
                })
                .collect(),
            samples: p
                .samples
                .iter()
                .map(|s| Sample {
                    ts_ns: s.ts,
                    pid: s.pid,
                    tid: s.tid,
                    stack: s.stack,
                })
                .collect(),
        }
    }
}

impl From<Profile> for CoreProfile {
    fn from(p: Profile) -> Self {
        Self {
            frequency_hz: p.frequency_hz,
            stacks: p.stacks.into_iter().map(|s| s.frames).collect(),
            samples: p
                .samples
                .into_iter()
                .map(|s| CpuSample {
                    ts: s.ts_ns,
                    pid: s.pid,
                    tid: s.tid,
                    stack: s.stack,
                })
                .collect(),
        }
    }
}

// ------------------------------------------------------------ file I/O

/// Streams a session's records into a raw.pb file.
pub struct RawWriter {
    out: BufWriter<File>,
    buf: Vec<u8>,
}

impl RawWriter {
    /// Creates `path` and writes the magic and the header.
    pub fn create(path: &Path, meta: &RecordingMeta) -> Result<Self> {
        let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
        let mut writer = Self {
            out: BufWriter::new(file),
            buf: Vec::new(),
        };
        writer.out.write_all(MAGIC)?;
        writer.record(record::Kind::Header(Header::from(meta)))?;
        Ok(writer)
    }

    fn record(&mut self, kind: record::Kind) -> io::Result<()> {
        self.buf.clear();
        prost::Message::encode_length_delimited(&Record { kind: Some(kind) }, &mut self.buf)
            .map_err(io::Error::other)?;
        self.out.write_all(&self.buf)
    }

    pub fn event(&mut self, event: &event::Event) -> io::Result<()> {
        self.record(record::Kind::Event(Event::from(event)))
    }

    pub fn tick(&mut self, now: u64) -> io::Result<()> {
        self.record(record::Kind::Tick(Tick { now_ns: now }))
    }

    /// Writes the Finish record (and the profile) and flushes the file.
    pub fn finish(
        mut self,
        now: u64,
        counters: &SessionCounters,
        profile: Option<&CoreProfile>,
    ) -> io::Result<()> {
        self.record(record::Kind::Finish(Finish {
            now_ns: now,
            events_dropped: counters.events_dropped,
            samples_dropped: counters.samples_dropped,
            profiled: profile.is_some(),
        }))?;
        if let Some(profile) = profile {
            self.record(record::Kind::Profile(Profile::from(profile)))?;
        }
        self.out.flush()
    }
}

/// Reads records back one at a time.
pub struct RawReader<R> {
    input: BufReader<R>,
}

impl RawReader<File> {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        Self::new(file).with_context(|| format!("reading {}", path.display()))
    }
}

impl<R: Read> RawReader<R> {
    /// Checks the magic bytes.
    pub fn new(input: R) -> Result<Self> {
        let mut input = BufReader::new(input);
        let mut magic = [0u8; 8];
        input
            .read_exact(&mut magic)
            .context("too short for a raw.pb file")?;
        if &magic != MAGIC {
            bail!("not a tokentrace raw.pb file (it does not start with {MAGIC:?})");
        }
        Ok(Self { input })
    }

    /// A varint length prefix; `None` at a clean end of file.
    fn length(&mut self) -> Result<Option<u64>> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = match self.input.fill_buf()?.first() {
                Some(&b) => b,
                None if shift == 0 => return Ok(None),
                None => bail!("the file ends inside a record length"),
            };
            self.input.consume(1);
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(Some(value));
            }
        }
        bail!("a record length longer than 10 bytes")
    }

    /// The next record; `Ok(None)` at the end of the file.
    pub fn next_record(&mut self) -> Result<Option<record::Kind>> {
        let Some(len) = self.length()? else {
            return Ok(None);
        };
        if len > MAX_RECORD_BYTES {
            bail!("a record of {len} bytes: the file is corrupt");
        }
        let mut buf = vec![0u8; usize::try_from(len)?];
        self.input
            .read_exact(&mut buf)
            .context("the file ends inside a record (was the agent stopped while writing?)")?;
        let record: Record =
            prost::Message::decode(buf.as_slice()).context("undecodable record")?;
        Ok(record.kind)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::core::tests::{meta, sse_exchange};

    fn path(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("tt-rawpb-{}-{name}", std::process::id()))
    }

    /// One event of every kind, with every optional field set somewhere.
    fn every_kind() -> Vec<event::Event> {
        let mut events = sse_exchange(1_100_000_000, 2, "/v1/chat/completions");
        events.push(event::Event::Exec(event::ProcEvent {
            pid: 5,
            ppid: 1,
            comm: "python3".into(),
            ts: 7,
            filename: "/usr/bin/python3".into(),
            exit_code: 0,
        }));
        events.push(event::Event::Exit(event::ProcEvent {
            pid: 5,
            ppid: 1,
            comm: "python3".into(),
            ts: 8,
            filename: String::new(),
            exit_code: 9,
        }));
        events.push(event::Event::Fork(event::ProcEvent {
            pid: 6,
            ppid: 5,
            comm: "python3".into(),
            ts: 8,
            filename: String::new(),
            exit_code: 0,
        }));
        events.push(event::Event::Listen(event::ListenEvent {
            pid: 5,
            comm: "python3".into(),
            ts: 9,
            port: 8000,
        }));
        events.push(event::Event::LibraryMapped(event::LibraryMapped {
            pid: 5,
            ts: 10,
        }));
        events.push(event::Event::Usdt(event::UsdtEvent {
            pid: 5,
            tid: 6,
            ts: 11,
            probe: event::LlmProbe::Token,
            request_id: "chatcmpl-1".into(),
            args: [3, 0, 0],
        }));
        events.push(event::Event::CudaSync(event::CudaSyncEvent {
            pid: 5,
            tid: 6,
            ts_enter: 12,
            ts_exit: 13,
            call: event::CudaSyncCall::CuCtxSynchronize,
            handle: 0,
            kernel_launches: 4,
            graph_launches: 1,
            memcpy_bytes: 4096,
        }));
        events.push(event::Event::OffCpu(event::OffCpuEvent {
            pid: 5,
            tid: 6,
            start: 14,
            end: 15,
            syscall: None,
            state: 0,
            in_cuda_sync: true,
        }));
        events.push(event::Event::SendHold(event::SendHoldEvent {
            pid: 5,
            tid: 6,
            sock_ino: 77,
            write_ts: 16,
            release_ts: 17,
            held_bytes: 5,
        }));
        events.push(event::Event::PeerClosed(event::PeerClosedEvent {
            conn: event::ConnId {
                pid: 5,
                fd: 7,
                sock_ino: 77,
            },
            ts: 18,
            reason: event::PeerClose::WriteEconnreset,
            addrs: None,
        }));
        events.push(event::Event::TlsHandshake(event::TlsHandshakeEvent {
            conn: event::ConnId {
                pid: 5,
                fd: event::ConnId::TLS_FD,
                sock_ino: 0xdead,
            },
            socket_fd: Some(7),
            ts: 19,
            first_byte: Some(3),
            addrs: None,
        }));
        if let event::Event::Accept(a) = &mut events[0] {
            a.established = Some(1_099_000_000);
        }

        if let event::Event::Data(d) = &mut events[1] {
            d.addrs = event::SockAddrs::from_raw(
                10,
                1,
                2,
                [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
                [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2],
            );
            d.call = event::IoCall::SslRead;
            d.ingress = Some(1_099_500_000);
            d.tcp = Some(event::TcpSendState {
                nodelay: false,
                unsent_bytes: 12,
            });
        }
        events
    }

    #[test]
    fn every_event_kind_round_trips() {
        let events = every_kind();
        for e in &events {
            let back = event::Event::try_from(Event::from(e)).expect("decode");
            assert_eq!(&back, e);
        }
    }

    #[test]
    fn file_round_trips_and_truncation_is_an_error() {
        let p = path("file");
        let m = meta();
        let mut w = RawWriter::create(&p, &m).expect("create");
        let events = sse_exchange(1_100_000_000, 2, "/x");
        for e in &events {
            w.event(e).expect("event");
        }
        w.tick(1_500_000_000).expect("tick");
        let profile = CoreProfile {
            frequency_hz: 99,
            stacks: vec![vec!["a".into(), "b".into()]],
            samples: vec![CpuSample {
                ts: 1,
                pid: 2,
                tid: 3,
                stack: 0,
            }],
        };
        let counters = SessionCounters {
            events_dropped: 4,
            ..SessionCounters::default()
        };
        w.finish(2_000_000_000, &counters, Some(&profile))
            .expect("finish");

        let mut r = RawReader::open(&p).expect("open");
        let mut kinds = Vec::new();
        while let Some(k) = r.next_record().expect("record") {
            kinds.push(k);
        }
        assert_eq!(kinds.len(), 1 + events.len() + 3);
        match &kinds[0] {
            record::Kind::Header(h) => assert_eq!(
                h.meta(),
                RecordingMeta {
                    ended_ns: m.started_ns,
                    ..m
                }
            ),
            other => panic!("first record {other:?}"),
        }
        assert!(matches!(
            kinds[kinds.len() - 2],
            record::Kind::Finish(Finish {
                events_dropped: 4,
                profiled: true,
                ..
            })
        ));
        match kinds.last() {
            Some(record::Kind::Profile(p)) => assert_eq!(CoreProfile::from(p.clone()), profile),
            other => panic!("last record {other:?}"),
        }

        let bytes = std::fs::read(&p).expect("read");
        let cut = &bytes[..bytes.len() - 3];
        let mut r = RawReader::new(cut).expect("magic");
        let mut result = Ok(None);
        for _ in 0..kinds.len() {
            result = r.next_record();
            if result.is_err() {
                break;
            }
        }
        assert!(result.is_err(), "a cut record is reported");
        assert!(RawReader::new(&b"not a raw file"[..]).is_err());
        let _ = std::fs::remove_file(&p);
    }

    /// `testdata/raw-v1.pb` was written by the hand-written prost mirror
    /// of `raw.proto` that preceded the generated types (every event kind,
    /// a tick, the finish record and a profile): files recorded by older
    /// agents must keep reading the same.
    #[test]
    fn a_file_written_by_an_earlier_agent_still_reads() {
        let fixture = include_bytes!("testdata/raw-v1.pb");
        let mut r = RawReader::new(&fixture[..]).expect("magic");
        let mut kinds = Vec::new();
        while let Some(k) = r.next_record().expect("record") {
            kinds.push(k);
        }
        let want = every_kind();
        assert_eq!(kinds.len(), 1 + want.len() + 3);
        match &kinds[0] {
            record::Kind::Header(h) => assert_eq!(
                h.meta(),
                RecordingMeta {
                    ended_ns: meta().started_ns,
                    ..meta()
                }
            ),
            other => panic!("first record {other:?}"),
        }
        for (k, want) in kinds[1..=want.len()].iter().zip(&want) {
            let record::Kind::Event(e) = k else {
                panic!("expected an event, got {k:?}");
            };
            assert_eq!(&event::Event::try_from(e.clone()).expect("decode"), want);
        }
        let rest = &kinds[want.len() + 1..];
        assert!(matches!(
            rest[0],
            record::Kind::Tick(Tick {
                now_ns: 1_500_000_000
            })
        ));
        assert!(matches!(
            rest[1],
            record::Kind::Finish(Finish {
                now_ns: 2_000_000_000,
                events_dropped: 4,
                samples_dropped: 1,
                profiled: true,
            })
        ));
        match &rest[2] {
            record::Kind::Profile(p) => assert_eq!(
                CoreProfile::from(p.clone()),
                CoreProfile {
                    frequency_hz: 99,
                    stacks: vec![vec!["main".into(), "generate".into()]],
                    samples: vec![CpuSample {
                        ts: 1,
                        pid: 2,
                        tid: 3,
                        stack: 0,
                    }],
                }
            ),
            other => panic!("last record {other:?}"),
        }
    }
}
