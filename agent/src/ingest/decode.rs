//! Raw ring buffer records → owned [`Event`]s.
//!
//! Record layouts come from the types libbpf-cargo generated from
//! `events.h`; nothing here restates them.

use bytes::BytesMut;
use thiserror::Error;
use tokentrace_probes::infer::types::{
    tt_cuda_sync, tt_cuda_sync_event, tt_llm_probe, tt_offcpu_event, tt_usdt_event,
};
use tokentrace_probes::sock::types::{
    tt_conn_event, tt_data_event, tt_direction, tt_event_header, tt_event_kind, tt_io_call,
    tt_listen_event, tt_nagle_event, tt_peer_close, tt_proc_event, tt_sock_addrs,
};

use crate::event::{
    ConnEvent, ConnId, CudaSyncCall, CudaSyncEvent, DataEvent, Direction, Event, IngressMark,
    IoCall, LibraryMapped, ListenEvent, LlmProbe, OffCpuEvent, PeerClose, PeerClosedEvent,
    ProcEvent, ProcessName, SendHoldEvent, SockAddrs, TcpSendState, TlsHandshakeEvent, UsdtEvent,
};

/// Why a record could not be decoded. Each one is counted, never fatal.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("record of {len} bytes is shorter than the {need}-byte {what}")]
    Short {
        what: &'static str,
        len: usize,
        need: usize,
    },
    #[error("unknown record kind {0}")]
    UnknownKind(u32),
    #[error("unknown {what} value {value}")]
    UnknownValue { what: &'static str, value: u32 },
    #[error("data record claims {claimed} payload bytes but carries {present}")]
    PayloadMismatch { claimed: u32, present: usize },
    #[error("data record's gathered payload is broken: {0}")]
    Gather(String),
}

fn read<T: plain::Plain + Default + Copy>(
    bytes: &[u8],
    what: &'static str,
) -> Result<T, DecodeError> {
    let mut value = T::default();
    plain::copy_from_bytes(&mut value, bytes).map_err(|_| DecodeError::Short {
        what,
        len: bytes.len(),
        need: std::mem::size_of::<T>(),
    })?;
    Ok(value)
}

/// A kernel string up to its NUL (all of `raw` without one).
fn until_nul(raw: &[i8]) -> &[i8] {
    &raw[..raw.iter().position(|&c| c == 0).unwrap_or(raw.len())]
}

/// A NUL-terminated kernel string; one allocation when it is valid UTF-8
/// (the usual case), lossy otherwise.
fn comm(raw: &[i8]) -> String {
    // A slice map: allocated once at its exact size.
    let bytes: Vec<u8> = until_nul(raw).iter().map(|&c| c as u8).collect();
    String::from_utf8(bytes)
        .unwrap_or_else(|invalid| String::from_utf8_lossy(invalid.as_bytes()).into_owned())
}

/// A data record's process name, without an allocation when it is valid
/// UTF-8 (the usual case; see [`ProcessName`]), lossy otherwise.
fn process_name(raw: &[i8; 16]) -> ProcessName {
    let name = until_nul(raw);
    let mut bytes = [0u8; 16];
    for (dst, &src) in bytes.iter_mut().zip(name) {
        *dst = src as u8;
    }
    match std::str::from_utf8(&bytes[..name.len()]) {
        Ok(valid) => ProcessName::new(valid),
        Err(_) => ProcessName::new(&comm(raw)),
    }
}

fn addrs(raw: &tt_sock_addrs) -> Option<SockAddrs> {
    SockAddrs::from_raw(
        raw.family,
        raw.local_port,
        raw.remote_port,
        raw.local_addr,
        raw.remote_addr,
    )
}

/// Kernel timestamps use 0 for "not known".
fn nonzero(ts: u64) -> Option<u64> {
    (ts != 0).then_some(ts)
}

fn direction(raw: u8) -> Result<Direction, DecodeError> {
    match tt_direction(u32::from(raw)) {
        tt_direction::TT_DIR_INGRESS => Ok(Direction::Ingress),
        tt_direction::TT_DIR_EGRESS => Ok(Direction::Egress),
        other => Err(DecodeError::UnknownValue {
            what: "direction",
            value: other.0,
        }),
    }
}

fn io_call(raw: u8) -> Result<IoCall, DecodeError> {
    Ok(match tt_io_call(u32::from(raw)) {
        tt_io_call::TT_IO_READ => IoCall::Read,
        tt_io_call::TT_IO_READV => IoCall::Readv,
        tt_io_call::TT_IO_RECVFROM => IoCall::Recvfrom,
        tt_io_call::TT_IO_RECVMSG => IoCall::Recvmsg,
        tt_io_call::TT_IO_WRITE => IoCall::Write,
        tt_io_call::TT_IO_WRITEV => IoCall::Writev,
        tt_io_call::TT_IO_SENDTO => IoCall::Sendto,
        tt_io_call::TT_IO_SENDMSG => IoCall::Sendmsg,
        tt_io_call::TT_IO_SENDFILE => IoCall::Sendfile,
        tt_io_call::TT_IO_SSL_READ | tt_io_call::TT_IO_SSL_READ_EX => IoCall::SslRead,
        tt_io_call::TT_IO_SSL_WRITE | tt_io_call::TT_IO_SSL_WRITE_EX => IoCall::SslWrite,
        other => {
            return Err(DecodeError::UnknownValue {
                what: "syscall",
                value: other.0,
            })
        }
    })
}

/// Decodes one ring buffer record (a data record's payload in a buffer of
/// its own).
pub fn decode(record: &[u8]) -> Result<Event, DecodeError> {
    decode_into(record, &mut BytesMut::new())
}

/// Decodes one ring buffer record; a data record's payload is written at
/// the end of `payloads` and split off it, so the records of a batch share
/// its allocation.
pub fn decode_into(record: &[u8], payloads: &mut BytesMut) -> Result<Event, DecodeError> {
    let hdr: tt_event_header = read(record, "event header")?;
    match tt_event_kind(hdr.kind) {
        tt_event_kind::TT_EVENT_DATA => decode_data(record, payloads),
        kind @ (tt_event_kind::TT_EVENT_ACCEPT | tt_event_kind::TT_EVENT_CLOSE) => {
            let raw: tt_conn_event = read(record, "connection record")?;
            let event = ConnEvent {
                conn: ConnId {
                    pid: raw.hdr.tgid,
                    fd: raw.fd,
                    sock_ino: raw.sock_ino,
                },
                tid: raw.hdr.tid,
                comm: comm(&raw.hdr.comm),
                ts: raw.hdr.ts_ns,
                addrs: addrs(&raw.addrs),
                established: nonzero(raw.start_ns),
            };
            Ok(if kind == tt_event_kind::TT_EVENT_ACCEPT {
                Event::Accept(event)
            } else {
                Event::Close(event)
            })
        }
        kind @ (tt_event_kind::TT_EVENT_EXEC
        | tt_event_kind::TT_EVENT_EXIT
        | tt_event_kind::TT_EVENT_FORK) => {
            let raw: tt_proc_event = read(record, "process record")?;
            let event = ProcEvent {
                pid: raw.hdr.tgid,
                ppid: raw.ppid,
                comm: comm(&raw.hdr.comm),
                ts: raw.hdr.ts_ns,
                filename: comm(&raw.filename),
                exit_code: raw.exit_code,
            };
            Ok(match kind {
                tt_event_kind::TT_EVENT_EXEC => Event::Exec(event),
                tt_event_kind::TT_EVENT_FORK => Event::Fork(event),
                _ => Event::Exit(event),
            })
        }
        tt_event_kind::TT_EVENT_LIB_MAPPED => {
            let raw: tt_proc_event = read(record, "process record")?;
            Ok(Event::LibraryMapped(LibraryMapped {
                pid: raw.hdr.tgid,
                ts: raw.hdr.ts_ns,
            }))
        }
        tt_event_kind::TT_EVENT_PEER_CLOSED => {
            let raw: tt_conn_event = read(record, "peer-close record")?;
            let reason = match tt_peer_close(raw.reason) {
                tt_peer_close::TT_PEER_FIN => PeerClose::Fin,
                tt_peer_close::TT_PEER_RST => PeerClose::Rst,
                tt_peer_close::TT_PEER_WRITE_EPIPE => PeerClose::WriteEpipe,
                tt_peer_close::TT_PEER_WRITE_ECONNRESET => PeerClose::WriteEconnreset,
                other => {
                    return Err(DecodeError::UnknownValue {
                        what: "peer close reason",
                        value: other.0,
                    })
                }
            };
            Ok(Event::PeerClosed(PeerClosedEvent {
                conn: ConnId {
                    pid: raw.hdr.tgid,
                    fd: raw.fd,
                    sock_ino: raw.sock_ino,
                },
                ts: raw.hdr.ts_ns,
                reason,
                addrs: addrs(&raw.addrs),
            }))
        }
        tt_event_kind::TT_EVENT_TLS_HANDSHAKE => {
            let raw: tt_conn_event = read(record, "TLS handshake record")?;
            Ok(Event::TlsHandshake(TlsHandshakeEvent {
                conn: ConnId {
                    pid: raw.hdr.tgid,
                    fd: ConnId::TLS_FD,
                    sock_ino: raw.sock_ino,
                },
                socket_fd: (raw.fd >= 0).then_some(raw.fd),
                ts: raw.hdr.ts_ns,
                first_byte: nonzero(raw.start_ns),
                addrs: addrs(&raw.addrs),
            }))
        }
        tt_event_kind::TT_EVENT_USDT => decode_usdt(record),
        tt_event_kind::TT_EVENT_CUDA_SYNC => decode_cuda_sync(record),
        tt_event_kind::TT_EVENT_OFFCPU => {
            let raw: tt_offcpu_event = read(record, "off-CPU record")?;
            Ok(Event::OffCpu(OffCpuEvent {
                pid: raw.hdr.tgid,
                tid: raw.hdr.tid,
                start: raw.start_ns,
                end: raw.hdr.ts_ns,
                syscall: u32::try_from(raw.syscall).ok(),
                state: raw.state,
                in_cuda_sync: raw.in_cuda_sync != 0,
            }))
        }
        tt_event_kind::TT_EVENT_NAGLE => {
            let raw: tt_nagle_event = read(record, "send-hold record")?;
            Ok(Event::SendHold(SendHoldEvent {
                pid: raw.hdr.tgid,
                tid: raw.hdr.tid,
                sock_ino: raw.sock_ino,
                write_ts: raw.write_ts_ns,
                release_ts: raw.hdr.ts_ns,
                held_bytes: raw.held_bytes,
            }))
        }
        tt_event_kind::TT_EVENT_LISTEN => {
            let raw: tt_listen_event = read(record, "listen record")?;
            Ok(Event::Listen(ListenEvent {
                pid: raw.hdr.tgid,
                comm: comm(&raw.hdr.comm),
                ts: raw.hdr.ts_ns,
                port: raw.port,
            }))
        }
        other => Err(DecodeError::UnknownKind(other.0)),
    }
}

fn decode_usdt(record: &[u8]) -> Result<Event, DecodeError> {
    let raw: tt_usdt_event = read(record, "USDT record")?;
    let probe = match tt_llm_probe(raw.probe) {
        tt_llm_probe::TT_LLM_REQUEST_START => LlmProbe::RequestStart,
        tt_llm_probe::TT_LLM_REQUEST_QUEUED => LlmProbe::RequestQueued,
        tt_llm_probe::TT_LLM_REQUEST_SCHEDULED => LlmProbe::RequestScheduled,
        tt_llm_probe::TT_LLM_PREFILL_START => LlmProbe::PrefillStart,
        tt_llm_probe::TT_LLM_PREFILL_END => LlmProbe::PrefillEnd,
        tt_llm_probe::TT_LLM_TOKEN => LlmProbe::Token,
        tt_llm_probe::TT_LLM_REQUEST_END => LlmProbe::RequestEnd,
        tt_llm_probe::TT_LLM_BATCH_STEP => LlmProbe::BatchStep,
        tt_llm_probe::TT_LLM_REQUEST_PREEMPTED => LlmProbe::RequestPreempted,
        other => {
            return Err(DecodeError::UnknownValue {
                what: "llm probe",
                value: other.0,
            })
        }
    };
    Ok(Event::Usdt(UsdtEvent {
        pid: raw.hdr.tgid,
        tid: raw.hdr.tid,
        ts: raw.hdr.ts_ns,
        probe,
        request_id: comm(&raw.request_id),
        args: raw.args,
    }))
}

fn decode_cuda_sync(record: &[u8]) -> Result<Event, DecodeError> {
    let raw: tt_cuda_sync_event = read(record, "CUDA sync record")?;
    let call = match tt_cuda_sync(raw.call) {
        tt_cuda_sync::TT_CUDA_STREAM_SYNCHRONIZE => CudaSyncCall::StreamSynchronize,
        tt_cuda_sync::TT_CUDA_DEVICE_SYNCHRONIZE => CudaSyncCall::DeviceSynchronize,
        tt_cuda_sync::TT_CUDA_EVENT_SYNCHRONIZE => CudaSyncCall::EventSynchronize,
        tt_cuda_sync::TT_CU_STREAM_SYNCHRONIZE => CudaSyncCall::CuStreamSynchronize,
        tt_cuda_sync::TT_CU_CTX_SYNCHRONIZE => CudaSyncCall::CuCtxSynchronize,
        other => {
            return Err(DecodeError::UnknownValue {
                what: "CUDA sync call",
                value: other.0,
            })
        }
    };
    Ok(Event::CudaSync(CudaSyncEvent {
        pid: raw.hdr.tgid,
        tid: raw.hdr.tid,
        ts_enter: raw.ts_enter_ns,
        ts_exit: raw.hdr.ts_ns,
        call,
        handle: raw.handle,
        kernel_launches: raw.kernel_launches,
        graph_launches: raw.graph_launches,
        memcpy_bytes: raw.memcpy_bytes,
    }))
}

/// The record's arrival marks that date something (a count past the array,
/// which the probes never write, is clamped).
fn marks(raw: &tt_data_event) -> Vec<IngressMark> {
    let n = (raw.nmarks as usize).min(raw.marks.len());
    let mut marks: Vec<IngressMark> = raw.marks[..n]
        .iter()
        .filter(|m| m.ts != 0 && m.len != 0)
        .map(|m| IngressMark {
            offset: m.offset,
            len: m.len,
            ts: m.ts,
        })
        .collect();
    marks.sort_by_key(|m| m.offset);
    marks
}

fn decode_data(record: &[u8], payloads: &mut BytesMut) -> Result<Event, DecodeError> {
    // Read in place: ring buffer records are 8-byte aligned, and copying
    // the ~300-byte header out first (its 8 arrival marks are mostly
    // unused) was a copy per record for nothing. A misaligned or short
    // slice (never from the ring) is copied, or refused, as before.
    let copied: tt_data_event;
    let raw: &tt_data_event = match plain::from_bytes(record) {
        Ok(raw) => raw,
        Err(_) => {
            copied = read(record, "data record")?;
            &copied
        }
    };
    let room = &record[std::mem::size_of::<tt_data_event>()..];
    // The probes reserve room for the bytes they mean to copy; a copy that
    // faulted part way leaves the tail unwritten and `captured` says how
    // much is real. Fewer bytes than claimed is a broken record.
    if room.len() < raw.captured as usize || raw.captured > raw.len {
        return Err(DecodeError::PayloadMismatch {
            claimed: raw.captured,
            present: room.len(),
        });
    }
    let payload = super::gather::payload(raw, &room[..raw.captured as usize], payloads)?;
    Ok(Event::Data(DataEvent {
        conn: ConnId {
            pid: raw.hdr.tgid,
            fd: raw.fd,
            sock_ino: raw.sock_ino,
        },
        tid: raw.hdr.tid,
        comm: process_name(&raw.hdr.comm),
        ts_enter: raw.ts_enter_ns,
        ts_exit: raw.hdr.ts_ns,
        ingress: nonzero(raw.ingress_ns),
        marks: marks(raw),
        direction: direction(raw.direction)?,
        call: io_call(raw.call)?,
        len: raw.len,
        payload,
        addrs: addrs(&raw.addrs),
        tcp: (raw.direction == tt_direction::TT_DIR_EGRESS.0 as u8 && raw.fd >= 0).then_some(
            TcpSendState {
                nodelay: raw.tcp_nodelay != 0,
                unsent_bytes: raw.unsent_bytes,
            },
        ),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel_comm(name: &[u8]) -> [i8; 16] {
        let mut raw = [0i8; 16];
        for (dst, &src) in raw.iter_mut().zip(name) {
            *dst = src as i8;
        }
        raw
    }

    #[test]
    fn process_names_stop_at_the_nul_and_keep_what_the_kernel_keeps() {
        assert_eq!(&*process_name(&kernel_comm(b"python3")), "python3");
        // A comm the kernel cut at 15 bytes, then its NUL.
        let long = process_name(&kernel_comm(b"vllm-engine-cor"));
        assert_eq!(long.as_str(), "vllm-engine-cor");
        assert_eq!(process_name(&[0; 16]).as_str(), "");
    }

    #[test]
    fn invalid_utf8_process_names_are_replaced_not_dropped() {
        let name = process_name(&kernel_comm(b"ab\xffcd"));
        assert_eq!(name.as_str(), "ab\u{fffd}cd");
    }

    fn as_bytes<T: plain::Plain>(value: &T) -> Vec<u8> {
        // SAFETY: `T: Plain` is a repr(C) plain-old-data type; viewing it as
        // bytes is sound.
        unsafe { plain::as_bytes(value) }.to_vec()
    }

    fn data_record(payload: &[u8], len: u32) -> Vec<u8> {
        let mut raw = tt_data_event::default();
        raw.hdr.kind = tt_event_kind::TT_EVENT_DATA.0;
        raw.hdr.tgid = 42;
        raw.hdr.tid = 43;
        raw.hdr.ts_ns = 2_000;
        raw.hdr.comm[..7]
            .copy_from_slice(&[b'p', b'y', b't', b'h', b'o', b'n', b'3'].map(|b| b as i8));
        raw.ts_enter_ns = 1_000;
        raw.sock_ino = 777;
        raw.fd = 9;
        raw.len = len;
        raw.captured = payload.len() as u32;
        raw.direction = tt_direction::TT_DIR_EGRESS.0 as u8;
        raw.call = tt_io_call::TT_IO_WRITEV.0 as u8;
        raw.addrs.family = 2;
        raw.addrs.local_port = 8000;
        raw.addrs.remote_port = 51000;
        raw.addrs.local_addr[..4].copy_from_slice(&[127, 0, 0, 1]);
        raw.addrs.remote_addr[..4].copy_from_slice(&[127, 0, 0, 2]);
        let mut bytes = as_bytes(&raw);
        bytes.extend_from_slice(payload);
        bytes
    }

    #[test]
    fn decodes_a_truncated_data_record() {
        let event = decode(&data_record(b"data: {}\n\n", 4096)).expect("valid record");
        let Event::Data(data) = event else {
            panic!("expected a data event, got {event:?}")
        };
        assert_eq!(
            data.conn,
            ConnId {
                pid: 42,
                fd: 9,
                sock_ino: 777
            }
        );
        assert_eq!(&*data.comm, "python3");
        assert_eq!((data.ts_enter, data.ts_exit), (1_000, 2_000));
        assert_eq!(data.direction, Direction::Egress);
        assert_eq!(data.call, IoCall::Writev);
        assert_eq!(&data.payload[..], b"data: {}\n\n");
        assert!(data.is_truncated());
        let addrs = data.addrs.expect("IPv4 addresses");
        assert_eq!(addrs.local.to_string(), "127.0.0.1:8000");
        assert_eq!(addrs.remote.to_string(), "127.0.0.2:51000");
    }

    #[test]
    fn a_batchs_payloads_are_slices_of_one_buffer() {
        let mut payloads = BytesMut::with_capacity(4096);
        let decoded = [&b"first"[..], b"second"].map(|payload| {
            match decode_into(&data_record(payload, payload.len() as u32), &mut payloads) {
                Ok(Event::Data(data)) => data.payload,
                other => panic!("not a data event: {other:?}"),
            }
        });
        assert_eq!(&decoded[0][..], b"first");
        assert_eq!(&decoded[1][..], b"second");
        // One allocation: the second payload starts where the first ends.
        assert_eq!(decoded[0].as_ptr_range().end, decoded[1].as_ptr());
    }

    /// Read in place when aligned (as the ring's records are), copied out
    /// when not: the same event either way.
    #[test]
    fn a_misaligned_data_record_decodes_the_same() {
        let record = data_record(b"data: {}\n\n", 10);
        let mut shifted = vec![0u8; record.len() + 8];
        let start = (1..8)
            .find(|&i| !(shifted[i..].as_ptr() as usize).is_multiple_of(8))
            .expect("a misaligned offset");
        shifted[start..start + record.len()].copy_from_slice(&record);
        let moved = &shifted[start..start + record.len()];
        assert_eq!(
            decode(moved).expect("misaligned"),
            decode(&record).expect("aligned")
        );
    }

    #[test]
    fn ingress_establishment_peer_close_and_handshake_records() {
        let mut raw = data_record(b"GET / HTTP/1.1\r\n\r\n", 18);
        let mut ev = tt_data_event::default();
        plain::copy_from_bytes(&mut ev, &raw).expect("header");
        ev.direction = tt_direction::TT_DIR_INGRESS.0 as u8;
        ev.call = tt_io_call::TT_IO_READ.0 as u8;
        ev.ingress_ns = 1_500;
        raw.splice(..std::mem::size_of::<tt_data_event>(), as_bytes(&ev));
        let Ok(Event::Data(d)) = decode(&raw) else {
            panic!("a data event")
        };
        assert_eq!((d.ingress, d.tcp), (Some(1_500), None));

        let conn = |kind: tt_event_kind, fd: i32, reason: u32, start_ns: u64| {
            let mut c = tt_conn_event::default();
            c.hdr.kind = kind.0;
            c.hdr.tgid = 42;
            c.hdr.ts_ns = 9_000;
            c.sock_ino = 0x77;
            c.fd = fd;
            c.reason = reason;
            c.start_ns = start_ns;
            as_bytes(&c)
        };
        let Ok(Event::Accept(a)) = decode(&conn(tt_event_kind::TT_EVENT_ACCEPT, 5, 0, 4_000))
        else {
            panic!("an accept")
        };
        assert_eq!(a.established, Some(4_000));
        let Ok(Event::Accept(a)) = decode(&conn(tt_event_kind::TT_EVENT_ACCEPT, 5, 0, 0)) else {
            panic!("an accept")
        };
        assert_eq!(a.established, None, "0 is unknown");
        let rst = tt_peer_close::TT_PEER_RST.0;
        let Ok(Event::PeerClosed(p)) =
            decode(&conn(tt_event_kind::TT_EVENT_PEER_CLOSED, 5, rst, 0))
        else {
            panic!("a peer close")
        };
        assert_eq!((p.conn.fd, p.reason, p.ts), (5, PeerClose::Rst, 9_000));
        assert_eq!(
            decode(&conn(tt_event_kind::TT_EVENT_PEER_CLOSED, 5, 99, 0)),
            Err(DecodeError::UnknownValue {
                what: "peer close reason",
                value: 99
            })
        );
        let hs = conn(tt_event_kind::TT_EVENT_TLS_HANDSHAKE, -1, 0, 7_000);
        let Ok(Event::TlsHandshake(h)) = decode(&hs) else {
            panic!("a handshake")
        };
        assert_eq!(
            (h.conn.fd, h.conn.sock_ino, h.socket_fd, h.first_byte),
            (ConnId::TLS_FD, 0x77, None, Some(7_000))
        );
    }

    #[test]
    fn rejects_short_and_inconsistent_records() {
        assert!(matches!(decode(&[1, 0, 0]), Err(DecodeError::Short { .. })));
        let mut record = data_record(b"abcdef", 6);
        record.truncate(record.len() - 2);
        assert_eq!(
            decode(&record),
            Err(DecodeError::PayloadMismatch {
                claimed: 6,
                present: 4
            })
        );
        // Room past `captured` (a copy that faulted part way) is not payload.
        let mut partial = data_record(b"abcdef", 6);
        let captured = std::mem::offset_of!(tt_data_event, captured);
        partial[captured..captured + 4].copy_from_slice(&4u32.to_ne_bytes());
        match decode(&partial) {
            Ok(Event::Data(data)) => assert_eq!(&data.payload[..], b"abcd"),
            other => panic!("a partly copied record decodes: {other:?}"),
        }
        let mut unknown = data_record(b"", 0);
        unknown[0] = 99;
        assert_eq!(decode(&unknown), Err(DecodeError::UnknownKind(99)));
    }
}
