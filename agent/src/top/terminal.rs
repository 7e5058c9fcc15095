//! The terminal while the live view runs: raw mode and the alternate
//! screen, left again however the view ends (quit, error, panic).

use std::io::{IsTerminal, Stdout};

use anyhow::{bail, Context, Result};
use ratatui::backend::CrosstermBackend;
use ratatui::crossterm::execute;
use ratatui::crossterm::terminal::{
    disable_raw_mode, enable_raw_mode, EnterAlternateScreen, LeaveAlternateScreen,
};
use ratatui::Terminal;

/// Refuses to start without a terminal on both ends: `top | cat` or a
/// cron job would get escape codes, not a view.
pub fn require_tty() -> Result<()> {
    if !std::io::stdout().is_terminal() || !std::io::stdin().is_terminal() {
        bail!(
            "tokentrace top needs a terminal (stdin and stdout are not both one); \
             for machine-readable output use `tokentrace run --output json`"
        );
    }
    Ok(())
}

/// The full-screen terminal; dropping it restores the shell's screen.
pub struct Screen {
    pub terminal: Terminal<CrosstermBackend<Stdout>>,
}

impl Screen {
    pub fn enter() -> Result<Self> {
        enable_raw_mode().context("switching the terminal to raw mode")?;
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            leave();
            previous(info);
        }));
        let mut stdout = std::io::stdout();
        if let Err(err) = execute!(stdout, EnterAlternateScreen) {
            leave();
            return Err(err).context("entering the alternate screen");
        }
        let terminal = Terminal::new(CrosstermBackend::new(stdout)).context("the terminal")?;
        Ok(Self { terminal })
    }
}

fn leave() {
    let _ = disable_raw_mode();
    let _ = execute!(std::io::stdout(), LeaveAlternateScreen);
}

impl Drop for Screen {
    fn drop(&mut self) {
        let _ = self.terminal.show_cursor();
        leave();
    }
}
