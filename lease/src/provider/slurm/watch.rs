//! What a held job's `squeue` row means for its lease. Pure: a row (or its
//! absence) and `now` in, a [`Step`] out; the poller acts on it (sends the
//! notice or the end, cancels a requeued job) and runs no tool from here.

use std::time::Duration;

use super::parse::{JobId, JobInfo, JobState};
use crate::billing::Millis;
use crate::lifecycle::EndReason;
use crate::table::LeaseId;

/// A job missing from `squeue` this many polls in a row has ended (one
/// miss may be a job that is between states on a busy controller).
const MISSES_TO_END: u32 = 2;

/// What the provider knows of one held job between polls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobWatch {
    /// The lease.
    pub lease: LeaseId,
    /// Its job.
    pub job: JobId,
    /// It was seen running (so an end is a loss, not a failed start).
    pub ran: bool,
    /// Its preemption notice was sent.
    pub noticed: bool,
    /// Polls in a row it was missing from `squeue`.
    pub misses: u32,
    /// It was requeued and is being cancelled: every poll that still
    /// shows it live cancels it again, until Slurm reports it ended.
    pub cancelling: bool,
}

/// What one poll means for a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Nothing new.
    Nothing,
    /// Send the spot notice.
    Notice {
        /// When Slurm kills it (ms since epoch).
        deadline: Millis,
    },
    /// Preempted and requeued: cancel it; once `scancel` succeeds it
    /// ended as preempted. If `scancel` fails the watch stays, and the next
    /// poll that shows the job live says `CancelRequeued` again.
    CancelRequeued {
        /// The notice to send first, if no poll saw the preemption coming.
        late_notice: Option<Millis>,
    },
    /// The job ended.
    Ended {
        /// Why, for the ledger.
        reason: EndReason,
        /// For logs.
        detail: String,
        /// The notice to send first: a preempted job whose worker drained
        /// and exited between two polls still gets its notice (so the
        /// autoscaler replaces it as a preemption).
        late_notice: Option<Millis>,
    },
}

impl JobWatch {
    /// A job just submitted (or adopted: `ran` if it was running).
    pub fn new(lease: LeaseId, job: JobId, ran: bool) -> JobWatch {
        JobWatch {
            lease,
            job,
            ran,
            noticed: false,
            misses: 0,
            cancelling: false,
        }
    }

    /// Folds one `squeue` observation (`None`: the job is not listed) into
    /// the watch. Pure: `now` and the notice period are given.
    pub fn observe(&mut self, info: Option<&JobInfo>, now: Millis, notice: Duration) -> Step {
        let Some(info) = info else {
            self.misses += 1;
            if self.misses < MISSES_TO_END {
                return Step::Nothing;
            }
            return Step::Ended {
                reason: self.end_reason(false),
                detail: format!("Slurm job {} is no longer known to Slurm", self.job),
                late_notice: None,
            };
        };
        self.misses = 0;
        let preempted = info.preempt_time.is_some()
            || matches!(&info.state, JobState::Ended(s) if s == "PREEMPTED");
        let notice_ms = Millis::try_from(notice.as_millis()).unwrap_or(Millis::MAX);
        let deadline = info.preempt_time.unwrap_or(now).saturating_add(notice_ms);
        let late_notice = (preempted && !self.noticed).then_some(deadline);
        if self.cancelling && !matches!(info.state, JobState::Ended(_)) {
            // a cancel that failed: try again, even if Slurm started it
            // once more meanwhile; its notice was sent the first time
            return Step::CancelRequeued { late_notice: None };
        }
        match &info.state {
            JobState::Ended(state) => Step::Ended {
                reason: self.end_reason(preempted),
                detail: format!(
                    "Slurm job {} ended {state} (reason {})",
                    self.job, info.reason
                ),
                late_notice,
            },
            JobState::Pending if self.ran || self.noticed || preempted => {
                // requeued after preemption (or after a node failure): a
                // lease is one run, and its worker is gone
                self.cancelling = true;
                self.noticed |= late_notice.is_some();
                Step::CancelRequeued { late_notice }
            }
            JobState::Pending | JobState::Configuring => Step::Nothing,
            JobState::Running | JobState::Suspended | JobState::Completing => {
                if matches!(info.state, JobState::Running) {
                    self.ran = true;
                }
                if preempted && !self.noticed {
                    self.noticed = true;
                    Step::Notice { deadline }
                } else {
                    Step::Nothing
                }
            }
        }
    }

    fn end_reason(&self, preempted: bool) -> EndReason {
        if preempted || self.noticed || self.cancelling {
            EndReason::Preempted
        } else if self.ran {
            EndReason::Lost
        } else {
            EndReason::Failed
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub(crate) fn info(state: &str, preempt: Option<Millis>) -> JobInfo {
        JobInfo {
            id: JobId(7),
            state: JobState::parse(state),
            preempt_time: preempt,
            end_time: None,
            reason: "None".into(),
        }
    }

    pub(crate) const NOTICE: Duration = Duration::from_secs(30);

    #[test]
    fn a_preempted_job_gets_one_notice_then_ends_preempted() {
        let mut w = JobWatch::new(LeaseId(1), JobId(7), false);
        assert_eq!(
            w.observe(Some(&info("PENDING", None)), 1000, NOTICE),
            Step::Nothing
        );
        assert_eq!(
            w.observe(Some(&info("RUNNING", None)), 2000, NOTICE),
            Step::Nothing
        );
        assert!(w.ran);
        assert_eq!(
            w.observe(Some(&info("RUNNING", Some(5000))), 6000, NOTICE),
            Step::Notice { deadline: 35_000 }
        );
        assert_eq!(
            w.observe(Some(&info("COMPLETING", Some(5000))), 7000, NOTICE),
            Step::Nothing
        );
        // the worker drained and exited 0 within the grace time
        match w.observe(Some(&info("COMPLETED", Some(5000))), 8000, NOTICE) {
            Step::Ended {
                reason,
                detail,
                late_notice,
            } => {
                assert_eq!(reason, EndReason::Preempted);
                assert!(detail.contains("COMPLETED"), "{detail}");
                assert_eq!(late_notice, None, "the notice went out already");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn ends_are_lost_failed_or_preempted() {
        let end =
            |w: &mut JobWatch, state: &str| match w.observe(Some(&info(state, None)), 0, NOTICE) {
                Step::Ended { reason, .. } => reason,
                other => panic!("{other:?}"),
            };
        let mut never_ran = JobWatch::new(LeaseId(1), JobId(7), false);
        assert_eq!(end(&mut never_ran, "CANCELLED"), EndReason::Failed);
        let mut ran = JobWatch::new(LeaseId(1), JobId(7), true);
        assert_eq!(end(&mut ran, "NODE_FAIL"), EndReason::Lost);
        let mut killed = JobWatch::new(LeaseId(1), JobId(7), true);
        assert_eq!(end(&mut killed, "PREEMPTED"), EndReason::Preempted);
        // preempted, drained and gone between two polls: notice, then end
        let mut quick = JobWatch::new(LeaseId(1), JobId(7), true);
        match quick.observe(Some(&info("COMPLETED", Some(4000))), 9000, NOTICE) {
            Step::Ended {
                reason,
                late_notice,
                ..
            } => {
                assert_eq!(reason, EndReason::Preempted);
                assert_eq!(late_notice, Some(34_000));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_missing_job_ends_only_after_two_polls() {
        let mut w = JobWatch::new(LeaseId(1), JobId(7), true);
        assert_eq!(w.observe(None, 0, NOTICE), Step::Nothing);
        assert_eq!(
            w.observe(Some(&info("RUNNING", None)), 0, NOTICE),
            Step::Nothing
        );
        assert_eq!(w.observe(None, 0, NOTICE), Step::Nothing);
        match w.observe(None, 0, NOTICE) {
            Step::Ended { reason, detail, .. } => {
                assert_eq!(reason, EndReason::Lost);
                assert!(detail.contains("no longer known"), "{detail}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_requeued_job_is_cancelled() {
        let mut w = JobWatch::new(LeaseId(1), JobId(7), false);
        assert_eq!(
            w.observe(Some(&info("RUNNING", None)), 0, NOTICE),
            Step::Nothing
        );
        assert_eq!(
            w.observe(Some(&info("PENDING", None)), 0, NOTICE),
            Step::CancelRequeued { late_notice: None }
        );
        // preempted and requeued between two polls: the notice comes late
        let mut w = JobWatch::new(LeaseId(1), JobId(7), true);
        assert_eq!(
            w.observe(Some(&info("PENDING", Some(4000))), 9000, NOTICE),
            Step::CancelRequeued {
                late_notice: Some(34_000)
            }
        );
    }

    #[test]
    fn a_requeued_job_is_cancelled_again_until_slurm_reports_it_ended() {
        let mut w = JobWatch::new(LeaseId(1), JobId(7), true);
        let late = Step::CancelRequeued {
            late_notice: Some(34_000),
        };
        let again = Step::CancelRequeued { late_notice: None };
        assert_eq!(
            w.observe(Some(&info("PENDING", Some(4000))), 9000, NOTICE),
            late
        );
        // the scancel failed: the next polls cancel again, the notice once
        assert_eq!(
            w.observe(Some(&info("PENDING", Some(4000))), 10_000, NOTICE),
            again
        );
        // Slurm started the requeued job meanwhile: still cancelled
        assert_eq!(
            w.observe(Some(&info("RUNNING", None)), 11_000, NOTICE),
            again
        );
        match w.observe(Some(&info("CANCELLED", None)), 12_000, NOTICE) {
            Step::Ended {
                reason,
                late_notice,
                ..
            } => {
                assert_eq!(reason, EndReason::Preempted);
                assert_eq!(late_notice, None);
            }
            other => panic!("{other:?}"),
        }
        // requeued after a node failure (no preemption), gone from squeue
        let mut w = JobWatch::new(LeaseId(1), JobId(7), true);
        assert_eq!(w.observe(Some(&info("PENDING", None)), 0, NOTICE), again);
        assert_eq!(w.observe(None, 0, NOTICE), Step::Nothing);
        match w.observe(None, 0, NOTICE) {
            Step::Ended { reason, .. } => assert_eq!(reason, EndReason::Preempted),
            other => panic!("{other:?}"),
        }
    }
}
