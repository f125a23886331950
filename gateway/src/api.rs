//! The operator HTTP API, on its own listener (separate from QUIC):
//! `/metrics`, `/healthz`, `/readyz`, JSON under `/api/v1/`, and the status
//! page at `/`. The mutating routes (`POST`) need the admin token.
//!
//! The router and its OpenAPI 3 document come from the same annotations
//! (`#[utoipa::path]` on each handler, added with `routes!`): a route is
//! served only as it is documented. The bodies are [`json`]'s types; every
//! error is `{"error": "…"}` ([`error`]), except on the probes and
//! `/metrics`, which stay plain text for the tools that read them.

pub mod json;

use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::{Json, Router};

use serde::Deserialize;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use tidegate_lease::LeaseId;

use std::sync::{Arc, OnceLock};

use crate::auth::{Access, token_matches};
use crate::hub::Hub;
use crate::leasing::{Leasing, MAX_LEASES_LISTED, ReleaseRefused};
use crate::metrics::Metrics;
use crate::reload::{ReloadError, Reloader};

use json::ApiError;

/// What the handlers share.
#[derive(Debug, Clone)]
pub struct ApiState {
    /// The hub, for snapshots.
    pub hub: Hub,
    /// The metrics registry.
    pub metrics: Metrics,
    /// The lease shell, when `[leasing]` is configured.
    pub leasing: Option<Leasing>,
    /// The credentials in force: the admin token (`http.admin_token_sha256`)
    /// that the mutating routes need (unset: they are refused).
    pub access: Arc<Access>,
    /// Reloads the configuration (`POST /api/v1/reload`).
    pub reloader: Arc<Reloader>,
}

/// Requests the API serves at once. The snapshot routes ask the hub (the
/// task frames go through) and the lease routes the lease manager (which
/// also answers worker logins): a flood of requests past this is answered
/// `503` at once instead of queueing in front of them.
pub const MAX_CONCURRENT_REQUESTS: usize = 64;

/// The one error answer: `status` with `{"error": message}` as
/// `application/json`. `message` says what was wrong and what to do.
pub fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (
        status,
        Json(ApiError {
            error: message.into(),
        }),
    )
        .into_response()
}

/// The answer while the hub is stopping.
fn shutting_down() -> Response {
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        "the gateway is shutting down; try another gateway or retry once it is back",
    )
}

/// Answers `503 Service Unavailable` (with `Retry-After: 1`) to a request
/// that finds [`MAX_CONCURRENT_REQUESTS`] under way.
async fn limit_concurrency(
    State(slots): State<Arc<tokio::sync::Semaphore>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match slots.try_acquire() {
        Ok(_slot) => next.run(request).await,
        Err(_) => {
            let mut answer = error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "too many API requests under way (at most {MAX_CONCURRENT_REQUESTS}); try again in a second"
                ),
            );
            answer
                .headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
            answer
        }
    }
}

/// What the document says of the API as a whole; the paths and schemas
/// come from the handlers' annotations.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "tidegate gateway operator API",
        description = "The gateway's HTTP API: JSON under /api/v1, the status page, probes and \
Prometheus metrics. Instants are RFC 3339 UTC with milliseconds in fields named *_at; durations \
carry their unit in their name (_ms, _s, _us); an edge is named by its configured name in a field \
called edge; a lease is its number. Every error under /api/ is {\"error\": \"...\"}. POST routes \
need Authorization: Bearer <admin token>."
    ),
    components(schemas(ApiError)),
    modifiers(&AdminToken)
)]
struct ApiDoc;

/// The `admin_token` scheme the POST routes name: `Authorization: Bearer
/// <token>`, the token whose SHA-256 is `http.admin_token_sha256`.
struct AdminToken;

impl utoipa::Modify for AdminToken {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let scheme = HttpBuilder::new()
            .scheme(HttpAuthScheme::Bearer)
            .description(Some(
                "The admin token, whose SHA-256 is http.admin_token_sha256 \
(tidegate-gateway hash-token <TOKEN>)",
            ))
            .build();
        doc.components
            .get_or_insert_with(Default::default)
            .add_security_scheme("admin_token", SecurityScheme::Http(scheme));
    }
}

/// Every route with its documentation: the only place a route is added.
fn routes() -> OpenApiRouter<ApiState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(status_page))
        .routes(routes!(metrics))
        .routes(routes!(healthz))
        .routes(routes!(readyz))
        .routes(routes!(openapi_document))
        .routes(routes!(frames))
        .routes(routes!(edges))
        .routes(routes!(cameras))
        .routes(routes!(camera_thumbnail))
        .routes(routes!(workers))
        .routes(routes!(models))
        .routes(routes!(status_json))
        .routes(routes!(timeline))
        .routes(routes!(leases))
        .routes(routes!(costs))
        .routes(routes!(costs_csv))
        .routes(routes!(drain_worker))
        .routes(routes!(release_lease))
        .routes(routes!(reload))
}

/// The API's OpenAPI 3 document.
pub fn openapi() -> utoipa::openapi::OpenApi {
    routes().into_openapi()
}

/// [`openapi`] as the text served at `/api/v1/openapi.json` and committed
/// as `docs/openapi.json`: pretty JSON and a final newline.
pub fn openapi_json() -> &'static str {
    static DOC: OnceLock<String> = OnceLock::new();
    DOC.get_or_init(|| {
        let mut text = openapi()
            .to_pretty_json()
            .unwrap_or_else(|e| format!("{{\"error\": \"the OpenAPI document: {e}\"}}"));
        text.push('\n');
        text
    })
}

/// The router.
pub fn router(state: ApiState) -> Router {
    router_with_slots(
        state,
        Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT_REQUESTS)),
    )
}

/// [`router`] with the slots its requests take.
fn router_with_slots(state: ApiState, slots: Arc<tokio::sync::Semaphore>) -> Router {
    let (router, _) = routes().split_for_parts();
    router
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .with_state(state)
        .layer(axum::middleware::from_fn_with_state(
            slots,
            limit_concurrency,
        ))
}

/// A path no route serves.
async fn no_route(uri: axum::http::Uri) -> Response {
    error(
        StatusCode::NOT_FOUND,
        format!(
            "no route {}: the routes are listed at /api/v1/openapi.json",
            uri.path()
        ),
    )
}

/// A route asked with a method it does not serve.
async fn wrong_method(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    error(
        StatusCode::METHOD_NOT_ALLOWED,
        format!(
            "{method} is not served at {}: the methods each route takes are listed at /api/v1/openapi.json",
            uri.path()
        ),
    )
}

/// Prometheus metrics, in the text exposition format.
#[utoipa::path(get, path = "/metrics", tag = "probes",
    responses((status = 200, description = "Prometheus text exposition format 0.0.4", content_type = "text/plain", body = String)))]
async fn metrics(State(s): State<ApiState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
        .into_response()
}

/// Liveness: `ok` while the HTTP listener serves.
#[utoipa::path(get, path = "/healthz", tag = "probes",
    responses((status = 200, description = "`ok`", content_type = "text/plain", body = String)))]
async fn healthz() -> &'static str {
    "ok\n"
}

/// This document.
#[utoipa::path(get, path = "/api/v1/openapi.json", tag = "api",
    responses((status = 200, description = "The API's OpenAPI 3 document (also docs/openapi.json)", body = serde_json::Value)))]
async fn openapi_document() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], openapi_json()).into_response()
}

/// The token of an `Authorization: Bearer <token>` value; the scheme's
/// name is case-insensitive (RFC 7235 §2.1).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
        .filter(|t| !t.is_empty())
}

/// The refusal of a mutating route, unless the request carries
/// `Authorization: Bearer <admin token>`.
fn refuse_unless_admin(s: &ApiState, headers: &HeaderMap) -> Option<Response> {
    let Some(digest) = s.access.admin_token_sha256() else {
        return Some(error(
            StatusCode::FORBIDDEN,
            "mutating routes are disabled: set http.admin_token_sha256 (tidegate-gateway hash-token <TOKEN>)",
        ));
    };
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token);
    let (challenge, message) = match token {
        Some(t) if token_matches(t, &digest) => return None,
        Some(_) => (
            "Bearer error=\"invalid_token\"",
            "wrong admin token: send the token whose SHA-256 is http.admin_token_sha256",
        ),
        None => (
            "Bearer",
            "this route needs Authorization: Bearer <admin token>",
        ),
    };
    let mut answer = error(StatusCode::UNAUTHORIZED, message);
    answer.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        header::HeaderValue::from_static(challenge),
    );
    Some(answer)
}

/// No new batch goes to the workers registered as `name`, and they are
/// told to finish theirs and exit.
#[utoipa::path(post, path = "/api/v1/workers/{name}/drain", tag = "api",
    params(("name" = String, Path, description = "The worker's registered name")),
    security(("admin_token" = [])),
    responses(
        (status = 202, description = "Its connections are draining", body = json::Draining),
        (status = 401, description = "No admin token, or a wrong one", body = ApiError),
        (status = 403, description = "No admin token is configured", body = ApiError),
        (status = 404, description = "No worker of that name is registered", body = ApiError),
        (status = 503, description = "Shutting down, or too many requests", body = ApiError),
    ))]
async fn drain_worker(
    State(s): State<ApiState>,
    name: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
) -> Response {
    if let Some(refused) = refuse_unless_admin(&s, &headers) {
        return refused;
    }
    let Path(name) = match name {
        Ok(n) => n,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("worker name: {e}")),
    };
    match s.hub.drain_worker(&name).await {
        Some(0) => error(
            StatusCode::NOT_FOUND,
            format!("no worker named {name:?} is registered: GET /api/v1/workers lists them"),
        ),
        Some(n) => (
            StatusCode::ACCEPTED,
            Json(json::Draining {
                worker: name,
                draining: n,
            }),
        )
            .into_response(),
        None => shutting_down(),
    }
}

/// Reads the config file again and applies its credentials; `400` with the
/// reason when the file is unusable (nothing changes then).
#[utoipa::path(post, path = "/api/v1/reload", tag = "api",
    security(("admin_token" = [])),
    responses(
        (status = 200, description = "What the reload changed", body = json::Reloaded),
        (status = 400, description = "The file is unusable; nothing changed", body = ApiError),
        (status = 401, description = "No admin token, or a wrong one", body = ApiError),
        (status = 403, description = "No admin token is configured", body = ApiError),
        (status = 409, description = "The gateway runs without --config", body = ApiError),
        (status = 500, description = "The reload task failed", body = ApiError),
        (status = 503, description = "Too many requests", body = ApiError),
    ))]
async fn reload(State(s): State<ApiState>, headers: HeaderMap) -> Response {
    if let Some(refused) = refuse_unless_admin(&s, &headers) {
        return refused;
    }
    let reloader = s.reloader.clone();
    match tokio::task::spawn_blocking(move || reloader.reload()).await {
        Ok(Ok(report)) => {
            tracing::info!(?report, "configuration reloaded (API)");
            Json(json::Reloaded::from(&report)).into_response()
        }
        Ok(Err(e @ ReloadError::NoFile)) => error(StatusCode::CONFLICT, e.to_string()),
        Ok(Err(e)) => {
            tracing::warn!("configuration reload refused: {e}");
            error(StatusCode::BAD_REQUEST, e.to_string())
        }
        Err(e) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the reload task failed: {e}; the configuration in force is unchanged"),
        ),
    }
}

/// Releases the lease now: its worker drains, then the provider ends it.
#[utoipa::path(post, path = "/api/v1/leases/{id}/release", tag = "api",
    params(("id" = u64, Path, description = "The lease's id, as `GET /api/v1/leases` lists it")),
    security(("admin_token" = [])),
    responses(
        (status = 202, description = "Its worker is draining", body = json::Releasing),
        (status = 400, description = "The id is not a number", body = ApiError),
        (status = 401, description = "No admin token, or a wrong one", body = ApiError),
        (status = 403, description = "No admin token is configured", body = ApiError),
        (status = 404, description = "No such lease, or leasing is not configured", body = ApiError),
        (status = 409, description = "The lease cannot be released now (already ending)", body = ApiError),
        (status = 503, description = "The lease manager stopped, or too many requests", body = ApiError),
    ))]
async fn release_lease(
    State(s): State<ApiState>,
    id: Result<Path<u64>, PathRejection>,
    headers: HeaderMap,
) -> Response {
    if let Some(refused) = refuse_unless_admin(&s, &headers) {
        return refused;
    }
    let Path(id) = match id {
        Ok(id) => id,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("lease id: {e}; use the number GET /api/v1/leases lists (3, not lease-3)"),
            );
        }
    };
    let Some(l) = &s.leasing else {
        return no_leasing();
    };
    match l.release(LeaseId(id)).await {
        Ok(()) => (
            StatusCode::ACCEPTED,
            Json(json::Releasing {
                lease: id,
                state: "draining".into(),
            }),
        )
            .into_response(),
        Err(e @ ReleaseRefused::Unknown(_)) => error(StatusCode::NOT_FOUND, e.to_string()),
        Err(e @ ReleaseRefused::Stopped) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        Err(e) => error(StatusCode::CONFLICT, e.to_string()),
    }
}

/// The status page's model (`status/`) as of now: the hub's snapshot,
/// and with `[leasing]` the ledger's live leases and costs.
async fn status_model(s: &ApiState) -> Result<crate::status::StatusModel, Response> {
    let Some(snap) = s.hub.snapshot().await else {
        return Err(shutting_down());
    };
    let now = tidegate_lease::provider::wall_clock_ms();
    let leasing = match &s.leasing {
        Some(l) => match (
            l.leases(true, MAX_LEASES_LISTED).await,
            l.cost_totals(0, now + 1).await,
            l.costs(now.saturating_sub(crate::status::RECENT_MS), now + 1)
                .await,
        ) {
            (Ok(live), Ok(costs), Ok(recent)) => Some((live, costs, recent)),
            (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => return Err(internal(e)),
        },
        None => None,
    };
    let spend_cap_per_hour = spend_cap(&s.metrics);
    let view = leasing
        .as_ref()
        .map(|(live, costs, recent)| crate::status::LeasingView {
            live,
            costs,
            recent,
            spend_cap_per_hour,
        });
    let mut model = crate::status::build(&snap, view, now);
    crate::status::add_thumbnails(&mut model, s.hub.thumbnails());
    Ok(model)
}

/// `leasing.spend_cap_per_hour`, as the gateway exports it
/// (`tidegate_spend_cap_per_hour`, set only when configured): read back
/// without creating the series.
fn spend_cap(metrics: &Metrics) -> Option<f64> {
    use prometheus::core::Collector;
    let families = metrics.spend_cap.collect();
    let sample = families.first()?.get_metric().first()?;
    Some(sample.get_gauge().get_value()).filter(|cap| *cap > 0.0)
}

/// The live status page: the model as of now, and the script that keeps
/// it current from `/api/v1/status`.
#[utoipa::path(get, path = "/", tag = "status",
    responses(
        (status = 200, description = "The status page (HTML, everything inline)", content_type = "text/html", body = String),
        (status = 500, description = "The ledger could not be read", body = ApiError),
        (status = 503, description = "Shutting down, or too many requests", body = ApiError),
    ))]
async fn status_page(State(s): State<ApiState>) -> Response {
    match status_model(&s).await {
        Ok(m) => Html(crate::status::page(&m)).into_response(),
        Err(answer) => answer,
    }
}

/// What the status page shows.
#[utoipa::path(get, path = "/api/v1/status", tag = "status",
    responses(
        (status = 200, description = "The status page's model", body = crate::status::StatusModel),
        (status = 500, description = "The ledger could not be read", body = ApiError),
        (status = 503, description = "Shutting down, or too many requests", body = ApiError),
    ))]
async fn status_json(State(s): State<ApiState>) -> Response {
    match status_model(&s).await {
        Ok(m) => Json(m).into_response(),
        Err(answer) => answer,
    }
}

/// Readiness: ready when at least one worker is registered.
#[utoipa::path(get, path = "/readyz", tag = "probes",
    responses(
        (status = 200, description = "`ready`", content_type = "text/plain", body = String),
        (status = 503, description = "`no worker registered` or `shutting down`", content_type = "text/plain", body = String),
    ))]
async fn readyz(State(s): State<ApiState>) -> Response {
    match s.hub.snapshot().await {
        Some(snap) if !snap.workers.is_empty() => (StatusCode::OK, "ready\n").into_response(),
        Some(_) => (StatusCode::SERVICE_UNAVAILABLE, "no worker registered\n").into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, "shutting down\n").into_response(),
    }
}

/// `view` of the hub's snapshot as JSON, or the answer that says why there
/// is no snapshot.
async fn snapshot_json<T: serde::Serialize>(
    s: &ApiState,
    view: impl FnOnce(crate::hub::Snapshot) -> T,
) -> Response {
    match s.hub.snapshot().await {
        Some(snap) => Json(view(snap)).into_response(),
        None => shutting_down(),
    }
}

/// Frame accounting since the gateway started.
#[utoipa::path(get, path = "/api/v1/frames", tag = "api",
    responses(
        (status = 200, description = "admitted = ok + shed + expired + failed + queued + dispatched", body = json::FrameTotals),
        (status = 503, description = "Shutting down, or too many requests", body = ApiError),
    ))]
async fn frames(State(s): State<ApiState>) -> Response {
    snapshot_json(&s, |snap| json::FrameTotals::from(snap.frames)).await
}

/// Connected edges, one entry per connection, by session.
#[utoipa::path(get, path = "/api/v1/edges", tag = "api",
    responses(
        (status = 200, description = "Connected edges", body = Vec<json::Edge>),
        (status = 503, description = "Shutting down, or too many requests", body = ApiError),
    ))]
async fn edges(State(s): State<ApiState>) -> Response {
    snapshot_json(&s, |snap| json::edges(&snap)).await
}

/// Open cameras, by edge name, session and camera name.
#[utoipa::path(get, path = "/api/v1/cameras", tag = "api",
    responses(
        (status = 200, description = "Open cameras", body = Vec<json::Camera>),
        (status = 503, description = "Shutting down, or too many requests", body = ApiError),
    ))]
async fn cameras(State(s): State<ApiState>) -> Response {
    snapshot_json(&s, |snap| json::cameras(&snap)).await
}

/// The camera's latest served frame, its content area with its
/// detections outlined, as a JPEG of at most `status.thumbnail_max_px` on
/// its long side; a new one at most every `status.thumbnail_interval_ms`.
/// Off unless `[status] thumbnails = true`.
#[utoipa::path(get, path = "/api/v1/cameras/{edge}/{camera}/thumbnail.jpg", tag = "status",
    params(
        ("edge" = String, Path, description = "The edge's configured name"),
        ("camera" = String, Path, description = "The camera's name"),
    ),
    responses(
        (status = 200, description = "The thumbnail (`Cache-Control: no-store`)", content_type = "image/jpeg", body = json::Jpeg),
        (status = 400, description = "The path is not an edge and a camera", body = ApiError),
        (status = 404, description = "Thumbnails are off, or the camera has none (not open, no frame served ok yet, or its frames are no picture)", body = ApiError),
        (status = 503, description = "Too many requests", body = ApiError),
    ))]
async fn camera_thumbnail(
    State(s): State<ApiState>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Response {
    let Path((edge, camera)) = match path {
        Ok(p) => p,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("edge and camera: {e}")),
    };
    match s.hub.thumbnails().get(&edge, &camera) {
        Ok((_, jpeg)) => (
            [
                (header::CONTENT_TYPE, "image/jpeg"),
                (header::CACHE_CONTROL, "no-store"),
            ],
            jpeg,
        )
            .into_response(),
        Err(why) => error(StatusCode::NOT_FOUND, why.to_string()),
    }
}

/// Registered workers, by session.
#[utoipa::path(get, path = "/api/v1/workers", tag = "api",
    responses(
        (status = 200, description = "Registered workers", body = Vec<json::Worker>),
        (status = 503, description = "Shutting down, or too many requests", body = ApiError),
    ))]
async fn workers(State(s): State<ApiState>) -> Response {
    snapshot_json(&s, |snap| json::workers(&snap)).await
}

/// Models served by at least one worker, by name.
#[utoipa::path(get, path = "/api/v1/models", tag = "api",
    responses(
        (status = 200, description = "Served models", body = Vec<json::Model>),
        (status = 503, description = "Shutting down, or too many requests", body = ApiError),
    ))]
async fn models(State(s): State<ApiState>) -> Response {
    snapshot_json(&s, |snap| json::models(&snap)).await
}

/// The last 15 minutes, interval by interval.
#[utoipa::path(get, path = "/api/v1/timeline", tag = "status",
    responses(
        (status = 200, description = "The timeline", body = json::Timeline),
        (status = 503, description = "Shutting down, or too many requests", body = ApiError),
    ))]
async fn timeline(State(s): State<ApiState>) -> Response {
    snapshot_json(&s, |snap| json::Timeline::from(&snap.timeline)).await
}

fn no_leasing() -> Response {
    error(
        StatusCode::NOT_FOUND,
        "leasing is not configured: add a [leasing] section to the gateway config",
    )
}

fn internal(e: String) -> Response {
    error(StatusCode::INTERNAL_SERVER_ERROR, e)
}

fn bad_request(e: String) -> Response {
    error(StatusCode::BAD_REQUEST, e)
}

/// A query string that did not parse, as a `400`.
fn bad_query(e: QueryRejection) -> Response {
    bad_request(format!("query: {}", e.body_text()))
}

/// `?live=true&limit=N`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
struct LeasesQuery {
    /// Only leases not ended (`true` or `false`; default `false`).
    #[serde(default)]
    live: Option<String>,
    /// Most leases listed (at most 10000, the default).
    #[serde(default)]
    limit: Option<u32>,
}

/// The ledger's leases, newest first.
#[utoipa::path(get, path = "/api/v1/leases", tag = "leasing",
    params(LeasesQuery),
    responses(
        (status = 200, description = "Leases, newest first", body = Vec<json::Lease>),
        (status = 400, description = "A query parameter is not understood", body = ApiError),
        (status = 404, description = "Leasing is not configured", body = ApiError),
        (status = 500, description = "The ledger could not be read", body = ApiError),
        (status = 503, description = "Too many requests", body = ApiError),
    ))]
async fn leases(
    State(s): State<ApiState>,
    q: Result<Query<LeasesQuery>, QueryRejection>,
) -> Response {
    let Query(q) = match q {
        Ok(q) => q,
        Err(e) => return bad_query(e),
    };
    let Some(l) = &s.leasing else {
        return no_leasing();
    };
    let live_only = match q.live.as_deref() {
        None | Some("false") | Some("0") => false,
        Some("true") | Some("1") | Some("") => true,
        Some(other) => return bad_request(format!("live={other:?}: use true or false")),
    };
    let limit = q.limit.unwrap_or(MAX_LEASES_LISTED).min(MAX_LEASES_LISTED);
    match l.leases(live_only, limit).await {
        Ok(v) => Json(v.iter().map(json::Lease::from).collect::<Vec<_>>()).into_response(),
        Err(e) => internal(e),
    }
}

/// `?from=&to=`: RFC 3339 or ms since the Unix epoch.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
struct CostsQuery {
    /// Range start, inclusive: RFC 3339 (`2026-12-02T17:00:00Z`) or ms
    /// since the Unix epoch (default: the epoch).
    #[serde(default)]
    from: Option<String>,
    /// Range end, exclusive, in the same forms (default: now).
    #[serde(default)]
    to: Option<String>,
}

/// Cost charged in `[from, to)` (default: everything until now).
#[utoipa::path(get, path = "/api/v1/costs", tag = "leasing",
    params(CostsQuery),
    responses(
        (status = 200, description = "The range's cost and its split", body = json::Costs),
        (status = 400, description = "`from` or `to` is not a time, or `to` is before `from`", body = ApiError),
        (status = 404, description = "Leasing is not configured", body = ApiError),
        (status = 500, description = "The ledger could not be read", body = ApiError),
        (status = 503, description = "Too many requests", body = ApiError),
    ))]
async fn costs(
    State(s): State<ApiState>,
    q: Result<Query<CostsQuery>, QueryRejection>,
) -> Response {
    match cost_report(&s, q).await {
        Ok(r) => Json(json::Costs::from(&r)).into_response(),
        Err(answer) => answer,
    }
}

/// The same as CSV, one row per edge, model, idle and the total: for a
/// spreadsheet or a finance import.
#[utoipa::path(get, path = "/api/v1/costs.csv", tag = "leasing",
    params(CostsQuery),
    responses(
        (status = 200, description = "split,name,cost,currency,frames_within_slo,frames_late,busy_seconds,cost_per_1k_within_slo", content_type = "text/csv", body = String),
        (status = 400, description = "`from` or `to` is not a time, or `to` is before `from`", body = ApiError),
        (status = 404, description = "Leasing is not configured", body = ApiError),
        (status = 500, description = "The ledger could not be read", body = ApiError),
        (status = 503, description = "Too many requests", body = ApiError),
    ))]
async fn costs_csv(
    State(s): State<ApiState>,
    q: Result<Query<CostsQuery>, QueryRejection>,
) -> Response {
    match cost_report(&s, q).await {
        Ok(r) => (
            [(axum::http::header::CONTENT_TYPE, "text/csv; charset=utf-8")],
            render_costs_csv(&r),
        )
            .into_response(),
        Err(answer) => answer,
    }
}

/// The ledger's report for the query's range, or the answer that says why
/// there is none.
async fn cost_report(
    s: &ApiState,
    q: Result<Query<CostsQuery>, QueryRejection>,
) -> Result<tidegate_lease::ledger::CostReport, Response> {
    let Query(q) = q.map_err(bad_query)?;
    let Some(l) = &s.leasing else {
        return Err(no_leasing());
    };
    let from = match q.from.as_deref().map(parse_time).transpose() {
        Ok(t) => t.unwrap_or(0),
        Err(e) => return Err(bad_request(format!("from: {e}"))),
    };
    let to = match q.to.as_deref().map(parse_time).transpose() {
        Ok(t) => t.unwrap_or_else(|| tidegate_lease::provider::wall_clock_ms() + 1),
        Err(e) => return Err(bad_request(format!("to: {e}"))),
    };
    if to < from {
        return Err(bad_request(format!(
            "to ({}) is before from ({})",
            json::rfc3339(to),
            json::rfc3339(from)
        )));
    }
    l.costs(from, to).await.map_err(internal)
}

/// `/api/v1/costs.csv`: a header, then `edge` and `model` rows (the two
/// splits), an `idle` row and a `total` row. Amounts in currency units with
/// six decimals (exact: the ledger counts micro-units).
pub fn render_costs_csv(r: &tidegate_lease::ledger::CostReport) -> String {
    use tidegate_lease::Money;
    let currency = r.currency.as_deref().unwrap_or("");
    let money = |m: Money| {
        format!(
            "{}.{:06}",
            m.0.div_euclid(1_000_000),
            m.0.rem_euclid(1_000_000)
        )
    };
    let per_1k = |v: Option<f64>| v.map_or_else(String::new, |v| format!("{v:.6}"));
    let mut out = String::from(
        "split,name,cost,currency,frames_within_slo,frames_late,busy_seconds,cost_per_1k_within_slo\r\n",
    );
    for (split, shares) in [("edge", &r.by_edge), ("model", &r.by_model)] {
        for (name, s) in shares {
            out += &format!(
                "{split},{},{},{},{},{},{:.6},{}\r\n",
                csv_field(name),
                money(s.cost),
                csv_field(currency),
                s.frames_within_slo,
                s.frames_late,
                s.busy_seconds,
                per_1k(s.cost_per_1k_within_slo)
            );
        }
    }
    out += &format!("idle,,{},{},,,,\r\n", money(r.idle), csv_field(currency));
    out += &format!(
        "total,,{},{},{},{},,{}\r\n",
        money(r.total),
        csv_field(currency),
        r.frames_within_slo,
        r.frames_late,
        per_1k(r.cost_per_1k_within_slo)
    );
    out
}

/// A CSV field (RFC 4180): quoted, with quotes doubled, when it holds a
/// comma, a quote or a line break; and with a leading `'` when it starts
/// like a formula (`=`, `+`, `-`, `@`), so a spreadsheet shows an edge's
/// name rather than running it.
fn csv_field(v: &str) -> String {
    let v = if v.starts_with(['=', '+', '-', '@']) {
        format!("'{v}")
    } else {
        v.to_string()
    };
    if v.contains([',', '"', '\r', '\n']) {
        format!("\"{}\"", v.replace('"', "\"\""))
    } else {
        v
    }
}

/// A time as ms since the Unix epoch, from digits or RFC 3339
/// (`2026-12-02T17:00:00Z`, `...T17:00:00.250+08:00`).
pub fn parse_time(s: &str) -> Result<u64, String> {
    let s = s.trim();
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        // At most i64::MAX: the ledger stores times as SQLite integers.
        return s
            .parse::<i64>()
            .map(|ms| ms as u64)
            .map_err(|_| format!("{s:?} is too large for ms since the epoch"));
    }
    match rfc3339_ms(s) {
        Some(Ok(ms)) => Ok(ms),
        Some(Err(BeforeEpoch)) => Err(format!("{s:?} is before 1970 (the Unix epoch)")),
        None => Err(format!(
            "{s:?} is neither ms since the Unix epoch nor RFC 3339 (2026-12-02T17:00:00Z)"
        )),
    }
}

/// An RFC 3339 time before the Unix epoch.
struct BeforeEpoch;

/// Days in `month` (1..=12) of `year`, in the proleptic Gregorian calendar.
fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        2 if year % 4 == 0 && (year % 100 != 0 || year % 400 == 0) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// ms since the epoch of an RFC 3339 time; `None` when it is not one (an
/// impossible date such as February 31st, or an offset past ±23:59,
/// included).
fn rfc3339_ms(s: &str) -> Option<Result<u64, BeforeEpoch>> {
    let b = s.as_bytes();
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let t = s.get(r)?;
        t.bytes()
            .all(|c| c.is_ascii_digit())
            .then(|| t.parse().ok())?
    };
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    if b[13] != b':' || b[16] != b':' {
        return None;
    }
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&mo)
        || !(1..=days_in_month(y, mo)).contains(&d)
        || h > 23
        || mi > 59
        || sec > 60
    {
        return None;
    }
    let mut i = 19;
    let mut ms = 0i64;
    if b.get(i) == Some(&b'.') {
        let start = i + 1;
        i = start;
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        if i == start {
            return None;
        }
        let frac = &s[start..i.min(start + 3)];
        ms = frac.parse::<i64>().ok()? * 10i64.pow(3 - frac.len() as u32);
    }
    let offset_min = match b.get(i)? {
        b'Z' | b'z' if i + 1 == b.len() => 0,
        sign @ (b'+' | b'-') if i + 6 == b.len() && b[i + 3] == b':' => {
            let (oh, om) = (num(i + 1..i + 3)?, num(i + 4..i + 6)?);
            if oh > 23 || om > 59 {
                return None;
            }
            let m = oh * 60 + om;
            if *sign == b'+' { m } else { -m }
        }
        _ => return None,
    };
    let days = tidegate_lease::billing::days_from_civil(y, mo, d);
    let secs = days * 86_400 + h * 3600 + mi * 60 + sec - offset_min * 60;
    Some(u64::try_from(secs * 1000 + ms).map_err(|_| BeforeEpoch))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hub and an API state over it: no leasing, no config file, the
    /// admin token `s3cret` when `admin`.
    fn state(admin: bool) -> (ApiState, tokio_util::sync::CancellationToken) {
        let cancel = tokio_util::sync::CancellationToken::new();
        let tracker = tokio_util::task::TaskTracker::new();
        let metrics = Metrics::new();
        let hub = crate::hub::spawn(
            crate::scheduler::Settings::default(),
            None,
            metrics.clone(),
            cancel.clone(),
            &tracker,
        );
        let credentials = crate::auth::Credentials {
            admin_token_sha256: admin.then(|| crate::auth::hash_token("s3cret")),
            ..crate::auth::Credentials::default()
        };
        let access = Arc::new(Access::new(credentials));
        let reloader = Arc::new(Reloader::new(
            None,
            crate::config::Config::default_config(),
            access.clone(),
            None,
            metrics.clone(),
        ));
        let state = ApiState {
            hub,
            metrics,
            leasing: None,
            access,
            reloader,
        };
        (state, cancel)
    }

    /// `app` served on 127.0.0.1; its address and the server's task.
    async fn serve(app: Router) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        (addr, server)
    }

    /// An answer: status, headers (lower-case names) and body.
    #[derive(Debug)]
    struct Answer {
        status: u16,
        headers: Vec<(String, String)>,
        body: String,
    }

    impl Answer {
        fn header(&self, name: &str) -> Option<&str> {
            self.headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
        }

        /// The body of an error: `{"error": "<non-empty>"}` as JSON, and
        /// nothing else; its message.
        fn error_message(&self) -> String {
            assert_eq!(
                self.header("content-type"),
                Some("application/json"),
                "{self:?}"
            );
            let v: serde_json::Value = serde_json::from_str(&self.body)
                .unwrap_or_else(|e| panic!("not JSON ({e}): {self:?}"));
            let obj = v.as_object().unwrap_or_else(|| panic!("{self:?}"));
            assert_eq!(obj.len(), 1, "one field: {self:?}");
            let message = obj["error"].as_str().unwrap_or_else(|| panic!("{self:?}"));
            assert!(!message.trim().is_empty(), "{self:?}");
            message.to_string()
        }
    }

    /// `method route` on `addr` (HTTP/1.1, `Connection: close`), with
    /// `auth` as its `Authorization` header.
    async fn request(
        addr: std::net::SocketAddr,
        method: &str,
        route: &str,
        auth: Option<&str>,
    ) -> Answer {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let auth = auth.map_or(String::new(), |a| format!("Authorization: {a}\r\n"));
        let req = format!(
            "{method} {route} HTTP/1.1\r\nHost: gateway\r\n{auth}Content-Length: 0\r\nConnection: close\r\n\r\n"
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        tokio::time::timeout(std::time::Duration::from_secs(10), s.read_to_end(&mut raw))
            .await
            .expect("answered in time")
            .unwrap();
        let raw = String::from_utf8(raw).unwrap();
        let (head, body) = raw.split_once("\r\n\r\n").expect("a head and a body");
        let mut lines = head.split("\r\n");
        let status = lines
            .next()
            .and_then(|l| l.split(' ').nth(1))
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("no status line: {raw:?}"));
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let chunked = head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked");
        let body = if chunked {
            unchunk(body)
        } else {
            body.to_string()
        };
        Answer {
            status,
            headers,
            body,
        }
    }

    /// A chunked body's content.
    fn unchunk(mut body: &str) -> String {
        let mut out = String::new();
        for _ in 0..body.len() + 1 {
            let Some((size, rest)) = body.split_once("\r\n") else {
                break;
            };
            let size = usize::from_str_radix(size.trim(), 16).expect("chunk size");
            if size == 0 {
                break;
            }
            out.push_str(&rest[..size]);
            body = &rest[size + 2..];
        }
        out
    }

    #[tokio::test]
    async fn every_error_answers_json_with_its_status_and_the_probes_stay_text() {
        let (admin_state, cancel) = state(true);
        let (addr, server) = serve(router(admin_state.clone())).await;
        let token = Some("Bearer s3cret");
        let cases: Vec<(&str, &str, Option<&str>, u16, &str)> = vec![
            (
                "GET",
                "/api/v1/nothing",
                None,
                404,
                "no route /api/v1/nothing",
            ),
            ("GET", "/api/v2/frames", None, 404, "openapi.json"),
            ("GET", "/favicon.ico", None, 404, "no route"),
            ("GET", "/api/v1/reload", None, 405, "GET is not served"),
            (
                "DELETE",
                "/api/v1/frames",
                None,
                405,
                "DELETE is not served",
            ),
            ("POST", "/api/v1/reload", None, 401, "Authorization: Bearer"),
            (
                "POST",
                "/api/v1/reload",
                Some("Bearer wrong"),
                401,
                "wrong admin token",
            ),
            ("POST", "/api/v1/reload", token, 409, "without --config"),
            (
                "POST",
                "/api/v1/workers/nobody/drain",
                token,
                404,
                "no worker named \"nobody\"",
            ),
            (
                "POST",
                "/api/v1/leases/lease-3/release",
                token,
                400,
                "3, not lease-3",
            ),
            (
                "POST",
                "/api/v1/leases/3/release",
                token,
                404,
                "leasing is not configured",
            ),
            ("GET", "/api/v1/leases", None, 404, "[leasing]"),
            ("GET", "/api/v1/leases?limit=many", None, 400, "query"),
            ("GET", "/api/v1/costs?from=0", None, 404, "[leasing]"),
            ("GET", "/api/v1/costs.csv", None, 404, "[leasing]"),
        ];
        for (method, route, auth, status, says) in cases {
            let a = request(addr, method, route, auth).await;
            assert_eq!(a.status, status, "{method} {route}: {a:?}");
            let message = a.error_message();
            assert!(message.contains(says), "{method} {route}: {message}");
        }
        let a = request(addr, "POST", "/api/v1/reload", None).await;
        assert_eq!(a.header("www-authenticate"), Some("Bearer"));

        // the probes and the metrics are plain text
        for route in ["/healthz", "/readyz", "/metrics"] {
            let a = request(addr, "GET", route, None).await;
            let kind = a.header("content-type").unwrap_or_default();
            assert!(kind.starts_with("text/plain"), "{route}: {a:?}");
            assert!(!a.body.starts_with('{'), "{route}: {a:?}");
        }
        server.abort();

        // no admin token configured: every POST is refused, 403
        let (no_admin, stop) = state(false);
        let (addr, server) = serve(router(no_admin)).await;
        for route in [
            "/api/v1/reload",
            "/api/v1/workers/w/drain",
            "/api/v1/leases/1/release",
        ] {
            let a = request(addr, "POST", route, token).await;
            assert_eq!(a.status, 403, "{route}: {a:?}");
            assert!(a.error_message().contains("admin_token_sha256"));
        }
        server.abort();
        stop.cancel();

        // requests past the slots: 503, JSON, Retry-After
        let slots = Arc::new(tokio::sync::Semaphore::new(1));
        let (addr, server) = serve(router_with_slots(admin_state.clone(), slots.clone())).await;
        let taken = slots.clone().try_acquire_owned().unwrap();
        for route in ["/api/v1/frames", "/api/v1/status"] {
            let a = request(addr, "GET", route, None).await;
            assert_eq!(a.status, 503, "{a:?}");
            assert_eq!(a.header("retry-after"), Some("1"));
            assert!(a.error_message().contains("too many API requests"));
        }
        drop(taken);

        // a stopped hub: the snapshot routes say so, as JSON
        cancel.cancel();
        for _ in 0..200 {
            if admin_state.hub.snapshot().await.is_none() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        for route in [
            "/api/v1/frames",
            "/api/v1/edges",
            "/api/v1/cameras",
            "/api/v1/workers",
            "/api/v1/models",
            "/api/v1/timeline",
            "/api/v1/status",
        ] {
            let a = request(addr, "GET", route, None).await;
            assert_eq!(a.status, 503, "{route}: {a:?}");
            assert!(a.error_message().contains("shutting down"), "{route}");
        }
        server.abort();
    }

    /// `GET route` on `addr`; the head (lower-case) and the body's bytes.
    async fn get_bytes(addr: std::net::SocketAddr, route: &str) -> (String, Vec<u8>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let req = format!("GET {route} HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        tokio::time::timeout(std::time::Duration::from_secs(10), s.read_to_end(&mut raw))
            .await
            .expect("answered in time")
            .unwrap();
        let end = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("a head");
        let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
        (head, raw[end + 4..].to_vec())
    }

    #[tokio::test]
    async fn a_cameras_thumbnail_is_a_jpeg_when_on_and_a_json_404_saying_how_when_off() {
        use crate::hub::{HintBox, HubMsg};
        use crate::thumbnail::{ThumbnailConfig, render};
        let (state, cancel) = state(false);
        let (results, _answers) = tidegate_protocol::queue::channel(8, 1 << 20);
        let edge = crate::scheduler::EdgeId(4);
        let hub = &state.hub;
        hub.send(HubMsg::EdgeConnected {
            edge,
            name: "lobby".into(),
            weight: 1,
            results,
            hints: HintBox::new(),
        })
        .await;
        hub.send(HubMsg::CameraOpened {
            edge,
            camera: "front door".into(),
            model: "blazeface".into(),
            budget_ms: 80,
        })
        .await;
        let thumbnails = hub.thumbnails().clone();
        let (addr, server) = serve(router(state.clone())).await;
        let route = "/api/v1/cameras/lobby/front%20door/thumbnail.jpg";
        let off = request(addr, "GET", route, None).await;
        assert_eq!(off.status, 404, "{off:?}");
        let e = off.error_message();
        assert!(
            e.contains("[status]") && e.contains("thumbnails = true"),
            "{e}"
        );
        let status = request(addr, "GET", "/api/v1/status", None).await;
        let status: serde_json::Value = serde_json::from_str(&status.body).unwrap();
        assert!(status["thumbnails"].is_null(), "{status}");

        thumbnails.configure(Some(ThumbnailConfig {
            interval: std::time::Duration::from_secs(2),
            max_px: 48,
        }));
        let none = request(addr, "GET", route, None).await;
        assert_eq!(none.status, 404, "{none:?}");
        assert!(
            none.error_message()
                .contains("no thumbnail of camera \"front door\"")
        );
        let frame = tidegate_protocol::Tensor::raw(
            tidegate_protocol::DType::U8,
            tidegate_protocol::Layout::Nhwc,
            vec![1, 64, 64, 3],
            vec![90u8; 64 * 64 * 3].into(),
        );
        let geometry = tidegate_protocol::Geometry::letterbox(1280, 720, 64, 64);
        let ticket = thumbnails
            .begin("lobby", "front door", std::time::Instant::now())
            .unwrap();
        let jpeg = render(&frame, &geometry, &[], ticket.max_px);
        assert!(thumbnails.finish(ticket, jpeg).is_none());
        let (head, body) = get_bytes(addr, route).await;
        assert!(head.starts_with("http/1.1 200"), "{head}");
        assert!(head.contains("content-type: image/jpeg"), "{head}");
        assert!(head.contains("cache-control: no-store"), "{head}");
        let img = image::load_from_memory(&body).unwrap();
        assert_eq!((img.width(), img.height()), (48, 27));

        let status = request(addr, "GET", "/api/v1/status", None).await;
        let status: serde_json::Value = serde_json::from_str(&status.body).unwrap();
        assert_eq!(status["thumbnails"]["max_px"], 48, "{status}");
        assert_eq!(status["thumbnails"]["interval_ms"], 2000, "{status}");
        let n = status["cameras"][0]["thumbnail"]
            .as_u64()
            .expect("a number");
        let page = request(addr, "GET", "/", None).await;
        let url = format!("/api/v1/cameras/lobby/front%20door/thumbnail.jpg?n={n}");
        assert!(page.body.contains(&url), "the first paint shows it");
        server.abort();
        cancel.cancel();
    }

    #[tokio::test]
    async fn cameras_and_edges_name_the_edge_by_its_configured_name() {
        use crate::hub::{HintBox, HubMsg};
        let (state, cancel) = state(true);
        for (session, name, camera) in [(7, "lobby", "door"), (3, "yard", "gate")] {
            let (results, _answers) = tidegate_protocol::queue::channel(8, 1 << 20);
            state
                .hub
                .send(HubMsg::EdgeConnected {
                    edge: crate::scheduler::EdgeId(session),
                    name: name.into(),
                    weight: 1,
                    results,
                    hints: HintBox::new(),
                })
                .await;
            state
                .hub
                .send(HubMsg::CameraOpened {
                    edge: crate::scheduler::EdgeId(session),
                    camera: camera.into(),
                    model: "blazeface".into(),
                    budget_ms: 80,
                })
                .await;
        }
        let (addr, server) = serve(router(state)).await;
        let get = |route: &'static str| async move {
            let a = request(addr, "GET", route, None).await;
            assert_eq!(a.status, 200, "{a:?}");
            assert_eq!(a.header("content-type"), Some("application/json"));
            serde_json::from_str::<serde_json::Value>(&a.body).unwrap()
        };
        let cameras = get("/api/v1/cameras").await;
        let seen: Vec<(&str, u64, &str)> = cameras
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                (
                    c["edge"].as_str().expect("edge is the name"),
                    c["session"].as_u64().unwrap(),
                    c["camera"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(seen, vec![("lobby", 7, "door"), ("yard", 3, "gate")]);
        let edges = get("/api/v1/edges").await;
        assert_eq!(
            edges,
            serde_json::json!([{"edge": "yard", "session": 3}, {"edge": "lobby", "session": 7}])
        );
        // the status page's model names them the same way
        let status = get("/api/v1/status").await;
        let mut named: Vec<&str> = status["cameras"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["edge"].as_str().unwrap())
            .collect();
        named.sort_unstable();
        assert_eq!(named, vec!["lobby", "yard"]);
        server.abort();
        cancel.cancel();
    }

    /// Whether `s` is an instant as the API writes them:
    /// `YYYY-MM-DDTHH:MM:SS.mmmZ`, and a real one.
    fn is_api_instant(s: &str) -> bool {
        let b = s.as_bytes();
        let shape = b.len() == 24
            && b.iter().enumerate().all(|(i, c)| match i {
                4 | 7 => *c == b'-',
                10 => *c == b'T',
                13 | 16 => *c == b':',
                19 => *c == b'.',
                23 => *c == b'Z',
                _ => c.is_ascii_digit(),
            });
        shape && parse_time(s).is_ok()
    }

    /// Every `(key, value)` pair in `v`, at any depth, with its path.
    fn fields<'a>(
        v: &'a serde_json::Value,
        path: String,
        out: &mut Vec<(String, &'a serde_json::Value)>,
    ) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, x) in m {
                    let p = format!("{path}.{k}");
                    out.push((p.clone(), x));
                    fields(x, p, out);
                }
            }
            serde_json::Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    fields(x, format!("{path}[{i}]"), out);
                }
            }
            _ => {}
        }
    }

    /// One of each body with every instant set, as the API writes them.
    fn bodies_with_every_instant() -> Vec<(&'static str, serde_json::Value)> {
        use crate::timeline::{FrameCounts, Point, RecentWindow, Stall, TimelineView};
        use tidegate_lease::billing::Granularity;
        use tidegate_lease::{EndReason, LeaseId, LeaseState, Money, Tier};
        const NOW: u64 = 1_764_694_800_123;
        let frames = FrameCounts {
            admitted: 3,
            ok: 2,
            shed: 1,
            ..FrameCounts::default()
        };
        let timeline = TimelineView {
            now_ms: NOW,
            interval_ms: crate::timeline::INTERVAL_MS,
            points: vec![Point {
                start_ms: NOW - 5_000,
                frames,
                shed_ratio: frames.shed_ratio(),
                latency: crate::timeline::Percentiles::of(&mut [10.0, 20.0]),
            }],
            recent: RecentWindow {
                start_ms: NOW - 65_000,
                end_ms: NOW - 5_000,
                frames,
                ..RecentWindow::default()
            },
            stalls: vec![Stall {
                at_ms: NOW - 1_000,
                worker: "w-1".into(),
                reason: "batch 7 unanswered".into(),
            }],
        };
        let lease = |id, state| tidegate_lease::ledger::LeaseRecord {
            id: LeaseId(id),
            provider: "process".into(),
            model: Some("blazeface".into()),
            instance_type: "cpu".into(),
            tier: Tier::Spot,
            price_per_hour: Money::from_units(1.5),
            currency: "CNY".into(),
            granularity: Granularity::Hour,
            state,
            requested_at: NOW - 120_000,
            billing_start: Some(NOW - 110_000),
            ready_at: Some(NOW - 100_000),
            ended_at: matches!(state, LeaseState::Ended(_)).then_some(NOW - 1),
            last_seen_at: Some(NOW - 2_000),
            pid: Some(42),
            provider_data: None,
            cost: Money::from_units(1.5),
            frames_within_slo: 10,
            frames_late: 1,
            token_claimed: true,
            token: None,
        };
        let live = vec![lease(1, LeaseState::Ready)];
        let ended = lease(2, LeaseState::Ended(EndReason::Preempted));
        let mut costs = tidegate_lease::ledger::CostReport {
            from: NOW - 3_600_000,
            to: NOW,
            currency: Some("CNY".into()),
            total: Money::from_units(3.0),
            ..Default::default()
        };
        costs.by_tier.insert(Tier::Spot, Money::from_units(3.0));
        costs.by_type.insert("cpu".into(), Money::from_units(3.0));
        let share = tidegate_lease::showback::Share {
            cost: Money::from_units(3.0),
            frames_within_slo: 10,
            frames_late: 1,
            busy_seconds: 0.5,
            cost_per_1k_within_slo: Some(300.0),
        };
        costs.by_edge.insert("lobby".into(), share);
        costs.by_model.insert("blazeface".into(), share);
        let snap = crate::hub::Snapshot {
            timeline: timeline.clone(),
            ..Default::default()
        };
        let view = crate::status::LeasingView {
            live: &live,
            costs: &costs,
            recent: &costs,
            spend_cap_per_hour: Some(10.0),
        };
        let status = crate::status::build(&snap, Some(view), NOW);
        let v = |x: serde_json::Result<serde_json::Value>| x.unwrap();
        vec![
            ("status", v(serde_json::to_value(&status))),
            (
                "timeline",
                v(serde_json::to_value(json::Timeline::from(&timeline))),
            ),
            (
                "leases",
                v(serde_json::to_value(
                    [&live[0], &ended].map(json::Lease::from),
                )),
            ),
            ("costs", v(serde_json::to_value(json::Costs::from(&costs)))),
        ]
    }

    #[test]
    fn every_instant_is_rfc3339_utc_with_milliseconds_in_a_field_named_at() {
        for (body, value) in bodies_with_every_instant() {
            let mut all = Vec::new();
            fields(&value, body.to_string(), &mut all);
            let mut instants = 0;
            for (path, v) in &all {
                if path.ends_with("_at") {
                    if v.is_null() {
                        continue;
                    }
                    let s = v.as_str().unwrap_or_else(|| panic!("{path}: {v}"));
                    assert!(is_api_instant(s), "{path}: {s:?}");
                    instants += 1;
                } else if let Some(s) = v.as_str() {
                    assert!(
                        parse_time(s).is_err(),
                        "{path}: an instant not named *_at: {s:?}"
                    );
                }
                // no epoch milliseconds left behind under another name
                if let Some(n) = v.as_u64() {
                    assert!(
                        n < 1_000_000_000_000,
                        "{path}: {n} looks like ms since the epoch"
                    );
                }
            }
            assert!(instants >= 2, "{body}: the sample sets its instants");
        }
        // and the document says the same of every field
        let doc = serde_json::to_value(openapi()).unwrap();
        let schemas = doc["components"]["schemas"].as_object().unwrap();
        let instant = format!(
            "#/components/schemas/{}",
            <json::Timestamp as utoipa::ToSchema>::name()
        );
        assert_eq!(schemas["Timestamp"]["format"], "date-time");
        assert_eq!(schemas["Timestamp"]["pattern"], json::TIMESTAMP_PATTERN);
        let mut checked = 0;
        for (name, schema) in schemas {
            let Some(props) = schema["properties"].as_object() else {
                continue;
            };
            for (field, p) in props {
                let text = p.to_string();
                let is_instant = text.contains(&format!("\"{instant}\""));
                assert_eq!(
                    field.ends_with("_at"),
                    is_instant,
                    "{name}.{field}: an instant is a Timestamp named *_at ({text})"
                );
                checked += usize::from(is_instant);
            }
        }
        assert!(checked >= 10, "{checked}");
    }

    #[test]
    fn the_document_has_no_unlabelled_tuple() {
        let doc = openapi_json();
        assert!(!doc.contains("prefixItems"), "a tuple in the API");
        let doc: serde_json::Value = serde_json::from_str(doc).unwrap();
        let mut all = Vec::new();
        fields(&doc, String::new(), &mut all);
        for (path, v) in all {
            if path.ends_with(".items") {
                assert_ne!(v["type"], "array", "{path}: a list of lists");
            }
        }
        let worker = &doc["components"]["schemas"]["Worker"]["properties"]["profile"];
        assert_eq!(
            worker["items"]["$ref"], "#/components/schemas/ProfilePoint",
            "{worker}"
        );
    }

    /// Where the document is committed.
    fn committed_document() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/openapi.json")
    }

    #[test]
    fn the_committed_openapi_document_is_the_generated_one() {
        let path = committed_document();
        let generated = openapi_json();
        if std::env::var_os("TIDEGATE_WRITE_OPENAPI").is_some() {
            std::fs::write(&path, generated).unwrap();
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == generated,
            "{} differs from what the code generates; regenerate it with\n  \
             TIDEGATE_WRITE_OPENAPI=1 cargo test -p tidegate-gateway --lib \
             api::tests::the_committed_openapi_document_is_the_generated_one\n\
             and commit the change",
            path.display()
        );
        let doc: serde_json::Value = serde_json::from_str(generated).unwrap();
        assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    }

    #[tokio::test]
    async fn every_route_the_router_serves_is_in_the_document_and_answers() {
        let doc = serde_json::to_value(openapi()).unwrap();
        let paths = doc["paths"].as_object().unwrap();
        let mut operations = Vec::new();
        for (path, item) in paths {
            for method in ["get", "post", "put", "delete", "patch"] {
                if let Some(op) = item.get(method) {
                    operations.push((method.to_ascii_uppercase(), path.clone(), op.clone()));
                }
            }
        }
        // the router is built from the same annotations (`routes()`), and
        // serves what the brief and the docs list
        let served: std::collections::BTreeSet<(String, String)> = operations
            .iter()
            .map(|(m, p, _)| (m.clone(), p.clone()))
            .collect();
        for (method, path) in [
            ("GET", "/"),
            ("GET", "/metrics"),
            ("GET", "/healthz"),
            ("GET", "/readyz"),
            ("GET", "/api/v1/openapi.json"),
            ("GET", "/api/v1/frames"),
            ("GET", "/api/v1/edges"),
            ("GET", "/api/v1/cameras"),
            ("GET", "/api/v1/cameras/{edge}/{camera}/thumbnail.jpg"),
            ("GET", "/api/v1/workers"),
            ("GET", "/api/v1/models"),
            ("GET", "/api/v1/status"),
            ("GET", "/api/v1/timeline"),
            ("GET", "/api/v1/leases"),
            ("GET", "/api/v1/costs"),
            ("GET", "/api/v1/costs.csv"),
            ("POST", "/api/v1/workers/{name}/drain"),
            ("POST", "/api/v1/reload"),
            ("POST", "/api/v1/leases/{id}/release"),
        ] {
            assert!(
                served.contains(&(method.to_string(), path.to_string())),
                "{method} {path} is not in the document"
            );
        }
        let (state, cancel) = state(true);
        let (addr, server) = serve(router(state)).await;
        for (method, path, op) in &operations {
            let route = path
                .replace("{name}", "nobody")
                .replace("{id}", "1")
                .replace("{edge}", "e")
                .replace("{camera}", "c");
            let a = request(addr, method, &route, Some("Bearer s3cret")).await;
            // reached its handler: not the fallbacks
            assert_ne!(a.status, 405, "{method} {path}: {a:?}");
            assert!(
                !a.body.contains("\"no route "),
                "{method} {path} is documented but not served: {a:?}"
            );
            // its status is one the document lists for it
            let listed = op["responses"].as_object().unwrap();
            assert!(
                listed.contains_key(&a.status.to_string()),
                "{method} {path} answered {} which the document does not list: {a:?}",
                a.status
            );
            let security = op.get("security").is_some();
            assert_eq!(security, method == "POST", "{method} {path}");
            // an error's shape is the document's
            if a.status >= 400 && path.starts_with("/api/") {
                a.error_message();
            }
        }
        let served = request(addr, "GET", "/api/v1/openapi.json", None).await;
        assert_eq!(served.header("content-type"), Some("application/json"));
        assert_eq!(served.body, openapi_json());
        server.abort();
        cancel.cancel();
    }

    #[test]
    fn costs_render_as_csv_with_names_quoted_and_formulas_defused() {
        use tidegate_lease::Money;
        use tidegate_lease::showback::Share;
        let mut r = tidegate_lease::ledger::CostReport {
            currency: Some("CNY".into()),
            total: Money(31_500_001),
            idle: Money(1_500_000),
            frames_within_slo: 4000,
            frames_late: 3,
            cost_per_1k_within_slo: Some(7.875),
            ..Default::default()
        };
        let share = |micro, frames| Share {
            cost: Money(micro),
            frames_within_slo: frames,
            frames_late: 1,
            busy_seconds: 1.25,
            cost_per_1k_within_slo: Some(1.5),
        };
        r.by_edge
            .insert("lobby, east \"A\"".into(), share(20_000_001, 3000));
        r.by_edge.insert("=cmd()".into(), share(10_000_000, 1000));
        r.by_model
            .insert("blazeface".into(), share(30_000_001, 4000));
        let csv = render_costs_csv(&r);
        let lines: Vec<&str> = csv.split("\r\n").collect();
        assert_eq!(
            lines,
            vec![
                "split,name,cost,currency,frames_within_slo,frames_late,busy_seconds,cost_per_1k_within_slo",
                "edge,'=cmd(),10.000000,CNY,1000,1,1.250000,1.500000",
                "edge,\"lobby, east \"\"A\"\"\",20.000001,CNY,3000,1,1.250000,1.500000",
                "model,blazeface,30.000001,CNY,4000,1,1.250000,1.500000",
                "idle,,1.500000,CNY,,,,",
                "total,,31.500001,CNY,4000,3,,7.875000",
                "",
            ]
        );
    }

    #[tokio::test]
    async fn mutating_routes_need_the_admin_token() {
        let cancel = tokio_util::sync::CancellationToken::new();
        let tracker = tokio_util::task::TaskTracker::new();
        let metrics = Metrics::new();
        let hub = crate::hub::spawn(
            crate::scheduler::Settings::default(),
            None,
            metrics.clone(),
            cancel.clone(),
            &tracker,
        );
        let no_admin = crate::auth::Credentials::default();
        let access = Arc::new(Access::new(no_admin.clone()));
        let reloader = Arc::new(Reloader::new(
            None,
            crate::config::Config::default_config(),
            access.clone(),
            None,
            metrics.clone(),
        ));
        let state = ApiState {
            hub,
            metrics,
            leasing: None,
            access: access.clone(),
            reloader,
        };
        let with = |auth: Option<&str>| {
            let mut h = HeaderMap::new();
            if let Some(a) = auth {
                h.insert(header::AUTHORIZATION, a.parse().unwrap());
            }
            h
        };
        let status = |r: Option<Response>| r.map(|r| r.status());
        assert_eq!(
            status(refuse_unless_admin(&state, &with(Some("Bearer s3cret")))),
            Some(StatusCode::FORBIDDEN),
            "no admin token configured: nothing mutates"
        );
        access.replace(crate::auth::Credentials {
            admin_token_sha256: Some(crate::auth::hash_token("s3cret")),
            ..no_admin
        });
        let missing = refuse_unless_admin(&state, &with(None)).unwrap();
        assert_eq!(missing.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(missing.headers()[header::WWW_AUTHENTICATE], "Bearer");
        for wrong in [
            "Bearer s3creT",
            "Basic s3cret",
            "s3cret",
            "Bearer ",
            "Bearers3cret",
        ] {
            let refused = refuse_unless_admin(&state, &with(Some(wrong)));
            assert_eq!(status(refused), Some(StatusCode::UNAUTHORIZED), "{wrong}");
        }
        let wrong = refuse_unless_admin(&state, &with(Some("Bearer s3creT"))).unwrap();
        assert_eq!(
            wrong.headers()[header::WWW_AUTHENTICATE],
            "Bearer error=\"invalid_token\""
        );
        for right in ["Bearer s3cret", "bearer s3cret", "BEARER  s3cret "] {
            assert!(
                refuse_unless_admin(&state, &with(Some(right))).is_none(),
                "{right}"
            );
        }

        // Through the router on a real socket: every POST route refuses a
        // request without the token before it does anything.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = router(state.clone());
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let routes: Vec<&str> = [
            "/api/v1/workers/w/drain",
            "/api/v1/leases/1/release",
            "/api/v1/reload",
        ]
        .to_vec();
        for route in &routes {
            for auth in [None, Some("Bearer wrong")] {
                let code = post_status(addr, route, auth).await;
                assert_eq!(code, 401, "POST {route} with {auth:?}");
            }
        }
        // With the token each gets past the check (to its own answer).
        for route in &routes {
            let code = post_status(addr, route, Some("Bearer s3cret")).await;
            assert_ne!(code, 401, "POST {route} with the token");
        }
        server.abort();

        // Requests past the slots are answered 503 at once.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let slots = Arc::new(tokio::sync::Semaphore::new(1));
        let app = router_with_slots(state, slots.clone());
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let taken = slots.clone().try_acquire_owned().unwrap();
        assert_eq!(post_status(addr, "/api/v1/reload", None).await, 503);
        drop(taken);
        assert_eq!(post_status(addr, "/api/v1/reload", None).await, 401);
        server.abort();
        cancel.cancel();
    }

    /// The status code of `POST route` on `addr`, with `auth` as its
    /// `Authorization` header.
    async fn post_status(addr: std::net::SocketAddr, route: &str, auth: Option<&str>) -> u16 {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let auth = auth.map_or(String::new(), |a| format!("Authorization: {a}\r\n"));
        let req = format!(
            "POST {route} HTTP/1.1\r\nHost: gateway\r\n{auth}Content-Length: 0\r\nConnection: close\r\n\r\n"
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let mut answer = String::new();
        tokio::time::timeout(
            std::time::Duration::from_secs(10),
            s.read_to_string(&mut answer),
        )
        .await
        .expect("answered in time")
        .unwrap();
        answer
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("no status line: {answer:?}"))
    }

    #[test]
    fn the_spend_cap_is_read_back_without_creating_its_series() {
        let metrics = Metrics::new();
        assert_eq!(spend_cap(&metrics), None);
        let series = "\ntidegate_spend_cap_per_hour ";
        assert!(!metrics.render().contains(series), "no cap, no series");
        metrics.spend_cap.with_label_values::<&str>(&[]).set(20.5);
        assert_eq!(spend_cap(&metrics), Some(20.5));
        assert!(metrics.render().contains(series));
    }

    #[test]
    fn times_parse_as_epoch_ms_or_rfc3339() {
        assert_eq!(parse_time("1764694800000"), Ok(1_764_694_800_000));
        assert_eq!(parse_time("1970-01-01T00:00:00Z"), Ok(0));
        assert_eq!(parse_time("2025-12-02T17:00:00Z"), Ok(1_764_694_800_000));
        assert_eq!(parse_time("2025-12-02T17:00:00.25Z"), Ok(1_764_694_800_250));
        assert_eq!(
            parse_time("2025-12-03T01:00:00+08:00"),
            Ok(1_764_694_800_000)
        );
        assert_eq!(
            parse_time("2024-02-29T12:00:00-01:30"),
            Ok(1_709_213_400_000)
        );
        assert_eq!(parse_time(&i64::MAX.to_string()), Ok(i64::MAX as u64));
        for huge in [
            "9223372036854775808",
            "18446744073709551615",
            "99999999999999999999",
        ] {
            let e = parse_time(huge).unwrap_err();
            assert!(e.contains("too large"), "{huge}: {e}");
        }
        assert_eq!(parse_time("2000-02-29T00:00:00Z"), Ok(951_782_400_000));
        for bad in [
            "",
            "yesterday",
            "2025-13-01T00:00:00Z",
            "2025-12-02T17:00:00",
            "-5",
            "2025-02-31T00:00:00Z",
            "2025-02-29T00:00:00Z",
            "1900-02-29T00:00:00Z",
            "2025-04-31T00:00:00Z",
            "2025-12-02T17:00:00+24:00",
            "2025-12-02T17:00:00-01:60",
            "2025-12-02T17:00:00+99:99",
        ] {
            let e = parse_time(bad).unwrap_err();
            assert!(e.contains("RFC 3339"), "{bad}: {e}");
        }
        let e = parse_time("1969-12-31T23:59:59Z").unwrap_err();
        assert!(e.contains("before 1970"), "{e}");
    }

    proptest::proptest! {
        /// Query strings are untrusted: any text is a value or an error,
        /// never a panic.
        #[test]
        fn any_text_parses_or_is_refused(s in "\\PC{0,40}") {
            let _ = parse_time(&s);
        }

        /// Near-miss timestamps (digits, separators and zone characters
        /// in any order) never panic either.
        #[test]
        fn timestamp_shaped_text_never_panics(s in "[0-9T:.Zz+ -]{0,32}") {
            let _ = parse_time(&s);
        }

        /// A zone offset moves the instant by exactly that offset.
        #[test]
        fn an_offset_shifts_the_instant_by_itself(
            y in 1970i64..=9999, mo in 1i64..=12, d in 1i64..=28,
            h in 0i64..=23, mi in 0i64..=59, sec in 0i64..=59, ms in 0i64..=999,
            oh in 0i64..=14, om in 0i64..=59,
        ) {
            let local = format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{sec:02}.{ms:03}");
            let utc = parse_time(&format!("{local}Z")).expect("valid UTC time");
            let shift = ((oh * 60 + om) * 60_000) as u64;
            let east = parse_time(&format!("{local}+{oh:02}:{om:02}"));
            let west = parse_time(&format!("{local}-{oh:02}:{om:02}")).expect("west of UTC");
            proptest::prop_assert_eq!(west, utc + shift);
            if utc >= shift {
                proptest::prop_assert_eq!(east, Ok(utc - shift));
            } else {
                proptest::prop_assert!(east.is_err(), "before the epoch: {:?}", east);
            }
        }
    }
}
