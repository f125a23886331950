//! The policy's configuration: which policy, its windows and margins, the
//! reserved floors and the time-of-day minimums, with the defaults each
//! field takes when a config file leaves it out. Only data: the decisions
//! that read it are in `mod.rs` and its siblings.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::PolicyName;
use crate::billing::Millis;
use crate::catalog::Money;

/// A configured time-of-day minimum for a model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScheduleEntry {
    /// Model.
    pub model: String,
    /// Start, minutes after midnight UTC (inclusive).
    pub from_minute: u32,
    /// End, minutes after midnight UTC (exclusive).
    pub to_minute: u32,
    /// Minimum capacity in frames per second.
    pub min_fps: f64,
}

/// Reserved capacity bought for a model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservedFloor {
    /// Model.
    pub model: String,
    /// Instance type.
    pub instance_type: String,
    /// Number of leases.
    pub count: u32,
}

/// Policy configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyConfig {
    /// Which policy.
    pub policy: PolicyName,
    /// Capacity kept above the observed rate (0.05 = 5%).
    pub headroom: f64,
    /// Never let the summed hourly price of live leases exceed this.
    pub spend_cap_per_hour: Option<Money>,
    /// Reserved floor, leased first. Each floor keeps the first `count`
    /// reserved leases of its model and type; reserved leases beyond those
    /// (a floor lowered, or its type changed) are released like any other.
    pub reserved: Vec<ReservedFloor>,
    /// Configured tidal minimum schedule.
    pub schedule: Vec<ScheduleEntry>,
    /// Learn the tidal schedule from past days' observations: the same
    /// weekday a week before, else the latest day before.
    pub learn_schedule: bool,
    /// Paid-block-aware: release at most this long before a block ends.
    pub release_window_ms: Millis,
    /// Paid-block-aware: how long a release takes to complete after it is
    /// decided (the shell's grace for batches in flight, plus the
    /// provider's stop). An hourly lease with less than this left in its
    /// block is kept for the next block rather than released: the release
    /// would land after the block ends and buy that block anyway. 0 in the
    /// simulator, which releases at once.
    #[serde(default)]
    pub release_lead_ms: Millis,
    /// Window over which the scale-down target takes the maximum rate
    /// (`tidal`), and the renewal forecast's look-back (`paid-block-aware`:
    /// its recent level is the highest rate over it, so a dip shorter than
    /// it is not the load leaving). 10 minutes by default; 3 minutes
    /// released a block ending soon after the load fell (the flip turning
    /// low) and paid fewer GPU-hours on 12 of the 18 shipped trace × cloud
    /// runs, but lost SLO attainment on 12 (flip on the harsh cloud: 97.0 %
    /// to 96.0 %), so it is not the default (docs/leasing.md).
    pub down_window_ms: Millis,
    /// Paid-block-aware: how far ahead of a block's end the renewal
    /// forecast looks, at least a start-up (the default, 0): a lease is
    /// renewed only if the forecast over this needs it. Looking the whole
    /// block ahead renews leases for a rise later in it, which pays no
    /// fewer blocks than releasing them and leasing again a start-up
    /// before the rise, and measured more GPU-hours on the shipped traces.
    #[serde(default = "default_renew_horizon_ms")]
    pub renew_horizon_ms: Millis,
    /// Paid-block-aware: the on-demand reserve held against spot
    /// preemptions is the spot workers the measured interruption rate
    /// takes out over one start-up, times this. 0 (no reserve) by
    /// default: 2 raised SLO attainment on the harsh cloud but paid 0.3 to
    /// 4.6 % more GPU-hours there (docs/leasing.md).
    #[serde(default = "default_hedge_margin")]
    pub hedge_margin: f64,
    /// Paid-block-aware: an on-demand lease is handed back to spot at its
    /// block end only while spot's expected overhead, at the interruption
    /// rate measured over `hedge_window` (`hedge.rs`, `spot_overhead`: the
    /// GPU-hours each interruption pays without serving, per hour a spot
    /// lease serves), is at most this. Above it the pool is reclaimed too
    /// often for a hand-over to pay: the on-demand lease is kept, and
    /// scale-up still leases spot. 0.1 by default: at the default
    /// catalog's rates (0.01–0.05 interruptions an hour, 150 s start-ups)
    /// it hands over; on the harsh cloud (ten times as many, 420 s
    /// start-ups) handing over paid 0.6–11 % more GPU-hours than
    /// idle-timeout-spot on every smooth trace, and keeping paid fewer on
    /// five of six (docs/leasing.md).
    #[serde(default = "default_handover_max_overhead")]
    pub handover_max_overhead: f64,
    /// How long before a preemption notice's deadline dispatch to the
    /// lease stops (every policy). Until then the lease serves on: a
    /// notice gives two minutes on the big clouds, and its replacement,
    /// acquired at the notice, needs a start-up; stopping at the notice
    /// left the fleet that much short for the whole gap, and shed most of
    /// the frames the simulator lost to reclaim waves (docs/leasing.md).
    /// The last batches finish within the frame budget, far inside this.
    /// 10 s by default; one at least the notice stops dispatch at once.
    #[serde(default = "default_notice_drain_ms")]
    pub notice_drain_ms: Millis,
    /// Paid-block-aware: the window the spot interruption rate is measured
    /// over.
    #[serde(default = "default_hedge_window_ms")]
    pub hedge_window_ms: Millis,
    /// Tidal: how long a surplus must persist before it is released.
    pub surplus_hold_ms: Millis,
    /// Reactive: release a lease idle this long.
    pub idle_timeout_ms: Millis,
    /// After a type's spot is refused, that type's spot is not asked for
    /// this long: the model leases the next cheapest type's spot (see
    /// `spot_fallback_min_share`), or on-demand. A refusal answers at once
    /// and costs nothing, and a pool short after one refusal still grants
    /// most requests (the harsh cloud's dry pool: 70 %), so every request
    /// the cool-off keeps from spot is one paid at on-demand's price. One
    /// minute by default, the on-demand cool-off's (`refused_cooloff_ms`):
    /// one round of refused rows a minute per model and type; 15 minutes
    /// paid `noise` on the harsh cloud 57.7 % of static-peak's cost on its
    /// worst seed instead of 50.7 % (docs/leasing.md, "The spot cool-off,
    /// measured").
    #[serde(default = "default_spot_refused_cooloff_ms")]
    pub spot_refused_cooloff_ms: Millis,
    /// Spot types a model may lease, the cheapest first, are those whose
    /// worker serves at least this share of what the model's fastest type
    /// does. A refusal of one type's spot moves the model to the next such
    /// type's pool (another pool: its own shortages, dry spells and
    /// reclaims) rather than to on-demand at three times the price. Slower
    /// types are left out: they would multiply the workers (leases,
    /// start-ups, connections, preemptions) for the same load. 0.5 by
    /// default: on the default catalog, an H100 refused falls back to H200
    /// spot, not to A100s or V100s (docs/leasing.md).
    #[serde(default = "default_spot_fallback_min_share")]
    pub spot_fallback_min_share: f64,
    /// After an on-demand or reserved acquire is refused (no capacity of
    /// that type and tier: a static fleet all bound, a quota, a missing
    /// partition), that model, type and tier is not asked for again for
    /// this long, so a refusal is not repeated (and recorded) every tick.
    #[serde(default = "default_refused_cooloff_ms")]
    pub refused_cooloff_ms: Millis,
    /// Static-peak: the peak rate per model it is sized for.
    pub static_peak_fps: BTreeMap<String, f64>,
    /// Time a queue should drain in when p95 is over budget (s).
    pub queue_drain_secs: f64,
    /// Upper bound on acquisitions in one event.
    pub max_acquire_per_event: u32,
}

impl PolicyConfig {
    /// Defaults for `policy`.
    pub fn new(policy: PolicyName) -> PolicyConfig {
        PolicyConfig {
            policy,
            headroom: 0.03,
            spend_cap_per_hour: None,
            reserved: Vec::new(),
            schedule: Vec::new(),
            learn_schedule: policy.uses_tiers(),
            release_window_ms: 3 * 60_000,
            release_lead_ms: 0,
            down_window_ms: 10 * 60_000,
            renew_horizon_ms: default_renew_horizon_ms(),
            hedge_margin: default_hedge_margin(),
            handover_max_overhead: default_handover_max_overhead(),
            hedge_window_ms: default_hedge_window_ms(),
            notice_drain_ms: default_notice_drain_ms(),
            surplus_hold_ms: 2 * 60_000,
            idle_timeout_ms: 5 * 60_000,
            spot_refused_cooloff_ms: default_spot_refused_cooloff_ms(),
            spot_fallback_min_share: default_spot_fallback_min_share(),
            refused_cooloff_ms: default_refused_cooloff_ms(),
            static_peak_fps: BTreeMap::new(),
            queue_drain_secs: 30.0,
            max_acquire_per_event: 2000,
        }
    }
}

fn default_spot_refused_cooloff_ms() -> Millis {
    60_000
}

fn default_spot_fallback_min_share() -> f64 {
    0.5
}

fn default_refused_cooloff_ms() -> Millis {
    60_000
}

fn default_renew_horizon_ms() -> Millis {
    0
}

fn default_hedge_margin() -> f64 {
    0.0
}

fn default_handover_max_overhead() -> f64 {
    0.1
}

fn default_notice_drain_ms() -> Millis {
    10_000
}

fn default_hedge_window_ms() -> Millis {
    6 * 3_600_000
}
