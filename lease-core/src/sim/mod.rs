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
//!
//! Its rooms: this module holds the options, the report and the policies'
//! inputs (throughput table, history split, reserved floors); `run.rs` the
//! replay loop over the trace, the simulated cloud and the bills;
//! `serving.rs` the queueing model of each model, step by step.
//!
//! [`Autoscaler`]: crate::autoscale::Autoscaler
//! [`ModelQueue`]: crate::queue::ModelQueue

use std::collections::BTreeMap;

use serde::Serialize;

use crate::autoscale::{PolicyConfig, PolicyName, ReservedFloor};
use crate::billing::{Granularity, Millis};
use crate::catalog::{Catalog, InstanceType, Money, Tier};
use crate::cloud::{CloudConfig, Commitment, DAY_MS, InterruptionCause};
use crate::lifecycle::LeaseState;
use crate::queue::{Arrivals, BatchCost, QueueConfig, QueueError};
use crate::table::LeaseId;
use crate::trace::Trace;

mod run;
mod serving;

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

impl SimOptions {
    /// The defaults, with the days of history the shipped trace `name`
    /// starts with (`trace::history_days_for`: a week for `office-week`,
    /// else one); what `bench-leasing` and `tidegate-gateway simulate`
    /// replay a trace with (`compare` sets the same on its own options).
    pub fn for_trace(name: &str) -> SimOptions {
        SimOptions {
            history_days: crate::trace::history_days_for(name),
            ..SimOptions::default()
        }
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
    /// When dispatch to it stopped under that notice (it served on until
    /// then: `PolicyConfig::notice_drain_ms` before the kill).
    pub stopped_at: Option<Millis>,
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
/// Parameters derived from the catalog and options, shared by the policies.
#[derive(Debug, Clone)]
struct Env {
    throughput: BTreeMap<String, f64>,
    /// Batch cost per type the autoscaler may use, for the queueing model.
    costs: BTreeMap<String, BatchCost>,
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
    run::replay(trace, cfg, catalog, opts)
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
