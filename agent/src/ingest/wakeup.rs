//! The ingest thread's wait: for the ring buffer (a forced kernel wake-up),
//! for a probe command (an eventfd written by the async side), or for the
//! poll interval, whichever comes first.
//!
//! Without the eventfd a command would wait out the current poll interval:
//! a process forked by a traced server would run up to 10 ms without its
//! uprobes. libbpf's own ring_buffer__poll cannot watch a second fd (it
//! indexes its rings by the epoll event's data), so the thread waits on an
//! epoll set of its own holding libbpf's epoll fd and the eventfd.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

/// Waits for the first of: ring buffer readable, notification, timeout.
pub struct Wakeup {
    epoll: OwnedFd,
    event: Arc<OwnedFd>,
}

/// Wakes the thread waiting in [`Wakeup::wait`]; cheap to clone and send.
#[derive(Clone)]
pub struct Notifier {
    event: Arc<OwnedFd>,
}

fn check(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

impl Wakeup {
    /// Watches `ring_epoll` (libbpf's ring buffer epoll fd, owned by the
    /// ring buffer, which must outlive this) and a new eventfd.
    pub fn new(ring_epoll: RawFd) -> io::Result<(Self, Notifier)> {
        // SAFETY: plain syscalls; returned fds are checked, then owned.
        let event = unsafe {
            let fd = check(libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC))?;
            Arc::new(OwnedFd::from_raw_fd(fd))
        };
        // SAFETY: as above.
        let epoll =
            unsafe { OwnedFd::from_raw_fd(check(libc::epoll_create1(libc::EPOLL_CLOEXEC))?) };
        for fd in [ring_epoll, event.as_raw_fd()] {
            let mut interest = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: fd as u64,
            };
            // SAFETY: both fds are open; `interest` is a valid epoll_event.
            check(unsafe {
                libc::epoll_ctl(epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut interest)
            })?;
        }
        let notifier = Notifier {
            event: Arc::clone(&event),
        };
        Ok((Self { epoll, event }, notifier))
    }

    /// Blocks until something is ready or `timeout` passed. Interrupted
    /// waits return early, like a timeout.
    pub fn wait(&self, timeout: Duration) -> io::Result<()> {
        let mut ready = [libc::epoll_event { events: 0, u64: 0 }; 2];
        let millis = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: `ready` has room for the 2 events asked for.
        let rc = unsafe { libc::epoll_wait(self.epoll.as_raw_fd(), ready.as_mut_ptr(), 2, millis) };
        if rc < 0 {
            let err = io::Error::last_os_error();
            return match err.kind() {
                io::ErrorKind::Interrupted => Ok(()),
                _ => Err(err),
            };
        }
        let event_fd = self.event.as_raw_fd() as u64;
        if ready.iter().take(rc as usize).any(|e| e.u64 == event_fd) {
            let mut count = 0u64;
            // SAFETY: reads 8 bytes into `count`; non-blocking, so an
            // already-drained counter returns EAGAIN, which is fine.
            unsafe { libc::read(self.event.as_raw_fd(), (&raw mut count).cast(), 8) };
        }
        Ok(())
    }
}

impl Notifier {
    /// Makes the next (or current) wait return.
    pub fn notify(&self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from `one` to our eventfd; it can only fail
        // when the counter would overflow, and then a wake-up is pending.
        unsafe { libc::write(self.event.as_raw_fd(), (&raw const one).cast(), 8) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_notification_ends_the_wait_and_a_timeout_does_too() {
        // Any epoll fd stands in for libbpf's.
        // SAFETY: epoll_create1 returns a new fd or -1.
        let ring = unsafe { OwnedFd::from_raw_fd(check(libc::epoll_create1(0)).expect("epoll")) };
        let (wakeup, notifier) = Wakeup::new(ring.as_raw_fd()).expect("wakeup");
        let started = Instant::now();
        wakeup.wait(Duration::from_millis(20)).expect("wait");
        assert!(
            started.elapsed() >= Duration::from_millis(19),
            "timed out early"
        );
        notifier.notify();
        let started = Instant::now();
        wakeup.wait(Duration::from_secs(30)).expect("wait");
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "notification lost"
        );
        // The notification was consumed: the next wait times out.
        let started = Instant::now();
        wakeup.wait(Duration::from_millis(20)).expect("wait");
        assert!(started.elapsed() >= Duration::from_millis(19));
    }
}
