//! The live view's state between frames: the snapshots of the window,
//! the sort, which table has the focus and which row is selected, and
//! whether one request's waterfall is open. Keys change it; drawing
//! reads it.

use std::collections::VecDeque;
use std::time::Duration;

use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};

use crate::live::window::{window, RouteRow, Window};
use crate::live::{SlowRequest, TopSnapshot};
use crate::units::nanos;

/// A column of the services table: its header, width and sort key.
pub struct Column {
    pub name: &'static str,
    pub width: u16,
    /// Right-aligned numbers; text columns are left-aligned.
    pub numeric: bool,
    pub cell: fn(&RouteRow) -> String,
    pub key: fn(&RouteRow) -> SortKey,
}

#[derive(Debug, Clone, PartialEq, PartialOrd)]
pub enum SortKey {
    Text(String),
    Number(f64),
}

fn number(v: Option<f64>) -> SortKey {
    SortKey::Number(v.unwrap_or(f64::NEG_INFINITY))
}

fn text(v: Option<&str>) -> String {
    v.unwrap_or("-").to_string()
}

/// A column of milliseconds (a percentile; `-` without observations).
macro_rules! ms_column {
    ($name:literal, $width:literal, $field:ident) => {
        Column {
            name: $name,
            width: $width,
            numeric: true,
            cell: |r| super::format::ms(r.$field),
            key: |r| number(r.$field),
        }
    };
}

/// A column of a count.
macro_rules! count_column {
    ($name:literal, $width:literal, $field:ident) => {
        Column {
            name: $name,
            width: $width,
            numeric: true,
            cell: |r| r.$field.to_string(),
            key: |r| SortKey::Number(r.$field as f64),
        }
    };
}

/// Every column, in screen order.
pub const COLUMNS: &[Column] = &[
    Column {
        name: "SERVICE",
        width: 14,
        numeric: false,
        cell: |r| r.service.clone(),
        key: |r| SortKey::Text(r.service.clone()),
    },
    Column {
        name: "MODEL",
        width: 16,
        numeric: false,
        cell: |r| text(r.model.as_deref()),
        key: |r| SortKey::Text(text(r.model.as_deref())),
    },
    Column {
        name: "ROUTE",
        width: 24,
        numeric: false,
        cell: |r| {
            if r.overflow {
                "(other routes)".to_string()
            } else {
                text(r.route.as_deref())
            }
        },
        key: |r| SortKey::Text(text(r.route.as_deref())),
    },
    Column {
        name: "REQ/S",
        width: 7,
        numeric: true,
        cell: |r| super::format::rate(r.requests_per_s),
        key: |r| SortKey::Number(r.requests_per_s),
    },
    count_column!("N", 7, requests),
    count_column!("WAIT1ST", 7, in_flight_first_token),
    count_column!("STREAM", 6, in_flight_streaming),
    ms_column!("TTFT50", 7, ttft_p50),
    ms_column!("TTFT95", 7, ttft_p95),
    ms_column!("TTFT99", 7, ttft_p99),
    ms_column!("ITL50", 6, itl_p50),
    ms_column!("ITL99", 6, itl_p99),
    ms_column!("SOCK95", 6, socket_wait_p95),
    Column {
        name: "CANC/S",
        width: 6,
        numeric: true,
        cell: |r| super::format::rate(r.cancellations_per_s),
        key: |r| SortKey::Number(r.cancellations_per_s),
    },
    Column {
        name: "STALLS",
        width: 30,
        numeric: false,
        cell: |r| super::format::shares(&r.stall_share),
        key: |r| SortKey::Number(r.stall_seconds),
    },
];

/// The column sorted by at start: TTFT p95, slowest first.
const DEFAULT_SORT: usize = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Focus {
    Routes,
    Slowest,
}

pub struct View {
    pub window: Duration,
    /// Snapshots, oldest first, reaching back at least `window`.
    history: VecDeque<TopSnapshot>,
    pub sort: usize,
    pub descending: bool,
    pub focus: Focus,
    pub route_selected: usize,
    pub slow_selected: usize,
    /// The request whose waterfall is open.
    pub waterfall: Option<SlowRequest>,
    /// Shown in the status line (a failed fetch, the agent's last line).
    pub status: String,
    pub quit: bool,
}

impl View {
    pub fn new(window: Duration) -> Self {
        Self {
            window,
            history: VecDeque::new(),
            sort: DEFAULT_SORT,
            descending: true,
            focus: Focus::Routes,
            route_selected: 0,
            slow_selected: 0,
            waterfall: None,
            status: String::new(),
            quit: false,
        }
    }

    pub fn push(&mut self, snapshot: TopSnapshot) {
        let keep_from = snapshot.at_ns.saturating_sub(nanos(self.window));
        self.history.push_back(snapshot);
        // keep one snapshot at or before the window's start: the base
        while self.history.len() > 2 && self.history[1].at_ns <= keep_from {
            self.history.pop_front();
        }
    }

    pub fn latest(&self) -> Option<&TopSnapshot> {
        self.history.back()
    }

    /// The snapshot before the latest, for per-second rates.
    pub fn previous(&self) -> Option<&TopSnapshot> {
        self.history.iter().rev().nth(1)
    }

    /// The window's rows, sorted. Its base is the newest snapshot at or
    /// before the window's start; while the agent is younger than the
    /// window, zero at its start; otherwise the oldest one held (the
    /// viewer started later: a shorter window, which `seconds` says).
    pub fn window(&self) -> Option<Window> {
        let now = self.latest()?;
        let start = now.at_ns.saturating_sub(nanos(self.window));
        let base = if now.started_ns >= start {
            None
        } else {
            self.history
                .iter()
                .rev()
                .find(|s| s.at_ns <= start)
                .or_else(|| self.history.front())
                .filter(|s| s.at_ns < now.at_ns)
        };
        let mut w = window(base, now);
        let column = &COLUMNS[self.sort];
        w.rows.sort_by(|a, b| {
            let order = (column.key)(a)
                .partial_cmp(&(column.key)(b))
                .unwrap_or(std::cmp::Ordering::Equal);
            if self.descending {
                order.reverse()
            } else {
                order
            }
        });
        Some(w)
    }

    pub fn slowest(&self) -> &[SlowRequest] {
        self.latest().map_or(&[], |s| s.slowest.as_slice())
    }

    /// Carries out one key.
    pub fn key(&mut self, key: KeyEvent) {
        let ctrl_c =
            key.modifiers.contains(KeyModifiers::CONTROL) && key.code == KeyCode::Char('c');
        if ctrl_c || key.code == KeyCode::Char('q') {
            self.quit = true;
            return;
        }
        if self.waterfall.is_some() {
            if matches!(key.code, KeyCode::Esc | KeyCode::Backspace | KeyCode::Enter) {
                self.waterfall = None;
            }
            return;
        }
        let rows = self.window().map_or(0, |w| w.rows.len());
        let slow = self.slowest().len();
        match key.code {
            KeyCode::Left | KeyCode::Char('<') => {
                self.sort = self.sort.checked_sub(1).unwrap_or(COLUMNS.len() - 1);
            }
            KeyCode::Right | KeyCode::Char('>') => self.sort = (self.sort + 1) % COLUMNS.len(),
            KeyCode::Char('r') => self.descending = !self.descending,
            KeyCode::Tab | KeyCode::BackTab => {
                self.focus = match self.focus {
                    Focus::Routes => Focus::Slowest,
                    Focus::Slowest => Focus::Routes,
                };
            }
            KeyCode::Up => match self.focus {
                Focus::Routes => self.route_selected = self.route_selected.saturating_sub(1),
                Focus::Slowest => self.slow_selected = self.slow_selected.saturating_sub(1),
            },
            KeyCode::Down => match self.focus {
                Focus::Routes => {
                    self.route_selected = (self.route_selected + 1).min(rows.saturating_sub(1));
                }
                Focus::Slowest => {
                    self.slow_selected = (self.slow_selected + 1).min(slow.saturating_sub(1));
                }
            },
            KeyCode::Enter => {
                let pick = self.slow_selected.min(slow.saturating_sub(1));
                self.waterfall = self.slowest().get(pick).cloned();
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live::RouteTotals;

    fn snapshot(at_s: u64, requests: u64) -> TopSnapshot {
        TopSnapshot {
            at_ns: at_s * 1_000_000_000,
            started_ns: 0,
            routes: vec![
                RouteTotals {
                    service: "a".into(),
                    requests,
                    ..RouteTotals::default()
                },
                RouteTotals {
                    service: "b".into(),
                    requests: 2 * requests,
                    ..RouteTotals::default()
                },
            ],
            ..TopSnapshot::default()
        }
    }

    fn press(view: &mut View, code: KeyCode) {
        view.key(KeyEvent::new(code, KeyModifiers::NONE));
    }

    #[test]
    fn the_window_slides_and_any_column_sorts() {
        let mut view = View::new(Duration::from_secs(10));
        for s in 1..=40 {
            view.push(snapshot(s, s * 10));
        }
        let w = view.window().expect("window");
        assert_eq!(w.seconds, 10.0);
        // sorted by REQ/S, slowest first
        view.sort = 3;
        let w = view.window().expect("window");
        let got: Vec<(&str, u64)> = w
            .rows
            .iter()
            .map(|r| (r.service.as_str(), r.requests))
            .collect();
        assert_eq!(got, vec![("b", 200), ("a", 100)]);
        press(&mut view, KeyCode::Char('r'));
        assert_eq!(view.window().expect("window").rows[0].service, "a");
        press(&mut view, KeyCode::Left);
        assert_eq!(COLUMNS[view.sort].name, "ROUTE");
        assert!(view.history.len() <= 12, "{}", view.history.len());
    }

    #[test]
    fn a_young_agent_counts_from_its_start() {
        let mut view = View::new(Duration::from_secs(30));
        view.push(snapshot(5, 50));
        let w = view.window().expect("window");
        assert_eq!(
            (w.seconds, w.rows[0].requests + w.rows[1].requests),
            (5.0, 150)
        );
    }

    #[test]
    fn enter_opens_the_selected_request_and_esc_and_q_do_what_they_say() {
        let mut view = View::new(Duration::from_secs(30));
        let mut s = snapshot(5, 50);
        s.slowest = vec![
            SlowRequest {
                route: "/a".into(),
                ..SlowRequest::default()
            },
            SlowRequest {
                route: "/b".into(),
                ..SlowRequest::default()
            },
        ];
        view.push(s);
        press(&mut view, KeyCode::Tab);
        press(&mut view, KeyCode::Down);
        press(&mut view, KeyCode::Down);
        press(&mut view, KeyCode::Enter);
        assert_eq!(
            view.waterfall.as_ref().map(|r| r.route.as_str()),
            Some("/b")
        );
        press(&mut view, KeyCode::Esc);
        assert!(view.waterfall.is_none() && !view.quit);
        press(&mut view, KeyCode::Char('q'));
        assert!(view.quit);
    }
}
