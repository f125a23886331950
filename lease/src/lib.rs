//! tidegate-lease: GPU leasing for the gateway, with its IO.
//!
//! What it owns: where leases come from and where they are recorded:
//!
//! * [`ledger`]: the SQLite record of leases, charged blocks and frames
//!   served;
//! * [`provider`]: where leases come from (`process`, `static`, `slurm`,
//!   `kubernetes`).
//!
//! The pure core (catalog, billing, lifecycle, lease table, autoscaler,
//! pacing, simulated cloud, traces, queueing model, simulator, showback,
//! metrics arithmetic, renting against owning) is the
//! `tidegate-lease-core` crate, which builds without SQLite or the
//! Kubernetes client; its modules are re-exported here under the same
//! names (`tidegate_lease::autoscale`, `tidegate_lease::sim`, …), so the
//! gateway names one crate.
//!
//! What it must not do: decide. Which lease to acquire or release, and
//! when, is the autoscaler's (in the core); this crate carries the
//! decisions to a provider and records them. The gateway's `leasing` shell
//! drives both.

pub mod ledger;
pub mod provider;

pub use tidegate_lease_core::{
    Catalog, EndReason, LeaseId, LeaseState, LeaseTable, LeaseToken, Millis, Money, Tier,
};
pub use tidegate_lease_core::{
    autoscale, billing, catalog, cloud, lifecycle, metrics, own, pacing, queue, showback, sim,
    table, trace, tracegen,
};
