//! The MiniKube test double (`testkit/src/mini_kube.rs`) driven through the
//! real kube client and `kube::runtime::watcher`, as the Kubernetes lease
//! provider drives it: create, list, watch, get and delete pods and
//! secrets, merge-patch secrets, evict and kill pods, and check that it
//! answers as the apiserver and kubelet do, and refuses what it does not
//! implement.
//! Shell scripts stand in for `tidegate-worker`. Waits are bounded by a
//! guard that only protects against a hang; no test asserts how fast
//! anything happens.

use std::fmt::Debug;
use std::path::Path;
use std::pin::Pin;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{ContainerStateTerminated, Pod, PodCondition, Secret};
use kube::api::{
    Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions, WatchEvent,
    WatchParams,
};
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tidegate_testkit::mini_kube::{MiniKube, NAMESPACE};

const GUARD: Duration = Duration::from_secs(30);

/// The stand-in worker: on SIGTERM it records that it drained and exits 0;
/// it writes `$TOKEN` to a file once it is up.
const WORKER: &str = r#"trap 'echo term > "$OUT/term"; exit 0' TERM
echo "worker up"
printf '%s\n' "$TOKEN" > "$OUT/token.tmp" && mv "$OUT/token.tmp" "$OUT/token"
while :; do sleep 0.1; done"#;

/// Waits, and exits 0 on SIGTERM.
const IDLE: &str = "trap 'exit 0' TERM; while :; do sleep 0.1; done";

type Events<K> = Pin<Box<dyn Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send>>;

fn client(kube: &MiniKube) -> Client {
    Client::try_from(kube.client_config()).expect("a kube client")
}

fn typed<T: DeserializeOwned>(v: Value) -> T {
    serde_json::from_value(v).expect("a well-formed object")
}

/// A pod running `script` with `OUT` set to `out` and `gpus` GPUs.
fn worker(name: &str, script: &str, out: &Path, gpus: u32) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "tidegate-worker"}},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 10,
            "containers": [{
                "name": "worker",
                "image": "local/sh",
                "command": ["sh", "-c", script],
                "env": [{"name": "OUT", "value": out.display().to_string()}],
                "resources": {"limits": {"nvidia.com/gpu": gpus.to_string()}},
            }],
        },
    })
}

fn secret(name: &str, token: &str) -> Secret {
    typed(json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name},
        "stringData": {"token": token},
    }))
}

fn with_token_from(mut pod: Value, secret: &str) -> Value {
    pod["spec"]["containers"][0]["env"]
        .as_array_mut()
        .expect("env")
        .push(json!({
            "name": "TOKEN",
            "valueFrom": {"secretKeyRef": {"name": secret, "key": "token"}},
        }));
    pod
}

/// kube's watcher on one object (the double has no field selectors: the
/// others' events are left out here).
fn events<K>(api: &Api<K>, name: &str) -> Events<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let name = name.to_string();
    watcher(api.clone(), watcher::Config::default())
        .filter(move |e| {
            let other = match e {
                Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o))
                | Ok(watcher::Event::Delete(o)) => o.name_any() != name,
                _ => false,
            };
            std::future::ready(!other)
        })
        .boxed()
}

/// kube's watcher on one object, once it has listed: what changes after
/// this returns is seen as a change (a watcher lists lazily, on its first
/// poll, and an object deleted before that is never seen at all).
async fn listed<K>(kube: &MiniKube, api: &Api<K>, name: &str) -> Events<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let mut events = events(api, name);
    let what = format!("the initial list of {name}");
    until(kube, &mut events, &what, |e| {
        matches!(e, watcher::Event::InitDone)
    })
    .await;
    events
}

/// Reads events until one satisfies `done`, and returns it. The watcher's
/// errors are skipped (it retries them itself) and reported on a timeout.
async fn until<K: Debug>(
    kube: &MiniKube,
    events: &mut Events<K>,
    what: &str,
    mut done: impl FnMut(&watcher::Event<K>) -> bool,
) -> watcher::Event<K> {
    let deadline = tokio::time::Instant::now() + GUARD;
    let mut errors = Vec::new();
    loop {
        match tokio::time::timeout_at(deadline, events.next()).await {
            Ok(Some(Ok(event))) => {
                if done(&event) {
                    return event;
                }
            }
            Ok(Some(Err(e))) => errors.push(e.to_string()),
            Ok(None) => panic!("the watch ended waiting for {what}\n{}", report(kube)),
            Err(_) => panic!(
                "timed out waiting for {what}; watcher errors: {errors:?}\n{}",
                report(kube)
            ),
        }
    }
}

fn report(kube: &MiniKube) -> String {
    let requests = kube.requests();
    let recent = requests[requests.len().saturating_sub(30)..].join("\n");
    let pods: Vec<String> = kube
        .pods(NAMESPACE)
        .iter()
        .map(|p| format!("{} {}", p["metadata"]["name"], p["status"]))
        .collect();
    format!(
        "last requests:\n{recent}\npods:\n{}\ncontainer logs:\n{}",
        pods.join("\n"),
        kube.logs()
    )
}

fn applied<K>(event: &watcher::Event<K>) -> Option<&K> {
    match event {
        watcher::Event::Apply(o) | watcher::Event::InitApply(o) => Some(o),
        _ => None,
    }
}

fn deleted<K>(event: &watcher::Event<K>) -> Option<&K> {
    match event {
        watcher::Event::Delete(o) => Some(o),
        _ => None,
    }
}

fn phase(p: &Pod) -> &str {
    p.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or_default()
}

fn condition<'a>(p: &'a Pod, kind: &str) -> Option<&'a PodCondition> {
    p.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == kind)
}

fn waiting(p: &Pod) -> Option<(&str, &str)> {
    let state = p
        .status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .first()?
        .state
        .as_ref()?;
    let w = state.waiting.as_ref()?;
    Some((
        w.reason.as_deref()?,
        w.message.as_deref().unwrap_or_default(),
    ))
}

fn terminated(p: &Pod) -> Option<&ContainerStateTerminated> {
    let state = p
        .status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .first()?
        .state
        .as_ref()?;
    state.terminated.as_ref()
}

fn running(event: &watcher::Event<Pod>) -> bool {
    applied(event).is_some_and(|p| phase(p) == "Running")
}

fn unschedulable(event: &watcher::Event<Pod>) -> bool {
    applied(event)
        .and_then(|p| condition(p, "PodScheduled"))
        .is_some_and(|c| c.status == "False" && c.reason.as_deref() == Some("Unschedulable"))
}

fn waiting_with(reason: &'static str) -> impl FnMut(&watcher::Event<Pod>) -> bool {
    move |event| {
        applied(event)
            .and_then(waiting)
            .is_some_and(|(r, _)| r == reason)
    }
}

async fn wait_file(kube: &MiniKube, path: &Path) -> String {
    let until = Instant::now() + GUARD;
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            return text;
        }
        assert!(
            Instant::now() < until,
            "timed out waiting for {}\n{}",
            path.display(),
            report(kube)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The `Status` of a request that must have failed with an API error.
fn api_error<T: Debug>(result: Result<T, kube::Error>) -> Box<kube::core::Status> {
    match result {
        Err(kube::Error::Api(status)) => status,
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[tokio::test]
async fn pod_runs_with_its_secret_and_drains_on_graceful_delete() {
    let kube = MiniKube::start(1);
    let client = client(&kube);
    let secrets: Api<Secret> = Api::default_namespaced(client.clone());
    let pods: Api<Pod> = Api::default_namespaced(client);
    let out = tempfile::tempdir().unwrap();
    let pp = PostParams::default();

    let token = secrets
        .create(&pp, &secret("lease-7-token", "s3cret"))
        .await
        .unwrap();
    // the apiserver folds stringData into data
    assert!(token.string_data.is_none());
    assert_eq!(token.data.as_ref().unwrap()["token"].0, b"s3cret");
    assert_eq!(token.type_.as_deref(), Some("Opaque"));
    assert!(token.metadata.uid.is_some() && token.metadata.creation_timestamp.is_some());

    let mut events = events(&pods, "worker-7");
    let spec = with_token_from(worker("worker-7", WORKER, out.path(), 1), "lease-7-token");
    let created = pods.create(&pp, &typed(spec)).await.unwrap();
    assert_eq!(phase(&created), "Pending");
    assert_eq!(created.metadata.namespace.as_deref(), Some(NAMESPACE));
    assert!(created.metadata.resource_version.is_some());

    let event = until(&kube, &mut events, "worker-7 running", running).await;
    let pod = applied(&event).unwrap();
    let status = pod.status.as_ref().unwrap();
    assert_eq!(status.pod_ip.as_deref(), Some("127.0.0.1"));
    assert_eq!(
        pod.spec.as_ref().unwrap().node_name.as_deref(),
        Some("node-1")
    );
    let container = &status.container_statuses.as_ref().unwrap()[0];
    assert!(container.ready && container.started == Some(true));
    assert!(container.state.as_ref().unwrap().running.is_some());
    assert_eq!(condition(pod, "Ready").unwrap().status, "True");
    assert_eq!(condition(pod, "PodScheduled").unwrap().status, "True");

    assert_eq!(
        wait_file(&kube, &out.path().join("token")).await,
        "s3cret\n"
    );
    let log = kube.logs();
    assert!(log.contains("worker up"), "{log}");

    let deleting = pods
        .delete("worker-7", &DeleteParams::default())
        .await
        .unwrap()
        .left()
        .expect("a pod's DELETE answers the pod");
    assert!(deleting.metadata.deletion_timestamp.is_some());
    assert_eq!(deleting.metadata.deletion_grace_period_seconds, Some(10));

    let event = until(&kube, &mut events, "worker-7 deleted", |e| {
        deleted(e).is_some()
    })
    .await;
    let gone = deleted(&event).unwrap();
    assert_eq!(phase(gone), "Succeeded");
    let end = terminated(gone).unwrap();
    assert_eq!(
        (end.exit_code, end.reason.as_deref()),
        (0, Some("Completed"))
    );
    assert_eq!(
        std::fs::read_to_string(out.path().join("term")).unwrap(),
        "term\n"
    );

    let err = api_error(pods.get("worker-7").await);
    assert_eq!((err.code, err.reason.as_str()), (404, "NotFound"));
    assert_eq!(err.message, "pods \"worker-7\" not found");
    // kube's watcher listed once, then watched
    let watches = kube.request_count("GET", "/api/v1/namespaces/tidegate/pods?");
    assert!(
        kube.requests().iter().any(|r| r.contains("watch=true")),
        "no watch among {watches} pod collection requests"
    );
}

#[tokio::test]
async fn a_pod_stays_unschedulable_until_a_gpu_frees() {
    let kube = MiniKube::start(1);
    let pods: Api<Pod> = Api::default_namespaced(client(&kube));
    let out = tempfile::tempdir().unwrap();
    let pp = PostParams::default();

    let mut first = events(&pods, "gpu-a");
    let mut second = events(&pods, "gpu-b");
    pods.create(&pp, &typed(worker("gpu-a", IDLE, out.path(), 1)))
        .await
        .unwrap();
    until(&kube, &mut first, "gpu-a running", running).await;
    pods.create(&pp, &typed(worker("gpu-b", IDLE, out.path(), 1)))
        .await
        .unwrap();
    let event = until(&kube, &mut second, "gpu-b unschedulable", unschedulable).await;
    let pending = applied(&event).unwrap();
    let scheduled = condition(pending, "PodScheduled").unwrap();
    assert!(
        scheduled
            .message
            .as_deref()
            .unwrap()
            .starts_with("0/1 nodes are available: 1 Insufficient nvidia.com/gpu."),
        "{scheduled:?}"
    );
    assert_eq!(phase(pending), "Pending");
    assert!(pending.spec.as_ref().unwrap().node_name.is_none());

    pods.delete("gpu-a", &DeleteParams::default())
        .await
        .unwrap();
    until(
        &kube,
        &mut second,
        "gpu-b running once gpu-a is gone",
        running,
    )
    .await;
    assert!(kube.pod(NAMESPACE, "gpu-a").is_none());
}

#[tokio::test]
async fn eviction_marks_the_disruption_then_deletes_gracefully() {
    let kube = MiniKube::start(2);
    let pods: Api<Pod> = Api::default_namespaced(client(&kube));
    let out = tempfile::tempdir().unwrap();
    let pp = PostParams::default();

    let mut events = events(&pods, "spot-1");
    pods.create(&pp, &typed(worker("spot-1", WORKER, out.path(), 1)))
        .await
        .unwrap();
    until(&kube, &mut events, "spot-1 running", running).await;
    wait_file(&kube, &out.path().join("token")).await;

    kube.evict(NAMESPACE, "spot-1", "DeletionByTaintManager", None);
    let event = until(
        &kube,
        &mut events,
        "spot-1 disrupted and terminating",
        |e| {
            applied(e).is_some_and(|p| {
                p.metadata.deletion_timestamp.is_some()
                    && condition(p, "DisruptionTarget").is_some()
            })
        },
    )
    .await;
    let pod = applied(&event).unwrap();
    let disruption = condition(pod, "DisruptionTarget").unwrap();
    assert_eq!(disruption.status, "True");
    assert_eq!(disruption.reason.as_deref(), Some("DeletionByTaintManager"));
    assert!(disruption.message.is_some());
    assert_eq!(pod.metadata.deletion_grace_period_seconds, Some(10));
    let event = until(&kube, &mut events, "spot-1 deleted", |e| {
        deleted(e).is_some()
    })
    .await;
    assert_eq!(phase(deleted(&event).unwrap()), "Succeeded");
    assert_eq!(
        std::fs::read_to_string(out.path().join("term")).unwrap(),
        "term\n"
    );
}

#[tokio::test]
async fn node_death_fails_the_pod_with_exit_code_137() {
    let kube = MiniKube::start(1);
    let pods: Api<Pod> = Api::default_namespaced(client(&kube));
    let out = tempfile::tempdir().unwrap();

    let mut events = events(&pods, "doomed");
    pods.create(
        &PostParams::default(),
        &typed(worker("doomed", IDLE, out.path(), 1)),
    )
    .await
    .unwrap();
    until(&kube, &mut events, "doomed running", running).await;
    kube.kill(NAMESPACE, "doomed");
    let event = until(&kube, &mut events, "doomed failed", |e| {
        applied(e).is_some_and(|p| phase(p) == "Failed")
    })
    .await;
    let end = terminated(applied(&event).unwrap()).unwrap();
    assert_eq!((end.exit_code, end.reason.as_deref()), (137, Some("Error")));

    // it stays, failed, until deleted; a terminal pod is deleted at once
    let still = pods.get("doomed").await.unwrap();
    assert_eq!(phase(&still), "Failed");
    assert!(still.metadata.deletion_timestamp.is_none());
    let gone = pods
        .delete("doomed", &DeleteParams::default())
        .await
        .unwrap()
        .left()
        .unwrap();
    assert!(gone.metadata.deletion_timestamp.is_none());
    until(&kube, &mut events, "doomed deleted", |e| {
        deleted(e).is_some()
    })
    .await;
    // its GPU is free again
    let mut next = self::events(&pods, "next");
    pods.create(
        &PostParams::default(),
        &typed(worker("next", IDLE, out.path(), 1)),
    )
    .await
    .unwrap();
    until(&kube, &mut next, "next running", running).await;
}

#[tokio::test]
async fn owned_secret_is_collected_with_its_last_owner() {
    let kube = MiniKube::start(0);
    let client = client(&kube);
    let secrets: Api<Secret> = Api::default_namespaced(client.clone());
    let pods: Api<Pod> = Api::default_namespaced(client);
    let out = tempfile::tempdir().unwrap();
    let (pp, patch) = (PostParams::default(), PatchParams::default());

    let owner = pods
        .create(&pp, &typed(worker("owner", IDLE, out.path(), 0)))
        .await
        .unwrap();
    let other = pods
        .create(&pp, &typed(worker("other", IDLE, out.path(), 0)))
        .await
        .unwrap();
    secrets.create(&pp, &secret("owned", "a")).await.unwrap();
    secrets.create(&pp, &secret("shared", "b")).await.unwrap();
    let reference = |p: &Pod, controller: bool| {
        json!({
            "apiVersion": "v1", "kind": "Pod", "name": p.metadata.name, "uid": p.metadata.uid,
            "controller": controller, "blockOwnerDeletion": true,
        })
    };

    let owned = secrets
        .patch(
            "owned",
            &patch,
            &Patch::Merge(json!({"metadata": {"ownerReferences": [reference(&owner, true)]}})),
        )
        .await
        .unwrap();
    let refs = owned.metadata.owner_references.unwrap();
    assert_eq!(refs.len(), 1);
    assert_eq!(Some(&refs[0].uid), owner.metadata.uid.as_ref());
    // a merge patch replaces the list: both owners at once
    let both = json!({"metadata": {"ownerReferences": [
        reference(&owner, false), reference(&other, false),
    ]}});
    secrets
        .patch("shared", &patch, &Patch::Merge(both))
        .await
        .unwrap();
    let shared = secrets.get("shared").await.unwrap();
    assert_eq!(shared.metadata.owner_references.unwrap().len(), 2);

    let mut owned_events = listed(&kube, &secrets, "owned").await;
    pods.delete("owner", &DeleteParams::default())
        .await
        .unwrap();
    until(&kube, &mut owned_events, "owned collected", |e| {
        deleted(e).is_some()
    })
    .await;
    assert!(kube.pod(NAMESPACE, "owner").is_none());
    // one owner of two is still there
    assert!(kube.secret(NAMESPACE, "shared").is_some());
    assert!(kube.pod(NAMESPACE, "other").is_some());

    let mut shared_events = listed(&kube, &secrets, "shared").await;
    pods.delete("other", &DeleteParams::default())
        .await
        .unwrap();
    until(&kube, &mut shared_events, "shared collected", |e| {
        deleted(e).is_some()
    })
    .await;
}

#[tokio::test]
async fn api_errors_are_kubernetes_status_objects() {
    let kube = MiniKube::start(1);
    let client = client(&kube);
    let secrets: Api<Secret> = Api::default_namespaced(client.clone());
    let pods: Api<Pod> = Api::default_namespaced(client);
    let out = tempfile::tempdir().unwrap();
    let pp = PostParams::default();

    secrets.create(&pp, &secret("dup", "x")).await.unwrap();
    let err = api_error(secrets.create(&pp, &secret("dup", "x")).await);
    assert_eq!((err.code, err.reason.as_str()), (409, "AlreadyExists"));
    assert_eq!(err.message, "secrets \"dup\" already exists");

    let err = api_error(pods.delete("ghost", &DeleteParams::default()).await);
    assert_eq!((err.code, err.reason.as_str()), (404, "NotFound"));
    assert_eq!(err.details.unwrap().name, "ghost");
    assert!(pods.get_opt("ghost").await.unwrap().is_none());

    // injected failures: the next matching request only
    let path = "/api/v1/namespaces/tidegate/secrets/dup";
    kube.fail_next("GET", path, 500, 1);
    let err = api_error(secrets.get("dup").await);
    assert_eq!((err.code, err.reason.as_str()), (500, "InternalError"));
    secrets
        .get("dup")
        .await
        .expect("only the next request fails");
    kube.fail_next("POST", "/api/v1/namespaces/tidegate/pods", 403, 1);
    let err = api_error(
        pods.create(&pp, &typed(worker("denied", IDLE, out.path(), 0)))
            .await,
    );
    assert_eq!((err.code, err.reason.as_str()), (403, "Forbidden"));
    assert!(
        err.message.contains("cannot create resource \"pods\""),
        "{}",
        err.message
    );
    // kube's client retries a 503 by itself
    let before = kube.request_count("GET", path);
    kube.fail_next("GET", path, 503, 1);
    secrets.get("dup").await.expect("kube retries a 503");
    assert_eq!(kube.request_count("GET", path), before + 2);

    // validation, and what the double does not implement
    let invalid = |result: Result<Pod, kube::Error>, field: &str| {
        let err = api_error(result);
        assert_eq!((err.code, err.reason.as_str()), (422, "Invalid"), "{err:?}");
        assert!(
            err.message.contains(field),
            "{field} not in {}",
            err.message
        );
    };
    let mut always = worker("restarts", IDLE, out.path(), 0);
    always["spec"]["restartPolicy"] = json!("Always");
    invalid(
        pods.create(&pp, &typed(always)).await,
        "spec.restartPolicy: Unsupported value: \"Always\"",
    );
    let mut unset = worker("defaults", IDLE, out.path(), 0);
    unset["spec"]
        .as_object_mut()
        .unwrap()
        .remove("restartPolicy");
    invalid(pods.create(&pp, &typed(unset)).await, "spec.restartPolicy");
    let mut empty = worker("empty", IDLE, out.path(), 0);
    empty["spec"]["containers"] = json!([]);
    invalid(
        pods.create(&pp, &typed(empty)).await,
        "spec.containers: Required value",
    );
    let mut mounted = worker("mounted", IDLE, out.path(), 0);
    mounted["spec"]["volumes"] = json!([{"name": "cfg", "secret": {"secretName": "dup"}}]);
    invalid(
        pods.create(&pp, &typed(mounted)).await,
        "spec.volumes: Forbidden: not supported by the MiniKube test double",
    );
    let mut held = secret("held", "x");
    held.metadata.finalizers = Some(vec!["tidegate.io/cleanup".into()]);
    let err = api_error(secrets.create(&pp, &held).await);
    assert_eq!((err.code, err.reason.as_str()), (422, "Invalid"));
    assert!(
        err.message.contains("metadata.finalizers"),
        "{}",
        err.message
    );
    assert!(
        pods.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );

    let mut elsewhere = secret("elsewhere", "x");
    elsewhere.metadata.namespace = Some("other".into());
    let err = api_error(secrets.create(&pp, &elsewhere).await);
    assert_eq!((err.code, err.reason.as_str()), (400, "BadRequest"));
    let err = api_error(
        pods.list(&ListParams::default().fields("metadata.name=x"))
            .await,
    );
    assert_eq!(err.code, 400);
    assert!(err.message.contains("fieldSelector"), "{}", err.message);
    // other verbs and patch types are refused
    let err = api_error(secrets.replace("dup", &pp, &secret("dup", "y")).await);
    assert_eq!((err.code, err.reason.as_str()), (405, "MethodNotAllowed"));
    let label = Patch::Merge(json!({"metadata": {"labels": {"touched": "yes"}}}));
    let err = api_error(pods.patch("denied", &PatchParams::default(), &label).await);
    assert_eq!(err.code, 405);
    let apply =
        Patch::Apply(json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "dup"}}));
    let err = api_error(
        secrets
            .patch("dup", &PatchParams::apply("test"), &apply)
            .await,
    );
    assert_eq!(err.code, 415);

    // a merge patch writes; one that changes nothing writes nothing
    let stale = secrets.get("dup").await.unwrap();
    let touched = secrets
        .patch("dup", &PatchParams::default(), &label)
        .await
        .unwrap();
    assert_ne!(
        touched.metadata.resource_version,
        stale.metadata.resource_version
    );
    assert_eq!(touched.labels()["touched"], "yes");
    let again = secrets
        .patch("dup", &PatchParams::default(), &label)
        .await
        .unwrap();
    assert_eq!(
        again.metadata.resource_version,
        touched.metadata.resource_version
    );

    let wrong_uid = DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some("not-its-uid".into()),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    let err = api_error(secrets.delete("dup", &wrong_uid).await);
    assert_eq!((err.code, err.reason.as_str()), (409, "Conflict"));
    let done = secrets
        .delete("dup", &DeleteParams::default())
        .await
        .unwrap();
    let status = done.right().expect("a secret's DELETE answers a Status");
    assert_eq!(status.details.unwrap().name, "dup");
}

#[tokio::test]
async fn bad_image_and_missing_secret_are_container_waiting_reasons() {
    let kube = MiniKube::start(1);
    let client = client(&kube);
    let secrets: Api<Secret> = Api::default_namespaced(client.clone());
    let pods: Api<Pod> = Api::default_namespaced(client);
    let out = tempfile::tempdir().unwrap();
    let pp = PostParams::default();

    let mut bad = worker("bad-image", IDLE, out.path(), 0);
    bad["spec"]["containers"][0]["image"] = json!("nvcr.io/tidegate/worker:1.0");
    let mut events = events(&pods, "bad-image");
    pods.create(&pp, &typed(bad)).await.unwrap();
    let event = until(
        &kube,
        &mut events,
        "ErrImagePull",
        waiting_with("ErrImagePull"),
    )
    .await;
    let pod = applied(&event).unwrap();
    assert_eq!(phase(pod), "Pending");
    assert!(
        waiting(pod)
            .unwrap()
            .1
            .contains("nvcr.io/tidegate/worker:1.0")
    );
    until(
        &kube,
        &mut events,
        "ImagePullBackOff",
        waiting_with("ImagePullBackOff"),
    )
    .await;
    // deleting a pod that never started
    pods.delete("bad-image", &DeleteParams::default())
        .await
        .unwrap();
    until(&kube, &mut events, "bad-image deleted", |e| {
        deleted(e).is_some()
    })
    .await;

    let late = with_token_from(worker("late", WORKER, out.path(), 1), "late-token");
    let mut events = self::events(&pods, "late");
    pods.create(&pp, &typed(late)).await.unwrap();
    let event = until(
        &kube,
        &mut events,
        "CreateContainerConfigError",
        waiting_with("CreateContainerConfigError"),
    )
    .await;
    assert_eq!(
        waiting(applied(&event).unwrap()).unwrap().1,
        "secret \"late-token\" not found"
    );
    secrets
        .create(&pp, &secret("late-token", "finally"))
        .await
        .unwrap();
    until(
        &kube,
        &mut events,
        "late running once its secret exists",
        running,
    )
    .await;
    assert_eq!(
        wait_file(&kube, &out.path().join("token")).await,
        "finally\n"
    );

    let mut missing = worker("no-program", IDLE, out.path(), 0);
    missing["spec"]["containers"][0]["command"] = json!(["tidegate-no-such-program"]);
    let mut events = self::events(&pods, "no-program");
    pods.create(&pp, &typed(missing)).await.unwrap();
    let event = until(&kube, &mut events, "no-program failed", |e| {
        applied(e).is_some_and(|p| phase(p) == "Failed")
    })
    .await;
    let end = terminated(applied(&event).unwrap()).unwrap();
    assert_eq!(
        (end.exit_code, end.reason.as_deref()),
        (128, Some("StartError"))
    );
    assert!(
        end.message
            .as_deref()
            .unwrap()
            .contains("executable file not found")
    );
}

#[tokio::test]
async fn watch_resumes_from_a_resource_version_and_expires_after_compaction() {
    let kube = MiniKube::start(0);
    let secrets: Api<Secret> = Api::default_namespaced(client(&kube));
    let pp = PostParams::default();

    let a = secrets.create(&pp, &secret("a", "1")).await.unwrap();
    let from = a.metadata.resource_version.clone().unwrap();
    secrets.create(&pp, &secret("b", "2")).await.unwrap();
    secrets.create(&pp, &secret("c", "3")).await.unwrap();
    secrets.delete("a", &DeleteParams::default()).await.unwrap();

    let mut stream = secrets
        .watch(&WatchParams::default().timeout(20), &from)
        .await
        .unwrap()
        .boxed();
    let mut seen = Vec::new();
    let mut last_rv = from.parse::<u64>().unwrap();
    while seen.len() < 3 {
        let event = tokio::time::timeout(GUARD, stream.next())
            .await
            .expect("an event within the guard")
            .expect("an open watch")
            .expect("a decodable event");
        let (kind, s) = match event {
            WatchEvent::Added(s) => ("ADDED", s),
            WatchEvent::Modified(s) => ("MODIFIED", s),
            WatchEvent::Deleted(s) => ("DELETED", s),
            WatchEvent::Bookmark(_) => continue,
            WatchEvent::Error(e) => panic!("watch error {e:?}"),
        };
        let rv: u64 = s.metadata.resource_version.unwrap().parse().unwrap();
        assert!(rv > last_rv, "resource versions increase");
        last_rv = rv;
        seen.push((kind, s.metadata.name.unwrap()));
    }
    let seen: Vec<(&str, &str)> = seen.iter().map(|(k, n)| (*k, n.as_str())).collect();
    assert_eq!(seen, [("ADDED", "b"), ("ADDED", "c"), ("DELETED", "a")]);

    kube.compact();
    let mut stream = secrets
        .watch(&WatchParams::default(), &from)
        .await
        .unwrap()
        .boxed();
    match tokio::time::timeout(GUARD, stream.next())
        .await
        .expect("an event")
    {
        Some(Ok(WatchEvent::Error(status))) => {
            assert_eq!((status.code, status.reason.as_str()), (410, "Expired"));
        }
        other => panic!("expected 410 Expired, got {other:?}"),
    }
    // kube's watcher starts over with a list
    let mut events = events(&secrets, "c");
    until(&kube, &mut events, "c listed", |e| applied(e).is_some()).await;

    // an API server restart drops open watches; kube's watcher watches
    // again and misses nothing
    let mut raw = secrets
        .watch(&WatchParams::default(), "0")
        .await
        .unwrap()
        .boxed();
    let first = tokio::time::timeout(GUARD, raw.next())
        .await
        .expect("an event");
    assert!(matches!(first, Some(Ok(WatchEvent::Added(_)))), "{first:?}");
    kube.break_watches();
    // what was sent before still arrives, then the stream breaks
    loop {
        match tokio::time::timeout(GUARD, raw.next())
            .await
            .expect("the watch to break")
        {
            Some(Err(_)) | None => break,
            Some(Ok(WatchEvent::Added(_))) => {}
            other => panic!("expected the watch to break, got {other:?}"),
        }
    }
    let restarted = Patch::Merge(json!({"metadata": {"labels": {"seen": "after-restart"}}}));
    secrets
        .patch("c", &PatchParams::default(), &restarted)
        .await
        .unwrap();
    until(&kube, &mut events, "c changed after the restart", |e| {
        applied(e).is_some_and(|s| {
            s.metadata
                .labels
                .as_ref()
                .is_some_and(|l| l.contains_key("seen"))
        })
    })
    .await;
}

#[tokio::test]
async fn selectors_filter_lists_and_watches() {
    let kube = MiniKube::start(0);
    let secrets: Api<Secret> = Api::default_namespaced(client(&kube));
    let pp = PostParams::default();
    for (name, labels) in [
        ("s1", json!({"app": "a", "tier": "gpu"})),
        ("s2", json!({"app": "b"})),
        ("s3", json!({})),
    ] {
        let mut s = secret(name, "x");
        s.metadata.labels = Some(serde_json::from_value(labels).unwrap());
        secrets.create(&pp, &s).await.unwrap();
    }
    let names = |list: kube::core::ObjectList<Secret>| -> Vec<String> {
        list.items
            .into_iter()
            .map(|s| s.metadata.name.unwrap())
            .collect()
    };
    for (selector, want) in [
        ("app=a", vec!["s1"]),
        ("app==b", vec!["s2"]),
        ("app!=a", vec!["s2", "s3"]),
        ("app=a,tier=gpu", vec!["s1"]),
        ("app=a,tier=cpu", vec![]),
    ] {
        let got = names(
            secrets
                .list(&ListParams::default().labels(selector))
                .await
                .unwrap(),
        );
        assert_eq!(got, want, "labelSelector {selector}");
    }
    // set-based requirements are refused, not ignored
    let err = api_error(
        secrets
            .list(&ListParams::default().labels("app in (a,b)"))
            .await,
    );
    assert_eq!((err.code, err.reason.as_str()), (400, "BadRequest"));
    assert!(err.message.contains("equality"), "{}", err.message);
    // a limit is ignored, as the watch cache ignores it: no continue token
    let all = secrets.list(&ListParams::default().limit(2)).await.unwrap();
    assert!(
        all.metadata
            .continue_
            .as_deref()
            .unwrap_or_default()
            .is_empty()
    );
    assert_eq!(names(all), ["s1", "s2", "s3"]);

    // an object that starts matching is added for a filtered watch, one
    // that stops matching is deleted
    let mut app_a: Events<Secret> =
        watcher(secrets.clone(), watcher::Config::default().labels("app=a")).boxed();
    until(&kube, &mut app_a, "the initial list", |e| {
        matches!(e, watcher::Event::InitDone)
    })
    .await;
    let relabel = |app: &str| Patch::Merge(json!({"metadata": {"labels": {"app": app}}}));
    secrets
        .patch("s2", &PatchParams::default(), &relabel("a"))
        .await
        .unwrap();
    let event = until(&kube, &mut app_a, "s2 matching", |e| applied(e).is_some()).await;
    assert_eq!(
        applied(&event).unwrap().metadata.name.as_deref(),
        Some("s2")
    );
    secrets
        .patch("s1", &PatchParams::default(), &relabel("c"))
        .await
        .unwrap();
    let event = until(&kube, &mut app_a, "s1 no longer matching", |e| {
        deleted(e).is_some()
    })
    .await;
    assert_eq!(
        deleted(&event).unwrap().metadata.name.as_deref(),
        Some("s1")
    );
}

#[tokio::test]
async fn the_kubeconfig_reaches_the_server_in_its_namespace() {
    let kube = MiniKube::start(3);
    let kubeconfig = kube::config::Kubeconfig::read_from(kube.kubeconfig()).unwrap();
    let options = kube::config::KubeConfigOptions::default();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &options)
        .await
        .unwrap();
    assert_eq!(config.default_namespace, NAMESPACE);
    let secrets: Api<Secret> = Api::default_namespaced(Client::try_from(config).unwrap());
    let made = secrets
        .create(&PostParams::default(), &secret("via-kubeconfig", "x"))
        .await
        .unwrap();
    assert_eq!(made.metadata.namespace.as_deref(), Some(NAMESPACE));
    assert!(kube.secret(NAMESPACE, "via-kubeconfig").is_some());
}

#[test]
fn dropping_the_server_kills_its_containers() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let kube = MiniKube::start(0);
    let out = tempfile::tempdir().unwrap();
    // (the double runs commands as written: no `$(VAR)` expansion)
    let script =
        r#"echo $$ > "$OUT/pid.tmp"; mv "$OUT/pid.tmp" "$OUT/pid"; while :; do sleep 0.1; done"#;
    let pid: u32 = rt.block_on(async {
        let pods: Api<Pod> = Api::default_namespaced(client(&kube));
        let mut events = events(&pods, "left-running");
        pods.create(
            &PostParams::default(),
            &typed(worker("left-running", script, out.path(), 0)),
        )
        .await
        .unwrap();
        until(&kube, &mut events, "left-running running", running).await;
        wait_file(&kube, &out.path().join("pid"))
            .await
            .trim()
            .parse()
            .unwrap()
    });
    assert!(alive(pid));
    drop(kube);
    let until = Instant::now() + GUARD;
    while alive(pid) {
        assert!(
            Instant::now() < until,
            "container process {pid} outlived MiniKube"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether a process exists and is not a zombie.
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            stat.rsplit_once(") ")
                .map(|(_, rest)| !rest.starts_with('Z'))
        })
        .unwrap_or(false)
}
