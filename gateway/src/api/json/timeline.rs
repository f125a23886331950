//! The last 15 minutes, interval by interval, and the last minute by
//! camera and worker (`GET /api/v1/timeline`), from [`crate::timeline`].

use serde::Serialize;
use utoipa::ToSchema;

use super::{FrameCounts, Percentiles, Timestamp};

/// One interval of the timeline.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Point {
    /// Its start.
    pub start_at: Timestamp,
    /// Frames that arrived, and that ended, within it.
    pub frames: FrameCounts,
    /// Shed over ended; `null` when none ended.
    pub shed_ratio: Option<f64>,
    /// End-to-end latency edges reported within it.
    pub latency: Option<Percentiles>,
}

impl From<&crate::timeline::Point> for Point {
    fn from(p: &crate::timeline::Point) -> Self {
        let crate::timeline::Point {
            start_ms,
            frames,
            shed_ratio,
            latency,
        } = p;
        Point {
            start_at: Timestamp(*start_ms),
            frames: (*frames).into(),
            shed_ratio: *shed_ratio,
            latency: latency.map(Percentiles::from),
        }
    }
}

/// A worker dropped as stalled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct Stall {
    /// When.
    pub stalled_at: Timestamp,
    /// The worker's registered name.
    pub worker: String,
    /// Why, as the scheduler said it.
    pub reason: String,
}

impl From<&crate::timeline::Stall> for Stall {
    fn from(s: &crate::timeline::Stall) -> Self {
        let crate::timeline::Stall {
            at_ms,
            worker,
            reason,
        } = s;
        Stall {
            stalled_at: Timestamp(*at_ms),
            worker: worker.clone(),
            reason: reason.clone(),
        }
    }
}

/// One camera over the recent window.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct CameraWindow {
    /// Its edge's configured name.
    pub edge: String,
    /// Camera name.
    pub camera: String,
    /// Its frames.
    pub frames: FrameCounts,
}

/// One worker's batches of one model over the recent window.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct WorkerWindow {
    /// Its connection's number.
    pub session: u64,
    /// Registered name.
    pub name: String,
    /// Model.
    pub model: String,
    /// Batches it returned.
    pub batches: u64,
    /// Frames in them.
    pub frames: u64,
    /// Mean run time per batch (ms), as the gateway sees it: dispatch (or
    /// the batch before) to result, transfer included.
    pub mean_ms: f64,
    /// 95th percentile of the run times (ms).
    pub p95_ms: f64,
    /// Mean of the worker's own time per batch (ms): what its profile
    /// times.
    pub own_ms: f64,
}

/// The last minute of the timeline.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct RecentWindow {
    /// Start.
    pub start_at: Timestamp,
    /// End: the end of the last closed interval.
    pub end_at: Timestamp,
    /// Frames; `admitted` is the sum of the cameras' (and
    /// `other_cameras'`).
    pub frames: FrameCounts,
    /// Shed over ended; `null` when none ended.
    pub shed_ratio: Option<f64>,
    /// End-to-end latency over the window.
    pub latency: Option<Percentiles>,
    /// Per camera that had a frame, by edge and camera name.
    pub cameras: Vec<CameraWindow>,
    /// Frames of cameras past the tracked number in some interval.
    pub other_cameras: FrameCounts,
    /// Per worker and model that returned a batch.
    pub workers: Vec<WorkerWindow>,
}

/// The last 15 minutes, interval by interval (`GET /api/v1/timeline`).
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Timeline {
    /// The instant of the view.
    pub generated_at: Timestamp,
    /// Each interval's length (ms).
    pub interval_ms: u64,
    /// Closed intervals, oldest first, consecutive.
    pub points: Vec<Point>,
    /// The last minute.
    pub recent: RecentWindow,
    /// Workers dropped as stalled, newest last.
    pub stalls: Vec<Stall>,
}

impl From<&crate::timeline::TimelineView> for Timeline {
    fn from(t: &crate::timeline::TimelineView) -> Self {
        let crate::timeline::TimelineView {
            now_ms,
            interval_ms,
            points,
            recent,
            stalls,
        } = t;
        let crate::timeline::RecentWindow {
            start_ms,
            end_ms,
            frames,
            shed_ratio,
            latency,
            cameras,
            other_cameras,
            workers,
        } = recent;
        Timeline {
            generated_at: Timestamp(*now_ms),
            interval_ms: *interval_ms,
            points: points.iter().map(Point::from).collect(),
            recent: RecentWindow {
                start_at: Timestamp(*start_ms),
                end_at: Timestamp(*end_ms),
                frames: (*frames).into(),
                shed_ratio: *shed_ratio,
                latency: latency.map(Percentiles::from),
                cameras: cameras
                    .iter()
                    .map(|c| {
                        let crate::timeline::CameraWindow {
                            edge,
                            camera,
                            frames,
                        } = c;
                        CameraWindow {
                            edge: edge.clone(),
                            camera: camera.clone(),
                            frames: (*frames).into(),
                        }
                    })
                    .collect(),
                other_cameras: (*other_cameras).into(),
                workers: workers
                    .iter()
                    .map(|w| {
                        let crate::timeline::WorkerWindow {
                            id,
                            name,
                            model,
                            batches,
                            frames,
                            mean_ms,
                            p95_ms,
                            own_ms,
                        } = w;
                        WorkerWindow {
                            session: *id,
                            name: name.clone(),
                            model: model.clone(),
                            batches: *batches,
                            frames: *frames,
                            mean_ms: *mean_ms,
                            p95_ms: *p95_ms,
                            own_ms: *own_ms,
                        }
                    })
                    .collect(),
            },
            stalls: stalls.iter().map(Stall::from).collect(),
        }
    }
}
