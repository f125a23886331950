//! The live status page (`GET /`) and the model it renders
//! (`GET /api/v1/status`).
//!
//! [`build`] turns the hub's [`Snapshot`] (with its [`crate::timeline`]),
//! the lease ledger's view and the clock into a [`StatusModel`]: rates over
//! the last minute that add up, cameras sorted worst first, each worker's
//! batch times against its profile, each lease's time left in the block it
//! has paid for, and the [`Problem`]s the banner shows. It is pure, and
//! tested without sockets.
//!
//! [`page`] is one HTML document, served by the gateway with everything
//! inline (no CDN, no fetch anywhere else): the model as of the request,
//! and a small script (`status_page.html`) that draws it, plots the last
//! 15 minutes as inline SVG, and fetches `/api/v1/status` every
//! [`POLL_MS`] to draw it again. Every name from outside (edge, camera,
//! worker, model, provider) reaches the document through `textContent`
//! only; the embedded JSON has its `<`, `>` and `&` escaped, so no name can
//! close its `<script>`.

use serde::Serialize;
use utoipa::ToSchema;

use tidegate_lease::billing::{Granularity, paid_until};
use tidegate_lease::ledger::{CostReport, LeaseRecord};

use crate::api::json::{FrameCounts, FrameTotals, Percentiles, Point, Stall, Timestamp};
use crate::hub::{Snapshot, WorkerView};

/// How often the page fetches the model again (ms).
pub const POLL_MS: u32 = 2000;

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

/// How far back the status page's cost by edge reaches: a day (the split
/// reads every usage row of the range).
pub const RECENT_MS: u64 = 24 * 3600 * 1000;

/// `s` with `&`, `<`, `>`, `"` and `'` escaped, for HTML or SVG text and
/// attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Leasing, when configured: the live leases, what all leases cost, and
/// the cap on what live leases may cost per hour.
#[derive(Debug, Clone, Copy)]
pub struct LeasingView<'a> {
    /// Leases not ended.
    pub live: &'a [LeaseRecord],
    /// Cost of every lease so far.
    pub costs: &'a CostReport,
    /// The last [`RECENT_MS`], split by edge.
    pub recent: &'a CostReport,
    /// `leasing.spend_cap_per_hour`, when set.
    pub spend_cap_per_hour: Option<f64>,
}

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

/// A model with workers, or one cameras ask for.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ModelRow {
    /// Name.
    pub name: String,
    /// Version (`None`: no worker serves it).
    pub version: Option<u32>,
    /// Workers that may serve it.
    pub workers: usize,
    /// Frames queued now.
    pub queued: usize,
    /// Largest batch.
    pub max_batch: u16,
    /// Open cameras sending it frames.
    pub cameras: usize,
    /// Budget (ms; 0 when not known).
    pub budget_ms: f64,
}

/// A camera, over the window.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct CameraRow {
    /// Its edge's configured name.
    pub edge: String,
    /// Camera name.
    pub camera: String,
    /// Model (`None` for a camera closed since).
    pub model: Option<String>,
    /// Open now.
    pub open: bool,
    /// Its frames in the window.
    pub frames: FrameCounts,
    /// Admitted per second over the window.
    pub admitted_fps: Option<f64>,
    /// `ok` per second over the window.
    pub ok_fps: Option<f64>,
    /// Shed over ended.
    pub shed_ratio: Option<f64>,
    /// The frame-rate cap the gateway's hints hold it to, if any.
    pub cap_fps: Option<f64>,
    /// The number of its latest thumbnail, which changes with each new
    /// one (the page puts it in the thumbnail's URL to fetch a new one);
    /// `None` while it has none, and when thumbnails are off.
    pub thumbnail: Option<u64>,
}

/// Camera thumbnails, as configured under `[status]`.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ThumbnailInfo {
    /// Least time between two thumbnails of a camera (ms).
    pub interval_ms: u64,
    /// Longest side of a thumbnail (px).
    pub max_px: u32,
    /// Frames that gave no thumbnail (no picture, or corrupt) since the
    /// gateway started.
    pub refused: u64,
}

/// A live lease.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct LeaseRow {
    /// Its id (the number `POST /api/v1/leases/{id}/release` takes).
    pub id: u64,
    /// Provider.
    pub provider: String,
    /// Instance type.
    pub instance_type: String,
    /// `on_demand`, `spot` or `reserved`.
    #[schema(value_type = String)]
    pub tier: &'static str,
    /// Lifecycle state.
    #[schema(value_type = String)]
    pub state: &'static str,
    /// Price per hour (currency units).
    pub price_per_hour: f64,
    /// Currency.
    pub currency: String,
    /// `hour` or `second`.
    #[schema(value_type = String)]
    pub billing: &'static str,
    /// Billing start, once the provider accepted.
    pub billing_started_at: Option<Timestamp>,
    /// End of what is already paid for: releasing earlier saves nothing.
    pub paid_until_at: Option<Timestamp>,
    /// Time left in that block (ms); 0 once per-second billing is past its
    /// minimum.
    pub block_left_ms: Option<u64>,
    /// Cost so far (currency units).
    pub cost: f64,
}

/// One edge's share of the last day's cost.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct EdgeCostRow {
    /// The edge's configured name (`null`: leases that served nothing).
    pub edge: Option<String>,
    /// Cost (currency units).
    pub cost: f64,
    /// Frames answered `ok` within their deadline.
    pub frames_within_slo: u64,
    /// Frames answered otherwise.
    pub frames_late: u64,
    /// Worker time (s).
    pub busy_s: f64,
    /// Cost per 1000 frames within the SLO.
    pub cost_per_1k_within_slo: Option<f64>,
}

/// Leasing on the page.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct LeasingModel {
    /// Live leases, newest first.
    pub leases: Vec<LeaseRow>,
    /// Their summed hourly price: what the spend cap holds.
    pub spend_per_hour: f64,
    /// `leasing.spend_cap_per_hour`.
    pub spend_cap_per_hour: Option<f64>,
    /// Currency of the ledger.
    pub currency: String,
    /// Cost of every lease so far.
    pub total_cost: f64,
    /// Frames leased workers answered within the SLO, so far.
    pub frames_within_slo: u64,
    /// And otherwise.
    pub frames_late: u64,
    /// Cost per 1000 frames within the SLO, so far.
    pub cost_per_1k_within_slo: Option<f64>,
    /// The last day's cost by edge, and idle leases last.
    pub last_day_by_edge: Vec<EdgeCostRow>,
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
fn rate(count: u64, seconds: f64) -> Option<f64> {
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

/// Says in `model` whether thumbnails are on, and which cameras have one
/// (its number).
pub fn add_thumbnails(model: &mut StatusModel, thumbnails: &crate::thumbnail::Thumbnails) {
    let Some(config) = thumbnails.config() else {
        return;
    };
    model.thumbnails = Some(ThumbnailInfo {
        interval_ms: config.interval.as_millis() as u64,
        max_px: config.max_px,
        refused: thumbnails.refused(),
    });
    let numbers = thumbnails.numbers();
    for c in &mut model.cameras {
        c.thumbnail = numbers.get(&(c.edge.clone(), c.camera.clone())).copied();
    }
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

fn worker_rows(snap: &Snapshot) -> Vec<WorkerRow> {
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

fn model_rows(snap: &Snapshot) -> Vec<ModelRow> {
    let cameras_of = |name: &str| snap.cameras.iter().filter(|c| c.model == name).count();
    let mut rows: Vec<ModelRow> = snap
        .models
        .iter()
        .map(|m| ModelRow {
            name: m.name.clone(),
            version: Some(m.version),
            workers: m.workers,
            queued: m.queued,
            max_batch: m.max_batch,
            cameras: cameras_of(&m.name),
            budget_ms: m.budget_ms,
        })
        .collect();
    for c in &snap.cameras {
        if !rows.iter().any(|r| r.name == c.model) {
            rows.push(ModelRow {
                name: c.model.clone(),
                version: None,
                workers: 0,
                queued: 0,
                max_batch: 0,
                cameras: cameras_of(&c.model),
                budget_ms: 0.0,
            });
        }
    }
    rows.sort_by(|a, b| a.name.cmp(&b.name));
    rows
}

/// Open cameras and those with frames in the window, sorted by shed share
/// (worst first), then by frames admitted, then by name.
fn camera_rows(snap: &Snapshot, seconds: f64) -> Vec<CameraRow> {
    let recent = &snap.timeline.recent.cameras;
    let row =
        |edge: String, camera: String, model, open, frames: crate::timeline::FrameCounts, cap| {
            CameraRow {
                edge,
                camera,
                model,
                open,
                admitted_fps: rate(frames.admitted, seconds),
                ok_fps: rate(frames.ok, seconds),
                shed_ratio: frames.shed_ratio(),
                frames: frames.into(),
                cap_fps: cap,
                thumbnail: None,
            }
        };
    let mut rows: Vec<CameraRow> = snap
        .cameras
        .iter()
        .map(|c| {
            let edge = c.edge.clone();
            let frames = recent
                .iter()
                .find(|r| r.edge == edge && r.camera == c.camera)
                .map(|r| r.frames)
                .unwrap_or_default();
            let cap = c.load.as_ref().and_then(|l| l.cap_fps);
            row(
                edge,
                c.camera.clone(),
                Some(c.model.clone()),
                true,
                frames,
                cap,
            )
        })
        .collect();
    for r in recent {
        if !rows
            .iter()
            .any(|o| o.edge == r.edge && o.camera == r.camera)
        {
            rows.push(row(
                r.edge.clone(),
                r.camera.clone(),
                None,
                false,
                r.frames,
                None,
            ));
        }
    }
    rows.sort_by(|a, b| {
        let shed = |r: &CameraRow| r.shed_ratio.unwrap_or(0.0);
        shed(b)
            .total_cmp(&shed(a))
            .then(b.frames.admitted.cmp(&a.frames.admitted))
            .then_with(|| (&a.edge, &a.camera).cmp(&(&b.edge, &b.camera)))
    });
    rows
}

fn lease_row(r: &LeaseRecord, now_ms: u64) -> LeaseRow {
    let paid = r
        .billing_start
        .map(|s| paid_until(s, now_ms, r.granularity));
    LeaseRow {
        id: r.id.0,
        provider: r.provider.clone(),
        instance_type: r.instance_type.clone(),
        tier: r.tier.as_str(),
        state: r.state.label(),
        price_per_hour: r.price_per_hour.units(),
        currency: r.currency.clone(),
        billing: match r.granularity {
            Granularity::Hour => "hour",
            Granularity::Second { .. } => "second",
        },
        billing_started_at: r.billing_start.map(Timestamp),
        paid_until_at: paid.map(Timestamp),
        block_left_ms: paid.map(|p| p.saturating_sub(now_ms)),
        cost: r.cost.units(),
    }
}

fn leasing_model(l: LeasingView<'_>, now_ms: u64) -> LeasingModel {
    let c = l.costs;
    let mut by_edge: Vec<EdgeCostRow> = l
        .recent
        .by_edge
        .iter()
        .map(|(edge, s)| EdgeCostRow {
            edge: Some(edge.clone()),
            cost: s.cost.units(),
            frames_within_slo: s.frames_within_slo,
            frames_late: s.frames_late,
            busy_s: s.busy_seconds,
            cost_per_1k_within_slo: s.cost_per_1k_within_slo,
        })
        .collect();
    if l.recent.idle.0 > 0 {
        by_edge.push(EdgeCostRow {
            edge: None,
            cost: l.recent.idle.units(),
            frames_within_slo: 0,
            frames_late: 0,
            busy_s: 0.0,
            cost_per_1k_within_slo: None,
        });
    }
    let currency = c
        .currency
        .clone()
        .or_else(|| l.live.first().map(|r| r.currency.clone()))
        .unwrap_or_default();
    LeasingModel {
        leases: l.live.iter().map(|r| lease_row(r, now_ms)).collect(),
        spend_per_hour: l.live.iter().map(|r| r.price_per_hour.units()).sum(),
        spend_cap_per_hour: l.spend_cap_per_hour,
        currency,
        total_cost: c.total.units(),
        frames_within_slo: c.frames_within_slo,
        frames_late: c.frames_late,
        cost_per_1k_within_slo: c.cost_per_1k_within_slo,
        last_day_by_edge: by_edge,
    }
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

/// Camera rows shown before the rest are collapsed behind "N more".
pub const TOP_CAMERAS: usize = 10;

/// The page's document: the model as of the request, embedded, drawn once
/// on the server (so that a client without script, or before it runs,
/// sees the tables and the banner), and the script that draws it again
/// with the plots and polls for the next.
pub fn page(model: &StatusModel) -> String {
    let json = serde_json::to_string(model).unwrap_or_else(|_| "null".into());
    // In a <script> element only `</script` ends it; escaping every `<`
    // (and `>`, `&`) as a JSON \u escape keeps any name inside the data.
    let json = json
        .replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026");
    let mut out = PAGE.to_string();
    for (mark, html) in first_paint(model) {
        out = out.replace(mark, &html);
    }
    out.replace("/*POLL_MS*/2000", &POLL_MS.to_string())
        .replace("/*MODEL*/null", &json)
}

/// A cell of a server-drawn table: text (escaped when drawn) or markup.
enum Cell {
    Text(String),
    Markup(String),
}

impl From<String> for Cell {
    fn from(s: String) -> Cell {
        Cell::Text(s)
    }
}

impl From<&str> for Cell {
    fn from(s: &str) -> Cell {
        Cell::Text(s.to_string())
    }
}

/// A table as the page's script draws it (`table()` in
/// `status_page.html`): `numeric` columns right-aligned, rows from
/// `hide_from` on hidden; or a line saying there is nothing.
fn table_html(
    head: &[&str],
    rows: Vec<Vec<Cell>>,
    none: &str,
    numeric: &[usize],
    hide_from: Option<usize>,
) -> String {
    if rows.is_empty() {
        return format!("<p class=\"none\">{}</p>", escape(none));
    }
    let mut out = String::from("<table><tr>");
    for h in head {
        out += &format!("<th>{}</th>", escape(h));
    }
    out += "</tr>";
    for (k, row) in rows.into_iter().enumerate() {
        let hidden = hide_from.is_some_and(|h| k >= h);
        out += if hidden { "<tr hidden=\"\">" } else { "<tr>" };
        for (i, c) in row.into_iter().enumerate() {
            let class = if numeric.contains(&i) {
                " class=\"n\""
            } else {
                ""
            };
            let inner = match c {
                Cell::Text(t) => escape(&t),
                Cell::Markup(m) => m,
            };
            out += &format!("<td{class}>{inner}</td>");
        }
        out += "</tr>";
    }
    out + "</table>"
}

/// `v` to `digits` decimals, or a dash.
fn num(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "—".into(), |v| format!("{v:.digits$}"))
}

/// `v` ms to a tenth, or a dash.
fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "—".into(), |v| format!("{v:.1} ms"))
}

/// A ratio as a percentage, or a dash.
fn pct(r: Option<f64>) -> String {
    r.map_or_else(|| "—".into(), |r| format!("{:.1} %", r * 100.0))
}

/// `ms` since the Unix epoch as ISO 8601 UTC, to the second
/// (`2026-12-05T04:37:13Z`).
pub fn iso8601(ms: u64) -> String {
    let full = crate::api::json::rfc3339(ms);
    format!("{}Z", &full[..19])
}

/// A length of time in words: `45 s`, `12 min`, `3 h 5 min`, `4 d`.
pub fn span(ms: u64) -> String {
    let s = (ms + 500) / 1000;
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min", s / 60),
        3600..172_800 => format!("{} h {} min", s / 3600, s / 60 % 60),
        _ => format!("{} d", s / 86_400),
    }
}

/// A time as people read it (`3 min ago`, `in 12 min`), with its ISO 8601
/// UTC in the title (`when()` in the script).
fn when(at_ms: u64, now_ms: u64) -> String {
    let text = match at_ms.abs_diff(now_ms) {
        0..2000 => "just now".to_string(),
        d if at_ms < now_ms => format!("{} ago", span(d)),
        d => format!("in {}", span(d)),
    };
    let iso = iso8601(at_ms);
    format!("<time datetime=\"{iso}\" title=\"{iso}\">{text}</time>")
}

/// The page's first paint: each placeholder in `status_page.html` and the
/// markup the script would draw there.
fn first_paint(m: &StatusModel) -> Vec<(&'static str, String)> {
    let hidden = |h: bool| {
        if h {
            " hidden".to_string()
        } else {
            String::new()
        }
    };
    let problems: String = m
        .problems
        .iter()
        .map(|p| format!("<li data-kind=\"{}\">{}</li>", p.kind, escape(&p.message)))
        .collect();
    let more = m.cameras.len().saturating_sub(TOP_CAMERAS);
    let l = m.leasing.as_ref();
    vec![
        ("<!--BANNER_HIDDEN-->", hidden(m.problems.is_empty())),
        ("<!--PROBLEMS-->", problems),
        ("<!--WORKERS-->", workers_html(m)),
        ("<!--MODELS-->", models_html(m)),
        ("<!--CAMERAS-->", cameras_html(m)),
        ("<!--MORE_HIDDEN-->", hidden(more == 0)),
        ("<!--MORE-->", format!("{more} more")),
        ("<!--LEASING_HIDDEN-->", hidden(l.is_none())),
        (
            "<!--LEASES-->",
            l.map(|l| leases_html(l, m.generated_at.0))
                .unwrap_or_default(),
        ),
        ("<!--COSTS-->", l.map(costs_html).unwrap_or_default()),
        ("<!--TOTALS-->", totals_html(&m.totals)),
    ]
}

fn workers_html(m: &StatusModel) -> String {
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

fn models_html(m: &StatusModel) -> String {
    let rows = m
        .models
        .iter()
        .map(|r| {
            vec![
                r.name.as_str().into(),
                r.version
                    .map_or_else(|| "—".into(), |v| v.to_string())
                    .into(),
                r.workers.to_string().into(),
                r.cameras.to_string().into(),
                r.queued.to_string().into(),
                r.max_batch.to_string().into(),
                (if r.budget_ms > 0.0 {
                    format!("{} ms", r.budget_ms)
                } else {
                    "—".into()
                })
                .into(),
            ]
        })
        .collect();
    table_html(
        &[
            "model",
            "version",
            "workers",
            "cameras",
            "queued",
            "max batch",
            "budget",
        ],
        rows,
        "No model is served and no camera is open.",
        &[2, 3, 4, 5, 6],
        None,
    )
}

/// `s` as one URL path segment: unreserved bytes kept, the rest
/// percent-encoded (as the page's `encodeURIComponent`).
fn path_segment(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A camera's thumbnail: the URL of its number `n`.
pub fn thumbnail_url(edge: &str, camera: &str, n: u64) -> String {
    format!(
        "/api/v1/cameras/{}/{}/thumbnail.jpg?n={n}",
        path_segment(edge),
        path_segment(camera)
    )
}

fn cameras_html(m: &StatusModel) -> String {
    let rows = m
        .cameras
        .iter()
        .map(|c| {
            let mut row: Vec<Cell> = vec![
                c.edge.as_str().into(),
                c.camera.as_str().into(),
                c.model
                    .as_deref()
                    .filter(|_| c.open)
                    .unwrap_or("(closed)")
                    .into(),
                num(c.admitted_fps, 2).into(),
                num(c.ok_fps, 2).into(),
                pct(c.shed_ratio).into(),
                c.cap_fps
                    .map_or_else(|| "none".into(), |f| format!("{f:.1}/s"))
                    .into(),
            ];
            if m.thumbnails.is_some() {
                row.push(match c.thumbnail {
                    Some(n) => Cell::Markup(format!(
                        "<img class=\"thumb\" src=\"{}\" alt=\"{}\">",
                        escape(&thumbnail_url(&c.edge, &c.camera, n)),
                        escape(&format!("latest frame of {}", c.camera))
                    )),
                    None => "—".into(),
                });
            }
            row
        })
        .collect();
    let mut head = vec![
        "edge",
        "camera",
        "model",
        "admitted/s",
        "ok/s",
        "shed",
        "rate cap",
    ];
    if m.thumbnails.is_some() {
        head.push("latest frame");
    }
    table_html(
        &head,
        rows,
        "No camera is open.",
        &[3, 4, 5],
        Some(TOP_CAMERAS),
    )
}

fn leases_html(l: &LeasingModel, now_ms: u64) -> String {
    let rows = l
        .leases
        .iter()
        .map(|r| {
            let since = r.billing_started_at.map_or_else(
                || Cell::from("not yet"),
                |t| Cell::Markup(when(t.0, now_ms)),
            );
            let left = match (r.paid_until_at, r.block_left_ms) {
                (Some(until), Some(left)) if left > 0 => {
                    Cell::Markup(format!("{} ({} left)", when(until.0, now_ms), span(left)))
                }
                (Some(_), _) => "per second now".into(),
                _ => "—".into(),
            };
            vec![
                format!("lease-{}", r.id).into(),
                r.provider.as_str().into(),
                r.instance_type.as_str().into(),
                r.tier.into(),
                r.state.into(),
                format!("{:.2} {}/h", r.price_per_hour, r.currency).into(),
                since,
                left,
                format!("{:.2} {}", r.cost, r.currency).into(),
            ]
        })
        .collect();
    table_html(
        &[
            "lease",
            "provider",
            "type",
            "tier",
            "state",
            "price",
            "billing since",
            "paid block ends",
            "cost so far",
        ],
        rows,
        "No lease is live.",
        &[5, 8],
        None,
    )
}

fn costs_html(l: &LeasingModel) -> String {
    let rows = l
        .last_day_by_edge
        .iter()
        .map(|e| {
            vec![
                e.edge.as_deref().unwrap_or("(idle leases)").into(),
                format!("{:.2} {}", e.cost, l.currency).into(),
                e.frames_within_slo.to_string().into(),
                e.frames_late.to_string().into(),
                format!("{:.1}", e.busy_s).into(),
                num(e.cost_per_1k_within_slo, 4).into(),
            ]
        })
        .collect();
    table_html(
        &[
            "edge",
            "cost",
            "within SLO",
            "late",
            "worker s",
            "per 1000 within SLO",
        ],
        rows,
        "No lease has served a frame yet.",
        &[1, 2, 3, 4, 5],
        None,
    )
}

fn totals_html(t: &FrameTotals) -> String {
    let row = [
        t.admitted,
        t.ok,
        t.shed,
        t.expired,
        t.failed,
        t.queued,
        t.dispatched,
    ]
    .iter()
    .map(|v| Cell::from(v.to_string()))
    .collect();
    table_html(
        &[
            "admitted",
            "ok",
            "shed",
            "expired",
            "failed",
            "queued",
            "on workers",
        ],
        vec![row],
        "",
        &[0, 1, 2, 3, 4, 5, 6],
        None,
    )
}

/// The page's template: HTML, CSS and script, all inline.
const PAGE: &str = include_str!("status_page.html");

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::{CameraView, EdgeView, ModelView};
    use crate::timeline::{
        CameraWindow, FrameCounts, Percentiles, RecentWindow, Stall, TimelineView, WorkerWindow,
    };
    use tidegate_lease::{LeaseId, Money};

    const NOW: u64 = 1_764_694_800_000;

    fn counts(admitted: u64, ok: u64, shed: u64) -> FrameCounts {
        FrameCounts {
            admitted,
            ok,
            shed,
            ..FrameCounts::default()
        }
    }

    fn camera(session: u64, edge: &str, name: &str, model: &str) -> CameraView {
        CameraView {
            session,
            edge: edge.into(),
            camera: name.into(),
            model: model.into(),
            load: None,
        }
    }

    fn worker(id: u64, name: &str, demoted: bool) -> WorkerView {
        WorkerView {
            id,
            name: name.into(),
            device: "cpu".into(),
            models: vec!["blazeface".into()],
            profile: [(1, 4_000), (4, 10_000)]
                .map(|(batch, latency_us)| tidegate_protocol::ProfilePoint {
                    model: "blazeface".into(),
                    batch,
                    latency_us,
                })
                .to_vec(),
            draining: false,
            demoted,
            lease: None,
            unbound: false,
        }
    }

    fn blazeface(workers: usize) -> ModelView {
        ModelView {
            name: "blazeface".into(),
            version: 1,
            input: tidegate_protocol::InputSpec {
                width: 128,
                height: 128,
                channels: 3,
                dtype: tidegate_protocol::DType::U8,
                layout: tidegate_protocol::Layout::Nhwc,
                color: tidegate_protocol::ColorOrder::Rgb,
                resize: tidegate_protocol::Resize::Stretch,
            },
            max_batch: 8,
            queued: 0,
            workers,
            labels: Vec::new(),
            budget_ms: 80.0,
        }
    }

    /// A gateway 2 minutes up: two edges, three cameras with frames in the
    /// last minute (one closed since), a worker with 10 batches.
    fn snapshot(lobby_shed: u64) -> Snapshot {
        let recent = RecentWindow {
            start_ms: NOW - 65_000,
            end_ms: NOW - 5_000,
            frames: counts(600 + 120 + 60, 600 - lobby_shed + 120 + 60, lobby_shed),
            shed_ratio: None,
            latency: Percentiles::of(&mut [10.0, 20.0, 30.0]),
            cameras: vec![
                CameraWindow {
                    edge: "dock".into(),
                    camera: "gone".into(),
                    frames: counts(60, 60, 0),
                },
                CameraWindow {
                    edge: "lobby".into(),
                    camera: "door".into(),
                    frames: counts(600, 600 - lobby_shed, lobby_shed),
                },
                CameraWindow {
                    edge: "yard".into(),
                    camera: "gate".into(),
                    frames: counts(120, 120, 0),
                },
            ],
            other_cameras: FrameCounts::default(),
            workers: vec![WorkerWindow {
                id: 3,
                name: "w-1".into(),
                model: "blazeface".into(),
                batches: 10,
                frames: 40,
                mean_ms: 12.0,
                p95_ms: 15.0,
                own_ms: 9.0,
            }],
        };
        let mut recent = recent;
        recent.shed_ratio = recent.frames.shed_ratio();
        Snapshot {
            edges: vec![
                EdgeView {
                    id: 1,
                    name: "lobby".into(),
                },
                EdgeView {
                    id: 2,
                    name: "yard".into(),
                },
            ],
            cameras: vec![
                camera(2, "yard", "gate", "blazeface"),
                camera(1, "lobby", "door", "blazeface"),
            ],
            workers: vec![worker(3, "w-1", false)],
            models: vec![blazeface(1)],
            timeline: TimelineView {
                now_ms: NOW,
                interval_ms: crate::timeline::INTERVAL_MS,
                recent,
                ..TimelineView::default()
            },
            ..Snapshot::default()
        }
    }

    #[test]
    fn camera_rates_add_up_to_the_admitted_rate_and_sort_worst_first() {
        let m = build(&snapshot(60), None, NOW);
        assert_eq!(m.window.length_s, 60.0);
        assert_eq!(m.window.admitted_fps, Some(13.0));
        let names: Vec<(&str, &str, bool)> = m
            .cameras
            .iter()
            .map(|c| (c.edge.as_str(), c.camera.as_str(), c.open))
            .collect();
        assert_eq!(
            names,
            [
                ("lobby", "door", true),
                ("yard", "gate", true),
                ("dock", "gone", false)
            ],
            "shed first, then by frames admitted"
        );
        let sum: f64 = m.cameras.iter().filter_map(|c| c.admitted_fps).sum();
        assert!((sum - 13.0).abs() < 1e-9, "{sum}");
        assert_eq!(m.cameras[0].shed_ratio, Some(0.1));
        assert_eq!(m.cameras[0].admitted_fps, Some(10.0));
        assert_eq!(m.cameras[2].model, None);
    }

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

    fn lease(id: u64, price: f64, start: Option<u64>, granularity: Granularity) -> LeaseRecord {
        LeaseRecord {
            id: LeaseId(id),
            provider: "process".into(),
            model: Some("blazeface".into()),
            instance_type: "a100".into(),
            tier: tidegate_lease::catalog::Tier::Spot,
            price_per_hour: Money::from_units(price),
            currency: "EUR".into(),
            granularity,
            state: tidegate_lease::lifecycle::LeaseState::Ready,
            requested_at: 0,
            billing_start: start,
            ready_at: start,
            ended_at: None,
            last_seen_at: None,
            pid: None,
            provider_data: None,
            cost: Money::ZERO,
            frames_within_slo: 0,
            frames_late: 0,
            token_claimed: false,
            token: None,
        }
    }

    #[test]
    fn leases_show_the_time_left_in_their_paid_block_and_spend_near_the_cap_is_flagged() {
        let live = [
            // 100 min into hourly billing: 20 min left in the second hour
            lease(1, 5.0, Some(NOW - 100 * 60_000), Granularity::Hour),
            // per-second billing past its 60 s minimum: nothing prepaid
            lease(
                2,
                4.0,
                Some(NOW - 120_000),
                Granularity::Second { minimum_secs: 60 },
            ),
            lease(3, 0.5, None, Granularity::Hour),
        ];
        let costs = CostReport::default();
        let view = |cap| LeasingView {
            live: &live,
            costs: &costs,
            recent: &costs,
            spend_cap_per_hour: cap,
        };
        let m = build(&snapshot(0), Some(view(Some(10.5))), NOW);
        let l = m.leasing.as_ref().unwrap();
        assert_eq!(l.spend_per_hour, 9.5);
        assert_eq!(l.leases[0].block_left_ms, Some(20 * 60_000));
        assert_eq!(
            l.leases[0].paid_until_at,
            Some(Timestamp(NOW + 20 * 60_000))
        );
        assert_eq!(l.leases[1].block_left_ms, Some(0));
        assert_eq!(
            (l.leases[2].paid_until_at, l.leases[2].block_left_ms),
            (None, None)
        );
        assert_eq!(
            m.problems.len(),
            1,
            "9.5 is 90.5 % of 10.5: {:?}",
            m.problems
        );
        assert_eq!(m.problems[0].kind, "spend_near_cap");
        assert!(
            build(&snapshot(0), Some(view(Some(10.6))), NOW)
                .problems
                .is_empty(),
            "89.6 %"
        );
        assert!(
            build(&snapshot(0), Some(view(None)), NOW)
                .problems
                .is_empty(),
            "no cap"
        );
    }

    #[test]
    fn the_page_embeds_the_model_with_no_way_out_of_its_script() {
        let mut s = snapshot(0);
        s.cameras.push(camera(
            1,
            "lobby & <b>co</b>",
            "</script><img src=x onerror=alert(1)>",
            "blazeface",
        ));
        s.workers[0].name = "<i>w</i>".into();
        let m = build(&s, None, NOW);
        let html = page(&m);
        assert!(html.contains("<td>&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;</td>"));
        assert!(html.contains("<td>lobby &amp; &lt;b&gt;co&lt;/b&gt;</td>"));
        assert!(html.contains("<td>&lt;i&gt;w&lt;/i&gt;</td>"));
        assert!(!html.contains("<i>w"), "a name leaked as markup");
        assert!(!html.contains("<img"), "a name leaked as markup");
        assert!(!html.contains("<b>co"), "a name leaked as markup");
        assert_eq!(
            html.matches("</script>").count(),
            2,
            "only the page's own two scripts end"
        );
        assert!(html.contains(r"\u003c/script\u003e\u003cimg src=x onerror=alert(1)\u003e"));
        assert!(
            !html.contains("/*MODEL*/") && html.contains(&format!("const POLL_MS = {POLL_MS};"))
        );
        // what the script parses is the model
        let start = html.find(r#"type="application/json">"#).unwrap() + 24;
        let end = start + html[start..].find("</script>").unwrap();
        let back: serde_json::Value = serde_json::from_str(&html[start..end]).unwrap();
        assert_eq!(back, serde_json::to_value(&m).unwrap());
        // The only URL is the SVG namespace (a name, never fetched).
        let urls = html.matches("http://").count() + html.matches("https://").count();
        let svg_ns = html.matches("\"http://www.w3.org/2000/svg\"").count();
        assert_eq!(urls, svg_ns, "nothing is fetched from elsewhere");
        assert!(
            !html.contains("innerHTML"),
            "names go in through textContent only"
        );
    }

    #[test]
    fn times_read_as_iso_8601_and_in_words() {
        assert_eq!(iso8601(0), "1970-01-01T00:00:00Z");
        assert_eq!(iso8601(NOW), "2025-12-02T17:00:00Z");
        assert_eq!(iso8601(951_782_400_999), "2000-02-29T00:00:00Z");
        assert_eq!(iso8601(1_709_213_400_000), "2024-02-29T13:30:00Z");
        // every instant parses back to itself, to the second
        for ms in [
            0,
            86_399_000,
            951_868_799_000,
            NOW + 59_000,
            4_102_444_800_000,
        ] {
            assert_eq!(crate::api::parse_time(&iso8601(ms)), Ok(ms), "{ms}");
        }
        assert_eq!(span(44_600), "45 s");
        assert_eq!(span(12 * 60_000 + 59_000), "12 min");
        assert_eq!(span(3 * 3_600_000 + 5 * 60_000), "3 h 5 min");
        assert_eq!(span(4 * 86_400_000), "4 d");
        assert_eq!(
            when(NOW - 180_000, NOW),
            "<time datetime=\"2025-12-02T16:57:00Z\" title=\"2025-12-02T16:57:00Z\">3 min ago</time>"
        );
        assert!(when(NOW + 20 * 60_000, NOW).ends_with(">in 20 min</time>"));
        assert!(when(NOW - 1_000, NOW).ends_with(">just now</time>"));
    }

    #[test]
    fn the_first_paint_draws_the_tables_with_long_lists_collapsed() {
        let mut s = snapshot(60);
        for k in 0..12 {
            s.cameras
                .push(camera(2, "yard", &format!("extra-{k:02}"), "blazeface"));
        }
        let live = [lease(4, 5.0, Some(NOW - 100 * 60_000), Granularity::Hour)];
        let costs = CostReport::default();
        let view = LeasingView {
            live: &live,
            costs: &costs,
            recent: &costs,
            spend_cap_per_hour: None,
        };
        let m = build(&s, Some(view), NOW);
        let html = page(&m);
        assert!(!html.contains("<!--"), "every placeholder is filled");
        assert_eq!(m.cameras.len(), 15);
        let cameras = &html[html.find("<div id=\"cameras\">").unwrap()..];
        let cameras = &cameras[..cameras.find("</div>").unwrap()];
        assert_eq!(cameras.matches("<tr>").count(), 1 + TOP_CAMERAS);
        assert_eq!(cameras.matches("<tr hidden=\"\">").count(), 5);
        assert!(cameras.starts_with("<div id=\"cameras\"><table><tr><th>edge</th>"));
        assert!(cameras.contains("<tr><td>lobby</td><td>door</td><td>blazeface</td><td class=\"n\">10.00</td><td class=\"n\">9.00</td><td class=\"n\">10.0 %</td><td>none</td></tr>"), "{cameras}");
        assert!(html.contains("<button id=\"cameras-more\">5 more</button>"));
        // 60 of 780 shed at the door: flagged, before any script runs
        assert!(
            html.contains("<div id=\"banner\"><b>Problems</b><ul id=\"problems\"><li data-kind=\"shedding\">7.7 % of frames shed"),
            "{html}"
        );
        assert!(page(&build(&snapshot(0), None, NOW)).contains("<div id=\"banner\" hidden>"));
        assert!(html.contains("<td>lease-4</td><td>process</td><td>a100</td><td>spot</td><td>ready</td><td class=\"n\">5.00 EUR/h</td><td><time"), "{html}");
        assert!(
            html.contains(">in 20 min</time> (20 min left)</td>"),
            "{html}"
        );
        assert!(html.contains("<td>w-1</td><td>blazeface</td><td>cpu</td><td>serving</td><td class=\"n\">10</td><td class=\"n\">40</td><td class=\"n\">4.0</td><td class=\"n\">12.0 ms</td><td class=\"n\">15.0 ms</td><td class=\"n\">9.0 ms</td><td class=\"n\">10.0 ms</td><td class=\"n\">× 0.90</td>"), "{html}");
    }

    #[test]
    fn outside_strings_are_escaped() {
        assert_eq!(
            escape(r#"<script>alert("x&y's")</script>"#),
            "&lt;script&gt;alert(&quot;x&amp;y&#39;s&quot;)&lt;/script&gt;"
        );
    }
}
