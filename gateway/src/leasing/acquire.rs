//! The shell's acquisitions: a lease recorded `requested`, asked of the
//! provider on a task of its own, and its answer (ready, failed, or
//! refused, with the backoff after a failed start).

use tidegate_lease::autoscale::{self, Action, Event};
use tidegate_lease::ledger::NewLease;
use tidegate_lease::provider::{Acquired, LeaseSpec, ProviderError};
use tidegate_lease::table::LeaseEntry;
use tidegate_lease::{EndReason, LeaseId, LeaseState, LeaseToken, Millis, Tier};
use tracing::{debug, info, warn};

use super::LeaseSource;
use super::book::{Acquiring, LedgerWrite};
use super::shell::Shell;
use crate::hub::HubMsg;

impl<P: LeaseSource> Shell<P> {
    /// Asks the provider for a lease: recorded `requested`, then answered
    /// on a task of its own ([`Shell::acquire_answered`]).
    pub(super) fn acquire(
        &mut self,
        now: Millis,
        model: String,
        instance_type: &str,
        tier: Tier,
        reason: autoscale::AcquireReason,
        depth: u32,
    ) {
        let Some(instance) = self.catalog.get(instance_type).cloned() else {
            warn!(
                instance_type,
                "autoscaler asked for a type not in the catalog"
            );
            return;
        };
        let token = match LeaseToken::generate() {
            Ok(t) => t,
            Err(e) => {
                warn!("cannot generate a lease token: {e}");
                return;
            }
        };
        let id = match self.ledger.insert_requested(&NewLease {
            provider: self.provider.name(),
            model: Some(&model),
            instance: &instance,
            tier,
            currency: &self.catalog.currency,
            requested_at: now,
            token: Some(token.digest()),
        }) {
            Ok(id) => id,
            Err(e) => {
                warn!("recording a lease request: {e}");
                return;
            }
        };
        let spec = LeaseSpec {
            lease: id,
            token: token.clone(),
            instance: instance.clone(),
            tier,
            preempt_after: None,
        };
        let answer = self.provider.acquire(spec);
        let task = self.acquiring.spawn(answer);
        debug!(lease = %id, model, instance_type, tier = tier.as_str(), ?reason, "lease requested");
        let asked = Acquiring {
            model,
            instance,
            tier,
            reason,
            token,
            depth,
            early: Vec::new(),
            release_wanted: false,
        };
        if !self.book.acquire_started(task.id(), id, asked) {
            // a fresh ledger row and task each time: never so
            warn!(lease = %id, "an acquire of this lease is already under way; this one's answer is dropped");
            task.abort();
        }
    }

    /// The provider's answer to an acquire: the lease starts (billing from
    /// now), or it ends `failed`; a refusal for lack of capacity lets the
    /// autoscaler choose another type or tier.
    pub(super) async fn acquire_answered(
        &mut self,
        joined: Result<(tokio::task::Id, Result<Acquired, ProviderError>), tokio::task::JoinError>,
    ) {
        let (task, answer) = match joined {
            Ok((task, answer)) => (task, Ok(answer)),
            Err(e) => (e.id(), Err(e.to_string())),
        };
        let Some((id, a)) = self.book.acquire_answered(&task) else {
            return;
        };
        let now = self.now_ms();
        let (model, instance_type, tier) = (a.model.as_str(), a.instance.name.as_str(), a.tier);
        let answer = match answer {
            Ok(answer) => answer,
            Err(panicked) => {
                // the provider may have started a worker before the task
                // failed: it is released like any other (a provider that
                // holds nothing answers at once), then the lease ends
                // failed; a release that fails is retried, the lease
                // `requested` meanwhile, since its worker may bill
                warn!(lease = %id, model, instance_type, "acquire task failed: {panicked}; releasing whatever its provider may have started");
                self.metrics
                    .lease_acquires
                    .with_label_values(&[tier.as_str(), "error"])
                    .inc();
                self.releases.schedule(id, self.mono(), EndReason::Failed);
                self.start_failed();
                return;
            }
        };
        match answer {
            Ok(acq) => self.acquired(id, a, acq, now).await,
            Err(e) => self.acquire_failed(id, a, e, now).await,
        }
    }

    /// The provider started lease `id` (asked for as `a`): it is recorded
    /// starting (billing from now), a static worker is bound, and what
    /// happened to it meanwhile (early events, a release asked for) is
    /// carried out.
    async fn acquired(&mut self, id: LeaseId, a: Acquiring, acq: Acquired, now: Millis) {
        let (model, instance_type, tier, reason) =
            (a.model.as_str(), a.instance.name.as_str(), a.tier, a.reason);
        let static_name = self
            .provider
            .listed()
            .and_then(|p| p.worker_of(id).map(|w| w.name.clone()));
        // a static worker already connected holds its lease's
        // (its own) token from now on; registered, it is ready
        let link = static_name
            .as_ref()
            .and_then(|n| self.static_links.get(n).copied());
        let entry = LeaseEntry {
            id,
            instance_type: a.instance.name.clone(),
            tier,
            state: LeaseState::Starting,
            token: acq.token.unwrap_or_else(|| a.token.digest()),
            claimed: link.is_some(),
        };
        if let Err(e) = self.table.insert(entry) {
            warn!(lease = %id, "lease table: {e}");
        }
        // its worker runs: a billing start that fails to be written
        // is retried, never dropped
        self.write(
            id,
            LedgerWrite::Starting {
                at: now,
                pid: acq.pid,
                data: acq.provider_data,
            },
        );
        info!(lease = %id, model, instance_type, tier = tier.as_str(), ?reason, pid = ?acq.pid, "lease acquired");
        self.metrics
            .lease_acquires
            .with_label_values(&[tier.as_str(), "ok"])
            .inc();
        if let Some(name) = static_name {
            self.static_names.insert(id, name.clone());
            if link.is_some()
                && let Err(e) = self.ledger.set_token_claimed(id, true)
            {
                warn!(lease = %id, "recording the token claim: {e}");
            }
            info!(lease = %id, worker = %name, connected = link.is_some(), "static worker bound");
            self.hub
                .send(HubMsg::LeaseBound {
                    lease: id,
                    worker_name: name,
                })
                .await;
            if link == Some(true) {
                self.lease_registered(id);
            }
        }
        for ev in a.early {
            Box::pin(self.on_provider_event(ev)).await;
        }
        if a.release_wanted && !self.stopping {
            Box::pin(self.execute(now, vec![Action::Release { lease: id }], 0)).await;
        }
    }

    /// The provider refused or failed lease `id` (asked for as `a`): it
    /// ends, `no_capacity` (the autoscaler hears of it and asks for
    /// something else, within a bounded chain) or `failed` (acquisitions
    /// pause).
    async fn acquire_failed(&mut self, id: LeaseId, a: Acquiring, e: ProviderError, now: Millis) {
        let (model, instance_type, tier) = (a.model.as_str(), a.instance.name.as_str(), a.tier);
        warn!(lease = %id, model, instance_type, tier = tier.as_str(), "acquire failed: {e}");
        if !a.early.is_empty() {
            debug!(lease = %id, events = ?a.early, "events for a lease whose acquire failed dropped");
        }
        let refused = matches!(e, ProviderError::NoCapacity { .. });
        let reason = if refused {
            EndReason::NoCapacity
        } else {
            EndReason::Failed
        };
        self.end(id, now, reason);
        let result = if refused { "no_capacity" } else { "error" };
        self.metrics
            .lease_acquires
            .with_label_values(&[tier.as_str(), result])
            .inc();
        if !refused {
            self.start_failed();
        } else {
            // the autoscaler hears of every refusal: it asks for
            // that model, type and tier again only after a cool-off
            // (spot: another type's spot, or on-demand, meanwhile), so
            // a full fleet
            // or quota is not asked, and recorded `failed`, every
            // tick; what it asks instead is carried out within a
            // bounded chain of refusals
            let more = self.autoscaler.on_event(
                now,
                Event::AcquireRefused {
                    model: a.model.clone(),
                    instance_type: a.instance.name.clone(),
                    tier,
                },
            );
            if a.depth < 2 {
                Box::pin(self.execute(now, more, a.depth + 1)).await;
            }
        }
    }

    /// A lease failed to start: pause acquisitions, longer each time.
    pub(super) fn start_failed(&mut self) {
        let pause_ms = self.backoff.start_failed(self.mono());
        warn!(pause_ms, "a lease failed to start; acquisitions paused");
    }
}
