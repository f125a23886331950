//! `tidegate-gateway simulate`: replays an arrival trace through the real
//! autoscaler ([`tidegate_lease::sim`]) and reports cost, GPU-hours,
//! utilisation and SLO attainment as JSON.

use std::path::{Path, PathBuf};

use tidegate_lease::Catalog;
use tidegate_lease::autoscale::{PolicyName, UnknownPolicy};
use tidegate_lease::catalog::CatalogError;
use tidegate_lease::sim::{self, SimOptions, SimReport};
use tidegate_lease::trace::{Trace, TraceError};

/// What to simulate.
#[derive(Debug, Clone)]
pub struct SimulateArgs {
    /// The trace (CSV: `t_secs,model,fps`).
    pub trace: PathBuf,
    /// Policy name (`static-peak`, `reactive-idle-timeout`, `tidal`,
    /// `paid-block-aware`).
    pub policy: String,
    /// Pricing catalog; `None`: the built-in one.
    pub catalog: Option<PathBuf>,
    /// Seed of every random draw (spot refusals, preemptions); `None`: the
    /// simulator's default.
    pub seed: Option<u64>,
}

/// Why a simulation could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SimulateError {
    /// The policy name is not one the simulator knows.
    #[error(transparent)]
    Policy(#[from] UnknownPolicy),
    /// The trace could not be read or parsed.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The catalog could not be read or is invalid.
    #[error("catalog {path}: {message}")]
    Catalog {
        /// The file.
        path: PathBuf,
        /// What was wrong, on one line.
        message: String,
    },
    /// The report could not be written.
    #[error("cannot write the report to {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A trace kind or generator parameter that is not valid.
    #[error(transparent)]
    Generate(#[from] tidegate_lease::tracegen::GenError),
    /// An ownership input that is not valid.
    #[error(transparent)]
    Own(#[from] tidegate_lease::own::OwnError),
}

/// Runs one simulation.
pub fn simulate(args: &SimulateArgs) -> Result<SimReport, SimulateError> {
    // The cheap checks first, so a typo costs no trace parsing.
    let policy: PolicyName = args.policy.parse()?;
    let catalog = match &args.catalog {
        Some(p) => Catalog::load(p).map_err(|e| SimulateError::Catalog {
            path: p.clone(),
            message: one_line(&e),
        })?,
        None => Catalog::default_catalog(),
    };
    let trace = Trace::load(&args.trace)?;
    let opts = options(&trace, args.seed);
    let span = tracing::info_span!("simulate", trace = %trace.name, %policy);
    let _enter = span.enter();
    Ok(sim::simulate(&trace, policy, &catalog, &opts))
}

/// The simulator's options for `trace`: its defaults, the days of history
/// a shipped trace of that name starts with (`trace::history_days_for`: a
/// week for `office-week`, else one), and `seed` if given.
fn options(trace: &Trace, seed: Option<u64>) -> SimOptions {
    let mut opts = SimOptions::for_trace(&trace.name);
    if let Some(seed) = seed {
        opts.seed = seed;
    }
    opts
}

/// An error's text on one line (TOML parse errors quote the source over
/// several lines).
pub fn one_line(e: &CatalogError) -> String {
    e.to_string()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// The report as pretty JSON, written to `out` when given.
pub fn render(report: &SimReport, out: Option<&Path>) -> Result<String, SimulateError> {
    let json = serde_json::to_string_pretty(report).expect("a SimReport serialises");
    if let Some(path) = out {
        std::fs::write(path, format!("{json}\n")).map_err(|source| SimulateError::Write {
            path: path.to_path_buf(),
            source,
        })?;
    }
    Ok(json)
}

/// `tidegate-gateway generate-trace`: a trace of `kind` with its default
/// parameters (`tidegate_lease::tracegen`) and `seed`, as CSV (what
/// `simulate --trace` reads), written to `out` when given.
pub fn generate_trace(kind: &str, seed: u64, out: Option<&Path>) -> Result<String, SimulateError> {
    use tidegate_lease::tracegen::{Kind, TraceSpec};
    let kind: Kind = kind.parse()?;
    let spec = TraceSpec::new(kind);
    let name = out
        .and_then(|p| p.file_stem())
        .map_or_else(|| kind.to_string(), |s| s.to_string_lossy().into_owned());
    let csv = spec
        .generate(&name, seed)?
        .to_csv(&spec.describe(&name, seed));
    if let Some(path) = out {
        std::fs::write(path, &csv).map_err(|source| SimulateError::Write {
            path: path.to_path_buf(),
            source,
        })?;
    }
    Ok(csv)
}

/// What `tidegate-gateway own-vs-rent` compares.
#[derive(Debug, Clone)]
pub struct OwnArgs {
    /// The trace (CSV).
    pub trace: PathBuf,
    /// Pricing catalog; `None`: the built-in one.
    pub catalog: Option<PathBuf>,
    /// One policy to rent with; `None`: every policy.
    pub policy: Option<String>,
    /// Seed of the simulator's random draws; `None`: its default.
    pub seed: Option<u64>,
    /// What owning costs.
    pub ownership: tidegate_lease::own::Ownership,
    /// GPUs owned; `None`: static-peak's fleet (its most leases at once,
    /// one GPU each as in the shipped catalogs).
    pub fleet_gpus: Option<u32>,
}

/// Simulates renting under each policy and prices owning the fleet that
/// static-peak rents, for the same trace (`tidegate_lease::own`).
pub fn own_vs_rent(args: &OwnArgs) -> Result<tidegate_lease::own::RentVsOwn, SimulateError> {
    args.ownership.validate()?;
    let policies = match &args.policy {
        Some(p) => vec![p.parse::<PolicyName>()?],
        None => PolicyName::ALL.to_vec(),
    };
    let catalog = match &args.catalog {
        Some(p) => Catalog::load(p).map_err(|e| SimulateError::Catalog {
            path: p.clone(),
            message: one_line(&e),
        })?,
        None => Catalog::default_catalog(),
    };
    let trace = Trace::load(&args.trace)?;
    let opts = options(&trace, args.seed);
    // the owned fleet is static-peak's and serves what it serves
    let fleet = sim::simulate(&trace, PolicyName::StaticPeak, &catalog, &opts);
    let rentals: Vec<(String, f64, f64)> = policies
        .into_iter()
        .map(|p| {
            let r = if p == PolicyName::StaticPeak {
                fleet.clone()
            } else {
                sim::simulate(&trace, p, &catalog, &opts)
            };
            (p.to_string(), r.cost_total.units(), r.gpu_hours_busy)
        })
        .collect();
    let fleet_gpus = args
        .fleet_gpus
        .unwrap_or(u32::try_from(fleet.peak_leases).unwrap_or(u32::MAX));
    Ok(tidegate_lease::own::compare(
        &args.ownership,
        fleet_gpus,
        fleet.hours,
        fleet.gpu_hours_busy,
        &rentals,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One model at a constant 2000 frames/s for two hours.
    fn flat_trace(dir: &Path) -> PathBuf {
        let mut csv = String::from("t_secs,model,fps\n");
        for m in 0..120 {
            csv += &format!("{},det,2000\n", m * 60);
        }
        let p = dir.join("flat.csv");
        std::fs::write(&p, csv).unwrap();
        p
    }

    fn args(trace: PathBuf, policy: &str) -> SimulateArgs {
        SimulateArgs {
            trace,
            policy: policy.into(),
            catalog: None,
            seed: None,
        }
    }

    #[test]
    fn small_trace_is_replayed_and_every_frame_is_accounted() {
        let dir = tempfile::tempdir().unwrap();
        let r = simulate(&args(flat_trace(dir.path()), "static-peak")).unwrap();
        assert_eq!(r.policy, PolicyName::StaticPeak);
        assert_eq!(r.trace, "flat");
        // 2 hours at 2000 frames/s
        assert_eq!(r.frames_total, 2 * 3600 * 2000);
        assert_eq!(
            r.frames_total,
            r.frames_within_slo + r.frames_late + r.frames_shed
        );
        assert!(r.cost_total.units() > 0.0, "{r:?}");
        assert!(r.gpu_hours_leased > 0.0 && r.utilisation > 0.0 && r.utilisation <= 1.0);
        // static-peak buys on-demand only, never preempted
        assert_eq!(
            r.cost_by_tier.keys().collect::<Vec<_>>(),
            vec![&tidegate_lease::Tier::OnDemand]
        );
        assert_eq!(r.preemptions, 0);
    }

    #[test]
    fn report_is_written_as_json_with_the_key_fields() {
        let dir = tempfile::tempdir().unwrap();
        let r = simulate(&args(flat_trace(dir.path()), "paid-block-aware")).unwrap();
        let out = dir.path().join("report.json");
        let printed = render(&r, Some(&out)).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        assert_eq!(
            v,
            serde_json::from_str::<serde_json::Value>(&printed).unwrap()
        );
        for key in [
            "cost_total",
            "cost_by_tier",
            "gpu_hours_leased",
            "utilisation",
            "slo_attainment",
            "frames_shed",
            "leases",
            "preemptions",
        ] {
            assert!(v.get(key).is_some(), "missing {key} in {v}");
        }
        assert_eq!(v["policy"], "paid-block-aware");
    }

    #[test]
    fn the_seed_changes_only_random_draws() {
        // A week of day/night load: the tidal policy rents spot for the
        // bursts, so spot refusals and preemptions are drawn.
        let t = Path::new(env!("CARGO_MANIFEST_DIR")).join("../lease-core/traces/day-night.csv");
        let a = simulate(&args(t.clone(), "tidal")).unwrap();
        let again = simulate(&args(t.clone(), "tidal")).unwrap();
        assert_eq!(a, again, "same seed, same report");
        assert!(
            a.preemptions + a.spot_refusals > 0,
            "nothing was drawn: {a:?}"
        );
        let mut seeded = args(t, "tidal");
        seeded.seed = Some(7);
        let b = simulate(&seeded).unwrap();
        assert_eq!(a.frames_total, b.frames_total, "the trace is the same");
        assert_ne!(
            (a.preemptions, a.spot_refusals),
            (b.preemptions, b.spot_refusals),
            "another seed, other draws"
        );
    }

    #[test]
    fn bad_policy_name_is_one_clear_line() {
        let dir = tempfile::tempdir().unwrap();
        let e = simulate(&args(flat_trace(dir.path()), "cheapest"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"cheapest\"") && e.contains("paid-block-aware"),
            "{e}"
        );
        assert!(!e.contains('\n'), "{e}");
    }

    #[test]
    fn missing_trace_and_catalog_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let e = simulate(&args(dir.path().join("nope.csv"), "tidal"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("nope.csv"), "{e}");
        let mut a = args(flat_trace(dir.path()), "tidal");
        a.catalog = Some(dir.path().join("prices.toml"));
        let e = simulate(&a).unwrap_err().to_string();
        assert!(e.contains("prices.toml"), "{e}");
        assert!(!e.contains('\n'), "{e}");
    }

    #[test]
    fn the_shipped_day_night_trace_replays_through_the_cli_with_every_frame_accounted() {
        // The goal's thresholds are the benchmark's (make bench-leasing,
        // docs/leasing.md) and lease-core/tests/sim.rs's; here, that the shipped
        // trace runs end to end through this path and adds up.
        let trace =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../lease-core/traces/day-night.csv");
        let r = simulate(&args(trace, "paid-block-aware")).unwrap();
        assert_eq!(r.trace, "day-night");
        // 7 days, of which the first is history (the reserved floor's)
        assert!(
            (r.hours + r.history_hours - 7.0 * 24.0).abs() < 1.0,
            "{} + {}",
            r.hours,
            r.history_hours
        );
        assert_eq!(
            r.frames_total,
            r.frames_within_slo + r.frames_late + r.frames_shed
        );
        assert!(r.slo_attainment >= 0.99, "{}", r.slo_attainment);
        assert!(
            r.utilisation > 0.0 && r.utilisation <= 1.0,
            "{}",
            r.utilisation
        );
        assert!(r.preemptions > 0 && r.leases > 0);
        let by_tier: f64 = r.cost_by_tier.values().map(|m| m.units()).sum();
        assert!((by_tier - r.cost_total.units()).abs() < 1.0, "{r:?}");
    }
}
