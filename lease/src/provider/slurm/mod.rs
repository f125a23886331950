//! The `slurm` provider: each lease is a Slurm batch job that runs one
//! `tidegate-worker` on a GPU node.
//!
//! Slurm is the engine many GPU clouds hand their users, and it runs on a
//! single machine for tests (see `lease/tests/slurm_provider.rs`). The
//! provider talks to it through its own command-line tools (`sbatch`,
//! `squeue`, `scancel`, `scontrol`), so it needs no library of Slurm's and
//! works against any version whose output it parses (22.05 and later):
//!
//! * **acquire** submits a job with `sbatch --parsable` into the tier's
//!   partition (on-demand, spot or reserved) with `--gres` from the
//!   instance type (`gpu:<gpus>` unless configured). The job script `exec`s
//!   `srun <command> <args>`: running the worker as a job *step* is what
//!   makes Slurm deliver the preemption SIGTERM to it at the start of the
//!   partition's `GraceTime`. The lease's identity and one-time token go
//!   in the environment of `sbatch` (exported to the job), never on a
//!   command line.
//! * **watching**: one task polls `squeue` for every held job each
//!   `poll_interval_ms`. A job Slurm has chosen to preempt shows a
//!   `PreemptTime`; that is the spot notice, with the deadline
//!   `PreemptTime + GraceTime` of the partition. The worker, signalled at
//!   the same moment, drains by itself. When the job ends, the lease ends:
//!   `preempted` if it was preempted, `failed` if it never ran, `lost`
//!   otherwise. A preempted job that Slurm requeued (`PreemptMode=REQUEUE`)
//!   is cancelled: a lease is one run of a worker.
//! * **release** cancels the job (`scancel`: SIGTERM to the worker, then
//!   SIGKILL after Slurm's `KillWait`) and waits until Slurm reports it
//!   ended; only then is the job forgotten. If `scancel` fails, or the job
//!   (or a tool that does not answer) outlives `release_timeout_secs`, the
//!   release fails and the job stays held and watched (it may still bill):
//!   the caller retries, and if it ends meanwhile the poller reports it
//!   like any end.
//! * **deadlines**: every run of a tool is bounded by
//!   `tool_timeout_secs`; past it the tool is killed (and reaped) and the
//!   call fails, saying which command did not answer within how long, so a
//!   hung slurmctld cannot stall the gateway. An `sbatch` that timed out
//!   may have queued its job all the same (the controller got it, the
//!   answer was lost), so any job of the lease's name (`<job_name>-<lease>`)
//!   is then cancelled, best effort, before the acquire fails; and since
//!   a busy controller may queue it later still, the poller looks for a
//!   job of that name for 15 minutes and cancels it when it appears. A release
//!   takes at most `release_timeout_secs` in all: each tool it runs gets the
//!   smaller of `tool_timeout_secs` and the time the release has left.
//! * a job that ended is no longer held: [`SlurmProvider::held`] lists live
//!   jobs only, and a shutdown cancels nothing that has already ended.
//! * **adoption**: the ledger keeps each lease's job id. After a gateway
//!   restart a lease whose job still runs (or is still pending) is watched
//!   again; any other is ended, so none leaks.
//!
//! Readiness comes from the worker's registration, as with the process
//! provider. A job that stays pending (no free GPU) is ended by the
//! gateway's `start_timeout_secs`, which releases it.
//!
//! Its rooms: [`config`] (`[leasing.slurm]`, the `sbatch` arguments and
//! script; pure), [`parse`] (what the tools print; pure), [`watch`] (what a
//! job's row means for its lease; pure), `tools` (running a tool within its
//! deadline), `poll` (the poller task: watches, events, stray jobs) and
//! `release` (cancel and wait). This module holds the provider itself:
//! connect, adopt, acquire, release and shutdown. What it shares with the
//! poller (the held jobs, the orders, the release bracket, the names of
//! jobs an unanswered `sbatch` may queue) is the remote-job skeleton,
//! `super::remote`, which Kubernetes uses too.

pub mod config;
pub mod parse;
mod poll;
mod release;
mod tools;
pub mod watch;

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

pub use self::config::{
    MAX_RELEASE_TIMEOUT_SECS, MAX_TOOL_TIMEOUT_SECS, SlurmConfig, SlurmPartitions, shell_quote,
};
pub use self::parse::{
    JobId, JobInfo, JobState, SQUEUE_FORMAT, parse_grace_secs, parse_job_id, parse_squeue,
    parse_stray_jobs, parse_utc,
};
use self::poll::HeldJobs;
use self::release::JobRelease;
use self::tools::{TOOL_TIMEOUT, Tools, tool_error};
pub use self::watch::{JobWatch, Step};
use super::remote::{self, Unreleased, release_all};
use super::{
    Acquired, Adoption, EVENT_CHANNEL_CAPACITY, LeaseSpec, MAX_NOTICE_PERIOD_SECS, Provider,
    ProviderError, ProviderEvent, checked_secs,
};
use crate::billing::Millis;
use crate::catalog::Tier;
use crate::ledger::Ledger;
use crate::table::LeaseId;

/// Provider name in the ledger.
pub const PROVIDER_NAME: &str = "slurm";

/// What the ledger keeps about a Slurm lease, to adopt it later.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlurmData {
    /// The job.
    pub job_id: JobId,
    /// The partition it was submitted to.
    pub partition: String,
}

/// The Slurm provider.
#[derive(Debug)]
pub struct SlurmProvider {
    cfg: SlurmConfig,
    tools: Tools,
    notice: Duration,
    jobs: HeldJobs,
    poller: JoinHandle<()>,
    events_rx: Option<mpsc::Receiver<ProviderEvent>>,
}

impl SlurmProvider {
    /// Checks the configuration against the cluster (every partition
    /// exists; the spot partition's `GraceTime` is the notice period unless
    /// configured) and starts the poller on the current runtime. Each
    /// `scontrol` is bounded by `tool_timeout_secs`.
    pub async fn connect(cfg: SlurmConfig) -> Result<SlurmProvider, ProviderError> {
        cfg.validate()
            .map_err(|e| tool_error(None, "leasing.slurm".into(), e))?;
        let tools = Tools::new(&cfg)?;
        let mut grace = None;
        let parts = &cfg.partitions;
        for (tier, p) in [
            (Tier::OnDemand, Some(&parts.on_demand)),
            (Tier::Spot, parts.spot.as_ref()),
            (Tier::Reserved, parts.reserved.as_ref()),
        ] {
            let Some(p) = p else { continue };
            let args = [
                "show".into(),
                "partition".into(),
                "--oneliner".into(),
                p.clone(),
            ];
            let out = tools
                .run_within(
                    None,
                    "scontrol",
                    &args,
                    None,
                    &[],
                    tools.timeout,
                    TOOL_TIMEOUT,
                )
                .await
                .map_err(|f| match f.error {
                    // a controller that does not answer: no hint about
                    // the partition would help
                    e if f.timed_out => e,
                    ProviderError::Slurm { detail, .. } => tool_error(
                        None,
                        format!("checking the {tier} partition {p:?}"),
                        format!(
                            "{detail}; is it in slurm.conf, and is SLURM_CONF ({}) right?",
                            cfg.slurm_conf
                                .as_ref()
                                .map_or("default".into(), |c| c.display().to_string())
                        ),
                    ),
                    other => other,
                })?;
            if tier == Tier::Spot {
                grace = parse_grace_secs(&out);
            }
        }
        let notice = match (cfg.notice_period_secs, grace) {
            (Some(s), _) => checked_secs("notice_period_secs", s, MAX_NOTICE_PERIOD_SECS)
                .map_err(|e| tool_error(None, "leasing.slurm".into(), e))?,
            (None, Some(g)) => Duration::from_secs(g),
            (None, None) => Duration::ZERO,
        };
        let (events_tx, events_rx) = mpsc::channel(EVENT_CHANNEL_CAPACITY);
        let (jobs, rx) = HeldJobs::new();
        let poller = tokio::spawn(poll::run(
            tools.clone(),
            Duration::from_millis(cfg.poll_interval_ms),
            notice,
            rx,
            events_tx,
            jobs.clone(),
        ));
        Ok(SlurmProvider {
            cfg,
            tools,
            notice,
            jobs,
            poller,
            events_rx: Some(events_rx),
        })
    }

    /// The notice period a preempted spot lease gets.
    pub fn notice_period(&self) -> Duration {
        self.notice
    }

    /// The job of a held lease.
    pub fn job(&self, lease: LeaseId) -> Option<JobId> {
        self.jobs.job(lease)
    }

    /// Leases held: those whose job Slurm has not reported ended.
    pub fn held(&self) -> Vec<LeaseId> {
        self.jobs.held()
    }

    /// Stops watching every job WITHOUT cancelling it, as a crash of the
    /// gateway would. The next provider over the same ledger adopts them.
    pub async fn detach_all(self) {
        self.jobs.detach_all().await;
        self.poller.abort();
    }

    /// Releases every lease (cancels its job and waits for its end). A job
    /// that cannot be cancelled is logged with its id: it outlives the
    /// provider, and the next one over the same ledger adopts it.
    pub async fn shutdown(mut self) {
        let held = self.held();
        for (lease, e) in release_all(&mut self, held).await {
            let job = self.job(lease);
            tracing::warn!(%lease, ?job, error = %e, "release at shutdown failed; the job may still run and bill");
        }
        self.poller.abort();
    }
}

impl Drop for SlurmProvider {
    fn drop(&mut self) {
        // Jobs are not ours to kill on drop: they outlive the gateway
        // like a cloud instance would, and the ledger adopts them.
        self.poller.abort();
    }
}

impl Provider for SlurmProvider {
    fn name(&self) -> &'static str {
        PROVIDER_NAME
    }

    /// Builds the job in the call; the future submits it (within
    /// `tool_timeout_secs`) and watches it.
    fn acquire(
        &mut self,
        spec: LeaseSpec,
    ) -> impl Future<Output = Result<Acquired, ProviderError>> + Send + 'static {
        let lease = spec.lease;
        let args = self
            .jobs
            .check_new(lease)
            .and_then(|()| self.cfg.sbatch_args(&spec));
        let mut env: Vec<(String, String)> = self
            .cfg
            .env
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        env.extend([
            ("TIDEGATE_LEASE_ID".to_string(), lease.0.to_string()),
            (
                "TIDEGATE_LEASE_TOKEN".into(),
                spec.token.expose().to_string(),
            ),
            ("TIDEGATE_INSTANCE_TYPE".into(), spec.instance.name.clone()),
            ("TIDEGATE_GPU_MODEL".into(), spec.instance.gpu_model.clone()),
            ("TIDEGATE_LEASE_TIER".into(), spec.tier.as_str().to_string()),
        ]);
        let script = self.cfg.script();
        let partition = self
            .cfg
            .partition(spec.tier)
            .unwrap_or_default()
            .to_string();
        let (tools, job_name) = (self.tools.clone(), self.cfg.job_name.clone());
        let jobs = self.jobs.clone();
        async move {
            let args = args?;
            let sbatch = tools
                .run_within(
                    Some(lease),
                    "sbatch",
                    &args,
                    Some(&script),
                    &env,
                    tools.timeout,
                    TOOL_TIMEOUT,
                )
                .await;
            let out = match sbatch {
                Ok(out) => out,
                Err(f) => {
                    if f.timed_out {
                        cancel_unanswered(&tools, &job_name, lease).await;
                        // the controller may queue it later still
                        jobs.abandon(format!("{job_name}-{}", lease.0), ());
                    }
                    return Err(f.error);
                }
            };
            let job = parse_job_id(&out).ok_or_else(|| {
                tool_error(
                    Some(lease),
                    "sbatch".into(),
                    format!("no job id in its output {:?}", out.trim()),
                )
            })?;
            jobs.watch(JobWatch::new(lease, job, false))?;
            tracing::info!(%lease, %job, %partition, instance = %spec.instance.name, tier = %spec.tier, "Slurm job submitted");
            let data = SlurmData {
                job_id: job,
                partition,
            };
            Ok(Acquired {
                lease,
                pid: None,
                provider_data: Some(serde_json::to_string(&data).unwrap_or_default()),
                token: None,
            })
        }
    }

    /// Cancels the lease's job and waits until Slurm reports it ended;
    /// only then is it forgotten. On an error the job is still held and
    /// watched: it may still run (and bill), so the caller must retry.
    fn release(
        &mut self,
        lease: LeaseId,
    ) -> impl Future<Output = Result<(), ProviderError>> + Send + 'static {
        let (tools, timeout_secs) = (self.tools.clone(), self.cfg.release_timeout_secs);
        self.jobs.release(lease, move |job| async move {
            let release = JobRelease {
                lease,
                job,
                tools,
                timeout_secs,
            };
            release.cancel_and_wait().await.map_err(Unreleased::from)
        })
    }

    /// Re-adopts the live `slurm` leases recorded in `ledger`, ending the
    /// ones whose job is gone: at the job's end when `squeue` still shows
    /// it, otherwise at `now`. One `squeue` (within `tool_timeout_secs`);
    /// a controller that cannot answer fails it, since ending leases whose
    /// jobs may well run would leak them.
    async fn adopt(&mut self, ledger: &mut Ledger, now: Millis) -> Result<Adoption, ProviderError> {
        let recs = remote::recorded::<SlurmData>(ledger, PROVIDER_NAME)?;
        let ids: Vec<JobId> = recs
            .iter()
            .filter_map(|(_, d)| d.as_ref().map(|d| d.job_id))
            .collect();
        let infos = self.tools.squeue(&ids).await?;
        let mut out = Adoption::default();
        for (r, data) in recs {
            let job = data.map(|d| d.job_id);
            let info = job.and_then(|j| infos.iter().find(|i| i.id == j));
            let live = info.filter(|i| !matches!(i.state, JobState::Ended(_)));
            if let (Some(job), Some(info)) = (job, live) {
                let ran = !matches!(info.state, JobState::Pending | JobState::Configuring);
                self.jobs.watch(JobWatch::new(r.id, job, ran))?;
                tracing::info!(lease = %r.id, %job, "adopted Slurm job after restart");
                out.adopted.push(r.id);
            } else {
                let reason = remote::gone_reason(r.state, false);
                if job.is_none() {
                    // The gateway stopped between sbatch and recording the
                    // job id: a job may be queued under the lease's name,
                    // to hold GPUs and start a worker for an ended lease.
                    let name = format!("--name={}-{}", self.cfg.job_name, r.id.0);
                    match self
                        .tools
                        .run(Some(r.id), "scancel", &[name], None, &[])
                        .await
                    {
                        Ok(_) => {
                            tracing::info!(lease = %r.id, "cancelled any job submitted for it before the restart")
                        }
                        Err(e) => {
                            tracing::warn!(lease = %r.id, "cancelling a job it may have been given: {e}")
                        }
                    }
                }
                // billed to when the job ended, where Slurm still says
                // (`MinJobAge`, 300 s by default); otherwise to now
                let at = info.and_then(|i| i.end_time).map_or(now, |t| t.min(now));
                remote::end_gone(ledger, &mut out, r.id, at, reason)?;
                tracing::warn!(lease = %r.id, job = ?job, ended_at = at, "Slurm job gone after restart; lease ended");
            }
        }
        Ok(out)
    }

    /// Starts releasing `leases` all at once: one `scancel` of their jobs
    /// (each worker gets SIGTERM and drains) without waiting for them to
    /// end. [`Provider::release`] then cancels again (harmless) and waits,
    /// so a gateway stopping with many leases waits about one drain, not
    /// one per lease. A failed `scancel` is logged; `release` retries.
    async fn begin_release(&mut self, leases: &[LeaseId]) {
        let jobs: Vec<String> = self
            .jobs
            .begin_release(leases)
            .into_iter()
            .map(|(_, job)| job.to_string())
            .collect();
        if jobs.is_empty() {
            return;
        }
        if let Err(e) = self.tools.run(None, "scancel", &jobs, None, &[]).await {
            tracing::warn!(?jobs, error = %e, "cancelling jobs; each release tries again");
        }
    }

    fn take_events(&mut self) -> Option<mpsc::Receiver<ProviderEvent>> {
        self.events_rx.take()
    }
}

/// After an `sbatch` for `lease` that did not answer in time: the
/// controller may have queued the job all the same (the answer was lost),
/// and nobody knows its id, so any job of the lease's name is cancelled,
/// as adoption does for a lease whose job id was never recorded. Best
/// effort: a failure is logged.
async fn cancel_unanswered(tools: &Tools, job_name: &str, lease: LeaseId) {
    let name = format!("{job_name}-{}", lease.0);
    let args = [format!("--name={name}")];
    match tools.run(Some(lease), "scancel", &args, None, &[]).await {
        Ok(_) => {
            tracing::info!(%lease, job_name = %name, "sbatch did not answer; cancelled any job it may have queued")
        }
        Err(e) => {
            tracing::warn!(%lease, job_name = %name, error = %e, "sbatch did not answer, and cancelling any job it may have queued failed; such a job runs unwatched: cancel it with `scancel --name={name}`")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_tool_timeout_must_be_positive_finite_and_at_most_ten_minutes() {
        let mut cfg = SlurmConfig::new("w", &[], "gpu");
        assert_eq!(cfg.tool_timeout_secs, 30.0);
        for ok in [0.5, 30.0, MAX_TOOL_TIMEOUT_SECS] {
            cfg.tool_timeout_secs = ok;
            assert_eq!(cfg.validate(), Ok(()), "{ok}");
            assert!(Tools::new(&cfg).is_ok(), "{ok}");
        }
        for bad in [
            0.0,
            -1.0,
            f64::NAN,
            f64::INFINITY,
            MAX_TOOL_TIMEOUT_SECS + 1.0,
            1e20,
        ] {
            cfg.tool_timeout_secs = bad;
            let e = cfg.validate().unwrap_err();
            assert!(e.contains("tool_timeout_secs"), "{bad}: {e}");
            // the provider refuses it too, before it runs any tool
            let e = SlurmProvider::connect(cfg.clone())
                .await
                .unwrap_err()
                .to_string();
            assert!(e.contains("tool_timeout_secs"), "{bad}: {e}");
        }
    }
}
