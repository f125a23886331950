//! The "latest frames" mailbox between a GStreamer streaming thread and the
//! async consumer.
//!
//! The producer side never waits: `push` takes a short, uncontended lock and,
//! when the queue is full, evicts the oldest frame (and counts it). The
//! consumer awaits [`Mailbox::recv`]. Once the producer reports the end of the
//! stream, frames already queued are still delivered, then the end is returned
//! to every later `recv`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use tokio::sync::Notify;

/// A bounded FIFO that keeps the newest items: pushing into a full queue
/// evicts the oldest.
#[derive(Debug)]
pub(crate) struct LatestQueue<T> {
    items: VecDeque<T>,
    capacity: usize,
}

impl<T> LatestQueue<T> {
    /// A queue of `capacity` items (at least one).
    pub(crate) fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        LatestQueue {
            items: VecDeque::with_capacity(capacity),
            capacity,
        }
    }

    /// Appends `item`; returns the oldest item if it had to make room.
    pub(crate) fn push(&mut self, item: T) -> Option<T> {
        let evicted = if self.items.len() == self.capacity {
            self.items.pop_front()
        } else {
            None
        };
        self.items.push_back(item);
        evicted
    }

    /// Removes the oldest item.
    pub(crate) fn pop(&mut self) -> Option<T> {
        self.items.pop_front()
    }
}

#[derive(Debug)]
struct State<T, E> {
    queue: LatestQueue<T>,
    ended: Option<E>,
}

/// A [`LatestQueue`] shared between a non-blocking producer and an async
/// consumer, with counters and a terminal error.
#[derive(Debug)]
pub(crate) struct Mailbox<T, E> {
    state: Mutex<State<T, E>>,
    notify: Notify,
    pushed: AtomicU64,
    dropped: AtomicU64,
}

impl<T, E: Clone> Mailbox<T, E> {
    /// A mailbox holding at most `capacity` undelivered items.
    pub(crate) fn new(capacity: usize) -> Self {
        Mailbox {
            state: Mutex::new(State {
                queue: LatestQueue::new(capacity),
                ended: None,
            }),
            notify: Notify::new(),
            pushed: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<T, E>> {
        // A panic while holding this lock cannot leave the queue half-updated
        // (every update is one VecDeque call), so a poisoned lock is usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `item` without waiting, evicting the oldest when full.
    pub(crate) fn push(&self, item: T) {
        let evicted = self.lock().queue.push(item);
        self.pushed.fetch_add(1, Ordering::Relaxed);
        if evicted.is_some() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
        // Dropped outside the lock: freeing a frame is not free.
        drop(evicted);
        self.notify.notify_one();
    }

    /// Records the end of the stream. The first reason wins; later ones are
    /// returned as `false` so the caller can log them.
    pub(crate) fn end(&self, reason: E) -> bool {
        let first = {
            let mut state = self.lock();
            if state.ended.is_none() {
                state.ended = Some(reason);
                true
            } else {
                false
            }
        };
        self.notify.notify_one();
        first
    }

    /// Whether the stream has ended.
    pub(crate) fn ended(&self) -> Option<E> {
        self.lock().ended.clone()
    }

    /// The oldest undelivered item, waiting for one; or the end of the stream
    /// once the queue is empty.
    pub(crate) async fn recv(&self) -> Result<T, E> {
        loop {
            {
                let mut state = self.lock();
                if let Some(item) = state.queue.pop() {
                    return Ok(item);
                }
                if let Some(reason) = &state.ended {
                    return Err(reason.clone());
                }
            }
            // `notify_one` stores a permit when nobody waits yet, so a push
            // between the check above and this await is not lost.
            self.notify.notified().await;
        }
    }

    /// Items pushed so far (delivered, queued or evicted).
    pub(crate) fn pushed(&self) -> u64 {
        self.pushed.load(Ordering::Relaxed)
    }

    /// Items evicted unread because the consumer fell behind.
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Items queued now, not yet delivered.
    pub(crate) fn queued(&self) -> usize {
        self.lock().queue.items.len()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    #[test]
    fn full_queue_evicts_the_oldest_item() {
        let mut q = LatestQueue::new(2);
        assert_eq!(q.push(1), None);
        assert_eq!(q.push(2), None);
        assert_eq!(q.push(3), Some(1));
        assert_eq!(q.pop(), Some(2));
        assert_eq!(q.pop(), Some(3));
        assert_eq!(q.pop(), None);
    }

    #[test]
    fn zero_capacity_still_keeps_the_newest_item() {
        let mut q = LatestQueue::new(0);
        assert_eq!(q.push('a'), None);
        assert_eq!(q.push('b'), Some('a'));
        assert_eq!(q.pop(), Some('b'));
    }

    #[tokio::test]
    async fn mailbox_counts_drops_and_delivers_the_newest_frames_in_order() {
        let mb: Mailbox<u64, String> = Mailbox::new(3);
        for seq in 0..10 {
            mb.push(seq);
        }
        assert_eq!(mb.pushed(), 10);
        assert_eq!(mb.dropped(), 7);
        for want in 7..10 {
            assert_eq!(mb.recv().await, Ok(want));
        }
    }

    #[tokio::test]
    async fn recv_wakes_when_a_frame_arrives_from_another_thread() {
        let mb: Arc<Mailbox<u64, String>> = Arc::new(Mailbox::new(1));
        let producer = Arc::clone(&mb);
        let thread = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            producer.push(42);
        });
        let got = tokio::time::timeout(Duration::from_secs(5), mb.recv()).await;
        thread.join().unwrap();
        assert_eq!(got, Ok(Ok(42)));
    }

    #[tokio::test]
    async fn queued_frames_are_delivered_before_the_end_which_then_repeats() {
        let mb: Mailbox<u64, String> = Mailbox::new(4);
        mb.push(1);
        assert!(mb.end("eos".into()));
        assert!(!mb.end("later error".into()));
        mb.push(2);
        assert_eq!(mb.recv().await, Ok(1));
        assert_eq!(mb.recv().await, Ok(2));
        assert_eq!(mb.recv().await, Err("eos".to_string()));
        assert_eq!(mb.recv().await, Err("eos".to_string()));
        assert_eq!(mb.ended(), Some("eos".to_string()));
    }
}
