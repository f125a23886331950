//! A CPU stand-in for a GPU's cold shapes (tests only: the `stand-in`
//! feature, never in a release or image build).
//!
//! On a GPU the first run of each new input shape costs seconds (cuDNN's
//! algorithm search, allocations), and now and then a batch runs far
//! slower than usual (a clock change, another process on the device). The
//! first end-to-end run on an H200 met both, and the gateway shed nearly
//! every frame. This stand-in brings both to the CPU, so that every CI run
//! checks what that run found: wrapped around the real ONNX Runtime runs
//! of [`crate::backend::OrtBackend`], it holds the first run of each
//! `(model, rows)` shape for `cold_ms`, and one warm run in about
//! `slow_one_in` (seeded) for `slow_ms`, and adds the hold to the frames'
//! `inference_us`, as the device would. With `busy_profile_ms` it also
//! holds each of the worker's start-up profiling runs that long, as a host
//! busy while the worker profiled would (another worker warming up beside
//! it): the worker then registers a profile far slower than it serves.
//!
//! It is switched on by the environment variable [`ENV`], read once at
//! start: `cold_ms=2000,slow_ms=1000,slow_one_in=150,seed=7` or
//! `busy_profile_ms=150` (every key optional: 0 holds nothing; `seed`
//! defaults to 1). This module decides
//! which runs to hold and for how long; the backend sleeps.

use std::collections::HashSet;
use std::time::Duration;

/// The environment variable that turns the stand-in on.
pub const ENV: &str = "TIDEGATE_STAND_IN";

/// What the stand-in holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Settings {
    /// Hold on the first run of each `(model, rows)` shape (ms).
    pub cold_ms: u64,
    /// Hold on a slow warm run (ms).
    pub slow_ms: u64,
    /// About one warm run in this many is slow (0: none).
    pub slow_one_in: u32,
    /// Seed of the choice of slow runs.
    pub seed: u64,
    /// Hold on each start-up profiling run (ms): a busy host.
    pub busy_profile_ms: u64,
}

/// A [`ENV`] value that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{ENV}={value:?}: {reason} (expected e.g. cold_ms=2000,slow_ms=1000,slow_one_in=150,seed=7)"
)]
pub struct SettingsError {
    value: String,
    reason: String,
}

impl Settings {
    /// Reads `key=value` pairs separated by commas.
    pub fn parse(value: &str) -> Result<Settings, SettingsError> {
        let fail = |reason: String| SettingsError {
            value: value.to_string(),
            reason,
        };
        let mut s = Settings {
            seed: 1,
            ..Settings::default()
        };
        for pair in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, v) = pair
                .split_once('=')
                .ok_or_else(|| fail(format!("{pair:?} is not key=value")))?;
            let number = |v: &str| {
                v.trim()
                    .parse::<u64>()
                    .map_err(|e| fail(format!("{key}: {v:?} is not a whole number ({e})")))
            };
            match key.trim() {
                "cold_ms" => s.cold_ms = number(v)?,
                "slow_ms" => s.slow_ms = number(v)?,
                "slow_one_in" => {
                    s.slow_one_in = u32::try_from(number(v)?)
                        .map_err(|_| fail(format!("slow_one_in {v} is too large")))?;
                }
                "seed" => s.seed = number(v)?,
                "busy_profile_ms" => s.busy_profile_ms = number(v)?,
                other => return Err(fail(format!("unknown key {other:?}"))),
            }
        }
        Ok(s)
    }
}

/// Why a run was held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// The first run of its shape.
    Cold,
    /// A rare slow run.
    Slow,
}

/// The stand-in's state: the shapes run so far and the seeded choice.
#[derive(Debug, Clone)]
pub struct StandIn {
    settings: Settings,
    seen: HashSet<(String, usize)>,
    rng: u64,
    /// Runs held cold.
    pub cold_runs: u64,
    /// Runs held slow.
    pub slow_runs: u64,
}

impl StandIn {
    /// A stand-in holding as `settings` say.
    pub fn new(settings: Settings) -> StandIn {
        StandIn {
            settings,
            seen: HashSet::new(),
            // xorshift must not start at 0.
            rng: settings.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
            cold_runs: 0,
            slow_runs: 0,
        }
    }

    /// The stand-in [`ENV`] asks for: `None` when it is unset.
    pub fn from_env() -> Result<Option<StandIn>, SettingsError> {
        match std::env::var(ENV) {
            Ok(v) => Settings::parse(&v).map(|s| Some(StandIn::new(s))),
            Err(_) => Ok(None),
        }
    }

    /// The settings in force.
    pub fn settings(&self) -> Settings {
        self.settings
    }

    /// After one ONNX Runtime run of `rows` rows of `model`: how long the
    /// device would have held it, and why (`None`: not held).
    pub fn hold(&mut self, model: &str, rows: usize) -> Option<(Duration, Hold)> {
        if self.seen.insert((model.to_string(), rows)) {
            if self.settings.cold_ms == 0 {
                return None;
            }
            self.cold_runs += 1;
            return Some((Duration::from_millis(self.settings.cold_ms), Hold::Cold));
        }
        if self.settings.slow_one_in == 0 || self.settings.slow_ms == 0 {
            return None;
        }
        // xorshift64*
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        let draw = self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32;
        if !draw.is_multiple_of(u64::from(self.settings.slow_one_in)) {
            return None;
        }
        self.slow_runs += 1;
        Some((Duration::from_millis(self.settings.slow_ms), Hold::Slow))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_every_key_and_default_the_rest() {
        assert_eq!(
            Settings::parse("cold_ms=2000, slow_ms=1000,slow_one_in=150,seed=7,busy_profile_ms=3"),
            Ok(Settings {
                cold_ms: 2000,
                slow_ms: 1000,
                slow_one_in: 150,
                seed: 7,
                busy_profile_ms: 3,
            })
        );
        assert_eq!(
            Settings::parse("cold_ms=5"),
            Ok(Settings {
                cold_ms: 5,
                seed: 1,
                ..Settings::default()
            })
        );
        assert_eq!(
            Settings::parse("busy_profile_ms=150"),
            Ok(Settings {
                busy_profile_ms: 150,
                seed: 1,
                ..Settings::default()
            })
        );
    }

    #[test]
    fn bad_settings_are_refused_naming_the_variable_and_the_fault() {
        for (value, says) in [
            ("cold=5", "unknown key \"cold\""),
            ("cold_ms", "is not key=value"),
            ("slow_ms=fast", "slow_ms: \"fast\" is not a whole number"),
            ("slow_one_in=99999999999", "too large"),
            (
                "busy_profile_ms=-1",
                "busy_profile_ms: \"-1\" is not a whole number",
            ),
        ] {
            let e = Settings::parse(value).unwrap_err().to_string();
            assert!(e.contains(ENV) && e.contains(says), "{value}: {e}");
        }
    }

    #[test]
    fn the_first_run_of_each_shape_is_held_cold_and_no_later_one_is() {
        let mut s = StandIn::new(Settings {
            cold_ms: 2000,
            ..Settings::default()
        });
        let cold = Some((Duration::from_secs(2), Hold::Cold));
        assert_eq!(s.hold("blazeface", 1), cold);
        assert_eq!(s.hold("blazeface", 1), None);
        assert_eq!(s.hold("blazeface", 4), cold);
        assert_eq!(s.hold("centernet", 1), cold);
        for _ in 0..100 {
            assert_eq!(s.hold("blazeface", 4), None);
        }
        assert_eq!((s.cold_runs, s.slow_runs), (3, 0));
    }

    #[test]
    fn slow_runs_come_about_one_in_n_of_the_warm_ones_and_repeat_with_the_seed() {
        let settings = Settings {
            slow_ms: 300,
            slow_one_in: 50,
            seed: 7,
            ..Settings::default()
        };
        let run = |settings| {
            let mut s = StandIn::new(settings);
            (0..10_000)
                .map(|_| s.hold("blazeface", 1).is_some())
                .collect::<Vec<_>>()
        };
        let a = run(settings);
        assert_eq!(a, run(settings), "the same seed holds the same runs");
        assert_ne!(
            a,
            run(Settings {
                seed: 8,
                ..settings
            })
        );
        let slow = a.iter().filter(|&&h| h).count();
        // 200 expected; a binomial's spread is about 14.
        assert!((130..=270).contains(&slow), "{slow} slow runs of 10,000");
        // The first run is the shape's cold one, held nothing when cold_ms is 0.
        assert!(!a[0]);
    }
}
