//! The operator API's JSON bodies: one type per body, each built from the
//! gateway's own state (the hub's [`Snapshot`], the timeline, the lease
//! ledger's rows and cost report), and the source of the OpenAPI document
//! (`GET /api/v1/openapi.json`, `docs/openapi.json`).
//!
//! The shape every body keeps:
//! - an edge is named by its configured (authenticated) name, in a field
//!   called `edge`; its connection's number, where useful, is `session`;
//! - a lease is its number (`"lease": 3`, the id `POST
//!   /api/v1/leases/{id}/release` takes), never `lease-3`;
//! - every instant is a [`Timestamp`]: RFC 3339 UTC with milliseconds
//!   (`2026-12-05T22:57:07.123Z`), in a field whose name ends in `_at`;
//!   every duration carries its unit in its name (`_ms`, `_s`, `_us`);
//! - every field is labelled: objects, never tuples;
//! - every error is an [`ApiError`], `{"error": "…"}`.
//!
//! The conversions destructure their source without `..`: a field added to
//! a source type does not compile until this module says what the API
//! makes of it.

use serde::Serialize;
use utoipa::ToSchema;

use tidegate_lease::Money;
use tidegate_lease::ledger::{CostReport, LeaseRecord};
use tidegate_lease::showback::Share;

use crate::hub::{CameraView, EdgeView, ModelView, Snapshot, WorkerView};

/// An instant: ms since the Unix epoch inside, RFC 3339 UTC with
/// milliseconds on the wire (`2026-12-05T22:57:07.123Z`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(pub u64);

/// The pattern every [`Timestamp`] matches (also in the document).
pub const TIMESTAMP_PATTERN: &str = r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$";

impl Serialize for Timestamp {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&rfc3339(self.0))
    }
}

impl utoipa::PartialSchema for Timestamp {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, SchemaFormat, Type};
        ObjectBuilder::new()
            .schema_type(Type::String)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::DateTime)))
            .pattern(Some(TIMESTAMP_PATTERN))
            .description(Some("An instant: RFC 3339, UTC, with milliseconds."))
            .examples([serde_json::json!("2026-12-05T22:57:07.123Z")])
            .into()
    }
}

impl ToSchema for Timestamp {}

/// A JPEG file, as a body's schema in the document (the body itself is
/// the file's bytes).
#[derive(Debug)]
pub struct Jpeg;

impl utoipa::PartialSchema for Jpeg {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, SchemaFormat, Type};
        ObjectBuilder::new()
            .schema_type(Type::String)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Binary)))
            .description(Some("A JPEG file."))
            .into()
    }
}

impl ToSchema for Jpeg {}

/// `ms` since the Unix epoch as RFC 3339 UTC with milliseconds
/// (`2026-12-05T22:57:07.123Z`).
pub fn rfc3339(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

/// Every error the API answers (any 4xx or 5xx under `/api/`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct ApiError {
    /// What was wrong and what to do about it.
    pub error: String,
}

/// Frame accounting since the gateway started: `admitted = ok + shed +
/// expired + failed + queued + dispatched`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, ToSchema)]
pub struct FrameTotals {
    /// Frames accepted into the scheduler.
    pub admitted: u64,
    /// Finished with inference results.
    pub ok: u64,
    /// Dropped before dispatch.
    pub shed: u64,
    /// Deadline passed while queued.
    pub expired: u64,
    /// Failed (worker error or worker lost).
    pub failed: u64,
    /// Waiting in a queue now.
    pub queued: u64,
    /// Dispatched to a worker and not yet finished.
    pub dispatched: u64,
    /// Times a lost worker's frame was queued again (not part of the
    /// identity: such a frame is still in flight, then ends once).
    pub requeued: u64,
    /// Times a frame a worker failed was queued again for another worker
    /// (at most once a frame; not part of the identity either).
    pub retried: u64,
}

impl From<crate::scheduler::Counters> for FrameTotals {
    fn from(c: crate::scheduler::Counters) -> Self {
        let crate::scheduler::Counters {
            admitted,
            ok,
            shed,
            expired,
            failed,
            queued,
            dispatched,
            requeued,
            retried,
        } = c;
        FrameTotals {
            admitted,
            ok,
            shed,
            expired,
            failed,
            queued,
            dispatched,
            requeued,
            retried,
        }
    }
}

/// Frames over a span of time, by how they ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, ToSchema)]
pub struct FrameCounts {
    /// Frames that arrived and were admitted.
    pub admitted: u64,
    /// Frames answered with results.
    pub ok: u64,
    /// Frames shed by the gateway (overload, would miss their deadline, no
    /// worker, superseded), not counting `edge_gone`.
    pub shed: u64,
    /// Frames whose deadline passed while queued.
    pub expired: u64,
    /// Frames a worker failed, or lost with its worker.
    pub failed: u64,
    /// Queued frames dropped because their edge disconnected.
    pub edge_gone: u64,
}

impl FrameCounts {
    /// Frames that ended (any status but `edge_gone`), as
    /// [`crate::timeline::FrameCounts::ended`] counts them.
    pub fn ended(&self) -> u64 {
        self.ok + self.shed + self.expired + self.failed
    }
}

impl From<crate::timeline::FrameCounts> for FrameCounts {
    fn from(c: crate::timeline::FrameCounts) -> Self {
        let crate::timeline::FrameCounts {
            admitted,
            ok,
            shed,
            expired,
            failed,
            edge_gone,
        } = c;
        FrameCounts {
            admitted,
            ok,
            shed,
            expired,
            failed,
            edge_gone,
        }
    }
}

/// End-to-end latency percentiles, as edges reported them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, ToSchema)]
pub struct Percentiles {
    /// Samples they were taken from.
    pub samples: u64,
    /// Median (ms).
    pub p50_ms: f64,
    /// 95th percentile (ms).
    pub p95_ms: f64,
    /// 99th percentile (ms).
    pub p99_ms: f64,
    /// Largest (ms).
    pub max_ms: f64,
}

impl From<crate::timeline::Percentiles> for Percentiles {
    fn from(p: crate::timeline::Percentiles) -> Self {
        let crate::timeline::Percentiles {
            samples,
            p50_ms,
            p95_ms,
            p99_ms,
            max_ms,
        } = p;
        Percentiles {
            samples,
            p50_ms,
            p95_ms,
            p99_ms,
            max_ms,
        }
    }
}

/// A connected edge (one entry per connection).
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Edge {
    /// Its configured name, as it authenticated.
    pub edge: String,
    /// Its connection's number (the same edge may hold several).
    pub session: u64,
}

impl From<&EdgeView> for Edge {
    fn from(e: &EdgeView) -> Self {
        let EdgeView { id, name } = e;
        Edge {
            edge: name.clone(),
            session: *id,
        }
    }
}

/// What the back-pressure policy measured of a camera over its last window.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, ToSchema)]
pub struct CameraLoad {
    /// Arrival rate (frames per second).
    pub arrival_fps: f64,
    /// Rate served `ok` (frames per second).
    pub ok_fps: f64,
    /// Fraction of the window's frames lost to overload.
    pub lost_ratio: f64,
    /// The frame-rate cap in force; `null` when uncapped.
    pub cap_fps: Option<f64>,
    /// Hints sent to this camera so far.
    pub hints: u64,
}

impl From<crate::backpressure::CameraLoad> for CameraLoad {
    fn from(l: crate::backpressure::CameraLoad) -> Self {
        let crate::backpressure::CameraLoad {
            arrival_fps,
            ok_fps,
            lost_ratio,
            cap_fps,
            hints,
        } = l;
        CameraLoad {
            arrival_fps,
            ok_fps,
            lost_ratio,
            cap_fps,
            hints,
        }
    }
}

/// An open camera.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Camera {
    /// Its edge's configured name.
    pub edge: String,
    /// Its edge's connection number.
    pub session: u64,
    /// Camera name.
    pub camera: String,
    /// Model its frames are for.
    pub model: String,
    /// Measured load and the frame-rate cap in force (after its first
    /// measurement window).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub load: Option<CameraLoad>,
}

impl From<&CameraView> for Camera {
    fn from(c: &CameraView) -> Self {
        let CameraView {
            session,
            edge,
            camera,
            model,
            load,
        } = c;
        Camera {
            edge: edge.clone(),
            session: *session,
            camera: camera.clone(),
            model: model.clone(),
            load: load.map(CameraLoad::from),
        }
    }
}

/// One point of a worker's measured latency profile.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct ProfilePoint {
    /// Model.
    pub model: String,
    /// Batch size.
    pub batch: u16,
    /// Latency of one run of that batch (µs).
    pub latency_us: u32,
}

/// A registered worker.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Worker {
    /// Its connection's number.
    pub session: u64,
    /// Its registered name (a leased worker's is `lease-<id>`).
    pub name: String,
    /// Its device (`cpu`, `cuda:0`, …).
    pub device: String,
    /// Models it serves.
    pub models: Vec<String>,
    /// Measured latency per model and batch size.
    pub profile: Vec<ProfilePoint>,
    /// Takes no new batch (it is draining, or an unbound static worker).
    pub draining: bool,
    /// Demoted for failing its frames: it gets only probe batches until
    /// one succeeds.
    pub demoted: bool,
    /// The lease it serves (its id), if any.
    pub lease: Option<u64>,
    /// A static worker bound to no lease: connected and registered, it
    /// waits (no batch) until the autoscaler binds it.
    pub unbound: bool,
}

impl From<&WorkerView> for Worker {
    fn from(w: &WorkerView) -> Self {
        let WorkerView {
            id,
            name,
            device,
            models,
            profile,
            draining,
            demoted,
            lease,
            unbound,
        } = w;
        Worker {
            session: *id,
            name: name.clone(),
            device: device.clone(),
            models: models.clone(),
            profile: profile
                .iter()
                .map(|p| ProfilePoint {
                    model: p.model.clone(),
                    batch: p.batch,
                    latency_us: p.latency_us,
                })
                .collect(),
            draining: *draining,
            demoted: *demoted,
            lease: *lease,
            unbound: *unbound,
        }
    }
}

/// The tensor a model takes from the edges.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, ToSchema)]
pub struct Input {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// Channels (3 for colour).
    pub channels: u8,
    /// Element type on the wire.
    #[schema(value_type = String, example = "u8")]
    pub dtype: tidegate_protocol::DType,
    /// Memory layout on the wire.
    #[schema(value_type = String, example = "nhwc")]
    pub layout: tidegate_protocol::Layout,
    /// Channel order.
    #[schema(value_type = String, example = "rgb")]
    pub color: tidegate_protocol::ColorOrder,
    /// How the edge fits a source frame into it.
    #[schema(value_type = String, example = "stretch")]
    pub resize: tidegate_protocol::Resize,
}

impl From<tidegate_protocol::InputSpec> for Input {
    fn from(i: tidegate_protocol::InputSpec) -> Self {
        let tidegate_protocol::InputSpec {
            width,
            height,
            channels,
            dtype,
            layout,
            color,
            resize,
        } = i;
        Input {
            width,
            height,
            channels,
            dtype,
            layout,
            color,
            resize,
        }
    }
}

/// A model served by at least one worker.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Model {
    /// Name.
    pub name: String,
    /// Version.
    pub version: u32,
    /// Input the edges send.
    pub input: Input,
    /// Largest batch across workers.
    pub max_batch: u16,
    /// Frames queued now.
    pub queued: usize,
    /// Workers serving it.
    pub workers: usize,
    /// Class names, indexed by a detection's `class`.
    pub labels: Vec<String>,
    /// The budget its frames are held to (ms): the strictest its open
    /// cameras declared, else the latest frame's; 0 when neither is known.
    pub budget_ms: f64,
}

impl From<&ModelView> for Model {
    fn from(m: &ModelView) -> Self {
        let ModelView {
            name,
            version,
            input,
            max_batch,
            queued,
            workers,
            labels,
            budget_ms,
        } = m;
        Model {
            name: name.clone(),
            version: *version,
            input: (*input).into(),
            max_batch: *max_batch,
            queued: *queued,
            workers: *workers,
            labels: labels.clone(),
            budget_ms: *budget_ms,
        }
    }
}

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

/// The hub's snapshot as the API's bodies.
pub fn edges(s: &Snapshot) -> Vec<Edge> {
    s.edges.iter().map(Edge::from).collect()
}

/// Open cameras, by edge name, session and camera.
pub fn cameras(s: &Snapshot) -> Vec<Camera> {
    s.cameras.iter().map(Camera::from).collect()
}

/// Registered workers, by session.
pub fn workers(s: &Snapshot) -> Vec<Worker> {
    s.workers.iter().map(Worker::from).collect()
}

/// Served models, by name.
pub fn models(s: &Snapshot) -> Vec<Model> {
    s.models.iter().map(Model::from).collect()
}

/// A lease, as the ledger records it (`GET /api/v1/leases`).
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Lease {
    /// Its id: the number `POST /api/v1/leases/{id}/release` takes (logs
    /// and a leased worker's name write it `lease-<id>`).
    pub id: u64,
    /// Provider name.
    pub provider: String,
    /// The model it serves.
    pub model: Option<String>,
    /// Instance type.
    pub instance_type: String,
    /// `on_demand`, `spot` or `reserved`.
    pub tier: String,
    /// Price per hour (currency units).
    pub price_per_hour: f64,
    /// Currency.
    pub currency: String,
    /// `hour` (whole hours, paid at the start of each) or `second`.
    pub billing: String,
    /// The least time billed (s): 3600 for hourly billing.
    pub billing_minimum_s: u32,
    /// `requested`, `starting`, `ready`, `draining` or `ended`.
    pub state: String,
    /// Why it ended (`released`, `preempted`, `failed`, `lost`,
    /// `no_capacity`); `null` until it has.
    pub end_reason: Option<String>,
    /// Asked of the provider.
    pub requested_at: Timestamp,
    /// The provider accepted it, and billing started.
    pub billing_started_at: Option<Timestamp>,
    /// Its worker registered and warmed its models.
    pub ready_at: Option<Timestamp>,
    /// It ended.
    pub ended_at: Option<Timestamp>,
    /// The gateway last heard from its worker (written at most every few
    /// seconds).
    pub last_seen_at: Option<Timestamp>,
    /// Worker process id (process provider), for adoption.
    pub pid: Option<u32>,
    /// Provider-specific data (JSON text), for adoption.
    pub provider_data: Option<String>,
    /// Cost charged so far (currency units).
    pub cost: f64,
    /// Frames served within the SLO.
    pub frames_within_slo: u64,
    /// Frames served late.
    pub frames_late: u64,
}

impl From<&LeaseRecord> for Lease {
    fn from(r: &LeaseRecord) -> Self {
        let LeaseRecord {
            id,
            provider,
            model,
            instance_type,
            tier,
            price_per_hour,
            currency,
            granularity,
            state,
            requested_at,
            billing_start,
            ready_at,
            ended_at,
            last_seen_at,
            pid,
            provider_data,
            cost,
            frames_within_slo,
            frames_late,
            token_claimed: _,
            token: _,
        } = r;
        Lease {
            id: id.0,
            provider: provider.clone(),
            model: model.clone(),
            instance_type: instance_type.clone(),
            tier: tier.as_str().into(),
            price_per_hour: price_per_hour.units(),
            currency: currency.clone(),
            billing: granularity.unit().into(),
            billing_minimum_s: granularity.minimum_secs(),
            state: state.label().into(),
            end_reason: match state {
                tidegate_lease::LeaseState::Ended(why) => Some(why.as_str().into()),
                _ => None,
            },
            requested_at: Timestamp(*requested_at),
            billing_started_at: billing_start.map(Timestamp),
            ready_at: ready_at.map(Timestamp),
            ended_at: ended_at.map(Timestamp),
            last_seen_at: last_seen_at.map(Timestamp),
            pid: *pid,
            provider_data: provider_data.clone(),
            cost: cost.units(),
            frames_within_slo: *frames_within_slo,
            frames_late: *frames_late,
        }
    }
}

/// Cost by tier.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct TierCost {
    /// `on_demand`, `spot` or `reserved`.
    pub tier: String,
    /// Charged in the range (currency units).
    pub cost: f64,
}

/// Cost by instance type.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct InstanceTypeCost {
    /// Instance type.
    pub instance_type: String,
    /// Charged in the range (currency units).
    pub cost: f64,
}

/// One edge's share of the range's cost.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct EdgeCost {
    /// The edge's configured name.
    pub edge: String,
    /// Its share of the leases' cost (currency units).
    pub cost: f64,
    /// Frames served within the SLO.
    pub frames_within_slo: u64,
    /// Frames served late or failed.
    pub frames_late: u64,
    /// Worker time its frames took (s).
    pub busy_s: f64,
    /// `cost` per 1000 frames within the SLO (`null` without such frames).
    pub cost_per_1k_within_slo: Option<f64>,
}

/// One model's share of the range's cost.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ModelCost {
    /// The model.
    pub model: String,
    /// Its share of the leases' cost (currency units).
    pub cost: f64,
    /// Frames served within the SLO.
    pub frames_within_slo: u64,
    /// Frames served late or failed.
    pub frames_late: u64,
    /// Worker time its frames took (s).
    pub busy_s: f64,
    /// `cost` per 1000 frames within the SLO (`null` without such frames).
    pub cost_per_1k_within_slo: Option<f64>,
}

/// A share's fields: cost, frames within the SLO, frames late, busy
/// seconds, cost per 1000.
fn share(s: &Share) -> (f64, u64, u64, f64, Option<f64>) {
    let Share {
        cost,
        frames_within_slo,
        frames_late,
        busy_seconds,
        cost_per_1k_within_slo,
    } = s;
    (
        cost.units(),
        *frames_within_slo,
        *frames_late,
        *busy_seconds,
        *cost_per_1k_within_slo,
    )
}

/// What the leases cost in a range (`GET /api/v1/costs`).
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Costs {
    /// Range start (inclusive).
    pub from_at: Timestamp,
    /// Range end (exclusive).
    pub to_at: Timestamp,
    /// Currency of every amount (`null` before any lease).
    pub currency: Option<String>,
    /// Total charged in the range (currency units).
    pub total: f64,
    /// By tier.
    pub by_tier: Vec<TierCost>,
    /// By instance type.
    pub by_instance_type: Vec<InstanceTypeCost>,
    /// Frames served within the SLO in hours starting in the range.
    pub frames_within_slo: u64,
    /// Frames served late in those hours.
    pub frames_late: u64,
    /// Cost per 1000 frames served within the SLO (`null` without frames).
    pub cost_per_1k_within_slo: Option<f64>,
    /// The cost split among the edges each lease served, by the worker
    /// time their frames took, by edge name.
    pub by_edge: Vec<EdgeCost>,
    /// The same split among models, by name.
    pub by_model: Vec<ModelCost>,
    /// Cost of leases that served no frame in the range (in neither split).
    pub idle: f64,
}

impl From<&CostReport> for Costs {
    fn from(r: &CostReport) -> Self {
        let CostReport {
            from,
            to,
            currency,
            total,
            by_tier,
            by_type,
            frames_within_slo,
            frames_late,
            cost_per_1k_within_slo,
            by_edge,
            by_model,
            idle,
        } = r;
        let units = |m: &Money| m.units();
        Costs {
            from_at: Timestamp(*from),
            to_at: Timestamp(*to),
            currency: currency.clone(),
            total: total.units(),
            by_tier: by_tier
                .iter()
                .map(|(tier, cost)| TierCost {
                    tier: tier.as_str().into(),
                    cost: units(cost),
                })
                .collect(),
            by_instance_type: by_type
                .iter()
                .map(|(instance_type, cost)| InstanceTypeCost {
                    instance_type: instance_type.clone(),
                    cost: units(cost),
                })
                .collect(),
            frames_within_slo: *frames_within_slo,
            frames_late: *frames_late,
            cost_per_1k_within_slo: *cost_per_1k_within_slo,
            by_edge: by_edge
                .iter()
                .map(|(edge, s)| {
                    let (cost, within, late, busy_s, per_1k) = share(s);
                    EdgeCost {
                        edge: edge.clone(),
                        cost,
                        frames_within_slo: within,
                        frames_late: late,
                        busy_s,
                        cost_per_1k_within_slo: per_1k,
                    }
                })
                .collect(),
            by_model: by_model
                .iter()
                .map(|(model, s)| {
                    let (cost, within, late, busy_s, per_1k) = share(s);
                    ModelCost {
                        model: model.clone(),
                        cost,
                        frames_within_slo: within,
                        frames_late: late,
                        busy_s,
                        cost_per_1k_within_slo: per_1k,
                    }
                })
                .collect(),
            idle: idle.units(),
        }
    }
}

/// `POST /api/v1/workers/{name}/drain` accepted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct Draining {
    /// The worker's registered name.
    pub worker: String,
    /// Its connections told to drain.
    pub draining: usize,
}

/// `POST /api/v1/leases/{id}/release` accepted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct Releasing {
    /// The lease's id.
    pub lease: u64,
    /// `draining`: its worker finishes its batches, then the provider
    /// releases it.
    pub state: String,
}

/// A principal list's changes at a reload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct PrincipalChanges {
    /// Names listed now and not before.
    pub added: Vec<String>,
    /// Names no longer listed.
    pub removed: Vec<String>,
    /// Names listed in both, with a different set of token digests.
    pub rotated: Vec<String>,
}

impl From<&crate::auth::PrincipalChanges> for PrincipalChanges {
    fn from(p: &crate::auth::PrincipalChanges) -> Self {
        let crate::auth::PrincipalChanges {
            added,
            removed,
            rotated,
        } = p;
        PrincipalChanges {
            added: added.clone(),
            removed: removed.clone(),
            rotated: rotated.clone(),
        }
    }
}

/// A connection a reload closed, because its credential was removed or
/// rotated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct Revoked {
    /// `edge` or `worker`.
    pub role: String,
    /// The name it connected as (an edge's configured name, or a
    /// worker's).
    pub name: String,
    /// Its connection's number.
    pub session: u64,
}

/// What `POST /api/v1/reload` did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct Reloaded {
    /// `[[edges]]` changes.
    pub edges: PrincipalChanges,
    /// `[[workers]]` changes.
    pub workers: PrincipalChanges,
    /// `unchanged`, `set`, `changed` or `removed`.
    pub admin_token: String,
    /// Connections closed, by session.
    pub revoked: Vec<Revoked>,
    /// `reloaded` when the QUIC certificate or key changed and now serves
    /// new handshakes, else `unchanged`.
    pub tls: String,
    /// Sections that differ from the running configuration and were not
    /// applied: they take effect at the next restart.
    pub needs_restart: Vec<String>,
}

impl From<&crate::reload::ReloadReport> for Reloaded {
    fn from(r: &crate::reload::ReloadReport) -> Self {
        let crate::reload::ReloadReport {
            credentials,
            tls,
            needs_restart,
        } = r;
        let crate::auth::CredentialChanges {
            edges,
            workers,
            admin_token,
            revoked,
        } = credentials;
        Reloaded {
            edges: edges.into(),
            workers: workers.into(),
            admin_token: (*admin_token).into(),
            revoked: revoked
                .iter()
                .map(|r| {
                    let crate::auth::Revoked {
                        role,
                        name,
                        session,
                    } = r;
                    Revoked {
                        role: match role {
                            tidegate_protocol::Role::Edge => "edge",
                            tidegate_protocol::Role::Worker => "worker",
                        }
                        .into(),
                        name: name.clone(),
                        session: *session,
                    }
                })
                .collect(),
            tls: (*tls).into(),
            needs_restart: needs_restart.iter().map(|s| (*s).into()).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_end_as_the_timeline_counts_them() {
        let t = crate::timeline::FrameCounts {
            admitted: 20,
            ok: 11,
            shed: 5,
            expired: 2,
            failed: 1,
            edge_gone: 1,
        };
        assert_eq!(FrameCounts::from(t).ended(), t.ended());
    }

    #[test]
    fn instants_are_rfc3339_utc_with_milliseconds() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_764_694_800_250), "2025-12-02T17:00:00.250Z");
        assert_eq!(rfc3339(951_782_400_007), "2000-02-29T00:00:00.007Z");
        assert_eq!(
            serde_json::to_value(Timestamp(1_709_213_400_999)).unwrap(),
            serde_json::json!("2024-02-29T13:30:00.999Z")
        );
    }

    proptest::proptest! {
        /// What the API writes, its `from`/`to` parse back to the same ms.
        #[test]
        fn written_instants_parse_back(ms in 0u64..253_402_300_800_000) {
            let text = rfc3339(ms);
            proptest::prop_assert_eq!(crate::api::parse_time(&text), Ok(ms));
            proptest::prop_assert_eq!(text.len(), 24);
        }
    }
}
