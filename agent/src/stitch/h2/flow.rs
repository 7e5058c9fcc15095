//! HTTP/2 flow control as the server lives it (RFC 9113 §5.2): every DATA
//! frame it writes spends its send window on the stream and on the
//! connection, and only the client's WINDOW_UPDATE (or a larger
//! SETTINGS_INITIAL_WINDOW_SIZE) gives it more. A window used up is a stall
//! the server cannot do anything about: the client is not reading.
//!
//! A wait is the interval from the write that used a window up to the
//! read of the update that reopened it, charged to a stream only when the
//! stream then writes again (so a response that just fit is not a stall).
//! A connection window wait is charged to every stream that was open
//! across it and writes after it.

use std::collections::BTreeMap;

use crate::event::MonoNs;

/// RFC 9113 §6.9.2: every window starts at 65,535 octets.
const DEFAULT_WINDOW: i64 = 65_535;

#[derive(Debug, Clone, Default)]
struct StreamWindow {
    window: i64,
    /// The write that used the window up.
    blocked: Option<MonoNs>,
    /// A wait that ended, not yet charged (charged at the next write).
    pending: Option<(MonoNs, MonoNs)>,
    /// Since when the stream has been waiting to write: its last DATA
    /// write, or its opening.
    active_since: MonoNs,
    /// End of the last connection wait charged to it.
    charged_until: MonoNs,
}

#[derive(Debug, Clone)]
pub(crate) struct Windows {
    /// The client's SETTINGS_INITIAL_WINDOW_SIZE.
    initial: i64,
    conn: i64,
    conn_blocked: Option<MonoNs>,
    last_conn_wait: Option<(MonoNs, MonoNs)>,
    streams: BTreeMap<u32, StreamWindow>,
}

impl Default for Windows {
    fn default() -> Self {
        Self {
            initial: DEFAULT_WINDOW,
            conn: DEFAULT_WINDOW,
            conn_blocked: None,
            last_conn_wait: None,
            streams: BTreeMap::new(),
        }
    }
}

impl Windows {
    pub(crate) fn stream_opened(&mut self, id: u32, ts: MonoNs) {
        self.streams.insert(
            id,
            StreamWindow {
                window: self.initial,
                active_since: ts,
                ..StreamWindow::default()
            },
        );
    }

    pub(crate) fn stream_closed(&mut self, id: u32) {
        self.streams.remove(&id);
    }

    /// The server writes a DATA frame of `len` bytes on stream `id` at
    /// `ts`; returns the waits this write ends for the stream.
    pub(crate) fn server_data(&mut self, id: u32, len: u32, ts: MonoNs) -> Vec<(MonoNs, MonoNs)> {
        let len = i64::from(len);
        self.conn -= len;
        if len > 0 && self.conn <= 0 {
            self.conn_blocked.get_or_insert(ts);
        }
        let mut waits = Vec::new();
        let Some(s) = self.streams.get_mut(&id) else {
            return waits;
        };
        if let Some(wait) = s.pending.take() {
            waits.push(wait);
        }
        if let Some((from, to)) = self.last_conn_wait {
            if s.active_since <= from && s.charged_until < to && ts >= to {
                if !waits.contains(&(from, to)) {
                    waits.push((from, to));
                }
                s.charged_until = to;
            }
        }
        s.window -= len;
        if len > 0 && s.window <= 0 {
            s.blocked.get_or_insert(ts);
        }
        s.active_since = ts;
        waits
    }

    /// The client's WINDOW_UPDATE of `increment` for stream `id` (0: the
    /// connection), read at `ts`.
    pub(crate) fn window_update(&mut self, id: u32, increment: u32, ts: MonoNs) {
        let increment = i64::from(increment);
        if id == 0 {
            self.conn += increment;
            if self.conn > 0 {
                if let Some(from) = self.conn_blocked.take() {
                    self.last_conn_wait = Some((from, ts));
                }
            }
        } else if let Some(s) = self.streams.get_mut(&id) {
            s.window += increment;
            s.reopen(ts);
        }
    }

    /// The client changed SETTINGS_INITIAL_WINDOW_SIZE (read at `ts`):
    /// every stream window moves by the difference (§6.9.2).
    pub(crate) fn set_initial_stream_window(&mut self, value: u32, ts: MonoNs) {
        let value = i64::from(value.min(0x7fff_ffff));
        let delta = value - self.initial;
        self.initial = value;
        for s in self.streams.values_mut() {
            s.window += delta;
            s.reopen(ts);
        }
    }
}

impl StreamWindow {
    fn reopen(&mut self, ts: MonoNs) {
        if self.window > 0 {
            if let Some(from) = self.blocked.take() {
                self.pending = Some((from, ts));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_window_used_up_and_reopened_is_a_wait_when_the_stream_writes_again() {
        let mut w = Windows::default();
        w.stream_opened(1, 0);
        assert!(w.server_data(1, 60_000, 10).is_empty());
        assert!(w.server_data(1, 5_535, 20).is_empty()); // window now 0
        w.window_update(1, 30_000, 70);
        w.window_update(0, 30_000, 70);
        assert_eq!(w.server_data(1, 100, 75), vec![(20, 70)]);
        // Charged once.
        assert!(w.server_data(1, 100, 80).is_empty());
    }

    #[test]
    fn a_response_that_just_fits_is_no_wait() {
        let mut w = Windows::default();
        w.stream_opened(3, 0);
        w.server_data(3, 65_535, 10);
        w.window_update(3, 65_535, 50);
        w.stream_closed(3);
        assert!(w.server_data(3, 10, 60).is_empty());
    }

    #[test]
    fn a_connection_wait_is_charged_to_every_stream_open_across_it() {
        let mut w = Windows::default();
        w.set_initial_stream_window(1 << 20, 0);
        w.stream_opened(1, 0);
        w.stream_opened(3, 5);
        w.server_data(1, 40_000, 10);
        w.server_data(3, 25_535, 20); // connection window used up at 20
        w.window_update(0, 1 << 20, 90);
        assert_eq!(w.server_data(3, 10, 95), vec![(20, 90)]);
        assert_eq!(w.server_data(1, 10, 96), vec![(20, 90)]);
        // A stream opened after the wait began was not held by it.
        w.stream_opened(5, 50);
        assert!(w.server_data(5, 10, 97).is_empty());
    }

    #[test]
    fn a_larger_initial_window_reopens_blocked_streams() {
        let mut w = Windows::default();
        w.stream_opened(1, 0);
        w.server_data(1, 65_535, 10);
        w.set_initial_stream_window(131_070, 40);
        w.window_update(0, 1 << 20, 40);
        assert_eq!(w.server_data(1, 1, 41), vec![(10, 40)]);
    }
}
