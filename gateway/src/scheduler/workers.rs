//! The workers as the scheduler sees them: what each serves and at what
//! cost (`profile.rs`), the batches each has running, whether it drains or
//! is demoted (`crate::health`).
//!
//! A worker whose running batch is `Settings::stall_us` past when its
//! profile said it would be done is stalled (a hung GPU or runtime, while
//! its connection and heartbeats go on): it is dropped
//! ([`Action::DropWorker`]) and its frames are handled as a lost worker's,
//! failing with `worker stalled`, so that no frame waits for ever. A lost
//! worker's in-flight frames are queued again if their deadline allows,
//! otherwise they fail with `worker lost`. A draining worker that resumes
//! (`Event::WorkerResumed`) keeps its batches, profile and health: only a
//! lost worker starts afresh when it joins again.

use std::collections::HashMap;

use tidegate_protocol::{ShedReason, Status};

use crate::health::WorkerHealth;

use super::profile::ModelProfile;
use super::queue::Queued;
use super::{Action, BatchId, Micros, Scheduler, WorkerId, WorkerModel};

#[derive(Debug)]
pub(super) struct Worker {
    pub(super) models: HashMap<String, ModelProfile>,
    /// When its profiles last relaxed (or it last had a batch running).
    pub(super) relaxed_at: Micros,
    /// Batches sent to it, oldest first (at most `Settings::pipeline_depth`),
    /// with their size and when its profile says each will be done.
    pub(super) running: Vec<Running>,
    /// Takes no new batch (until [`Event::WorkerResumed`](super::Event::WorkerResumed)).
    pub(super) draining: bool,
    /// When it last returned a batch: a pipelined batch starts running
    /// then, not when it was sent.
    pub(super) last_done: Option<Micros>,
    /// Whether it is demoted for failing its frames.
    pub(super) health: WorkerHealth,
}

impl Worker {
    /// Counts for capacity and takes batches as usual: not draining, not
    /// demoted.
    pub(super) fn serving(&self) -> bool {
        !self.draining && self.health.serving()
    }

    /// Could take a frame now or at its next probe: not draining, and not
    /// backing off after a demotion.
    pub(super) fn available(&self) -> bool {
        !self.draining && self.health.available()
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Running {
    pub(super) batch: BatchId,
    pub(super) size: usize,
    /// When it was dispatched.
    pub(super) sent_at: Micros,
    pub(super) done_at: Micros,
}

impl Worker {
    /// When a batch sent now would start: batches run one after another.
    pub(super) fn start_at(&self, now: Micros) -> Micros {
        self.running.last().map_or(now, |r| r.done_at.max(now))
    }
}

impl Scheduler {
    /// A worker registered and is ready: it serves `models` at their
    /// registered profiles.
    pub(super) fn join_worker(&mut self, now: Micros, worker: WorkerId, models: &[WorkerModel]) {
        let models = models
            .iter()
            .map(|m| {
                (
                    m.model.clone(),
                    ModelProfile::new(m, self.limits.default_latency_us, now),
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
                last_done: None,
                health: WorkerHealth::new(),
            },
        );
    }

    /// Relaxes the profiles of the workers that run nothing (see
    /// [`ModelProfile::relax`]); a busy worker's idle time starts anew.
    pub(super) fn relax_idle(&mut self, now: Micros) {
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

    /// Earliest finish of one frame of `model` on any worker but `except`
    /// (the one that failed the frame, if any), counting the batches each
    /// worker already has.
    pub(super) fn best_finish(
        &self,
        model: &str,
        now: Micros,
        except: Option<WorkerId>,
    ) -> Option<Micros> {
        self.workers
            .iter()
            .filter(|(id, w)| Some(**id) != except && w.available())
            .filter_map(|(_, w)| Some(w.start_at(now) + w.models.get(model)?.latency(1)))
            .min()
    }

    /// A batch's frames stopped running (finished or lost).
    pub(super) fn release(&mut self, frames: &[Queued]) {
        if let Some(d) = frames
            .first()
            .and_then(|q| self.demand.get_mut(&q.arrival.model))
        {
            d.in_flight = d.in_flight.saturating_sub(frames.len());
        }
    }

    /// When `w` counts as stalled if its running batch is still unanswered.
    pub(super) fn stalled_at(&self, w: &Worker) -> Option<Micros> {
        w.running
            .first()
            .map(|r| r.done_at.saturating_add(self.limits.stall_us))
    }

    pub(super) fn drop_stalled(&mut self, now: Micros, out: &mut Vec<Action>) {
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

    pub(super) fn lose(&mut self, now: Micros, worker: WorkerId, why: &str, out: &mut Vec<Action>) {
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
