//! The worker side of the hub: workers joining, draining, stalling and
//! leaving, their leases bound and unbound (the membership decisions are
//! the roster's, `roster.rs`; here the scheduler is told of them), the
//! batches they return, and what they serve.

use std::collections::BTreeSet;

use bytes::Bytes;
use tidegate_protocol::{BatchResult, Codec, ItemResult, Register, Status};
use tokio::sync::oneshot;

use tidegate_lease::LeaseId;

use super::ServedModel;
use super::roster::{Change, Membership};
use super::state::{State, WorkerEntry};
use crate::scheduler::{Action, BatchId, Event, FrameId, Micros, WorkerId, WorkerModel};

impl State {
    /// A worker has gone (disconnected, lease ended, or wedged): forget
    /// it; the scheduler re-homes or fails the frames it held.
    pub(super) fn lose_worker(&mut self, worker: WorkerId) {
        if let Some(w) = self.workers.remove(&worker) {
            self.release_label(&w);
            self.publish_models();
        }
        self.roster.leave(worker);
        self.step(Event::WorkerLost { worker });
    }

    /// Tells the scheduler of a membership change the roster decided.
    pub(super) fn apply(&mut self, worker: WorkerId, change: Change) {
        match change {
            Change::Quiet => {}
            Change::Drain => self.step(Event::WorkerDraining { worker }),
            Change::Resume => self.step(Event::WorkerResumed { worker }),
            Change::Lose => self.lose_worker(worker),
        }
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
    pub(super) fn release_label(&mut self, w: &WorkerEntry) {
        if let Some(label) = self.worker_labels.release(&w.label) {
            let models = w.register.models.iter().map(|m| m.name.as_str());
            self.metrics.worker_gone(&label, models);
        }
    }

    pub(super) fn update_worker_gauges(&mut self) {
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

    /// A worker answered a batch: the scheduler told once, at `now`; if
    /// the batch is still the worker's ([`Action::BatchRan`]), its frames'
    /// answers, timings and outputs are recorded before their ends.
    pub(super) fn batch_done(&mut self, worker: WorkerId, result: BatchResult) {
        let now = self.now();
        let batch = BatchId(result.batch);
        // Every answer goes to the scheduler, which judges the worker by
        // them (one for a frame the batch does not hold is malformed).
        let outcomes: Vec<(FrameId, Status)> = result
            .items
            .iter()
            .map(|i| (FrameId(i.id), i.status.clone()))
            .collect();
        let (actions, tally) = self.scheduler_step(
            now,
            Event::BatchFinished {
                worker,
                batch,
                outcomes,
            },
        );
        let mut rest = Vec::with_capacity(actions.len());
        let mut items = Some(result.items);
        for a in actions {
            match a {
                Action::BatchRan {
                    model,
                    frames,
                    run_us,
                    ..
                } => {
                    let items = items.take().unwrap_or_default();
                    self.batch_ran(now, worker, &model, &frames, run_us, items);
                }
                a => rest.push(a),
            }
        }
        if items.is_some() {
            // Not (or no longer) this worker's batch: its frames were
            // re-homed or failed when the worker was lost or dropped;
            // they end there, so this late result is not theirs.
            tracing::debug!(
                worker = worker.0,
                batch = batch.0,
                "result of a batch re-homed meanwhile; ignored"
            );
        }
        self.settle(rest, tally);
    }

    /// `worker` ran a batch of `model` (`frames`, as sent) in `run_us` on
    /// the scheduler's clock, answered at `now`, answering `items`: the
    /// held frames take their outputs and a share of the run, and the
    /// run and the worker's own time are recorded.
    fn batch_ran(
        &mut self,
        now: Micros,
        worker: WorkerId,
        model: &str,
        frames: &[FrameId],
        run_us: u32,
        items: Vec<ItemResult>,
    ) {
        let answers = items.len();
        let lease = self.roster.lease(worker);
        if let Some(l) = lease {
            self.served.entry(l).or_default().busy_us += u64::from(run_us);
        }
        let mut inference_us = 0;
        // the worker's own time on the batch, as its profile measures it:
        // each frame's pre- and postprocessing, and the one inference run
        let mut per_frame_us = 0u64;
        let share = u64::from(run_us) / answers.max(1) as u64;
        let shared_buffer = answers > 1;
        if let Some(w) = self.workers.get(&worker) {
            for item in &items {
                self.metrics
                    .worker_frames
                    .with_label_values(&[w.label.as_str(), item.status.label()])
                    .inc();
            }
        }
        for mut item in items {
            inference_us = inference_us.max(item.timings.inference_us);
            per_frame_us +=
                u64::from(item.timings.preprocess_us) + u64::from(item.timings.postprocess_us);
            let id = FrameId(item.id);
            // Only the batch's own frames take their answer's outputs.
            if !frames.contains(&id) {
                continue;
            }
            if shared_buffer {
                // Raw outputs slice the whole batch's buffer: copied out,
                // a result waiting for its edge holds its own bytes (what
                // its queue counts), not its batch's.
                for o in &mut item.outputs {
                    o.data = Bytes::copy_from_slice(&o.data);
                }
            }
            if let Some(p) = self.pending.get_mut(&id) {
                p.served_by = lease;
                p.busy_us = share;
                self.outputs.insert(id, item);
            }
        }
        self.metrics
            .inference
            .with_label_values(&[model])
            .observe(inference_us as f64 / 1e6);
        let compute_us = per_frame_us + u64::from(inference_us);
        self.observe_worker_batch(worker, model, frames.len(), run_us, compute_us);
        if let Some(w) = self.workers.get(&worker) {
            let name = w.register.worker.as_str();
            let times = crate::timeline::BatchTimes {
                run_us,
                own_us: compute_us,
            };
            self.timeline
                .batch(now, worker.0, name, model, frames.len(), times);
        }
    }

    /// The operator drains the workers registered as `name`; answers how many.
    pub(super) fn drain_worker(&mut self, name: String, reply: oneshot::Sender<usize>) {
        let ids: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(_, w)| w.register.worker == name)
            .map(|(id, _)| *id)
            .collect();
        for worker in &ids {
            if let Some(w) = self.workers.get(worker) {
                w.drain_request.cancel();
            }
            let Some(change) = self.roster.retire(*worker) else {
                continue;
            };
            if change == Change::Drain {
                tracing::info!(worker = worker.0, %name, "operator drains the worker");
            }
            self.apply(*worker, change);
        }
        let _ = reply.send(ids.len());
    }

    /// A static worker's name was bound to `lease`: its worker, if
    /// registered, serves the lease, unless it is retiring (it drains and
    /// exits; its lease ends when it goes). One that was draining resumes
    /// in the scheduler with what it holds.
    pub(super) fn lease_bound(&mut self, lease: LeaseId, worker_name: String) {
        for (worker, change) in self.roster.lease_bound(lease, &worker_name) {
            let retiring = self
                .roster
                .get(worker)
                .is_some_and(|m| matches!(m.state, Membership::Retiring { .. }));
            if !retiring {
                tracing::info!(worker = worker.0, name = %worker_name, %lease, "static worker bound; it serves the lease");
            }
            self.apply(worker, change);
        }
    }

    /// A lease ended other than by its worker's loss: a static worker
    /// stays connected, unbound; any other is lost.
    pub(super) fn lease_unbound(&mut self, lease: LeaseId) {
        for (worker, change) in self.roster.lease_unbound(lease) {
            if change == Change::Lose {
                // only a static worker outlives its lease
                tracing::info!(worker = worker.0, %lease, "lease ended; its worker is lost");
            } else {
                tracing::info!(worker = worker.0, %lease, "static worker unbound; it stays connected and takes no batch");
            }
            self.apply(worker, change);
        }
    }

    /// Publishes every served model ([`State::served_model`]) for
    /// [`super::Hub::model_info`]: called each time a worker comes or goes.
    pub(super) fn publish_models(&self) {
        let names: BTreeSet<&str> = self
            .workers
            .values()
            .flat_map(|w| w.register.models.iter().map(|m| m.name.as_str()))
            .collect();
        let served: std::collections::BTreeMap<String, ServedModel> = names
            .into_iter()
            .filter_map(|m| Some((m.to_string(), self.served_model(m)?)))
            .collect();
        self.models.send_replace(std::sync::Arc::new(served));
    }

    /// The model as its first worker registered it, with the encodings
    /// every worker serving it decodes (a frame may go to any of them).
    pub(super) fn served_model(&self, model: &str) -> Option<ServedModel> {
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
}

/// What a worker serves, as the scheduler plans with it.
pub(super) fn worker_models(register: &Register) -> Vec<WorkerModel> {
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
