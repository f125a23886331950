//! The operator HTTP API, on its own listener (separate from QUIC):
//! `/metrics`, `/healthz`, `/readyz`, and JSON under `/api/v1/`.

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};

use crate::hub::Hub;
use crate::metrics::Metrics;

/// What the handlers share.
#[derive(Debug, Clone)]
pub struct ApiState {
    /// The hub, for snapshots.
    pub hub: Hub,
    /// The metrics registry.
    pub metrics: Metrics,
}

/// The router.
pub fn router(state: ApiState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/api/v1/frames", get(frames))
        .route("/api/v1/edges", get(edges))
        .route("/api/v1/cameras", get(cameras))
        .route("/api/v1/workers", get(workers))
        .route("/api/v1/models", get(models))
        .with_state(state)
}

async fn metrics(State(s): State<ApiState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
        .into_response()
}

/// Ready when at least one worker is registered.
async fn readyz(State(s): State<ApiState>) -> Response {
    match s.hub.snapshot().await {
        Some(snap) if !snap.workers.is_empty() => (StatusCode::OK, "ready\n").into_response(),
        Some(_) => (StatusCode::SERVICE_UNAVAILABLE, "no worker registered\n").into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, "shutting down\n").into_response(),
    }
}

macro_rules! snapshot_route {
    ($name:ident, $field:ident) => {
        async fn $name(State(s): State<ApiState>) -> Response {
            match s.hub.snapshot().await {
                Some(snap) => Json(snap.$field).into_response(),
                None => (StatusCode::SERVICE_UNAVAILABLE, "shutting down\n").into_response(),
            }
        }
    };
}

snapshot_route!(frames, frames);
snapshot_route!(edges, edges);
snapshot_route!(cameras, cameras);
snapshot_route!(workers, workers);
snapshot_route!(models, models);
