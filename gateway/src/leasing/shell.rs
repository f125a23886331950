//! The [`Shell`] actor: its state, its loop (inbox, provider events,
//! ticks, releases and acquisitions under way), worker authentication,
//! the autoscaler's actions, and the leasing metrics.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use tidegate_lease::autoscale::{self, Action, Autoscaler, Event, ModelLoad, Observation};
use tidegate_lease::catalog::InstanceType;
use tidegate_lease::ledger::Ledger;
use tidegate_lease::pacing::{
    AcquireBackoff, ReleaseQueue, end_reason_while_releasing, start_timed_out,
};
use tidegate_lease::provider::{Acquired, ProviderError, ProviderEvent, wall_clock_ms};
use tidegate_lease::table::ClaimError;
use tidegate_lease::{
    Catalog, EndReason, LeaseId, LeaseState, LeaseTable, LeaseToken, Millis, Tier,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::release::Released;
use super::writes::{PendingWrites, Write};
use super::{
    DEFAULT_BUDGET_MS, LeaseSource, LeasingMsg, NETWORK_MS, NOTICE_OVERRUN, RELEASE_GRACE, Refusal,
    ReleaseOutcome, ReleaseRefused, SEEN_EVERY, STALL_WINDOW, WorkerPass,
};
use crate::config::{OnStop, ScaledModel};
use crate::hub::{Hub, HubMsg, LoadReport};
use crate::metrics::Metrics;

/// The shell over its provider `P`, which it knows only as a
/// [`LeaseSource`].
pub(super) struct Shell<P> {
    pub(super) autoscaler: Autoscaler,
    pub(super) catalog: Catalog,
    pub(super) models: Vec<ScaledModel>,
    pub(super) ledger: Ledger,
    pub(super) table: LeaseTable,
    pub(super) provider: P,
    pub(super) hub: Hub,
    pub(super) metrics: Metrics,
    /// What a clean stop does with the live leases.
    pub(super) on_stop: OnStop,
    /// Throughput at the SLO measured from registered workers' profiles,
    /// by (model, instance type).
    pub(super) measured: HashMap<(String, String), f64>,
    /// Static provider: the worker name bound to each lease.
    pub(super) static_names: HashMap<LeaseId, String>,
    /// Static provider: the listed workers connected now, by name, and
    /// whether each has registered.
    pub(super) static_links: HashMap<String, bool>,
    /// Start of the monotonic clock of the pacing decisions.
    pub(super) epoch: tokio::time::Instant,
    /// Leases whose dispatch stopped, with when their provider release is
    /// due (or retried), on the monotonic clock.
    pub(super) releases: ReleaseQueue,
    /// Acquisitions paused after leases failed to start (monotonic clock).
    pub(super) backoff: AcquireBackoff,
    /// Ledger writes to retry.
    pub(super) writes: PendingWrites,
    pub(super) last_tick: Option<Millis>,
    /// When the connected workers were last written to the ledger as seen
    /// (monotonic clock).
    pub(super) seen_written: Option<Millis>,
    /// GPU time spent running batches, and leased (billing started), since
    /// this gateway started (ms).
    pub(super) busy_ms: f64,
    pub(super) leased_ms: f64,
    /// Cost per tier already added to `tidegate_cost_total`.
    pub(super) cost_seen: BTreeMap<Tier, f64>,
    /// A lease whose worker has not registered this long after it was
    /// requested is ended as `failed` and released (ms).
    pub(super) start_timeout_ms: Millis,
    /// Ready leases whose worker's connection is gone, with since when
    /// (monotonic clock; adopted leases from the start).
    pub(super) absent: HashMap<LeaseId, Millis>,
    /// A ready lease whose worker has been gone this long is ended as
    /// `lost` and released (ms).
    pub(super) rejoin_timeout_ms: Millis,
    /// When each live lease's worker was last dropped as stalled
    /// (monotonic clock).
    pub(super) stalls: HashMap<LeaseId, Millis>,
    /// Provider releases under way, each on a task of its own: a Pod's
    /// grace period or a job's drain never holds up the shell (worker
    /// logins, the API, ticks, spot notices and the acquisitions that
    /// replace a preempted lease).
    pub(super) in_flight: tokio::task::JoinSet<ReleaseOutcome>,
    /// The lease of each task in `in_flight`.
    pub(super) in_flight_leases: HashMap<tokio::task::Id, LeaseId>,
    /// Provider acquisitions under way, each on a task of its own, as the
    /// releases: an API server or `sbatch` slow to answer holds up nothing
    /// else (each provider bounds its calls).
    pub(super) acquiring: tokio::task::JoinSet<Result<Acquired, ProviderError>>,
    /// The lease of each task in `acquiring`.
    pub(super) acquiring_tasks: HashMap<tokio::task::Id, LeaseId>,
    /// What each lease under way was asked for.
    pub(super) acquiring_leases: HashMap<LeaseId, Acquiring>,
    /// Shutting down: the autoscaler's acquisitions are no longer made.
    pub(super) stopping: bool,
}

/// An acquire under way: the lease is `requested` in the ledger, and not in
/// the table until the provider has answered.
pub(super) struct Acquiring {
    pub(super) model: String,
    pub(super) instance: InstanceType,
    pub(super) tier: Tier,
    pub(super) reason: autoscale::AcquireReason,
    pub(super) token: LeaseToken,
    /// Its place in a chain of refusals (`AcquireRefused`).
    pub(super) depth: u32,
    /// Its provider's events that came before the answer (its worker may
    /// end, or its spot node be reclaimed, that soon): handled after it.
    pub(super) early: Vec<ProviderEvent>,
    /// The autoscaler released it before the answer: released after it.
    pub(super) release_wanted: bool,
}

impl<P: LeaseSource> Shell<P> {
    /// The monotonic clock of the pacing decisions (ms since the shell
    /// started).
    pub(super) fn mono(&self) -> Millis {
        self.epoch.elapsed().as_millis() as Millis
    }

    pub(super) async fn run(
        mut self,
        mut rx: mpsc::Receiver<LeasingMsg>,
        mut events: mpsc::Receiver<ProviderEvent>,
        tick: Duration,
        cancel: CancellationToken,
    ) {
        // leases adopted while draining: the hub drains their workers
        for lease in self.releases.leases() {
            self.hub.send(HubMsg::LeaseDraining { lease }).await;
        }
        let mut ticker = tokio::time::interval(tick);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            // provider releases run on their own timer, not the tick's: a
            // release is due RELEASE_GRACE after its decision
            let release_at = self
                .releases
                .next_due()
                .map(|at| self.epoch + Duration::from_millis(at));
            let far = tokio::time::Instant::now() + Duration::from_secs(3600);
            tokio::select! {
                _ = cancel.cancelled() => break,
                msg = rx.recv() => match msg {
                    Some(m) => self.handle(m).await,
                    None => break,
                },
                ev = events.recv() => match ev {
                    Some(e) => self.on_provider_event(e).await,
                    None => break,
                },
                _ = ticker.tick() => self.tick().await,
                _ = tokio::time::sleep_until(release_at.unwrap_or(far)), if release_at.is_some() => {
                    self.release_due().await;
                    self.update_metrics(wall_clock_ms());
                }
                Some(joined) = self.acquiring.join_next_with_id(), if !self.acquiring.is_empty() => {
                    self.acquire_answered(joined).await;
                    self.update_metrics(wall_clock_ms());
                }
                Some(joined) = self.in_flight.join_next_with_id(), if !self.in_flight.is_empty() => {
                    self.release_finished(joined).await;
                    self.update_metrics(wall_clock_ms());
                }
            }
        }
        self.shutdown().await;
    }

    /// Clean shutdown: every held lease is released and ended (its worker
    /// would exit anyway once the gateway closes its connection). A lease
    /// whose provider release fails is left live in the ledger, since it
    /// may still bill: the next start adopts it (and releases it) or ends
    /// it if its worker is gone. With `on_stop = "keep"` only the leases
    /// already draining are released; the others stay live, their workers
    /// running, for the next start to adopt.
    async fn shutdown(mut self) {
        // what the workers did since the last tick reaches the ledger too
        if let Some(report) = self.hub.unreported().await {
            self.record(wall_clock_ms(), &report);
        }
        // the acquisitions under way are answered first (each within its
        // provider's deadline): a worker that was started is released below
        self.stopping = true;
        // named in the log, so that a stop that takes long says what it
        // waits for
        info!(
            acquiring = self.acquiring.len(),
            releasing = self.in_flight.len(),
            "lease manager stopping: waiting for the acquisitions and releases under way"
        );
        while let Some(joined) = self.acquiring.join_next_with_id().await {
            self.acquire_answered(joined).await;
        }
        // the releases under way end first (each within its provider's
        // release timeout); one that failed is tried again below
        while let Some(joined) = self.in_flight.join_next_with_id().await {
            self.release_finished(joined).await;
        }
        self.flush_writes();
        let mut live: BTreeSet<LeaseId> = self
            .table
            .entries()
            .iter()
            .filter(|e| !e.state.is_ended())
            .map(|e| e.id)
            .collect();
        match self.ledger.live_leases() {
            Ok(recs) => live.extend(recs.iter().map(|r| r.id)),
            Err(e) => warn!("reading live leases at shutdown: {e}; releasing the ones in memory"),
        }
        let keep = self.on_stop == OnStop::Keep;
        let mut held_on = Vec::new();
        if keep {
            // a lease on its way out (released, or under a spot notice) goes
            live.retain(|id| {
                let draining = self.table.get(*id).map(|e| e.state) == Some(LeaseState::Draining);
                if !draining {
                    held_on.push(*id);
                }
                draining
            });
        }
        let released: Vec<LeaseId> = live.iter().copied().collect();
        info!(leases = ?released, "lease manager stopping: releasing the live leases");
        // every worker drains at once, then each release waits for its own
        self.provider.begin_release(&released).await;
        let mut kept = Vec::new();
        for lease in live {
            match self.provider_release(lease).await {
                Released::Gone => {
                    let reason = self.releases.done(lease).unwrap_or(EndReason::Released);
                    self.end(lease, wall_clock_ms(), reason);
                }
                Released::Failed(e) => {
                    self.metrics.lease_release_failures.inc();
                    warn!(%lease, "release at shutdown failed; the lease stays live in the ledger, and the next start adopts or ends it: {e}");
                    kept.push(lease);
                }
            }
        }
        self.flush_writes();
        if let Err(e) = self.ledger.accrue(wall_clock_ms()) {
            warn!("accruing cost at shutdown: {e}");
        }
        let unwritten: Vec<LeaseId> = self.writes.by_lease.keys().copied().collect();
        if keep {
            // stop watching without ending anything: the workers run on
            self.provider.detach().await;
            info!(
                kept = ?held_on,
                released = ?released,
                not_released = ?kept,
                ?unwritten,
                "lease manager stopped; leases kept live for the next start to adopt (on_stop = keep)"
            );
        } else if kept.is_empty() && unwritten.is_empty() {
            info!("lease manager stopped; every lease released");
        } else {
            warn!(
                ?kept,
                ?unwritten,
                "lease manager stopped; some leases were not released or not recorded ended"
            );
        }
    }

    async fn handle(&mut self, msg: LeasingMsg) {
        match msg {
            LeasingMsg::Authenticate { name, token, reply } => {
                let _ = reply.send(self.authenticate(&name, &token));
            }
            LeasingMsg::Registered { lease } => self.lease_registered(lease),
            LeasingMsg::StaticRegistered { name } => {
                if let Some(registered) = self.static_links.get_mut(&name) {
                    *registered = true;
                }
                let bound = self.provider.listed().and_then(|p| p.bound_lease(&name));
                match bound {
                    Some(lease) => self.lease_registered(lease),
                    None => {
                        info!(worker = %name, "static worker registered unbound; it waits for a lease")
                    }
                }
            }
            LeasingMsg::StaticDisconnected { name } => {
                self.static_links.remove(&name);
                if let Some(p) = self.provider.listed_mut()
                    && let Some(lease) = p.bound_lease(&name)
                {
                    // a static worker's link is all we know of it: losing
                    // it ends the lease (the provider reports it lost), and
                    // frees the worker to be bound again when it returns
                    info!(%lease, worker = %name, "static worker disconnected; its lease is lost");
                    if let Err(e) = p.worker_disconnected(lease) {
                        debug!(%lease, "static worker disconnected: {e}");
                    }
                } else {
                    info!(worker = %name, "unbound static worker disconnected");
                }
            }
            LeasingMsg::Disconnected { lease } => {
                info!(%lease, "leased worker disconnected");
                if let Some(p) = self.provider.listed_mut() {
                    // a static worker's link is all we know of it: losing
                    // it ends the lease, and frees the worker to be bound
                    // again when it returns
                    if let Err(e) = p.worker_disconnected(lease) {
                        debug!(%lease, "static worker disconnected: {e}");
                    }
                } else {
                    self.rearm(lease);
                    if self.state(lease) == Some(LeaseState::Ready) {
                        let now = self.mono();
                        self.absent.entry(lease).or_insert(now);
                    }
                }
            }
            LeasingMsg::Leases {
                live_only,
                limit,
                reply,
            } => {
                let _ = reply.send(
                    self.ledger
                        .leases(live_only, limit)
                        .map_err(|e| e.to_string()),
                );
            }
            LeasingMsg::Costs {
                from,
                to,
                split,
                reply,
            } => {
                // up to the moment asked, not the last tick; not while a
                // write waits for a retry (the ledger may be locked), which
                // the next tick makes
                if self.writes.by_lease.is_empty()
                    && let Err(e) = self.ledger.accrue(wall_clock_ms())
                {
                    warn!("accruing cost: {e}");
                }
                let report = if split {
                    self.ledger.costs(from, to)
                } else {
                    self.ledger.cost_totals(from, to)
                };
                let _ = reply.send(report.map_err(|e| e.to_string()));
            }
            LeasingMsg::Release { lease, reply } => {
                let in_ledger = self.ledger.lease(lease).ok().flatten().is_some();
                let answer = match self.state(lease) {
                    None if self.acquiring_leases.contains_key(&lease) => {
                        Err(ReleaseRefused::NotYetStarted(lease))
                    }
                    None if in_ledger => Err(ReleaseRefused::Ended(lease)),
                    None => Err(ReleaseRefused::Unknown(lease)),
                    Some(LeaseState::Ended(_)) => Err(ReleaseRefused::Ended(lease)),
                    Some(LeaseState::Requested) => Err(ReleaseRefused::NotYetStarted(lease)),
                    Some(_) => {
                        info!(%lease, "operator releases the lease");
                        self.execute(wall_clock_ms(), vec![Action::Release { lease }], 0)
                            .await;
                        Ok(())
                    }
                };
                let _ = reply.send(answer);
            }
        }
    }

    /// A process or Slurm worker's connection is gone while its lease
    /// lives (its link dropped, or the gateway lost its heartbeats): its
    /// token is re-armed so that the same worker may redial and register
    /// again under the same lease instead of exiting on "already used" and
    /// wasting the paid block. Only that lease's token is accepted, and
    /// only for one connection at a time: the claim is re-armed once the
    /// previous connection has gone. If the worker is really gone, its
    /// provider reports the end.
    fn rearm(&mut self, lease: LeaseId) {
        if self.state(lease).is_none_or(|s| s.is_ended()) {
            return;
        }
        match self.table.rearm_claim(lease) {
            Ok(()) => {
                debug!(%lease, "token re-armed: its worker may register again");
                if let Err(e) = self.ledger.set_token_claimed(lease, false) {
                    warn!(%lease, "recording the re-armed token: {e}");
                }
            }
            Err(e) => debug!(%lease, "token not re-armed: {e}"),
        }
    }

    /// The lease's worker registered (its models are warm): `ready`.
    pub(super) fn lease_registered(&mut self, lease: LeaseId) {
        self.absent.remove(&lease);
        let now = wall_clock_ms();
        if self.state(lease) == Some(LeaseState::Starting) {
            self.write(lease, Write::Ready { at: now });
            let _ = self.table.transition(lease, LeaseState::Ready);
            info!(%lease, "lease ready: its worker registered");
            self.backoff.reset();
        }
        if let Some(p) = self.provider.listed()
            && let Err(e) = p.worker_registered(lease)
        {
            debug!(%lease, "static worker registered: {e}");
        }
        self.update_metrics(now);
    }

    fn authenticate(&mut self, name: &str, token: &str) -> Option<Result<WorkerPass, Refusal>> {
        let Some(n) = name.strip_prefix("lease-") else {
            return self.authenticate_static(name, token);
        };
        let Ok(n) = n.parse::<u64>() else {
            return Some(Err(format!(
                "a leased worker's name is lease-<id>; '{name}' is not"
            )
            .into()));
        };
        let id = LeaseId(n);
        if self.acquiring_leases.contains_key(&id) {
            // its worker came up before its provider's answer did
            return Some(Err(Refusal::later(format!(
                "lease {id} is still being acquired"
            ))));
        }
        match self.table.claim(id, &LeaseToken::from_secret(token)) {
            Ok(()) => {
                if let Err(e) = self.ledger.set_token_claimed(id, true) {
                    warn!(lease = %id, "recording the token claim: {e}");
                }
                Some(Ok(WorkerPass::Lease(id)))
            }
            // A second connection while the first still holds the claim:
            // the first may be a dead link not yet noticed (heartbeats end
            // it within seconds), so the worker may retry.
            Err(e @ ClaimError::AlreadyClaimed(_)) => Some(Err(Refusal::later(e.to_string()))),
            Err(e) => Some(Err(e.to_string().into())),
        }
    }

    /// A listed static worker connects with its own token, bound to a lease
    /// or not, one connection at a time; `None` for a name not listed.
    fn authenticate_static(
        &mut self,
        name: &str,
        token: &str,
    ) -> Option<Result<WorkerPass, Refusal>> {
        let p = self.provider.listed()?;
        if !p.is_listed(name) {
            return None;
        }
        let token = LeaseToken::from_secret(token);
        if !p.token_matches(name, &token) {
            return Some(Err(format!(
                "static worker '{name}': its token does not match its token_sha256 in [[leasing.static_workers]]"
            )
            .into()));
        }
        if self.static_links.contains_key(name) {
            return Some(Err(Refusal::later(format!(
                "static worker '{name}' is already connected; one connection at a time (retry once the old connection has ended)"
            ))));
        }
        let bound = p.bound_lease(name);
        self.static_links.insert(name.to_string(), false);
        if let Some(lease) = bound {
            // its lease's token is the worker's own: claimed by this link
            match self.table.claim(lease, &token) {
                Ok(()) => {
                    if let Err(e) = self.ledger.set_token_claimed(lease, true) {
                        warn!(%lease, "recording the token claim: {e}");
                    }
                }
                Err(e) => debug!(%lease, "static worker's claim: {e}"),
            }
        }
        Some(Ok(WorkerPass::Static(name.to_string())))
    }

    fn state(&self, lease: LeaseId) -> Option<LeaseState> {
        self.table.get(lease).map(|e| e.state)
    }

    pub(super) async fn on_provider_event(&mut self, ev: ProviderEvent) {
        let lease = match &ev {
            ProviderEvent::Ready { lease }
            | ProviderEvent::PreemptionNotice { lease, .. }
            | ProviderEvent::Ended { lease, .. } => *lease,
        };
        if let Some(a) = self.acquiring_leases.get_mut(&lease) {
            a.early.push(ev);
            return;
        }
        let now = wall_clock_ms();
        match ev {
            ProviderEvent::Ready { lease } => {
                if self.state(lease) == Some(LeaseState::Starting) {
                    self.write(lease, Write::Ready { at: now });
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
                warn!(%lease, deadline, "spot preemption notice: draining, replacing");
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
        if self.state(lease).is_some_and(|s| s.is_ended()) && !self.writes.is_pending(lease) {
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
        self.write(lease, Write::Ended { at: now, reason });
        self.absent.remove(&lease);
        self.stalls.remove(&lease);
    }

    async fn tick(&mut self) {
        let now = wall_clock_ms();
        self.flush_writes();
        let names: Vec<String> = self.models.iter().map(|m| m.name.clone()).collect();
        let Some(report) = self.hub.load_report(names).await else {
            return;
        };
        self.record(now, &report);
        // before anything that may fail: the hub reports a stall once
        self.replace_unserving(&report.stalled).await;
        let live = match self.ledger.live_leases() {
            Ok(l) => l,
            Err(e) => {
                warn!("reading live leases: {e}");
                return;
            }
        };
        if let Some(last) = self.last_tick {
            for r in &live {
                if let Some(start) = r.billing_start {
                    let paid = now.saturating_sub(start.max(last)) as f64;
                    self.leased_ms += paid;
                    self.metrics.leased_paid.inc_by(paid / 1e3);
                }
            }
        }
        self.last_tick = Some(now);
        // A worker that never registers must not count as capacity forever.
        // By the table's state: the ledger's lags while a write waits for a
        // retry, and a lease already ready (or ended) there is not stuck.
        let stuck: Vec<LeaseId> = live
            .iter()
            .filter(|r| {
                let state = self.state(r.id).unwrap_or(r.state);
                start_timed_out(state, r.requested_at, now, self.start_timeout_ms)
            })
            .filter(|r| !self.releases.contains(r.id))
            // its provider has not answered yet (within its own deadline)
            .filter(|r| !self.acquiring_leases.contains_key(&r.id))
            .map(|r| r.id)
            .collect();
        for lease in &stuck {
            warn!(%lease, timeout_secs = self.start_timeout_ms / 1000, "worker never registered; ending the lease as failed");
            self.drain(*lease).await;
            self.releases
                .schedule(*lease, self.mono(), EndReason::Failed);
            self.start_failed();
        }
        // the table is the truth (a ledger write may be pending retry)
        let leases = live
            .iter()
            .map(|r| {
                let mut v = r.view();
                if let Some(s) = self.state(r.id) {
                    v.state = s;
                }
                v
            })
            .collect();
        let obs = Observation {
            models: self.observe(&report),
            leases,
        };
        let actions = self.autoscaler.on_event(now, Event::Tick(obs));
        self.execute(now, actions, 0).await;
        // the start timeouts above are due now
        self.release_due().await;
        if let Err(e) = self.ledger.accrue(now) {
            warn!("accruing cost: {e}");
        }
        self.update_metrics(now);
    }

    /// Ends as `lost`, and releases, the live leases that serve nothing
    /// and never will, so that the autoscaler, no longer counting them,
    /// leases replacements; the release stops them at the provider:
    /// - the ready ones whose worker has been gone for the rejoin timeout
    ///   (a process that hangs or lost its network is never reported ended
    ///   by its provider, and would be paid for while serving nothing);
    /// - those whose worker the hub dropped as stalled (a batch far past
    ///   due) a second time within [`STALL_WINDOW`]. A first stall may be
    ///   a slow first batch of a size the worker never ran (cuDNN's
    ///   algorithm search), and replacing the lease would pay a cold start
    ///   and perhaps a new billing block: the lease is kept, its worker
    ///   registers again once the batch is done. A wedged worker never
    ///   does (it waits for its batch, and its watchdog ends it), so it is
    ///   then absent and replaced by the rejoin timeout, if its provider
    ///   has not reported its end first.
    async fn replace_unserving(&mut self, stalled: &[LeaseId]) {
        let mono = self.mono();
        let live = |shell: &Self, lease: &LeaseId| {
            matches!(
                shell.state(*lease),
                Some(LeaseState::Starting | LeaseState::Ready)
            ) && !shell.releases.contains(*lease)
        };
        let window = STALL_WINDOW.as_millis() as Millis;
        let mut again = Vec::new();
        let stalled: Vec<LeaseId> = stalled.iter().filter(|l| live(self, l)).copied().collect();
        for lease in stalled {
            match self.stalls.insert(lease, mono) {
                Some(first) if mono.saturating_sub(first) <= window => again.push(lease),
                _ => {
                    warn!(%lease, "its worker stalled (a batch far past due); the lease is kept while the worker recovers, and replaced should it stall again within {} min or not register again within rejoin_timeout_secs", window / 60_000)
                }
            }
        }
        let gone: Vec<(LeaseId, Millis)> = self
            .absent
            .iter()
            .filter(|(lease, since)| {
                mono.saturating_sub(**since) >= self.rejoin_timeout_ms && live(self, lease)
            })
            .map(|(lease, since)| (*lease, mono.saturating_sub(*since)))
            .collect();
        for lease in again {
            warn!(%lease, "its worker stalled again; ending the lease as lost and releasing it so that a new one replaces it");
            self.absent.remove(&lease);
            self.drain(lease).await;
            self.releases.schedule(lease, mono, EndReason::Lost);
        }
        for (lease, gone_ms) in gone {
            warn!(%lease, gone_secs = gone_ms / 1000, "its worker has not redialled; ending the lease as lost and releasing it so that a new one replaces it");
            self.absent.remove(&lease);
            self.drain(lease).await;
            self.releases.schedule(lease, mono, EndReason::Lost);
        }
    }

    /// Frames served per lease into the ledger; profiles into throughput.
    fn record(&mut self, now: Millis, report: &LoadReport) {
        let mono = self.mono();
        let every = SEEN_EVERY.as_millis() as Millis;
        if !report.workers.is_empty()
            && self
                .seen_written
                .is_none_or(|at| mono.saturating_sub(at) >= every)
        {
            let ids: Vec<LeaseId> = report.workers.iter().map(|w| w.lease).collect();
            match self.ledger.mark_seen(&ids, now) {
                Ok(()) => self.seen_written = Some(mono),
                Err(e) => warn!("recording which workers are connected: {e}"),
            }
        }
        for (lease, s) in &report.served {
            self.busy_ms += s.busy_us as f64 / 1e3;
            self.metrics.leased_busy.inc_by(s.busy_us as f64 / 1e6);
            let frames = &self.metrics.lease_frames;
            frames
                .with_label_values(&["within_slo"])
                .inc_by(s.within_slo);
            frames.with_label_values(&["late"]).inc_by(s.late);
            if (s.within_slo > 0 || s.late > 0)
                && let Err(e) = self.ledger.record_frames(*lease, now, s.within_slo, s.late)
            {
                warn!(%lease, "recording frames: {e}");
            }
        }
        for u in &report.usage {
            if let Err(e) = self
                .ledger
                .record_usage(u.lease, now, &u.edge, &u.model, u.usage)
            {
                warn!(lease = %u.lease, edge = %u.edge, "recording usage: {e}");
            }
        }
        for w in &report.workers {
            let Some(entry) = self.table.get(w.lease) else {
                continue;
            };
            for m in &report.models {
                let points: Vec<(u16, u32)> = w
                    .profile
                    .iter()
                    .filter(|p| p.0 == m.model)
                    .map(|p| (p.1, p.2))
                    .collect();
                let budget = if m.budget_ms > 0.0 {
                    m.budget_ms
                } else {
                    DEFAULT_BUDGET_MS
                };
                let batch_budget_us = ((budget - NETWORK_MS).max(1.0) / 2.0 * 1e3) as u32;
                let fps = autoscale::throughput_from_profile(&points, batch_budget_us);
                if fps > 0.0 {
                    self.measured
                        .insert((m.model.clone(), entry.instance_type.clone()), fps);
                }
            }
        }
    }

    fn observe(&self, report: &LoadReport) -> Vec<ModelLoad> {
        self.models
            .iter()
            .map(|m| {
                let load = report.models.iter().find(|l| l.model == m.name);
                let throughput_fps = m
                    .instance_types
                    .iter()
                    .map(|t| {
                        let measured = self.measured.get(&(m.name.clone(), t.clone()));
                        let fps = match measured {
                            Some(f) if m.measure => *f,
                            _ => m.worker_fps,
                        };
                        (t.clone(), fps)
                    })
                    .collect();
                ModelLoad {
                    model: m.name.clone(),
                    arrival_fps: load.map_or(0.0, |l| l.arrival_fps),
                    queue_depth: load.map_or(0, |l| l.queue_depth),
                    p95_ms: load.map_or(0.0, |l| l.p95_ms),
                    budget_ms: load
                        .map(|l| l.budget_ms)
                        .filter(|b| *b > 0.0)
                        .unwrap_or(DEFAULT_BUDGET_MS),
                    throughput_fps,
                }
            })
            .collect()
    }

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
                Action::Release { lease } if self.acquiring_leases.contains_key(&lease) => {
                    // not the provider's yet: released once it is
                    debug!(%lease, "release of a lease still being acquired put off until its answer");
                    if let Some(a) = self.acquiring_leases.get_mut(&lease) {
                        a.release_wanted = true;
                    }
                }
                Action::Release { lease } => {
                    let due = self.mono() + RELEASE_GRACE.as_millis() as Millis;
                    if self.releases.contains(lease) {
                        // already being released (or under a spot notice):
                        // at most a grace from now
                        self.releases.schedule(lease, due, EndReason::Released);
                        continue;
                    }
                    info!(%lease, "releasing lease: dispatch stopped, ends after its batches");
                    self.drain(lease).await;
                    self.releases.schedule(lease, due, EndReason::Released);
                }
                Action::StopDispatch { lease } => {
                    info!(%lease, "dispatch to lease stopped");
                    self.drain(lease).await;
                }
            }
        }
    }

    async fn drain(&mut self, lease: LeaseId) {
        self.hub.send(HubMsg::LeaseDraining { lease }).await;
        if matches!(
            self.state(lease),
            Some(LeaseState::Starting | LeaseState::Ready)
        ) {
            self.write(lease, Write::Draining);
            let _ = self.table.transition(lease, LeaseState::Draining);
        }
    }

    pub(super) fn update_metrics(&mut self, now: Millis) {
        let m = &self.metrics;
        m.leases.reset();
        let mut counts = self.table.counts();
        // asked of the provider, not answered yet
        for a in self.acquiring_leases.values() {
            let label = LeaseState::Requested.label();
            *counts
                .entry((a.instance.name.clone(), a.tier, label))
                .or_insert(0) += 1;
        }
        for ((ty, tier, state), n) in counts {
            m.leases
                .with_label_values(&[ty.as_str(), tier.as_str(), state])
                .set(n as i64);
        }
        if let Ok(by_tier) = self.ledger.cost_total_by_tier() {
            for (tier, cost) in by_tier {
                let seen = self.cost_seen.entry(tier).or_insert(0.0);
                let add = cost.units() - *seen;
                if add > 0.0 {
                    m.cost_total
                        .with_label_values(&[tier.as_str(), self.catalog.currency.as_str()])
                        .inc_by(add);
                    *seen = cost.units();
                }
            }
        }
        if let Ok(r) = self.ledger.cost_totals(0, now + 1)
            && let Some(c) = r.cost_per_1k_within_slo
        {
            m.cost_per_1k_within_slo.set(c);
        }
        if let Some(u) = tidegate_lease::metrics::gpu_utilization(self.busy_ms, self.leased_ms) {
            m.gpu_utilization.set(u);
        }
    }
}
