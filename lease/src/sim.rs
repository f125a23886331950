//! The simulator: replays an arrival trace through the real
//! [`Autoscaler`] with a latency/throughput model, and reports cost,
//! GPU-hours, utilisation and SLO attainment.
//!
//! Model (deliberately simple, stated so results can be judged):
//! * Per-worker throughput at the SLO comes from [`Workload`]: a batch of
//!   `b` frames takes `launch_ms + b × frame_ms` on a type, where
//!   `frame_ms` adds compute (GFLOP over datasheet TFLOPS × efficiency) and
//!   memory traffic (MB over datasheet bandwidth). A frame may wait for the
//!   running batch and then run in its own, so the batch latency may use
//!   half of `budget − network`; the largest such batch gives the
//!   throughput at the SLO. A type that cannot serve one frame in time has
//!   none and is never chosen.
//! * Serving is a fluid model in 10-second steps: frames up to the ready
//!   capacity are served within the SLO (that is what "throughput at the
//!   SLO" means); the rest are shed before the GPU, as the gateway's
//!   scheduler does. Frames are integers, so `total = within_slo + shed`
//!   holds exactly.
//! * A lease bills from its acquire; it is ready `startup_secs` (catalog)
//!   later. The trace starts warm (`warm_start`): the rate before t = 0 is
//!   the first row's and what is acquired at t = 0 is ready at once. Spot acquires are refused with `spot_refusal_probability`;
//!   a spot lease is preempted after an exponential time with the catalog's
//!   `spot_interruptions_per_hour`, with a `notice_secs` notice, then killed.
//! * Cost is [`crate::billing::blocks`] of every lease, exactly what the
//!   ledger would charge. Utilisation is busy GPU time over held GPU time.
//!
//! Every random draw comes from a seeded SplitMix64, so a run is a pure
//! function of its inputs.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use serde::Serialize;

use crate::autoscale::{
    Action, Autoscaler, Event, LeaseView, ModelLoad, Observation, PolicyConfig, PolicyName,
    ReservedFloor,
};
use crate::billing::{self, Granularity, HOUR_MS, Millis};
use crate::catalog::{Catalog, InstanceType, Money, Tier};
use crate::lifecycle::{EndReason, LeaseState};
use crate::table::LeaseId;
use crate::trace::{SplitMix64, Trace};

/// Serving step.
pub const STEP_MS: Millis = 10_000;

/// The per-frame cost of the simulated model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Workload {
    /// Compute per frame, GFLOP.
    pub gflop_per_frame: f64,
    /// Memory traffic per frame, MB.
    pub mbytes_per_frame: f64,
    /// Fraction of datasheet TFLOPS achieved.
    pub efficiency: f64,
    /// Fixed cost per batch, ms.
    pub launch_ms: f64,
    /// Largest batch.
    pub max_batch: u32,
}

impl Default for Workload {
    /// A large detector at high resolution: about 1000 frames/s on one H100
    /// at the SLO (so one "GPU of load" in the traces is about one H100).
    fn default() -> Workload {
        Workload {
            gflop_per_frame: 280.0,
            mbytes_per_frame: 400.0,
            efficiency: 0.35,
            launch_ms: 2.0,
            max_batch: 64,
        }
    }
}

impl Workload {
    /// Per-worker throughput at the SLO on `it` (frames/s), given the
    /// compute share of the budget (ms). 0 if one frame cannot make it.
    pub fn throughput_at_slo(&self, it: &InstanceType, compute_budget_ms: f64) -> f64 {
        if it.fp16_tflops <= 0.0 || it.memory_bandwidth_gbs <= 0.0 {
            return 0.0;
        }
        let frame_ms = self.gflop_per_frame / (it.fp16_tflops * self.efficiency)
            + self.mbytes_per_frame / it.memory_bandwidth_gbs;
        let batch_budget = compute_budget_ms / 2.0;
        let b = ((batch_budget - self.launch_ms) / frame_ms).floor();
        if b < 1.0 {
            return 0.0;
        }
        let b = b.min(f64::from(self.max_batch));
        b / (self.launch_ms + b * frame_ms) * 1000.0
    }
}

/// Simulation options.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimOptions {
    /// Autoscaler tick.
    pub tick_ms: Millis,
    /// End-to-end latency budget, ms.
    pub budget_ms: f64,
    /// Network + return margin taken from the budget, ms.
    pub network_ms: f64,
    /// The model's cost.
    pub workload: Workload,
    /// Instance types the policy may use (None: all in the catalog).
    pub instance_types: Option<Vec<String>>,
    /// Headroom override (None: the policy default).
    pub headroom: Option<f64>,
    /// Hourly spend cap.
    pub spend_cap_per_hour: Option<Money>,
    /// Reserved floor in leases (None: sized on the first day's minimum).
    pub reserved_floor: Option<u32>,
    /// Simulate spot preemptions.
    pub preemptions: bool,
    /// Probability that a spot acquire is refused.
    pub spot_refusal_probability: f64,
    /// Spot notice period, seconds.
    pub notice_secs: u32,
    /// Seed of every random draw.
    pub seed: u64,
    /// Include every lease in the report.
    pub record_leases: bool,
    /// Leases acquired at t = 0 are ready at once: the trace starts in a
    /// steady state instead of a cold start that every policy would pay.
    pub warm_start: bool,
}

impl Default for SimOptions {
    fn default() -> SimOptions {
        SimOptions {
            tick_ms: 60_000,
            budget_ms: 80.0,
            network_ms: 20.0,
            workload: Workload::default(),
            instance_types: None,
            headroom: None,
            spend_cap_per_hour: None,
            reserved_floor: None,
            preemptions: true,
            spot_refusal_probability: 0.02,
            notice_secs: 120,
            seed: 42,
            record_leases: false,
            warm_start: true,
        }
    }
}

/// One simulated lease.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimLease {
    /// Id.
    pub id: LeaseId,
    /// Model.
    pub model: String,
    /// Instance type.
    pub instance_type: String,
    /// Tier.
    pub tier: Tier,
    /// Hourly price.
    pub price_per_hour: Money,
    /// Billing granularity.
    pub granularity: Granularity,
    /// Requested at.
    pub requested_at: Millis,
    /// Billing start (None if refused).
    pub billing_start: Option<Millis>,
    /// Ready at.
    pub ready_at: Option<Millis>,
    /// Ended at.
    pub ended_at: Option<Millis>,
    /// Final state.
    pub state: LeaseState,
    /// Frames served (all within the SLO in this model).
    pub frames_served: u64,
    /// Busy ms.
    pub busy_ms: f64,
    /// Still held when the trace ended: the simulator ended it (as
    /// `released`), not the policy or the provider.
    pub held_at_end: bool,
}

/// The result of one run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimReport {
    /// Trace name.
    pub trace: String,
    /// Policy.
    pub policy: PolicyName,
    /// Currency of every amount.
    pub currency: String,
    /// Simulated hours.
    pub hours: f64,
    /// Total cost.
    pub cost_total: Money,
    /// Cost by tier.
    pub cost_by_tier: BTreeMap<Tier, Money>,
    /// GPU-hours held (acquire to end).
    pub gpu_hours_leased: f64,
    /// GPU-hours paid (whole billing blocks).
    pub gpu_hours_paid: f64,
    /// GPU-hours busy.
    pub gpu_hours_busy: f64,
    /// Busy / held.
    pub utilisation: f64,
    /// Busy / paid.
    pub paid_utilisation: f64,
    /// Frames that arrived.
    pub frames_total: u64,
    /// Frames served within the SLO.
    pub frames_within_slo: u64,
    /// Frames shed for lack of capacity.
    pub frames_shed: u64,
    /// within_slo / total.
    pub slo_attainment: f64,
    /// Leases acquired (including refused attempts).
    pub leases: u64,
    /// Spot acquires refused.
    pub spot_refusals: u64,
    /// Spot preemptions.
    pub preemptions: u64,
    /// Most leases held at once.
    pub peak_leases: u64,
    /// Leases still held when the trace ended (the simulator ended them).
    pub leases_held_at_end: u64,
    /// Highest summed hourly price of live leases.
    pub max_burn_per_hour: Money,
    /// Cost per 1000 frames within the SLO.
    pub cost_per_1k_within_slo: Option<f64>,
    /// Leases by instance type.
    pub leases_by_type: BTreeMap<String, u64>,
    /// Every lease (when asked for).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub lease_log: Vec<SimLease>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Due {
    Ready(LeaseId),
    Notice(LeaseId),
    Kill(LeaseId),
}

/// Parameters derived from the catalog and options, shared by the policies.
#[derive(Debug, Clone)]
struct Env {
    throughput: BTreeMap<String, f64>,
}

struct Run<'a> {
    catalog: &'a Catalog,
    opts: &'a SimOptions,
    env: Env,
    scaler: Autoscaler,
    leases: Vec<SimLease>,
    /// Indices of leases not ended.
    live: Vec<usize>,
    due: BinaryHeap<Reverse<(Millis, Due)>>,
    rng: SplitMix64,
    report: SimReport,
}

/// Per-model throughput table the autoscaler is given.
pub fn throughput_table(catalog: &Catalog, opts: &SimOptions) -> BTreeMap<String, f64> {
    catalog
        .instances
        .iter()
        .filter(|i| {
            opts.instance_types
                .as_ref()
                .is_none_or(|allowed| allowed.contains(&i.name))
        })
        .map(|i| {
            (
                i.name.clone(),
                opts.workload
                    .throughput_at_slo(i, opts.budget_ms - opts.network_ms),
            )
        })
        .filter(|(_, f)| *f > 0.0)
        .collect()
}

/// The cheapest type per frame for `tier` under `throughput` (what the
/// autoscaler will pick), for sizing the baselines.
fn cheapest(
    catalog: &Catalog,
    throughput: &BTreeMap<String, f64>,
    tier: Tier,
) -> Option<(String, f64)> {
    throughput
        .iter()
        .filter_map(|(t, &f)| {
            catalog
                .get(t)
                .map(|i| (t.clone(), f, i.price_per_hour.get(tier).units() / f))
        })
        .min_by(|a, b| a.2.total_cmp(&b.2))
        .map(|(t, f, _)| (t, f))
}

/// The policy configuration the simulator uses for `policy` on `trace`.
///
/// Sizing inputs that an operator would set from history are derived from
/// the trace by one rule for every trace: static-peak is sized for the
/// trace's peak; the reserved floor (tidal, paid-block-aware) is the first
/// day's minimum, in whole workers of the cheapest reserved type.
pub fn policy_config(
    trace: &Trace,
    policy: PolicyName,
    catalog: &Catalog,
    opts: &SimOptions,
) -> PolicyConfig {
    let mut cfg = PolicyConfig::new(policy);
    if let Some(h) = opts.headroom {
        cfg.headroom = h;
    }
    cfg.spend_cap_per_hour = opts.spend_cap_per_hour;
    cfg.static_peak_fps = trace.peak_fps();
    let throughput = throughput_table(catalog, opts);
    if matches!(policy, PolicyName::Tidal | PolicyName::PaidBlockAware)
        && let Some((ty, fps)) = cheapest(catalog, &throughput, Tier::Reserved)
    {
        let mins = trace.min_fps_until(24 * HOUR_MS);
        for (model, min) in mins {
            let count = opts
                .reserved_floor
                .unwrap_or((min / fps).floor().max(0.0) as u32);
            if count > 0 {
                cfg.reserved.push(ReservedFloor {
                    model,
                    instance_type: ty.clone(),
                    count,
                });
            }
        }
    }
    cfg
}

/// Replays `trace` through the real autoscaler under `policy`.
pub fn simulate(
    trace: &Trace,
    policy: PolicyName,
    catalog: &Catalog,
    opts: &SimOptions,
) -> SimReport {
    let cfg = policy_config(trace, policy, catalog, opts);
    simulate_with(trace, cfg, catalog, opts)
}

/// Like [`simulate`], with an explicit policy configuration.
pub fn simulate_with(
    trace: &Trace,
    cfg: PolicyConfig,
    catalog: &Catalog,
    opts: &SimOptions,
) -> SimReport {
    let policy = cfg.policy;
    let env = Env {
        throughput: throughput_table(catalog, opts),
    };
    let mut run = Run {
        catalog,
        opts,
        env,
        scaler: Autoscaler::new(cfg, catalog.clone()),
        leases: Vec::new(),
        live: Vec::new(),
        due: BinaryHeap::new(),
        rng: SplitMix64::new(opts.seed),
        report: SimReport {
            trace: trace.name.clone(),
            policy,
            currency: catalog.currency.clone(),
            hours: 0.0,
            cost_total: Money::ZERO,
            cost_by_tier: BTreeMap::new(),
            gpu_hours_leased: 0.0,
            gpu_hours_paid: 0.0,
            gpu_hours_busy: 0.0,
            utilisation: 0.0,
            paid_utilisation: 0.0,
            frames_total: 0,
            frames_within_slo: 0,
            frames_shed: 0,
            slo_attainment: 0.0,
            leases: 0,
            spot_refusals: 0,
            preemptions: 0,
            peak_leases: 0,
            leases_held_at_end: 0,
            max_burn_per_hour: Money::ZERO,
            cost_per_1k_within_slo: None,
            leases_by_type: BTreeMap::new(),
            lease_log: Vec::new(),
        },
    };
    run.go(trace);
    run.report
}

impl Run<'_> {
    fn go(&mut self, trace: &Trace) {
        let end = trace.end_ms();
        let models = trace.models();
        let tick = self.opts.tick_ms.max(STEP_MS);
        // fractional frames carried so arrivals are integers that sum right
        let mut carry: BTreeMap<String, f64> = BTreeMap::new();
        let mut tick_frames: BTreeMap<String, (u64, u64)> = BTreeMap::new();
        let mut t: Millis = 0;
        while t < end {
            self.run_due(t);
            if t.is_multiple_of(tick) {
                // the trace starts warm: before t = 0 the gateway is taken to
                // have measured the first row's rate
                let warm = (t == 0).then(|| trace.rates_at(0));
                let obs = self.observe(&models, &tick_frames, tick, warm.as_ref());
                tick_frames.clear();
                let actions = self.scaler.on_event(t, Event::Tick(obs));
                self.apply(t, actions);
                // anything the actions made due now (a warm start)
                self.run_due(t);
            }
            // serve one step
            let rates = trace.rates_at(t);
            for model in &models {
                let fps = rates.get(model).copied().unwrap_or(0.0);
                let c = carry.entry(model.clone()).or_insert(0.0);
                let exact = fps * STEP_MS as f64 / 1000.0 + *c;
                let arrivals = exact.floor() as u64;
                *c = exact - arrivals as f64;
                let served = self.serve(model, arrivals);
                let e = tick_frames.entry(model.clone()).or_insert((0, 0));
                e.0 += arrivals;
                e.1 += arrivals - served;
                self.report.frames_total += arrivals;
                self.report.frames_within_slo += served;
                self.report.frames_shed += arrivals - served;
            }
            t += STEP_MS;
        }
        // end every lease still held at the end of the trace, marked as
        // ended by the simulator, so that tests can tell them from leases
        // the policy released
        self.report.leases_held_at_end = self.live.len() as u64;
        for i in self.live.clone() {
            self.leases[i].held_at_end = true;
            self.end_lease(i, end, EndReason::Released);
        }
        self.finish(end);
    }

    fn observe(
        &self,
        models: &[String],
        tick_frames: &BTreeMap<String, (u64, u64)>,
        tick: Millis,
        warm: Option<&BTreeMap<String, f64>>,
    ) -> Observation {
        let loads = models
            .iter()
            .map(|m| {
                let (arrived, shed) = tick_frames.get(m).copied().unwrap_or((0, 0));
                let shed_frac = if arrived == 0 {
                    0.0
                } else {
                    shed as f64 / arrived as f64
                };
                let measured = arrived as f64 * 1000.0 / tick as f64;
                ModelLoad {
                    model: m.clone(),
                    arrival_fps: warm.and_then(|w| w.get(m).copied()).unwrap_or(measured),
                    queue_depth: 0,
                    // shedding more than 5% means p95 is at the budget
                    p95_ms: if shed_frac > 0.05 {
                        self.opts.budget_ms
                    } else {
                        self.opts.budget_ms * 0.6
                    },
                    budget_ms: self.opts.budget_ms,
                    throughput_fps: self.env.throughput.clone(),
                }
            })
            .collect();
        let leases = self
            .live
            .iter()
            .map(|&i| &self.leases[i])
            .map(|l| LeaseView {
                id: l.id,
                model: l.model.clone(),
                instance_type: l.instance_type.clone(),
                tier: l.tier,
                state: l.state,
                billing_start: l.billing_start,
                granularity: l.granularity,
                price_per_hour: l.price_per_hour,
            })
            .collect();
        Observation {
            models: loads,
            leases,
        }
    }

    fn index(&self, id: LeaseId) -> usize {
        (id.0 - 1) as usize
    }

    fn run_due(&mut self, now: Millis) {
        while let Some(Reverse((at, due))) = self.due.peek().copied() {
            if at > now {
                break;
            }
            self.due.pop();
            match due {
                Due::Ready(id) => {
                    let i = self.index(id);
                    if self.leases[i].state == LeaseState::Starting {
                        self.leases[i].state = LeaseState::Ready;
                        self.leases[i].ready_at = Some(at);
                    }
                }
                Due::Notice(id) => {
                    let i = self.index(id);
                    if self.leases[i].state.is_ended() {
                        continue;
                    }
                    let deadline = at + u64::from(self.opts.notice_secs) * 1000;
                    self.due.push(Reverse((deadline, Due::Kill(id))));
                    let actions = self.scaler.on_event(
                        at,
                        Event::PreemptionNotice {
                            lease: id,
                            deadline,
                        },
                    );
                    self.apply(at, actions);
                }
                Due::Kill(id) => {
                    let i = self.index(id);
                    if !self.leases[i].state.is_ended() {
                        self.report.preemptions += 1;
                        self.end_lease(i, at, EndReason::Preempted);
                    }
                }
            }
        }
    }

    fn transition(&mut self, i: usize, to: LeaseState) {
        let l = &mut self.leases[i];
        match l.state.transition(to) {
            Ok(s) => l.state = s,
            // the simulator only makes legal moves; a bug here must be loud
            Err(e) => panic!("simulator made an illegal lease transition: {e}"),
        }
    }

    fn end_lease(&mut self, i: usize, at: Millis, reason: EndReason) {
        self.transition(i, LeaseState::Ended(reason));
        self.leases[i].ended_at = Some(at.max(self.leases[i].billing_start.unwrap_or(at)));
        self.live.retain(|&j| j != i);
    }

    fn burn(&self) -> Money {
        self.live
            .iter()
            .map(|&i| self.leases[i].price_per_hour)
            .sum()
    }

    fn apply(&mut self, now: Millis, actions: Vec<Action>) {
        let mut queue = std::collections::VecDeque::from(actions);
        // each refusal adds at most one on-demand acquire, which is never
        // refused, so this terminates; the bound is belt and braces
        let mut budget = 100_000usize;
        while let Some(a) = queue.pop_front() {
            budget -= 1;
            if budget == 0 {
                break;
            }
            match a {
                Action::Acquire {
                    model,
                    instance_type,
                    tier,
                    ..
                } => {
                    let Some(it) = self.catalog.get(&instance_type) else {
                        continue;
                    };
                    let id = LeaseId(self.leases.len() as u64 + 1);
                    self.leases.push(SimLease {
                        id,
                        model: model.clone(),
                        instance_type: instance_type.clone(),
                        tier,
                        price_per_hour: it.price_per_hour.get(tier),
                        granularity: it.granularity,
                        requested_at: now,
                        billing_start: None,
                        ready_at: None,
                        ended_at: None,
                        state: LeaseState::Requested,
                        frames_served: 0,
                        busy_ms: 0.0,
                        held_at_end: false,
                    });
                    self.report.leases += 1;
                    *self
                        .report
                        .leases_by_type
                        .entry(instance_type.clone())
                        .or_insert(0) += 1;
                    let i = self.leases.len() - 1;
                    self.live.push(i);
                    if tier == Tier::Spot && self.rng.unit() < self.opts.spot_refusal_probability {
                        self.report.spot_refusals += 1;
                        self.end_lease(i, now, EndReason::NoCapacity);
                        queue.extend(self.scaler.on_event(
                            now,
                            Event::AcquireRefused {
                                model,
                                instance_type,
                                tier,
                            },
                        ));
                        continue;
                    }
                    self.transition(i, LeaseState::Starting);
                    self.leases[i].billing_start = Some(now);
                    let startup = if now == 0 && self.opts.warm_start {
                        0
                    } else {
                        u64::from(it.startup_secs) * 1000
                    };
                    self.due.push(Reverse((now + startup, Due::Ready(id))));
                    if tier == Tier::Spot
                        && self.opts.preemptions
                        && it.spot_interruptions_per_hour > 0.0
                    {
                        let u = self.rng.unit().max(1e-12);
                        let hours = -u.ln() / it.spot_interruptions_per_hour;
                        let at = now + (hours * HOUR_MS as f64) as u64;
                        self.due.push(Reverse((at, Due::Notice(id))));
                    }
                }
                Action::Release { lease } => {
                    let i = self.index(lease);
                    if self.leases[i].state.is_ended() {
                        continue;
                    }
                    if self.leases[i].state == LeaseState::Ready {
                        self.transition(i, LeaseState::Draining);
                    }
                    self.end_lease(i, now, EndReason::Released);
                }
                Action::StopDispatch { lease } => {
                    let i = self.index(lease);
                    if matches!(
                        self.leases[i].state,
                        LeaseState::Starting | LeaseState::Ready
                    ) {
                        self.transition(i, LeaseState::Draining);
                    }
                }
            }
        }
        let live = self.live.len() as u64;
        self.report.peak_leases = self.report.peak_leases.max(live);
        let burn = self.burn();
        self.report.max_burn_per_hour = self.report.max_burn_per_hour.max(burn);
    }

    /// Serves `arrivals` frames of `model` on its ready leases; returns how
    /// many were served.
    fn serve(&mut self, model: &str, arrivals: u64) -> u64 {
        let step_s = STEP_MS as f64 / 1000.0;
        let ready: Vec<(usize, f64)> = self
            .live
            .iter()
            .map(|&i| (i, &self.leases[i]))
            .filter(|(_, l)| l.model == model && l.state == LeaseState::Ready)
            .map(|(i, l)| {
                (
                    i,
                    self.env
                        .throughput
                        .get(&l.instance_type)
                        .copied()
                        .unwrap_or(0.0),
                )
            })
            .filter(|(_, f)| *f > 0.0)
            .collect();
        let capacity: f64 = ready.iter().map(|(_, f)| f * step_s).sum();
        let served = arrivals.min(capacity.floor() as u64);
        if served == 0 || capacity <= 0.0 {
            return served;
        }
        // share in proportion to throughput; the remainder to the first
        let mut given = 0u64;
        let load = served as f64 / capacity;
        for (k, &(i, f)) in ready.iter().enumerate() {
            let share = if k + 1 == ready.len() {
                served - given
            } else {
                ((served as f64) * f * step_s / capacity).floor() as u64
            };
            given += share;
            self.leases[i].frames_served += share;
            self.leases[i].busy_ms += load * STEP_MS as f64;
        }
        served
    }

    fn finish(&mut self, end: Millis) {
        let r = &mut self.report;
        r.hours = end as f64 / HOUR_MS as f64;
        let mut busy_ms = 0.0;
        let mut held_ms = 0.0;
        let mut paid_ms = 0.0;
        for l in &self.leases {
            let Some(start) = l.billing_start else {
                continue;
            };
            let ended = l.ended_at.unwrap_or(end);
            let gpus = self
                .catalog
                .get(&l.instance_type)
                .map_or(1, |i| i.gpus.max(1)) as f64;
            held_ms += (ended - start) as f64 * gpus;
            busy_ms += l.busy_ms * gpus;
            for b in billing::blocks(
                start,
                Some(ended),
                Millis::MAX / 2,
                l.granularity,
                l.price_per_hour,
            ) {
                r.cost_total += b.amount;
                *r.cost_by_tier.entry(l.tier).or_insert(Money::ZERO) += b.amount;
                paid_ms += (b.end - b.start) as f64 * gpus;
            }
        }
        r.gpu_hours_busy = busy_ms / HOUR_MS as f64;
        r.gpu_hours_leased = held_ms / HOUR_MS as f64;
        r.gpu_hours_paid = paid_ms / HOUR_MS as f64;
        r.utilisation = crate::metrics::gpu_utilization(busy_ms, held_ms).unwrap_or(0.0);
        r.paid_utilisation = crate::metrics::gpu_utilization(busy_ms, paid_ms).unwrap_or(0.0);
        r.slo_attainment = if r.frames_total == 0 {
            1.0
        } else {
            r.frames_within_slo as f64 / r.frames_total as f64
        };
        r.cost_per_1k_within_slo = crate::metrics::cost_per_1k(r.cost_total, r.frames_within_slo);
        if self.opts.record_leases {
            r.lease_log = self.leases.clone();
        }
    }
}

/// The header of the comparison table (Markdown).
pub fn table_header() -> String {
    "| trace | policy | cost (CNY) | vs static-peak | util (busy/held) | busy/paid | SLO | GPU-h held | frames shed | leases | preemptions |\n\
     |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        .to_string()
}

/// A row of the comparison table; `static_cost` is static-peak's cost on
/// the same trace.
pub fn table_row(r: &SimReport, static_cost: Money) -> String {
    let vs = if static_cost.0 > 0 {
        r.cost_total.units() / static_cost.units() * 100.0
    } else {
        0.0
    };
    format!(
        "| {} | {} | {:.0} | {:.1}% | {:.1}% | {:.1}% | {:.2}% | {:.0} | {} | {} | {} |",
        r.trace,
        r.policy.as_str(),
        r.cost_total.units(),
        vs,
        r.utilisation * 100.0,
        r.paid_utilisation * 100.0,
        r.slo_attainment * 100.0,
        r.gpu_hours_leased,
        r.frames_shed,
        r.leases,
        r.preemptions
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_workload_makes_h100_the_cheapest_per_frame_and_cpu_unusable() {
        let c = Catalog::default_catalog();
        let o = SimOptions::default();
        let t = throughput_table(&c, &o);
        assert!(!t.contains_key("cpu-32"), "{t:?}");
        let h100 = t["h100"];
        assert!((950.0..=1050.0).contains(&h100), "{h100}");
        assert_eq!(cheapest(&c, &t, Tier::OnDemand).unwrap().0, "h100");
    }
}
