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
//! - per-edge and global bounds on queued frames (`overloaded`);
//! - a frame that no worker can finish before its deadline, given its
//!   measured latency profile, is shed before dispatch (`would_miss_deadline`);
//!   a frame whose deadline passes while queued ends `expired`;
//! - an idle worker takes the most urgent model it serves, up to its batch
//!   limit, choosing the batch size from its profile so the earliest deadline
//!   still holds;
//! - a lost worker's in-flight frames are queued again if their deadline
//!   allows, otherwise they fail with `worker lost`.

use std::collections::{BTreeSet, HashMap};

use tidegate_protocol::{ShedReason, Status};

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
    /// A worker's connection died; what it held must be re-homed.
    WorkerLost {
        /// The worker.
        worker: WorkerId,
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
    /// The frame is finished: send this result to its edge.
    Complete {
        /// The frame.
        frame: FrameId,
        /// Its final status.
        status: Status,
        /// Time it spent queued in the gateway (µs).
        queue_us: u32,
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
    /// Most frames queued per edge.
    pub max_queued_per_edge: usize,
    /// Latency assumed for a worker with no profile point (µs).
    pub default_latency_us: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_queued: 4096,
            max_queued_per_edge: 256,
            default_latency_us: 20_000,
        }
    }
}

#[derive(Debug, Clone)]
struct Queued {
    arrival: Arrival,
    enqueued: Micros,
    /// When it was (last) dispatched; queue time ends there.
    dispatched: Option<Micros>,
}

#[derive(Debug)]
struct Worker {
    models: HashMap<String, ModelProfile>,
    /// The batch it is running, if any (one in flight per worker).
    busy: Option<BatchId>,
}

#[derive(Debug, Clone)]
struct ModelProfile {
    max_batch: u16,
    /// Latency (µs) per batch size 1..=max_batch, smoothed by EWMA.
    latency: Vec<f64>,
}

impl ModelProfile {
    fn new(m: &WorkerModel, default_latency_us: u32) -> Self {
        let max_batch = m.max_batch.max(1);
        let mut points: Vec<(u16, u32)> = m.profile.clone();
        points.sort_unstable();
        let latency = (1..=max_batch)
            .map(|b| interpolate(&points, b, default_latency_us))
            .collect();
        ModelProfile { max_batch, latency }
    }

    fn latency(&self, batch: usize) -> u64 {
        let i = batch.clamp(1, self.latency.len()) - 1;
        self.latency[i].ceil() as u64
    }

    fn observe(&mut self, batch: usize, latency_us: u32) {
        const ALPHA: f64 = 0.2;
        let i = batch.clamp(1, self.latency.len()) - 1;
        self.latency[i] = (1.0 - ALPHA) * self.latency[i] + ALPHA * latency_us as f64;
    }
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

/// The scheduler state machine. See the module docs.
#[derive(Debug)]
pub struct Scheduler {
    limits: Limits,
    /// Per model: (deadline, frame) in EDF order.
    queues: HashMap<String, BTreeSet<(Micros, FrameId)>>,
    queued: HashMap<FrameId, Queued>,
    /// The queued frame of each camera (newest wins).
    by_camera: HashMap<(EdgeId, String), FrameId>,
    per_edge: HashMap<EdgeId, usize>,
    workers: HashMap<WorkerId, Worker>,
    /// Frames each in-flight batch holds.
    batches: HashMap<BatchId, (WorkerId, Vec<Queued>)>,
    next_batch: u64,
    counters: Counters,
}

impl Scheduler {
    /// An empty scheduler.
    pub fn new(limits: Limits) -> Self {
        Scheduler {
            limits,
            queues: HashMap::new(),
            queued: HashMap::new(),
            by_camera: HashMap::new(),
            per_edge: HashMap::new(),
            workers: HashMap::new(),
            batches: HashMap::new(),
            next_batch: 1,
            counters: Counters::default(),
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

    /// The earliest time at which a queued frame expires: the shell should
    /// deliver a [`Event::Tick`] then.
    pub fn next_wakeup(&self) -> Option<Micros> {
        self.queues
            .values()
            .filter_map(|q| q.first().map(|(d, _)| *d))
            .min()
    }

    /// Number of registered workers, and how many are busy.
    pub fn worker_counts(&self) -> (usize, usize) {
        let busy = self.workers.values().filter(|w| w.busy.is_some()).count();
        (self.workers.len(), busy)
    }

    /// Applies one event at time `now` and returns what to do.
    pub fn on_event(&mut self, now: Micros, event: Event) -> Vec<Action> {
        let mut out = Vec::new();
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
                self.workers.insert(worker, Worker { models, busy: None });
            }
            Event::BatchFinished {
                worker,
                batch,
                outcomes,
                latency_us,
            } => self.finish(now, worker, batch, outcomes, latency_us, &mut out),
            Event::WorkerLost { worker } => self.lose(now, worker, &mut out),
            Event::Tick => {}
        }
        self.expire(now, &mut out);
        self.dispatch(now, &mut out);
        out
    }

    fn complete(&mut self, now: Micros, q: &Queued, status: Status, out: &mut Vec<Action>) {
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
        if let Some(n) = self.per_edge.get_mut(&q.arrival.edge) {
            *n = n.saturating_sub(1);
        }
        self.counters.queued -= 1;
        Some(q)
    }

    fn enqueue(&mut self, q: Queued) {
        let a = &q.arrival;
        self.queues
            .entry(a.model.clone())
            .or_default()
            .insert((a.deadline, a.id));
        self.by_camera.insert((a.edge, a.camera.clone()), a.id);
        *self.per_edge.entry(a.edge).or_default() += 1;
        self.counters.queued += 1;
        self.queued.insert(a.id, q);
    }

    /// Fastest single-frame latency any worker serving `model` offers.
    fn best_latency(&self, model: &str) -> Option<u64> {
        self.workers
            .values()
            .filter_map(|w| w.models.get(model).map(|p| p.latency(1)))
            .min()
    }

    fn arrive(&mut self, now: Micros, a: Arrival, out: &mut Vec<Action>) {
        self.counters.admitted += 1;
        let q = Queued {
            arrival: a,
            enqueued: now,
            dispatched: None,
        };
        let Some(best) = self.best_latency(&q.arrival.model) else {
            self.complete(now, &q, Status::Shed(ShedReason::NoWorker), out);
            return;
        };
        if now + best > q.arrival.deadline {
            self.complete(now, &q, Status::Shed(ShedReason::WouldMissDeadline), out);
            return;
        }
        // The newest frame of a camera supersedes the one still waiting.
        let key = (q.arrival.edge, q.arrival.camera.clone());
        if let Some(old) = self
            .by_camera
            .get(&key)
            .copied()
            .and_then(|id| self.unqueue(id))
        {
            self.complete(now, &old, Status::Shed(ShedReason::Superseded), out);
        }
        let edge_queued = self.per_edge.get(&q.arrival.edge).copied().unwrap_or(0);
        if self.queued.len() >= self.limits.max_queued
            || edge_queued >= self.limits.max_queued_per_edge
        {
            self.complete(now, &q, Status::Shed(ShedReason::Overloaded), out);
            return;
        }
        self.enqueue(q);
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

    fn dispatch(&mut self, now: Micros, out: &mut Vec<Action>) {
        let mut idle: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(_, w)| w.busy.is_none())
            .map(|(id, _)| *id)
            .collect();
        idle.sort_unstable();
        for wid in idle {
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
            let mut frames = Vec::new();
            while let Some(&(deadline, id)) = self.queues.get(&model).and_then(|q| q.first()) {
                if now + profile.latency(1) > deadline {
                    // Cannot make it even alone on this worker: shed it if
                    // no other worker could either, else leave it for them.
                    if frames.is_empty()
                        && self.best_latency(&model).is_none_or(|b| now + b > deadline)
                    {
                        let q = self.unqueue(id).expect("queued frame is indexed");
                        self.complete(now, &q, Status::Shed(ShedReason::WouldMissDeadline), out);
                        continue;
                    }
                    break;
                }
                if frames.len() >= profile.max_batch as usize {
                    break;
                }
                // The batch's earliest deadline (its first frame) must hold
                // with one more frame in it.
                let first_deadline = frames
                    .first()
                    .map(|q: &Queued| q.arrival.deadline)
                    .unwrap_or(deadline);
                if !frames.is_empty() && now + profile.latency(frames.len() + 1) > first_deadline {
                    break;
                }
                frames.push(self.unqueue(id).expect("queued frame is indexed"));
            }
            if frames.is_empty() {
                continue;
            }
            let batch = BatchId(self.next_batch);
            self.next_batch += 1;
            self.counters.dispatched += frames.len() as u64;
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
                w.busy = Some(batch);
            }
            self.batches.insert(batch, (wid, frames));
        }
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
            w.busy = None;
            if let Some(p) = frames
                .first()
                .and_then(|q| w.models.get_mut(&q.arrival.model))
            {
                p.observe(frames.len(), latency_us);
            }
        }
        let mut by_id: HashMap<FrameId, Status> = outcomes.into_iter().collect();
        for q in frames {
            self.counters.dispatched -= 1;
            let status = match by_id.remove(&q.arrival.id) {
                Some(Status::Ok) => Status::Ok,
                Some(Status::Failed(reason)) => Status::Failed(reason),
                Some(other) => Status::Failed(format!(
                    "worker answered with status '{}', which only the gateway may assign",
                    other.label()
                )),
                None => Status::Failed("worker returned no result for this frame".into()),
            };
            self.complete(now, &q, status, out);
        }
    }

    fn lose(&mut self, now: Micros, worker: WorkerId, out: &mut Vec<Action>) {
        self.workers.remove(&worker);
        let lost: Vec<BatchId> = self
            .batches
            .iter()
            .filter(|(_, (w, _))| *w == worker)
            .map(|(b, _)| *b)
            .collect();
        for b in lost {
            let (_, frames) = self.batches.remove(&b).expect("listed above");
            for q in frames {
                self.counters.dispatched -= 1;
                let still_possible = self
                    .best_latency(&q.arrival.model)
                    .is_some_and(|l| now + l <= q.arrival.deadline);
                let newer_queued = self
                    .by_camera
                    .contains_key(&(q.arrival.edge, q.arrival.camera.clone()));
                if still_possible && !newer_queued {
                    self.enqueue(q);
                } else {
                    self.complete(now, &q, Status::Failed("worker lost".into()), out);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let mut s = Scheduler::new(Limits::default());
        let a = s.on_event(0, frame(1, "c", 80_000));
        assert_eq!(completes(&a), vec![(1, Status::Shed(ShedReason::NoWorker))]);
        assert!(s.counters().balanced());
    }

    #[test]
    fn idle_worker_gets_frame_and_result_completes_ok() {
        let mut s = Scheduler::new(Limits::default());
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
        let mut s = Scheduler::new(Limits::default());
        s.on_event(0, worker(1, 1, 50_000));
        let a = s.on_event(0, frame(1, "c", 40_000));
        assert_eq!(
            completes(&a),
            vec![(1, Status::Shed(ShedReason::WouldMissDeadline))]
        );
    }

    #[test]
    fn newer_frame_of_camera_supersedes_queued_one() {
        let mut s = Scheduler::new(Limits::default());
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
        let mut s = Scheduler::new(Limits::default());
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
        let mut s = Scheduler::new(Limits::default());
        s.on_event(0, worker(9, 8, 10_000));
        let first = s.on_event(0, frame(100, "z", 900_000));
        assert!(matches!(first[0], Action::Dispatch { .. }));
        for (i, d) in [(1, 50_000), (2, 30_000), (3, 70_000), (4, 45_000)] {
            assert!(s.on_event(0, frame(i, &format!("c{i}"), d)).is_empty());
        }
        // The worker frees at 1 ms. A batch of k takes 10k ms, and the batch's
        // earliest deadline (30 ms) allows 2 frames (done at 21 ms), not 3.
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
        let mut s = Scheduler::new(Limits::default());
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

    #[test]
    fn interpolation_extends_profile_linearly() {
        let pts = [(1, 1_000), (4, 2_500)];
        assert_eq!(interpolate(&pts, 1, 0), 1_000.0);
        assert_eq!(interpolate(&pts, 2, 0), 1_500.0);
        assert_eq!(interpolate(&pts, 8, 0), 4_500.0);
        assert_eq!(interpolate(&[], 3, 100), 300.0);
    }
}
