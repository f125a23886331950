//! The operator API's JSON bodies: one type per body, each built from the
//! gateway's own state (the hub's [`Snapshot`](crate::hub::Snapshot), the
//! timeline, the lease ledger's rows and cost report), and the source of
//! the OpenAPI document (`GET /api/v1/openapi.json`, `docs/openapi.json`).
//!
//! The shape every body keeps:
//! - an edge is named by its configured (authenticated) name, in a field
//!   called `edge`; its connection's number, where useful, is `session`;
//! - a lease is its number (`"lease": 3`, the id `POST
//!   /api/v1/leases/{id}/release` takes), never `lease-3`;
//! - every instant is a [`Timestamp`]: RFC 3339 UTC with milliseconds
//!   (`2026-12-05T22:57:07.123Z`), in a field whose name ends in `_at`;
//!   every duration carries its unit in its name (`_ms`, `_s`, `_us`);
//! - every field is labelled: objects, never tuples;
//! - every error is an [`ApiError`], `{"error": "…"}`.
//!
//! The conversions destructure their source without `..`: a field added to
//! a source type does not compile until this module says what the API
//! makes of it.
//!
//! One child module per resource (edges, cameras, workers, models, the
//! timeline, leases, costs, reloads), one for frame accounting shared by
//! several, and one for [`Timestamp`]; this file re-exports them all, so
//! callers name `json::X`. This module only describes and converts: it
//! takes no lock, reads no clock and decides nothing; the handlers in
//! [`crate::api`] do that.

use serde::Serialize;
use utoipa::ToSchema;

mod cameras;
mod costs;
mod edges;
mod frames;
mod leases;
mod models;
mod reload;
mod timeline;
mod timestamp;
mod workers;

pub use cameras::{Camera, CameraLoad, Jpeg, cameras};
pub use costs::{Costs, EdgeCost, InstanceTypeCost, ModelCost, TierCost};
pub use edges::{Edge, edges};
pub use frames::{FrameCounts, FrameTotals, Percentiles};
pub use leases::{Lease, Releasing};
pub use models::{Input, Model, models};
pub use reload::{PrincipalChanges, Reloaded, Revoked};
pub use timeline::{CameraWindow, Point, RecentWindow, Stall, Timeline, WorkerWindow};
pub use timestamp::{TIMESTAMP_PATTERN, Timestamp, rfc3339};
pub use workers::{Draining, ProfilePoint, Worker, workers};

/// Every error the API answers (any 4xx or 5xx under `/api/`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct ApiError {
    /// What was wrong and what to do about it.
    pub error: String,
}
