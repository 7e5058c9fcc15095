//! Generated traffic of an OpenAI-compatible streaming server, as the ring
//! buffer records the probes would write for it: what the replay benchmark
//! pushes through `run::RecordReplay`.
//!
//! The shape follows a vLLM deployment behind uvicorn: a frontend process
//! whose one event-loop thread reads requests and writes responses on many
//! keep-alive connections, and an engine process that runs batched steps.
//! Each step the engine waits in a CUDA sync (and sleeps off-CPU inside
//! it), fires `llm:batch_step` and one `llm:token` per running request; the
//! frontend then wakes from `epoll_wait` and writes every request's token
//! as an OpenAI `chat.completion.chunk` SSE event (with `"usage":null`, as
//! `stream_options.include_usage` makes every chunk carry), chunked-encoded
//! in three writes (size line, event, CRLF). A stream ends with the usage
//! chunk, `data: [DONE]` and the terminating chunk; the client waits a
//! little and sends its next request on the same connection, reconnecting
//! after a few (a new socket on the same fd). Some steps are slow on the
//! GPU, and in some the frontend is preempted before it writes, so the
//! explainer has late chunks to break down.
//!
//! Deterministic for a given [`TrafficConfig`]; nothing here reads a clock.

use std::fmt::Write as _;

use tokentrace_probes::infer::types::{
    tt_cuda_sync, tt_cuda_sync_event, tt_llm_probe, tt_offcpu_event, tt_usdt_event,
};
use tokentrace_probes::sock::types::{
    tt_conn_event, tt_data_event, tt_direction, tt_event_kind, tt_io_call, tt_sock_addrs,
};

use crate::event::MonoNs;

/// Fills a record header: the sock and infer skeletons each generate their
/// own copy of `struct tt_event_header` (same layout, distinct types).
macro_rules! set_header {
    ($hdr:expr, $kind:expr, $pid:expr, $tid:expr, $ts:expr, $comm:expr) => {{
        let hdr = &mut $hdr;
        hdr.kind = $kind.0;
        hdr.tgid = $pid;
        hdr.tid = $tid;
        hdr.ts_ns = $ts;
        for (dst, &src) in hdr.comm.iter_mut().zip($comm.as_bytes()) {
            *dst = src as i8;
        }
    }};
}

/// The frontend (HTTP server) process; its event loop is its main thread.
pub const FRONTEND_PID: u32 = 4100;
/// The engine process (scheduler and GPU worker on one thread).
pub const ENGINE_PID: u32 = 4200;
const SERVER_PORT: u16 = 8000;
/// Simulated time starts here (a host up for a while).
const START_NS: MonoNs = 1_000_000_000_000;
const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
/// x86_64 syscall numbers the off-CPU records name.
const SYS_FUTEX: i64 = 202;
const SYS_EPOLL_WAIT: i64 = 232;

/// What to generate.
#[derive(Debug, Clone)]
pub struct TrafficConfig {
    /// Concurrent keep-alive client connections (each has at most one
    /// request in flight).
    pub connections: u32,
    /// Completion tokens per request, uniformly in this range.
    pub min_tokens: u32,
    pub max_tokens: u32,
    /// Duration of a normal engine step (one token per running request).
    pub step_ns: u64,
    /// Every this many steps one is slow (alternately on the GPU and in
    /// the frontend); 0: never.
    pub stall_every: u64,
    /// Requests a client sends on one connection before reconnecting.
    pub requests_per_connection: u32,
    pub seed: u64,
}

impl Default for TrafficConfig {
    fn default() -> Self {
        Self {
            connections: 256,
            min_tokens: 32,
            max_tokens: 256,
            step_ns: 20_000_000,
            stall_every: 50,
            requests_per_connection: 8,
            seed: 1,
        }
    }
}

/// Records one after the other in one buffer.
#[derive(Debug, Default)]
pub struct Records {
    bytes: Vec<u8>,
    ends: Vec<usize>,
}

impl Records {
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    pub fn clear(&mut self) {
        self.bytes.clear();
        self.ends.clear();
    }

    pub fn iter(&self) -> impl Iterator<Item = &[u8]> {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts
            .zip(self.ends.iter().copied())
            .map(|(start, end)| &self.bytes[start..end])
    }

    fn push(&mut self, record: &[u8]) {
        self.bytes.extend_from_slice(record);
        self.ends.push(self.bytes.len());
    }
}

/// splitmix64: small, fast and good enough for traffic shapes.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi.saturating_sub(lo) + 1)
    }
}

#[derive(Debug)]
struct Stream {
    id: String,
    tokens: u32,
    sent: u32,
    prompt_tokens: u32,
    created: u64,
}

#[derive(Debug)]
enum ClientState {
    /// Thinking until the time given; then it sends its next request.
    Idle(MonoNs),
    Streaming(Stream),
}

#[derive(Debug)]
struct Client {
    fd: i32,
    sock_ino: u64,
    /// `None` until the first connect.
    port: Option<u16>,
    served: u32,
    state: ClientState,
}

/// A record waiting to be ordered within its step.
struct Pending {
    order_ts: MonoNs,
    bytes: Vec<u8>,
}

/// The traffic generator: [`Traffic::step`] appends one engine step's
/// records, in the order the agent would receive them.
pub struct Traffic {
    config: TrafficConfig,
    rng: Rng,
    clients: Vec<Client>,
    now: MonoNs,
    step: u64,
    next_ino: u64,
    next_port: u16,
    next_request: u64,
    /// When the frontend thread last went to sleep (after its writes).
    frontend_idle_since: MonoNs,
    pending: Vec<Pending>,
}

impl Traffic {
    pub fn new(config: TrafficConfig) -> Self {
        let mut rng = Rng(config.seed);
        let start = START_NS;
        let clients = (0..config.connections)
            .map(|i| Client {
                fd: 20 + i as i32,
                sock_ino: 0,
                port: None,
                served: 0,
                // Clients arrive spread over the first second.
                state: ClientState::Idle(start + rng.between(0, 1_000_000_000)),
            })
            .collect();
        Self {
            config,
            rng,
            clients,
            now: start,
            step: 0,
            next_ino: 900_000,
            next_port: 40_000,
            next_request: 0,
            frontend_idle_since: start,
            pending: Vec::new(),
        }
    }

    /// The simulated time: the end of the last generated step.
    pub fn now(&self) -> MonoNs {
        self.now
    }

    /// Simulated time generated so far.
    pub fn elapsed_ns(&self) -> u64 {
        self.now - START_NS
    }

    /// Generates the next engine step and appends its records to `out`.
    pub fn step(&mut self, out: &mut Records) {
        let t = self.now;
        let step_ns = self.config.step_ns.max(10_000_000);
        let every = self.config.stall_every;
        let slow = every > 0 && self.step > 0 && self.step.is_multiple_of(every);
        // Alternately the GPU and the frontend.
        let gpu_slow = slow && !(self.step / every).is_multiple_of(2);
        let frontend_slow = slow && !gpu_slow;
        let engine_ns = if gpu_slow { step_ns * 4 } else { step_ns };
        // The engine's tokens are ready 5 ms before the step ends; a
        // preempted frontend writes them 50 ms late.
        let tokens_ready = t + engine_ns - 5_000_000;
        let frontend_delay = if frontend_slow { 50_000_000 } else { 0 };
        let writes_start = tokens_ready + 500_000 + frontend_delay;

        let busy_until = self.arrivals(t, tokens_ready);
        self.engine(t, engine_ns, tokens_ready);
        // The frontend slept in epoll_wait since its last reads or writes;
        // when preempted, it was runnable but off-CPU for the delay.
        let wake = tokens_ready + 200_000;
        let since = self.frontend_idle_since.max(busy_until);
        if wake > since + 1_000_000 {
            self.off_cpu(
                FRONTEND_PID,
                FRONTEND_PID,
                since,
                wake,
                SYS_EPOLL_WAIT,
                1,
                false,
            );
        }
        if frontend_slow {
            self.off_cpu(FRONTEND_PID, FRONTEND_PID, wake, writes_start, -1, 0, false);
        }
        let end = self.frontend_writes(writes_start);
        self.frontend_idle_since = end;

        self.now = (t + engine_ns).max(end + 100_000);
        self.step += 1;
        self.pending.sort_by_key(|p| p.order_ts);
        for p in self.pending.drain(..) {
            out.push(&p.bytes);
        }
    }

    /// Clients whose think time is over send their request (connecting
    /// first when needed) early in the step; each is queued, scheduled and
    /// prefilled by the engine within the step. Returns when the frontend
    /// was done with them (`t` when nobody came).
    fn arrivals(&mut self, t: MonoNs, tokens_ready: MonoNs) -> MonoNs {
        let mut at = t + 100_000;
        let mut busy_until = t;
        for i in 0..self.clients.len() {
            let ClientState::Idle(until) = self.clients[i].state else {
                continue;
            };
            if until > t {
                continue;
            }
            if self.clients[i].port.is_none()
                || self.clients[i].served >= self.config.requests_per_connection
            {
                self.reconnect(i, at);
                at += 20_000;
            }
            let id = format!("chatcmpl-{:032x}", self.next_request);
            self.next_request += 1;
            let tokens = self.rng.between(
                u64::from(self.config.min_tokens),
                u64::from(self.config.max_tokens.max(self.config.min_tokens)),
            ) as u32;
            let prompt_tokens = self.rng.between(20, 400) as u32;
            let request = self.request(tokens);
            let client = &self.clients[i];
            let conn = (client.fd, client.sock_ino, client.port.unwrap_or(0));
            self.data(conn, at, at + 8_000, tt_direction::TT_DIR_INGRESS, &request);
            let (q, s) = (at + 60_000, at + 200_000);
            self.usdt(
                ENGINE_PID,
                at + 40_000,
                tt_llm_probe::TT_LLM_REQUEST_START,
                &id,
                0,
            );
            self.usdt(ENGINE_PID, q, tt_llm_probe::TT_LLM_REQUEST_QUEUED, &id, 0);
            self.usdt(
                ENGINE_PID,
                s,
                tt_llm_probe::TT_LLM_REQUEST_SCHEDULED,
                &id,
                0,
            );
            self.usdt(
                ENGINE_PID,
                s + 10_000,
                tt_llm_probe::TT_LLM_PREFILL_START,
                &id,
                0,
            );
            let prefill_end = tokens_ready - 400_000;
            self.usdt(
                ENGINE_PID,
                prefill_end,
                tt_llm_probe::TT_LLM_PREFILL_END,
                &id,
                0,
            );
            // uvicorn sends the head as soon as the app starts streaming.
            self.data(
                conn,
                at + 300_000,
                at + 310_000,
                tt_direction::TT_DIR_EGRESS,
                RESPONSE_HEAD.as_bytes(),
            );
            let client = &mut self.clients[i];
            client.served += 1;
            client.state = ClientState::Streaming(Stream {
                id,
                tokens,
                sent: 0,
                prompt_tokens,
                created: 1_764_583_200 + t / 1_000_000_000,
            });
            busy_until = at + 310_000;
            at += 400_000 / u64::from(self.config.connections.max(1)) + 5_000;
        }
        busy_until
    }

    /// A new socket for client `i` (closing its previous one on the same fd).
    fn reconnect(&mut self, i: usize, at: MonoNs) {
        let client = &self.clients[i];
        if let Some(port) = client.port {
            let conn = (client.fd, client.sock_ino, port);
            self.conn_event(tt_event_kind::TT_EVENT_CLOSE, conn, at);
        }
        self.next_ino += 1;
        self.next_port = self.next_port.wrapping_add(1).max(40_000);
        let client = &mut self.clients[i];
        client.sock_ino = self.next_ino;
        client.port = Some(self.next_port);
        client.served = 0;
        let conn = (client.fd, client.sock_ino, self.next_port);
        self.conn_event(tt_event_kind::TT_EVENT_ACCEPT, conn, at + 5_000);
    }

    /// The engine's step: a CUDA sync it sleeps in, the batch mark, and a
    /// token mark per running request.
    fn engine(&mut self, t: MonoNs, engine_ns: u64, tokens_ready: MonoNs) {
        let running: Vec<(String, u32)> = self
            .clients
            .iter()
            .filter_map(|c| match &c.state {
                ClientState::Streaming(s) => Some((s.id.clone(), s.sent)),
                ClientState::Idle(_) => None,
            })
            .collect();
        if running.is_empty() {
            return;
        }
        let (sync_start, sync_end) = (t + 500_000, t + engine_ns - 6_000_000);
        self.cuda_sync(sync_start, sync_end, 96 + running.len() as u64);
        self.off_cpu(
            ENGINE_PID,
            ENGINE_PID,
            sync_start + 20_000,
            sync_end - 20_000,
            SYS_FUTEX,
            1,
            true,
        );
        let mut usdt = tt_usdt_event::default();
        set_header!(
            usdt.hdr,
            tt_event_kind::TT_EVENT_USDT,
            ENGINE_PID,
            ENGINE_PID,
            tokens_ready - 300_000,
            ENGINE_COMM
        );
        usdt.probe = tt_llm_probe::TT_LLM_BATCH_STEP.0;
        usdt.nargs = 3;
        usdt.args = [self.step, running.len() as u64, running.len() as u64];
        self.push(usdt.hdr.ts_ns, as_bytes(&usdt));
        for (n, (id, sent)) in running.iter().enumerate() {
            let ts = tokens_ready - 200_000 + n as u64 * 500;
            self.usdt(
                ENGINE_PID,
                ts,
                tt_llm_probe::TT_LLM_TOKEN,
                id,
                u64::from(*sent),
            );
        }
    }

    /// Every streaming request's next token, chunk-encoded in three writes;
    /// finished streams get their usage chunk, `[DONE]` and the last chunk.
    /// Returns when the last write returned.
    fn frontend_writes(&mut self, start: MonoNs) -> MonoNs {
        let mut at = start;
        let mut event = String::new();
        for i in 0..self.clients.len() {
            let client = &self.clients[i];
            let ClientState::Streaming(stream) = &client.state else {
                continue;
            };
            let conn = (client.fd, client.sock_ino, client.port.unwrap_or(0));
            event.clear();
            chunk_event(&mut event, stream);
            let last = stream.sent + 1 == stream.tokens;
            let mut bodies = vec![std::mem::take(&mut event)];
            if last {
                let total = stream.prompt_tokens + stream.tokens;
                bodies.push(format!(
                    "data: {{\"id\":\"{}\",\"object\":\"chat.completion.chunk\",\"created\":{},\"model\":\"{MODEL}\",\"choices\":[],\"usage\":{{\"prompt_tokens\":{},\"total_tokens\":{total},\"completion_tokens\":{}}}}}\n\n",
                    stream.id, stream.created, stream.prompt_tokens, stream.tokens
                ));
                bodies.push("data: [DONE]\n\n".to_owned());
            }
            for body in &bodies {
                let size = format!("{:x}\r\n", body.len());
                self.data(
                    conn,
                    at,
                    at + 1_500,
                    tt_direction::TT_DIR_EGRESS,
                    size.as_bytes(),
                );
                self.data(
                    conn,
                    at + 2_000,
                    at + 3_500,
                    tt_direction::TT_DIR_EGRESS,
                    body.as_bytes(),
                );
                self.data(
                    conn,
                    at + 4_000,
                    at + 5_500,
                    tt_direction::TT_DIR_EGRESS,
                    b"\r\n",
                );
                at += 6_000;
            }
            if last {
                self.data(
                    conn,
                    at,
                    at + 1_500,
                    tt_direction::TT_DIR_EGRESS,
                    b"0\r\n\r\n",
                );
                at += 2_000;
            }
            let think = self.rng.between(1_000_000, 200_000_000);
            let ClientState::Streaming(stream) = &mut self.clients[i].state else {
                continue;
            };
            if last {
                let id = stream.id.clone();
                self.clients[i].state = ClientState::Idle(at + think);
                self.usdt(ENGINE_PID, at, tt_llm_probe::TT_LLM_REQUEST_END, &id, 0);
            } else {
                stream.sent += 1;
            }
        }
        at
    }

    fn request(&mut self, max_tokens: u32) -> Vec<u8> {
        let words = self.rng.between(8, 120);
        let mut content = String::new();
        for w in 0..words {
            content.push_str(WORDS[(w as usize * 7 + self.next_request as usize) % WORDS.len()]);
            content.push(' ');
        }
        let body = format!(
            "{{\"model\":\"{MODEL}\",\"messages\":[{{\"role\":\"system\",\"content\":\"You are a helpful assistant.\"}},{{\"role\":\"user\",\"content\":\"{content}\"}}],\"stream\":true,\"stream_options\":{{\"include_usage\":true}},\"max_tokens\":{max_tokens},\"temperature\":0.7}}"
        );
        let trace = self.rng.next();
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{SERVER_PORT}\r\naccept: */*\r\naccept-encoding: gzip, deflate\r\nconnection: keep-alive\r\nuser-agent: OpenAI/Python 1.54.0\r\ncontent-type: application/json\r\nauthorization: Bearer sk-local\r\ntraceparent: 00-{trace:016x}{:016x}-{:016x}-01\r\ncontent-length: {}\r\n\r\n{body}",
            trace.rotate_left(17),
            trace.rotate_left(33),
            body.len()
        )
        .into_bytes()
    }

    fn push(&mut self, order_ts: MonoNs, bytes: Vec<u8>) {
        self.pending.push(Pending { order_ts, bytes });
    }

    /// A read or write of the frontend on connection `(fd, ino, port)`.
    fn data(
        &mut self,
        (fd, sock_ino, port): (i32, u64, u16),
        ts_enter: MonoNs,
        ts_exit: MonoNs,
        direction: tt_direction,
        payload: &[u8],
    ) {
        let mut raw = tt_data_event::default();
        set_header!(
            raw.hdr,
            tt_event_kind::TT_EVENT_DATA,
            FRONTEND_PID,
            FRONTEND_PID,
            ts_exit,
            FRONTEND_COMM
        );
        raw.ts_enter_ns = ts_enter;
        raw.sock_ino = sock_ino;
        raw.fd = fd;
        raw.len = payload.len() as u32;
        raw.captured = payload.len() as u32;
        raw.direction = direction.0 as u8;
        let egress = direction == tt_direction::TT_DIR_EGRESS;
        raw.call = if egress {
            tt_io_call::TT_IO_SENDTO
        } else {
            tt_io_call::TT_IO_RECVFROM
        }
        .0 as u8;
        raw.tcp_nodelay = 1;
        raw.addrs = addrs(port);
        let mut bytes = as_bytes(&raw);
        bytes.extend_from_slice(payload);
        self.push(if egress { ts_enter } else { ts_exit }, bytes);
    }

    fn conn_event(
        &mut self,
        kind: tt_event_kind,
        (fd, sock_ino, port): (i32, u64, u16),
        ts: MonoNs,
    ) {
        let mut raw = tt_conn_event::default();
        set_header!(raw.hdr, kind, FRONTEND_PID, FRONTEND_PID, ts, FRONTEND_COMM);
        raw.sock_ino = sock_ino;
        raw.fd = fd;
        raw.addrs = addrs(port);
        self.push(ts, as_bytes(&raw));
    }

    fn usdt(&mut self, pid: u32, ts: MonoNs, probe: tt_llm_probe, id: &str, arg: u64) {
        let mut raw = tt_usdt_event::default();
        set_header!(
            raw.hdr,
            tt_event_kind::TT_EVENT_USDT,
            pid,
            pid,
            ts,
            ENGINE_COMM
        );
        raw.probe = probe.0;
        raw.nargs = 1;
        raw.args = [arg, 0, 0];
        for (dst, &src) in raw.request_id.iter_mut().zip(id.as_bytes()) {
            *dst = src as i8;
        }
        self.push(ts, as_bytes(&raw));
    }

    fn cuda_sync(&mut self, start: MonoNs, end: MonoNs, launches: u64) {
        let mut raw = tt_cuda_sync_event::default();
        set_header!(
            raw.hdr,
            tt_event_kind::TT_EVENT_CUDA_SYNC,
            ENGINE_PID,
            ENGINE_PID,
            end,
            ENGINE_COMM
        );
        raw.ts_enter_ns = start;
        raw.call = tt_cuda_sync::TT_CUDA_STREAM_SYNCHRONIZE.0;
        raw.handle = 0x7f00_dead_0000;
        raw.kernel_launches = launches;
        self.push(end, as_bytes(&raw));
    }

    #[allow(clippy::too_many_arguments)]
    fn off_cpu(
        &mut self,
        pid: u32,
        tid: u32,
        start: MonoNs,
        end: MonoNs,
        syscall: i64,
        state: u32,
        in_cuda_sync: bool,
    ) {
        let mut raw = tt_offcpu_event::default();
        let comm = if pid == ENGINE_PID {
            ENGINE_COMM
        } else {
            FRONTEND_COMM
        };
        set_header!(raw.hdr, tt_event_kind::TT_EVENT_OFFCPU, pid, tid, end, comm);
        raw.start_ns = start;
        raw.syscall = syscall;
        raw.state = state;
        raw.in_cuda_sync = u32::from(in_cuda_sync);
        self.push(end, as_bytes(&raw));
    }
}

const FRONTEND_COMM: &str = "python3";
/// vLLM names its engine process `VLLM::EngineCore` (comm keeps 15 bytes).
const ENGINE_COMM: &str = "VLLM::EngineCor";

const RESPONSE_HEAD: &str = "HTTP/1.1 200 OK\r\ndate: Tue, 01 Dec 2026 10:00:00 GMT\r\nserver: uvicorn\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n";

const WORDS: &[&str] = &[
    "the", "model", "streams", "tokens", "while", "a", "latency", "budget", "holds", "for",
    "every", "request", "in", "flight", "explain", "why", "this", "one", "was", "late",
];

/// One token's SSE event, as vLLM writes it with `include_usage`.
fn chunk_event(out: &mut String, stream: &Stream) {
    let word = WORDS[(stream.sent as usize * 13 + stream.id.len()) % WORDS.len()];
    let delta = if stream.sent == 0 {
        format!("{{\"role\":\"assistant\",\"content\":\"{word}\"}}")
    } else {
        format!("{{\"content\":\" {word}\"}}")
    };
    let finish = if stream.sent + 1 == stream.tokens {
        "\"stop\""
    } else {
        "null"
    };
    let _ = write!(
        out,
        "data: {{\"id\":\"{}\",\"object\":\"chat.completion.chunk\",\"created\":{},\"model\":\"{MODEL}\",\"choices\":[{{\"index\":0,\"delta\":{delta},\"logprobs\":null,\"finish_reason\":{finish}}}],\"usage\":null}}\n\n",
        stream.id, stream.created
    );
}

fn addrs(remote_port: u16) -> tt_sock_addrs {
    let mut addrs = tt_sock_addrs {
        family: 2, // AF_INET
        local_port: SERVER_PORT,
        remote_port,
        ..Default::default()
    };
    addrs.local_addr[..4].copy_from_slice(&[127, 0, 0, 1]);
    addrs.remote_addr[..4].copy_from_slice(&[127, 0, 0, 1]);
    addrs
}

fn as_bytes<T: plain::Plain>(value: &T) -> Vec<u8> {
    // SAFETY: `T: Plain` is a repr(C) plain-old-data record type generated
    // from events.h; viewing it as bytes is sound.
    unsafe { plain::as_bytes(value) }.to_vec()
}

#[cfg(test)]
mod tests;
