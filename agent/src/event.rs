//! Typed events: what the kernel probes saw, decoded and owned.
//!
//! `ingest` builds these from ring buffer records; `stitch` consumes them.
//! Nothing here knows about libbpf, so stitching is testable with events
//! built by hand.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use bytes::Bytes;

/// Nanoseconds of `CLOCK_MONOTONIC`, the clock `bpf_ktime_get_ns` reads.
pub type MonoNs = u64;

/// Identity of one TCP connection inside one process.
///
/// The fd alone is reused after close; the socket inode tells a new
/// connection on a reused fd apart from the old one. A TLS connection seen
/// through OpenSSL has no fd of its own ([`ConnId::TLS_FD`]) and is keyed by
/// its `SSL*` in `sock_ino`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId {
    pub pid: u32,
    pub fd: i32,
    pub sock_ino: u64,
}

impl ConnId {
    /// The fd of connections keyed by their `SSL*`.
    pub const TLS_FD: i32 = -1;

    /// A plaintext stream read and written through OpenSSL.
    pub fn is_tls(&self) -> bool {
        self.fd == Self::TLS_FD
    }
}

impl fmt::Display for ConnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_tls() {
            write!(f, "pid {} SSL* {:#x}", self.pid, self.sock_ino)
        } else {
            write!(f, "pid {} fd {} sock {}", self.pid, self.fd, self.sock_ino)
        }
    }
}

/// Which way bytes moved, seen from the traced process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// The process read bytes from the socket (a request, for a server).
    Ingress,
    /// The process wrote bytes to the socket (a response, for a server).
    Egress,
}

/// The syscall that moved the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IoCall {
    Read,
    Readv,
    Recvfrom,
    Recvmsg,
    Write,
    Writev,
    Sendto,
    Sendmsg,
    Sendfile,
    /// OpenSSL `SSL_read` / `SSL_read_ex` (plaintext of a TLS connection).
    SslRead,
    /// OpenSSL `SSL_write` / `SSL_write_ex`.
    SslWrite,
}

impl IoCall {
    /// Plaintext seen inside OpenSSL rather than on a socket.
    pub fn is_tls(self) -> bool {
        matches!(self, IoCall::SslRead | IoCall::SslWrite)
    }
}

/// Local and remote endpoint of a TCP socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SockAddrs {
    pub local: SocketAddr,
    pub remote: SocketAddr,
}

impl SockAddrs {
    /// Builds the pair from the raw fields of `struct sock_addrs`; `None` for
    /// an unknown address family.
    pub fn from_raw(
        family: u16,
        local_port: u16,
        remote_port: u16,
        local: [u8; 16],
        remote: [u8; 16],
    ) -> Option<Self> {
        const AF_INET: u16 = 2;
        const AF_INET6: u16 = 10;
        let ip = |raw: [u8; 16]| -> Option<IpAddr> {
            match family {
                AF_INET => Some(IpAddr::V4(Ipv4Addr::new(raw[0], raw[1], raw[2], raw[3]))),
                AF_INET6 => Some(IpAddr::V6(Ipv6Addr::from(raw))),
                _ => None,
            }
        };
        Some(Self {
            local: SocketAddr::new(ip(local)?, local_port),
            remote: SocketAddr::new(ip(remote)?, remote_port),
        })
    }
}

/// A process name as the kernel keeps it (`TASK_COMM_LEN`: 15 bytes and a
/// NUL), held inline: every data record carries one, and a heap string per
/// record was a tenth of the agent's time under a flood (a shared one
/// moved the cost to its count, bounced between the decoding and the
/// stitching thread).
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct ProcessName {
    bytes: [u8; ProcessName::MAX],
    len: u8,
}

impl ProcessName {
    /// The longest name the kernel records, in bytes.
    pub const MAX: usize = 15;

    /// `name`, cut at a character boundary to [`Self::MAX`] bytes.
    pub fn new(name: &str) -> Self {
        let mut len = name.len().min(Self::MAX);
        while !name.is_char_boundary(len) {
            len -= 1;
        }
        let mut bytes = [0; Self::MAX];
        bytes[..len].copy_from_slice(&name.as_bytes()[..len]);
        Self {
            bytes,
            len: len as u8,
        }
    }

    pub fn as_str(&self) -> &str {
        // Valid by construction: a prefix of a str cut at a boundary.
        std::str::from_utf8(&self.bytes[..usize::from(self.len)]).unwrap_or_default()
    }
}

impl std::ops::Deref for ProcessName {
    type Target = str;

    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl fmt::Debug for ProcessName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl From<&str> for ProcessName {
    fn from(name: &str) -> Self {
        Self::new(name)
    }
}

impl From<String> for ProcessName {
    fn from(name: String) -> Self {
        Self::new(&name)
    }
}

/// Bytes moved by one read- or write-family syscall on a TCP socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataEvent {
    pub conn: ConnId,
    pub tid: u32,
    pub comm: ProcessName,
    /// When the syscall was entered. For egress this is the moment the
    /// process handed the bytes over: the emit time of a token.
    pub ts_enter: MonoNs,
    /// When the syscall returned. For ingress this is when the bytes were in
    /// the process: the server's read of a request.
    pub ts_exit: MonoNs,
    /// Ingress: when the oldest byte this read returned reached the host
    /// (the kernel's receive path, before any process saw it); `None` when
    /// it arrived before the socket was tracked.
    pub ingress: Option<MonoNs>,
    /// Ingress: when each range of the read's bytes reached the host (the
    /// segment, or for TLS plaintext the record, that carried it), in
    /// offset order; empty when the kernel had none (bytes that came
    /// before the socket was tracked, recordings made before issue 27).
    pub marks: Vec<IngressMark>,
    pub direction: Direction,
    pub call: IoCall,
    /// Bytes the syscall really moved.
    pub len: u32,
    /// The captured prefix of those bytes (`payload.len() <= len`). From the
    /// ring buffer it is a slice of the buffer its whole delivered batch
    /// shares (one allocation per batch instead of one per record): cheap
    /// to clone, and it keeps that buffer alive, so what holds events for
    /// long copies the bytes out (the trigger history does).
    pub payload: Bytes,
    pub addrs: Option<SockAddrs>,
    /// Send-side TCP state after an egress write on a socket.
    pub tcp: Option<TcpSendState>,
}

/// What the socket did with a write's bytes, read when the write returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpSendState {
    /// TCP_NODELAY set: Nagle's algorithm off.
    pub nodelay: bool,
    /// Bytes written but not yet transmitted (held by Nagle, the congestion
    /// window or the peer's receive window).
    pub unsent_bytes: u32,
}

/// Bytes `offset .. offset + len` of a read reached the host at `ts`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IngressMark {
    pub offset: u32,
    pub len: u32,
    pub ts: MonoNs,
}

impl DataEvent {
    /// When the read's byte at `offset` reached the host, if a mark covers
    /// it.
    pub fn arrival_at(marks: &[IngressMark], offset: u64) -> Option<MonoNs> {
        marks
            .iter()
            .find(|m| {
                let start = u64::from(m.offset);
                (start..start + u64::from(m.len)).contains(&offset)
            })
            .map(|m| m.ts)
    }

    /// True when the capture cap cut this payload short.
    pub fn is_truncated(&self) -> bool {
        (self.payload.len() as u64) < u64::from(self.len)
    }
}

/// A connection accepted by, or closed in, a traced process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnEvent {
    pub conn: ConnId,
    pub tid: u32,
    pub comm: String,
    pub ts: MonoNs,
    pub addrs: Option<SockAddrs>,
    /// Accept: when the handshake completed (the connection entered the
    /// accept queue); `None` when unknown (the listener was not yet known
    /// to be traced) and for closes.
    pub established: Option<MonoNs>,
}

/// How the peer ended a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PeerClose {
    /// A FIN arrived: the peer will send no more (it closed, or half-closed).
    Fin,
    /// An RST arrived: the peer is gone.
    Rst,
    /// A write failed with EPIPE.
    WriteEpipe,
    /// A write failed with ECONNRESET.
    WriteEconnreset,
}

impl PeerClose {
    /// The peer is certainly gone (not a half-close).
    pub fn is_reset(self) -> bool {
        !matches!(self, PeerClose::Fin)
    }
}

/// The peer (a server's client) ended a traced TCP connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerClosedEvent {
    /// The socket's owner, fd and inode as the probes last saw them.
    pub conn: ConnId,
    pub ts: MonoNs,
    pub reason: PeerClose,
    /// Ties the socket to a TLS connection, which is keyed by its `SSL*`.
    pub addrs: Option<SockAddrs>,
}

/// `SSL_do_handshake` succeeded on a traced `SSL*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsHandshakeEvent {
    /// The TLS connection (fd [`ConnId::TLS_FD`], `sock_ino` = the `SSL*`).
    pub conn: ConnId,
    /// Its socket's fd, when known.
    pub socket_fd: Option<i32>,
    /// When the handshake completed.
    pub ts: MonoNs,
    /// When the connection's first byte (the ClientHello) reached the host.
    pub first_byte: Option<MonoNs>,
    pub addrs: Option<SockAddrs>,
}

/// A process exec'd, or a traced process exited or forked (`pid` is the
/// child, `ppid` the traced parent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcEvent {
    pub pid: u32,
    pub ppid: u32,
    pub comm: String,
    pub ts: MonoNs,
    /// Path given to exec (empty for exits).
    pub filename: String,
    /// Raw `task->exit_code` for exits (signal in the low 7 bits).
    pub exit_code: i32,
}

/// A traced process mapped a file executable: a library was loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibraryMapped {
    pub pid: u32,
    pub ts: MonoNs,
}

/// The `llm` USDT provider's probes (see instrument/README.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LlmProbe {
    RequestStart,
    RequestQueued,
    RequestScheduled,
    PrefillStart,
    PrefillEnd,
    Token,
    RequestEnd,
    BatchStep,
    /// The engine took the request's KV cache away to make room for others;
    /// it waits to be scheduled again.
    RequestPreempted,
}

/// An `llm:*` USDT probe fired in a traced process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsdtEvent {
    pub pid: u32,
    pub tid: u32,
    pub ts: MonoNs,
    pub probe: LlmProbe,
    /// Empty for `batch_step`.
    pub request_id: String,
    /// Integer arguments after the request id (`batch_step`: step id,
    /// batch size, tokens in step). For request-id probes `args[1]` is the
    /// optional `at_ns` (0 when absent): see [`UsdtEvent::at`].
    pub args: [u64; 3],
}

impl UsdtEvent {
    /// When the event happened: the probe's optional `at_ns` argument
    /// (instrumentation that learns of an event after the fact, like vLLM's
    /// stamped scheduler events, passes the original CLOCK_MONOTONIC time),
    /// else the firing time. An `at_ns` later than the firing cannot be
    /// true of the same clock and is ignored.
    pub fn at(&self) -> MonoNs {
        match self.args[1] {
            at if self.probe != LlmProbe::BatchStep && at != 0 && at <= self.ts => at,
            _ => self.ts,
        }
    }
}

/// CUDA calls that wait for the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum CudaSyncCall {
    #[serde(rename = "cudaStreamSynchronize")]
    StreamSynchronize,
    #[serde(rename = "cudaDeviceSynchronize")]
    DeviceSynchronize,
    #[serde(rename = "cudaEventSynchronize")]
    EventSynchronize,
    #[serde(rename = "cuStreamSynchronize")]
    CuStreamSynchronize,
    #[serde(rename = "cuCtxSynchronize")]
    CuCtxSynchronize,
}

/// A CUDA synchronisation call of a traced thread, with the work that
/// thread enqueued since its previous sync.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaSyncEvent {
    pub pid: u32,
    pub tid: u32,
    pub ts_enter: MonoNs,
    pub ts_exit: MonoNs,
    pub call: CudaSyncCall,
    /// Stream or event handle (0 for device/context syncs).
    pub handle: u64,
    pub kernel_launches: u64,
    pub graph_launches: u64,
    pub memcpy_bytes: u64,
}

/// A traced thread was off-CPU from `start` to `end`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffCpuEvent {
    pub pid: u32,
    pub tid: u32,
    pub start: MonoNs,
    pub end: MonoNs,
    /// The syscall it blocked in; None when preempted.
    pub syscall: Option<u32>,
    /// Task state at switch-out (0 = preempted while runnable).
    pub state: u32,
    /// A probed CUDA sync was in flight on the thread.
    pub in_cuda_sync: bool,
}

/// Bytes written to a socket were held unsent until an ACK released them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendHoldEvent {
    pub pid: u32,
    pub tid: u32,
    pub sock_ino: u64,
    /// Entry of the write whose bytes were held.
    pub write_ts: MonoNs,
    pub release_ts: MonoNs,
    pub held_bytes: u32,
}

/// A process started listening on a TCP port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenEvent {
    pub pid: u32,
    pub comm: String,
    pub ts: MonoNs,
    pub port: u16,
}

/// Everything the kernel side reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Data(DataEvent),
    Accept(ConnEvent),
    Close(ConnEvent),
    Exec(ProcEvent),
    Exit(ProcEvent),
    Fork(ProcEvent),
    Listen(ListenEvent),
    LibraryMapped(LibraryMapped),
    Usdt(UsdtEvent),
    CudaSync(CudaSyncEvent),
    OffCpu(OffCpuEvent),
    SendHold(SendHoldEvent),
    PeerClosed(PeerClosedEvent),
    TlsHandshake(TlsHandshakeEvent),
}

impl Event {
    /// The timestamp events are ordered by before stitching.
    pub fn order_ts(&self) -> MonoNs {
        match self {
            // Egress is ordered by entry (the emit time), ingress by exit (the
            // arrival time); both are what stitching uses as the event's time.
            Event::Data(d) => match d.direction {
                Direction::Ingress => d.ts_exit,
                Direction::Egress => d.ts_enter,
            },
            Event::Accept(c) | Event::Close(c) => c.ts,
            Event::Exec(p) | Event::Exit(p) | Event::Fork(p) => p.ts,
            Event::Listen(l) => l.ts,
            Event::LibraryMapped(m) => m.ts,
            Event::Usdt(u) => u.ts,
            Event::CudaSync(c) => c.ts_exit,
            Event::OffCpu(o) => o.end,
            Event::SendHold(h) => h.release_ts,
            Event::PeerClosed(p) => p.ts,
            Event::TlsHandshake(h) => h.ts,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ProcessName;

    #[test]
    fn process_names_are_cut_at_a_character_boundary() {
        // 14 ASCII bytes, then a 2-byte character that does not fit.
        let name = ProcessName::new("abcdefghijklmné");
        assert_eq!(name.as_str(), "abcdefghijklmn");
        assert_eq!(ProcessName::from("x".repeat(40)).len(), ProcessName::MAX);
    }
}
