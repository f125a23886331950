//! A queueing model of serving, for the simulator: one model's frames wait
//! in a deadline-ordered queue and are dispatched in batches to pools of
//! identical workers, as the gateway's scheduler does, in virtual time.
//!
//! Model (stated so its results can be judged):
//! * **Time** advances in slots of `slot_us` (5 ms by default in the
//!   simulator). Frames arriving within a slot form a *cohort*: a count
//!   spread uniformly over the slot. Nothing is simulated frame by frame, so
//!   a week at hundreds of workers runs in about ten seconds.
//! * **Arrivals**: the caller gives the frames of each interval (the
//!   simulator's 10 s step); they are spread over its slots either as a
//!   Poisson process conditioned on that count (a multinomial over the
//!   slots: binomial draws from a seeded SplitMix64, normal-approximated
//!   when a slot expects 30 frames or more) or evenly
//!   ([`Arrivals`]). The interval's count is kept exactly.
//! * **Deadline**: a frame must finish its batch by arrival + budget −
//!   network. Its latency is network + wait + batch time, and it is within
//!   the SLO when that is at most the budget. The queue is first in, first
//!   out, which is earliest deadline first since every frame has the same
//!   budget.
//! * **Workers**: a pool per instance type, each worker running one batch
//!   at a time; a batch of `b` takes `launch + b × frame` ([`BatchCost`]).
//!   At each slot boundary the free workers take batches: a worker that
//!   frees within the next slot is given its batch at the boundary, from
//!   the frames queued by then, and starts it when it frees (the gateway
//!   sends a busy worker its next batch just before it frees). Workers that
//!   free within the same slot are merged and start at their mean free time,
//!   so a pool's busy time is kept, not rounded to slots.
//! * **Batching**: as the gateway's scheduler, a batch takes what is queued
//!   up to the largest batch that still meets the oldest queued frame's
//!   deadline (and `max_batch`). The queue is spread evenly over the
//!   workers free at a boundary, as the gateway, giving each worker what
//!   has queued when it frees, spreads continuous arrivals. Unlike the
//!   gateway, a short batch is not held back to fill its *target* size (the
//!   gateway holds at most the time the target takes to fill at the
//!   arrival rate, under a millisecond at the simulator's rates); frames
//!   wait at most to the next slot boundary instead.
//! * **Shedding**: a frame that cannot make its deadline even alone on the
//!   soonest free worker is shed before dispatch; a frame still queued when
//!   its deadline passes is shed; with `max_queued`, a frame arriving to a
//!   full queue is refused (shed). A batch may run longer than planned by up
//!   to `batch_jitter` (uniform, one draw per group of equal batches); a
//!   frame it makes finish past the budget is *late*.
//!
//! Accounting is exact: every frame that arrives is, once, within the SLO,
//! late or shed, or still queued ([`ModelQueue::queued`]).

use std::collections::VecDeque;

use serde::Serialize;

use crate::trace::SplitMix64;

mod cost;
mod latency;

pub use self::cost::BatchCost;
pub use self::latency::LatencyHistogram;

/// Microseconds of virtual time.
pub type Micros = u64;

/// Why a queue model could not be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum QueueError {
    /// A batch cost that cannot describe a worker.
    #[error(
        "batch cost launch {launch_us} µs, {frame_us} µs per frame, max batch {max_batch}: \
         the per-frame time must be finite and above 0, the launch finite and at least 0, \
         and the max batch at least 1"
    )]
    BadCost {
        /// Fixed time per batch.
        launch_us: f64,
        /// Time per frame.
        frame_us: f64,
        /// Largest batch.
        max_batch: u32,
    },
    /// A latency profile too short or inconsistent to fit.
    #[error(
        "latency profile {0}; give (batch, latency µs) points at two or more batch sizes, e.g. 1:1200,2:2300,4:4600"
    )]
    BadProfile(String),
    /// A configuration value out of range.
    #[error("queue model: {0}")]
    BadConfig(String),
}

/// How the frames of an interval are spread over its slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Arrivals {
    /// A Poisson process conditioned on the interval's count (uniform
    /// arrival times: a multinomial over the slots).
    Poisson,
    /// Evenly spaced.
    Even,
}

/// The queue model's parameters.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueueConfig {
    /// End-to-end latency budget, µs.
    pub budget_us: Micros,
    /// Network and return time taken from the budget, µs.
    pub network_us: Micros,
    /// Time resolution, µs: dispatch happens at slot boundaries.
    pub slot_us: Micros,
    /// How arrivals are spread within an interval.
    pub arrivals: Arrivals,
    /// Most frames queued at once (the gateway's `max_queued`); None: only
    /// the deadline bounds the queue.
    pub max_queued: Option<u64>,
    /// A batch runs up to this fraction longer or shorter than its cost
    /// says (uniform), 0 ≤ jitter < 1.
    pub batch_jitter: f64,
}

impl QueueConfig {
    /// The scheduler's defaults for a budget and network margin (ms).
    pub fn new(budget_ms: f64, network_ms: f64) -> QueueConfig {
        QueueConfig {
            budget_us: (budget_ms * 1000.0).round().max(0.0) as Micros,
            network_us: (network_ms * 1000.0).round().max(0.0) as Micros,
            slot_us: 5_000,
            arrivals: Arrivals::Poisson,
            max_queued: None,
            batch_jitter: 0.0,
        }
    }

    /// Checks the ranges.
    pub fn validate(&self) -> Result<(), QueueError> {
        let bad = |what: String| Err(QueueError::BadConfig(what));
        if self.network_us >= self.budget_us {
            return bad(format!(
                "network {} µs must be below the budget {} µs",
                self.network_us, self.budget_us
            ));
        }
        if self.slot_us == 0 || self.slot_us > self.budget_us - self.network_us {
            return bad(format!(
                "slot {} µs must be at least 1 and at most budget − network ({} µs); 1000–5000 suits GPU batches",
                self.slot_us,
                self.budget_us - self.network_us
            ));
        }
        if !(0.0..1.0).contains(&self.batch_jitter) {
            return bad(format!(
                "batch jitter {} must be within 0 ≤ jitter < 1 (0.05 is ±5%)",
                self.batch_jitter
            ));
        }
        Ok(())
    }

    fn deadline_us(&self) -> f64 {
        (self.budget_us - self.network_us) as f64
    }
}

/// What one pool did over an interval.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolStep {
    /// The pool (instance type).
    pub name: String,
    /// Frames dispatched to it (within the SLO or late).
    pub served: u64,
    /// Summed run time of its batches, µs (worker-µs).
    pub run_us: f64,
    /// Batches dispatched.
    pub batches: u64,
}

/// What happened over one [`ModelQueue::advance`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepOutcome {
    /// Frames that arrived.
    pub arrived: u64,
    /// Frames served within the budget.
    pub within_slo: u64,
    /// Frames served past the budget.
    pub late: u64,
    /// Frames shed (refused, would miss, or expired in the queue).
    pub shed: u64,
    /// Per pool.
    pub pools: Vec<PoolStep>,
    /// Frames queued at the end.
    pub queued: u64,
    /// Most frames queued at any slot boundary.
    pub max_queued: u64,
    /// Least time any dispatched frame waited, µs (never negative: no frame
    /// is served before it arrives); None if none was dispatched.
    pub min_wait_us: Option<f64>,
}

/// Frames that arrived uniformly over `(from, to]`.
#[derive(Debug, Clone, Copy)]
struct Cohort {
    from: f64,
    to: f64,
    count: u64,
    /// Frames per µs, and µs per frame: kept through splits (the frames
    /// stay uniform), so that splitting needs no division.
    density: f64,
    spacing: f64,
}

impl Cohort {
    fn new(from: f64, to: f64, count: u64) -> Cohort {
        let span = (to - from).max(f64::MIN_POSITIVE);
        Cohort {
            from,
            to,
            count,
            density: count as f64 / span,
            spacing: span / count.max(1) as f64,
        }
    }

    /// How many arrived before `x` (rounded).
    fn before(&self, x: f64) -> u64 {
        if x <= self.from {
            0
        } else if x >= self.to {
            self.count
        } else {
            (((x - self.from) * self.density + 0.5) as u64).min(self.count)
        }
    }

    /// Splits off the `n` earliest; `self` keeps the rest.
    fn split_front(&mut self, n: u64) -> Cohort {
        let n = n.min(self.count);
        let at = if n == self.count {
            self.to
        } else {
            (self.from + n as f64 * self.spacing).min(self.to)
        };
        let front = Cohort {
            from: self.from,
            to: at,
            count: n,
            ..*self
        };
        self.from = at;
        self.count -= n;
        front
    }
}

/// Workers freeing within one slot: how many, and their summed offset
/// from the slot's start (µs).
#[derive(Debug, Clone, Copy, Default)]
struct Freeing {
    count: u64,
    offset_sum: f64,
}

/// Identical workers of one type.
#[derive(Debug, Clone)]
struct Pool {
    name: String,
    cost: BatchCost,
    size: u64,
    idle: u64,
    /// Front: workers freeing within the slot after the last boundary.
    busy: VecDeque<Freeing>,
    /// The batch admission counts on: the largest that runs within half of
    /// budget − network (as the autoscaler sizes workers), else within all
    /// of it; 0 if not even one frame does.
    admit: u64,
    /// Run time of the admission batch, µs.
    admit_us: f64,
    /// Frames per µs of one worker at the admission batch.
    admit_rate: f64,
    step: PoolStep,
}

impl Pool {
    /// `n` workers free at `at` (µs): counted in the slot holding it, or the
    /// one after `boundary` if that is later.
    fn free_at(&mut self, boundary: u64, slot: f64, at: f64, n: u64) {
        if n == 0 {
            return;
        }
        let next = boundary + 1;
        let j = ((at.max(0.0) / slot) as u64).max(next);
        let offset = (at - j as f64 * slot).max(0.0);
        let idx = (j - next) as usize;
        if self.busy.len() <= idx {
            self.busy.resize(idx + 1, Freeing::default());
        }
        self.busy[idx].count += n;
        self.busy[idx].offset_sum += offset * n as f64;
    }

    fn remove(&mut self, mut n: u64) {
        let idle = n.min(self.idle);
        self.idle -= idle;
        n -= idle;
        // then the workers busy longest: their batches still finish (the
        // frames are counted already), but they take no more
        for f in self.busy.iter_mut().rev() {
            if n == 0 {
                break;
            }
            let k = n.min(f.count);
            let mean = if f.count > 0 {
                f.offset_sum / f.count as f64
            } else {
                0.0
            };
            f.count -= k;
            f.offset_sum = mean * f.count as f64;
            n -= k;
        }
    }
}

/// A group of free workers at one boundary.
#[derive(Debug, Clone, Copy)]
struct Free {
    pool: usize,
    start: f64,
    count: u64,
    was_idle: bool,
}

/// One model's queue and the worker pools that serve it.
#[derive(Debug, Clone)]
pub struct ModelQueue {
    cfg: QueueConfig,
    rng: SplitMix64,
    /// Index of the last slot boundary processed (time = index × slot).
    boundary: u64,
    queue: VecDeque<Cohort>,
    queued: u64,
    pending: u64,
    pools: Vec<Pool>,
    free: Vec<Free>,
    tick: LatencyHistogram,
    run: LatencyHistogram,
    out: StepOutcome,
}

impl ModelQueue {
    /// An empty queue at time `start_us` (rounded down to a slot boundary),
    /// with no workers.
    pub fn new(cfg: QueueConfig, start_us: Micros, seed: u64) -> Result<ModelQueue, QueueError> {
        cfg.validate()?;
        Ok(ModelQueue {
            boundary: start_us / cfg.slot_us,
            cfg,
            rng: SplitMix64::new(seed),
            queue: VecDeque::new(),
            queued: 0,
            pending: 0,
            pools: Vec::new(),
            free: Vec::new(),
            tick: LatencyHistogram::new(),
            run: LatencyHistogram::new(),
            out: StepOutcome::empty(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &QueueConfig {
        &self.cfg
    }

    /// Sets the serving workers: `fleet` lists (type, cost, workers);
    /// a pool not listed keeps no worker. Added workers are idle; removed
    /// ones are taken idle first, then those busy longest (their batches
    /// still finish).
    pub fn set_fleet(&mut self, fleet: &[(&str, BatchCost, u64)]) {
        for p in &mut self.pools {
            if !fleet.iter().any(|(n, _, _)| *n == p.name) && p.size > 0 {
                p.remove(p.size);
                p.size = 0;
            }
        }
        for &(name, cost, n) in fleet {
            let i = match self.pools.iter().position(|p| p.name == name) {
                Some(i) => i,
                None => {
                    self.pools.push(Pool {
                        name: name.to_string(),
                        cost,
                        size: 0,
                        idle: 0,
                        busy: VecDeque::new(),
                        admit: 0,
                        admit_us: 0.0,
                        admit_rate: 0.0,
                        step: PoolStep::new(name),
                    });
                    self.pools.len() - 1
                }
            };
            let deadline = self.cfg.deadline_us();
            let p = &mut self.pools[i];
            p.cost = cost;
            p.admit = match cost.fit(deadline / 2.0) {
                0 => cost.fit(deadline),
                b => b,
            };
            p.admit_us = cost.latency_us(p.admit);
            p.admit_rate = cost.throughput_fps(p.admit) / 1e6;
            if n >= p.size {
                p.idle += n - p.size;
            } else {
                p.remove(p.size - n);
            }
            p.size = n;
        }
    }

    /// Frames waiting now.
    pub fn queued(&self) -> u64 {
        self.queued + self.pending
    }

    /// Workers in the fleet.
    pub fn workers(&self) -> u64 {
        self.pools.iter().map(|p| p.size).sum()
    }

    /// Latencies of the frames served since the last call, then cleared
    /// (they stay counted in [`ModelQueue::run_latency`]).
    pub fn take_tick_latency(&mut self) -> LatencyHistogram {
        self.run.merge(&self.tick);
        let h = self.tick.clone();
        self.tick.clear();
        h
    }

    /// Latencies of every frame served, up to the last
    /// [`ModelQueue::take_tick_latency`].
    pub fn run_latency(&self) -> &LatencyHistogram {
        &self.run
    }

    /// Advances to `until_us` (rounded down to a slot boundary): `arrivals`
    /// frames arrive over the interval. Frames given for an interval shorter
    /// than a slot wait for the next call.
    pub fn advance(&mut self, until_us: Micros, arrivals: u64) -> StepOutcome {
        self.out = StepOutcome::empty();
        self.out.arrived = arrivals;
        let end = until_us / self.cfg.slot_us;
        let slots = end.saturating_sub(self.boundary);
        let total = arrivals + self.pending;
        if slots == 0 {
            self.pending = total;
            return self.finish_step();
        }
        self.pending = 0;
        let mut left = total;
        // even: `base` a slot and one more in `extra` of them (Bresenham)
        let (base, extra) = (total / slots, total % slots);
        let mut err = 0;
        // the spread of a slot's count, about constant over the interval
        let sd = (total as f64 / slots as f64).sqrt();
        for i in 0..slots {
            let c = match self.cfg.arrivals {
                Arrivals::Even => {
                    err += extra;
                    let one = err >= slots;
                    if one {
                        err -= slots;
                    }
                    base + u64::from(one)
                }
                Arrivals::Poisson if i + 1 == slots => left,
                Arrivals::Poisson => self.binomial(left, 1.0 / (slots - i) as f64, sd),
            };
            left -= c;
            self.boundary += 1;
            self.arrive(c);
            self.dispatch();
        }
        self.finish_step()
    }

    /// Advances with no arrivals until the queue is empty (at most the
    /// deadline plus two slots), so that every frame is accounted for.
    pub fn drain(&mut self) -> StepOutcome {
        let slot = self.cfg.slot_us;
        let until = (self.boundary + 2) * slot + self.cfg.budget_us - self.cfg.network_us;
        self.advance(until, 0)
    }

    fn finish_step(&mut self) -> StepOutcome {
        let mut out = std::mem::replace(&mut self.out, StepOutcome::empty());
        out.queued = self.queued();
        out.max_queued = out.max_queued.max(out.queued);
        out.pools = self.pools.iter().map(|p| p.step.clone()).collect();
        for p in &mut self.pools {
            p.step = PoolStep::new(&p.name);
        }
        out
    }

    fn now(&self) -> f64 {
        (self.boundary * self.cfg.slot_us) as f64
    }

    /// Frames of the slot ending at the current boundary join the queue,
    /// as many as the admission room and `max_queued` allow; the rest (the
    /// latest of the slot) are shed on arrival.
    fn arrive(&mut self, c: u64) {
        let slot = self.cfg.slot_us as f64;
        let from = self.now() - slot;
        let room = self.admission_room(from + self.cfg.deadline_us());
        let mut accept = c.min(room.saturating_sub(self.queued));
        if let Some(max) = self.cfg.max_queued {
            accept = accept.min(max.saturating_sub(self.queued));
        }
        self.out.shed += c - accept;
        if accept > 0 {
            let to = from + slot * accept as f64 / c as f64;
            self.queue.push_back(Cohort::new(from, to, accept));
            self.queued += accept;
        }
        self.out.max_queued = self.out.max_queued.max(self.queued);
    }

    /// How many frames may be queued ahead of one due at `deadline` (µs)
    /// and still be served by then: per pool, from when its first worker
    /// frees, at the throughput of its admission batch, leaving that
    /// batch's run time. 0 without workers.
    fn admission_room(&self, deadline: f64) -> u64 {
        let now = self.now();
        let slot = self.cfg.slot_us as f64;
        let mut room = 0.0;
        for p in self.pools.iter().filter(|p| p.size > 0 && p.admit > 0) {
            let free_at = if p.idle > 0 {
                now
            } else {
                p.busy
                    .iter()
                    .enumerate()
                    .find(|(_, f)| f.count > 0)
                    .map_or(now, |(i, f)| {
                        (self.boundary + i as u64) as f64 * slot + f.offset_sum / f.count as f64
                    })
                    .max(now)
            };
            let left = deadline - free_at - p.admit_us;
            if left > 0.0 {
                room += p.size as f64 * p.admit_rate * left;
            }
        }
        room.floor() as u64
    }

    /// Sheds every queued frame that arrived before `x`.
    fn shed_before(&mut self, x: f64) {
        while let Some(head) = self.queue.front_mut() {
            let n = head.before(x);
            if n >= head.count {
                self.out.shed += head.count;
                self.queued -= head.count;
                self.queue.pop_front();
                continue;
            }
            if head.from < x {
                head.split_front(n);
                head.from = x;
                self.out.shed += n;
                self.queued -= n;
            }
            break;
        }
    }

    /// The free workers at the current boundary take batches.
    fn dispatch(&mut self) {
        let now = self.now();
        let deadline = self.cfg.deadline_us();
        // a frame whose deadline has passed is gone
        self.shed_before(now - deadline);
        self.free.clear();
        for (i, p) in self.pools.iter_mut().enumerate() {
            let f = p.busy.pop_front().unwrap_or_default();
            if p.idle > 0 {
                self.free.push(Free {
                    pool: i,
                    start: now,
                    count: p.idle,
                    was_idle: true,
                });
            }
            if f.count > 0 {
                self.free.push(Free {
                    pool: i,
                    start: now + f.offset_sum / f.count as f64,
                    count: f.count,
                    was_idle: false,
                });
            }
        }
        if self.free.is_empty() {
            return;
        }
        // the soonest finish of one frame first
        let pools = &self.pools;
        self.free.sort_unstable_by(|a, b| {
            let fa = a.start + pools[a.pool].cost.latency_us(1);
            let fb = b.start + pools[b.pool].cost.latency_us(1);
            fa.total_cmp(&fb)
        });
        let workers: u64 = self.free.iter().map(|f| f.count).sum();
        let first = self.free[0];
        // frames that cannot make it even alone on the soonest worker
        let best = first.start + self.pools[first.pool].cost.latency_us(1);
        self.shed_before(best - deadline);
        let share = self.queued.div_ceil(workers.max(1));
        for k in 0..self.free.len() {
            let f = self.free[k];
            let used = self.serve_group(f, share);
            let p = &mut self.pools[f.pool];
            if f.was_idle {
                p.idle -= used;
            } else {
                // freed with nothing to take: idle from the next boundary
                p.idle += f.count - used;
            }
        }
    }

    /// One group of free workers takes batches; returns how many it used.
    fn serve_group(&mut self, f: Free, share: u64) -> u64 {
        let deadline = self.cfg.deadline_us();
        let cost = self.pools[f.pool].cost;
        let mut used = 0;
        // at most two rounds: equal batches, then the remainder
        for _ in 0..2 {
            let Some(head) = self.queue.front() else {
                break;
            };
            if used == f.count {
                break;
            }
            let fit = cost.fit(head.from + deadline - f.start);
            if fit == 0 {
                break; // left for a sooner worker, or shed at the next boundary
            }
            let b = fit.min(share.max(1));
            let full = (f.count - used).min(self.queued / b);
            let (workers, size) = if full > 0 {
                (full, b)
            } else {
                (1, self.queued.min(b))
            };
            self.run_batches(f, workers, size);
            used += workers;
        }
        used
    }

    /// `workers` workers of group `f` each take a batch of `size` from the
    /// head of the queue, starting at `f.start`.
    fn run_batches(&mut self, f: Free, workers: u64, size: u64) {
        let cfg = &self.cfg;
        let planned = self.pools[f.pool].cost.latency_us(size);
        let run = if cfg.batch_jitter > 0.0 {
            planned * (1.0 + cfg.batch_jitter * (2.0 * self.rng.unit() - 1.0))
        } else {
            planned
        };
        let net = cfg.network_us as f64;
        let budget = cfg.budget_us as f64;
        // frames that arrived before this finish past the budget
        let late_cut = f.start + run + net - budget;
        let mut take = workers * size;
        while take > 0 {
            let Some(head) = self.queue.front_mut() else {
                break;
            };
            let part = head.split_front(take);
            if head.count == 0 {
                self.queue.pop_front();
            }
            take -= part.count;
            self.queued -= part.count;
            let wait_min = f.start - part.to;
            self.out.min_wait_us = Some(self.out.min_wait_us.map_or(wait_min, |m| m.min(wait_min)));
            let mut part = part;
            let late = part.before(late_cut);
            if late > 0 {
                let l = part.split_front(late);
                self.tick
                    .add(net + f.start - (l.from + l.to) / 2.0 + run, l.count);
                self.out.late += l.count;
            }
            if part.count > 0 {
                self.tick.add(
                    net + f.start - (part.from + part.to) / 2.0 + run,
                    part.count,
                );
                self.out.within_slo += part.count;
            }
        }
        let served = workers * size - take;
        let p = &mut self.pools[f.pool];
        p.step.served += served;
        p.step.run_us += run * workers as f64;
        p.step.batches += workers;
        // When they free. The group stands for workers that freed across a
        // slot, merged at their mean: they free again spread the same way,
        // over a slot around start + run, so that merging does not lock them
        // into step (a clump taking the whole queue at once). One worker
        // frees at its own time. Never in the slot being dispatched.
        let slot = self.cfg.slot_us as f64;
        let free_at = f.start + run;
        if workers == 1 {
            p.free_at(self.boundary, slot, free_at, 1);
        } else {
            let lo = free_at - slot / 2.0;
            let split = ((lo / slot) as u64 + 1) as f64 * slot;
            let first = ((workers as f64 * (split - lo) / slot + 0.5) as u64).min(workers);
            p.free_at(self.boundary, slot, (lo + split) / 2.0, first);
            p.free_at(
                self.boundary,
                slot,
                (split + lo + slot) / 2.0,
                workers - first,
            );
        }
    }

    /// Binomial(n, p): inversion for small means, else normal with
    /// standard deviation `sd` (the caller's, nearly constant over an
    /// interval, so that no square root is taken per slot).
    fn binomial(&mut self, n: u64, p: f64, sd: f64) -> u64 {
        if n == 0 || p <= 0.0 {
            return 0;
        }
        if p >= 1.0 {
            return n;
        }
        let mean = n as f64 * p;
        if mean < 30.0 {
            let q = 1.0 - p;
            let u = self.rng.unit();
            let mut pr = q.powf(n as f64);
            let mut cdf = pr;
            let mut k = 0u64;
            let cap = (mean + 40.0 * mean.sqrt() + 40.0) as u64;
            while u > cdf && k < n && k < cap {
                pr *= (n - k) as f64 / (k + 1) as f64 * p / q;
                k += 1;
                cdf += pr;
            }
            return k;
        }
        let z = self.normal();
        let x = (mean + z * sd + 0.5).max(0.0) as u64;
        x.min(n)
    }

    /// About standard normal: the sum of four uniforms (16 bits each, from
    /// one draw), centred and scaled (Irwin–Hall; tails end at ±3.46σ,
    /// enough to spread arrivals, and cheap at a draw per slot).
    fn normal(&mut self) -> f64 {
        let r = self.rng.next_u64();
        let sum: u64 = (0..4).map(|k| (r >> (16 * k)) & 0xFFFF).sum();
        (sum as f64 / 65_536.0 - 2.0) * 3f64.sqrt()
    }
}

impl PoolStep {
    fn new(name: &str) -> PoolStep {
        PoolStep {
            name: name.to_string(),
            served: 0,
            run_us: 0.0,
            batches: 0,
        }
    }
}

impl StepOutcome {
    fn empty() -> StepOutcome {
        StepOutcome {
            arrived: 0,
            within_slo: 0,
            late: 0,
            shed: 0,
            pools: Vec::new(),
            queued: 0,
            max_queued: 0,
            min_wait_us: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The simulator's H100 for the default workload: 2 ms launch,
    /// 0.928 ms a frame.
    fn h100() -> BatchCost {
        BatchCost::new(2_000.0, 928.0, 64).unwrap()
    }

    fn cfg() -> QueueConfig {
        QueueConfig::new(80.0, 20.0)
    }

    /// Runs `steps` intervals of `step_us` at `fps`; returns the summed
    /// outcome (pools summed by name order) and the queue.
    fn run(
        cfg: QueueConfig,
        fleet: &[(&str, BatchCost, u64)],
        fps: f64,
        step_us: u64,
        steps: u64,
    ) -> (Totals, ModelQueue) {
        let mut q = ModelQueue::new(cfg, 0, 7).unwrap();
        q.set_fleet(fleet);
        let mut t = Totals::default();
        let per = (fps * step_us as f64 / 1e6).round() as u64;
        for s in 1..=steps {
            t.add(&q.advance(s * step_us, per));
        }
        t.add(&q.drain());
        q.take_tick_latency();
        (t, q)
    }

    #[derive(Debug, Default)]
    struct Totals {
        arrived: u64,
        within: u64,
        late: u64,
        shed: u64,
        served: u64,
        run_us: f64,
        max_queued: u64,
        min_wait_us: f64,
    }

    impl Totals {
        fn add(&mut self, o: &StepOutcome) {
            if self.arrived == 0 && self.served == 0 {
                self.min_wait_us = f64::INFINITY;
            }
            self.arrived += o.arrived;
            self.within += o.within_slo;
            self.late += o.late;
            self.shed += o.shed;
            self.served += o.pools.iter().map(|p| p.served).sum::<u64>();
            self.run_us += o.pools.iter().map(|p| p.run_us).sum::<f64>();
            self.max_queued = self.max_queued.max(o.max_queued);
            if let Some(w) = o.min_wait_us {
                self.min_wait_us = self.min_wait_us.min(w);
            }
        }
    }

    #[test]
    fn a_profile_fit_recovers_launch_and_per_frame_time_and_caps_at_the_best_batch() {
        let pts: Vec<(u32, f64)> = [1u32, 2, 4, 8, 16]
            .iter()
            .map(|&b| (b, 500.0 + 1000.0 * f64::from(b)))
            .collect();
        let c = BatchCost::fit_profile(&pts).unwrap();
        assert!((c.launch_us - 500.0).abs() < 1e-6, "{c:?}");
        assert!((c.frame_us - 1000.0).abs() < 1e-6, "{c:?}");
        assert_eq!(c.max_batch, 16);
        // a CPU where larger batches are slower per frame: the best is 1
        let cpu = BatchCost::fit_profile(&[(1, 1000.0), (2, 2100.0), (4, 4400.0)]).unwrap();
        assert_eq!(
            (cpu.launch_us, cpu.frame_us, cpu.max_batch),
            (0.0, 1000.0, 1)
        );
        // points past the best batch do not bend the fit
        let gpu =
            BatchCost::fit_profile(&[(1, 3.0e3), (2, 4.0e3), (4, 6.0e3), (8, 40.0e3)]).unwrap();
        assert_eq!(gpu.max_batch, 4);
        assert!((gpu.frame_us - 1000.0).abs() < 1e-6 && (gpu.launch_us - 2000.0).abs() < 1e-6);
    }

    #[test]
    fn bad_profiles_costs_and_configs_are_refused_with_the_reason() {
        let e = BatchCost::fit_profile(&[(1, 1000.0)]).unwrap_err();
        assert!(e.to_string().contains("two or more batch sizes"), "{e}");
        assert!(BatchCost::fit_profile(&[(1, 1000.0), (2, 900.0)]).is_err());
        assert!(BatchCost::fit_profile(&[(0, 1000.0), (2, 2000.0)]).is_err());
        assert!(BatchCost::new(0.0, 0.0, 4).is_err());
        assert!(BatchCost::new(1.0, 1.0, 0).is_err());
        let mut c = cfg();
        c.network_us = c.budget_us;
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("below the budget")
        );
        let mut c = cfg();
        c.slot_us = 0;
        assert!(c.validate().is_err());
        let mut c = cfg();
        c.batch_jitter = 1.0;
        assert!(c.validate().unwrap_err().to_string().contains("jitter"));
    }

    #[test]
    fn the_fit_is_the_largest_batch_that_runs_in_time() {
        let c = h100();
        // 1 frame in 2.928 ms; 30 in 29.84; 64 at most
        assert_eq!(c.fit(2_927.0), 0);
        assert_eq!(c.fit(2_928.0), 1);
        assert_eq!(c.fit(30_000.0), 30);
        assert_eq!(c.fit(1e9), 64);
        assert!((c.throughput_fps(30) - 1005.4).abs() < 0.1);
    }

    #[test]
    fn at_low_load_nothing_is_shed_and_latency_is_network_plus_a_short_batch() {
        // 10 H100 at 3000 fps: 30% of what they serve at the SLO
        let (t, q) = run(cfg(), &[("h100", h100(), 10)], 3_000.0, 1_000_000, 20);
        assert_eq!(t.arrived, 60_000);
        assert_eq!(t.shed, 0);
        assert_eq!(t.late, 0);
        assert_eq!(t.within, t.arrived);
        let h = q.run_latency();
        assert_eq!(h.total(), t.arrived);
        // network 20 ms + a batch of 1 (2.9 ms) at least; waits are short
        assert!(h.min_ms().unwrap() >= 20.0 + 2.928, "{:?}", h.min_ms());
        let p99 = h.quantile_ms(0.99).unwrap();
        assert!(p99 < 40.0, "p99 {p99}");
    }

    #[test]
    fn without_workers_every_frame_is_shed_on_arrival() {
        let (t, q) = run(cfg(), &[], 1_000.0, 1_000_000, 3);
        assert_eq!(t.arrived, 3_000);
        assert_eq!(t.shed, 3_000);
        assert_eq!(t.within + t.late, 0);
        assert_eq!(t.max_queued, 0);
        assert_eq!(q.queued(), 0);
    }

    #[test]
    fn frames_queued_when_the_workers_go_are_shed_by_their_deadline() {
        let mut q = ModelQueue::new(cfg(), 0, 3).unwrap();
        let slow = BatchCost::new(2_000.0, 928.0, 64).unwrap();
        q.set_fleet(&[("h100", slow, 1)]);
        // 3000 fps on one worker: a queue builds up to the admission room
        let o = q.advance(1_000_000, 3_000);
        assert!(o.queued > 0, "{o:?}");
        let before = o.queued;
        q.set_fleet(&[]);
        let o = q.advance(1_100_000, 0);
        assert_eq!(o.shed, before);
        assert_eq!(q.queued(), 0);
    }

    #[test]
    fn the_queue_holds_no_more_than_can_be_served_by_the_deadline() {
        // one worker at 10x its throughput: admission keeps the queue to
        // about (60 ms − a 30-frame batch) × 1005 fps = 30 frames
        let (t, _) = run(cfg(), &[("h100", h100(), 1)], 10_000.0, 1_000_000, 3);
        assert!(t.max_queued <= 35, "{}", t.max_queued);
        assert_eq!(t.late, 0);
        assert!(
            t.within as f64 >= 0.9 * 3.0 * h100().throughput_fps(30),
            "{t:?}"
        );
    }

    #[test]
    fn overload_sheds_the_excess_and_serves_no_more_than_capacity() {
        // 2 H100 at 4000 fps; at most one batch of 61 in 58.6 ms each
        let (t, _) = run(cfg(), &[("h100", h100(), 2)], 4_000.0, 1_000_000, 10);
        assert_eq!(t.arrived, 40_000);
        assert_eq!(t.arrived, t.within + t.late + t.shed);
        let c = h100();
        let cap = 2.0 * c.throughput_fps(64) * 10.0 + 2.0 * 64.0;
        assert!((t.served as f64) <= cap, "{} > {cap}", t.served);
        // but close to it: they are never idle with frames waiting
        assert!(
            t.served as f64 >= 0.9 * 2.0 * c.throughput_fps(30) * 10.0,
            "{}",
            t.served
        );
        assert!(t.shed > 15_000, "{}", t.shed);
        assert_eq!(t.late, 0);
    }

    #[test]
    fn a_full_queue_refuses_what_arrives() {
        let mut c = cfg();
        c.max_queued = Some(5);
        let (t, _) = run(c, &[], 1_000.0, 100_000, 5);
        assert!(t.max_queued <= 5);
        assert_eq!(t.shed, t.arrived);
    }

    #[test]
    fn jitter_makes_frames_late_and_every_frame_is_still_counted_once() {
        let mut c = cfg();
        c.batch_jitter = 0.5;
        let (t, _) = run(c, &[("h100", h100(), 2)], 1_900.0, 1_000_000, 10);
        assert!(t.late > 0, "{t:?}");
        assert_eq!(t.arrived, t.within + t.late + t.shed);
    }

    #[test]
    fn the_same_seed_gives_the_same_run() {
        let a = run(cfg(), &[("h100", h100(), 3)], 2_500.0, 500_000, 6);
        let b = run(cfg(), &[("h100", h100(), 3)], 2_500.0, 500_000, 6);
        assert_eq!(format!("{:?}", a.0), format!("{:?}", b.0));
        assert_eq!(a.1.run_latency(), b.1.run_latency());
    }

    #[test]
    fn even_arrivals_spread_the_count_exactly() {
        let mut c = cfg();
        c.arrivals = Arrivals::Even;
        let (t, _) = run(c, &[("h100", h100(), 1)], 333.0, 1_000_000, 3);
        assert_eq!(t.arrived, 999);
        assert_eq!(t.within, 999);
    }

    fn any_cost() -> impl Strategy<Value = BatchCost> {
        (0.0f64..3_000.0, 100.0f64..3_000.0, 1u32..64)
            .prop_map(|(l, f, m)| BatchCost::new(l, f, m).unwrap())
    }

    fn any_config() -> impl Strategy<Value = QueueConfig> {
        (
            prop::sample::select(vec![500u64, 1_000, 2_000, 5_000]),
            prop::option::of(0u64..400),
            0.0f64..0.5,
            any::<bool>(),
        )
            .prop_map(|(slot, max, jitter, even)| QueueConfig {
                slot_us: slot,
                max_queued: max,
                batch_jitter: jitter,
                arrivals: if even {
                    Arrivals::Even
                } else {
                    Arrivals::Poisson
                },
                ..cfg()
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// Random loads and fleets that change between steps: every frame
        /// is within the SLO, late or shed exactly once; the queue stays
        /// within its bound; no frame is served before it arrives; every
        /// latency is at least network + one batch; without jitter nothing
        /// is late; and no pool serves more than its workers can.
        #[test]
        fn every_frame_is_counted_once_and_no_bound_is_broken(
            cfg in any_config(),
            cost in any_cost(),
            steps in prop::collection::vec((0u64..12, 0.0f64..4_000.0), 1..8),
            seed in any::<u64>(),
        ) {
            let step_us = 250_000;
            let mut q = ModelQueue::new(cfg.clone(), 0, seed).unwrap();
            let mut t = Totals::default();
            let mut cap = 0.0;
            for (i, &(workers, fps)) in steps.iter().enumerate() {
                q.set_fleet(&[("w", cost, workers)]);
                let arrivals = (fps * step_us as f64 / 1e6) as u64;
                let o = q.advance((i as u64 + 1) * step_us, arrivals);
                prop_assert_eq!(
                    t.arrived + o.arrived,
                    t.within + o.within_slo + t.late + o.late + t.shed + o.shed + o.queued
                );
                if let Some(max) = cfg.max_queued {
                    prop_assert!(o.max_queued <= max, "{} > {}", o.max_queued, max);
                }
                // a worker serves at most one best batch per its run time,
                // plus the batch it may start at each fleet change
                cap += workers as f64
                    * (cost.throughput_fps(u64::from(cost.max_batch)) * step_us as f64 / 1e6
                        + f64::from(cost.max_batch) * 2.0);
                t.add(&o);
            }
            // the drain runs the last fleet up to the deadline and two slots on
            let last = steps.last().map_or(0, |s| s.0) as f64;
            let drain_us = (cfg.budget_us - cfg.network_us + 2 * cfg.slot_us) as f64;
            cap += last * cost.throughput_fps(u64::from(cost.max_batch)) * drain_us / 1e6;
            t.add(&q.drain());
            prop_assert_eq!(q.queued(), 0);
            prop_assert_eq!(t.arrived, t.within + t.late + t.shed);
            prop_assert_eq!(t.served, t.within + t.late);
            prop_assert!(t.served as f64 <= cap + 1e-9, "served {} > capacity {}", t.served, cap);
            if t.served > 0 {
                prop_assert!(t.min_wait_us >= 0.0, "served {} µs before arrival", -t.min_wait_us);
                let h = q.take_tick_latency();
                let floor = cfg.network_us as f64 + cost.latency_us(1) * (1.0 - cfg.batch_jitter);
                prop_assert!(h.min_ms().unwrap() * 1000.0 >= floor - 1e-6);
                if cfg.batch_jitter == 0.0 {
                    prop_assert_eq!(t.late, 0);
                    prop_assert!(h.max_ms().unwrap() * 1000.0 <= cfg.budget_us as f64 + 1e-6);
                }
            }
        }

        /// At a third of what the workers serve at the SLO, nothing is shed.
        #[test]
        fn at_low_load_nothing_is_shed(
            workers in 1u64..40,
            load in 0.0f64..0.33,
            seed in any::<u64>(),
        ) {
            let c = cfg();
            let cost = h100();
            // the batch that fits half of budget − network, as the autoscaler sizes
            let b = cost.fit(c.deadline_us() / 2.0);
            let fps = workers as f64 * cost.throughput_fps(b) * load;
            let mut q = ModelQueue::new(c, 0, seed).unwrap();
            q.set_fleet(&[("h100", cost, workers)]);
            let mut shed = 0;
            for s in 1..=4u64 {
                shed += q.advance(s * 500_000, (fps / 2.0) as u64).shed;
            }
            shed += q.drain().shed;
            prop_assert_eq!(shed, 0);
        }
    }
}
