//! A worker's answer to a batch ([`Event::BatchFinished`]): each frame's
//! end, a retry on another worker, and the worker's health verdict.
//!
//! Only the frames of the answered batch are taken from it, and only from
//! the worker it was sent to. A frame a worker failed (answered failed or
//! shed, or left out of the answer) goes once to another worker while one
//! could still meet its deadline, never back to the one that failed it.
//! Each returned batch is judged by the worker's health
//! ([`crate::health`]): a short or malformed answer, or a failure share
//! over `Settings::health` across its recent frames, demotes the worker
//! ([`Action::WorkerDemoted`]). A demoted worker takes no batch and counts
//! for no capacity while it backs off; then it is sent one small probe
//! batch at a time, and serves again ([`Action::WorkerRestored`]) only when
//! a probe comes back whole and mostly `ok`.
//!
//! A returned batch's run time ([`Scheduler::batch_run`]) refines its
//! worker's profile, and goes to the shell with the batch's frames
//! ([`Action::BatchRan`]), before their ends. It runs from when the batch was dispatched, or from
//! when the worker returned its previous batch if that is later (a
//! pipelined batch waits on the worker for the one before it), to the
//! answer: transfer included, as the gateway sees it, on the scheduler's
//! own clock.
//!
//! [`Event::BatchFinished`]: super::Event::BatchFinished

use std::collections::HashMap;

use tidegate_protocol::Status;

use crate::health::{Tally, Verdict};

use super::queue::Queued;
use super::{Action, BatchId, FrameId, Micros, Scheduler, WorkerId};

/// A batch's run on its worker, as [`Scheduler::batch_run`] measures it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchRun {
    /// Frames it was sent with.
    pub frames: usize,
    /// Its run time (µs): see the module docs.
    pub run_us: u32,
}

impl Scheduler {
    /// The run of `batch` if `worker` answered it at `now`: `None` unless
    /// the batch is running on that worker (unknown, or re-homed when the
    /// worker was lost or dropped: its answer is ignored).
    /// [`Event::BatchFinished`](super::Event::BatchFinished) at the same `now` refines the profile with
    /// this run time and hands it to the shell ([`Action::BatchRan`]).
    pub fn batch_run(&self, now: Micros, worker: WorkerId, batch: BatchId) -> Option<BatchRun> {
        let w = self.workers.get(&worker)?;
        let r = w.running.iter().find(|r| r.batch == batch)?;
        let began = w.last_done.map_or(r.sent_at, |d| d.max(r.sent_at));
        Some(BatchRun {
            frames: r.size,
            run_us: now.saturating_sub(began).min(u64::from(u32::MAX)) as u32,
        })
    }

    pub(super) fn finish(
        &mut self,
        now: Micros,
        worker: WorkerId,
        batch: BatchId,
        outcomes: Vec<(FrameId, Status)>,
        out: &mut Vec<Action>,
    ) {
        let Some((owner, frames)) = self.batches.remove(&batch) else {
            return; // Unknown or already re-homed batch: nothing to account.
        };
        if owner != worker {
            self.batches.insert(batch, (owner, frames));
            return;
        }
        let run = self.batch_run(now, worker, batch);
        if let (Some(run), Some(q)) = (run, frames.first()) {
            out.push(Action::BatchRan {
                worker,
                batch,
                model: q.arrival.model.clone(),
                frames: frames.iter().map(|q| q.arrival.id).collect(),
                run_us: run.run_us,
            });
        }
        if let Some(w) = self.workers.get_mut(&worker) {
            w.running.retain(|r| r.batch != batch);
            w.last_done = Some(now);
            if let (Some(run), Some(p)) = (
                run,
                frames
                    .first()
                    .and_then(|q| w.models.get_mut(&q.arrival.model)),
            ) {
                p.observe(frames.len(), run.run_us);
                p.tested_at = now;
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
}
