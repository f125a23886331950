//! The workers panel: a row per registered worker and model it serves,
//! its batch times against its profile, and the workers dropped as stalled.

use serde::Serialize;
use utoipa::ToSchema;

use crate::hub::{Snapshot, WorkerView};

use super::format::{escape, ms, num, when};
use super::page_model::StatusModel;
use super::table::table_html;

/// A registered worker and one model it serves, with its batches over the
/// window.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct WorkerRow {
    /// Its connection's number.
    pub session: u64,
    /// Registered name.
    pub name: String,
    /// Device.
    pub device: String,
    /// Model of this row.
    pub model: String,
    /// `serving`, `draining`, `demoted` or `unbound`.
    #[schema(value_type = String)]
    pub state: &'static str,
    /// The lease it serves (its id), if any.
    pub lease: Option<u64>,
    /// Batches it returned in the window.
    pub batches: u64,
    /// Frames in them.
    pub frames: u64,
    /// Frames per batch.
    pub mean_batch: Option<f64>,
    /// Mean run time per batch (ms).
    pub mean_ms: Option<f64>,
    /// p95 of the run times (ms).
    pub p95_ms: Option<f64>,
    /// Mean of the worker's own time per batch (ms): pre- and
    /// postprocessing and inference, as it reports them, without the
    /// transfer; what its profile times.
    pub own_ms: Option<f64>,
    /// What its registered profile says a batch of the mean size takes
    /// (ms); `None` with no batch or no profile for the model.
    pub profile_ms: Option<f64>,
}

/// A worker's state, in a word (its lease is beside it).
fn worker_state(w: &WorkerView) -> &'static str {
    if w.unbound {
        "unbound"
    } else if w.draining {
        "draining"
    } else if w.demoted {
        "demoted"
    } else {
        "serving"
    }
}

pub(super) fn worker_rows(snap: &Snapshot) -> Vec<WorkerRow> {
    let recent = &snap.timeline.recent;
    let mut rows = Vec::new();
    for w in &snap.workers {
        for model in &w.models {
            let done = recent
                .workers
                .iter()
                .find(|r| r.id == w.id && &r.model == model);
            let (batches, frames) = done.map_or((0, 0), |d| (d.batches, d.frames));
            let mean_batch = (batches > 0).then(|| frames as f64 / batches as f64);
            let mut points: Vec<(u16, u32)> = w
                .profile
                .iter()
                .filter(|p| &p.model == model)
                .map(|p| (p.batch, p.latency_us))
                .collect();
            points.sort_unstable();
            let profile_ms = mean_batch.filter(|_| !points.is_empty()).map(|mean| {
                let size = (mean.round() as u16).max(1);
                crate::scheduler::profile_latency_us(&points, size) / 1e3
            });
            rows.push(WorkerRow {
                session: w.id,
                name: w.name.clone(),
                device: w.device.clone(),
                model: model.clone(),
                state: worker_state(w),
                lease: w.lease,
                batches,
                frames,
                mean_batch,
                mean_ms: done.filter(|_| batches > 0).map(|d| d.mean_ms),
                p95_ms: done.filter(|_| batches > 0).map(|d| d.p95_ms),
                own_ms: done.filter(|_| batches > 0).map(|d| d.own_ms),
                profile_ms,
            });
        }
    }
    rows
}

pub(super) fn workers_html(m: &StatusModel) -> String {
    let rows = m
        .workers
        .iter()
        .map(|w| {
            // the worker's own time against its profile, which times the
            // same work: the transfer is the link's, not the worker's
            let ratio = w
                .own_ms
                .zip(w.profile_ms)
                .map(|(mean, p)| format!("× {:.2}", mean / p.max(0.001)));
            vec![
                w.name.as_str().into(),
                w.model.as_str().into(),
                w.device.as_str().into(),
                w.lease
                    .map_or_else(|| w.state.to_string(), |l| format!("{} lease-{l}", w.state))
                    .into(),
                w.batches.to_string().into(),
                w.frames.to_string().into(),
                num(w.mean_batch, 1).into(),
                ms(w.mean_ms).into(),
                ms(w.p95_ms).into(),
                ms(w.own_ms).into(),
                ms(w.profile_ms).into(),
                ratio.unwrap_or_else(|| "—".into()).into(),
            ]
        })
        .collect();
    let mut out = table_html(
        &[
            "worker",
            "model",
            "device",
            "state",
            "batches",
            "frames",
            "mean batch",
            "mean batch time",
            "p95 batch time",
            "worker's own time",
            "profile at mean batch",
            "own vs profile",
        ],
        rows,
        "No worker is registered.",
        &[4, 5, 6, 7, 8, 9, 10, 11],
        None,
    );
    for s in &m.stalls {
        out += &format!(
            "<p class=\"warn\">Worker {} dropped as stalled {}: {}</p>",
            escape(&s.worker),
            when(s.stalled_at.0, m.generated_at.0),
            escape(&s.reason)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::build;
    use crate::status::fixtures::{NOW, snapshot};

    #[test]
    fn a_worker_row_holds_its_batch_time_against_its_profile() {
        let m = build(&snapshot(0), None, NOW);
        let w = &m.workers[0];
        assert_eq!((w.batches, w.frames, w.mean_batch), (10, 40, Some(4.0)));
        assert_eq!((w.mean_ms, w.p95_ms), (Some(12.0), Some(15.0)));
        assert_eq!(w.profile_ms, Some(10.0), "the profile's point at batch 4");
        assert_eq!(
            w.own_ms,
            Some(9.0),
            "the worker's own time, not the round trip"
        );
        let html = workers_html(&m);
        assert!(html.contains("× 0.90"), "own time over the profile: {html}");
        assert_eq!(w.state, "serving");
        assert_eq!(m.budget_ms, Some(80.0));
    }
}
