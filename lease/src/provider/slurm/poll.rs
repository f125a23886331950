//! The poller: one task that owns the watches of the held jobs, polls
//! `squeue` for them every `poll_interval_ms` and sends what each row means
//! as a [`ProviderEvent`]; it also cancels requeued jobs, and jobs that an
//! `sbatch` which did not answer queued after all. The provider talks to it
//! with [`Cmd`]s, which it applies to its [`Watched`] table (the skeleton's:
//! which jobs are being released, so their end is no news), and shares
//! [`HeldJobs`] with it, which the poller changes only to drop a job Slurm
//! reported ended (before it sends the end). What a row means is
//! [`JobWatch::observe`]'s to decide, not the poller's.

use std::time::Duration;

use tokio::sync::mpsc;

use super::super::remote::{self, Abandoned, RemoteJobs, Watched};
use super::super::{ProviderEvent, wall_clock_ms};
use super::Slurm;
use super::parse::{JobId, JobInfo, parse_stray_jobs};
use super::tools::Tools;
use super::watch::Step;
use crate::billing::Millis;
use crate::lifecycle::EndReason;

/// An order from the provider to the poller.
pub(super) type Cmd = remote::Cmd<Slurm>;

/// The jobs held, shared with the poller, which drops a job once Slurm
/// reports it ended (before it sends the end), so they are live jobs only.
pub(super) type HeldJobs = RemoteJobs<Slurm>;

/// Cancels the live jobs named in `abandoned`: queued by an `sbatch` that
/// did not answer, after its acquire gave up, they belong to no lease. A
/// name whose job is cancelled is looked for no more (one `sbatch` queues
/// one job). Failures are logged; the next poll tries again.
async fn cancel_strays(tools: &Tools, abandoned: &mut Abandoned<()>) {
    let names: Vec<&str> = abandoned.names().collect();
    let args = [
        "--noheader".to_string(),
        format!("--name={}", names.join(",")),
        "--format=%i|%j|%T".to_string(),
    ];
    let out = match tools.run(None, "squeue", &args, None, &[]).await {
        Ok(out) => out,
        Err(e) => {
            tracing::debug!(error = %e, "looking for jobs queued by unanswered sbatches");
            return;
        }
    };
    for (job, name) in parse_stray_jobs(&out) {
        match tools
            .run(None, "scancel", &[job.to_string()], None, &[])
            .await
        {
            Ok(_) => {
                tracing::warn!(%job, job_name = %name, "Slurm queued a job after its sbatch had stopped waiting for the answer; no lease holds it, cancelled so it does not bill");
                abandoned.remove(&name);
            }
            Err(e) => {
                tracing::warn!(%job, job_name = %name, error = %e, "cancelling a job no lease holds failed; trying again at the next poll");
            }
        }
    }
}

/// The poller: owns the watches, polls `squeue`, sends events.
pub(super) async fn run(
    tools: Tools,
    every: Duration,
    notice: Duration,
    mut cmds: mpsc::UnboundedReceiver<Cmd>,
    events: mpsc::Sender<ProviderEvent>,
    held: HeldJobs,
) {
    // the watched jobs, and the job names of unanswered sbatches
    let mut watched: Watched<Slurm> = Watched::new();
    // the first poll one interval after start, not at once: a lease
    // watched in the meantime is looked at on the same schedule as later
    // ones (and a test that swaps a tool after its acquire never races an
    // immediate poll)
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failures = 0u32;
    loop {
        tokio::select! {
            cmd = cmds.recv() => match cmd {
                // what the order did needs no action here: the next poll
                // looks at every watched job, and for every abandoned name
                Some(cmd) => {
                    watched.apply(cmd, tokio::time::Instant::now(), |w| w);
                }
                None => return,
            },
            _ = tick.tick() => {
                let abandoned = watched.abandoned();
                abandoned.expire(tokio::time::Instant::now());
                if !abandoned.is_empty() {
                    cancel_strays(&tools, abandoned).await;
                }
                if watched.is_empty() {
                    continue;
                }
                let jobs: Vec<JobId> = watched.watching().map(|w| w.job).collect();
                match tools.squeue(&jobs).await {
                    Ok(infos) => {
                        failures = 0;
                        if !poll_once(&tools, &mut watched, &infos, notice, &events, &held).await {
                            return;
                        }
                    }
                    Err(e) => {
                        // the controller may be restarting; the jobs run on
                        failures += 1;
                        if failures == 1 || failures.is_multiple_of(30) {
                            tracing::warn!(error = %e, failures, "squeue failed; leases kept as they were");
                        }
                    }
                }
            }
        }
    }
}

/// Folds one `squeue` answer into the watches whose jobs can be news (not
/// being released: the release waits for its end and forgets it) and
/// sends what it means; `false` once nobody listens to the events. A job
/// that ended is dropped from the watches and from the held jobs before
/// its end is sent.
async fn poll_once(
    tools: &Tools,
    watched: &mut Watched<Slurm>,
    infos: &[JobInfo],
    notice: Duration,
    events: &mpsc::Sender<ProviderEvent>,
    held: &HeldJobs,
) -> bool {
    let now = wall_clock_ms();
    let mut ended = Vec::new();
    let mut out = Vec::new();
    for (lease, w) in watched.all_news() {
        let job = w.job;
        let info = infos.iter().find(|i| i.id == job);
        let notice_first = |deadline: Option<Millis>, out: &mut Vec<ProviderEvent>| {
            if let Some(deadline) = deadline {
                out.push(ProviderEvent::PreemptionNotice { lease, deadline });
            }
        };
        match w.observe(info, now, notice) {
            Step::Nothing => {}
            Step::Notice { deadline } => {
                tracing::info!(%lease, %job, deadline, "Slurm preempts the job: spot notice");
                notice_first(Some(deadline), &mut out);
            }
            Step::CancelRequeued { late_notice } => {
                // the notice first: the worker is gone either way
                notice_first(late_notice, &mut out);
                let r = tools
                    .run(Some(lease), "scancel", &[job.to_string()], None, &[])
                    .await;
                if let Err(e) = r {
                    // Slurm may start it again: keep it held and watched,
                    // and cancel again at the next poll (or see it end)
                    tracing::warn!(%lease, %job, error = %e, "cancelling a requeued job failed; retrying at the next poll");
                    continue;
                }
                ended.push(lease);
                out.push(ProviderEvent::Ended {
                    lease,
                    reason: EndReason::Preempted,
                    detail: format!("Slurm job {job} was preempted and requeued; cancelled"),
                });
            }
            Step::Ended {
                reason,
                detail,
                late_notice,
            } => {
                notice_first(late_notice, &mut out);
                ended.push(lease);
                out.push(ProviderEvent::Ended {
                    lease,
                    reason,
                    detail,
                });
            }
        }
    }
    for lease in ended {
        watched.ended(lease);
        held.ended(lease);
    }
    for ev in out {
        if events.send(ev).await.is_err() {
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::slurm::watch::JobWatch;
    use crate::provider::slurm::watch::tests::{NOTICE, info};
    use crate::table::LeaseId;

    /// Points the provider's `scancel` at `true` or `false` (a symlink:
    /// nothing is written that a forked child could hold open).
    fn fake_scancel(dir: &std::path::Path, works: bool) {
        let target = ["/bin", "/usr/bin"]
            .iter()
            .map(|d| std::path::Path::new(d).join(if works { "true" } else { "false" }))
            .find(|p| p.exists())
            .expect("true and false are installed");
        let link = dir.join("scancel");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(target, link).unwrap();
    }

    /// A poller's table watching `w`.
    fn watched_with(w: JobWatch) -> Watched<Slurm> {
        let mut watched = Watched::new();
        watched.apply(Cmd::Watch(w), tokio::time::Instant::now(), |w| w);
        watched
    }

    #[tokio::test]
    async fn a_job_we_are_releasing_is_not_looked_at_and_its_end_is_no_news() {
        let tools = Tools {
            bin_dir: None,
            slurm_conf: None,
            timeout: Duration::from_secs(30),
        };
        let lease = LeaseId(2);
        let mut watched = watched_with(JobWatch::new(lease, JobId(7), true));
        let (held, _cmds) = HeldJobs::new();
        held.watch(JobWatch::new(lease, JobId(7), true)).unwrap();
        let (tx, mut rx) = mpsc::channel(16);
        let now = tokio::time::Instant::now();
        watched.apply(Cmd::Releasing(lease, true), now, |w| w);
        // it ended, but by our own scancel
        let cancelled = [info("CANCELLED", None)];
        assert!(poll_once(&tools, &mut watched, &cancelled, NOTICE, &tx, &held).await);
        assert!(rx.try_recv().is_err());
        assert_eq!(watched.leases(), [lease], "the release forgets it");
        assert_eq!(held.job(lease), Some(JobId(7)));
        // the release failed: the same answer is news now
        watched.apply(Cmd::Releasing(lease, false), now, |w| w);
        assert!(poll_once(&tools, &mut watched, &cancelled, NOTICE, &tx, &held).await);
        assert!(matches!(
            rx.try_recv(),
            Ok(ProviderEvent::Ended { lease: l, .. }) if l == lease
        ));
        assert!(watched.is_empty());
        assert!(held.held().is_empty());
    }

    #[tokio::test]
    async fn a_requeued_job_whose_scancel_fails_stays_held_and_watched() {
        let dir = tempfile::tempdir().unwrap();
        let tools = Tools {
            bin_dir: Some(dir.path().to_path_buf()),
            slurm_conf: None,
            timeout: Duration::from_secs(30),
        };
        let lease = LeaseId(1);
        let mut watched = watched_with(JobWatch::new(lease, JobId(7), true));
        let (held, _cmds) = HeldJobs::new();
        held.watch(JobWatch::new(lease, JobId(7), true)).unwrap();
        let (tx, mut rx) = mpsc::channel(16);
        let requeued = [info("PENDING", Some(4000))];

        fake_scancel(dir.path(), false);
        assert!(poll_once(&tools, &mut watched, &requeued, NOTICE, &tx, &held).await);
        // the notice goes out (its worker is gone), but the lease does not end
        assert!(matches!(
            rx.try_recv(),
            Ok(ProviderEvent::PreemptionNotice { lease: l, deadline: 34_000 }) if l == lease
        ));
        assert!(rx.try_recv().is_err());
        assert_eq!(watched.leases(), [lease]);
        assert_eq!(held.job(lease), Some(JobId(7)));

        // the next poll cancels again; this time it works, and it ends
        fake_scancel(dir.path(), true);
        assert!(poll_once(&tools, &mut watched, &requeued, NOTICE, &tx, &held).await);
        match rx.try_recv() {
            Ok(ProviderEvent::Ended {
                lease: l, reason, ..
            }) => {
                assert_eq!(l, lease);
                assert_eq!(reason, EndReason::Preempted);
            }
            other => panic!("{other:?}"),
        }
        assert!(rx.try_recv().is_err());
        assert!(watched.is_empty());
        assert!(held.held().is_empty());
    }
}
