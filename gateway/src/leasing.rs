//! The lease shell: one task that owns the ledger, the lease table, the
//! provider and the [`Autoscaler`], like the hub owns the scheduler. Every
//! decision is the pure autoscaler's; this task only moves observations in
//! and carries actions out:
//!
//! * on start it adopts the live leases of the ledger whose worker still
//!   runs (their tokens re-armed, so the worker may register again) and
//!   ends the rest; an adopted lease that was draining (being released, or
//!   under a spot notice) is drained in the hub and released at once;
//! * every tick it asks the hub for the load (arrival rate, queue, p95
//!   against the budget, the leased workers' profiles, frames served per
//!   lease), records the frames in the ledger, feeds an [`Observation`] to
//!   the autoscaler, executes its [`Action`]s, accrues cost and updates the
//!   leasing metrics;
//! * `Acquire` → one-time token + ledger row → `provider.acquire` →
//!   `starting`; `Release` → the hub stops dispatching to the worker,
//!   `draining`, and [`RELEASE_GRACE`] later (its batches in flight come
//!   back; a timer of its own, not the tick) `provider.release` →
//!   `ended(released)`. A release the provider fails is retried, backing
//!   off, with the lease kept draining in the ledger: it may still bill,
//!   so it is never forgotten. `StopDispatch` → the hub stops dispatching;
//! * provider events: a spot notice drains the worker and goes to the
//!   autoscaler (which acquires a replacement); `Ended` ends the lease;
//! * the QUIC server asks it to check a worker's lease token (once) and
//!   tells it when the worker registered (`ready`) or went away; a process
//!   or Slurm worker that went away while its lease lives gets its token
//!   re-armed, so it may redial and register again (one connection at a
//!   time);
//! * static workers (`[[leasing.static_workers]]`) connect with their own
//!   token whether bound or not (one connection each); the hub gives an
//!   unbound one no batch. Binding one tells the hub (`LeaseBound`; the
//!   lease is ready at once if the worker is registered); the end of its
//!   lease other than by its disconnection unbinds it (`LeaseUnbound`: its
//!   connection stays, it takes no batch); its disconnection ends the
//!   lease as `lost`;
//! * a ledger write that fails is kept and retried every tick, in lifecycle
//!   order: a billing start or an end is never dropped.
//!
//! The pacing decisions (acquire backoff, start timeout, release due and
//! retry times) are the pure [`tidegate_lease::pacing`]; the shell reads
//! the clocks and sleeps.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::time::Duration;

use tidegate_lease::autoscale::{
    self, Action, Autoscaler, Event, ModelLoad, Observation, PolicyConfig, ReservedFloor,
    ScheduleEntry,
};
use tidegate_lease::catalog::InstanceType;
use tidegate_lease::ledger::{CostReport, LeaseRecord, Ledger, LedgerError, NewLease};
use tidegate_lease::pacing::{
    AcquireBackoff, ReleaseQueue, end_reason_while_releasing, start_timed_out,
};
use tidegate_lease::provider::kubernetes::KubernetesProvider;
use tidegate_lease::provider::process::{ProcessConfig, ProcessProvider};
use tidegate_lease::provider::slurm::SlurmProvider;
use tidegate_lease::provider::static_workers::{StaticConfig, StaticProvider};
use tidegate_lease::provider::{
    Acquired, LeaseSpec, Provider, ProviderError, ProviderEvent, wall_clock_ms,
};
use tidegate_lease::table::{ClaimError, LeaseEntry, TableError};
use tidegate_lease::{
    Catalog, EndReason, LeaseId, LeaseState, LeaseTable, LeaseToken, Millis, Money, Tier,
};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::config::{LeasingConfig, OnStop, ProviderKind, ScaledModel};
use crate::hub::{Hub, HubMsg, LoadReport};
use crate::metrics::Metrics;

/// Time between `Release` (dispatch stopped) and the provider's release of
/// the worker, for the batches it was running to come back.
pub const RELEASE_GRACE: Duration = Duration::from_secs(1);

/// Time from a `Release` decision until the lease has ended: the grace,
/// plus a margin for the provider to stop the worker. Paid-block-aware
/// keeps an hourly lease with less than this left in its block (releasing
/// it would pay for the next block anyway), and `[leasing]` validation
/// requires `release_window_secs` to fit a tick plus this, so that some
/// tick decides each release early enough.
pub const RELEASE_LEAD: Duration = Duration::from_secs(3);

/// How long after a spot notice's deadline a lease its provider has not
/// reported ended is released by the gateway.
pub const NOTICE_OVERRUN: Duration = Duration::from_secs(30);

/// A lease whose worker is dropped as stalled twice within this is ended
/// `lost` and replaced; after one stall it is kept (see
/// `Shell::replace_unserving`).
pub const STALL_WINDOW: Duration = Duration::from_secs(15 * 60);

/// How often the ledger is told which leases' workers are connected
/// (`last_seen_at`): a worker found gone after a restart is billed to then.
pub const SEEN_EVERY: Duration = Duration::from_secs(10);

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
    /// The ledger's folder could not be created.
    #[error(
        "cannot create the ledger's folder {path}: {source}; check `[leasing] ledger` and the gateway's permissions"
    )]
    LedgerFolder {
        /// The folder.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The lease table rebuilt from the ledger refused an adopted lease.
    #[error("lease table: {0}")]
    Table(#[from] TableError),
    /// The provider could not be set up or adopt the live leases.
    #[error("lease provider: {0}")]
    Provider(String),
    /// The lease shell's thread or runtime could not start.
    #[error("starting the lease shell's thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// Messages to the lease shell.
#[derive(Debug)]
enum LeasingMsg {
    Authenticate {
        name: String,
        token: String,
        reply: oneshot::Sender<Option<Result<WorkerPass, Refusal>>>,
    },
    Registered {
        lease: LeaseId,
    },
    Disconnected {
        lease: LeaseId,
    },
    StaticRegistered {
        name: String,
    },
    StaticDisconnected {
        name: String,
    },
    Leases {
        live_only: bool,
        limit: u32,
        reply: oneshot::Sender<Result<Vec<LeaseRecord>, String>>,
    },
    Costs {
        from: Millis,
        to: Millis,
        /// With the split by edge and model.
        split: bool,
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

/// What a worker's `Hello` proved ([`Leasing::authenticate`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WorkerPass {
    /// A worker started for this lease (process, Slurm): it serves it.
    Lease(LeaseId),
    /// A listed static worker (`[[leasing.static_workers]]`), by name,
    /// bound to a lease or not: it serves the lease bound to it, if any,
    /// and waits connected otherwise.
    Static(String),
}

/// A handle to the lease shell.
#[derive(Debug, Clone)]
pub struct Leasing {
    tx: mpsc::Sender<LeasingMsg>,
}

/// Why a worker's `Hello` was refused, and whether it should dial again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// What the worker is told.
    pub message: String,
    /// Its credentials hold, but the connection it would replace has not
    /// been seen to end yet (or the lease manager is busy): it may dial
    /// again after a backoff. Otherwise the refusal is final.
    pub retry_later: bool,
}

impl Refusal {
    fn later(message: String) -> Self {
        Refusal {
            message,
            retry_later: true,
        }
    }
}

impl From<String> for Refusal {
    fn from(message: String) -> Self {
        Refusal {
            message,
            retry_later: false,
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl Leasing {
    /// Checks a worker's `Hello`: `None` when the worker is neither a
    /// leased one nor a listed static one (the `[[workers]]` list decides),
    /// else what it proved or the reason it is refused. A lease token is
    /// accepted once; a static worker's token, by one connection at a time.
    pub async fn authenticate(
        &self,
        name: &str,
        token: &str,
    ) -> Option<Result<WorkerPass, Refusal>> {
        let (reply, rx) = oneshot::channel();
        let msg = LeasingMsg::Authenticate {
            name: name.to_string(),
            token: token.to_string(),
            reply,
        };
        if self.tx.send(msg).await.is_err() {
            return Some(Err(Refusal::later(
                "the gateway's lease manager has stopped".into(),
            )));
        }
        rx.await.unwrap_or_else(|_| {
            Some(Err(Refusal::later(
                "the gateway's lease manager has stopped".into(),
            )))
        })
    }

    /// The lease's worker registered (its models are warm): `ready`.
    pub async fn registered(&self, lease: LeaseId) {
        let _ = self.tx.send(LeasingMsg::Registered { lease }).await;
    }

    /// The lease's worker disconnected.
    pub async fn disconnected(&self, lease: LeaseId) {
        let _ = self.tx.send(LeasingMsg::Disconnected { lease }).await;
    }

    /// The static worker `name` registered (its models are warm): the
    /// lease bound to it, if any, is `ready`.
    pub async fn static_registered(&self, name: &str) {
        let name = name.to_string();
        let _ = self.tx.send(LeasingMsg::StaticRegistered { name }).await;
    }

    /// The static worker `name` disconnected: the lease bound to it, if
    /// any, ends as `lost`, and the worker may connect again.
    pub async fn static_disconnected(&self, name: &str) {
        let name = name.to_string();
        let _ = self.tx.send(LeasingMsg::StaticDisconnected { name }).await;
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

    /// Cost charged in `[from, to)`, split by edge and model
    /// (`/api/v1/costs`).
    pub async fn costs(&self, from: Millis, to: Millis) -> Result<CostReport, String> {
        self.cost_report(from, to, true).await
    }

    /// [`Leasing::costs`] without the split (cheaper on a long ledger).
    pub async fn cost_totals(&self, from: Millis, to: Millis) -> Result<CostReport, String> {
        self.cost_report(from, to, false).await
    }

    async fn cost_report(
        &self,
        from: Millis,
        to: Millis,
        split: bool,
    ) -> Result<CostReport, String> {
        let (reply, rx) = oneshot::channel();
        if self
            .tx
            .send(LeasingMsg::Costs {
                from,
                to,
                split,
                reply,
            })
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
    Kubernetes(Box<KubernetesProvider>),
    #[cfg(test)]
    Fake(fake::FakeProvider),
}

impl Source {
    fn name(&self) -> &'static str {
        match self {
            Source::Process { provider, .. } => provider.name(),
            Source::Static(p) => p.name(),
            Source::Slurm(p) => p.name(),
            Source::Kubernetes(p) => p.name(),
            #[cfg(test)]
            Source::Fake(p) => p.name(),
        }
    }

    /// Starts the acquire of `spec`; the future waits for the provider's
    /// answer, and holds no borrow of the provider.
    fn acquire(&mut self, mut spec: LeaseSpec) -> AcquireFuture {
        match self {
            Source::Process {
                provider,
                preempt_spot_after,
            } => {
                spec.preempt_after = *preempt_spot_after;
                Box::pin(provider.acquire(spec))
            }
            Source::Static(p) => Box::pin(p.acquire(spec)),
            Source::Slurm(p) => Box::pin(p.acquire(spec)),
            Source::Kubernetes(p) => Box::pin(p.acquire(spec)),
            #[cfg(test)]
            Source::Fake(p) => Box::pin(p.acquire(spec)),
        }
    }

    /// Starts the release of `lease`; the future waits until its worker is
    /// gone, and holds no borrow of the provider.
    fn release(&mut self, lease: LeaseId) -> ReleaseFuture {
        match self {
            Source::Process { provider, .. } => Box::pin(provider.release(lease)),
            Source::Static(p) => Box::pin(p.release(lease)),
            Source::Slurm(p) => Box::pin(p.release(lease)),
            Source::Kubernetes(p) => Box::pin(p.release(lease)),
            #[cfg(test)]
            Source::Fake(p) => Box::pin(p.release(lease)),
        }
    }

    /// Starts releasing `leases` together where the provider can (its
    /// workers drain at the same time); `release` then waits for each.
    async fn begin_release(&mut self, leases: &[LeaseId]) {
        match self {
            Source::Slurm(p) => p.begin_release(leases).await,
            Source::Kubernetes(p) => p.begin_release(leases).await,
            Source::Process { .. } | Source::Static(_) => {}
            #[cfg(test)]
            Source::Fake(p) => p.begin_release(leases),
        }
    }

    fn take_events(&mut self) -> Option<mpsc::Receiver<ProviderEvent>> {
        match self {
            Source::Process { provider, .. } => provider.take_events(),
            Source::Static(p) => p.take_events(),
            Source::Slurm(p) => p.take_events(),
            Source::Kubernetes(p) => p.take_events(),
            #[cfg(test)]
            Source::Fake(p) => p.take_events(),
        }
    }
}

/// A provider release under way: it ends when the worker is gone.
type ReleaseFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), ProviderError>> + Send>>;
type AcquireFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Acquired, ProviderError>> + Send>>;

/// A provider release's lease and how it ended.
type ReleaseOutcome = (LeaseId, Result<(), ProviderError>);

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
    let ledger_err = |source| LeasingError::Ledger {
        path: cfg.ledger.clone(),
        source,
    };
    if let Some(dir) = cfg.ledger.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| LeasingError::LedgerFolder {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    let ledger = Ledger::open(&cfg.ledger).map_err(ledger_err)?;
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
    let source = match cfg.provider {
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
                // validated: finite and within range
                preempt_spot_after: p
                    .preempt_spot_after_secs
                    .and_then(|s| Duration::try_from_secs_f64(s).ok()),
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
        ProviderKind::Kubernetes => {
            let mut k = cfg
                .kubernetes
                .clone()
                .ok_or_else(|| LeasingError::Provider("[leasing.kubernetes] is missing".into()))?;
            if !k.env.contains_key("TIDEGATE_GATEWAY_ADDR") {
                warn!(
                    "[leasing.kubernetes] env sets no TIDEGATE_GATEWAY_ADDR: worker Pods dial this gateway's own address, which only Pods on this host reach; set it to the gateway's Service"
                );
            }
            k.env = with_dial(&k.env);
            Source::Kubernetes(Box::new(
                KubernetesProvider::connect(k).map_err(provider_err)?,
            ))
        }
    };
    start(cfg, ledger, source, hub, metrics, cancel, tracker)
}

/// Adopts with `source` the ledger's live leases whose worker still runs,
/// ends the rest, and starts the shell.
fn start(
    cfg: &LeasingConfig,
    mut ledger: Ledger,
    mut source: Source,
    hub: Hub,
    metrics: Metrics,
    cancel: CancellationToken,
    tracker: &TaskTracker,
) -> Result<Leasing, LeasingError> {
    let catalog = cfg.load_catalog()?;
    let policy = cfg.policy_name()?;
    let ledger_err = |source| LeasingError::Ledger {
        path: cfg.ledger.clone(),
        source,
    };
    let now = wall_clock_ms();
    // Adopt what still runs, end the rest: no lease outlives its worker.
    let adopted = adopt_live(cfg, &mut ledger, &mut source, now)?;
    let mut table = ledger.load_table().map_err(ledger_err)?;
    let epoch = tokio::time::Instant::now();
    let (releases, absent) = rearm_adopted(cfg, &mut ledger, &mut table, &adopted)?;
    let events = source
        .take_events()
        .ok_or_else(|| LeasingError::Provider("provider events already taken".into()))?;

    let pc = policy_config(cfg, policy, &metrics, &catalog.currency);

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
        static_links: HashMap::new(),
        epoch,
        releases,
        backoff: AcquireBackoff::new(),
        writes: PendingWrites::default(),
        last_tick: None,
        seen_written: None,
        busy_ms: 0.0,
        leased_ms: 0.0,
        cost_seen: BTreeMap::new(),
        start_timeout_ms: cfg.start_timeout_secs.saturating_mul(1000),
        absent,
        rejoin_timeout_ms: cfg.rejoin_timeout_secs.saturating_mul(1000),
        stalls: HashMap::new(),
        in_flight: tokio::task::JoinSet::new(),
        in_flight_leases: HashMap::new(),
        acquiring: tokio::task::JoinSet::new(),
        acquiring_tasks: HashMap::new(),
        acquiring_leases: HashMap::new(),
        stopping: false,
        on_stop: cfg.on_stop,
    };
    shell.update_metrics(now);
    spawn_shell(
        shell,
        (rx, events),
        Duration::from_millis(cfg.tick_ms),
        cancel,
        tracker,
    )?;
    Ok(Leasing { tx })
}

/// Adopts with `source` the ledger's live leases whose worker still runs,
/// and ends the rest (`failed` if never started, else `lost`): no lease
/// outlives its worker. The adopted leases.
fn adopt_live(
    cfg: &LeasingConfig,
    ledger: &mut Ledger,
    source: &mut Source,
    now: Millis,
) -> Result<Vec<LeaseId>, LeasingError> {
    let ledger_err = |source| LeasingError::Ledger {
        path: cfg.ledger.clone(),
        source,
    };
    let provider_err = |e: ProviderError| LeasingError::Provider(e.to_string());
    let adopted = match source {
        Source::Process { provider, .. } => {
            provider.adopt(ledger, now).map_err(provider_err)?.adopted
        }
        Source::Slurm(provider) => provider.adopt(ledger, now).map_err(provider_err)?.adopted,
        Source::Kubernetes(provider) => provider.adopt(ledger, now).map_err(provider_err)?.adopted,
        Source::Static(_) => Vec::new(),
        #[cfg(test)]
        Source::Fake(provider) => provider.adopt(ledger).map_err(provider_err)?,
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
    Ok(adopted)
}

/// After adoption: each adopted lease's token is armed again (its worker
/// registers again with it), a lease adopted `ready` is absent until its
/// worker does, and one adopted `draining` is released at once. The
/// releases so scheduled, and the absent leases.
fn rearm_adopted(
    cfg: &LeasingConfig,
    ledger: &mut Ledger,
    table: &mut LeaseTable,
    adopted: &[LeaseId],
) -> Result<(ReleaseQueue, HashMap<LeaseId, Millis>), LeasingError> {
    let ledger_err = |source| LeasingError::Ledger {
        path: cfg.ledger.clone(),
        source,
    };
    let mut releases = ReleaseQueue::new();
    // An adopted lease's worker must redial this gateway: until it
    // registers, it is absent.
    let absent: HashMap<LeaseId, Millis> = adopted
        .iter()
        .filter(|id| table.get(**id).map(|e| e.state) == Some(LeaseState::Ready))
        .map(|id| (*id, 0))
        .collect();
    for id in adopted {
        // the adopted worker registers again with the token it was given
        table.rearm_claim(*id)?;
        ledger.set_token_claimed(*id, false).map_err(ledger_err)?;
        // A lease that was draining (being released, or under a spot
        // notice) when the gateway went down: no policy would ever release
        // it (it serves nothing), so release it now; the hub drains its
        // worker if it registers again meanwhile.
        if table.get(*id).map(|e| e.state) == Some(LeaseState::Draining) {
            info!(lease = %id, "adopted lease was draining; releasing it");
            releases.schedule(*id, 0, EndReason::Released);
        }
    }
    if !adopted.is_empty() {
        info!(adopted = ?adopted, "adopted live leases");
    }
    Ok((releases, absent))
}

/// The autoscaler's configuration from `[leasing]`; exports the spend cap
/// and every tier's cost counter at 0 in `currency`.
fn policy_config(
    cfg: &LeasingConfig,
    policy: autoscale::PolicyName,
    metrics: &Metrics,
    currency: &str,
) -> PolicyConfig {
    let mut pc = PolicyConfig::new(policy);
    if let Some(h) = cfg.headroom {
        pc.headroom = h;
    }
    pc.spend_cap_per_hour = cfg.spend_cap_per_hour.map(Money::from_units);
    if let Some(cap) = cfg.spend_cap_per_hour {
        metrics.spend_cap.with_label_values::<&str>(&[]).set(cap);
    }
    // Exported at 0 from the start, in the catalog's currency.
    for tier in Tier::ALL {
        metrics
            .cost_total
            .with_label_values(&[tier.as_str(), currency]);
    }
    // the windows are bounded by validate(); saturating all the same
    if let Some(s) = cfg.down_window_secs {
        pc.down_window_ms = s.saturating_mul(1000);
    }
    if let Some(s) = cfg.release_window_secs {
        pc.release_window_ms = s.saturating_mul(1000);
    }
    if let Some(s) = cfg.idle_timeout_secs {
        pc.idle_timeout_ms = s.saturating_mul(1000);
    }
    pc.release_lead_ms = RELEASE_LEAD.as_millis() as Millis;
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

    pc
}

/// Runs `shell` on a thread and runtime of its own until `cancel`; the
/// tracker waits for it at shutdown.
fn spawn_shell(
    shell: Shell,
    (rx, events): (mpsc::Receiver<LeasingMsg>, mpsc::Receiver<ProviderEvent>),
    tick: Duration,
    cancel: CancellationToken,
    tracker: &TaskTracker,
) -> Result<(), LeasingError> {
    // The shell blocks: SQLite writes (up to the ledger's busy timeout)
    // and the provider's tools. It runs on its own thread and runtime, so
    // the gateway's workers (QUIC, the hub, the API) never wait on it; the
    // tracker waits for it at shutdown.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(LeasingError::Thread)?;
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let span = info_span!("leasing");
    std::thread::Builder::new()
        .name("tidegate-leasing".into())
        .spawn(move || {
            runtime.block_on(shell.run(rx, events, tick, cancel).instrument(span));
            // Tasks the provider left (watchers of ended leases) end with
            // the runtime.
            drop(runtime);
            let _ = done_tx.send(());
        })
        .map_err(LeasingError::Thread)?;
    tracker.spawn(async move {
        let _ = done_rx.await;
    });
    Ok(())
}

/// A ledger write of one lease's lifecycle.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Write {
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
struct PendingWrites {
    by_lease: BTreeMap<LeaseId, Vec<Write>>,
}

impl PendingWrites {
    fn is_pending(&self, lease: LeaseId) -> bool {
        self.by_lease.contains_key(&lease)
    }

    /// Queues `w` behind the lease's earlier pending writes. An end makes
    /// the pending `ready`/`draining` moot (a pending start stays: the
    /// billing start must be written before the end).
    fn push(&mut self, lease: LeaseId, w: Write) {
        let q = self.by_lease.entry(lease).or_default();
        if matches!(w, Write::Ended { .. }) {
            q.retain(|p| matches!(p, Write::Starting { .. }));
        }
        if !q.iter().any(|p| p.rank() >= w.rank()) {
            q.push(w);
        }
    }
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
    /// What a clean stop does with the live leases.
    on_stop: OnStop,
    /// Throughput at the SLO measured from registered workers' profiles,
    /// by (model, instance type).
    measured: HashMap<(String, String), f64>,
    /// Static provider: the worker name bound to each lease.
    static_names: HashMap<LeaseId, String>,
    /// Static provider: the listed workers connected now, by name, and
    /// whether each has registered.
    static_links: HashMap<String, bool>,
    /// Start of the monotonic clock of the pacing decisions.
    epoch: tokio::time::Instant,
    /// Leases whose dispatch stopped, with when their provider release is
    /// due (or retried), on the monotonic clock.
    releases: ReleaseQueue,
    /// Acquisitions paused after leases failed to start (monotonic clock).
    backoff: AcquireBackoff,
    /// Ledger writes to retry.
    writes: PendingWrites,
    last_tick: Option<Millis>,
    /// When the connected workers were last written to the ledger as seen
    /// (monotonic clock).
    seen_written: Option<Millis>,
    /// GPU time spent running batches, and leased (billing started), since
    /// this gateway started (ms).
    busy_ms: f64,
    leased_ms: f64,
    /// Cost per tier already added to `tidegate_cost_total`.
    cost_seen: BTreeMap<Tier, f64>,
    /// A lease whose worker has not registered this long after it was
    /// requested is ended as `failed` and released (ms).
    start_timeout_ms: Millis,
    /// Ready leases whose worker's connection is gone, with since when
    /// (monotonic clock; adopted leases from the start).
    absent: HashMap<LeaseId, Millis>,
    /// A ready lease whose worker has been gone this long is ended as
    /// `lost` and released (ms).
    rejoin_timeout_ms: Millis,
    /// When each live lease's worker was last dropped as stalled
    /// (monotonic clock).
    stalls: HashMap<LeaseId, Millis>,
    /// Provider releases under way, each on a task of its own: a Pod's
    /// grace period or a job's drain never holds up the shell (worker
    /// logins, the API, ticks, spot notices and the acquisitions that
    /// replace a preempted lease).
    in_flight: tokio::task::JoinSet<ReleaseOutcome>,
    /// The lease of each task in `in_flight`.
    in_flight_leases: HashMap<tokio::task::Id, LeaseId>,
    /// Provider acquisitions under way, each on a task of its own, as the
    /// releases: an API server or `sbatch` slow to answer holds up nothing
    /// else (each provider bounds its calls).
    acquiring: tokio::task::JoinSet<Result<Acquired, ProviderError>>,
    /// The lease of each task in `acquiring`.
    acquiring_tasks: HashMap<tokio::task::Id, LeaseId>,
    /// What each lease under way was asked for.
    acquiring_leases: HashMap<LeaseId, Acquiring>,
    /// Shutting down: the autoscaler's acquisitions are no longer made.
    stopping: bool,
}

/// An acquire under way: the lease is `requested` in the ledger, and not in
/// the table until the provider has answered.
struct Acquiring {
    model: String,
    instance: InstanceType,
    tier: Tier,
    reason: autoscale::AcquireReason,
    token: LeaseToken,
    /// Its place in a chain of refusals (`AcquireRefused`).
    depth: u32,
    /// Its provider's events that came before the answer (its worker may
    /// end, or its spot node be reclaimed, that soon): handled after it.
    early: Vec<ProviderEvent>,
    /// The autoscaler released it before the answer: released after it.
    release_wanted: bool,
}

/// What a provider release came to.
enum Released {
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

impl Shell {
    /// The monotonic clock of the pacing decisions (ms since the shell
    /// started).
    fn mono(&self) -> Millis {
        self.epoch.elapsed().as_millis() as Millis
    }

    async fn run(
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
        self.source.begin_release(&released).await;
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
            match self.source {
                Source::Process { provider, .. } => provider.detach_all().await,
                Source::Slurm(p) => p.detach_all().await,
                Source::Kubernetes(p) => p.detach_all().await,
                Source::Static(_) => {}
                #[cfg(test)]
                Source::Fake(_) => {}
            }
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
                let bound = match &self.source {
                    Source::Static(p) => p.bound_lease(&name),
                    _ => None,
                };
                match bound {
                    Some(lease) => self.lease_registered(lease),
                    None => {
                        info!(worker = %name, "static worker registered unbound; it waits for a lease")
                    }
                }
            }
            LeasingMsg::StaticDisconnected { name } => {
                self.static_links.remove(&name);
                if let Source::Static(p) = &mut self.source
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
                if let Source::Static(p) = &mut self.source {
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
    fn lease_registered(&mut self, lease: LeaseId) {
        self.absent.remove(&lease);
        let now = wall_clock_ms();
        if self.state(lease) == Some(LeaseState::Starting) {
            self.write(lease, Write::Ready { at: now });
            let _ = self.table.transition(lease, LeaseState::Ready);
            info!(%lease, "lease ready: its worker registered");
            self.backoff.reset();
        }
        if let Source::Static(p) = &self.source
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
        let Source::Static(p) = &self.source else {
            return None;
        };
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

    async fn on_provider_event(&mut self, ev: ProviderEvent) {
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

    /// Writes `w` to the ledger now, or queues it to retry next tick when
    /// an earlier write of the lease is still pending or the ledger fails.
    /// A write the lifecycle refuses (the lease already moved past it, or
    /// ended) is moot and dropped.
    fn write(&mut self, lease: LeaseId, w: Write) {
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
    fn flush_writes(&mut self) {
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

    /// Ends a lease in the table at once and in the ledger (retried if the
    /// ledger fails), once.
    fn end(&mut self, lease: LeaseId, now: Millis, reason: EndReason) {
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
    async fn execute(&mut self, now: Millis, actions: Vec<Action>, depth: u32) {
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

    /// Asks the provider for a lease: recorded `requested`, then answered
    /// on a task of its own ([`Shell::acquire_answered`]).
    fn acquire(
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
            provider: self.source.name(),
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
        let answer = self.source.acquire(spec);
        let task = self.acquiring.spawn(answer);
        self.acquiring_tasks.insert(task.id(), id);
        debug!(lease = %id, model, instance_type, tier = tier.as_str(), ?reason, "lease requested");
        self.acquiring_leases.insert(
            id,
            Acquiring {
                model,
                instance,
                tier,
                reason,
                token,
                depth,
                early: Vec::new(),
                release_wanted: false,
            },
        );
    }

    /// The provider's answer to an acquire: the lease starts (billing from
    /// now), or it ends `failed`; a refusal for lack of capacity lets the
    /// autoscaler choose another type or tier.
    async fn acquire_answered(
        &mut self,
        joined: Result<(tokio::task::Id, Result<Acquired, ProviderError>), tokio::task::JoinError>,
    ) {
        let (task, answer) = match joined {
            Ok((task, answer)) => (task, Ok(answer)),
            Err(e) => (e.id(), Err(e.to_string())),
        };
        let Some(id) = self.acquiring_tasks.remove(&task) else {
            return;
        };
        let Some(a) = self.acquiring_leases.remove(&id) else {
            return;
        };
        let now = wall_clock_ms();
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
        let static_name = match &self.source {
            Source::Static(p) => p.worker_of(id).map(|w| w.name.clone()),
            _ => None,
        };
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
            Write::Starting {
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
            // (spot: on-demand instead meanwhile), so a full fleet
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
    fn start_failed(&mut self) {
        let pause_ms = self.backoff.start_failed(self.mono());
        warn!(pause_ms, "a lease failed to start; acquisitions paused");
    }

    /// The provider's release of `lease`. A provider that no longer holds
    /// it (its worker ended, and the provider dropped it) has nothing to
    /// release: that is `Gone` too.
    async fn provider_release(&mut self, lease: LeaseId) -> Released {
        Released::of(lease, self.source.release(lease).await)
    }

    /// Releases the leases whose release is due. Their workers all begin
    /// to drain first (a Pod deleted, a job cancelled), then each release
    /// waits for its own on a task of its own (`in_flight`): one after
    /// another, the last of a batch would end only after every drain
    /// before it, past the paid block it was timed to end in, and the
    /// shell would wait for them all. One the provider fails to release
    /// stays draining (in the ledger and the hub) and in the queue,
    /// retried with backoff: it may still bill, so it is never ended while
    /// its worker may run.
    async fn release_due(&mut self) {
        let due = self.releases.due(self.mono());
        if !due.is_empty() {
            self.source.begin_release(&due).await;
        }
        for lease in due {
            self.releases.start(lease);
            let release = self.source.release(lease);
            let task = self.in_flight.spawn(async move { (lease, release.await) });
            self.in_flight_leases.insert(task.id(), lease);
        }
    }

    /// A provider release under way has ended: the lease ends, or its
    /// release is retried with backoff.
    async fn release_finished(
        &mut self,
        joined: Result<(tokio::task::Id, ReleaseOutcome), tokio::task::JoinError>,
    ) {
        let (lease, released) = match joined {
            Ok((task, (lease, result))) => {
                self.in_flight_leases.remove(&task);
                (lease, Released::of(lease, result))
            }
            Err(e) => {
                let Some(lease) = self.in_flight_leases.remove(&e.id()) else {
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
                self.end(lease, wall_clock_ms(), reason);
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

    fn update_metrics(&mut self, now: Millis) {
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

#[cfg(test)]
mod fake {
    //! A scripted provider for the shell's tests: acquires at once, fails
    //! its releases while told to, and adopts the ledger's live `fake`
    //! leases.
    use std::collections::{BTreeSet, HashMap};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    use tidegate_lease::ledger::Ledger;
    use tidegate_lease::provider::{
        Acquired, EVENT_CHANNEL_CAPACITY, LeaseSpec, Provider, ProviderError, ProviderEvent,
    };
    use tidegate_lease::{LeaseId, LeaseToken};
    use tokio::sync::mpsc;

    /// What the test controls and observes.
    #[derive(Debug, Default)]
    pub struct Script {
        /// Releases fail while set (the worker keeps running).
        pub fail_releases: AtomicBool,
        /// Every release asked for, in order.
        pub release_calls: Mutex<Vec<LeaseId>>,
        /// Leases whose release was begun (`begin_release`), in order.
        pub begun: Mutex<Vec<LeaseId>>,
        /// Releases asked for before the lease's release was begun.
        pub unbegun_releases: AtomicUsize,
        /// The token handed to each acquired lease's worker.
        pub tokens: Mutex<HashMap<LeaseId, LeaseToken>>,
        /// While true, releases wait (a Pod's grace period, a job's drain).
        pub hold_releases: tokio::sync::watch::Sender<bool>,
        /// While true, acquisitions wait (an API server slow to answer).
        pub hold_acquires: tokio::sync::watch::Sender<bool>,
        /// While true, acquisitions panic once the lease is held (a bug in
        /// a provider, after it started a worker).
        pub panic_acquires: AtomicBool,
        /// The provider's event channel, for a test to report events.
        pub events: Mutex<Option<mpsc::Sender<ProviderEvent>>>,
    }

    impl Script {
        pub fn releases_of(&self, lease: LeaseId) -> usize {
            let calls = self.release_calls.lock().unwrap();
            calls.iter().filter(|l| **l == lease).count()
        }

        pub fn token(&self, lease: LeaseId) -> Option<String> {
            let tokens = self.tokens.lock().unwrap();
            tokens.get(&lease).map(|t| t.expose().to_string())
        }

        pub fn fail_releases(&self, fail: bool) {
            self.fail_releases.store(fail, Ordering::SeqCst);
        }

        pub fn hold_releases(&self, hold: bool) {
            self.hold_releases.send_replace(hold);
        }

        pub fn hold_acquires(&self, hold: bool) {
            self.hold_acquires.send_replace(hold);
        }

        /// Whether the shell has taken every event reported.
        pub fn events_taken(&self) -> bool {
            let tx = self.events.lock().unwrap();
            tx.as_ref()
                .is_some_and(|tx| tx.capacity() == tx.max_capacity())
        }

        /// Reports `ev` as the provider would.
        pub async fn report(&self, ev: ProviderEvent) {
            let tx = self.events.lock().unwrap().clone();
            tx.expect("a FakeProvider was made")
                .send(ev)
                .await
                .expect("the shell reads events");
        }
    }

    #[derive(Debug)]
    pub struct FakeProvider {
        script: Arc<Script>,
        held: BTreeSet<LeaseId>,
        events: Option<mpsc::Receiver<ProviderEvent>>,
    }

    impl FakeProvider {
        pub fn new(script: Arc<Script>) -> FakeProvider {
            let (tx, rx) = mpsc::channel(EVENT_CHANNEL_CAPACITY);
            *script.events.lock().unwrap() = Some(tx);
            FakeProvider {
                script,
                held: BTreeSet::new(),
                events: Some(rx),
            }
        }

        /// Starts the drain of every lease in `leases` at once.
        pub fn begin_release(&mut self, leases: &[LeaseId]) {
            self.script.begun.lock().unwrap().extend(leases);
        }

        /// Every live `fake` lease's worker "still runs".
        pub fn adopt(&mut self, ledger: &mut Ledger) -> Result<Vec<LeaseId>, ProviderError> {
            let ids: Vec<LeaseId> = ledger
                .live_leases()?
                .into_iter()
                .filter(|r| r.provider == "fake")
                .map(|r| r.id)
                .collect();
            self.held.extend(ids.iter().copied());
            Ok(ids)
        }
    }

    impl Provider for FakeProvider {
        fn name(&self) -> &'static str {
            "fake"
        }

        fn acquire(
            &mut self,
            spec: LeaseSpec,
        ) -> impl Future<Output = Result<Acquired, ProviderError>> + Send + 'static {
            self.held.insert(spec.lease);
            self.script
                .tokens
                .lock()
                .unwrap()
                .insert(spec.lease, spec.token.clone());
            let mut hold = self.script.hold_acquires.subscribe();
            let panics = self.script.panic_acquires.load(Ordering::SeqCst);
            async move {
                // held while the script says so
                let _ = hold.wait_for(|held| !held).await;
                assert!(!panics, "scripted panic in acquire");
                Ok(Acquired {
                    lease: spec.lease,
                    pid: None,
                    provider_data: None,
                    token: None,
                })
            }
        }

        fn release(
            &mut self,
            lease: LeaseId,
        ) -> impl Future<Output = Result<(), ProviderError>> + Send + 'static {
            self.script.release_calls.lock().unwrap().push(lease);
            if !self.script.begun.lock().unwrap().contains(&lease) {
                self.script.unbegun_releases.fetch_add(1, Ordering::SeqCst);
            }
            let result = if !self.held.contains(&lease) {
                Err(ProviderError::UnknownLease(lease))
            } else if self.script.fail_releases.load(Ordering::SeqCst) {
                Err(ProviderError::Slurm {
                    lease: Some(lease),
                    what: "scancel".into(),
                    detail: "the controller does not answer (scripted)".into(),
                })
            } else {
                self.held.remove(&lease);
                Ok(())
            };
            let mut hold = self.script.hold_releases.subscribe();
            async move {
                let _ = hold.wait_for(|held| !held).await;
                result
            }
        }

        fn take_events(&mut self) -> Option<mpsc::Receiver<ProviderEvent>> {
            self.events.take()
        }
    }
}

#[cfg(test)]
mod shell_tests {
    use std::sync::Arc;

    use super::fake::{FakeProvider, Script};
    use super::*;

    /// Bounded wait: polls `done` until it holds, failing after `guard`.
    async fn eventually<F, Fut>(guard: Duration, what: &str, mut done: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let until = tokio::time::Instant::now() + guard;
        while !done().await {
            assert!(tokio::time::Instant::now() < until, "timed out: {what}");
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    const GUARD: Duration = Duration::from_secs(20);

    fn config(dir: &std::path::Path, policy: &str, min_fps: u32) -> LeasingConfig {
        let text = format!(
            r#"
[leasing]
provider = "process"
ledger = "{}"
policy = "{policy}"
tick_ms = 100
[leasing.process]
command = "unused-by-the-fake-provider"
[[leasing.models]]
name = "m"
instance_types = ["cpu-32"]
worker_fps = 20
min_fps = {min_fps}
"#,
            dir.join("l.db").display()
        );
        let cfg: crate::config::Config = toml::from_str(&text).unwrap();
        cfg.validate().unwrap();
        cfg.leasing.unwrap()
    }

    fn start_fake(
        cfg: &LeasingConfig,
        script: &Arc<Script>,
    ) -> (Leasing, CancellationToken, TaskTracker) {
        let (l, cancel, tracker, _) = start_fake_metered(cfg, script);
        (l, cancel, tracker)
    }

    fn start_fake_metered(
        cfg: &LeasingConfig,
        script: &Arc<Script>,
    ) -> (Leasing, CancellationToken, TaskTracker, Metrics) {
        let (l, _, cancel, tracker, metrics) =
            start_fake_with_hub(cfg, script, crate::scheduler::Limits::default());
        (l, cancel, tracker, metrics)
    }

    /// [`start_fake_metered`] with the hub's scheduler `limits`, and the
    /// hub.
    fn start_fake_with_hub(
        cfg: &LeasingConfig,
        script: &Arc<Script>,
        limits: crate::scheduler::Limits,
    ) -> (Leasing, Hub, CancellationToken, TaskTracker, Metrics) {
        let cancel = CancellationToken::new();
        let tracker = TaskTracker::new();
        let metrics = Metrics::new();
        let hub = crate::hub::spawn(limits, None, metrics.clone(), cancel.clone(), &tracker);
        let ledger = Ledger::open(&cfg.ledger).unwrap();
        let source = Source::Fake(FakeProvider::new(script.clone()));
        let l = start(
            cfg,
            ledger,
            source,
            hub.clone(),
            metrics.clone(),
            cancel.clone(),
            &tracker,
        )
        .unwrap();
        (l, hub, cancel, tracker, metrics)
    }

    async fn stop(cancel: CancellationToken, tracker: TaskTracker) {
        cancel.cancel();
        tracker.close();
        tracker.wait().await;
    }

    async fn lease(l: &Leasing, id: LeaseId) -> LeaseRecord {
        let all = l.leases(false, 100).await.unwrap();
        all.into_iter().find(|r| r.id == id).expect("in the ledger")
    }

    /// The first lease, once its provider has answered.
    async fn first_lease(l: &Leasing) -> LeaseId {
        eventually(GUARD, "a lease acquired", || async {
            let leases = l.leases(true, 100).await.unwrap();
            leases
                .last()
                .is_some_and(|r| r.state != LeaseState::Requested)
        })
        .await;
        l.leases(true, 100).await.unwrap().last().unwrap().id
    }

    /// A lease whose worker registered while the ledger could not be
    /// written (another writer holds its lock; a full disk does the same)
    /// is ready in the table while the ledger still says starting: the
    /// start timeout goes by the table and does not end it as stuck.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_ready_lease_whose_ledger_write_waits_is_not_ended_by_the_start_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = config(dir.path(), "static-peak", 10);
        cfg.start_timeout_secs = 1;
        let script = Arc::new(Script::default());
        let (l, cancel, tracker) = start_fake(&cfg, &script);
        let id = first_lease(&l).await;
        // Another writer holds the lock: the shell's writes wait out the
        // busy timeout (5 s) and fail, to be retried.
        let blocker = rusqlite::Connection::open(&cfg.ledger).unwrap();
        blocker.execute_batch("BEGIN IMMEDIATE").unwrap();
        l.registered(id).await;
        // The registration's write waits 5 s and fails; the next tick's
        // retry does the same, then that tick checks the start timeout
        // (1 s, long past) with the ledger still saying `starting`.
        tokio::time::sleep(Duration::from_secs(12)).await;
        blocker.execute_batch("ROLLBACK").unwrap();
        eventually(Duration::from_secs(30), "ready in the ledger", || async {
            lease(&l, id).await.state == LeaseState::Ready
        })
        .await;
        // Longer than a release's lead: nothing was scheduled.
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert_eq!(script.releases_of(id), 0);
        assert_eq!(lease(&l, id).await.state, LeaseState::Ready);
        stop(cancel, tracker).await;
    }

    /// A release that takes long (a Pod's grace period, a job's drain)
    /// holds up nothing else: while it waits, the shell answers, and the
    /// replacement the floor needs is leased and its worker logs in. The
    /// lease ends only once its worker is gone.
    #[tokio::test]
    async fn a_long_release_holds_up_neither_the_shell_nor_the_replacement() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path(), "static-peak", 10);
        let script = Arc::new(Script::default());
        let (l, cancel, tracker) = start_fake(&cfg, &script);
        let id = a_release_held_under_way(&l, &script).await;
        replaced(&l, id).await;
        let next = l.leases(true, 100).await.unwrap();
        let next = next.iter().find(|r| r.id != id).unwrap().id;
        let token = script.token(next).unwrap();
        let name = next.to_string();
        let login = tokio::time::timeout(GUARD, l.authenticate(&name, &token)).await;
        assert_eq!(login.unwrap(), Some(Ok(WorkerPass::Lease(next))));
        let rec = lease(&l, id).await;
        assert_eq!(
            rec.state,
            LeaseState::Draining,
            "not ended before its worker is gone"
        );
        assert_eq!(script.releases_of(id), 1, "one try at a time");

        script.hold_releases(false);
        eventually(GUARD, "the lease released", || async {
            lease(&l, id).await.state.is_ended()
        })
        .await;
        assert_eq!(
            lease(&l, id).await.state,
            LeaseState::Ended(EndReason::Released)
        );
        assert_eq!(script.releases_of(id), 1);
        stop(cancel, tracker).await;
    }

    /// An acquire the provider takes long to answer (an API server that
    /// does not answer, an `sbatch` waiting on its controller) holds up
    /// nothing else: the shell answers, the lease is `requested` (counted,
    /// so the autoscaler asks for no other), its worker's login is put off
    /// until the answer, and an operator cannot release it yet; a provider
    /// event for it that comes before the answer is handled after it.
    #[tokio::test]
    async fn a_slow_acquire_holds_up_nothing_and_its_early_events_wait_for_it() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path(), "static-peak", 10);
        let script = Arc::new(Script::default());
        script.hold_acquires(true);
        let (l, cancel, tracker) = start_fake(&cfg, &script);
        eventually(GUARD, "a lease requested", || async {
            !l.leases(true, 100).await.unwrap().is_empty()
        })
        .await;
        let id = l.leases(true, 100).await.unwrap()[0].id;
        // a few ticks: still one lease asked for, and the shell answers
        tokio::time::sleep(Duration::from_millis(300)).await;
        let live = tokio::time::timeout(GUARD, l.leases(true, 100))
            .await
            .expect("the shell answers while the provider does not")
            .unwrap();
        assert_eq!(live.len(), 1, "{live:#?}");
        assert_eq!(live[0].state, LeaseState::Requested);
        let token = script.token(id).unwrap();
        let login = l.authenticate(&id.to_string(), &token).await;
        assert!(
            matches!(&login, Some(Err(r)) if r.to_string().contains("still being acquired")),
            "{login:?}"
        );
        assert_eq!(l.release(id).await, Err(ReleaseRefused::NotYetStarted(id)));
        // its spot node is reclaimed before the answer comes
        script
            .report(ProviderEvent::PreemptionNotice {
                lease: id,
                deadline: wall_clock_ms() + 60_000,
            })
            .await;
        eventually(GUARD, "the notice taken before the answer", || async {
            script.events_taken()
        })
        .await;
        assert_eq!(
            lease(&l, id).await.state,
            LeaseState::Requested,
            "kept for after the answer"
        );
        script.hold_acquires(false);
        eventually(GUARD, "the notice drains it once acquired", || async {
            lease(&l, id).await.state == LeaseState::Draining
        })
        .await;
        replaced(&l, id).await;
        stop(cancel, tracker).await;
    }

    /// An acquire whose task panics (a provider's bug) may have left a
    /// worker running: the provider is asked to release the lease, which
    /// then ends failed, neither `requested` for ever nor billing unseen;
    /// a release that fails is retried. Acquisitions go on afterwards.
    #[tokio::test]
    async fn a_panicking_acquire_is_released_at_its_provider_and_ends_failed() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path(), "static-peak", 10);
        let script = Arc::new(Script::default());
        script
            .panic_acquires
            .store(true, std::sync::atomic::Ordering::SeqCst);
        script.fail_releases(true);
        let (l, cancel, tracker) = start_fake(&cfg, &script);
        eventually(GUARD, "a release of the panicked acquire tried", || async {
            script.release_calls.lock().unwrap().len() >= 2
        })
        .await;
        script
            .panic_acquires
            .store(false, std::sync::atomic::Ordering::SeqCst);
        let id = script.release_calls.lock().unwrap()[0];
        // its release failed: the worker may run, the lease is not over
        assert_eq!(lease(&l, id).await.state, LeaseState::Requested);
        script.fail_releases(false);
        eventually(GUARD, "the panicked lease released and ended", || async {
            lease(&l, id).await.state == LeaseState::Ended(EndReason::Failed)
        })
        .await;
        let rec = lease(&l, id).await;
        assert_eq!(rec.billing_start, None, "it never started");
        assert!(rec.ended_at.is_some());
        // the provider no longer holds it, and acquisitions go on
        let next = first_lease(&l).await;
        assert_ne!(next, id);
        stop(cancel, tracker).await;
    }

    /// The first lease, ready, whose release an operator asked for and
    /// the provider holds under way (`Script::hold_releases`).
    async fn a_release_held_under_way(l: &Leasing, script: &Script) -> LeaseId {
        let id = first_lease(l).await;
        l.registered(id).await;
        script.hold_releases(true);
        l.release(id).await.unwrap();
        eventually(GUARD, "the release under way", || async {
            script.releases_of(id) == 1
        })
        .await;
        id
    }

    /// The provider reports the end of a lease whose release is under way
    /// (its worker exited first): the lease ends once, as released, and
    /// the release's own result, coming later, changes nothing; a spot
    /// notice arriving for it after its end neither drains nor replaces
    /// anything.
    #[tokio::test]
    async fn an_end_reported_during_a_release_ends_the_lease_once() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path(), "static-peak", 10);
        let script = Arc::new(Script::default());
        let (l, cancel, tracker, metrics) = start_fake_metered(&cfg, &script);
        let id = a_release_held_under_way(&l, &script).await;
        script
            .report(ProviderEvent::Ended {
                lease: id,
                reason: EndReason::Lost,
                detail: "worker exited: exit status: 0".into(),
            })
            .await;
        eventually(GUARD, "the lease ended", || async {
            lease(&l, id).await.state.is_ended()
        })
        .await;
        let rec = lease(&l, id).await;
        assert_eq!(
            rec.state,
            LeaseState::Ended(EndReason::Released),
            "as meant"
        );
        script
            .report(ProviderEvent::PreemptionNotice {
                lease: id,
                deadline: wall_clock_ms(),
            })
            .await;
        script.hold_releases(false);
        replaced(&l, id).await;
        // a few ticks for anything left to happen
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(lease(&l, id).await, rec, "ended once");
        assert_eq!(script.releases_of(id), 1);
        let tier = rec.tier.as_str();
        let ends = |reason: &str| metrics.lease_ends.with_label_values(&[tier, reason]).get();
        assert_eq!(
            (ends("released"), ends("lost"), ends("preempted")),
            (1, 0, 0)
        );
        let live = l.leases(true, 100).await.unwrap();
        assert_eq!(
            live.len(),
            1,
            "one replacement, none for the late notice: {live:?}"
        );
        stop(cancel, tracker).await;
    }

    #[tokio::test]
    async fn a_release_the_provider_fails_keeps_the_lease_draining_and_is_retried() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path(), "tidal", 10);
        let script = Arc::new(Script::default());
        let (l, cancel, tracker, metrics) = start_fake_metered(&cfg, &script);
        let id = first_lease(&l).await;

        script.fail_releases(true);
        l.release(id).await.unwrap();
        eventually(GUARD, "the release tried twice", || async {
            script.releases_of(id) >= 2
        })
        .await;
        // the worker may still run and bill: the lease is not ended
        let rec = lease(&l, id).await;
        assert_eq!(rec.state, LeaseState::Draining, "{rec:?}");
        assert!(rec.ended_at.is_none(), "{rec:?}");

        script.fail_releases(false);
        eventually(GUARD, "the lease released", || async {
            lease(&l, id).await.state.is_ended()
        })
        .await;
        let rec = lease(&l, id).await;
        assert_eq!(rec.state, LeaseState::Ended(EndReason::Released), "{rec:?}");
        // counted: its acquisition, every failed release, its end
        let tier = rec.tier.as_str();
        assert!(
            metrics
                .lease_acquires
                .with_label_values(&[tier, "ok"])
                .get()
                >= 1
        );
        assert!(metrics.lease_release_failures.get() >= 2);
        assert_eq!(
            metrics
                .lease_ends
                .with_label_values(&[tier, "released"])
                .get(),
            1
        );
        let tries = script.releases_of(id);
        assert!(tries >= 3, "released on a retry: {tries} tries");
        // each release waited only after every due lease began to drain
        assert_eq!(
            script
                .unbegun_releases
                .load(std::sync::atomic::Ordering::SeqCst),
            0
        );
        stop(cancel, tracker).await;
        // the replacement the floor needed was released at shutdown; the
        // first lease was not released again
        assert_eq!(script.releases_of(id), tries);
        let ledger = Ledger::open(&cfg.ledger).unwrap();
        assert!(ledger.live_leases().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_lease_whose_release_keeps_failing_is_left_live_at_shutdown_for_the_next_start() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path(), "static-peak", 10);
        let script = Arc::new(Script::default());
        let (l, cancel, tracker) = start_fake(&cfg, &script);
        let id = first_lease(&l).await;
        script.fail_releases(true);
        stop(cancel, tracker).await;
        assert!(script.releases_of(id) >= 1);
        // not forgotten: still live, so the next start adopts (or ends) it
        let ledger = Ledger::open(&cfg.ledger).unwrap();
        let live: Vec<LeaseId> = ledger.live_leases().unwrap().iter().map(|r| r.id).collect();
        assert_eq!(live, vec![id]);
    }

    /// A lease left in the ledger by a previous gateway, of the fake
    /// provider, in `state` (draining: being released or under a notice).
    fn recorded(cfg: &LeasingConfig, draining: bool) -> LeaseId {
        let catalog = Catalog::default_catalog();
        let mut ledger = Ledger::open(&cfg.ledger).unwrap();
        let token = LeaseToken::generate().unwrap();
        let t0 = wall_clock_ms() - 60_000;
        let id = ledger
            .insert_requested(&NewLease {
                provider: "fake",
                model: Some("m"),
                instance: catalog.get("cpu-32").unwrap(),
                tier: Tier::Spot,
                currency: &catalog.currency,
                requested_at: t0,
                token: Some(token.digest()),
            })
            .unwrap();
        ledger.mark_starting(id, t0, None, None).unwrap();
        ledger.mark_ready(id, t0 + 1000).unwrap();
        ledger.set_token_claimed(id, true).unwrap();
        if draining {
            ledger.mark_draining(id).unwrap();
        }
        id
    }

    #[tokio::test]
    async fn an_adopted_draining_lease_is_released_at_start_and_a_ready_one_kept() {
        let dir = tempfile::tempdir().unwrap();
        // static-peak with no load neither acquires nor releases: what
        // happens is the restart's doing
        let cfg = config(dir.path(), "static-peak", 0);
        let draining = recorded(&cfg, true);
        let ready = recorded(&cfg, false);
        let script = Arc::new(Script::default());
        let (l, cancel, tracker) = start_fake(&cfg, &script);
        eventually(GUARD, "the draining lease released", || async {
            lease(&l, draining).await.state.is_ended()
        })
        .await;
        assert_eq!(
            lease(&l, draining).await.state,
            LeaseState::Ended(EndReason::Released)
        );
        assert_eq!(script.releases_of(draining), 1);
        // the ready one was adopted, its token re-armed, and kept
        let rec = lease(&l, ready).await;
        assert_eq!(rec.state, LeaseState::Ready, "{rec:?}");
        assert!(!rec.token_claimed, "{rec:?}");
        assert_eq!(script.releases_of(ready), 0);
        stop(cancel, tracker).await;
    }

    /// After a restart, an adopted ready lease whose worker never redials
    /// this gateway is ended `lost` after the rejoin timeout and released;
    /// one whose worker registers again is kept.
    #[tokio::test]
    async fn an_adopted_lease_whose_worker_never_redials_is_ended_lost() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = config(dir.path(), "static-peak", 0);
        cfg.rejoin_timeout_secs = 1;
        let back = recorded(&cfg, false);
        let gone = recorded(&cfg, false);
        let script = Arc::new(Script::default());
        let (l, cancel, tracker) = start_fake(&cfg, &script);
        l.registered(back).await;
        ended_lost_and_released(&l, &script, gone).await;
        assert_eq!(lease(&l, back).await.state, LeaseState::Ready);
        assert_eq!(script.releases_of(back), 0);
        stop(cancel, tracker).await;
    }

    /// A ready lease whose worker's link dropped and never came back (a
    /// hung process, a lost network: its provider reports nothing) is
    /// ended `lost` after the rejoin timeout, released at the provider,
    /// and replaced; one whose worker redials in time is kept.
    #[tokio::test]
    async fn a_lease_whose_worker_never_redials_is_ended_lost_released_and_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = config(dir.path(), "static-peak", 10);
        cfg.rejoin_timeout_secs = 1;
        let script = Arc::new(Script::default());
        let (l, cancel, tracker) = start_fake(&cfg, &script);
        let id = first_lease(&l).await;
        l.registered(id).await;
        // back in time: kept
        l.disconnected(id).await;
        l.registered(id).await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(lease(&l, id).await.state, LeaseState::Ready);
        assert_eq!(script.releases_of(id), 0);

        // gone for good
        l.disconnected(id).await;
        ended_lost_released_and_replaced(&l, &script, id).await;
        stop(cancel, tracker).await;
    }

    /// Waits for `id` to end, checks that it ended `lost` and was
    /// released at the provider once, and waits for a new lease.
    async fn ended_lost_released_and_replaced(l: &Leasing, script: &Script, id: LeaseId) {
        ended_lost_and_released(l, script, id).await;
        replaced(l, id).await;
    }

    /// Waits for `id` to end, and checks that it ended `lost` and was
    /// released at the provider once.
    async fn ended_lost_and_released(l: &Leasing, script: &Script, id: LeaseId) {
        eventually(GUARD, "the lease ended", || async {
            lease(l, id).await.state.is_ended()
        })
        .await;
        assert_eq!(lease(l, id).await.state, LeaseState::Ended(EndReason::Lost));
        assert_eq!(script.releases_of(id), 1, "stopped at the provider");
    }

    /// Waits for a live lease other than `id`.
    /// Waits for a lease other than `id`, acquired.
    async fn replaced(l: &Leasing, id: LeaseId) {
        eventually(GUARD, "a new lease replaces it", || async {
            l.leases(true, 100)
                .await
                .unwrap()
                .iter()
                .any(|r| r.id != id && r.state != LeaseState::Requested)
        })
        .await;
    }

    /// The hub drops a worker whose batch is far past due while its link
    /// lives. Once, the lease is kept (a slow first batch of a new size);
    /// when the worker, registered again, stalls a second time (a wedged
    /// GPU), its lease is ended `lost`, released at the provider (which
    /// stops the process) and replaced.
    #[tokio::test]
    async fn a_lease_whose_worker_stalls_twice_is_ended_lost_released_and_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path(), "static-peak", 10);
        let script = Arc::new(Script::default());
        let limits = crate::scheduler::Limits {
            stall_us: 200_000,
            ..Default::default()
        };
        let (l, hub, cancel, tracker, metrics) = start_fake_with_hub(&cfg, &script, limits);
        let id = first_lease(&l).await;
        l.registered(id).await;
        let (results, _answers) = tidegate_protocol::queue::channel(8, 1 << 20);
        hub.send(HubMsg::EdgeConnected {
            edge: crate::scheduler::EdgeId(1),
            name: "e".into(),
            weight: 1,
            results,
            hints: crate::hub::HintBox::new(),
        })
        .await;
        stall_once(&hub, id, 1).await;
        eventually(GUARD, "the first stall counted", || async {
            metrics.workers_stalled.get() == 1
        })
        .await;
        // ten ticks later: kept
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(lease(&l, id).await.state, LeaseState::Ready);
        assert_eq!(script.releases_of(id), 0);

        stall_once(&hub, id, 2).await;
        ended_lost_released_and_replaced(&l, &script, id).await;
        assert_eq!(metrics.workers_stalled.get(), 2);
        stop(cancel, tracker).await;
    }

    /// The ledger learns when each lease's worker was last connected (at
    /// most every `SEEN_EVERY`), which bills a worker found gone after a
    /// restart; a lease with no worker connected is not seen.
    #[tokio::test]
    async fn connected_workers_are_recorded_as_seen_in_the_ledger() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path(), "static-peak", 10);
        let script = Arc::new(Script::default());
        let (l, hub, cancel, tracker, _) =
            start_fake_with_hub(&cfg, &script, crate::scheduler::Limits::default());
        let id = first_lease(&l).await;
        // a few ticks without its worker
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(lease(&l, id).await.last_seen_at, None);
        let before = wall_clock_ms();
        let _batches = leased_worker(&hub, id, 1).await;
        eventually(GUARD, "its worker recorded as seen", || async {
            lease(&l, id)
                .await
                .last_seen_at
                .is_some_and(|t| t >= before)
        })
        .await;
        stop(cancel, tracker).await;
    }

    #[tokio::test]
    async fn frames_served_since_the_last_tick_reach_the_ledger_on_a_clean_stop() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = config(dir.path(), "static-peak", 10);
        // one tick, the first: everything after it is reported at the stop
        cfg.tick_ms = 3_600_000;
        let script = Arc::new(Script::default());
        let (l, hub, cancel, tracker, _) =
            start_fake_with_hub(&cfg, &script, crate::scheduler::Limits::default());
        let id = first_lease(&l).await;
        let mut batches = leased_worker(&hub, id, 1).await;
        let (results, mut answers) = tidegate_protocol::queue::channel(8, 1 << 20);
        hub.send(HubMsg::EdgeConnected {
            edge: crate::scheduler::EdgeId(1),
            name: "e".into(),
            weight: 1,
            results,
            hints: crate::hub::HintBox::new(),
        })
        .await;
        for seq in 1..=3 {
            hub.send(HubMsg::Frame {
                edge: crate::scheduler::EdgeId(1),
                frame: crate::hub::tests::frame(seq),
                deadline: std::time::Instant::now() + Duration::from_secs(5),
            })
            .await;
            let d = tokio::time::timeout(GUARD, batches.recv())
                .await
                .unwrap()
                .expect("a batch");
            let items = d
                .items
                .iter()
                .map(|i| tidegate_protocol::ItemResult {
                    id: i.id,
                    status: tidegate_protocol::Status::Ok,
                    detections: Vec::new(),
                    timings: Default::default(),
                    outputs: Vec::new(),
                })
                .collect();
            hub.send(HubMsg::BatchDone {
                worker: crate::scheduler::WorkerId(1),
                result: tidegate_protocol::BatchResult {
                    batch: d.batch,
                    items,
                },
            })
            .await;
            let r = tokio::time::timeout(GUARD, answers.recv())
                .await
                .unwrap()
                .expect("a result");
            assert_eq!(r.status, tidegate_protocol::Status::Ok);
        }
        stop(cancel, tracker).await;
        let ledger = Ledger::open(&cfg.ledger).unwrap();
        let r = ledger.lease(id).unwrap().expect("in the ledger");
        assert_eq!(r.frames_within_slo + r.frames_late, 3, "{r:?}");
        // and the worker time each edge took, for the cost split
        let costs = ledger.costs(0, wall_clock_ms() + 1).unwrap();
        assert_eq!(costs.by_edge.keys().collect::<Vec<_>>(), ["e"], "{costs:?}");
    }

    /// Worker `n` registers with the hub for `lease`; its batches.
    async fn leased_worker(
        hub: &Hub,
        lease: LeaseId,
        n: u64,
    ) -> mpsc::Receiver<tidegate_protocol::Dispatch> {
        let (dispatch, batches) = mpsc::channel(8);
        hub.send(HubMsg::WorkerConnected {
            worker: crate::scheduler::WorkerId(n),
            register: crate::hub::tests::register(),
            dispatch,
            lease: Some(lease),
            static_worker: None,
            drain: CancellationToken::new(),
        })
        .await;
        batches
    }

    /// Worker `n` registers for `lease` with the hub and takes frame `n`
    /// of edge 1, which it never answers.
    async fn stall_once(hub: &Hub, lease: LeaseId, n: u64) {
        let mut batches = leased_worker(hub, lease, n).await;
        hub.send(HubMsg::Frame {
            edge: crate::scheduler::EdgeId(1),
            frame: crate::hub::tests::frame(n),
            deadline: std::time::Instant::now() + Duration::from_secs(5),
        })
        .await;
        let taken = tokio::time::timeout(GUARD, batches.recv()).await.unwrap();
        assert!(taken.is_some(), "worker {n} took the frame");
    }

    #[tokio::test]
    async fn a_worker_whose_link_dropped_may_register_again_with_its_own_token_once() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path(), "static-peak", 10);
        let script = Arc::new(Script::default());
        let (l, cancel, tracker) = start_fake(&cfg, &script);
        let id = first_lease(&l).await;
        let name = id.to_string();
        let token = script.token(id).unwrap();
        assert_eq!(
            l.authenticate(&name, &token).await,
            Some(Ok(WorkerPass::Lease(id)))
        );
        let again = l.authenticate(&name, &token).await.unwrap().unwrap_err();
        assert!(again.message.contains("already used"), "{again}");
        assert!(again.retry_later, "the first link may be dead unnoticed");
        l.registered(id).await;

        // its link drops: the same worker redials with the same token
        l.disconnected(id).await;
        let wrong = l.authenticate(&name, "guess").await.unwrap().unwrap_err();
        assert!(wrong.message.contains("does not match"), "{wrong}");
        assert!(!wrong.retry_later, "a wrong token is final");
        assert_eq!(
            l.authenticate(&name, &token).await,
            Some(Ok(WorkerPass::Lease(id)))
        );
        // still one connection at a time
        let again = l.authenticate(&name, &token).await.unwrap().unwrap_err();
        assert!(again.message.contains("already used"), "{again}");

        // once the lease has ended, a disconnect re-arms nothing
        l.release(id).await.unwrap();
        eventually(GUARD, "the lease released", || async {
            lease(&l, id).await.state.is_ended()
        })
        .await;
        l.disconnected(id).await;
        let gone = l.authenticate(&name, &token).await.unwrap().unwrap_err();
        assert!(gone.message.contains("not a live lease"), "{gone}");
        assert!(!gone.retry_later, "an ended lease is final");
        stop(cancel, tracker).await;
    }

    #[test]
    fn pending_ledger_writes_keep_lifecycle_order_and_an_end_supersedes_the_rest() {
        let l = LeaseId(1);
        let mut w = PendingWrites::default();
        w.push(
            l,
            Write::Starting {
                at: 5,
                pid: None,
                data: None,
            },
        );
        w.push(l, Write::Ready { at: 6 });
        w.push(l, Write::Draining);
        // an earlier stage queued after a later one is moot
        w.push(l, Write::Ready { at: 7 });
        assert_eq!(w.by_lease[&l].len(), 3);
        w.push(
            l,
            Write::Ended {
                at: 8,
                reason: EndReason::Released,
            },
        );
        // the billing start stays (it must be written before the end); the
        // ready and draining marks are moot
        assert_eq!(
            w.by_lease[&l],
            vec![
                Write::Starting {
                    at: 5,
                    pid: None,
                    data: None
                },
                Write::Ended {
                    at: 8,
                    reason: EndReason::Released
                }
            ]
        );
        // nothing after an end
        w.push(l, Write::Draining);
        assert_eq!(w.by_lease[&l].len(), 2);
        assert!(w.is_pending(l));
        assert!(!w.is_pending(LeaseId(2)));
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
        let (l, _hub, cancel, tracker) = start_with_hub(cfg).await;
        (l, cancel, tracker)
    }

    /// [`start`], with the hub the shell drives.
    async fn start_with_hub(cfg: &LeasingConfig) -> (Leasing, Hub, CancellationToken, TaskTracker) {
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
        let l = spawn(cfg, quic, hub.clone(), metrics, cancel.clone(), &tracker).unwrap();
        (l, hub, cancel, tracker)
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
        while live(&l)
            .await
            .iter()
            .all(|r| r.state == LeaseState::Requested)
        {
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
        assert!(wrong.message.contains("does not match"), "{wrong}");
        assert_eq!(
            l.authenticate("gpu-a", "gpu-a-secret").await,
            Some(Ok(WorkerPass::Static("gpu-a".into())))
        );
        let again = l
            .authenticate("gpu-a", "gpu-a-secret")
            .await
            .unwrap()
            .unwrap_err();
        assert!(again.message.contains("already connected"), "{again}");
        let bad = l.authenticate("lease-x", "t").await.unwrap().unwrap_err();
        assert!(bad.message.contains("lease-<id>"), "{bad}");

        l.static_registered("gpu-a").await;
        let until = tokio::time::Instant::now() + Duration::from_secs(5);
        while live(&l).await[0].state != LeaseState::Ready {
            assert!(tokio::time::Instant::now() < until, "lease never ready");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(live(&l).await[0].id, id, "the bound lease is ready");
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

    /// Polls `done` every 25 ms until it holds; fails after 10 s.
    async fn until<F, Fut>(what: &str, mut done: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let until = tokio::time::Instant::now() + Duration::from_secs(10);
        while !done().await {
            assert!(tokio::time::Instant::now() < until, "timed out: {what}");
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Connects and registers the static worker `gpu-a` as worker `id`:
    /// the batches the hub sends it.
    async fn connect_static(
        l: &Leasing,
        hub: &Hub,
        id: u64,
    ) -> mpsc::Receiver<tidegate_protocol::Dispatch> {
        assert_eq!(
            l.authenticate("gpu-a", "gpu-a-secret").await,
            Some(Ok(WorkerPass::Static("gpu-a".into())))
        );
        let (dispatch, batches) = mpsc::channel(8);
        hub.send(HubMsg::WorkerConnected {
            worker: crate::scheduler::WorkerId(id),
            register: tidegate_protocol::Register {
                worker: "gpu-a".into(),
                device: "cpu".into(),
                models: Vec::new(),
                profile: Vec::new(),
                codecs: Vec::new(),
            },
            dispatch,
            lease: None,
            static_worker: Some("gpu-a".into()),
            drain: CancellationToken::new(),
        })
        .await;
        l.static_registered("gpu-a").await;
        batches
    }

    /// The hub's view of worker `id`: its lease and whether it is unbound.
    async fn worker_view(hub: &Hub, id: u64) -> Option<(Option<u64>, bool)> {
        let snap = hub.snapshot().await?;
        snap.workers
            .iter()
            .find(|w| w.id == id)
            .map(|w| (w.lease, w.unbound))
    }

    #[tokio::test]
    async fn a_released_static_lease_unbinds_its_worker_which_stays_connected_and_is_bound_again() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = static_config(dir.path());
        let (l, hub, cancel, tracker) = start_with_hub(&cfg).await;
        // the worker connects whether or not the reserved floor has bound
        // it yet; either way its lease becomes ready and the hub serves it
        let mut batches = connect_static(&l, &hub, 1).await;
        let again = l
            .authenticate("gpu-a", "gpu-a-secret")
            .await
            .unwrap()
            .unwrap_err();
        assert!(again.message.contains("already connected"), "{again}");
        until("the first lease ready", || async {
            live(&l)
                .await
                .first()
                .is_some_and(|r| r.state == LeaseState::Ready)
        })
        .await;
        let first = live(&l).await[0].id;
        until("the hub serves the first lease", || async {
            worker_view(&hub, 1).await == Some((Some(first.0), false))
        })
        .await;

        // an operator releases it: the lease ends released, the worker
        // stays (its dispatch channel open) and the floor binds it again
        // under a new lease, ready at once since it is registered
        l.release(first).await.unwrap();
        until("the first lease released", || async {
            let all = l.leases(false, 100).await.unwrap();
            all.iter()
                .any(|r| r.id == first && r.state == LeaseState::Ended(EndReason::Released))
        })
        .await;
        until("a second lease ready on the same worker", || async {
            live(&l)
                .await
                .iter()
                .any(|r| r.id != first && r.state == LeaseState::Ready)
        })
        .await;
        let second = live(&l)
            .await
            .iter()
            .find(|r| r.id != first && r.state == LeaseState::Ready)
            .expect("the second lease")
            .id;
        until("the hub serves the second lease", || async {
            worker_view(&hub, 1).await == Some((Some(second.0), false))
        })
        .await;
        assert!(
            matches!(batches.try_recv(), Err(mpsc::error::TryRecvError::Empty)),
            "the worker's link was kept"
        );
        let all = l.leases(false, 100).await.unwrap();
        for id in [first, second] {
            let r = all.iter().find(|r| r.id == id).unwrap();
            assert!(
                r.provider_data
                    .as_deref()
                    .is_some_and(|d| d.contains("gpu-a")),
                "both leases bound gpu-a: {r:?}"
            );
        }

        // its disconnection ends the lease as lost; it may connect again,
        // and the floor binds it once more
        hub.send(HubMsg::WorkerGone {
            worker: crate::scheduler::WorkerId(1),
        })
        .await;
        l.static_disconnected("gpu-a").await;
        until("the second lease lost", || async {
            let all = l.leases(false, 100).await.unwrap();
            all.iter()
                .any(|r| r.id == second && r.state == LeaseState::Ended(EndReason::Lost))
        })
        .await;
        let _batches = connect_static(&l, &hub, 2).await;
        until("a third lease ready", || async {
            live(&l)
                .await
                .iter()
                .any(|r| r.id != second && r.id != first && r.state == LeaseState::Ready)
        })
        .await;
        cancel.cancel();
        tracker.close();
        tracker.wait().await;
    }

    #[tokio::test]
    async fn acquires_the_provider_refuses_are_not_asked_again_at_every_tick() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = static_config(dir.path());
        // 100 fps (+3%) takes six 20-fps workers; one is listed, reserved:
        // five spot acquires are refused, then their on-demand fallbacks
        cfg.models[0].min_fps = 100.0;
        let (l, cancel, tracker) = start(&cfg).await;
        // Refusals end as `no_capacity`, not `failed`.
        let failed = |all: &[LeaseRecord], tier: Tier| {
            all.iter()
                .filter(|r| r.tier == tier && r.state == LeaseState::Ended(EndReason::NoCapacity))
                .count()
        };
        until("an on-demand fallback refused", || async {
            failed(&l.leases(false, 1000).await.unwrap(), Tier::OnDemand) > 0
        })
        .await;
        // 20 ticks of 100 ms within the cool-offs (spot 15 min, on-demand
        // 1 min): nothing more is asked
        tokio::time::sleep(Duration::from_secs(2)).await;
        let all = l.leases(false, 1000).await.unwrap();
        cancel.cancel();
        tracker.close();
        tracker.wait().await;
        assert_eq!(failed(&all, Tier::Spot), 5, "{all:?}");
        assert!(
            (1..=5).contains(&failed(&all, Tier::OnDemand)),
            "one round of on-demand refusals at most: {all:?}"
        );
        assert_eq!(failed(&all, Tier::Reserved), 0, "{all:?}");
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
            metrics.clone(),
            cancel.clone(),
            &tracker,
        )
        .unwrap();
        // 15 ticks: without the pause, 15 spawn attempts; with it, the
        // first, one after 1 s, none before 3 s.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        // (the last try's answer may still be on its way)
        let until = tokio::time::Instant::now() + Duration::from_secs(20);
        while (l.leases(false, 100).await.unwrap().iter()).any(|r| r.state == LeaseState::Requested)
        {
            assert!(tokio::time::Instant::now() < until, "a try never answered");
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        let all = l.leases(false, 100).await.unwrap();
        assert!((1..=2).contains(&all.len()), "{all:?}");
        assert!(
            all.iter()
                .all(|r| r.state == LeaseState::Ended(EndReason::Failed)),
            "{all:?}"
        );
        // each try is an acquire error and a failed end, by its tier
        let tiers: BTreeSet<&str> = all.iter().map(|r| r.tier.as_str()).collect();
        let count = |c: &prometheus::IntCounterVec, result: &str| -> u64 {
            tiers
                .iter()
                .map(|t| c.with_label_values(&[*t, result]).get())
                .sum()
        };
        assert_eq!(count(&metrics.lease_acquires, "error"), all.len() as u64);
        assert_eq!(count(&metrics.lease_acquires, "ok"), 0);
        assert_eq!(count(&metrics.lease_ends, "failed"), all.len() as u64);
        let text = metrics.render();
        assert!(
            text.contains("tidegate_lease_acquires_total{result=\"error\""),
            "{text}"
        );
        cancel.cancel();
        tracker.close();
        tracker.wait().await;
    }
}
