//! Regenerates the committed traces in `lease-core/traces/` from
//! `tidegate_lease_core::trace::generate` (the three hand-shaped traces and the
//! seeded suite of `tidegate_lease_core::tracegen::suite`).
//!
//! `cargo run -p tidegate-lease-core --example gen-traces`

use std::path::Path;

use tidegate_lease_core::trace::{SHIPPED, describe, generate};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces");
    std::fs::create_dir_all(&dir)?;
    for name in SHIPPED {
        let trace = generate(name)?;
        let path = dir.join(format!("{name}.csv"));
        std::fs::write(&path, trace.to_csv(&describe(name)?))?;
        println!("wrote {} ({} rows)", path.display(), trace.rows.len());
    }
    Ok(())
}
