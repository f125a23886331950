//! The lease shell: one task that owns the ledger, the lease table, the
//! provider and the [`Autoscaler`], like the hub owns the scheduler. Every
//! decision is the pure autoscaler's; this task only moves observations in
//! and carries actions out:
//!
//! * on start it adopts the live leases of the ledger whose worker still
//!   runs (their tokens re-armed, so the worker may register again) and
//!   ends the rest;
//! * every tick it asks the hub for the load (arrival rate, queue, p95
//!   against the budget, the leased workers' profiles, frames served per
//!   lease), records the frames in the ledger, feeds an [`Observation`] to
//!   the autoscaler, executes its [`Action`]s, accrues cost and updates the
//!   leasing metrics;
//! * `Acquire` → ledger row + one-time token → `provider.acquire` →
//!   `starting`; `Release` → the hub stops dispatching to the worker,
//!   `draining`, and after [`RELEASE_GRACE`] (its batches in flight come
//!   back) `provider.release` → `ended(released)`; `StopDispatch` → the hub
//!   stops dispatching;
//! * provider events: a spot notice drains the worker and goes to the
//!   autoscaler (which acquires a replacement); `Ended` ends the lease;
//! * the QUIC server asks it to check a worker's lease token (once) and
//!   tells it when the worker registered (`ready`) or went away.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::Duration;

use tidegate_lease::autoscale::{
    self, Action, Autoscaler, Event, ModelLoad, Observation, PolicyConfig, ReservedFloor,
    ScheduleEntry,
};
use tidegate_lease::ledger::{CostReport, LeaseRecord, Ledger, LedgerError, NewLease};
use tidegate_lease::provider::process::{ProcessConfig, ProcessProvider};
use tidegate_lease::provider::slurm::SlurmProvider;
use tidegate_lease::provider::static_workers::{StaticConfig, StaticProvider};
use tidegate_lease::provider::{
    Acquired, LeaseSpec, Provider, ProviderError, ProviderEvent, wall_clock_ms,
};
use tidegate_lease::table::LeaseEntry;
use tidegate_lease::{
    Catalog, EndReason, LeaseId, LeaseState, LeaseTable, LeaseToken, Millis, Money, Tier,
};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::config::{LeasingConfig, ProviderKind, ScaledModel};
use crate::hub::{Hub, HubMsg, LoadReport};
use crate::metrics::Metrics;

/// Time between `Release` (dispatch stopped) and the worker's end, for the
/// batches it was running to come back.
pub const RELEASE_GRACE: Duration = Duration::from_secs(1);

/// After a lease fails to start (spawn error, or its worker ended before
/// it registered), acquisitions pause this long, doubling per failure up to
/// [`ACQUIRE_BACKOFF_MAX`], so a broken worker command or config cannot
/// spawn a process (and write a ledger row) every tick.
pub const ACQUIRE_BACKOFF: Duration = Duration::from_secs(1);
/// Longest pause between acquisitions after repeated start failures.
pub const ACQUIRE_BACKOFF_MAX: Duration = Duration::from_secs(60);

/// Network and return time taken from the budget when turning a latency
/// profile into throughput at the SLO (as the simulator does).
const NETWORK_MS: f64 = 20.0;

/// Budget assumed before any frame of a model has arrived (ms).
const DEFAULT_BUDGET_MS: f64 = 80.0;

/// Most leases `/api/v1/leases` returns.
pub const MAX_LEASES_LISTED: u32 = 10_000;

/// Why the lease shell could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LeasingError {
    /// The `[leasing]` section is invalid.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// The ledger could not be opened or read.
    #[error("ledger {path}: {source}")]
    Ledger {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: LedgerError,
    },
    /// The provider could not be set up or adopt the live leases.
    #[error("lease provider: {0}")]
    Provider(String),
}

/// Messages to the lease shell.
#[derive(Debug)]
enum LeasingMsg {
    Authenticate {
        name: String,
        token: String,
        reply: oneshot::Sender<Option<Result<LeaseId, String>>>,
    },
    Registered {
        lease: LeaseId,
    },
    Disconnected {
        lease: LeaseId,
    },
    Leases {
        live_only: bool,
        limit: u32,
        reply: oneshot::Sender<Result<Vec<LeaseRecord>, String>>,
    },
    Costs {
        from: Millis,
        to: Millis,
        reply: oneshot::Sender<Result<CostReport, String>>,
    },
    Release {
        lease: LeaseId,
        reply: oneshot::Sender<Result<(), ReleaseRefused>>,
    },
}

/// Why an operator's release was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReleaseRefused {
    /// No such lease in the ledger.
    #[error("{0} is not in the ledger")]
    Unknown(LeaseId),
    /// It has ended already.
    #[error("{0} has already ended")]
    Ended(LeaseId),
    /// It is being acquired: its provider has not answered yet.
    #[error("{0} is still being acquired; release it once it is starting")]
    NotYetStarted(LeaseId),
    /// The lease manager has stopped.
    #[error("the lease manager has stopped")]
    Stopped,
}

/// A handle to the lease shell.
#[derive(Debug, Clone)]
pub struct Leasing {
    tx: mpsc::Sender<LeasingMsg>,
}

impl Leasing {
    /// Checks a worker's `Hello`: `None` when the worker is not a leased one
    /// (the `[[workers]]` list decides), else its lease or the reason it is
    /// refused. A token is accepted once.
    pub async fn authenticate(&self, name: &str, token: &str) -> Option<Result<LeaseId, String>> {
        let (reply, rx) = oneshot::channel();
        let msg = LeasingMsg::Authenticate {
            name: name.to_string(),
            token: token.to_string(),
            reply,
        };
        if self.tx.send(msg).await.is_err() {
            return Some(Err("the gateway's lease manager has stopped".into()));
        }
        rx.await
            .unwrap_or_else(|_| Some(Err("the gateway's lease manager has stopped".into())))
    }

    /// The lease's worker registered (its models are warm): `ready`.
    pub async fn registered(&self, lease: LeaseId) {
        let _ = self.tx.send(LeasingMsg::Registered { lease }).await;
    }

    /// The lease's worker disconnected.
    pub async fn disconnected(&self, lease: LeaseId) {
        let _ = self.tx.send(LeasingMsg::Disconnected { lease }).await;
    }

    /// Ledger leases, newest first (`/api/v1/leases`).
    pub async fn leases(&self, live_only: bool, limit: u32) -> Result<Vec<LeaseRecord>, String> {
        let (reply, rx) = oneshot::channel();
        let msg = LeasingMsg::Leases {
            live_only,
            limit,
            reply,
        };
        if self.tx.send(msg).await.is_err() {
            return Err("the lease manager has stopped".into());
        }
        rx.await
            .unwrap_or_else(|_| Err("the lease manager has stopped".into()))
    }

    /// Releases a lease now, as the autoscaler would (an operator's
    /// decision): dispatch stops, and its worker ends after the batches it
    /// holds. The autoscaler may lease a replacement if the capacity is
    /// still needed.
    pub async fn release(&self, lease: LeaseId) -> Result<(), ReleaseRefused> {
        let (reply, rx) = oneshot::channel();
        if self
            .tx
            .send(LeasingMsg::Release { lease, reply })
            .await
            .is_err()
        {
            return Err(ReleaseRefused::Stopped);
        }
        rx.await.unwrap_or(Err(ReleaseRefused::Stopped))
    }

    /// Cost charged in `[from, to)` (`/api/v1/costs`).
    pub async fn costs(&self, from: Millis, to: Millis) -> Result<CostReport, String> {
        let (reply, rx) = oneshot::channel();
        if self
            .tx
            .send(LeasingMsg::Costs { from, to, reply })
            .await
            .is_err()
        {
            return Err("the lease manager has stopped".into());
        }
        rx.await
            .unwrap_or_else(|_| Err("the lease manager has stopped".into()))
    }
}

/// The configured provider.
#[derive(Debug)]
enum Source {
    Process {
        provider: ProcessProvider,
        preempt_spot_after: Option<Duration>,
    },
    Static(StaticProvider),
    Slurm(Box<SlurmProvider>),
}

impl Source {
    fn name(&self) -> &'static str {
        match self {
            Source::Process { provider, .. } => provider.name(),
            Source::Static(p) => p.name(),
            Source::Slurm(p) => p.name(),
        }
    }

    async fn acquire(&mut self, mut spec: LeaseSpec) -> Result<Acquired, ProviderError> {
        match self {
            Source::Process {
                provider,
                preempt_spot_after,
            } => {
                spec.preempt_after = *preempt_spot_after;
                provider.acquire(spec).await
            }
            Source::Static(p) => p.acquire(spec).await,
            Source::Slurm(p) => p.acquire(spec).await,
        }
    }

    async fn release(&mut self, lease: LeaseId) -> Result<(), ProviderError> {
        match self {
            Source::Process { provider, .. } => provider.release(lease).await,
            Source::Static(p) => p.release(lease).await,
            Source::Slurm(p) => p.release(lease).await,
        }
    }

    fn take_events(&mut self) -> Option<mpsc::Receiver<ProviderEvent>> {
        match self {
            Source::Process { provider, .. } => provider.take_events(),
            Source::Static(p) => p.take_events(),
            Source::Slurm(p) => p.take_events(),
        }
    }
}

/// Capacity of the shell's inbox.
const INBOX: usize = 256;

/// Opens the ledger, adopts or ends its live leases and starts the lease
/// shell; it runs until `cancel` fires, then releases every lease it holds.
/// `quic` is the gateway's bound QUIC address: process workers run on this
/// host and get it as `TIDEGATE_GATEWAY_ADDR` (unless the configured `env`
/// sets it). Must be called inside the tokio runtime.
pub fn spawn(
    cfg: &LeasingConfig,
    quic: std::net::SocketAddr,
    hub: Hub,
    metrics: Metrics,
    cancel: CancellationToken,
    tracker: &TaskTracker,
) -> Result<Leasing, LeasingError> {
    cfg.validate()?;
    let catalog = cfg.load_catalog()?;
    let policy = cfg.policy_name()?;
    let ledger_err = |source| LeasingError::Ledger {
        path: cfg.ledger.clone(),
        source,
    };
    if let Some(dir) = cfg.ledger.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| {
            LeasingError::Provider(format!(
                "cannot create the ledger's folder {}: {e}",
                dir.display()
            ))
        })?;
    }
    let mut ledger = Ledger::open(&cfg.ledger).map_err(ledger_err)?;
    let now = wall_clock_ms();
    // workers dial the gateway's QUIC address unless the config's `env`
    // names another (a Slurm cluster's nodes reach it by its own name)
    let with_dial = |env: &std::collections::BTreeMap<String, String>| {
        let mut env = env.clone();
        let mut dial = quic;
        if dial.ip().is_unspecified() {
            dial.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        env.entry("TIDEGATE_GATEWAY_ADDR".into())
            .or_insert_with(|| dial.to_string());
        env
    };
    let provider_err = |e: ProviderError| LeasingError::Provider(e.to_string());
    let mut source = match cfg.provider {
        ProviderKind::Process => {
            let p = cfg
                .process
                .as_ref()
                .ok_or_else(|| LeasingError::Provider("[leasing.process] is missing".into()))?;
            Source::Process {
                provider: ProcessProvider::new(ProcessConfig {
                    command: p.command.clone(),
                    args: p.args.clone(),
                    env: with_dial(&p.env).into_iter().collect(),
                    notice_period_secs: p.notice_period_secs,
                }),
                preempt_spot_after: p.preempt_spot_after_secs.map(Duration::from_secs_f64),
            }
        }
        ProviderKind::Static => Source::Static(
            StaticProvider::new(StaticConfig {
                workers: cfg.static_workers.clone(),
            })
            .map_err(|e| LeasingError::Provider(e.to_string()))?,
        ),
        ProviderKind::Slurm => {
            let mut s = cfg
                .slurm
                .clone()
                .ok_or_else(|| LeasingError::Provider("[leasing.slurm] is missing".into()))?;
            s.env = with_dial(&s.env);
            Source::Slurm(Box::new(SlurmProvider::connect(s).map_err(provider_err)?))
        }
    };
    // Adopt what still runs, end the rest: no lease outlives its worker.
    let adopted = match &mut source {
        Source::Process { provider, .. } => {
            provider
                .adopt(&mut ledger, now)
                .map_err(provider_err)?
                .adopted
        }
        Source::Slurm(provider) => {
            provider
                .adopt(&mut ledger, now)
                .map_err(provider_err)?
                .adopted
        }
        Source::Static(_) => Vec::new(),
    };
    for rec in ledger.live_leases().map_err(ledger_err)? {
        if !adopted.contains(&rec.id) {
            let reason = if rec.state == LeaseState::Requested {
                EndReason::Failed
            } else {
                EndReason::Lost
            };
            warn!(lease = %rec.id, provider = %rec.provider, "live lease not adopted after restart; ended");
            ledger.mark_ended(rec.id, now, reason).map_err(ledger_err)?;
        }
    }
    let mut table = ledger.load_table().map_err(ledger_err)?;
    for id in &adopted {
        // the adopted worker registers again with the token it was given
        table
            .rearm_claim(*id)
            .map_err(|e| LeasingError::Provider(e.to_string()))?;
        ledger.set_token_claimed(*id, false).map_err(ledger_err)?;
    }
    if !adopted.is_empty() {
        info!(adopted = ?adopted, "adopted live leases");
    }
    let events = source
        .take_events()
        .ok_or_else(|| LeasingError::Provider("provider events already taken".into()))?;

    let mut pc = PolicyConfig::new(policy);
    if let Some(h) = cfg.headroom {
        pc.headroom = h;
    }
    pc.spend_cap_per_hour = cfg.spend_cap_per_hour.map(Money::from_units);
    if let Some(cap) = cfg.spend_cap_per_hour {
        metrics.spend_cap.with_label_values::<&str>(&[]).set(cap);
    }
    if let Some(s) = cfg.down_window_secs {
        pc.down_window_ms = s * 1000;
    }
    if let Some(s) = cfg.release_window_secs {
        pc.release_window_ms = s * 1000;
    }
    if let Some(s) = cfg.idle_timeout_secs {
        pc.idle_timeout_ms = s * 1000;
    }
    for m in &cfg.models {
        if m.min_fps > 0.0 {
            pc.schedule.push(ScheduleEntry {
                model: m.name.clone(),
                from_minute: 0,
                to_minute: 24 * 60,
                min_fps: m.min_fps,
            });
            pc.static_peak_fps.insert(m.name.clone(), m.min_fps);
        }
        if m.reserved > 0 {
            pc.reserved.push(ReservedFloor {
                model: m.name.clone(),
                instance_type: m.instance_types[0].clone(),
                count: m.reserved,
            });
        }
    }

    let (tx, rx) = mpsc::channel(INBOX);
    let mut shell = Shell {
        autoscaler: Autoscaler::new(pc, catalog.clone()),
        catalog,
        models: cfg.models.clone(),
        ledger,
        table,
        source,
        hub,
        metrics,
        measured: HashMap::new(),
        static_names: HashMap::new(),
        releasing: Vec::new(),
        backoff: None,
        last_tick: None,
        busy_ms: 0.0,
        leased_ms: 0.0,
        cost_seen: BTreeMap::new(),
        start_timeout: Duration::from_secs(cfg.start_timeout_secs),
    };
    shell.update_metrics(now);
    let tick = Duration::from_millis(cfg.tick_ms);
    tracker.spawn(
        shell
            .run(rx, events, tick, cancel)
            .instrument(info_span!("leasing")),
    );
    Ok(Leasing { tx })
}

struct Shell {
    autoscaler: Autoscaler,
    catalog: Catalog,
    models: Vec<ScaledModel>,
    ledger: Ledger,
    table: LeaseTable,
    source: Source,
    hub: Hub,
    metrics: Metrics,
    /// Throughput at the SLO measured from registered workers' profiles,
    /// by (model, instance type).
    measured: HashMap<(String, String), f64>,
    /// Static provider: the worker name bound to each lease.
    static_names: HashMap<LeaseId, String>,
    /// Leases whose dispatch stopped, to release when due.
    releasing: Vec<(LeaseId, tokio::time::Instant)>,
    /// Acquisitions paused until, and the pause to use after the next
    /// failure, after leases failed to start.
    backoff: Option<(tokio::time::Instant, Duration)>,
    last_tick: Option<Millis>,
    /// GPU time spent running batches, and leased (billing started), since
    /// this gateway started (ms).
    busy_ms: f64,
    leased_ms: f64,
    /// Cost per tier already added to `tidegate_cost_total`.
    cost_seen: BTreeMap<Tier, f64>,
    /// A lease whose worker has not registered this long after it was
    /// requested is ended as `failed` and released.
    start_timeout: Duration,
}

impl Shell {
    async fn run(
        mut self,
        mut rx: mpsc::Receiver<LeasingMsg>,
        mut events: mpsc::Receiver<ProviderEvent>,
        tick: Duration,
        cancel: CancellationToken,
    ) {
        let mut ticker = tokio::time::interval(tick);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
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
            }
        }
        self.shutdown().await;
    }

    /// Clean shutdown: every held lease is released and ended (its worker
    /// would exit anyway once the gateway closes its connection).
    async fn shutdown(mut self) {
        let now = wall_clock_ms();
        let live = self.ledger.live_leases().unwrap_or_default();
        for rec in live {
            if let Err(e) = self.source.release(rec.id).await {
                debug!(lease = %rec.id, error = %e, "release at shutdown");
            }
            self.end(rec.id, now, EndReason::Released);
        }
        if let Err(e) = self.ledger.accrue(now) {
            warn!("accruing cost at shutdown: {e}");
        }
        info!("lease manager stopped; every lease released");
    }

    async fn handle(&mut self, msg: LeasingMsg) {
        match msg {
            LeasingMsg::Authenticate { name, token, reply } => {
                let _ = reply.send(self.authenticate(&name, &token));
            }
            LeasingMsg::Registered { lease } => {
                let now = wall_clock_ms();
                if self.state(lease) == Some(LeaseState::Starting) {
                    match self.ledger.mark_ready(lease, now) {
                        Ok(()) => {
                            let _ = self.table.transition(lease, LeaseState::Ready);
                            info!(%lease, "lease ready: its worker registered");
                            self.backoff = None;
                        }
                        Err(e) => warn!(%lease, "marking ready: {e}"),
                    }
                }
                if let Source::Static(p) = &self.source
                    && let Err(e) = p.worker_registered(lease)
                {
                    debug!(%lease, "static worker registered: {e}");
                }
                self.update_metrics(now);
            }
            LeasingMsg::Disconnected { lease } => {
                info!(%lease, "leased worker disconnected");
                if let Source::Static(p) = &mut self.source
                    && let Err(e) = p.worker_disconnected(lease)
                {
                    debug!(%lease, "static worker disconnected: {e}");
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
            LeasingMsg::Costs { from, to, reply } => {
                let _ = reply.send(self.ledger.costs(from, to).map_err(|e| e.to_string()));
            }
            LeasingMsg::Release { lease, reply } => {
                let in_ledger = self.ledger.lease(lease).ok().flatten().is_some();
                let answer = match self.state(lease) {
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

    fn authenticate(&mut self, name: &str, token: &str) -> Option<Result<LeaseId, String>> {
        let id = if let Some(n) = name.strip_prefix("lease-") {
            match n.parse::<u64>() {
                Ok(n) => LeaseId(n),
                Err(_) => {
                    return Some(Err(format!(
                        "a leased worker's name is lease-<id>; '{name}' is not"
                    )));
                }
            }
        } else {
            let bound = self
                .static_names
                .iter()
                .find(|(_, n)| n.as_str() == name)
                .map(|(id, _)| *id);
            bound?
        };
        match self.table.claim(id, &LeaseToken::from_secret(token)) {
            Ok(()) => {
                if let Err(e) = self.ledger.set_token_claimed(id, true) {
                    warn!(lease = %id, "recording the token claim: {e}");
                }
                Some(Ok(id))
            }
            Err(e) => Some(Err(e.to_string())),
        }
    }

    fn state(&self, lease: LeaseId) -> Option<LeaseState> {
        self.table.get(lease).map(|e| e.state)
    }

    async fn on_provider_event(&mut self, ev: ProviderEvent) {
        let now = wall_clock_ms();
        match ev {
            ProviderEvent::Ready { lease } => {
                if self.state(lease) == Some(LeaseState::Starting) {
                    if let Err(e) = self.ledger.mark_ready(lease, now) {
                        warn!(%lease, "marking ready: {e}");
                    }
                    let _ = self.table.transition(lease, LeaseState::Ready);
                }
            }
            ProviderEvent::PreemptionNotice { lease, deadline } => {
                warn!(%lease, deadline, "spot preemption notice: draining, replacing");
                let actions = self
                    .autoscaler
                    .on_event(now, Event::PreemptionNotice { lease, deadline });
                self.execute(now, actions, 0).await;
            }
            ProviderEvent::Ended {
                lease,
                reason,
                detail,
            } => {
                warn!(%lease, reason = reason.as_str(), %detail, "lease ended by its provider");
                if matches!(
                    self.state(lease),
                    Some(LeaseState::Requested | LeaseState::Starting)
                ) {
                    self.start_failed();
                }
                self.releasing.retain(|(l, _)| *l != lease);
                self.static_names.remove(&lease);
                self.hub.send(HubMsg::LeaseEnded { lease }).await;
                self.end(lease, now, reason);
            }
        }
        self.update_metrics(now);
    }

    /// Ends a lease in the ledger and the table, once.
    fn end(&mut self, lease: LeaseId, now: Millis, reason: EndReason) {
        let ended = self
            .ledger
            .lease(lease)
            .ok()
            .flatten()
            .is_none_or(|r| r.state.is_ended());
        if ended {
            return;
        }
        match self.ledger.mark_ended(lease, now, reason) {
            Ok(last) => {
                info!(%lease, reason = reason.as_str(), final_blocks = last.units(), "lease ended")
            }
            Err(e) => warn!(%lease, "ending the lease: {e}"),
        }
        let _ = self.table.transition(lease, LeaseState::Ended(reason));
    }

    async fn tick(&mut self) {
        let now = wall_clock_ms();
        let names: Vec<String> = self.models.iter().map(|m| m.name.clone()).collect();
        let Some(report) = self.hub.load_report(names).await else {
            return;
        };
        self.record(now, &report);
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
                    self.leased_ms += now.saturating_sub(start.max(last)) as f64;
                }
            }
        }
        self.last_tick = Some(now);
        // A worker that never registers must not count as capacity forever.
        let timeout = self.start_timeout.as_millis() as Millis;
        let stuck: Vec<LeaseId> = live
            .iter()
            .filter(|r| matches!(r.state, LeaseState::Requested | LeaseState::Starting))
            .filter(|r| now.saturating_sub(r.requested_at) > timeout)
            .map(|r| r.id)
            .collect();
        for lease in &stuck {
            warn!(%lease, timeout_secs = self.start_timeout.as_secs(), "worker never registered; ending the lease as failed");
            if let Err(e) = self.source.release(*lease).await {
                warn!(%lease, "provider release: {e}");
            }
            self.static_names.remove(lease);
            self.hub.send(HubMsg::LeaseEnded { lease: *lease }).await;
            self.end(*lease, wall_clock_ms().max(now), EndReason::Failed);
            self.start_failed();
        }
        let live: Vec<LeaseRecord> = live
            .into_iter()
            .filter(|r| !stuck.contains(&r.id))
            .collect();
        let obs = Observation {
            models: self.observe(&report),
            leases: live.iter().map(LeaseRecord::view).collect(),
        };
        let actions = self.autoscaler.on_event(now, Event::Tick(obs));
        self.execute(now, actions, 0).await;
        self.release_due(now).await;
        if let Err(e) = self.ledger.accrue(now) {
            warn!("accruing cost: {e}");
        }
        self.update_metrics(now);
    }

    /// Frames served per lease into the ledger; profiles into throughput.
    fn record(&mut self, now: Millis, report: &LoadReport) {
        for (lease, s) in &report.served {
            self.busy_ms += s.busy_us as f64 / 1e3;
            if (s.within_slo > 0 || s.late > 0)
                && let Err(e) = self.ledger.record_frames(*lease, now, s.within_slo, s.late)
            {
                warn!(%lease, "recording frames: {e}");
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
    async fn execute(&mut self, now: Millis, actions: Vec<Action>, depth: u32) {
        for action in actions {
            match action {
                Action::Acquire {
                    model,
                    instance_type,
                    tier,
                    reason,
                } => {
                    if let Some((until, _)) = self.backoff
                        && tokio::time::Instant::now() < until
                    {
                        debug!(
                            model,
                            instance_type, "acquire held back after start failures"
                        );
                        continue;
                    }
                    let refused = self
                        .acquire(now, &model, &instance_type, tier, reason)
                        .await;
                    if refused && depth < 2 {
                        let more = self.autoscaler.on_event(
                            now,
                            Event::AcquireRefused {
                                model,
                                instance_type,
                                tier,
                            },
                        );
                        Box::pin(self.execute(now, more, depth + 1)).await;
                    }
                }
                Action::Release { lease } => {
                    if self.releasing.iter().any(|(l, _)| *l == lease) {
                        continue;
                    }
                    info!(%lease, "releasing lease: dispatch stopped, ends after its batches");
                    self.drain(lease).await;
                    self.releasing
                        .push((lease, tokio::time::Instant::now() + RELEASE_GRACE));
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
            if let Err(e) = self.ledger.mark_draining(lease) {
                warn!(%lease, "marking draining: {e}");
            }
            let _ = self.table.transition(lease, LeaseState::Draining);
        }
    }

    /// One acquire; true when the provider refused it for lack of capacity.
    async fn acquire(
        &mut self,
        now: Millis,
        model: &str,
        instance_type: &str,
        tier: Tier,
        reason: autoscale::AcquireReason,
    ) -> bool {
        let Some(instance) = self.catalog.get(instance_type).cloned() else {
            warn!(
                instance_type,
                "autoscaler asked for a type not in the catalog"
            );
            return false;
        };
        let token = match LeaseToken::generate() {
            Ok(t) => t,
            Err(e) => {
                warn!("cannot generate a lease token: {e}");
                return false;
            }
        };
        let id = match self.ledger.insert_requested(&NewLease {
            provider: self.source.name(),
            model: Some(model),
            instance: &instance,
            tier,
            currency: &self.catalog.currency,
            requested_at: now,
            token: Some(token.digest()),
        }) {
            Ok(id) => id,
            Err(e) => {
                warn!("recording a lease request: {e}");
                return false;
            }
        };
        let spec = LeaseSpec {
            lease: id,
            token: token.clone(),
            instance: instance.clone(),
            tier,
            preempt_after: None,
        };
        match self.source.acquire(spec).await {
            Ok(acq) => {
                let entry = LeaseEntry {
                    id,
                    instance_type: instance.name.clone(),
                    tier,
                    state: LeaseState::Starting,
                    token: acq.token.unwrap_or_else(|| token.digest()),
                    claimed: false,
                };
                if let Err(e) = self.table.insert(entry) {
                    warn!(lease = %id, "lease table: {e}");
                }
                if let Source::Static(p) = &self.source
                    && let Some(w) = p.worker_of(id)
                {
                    self.static_names.insert(id, w.name.clone());
                }
                if let Err(e) =
                    self.ledger
                        .mark_starting(id, now, acq.pid, acq.provider_data.as_deref())
                {
                    warn!(lease = %id, "marking starting: {e}");
                }
                info!(lease = %id, model, instance_type, tier = tier.as_str(), ?reason, pid = ?acq.pid, "lease acquired");
                false
            }
            Err(e) => {
                warn!(lease = %id, model, instance_type, tier = tier.as_str(), "acquire failed: {e}");
                if let Err(e) = self.ledger.mark_ended(id, now, EndReason::Failed) {
                    warn!(lease = %id, "ending a failed lease: {e}");
                }
                let refused = matches!(e, ProviderError::NoCapacity { .. });
                if !refused {
                    self.start_failed();
                }
                refused
            }
        }
    }

    /// A lease failed to start: pause acquisitions, longer each time.
    fn start_failed(&mut self) {
        let pause = self.backoff.map_or(ACQUIRE_BACKOFF, |(_, next)| next);
        let next = (pause * 2).min(ACQUIRE_BACKOFF_MAX);
        warn!(
            pause_ms = pause.as_millis() as u64,
            "a lease failed to start; acquisitions paused"
        );
        self.backoff = Some((tokio::time::Instant::now() + pause, next));
    }

    async fn release_due(&mut self, now: Millis) {
        let t = tokio::time::Instant::now();
        let due: Vec<LeaseId> = self
            .releasing
            .iter()
            .filter(|(_, at)| *at <= t)
            .map(|(l, _)| *l)
            .collect();
        self.releasing.retain(|(_, at)| *at > t);
        for lease in due {
            if let Err(e) = self.source.release(lease).await {
                warn!(%lease, "provider release: {e}");
            }
            self.static_names.remove(&lease);
            self.hub.send(HubMsg::LeaseEnded { lease }).await;
            // the worker is gone now, not when this tick began
            self.end(lease, wall_clock_ms().max(now), EndReason::Released);
        }
    }

    fn update_metrics(&mut self, now: Millis) {
        let m = &self.metrics;
        m.leases.reset();
        for ((ty, tier, state), n) in self.table.counts() {
            m.leases
                .with_label_values(&[ty.as_str(), tier.as_str(), state])
                .set(n as i64);
        }
        if let Ok(by_tier) = self.ledger.cost_total_by_tier() {
            for (tier, cost) in by_tier {
                let seen = self.cost_seen.entry(tier).or_insert(0.0);
                let add = cost.units() - *seen;
                if add > 0.0 {
                    m.cost_total.with_label_values(&[tier.as_str()]).inc_by(add);
                    *seen = cost.units();
                }
            }
        }
        if let Ok(r) = self.ledger.costs(0, now + 1)
            && let Some(c) = r.cost_per_1k_within_slo
        {
            m.cost_per_1k_within_slo.set(c);
        }
        if let Some(u) = tidegate_lease::metrics::gpu_utilization(self.busy_ms, self.leased_ms) {
            m.gpu_utilization.set(u);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::hash_token;

    fn static_config(dir: &std::path::Path) -> LeasingConfig {
        let text = format!(
            r#"
[leasing]
provider = "static"
ledger = "{}"
policy = "tidal"
tick_ms = 100
[[leasing.static_workers]]
name = "gpu-a"
instance_type = "cpu-32"
tier = "reserved"
token_sha256 = "{}"
[[leasing.models]]
name = "m"
instance_types = ["cpu-32"]
worker_fps = 20
min_fps = 10
reserved = 1
"#,
            dir.join("l.db").display(),
            hash_token("gpu-a-secret")
        );
        let cfg: crate::config::Config = toml::from_str(&text).unwrap();
        cfg.validate().unwrap();
        assert!(
            !format!("{cfg:?}").contains(&hash_token("gpu-a-secret")),
            "token digests stay out of Debug"
        );
        cfg.leasing.unwrap()
    }

    pub(super) async fn start(cfg: &LeasingConfig) -> (Leasing, CancellationToken, TaskTracker) {
        let cancel = CancellationToken::new();
        let tracker = TaskTracker::new();
        let metrics = Metrics::new();
        let hub = crate::hub::spawn(
            crate::scheduler::Limits::default(),
            None,
            metrics.clone(),
            cancel.clone(),
            &tracker,
        );
        let quic = "127.0.0.1:4433".parse().unwrap();
        let l = spawn(cfg, quic, hub, metrics, cancel.clone(), &tracker).unwrap();
        (l, cancel, tracker)
    }

    async fn live(l: &Leasing) -> Vec<LeaseRecord> {
        l.leases(true, 100).await.unwrap()
    }

    #[tokio::test]
    async fn static_worker_is_leased_authenticated_once_and_made_ready() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = static_config(dir.path());
        let (l, cancel, tracker) = start(&cfg).await;
        // the reserved floor binds gpu-a at the first tick
        let until = tokio::time::Instant::now() + Duration::from_secs(5);
        while live(&l).await.is_empty() {
            assert!(tokio::time::Instant::now() < until, "no lease acquired");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let leases = live(&l).await;
        assert_eq!(leases.len(), 1, "{leases:?}");
        let id = leases[0].id;
        assert_eq!(leases[0].tier, Tier::Reserved);
        assert_eq!(leases[0].state, LeaseState::Starting);

        // not a leased worker: the [[workers]] list decides
        assert_eq!(l.authenticate("gpu-b", "x").await, None);
        let wrong = l.authenticate("gpu-a", "guess").await.unwrap().unwrap_err();
        assert!(wrong.contains("does not match"), "{wrong}");
        assert_eq!(l.authenticate("gpu-a", "gpu-a-secret").await, Some(Ok(id)));
        let again = l
            .authenticate("gpu-a", "gpu-a-secret")
            .await
            .unwrap()
            .unwrap_err();
        assert!(again.contains("already used"), "{again}");
        let bad = l.authenticate("lease-x", "t").await.unwrap().unwrap_err();
        assert!(bad.contains("lease-<id>"), "{bad}");

        l.registered(id).await;
        let until = tokio::time::Instant::now() + Duration::from_secs(5);
        while live(&l).await[0].state != LeaseState::Ready {
            assert!(tokio::time::Instant::now() < until, "lease never ready");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let costs = l.costs(0, wall_clock_ms() + 1).await.unwrap();
        assert!(costs.total > Money::ZERO, "{costs:?}");

        // a clean stop ends every lease as released
        cancel.cancel();
        tracker.close();
        tracker.wait().await;
        let ledger = Ledger::open(&cfg.ledger).unwrap();
        let all = ledger.leases(false, 100).unwrap();
        assert!(ledger.live_leases().unwrap().is_empty(), "{all:?}");
        assert!(
            all.iter()
                .all(|r| r.state == LeaseState::Ended(EndReason::Released)),
            "{all:?}"
        );
    }

    #[tokio::test]
    async fn restart_ends_leases_it_cannot_adopt() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = static_config(dir.path());
        // a live lease left by a previous gateway
        let catalog = Catalog::default_catalog();
        let mut ledger = Ledger::open(&cfg.ledger).unwrap();
        let token = LeaseToken::generate().unwrap();
        let old = ledger
            .insert_requested(&NewLease {
                provider: "static",
                model: Some("m"),
                instance: catalog.get("cpu-32").unwrap(),
                tier: Tier::Reserved,
                currency: &catalog.currency,
                requested_at: wall_clock_ms() - 10_000,
                token: Some(token.digest()),
            })
            .unwrap();
        ledger
            .mark_starting(old, wall_clock_ms() - 9_000, None, None)
            .unwrap();
        drop(ledger);
        let (l, cancel, tracker) = start(&cfg).await;
        let all = l.leases(false, 100).await.unwrap();
        let rec = all.iter().find(|r| r.id == old).unwrap();
        assert_eq!(rec.state, LeaseState::Ended(EndReason::Lost), "{rec:?}");
        assert!(rec.cost > Money::ZERO, "the minimum was charged: {rec:?}");
        cancel.cancel();
        tracker.close();
        tracker.wait().await;
    }
}

#[cfg(test)]
mod backoff_tests {
    use super::*;

    #[tokio::test]
    async fn a_worker_that_never_registers_is_ended_and_its_process_stopped() {
        let dir = tempfile::tempdir().unwrap();
        // `sleep` starts fine but never dials the gateway.
        let text = format!(
            r#"
[leasing]
provider = "process"
ledger = "{}"
tick_ms = 100
start_timeout_secs = 1
[leasing.process]
command = "sleep"
args = ["30"]
[[leasing.models]]
name = "m"
instance_types = ["cpu-32"]
worker_fps = 20
min_fps = 10
"#,
            dir.path().join("l.db").display()
        );
        let cfg: crate::config::Config = toml::from_str(&text).unwrap();
        let (l, cancel, tracker) = super::tests::start(&cfg.leasing.unwrap()).await;
        let until = tokio::time::Instant::now() + Duration::from_secs(10);
        let first = loop {
            let all = l.leases(false, 100).await.unwrap();
            if let Some(r) = all.iter().find(|r| r.state.is_ended()) {
                break r.clone();
            }
            assert!(
                tokio::time::Instant::now() < until,
                "no lease timed out: {all:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(
            first.state,
            LeaseState::Ended(EndReason::Failed),
            "{first:?}"
        );
        assert!(first.ready_at.is_none());
        let waited = first.ended_at.unwrap() - first.requested_at;
        assert!(
            waited >= 1_000,
            "ended after {waited} ms, before the timeout"
        );
        // Its process is gone (reaped, not a zombie).
        let pid = first.pid.expect("a process lease has a pid");
        let gone = !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|st| {
            st.rsplit_once(')')
                .is_some_and(|(_, r)| !r.trim_start().starts_with('Z'))
        });
        assert!(gone, "worker {pid} still runs");
        cancel.cancel();
        tracker.close();
        tracker.wait().await;
    }

    #[tokio::test]
    async fn a_worker_command_that_cannot_start_is_retried_with_backoff() {
        let dir = tempfile::tempdir().unwrap();
        let text = format!(
            r#"
[leasing]
provider = "process"
ledger = "{}"
tick_ms = 100
[leasing.process]
command = "/nonexistent/tidegate-worker"
[[leasing.models]]
name = "m"
instance_types = ["cpu-32"]
worker_fps = 20
min_fps = 10
"#,
            dir.path().join("l.db").display()
        );
        let cfg: crate::config::Config = toml::from_str(&text).unwrap();
        let cfg = cfg.leasing.unwrap();
        let cancel = CancellationToken::new();
        let tracker = TaskTracker::new();
        let metrics = Metrics::new();
        let hub = crate::hub::spawn(
            crate::scheduler::Limits::default(),
            None,
            metrics.clone(),
            cancel.clone(),
            &tracker,
        );
        let l = spawn(
            &cfg,
            "127.0.0.1:4433".parse().unwrap(),
            hub,
            metrics,
            cancel.clone(),
            &tracker,
        )
        .unwrap();
        // 15 ticks: without the pause, 15 spawn attempts; with it, the
        // first, one after 1 s, none before 3 s.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let all = l.leases(false, 100).await.unwrap();
        assert!((1..=2).contains(&all.len()), "{all:?}");
        assert!(
            all.iter()
                .all(|r| r.state == LeaseState::Ended(EndReason::Failed)),
            "{all:?}"
        );
        cancel.cancel();
        tracker.close();
        tracker.wait().await;
    }
}
