//! Providers: where leases come from.
//!
//! A provider turns an acquire into a running worker and reports what
//! happens to it afterwards. It does not own the ledger or the lease table:
//! the gateway's async shell records the lease (`Ledger::insert_requested`),
//! issues its one-time token, calls [`Provider::acquire`], then records the
//! result (`Ledger::mark_starting`) and feeds [`ProviderEvent`]s to the
//! autoscaler and the ledger. Keeping the provider free of bookkeeping means
//! every provider gets the same accounting. The one exception is
//! [`Provider::adopt`], at start: it reads the ledger's live leases of its
//! provider and ends those whose worker is gone.
//!
//! Every operation is async and runs on the caller's runtime, adoption and
//! start-up checks included: the tasks a provider spawns (watchers,
//! pollers, supervisors) live there too.
//!
//! * [`process::ProcessProvider`] (embedded default) spawns
//!   `tidegate-worker` processes on this host and can simulate spot
//!   preemption.
//! * [`static_workers::StaticProvider`] hands out workers listed in config,
//!   which dial in by themselves.
//! * [`slurm::SlurmProvider`] submits each lease as a Slurm batch job with
//!   `--gres=gpu`; Slurm's preemption of the spot partition is the spot
//!   notice.
//! * [`kubernetes::KubernetesProvider`] creates each lease as a Pod that
//!   requests its GPUs; Kubernetes taking the Pod away (spot node
//!   reclaimed, preemption, eviction) is the spot notice.
//!
//! Slurm and Kubernetes share one remote-job provider, [`remote`]'s
//! [`remote::RemoteProvider`]: the held leases' jobs, the orders to their
//! watch task, the release bracket, detaching, the jobs an acquire gave up
//! submitting, and acquire, release, adopt and shutdown themselves; each
//! system supplies only its submit, cancel, survey, watch and parse.

pub mod kubernetes;
pub mod process;
pub mod remote;
pub mod slurm;
pub mod static_workers;

use std::future::Future;
use std::time::Duration;

use tokio::sync::mpsc;

use crate::billing::Millis;
use crate::catalog::{InstanceType, Tier};
use crate::ledger::Ledger;
use crate::lifecycle::EndReason;
use crate::table::{LeaseId, LeaseToken, TokenDigest};

/// What a provider's `adopt` did with the ledger's live leases after a
/// gateway restart.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Adoption {
    /// Leases whose worker (process or job) still runs and is watched again.
    pub adopted: Vec<LeaseId>,
    /// Leases ended in the ledger (worker gone, pid reused, job gone, or
    /// never started).
    pub ended: Vec<(LeaseId, EndReason)>,
}

/// What to start.
#[derive(Debug, Clone)]
pub struct LeaseSpec {
    /// The lease (already in the ledger).
    pub lease: LeaseId,
    /// Its one-time token, handed to the worker.
    pub token: LeaseToken,
    /// The catalog type it stands for.
    pub instance: InstanceType,
    /// The tier.
    pub tier: Tier,
    /// Simulated spot preemption: send the notice this long after start
    /// (process provider, spot tier only).
    pub preempt_after: Option<Duration>,
}

/// What the provider started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acquired {
    /// The lease.
    pub lease: LeaseId,
    /// The worker's process id, when the provider runs processes.
    pub pid: Option<u32>,
    /// Provider data to store in the ledger for adoption (JSON).
    pub provider_data: Option<String>,
    /// The digest of the token the worker will present, when the provider
    /// supplies its own credentials (static workers); `None` means the
    /// spec's token.
    pub token: Option<TokenDigest>,
}

/// Something that happened to a lease, reported by its provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProviderEvent {
    /// The provider knows the worker is up (static workers dialling in).
    /// For process workers, readiness comes from registration instead.
    Ready {
        /// The lease.
        lease: LeaseId,
    },
    /// The lease will be reclaimed at `deadline`: stop dispatching to it and
    /// acquire a replacement now.
    PreemptionNotice {
        /// The lease.
        lease: LeaseId,
        /// When it will be killed (ms since epoch).
        deadline: Millis,
    },
    /// The lease is gone, not by our release: preempted, or lost (the
    /// worker died, or vanished while we were down).
    Ended {
        /// The lease.
        lease: LeaseId,
        /// `Preempted` or `Lost` (or `Failed` if it died while starting).
        reason: EndReason,
        /// For logs: exit status, signal, etc.
        detail: String,
    },
}

/// Why a provider operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProviderError {
    /// The worker process could not be started.
    #[error(
        "cannot spawn worker {command:?} for {lease}: {source}; check the provider's `command`"
    )]
    Spawn {
        /// The lease.
        lease: LeaseId,
        /// The command.
        command: String,
        /// The cause.
        source: std::io::Error,
    },
    /// No capacity of that kind (static pool exhausted; spot refused).
    #[error("no {tier} capacity of type {instance_type:?} available: {detail}")]
    NoCapacity {
        /// Type asked for.
        instance_type: String,
        /// Tier asked for.
        tier: Tier,
        /// Why.
        detail: String,
    },
    /// The lease is not held by this provider.
    #[error("{0} is not held by this provider")]
    UnknownLease(LeaseId),
    /// The same lease was acquired twice.
    #[error("{0} is already held by this provider")]
    Duplicate(LeaseId),
    /// Killing or inspecting a process failed.
    #[error("{lease}: {what}: {source}")]
    Process {
        /// The lease.
        lease: LeaseId,
        /// What we were doing.
        what: &'static str,
        /// The cause.
        source: std::io::Error,
    },
    /// A Slurm tool failed, or printed what the provider cannot read.
    #[error("slurm: {what}: {detail}")]
    Slurm {
        /// The lease, when the call was for one.
        lease: Option<LeaseId>,
        /// The command (or check) that failed.
        what: String,
        /// Its exit status and stderr, or the cause.
        detail: String,
    },
    /// A Kubernetes API call failed, or the provider cannot reach the
    /// cluster.
    #[error("kubernetes: {what}: {detail}")]
    Kubernetes {
        /// The lease, when the call was for one.
        lease: Option<LeaseId>,
        /// What the provider was doing.
        what: String,
        /// The API server's status (code, reason, message), or the cause.
        detail: String,
    },
    /// The ledger failed during adoption.
    #[error("adoption: {0}")]
    Ledger(#[from] crate::ledger::LedgerError),
}

/// A source of leases.
pub trait Provider {
    /// Name stored in the ledger (`process`, `static`, `slurm`,
    /// `kubernetes`).
    fn name(&self) -> &'static str;

    /// Starts a worker for `spec`. As with [`Provider::release`], what
    /// needs the provider is done in the call, and the future it returns
    /// owns the rest (`'static`: an API call, an `sbatch`), so a caller can
    /// go on with other work while the provider answers; the lease is held
    /// once the future has succeeded. Each provider bounds its calls (its
    /// `api_timeout_secs`, `tool_timeout_secs`).
    fn acquire(
        &mut self,
        spec: LeaseSpec,
    ) -> impl Future<Output = Result<Acquired, ProviderError>> + Send + 'static;

    /// Stops the lease's worker; the future it returns waits until the
    /// worker is gone. What needs the provider is done in the call; the
    /// future owns the rest (`'static`), so a caller can wait for several
    /// releases (a Pod's grace period, a job's drain) while it goes on
    /// with other work, acquisitions included. On an error the lease is
    /// still held, since its worker may still run and bill: the caller
    /// retries, once this future has ended.
    fn release(
        &mut self,
        lease: LeaseId,
    ) -> impl Future<Output = Result<(), ProviderError>> + Send + 'static;

    /// After a gateway restart, before the first acquire: takes up again
    /// the ledger's live leases of this provider whose worker still runs
    /// (watched again, their events reported as any other's) and ends in
    /// the ledger those whose worker is gone, so that none leaks. Leases of
    /// other providers are left alone; the caller ends whatever no
    /// provider adopted. A cluster that cannot answer fails it: ending
    /// leases whose workers may well run would leak them. Each provider
    /// bounds its calls, as for [`Provider::acquire`].
    fn adopt(
        &mut self,
        ledger: &mut Ledger,
        now: Millis,
    ) -> impl Future<Output = Result<Adoption, ProviderError>> + Send;

    /// Starts releasing `leases` together where the provider can (one
    /// `scancel` of their jobs, their Pods' deletes at once): their workers
    /// drain at the same time, and [`Provider::release`] then waits for
    /// each, so that releasing many waits about one drain, not one per
    /// lease. A failure is logged: `release` tries again. By default it
    /// does nothing (a provider whose release is quick).
    fn begin_release(&mut self, leases: &[LeaseId]) -> impl Future<Output = ()> + Send {
        let _ = leases;
        std::future::ready(())
    }

    /// The event stream; `None` after the first call. It is bounded
    /// ([`EVENT_CHANNEL_CAPACITY`]): the shell must keep draining it, or
    /// supervisors wait (back-pressure) before reporting more.
    fn take_events(&mut self) -> Option<mpsc::Receiver<ProviderEvent>>;
}

/// Capacity of every provider's event channel.
pub const EVENT_CHANNEL_CAPACITY: usize = 256;

/// Longest spot notice period a provider accepts (s): a day, far above any
/// cloud's (30 s to 2 min) and any sane Slurm `GraceTime`.
pub const MAX_NOTICE_PERIOD_SECS: f64 = 86_400.0;

/// `secs` as a [`Duration`] when it is a finite number within
/// `0..=max_secs`; why not, naming `field`, otherwise. Checks a config
/// value before [`Duration::from_secs_f64`] could panic on it.
pub fn checked_secs(field: &str, secs: f64, max_secs: f64) -> Result<Duration, String> {
    if !(secs.is_finite() && (0.0..=max_secs).contains(&secs)) {
        return Err(format!("{field} = {secs} must be between 0 and {max_secs}"));
    }
    Duration::try_from_secs_f64(secs).map_err(|e| format!("{field} = {secs}: {e}"))
}

/// Wall clock in [`Millis`]; only the async shells call it.
pub fn wall_clock_ms() -> Millis {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as Millis)
        .unwrap_or(0)
}
