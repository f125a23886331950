//! [`StatusModel`], everything the page shows, and [`build`], which makes
//! it from the hub's snapshot, each panel's rows and the banner's problems.

use serde::Serialize;
use utoipa::ToSchema;

use crate::api::json::{FrameCounts, FrameTotals, Percentiles, Point, Stall, Timestamp};
use crate::hub::Snapshot;

use super::cameras::{CameraRow, camera_rows};
use super::leases::{LeasingModel, LeasingView, leasing_model};
use super::models::{ModelRow, model_rows};
use super::problems::{Problem, problems};
use super::thumbnails::ThumbnailInfo;
use super::workers::{WorkerRow, worker_rows};

/// The last minute: the window of every rate on the page.
#[derive(Debug, Clone, Default, PartialEq, Serialize, ToSchema)]
pub struct Window {
    /// Start.
    pub start_at: Timestamp,
    /// End: the end of the last whole interval.
    pub end_at: Timestamp,
    /// Its length (s); shorter than a minute in the gateway's first one.
    pub length_s: f64,
    /// Frames in it.
    pub frames: FrameCounts,
    /// Frames admitted per second (the cameras' rates add up to it).
    pub admitted_fps: Option<f64>,
    /// Frames answered `ok` per second.
    pub ok_fps: Option<f64>,
    /// Shed over ended.
    pub shed_ratio: Option<f64>,
    /// End-to-end latency edges reported.
    pub latency: Option<Percentiles>,
}

/// Everything the page shows; served as `GET /api/v1/status`.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct StatusModel {
    /// The instant it describes.
    pub generated_at: Timestamp,
    /// What the banner flags; empty when all is well.
    pub problems: Vec<Problem>,
    /// Frame counters since the gateway started.
    pub totals: FrameTotals,
    /// The last minute.
    pub window: Window,
    /// Length of each plotted interval (ms).
    pub interval_ms: u64,
    /// The last 15 minutes, oldest first.
    pub points: Vec<Point>,
    /// The strictest budget of a served model (ms): the plot's line.
    pub budget_ms: Option<f64>,
    /// Workers, by id, one row per model.
    pub workers: Vec<WorkerRow>,
    /// Workers dropped as stalled, newest last.
    pub stalls: Vec<Stall>,
    /// Models, by name.
    pub models: Vec<ModelRow>,
    /// Cameras, worst shed share first.
    pub cameras: Vec<CameraRow>,
    /// Frames of cameras the window could not track one by one.
    pub other_cameras: FrameCounts,
    /// With `[leasing]`.
    pub leasing: Option<LeasingModel>,
    /// Camera thumbnails (`GET /api/v1/cameras/{edge}/{camera}/thumbnail.jpg`);
    /// `None` when they are off (`[status] thumbnails`).
    pub thumbnails: Option<ThumbnailInfo>,
}

/// `count` per second over `seconds`; `None` for an empty window.
pub(super) fn rate(count: u64, seconds: f64) -> Option<f64> {
    (seconds > 0.0).then(|| count as f64 / seconds)
}

/// The model of the page at `now_ms`.
pub fn build(snap: &Snapshot, leasing: Option<LeasingView<'_>>, now_ms: u64) -> StatusModel {
    let recent = &snap.timeline.recent;
    let seconds = recent.end_ms.saturating_sub(recent.start_ms) as f64 / 1e3;
    let window = Window {
        start_at: Timestamp(recent.start_ms),
        end_at: Timestamp(recent.end_ms),
        length_s: seconds,
        frames: recent.frames.into(),
        admitted_fps: rate(recent.frames.admitted, seconds),
        ok_fps: rate(recent.frames.ok, seconds),
        shed_ratio: recent.shed_ratio,
        latency: recent.latency.map(Percentiles::from),
    };
    let budget_ms = snap
        .models
        .iter()
        .map(|m| m.budget_ms)
        .filter(|b| *b > 0.0)
        .min_by(f64::total_cmp);
    let mut model = StatusModel {
        generated_at: Timestamp(now_ms),
        problems: Vec::new(),
        totals: snap.frames.into(),
        window,
        interval_ms: snap.timeline.interval_ms,
        points: snap.timeline.points.iter().map(Point::from).collect(),
        budget_ms,
        workers: worker_rows(snap),
        stalls: snap.timeline.stalls.iter().map(Stall::from).collect(),
        models: model_rows(snap),
        cameras: camera_rows(snap, seconds),
        other_cameras: recent.other_cameras.into(),
        leasing: leasing.map(|l| leasing_model(l, now_ms)),
        thumbnails: None,
    };
    model.problems = problems(&model);
    model
}
