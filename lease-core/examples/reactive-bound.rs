//! What a fleet that follows the load, but does not foresee it, loses on
//! each shipped trace, and how much capacity it would have to hold in
//! reserve to reach 99 % SLO attainment.
//!
//! `cargo run --release -p tidegate-lease-core --example reactive-bound [-- --lag-secs 180]`
//!
//! The model, deliberately kind: at every moment the fleet serves 1.03 ×
//! (the trace's headroom) the rate it saw `lag` ago (a tick's detection,
//! half the 60 s tick on average, plus the catalog's median 150 s
//! start-up), never releases too early, never queues and is never
//! reclaimed; every frame above that capacity is lost. Then the least
//! standing reserve (fps held above that capacity at all times) for which
//! at most 1 % of the frames are lost, as a share of the trace's mean rate
//! and in GPU-hours of the catalog's cheapest spot type per frame over the
//! scored window. Traces are scored after their history, as the simulator
//! does. docs/leasing.md ("Benchmark") quotes the table.

use std::path::Path;

use tidegate_lease_core::autoscale::DAY_MS;
use tidegate_lease_core::catalog::{Catalog, Tier};
use tidegate_lease_core::sim::{SimOptions, throughput_table};
use tidegate_lease_core::trace::{SHIPPED, Trace, catalog_for, history_days_for};

/// Samples per minute of trace.
const SAMPLE_MS: u64 = 10_000;
/// The SLO attainment the reserve must reach.
const TARGET: f64 = 0.99;
/// The simulator's default headroom.
const HEADROOM: f64 = 0.03;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let lag_ms = args
        .iter()
        .position(|a| a == "--lag-secs")
        .and_then(|i| args.get(i + 1))
        .map(|s| s.parse::<u64>())
        .transpose()?
        .unwrap_or(180)
        * 1000;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    println!(
        "| trace | mean rate (fps) | reactive loses | its SLO | reserve for 99 % | of the mean | its GPU-hours |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for name in SHIPPED {
        let trace = Trace::load(&dir.join("traces").join(format!("{name}.csv")))?;
        let catalog = match catalog_for(name) {
            Some(file) => Catalog::load(&dir.join(file))?,
            None => Catalog::default_catalog(),
        };
        let start = u64::from(history_days_for(name)) * DAY_MS;
        let rate = |t: u64| -> f64 { trace.rates_at(t).values().sum() };
        let samples: Vec<(f64, f64)> = (start..trace.end_ms())
            .step_by(SAMPLE_MS as usize)
            .map(|t| (rate(t), (1.0 + HEADROOM) * rate(t.saturating_sub(lag_ms))))
            .collect();
        let total: f64 = samples.iter().map(|s| s.0).sum();
        let lost = |reserve: f64| -> f64 {
            samples
                .iter()
                .map(|&(r, have)| (r - have - reserve).max(0.0))
                .sum::<f64>()
                / total
        };
        let (mut lo, mut hi) = (0.0, total / samples.len() as f64 * 4.0);
        for _ in 0..50 {
            let mid = (lo + hi) / 2.0;
            if lost(mid) > 1.0 - TARGET {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let reserve = if lost(0.0) <= 1.0 - TARGET { 0.0 } else { hi };
        let mean = total / samples.len() as f64;
        let hours = (trace.end_ms() - start) as f64 / 3.6e6;
        let worker_fps = throughput_table(&catalog, &SimOptions::default())
            .into_iter()
            .filter_map(|(ty, fps)| {
                let price = catalog.get(&ty)?.price_per_hour.get(Tier::Spot).units();
                Some((price / fps, fps))
            })
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .map_or(f64::NAN, |(_, fps)| fps);
        println!(
            "| {name} | {mean:.0} | {:.2} % | {:.2} % | {reserve:.0} fps | {:.0} % | {:.0} |",
            100.0 * lost(0.0),
            100.0 * (1.0 - lost(0.0)),
            100.0 * reserve / mean,
            (reserve / worker_fps).ceil() * hours,
        );
    }
    Ok(())
}
