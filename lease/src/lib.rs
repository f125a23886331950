//! tidegate-lease: GPU leasing, billing and autoscaling for the gateway.
//!
//! The gateway leases cloud GPUs by the hour. This crate holds everything
//! about those leases that does not need the gateway's sockets:
//!
//! * [`catalog`]: instance types and prices (TOML), validated on load;
//! * [`cloud`]: the simulated cloud (start-up draws, spot refusals and
//!   reclaim waves, capacity, reserved commitments), pure;
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
//!   them through the real autoscaler; [`queue`]: its queueing model of
//!   serving (deadline, batching, shedding) in virtual time;
//! * [`tracegen`]: seeded generators of trace shapes (diurnal, office
//!   week, burst, growth, flip, noise) and the suite shipped in `traces/`;
//! * [`metrics`]: the values behind the gateway's leasing metrics;
//! * [`own`]: renting against owning (what a bought fleet would cost, and
//!   the utilisation at which buying pays).
//!
//! The pure parts (billing, lifecycle, autoscale, pacing, sim) take `now` as an
//! argument and never read a clock, so a week of tidal load is simulated in
//! well under a second and tested deterministically.

pub mod autoscale;
pub mod billing;
pub mod catalog;
pub mod cloud;
pub mod ledger;
pub mod lifecycle;
pub mod metrics;
pub mod own;
pub mod pacing;
pub mod provider;
pub mod queue;
pub mod showback;
pub mod sim;
pub mod table;
pub mod trace;
pub mod tracegen;

pub use billing::Millis;
pub use catalog::{Catalog, Money, Tier};
pub use lifecycle::{EndReason, LeaseState};
pub use table::{LeaseId, LeaseTable, LeaseToken};
