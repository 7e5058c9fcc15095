//! One request drawn as a waterfall: its phases as bars on one time axis
//! (arrival at the host → end), every chunk as a tick with the late ones
//! marked `!`, and each late chunk's causes.

use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Paragraph};
use ratatui::Frame;

use super::format;
use crate::live::SlowRequest;

/// Width of the phase labels before the bars.
const LABEL: usize = 16;

pub fn draw(f: &mut Frame<'_>, r: &SlowRequest, now_ns: u64) {
    let [body, keys] =
        Layout::vertical([Constraint::Min(8), Constraint::Length(1)]).areas(f.area());
    let inner = usize::from(body.width.saturating_sub(2));
    let bar_width = inner.saturating_sub(LABEL + 12).max(10);
    let title = format!(
        " {}[{}] {} {} {} — id {} — model {} — ended {} ago ",
        r.comm,
        r.pid,
        r.method,
        r.route,
        r.status.map_or("-".to_string(), |s| s.to_string()),
        r.request_id.as_deref().unwrap_or("-"),
        r.model.as_deref().unwrap_or("-"),
        format::ago(now_ns, r.end_ns),
    );
    let lines = lines(r, bar_width);
    f.render_widget(
        Paragraph::new(lines).block(Block::bordered().title(title)),
        body,
    );
    f.render_widget(
        Paragraph::new(" Esc back  q quit")
            .style(Style::default().add_modifier(Modifier::REVERSED)),
        keys,
    );
}

/// The waterfall's text, `width` columns for the bars.
pub fn lines(r: &SlowRequest, width: usize) -> Vec<Line<'static>> {
    let total = r.e2e_ms.max(1e-3);
    let col = |ms: f64| {
        ((ms / total) * width as f64)
            .round()
            .clamp(0.0, width as f64) as usize
    };
    let bar = |from: f64, to: f64, fill: char| {
        let (a, b) = (col(from), col(to).max(col(from) + 1).min(width));
        format!(
            "{}{}{}",
            " ".repeat(a),
            fill.to_string().repeat(b.saturating_sub(a)),
            " ".repeat(width - b.max(a))
        )
    };
    let mut out = vec![Line::from(format!(
        " arrival → end {} ms   TTFT {} ms   {} chunks   worst gap {} ms{}{}",
        format::ms(Some(r.e2e_ms)),
        format::ms(r.ttft_ms),
        r.chunks,
        format::ms(r.worst_gap_ms),
        r.worst_gap_chunk
            .map_or(String::new(), |c| format!(" before chunk {c}")),
        r.worst_gap_cause
            .as_ref()
            .map_or(String::new(), |c| format!(" ({c})")),
    ))];
    let socket = r.socket_wait_ms.unwrap_or(0.0);
    let read_end = socket + r.reading_ms;
    let first = r.ttft_ms.unwrap_or(r.e2e_ms);
    out.push(Line::from(format!(
        " {:<LABEL$}0 ms{:>w$}",
        "",
        format!("{} ms", format::ms(Some(r.e2e_ms))),
        w = width.saturating_sub(4)
    )));
    let mut phase = |label: &str, from: f64, to: f64, fill: char, ms: Option<f64>| {
        out.push(Line::from(format!(
            " {label:<LABEL$}{}  {:>8}",
            bar(from, to, fill),
            format::ms(ms)
        )));
    };
    phase("in the socket", 0.0, socket, '░', r.socket_wait_ms);
    phase("reading", socket, read_end, '▒', Some(r.reading_ms));
    phase("to first token", read_end, first, '▓', r.to_first_token_ms);
    phase("stream", first, r.e2e_ms, '█', r.stream_ms);
    let mut ticks = vec![' '; width];
    let tick = |ms: f32| col(f64::from(ms)).min(width - 1);
    for &offset in &r.chunk_offsets_ms {
        ticks[tick(offset)] = '|';
    }
    for s in &r.stalls {
        if let Some(&offset) = r.chunk_offsets_ms.get(s.chunk) {
            ticks[tick(offset)] = '!';
        }
    }
    let ticks: String = ticks.into_iter().collect();
    out.push(Line::from(format!(" {:<LABEL$}{ticks}", "chunks (! late)")));
    if let (Some(a), Some(t)) = (r.accept_wait_ms, r.tls_handshake_ms) {
        out.push(Line::from(format!(
            " before the request: accept wait {} ms, TLS handshake {} ms",
            format::ms(Some(a)),
            format::ms(Some(t))
        )));
    } else if let Some(a) = r.accept_wait_ms {
        out.push(Line::from(format!(
            " before the request: accept wait {} ms",
            format::ms(Some(a))
        )));
    }
    if r.stalls.is_empty() {
        out.push(Line::from(" late tokens: none"));
    }
    for s in &r.stalls {
        let causes: Vec<String> = s
            .causes
            .iter()
            .map(|(c, ms)| format!("{c} {}", format::ms(Some(*ms))))
            .collect();
        out.push(Line::from(format!(
            " late chunk {} at {} ms: gap {} ms — {}",
            s.chunk,
            format::ms(Some(s.start_ms + s.gap_ms)),
            format::ms(Some(s.gap_ms)),
            causes.join(", ")
        )));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live::StallBrief;

    #[test]
    fn phases_line_up_on_one_axis_and_late_chunks_are_marked() {
        let r = SlowRequest {
            e2e_ms: 100.0,
            ttft_ms: Some(50.0),
            socket_wait_ms: Some(10.0),
            reading_ms: 10.0,
            to_first_token_ms: Some(30.0),
            stream_ms: Some(50.0),
            chunks: 3,
            chunk_offsets_ms: vec![50.0, 60.0, 100.0],
            stalls: vec![StallBrief {
                chunk: 2,
                start_ms: 60.0,
                gap_ms: 40.0,
                cause: "off_cpu (sleep)".into(),
                causes: vec![("off_cpu (sleep)".into(), 39.0)],
            }],
            ..SlowRequest::default()
        };
        let text: Vec<String> = lines(&r, 50).iter().map(ToString::to_string).collect();
        let bar = |label: &str| {
            let line = text.iter().find(|l| l.contains(label)).expect(label);
            let bars = &line[1 + LABEL..];
            let start = bars.chars().position(|c| c != ' ').unwrap_or(0);
            let len = bars.chars().skip(start).take_while(|c| *c != ' ').count();
            (start, len)
        };
        assert_eq!(bar("in the socket"), (0, 5));
        assert_eq!(bar("reading"), (5, 5));
        assert_eq!(bar("to first token"), (10, 15));
        assert_eq!(bar("stream"), (25, 25));
        let ticks = text
            .iter()
            .find(|l| l.contains("chunks (! late)"))
            .expect("ticks");
        assert_eq!(ticks.matches('|').count(), 2, "{ticks}");
        assert!(
            text.iter()
                .any(|l| l.contains("late chunk 2 at 100 ms: gap 40.0 ms — off_cpu (sleep) 39.0")),
            "{text:?}"
        );
    }
}
