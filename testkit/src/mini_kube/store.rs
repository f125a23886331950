//! The objects and their history: create, merge patch, delete (graceful
//! for a running pod), the garbage collector, one global resourceVersion
//! counter and the watch history, and the `Status` errors these answer
//! with. It speaks no HTTP ([`super::http`] does) and runs nothing
//! ([`super::kubelet`] does).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde_json::{Value, json};
use tokio::sync::watch;

use super::kubelet::{Kubelet, is_terminal, set_condition};
use super::{arr, b64_encode, new_uid, now_rfc3339, rfc3339, s};

/// Watch events kept for resuming watches.
const HISTORY: usize = 20_000;
/// Request lines kept for [`super::MiniKube::requests`].
const REQUEST_LOG: usize = 100_000;
/// `terminationGracePeriodSeconds` when the pod does not say.
const DEFAULT_GRACE_SECS: u64 = 30;
/// Metadata the server sets, dropped from a create.
const SERVER_OWNED: &[&str] = &[
    "resourceVersion",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "managedFields",
    "generation",
];
/// Pod spec fields this double does not implement: refused at create.
const UNSUPPORTED_SPEC: &[&str] = &[
    "initContainers",
    "ephemeralContainers",
    "volumes",
    "affinity",
    "nodeName",
];
/// Container fields refused the same way.
const UNSUPPORTED_CONTAINER: &[&str] = &["envFrom", "volumeMounts", "volumeDevices"];

/// The kinds of object served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) enum Kind {
    Pod,
    Secret,
}

impl Kind {
    pub(super) fn from_plural(plural: &str) -> Option<Kind> {
        match plural {
            "pods" => Some(Kind::Pod),
            "secrets" => Some(Kind::Secret),
            _ => None,
        }
    }

    pub(super) fn plural(self) -> &'static str {
        match self {
            Kind::Pod => "pods",
            Kind::Secret => "secrets",
        }
    }

    pub(super) fn name(self) -> &'static str {
        match self {
            Kind::Pod => "Pod",
            Kind::Secret => "Secret",
        }
    }
}

pub(super) type Key = (Kind, String, String);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum EventType {
    Added,
    Modified,
    Deleted,
}

/// One change, as the watch cache keeps it.
#[derive(Debug)]
pub(super) struct Event {
    pub(super) rv: u64,
    pub(super) kind: Kind,
    pub(super) ns: String,
    pub(super) etype: EventType,
    pub(super) object: Arc<Value>,
    /// The object before a change (for selector transitions).
    pub(super) prev: Option<Arc<Value>>,
}

/// What an injected fault does to a request.
#[derive(Clone, Copy, Debug)]
pub(super) enum Fault {
    /// Answer this HTTP status with the apiserver's `Status` body.
    Fail(u16),
    /// Take effect at once, answer after the delay.
    AnswerLate(Duration),
    /// Wait the delay, then take effect and answer (even if the client
    /// has gone).
    ActLate(Duration),
}

/// A fault for the next `remaining` requests of a method and path prefix.
#[derive(Debug)]
pub(super) struct Injection {
    pub(super) method: String,
    pub(super) prefix: String,
    pub(super) fault: Fault,
    pub(super) remaining: u32,
}

/// What the apiserver reads from `DeleteOptions`.
#[derive(Debug, Default, Clone)]
pub(super) struct DeleteOptions {
    pub(super) grace: Option<u64>,
    pub(super) uid: Option<String>,
}

#[derive(Debug, Default)]
pub(super) struct State {
    pub(super) rv: u64,
    pub(super) objects: BTreeMap<Key, Arc<Value>>,
    pub(super) history: VecDeque<Event>,
    /// Every event after this resourceVersion is in `history`.
    pub(super) floor: u64,
    pub(super) notify: watch::Sender<u64>,
    /// Pod uid → the resourceVersion that created it (scheduling order).
    pub(super) order: HashMap<String, u64>,
    pub(super) gpus: u32,
    pub(super) kubelet: HashMap<String, Kubelet>,
    pub(super) requests: VecDeque<String>,
    pub(super) faults: Vec<Injection>,
    /// Bumped by [`super::MiniKube::break_watches`]: older watches end.
    pub(super) watch_epoch: u64,
    pub(super) stopping: bool,
}

impl State {
    /// Logs a request; returns the fault injected for it, if any.
    pub(super) fn record(&mut self, method: &str, target: &str) -> Option<Fault> {
        if self.requests.len() >= REQUEST_LOG {
            self.requests.pop_front();
        }
        self.requests.push_back(format!("{method} {target}"));
        let f = self
            .faults
            .iter_mut()
            .find(|f| f.method == method && target.starts_with(&f.prefix))?;
        f.remaining -= 1;
        let fault = f.fault;
        self.faults.retain(|f| f.remaining > 0);
        Some(fault)
    }

    pub(super) fn get(&self, kind: Kind, ns: &str, name: &str) -> Option<Arc<Value>> {
        self.objects
            .get(&(kind, ns.to_string(), name.to_string()))
            .cloned()
    }

    /// Stores (or removes) an object under a new resourceVersion and
    /// records the event.
    fn commit(&mut self, key: &Key, mut obj: Value, etype: EventType) -> Arc<Value> {
        self.rv += 1;
        let rv = self.rv;
        obj["metadata"]["resourceVersion"] = Value::String(rv.to_string());
        let obj = Arc::new(obj);
        let prev = if etype == EventType::Deleted {
            self.objects.remove(key)
        } else {
            self.objects.insert(key.clone(), obj.clone())
        };
        self.history.push_back(Event {
            rv,
            kind: key.0,
            ns: key.1.clone(),
            etype,
            object: obj.clone(),
            prev,
        });
        while self.history.len() > HISTORY {
            if let Some(e) = self.history.pop_front() {
                self.floor = e.rv;
            }
        }
        self.notify.send_replace(rv);
        obj
    }

    /// Changes an object; a change that changes nothing is no write, as in
    /// the apiserver.
    pub(super) fn modify(&mut self, key: &Key, f: impl FnOnce(&mut Value)) -> Option<Arc<Value>> {
        let cur = self.objects.get(key)?.clone();
        let mut next = (*cur).clone();
        f(&mut next);
        if next == *cur {
            return Some(cur);
        }
        Some(self.commit(key, next, EventType::Modified))
    }

    pub(super) fn pod_key(&self, uid: &str) -> Option<Key> {
        self.objects
            .iter()
            .find(|(k, o)| k.0 == Kind::Pod && s(o, "/metadata/uid") == uid)
            .map(|(k, _)| k.clone())
    }

    /// POST: validates and defaults `body`, and stores it.
    pub(super) fn create(
        &mut self,
        kind: Kind,
        ns: &str,
        body: Value,
    ) -> Result<Arc<Value>, ApiError> {
        let mut obj = body;
        if !obj.is_object() || !obj["metadata"].is_object() && !obj["metadata"].is_null() {
            let k = kind.name();
            let why = "the body is not a JSON object with object metadata";
            let message = format!("{k} in version \"v1\" cannot be handled as a {k}: {why}");
            return Err(ApiError::bad_request(message));
        }
        let given_ns = s(&obj, "/metadata/namespace");
        if !given_ns.is_empty() && given_ns != ns {
            return Err(ApiError::bad_request(
                "the namespace of the provided object does not match the namespace sent on the \
                 request"
                    .into(),
            ));
        }
        let name = s(&obj, "/metadata/name").to_string();
        obj["metadata"]["namespace"] = Value::String(ns.to_string());
        let mut causes = validate_meta(&obj);
        match kind {
            Kind::Pod => causes.extend(prepare_pod(&mut obj)),
            Kind::Secret => default_secret(&mut obj),
        }
        if !causes.is_empty() {
            return Err(ApiError::invalid(kind, &name, &causes));
        }
        if self.get(kind, ns, &name).is_some() {
            return Err(ApiError::already_exists(kind, &name));
        }
        let meta = obj["metadata"].as_object_mut().expect("metadata");
        meta.retain(|k, _| !SERVER_OWNED.contains(&k.as_str()));
        let uid = new_uid();
        meta.insert("uid".into(), Value::String(uid.clone()));
        meta.insert("creationTimestamp".into(), Value::String(now_rfc3339()));
        let obj = self.commit(&(kind, ns.to_string(), name), obj, EventType::Added);
        if kind == Kind::Pod {
            self.order.insert(uid, self.rv);
        }
        Ok(obj)
    }

    /// PATCH of a secret with an RFC 7386 merge patch.
    pub(super) fn patch_secret(
        &mut self,
        ns: &str,
        name: &str,
        patch: &Value,
    ) -> Result<Arc<Value>, ApiError> {
        let key = (Kind::Secret, ns.to_string(), name.to_string());
        let old = self.get(Kind::Secret, ns, name);
        let old = old.ok_or_else(|| ApiError::not_found(Kind::Secret, name))?;
        let mut new = (*old).clone();
        merge_patch(&mut new, patch);
        if !new["metadata"].is_object() {
            return Err(ApiError::bad_request("metadata must be an object".into()));
        }
        for f in [
            "name",
            "namespace",
            "uid",
            "creationTimestamp",
            "resourceVersion",
        ] {
            new["metadata"][f] = old["metadata"][f].clone();
        }
        default_secret(&mut new);
        let causes = validate_meta(&new);
        if !causes.is_empty() {
            return Err(ApiError::invalid(Kind::Secret, name, &causes));
        }
        if new == *old {
            return Ok(old);
        }
        Ok(self.commit(&key, new, EventType::Modified))
    }

    /// DELETE: `(the object as answered, whether it is gone)`. A pod that a
    /// container runs for is only marked (`deletionTimestamp`); the kubelet
    /// removes it once its container has stopped.
    pub(super) fn delete(
        &mut self,
        kind: Kind,
        ns: &str,
        name: &str,
        opts: &DeleteOptions,
    ) -> Result<(Arc<Value>, bool), ApiError> {
        let key = (kind, ns.to_string(), name.to_string());
        let cur = self.get(kind, ns, name);
        let cur = cur.ok_or_else(|| ApiError::not_found(kind, name))?;
        let uid = s(&cur, "/metadata/uid");
        if let Some(want) = &opts.uid
            && want != uid
        {
            let why = format!(
                "Precondition failed: UID in precondition: {want}, UID in object meta: {uid}"
            );
            return Err(ApiError::conflict(kind, name, &why));
        }
        if kind != Kind::Pod {
            return Ok((self.remove(&key), true));
        }
        let grace = opts.grace.unwrap_or_else(|| {
            cur.pointer("/spec/terminationGracePeriodSeconds")
                .and_then(Value::as_u64)
                .unwrap_or(DEFAULT_GRACE_SECS)
        });
        // the apiserver deletes at once what no kubelet runs
        if grace == 0 || s(&cur, "/spec/nodeName").is_empty() || is_terminal(&cur) {
            return Ok((self.remove(&key), true));
        }
        let terminating = cur
            .pointer("/metadata/deletionGracePeriodSeconds")
            .and_then(Value::as_u64);
        if terminating.is_some_and(|current| grace >= current) {
            return Ok((cur, false));
        }
        let at = rfc3339(SystemTime::now() + Duration::from_secs(grace));
        let obj = self
            .modify(&key, |p| {
                p["metadata"]["deletionTimestamp"] = Value::String(at);
                p["metadata"]["deletionGracePeriodSeconds"] = json!(grace);
            })
            .expect("the pod");
        Ok((obj, false))
    }

    /// Removes an object (a `DELETED` event).
    pub(super) fn remove(&mut self, key: &Key) -> Arc<Value> {
        let cur = self.objects.get(key).cloned().expect("an object to remove");
        let obj = self.commit(key, (*cur).clone(), EventType::Deleted);
        if key.0 == Kind::Pod {
            self.order.remove(s(&obj, "/metadata/uid"));
        }
        obj
    }

    /// The garbage collector: deletes (in the background) every object none
    /// of whose owners exists any more.
    pub(super) fn collect_garbage(&mut self) {
        let doomed: Vec<Key> = self
            .objects
            .iter()
            .filter(|(key, o)| {
                let refs = arr(o, "/metadata/ownerReferences");
                !refs.is_empty()
                    && o.pointer("/metadata/deletionTimestamp").is_none()
                    && refs.iter().all(|r| !self.owner_exists(&key.1, r))
            })
            .map(|(k, _)| k.clone())
            .collect();
        for key in doomed {
            let _ = self.delete(key.0, &key.1, &key.2, &DeleteOptions::default());
        }
    }

    /// An owner of a kind this server does not serve is assumed to exist.
    fn owner_exists(&self, ns: &str, owner: &Value) -> bool {
        let kind = match (s(owner, "/apiVersion"), s(owner, "/kind")) {
            ("v1", "Pod") => Kind::Pod,
            ("v1", "Secret") => Kind::Secret,
            _ => return true,
        };
        self.get(kind, ns, s(owner, "/name"))
            .is_some_and(|o| s(&o, "/metadata/uid") == s(owner, "/uid"))
    }

    /// Adds the `DisruptionTarget` condition, as the component that takes
    /// the pod away does.
    pub(super) fn disrupt(&mut self, key: &Key, reason: &str) {
        let message = match reason {
            "DeletionByTaintManager" => "Taint manager: deleting due to NoExecute taint",
            "PreemptionByScheduler" => {
                "default-scheduler: preempting to accommodate a higher priority pod"
            }
            "EvictionByEvictionAPI" => "Eviction API: evicting",
            _ => "MiniKube: the test disrupted this pod",
        };
        self.modify(key, |p| {
            set_condition(p, "DisruptionTarget", "True", Some(reason), Some(message));
        });
    }
}

/// RFC 7386 JSON merge patch.
fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(p) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    let t = target.as_object_mut().expect("an object");
    for (k, v) in p {
        if v.is_null() {
            t.remove(k);
        } else {
            merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}

// ---------------------------------------------------------------------------
// Create-time defaulting and validation

/// Pod defaulting (the fields the kubelet and delete read), then
/// validation; the status a new pod starts with.
fn prepare_pod(pod: &mut Value) -> Vec<Cause> {
    if !pod["spec"].is_object() {
        pod["spec"] = json!({});
    }
    let spec = pod["spec"].as_object_mut().expect("spec");
    spec.entry("restartPolicy").or_insert(json!("Always"));
    spec.entry("terminationGracePeriodSeconds")
        .or_insert(json!(DEFAULT_GRACE_SECS));
    let mut errs = Vec::new();
    let spec = &pod["spec"];
    let policy = s(spec, "/restartPolicy");
    if policy != "Never" {
        let message = format!(
            "Unsupported value: {policy:?}: supported values: \"Never\" (the MiniKube test \
             double runs only restartPolicy Never; the API default is Always, so set it)"
        );
        errs.push((
            "FieldValueNotSupported",
            "spec.restartPolicy".into(),
            message,
        ));
    }
    for field in UNSUPPORTED_SPEC {
        if spec.get(field).is_some_and(|v| !v.is_null()) {
            errs.push(unsupported(&format!("spec.{field}")));
        }
    }
    let containers = arr(spec, "/containers");
    if containers.is_empty() {
        errs.push(required("spec.containers"));
    }
    for (i, c) in containers.iter().enumerate() {
        let f = format!("spec.containers[{i}]");
        for field in ["name", "image"] {
            if s(c, &format!("/{field}")).is_empty() {
                errs.push(required(&format!("{f}.{field}")));
            }
        }
        for field in UNSUPPORTED_CONTAINER {
            if c.get(field).is_some_and(|v| !v.is_null()) {
                errs.push(unsupported(&format!("{f}.{field}")));
            }
        }
        for (j, e) in arr(c, "/env").iter().enumerate() {
            let Some(from) = e.get("valueFrom") else {
                continue;
            };
            let required_secret = from
                .get("secretKeyRef")
                .is_some_and(|r| r.get("optional") != Some(&json!(true)));
            let supported = required_secret || s(from, "/fieldRef/fieldPath") == "metadata.name";
            if !supported {
                errs.push(unsupported(&format!(
                    "{f}.env[{j}].valueFrom (a required secretKeyRef and fieldRef metadata.name are)"
                )));
            }
        }
    }
    pod["status"] = json!({"phase": "Pending"});
    errs
}

/// `stringData` folded into `data`, and the default type.
fn default_secret(secret: &mut Value) {
    if let Some(Value::Object(string_data)) =
        secret.as_object_mut().and_then(|m| m.remove("stringData"))
    {
        if !secret["data"].is_object() {
            secret["data"] = json!({});
        }
        for (k, v) in string_data {
            secret["data"][k] = b64_encode(v.as_str().unwrap_or_default().as_bytes());
        }
    }
    if s(secret, "/type").is_empty() {
        secret["type"] = json!("Opaque");
    }
}

/// Any object's name is required; finalizers are refused.
fn validate_meta(obj: &Value) -> Vec<Cause> {
    let mut errs = Vec::new();
    if s(obj, "/metadata/name").is_empty() {
        errs.push(required("metadata.name"));
    }
    if !arr(obj, "/metadata/finalizers").is_empty() {
        errs.push(unsupported("metadata.finalizers"));
    }
    errs
}

// ---------------------------------------------------------------------------
// Errors: `Status` objects

/// One `details.causes` entry of an Invalid status: reason, field,
/// message.
pub(super) type Cause = (&'static str, String, String);

fn required(field: &str) -> Cause {
    ("FieldValueRequired", field.into(), "Required value".into())
}

fn unsupported(field: &str) -> Cause {
    let message = "Forbidden: not supported by the MiniKube test double".into();
    ("FieldValueForbidden", field.into(), message)
}

/// A failed request, answered with a `Status` object.
#[derive(Debug)]
pub(super) struct ApiError {
    pub(super) code: u16,
    pub(super) reason: &'static str,
    pub(super) message: String,
    pub(super) details: Option<Value>,
}

impl ApiError {
    pub(super) fn new(
        code: u16,
        reason: &'static str,
        message: String,
        details: Option<Value>,
    ) -> ApiError {
        ApiError {
            code,
            reason,
            message,
            details,
        }
    }

    /// An error about one object, `details` naming it.
    fn about(code: u16, reason: &'static str, kind: Kind, name: &str, message: String) -> ApiError {
        let details = json!({"name": name, "kind": kind.plural()});
        ApiError::new(code, reason, message, Some(details))
    }

    pub(super) fn not_found(kind: Kind, name: &str) -> ApiError {
        let message = format!("{} \"{name}\" not found", kind.plural());
        ApiError::about(404, "NotFound", kind, name, message)
    }

    fn already_exists(kind: Kind, name: &str) -> ApiError {
        let message = format!("{} \"{name}\" already exists", kind.plural());
        ApiError::about(409, "AlreadyExists", kind, name, message)
    }

    fn conflict(kind: Kind, name: &str, why: &str) -> ApiError {
        let message = format!(
            "Operation cannot be fulfilled on {} \"{name}\": {why}",
            kind.plural()
        );
        ApiError::about(409, "Conflict", kind, name, message)
    }

    fn invalid(kind: Kind, name: &str, causes: &[Cause]) -> ApiError {
        let list: Vec<String> = causes.iter().map(|c| format!("{}: {}", c.1, c.2)).collect();
        let detail = match list.as_slice() {
            [one] => one.clone(),
            _ => format!("[{}]", list.join(", ")),
        };
        let causes: Vec<Value> = causes
            .iter()
            .map(|c| json!({"reason": c.0, "field": c.1, "message": c.2}))
            .collect();
        let message = format!("{} \"{name}\" is invalid: {detail}", kind.name());
        let details = json!({"name": name, "kind": kind.name(), "causes": causes});
        ApiError::new(422, "Invalid", message, Some(details))
    }

    pub(super) fn bad_request(message: String) -> ApiError {
        ApiError::new(400, "BadRequest", message, None)
    }

    pub(super) fn status(&self) -> Value {
        let mut v = json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "code": self.code,
        });
        if !self.reason.is_empty() {
            v["reason"] = json!(self.reason);
        }
        if let Some(d) = &self.details {
            v["details"] = d.clone();
        }
        v
    }
}
