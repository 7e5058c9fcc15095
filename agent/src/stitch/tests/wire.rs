//! Request ingress (arrival at the host vs the server's read), setup waits
//! (accept, TLS handshake), who ended a request, request-id headers.

use super::*;
use crate::event::{PeerClose, PeerClosedEvent, TlsHandshakeEvent};

impl Sim {
    /// A read whose oldest byte the kernel dated at `ingress`.
    fn read_arrived(&mut self, ingress: MonoNs, ts: MonoNs, bytes: impl AsRef<[u8]>) {
        self.next_ingress = Some(ingress);
        self.read(ts, bytes);
    }

    fn peer(&mut self, conn: ConnId, ts: MonoNs, reason: PeerClose) {
        self.push(Event::PeerClosed(PeerClosedEvent {
            conn,
            ts,
            reason,
            addrs: Some(addrs()),
        }));
    }

    /// A stream of `tokens` events at 300, 400, ... after a head at 200.
    fn stream(&mut self, tokens: u64) {
        self.write(200, SSE_CHUNKED_HEAD);
        for i in 0..tokens {
            self.write(300 + 100 * i, chunk(token_event("s", "x")));
        }
    }

    fn finish_stream(&mut self, ts: MonoNs) {
        self.write(ts, chunk(DONE_EVENT));
        self.write(ts + 1, LAST_CHUNK);
    }
}

#[test]
fn times_count_from_arrival_and_the_read_is_kept() {
    let mut sim = Sim::new();
    sim.read_arrived(40, 100, chat_request("m", true));
    sim.stream(2);
    sim.finish_stream(500);
    let tl = sim.one();
    assert_eq!((tl.request_start, tl.read_start), (40, 100));
    assert!(tl.ingress_known);
    assert_eq!(tl.socket_wait_ns(), Some(60));
    assert_eq!(tl.ttft_ns(), Some(300 - 40));
    assert_eq!(tl.ttft_from_read_ns(), Some(300 - 100));
    assert_eq!(tl.chunk_offsets_ns(), vec![260, 360]);
    assert_eq!(tl.e2e_ns(), 501 - 40);
    assert_eq!(sim.st.stats().requests_without_ingress, 0);
}

#[test]
fn unknown_or_impossible_arrival_falls_back_to_the_read() {
    let mut sim = Sim::new();
    sim.read(100, get_request("/unknown"));
    sim.write(150, json_response("{}"));
    // An arrival after the read cannot be: ignored, not trusted.
    sim.read_arrived(260, 250, get_request("/later"));
    sim.write(300, json_response("{}"));
    let out = sim.take();
    assert_eq!(out.len(), 2);
    for (tl, read) in out.iter().zip([100, 250]) {
        assert_eq!((tl.request_start, tl.read_start), (read, read));
        assert!(!tl.ingress_known);
        assert_eq!(tl.socket_wait_ns(), None);
        assert_eq!(tl.ttft_ns(), tl.ttft_from_read_ns());
    }
    assert_eq!(sim.st.stats().requests_without_ingress, 2);
}

#[test]
fn a_head_split_over_reads_starts_at_its_first_byte() {
    let mut sim = Sim::new();
    let req = chat_request("m", true);
    let (a, b) = req.split_at(20);
    sim.read_arrived(10, 100, a);
    sim.read_arrived(150, 160, b);
    sim.stream(1);
    sim.finish_stream(400);
    let tl = sim.one();
    assert_eq!(
        (tl.request_start, tl.read_start, tl.request_end),
        (10, 100, 160)
    );
}

#[test]
fn accept_wait_is_charged_to_the_first_request_only() {
    let mut sim = Sim::without_accept(StitchConfig::default());
    sim.push(Event::Accept(ConnEvent {
        conn: sim.conn,
        tid: PID,
        comm: COMM.to_owned(),
        ts: 30,
        addrs: Some(addrs()),
        established: Some(5),
    }));
    sim.read_arrived(8, 40, get_request("/first"));
    sim.write(50, json_response("{}"));
    sim.read_arrived(60, 61, get_request("/second"));
    sim.write(70, json_response("{}"));
    let out = sim.take();
    assert_eq!(out[0].accept_wait_ns, Some(25));
    assert_eq!(out[1].accept_wait_ns, None);
    assert_eq!(out[0].socket_wait_ns(), Some(32));
}

#[test]
fn client_fin_then_close_mid_stream_is_client_closed_with_chunks_after() {
    let mut sim = Sim::new();
    sim.read(100, chat_request("m", true));
    sim.stream(1); // chunk at 300
    sim.peer(sim.conn, 350, PeerClose::Fin);
    sim.write(400, chunk(token_event("s", "late")));
    sim.write(500, chunk(token_event("s", "later")));
    sim.close(600);
    let tl = sim.one();
    assert_eq!(tl.abort_reason, Some(AbortReason::ClientClosed));
    assert_eq!(tl.chunks_after_client_closed, 2);
    assert_eq!(tl.chunk_ts, vec![300, 400, 500]);
}

#[test]
fn a_reset_before_the_response_completes_is_a_cancellation() {
    let mut sim = Sim::new();
    sim.read(100, chat_request("m", true));
    sim.stream(2); // chunks at 300, 400
    sim.peer(sim.conn, 350, PeerClose::Rst);
    // The server writes the rest into the void and finishes.
    sim.finish_stream(450);
    let tl = sim.one();
    assert!(tl.aborted);
    assert_eq!(tl.abort_reason, Some(AbortReason::ClientClosed));
    assert_eq!(tl.chunks_after_client_closed, 1);
    assert!(tl.done_seen);
}

#[test]
fn a_half_close_before_a_complete_response_is_no_cancellation() {
    let mut sim = Sim::new();
    sim.read(100, chat_request("m", true));
    sim.peer(sim.conn, 150, PeerClose::Fin);
    sim.stream(2);
    sim.finish_stream(450);
    let tl = sim.one();
    assert!(!tl.aborted, "{tl:#?}");
    assert_eq!(tl.chunks_after_client_closed, 0);
}

#[test]
fn a_refused_write_counts_as_the_client_leaving() {
    let mut sim = Sim::new();
    sim.read(100, chat_request("m", true));
    sim.stream(1);
    sim.peer(sim.conn, 420, PeerClose::WriteEpipe);
    sim.close(430);
    let tl = sim.one();
    assert_eq!(tl.abort_reason, Some(AbortReason::ClientClosed));
    assert_eq!(tl.chunks_after_client_closed, 0);
}

#[test]
fn server_close_with_a_request_unanswered_is_server_closed() {
    let mut sim = Sim::new();
    sim.read(100, get_request("/a"));
    sim.write(150, json_response("{}"));
    sim.read(200, get_request("/b"));
    sim.close(250);
    let out = sim.take();
    assert_eq!(out.len(), 2);
    assert!(!out[0].aborted);
    assert_eq!(out[1].abort_reason, Some(AbortReason::ServerClosed));
    // A client leaving after a completed exchange changes nothing.
    let mut sim = Sim::new();
    sim.read(100, get_request("/a"));
    sim.write(150, json_response("{}"));
    sim.peer(sim.conn, 160, PeerClose::Fin);
    sim.close(170);
    assert!(!sim.one().aborted);
}

#[test]
fn a_close_only_inferred_from_fd_reuse_stays_connection_closed() {
    let mut sim = Sim::new();
    sim.read(100, chat_request("m", true));
    sim.stream(1);
    // A new socket on the same fd: the old one's close was never seen.
    sim.conn = conn_id(sim.conn.fd, 4711);
    sim.read(500, get_request("/next"));
    let tl = sim.one();
    assert_eq!(tl.abort_reason, Some(AbortReason::ConnectionClosed));
}

#[test]
fn tls_handshake_and_the_sockets_accept_wait_go_to_the_first_request() {
    let mut sim = Sim::without_accept(StitchConfig::default());
    let socket = conn_id(9, 900);
    sim.push(Event::Accept(ConnEvent {
        conn: socket,
        tid: PID,
        comm: COMM.to_owned(),
        ts: 20,
        addrs: Some(addrs()),
        established: Some(12),
    }));
    let tls = tls_conn(0x7000);
    sim.push(Event::TlsHandshake(TlsHandshakeEvent {
        conn: tls,
        socket_fd: Some(9),
        ts: 90,
        first_byte: Some(25),
        addrs: Some(addrs()),
    }));
    sim.conn = tls;
    sim.read_arrived(95, 100, chat_request("m", true));
    sim.stream(1);
    // The client leaves: its FIN is reported on the socket, not the SSL*.
    sim.peer(socket, 350, PeerClose::Fin);
    sim.write(400, chunk(token_event("s", "late")));
    sim.push(Event::Close(ConnEvent {
        conn: tls,
        tid: PID,
        comm: COMM.to_owned(),
        ts: 450,
        addrs: None,
        established: None,
    }));
    let tl = sim.one();
    assert!(tl.tls);
    assert_eq!(tl.accept_wait_ns, Some(8));
    assert_eq!(tl.tls_handshake_ns, Some(65));
    assert_eq!(tl.socket_wait_ns(), Some(5));
    assert_eq!(tl.abort_reason, Some(AbortReason::ClientClosed));
    assert_eq!(tl.chunks_after_client_closed, 1);
}

#[test]
fn a_stream_under_way_when_tracing_began_is_skipped_and_counted() {
    let mut sim = Sim::without_accept(StitchConfig::default());
    sim.write(10, chunk(token_event("old", "a")));
    sim.write(20, chunk(token_event("old", "b")));
    sim.finish_stream(30);
    assert!(sim.take().is_empty());
    assert_eq!(sim.st.stats().streams_in_flight_at_start, 1);
    // The next request on that connection is reported in full.
    sim.read_arrived(90, 100, chat_request("m", true));
    sim.stream(1);
    sim.finish_stream(400);
    let tl = sim.one();
    assert_eq!((tl.request_start, tl.chunk_ts.len()), (90, 1));
    assert_eq!(sim.st.stats().streams_in_flight_at_start, 1);
}

#[test]
fn the_first_configured_request_id_header_present_is_the_request_id() {
    let config = StitchConfig {
        request_id_headers: ["x-trace-id", "x-request-id"].map(String::from).into(),
        ..StitchConfig::default()
    };
    let mut sim = Sim::with_config(config);
    sim.read(
        100,
        "GET /a HTTP/1.1\r\nX-Request-Id: req-7\r\nHost: x\r\n\r\n".as_bytes(),
    );
    sim.write(150, json_response("{}"));
    sim.read(
        200,
        "GET /b HTTP/1.1\r\nx-request-id: req-8\r\nX-Trace-Id: tr-1\r\n\r\n".as_bytes(),
    );
    sim.write(250, json_response("{}"));
    let out = sim.take();
    assert_eq!(out[0].request_id(), Some("req-7"));
    assert_eq!(
        out[1].request_headers,
        [
            ("x-trace-id".to_string(), "tr-1".to_string()),
            ("x-request-id".to_string(), "req-8".to_string())
        ]
    );
    assert_eq!(out[1].request_id(), Some("tr-1"));
}
