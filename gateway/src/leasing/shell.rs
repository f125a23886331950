//! The [`Shell`] actor: its state and its loop, which dispatches the
//! inbox, the provider's events, ticks, the releases due and the answers
//! of the acquisitions and releases under way; and its clean stop. Its
//! bookkeeping is the pure [`LeaseBook`]; what it carries out is in
//! `actions.rs`, `acquire.rs` and `release.rs`, worker logins in
//! `auth.rs`, the ledger's records and the metrics in `metrics.rs`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use tidegate_lease::autoscale::{Action, Autoscaler, Event, Observation};
use tidegate_lease::ledger::Ledger;
use tidegate_lease::pacing::{AcquireBackoff, ReleaseQueue, start_timed_out};
use tidegate_lease::provider::{Acquired, ProviderError, ProviderEvent, wall_clock_ms};
use tidegate_lease::{Catalog, EndReason, LeaseId, LeaseState, LeaseTable, Millis, Tier};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::book::LeaseBook;
use super::release::Released;
use super::{LeaseSource, LeasingMsg, ReleaseOutcome, ReleaseRefused, STALL_WINDOW};
use crate::config::{OnStop, ScaledModel};
use crate::hub::{Hub, HubMsg};
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
    /// The wall clock.
    pub(super) clock: WallClock,
    /// Leases whose dispatch stopped, with when their provider release is
    /// due (or retried), on the monotonic clock.
    pub(super) releases: ReleaseQueue,
    /// Acquisitions paused after leases failed to start (monotonic clock).
    pub(super) backoff: AcquireBackoff,
    pub(super) last_tick: Option<Millis>,
    /// GPU time spent running batches, and leased (billing started), since
    /// this gateway started (ms).
    pub(super) busy_ms: f64,
    pub(super) leased_ms: f64,
    /// Cost per tier already added to `tidegate_cost_total`.
    pub(super) cost_seen: BTreeMap<Tier, f64>,
    /// A lease whose worker has not registered this long after it was
    /// requested is ended as `failed` and released (ms).
    pub(super) start_timeout_ms: Millis,
    /// Provider releases under way, each on a task of its own: a Pod's
    /// grace period or a job's drain never holds up the shell (worker
    /// logins, the API, ticks, spot notices and the acquisitions that
    /// replace a preempted lease).
    pub(super) in_flight: tokio::task::JoinSet<ReleaseOutcome>,
    /// Provider acquisitions under way, each on a task of its own, as the
    /// releases: an API server or `sbatch` slow to answer holds up nothing
    /// else (each provider bounds its calls).
    pub(super) acquiring: tokio::task::JoinSet<Result<Acquired, ProviderError>>,
    /// Which workers are gone, stalls, the acquisitions and releases
    /// under way, and the ledger writes to retry (pure).
    pub(super) book: LeaseBook<tokio::task::Id>,
    /// Shutting down: the autoscaler's acquisitions are no longer made.
    pub(super) stopping: bool,
}

/// The shell's wall clock (ms since the Unix epoch), which stamps the
/// ledger and drives billing: the system's; or, for a shell run on a test's
/// runtime with Tokio's time paused, the system's reading at start moved on
/// by Tokio's clock, so that an hour's block end comes when the test's
/// virtual time reaches it.
#[derive(Debug, Clone, Copy)]
pub(super) enum WallClock {
    /// The system's clock.
    System,
    /// `start_ms` at `start` on Tokio's clock, moving with it.
    #[cfg(test)]
    FollowsTokio {
        /// The wall clock's reading at `start`.
        start_ms: Millis,
        /// When, on Tokio's clock.
        start: tokio::time::Instant,
    },
}

impl WallClock {
    /// A clock that follows Tokio's from the system's reading now.
    #[cfg(test)]
    pub(super) fn follows_tokio() -> Self {
        WallClock::FollowsTokio {
            start_ms: wall_clock_ms(),
            start: tokio::time::Instant::now(),
        }
    }

    /// Now, in ms since the Unix epoch.
    pub(super) fn now_ms(&self) -> Millis {
        match self {
            WallClock::System => wall_clock_ms(),
            #[cfg(test)]
            WallClock::FollowsTokio { start_ms, start } => {
                start_ms + start.elapsed().as_millis() as Millis
            }
        }
    }
}

impl<P: LeaseSource> Shell<P> {
    /// The wall clock now (ms since the Unix epoch).
    pub(super) fn now_ms(&self) -> Millis {
        self.clock.now_ms()
    }

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
            // leases under a spot notice serve until their drain
            let drain_at = self
                .book
                .next_drain()
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
                    self.update_metrics(self.now_ms());
                }
                _ = tokio::time::sleep_until(drain_at.unwrap_or(far)), if drain_at.is_some() => {
                    self.drains_due().await;
                }
                Some(joined) = self.acquiring.join_next_with_id(), if !self.acquiring.is_empty() => {
                    self.acquire_answered(joined).await;
                    self.update_metrics(self.now_ms());
                }
                Some(joined) = self.in_flight.join_next_with_id(), if !self.in_flight.is_empty() => {
                    self.release_finished(joined).await;
                    self.update_metrics(self.now_ms());
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
            self.record(self.now_ms(), &report);
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
                    self.end(lease, self.now_ms(), reason);
                }
                Released::Failed(e) => {
                    self.metrics.lease_release_failures.inc();
                    warn!(%lease, "release at shutdown failed; the lease stays live in the ledger, and the next start adopts or ends it: {e}");
                    kept.push(lease);
                }
            }
        }
        self.flush_writes();
        if let Err(e) = self.ledger.accrue(self.now_ms()) {
            warn!("accruing cost at shutdown: {e}");
        }
        let unwritten = self.book.unwritten();
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

    /// One message from the QUIC server or the API.
    async fn handle(&mut self, msg: LeasingMsg) {
        match msg {
            LeasingMsg::Authenticate { name, token, reply } => {
                let _ = reply.send(self.authenticate(&name, &token));
            }
            LeasingMsg::Registered { lease } => self.lease_registered(lease),
            LeasingMsg::StaticRegistered { name } => self.static_registered(&name),
            LeasingMsg::StaticDisconnected { name } => self.static_disconnected(&name),
            LeasingMsg::Disconnected { lease } => self.lease_disconnected(lease),
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
                if !self.book.writes_wait()
                    && let Err(e) = self.ledger.accrue(self.now_ms())
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
                    None if self.book.is_acquiring(lease) => {
                        Err(ReleaseRefused::NotYetStarted(lease))
                    }
                    None if in_ledger => Err(ReleaseRefused::Ended(lease)),
                    None => Err(ReleaseRefused::Unknown(lease)),
                    Some(LeaseState::Ended(_)) => Err(ReleaseRefused::Ended(lease)),
                    Some(LeaseState::Requested) => Err(ReleaseRefused::NotYetStarted(lease)),
                    Some(_) => {
                        info!(%lease, "operator releases the lease");
                        self.execute(self.now_ms(), vec![Action::Release { lease }], 0)
                            .await;
                        Ok(())
                    }
                };
                let _ = reply.send(answer);
            }
        }
    }

    /// The lease's state in the table (the truth; the ledger's may lag
    /// while a write waits for a retry).
    pub(super) fn state(&self, lease: LeaseId) -> Option<LeaseState> {
        self.table.get(lease).map(|e| e.state)
    }

    /// One tick: the hub's load into the ledger and the autoscaler, the
    /// leases that serve nothing or never started replaced, the
    /// autoscaler's actions carried out, cost accrued, metrics updated.
    async fn tick(&mut self) {
        let now = self.now_ms();
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
            .filter(|r| !self.book.is_acquiring(r.id))
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
        let (table, releases) = (&self.table, &self.releases);
        let live = |lease: LeaseId| {
            matches!(
                table.get(lease).map(|e| e.state),
                Some(LeaseState::Starting | LeaseState::Ready)
            ) && !releases.contains(lease)
        };
        let verdict = self.book.unserving(mono, stalled, live);
        let window_min = STALL_WINDOW.as_secs() / 60;
        for lease in verdict.first_stall {
            warn!(%lease, "its worker stalled (a batch far past due); the lease is kept while the worker recovers, and replaced should it stall again within {window_min} min or not register again within rejoin_timeout_secs");
        }
        for lease in verdict.stalled_again {
            warn!(%lease, "its worker stalled again; ending the lease as lost and releasing it so that a new one replaces it");
            self.drain(lease).await;
            self.releases.schedule(lease, mono, EndReason::Lost);
        }
        for (lease, gone_ms) in verdict.gone {
            warn!(%lease, gone_secs = gone_ms / 1000, "its worker has not redialled; ending the lease as lost and releasing it so that a new one replaces it");
            self.drain(lease).await;
            self.releases.schedule(lease, mono, EndReason::Lost);
        }
    }
}
