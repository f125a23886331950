//! The scheduler: a pure, clock-injected state machine.
//!
//! It owns no sockets, no payloads and no clock. The async shell
//! (`crate::hub`) feeds it [`Event`]s with the current time in microseconds
//! and carries out the [`Action`]s it returns. Every admitted frame ends in
//! exactly one [`Action::Complete`]; [`Counters`] always satisfy
//! `admitted == ok + shed + expired + failed + in_flight`.
//!
//! Policy:
//! - one earliest-deadline-first queue per model;
//! - per camera the newest frame wins: an older frame still queued is shed
//!   (`superseded`);
//! - every configured edge (all connections under one `[[edges]]` name,
//!   see [`Event::EdgeJoined`]) is an *account* with a weight. The queue
//!   is shared by weight: an account holds at most
//!   `Limits::max_queued_per_edge` frames, and when the whole queue
//!   (`Limits::max_queued`) is full a frame of an account under its
//!   weighted share of it pushes out the least urgent frame of the account
//!   furthest over its share; a frame of an account at or over its share is
//!   refused (`overloaded`);
//! - a batch's frames are picked across accounts by start-time fair
//!   queuing (each pick goes to the account that has been served least for
//!   its weight; an account that falls idle banks no credit), earliest
//!   deadline first within an account; the batch size is still cut to the
//!   model's earliest queued deadline, so every picked frame makes its
//!   deadline;
//! - when an edge connection goes ([`Event::EdgeGone`]) its queued frames
//!   are dropped (`edge_gone`): their results would have nowhere to go.
//!   Its frames already on a worker finish as usual;
//! - a frame that no worker can finish before its deadline, given the
//!   frames queued ahead of it, the workers' measured latency profiles and
//!   when the busy ones will be free, is shed before dispatch
//!   (`would_miss_deadline`); a frame whose deadline passes while queued ends
//!   `expired`;
//! - batching is driven by the deadline and the measured rate, not by a
//!   timer. An idle worker takes the most urgent model it serves. From the
//!   model's arrival rate it picks a *target* batch: the smallest batch
//!   whose throughput on its profile keeps up with its share of the
//!   arrivals (with headroom), else the best-throughput batch, capped by the
//!   number of sending cameras without a frame running. It dispatches at
//!   once when the target is met; otherwise it holds the frames no longer
//!   than the batch should take to fill at the measured rate, and no later
//!   than the last moment a target batch would still (with a margin) finish
//!   before the earliest deadline. A batch never exceeds the best-throughput
//!   size, so where batching does not pay (a CPU) frames go one by one and
//!   never wait; the batch is always cut so that its earliest deadline
//!   holds; up to `Limits::pipeline_depth` batches are in flight per worker;
//! - a lost worker's in-flight frames are queued again if their deadline
//!   allows, otherwise they fail with `worker lost`;
//! - each finished batch refines its worker's profile, but one slow batch
//!   counts at most `OBSERVE_CAP` times the estimate (a GPU's first run of a
//!   new input shape can take a thousand times the usual), and while a
//!   worker runs nothing its estimate relaxes back towards the profile it
//!   registered (half the excess every `RELAX_HALF_LIFE_US`): an estimate
//!   that outgrew every deadline would otherwise shed the model's frames
//!   for ever, since only a dispatched batch can correct it;
//! - a worker whose running batch is `Limits::stall_us` past when its
//!   profile said it would be done is stalled (a hung GPU or runtime, while
//!   its connection and heartbeats go on): it is dropped
//!   ([`Action::DropWorker`]) and its frames are handled as a lost worker's,
//!   failing with `worker stalled`, so that no frame waits for ever;
//! - each returned batch is judged by the worker's health
//!   ([`crate::health`]): a short or malformed answer, or a failure share
//!   over `Limits::health` across its recent frames, demotes the worker
//!   ([`Action::WorkerDemoted`]). A demoted worker takes no batch and counts
//!   for no capacity while it backs off; then it is sent one small probe
//!   batch at a time, and serves again ([`Action::WorkerRestored`]) only
//!   when a probe comes back whole and mostly `ok`.

use std::collections::{BTreeSet, HashMap};

use tidegate_protocol::{ShedReason, Status};

use crate::health::{DemotionReason, Eligibility, HealthPolicy, Tally, Verdict, WorkerHealth};

/// Gateway clock, microseconds since an arbitrary origin.
pub type Micros = u64;

/// A frame admitted by the gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FrameId(pub u64);

/// A registered worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(pub u64);

/// A connected edge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EdgeId(pub u64);

/// A dispatched batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BatchId(pub u64);

/// A frame as the scheduler sees it: metadata only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arrival {
    /// Gateway-assigned id.
    pub id: FrameId,
    /// The edge it came from.
    pub edge: EdgeId,
    /// Camera name within the edge.
    pub camera: String,
    /// Model to run.
    pub model: String,
    /// Latest time by which a worker must have finished it.
    pub deadline: Micros,
}

/// What a worker serves: a model, its batch limit and measured latencies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerModel {
    /// Model name.
    pub model: String,
    /// Largest batch.
    pub max_batch: u16,
    /// (batch size, latency µs) points, measured at warm-up.
    pub profile: Vec<(u16, u32)>,
}

/// Inputs to the scheduler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A frame was admitted.
    FrameArrived(Arrival),
    /// A worker registered and is ready.
    WorkerJoined {
        /// Its id.
        worker: WorkerId,
        /// What it serves.
        models: Vec<WorkerModel>,
    },
    /// A worker returned a batch: one outcome per frame it was given.
    BatchFinished {
        /// The worker.
        worker: WorkerId,
        /// The batch.
        batch: BatchId,
        /// Per frame: `Ok` or `Failed` as reported by the worker.
        outcomes: Vec<(FrameId, Status)>,
        /// Measured run time of the batch (µs), to refine the profile.
        latency_us: u32,
    },
    /// A worker is draining (it said so, or its lease got a preemption
    /// notice): it gets no new batch; the ones it holds still finish.
    WorkerDraining {
        /// The worker.
        worker: WorkerId,
    },
    /// A worker's connection died; what it held must be re-homed.
    WorkerLost {
        /// The worker.
        worker: WorkerId,
    },
    /// An edge connection authenticated as the configured edge `name`. Its
    /// frames count to that name's account, shared by all its connections,
    /// with `weight` (the latest joined connection's weight wins). A
    /// connection that never joined is an account of its own, of weight 1.
    EdgeJoined {
        /// The connection.
        edge: EdgeId,
        /// Its configured edge name.
        name: String,
        /// Its share of the queue and of the workers, relative to the other
        /// accounts' (at least 1).
        weight: u32,
    },
    /// An edge connection closed: its queued frames end `edge_gone`, and a
    /// frame of it that arrives later (one that trails the close) too.
    EdgeGone {
        /// The connection.
        edge: EdgeId,
    },
    /// Time passed (a timer fired); expire what is due.
    Tick,
}

/// Outputs of the scheduler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Send these frames, in this order, to the worker as one batch.
    Dispatch {
        /// Target worker.
        worker: WorkerId,
        /// Batch id to echo.
        batch: BatchId,
        /// Model.
        model: String,
        /// Frames, earliest deadline first.
        frames: Vec<FrameId>,
    },
    /// The worker is stalled: close its connection. Its frames are
    /// already re-homed or failed, and it is no longer scheduled; a late
    /// result from it is ignored.
    DropWorker {
        /// The worker.
        worker: WorkerId,
        /// Why, for the log.
        reason: String,
    },
    /// The worker failed its frames (see [`crate::health`]): it gets no
    /// batch for `backoff_us`, then one probe batch at a time. Its frames
    /// are already accounted for.
    WorkerDemoted {
        /// The worker.
        worker: WorkerId,
        /// The model of the batch that demoted it.
        model: String,
        /// Why.
        reason: DemotionReason,
        /// How long it gets no batch (µs).
        backoff_us: Micros,
        /// It was already demoted and failed its probe (a demotion in a
        /// row, not a new one).
        probe_failed: bool,
    },
    /// A demoted worker's probe succeeded: it gets batches again.
    WorkerRestored {
        /// The worker.
        worker: WorkerId,
    },
    /// The frame is finished: send this result to its edge.
    Complete {
        /// The frame.
        frame: FrameId,
        /// Its final status.
        status: Status,
        /// Time it spent queued in the gateway (µs).
        queue_us: u32,
        /// Whether it was lost to the workers' capacity: it waited past its
        /// deadline, was pushed out by a full queue or a newer frame, or
        /// could not be served in time behind the frames ahead of it. What
        /// rate hints answer; a frame shed because too little of its budget
        /// was left for even an idle worker's one run (the link or the edge
        /// used it up, or the worker is slow whatever the load) is not,
        /// since fewer frames would not have saved it.
        capacity: bool,
    },
}

/// Frame accounting. At every instant
/// `admitted == ok + shed + expired + failed + in_flight()`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counters {
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

impl Counters {
    /// Frames not yet finished.
    pub fn in_flight(&self) -> u64 {
        self.queued + self.dispatched
    }

    /// Whether the accounting identity holds.
    pub fn balanced(&self) -> bool {
        self.admitted == self.ok + self.shed + self.expired + self.failed + self.in_flight()
    }
}

/// Bounds and margins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most frames queued across all models.
    pub max_queued: usize,
    /// Most frames queued per configured edge (all its connections
    /// together), whatever its weight.
    pub max_queued_per_edge: usize,
    /// Latency assumed for a worker with no profile point (µs).
    pub default_latency_us: u32,
    /// Batches sent to a worker before the previous ones return: 2 hides the
    /// gateway ↔ worker round trip behind the batch that is running.
    pub pipeline_depth: usize,
    /// How long past its expected end a running batch may go unanswered
    /// before its worker counts as stalled and is dropped (µs).
    pub stall_us: Micros,
    /// When a worker that fails its frames is demoted, and how it comes
    /// back (see [`crate::health`]).
    pub health: HealthPolicy,
}

/// Time constant of the arrival-rate estimate (µs).
const RATE_TAU_US: f64 = 500_000.0;
/// Shortest span over which a rate is believed: a first frame alone is not
/// a burst (µs).
const RATE_MIN_SPAN_US: Micros = 100_000;
/// A camera counts as sending if it sent a frame within this window (µs).
const ACTIVE_WINDOW_US: Micros = 2_000_000;
/// Held frames leave this long before the last safe moment: timers fire
/// late (tokio's resolution is 1 ms) and the dispatch itself takes time.
const HOLD_GUARD_US: Micros = 2_000;
/// Held frames leave early enough for a full batch to take this much
/// longer than its profile says.
const HOLD_LATENCY_SAFETY: f64 = 1.25;
/// A batch is held at most this many times as long as it should take to fill
/// at the measured arrival rate.
const FILL_SLACK: f64 = 1.5;
/// A batch for a busy worker is sent this long before the worker frees, so
/// it is there when the running batch ends (µs).
const PIPELINE_LEAD_US: Micros = 1_000;
/// Throughput headroom the target batch must give over the arrival rate.
const BATCH_HEADROOM: f64 = 1.2;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_queued: 4096,
            max_queued_per_edge: 256,
            default_latency_us: 20_000,
            pipeline_depth: 2,
            stall_us: 10_000_000,
            health: HealthPolicy::default(),
        }
    }
}

#[derive(Debug, Clone)]
struct Queued {
    arrival: Arrival,
    /// Who it counts to for fair shares.
    account: Account,
    enqueued: Micros,
    /// When it was (last) dispatched; queue time ends there.
    dispatched: Option<Micros>,
    /// The worker that failed it, once it is queued again for another:
    /// never sent back there, and not retried a second time.
    failed_on: Option<WorkerId>,
}

/// An observed batch time counts at most this many times the current
/// estimate, so that one outlier (a GPU's first run of an input shape:
/// cuDNN's algorithm search, allocations) cannot make every batch size look
/// hopeless at once; a worker that really slowed down is learned within a
/// few batches.
const OBSERVE_CAP: f64 = 3.0;

/// While a worker runs nothing, the excess of its estimate over the
/// profile it registered halves every this many µs. A model whose frames
/// all looked too slow to dispatch gets a batch again once the estimate has
/// relaxed enough, and that batch's time corrects the estimate.
const RELAX_HALF_LIFE_US: f64 = 2_000_000.0;

#[derive(Debug)]
struct Worker {
    models: HashMap<String, ModelProfile>,
    /// When its profiles last relaxed (or it last had a batch running).
    relaxed_at: Micros,
    /// Batches sent to it, oldest first (at most `Limits::pipeline_depth`),
    /// with their size and when its profile says each will be done.
    running: Vec<Running>,
    /// Takes no new batch.
    draining: bool,
    /// Whether it is demoted for failing its frames.
    health: WorkerHealth,
}

impl Worker {
    /// Counts for capacity and takes batches as usual: not draining, not
    /// demoted.
    fn serving(&self) -> bool {
        !self.draining && self.health.serving()
    }

    /// Could take a frame now or at its next probe: not draining, and not
    /// backing off after a demotion.
    fn available(&self) -> bool {
        !self.draining && self.health.available()
    }
}

#[derive(Debug, Clone, Copy)]
struct Running {
    batch: BatchId,
    size: usize,
    done_at: Micros,
}

impl Worker {
    /// When a batch sent now would start: batches run one after another.
    fn start_at(&self, now: Micros) -> Micros {
        self.running.last().map_or(now, |r| r.done_at.max(now))
    }
}

#[derive(Debug, Clone)]
struct ModelProfile {
    max_batch: u16,
    /// Latency (µs) per batch size 1..=max_batch, smoothed by EWMA.
    latency: Vec<f64>,
    /// `latency` as registered, before any observation.
    registered: Vec<f64>,
}

impl ModelProfile {
    fn new(m: &WorkerModel, default_latency_us: u32) -> Self {
        let max_batch = m.max_batch.max(1);
        let mut points: Vec<(u16, u32)> = m.profile.clone();
        points.sort_unstable();
        let latency: Vec<f64> = (1..=max_batch)
            .map(|b| interpolate(&points, b, default_latency_us))
            .collect();
        ModelProfile {
            max_batch,
            registered: latency.clone(),
            latency,
        }
    }

    /// Expected run time of a batch. A larger batch never runs faster than
    /// a smaller one: observations only refine the sizes actually run, so
    /// the estimate is the largest over sizes up to `batch`.
    fn latency(&self, batch: usize) -> u64 {
        let i = batch.clamp(1, self.latency.len());
        self.latency[..i]
            .iter()
            .fold(0.0f64, |m, l| m.max(*l))
            .ceil() as u64
    }

    /// Best throughput over batch sizes, in frames per µs.
    fn peak_throughput(&self) -> f64 {
        self.throughput(self.best_batch())
    }

    /// Throughput of a batch of `b`, frames per µs.
    fn throughput(&self, b: usize) -> f64 {
        b as f64 / self.latency(b).max(1) as f64
    }

    /// The batch with the highest throughput (the smallest of equals). On a
    /// GPU that is usually the largest; on a CPU, where a batch costs about
    /// as much per frame as single runs or more, it can be 1.
    fn best_batch(&self) -> usize {
        let mut best = 1;
        for b in 2..=self.max_batch as usize {
            if self.throughput(b) > self.throughput(best) * 1.02 {
                best = b;
            }
        }
        best
    }

    /// The smallest batch whose throughput covers `demand` frames per µs
    /// with headroom; the best-throughput batch when none does.
    fn batch_for(&self, demand: f64) -> usize {
        let best = self.best_batch();
        (1..=best)
            .find(|&b| self.throughput(b) >= demand * BATCH_HEADROOM)
            .unwrap_or(best)
    }

    /// Refines the profile with one measured run. The whole curve moves by
    /// the same factor: a worker that slows down (a shared or throttled
    /// device) slows down at every batch size, and a size that is rarely run
    /// must not keep its warm-up value while the others drift, or the
    /// batcher would believe the unobserved sizes are cheap.
    fn observe(&mut self, batch: usize, latency_us: u32) {
        const ALPHA: f64 = 0.2;
        let i = batch.clamp(1, self.latency.len()) - 1;
        let old = self.latency[i].max(1.0);
        let sample = (latency_us.max(1) as f64).min(old * OBSERVE_CAP);
        let new = (1.0 - ALPHA) * old + ALPHA * sample;
        let factor = new / old;
        for l in &mut self.latency {
            *l = (*l * factor).max(1.0);
        }
    }
}

impl ModelProfile {
    /// Moves each batch size's estimate back towards its registered value
    /// after `idle_us` with nothing running: the excess halves every
    /// [`RELAX_HALF_LIFE_US`]. An estimate below the registered one (a
    /// worker faster than it said) stays.
    fn relax(&mut self, idle_us: Micros) {
        // Observations scale the whole curve alike, so the first size tells
        // whether any is above its registered value.
        if self.latency[0] <= self.registered[0] {
            return;
        }
        let keep = 0.5f64.powf(idle_us as f64 / RELAX_HALF_LIFE_US);
        // Within a microsecond of it, the whole curve is back (all at once,
        // or the check above would stop the larger sizes short of it).
        if (self.latency[0] - self.registered[0]) * keep < 1.0 {
            self.latency.clone_from(&self.registered);
            return;
        }
        for (l, r) in self.latency.iter_mut().zip(&self.registered) {
            if *l > *r {
                *l = r + (*l - r) * keep;
            }
        }
    }
}

/// What a worker's profile `points` (batch size, µs; sorted by batch size)
/// say a batch of `batch` frames takes, in µs: piecewise linear, and
/// linear per frame beyond the last point. `points` must not be empty.
pub fn profile_latency_us(points: &[(u16, u32)], batch: u16) -> f64 {
    interpolate(points, batch, 0)
}

/// Piecewise-linear latency at `batch` from sorted profile points; beyond the
/// last point it grows linearly per frame; with no points, the default.
fn interpolate(points: &[(u16, u32)], batch: u16, default_latency_us: u32) -> f64 {
    match points {
        [] => default_latency_us as f64 * batch as f64,
        [(b, l)] => *l as f64 * (batch as f64 / (*b).max(1) as f64).max(1.0),
        _ => {
            if let Some(&(_, l)) = points.iter().find(|(b, _)| *b == batch) {
                return l as f64;
            }
            let (lo, hi) = match points.iter().position(|(b, _)| *b > batch) {
                Some(0) => (points[0], points[1]),
                Some(i) => (points[i - 1], points[i]),
                None => (points[points.len() - 2], points[points.len() - 1]),
            };
            let slope = (hi.1 as f64 - lo.1 as f64) / (hi.0 as f64 - lo.0 as f64).max(1.0);
            (lo.1 as f64 + slope * (batch as f64 - lo.0 as f64)).max(1.0)
        }
    }
}

/// Demand on one model: an exponentially decaying arrival count (its rate)
/// and the cameras that sent recently.
#[derive(Debug, Default)]
struct Demand {
    /// Decayed arrival count; in steady state `count = rate × RATE_TAU_US`.
    count: f64,
    /// First and last arrival.
    first: Option<Micros>,
    last: Micros,
    /// Last arrival per camera.
    cameras: HashMap<(EdgeId, String), Micros>,
    /// When `cameras` was last pruned.
    pruned: Micros,
    /// Frames of this model running on workers now.
    in_flight: usize,
}

impl Demand {
    fn arrive(&mut self, now: Micros, edge: EdgeId, camera: &str) {
        self.count = self.decayed(now) + 1.0;
        self.first.get_or_insert(now);
        self.last = self.last.max(now);
        match self.cameras.get_mut(&(edge, camera.to_string())) {
            Some(t) => *t = now,
            None => {
                self.cameras.insert((edge, camera.to_string()), now);
            }
        }
        if now.saturating_sub(self.pruned) >= ACTIVE_WINDOW_US {
            self.cameras
                .retain(|_, t| now.saturating_sub(*t) < ACTIVE_WINDOW_US);
            self.pruned = now;
        }
    }

    fn decayed(&self, now: Micros) -> f64 {
        let dt = now.saturating_sub(self.last) as f64;
        self.count * (-dt / RATE_TAU_US).exp()
    }

    /// Arrivals per µs. Early on the decayed count has not filled up yet;
    /// dividing by the weight the observed span can hold corrects that bias,
    /// so a burst is seen at its true rate from its first frames.
    fn rate(&self, now: Micros) -> f64 {
        let Some(first) = self.first else {
            return 0.0;
        };
        let span = now.saturating_sub(first).max(RATE_MIN_SPAN_US) as f64;
        let weight = RATE_TAU_US * (1.0 - (-span / RATE_TAU_US).exp());
        self.decayed(now) / weight.max(1.0)
    }
}

/// Who a frame counts to for the fair shares of the queue and of the
/// workers: its connection's configured edge name, or the connection itself
/// when it never joined (tests, a frame that beat its edge's join).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Account {
    /// A configured edge, all its connections together.
    Named(std::sync::Arc<str>),
    /// A connection that never joined.
    Connection(EdgeId),
}

/// An account's weight, backlog and service.
#[derive(Debug)]
struct Share {
    weight: u32,
    /// Its frames queued, all models.
    queued: usize,
    /// Its connections joined and not gone.
    connections: usize,
    /// Start-time fair queuing tag: [`VT_UNIT`] / `weight` per frame
    /// dispatched; never behind the scheduler's virtual time while it has
    /// frames queued.
    vtime: u64,
}

/// Virtual time one frame costs an account of weight 1. A weight of `w`
/// pays `VT_UNIT / w`; weights are at most [`MAX_WEIGHT`], so the rounding
/// is under a thousandth of a frame.
const VT_UNIT: u64 = 1_000_000_000;

/// The largest weight an edge may have (config validation holds to it).
pub const MAX_WEIGHT: u32 = 1_000_000;

/// Gone edge connections remembered, so that a frame that trails its
/// connection's close is dropped too: the shell's frame and close messages
/// come from separate tasks, and a trailing frame arrives within moments.
const GONE_EDGES_KEPT: usize = 1024;

/// The scheduler state machine. See the module docs.
#[derive(Debug)]
pub struct Scheduler {
    limits: Limits,
    /// Per model: (deadline, frame) in EDF order.
    queues: HashMap<String, BTreeSet<(Micros, FrameId)>>,
    queued: HashMap<FrameId, Queued>,
    /// The queued frame of each camera (newest wins).
    by_camera: HashMap<(EdgeId, String), FrameId>,
    /// Per model, per account: (deadline, frame) in EDF order.
    by_account: HashMap<String, HashMap<Account, BTreeSet<(Micros, FrameId)>>>,
    /// The account of each joined connection.
    accounts: HashMap<EdgeId, Account>,
    /// Accounts with frames queued or connections joined.
    shares: HashMap<Account, Share>,
    /// Start tag of the last frame picked (see [`Share::vtime`]).
    vnow: u64,
    /// Connections gone most recently, oldest first (at most
    /// [`GONE_EDGES_KEPT`]).
    gone: std::collections::VecDeque<EdgeId>,
    /// The same, to look up.
    gone_set: std::collections::HashSet<EdgeId>,
    workers: HashMap<WorkerId, Worker>,
    /// Frames each in-flight batch holds.
    batches: HashMap<BatchId, (WorkerId, Vec<Queued>)>,
    next_batch: u64,
    counters: Counters,
    /// Arrival rate and sending cameras per model.
    demand: HashMap<String, Demand>,
    /// When held frames must be sent at the latest (see the module docs).
    hold_until: Option<Micros>,
}

impl Scheduler {
    /// An empty scheduler.
    pub fn new(limits: Limits) -> Self {
        Scheduler {
            limits,
            queues: HashMap::new(),
            queued: HashMap::new(),
            by_camera: HashMap::new(),
            by_account: HashMap::new(),
            accounts: HashMap::new(),
            shares: HashMap::new(),
            vnow: 0,
            gone: std::collections::VecDeque::new(),
            gone_set: std::collections::HashSet::new(),
            workers: HashMap::new(),
            batches: HashMap::new(),
            next_batch: 1,
            counters: Counters::default(),
            demand: HashMap::new(),
            hold_until: None,
        }
    }

    /// Current accounting.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Frames queued for `model`.
    pub fn queue_len(&self, model: &str) -> usize {
        self.queues.get(model).map_or(0, BTreeSet::len)
    }

    /// Frames queued for each model that has had a queue (0 once drained).
    pub fn queue_lens(&self) -> impl Iterator<Item = (&str, usize)> {
        self.queues.iter().map(|(m, q)| (m.as_str(), q.len()))
    }

    /// The next time something is due (a queued frame expires, or held
    /// frames must be dispatched): the shell should deliver an
    /// [`Event::Tick`] then.
    pub fn next_wakeup(&self) -> Option<Micros> {
        self.queues
            .values()
            .filter_map(|q| q.first().map(|(d, _)| *d))
            .chain(self.hold_until)
            .chain(self.workers.values().filter_map(|w| self.stalled_at(w)))
            .chain(
                self.workers
                    .values()
                    .filter_map(|w| w.health.backoff_until()),
            )
            .min()
    }

    /// Measured arrival rate of `model`, frames per second.
    pub fn arrival_rate(&self, model: &str, now: Micros) -> f64 {
        self.demand.get(model).map_or(0.0, |d| d.rate(now) * 1e6)
    }

    /// Whether `frame` is in flight in `batch`: only such a frame's answer
    /// is taken from that batch's result (a worker may not answer for
    /// another's frames).
    pub fn batch_holds(&self, batch: BatchId, frame: FrameId) -> bool {
        self.batches
            .get(&batch)
            .is_some_and(|(_, frames)| frames.iter().any(|q| q.arrival.id == frame))
    }

    /// Whether `worker` is demoted for failing its frames.
    pub fn is_demoted(&self, worker: WorkerId) -> bool {
        self.workers
            .get(&worker)
            .is_some_and(|w| w.health.demoted())
    }

    /// Number of registered workers demoted for failing their frames
    /// (backing off, or being probed).
    pub fn demoted_count(&self) -> usize {
        self.workers.values().filter(|w| w.health.demoted()).count()
    }

    /// Number of registered workers, and how many are busy.
    pub fn worker_counts(&self) -> (usize, usize) {
        let busy = self
            .workers
            .values()
            .filter(|w| !w.running.is_empty())
            .count();
        (self.workers.len(), busy)
    }

    /// Applies one event at time `now` and returns what to do.
    pub fn on_event(&mut self, now: Micros, event: Event) -> Vec<Action> {
        let mut out = Vec::new();
        self.relax_idle(now);
        match event {
            Event::FrameArrived(a) => self.arrive(now, a, &mut out),
            Event::WorkerJoined { worker, models } => {
                let models = models
                    .iter()
                    .map(|m| {
                        (
                            m.model.clone(),
                            ModelProfile::new(m, self.limits.default_latency_us),
                        )
                    })
                    .collect();
                self.workers.insert(
                    worker,
                    Worker {
                        models,
                        relaxed_at: now,
                        running: Vec::new(),
                        draining: false,
                        health: WorkerHealth::new(),
                    },
                );
            }
            Event::BatchFinished {
                worker,
                batch,
                outcomes,
                latency_us,
            } => self.finish(now, worker, batch, outcomes, latency_us, &mut out),
            Event::WorkerDraining { worker } => {
                if let Some(w) = self.workers.get_mut(&worker) {
                    w.draining = true;
                }
            }
            Event::WorkerLost { worker } => self.lose(now, worker, "worker lost", &mut out),
            Event::EdgeJoined { edge, name, weight } => self.join_edge(edge, name, weight),
            Event::EdgeGone { edge } => self.edge_gone(now, edge, &mut out),
            Event::Tick => {}
        }
        self.drop_stalled(now, &mut out);
        self.expire(now, &mut out);
        self.dispatch(now, &mut out);
        out
    }

    fn complete(&mut self, now: Micros, q: &Queued, status: Status, out: &mut Vec<Action>) {
        let capacity = matches!(
            status,
            Status::Expired
                | Status::Shed(
                    ShedReason::Superseded | ShedReason::WouldMissDeadline | ShedReason::Overloaded
                )
        );
        self.complete_as(now, q, status, capacity, out);
    }

    /// [`Scheduler::complete`], saying whether the frame was lost to
    /// capacity (see [`Action::Complete`]).
    fn complete_as(
        &mut self,
        now: Micros,
        q: &Queued,
        status: Status,
        capacity: bool,
        out: &mut Vec<Action>,
    ) {
        match &status {
            Status::Ok => self.counters.ok += 1,
            Status::Shed(_) => self.counters.shed += 1,
            Status::Expired => self.counters.expired += 1,
            Status::Failed(_) => self.counters.failed += 1,
        }
        out.push(Action::Complete {
            frame: q.arrival.id,
            status,
            queue_us: q
                .dispatched
                .unwrap_or(now)
                .saturating_sub(q.enqueued)
                .min(u32::MAX as u64) as u32,
            capacity,
        });
    }

    /// Removes a frame from its queue and indices; returns it.
    fn unqueue(&mut self, id: FrameId) -> Option<Queued> {
        let q = self.queued.remove(&id)?;
        if let Some(set) = self.queues.get_mut(&q.arrival.model) {
            set.remove(&(q.arrival.deadline, id));
        }
        let key = (q.arrival.edge, q.arrival.camera.clone());
        if self.by_camera.get(&key) == Some(&id) {
            self.by_camera.remove(&key);
        }
        if let Some(sets) = self.by_account.get_mut(&q.arrival.model)
            && let Some(set) = sets.get_mut(&q.account)
        {
            set.remove(&(q.arrival.deadline, id));
            if set.is_empty() {
                sets.remove(&q.account);
            }
        }
        // An account's entry goes with its last queued frame once no
        // connection holds it: every connection that never joined is an
        // account of its own, so entries would otherwise pile up.
        if let Some(share) = self.shares.get_mut(&q.account) {
            share.queued = share.queued.saturating_sub(1);
            if share.queued == 0 && share.connections == 0 {
                self.shares.remove(&q.account);
            }
        }
        self.counters.queued -= 1;
        Some(q)
    }

    /// The account a connection's frames count to.
    fn account_of(&self, edge: EdgeId) -> Account {
        self.accounts
            .get(&edge)
            .cloned()
            .unwrap_or(Account::Connection(edge))
    }

    /// Frames `account` has queued, all models.
    fn queued_of(&self, account: &Account) -> usize {
        self.shares.get(account).map_or(0, |s| s.queued)
    }

    /// `account`'s weighted share of the whole queue: `max_queued` split by
    /// weight among the accounts with frames queued and `account` itself.
    fn queue_share(&self, account: &Account) -> usize {
        let weight = |a: &Account| self.shares.get(a).map_or(1, |s| s.weight.max(1)) as u128;
        let others: u128 = self
            .shares
            .iter()
            .filter(|(a, s)| s.queued > 0 && *a != account)
            .map(|(_, s)| s.weight.max(1) as u128)
            .sum();
        let own = weight(account);
        (self.limits.max_queued as u128 * own / (own + others)) as usize
    }

    /// The least urgent queued frame (latest deadline, newest of equals) of
    /// the account furthest over its weighted share, if that is not
    /// `account`.
    fn push_out_victim(&self, account: &Account) -> Option<FrameId> {
        let (over, _) = self
            .shares
            .iter()
            .filter(|(_, s)| s.queued > 0)
            // queued / weight, compared without division
            .max_by(|(_, a), (_, b)| {
                (a.queued as u128 * b.weight.max(1) as u128)
                    .cmp(&(b.queued as u128 * a.weight.max(1) as u128))
            })?;
        if over == account {
            return None;
        }
        self.by_account
            .values()
            .filter_map(|sets| sets.get(over)?.last().copied())
            .max()
            .map(|(_, id)| id)
    }

    fn enqueue(&mut self, q: Queued) {
        let a = &q.arrival;
        self.queues
            .entry(a.model.clone())
            .or_default()
            .insert((a.deadline, a.id));
        self.by_camera.insert((a.edge, a.camera.clone()), a.id);
        self.by_account
            .entry(a.model.clone())
            .or_default()
            .entry(q.account.clone())
            .or_default()
            .insert((a.deadline, a.id));
        let share = self.shares.entry(q.account.clone()).or_insert(Share {
            weight: 1,
            queued: 0,
            connections: 0,
            vtime: 0,
        });
        // An account that was idle starts level with the others: waiting
        // banks no credit.
        if share.queued == 0 {
            share.vtime = share.vtime.max(self.vnow);
        }
        share.queued += 1;
        self.counters.queued += 1;
        self.queued.insert(a.id, q);
    }

    /// Fastest single-frame latency any worker serving `model` offers.
    fn best_latency(&self, model: &str) -> Option<u64> {
        self.workers
            .values()
            .filter(|w| w.available())
            .filter_map(|w| w.models.get(model).map(|p| p.latency(1)))
            .min()
    }

    /// Whether a frame of `model` with `deadline` could still finish in time
    /// on some worker, given the frames queued ahead of it (earlier
    /// deadlines), the models' peak throughput and when busy workers free.
    fn can_make_it(
        &self,
        now: Micros,
        model: &str,
        deadline: Micros,
        best: u64,
        own_ahead: bool,
    ) -> bool {
        if now + best > deadline {
            return false;
        }
        let serving = || {
            self.workers
                .values()
                .filter(|w| w.serving() && w.models.contains_key(model))
        };
        let free_at = serving().map(|w| w.start_at(now)).min().unwrap_or(now);
        let capacity: f64 = serving().map(|w| w.models[model].peak_throughput()).sum();
        if capacity <= 0.0 || free_at + best > deadline {
            return free_at + best <= deadline;
        }
        // Frames ahead that fit before the deadline; count only as many as
        // matter, so a long queue costs no more than the answer needs.
        let room =
            ((deadline - free_at - best) as f64 * capacity).floor() as usize + own_ahead as usize;
        let queue = self.queues.get(model);
        if queue.map_or(0, BTreeSet::len) <= room {
            return true; // Even the whole queue ahead fits.
        }
        let ahead = queue.map_or(0, |q| {
            q.range(..=(deadline, FrameId(u64::MAX)))
                .take(room + 1)
                .count()
        });
        ahead <= room
    }

    fn arrive(&mut self, now: Micros, a: Arrival, out: &mut Vec<Action>) {
        self.counters.admitted += 1;
        let q = Queued {
            account: self.account_of(a.edge),
            arrival: a,
            enqueued: now,
            dispatched: None,
            failed_on: None,
        };
        // It trails its connection's close: its result has nowhere to go.
        if self.gone_set.contains(&q.arrival.edge) {
            self.complete(now, &q, Status::Shed(ShedReason::EdgeGone), out);
            return;
        }
        self.demand
            .entry(q.arrival.model.clone())
            .or_default()
            .arrive(now, q.arrival.edge, &q.arrival.camera);
        // Nothing of its budget is left: the time went before it got here
        // (the edge's send path, the link), whatever the workers can do.
        if q.arrival.deadline <= now {
            self.complete(now, &q, Status::Shed(ShedReason::LateOnArrival), out);
            return;
        }
        let Some(best) = self.best_latency(&q.arrival.model) else {
            self.complete(now, &q, Status::Shed(ShedReason::NoWorker), out);
            return;
        };
        // Too little is left for even an idle worker's one run: no queue
        // is to blame, so no rate hint would have saved it.
        if now + best > q.arrival.deadline {
            let status = Status::Shed(ShedReason::WouldMissDeadline);
            self.complete_as(now, &q, status, false, out);
            return;
        }

        // The camera's own queued frame is superseded if this one is kept,
        // so it does not count as ahead of it.
        let key = (q.arrival.edge, q.arrival.camera.clone());
        let own_ahead = self
            .by_camera
            .get(&key)
            .and_then(|id| self.queued.get(id))
            .is_some_and(|o| {
                o.arrival.model == q.arrival.model && o.arrival.deadline <= q.arrival.deadline
            });
        if !self.can_make_it(now, &q.arrival.model, q.arrival.deadline, best, own_ahead) {
            self.complete(now, &q, Status::Shed(ShedReason::WouldMissDeadline), out);
            return;
        }
        // The newest frame of a camera supersedes the one still waiting.
        if let Some(old) = self
            .by_camera
            .get(&key)
            .copied()
            .and_then(|id| self.unqueue(id))
        {
            self.complete(now, &old, Status::Shed(ShedReason::Superseded), out);
        }
        // The queue is shared by weight (see the module docs): an account
        // under its share of a full queue pushes out the least urgent frame
        // of the account furthest over its own.
        let account_queued = self.queued_of(&q.account);
        let mut refused = account_queued >= self.limits.max_queued_per_edge;
        if !refused && self.queued.len() >= self.limits.max_queued {
            refused = true;
            if account_queued < self.queue_share(&q.account)
                && let Some(victim) = self.push_out_victim(&q.account)
            {
                let v = self.unqueue(victim).expect("queued frame is indexed");
                self.complete(now, &v, Status::Shed(ShedReason::Overloaded), out);
                refused = false;
            }
        }
        if refused {
            self.complete(now, &q, Status::Shed(ShedReason::Overloaded), out);
            return;
        }
        self.enqueue(q);
    }

    /// A connection authenticated as the configured edge `name`.
    fn join_edge(&mut self, edge: EdgeId, name: String, weight: u32) {
        let account = Account::Named(name.into());
        if let Some(old) = self.accounts.insert(edge, account.clone())
            && let Some(s) = self.shares.get_mut(&old)
        {
            // Joined twice: the old account loses the connection.
            s.connections = s.connections.saturating_sub(1);
        }
        let share = self.shares.entry(account).or_insert(Share {
            weight: 1,
            queued: 0,
            connections: 0,
            vtime: self.vnow,
        });
        share.weight = weight.clamp(1, MAX_WEIGHT);
        share.connections += 1;
    }

    /// A connection closed: its queued frames end `edge_gone`, and so will
    /// any of its frames that arrive later.
    fn edge_gone(&mut self, now: Micros, edge: EdgeId, out: &mut Vec<Action>) {
        // Its frames count to its account, or to itself if they came
        // before it joined.
        let accounts = [self.account_of(edge), Account::Connection(edge)];
        let mut doomed: Vec<FrameId> = self
            .by_account
            .values()
            .flat_map(|sets| accounts.iter().filter_map(|a| sets.get(a)))
            .flatten()
            .map(|(_, id)| *id)
            .filter(|id| self.queued.get(id).is_some_and(|q| q.arrival.edge == edge))
            .collect();
        doomed.sort_unstable();
        doomed.dedup();
        for id in doomed {
            let q = self.unqueue(id).expect("queued frame is indexed");
            self.complete(now, &q, Status::Shed(ShedReason::EdgeGone), out);
        }
        if let Some(account) = self.accounts.remove(&edge)
            && let Some(s) = self.shares.get_mut(&account)
        {
            s.connections = s.connections.saturating_sub(1);
            if s.connections == 0 && s.queued == 0 {
                self.shares.remove(&account);
            }
        }
        if self.gone_set.insert(edge) {
            if self.gone.len() >= GONE_EDGES_KEPT
                && let Some(old) = self.gone.pop_front()
            {
                self.gone_set.remove(&old);
            }
            self.gone.push_back(edge);
        }
    }

    /// Relaxes the profiles of the workers that run nothing (see
    /// [`ModelProfile::relax`]); a busy worker's idle time starts anew.
    fn relax_idle(&mut self, now: Micros) {
        for w in self.workers.values_mut() {
            w.health.tick(now);
            if w.running.is_empty() {
                let idle = now.saturating_sub(w.relaxed_at);
                if idle > 0 {
                    for p in w.models.values_mut() {
                        p.relax(idle);
                    }
                }
            }
            w.relaxed_at = now;
        }
    }

    fn expire(&mut self, now: Micros, out: &mut Vec<Action>) {
        let due: Vec<FrameId> = self
            .queues
            .values()
            .flat_map(|set| set.iter().take_while(|(d, _)| *d <= now).map(|(_, id)| *id))
            .collect();
        for id in due {
            if let Some(q) = self.unqueue(id) {
                self.complete(now, &q, Status::Expired, out);
            }
        }
    }

    /// Earliest finish of one frame of `model` on any worker but `except`
    /// (the one that failed the frame, if any), counting the batches each
    /// worker already has.
    fn best_finish(&self, model: &str, now: Micros, except: Option<WorkerId>) -> Option<Micros> {
        self.workers
            .iter()
            .filter(|(id, w)| Some(**id) != except && w.available())
            .filter_map(|(_, w)| Some(w.start_at(now) + w.models.get(model)?.latency(1)))
            .min()
    }

    fn dispatch(&mut self, now: Micros, out: &mut Vec<Action>) {
        self.hold_until = None;
        let depth = self.limits.pipeline_depth.max(1);
        // Workers with room, the soonest free first: an idle worker is
        // always offered work before a busy one's next slot.
        let policy = self.limits.health;
        let mut open: Vec<(Micros, WorkerId)> = self
            .workers
            .iter()
            .filter(|(_, w)| {
                !w.draining
                    && w.running.len() < depth
                    && w.health.eligibility(&policy) != Eligibility::None
            })
            .map(|(id, w)| (w.start_at(now), *id))
            .collect();
        open.sort_unstable();
        for (start, wid) in open {
            // A demoted worker is sent one small probe batch at a time.
            let most = match self.workers[&wid].health.eligibility(&policy) {
                Eligibility::Probe(n) => n.max(1),
                _ => usize::MAX,
            };
            // The most urgent model this worker serves.
            let Some(model) = self.workers[&wid]
                .models
                .keys()
                .filter_map(|m| self.queues.get(m)?.first().map(|(d, _)| (*d, m.clone())))
                .min()
                .map(|(_, m)| m)
            else {
                continue;
            };
            let profile = self.workers[&wid].models[&model].clone();
            // Heads that cannot make it even alone on this worker: shed them
            // if no worker could, else leave them for a sooner one.
            let first_deadline = loop {
                let Some(&(deadline, id)) = self.queues.get(&model).and_then(|q| q.first()) else {
                    break None;
                };
                if start + profile.latency(1) <= deadline {
                    break Some(deadline);
                }
                let failed_on = self.queued.get(&id).and_then(|q| q.failed_on);
                if self
                    .best_finish(&model, now, failed_on)
                    .is_some_and(|f| f <= deadline)
                {
                    break None;
                }
                let q = self.unqueue(id).expect("queued frame is indexed");
                self.complete(now, &q, Status::Shed(ShedReason::WouldMissDeadline), out);
            };
            let Some(first_deadline) = first_deadline else {
                continue;
            };
            // The largest batch whose run still meets the earliest deadline.
            let queued = self.queue_len(&model);
            let target = self.target_batch(now, &model, &profile).min(most);
            // Never larger than the best-throughput batch (or the target):
            // a larger one would finish the backlog later, not sooner.
            let cap = profile.best_batch().max(target).min(most);
            let fit = (1..=queued.min(cap))
                .take_while(|&b| start + profile.latency(b) <= first_deadline)
                .last()
                .unwrap_or(1);
            if fit < target {
                let latest = self.hold_limit(now, &model, &profile, target, first_deadline, start);
                if now < latest {
                    self.hold_until = Some(self.hold_until.map_or(latest, |h| h.min(latest)));
                    continue;
                }
            }
            let mut frames = self.pick_fair(&model, fit, wid);
            if frames.is_empty() {
                continue; // all it could take are frames it failed
            }
            let batch = BatchId(self.next_batch);
            self.next_batch += 1;
            self.counters.dispatched += frames.len() as u64;
            if let Some(d) = self.demand.get_mut(&model) {
                d.in_flight += frames.len();
            }
            for q in &mut frames {
                q.dispatched = Some(now);
            }
            out.push(Action::Dispatch {
                worker: wid,
                batch,
                model,
                frames: frames.iter().map(|q| q.arrival.id).collect(),
            });
            if let Some(w) = self.workers.get_mut(&wid) {
                w.running.push(Running {
                    batch,
                    size: frames.len(),
                    done_at: start + profile.latency(frames.len()),
                });
                w.health.dispatched(batch);
            }
            self.batches.insert(batch, (wid, frames));
        }
    }

    /// How long a batch smaller than `target` may be held for more frames
    /// on a worker free at `start`: only while it pays and is safe. No later
    /// than the last moment a full target batch would still make the
    /// earliest deadline (with a margin for profile error), no longer than
    /// the batch should take to fill at the measured arrival rate (counted
    /// from when its first frame came), and for a busy worker no later than
    /// just before it frees.
    fn hold_limit(
        &self,
        now: Micros,
        model: &str,
        profile: &ModelProfile,
        target: usize,
        first_deadline: Micros,
        start: Micros,
    ) -> Micros {
        let safe = (profile.latency(target) as f64 * HOLD_LATENCY_SAFETY) as Micros;
        let mut latest = first_deadline
            .saturating_sub(safe)
            .saturating_sub(HOLD_GUARD_US);
        let head_enqueued = self.queues[model]
            .first()
            .and_then(|(_, id)| self.queued.get(id))
            .map_or(now, |q| q.enqueued);
        // The rate as of the head's arrival: it must not decay while the
        // frames wait, or the hold would keep extending itself.
        let rate = self
            .demand
            .get(model)
            .map_or(0.0, |d| d.rate(head_enqueued));
        if rate > 0.0 {
            let fill = (target as f64 / rate * FILL_SLACK).min(u32::MAX as f64) as Micros;
            latest = latest.min(head_enqueued.saturating_add(fill));
        }
        if start > now {
            latest = latest.min(start.saturating_sub(PIPELINE_LEAD_US));
        }
        latest
    }

    /// Takes up to `n` queued frames of `model` for one batch, earliest
    /// deadline first. Each pick goes to the account with the lowest
    /// start-time fair queuing tag (served least for its weight; the most
    /// urgent head among equals) and takes that account's most urgent
    /// frame that `worker` did not fail before. Every frame of the model
    /// has a deadline at or after the model's earliest, which the caller cut
    /// the batch to, so whichever frames are picked make their deadlines.
    fn pick_fair(&mut self, model: &str, n: usize, worker: WorkerId) -> Vec<Queued> {
        let mut picked = Vec::with_capacity(n);
        while picked.len() < n {
            let Some(sets) = self.by_account.get(model) else {
                break;
            };
            // A frame this worker failed goes to another one.
            let sendable = |id: &FrameId| {
                self.queued
                    .get(id)
                    .is_none_or(|q| q.failed_on != Some(worker))
            };
            let next = sets
                .iter()
                .filter_map(|(account, set)| {
                    let &(deadline, id) = set.iter().find(|(_, id)| sendable(id))?;
                    let tag = self.shares.get(account).map_or(self.vnow, |s| s.vtime);
                    Some(((tag, deadline, id), account))
                })
                .min_by_key(|(key, _)| *key)
                .map(|((_, _, id), account)| (account.clone(), id));
            let Some((account, id)) = next else {
                break;
            };
            if let Some(share) = self.shares.get_mut(&account) {
                self.vnow = self.vnow.max(share.vtime);
                share.vtime = share.vtime.max(self.vnow) + VT_UNIT / u64::from(share.weight.max(1));
            }
            picked.push(self.unqueue(id).expect("queued frame is indexed"));
        }
        picked.sort_unstable_by_key(|q| (q.arrival.deadline, q.arrival.id));
        picked
    }

    /// The batch size worth waiting for on a worker with `profile`: the
    /// smallest that keeps up with this worker's share of the model's
    /// arrivals, capped by how many sending cameras have no frame running
    /// (a camera that waits for its result cannot fill a batch).
    fn target_batch(&self, now: Micros, model: &str, profile: &ModelProfile) -> usize {
        let Some(demand) = self.demand.get(model) else {
            return 1;
        };
        let serving = self
            .workers
            .values()
            .filter(|w| w.serving() && w.models.contains_key(model))
            .count()
            .max(1);
        // Only cameras without a frame running can still add to the batch.
        let can_arrive = demand.cameras.len().saturating_sub(demand.in_flight);
        profile
            .batch_for(demand.rate(now) / serving as f64)
            .min(can_arrive.max(1))
    }

    fn finish(
        &mut self,
        now: Micros,
        worker: WorkerId,
        batch: BatchId,
        outcomes: Vec<(FrameId, Status)>,
        latency_us: u32,
        out: &mut Vec<Action>,
    ) {
        let Some((owner, frames)) = self.batches.remove(&batch) else {
            return; // Unknown or already re-homed batch: nothing to account.
        };
        if owner != worker {
            self.batches.insert(batch, (owner, frames));
            return;
        }
        if let Some(w) = self.workers.get_mut(&worker) {
            w.running.retain(|r| r.batch != batch);
            if let Some(p) = frames
                .first()
                .and_then(|q| w.models.get_mut(&q.arrival.model))
            {
                p.observe(frames.len(), latency_us);
            }
            // The next batch starts now: re-estimate when each will be done.
            let mut t = now;
            for r in &mut w.running {
                let model = self
                    .batches
                    .get(&r.batch)
                    .and_then(|(_, f)| f.first())
                    .map(|q| q.arrival.model.as_str());
                let lat = model
                    .and_then(|m| w.models.get(m))
                    .map_or(self.limits.default_latency_us as u64, |p| p.latency(r.size));
                t += lat;
                r.done_at = t;
            }
        }
        self.release(&frames);
        let answers = outcomes.len() as u32;
        let mut by_id: HashMap<FrameId, Status> = outcomes.into_iter().collect();
        let mut tally = Tally::default();
        let model = frames.first().map(|q| q.arrival.model.clone());
        for q in frames {
            self.counters.dispatched -= 1;
            let status = match by_id.remove(&q.arrival.id) {
                Some(Status::Ok) => {
                    tally.ok += 1;
                    Status::Ok
                }
                None => {
                    tally.missing += 1;
                    Status::Failed("worker returned no result for this frame".into())
                }
                Some(other) => {
                    tally.failed += 1;
                    match other {
                        Status::Failed(reason) => Status::Failed(reason),
                        other => Status::Failed(format!(
                            "worker answered with status '{}', which only the gateway may assign",
                            other.label()
                        )),
                    }
                }
            };
            if matches!(status, Status::Failed(_)) && self.can_retry(now, &q, worker) {
                self.counters.retried += 1;
                self.enqueue(Queued {
                    failed_on: Some(worker),
                    ..q
                });
            } else {
                self.complete(now, &q, status, out);
            }
        }
        // Answers that matched no frame: another batch's ids, or repeats.
        tally.foreign = answers.saturating_sub(tally.ok + tally.failed);
        if let Some(model) = model {
            self.judge(now, worker, batch, &model, tally, out);
        }
    }

    /// Whether a frame `worker` failed goes to another worker instead of
    /// failing: once per frame, while another available worker serves its
    /// model and could still meet its deadline, its edge is connected, and
    /// its camera has no newer frame queued (which supersedes it).
    fn can_retry(&self, now: Micros, q: &Queued, worker: WorkerId) -> bool {
        let a = &q.arrival;
        q.failed_on.is_none()
            && self
                .best_finish(&a.model, now, Some(worker))
                .is_some_and(|finish| finish <= a.deadline)
            && !self.gone_set.contains(&a.edge)
            && !self.by_camera.contains_key(&(a.edge, a.camera.clone()))
    }

    /// Judges a returned batch by its worker's health policy; says so if
    /// the worker is demoted or restored.
    fn judge(
        &mut self,
        now: Micros,
        worker: WorkerId,
        batch: BatchId,
        model: &str,
        tally: Tally,
        out: &mut Vec<Action>,
    ) {
        // Only while another worker serves the model may the failure ratio
        // demote this one (see `crate::health`).
        let spare = self
            .workers
            .iter()
            .any(|(id, w)| *id != worker && w.serving() && w.models.contains_key(model));
        let policy = self.limits.health;
        let Some(w) = self.workers.get_mut(&worker) else {
            return;
        };
        let (reason, backoff_us, probe_failed) =
            match w.health.finished(now, &policy, batch, tally, spare) {
                None => return,
                Some(Verdict::Restored) => {
                    out.push(Action::WorkerRestored { worker });
                    return;
                }
                Some(Verdict::Demoted { reason, backoff_us }) => (reason, backoff_us, false),
                Some(Verdict::ProbeFailed { reason, backoff_us }) => (reason, backoff_us, true),
            };
        out.push(Action::WorkerDemoted {
            worker,
            model: model.to_string(),
            reason,
            backoff_us,
            probe_failed,
        });
    }

    /// A batch's frames stopped running (finished or lost).
    fn release(&mut self, frames: &[Queued]) {
        if let Some(d) = frames
            .first()
            .and_then(|q| self.demand.get_mut(&q.arrival.model))
        {
            d.in_flight = d.in_flight.saturating_sub(frames.len());
        }
    }

    /// When `w` counts as stalled if its running batch is still unanswered.
    fn stalled_at(&self, w: &Worker) -> Option<Micros> {
        w.running
            .first()
            .map(|r| r.done_at.saturating_add(self.limits.stall_us))
    }

    fn drop_stalled(&mut self, now: Micros, out: &mut Vec<Action>) {
        let mut stalled: Vec<(WorkerId, BatchId, Micros)> = self
            .workers
            .iter()
            .filter(|(_, w)| self.stalled_at(w).is_some_and(|at| at <= now))
            .filter_map(|(id, w)| w.running.first().map(|r| (*id, r.batch, r.done_at)))
            .collect();
        stalled.sort_unstable();
        for (worker, batch, due) in stalled {
            let reason = format!(
                "batch {} unanswered {} ms after it was due; the worker is stalled",
                batch.0,
                now.saturating_sub(due) / 1000
            );
            out.push(Action::DropWorker { worker, reason });
            self.lose(now, worker, "worker stalled", out);
        }
    }

    fn lose(&mut self, now: Micros, worker: WorkerId, why: &str, out: &mut Vec<Action>) {
        self.workers.remove(&worker);
        let lost: Vec<BatchId> = self
            .batches
            .iter()
            .filter(|(_, (w, _))| *w == worker)
            .map(|(b, _)| *b)
            .collect();
        let mut frames = Vec::new();
        for b in lost {
            let (_, batch) = self.batches.remove(&b).expect("listed above");
            self.release(&batch);
            frames.extend(batch);
        }
        // Newest first: a camera with frames in two lost batches gets its
        // newest one back in the queue, and the older one is the one that
        // fails.
        frames.sort_unstable_by_key(|q| std::cmp::Reverse(q.arrival.id));
        for q in frames {
            self.counters.dispatched -= 1;
            let still_possible = self
                .best_latency(&q.arrival.model)
                .is_some_and(|l| now + l <= q.arrival.deadline);
            let newer_queued = self
                .by_camera
                .contains_key(&(q.arrival.edge, q.arrival.camera.clone()));
            if self.gone_set.contains(&q.arrival.edge) {
                // Its result would have nowhere to go.
                self.complete(now, &q, Status::Shed(ShedReason::EdgeGone), out);
            } else if still_possible && !newer_queued {
                self.counters.requeued += 1;
                self.enqueue(q);
            } else {
                self.complete(now, &q, Status::Failed(why.into()), out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One batch per worker at a time, as most of these tests assume.
    fn one_deep() -> Limits {
        Limits {
            pipeline_depth: 1,
            ..Limits::default()
        }
    }

    fn worker(id: u64, max_batch: u16, lat: u32) -> Event {
        Event::WorkerJoined {
            worker: WorkerId(id),
            models: vec![WorkerModel {
                model: "m".into(),
                max_batch,
                profile: (1..=max_batch).map(|b| (b, lat * b as u32)).collect(),
            }],
        }
    }

    fn frame(id: u64, camera: &str, deadline: Micros) -> Event {
        Event::FrameArrived(Arrival {
            id: FrameId(id),
            edge: EdgeId(1),
            camera: camera.into(),
            model: "m".into(),
            deadline,
        })
    }

    fn completes(actions: &[Action]) -> Vec<(u64, Status)> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Complete { frame, status, .. } => Some((frame.0, status.clone())),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn frame_without_worker_is_shed_no_worker() {
        let mut s = Scheduler::new(one_deep());
        let a = s.on_event(0, frame(1, "c", 80_000));
        assert_eq!(completes(&a), vec![(1, Status::Shed(ShedReason::NoWorker))]);
        assert!(s.counters().balanced());
    }

    #[test]
    fn idle_worker_gets_frame_and_result_completes_ok() {
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, worker(1, 1, 5_000));
        let a = s.on_event(0, frame(1, "c", 80_000));
        let Action::Dispatch { batch, frames, .. } = &a[0] else {
            panic!("expected dispatch, got {a:?}");
        };
        assert_eq!(frames, &vec![FrameId(1)]);
        let a = s.on_event(
            6_000,
            Event::BatchFinished {
                worker: WorkerId(1),
                batch: *batch,
                outcomes: vec![(FrameId(1), Status::Ok)],
                latency_us: 5_000,
            },
        );
        assert_eq!(completes(&a), vec![(1, Status::Ok)]);
        let c = s.counters();
        assert!(c.balanced() && c.ok == 1 && c.in_flight() == 0);
    }

    #[test]
    fn frame_past_deadline_is_shed_before_dispatch() {
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, worker(1, 1, 50_000));
        let a = s.on_event(0, frame(1, "c", 40_000));
        assert_eq!(
            completes(&a),
            vec![(1, Status::Shed(ShedReason::WouldMissDeadline))]
        );
    }

    #[test]
    fn a_frame_with_no_budget_left_on_arrival_is_shed_late_whatever_the_workers() {
        let mut s = Scheduler::new(one_deep());
        // No worker at all, and an idle one: the lateness is the reason.
        let a = s.on_event(100, frame(1, "c", 100));
        assert_eq!(
            completes(&a),
            vec![(1, Status::Shed(ShedReason::LateOnArrival))]
        );
        s.on_event(100, worker(1, 1, 1_000));
        let a = s.on_event(200, frame(2, "c", 150));
        assert_eq!(
            completes(&a),
            vec![(2, Status::Shed(ShedReason::LateOnArrival))]
        );
        assert_eq!(s.counters().shed, 2);
        assert_eq!(s.counters().admitted, 2);
    }

    #[test]
    fn only_a_frame_that_waited_behind_others_is_lost_to_capacity() {
        let capacity = |a: &[Action]| -> Vec<(u64, bool)> {
            a.iter()
                .filter_map(|a| match a {
                    Action::Complete {
                        frame, capacity, ..
                    } => Some((frame.0, *capacity)),
                    _ => None,
                })
                .collect()
        };
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, worker(1, 1, 50_000));
        // 40 ms left for a 50 ms run: no queue is to blame.
        let a = s.on_event(0, frame(1, "a", 40_000));
        assert_eq!(capacity(&a), vec![(1, false)]);
        // Served at once; the next could make it alone, not behind it.
        s.on_event(0, frame(2, "b", 80_000));
        let a = s.on_event(0, frame(3, "c", 90_000));
        assert_eq!(
            completes(&a),
            vec![(3, Status::Shed(ShedReason::WouldMissDeadline))]
        );
        assert_eq!(capacity(&a), vec![(3, true)]);
    }

    #[test]
    fn newer_frame_of_camera_supersedes_queued_one() {
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, worker(1, 1, 1_000));
        s.on_event(0, frame(1, "c", 80_000)); // dispatched, worker busy
        s.on_event(10, frame(2, "c", 80_010)); // queued
        let a = s.on_event(20, frame(3, "c", 80_020));
        assert_eq!(
            completes(&a),
            vec![(2, Status::Shed(ShedReason::Superseded))]
        );
        assert_eq!(s.queue_len("m"), 1);
    }

    #[test]
    fn queued_frame_expires_at_its_deadline() {
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, worker(1, 1, 1_000));
        s.on_event(0, frame(1, "a", 80_000));
        s.on_event(0, frame(2, "b", 10_000));
        assert_eq!(s.next_wakeup(), Some(10_000));
        let a = s.on_event(10_000, Event::Tick);
        assert_eq!(completes(&a), vec![(2, Status::Expired)]);
        assert!(s.counters().balanced());
    }

    #[test]
    fn batch_is_edf_ordered_and_bounded_by_earliest_deadline() {
        let mut s = Scheduler::new(one_deep());
        s.on_event(
            0,
            Event::WorkerJoined {
                worker: WorkerId(9),
                models: vec![WorkerModel {
                    model: "m".into(),
                    max_batch: 8,
                    // Batching pays a little: 1 ms + 9.5 ms per frame.
                    profile: (1..=8).map(|b| (b, 1_000 + 9_500 * b as u32)).collect(),
                }],
            },
        );
        let first = s.on_event(0, frame(100, "z", 900_000));
        assert!(matches!(first[0], Action::Dispatch { .. }));
        for (i, d) in [(1, 50_000), (2, 30_000), (3, 70_000), (4, 45_000)] {
            assert!(s.on_event(0, frame(i, &format!("c{i}"), d)).is_empty());
        }
        // The worker frees at 1 ms. A batch of k takes 1 + 9.5k ms, and the
        // batch's earliest deadline (30 ms) allows 2 frames (done at 21 ms),
        // not 3 (30.5 ms).
        let a = s.on_event(
            1_000,
            Event::BatchFinished {
                worker: WorkerId(9),
                batch: BatchId(1),
                outcomes: vec![(FrameId(100), Status::Ok)],
                latency_us: 10_000,
            },
        );
        let dispatched = a
            .iter()
            .find_map(|a| match a {
                Action::Dispatch { frames, .. } => Some(frames.clone()),
                _ => None,
            })
            .expect("dispatch once the worker frees");
        assert_eq!(dispatched, vec![FrameId(2), FrameId(4)]);
    }

    #[test]
    fn lost_worker_frames_are_redispatched_or_failed() {
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, worker(1, 2, 1_000));
        s.on_event(0, worker(2, 2, 1_000));
        s.on_event(0, frame(1, "a", 80_000));
        s.on_event(0, frame(2, "b", 80_000));
        // Both workers busy with one frame each. Lose worker 1 at t=10 ms:
        // its frame can still make it on worker 2 and is queued again.
        let a = s.on_event(
            10_000,
            Event::WorkerLost {
                worker: WorkerId(1),
            },
        );
        assert!(completes(&a).is_empty());
        assert_eq!(s.counters().in_flight(), 2);
        // Lose worker 2 too: its frame cannot be re-homed and fails; the
        // re-queued one waits for a new worker until its deadline.
        let a = s.on_event(
            20_000,
            Event::WorkerLost {
                worker: WorkerId(2),
            },
        );
        assert_eq!(
            completes(&a),
            vec![(2, Status::Failed("worker lost".into()))]
        );
        assert_eq!(s.counters().in_flight(), 1);
        let a = s.on_event(80_000, Event::Tick);
        assert_eq!(completes(&a), vec![(1, Status::Expired)]);
        assert!(s.counters().balanced());
        assert_eq!(s.counters().in_flight(), 0);
    }

    fn drops(actions: &[Action]) -> Vec<u64> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::DropWorker { worker, .. } => Some(worker.0),
                _ => None,
            })
            .collect()
    }

    /// A worker that stops answering while its connection lives (a hung
    /// GPU): once its running batch is `stall_us` past due, it is dropped
    /// and its frames fail, or go to another worker if their deadline
    /// still allows; its late answer changes nothing.
    #[test]
    fn a_worker_that_never_answers_is_dropped_and_its_frames_do_not_wait_for_ever() {
        let limits = Limits {
            stall_us: 1_000_000,
            ..one_deep()
        };
        let mut s = Scheduler::new(limits);
        s.on_event(0, worker(1, 1, 5_000));
        s.on_event(0, frame(1, "a", 80_000));
        s.on_event(0, worker(2, 1, 5_000));
        // A frame with a long budget: still possible after the stall.
        assert_eq!(
            dispatches(&s.on_event(0, frame(2, "b", 10_000_000))),
            vec![vec![2]]
        );
        // Frame 1 is on worker 1 (due at 5 ms), frame 2 on worker 2; worker
        // 2 answers, worker 1 never does.
        let batch2 = BatchId(2);
        s.on_event(
            5_000,
            Event::BatchFinished {
                worker: WorkerId(2),
                batch: batch2,
                outcomes: vec![(FrameId(2), Status::Ok)],
                latency_us: 5_000,
            },
        );
        assert_eq!(s.next_wakeup(), Some(1_005_000));
        let a = s.on_event(1_004_999, Event::Tick);
        assert!(a.is_empty(), "{a:?}");
        let a = s.on_event(1_005_000, Event::Tick);
        assert_eq!(drops(&a), vec![1]);
        assert_eq!(
            completes(&a),
            vec![(1, Status::Failed("worker stalled".into()))]
        );
        assert_eq!(s.worker_counts(), (1, 0));
        // A long-budget frame on a stalled worker goes to the other one.
        assert_eq!(
            dispatches(&s.on_event(1_006_000, frame(3, "c", 10_000_000))),
            vec![vec![3]]
        );
        let a = s.on_event(
            1_006_000,
            Event::BatchFinished {
                worker: WorkerId(2),
                batch: BatchId(3),
                outcomes: vec![(FrameId(3), Status::Ok)],
                latency_us: 5_000,
            },
        );
        assert_eq!(completes(&a), vec![(3, Status::Ok)]);
        // Worker 1's answer, late: ignored.
        let a = s.on_event(
            1_100_000,
            Event::BatchFinished {
                worker: WorkerId(1),
                batch: BatchId(1),
                outcomes: vec![(FrameId(1), Status::Ok)],
                latency_us: 5_000,
            },
        );
        assert!(completes(&a).is_empty());
        assert!(s.counters().balanced());
        assert_eq!(s.counters().in_flight(), 0);
        assert_eq!(s.counters().failed, 1);
        assert_eq!(s.next_wakeup(), None);
    }

    /// A frame of a stalled worker whose deadline allows is queued again.
    #[test]
    fn a_stalled_workers_frame_with_time_left_is_queued_again() {
        let limits = Limits {
            stall_us: 1_000_000,
            ..one_deep()
        };
        let mut s = Scheduler::new(limits);
        s.on_event(0, worker(1, 1, 5_000));
        assert_eq!(
            dispatches(&s.on_event(0, frame(1, "a", 10_000_000))),
            vec![vec![1]]
        );
        s.on_event(500_000, worker(2, 1, 5_000));
        let a = s.on_event(1_005_000, Event::Tick);
        assert_eq!(drops(&a), vec![1]);
        assert!(completes(&a).is_empty(), "{a:?}");
        assert_eq!(dispatches(&a), vec![vec![1]], "re-homed on worker 2");
        assert_eq!(s.counters().requeued, 1);
        assert!(s.counters().balanced());
    }

    /// Two frames of one camera in two batches on one worker (pipeline
    /// depth 2), the worker lost: the newer frame goes back in the queue
    /// and the older one fails, whatever order the batches are found in
    /// (a hash map's, so the scenario runs on many fresh schedulers).
    #[test]
    fn a_lost_worker_gives_each_camera_its_newest_frame_back() {
        for _ in 0..32 {
            let mut s = Scheduler::new(Limits::default());
            s.on_event(0, worker(1, 1, 1_000));
            assert_eq!(
                dispatches(&s.on_event(0, frame(1, "c", 80_000))),
                vec![vec![1]]
            );
            assert_eq!(
                dispatches(&s.on_event(1, frame(2, "c", 80_000))),
                vec![vec![2]]
            );
            s.on_event(2, worker(2, 1, 1_000));
            let a = s.on_event(
                3,
                Event::WorkerLost {
                    worker: WorkerId(1),
                },
            );
            assert_eq!(
                completes(&a),
                vec![(1, Status::Failed("worker lost".into()))]
            );
            assert_eq!(dispatches(&a), vec![vec![2]], "the newest goes to worker 2");
            assert!(s.counters().balanced());
        }
    }

    fn dispatches(actions: &[Action]) -> Vec<Vec<u64>> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Dispatch { frames, .. } => Some(frames.iter().map(|f| f.0).collect()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn light_load_dispatches_single_frames_at_once() {
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, worker(1, 8, 2_000));
        // Two cameras at 5 fps each: far below what one frame per 2 ms
        // serves, so the target batch is 1 and nothing waits.
        let mut t = 0;
        let mut id = 0;
        for _ in 0..10 {
            for cam in ["a", "b"] {
                id += 1;
                let a = s.on_event(t, frame(id, cam, t + 80_000));
                let batch = dispatches(&a);
                assert_eq!(batch, vec![vec![id]], "frame {id} should go at once");
                let Action::Dispatch { batch, .. } = a[0] else {
                    unreachable!()
                };
                s.on_event(
                    t + 2_000,
                    Event::BatchFinished {
                        worker: WorkerId(1),
                        batch,
                        outcomes: vec![(FrameId(id), Status::Ok)],
                        latency_us: 2_000,
                    },
                );
                t += 10_000;
            }
            t += 80_000;
        }
        assert_eq!(s.next_wakeup(), None);
    }

    /// A worker whose batch of b takes 4 ms + 1 ms per frame: batching pays.
    fn batching_worker(id: u64) -> Event {
        Event::WorkerJoined {
            worker: WorkerId(id),
            models: vec![WorkerModel {
                model: "m".into(),
                max_batch: 8,
                profile: (1..=8).map(|b| (b, 4_000 + 1_000 * b as u32)).collect(),
            }],
        }
    }

    #[test]
    fn heavy_load_holds_frames_until_the_deadline_forces_a_batch() {
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, batching_worker(1));
        // Eight cameras at 100 fps each (800 fps) for 300 ms: one worker
        // needs batches of 8 (8 frames / 12 ms = 667 fps < 800 × 1.2, so the
        // largest) to keep up.
        let mut id = 0;
        for t in (0..300_000).step_by(10_000) {
            for cam in 0..8 {
                id += 1;
                let a = s.on_event(t, frame(id, &format!("c{cam}"), t + 30_000));
                // Whatever is dispatched while warming up, it is EDF-ordered.
                for d in dispatches(&a) {
                    assert!(d.windows(2).all(|w| w[0] < w[1]));
                }
                if let Some(Action::Dispatch { batch, frames, .. }) =
                    a.iter().find(|a| matches!(a, Action::Dispatch { .. }))
                {
                    let outcomes = frames.iter().map(|f| (*f, Status::Ok)).collect();
                    s.on_event(
                        t,
                        Event::BatchFinished {
                            worker: WorkerId(1),
                            batch: *batch,
                            outcomes,
                            latency_us: 4_000 + 1_000 * frames.len() as u32,
                        },
                    );
                }
            }
        }
        // Let the held tail go (at its deadline minus a full batch's time).
        while let Some(w) = s.next_wakeup() {
            let a = s.on_event(w, Event::Tick);
            for a in a {
                if let Action::Dispatch { batch, frames, .. } = a {
                    let outcomes = frames.iter().map(|f| (*f, Status::Ok)).collect();
                    s.on_event(
                        w,
                        Event::BatchFinished {
                            worker: WorkerId(1),
                            batch,
                            outcomes,
                            latency_us: 4_000 + 1_000 * frames.len() as u32,
                        },
                    );
                }
            }
        }
        assert_eq!(s.counters().in_flight(), 0);
        // Now a lone frame with a 30 ms deadline: it is held, not sent alone.
        let t = 320_000;
        let a = s.on_event(t, frame(1_000, "solo", t + 30_000));
        assert!(dispatches(&a).is_empty(), "held for a fuller batch: {a:?}");
        // It must leave by deadline − latency of a full batch (12 ms) with
        // its safety margin − the timer guard (sooner than the ~15 ms the
        // batch should take to fill at 800 fps).
        let latest = t + 30_000 - (12_000.0 * HOLD_LATENCY_SAFETY) as Micros - HOLD_GUARD_US;
        assert_eq!(s.next_wakeup(), Some(latest));
        assert!(dispatches(&s.on_event(latest - 1, Event::Tick)).is_empty());
        let a = s.on_event(latest, Event::Tick);
        assert_eq!(dispatches(&a), vec![vec![1_000]]);
        assert!(s.counters().balanced());
    }

    #[test]
    fn a_batch_is_held_only_as_long_as_it_should_take_to_fill() {
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, batching_worker(1));
        // Four cameras at 50 fps (200 fps): one frame per 5 ms does not keep
        // up with 200 × 1.2 fps, two per 6 ms does, so the target is 2.
        let mut id = 0;
        for t in (0..400_000).step_by(20_000) {
            for cam in 0..4 {
                id += 1;
                let a = s.on_event(
                    t + cam * 5_000,
                    frame(id, &format!("c{cam}"), t + 1_000_000),
                );
                for a in a {
                    if let Action::Dispatch { batch, frames, .. } = a {
                        let outcomes = frames.iter().map(|f| (*f, Status::Ok)).collect();
                        s.on_event(
                            t + cam * 5_000,
                            Event::BatchFinished {
                                worker: WorkerId(1),
                                batch,
                                outcomes,
                                latency_us: 4_000 + 1_000 * frames.len() as u32,
                            },
                        );
                    }
                }
            }
        }
        // Flush what is held, then one frame alone with a whole second of
        // slack: it waits about as long as a second frame should take to
        // come (1.5 × 2 / 200 fps = 15 ms), not until its deadline.
        while let Some(w) = s.next_wakeup().filter(|w| *w < 2_000_000) {
            for a in s.on_event(w, Event::Tick) {
                if let Action::Dispatch { batch, frames, .. } = a {
                    let outcomes = frames.iter().map(|f| (*f, Status::Ok)).collect();
                    s.on_event(
                        w,
                        Event::BatchFinished {
                            worker: WorkerId(1),
                            batch,
                            outcomes,
                            latency_us: 6_000,
                        },
                    );
                }
            }
        }
        let t = 420_000;
        assert!(dispatches(&s.on_event(t, frame(9_999, "c0", t + 1_000_000))).is_empty());
        let wake = s.next_wakeup().expect("held frame wakes the scheduler");
        assert!(
            (t + 10_000..=t + 25_000).contains(&wake),
            "held until {} µs after arrival",
            wake - t
        );
        assert_eq!(
            dispatches(&s.on_event(wake, Event::Tick)),
            vec![vec![9_999]]
        );
    }

    #[test]
    fn when_batching_does_not_pay_frames_go_one_by_one_without_waiting() {
        let mut s = Scheduler::new(one_deep());
        // Like BlazeFace on a CPU: a batch costs more per frame than singles.
        s.on_event(
            0,
            Event::WorkerJoined {
                worker: WorkerId(1),
                models: vec![WorkerModel {
                    model: "m".into(),
                    max_batch: 16,
                    profile: (1..=16)
                        .map(|b| (b, 1_000 * b as u32 + 100 * (b * b) as u32))
                        .collect(),
                }],
            },
        );
        // Overload: 16 cameras at 1,000 fps for 200 ms.
        let mut sizes = Vec::new();
        let mut id = 0;
        for t in (0..200_000).step_by(1_000) {
            for cam in 0..16 {
                id += 1;
                let a = s.on_event(t, frame(id, &format!("c{cam}"), t + 80_000));
                for a in a {
                    if let Action::Dispatch { batch, frames, .. } = a {
                        sizes.push(frames.len());
                        let outcomes = frames.iter().map(|f| (*f, Status::Ok)).collect();
                        s.on_event(
                            t,
                            Event::BatchFinished {
                                worker: WorkerId(1),
                                batch,
                                outcomes,
                                latency_us: 1_100,
                            },
                        );
                    }
                }
            }
        }
        assert!(sizes.len() > 100, "{} batches", sizes.len());
        assert!(sizes.iter().all(|&n| n == 1), "batches: {sizes:?}");
        assert!(s.counters().balanced());
    }

    #[test]
    fn full_target_batch_goes_without_waiting() {
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, batching_worker(1));
        // 8 cameras sending 100 fps: the 8th frame completes the batch.
        let mut sent = Vec::new();
        for round in 0..20u64 {
            let t = round * 10_000;
            for cam in 0..8u64 {
                let id = round * 8 + cam + 1;
                let a = s.on_event(t, frame(id, &format!("c{cam}"), t + 60_000));
                for d in dispatches(&a) {
                    sent.push(d.len());
                }
                if let Some(Action::Dispatch { batch, frames, .. }) =
                    a.iter().find(|a| matches!(a, Action::Dispatch { .. }))
                {
                    let outcomes = frames.iter().map(|f| (*f, Status::Ok)).collect();
                    s.on_event(
                        t,
                        Event::BatchFinished {
                            worker: WorkerId(1),
                            batch: *batch,
                            outcomes,
                            latency_us: 12_000,
                        },
                    );
                }
            }
        }
        // Once the rate estimate settles, every batch is full.
        assert!(sent.len() >= 10, "batches: {sent:?}");
        assert!(sent[sent.len() - 5..].iter().all(|&n| n == 8), "{sent:?}");
    }

    #[test]
    fn frame_behind_a_queue_it_cannot_outrun_is_shed_on_arrival() {
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, worker(1, 1, 10_000));
        // Frame 1 runs until 10 ms; frames 2..=5 queue, due at 60 ms.
        for i in 1..=5 {
            s.on_event(0, frame(i, &format!("c{i}"), 60_000));
        }
        assert_eq!(s.queue_len("m"), 4);
        // Due at 65 ms behind four: free at 10 ms + 4 × 10 ms + its own
        // 10 ms = 60 ms. Kept.
        assert!(completes(&s.on_event(0, frame(6, "x", 65_000))).is_empty());
        // Due at 69 ms behind five: 10 + 50 + 10 = 70 ms. Shed before it
        // ever queues, so it cannot delay anything.
        assert_eq!(
            completes(&s.on_event(0, frame(7, "y", 69_000))),
            vec![(7, Status::Shed(ShedReason::WouldMissDeadline))]
        );
        // An earlier deadline goes ahead of the queue (EDF): kept.
        assert!(completes(&s.on_event(0, frame(8, "z", 25_000))).is_empty());
        // The camera's own queued frame does not count against its
        // successor: due at 75 ms, frame 9 is behind 2..=5, 8 and its own
        // predecessor 6, which it replaces: 10 + 50 + 10 = 70 ms. Kept.
        assert_eq!(
            completes(&s.on_event(0, frame(9, "x", 75_000))),
            vec![(6, Status::Shed(ShedReason::Superseded))]
        );
        assert!(s.counters().balanced());
    }

    /// Finishes the batch dispatched in `actions` (if any) at `now`, all ok,
    /// reporting `latency_us`.
    fn finish_dispatched(s: &mut Scheduler, now: Micros, actions: &[Action], latency_us: u32) {
        if let Some(Action::Dispatch {
            worker,
            batch,
            frames,
            ..
        }) = actions
            .iter()
            .find(|a| matches!(a, Action::Dispatch { .. }))
        {
            let outcomes = frames.iter().map(|f| (*f, Status::Ok)).collect();
            s.on_event(
                now,
                Event::BatchFinished {
                    worker: *worker,
                    batch: *batch,
                    outcomes,
                    latency_us,
                },
            );
        }
    }

    #[test]
    fn one_outlier_batch_does_not_shed_the_model_for_ever() {
        // A GPU worker: 2 ms a frame. Its first batch takes 2 s (a cuDNN
        // algorithm search for a new input shape).
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, worker(1, 1, 2_000));
        let a = s.on_event(0, frame(1, "c", 80_000));
        assert_eq!(dispatches(&a), vec![vec![1]]);
        finish_dispatched(&mut s, 2_000_000, &a, 2_000_000);
        // Counted as at most 3 × 2 ms: the estimate is 2.8 ms, not 400 ms,
        // and the next frames are served.
        let mut t = 2_000_000;
        for id in 2..=6 {
            let a = s.on_event(t, frame(id, "c", t + 80_000));
            assert_eq!(dispatches(&a), vec![vec![id]], "frame {id}: {a:?}");
            finish_dispatched(&mut s, t + 2_000, &a, 2_000);
            t += 33_000;
        }
        assert!(s.counters().balanced());
    }

    #[test]
    fn an_estimate_beyond_every_deadline_relaxes_while_the_worker_idles() {
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, worker(1, 1, 2_000));
        // The worker really is slow for a while: 300 ms a frame, learned
        // over a few batches.
        let mut t = 0;
        let mut id = 0;
        while id < 20 {
            id += 1;
            let a = s.on_event(t, frame(id, "c", t + 1_000_000));
            assert_eq!(dispatches(&a), vec![vec![id]], "frame {id}: {a:?}");
            t += 300_000;
            finish_dispatched(&mut s, t, &a, 300_000);
        }
        assert!(s.workers[&WorkerId(1)].models["m"].latency(1) > 200_000);
        // Now no frame with an 80 ms budget looks like it can make it.
        id += 1;
        assert_eq!(
            completes(&s.on_event(t, frame(id, "c", t + 80_000))),
            vec![(id, Status::Shed(ShedReason::WouldMissDeadline))]
        );
        // Idle, the estimate relaxes towards the registered 2 ms: within a
        // fraction of a second it does not, ...
        id += 1;
        let soon = t + 200_000;
        assert_eq!(
            completes(&s.on_event(soon, frame(id, "c", soon + 80_000))),
            vec![(id, Status::Shed(ShedReason::WouldMissDeadline))]
        );
        // ... after a quiet 20 s a frame is dispatched again, whose
        // batch time then corrects the estimate.
        id += 1;
        let later = t + 20_000_000;
        let a = s.on_event(later, frame(id, "c", later + 80_000));
        assert_eq!(dispatches(&a), vec![vec![id]]);
        let before = s.workers[&WorkerId(1)].models["m"].latency(1);
        finish_dispatched(&mut s, later + 300_000, &a, 300_000);
        // Up by the bounded step (×1.4) per slow batch.
        let after = s.workers[&WorkerId(1)].models["m"].latency(1);
        assert!(after * 10 >= before * 13, "{before} -> {after}");
        assert!(s.counters().balanced());
    }

    #[test]
    fn one_observation_moves_the_estimate_a_bounded_step() {
        let mut p = ModelProfile::new(
            &WorkerModel {
                model: "m".into(),
                max_batch: 4,
                profile: vec![(1, 1_000), (4, 2_000)],
            },
            1_000,
        );
        p.observe(4, u32::MAX);
        // 0.8 × 2 ms + 0.2 × 3 × 2 ms: the curve grows by 1.4 at most.
        assert_eq!(p.latency(4), 2_800);
        assert_eq!(p.latency(1), 1_400);
        // Relaxing never goes below what was registered, and a worker
        // faster than registered keeps its estimate.
        p.relax(u64::MAX);
        assert_eq!((p.latency(1), p.latency(4)), (1_000, 2_000));
        for _ in 0..20 {
            p.observe(4, 1_000);
        }
        let fast = p.latency(4);
        assert!(fast < 2_000);
        p.relax(10_000_000);
        assert_eq!(p.latency(4), fast);
    }

    #[test]
    fn observed_latency_never_makes_a_bigger_batch_look_faster() {
        let mut p = ModelProfile::new(
            &WorkerModel {
                model: "m".into(),
                max_batch: 8,
                profile: vec![(1, 50), (8, 100)],
            },
            1_000,
        );
        // Only single frames ever run, and they take 500 µs on the wire.
        for _ in 0..30 {
            p.observe(1, 500);
        }
        assert!(p.latency(1) > 400);
        // A batch of 8 was never observed; it cannot be assumed faster than
        // one frame, or frames held for it would miss their deadline.
        assert!(p.latency(8) >= p.latency(1));
        assert!((1..8).all(|b| p.latency(b) <= p.latency(b + 1)));
    }

    #[test]
    fn a_busy_worker_gets_its_next_batch_just_before_it_frees() {
        let mut s = Scheduler::new(Limits::default()); // pipeline depth 2
        s.on_event(0, worker(1, 1, 10_000));
        // Frame 1 runs 0..10 ms; frame 2 goes as the second batch at once
        // (light load: the target batch is 1) and will start at 10 ms.
        assert_eq!(
            dispatches(&s.on_event(0, frame(1, "a", 80_000))),
            vec![vec![1]]
        );
        assert_eq!(
            dispatches(&s.on_event(0, frame(2, "b", 80_000))),
            vec![vec![2]]
        );
        // The pipeline is full: frame 3 waits in the gateway queue.
        assert!(dispatches(&s.on_event(0, frame(3, "c", 80_000))).is_empty());
        assert_eq!(s.queue_len("m"), 1);
        // A frame due at 25 ms cannot make it: the worker only frees at
        // 20 ms (both batches), + 10 ms = 30 ms. Shed on arrival.
        assert_eq!(
            completes(&s.on_event(0, frame(4, "d", 25_000))),
            vec![(4, Status::Shed(ShedReason::WouldMissDeadline))]
        );
        // Batch 1 returns at 10 ms: frame 3 is sent as the next batch.
        let a = s.on_event(
            10_000,
            Event::BatchFinished {
                worker: WorkerId(1),
                batch: BatchId(1),
                outcomes: vec![(FrameId(1), Status::Ok)],
                latency_us: 10_000,
            },
        );
        assert_eq!(dispatches(&a), vec![vec![3]]);
        assert!(s.counters().balanced());
        assert_eq!(s.counters().dispatched, 2);
    }

    #[test]
    fn a_draining_worker_finishes_its_batch_but_gets_no_new_one() {
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, worker(1, 1, 1_000));
        s.on_event(0, worker(2, 1, 5_000));
        assert_eq!(
            dispatches(&s.on_event(0, frame(1, "a", 80_000))),
            vec![vec![1]]
        );
        s.on_event(
            0,
            Event::WorkerDraining {
                worker: WorkerId(1),
            },
        );
        // Worker 2 is busy with frame 2; frame 3 waits for it, not for the
        // draining worker 1.
        assert_eq!(
            dispatches(&s.on_event(0, frame(2, "b", 80_000))),
            vec![vec![2]]
        );
        assert!(dispatches(&s.on_event(0, frame(3, "c", 80_000))).is_empty());
        let done = |w, b, f| Event::BatchFinished {
            worker: WorkerId(w),
            batch: BatchId(b),
            outcomes: vec![(FrameId(f), Status::Ok)],
            latency_us: 1_000,
        };
        // Worker 1's batch is still answered and accounted.
        let a = s.on_event(1_000, done(1, 1, 1));
        assert_eq!(completes(&a), vec![(1, Status::Ok)]);
        assert!(dispatches(&a).is_empty(), "draining worker got work: {a:?}");
        let a = s.on_event(5_000, done(2, 2, 2));
        assert_eq!(dispatches(&a), vec![vec![3]]);
        // With only the draining worker left, new frames have no worker.
        s.on_event(
            6_000,
            Event::WorkerLost {
                worker: WorkerId(2),
            },
        );
        assert_eq!(
            completes(&s.on_event(6_000, frame(4, "d", 80_000))),
            vec![(4, Status::Shed(ShedReason::NoWorker))]
        );
        assert!(s.counters().balanced());
    }

    #[test]
    fn a_worker_failing_its_frames_is_demoted_and_gets_only_probes_until_one_succeeds() {
        let mut s = Scheduler::new(one_deep());
        // Worker 1 is fast and fails everything; worker 2 is slow and honest.
        s.on_event(0, worker(1, 1, 1_000));
        s.on_event(0, worker(2, 1, 5_000));
        let done = |w, batch, f, status| Event::BatchFinished {
            worker: WorkerId(w),
            batch,
            outcomes: vec![(FrameId(f), status)],
            latency_us: 1_000,
        };
        let failed = || Status::Failed("boom".into());
        let sent = |a: &[Action]| -> Vec<(u64, usize, BatchId)> {
            a.iter()
                .filter_map(|a| match a {
                    Action::Dispatch {
                        worker,
                        batch,
                        frames,
                        ..
                    } => Some((worker.0, frames.len(), *batch)),
                    _ => None,
                })
                .collect()
        };
        let demotions = |a: &[Action]| -> Vec<Action> {
            a.iter()
                .filter(|a| matches!(a, Action::WorkerDemoted { .. }))
                .cloned()
                .collect()
        };
        // Seven failed frames are too few to judge; the eighth demotes.
        // Each failed frame goes to the honest worker instead of failing.
        for id in 1..=8u64 {
            let t = id * 10_000;
            let d = sent(&s.on_event(t, frame(id, "c", t + 80_000)));
            assert_eq!(d.len(), 1);
            assert_eq!(d[0].0, 1, "the fast worker takes frame {id}");
            let a = s.on_event(t + 1_000, done(1, d[0].2, id, failed()));
            assert!(completes(&a).is_empty(), "frame {id}: {a:?}");
            let retry = sent(&a);
            assert_eq!(
                retry.iter().map(|d| (d.0, d.1)).collect::<Vec<_>>(),
                vec![(2, 1)]
            );
            let ok = s.on_event(t + 6_000, done(2, retry[0].2, id, Status::Ok));
            assert_eq!(completes(&ok), vec![(id, Status::Ok)]);
            if id < 8 {
                assert!(demotions(&a).is_empty(), "frame {id}: {a:?}");
            } else {
                assert_eq!(
                    demotions(&a),
                    vec![Action::WorkerDemoted {
                        worker: WorkerId(1),
                        model: "m".into(),
                        reason: DemotionReason::FailureRatio { failed: 8, of: 8 },
                        backoff_us: 1_000_000,
                        probe_failed: false,
                    }]
                );
            }
        }
        assert_eq!(s.demoted_count(), 1);
        assert!(s.is_demoted(WorkerId(1)));
        // The back-off's end wakes the scheduler.
        assert_eq!(s.next_wakeup(), Some(1_081_000));
        // Backing off, it gets nothing: the slow worker takes every frame.
        let mut id = 100;
        for t in (100_000..1_000_000).step_by(100_000) {
            id += 1;
            let d = sent(&s.on_event(t, frame(id, "c", t + 80_000)));
            assert_eq!(d.iter().map(|d| d.0).collect::<Vec<_>>(), vec![2]);
            s.on_event(t + 5_000, done(2, d[0].2, id, Status::Ok));
        }
        // After it, one probe of one frame; while it is out, nothing more.
        let t = 1_100_000;
        let a = s.on_event(t, frame(201, "a", t + 80_000));
        let probe = sent(&a);
        assert_eq!(
            probe.iter().map(|d| (d.0, d.1)).collect::<Vec<_>>(),
            vec![(1, 1)]
        );
        let d = sent(&s.on_event(t, frame(202, "b", t + 80_000)));
        assert_eq!(d.iter().map(|d| d.0).collect::<Vec<_>>(), vec![2]);
        assert!(dispatches(&s.on_event(t, frame(203, "x", t + 80_000))).is_empty());
        // The probe fails: demoted again, for twice as long, not counted as
        // a new demotion.
        let a = s.on_event(t + 1_000, done(1, probe[0].2, 201, failed()));
        assert!(matches!(
            demotions(&a)[..],
            [Action::WorkerDemoted {
                backoff_us: 2_000_000,
                probe_failed: true,
                ..
            }]
        ));
        // The next probe succeeds: it serves again.
        let t = 3_200_000;
        s.on_event(t, done(2, d[0].2, 202, Status::Ok));
        let a = s.on_event(t, frame(301, "a", t + 80_000));
        let probe = sent(&a);
        assert_eq!(
            probe.iter().map(|d| (d.0, d.1)).collect::<Vec<_>>(),
            vec![(1, 1)]
        );
        let a = s.on_event(t + 1_000, done(1, probe[0].2, 301, Status::Ok));
        assert!(a.contains(&Action::WorkerRestored {
            worker: WorkerId(1)
        }));
        assert_eq!(s.demoted_count(), 0);
        assert!(s.counters().balanced());
    }

    /// What `BatchFinished` of one frame `f` on worker `w` looks like.
    fn one_done(w: u64, batch: BatchId, f: u64, status: Status) -> Event {
        Event::BatchFinished {
            worker: WorkerId(w),
            batch,
            outcomes: vec![(FrameId(f), status)],
            latency_us: 1_000,
        }
    }

    /// The (worker, frames, batch) of each dispatch in `a`.
    fn sent_to(a: &[Action]) -> Vec<(u64, Vec<u64>, BatchId)> {
        a.iter()
            .filter_map(|a| match a {
                Action::Dispatch {
                    worker,
                    batch,
                    frames,
                    ..
                } => Some((worker.0, frames.iter().map(|f| f.0).collect(), *batch)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_frame_a_worker_fails_goes_once_to_another_and_never_back() {
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, worker(1, 1, 1_000));
        s.on_event(0, worker(2, 1, 5_000));
        let failed = || Status::Failed("boom".into());
        let d = sent_to(&s.on_event(0, frame(1, "c", 80_000)));
        assert_eq!(d[0].0, 1);
        // Failed on 1: queued for 2, not completed.
        let a = s.on_event(1_000, one_done(1, d[0].2, 1, failed()));
        assert!(completes(&a).is_empty(), "{a:?}");
        let d = sent_to(&a);
        assert_eq!((d[0].0, d[0].1.clone()), (2, vec![1]));
        assert_eq!(s.counters().retried, 1);
        assert!(s.counters().balanced());
        // Failed again on 2: no second retry, it fails with 2's reason.
        let a = s.on_event(
            6_000,
            one_done(2, d[0].2, 1, Status::Failed("again".into())),
        );
        assert_eq!(completes(&a), vec![(1, Status::Failed("again".into()))]);
        assert_eq!(s.counters().retried, 1);
        assert_eq!(s.counters().failed, 1);
        assert!(s.counters().balanced());
    }

    #[test]
    fn a_retried_frame_waits_for_another_worker_while_the_one_that_failed_it_idles() {
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, worker(1, 4, 1_000));
        s.on_event(0, worker(2, 4, 5_000));
        let d = sent_to(&s.on_event(0, frame(1, "c", 80_000)));
        assert_eq!(d[0].0, 1);
        // 2 is busy with another camera's frame when 1 fails frame 1.
        let busy = sent_to(&s.on_event(100, frame(2, "d", 80_100)));
        assert_eq!(busy[0].0, 2);
        let a = s.on_event(1_000, one_done(1, d[0].2, 1, Status::Failed("boom".into())));
        // 1 is idle, yet the frame it failed waits for 2.
        assert!(sent_to(&a).is_empty(), "{a:?}");
        assert!(completes(&a).is_empty(), "{a:?}");
        assert_eq!(s.queue_len("m"), 1);
        // A new frame meanwhile goes to 1; the retried one does not join it.
        let a = s.on_event(2_000, frame(3, "e", 82_000));
        assert_eq!(
            sent_to(&a)
                .into_iter()
                .map(|d| (d.0, d.1))
                .collect::<Vec<_>>(),
            vec![(1, vec![3])]
        );
        // When 2 frees, it takes the retried frame.
        let a = s.on_event(5_100, one_done(2, busy[0].2, 2, Status::Ok));
        assert_eq!(completes(&a), vec![(2, Status::Ok)]);
        assert_eq!(
            sent_to(&a)
                .into_iter()
                .map(|d| (d.0, d.1))
                .collect::<Vec<_>>(),
            vec![(2, vec![1])]
        );
        assert!(s.counters().balanced());
    }

    #[test]
    fn a_failed_frame_fails_without_another_worker_time_or_a_connected_edge() {
        let failed = || Status::Failed("boom".into());
        // No other worker.
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, worker(1, 1, 1_000));
        let d = sent_to(&s.on_event(0, frame(1, "c", 80_000)));
        let a = s.on_event(1_000, one_done(1, d[0].2, 1, failed()));
        assert_eq!(completes(&a), vec![(1, failed())]);
        // Another worker, but too slow for what is left of the budget.
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, worker(1, 1, 1_000));
        s.on_event(0, worker(2, 1, 50_000));
        let d = sent_to(&s.on_event(0, frame(1, "c", 40_000)));
        assert_eq!(d[0].0, 1);
        let a = s.on_event(1_000, one_done(1, d[0].2, 1, failed()));
        assert_eq!(completes(&a), vec![(1, failed())]);
        // A newer frame of the same camera is queued: it supersedes.
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, worker(1, 1, 1_000));
        s.on_event(0, worker(2, 1, 5_000));
        let d = sent_to(&s.on_event(0, frame(1, "c", 80_000)));
        let busy = sent_to(&s.on_event(0, frame(2, "other", 80_000)));
        assert_eq!((d[0].0, busy[0].0), (1, 2));
        s.on_event(500, frame(3, "c", 80_500));
        let a = s.on_event(1_000, one_done(1, d[0].2, 1, failed()));
        assert!(completes(&a).contains(&(1, failed())), "{a:?}");
        // A frame the worker left out of its answer is retried as well.
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, worker(1, 1, 1_000));
        s.on_event(0, worker(2, 1, 5_000));
        let d = sent_to(&s.on_event(0, frame(1, "c", 80_000)));
        let a = s.on_event(
            1_000,
            Event::BatchFinished {
                worker: WorkerId(1),
                batch: d[0].2,
                outcomes: vec![],
                latency_us: 1_000,
            },
        );
        assert_eq!(sent_to(&a)[0].1, vec![1]);
        assert_eq!(sent_to(&a)[0].0, 2);
        assert_eq!(s.counters().retried, 1);
        assert!(s.counters().balanced());
    }

    fn join(edge: u64, name: &str, weight: u32) -> Event {
        Event::EdgeJoined {
            edge: EdgeId(edge),
            name: name.into(),
            weight,
        }
    }

    fn frame_of(id: u64, edge: u64, camera: &str, deadline: Micros) -> Event {
        Event::FrameArrived(Arrival {
            id: FrameId(id),
            edge: EdgeId(edge),
            camera: camera.into(),
            model: "m".into(),
            deadline,
        })
    }

    /// Answers the batch `actions` dispatched, if any, `ok` at `now`; what
    /// the scheduler does next.
    fn answer_ok(s: &mut Scheduler, now: Micros, actions: &[Action]) -> Vec<Action> {
        let Some(Action::Dispatch {
            worker,
            batch,
            frames,
            ..
        }) = actions
            .iter()
            .find(|a| matches!(a, Action::Dispatch { .. }))
        else {
            return Vec::new();
        };
        let outcomes = frames.iter().map(|f| (*f, Status::Ok)).collect();
        s.on_event(
            now,
            Event::BatchFinished {
                worker: *worker,
                batch: *batch,
                outcomes,
                latency_us: 1_000,
            },
        )
    }

    /// Serves one frame at a time on a one-deep worker from `first` on
    /// (the actions that dispatched the first batch); the frames in the
    /// order they were dispatched.
    fn served_order(s: &mut Scheduler, first: Vec<Action>, rounds: usize) -> Vec<u64> {
        let mut order = Vec::new();
        let mut actions = first;
        let mut now = 0;
        for _ in 0..rounds {
            let Some(batch) = dispatches(&actions).into_iter().next() else {
                break;
            };
            order.extend(batch);
            now += 1_000;
            actions = answer_ok(s, now, &actions);
        }
        order
    }

    #[test]
    fn two_edges_with_queued_frames_take_turns_whatever_their_deadlines() {
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, worker(1, 1, 1_000));
        s.on_event(0, join(1, "a", 1));
        s.on_event(0, join(2, "b", 1));
        // Edge a's frames are all more urgent: pure EDF would serve them
        // all before any of b's.
        let first = s.on_event(0, frame_of(1, 1, "a1", 1_000_000));
        for i in 2..=4 {
            s.on_event(0, frame_of(i, 1, &format!("a{i}"), 1_000_000 + i));
        }
        for i in 11..=14 {
            s.on_event(0, frame_of(i, 2, &format!("b{i}"), 5_000_000 + i));
        }
        let order = served_order(&mut s, first, 8);
        assert_eq!(order, vec![1, 11, 2, 12, 3, 13, 4, 14]);
        assert!(s.counters().balanced());
    }

    #[test]
    fn an_edge_of_weight_two_gets_two_frames_for_each_of_an_edge_of_weight_one() {
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, worker(1, 1, 1_000));
        s.on_event(0, join(1, "heavy", 2));
        s.on_event(0, join(2, "light", 1));
        let first = s.on_event(0, frame_of(1, 1, "h1", 9_000_000));
        for i in 2..=12 {
            s.on_event(0, frame_of(i, 1, &format!("h{i}"), 9_000_000 + i));
        }
        for i in 101..=112 {
            s.on_event(0, frame_of(i, 2, &format!("l{i}"), 1_000_000 + i));
        }
        let order = served_order(&mut s, first, 12);
        let heavy = order.iter().filter(|id| **id < 100).count();
        assert_eq!((heavy, order.len() - heavy), (8, 4), "{order:?}");
    }

    #[test]
    fn every_connection_of_an_edge_name_counts_against_its_queue_cap() {
        let mut s = Scheduler::new(Limits {
            max_queued_per_edge: 3,
            ..one_deep()
        });
        s.on_event(0, worker(1, 1, 1_000));
        for conn in [1, 2, 3] {
            s.on_event(0, join(conn, "a", 1));
        }
        s.on_event(0, join(9, "b", 1));
        s.on_event(0, frame_of(1, 1, "x", 9_000_000)); // dispatched at once
        s.on_event(0, frame_of(2, 1, "y", 9_000_000));
        s.on_event(0, frame_of(3, 2, "y", 9_000_000));
        s.on_event(0, frame_of(4, 3, "y", 9_000_000));
        let a = s.on_event(0, frame_of(5, 3, "z", 9_000_000));
        assert_eq!(
            completes(&a),
            vec![(5, Status::Shed(ShedReason::Overloaded))]
        );
        // Another edge name has a cap of its own.
        let a = s.on_event(0, frame_of(6, 9, "y", 9_000_000));
        assert_eq!(completes(&a), vec![]);
    }

    #[test]
    fn an_edge_under_its_share_of_a_full_queue_pushes_out_a_frame_of_the_edge_over_it() {
        let mut s = Scheduler::new(Limits {
            max_queued: 4,
            max_queued_per_edge: 100,
            ..one_deep()
        });
        s.on_event(0, worker(1, 1, 1_000));
        s.on_event(0, join(1, "hog", 1));
        s.on_event(0, join(2, "hog", 1));
        s.on_event(0, join(3, "fair", 1));
        s.on_event(0, frame_of(1, 1, "c1", 9_000_000)); // dispatched at once
        for i in 2..=5 {
            let a = s.on_event(0, frame_of(i, 1 + i % 2, &format!("c{i}"), 9_000_000 + i));
            assert_eq!(completes(&a), vec![], "frame {i}");
        }
        // Full. The hog's least urgent frame makes room for the fair edge.
        let a = s.on_event(0, frame_of(10, 3, "f1", 9_000_000));
        assert_eq!(
            completes(&a),
            vec![(5, Status::Shed(ShedReason::Overloaded))]
        );
        let a = s.on_event(0, frame_of(11, 3, "f2", 9_000_000));
        assert_eq!(
            completes(&a),
            vec![(4, Status::Shed(ShedReason::Overloaded))]
        );
        // Now at its share (half of 4): its next frame is refused instead.
        let a = s.on_event(0, frame_of(12, 3, "f3", 9_000_000));
        assert_eq!(
            completes(&a),
            vec![(12, Status::Shed(ShedReason::Overloaded))]
        );
        // And the hog, at its share too, pushes out nobody.
        let a = s.on_event(0, frame_of(13, 2, "c13", 9_000_000));
        assert_eq!(
            completes(&a),
            vec![(13, Status::Shed(ShedReason::Overloaded))]
        );
        assert!(s.counters().balanced());
    }

    #[test]
    fn a_gone_edges_queued_and_trailing_frames_are_dropped_and_its_running_frame_finishes() {
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, worker(1, 1, 1_000));
        s.on_event(0, join(1, "a", 1));
        s.on_event(0, join(2, "a", 1));
        let running = s.on_event(0, frame_of(1, 1, "x", 9_000_000));
        s.on_event(0, frame_of(2, 1, "y", 9_000_000));
        s.on_event(0, frame_of(3, 1, "z", 9_000_000));
        // Another connection of the same name is not touched.
        s.on_event(0, frame_of(4, 2, "y", 9_000_000));
        let a = s.on_event(10, Event::EdgeGone { edge: EdgeId(1) });
        assert_eq!(
            completes(&a),
            vec![
                (2, Status::Shed(ShedReason::EdgeGone)),
                (3, Status::Shed(ShedReason::EdgeGone))
            ]
        );
        let a = s.on_event(20, frame_of(5, 1, "x", 9_000_000));
        assert_eq!(completes(&a), vec![(5, Status::Shed(ShedReason::EdgeGone))]);
        // The frame on the worker finishes; the other connection's is next.
        let a = answer_ok(&mut s, 1_000, &running);
        assert_eq!(completes(&a), vec![(1, Status::Ok)]);
        assert_eq!(dispatches(&a), vec![vec![4]]);
        let c = s.counters();
        assert!(c.balanced() && c.shed == 3 && c.queued == 0, "{c:?}");
    }

    #[test]
    fn a_frame_queued_before_its_connection_joined_is_dropped_when_it_goes() {
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, worker(1, 1, 1_000));
        s.on_event(0, frame_of(1, 1, "x", 9_000_000)); // dispatched at once
        s.on_event(0, frame_of(2, 1, "y", 9_000_000));
        s.on_event(0, join(1, "a", 1));
        let a = s.on_event(10, Event::EdgeGone { edge: EdgeId(1) });
        assert_eq!(completes(&a), vec![(2, Status::Shed(ShedReason::EdgeGone))]);
        assert_eq!(s.counters().queued, 0);
    }

    #[test]
    fn a_lost_workers_frame_of_a_gone_edge_is_dropped_not_queued_again() {
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, worker(1, 1, 1_000));
        s.on_event(0, frame_of(1, 1, "x", 9_000_000));
        s.on_event(10, Event::EdgeGone { edge: EdgeId(1) });
        let a = s.on_event(
            20,
            Event::WorkerLost {
                worker: WorkerId(1),
            },
        );
        assert_eq!(completes(&a), vec![(1, Status::Shed(ShedReason::EdgeGone))]);
        assert_eq!(s.counters().requeued, 0);
    }

    #[test]
    fn interpolation_extends_profile_linearly() {
        let pts = [(1, 1_000), (4, 2_500)];
        assert_eq!(interpolate(&pts, 1, 0), 1_000.0);
        assert_eq!(interpolate(&pts, 2, 0), 1_500.0);
        assert_eq!(interpolate(&pts, 8, 0), 4_500.0);
        assert_eq!(interpolate(&[], 3, 100), 300.0);
    }
}
