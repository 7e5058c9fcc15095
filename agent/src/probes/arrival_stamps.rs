//! Receive stamps for dating incoming segments (`segment_arrival` in
//! `sock_state.bpf.h`).
//!
//! `tcp_probe` runs when TCP processes a segment. A segment that arrives
//! while the socket's owner is inside a send or a read on it waits in the
//! socket's backlog until that call releases the socket: under CPU load a
//! millisecond and more after it reached the host, and a TLS handshake's
//! Finished or an upstream response's first chunk was dated that late. The
//! kernel stamps each packet as it enters the receive path (`skb->tstamp`,
//! CLOCK_REALTIME, what a packet capture shows) only while some socket on
//! the host asks for receive timestamps; the agent keeps one that does, and
//! gives the probes the CLOCK_REALTIME − CLOCK_MONOTONIC offset to turn a
//! stamp into their clock. Host-wide, the stamps cost one clock read per
//! received packet: any running `tcpdump` pays the same.

use std::os::fd::{FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use libbpf_rs::{MapCore, MapFlags, MapHandle};

use crate::units::WallClock;

/// How often the offset is measured again: it moves only when the wall
/// clock is stepped, and the probes refuse a stamp it would place in the
/// future or more than 2 s back, so a step costs at most this long of
/// stamps dated off by the step (or by processing time).
const REMEASURE_EVERY: Duration = Duration::from_secs(1);

/// The socket that keeps the kernel stamping, and the probes' offset.
pub struct ArrivalStamps {
    /// A UDP socket with SO_TIMESTAMPNS set: while it is open the kernel
    /// stamps every packet entering the receive path. Never bound or read.
    _stamping: OwnedFd,
    /// The one-entry `.data.wall` map holding `wall_minus_mono_ns`.
    offset: MapHandle,
    next_measure: Instant,
}

impl ArrivalStamps {
    /// Opens the stamping socket and writes the offset once.
    pub(super) fn start(offset: MapHandle) -> Result<Self> {
        let stamping = stamping_socket()?;
        let mut stamps = Self {
            _stamping: stamping,
            offset,
            next_measure: Instant::now(),
        };
        stamps.write_offset()?;
        Ok(stamps)
    }

    /// Measures and writes the offset again when it is due. Called on every
    /// pass of the ingest loop: all but one a second cost a clock read.
    pub fn refresh(&mut self) {
        if Instant::now() < self.next_measure {
            return;
        }
        if let Err(err) = self.write_offset() {
            tracing::warn!("receive stamps: {err:#}");
        }
    }

    fn write_offset(&mut self) -> Result<()> {
        let clock = WallClock::measure();
        let offset = i64::try_from(clock.offset_ns())
            .context("the wall clock offset does not fit 64 bits")?;
        self.next_measure = Instant::now() + REMEASURE_EVERY;
        self.offset
            .update(&0u32.to_ne_bytes(), &offset.to_ne_bytes(), MapFlags::ANY)
            .context("writing the wall clock offset into the probes")
    }
}

/// A UDP socket asking for nanosecond receive timestamps: the kernel turns
/// receive stamping on for the whole host (`net_enable_timestamp`) for as
/// long as such a socket exists. No privilege is needed.
fn stamping_socket() -> Result<OwnedFd> {
    // SAFETY: plain socket(2); the result is checked before it is owned.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("opening the stamping socket");
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    let on: libc::c_int = 1;
    // SAFETY: `on` outlives the call and its size is passed.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_TIMESTAMPNS,
            std::ptr::from_ref(&on).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error()).context("asking for receive timestamps");
    }
    Ok(socket)
}
