//! The hub's state and its core loop: the frames in flight, the edges
//! and workers connected (whether a worker takes batches, and for which
//! lease, is its [`Roster`] membership), how a message becomes scheduler
//! events ([`State::handle`], [`State::step`]) and how the scheduler's
//! actions are carried out ([`State::act`]: dispatch, and a frame's
//! completion). Batch timing is the scheduler's, not kept here.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use tidegate_protocol::queue;
use tidegate_protocol::{Dispatch, DispatchItem, Frame, FrameResult, ItemResult, Register, Status};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use tidegate_lease::LeaseId;
use tidegate_lease::showback::Usage;

use super::roster::{Membership, Roster};
use super::workers::worker_models;
use super::{HintBox, HubMsg, Served};
use crate::backpressure::Backpressure;
use crate::metrics::{Metrics, WorkerLabels};
use crate::scheduler::{Action, BatchId, EdgeId, Event, FrameId, Micros, Scheduler, WorkerId};
use crate::thumbnail::Thumbnails;

pub(super) struct Pending {
    pub(super) edge: EdgeId,
    /// The edge's name, kept for the showback after the edge has gone.
    pub(super) edge_name: Arc<str>,
    pub(super) frame: Frame,
    /// Local deadline.
    pub(super) deadline: Micros,
    /// The lease whose worker answered it, once one has.
    pub(super) served_by: Option<LeaseId>,
    /// Its share of its batch's run time on that worker (µs).
    pub(super) busy_us: u64,
}

pub(super) struct EdgeEntry {
    pub(super) name: Arc<str>,
    pub(super) results: queue::Sender<FrameResult>,
    pub(super) hints: HintBox,
    /// Its open cameras: model and declared budget (ms).
    pub(super) cameras: HashMap<String, (String, u32)>,
}

/// A registered worker's connection; whether it takes batches, and for
/// which lease, is its [`Roster`] membership.
pub(super) struct WorkerEntry {
    pub(super) register: Register,
    pub(super) dispatch: mpsc::Sender<Dispatch>,
    /// Cancelled to send the worker a `Drain`.
    pub(super) drain_request: CancellationToken,
    /// Its `worker` label in the metrics ([`WorkerLabels`]).
    pub(super) label: String,
}

/// Names of gone edges the hub keeps for the frames that trail them.
pub(super) const GONE_EDGES_KEPT: usize = 256;

/// Most latency reports kept per model between two load reports.
pub(super) const LATENCY_SAMPLES: usize = 8192;

/// What one scheduler step did besides its actions: frames it sent to
/// another worker after one failed them, and trials of an estimate
/// (`scheduler/trial.rs`), for the metrics.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct StepTally {
    pub(super) retried: u64,
    pub(super) trials: u64,
}

/// The hub's state, driven by [`run`](super::run).
pub(super) struct State {
    pub(super) origin: Instant,
    pub(super) scheduler: Scheduler,
    pub(super) metrics: Metrics,
    pub(super) pending: HashMap<FrameId, Pending>,
    /// Worker results waiting for the scheduler's `Complete`.
    pub(super) outputs: HashMap<FrameId, ItemResult>,
    pub(super) edges: HashMap<EdgeId, EdgeEntry>,
    /// The names of the edges gone most recently (at most
    /// [`GONE_EDGES_KEPT`]): a frame that trails its edge's `EdgeGone` is
    /// still run, and its worker time goes to its edge's showback.
    pub(super) gone_edges: std::collections::VecDeque<(EdgeId, Arc<str>)>,
    pub(super) workers: HashMap<WorkerId, WorkerEntry>,
    /// Each registered worker's membership (serving, draining, retiring,
    /// unbound) and lease, and the lease messages for workers yet to
    /// register: every lease message goes through it.
    pub(super) roster: Roster,
    /// The `worker` label of each connected worker's series.
    pub(super) worker_labels: WorkerLabels,
    /// `tidegate_queue_depth` of each model, last set (to set it only when
    /// it moves).
    pub(super) queue_depths: HashMap<String, usize>,
    pub(super) next_frame: u64,
    /// Frame-rate hints for cameras whose frames are shed; `None` when
    /// hints are turned off.
    pub(super) backpressure: Option<Backpressure>,
    /// Work per lease since the last load report.
    pub(super) served: HashMap<LeaseId, Served>,
    /// The same per lease, edge and model (the showback).
    /// Keyed by lease and edge, then model, so that a frame's completion
    /// allocates nothing once its key has been seen.
    pub(super) usage: HashMap<(LeaseId, Arc<str>), HashMap<String, Usage>>,
    /// Leases whose worker was dropped as stalled, for the next load
    /// report.
    pub(super) stalled_leases: std::collections::BTreeSet<LeaseId>,
    /// Edge-reported e2e latencies (ms) since the last load report.
    pub(super) latencies: HashMap<String, Vec<f64>>,
    /// The latest frame budget per model (µs).
    pub(super) budgets: HashMap<String, u32>,
    /// The last 15 minutes, for the status page.
    pub(super) timeline: crate::timeline::Timeline,
    /// Each open camera's latest thumbnail, rendered off the hub's task.
    pub(super) thumbnails: Thumbnails,
    /// Owns the thumbnails' blocking renders, so shutdown waits for them.
    pub(super) tracker: tokio_util::task::TaskTracker,
    /// Where the served models are published each time a worker comes or
    /// goes ([`State::publish_models`]).
    pub(super) models: tokio::sync::watch::Sender<super::ServedModels>,
}

impl State {
    pub(super) fn now(&self) -> Micros {
        self.origin.elapsed().as_micros() as Micros
    }

    pub(super) fn at(&self, t: Instant) -> Micros {
        t.saturating_duration_since(self.origin).as_micros() as Micros
    }

    pub(super) fn step(&mut self, event: Event) {
        self.step_at(self.now(), event);
    }

    /// [`State::step`] at `now`, which the caller also used to ask the
    /// scheduler something about this event.
    pub(super) fn step_at(&mut self, now: Micros, event: Event) {
        let (actions, tally) = self.scheduler_step(now, event);
        self.settle(actions, tally);
    }

    /// The scheduler told `event` at `now`: its actions, and what it did
    /// meanwhile that they do not say.
    pub(super) fn scheduler_step(&mut self, now: Micros, event: Event) -> (Vec<Action>, StepTally) {
        let before = self.scheduler.counters();
        let actions = self.scheduler.on_event(now, event);
        let after = self.scheduler.counters();
        let tally = StepTally {
            retried: after.retried - before.retried,
            trials: after.trials - before.trials,
        };
        (actions, tally)
    }

    /// Carries out the scheduler's `actions`, in order.
    pub(super) fn settle(&mut self, actions: Vec<Action>, tally: StepTally) {
        self.metrics.frames_retried.inc_by(tally.retried);
        self.metrics.estimate_trials.inc_by(tally.trials);
        for a in actions {
            self.act(a);
        }
        self.update_worker_gauges();
        debug_assert!(self.scheduler.counters().balanced());
    }

    pub(super) fn handle(&mut self, msg: HubMsg) {
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
                age,
            } => self.frame_arrived(edge, frame, deadline, age),
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
                let membership = self.roster.join(worker, lease, static_worker);
                if membership == Membership::Unbound {
                    tracing::info!(worker = worker.0, name = %register.worker, "static worker registered unbound; no batch until a lease binds it");
                }
                let label = self.worker_labels.acquire(&register.worker);
                self.metrics.worker_known(&label);
                let replaced = self.workers.insert(
                    worker,
                    WorkerEntry {
                        register,
                        dispatch,
                        drain_request,
                        label,
                    },
                );
                if let Some(old) = replaced {
                    self.release_label(&old);
                }
                self.publish_models();
                self.step(Event::WorkerJoined { worker, models });
                if !membership.takes_batches() {
                    self.step(Event::WorkerDraining { worker });
                }
            }
            HubMsg::BatchDone { worker, result } => self.batch_done(worker, result),
            HubMsg::WorkerDraining { worker } => {
                if let Some(change) = self.roster.retire(worker) {
                    self.apply(worker, change);
                }
            }
            HubMsg::DrainWorker { name, reply } => self.drain_worker(name, reply),
            HubMsg::LeaseDraining { lease } => {
                for (worker, change) in self.roster.lease_draining(lease) {
                    self.apply(worker, change);
                }
            }
            HubMsg::LeaseEnded { lease } => {
                for (worker, change) in self.roster.lease_ended(lease) {
                    tracing::info!(worker = worker.0, %lease, "lease ended; its worker is lost");
                    self.apply(worker, change);
                }
            }
            HubMsg::LeaseBound { lease, worker_name } => self.lease_bound(lease, worker_name),
            HubMsg::LeaseUnbound { lease } => self.lease_unbound(lease),
            HubMsg::LoadReport { models, reply } => {
                let _ = reply.send(self.load_report(models));
            }
            HubMsg::WorkerGone { worker } => self.lose_worker(worker),
            HubMsg::Snapshot { reply } => {
                let _ = reply.send(self.snapshot());
            }
        }
    }

    fn act(&mut self, action: Action) {
        match action {
            // Only an answer's own step makes one, and takes it there with
            // the answer's items (`State::batch_done`).
            Action::BatchRan { .. } => {}
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
                if let Some(w) = self.workers.remove(&worker) {
                    self.release_label(&w);
                    self.publish_models();
                }
                let lease = self.roster.leave(worker).and_then(|m| m.state.lease());
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
                if let Some(lease) = self.roster.lease(worker) {
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
}
