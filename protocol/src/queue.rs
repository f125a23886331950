//! A queue bounded by bytes as well as by items.
//!
//! A queue of messages bounded only by their count holds as many bytes as
//! its largest messages allow: 4096 results of a few hundred bytes each is
//! 1 MB, but 4096 results that each carry a 4 MiB `raw` output is 16 GiB.
//! Here every item is queued with its size, and a sender waits (or, with
//! [`Sender::try_send`], is refused) until the queue holds both a free slot
//! and room for those bytes.
//!
//! An item larger than the whole byte budget is admitted on its own, once
//! the queue's bytes are all free, so that no item can wait for ever.
//!
//! [`Receiver::recv_held`] hands an item out together with its bytes, which
//! stay counted until the [`Held`] is dropped: a consumer that is still
//! writing what it took then holds the queue's producers back as well.

use std::fmt;
use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, TryAcquireError, mpsc};

/// Creates a queue of at most `items` items and `bytes` bytes (each at
/// least 1; `bytes` is capped at `u32::MAX`).
pub fn channel<T>(items: usize, bytes: usize) -> (Sender<T>, Receiver<T>) {
    let budget = bytes
        .clamp(1, u32::MAX as usize)
        .min(Semaphore::MAX_PERMITS);
    let (tx, rx) = mpsc::channel(items.max(1));
    (
        Sender {
            tx,
            bytes: Arc::new(Semaphore::new(budget)),
            budget,
        },
        Receiver { rx },
    )
}

/// The sending half of a [`channel`]. Cloning it makes another sender to
/// the same queue.
pub struct Sender<T> {
    tx: mpsc::Sender<(T, OwnedSemaphorePermit)>,
    bytes: Arc<Semaphore>,
    budget: usize,
}

impl<T> Clone for Sender<T> {
    fn clone(&self) -> Self {
        Sender {
            tx: self.tx.clone(),
            bytes: self.bytes.clone(),
            budget: self.budget,
        }
    }
}

impl<T> fmt::Debug for Sender<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("queue::Sender")
            .field("free_bytes", &self.bytes.available_permits())
            .field("budget", &self.budget)
            .field("closed", &self.tx.is_closed())
            .finish()
    }
}

/// The receiver is gone; the item is handed back.
#[derive(PartialEq, Eq)]
pub struct Closed<T>(pub T);

impl<T> fmt::Debug for Closed<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Closed(..)")
    }
}

/// Why [`Sender::try_send`] did not queue an item, which it hands back.
#[derive(PartialEq, Eq)]
pub enum TrySendError<T> {
    /// No free slot, or not enough free bytes, right now.
    Full(T),
    /// The receiver is gone.
    Closed(T),
}

impl<T> fmt::Debug for TrySendError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TrySendError::Full(_) => f.write_str("Full(..)"),
            TrySendError::Closed(_) => f.write_str("Closed(..)"),
        }
    }
}

impl<T> Sender<T> {
    /// The share of the byte budget an item of `size` bytes takes: at
    /// least 1, at most the whole budget.
    fn cost(&self, size: usize) -> u32 {
        // `budget` fits in a u32 (see `channel`).
        size.clamp(1, self.budget) as u32
    }

    /// Queues `item`, of `size` bytes, waiting for a free slot and for its
    /// bytes. Fails only when the receiver is gone. Senders waiting for
    /// bytes are served in the order they began to wait.
    pub async fn send(&self, item: T, size: usize) -> Result<(), Closed<T>> {
        let cost = self.cost(size);
        let permit = tokio::select! {
            p = self.bytes.clone().acquire_many_owned(cost) => match p {
                Ok(p) => p,
                // The semaphore is never closed; if it were, nothing
                // could ever be queued again.
                Err(_) => return Err(Closed(item)),
            },
            _ = self.tx.closed() => return Err(Closed(item)),
        };
        self.tx
            .send((item, permit))
            .await
            .map_err(|e| Closed((e.0).0))
    }

    /// Queues `item`, of `size` bytes, if there is a free slot and room for
    /// its bytes now.
    pub fn try_send(&self, item: T, size: usize) -> Result<(), TrySendError<T>> {
        if self.tx.is_closed() {
            return Err(TrySendError::Closed(item));
        }
        let permit = match self.bytes.clone().try_acquire_many_owned(self.cost(size)) {
            Ok(p) => p,
            Err(TryAcquireError::NoPermits) => return Err(TrySendError::Full(item)),
            Err(TryAcquireError::Closed) => return Err(TrySendError::Closed(item)),
        };
        self.tx.try_send((item, permit)).map_err(|e| match e {
            mpsc::error::TrySendError::Full((item, _)) => TrySendError::Full(item),
            mpsc::error::TrySendError::Closed((item, _)) => TrySendError::Closed(item),
        })
    }

    /// Whether the receiver is gone.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// Bytes of the budget not taken by queued (or held) items.
    pub fn free_bytes(&self) -> usize {
        self.bytes.available_permits()
    }
}

/// An item taken from the queue with [`Receiver::recv_held`]: its bytes
/// count against the queue's budget until this is dropped.
pub struct Held<T> {
    item: T,
    permit: OwnedSemaphorePermit,
}

impl<T> Held<T> {
    /// The item, its bytes still counted.
    pub fn get(&self) -> &T {
        &self.item
    }

    /// The item, and the bytes it held made free.
    pub fn into_inner(self) -> T {
        drop(self.permit);
        self.item
    }

    /// The item, and its bytes still counted until the [`HeldBytes`] is
    /// dropped.
    pub fn into_parts(self) -> (T, HeldBytes) {
        (
            self.item,
            HeldBytes {
                permit: self.permit,
            },
        )
    }
}

/// The bytes of an item taken from a queue, counted against its budget
/// until this is dropped (see [`Held::into_parts`]).
#[derive(Debug)]
pub struct HeldBytes {
    permit: OwnedSemaphorePermit,
}

impl HeldBytes {
    /// How much of the budget is held (an item's size, within 1 and the
    /// budget).
    pub fn bytes(&self) -> usize {
        self.permit.num_permits()
    }
}

impl<T: fmt::Debug> fmt::Debug for Held<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Held")
            .field("item", &self.item)
            .field("bytes", &self.permit.num_permits())
            .finish()
    }
}

/// The receiving half of a [`channel`]. Dropping it drops what is queued
/// and fails every sender.
pub struct Receiver<T> {
    rx: mpsc::Receiver<(T, OwnedSemaphorePermit)>,
}

impl<T> fmt::Debug for Receiver<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("queue::Receiver")
            .field("len", &self.rx.len())
            .finish()
    }
}

impl<T> Receiver<T> {
    /// The next item, its bytes made free; `None` once every sender is gone
    /// and the queue is empty. Cancel-safe.
    pub async fn recv(&mut self) -> Option<T> {
        self.rx.recv().await.map(|(item, _)| item)
    }

    /// The next item with its bytes still counted (see [`Held`]). Cancel-safe.
    pub async fn recv_held(&mut self) -> Option<Held<T>> {
        self.rx
            .recv()
            .await
            .map(|(item, permit)| Held { item, permit })
    }

    /// [`Receiver::recv`] for a thread outside the async runtime; panics if
    /// called from within one (as tokio's does).
    pub fn blocking_recv(&mut self) -> Option<T> {
        self.rx.blocking_recv().map(|(item, _)| item)
    }

    /// The next item if one is queued now.
    pub fn try_recv(&mut self) -> Option<T> {
        self.rx.try_recv().ok().map(|(item, _)| item)
    }

    /// Items queued.
    pub fn len(&self) -> usize {
        self.rx.len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.rx.is_empty()
    }

    /// Refuses further sends; what is queued can still be received.
    pub fn close(&mut self) {
        self.rx.close();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn pending<F: std::future::Future>(f: F) -> bool {
        use std::task::{Context, Poll, Waker};
        let mut f = std::pin::pin!(f);
        let mut cx = Context::from_waker(Waker::noop());
        matches!(f.as_mut().poll(&mut cx), Poll::Pending)
    }

    #[tokio::test]
    async fn a_send_waits_for_bytes_until_a_receive_frees_them() {
        let (tx, mut rx) = channel::<u32>(100, 10);
        tx.send(1, 6).await.unwrap();
        assert_eq!(tx.free_bytes(), 4);
        // 6 more bytes do not fit beside the first 6, though a slot is free.
        let tx2 = tx.clone();
        let second = tokio::spawn(async move { tx2.send(2, 6).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!second.is_finished());
        assert_eq!(rx.len(), 1);
        assert_eq!(rx.recv().await, Some(1));
        second.await.unwrap().unwrap();
        assert_eq!(rx.recv().await, Some(2));
        assert_eq!(tx.free_bytes(), 10);
    }

    #[tokio::test]
    async fn try_send_is_refused_on_bytes_and_on_slots() {
        let (tx, mut rx) = channel::<&str>(2, 10);
        tx.try_send("a", 8).unwrap();
        assert_eq!(tx.try_send("b", 3), Err(TrySendError::Full("b")));
        tx.try_send("c", 2).unwrap();
        // Bytes are free now, but both slots are taken; the bytes taken for
        // the refused item are given back.
        assert_eq!(tx.try_send("d", 0), Err(TrySendError::Full("d")));
        assert_eq!(tx.free_bytes(), 0);
        assert_eq!(rx.recv().await, Some("a"));
        assert_eq!(tx.free_bytes(), 8);
        tx.try_send("e", 5).unwrap();
        drop(rx);
        assert_eq!(tx.try_send("f", 1), Err(TrySendError::Closed("f")));
    }

    #[tokio::test]
    async fn an_item_over_the_budget_goes_alone_and_is_not_stuck() {
        let (tx, mut rx) = channel::<u8>(10, 100);
        tx.send(1, 10).await.unwrap();
        assert!(matches!(tx.try_send(2, 1_000), Err(TrySendError::Full(2))));
        assert!(pending(tx.send(2, 1_000)));
        assert_eq!(rx.recv().await, Some(1));
        tx.send(2, 1_000).await.unwrap();
        assert_eq!(tx.free_bytes(), 0);
        assert_eq!(rx.recv().await, Some(2));
        assert_eq!(tx.free_bytes(), 100);
    }

    #[tokio::test]
    async fn a_held_item_keeps_its_bytes_until_dropped() {
        let (tx, mut rx) = channel::<u8>(10, 10);
        tx.send(7, 10).await.unwrap();
        let held = rx.recv_held().await.unwrap();
        assert_eq!(*held.get(), 7);
        assert!(matches!(tx.try_send(8, 1), Err(TrySendError::Full(8))));
        let (item, bytes) = held.into_parts();
        assert_eq!((item, bytes.bytes()), (7, 10));
        assert_eq!(tx.free_bytes(), 0);
        drop(bytes);
        assert_eq!(tx.free_bytes(), 10);
        tx.try_send(8, 10).unwrap();
        assert_eq!(rx.recv_held().await.unwrap().into_inner(), 8);
        assert_eq!(tx.free_bytes(), 10);
    }

    #[tokio::test]
    async fn a_sender_waiting_for_bytes_fails_when_the_receiver_goes() {
        let (tx, mut rx) = channel::<u8>(10, 4);
        tx.send(1, 4).await.unwrap();
        let tx2 = tx.clone();
        let waiting = tokio::spawn(async move { tx2.send(2, 4).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        rx.close();
        drop(rx);
        assert_eq!(waiting.await.unwrap(), Err(Closed(2)));
        assert!(tx.is_closed());
        // Dropping the receiver dropped what it held: every byte is free.
        assert_eq!(tx.free_bytes(), 4);
    }

    #[tokio::test]
    async fn the_receiver_ends_once_every_sender_is_gone_and_it_is_drained() {
        let (tx, mut rx) = channel::<u8>(4, 4);
        tx.send(1, 1).await.unwrap();
        tx.send(2, 1).await.unwrap();
        drop(tx);
        assert_eq!(rx.try_recv(), Some(1));
        assert_eq!(rx.recv().await, Some(2));
        assert_eq!(rx.recv().await, None);
        assert!(rx.is_empty());
    }

    #[test]
    fn blocking_recv_serves_a_thread_outside_the_runtime() {
        let (tx, mut rx) = channel::<u8>(4, 4);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            while let Some(v) = rx.blocking_recv() {
                got.push(v);
            }
            got
        });
        rt.block_on(async {
            for v in 0..20u8 {
                tx.send(v, 2).await.unwrap();
            }
        });
        drop(tx);
        assert_eq!(reader.join().unwrap(), (0..20).collect::<Vec<_>>());
    }
}
