//! The soak's steady load: streaming chat completions (SSE) against the test
//! server at a fixed rate, each on its own connection, each carrying a
//! `traceparent` whose trace id names the request, so its span can be found
//! at the collector, and `?rid=soak-N` in the path, so the agent's JSON line
//! names it too.
//!
//! Requests start on a fixed schedule (request k at k × 60 / rate seconds),
//! not after the previous one ends: a slow server does not slow the load,
//! it piles up connections, as real clients do.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// One request as the client saw it (seconds since the soak's start).
#[derive(Clone, Debug)]
pub struct Sent {
    pub rid: u64,
    pub sent: f64,
    pub done: f64,
    /// 200 and the stream ended with `data: [DONE]`.
    pub ok: bool,
}

#[derive(Clone, Copy)]
pub struct Spec {
    pub port: u16,
    pub per_minute: u32,
    pub tokens: u32,
    pub token_delay_ms: u32,
    pub ttft_ms: u32,
    /// Upper half of every trace id: unique per soak run.
    pub salt: u64,
}

/// The trace id of request `rid` (lowercase hex, as collectors print it).
pub fn trace_id(salt: u64, rid: u64) -> String {
    format!("{salt:016x}{rid:016x}")
}

/// Requests in flight at once, at most. The nominal load keeps about
/// rate × stream length in flight (2000/min × 0.7 s ≈ 23); the rest is
/// headroom for a stalled server.
const WORKERS: usize = 128;

pub struct Load {
    stop: Arc<AtomicBool>,
    dispatcher: JoinHandle<()>,
    workers: Vec<JoinHandle<()>>,
    sent: Arc<Mutex<Vec<Sent>>>,
}

impl Load {
    pub fn start(spec: Spec, t0: Instant) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::sync_channel::<u64>(4 * WORKERS);
        let rx = Arc::new(Mutex::new(rx));
        let workers = (0..WORKERS)
            .map(|_| {
                let rx = Arc::clone(&rx);
                let sent = Arc::clone(&sent);
                thread::spawn(move || loop {
                    let next = rx.lock().ok().and_then(|r| r.recv().ok());
                    let Some(rid) = next else { break };
                    let start = t0.elapsed().as_secs_f64();
                    let ok = request(&spec, rid).unwrap_or(false);
                    let done = t0.elapsed().as_secs_f64();
                    if let Ok(mut v) = sent.lock() {
                        v.push(Sent {
                            rid,
                            sent: start,
                            done,
                            ok,
                        });
                    }
                })
            })
            .collect();
        let dispatcher = {
            let stop = Arc::clone(&stop);
            thread::spawn(move || {
                let interval = 60.0 / f64::from(spec.per_minute.max(1));
                let begin = Instant::now();
                for rid in 0u64.. {
                    let due = Duration::from_secs_f64(rid as f64 * interval);
                    if let Some(wait) = due.checked_sub(begin.elapsed()) {
                        thread::sleep(wait);
                    }
                    if stop.load(Ordering::Relaxed) || tx.send(rid).is_err() {
                        break;
                    }
                }
            })
        };
        Load {
            stop,
            dispatcher,
            workers,
            sent,
        }
    }

    /// Stops scheduling, lets the requests in flight finish, and returns
    /// every request sent, in order of their start.
    pub fn stop(self) -> Vec<Sent> {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.dispatcher.join();
        for w in self.workers {
            let _ = w.join();
        }
        let mut sent = self.sent.lock().map(|v| v.clone()).unwrap_or_default();
        sent.sort_by(|a, b| a.sent.total_cmp(&b.sent));
        sent
    }
}

/// One streaming request on a new connection (`Connection: close`): the
/// response is read to EOF. Ok when it is a 200 that ends with [DONE].
fn request(spec: &Spec, rid: u64) -> std::io::Result<bool> {
    let addr = SocketAddr::from(([127, 0, 0, 1], spec.port));
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let body = format!(
        "{{\"model\":\"soak\",\"stream\":true,\"max_tokens\":{},\"token_delay_ms\":{},\"ttft_ms\":{},\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}]}}",
        spec.tokens, spec.token_delay_ms, spec.ttft_ms
    );
    let head = format!(
        "POST /v1/chat/completions?rid=soak-{rid} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         traceparent: 00-{}-{:016x}-01\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        trace_id(spec.salt, rid),
        rid + 1,
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body.as_bytes())?;
    let mut response = Vec::new();
    s.read_to_end(&mut response)?;
    let text = String::from_utf8_lossy(&response);
    Ok(text.starts_with("HTTP/1.1 200") && text.contains("data: [DONE]"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_ids_are_32_hex_digits_and_name_the_request() {
        let id = trace_id(0xabc, 7);
        assert_eq!(id.len(), 32);
        assert_eq!(id, "0000000000000abc0000000000000007");
        assert_ne!(trace_id(0xabc, 7), trace_id(0xabd, 7));
    }
}
