//! The remote-job provider itself, once for Slurm and Kubernetes:
//! [`RemoteProvider`] holds a system's jobs ([`RemoteJobs`]) and its watch
//! task, and implements [`Provider`] (acquire, release, adopt, begin
//! release, events, shutdown, detach) over what a [`RemoteSystem`]
//! supplies: submit, cancel, and the survey adoption reads. The watch
//! task (the system's own) receives the [`Cmd`]s this sends through
//! [`RemoteJobs`].

use std::future::Future;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::{
    Cmd, JobBackend, RemoteJobs, Unreleased, end_gone, gone_reason, recorded, release_all,
};
use crate::billing::Millis;
use crate::ledger::{LeaseRecord, Ledger};
use crate::provider::{
    Acquired, Adoption, EVENT_CHANNEL_CAPACITY, LeaseSpec, Provider, ProviderError, ProviderEvent,
};
use crate::table::LeaseId;

/// What one remote-job system (a batch scheduler, a cluster API) supplies
/// to [`RemoteProvider`]. Its IO is its own: it submits, cancels and
/// surveys jobs, and its watch task (started by its `connect`) reports
/// their news.
pub trait RemoteSystem: JobBackend + Send + Sync + Sized {
    /// The provider's name in the ledger.
    const NAME: &'static str;
    /// What the ledger keeps of a lease's job, to adopt it after a
    /// restart.
    type Record: Serialize + DeserializeOwned + Send + 'static;

    /// Builds `spec`'s job in the call (an error there fails the acquire
    /// at once); the future submits it, within the system's deadline, and
    /// answers what the watch task is to be handed and what the ledger
    /// keeps. One that gives up on a submit that did not answer tells
    /// `jobs` ([`RemoteJobs::abandon`]), since the job may appear later.
    fn submit(
        &self,
        spec: LeaseSpec,
        jobs: &RemoteJobs<Self>,
    ) -> impl Future<Output = Result<(Self::Watch, Self::Record), ProviderError>> + Send + 'static;

    /// Cancels `lease`'s job and waits until the system says it ended,
    /// within the system's release deadline.
    fn cancel(
        &self,
        lease: LeaseId,
        job: Self::Job,
    ) -> impl Future<Output = Result<(), Unreleased>> + Send + 'static;

    /// Starts cancelling `jobs` together (each worker gets its signal and
    /// drains) without waiting for their ends; a failure is logged, since
    /// each lease's [`RemoteSystem::cancel`] tries again.
    fn begin_cancel(&self, jobs: Vec<(LeaseId, Self::Job)>) -> impl Future<Output = ()> + Send;

    /// Adoption: what the system says now of each of the ledger's live
    /// leases of this provider (`recorded`, with what the ledger kept of
    /// its job, `None` where nothing readable was), one [`Found`] each, in
    /// order. It cleans up what belongs to no lease it finds live (a job
    /// submitted before its id was recorded, a Pod of the pool no lease
    /// owns). A system that cannot answer fails it: ending leases whose
    /// jobs may well run would leak them.
    fn survey(
        &self,
        recorded: &[(LeaseRecord, Option<Self::Record>)],
        now: Millis,
    ) -> impl Future<Output = Result<Vec<Found<Self::Watch>>, ProviderError>> + Send;
}

/// What a [`RemoteSystem::survey`] found of one recorded lease's job.
#[derive(Debug)]
pub enum Found<W> {
    /// It still runs (or waits to): watch it again.
    Live(W),
    /// It is gone or finished: the lease ends at `at` (when the job ended,
    /// where the system still says; else now), preempted when the system
    /// was `taking` it.
    Gone {
        /// When the lease ends.
        at: Millis,
        /// The system was taking the job (a preemption, a disruption).
        taking: bool,
    },
}

/// A remote-job provider: a [`RemoteSystem`], the jobs it holds, and its
/// watch task (stopped when the provider is dropped; the jobs are not:
/// they outlive the gateway as a cloud instance would, and the ledger
/// adopts them).
pub struct RemoteProvider<S: RemoteSystem> {
    system: S,
    jobs: RemoteJobs<S>,
    watcher: JoinHandle<()>,
    events_rx: Option<mpsc::Receiver<ProviderEvent>>,
}

impl<S: RemoteSystem> std::fmt::Debug for RemoteProvider<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteProvider")
            .field("system", &S::NAME)
            .field("held", &self.held())
            .finish_non_exhaustive()
    }
}

impl<S: RemoteSystem> RemoteProvider<S> {
    /// A provider over `system`, whose watch task `watch` starts on the
    /// current runtime with the orders' receiver, the events' sender and
    /// the held jobs.
    pub fn start<F>(
        system: S,
        watch: impl FnOnce(
            mpsc::UnboundedReceiver<Cmd<S>>,
            mpsc::Sender<ProviderEvent>,
            RemoteJobs<S>,
        ) -> F,
    ) -> RemoteProvider<S>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let (events_tx, events_rx) = mpsc::channel(EVENT_CHANNEL_CAPACITY);
        let (jobs, rx) = RemoteJobs::new();
        let watcher = tokio::spawn(watch(rx, events_tx, jobs.clone()));
        RemoteProvider {
            system,
            jobs,
            watcher,
            events_rx: Some(events_rx),
        }
    }

    /// The system.
    pub fn system(&self) -> &S {
        &self.system
    }

    /// The job of a held lease.
    pub fn job(&self, lease: LeaseId) -> Option<S::Job> {
        self.jobs.job(lease)
    }

    /// Leases held: those whose job the system has not reported ended.
    pub fn held(&self) -> Vec<LeaseId> {
        self.jobs.held()
    }

    /// Stops watching every job WITHOUT cancelling it, as a crash of the
    /// gateway would. The next provider over the same ledger adopts them.
    pub async fn detach_all(self) {
        self.jobs.detach_all().await;
    }

    /// Releases every lease (cancels its job and waits for its end). A job
    /// that cannot be cancelled is logged: it outlives the provider, and
    /// the next one over the same ledger adopts it.
    pub async fn shutdown(mut self) {
        let held = self.held();
        for (lease, e) in release_all(&mut self, held).await {
            let job = self.job(lease);
            tracing::warn!(%lease, ?job, provider = S::NAME, error = %e, "release at shutdown failed; the job may still run and bill");
        }
    }
}

impl<S: RemoteSystem> Drop for RemoteProvider<S> {
    fn drop(&mut self) {
        self.watcher.abort();
    }
}

impl<S: RemoteSystem> Provider for RemoteProvider<S> {
    fn name(&self) -> &'static str {
        S::NAME
    }

    /// Builds the job in the call; the future submits it and watches it.
    fn acquire(
        &mut self,
        spec: LeaseSpec,
    ) -> impl Future<Output = Result<Acquired, ProviderError>> + Send + 'static {
        let lease = spec.lease;
        let submit = self
            .jobs
            .check_new(lease)
            .map(|()| self.system.submit(spec, &self.jobs));
        let jobs = self.jobs.clone();
        async move {
            let (watch, record) = submit?.await?;
            jobs.watch(watch)?;
            Ok(Acquired {
                lease,
                pid: None,
                provider_data: Some(serde_json::to_string(&record).unwrap_or_default()),
                token: None,
            })
        }
    }

    /// Cancels the lease's job and waits until the system reports it
    /// ended; only then is it forgotten. On an error the job is still held
    /// and watched: it may still run (and bill), so the caller must retry.
    fn release(
        &mut self,
        lease: LeaseId,
    ) -> impl Future<Output = Result<(), ProviderError>> + Send + 'static {
        let system = &self.system;
        self.jobs
            .release(lease, move |job| system.cancel(lease, job))
    }

    /// Re-adopts the live leases of this provider recorded in `ledger`,
    /// ending the ones whose job is gone (see [`RemoteSystem::survey`]).
    async fn adopt(&mut self, ledger: &mut Ledger, now: Millis) -> Result<Adoption, ProviderError> {
        let recs = recorded::<S::Record>(ledger, S::NAME)?;
        let found = self.system.survey(&recs, now).await?;
        let mut out = Adoption::default();
        for ((r, _), found) in recs.iter().zip(found) {
            match found {
                Found::Live(watch) => {
                    self.jobs.watch(watch)?;
                    out.adopted.push(r.id);
                }
                Found::Gone { at, taking } => {
                    end_gone(ledger, &mut out, r.id, at, gone_reason(r.state, taking))?;
                }
            }
        }
        Ok(out)
    }

    /// Starts releasing `leases` all at once ([`RemoteSystem::begin_cancel`])
    /// without waiting for their ends. [`Provider::release`] then cancels
    /// again (harmless) and waits, so a gateway stopping with many leases
    /// waits about one drain, not one per lease.
    async fn begin_release(&mut self, leases: &[LeaseId]) {
        let jobs = self.jobs.begin_release(leases);
        if !jobs.is_empty() {
            self.system.begin_cancel(jobs).await;
        }
    }

    fn take_events(&mut self) -> Option<mpsc::Receiver<ProviderEvent>> {
        self.events_rx.take()
    }
}
