//! Prints the policy comparison table for the three shipped traces.
//!
//! `cargo run --release -p tidegate-lease --example compare [-- --json] [--trace NAME] [--headroom 0.03] [--tick-secs 60]`
//!
//! Each trace is replayed through the real autoscaler under every policy
//! with the default catalog and simulator options; the `vs static` column
//! is the cost relative to `static-peak` on the same trace.

use std::path::Path;

use tidegate_lease::autoscale::PolicyName;
use tidegate_lease::catalog::Catalog;
use tidegate_lease::sim::{SimOptions, simulate, table_header, table_row};
use tidegate_lease::trace::{SHIPPED, Trace};

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
    let catalog = Catalog::default_catalog();
    let mut opts = SimOptions::default();
    if let Some(h) = flag("--headroom") {
        opts.headroom = Some(h.parse()?);
    }
    if let Some(t) = flag("--tick-secs") {
        opts.tick_ms = t.parse::<u64>()? * 1000;
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
