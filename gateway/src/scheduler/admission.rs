//! A frame's arrival ([`Event::FrameArrived`]): queued, or shed at once.
//!
//! It is shed when its edge connection is gone (`edge_gone`), when no
//! budget is left (`late_on_arrival`), when no worker serves its model
//! (`no_worker`), and when no worker can finish it before its deadline,
//! given the frames queued ahead of it, the workers' measured latency
//! profiles and when the busy ones will be free: `late_on_arrival` again
//! if it would have made it at its camera's usual age on arrival (the
//! link is to blame, `transfer.rs`), `would_miss_deadline` if not.
//! A frame too late even alone by every estimate may go to an idle worker
//! as a trial of its estimate instead (`trial.rs`).
//! Per camera the newest frame wins: an older frame still queued is shed
//! (`superseded`). Past the queue bounds a frame is refused or pushes out
//! another by its edge's share (`fair_share.rs`, `overloaded`).
//!
//! [`Event::FrameArrived`]: super::Event::FrameArrived

use std::collections::BTreeSet;

use tidegate_protocol::{ShedReason, Status};

use super::queue::Queued;
use super::transfer::AgeFloor;
use super::{Action, Arrival, EdgeId, FrameId, Micros, Scheduler};

impl Scheduler {
    /// Fastest single-frame latency any worker serving `model` offers.
    pub(super) fn best_latency(&self, model: &str) -> Option<u64> {
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

    /// Records that a frame of camera `key` arrived at `now`, `age` old;
    /// returns how much older than the camera's usual age it was.
    fn observe_age(&mut self, now: Micros, key: &(EdgeId, String), age: Micros) -> Micros {
        // A frame that trails its edge's close is shed before this: the
        // floors last as long as their edges.
        match self.age_floors.get_mut(key) {
            Some(f) => {
                f.observe(now, age);
                f.excess(age)
            }
            None => {
                self.age_floors.insert(key.clone(), AgeFloor::new(now, age));
                0
            }
        }
    }

    pub(super) fn arrive(&mut self, now: Micros, a: Arrival, out: &mut Vec<Action>) {
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
        let key = (q.arrival.edge, q.arrival.camera.clone());
        // What the link added to its age beyond its camera's usual.
        let excess = self.observe_age(now, &key, q.arrival.age);
        let Some(best) = self.best_latency(&q.arrival.model) else {
            self.complete(now, &q, Status::Shed(ShedReason::NoWorker), out);
            return;
        };
        // The camera's own queued frame is superseded if this one is kept,
        // so it does not count as ahead of it.
        let own_ahead = self
            .by_camera
            .get(&key)
            .and_then(|id| self.queued.get(id))
            .is_some_and(|o| {
                o.arrival.model == q.arrival.model && o.arrival.deadline <= q.arrival.deadline
            });
        let model = q.arrival.model.as_str();
        if !self.can_make_it(now, model, q.arrival.deadline, best, own_ahead) {
            let (status, capacity) = if excess > 0
                && self.can_make_it(
                    now,
                    model,
                    q.arrival.deadline.saturating_add(excess),
                    best,
                    own_ahead,
                ) {
                // It would have made it at its link's usual pace: the
                // link's queues ate its time, not the workers'.
                (ShedReason::LateOnArrival, false)
            } else {
                // Too little is left for even an idle worker's one run: no
                // queue is to blame, so no rate hint would have saved it.
                // Otherwise the queue ahead is.
                (
                    ShedReason::WouldMissDeadline,
                    now + best <= q.arrival.deadline,
                )
            };
            // Too slow even alone, by every estimate: perhaps the
            // estimate is what is wrong, and only a run can tell.
            if status == ShedReason::WouldMissDeadline && !capacity && self.try_trial(now, &q, out)
            {
                return;
            }
            self.complete_as(now, &q, Status::Shed(status), capacity, out);
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
}
