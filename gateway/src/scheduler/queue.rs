//! The queues: one earliest-deadline-first queue per model, indexed by
//! camera (per camera the newest frame wins, see `admission.rs`) and by
//! account (`fair_share.rs`). A frame whose deadline passes while queued
//! ends `expired`.

use tidegate_protocol::Status;

use super::fair_share::{Account, Share};
use super::{Action, Arrival, FrameId, Micros, Scheduler, WorkerId};

#[derive(Debug, Clone)]
pub(super) struct Queued {
    pub(super) arrival: Arrival,
    /// Who it counts to for fair shares.
    pub(super) account: Account,
    pub(super) enqueued: Micros,
    /// When it was (last) dispatched; queue time ends there.
    pub(super) dispatched: Option<Micros>,
    /// The worker that failed it, once it is queued again for another:
    /// never sent back there, and not retried a second time.
    pub(super) failed_on: Option<WorkerId>,
}

impl Scheduler {
    /// Removes a frame from its queue and indices; returns it.
    pub(super) fn unqueue(&mut self, id: FrameId) -> Option<Queued> {
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

    pub(super) fn enqueue(&mut self, q: Queued) {
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

    pub(super) fn expire(&mut self, now: Micros, out: &mut Vec<Action>) {
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
}
