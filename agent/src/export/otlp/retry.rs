//! Retry with exponential backoff and jitter, under a time budget.
//!
//! Our own, not a crate: `backoff` is unmaintained (no release since 0.4.0
//! in 2022), and `backon`'s jitter only adds to a delay, where ours spreads
//! agents ±20 % around it; a server's `Retry-After` replaces the delay,
//! and waits are cut short when the backend comes back.
//!
//! While the export task retries a batch, the run loop keeps filling the
//! bounded queue. A batch is given up only when it is past `max_elapsed`
//! *and* the queue behind it is full (the OTLP exporters give up on time
//! alone, which dropped spans a soak's queue had room for); new spans that
//! find the queue full are dropped and counted. So a dead backend costs at
//! most one batch in flight plus a full queue, and when it comes back the
//! next attempt goes out within a reachability poll and the queue drains.

use std::collections::hash_map::RandomState;
use std::future::Future;
use std::hash::BuildHasher;
use std::time::Duration;

use tokio::time::Instant;

use super::client::SendError;

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

/// What a retry loop is told besides how to attempt.
pub struct Outage<Back, Full> {
    /// Resolves when the backend, unreachable so far, accepts connections
    /// again ([`super::reachability::Reachability::comes_back`]).
    pub comes_back: Back,
    /// Whether the queue behind this batch is full: only then may a batch
    /// past `max_elapsed` be given up, to make room for newer spans.
    pub queue_full: Full,
}

/// How a batch ended when it was not sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GaveUp {
    /// The backend refused it; sending it again would not help.
    Refused(SendError, u32),
    /// Still failing after `max_elapsed` with the queue full behind it.
    NoRoom(SendError, u32),
}

/// Runs `attempt` until it succeeds or fails permanently, waiting out a
/// backoff between tries. Past `max_elapsed` the batch is given up only
/// when the queue behind it is full: while there is room, the spans are
/// worth more kept than dropped.
///
/// Once an attempt has failed, every wait (and every further attempt) is
/// raced against `comes_back`: when the backend returns, the attempt in
/// progress is abandoned and the next one goes out at once with
/// `attempt(true)` (renew the transport) and the backoff starts over.
pub async fn with_retry<T, F, Fut, B, BackFut, Full>(
    policy: RetryPolicy,
    outage: Outage<B, Full>,
    mut attempt: F,
) -> Result<T, GaveUp>
where
    F: FnMut(bool) -> Fut,
    Fut: Future<Output = Result<T, SendError>>,
    B: Fn() -> BackFut,
    BackFut: Future<Output = ()>,
    Full: Fn() -> bool,
{
    let start = Instant::now();
    let mut backoff = Backoff::new(policy);
    let mut attempts = 0;
    let mut failed = false;
    let mut renew = false;
    loop {
        attempts += 1;
        let result = if failed {
            tokio::select! {
                result = attempt(std::mem::take(&mut renew)) => Some(result),
                () = (outage.comes_back)() => None,
            }
        } else {
            Some(attempt(false).await)
        };
        let (err, retry_after) = match result {
            Some(Ok(value)) => return Ok(value),
            Some(Err(err @ SendError::Permanent(_))) => return Err(GaveUp::Refused(err, attempts)),
            Some(Err(err @ SendError::Retryable { retry_after, .. })) => (err, retry_after),
            None => {
                tracing::debug!("the OTLP backend is reachable again; retrying now");
                (renew, backoff) = (true, Backoff::new(policy));
                continue;
            }
        };
        failed = true;
        let delay = backoff.next_delay(retry_after);
        if start.elapsed() + delay > policy.max_elapsed && (outage.queue_full)() {
            return Err(GaveUp::NoRoom(err, attempts));
        }
        tracing::debug!("OTLP export failed ({err}); retrying in {delay:?}");
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = (outage.comes_back)() => {
                tracing::debug!("the OTLP backend is reachable again; retrying now");
                (renew, backoff) = (true, Backoff::new(policy));
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

    fn down() -> SendError {
        SendError::Retryable {
            message: "down".into(),
            retry_after: None,
        }
    }

    /// No return noticed, and a queue with or without room.
    fn plain(full: bool) -> Outage<impl Fn() -> std::future::Pending<()>, impl Fn() -> bool> {
        Outage {
            comes_back: std::future::pending,
            queue_full: move || full,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn retries_transient_errors_then_succeeds() {
        let calls = AtomicU32::new(0);
        let got = with_retry(POLICY, plain(true), |_| async {
            if calls.fetch_add(1, Ordering::SeqCst) < 3 {
                Err(down())
            } else {
                Ok(7)
            }
        })
        .await;
        assert_eq!(got, Ok(7));
        assert_eq!(calls.load(Ordering::SeqCst), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn gives_up_past_the_budget_only_with_a_full_queue_and_at_once_on_permanent_errors() {
        let started = Instant::now();
        let got: Result<(), _> = with_retry(POLICY, plain(true), |_| async { Err(down()) }).await;
        let Err(GaveUp::NoRoom(_, attempts)) = got else {
            panic!("{got:?}")
        };
        assert!(
            started.elapsed() <= POLICY.max_elapsed,
            "{:?}",
            started.elapsed()
        );
        assert!(
            (4..=8).contains(&attempts),
            "{attempts} attempts in 2 s of 100..400 ms backoff"
        );

        // with room in the queue the batch is kept, past the budget
        let calls = AtomicU32::new(0);
        let started = Instant::now();
        let got = with_retry(POLICY, plain(false), |_| async {
            if calls.fetch_add(1, Ordering::SeqCst) < 40 {
                Err(down())
            } else {
                Ok(())
            }
        })
        .await;
        assert_eq!(got, Ok(()));
        assert!(started.elapsed() > 5 * POLICY.max_elapsed);

        let got: Result<(), _> = with_retry(POLICY, plain(false), |_| async {
            Err(SendError::Permanent("bad".into()))
        })
        .await;
        assert_eq!(
            got,
            Err(GaveUp::Refused(SendError::Permanent("bad".into()), 1))
        );
    }

    /// The backend comes back 10.2 s into an outage, while the backoff
    /// (at its 400 ms cap here, 5 s by default) still has time to run, and
    /// while an attempt hangs: the next attempt goes out at once, renewed,
    /// and later waits start again from the initial backoff.
    #[tokio::test(start_paused = true)]
    async fn a_returning_backend_cuts_the_wait_and_the_hung_attempt_short() {
        let policy = RetryPolicy {
            max_backoff: Duration::from_secs(5),
            max_elapsed: Duration::from_secs(60),
            ..POLICY
        };
        let started = Instant::now();
        let back_at = started + Duration::from_millis(10_200);
        let renewed_at = std::sync::Mutex::new(Vec::new());
        let outage = Outage {
            // as Reachability: resolves when the backend returns, never once
            // it is back
            comes_back: || async move {
                if Instant::now() >= back_at {
                    std::future::pending::<()>().await;
                }
                tokio::time::sleep_until(back_at).await;
            },
            queue_full: || false,
        };
        let calls = AtomicU32::new(0);
        let got = with_retry(policy, outage, |renew| {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            if renew {
                renewed_at.lock().expect("lock").push(started.elapsed());
            }
            async move {
                if renew {
                    Ok(n)
                } else if n == 0 {
                    Err(down())
                } else {
                    // a hung connection: never answers
                    std::future::pending().await
                }
            }
        })
        .await;
        assert_eq!(got, Ok(2), "attempt 1 failed, 2 hung, 3 renewed");
        assert_eq!(
            *renewed_at.lock().expect("lock"),
            vec![Duration::from_millis(10_200)]
        );
    }
}
