//! Seeded generators of arrival traces, one per load shape, and the suite
//! of traces shipped in `lease-core/traces/`.
//!
//! Each [`Kind`] has a parameter struct whose `Default` is what the suite
//! uses unless it says otherwise; levels are in GPUs of load
//! ([`TraceSpec::fps_per_gpu`] frames/s each, [`FPS_PER_GPU`] by default).
//! Generation is a pure function of the spec and a seed (every draw comes
//! from [`SplitMix64`]), so a committed trace can be checked byte for byte
//! against its generator.
//!
//! The simulator takes a trace's first days as history (their minimum
//! sizes the reserved floor; they are not replayed:
//! `sim::SimOptions::history_days`, one day unless
//! `trace::history_days_for` says otherwise). The `weekly` and `burst`
//! kinds therefore start with `history_days` days before the window they
//! are about (a whole office week before the one replayed, since one day
//! cannot show a week's lowest load; the burst's base without bursts), so
//! that the window replayed is the office week or the burst itself.
//!
//! | kind | shape |
//! |---|---|
//! | `diurnal` | a night level and a day level, with ramps, a day-to-day level and per-minute noise |
//! | `weekly` | an office week from Monday 00:00: business hours with a lunch dip on weekdays, quiet nights and weekends |
//! | `burst` | a diurnal base plus bursts of a few hours at random times, scaled to an exact mean and peak |
//! | `growth` | a level growing by the same factor every day, with a daily swing |
//! | `flip` | load that flips between a high and a low level, each phase a random length within bounds |
//! | `noise` | a wandering base with heavy per-minute noise and random spikes |

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::trace::{FPS_PER_GPU, MAX_T_SECS, SplitMix64, Trace};

/// One V100 worker at the SLO under the simulator's default workload
/// (`sim::Workload::default()`: 136.2 frames/s), rounded down. The
/// `burst-72h-v100` trace counts its load in these units, so that its 487
/// GPUs at the peak are 487 V100s, as in the design seed's 72-hour burst.
/// Fixed here, not computed, so the committed trace does not move when the
/// serving model does; a test checks it against the simulator.
pub const V100_FPS_PER_GPU: f64 = 136.0;

/// The load shapes the generator knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// Night and day levels with ramps ([`Diurnal`]).
    Diurnal,
    /// An office week ([`Weekly`]).
    Weekly,
    /// A diurnal base with bursts, exact mean and peak ([`Burst`]).
    Burst,
    /// Steady daily growth ([`Growth`]).
    Growth,
    /// High and low phases of random length ([`Flip`]).
    Flip,
    /// Noise and random spikes ([`Noise`]).
    Noise,
}

impl Kind {
    /// Every kind, in documentation order.
    pub const ALL: [Kind; 6] = [
        Kind::Diurnal,
        Kind::Weekly,
        Kind::Burst,
        Kind::Growth,
        Kind::Flip,
        Kind::Noise,
    ];

    /// The CLI name.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Diurnal => "diurnal",
            Kind::Weekly => "weekly",
            Kind::Burst => "burst",
            Kind::Growth => "growth",
            Kind::Flip => "flip",
            Kind::Noise => "noise",
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Kind {
    type Err = GenError;
    fn from_str(s: &str) -> Result<Kind, GenError> {
        Kind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| GenError::UnknownKind(s.to_string()))
    }
}

/// Why a trace could not be generated.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum GenError {
    /// A kind the generator does not know.
    #[error("unknown trace kind {0:?}; use diurnal, weekly, burst, growth, flip or noise")]
    UnknownKind(String),
    /// A parameter out of its range.
    #[error("{kind} trace: {field} {reason}")]
    Invalid {
        /// The kind.
        kind: Kind,
        /// The parameter.
        field: &'static str,
        /// What is wrong and what would do.
        reason: String,
    },
}

/// `diurnal`: a night level and a day level (UTC), ramping between them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Diurnal {
    /// Length in days.
    pub days: u32,
    /// Load at night (GPUs).
    pub night_gpus: f64,
    /// Load by day (GPUs).
    pub day_gpus: f64,
    /// Hour (UTC) at which the morning ramp starts.
    pub ramp_up_at_h: f64,
    /// Hour (UTC) at which the evening ramp starts.
    pub ramp_down_at_h: f64,
    /// Length of each ramp (h).
    pub ramp_hours: f64,
    /// Each day's day level is off by up to this fraction, drawn per day.
    pub day_to_day: f64,
    /// Per-minute noise (standard deviation, fraction of the level).
    pub noise: f64,
}

impl Default for Diurnal {
    fn default() -> Diurnal {
        Diurnal {
            days: 14,
            night_gpus: 40.0,
            day_gpus: 180.0,
            ramp_up_at_h: 7.0,
            ramp_down_at_h: 18.5,
            ramp_hours: 2.5,
            day_to_day: 0.05,
            noise: 0.02,
        }
    }
}

/// `weekly`: an office week from Monday 00:00 UTC, after `history_days`
/// days before it (by default a whole office week, so the trace starts on
/// a Monday, 00:00 UTC, and the simulator sizes the reserved floor from a
/// week of history, weekday nights included: `trace::history_days_for`). On weekdays the
/// load ramps from the night level up to the business level from
/// `open_at_h` and back down from `close_at_h`, dipping by `lunch_dip` for
/// `lunch_hours` from `lunch_at_h` (15-minute edges); Saturday and Sunday
/// stay at the weekend level.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Weekly {
    /// Length in weeks, after the history days.
    pub weeks: u32,
    /// Days before the first Monday: history, which the simulator does not
    /// replay (7: the week before; 1: the Sunday before).
    pub history_days: u32,
    /// Weekday nights (GPUs).
    pub night_gpus: f64,
    /// All of Saturday and Sunday (GPUs).
    pub weekend_gpus: f64,
    /// Weekday business hours (GPUs).
    pub business_gpus: f64,
    /// Hour at which the morning ramp starts.
    pub open_at_h: f64,
    /// Hour at which the evening ramp starts.
    pub close_at_h: f64,
    /// Length of each ramp (h).
    pub ramp_hours: f64,
    /// Hour at which lunch starts.
    pub lunch_at_h: f64,
    /// Length of lunch (h).
    pub lunch_hours: f64,
    /// Fraction of the business load that goes away over lunch.
    pub lunch_dip: f64,
    /// Per-minute noise (standard deviation, fraction of the level).
    pub noise: f64,
}

impl Default for Weekly {
    fn default() -> Weekly {
        Weekly {
            weeks: 1,
            history_days: 7,
            night_gpus: 15.0,
            weekend_gpus: 25.0,
            business_gpus: 220.0,
            open_at_h: 7.5,
            close_at_h: 17.5,
            ramp_hours: 1.5,
            lunch_at_h: 12.0,
            lunch_hours: 1.0,
            lunch_dip: 0.4,
            noise: 0.02,
        }
    }
}

/// `burst`: `history_days` days of a diurnal base (lowest at 04:00 UTC),
/// then `hours` of the same base plus `bursts` bursts, each centred at a
/// random time at least `burst_hours_max` from either end of the window, a
/// Gaussian of random width (standard deviation within
/// `burst_hours_min..=burst_hours_max` / 2) and random height; all mapped
/// (affinely) so that over the `hours` of the burst window the mean and the
/// peak are exactly `mean_gpus` and `peak_gpus`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Burst {
    /// Days of the base alone before the burst window.
    pub history_days: u32,
    /// Length of the burst window in hours.
    pub hours: u32,
    /// Mean load (GPUs), exact.
    pub mean_gpus: f64,
    /// Peak load (GPUs), exact.
    pub peak_gpus: f64,
    /// Number of bursts.
    pub bursts: u32,
    /// Shortest burst width (h).
    pub burst_hours_min: f64,
    /// Longest burst width (h).
    pub burst_hours_max: f64,
    /// Per-minute noise (standard deviation, fraction of the level).
    pub noise: f64,
}

impl Default for Burst {
    /// The design seed's burst: 72 hours, mean 320, peak 487.
    fn default() -> Burst {
        Burst {
            history_days: 1,
            hours: 72,
            mean_gpus: 320.0,
            peak_gpus: 487.0,
            bursts: 3,
            burst_hours_min: 2.0,
            burst_hours_max: 6.0,
            noise: 0.02,
        }
    }
}

/// `growth`: a level that grows by the same factor every day, from
/// `start_gpus` to `end_gpus`, times a daily swing of ±`daily_swing`
/// (lowest at 04:00 UTC).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Growth {
    /// Length in days.
    pub days: u32,
    /// Level at the start (GPUs).
    pub start_gpus: f64,
    /// Level at the end (GPUs).
    pub end_gpus: f64,
    /// Daily swing around the level (fraction).
    pub daily_swing: f64,
    /// Per-minute noise (standard deviation, fraction of the level).
    pub noise: f64,
}

impl Default for Growth {
    fn default() -> Growth {
        Growth {
            days: 7,
            start_gpus: 60.0,
            end_gpus: 240.0,
            daily_swing: 0.25,
            noise: 0.02,
        }
    }
}

/// `flip`: load that starts high and flips between `high_gpus` and
/// `low_gpus` (from one minute to the next), each phase lasting a whole
/// number of minutes drawn uniformly in `min_minutes..=max_minutes`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Flip {
    /// Length in hours.
    pub hours: u32,
    /// High level (GPUs).
    pub high_gpus: f64,
    /// Low level (GPUs).
    pub low_gpus: f64,
    /// Shortest phase (minutes).
    pub min_minutes: u32,
    /// Longest phase (minutes).
    pub max_minutes: u32,
    /// Per-minute noise (standard deviation, fraction of the level).
    pub noise: f64,
}

impl Default for Flip {
    fn default() -> Flip {
        Flip {
            hours: 48,
            high_gpus: 220.0,
            low_gpus: 70.0,
            min_minutes: 50,
            max_minutes: 70,
            noise: 0.02,
        }
    }
}

/// `noise`: a base level that wanders (a slow random walk pulled back to
/// `base_gpus`, within ±`wander`), heavy per-minute noise, and spikes at
/// random (exponential gaps, `spikes_per_hour` on average), each of a
/// random height and length within bounds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Noise {
    /// Length in hours.
    pub hours: u32,
    /// Base level (GPUs).
    pub base_gpus: f64,
    /// How far the base may wander (fraction).
    pub wander: f64,
    /// Per-minute noise (standard deviation, fraction of the level).
    pub noise: f64,
    /// Mean number of spikes an hour.
    pub spikes_per_hour: f64,
    /// Smallest spike (GPUs added).
    pub spike_min_gpus: f64,
    /// Largest spike (GPUs added).
    pub spike_max_gpus: f64,
    /// Shortest spike (minutes).
    pub spike_min_minutes: u32,
    /// Longest spike (minutes).
    pub spike_max_minutes: u32,
}

impl Default for Noise {
    fn default() -> Noise {
        Noise {
            hours: 48,
            base_gpus: 120.0,
            wander: 0.15,
            noise: 0.08,
            spikes_per_hour: 1.5,
            spike_min_gpus: 20.0,
            spike_max_gpus: 120.0,
            spike_min_minutes: 2,
            spike_max_minutes: 10,
        }
    }
}

/// A kind with its parameters.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Shape {
    /// See [`Diurnal`].
    Diurnal(Diurnal),
    /// See [`Weekly`].
    Weekly(Weekly),
    /// See [`Burst`].
    Burst(Burst),
    /// See [`Growth`].
    Growth(Growth),
    /// See [`Flip`].
    Flip(Flip),
    /// See [`Noise`].
    Noise(Noise),
}

impl Shape {
    /// `kind` with its default parameters.
    pub fn default_for(kind: Kind) -> Shape {
        match kind {
            Kind::Diurnal => Shape::Diurnal(Diurnal::default()),
            Kind::Weekly => Shape::Weekly(Weekly::default()),
            Kind::Burst => Shape::Burst(Burst::default()),
            Kind::Growth => Shape::Growth(Growth::default()),
            Kind::Flip => Shape::Flip(Flip::default()),
            Kind::Noise => Shape::Noise(Noise::default()),
        }
    }

    /// The days of history before the window the shape is about: the
    /// `weekly` and `burst` kinds' `history_days`, one day for the others
    /// (the simulator's default).
    pub fn history_days(&self) -> u32 {
        match self {
            Shape::Weekly(p) => p.history_days,
            Shape::Burst(p) => p.history_days,
            _ => 1,
        }
    }

    /// Its kind.
    pub fn kind(&self) -> Kind {
        match self {
            Shape::Diurnal(_) => Kind::Diurnal,
            Shape::Weekly(_) => Kind::Weekly,
            Shape::Burst(_) => Kind::Burst,
            Shape::Growth(_) => Kind::Growth,
            Shape::Flip(_) => Kind::Flip,
            Shape::Noise(_) => Kind::Noise,
        }
    }

    /// Length in minutes.
    fn minutes(&self) -> u64 {
        match self {
            Shape::Diurnal(p) => u64::from(p.days) * 1440,
            Shape::Weekly(p) => (u64::from(p.weeks) * 7 + u64::from(p.history_days)) * 1440,
            Shape::Growth(p) => u64::from(p.days) * 1440,
            Shape::Burst(p) => u64::from(p.history_days) * 1440 + u64::from(p.hours) * 60,
            Shape::Flip(p) => u64::from(p.hours) * 60,
            Shape::Noise(p) => u64::from(p.hours) * 60,
        }
    }

    fn validate(&self) -> Result<(), GenError> {
        let kind = self.kind();
        let bad = |field: &'static str, reason: String| GenError::Invalid {
            kind,
            field,
            reason,
        };
        let minutes = self.minutes();
        if minutes == 0 || minutes * 60 > MAX_T_SECS {
            return Err(bad(
                "length",
                format!("is {minutes} minutes; it must be at least a minute and at most a year"),
            ));
        }
        for (field, v) in self.levels() {
            if !v.is_finite() || v < 0.0 {
                return Err(bad(field, format!("is {v}; it must be a number ≥ 0")));
            }
        }
        for (field, v) in self.fractions() {
            if !(0.0..=1.0).contains(&v) {
                return Err(bad(field, format!("is {v}; it must be within 0..=1")));
            }
        }
        self.validate_own()
            .map_err(|(field, reason)| bad(field, reason))
    }

    /// The parameters that are loads, hours or counts (≥ 0).
    fn levels(&self) -> Vec<(&'static str, f64)> {
        match self {
            Shape::Diurnal(p) => vec![
                ("night_gpus", p.night_gpus),
                ("day_gpus", p.day_gpus),
                ("ramp_up_at_h", p.ramp_up_at_h),
                ("ramp_down_at_h", p.ramp_down_at_h),
                ("ramp_hours", p.ramp_hours),
            ],
            Shape::Weekly(p) => vec![
                ("night_gpus", p.night_gpus),
                ("weekend_gpus", p.weekend_gpus),
                ("business_gpus", p.business_gpus),
                ("open_at_h", p.open_at_h),
                ("close_at_h", p.close_at_h),
                ("ramp_hours", p.ramp_hours),
                ("lunch_at_h", p.lunch_at_h),
                ("lunch_hours", p.lunch_hours),
            ],
            Shape::Burst(p) => vec![
                ("mean_gpus", p.mean_gpus),
                ("peak_gpus", p.peak_gpus),
                ("burst_hours_min", p.burst_hours_min),
                ("burst_hours_max", p.burst_hours_max),
            ],
            Shape::Growth(p) => vec![("start_gpus", p.start_gpus), ("end_gpus", p.end_gpus)],
            Shape::Flip(p) => vec![("high_gpus", p.high_gpus), ("low_gpus", p.low_gpus)],
            Shape::Noise(p) => vec![
                ("base_gpus", p.base_gpus),
                ("spikes_per_hour", p.spikes_per_hour),
                ("spike_min_gpus", p.spike_min_gpus),
                ("spike_max_gpus", p.spike_max_gpus),
            ],
        }
    }

    /// The parameters that are fractions (0..=1).
    fn fractions(&self) -> Vec<(&'static str, f64)> {
        match self {
            Shape::Diurnal(p) => vec![("day_to_day", p.day_to_day), ("noise", p.noise)],
            Shape::Weekly(p) => vec![("lunch_dip", p.lunch_dip), ("noise", p.noise)],
            Shape::Burst(p) => vec![("noise", p.noise)],
            Shape::Growth(p) => vec![("daily_swing", p.daily_swing), ("noise", p.noise)],
            Shape::Flip(p) => vec![("noise", p.noise)],
            Shape::Noise(p) => vec![("wander", p.wander), ("noise", p.noise)],
        }
    }

    /// The checks particular to one kind: (field, reason).
    fn validate_own(&self) -> Result<(), (&'static str, String)> {
        match self {
            Shape::Burst(p) => {
                if p.peak_gpus <= p.mean_gpus {
                    return Err((
                        "peak_gpus",
                        format!(
                            "= {} must be above mean_gpus = {}",
                            p.peak_gpus, p.mean_gpus
                        ),
                    ));
                }
                if p.burst_hours_min <= 0.0 || p.burst_hours_min > p.burst_hours_max {
                    return Err((
                        "burst_hours_min",
                        "must be above 0 and at most burst_hours_max".to_string(),
                    ));
                }
                if 2.0 * p.burst_hours_max >= f64::from(p.hours) {
                    return Err((
                        "burst_hours_max",
                        format!("must be under half the trace's {} hours", p.hours),
                    ));
                }
                Ok(())
            }
            Shape::Growth(p) if p.start_gpus <= 0.0 => Err((
                "start_gpus",
                "must be above 0 (growth is by a factor)".to_string(),
            )),
            Shape::Flip(p) if p.min_minutes == 0 || p.min_minutes > p.max_minutes => Err((
                "min_minutes",
                format!(
                    "= {} must be at least 1 and at most max_minutes = {}",
                    p.min_minutes, p.max_minutes
                ),
            )),
            Shape::Noise(p)
                if p.spike_min_minutes == 0 || p.spike_min_minutes > p.spike_max_minutes =>
            {
                Err((
                    "spike_min_minutes",
                    "must be at least 1 and at most spike_max_minutes".to_string(),
                ))
            }
            Shape::Noise(p) if p.spike_min_gpus > p.spike_max_gpus => Err((
                "spike_min_gpus",
                "must be at most spike_max_gpus".to_string(),
            )),
            _ => Ok(()),
        }
    }

    /// The load per minute, in GPUs.
    fn gpus(&self, rng: &mut SplitMix64) -> Result<Vec<f64>, GenError> {
        Ok(match self {
            Shape::Diurnal(p) => diurnal(p, rng),
            Shape::Weekly(p) => weekly(p, rng),
            Shape::Burst(p) => burst(p, rng)?,
            Shape::Growth(p) => growth(p, rng),
            Shape::Flip(p) => flip(p, rng),
            Shape::Noise(p) => noise(p, rng),
        })
    }
}

/// What to generate: a shape and the unit its GPUs are counted in.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TraceSpec {
    /// The kind and its parameters.
    pub shape: Shape,
    /// Frames/s in one GPU of load ([`FPS_PER_GPU`] unless the trace is
    /// meant for another type, as [`V100_FPS_PER_GPU`]).
    pub fps_per_gpu: f64,
}

impl TraceSpec {
    /// `kind` with its default parameters, in [`FPS_PER_GPU`] units.
    pub fn new(kind: Kind) -> TraceSpec {
        TraceSpec {
            shape: Shape::default_for(kind),
            fps_per_gpu: FPS_PER_GPU,
        }
    }

    /// The trace called `name` for `seed`. A parameter out of range is a
    /// [`GenError::Invalid`] naming it.
    pub fn generate(&self, name: &str, seed: u64) -> Result<Trace, GenError> {
        self.shape.validate()?;
        if !(self.fps_per_gpu.is_finite() && self.fps_per_gpu > 0.0) {
            return Err(GenError::Invalid {
                kind: self.shape.kind(),
                field: "fps_per_gpu",
                reason: format!("is {}; it must be above 0", self.fps_per_gpu),
            });
        }
        let mut rng = SplitMix64::new(seed);
        let gpus = self.shape.gpus(&mut rng)?;
        Ok(Trace::from_gpus(name, &gpus, self.fps_per_gpu))
    }

    /// The comment written at the top of the trace's CSV: what made it,
    /// every parameter, and the unit.
    pub fn describe(&self, name: &str, seed: u64) -> String {
        let unit = if self.fps_per_gpu == V100_FPS_PER_GPU {
            " (one V100 at the SLO under the simulator's default workload)"
        } else {
            ""
        };
        format!(
            "tidegate trace {name:?}, generated by tidegate_lease::tracegen (kind {}, seed {seed}).\n\
             {:?}\n\
             1 GPU of load = {} frames/s{unit}. Times are seconds after midnight UTC.",
            self.shape.kind(),
            self.shape,
            self.fps_per_gpu,
        )
    }
}

/// One trace of the shipped suite (besides the three of
/// [`crate::trace::generate`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SuiteTrace {
    /// File stem in `lease-core/traces/`.
    pub name: &'static str,
    /// What it is.
    pub spec: TraceSpec,
    /// Its seed.
    pub seed: u64,
    /// The catalog it is meant for, relative to the lease crate (None: the
    /// default catalog).
    pub catalog: Option<&'static str>,
}

/// The generated traces shipped in `lease-core/traces/`, with their seeds.
pub fn suite() -> Vec<SuiteTrace> {
    let entry = |name, shape, seed| SuiteTrace {
        name,
        spec: TraceSpec {
            shape,
            fps_per_gpu: FPS_PER_GPU,
        },
        seed,
        catalog: None,
    };
    vec![
        entry("diurnal-2w", Shape::Diurnal(Diurnal::default()), 0xd1_0001),
        entry("office-week", Shape::Weekly(Weekly::default()), 0x0ff1_ce01),
        SuiteTrace {
            name: "burst-72h-v100",
            spec: TraceSpec {
                shape: Shape::Burst(Burst::default()),
                fps_per_gpu: V100_FPS_PER_GPU,
            },
            seed: 0xb0_0572,
            catalog: Some("catalog/v100.toml"),
        },
        entry("growth-week", Shape::Growth(Growth::default()), 0x6_0001),
        entry("flip", Shape::Flip(Flip::default()), 0xf1_1900),
        entry("noise", Shape::Noise(Noise::default()), 0x0_0015e),
    ]
}

/// `x` eased from 0 (at 0) to 1 (at 1).
pub(crate) fn smoothstep(x: f64) -> f64 {
    let x = x.clamp(0.0, 1.0);
    x * x * (3.0 - 2.0 * x)
}

/// −1 at 04:00 UTC, +1 at 16:00.
fn daily_wave(minute: u64) -> f64 {
    let h = (minute % 1440) as f64 / 60.0;
    -((h - 4.0) / 24.0 * std::f64::consts::TAU).cos()
}

fn diurnal(p: &Diurnal, rng: &mut SplitMix64) -> Vec<f64> {
    let mut out = Vec::with_capacity(p.days as usize * 1440);
    let ramp = p.ramp_hours.max(1.0 / 60.0);
    for _day in 0..p.days {
        let level = 1.0 + p.day_to_day * (2.0 * rng.unit() - 1.0);
        for minute in 0..1440 {
            let h = f64::from(minute) / 60.0;
            let day =
                smoothstep((h - p.ramp_up_at_h) / ramp) - smoothstep((h - p.ramp_down_at_h) / ramp);
            let base = p.night_gpus + (p.day_gpus * level - p.night_gpus) * day;
            out.push(base * (1.0 + p.noise * rng.normal()));
        }
    }
    out
}

fn weekly(p: &Weekly, rng: &mut SplitMix64) -> Vec<f64> {
    let minutes = (p.weeks as usize * 7 + p.history_days as usize) * 1440;
    // day 0 is `history_days` before Monday
    let shift = 7 - p.history_days as usize % 7;
    let ramp = p.ramp_hours.max(1.0 / 60.0);
    let edge = 0.25f64.min(p.lunch_hours / 2.0).max(1.0 / 60.0);
    let mut out = Vec::with_capacity(minutes);
    for m in 0..minutes {
        let weekday = (m / 1440 + shift) % 7; // 0 = Monday
        let h = (m % 1440) as f64 / 60.0;
        let level = if weekday >= 5 {
            p.weekend_gpus
        } else {
            let open = smoothstep((h - p.open_at_h) / ramp) - smoothstep((h - p.close_at_h) / ramp);
            let lunch = smoothstep((h - p.lunch_at_h) / edge)
                - smoothstep((h - (p.lunch_at_h + p.lunch_hours - edge)) / edge);
            p.night_gpus + (p.business_gpus - p.night_gpus) * open * (1.0 - p.lunch_dip * lunch)
        };
        out.push(level * (1.0 + p.noise * rng.normal()));
    }
    out
}

fn burst(p: &Burst, rng: &mut SplitMix64) -> Result<Vec<f64>, GenError> {
    let history = p.history_days as usize * 1440;
    let minutes = history + p.hours as usize * 60;
    let span = f64::from(p.hours) - 2.0 * p.burst_hours_max;
    let bursts: Vec<(f64, f64, f64)> = (0..p.bursts)
        .map(|_| {
            let centre = p.burst_hours_max + rng.unit() * span;
            let width = p.burst_hours_min + rng.unit() * (p.burst_hours_max - p.burst_hours_min);
            let height = 0.6 + 0.6 * rng.unit();
            (centre, width / 2.0, height)
        })
        .collect();
    let raw: Vec<f64> = (0..minutes)
        .map(|m| {
            // hours into the burst window (negative in the history)
            let h = (m as f64 - history as f64) / 60.0;
            let base = 0.5 + 0.5 * daily_wave(m as u64);
            let b: f64 = if m < history {
                0.0
            } else {
                bursts
                    .iter()
                    .map(|&(c, sd, height)| height * (-0.5 * ((h - c) / sd).powi(2)).exp())
                    .sum()
            };
            (base + b) * (1.0 + p.noise * rng.normal())
        })
        .collect();
    // affine map so that the window's mean and the peak are exact
    let window = &raw[history..];
    let mean = window.iter().sum::<f64>() / window.len() as f64;
    let max = raw.iter().copied().fold(f64::MIN, f64::max);
    let min = raw.iter().copied().fold(f64::MAX, f64::min);
    if max <= mean {
        return Err(GenError::Invalid {
            kind: Kind::Burst,
            field: "noise",
            reason: "leaves a shape with no peak above its mean; lower it".to_string(),
        });
    }
    let k = (p.peak_gpus - p.mean_gpus) / (max - mean);
    if p.mean_gpus + k * (min - mean) < 0.0 {
        return Err(GenError::Invalid {
            kind: Kind::Burst,
            field: "peak_gpus",
            reason: format!(
                "= {} is too far above mean_gpus = {} for this shape: its trough would need a negative load; raise the mean or lower the peak",
                p.peak_gpus, p.mean_gpus
            ),
        });
    }
    Ok(raw
        .into_iter()
        .map(|r| p.mean_gpus + k * (r - mean))
        .collect())
}

fn growth(p: &Growth, rng: &mut SplitMix64) -> Vec<f64> {
    let minutes = p.days as usize * 1440;
    let ratio = p.end_gpus / p.start_gpus;
    (0..minutes)
        .map(|m| {
            let level = p.start_gpus * ratio.powf(m as f64 / minutes as f64);
            level * (1.0 + p.daily_swing * daily_wave(m as u64)) * (1.0 + p.noise * rng.normal())
        })
        .collect()
}

fn flip(p: &Flip, rng: &mut SplitMix64) -> Vec<f64> {
    let minutes = p.hours as usize * 60;
    let mut out = Vec::with_capacity(minutes);
    let mut high = true;
    // each phase is at least a minute long, so this ends
    while out.len() < minutes {
        let spread = u64::from(p.max_minutes - p.min_minutes) + 1;
        let len = u64::from(p.min_minutes) + rng.next_u64() % spread;
        let level = if high { p.high_gpus } else { p.low_gpus };
        for _ in 0..len {
            if out.len() == minutes {
                break;
            }
            out.push(level * (1.0 + p.noise * rng.normal()));
        }
        high = !high;
    }
    out
}

fn noise(p: &Noise, rng: &mut SplitMix64) -> Vec<f64> {
    let minutes = p.hours as usize * 60;
    // the base: a random walk pulled back towards 1, kept within ±wander
    let mut walk = 0.0f64;
    let mut out: Vec<f64> = (0..minutes)
        .map(|_| {
            walk = (0.97 * walk + 0.01 * rng.normal()).clamp(-p.wander, p.wander);
            p.base_gpus * (1.0 + walk) * (1.0 + p.noise * rng.normal())
        })
        .collect();
    if p.spikes_per_hour <= 0.0 {
        return out;
    }
    let mean_gap_min = 60.0 / p.spikes_per_hour;
    let mut t = 0.0f64;
    // each gap is at least a minute, so this ends
    loop {
        t += (-rng.unit().max(1e-12).ln() * mean_gap_min).max(1.0);
        let start = t as usize;
        if start >= minutes {
            break;
        }
        let height = p.spike_min_gpus + rng.unit() * (p.spike_max_gpus - p.spike_min_gpus);
        let spread = u64::from(p.spike_max_minutes - p.spike_min_minutes) + 1;
        let len = (u64::from(p.spike_min_minutes) + rng.next_u64() % spread) as usize;
        for v in out.iter_mut().skip(start).take(len) {
            *v += height;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::Catalog;
    use crate::trace::STEP_MS;

    fn gpus(t: &Trace, unit: f64) -> Vec<f64> {
        t.rows.iter().map(|r| r.fps / unit).collect()
    }

    fn mean(v: &[f64]) -> f64 {
        v.iter().sum::<f64>() / v.len() as f64
    }

    fn hour_mean(v: &[f64], day: usize, hour: usize) -> f64 {
        let from = day * 1440 + hour * 60;
        mean(&v[from..from + 60])
    }

    #[test]
    fn every_kind_generates_its_length_with_rows_a_minute_apart_and_no_negative_load() {
        for kind in Kind::ALL {
            let spec = TraceSpec::new(kind);
            let t = spec.generate("x", 1).unwrap();
            assert_eq!(t.rows.len() as u64, spec.shape.minutes(), "{kind}");
            for (i, r) in t.rows.iter().enumerate() {
                assert_eq!(r.t_ms, i as u64 * STEP_MS);
                assert!(r.fps >= 0.0, "{kind} row {i}: {}", r.fps);
            }
            assert_eq!(kind.as_str().parse::<Kind>(), Ok(kind));
        }
    }

    #[test]
    fn a_seed_gives_one_trace_and_another_seed_another() {
        for kind in Kind::ALL {
            let spec = TraceSpec::new(kind);
            assert_eq!(spec.generate("x", 5), spec.generate("x", 5), "{kind}");
            assert_ne!(spec.generate("x", 5), spec.generate("x", 6), "{kind}");
        }
    }

    #[test]
    fn the_burst_has_the_exact_mean_and_peak() {
        for seed in [1, 2, 3, suite()[2].seed] {
            let t = TraceSpec::new(Kind::Burst).generate("b", seed).unwrap();
            let all = gpus(&t, FPS_PER_GPU);
            // a day of history, then the 72-hour window
            assert_eq!(all.len(), 24 * 60 + 72 * 60);
            let g = &all[24 * 60..];
            // rounding to 0.1 frames/s moves the mean by < 0.05 / 1000
            assert!((mean(g) - 320.0).abs() < 1e-3, "seed {seed}: {}", mean(g));
            let peak = g.iter().copied().fold(0.0, f64::max);
            assert!((peak - 487.0).abs() < 1e-3, "seed {seed}: {peak}");
            // the history day is the base alone, below the bursts
            let before = all[..24 * 60].iter().copied().fold(0.0, f64::max);
            assert!(before < 487.0 - 50.0, "seed {seed}: {before}");
        }
    }

    #[test]
    fn the_office_week_dips_at_lunch_and_is_quiet_at_night_and_at_weekends() {
        let t = TraceSpec::new(Kind::Weekly).generate("w", 9).unwrap();
        // a week of history, then Monday to Sunday; the history is the
        // same week
        let all = gpus(&t, FPS_PER_GPU);
        assert_eq!(all.len(), 14 * 1440);
        let history = all[..7 * 1440].to_vec();
        assert!((13.0..=17.0).contains(&hour_mean(&history, 0, 3)));
        assert!((210.0..=230.0).contains(&hour_mean(&history, 4, 10)));
        assert!((23.0..=27.0).contains(&hour_mean(&history, 6, 10)));
        let g = all[7 * 1440..].to_vec();
        for day in 0..5 {
            let morning = hour_mean(&g, day, 10);
            let noon = day * 1440 + 12 * 60;
            let lunch = mean(&g[noon + 20..noon + 40]);
            let night = hour_mean(&g, day, 3);
            assert!((210.0..=230.0).contains(&morning), "day {day}: {morning}");
            assert!(lunch < 0.65 * morning, "day {day}: {lunch} vs {morning}");
            assert!((13.0..=17.0).contains(&night), "day {day}: {night}");
        }
        for day in 5..7 {
            for hour in [3, 10, 12, 15] {
                let v = hour_mean(&g, day, hour);
                assert!((23.0..=27.0).contains(&v), "day {day} {hour}h: {v}");
            }
        }
    }

    #[test]
    fn growth_multiplies_the_level_by_the_same_factor_every_day() {
        let p = Growth::default();
        let t = TraceSpec::new(Kind::Growth).generate("g", 4).unwrap();
        let g = gpus(&t, FPS_PER_GPU);
        let days: Vec<f64> = (0..7).map(|d| mean(&g[d * 1440..(d + 1) * 1440])).collect();
        let daily = (p.end_gpus / p.start_gpus).powf(1.0 / 7.0);
        for w in days.windows(2) {
            let r = w[1] / w[0];
            assert!((r - daily).abs() < 0.02, "{r} vs {daily}");
        }
        assert!(days[0] > 60.0 && days[6] < 240.0, "{days:?}");
    }

    #[test]
    fn flip_phases_last_between_fifty_and_seventy_minutes() {
        let p = Flip::default();
        let t = TraceSpec::new(Kind::Flip).generate("f", 11).unwrap();
        let g = gpus(&t, FPS_PER_GPU);
        let mid = (p.high_gpus + p.low_gpus) / 2.0;
        let mut runs = Vec::new();
        let mut run = 1;
        for w in g.windows(2) {
            if (w[0] > mid) == (w[1] > mid) {
                run += 1;
            } else {
                runs.push(run);
                run = 1;
            }
        }
        // the last run is cut by the end of the trace
        assert!(runs.len() >= 40, "{runs:?}");
        assert!(runs.iter().all(|r| (50..=70).contains(r)), "{runs:?}");
        assert!(runs.iter().min() != runs.iter().max(), "lengths are random");
    }

    #[test]
    fn noise_has_spikes_above_its_wandering_base() {
        let p = Noise::default();
        let t = TraceSpec::new(Kind::Noise).generate("n", 3).unwrap();
        let g = gpus(&t, FPS_PER_GPU);
        let top = g.iter().copied().fold(0.0, f64::max);
        assert!(
            top > p.base_gpus * (1.0 + p.wander) + p.spike_min_gpus,
            "{top}"
        );
        let above = g.iter().filter(|&&v| v > 1.5 * p.base_gpus).count();
        // 1.5 spikes an hour of 2..10 minutes over 48 h: some, not most
        assert!((20..=g.len() / 4).contains(&above), "{above}");
    }

    #[test]
    fn a_diurnal_day_is_high_by_day_and_low_at_night() {
        let t = TraceSpec::new(Kind::Diurnal).generate("d", 2).unwrap();
        let g = gpus(&t, FPS_PER_GPU);
        assert_eq!(g.len(), 14 * 1440);
        for day in 0..14 {
            let night = hour_mean(&g, day, 3);
            let noon = hour_mean(&g, day, 13);
            assert!((38.0..=42.0).contains(&night), "{night}");
            assert!((168.0..=192.0).contains(&noon), "{noon}");
        }
    }

    #[test]
    fn parameters_out_of_range_are_named() {
        let b = Burst {
            peak_gpus: 300.0,
            ..Burst::default()
        };
        let e = TraceSpec {
            shape: Shape::Burst(b),
            fps_per_gpu: FPS_PER_GPU,
        }
        .generate("x", 1)
        .unwrap_err();
        assert!(e.to_string().contains("peak_gpus"), "{e}");
        let f = Flip {
            min_minutes: 80,
            ..Flip::default()
        };
        let e = TraceSpec {
            shape: Shape::Flip(f),
            fps_per_gpu: FPS_PER_GPU,
        }
        .generate("x", 1)
        .unwrap_err();
        assert!(e.to_string().contains("min_minutes = 80"), "{e}");
        let d = Diurnal {
            days: 400,
            ..Diurnal::default()
        };
        let e = TraceSpec {
            shape: Shape::Diurnal(d),
            fps_per_gpu: FPS_PER_GPU,
        }
        .generate("x", 1)
        .unwrap_err();
        assert!(e.to_string().contains("a year"), "{e}");
        let w = Weekly {
            lunch_dip: 1.5,
            ..Weekly::default()
        };
        let e = TraceSpec {
            shape: Shape::Weekly(w),
            fps_per_gpu: FPS_PER_GPU,
        }
        .generate("x", 1)
        .unwrap_err();
        assert!(e.to_string().contains("lunch_dip"), "{e}");
        let e = "sawtooth".parse::<Kind>().unwrap_err().to_string();
        assert!(e.contains("\"sawtooth\"") && e.contains("flip"), "{e}");
    }

    #[test]
    fn the_v100_unit_is_one_v100_at_the_slo_and_its_catalog_has_only_v100() {
        let c = Catalog::from_toml(include_str!("../catalog/v100.toml")).unwrap();
        assert_eq!(c.instances.len(), 1);
        let (v, d) = (&c.instances[0], Catalog::default_catalog());
        let d = d.get("v100").unwrap();
        assert_eq!(
            (
                v.fp16_tflops,
                v.memory_bandwidth_gbs,
                v.price_per_hour,
                v.startup_secs
            ),
            (
                d.fp16_tflops,
                d.memory_bandwidth_gbs,
                d.price_per_hour,
                d.startup_secs
            ),
            "the V100 of default.toml, its datasheet and prices"
        );
        let t = crate::sim::throughput_table(&c, &crate::sim::SimOptions::default());
        let v100 = t["v100"];
        assert!(
            (V100_FPS_PER_GPU..V100_FPS_PER_GPU * 1.01).contains(&v100),
            "the simulator's V100 serves {v100} frames/s: set V100_FPS_PER_GPU to it (rounded down) and run the gen-traces example"
        );
    }
}
