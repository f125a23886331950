//! A Kubernetes API server cut down to what the Kubernetes lease provider
//! (`lease/src/provider/kubernetes/`) calls, and a one-node kubelet, in
//! process, so the provider is tested through the real `kube::Client` and
//! `kube::runtime::watcher` without a cluster. [`MiniKube::start`] serves
//! plain HTTP on `127.0.0.1:0` from its own thread and runtime.
//!
//! Served, for core v1 pods and secrets in any namespace: list and watch
//! with an equality `labelSelector` (a list returns every match: `limit`
//! is ignored, as the watch cache ignores it); chunked watches that resume
//! from a resourceVersion (one global counter), send bookmarks when
//! allowed, turn an object that starts or stops matching into `ADDED` /
//! `DELETED`, and answer an expired resourceVersion (older than 20 000
//! events, or [`MiniKube::compact`]ed) with a 410 `Expired` `ERROR` event;
//! create (`stringData` folded into `data`, 409 `AlreadyExists`, 422
//! `Invalid`), get (404), delete with a grace period and a uid
//! precondition (409 `Conflict`), a secret's JSON merge patch, and garbage
//! collection of objects whose `v1` Pod or Secret owners are all gone.
//! Every other route, verb, patch type, option and pod feature (volumes,
//! `envFrom`, affinity, `nodeName`, init containers, finalizers, any
//! `restartPolicy` but `Never`, which must be given) is refused with a
//! `Status` naming it, so a provider that starts using one fails here.
//!
//! The node `node-1` ([`NODE_LABELS`], no taints) has `gpus` [`GPU`]. The
//! scheduler binds pending pods in creation order when their GPUs fit and
//! their `nodeSelector` matches, else sets `PodScheduled=False`
//! (`Unschedulable`); it never preempts. The kubelet runs a pod's first
//! container as a local process group (stdout and stderr in
//! [`MiniKube::logs`]): the image must be `local` or `local/<program>`
//! (else `ErrImagePull`, then `ImagePullBackOff`); `command` + `args` run
//! as written (no `$(VAR)` expansion) with the test's `PATH` and `HOME`,
//! `HOSTNAME` and the `env` (values, `secretKeyRef`, `fieldRef`
//! `metadata.name`; a missing Secret is `CreateContainerConfigError`,
//! retried). Status follows the kubelet: `Pending` (`ContainerCreating`),
//! `Running` (`podIP` 127.0.0.1, `Ready`), then `Succeeded` or `Failed`
//! with `state.terminated` (exit code or 128 + signal, `StartError` 128 if
//! the program cannot start). A graceful delete sets `deletionTimestamp`,
//! SIGTERMs the main process and SIGKILLs the group when the grace period
//! ends; the pod then goes terminal and is removed.
//!
//! Faults: [`MiniKube::evict`] (spot reclaim), [`MiniKube::kill`] (dead
//! node), [`MiniKube::fail_next`], [`MiniKube::answer_late`],
//! [`MiniKube::act_late`], [`MiniKube::break_watches`] (apiserver restart).
//! Parts: `store` (objects, history, errors), `http` (routes, watches,
//! faults), `kubelet` (scheduler, kubelet, processes). Used by
//! `lease/tests/kubernetes_provider.rs`,
//! `loadtest/tests/kubernetes_leasing.rs` and `lease/tests/mini_kube.rs`
//! (its own behaviour). Feature `kube`.

mod http;
mod kubelet;
mod store;

use std::hash::BuildHasher;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use axum::Router;
use k8s_openapi::ByteString;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use serde_json::{Map, Value};
use tidegate_kit::signal::Signal;
use tokio::sync::oneshot;

use self::store::{DeleteOptions, Fault, Injection, Key, Kind, State};

/// The one node.
pub const NODE: &str = "node-1";
/// The default namespace of [`MiniKube::kubeconfig`] and
/// [`MiniKube::client_config`].
pub const NAMESPACE: &str = "tidegate";
/// The node's labels, which `nodeSelector` sees.
pub const NODE_LABELS: &[(&str, &str)] = &[
    ("kubernetes.io/hostname", NODE),
    ("kubernetes.io/os", "linux"),
    ("kubernetes.io/arch", "amd64"),
    ("nvidia.com/gpu.product", "NVIDIA-H200"),
    ("tidegate.test/spot", "true"),
];
/// The extended resource the scheduler counts.
pub const GPU: &str = "nvidia.com/gpu";
/// The address of every pod.
pub const POD_IP: &str = "127.0.0.1";

/// A running test API server and its node.
#[derive(Debug)]
pub struct MiniKube {
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    dir: tempfile::TempDir,
}

/// What the server thread and the handle share.
#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    /// `pods/` (working directories) and `logs/`.
    dir: PathBuf,
    url: String,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl MiniKube {
    /// Starts the API server on `127.0.0.1:0`, on its own thread with its
    /// own tokio runtime, with one node, `node-1`, that has `gpus`
    /// `nvidia.com/gpu`. It accepts requests as soon as this returns.
    pub fn start(gpus: u32) -> MiniKube {
        let dir = tempfile::Builder::new()
            .prefix("tidegate-kube-")
            .tempdir()
            .expect("temp dir");
        for sub in ["pods", "logs"] {
            std::fs::create_dir(dir.path().join(sub)).expect("MiniKube folders");
        }
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a port on 127.0.0.1");
        listener
            .set_nonblocking(true)
            .expect("a non-blocking listener");
        let port = listener.local_addr().expect("the listener's address");
        let url = format!("http://127.0.0.1:{}", port.port());
        std::fs::write(dir.path().join("kubeconfig"), kubeconfig(&url)).expect("kubeconfig");
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                gpus,
                ..State::default()
            }),
            dir: dir.path().to_path_buf(),
            url,
        });
        let (stop, stopped) = oneshot::channel();
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("mini-kube".into())
            .spawn(move || serve(sh, listener, stopped))
            .expect("the MiniKube thread");
        MiniKube {
            shared,
            stop: Some(stop),
            thread: Some(thread),
            dir,
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        self.shared.url.clone()
    }

    /// A kubeconfig file for this server: cluster `mini` at [`Self::url`],
    /// context `mini` with namespace `tidegate`, a user with no credentials.
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.path().join("kubeconfig")
    }

    /// A `kube::Config` for this server, default namespace `tidegate`.
    pub fn client_config(&self) -> kube::Config {
        let mut config = kube::Config::new(self.shared.url.parse().expect("the server's URL"));
        config.default_namespace = NAMESPACE.into();
        config
    }

    /// A pod as the server holds it now.
    pub fn pod(&self, ns: &str, name: &str) -> Option<Value> {
        let st = self.shared.lock();
        st.get(Kind::Pod, ns, name).map(|o| (*o).clone())
    }

    /// Every pod of a namespace, by name.
    pub fn pods(&self, ns: &str) -> Vec<Value> {
        self.objects(Kind::Pod, ns)
    }

    /// A secret as the server holds it now (`data` base64, as served).
    pub fn secret(&self, ns: &str, name: &str) -> Option<Value> {
        let st = self.shared.lock();
        st.get(Kind::Secret, ns, name).map(|o| (*o).clone())
    }

    /// Every secret of a namespace, by name.
    pub fn secrets(&self, ns: &str) -> Vec<Value> {
        self.objects(Kind::Secret, ns)
    }

    fn objects(&self, kind: Kind, ns: &str) -> Vec<Value> {
        let st = self.shared.lock();
        st.objects
            .iter()
            .filter(|(k, _)| k.0 == kind && k.1 == ns)
            .map(|(_, o)| (**o).clone())
            .collect()
    }

    /// What Kubernetes does when a spot node is reclaimed or a pod is
    /// preempted or evicted: adds the `DisruptionTarget` condition (status
    /// `True`, `reason` such as `DeletionByTaintManager`,
    /// `PreemptionByScheduler` or `EvictionByEvictionAPI`, and that
    /// component's message), then deletes the pod gracefully with its own
    /// `terminationGracePeriodSeconds`, or `grace` when given.
    ///
    /// Panics if there is no such pod.
    pub fn evict(&self, ns: &str, name: &str, reason: &str, grace: Option<u64>) {
        let mut st = self.shared.lock();
        let key = pod_key(ns, name);
        assert!(
            st.objects.contains_key(&key),
            "MiniKube::evict: there is no pod {ns}/{name}"
        );
        st.disrupt(&key, reason);
        let opts = DeleteOptions { grace, uid: None };
        if let Err(e) = st.delete(Kind::Pod, ns, name, &opts) {
            panic!("MiniKube::evict: deleting {ns}/{name}: {}", e.message);
        }
    }

    /// The node dies under the pod: its container's processes are
    /// SIGKILLed, and the pod goes `Failed` with its container terminated
    /// (`Error`, exit code 137) shortly after. The pod is not deleted.
    ///
    /// Panics if there is no such pod.
    pub fn kill(&self, ns: &str, name: &str) {
        let key = pod_key(ns, name);
        let pid = {
            let mut st = self.shared.lock();
            assert!(
                st.objects.contains_key(&key),
                "MiniKube::kill: there is no pod {ns}/{name}"
            );
            st.kill(&key)
        };
        if let Some(pid) = pid {
            kubelet::signal(pid, Signal::Kill, true);
        }
    }

    /// Every request so far (the last 100 000), as `METHOD /path?query`,
    /// e.g. `GET /api/v1/namespaces/tidegate/pods?watch=true&…`.
    pub fn requests(&self) -> Vec<String> {
        self.shared.lock().requests.iter().cloned().collect()
    }

    /// How many requests had this method and a `/path?query` starting with
    /// `prefix`, e.g. to assert that the provider watched instead of polling.
    pub fn request_count(&self, method: &str, prefix: &str) -> usize {
        self.shared
            .lock()
            .requests
            .iter()
            .filter(|r| {
                r.split_once(' ')
                    .is_some_and(|(m, t)| m.eq_ignore_ascii_case(method) && t.starts_with(prefix))
            })
            .count()
    }

    /// Makes the next `count` requests with this method whose `/path?query`
    /// starts with `prefix` fail with HTTP `status` and the `Status` body
    /// the apiserver sends for it (403 `Forbidden` with an RBAC message, 500
    /// `InternalError`, 409 `Conflict`, 429 `TooManyRequests`, …). Note that
    /// kube's client retries 429, 503 and 504 by itself.
    pub fn fail_next(&self, method: &str, prefix: &str, status: u16, count: u32) {
        self.inject(method, prefix, Fault::Fail(status), count);
    }

    /// Makes the next `count` requests with this method whose `/path?query`
    /// starts with `prefix` take effect but be answered only after
    /// `delay`, as from an overloaded apiserver or a lost answer: a client
    /// that gives up first does not know whether they took effect.
    pub fn answer_late(&self, method: &str, prefix: &str, delay: Duration, count: u32) {
        self.inject(method, prefix, Fault::AnswerLate(delay), count);
    }

    /// Makes the next `count` requests with this method whose `/path?query`
    /// starts with `prefix` wait `delay` before they take effect, as in an
    /// overloaded apiserver's queue: they take effect then even if the
    /// client has given up and gone, so a client's cleanup in between
    /// finds nothing, and what it asked for appears afterwards.
    pub fn act_late(&self, method: &str, prefix: &str, delay: Duration, count: u32) {
        self.inject(method, prefix, Fault::ActLate(delay), count);
    }

    fn inject(&self, method: &str, prefix: &str, fault: Fault, count: u32) {
        if count > 0 {
            self.shared.lock().faults.push(Injection {
                method: method.to_ascii_uppercase(),
                prefix: prefix.to_string(),
                fault,
                remaining: count,
            });
        }
    }

    /// Breaks every open watch, as an apiserver restart does: each watch
    /// connection is dropped mid-stream (the client sees the chunked body
    /// end with an error) and clients must watch again. The history is
    /// kept, as etcd keeps it across a restart, so a watch from the last
    /// resourceVersion a client saw resumes without a gap.
    pub fn break_watches(&self) {
        let mut st = self.shared.lock();
        st.watch_epoch += 1;
        let rv = st.rv;
        st.notify.send_replace(rv);
    }

    /// Forgets the watch history, as an etcd compaction does: a watch from
    /// any resourceVersion before now gets `410 Expired`.
    pub fn compact(&self) {
        let mut st = self.shared.lock();
        st.history.clear();
        st.floor = st.rv;
    }

    /// The stdout and stderr of every container (the last 40 lines each),
    /// for a failure message.
    pub fn logs(&self) -> String {
        let mut files: Vec<PathBuf> = std::fs::read_dir(self.dir.path().join("logs"))
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        files.sort();
        let mut out = String::new();
        for p in files {
            let text = std::fs::read_to_string(&p).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            let name = p.file_stem().unwrap_or_default().to_string_lossy();
            out.push_str(&format!("--- {name}\n"));
            for l in tail.into_iter().rev() {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }
}

impl Drop for MiniKube {
    fn drop(&mut self) {
        let pids: Vec<u32> = {
            let mut st = self.shared.lock();
            st.stopping = true;
            st.kubelet.values().filter_map(|k| k.running).collect()
        };
        for pid in pids {
            kubelet::signal(pid, Signal::Kill, true);
        }
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn pod_key(ns: &str, name: &str) -> Key {
    (Kind::Pod, ns.to_string(), name.to_string())
}

/// The server thread: the HTTP server and the kubelet, until told to stop.
fn serve(sh: Arc<Shared>, listener: std::net::TcpListener, stopped: oneshot::Receiver<()>) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("mini-kube-rt")
        .enable_all()
        .build()
        .expect("the MiniKube runtime");
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener).expect("the listener");
        let app = Router::new().fallback(http::handle).with_state(sh.clone());
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        let kubelet = tokio::spawn(kubelet::kubelet(sh));
        let _ = stopped.await;
        server.abort();
        kubelet.abort();
    });
    // open watches and container waiters end here; `kill_on_drop` kills
    // any container that started after `Drop` collected the pids
    rt.shutdown_timeout(Duration::from_secs(2));
}

/// The kubeconfig (JSON, which is YAML too): cluster, context and user
/// `mini`, namespace [`NAMESPACE`], no credentials.
fn kubeconfig(url: &str) -> String {
    let named = |key: &str, v: Value| serde_json::json!([{"name": "mini", key: v}]);
    let context = serde_json::json!({"cluster": "mini", "namespace": NAMESPACE, "user": "mini"});
    serde_json::json!({
        "apiVersion": "v1", "kind": "Config", "current-context": "mini",
        "clusters": named("cluster", serde_json::json!({"server": url})),
        "contexts": named("context", context), "users": named("user", serde_json::json!({})),
    })
    .to_string()
}

// ---------------------------------------------------------------------------
// JSON, ids and time, for the parts

fn s<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_default()
}

fn arr<'a>(v: &'a Value, pointer: &str) -> &'a [Value] {
    v.pointer(pointer)
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default()
}

fn map<'a>(v: &'a Value, pointer: &str) -> Option<&'a Map<String, Value>> {
    v.pointer(pointer).and_then(Value::as_object)
}

fn b64_decode(s: &str) -> Option<Vec<u8>> {
    serde_json::from_value::<ByteString>(Value::String(s.to_string()))
        .ok()
        .map(|b| b.0)
}

fn b64_encode(bytes: &[u8]) -> Value {
    serde_json::to_value(ByteString(bytes.to_vec())).unwrap_or_default()
}

fn random_hex(len: usize) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut out = String::new();
    while out.len() < len {
        let seed = (COUNTER.fetch_add(1, Ordering::Relaxed), SystemTime::now());
        let word = std::hash::RandomState::new().hash_one(seed);
        out.push_str(&format!("{word:016x}"));
    }
    out.truncate(len);
    out
}

/// A random version-4 UUID, as the apiserver gives.
fn new_uid() -> String {
    let h = random_hex(32);
    let (a, b, c, d, e) = (&h[..8], &h[8..12], &h[13..16], &h[17..20], &h[20..]);
    format!("{a}-{b}-4{c}-a{d}-{e}")
}

fn now_rfc3339() -> String {
    rfc3339(SystemTime::now())
}

/// RFC 3339 UTC with whole seconds, as `metav1.Time` is written.
fn rfc3339(t: SystemTime) -> String {
    let time = Time(Timestamp::try_from(t).unwrap_or_default());
    match serde_json::to_value(time) {
        Ok(Value::String(s)) => s,
        _ => String::new(),
    }
}
