//! tidegate-lease-core: the pure core of GPU leasing.
//!
//! What it owns: every leasing decision and sum that needs no IO, so that
//! the policy, the bill and the simulator build and test without SQLite,
//! a Kubernetes client or an async runtime.
//!
//! * [`catalog`]: instance types and prices (TOML), validated on load;
//! * [`cloud`]: the simulated cloud (start-up draws, spot refusals and
//!   reclaim waves, capacity, reserved commitments);
//! * [`billing`]: the one definition of a lease's billing blocks;
//! * [`lifecycle`]: requested → starting → ready → draining → ended, checked;
//! * [`table`]: the live lease table and one-time lease tokens;
//! * [`autoscale`]: the clock-injected scaling policy;
//! * [`pacing`]: when the gateway's shell may act again (acquire backoff,
//!   start timeout, provider releases due and retried);
//! * [`trace`] and [`sim`]: arrival traces and the simulator that replays
//!   them through the real autoscaler; [`queue`]: its queueing model of
//!   serving (deadline, batching, shedding) in virtual time;
//! * [`tracegen`]: seeded generators of trace shapes (diurnal, office
//!   week, burst, growth, flip, noise) and the suite shipped in `traces/`;
//! * [`showback`]: who used what, priced;
//! * [`metrics`]: the arithmetic behind the gateway's leasing metrics;
//! * [`own`]: renting against owning (what a bought fleet would cost, and
//!   the utilisation at which buying pays).
//!
//! What it must not do: read a clock, open a socket or a database, or
//! spawn. Everything takes `now` as an argument, so a week of tidal load
//! is simulated in well under a second and tested deterministically.
//!
//! Where a lease goes next: `tidegate-lease` adds the SQLite ledger and
//! the providers (process, static, Slurm, Kubernetes) and re-exports these
//! modules under the same names; the gateway's `leasing` shell carries out
//! the autoscaler's actions.

pub mod autoscale;
pub mod billing;
pub mod catalog;
pub mod cloud;
pub mod lifecycle;
pub mod metrics;
pub mod own;
pub mod pacing;
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
