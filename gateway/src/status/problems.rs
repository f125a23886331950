//! The banner: what it flags, in what order, and the thresholds past which
//! it does.

use serde::Serialize;
use utoipa::ToSchema;

use super::page_model::StatusModel;

/// Shed share of the frames that ended in the last minute above which the
/// banner flags shedding: past 5 %, cameras lose frames an operator should
/// hear about (the SLO is 99 % ok).
pub const SHED_ALERT_RATIO: f64 = 0.05;

/// Frames that must have ended in the last minute before the shed share is
/// judged: a few frames of a camera that just opened are not a trend.
pub const SHED_ALERT_MIN_FRAMES: u64 = 20;

/// Share of `leasing.spend_cap_per_hour` that the live leases' summed
/// hourly price must reach to be flagged (the `TidegateSpendNearCap`
/// alert's 90 %).
pub const SPEND_ALERT_RATIO: f64 = 0.9;

/// How long a worker dropped as stalled stays on the banner (ms).
pub const STALL_SHOWN_MS: u64 = 5 * 60 * 1000;

/// Something the banner at the top of the page flags.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Problem {
    /// `shedding`, `worker_demoted`, `worker_stalled`, `spend_near_cap` or
    /// `no_worker`.
    #[schema(value_type = String)]
    pub kind: &'static str,
    /// What is wrong, for an operator.
    pub message: String,
}

/// What the banner flags, in the order it shows them.
pub fn problems(m: &StatusModel) -> Vec<Problem> {
    let mut out = Vec::new();
    let f = &m.window.frames;
    if let Some(ratio) = m.window.shed_ratio
        && f.ended() >= SHED_ALERT_MIN_FRAMES
        && ratio > SHED_ALERT_RATIO
    {
        out.push(Problem {
            kind: "shedding",
            message: format!(
                "{:.1} % of frames shed over the last {:.0} s ({} of {}); over {:.0} % is flagged",
                ratio * 100.0,
                m.window.length_s,
                f.shed,
                f.ended(),
                SHED_ALERT_RATIO * 100.0
            ),
        });
    }
    let mut demoted: Vec<&str> = m
        .workers
        .iter()
        .filter(|w| w.state == "demoted")
        .map(|w| w.name.as_str())
        .collect();
    demoted.dedup();
    for name in demoted {
        out.push(Problem {
            kind: "worker_demoted",
            message: format!("worker {name} is demoted for failing its frames: it gets only probe batches until one succeeds"),
        });
    }
    for s in m
        .stalls
        .iter()
        .filter(|s| m.generated_at.0.saturating_sub(s.stalled_at.0) <= STALL_SHOWN_MS)
    {
        out.push(Problem {
            kind: "worker_stalled",
            message: format!("worker {} was dropped as stalled: {}", s.worker, s.reason),
        });
    }
    if let Some(l) = &m.leasing
        && let Some(cap) = l.spend_cap_per_hour
        && cap > 0.0
        && l.spend_per_hour >= SPEND_ALERT_RATIO * cap
    {
        out.push(Problem {
            kind: "spend_near_cap",
            message: format!(
                "live leases cost {:.2} {cur}/h, {:.0} % of the {:.2} {cur}/h cap: the autoscaler cannot add capacity past it",
                l.spend_per_hour,
                l.spend_per_hour / cap * 100.0,
                cap,
                cur = l.currency
            ),
        });
    }
    for model in m.models.iter().filter(|r| r.workers == 0 && r.cameras > 0) {
        out.push(Problem {
            kind: "no_worker",
            message: format!(
                "no worker serves model {} for its {} open camera(s): their frames are shed",
                model.name, model.cameras
            ),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::build;
    use crate::status::fixtures::{NOW, camera, counts, snapshot, worker};
    use crate::timeline::Stall;

    #[test]
    fn light_load_flags_nothing() {
        // 1 of 60 shed at the door: 1/780 overall, far under 5 %
        let m = build(&snapshot(1), None, NOW);
        assert_eq!(m.problems, Vec::new());
    }

    #[test]
    fn shedding_is_flagged_above_five_percent_of_enough_frames() {
        // 39 of 780 is exactly 5 %: not flagged; 40 is
        assert!(build(&snapshot(39), None, NOW).problems.is_empty());
        let m = build(&snapshot(40), None, NOW);
        assert_eq!(m.problems.len(), 1, "{:?}", m.problems);
        assert_eq!(m.problems[0].kind, "shedding");
        assert!(
            m.problems[0]
                .message
                .starts_with("5.1 % of frames shed over the last 60 s (40 of 780)"),
            "{:?}",
            m.problems
        );
        // too few frames to judge: 3 of 10 shed is not flagged
        let mut few = snapshot(0);
        few.timeline.recent.frames = counts(10, 7, 3);
        few.timeline.recent.shed_ratio = few.timeline.recent.frames.shed_ratio();
        assert!(build(&few, None, NOW).problems.is_empty());
    }

    #[test]
    fn demoted_and_recently_stalled_workers_and_models_without_workers_are_flagged() {
        let mut s = snapshot(0);
        s.workers.push(worker(4, "w-2", true));
        s.timeline.stalls = vec![
            Stall {
                at_ms: NOW - STALL_SHOWN_MS - 1,
                worker: "old".into(),
                reason: "long ago".into(),
            },
            Stall {
                at_ms: NOW - 60_000,
                worker: "w-9".into(),
                reason: "batch 7 unanswered".into(),
            },
        ];
        s.cameras.push(camera(1, "lobby", "<b>cam</b>", "yolo"));
        let m = build(&s, None, NOW);
        let kinds: Vec<&str> = m.problems.iter().map(|p| p.kind).collect();
        assert_eq!(
            kinds,
            ["worker_demoted", "worker_stalled", "no_worker"],
            "{:?}",
            m.problems
        );
        assert!(m.problems[0].message.contains("w-2"));
        assert!(
            m.problems[1]
                .message
                .contains("w-9 was dropped as stalled: batch 7 unanswered")
        );
        assert_eq!(
            m.problems[2].message,
            "no worker serves model yolo for its 1 open camera(s): their frames are shed"
        );
        let yolo = m.models.iter().find(|r| r.name == "yolo").unwrap();
        assert_eq!((yolo.version, yolo.workers, yolo.cameras), (None, 0, 1));
    }
}
