use super::dispatch::{HOLD_GUARD_US, HOLD_LATENCY_SAFETY};
use super::*;

/// One batch per worker at a time, as most of these tests assume.
fn one_deep() -> Settings {
    Settings {
        pipeline_depth: 1,
        ..Settings::default()
    }
}

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
    frame_aged(id, camera, deadline, 0)
}

/// A frame that arrived `age` old (its time on the link).
fn frame_aged(id: u64, camera: &str, deadline: Micros, age: Micros) -> Event {
    Event::FrameArrived(Arrival {
        id: FrameId(id),
        edge: EdgeId(1),
        camera: camera.into(),
        model: "m".into(),
        deadline,
        age,
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
    let mut s = Scheduler::new(one_deep());
    let a = s.on_event(0, frame(1, "c", 80_000));
    assert_eq!(completes(&a), vec![(1, Status::Shed(ShedReason::NoWorker))]);
    assert!(s.counters().balanced());
}

#[test]
fn idle_worker_gets_frame_and_result_completes_ok() {
    let mut s = Scheduler::new(one_deep());
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
        },
    );
    assert_eq!(completes(&a), vec![(1, Status::Ok)]);
    let c = s.counters();
    assert!(c.balanced() && c.ok == 1 && c.in_flight() == 0);
}

#[test]
fn frame_past_deadline_is_shed_before_dispatch() {
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, worker(1, 1, 50_000));
    let a = s.on_event(0, frame(1, "c", 40_000));
    assert_eq!(
        completes(&a),
        vec![(1, Status::Shed(ShedReason::WouldMissDeadline))]
    );
}

#[test]
fn a_frame_with_no_budget_left_on_arrival_is_shed_late_whatever_the_workers() {
    let mut s = Scheduler::new(one_deep());
    // No worker at all, and an idle one: the lateness is the reason.
    let a = s.on_event(100, frame(1, "c", 100));
    assert_eq!(
        completes(&a),
        vec![(1, Status::Shed(ShedReason::LateOnArrival))]
    );
    s.on_event(100, worker(1, 1, 1_000));
    let a = s.on_event(200, frame(2, "c", 150));
    assert_eq!(
        completes(&a),
        vec![(2, Status::Shed(ShedReason::LateOnArrival))]
    );
    assert_eq!(s.counters().shed, 2);
    assert_eq!(s.counters().admitted, 2);
}

/// Each completed frame, and whether it was lost to capacity.
fn capacity(a: &[Action]) -> Vec<(u64, bool)> {
    a.iter()
        .filter_map(|a| match a {
            Action::Complete {
                frame, capacity, ..
            } => Some((frame.0, *capacity)),
            _ => None,
        })
        .collect()
}

#[test]
fn only_a_frame_that_waited_behind_others_is_lost_to_capacity() {
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, worker(1, 1, 50_000));
    // 40 ms left for a 50 ms run: no queue is to blame.
    let a = s.on_event(0, frame(1, "a", 40_000));
    assert_eq!(capacity(&a), vec![(1, false)]);
    // Served at once; the next could make it alone, not behind it.
    s.on_event(0, frame(2, "b", 80_000));
    let a = s.on_event(0, frame(3, "c", 90_000));
    assert_eq!(
        completes(&a),
        vec![(3, Status::Shed(ShedReason::WouldMissDeadline))]
    );
    assert_eq!(capacity(&a), vec![(3, true)]);
}

/// A frame that cannot make its deadline, but would have at its camera's
/// usual age on arrival, lost its time on the link: it is shed
/// `late_on_arrival` and not lost to capacity, so no rate hint caps the
/// camera for the workers' sake. One that would have missed even at the
/// usual age is the workers': `would_miss_deadline`, lost to capacity.
#[test]
fn a_missed_deadline_is_the_links_only_if_the_frame_came_later_than_usual() {
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, worker(1, 1, 50_000));
    // Camera "a"'s frames come 10 ms old; this one is served at once, and
    // the worker is busy until 50 ms.
    let a = s.on_event(0, frame_aged(1, "a", 200_000, 10_000));
    assert!(completes(&a).is_empty(), "{a:?}");
    // 30 ms later than usual: it needs 100 ms (free at 50, a 50 ms run)
    // and has 90 left; 30 more would have done.
    let a = s.on_event(1, frame_aged(2, "a", 90_001, 40_000));
    assert_eq!(
        completes(&a),
        vec![(2, Status::Shed(ShedReason::LateOnArrival))]
    );
    assert_eq!(capacity(&a), vec![(2, false)]);
    // At the usual age, and still too late: the queue is to blame.
    let a = s.on_event(2, frame_aged(3, "a", 90_002, 10_000));
    assert_eq!(
        completes(&a),
        vec![(3, Status::Shed(ShedReason::WouldMissDeadline))]
    );
    assert_eq!(capacity(&a), vec![(3, true)]);
    // 5 ms later than usual, but 5 ms would not have saved it.
    let a = s.on_event(3, frame_aged(4, "a", 90_003, 15_000));
    assert_eq!(
        completes(&a),
        vec![(4, Status::Shed(ShedReason::WouldMissDeadline))]
    );
    assert_eq!(capacity(&a), vec![(4, true)]);
    // Another camera's usual age is its own: "b"'s first frame, 40 ms old,
    // sets its floor and is blamed on the queue.
    let a = s.on_event(4, frame_aged(5, "b", 90_004, 40_000));
    assert_eq!(capacity(&a), vec![(5, true)]);
    let c = s.counters();
    assert!(c.balanced() && c.shed == 4, "{c:?}");
}

/// A camera's usual age is forgotten with its edge: a reconnect (a new
/// route, perhaps) starts from its own first frame.
#[test]
fn an_edge_that_goes_takes_its_cameras_usual_ages_with_it() {
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, worker(1, 1, 50_000));
    s.on_event(0, frame_aged(1, "a", 200_000, 10_000));
    s.on_event(1, Event::EdgeGone { edge: EdgeId(1) });
    assert!(s.age_floors.is_empty());
}

#[test]
fn newer_frame_of_camera_supersedes_queued_one() {
    let mut s = Scheduler::new(one_deep());
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
    let mut s = Scheduler::new(one_deep());
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
    let mut s = Scheduler::new(one_deep());
    s.on_event(
        0,
        Event::WorkerJoined {
            worker: WorkerId(9),
            models: vec![WorkerModel {
                model: "m".into(),
                max_batch: 8,
                // Batching pays a little: 1 ms + 9.5 ms per frame.
                profile: (1..=8).map(|b| (b, 1_000 + 9_500 * b as u32)).collect(),
            }],
        },
    );
    let first = s.on_event(0, frame(100, "z", 900_000));
    assert!(matches!(first[0], Action::Dispatch { .. }));
    for (i, d) in [(1, 59_500), (2, 39_500), (3, 79_500), (4, 54_500)] {
        assert!(s.on_event(9_500, frame(i, &format!("c{i}"), d)).is_empty());
    }
    // The worker frees at 10.5 ms, its first batch having run as its
    // profile said. A batch of k takes 1 + 9.5k ms, and the batch's
    // earliest deadline (39.5 ms) allows 2 frames (done at 30.5 ms), not
    // 3 (40 ms).
    let a = s.on_event(
        10_500,
        Event::BatchFinished {
            worker: WorkerId(9),
            batch: BatchId(1),
            outcomes: vec![(FrameId(100), Status::Ok)],
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
    let mut s = Scheduler::new(one_deep());
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

fn drops(actions: &[Action]) -> Vec<u64> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::DropWorker { worker, .. } => Some(worker.0),
            _ => None,
        })
        .collect()
}

/// A worker that stops answering while its connection lives (a hung
/// GPU): once its running batch is `stall_us` past due, it is dropped
/// and its frames fail, or go to another worker if their deadline
/// still allows; its late answer changes nothing.
#[test]
fn a_worker_that_never_answers_is_dropped_and_its_frames_do_not_wait_for_ever() {
    let limits = Settings {
        stall_us: 1_000_000,
        ..one_deep()
    };
    let mut s = Scheduler::new(limits);
    s.on_event(0, worker(1, 1, 5_000));
    s.on_event(0, frame(1, "a", 80_000));
    s.on_event(0, worker(2, 1, 5_000));
    // A frame with a long budget: still possible after the stall.
    assert_eq!(
        dispatches(&s.on_event(0, frame(2, "b", 10_000_000))),
        vec![vec![2]]
    );
    // Frame 1 is on worker 1 (due at 5 ms), frame 2 on worker 2; worker
    // 2 answers, worker 1 never does.
    let batch2 = BatchId(2);
    s.on_event(
        5_000,
        Event::BatchFinished {
            worker: WorkerId(2),
            batch: batch2,
            outcomes: vec![(FrameId(2), Status::Ok)],
        },
    );
    assert_eq!(s.next_wakeup(), Some(1_005_000));
    let a = s.on_event(1_004_999, Event::Tick);
    assert!(a.is_empty(), "{a:?}");
    let a = s.on_event(1_005_000, Event::Tick);
    assert_eq!(drops(&a), vec![1]);
    assert_eq!(
        completes(&a),
        vec![(1, Status::Failed("worker stalled".into()))]
    );
    assert_eq!(s.worker_counts(), (1, 0));
    // A long-budget frame on a stalled worker goes to the other one.
    assert_eq!(
        dispatches(&s.on_event(1_006_000, frame(3, "c", 10_000_000))),
        vec![vec![3]]
    );
    let a = s.on_event(
        1_006_000,
        Event::BatchFinished {
            worker: WorkerId(2),
            batch: BatchId(3),
            outcomes: vec![(FrameId(3), Status::Ok)],
        },
    );
    assert_eq!(completes(&a), vec![(3, Status::Ok)]);
    // Worker 1's answer, late: ignored.
    let a = s.on_event(
        1_100_000,
        Event::BatchFinished {
            worker: WorkerId(1),
            batch: BatchId(1),
            outcomes: vec![(FrameId(1), Status::Ok)],
        },
    );
    assert!(completes(&a).is_empty());
    assert!(s.counters().balanced());
    assert_eq!(s.counters().in_flight(), 0);
    assert_eq!(s.counters().failed, 1);
    assert_eq!(s.next_wakeup(), None);
}

/// A frame of a stalled worker whose deadline allows is queued again.
#[test]
fn a_stalled_workers_frame_with_time_left_is_queued_again() {
    let limits = Settings {
        stall_us: 1_000_000,
        ..one_deep()
    };
    let mut s = Scheduler::new(limits);
    s.on_event(0, worker(1, 1, 5_000));
    assert_eq!(
        dispatches(&s.on_event(0, frame(1, "a", 10_000_000))),
        vec![vec![1]]
    );
    s.on_event(500_000, worker(2, 1, 5_000));
    let a = s.on_event(1_005_000, Event::Tick);
    assert_eq!(drops(&a), vec![1]);
    assert!(completes(&a).is_empty(), "{a:?}");
    assert_eq!(dispatches(&a), vec![vec![1]], "re-homed on worker 2");
    assert_eq!(s.counters().requeued, 1);
    assert!(s.counters().balanced());
}

/// Two frames of one camera in two batches on one worker (pipeline
/// depth 2), the worker lost: the newer frame goes back in the queue
/// and the older one fails, whatever order the batches are found in
/// (a hash map's, so the scenario runs on many fresh schedulers).
#[test]
fn a_lost_worker_gives_each_camera_its_newest_frame_back() {
    for _ in 0..32 {
        let mut s = Scheduler::new(Settings::default());
        s.on_event(0, worker(1, 1, 1_000));
        assert_eq!(
            dispatches(&s.on_event(0, frame(1, "c", 80_000))),
            vec![vec![1]]
        );
        assert_eq!(
            dispatches(&s.on_event(1, frame(2, "c", 80_000))),
            vec![vec![2]]
        );
        s.on_event(2, worker(2, 1, 1_000));
        let a = s.on_event(
            3,
            Event::WorkerLost {
                worker: WorkerId(1),
            },
        );
        assert_eq!(
            completes(&a),
            vec![(1, Status::Failed("worker lost".into()))]
        );
        assert_eq!(dispatches(&a), vec![vec![2]], "the newest goes to worker 2");
        assert!(s.counters().balanced());
    }
}

fn dispatches(actions: &[Action]) -> Vec<Vec<u64>> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Dispatch { frames, .. } => Some(frames.iter().map(|f| f.0).collect()),
            _ => None,
        })
        .collect()
}

#[test]
fn light_load_dispatches_single_frames_at_once() {
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, worker(1, 8, 2_000));
    // Two cameras at 5 fps each: far below what one frame per 2 ms
    // serves, so the target batch is 1 and nothing waits.
    let mut t = 0;
    let mut id = 0;
    for _ in 0..10 {
        for cam in ["a", "b"] {
            id += 1;
            let a = s.on_event(t, frame(id, cam, t + 80_000));
            let batch = dispatches(&a);
            assert_eq!(batch, vec![vec![id]], "frame {id} should go at once");
            let Action::Dispatch { batch, .. } = a[0] else {
                unreachable!()
            };
            s.on_event(
                t + 2_000,
                Event::BatchFinished {
                    worker: WorkerId(1),
                    batch,
                    outcomes: vec![(FrameId(id), Status::Ok)],
                },
            );
            t += 10_000;
        }
        t += 80_000;
    }
    assert_eq!(s.next_wakeup(), None);
}

/// A worker whose batch of b takes 4 ms + 1 ms per frame: batching pays.
fn batching_worker(id: u64) -> Event {
    Event::WorkerJoined {
        worker: WorkerId(id),
        models: vec![WorkerModel {
            model: "m".into(),
            max_batch: 8,
            profile: (1..=8).map(|b| (b, 4_000 + 1_000 * b as u32)).collect(),
        }],
    }
}

/// One worker on the injected clock that answers each batch `ok` exactly
/// `run(frames)` after it starts, so that the run time the scheduler
/// measures is `run`'s: one batch at a time ([`one_deep`]).
struct TimedWorker<F: Fn(usize) -> Micros> {
    run: F,
    /// The batch running: when it is done, and its answer.
    running: Option<(Micros, Event)>,
    /// The frames of each batch sent, in order.
    sent: Vec<Vec<u64>>,
    /// The time of the last event it delivered.
    last: Micros,
}

impl<F: Fn(usize) -> Micros> TimedWorker<F> {
    fn new(run: F) -> Self {
        TimedWorker {
            run,
            running: None,
            sent: Vec::new(),
            last: 0,
        }
    }

    /// Answers the batches done by `now`, then applies `event` at `now`.
    fn at(&mut self, s: &mut Scheduler, now: Micros, event: Event) -> Vec<Action> {
        self.answer_until(s, now);
        let a = s.on_event(now, event);
        self.last = now;
        self.start(now, &a);
        a
    }

    /// Answers every batch done by `now`, each at its own end.
    fn answer_until(&mut self, s: &mut Scheduler, now: Micros) {
        while let Some((done, _)) = &self.running
            && *done <= now
        {
            let (done, answer) = self.running.take().expect("checked");
            let a = s.on_event(done, answer);
            self.last = done;
            self.start(done, &a);
        }
    }

    /// Answers the batches and delivers the ticks due up to `limit`.
    fn settle(&mut self, s: &mut Scheduler, limit: Micros) {
        loop {
            let done = self.running.as_ref().map(|(t, _)| *t);
            let next = [done, s.next_wakeup()].into_iter().flatten().min();
            let Some(t) = next.filter(|t| *t <= limit) else {
                return;
            };
            self.at(s, t, Event::Tick);
        }
    }

    fn start(&mut self, now: Micros, actions: &[Action]) {
        for a in actions {
            if let Action::Dispatch {
                worker,
                batch,
                frames,
                ..
            } = a
            {
                assert!(self.running.is_none(), "one batch at a time: {a:?}");
                assert!(
                    frames.windows(2).all(|w| w[0] < w[1]),
                    "EDF order: {frames:?}"
                );
                self.sent.push(frames.iter().map(|f| f.0).collect());
                let answer = Event::BatchFinished {
                    worker: *worker,
                    batch: *batch,
                    outcomes: frames.iter().map(|f| (*f, Status::Ok)).collect(),
                };
                self.running = Some((now + (self.run)(frames.len()), answer));
            }
        }
    }
}

/// What [`batching_worker`]'s batch of `n` takes.
fn batching_run(n: usize) -> Micros {
    4_000 + 1_000 * n as Micros
}

#[test]
fn heavy_load_holds_frames_until_the_deadline_forces_a_batch() {
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, batching_worker(1));
    let mut w = TimedWorker::new(batching_run);
    // Eight cameras at 100 fps each (800 fps) for 300 ms: one worker
    // needs batches of 8 (8 frames / 12 ms = 667 fps < 800 × 1.2, so the
    // largest) to keep up. Whatever is dispatched while warming up, it
    // is EDF-ordered.
    let mut id = 0;
    for t in (0..300_000).step_by(10_000) {
        for cam in 0..8 {
            id += 1;
            w.at(&mut s, t, frame(id, &format!("c{cam}"), t + 30_000));
        }
    }
    // Let the held tail go (at its deadline minus a full batch's time).
    w.settle(&mut s, Micros::MAX);
    assert_eq!(s.counters().in_flight(), 0);
    assert!(w.last < 320_000, "{}", w.last);
    assert!(w.sent.iter().any(|b| b.len() == 8), "{:?}", w.sent);
    // Every batch ran as its profile said: the estimate is unchanged.
    assert_eq!(s.workers[&WorkerId(1)].models["m"].latency(8), 12_000);
    // Now a lone frame with a 30 ms deadline: it is held, not sent alone.
    let t = 320_000;
    let a = s.on_event(t, frame(1_000, "solo", t + 30_000));
    assert!(dispatches(&a).is_empty(), "held for a fuller batch: {a:?}");
    // It must leave by deadline − latency of a full batch (12 ms) with
    // its safety margin − the timer guard (sooner than the ~15 ms the
    // batch should take to fill at 800 fps).
    let latest = t + 30_000 - (12_000.0 * HOLD_LATENCY_SAFETY) as Micros - HOLD_GUARD_US;
    assert_eq!(s.next_wakeup(), Some(latest));
    assert!(dispatches(&s.on_event(latest - 1, Event::Tick)).is_empty());
    let a = s.on_event(latest, Event::Tick);
    assert_eq!(dispatches(&a), vec![vec![1_000]]);
    assert!(s.counters().balanced());
}

#[test]
fn a_batch_is_held_only_as_long_as_it_should_take_to_fill() {
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, batching_worker(1));
    let mut w = TimedWorker::new(batching_run);
    // Four cameras at 50 fps (200 fps): one frame per 5 ms does not keep
    // up with 200 × 1.2 fps, two per 6 ms does, so the target is 2.
    let mut id = 0;
    for t in (0..400_000).step_by(20_000) {
        for cam in 0..4 {
            id += 1;
            let at = t + cam * 5_000;
            w.at(&mut s, at, frame(id, &format!("c{cam}"), t + 1_000_000));
        }
    }
    // Flush what is held, then one frame alone with a whole second of
    // slack: it waits about as long as a second frame should take to
    // come (1.5 × 2 / 200 fps = 15 ms), not until its deadline.
    let t = 420_000;
    w.settle(&mut s, t);
    assert_eq!(s.counters().in_flight(), 0);
    assert!(w.last < t, "{}", w.last);
    assert!(dispatches(&s.on_event(t, frame(9_999, "c0", t + 1_000_000))).is_empty());
    let wake = s.next_wakeup().expect("held frame wakes the scheduler");
    assert!(
        (t + 10_000..=t + 25_000).contains(&wake),
        "held until {} µs after arrival",
        wake - t
    );
    assert_eq!(
        dispatches(&s.on_event(wake, Event::Tick)),
        vec![vec![9_999]]
    );
}

#[test]
fn when_batching_does_not_pay_frames_go_one_by_one_without_waiting() {
    let mut s = Scheduler::new(one_deep());
    // Like BlazeFace on a CPU: a batch costs more per frame than singles.
    let cpu_run = |b: usize| (1_000 * b + 100 * b * b) as Micros;
    s.on_event(
        0,
        Event::WorkerJoined {
            worker: WorkerId(1),
            models: vec![WorkerModel {
                model: "m".into(),
                max_batch: 16,
                profile: (1..=16).map(|b| (b, cpu_run(b as usize) as u32)).collect(),
            }],
        },
    );
    let mut w = TimedWorker::new(cpu_run);
    // Overload: 16 cameras at 1,000 fps for 200 ms.
    let mut id = 0;
    for t in (0..200_000).step_by(1_000) {
        for cam in 0..16 {
            id += 1;
            w.at(&mut s, t, frame(id, &format!("c{cam}"), t + 80_000));
        }
    }
    w.settle(&mut s, Micros::MAX);
    assert!(w.sent.len() > 100, "{} batches", w.sent.len());
    assert!(w.sent.iter().all(|b| b.len() == 1), "batches: {:?}", w.sent);
    assert!(s.counters().balanced());
    assert_eq!(s.counters().in_flight(), 0);
}

#[test]
fn full_target_batch_goes_without_waiting() {
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, batching_worker(1));
    let mut w = TimedWorker::new(batching_run);
    // 8 cameras sending 100 fps: the 8th frame completes the batch.
    for round in 0..20u64 {
        let t = round * 10_000;
        for cam in 0..8u64 {
            let id = round * 8 + cam + 1;
            w.at(&mut s, t, frame(id, &format!("c{cam}"), t + 60_000));
        }
    }
    // Once the rate estimate settles, every batch is full.
    let sent: Vec<usize> = w.sent.iter().map(Vec::len).collect();
    assert!(sent.len() >= 10, "batches: {sent:?}");
    assert!(sent[sent.len() - 5..].iter().all(|&n| n == 8), "{sent:?}");
}

#[test]
fn frame_behind_a_queue_it_cannot_outrun_is_shed_on_arrival() {
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, worker(1, 1, 10_000));
    // Frame 1 runs until 10 ms; frames 2..=5 queue, due at 60 ms.
    for i in 1..=5 {
        s.on_event(0, frame(i, &format!("c{i}"), 60_000));
    }
    assert_eq!(s.queue_len("m"), 4);
    // Due at 65 ms behind four: free at 10 ms + 4 × 10 ms + its own
    // 10 ms = 60 ms. Kept.
    assert!(completes(&s.on_event(0, frame(6, "x", 65_000))).is_empty());
    // Due at 69 ms behind five: 10 + 50 + 10 = 70 ms. Shed before it
    // ever queues, so it cannot delay anything.
    assert_eq!(
        completes(&s.on_event(0, frame(7, "y", 69_000))),
        vec![(7, Status::Shed(ShedReason::WouldMissDeadline))]
    );
    // An earlier deadline goes ahead of the queue (EDF): kept.
    assert!(completes(&s.on_event(0, frame(8, "z", 25_000))).is_empty());
    // The camera's own queued frame does not count against its
    // successor: due at 75 ms, frame 9 is behind 2..=5, 8 and its own
    // predecessor 6, which it replaces: 10 + 50 + 10 = 70 ms. Kept.
    assert_eq!(
        completes(&s.on_event(0, frame(9, "x", 75_000))),
        vec![(6, Status::Shed(ShedReason::Superseded))]
    );
    assert!(s.counters().balanced());
}

/// Finishes the batch dispatched in `actions` (if any) at `now`, all ok:
/// the scheduler measures its run time up to `now`.
fn finish_dispatched(s: &mut Scheduler, now: Micros, actions: &[Action]) {
    if let Some(Action::Dispatch {
        worker,
        batch,
        frames,
        ..
    }) = actions
        .iter()
        .find(|a| matches!(a, Action::Dispatch { .. }))
    {
        let outcomes = frames.iter().map(|f| (*f, Status::Ok)).collect();
        s.on_event(
            now,
            Event::BatchFinished {
                worker: *worker,
                batch: *batch,
                outcomes,
            },
        );
    }
}

#[test]
fn one_outlier_batch_does_not_shed_the_model_for_ever() {
    // A GPU worker: 2 ms a frame. Its first batch takes 2 s (a cuDNN
    // algorithm search for a new input shape).
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, worker(1, 1, 2_000));
    let a = s.on_event(0, frame(1, "c", 80_000));
    assert_eq!(dispatches(&a), vec![vec![1]]);
    finish_dispatched(&mut s, 2_000_000, &a);
    // Counted as at most 3 × 2 ms: the estimate is 2.8 ms, not 400 ms,
    // and the next frames are served.
    let mut t = 2_000_000;
    for id in 2..=6 {
        let a = s.on_event(t, frame(id, "c", t + 80_000));
        assert_eq!(dispatches(&a), vec![vec![id]], "frame {id}: {a:?}");
        finish_dispatched(&mut s, t + 2_000, &a);
        t += 33_000;
    }
    assert!(s.counters().balanced());
}

#[test]
fn an_estimate_beyond_every_deadline_relaxes_while_the_worker_idles() {
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, worker(1, 1, 2_000));
    // The worker really is slow for a while: 300 ms a frame, learned
    // over a few batches.
    let mut t = 0;
    let mut id = 0;
    while id < 20 {
        id += 1;
        let a = s.on_event(t, frame(id, "c", t + 1_000_000));
        assert_eq!(dispatches(&a), vec![vec![id]], "frame {id}: {a:?}");
        t += 300_000;
        finish_dispatched(&mut s, t, &a);
    }
    assert!(s.workers[&WorkerId(1)].models["m"].latency(1) > 200_000);
    // Now no frame with an 80 ms budget looks like it can make it.
    id += 1;
    assert_eq!(
        completes(&s.on_event(t, frame(id, "c", t + 80_000))),
        vec![(id, Status::Shed(ShedReason::WouldMissDeadline))]
    );
    // Idle, the estimate relaxes towards the registered 2 ms: within a
    // fraction of a second it does not, ...
    id += 1;
    let soon = t + 200_000;
    assert_eq!(
        completes(&s.on_event(soon, frame(id, "c", soon + 80_000))),
        vec![(id, Status::Shed(ShedReason::WouldMissDeadline))]
    );
    // ... after a quiet 20 s a frame is dispatched again, whose
    // batch time then corrects the estimate.
    id += 1;
    let later = t + 20_000_000;
    let a = s.on_event(later, frame(id, "c", later + 80_000));
    assert_eq!(dispatches(&a), vec![vec![id]]);
    let before = s.workers[&WorkerId(1)].models["m"].latency(1);
    finish_dispatched(&mut s, later + 300_000, &a);
    // Up by the bounded step (×1.4) per slow batch.
    let after = s.workers[&WorkerId(1)].models["m"].latency(1);
    assert!(after * 10 >= before * 13, "{before} -> {after}");
    assert!(s.counters().balanced());
}

#[test]
fn the_estimate_shown_relaxes_with_idle_time_even_with_no_event_to_apply_it() {
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, worker(1, 1, 2_000));
    assert_eq!(s.latency_estimate_us(0, WorkerId(1), "m", 1), Some(2_000));
    assert_eq!(s.latency_estimate_us(0, WorkerId(2), "m", 1), None);
    assert_eq!(s.latency_estimate_us(0, WorkerId(1), "other", 1), None);
    // One 2 s batch: counted as at most 3 × 2 ms, so 2.8 ms.
    let a = s.on_event(0, frame(1, "c", 80_000));
    finish_dispatched(&mut s, 2_000_000, &a);
    let t = 2_000_000;
    assert_eq!(s.latency_estimate_us(t, WorkerId(1), "m", 1), Some(2_800));
    // Idle: the excess halves every 2 s, read without an event.
    assert_eq!(
        s.latency_estimate_us(t + 2_000_000, WorkerId(1), "m", 1),
        Some(2_400)
    );
    assert_eq!(
        s.latency_estimate_us(t + 60_000_000, WorkerId(1), "m", 1),
        Some(2_000)
    );
    // Reading changed nothing: the next event relaxes from where it was.
    assert_eq!(s.latency_estimate_us(t, WorkerId(1), "m", 1), Some(2_800));
}

#[test]
fn a_busy_worker_gets_its_next_batch_just_before_it_frees() {
    let mut s = Scheduler::new(Settings::default()); // pipeline depth 2
    s.on_event(0, worker(1, 1, 10_000));
    // Frame 1 runs 0..10 ms; frame 2 goes as the second batch at once
    // (light load: the target batch is 1) and will start at 10 ms.
    assert_eq!(
        dispatches(&s.on_event(0, frame(1, "a", 80_000))),
        vec![vec![1]]
    );
    assert_eq!(
        dispatches(&s.on_event(0, frame(2, "b", 80_000))),
        vec![vec![2]]
    );
    // The pipeline is full: frame 3 waits in the gateway queue.
    assert!(dispatches(&s.on_event(0, frame(3, "c", 80_000))).is_empty());
    assert_eq!(s.queue_len("m"), 1);
    // A frame due at 25 ms cannot make it: the worker only frees at
    // 20 ms (both batches), + 10 ms = 30 ms. Shed on arrival.
    assert_eq!(
        completes(&s.on_event(0, frame(4, "d", 25_000))),
        vec![(4, Status::Shed(ShedReason::WouldMissDeadline))]
    );
    // Batch 1 returns at 10 ms: frame 3 is sent as the next batch.
    let a = s.on_event(
        10_000,
        Event::BatchFinished {
            worker: WorkerId(1),
            batch: BatchId(1),
            outcomes: vec![(FrameId(1), Status::Ok)],
        },
    );
    assert_eq!(dispatches(&a), vec![vec![3]]);
    assert!(s.counters().balanced());
    assert_eq!(s.counters().dispatched, 2);
}

#[test]
fn a_draining_worker_finishes_its_batch_but_gets_no_new_one() {
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, worker(1, 1, 1_000));
    s.on_event(0, worker(2, 1, 5_000));
    assert_eq!(
        dispatches(&s.on_event(0, frame(1, "a", 80_000))),
        vec![vec![1]]
    );
    s.on_event(
        0,
        Event::WorkerDraining {
            worker: WorkerId(1),
        },
    );
    // Worker 2 is busy with frame 2; frame 3 waits for it, not for the
    // draining worker 1.
    assert_eq!(
        dispatches(&s.on_event(0, frame(2, "b", 80_000))),
        vec![vec![2]]
    );
    assert!(dispatches(&s.on_event(0, frame(3, "c", 80_000))).is_empty());
    let done = |w, b, f| Event::BatchFinished {
        worker: WorkerId(w),
        batch: BatchId(b),
        outcomes: vec![(FrameId(f), Status::Ok)],
    };
    // Worker 1's batch is still answered and accounted.
    let a = s.on_event(1_000, done(1, 1, 1));
    assert_eq!(completes(&a), vec![(1, Status::Ok)]);
    assert!(dispatches(&a).is_empty(), "draining worker got work: {a:?}");
    let a = s.on_event(5_000, done(2, 2, 2));
    assert_eq!(dispatches(&a), vec![vec![3]]);
    // With only the draining worker left, new frames have no worker.
    s.on_event(
        6_000,
        Event::WorkerLost {
            worker: WorkerId(2),
        },
    );
    assert_eq!(
        completes(&s.on_event(6_000, frame(4, "d", 80_000))),
        vec![(4, Status::Shed(ShedReason::NoWorker))]
    );
    assert!(s.counters().balanced());
}

#[test]
fn a_worker_failing_its_frames_is_demoted_and_gets_only_probes_until_one_succeeds() {
    let mut s = Scheduler::new(one_deep());
    // Worker 1 is fast and fails everything; worker 2 is slow and honest.
    s.on_event(0, worker(1, 1, 1_000));
    s.on_event(0, worker(2, 1, 5_000));
    let done = |w, batch, f, status| Event::BatchFinished {
        worker: WorkerId(w),
        batch,
        outcomes: vec![(FrameId(f), status)],
    };
    let failed = || Status::Failed("boom".into());
    let sent = |a: &[Action]| -> Vec<(u64, usize, BatchId)> {
        a.iter()
            .filter_map(|a| match a {
                Action::Dispatch {
                    worker,
                    batch,
                    frames,
                    ..
                } => Some((worker.0, frames.len(), *batch)),
                _ => None,
            })
            .collect()
    };
    let demotions = |a: &[Action]| -> Vec<Action> {
        a.iter()
            .filter(|a| matches!(a, Action::WorkerDemoted { .. }))
            .cloned()
            .collect()
    };
    // Seven failed frames are too few to judge; the eighth demotes.
    // Each failed frame goes to the honest worker instead of failing.
    for id in 1..=8u64 {
        let t = id * 10_000;
        let d = sent(&s.on_event(t, frame(id, "c", t + 80_000)));
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].0, 1, "the fast worker takes frame {id}");
        let a = s.on_event(t + 1_000, done(1, d[0].2, id, failed()));
        assert!(completes(&a).is_empty(), "frame {id}: {a:?}");
        let retry = sent(&a);
        assert_eq!(
            retry.iter().map(|d| (d.0, d.1)).collect::<Vec<_>>(),
            vec![(2, 1)]
        );
        let ok = s.on_event(t + 6_000, done(2, retry[0].2, id, Status::Ok));
        assert_eq!(completes(&ok), vec![(id, Status::Ok)]);
        if id < 8 {
            assert!(demotions(&a).is_empty(), "frame {id}: {a:?}");
        } else {
            assert_eq!(
                demotions(&a),
                vec![Action::WorkerDemoted {
                    worker: WorkerId(1),
                    model: "m".into(),
                    reason: DemotionReason::FailureRatio { failed: 8, of: 8 },
                    backoff_us: 1_000_000,
                    probe_failed: false,
                }]
            );
        }
    }
    assert_eq!(s.demoted_count(), 1);
    assert!(s.is_demoted(WorkerId(1)));
    // The back-off's end wakes the scheduler.
    assert_eq!(s.next_wakeup(), Some(1_081_000));
    // Backing off, it gets nothing: the slow worker takes every frame.
    let mut id = 100;
    for t in (100_000..1_000_000).step_by(100_000) {
        id += 1;
        let d = sent(&s.on_event(t, frame(id, "c", t + 80_000)));
        assert_eq!(d.iter().map(|d| d.0).collect::<Vec<_>>(), vec![2]);
        s.on_event(t + 5_000, done(2, d[0].2, id, Status::Ok));
    }
    // After it, one probe of one frame; while it is out, nothing more.
    let t = 1_100_000;
    let a = s.on_event(t, frame(201, "a", t + 80_000));
    let probe = sent(&a);
    assert_eq!(
        probe.iter().map(|d| (d.0, d.1)).collect::<Vec<_>>(),
        vec![(1, 1)]
    );
    let d = sent(&s.on_event(t, frame(202, "b", t + 80_000)));
    assert_eq!(d.iter().map(|d| d.0).collect::<Vec<_>>(), vec![2]);
    assert!(dispatches(&s.on_event(t, frame(203, "x", t + 80_000))).is_empty());
    // The probe fails: demoted again, for twice as long, not counted as
    // a new demotion.
    let a = s.on_event(t + 1_000, done(1, probe[0].2, 201, failed()));
    assert!(matches!(
        demotions(&a)[..],
        [Action::WorkerDemoted {
            backoff_us: 2_000_000,
            probe_failed: true,
            ..
        }]
    ));
    // The next probe succeeds: it serves again.
    let t = 3_200_000;
    s.on_event(t, done(2, d[0].2, 202, Status::Ok));
    let a = s.on_event(t, frame(301, "a", t + 80_000));
    let probe = sent(&a);
    assert_eq!(
        probe.iter().map(|d| (d.0, d.1)).collect::<Vec<_>>(),
        vec![(1, 1)]
    );
    let a = s.on_event(t + 1_000, done(1, probe[0].2, 301, Status::Ok));
    assert!(a.contains(&Action::WorkerRestored {
        worker: WorkerId(1)
    }));
    assert_eq!(s.demoted_count(), 0);
    assert!(s.counters().balanced());
}

/// What `BatchFinished` of one frame `f` on worker `w` looks like.
fn one_done(w: u64, batch: BatchId, f: u64, status: Status) -> Event {
    Event::BatchFinished {
        worker: WorkerId(w),
        batch,
        outcomes: vec![(FrameId(f), status)],
    }
}

/// The (worker, frames, batch) of each dispatch in `a`.
fn sent_to(a: &[Action]) -> Vec<(u64, Vec<u64>, BatchId)> {
    a.iter()
        .filter_map(|a| match a {
            Action::Dispatch {
                worker,
                batch,
                frames,
                ..
            } => Some((worker.0, frames.iter().map(|f| f.0).collect(), *batch)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_frame_a_worker_fails_goes_once_to_another_and_never_back() {
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, worker(1, 1, 1_000));
    s.on_event(0, worker(2, 1, 5_000));
    let failed = || Status::Failed("boom".into());
    let d = sent_to(&s.on_event(0, frame(1, "c", 80_000)));
    assert_eq!(d[0].0, 1);
    // Failed on 1: queued for 2, not completed.
    let a = s.on_event(1_000, one_done(1, d[0].2, 1, failed()));
    assert!(completes(&a).is_empty(), "{a:?}");
    let d = sent_to(&a);
    assert_eq!((d[0].0, d[0].1.clone()), (2, vec![1]));
    assert_eq!(s.counters().retried, 1);
    assert!(s.counters().balanced());
    // Failed again on 2: no second retry, it fails with 2's reason.
    let a = s.on_event(
        6_000,
        one_done(2, d[0].2, 1, Status::Failed("again".into())),
    );
    assert_eq!(completes(&a), vec![(1, Status::Failed("again".into()))]);
    assert_eq!(s.counters().retried, 1);
    assert_eq!(s.counters().failed, 1);
    assert!(s.counters().balanced());
}

#[test]
fn a_retried_frame_waits_for_another_worker_while_the_one_that_failed_it_idles() {
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, worker(1, 4, 1_000));
    s.on_event(0, worker(2, 4, 5_000));
    let d = sent_to(&s.on_event(0, frame(1, "c", 80_000)));
    assert_eq!(d[0].0, 1);
    // 2 is busy with another camera's frame when 1 fails frame 1.
    let busy = sent_to(&s.on_event(100, frame(2, "d", 80_100)));
    assert_eq!(busy[0].0, 2);
    let a = s.on_event(1_000, one_done(1, d[0].2, 1, Status::Failed("boom".into())));
    // 1 is idle, yet the frame it failed waits for 2.
    assert!(sent_to(&a).is_empty(), "{a:?}");
    assert!(completes(&a).is_empty(), "{a:?}");
    assert_eq!(s.queue_len("m"), 1);
    // A new frame meanwhile goes to 1; the retried one does not join it.
    let a = s.on_event(2_000, frame(3, "e", 82_000));
    assert_eq!(
        sent_to(&a)
            .into_iter()
            .map(|d| (d.0, d.1))
            .collect::<Vec<_>>(),
        vec![(1, vec![3])]
    );
    // When 2 frees, it takes the retried frame.
    let a = s.on_event(5_100, one_done(2, busy[0].2, 2, Status::Ok));
    assert_eq!(completes(&a), vec![(2, Status::Ok)]);
    assert_eq!(
        sent_to(&a)
            .into_iter()
            .map(|d| (d.0, d.1))
            .collect::<Vec<_>>(),
        vec![(2, vec![1])]
    );
    assert!(s.counters().balanced());
}

#[test]
fn a_failed_frame_fails_without_another_worker_time_or_a_connected_edge() {
    let failed = || Status::Failed("boom".into());
    // No other worker.
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, worker(1, 1, 1_000));
    let d = sent_to(&s.on_event(0, frame(1, "c", 80_000)));
    let a = s.on_event(1_000, one_done(1, d[0].2, 1, failed()));
    assert_eq!(completes(&a), vec![(1, failed())]);
    // Another worker, but too slow for what is left of the budget.
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, worker(1, 1, 1_000));
    s.on_event(0, worker(2, 1, 50_000));
    let d = sent_to(&s.on_event(0, frame(1, "c", 40_000)));
    assert_eq!(d[0].0, 1);
    let a = s.on_event(1_000, one_done(1, d[0].2, 1, failed()));
    assert_eq!(completes(&a), vec![(1, failed())]);
    // A newer frame of the same camera is queued: it supersedes.
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, worker(1, 1, 1_000));
    s.on_event(0, worker(2, 1, 5_000));
    let d = sent_to(&s.on_event(0, frame(1, "c", 80_000)));
    let busy = sent_to(&s.on_event(0, frame(2, "other", 80_000)));
    assert_eq!((d[0].0, busy[0].0), (1, 2));
    s.on_event(500, frame(3, "c", 80_500));
    let a = s.on_event(1_000, one_done(1, d[0].2, 1, failed()));
    assert!(completes(&a).contains(&(1, failed())), "{a:?}");
    // A frame the worker left out of its answer is retried as well.
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, worker(1, 1, 1_000));
    s.on_event(0, worker(2, 1, 5_000));
    let d = sent_to(&s.on_event(0, frame(1, "c", 80_000)));
    let a = s.on_event(
        1_000,
        Event::BatchFinished {
            worker: WorkerId(1),
            batch: d[0].2,
            outcomes: vec![],
        },
    );
    assert_eq!(sent_to(&a)[0].1, vec![1]);
    assert_eq!(sent_to(&a)[0].0, 2);
    assert_eq!(s.counters().retried, 1);
    assert!(s.counters().balanced());
}

fn join(edge: u64, name: &str, weight: u32) -> Event {
    Event::EdgeJoined {
        edge: EdgeId(edge),
        name: name.into(),
        weight,
    }
}

fn frame_of(id: u64, edge: u64, camera: &str, deadline: Micros) -> Event {
    Event::FrameArrived(Arrival {
        id: FrameId(id),
        edge: EdgeId(edge),
        camera: camera.into(),
        model: "m".into(),
        deadline,
        age: 0,
    })
}

/// Answers the batch `actions` dispatched, if any, `ok` at `now`; what
/// the scheduler does next.
fn answer_ok(s: &mut Scheduler, now: Micros, actions: &[Action]) -> Vec<Action> {
    let Some(Action::Dispatch {
        worker,
        batch,
        frames,
        ..
    }) = actions
        .iter()
        .find(|a| matches!(a, Action::Dispatch { .. }))
    else {
        return Vec::new();
    };
    let outcomes = frames.iter().map(|f| (*f, Status::Ok)).collect();
    s.on_event(
        now,
        Event::BatchFinished {
            worker: *worker,
            batch: *batch,
            outcomes,
        },
    )
}

/// Serves one frame at a time on a one-deep worker from `first` on
/// (the actions that dispatched the first batch); the frames in the
/// order they were dispatched.
fn served_order(s: &mut Scheduler, first: Vec<Action>, rounds: usize) -> Vec<u64> {
    let mut order = Vec::new();
    let mut actions = first;
    let mut now = 0;
    for _ in 0..rounds {
        let Some(batch) = dispatches(&actions).into_iter().next() else {
            break;
        };
        order.extend(batch);
        now += 1_000;
        actions = answer_ok(s, now, &actions);
    }
    order
}

#[test]
fn two_edges_with_queued_frames_take_turns_whatever_their_deadlines() {
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, worker(1, 1, 1_000));
    s.on_event(0, join(1, "a", 1));
    s.on_event(0, join(2, "b", 1));
    // Edge a's frames are all more urgent: pure EDF would serve them
    // all before any of b's.
    let first = s.on_event(0, frame_of(1, 1, "a1", 1_000_000));
    for i in 2..=4 {
        s.on_event(0, frame_of(i, 1, &format!("a{i}"), 1_000_000 + i));
    }
    for i in 11..=14 {
        s.on_event(0, frame_of(i, 2, &format!("b{i}"), 5_000_000 + i));
    }
    let order = served_order(&mut s, first, 8);
    assert_eq!(order, vec![1, 11, 2, 12, 3, 13, 4, 14]);
    assert!(s.counters().balanced());
}

#[test]
fn an_edge_of_weight_two_gets_two_frames_for_each_of_an_edge_of_weight_one() {
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, worker(1, 1, 1_000));
    s.on_event(0, join(1, "heavy", 2));
    s.on_event(0, join(2, "light", 1));
    let first = s.on_event(0, frame_of(1, 1, "h1", 9_000_000));
    for i in 2..=12 {
        s.on_event(0, frame_of(i, 1, &format!("h{i}"), 9_000_000 + i));
    }
    for i in 101..=112 {
        s.on_event(0, frame_of(i, 2, &format!("l{i}"), 1_000_000 + i));
    }
    let order = served_order(&mut s, first, 12);
    let heavy = order.iter().filter(|id| **id < 100).count();
    assert_eq!((heavy, order.len() - heavy), (8, 4), "{order:?}");
}

#[test]
fn every_connection_of_an_edge_name_counts_against_its_queue_cap() {
    let mut s = Scheduler::new(Settings {
        max_queued_per_edge: 3,
        ..one_deep()
    });
    s.on_event(0, worker(1, 1, 1_000));
    for conn in [1, 2, 3] {
        s.on_event(0, join(conn, "a", 1));
    }
    s.on_event(0, join(9, "b", 1));
    s.on_event(0, frame_of(1, 1, "x", 9_000_000)); // dispatched at once
    s.on_event(0, frame_of(2, 1, "y", 9_000_000));
    s.on_event(0, frame_of(3, 2, "y", 9_000_000));
    s.on_event(0, frame_of(4, 3, "y", 9_000_000));
    let a = s.on_event(0, frame_of(5, 3, "z", 9_000_000));
    assert_eq!(
        completes(&a),
        vec![(5, Status::Shed(ShedReason::Overloaded))]
    );
    // Another edge name has a cap of its own.
    let a = s.on_event(0, frame_of(6, 9, "y", 9_000_000));
    assert_eq!(completes(&a), vec![]);
}

#[test]
fn an_edge_under_its_share_of_a_full_queue_pushes_out_a_frame_of_the_edge_over_it() {
    let mut s = Scheduler::new(Settings {
        max_queued: 4,
        max_queued_per_edge: 100,
        ..one_deep()
    });
    s.on_event(0, worker(1, 1, 1_000));
    s.on_event(0, join(1, "hog", 1));
    s.on_event(0, join(2, "hog", 1));
    s.on_event(0, join(3, "fair", 1));
    s.on_event(0, frame_of(1, 1, "c1", 9_000_000)); // dispatched at once
    for i in 2..=5 {
        let a = s.on_event(0, frame_of(i, 1 + i % 2, &format!("c{i}"), 9_000_000 + i));
        assert_eq!(completes(&a), vec![], "frame {i}");
    }
    // Full. The hog's least urgent frame makes room for the fair edge.
    let a = s.on_event(0, frame_of(10, 3, "f1", 9_000_000));
    assert_eq!(
        completes(&a),
        vec![(5, Status::Shed(ShedReason::Overloaded))]
    );
    let a = s.on_event(0, frame_of(11, 3, "f2", 9_000_000));
    assert_eq!(
        completes(&a),
        vec![(4, Status::Shed(ShedReason::Overloaded))]
    );
    // Now at its share (half of 4): its next frame is refused instead.
    let a = s.on_event(0, frame_of(12, 3, "f3", 9_000_000));
    assert_eq!(
        completes(&a),
        vec![(12, Status::Shed(ShedReason::Overloaded))]
    );
    // And the hog, at its share too, pushes out nobody.
    let a = s.on_event(0, frame_of(13, 2, "c13", 9_000_000));
    assert_eq!(
        completes(&a),
        vec![(13, Status::Shed(ShedReason::Overloaded))]
    );
    assert!(s.counters().balanced());
}

#[test]
fn a_gone_edges_queued_and_trailing_frames_are_dropped_and_its_running_frame_finishes() {
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, worker(1, 1, 1_000));
    s.on_event(0, join(1, "a", 1));
    s.on_event(0, join(2, "a", 1));
    let running = s.on_event(0, frame_of(1, 1, "x", 9_000_000));
    s.on_event(0, frame_of(2, 1, "y", 9_000_000));
    s.on_event(0, frame_of(3, 1, "z", 9_000_000));
    // Another connection of the same name is not touched.
    s.on_event(0, frame_of(4, 2, "y", 9_000_000));
    let a = s.on_event(10, Event::EdgeGone { edge: EdgeId(1) });
    assert_eq!(
        completes(&a),
        vec![
            (2, Status::Shed(ShedReason::EdgeGone)),
            (3, Status::Shed(ShedReason::EdgeGone))
        ]
    );
    let a = s.on_event(20, frame_of(5, 1, "x", 9_000_000));
    assert_eq!(completes(&a), vec![(5, Status::Shed(ShedReason::EdgeGone))]);
    // The frame on the worker finishes; the other connection's is next.
    let a = answer_ok(&mut s, 1_000, &running);
    assert_eq!(completes(&a), vec![(1, Status::Ok)]);
    assert_eq!(dispatches(&a), vec![vec![4]]);
    let c = s.counters();
    assert!(c.balanced() && c.shed == 3 && c.queued == 0, "{c:?}");
}

#[test]
fn a_frame_queued_before_its_connection_joined_is_dropped_when_it_goes() {
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, worker(1, 1, 1_000));
    s.on_event(0, frame_of(1, 1, "x", 9_000_000)); // dispatched at once
    s.on_event(0, frame_of(2, 1, "y", 9_000_000));
    s.on_event(0, join(1, "a", 1));
    let a = s.on_event(10, Event::EdgeGone { edge: EdgeId(1) });
    assert_eq!(completes(&a), vec![(2, Status::Shed(ShedReason::EdgeGone))]);
    assert_eq!(s.counters().queued, 0);
}

#[test]
fn a_lost_workers_frame_of_a_gone_edge_is_dropped_not_queued_again() {
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, worker(1, 1, 1_000));
    s.on_event(0, frame_of(1, 1, "x", 9_000_000));
    s.on_event(10, Event::EdgeGone { edge: EdgeId(1) });
    let a = s.on_event(
        20,
        Event::WorkerLost {
            worker: WorkerId(1),
        },
    );
    assert_eq!(completes(&a), vec![(1, Status::Shed(ShedReason::EdgeGone))]);
    assert_eq!(s.counters().requeued, 0);
}

/// The learned latency of one frame of "m" on `worker`.
fn learned(s: &Scheduler, worker: u64) -> u64 {
    s.workers[&WorkerId(worker)].models["m"].latency(1)
}

#[test]
fn a_batchs_run_time_is_measured_from_its_dispatch_or_the_workers_previous_answer() {
    let mut s = Scheduler::new(Settings::default()); // pipeline depth 2
    s.on_event(0, worker(1, 1, 10_000));
    // Two batches at once: the second waits on the worker for the first.
    assert_eq!(
        dispatches(&s.on_event(0, frame(1, "a", 80_000))),
        vec![vec![1]]
    );
    assert_eq!(
        dispatches(&s.on_event(0, frame(2, "b", 80_000))),
        vec![vec![2]]
    );
    let run = |s: &Scheduler, now, b| s.batch_run(now, WorkerId(1), BatchId(b));
    let ran = |run_us| Some(BatchRun { frames: 1, run_us });
    assert_eq!(run(&s, 10_000, 1), ran(10_000));
    // Only the worker it was sent to runs it; an unknown batch has no run.
    assert_eq!(s.batch_run(10_000, WorkerId(2), BatchId(1)), None);
    assert_eq!(run(&s, 10_000, 9), None);
    s.on_event(10_000, one_done(1, BatchId(1), 1, Status::Ok));
    assert_eq!(run(&s, 10_000, 1), None, "answered once");
    // It ran as its profile said: the estimate holds.
    assert_eq!(learned(&s, 1), 10_000);
    // Batch 2, sent at 0, ran from batch 1's answer: 8 ms, not 18.
    assert_eq!(run(&s, 18_000, 2), ran(8_000));
    s.on_event(18_000, one_done(1, BatchId(2), 2, Status::Ok));
    // The profile learned 8 ms (EWMA: 0.8 × 10 ms + 0.2 × 8 ms).
    assert!(
        (9_600..=9_601).contains(&learned(&s, 1)),
        "{}",
        learned(&s, 1)
    );
    // A batch sent later to the idle worker runs from its dispatch.
    let a = s.on_event(50_000, frame(3, "c", 130_000));
    assert_eq!(dispatches(&a), vec![vec![3]]);
    assert_eq!(run(&s, 59_000, 3), ran(9_000));
    // A lost worker's batch has no run: its late answer is ignored.
    s.on_event(
        55_000,
        Event::WorkerLost {
            worker: WorkerId(1),
        },
    );
    assert_eq!(run(&s, 59_000, 3), None);
    assert!(s.counters().balanced());
}

/// A draining worker that resumes (a static worker bound to a lease
/// again) keeps the batch it holds, its learned profile and its health.
/// Losing it and joining it afresh, the only way back before
/// `WorkerResumed`, fails that batch's frame while the worker still runs
/// it, ignores its answer, and forgets what was learned of it.
#[test]
fn a_resumed_worker_keeps_its_batch_profile_and_health_which_a_rejoin_loses() {
    // Worker 1 (10 ms a frame) answers its first batch short after 20 ms:
    // demoted, and the profile learned the slow run. After its back-off,
    // its probe (frame 2) is out when it starts draining.
    let draining_with_a_probe_out = || {
        let mut s = Scheduler::new(one_deep());
        s.on_event(0, worker(1, 1, 10_000));
        let a = s.on_event(0, frame(1, "a", 80_000));
        let short = Event::BatchFinished {
            worker: WorkerId(1),
            batch: sent_to(&a)[0].2,
            outcomes: vec![],
        };
        s.on_event(20_000, short);
        assert!(s.is_demoted(WorkerId(1)));
        assert_eq!(learned(&s, 1), 12_000);
        let probe = sent_to(&s.on_event(1_100_000, frame(2, "a", 1_180_000)));
        assert_eq!(probe.len(), 1, "{probe:?}");
        s.on_event(
            1_100_000,
            Event::WorkerDraining {
                worker: WorkerId(1),
            },
        );
        assert!(
            completes(&s.on_event(1_100_000, frame(3, "b", 1_180_000)))
                .iter()
                .all(|(_, st)| *st == Status::Shed(ShedReason::NoWorker)),
            "no batch while draining"
        );
        let slow = learned(&s, 1);
        // relaxing towards the registered 10 ms while it idled
        assert!(slow > 10_000, "{slow}");
        (s, probe[0].2, slow)
    };
    let answered = |batch| one_done(1, batch, 2, Status::Ok);

    // Resumed: the probe's answer ends its frame, restores the worker,
    // and it takes new batches again, with what it learned.
    let (mut s, probe, slow) = draining_with_a_probe_out();
    s.on_event(
        1_101_000,
        Event::WorkerResumed {
            worker: WorkerId(1),
        },
    );
    assert!(s.is_demoted(WorkerId(1)), "its health is kept");
    assert_eq!(learned(&s, 1), slow, "its profile is kept");
    let a = s.on_event(1_110_000, answered(probe));
    assert_eq!(completes(&a), vec![(2, Status::Ok)]);
    assert!(a.contains(&Action::WorkerRestored {
        worker: WorkerId(1)
    }));
    assert_eq!(
        dispatches(&s.on_event(1_120_000, frame(4, "c", 1_200_000))),
        vec![vec![4]]
    );
    assert!(s.counters().balanced());
    assert_eq!((s.counters().ok, s.counters().failed), (1, 1));

    // Lost and joined again: the probe's frame fails although the worker
    // is still running it, its answer is ignored, and the worker starts
    // healthy at its registered profile.
    let (mut s, probe, _) = draining_with_a_probe_out();
    s.on_event(
        1_101_000,
        Event::WorkerLost {
            worker: WorkerId(1),
        },
    );
    let a = s.on_event(1_101_000, worker(1, 1, 10_000));
    assert_eq!(completes(&a), vec![]);
    assert_eq!((s.counters().ok, s.counters().failed), (0, 2));
    assert!(completes(&s.on_event(1_110_000, answered(probe))).is_empty());
    assert!(!s.is_demoted(WorkerId(1)));
    assert_eq!(learned(&s, 1), 10_000);
    assert!(s.counters().balanced());
}

#[test]
fn only_a_known_worker_resumes() {
    let mut s = Scheduler::new(one_deep());
    s.on_event(
        0,
        Event::WorkerResumed {
            worker: WorkerId(1),
        },
    );
    assert_eq!(s.worker_counts(), (0, 0));
    assert_eq!(
        completes(&s.on_event(0, frame(1, "a", 80_000))),
        vec![(1, Status::Shed(ShedReason::NoWorker))]
    );
}

/// A flooding edge (a batch or more queued) and a light one (one frame):
/// no batch mixes their frames, the picks keep their fair order (the
/// light frame goes second, as start-time fair queuing says), and every
/// frame is dispatched once.
#[test]
fn a_light_edges_frame_never_shares_a_batch_with_a_flooding_edges_frames() {
    let mut s = Scheduler::new(one_deep());
    // Batching pays on this worker: 1 ms a batch plus 0.2 ms a frame.
    s.on_event(
        0,
        Event::WorkerJoined {
            worker: WorkerId(1),
            models: vec![WorkerModel {
                model: "m".into(),
                max_batch: 4,
                profile: (1..=4u16)
                    .map(|b| (b, 1_000 + 200 * u32::from(b)))
                    .collect(),
            }],
        },
    );
    s.on_event(0, join(1, "flood", 1));
    s.on_event(0, join(2, "light", 1));
    // The flood's first frame goes at once; the rest queue behind it.
    let first = s.on_event(0, frame_of(1, 1, "f1", 9_000_000));
    for i in 2..=12 {
        s.on_event(0, frame_of(i, 1, &format!("f{i}"), 9_000_000 + i));
    }
    s.on_event(0, frame_of(101, 2, "l", 9_000_000));
    // Each batch answered 2 ms after it went; held frames wait for ticks.
    let mut batches = Vec::new();
    let (mut actions, mut now) = (first, 0);
    for _ in 0..100 {
        now += 2_000;
        actions = match dispatches(&actions).into_iter().next() {
            Some(batch) => {
                batches.push(batch);
                answer_ok(&mut s, now, &actions)
            }
            None => s.on_event(now, Event::Tick),
        };
    }
    for b in &batches {
        let light = b.iter().filter(|id| **id > 100).count();
        assert!(light == 0 || light == b.len(), "a mixed batch: {batches:?}");
    }
    let order: Vec<u64> = batches.concat();
    assert_eq!(
        order.iter().position(|id| *id == 101),
        Some(1),
        "{batches:?}"
    );
    let mut all = order.clone();
    all.sort_unstable();
    let want: Vec<u64> = (1..=12).chain([101]).collect();
    assert_eq!(all, want, "each frame dispatched once: {batches:?}");
    assert!(
        batches.iter().any(|b| b.len() > 1),
        "the flood still batches: {batches:?}"
    );
    assert!(s.counters().balanced());
}

/// The actions of `event` at `now`, and whether it sent a trial.
fn step_trial(s: &mut Scheduler, now: Micros, event: Event) -> (Vec<Action>, bool) {
    let before = s.counters().trials;
    let a = s.on_event(now, event);
    let trial = s.counters().trials > before;
    (a, trial)
}

#[test]
fn an_estimate_too_slow_for_every_frame_is_put_to_the_test_once_a_second_until_it_is_right() {
    // The worker registered 100 ms a frame (profiled while its host was
    // busy) and really runs in 20 ms; a camera's frames have 60 ms left
    // on arrival, 10 a second.
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, worker(1, 1, 100_000));
    let mut trials = Vec::new();
    let mut first_served = None;
    let mut t = 0;
    for id in 1..=100u64 {
        let (a, trial) = step_trial(&mut s, t, frame(id, "c", t + 60_000));
        if trial {
            trials.push(t);
        }
        if dispatches(&a).is_empty() {
            assert!(
                first_served.is_none(),
                "frame {id} shed after frames were served"
            );
            assert_eq!(
                completes(&a),
                vec![(id, Status::Shed(ShedReason::WouldMissDeadline))]
            );
        } else {
            // alone, and answered in the worker's real 20 ms
            assert_eq!(dispatches(&a), vec![vec![id]]);
            if !trial && first_served.is_none() {
                first_served = Some(t);
            }
            finish_dispatched(&mut s, t + 20_000, &a);
        }
        t += 100_000;
    }
    // Not before the registered profile has had a second to be right,
    // then no two trials within a second (the last returned batch counts
    // as tested): 1.0, 2.1, 3.2, 4.3 s; 100 → 84 → 71 → 61 → 53 ms.
    assert_eq!(trials, vec![1_000_000, 2_100_000, 3_200_000, 4_300_000]);
    assert_eq!(
        first_served,
        Some(4_400_000),
        "the estimate fits 60 ms after 4 trials"
    );
    assert!(learned(&s, 1) < 30_000, "{}", learned(&s, 1));
    let c = s.counters();
    assert_eq!(c.trials, 4);
    assert_eq!(c.ok, 4 + 56);
    assert_eq!(c.shed, 40);
    assert!(c.balanced());
}

#[test]
fn a_trial_goes_only_to_an_idle_serving_worker_and_never_for_a_frame_the_queue_delays() {
    let mut s = Scheduler::new(one_deep());
    // Two workers at 100 ms; worker 1 gets a relaxed frame and keeps it.
    s.on_event(0, worker(1, 1, 100_000));
    s.on_event(0, worker(2, 1, 100_000));
    let a = s.on_event(0, frame(1, "a", 5_000_000));
    let busy = match &a[..] {
        [Action::Dispatch { worker, .. }] => *worker,
        other => panic!("expected one dispatch: {other:?}"),
    };
    let idle = if busy == WorkerId(1) {
        WorkerId(2)
    } else {
        WorkerId(1)
    };
    // A second on, a frame with 60 ms left: a trial, on the idle worker.
    let (tried, trial) = step_trial(&mut s, 1_000_000, frame(2, "b", 1_060_000));
    assert!(trial);
    assert!(
        matches!(&tried[..], [Action::Dispatch { worker, frames, .. }] if *worker == idle && frames == &vec![FrameId(2)]),
        "{tried:?}"
    );
    // Both workers busy now: the next such frame is shed.
    let (a, trial) = step_trial(&mut s, 1_100_000, frame(3, "c", 1_160_000));
    assert!(!trial);
    assert_eq!(
        completes(&a),
        vec![(3, Status::Shed(ShedReason::WouldMissDeadline))]
    );
    // The trial answered, its worker draining: no trial for it either,
    // however long since.
    finish_dispatched(&mut s, 1_150_000, &tried);
    s.on_event(1_200_000, Event::WorkerDraining { worker: idle });
    let (a, trial) = step_trial(&mut s, 3_000_000, frame(4, "d", 3_060_000));
    assert!(!trial, "{a:?}");
    assert_eq!(
        completes(&a),
        vec![(4, Status::Shed(ShedReason::WouldMissDeadline))]
    );
    // A frame an idle worker could finish alone, but not behind the
    // frames queued ahead of it, is the queue's to shed: no trial.
    let mut s = Scheduler::new(one_deep());
    s.on_event(0, worker(1, 1, 10_000));
    let a = s.on_event(2_000_000, frame(10, "a", 2_500_000));
    assert_eq!(dispatches(&a), vec![vec![10]]);
    // Each queued frame just makes it behind the ones before it.
    for (id, cam, deadline) in [
        (11, "b", 2_021_000),
        (12, "c", 2_031_000),
        (13, "d", 2_041_000),
    ] {
        let a = s.on_event(2_000_000, frame(id, cam, deadline));
        assert!(completes(&a).is_empty(), "{a:?}");
    }
    let (a, trial) = step_trial(&mut s, 2_000_000, frame(14, "e", 2_045_000));
    assert!(!trial);
    assert_eq!(
        capacity(&a),
        vec![(14, true)],
        "shed for the queue ahead, which a rate hint could cure"
    );
    assert!(s.counters().balanced());
}
