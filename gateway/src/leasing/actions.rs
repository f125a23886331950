//! What the shell carries out: the autoscaler's actions (acquire,
//! release after the grace, stop dispatch), the provider's events (ready,
//! spot notice, end), and a lease's end in the table and the ledger. The
//! decisions are the autoscaler's and the [`LeaseBook`]'s; the acquisitions
//! and releases themselves are `acquire.rs`'s and `release.rs`'s.
//!
//! [`LeaseBook`]: super::book::LeaseBook

use tidegate_lease::autoscale::{Action, Event};
use tidegate_lease::pacing::end_reason_while_releasing;
use tidegate_lease::provider::ProviderEvent;
use tidegate_lease::{EndReason, LeaseId, LeaseState, Millis};
use tracing::{debug, info, warn};

use super::book::LedgerWrite;
use super::shell::Shell;
use super::{LeaseSource, NOTICE_OVERRUN, RELEASE_GRACE};
use crate::hub::HubMsg;

impl<P: LeaseSource> Shell<P> {
    /// Carries out the autoscaler's actions. `depth` bounds the re-entry
    /// through `AcquireRefused`.
    pub(super) async fn execute(&mut self, now: Millis, actions: Vec<Action>, depth: u32) {
        for action in actions {
            match action {
                Action::Acquire {
                    model,
                    instance_type,
                    tier,
                    reason,
                } => {
                    if self.stopping {
                        continue;
                    }
                    if !self.backoff.allows(self.mono()) {
                        debug!(
                            model,
                            instance_type, "acquire held back after start failures"
                        );
                        continue;
                    }
                    self.acquire(now, model, &instance_type, tier, reason, depth);
                }
                Action::Release { lease } if self.book.release_after_answer(lease) => {
                    // not the provider's yet: released once it is
                    debug!(%lease, "release of a lease still being acquired put off until its answer");
                }
                Action::Release { lease } => {
                    let due = self.mono() + RELEASE_GRACE.as_millis() as Millis;
                    if self.releases.contains(lease) {
                        // already being released (or under a spot notice,
                        // perhaps still serving): at most a grace from now
                        if self.serving(lease) {
                            self.drain(lease).await;
                        }
                        self.releases.schedule(lease, due, EndReason::Released);
                        continue;
                    }
                    info!(%lease, "releasing lease: dispatch stopped, ends after its batches");
                    self.drain(lease).await;
                    self.releases.schedule(lease, due, EndReason::Released);
                }
                Action::StopDispatch { lease, at } if at > now => {
                    // it serves on through its notice until then
                    let at = self.mono() + (at - now);
                    self.book.drain_at(lease, at);
                }
                Action::StopDispatch { lease, .. } => {
                    info!(%lease, "dispatch to lease stopped");
                    self.drain(lease).await;
                }
            }
        }
    }

    /// Dispatch stops to the leases under a spot notice whose drain is due.
    pub(super) async fn drains_due(&mut self) {
        for lease in self.book.drains_due(self.mono()) {
            if self.serving(lease) {
                info!(%lease, "spot notice: dispatch to lease stopped before its deadline");
                self.drain(lease).await;
            }
        }
    }

    /// Whether the lease is starting or ready (dispatch not yet stopped).
    fn serving(&self, lease: LeaseId) -> bool {
        matches!(
            self.state(lease),
            Some(LeaseState::Starting | LeaseState::Ready)
        )
    }

    /// The hub stops dispatching to the lease's worker; a starting or
    /// ready lease is `draining`.
    pub(super) async fn drain(&mut self, lease: LeaseId) {
        self.hub.send(HubMsg::LeaseDraining { lease }).await;
        if self.serving(lease) {
            self.write(lease, LedgerWrite::Draining);
            let _ = self.table.transition(lease, LeaseState::Draining);
        }
    }

    /// What the provider reports: a worker ready, a spot notice (drained
    /// and replaced, released should the provider never end it), an end.
    pub(super) async fn on_provider_event(&mut self, ev: ProviderEvent) {
        // one for a lease still being acquired waits for its answer
        let Some(ev) = self.book.hold_early(ev) else {
            return;
        };
        let now = self.now_ms();
        match ev {
            ProviderEvent::Ready { lease } => {
                if self.state(lease) == Some(LeaseState::Starting) {
                    self.write(lease, LedgerWrite::Ready { at: now });
                    let _ = self.table.transition(lease, LeaseState::Ready);
                }
            }
            ProviderEvent::PreemptionNotice { lease, deadline } => {
                if self.state(lease).is_none_or(|s| s.is_ended()) {
                    // a late notice for a lease that ended (its release
                    // may still be finishing): nothing to drain or replace
                    debug!(%lease, deadline, "spot preemption notice for a lease not live; ignored");
                    return;
                }
                warn!(%lease, deadline, "spot preemption notice: replacing; serving until a drain before the deadline");
                let actions = self
                    .autoscaler
                    .on_event(now, Event::PreemptionNotice { lease, deadline });
                self.execute(now, actions, 0).await;
                // The provider ends it at the deadline. Should it not (a
                // preemption called off, an end never reported), nothing
                // else would ever release a draining lease: release it
                // then, rather than let it bill unwatched.
                let due = self.mono()
                    + deadline.saturating_sub(now)
                    + NOTICE_OVERRUN.as_millis() as Millis;
                self.releases.schedule(lease, due, EndReason::Preempted);
            }
            ProviderEvent::Ended {
                lease,
                reason,
                detail,
            } => {
                if self.state(lease).is_some_and(|s| s.is_ended()) {
                    // we ended it first (a release racing the provider's
                    // own report of the end)
                    debug!(%lease, reason = reason.as_str(), %detail, "provider reports the end of a lease already ended");
                    self.update_metrics(now);
                    return;
                }
                let releasing = self.releases.done(lease);
                if releasing.is_none()
                    && matches!(
                        self.state(lease),
                        Some(LeaseState::Requested | LeaseState::Starting)
                    )
                {
                    self.start_failed();
                }
                let reason = match releasing {
                    Some(intended) => end_reason_while_releasing(intended, reason),
                    None => reason,
                };
                warn!(%lease, reason = reason.as_str(), %detail, "lease ended by its provider");
                self.static_names.remove(&lease);
                self.hub.send(HubMsg::LeaseEnded { lease }).await;
                self.end(lease, now, reason);
            }
        }
        self.update_metrics(now);
    }

    /// Ends a lease in the table at once and in the ledger (retried if the
    /// ledger fails), once.
    pub(super) fn end(&mut self, lease: LeaseId, now: Millis, reason: EndReason) {
        if self.state(lease).is_some_and(|s| s.is_ended()) && !self.book.write_waits(lease) {
            return;
        }
        // counted once, when it ends: a lease whose acquire failed is in
        // the ledger only
        let tier = match self.table.get(lease) {
            Some(e) if e.state.is_ended() => None,
            Some(e) => Some(e.tier),
            None => match self.ledger.lease(lease) {
                Ok(Some(r)) if !r.state.is_ended() => Some(r.tier),
                _ => None,
            },
        };
        if let Some(tier) = tier {
            self.metrics
                .lease_ends
                .with_label_values(&[tier.as_str(), reason.as_str()])
                .inc();
        }
        let _ = self.table.transition(lease, LeaseState::Ended(reason));
        self.write(lease, LedgerWrite::Ended { at: now, reason });
        self.book.ended(lease);
    }
}
