//! The simulated cloud: how long a worker takes to start, when the provider
//! refuses an acquire, when it reclaims spot capacity, how much of each type
//! and tier it has, and what a reserved commitment costs.
//!
//! [`crate::sim`] asks a [`Cloud`] at every acquire and release instead of
//! using constants. The model, stated so results can be judged:
//!
//! * **Start-up** is log-normal per instance type, given by its median
//!   (`startup_secs` in the catalog) and its 95th percentile
//!   (`startup_p95_secs`), both multiplied by the preset's
//!   `startup_factor` (`startup_spread` keeps that share of the distance
//!   from median to p95; 0 makes start-ups constant). Draws are clamped to four standard deviations either
//!   side of the median (in log space) and to [`MAX_STARTUP_MS`], which
//!   leaves the median and the p95 as configured.
//! * **Spot interruptions** come in correlated waves: per type, waves arrive
//!   as a Poisson process and each reclaims `wave_fraction` of that type's
//!   spot leases at once; a small background rate interrupts leases one by
//!   one. The catalog's `spot_interruptions_per_hour` (times
//!   `interruption_factor`) stays the mean rate per spot lease-hour:
//!   `wave_share` of it comes from waves (`waves/h = rate × wave_share /
//!   wave_fraction`), the rest is background.
//! * **Spot refusals** depend on demand: a calm pool refuses with the
//!   simulator's `spot_refusal_probability` × `refusal_factor`; every other
//!   spot request of the same type in the last `refusal_window_secs` adds
//!   `refusal_per_request` (capped at `refusal_max`); after a refusal the
//!   pool is dry for `dry_secs` (refusals meanwhile do not prolong it), and
//!   refuses with at least `dry_refusal`.
//! * **Capacity** is limited per type and tier (the catalog's `capacity`):
//!   an acquire beyond it is refused as no capacity. Reserved capacity is
//!   the commitment: as many leases as were committed to, no more.
//! * **Reserved** capacity is a [`Commitment`]: a count of one type for a
//!   term, billed whether used or not; leases within it cost nothing more.
//!
//! Everything here is pure: the caller passes `now`, and every draw comes
//! from one seeded [`SplitMix64`], so a run is a function of its inputs.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::billing::{HOUR_MS, Millis};
use crate::catalog::{Catalog, Money, Tier};
use crate::table::LeaseId;
use crate::trace::SplitMix64;

/// One day, ms.
pub const DAY_MS: Millis = 86_400_000;

/// Longest start-up a draw may give: beyond any configured p95 (a catalog
/// p95 is at most an hour, and `startup_factor` at most 10).
pub const MAX_STARTUP_MS: Millis = 24 * HOUR_MS;

/// The standard normal's 95th percentile.
const Z95: f64 = 1.644_853_626_951_472_2;

/// Start-up draws are clamped to this many standard deviations (in log
/// space) either side of the median: far enough out not to move the p95.
const Z_CLAMP: f64 = 4.0;

/// A named set of cloud parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CloudPreset {
    /// Realistic but ordinary: catalog start-ups (GPU median 150 s, p95
    /// 300 s), catalog interruption rates, 70% of them in waves that each
    /// reclaim 30% of a type's spot leases, refusals rising with demand.
    Default,
    /// [`CloudPreset::Default`] with start-ups 2.8 times longer (a GPU's
    /// median 420 s), interruptions 10 times as frequent and the calm-pool
    /// refusal probability 10 times higher (2% → 20%).
    Harsh,
    /// The simulator's cloud before this model (kinder than real clouds):
    /// every start-up the catalog's median, interruptions independent at
    /// the catalog rate (no waves), refusals independent at the calm-pool
    /// probability, no dry pools. For hand computations and comparisons.
    Ideal,
}

impl CloudPreset {
    /// Every preset.
    pub const ALL: [CloudPreset; 3] =
        [CloudPreset::Default, CloudPreset::Harsh, CloudPreset::Ideal];

    /// The name used in TOML and on command lines.
    pub fn as_str(self) -> &'static str {
        match self {
            CloudPreset::Default => "default",
            CloudPreset::Harsh => "harsh",
            CloudPreset::Ideal => "ideal",
        }
    }

    /// The preset's parameters.
    pub fn params(self) -> CloudParams {
        let ordinary = CloudParams {
            preset: self,
            startup_factor: 1.0,
            startup_spread: 1.0,
            interruption_factor: 1.0,
            wave_share: 0.7,
            wave_fraction: 0.3,
            refusal_factor: 1.0,
            refusal_per_request: 0.002,
            refusal_window_secs: 600,
            refusal_max: 0.9,
            dry_secs: 900,
            dry_refusal: 0.3,
            reserved_term_days: 30,
        };
        match self {
            CloudPreset::Default => ordinary,
            CloudPreset::Harsh => CloudParams {
                startup_factor: 2.8,
                interruption_factor: 10.0,
                refusal_factor: 10.0,
                ..ordinary
            },
            CloudPreset::Ideal => CloudParams {
                startup_spread: 0.0,
                wave_share: 0.0,
                refusal_per_request: 0.0,
                dry_refusal: 0.0,
                ..ordinary
            },
        }
    }
}

impl fmt::Display for CloudPreset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for CloudPreset {
    type Err = CloudError;
    fn from_str(s: &str) -> Result<CloudPreset, CloudError> {
        CloudPreset::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| CloudError::UnknownPreset(s.to_string()))
    }
}

/// The cloud's parameters, before validation ([`CloudConfig::new`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CloudParams {
    /// The preset the values started from (reported; the values rule).
    pub preset: CloudPreset,
    /// Multiplies every type's median and p95 start-up (0.1..=10).
    pub startup_factor: f64,
    /// How much of the catalog's spread between median and p95 start-ups
    /// is kept (0..=1; 0: every start-up is the median).
    pub startup_spread: f64,
    /// Multiplies every type's `spot_interruptions_per_hour` (0..=100).
    pub interruption_factor: f64,
    /// Share of the interruption rate that comes in waves (0..=1).
    pub wave_share: f64,
    /// Share of a type's spot leases one wave reclaims (above 0, at most 1).
    pub wave_fraction: f64,
    /// Multiplies the simulator's calm-pool spot refusal probability
    /// (0..=50).
    pub refusal_factor: f64,
    /// Added to the refusal probability per other spot request of the same
    /// type within the window (0..=1).
    pub refusal_per_request: f64,
    /// The window over which requests are counted, seconds (1..=86400).
    pub refusal_window_secs: u32,
    /// The highest refusal probability demand can cause (0..=1).
    pub refusal_max: f64,
    /// How long a type's spot pool stays dry after a refusal, seconds
    /// (0..=86400).
    pub dry_secs: u32,
    /// The least refusal probability while the pool is dry (0..=1).
    pub dry_refusal: f64,
    /// A reserved commitment's term, days (1..=1096); the simulator bills
    /// the share of it that the replayed window covers.
    pub reserved_term_days: u32,
}

impl CloudParams {
    fn check(&self) -> Result<(), CloudError> {
        let probability = "use a probability within 0..=1";
        let fields: [(&'static str, f64, f64, f64, &'static str); 12] = [
            (
                "startup_factor",
                self.startup_factor,
                0.1,
                10.0,
                "use a factor within 0.1..=10",
            ),
            (
                "startup_spread",
                self.startup_spread,
                0.0,
                1.0,
                "use a share within 0..=1 (0: constant start-ups)",
            ),
            (
                "interruption_factor",
                self.interruption_factor,
                0.0,
                100.0,
                "use a factor within 0..=100 (0: no interruptions)",
            ),
            (
                "wave_share",
                self.wave_share,
                0.0,
                1.0,
                "use a share within 0..=1",
            ),
            (
                "wave_fraction",
                self.wave_fraction,
                f64::MIN_POSITIVE,
                1.0,
                "use a share above 0 and at most 1 (set wave_share = 0 for no waves)",
            ),
            (
                "refusal_factor",
                self.refusal_factor,
                0.0,
                50.0,
                "use a factor within 0..=50",
            ),
            (
                "refusal_per_request",
                self.refusal_per_request,
                0.0,
                1.0,
                probability,
            ),
            (
                "refusal_window_secs",
                f64::from(self.refusal_window_secs),
                1.0,
                86_400.0,
                "use 1..=86400 seconds",
            ),
            ("refusal_max", self.refusal_max, 0.0, 1.0, probability),
            (
                "dry_secs",
                f64::from(self.dry_secs),
                0.0,
                86_400.0,
                "use 0..=86400 seconds",
            ),
            ("dry_refusal", self.dry_refusal, 0.0, 1.0, probability),
            (
                "reserved_term_days",
                f64::from(self.reserved_term_days),
                1.0,
                1096.0,
                "use 1..=1096 days (30 for a month, 365 for a year)",
            ),
        ];
        for (field, v, lo, hi, expected) in fields {
            if !(v.is_finite() && (lo..=hi).contains(&v)) {
                return Err(CloudError::Field {
                    field,
                    value: v.to_string(),
                    expected,
                });
            }
        }
        Ok(())
    }
}

/// Validated cloud parameters.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(transparent)]
pub struct CloudConfig(CloudParams);

impl Default for CloudConfig {
    /// [`CloudPreset::Default`].
    fn default() -> CloudConfig {
        CloudConfig::preset(CloudPreset::Default)
    }
}

impl CloudConfig {
    /// A preset's configuration.
    pub fn preset(preset: CloudPreset) -> CloudConfig {
        CloudConfig(preset.params())
    }

    /// Checks every field; the error names the first one out of range.
    pub fn new(params: CloudParams) -> Result<CloudConfig, CloudError> {
        params.check()?;
        Ok(CloudConfig(params))
    }

    /// The parameters.
    pub fn params(&self) -> &CloudParams {
        &self.0
    }

    /// The probability that a spot request is refused, given the calm-pool
    /// probability, how many other spot requests of its type were made in
    /// the window, and whether the pool is dry. Never decreases as `recent`
    /// grows, and is at least `dry_refusal` while dry.
    pub fn refusal_probability(&self, calm: f64, recent: usize, dry: bool) -> f64 {
        let p = &self.0;
        let calm = if calm.is_finite() {
            calm.clamp(0.0, 1.0)
        } else {
            0.0
        };
        // demand raises the calm pool's chance up to `refusal_max`, never
        // below the calm chance itself
        let calm = (calm * p.refusal_factor).min(1.0);
        let demand = (calm + p.refusal_per_request * recent as f64).min(p.refusal_max.max(calm));
        let p_refuse = if dry {
            demand.max(p.dry_refusal)
        } else {
            demand
        };
        p_refuse.clamp(0.0, 1.0)
    }
}

/// The `[cloud]` section of a catalog: a preset and any fields that
/// override it.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CloudSection {
    preset: Option<String>,
    startup_factor: Option<f64>,
    startup_spread: Option<f64>,
    interruption_factor: Option<f64>,
    wave_share: Option<f64>,
    wave_fraction: Option<f64>,
    refusal_factor: Option<f64>,
    refusal_per_request: Option<f64>,
    refusal_window_secs: Option<u32>,
    refusal_max: Option<f64>,
    dry_secs: Option<u32>,
    dry_refusal: Option<f64>,
    reserved_term_days: Option<u32>,
}

impl CloudSection {
    /// The preset (default: `default`) with the given fields over it.
    pub(crate) fn resolve(self) -> Result<CloudConfig, CloudError> {
        let preset = match &self.preset {
            Some(name) => name.parse()?,
            None => CloudPreset::Default,
        };
        let base = preset.params();
        CloudConfig::new(CloudParams {
            preset,
            startup_factor: self.startup_factor.unwrap_or(base.startup_factor),
            startup_spread: self.startup_spread.unwrap_or(base.startup_spread),
            interruption_factor: self.interruption_factor.unwrap_or(base.interruption_factor),
            wave_share: self.wave_share.unwrap_or(base.wave_share),
            wave_fraction: self.wave_fraction.unwrap_or(base.wave_fraction),
            refusal_factor: self.refusal_factor.unwrap_or(base.refusal_factor),
            refusal_per_request: self.refusal_per_request.unwrap_or(base.refusal_per_request),
            refusal_window_secs: self.refusal_window_secs.unwrap_or(base.refusal_window_secs),
            refusal_max: self.refusal_max.unwrap_or(base.refusal_max),
            dry_secs: self.dry_secs.unwrap_or(base.dry_secs),
            dry_refusal: self.dry_refusal.unwrap_or(base.dry_refusal),
            reserved_term_days: self.reserved_term_days.unwrap_or(base.reserved_term_days),
        })
    }
}

/// Why a cloud configuration was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum CloudError {
    /// A preset name that is not known.
    #[error("unknown cloud preset {0:?}; use \"default\" or \"harsh\"")]
    UnknownPreset(String),
    /// A field out of range.
    #[error("cloud field {field} is {value}; {expected}")]
    Field {
        /// The field's name in `[cloud]`.
        field: &'static str,
        /// The value given.
        value: String,
        /// What to give instead.
        expected: &'static str,
    },
    /// A start-up distribution that cannot be.
    #[error(
        "start-up p95 {p95_secs} s with median {median_secs} s: give a median >= 0 and a p95 >= the median (equal for a constant start-up)"
    )]
    Startup {
        /// The median given, seconds.
        median_secs: f64,
        /// The p95 given, seconds.
        p95_secs: f64,
    },
}

/// A log-normal start-up time, given by its median and 95th percentile.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StartupDist {
    median_ms: f64,
    sigma: f64,
}

impl StartupDist {
    /// From a median and a p95 in seconds; equal values give a constant.
    pub fn new(median_secs: f64, p95_secs: f64) -> Result<StartupDist, CloudError> {
        let bad = !median_secs.is_finite()
            || !p95_secs.is_finite()
            || median_secs < 0.0
            || p95_secs < median_secs
            || p95_secs * 1000.0 > MAX_STARTUP_MS as f64
            || (median_secs == 0.0 && p95_secs > 0.0);
        if bad {
            return Err(CloudError::Startup {
                median_secs,
                p95_secs,
            });
        }
        let sigma = if median_secs > 0.0 {
            (p95_secs / median_secs).ln() / Z95
        } else {
            0.0
        };
        Ok(StartupDist {
            median_ms: median_secs * 1000.0,
            sigma,
        })
    }

    /// The median, ms.
    pub fn median_ms(&self) -> f64 {
        self.median_ms
    }

    /// The 95th percentile, ms.
    pub fn p95_ms(&self) -> f64 {
        self.median_ms * (self.sigma * Z95).exp()
    }

    /// The least and the most a draw can give, ms.
    pub fn bounds(&self) -> (Millis, Millis) {
        let at = |z: f64| (self.median_ms * (self.sigma * z).exp()).round();
        let hi = at(Z_CLAMP).min(MAX_STARTUP_MS as f64) as Millis;
        (at(-Z_CLAMP) as Millis, hi)
    }

    /// One draw, ms.
    pub fn sample(&self, rng: &mut SplitMix64) -> Millis {
        let z = standard_normal(rng).clamp(-Z_CLAMP, Z_CLAMP);
        let (lo, hi) = self.bounds();
        ((self.median_ms * (self.sigma * z).exp()).round() as Millis).clamp(lo, hi)
    }
}

/// A standard normal draw (Box–Muller).
fn standard_normal(rng: &mut SplitMix64) -> f64 {
    let u1 = 1.0 - rng.unit(); // (0, 1]: ln is finite
    let u2 = rng.unit();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// An exponential wait at `per_hour`, ms (at least 1); None at rate 0.
fn exponential_ms(rng: &mut SplitMix64, per_hour: f64) -> Option<Millis> {
    if per_hour.is_nan() || per_hour <= 0.0 {
        return None;
    }
    let u = 1.0 - rng.unit();
    let ms = -u.ln() / per_hour * HOUR_MS as f64;
    Some((ms.min(u64::MAX as f64 / 4.0) as Millis).max(1))
}

/// Reserved capacity bought for a term: `count` leases of one type, billed
/// whether used or not.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Commitment {
    /// Instance type.
    pub instance_type: String,
    /// Leases committed to.
    pub count: u32,
    /// The reserved price of one lease, per hour.
    pub price_per_hour: Money,
    /// The term, days.
    pub term_days: u32,
}

impl Commitment {
    /// The whole term's bill: term × count × price.
    pub fn term_cost(&self) -> Money {
        Money(
            self.price_per_hour.0
                * i64::from(self.count)
                * i64::from(self.term_days)
                * (DAY_MS / HOUR_MS) as i64,
        )
    }

    /// The share of the bill a window of `window_ms` carries: count ×
    /// price × window, the term prorated (a window longer than the term
    /// renews it at the same price). Exact for whole hours, else rounded to
    /// the nearest millionth.
    pub fn billed_over(&self, window_ms: Millis) -> Money {
        let num =
            i128::from(self.price_per_hour.0) * i128::from(self.count) * i128::from(window_ms);
        let hour = i128::from(HOUR_MS);
        Money(((num + hour / 2) / hour) as i64)
    }
}

/// Why the cloud refused an acquire.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Refusal {
    /// The type's capacity in this tier is all held.
    Capacity {
        /// The tier.
        tier: Tier,
        /// Its limit.
        limit: u32,
    },
    /// The spot pool was short (a calm pool's chance, raised by demand).
    PoolShort {
        /// The probability it was refused with.
        probability: f64,
    },
    /// The spot pool was dry after a recent refusal.
    PoolDry {
        /// The probability it was refused with.
        probability: f64,
    },
}

/// What the cloud granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// How long the worker takes to start, ms.
    pub startup_ms: Millis,
    /// When the background process interrupts it (spot only).
    pub interruption_at: Option<Millis>,
}

/// Why a spot lease was interrupted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum InterruptionCause {
    /// A reclaim wave over its type.
    Wave,
    /// The independent background rate.
    Background,
}

/// A lease the cloud holds, as a wave sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeldLease<'a> {
    /// Id.
    pub id: LeaseId,
    /// Instance type.
    pub instance_type: &'a str,
    /// Tier.
    pub tier: Tier,
}

/// What the simulator sets besides the [`CloudConfig`].
#[derive(Debug, Clone, Copy)]
pub struct CloudSetup<'a> {
    /// A calm pool's spot refusal probability (before `refusal_factor`).
    pub calm_refusal: f64,
    /// Whether spot leases are interrupted at all.
    pub interruptions: bool,
    /// Reserved commitments: the reserved tier's capacity.
    pub commitments: &'a [Commitment],
    /// Seed of every draw.
    pub seed: u64,
}

fn tier_index(tier: Tier) -> usize {
    match tier {
        Tier::OnDemand => 0,
        Tier::Spot => 1,
        Tier::Reserved => 2,
    }
}

#[derive(Debug, Clone)]
struct TypeCloud {
    startup: StartupDist,
    background_per_hour: f64,
    waves_per_hour: f64,
    /// Capacity by [`tier_index`]; None: unlimited.
    limit: [Option<u32>; 3],
    held: [u32; 3],
    recent_spot: VecDeque<Millis>,
    dry_until: Option<Millis>,
}

/// The simulated cloud's state: what is held, recent spot demand, dry
/// pools, and the random source.
#[derive(Debug, Clone)]
pub struct Cloud {
    cfg: CloudConfig,
    calm_refusal: f64,
    types: BTreeMap<String, TypeCloud>,
    rng: SplitMix64,
}

impl Cloud {
    /// The cloud for `catalog` (its start-ups, interruption rates and
    /// capacities; the config's factors are applied here).
    pub fn new(cfg: &CloudConfig, catalog: &Catalog, setup: CloudSetup<'_>) -> Cloud {
        let p = cfg.params();
        let types = catalog
            .instances
            .iter()
            .map(|it| {
                let median = f64::from(it.startup_secs) * p.startup_factor;
                let spread = f64::from(it.startup_p95_secs.saturating_sub(it.startup_secs));
                let p95 = median + spread * p.startup_factor * p.startup_spread;
                // a validated catalog and config always make a distribution;
                // a hand-built one that cannot falls back to a constant
                let startup = StartupDist::new(median, p95)
                    .or_else(|_| StartupDist::new(median, median))
                    .unwrap_or(StartupDist {
                        median_ms: 0.0,
                        sigma: 0.0,
                    });
                let rate = if setup.interruptions {
                    (it.spot_interruptions_per_hour * p.interruption_factor).max(0.0)
                } else {
                    0.0
                };
                let reserved: u32 = setup
                    .commitments
                    .iter()
                    .filter(|c| c.instance_type == it.name)
                    .map(|c| c.count)
                    .sum();
                let tc = TypeCloud {
                    startup,
                    background_per_hour: rate * (1.0 - p.wave_share),
                    waves_per_hour: rate * p.wave_share / p.wave_fraction,
                    limit: [it.capacity.on_demand, it.capacity.spot, Some(reserved)],
                    held: [0; 3],
                    recent_spot: VecDeque::new(),
                    dry_until: None,
                };
                (it.name.clone(), tc)
            })
            .collect();
        Cloud {
            cfg: cfg.clone(),
            calm_refusal: setup.calm_refusal,
            types,
            rng: SplitMix64::new(setup.seed),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &CloudConfig {
        &self.cfg
    }

    /// Leases of `instance_type` in `tier` held now.
    pub fn held(&self, instance_type: &str, tier: Tier) -> u32 {
        self.types
            .get(instance_type)
            .map_or(0, |t| t.held[tier_index(tier)])
    }

    /// The capacity of `instance_type` in `tier` (None: unlimited).
    pub fn limit(&self, instance_type: &str, tier: Tier) -> Option<u32> {
        self.types
            .get(instance_type)
            .map_or(Some(0), |t| t.limit[tier_index(tier)])
    }

    /// Asks for one lease at `now`. A type the cloud does not have is
    /// refused as no capacity.
    pub fn acquire(
        &mut self,
        now: Millis,
        instance_type: &str,
        tier: Tier,
    ) -> Result<Grant, Refusal> {
        let params = self.cfg.params().clone();
        let calm = self.calm_refusal;
        let Some(tc) = self.types.get_mut(instance_type) else {
            return Err(Refusal::Capacity { tier, limit: 0 });
        };
        let k = tier_index(tier);
        if let Some(limit) = tc.limit[k]
            && tc.held[k] >= limit
        {
            return Err(Refusal::Capacity { tier, limit });
        }
        if tier == Tier::Spot {
            let window = u64::from(params.refusal_window_secs) * 1000;
            while tc
                .recent_spot
                .front()
                .is_some_and(|&t| t.saturating_add(window) <= now)
            {
                tc.recent_spot.pop_front();
            }
            let dry = tc.dry_until.is_some_and(|until| now < until);
            let p = self
                .cfg
                .refusal_probability(calm, tc.recent_spot.len(), dry);
            tc.recent_spot.push_back(now);
            if self.rng.unit() < p {
                if !dry {
                    // the pool runs dry for a while, then recovers: a
                    // refusal while dry does not prolong it
                    tc.dry_until = Some(now.saturating_add(u64::from(params.dry_secs) * 1000));
                }
                return Err(if dry {
                    Refusal::PoolDry { probability: p }
                } else {
                    Refusal::PoolShort { probability: p }
                });
            }
        }
        tc.held[k] += 1;
        let startup_ms = tc.startup.sample(&mut self.rng);
        let interruption_at = if tier == Tier::Spot {
            exponential_ms(&mut self.rng, tc.background_per_hour).map(|d| now.saturating_add(d))
        } else {
            None
        };
        Ok(Grant {
            startup_ms,
            interruption_at,
        })
    }

    /// A lease granted by [`Cloud::acquire`] has ended: its capacity is free.
    pub fn release(&mut self, instance_type: &str, tier: Tier) {
        if let Some(tc) = self.types.get_mut(instance_type) {
            let held = &mut tc.held[tier_index(tier)];
            *held = held.saturating_sub(1);
        }
    }

    /// The types whose spot leases are reclaimed in waves.
    pub fn wave_types(&self) -> Vec<String> {
        self.types
            .iter()
            .filter(|(_, t)| t.waves_per_hour > 0.0)
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// When the next wave over `instance_type` after `after` strikes (None:
    /// it has none).
    pub fn next_wave(&mut self, instance_type: &str, after: Millis) -> Option<Millis> {
        let rate = self.types.get(instance_type)?.waves_per_hour;
        exponential_ms(&mut self.rng, rate).map(|d| after.saturating_add(d))
    }

    /// A wave over `instance_type`: which of `held` it reclaims. Only spot
    /// leases of that type are candidates; of `n` candidates it takes
    /// `wave_fraction × n`, rounded at random to a whole lease so that the
    /// mean is exact, chosen at random. Returned in id order.
    pub fn wave(&mut self, instance_type: &str, held: &[HeldLease<'_>]) -> Vec<LeaseId> {
        let mut pool: Vec<LeaseId> = held
            .iter()
            .filter(|l| l.tier == Tier::Spot && l.instance_type == instance_type)
            .map(|l| l.id)
            .collect();
        let want = self.cfg.params().wave_fraction * pool.len() as f64;
        let mut take = want.floor() as usize;
        if self.rng.unit() < want - want.floor() {
            take += 1;
        }
        let take = take.min(pool.len());
        // partial Fisher–Yates: the first `take` are a uniform choice
        for i in 0..take {
            let j = i + (self.rng.next_u64() % (pool.len() - i) as u64) as usize;
            pool.swap(i, j);
        }
        pool.truncate(take);
        pool.sort();
        pool
    }
}

/// `catalog` as the configured cloud makes it: start-ups (median and p95)
/// times `startup_factor` (the p95 nearer the median by `startup_spread`), interruption rates times `interruption_factor`.
/// What an operator of that cloud would configure, so the simulator gives
/// it to the autoscaler.
pub fn effective_catalog(catalog: &Catalog, cfg: &CloudConfig) -> Catalog {
    let p = cfg.params();
    let mut c = catalog.clone();
    for it in &mut c.instances {
        let spread = f64::from(it.startup_p95_secs.saturating_sub(it.startup_secs));
        let median = f64::from(it.startup_secs) * p.startup_factor;
        it.startup_secs = median.round() as u32;
        it.startup_p95_secs =
            (median + spread * p.startup_factor * p.startup_spread).round() as u32;
        it.spot_interruptions_per_hour *= p.interruption_factor;
    }
    c
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn quantile(sorted: &[Millis], q: f64) -> f64 {
        let k = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
        sorted[k - 1] as f64
    }

    #[test]
    fn startup_draws_have_the_configured_median_and_p95_and_stay_in_bounds() {
        let d = StartupDist::new(150.0, 300.0).unwrap();
        let (lo, hi) = d.bounds();
        let mut rng = SplitMix64::new(1);
        let mut xs: Vec<Millis> = (0..20_000).map(|_| d.sample(&mut rng)).collect();
        assert!(xs.iter().all(|&x| (lo..=hi).contains(&x)), "{lo}..{hi}");
        xs.sort_unstable();
        let (median, p95) = (quantile(&xs, 0.5), quantile(&xs, 0.95));
        // 20 000 draws: the sample quantiles are within a few percent
        assert!((median / 150_000.0 - 1.0).abs() < 0.03, "median {median}");
        assert!((p95 / 300_000.0 - 1.0).abs() < 0.04, "p95 {p95}");
        assert!((d.p95_ms() - 300_000.0).abs() < 1e-6);
    }

    #[test]
    fn equal_median_and_p95_make_a_constant_start_up() {
        let d = StartupDist::new(150.0, 150.0).unwrap();
        let mut rng = SplitMix64::new(9);
        assert!((0..100).all(|_| d.sample(&mut rng) == 150_000));
        assert_eq!(d.bounds(), (150_000, 150_000));
    }

    #[test]
    fn an_impossible_start_up_is_refused_naming_both_values() {
        for (m, p) in [(300.0, 150.0), (-1.0, 10.0), (0.0, 10.0), (f64::NAN, 1.0)] {
            let e = StartupDist::new(m, p).unwrap_err();
            assert!(e.to_string().contains("p95 >= the median"), "{e}");
        }
    }

    #[test]
    fn presets_are_valid_and_harsh_is_default_with_three_knobs_turned() {
        for p in CloudPreset::ALL {
            CloudConfig::new(p.params()).unwrap();
            assert_eq!(p.as_str().parse::<CloudPreset>().unwrap(), p);
        }
        let (d, h) = (CloudPreset::Default.params(), CloudPreset::Harsh.params());
        assert_eq!(h.startup_factor, 2.8); // 150 s -> 420 s
        assert_eq!(h.interruption_factor, 10.0);
        assert_eq!(h.refusal_factor, 10.0); // 2% -> 20%
        let same = CloudParams {
            preset: d.preset,
            startup_factor: d.startup_factor,
            interruption_factor: d.interruption_factor,
            refusal_factor: d.refusal_factor,
            ..h
        };
        assert_eq!(same, d);
        let e = "windy".parse::<CloudPreset>().unwrap_err();
        assert!(e.to_string().contains("\"default\" or \"harsh\""), "{e}");
    }

    #[test]
    fn a_field_out_of_range_is_refused_naming_it_and_the_fix() {
        let bad = [
            (
                "wave_fraction",
                CloudParams {
                    wave_fraction: 0.0,
                    ..CloudPreset::Default.params()
                },
            ),
            (
                "wave_share",
                CloudParams {
                    wave_share: 1.5,
                    ..CloudPreset::Default.params()
                },
            ),
            (
                "startup_factor",
                CloudParams {
                    startup_factor: f64::NAN,
                    ..CloudPreset::Default.params()
                },
            ),
            (
                "dry_refusal",
                CloudParams {
                    dry_refusal: -0.1,
                    ..CloudPreset::Default.params()
                },
            ),
            (
                "reserved_term_days",
                CloudParams {
                    reserved_term_days: 0,
                    ..CloudPreset::Default.params()
                },
            ),
        ];
        for (field, params) in bad {
            let e = CloudConfig::new(params).unwrap_err();
            assert!(
                matches!(e, CloudError::Field { field: f, .. } if f == field),
                "{e}"
            );
            let text = e.to_string();
            assert!(text.contains(field) && text.contains("use "), "{text}");
        }
    }

    #[test]
    fn a_cloud_section_overrides_its_preset_and_refuses_unknown_fields() {
        let s: CloudSection = toml::from_str("preset = \"harsh\"\nwave_share = 0.5\n").unwrap();
        let c = s.resolve().unwrap();
        assert_eq!(c.params().preset, CloudPreset::Harsh);
        assert_eq!(c.params().wave_share, 0.5);
        assert_eq!(c.params().startup_factor, 2.8);
        assert!(toml::from_str::<CloudSection>("gusts = 3\n").is_err());
        let e = toml::from_str::<CloudSection>("preset = \"calm\"\n")
            .unwrap()
            .resolve()
            .unwrap_err();
        assert!(matches!(e, CloudError::UnknownPreset(_)), "{e}");
    }

    #[test]
    fn a_dry_pool_refuses_at_least_dry_refusal_and_recovers_after_dry_secs() {
        let params = CloudParams {
            refusal_per_request: 0.0,
            dry_refusal: 1.0,
            dry_secs: 600,
            ..CloudPreset::Default.params()
        };
        let cfg = CloudConfig::new(params).unwrap();
        let catalog = Catalog::default_catalog();
        let setup = |calm| CloudSetup {
            calm_refusal: calm,
            interruptions: false,
            commitments: &[],
            seed: 3,
        };
        // a pool that always refuses, to start the dry spell at t = 0
        let mut cloud = Cloud::new(&cfg, &catalog, setup(1.0));
        assert!(matches!(
            cloud.acquire(0, "h100", Tier::Spot),
            Err(Refusal::PoolShort { .. })
        ));
        // then a calm pool: dry (refused for sure) until 600 s, then granted
        cloud.calm_refusal = 0.0;
        for t in [1_000, 300_000, 599_999] {
            assert!(matches!(
                cloud.acquire(t, "h100", Tier::Spot),
                Err(Refusal::PoolDry { .. })
            ));
        }
        assert!(cloud.acquire(600_000, "h100", Tier::Spot).is_ok());
        // on-demand is never refused by the pool
        assert!(cloud.acquire(0, "h100", Tier::OnDemand).is_ok());
    }

    #[test]
    fn reserved_capacity_is_the_commitment() {
        let c = Commitment {
            instance_type: "h100".into(),
            count: 2,
            price_per_hour: Money::from_units(27.68),
            term_days: 30,
        };
        let mut cloud = Cloud::new(
            &CloudConfig::default(),
            &Catalog::default_catalog(),
            CloudSetup {
                calm_refusal: 0.0,
                interruptions: true,
                commitments: std::slice::from_ref(&c),
                seed: 1,
            },
        );
        assert!(cloud.acquire(0, "h100", Tier::Reserved).is_ok());
        assert!(cloud.acquire(0, "h100", Tier::Reserved).is_ok());
        assert_eq!(
            cloud.acquire(0, "h100", Tier::Reserved),
            Err(Refusal::Capacity {
                tier: Tier::Reserved,
                limit: 2
            })
        );
        assert_eq!(
            cloud.acquire(0, "a100", Tier::Reserved),
            Err(Refusal::Capacity {
                tier: Tier::Reserved,
                limit: 0
            })
        );
        cloud.release("h100", Tier::Reserved);
        assert!(cloud.acquire(0, "h100", Tier::Reserved).is_ok());
    }

    #[test]
    fn the_same_seed_gives_the_same_cloud() {
        let run = || {
            let mut cloud = Cloud::new(
                &CloudConfig::preset(CloudPreset::Harsh),
                &Catalog::default_catalog(),
                CloudSetup {
                    calm_refusal: 0.02,
                    interruptions: true,
                    commitments: &[],
                    seed: 5,
                },
            );
            (0..200u64)
                .map(|k| {
                    (
                        cloud.acquire(k * 7_000, "h100", Tier::Spot),
                        cloud.next_wave("h100", k),
                    )
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
    }

    fn tier() -> impl Strategy<Value = Tier> {
        prop::sample::select(Tier::ALL.to_vec())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        #[test]
        fn start_up_draws_stay_within_their_bounds(
            median in 0.0f64..3600.0,
            spread in 1.0f64..4.0,
            seed in any::<u64>(),
        ) {
            let p95 = (median * spread).min(3600.0).max(median);
            let d = StartupDist::new(median, p95).unwrap();
            let (lo, hi) = d.bounds();
            prop_assert!(lo as f64 <= d.median_ms() + 0.5 && d.median_ms() <= d.p95_ms() + 1e-6);
            prop_assert!(d.p95_ms() <= hi as f64 + 0.5 && hi <= MAX_STARTUP_MS);
            let mut rng = SplitMix64::new(seed);
            for _ in 0..200 {
                let x = d.sample(&mut rng);
                prop_assert!((lo..=hi).contains(&x), "{x} outside {lo}..={hi}");
            }
        }

        #[test]
        fn refusal_probability_never_falls_as_recent_requests_grow(
            calm in 0.0f64..1.0,
            a in 0usize..500,
            b in 0usize..500,
            dry in any::<bool>(),
            harsh in any::<bool>(),
        ) {
            let preset = if harsh { CloudPreset::Harsh } else { CloudPreset::Default };
            let cfg = CloudConfig::preset(preset);
            let (few, many) = (a.min(b), a.max(b));
            let (p_few, p_many) = (
                cfg.refusal_probability(calm, few, dry),
                cfg.refusal_probability(calm, many, dry),
            );
            prop_assert!(p_few <= p_many, "{p_few} > {p_many}");
            prop_assert!((0.0..=1.0).contains(&p_many));
            prop_assert!(cfg.refusal_probability(calm, few, true) >= p_few.min(cfg.params().dry_refusal));
            prop_assert!(cfg.refusal_probability(calm, few, true) >= cfg.params().dry_refusal);
        }

        #[test]
        fn never_more_leases_than_the_capacity(
            ops in prop::collection::vec((tier(), any::<bool>(), 0u64..600), 1..300),
            od in 0u32..6,
            spot in 0u32..6,
            seed in any::<u64>(),
        ) {
            let mut catalog = Catalog::default_catalog();
            for it in &mut catalog.instances {
                it.capacity = crate::catalog::Capacity { on_demand: Some(od), spot: Some(spot) };
            }
            let commitments = [Commitment {
                instance_type: "h100".into(),
                count: 2,
                price_per_hour: Money::from_units(27.68),
                term_days: 30,
            }];
            let mut cloud = Cloud::new(
                &CloudConfig::default(),
                &catalog,
                CloudSetup { calm_refusal: 0.1, interruptions: true, commitments: &commitments, seed },
            );
            let mut held = [0u32; 3];
            let limit = [od, spot, 2];
            for (k, (tier, release, dt)) in ops.into_iter().enumerate() {
                let i = tier_index(tier);
                let now = k as u64 * 1000 + dt;
                if release && held[i] > 0 {
                    cloud.release("h100", tier);
                    held[i] -= 1;
                    continue;
                }
                match cloud.acquire(now, "h100", tier) {
                    Ok(_) => held[i] += 1,
                    Err(Refusal::Capacity { limit: l, .. }) => {
                        prop_assert_eq!(l, limit[i]);
                        prop_assert_eq!(held[i], limit[i], "refused below the limit");
                    }
                    Err(_) => prop_assert_eq!(tier, Tier::Spot, "only spot pools run short"),
                }
                prop_assert!(held[i] <= limit[i], "{} held, limit {}", held[i], limit[i]);
                prop_assert_eq!(cloud.held("h100", tier), held[i]);
            }
        }

        #[test]
        fn a_wave_reclaims_only_spot_leases_of_its_type_and_its_share_of_them(
            leases in prop::collection::vec((0usize..3, tier()), 0..80),
            fraction in 0.01f64..1.0,
            seed in any::<u64>(),
        ) {
            let types = ["h100", "a100", "v100"];
            let held: Vec<HeldLease<'_>> = leases
                .iter()
                .enumerate()
                .map(|(k, &(t, tier))| HeldLease { id: LeaseId(k as u64 + 1), instance_type: types[t], tier })
                .collect();
            let cfg = CloudConfig::new(CloudParams { wave_fraction: fraction, ..CloudPreset::Default.params() }).unwrap();
            let mut cloud = Cloud::new(
                &cfg,
                &Catalog::default_catalog(),
                CloudSetup { calm_refusal: 0.0, interruptions: true, commitments: &[], seed },
            );
            let taken = cloud.wave("h100", &held);
            let eligible: Vec<LeaseId> = held
                .iter()
                .filter(|l| l.instance_type == "h100" && l.tier == Tier::Spot)
                .map(|l| l.id)
                .collect();
            for id in &taken {
                prop_assert!(eligible.contains(id), "{id:?} is not an h100 spot lease");
            }
            let want = fraction * eligible.len() as f64;
            prop_assert!(taken.len() as f64 >= want.floor() && taken.len() as f64 <= want.ceil());
            let mut unique = taken.clone();
            unique.dedup();
            prop_assert_eq!(unique.len(), taken.len());
        }

        #[test]
        fn a_commitment_bills_term_times_count_times_price(
            count in 0u32..500,
            cents in 0i64..10_000_000,
            term_days in 1u32..1096,
            hours in 0u64..20_000,
        ) {
            let price = Money(cents * 10_000);
            let c = Commitment { instance_type: "h100".into(), count, price_per_hour: price, term_days };
            let term_hours = i64::from(term_days) * 24;
            prop_assert_eq!(c.term_cost(), Money(price.0 * i64::from(count) * term_hours));
            prop_assert_eq!(c.billed_over(u64::from(term_days) * DAY_MS), c.term_cost());
            prop_assert_eq!(c.billed_over(hours * HOUR_MS), Money(price.0 * i64::from(count) * hours as i64));
        }
    }
}
