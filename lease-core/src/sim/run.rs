//! One replay: the loop that steps through the trace, shows the autoscaler
//! each tick, carries out its actions on the simulated cloud, serves the
//! frames through the queueing model and bills every lease. It owns the
//! run's state; the options, the report's shape and the policies' inputs
//! are the parent module's, and every draw comes from the seeded streams.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use super::serving::Serving;
use super::{
    Env, RefusalCounts, ReservedUse, STEP_MS, SimLease, SimOptions, SimReport, throughput_table,
};
use crate::autoscale::{
    Action, Autoscaler, Event, LeaseView, ModelLoad, Observation, PolicyConfig,
};
use crate::billing::{self, HOUR_MS, Millis};
use crate::catalog::{Catalog, Money, Tier};
use crate::cloud::{
    self, Cloud, CloudConfig, CloudSetup, Commitment, HeldLease, InterruptionCause, Refusal,
};
use crate::lifecycle::{EndReason, LeaseState};
use crate::queue::BatchCost;
use crate::table::LeaseId;
use crate::trace::{SplitMix64, Trace};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Due {
    Ready(LeaseId),
    Notice(LeaseId),
    Kill(LeaseId),
    /// Dispatch to a lease under notice stops (`Action::StopDispatch`).
    Stop(LeaseId),
    /// A reclaim wave over `Run::wave_types[k]`.
    Wave(usize),
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

/// Replays the whole of `trace` under `cfg` (see [`super::simulate_with`]).
///
/// # Panics
///
/// On queueing options out of range.
pub(super) fn replay(
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
                Due::Stop(id) => self.stop_dispatch(at, id),
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

    /// Lease `id` serves no more from `at`: draining, if it was starting
    /// or ready (its kill, if it came first, ended it).
    fn stop_dispatch(&mut self, at: Millis, id: LeaseId) {
        let i = self.index(id);
        if matches!(
            self.leases[i].state,
            LeaseState::Starting | LeaseState::Ready
        ) {
            self.transition(i, LeaseState::Draining);
            self.leases[i].stopped_at = Some(at);
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
                Action::StopDispatch { lease, at } if at > now => {
                    self.due.push(Reverse((at, Due::Stop(lease))));
                }
                Action::StopDispatch { lease, .. } => self.stop_dispatch(now, lease),
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
            stopped_at: None,
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
