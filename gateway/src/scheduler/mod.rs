//! The scheduler: a pure, clock-injected state machine that decides what
//! becomes of each admitted frame.
//!
//! It owns the per-model queues, the edges' fair shares of the queue and of
//! the workers, and the batches each worker has running. It owns no
//! sockets, no payloads and no clock, and must not block or wait: the async
//! shell (`crate::hub`) feeds it [`Event`]s with the current time in
//! microseconds and carries out the [`Action`]s it returns. Every admitted
//! frame ends in exactly one [`Action::Complete`]; [`Counters`] always
//! satisfy `admitted == ok + shed + expired + failed + in_flight`.
//!
//! Where a frame goes, and which file decides (each says its policy):
//! - `admission.rs`: on arrival it is shed at once or queued; one that
//!   cannot make its deadline is blamed on its link or on the workers by
//!   `transfer.rs` (its age on arrival against its camera's usual one);
//! - `queue.rs`: it waits in its model's earliest-deadline-first queue, and
//!   expires there at its deadline;
//! - `fair_share.rs`: it counts to its edge's account, whose weight sets
//!   its share of the queue and of the batches; `edges.rs`: connections
//!   joining and going;
//! - `dispatch.rs`: a worker takes it in a batch ([`Action::Dispatch`]),
//!   sized by the model's latency profile (`profile.rs`) and arrival rate
//!   (`demand.rs`) and cut to the earliest deadline;
//! - `batch_results.rs`: the worker's answer ends it, or sends it once to
//!   another worker, and judges the worker's health; the batch's run time,
//!   measured on the scheduler's own clock, refines the profile;
//! - `workers.rs`: a stalled or lost worker's frames are queued again or
//!   failed; a draining worker may resume;
//! - `trial.rs`: a frame every estimate says is too late even alone goes,
//!   now and then, alone to an idle worker, so that an estimate too slow
//!   for every frame (a profile measured on a busy host) is put to the
//!   test instead of shedding its model for ever.
//!
//! The shell then sends each [`Action::Complete`]'s result to the frame's
//! edge.

mod admission;
mod batch_results;
mod demand;
mod dispatch;
mod edges;
mod fair_share;
mod profile;
mod queue;
mod transfer;
mod trial;
mod workers;

#[cfg(test)]
mod tests;

use std::collections::{BTreeSet, HashMap};

use tidegate_protocol::{ShedReason, Status};

use crate::health::{DemotionReason, HealthPolicy};

pub use batch_results::BatchRun;
use demand::Demand;
pub use fair_share::MAX_WEIGHT;
use fair_share::{Account, Share};
pub use profile::profile_latency_us;
use queue::Queued;
use transfer::AgeFloor;
pub use transfer::FLOOR_WINDOW;
pub use trial::TRIAL_AFTER_US;
use workers::Worker;

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
    /// How old it was when it arrived: its time on the edge's send path
    /// and the link (µs). Against its camera's usual age, it tells whether
    /// a missed deadline is the link's fault or the workers' (see
    /// `transfer.rs`).
    pub age: Micros,
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
    /// A worker returned a batch: one outcome per frame it was given. Its
    /// run time, which refines the worker's profile, is the scheduler's own
    /// measure ([`Scheduler::batch_run`]), taken at this event's `now`.
    BatchFinished {
        /// The worker.
        worker: WorkerId,
        /// The batch.
        batch: BatchId,
        /// Per frame: `Ok` or `Failed` as reported by the worker.
        outcomes: Vec<(FrameId, Status)>,
    },
    /// A worker is draining (it said so, or its lease got a preemption
    /// notice): it gets no new batch; the ones it holds still finish.
    WorkerDraining {
        /// The worker.
        worker: WorkerId,
    },
    /// A draining worker, still connected, takes batches again (a static
    /// worker bound to a lease again). It keeps what it had: the batches
    /// it holds (they still finish), its learned profile and its health.
    /// The shell decides who may resume: a worker that said `Drain` never
    /// does.
    WorkerResumed {
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
    /// A worker answered a batch it holds: the frames sent in it (only
    /// these take their answer's outputs; a worker may not answer for
    /// another's frames) and its run time ([`Scheduler::batch_run`]),
    /// which has refined the worker's profile. Comes before the
    /// [`Action::Complete`]s of the batch's frames. An answer to a batch
    /// the worker no longer holds (re-homed when it was lost or dropped)
    /// has none: it is ignored.
    BatchRan {
        /// The worker.
        worker: WorkerId,
        /// The batch.
        batch: BatchId,
        /// Its model.
        model: String,
        /// The frames it was sent with, in order.
        frames: Vec<FrameId>,
        /// Its run time (µs).
        run_us: u32,
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
    /// Frames no worker's estimate could finish in time, sent alone to an
    /// idle worker as a trial of its estimate (`trial.rs`; dispatched
    /// frames, so not part of the identity either).
    pub trials: u64,
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

/// The scheduler's bounds and margins (the wire's are
/// `tidegate_protocol::Limits`, the gateway's memory budgets `[limits]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
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

impl Default for Settings {
    fn default() -> Self {
        Settings {
            max_queued: 4096,
            max_queued_per_edge: 256,
            default_latency_us: 20_000,
            pipeline_depth: 2,
            stall_us: 10_000_000,
            health: HealthPolicy::default(),
        }
    }
}

/// The scheduler state machine. See the module docs.
#[derive(Debug)]
pub struct Scheduler {
    limits: Settings,
    /// Per model: (deadline, frame) in EDF order.
    queues: HashMap<String, BTreeSet<(Micros, FrameId)>>,
    queued: HashMap<FrameId, Queued>,
    /// The queued frame of each camera (newest wins).
    by_camera: HashMap<(EdgeId, String), FrameId>,
    /// Each camera's usual age on arrival (`transfer.rs`), until its edge
    /// goes.
    age_floors: HashMap<(EdgeId, String), AgeFloor>,
    /// Per model, per account: (deadline, frame) in EDF order.
    by_account: HashMap<String, HashMap<Account, BTreeSet<(Micros, FrameId)>>>,
    /// The account of each joined connection.
    accounts: HashMap<EdgeId, Account>,
    /// Accounts with frames queued or connections joined.
    shares: HashMap<Account, Share>,
    /// Start tag of the last frame picked (see [`Share::vtime`]).
    vnow: u64,
    /// Connections gone most recently, oldest first (at most
    /// [`GONE_EDGES_KEPT`](edges::GONE_EDGES_KEPT)).
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
    pub fn new(limits: Settings) -> Self {
        Scheduler {
            limits,
            queues: HashMap::new(),
            queued: HashMap::new(),
            by_camera: HashMap::new(),
            age_floors: HashMap::new(),
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

    /// Whether `worker` is demoted for failing its frames.
    pub fn is_demoted(&self, worker: WorkerId) -> bool {
        self.workers
            .get(&worker)
            .is_some_and(|w| w.health.demoted())
    }

    /// What the scheduler expects, at `now`, a batch of `batch` frames of
    /// `model` to take on `worker` (µs): its registered profile as refined
    /// by the batches it returned, and relaxed for the time it has run
    /// nothing (as the next event would relax it). `None` for a worker or
    /// model it does not know.
    pub fn latency_estimate_us(
        &self,
        now: Micros,
        worker: WorkerId,
        model: &str,
        batch: u16,
    ) -> Option<u64> {
        let w = self.workers.get(&worker)?;
        let profile = w.models.get(model)?;
        let batch = usize::from(batch);
        if !w.running.is_empty() {
            return Some(profile.latency(batch));
        }
        let mut relaxed = profile.clone();
        relaxed.relax(now.saturating_sub(w.relaxed_at));
        Some(relaxed.latency(batch))
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
            Event::WorkerJoined { worker, models } => self.join_worker(now, worker, &models),
            Event::BatchFinished {
                worker,
                batch,
                outcomes,
            } => self.finish(now, worker, batch, outcomes, &mut out),
            Event::WorkerDraining { worker } => {
                if let Some(w) = self.workers.get_mut(&worker) {
                    w.draining = true;
                }
            }
            Event::WorkerResumed { worker } => {
                if let Some(w) = self.workers.get_mut(&worker) {
                    w.draining = false;
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
}
