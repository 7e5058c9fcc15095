//! The bounded hand-off between the run loop and the span export task.
//!
//! The run loop must never wait on the network: it `try_push`es and, when
//! the queue is full (backend slow or down), the item is dropped and counted
//! by the caller. The export task takes batches: it waits for a first item,
//! then lingers a little for more, so a burst goes out in one request and a
//! trickle still goes out promptly.

use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

/// The run loop's end.
#[derive(Debug)]
pub struct QueueSender<T> {
    tx: mpsc::Sender<T>,
}

/// The export task's end.
#[derive(Debug)]
pub struct QueueReceiver<T> {
    rx: mpsc::Receiver<T>,
}

/// A queue of at most `capacity` items (at least one).
pub fn bounded<T>(capacity: usize) -> (QueueSender<T>, QueueReceiver<T>) {
    let (tx, rx) = mpsc::channel(capacity.max(1));
    (QueueSender { tx }, QueueReceiver { rx })
}

impl<T> QueueSender<T> {
    /// Enqueues without waiting; gives the item back when the queue is full
    /// or the export task is gone.
    pub fn try_push(&self, item: T) -> Result<(), T> {
        self.tx.try_send(item).map_err(|err| match err {
            mpsc::error::TrySendError::Full(item) | mpsc::error::TrySendError::Closed(item) => item,
        })
    }
}

impl<T> QueueReceiver<T> {
    /// Whether a `try_push` would fail for want of room now.
    pub fn is_full(&self) -> bool {
        self.rx.capacity() == 0
    }

    /// Waits for an item, then collects up to `max` items, waiting at most
    /// `linger` after the first for the batch to fill. `None` once every
    /// sender is gone and the queue is empty.
    pub async fn next_batch(&mut self, max: usize, linger: Duration) -> Option<Vec<T>> {
        let first = self.rx.recv().await?;
        let mut batch = vec![first];
        let deadline = Instant::now() + linger;
        while batch.len() < max {
            // take what is already there without waiting
            match self.rx.try_recv() {
                Ok(item) => {
                    batch.push(item);
                    continue;
                }
                Err(mpsc::error::TryRecvError::Disconnected) => break,
                Err(mpsc::error::TryRecvError::Empty) => {}
            }
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(item)) => batch.push(item),
                Ok(None) | Err(_) => break,
            }
        }
        Some(batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_full_queue_gives_items_back_and_never_grows() {
        let (tx, mut rx) = bounded::<u32>(4);
        let mut dropped = 0;
        for i in 0..10 {
            if tx.try_push(i).is_err() {
                dropped += 1;
            }
        }
        assert_eq!(dropped, 6);
        let batch = rx.next_batch(100, Duration::ZERO).await.expect("items");
        assert_eq!(
            batch,
            vec![0, 1, 2, 3],
            "the oldest items are kept, in order"
        );
        assert!(tx.try_push(4).is_ok(), "room again once drained");
        assert_eq!(rx.next_batch(100, Duration::ZERO).await, Some(vec![4]));
        drop(tx);
        assert_eq!(rx.next_batch(100, Duration::ZERO).await, None);
    }

    /// On tokio's paused clock: the linger is measured in virtual time, so
    /// what arrives inside it and what arrives after it are told apart
    /// exactly, however loaded the machine is.
    #[tokio::test(start_paused = true)]
    async fn batches_are_capped_and_linger_for_late_items() {
        let (tx, mut rx) = bounded::<u32>(16);
        for i in 0..5 {
            tx.try_push(i).expect("room");
        }
        assert_eq!(rx.next_batch(3, Duration::ZERO).await, Some(vec![0, 1, 2]));
        assert_eq!(rx.next_batch(3, Duration::ZERO).await, Some(vec![3, 4]));

        let late = tokio::spawn(async move {
            tx.try_push(10).expect("room");
            tokio::time::sleep(Duration::from_millis(499)).await;
            tx.try_push(11).expect("room");
            // after the first batch's linger (500 ms from item 10) ran out
            tokio::time::sleep(Duration::from_millis(2)).await;
            tx.try_push(12).expect("room");
            tx
        });
        let started = Instant::now();
        let batch = rx
            .next_batch(10, Duration::from_millis(500))
            .await
            .expect("items");
        assert_eq!(
            batch,
            vec![10, 11],
            "item 11 arrived 499 ms into the 500 ms linger, item 12 after it"
        );
        assert_eq!(
            started.elapsed(),
            Duration::from_millis(500),
            "a batch short of `max` waits out the whole linger"
        );
        assert_eq!(
            rx.next_batch(10, Duration::from_millis(500)).await,
            Some(vec![12])
        );
        drop(late.await.expect("sender task"));
        assert_eq!(rx.next_batch(10, Duration::from_millis(500)).await, None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_batch_goes_out_without_lingering() {
        let (tx, mut rx) = bounded::<u32>(16);
        for i in 0..4 {
            tx.try_push(i).expect("room");
        }
        let started = Instant::now();
        assert_eq!(
            rx.next_batch(4, Duration::from_secs(60)).await,
            Some(vec![0, 1, 2, 3])
        );
        assert_eq!(started.elapsed(), Duration::ZERO);
    }
}
