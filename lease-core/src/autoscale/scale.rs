//! One model's scaling on one tick: the targets its load sets, the acquires
//! that reach the up-target (its reserved floors first, then the cheapest
//! type of the tier), and the release of its surplus by the policy's own
//! rule. Pure like the rest of the autoscaler. The tick's bookkeeping (rate
//! history, the lease table, the event's spend) stays in the parent
//! module, which calls [`Autoscaler::scale_model`] once per model.

use std::collections::{BTreeSet, VecDeque};

use super::forecast::{Horizon, renewal_demand};
use super::hedge::{reserve_workers, spot_overhead};
use super::{AcquireReason, Action, Autoscaler, Lease, LeaseView, ModelLoad, PolicyName};
use crate::billing::{Granularity, Millis};
use crate::catalog::{Money, Tier};
use crate::lifecycle::LeaseState;
use crate::table::LeaseId;

/// Most the trend may add to the observed rate (fraction of it).
pub(super) const MAX_TREND_GROWTH: f64 = 0.25;
/// Trend window.
const TREND_MS: Millis = 10 * 60_000;

/// What one event may still acquire: the hourly burn counted against the
/// spend cap (every lease not ended, and this event's acquires) and how
/// many more acquires it may make.
#[derive(Debug, Clone, Copy)]
pub(super) struct Allowance {
    /// Hourly price of every lease not ended plus this event's acquires.
    pub(super) burn: Money,
    /// Acquires this event may still make (`max_acquire_per_event`).
    pub(super) acquires_left: u32,
}

/// The capacity (fps) a model's load asks for on this tick.
#[derive(Debug, Clone, Copy)]
struct Targets {
    /// The observed arrival rate.
    rate: f64,
    /// What draining the queue needs while p95 is over budget.
    queue_fps: f64,
    /// Scale up until the capacity reaches it.
    up: f64,
    /// Scale down no further than it.
    down: f64,
}

/// One model on this tick: what the steps of [`Autoscaler::scale_model`]
/// share.
struct ModelTick<'a> {
    now: Millis,
    load: &'a ModelLoad,
    /// The model's leases (none ended).
    mine: Vec<LeaseView>,
    /// The capacity counted for scale-up: the serving leases, less those
    /// retiring, plus what this tick acquired.
    cap: f64,
}

impl Autoscaler {
    /// Scales `load`'s model: acquires towards its up-target within
    /// `allow`, then releases its surplus over the down-target. A lease a
    /// reserved floor keeps (`kept`) is never surplus.
    pub(super) fn scale_model(
        &mut self,
        now: Millis,
        load: &ModelLoad,
        kept: &BTreeSet<LeaseId>,
        allow: &mut Allowance,
        actions: &mut Vec<Action>,
    ) {
        let Some(best_od) = self.best_type(load, Tier::OnDemand, |_| true) else {
            return;
        };
        let lead = self.startup_ms(&best_od.instance_type) + 60_000;
        let mine: Vec<LeaseView> = self
            .leases
            .values()
            .filter(|l| l.model == load.model)
            .cloned()
            .collect();
        let hedge = self.hedge_fps(load, &mine, &best_od.instance_type);
        let mut targets = self.targets(now, load, lead);
        targets.down += hedge;
        let capacity = self.serving_fps(load, &mine, |_| true);
        let choice = self.lease_choice(now, load);
        let spot_type = choice
            .as_ref()
            .filter(|c| c.tier == Tier::Spot)
            .map(|c| c.instance_type.as_str());
        let retiring = self.retiring_fps(now, load, &mine, spot_type, hedge);
        // on-demand capacity that stays counts towards the hedge first
        let od_kept = self.serving_fps(load, &mine, |l| l.tier == Tier::OnDemand) - retiring;
        let hedge_met = od_kept.clamp(0.0, hedge);
        let mut m = ModelTick {
            now,
            load,
            mine,
            cap: capacity - retiring,
        };

        // --- scale up ---
        if self.cfg.policy.uses_tiers() {
            actions.extend(self.acquire_reserved_floors(&mut m, allow));
        }
        let reason = self.acquire_reason(&targets, capacity);
        if let Some(c) = &choice {
            actions.extend(self.acquire_to_target(
                &mut m,
                allow,
                c,
                reason,
                targets.up + hedge_met,
            ));
        }
        if hedge > 0.0
            && let Some(od) = self.on_demand_choice(now, load)
        {
            actions.extend(self.acquire_to_target(
                &mut m,
                allow,
                &od,
                AcquireReason::SpotHedge,
                targets.up + hedge,
            ));
        }

        // --- scale down ---
        // Releasing a lease that serves must leave enough *ready* capacity:
        // a lease still requested or starting counts for scale-up (nothing
        // is acquired twice) but serves nothing yet, and may never start.
        let ready_cap = self.serving_fps(load, &m.mine, |l| l.state == LeaseState::Ready);
        let surplus = Surplus {
            all: m.cap + retiring - targets.down,
            ready: ready_cap - targets.down,
        };
        let releasable: Vec<&LeaseView> = m
            .mine
            .iter()
            .filter(|l| self.serves(l) && !kept.contains(&l.id))
            .collect();
        let released = match self.cfg.policy {
            PolicyName::StaticPeak => Vec::new(),
            PolicyName::PaidBlockAware => self.release_at_block_ends(&m, surplus, releasable),
            PolicyName::Tidal => self.release_after_surplus_hold(&m, surplus, releasable),
            PolicyName::ReactiveIdleTimeout | PolicyName::IdleTimeoutSpot => {
                self.release_idle(&m, surplus, releasable)
            }
        };
        actions.extend(released.into_iter().map(|lease| Action::Release { lease }));
    }

    /// Whether `l` serves: not ended, not draining, not stopped by a
    /// preemption notice.
    fn serves(&self, l: &LeaseView) -> bool {
        !l.state.is_ended() && l.state != LeaseState::Draining && !self.stopped.contains(&l.id)
    }

    /// The throughput of the leases in `mine` that serve and pass `which`.
    fn serving_fps(
        &self,
        load: &ModelLoad,
        mine: &[LeaseView],
        which: impl Fn(&LeaseView) -> bool,
    ) -> f64 {
        mine.iter()
            .filter(|l| self.serves(l) && which(l))
            .map(|l| Self::lease_fps(load, l))
            .sum()
    }

    /// The up- and down-targets of the policy, `lead` being how far ahead
    /// a lease acquired now would serve.
    fn targets(&self, now: Millis, load: &ModelLoad, lead: Millis) -> Targets {
        let h = self.cfg.headroom;
        let st = &self.models[&load.model];
        let rate = load.arrival_fps.max(0.0);
        let queue_fps = if load.p95_ms > load.budget_ms {
            load.queue_depth as f64 / self.cfg.queue_drain_secs.max(1.0)
        } else {
            0.0
        };
        let (up, down) = match self.cfg.policy {
            PolicyName::StaticPeak => {
                let peak = self
                    .cfg
                    .static_peak_fps
                    .get(&load.model)
                    .copied()
                    .unwrap_or(rate);
                (peak * (1.0 + h), f64::INFINITY)
            }
            PolicyName::ReactiveIdleTimeout | PolicyName::IdleTimeoutSpot => {
                let t = rate * (1.0 + h) + queue_fps;
                (t, t)
            }
            PolicyName::Tidal | PolicyName::PaidBlockAware => {
                let recent_max = if self.cfg.policy == PolicyName::PaidBlockAware {
                    // releases happen only at block ends: the down-target
                    // is the forecast over the block a renewal would buy
                    let horizon = Horizon {
                        lookback_ms: self.cfg.down_window_ms,
                        ahead_ms: self.cfg.renew_horizon_ms.max(lead),
                    };
                    renewal_demand(&st.history, now, rate, horizon, |t| {
                        self.schedule_min(&load.model, t)
                    })
                } else {
                    st.history
                        .iter()
                        .filter(|(t, _)| *t + self.cfg.down_window_ms >= now)
                        .map(|(_, r)| *r)
                        .fold(rate, f64::max)
                };
                let slope = trend(&st.history, now);
                // a fitted ramp is followed for one start-up, but a spike's
                // steep edge is not extrapolated beyond MAX_TREND_GROWTH
                let extrapolated =
                    rate + (slope.max(0.0) * lead as f64).min(rate * MAX_TREND_GROWTH);
                let sched = self.schedule_max(&load.model, now, now + lead);
                let up = (rate.max(extrapolated).max(sched)) * (1.0 + h) + queue_fps;
                let down = recent_max.max(sched) * (1.0 + h) + queue_fps;
                (up, down.max(up))
            }
        };
        Targets {
            rate,
            queue_fps,
            up,
            down,
        }
    }

    /// `paid-block-aware`: whether an on-demand lease may be handed back
    /// to spot of `spot_type` (the one the model leases now), its expected
    /// overhead at the measured interruption rate (the catalog's as the
    /// prior) being at most `handover_max_overhead`.
    fn spot_worth_handing_over(&self, load: &ModelLoad, spot_type: &str) -> bool {
        let Some(it) = self.catalog.get(spot_type) else {
            return false;
        };
        let rate = self.models[&load.model]
            .spot
            .rate_per_hour(it.spot_interruptions_per_hour);
        spot_overhead(rate, self.startup_ms(spot_type), it.granularity)
            <= self.cfg.handover_max_overhead
    }

    /// Paid-block-aware rebalancing: the capacity of the on-demand leases
    /// (a preemption replacement, or bought while spot was refused) whose
    /// block ends within a start-up. It is not counted for scale-up, so a
    /// spot replacement starts now and is warm when the on-demand block
    /// ends and the lease is released as surplus (if the replacement is not
    /// ready by then, the lease is kept for another block: see the
    /// scale-down). A lease with no billing start yet is taken to start now
    /// (`LeaseView::paid_until`), so it is not retiring. The on-demand
    /// capacity the spot hedge holds (`hedge` fps) is not handed over, and
    /// nothing is while no spot is worth leasing (`spot_type` `None`: every
    /// fast type's spot refused recently) or spot is reclaimed too often
    /// ([`Autoscaler::spot_worth_handing_over`], asked only when an
    /// on-demand block is ending). A dearer type's spot lease is not handed
    /// over: the overlap a hand-over pays (a start-up and the release
    /// window, about a ninth of a block) is what H200 spot costs over H100
    /// spot per frame, and handing it over measured lower utilisation.
    fn retiring_fps(
        &self,
        now: Millis,
        load: &ModelLoad,
        mine: &[LeaseView],
        spot_type: Option<&str>,
        hedge: f64,
    ) -> f64 {
        let Some(spot_type) = spot_type.filter(|_| self.cfg.policy == PolicyName::PaidBlockAware)
        else {
            return 0.0;
        };
        let ending = self.serving_fps(load, mine, |l| {
            l.tier == Tier::OnDemand
                && l.paid_until(now).saturating_sub(now)
                    <= self.startup_ms(&l.instance_type) + self.cfg.release_window_ms + 60_000
        });
        if ending <= 0.0 || !self.spot_worth_handing_over(load, spot_type) {
            return 0.0;
        }
        let on_demand = self.serving_fps(load, mine, |l| l.tier == Tier::OnDemand);
        ending.min((on_demand - hedge).max(0.0))
    }

    /// `paid-block-aware`: the on-demand capacity (fps of `od_type`) held
    /// above the target against spot preemptions: the reserve
    /// (`hedge.rs`) for the model's serving spot workers, the rate its
    /// notices measured and the start-up of `od_type`. 0 in other policies.
    fn hedge_fps(&self, load: &ModelLoad, mine: &[LeaseView], od_type: &str) -> f64 {
        if self.cfg.policy != PolicyName::PaidBlockAware || self.cfg.hedge_margin <= 0.0 {
            return 0.0;
        }
        let spot: Vec<&LeaseView> = mine
            .iter()
            .filter(|l| l.tier == Tier::Spot && self.serves(l))
            .collect();
        if spot.is_empty() {
            return 0.0;
        }
        // the catalog's rate of the most interrupted type held
        let prior = spot
            .iter()
            .filter_map(|l| self.catalog.get(&l.instance_type))
            .map(|it| it.spot_interruptions_per_hour)
            .fold(0.0, f64::max);
        let rate = self.models[&load.model].spot.rate_per_hour(prior);
        let workers = reserve_workers(
            rate,
            spot.len() as u32,
            self.startup_ms(od_type),
            self.cfg.hedge_margin,
        );
        f64::from(workers) * load.throughput_fps.get(od_type).copied().unwrap_or(0.0)
    }

    /// Why this tick's acquires are made: the serving `capacity` covers
    /// the up-target already (a rebalance), the schedule or the trend asks
    /// for more than the rate does, or the rate itself.
    fn acquire_reason(&self, targets: &Targets, capacity: f64) -> AcquireReason {
        let h = self.cfg.headroom;
        if capacity + 1e-9 >= targets.up {
            AcquireReason::Rebalance
        } else if targets.up > targets.rate * (1.0 + h) + targets.queue_fps + 1e-9 {
            AcquireReason::Schedule
        } else {
            AcquireReason::Demand
        }
    }

    /// The reserved leases missing from the model's floors, as far as the
    /// spend cap and the event's acquires allow; each adds its capacity.
    fn acquire_reserved_floors(&self, m: &mut ModelTick<'_>, allow: &mut Allowance) -> Vec<Action> {
        let mut actions = Vec::new();
        for floor in &self.cfg.reserved {
            if floor.model != m.load.model
                || !self.may_ask(m.now, &m.load.model, &floor.instance_type, Tier::Reserved)
            {
                continue;
            }
            let have = m
                .mine
                .iter()
                .filter(|l| l.tier == Tier::Reserved && l.instance_type == floor.instance_type)
                .count() as u32;
            let Some(it) = self.catalog.get(&floor.instance_type) else {
                continue;
            };
            let price = it.price_per_hour.reserved;
            let fps = m
                .load
                .throughput_fps
                .get(&floor.instance_type)
                .copied()
                .unwrap_or(0.0);
            for _ in have..floor.count {
                if allow.acquires_left == 0 || !self.within_cap(allow.burn, price) {
                    break;
                }
                allow.burn += price;
                allow.acquires_left -= 1;
                m.cap += fps;
                actions.push(Action::Acquire {
                    model: m.load.model.clone(),
                    instance_type: floor.instance_type.clone(),
                    tier: Tier::Reserved,
                    reason: AcquireReason::ReservedFloor,
                });
            }
        }
        actions
    }

    /// Leases of `lease`'s type and tier until the capacity reaches
    /// `up_target`, as far as the spend cap and the event's acquires allow.
    fn acquire_to_target(
        &self,
        m: &mut ModelTick<'_>,
        allow: &mut Allowance,
        lease: &Lease,
        reason: AcquireReason,
        up_target: f64,
    ) -> Vec<Action> {
        let mut actions = Vec::new();
        let Lease {
            instance_type: ty,
            fps,
            price,
            tier,
        } = lease.clone();
        while m.cap + 1e-9 < up_target && allow.acquires_left > 0 {
            if !self.within_cap(allow.burn, price) {
                tracing::debug!(model = %m.load.model, "spend cap reached; not scaling up");
                break;
            }
            allow.burn += price;
            allow.acquires_left -= 1;
            m.cap += fps;
            actions.push(Action::Acquire {
                model: m.load.model.clone(),
                instance_type: ty.clone(),
                tier,
                reason,
            });
        }
        actions
    }

    /// `paid-block-aware`: the surplus leases whose paid block ends
    /// soonest, each only within `release_window` of that end (an hourly
    /// one not with less than `release_lead` left).
    fn release_at_block_ends(
        &self,
        m: &ModelTick<'_>,
        mut surplus: Surplus,
        mut cands: Vec<&LeaseView>,
    ) -> Vec<LeaseId> {
        let now = m.now;
        cands.sort_by(|a, b| {
            a.paid_until(now)
                .cmp(&b.paid_until(now))
                .then(b.price_per_hour.cmp(&a.price_per_hour))
                .then(a.id.cmp(&b.id))
        });
        let mut released = Vec::new();
        for l in cands {
            let fps = Self::lease_fps(m.load, l);
            if !surplus.covers(l, fps) {
                continue;
            }
            let left = l.paid_until(now).saturating_sub(now);
            if left > self.cfg.release_window_ms {
                continue;
            }
            // hourly blocks are prepaid: a release completing after this
            // one ends would pay for the next in full
            if l.granularity == Granularity::Hour && left < self.cfg.release_lead_ms {
                continue;
            }
            surplus.take(l, fps);
            released.push(l.id);
        }
        released
    }

    /// `tidal`: once the model has had a surplus of at least one whole
    /// lease for `surplus_hold`, the newest leases that fit in it, whatever
    /// they have paid.
    fn release_after_surplus_hold(
        &mut self,
        m: &ModelTick<'_>,
        mut surplus: Surplus,
        mut cands: Vec<&LeaseView>,
    ) -> Vec<LeaseId> {
        let hold = self.cfg.surplus_hold_ms;
        let st = self
            .models
            .get_mut(&m.load.model)
            .expect("model state exists");
        // a surplus is at least one whole lease that could go
        if !cands
            .iter()
            .any(|l| surplus.covers(l, Self::lease_fps(m.load, l)))
        {
            st.surplus_since = None;
            return Vec::new();
        }
        let since = *st.surplus_since.get_or_insert(m.now);
        if m.now < since + hold {
            return Vec::new();
        }
        // newest first, whatever it has paid
        cands.sort_by(|a, b| b.billing_start.cmp(&a.billing_start).then(b.id.cmp(&a.id)));
        let mut released = Vec::new();
        for l in cands {
            let fps = Self::lease_fps(m.load, l);
            if surplus.covers(l, fps) {
                surplus.take(l, fps);
                released.push(l.id);
            }
        }
        st.surplus_since = None;
        released
    }

    /// `reactive-idle-timeout` and `idle-timeout-spot`: the leases that fit
    /// in the surplus are the idle ones (a dispatcher packs work onto the
    /// oldest workers, so the newest are idle); each goes once it has been
    /// idle for `idle_timeout`.
    fn release_idle(
        &mut self,
        m: &ModelTick<'_>,
        mut surplus: Surplus,
        mut cands: Vec<&LeaseView>,
    ) -> Vec<LeaseId> {
        cands.sort_by(|a, b| b.billing_start.cmp(&a.billing_start).then(b.id.cmp(&a.id)));
        let mut idle_now = BTreeSet::new();
        for l in cands {
            let fps = Self::lease_fps(m.load, l);
            if surplus.covers(l, fps) {
                surplus.take(l, fps);
                idle_now.insert(l.id);
            }
        }
        for l in &m.mine {
            if !idle_now.contains(&l.id) {
                self.idle_since.remove(&l.id);
            }
        }
        let mut released = Vec::new();
        for id in idle_now {
            let since = *self.idle_since.entry(id).or_insert(m.now);
            if m.now >= since + self.cfg.idle_timeout_ms {
                self.idle_since.remove(&id);
                released.push(id);
            }
        }
        released
    }
}

/// What a model's leases may shed without falling below its down-target:
/// `all` counts every lease that serves or will (and what this event
/// acquired), `ready` only those ready now. A lease not yet ready may go
/// within `all`; a ready one only within both, so that a lease serving now
/// is never released on the strength of one still starting.
#[derive(Debug, Clone, Copy)]
struct Surplus {
    all: f64,
    ready: f64,
}

impl Surplus {
    /// Whether `l` (of `fps`) may be released.
    fn covers(&self, l: &LeaseView, fps: f64) -> bool {
        self.all + 1e-9 >= fps && (l.state != LeaseState::Ready || self.ready + 1e-9 >= fps)
    }

    /// `l` (of `fps`) is released.
    fn take(&mut self, l: &LeaseView, fps: f64) {
        self.all -= fps;
        if l.state == LeaseState::Ready {
            self.ready -= fps;
        }
    }
}

/// Least-squares slope (fps per ms) of the rate over the last
/// [`TREND_MS`]; a fit rather than two points, so per-minute noise does
/// not read as a ramp. Points later than `now` (the wall clock stepped
/// back) are not part of the last [`TREND_MS`] and are left out.
pub(super) fn trend(history: &VecDeque<(Millis, f64)>, now: Millis) -> f64 {
    let pts: Vec<(f64, f64)> = history
        .iter()
        .filter(|(t, _)| *t <= now && *t + TREND_MS >= now)
        .map(|(t, r)| (now.saturating_sub(*t) as f64, *r))
        .collect();
    if pts.len() < 3 {
        return 0.0;
    }
    let n = pts.len() as f64;
    let mx = pts.iter().map(|p| p.0).sum::<f64>() / n;
    let my = pts.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    if sxx <= 0.0 {
        return 0.0;
    }
    // x is age (ms before now), so the slope over time is the negative
    -sxy / sxx
}
