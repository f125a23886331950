//! A lease's release work: cancel its job and wait until Slurm reports it
//! ended, all within `release_timeout_secs`, each tool run getting the
//! smaller of `tool_timeout_secs` and the time left. It owns what it needs,
//! so the shell can wait for it while it goes on with other work. The
//! bracket around it (releasing, then forgotten, or news again on failure)
//! is the remote-job skeleton's (`RemoteJobs::release`); it never ends the
//! lease itself: a release that fails leaves the job held and watched, and
//! the caller retries.

use std::time::Duration;

use super::super::{ProviderError, checked_secs};
use super::config::{MAX_RELEASE_TIMEOUT_SECS, default_release_timeout_secs};
use super::parse::{JobId, JobState};
use super::tools::{TOOL_TIMEOUT, Tools, tool_error};
use crate::table::LeaseId;

/// How often `release` checks whether the cancelled job has ended.
const RELEASE_POLL: Duration = Duration::from_millis(200);

/// One release's work, owning what it needs so that the shell can wait
/// for it while it goes on with other work.
pub(super) struct JobRelease {
    pub(super) lease: LeaseId,
    pub(super) job: JobId,
    pub(super) tools: Tools,
    pub(super) timeout_secs: f64,
}

impl JobRelease {
    /// Cancel, wait for the end; all within `release_timeout_secs`.
    pub(super) async fn cancel_and_wait(self) -> Result<(), ProviderError> {
        let (lease, job) = (self.lease, self.job);
        let timeout = checked_secs(
            "release_timeout_secs",
            self.timeout_secs,
            MAX_RELEASE_TIMEOUT_SECS,
        )
        .unwrap_or(Duration::from_secs_f64(default_release_timeout_secs()));
        let give_up = tokio::time::Instant::now() + timeout;
        let cancel = [job.to_string()];
        if let Err(e) = self.tool("scancel", &cancel, give_up).await {
            // a job that has ended cannot be cancelled, and need not be
            if !matches!(self.live_state(job, give_up).await, Ok(None)) {
                return Err(e);
            }
        }
        loop {
            let state = match self.live_state(job, give_up).await? {
                None => break,
                Some(state) => state,
            };
            let left = give_up.saturating_duration_since(tokio::time::Instant::now());
            if left < RELEASE_POLL {
                // no time for another look
                return Err(tool_error(
                    Some(lease),
                    format!("waiting for cancelled job {job} to end"),
                    format!(
                        "still {state:?} after {} s; it is still held and watched, and its release will be retried",
                        self.timeout_secs
                    ),
                ));
            }
            tokio::time::sleep(RELEASE_POLL).await;
        }
        tracing::info!(%lease, %job, "Slurm job cancelled");
        Ok(())
    }

    /// How long a tool may run, given the release ends at `give_up`: the
    /// smaller of the tool's own deadline and the time left; and which
    /// setting that is. `None` when no time is left.
    fn limit(&self, give_up: tokio::time::Instant) -> Option<(Duration, &'static str)> {
        let left = give_up.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            None
        } else if left < self.tools.timeout {
            Some((left, "what was left of release_timeout_secs"))
        } else {
            Some((self.tools.timeout, TOOL_TIMEOUT))
        }
    }

    /// The error of a release out of time before it could run `what`.
    fn out_of_time(&self, what: String) -> ProviderError {
        tool_error(
            Some(self.lease),
            what,
            format!(
                "not run: release_timeout_secs ({} s) ran out; the job is still held and watched, and its release will be retried",
                self.timeout_secs
            ),
        )
    }

    /// Runs `tool` for this release, within its deadline.
    async fn tool(
        &self,
        tool: &str,
        args: &[String],
        give_up: tokio::time::Instant,
    ) -> Result<String, ProviderError> {
        let Some((limit, bound)) = self.limit(give_up) else {
            return Err(self.out_of_time(format!("{tool} {}", args.join(" "))));
        };
        self.tools
            .run_within(Some(self.lease), tool, args, None, &[], limit, bound)
            .await
            .map_err(|f| f.error)
    }

    /// [`live_state`], within the release's deadline.
    async fn live_state(
        &self,
        job: JobId,
        give_up: tokio::time::Instant,
    ) -> Result<Option<JobState>, ProviderError> {
        let Some((limit, bound)) = self.limit(give_up) else {
            return Err(self.out_of_time(format!("squeue --jobs={job}")));
        };
        live_state(&self.tools, self.lease, job, limit, bound).await
    }
}

/// The state of `lease`'s `job` while Slurm reports it live; `None` once
/// it has ended (or Slurm no longer knows it); `Err` when `squeue` cannot
/// answer within `limit` (set by `bound`).
async fn live_state(
    tools: &Tools,
    lease: LeaseId,
    job: JobId,
    limit: Duration,
    bound: &str,
) -> Result<Option<JobState>, ProviderError> {
    let infos = tools
        .squeue_within(Some(lease), &[job], limit, bound)
        .await?;
    Ok(match infos.into_iter().find(|i| i.id == job) {
        None => None,
        Some(i) if matches!(i.state, JobState::Ended(_)) => None,
        Some(i) => Some(i.state),
    })
}
