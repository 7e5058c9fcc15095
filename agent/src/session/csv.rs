//! `requests.csv`: one row per request, for spreadsheets and pandas.
//!
//! Derived numbers come from [`JsonTimeline`] so both files agree; times
//! are milliseconds, `start_time` is RFC 3339 UTC and `start_offset_ms` is
//! relative to the session start.

use std::time::{Duration, UNIX_EPOCH};

use super::core::Recording;
use crate::output::JsonTimeline;

const HEADER: [&str; 33] = [
    "request",
    "start_time",
    "start_offset_ms",
    "pid",
    "comm",
    "fd",
    "method",
    "path",
    "status",
    "stream",
    "body",
    "model",
    "response_id",
    "ttft_ms",
    "e2e_ms",
    "request_read_ms",
    "tpot_ms",
    "chunks",
    "itl_p50_ms",
    "itl_p95_ms",
    "itl_max_ms",
    "request_bytes",
    "response_bytes",
    "aborted",
    "abort_reason",
    "tls",
    "trace_id",
    "socket_wait_ms",
    "accept_wait_ms",
    "tls_handshake_ms",
    "ttft_from_read_ms",
    "request_id",
    "chunks_after_client_closed",
];

fn opt<T: ToString>(value: Option<T>) -> String {
    value.map(|v| v.to_string()).unwrap_or_default()
}

/// RFC 3339 with microseconds, or empty if the time is before the epoch.
pub(crate) fn rfc3339(unix_ns: i128) -> String {
    u64::try_from(unix_ns).map_or_else(
        |_| String::new(),
        |ns| humantime::format_rfc3339_micros(UNIX_EPOCH + Duration::from_nanos(ns)).to_string(),
    )
}

/// The trace id of a W3C `traceparent` (`00-<trace id>-<span id>-<flags>`).
fn trace_id(traceparent: Option<&str>) -> String {
    traceparent
        .and_then(|tp| tp.split('-').nth(1))
        .filter(|id| id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()))
        .unwrap_or_default()
        .to_string()
}

/// The CSV text (RFC 4180 quoting by the `csv` crate: a field is quoted
/// when it holds a separator, quote or line break).
pub fn render(recording: &Recording) -> String {
    let mut out = csv::Writer::from_writer(Vec::new());
    write_rows(recording, &mut out).expect("rows as long as the header, written to memory");
    let bytes = out
        .into_inner()
        .expect("flushing CSV to memory cannot fail");
    String::from_utf8(bytes).expect("CSV of UTF-8 fields is UTF-8")
}

fn write_rows(recording: &Recording, out: &mut csv::Writer<Vec<u8>>) -> csv::Result<()> {
    out.write_record(HEADER)?;
    let meta = &recording.meta;
    for (i, t) in recording.timelines.iter().enumerate() {
        let j = JsonTimeline::new(t);
        let offset = (t.request_start as f64 - meta.started_ns as f64) / 1e6;
        let body = j.body.and_then(|b| serde_plain::to_string(&b).ok());
        let reason = j.abort_reason.and_then(|r| serde_plain::to_string(&r).ok());
        // As many fields as HEADER, by type: the writer refuses a row of
        // another length.
        let row: [String; HEADER.len()] = [
            (i + 1).to_string(),
            rfc3339(meta.unix_ns(t.request_start)),
            format!("{offset:.3}"),
            j.pid.to_string(),
            j.comm.to_string(),
            j.fd.to_string(),
            j.method.to_string(),
            j.path.to_string(),
            opt(j.status),
            j.stream.to_string(),
            opt(body),
            j.model.unwrap_or_default().to_string(),
            j.response_id.unwrap_or_default().to_string(),
            opt(j.ttft_ms),
            j.e2e_ms.to_string(),
            j.request_read_ms.to_string(),
            opt(j.tpot_ms),
            j.chunks.to_string(),
            opt(j.itl_p50_ms),
            opt(j.itl_p95_ms),
            opt(j.itl_max_ms),
            j.request_bytes.to_string(),
            j.response_bytes.to_string(),
            j.aborted.to_string(),
            opt(reason),
            j.tls.to_string(),
            trace_id(t.traceparent.as_deref()),
            opt(j.socket_wait_ms),
            opt(j.accept_wait_ms),
            opt(j.tls_handshake_ms),
            opt(j.ttft_from_read_ms),
            j.request_id.unwrap_or_default().to_string(),
            j.chunks_after_client_closed.to_string(),
        ];
        out.write_record(&row)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::core::tests::recording;

    #[test]
    fn one_row_per_request_with_a_header() {
        let mut rec = recording();
        rec.timelines[0].path = "/x?a=1,b=\"2\"".into();
        rec.timelines[0].traceparent =
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into());
        let text = render(&rec);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[0].split(',').count(), HEADER.len());
        assert!(
            lines[1].starts_with("1,2023-11-14T22:13:21.1"),
            "{}",
            lines[1]
        );
        assert!(
            lines[1].contains(",\"/x?a=1,b=\"\"2\"\"\","),
            "{}",
            lines[1]
        );
        rec.timelines[1].request_headers = vec![("x-request-id".into(), "r,1".into())];
        let text = render(&rec);
        let lines: Vec<&str> = text.lines().collect();
        // trace id, then socket/accept/TLS waits, TTFT from the read,
        // request id, chunks after the client left
        assert!(
            lines[1].contains(",4bf92f3577b34da6a3ce929d0e0e4736,"),
            "{}",
            lines[1]
        );
        assert!(lines[2].ends_with(",\"r,1\",0"), "{}", lines[2]);
        assert!(lines[2].contains(",sse,"), "{}", lines[2]);
        assert!(lines[1].contains(",100.000,"), "start offset: {}", lines[1]);
        assert!(lines[2].contains(",500.000,"), "start offset: {}", lines[2]);
    }

    #[test]
    fn rfc3339_of_negative_time_is_empty() {
        assert_eq!(rfc3339(-1), "");
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000000Z");
    }
}
