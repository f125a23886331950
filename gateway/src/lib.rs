//! tidegate-gateway: accepts edges and workers over QUIC, schedules every
//! frame against its deadline, and serves the operator API.
//!
//! - [`scheduler`]: the pure, clock-injected scheduling state machine.
//! - [`health`]: the pure policy that demotes a worker failing its frames
//!   and probes it back.
//! - [`backpressure`]: the pure policy that turns shedding into frame-rate
//!   hints for the cameras.
//! - [`hub`]: the async shell that owns the scheduler, frame payloads and the
//!   routes back to edges and workers.
//! - [`leasing`]: the lease shell around the pure autoscaler: ledger,
//!   provider, lease tokens, cost.
//! - [`server`]: the QUIC listener; one task and span per connection.
//! - [`auth`]: token hashing and checking; the credentials in force and the
//!   connections they let in.
//! - [`reload`]: configuration reload (SIGHUP, `POST /api/v1/reload`).
//! - [`api`]: HTTP (`/metrics`, `/healthz`, `/readyz`, `/api/v1/...`, and
//!   the status page at `/`).
//! - [`http_listener`]: the API's accept loop: a connection cap and a
//!   header-read timeout.
//! - [`status`]: the live status page and the model it renders
//!   (`/api/v1/status`), from the API's snapshot.
//! - [`thumbnail`]: camera thumbnails with their detections drawn (the
//!   pure renderer, and the store the hub fills and the API serves).
//! - [`timeline`]: the pure ring of 5 s intervals (15 minutes) behind the
//!   status page's plots, rates and problems banner.
//! - [`metrics`]: Prometheus metrics, registered in one place.
//! - [`ratelimit`]: the pure token bucket and per-connection policy that
//!   hold an edge's control messages to a rate.
//! - [`config`]: the `Config` file and flags.
//! - [`certs`]: dev CA and certificates (`tidegate-gateway dev-certs`).
//! - [`preflight`]: `tidegate-gateway check-config`, every file and port
//!   `run` needs, checked without running.
//! - [`simulate`]: `tidegate-gateway simulate`, a trace replayed through the
//!   autoscaler.

pub mod api;
pub mod auth;
pub mod backpressure;
/// Development TLS material (`tidegate-gateway dev-certs`).
pub use tidegate_protocol::certs;
pub mod config;
pub mod deadline;
pub mod health;
pub mod http_listener;
pub mod hub;
pub mod leasing;
pub mod metrics;
pub mod preflight;
pub mod ratelimit;
pub mod reload;
pub mod scheduler;
pub mod server;
pub mod simulate;
pub mod status;
pub mod thumbnail;
pub mod timeline;
