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
//!   so it is never forgotten. `StopDispatch { at }` → the hub stops
//!   dispatching then (a timer of its own; at once when `at` has come);
//! * provider events: a spot notice goes to the autoscaler, which acquires
//!   a replacement at once and has the worker serve on until
//!   `notice_drain_ms` before the deadline; `Ended` ends the lease;
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
//! retry times) are the pure [`tidegate_lease::pacing`], and the shell's
//! bookkeeping (absent workers and their rejoin timeout, stalls, the
//! acquisitions and releases under way, the ledger writes to retry) is
//! the pure `book::LeaseBook`; the shell reads the clocks, sleeps, and
//! does the IO. `shell.rs` is its loop; `startup.rs`, `auth.rs`,
//! `actions.rs`, `acquire.rs`, `release.rs`, `writes.rs` and `metrics.rs`
//! the rest.
//!
//! [`Autoscaler`]: tidegate_lease::autoscale::Autoscaler
//! [`Observation`]: tidegate_lease::autoscale::Observation
//! [`Action`]: tidegate_lease::autoscale::Action

use std::path::PathBuf;
use std::time::Duration;

use tidegate_lease::ledger::{CostReport, LeaseRecord, Ledger, LedgerError};
use tidegate_lease::provider::kubernetes::KubernetesProvider;
use tidegate_lease::provider::process::{ProcessConfig, ProcessProvider};
use tidegate_lease::provider::slurm::SlurmProvider;
use tidegate_lease::provider::static_workers::{StaticConfig, StaticProvider};
use tidegate_lease::provider::{Provider, ProviderError};
use tidegate_lease::table::TableError;
use tidegate_lease::{LeaseId, Millis};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::warn;

use crate::config::{LeasingConfig, ProviderKind};
use crate::hub::Hub;
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
/// `LeaseBook::unserving`).
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
    /// The lease shell's thread or runtime could not start, or its thread
    /// stopped while the provider connected and adopted (a panic: see the
    /// log).
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

/// What the shell needs of its provider beyond [`Provider`]: the static
/// provider's listed workers, which connect by themselves, and a stop that
/// leaves the workers running (`on_stop = "keep"`). The shell is generic
/// over it; [`spawn`] is the one place that picks the provider.
trait LeaseSource: Provider + Send + 'static {
    /// The static provider, whose listed workers the shell authenticates
    /// and binds; `None` for every other.
    fn listed(&self) -> Option<&StaticProvider> {
        None
    }

    /// [`LeaseSource::listed`], to report its workers' links.
    fn listed_mut(&mut self) -> Option<&mut StaticProvider> {
        None
    }

    /// Stops watching every worker WITHOUT ending it, as a crash of the
    /// gateway would: the next start adopts them.
    fn detach(self) -> impl std::future::Future<Output = ()> + Send;
}

impl LeaseSource for ProcessProvider {
    fn detach(self) -> impl std::future::Future<Output = ()> + Send {
        self.detach_all()
    }
}

impl LeaseSource for SlurmProvider {
    fn detach(self) -> impl std::future::Future<Output = ()> + Send {
        self.detach_all()
    }
}

impl LeaseSource for KubernetesProvider {
    fn detach(self) -> impl std::future::Future<Output = ()> + Send {
        self.detach_all()
    }
}

impl LeaseSource for StaticProvider {
    fn listed(&self) -> Option<&StaticProvider> {
        Some(self)
    }

    fn listed_mut(&mut self) -> Option<&mut StaticProvider> {
        Some(self)
    }

    /// Nothing runs on its behalf: its workers are not its own.
    fn detach(self) -> impl std::future::Future<Output = ()> + Send {
        std::future::ready(())
    }
}

/// A provider release's lease and how it ended.
type ReleaseOutcome = (LeaseId, Result<(), ProviderError>);

/// Capacity of the shell's inbox.
const INBOX: usize = 256;

/// Opens the ledger, makes the configured provider, and starts the lease
/// shell on a thread and runtime of its own, where the provider connects
/// (Slurm's partition checks, the Kubernetes API) and adopts or ends the
/// ledger's live leases; returns once that is done, with its error if it
/// failed. The shell runs until `cancel` fires, then releases every lease
/// it holds. `quic` is the gateway's bound QUIC address: process workers
/// run on this host and get it as `TIDEGATE_GATEWAY_ADDR` (unless the
/// configured `env` sets it). Must be called inside the tokio runtime.
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
    match cfg.provider {
        ProviderKind::Process => {
            let p = cfg
                .process
                .as_ref()
                .ok_or_else(|| LeasingError::Provider("[leasing.process] is missing".into()))?;
            let provider = ProcessProvider::new(ProcessConfig {
                command: p.command.clone(),
                args: p.args.clone(),
                env: with_dial(&p.env).into_iter().collect(),
                notice_period_secs: p.notice_period_secs,
                preempt_spot_after_secs: p.preempt_spot_after_secs,
            });
            let connect = std::future::ready(Ok(provider));
            startup::start(cfg, ledger, connect, hub, metrics, cancel, tracker)
        }
        ProviderKind::Static => {
            let provider = StaticProvider::new(StaticConfig {
                workers: cfg.static_workers.clone(),
            })
            .map_err(|e| LeasingError::Provider(e.to_string()))?;
            let connect = std::future::ready(Ok(provider));
            startup::start(cfg, ledger, connect, hub, metrics, cancel, tracker)
        }
        ProviderKind::Slurm => {
            let mut s = cfg
                .slurm
                .clone()
                .ok_or_else(|| LeasingError::Provider("[leasing.slurm] is missing".into()))?;
            s.env = with_dial(&s.env);
            let connect = SlurmProvider::connect(s);
            startup::start(cfg, ledger, connect, hub, metrics, cancel, tracker)
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
            let connect = KubernetesProvider::connect(k);
            startup::start(cfg, ledger, connect, hub, metrics, cancel, tracker)
        }
    }
}

mod acquire;
mod actions;
mod auth;
#[cfg(test)]
mod backoff_tests;
mod book;
#[cfg(test)]
mod fake;
mod metrics;
mod release;
mod shell;
#[cfg(test)]
mod shell_tests;
mod startup;
#[cfg(test)]
mod tests;
mod writes;
