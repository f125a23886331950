//! Prints the policy comparison table for the shipped traces.
//!
//! `cargo run --release -p tidegate-lease-core --example compare [-- --json] [--trace NAME] [--headroom 0.03] [--tick-secs 60] [--cloud default|harsh|ideal]`
//!
//! Each trace is replayed through the real autoscaler under every policy
//! with its catalog (the default one, or the one `trace::catalog_for`
//! names: V100s for `burst-72h-v100`), its history (`trace::history_days_for`:
//! a week for `office-week`) and the default simulator options (the cloud:
//! the catalog's `[cloud]`, or the `--cloud` preset);
//! the `vs static` column is the cost relative to `static-peak` on the
//! same trace. `make bench-leasing` runs the same over seeds and clouds.

use std::path::Path;

use tidegate_lease_core::autoscale::PolicyName;
use tidegate_lease_core::catalog::Catalog;
use tidegate_lease_core::cloud::{CloudConfig, CloudPreset};
use tidegate_lease_core::sim::{SimOptions, simulate, table_header, table_row};
use tidegate_lease_core::trace::{SHIPPED, Trace, catalog_for, history_days_for};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let json = args.iter().any(|a| a == "--json");
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces");
    let default_catalog = Catalog::default_catalog();
    let mut opts = SimOptions::default();
    if let Some(h) = flag("--headroom") {
        opts.headroom = Some(h.parse()?);
    }
    if let Some(t) = flag("--tick-secs") {
        opts.tick_ms = t.parse::<u64>()? * 1000;
    }
    if let Some(c) = flag("--cloud") {
        opts.cloud = Some(CloudConfig::preset(c.parse::<CloudPreset>()?));
    }
    let only = flag("--trace");
    if !json {
        println!("{}", table_header());
    }
    for name in SHIPPED {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let trace = Trace::load(&dir.join(format!("{name}.csv")))?;
        let catalog = match catalog_for(name) {
            Some(file) => Catalog::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join(file))?,
            None => default_catalog.clone(),
        };
        let opts = SimOptions {
            history_days: history_days_for(name),
            ..opts.clone()
        };
        let reports: Vec<_> = PolicyName::ALL
            .into_iter()
            .map(|p| simulate(&trace, p, &catalog, &opts))
            .collect();
        let static_cost = reports[0].cost_total;
        for r in &reports {
            if json {
                println!("{}", serde_json::to_string(r)?);
            } else {
                println!("{}", table_row(r, static_cost));
            }
        }
    }
    Ok(())
}
