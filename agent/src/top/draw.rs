//! One frame of the live view: a title line, the services table, the
//! slowest recent requests, the agent's line, the status line and the
//! keys, or one request's waterfall.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Cell, Paragraph, Row, Table, TableState};
use ratatui::Frame;

use super::format;
use super::view::{Focus, View, COLUMNS};
use crate::live::{AgentStatus, SlowRequest};

const KEYS: &str =
    " ←/→ sort column  r reverse  Tab routes/slowest  ↑/↓ select  Enter waterfall  Esc back  q quit";

pub fn frame(f: &mut Frame<'_>, view: &View, source: &str) {
    if let Some(request) = &view.waterfall {
        super::waterfall::draw(f, request, view.latest().map_or(0, |s| s.at_ns));
        return;
    }
    let window = view.window();
    let route_rows = window.as_ref().map_or(0, |w| w.rows.len()).max(1) as u16;
    let [title, routes, slowest, agent, status, keys] = Layout::vertical([
        Constraint::Length(1),
        // the routes fit (up to half the screen), the slowest take the rest
        Constraint::Max(route_rows + 3),
        Constraint::Min(4),
        Constraint::Length(2),
        Constraint::Length(1),
        Constraint::Length(1),
    ])
    .areas(f.area());
    let covered = window.as_ref().map_or(0.0, |w| w.seconds);
    let sort = format!(
        "{} {}",
        COLUMNS[view.sort].name,
        if view.descending { "↓" } else { "↑" }
    );
    f.render_widget(
        Paragraph::new(format!(
            " tokentrace top — {source} — window {} (covering {covered:.0} s) — sorted by {sort} — ms",
            humantime::format_duration(view.window)
        ))
        .style(Style::default().add_modifier(Modifier::BOLD)),
        title,
    );
    routes_table(f, routes, view, window.map(|w| w.rows).unwrap_or_default());
    slowest_table(f, slowest, view);
    f.render_widget(Paragraph::new(agent_lines(view)), agent);
    f.render_widget(Paragraph::new(format!(" {}", view.status)), status);
    f.render_widget(
        Paragraph::new(KEYS).style(Style::default().add_modifier(Modifier::REVERSED)),
        keys,
    );
}

fn focused(view: &View, which: Focus, title: &str) -> Block<'static> {
    let block = Block::bordered().title(title.to_string());
    if view.focus == which {
        block.border_style(Style::default().add_modifier(Modifier::BOLD))
    } else {
        block
    }
}

fn routes_table(
    f: &mut Frame<'_>,
    area: Rect,
    view: &View,
    rows: Vec<crate::live::window::RouteRow>,
) {
    let header = Row::new(COLUMNS.iter().enumerate().map(|(i, c)| {
        let name = if i == view.sort {
            format!("{}{}", c.name, if view.descending { "↓" } else { "↑" })
        } else {
            c.name.to_string()
        };
        aligned(name, c.width, c.numeric)
    }))
    .style(Style::default().add_modifier(Modifier::BOLD));
    let body: Vec<Row> = rows
        .iter()
        .map(|r| {
            Row::new(
                COLUMNS
                    .iter()
                    .map(|c| aligned((c.cell)(r), c.width, c.numeric)),
            )
        })
        .collect();
    let widths = COLUMNS.iter().map(|c| Constraint::Length(c.width));
    let mut state = TableState::default();
    if view.focus == Focus::Routes && !rows.is_empty() {
        state.select(Some(view.route_selected.min(rows.len() - 1)));
    }
    let title = format!(" services × model × route ({} rows) ", rows.len());
    let table = Table::new(body, widths)
        .header(header)
        .block(focused(view, Focus::Routes, &title))
        .row_highlight_style(Style::default().add_modifier(Modifier::REVERSED));
    f.render_stateful_widget(table, area, &mut state);
}

/// Columns of the slowest table: (header, width, numeric).
const SLOW_COLUMNS: &[(&str, u16, bool)] = &[
    ("TTFT", 7, true),
    ("SOCKET", 7, true),
    ("ACCEPT", 7, true),
    ("TLS", 6, true),
    ("READ", 6, true),
    ("TO1ST", 7, true),
    ("STREAM", 7, true),
    ("GAP", 7, true),
    ("GAP CAUSE", 22, false),
    ("CHUNKS", 6, true),
    ("ROUTE", 34, false),
    ("ID", 16, false),
    ("AGO", 5, true),
];

fn slow_cells(r: &SlowRequest, now_ns: u64) -> [String; 13] {
    let ms = |v: Option<f64>| format::ms(v);
    [
        ms(r.ttft_ms),
        ms(r.socket_wait_ms),
        ms(r.accept_wait_ms),
        ms(r.tls_handshake_ms),
        ms(Some(r.reading_ms)),
        ms(r.to_first_token_ms),
        ms(r.stream_ms),
        ms(r.worst_gap_ms),
        r.worst_gap_cause.clone().unwrap_or_else(|| "-".into()),
        r.chunks.to_string(),
        format!("{} {}", r.method, r.route),
        r.request_id.clone().unwrap_or_else(|| "-".into()),
        format::ago(now_ns, r.end_ns),
    ]
}

fn slowest_table(f: &mut Frame<'_>, area: Rect, view: &View) {
    let now = view.latest().map_or(0, |s| s.at_ns);
    let header = Row::new(
        SLOW_COLUMNS
            .iter()
            .map(|(name, width, numeric)| aligned((*name).to_string(), *width, *numeric)),
    )
    .style(Style::default().add_modifier(Modifier::BOLD));
    let rows: Vec<Row> = view
        .slowest()
        .iter()
        .map(|r| {
            Row::new(
                slow_cells(r, now)
                    .into_iter()
                    .zip(SLOW_COLUMNS)
                    .map(|(cell, (_, width, numeric))| aligned(cell, *width, *numeric)),
            )
        })
        .collect();
    let mut state = TableState::default();
    if view.focus == Focus::Slowest && !rows.is_empty() {
        state.select(Some(view.slow_selected.min(rows.len() - 1)));
    }
    let table = Table::new(rows, SLOW_COLUMNS.iter().map(|c| Constraint::Length(c.1)))
        .header(header)
        .block(focused(
            view,
            Focus::Slowest,
            " slowest recent requests (by TTFT or worst gap, whichever is longer) ",
        ))
        .row_highlight_style(Style::default().add_modifier(Modifier::REVERSED));
    f.render_stateful_widget(table, area, &mut state);
}

/// A cell padded so numbers line up on the right.
fn aligned(text: String, width: u16, numeric: bool) -> Cell<'static> {
    let width = usize::from(width);
    let text = truncate(&text, width);
    if numeric {
        Cell::from(format!("{text:>width$}"))
    } else {
        Cell::from(text)
    }
}

fn truncate(text: &str, width: usize) -> String {
    if text.chars().count() <= width {
        return text.to_string();
    }
    let mut cut: String = text.chars().take(width.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

fn agent_lines(view: &View) -> Vec<Line<'static>> {
    let Some(now) = view.latest() else {
        return vec![Line::from(" agent: starting…")];
    };
    let a: &AgentStatus = &now.agent;
    let (events_per_s, cpu) = match view.previous() {
        Some(before) => {
            let seconds = (now.at_ns.saturating_sub(before.at_ns) as f64 / 1e9).max(1e-3);
            let events = a
                .events_received
                .saturating_sub(before.agent.events_received);
            let cpu = a.cpu_ns.saturating_sub(before.agent.cpu_ns) as f64 / 1e9 / seconds;
            (events as f64 / seconds, cpu * 100.0)
        }
        None => (0.0, 0.0),
    };
    let mut lines = vec![Line::from(format!(
        " agent pid {}: {} events/s, {} lost, CPU {cpu:.1}%, RSS {}, probes: {} kernel programs, {} uprobe links, {} failed, {} connections",
        a.pid,
        format::rate(events_per_s),
        a.events_lost,
        format::bytes(a.rss_bytes),
        a.kernel_programs,
        a.uprobe_links,
        a.attach_failures,
        a.open_connections,
    ))];
    if let Some(last) = a.failed.last() {
        lines.push(Line::from(format!(" last probe failure: {last}")));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live::{Buckets, RouteTotals, TopSnapshot};
    use ratatui::backend::TestBackend;
    use ratatui::Terminal;

    pub(crate) fn screen(view: &View, width: u16, height: u16) -> String {
        let mut terminal = Terminal::new(TestBackend::new(width, height)).expect("terminal");
        terminal.draw(|f| frame(f, view, "local")).expect("draw");
        let buffer = terminal.backend().buffer();
        (0..height)
            .map(|y| {
                (0..width)
                    .map(|x| buffer[(x, y)].symbol().to_string())
                    .collect::<String>()
                    .trim_end()
                    .to_string()
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn a_frame_shows_the_rows_the_slowest_and_the_agent() {
        let mut view = View::new(std::time::Duration::from_secs(30));
        let mut ttft = crate::export::Histogram::new(crate::export::TTFT_BOUNDS);
        for _ in 0..10 {
            ttft.observe(0.045);
        }
        let mut b = Buckets::default();
        b.add(&ttft);
        view.push(TopSnapshot {
            at_ns: 20_000_000_000,
            started_ns: 10_000_000_000,
            routes: vec![RouteTotals {
                service: "python3".into(),
                model: Some("m".into()),
                route: Some("/v1/chat/completions".into()),
                requests: 10,
                ttft: b,
                stall_seconds: [("off_cpu".to_string(), 0.3)].into_iter().collect(),
                ..RouteTotals::default()
            }],
            slowest: vec![SlowRequest {
                end_ns: 19_000_000_000,
                method: "POST".into(),
                route: "/v1/chat/completions".into(),
                ttft_ms: Some(45.0),
                worst_gap_ms: Some(402.5),
                worst_gap_cause: Some("off_cpu (sleep)".into()),
                request_id: Some("rid-7".into()),
                ..SlowRequest::default()
            }],
            agent: AgentStatus {
                pid: 77,
                kernel_programs: 27,
                ..AgentStatus::default()
            },
        });
        let text = screen(&view, 200, 20);
        let row = text
            .lines()
            .find(|l| l.contains("/v1/chat/completions") && l.contains("python3"))
            .unwrap_or_else(|| panic!("no route row:\n{text}"));
        let fields: Vec<&str> = row.split_whitespace().collect();
        // REQ/S over the 10 s the agent has run, N, then TTFT p50 in (40, 50]
        assert!(fields.contains(&"1.0") && fields.contains(&"10"), "{row}");
        assert!(
            row.contains("45.0") || row.contains("42.5") || row.contains("47.5"),
            "{row}"
        );
        assert!(row.contains("off_cpu 100%"), "{row}");
        assert!(
            text.contains("off_cpu (sleep)") && text.contains("rid-7"),
            "{text}"
        );
        assert!(text.contains("27 kernel programs"), "{text}");
        assert!(text.contains("q quit"), "{text}");
    }
}
