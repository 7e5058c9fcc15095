//! Noticing that a backend which was down is back.
//!
//! A failed export waits out its backoff (up to `max_backoff`, 5 s by
//! default), and the transport underneath has reconnect logic of its own;
//! together they left a soak's backlog undrained for 69 s after the
//! collector came back. While exports fail, the span task probes the
//! backend's port with a plain TCP connect every [`POLL`]: the moment one
//! succeeds after one that did not, the wait is cut short and the next
//! attempt goes out on a renewed transport.
//!
//! A backend that accepts connections but answers with errors (overloaded,
//! 503, `RESOURCE_EXHAUSTED`) has not "come back": it never went away, so
//! the probe stays quiet and the backoff holds, as the spec asks.

use std::future::pending;
use std::time::Duration;

use tokio::net::TcpStream;

/// Time between probes while the backend is unreachable.
pub const POLL: Duration = Duration::from_millis(250);

/// A connect that has not completed in this long counts as unreachable
/// (a blackholed address never refuses).
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// The backend's `host:port`, as the transport dials it.
#[derive(Debug, Clone)]
pub struct Reachability {
    authority: Option<String>,
}

impl Reachability {
    /// `None` (a URL without a host): never reports a return, so retries
    /// keep their plain backoff.
    pub fn new(authority: Option<String>) -> Self {
        Self { authority }
    }

    /// Resolves when the backend accepts a connection after refusing one
    /// (or letting one time out); never, when it accepts the first probe.
    pub async fn comes_back(&self) {
        let Some(authority) = self.authority.as_deref() else {
            return pending().await;
        };
        if accepts(authority).await {
            return pending().await;
        }
        loop {
            tokio::time::sleep(POLL).await;
            if accepts(authority).await {
                return;
            }
        }
    }
}

async fn accepts(authority: &str) -> bool {
    matches!(
        tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(authority)).await,
        Ok(Ok(_))
    )
}

#[cfg(test)]
mod tests {
    use tokio::net::TcpListener;

    use super::*;

    /// Real sockets on loopback: a port nobody listens on refuses, then a
    /// listener appears on it.
    #[tokio::test]
    async fn a_refusing_port_is_noticed_once_it_listens() {
        let probe = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = probe.local_addr().expect("addr");
        drop(probe);
        let reach = Reachability::new(Some(addr.to_string()));
        let back = tokio::spawn(async move { reach.comes_back().await });
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert!(!back.is_finished(), "nothing listens yet");
        let listener = TcpListener::bind(addr).await.expect("rebind the port");
        tokio::time::timeout(Duration::from_secs(5), back)
            .await
            .expect("noticed within 5 s (a poll is 250 ms)")
            .expect("task");
        drop(listener);
    }

    #[tokio::test]
    async fn a_backend_that_accepts_never_comes_back() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let reach = Reachability::new(Some(listener.local_addr().expect("addr").to_string()));
        let waited = tokio::time::timeout(Duration::from_millis(800), reach.comes_back()).await;
        assert!(waited.is_err(), "an accepting backend is not 'back'");
        let none = Reachability::new(None);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), none.comes_back())
                .await
                .is_err()
        );
    }
}
