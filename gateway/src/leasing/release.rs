//! The shell's provider releases: those due, each on a task of its own,
//! and how each ended (the lease ended, or its release retried).

use tidegate_lease::provider::ProviderError;
use tidegate_lease::{EndReason, LeaseId};
use tracing::{debug, warn};

use super::LeaseSource;
use super::ReleaseOutcome;
use super::shell::Shell;
use crate::hub::HubMsg;

/// What a provider release came to.
pub(super) enum Released {
    /// The worker is gone (or the provider no longer holds the lease).
    Gone,
    /// The provider failed: the worker may still run, and bill.
    Failed(String),
}

impl Released {
    fn of(lease: LeaseId, result: Result<(), ProviderError>) -> Released {
        match result {
            Ok(()) => Released::Gone,
            Err(ProviderError::UnknownLease(_)) => {
                debug!(%lease, "the provider no longer holds it; nothing to release");
                Released::Gone
            }
            Err(e) => Released::Failed(e.to_string()),
        }
    }
}

impl<P: LeaseSource> Shell<P> {
    /// The provider's release of `lease`. A provider that no longer holds
    /// it (its worker ended, and the provider dropped it) has nothing to
    /// release: that is `Gone` too.
    pub(super) async fn provider_release(&mut self, lease: LeaseId) -> Released {
        Released::of(lease, self.provider.release(lease).await)
    }

    /// Releases the leases whose release is due. Their workers all begin
    /// to drain first (a Pod deleted, a job cancelled), then each release
    /// waits for its own on a task of its own (`in_flight`, each recorded
    /// in the book, never two of one lease at once): one after
    /// another, the last of a batch would end only after every drain
    /// before it, past the paid block it was timed to end in, and the
    /// shell would wait for them all. One the provider fails to release
    /// stays draining (in the ledger and the hub) and in the queue,
    /// retried with backoff: it may still bill, so it is never ended while
    /// its worker may run.
    pub(super) async fn release_due(&mut self) {
        let mut due = self.releases.due(self.mono());
        for lease in &due {
            self.releases.start(*lease);
        }
        // a try still under way (its lease ended and was queued again
        // meanwhile) answers for this one: never two at once
        due.retain(|lease| !self.book.is_releasing(*lease));
        if !due.is_empty() {
            self.provider.begin_release(&due).await;
        }
        for lease in due {
            let release = self.provider.release(lease);
            let task = self.in_flight.spawn(async move { (lease, release.await) });
            self.book.release_started(task.id(), lease);
        }
    }

    /// A provider release under way has ended: the lease ends, or its
    /// release is retried with backoff.
    pub(super) async fn release_finished(
        &mut self,
        joined: Result<(tokio::task::Id, ReleaseOutcome), tokio::task::JoinError>,
    ) {
        let (lease, released) = match joined {
            Ok((task, (lease, result))) => {
                self.book.release_answered(&task);
                (lease, Released::of(lease, result))
            }
            Err(e) => {
                let Some(lease) = self.book.release_answered(&e.id()) else {
                    return;
                };
                (
                    lease,
                    Released::Failed(format!("the release task failed: {e}")),
                )
            }
        };
        if !self.releases.is_running(lease) {
            // its provider reported the end meanwhile, and it has ended
            // (or it was queued again since: that is another try's to say)
            debug!(%lease, "release finished for a lease already ended");
            return;
        }
        match released {
            Released::Gone => {
                let reason = self.releases.done(lease).unwrap_or(EndReason::Released);
                if self.static_names.remove(&lease).is_some() {
                    // a static worker is unbound, not gone: it keeps its
                    // connection and waits for another lease
                    self.hub.send(HubMsg::LeaseUnbound { lease }).await;
                } else {
                    // the worker is gone now
                    self.hub.send(HubMsg::LeaseEnded { lease }).await;
                }
                self.end(lease, self.now_ms(), reason);
            }
            Released::Failed(e) => {
                self.metrics.lease_release_failures.inc();
                let now = self.mono();
                let retry_ms = self
                    .releases
                    .failed(lease, now)
                    .map_or(0, |at| at.saturating_sub(now));
                warn!(%lease, retry_ms, "provider release failed; the lease stays draining (it may still bill) and is retried: {e}");
            }
        }
    }
}
