//! The skeleton the remote-job providers (Slurm, Kubernetes) share: the
//! held-leases map, the orders the provider sends its watch task
//! ([`Cmd`]), the watch task's table of watched jobs that applies them
//! ([`Watched`]: which are being released, so their end is no news), the
//! release bracket (releasing, then forgotten on success or news again on
//! failure), detaching, and the bounded list of jobs an acquire gave up
//! submitting ([`Abandoned`]) that the watch task cancels as strays when
//! they appear; and adoption's common part ([`recorded`]: the ledger's
//! leases of a provider with their job records; [`gone_reason`] and
//! [`end_gone`] for a lease whose job did not survive the restart).
//!
//! [`RemoteProvider`] (`provider.rs`) is the provider itself, once: it
//! implements [`Provider`] (acquire, release, adopt, begin release,
//! events) and shutdown and detach over a [`RemoteSystem`], which supplies
//! only its IO: submit, cancel (one, or many at once), adoption's survey,
//! and its watch or poll loop, which parses what the system says. Through
//! [`JobBackend`] it says what its jobs are known by, what its watch task
//! is handed and keeps, and what it keeps of a stray. This module runs no
//! tool and calls no cluster API: the next hop is the system's (`slurm/`,
//! `kubernetes/`), and its watch task (`slurm/poll.rs`,
//! `kubernetes/pool_watch.rs`) receives the [`Cmd`]s and folds them into
//! its [`Watched`].

mod provider;

pub use self::provider::{Found, RemoteProvider, RemoteSystem};

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use serde::de::DeserializeOwned;

use super::{Adoption, Provider, ProviderError};
use crate::billing::Millis;
use crate::ledger::{LeaseRecord, Ledger};
use crate::lifecycle::{EndReason, LeaseState};
use crate::table::LeaseId;

/// How long a watch task looks for a job that an acquire gave up
/// submitting (its request waiting in a busy controller's or API server's
/// queue), and cancels it when it appears.
pub const ABANDONED_WATCH: Duration = Duration::from_secs(900);

/// The per-system parts of a remote-job provider that its skeleton needs.
pub trait JobBackend: 'static {
    /// What a held lease's job is known by (a Slurm job id; a Pod's name
    /// and uid).
    type Job: Clone + Send + std::fmt::Debug + 'static;
    /// What the watch task is handed when it starts watching a job (just
    /// submitted, or adopted).
    type Watch: Send + 'static;
    /// What the watch task keeps of a watched job between observations
    /// (the [`JobBackend::Watch`] itself, or part of it).
    type Watching: Send + 'static;
    /// What is kept of a job an acquire gave up submitting, beside its
    /// name, to clean it up (a Pod's token Secret; nothing for Slurm).
    type Stray: Send + 'static;
    /// Most abandoned job names the watch task keeps at once (the oldest
    /// go first).
    const ABANDONED_KEPT: usize;

    /// The lease a watch is for, and its job.
    fn watched(w: &Self::Watch) -> (LeaseId, Self::Job);

    /// The error of an acquire or adoption whose watch task has stopped.
    fn stopped(lease: LeaseId) -> ProviderError;
}

/// An order from the provider to its watch task.
pub enum Cmd<B: JobBackend> {
    /// Watch this job (just submitted, or adopted).
    Watch(B::Watch),
    /// We are cancelling it (`true`): its end is ours, not news (the
    /// release waits for it and forgets it); or the release failed
    /// (`false`): the job may run on, and its end is news again.
    Releasing(LeaseId, bool),
    /// Stop watching (release, detach); the reply comes once no event for
    /// it can follow.
    Forget(LeaseId, oneshot::Sender<()>),
    /// An acquire gave up submitting the job of this name: one that
    /// appears within [`ABANDONED_WATCH`] is no lease's, and is cancelled.
    Abandoned {
        /// The job's name (`<job_name>-<lease>`, `<name_prefix>-<lease>`).
        name: String,
        /// What else to clean up with it.
        stray: B::Stray,
    },
}

impl<B: JobBackend> std::fmt::Debug for Cmd<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cmd::Watch(_) => f.write_str("Watch"),
            Cmd::Releasing(lease, on) => write!(f, "Releasing({lease}, {on})"),
            Cmd::Forget(lease, _) => write!(f, "Forget({lease})"),
            Cmd::Abandoned { name, .. } => write!(f, "Abandoned({name})"),
        }
    }
}

/// Why a release's own work (cancel, wait for the end) failed.
#[derive(Debug)]
pub struct Unreleased {
    /// What went wrong.
    pub error: ProviderError,
    /// The cancel went through and the job is on its way out (its end is
    /// still no news); `false`: it may run on, and its end is news again.
    pub on_its_way_out: bool,
}

impl From<ProviderError> for Unreleased {
    fn from(error: ProviderError) -> Unreleased {
        Unreleased {
            error,
            on_its_way_out: false,
        }
    }
}

/// The held leases' jobs and the way to the watch task. Shared (cheap to
/// clone) between the provider, its acquires and releases in flight, and
/// the watch task, which drops a job once it has ended (before it sends
/// the end), so the map holds live jobs only. Its lock is never held
/// across an `.await`.
pub struct RemoteJobs<B: JobBackend> {
    held: Arc<Mutex<HashMap<LeaseId, B::Job>>>,
    cmds: mpsc::UnboundedSender<Cmd<B>>,
}

impl<B: JobBackend> Clone for RemoteJobs<B> {
    fn clone(&self) -> Self {
        RemoteJobs {
            held: self.held.clone(),
            cmds: self.cmds.clone(),
        }
    }
}

impl<B: JobBackend> std::fmt::Debug for RemoteJobs<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteJobs")
            .field("held", &self.held())
            .finish_non_exhaustive()
    }
}

impl<B: JobBackend> RemoteJobs<B> {
    /// No job held; the receiver is the watch task's.
    pub fn new() -> (RemoteJobs<B>, mpsc::UnboundedReceiver<Cmd<B>>) {
        let (cmds, rx) = mpsc::unbounded_channel();
        let jobs = RemoteJobs {
            held: Arc::default(),
            cmds,
        };
        (jobs, rx)
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<LeaseId, B::Job>> {
        // a panic while holding it cannot leave the map half-updated
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The job of a held lease.
    pub fn job(&self, lease: LeaseId) -> Option<B::Job> {
        self.lock().get(&lease).cloned()
    }

    /// Leases held, in order.
    pub fn held(&self) -> Vec<LeaseId> {
        let mut v: Vec<LeaseId> = self.lock().keys().copied().collect();
        v.sort();
        v
    }

    /// The held jobs.
    pub fn jobs(&self) -> Vec<B::Job> {
        self.lock().values().cloned().collect()
    }

    /// `Duplicate` when `lease` is held already.
    pub fn check_new(&self, lease: LeaseId) -> Result<(), ProviderError> {
        if self.lock().contains_key(&lease) {
            return Err(ProviderError::Duplicate(lease));
        }
        Ok(())
    }

    /// Has the watch task watch `w`'s job, which is held from now on.
    pub fn watch(&self, w: B::Watch) -> Result<(), ProviderError> {
        let (lease, job) = B::watched(&w);
        self.cmds
            .send(Cmd::Watch(w))
            .map_err(|_| B::stopped(lease))?;
        self.lock().insert(lease, job);
        Ok(())
    }

    /// Tells the watch task that `lease`'s job is being cancelled by us
    /// (`true`), or that its release failed (`false`).
    pub fn releasing(&self, lease: LeaseId, releasing: bool) {
        let _ = self.cmds.send(Cmd::Releasing(lease, releasing));
    }

    /// Tells the watch task that an acquire gave up submitting the job
    /// `name`: it cancels it if it appears.
    pub fn abandon(&self, name: String, stray: B::Stray) {
        let _ = self.cmds.send(Cmd::Abandoned { name, stray });
    }

    /// Drops `lease` from the held jobs (the watch task, for a job that
    /// ended, before it sends the end).
    pub fn ended(&self, lease: LeaseId) {
        self.lock().remove(&lease);
    }

    /// Has the watch task stop watching `lease`, then no longer holds it;
    /// returns once no event for it can follow.
    pub async fn forget(&self, lease: LeaseId) {
        let (tx, rx) = oneshot::channel();
        if self.cmds.send(Cmd::Forget(lease, tx)).is_ok() {
            let _ = rx.await;
        }
        self.lock().remove(&lease);
    }

    /// Stops watching every job WITHOUT cancelling it, as a crash of the
    /// gateway would; the next provider over the same ledger adopts them.
    pub async fn detach_all(&self) {
        for lease in self.held() {
            self.forget(lease).await;
        }
        self.lock().clear();
    }

    /// The start of releasing `leases` together: each held one is marked
    /// releasing (its end is no news) and returned with its job, for the
    /// provider to cancel at once; leases not held are left out.
    pub fn begin_release(&self, leases: &[LeaseId]) -> Vec<(LeaseId, B::Job)> {
        let jobs: Vec<(LeaseId, B::Job)> = {
            let held = self.lock();
            leases
                .iter()
                .filter_map(|l| held.get(l).map(|j| (*l, j.clone())))
                .collect()
        };
        for (lease, _) in &jobs {
            self.releasing(*lease, true);
        }
        jobs
    }

    /// The release bracket around `work` (cancel the job and wait for its
    /// end). In the call: `UnknownLease` unless `lease` is held; else it is
    /// marked releasing and `work` gets its job. Once `work` succeeds the
    /// lease is forgotten; when it fails, the lease stays held, and its end
    /// is news again unless the job is on its way out.
    pub fn release<F>(
        &self,
        lease: LeaseId,
        work: impl FnOnce(B::Job) -> F,
    ) -> impl Future<Output = Result<(), ProviderError>> + Send + 'static
    where
        F: Future<Output = Result<(), Unreleased>> + Send + 'static,
    {
        let job = self.job(lease);
        if job.is_some() {
            self.releasing(lease, true);
        }
        let work = job.map(work);
        let jobs = self.clone();
        async move {
            let work = work.ok_or(ProviderError::UnknownLease(lease))?;
            match work.await {
                Ok(()) => {
                    jobs.forget(lease).await;
                    Ok(())
                }
                Err(u) => {
                    if !u.on_its_way_out {
                        jobs.releasing(lease, false);
                    }
                    Err(u.error)
                }
            }
        }
    }
}

/// Releases `leases` at a provider's shutdown: [`Provider::begin_release`]
/// for all, then [`Provider::release`] of each in turn. Returns those that
/// failed: their jobs outlive the provider (and may bill), and the next
/// one over the same ledger adopts them.
pub async fn release_all<P: Provider>(
    provider: &mut P,
    leases: Vec<LeaseId>,
) -> Vec<(LeaseId, ProviderError)> {
    provider.begin_release(&leases).await;
    let mut failed = Vec::new();
    for lease in leases {
        if let Err(e) = provider.release(lease).await {
            failed.push((lease, e));
        }
    }
    failed
}

/// The ledger's live leases of `provider`, each with what it recorded of
/// its job (`provider_data`) read as `D`: `None` where nothing readable
/// was recorded (the gateway stopped between submitting the job and
/// recording it). Adoption starts here.
pub fn recorded<D: DeserializeOwned>(
    ledger: &Ledger,
    provider: &str,
) -> Result<Vec<(LeaseRecord, Option<D>)>, ProviderError> {
    Ok(ledger
        .live_leases()?
        .into_iter()
        .filter(|r| r.provider == provider)
        .map(|r| {
            let data = r
                .provider_data
                .as_deref()
                .and_then(|d| serde_json::from_str::<D>(d).ok());
            (r, data)
        })
        .collect())
}

/// Why a lease whose job did not survive a gateway restart ended:
/// `failed` while it was still requested (its job never started for it),
/// else `preempted` when the system was taking it (`taken`), else `lost`.
pub fn gone_reason(state: LeaseState, taken: bool) -> EndReason {
    match state {
        LeaseState::Requested => EndReason::Failed,
        _ if taken => EndReason::Preempted,
        _ => EndReason::Lost,
    }
}

/// Ends `lease`, whose job did not survive a restart, in the ledger at
/// `at` for `reason`, and counts it in `out`.
pub fn end_gone(
    ledger: &mut Ledger,
    out: &mut Adoption,
    lease: LeaseId,
    at: Millis,
    reason: EndReason,
) -> Result<(), ProviderError> {
    ledger.mark_ended(lease, at, reason)?;
    out.ended.push((lease, reason));
    Ok(())
}

/// What applying a [`Cmd`] to a [`Watched`] table did, for the watch task
/// to act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// The lease's job is watched from now on: it may mean news at once.
    Watched(LeaseId),
    /// The lease's job is being released by us: its end is no news.
    Releasing(LeaseId),
    /// The lease's release failed: its job's end is news again, and it
    /// may mean news at once.
    NewsAgain(LeaseId),
    /// The lease is watched no more (the order is answered).
    Forgotten(LeaseId),
    /// An acquire gave up submitting the job of this name: look for it
    /// now.
    Abandoned(String),
}

/// The watch task's table: the watched jobs (what it keeps of each, and
/// whether we are releasing it), and the jobs acquires gave up submitting.
/// The task applies every [`Cmd`] here, and asks [`Watched::news`] which
/// jobs' observations can be news. Pure: `now` is given.
pub struct Watched<B: JobBackend> {
    /// Each watched lease's job, and whether we are releasing it.
    jobs: HashMap<LeaseId, (B::Watching, bool)>,
    abandoned: Abandoned<B::Stray>,
}

impl<B: JobBackend> std::fmt::Debug for Watched<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watched")
            .field("leases", &self.leases())
            .finish_non_exhaustive()
    }
}

impl<B: JobBackend> Default for Watched<B> {
    fn default() -> Self {
        Watched {
            jobs: HashMap::new(),
            abandoned: Abandoned::new(B::ABANDONED_KEPT),
        }
    }
}

impl<B: JobBackend> Watched<B> {
    /// Nothing watched, nothing abandoned.
    pub fn new() -> Watched<B> {
        Watched::default()
    }

    /// Takes one order at `now`. `keep` turns a new watch into what the
    /// table keeps of it (the watch task folds in the rest). A new watch
    /// is not being released; a release mark or its end for a lease not
    /// watched changes nothing.
    pub fn apply(
        &mut self,
        cmd: Cmd<B>,
        now: Instant,
        keep: impl FnOnce(B::Watch) -> B::Watching,
    ) -> Applied {
        match cmd {
            Cmd::Watch(w) => {
                let (lease, _) = B::watched(&w);
                self.jobs.insert(lease, (keep(w), false));
                Applied::Watched(lease)
            }
            Cmd::Releasing(lease, on) => {
                if let Some((_, releasing)) = self.jobs.get_mut(&lease) {
                    *releasing = on;
                }
                if on {
                    Applied::Releasing(lease)
                } else {
                    Applied::NewsAgain(lease)
                }
            }
            Cmd::Forget(lease, done) => {
                self.jobs.remove(&lease);
                let _ = done.send(());
                Applied::Forgotten(lease)
            }
            Cmd::Abandoned { name, stray } => {
                self.abandoned.add(name.clone(), stray, now);
                Applied::Abandoned(name)
            }
        }
    }

    /// We are releasing `lease`'s job (its end is ours, not news).
    pub fn releasing(&self, lease: LeaseId) -> bool {
        self.jobs.get(&lease).is_some_and(|(_, r)| *r)
    }

    /// `lease`'s job, when what is observed of it can be news: it is
    /// watched, and not being released by us (the release waits for its
    /// end and forgets it).
    pub fn news(&mut self, lease: LeaseId) -> Option<&mut B::Watching> {
        if self.releasing(lease) {
            return None;
        }
        self.jobs.get_mut(&lease).map(|(w, _)| w)
    }

    /// Every job whose observation can be news (see [`Watched::news`]).
    pub fn all_news(&mut self) -> impl Iterator<Item = (LeaseId, &mut B::Watching)> {
        self.jobs
            .iter_mut()
            .filter(|(_, (_, releasing))| !*releasing)
            .map(|(lease, (w, _))| (*lease, w))
    }

    /// `lease`'s job ended (and the end was sent): watched no more.
    pub fn ended(&mut self, lease: LeaseId) {
        self.jobs.remove(&lease);
    }

    /// The watched leases, in order.
    pub fn leases(&self) -> Vec<LeaseId> {
        let mut v: Vec<LeaseId> = self.jobs.keys().copied().collect();
        v.sort();
        v
    }

    /// What is kept of every watched job, released or not.
    pub fn watching(&self) -> impl Iterator<Item = &B::Watching> {
        self.jobs.values().map(|(w, _)| w)
    }

    /// No job is watched.
    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// The jobs acquires gave up submitting, still looked for.
    pub fn abandoned(&mut self) -> &mut Abandoned<B::Stray> {
        &mut self.abandoned
    }
}

/// Jobs that acquires gave up submitting, by name, each looked for until
/// [`ABANDONED_WATCH`] after it was given up, at most `kept` at once (the
/// oldest go first). Pure: `now` is given.
#[derive(Debug)]
pub struct Abandoned<S> {
    /// Name, what to clean up with it, and until when to look for it;
    /// oldest first.
    entries: Vec<(String, S, Instant)>,
    kept: usize,
}

impl<S> Abandoned<S> {
    /// None yet; at most `kept` at once.
    pub fn new(kept: usize) -> Abandoned<S> {
        Abandoned {
            entries: Vec::new(),
            kept: kept.max(1),
        }
    }

    /// Looks for job `name` from `now` on (again, if it was looked for).
    pub fn add(&mut self, name: String, stray: S, now: Instant) {
        self.expire(now);
        self.entries.retain(|(n, _, _)| *n != name);
        if self.entries.len() >= self.kept {
            self.entries.remove(0);
        }
        self.entries.push((name, stray, now + ABANDONED_WATCH));
    }

    /// Stops looking for those given up longer than [`ABANDONED_WATCH`]
    /// before `now`.
    pub fn expire(&mut self, now: Instant) {
        self.entries.retain(|(_, _, until)| *until > now);
    }

    /// What to clean up with job `name`, when it is still looked for at
    /// `now`.
    pub fn get(&mut self, name: &str, now: Instant) -> Option<&S> {
        self.expire(now);
        self.entries
            .iter()
            .find(|(n, _, _)| n == name)
            .map(|(_, s, _)| s)
    }

    /// Stops looking for job `name` (cancelled, or gone).
    pub fn remove(&mut self, name: &str) {
        self.entries.retain(|(n, _, _)| n != name);
    }

    /// The names looked for, oldest first.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|(n, _, _)| n.as_str())
    }

    /// Nothing is looked for.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A backend whose jobs are numbers and whose watch is (lease, job).
    struct Numbered;

    impl JobBackend for Numbered {
        type Job = u32;
        type Watch = (LeaseId, u32);
        type Watching = u32;
        type Stray = &'static str;
        const ABANDONED_KEPT: usize = 2;

        fn watched(w: &(LeaseId, u32)) -> (LeaseId, u32) {
            *w
        }

        fn stopped(lease: LeaseId) -> ProviderError {
            ProviderError::Slurm {
                lease: Some(lease),
                what: "watching its job".into(),
                detail: "the poller has stopped".into(),
            }
        }
    }

    /// What the watch task was told, in order (Forget answered).
    fn drain(rx: &mut mpsc::UnboundedReceiver<Cmd<Numbered>>) -> Vec<String> {
        let mut seen = Vec::new();
        while let Ok(cmd) = rx.try_recv() {
            seen.push(format!("{cmd:?}"));
            if let Cmd::Forget(_, done) = cmd {
                let _ = done.send(());
            }
        }
        seen
    }

    /// Answers every Forget as the watch task would, logging every order.
    fn watch_task(
        mut rx: mpsc::UnboundedReceiver<Cmd<Numbered>>,
    ) -> (Arc<Mutex<Vec<String>>>, tokio::task::JoinHandle<()>) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let seen = log.clone();
        let task = tokio::spawn(async move {
            while let Some(cmd) = rx.recv().await {
                seen.lock().unwrap().push(format!("{cmd:?}"));
                if let Cmd::Forget(_, done) = cmd {
                    let _ = done.send(());
                }
            }
        });
        (log, task)
    }

    #[test]
    fn a_watched_job_is_held_once_and_a_second_acquire_of_its_lease_is_refused() {
        let (jobs, mut rx) = RemoteJobs::<Numbered>::new();
        assert!(jobs.check_new(LeaseId(1)).is_ok());
        jobs.watch((LeaseId(1), 7)).unwrap();
        jobs.watch((LeaseId(2), 8)).unwrap();
        assert_eq!(jobs.held(), vec![LeaseId(1), LeaseId(2)]);
        assert_eq!(jobs.job(LeaseId(1)), Some(7));
        assert!(matches!(
            jobs.check_new(LeaseId(1)),
            Err(ProviderError::Duplicate(LeaseId(1)))
        ));
        assert_eq!(drain(&mut rx), ["Watch", "Watch"]);
        // the watch task dropped an ended job: held no more
        jobs.ended(LeaseId(1));
        assert_eq!(jobs.held(), vec![LeaseId(2)]);
    }

    #[test]
    fn a_watch_after_the_task_stopped_fails_and_holds_nothing() {
        let (jobs, rx) = RemoteJobs::<Numbered>::new();
        drop(rx);
        let e = jobs.watch((LeaseId(3), 9)).unwrap_err().to_string();
        assert!(e.contains("the poller has stopped"), "{e}");
        assert!(jobs.held().is_empty());
    }

    #[tokio::test]
    async fn a_released_job_is_cancelled_once_then_forgotten() {
        let (jobs, rx) = RemoteJobs::<Numbered>::new();
        let (log, task) = watch_task(rx);
        jobs.watch((LeaseId(1), 7)).unwrap();
        let cancelled = Arc::new(Mutex::new(Vec::new()));
        let c = cancelled.clone();
        jobs.release(LeaseId(1), move |job| async move {
            c.lock().unwrap().push(job);
            Ok(())
        })
        .await
        .unwrap();
        assert_eq!(*cancelled.lock().unwrap(), vec![7]);
        assert!(jobs.held().is_empty());
        drop(jobs);
        task.await.unwrap();
        assert_eq!(
            *log.lock().unwrap(),
            ["Watch", "Releasing(lease-1, true)", "Forget(lease-1)"]
        );
    }

    #[tokio::test]
    async fn a_lease_not_held_is_refused_and_nothing_is_cancelled() {
        let (jobs, mut rx) = RemoteJobs::<Numbered>::new();
        let mut cancels = 0;
        let r = jobs
            .release(LeaseId(4), |_| {
                cancels += 1;
                async { Ok(()) }
            })
            .await;
        assert!(matches!(r, Err(ProviderError::UnknownLease(LeaseId(4)))));
        assert_eq!(cancels, 0);
        assert!(drain(&mut rx).is_empty());
    }

    #[tokio::test]
    async fn a_failed_release_keeps_the_lease_held_and_its_end_is_news_again_unless_on_its_way_out()
    {
        let (jobs, mut rx) = RemoteJobs::<Numbered>::new();
        jobs.watch((LeaseId(1), 7)).unwrap();
        jobs.watch((LeaseId(2), 8)).unwrap();
        let refused = jobs
            .release(LeaseId(1), |_| async {
                Err(Unreleased::from(ProviderError::UnknownLease(LeaseId(1))))
            })
            .await;
        assert!(refused.is_err());
        let slow = jobs
            .release(LeaseId(2), |_| async {
                Err(Unreleased {
                    error: ProviderError::UnknownLease(LeaseId(2)),
                    on_its_way_out: true,
                })
            })
            .await;
        assert!(slow.is_err());
        assert_eq!(jobs.held(), vec![LeaseId(1), LeaseId(2)]);
        assert_eq!(
            drain(&mut rx),
            [
                "Watch",
                "Watch",
                "Releasing(lease-1, true)",
                "Releasing(lease-1, false)",
                "Releasing(lease-2, true)",
            ]
        );
    }

    #[test]
    fn beginning_a_release_marks_only_held_leases_and_names_each_job_once() {
        let (jobs, mut rx) = RemoteJobs::<Numbered>::new();
        jobs.watch((LeaseId(1), 7)).unwrap();
        jobs.watch((LeaseId(2), 8)).unwrap();
        let begun = jobs.begin_release(&[LeaseId(2), LeaseId(5), LeaseId(1)]);
        assert_eq!(begun, vec![(LeaseId(2), 8), (LeaseId(1), 7)]);
        assert_eq!(
            drain(&mut rx),
            [
                "Watch",
                "Watch",
                "Releasing(lease-2, true)",
                "Releasing(lease-1, true)",
            ]
        );
        // begun, not released: still held until each release ends
        assert_eq!(jobs.held(), vec![LeaseId(1), LeaseId(2)]);
    }

    #[tokio::test]
    async fn detaching_forgets_every_job_and_cancels_none() {
        let (jobs, rx) = RemoteJobs::<Numbered>::new();
        let (log, task) = watch_task(rx);
        jobs.watch((LeaseId(1), 7)).unwrap();
        jobs.watch((LeaseId(2), 8)).unwrap();
        jobs.detach_all().await;
        assert!(jobs.held().is_empty());
        drop(jobs);
        task.await.unwrap();
        assert_eq!(
            *log.lock().unwrap(),
            ["Watch", "Watch", "Forget(lease-1)", "Forget(lease-2)"]
        );
    }

    #[test]
    fn a_job_gone_after_a_restart_failed_if_still_requested_preempted_if_taken_else_lost() {
        assert_eq!(gone_reason(LeaseState::Requested, false), EndReason::Failed);
        assert_eq!(gone_reason(LeaseState::Requested, true), EndReason::Failed);
        assert_eq!(gone_reason(LeaseState::Ready, true), EndReason::Preempted);
        assert_eq!(gone_reason(LeaseState::Ready, false), EndReason::Lost);
        assert_eq!(gone_reason(LeaseState::Starting, false), EndReason::Lost);
    }

    #[test]
    fn an_abandoned_job_is_looked_for_until_the_watch_ends() {
        let t0 = Instant::now();
        let mut a = Abandoned::new(Numbered::ABANDONED_KEPT);
        a.add("w-1".into(), "secret-1", t0);
        assert_eq!(a.get("w-1", t0 + ABANDONED_WATCH / 2), Some(&"secret-1"));
        assert_eq!(a.get("w-2", t0), None);
        assert_eq!(a.get("w-1", t0 + ABANDONED_WATCH), None);
        assert!(a.is_empty(), "an expired name is dropped");
    }

    #[test]
    fn abandoned_names_are_bounded_the_oldest_going_first_and_one_cancel_ends_the_search() {
        let t0 = Instant::now();
        let mut a = Abandoned::new(Numbered::ABANDONED_KEPT);
        a.add("w-1".into(), "s1", t0);
        a.add("w-2".into(), "s2", t0 + Duration::from_secs(1));
        a.add("w-3".into(), "s3", t0 + Duration::from_secs(2));
        assert_eq!(a.names().collect::<Vec<_>>(), ["w-2", "w-3"]);
        // the same name again is looked for once, from the later time
        a.add("w-2".into(), "s2b", t0 + Duration::from_secs(3));
        assert_eq!(a.names().collect::<Vec<_>>(), ["w-3", "w-2"]);
        assert_eq!(a.get("w-2", t0), Some(&"s2b"));
        // cancelled once: looked for no more
        a.remove("w-3");
        assert_eq!(a.names().collect::<Vec<_>>(), ["w-2"]);
        a.expire(t0 + Duration::from_secs(3) + ABANDONED_WATCH);
        assert!(a.is_empty());
    }

    /// Applies `cmd` to `t` at `now`, keeping a watch's job number.
    fn apply(t: &mut Watched<Numbered>, cmd: Cmd<Numbered>, now: Instant) -> Applied {
        t.apply(cmd, now, |(_, job)| job)
    }

    /// The leases whose observations are news, in order.
    fn news_of(t: &mut Watched<Numbered>) -> Vec<(LeaseId, u32)> {
        let mut v: Vec<(LeaseId, u32)> = t.all_news().map(|(l, j)| (l, *j)).collect();
        v.sort();
        v
    }

    #[test]
    fn a_watched_job_is_news_until_we_release_it_and_news_again_when_the_release_fails() {
        let now = Instant::now();
        let mut t = Watched::<Numbered>::new();
        assert_eq!(
            apply(&mut t, Cmd::Watch((LeaseId(1), 7)), now),
            Applied::Watched(LeaseId(1))
        );
        apply(&mut t, Cmd::Watch((LeaseId(2), 8)), now);
        assert_eq!(news_of(&mut t), [(LeaseId(1), 7), (LeaseId(2), 8)]);
        assert!(!t.releasing(LeaseId(1)));

        assert_eq!(
            apply(&mut t, Cmd::Releasing(LeaseId(1), true), now),
            Applied::Releasing(LeaseId(1))
        );
        assert!(t.releasing(LeaseId(1)));
        assert!(t.news(LeaseId(1)).is_none(), "our own cancel is no news");
        assert_eq!(t.leases(), [LeaseId(1), LeaseId(2)], "still watched");
        assert_eq!(news_of(&mut t), [(LeaseId(2), 8)]);

        assert_eq!(
            apply(&mut t, Cmd::Releasing(LeaseId(1), false), now),
            Applied::NewsAgain(LeaseId(1))
        );
        assert!(!t.releasing(LeaseId(1)));
        assert_eq!(t.news(LeaseId(1)).copied(), Some(7));
        assert_eq!(t.leases(), [LeaseId(1), LeaseId(2)]);
    }

    #[test]
    fn a_forgotten_or_ended_job_is_watched_no_more_and_the_forget_is_answered() {
        let now = Instant::now();
        let mut t = Watched::<Numbered>::new();
        apply(&mut t, Cmd::Watch((LeaseId(1), 7)), now);
        apply(&mut t, Cmd::Watch((LeaseId(2), 8)), now);
        apply(&mut t, Cmd::Releasing(LeaseId(1), true), now);
        let (done, mut answer) = oneshot::channel();
        assert_eq!(
            apply(&mut t, Cmd::Forget(LeaseId(1), done), now),
            Applied::Forgotten(LeaseId(1))
        );
        assert_eq!(answer.try_recv(), Ok(()));
        assert!(!t.releasing(LeaseId(1)));
        assert_eq!(t.leases(), [LeaseId(2)]);
        t.ended(LeaseId(2));
        assert!(t.is_empty());
        assert!(news_of(&mut t).is_empty());
    }

    #[test]
    fn a_release_mark_for_a_lease_not_watched_changes_nothing_and_a_new_watch_starts_unmarked() {
        let now = Instant::now();
        let mut t = Watched::<Numbered>::new();
        apply(&mut t, Cmd::Releasing(LeaseId(3), true), now);
        assert!(!t.releasing(LeaseId(3)));
        assert!(t.is_empty());
        apply(&mut t, Cmd::Watch((LeaseId(3), 9)), now);
        assert!(!t.releasing(LeaseId(3)));
        assert_eq!(t.news(LeaseId(3)).copied(), Some(9));
        // a lease watched again (adopted anew) is news again
        apply(&mut t, Cmd::Releasing(LeaseId(3), true), now);
        apply(&mut t, Cmd::Watch((LeaseId(3), 10)), now);
        assert_eq!(t.news(LeaseId(3)).copied(), Some(10));
        assert_eq!(t.watching().copied().collect::<Vec<_>>(), [10]);
    }

    #[test]
    fn an_abandoned_order_is_looked_for_from_its_arrival_and_bounded() {
        let t0 = Instant::now();
        let mut t = Watched::<Numbered>::new();
        assert_eq!(
            apply(
                &mut t,
                Cmd::Abandoned {
                    name: "w-1".into(),
                    stray: "s1",
                },
                t0,
            ),
            Applied::Abandoned("w-1".into())
        );
        for (i, name) in ["w-2", "w-3"].into_iter().enumerate() {
            let at = t0 + Duration::from_secs(i as u64 + 1);
            apply(
                &mut t,
                Cmd::Abandoned {
                    name: name.into(),
                    stray: "s",
                },
                at,
            );
        }
        assert_eq!(t.abandoned().names().collect::<Vec<_>>(), ["w-2", "w-3"]);
        assert_eq!(t.abandoned().get("w-3", t0 + ABANDONED_WATCH), Some(&"s"));
        assert!(t.is_empty(), "an abandoned name is no watched lease");
    }
}
