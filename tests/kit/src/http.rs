//! A plain HTTP GET on loopback, for health checks and metric scrapes of
//! the servers, vLLM and the agent.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// `GET path` on 127.0.0.1:`port`: (status, body); None when nothing
/// answers within `timeout` or the answer is not HTTP. HTTP/1.0, so the
/// body comes plain (never chunked) and the server closes.
pub fn get(port: u16, path: &str, timeout: Duration) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(timeout)).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    let status = raw.split_whitespace().nth(1)?.parse().ok()?;
    let body = raw.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((status, body))
}
