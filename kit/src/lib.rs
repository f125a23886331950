//! What every tidegate client repeats, written once: the edge and the
//! worker (both dial the gateway), the lease providers and the load tests.
//!
//! - [`backoff`]: a pure, seeded exponential backoff with jitter; the caller
//!   sleeps.
//! - [`signal`]: signals sent to a process or group through `kill(2)` (no
//!   `kill` process), and, with the `shutdown` feature, the wait for SIGTERM
//!   or Ctrl-C.
//! - `gateway` (feature `gateway`): how the edge's and the worker's
//!   `[gateway]` sections read their shared fields.
//! - `config` (feature `config`): a TOML config file read into a binary's
//!   own schema, and the one `ConfigError` the gateway, the edge and the
//!   worker report.
//!
//! Kept tiny on purpose (std, thiserror, rustix; tokio only for
//! `shutdown`, serde and tidegate-protocol only for `gateway`, serde and
//! toml only for `config`): the lease crate depends on it, with none of
//! these features.

pub mod backoff;
#[cfg(feature = "config")]
pub mod config;
#[cfg(feature = "gateway")]
pub mod gateway;
pub mod signal;
