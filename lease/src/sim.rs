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
//! * Serving is [`crate::queue`]'s queueing model, one [`ModelQueue`] per
//!   model: each 10-second step's frames (an exact count) arrive within the
//!   step, wait in a deadline-ordered queue, and are dispatched in batches
//!   to the ready leases' workers, or shed when they cannot make their
//!   deadline. `total = within_slo + late + shed` holds exactly. Each tick
//!   the autoscaler is shown the tick's arrival rate, the queue depth at
//!   its end and the p95 latency of the frames served in it.
//! * The cloud is [`crate::cloud`]'s model ([`SimOptions::cloud`], else the
//!   catalog's `[cloud]`): an acquire may be refused (a spot pool short or
//!   dry, or a type's capacity in a tier all held); a lease bills from its
//!   acquire and is ready after a start-up drawn from its type's log-normal
//!   (median and p95 from the catalog); spot leases are reclaimed in waves
//!   over their type and one by one in the background, each with a
//!   `notice_secs` notice, then killed. The trace starts warm
//!   (`warm_start`): the rate before t = 0 is the first row's and what is
//!   acquired at t = 0 is ready at once.
//! * Reserved capacity is a commitment: the floor's count of its type,
//!   billed for the whole replayed window whether used or not; reserved
//!   leases within it cost nothing more. The floor is chosen from past data
//!   only: a configured count, or the first `history_days` days of the
//!   trace, which are then not replayed ([`split_history`]).
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
use crate::cloud::{
    self, Cloud, CloudConfig, CloudSetup, Commitment, DAY_MS, HeldLease, InterruptionCause, Refusal,
};
use crate::lifecycle::{EndReason, LeaseState};
use crate::queue::{
    Arrivals, BatchCost, LatencyHistogram, ModelQueue, QueueConfig, QueueError, StepOutcome,
};
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

    /// What a batch takes on `it`, for the queueing model: `launch_ms +
    /// b × frame_ms`, up to `max_batch`. None for a type with no compute or
    /// memory figures.
    pub fn batch_cost(&self, it: &InstanceType) -> Option<BatchCost> {
        if it.fp16_tflops <= 0.0 || it.memory_bandwidth_gbs <= 0.0 {
            return None;
        }
        let frame_ms = self.gflop_per_frame / (it.fp16_tflops * self.efficiency)
            + self.mbytes_per_frame / it.memory_bandwidth_gbs;
        BatchCost::new(self.launch_ms * 1000.0, frame_ms * 1000.0, self.max_batch).ok()
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
    /// Reserved floor (and commitment) in leases per model. None: chosen
    /// from history, the first [`SimOptions::history_days`] days.
    pub reserved_floor: Option<u32>,
    /// Days at the start of the trace taken as history when the reserved
    /// floor is not configured: the floor is their minimum and they are not
    /// replayed. A trace no longer than this has no history (no floor).
    pub history_days: u32,
    /// The cloud (None: the catalog's `[cloud]`).
    pub cloud: Option<CloudConfig>,
    /// Simulate spot interruptions (waves and background).
    pub preemptions: bool,
    /// Probability that a calm spot pool refuses an acquire, before the
    /// cloud's `refusal_factor` and its demand and dry-pool terms.
    pub spot_refusal_probability: f64,
    /// Spot notice period, seconds.
    pub notice_secs: u32,
    /// Seed of every random draw.
    pub seed: u64,
    /// Include every lease in the report.
    pub record_leases: bool,
    /// Include each tick's latency and queue per model in the report
    /// ([`SimReport::ticks`]).
    pub record_ticks: bool,
    /// Time resolution of the queueing model, µs (see [`crate::queue`]).
    pub slot_us: u64,
    /// How frames arrive within a 10 s step.
    pub arrivals: Arrivals,
    /// A batch runs up to this fraction longer or shorter than its cost
    /// (uniform); frames it makes finish past the budget are late.
    pub batch_jitter: f64,
    /// Most frames queued per model (None: only the deadline bounds it).
    pub max_queued: Option<u64>,
    /// Leases acquired at t = 0 are ready at once: the trace starts in a
    /// steady state instead of a cold start that every policy would pay.
    pub warm_start: bool,
}

impl SimOptions {
    /// The queueing model's parameters these options give, checked.
    pub fn queue_config(&self) -> Result<QueueConfig, QueueError> {
        let cfg = QueueConfig {
            slot_us: self.slot_us,
            arrivals: self.arrivals,
            max_queued: self.max_queued,
            batch_jitter: self.batch_jitter,
            ..QueueConfig::new(self.budget_ms, self.network_ms)
        };
        cfg.validate()?;
        Ok(cfg)
    }
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
            history_days: 1,
            cloud: None,
            preemptions: true,
            spot_refusal_probability: 0.02,
            notice_secs: 120,
            seed: 42,
            record_leases: false,
            record_ticks: false,
            slot_us: 5_000,
            arrivals: Arrivals::Poisson,
            batch_jitter: 0.0,
            max_queued: None,
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
    /// Frames its worker served (within the SLO or late), its even share of
    /// its type's pool in the queueing model.
    pub frames_served: u64,
    /// Busy ms: its frames' share of SLO capacity, frames served ×
    /// 1000 / the type's throughput at the SLO (how the batcher batched
    /// them does not change it; [`SimReport::gpu_hours_running`] does).
    pub busy_ms: f64,
    /// Still held when the trace ended: the simulator ended it (as
    /// `released`), not the policy or the provider.
    pub held_at_end: bool,
    /// Why its spot capacity was reclaimed, if it was.
    pub interruption: Option<InterruptionCause>,
    /// When the reclaim's notice came.
    pub notice_at: Option<Millis>,
}

/// Refused acquires, by cause.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RefusalCounts {
    /// Spot acquires a short pool refused (its calm chance, raised by
    /// recent requests).
    pub spot_pool: u64,
    /// Spot acquires refused while the pool was dry after a refusal.
    pub spot_pool_dry: u64,
    /// Acquires refused because the type's capacity in the tier was held.
    pub capacity: BTreeMap<Tier, u64>,
}

/// The reserved commitment and how much of it was used.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ReservedUse {
    /// The commitments, one per type.
    pub commitments: Vec<Commitment>,
    /// What they cost over the replayed window (the term prorated).
    pub commitment_cost: Money,
    /// Committed GPU-hours over the window.
    pub committed_gpu_hours: f64,
    /// GPU-hours reserved leases were held.
    pub used_gpu_hours: f64,
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
    /// Frames served past the budget (a batch ran longer than planned).
    pub frames_late: u64,
    /// Frames shed: refused on arrival, or unable to make their deadline.
    pub frames_shed: u64,
    /// within_slo / total.
    pub slo_attainment: f64,
    /// Median latency of the frames served, ms (network + wait + batch).
    pub latency_p50_ms: Option<f64>,
    /// 95th percentile latency of the frames served, ms.
    pub latency_p95_ms: Option<f64>,
    /// 99th percentile latency of the frames served, ms.
    pub latency_p99_ms: Option<f64>,
    /// The worst tick's p95, ms.
    pub worst_tick_p95_ms: Option<f64>,
    /// GPU-hours spent running batches in the queueing model (small batches
    /// at low load cost more per frame than the SLO batch `busy` counts).
    pub gpu_hours_running: f64,
    /// Leases acquired (including refused attempts).
    pub leases: u64,
    /// Spot acquires refused, whatever the cause.
    pub spot_refusals: u64,
    /// Every refusal, by cause.
    pub refusals: RefusalCounts,
    /// Spot preemptions.
    pub preemptions: u64,
    /// Of those, by a reclaim wave.
    pub wave_preemptions: u64,
    /// Reclaim waves that struck (whether or not they found a lease).
    pub waves: u64,
    /// Median start-up drawn, seconds (warm-start leases excluded).
    pub startup_median_secs: f64,
    /// 95th percentile of the start-ups drawn, seconds.
    pub startup_p95_secs: f64,
    /// The reserved commitment and its use.
    pub reserved: ReservedUse,
    /// Hours of the trace taken as history: not replayed, not scored.
    pub history_hours: f64,
    /// The cloud the run used.
    pub cloud: CloudConfig,
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
    /// Each tick per model (when asked for: [`SimOptions::record_ticks`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ticks: Vec<TickServing>,
}

/// One model's serving over one autoscaler tick, from the queueing model:
/// what the autoscaler is shown at the tick's end.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TickServing {
    /// End of the tick (the autoscaler's `now`).
    pub at: Millis,
    /// Model.
    pub model: String,
    /// Frames that arrived in the tick.
    pub arrived: u64,
    /// Frames served within the SLO in the tick.
    pub within_slo: u64,
    /// Frames served late in the tick.
    pub late: u64,
    /// Frames shed in the tick.
    pub shed: u64,
    /// Frames queued at its end.
    pub queue_depth: u64,
    /// p95 latency of the frames served in the tick, ms (None: none served).
    pub p95_ms: Option<f64>,
    /// p99 latency, ms.
    pub p99_ms: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Due {
    Ready(LeaseId),
    Notice(LeaseId),
    Kill(LeaseId),
    /// A reclaim wave over `Run::wave_types[k]`.
    Wave(usize),
}

/// Parameters derived from the catalog and options, shared by the policies.
#[derive(Debug, Clone)]
struct Env {
    throughput: BTreeMap<String, f64>,
    /// Batch cost per type the autoscaler may use, for the queueing model.
    costs: BTreeMap<String, BatchCost>,
}

/// The queueing model of each model of the trace, and what it measured.
#[derive(Debug)]
struct Serving {
    queues: BTreeMap<String, ModelQueue>,
    /// Frames per model since the last tick.
    tick: BTreeMap<String, TickCounts>,
    /// Latency of every frame served, all models.
    run: LatencyHistogram,
    worst_tick_p95_ms: Option<f64>,
    /// GPU-ms spent running batches.
    running_ms: f64,
    ticks: Vec<TickServing>,
}

#[derive(Debug, Clone, Copy, Default)]
struct TickCounts {
    arrived: u64,
    within_slo: u64,
    late: u64,
    shed: u64,
}

/// What one model's tick showed the autoscaler.
#[derive(Debug, Clone, Copy, Default)]
struct TickSeen {
    arrived: u64,
    queue_depth: u64,
    p95_ms: Option<f64>,
}

impl Serving {
    /// One queue per model, each seeded from `seed` and its place.
    fn new(cfg: &QueueConfig, models: &[String], seed: u64) -> Result<Serving, QueueError> {
        let mut queues = BTreeMap::new();
        for (k, m) in models.iter().enumerate() {
            let seed = seed ^ 0x51AB_0000_0000_0001u64.wrapping_mul(k as u64 + 1);
            queues.insert(m.clone(), ModelQueue::new(cfg.clone(), 0, seed)?);
        }
        Ok(Serving {
            queues,
            tick: BTreeMap::new(),
            run: LatencyHistogram::new(),
            worst_tick_p95_ms: None,
            running_ms: 0.0,
            ticks: Vec::new(),
        })
    }

    /// One step of `model` on `fleet` (see [`Run::serve`]).
    fn step(
        &mut self,
        model: &str,
        fleet: &[(&str, BatchCost, u64)],
        step: Option<(Millis, u64)>,
    ) -> Option<StepOutcome> {
        let q = self.queues.get_mut(model)?;
        q.set_fleet(fleet);
        let out = match step {
            Some((until, arrivals)) => q.advance(until * 1000, arrivals),
            None => q.drain(),
        };
        if !self.tick.contains_key(model) {
            self.tick.insert(model.to_string(), TickCounts::default());
        }
        if let Some(t) = self.tick.get_mut(model) {
            t.arrived += out.arrived;
            t.within_slo += out.within_slo;
            t.late += out.late;
            t.shed += out.shed;
        }
        Some(out)
    }

    /// Ends `model`'s tick at `now`: its counts, queue and latencies.
    fn close_tick(&mut self, now: Millis, model: &str, record: bool) -> TickSeen {
        let counts = self.tick.remove(model).unwrap_or_default();
        let Some(q) = self.queues.get_mut(model) else {
            return TickSeen::default();
        };
        let h = q.take_tick_latency();
        self.run.merge(&h);
        let p95_ms = h.quantile_ms(0.95);
        if let Some(p) = p95_ms {
            self.worst_tick_p95_ms = Some(self.worst_tick_p95_ms.map_or(p, |w| w.max(p)));
        }
        let queue_depth = q.queued();
        if record {
            self.ticks.push(TickServing {
                at: now,
                model: model.to_string(),
                arrived: counts.arrived,
                within_slo: counts.within_slo,
                late: counts.late,
                shed: counts.shed,
                queue_depth,
                p95_ms,
                p99_ms: h.quantile_ms(0.99),
            });
        }
        TickSeen {
            arrived: counts.arrived,
            queue_depth,
            p95_ms,
        }
    }
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
    cloud: Cloud,
    /// The types whose spot leases are reclaimed in waves.
    wave_types: Vec<String>,
    commitments: Vec<Commitment>,
    /// Start-ups drawn (warm-start leases excluded), ms.
    startups: Vec<Millis>,
    serving: Serving,
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

/// A trace split into history (past data) and the window replayed and
/// scored.
#[derive(Debug, Clone)]
pub struct HistorySplit {
    /// The first [`SimOptions::history_days`] days; None: no history.
    pub history: Option<Trace>,
    /// The rest, shifted to start at 0 (by whole days, so the time of day
    /// is kept).
    pub scored: Trace,
}

/// Splits `trace` into history and the scored window. There is history only
/// when the reserved floor is not configured, `history_days` is above 0 and
/// the trace is longer than that; otherwise the whole trace is scored.
pub fn split_history(trace: &Trace, opts: &SimOptions) -> HistorySplit {
    let cut = u64::from(opts.history_days) * DAY_MS;
    if opts.reserved_floor.is_some() || cut == 0 || trace.end_ms() <= cut {
        return HistorySplit {
            history: None,
            scored: trace.clone(),
        };
    }
    let (past, rest): (Vec<_>, Vec<_>) = trace.rows.iter().cloned().partition(|r| r.t_ms < cut);
    let rest = rest
        .into_iter()
        .map(|mut r| {
            r.t_ms -= cut;
            r
        })
        .collect();
    HistorySplit {
        history: Some(Trace {
            name: trace.name.clone(),
            rows: past,
        }),
        scored: Trace {
            name: trace.name.clone(),
            rows: rest,
        },
    }
}

/// The policy configuration the simulator uses for `policy` on `trace`.
///
/// Sizing inputs that an operator would set from history are derived by
/// one rule for every trace: static-peak is sized for the scored window's
/// peak; the reserved floor (tidal, paid-block-aware) is
/// [`SimOptions::reserved_floor`] if set, else the history's minimum
/// ([`split_history`]) in whole workers of the cheapest reserved type, else
/// none. It never looks at the window being scored.
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
    let split = split_history(trace, opts);
    cfg.static_peak_fps = split.scored.peak_fps();
    let throughput = throughput_table(catalog, opts);
    if matches!(policy, PolicyName::Tidal | PolicyName::PaidBlockAware)
        && let Some((ty, fps)) = cheapest(catalog, &throughput, Tier::Reserved)
    {
        let floors: BTreeMap<String, u32> = match (opts.reserved_floor, &split.history) {
            (Some(n), _) => split.scored.models().into_iter().map(|m| (m, n)).collect(),
            (None, Some(history)) => history
                .min_fps_until(history.end_ms())
                .into_iter()
                .map(|(m, min)| (m, (min / fps).floor().max(0.0) as u32))
                .collect(),
            (None, None) => BTreeMap::new(),
        };
        for (model, count) in floors {
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
///
/// # Panics
///
/// If `opts`' queueing options are out of range (a slot of 0, a network
/// margin not below the budget, a jitter of 1 or more): check them first
/// with [`SimOptions::queue_config`], which names what is wrong.
pub fn simulate(
    trace: &Trace,
    policy: PolicyName,
    catalog: &Catalog,
    opts: &SimOptions,
) -> SimReport {
    let cfg = policy_config(trace, policy, catalog, opts);
    let split = split_history(trace, opts);
    let mut report = simulate_with(&split.scored, cfg, catalog, opts);
    if split.history.is_some() {
        report.history_hours = f64::from(opts.history_days) * 24.0;
    }
    report
}

/// One commitment per type: the floors' counts summed, at the type's
/// reserved price.
fn commitments(cfg: &PolicyConfig, catalog: &Catalog, cloud: &CloudConfig) -> Vec<Commitment> {
    let mut counts: BTreeMap<&str, u32> = BTreeMap::new();
    for f in &cfg.reserved {
        *counts.entry(f.instance_type.as_str()).or_insert(0) += f.count;
    }
    counts
        .into_iter()
        .filter_map(|(ty, count)| {
            catalog.get(ty).map(|it| Commitment {
                instance_type: ty.to_string(),
                count,
                price_per_hour: it.price_per_hour.reserved,
                term_days: cloud.params().reserved_term_days,
            })
        })
        .collect()
}

/// Mixed into the seed for the cloud's random stream.
const CLOUD_STREAM: u64 = 0xC10D_5EED_0000_0001;

/// The run's cloud: its configuration, the commitments, and the first
/// reclaim wave of each type, scheduled.
struct CloudParts {
    cloud_cfg: CloudConfig,
    commitments: Vec<Commitment>,
    cloud: Cloud,
    wave_types: Vec<String>,
    due: BinaryHeap<Reverse<(Millis, Due)>>,
}

impl CloudParts {
    fn new(cfg: &PolicyConfig, catalog: &Catalog, opts: &SimOptions) -> CloudParts {
        let cloud_cfg = opts.cloud.clone().unwrap_or_else(|| catalog.cloud.clone());
        let commitments = commitments(cfg, catalog, &cloud_cfg);
        let mut cloud = Cloud::new(
            &cloud_cfg,
            catalog,
            CloudSetup {
                calm_refusal: opts.spot_refusal_probability,
                interruptions: opts.preemptions,
                commitments: &commitments,
                // its own stream, not the serving model's: the same seed
                // hashed apart, so refusals do not echo arrival draws
                seed: SplitMix64::new(opts.seed ^ CLOUD_STREAM).next_u64(),
            },
        );
        let wave_types = cloud.wave_types();
        let mut due = BinaryHeap::new();
        for (k, ty) in wave_types.iter().enumerate() {
            if let Some(at) = cloud.next_wave(ty, 0) {
                due.push(Reverse((at, Due::Wave(k))));
            }
        }
        CloudParts {
            cloud_cfg,
            commitments,
            cloud,
            wave_types,
            due,
        }
    }
}

/// Like [`simulate`], with an explicit policy configuration, replaying the
/// whole of `trace` (no history is cut). The reserved floors of `cfg` are
/// the commitment.
///
/// # Panics
///
/// As [`simulate`], on queueing options out of range.
pub fn simulate_with(
    trace: &Trace,
    cfg: PolicyConfig,
    catalog: &Catalog,
    opts: &SimOptions,
) -> SimReport {
    let policy = cfg.policy;
    let throughput = throughput_table(catalog, opts);
    let costs = throughput
        .keys()
        .filter_map(|t| Some((t.clone(), opts.workload.batch_cost(catalog.get(t)?)?)))
        .collect();
    let env = Env { throughput, costs };
    let queue = opts
        .queue_config()
        .and_then(|q| Serving::new(&q, &trace.models(), opts.seed));
    let serving = match queue {
        Ok(s) => s,
        Err(e) => panic!("simulator options: {e}"),
    };
    let CloudParts {
        cloud_cfg,
        commitments,
        cloud,
        wave_types,
        due,
    } = CloudParts::new(&cfg, catalog, opts);
    let mut run = Run {
        catalog,
        opts,
        env,
        // the autoscaler plans with the start-ups and interruption rates of
        // the cloud it runs on, as its operator would configure them
        scaler: Autoscaler::new(cfg, cloud::effective_catalog(catalog, &cloud_cfg)),
        leases: Vec::new(),
        live: Vec::new(),
        due,
        cloud,
        wave_types,
        commitments,
        startups: Vec::new(),
        serving,
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
            frames_late: 0,
            frames_shed: 0,
            slo_attainment: 0.0,
            latency_p50_ms: None,
            latency_p95_ms: None,
            latency_p99_ms: None,
            worst_tick_p95_ms: None,
            gpu_hours_running: 0.0,
            leases: 0,
            spot_refusals: 0,
            refusals: RefusalCounts::default(),
            preemptions: 0,
            wave_preemptions: 0,
            waves: 0,
            startup_median_secs: 0.0,
            startup_p95_secs: 0.0,
            reserved: ReservedUse::default(),
            history_hours: 0.0,
            cloud: cloud_cfg,
            peak_leases: 0,
            leases_held_at_end: 0,
            max_burn_per_hour: Money::ZERO,
            cost_per_1k_within_slo: None,
            leases_by_type: BTreeMap::new(),
            lease_log: Vec::new(),
            ticks: Vec::new(),
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
        let mut t: Millis = 0;
        while t < end {
            self.run_due(t);
            if t.is_multiple_of(tick) {
                // the trace starts warm: before t = 0 the gateway is taken to
                // have measured the first row's rate
                let warm = (t == 0).then(|| trace.rates_at(0));
                let obs = self.observe(t, &models, tick, warm.as_ref());
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
                self.serve(model, Some((t + STEP_MS, arrivals)));
            }
            t += STEP_MS;
        }
        // what is still queued is served or shed by the fleet of the end
        for model in &models {
            self.serve(model, None);
            self.serving.close_tick(end, model, self.opts.record_ticks);
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

    /// What the gateway would report at the tick ending at `now`: the
    /// arrival rate, queue depth and p95 latency the queueing model
    /// produced over the tick.
    fn observe(
        &mut self,
        now: Millis,
        models: &[String],
        tick: Millis,
        warm: Option<&BTreeMap<String, f64>>,
    ) -> Observation {
        let loads = models
            .iter()
            .map(|m| {
                let seen = self.serving.close_tick(now, m, self.opts.record_ticks);
                let measured = seen.arrived as f64 * 1000.0 / tick as f64;
                ModelLoad {
                    model: m.clone(),
                    arrival_fps: warm.and_then(|w| w.get(m).copied()).unwrap_or(measured),
                    queue_depth: seen.queue_depth,
                    // as the gateway: 0 when no frame was served
                    p95_ms: seen.p95_ms.unwrap_or(0.0),
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
                Due::Notice(id) => self.notice(at, id, InterruptionCause::Background),
                Due::Wave(k) => self.wave(at, k),
                Due::Kill(id) => {
                    let i = self.index(id);
                    if !self.leases[i].state.is_ended() {
                        self.report.preemptions += 1;
                        if self.leases[i].interruption == Some(InterruptionCause::Wave) {
                            self.report.wave_preemptions += 1;
                        }
                        self.end_lease(i, at, EndReason::Preempted);
                    }
                }
            }
        }
    }

    /// The cloud reclaims lease `id`: a notice now, the kill `notice_secs`
    /// later. A lease already ended or already under notice is left alone.
    fn notice(&mut self, at: Millis, id: LeaseId, cause: InterruptionCause) {
        let i = self.index(id);
        if self.leases[i].state.is_ended() || self.leases[i].interruption.is_some() {
            return;
        }
        self.leases[i].interruption = Some(cause);
        self.leases[i].notice_at = Some(at);
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

    /// A reclaim wave over `wave_types[k]`: notices to the spot leases of
    /// that type it takes, and the next wave scheduled.
    fn wave(&mut self, at: Millis, k: usize) {
        self.report.waves += 1;
        let ty = self.wave_types[k].clone();
        let held: Vec<HeldLease<'_>> = self
            .live
            .iter()
            .map(|&i| &self.leases[i])
            .filter(|l| l.interruption.is_none())
            .map(|l| HeldLease {
                id: l.id,
                instance_type: &l.instance_type,
                tier: l.tier,
            })
            .collect();
        let reclaimed = self.cloud.wave(&ty, &held);
        for id in reclaimed {
            self.notice(at, id, InterruptionCause::Wave);
        }
        if let Some(next) = self.cloud.next_wave(&ty, at) {
            self.due.push(Reverse((next, Due::Wave(k))));
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
        if self.leases[i].billing_start.is_some() {
            // granted by the cloud: its capacity is free again
            self.cloud
                .release(&self.leases[i].instance_type, self.leases[i].tier);
        }
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
        // a spot refusal adds at most one on-demand acquire, and the
        // autoscaler answers any other refusal with none, so this
        // terminates; the bound is belt and braces
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
                } => queue.extend(self.acquire(now, model, instance_type, tier)),
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

    /// Asks the cloud for one lease; returns the autoscaler's answer if the
    /// cloud refused it.
    fn acquire(
        &mut self,
        now: Millis,
        model: String,
        instance_type: String,
        tier: Tier,
    ) -> Vec<Action> {
        let Some(it) = self.catalog.get(&instance_type) else {
            return Vec::new();
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
            interruption: None,
            notice_at: None,
        });
        self.report.leases += 1;
        *self
            .report
            .leases_by_type
            .entry(instance_type.clone())
            .or_insert(0) += 1;
        let i = self.leases.len() - 1;
        self.live.push(i);
        let grant = match self.cloud.acquire(now, &instance_type, tier) {
            Ok(grant) => grant,
            Err(refusal) => {
                self.count_refusal(tier, refusal);
                self.end_lease(i, now, EndReason::NoCapacity);
                let refused = Event::AcquireRefused {
                    model,
                    instance_type,
                    tier,
                };
                return self.scaler.on_event(now, refused);
            }
        };
        self.transition(i, LeaseState::Starting);
        self.leases[i].billing_start = Some(now);
        let startup = if now == 0 && self.opts.warm_start {
            0
        } else {
            self.startups.push(grant.startup_ms);
            grant.startup_ms
        };
        self.due.push(Reverse((now + startup, Due::Ready(id))));
        if let Some(at) = grant.interruption_at {
            self.due.push(Reverse((at, Due::Notice(id))));
        }
        Vec::new()
    }

    fn count_refusal(&mut self, tier: Tier, refusal: Refusal) {
        let r = &mut self.report;
        if tier == Tier::Spot {
            r.spot_refusals += 1;
        }
        match refusal {
            Refusal::PoolShort { .. } => r.refusals.spot_pool += 1,
            Refusal::PoolDry { .. } => r.refusals.spot_pool_dry += 1,
            Refusal::Capacity { tier, .. } => {
                *r.refusals.capacity.entry(tier).or_insert(0) += 1;
            }
        }
    }

    /// Serves one step of `model` in the queueing model: `Some((until,
    /// arrivals))` brings the step's frames, `None` drains the queue
    /// at the trace's end. The model's ready leases are its workers; each
    /// pool's frames are shared evenly among its type's leases.
    fn serve(&mut self, model: &str, step: Option<(Millis, u64)>) {
        let mut by_type: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for &i in &self.live {
            let l = &self.leases[i];
            if l.model == model
                && l.state == LeaseState::Ready
                && self.env.costs.contains_key(&l.instance_type)
            {
                by_type.entry(l.instance_type.clone()).or_default().push(i);
            }
        }
        let fleet: Vec<(&str, BatchCost, u64)> = by_type
            .iter()
            .map(|(ty, v)| (ty.as_str(), self.env.costs[ty], v.len() as u64))
            .collect();
        let Some(out) = self.serving.step(model, &fleet, step) else {
            return;
        };
        let r = &mut self.report;
        r.frames_total += out.arrived;
        r.frames_within_slo += out.within_slo;
        r.frames_late += out.late;
        r.frames_shed += out.shed;
        for pool in out.pools.iter().filter(|p| p.served > 0 || p.run_us > 0.0) {
            let Some(ids) = by_type.get(&pool.name) else {
                continue;
            };
            let gpus = self.catalog.get(&pool.name).map_or(1, |i| i.gpus.max(1)) as f64;
            self.serving.running_ms += pool.run_us / 1000.0 * gpus;
            let fps = self.env.throughput.get(&pool.name).copied().unwrap_or(0.0);
            let n = ids.len() as u64;
            for (k, &i) in ids.iter().enumerate() {
                let share = pool.served / n + u64::from((k as u64) < pool.served % n);
                self.leases[i].frames_served += share;
                if fps > 0.0 {
                    self.leases[i].busy_ms += share as f64 * 1000.0 / fps;
                }
            }
        }
    }

    /// Bills the commitments over `[0, end)` whether used or not; returns
    /// the committed GPU-ms (paid time).
    fn bill_commitments(&mut self, end: Millis) -> f64 {
        let r = &mut self.report;
        let mut paid_ms = 0.0;
        for c in &self.commitments {
            let cost = c.billed_over(end);
            r.cost_total += cost;
            *r.cost_by_tier.entry(Tier::Reserved).or_insert(Money::ZERO) += cost;
            r.reserved.commitment_cost += cost;
            let gpus = self
                .catalog
                .get(&c.instance_type)
                .map_or(1, |i| i.gpus.max(1));
            let ms = f64::from(c.count) * f64::from(gpus) * end as f64;
            r.reserved.committed_gpu_hours += ms / HOUR_MS as f64;
            paid_ms += ms;
        }
        r.reserved.commitments = self.commitments.clone();
        paid_ms
    }

    /// The median and p95 of the start-ups drawn (nearest rank).
    fn record_startups(&mut self) {
        let r = &mut self.report;
        let mut startups = self.startups.clone();
        startups.sort_unstable();
        let rank = |q: f64| {
            // nearest rank
            let k = ((q * startups.len() as f64).ceil() as usize).clamp(1, startups.len());
            startups[k - 1] as f64 / 1000.0
        };
        if !startups.is_empty() {
            r.startup_median_secs = rank(0.5);
            r.startup_p95_secs = rank(0.95);
        }
    }

    fn finish(&mut self, end: Millis) {
        self.report.hours = end as f64 / HOUR_MS as f64;
        self.record_startups();
        let mut busy_ms = 0.0;
        let mut held_ms = 0.0;
        let mut paid_ms = self.bill_commitments(end);
        let r = &mut self.report;
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
            if l.tier == Tier::Reserved {
                // within the commitment (the reserved capacity is the
                // commitment): paid for by it, nothing more
                r.reserved.used_gpu_hours += (ended - start) as f64 * gpus / HOUR_MS as f64;
                continue;
            }
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
        r.latency_p50_ms = self.serving.run.quantile_ms(0.50);
        r.latency_p95_ms = self.serving.run.quantile_ms(0.95);
        r.latency_p99_ms = self.serving.run.quantile_ms(0.99);
        r.worst_tick_p95_ms = self.serving.worst_tick_p95_ms;
        r.gpu_hours_running = self.serving.running_ms / HOUR_MS as f64;
        r.ticks = std::mem::take(&mut self.serving.ticks);
        if self.opts.record_leases {
            r.lease_log = self.leases.clone();
        }
    }
}

/// The header of the comparison table (Markdown).
pub fn table_header() -> String {
    "| trace | policy | cost (CNY) | GPU-h paid | vs static-peak | util (busy/held) | busy/paid | SLO | p95 / p99 (ms) | GPU-h held | frames shed | leases | preemptions |\n\
     |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
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
        "| {} | {} | {:.0} | {:.0} | {:.1}% | {:.1}% | {:.1}% | {:.2}% | {} / {} | {:.0} | {} | {} | {} |",
        r.trace,
        r.policy.as_str(),
        r.cost_total.units(),
        r.gpu_hours_paid,
        vs,
        r.utilisation * 100.0,
        r.paid_utilisation * 100.0,
        r.slo_attainment * 100.0,
        ms(r.latency_p95_ms),
        ms(r.latency_p99_ms),
        r.gpu_hours_leased,
        r.frames_shed,
        r.leases,
        r.preemptions
    )
}

/// A latency for the table: one decimal, or `–` when nothing was served.
fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "–".to_string(), |v| format!("{v:.1}"))
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
