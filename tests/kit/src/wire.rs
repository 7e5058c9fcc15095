//! Loopback packet capture for the root tests (tests/clients/wire_capture.py:
//! AF_PACKET on `lo`, kernel receive timestamps converted to CLOCK_MONOTONIC):
//! when bytes really crossed the device, a reference load cannot move.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use super::{mono_now_ns, python, repo_root, Proc};

/// tests/clients/wire_capture.py on `lo` for `port`.
pub struct Capture {
    proc: Proc,
    out: PathBuf,
}

/// One captured TCP payload packet.
#[derive(Debug, Clone)]
pub struct Packet {
    pub ts: u64,
    pub src: u16,
    pub dst: u16,
    /// Sequence number of its first payload byte, and the payload's length.
    pub seq: u32,
    pub len: u32,
    pub data_event: bool,
}

impl Capture {
    pub fn start(port: u16) -> Self {
        Self::start_with(port, false)
    }

    /// Also keeps every packet's payload (for tests/clients/tls_wire.py).
    pub fn start_with_payload(port: u16) -> Self {
        Self::start_with(port, true)
    }

    fn start_with(port: u16, payload: bool) -> Self {
        let out = std::env::temp_dir().join(format!(
            "tokentrace-wire-{}-{}.jsonl",
            std::process::id(),
            mono_now_ns()
        ));
        let mut child = Command::new(python())
            .arg("-u")
            .arg(repo_root().join("tests/clients/wire_capture.py"))
            .args(["--port", &port.to_string(), "--out"])
            .arg(&out)
            .args(payload.then_some("--payload"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start wire_capture.py: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let mut first = String::new();
        BufReader::new(stdout)
            .read_line(&mut first)
            .expect("read wire_capture.py READY");
        assert_eq!(first.trim(), "READY", "wire_capture.py did not start");
        Capture {
            proc: Proc::guard("wire_capture.py", child),
            out,
        }
    }

    /// Stops the capture; the file it wrote (the caller removes it).
    pub fn finish_file(mut self) -> PathBuf {
        self.proc.signal(libc::SIGTERM);
        let st = self.proc.wait_timeout(Duration::from_secs(20));
        assert!(st.is_some(), "wire_capture.py did not exit on SIGTERM");
        self.out
    }

    /// Stops the capture; its packets, in time order.
    pub fn finish(self) -> Vec<Packet> {
        let out = self.finish_file();
        let text = std::fs::read_to_string(&out).expect("capture output");
        let _ = std::fs::remove_file(&out);
        let mut packets: Vec<Packet> = text
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter_map(|v| {
                Some(Packet {
                    ts: v.get("ts")?.as_u64()?,
                    src: u16::try_from(v.get("src")?.as_u64()?).ok()?,
                    dst: u16::try_from(v.get("dst")?.as_u64()?).ok()?,
                    seq: u32::try_from(v.get("seq")?.as_u64()?).ok()?,
                    len: u32::try_from(v.get("len")?.as_u64()?).ok()?,
                    data_event: v.get("data_event")?.as_bool()?,
                })
            })
            .collect();
        packets.sort_by_key(|p| p.ts);
        packets
    }
}

/// When, on the wire, a connection's request arrived and its first SSE
/// event left: the first client→server payload packet, and the first
/// server→client packet carrying `data: `.
pub fn wire_times(packets: &[Packet], server: u16, client: u16) -> (Option<u64>, Option<u64>) {
    let request = packets
        .iter()
        .find(|p| p.src == client && p.dst == server)
        .map(|p| p.ts);
    let event = packets
        .iter()
        .find(|p| p.src == server && p.dst == client && p.data_event)
        .map(|p| p.ts);
    (request, event)
}
