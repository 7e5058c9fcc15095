//! What ties two requests of one serving path together: the two ends of
//! one TCP connection on this host (exact), or inside a gateway what it
//! carried from its inbound request to the outbound one it caused.
//! Nothing here joins on timing alone: times only rule candidates out.

use std::net::SocketAddr;

use crate::model::trace_context::RemoteParent;
use crate::model::{JoinKey, RequestTimeline};

/// A connection's endpoints as (local, remote), IPv4-mapped addresses as
/// IPv4 (a dual-stack listener sees `::ffff:127.0.0.1`).
pub(super) fn ends(t: &RequestTimeline) -> Option<(SocketAddr, SocketAddr)> {
    let canon = |a: SocketAddr| SocketAddr::new(a.ip().to_canonical(), a.port());
    t.addrs.map(|a| (canon(a.local), canon(a.remote)))
}

/// Whether `server` is a request `client` sent: the server's connection is
/// the client's seen from the other end, and the server's request began
/// while the client's was in flight (the client's write came first; on
/// HTTP/1.1 a connection carries one request at a time, so at most one
/// client request qualifies).
pub(super) fn same_connection(client: &RequestTimeline, server: &RequestTimeline) -> bool {
    let (Some((c_local, c_remote)), Some((s_local, s_remote))) = (ends(client), ends(server))
    else {
        return false;
    };
    c_local == s_remote
        && c_remote == s_local
        && client.request_start <= server.request_start
        && server.request_start <= client.end
        && client.stream_id == server.stream_id
}

/// What ties a gateway's inbound request to an outbound one of the same
/// process, strongest first; `None` when nothing it carried over matches
/// or the outbound one did not start while the inbound one was in flight.
pub(super) fn carried_over(
    inbound: &RequestTimeline,
    outbound: &RequestTimeline,
) -> Option<JoinKey> {
    if inbound.conn.pid != outbound.conn.pid
        || outbound.request_start < inbound.request_start
        || outbound.request_start > inbound.end
    {
        return None;
    }
    let trace_of = |t: &RequestTimeline| {
        t.traceparent
            .as_deref()
            .and_then(|tp| RemoteParent::parse(tp, None))
            .map(|p| p.trace_id)
    };
    if let (Some(a), Some(b)) = (trace_of(inbound), trace_of(outbound)) {
        if a == b {
            return Some(JoinKey::Traceparent);
        }
    }
    let shares_id = outbound.request_headers.iter().any(|(name, value)| {
        inbound
            .request_headers
            .iter()
            .any(|(n, v)| n == name && v == value && !v.is_empty())
    });
    if shares_id {
        return Some(JoinKey::RequestId);
    }
    match (&inbound.response_id, &outbound.response_id) {
        (Some(a), Some(b)) if a == b && !a.is_empty() => return Some(JoinKey::ResponseId),
        _ => {}
    }
    match (inbound.first_event_hash, outbound.first_event_hash) {
        (Some(a), Some(b)) if a == b => Some(JoinKey::FirstEvent),
        _ => None,
    }
}

/// Whether `a` and `b` carry the same value of `key` (two outbound
/// requests that would both claim one inbound request by it).
pub(super) fn same_value(key: JoinKey, a: &RequestTimeline, b: &RequestTimeline) -> bool {
    match key {
        JoinKey::Tcp4tuple => false,
        JoinKey::Traceparent => a.traceparent.is_some() && a.traceparent == b.traceparent,
        JoinKey::RequestId => a
            .request_headers
            .iter()
            .any(|h| b.request_headers.contains(h)),
        JoinKey::ResponseId => a.response_id.is_some() && a.response_id == b.response_id,
        JoinKey::FirstEvent => {
            a.first_event_hash.is_some() && a.first_event_hash == b.first_event_hash
        }
    }
}

/// Whether two requests were in flight at the same time.
pub(super) fn overlap(a: &RequestTimeline, b: &RequestTimeline) -> bool {
    a.request_start <= b.end && b.request_start <= a.end
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{ConnId, SockAddrs};
    use crate::model::SpanKind;

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("address")
    }

    fn timeline(
        kind: SpanKind,
        local: &str,
        remote: &str,
        start: u64,
        end: u64,
    ) -> RequestTimeline {
        RequestTimeline {
            conn: ConnId {
                pid: 1,
                fd: 5,
                sock_ino: 9,
            },
            kind,
            addrs: Some(SockAddrs {
                local: addr(local),
                remote: addr(remote),
            }),
            request_start: start,
            end,
            ..RequestTimeline::default()
        }
    }

    #[test]
    fn the_two_ends_of_one_connection_while_the_client_request_is_in_flight() {
        let client = timeline(
            SpanKind::Client,
            "127.0.0.1:40000",
            "127.0.0.1:8000",
            100,
            900,
        );
        let server = timeline(
            SpanKind::Server,
            "[::ffff:127.0.0.1]:8000",
            "127.0.0.1:40000",
            150,
            800,
        );
        assert!(same_connection(&client, &server));
        // the next request on the same keep-alive connection
        let later = timeline(
            SpanKind::Server,
            "127.0.0.1:8000",
            "127.0.0.1:40000",
            950,
            1200,
        );
        assert!(!same_connection(&client, &later));
        // another client port
        let other = timeline(
            SpanKind::Server,
            "127.0.0.1:8000",
            "127.0.0.1:40001",
            150,
            800,
        );
        assert!(!same_connection(&client, &other));
    }

    #[test]
    fn a_gateway_joins_by_what_it_forwarded_strongest_first() {
        let mut inbound = timeline(SpanKind::Server, "127.0.0.1:80", "127.0.0.1:5000", 100, 900);
        let mut outbound = timeline(
            SpanKind::Client,
            "127.0.0.1:40000",
            "127.0.0.1:8000",
            120,
            850,
        );
        assert_eq!(carried_over(&inbound, &outbound), None, "nothing shared");
        inbound.first_event_hash = Some(42);
        outbound.first_event_hash = Some(42);
        assert_eq!(carried_over(&inbound, &outbound), Some(JoinKey::FirstEvent));
        inbound.response_id = Some("chatcmpl-1".into());
        outbound.response_id = Some("chatcmpl-1".into());
        assert_eq!(carried_over(&inbound, &outbound), Some(JoinKey::ResponseId));
        inbound.request_headers = vec![("x-request-id".into(), "r1".into())];
        outbound.request_headers = vec![("x-request-id".into(), "r1".into())];
        assert_eq!(carried_over(&inbound, &outbound), Some(JoinKey::RequestId));
        let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        inbound.traceparent = Some(tp.into());
        outbound.traceparent =
            Some("00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01".into());
        assert_eq!(
            carried_over(&inbound, &outbound),
            Some(JoinKey::Traceparent)
        );
        // an outbound request that began before the inbound one arrived
        outbound.request_start = 50;
        assert_eq!(carried_over(&inbound, &outbound), None);
    }
}
