//! When a worker takes a batch, and how large ([`Action::Dispatch`]).
//!
//! Batching is driven by the deadline and the measured rate, not by a
//! timer. An idle worker takes the most urgent model it serves. From the
//! model's arrival rate (`demand.rs`) it picks a *target* batch: the
//! smallest batch whose throughput on its profile (`profile.rs`) keeps up
//! with its share of the arrivals (with headroom), else the
//! best-throughput batch, capped by the number of sending cameras without a
//! frame running. It dispatches at once when the target is met; otherwise
//! it holds the frames no longer than the batch should take to fill at the
//! measured rate, and no later than the last moment a target batch would
//! still (with a margin) finish before the earliest deadline. A batch never
//! exceeds the best-throughput size, so where batching does not pay (a
//! CPU) frames go one by one and never wait; the batch is always cut so
//! that its earliest deadline holds; up to `Settings::pipeline_depth`
//! batches are in flight per worker. A demoted worker is sent one small
//! probe batch at a time (`crate::health`).

use tidegate_protocol::{ShedReason, Status};

use crate::health::Eligibility;

use super::profile::ModelProfile;
use super::queue::Queued;
use super::workers::Running;
use super::{Action, BatchId, Micros, Scheduler, WorkerId};

/// Held frames leave this long before the last safe moment: timers fire
/// late (tokio's resolution is 1 ms) and the dispatch itself takes time.
pub(super) const HOLD_GUARD_US: Micros = 2_000;
/// Held frames leave early enough for a full batch to take this much
/// longer than its profile says.
pub(super) const HOLD_LATENCY_SAFETY: f64 = 1.25;
/// A batch is held at most this many times as long as it should take to fill
/// at the measured arrival rate.
const FILL_SLACK: f64 = 1.5;
/// A batch for a busy worker is sent this long before the worker frees, so
/// it is there when the running batch ends (µs).
const PIPELINE_LEAD_US: Micros = 1_000;

impl Scheduler {
    /// Offers each worker with room, the soonest free first, a batch of
    /// the most urgent model it serves, or holds it for a fuller one.
    pub(super) fn dispatch(&mut self, now: Micros, out: &mut Vec<Action>) {
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
            let Some(first_deadline) = self.servable_head(now, &model, start, &profile, out) else {
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
            let frames = self.pick_fair(&model, fit, wid);
            if frames.is_empty() {
                continue; // all it could take are frames it failed
            }
            let done_at = start + profile.latency(frames.len());
            self.send_batch(now, wid, model, frames, done_at, out);
        }
    }

    /// Heads of `model`'s queue that cannot make it even alone on a worker
    /// free at `start`: shed them if no worker could, else leave them for a
    /// sooner one. Returns the earliest deadline left for this worker, or
    /// `None` when it gets nothing of `model` now.
    fn servable_head(
        &mut self,
        now: Micros,
        model: &str,
        start: Micros,
        profile: &ModelProfile,
        out: &mut Vec<Action>,
    ) -> Option<Micros> {
        // Each pass sheds the head or returns, so it ends with the queue.
        loop {
            let &(deadline, id) = self.queues.get(model).and_then(|q| q.first())?;
            if start + profile.latency(1) <= deadline {
                return Some(deadline);
            }
            let failed_on = self.queued.get(&id).and_then(|q| q.failed_on);
            if self
                .best_finish(model, now, failed_on)
                .is_some_and(|f| f <= deadline)
            {
                return None;
            }
            let q = self.unqueue(id).expect("queued frame is indexed");
            self.complete(now, &q, Status::Shed(ShedReason::WouldMissDeadline), out);
        }
    }

    /// Sends `frames` of `model` to worker `wid` as one batch, which its
    /// profile says will be done at `done_at`.
    pub(super) fn send_batch(
        &mut self,
        now: Micros,
        wid: WorkerId,
        model: String,
        mut frames: Vec<Queued>,
        done_at: Micros,
        out: &mut Vec<Action>,
    ) {
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
                sent_at: now,
                done_at,
            });
            w.health.dispatched(batch);
        }
        self.batches.insert(batch, (wid, frames));
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
}
