//! The async shell around the [`Scheduler`]: one task that owns the
//! scheduler, the frame payloads and the routes to edges and workers. It
//! turns messages from connection tasks into scheduler events (stamped with
//! the gateway clock) and carries out the actions.

mod edges;
mod reports;
mod roster;
mod state;
#[cfg(test)]
pub(crate) mod tests;
mod workers;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tidegate_protocol::queue;
use tidegate_protocol::{
    BatchResult, Codec, ControlHint, Dispatch, Encoding, ErrorCode, Frame, FrameResult, InputSpec,
    ModelInfo, Register,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

use tidegate_lease::LeaseId;
use tidegate_lease::showback::Usage;

use crate::backpressure::{Backpressure, BackpressureConfig, CameraLoad};
use crate::metrics::{Metrics, WorkerLabels};
use crate::scheduler::{Counters, EdgeId, Event, Scheduler, Settings, WorkerId};
use crate::thumbnail::Thumbnails;
use state::State;

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
        /// How old it was on arrival: its time on the edge's send path and
        /// the link.
        age: Duration,
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
    /// The scheduler's estimate now at each of `profile`'s points: the
    /// registered latency as refined by the batches the worker returned
    /// (one slow batch counts at most 3 times the estimate) and relaxed
    /// back towards it while the worker ran nothing.
    pub estimate: Vec<tidegate_protocol::ProfilePoint>,
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
    /// The models the connected workers serve, as the hub last published
    /// them: a `CameraOpen` is answered from here, without a message to
    /// the hub, whose inbox every frame goes through.
    models: watch::Receiver<ServedModels>,
    /// The cameras' thumbnails, which the hub makes (off until
    /// configured).
    thumbnails: Thumbnails,
}

/// Every model some connected worker serves, by name.
pub type ServedModels = Arc<BTreeMap<String, ServedModel>>;

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

    /// What `model` is (input spec, labels, encodings), if a connected
    /// worker serves it: as the hub published it once it had handled the
    /// last worker to come or go (no message to the hub, so a flood of
    /// camera opens does not queue with the frames).
    pub fn model_info(&self, model: &str) -> Option<ServedModel> {
        self.models.borrow().get(model).cloned()
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

/// Capacity of the hub's inbox.
pub const INBOX: usize = 4096;

/// How often the back-pressure policy closes its windows.
const HINT_TICK: Duration = Duration::from_millis(100);

/// Starts the hub task; it runs until `cancel` fires. `hints` turns on
/// frame-rate hints to cameras whose frames are being shed.
pub fn spawn(
    limits: Settings,
    hints: Option<BackpressureConfig>,
    metrics: Metrics,
    cancel: CancellationToken,
    tracker: &tokio_util::task::TaskTracker,
) -> Hub {
    let (tx, rx) = mpsc::channel(INBOX);
    let thumbnails = Thumbnails::default();
    let (models_tx, models) = watch::channel(ServedModels::default());
    let state = State {
        origin: Instant::now(),
        scheduler: Scheduler::new(limits),
        backpressure: hints.map(Backpressure::new),
        metrics,
        pending: HashMap::new(),
        outputs: HashMap::new(),
        edges: HashMap::new(),
        gone_edges: std::collections::VecDeque::new(),
        workers: HashMap::new(),
        roster: Default::default(),
        worker_labels: WorkerLabels::default(),
        queue_depths: HashMap::new(),
        next_frame: 1,
        served: HashMap::new(),
        usage: HashMap::new(),
        stalled_leases: Default::default(),
        latencies: HashMap::new(),
        budgets: HashMap::new(),
        timeline: crate::timeline::Timeline::new(tidegate_lease::provider::wall_clock_ms()),
        thumbnails: thumbnails.clone(),
        tracker: tracker.clone(),
        models: models_tx,
    };
    let (last_tx, last) = watch::channel(None);
    tracker.spawn(run(state, rx, last_tx, cancel));
    Hub {
        tx,
        last,
        models,
        thumbnails,
    }
}

/// The most messages the hub handles in one turn of its loop.
const INBOX_BATCH: usize = 64;

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
            Some(m) => {
                st.handle(m);
                // What else waits is handled before the timers are armed
                // again: under load one turn serves many messages. Every
                // message expires and dispatches, so no tick is missed.
                for _ in 1..INBOX_BATCH {
                    match rx.try_recv() {
                        Ok(m) => st.handle(m),
                        Err(_) => break,
                    }
                }
            }
            None => st.step(Event::Tick),
        }
    }
    tracing::debug!(counters = ?st.scheduler.counters(), "hub stopped");
    // Before `rx` goes: a report asked for and not answered finds this.
    last.send_replace(Some(st.load_report(Vec::new())));
}
