//! Trial runs: how the scheduler learns that a worker is faster than its
//! estimate, when the estimate is too slow for every frame.
//!
//! Only a batch a worker returns corrects its estimate (`profile.rs`). A
//! worker that registered a profile measured while its host was busy
//! (another worker warming up beside it, a noisy neighbour) can look too
//! slow for every deadline of a model: each frame is shed
//! `would_miss_deadline` on arrival, no batch runs, and nothing would ever
//! correct the estimate, so the model would be shed for ever. Relaxing
//! does not help: it only brings an estimate back down to the registered
//! profile.
//!
//! So a frame that no worker's estimate can finish in time even alone is
//! not shed when an idle worker serving its model has had that model's
//! estimate untested (no batch of it returned, no trial sent) for
//! [`TRIAL_AFTER_US`]: it goes to that worker alone, as a trial. The frame
//! was lost anyway; if the worker is faster than its estimate, the frame
//! may still make its deadline, and its run time refines the estimate like
//! any batch's. At most one trial per worker and model every
//! [`TRIAL_AFTER_US`], and only to a serving worker with nothing running,
//! so that a trial never delays another frame.

use super::queue::Queued;
use super::{Action, Micros, Scheduler};

/// How long a worker's estimate for a model must have gone untested
/// before a frame it says is too slow for is sent to it as a trial: one
/// frame a second at most, against an estimate that would otherwise shed
/// every frame of the model.
pub const TRIAL_AFTER_US: Micros = 1_000_000;

impl Scheduler {
    /// Sends `q`, which no worker's estimate can finish by its deadline, to
    /// an idle worker whose estimate for its model is due a trial (the
    /// fastest by its estimate); `false` when none is.
    pub(super) fn try_trial(&mut self, now: Micros, q: &Queued, out: &mut Vec<Action>) -> bool {
        let model = &q.arrival.model;
        let Some((latency, wid)) = self
            .workers
            .iter()
            .filter(|(_, w)| w.serving() && w.running.is_empty())
            .filter_map(|(id, w)| {
                let p = w.models.get(model)?;
                (now.saturating_sub(p.tested_at) >= TRIAL_AFTER_US).then_some((p.latency(1), *id))
            })
            .min()
        else {
            return false;
        };
        if let Some(p) = self
            .workers
            .get_mut(&wid)
            .and_then(|w| w.models.get_mut(model))
        {
            p.tested_at = now;
        }
        self.counters.trials += 1;
        self.send_batch(now, wid, model.clone(), vec![q.clone()], now + latency, out);
        true
    }
}
