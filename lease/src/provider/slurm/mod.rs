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
//! `release` (cancel and wait). This module holds [`Slurm`], what Slurm
//! supplies to the remote-job provider that Kubernetes shares
//! (`super::remote`): connect, and submit (`sbatch`), cancel (`scancel`
//! and wait), begin cancel and adoption's survey (`squeue`). The provider
//! itself (held jobs, orders, the release bracket, the names of jobs an
//! unanswered `sbatch` may queue, acquire, release, adopt, shutdown) is the
//! skeleton's.

pub mod config;
pub mod parse;
mod poll;
mod release;
mod tools;
pub mod watch;

use std::future::Future;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use self::config::{
    MAX_RELEASE_TIMEOUT_SECS, MAX_TOOL_TIMEOUT_SECS, SlurmConfig, SlurmPartitions, shell_quote,
};
pub use self::parse::{
    JobId, JobInfo, JobState, SQUEUE_FORMAT, parse_grace_secs, parse_job_id, parse_squeue,
    parse_stray_jobs, parse_utc,
};
use self::release::JobRelease;
use self::tools::{TOOL_TIMEOUT, Tools, tool_error};
pub use self::watch::{JobWatch, Step};
use super::remote::{Found, JobBackend, RemoteJobs, RemoteProvider, RemoteSystem, Unreleased};
use super::{LeaseSpec, MAX_NOTICE_PERIOD_SECS, ProviderError, checked_secs};
use crate::billing::Millis;
use crate::catalog::Tier;
use crate::ledger::LeaseRecord;
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

/// The Slurm provider: the remote-job provider over [`Slurm`].
pub type SlurmProvider = RemoteProvider<Slurm>;

/// Slurm as a remote-job system: its config, its tools and the spot
/// notice period. A lease's job is its id, the poller is handed a
/// [`JobWatch`], and a job an `sbatch` which did not answer may queue is
/// known by its name alone.
#[derive(Debug)]
pub struct Slurm {
    cfg: SlurmConfig,
    tools: Tools,
    notice: Duration,
}

impl JobBackend for Slurm {
    type Job = JobId;
    type Watch = JobWatch;
    type Watching = JobWatch;
    type Stray = ();
    const ABANDONED_KEPT: usize = 256;

    fn watched(w: &JobWatch) -> (LeaseId, JobId) {
        (w.lease, w.job)
    }

    fn stopped(lease: LeaseId) -> ProviderError {
        tool_error(
            Some(lease),
            "watching its job".into(),
            "the poller has stopped".into(),
        )
    }
}

impl RemoteProvider<Slurm> {
    /// Checks the configuration against the cluster (every partition
    /// exists; the spot partition's `GraceTime` is the notice period unless
    /// configured) and starts the poller on the current runtime. Each
    /// `scontrol` is bounded by `tool_timeout_secs`.
    pub async fn connect(cfg: SlurmConfig) -> Result<SlurmProvider, ProviderError> {
        cfg.validate()
            .map_err(|e| tool_error(None, "leasing.slurm".into(), e))?;
        let tools = Tools::new(&cfg)?;
        let grace = spot_grace(&cfg, &tools).await?;
        let notice = match (cfg.notice_period_secs, grace) {
            (Some(s), _) => checked_secs("notice_period_secs", s, MAX_NOTICE_PERIOD_SECS)
                .map_err(|e| tool_error(None, "leasing.slurm".into(), e))?,
            (None, Some(g)) => Duration::from_secs(g),
            (None, None) => Duration::ZERO,
        };
        let poll_every = Duration::from_millis(cfg.poll_interval_ms);
        let poll_tools = tools.clone();
        let slurm = Slurm { cfg, tools, notice };
        Ok(RemoteProvider::start(slurm, move |rx, events, held| {
            poll::run(poll_tools, poll_every, notice, rx, events, held)
        }))
    }

    /// The notice period a preempted spot lease gets.
    pub fn notice_period(&self) -> Duration {
        self.system().notice
    }
}

/// Checks that every configured partition exists (one `scontrol` each);
/// the spot partition's `GraceTime` (s), when it has one.
async fn spot_grace(cfg: &SlurmConfig, tools: &Tools) -> Result<Option<u64>, ProviderError> {
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
                // a controller that does not answer: no hint about the
                // partition would help
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
    Ok(grace)
}

impl RemoteSystem for Slurm {
    const NAME: &'static str = PROVIDER_NAME;
    type Record = SlurmData;

    /// Builds the job in the call; the future submits it with `sbatch`
    /// (within `tool_timeout_secs`).
    fn submit(
        &self,
        spec: LeaseSpec,
        jobs: &RemoteJobs<Slurm>,
    ) -> impl Future<Output = Result<(JobWatch, SlurmData), ProviderError>> + Send + 'static {
        let lease = spec.lease;
        let args = self.cfg.sbatch_args(&spec);
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
        let jobs = jobs.clone();
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
            tracing::info!(%lease, %job, %partition, instance = %spec.instance.name, tier = %spec.tier, "Slurm job submitted");
            let data = SlurmData {
                job_id: job,
                partition,
            };
            Ok((JobWatch::new(lease, job, false), data))
        }
    }

    /// `scancel`, then waits until Slurm reports the job ended.
    fn cancel(
        &self,
        lease: LeaseId,
        job: JobId,
    ) -> impl Future<Output = Result<(), Unreleased>> + Send + 'static {
        let release = JobRelease {
            lease,
            job,
            tools: self.tools.clone(),
            timeout_secs: self.cfg.release_timeout_secs,
        };
        async move { release.cancel_and_wait().await.map_err(Unreleased::from) }
    }

    /// One `scancel` of every job (each worker gets SIGTERM and drains).
    async fn begin_cancel(&self, jobs: Vec<(LeaseId, JobId)>) {
        let jobs: Vec<String> = jobs.into_iter().map(|(_, job)| job.to_string()).collect();
        if let Err(e) = self.tools.run(None, "scancel", &jobs, None, &[]).await {
            tracing::warn!(?jobs, error = %e, "cancelling jobs; each release tries again");
        }
    }

    /// One `squeue` of the recorded jobs (within `tool_timeout_secs`); a
    /// controller that cannot answer fails it. A job still pending or
    /// running is live; any other lease ends when its job ended, where
    /// Slurm still says (`MinJobAge`, 300 s by default), else now. A lease
    /// whose job id was never recorded may have a job queued under its
    /// name, which is cancelled.
    async fn survey(
        &self,
        recorded: &[(LeaseRecord, Option<SlurmData>)],
        now: Millis,
    ) -> Result<Vec<Found<JobWatch>>, ProviderError> {
        let ids: Vec<JobId> = recorded
            .iter()
            .filter_map(|(_, d)| d.as_ref().map(|d| d.job_id))
            .collect();
        let infos = self.tools.squeue(&ids).await?;
        let mut found = Vec::with_capacity(recorded.len());
        for (r, data) in recorded {
            let job = data.as_ref().map(|d| d.job_id);
            let info = job.and_then(|j| infos.iter().find(|i| i.id == j));
            let live = info.filter(|i| !matches!(i.state, JobState::Ended(_)));
            if let (Some(job), Some(info)) = (job, live) {
                let ran = !matches!(info.state, JobState::Pending | JobState::Configuring);
                tracing::info!(lease = %r.id, %job, "adopted Slurm job after restart");
                found.push(Found::Live(JobWatch::new(r.id, job, ran)));
                continue;
            }
            if job.is_none() {
                // The gateway stopped between sbatch and recording the job
                // id: a job may be queued under the lease's name, to hold
                // GPUs and start a worker for an ended lease.
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
            let at = info.and_then(|i| i.end_time).map_or(now, |t| t.min(now));
            tracing::warn!(lease = %r.id, job = ?job, ended_at = at, "Slurm job gone after restart; lease ended");
            found.push(Found::Gone { at, taking: false });
        }
        Ok(found)
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
