//! Retry with exponential backoff and jitter, under a time budget.
//!
//! Our own, not a crate: `backoff` is unmaintained (no release since 0.4.0
//! in 2022), and `backon`'s jitter only adds to a delay, where ours spreads
//! agents ±20 % around it; a server's `Retry-After` replaces the delay and
//! a batch is given up when the next attempt would start past
//! `max_elapsed` (the OTLP exporter behaviour), in 60 lines with tests.
//!
//! While the export task retries a batch, the run loop keeps filling the
//! bounded queue; once it is full, new spans are dropped and counted. So a
//! dead backend costs at most one batch in flight plus a full queue, and
//! when it comes back the next attempt (at most `max_backoff` later)
//! succeeds and the queue drains.

use std::collections::hash_map::RandomState;
use std::future::Future;
use std::hash::BuildHasher;
use std::time::Duration;

use tokio::time::Instant;

use super::otlp::SendError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    /// Give up on a batch when the next attempt would start later than this
    /// after the first.
    pub max_elapsed: Duration,
}

/// Delays between attempts: doubling from `initial_backoff` up to
/// `max_backoff`, each scaled by a random factor in [0.8, 1.2) so agents on
/// many nodes do not hit a recovering collector in lockstep.
#[derive(Debug, Clone)]
pub struct Backoff {
    policy: RetryPolicy,
    next: Duration,
    rng: u64,
}

impl Backoff {
    pub fn new(policy: RetryPolicy) -> Self {
        Self::with_seed(policy, RandomState::new().hash_one(0u8) | 1)
    }

    pub fn with_seed(policy: RetryPolicy, seed: u64) -> Self {
        Self {
            policy,
            next: policy.initial_backoff,
            rng: seed | 1,
        }
    }

    /// The next delay; a server-requested `Retry-After` replaces it.
    pub fn next_delay(&mut self, retry_after: Option<Duration>) -> Duration {
        // xorshift64: cheap, and good enough for jitter
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let factor = 0.8 + 0.4 * (self.rng >> 11) as f64 / (1u64 << 53) as f64;
        let delay = retry_after.unwrap_or_else(|| self.next.mul_f64(factor));
        self.next = (self.next * 2).min(self.policy.max_backoff);
        delay
    }
}

/// Runs `attempt` until it succeeds, fails permanently, or the next try
/// would start past `max_elapsed`. Returns the last error when giving up,
/// with the number of attempts made.
pub async fn with_retry<T, F, Fut>(
    policy: RetryPolicy,
    mut attempt: F,
) -> Result<T, (SendError, u32)>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, SendError>>,
{
    let start = Instant::now();
    let mut backoff = Backoff::new(policy);
    let mut attempts = 0;
    loop {
        attempts += 1;
        match attempt().await {
            Ok(value) => return Ok(value),
            Err(err @ SendError::Permanent(_)) => return Err((err, attempts)),
            Err(err @ SendError::Retryable { retry_after, .. }) => {
                let delay = backoff.next_delay(retry_after);
                if start.elapsed() + delay > policy.max_elapsed {
                    return Err((err, attempts));
                }
                tracing::debug!("OTLP export failed ({err}); retrying in {delay:?}");
                tokio::time::sleep(delay).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    const POLICY: RetryPolicy = RetryPolicy {
        initial_backoff: Duration::from_millis(100),
        max_backoff: Duration::from_millis(400),
        max_elapsed: Duration::from_secs(2),
    };

    #[test]
    fn delays_double_up_to_the_cap_with_bounded_jitter() {
        let mut b = Backoff::with_seed(POLICY, 42);
        let delays: Vec<Duration> = (0..6).map(|_| b.next_delay(None)).collect();
        for (d, nominal) in delays.iter().zip([100u64, 200, 400, 400, 400, 400]) {
            let ms = d.as_secs_f64() * 1000.0;
            assert!(
                ms >= nominal as f64 * 0.8 && ms < nominal as f64 * 1.2,
                "{ms} vs {nominal}"
            );
        }
        assert_eq!(
            b.next_delay(Some(Duration::from_secs(3))),
            Duration::from_secs(3),
            "Retry-After wins"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn retries_transient_errors_then_succeeds() {
        let calls = AtomicU32::new(0);
        let got = with_retry(POLICY, || async {
            if calls.fetch_add(1, Ordering::SeqCst) < 3 {
                Err(SendError::Retryable {
                    message: "down".into(),
                    retry_after: None,
                })
            } else {
                Ok(7)
            }
        })
        .await;
        assert_eq!(got, Ok(7));
        assert_eq!(calls.load(Ordering::SeqCst), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn gives_up_after_the_budget_and_at_once_on_permanent_errors() {
        let started = Instant::now();
        let got: Result<(), _> = with_retry(POLICY, || async {
            Err(SendError::Retryable {
                message: "down".into(),
                retry_after: None,
            })
        })
        .await;
        let (_, attempts) = got.expect_err("never succeeds");
        assert!(
            started.elapsed() <= POLICY.max_elapsed,
            "{:?}",
            started.elapsed()
        );
        assert!(
            (4..=8).contains(&attempts),
            "{attempts} attempts in 2 s of 100..400 ms backoff"
        );

        let got: Result<(), _> =
            with_retry(POLICY, || async { Err(SendError::Permanent("bad".into())) }).await;
        assert_eq!(got, Err((SendError::Permanent("bad".into()), 1)));
    }
}
