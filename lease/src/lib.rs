//! tidegate-lease: GPU leasing, billing and autoscaling for the gateway.
//!
//! The gateway leases cloud GPUs by the hour. This crate holds everything
//! about those leases that does not need the gateway's sockets:
//!
//! * [`catalog`]: instance types and prices (TOML), validated on load;
//! * [`billing`]: the one definition of a lease's billing blocks;
//! * [`lifecycle`]: requested → starting → ready → draining → ended, checked;
//! * [`table`]: the live lease table and one-time lease tokens;
//! * [`ledger`]: SQLite record of leases, charged blocks and frames served;
//! * [`provider`]: where leases come from (`process`, `static`, `slurm`,
//!   `kubernetes`);
//! * [`autoscale`]: the pure, clock-injected scaling policy;
//! * [`pacing`]: when the gateway's shell may act again (acquire backoff,
//!   start timeout, provider releases due and retried), also pure;
//! * [`trace`] and [`sim`]: arrival traces and the simulator that replays
//!   them through the real autoscaler;
//! * [`metrics`]: the values behind the gateway's leasing metrics.
//!
//! The pure parts (billing, lifecycle, autoscale, pacing, sim) take `now` as an
//! argument and never read a clock, so a week of tidal load is simulated in
//! well under a second and tested deterministically.

pub mod autoscale;
pub mod billing;
pub mod catalog;
pub mod ledger;
pub mod lifecycle;
pub mod metrics;
pub mod pacing;
pub mod provider;
pub mod showback;
pub mod sim;
pub mod table;
pub mod trace;

pub use billing::Millis;
pub use catalog::{Catalog, Money, Tier};
pub use lifecycle::{EndReason, LeaseState};
pub use table::{LeaseId, LeaseTable, LeaseToken};
