//! The shell's ledger writes of a lease's lifecycle: made now, or queued
//! in the [`LeaseBook`](super::book::LeaseBook) (in lifecycle order) and
//! retried every tick when the ledger fails.

use tidegate_lease::LeaseId;
use tidegate_lease::ledger::LedgerError;
use tracing::{debug, info, warn};

use super::LeaseSource;
use super::book::LedgerWrite;
use super::shell::Shell;

impl<P: LeaseSource> Shell<P> {
    /// Writes `w` to the ledger now, or queues it to retry next tick when
    /// an earlier write of the lease is still pending or the ledger fails.
    /// A write the lifecycle refuses (the lease already moved past it, or
    /// ended) is moot and dropped.
    pub(super) fn write(&mut self, lease: LeaseId, w: LedgerWrite) {
        if self.book.write_waits(lease) {
            debug!(%lease, write = w.name(), "queued behind an earlier ledger write");
            self.book.queue_write(lease, w);
            return;
        }
        if let Err(e) = self.try_write(lease, &w) {
            warn!(%lease, "{}: {e}; retried every tick", w.name());
            self.book.queue_write(lease, w);
        }
    }

    /// One ledger write: `Err` only when it should be retried.
    fn try_write(&mut self, lease: LeaseId, w: &LedgerWrite) -> Result<(), LedgerError> {
        let r = match w {
            LedgerWrite::Starting { at, pid, data } => {
                self.ledger.mark_starting(lease, *at, *pid, data.as_deref())
            }
            LedgerWrite::Ready { at } => self.ledger.mark_ready(lease, *at),
            LedgerWrite::Draining => self.ledger.mark_draining(lease),
            LedgerWrite::Ended { at, reason } => self.ledger.mark_ended(lease, *at, *reason).map(|last| {
                info!(%lease, reason = reason.as_str(), final_blocks = last.units(), "lease ended");
            }),
        };
        match r {
            Ok(()) => Ok(()),
            Err(e @ (LedgerError::Transition { .. } | LedgerError::UnknownLease(_))) => {
                debug!(%lease, write = w.name(), "moot: {e}");
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Retries the pending ledger writes, each lease's in lifecycle order;
    /// after one fails, the lease's later writes wait behind it.
    pub(super) fn flush_writes(&mut self) {
        for (lease, queue) in self.book.take_writes() {
            let mut left = Vec::new();
            for w in queue {
                if !left.is_empty() {
                    left.push(w);
                    continue;
                }
                match self.try_write(lease, &w) {
                    Ok(()) => info!(%lease, "{} succeeded on retry", w.name()),
                    Err(e) => {
                        debug!(%lease, "{}: {e}; retried next tick", w.name());
                        left.push(w);
                    }
                }
            }
            self.book.requeue(lease, left);
        }
    }
}
