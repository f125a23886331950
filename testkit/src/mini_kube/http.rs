//! The apiserver's HTTP side: routes the calls the Kubernetes provider
//! makes to [`super::store`], answers lists and chunked watch streams
//! (label selectors, resume from a resourceVersion, bookmarks, 410 after
//! compaction),
//! and applies the faults a test injected. Any other route, verb or option
//! is refused with a `Status` that names it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Query, Request, State as AxState};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::Response;
use serde_json::{Value, json};
use tokio::sync::watch;

use super::store::{ApiError, DeleteOptions, Event, EventType, Fault, Kind};
use super::{NAMESPACE, Shared, s};

/// How often a watch that allows bookmarks gets one.
const BOOKMARK_EVERY: Duration = Duration::from_secs(60);
/// The apiserver's request body limit.
const MAX_BODY: usize = 3 * 1024 * 1024;
/// A watch's length when the client does not say (the apiserver picks
/// 30–60 minutes).
const DEFAULT_WATCH_SECS: u64 = 1800;
/// Query parameters for options this double does not implement.
const UNSUPPORTED_QUERY: &[&str] = &[
    "dryRun",
    "fieldSelector",
    "sendInitialEvents",
    "resourceVersionMatch",
    "continue",
    "gracePeriodSeconds",
    "propagationPolicy",
];

/// A request, read whole.
#[derive(Debug)]
struct Req {
    method: Method,
    path: String,
    query: HashMap<String, String>,
    content_type: String,
    body: Bytes,
}

impl ApiError {
    fn into_response(self) -> Response {
        let mut r = respond(self.code, &self.status());
        if matches!(self.code, 429 | 503) {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        r
    }

    /// A refusal of what this double does not implement.
    fn refused(code: u16, reason: &'static str, what: &str) -> ApiError {
        let message = format!("{what}: not implemented by the MiniKube test double");
        ApiError::new(code, reason, message, Some(json!({})))
    }
}

/// Every request: logged, faults applied, then routed.
pub(super) async fn handle(AxState(sh): AxState<Arc<Shared>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let path = parts.uri.path().to_string();
    let target = match parts.uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path.clone(),
    };
    let fault = sh.lock().record(parts.method.as_str(), &target);
    let query = match Query::<HashMap<String, String>>::try_from_uri(&parts.uri) {
        Ok(Query(q)) => q,
        Err(e) => return ApiError::bad_request(format!("invalid query: {e}")).into_response(),
    };
    if let Some(Fault::Fail(code)) = fault {
        return injected_error(code, &parts.method, &path, is_watch(&query)).into_response();
    }
    let header = |h| parts.headers.get(h).and_then(|v| v.to_str().ok());
    if header(header::ACCEPT).is_some_and(|a| a.contains("as=PartialObjectMetadata")) {
        let what = "PartialObjectMetadata (metadata-only answers)";
        return ApiError::refused(406, "NotAcceptable", what).into_response();
    }
    let content_type = header(header::CONTENT_TYPE).unwrap_or_default().to_string();
    let Ok(body) = axum::body::to_bytes(body, MAX_BODY).await else {
        let what = format!("a request body over {MAX_BODY} bytes");
        return ApiError::refused(413, "RequestEntityTooLarge", &what).into_response();
    };
    let req = Req {
        method: parts.method,
        path,
        query,
        content_type,
        body,
    };
    let answer =
        |sh: &Arc<Shared>, req: &Req| route(sh, req).unwrap_or_else(ApiError::into_response);
    match fault {
        Some(Fault::AnswerLate(delay)) => {
            let answer = answer(&sh, &req);
            tokio::time::sleep(delay).await;
            answer
        }
        // a task of its own: it takes effect even if the client has gone
        // and this handler is dropped
        Some(Fault::ActLate(delay)) => tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            answer(&sh, &req)
        })
        .await
        .unwrap_or_else(|e| {
            ApiError::new(500, "InternalError", e.to_string(), None).into_response()
        }),
        _ => answer(&sh, &req),
    }
}

fn route(sh: &Arc<Shared>, r: &Req) -> Result<Response, ApiError> {
    if let Some(q) = UNSUPPORTED_QUERY.iter().find(|q| r.query.contains_key(**q)) {
        return Err(ApiError::refused(
            400,
            "BadRequest",
            &format!("the {q} option"),
        ));
    }
    let segs: Vec<&str> = r.path.split('/').filter(|s| !s.is_empty()).collect();
    let kind = match segs.as_slice() {
        ["api", "v1", "namespaces", _, plural, ..] => Kind::from_plural(plural),
        _ => None,
    };
    let (Some(kind), ["api", "v1", "namespaces", ns, _, rest @ ..]) = (kind, segs.as_slice())
    else {
        let what = format!("{} (it serves namespaced pods and secrets)", r.path);
        return Err(ApiError::refused(404, "NotFound", &what));
    };
    match (rest, &r.method) {
        ([], &Method::GET) if is_watch(&r.query) => watch_collection(sh, r, kind, ns),
        ([], &Method::GET) => list(sh, r, kind, ns),
        ([], &Method::POST) => {
            let obj = sh.lock().create(kind, ns, parse_json(&r.body)?)?;
            Ok(respond(201, &obj))
        }
        ([name], &Method::GET) => {
            let obj = sh.lock().get(kind, ns, name);
            let obj = obj.ok_or_else(|| ApiError::not_found(kind, name))?;
            Ok(respond(200, &obj))
        }
        ([name], &Method::PATCH) if kind == Kind::Secret => {
            let media = r.content_type.split(';').next().unwrap_or_default().trim();
            if media != "application/merge-patch+json" {
                let what = format!("{media:?} patches (JSON merge patch is)");
                return Err(ApiError::refused(415, "UnsupportedMediaType", &what));
            }
            let obj = sh.lock().patch_secret(ns, name, &parse_json(&r.body)?)?;
            Ok(respond(200, &obj))
        }
        ([name], &Method::DELETE) => {
            let opts = delete_options(r)?;
            let (obj, removed) = sh.lock().delete(kind, ns, name, &opts)?;
            if kind == Kind::Pod || !removed {
                return Ok(respond(200, &obj));
            }
            let uid = s(&obj, "/metadata/uid");
            let details = json!({"name": name, "kind": kind.plural(), "uid": uid});
            let status = json!({
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                "details": details,
            });
            Ok(respond(200, &status))
        }
        ([] | [_], method) => {
            let what = format!(
                "{method} on {} (get, list, watch, create, delete and a secret's merge patch are)",
                r.path
            );
            Err(ApiError::refused(405, "MethodNotAllowed", &what))
        }
        _ => Err(ApiError::refused(
            404,
            "NotFound",
            &format!("the subresource {}", r.path),
        )),
    }
}

fn respond(code: u16, v: &Value) -> Response {
    let mut r = Response::new(Body::from(serde_json::to_vec(v).unwrap_or_default()));
    *r.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

fn is_watch(query: &HashMap<String, String>) -> bool {
    matches!(query.get("watch").map(String::as_str), Some("true" | "1"))
}

fn parse_json(body: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!("couldn't get version/kind; json parse error: {e}"))
    })
}

/// The grace period and uid precondition of a DELETE's body; any other
/// option there is refused.
fn delete_options(r: &Req) -> Result<DeleteOptions, ApiError> {
    let v = match r.body.is_empty() {
        true => json!({}),
        false => parse_json(&r.body)?,
    };
    let keys = |p: &str| {
        v.pointer(p)
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
    };
    let known = [
        "kind",
        "apiVersion",
        "gracePeriodSeconds",
        "preconditions",
        "uid",
    ];
    if let Some((k, _)) = keys("")
        .chain(keys("/preconditions"))
        .find(|(k, _)| !known.contains(&k.as_str()))
    {
        let what = format!("the DeleteOptions field {k}");
        return Err(ApiError::refused(400, "BadRequest", &what));
    }
    let grace = v.get("gracePeriodSeconds").and_then(Value::as_i64);
    Ok(DeleteOptions {
        // a negative grace period means 1 s
        grace: grace.map(|g| u64::try_from(g).unwrap_or(1)),
        uid: v
            .pointer("/preconditions/uid")
            .and_then(Value::as_str)
            .map(str::to_string),
    })
}

/// An object as a list item: no kind and apiVersion, as the apiserver
/// sends them.
fn strip_type(obj: &Value) -> Value {
    let mut o = obj.clone();
    if let Some(m) = o.as_object_mut() {
        m.remove("kind");
        m.remove("apiVersion");
    }
    o
}

/// A list: every match at once (`limit` is ignored, as the apiserver's
/// watch cache ignores it; no `continue` token is sent).
fn list(sh: &Arc<Shared>, r: &Req, kind: Kind, ns: &str) -> Result<Response, ApiError> {
    let filter = Filter::new(kind, ns, &r.query)?;
    let st = sh.lock();
    let items: Vec<Value> = st
        .objects
        .iter()
        .filter(|((k, ons, _), obj)| filter.accepts(*k, ons, obj))
        .map(|(_, obj)| strip_type(obj))
        .collect();
    Ok(respond(
        200,
        &json!({
            "kind": format!("{}List", kind.name()), "apiVersion": "v1",
            "metadata": {"resourceVersion": st.rv.to_string()}, "items": items,
        }),
    ))
}

// ---------------------------------------------------------------------------
// Selectors and watches

/// What a list or watch selects: a kind in a namespace, and equality label
/// requirements `(key, equal, value)`.
#[derive(Debug, Clone)]
struct Filter {
    kind: Kind,
    ns: String,
    labels: Vec<(String, bool, String)>,
}

impl Filter {
    fn new(kind: Kind, ns: &str, query: &HashMap<String, String>) -> Result<Filter, ApiError> {
        let selector = query.get("labelSelector").map_or("", String::as_str);
        let mut labels = Vec::new();
        for t in selector.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let refused = || {
                let what = format!("the set-based requirement {t:?} (equality ones are)");
                ApiError::refused(400, "BadRequest", &what)
            };
            let (k, equal, v) = match t.split_once("!=") {
                Some((k, v)) => (k, false, v),
                None => t
                    .split_once("==")
                    .or_else(|| t.split_once('='))
                    .map(|(k, v)| (k, true, v))
                    .ok_or_else(refused)?,
            };
            labels.push((k.trim().to_string(), equal, v.trim().to_string()));
        }
        Ok(Filter {
            kind,
            ns: ns.to_string(),
            labels,
        })
    }

    fn accepts(&self, kind: Kind, ns: &str, obj: &Value) -> bool {
        kind == self.kind && ns == self.ns && self.matches(obj)
    }

    fn matches(&self, obj: &Value) -> bool {
        let labels = obj.pointer("/metadata/labels");
        self.labels.iter().all(|(k, equal, v)| {
            let got = labels.and_then(|l| l.get(k)).and_then(Value::as_str);
            (got == Some(v.as_str())) == *equal
        })
    }

    /// The watch event a change is for this watcher, if any: an object that
    /// stops matching is DELETED for it, one that starts matching ADDED.
    fn render(&self, e: &Event) -> Option<Bytes> {
        if e.kind != self.kind || e.ns != self.ns {
            return None;
        }
        let now = self.matches(&e.object);
        match e.etype {
            EventType::Added => now.then(|| watch_line("ADDED", &e.object)),
            EventType::Deleted => now.then(|| watch_line("DELETED", &e.object)),
            EventType::Modified => {
                let before = e.prev.as_ref().is_some_and(|p| self.matches(p));
                match (before, now, &e.prev) {
                    (true, true, _) => Some(watch_line("MODIFIED", &e.object)),
                    (false, true, _) => Some(watch_line("ADDED", &e.object)),
                    (true, false, Some(prev)) => {
                        let mut gone = (**prev).clone();
                        gone["metadata"]["resourceVersion"] = Value::String(e.rv.to_string());
                        Some(watch_line("DELETED", &gone))
                    }
                    _ => None,
                }
            }
        }
    }
}

fn watch_line(etype: &str, object: &Value) -> Bytes {
    let mut line =
        serde_json::to_vec(&json!({"type": etype, "object": object})).unwrap_or_default();
    line.push(b'\n');
    Bytes::from(line)
}

fn bookmark(kind: Kind, rv: u64) -> Bytes {
    let object = json!({
        "kind": kind.name(), "apiVersion": "v1",
        "metadata": {"resourceVersion": rv.to_string()},
    });
    watch_line("BOOKMARK", &object)
}

fn expired(rv: u64, oldest: u64) -> Bytes {
    let message = format!("too old resource version: {rv} ({oldest})");
    watch_line(
        "ERROR",
        &ApiError::new(410, "Expired", message, None).status(),
    )
}

/// One watch's position in the event history.
struct Cursor {
    shared: Arc<Shared>,
    changes: watch::Receiver<u64>,
    filter: Filter,
    last: u64,
    queue: VecDeque<Bytes>,
    /// The `watch_epoch` it started in.
    epoch: u64,
    /// [`super::MiniKube::break_watches`] ended it.
    broken: bool,
    deadline: tokio::time::Instant,
    bookmarks: bool,
    next_bookmark: tokio::time::Instant,
    done: bool,
}

impl Cursor {
    /// Queues every event after `last` that this watch selects.
    fn drain(&mut self) {
        let st = self.shared.lock();
        if self.last < st.floor {
            self.queue.push_back(expired(self.last, st.floor + 1));
            self.done = true;
            return;
        }
        let start = st.history.partition_point(|e| e.rv <= self.last);
        for e in st.history.range(start..) {
            if let Some(line) = self.filter.render(e) {
                self.queue.push_back(line);
            }
        }
        self.last = self.last.max(st.rv);
    }
}

async fn next_chunk(mut c: Cursor) -> Option<(Result<Bytes, std::io::Error>, Cursor)> {
    loop {
        if c.broken {
            return None;
        }
        if c.shared.lock().watch_epoch != c.epoch {
            // dropped mid-stream, with any events in flight
            c.broken = true;
            let gone = std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "MiniKube::break_watches: the API server went away",
            );
            return Some((Err(gone), c));
        }
        if let Some(b) = c.queue.pop_front() {
            return Some((Ok(b), c));
        }
        if c.done {
            return None;
        }
        c.drain();
        if !c.queue.is_empty() || c.done {
            continue;
        }
        let (deadline, next_bookmark) = (c.deadline, c.next_bookmark);
        tokio::select! {
            changed = c.changes.changed() => c.done = changed.is_err(),
            () = tokio::time::sleep_until(deadline) => c.done = true,
            () = tokio::time::sleep_until(next_bookmark), if c.bookmarks => {
                c.queue.push_back(bookmark(c.filter.kind, c.last));
                c.next_bookmark = (tokio::time::Instant::now() + BOOKMARK_EVERY).min(c.deadline);
            }
        }
    }
}

/// A chunked watch stream: with no `resourceVersion` (or `0`) the current
/// objects as `ADDED` first, then every change after it; from an expired
/// one, a 410 `ERROR` event.
fn watch_collection(sh: &Arc<Shared>, r: &Req, kind: Kind, ns: &str) -> Result<Response, ApiError> {
    let filter = Filter::new(kind, ns, &r.query)?;
    let timeout = match r.query.get("timeoutSeconds") {
        Some(t) => t
            .parse::<u64>()
            .map_err(|_| ApiError::bad_request(format!("timeoutSeconds: invalid value {t:?}")))?,
        None => DEFAULT_WATCH_SECS,
    };
    let bookmarks = r
        .query
        .get("allowWatchBookmarks")
        .is_some_and(|v| v == "true" || v == "1");
    let rv = r.query.get("resourceVersion").map_or("", String::as_str);
    let mut queue = VecDeque::new();
    let mut done = false;
    let st = sh.lock();
    let last = if rv.is_empty() || rv == "0" {
        for ((k, ons, _), obj) in &st.objects {
            if filter.accepts(*k, ons, obj) {
                queue.push_back(watch_line("ADDED", obj));
            }
        }
        st.rv
    } else {
        let n: u64 = rv.parse().map_err(|_| {
            ApiError::bad_request(format!(
                "resourceVersion: Invalid value: {rv:?}: must be an integer"
            ))
        })?;
        if n < st.floor {
            queue.push_back(expired(n, st.floor + 1));
            done = true;
        }
        n
    };
    let changes = st.notify.subscribe();
    let epoch = st.watch_epoch;
    drop(st);
    let now = tokio::time::Instant::now();
    let deadline = now + Duration::from_secs(timeout);
    let before_end = deadline
        .checked_sub(Duration::from_secs(1))
        .unwrap_or(deadline);
    let cursor = Cursor {
        shared: sh.clone(),
        changes,
        filter,
        last,
        queue,
        deadline,
        bookmarks,
        next_bookmark: (now + BOOKMARK_EVERY).min(before_end),
        done,
        epoch,
        broken: false,
    };
    let stream = futures::stream::unfold(cursor, next_chunk);
    let mut response = Response::new(Body::from_stream(stream));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Ok(response)
}

// ---------------------------------------------------------------------------
// Injected faults

/// The error `fail_next` injects for an HTTP status, with the apiserver's
/// reason (and, for 403, RBAC's message).
fn injected_error(code: u16, method: &Method, path: &str, watch: bool) -> ApiError {
    let reason = match code {
        403 => "Forbidden",
        404 => "NotFound",
        409 => "Conflict",
        429 => "TooManyRequests",
        500 => "InternalError",
        503 => "ServiceUnavailable",
        _ => "",
    };
    let message = match code {
        403 => forbidden_message(method, path, watch),
        _ => format!("{reason} (HTTP {code}, injected by MiniKube::fail_next)"),
    };
    ApiError::new(code, reason, message, Some(json!({})))
}

/// RBAC's denial message for a request.
fn forbidden_message(method: &Method, path: &str, watch: bool) -> String {
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let (ns, plural, name) = match segs.as_slice() {
        ["api", "v1", "namespaces", ns, plural, rest @ ..] => (*ns, *plural, rest.first()),
        _ => ("", "", None),
    };
    let verb = match (method.as_str(), name) {
        ("GET", Some(_)) => "get",
        ("GET", None) if watch => "watch",
        ("GET", None) => "list",
        ("POST", _) => "create",
        ("PATCH", _) => "patch",
        ("DELETE", _) => "delete",
        _ => "get",
    };
    let subject = match name {
        Some(n) => format!("{plural} \"{n}\" is forbidden"),
        None => format!("{plural} is forbidden"),
    };
    format!(
        "{subject}: User \"system:serviceaccount:{NAMESPACE}:default\" cannot {verb} resource \
         \"{plural}\" in API group \"\" in the namespace \"{ns}\""
    )
}
