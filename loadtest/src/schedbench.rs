//! Cost of the pure scheduler: decisions per second with a given number of
//! frames queued. No sockets and no clock: events are fed on a synthetic
//! clock that advances 1 µs per event, so only the scheduler's own work is
//! timed (and the batch run times it measures on that clock are a few µs).
//!
//! Two kinds of decision are timed separately:
//! - **arrival**: a camera's new frame arrives; the scheduler checks that it
//!   can still make its deadline behind the queue, supersedes the camera's
//!   queued frame and queues it (the queue length stays constant);
//! - **completion**: a worker returns a batch; the scheduler accounts for it
//!   and dispatches the next batch (up to 8 frames) from the queue, which is
//!   then topped up again outside the timed section.

use std::time::Instant;

use serde::Serialize;
use tidegate_gateway::scheduler::{
    Action, Arrival, BatchId, EdgeId, Event, FrameId, Micros, Scheduler, Settings, WorkerId,
    WorkerModel,
};
use tidegate_protocol::Status;

/// One measured configuration.
#[derive(Debug, Clone, Serialize)]
pub struct SchedResult {
    /// Frames queued while measuring.
    pub queued: usize,
    /// Registered workers.
    pub workers: usize,
    /// Median cost of an arrival decision (ns), over the samples.
    pub arrival_ns: f64,
    /// Arrival decisions per second (1e9 / arrival_ns).
    pub arrivals_per_s: f64,
    /// Median cost of a completion + dispatch decision (ns).
    pub completion_ns: f64,
    /// Completion decisions per second.
    pub completions_per_s: f64,
}

const MODEL: &str = "m";
const DEADLINE_US: Micros = 3_600_000_000;

struct Bench {
    s: Scheduler,
    now: Micros,
    next_frame: u64,
    cameras: usize,
    /// Cameras below this index had their frame dispatched at setup.
    first_queued: usize,
    /// Batches in flight: (worker, batch, frames).
    in_flight: Vec<(WorkerId, BatchId, Vec<FrameId>)>,
}

impl Bench {
    fn new(queued: usize, workers: usize) -> Self {
        let mut s = Scheduler::new(Settings {
            max_queued: queued * 2 + 64,
            max_queued_per_edge: queued * 2 + 64,
            default_latency_us: 5_000,
            pipeline_depth: 1,
            ..Settings::default()
        });
        for w in 0..workers {
            s.on_event(
                0,
                Event::WorkerJoined {
                    worker: WorkerId(w as u64),
                    models: vec![WorkerModel {
                        model: MODEL.into(),
                        max_batch: 8,
                        profile: (1..=8).map(|b| (b, 2_000 + 500 * b as u32)).collect(),
                    }],
                },
            );
        }
        let mut b = Bench {
            s,
            now: 1,
            next_frame: 0,
            cameras: 0,
            first_queued: 0,
            in_flight: Vec::new(),
        };
        // Deadlines grow with arrival, so EDF order is arrival order: the
        // first cameras' frames go to the idle workers, the rest queue.
        while b.s.queue_len(MODEL) < queued {
            b.arrive(b.cameras);
            b.cameras += 1;
        }
        b.first_queued = b.in_flight.iter().map(|(_, _, f)| f.len()).sum();
        b
    }

    /// A new frame for camera `cam` (edges of 100 cameras each).
    fn arrive(&mut self, cam: usize) {
        let id = FrameId(self.next_frame);
        self.next_frame += 1;
        self.now += 1;
        let actions = self.s.on_event(
            self.now,
            Event::FrameArrived(Arrival {
                id,
                edge: EdgeId((cam / 100) as u64),
                camera: format!("c{}", cam % 100),
                model: MODEL.into(),
                deadline: self.now + DEADLINE_US,
                age: 0,
            }),
        );
        self.collect(actions);
    }

    fn collect(&mut self, actions: Vec<Action>) {
        for a in actions {
            if let Action::Dispatch {
                worker,
                batch,
                frames,
                ..
            } = a
            {
                self.in_flight.push((worker, batch, frames));
            }
        }
    }
}

/// Measures `queued` frames with `workers` workers: `samples` samples of
/// `per_sample` decisions of each kind.
pub fn run(queued: usize, workers: usize, samples: usize, per_sample: usize) -> SchedResult {
    let mut b = Bench::new(queued, workers);
    // Arrivals: each supersedes the camera's queued frame.
    let mut arrival = Vec::with_capacity(samples);
    let mut cam = 0;
    for _ in 0..samples {
        let t = Instant::now();
        for _ in 0..per_sample {
            // Cameras that are queued, not in flight.
            b.arrive(b.first_queued + cam % queued);
            cam += 1;
        }
        arrival.push(t.elapsed().as_nanos() as f64 / per_sample as f64);
    }
    // Completions: finish a batch, the scheduler dispatches the next one;
    // top the queue up again untimed.
    let mut completion = Vec::with_capacity(samples);
    for _ in 0..samples {
        let mut timed = 0u128;
        for _ in 0..per_sample {
            let (worker, batch, frames) = b.in_flight.remove(0);
            let outcomes = frames.into_iter().map(|f| (f, Status::Ok)).collect();
            b.now += 1;
            let t = Instant::now();
            let actions = b.s.on_event(
                b.now,
                Event::BatchFinished {
                    worker,
                    batch,
                    outcomes,
                },
            );
            timed += t.elapsed().as_nanos();
            b.collect(actions);
            while b.s.queue_len(MODEL) < queued {
                b.arrive(b.cameras);
                b.cameras += 1;
            }
        }
        completion.push(timed as f64 / per_sample as f64);
    }
    assert!(b.s.counters().balanced());
    assert_eq!(b.s.queue_len(MODEL), queued, "the queue kept its length");
    let arrival_ns = crate::median(&arrival);
    let completion_ns = crate::median(&completion);
    SchedResult {
        queued,
        workers,
        arrival_ns,
        arrivals_per_s: 1e9 / arrival_ns,
        completion_ns,
        completions_per_s: 1e9 / completion_ns,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bench_keeps_its_queue_length_and_accounting() {
        let r = run(100, 2, 2, 50);
        assert_eq!(r.queued, 100);
        assert!(r.arrival_ns > 0.0 && r.completion_ns > 0.0);
    }
}
