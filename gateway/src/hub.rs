//! The async shell around the [`Scheduler`]: one task that owns the
//! scheduler, the frame payloads and the routes to edges and workers. It
//! turns messages from connection tasks into scheduler events (stamped with
//! the gateway clock) and carries out the actions.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tidegate_protocol::queue;
use tidegate_protocol::{
    BatchResult, Codec, ControlHint, Dispatch, DispatchItem, Encoding, ErrorCode, Frame,
    FrameResult, InputSpec, ItemResult, ModelInfo, Register, Status,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

use tidegate_lease::LeaseId;
use tidegate_lease::showback::Usage;

use crate::backpressure::{Backpressure, BackpressureConfig, CameraLoad};
use crate::metrics::{Metrics, WorkerLabels};
use crate::scheduler::{
    Action, Arrival, BatchId, Counters, EdgeId, Event, FrameId, Limits, Micros, Scheduler,
    WorkerId, WorkerModel,
};
use crate::thumbnail::Thumbnails;

/// Control hints on their way to one edge. The latest hint per camera
/// wins: one the connection has not written yet is replaced, never queued
/// behind, so a slow control stream or a tick with hints for many cameras
/// loses none (the back-pressure policy sends only changes, so a lost
/// "lift" would leave a camera capped for good), and what waits is bounded
/// by the edge's cameras.
#[derive(Debug, Clone, Default)]
pub struct HintBox {
    inner: Arc<HintBoxInner>,
}

#[derive(Debug, Default)]
struct HintBoxInner {
    waiting: std::sync::Mutex<std::collections::BTreeMap<String, ControlHint>>,
    posted: tokio::sync::Notify,
}

impl HintBox {
    /// An empty box.
    pub fn new() -> HintBox {
        HintBox::default()
    }

    /// Posts `hint`, replacing one for the same camera not taken yet.
    pub fn post(&self, hint: ControlHint) {
        self.waiting().insert(hint.camera.clone(), hint);
        self.inner.posted.notify_one();
    }

    /// Waits until hints are posted, then takes every one waiting, in
    /// camera order.
    pub async fn take(&self) -> Vec<ControlHint> {
        loop {
            {
                let mut waiting = self.waiting();
                if !waiting.is_empty() {
                    return std::mem::take(&mut *waiting).into_values().collect();
                }
            }
            // a post since the check left a permit: this returns at once
            self.inner.posted.notified().await;
        }
    }

    fn waiting(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<String, ControlHint>> {
        // a panic while holding it cannot leave the map half-updated
        self.inner.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Names of gone edges the hub keeps for the frames that trail them.
const GONE_EDGES_KEPT: usize = 256;

/// Messages from connection tasks to the hub.
#[derive(Debug)]
pub enum HubMsg {
    /// An edge authenticated.
    EdgeConnected {
        /// Its id.
        edge: EdgeId,
        /// Its configured name.
        name: String,
        /// Its configured weight: its name's share of the queue and of the
        /// workers against the other edges' (see [`crate::scheduler`]).
        weight: u32,
        /// Where its results go (the connection's result writer), bounded
        /// by bytes as well as results.
        results: queue::Sender<FrameResult>,
        /// Where control hints go (the connection's control-stream writer).
        hints: HintBox,
    },
    /// An edge's camera was opened.
    CameraOpened {
        /// The edge.
        edge: EdgeId,
        /// Camera name.
        camera: String,
        /// Model name.
        model: String,
        /// Its end-to-end budget per frame (ms), as the edge declared it.
        budget_ms: u32,
    },
    /// An edge disconnected.
    EdgeGone {
        /// The edge.
        edge: EdgeId,
    },
    /// A frame arrived from an edge.
    Frame {
        /// The edge.
        edge: EdgeId,
        /// The frame.
        frame: Frame,
        /// Local deadline (arrival + budget − network time − return margin).
        deadline: Instant,
    },
    /// An edge reported the end-to-end latency of a result.
    Latency {
        /// Model of the camera, if known.
        model: String,
        /// Capture to result, on the edge's clock.
        e2e: Duration,
    },
    /// A worker registered.
    WorkerConnected {
        /// Its id.
        worker: WorkerId,
        /// Its registration.
        register: Register,
        /// Where its batches go (the connection's dispatch writer).
        dispatch: mpsc::Sender<Dispatch>,
        /// The lease it serves, when it authenticated with a lease token.
        lease: Option<LeaseId>,
        /// A listed static worker (`[[leasing.static_workers]]`), by name:
        /// it serves the lease bound to that name ([`HubMsg::LeaseBound`]),
        /// and takes no batch while none is (`lease` is then ignored).
        static_worker: Option<String>,
        /// Cancelled by the hub to have the connection send the worker a
        /// `Drain` (an operator's drain).
        drain: CancellationToken,
    },
    /// An operator drains the workers registered as `name`: no new batch
    /// goes to them, and they are told to finish theirs and exit.
    DrainWorker {
        /// The worker's registered name.
        name: String,
        /// Answer: how many workers of that name are now draining (0: none
        /// is registered).
        reply: oneshot::Sender<usize>,
    },
    /// A worker returned a batch.
    BatchDone {
        /// The worker.
        worker: WorkerId,
        /// The results.
        result: BatchResult,
    },
    /// A worker said it is draining: send it nothing new.
    WorkerDraining {
        /// The worker.
        worker: WorkerId,
    },
    /// The lease shell stops dispatch to a lease's worker (release, spot
    /// notice); applies when the worker registers if it has not yet.
    LeaseDraining {
        /// The lease.
        lease: LeaseId,
    },
    /// A lease ended (released, preempted, lost): its worker is gone now,
    /// so its frames are re-homed or failed at once rather than when its
    /// connection misses its heartbeats.
    LeaseEnded {
        /// The lease.
        lease: LeaseId,
    },
    /// A static worker was bound to a lease: once it is registered (now or
    /// when it connects) it serves that lease and takes batches again.
    LeaseBound {
        /// The lease.
        lease: LeaseId,
        /// The static worker's name.
        worker_name: String,
    },
    /// A static worker's lease ended other than by its disconnection
    /// (released): it keeps its connection, unbound, and takes no new
    /// batch; the batches it holds still finish, as in a drain.
    LeaseUnbound {
        /// The lease.
        lease: LeaseId,
    },
    /// Asks for the load the autoscaler observes, and the frames served
    /// per lease since the last ask.
    LoadReport {
        /// Models to report on.
        models: Vec<String>,
        /// Answer.
        reply: oneshot::Sender<LoadReport>,
    },
    /// A worker disconnected.
    WorkerGone {
        /// The worker.
        worker: WorkerId,
    },
    /// Asks what a model is: its input and labels, and the encodings its
    /// workers decode (for `CameraAccepted`).
    ModelInfo {
        /// Model name.
        model: String,
        /// Answer: as registered, if some worker serves the model.
        reply: oneshot::Sender<Option<ServedModel>>,
    },
    /// Asks for a snapshot (for the HTTP API).
    Snapshot {
        /// Answer.
        reply: oneshot::Sender<Snapshot>,
    },
}

/// A point-in-time view of the gateway; the API's bodies are built from it
/// (`crate::api::json`).
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// Frame accounting.
    pub frames: Counters,
    /// Connected edges.
    pub edges: Vec<EdgeView>,
    /// Open cameras.
    pub cameras: Vec<CameraView>,
    /// Registered workers.
    pub workers: Vec<WorkerView>,
    /// Models served by at least one worker.
    pub models: Vec<ModelView>,
    /// The last 15 minutes, interval by interval (`crate::timeline`).
    pub timeline: crate::timeline::TimelineView,
}

/// An edge in a [`Snapshot`].
#[derive(Debug, Clone)]
pub struct EdgeView {
    /// Session id.
    pub id: u64,
    /// Configured name.
    pub name: String,
}

/// A camera in a [`Snapshot`].
#[derive(Debug, Clone)]
pub struct CameraView {
    /// Its edge's session id.
    pub session: u64,
    /// Its edge's configured name.
    pub edge: String,
    /// Camera name.
    pub camera: String,
    /// Model.
    pub model: String,
    /// Measured load and the frame-rate cap in force (after its first
    /// measurement window).
    pub load: Option<CameraLoad>,
}

/// A worker in a [`Snapshot`].
#[derive(Debug, Clone)]
pub struct WorkerView {
    /// Session id.
    pub id: u64,
    /// Its name.
    pub name: String,
    /// Its device.
    pub device: String,
    /// Models it serves.
    pub models: Vec<String>,
    /// Measured latency per model and batch size, as registered.
    pub profile: Vec<tidegate_protocol::ProfilePoint>,
    /// Takes no new batch (it is draining, or an unbound static worker).
    pub draining: bool,
    /// Demoted for failing its frames: it gets only probe batches until
    /// one succeeds (see `tidegate_gateway::health`).
    pub demoted: bool,
    /// The lease it serves, if any.
    pub lease: Option<u64>,
    /// A static worker bound to no lease: connected and registered, it
    /// waits (no batch) until the autoscaler binds it.
    pub unbound: bool,
}

/// A model in a [`Snapshot`].
#[derive(Debug, Clone)]
pub struct ModelView {
    /// Name.
    pub name: String,
    /// Version.
    pub version: u32,
    /// Input the edges send.
    pub input: InputSpec,
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

/// What the lease shell observes each tick ([`HubMsg::LoadReport`]).
#[derive(Debug, Clone, Default)]
pub struct LoadReport {
    /// Per model asked for.
    pub models: Vec<ModelLoadReport>,
    /// Registered workers that serve a lease.
    pub workers: Vec<LeasedWorker>,
    /// Frames served per lease since the last report.
    pub served: Vec<(LeaseId, Served)>,
    /// The same per lease, edge and model, for the ledger's showback.
    pub usage: Vec<UsageReport>,
    /// Leases whose worker the hub dropped as stalled since the last
    /// report (a batch far past due while its connection lived), or
    /// demoted for failing its frames (or failing its probe); the lease
    /// shell replaces those reported twice within its window.
    pub stalled: Vec<LeaseId>,
}

/// What one lease did for one edge on one model since the last report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageReport {
    /// The lease.
    pub lease: LeaseId,
    /// The edge.
    pub edge: String,
    /// The model.
    pub model: String,
    /// Frames and worker time.
    pub usage: Usage,
}

/// One model's load in a [`LoadReport`].
#[derive(Debug, Clone, PartialEq)]
pub struct ModelLoadReport {
    /// Model.
    pub model: String,
    /// Arrival rate (frames/s), from the scheduler's decaying count.
    pub arrival_fps: f64,
    /// Frames queued now.
    pub queue_depth: u64,
    /// p95 of the end-to-end latencies edges reported since the last
    /// report (ms); 0 when none were.
    pub p95_ms: f64,
    /// The budget its frames are held to (ms): the strictest its open
    /// cameras declared, else the latest frame's; 0 when neither is known.
    pub budget_ms: f64,
}

/// A leased worker in a [`LoadReport`].
#[derive(Debug, Clone, PartialEq)]
pub struct LeasedWorker {
    /// Its lease.
    pub lease: LeaseId,
    /// Measured latency per model and batch size (µs), from registration.
    pub profile: Vec<(String, u16, u32)>,
}

/// Work done by one lease's worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Served {
    /// Frames answered `ok` before their deadline.
    pub within_slo: u64,
    /// Frames it answered otherwise (`ok` too late, or `failed`).
    pub late: u64,
    /// Time it spent running batches (µs).
    pub busy_us: u64,
}

/// A handle to the hub task.
#[derive(Debug, Clone)]
pub struct Hub {
    tx: mpsc::Sender<HubMsg>,
    /// What the hub had not yet reported when it stopped.
    last: watch::Receiver<Option<LoadReport>>,
    /// The cameras' thumbnails, which the hub makes (off until
    /// configured).
    thumbnails: Thumbnails,
}

/// A model that some worker serves, as `CameraOpen` is answered from it.
#[derive(Debug, Clone, PartialEq)]
pub struct ServedModel {
    /// As its first worker registered it.
    pub info: ModelInfo,
    /// The encodings every worker serving it decodes; always raw.
    pub codecs: BTreeSet<Codec>,
}

impl ServedModel {
    /// Whether a camera of this model may send `encoding`: its workers
    /// decode it and it can carry the model's input. The refusal says why
    /// and what to use instead.
    pub fn accepts(&self, encoding: Encoding) -> Result<(), (ErrorCode, String)> {
        let codec = encoding.codec();
        let input = &self.info.input;
        codec
            .carries(input.dtype, input.layout, u32::from(input.channels))
            .map_err(|why| {
                (
                    ErrorCode::ShapeMismatch,
                    format!(
                        "model '{}' cannot take {codec} frames: {why}",
                        self.info.name
                    ),
                )
            })?;
        if !self.codecs.contains(&codec) {
            let known: Vec<&str> = self.codecs.iter().map(|c| c.name()).collect();
            return Err((
                ErrorCode::Unavailable,
                format!(
                    "no worker serving model '{}' decodes {codec} (they decode: {}); open the camera with one of those",
                    self.info.name,
                    known.join(", ")
                ),
            ));
        }
        Ok(())
    }
}

impl Hub {
    /// The cameras' thumbnails: turned on with
    /// [`Thumbnails::configure`], read by the API.
    pub fn thumbnails(&self) -> &Thumbnails {
        &self.thumbnails
    }

    /// Sends a message to the hub; false when the hub has stopped.
    pub async fn send(&self, msg: HubMsg) -> bool {
        self.tx.send(msg).await.is_ok()
    }

    /// What `model` is (input spec, labels, encodings), if a worker serves
    /// it.
    pub async fn model_info(&self, model: &str) -> Option<ServedModel> {
        let (reply, rx) = oneshot::channel();
        self.send(HubMsg::ModelInfo {
            model: model.to_string(),
            reply,
        })
        .await;
        rx.await.ok().flatten()
    }

    /// The load of `models` and the work per lease since the last call.
    pub async fn load_report(&self, models: Vec<String>) -> Option<LoadReport> {
        let (reply, rx) = oneshot::channel();
        if !self.send(HubMsg::LoadReport { models, reply }).await {
            return None;
        }
        rx.await.ok()
    }

    /// The frames served and the usage not yet taken by a
    /// [`Hub::load_report`]: from a report now while the hub runs, else
    /// what it left when it stopped (waiting for it to stop). `None` only
    /// if it ended without leaving one (it panicked). A clean shutdown asks
    /// this last, so the work of its final moments still reaches the
    /// ledger.
    pub async fn unreported(&self) -> Option<LoadReport> {
        if let Some(r) = self.load_report(Vec::new()).await {
            return Some(r);
        }
        let mut last = self.last.clone();
        let left = last.wait_for(Option::is_some).await.ok()?;
        (*left).clone()
    }

    /// A snapshot for the API.
    pub async fn snapshot(&self) -> Option<Snapshot> {
        let (reply, rx) = oneshot::channel();
        if !self.send(HubMsg::Snapshot { reply }).await {
            return None;
        }
        rx.await.ok()
    }

    /// Drains the workers registered as `name` (an operator's drain): how
    /// many there were; `None` once the hub has stopped.
    pub async fn drain_worker(&self, name: &str) -> Option<usize> {
        let (reply, rx) = oneshot::channel();
        let msg = HubMsg::DrainWorker {
            name: name.to_string(),
            reply,
        };
        if !self.send(msg).await {
            return None;
        }
        rx.await.ok()
    }
}

struct Pending {
    edge: EdgeId,
    /// The edge's name, kept for the showback after the edge has gone.
    edge_name: Arc<str>,
    frame: Frame,
    /// Local deadline.
    deadline: Micros,
    /// The lease whose worker answered it, once one has.
    served_by: Option<LeaseId>,
    /// Its share of its batch's run time on that worker (µs).
    busy_us: u64,
}

struct EdgeEntry {
    name: Arc<str>,
    results: queue::Sender<FrameResult>,
    hints: HintBox,
    /// Its open cameras: model and declared budget (ms).
    cameras: HashMap<String, (String, u32)>,
}

struct WorkerEntry {
    register: Register,
    dispatch: mpsc::Sender<Dispatch>,
    /// Takes no new batch: it retires, its lease drains, or it is an
    /// unbound static worker.
    draining: bool,
    /// It said `Drain`, or an operator drained it: it never takes a batch
    /// again, whatever lease it is bound to.
    retiring: bool,
    lease: Option<LeaseId>,
    /// A static worker's name: it serves whichever lease is bound to it.
    static_name: Option<String>,
    /// Cancelled to send the worker a `Drain`.
    drain_request: CancellationToken,
    /// Its `worker` label in the metrics ([`WorkerLabels`]).
    label: String,
}

/// Most latency reports kept per model between two load reports.
const LATENCY_SAMPLES: usize = 8192;

/// The hub's state, driven by [`run`].
struct State {
    origin: Instant,
    scheduler: Scheduler,
    metrics: Metrics,
    pending: HashMap<FrameId, Pending>,
    /// Worker results waiting for the scheduler's `Complete`.
    outputs: HashMap<FrameId, ItemResult>,
    /// When each batch was dispatched, to which worker, and its size.
    started: HashMap<BatchId, (WorkerId, Instant, usize)>,
    /// When each worker last returned a batch.
    last_done: HashMap<WorkerId, Instant>,
    edges: HashMap<EdgeId, EdgeEntry>,
    /// The names of the edges gone most recently (at most
    /// [`GONE_EDGES_KEPT`]): a frame that trails its edge's `EdgeGone` is
    /// still run, and its worker time goes to its edge's showback.
    gone_edges: std::collections::VecDeque<(EdgeId, Arc<str>)>,
    workers: HashMap<WorkerId, WorkerEntry>,
    /// The `worker` label of each connected worker's series.
    worker_labels: WorkerLabels,
    /// `tidegate_queue_depth` of each model, last set (to set it only when
    /// it moves).
    queue_depths: HashMap<String, usize>,
    next_frame: u64,
    /// Frame-rate hints for cameras whose frames are shed; `None` when
    /// hints are turned off.
    backpressure: Option<Backpressure>,
    /// Work per lease since the last load report.
    served: HashMap<LeaseId, Served>,
    /// The same per lease, edge and model (the showback).
    /// Keyed by lease and edge, then model, so that a frame's completion
    /// allocates nothing once its key has been seen.
    usage: HashMap<(LeaseId, Arc<str>), HashMap<String, Usage>>,
    /// Leases told to drain (applied to their worker when it registers).
    draining_leases: std::collections::HashSet<LeaseId>,
    /// Leases whose worker was dropped as stalled, for the next load
    /// report.
    stalled_leases: std::collections::BTreeSet<LeaseId>,
    /// The lease each static worker is bound to (applied to its worker
    /// when it registers).
    static_bindings: HashMap<String, LeaseId>,
    /// Edge-reported e2e latencies (ms) since the last load report.
    latencies: HashMap<String, Vec<f64>>,
    /// The latest frame budget per model (µs).
    budgets: HashMap<String, u32>,
    /// The last 15 minutes, for the status page.
    timeline: crate::timeline::Timeline,
    /// Each open camera's latest thumbnail, rendered off the hub's task.
    thumbnails: Thumbnails,
    /// Owns the thumbnails' blocking renders, so shutdown waits for them.
    tracker: tokio_util::task::TaskTracker,
}

/// Capacity of the hub's inbox.
pub const INBOX: usize = 4096;

/// How often the back-pressure policy closes its windows.
const HINT_TICK: Duration = Duration::from_millis(100);

/// Starts the hub task; it runs until `cancel` fires. `hints` turns on
/// frame-rate hints to cameras whose frames are being shed.
pub fn spawn(
    limits: Limits,
    hints: Option<BackpressureConfig>,
    metrics: Metrics,
    cancel: CancellationToken,
    tracker: &tokio_util::task::TaskTracker,
) -> Hub {
    let (tx, rx) = mpsc::channel(INBOX);
    let thumbnails = Thumbnails::default();
    let state = State {
        origin: Instant::now(),
        scheduler: Scheduler::new(limits),
        backpressure: hints.map(Backpressure::new),
        metrics,
        pending: HashMap::new(),
        outputs: HashMap::new(),
        started: HashMap::new(),
        last_done: HashMap::new(),
        edges: HashMap::new(),
        gone_edges: std::collections::VecDeque::new(),
        workers: HashMap::new(),
        worker_labels: WorkerLabels::default(),
        queue_depths: HashMap::new(),
        next_frame: 1,
        served: HashMap::new(),
        usage: HashMap::new(),
        draining_leases: Default::default(),
        stalled_leases: Default::default(),
        static_bindings: HashMap::new(),
        latencies: HashMap::new(),
        budgets: HashMap::new(),
        timeline: crate::timeline::Timeline::new(tidegate_lease::provider::wall_clock_ms()),
        thumbnails: thumbnails.clone(),
        tracker: tracker.clone(),
    };
    let (last_tx, last) = watch::channel(None);
    tracker.spawn(run(state, rx, last_tx, cancel));
    Hub {
        tx,
        last,
        thumbnails,
    }
}

async fn run(
    mut st: State,
    mut rx: mpsc::Receiver<HubMsg>,
    last: watch::Sender<Option<LoadReport>>,
    cancel: CancellationToken,
) {
    let mut hint_tick = tokio::time::interval(HINT_TICK);
    hint_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let wake = st
            .scheduler
            .next_wakeup()
            .map(|t| st.origin + Duration::from_micros(t));
        let msg = tokio::select! {
            _ = cancel.cancelled() => break,
            msg = rx.recv() => match msg {
                Some(m) => Some(m),
                None => break,
            },
            _ = hint_tick.tick(), if st.backpressure.is_some() => {
                st.send_hints();
                continue;
            }
            _ = async {
                match wake {
                    Some(t) => tokio::time::sleep_until(t.into()).await,
                    None => std::future::pending().await,
                }
            } => None,
        };
        match msg {
            Some(m) => st.handle(m),
            None => st.step(Event::Tick),
        }
    }
    tracing::debug!(counters = ?st.scheduler.counters(), "hub stopped");
    // Before `rx` goes: a report asked for and not answered finds this.
    last.send_replace(Some(st.load_report(Vec::new())));
}

impl State {
    fn now(&self) -> Micros {
        self.origin.elapsed().as_micros() as Micros
    }

    fn at(&self, t: Instant) -> Micros {
        t.saturating_duration_since(self.origin).as_micros() as Micros
    }

    /// A lease has ended or been unbound: forget its drain and its static
    /// binding, and return the workers that served it.
    fn forget_lease(&mut self, lease: LeaseId) -> Vec<WorkerId> {
        self.draining_leases.remove(&lease);
        self.static_bindings.retain(|_, l| *l != lease);
        self.workers
            .iter()
            .filter(|(_, w)| w.lease == Some(lease))
            .map(|(id, _)| *id)
            .collect()
    }

    /// A worker has gone (disconnected, lease ended, or wedged): forget
    /// it and its batches' timings; the scheduler re-homes or fails the
    /// frames it held.
    fn lose_worker(&mut self, worker: WorkerId) {
        if let Some(w) = self.workers.remove(&worker) {
            self.release_label(&w);
        }
        self.forget_batches(worker);
        self.step(Event::WorkerLost { worker });
    }

    /// A batch of `size` frames of `model` ran `latency_us` on `worker` as
    /// the gateway saw it (transfer included), of which the worker reported
    /// `compute_us` of its own work: the run time, and the worker's time
    /// over what its profile (which times the same work) says, under its
    /// label.
    fn observe_worker_batch(
        &self,
        worker: WorkerId,
        model: &str,
        size: usize,
        latency_us: u32,
        compute_us: u64,
    ) {
        let Some(w) = self.workers.get(&worker) else {
            return;
        };
        let labels = [w.label.as_str(), model];
        self.metrics
            .worker_batch
            .with_label_values(&labels)
            .observe(f64::from(latency_us) / 1e6);
        let mut points: Vec<(u16, u32)> = w
            .register
            .profile
            .iter()
            .filter(|p| p.model == model)
            .map(|p| (p.batch, p.latency_us))
            .collect();
        points.sort_unstable();
        // a worker that registered no profile for the model said nothing
        // to hold it to
        if points.is_empty() {
            return;
        }
        let batch = u16::try_from(size).unwrap_or(u16::MAX);
        let profiled = crate::scheduler::profile_latency_us(&points, batch);
        self.metrics
            .worker_batch_over_profile
            .with_label_values(&labels)
            .observe(compute_us as f64 / profiled.max(1.0));
    }

    /// A worker's entry went: its label is released, and its series go
    /// with the last connection holding it.
    fn release_label(&mut self, w: &WorkerEntry) {
        if let Some(label) = self.worker_labels.release(&w.label) {
            let models = w.register.models.iter().map(|m| m.name.as_str());
            self.metrics.worker_gone(&label, models);
        }
    }

    /// Drops the timing of `worker`'s batches: the scheduler re-homes or
    /// fails them, and a late result is not timed.
    fn forget_batches(&mut self, worker: WorkerId) {
        self.last_done.remove(&worker);
        self.started.retain(|_, (w, _, _)| *w != worker);
    }

    /// A worker whose entry stays (a static worker just bound) joins the
    /// scheduler afresh as a serving worker: the scheduler has no way back
    /// from draining, so it is lost there first (the batches it still held
    /// are re-homed or failed; their late results are ignored) and joins
    /// again.
    fn rejoin_worker(&mut self, worker: WorkerId) {
        let Some(w) = self.workers.get(&worker) else {
            return;
        };
        let models = worker_models(&w.register);
        let draining = w.draining;
        self.forget_batches(worker);
        self.step(Event::WorkerLost { worker });
        self.step(Event::WorkerJoined { worker, models });
        if draining {
            self.step(Event::WorkerDraining { worker });
        }
    }

    fn step(&mut self, event: Event) {
        let now = self.now();
        let retried = self.scheduler.counters().retried;
        let actions = self.scheduler.on_event(now, event);
        self.metrics
            .frames_retried
            .inc_by(self.scheduler.counters().retried - retried);
        for a in actions {
            self.act(a);
        }
        self.update_worker_gauges();
        debug_assert!(self.scheduler.counters().balanced());
    }

    fn send_hints(&mut self) {
        let now = self.now();
        let Some(bp) = self.backpressure.as_mut() else {
            return;
        };
        for h in bp.tick(now) {
            let direction = if h.max_fps == 0.0 { "lift" } else { "set" };
            let Some(edge) = self.edges.get(&h.edge) else {
                continue;
            };
            tracing::info!(edge = %edge.name, camera = %h.camera, max_fps = h.max_fps, "frame-rate hint");
            let hint = ControlHint {
                camera: h.camera,
                max_fps: h.max_fps,
                motion_threshold: 0.0,
            };
            edge.hints.post(hint);
            self.metrics.hints.with_label_values(&[direction]).inc();
        }
    }

    fn update_worker_gauges(&mut self) {
        for (model, depth) in self.scheduler.queue_lens() {
            let last = self
                .queue_depths
                .entry(model.to_string())
                .or_insert(usize::MAX);
            if *last != depth {
                *last = depth;
                self.metrics
                    .queue_depth
                    .with_label_values(&[model])
                    .set(depth as i64);
            }
        }
        self.metrics
            .workers_demoted
            .set(self.scheduler.demoted_count() as i64);
        let (total, busy) = self.scheduler.worker_counts();
        self.metrics
            .workers
            .with_label_values(&["busy"])
            .set(busy as i64);
        self.metrics
            .workers
            .with_label_values(&["idle"])
            .set((total - busy) as i64);
    }

    fn handle(&mut self, msg: HubMsg) {
        match msg {
            HubMsg::EdgeConnected {
                edge,
                name,
                weight,
                results,
                hints,
            } => {
                self.edges.insert(
                    edge,
                    EdgeEntry {
                        name: name.as_str().into(),
                        results,
                        hints,
                        cameras: HashMap::new(),
                    },
                );
                self.metrics.edges_connected.set(self.edges.len() as i64);
                self.step(Event::EdgeJoined { edge, name, weight });
            }
            HubMsg::CameraOpened {
                edge,
                camera,
                model,
                budget_ms,
            } => {
                if let Some(e) = self.edges.get_mut(&edge) {
                    e.cameras.insert(camera, (model, budget_ms));
                }
            }
            HubMsg::EdgeGone { edge } => self.edge_gone(edge),
            HubMsg::Frame {
                edge,
                frame,
                deadline,
            } => self.frame_arrived(edge, frame, deadline),
            HubMsg::Latency { model, e2e } => self.latency_reported(model, e2e),
            HubMsg::WorkerConnected {
                worker,
                register,
                dispatch,
                lease,
                static_worker,
                drain: drain_request,
            } => {
                let models = worker_models(&register);
                for m in &models {
                    self.metrics.model_known(&m.model);
                }
                // a static worker serves the lease bound to its name, if any
                let lease = match &static_worker {
                    Some(name) => self.static_bindings.get(name).copied(),
                    None => lease,
                };
                let unbound = static_worker.is_some() && lease.is_none();
                let drain = unbound || lease.is_some_and(|l| self.draining_leases.contains(&l));
                if unbound {
                    tracing::info!(worker = worker.0, name = %register.worker, "static worker registered unbound; no batch until a lease binds it");
                }
                let label = self.worker_labels.acquire(&register.worker);
                self.metrics.worker_known(&label);
                let replaced = self.workers.insert(
                    worker,
                    WorkerEntry {
                        register,
                        dispatch,
                        draining: drain,
                        retiring: false,
                        lease,
                        static_name: static_worker,
                        drain_request,
                        label,
                    },
                );
                if let Some(old) = replaced {
                    self.release_label(&old);
                }
                self.step(Event::WorkerJoined { worker, models });
                if drain {
                    self.step(Event::WorkerDraining { worker });
                }
            }
            HubMsg::BatchDone { worker, result } => self.batch_done(worker, result),
            HubMsg::WorkerDraining { worker } => {
                if let Some(w) = self.workers.get_mut(&worker) {
                    w.draining = true;
                    w.retiring = true;
                }
                self.step(Event::WorkerDraining { worker });
            }
            HubMsg::DrainWorker { name, reply } => self.drain_worker(name, reply),
            HubMsg::LeaseDraining { lease } => self.lease_draining(lease),
            HubMsg::LeaseEnded { lease } => {
                for worker in self.forget_lease(lease) {
                    tracing::info!(worker = worker.0, %lease, "lease ended; its worker is lost");
                    self.lose_worker(worker);
                }
            }
            HubMsg::LeaseBound { lease, worker_name } => self.lease_bound(lease, worker_name),
            HubMsg::LeaseUnbound { lease } => self.lease_unbound(lease),
            HubMsg::LoadReport { models, reply } => {
                let _ = reply.send(self.load_report(models));
            }
            HubMsg::WorkerGone { worker } => self.lose_worker(worker),
            HubMsg::ModelInfo { model, reply } => {
                let _ = reply.send(self.served_model(&model));
            }
            HubMsg::Snapshot { reply } => {
                let _ = reply.send(self.snapshot());
            }
        }
    }

    /// An edge's connection closed: its queued frames are dropped and it is forgotten.
    fn edge_gone(&mut self, edge: EdgeId) {
        // Its queued frames are dropped (`edge_gone`, counted), and
        // so are its frames that trail this message; those on a
        // worker still finish, and their results are counted
        // undeliverable when they complete.
        let before = self.scheduler.counters().shed;
        self.step(Event::EdgeGone { edge });
        let c = self.scheduler.counters();
        // What was on the workers, and what had ended, as it went:
        // no more than the first of its frames can end after.
        tracing::info!(
            edge = edge.0,
            dropped = c.shed - before,
            on_workers = c.dispatched,
            ended = c.ok + c.failed + c.expired,
            "edge connection gone; its queued frames dropped"
        );
        if let Some(gone) = self.edges.remove(&edge) {
            self.forget_thumbnails(&gone);
            if self.gone_edges.len() >= GONE_EDGES_KEPT {
                self.gone_edges.pop_front();
            }
            self.gone_edges.push_back((edge, gone.name));
        }
        if let Some(bp) = self.backpressure.as_mut() {
            bp.forget_edge(edge);
        }
        self.metrics.edges_connected.set(self.edges.len() as i64);
    }

    /// A frame read from an edge: admitted, tracked until it completes, and handed to the scheduler.
    fn frame_arrived(&mut self, edge: EdgeId, frame: Frame, deadline: Instant) {
        let id = FrameId(self.next_frame);
        self.next_frame += 1;
        let deadline = self.at(deadline);
        let arrival = Arrival {
            id,
            edge,
            camera: frame.camera.clone(),
            model: frame.model.clone(),
            deadline,
        };
        let now = self.now();
        // A frame can trail its edge's EdgeGone (separate tasks):
        // it is still admitted and accounted, but tracking its
        // camera for hints would outlive the edge.
        if let Some(bp) = self.backpressure.as_mut()
            && self.edges.contains_key(&edge)
        {
            bp.on_arrival(now, edge, &frame.camera);
        }
        if self.budgets.get(&frame.model) != Some(&frame.budget_us) {
            self.budgets.insert(frame.model.clone(), frame.budget_us);
        }
        let edge_name = match self.edges.get(&edge) {
            Some(e) => e.name.clone(),
            // it trails its edge's EdgeGone
            None => self
                .gone_edges
                .iter()
                .rev()
                .find(|(id, _)| *id == edge)
                .map_or_else(|| Arc::from(""), |(_, name)| name.clone()),
        };
        self.timeline.arrival(now, &edge_name, &frame.camera);
        self.pending.insert(
            id,
            Pending {
                edge,
                edge_name,
                frame,
                deadline,
                served_by: None,
                busy_us: 0,
            },
        );
        self.step(Event::FrameArrived(arrival));
    }

    /// An edge reported a frame's capture-to-result latency.
    fn latency_reported(&mut self, model: String, e2e: Duration) {
        let now = self.now();
        self.timeline.latency(now, e2e.as_secs_f64() * 1e3);
        let samples = self.latencies.entry(model.clone()).or_default();
        if samples.len() < LATENCY_SAMPLES {
            samples.push(e2e.as_secs_f64() * 1e3);
        }
        self.metrics
            .e2e_latency
            .with_label_values(&[model.as_str()])
            .observe(e2e.as_secs_f64());
    }

    /// A worker answered a batch: its answers, timings and outputs recorded, and the scheduler told.
    fn batch_done(&mut self, worker: WorkerId, result: BatchResult) {
        // Run time, not time since dispatch: a pipelined batch waits
        // on the worker for the one before it to finish.
        let done = Instant::now();
        let batch = BatchId(result.batch);
        let (latency_us, size) = match self.started.remove(&batch) {
            Some((w, t, n)) if w == worker => {
                let previous = self.last_done.insert(worker, done);
                let began = previous.map_or(t, |p| p.max(t));
                let us = done.saturating_duration_since(began).as_micros();
                (us.min(u32::MAX as u128) as u32, n)
            }
            other => {
                // Not (or no longer) this worker's batch: its frames
                // were re-homed or failed when the worker left the
                // scheduler (a rebound static worker); they end
                // there, so this late result is not theirs.
                if let Some(entry) = other {
                    self.started.insert(batch, entry);
                }
                tracing::debug!(
                    worker = worker.0,
                    batch = batch.0,
                    "result of a batch re-homed meanwhile; ignored"
                );
                return;
            }
        };
        let lease = self.workers.get(&worker).and_then(|w| w.lease);
        if let Some(l) = lease {
            self.served.entry(l).or_default().busy_us += u64::from(latency_us);
        }
        let mut outcomes = Vec::with_capacity(result.items.len());
        let mut inference_us = 0;
        // the worker's own time on the batch, as its profile
        // measures it: each frame's pre- and postprocessing, and
        // the one inference run
        let mut per_frame_us = 0u64;
        let share = u64::from(latency_us) / result.items.len().max(1) as u64;
        let shared_buffer = result.items.len() > 1;
        for mut item in result.items {
            inference_us = inference_us.max(item.timings.inference_us);
            per_frame_us +=
                u64::from(item.timings.preprocess_us) + u64::from(item.timings.postprocess_us);
            if shared_buffer {
                // Raw outputs slice the whole batch's buffer: copied
                // out, a result waiting for its edge holds its own
                // bytes (what its queue counts), not its batch's.
                for o in &mut item.outputs {
                    o.data = Bytes::copy_from_slice(&o.data);
                }
            }
            let id = FrameId(item.id);
            // Every answer goes to the scheduler, which judges the
            // worker by them (one for a frame the batch does not
            // hold is malformed); only the batch's own frames take
            // their answer's outputs.
            outcomes.push((id, item.status.clone()));
            if !self.scheduler.batch_holds(batch, id) {
                continue;
            }
            if let Some(p) = self.pending.get_mut(&id) {
                p.served_by = lease;
                p.busy_us = share;
                self.outputs.insert(id, item);
            }
        }
        let model = outcomes
            .iter()
            .find_map(|(id, _)| self.pending.get(id))
            .map(|p| p.frame.model.clone());
        if let Some(model) = model.filter(|_| size > 0) {
            self.metrics
                .inference
                .with_label_values(&[model.as_str()])
                .observe(inference_us as f64 / 1e6);
            let compute_us = per_frame_us + u64::from(inference_us);
            self.observe_worker_batch(worker, &model, size, latency_us, compute_us);
            let now = self.now();
            if let Some(w) = self.workers.get(&worker) {
                let name = w.register.worker.as_str();
                let times = crate::timeline::BatchTimes {
                    run_us: latency_us,
                    own_us: compute_us,
                };
                self.timeline
                    .batch(now, worker.0, name, &model, size, times);
            }
        }
        if let Some(w) = self.workers.get(&worker) {
            for (_, status) in &outcomes {
                self.metrics
                    .worker_frames
                    .with_label_values(&[w.label.as_str(), status.label()])
                    .inc();
            }
        }
        self.step(Event::BatchFinished {
            worker,
            batch: BatchId(result.batch),
            outcomes,
            latency_us,
        });
    }

    /// The operator drains the workers registered as `name`; answers how many.
    fn drain_worker(&mut self, name: String, reply: oneshot::Sender<usize>) {
        let ids: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(_, w)| w.register.worker == name)
            .map(|(id, _)| *id)
            .collect();
        for worker in &ids {
            if let Some(w) = self.workers.get_mut(worker) {
                w.drain_request.cancel();
                w.retiring = true;
                if !w.draining {
                    w.draining = true;
                    tracing::info!(worker = worker.0, %name, "operator drains the worker");
                    self.step(Event::WorkerDraining { worker: *worker });
                }
            }
        }
        let _ = reply.send(ids.len());
    }

    /// A lease is being released: its worker takes no new batch.
    fn lease_draining(&mut self, lease: LeaseId) {
        self.draining_leases.insert(lease);
        let ids: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(_, w)| w.lease == Some(lease) && !w.draining)
            .map(|(id, _)| *id)
            .collect();
        for worker in ids {
            if let Some(w) = self.workers.get_mut(&worker) {
                w.draining = true;
            }
            self.step(Event::WorkerDraining { worker });
        }
    }

    /// A leased worker registered: its lease is bound to it.
    fn lease_bound(&mut self, lease: LeaseId, worker_name: String) {
        self.static_bindings.insert(worker_name.clone(), lease);
        let ids: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(_, w)| {
                w.static_name.as_deref() == Some(worker_name.as_str()) && w.lease != Some(lease)
            })
            .map(|(id, _)| *id)
            .collect();
        for worker in ids {
            let drain = self.draining_leases.contains(&lease);
            let Some(w) = self.workers.get_mut(&worker) else {
                continue;
            };
            w.lease = Some(lease);
            if w.retiring {
                // it drains and exits; its lease ends when it goes
                continue;
            }
            w.draining = drain;
            tracing::info!(worker = worker.0, name = %worker_name, %lease, "static worker bound; it serves the lease");
            self.rejoin_worker(worker);
        }
    }

    /// A lease lost its worker.
    fn lease_unbound(&mut self, lease: LeaseId) {
        for worker in self.forget_lease(lease) {
            let Some(w) = self.workers.get_mut(&worker) else {
                continue;
            };
            if w.static_name.is_none() {
                // only a static worker outlives its lease
                tracing::info!(worker = worker.0, %lease, "lease ended; its worker is lost");
                self.lose_worker(worker);
                continue;
            }
            w.lease = None;
            tracing::info!(worker = worker.0, %lease, "static worker unbound; it stays connected and takes no batch");
            if !w.draining {
                w.draining = true;
                self.step(Event::WorkerDraining { worker });
            }
        }
    }

    /// The model as its first worker registered it, with the encodings
    /// every worker serving it decodes (a frame may go to any of them).
    fn served_model(&self, model: &str) -> Option<ServedModel> {
        let mut serving = self.workers.values().filter_map(|w| {
            let info = w.register.models.iter().find(|m| m.name == model)?;
            Some((info, &w.register.codecs))
        });
        let (info, codecs) = serving.next()?;
        let mut codecs: BTreeSet<Codec> = codecs.iter().copied().collect();
        for (_, more) in serving {
            codecs.retain(|c| more.contains(c));
        }
        // Raw needs no decoder: every worker takes it.
        codecs.insert(Codec::Raw);
        Some(ServedModel {
            info: info.clone(),
            codecs,
        })
    }

    fn act(&mut self, action: Action) {
        match action {
            Action::Dispatch {
                worker,
                batch,
                model,
                frames,
            } => self.dispatch(worker, batch, model, frames),
            Action::DropWorker { worker, reason } => {
                // The scheduler has already re-homed or failed its frames.
                // Dropping its entry drops its dispatch channel, which ends
                // the connection's writer and so the connection.
                let name = self
                    .workers
                    .get(&worker)
                    .map(|w| w.register.worker.clone())
                    .unwrap_or_default();
                tracing::warn!(worker = worker.0, %name, "{reason}; dropping it");
                self.metrics.workers_stalled.inc();
                let now = self.now();
                self.timeline.stalled(now, &name, &reason);
                let gone = self.workers.remove(&worker);
                if let Some(w) = &gone {
                    self.release_label(w);
                }
                let lease = gone.and_then(|w| w.lease);
                self.forget_batches(worker);
                if let Some(lease) = lease {
                    // The lease shell decides: a worker that registers
                    // again once its slow batch is done serves again; one
                    // that stalls twice, or never comes back, is replaced.
                    self.stalled_leases.insert(lease);
                }
            }
            Action::WorkerDemoted {
                worker,
                model,
                reason,
                backoff_us,
                probe_failed,
            } => {
                let Some(w) = self.workers.get(&worker) else {
                    return;
                };
                let name = w.register.worker.as_str();
                let backoff_ms = backoff_us / 1000;
                if probe_failed {
                    tracing::warn!(worker = worker.0, %name, %model, backoff_ms, "probe failed: {reason}; the worker stays demoted");
                } else {
                    tracing::warn!(worker = worker.0, %name, %model, backoff_ms, "worker demoted: {reason}; it gets no batch until a probe succeeds");
                    self.metrics
                        .worker_demotions
                        .with_label_values(&[model.as_str(), reason.label()])
                        .inc();
                }
                if let Some(lease) = w.lease {
                    // The stall hook: the lease shell keeps a lease after
                    // one report and replaces it at the second within its
                    // window, so a worker that fails its probe too is
                    // replaced, and one demoted once and restored is not.
                    self.stalled_leases.insert(lease);
                }
            }
            Action::WorkerRestored { worker } => {
                let name = self
                    .workers
                    .get(&worker)
                    .map(|w| w.register.worker.clone())
                    .unwrap_or_default();
                tracing::info!(worker = worker.0, %name, "probe succeeded; the worker serves again");
            }
            Action::Complete {
                frame,
                status,
                queue_us,
                capacity,
            } => self.complete(frame, status, queue_us, capacity),
        }
    }

    /// The scheduler sends a batch: its frames' tensors go to the worker's dispatch channel; a closed or full channel loses the worker.
    fn dispatch(&mut self, worker: WorkerId, batch: BatchId, model: String, frames: Vec<FrameId>) {
        let items: Vec<DispatchItem> = frames
            .iter()
            .filter_map(|id| {
                let p = self.pending.get(id)?;
                Some(DispatchItem {
                    id: id.0,
                    camera: p.frame.camera.clone(),
                    seq: p.frame.seq,
                    geometry: p.frame.geometry,
                    tensor: p.frame.tensor.clone(),
                })
            })
            .collect();
        self.metrics
            .batch_size
            .with_label_values(&[model.as_str()])
            .observe(items.len() as f64);
        self.started
            .insert(batch, (worker, Instant::now(), items.len()));
        let msg = Dispatch {
            batch: batch.0,
            model,
            items,
        };
        let sent = self
            .workers
            .get(&worker)
            .is_some_and(|w| w.dispatch.try_send(msg).is_ok());
        if !sent {
            // The worker's connection is gone or wedged: treat it as
            // lost so its frames are re-homed or failed.
            tracing::warn!(worker = worker.0, "dispatch channel closed; worker lost");
            self.lose_worker(worker);
        }
    }

    /// A frame ended: its result (or status) goes to its edge, and its latency, outcome and cost are recorded.
    fn complete(&mut self, frame: FrameId, status: Status, queue_us: u32, capacity: bool) {
        let Some(p) = self.pending.remove(&frame) else {
            return;
        };
        let now = self.now();
        self.timeline
            .outcome(now, &p.edge_name, &p.frame.camera, &status);
        if p.busy_us > 0 {
            self.metrics
                .worker_busy
                .with_label_values(&[&*p.edge_name, p.frame.model.as_str()])
                .inc_by(p.busy_us as f64 / 1e6);
        }
        if let Some(l) = p.served_by {
            let on_time = status == Status::Ok && self.now() <= p.deadline;
            let s = self.served.entry(l).or_default();
            let models = self.usage.entry((l, p.edge_name.clone())).or_default();
            if !models.contains_key(&p.frame.model) {
                models.insert(p.frame.model.clone(), Usage::default());
            }
            let u = models.get_mut(&p.frame.model).expect("inserted above");
            if on_time {
                s.within_slo += 1;
                u.within_slo += 1;
            } else {
                s.late += 1;
                u.late += 1;
            }
            u.busy_us += p.busy_us;
        }
        let (detections, mut timings, outputs) = match self.outputs.remove(&frame) {
            Some(item) => (item.detections, item.timings, item.outputs),
            None => Default::default(),
        };
        timings.queue_us = queue_us;
        let model = p.frame.model.as_str();
        if status == Status::Shed(tidegate_protocol::ShedReason::EdgeGone) {
            // Never run, and nobody is there to take its result.
            self.metrics
                .frames
                .with_label_values(&[model, status.label()])
                .inc();
            self.metrics
                .frames_dropped
                .with_label_values(&["edge_gone"])
                .inc();
            return;
        }
        if let Some(bp) = self.backpressure.as_mut() {
            bp.on_outcome_as(p.edge, &p.frame.camera, &status, capacity);
        }
        self.metrics
            .frames
            .with_label_values(&[model, status.label()])
            .inc();
        if matches!(status, Status::Ok | Status::Failed(_)) {
            self.metrics
                .queue_wait
                .with_label_values(&[model])
                .observe(queue_us as f64 / 1e6);
        }
        let ok = status == Status::Ok;
        if ok {
            self.thumbnail(&p, &detections);
        }
        let result = FrameResult {
            camera: p.frame.camera,
            seq: p.frame.seq,
            captured_at_us: p.frame.captured_at_us,
            detections: if ok { detections } else { Vec::new() },
            outputs: if ok { outputs } else { Vec::new() },
            status,
            timings,
        };
        let delivered = self.edges.get(&p.edge).is_some_and(|e| {
            let size = result.held_bytes();
            e.results.try_send(result, size).is_ok()
        });
        if !delivered {
            self.metrics.undeliverable.inc();
        }
    }

    /// Starts a thumbnail of a frame served `ok`, on a blocking task, if
    /// its camera is open and due for one (at most one per interval, and
    /// one under way) and thumbnails are on.
    fn thumbnail(&self, p: &Pending, detections: &[tidegate_protocol::Detection]) {
        // A frame trailing its edge's EdgeGone would make a thumbnail
        // nobody forgets.
        let open = self
            .edges
            .get(&p.edge)
            .is_some_and(|e| e.cameras.contains_key(&p.frame.camera));
        if !open {
            return;
        }
        let Some(ticket) = self
            .thumbnails
            .begin(&p.edge_name, &p.frame.camera, Instant::now())
        else {
            return;
        };
        let store = self.thumbnails.clone();
        let (tensor, geometry) = (p.frame.tensor.clone(), p.frame.geometry);
        let detections = detections.to_vec();
        let (edge, camera) = (p.edge_name.clone(), p.frame.camera.clone());
        let counted = self.metrics.thumbnails.clone();
        self.tracker.spawn_blocking(move || {
            let jpeg = crate::thumbnail::render(&tensor, &geometry, &detections, ticket.max_px);
            let result = if jpeg.is_ok() { "rendered" } else { "refused" };
            counted.with_label_values(&[result]).inc();
            if let Some(e) = store.finish(ticket, jpeg) {
                tracing::warn!(edge = %edge, camera = %camera, "no thumbnail: {e}");
            }
        });
    }

    /// Drops the thumbnails of a gone connection's cameras, except those
    /// that another connection of its edge still has open.
    fn forget_thumbnails(&self, gone: &EdgeEntry) {
        for camera in gone.cameras.keys() {
            let still_open = self
                .edges
                .values()
                .any(|e| e.name == gone.name && e.cameras.contains_key(camera));
            if !still_open {
                self.thumbnails.forget(&gone.name, camera);
            }
        }
    }

    /// The budget `model`'s frames are held to (ms): the strictest its open
    /// cameras declared; else the latest frame's (its whole budget, counted
    /// from capture since protocol version 3); 0 when neither is known.
    fn budget_ms(&self, model: &str) -> f64 {
        let declared = self
            .edges
            .values()
            .flat_map(|e| e.cameras.values())
            .filter(|(m, b)| m == model && *b > 0)
            .map(|(_, b)| *b)
            .min();
        match declared {
            Some(ms) => f64::from(ms),
            None => self.budgets.get(model).map_or(0.0, |b| *b as f64 / 1e3),
        }
    }

    fn load_report(&mut self, models: Vec<String>) -> LoadReport {
        let now = self.now();
        let models = models
            .into_iter()
            .map(|model| {
                let mut lat = self.latencies.remove(&model).unwrap_or_default();
                lat.sort_by(f64::total_cmp);
                let p95_ms = match lat.len() {
                    0 => 0.0,
                    n => lat[((n as f64 * 0.95).ceil() as usize).clamp(1, n) - 1],
                };
                ModelLoadReport {
                    arrival_fps: self.scheduler.arrival_rate(&model, now),
                    queue_depth: self.scheduler.queue_len(&model) as u64,
                    p95_ms,
                    budget_ms: self.budget_ms(&model),
                    model,
                }
            })
            .collect();
        self.latencies.clear();
        let mut workers: Vec<LeasedWorker> = self
            .workers
            .values()
            .filter_map(|w| {
                Some(LeasedWorker {
                    lease: w.lease?,
                    profile: w
                        .register
                        .profile
                        .iter()
                        .map(|p| (p.model.clone(), p.batch, p.latency_us))
                        .collect(),
                })
            })
            .collect();
        workers.sort_by_key(|w| w.lease);
        let mut served: Vec<(LeaseId, Served)> = self.served.drain().collect();
        served.sort_by_key(|(l, _)| *l);
        let mut usage: Vec<UsageReport> = self
            .usage
            .drain()
            .flat_map(|((lease, edge), models)| {
                models.into_iter().map(move |(model, usage)| UsageReport {
                    lease,
                    edge: edge.to_string(),
                    model,
                    usage,
                })
            })
            .collect();
        usage.sort_by(|a, b| (a.lease, &a.edge, &a.model).cmp(&(b.lease, &b.edge, &b.model)));
        LoadReport {
            models,
            workers,
            served,
            usage,
            stalled: std::mem::take(&mut self.stalled_leases)
                .into_iter()
                .collect(),
        }
    }

    fn snapshot(&self) -> Snapshot {
        let mut models: HashMap<&str, ModelView> = HashMap::new();
        for w in self.workers.values() {
            let serving = !(w.static_name.is_some() && w.lease.is_none());
            for m in &w.register.models {
                let v = models.entry(m.name.as_str()).or_insert_with(|| ModelView {
                    name: m.name.clone(),
                    version: m.version,
                    input: m.input,
                    max_batch: 0,
                    queued: self.scheduler.queue_len(&m.name),
                    workers: 0,
                    labels: m.labels.clone(),
                    budget_ms: self.budget_ms(&m.name),
                });
                v.max_batch = v.max_batch.max(m.max_batch);
                if serving {
                    v.workers += 1;
                }
            }
        }
        let mut snap = Snapshot {
            frames: self.scheduler.counters(),
            edges: self
                .edges
                .iter()
                .map(|(id, e)| EdgeView {
                    id: id.0,
                    name: e.name.to_string(),
                })
                .collect(),
            cameras: self
                .edges
                .iter()
                .flat_map(|(id, e)| {
                    e.cameras.iter().map(|(c, (m, _))| CameraView {
                        session: id.0,
                        edge: e.name.to_string(),
                        camera: c.clone(),
                        model: m.clone(),
                        load: self.backpressure.as_ref().and_then(|bp| bp.load(*id, c)),
                    })
                })
                .collect(),
            workers: self
                .workers
                .iter()
                .map(|(id, w)| WorkerView {
                    id: id.0,
                    name: w.register.worker.clone(),
                    device: w.register.device.clone(),
                    models: w.register.models.iter().map(|m| m.name.clone()).collect(),
                    profile: w.register.profile.clone(),
                    draining: w.draining,
                    demoted: self.scheduler.is_demoted(*id),
                    lease: w.lease.map(|l| l.0),
                    unbound: w.static_name.is_some() && w.lease.is_none(),
                })
                .collect(),
            models: models.into_values().collect(),
            timeline: self.timeline.view(self.now()),
        };
        snap.edges.sort_by_key(|e| e.id);
        snap.workers.sort_by_key(|w| w.id);
        snap.cameras
            .sort_by(|a, b| (&a.edge, a.session, &a.camera).cmp(&(&b.edge, b.session, &b.camera)));
        snap.models.sort_by(|a, b| a.name.cmp(&b.name));
        snap
    }
}

/// What a worker serves, as the scheduler plans with it.
fn worker_models(register: &Register) -> Vec<WorkerModel> {
    register
        .models
        .iter()
        .map(|m| WorkerModel {
            model: m.name.clone(),
            max_batch: m.max_batch,
            profile: register
                .profile
                .iter()
                .filter(|p| p.model == m.name)
                .map(|p| (p.batch, p.latency_us))
                .collect(),
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use bytes::Bytes;
    use tidegate_protocol::{
        ColorOrder, DType, Detection, Geometry, Layout, OutputTensor, ProfilePoint, Resize, Tensor,
        Timings,
    };

    /// The model of [`register`] and [`frame`].
    pub(crate) const MODEL: &str = "m";

    /// A worker serving [`MODEL`], batch 1 at 1 ms.
    pub(crate) fn register() -> Register {
        Register {
            worker: "lease-7".into(),
            device: "cpu".into(),
            models: vec![ModelInfo {
                name: MODEL.into(),
                version: 1,
                input: InputSpec {
                    width: 2,
                    height: 2,
                    channels: 3,
                    dtype: DType::U8,
                    layout: Layout::Nhwc,
                    color: ColorOrder::Rgb,
                    resize: Resize::Stretch,
                },
                max_batch: 1,
                labels: vec!["face".into(), "hand".into()],
            }],
            profile: vec![ProfilePoint {
                model: MODEL.into(),
                batch: 1,
                latency_us: 1000,
            }],
            codecs: vec![Codec::Raw, Codec::Jpeg],
        }
    }

    /// A 2×2 frame of camera `cam` for [`MODEL`], 80 ms budget.
    pub(crate) fn frame(seq: u64) -> Frame {
        Frame {
            camera: "cam".into(),
            seq,
            captured_at_us: 0,
            budget_us: 80_000,
            model: MODEL.into(),
            geometry: Geometry {
                source_width: 2,
                source_height: 2,
                content_x: 0,
                content_y: 0,
                content_width: 2,
                content_height: 2,
            },
            tensor: Tensor::raw(
                DType::U8,
                Layout::Nhwc,
                vec![1, 2, 2, 3],
                Bytes::from(vec![0u8; 12]),
            ),
        }
    }

    async fn recv<T>(rx: &mut mpsc::Receiver<T>) -> T {
        tokio::time::timeout(Duration::from_secs(2), rx.recv())
            .await
            .expect("in time")
            .expect("open")
    }

    /// Frame `seq` of edge 1, with 500 ms to go, sent to the hub; the
    /// batch worker 1 is given for it.
    async fn dispatched(hub: &Hub, batches: &mut mpsc::Receiver<Dispatch>, seq: u64) -> Dispatch {
        hub.send(HubMsg::Frame {
            edge: EdgeId(1),
            frame: frame(seq),
            deadline: Instant::now() + Duration::from_millis(500),
        })
        .await;
        recv(batches).await
    }

    /// The next result an edge was sent.
    async fn recv_result(rx: &mut queue::Receiver<FrameResult>) -> FrameResult {
        tokio::time::timeout(Duration::from_secs(2), rx.recv())
            .await
            .expect("in time")
            .expect("open")
    }

    /// A hub with no hints, and the token that stops it.
    fn hub() -> (Hub, CancellationToken) {
        hub_with(Metrics::new())
    }

    /// [`hub`] with `metrics` (a clone shares its series).
    fn hub_with(metrics: Metrics) -> (Hub, CancellationToken) {
        let cancel = CancellationToken::new();
        let tracker = tokio_util::task::TaskTracker::new();
        let hub = spawn(Limits::default(), None, metrics, cancel.clone(), &tracker);
        (hub, cancel)
    }

    /// Registers worker 1 (serving `MODEL`) under `lease`; its batches.
    async fn connect_worker(hub: &Hub, lease: Option<LeaseId>) -> mpsc::Receiver<Dispatch> {
        connect_worker_drainable(hub, lease).await.0
    }

    /// [`connect_worker`], with the token the hub cancels to drain it.
    async fn connect_worker_drainable(
        hub: &Hub,
        lease: Option<LeaseId>,
    ) -> (mpsc::Receiver<Dispatch>, CancellationToken) {
        let (dispatch, batches) = mpsc::channel(8);
        let drain = CancellationToken::new();
        hub.send(HubMsg::WorkerConnected {
            worker: WorkerId(1),
            register: register(),
            dispatch,
            lease,
            static_worker: None,
            drain: drain.clone(),
        })
        .await;
        (batches, drain)
    }

    /// Connects edge 1; the results it is sent.
    async fn connect_edge(hub: &Hub) -> queue::Receiver<FrameResult> {
        connect_edge_with(hub, queue::channel(8, 1 << 20)).await
    }

    /// [`connect_edge`] with its results queue.
    async fn connect_edge_with(
        hub: &Hub,
        (results, answers): (queue::Sender<FrameResult>, queue::Receiver<FrameResult>),
    ) -> queue::Receiver<FrameResult> {
        hub.send(HubMsg::EdgeConnected {
            edge: EdgeId(1),
            name: "e".into(),
            weight: 1,
            results,
            hints: HintBox::new(),
        })
        .await;
        answers
    }

    /// Worker 1 answers batch `d`, every item with `item(id)`.
    async fn answer(hub: &Hub, d: &Dispatch, item: impl Fn(u64) -> ItemResult) {
        hub.send(HubMsg::BatchDone {
            worker: WorkerId(1),
            result: BatchResult {
                batch: d.batch,
                items: d.items.iter().map(|i| item(i.id)).collect(),
            },
        })
        .await;
    }

    fn ok_item(id: u64) -> ItemResult {
        ItemResult {
            id,
            status: Status::Ok,
            detections: Vec::new(),
            timings: Timings::default(),
            outputs: Vec::new(),
        }
    }

    /// Hints wait per camera, the latest winning: a tick with hints for
    /// more cameras than any queue would hold loses none, and a waiting
    /// writer wakes when one is posted.
    #[tokio::test]
    async fn a_hint_box_keeps_the_latest_hint_of_every_camera() {
        let hints = HintBox::new();
        let hint = |camera: String, max_fps: f32| ControlHint {
            camera,
            max_fps,
            motion_threshold: 0.0,
        };
        for i in 0..200 {
            hints.post(hint(format!("cam-{i:03}"), 5.0));
        }
        hints.post(hint("cam-007".into(), 0.0));
        let taken = hints.take().await;
        assert_eq!(taken.len(), 200);
        assert_eq!(taken[7].camera, "cam-007");
        assert_eq!(taken[7].max_fps, 0.0, "the latest wins");
        assert!(
            taken
                .iter()
                .filter(|h| h.camera != "cam-007")
                .all(|h| h.max_fps == 5.0)
        );
        // empty now: a writer waits until the next post
        let writer = tokio::spawn({
            let hints = hints.clone();
            async move { hints.take().await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!writer.is_finished(), "nothing to take");
        hints.post(hint("cam-000".into(), 2.0));
        let taken = tokio::time::timeout(Duration::from_secs(2), writer)
            .await
            .expect("woken by the post")
            .unwrap();
        assert_eq!(taken.len(), 1);
        assert_eq!(
            (taken[0].camera.as_str(), taken[0].max_fps),
            ("cam-000", 2.0)
        );
    }

    /// An edge that reads no hints for a while (a slow control stream)
    /// still ends up with the policy's last word for its camera: the cap
    /// lifted, not a stale cap that no later hint corrects.
    #[tokio::test]
    async fn an_edge_that_reads_its_hints_late_gets_the_policys_last_word() {
        let metrics = Metrics::new();
        let cancel = CancellationToken::new();
        let tracker = tokio_util::task::TaskTracker::new();
        let cfg = BackpressureConfig {
            window_us: 100_000,
            relax_after: 1,
            increase: 2.0,
            ..Default::default()
        };
        let hub = spawn(
            Limits::default(),
            Some(cfg),
            metrics.clone(),
            cancel.clone(),
            &tracker,
        );
        // 50 ms a frame: of 10 frames due within 80 ms, all but the first
        // wait behind it past their deadline and are shed (capacity)
        let mut slow = register();
        slow.profile[0].latency_us = 50_000;
        let (dispatch, _batches) = mpsc::channel(8);
        hub.send(HubMsg::WorkerConnected {
            worker: WorkerId(1),
            register: slow,
            dispatch,
            lease: None,
            static_worker: None,
            drain: CancellationToken::new(),
        })
        .await;
        let (results, _answers) = queue::channel(64, 1 << 20);
        let hints = HintBox::new();
        hub.send(HubMsg::EdgeConnected {
            edge: EdgeId(1),
            name: "e".into(),
            weight: 1,
            results,
            hints: hints.clone(),
        })
        .await;
        hub.send(HubMsg::CameraOpened {
            edge: EdgeId(1),
            camera: "cam".into(),
            model: MODEL.into(),
            budget_ms: 80,
        })
        .await;
        for seq in 0..10 {
            hub.send(HubMsg::Frame {
                edge: EdgeId(1),
                frame: frame(seq),
                deadline: Instant::now() + Duration::from_millis(80),
            })
            .await;
            tokio::time::sleep(Duration::from_millis(33)).await;
        }
        let first = tokio::time::timeout(Duration::from_secs(2), hints.take())
            .await
            .expect("a hint in time");
        assert!(
            first.iter().all(|h| h.camera == "cam" && h.max_fps > 0.0),
            "{first:?}"
        );
        // the camera obeys (sends nothing): clean windows raise the cap
        // step by step, then lift it, while the edge reads nothing
        let lifted = async {
            loop {
                let snap = hub.snapshot().await.unwrap();
                if snap.cameras[0].load.is_some_and(|l| l.cap_fps.is_none()) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), lifted)
            .await
            .expect("the policy lifts the cap");
        assert!(metrics.hints.with_label_values(&["set"]).get() >= 2);
        assert_eq!(metrics.hints.with_label_values(&["lift"]).get(), 1);
        let last = tokio::time::timeout(Duration::from_secs(2), hints.take())
            .await
            .expect("the lift waits to be taken");
        assert_eq!(last.len(), 1, "{last:?}");
        assert_eq!((last[0].camera.as_str(), last[0].max_fps), ("cam", 0.0));
        cancel.cancel();
    }

    /// A worker that takes a batch and never answers (a hung GPU) while
    /// its connection lives: once the batch is the stall timeout past due,
    /// its frame ends `failed: worker stalled`, its dispatch channel is
    /// closed (which closes the connection) and the drop is counted. Its
    /// lease is reported stalled once, for the lease shell to judge; the
    /// same worker registering again (its batch done) serves again.
    #[tokio::test]
    async fn a_stalled_worker_is_dropped_its_frame_ends_and_its_lease_is_reported() {
        let metrics = Metrics::new();
        let cancel = CancellationToken::new();
        let tracker = tokio_util::task::TaskTracker::new();
        let limits = Limits {
            stall_us: 300_000,
            ..Limits::default()
        };
        let hub = spawn(limits, None, metrics.clone(), cancel.clone(), &tracker);
        let mut batches = connect_worker(&hub, Some(LeaseId(4))).await;
        let mut answers = connect_edge(&hub).await;
        send_frame(&hub, 1, 5_000).await;
        let d = recv(&mut batches).await;
        assert_eq!(d.items.len(), 1);
        let r = recv_result(&mut answers).await;
        assert_eq!(r.status, Status::Failed("worker stalled".into()));
        let closed = tokio::time::timeout(Duration::from_secs(2), batches.recv()).await;
        assert!(
            matches!(closed, Ok(None)),
            "dispatch channel closed: {closed:?}"
        );
        assert_eq!(metrics.workers_stalled.get(), 1);
        // Its late answer changes nothing; the hub goes on.
        answer(&hub, &d, ok_item).await;
        assert!(hub.snapshot().await.unwrap().workers.is_empty());
        let report = hub.load_report(vec![MODEL.into()]).await.unwrap();
        assert_eq!(report.stalled, vec![LeaseId(4)]);
        let report = hub.load_report(vec![MODEL.into()]).await.unwrap();
        assert!(report.stalled.is_empty(), "reported once: {report:?}");

        // The same process registers again once its batch is done: it
        // serves again.
        let (dispatch, mut again) = mpsc::channel(8);
        hub.send(HubMsg::WorkerConnected {
            worker: WorkerId(2),
            register: register(),
            dispatch,
            lease: Some(LeaseId(4)),
            static_worker: None,
            drain: CancellationToken::new(),
        })
        .await;
        send_frame(&hub, 2, 5_000).await;
        let d = recv(&mut again).await;
        hub.send(HubMsg::BatchDone {
            worker: WorkerId(2),
            result: BatchResult {
                batch: d.batch,
                items: d.items.iter().map(|i| ok_item(i.id)).collect(),
            },
        })
        .await;
        assert_eq!(recv_result(&mut answers).await.status, Status::Ok);
        cancel.cancel();
    }

    /// A frame on a worker when its edge goes still finishes (its result
    /// counted undeliverable), and its worker time is its edge's, not an
    /// unnamed edge's; a frame that trails the edge's `EdgeGone` (they come
    /// from separate tasks) is dropped unserved and counted.
    #[tokio::test]
    async fn a_running_frame_of_a_gone_edge_finishes_on_its_account_and_a_trailing_one_is_dropped()
    {
        let metrics = Metrics::new();
        let (hub, cancel) = hub_with(metrics.clone());
        let mut batches = connect_worker(&hub, Some(LeaseId(7))).await;
        let _answers = connect_edge(&hub).await;
        let d = dispatched(&hub, &mut batches, 1).await;
        hub.send(HubMsg::EdgeGone { edge: EdgeId(1) }).await;
        send_frame(&hub, 2, 500).await;
        // The hub takes its messages in order: once it answers, frame 2 was
        // handled.
        hub.snapshot().await.unwrap();
        assert!(
            batches.try_recv().is_err(),
            "a trailing frame was dispatched"
        );
        assert_eq!(
            metrics
                .frames_dropped
                .with_label_values(&["edge_gone"])
                .get(),
            1
        );
        answer(&hub, &d, ok_item).await;
        eventually_counted(&metrics, 1).await;
        let r = hub.load_report(vec![MODEL.into()]).await.unwrap();
        assert_eq!(r.usage.len(), 1, "{r:?}");
        assert_eq!(r.usage[0].edge, "e", "{r:?}");
        assert!(metrics.worker_busy.with_label_values(&["e", MODEL]).get() > 0.0);
        assert_eq!(
            metrics.worker_busy.with_label_values(&["", MODEL]).get(),
            0.0
        );
        cancel.cancel();
    }

    /// A worker's batches are timed under its name, against its profile,
    /// with its frames counted by status; frames waiting are the model's
    /// queue depth; and its series go when it does.
    #[tokio::test]
    async fn a_workers_batches_and_frames_are_labelled_with_its_name_until_it_goes() {
        let metrics = Metrics::new();
        let (hub, cancel) = hub_with(metrics.clone());
        let mut batches = connect_worker(&hub, None).await;
        let mut answers = connect_edge(&hub).await;
        let labels = ["lease-7", MODEL];
        assert_eq!(
            metrics
                .worker_frames
                .with_label_values(&["lease-7", "ok"])
                .get(),
            0,
            "exported at 0 from registration"
        );
        let d = dispatched(&hub, &mut batches, 1).await;
        // the worker holds two batches of one (the pipeline's depth): a
        // third frame waits in the queue
        let d2 = dispatched(&hub, &mut batches, 2).await;
        send_frame(&hub, 3, 500).await;
        hub.snapshot().await.unwrap();
        assert!(batches.try_recv().is_err(), "two batches at a time");
        assert_eq!(metrics.queue_depth.with_label_values(&[MODEL]).get(), 1);
        // 0.5 + 2 + 0.5 ms of the worker's own time: three times the
        // profile's 1 ms for a batch of one, whatever the transfer took
        let timed = |id| ItemResult {
            timings: Timings {
                preprocess_us: 500,
                inference_us: 2000,
                postprocess_us: 500,
                ..Timings::default()
            },
            ..ok_item(id)
        };
        answer(&hub, &d, timed).await;
        recv_result(&mut answers).await;
        let d3 = recv(&mut batches).await;
        hub.snapshot().await.unwrap();
        assert_eq!(metrics.queue_depth.with_label_values(&[MODEL]).get(), 0);
        let failed = |id| ItemResult {
            status: Status::Failed("boom".into()),
            ..timed(id)
        };
        answer(&hub, &d2, failed).await;
        answer(&hub, &d3, timed).await;
        recv_result(&mut answers).await;
        recv_result(&mut answers).await;
        hub.snapshot().await.unwrap();
        let frames = |s: &str| {
            metrics
                .worker_frames
                .with_label_values(&["lease-7", s])
                .get()
        };
        assert_eq!((frames("ok"), frames("failed"), frames("shed")), (2, 1, 0));
        let batch = metrics.worker_batch.with_label_values(&labels);
        assert_eq!(batch.get_sample_count(), 3);
        let ratio = metrics.worker_batch_over_profile.with_label_values(&labels);
        assert_eq!(ratio.get_sample_count(), 3);
        assert!(
            (ratio.get_sample_sum() - 9.0).abs() < 1e-9,
            "three batches at 3x their profile: {}",
            ratio.get_sample_sum()
        );
        hub.send(HubMsg::WorkerGone {
            worker: WorkerId(1),
        })
        .await;
        hub.snapshot().await.unwrap();
        let text = metrics.render();
        assert!(!text.contains("worker=\"lease-7\""), "{text}");
        cancel.cancel();
    }

    /// With thumbnails on, a frame served `ok` of an open camera gives its
    /// thumbnail, with its boxes; the next within the interval gives none;
    /// and the thumbnail goes with its edge. Off, nothing is kept.
    #[tokio::test]
    async fn an_ok_frame_gives_one_thumbnail_per_interval_which_goes_with_its_edge() {
        use crate::thumbnail::{NoThumbnail, ThumbnailConfig};
        let (hub, cancel) = hub();
        let mut batches = connect_worker(&hub, None).await;
        let mut answers = connect_edge(&hub).await;
        hub.send(HubMsg::CameraOpened {
            edge: EdgeId(1),
            camera: "cam".into(),
            model: MODEL.into(),
            budget_ms: 80,
        })
        .await;
        let boxed = |id| ItemResult {
            detections: vec![tidegate_protocol::Detection {
                x1: 0.0,
                y1: 0.0,
                x2: 2.0,
                y2: 2.0,
                score: 0.9,
                class: 0,
                keypoints: Vec::new(),
            }],
            ..ok_item(id)
        };
        let d = dispatched(&hub, &mut batches, 1).await;
        answer(&hub, &d, boxed).await;
        recv_result(&mut answers).await;
        assert_eq!(hub.thumbnails().cameras(), 0, "off: nothing kept");
        assert_eq!(hub.thumbnails().get("e", "cam"), Err(NoThumbnail::Off));

        hub.thumbnails().configure(Some(ThumbnailConfig {
            interval: Duration::from_secs(3600),
            max_px: 32,
        }));
        let d = dispatched(&hub, &mut batches, 2).await;
        answer(&hub, &d, boxed).await;
        recv_result(&mut answers).await;
        // Rendered on a blocking task: wait for it, boundedly.
        let mut made = None;
        for _ in 0..500 {
            if let Ok(t) = hub.thumbnails().get("e", "cam") {
                made = Some(t);
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let (number, jpeg) = made.expect("a thumbnail within 5 s");
        let img = image::load_from_memory(&jpeg).unwrap().to_rgb8();
        // A 2×2 source drawn at 2×2: the 2 px outline covers it.
        assert_eq!(img.dimensions(), (2, 2));
        assert!(img.pixels().all(|p| p[1] > 150), "{img:?}");
        // The next frame is within the interval: no render starts.
        let d = dispatched(&hub, &mut batches, 3).await;
        answer(&hub, &d, boxed).await;
        recv_result(&mut answers).await;
        assert_eq!(hub.thumbnails().get("e", "cam").unwrap().0, number);
        assert_eq!(hub.thumbnails().numbers().len(), 1);

        hub.send(HubMsg::EdgeGone { edge: EdgeId(1) }).await;
        hub.snapshot().await.unwrap();
        assert_eq!(hub.thumbnails().cameras(), 0);
        assert!(matches!(
            hub.thumbnails().get("e", "cam"),
            Err(NoThumbnail::NoneYet { .. })
        ));
        cancel.cancel();
    }

    /// The budget reported for a model is the strictest its open cameras
    /// declared, whichever frame came last; with no camera open, the latest
    /// frame's.
    #[tokio::test]
    async fn the_reported_budget_is_the_strictest_declared_not_the_last_frames() {
        let (hub, cancel) = hub();
        let _batches = connect_worker(&hub, None).await;
        let _answers = connect_edge(&hub).await;
        for (camera, budget_ms) in [("slow", 200), ("fast", 80)] {
            hub.send(HubMsg::CameraOpened {
                edge: EdgeId(1),
                camera: camera.into(),
                model: MODEL.into(),
                budget_ms,
            })
            .await;
        }
        // the last frame has 190 ms left
        let mut f = frame(1);
        f.camera = "slow".into();
        f.budget_us = 190_000;
        hub.send(HubMsg::Frame {
            edge: EdgeId(1),
            frame: f,
            deadline: Instant::now() + Duration::from_millis(190),
        })
        .await;
        let r = hub.load_report(vec![MODEL.into()]).await.unwrap();
        assert_eq!(r.models[0].budget_ms, 80.0, "{r:?}");
        // its edge gone, only the frame says
        hub.send(HubMsg::EdgeGone { edge: EdgeId(1) }).await;
        let r = hub.load_report(vec![MODEL.into()]).await.unwrap();
        assert_eq!(r.models[0].budget_ms, 190.0, "{r:?}");
        cancel.cancel();
    }

    #[tokio::test]
    async fn frames_are_counted_per_lease_and_a_drained_lease_gets_no_batch() {
        let metrics = Metrics::new();
        let (hub, cancel) = hub_with(metrics.clone());
        let mut batches = connect_worker(&hub, Some(LeaseId(7))).await;
        let mut answers = connect_edge(&hub).await;
        let deadline = Instant::now() + Duration::from_millis(500);
        hub.send(HubMsg::Frame {
            edge: EdgeId(1),
            frame: frame(1),
            deadline,
        })
        .await;
        let d = recv(&mut batches).await;
        answer(&hub, &d, ok_item).await;
        assert_eq!(recv_result(&mut answers).await.status, Status::Ok);

        let r = hub.load_report(vec![MODEL.into()]).await.unwrap();
        assert_eq!(r.served.len(), 1, "{r:?}");
        let (lease, s) = r.served[0];
        assert_eq!(lease, LeaseId(7));
        assert_eq!((s.within_slo, s.late), (1, 0));
        assert_eq!(r.workers.len(), 1);
        assert_eq!(r.workers[0].profile, vec![(MODEL.to_string(), 1, 1000)]);
        assert_eq!(r.models[0].budget_ms, 80.0);
        assert!(r.models[0].arrival_fps > 0.0, "{r:?}");
        // the same frame for the showback: lease, edge and model, with the
        // batch's run time
        assert_eq!(r.usage.len(), 1, "{r:?}");
        let u = &r.usage[0];
        assert_eq!(
            (u.lease, u.edge.as_str(), u.model.as_str()),
            (LeaseId(7), "e", MODEL)
        );
        assert_eq!((u.usage.within_slo, u.usage.late), (1, 0));
        assert_eq!(u.usage.busy_us, s.busy_us, "one frame: the whole batch");
        assert!(u.usage.busy_us > 0, "{u:?}");
        let busy = metrics.worker_busy.with_label_values(&["e", MODEL]).get();
        assert!((busy - u.usage.busy_us as f64 / 1e6).abs() < 1e-9, "{busy}");
        // counted once: the next report starts from zero
        let r = hub.load_report(vec![MODEL.into()]).await.unwrap();
        assert!(r.served.is_empty(), "{r:?}");
        assert!(r.usage.is_empty(), "{r:?}");

        // a drained lease's worker gets nothing; the frame still ends
        hub.send(HubMsg::LeaseDraining { lease: LeaseId(7) }).await;
        hub.send(HubMsg::Frame {
            edge: EdgeId(1),
            frame: frame(2),
            deadline: Instant::now() + Duration::from_millis(50),
        })
        .await;
        let answer = recv_result(&mut answers).await;
        assert_ne!(answer.status, Status::Ok, "{answer:?}");
        assert!(batches.try_recv().is_err(), "no batch to a draining lease");
        let snap = hub.snapshot().await.unwrap();
        assert!(snap.frames.balanced(), "{:?}", snap.frames);
        assert!(snap.workers[0].draining);
        cancel.cancel();
    }

    #[tokio::test]
    async fn an_operator_drain_stops_dispatch_and_asks_the_worker_to_drain() {
        let (hub, cancel) = hub();
        let (mut batches, drain) = connect_worker_drainable(&hub, None).await;
        let mut answers = connect_edge(&hub).await;
        assert_eq!(hub.drain_worker("no-such-worker").await, Some(0));
        assert!(!drain.is_cancelled());
        assert_eq!(hub.drain_worker("lease-7").await, Some(1));
        assert!(drain.is_cancelled(), "the connection is told to send Drain");
        assert!(hub.snapshot().await.unwrap().workers[0].draining);
        // again: still one, still draining
        assert_eq!(hub.drain_worker("lease-7").await, Some(1));
        hub.send(HubMsg::Frame {
            edge: EdgeId(1),
            frame: frame(1),
            deadline: Instant::now() + Duration::from_millis(50),
        })
        .await;
        let answer = recv_result(&mut answers).await;
        assert_ne!(answer.status, Status::Ok, "{answer:?}");
        assert!(batches.try_recv().is_err(), "no batch to a draining worker");
        assert!(hub.snapshot().await.unwrap().frames.balanced());
        cancel.cancel();
    }

    #[tokio::test]
    async fn a_lease_drained_before_its_worker_registers_is_drained_on_arrival() {
        let (hub, cancel) = hub();
        hub.send(HubMsg::LeaseDraining { lease: LeaseId(3) }).await;
        let _batches = connect_worker(&hub, Some(LeaseId(3))).await;
        let snap = hub.snapshot().await.unwrap();
        assert!(snap.workers[0].draining, "{:?}", snap.workers);
        // and a lease that ended takes its worker with it at once
        hub.send(HubMsg::LeaseEnded { lease: LeaseId(3) }).await;
        assert!(hub.snapshot().await.unwrap().workers.is_empty());
        cancel.cancel();
    }

    /// Registers worker 1 as the static worker `gpu-a`; its batches.
    async fn connect_static_worker(hub: &Hub) -> mpsc::Receiver<Dispatch> {
        let (dispatch, batches) = mpsc::channel(8);
        hub.send(HubMsg::WorkerConnected {
            worker: WorkerId(1),
            register: register(),
            dispatch,
            lease: None,
            static_worker: Some("gpu-a".into()),
            drain: CancellationToken::new(),
        })
        .await;
        batches
    }

    /// Sends frame `seq` of camera `cam`, due in `ms`.
    async fn send_frame(hub: &Hub, seq: u64, ms: u64) {
        hub.send(HubMsg::Frame {
            edge: EdgeId(1),
            frame: frame(seq),
            deadline: Instant::now() + Duration::from_millis(ms),
        })
        .await;
    }

    /// Worker 1's lease and whether it is unbound, as the API shows it.
    async fn static_view(hub: &Hub) -> (Option<u64>, bool, bool) {
        let snap = hub.snapshot().await.unwrap();
        assert_eq!(snap.workers.len(), 1, "{:?}", snap.workers);
        let w = &snap.workers[0];
        (w.lease, w.unbound, w.draining)
    }

    #[tokio::test]
    async fn an_unbound_static_worker_waits_connected_serves_once_bound_and_keeps_its_link_when_unbound()
     {
        let (hub, cancel) = hub();
        let mut batches = connect_static_worker(&hub).await;
        let mut answers = connect_edge(&hub).await;
        // unbound: registered (a camera may open), but no batch
        assert_eq!(static_view(&hub).await, (None, true, true));
        assert!(hub.model_info(MODEL).await.is_some());
        assert_eq!(hub.snapshot().await.unwrap().models[0].workers, 0);
        send_frame(&hub, 1, 50).await;
        let r = recv_result(&mut answers).await;
        assert_ne!(r.status, Status::Ok, "{r:?}");
        assert!(batches.try_recv().is_err(), "no batch while unbound");

        // bound: it serves the lease, and its frames count for it
        hub.send(HubMsg::LeaseBound {
            lease: LeaseId(5),
            worker_name: "gpu-a".into(),
        })
        .await;
        assert_eq!(static_view(&hub).await, (Some(5), false, false));
        send_frame(&hub, 2, 500).await;
        let d = recv(&mut batches).await;
        answer(&hub, &d, ok_item).await;
        assert_eq!(recv_result(&mut answers).await.status, Status::Ok);
        let r = hub.load_report(vec![MODEL.into()]).await.unwrap();
        assert_eq!(r.served.len(), 1, "{r:?}");
        assert_eq!(r.served[0].0, LeaseId(5));
        assert_eq!(r.workers.len(), 1);

        // released: drained, then unbound with a batch still out; the link
        // stays, the batch still finishes, and nothing new is sent
        send_frame(&hub, 3, 500).await;
        let held = recv(&mut batches).await;
        hub.send(HubMsg::LeaseDraining { lease: LeaseId(5) }).await;
        hub.send(HubMsg::LeaseUnbound { lease: LeaseId(5) }).await;
        assert_eq!(static_view(&hub).await, (None, true, true));
        assert!(
            matches!(batches.try_recv(), Err(mpsc::error::TryRecvError::Empty)),
            "the dispatch channel is still open"
        );
        answer(&hub, &held, ok_item).await;
        let r = recv_result(&mut answers).await;
        assert_eq!((r.seq, r.status), (3, Status::Ok));
        send_frame(&hub, 4, 50).await;
        let r = recv_result(&mut answers).await;
        assert_ne!(r.status, Status::Ok, "{r:?}");
        assert!(batches.try_recv().is_err(), "no batch once unbound");
        assert!(hub.load_report(vec![]).await.unwrap().workers.is_empty());

        // bound again by a later lease: it serves again
        hub.send(HubMsg::LeaseBound {
            lease: LeaseId(6),
            worker_name: "gpu-a".into(),
        })
        .await;
        assert_eq!(static_view(&hub).await, (Some(6), false, false));
        send_frame(&hub, 5, 500).await;
        let d = recv(&mut batches).await;
        answer(&hub, &d, ok_item).await;
        let r = recv_result(&mut answers).await;
        assert_eq!((r.seq, r.status), (5, Status::Ok));
        let snap = hub.snapshot().await.unwrap();
        assert!(snap.frames.balanced(), "{:?}", snap.frames);
        assert_eq!(snap.frames.admitted, 5, "{:?}", snap.frames);
        cancel.cancel();
    }

    #[tokio::test]
    async fn a_static_worker_rebound_with_a_batch_out_ends_each_frame_once() {
        let (hub, cancel) = hub();
        let bind = |lease| HubMsg::LeaseBound {
            lease: LeaseId(lease),
            worker_name: "gpu-a".into(),
        };
        // bound before it connects: it serves at once when it does
        hub.send(bind(5)).await;
        let mut batches = connect_static_worker(&hub).await;
        let mut answers = connect_edge(&hub).await;
        assert_eq!(static_view(&hub).await, (Some(5), false, false));
        send_frame(&hub, 1, 2000).await;
        let old = recv(&mut batches).await;
        // unbound and bound again before it answers (a batch slower than
        // the release's grace): the scheduler takes it back as a fresh
        // worker, so the frame it held ends there (no other worker could
        // take it: failed, worker lost) and the late answer is ignored
        hub.send(HubMsg::LeaseUnbound { lease: LeaseId(5) }).await;
        hub.send(bind(6)).await;
        let r = recv_result(&mut answers).await;
        assert_eq!(r.seq, 1);
        assert!(matches!(r.status, Status::Failed(_)), "{r:?}");
        answer(&hub, &old, ok_item).await;
        // and it serves the new lease
        send_frame(&hub, 2, 2000).await;
        let new = recv(&mut batches).await;
        assert_ne!(new.batch, old.batch);
        answer(&hub, &new, ok_item).await;
        let r = recv_result(&mut answers).await;
        assert_eq!((r.seq, r.status), (2, Status::Ok));
        let snap = hub.snapshot().await.unwrap();
        assert!(snap.frames.balanced(), "{:?}", snap.frames);
        assert_eq!(
            (snap.frames.ok, snap.frames.failed),
            (1, 1),
            "{:?}",
            snap.frames
        );
        assert!(answers.try_recv().is_none(), "one result per frame");
        let r = hub.load_report(vec![]).await.unwrap();
        assert_eq!(r.served.len(), 1, "{r:?}");
        assert_eq!(
            r.served[0].0,
            LeaseId(6),
            "the ignored answer counts for no lease"
        );
        assert_eq!((r.served[0].1.within_slo, r.served[0].1.late), (1, 0));
        // a lease that ends by the worker's loss unbinds the name too
        hub.send(HubMsg::LeaseEnded { lease: LeaseId(6) }).await;
        assert!(hub.snapshot().await.unwrap().workers.is_empty());
        let _batches = connect_static_worker(&hub).await;
        assert_eq!(static_view(&hub).await, (None, true, true));
        cancel.cancel();
    }

    #[tokio::test]
    async fn a_camera_may_ask_only_for_an_encoding_every_worker_of_its_model_decodes() {
        let (hub, cancel) = hub();
        let _batches = connect_worker(&hub, None).await;
        let served = hub.model_info(MODEL).await.unwrap();
        assert_eq!(
            served.codecs,
            BTreeSet::from([Codec::Raw, Codec::Jpeg]),
            "as registered"
        );
        served.accepts(Encoding::Raw).unwrap();
        served.accepts(Encoding::Jpeg { quality: 75 }).unwrap();
        let (code, why) = served.accepts(Encoding::Png).unwrap_err();
        assert_eq!(code, ErrorCode::Unavailable);
        assert!(
            why.contains("decodes png") && why.contains("raw, jpeg"),
            "{why}"
        );

        // A second worker of the model that decodes only raw: a JPEG frame
        // could reach it, so JPEG is refused from now on.
        let (dispatch, _more) = mpsc::channel(8);
        hub.send(HubMsg::WorkerConnected {
            worker: WorkerId(2),
            register: Register {
                worker: "raw-only".into(),
                codecs: vec![Codec::Raw],
                ..register()
            },
            dispatch,
            lease: None,
            static_worker: None,
            drain: CancellationToken::new(),
        })
        .await;
        let served = hub.model_info(MODEL).await.unwrap();
        assert_eq!(served.codecs, BTreeSet::from([Codec::Raw]));
        assert_eq!(
            served
                .accepts(Encoding::Jpeg { quality: 90 })
                .unwrap_err()
                .0,
            ErrorCode::Unavailable
        );

        // A model whose input no image codec carries is refused for good,
        // whatever the workers decode.
        let f32_model = ServedModel {
            info: ModelInfo {
                input: InputSpec {
                    dtype: DType::F32,
                    layout: Layout::Nchw,
                    ..register().models[0].input
                },
                ..register().models[0].clone()
            },
            codecs: BTreeSet::from(Codec::ALL),
        };
        let (code, why) = f32_model.accepts(Encoding::Png).unwrap_err();
        assert_eq!(code, ErrorCode::ShapeMismatch);
        assert!(why.contains("use raw"), "{why}");
        cancel.cancel();
    }

    #[tokio::test]
    async fn labels_and_raw_outputs_reach_the_edge_and_failures_carry_none() {
        let (hub, cancel) = hub();
        assert!(hub.model_info(MODEL).await.is_none(), "no worker yet");
        let mut batches = connect_worker(&hub, None).await;
        // What CameraAccepted is built from: the registered input and labels.
        let info = hub.model_info(MODEL).await.unwrap().info;
        assert_eq!(info.labels, vec!["face".to_string(), "hand".into()]);
        assert_eq!(info.input.width, 2);
        // and what /api/v1/models shows.
        let snap = hub.snapshot().await.unwrap();
        assert_eq!(snap.models[0].labels, info.labels);

        let mut answers = connect_edge(&hub).await;
        let embedding =
            OutputTensor::from_f32("embedding", vec![1, 3], &[0.25, -1.0, 4.0]).unwrap();
        for (seq, ok) in [(1, true), (2, false)] {
            let d = dispatched(&hub, &mut batches, seq).await;
            answer(&hub, &d, |id| ItemResult {
                status: if ok {
                    Status::Ok
                } else {
                    Status::Failed("bad input".into())
                },
                detections: vec![Detection {
                    x1: 0.0,
                    y1: 0.0,
                    x2: 1.0,
                    y2: 1.0,
                    score: 0.9,
                    class: 1,
                    keypoints: vec![],
                }],
                outputs: vec![embedding.clone()],
                ..ok_item(id)
            })
            .await;
            let r = recv_result(&mut answers).await;
            assert_eq!(r.seq, seq);
            if ok {
                assert_eq!(r.status, Status::Ok);
                assert_eq!(r.detections.len(), 1);
                assert_eq!(r.outputs, vec![embedding.clone()]);
            } else {
                assert!(matches!(r.status, Status::Failed(_)), "{r:?}");
                assert!(r.detections.is_empty() && r.outputs.is_empty(), "{r:?}");
            }
        }
        cancel.cancel();
    }

    #[tokio::test]
    async fn results_past_an_edges_byte_budget_are_dropped_and_counted() {
        let metrics = Metrics::new();
        // The answer for a frame not in the batch (below) demotes the
        // worker as malformed; with a 1 µs back-off its next batch is the
        // probe that restores it, so the frames that follow are still run.
        let limits = Limits {
            health: crate::health::HealthPolicy {
                backoff_us: 1,
                max_backoff_us: 1,
                ..Default::default()
            },
            ..Limits::default()
        };
        let cancel = CancellationToken::new();
        let tracker = tokio_util::task::TaskTracker::new();
        let hub = spawn(limits, None, metrics.clone(), cancel.clone(), &tracker);
        let mut batches = connect_worker(&hub, None).await;
        // 64 KiB of raw output a frame; the edge's queue has room for the
        // bytes of one such result, though it has slots for eight.
        let big = OutputTensor::from_f32("map", vec![1, 16384], &[0.5; 16384]).unwrap();
        let one = FrameResult {
            camera: "cam".into(),
            seq: 1,
            captured_at_us: 0,
            status: Status::Ok,
            detections: Vec::new(),
            timings: Default::default(),
            outputs: vec![big.clone()],
        }
        .held_bytes();
        let mut answers = connect_edge_with(&hub, queue::channel(8, one + one / 2)).await;
        let mut serve = async |seq: u64, extra: Option<u64>| {
            let d = dispatched(&hub, &mut batches, seq).await;
            let mut items: Vec<ItemResult> = d
                .items
                .iter()
                .map(|i| ItemResult {
                    outputs: vec![big.clone()],
                    ..ok_item(i.id)
                })
                .collect();
            // An answer for a frame the hub no longer holds shares the
            // batch's buffer, as the frames of a real batch do.
            items.extend(extra.map(|id| ItemResult {
                outputs: vec![big.clone()],
                ..ok_item(id)
            }));
            hub.send(HubMsg::BatchDone {
                worker: WorkerId(1),
                result: BatchResult {
                    batch: d.batch,
                    items,
                },
            })
            .await;
        };
        serve(1, Some(999)).await;
        serve(2, None).await;
        eventually_counted(&metrics, 1).await;
        let r = recv_result(&mut answers).await;
        assert_eq!((r.seq, r.status), (1, Status::Ok));
        assert_eq!(r.outputs, vec![big.clone()]);
        assert_ne!(
            r.outputs[0].data.as_ptr(),
            big.data.as_ptr(),
            "an output of a batch of many is copied out of the batch's buffer"
        );
        assert!(answers.is_empty(), "the second result did not fit");
        // Taken, its bytes are free again: the next result fits.
        serve(3, None).await;
        let r = recv_result(&mut answers).await;
        assert_eq!(r.seq, 3);
        assert_eq!(
            r.outputs[0].data.as_ptr(),
            big.data.as_ptr(),
            "the output of a batch of one is its buffer's own, not copied"
        );
        assert_eq!(metrics.undeliverable.get(), 1);
        cancel.cancel();
    }

    /// A worker that leaves a frame of its batch unanswered: the frame fails
    /// once, and the worker is demoted at once (even as the only worker),
    /// counted, shown in the API, and its lease reported to the lease
    /// shell; while it backs off it gets no batch.
    #[tokio::test]
    async fn a_worker_returning_a_short_batch_is_demoted_counted_shown_and_its_lease_reported() {
        let metrics = Metrics::new();
        let (hub, cancel) = hub_with(metrics.clone());
        let mut batches = connect_worker(&hub, Some(LeaseId(3))).await;
        let mut answers = connect_edge(&hub).await;
        let d = dispatched(&hub, &mut batches, 1).await;
        hub.send(HubMsg::BatchDone {
            worker: WorkerId(1),
            result: BatchResult {
                batch: d.batch,
                items: Vec::new(),
            },
        })
        .await;
        let r = recv_result(&mut answers).await;
        assert_eq!(
            r.status,
            Status::Failed("worker returned no result for this frame".into())
        );
        let snap = hub.snapshot().await.unwrap();
        assert!(snap.workers[0].demoted, "{:?}", snap.workers);
        assert_eq!(
            metrics
                .worker_demotions
                .with_label_values(&[MODEL, "short_result"])
                .get(),
            1
        );
        assert_eq!(metrics.workers_demoted.get(), 1);
        let report = hub.load_report(vec![]).await.unwrap();
        assert_eq!(report.stalled, vec![LeaseId(3)]);
        // Backing off (a second by default), it counts for no capacity: a
        // frame now has no worker.
        send_frame(&hub, 2, 500).await;
        let r = recv_result(&mut answers).await;
        assert_eq!(
            (r.seq, r.status),
            (2, Status::Shed(tidegate_protocol::ShedReason::NoWorker))
        );
        assert!(batches.try_recv().is_err(), "no batch while it backs off");
        assert!(answers.try_recv().is_none(), "one result per frame");
        cancel.cancel();
    }

    /// An answer for a frame of another batch is not taken: the frame keeps
    /// its own worker's answer, and the liar is demoted as malformed.
    #[tokio::test]
    async fn an_answer_for_a_frame_outside_the_batch_is_ignored_and_demotes_its_worker() {
        let metrics = Metrics::new();
        let (hub, cancel) = hub_with(metrics.clone());
        let mut batches = connect_worker(&hub, None).await;
        let mut answers = connect_edge(&hub).await;
        // Frame 1 goes to worker 1 (batch of one); a second frame queues
        // behind it for the pipeline's second slot.
        let first = dispatched(&hub, &mut batches, 1).await;
        let second = dispatched(&hub, &mut batches, 2).await;
        // Worker 1 answers its first batch, and frame 2 as well (a lie).
        hub.send(HubMsg::BatchDone {
            worker: WorkerId(1),
            result: BatchResult {
                batch: first.batch,
                items: vec![
                    ok_item(first.items[0].id),
                    ItemResult {
                        status: Status::Failed("made up".into()),
                        ..ok_item(second.items[0].id)
                    },
                ],
            },
        })
        .await;
        let r = recv_result(&mut answers).await;
        assert_eq!((r.seq, r.status), (1, Status::Ok));
        assert_eq!(
            metrics
                .worker_demotions
                .with_label_values(&[MODEL, "malformed_result"])
                .get(),
            1
        );
        // Frame 2 still ends once, by its own batch's answer.
        answer(&hub, &second, ok_item).await;
        let r = recv_result(&mut answers).await;
        assert_eq!((r.seq, r.status), (2, Status::Ok));
        let snap = hub.snapshot().await.unwrap();
        assert!(
            snap.frames.balanced() && snap.frames.ok == 2,
            "{:?}",
            snap.frames
        );
        cancel.cancel();
    }

    /// Waits until `n` results were counted undeliverable.
    async fn eventually_counted(metrics: &Metrics, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(2);
        while metrics.undeliverable.get() != n && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(metrics.undeliverable.get(), n);
    }
}
