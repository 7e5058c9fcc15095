//! `report.html`: one self-contained page (no network needed to view it)
//! with the summary table, the TTFT histogram, the per-request waterfall
//! with every token tick, the slowest requests with their breakdown, and
//! the flame graph.
//!
//! The numbers are computed here; the embedded script (`assets/report.js`)
//! only draws them, so what the page shows is unit-tested in Rust. The
//! data goes in a `<script type="application/json">` block with `<`
//! escaped, so no id or path can close the script element. The flame graph
//! is an `<iframe>` of the SVG as a data URL: inferno's own script then
//! keeps its search and zoom without clashing with the page.

use base64::Engine as _;
use serde::Serialize;

use super::core::{Profile, Recording};
use super::csv::rfc3339;
use super::hop_order::hop_order;
use super::perfetto::request_label;
use crate::model::Stall;
use crate::model::{RequestTimeline, SpanKind};
use crate::units::{ms, percentile};

const TEMPLATE: &str = include_str!("assets/report.html");
const CSS: &str = include_str!("assets/report.css");
const JS: &str = include_str!("assets/report.js");

/// Requests drawn in the waterfall; a longer session shows its first ones
/// and says how many were left out (the table and files have them all).
pub const MAX_WATERFALL_ROWS: usize = 500;
/// Rows of the slowest-requests table.
pub const SLOWEST_ROWS: usize = 10;
/// Bars of the TTFT histogram.
const HISTOGRAM_BINS: usize = 30;
/// An inter-token gap is "slow" when it is this many times the request's
/// median gap …
const SLOW_GAP_FACTOR: u64 = 3;
/// … and at least this long (ns): sub-5 ms jitter is not slow. (Relative to
/// the request itself, unlike the explainer's absolute stall threshold.)
const SLOW_GAP_MIN_NS: u64 = 5_000_000;
/// Margin of the waterfall's default view on each side of the requests'
/// span, as a share of that span.
const REQUESTS_VIEW_PAD: f64 = 0.02;

#[derive(Debug, Serialize)]
struct Dist {
    name: &'static str,
    count: usize,
    p50: Option<f64>,
    p90: Option<f64>,
    p95: Option<f64>,
    p99: Option<f64>,
    max: Option<f64>,
}

impl Dist {
    fn of(name: &'static str, mut values: Vec<u64>) -> Self {
        values.sort_unstable();
        let q = |p| percentile(&values, p).map(ms);
        Self {
            name,
            count: values.len(),
            p50: q(50.0),
            p90: q(90.0),
            p95: q(95.0),
            p99: q(99.0),
            max: values.last().copied().map(ms),
        }
    }
}

#[derive(Debug, Serialize)]
struct Summary {
    requests: usize,
    aborted: usize,
    chunks: usize,
    chunks_per_s: f64,
    rows: Vec<Dist>,
}

#[derive(Debug, Serialize, PartialEq)]
struct Bin {
    lo: f64,
    hi: f64,
    n: usize,
}

#[derive(Debug, Serialize)]
struct Row {
    label: String,
    /// Depth in its trace: an upstream call (1) under the gateway's
    /// request, the engine's request (2) under that call.
    d: usize,
    /// `client` for a traced process's upstream call, else `server`.
    kind: SpanKind,
    /// Offsets from the session start, ms: arrival of the request, the
    /// server's first read of it, request read, first token, end.
    s: f64,
    rd: f64,
    r: f64,
    f: Option<f64>,
    e: f64,
    /// Token ticks, ms from the session start.
    t: Vec<f64>,
    /// Indexes (into `t`) of the chunks the explainer found late.
    k: Vec<usize>,
    /// The late chunks' causes, summed ([`causes`]); empty when none.
    c: String,
    aborted: bool,
}

#[derive(Debug, Serialize)]
struct Waterfall {
    total: usize,
    rows: Vec<Row>,
    /// The whole session's axis, ms.
    span_ms: f64,
    /// The drawn requests' own span (first arrival → last end, padded by
    /// [`REQUESTS_VIEW_PAD`] each side, inside the session): the default
    /// view, so ten requests in one second of an 18 s session are not a
    /// sliver at one end of the axis.
    from_ms: f64,
    to_ms: f64,
}

/// Where a slow request's time went, from what the session saw.
#[derive(Debug, Serialize, PartialEq)]
struct Breakdown {
    label: String,
    ttft_ms: Option<f64>,
    e2e_ms: f64,
    chunks: usize,
    /// Arrival at the host → the server's first read (waiting in the
    /// kernel's receive queue); `None` when the arrival is unknown.
    socket_wait_ms: Option<f64>,
    /// First request of a connection: in the accept queue.
    accept_wait_ms: Option<f64>,
    /// First request of a TLS connection: ClientHello → handshake done.
    tls_handshake_ms: Option<f64>,
    /// Reading the request off the socket.
    receive_ms: f64,
    /// Request read → first token (queueing and prefill, seen from outside).
    wait_ms: Option<f64>,
    /// First token → end.
    stream_ms: Option<f64>,
    longest_gap_ms: Option<f64>,
    /// Token index after the longest gap.
    longest_gap_at: Option<usize>,
    /// What the explainer found in the longest gap, when that token was
    /// late enough to be explained ([`causes`] of its stall).
    longest_gap_cause: String,
    /// Gaps of at least [`SLOW_GAP_FACTOR`] × the median gap and
    /// [`SLOW_GAP_MIN_NS`]: how many, and their total.
    slow_gaps: usize,
    slow_gap_ms: f64,
    /// On-CPU samples of the serving process while the request ran.
    cpu_samples: Option<usize>,
    /// Where the explainer's late chunks spent their gaps, largest first
    /// ("off-CPU 80.0 ms (futex) · GPU sync 20.0 ms"); empty when no chunk
    /// was late enough to be explained.
    causes: String,
    abort_reason: Option<String>,
}

#[derive(Debug, Serialize)]
struct Meta {
    host: String,
    selector: String,
    start: String,
    duration_s: f64,
    version: String,
    profile_hz: u64,
}

#[derive(Debug, Serialize)]
struct Data {
    meta: Meta,
    counters: super::core::SessionCounters,
    summary: Summary,
    histogram: Vec<Bin>,
    waterfall: Waterfall,
    slowest: Vec<Breakdown>,
    cpu_samples: Option<usize>,
}

/// A round bin width (1, 2 or 5 × 10^k ms) giving about `bins` bars up to
/// `max`.
fn bin_width(max_ms: f64, bins: usize) -> f64 {
    let raw = (max_ms / bins as f64).max(0.001);
    let magnitude = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|w| *w >= raw)
        .unwrap_or(10.0 * magnitude)
}

/// Bars from the bin holding the smallest TTFT to the one holding the
/// largest: a narrow spread far from zero is not squeezed into one corner.
fn histogram(ttfts_ns: &[u64]) -> Vec<Bin> {
    let (Some(&min), Some(&max)) = (ttfts_ns.iter().min(), ttfts_ns.iter().max()) else {
        return Vec::new();
    };
    let width = bin_width(ms(max) - ms(min), HISTOGRAM_BINS);
    let first = (ms(min) / width).floor() as usize;
    let count = ((ms(max) / width).floor() as usize + 1 - first).min(HISTOGRAM_BINS * 3);
    let mut bins: Vec<Bin> = (first..first + count)
        .map(|i| Bin {
            lo: i as f64 * width,
            hi: (i + 1) as f64 * width,
            n: 0,
        })
        .collect();
    for &v in ttfts_ns {
        let i = ((ms(v) / width).floor() as usize)
            .saturating_sub(first)
            .min(count - 1);
        bins[i].n += 1;
    }
    bins
}

/// The explainer's causes of a request's stalls, summed, largest first.
fn causes(stalls: &[Stall]) -> String {
    let sum = |f: fn(&Stall) -> f64| stalls.iter().map(f).sum::<f64>();
    let mut parts: Vec<(f64, String)> = Vec::new();
    let mut push = |ms: f64, label: String| {
        if ms > 0.0 {
            parts.push((ms, format!("{label} {ms:.1} ms")));
        }
    };
    push(sum(|s| s.queue_ms), "queue".into());
    push(sum(|s| s.preempted_ms), "preempted (engine)".into());
    push(sum(|s| s.prefill_ms), "prefill".into());
    push(sum(|s| s.gpu_sync_ms), "GPU sync".into());
    push(sum(|s| s.flow_control_ms), "HTTP/2 flow control".into());
    let off_cpu_reason = stalls
        .iter()
        .filter(|s| s.off_cpu_ms > 0.0)
        .max_by(|a, b| a.off_cpu_ms.total_cmp(&b.off_cpu_ms))
        .and_then(|s| s.off_cpu_reason.clone());
    push(
        sum(|s| s.off_cpu_ms),
        match off_cpu_reason {
            Some(reason) => format!("off-CPU ({reason})"),
            None => "off-CPU".into(),
        },
    );
    let nagle = stalls.iter().any(|s| s.nagle);
    push(
        sum(|s| s.socket_ms),
        if nagle { "socket (Nagle)" } else { "socket" }.into(),
    );
    push(sum(|s| s.unexplained_ms), "unexplained".into());
    parts.sort_by(|a, b| b.0.total_cmp(&a.0));
    parts
        .into_iter()
        .map(|(_, text)| text)
        .collect::<Vec<_>>()
        .join(" · ")
}

/// Chunk indexes with a stall, in order, each once.
fn late_chunks(t: &RequestTimeline) -> Vec<usize> {
    let mut late: Vec<usize> = t
        .stalls
        .iter()
        .map(|s| s.chunk)
        .filter(|&c| c < t.chunk_ts.len())
        .collect();
    late.sort_unstable();
    late.dedup();
    late
}

/// The waterfall's default view: the rows' first arrival to their last
/// end, padded, within `[0, span_ms]`; the whole session when no row
/// spans any time.
fn requests_view(rows: &[Row], span_ms: f64) -> (f64, f64) {
    let first = rows.iter().map(|r| r.s).fold(f64::INFINITY, f64::min);
    let last = rows.iter().map(|r| r.e).fold(f64::NEG_INFINITY, f64::max);
    if rows.is_empty() || last <= first {
        return (0.0, span_ms);
    }
    let pad = (last - first) * REQUESTS_VIEW_PAD;
    let round = |v: f64| (v * 1e3).round() / 1e3;
    (
        round((first - pad).max(0.0)),
        round((last + pad).min(span_ms)),
    )
}

fn breakdown(index: usize, t: &RequestTimeline, profile: Option<&Profile>) -> Breakdown {
    let phases = t.phases();
    let gaps = &t.stats().itl_ns;
    let median = t.stats().itl_percentile_ns(50.0).unwrap_or(0);
    let threshold = (median * SLOW_GAP_FACTOR).max(SLOW_GAP_MIN_NS);
    let slow: Vec<u64> = gaps.iter().copied().filter(|&g| g >= threshold).collect();
    let longest = t.longest_gap();
    let cpu_samples = profile.map(|p| {
        p.samples
            .iter()
            .filter(|s| s.pid == t.conn.pid && s.ts >= t.request_start && s.ts <= t.end)
            .count()
    });
    Breakdown {
        label: request_label(index, t),
        ttft_ms: t.ttft_ns().map(ms),
        e2e_ms: ms(t.e2e_ns()),
        chunks: t.chunk_ts.len(),
        socket_wait_ms: phases.socket_wait_ns.map(ms),
        accept_wait_ms: t.accept_wait_ns.map(ms),
        tls_handshake_ms: t.tls_handshake_ns.map(ms),
        receive_ms: ms(phases.reading_ns),
        wait_ms: phases.to_first_token_ns.map(ms),
        stream_ms: phases.stream_ns.map(ms),
        longest_gap_ms: longest.map(|(_, g)| ms(g)),
        longest_gap_at: longest.map(|(i, _)| i),
        longest_gap_cause: longest
            .map(|(i, _)| {
                let late: Vec<Stall> = t.stalls.iter().filter(|s| s.chunk == i).cloned().collect();
                causes(&late)
            })
            .unwrap_or_default(),
        slow_gaps: slow.len(),
        slow_gap_ms: ms(slow.iter().sum()),
        cpu_samples,
        causes: causes(&t.stalls),
        abort_reason: t.abort_reason.and_then(|r| serde_plain::to_string(&r).ok()),
    }
}

fn data(rec: &Recording) -> Data {
    let meta = &rec.meta;
    let base = meta.started_ns as f64;
    let off = |ts: u64| ((ts as f64 - base) / 1e3).round() / 1e3;
    // The figures are the servers' (as the run summary's and the metrics
    // are); upstream calls only show in the waterfall, under their hop.
    let served = || rec.timelines.iter().filter(|t| t.kind == SpanKind::Server);
    let ttfts: Vec<u64> = served().filter_map(|t| t.ttft_ns()).collect();
    let chunks: usize = served().map(|t| t.chunk_ts.len()).sum();
    let duration_s = meta.duration_ns() as f64 / 1e9;
    let tpots: Vec<u64> = served().filter_map(|t| t.stats().tpot_ns).collect();
    let summary = Summary {
        requests: served().count(),
        aborted: served().filter(|t| t.aborted).count(),
        chunks,
        chunks_per_s: if duration_s > 0.0 {
            (chunks as f64 / duration_s * 10.0).round() / 10.0
        } else {
            0.0
        },
        rows: vec![
            Dist::of("TTFT", ttfts.clone()),
            Dist::of(
                "socket wait",
                served()
                    .filter_map(RequestTimeline::socket_wait_ns)
                    .collect(),
            ),
            Dist::of(
                "ITL",
                served()
                    .flat_map(|t| t.stats().itl_ns.iter().copied())
                    .collect(),
            ),
            Dist::of("TPOT", tpots),
            Dist::of("E2E", served().map(RequestTimeline::e2e_ns).collect()),
        ],
    };
    let rows: Vec<Row> = hop_order(&rec.timelines)
        .into_iter()
        .take(MAX_WATERFALL_ROWS)
        .map(|(i, d)| {
            let t = &rec.timelines[i];
            Row {
                label: request_label(i, t),
                d,
                kind: t.kind,
                s: off(t.request_start),
                rd: off(t.read_start),
                r: off(t.request_end),
                f: t.first_token().map(off),
                e: off(t.end),
                t: t.chunk_ts.iter().map(|&c| off(c)).collect(),
                k: late_chunks(t),
                c: causes(&t.stalls),
                aborted: t.aborted,
            }
        })
        .collect();
    let span_ms = rows
        .iter()
        .map(|r| r.e)
        .fold(ms(meta.duration_ns()), f64::max);
    let (from_ms, to_ms) = requests_view(&rows, span_ms);
    let mut slow: Vec<usize> = (0..rec.timelines.len())
        .filter(|&i| rec.timelines[i].kind == SpanKind::Server)
        .collect();
    slow.sort_by_key(|&i| {
        let t = &rec.timelines[i];
        (std::cmp::Reverse(t.ttft_ns().unwrap_or(t.e2e_ns())), i)
    });
    let slowest = slow
        .into_iter()
        .take(SLOWEST_ROWS)
        .map(|i| breakdown(i, &rec.timelines[i], rec.profile.as_ref()))
        .collect();
    Data {
        meta: Meta {
            host: meta.hostname.clone(),
            selector: meta.selector.clone(),
            start: rfc3339(meta.unix_ns(meta.started_ns)),
            duration_s: (duration_s * 10.0).round() / 10.0,
            version: meta.agent_version.clone(),
            profile_hz: meta.profile_hz,
        },
        counters: rec.counters.clone(),
        summary,
        histogram: histogram(&ttfts),
        waterfall: Waterfall {
            total: rec.timelines.len(),
            rows,
            span_ms,
            from_ms,
            to_ms,
        },
        slowest,
        cpu_samples: rec.profile.as_ref().map(|p| p.samples.len()),
    }
}

/// JSON safe inside a `<script>` element: `<` never appears literally.
fn script_json(value: &impl Serialize) -> anyhow::Result<String> {
    Ok(serde_json::to_string(value)?.replace('<', "\\u003c"))
}

fn escape_html(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

pub fn render(rec: &Recording, flame_svg: &[u8]) -> anyhow::Result<String> {
    let data = data(rec);
    let title = format!(
        "tokentrace session on {} ({})",
        rec.meta.hostname, data.meta.start
    );
    let flame = format!(
        "data:image/svg+xml;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(flame_svg)
    );
    Ok(TEMPLATE
        .replace("{{TITLE}}", &escape_html(&title))
        .replace("{{CSS}}", CSS)
        .replace("{{FLAME}}", &flame)
        .replace("{{JS}}", JS)
        .replace("{{DATA}}", &script_json(&data)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::core::tests::recording;

    #[test]
    fn bin_widths_are_round() {
        assert_eq!(bin_width(300.0, 30), 10.0);
        assert_eq!(bin_width(45.0, 30), 2.0);
        assert_eq!(bin_width(0.0, 30), 0.001);
        assert!((bin_width(7.0, 30) - 0.5).abs() < 1e-12);
    }

    #[test]
    fn histogram_counts_every_request() {
        let bins = histogram(&[10_000_000, 12_000_000, 50_000_000]);
        assert_eq!(bins.iter().map(|b| b.n).sum::<usize>(), 3);
        assert_eq!(bins[0].lo, 10.0, "starts at the smallest TTFT's bin");
        assert_eq!(bins[0].hi - bins[0].lo, 2.0);
        assert!(bins.last().expect("bins").hi >= 50.0);
        let same = histogram(&[7_000_000, 7_000_000]);
        assert_eq!(same.len(), 1);
        assert_eq!(same[0].n, 2);
        assert!(histogram(&[]).is_empty());
    }

    #[test]
    fn slowest_requests_come_with_their_breakdown() {
        let mut rec = recording();
        // a 100 ms stall before the last token of request 2
        let t = &mut rec.timelines[1];
        let last = t.chunk_ts.len() - 1;
        t.chunk_ts[last] += 100_000_000;
        t.end += 100_000_000;
        let d = data(&rec);
        assert_eq!(d.slowest.len(), 2);
        let b = d
            .slowest
            .iter()
            .find(|b| b.label.starts_with("#2"))
            .expect("request 2");
        assert_eq!(b.chunks, 4);
        assert_eq!(b.longest_gap_ms, Some(110.0));
        assert_eq!(b.longest_gap_at, Some(3));
        assert_eq!(b.slow_gaps, 1);
        assert_eq!(b.slow_gap_ms, 110.0);
        assert_eq!(b.wait_ms, Some(50.0));
        assert_eq!(b.cpu_samples, Some(0));
        assert_eq!(b.causes, "unexplained 50.0 ms", "the TTFT over 30 ms");
        let first = d
            .slowest
            .iter()
            .find(|b| b.label.starts_with("#1"))
            .expect("request 1");
        assert_eq!(first.cpu_samples, Some(3), "samples inside request 1");
        assert_eq!(d.summary.requests, 2);
        assert_eq!(d.summary.chunks, 7);
        assert_eq!(d.summary.rows[0].name, "TTFT");
        assert_eq!(d.summary.rows[0].p50, Some(50.0));
        assert_eq!(d.waterfall.rows[0].t.len(), 3);
        assert_eq!(d.waterfall.rows[1].s, 500.0);
    }

    #[test]
    fn waterfall_opens_on_the_requests_not_the_session() {
        let mut rec = recording();
        rec.meta.ended_ns += 60_000_000_000; // a minute of nothing after them
        let w = data(&rec).waterfall;
        let first = w.rows.iter().map(|r| r.s).fold(f64::INFINITY, f64::min);
        let last = w.rows.iter().map(|r| r.e).fold(0.0, f64::max);
        let pad = (last - first) * REQUESTS_VIEW_PAD;
        assert!(
            (w.from_ms - (first - pad)).abs() < 1e-3,
            "{} vs {first}",
            w.from_ms
        );
        assert!(
            (w.to_ms - (last + pad)).abs() < 1e-3,
            "{} vs {last}",
            w.to_ms
        );
        assert!(
            w.span_ms > 60_000.0,
            "the session's axis stays one click away"
        );
        assert_eq!(requests_view(&[], 5.0), (0.0, 5.0), "no rows: the session");
    }

    #[test]
    fn a_gateways_hops_are_drawn_one_under_the_other_and_counted_once() {
        let mut rec = recording();
        let ids = |span: u8, parent: Option<u8>| crate::model::TraceIds {
            trace_id: [7; 16],
            span_id: [span; 8],
            parent_span_id: parent.map(|p| [p; 8]),
            parent_remote: false,
            flags: 1,
            tracestate: None,
            join_key: None,
        };
        // the recording's first request is the gateway's; its upstream
        // call and the engine's request come after every other line
        let gateway = rec.timelines[0].clone();
        rec.timelines[0].trace = Some(ids(1, None));
        let mut call = gateway.clone();
        call.kind = SpanKind::Client;
        call.request_start += 1;
        call.trace = Some(ids(2, Some(1)));
        let mut engine = gateway;
        engine.request_start += 2;
        engine.trace = Some(ids(3, Some(2)));
        let servers = rec.timelines.len() + 1;
        rec.timelines.push(engine);
        rec.timelines.push(call);
        let d = data(&rec);
        let last = rec.timelines.len() - 1;
        let order: Vec<(usize, SpanKind)> = d.waterfall.rows[..3]
            .iter()
            .map(|r| (r.d, r.kind))
            .collect();
        assert_eq!(
            order,
            vec![
                (0, SpanKind::Server),
                (1, SpanKind::Client),
                (2, SpanKind::Server)
            ]
        );
        assert_eq!(
            d.waterfall.rows[1].label,
            request_label(last, &rec.timelines[last])
        );
        assert_eq!(
            d.summary.requests, servers,
            "the upstream call is no request of its own"
        );
        assert!(d
            .slowest
            .iter()
            .all(|b| b.label != d.waterfall.rows[1].label));
    }

    #[test]
    fn late_chunks_and_the_longest_gaps_cause_are_named() {
        let mut rec = recording();
        let t = &mut rec.timelines[1];
        let last = t.chunk_ts.len() - 1;
        t.chunk_ts[last] += 100_000_000;
        t.end += 100_000_000;
        t.stalls.push(Stall {
            chunk: last,
            gap_ms: 110.0,
            off_cpu_ms: 100.0,
            off_cpu_reason: Some("futex".into()),
            unexplained_ms: 10.0,
            ..Stall::default()
        });
        let d = data(&rec);
        let row = &d.waterfall.rows[1];
        assert_eq!(
            row.k,
            vec![0, last],
            "the first token (50 ms TTFT) and the stalled one"
        );
        assert!(row.c.starts_with("off-CPU (futex) 100.0 ms"), "{}", row.c);
        let b = d
            .slowest
            .iter()
            .find(|b| b.label.starts_with("#2"))
            .expect("#2");
        assert_eq!(b.longest_gap_at, Some(last));
        assert_eq!(
            b.longest_gap_cause,
            "off-CPU (futex) 100.0 ms · unexplained 10.0 ms"
        );
        let a = d
            .slowest
            .iter()
            .find(|b| b.label.starts_with("#1"))
            .expect("#1");
        assert_eq!(a.longest_gap_cause, "", "no stall on its longest gap");
    }

    #[test]
    fn stall_causes_are_summed_largest_first() {
        let stall = |off_cpu_ms: f64, gpu_sync_ms: f64, reason: Option<&str>| Stall {
            chunk: 1,
            gap_ms: off_cpu_ms + gpu_sync_ms + 1.0,
            gpu_sync_ms,
            off_cpu_ms,
            off_cpu_reason: reason.map(str::to_string),
            unexplained_ms: 1.0,
            ..Stall::default()
        };
        let stalls = [
            stall(80.0, 0.0, Some("futex")),
            stall(5.0, 30.0, Some("sleep")),
        ];
        assert_eq!(
            causes(&stalls),
            "off-CPU (futex) 85.0 ms · GPU sync 30.0 ms · unexplained 2.0 ms"
        );
        assert_eq!(causes(&[]), "");
    }

    #[test]
    fn page_is_self_contained_and_escapes_its_data() {
        let mut rec = recording();
        rec.timelines[0].path = "/x</script><script>alert(1)</script>".into();
        let page = render(&rec, b"<svg/>").expect("render");
        assert!(!page.contains("</script><script>alert"));
        assert!(!page.contains("{{"), "every placeholder filled");
        assert!(page.contains("data:image/svg+xml;base64,PHN2Zy8+"));
        for external in ["http://", "https://", "src=\"//"] {
            assert!(
                !page.replace("http://www.w3.org", "").contains(external),
                "no external resource: {external}"
            );
        }
    }
}
