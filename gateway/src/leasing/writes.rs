//! The ledger write queue: a lease's lifecycle writes, kept in order and
//! retried every tick when the ledger fails.

use std::collections::BTreeMap;

use tidegate_lease::ledger::LedgerError;

use tidegate_lease::{EndReason, LeaseId, Millis};
use tracing::{debug, info, warn};

use super::LeaseSource;
use super::shell::Shell;

/// A ledger write of one lease's lifecycle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Write {
    /// `mark_starting`: the provider accepted; billing starts.
    Starting {
        at: Millis,
        pid: Option<u32>,
        data: Option<String>,
    },
    /// `mark_ready`: the worker registered.
    Ready { at: Millis },
    /// `mark_draining`: no new frames.
    Draining,
    /// `mark_ended`: charges the final blocks.
    Ended { at: Millis, reason: EndReason },
}

impl Write {
    /// Lifecycle order: a later write waits for an earlier one.
    fn rank(&self) -> u8 {
        match self {
            Write::Starting { .. } => 0,
            Write::Ready { .. } => 1,
            Write::Draining => 2,
            Write::Ended { .. } => 3,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Write::Starting { .. } => "marking starting",
            Write::Ready { .. } => "marking ready",
            Write::Draining => "marking draining",
            Write::Ended { .. } => "ending the lease",
        }
    }
}

/// Ledger writes that failed (the ledger could not be read or written),
/// kept per lease in lifecycle order and retried every tick: a lease's
/// billing start, or its end, is never dropped because one write failed.
#[derive(Debug, Default)]
pub(super) struct PendingWrites {
    pub(super) by_lease: BTreeMap<LeaseId, Vec<Write>>,
}

impl PendingWrites {
    pub(super) fn is_pending(&self, lease: LeaseId) -> bool {
        self.by_lease.contains_key(&lease)
    }

    /// Queues `w` behind the lease's earlier pending writes. An end makes
    /// the pending `ready`/`draining` moot (a pending start stays: the
    /// billing start must be written before the end).
    pub(super) fn push(&mut self, lease: LeaseId, w: Write) {
        let q = self.by_lease.entry(lease).or_default();
        if matches!(w, Write::Ended { .. }) {
            q.retain(|p| matches!(p, Write::Starting { .. }));
        }
        if !q.iter().any(|p| p.rank() >= w.rank()) {
            q.push(w);
        }
    }
}

impl<P: LeaseSource> Shell<P> {
    /// Writes `w` to the ledger now, or queues it to retry next tick when
    /// an earlier write of the lease is still pending or the ledger fails.
    /// A write the lifecycle refuses (the lease already moved past it, or
    /// ended) is moot and dropped.
    pub(super) fn write(&mut self, lease: LeaseId, w: Write) {
        if self.writes.is_pending(lease) {
            debug!(%lease, write = w.name(), "queued behind an earlier ledger write");
            self.writes.push(lease, w);
            return;
        }
        if let Err(e) = self.try_write(lease, &w) {
            warn!(%lease, "{}: {e}; retried every tick", w.name());
            self.writes.push(lease, w);
        }
    }

    /// One ledger write: `Err` only when it should be retried.
    fn try_write(&mut self, lease: LeaseId, w: &Write) -> Result<(), LedgerError> {
        let r = match w {
            Write::Starting { at, pid, data } => {
                self.ledger.mark_starting(lease, *at, *pid, data.as_deref())
            }
            Write::Ready { at } => self.ledger.mark_ready(lease, *at),
            Write::Draining => self.ledger.mark_draining(lease),
            Write::Ended { at, reason } => self.ledger.mark_ended(lease, *at, *reason).map(|last| {
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

    /// Retries the pending ledger writes, each lease's in lifecycle order.
    pub(super) fn flush_writes(&mut self) {
        let leases: Vec<LeaseId> = self.writes.by_lease.keys().copied().collect();
        for lease in leases {
            let queue = self.writes.by_lease.remove(&lease).unwrap_or_default();
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
            if !left.is_empty() {
                self.writes.by_lease.insert(lease, left);
            }
        }
    }
}
