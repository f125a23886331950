//! The operator HTTP API, on its own listener (separate from QUIC):
//! `/metrics`, `/healthz`, `/readyz`, JSON under `/api/v1/`, and the status
//! page at `/`. The mutating routes (`POST`) need the admin token.

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};

use serde::Deserialize;

use tidegate_lease::LeaseId;

use std::sync::Arc;

use crate::auth::{Access, token_matches};
use crate::hub::Hub;
use crate::leasing::{Leasing, MAX_LEASES_LISTED, ReleaseRefused};
use crate::metrics::Metrics;
use crate::reload::{ReloadError, Reloader};

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

/// Answers `503 Service Unavailable` (with `Retry-After: 1`) to a request
/// that finds [`MAX_CONCURRENT_REQUESTS`] under way.
async fn limit_concurrency(
    State(slots): State<Arc<tokio::sync::Semaphore>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match slots.try_acquire() {
        Ok(_slot) => next.run(request).await,
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::RETRY_AFTER, "1")],
            "too many API requests under way; try again\n",
        )
            .into_response(),
    }
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
    Router::new()
        .route("/", get(status_page))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/api/v1/frames", get(frames))
        .route("/api/v1/edges", get(edges))
        .route("/api/v1/cameras", get(cameras))
        .route("/api/v1/workers", get(workers))
        .route("/api/v1/models", get(models))
        .route("/api/v1/status", get(status_json))
        .route("/api/v1/timeline", get(timeline))
        .route("/api/v1/leases", get(leases))
        .route("/api/v1/costs", get(costs))
        .route("/api/v1/costs.csv", get(costs_csv))
        .route("/api/v1/workers/{name}/drain", post(drain_worker))
        .route("/api/v1/leases/{id}/release", post(release_lease))
        .route("/api/v1/reload", post(reload))
        .with_state(state)
        .layer(axum::middleware::from_fn_with_state(
            slots,
            limit_concurrency,
        ))
}

async fn metrics(State(s): State<ApiState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
        .into_response()
}

/// The refusal of a mutating route, unless the request carries
/// `Authorization: Bearer <admin token>`.
/// The token of an `Authorization: Bearer <token>` value; the scheme's
/// name is case-insensitive (RFC 7235 §2.1).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
        .filter(|t| !t.is_empty())
}

fn refuse_unless_admin(s: &ApiState, headers: &HeaderMap) -> Option<Response> {
    let Some(digest) = s.access.admin_token_sha256() else {
        return Some((
            StatusCode::FORBIDDEN,
            "mutating routes are disabled: set http.admin_token_sha256 (tidegate-gateway hash-token <TOKEN>)\n",
        )
            .into_response(),
        );
    };
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token);
    match token {
        Some(t) if token_matches(t, &digest) => None,
        Some(_) => Some(
            (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer error=\"invalid_token\"")],
                "wrong admin token\n",
            )
                .into_response(),
        ),
        None => Some(
            (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer")],
                "this route needs Authorization: Bearer <admin token>\n",
            )
                .into_response(),
        ),
    }
}

/// `POST /api/v1/workers/{name}/drain`: no new batch goes to the workers
/// registered as `name`, and they are told to finish theirs and exit.
async fn drain_worker(
    State(s): State<ApiState>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Some(refused) = refuse_unless_admin(&s, &headers) {
        return refused;
    }
    match s.hub.drain_worker(&name).await {
        Some(0) => (
            StatusCode::NOT_FOUND,
            format!("no worker named {name:?} is registered\n"),
        )
            .into_response(),
        Some(n) => (
            StatusCode::ACCEPTED,
            Json(serde_json::json!({ "worker": name, "draining": n })),
        )
            .into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, "shutting down\n").into_response(),
    }
}

/// `POST /api/v1/reload`: reads the config file again and applies its
/// credentials; `400` with the reason when the file is unusable (nothing
/// changes then).
async fn reload(State(s): State<ApiState>, headers: HeaderMap) -> Response {
    if let Some(refused) = refuse_unless_admin(&s, &headers) {
        return refused;
    }
    let reloader = s.reloader.clone();
    match tokio::task::spawn_blocking(move || reloader.reload()).await {
        Ok(Ok(report)) => {
            tracing::info!(?report, "configuration reloaded (API)");
            Json(report).into_response()
        }
        Ok(Err(e @ ReloadError::NoFile)) => (
            StatusCode::CONFLICT,
            Json(serde_json::json!({ "error": e.to_string() })),
        )
            .into_response(),
        Ok(Err(e)) => {
            tracing::warn!("configuration reload refused: {e}");
            (
                StatusCode::BAD_REQUEST,
                Json(serde_json::json!({ "error": e.to_string() })),
            )
                .into_response()
        }
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the reload task failed: {e}\n"),
        )
            .into_response(),
    }
}

/// `POST /api/v1/leases/{id}/release`: releases the lease now.
async fn release_lease(
    State(s): State<ApiState>,
    Path(id): Path<u64>,
    headers: HeaderMap,
) -> Response {
    if let Some(refused) = refuse_unless_admin(&s, &headers) {
        return refused;
    }
    let Some(l) = &s.leasing else {
        return no_leasing();
    };
    match l.release(LeaseId(id)).await {
        Ok(()) => (
            StatusCode::ACCEPTED,
            Json(serde_json::json!({ "lease": id, "state": "draining" })),
        )
            .into_response(),
        Err(e @ ReleaseRefused::Unknown(_)) => {
            (StatusCode::NOT_FOUND, format!("{e}\n")).into_response()
        }
        Err(e @ ReleaseRefused::Stopped) => {
            (StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n")).into_response()
        }
        Err(e) => (StatusCode::CONFLICT, format!("{e}\n")).into_response(),
    }
}

/// The status page's model (`status.rs`) as of now: the hub's snapshot,
/// and with `[leasing]` the ledger's live leases and costs.
async fn status_model(s: &ApiState) -> Result<crate::status::StatusModel, Response> {
    let Some(snap) = s.hub.snapshot().await else {
        return Err((StatusCode::SERVICE_UNAVAILABLE, "shutting down\n").into_response());
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
    Ok(crate::status::build(&snap, view, now))
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

/// The status page (`status.rs`): the model as of now, and the script that
/// keeps it current from `/api/v1/status`.
async fn status_page(State(s): State<ApiState>) -> Response {
    match status_model(&s).await {
        Ok(m) => Html(crate::status::page(&m)).into_response(),
        Err(answer) => answer,
    }
}

/// `GET /api/v1/status`: what the status page shows, as JSON.
async fn status_json(State(s): State<ApiState>) -> Response {
    match status_model(&s).await {
        Ok(m) => Json(m).into_response(),
        Err(answer) => answer,
    }
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
snapshot_route!(timeline, timeline);

fn no_leasing() -> Response {
    (
        StatusCode::NOT_FOUND,
        "leasing is not configured: add a [leasing] section to the gateway config\n",
    )
        .into_response()
}

fn internal(e: String) -> Response {
    (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response()
}

fn bad_request(e: String) -> Response {
    (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response()
}

/// `?live=true&limit=N`.
#[derive(Debug, Deserialize)]
struct LeasesQuery {
    #[serde(default)]
    live: Option<String>,
    #[serde(default)]
    limit: Option<u32>,
}

/// The ledger's leases, newest first.
async fn leases(State(s): State<ApiState>, Query(q): Query<LeasesQuery>) -> Response {
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
        Ok(v) => Json(v).into_response(),
        Err(e) => internal(e),
    }
}

/// `?from=&to=`: ms since the Unix epoch or RFC 3339.
#[derive(Debug, Deserialize)]
struct CostsQuery {
    #[serde(default)]
    from: Option<String>,
    #[serde(default)]
    to: Option<String>,
}

/// Cost charged in `[from, to)` (default: everything until now).
async fn costs(State(s): State<ApiState>, Query(q): Query<CostsQuery>) -> Response {
    match cost_report(&s, &q).await {
        Ok(r) => Json(r).into_response(),
        Err(answer) => answer,
    }
}

/// The same as CSV, one row per edge, model, idle and the total: for a
/// spreadsheet or a finance import.
async fn costs_csv(State(s): State<ApiState>, Query(q): Query<CostsQuery>) -> Response {
    match cost_report(&s, &q).await {
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
    q: &CostsQuery,
) -> Result<tidegate_lease::ledger::CostReport, Response> {
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
        return Err(bad_request(format!("to ({to}) is before from ({from})")));
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
            crate::scheduler::Limits::default(),
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
