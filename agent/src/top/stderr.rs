//! The agent's messages while the live view owns the terminal: stderr
//! (the ready line, warnings, the log) goes into a pipe instead of over
//! the screen. The last line shows in the status line; all of them are
//! written to the real stderr once the view is gone.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::{Context, Result};

/// Lines kept for the replay at exit.
const KEEP_LINES: usize = 500;

pub struct StderrCapture {
    /// The real stderr, put back by [`Self::restore`].
    saved: Option<OwnedFd>,
    lines: Arc<Mutex<VecDeque<String>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl StderrCapture {
    pub fn start() -> Result<Self> {
        let mut fds = [0; 2];
        // SAFETY: a valid array of two ints for pipe2 to fill.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error()).context("a pipe for stderr");
        }
        // SAFETY: pipe2 returned two fresh descriptors we now own.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: dup of our own stderr; the result is ours.
        let saved = unsafe { libc::fcntl(libc::STDERR_FILENO, libc::F_DUPFD_CLOEXEC, 3) };
        if saved < 0 {
            return Err(std::io::Error::last_os_error()).context("saving stderr");
        }
        // SAFETY: saved is a fresh descriptor we own.
        let saved = unsafe { OwnedFd::from_raw_fd(saved) };
        // SAFETY: both descriptors are open; dup2 replaces fd 2.
        if unsafe { libc::dup2(write.as_raw_fd(), libc::STDERR_FILENO) } < 0 {
            return Err(std::io::Error::last_os_error()).context("redirecting stderr");
        }
        drop(write);
        let lines = Arc::new(Mutex::new(VecDeque::new()));
        let reader = std::thread::Builder::new()
            .name("tokentrace-stderr".into())
            .spawn({
                let lines = Arc::clone(&lines);
                move || {
                    for line in BufReader::new(File::from(read)).lines() {
                        let Ok(line) = line else { break };
                        let mut lines = lines.lock().unwrap_or_else(PoisonError::into_inner);
                        if lines.len() == KEEP_LINES {
                            lines.pop_front();
                        }
                        lines.push_back(line);
                    }
                }
            })
            .context("spawning the stderr reader")?;
        Ok(Self {
            saved: Some(saved),
            lines,
            reader: Some(reader),
        })
    }

    /// A handle that reads the last line from another thread.
    pub fn lines(&self) -> Arc<Mutex<VecDeque<String>>> {
        Arc::clone(&self.lines)
    }

    /// Puts the real stderr back and writes what was captured to it.
    pub fn restore(&mut self) {
        let Some(saved) = self.saved.take() else {
            return;
        };
        // SAFETY: both open; fd 2 becomes the real stderr again, which
        // closes the pipe's last write end.
        unsafe { libc::dup2(saved.as_raw_fd(), libc::STDERR_FILENO) };
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        let lines = std::mem::take(&mut *self.lines.lock().unwrap_or_else(PoisonError::into_inner));
        let mut err = std::io::stderr().lock();
        for line in lines {
            let _ = writeln!(err, "{line}");
        }
    }
}

impl Drop for StderrCapture {
    fn drop(&mut self) {
        self.restore();
    }
}
