//! Worker health: a pure, clock-injected policy that takes a failing
//! worker out of dispatch.
//!
//! A worker that fails its frames (answers `failed`, or `shed`, which only
//! the gateway may assign) still looks idle and fast to the scheduler, so it
//! would keep taking its share of every model's frames and fail them all.
//! [`WorkerHealth`] watches each batch it returns and *demotes* it:
//!
//! - at once when a result is **short** (fewer answers than frames: a
//!   worker that drops frames is broken, whatever its reason) or
//!   **malformed** (an answer for a frame not in the batch, or two for one);
//! - when, over its last [`HealthPolicy::window`] frames and with at least
//!   [`HealthPolicy::min_samples`] of them, the share that failed reaches
//!   [`HealthPolicy::max_failure_permille`]; one bad frame never demotes.
//!   The scheduler asks for this only while another serving worker could
//!   take the model's frames (`spare`): when every worker fails, the frames
//!   (a hostile edge's) are the likelier cause, and demoting the last worker
//!   would turn failures into `no_worker` sheds without saving a frame.
//!
//! A demoted worker gets no batch for a back-off that doubles with every
//! demotion in a row ([`HealthPolicy::backoff_us`], capped at
//! [`HealthPolicy::max_backoff_us`]). Then it is sent one *probe* batch of
//! at most [`HealthPolicy::probe_frames`] frames at a time: a probe answered
//! in full and under the failure ratio restores it; any other answer demotes
//! it again, for the next, longer back-off. The run of demotions is
//! forgiven (the back-off starts from its base again) once a restored
//! worker has served a whole window without being demoted.
//!
//! Batches it held when it was demoted still finish (their frames end
//! once, as the scheduler decides), but their answers do not count: a
//! worker is judged once per fault.

use std::collections::VecDeque;
use std::fmt;

use serde::Deserialize;

use crate::scheduler::{BatchId, Micros};

/// The policy's tuning, in the scheduler's units. See the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthPolicy {
    /// Frames whose outcomes the failure ratio is taken over (the most
    /// recent).
    pub window: u32,
    /// Outcomes needed in the window before the ratio can demote: one
    /// failed frame of a fresh worker is not a failing worker.
    pub min_samples: u32,
    /// Failed frames per thousand in the window that demote the worker (a
    /// share at or above it); 1000 demotes only a worker that fails all.
    pub max_failure_permille: u32,
    /// Back-off after a first demotion (µs); it doubles with each demotion
    /// in a row.
    pub backoff_us: Micros,
    /// Longest back-off (µs).
    pub max_backoff_us: Micros,
    /// Most frames in a probe batch.
    pub probe_frames: u16,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        HealthSettings::default().policy()
    }
}

/// `[scheduler.health]`: the health policy's settings as the gateway's
/// config file states them.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthSettings {
    /// Frames whose outcomes the failure ratio is taken over.
    #[serde(default = "default_window")]
    pub window: u32,
    /// Outcomes needed before the ratio can demote a worker.
    #[serde(default = "default_min_samples")]
    pub min_samples: u32,
    /// Share of failed frames in the window (0 < ratio ≤ 1) that demotes.
    #[serde(default = "default_max_failure_ratio")]
    pub max_failure_ratio: f64,
    /// Back-off after a first demotion (ms); doubles per demotion in a row.
    #[serde(default = "default_backoff_ms")]
    pub backoff_ms: u32,
    /// Longest back-off (ms).
    #[serde(default = "default_max_backoff_ms")]
    pub max_backoff_ms: u32,
    /// Most frames in a probe batch.
    #[serde(default = "default_probe_frames")]
    pub probe_frames: u16,
}

/// A window of 32 frames: a few batches of a busy worker, long enough that
/// a burst of bad frames from one camera is diluted by the others'.
fn default_window() -> u32 {
    32
}
/// A quarter of the window.
fn default_min_samples() -> u32 {
    8
}
/// Failing half its frames: an honest worker under load sheds far fewer
/// (its queue is sized for the pipeline depth the gateway keeps).
fn default_max_failure_ratio() -> f64 {
    0.5
}
/// One second: a restart or a transient fault of the device clears in a
/// few, and a liar costs at most one probe per back-off.
fn default_backoff_ms() -> u32 {
    1000
}
/// One minute: a worker that stays broken is probed once a minute.
fn default_max_backoff_ms() -> u32 {
    60_000
}
/// One frame: a probe that fails costs one frame.
fn default_probe_frames() -> u16 {
    1
}

impl Default for HealthSettings {
    fn default() -> Self {
        HealthSettings {
            window: default_window(),
            min_samples: default_min_samples(),
            max_failure_ratio: default_max_failure_ratio(),
            backoff_ms: default_backoff_ms(),
            max_backoff_ms: default_max_backoff_ms(),
            probe_frames: default_probe_frames(),
        }
    }
}

impl HealthSettings {
    /// Why these settings cannot work, naming the key and what to use.
    pub fn validate(&self) -> Result<(), String> {
        if self.window == 0 || self.min_samples == 0 || self.min_samples > self.window {
            return Err(format!(
                "scheduler.health.min_samples = {} must be 1..=window ({})",
                self.min_samples, self.window
            ));
        }
        if !(self.max_failure_ratio > 0.0 && self.max_failure_ratio <= 1.0) {
            return Err(format!(
                "scheduler.health.max_failure_ratio = {} must be in (0, 1]",
                self.max_failure_ratio
            ));
        }
        if self.backoff_ms == 0 || self.max_backoff_ms < self.backoff_ms {
            return Err(format!(
                "scheduler.health.backoff_ms = {} must be at least 1 and at most max_backoff_ms ({})",
                self.backoff_ms, self.max_backoff_ms
            ));
        }
        if self.probe_frames == 0 {
            return Err("scheduler.health.probe_frames must be at least 1".into());
        }
        Ok(())
    }

    /// The policy these settings describe.
    pub fn policy(&self) -> HealthPolicy {
        HealthPolicy {
            window: self.window.max(1),
            min_samples: self.min_samples.max(1),
            max_failure_permille: (self.max_failure_ratio * 1000.0).round().clamp(1.0, 1000.0)
                as u32,
            backoff_us: Micros::from(self.backoff_ms.max(1)) * 1000,
            max_backoff_us: Micros::from(self.max_backoff_ms.max(self.backoff_ms).max(1)) * 1000,
            probe_frames: self.probe_frames.max(1),
        }
    }
}

/// How one returned batch went, frame by frame, as the scheduler matched
/// the answers to the frames it sent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    /// Frames answered `ok`.
    pub ok: u32,
    /// Frames answered otherwise (`failed`, or a status only the gateway
    /// may assign).
    pub failed: u32,
    /// Frames of the batch with no answer.
    pub missing: u32,
    /// Answers that match no frame of the batch (another frame's id, or a
    /// second answer for one).
    pub foreign: u32,
}

/// Why a worker was demoted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DemotionReason {
    /// A batch came back with frames unanswered.
    Short {
        /// Frames answered.
        answered: u32,
        /// Frames sent.
        sent: u32,
    },
    /// A batch came back with answers for frames it did not hold.
    Malformed {
        /// Such answers.
        foreign: u32,
    },
    /// Too many of its recent frames failed.
    FailureRatio {
        /// Failed frames in the window.
        failed: u32,
        /// Frames in the window.
        of: u32,
    },
}

impl DemotionReason {
    /// Snake-case name, for the `reason` label of
    /// `tidegate_worker_demotions_total`.
    pub fn label(&self) -> &'static str {
        match self {
            DemotionReason::Short { .. } => "short_result",
            DemotionReason::Malformed { .. } => "malformed_result",
            DemotionReason::FailureRatio { .. } => "failure_ratio",
        }
    }
}

impl fmt::Display for DemotionReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DemotionReason::Short { answered, sent } => {
                write!(f, "it answered {answered} of the {sent} frames of a batch")
            }
            DemotionReason::Malformed { foreign } => write!(
                f,
                "it answered {foreign} frame(s) that were not in the batch, or twice"
            ),
            DemotionReason::FailureRatio { failed, of } => {
                write!(f, "{failed} of its last {of} frames failed")
            }
        }
    }
}

/// What a returned batch changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// A serving worker is demoted: no batch for `backoff_us`, then probes.
    Demoted {
        /// Why.
        reason: DemotionReason,
        /// How long it gets no batch (µs).
        backoff_us: Micros,
    },
    /// A probe failed: the worker stays demoted, for a longer back-off.
    ProbeFailed {
        /// How the probe went wrong.
        reason: DemotionReason,
        /// How long it gets no batch now (µs).
        backoff_us: Micros,
    },
    /// A probe succeeded: the worker serves again.
    Restored,
}

/// What a worker may be sent now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Eligibility {
    /// Batches as usual.
    Full,
    /// One probe batch of at most this many frames.
    Probe(usize),
    /// Nothing (backing off, or its probe is out).
    None,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Serving,
    /// Demoted; no batch until then.
    BackingOff {
        until: Micros,
    },
    /// Demoted, back-off over: it may be sent one probe (`None`), or its
    /// probe is out.
    Probing {
        probe: Option<BatchId>,
    },
}

/// One worker's health. Starts serving.
#[derive(Debug, Clone)]
pub struct WorkerHealth {
    phase: Phase,
    /// The most recent outcomes, `true` for a failed frame.
    window: VecDeque<bool>,
    /// `true`s in `window`.
    failed: u32,
    /// Demotions in a row, not yet forgiven.
    strikes: u32,
    /// Frames served since it was last restored (or joined) without a
    /// demotion; a whole window of them forgives the strikes.
    proven: u32,
}

impl Default for WorkerHealth {
    fn default() -> Self {
        WorkerHealth::new()
    }
}

impl WorkerHealth {
    /// A healthy worker with no history.
    pub fn new() -> Self {
        WorkerHealth {
            phase: Phase::Serving,
            window: VecDeque::new(),
            failed: 0,
            strikes: 0,
            proven: 0,
        }
    }

    /// Ends a back-off that is over by `now`. The scheduler calls this on
    /// every event, so that what it reads afterwards is current.
    pub fn tick(&mut self, now: Micros) {
        if let Phase::BackingOff { until } = self.phase
            && until <= now
        {
            self.phase = Phase::Probing { probe: None };
        }
    }

    /// Whether it serves as usual (not demoted).
    pub fn serving(&self) -> bool {
        self.phase == Phase::Serving
    }

    /// Whether it is demoted (backing off or being probed).
    pub fn demoted(&self) -> bool {
        !self.serving()
    }

    /// Whether it could take a frame now or at its next probe: serving, or
    /// its back-off is over (as of the last [`WorkerHealth::tick`]).
    pub fn available(&self) -> bool {
        !matches!(self.phase, Phase::BackingOff { .. })
    }

    /// When its back-off ends, while it backs off.
    pub fn backoff_until(&self) -> Option<Micros> {
        match self.phase {
            Phase::BackingOff { until } => Some(until),
            _ => None,
        }
    }

    /// What it may be sent (as of the last [`WorkerHealth::tick`]).
    pub fn eligibility(&self, policy: &HealthPolicy) -> Eligibility {
        match self.phase {
            Phase::Serving => Eligibility::Full,
            Phase::Probing { probe: None } => Eligibility::Probe(usize::from(policy.probe_frames)),
            Phase::Probing { probe: Some(_) } | Phase::BackingOff { .. } => Eligibility::None,
        }
    }

    /// A batch was sent to it; while it is being probed, that batch is the
    /// probe.
    pub fn dispatched(&mut self, batch: BatchId) {
        if let Phase::Probing { probe: None } = self.phase {
            self.phase = Phase::Probing { probe: Some(batch) };
        }
    }

    /// Judges batch `batch`, returned at `now` with `tally`. `spare`: some
    /// other serving worker could take its model's frames, so the failure
    /// ratio may demote this one (a short or malformed answer demotes it
    /// regardless).
    pub fn finished(
        &mut self,
        now: Micros,
        policy: &HealthPolicy,
        batch: BatchId,
        tally: Tally,
        spare: bool,
    ) -> Option<Verdict> {
        match self.phase {
            Phase::Serving => {
                let reason = self.record(policy, tally, spare)?;
                Some(Verdict::Demoted {
                    reason,
                    backoff_us: self.demote(now, policy),
                })
            }
            Phase::Probing { probe: Some(p) } if p == batch => {
                let answered = tally.ok + tally.failed;
                let reason = if tally.missing > 0 {
                    Some(short(tally))
                } else if tally.foreign > 0 {
                    Some(DemotionReason::Malformed {
                        foreign: tally.foreign,
                    })
                } else if answered == 0 || failing(policy, tally.failed, answered) {
                    Some(DemotionReason::FailureRatio {
                        failed: tally.failed,
                        of: answered,
                    })
                } else {
                    None
                };
                match reason {
                    Some(reason) => Some(Verdict::ProbeFailed {
                        reason,
                        backoff_us: self.demote(now, policy),
                    }),
                    None => {
                        self.phase = Phase::Serving;
                        self.proven = 0;
                        Some(Verdict::Restored)
                    }
                }
            }
            // A batch it held when it was demoted, or one that raced the
            // probe: already judged.
            Phase::Probing { .. } | Phase::BackingOff { .. } => None,
        }
    }

    /// Adds a serving worker's batch to its window; why it must be
    /// demoted, if it must.
    fn record(
        &mut self,
        policy: &HealthPolicy,
        tally: Tally,
        spare: bool,
    ) -> Option<DemotionReason> {
        if tally.missing > 0 {
            return Some(short(tally));
        }
        if tally.foreign > 0 {
            return Some(DemotionReason::Malformed {
                foreign: tally.foreign,
            });
        }
        let outcomes = std::iter::repeat_n(false, tally.ok as usize)
            .chain(std::iter::repeat_n(true, tally.failed as usize));
        for failed in outcomes {
            self.window.push_back(failed);
            self.failed += u32::from(failed);
            if self.window.len() > policy.window as usize && self.window.pop_front() == Some(true) {
                self.failed -= 1;
            }
        }
        let of = self.window.len() as u32;
        if of >= policy.min_samples && failing(policy, self.failed, of) {
            if spare {
                return Some(DemotionReason::FailureRatio {
                    failed: self.failed,
                    of,
                });
            }
            return None;
        }
        self.proven = self.proven.saturating_add(tally.ok + tally.failed);
        if self.proven >= policy.window {
            self.strikes = 0;
        }
        None
    }

    /// Takes it out of dispatch for the next back-off; returns its length.
    fn demote(&mut self, now: Micros, policy: &HealthPolicy) -> Micros {
        self.strikes = self.strikes.saturating_add(1);
        // The client kit's doubling, without jitter: the gateway's clock
        // decides, and one worker's back-off is no crowd.
        let backoff = tidegate_kit::backoff::step(
            std::time::Duration::from_micros(policy.backoff_us),
            std::time::Duration::from_micros(policy.max_backoff_us),
            self.strikes.saturating_sub(1),
        );
        let backoff = Micros::try_from(backoff.as_micros()).unwrap_or(Micros::MAX);
        self.phase = Phase::BackingOff {
            until: now.saturating_add(backoff),
        };
        self.window.clear();
        self.failed = 0;
        self.proven = 0;
        backoff
    }
}

/// Whether `failed` of `of` frames reach the policy's failure share.
fn failing(policy: &HealthPolicy, failed: u32, of: u32) -> bool {
    u64::from(failed) * 1000 >= u64::from(policy.max_failure_permille) * u64::from(of)
}

fn short(tally: Tally) -> DemotionReason {
    DemotionReason::Short {
        answered: tally.ok + tally.failed,
        sent: tally.ok + tally.failed + tally.missing,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn policy() -> HealthPolicy {
        HealthPolicy {
            window: 10,
            min_samples: 4,
            max_failure_permille: 500,
            backoff_us: 1_000_000,
            max_backoff_us: 4_000_000,
            probe_frames: 1,
        }
    }

    fn tally(ok: u32, failed: u32) -> Tally {
        Tally {
            ok,
            failed,
            ..Tally::default()
        }
    }

    /// Feeds batches of `ok`/`failed` to a serving worker at time 0.
    fn feed(h: &mut WorkerHealth, batches: &[(u32, u32)]) -> Option<Verdict> {
        let mut last = None;
        for (i, (ok, failed)) in batches.iter().enumerate() {
            last = h.finished(0, &policy(), BatchId(i as u64), tally(*ok, *failed), true);
        }
        last
    }

    /// Probes `h` at `now` with batch `b`, answered with `t`.
    fn probe(h: &mut WorkerHealth, now: Micros, b: u64, t: Tally) -> Option<Verdict> {
        h.tick(now);
        assert_eq!(h.eligibility(&policy()), Eligibility::Probe(1));
        h.dispatched(BatchId(b));
        assert_eq!(
            h.eligibility(&policy()),
            Eligibility::None,
            "one probe at a time"
        );
        h.finished(now, &policy(), BatchId(b), t, true)
    }

    #[test]
    fn one_failed_frame_does_not_demote_a_fresh_worker() {
        let mut h = WorkerHealth::new();
        assert_eq!(feed(&mut h, &[(0, 1)]), None);
        assert!(h.serving());
        // nor does a failure share under the threshold once enough is seen
        assert_eq!(feed(&mut h, &[(3, 0), (2, 1), (4, 0)]), None);
        assert_eq!(h.eligibility(&policy()), Eligibility::Full);
    }

    #[test]
    fn failing_half_the_window_demotes_once_enough_frames_are_seen() {
        let mut h = WorkerHealth::new();
        assert_eq!(feed(&mut h, &[(1, 1)]), None, "2 samples: too few");
        assert_eq!(
            feed(&mut h, &[(1, 1)]),
            Some(Verdict::Demoted {
                reason: DemotionReason::FailureRatio { failed: 2, of: 4 },
                backoff_us: 1_000_000
            })
        );
        assert!(h.demoted());
        assert_eq!(h.eligibility(&policy()), Eligibility::None);
    }

    #[test]
    fn a_short_or_malformed_result_demotes_at_once() {
        let mut h = WorkerHealth::new();
        let short = Tally {
            ok: 2,
            missing: 2,
            ..Tally::default()
        };
        let v = h.finished(0, &policy(), BatchId(1), short, false);
        assert_eq!(
            v,
            Some(Verdict::Demoted {
                reason: DemotionReason::Short {
                    answered: 2,
                    sent: 4
                },
                backoff_us: 1_000_000
            }),
            "even as the last worker of its model"
        );
        let mut h = WorkerHealth::new();
        let foreign = Tally {
            ok: 1,
            foreign: 1,
            ..Tally::default()
        };
        let v = h.finished(0, &policy(), BatchId(1), foreign, false);
        assert!(
            matches!(
                v,
                Some(Verdict::Demoted {
                    reason: DemotionReason::Malformed { foreign: 1 },
                    ..
                })
            ),
            "{v:?}"
        );
    }

    #[test]
    fn the_last_serving_worker_is_not_demoted_for_its_failure_ratio() {
        let mut h = WorkerHealth::new();
        for b in 0..10 {
            assert_eq!(
                h.finished(0, &policy(), BatchId(b), tally(0, 4), false),
                None
            );
        }
        assert!(h.serving());
        // once another worker serves, it is
        assert!(matches!(
            h.finished(0, &policy(), BatchId(10), tally(0, 1), true),
            Some(Verdict::Demoted { .. })
        ));
    }

    #[test]
    fn after_its_backoff_a_demoted_worker_gets_one_probe_and_comes_back_only_if_it_succeeds() {
        let mut h = WorkerHealth::new();
        feed(&mut h, &[(0, 4)]);
        assert_eq!(h.backoff_until(), Some(1_000_000));
        h.tick(999_999);
        assert_eq!(
            h.eligibility(&policy()),
            Eligibility::None,
            "still backing off"
        );
        // a batch it held when it was demoted changes nothing
        assert_eq!(
            h.finished(999_999, &policy(), BatchId(0), tally(0, 4), true),
            None
        );
        // failed probe: demoted again for twice as long
        assert_eq!(
            probe(&mut h, 1_000_000, 7, tally(0, 1)),
            Some(Verdict::ProbeFailed {
                reason: DemotionReason::FailureRatio { failed: 1, of: 1 },
                backoff_us: 2_000_000
            })
        );
        assert_eq!(h.backoff_until(), Some(3_000_000));
        // a probe answered with nothing at all fails too
        let v = probe(
            &mut h,
            3_000_000,
            8,
            Tally {
                missing: 1,
                ..Tally::default()
            },
        );
        assert!(
            matches!(
                v,
                Some(Verdict::ProbeFailed {
                    backoff_us: 4_000_000,
                    ..
                })
            ),
            "{v:?}"
        );
        // capped
        let v = probe(&mut h, 7_000_000, 9, tally(0, 1));
        assert!(
            matches!(
                v,
                Some(Verdict::ProbeFailed {
                    backoff_us: 4_000_000,
                    ..
                })
            ),
            "{v:?}"
        );
        // a good probe restores it
        assert_eq!(
            probe(&mut h, 11_000_000, 10, tally(1, 0)),
            Some(Verdict::Restored)
        );
        assert_eq!(h.eligibility(&policy()), Eligibility::Full);
    }

    #[test]
    fn strikes_are_forgiven_after_a_whole_window_served_well() {
        let mut h = WorkerHealth::new();
        feed(&mut h, &[(0, 4)]);
        assert_eq!(
            probe(&mut h, 1_000_000, 1, tally(1, 0)),
            Some(Verdict::Restored)
        );
        // demoted again soon: the back-off doubles
        let v = h.finished(
            1_000_000,
            &policy(),
            BatchId(2),
            Tally {
                missing: 1,
                ..Tally::default()
            },
            true,
        );
        assert!(
            matches!(
                v,
                Some(Verdict::Demoted {
                    backoff_us: 2_000_000,
                    ..
                })
            ),
            "{v:?}"
        );
        assert_eq!(
            probe(&mut h, 3_000_000, 3, tally(1, 0)),
            Some(Verdict::Restored)
        );
        // a window of good frames, then a fault: back to the base back-off
        for b in 4..9 {
            assert_eq!(
                h.finished(3_000_000, &policy(), BatchId(b), tally(2, 0), true),
                None
            );
        }
        let v = h.finished(
            3_000_000,
            &policy(),
            BatchId(9),
            Tally {
                missing: 1,
                ..Tally::default()
            },
            true,
        );
        assert!(
            matches!(
                v,
                Some(Verdict::Demoted {
                    backoff_us: 1_000_000,
                    ..
                })
            ),
            "{v:?}"
        );
    }

    #[test]
    fn settings_are_checked_and_converted() {
        let s = HealthSettings::default();
        s.validate().unwrap();
        let p = s.policy();
        assert_eq!(p, HealthPolicy::default());
        assert_eq!((p.max_failure_permille, p.backoff_us), (500, 1_000_000));
        for bad in [
            HealthSettings {
                min_samples: 64,
                ..s.clone()
            },
            HealthSettings {
                max_failure_ratio: 0.0,
                ..s.clone()
            },
            HealthSettings {
                max_failure_ratio: f64::NAN,
                ..s.clone()
            },
            HealthSettings {
                max_backoff_ms: 10,
                ..s.clone()
            },
            HealthSettings {
                probe_frames: 0,
                ..s.clone()
            },
        ] {
            let e = bad.validate().unwrap_err();
            assert!(e.starts_with("scheduler.health."), "{e}");
        }
    }

    /// One step of a random history: a batch returned, or time passing.
    #[derive(Debug, Clone)]
    enum Step {
        Batch {
            ok: u32,
            failed: u32,
            missing: u32,
            foreign: u32,
            spare: bool,
        },
        Advance(Micros),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (0u32..5, 0u32..5, 0u32..2, 0u32..2, any::<bool>()).prop_map(
                |(ok, failed, missing, foreign, spare)| Step::Batch { ok, failed, missing, foreign, spare }
            ),
            1 => (0u64..5_000_000).prop_map(Step::Advance),
        ]
    }

    proptest! {
        /// Over any history: a demoted worker gets nothing while it backs
        /// off and at most one probe of `probe_frames` after; back-offs stay
        /// within their bounds; only a successful probe restores; and a
        /// worker that only ever answers in full and `ok` is never demoted.
        #[test]
        fn demotion_backoff_and_probes_hold_their_bounds(
            steps in prop::collection::vec(step(), 1..200),
        ) {
            let p = policy();
            let mut h = WorkerHealth::new();
            let mut now = 0;
            let mut next = 0u64;
            let mut honest = true;
            for st in steps {
                h.tick(now);
                match st {
                    Step::Advance(us) => now += us,
                    Step::Batch { ok, failed, missing, foreign, spare } => {
                        let t = Tally { ok, failed, missing, foreign };
                        if ok + failed + missing == 0 {
                            continue;
                        }
                        let was_probe = match h.eligibility(&p) {
                            Eligibility::Full => false,
                            Eligibility::Probe(n) => {
                                prop_assert_eq!(n, 1);
                                true
                            }
                            Eligibility::None => {
                                prop_assert!(h.demoted());
                                if let Some(until) = h.backoff_until() {
                                    prop_assert!(until > now, "a back-off over is not ended");
                                }
                                continue;
                            }
                        };
                        honest &= failed + missing + foreign == 0;
                        let b = BatchId(next);
                        next += 1;
                        h.dispatched(b);
                        let v = h.finished(now, &p, b, t, spare);
                        match v {
                            Some(Verdict::Demoted { backoff_us, .. }) => {
                                prop_assert!(!was_probe);
                                prop_assert!((p.backoff_us..=p.max_backoff_us).contains(&backoff_us));
                                prop_assert_eq!(h.backoff_until(), Some(now + backoff_us));
                            }
                            Some(Verdict::ProbeFailed { backoff_us, .. }) => {
                                prop_assert!(was_probe);
                                prop_assert!((p.backoff_us..=p.max_backoff_us).contains(&backoff_us));
                            }
                            Some(Verdict::Restored) => {
                                prop_assert!(was_probe);
                                prop_assert!(missing + foreign == 0 && ok > failed);
                                prop_assert!(h.serving());
                            }
                            None => prop_assert_eq!(was_probe, false, "a probe is always judged"),
                        }
                        prop_assert!(!honest || h.serving(), "an honest worker was demoted");
                    }
                }
            }
        }
    }
}
