//! Property tests of the pure scheduler over random event sequences on the
//! injected clock: arrivals, worker joins and losses, batch completions,
//! drains and resumptions, ticks and clock jumps (which also stall
//! workers: a batch long past due drops its worker, whose late answers must
//! change nothing). The run time the scheduler measures for each answered
//! batch is checked too: never longer than since its dispatch, and never
//! counting a worker busy twice over (a pipelined batch runs from the
//! answer before it). A trial of an estimate (a frame every estimate says
//! is too late, sent alone anyway) goes only with the frame just arrived,
//! to a worker with nothing out, at most once a `TRIAL_AFTER_US` per
//! worker and model.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;
use tidegate_gateway::health::HealthPolicy;
use tidegate_gateway::scheduler::{
    Action, Arrival, BatchId, EdgeId, Event, FrameId, Micros, Scheduler, Settings, TRIAL_AFTER_US,
    WorkerId, WorkerModel,
};
use tidegate_protocol::{ShedReason, Status};

#[derive(Debug, Clone)]
enum Step {
    Arrive {
        edge: u8,
        camera: u8,
        model: u8,
        budget_us: u32,
        /// Its age on arrival: its time on the link.
        age_us: u32,
    },
    Join {
        max_batch: u16,
        latency_us: u32,
        models: u8,
    },
    Lose {
        pick: u8,
    },
    Drain {
        pick: u8,
    },
    /// A draining worker takes batches again (a static worker rebound).
    Resume {
        pick: u8,
    },
    Finish {
        pick: u8,
        fail_one: bool,
        /// The worker leaves the last frame unanswered (a lying worker).
        short: bool,
    },
    Advance {
        us: u32,
    },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (0u8..3, 0u8..4, 0u8..2, 1_000u32..200_000, 0u32..60_000).prop_map(
            |(edge, camera, model, budget_us, age_us)| Step::Arrive { edge, camera, model, budget_us, age_us }
        ),
        1 => (1u16..9, 500u32..40_000, 1u8..4).prop_map(
            |(max_batch, latency_us, models)| Step::Join { max_batch, latency_us, models }
        ),
        1 => any::<u8>().prop_map(|pick| Step::Lose { pick }),
        1 => any::<u8>().prop_map(|pick| Step::Drain { pick }),
        1 => any::<u8>().prop_map(|pick| Step::Resume { pick }),
        4 => (any::<u8>(), any::<bool>(), prop::bool::weighted(0.1))
            .prop_map(|(pick, fail_one, short)| Step::Finish { pick, fail_one, short }),
        3 => (0u32..20_000).prop_map(|us| Step::Advance { us }),
        // Clock jumps: far past every deadline in the queue.
        1 => (100_000u32..2_000_000).prop_map(|us| Step::Advance { us }),
    ]
}

/// What the test remembers to check the scheduler's answers.
#[derive(Default)]
struct World {
    now: Micros,
    next_frame: u64,
    next_worker: u64,
    deadlines: HashMap<FrameId, Micros>,
    completed: HashSet<FrameId>,
    workers: Vec<WorkerId>,
    /// Workers told to drain: they must get no new batch.
    draining: HashSet<WorkerId>,
    /// Workers the scheduler dropped as stalled: no batch ever again.
    dropped: HashSet<WorkerId>,
    /// Workers demoted and not restored: probes only.
    demoted: HashSet<WorkerId>,
    /// Batches sent as probes.
    probes: HashSet<BatchId>,
    /// Outstanding batches: (worker, batch, frames).
    batches: Vec<(WorkerId, BatchId, Vec<FrameId>)>,
    /// The workers that failed each frame (answered `failed` or left it
    /// out): it is never sent back to one, and after two it ends.
    failed_by: HashMap<FrameId, HashSet<WorkerId>>,
    /// When each batch was dispatched.
    sent_at: HashMap<BatchId, Micros>,
    /// When each worker joined, and the run time of its batches answered
    /// so far.
    busy: HashMap<WorkerId, (Micros, u64)>,
    /// The batch being answered, if it is still its worker's: it must
    /// come back as the one `Action::BatchRan`.
    expected_run: Option<(WorkerId, BatchId, Vec<FrameId>, u32)>,
    /// When each worker was last sent a trial of its estimate for a model.
    trials: HashMap<(WorkerId, String), Micros>,
}

impl World {
    fn apply(&mut self, s: &mut Scheduler, event: Event) -> Result<(), TestCaseError> {
        let arrived = match &event {
            Event::FrameArrived(a) => Some(a.id),
            _ => None,
        };
        let trials_before = s.counters().trials;
        let busy_before: HashSet<WorkerId> = self.batches.iter().map(|(w, ..)| *w).collect();
        let mut sent_now = Vec::new();
        for a in s.on_event(self.now, event) {
            match a {
                Action::Dispatch {
                    worker,
                    batch,
                    frames,
                    model,
                } => {
                    prop_assert!(!frames.is_empty());
                    sent_now.push((worker, model, frames.clone()));
                    prop_assert!(
                        !self.draining.contains(&worker),
                        "dispatched to a draining worker"
                    );
                    prop_assert!(
                        !self.dropped.contains(&worker),
                        "dispatched to a dropped worker"
                    );
                    if self.demoted.contains(&worker) {
                        // a demoted worker gets one small probe at a time
                        let probe = HealthPolicy::default().probe_frames as usize;
                        prop_assert!(frames.len() <= probe, "a probe of {} frames", frames.len());
                        prop_assert!(
                            !self
                                .batches
                                .iter()
                                .any(|(w, b, _)| *w == worker && self.probes.contains(b)),
                            "a second probe while one is out"
                        );
                        self.probes.insert(batch);
                    }
                    self.sent_at.insert(batch, self.now);
                    let ds: Vec<Micros> = frames.iter().map(|f| self.deadlines[f]).collect();
                    prop_assert!(
                        ds.windows(2).all(|w| w[0] <= w[1]),
                        "batch not in EDF order: {:?}",
                        ds
                    );
                    for f in &frames {
                        prop_assert!(!self.completed.contains(f), "dispatched a finished frame");
                        let failed = self.failed_by.get(f);
                        prop_assert!(
                            !failed.is_some_and(|by| by.contains(&worker)),
                            "{:?} sent back to the worker that failed it",
                            f
                        );
                        prop_assert!(
                            failed.is_none_or(|by| by.len() < 2),
                            "{:?} tried again after failing twice",
                            f
                        );
                        prop_assert!(
                            self.now <= self.deadlines[f],
                            "dispatched after its deadline"
                        );
                    }
                    self.batches.push((worker, batch, frames));
                }
                Action::DropWorker { worker, .. } => {
                    prop_assert!(self.workers.contains(&worker), "dropped an unknown worker");
                    prop_assert!(self.dropped.insert(worker), "dropped twice");
                    // Gone for the scheduler; its batches stay in `batches`
                    // so that some are answered late (and must be ignored).
                    self.workers.retain(|w| *w != worker);
                }
                Action::WorkerDemoted { worker, .. } => {
                    prop_assert!(self.workers.contains(&worker), "demoted an unknown worker");
                    self.demoted.insert(worker);
                }
                Action::WorkerRestored { worker } => {
                    prop_assert!(
                        self.demoted.remove(&worker),
                        "restored a worker not demoted"
                    );
                }
                Action::BatchRan {
                    worker,
                    batch,
                    frames,
                    run_us,
                    ..
                } => {
                    // the answered batch, as sent, at the run time the
                    // scheduler measured for it just before
                    prop_assert_eq!(
                        self.expected_run.take(),
                        Some((worker, batch, frames, run_us)),
                        "a batch ran that was not answered, or not as sent and measured"
                    );
                }
                Action::Complete {
                    frame,
                    status,
                    capacity,
                    ..
                } => {
                    prop_assert!(self.completed.insert(frame), "{:?} completed twice", frame);
                    // A frame whose link ate its time never counts
                    // against the workers' capacity.
                    prop_assert!(
                        !(capacity && status == Status::Shed(ShedReason::LateOnArrival)),
                        "{:?} late on arrival counted as lost to capacity",
                        frame
                    );
                    if status == Status::Expired {
                        prop_assert!(self.now >= self.deadlines[&frame]);
                    }
                }
            }
        }
        // Nothing is left due: whatever waits (a queued deadline, held
        // frames) wakes the scheduler strictly later.
        if let Some(t) = s.next_wakeup() {
            prop_assert!(t > self.now, "wakeup {} not after now {}", t, self.now);
        }
        let c = s.counters();
        prop_assert!(c.balanced(), "counters out of balance: {:?}", c);
        self.check_trial(c.trials - trials_before, arrived, &busy_before, &sent_now)?;
        prop_assert_eq!(c.admitted, self.deadlines.len() as u64);
        prop_assert_eq!(
            c.ok + c.shed + c.expired + c.failed,
            self.completed.len() as u64
        );
        Ok(())
    }

    /// A step that sent `trials` trials of an estimate: at most one, with
    /// the frame that just `arrived`, alone, to a worker that had no batch
    /// out, and not within `TRIAL_AFTER_US` of that worker's last trial for
    /// the model.
    fn check_trial(
        &mut self,
        trials: u64,
        arrived: Option<FrameId>,
        busy_before: &HashSet<WorkerId>,
        sent_now: &[(WorkerId, String, Vec<FrameId>)],
    ) -> Result<(), TestCaseError> {
        prop_assert!(trials <= 1, "{} trials in one step", trials);
        if trials == 0 {
            return Ok(());
        }
        let id = arrived.ok_or_else(|| TestCaseError::fail("a trial without an arrival"))?;
        let Some((worker, model, frames)) = sent_now.iter().find(|(_, _, f)| f.contains(&id))
        else {
            return Err(TestCaseError::fail(
                "a trial, but the frame arrived was not sent",
            ));
        };
        prop_assert_eq!(frames, &vec![id], "a trial goes alone");
        prop_assert!(!busy_before.contains(worker), "a trial to a busy worker");
        if let Some(last) = self.trials.insert((*worker, model.clone()), self.now) {
            prop_assert!(
                self.now - last >= TRIAL_AFTER_US,
                "trials {} µs apart",
                self.now - last
            );
        }
        Ok(())
    }

    /// Answers `batch` of `worker` (with `frames`) with `outcomes`, after
    /// checking the run time the scheduler measures for it.
    fn finish(
        &mut self,
        s: &mut Scheduler,
        (worker, batch, frames): (WorkerId, BatchId, Vec<FrameId>),
        outcomes: Vec<(FrameId, Status)>,
    ) -> Result<(), TestCaseError> {
        let run = s.batch_run(self.now, worker, batch);
        if self.dropped.contains(&worker) {
            prop_assert_eq!(run, None, "a dropped worker's batch has no run");
        } else {
            let run = run.ok_or_else(|| TestCaseError::fail("a running batch has no run"))?;
            prop_assert_eq!(run.frames, frames.len());
            let since_sent = self.now - self.sent_at[&batch];
            prop_assert!(
                u64::from(run.run_us) <= since_sent,
                "ran {} µs, sent {} µs ago",
                run.run_us,
                since_sent
            );
            let (joined, busy) = self.busy.get_mut(&worker).expect("joined");
            *busy += u64::from(run.run_us);
            prop_assert!(
                *busy <= self.now - *joined,
                "busy {} µs in {} µs",
                *busy,
                self.now - *joined
            );
        }
        self.expected_run = run.map(|r| (worker, batch, frames, r.run_us));
        self.apply(
            s,
            Event::BatchFinished {
                worker,
                batch,
                outcomes,
            },
        )?;
        prop_assert_eq!(&self.expected_run, &None, "an answered batch did not run");
        Ok(())
    }
}

/// Runs `steps` against a fresh scheduler, checking every invariant
/// after each (see [`World::apply`]), then drains it: every frame must
/// have ended exactly once.
fn run(steps: Vec<Step>, pipeline_depth: usize, stall_us: u64) -> Result<(), TestCaseError> {
    let mut s = Scheduler::new(Settings {
        max_queued: 64,
        max_queued_per_edge: 16,
        default_latency_us: 10_000,
        pipeline_depth,
        stall_us,
        health: HealthPolicy::default(),
    });
    let mut w = World::default();
    let models = ["a", "b", "c"];
    for st in steps {
        match st {
            Step::Arrive {
                edge,
                camera,
                model,
                budget_us,
                age_us,
            } => {
                let id = FrameId(w.next_frame);
                w.next_frame += 1;
                let deadline = w.now + budget_us as u64;
                w.deadlines.insert(id, deadline);
                w.apply(
                    &mut s,
                    Event::FrameArrived(Arrival {
                        id,
                        edge: EdgeId(edge as u64),
                        camera: format!("c{camera}"),
                        model: models[model as usize].into(),
                        deadline,
                        age: u64::from(age_us),
                    }),
                )?;
            }
            Step::Join {
                max_batch,
                latency_us,
                models: n,
            } => {
                let id = WorkerId(w.next_worker);
                w.next_worker += 1;
                w.workers.push(id);
                w.busy.insert(id, (w.now, 0));
                let served = models
                    .iter()
                    .take(n as usize)
                    .map(|m| WorkerModel {
                        model: (*m).into(),
                        max_batch,
                        profile: vec![
                            (1, latency_us),
                            (max_batch, latency_us * max_batch as u32 / 2 + latency_us),
                        ],
                    })
                    .collect();
                w.apply(
                    &mut s,
                    Event::WorkerJoined {
                        worker: id,
                        models: served,
                    },
                )?;
            }
            Step::Lose { pick } => {
                if w.workers.is_empty() {
                    continue;
                }
                let id = w.workers.remove(pick as usize % w.workers.len());
                w.batches.retain(|(wk, _, _)| *wk != id);
                w.apply(&mut s, Event::WorkerLost { worker: id })?;
            }
            Step::Drain { pick } => {
                if w.workers.is_empty() {
                    continue;
                }
                let id = w.workers[pick as usize % w.workers.len()];
                w.draining.insert(id);
                w.apply(&mut s, Event::WorkerDraining { worker: id })?;
            }
            Step::Resume { pick } => {
                if w.workers.is_empty() {
                    continue;
                }
                let id = w.workers[pick as usize % w.workers.len()];
                w.draining.remove(&id);
                w.apply(&mut s, Event::WorkerResumed { worker: id })?;
            }
            Step::Finish {
                pick,
                fail_one,
                short,
            } => {
                if w.batches.is_empty() {
                    continue;
                }
                let (worker, batch, frames) = w.batches.remove(pick as usize % w.batches.len());
                let answered = frames.len() - usize::from(short);
                let outcomes = frames
                    .iter()
                    .take(answered)
                    .enumerate()
                    .map(|(i, f)| {
                        let st = if fail_one && i == 0 {
                            Status::Failed("boom".into())
                        } else {
                            Status::Ok
                        };
                        (*f, st)
                    })
                    .collect();
                if !w.dropped.contains(&worker) {
                    // what the scheduler counts failed: the first frame
                    // if failed, the last if left out
                    let failed = frames
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| (fail_one && *i == 0) || *i >= answered);
                    for (_, f) in failed {
                        w.failed_by.entry(*f).or_default().insert(worker);
                    }
                }
                w.finish(&mut s, (worker, batch, frames), outcomes)?;
            }
            Step::Advance { us } => {
                w.now += us as u64;
                w.apply(&mut s, Event::Tick)?;
            }
        }
    }
    // Drain: finish every batch, lose every worker, let every deadline pass.
    while let Some((worker, batch, frames)) = w.batches.pop() {
        let outcomes = frames.iter().map(|f| (*f, Status::Ok)).collect();
        w.finish(&mut s, (worker, batch, frames), outcomes)?;
    }
    for id in std::mem::take(&mut w.workers) {
        w.apply(&mut s, Event::WorkerLost { worker: id })?;
    }
    w.batches.clear();
    w.now += 10_000_000;
    w.apply(&mut s, Event::Tick)?;
    prop_assert_eq!(s.counters().in_flight(), 0);
    prop_assert_eq!(w.completed.len(), w.deadlines.len(), "a frame was lost");
    Ok(())
}

/// Steps where workers often look too slow for the frames' budgets
/// (registered at 50–150 ms, budgets of 10–120 ms) and the clock moves in
/// long strides: trials of an estimate are common.
fn slow_step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (0u8..2, 0u8..3, 0u8..2, 10_000u32..120_000, 0u32..5_000).prop_map(
            |(edge, camera, model, budget_us, age_us)| Step::Arrive { edge, camera, model, budget_us, age_us }
        ),
        1 => (1u16..3, 50_000u32..150_000, 1u8..3).prop_map(
            |(max_batch, latency_us, models)| Step::Join { max_batch, latency_us, models }
        ),
        1 => any::<u8>().prop_map(|pick| Step::Lose { pick }),
        1 => any::<u8>().prop_map(|pick| Step::Drain { pick }),
        1 => any::<u8>().prop_map(|pick| Step::Resume { pick }),
        4 => (any::<u8>(), any::<bool>(), prop::bool::weighted(0.05))
            .prop_map(|(pick, fail_one, short)| Step::Finish { pick, fail_one, short }),
        4 => (0u32..700_000).prop_map(|us| Step::Advance { us }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn every_frame_ends_exactly_once_in_edf_order_and_never_late(
        steps in prop::collection::vec(step(), 1..200),
        pipeline_depth in 1usize..4,
        stall_us in 50_000u64..3_000_000,
    ) {
        run(steps, pipeline_depth, stall_us)?;
    }

    #[test]
    fn a_trial_goes_alone_to_an_idle_worker_at_most_once_a_second_per_model(
        steps in prop::collection::vec(slow_step(), 1..200),
        pipeline_depth in 1usize..3,
    ) {
        run(steps, pipeline_depth, 3_000_000)?;
    }
}
