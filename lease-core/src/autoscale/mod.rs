//! The autoscaler: a pure, clock-injected policy.
//!
//! `Autoscaler::on_event(now, Event) -> Vec<Action>`: no IO, no clock, no
//! randomness. The gateway's shell (and the simulator, which is how the
//! policy is tested on a week of load in milliseconds) feeds it an
//! [`Observation`] every tick — arrival rate, queue depth and p95 latency
//! per model, per-worker throughput at the SLO from the measured profiles,
//! and the lease table — plus provider events, and carries out the
//! [`Action`]s.
//!
//! Scaling up, for each model:
//! * the target capacity is the largest of: the observed rate plus headroom
//!   (plus what is needed to drain a queue when p95 is over budget), that
//!   rate extrapolated over the start-up time, and the time-of-day minimum
//!   ("tidal" schedule: configured, and learned: the same weekday a week
//!   before, else the latest day before; a day whose load stays well under
//!   it stops following it, see `learn.rs`) at `now + start-up`, so
//!   capacity is warm before a scheduled ramp;
//! * the reserved floor is leased first, then spot for the rest, then
//!   on-demand to replace a preempted spot lease, or when no spot worth
//!   leasing is left: a spot refusal cools off that type's spot only
//!   (`spot_refused_cooloff`), and the model moves to the next type's spot
//!   pool among those whose worker serves at least
//!   `spot_fallback_min_share` of the fastest type's throughput, while its
//!   spot is cheaper per frame than on-demand; an on-demand or reserved
//!   acquire that the provider
//!   refused is not asked for again (that model, type and tier) for
//!   `refused_cooloff`, so a fleet or quota that is full is not asked every
//!   tick;
//! * the instance type is the one with the lowest expected cost per frame
//!   at the SLO (price, over throughput, with spot's expected re-start
//!   cost);
//! * the hourly spend cap (sum of the hourly prices of every lease not
//!   ended) is never exceeded: an acquire that would exceed it is not made.
//!
//! Scaling down (`paid-block-aware`): the surplus is released from the lease
//! whose paid block ends soonest, and only within `release_window` of that
//! end (a lease paid until 14:00 is free capacity until then). Keeping a
//! lease there renews it, so the down-target is the renewal forecast over
//! the block it would buy (`forecast.rs`: the recent level and rising
//! trend, and the schedule scaled to today, over `renew_horizon`, at least
//! a start-up, because releasing a lease that will be needed sooner than a
//! replacement could start saves nothing), plus the spot hedge.
//!
//! In every policy, a ready lease is released only if the other *ready*
//! leases still cover the down-target: leases requested or starting count
//! as capacity for scale-up (so nothing is acquired twice), but they serve
//! nothing yet and may never start. Each reserved floor keeps the first
//! `count` reserved leases of its type; reserved leases beyond those (the
//! floor lowered, or its type changed) are surplus like any other lease.
//!
//! A lease whose model has no [`ModelLoad`] in the observation (its model
//! was removed from the configuration, or it has none recorded) serves no
//! load: it is surplus as a whole, released by each policy's own rule (see
//! `Autoscaler::release_orphans`), so it does not bill and count against
//! the spend cap for ever.
//!
//! On a spot preemption notice: acquire an on-demand replacement at once,
//! and stop dispatching to the lease `notice_drain_ms` before its deadline
//! (it serves through the notice while the replacement starts; for
//! scale-up it is gone at once). Paid-block-aware then hands
//! such on-demand leases back to spot: a start-up before an on-demand
//! lease's block ends, its capacity stops counting for scale-up (a spot
//! lease starts), and at the block end it is released as surplus if the
//! spot lease is ready by then; if not, it is kept for another block. It
//! does so only while spot's measured interruption rate makes each hand-over
//! worth its start-up (`handover_max_overhead`): on a pool reclaimed often,
//! the on-demand leases are kept.
//! With `hedge_margin` set (off by default), paid-block-aware also holds
//! an on-demand reserve above its targets, sized to the interruption rate
//! its notices measure (`hedge.rs`), so the next wave does not take the
//! fleet under the load while replacements start; that reserve is not
//! handed over.
//!
//! The baselines (`static-peak`, `reactive-idle-timeout`,
//! `idle-timeout-spot`, `tidal`) are the same code with parts switched off,
//! so the simulator compares policies, not implementations.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::billing::{self, Granularity, Millis};
use crate::catalog::{Catalog, Money, Tier};
use crate::lifecycle::LeaseState;
use crate::table::LeaseId;

mod config;
mod forecast;
mod hedge;
mod learn;
mod scale;

pub use self::config::{PolicyConfig, ReservedFloor, ScheduleEntry};
use self::hedge::SpotExposure;
use self::learn::{Learner, SLOT_MS, SLOTS};
use self::scale::Allowance;

/// One day in ms.
pub const DAY_MS: Millis = 86_400_000;

/// The policies the simulator compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyName {
    /// A fixed on-demand fleet sized for the known peak; never released.
    StaticPeak,
    /// On-demand only; scales up on the observed rate; a lease idle for
    /// `idle_timeout` is released (like SkyPilot's autostop).
    ReactiveIdleTimeout,
    /// `reactive-idle-timeout`'s scale-up and release rule, but it leases
    /// spot, falling back to another type's spot, or to on-demand, for
    /// `spot_refused_cooloff` after a spot refusal of a type
    /// refusal (and replacing a preempted lease on-demand): the fair
    /// baseline for the tiered policies, which differ from it in their
    /// release logic, not in the prices they may pay. No reserved floor,
    /// no schedule.
    IdleTimeoutSpot,
    /// Reserved floor + spot + on-demand, tidal schedule with pre-warm,
    /// surplus released at once (newest first), whatever was paid.
    Tidal,
    /// `tidal`, but the surplus is released only just before its paid
    /// block ends, soonest-ending first.
    PaidBlockAware,
}

impl PolicyName {
    /// Every policy, in table order.
    pub const ALL: [PolicyName; 5] = [
        PolicyName::StaticPeak,
        PolicyName::ReactiveIdleTimeout,
        PolicyName::IdleTimeoutSpot,
        PolicyName::Tidal,
        PolicyName::PaidBlockAware,
    ];

    /// The CLI name.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyName::StaticPeak => "static-peak",
            PolicyName::ReactiveIdleTimeout => "reactive-idle-timeout",
            PolicyName::IdleTimeoutSpot => "idle-timeout-spot",
            PolicyName::Tidal => "tidal",
            PolicyName::PaidBlockAware => "paid-block-aware",
        }
    }

    /// Reserved floor, spot and the tidal schedule.
    fn uses_tiers(self) -> bool {
        matches!(self, PolicyName::Tidal | PolicyName::PaidBlockAware)
    }

    /// Spot (with on-demand as the fallback).
    fn uses_spot(self) -> bool {
        self.uses_tiers() || self == PolicyName::IdleTimeoutSpot
    }
}

impl fmt::Display for PolicyName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown policy name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown policy {0:?}; use static-peak, reactive-idle-timeout, idle-timeout-spot, tidal or paid-block-aware"
)]
pub struct UnknownPolicy(pub String);

impl FromStr for PolicyName {
    type Err = UnknownPolicy;
    fn from_str(s: &str) -> Result<PolicyName, UnknownPolicy> {
        PolicyName::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| UnknownPolicy(s.to_string()))
    }
}

/// Per-worker throughput at the SLO (frames/s) from a measured latency
/// profile of `(batch size, batch latency µs)` points: the best
/// `batch / latency` among batches whose latency fits `batch_budget_us`
/// (half the compute budget: a frame may wait for the running batch, then
/// run in its own). 0 when no batch fits.
pub fn throughput_from_profile(profile: &[(u16, u32)], batch_budget_us: u32) -> f64 {
    profile
        .iter()
        .filter(|&&(b, lat)| b > 0 && lat > 0 && lat <= batch_budget_us)
        .map(|&(b, lat)| f64::from(b) * 1e6 / f64::from(lat))
        .fold(0.0, f64::max)
}

/// Load and capability of one model, measured by the gateway.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelLoad {
    /// Model name.
    pub model: String,
    /// Arrival rate over the last tick (frames/s).
    pub arrival_fps: f64,
    /// Frames queued now.
    pub queue_depth: u64,
    /// p95 end-to-end latency over the last tick (ms).
    pub p95_ms: f64,
    /// The latency budget (ms).
    pub budget_ms: f64,
    /// Per-worker throughput at the SLO, by instance type (frames/s), from
    /// the measured latency profiles.
    pub throughput_fps: BTreeMap<String, f64>,
}

/// One lease as the autoscaler sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeaseView {
    /// Id.
    pub id: LeaseId,
    /// The model it serves.
    pub model: String,
    /// Instance type.
    pub instance_type: String,
    /// Tier.
    pub tier: Tier,
    /// Lifecycle state.
    pub state: LeaseState,
    /// Billing start (None while requested).
    pub billing_start: Option<Millis>,
    /// Billing granularity.
    pub granularity: Granularity,
    /// Hourly price.
    pub price_per_hour: Money,
}

impl LeaseView {
    /// Until when the lease is paid at `now`. A lease with no billing start
    /// yet (its provider has not answered, or the write of its start is
    /// pending) is taken to start now: once it does, its first block is
    /// paid, so it is neither near a block end nor free to release.
    fn paid_until(&self, now: Millis) -> Millis {
        billing::paid_until(self.billing_start.unwrap_or(now), now, self.granularity)
    }
}

/// What the shell observed this tick.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Observation {
    /// Per model.
    pub models: Vec<ModelLoad>,
    /// Every lease not ended.
    pub leases: Vec<LeaseView>,
}

/// Inputs.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A periodic observation.
    Tick(Observation),
    /// A spot lease will be reclaimed at `deadline`.
    PreemptionNotice {
        /// The lease.
        lease: LeaseId,
        /// When.
        deadline: Millis,
    },
    /// The provider refused an acquire.
    AcquireRefused {
        /// Model it was for.
        model: String,
        /// Type asked for.
        instance_type: String,
        /// Tier asked for.
        tier: Tier,
    },
}

/// Why an acquire is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AcquireReason {
    /// Filling the reserved floor.
    ReservedFloor,
    /// The observed (or extrapolated) rate needs it.
    Demand,
    /// The tidal schedule needs it soon (pre-warm).
    Schedule,
    /// Replacing a preempted spot lease.
    PreemptionReplacement,
    /// Spot of one type was refused; another type's spot instead, or
    /// on-demand when no spot left is cheaper per frame.
    SpotRefused,
    /// A spot lease to take over from an on-demand one at its block end.
    Rebalance,
    /// The on-demand reserve held against spot preemptions.
    SpotHedge,
}

/// A type and tier to lease, with one worker's throughput and hourly
/// price ([`Autoscaler::lease_choice`]).
#[derive(Debug, Clone, PartialEq)]
struct Lease {
    instance_type: String,
    fps: f64,
    price: Money,
    tier: Tier,
}

/// Outputs.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Lease a worker.
    Acquire {
        /// For which model.
        model: String,
        /// Instance type.
        instance_type: String,
        /// Tier.
        tier: Tier,
        /// Why.
        reason: AcquireReason,
    },
    /// End a lease (stop dispatching first).
    Release {
        /// The lease.
        lease: LeaseId,
    },
    /// Dispatch nothing more to this lease from `at` (a preemption
    /// notice: the lease serves through its notice until a drain before
    /// the deadline, [`PolicyConfig::notice_drain_ms`]). An `at` not after
    /// the event's `now` stops dispatch at once.
    StopDispatch {
        /// The lease.
        lease: LeaseId,
        /// From when.
        at: Millis,
    },
}

#[derive(Debug, Clone)]
struct ModelState {
    /// The model's load as last observed (what a refusal between ticks
    /// sizes its fallback with).
    load: ModelLoad,
    history: VecDeque<(Millis, f64)>,
    learner: Learner,
    surplus_since: Option<Millis>,
    spot: SpotExposure,
}

/// The autoscaler.
#[derive(Debug)]
pub struct Autoscaler {
    cfg: PolicyConfig,
    catalog: Catalog,
    models: HashMap<String, ModelState>,
    leases: HashMap<LeaseId, LeaseView>,
    /// Until when each (model, type)'s spot is not asked for, after a
    /// spot refusal of that type (its pool short or dry).
    spot_refused_until: HashMap<(String, String), Millis>,
    /// Until when each refused on-demand or reserved (model, type, tier) is
    /// not asked for.
    refused_until: HashMap<(String, String, Tier), Millis>,
    /// Preempted leases whose on-demand replacement was already asked for.
    replaced: BTreeSet<LeaseId>,
    /// Leases stopped from dispatch (preemption notice).
    stopped: BTreeSet<LeaseId>,
    /// Reactive: when each lease became idle.
    idle_since: HashMap<LeaseId, Millis>,
    /// Since when each lease whose model had no [`ModelLoad`] has been seen
    /// so (see [`Autoscaler::release_orphans`]).
    orphan_since: HashMap<LeaseId, Millis>,
    /// Hourly price of acquisitions made since the last observation (they
    /// are not in its lease list yet).
    pending_burn: Money,
}

/// How many ms of history to keep for trend and down-window.
const HISTORY_MS: Millis = 30 * 60_000;

impl Autoscaler {
    /// A policy over `catalog`.
    pub fn new(cfg: PolicyConfig, catalog: Catalog) -> Autoscaler {
        Autoscaler {
            cfg,
            catalog,
            models: HashMap::new(),
            leases: HashMap::new(),
            spot_refused_until: HashMap::new(),
            refused_until: HashMap::new(),
            replaced: BTreeSet::new(),
            stopped: BTreeSet::new(),
            idle_since: HashMap::new(),
            orphan_since: HashMap::new(),
            pending_burn: Money::ZERO,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &PolicyConfig {
        &self.cfg
    }

    /// Handles one event.
    pub fn on_event(&mut self, now: Millis, event: Event) -> Vec<Action> {
        match event {
            Event::Tick(obs) => self.on_tick(now, obs),
            Event::PreemptionNotice { lease, deadline } => self.on_notice(now, lease, deadline),
            Event::AcquireRefused {
                model,
                instance_type,
                tier,
            } => self.on_refused(now, model, instance_type, tier),
        }
    }

    /// Sum of the hourly prices of every lease not ended, as last seen, plus
    /// what was acquired since.
    fn burn(&self) -> Money {
        self.leases
            .values()
            .filter(|l| !l.state.is_ended())
            .map(|l| l.price_per_hour)
            .sum::<Money>()
            + self.pending_burn
    }

    fn within_cap(&self, burn: Money, add: Money) -> bool {
        match self.cfg.spend_cap_per_hour {
            Some(cap) => burn + add <= cap,
            None => true,
        }
    }

    /// Whether `model`'s acquires of `instance_type` in `tier` may be made
    /// at `now`: not within the cool-off of a refusal of the same.
    fn may_ask(&self, now: Millis, model: &str, instance_type: &str, tier: Tier) -> bool {
        self.refused_until
            .get(&(model.to_string(), instance_type.to_string(), tier))
            .is_none_or(|&until| until <= now)
    }

    /// Whether `model` may ask for `instance_type` on spot now: no refusal
    /// of that type's spot is cooling off, and no capacity refusal.
    fn spot_askable(&self, now: Millis, model: &str, instance_type: &str) -> bool {
        self.may_ask(now, model, instance_type, Tier::Spot)
            && self
                .spot_refused_until
                .get(&(model.to_string(), instance_type.to_string()))
                .is_none_or(|&until| until <= now)
    }

    /// Whether `load`'s model may lease `instance_type` on spot now: its
    /// spot is askable ([`Autoscaler::spot_askable`]), and a worker of it
    /// serves at least `spot_fallback_min_share` of what the model's
    /// fastest type does.
    fn spot_candidate(&self, now: Millis, load: &ModelLoad, instance_type: &str) -> bool {
        let fastest = load.throughput_fps.values().copied().fold(0.0, f64::max);
        self.spot_askable(now, &load.model, instance_type)
            && load
                .throughput_fps
                .get(instance_type)
                .is_some_and(|&fps| fps >= self.cfg.spot_fallback_min_share * fastest)
    }

    /// Expected cost per frame of `ty` in `tier` for `load`: the hourly
    /// price over the type's throughput, spot's raised by the start-up a
    /// preemption wastes on the replacement. `None` for a type that does
    /// not serve the model or is not in the catalog.
    fn per_frame(&self, load: &ModelLoad, ty: &str, tier: Tier) -> Option<f64> {
        let fps = load.throughput_fps.get(ty).copied()?;
        if fps <= 0.0 || !fps.is_finite() {
            return None;
        }
        let it = self.catalog.get(ty)?;
        let mut effective = it.price_per_hour.get(tier).units();
        if tier == Tier::Spot {
            effective *= 1.0 + it.spot_interruptions_per_hour * f64::from(it.startup_secs) / 3600.0;
        }
        Some(effective / fps)
    }

    /// Cheapest type per frame for `tier` among those `askable`, as a
    /// [`Lease`] with its throughput and price.
    fn best_type(
        &self,
        load: &ModelLoad,
        tier: Tier,
        askable: impl Fn(&str) -> bool,
    ) -> Option<Lease> {
        let mut best: Option<(&String, f64, f64)> = None;
        for (ty, &fps) in &load.throughput_fps {
            if !askable(ty) {
                continue;
            }
            let Some(per_frame) = self.per_frame(load, ty, tier) else {
                continue;
            };
            if best.is_none_or(|b| per_frame < b.2) {
                best = Some((ty, fps, per_frame));
            }
        }
        best.and_then(|(ty, fps, _)| {
            Some(Lease {
                instance_type: ty.clone(),
                fps,
                price: self.catalog.get(ty)?.price_per_hour.get(tier),
                tier,
            })
        })
    }

    /// The cheapest on-demand type per frame that `load`'s model may ask
    /// for now (no capacity refusal cooling off).
    fn on_demand_choice(&self, now: Millis, load: &ModelLoad) -> Option<Lease> {
        self.best_type(load, Tier::OnDemand, |ty| {
            self.may_ask(now, &load.model, ty, Tier::OnDemand)
        })
    }

    /// What `load`'s model leases now ([`Lease`]): the cheapest spot
    /// candidate per frame ([`Autoscaler::spot_candidate`]) while it is
    /// cheaper per frame than the cheapest askable on-demand type, else
    /// that on-demand type. A refusal of one type's spot so moves the model
    /// to the next type's spot pool (a pool of its own: another type's
    /// shortage, reclaims and dry spells), and to on-demand only when no
    /// spot left is worth it. `None` when nothing is askable.
    fn lease_choice(&self, now: Millis, load: &ModelLoad) -> Option<Lease> {
        let on_demand = self.on_demand_choice(now, load);
        let spot = self
            .cfg
            .policy
            .uses_spot()
            .then(|| self.best_type(load, Tier::Spot, |ty| self.spot_candidate(now, load, ty)))
            .flatten();
        match (spot, on_demand) {
            (Some(spot), Some(od))
                if self.per_frame(load, &od.instance_type, Tier::OnDemand)
                    <= self.per_frame(load, &spot.instance_type, Tier::Spot) =>
            {
                Some(od)
            }
            (Some(spot), _) => Some(spot),
            (None, od) => od,
        }
    }

    fn startup_ms(&self, ty: &str) -> Millis {
        self.catalog
            .get(ty)
            .map_or(0, |i| u64::from(i.startup_secs) * 1000)
    }

    fn lease_fps(load: &ModelLoad, l: &LeaseView) -> f64 {
        load.throughput_fps
            .get(&l.instance_type)
            .copied()
            .unwrap_or(0.0)
    }

    fn schedule_min(&self, model: &str, t: Millis) -> f64 {
        let minute = ((t % DAY_MS) / 60_000) as u32;
        let configured = self
            .cfg
            .schedule
            .iter()
            .filter(|e| e.model == model && e.from_minute <= minute && minute < e.to_minute)
            .map(|e| e.min_fps)
            .fold(0.0, f64::max);
        let learned = if self.cfg.learn_schedule {
            self.models.get(model).map_or(0.0, |m| m.learner.min_at(t))
        } else {
            0.0
        };
        configured.max(learned)
    }

    /// Max of the schedule over `[from, to]`, sampled per slot.
    fn schedule_max(&self, model: &str, from: Millis, to: Millis) -> f64 {
        let mut t = from;
        let mut m = 0.0f64;
        let mut n = 0;
        while t <= to && n < SLOTS {
            m = m.max(self.schedule_min(model, t));
            t += SLOT_MS;
            n += 1;
        }
        m.max(self.schedule_min(model, to))
    }

    fn on_tick(&mut self, now: Millis, obs: Observation) -> Vec<Action> {
        let leases: HashMap<LeaseId, LeaseView> = obs
            .leases
            .iter()
            .filter(|l| !l.state.is_ended())
            .map(|l| (l.id, l.clone()))
            .collect();
        // A lease that held capacity (it had started) and has ended freed
        // a worker of its type (a static worker unbound, quota given
        // back): a refusal of that type is worth asking again at once.
        let freed: BTreeSet<&str> = self
            .leases
            .values()
            .filter(|l| l.billing_start.is_some() && !leases.contains_key(&l.id))
            .map(|l| l.instance_type.as_str())
            .collect();
        self.refused_until
            .retain(|(_, ty, _), _| !freed.contains(ty.as_str()));
        self.leases = leases;
        self.stopped.retain(|id| self.leases.contains_key(id));
        self.replaced.retain(|id| self.leases.contains_key(id));
        self.idle_since.retain(|id, _| self.leases.contains_key(id));
        self.refused_until.retain(|_, until| *until > now);
        self.pending_burn = Money::ZERO;
        let kept = self.floor_kept();
        let mut actions = Vec::new();
        let mut allow = Allowance {
            burn: self.burn(),
            acquires_left: self.cfg.max_acquire_per_event,
        };
        for load in &obs.models {
            let st = self
                .models
                .entry(load.model.clone())
                .or_insert_with(|| ModelState {
                    load: load.clone(),
                    history: VecDeque::new(),
                    learner: Learner::new(),
                    surplus_since: None,
                    spot: SpotExposure::default(),
                });
            st.load = load.clone();
            st.history.push_back((now, load.arrival_fps));
            while st
                .history
                .front()
                .is_some_and(|(t, _)| *t + HISTORY_MS < now)
            {
                st.history.pop_front();
            }
            st.learner.observe(now, load.arrival_fps);
            let spot = self
                .leases
                .values()
                .filter(|l| l.model == load.model && l.tier == Tier::Spot)
                .filter(|l| l.state != LeaseState::Draining && !self.stopped.contains(&l.id))
                .count() as u32;
            st.spot.tick(now, spot, self.cfg.hedge_window_ms);
            self.scale_model(now, load, &kept, &mut allow, &mut actions);
        }
        self.release_orphans(now, &obs.models, &kept, &mut actions);
        self.pending_burn = allow.burn - self.burn();
        actions
    }

    /// The reserved leases the floors keep: per floor, the first `count`
    /// reserved leases of its model and type (those that serve first, then
    /// the oldest). The other reserved leases (a floor lowered, its type
    /// changed, or no floor for their model any more) are surplus like any
    /// other lease.
    fn floor_kept(&self) -> BTreeSet<LeaseId> {
        let mut reserved: Vec<&LeaseView> = self
            .leases
            .values()
            .filter(|l| l.tier == Tier::Reserved)
            .collect();
        reserved.sort_by_key(|l| {
            let serves = l.state != LeaseState::Draining && !self.stopped.contains(&l.id);
            (!serves, l.id)
        });
        let mut kept = BTreeSet::new();
        for floor in &self.cfg.reserved {
            let ids: Vec<LeaseId> = reserved
                .iter()
                .filter(|l| l.model == floor.model && l.instance_type == floor.instance_type)
                .map(|l| l.id)
                .filter(|id| !kept.contains(id))
                .take(floor.count as usize)
                .collect();
            kept.extend(ids);
        }
        kept
    }

    /// Scale-down of the leases whose model has no [`ModelLoad`] in this
    /// observation: the model was removed from (or renamed in) the
    /// configuration while its leases were kept and adopted, or the lease
    /// has no model recorded (a ledger from before models were). No load
    /// needs them, so each is surplus as a whole, released by the policy's
    /// own rule: `paid-block-aware` within `release_window` of its paid
    /// block's end (an hourly one not with less than `release_lead` left);
    /// `tidal` once it has been surplus for `surplus_hold`;
    /// `reactive-idle-timeout` once it has been idle (it gets no frames)
    /// for `idle_timeout`; `static-peak`, whose fleet is sized per model,
    /// has no fleet for such a model and releases them at once. A reserved
    /// lease is kept only while a floor keeps it (`kept`, see
    /// [`Autoscaler::floor_kept`]).
    fn release_orphans(
        &mut self,
        now: Millis,
        models: &[ModelLoad],
        kept: &BTreeSet<LeaseId>,
        actions: &mut Vec<Action>,
    ) {
        let observed: BTreeSet<&str> = models.iter().map(|m| m.model.as_str()).collect();
        let mut orphans: Vec<&LeaseView> = self
            .leases
            .values()
            .filter(|l| !observed.contains(l.model.as_str()))
            .filter(|l| l.state != LeaseState::Draining && !self.stopped.contains(&l.id))
            .filter(|l| !kept.contains(&l.id))
            .collect();
        orphans.sort_by_key(|l| l.id);
        self.orphan_since
            .retain(|id, _| orphans.iter().any(|l| l.id == *id));
        let hold = match self.cfg.policy {
            PolicyName::StaticPeak => Some(0),
            PolicyName::ReactiveIdleTimeout | PolicyName::IdleTimeoutSpot => {
                Some(self.cfg.idle_timeout_ms)
            }
            PolicyName::Tidal => Some(self.cfg.surplus_hold_ms),
            PolicyName::PaidBlockAware => None,
        };
        for l in orphans {
            let release = match hold {
                Some(hold) => {
                    let since = *self.orphan_since.entry(l.id).or_insert(now);
                    now >= since.saturating_add(hold)
                }
                None => {
                    let left = l.paid_until(now).saturating_sub(now);
                    left <= self.cfg.release_window_ms
                        && !(l.granularity == Granularity::Hour && left < self.cfg.release_lead_ms)
                }
            };
            if release {
                tracing::info!(lease = %l.id, model = %l.model, "releasing a lease of a model with no load observed");
                self.orphan_since.remove(&l.id);
                actions.push(Action::Release { lease: l.id });
            }
        }
    }

    fn on_notice(&mut self, now: Millis, lease: LeaseId, deadline: Millis) -> Vec<Action> {
        // the lease serves on until a drain before the kill; for scale-up
        // it is gone at once, so its replacement starts now
        let at = deadline.saturating_sub(self.cfg.notice_drain_ms).max(now);
        let mut actions = vec![Action::StopDispatch { lease, at }];
        self.stopped.insert(lease);
        let Some(view) = self.leases.get(&lease).cloned() else {
            return actions;
        };
        // a notice repeated for the same lease is one interruption
        if !self.replaced.contains(&lease)
            && let Some(st) = self.models.get_mut(&view.model)
        {
            st.spot.notice(now);
        }
        if !self.replaced.insert(lease) {
            return actions;
        }
        // replace at once, on-demand, with the type the old lease was,
        // unless that was refused within its cool-off (the next tick then
        // chooses another type, or waits)
        let Some(it) = self.catalog.get(&view.instance_type) else {
            return actions;
        };
        if !self.may_ask(now, &view.model, &view.instance_type, Tier::OnDemand) {
            return actions;
        }
        let price = it.price_per_hour.on_demand;
        // the preempted lease stops costing at its deadline; until then both
        // count against the cap
        if self.within_cap(self.burn(), price) {
            self.pending_burn += price;
            actions.push(Action::Acquire {
                model: view.model,
                instance_type: view.instance_type,
                tier: Tier::OnDemand,
                reason: AcquireReason::PreemptionReplacement,
            });
        }
        actions
    }

    fn on_refused(
        &mut self,
        now: Millis,
        model: String,
        instance_type: String,
        tier: Tier,
    ) -> Vec<Action> {
        if tier != Tier::Spot {
            // no capacity of this type and tier: not asked for again until
            // the cool-off has passed (meanwhile the policy chooses another
            // type, or waits)
            let until = now.saturating_add(self.cfg.refused_cooloff_ms);
            let e = self
                .refused_until
                .entry((model, instance_type, tier))
                .or_insert(until);
            *e = (*e).max(until);
            return Vec::new();
        }
        self.spot_refused_until.insert(
            (model.clone(), instance_type.clone()),
            now + self.cfg.spot_refused_cooloff_ms,
        );
        // another type's spot pool while one is worth it, else on-demand
        // of the cheapest type per frame, as much throughput as was refused
        let load = self.models.get(&model).map(|st| st.load.clone());
        let fallback = load.as_ref().and_then(|load| {
            let lease = self.lease_choice(now, load)?;
            let refused_fps = load
                .throughput_fps
                .get(&instance_type)
                .copied()
                .unwrap_or(lease.fps);
            let n = (refused_fps / lease.fps).ceil().clamp(1.0, 64.0) as u32;
            Some((lease.instance_type, lease.tier, lease.price, n))
        });
        let (ty, tier, price, n) = match fallback {
            Some(f) => f,
            // no load seen yet (or no type askable on-demand): on-demand
            // of the refused type, if it may be asked for
            None => {
                if !self.may_ask(now, &model, &instance_type, Tier::OnDemand) {
                    return Vec::new();
                }
                let Some(it) = self.catalog.get(&instance_type) else {
                    return Vec::new();
                };
                (
                    instance_type,
                    Tier::OnDemand,
                    it.price_per_hour.on_demand,
                    1,
                )
            }
        };
        let mut actions = Vec::new();
        for _ in 0..n {
            if !self.within_cap(self.burn(), price) {
                break;
            }
            self.pending_burn += price;
            actions.push(Action::Acquire {
                model: model.clone(),
                instance_type: ty.clone(),
                tier,
                reason: AcquireReason::SpotRefused,
            });
        }
        actions
    }
}

#[cfg(test)]
mod tests {
    use super::scale::trend;
    use super::*;

    fn load(fps: f64) -> ModelLoad {
        ModelLoad {
            model: "m".into(),
            arrival_fps: fps,
            queue_depth: 0,
            p95_ms: 10.0,
            budget_ms: 80.0,
            throughput_fps: [("a100".to_string(), 100.0)].into_iter().collect(),
        }
    }

    fn view(id: u64, tier: Tier, start: Millis, state: LeaseState) -> LeaseView {
        LeaseView {
            id: LeaseId(id),
            model: "m".into(),
            instance_type: "a100".into(),
            tier,
            state,
            billing_start: Some(start),
            granularity: Granularity::Hour,
            price_per_hour: Catalog::default_catalog()
                .get("a100")
                .unwrap()
                .price_per_hour
                .get(tier),
        }
    }

    /// A reserved floor of `count` leases of type `ty` for `model`.
    fn floor(model: &str, ty: &str, count: u32) -> ReservedFloor {
        ReservedFloor {
            model: model.into(),
            instance_type: ty.into(),
            count,
        }
    }

    fn cfg(p: PolicyName) -> PolicyConfig {
        let mut c = PolicyConfig::new(p);
        c.headroom = 0.0;
        c
    }

    fn acquires(a: &[Action]) -> usize {
        a.iter()
            .filter(|a| matches!(a, Action::Acquire { .. }))
            .count()
    }

    #[test]
    fn scales_up_to_the_rate_on_spot_after_the_reserved_floor() {
        let mut c = cfg(PolicyName::PaidBlockAware);
        c.reserved.push(floor("m", "a100", 2));
        let mut a = Autoscaler::new(c, Catalog::default_catalog());
        let acts = a.on_event(
            0,
            Event::Tick(Observation {
                models: vec![load(450.0)],
                leases: vec![],
            }),
        );
        let tiers: Vec<Tier> = acts
            .iter()
            .filter_map(|a| match a {
                Action::Acquire { tier, .. } => Some(*tier),
                _ => None,
            })
            .collect();
        assert_eq!(
            tiers,
            vec![
                Tier::Reserved,
                Tier::Reserved,
                Tier::Spot,
                Tier::Spot,
                Tier::Spot
            ]
        );
    }

    #[test]
    fn paid_block_aware_keeps_a_surplus_lease_until_its_block_is_nearly_over() {
        let mut a = Autoscaler::new(cfg(PolicyName::PaidBlockAware), Catalog::default_catalog());
        let leases = vec![
            view(1, Tier::Spot, 0, LeaseState::Ready),
            view(2, Tier::Spot, 20 * 60_000, LeaseState::Ready),
        ];
        let obs = |l: &Vec<LeaseView>| {
            Event::Tick(Observation {
                models: vec![load(50.0)],
                leases: l.clone(),
            })
        };
        // 30 minutes in: lease 1 is paid until 60 min; keep it
        let acts = a.on_event(30 * 60_000, obs(&leases));
        assert!(acts.is_empty(), "{acts:?}");
        // 58 minutes in: within the release window of lease 1's block end
        let acts = a.on_event(58 * 60_000, obs(&leases));
        assert_eq!(acts, vec![Action::Release { lease: LeaseId(1) }]);
    }

    #[test]
    fn paid_block_aware_keeps_an_hourly_lease_whose_release_would_land_in_the_next_block() {
        let scaler = || {
            let mut c = cfg(PolicyName::PaidBlockAware);
            c.release_lead_ms = 3000;
            Autoscaler::new(c, Catalog::default_catalog())
        };
        let obs = |l: Vec<LeaseView>| {
            Event::Tick(Observation {
                models: vec![load(50.0)],
                leases: l,
            })
        };
        let hourly = || {
            vec![
                view(1, Tier::Spot, 0, LeaseState::Ready),
                view(2, Tier::Spot, 0, LeaseState::Ready),
            ]
        };
        // 2 s before the block ends: a release would complete after it
        let acts = scaler().on_event(60 * 60_000 - 2000, obs(hourly()));
        assert!(acts.is_empty(), "{acts:?}");
        // 3 s before: it completes in time
        let acts = scaler().on_event(60 * 60_000 - 3000, obs(hourly()));
        assert_eq!(acts, vec![Action::Release { lease: LeaseId(1) }]);
        // per-second billing past its minimum has no block to buy: the
        // surplus goes whenever it is seen
        let secondly = |id| LeaseView {
            granularity: Granularity::Second { minimum_secs: 60 },
            ..view(id, Tier::Spot, 0, LeaseState::Ready)
        };
        let acts = scaler().on_event(10 * 60_000, obs(vec![secondly(1), secondly(2)]));
        assert_eq!(acts, vec![Action::Release { lease: LeaseId(1) }]);
    }

    #[test]
    fn tidal_releases_surplus_mid_block() {
        let mut a = Autoscaler::new(cfg(PolicyName::Tidal), Catalog::default_catalog());
        let leases = vec![
            view(1, Tier::Spot, 0, LeaseState::Ready),
            view(2, Tier::Spot, 20 * 60_000, LeaseState::Ready),
        ];
        let obs = || {
            Event::Tick(Observation {
                models: vec![load(50.0)],
                leases: leases.clone(),
            })
        };
        assert!(a.on_event(30 * 60_000, obs()).is_empty());
        let acts = a.on_event(33 * 60_000, obs());
        assert_eq!(acts, vec![Action::Release { lease: LeaseId(2) }]);
    }

    #[test]
    fn reactive_releases_after_five_idle_minutes() {
        let mut a = Autoscaler::new(
            cfg(PolicyName::ReactiveIdleTimeout),
            Catalog::default_catalog(),
        );
        let leases = vec![
            view(1, Tier::OnDemand, 0, LeaseState::Ready),
            view(2, Tier::OnDemand, 60_000, LeaseState::Ready),
        ];
        let obs = || {
            Event::Tick(Observation {
                models: vec![load(80.0)],
                leases: leases.clone(),
            })
        };
        assert!(a.on_event(10 * 60_000, obs()).is_empty());
        assert!(a.on_event(14 * 60_000, obs()).is_empty());
        assert_eq!(
            a.on_event(15 * 60_000, obs()),
            vec![Action::Release { lease: LeaseId(2) }]
        );
    }

    /// The tier of every acquire in `acts`.
    fn acquire_tiers(acts: &[Action]) -> Vec<Tier> {
        acts.iter()
            .filter_map(|a| match a {
                Action::Acquire { tier, .. } => Some(*tier),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn idle_timeout_spot_scales_up_on_spot_without_reserved_floor_or_schedule() {
        let mut c = cfg(PolicyName::IdleTimeoutSpot);
        // given a floor and a schedule, it uses neither
        c.reserved = vec![floor("m", "a100", 2)];
        c.schedule = vec![ScheduleEntry {
            model: "m".into(),
            from_minute: 0,
            to_minute: 1440,
            min_fps: 900.0,
        }];
        let mut a = Autoscaler::new(c, Catalog::default_catalog());
        let acts = a.on_event(
            60_000,
            Event::Tick(Observation {
                models: vec![load(250.0)],
                leases: vec![],
            }),
        );
        assert_eq!(acquire_tiers(&acts), vec![Tier::Spot; 3]);
        assert!(acts.iter().all(|a| matches!(
            a,
            Action::Acquire {
                reason: AcquireReason::Demand,
                ..
            }
        )));
    }

    #[test]
    fn idle_timeout_spot_falls_back_to_on_demand_for_the_cool_off_after_a_spot_refusal() {
        let c = cfg(PolicyName::IdleTimeoutSpot);
        let cooloff = c.spot_refused_cooloff_ms;
        let mut a = Autoscaler::new(c, Catalog::default_catalog());
        let acts = a.on_event(0, refused("a100", Tier::Spot));
        assert_eq!(acquire_tiers(&acts), vec![Tier::OnDemand]);
        let tick = |a: &mut Autoscaler, now| {
            a.on_event(
                now,
                Event::Tick(Observation {
                    models: vec![load(150.0)],
                    leases: vec![],
                }),
            )
        };
        assert_eq!(
            acquire_tiers(&tick(&mut a, cooloff / 2)),
            vec![Tier::OnDemand; 2]
        );
        assert_eq!(
            acquire_tiers(&tick(&mut a, cooloff - 1000)),
            vec![Tier::OnDemand; 2]
        );
        assert_eq!(acquire_tiers(&tick(&mut a, cooloff)), vec![Tier::Spot; 2]);
        // a preempted spot lease is replaced on-demand at once
        let acts = a.on_event(
            cooloff + 1000,
            Event::PreemptionNotice {
                lease: LeaseId(7),
                deadline: cooloff + 121_000,
            },
        );
        assert_eq!(
            acts,
            vec![Action::StopDispatch {
                lease: LeaseId(7),
                at: cooloff + 111_000
            }]
        );
        a.on_event(
            cooloff + 60_000,
            Event::Tick(Observation {
                models: vec![load(90.0)],
                leases: vec![view(8, Tier::Spot, 0, LeaseState::Ready)],
            }),
        );
        let acts = a.on_event(
            cooloff + 61_000,
            Event::PreemptionNotice {
                lease: LeaseId(8),
                deadline: cooloff + 181_000,
            },
        );
        assert_eq!(
            acts[0],
            Action::StopDispatch {
                lease: LeaseId(8),
                at: cooloff + 171_000
            }
        );
        assert_eq!(acquire_tiers(&acts), vec![Tier::OnDemand]);
    }

    /// A load whose model runs on three types: two fast ones (H100, H200)
    /// and a slow one (A100, a third of their throughput).
    fn load_on_three_types(fps: f64) -> ModelLoad {
        ModelLoad {
            throughput_fps: [("h100", 1000.0), ("h200", 1000.0), ("a100", 340.0)]
                .into_iter()
                .map(|(t, f)| (t.to_string(), f))
                .collect(),
            ..load(fps)
        }
    }

    fn acquired(acts: &[Action]) -> Vec<(String, Tier, AcquireReason)> {
        acts.iter()
            .filter_map(|a| match a {
                Action::Acquire {
                    instance_type,
                    tier,
                    reason,
                    ..
                } => Some((instance_type.clone(), *tier, *reason)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_spot_refusal_moves_the_model_to_the_next_fast_types_spot_then_to_on_demand() {
        for policy in [PolicyName::IdleTimeoutSpot, PolicyName::PaidBlockAware] {
            let c = cfg(policy);
            let cooloff = c.spot_refused_cooloff_ms;
            let mut a = Autoscaler::new(c, Catalog::default_catalog());
            let tick = |a: &mut Autoscaler, now, fps| {
                a.on_event(
                    now,
                    Event::Tick(Observation {
                        models: vec![load_on_three_types(fps)],
                        leases: vec![],
                    }),
                )
            };
            let spot = |ty: &str, reason| (ty.to_string(), Tier::Spot, reason);
            assert_eq!(
                acquired(&tick(&mut a, 0, 1500.0)),
                vec![spot("h100", AcquireReason::Demand); 2],
                "{policy}"
            );
            // H100's pool refused: the refused worker is leased from H200's
            let acts = a.on_event(1000, refused("h100", Tier::Spot));
            assert_eq!(
                acquired(&acts),
                vec![spot("h200", AcquireReason::SpotRefused)],
                "{policy}"
            );
            assert_eq!(
                acquired(&tick(&mut a, cooloff / 2, 1500.0)),
                vec![spot("h200", AcquireReason::Demand); 2],
                "{policy}"
            );
            // H200's refused too: the A100 serves a third of what they do,
            // so on-demand of the cheapest type per frame
            let acts = a.on_event(cooloff / 2 + 1000, refused("h200", Tier::Spot));
            assert_eq!(
                acquired(&acts),
                vec![(
                    "h100".to_string(),
                    Tier::OnDemand,
                    AcquireReason::SpotRefused
                )],
                "{policy}"
            );
            assert_eq!(
                acquired(&tick(&mut a, cooloff, 1500.0)),
                vec![("h100".to_string(), Tier::OnDemand, AcquireReason::Demand); 2],
                "{policy}"
            );
            // each pool's cool-off ends on its own
            assert_eq!(
                acquired(&tick(&mut a, cooloff + 1000, 1500.0)),
                vec![spot("h100", AcquireReason::Demand); 2],
                "{policy}"
            );
        }
    }

    #[test]
    fn with_no_least_share_a_refused_fast_worker_is_replaced_by_as_many_slow_ones_as_it_served() {
        let mut c = cfg(PolicyName::PaidBlockAware);
        c.spot_fallback_min_share = 0.0;
        let mut a = Autoscaler::new(c, Catalog::default_catalog());
        a.on_event(
            0,
            Event::Tick(Observation {
                models: vec![load_on_three_types(500.0)],
                leases: vec![],
            }),
        );
        a.on_event(1000, refused("h100", Tier::Spot));
        let acts = a.on_event(2000, refused("h200", Tier::Spot));
        // 1000 fps refused, 340 fps an A100: three A100s
        assert_eq!(
            acquired(&acts),
            vec![("a100".to_string(), Tier::Spot, AcquireReason::SpotRefused); 3]
        );
    }

    #[test]
    fn idle_timeout_spot_releases_a_lease_idle_five_minutes_whatever_its_paid_block() {
        let mut a = Autoscaler::new(cfg(PolicyName::IdleTimeoutSpot), Catalog::default_catalog());
        let leases = vec![
            view(1, Tier::Spot, 0, LeaseState::Ready),
            view(2, Tier::Spot, 60_000, LeaseState::Ready),
        ];
        let obs = |fps| {
            Event::Tick(Observation {
                models: vec![load(fps)],
                leases: leases.clone(),
            })
        };
        // idle from minute 10; busy again at minute 13 resets it
        assert!(a.on_event(10 * 60_000, obs(80.0)).is_empty());
        assert!(a.on_event(13 * 60_000, obs(180.0)).is_empty());
        assert!(a.on_event(14 * 60_000, obs(80.0)).is_empty());
        assert!(a.on_event(18 * 60_000, obs(80.0)).is_empty());
        // five idle minutes, 18 minutes into its paid hour: released
        assert_eq!(
            a.on_event(19 * 60_000, obs(80.0)),
            vec![Action::Release { lease: LeaseId(2) }]
        );
    }

    #[test]
    fn a_preempted_lease_serves_until_a_drain_before_its_deadline_and_is_replaced_at_once() {
        let mut a = Autoscaler::new(cfg(PolicyName::PaidBlockAware), Catalog::default_catalog());
        let leases = vec![view(1, Tier::Spot, 0, LeaseState::Ready)];
        a.on_event(
            60_000,
            Event::Tick(Observation {
                models: vec![load(90.0)],
                leases,
            }),
        );
        let acts = a.on_event(
            61_000,
            Event::PreemptionNotice {
                lease: LeaseId(1),
                deadline: 181_000,
            },
        );
        // dispatch stops 10 s before the kill, not at the notice
        assert_eq!(
            acts[0],
            Action::StopDispatch {
                lease: LeaseId(1),
                at: 171_000
            }
        );
        assert!(matches!(
            &acts[1],
            Action::Acquire {
                tier: Tier::OnDemand,
                reason: AcquireReason::PreemptionReplacement,
                ..
            }
        ));
        assert_eq!(acts.len(), 2);
        // while it serves on, it is not capacity: the tick after, with it
        // still ready and its replacement starting, neither acquires more
        // nor releases either
        let acts = a.on_event(
            120_000,
            Event::Tick(Observation {
                models: vec![load(90.0)],
                leases: vec![
                    view(1, Tier::Spot, 0, LeaseState::Ready),
                    view(2, Tier::OnDemand, 62_000, LeaseState::Starting),
                ],
            }),
        );
        assert!(acts.is_empty(), "{acts:?}");
        // a notice shorter than the drain stops dispatch at once
        let mut a = Autoscaler::new(cfg(PolicyName::PaidBlockAware), Catalog::default_catalog());
        a.on_event(
            60_000,
            Event::Tick(Observation {
                models: vec![load(90.0)],
                leases: vec![view(1, Tier::Spot, 0, LeaseState::Ready)],
            }),
        );
        let acts = a.on_event(
            61_000,
            Event::PreemptionNotice {
                lease: LeaseId(1),
                deadline: 66_000,
            },
        );
        assert_eq!(
            acts[0],
            Action::StopDispatch {
                lease: LeaseId(1),
                at: 61_000
            }
        );
    }

    /// Whether `acts` is one spot acquire for a rebalance (a hand-over).
    fn one_spot_rebalance(acts: &[Action]) -> bool {
        matches!(
            acts,
            [Action::Acquire {
                tier: Tier::Spot,
                reason: AcquireReason::Rebalance,
                ..
            }]
        )
    }

    #[test]
    fn paid_block_aware_hands_an_on_demand_lease_over_to_spot_at_its_block_end() {
        let mut a = Autoscaler::new(cfg(PolicyName::PaidBlockAware), Catalog::default_catalog());
        let od = view(1, Tier::OnDemand, 0, LeaseState::Ready);
        let tick = |l: Vec<LeaseView>| {
            Event::Tick(Observation {
                models: vec![load(90.0)],
                leases: l,
            })
        };
        // mid-block: nothing to do
        assert!(a.on_event(30 * 60_000, tick(vec![od.clone()])).is_empty());
        // a start-up (150 s) + window (3 min) + a tick before the block end:
        // a spot replacement starts
        let acts = a.on_event(54 * 60_000, tick(vec![od.clone()]));
        assert!(one_spot_rebalance(&acts), "{acts:?}");
        // still starting at 56 min: nothing to do yet
        let spot = view(2, Tier::Spot, 54 * 60_000, LeaseState::Starting);
        let acts = a.on_event(56 * 60_000, tick(vec![od.clone(), spot.clone()]));
        assert!(acts.is_empty(), "{acts:?}");
        // ready after its start-up; within the release window the on-demand
        // lease goes
        let spot = LeaseView {
            state: LeaseState::Ready,
            ..spot
        };
        let acts = a.on_event(57 * 60_000, tick(vec![od, spot]));
        assert_eq!(acts, vec![Action::Release { lease: LeaseId(1) }]);
    }

    #[test]
    fn paid_block_aware_keeps_an_on_demand_lease_for_another_block_while_its_spot_replacement_is_not_ready()
     {
        let mut c = cfg(PolicyName::PaidBlockAware);
        c.release_lead_ms = 3000;
        let mut a = Autoscaler::new(c, Catalog::default_catalog());
        let od = view(1, Tier::OnDemand, 0, LeaseState::Ready);
        let tick = |l: Vec<LeaseView>| {
            Event::Tick(Observation {
                models: vec![load(90.0)],
                leases: l,
            })
        };
        let acts = a.on_event(54 * 60_000, tick(vec![od.clone()]));
        assert_eq!(acquires(&acts), 1, "{acts:?}");
        // the spot replacement never becomes ready: every tick of the
        // release window, up to the last one a release could complete in,
        // keeps the only lease that serves
        let spot = view(2, Tier::Spot, 54 * 60_000, LeaseState::Starting);
        let mut now = 57 * 60_000;
        while now <= 60 * 60_000 - 3000 {
            let acts = a.on_event(now, tick(vec![od.clone(), spot.clone()]));
            assert!(acts.is_empty(), "at {now} ms: {acts:?}");
            now += 1000;
        }
        // the next block is paid: the lease serves on, and nothing more is
        // acquired while the spot lease is still starting
        let acts = a.on_event(61 * 60_000, tick(vec![od, spot]));
        assert!(acts.is_empty(), "{acts:?}");
    }

    #[test]
    fn an_on_demand_lease_with_no_billing_start_yet_is_not_handed_over_to_spot() {
        let mut a = Autoscaler::new(cfg(PolicyName::PaidBlockAware), Catalog::default_catalog());
        let spot = view(1, Tier::Spot, 0, LeaseState::Ready);
        a.on_event(
            60_000,
            Event::Tick(Observation {
                models: vec![load(90.0)],
                leases: vec![spot.clone()],
            }),
        );
        let acts = a.on_event(
            61_000,
            Event::PreemptionNotice {
                lease: LeaseId(1),
                deadline: 181_000,
            },
        );
        assert_eq!(acquires(&acts), 1, "{acts:?}");
        let draining = LeaseView {
            state: LeaseState::Draining,
            ..spot
        };
        // the on-demand replacement, before its provider has answered
        // (requested) and after, while the write of its billing start
        // waits for a retry (starting, no billing start in the ledger)
        for (at, state) in [
            (62_000, LeaseState::Requested),
            (63_000, LeaseState::Starting),
        ] {
            let replacement = LeaseView {
                billing_start: None,
                ..view(2, Tier::OnDemand, 0, state)
            };
            let acts = a.on_event(
                at,
                Event::Tick(Observation {
                    models: vec![load(90.0)],
                    leases: vec![draining.clone(), replacement],
                }),
            );
            assert!(acts.is_empty(), "{state:?}: {acts:?}");
        }
    }

    fn reserved(id: u64, ty: &str, start: Millis) -> LeaseView {
        let price = Catalog::default_catalog()
            .get(ty)
            .unwrap()
            .price_per_hour
            .reserved;
        LeaseView {
            instance_type: ty.into(),
            price_per_hour: price,
            ..view(id, Tier::Reserved, start, LeaseState::Ready)
        }
    }

    #[test]
    fn reserved_leases_beyond_a_lowered_floor_are_released_at_their_block_end() {
        // three reserved leases adopted after a restart that lowered the
        // floor from 3 to 1; no load at all
        let mut c = cfg(PolicyName::PaidBlockAware);
        c.reserved.push(floor("m", "a100", 1));
        let mut a = Autoscaler::new(c, Catalog::default_catalog());
        let tick = || {
            Event::Tick(Observation {
                models: vec![load(0.0)],
                leases: (1..=3).map(|i| reserved(i, "a100", 0)).collect(),
            })
        };
        // paid until 60 min: kept mid-block
        let acts = a.on_event(30 * 60_000, tick());
        assert!(acts.is_empty(), "{acts:?}");
        // the floor keeps the first; the others go at their block end
        let acts = a.on_event(58 * 60_000, tick());
        assert_eq!(
            acts,
            vec![
                Action::Release { lease: LeaseId(2) },
                Action::Release { lease: LeaseId(3) }
            ]
        );
    }

    #[test]
    fn a_reserved_lease_of_a_floors_former_type_is_released_once_the_new_type_serves() {
        // the floor's type changed from a100 to h100
        let mut c = cfg(PolicyName::PaidBlockAware);
        c.reserved.push(floor("m", "h100", 1));
        let mut a = Autoscaler::new(c, Catalog::default_catalog());
        let mut l = load(0.0);
        l.throughput_fps.insert("h100".into(), 300.0);
        let tick = |leases: Vec<LeaseView>| {
            Event::Tick(Observation {
                models: vec![l.clone()],
                leases,
            })
        };
        let old = reserved(1, "a100", 0);
        let acts = a.on_event(30 * 60_000, tick(vec![old.clone()]));
        assert_eq!(
            acts,
            vec![Action::Acquire {
                model: "m".into(),
                instance_type: "h100".into(),
                tier: Tier::Reserved,
                reason: AcquireReason::ReservedFloor,
            }]
        );
        let new = reserved(2, "h100", 30 * 60_000);
        let acts = a.on_event(58 * 60_000, tick(vec![old, new.clone()]));
        assert_eq!(acts, vec![Action::Release { lease: LeaseId(1) }]);
        // the floor's own lease is kept through its block end
        let acts = a.on_event(88 * 60_000, tick(vec![new]));
        assert!(acts.is_empty(), "{acts:?}");
    }

    fn refused(ty: &str, tier: Tier) -> Event {
        Event::AcquireRefused {
            model: "m".into(),
            instance_type: ty.into(),
            tier,
        }
    }

    #[test]
    fn a_refused_on_demand_type_is_not_asked_for_again_until_its_cool_off_ends() {
        let mut a = Autoscaler::new(
            cfg(PolicyName::ReactiveIdleTimeout),
            Catalog::default_catalog(),
        );
        let tick = |l: ModelLoad| {
            Event::Tick(Observation {
                models: vec![l],
                leases: vec![],
            })
        };
        assert_eq!(acquires(&a.on_event(0, tick(load(150.0)))), 2);
        // both refused (a static fleet, a quota): a minute from the last
        assert!(a.on_event(10, refused("a100", Tier::OnDemand)).is_empty());
        assert!(a.on_event(20, refused("a100", Tier::OnDemand)).is_empty());
        // ticks of 100 ms for that minute ask for nothing
        let mut now = 100;
        while now < 60_020 {
            let acts = a.on_event(now, tick(load(150.0)));
            assert!(acts.is_empty(), "at {now} ms: {acts:?}");
            now += 100;
        }
        // the cool-off is over: asked again
        assert_eq!(acquires(&a.on_event(60_020, tick(load(150.0)))), 2);
        // with another type to choose, the refused one is passed over
        assert!(
            a.on_event(60_030, refused("a100", Tier::OnDemand))
                .is_empty()
        );
        let mut both = load(150.0);
        both.throughput_fps.insert("h100".into(), 300.0);
        let acts = a.on_event(60_100, tick(both));
        assert_eq!(
            acts,
            vec![Action::Acquire {
                model: "m".into(),
                instance_type: "h100".into(),
                tier: Tier::OnDemand,
                reason: AcquireReason::Demand,
            }]
        );
    }

    #[test]
    fn a_lease_of_a_refused_type_that_ends_lifts_its_cool_off() {
        let mut a = Autoscaler::new(
            cfg(PolicyName::ReactiveIdleTimeout),
            Catalog::default_catalog(),
        );
        let tick = |leases: Vec<LeaseView>| {
            Event::Tick(Observation {
                models: vec![load(150.0)],
                leases,
            })
        };
        let serving = view(1, Tier::OnDemand, 0, LeaseState::Ready);
        assert_eq!(acquires(&a.on_event(0, tick(vec![serving.clone()]))), 1);
        assert!(a.on_event(10, refused("a100", Tier::OnDemand)).is_empty());
        assert!(a.on_event(100, tick(vec![serving])).is_empty());
        // the lease ended (its static worker unbound, its quota given
        // back): that type is asked for again at once
        assert_eq!(acquires(&a.on_event(200, tick(vec![]))), 2);
        // a refused acquire that ends never held capacity: no lift
        assert!(a.on_event(210, refused("a100", Tier::OnDemand)).is_empty());
        let refused_lease = LeaseView {
            billing_start: None,
            ..view(3, Tier::OnDemand, 0, LeaseState::Requested)
        };
        assert!(a.on_event(300, tick(vec![refused_lease])).is_empty());
        assert!(a.on_event(400, tick(vec![])).is_empty());
    }

    #[test]
    fn a_refused_reserved_floor_waits_its_cool_off_while_spot_covers_the_load() {
        let mut c = cfg(PolicyName::PaidBlockAware);
        c.reserved.push(floor("m", "a100", 1));
        let mut a = Autoscaler::new(c, Catalog::default_catalog());
        let mut tiers_at = |now| -> Vec<Tier> {
            let event = match now {
                10 => refused("a100", Tier::Reserved),
                _ => Event::Tick(Observation {
                    models: vec![load(90.0)],
                    leases: vec![],
                }),
            };
            a.on_event(now, event)
                .into_iter()
                .filter_map(|a| match a {
                    Action::Acquire { tier, .. } => Some(tier),
                    _ => None,
                })
                .collect()
        };
        assert_eq!(tiers_at(0), vec![Tier::Reserved]);
        // refused: nothing instead at once, spot at the next tick
        assert_eq!(tiers_at(10), vec![]);
        assert_eq!(tiers_at(1_000), vec![Tier::Spot]);
        // the floor is asked for again once the cool-off has passed
        assert_eq!(tiers_at(60_010), vec![Tier::Reserved]);
    }

    #[test]
    fn a_spot_refusal_does_not_fall_back_to_an_on_demand_type_cooling_off() {
        let mut a = Autoscaler::new(cfg(PolicyName::PaidBlockAware), Catalog::default_catalog());
        assert!(a.on_event(0, refused("a100", Tier::OnDemand)).is_empty());
        assert!(a.on_event(10, refused("a100", Tier::Spot)).is_empty());
        // once the on-demand cool-off ends, spot still cooling off
        let acts = a.on_event(60_000, refused("a100", Tier::Spot));
        assert_eq!(
            acts,
            vec![Action::Acquire {
                model: "m".into(),
                instance_type: "a100".into(),
                tier: Tier::OnDemand,
                reason: AcquireReason::SpotRefused,
            }]
        );
    }

    fn schedule_acquires(acts: &[Action]) -> usize {
        acts.iter()
            .filter(|a| {
                matches!(
                    a,
                    Action::Acquire {
                        reason: AcquireReason::Schedule,
                        ..
                    }
                )
            })
            .count()
    }

    #[test]
    fn configured_schedule_is_pre_warmed_one_start_up_ahead() {
        let mut c = cfg(PolicyName::PaidBlockAware);
        c.learn_schedule = false;
        c.schedule.push(ScheduleEntry {
            model: "m".into(),
            from_minute: 8 * 60,
            to_minute: 20 * 60,
            min_fps: 500.0,
        });
        let mut a = Autoscaler::new(c, Catalog::default_catalog());
        let at = |h: u64, m: u64| h * 3_600_000 + m * 60_000;
        let idle = || {
            Event::Tick(Observation {
                models: vec![load(0.0)],
                leases: vec![],
            })
        };
        // start-up 150 s + one tick: the ramp at 08:00 is seen from 07:57
        assert!(a.on_event(at(7, 50), idle()).is_empty());
        assert_eq!(schedule_acquires(&a.on_event(at(7, 57), idle())), 5);
    }

    #[test]
    fn yesterdays_ramp_is_learned_and_pre_warmed_today() {
        let mut a = Autoscaler::new(cfg(PolicyName::PaidBlockAware), Catalog::default_catalog());
        let tick = |fps: f64| {
            Event::Tick(Observation {
                models: vec![load(fps)],
                leases: vec![],
            })
        };
        // day 0: 0 fps at night, 400 fps from 08:00 to 20:00
        for minute in (0..24 * 60).step_by(5) {
            let fps = if (8 * 60..20 * 60).contains(&minute) {
                400.0
            } else {
                0.0
            };
            a.on_event(minute * 60_000, tick(fps));
        }
        // day 1, still quiet at 07:57: capacity for 08:00 starts now
        let day1 = DAY_MS;
        assert!(
            a.on_event(day1 + 7 * 3_600_000 + 40 * 60_000, tick(0.0))
                .is_empty()
        );
        let acts = a.on_event(day1 + 7 * 3_600_000 + 57 * 60_000, tick(0.0));
        assert_eq!(schedule_acquires(&acts), 4, "{acts:?}");
    }

    #[test]
    fn spend_cap_stops_scale_up() {
        let mut c = cfg(PolicyName::PaidBlockAware);
        c.spend_cap_per_hour = Some(Money::from_units(20.0)); // two a100 spot (7.70)
        let mut a = Autoscaler::new(c, Catalog::default_catalog());
        let acts = a.on_event(
            0,
            Event::Tick(Observation {
                models: vec![load(1000.0)],
                leases: vec![],
            }),
        );
        assert_eq!(acquires(&acts), 2);
    }

    #[test]
    fn spot_refusal_falls_back_to_on_demand() {
        let mut a = Autoscaler::new(cfg(PolicyName::PaidBlockAware), Catalog::default_catalog());
        let acts = a.on_event(
            0,
            Event::AcquireRefused {
                model: "m".into(),
                instance_type: "a100".into(),
                tier: Tier::Spot,
            },
        );
        assert!(matches!(
            &acts[0],
            Action::Acquire {
                tier: Tier::OnDemand,
                ..
            }
        ));
        // and the next scale-up uses on-demand during the cool-off
        let acts = a.on_event(
            30_000,
            Event::Tick(Observation {
                models: vec![load(150.0)],
                leases: vec![],
            }),
        );
        assert!(acts.iter().all(|a| matches!(
            a,
            Action::Acquire {
                tier: Tier::OnDemand,
                ..
            }
        )));
    }

    #[test]
    fn throughput_comes_from_the_largest_batch_that_fits() {
        let profile = [(1, 4_000), (8, 12_000), (16, 20_000), (32, 41_000)];
        // 32 does not fit 30 ms; 16 / 20 ms = 800 fps is the best
        assert_eq!(throughput_from_profile(&profile, 30_000), 800.0);
        assert_eq!(throughput_from_profile(&profile, 3_000), 0.0);
    }

    fn of_model(model: &str, v: LeaseView) -> LeaseView {
        LeaseView {
            model: model.into(),
            ..v
        }
    }

    #[test]
    fn paid_block_aware_releases_leases_of_an_unobserved_model_at_their_block_end() {
        let mut a = Autoscaler::new(cfg(PolicyName::PaidBlockAware), Catalog::default_catalog());
        let leases = vec![
            // needed by model m (50 fps on a 100 fps lease)
            view(1, Tier::Spot, 0, LeaseState::Ready),
            // a model removed from the configuration, adopted after a restart
            of_model("renamed", view(2, Tier::Spot, 0, LeaseState::Ready)),
            // migrated from a ledger with no model column: model ""
            of_model("", view(3, Tier::OnDemand, 10 * 60_000, LeaseState::Ready)),
        ];
        let tick = || {
            Event::Tick(Observation {
                models: vec![load(50.0)],
                leases: leases.clone(),
            })
        };
        // mid-block, both are paid for: kept
        let acts = a.on_event(30 * 60_000, tick());
        assert!(acts.is_empty(), "{acts:?}");
        // within the release window of lease 2's block end (60 min)
        let acts = a.on_event(58 * 60_000, tick());
        assert_eq!(acts, vec![Action::Release { lease: LeaseId(2) }]);
        // and of lease 3's (70 min); lease 1 serves m and stays
        let acts = a.on_event(68 * 60_000, tick());
        assert_eq!(acts, vec![Action::Release { lease: LeaseId(3) }]);
    }

    #[test]
    fn every_policy_releases_leases_of_an_unobserved_model_by_its_own_rule() {
        let orphan = || of_model("gone", view(7, Tier::OnDemand, 0, LeaseState::Ready));
        let tick = |l: Vec<LeaseView>| {
            Event::Tick(Observation {
                models: vec![load(0.0)],
                leases: l,
            })
        };
        // (policy, the last minute after it is first seen that keeps it,
        // None: kept by none); one tick a minute
        for (policy, keep_until) in [
            (PolicyName::StaticPeak, None),
            (PolicyName::Tidal, Some(60_000)),
            (PolicyName::ReactiveIdleTimeout, Some(4 * 60_000)),
        ] {
            let mut a = Autoscaler::new(cfg(policy), Catalog::default_catalog());
            let mut released_at = None;
            for minute in 0..10u64 {
                let now = 10 * 60_000 + minute * 60_000;
                let acts = a.on_event(now, tick(vec![orphan()]));
                if acts.contains(&Action::Release { lease: LeaseId(7) }) {
                    released_at = Some(now - 10 * 60_000);
                    break;
                }
            }
            let expected = keep_until.map_or(0, |k| k + 60_000);
            assert_eq!(released_at, Some(expected), "{policy}");
        }
        // a reserved lease is kept while a floor names its model, and goes
        // once none does
        let reserved = || of_model("gone", view(8, Tier::Reserved, 0, LeaseState::Ready));
        let mut c = cfg(PolicyName::Tidal);
        c.reserved.push(floor("gone", "a100", 1));
        let mut a = Autoscaler::new(c, Catalog::default_catalog());
        for minute in 0..10u64 {
            let acts = a.on_event(minute * 60_000, tick(vec![reserved()]));
            assert!(acts.is_empty(), "{acts:?}");
        }
        let mut a = Autoscaler::new(cfg(PolicyName::Tidal), Catalog::default_catalog());
        assert!(a.on_event(0, tick(vec![reserved()])).is_empty());
        assert_eq!(
            a.on_event(2 * 60_000, tick(vec![reserved()])),
            vec![Action::Release { lease: LeaseId(8) }]
        );
    }

    #[test]
    fn a_wall_clock_step_back_neither_panics_nor_reads_later_points_as_a_trend() {
        let mut a = Autoscaler::new(cfg(PolicyName::PaidBlockAware), Catalog::default_catalog());
        let lease = vec![view(1, Tier::Spot, 0, LeaseState::Ready)];
        let tick = |fps: f64| {
            Event::Tick(Observation {
                models: vec![load(fps)],
                leases: lease.clone(),
            })
        };
        // a steep ramp observed at 20..23 min
        for (minute, fps) in [(20, 40.0), (21, 60.0), (22, 80.0), (23, 100.0)] {
            a.on_event(minute * 60_000, tick(fps));
        }
        // the clock steps back 15 minutes: those points lie in the future
        // and are no trend; 100 fps fits the one lease
        let acts = a.on_event(8 * 60_000, tick(100.0));
        assert_eq!(acquires(&acts), 0, "{acts:?}");
        let mut h = VecDeque::new();
        for (t, r) in [(600_000, 1.0), (660_000, 2.0), (720_000, 3.0)] {
            h.push_back((t, r));
        }
        assert_eq!(trend(&h, 300_000), 0.0);
        assert!(trend(&h, 720_000) > 0.0);
    }

    #[test]
    fn policy_names_parse() {
        for p in PolicyName::ALL {
            assert_eq!(p.as_str().parse::<PolicyName>(), Ok(p));
        }
        assert!("autostop".parse::<PolicyName>().is_err());
    }

    /// `n` ready spot leases of 100 fps each, ids from `first`, paid from
    /// `start`.
    fn spot_fleet(first: u64, n: u64, start: Millis) -> Vec<LeaseView> {
        (first..first + n)
            .map(|id| view(id, Tier::Spot, start, LeaseState::Ready))
            .collect()
    }

    fn releases(a: &[Action]) -> Vec<LeaseId> {
        a.iter()
            .filter_map(|a| match a {
                Action::Release { lease } => Some(*lease),
                _ => None,
            })
            .collect()
    }

    /// Ticks `a` every minute over `[from, to]` at `fps(minute)`, with
    /// `leases`; the actions of the last tick.
    fn tick_minutes(
        a: &mut Autoscaler,
        from: Millis,
        to: Millis,
        leases: &[LeaseView],
        fps: impl Fn(Millis) -> f64,
    ) -> Vec<Action> {
        let mut last = Vec::new();
        for m in from / 60_000..=to / 60_000 {
            last = a.on_event(
                m * 60_000,
                Event::Tick(Observation {
                    models: vec![load(fps(m))],
                    leases: leases.to_vec(),
                }),
            );
        }
        last
    }

    #[test]
    fn a_block_ending_as_the_flip_turns_low_is_released_with_a_short_look_back() {
        // three leases paid until minute 60; the load flips from 280 to 90
        // fps at minute 55
        let leases = spot_fleet(1, 3, 0);
        let flip = |m: Millis| if m < 55 { 280.0 } else { 90.0 };
        let mut c = cfg(PolicyName::PaidBlockAware);
        c.down_window_ms = 3 * 60_000;
        let mut a = Autoscaler::new(c, Catalog::default_catalog());
        let acts = tick_minutes(&mut a, 40 * 60_000, 58 * 60_000, &leases, flip);
        assert_eq!(releases(&acts), vec![LeaseId(1), LeaseId(2)]);
        // the default ten-minute look-back still sees the high load and
        // renews them all
        let mut a = Autoscaler::new(cfg(PolicyName::PaidBlockAware), Catalog::default_catalog());
        let acts = tick_minutes(&mut a, 40 * 60_000, 58 * 60_000, &leases, flip);
        assert!(releases(&acts).is_empty(), "{acts:?}");
    }

    #[test]
    fn a_block_ending_before_the_learned_morning_rise_is_renewed() {
        const HOUR: Millis = 3_600_000;
        let office = |t: Millis| {
            if (8 * HOUR..18 * HOUR).contains(&(t % DAY_MS)) {
                200.0
            } else {
                20.0
            }
        };
        // two leases paid until 07:30 (or 07:59) on day 1; the load needs
        // one of them until the rise at 08:00 that day 0 taught
        let decide = |c: PolicyConfig, block_end: Millis| {
            let leases = spot_fleet(1, 2, DAY_MS + block_end - HOUR);
            let mut a = Autoscaler::new(c, Catalog::default_catalog());
            for slot in 0..DAY_MS / SLOT_MS {
                let t = slot * SLOT_MS;
                a.on_event(
                    t,
                    Event::Tick(Observation {
                        models: vec![load(office(t))],
                        leases: vec![],
                    }),
                );
            }
            let from = DAY_MS + block_end - 30 * 60_000;
            tick_minutes(&mut a, from, from + 28 * 60_000, &leases, |m| {
                office(m * 60_000)
            })
        };
        let (half_past, one_to) = (7 * HOUR + 30 * 60_000, 8 * HOUR - 60_000);
        // by default the forecast looks a start-up ahead: a block ending
        // within it of the rise is renewed, one ending half an hour before
        // is released (a lease bought a start-up before the rise pays no
        // more blocks)
        let acts = decide(cfg(PolicyName::PaidBlockAware), one_to);
        assert!(releases(&acts).is_empty(), "{acts:?}");
        let acts = decide(cfg(PolicyName::PaidBlockAware), half_past);
        assert_eq!(releases(&acts).len(), 1, "{acts:?}");
        // a forecast over the whole block renews it half an hour ahead
        let mut c = cfg(PolicyName::PaidBlockAware);
        c.renew_horizon_ms = HOUR;
        let acts = decide(c, half_past);
        assert!(releases(&acts).is_empty(), "{acts:?}");
    }

    /// The on-demand acquires `acts` makes for the spot hedge.
    fn hedge_acquires(acts: &[Action]) -> usize {
        acts.iter()
            .filter(|a| {
                matches!(
                    a,
                    Action::Acquire {
                        tier: Tier::OnDemand,
                        reason: AcquireReason::SpotHedge,
                        ..
                    }
                )
            })
            .count()
    }

    #[test]
    fn a_wave_of_preemptions_holds_an_on_demand_reserve_sized_to_the_measured_rate() {
        let run = |margin: f64| {
            let mut c = cfg(PolicyName::PaidBlockAware);
            c.hedge_margin = margin;
            let mut a = Autoscaler::new(c, Catalog::default_catalog());
            // 100 spot leases serve 10,000 fps for ten calm minutes
            let fleet = spot_fleet(1, 100, 0);
            let calm = tick_minutes(&mut a, 0, 10 * 60_000, &fleet, |_| 10_000.0);
            assert_eq!(hedge_acquires(&calm), 0, "a calm pool holds no reserve");
            // a wave reclaims 30 of them; each is replaced on demand
            let mut replacements = 0;
            for id in 1..=30 {
                let acts = a.on_event(
                    10 * 60_000 + 1,
                    Event::PreemptionNotice {
                        lease: LeaseId(id),
                        deadline: 12 * 60_000,
                    },
                );
                replacements += acquires(&acts);
            }
            assert_eq!(replacements, 30);
            let survivors = spot_fleet(31, 70, 0);
            let mut after = survivors.clone();
            after.extend((101..=130).map(|id| {
                let mut l = view(id, Tier::OnDemand, 10 * 60_000, LeaseState::Requested);
                l.billing_start = None;
                l
            }));
            let tick = |a: &mut Autoscaler, leases: Vec<LeaseView>| {
                a.on_event(
                    11 * 60_000,
                    Event::Tick(Observation {
                        models: vec![load(10_000.0)],
                        leases,
                    }),
                )
            };
            // with the replacements on demand, the reserve is the
            // capacity held above the target
            let extra = acquires(&tick(&mut a, after));
            // with them refused, the reserve is leased on demand (the rest
            // of the target on spot)
            let acts = tick(&mut a, survivors);
            (extra, hedge_acquires(&acts), acquires(&acts))
        };
        // 30 notices over 100 leases × 10 minutes (16.7 lease-hours), with
        // the catalog's 0.02 per hour worth 20 lease-hours: 0.83 per hour;
        // over the 70 spot leases left and a 150 s start-up, 2.4 workers
        // lost, 4.9 with the margin of 2
        let rate = (30.0 + 0.02 * hedge::PRIOR_LEASE_HOURS)
            / (100.0 * 10.0 / 60.0 + hedge::PRIOR_LEASE_HOURS);
        let expected = (rate * 70.0 * 150.0 / 3600.0 * 2.0).round() as usize;
        assert_eq!(expected, 5);
        assert_eq!(run(2.0), (expected, expected, 30 + expected));
        assert_eq!(run(0.0), (0, 0, 30), "a margin of 0 holds no reserve");
    }

    #[test]
    fn an_on_demand_lease_is_kept_rather_than_handed_to_a_spot_pool_reclaimed_often() {
        // 20 spot leases and one on-demand lease (paid from 0) serve 2,100
        // fps; at 10 minutes `reclaimed` of the spot leases get a notice
        let run = |reclaimed: u64| -> Vec<Action> {
            let mut a =
                Autoscaler::new(cfg(PolicyName::PaidBlockAware), Catalog::default_catalog());
            let od = view(100, Tier::OnDemand, 0, LeaseState::Ready);
            let mut fleet = spot_fleet(1, 20, 0);
            fleet.push(od.clone());
            let quiet = tick_minutes(&mut a, 0, 10 * 60_000, &fleet, |_| 2_100.0);
            assert!(quiet.is_empty(), "{quiet:?}");
            for id in 1..=reclaimed {
                let acts = a.on_event(
                    10 * 60_000 + 1,
                    Event::PreemptionNotice {
                        lease: LeaseId(id),
                        deadline: 12 * 60_000,
                    },
                );
                assert_eq!(acquires(&acts), 1, "replaced on demand at once: {acts:?}");
            }
            // the reclaimed leases are gone and their replacements serve
            let mut after = spot_fleet(reclaimed + 1, 20 - reclaimed, 0);
            after.extend(
                (200..200 + reclaimed)
                    .map(|id| view(id, Tier::OnDemand, 10 * 60_000, LeaseState::Ready)),
            );
            after.push(od);
            let quiet = tick_minutes(&mut a, 11 * 60_000, 53 * 60_000, &after, |_| 2_100.0);
            assert!(quiet.is_empty(), "{quiet:?}");
            // a start-up, the release window and a tick before the first
            // on-demand lease's block ends
            a.on_event(
                54 * 60_000,
                Event::Tick(Observation {
                    models: vec![load(2_100.0)],
                    leases: after,
                }),
            )
        };
        // a calm pool: the catalog's rate, far below the bar
        let it = Catalog::default_catalog().get("a100").cloned().unwrap();
        let calm = hedge::spot_overhead(it.spot_interruptions_per_hour, 150_000, it.granularity);
        assert!(calm < PolicyConfig::new(PolicyName::PaidBlockAware).handover_max_overhead);
        let acts = run(0);
        assert!(
            one_spot_rebalance(&acts),
            "a calm pool takes the hand-over: {acts:?}"
        );
        // half the pool reclaimed in 10 minutes: about 0.3 an hour measured
        // (with the prior), an overhead twice the bar's; the on-demand
        // lease is kept for another block, and nothing is acquired
        let acts = run(10);
        assert!(acts.is_empty(), "{acts:?}");
    }
}
