//! What a worker Pod's state means for its lease. Pure: a Pod (as the
//! watch last saw it) and `now` in, a [`Step`] out.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::billing::Millis;
use crate::lifecycle::EndReason;
use crate::table::LeaseId;

/// Container waiting reasons that no retry fixes: the lease fails at once
/// instead of waiting out the start timeout.
const FATAL_WAITING: &[&str] = &["InvalidImageName", "ErrImageNeverPull"];

/// The parts of a Pod the provider acts on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodView {
    /// `metadata.name`.
    pub name: String,
    /// `metadata.uid`: a Pod deleted and created again under the same name
    /// is another Pod.
    pub uid: String,
    /// `status.phase` (`Pending`, `Running`, `Succeeded`, `Failed`,
    /// `Unknown`).
    pub phase: String,
    /// `metadata.deletionTimestamp`: the Pod is being deleted and will be
    /// killed at this time (ms since epoch).
    pub deleting_at: Option<Millis>,
    /// The `DisruptionTarget` condition (Kubernetes 1.26+): why the Pod is
    /// about to go (`PreemptionByScheduler`, `DeletionByTaintManager`,
    /// `EvictionByEvictionAPI`, `TerminationByKubelet`, …) and its message.
    pub disruption: Option<(String, String)>,
    /// `status.reason` (`Evicted` after a node-pressure eviction).
    pub status_reason: Option<String>,
    /// The worker container is waiting: reason and message.
    pub waiting: Option<(String, String)>,
    /// The worker container ended: exit code and reason.
    pub terminated: Option<(i32, String)>,
    /// When the worker container ended (ms since epoch).
    pub finished_at: Option<Millis>,
    /// The worker container has started (it runs, or it ended after a
    /// start): an end is then a loss, even if no event showed it running.
    pub started: bool,
    /// The scheduler cannot place the Pod: its message.
    pub unschedulable: Option<String>,
}

fn ms(t: &Time) -> Millis {
    Millis::try_from(t.0.as_millisecond()).unwrap_or(0)
}

impl PodView {
    /// Reads the fields the provider acts on.
    pub fn of(pod: &Pod) -> PodView {
        let meta = &pod.metadata;
        let status = pod.status.as_ref();
        let conditions = status.and_then(|s| s.conditions.as_deref()).unwrap_or(&[]);
        let disruption = conditions
            .iter()
            .find(|c| c.type_ == "DisruptionTarget" && c.status == "True")
            .map(|c| {
                (
                    c.reason.clone().unwrap_or_default(),
                    c.message.clone().unwrap_or_default(),
                )
            });
        let unschedulable = conditions
            .iter()
            .find(|c| {
                c.type_ == "PodScheduled"
                    && c.status == "False"
                    && c.reason.as_deref() == Some("Unschedulable")
            })
            .map(|c| c.message.clone().unwrap_or_default());
        let container = status
            .and_then(|s| s.container_statuses.as_deref())
            .and_then(|cs| cs.iter().find(|c| c.name == super::config::CONTAINER));
        let state = container.and_then(|c| c.state.as_ref());
        PodView {
            name: meta.name.clone().unwrap_or_default(),
            uid: meta.uid.clone().unwrap_or_default(),
            phase: status
                .and_then(|s| s.phase.clone())
                .unwrap_or_else(|| "Pending".into()),
            deleting_at: meta.deletion_timestamp.as_ref().map(ms),
            disruption,
            status_reason: status.and_then(|s| s.reason.clone()),
            waiting: state.and_then(|s| s.waiting.as_ref()).map(|w| {
                (
                    w.reason.clone().unwrap_or_default(),
                    w.message.clone().unwrap_or_default(),
                )
            }),
            terminated: state
                .and_then(|s| s.terminated.as_ref())
                .map(|t| (t.exit_code, t.reason.clone().unwrap_or_default())),
            finished_at: state
                .and_then(|s| s.terminated.as_ref())
                .and_then(|t| t.finished_at.as_ref())
                .map(ms),
            started: state.is_some_and(|s| {
                s.running.is_some()
                    || s.terminated
                        .as_ref()
                        .is_some_and(|t| t.started_at.is_some())
            }),
            unschedulable,
        }
    }

    /// Has the Pod run to its end?
    pub fn is_terminal(&self) -> bool {
        self.phase == "Succeeded" || self.phase == "Failed"
    }

    /// When the Pod's worker stopped running, as far as the Pod says, no
    /// later than `now`: its container's end, or for a Pod being deleted
    /// the time it is killed; `now` when the Pod says neither. A lease
    /// found ended after a gateway restart is billed to this, not to the
    /// restart.
    pub fn ended_at(&self, now: Millis) -> Millis {
        self.finished_at
            .or(self.deleting_at)
            .map_or(now, |t| t.min(now))
    }

    /// Is Kubernetes taking the Pod away (not at our request: the watch of
    /// a lease being released ignores this)?
    pub fn is_disrupted(&self) -> bool {
        self.deleting_at.is_some()
            || self.disruption.is_some()
            || self.status_reason.as_deref() == Some("Evicted")
    }

    fn why(&self) -> String {
        if let Some((reason, message)) = &self.disruption {
            return format!("{reason}: {message}");
        }
        if let Some(r) = &self.status_reason {
            return r.clone();
        }
        "deleted".into()
    }
}

/// What the provider knows of one held Pod between events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodWatch {
    /// The lease.
    pub lease: LeaseId,
    /// Its Pod.
    pub pod: String,
    /// The Pod's uid (from its creation).
    pub uid: String,
    /// It was seen running (so an end is a loss, not a failed start).
    pub ran: bool,
    /// Its preemption notice was sent.
    pub noticed: bool,
    /// The last waiting or unschedulable reason logged, so each is logged
    /// once.
    pub last_wait: Option<String>,
}

/// What one observation means for a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Nothing new.
    Nothing,
    /// The Pod cannot start yet: log it (once per reason); the gateway's
    /// start timeout ends the lease if it never does.
    Waiting {
        /// Reason and message, for the log.
        detail: String,
    },
    /// Send the spot notice: Kubernetes is taking the Pod.
    Notice {
        /// When its worker will be killed (ms since epoch).
        deadline: Millis,
    },
    /// The lease ended. When `delete` is set the Pod object is still there
    /// (a finished Pod, or one that can never start) and the provider
    /// deletes it.
    Ended {
        /// Why, for the ledger.
        reason: EndReason,
        /// For logs.
        detail: String,
        /// The notice to send first, when Kubernetes took the Pod before
        /// any observation showed it coming.
        late_notice: Option<Millis>,
        /// Delete the Pod object.
        delete: bool,
    },
}

impl PodWatch {
    /// A Pod just created (`ran = false`) or adopted.
    pub fn new(lease: LeaseId, pod: &PodView, ran: bool) -> PodWatch {
        PodWatch {
            lease,
            pod: pod.name.clone(),
            uid: pod.uid.clone(),
            ran,
            noticed: false,
            last_wait: None,
        }
    }

    /// Folds one observation of the Pod (`None`: it is gone) into the
    /// watch. `grace_ms` is the Pod's grace period, the notice a Pod
    /// disrupted without a deletion time gets. The watch loop asks only
    /// while the Pod's end can be news: not while we delete it (release).
    pub fn observe(&mut self, pod: Option<&PodView>, now: Millis, grace_ms: Millis) -> Step {
        let pod = pod.filter(|p| p.uid == self.uid);
        let Some(pod) = pod else {
            let disrupted = self.noticed;
            return Step::Ended {
                reason: self.end_reason(disrupted),
                detail: format!("pod {} was deleted", self.pod),
                late_notice: None,
                delete: false,
            };
        };
        if pod.started {
            self.ran = true;
        }
        let disrupted = pod.is_disrupted();
        let deadline = pod
            .deleting_at
            .unwrap_or_else(|| now.saturating_add(grace_ms));
        let late_notice = (disrupted && !self.noticed).then_some(deadline);
        if pod.is_terminal() {
            let exit = match &pod.terminated {
                Some((code, reason)) => format!(": worker exited {code} ({reason})"),
                None => String::new(),
            };
            let why = if disrupted {
                format!(" after {}", pod.why())
            } else {
                String::new()
            };
            return Step::Ended {
                reason: self.end_reason(disrupted),
                detail: format!("pod {} {}{exit}{why}", self.pod, pod.phase),
                late_notice,
                delete: true,
            };
        }
        if disrupted {
            if self.noticed {
                return Step::Nothing;
            }
            self.noticed = true;
            return Step::Notice { deadline };
        }
        if pod.phase == "Running" {
            self.ran = true;
            self.last_wait = None;
            return Step::Nothing;
        }
        if let Some((reason, message)) = &pod.waiting
            && FATAL_WAITING.contains(&reason.as_str())
        {
            return Step::Ended {
                reason: EndReason::Failed,
                detail: format!("pod {} cannot start: {reason}: {message}", self.pod),
                late_notice: None,
                delete: true,
            };
        }
        let wait = match (&pod.waiting, &pod.unschedulable) {
            (Some((reason, message)), _) if reason != "ContainerCreating" => {
                Some(format!("{reason}: {message}"))
            }
            (_, Some(message)) => Some(format!("Unschedulable: {message}")),
            _ => None,
        };
        match wait {
            Some(w) if self.last_wait.as_deref() != Some(w.as_str()) => {
                self.last_wait = Some(w.clone());
                Step::Waiting { detail: w }
            }
            _ => Step::Nothing,
        }
    }

    fn end_reason(&self, disrupted: bool) -> EndReason {
        if disrupted || self.noticed {
            EndReason::Preempted
        } else if self.ran {
            EndReason::Lost
        } else {
            EndReason::Failed
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(phase: &str) -> PodView {
        PodView {
            name: "tidegate-worker-7".into(),
            uid: "u-7".into(),
            phase: phase.into(),
            ..PodView::default()
        }
    }

    const GRACE: Millis = 30_000;

    fn watch() -> PodWatch {
        PodWatch::new(LeaseId(7), &view("Pending"), false)
    }

    #[test]
    fn a_pod_that_runs_then_crashes_is_lost_and_its_object_deleted() {
        let mut w = watch();
        assert_eq!(w.observe(Some(&view("Pending")), 0, GRACE), Step::Nothing);
        assert_eq!(w.observe(Some(&view("Running")), 1, GRACE), Step::Nothing);
        assert!(w.ran);
        let mut failed = view("Failed");
        failed.terminated = Some((137, "Error".into()));
        match w.observe(Some(&failed), 2, GRACE) {
            Step::Ended {
                reason,
                detail,
                late_notice,
                delete,
            } => {
                assert_eq!(reason, EndReason::Lost);
                assert!(detail.contains("exited 137"), "{detail}");
                assert_eq!(late_notice, None);
                assert!(delete);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_container_that_started_then_ended_between_two_events_is_a_loss() {
        let mut w = watch();
        let mut failed = view("Failed");
        failed.terminated = Some((1, "Error".into()));
        failed.started = true;
        assert!(matches!(
            w.observe(Some(&failed), 0, GRACE),
            Step::Ended {
                reason: EndReason::Lost,
                ..
            }
        ));
        let mut w = watch();
        failed.started = false;
        assert!(matches!(
            w.observe(Some(&failed), 0, GRACE),
            Step::Ended {
                reason: EndReason::Failed,
                ..
            }
        ));
    }

    #[test]
    fn a_pod_that_never_ran_failed() {
        let mut w = watch();
        match w.observe(None, 5, GRACE) {
            Step::Ended { reason, delete, .. } => {
                assert_eq!(reason, EndReason::Failed);
                assert!(!delete);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_eviction_is_a_notice_with_the_deletion_deadline_then_a_preemption() {
        let mut w = watch();
        w.observe(Some(&view("Running")), 0, GRACE);
        let mut evicted = view("Running");
        evicted.disruption = Some(("DeletionByTaintManager".into(), "spot reclaim".into()));
        evicted.deleting_at = Some(45_000);
        assert_eq!(
            w.observe(Some(&evicted), 10_000, GRACE),
            Step::Notice { deadline: 45_000 }
        );
        // only once
        assert_eq!(w.observe(Some(&evicted), 11_000, GRACE), Step::Nothing);
        match w.observe(None, 20_000, GRACE) {
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
    }

    #[test]
    fn a_disruption_condition_without_a_deletion_gets_the_grace_period() {
        let mut w = watch();
        let mut p = view("Running");
        p.disruption = Some(("PreemptionByScheduler".into(), String::new()));
        assert_eq!(
            w.observe(Some(&p), 1_000, GRACE),
            Step::Notice { deadline: 31_000 }
        );
    }

    #[test]
    fn a_pod_evicted_and_finished_between_two_events_still_gets_its_notice_first() {
        let mut w = watch();
        w.observe(Some(&view("Running")), 0, GRACE);
        let mut p = view("Failed");
        p.status_reason = Some("Evicted".into());
        match w.observe(Some(&p), 5_000, GRACE) {
            Step::Ended {
                reason,
                late_notice,
                detail,
                delete,
            } => {
                assert_eq!(reason, EndReason::Preempted);
                assert_eq!(late_notice, Some(35_000));
                assert!(detail.contains("Evicted"), "{detail}");
                assert!(delete);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn another_pod_under_the_same_name_means_ours_is_gone() {
        let mut w = watch();
        w.observe(Some(&view("Running")), 0, GRACE);
        let mut other = view("Running");
        other.uid = "u-other".into();
        assert!(matches!(
            w.observe(Some(&other), 1, GRACE),
            Step::Ended {
                reason: EndReason::Lost,
                ..
            }
        ));
    }

    #[test]
    fn waiting_reasons_are_told_once_and_a_bad_image_name_fails_at_once() {
        let mut w = watch();
        let mut p = view("Pending");
        p.unschedulable = Some("0/3 nodes are available: 3 Insufficient nvidia.com/gpu.".into());
        assert!(
            matches!(w.observe(Some(&p), 0, GRACE), Step::Waiting { detail } if detail.contains("Insufficient"))
        );
        assert_eq!(w.observe(Some(&p), 1, GRACE), Step::Nothing);
        p.unschedulable = None;
        p.waiting = Some(("ImagePullBackOff".into(), "back-off pulling".into()));
        assert!(matches!(
            w.observe(Some(&p), 2, GRACE),
            Step::Waiting { .. }
        ));
        p.waiting = Some(("ContainerCreating".into(), String::new()));
        assert_eq!(w.observe(Some(&p), 3, GRACE), Step::Nothing);
        p.waiting = Some(("InvalidImageName".into(), "bad ref".into()));
        assert!(matches!(
            w.observe(Some(&p), 4, GRACE),
            Step::Ended {
                reason: EndReason::Failed,
                delete: true,
                ..
            }
        ));
    }

    #[test]
    fn a_pod_object_reads_into_a_view() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "tidegate-worker-3", "uid": "abc",
                "deletionTimestamp": "2026-12-03T10:00:30Z"
            },
            "status": {
                "phase": "Running",
                "conditions": [
                    {"type": "DisruptionTarget", "status": "True",
                     "reason": "EvictionByEvictionAPI", "message": "Eviction API: evicting"},
                    {"type": "Ready", "status": "True"}
                ],
                "containerStatuses": [{
                    "name": "worker", "ready": true, "restartCount": 0,
                    "image": "w", "imageID": "",
                    "state": {"running": {"startedAt": "2026-12-03T10:00:00Z"}}
                }]
            }
        }))
        .unwrap();
        let v = PodView::of(&pod);
        assert_eq!(v.name, "tidegate-worker-3");
        assert_eq!(v.uid, "abc");
        assert_eq!(v.phase, "Running");
        assert_eq!(v.deleting_at, Some(1_796_292_030_000));
        assert_eq!(v.disruption.as_ref().unwrap().0, "EvictionByEvictionAPI");
        assert!(v.is_disrupted());
        assert_eq!(v.waiting, None);
        assert!(v.started);
        assert!(!v.is_terminal());
        assert_eq!(v.finished_at, None);
        assert_eq!(
            v.ended_at(1_796_292_040_000),
            1_796_292_030_000,
            "killed then"
        );
        assert_eq!(
            v.ended_at(1_796_292_020_000),
            1_796_292_020_000,
            "never after now"
        );
    }

    #[test]
    fn a_finished_pod_ended_when_its_container_finished() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "tidegate-worker-4", "uid": "def"},
            "status": {
                "phase": "Failed",
                "containerStatuses": [{
                    "name": "worker", "ready": false, "restartCount": 0,
                    "image": "w", "imageID": "",
                    "state": {"terminated": {
                        "exitCode": 3, "reason": "Error",
                        "startedAt": "2026-12-03T10:00:00Z",
                        "finishedAt": "2026-12-03T10:20:00Z"
                    }}
                }]
            }
        }))
        .unwrap();
        let v = PodView::of(&pod);
        assert!(v.is_terminal());
        assert_eq!(v.terminated, Some((3, "Error".into())));
        assert_eq!(v.finished_at, Some(1_796_292_000_000 + 20 * 60_000));
        assert_eq!(v.ended_at(1_796_300_000_000), 1_796_293_200_000);
        // a Pod that says nothing of its end: now
        assert_eq!(PodView::default().ended_at(5), 5);
    }
}
