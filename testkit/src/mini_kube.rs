//! A Kubernetes API server (a core/v1 subset) and a one-node kubelet, in
//! process, for testing the Kubernetes lease provider without a cluster.
//!
//! [`MiniKube::start`] serves plain HTTP on `127.0.0.1:0` from its own
//! thread and tokio runtime, so it works under `#[test]` and under every
//! `#[tokio::test]` flavour. It speaks the apiserver's wire protocol: objects
//! as the apiserver stores them (defaults filled in, `stringData` folded into
//! `data`, unknown fields dropped), `Status` errors with the real reasons,
//! codes and messages, one global `resourceVersion` counter, and chunked
//! newline-delimited watch streams that resume from a resource version. The
//! real `kube::Client` and `kube::runtime::watcher` talk to it unchanged.
//!
//! Served (core v1 only; any namespace name is accepted, none has to exist):
//! `GET /version`, `/api`, `/api/v1`, `/apis`, `/healthz`; pods, secrets and
//! configmaps: list, watch, create, get, replace (PUT), merge and strategic
//! merge patch, delete and delete-collection; `pods/{name}/status` (get,
//! patch, replace), `pods/{name}/log` and `pods/{name}/eviction`; the node
//! `node-1`: get, list, watch. Metadata-only answers (`Accept:
//! …;as=PartialObjectMetadata`, as kube's `Api<PartialObjectMeta<K>>` asks)
//! for get, list and watch. Label selectors (`=`, `==`, `!=`, `in`,
//! `notin`, `key`, `!key`, `>`, `<`), field selectors (`metadata.name`,
//! `metadata.namespace`, and per kind what Kubernetes allows, e.g. a pod's
//! `status.phase` or `spec.nodeName`), `limit`/`continue` paging, `dryRun`,
//! ownerReferences with background garbage collection, finalizers.
//!
//! For tests of failure handling: [`MiniKube::fail_next`] injects HTTP
//! errors with the apiserver's `Status` bodies, [`MiniKube::answer_late`]
//! carries a request out but answers it late, [`MiniKube::act_late`]
//! carries it out late (whether or not the client still waits),
//! [`MiniKube::break_watches`]
//! drops every open watch as an apiserver restart does, and
//! [`MiniKube::compact`] makes old resourceVersions expire (410).
//!
//! The node `node-1` ([`NODE_LABELS`], no taints) has `gpus`
//! `nvidia.com/gpu`. The scheduler binds a pending pod when its GPUs fit and
//! its `nodeSelector` / required node affinity match, and otherwise sets
//! `PodScheduled=False` (`Unschedulable`) with the scheduler's message. The
//! kubelet then runs the pod's first container as a real local process (its
//! own process group, so that killing the "container" kills all of it),
//! with stdout and stderr in a per-pod log file ([`MiniKube::logs`], and the
//! `pods/log` endpoint):
//!
//! - the image must be `local` or `local/<program>`; any other image ends
//!   in `ErrImagePull` / `ImagePullBackOff` and the pod stays Pending. With
//!   no `command`, `local/<program>` runs `<program>` with the `args`;
//! - `command[0]` runs with `command[1..]` + `args`, `$(VAR)` references
//!   expanded as the kubelet does (so `$$` is a literal `$`: a shell script
//!   that wants its pid writes `$$$$`), in a fresh working directory, with the
//!   test process's `PATH` and `HOME`, `HOSTNAME` = the pod name, and the
//!   declared `env` / `envFrom` (values, `secretKeyRef`, `configMapKeyRef`,
//!   `fieldRef`). A missing Secret, ConfigMap or key leaves the container
//!   waiting with `CreateContainerConfigError` and the kubelet's message,
//!   retried every 200 ms, as the kubelet does;
//! - volumes (`secret`, `configMap`, `emptyDir`, `hostPath`) cannot be
//!   mounted at their real paths, so each is written to a folder of the
//!   pod's temp directory and **every occurrence of a `mountPath` in the
//!   command, args and env values is replaced by that folder** (whole path
//!   components only: `/etc/tg` does not rewrite `/etc/tgx`). A missing
//!   Secret or ConfigMap leaves the container `ContainerCreating` with the
//!   kubelet's `MountVolume.SetUp failed …` message until it appears;
//! - status follows the kubelet: `Pending` (`ContainerCreating`), then
//!   `Running` with `podIP` 127.0.0.1 and `Ready=True`, then `Succeeded` or
//!   `Failed` with `state.terminated` (`Completed` / `Error`, exit code, or
//!   128 + signal) when the process exits. Every change bumps the
//!   resourceVersion and is a `MODIFIED` watch event;
//! - graceful deletion: `deletionTimestamp` is set, the process gets SIGTERM
//!   (the container's main process only, as the runtime does), then SIGKILL
//!   for its whole process group when the grace period ends; once it has
//!   exited the pod goes terminal (`MODIFIED`) and is removed (`DELETED`).
//!
//! # Where it differs from Kubernetes
//!
//! - Only `restartPolicy: Never` is implemented; `Always` (the API default
//!   when the field is omitted) and `OnFailure` are rejected at create with
//!   422 Invalid. Init containers, and volume types other than the four
//!   above, and `resourceFieldRef` env, are rejected the same way. Of
//!   several containers only the first runs and has a container status.
//! - The scheduler counts only `nvidia.com/gpu` (CPU and memory always
//!   fit), orders by `spec.priority` then creation, and never preempts: use
//!   [`MiniKube::evict`] to act out a preemption or a spot reclaim. Pods for
//!   another `schedulerName` stay pending; a pod created with `nodeName:
//!   node-1` skips the scheduler and is admitted (or rejected with
//!   `OutOfnvidia.com/gpu`) by the kubelet, as in Kubernetes.
//! - Pod specs are immutable after create (Kubernetes allows a few fields,
//!   such as the image, to change). Status written through the main
//!   resource is ignored, as in Kubernetes; use `pods/{name}/status`.
//! - Strategic merge patch merges lists by their Kubernetes merge keys for
//!   the lists a lease provider touches (`ownerReferences` by uid,
//!   `finalizers` as a set, containers/env/volumes/volumeMounts/ports,
//!   status conditions and container statuses); every other list is
//!   replaced, as in a JSON merge patch. `$patch: replace|delete` and
//!   `$deleteFromPrimitiveList` are honoured; `$retainKeys` and
//!   `$setElementOrder` are ignored. JSON patch and server-side apply
//!   answer 415.
//! - Garbage collection deletes a dependent once none of its owners (`v1`
//!   pods, secrets, configmaps or the node, matched by name and uid)
//!   exists; owners of other kinds are assumed to exist. `Foreground`
//!   propagation acts like `Background`; `Orphan` removes the owner
//!   references at once.
//! - A list is not a consistent snapshot across `continue` pages, and list
//!   `resourceVersion` parameters are ignored. Watch history keeps the last
//!   20 000 events; an older `resourceVersion`, or one before
//!   [`MiniKube::compact`], gets the `ERROR` event with a 410 `Expired`
//!   status, as after an etcd compaction; one from the future is accepted
//!   (the apiserver waits up to 3 s, then answers 504). Bookmarks (when
//!   allowed) come every 60 s and just before `timeoutSeconds` ends the
//!   watch.
//! - No authentication or authorization, no managedFields, no `generation`,
//!   no Events objects, no namespaces objects, no service-account token
//!   mount, no `KUBERNETES_SERVICE_*` env, no probes (Ready follows
//!   Running). Secret and ConfigMap volumes are written once at start.
//!   `pods/log` ignores `follow` (it returns what was written so far) and
//!   `sinceSeconds`/`timestamps`. `fieldValidation` is ignored (unknown
//!   fields are dropped, as with the default `Warn`, but without a warning).
//! - `workingDir` is ignored: a container starts in a fresh empty folder.
//!
//! Used by `lease/tests/kubernetes_provider.rs`,
//! `loadtest/tests/kubernetes_leasing.rs`, and `lease/tests/mini_kube.rs`,
//! which checks its own behaviour. Feature `kube`.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fmt;
use std::hash::{BuildHasher, Hasher, RandomState};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Query, Request, State as AxState};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::Response;
use k8s_openapi::ByteString;
use serde_json::{Map, Value, json};
use tidegate_kit::signal::Signal;
use tokio::sync::{oneshot, watch};

/// The one node.
pub const NODE: &str = "node-1";
/// The default namespace of [`MiniKube::kubeconfig`] and
/// [`MiniKube::client_config`].
pub const NAMESPACE: &str = "tidegate";
/// The node's labels, which `nodeSelector` and node affinity see.
pub const NODE_LABELS: &[(&str, &str)] = &[
    ("kubernetes.io/hostname", NODE),
    ("kubernetes.io/os", "linux"),
    ("kubernetes.io/arch", "amd64"),
    ("nvidia.com/gpu.product", "NVIDIA-H200"),
    ("tidegate.test/spot", "true"),
];
/// The extended resource the scheduler counts.
pub const GPU: &str = "nvidia.com/gpu";
/// The address of the node and of every pod.
pub const POD_IP: &str = "127.0.0.1";
/// The version the server reports.
pub const GIT_VERSION: &str = "v1.33.0-minikube-test";

/// Watch events kept for resuming watches.
const HISTORY: usize = 20_000;
/// Request lines kept for [`MiniKube::requests`].
const REQUEST_LOG: usize = 100_000;
/// How often the kubelet and scheduler look again without a change (the
/// kubelet's retry of a missing Secret, grace period deadlines).
const RESYNC: Duration = Duration::from_millis(200);
/// How often a watch that allows bookmarks gets one.
const BOOKMARK_EVERY: Duration = Duration::from_secs(60);
/// The apiserver's request body limit.
const MAX_BODY: usize = 3 * 1024 * 1024;
/// A watch's length when the client does not say (the apiserver picks
/// 30–60 minutes).
const DEFAULT_WATCH_SECS: u64 = 1800;
/// `terminationGracePeriodSeconds` when the pod does not say.
const DEFAULT_GRACE_SECS: u64 = 30;

const INSUFFICIENT_GPU: &str = "0/1 nodes are available: 1 Insufficient nvidia.com/gpu. \
     preemption: 0/1 nodes are available: 1 No preemption victims found for incoming pod.";
const SELECTOR_MISMATCH: &str = "0/1 nodes are available: 1 node(s) didn't match Pod's node \
     affinity/selector. preemption: 0/1 nodes are available: 1 Preemption is not helpful for \
     scheduling.";
const POD_SPEC_IMMUTABLE: &str = "pod updates may not change fields other than \
     `spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,\
     `spec.tolerations` (only additions to existing tolerations),\
     `spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously \
     negative) (the MiniKube test double allows none of them)";
const DNS_SUBDOMAIN_MSG: &str = "a lowercase RFC 1123 subdomain must consist of lower case \
     alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character \
     (e.g. 'example.com', regex used for validation is \
     '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";
const DNS_LABEL_MSG: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric \
     characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  \
     or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')";
const QUALIFIED_NAME_MSG: &str = "name part must consist of alphanumeric characters, '-', '_' or \
     '.', and must start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  \
     or '123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')";
const LABEL_VALUE_MSG: &str = "a valid label must be an empty string or consist of alphanumeric \
     characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. \
     'MyValue',  or 'my_value',  or '12345', regex used for validation is \
     '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')";
const ENV_NAME_MSG: &str = "a valid environment variable name must consist of alphabetic \
     characters, digits, '_', '-', or '.', and must not start with a digit (e.g. 'my.env-name',  \
     or 'MY_ENV.NAME',  or 'MyEnvName1', regex used for validation is \
     '[-._a-zA-Z][-._a-zA-Z0-9]*')";
const CONFIG_KEY_MSG: &str = "a valid config key must consist of alphanumeric characters, '-', \
     '_' or '.' (e.g. 'key.name',  or 'KEY_NAME',  or 'key-name', regex used for validation is \
     '[-._a-zA-Z0-9]+')";

/// A running test API server and its node.
pub struct MiniKube {
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    dir: tempfile::TempDir,
}

impl fmt::Debug for MiniKube {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MiniKube")
            .field("url", &self.shared.url)
            .field("dir", &self.dir.path())
            .finish()
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
        let port = listener
            .local_addr()
            .expect("the listener's address")
            .port();
        let url = format!("http://127.0.0.1:{port}");
        std::fs::write(dir.path().join("kubeconfig"), kubeconfig_yaml(&url)).expect("kubeconfig");
        let (notify, _) = watch::channel(0);
        let mut state = State::new(gpus, notify);
        state.commit(Kind::Node, "", NODE, node_object(gpus), EventType::Added);
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
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

    /// Its temporary folder: `pods/<ns>_<name>_<uid>/` (each container's
    /// working directory and volumes) and `logs/`.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// A pod as the server holds it now.
    pub fn pod(&self, ns: &str, name: &str) -> Option<Value> {
        self.object(Kind::Pod, ns, name)
    }

    /// Every pod of a namespace, by name.
    pub fn pods(&self, ns: &str) -> Vec<Value> {
        self.objects(Kind::Pod, ns)
    }

    /// A secret as the server holds it now (`data` base64, as served).
    pub fn secret(&self, ns: &str, name: &str) -> Option<Value> {
        self.object(Kind::Secret, ns, name)
    }

    /// Every secret of a namespace, by name.
    pub fn secrets(&self, ns: &str) -> Vec<Value> {
        self.objects(Kind::Secret, ns)
    }

    /// The node object.
    pub fn node(&self) -> Value {
        self.object(Kind::Node, "", NODE).expect("the node")
    }

    fn object(&self, kind: Kind, ns: &str, name: &str) -> Option<Value> {
        let st = self.shared.lock();
        st.objects
            .get(&(kind, ns.to_string(), name.to_string()))
            .map(|o| (**o).clone())
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
        let key = (Kind::Pod, ns.to_string(), name.to_string());
        assert!(
            st.objects.contains_key(&key),
            "MiniKube::evict: there is no pod {ns}/{name}"
        );
        st.disrupt(&key, reason);
        let opts = DeleteOptions {
            grace,
            ..DeleteOptions::default()
        };
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
        let pid = {
            let mut st = self.shared.lock();
            let key = (Kind::Pod, ns.to_string(), name.to_string());
            let pod = st
                .objects
                .get(&key)
                .cloned()
                .unwrap_or_else(|| panic!("MiniKube::kill: there is no pod {ns}/{name}"));
            let uid = s(&pod, "/metadata/uid").to_string();
            let kl = st.kubelet.entry(uid).or_default();
            // a pod that was not running yet never will
            kl.started = true;
            match kl.running {
                Some(pid) => Some(pid),
                None => {
                    if !is_terminal(&pod) {
                        let now = now_rfc3339();
                        st.modify(&key, |p| terminate(p, 137, "Error", None, "", &now, "", ""));
                    }
                    None
                }
            }
        };
        if let Some(pid) = pid {
            signal_sync(&[pid], Signal::Kill);
        }
    }

    /// Sets the node's `nvidia.com/gpu` capacity; pending pods that now fit
    /// get scheduled.
    pub fn set_gpus(&self, gpus: u32) {
        let mut st = self.shared.lock();
        st.gpus = gpus;
        let key = (Kind::Node, String::new(), NODE.to_string());
        st.modify(&key, |node| {
            for field in ["capacity", "allocatable"] {
                node["status"][field][GPU] = Value::String(gpus.to_string());
            }
        });
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
        self.shared.lock().failures.push(Failure {
            method: method.to_ascii_uppercase(),
            prefix: prefix.to_string(),
            status,
            remaining: count,
        });
    }

    /// Makes the next `count` requests with this method whose `/path?query`
    /// starts with `prefix` take effect but be answered only after
    /// `delay`, as from an overloaded apiserver or a lost answer: a client
    /// that gives up first does not know whether they took effect.
    pub fn answer_late(&self, method: &str, prefix: &str, delay: Duration, count: u32) {
        self.shared.lock().late.push(Late {
            method: method.to_ascii_uppercase(),
            prefix: prefix.to_string(),
            delay,
            remaining: count,
            act_first: true,
        });
    }

    /// Makes the next `count` requests with this method whose `/path?query`
    /// starts with `prefix` wait `delay` before they take effect, as in an
    /// overloaded apiserver's queue: they take effect then even if the
    /// client has given up and gone, so a client's cleanup in between
    /// finds nothing, and what it asked for appears afterwards.
    pub fn act_late(&self, method: &str, prefix: &str, delay: Duration, count: u32) {
        self.shared.lock().late.push(Late {
            method: method.to_ascii_uppercase(),
            prefix: prefix.to_string(),
            delay,
            remaining: count,
            act_first: false,
        });
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
        signal_sync(&pids, Signal::Kill);
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
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
        let app = Router::new().fallback(handle).with_state(sh.clone());
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        let kubelet = tokio::spawn(kubelet(sh));
        let _ = stopped.await;
        server.abort();
        kubelet.abort();
    });
    // open watches and container waiters end here; `kill_on_drop` kills
    // any container that started after `Drop` collected the pids
    rt.shutdown_timeout(Duration::from_secs(2));
}

fn kubeconfig_yaml(url: &str) -> String {
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: mini
  cluster:
    server: {url}
contexts:
- name: mini
  context:
    cluster: mini
    namespace: {NAMESPACE}
    user: mini
current-context: mini
users:
- name: mini
  user: {{}}
preferences: {{}}
"
    )
}

// ---------------------------------------------------------------------------
// State

/// The kinds of object served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Kind {
    Pod,
    Secret,
    ConfigMap,
    Node,
}

impl Kind {
    fn from_plural(plural: &str) -> Option<Kind> {
        Some(match plural {
            "pods" => Kind::Pod,
            "secrets" => Kind::Secret,
            "configmaps" => Kind::ConfigMap,
            "nodes" => Kind::Node,
            _ => return None,
        })
    }

    fn plural(self) -> &'static str {
        match self {
            Kind::Pod => "pods",
            Kind::Secret => "secrets",
            Kind::ConfigMap => "configmaps",
            Kind::Node => "nodes",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Pod => "Pod",
            Kind::Secret => "Secret",
            Kind::ConfigMap => "ConfigMap",
            Kind::Node => "Node",
        }
    }

    fn namespaced(self) -> bool {
        self != Kind::Node
    }

    /// Decodes a request body as the apiserver does: into the typed object
    /// (so wrong types are 400 and unknown fields are dropped), and back.
    fn decode(self, mut body: Value) -> Result<Value, ApiError> {
        let k = self.name();
        let fail = |e: String| {
            ApiError::bad_request(format!(
                "{k} in version \"v1\" cannot be handled as a {k}: {e}"
            ))
        };
        let Some(m) = body.as_object_mut() else {
            return Err(fail("the body is not a JSON object".into()));
        };
        if let Some(got) = m.get("kind").and_then(Value::as_str)
            && got != k
        {
            return Err(ApiError::bad_request(format!(
                "the kind of the provided object ({got}) does not match the resource ({})",
                self.plural()
            )));
        }
        if !m.get("metadata").is_some_and(Value::is_object) {
            m.insert("metadata".into(), json!({}));
        }
        fn round_trip<T: serde::de::DeserializeOwned + serde::Serialize>(
            v: Value,
        ) -> Result<Value, String> {
            let typed: T = serde_json::from_value(v).map_err(|e| e.to_string())?;
            serde_json::to_value(typed).map_err(|e| e.to_string())
        }
        use k8s_openapi::api::core::v1 as core;
        match self {
            Kind::Pod => round_trip::<core::Pod>(body),
            Kind::Secret => round_trip::<core::Secret>(body),
            Kind::ConfigMap => round_trip::<core::ConfigMap>(body),
            Kind::Node => round_trip::<core::Node>(body),
        }
        .map_err(fail)
    }
}

type Key = (Kind, String, String);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EventType {
    Added,
    Modified,
    Deleted,
}

/// One change, as the watch cache keeps it.
#[derive(Debug)]
struct Event {
    rv: u64,
    kind: Kind,
    ns: String,
    etype: EventType,
    object: Arc<Value>,
    /// The object before a change (for selector transitions).
    prev: Option<Arc<Value>>,
}

#[derive(Debug)]
struct Late {
    method: String,
    prefix: String,
    delay: Duration,
    remaining: u32,
    /// Take effect at once and answer after `delay` (`answer_late`), or
    /// wait `delay`, then take effect and answer (`act_late`).
    act_first: bool,
}

#[derive(Debug)]
struct Failure {
    method: String,
    prefix: String,
    status: u16,
    remaining: u32,
}

/// What the kubelet knows of a pod (by uid).
#[derive(Debug, Default)]
struct Kubelet {
    /// Admitted against the node's GPUs.
    admitted: bool,
    /// Its container was started (or failed to); with `restartPolicy:
    /// Never` it never starts again.
    started: bool,
    /// The live container's pid, which is also its process group.
    running: Option<u32>,
    container_id: String,
    image_id: String,
    started_at: String,
    /// When SIGKILL follows the SIGTERM of a graceful deletion.
    kill_at: Option<Instant>,
    kill_sent: bool,
    pull: Option<Pull>,
}

/// Image pull back-off, as the kubelet shows it: `ErrImagePull` for a
/// moment, then `ImagePullBackOff` for a doubling back-off.
#[derive(Debug)]
struct Pull {
    next: Instant,
    backoff: Duration,
    in_backoff: bool,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    dir: PathBuf,
    url: String,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[derive(Debug)]
struct State {
    rv: u64,
    objects: BTreeMap<Key, Arc<Value>>,
    history: VecDeque<Event>,
    /// Every event after this resourceVersion is in `history`.
    floor: u64,
    notify: watch::Sender<u64>,
    /// Pod uid → the resourceVersion that created it (scheduling order).
    order: HashMap<String, u64>,
    gpus: u32,
    kubelet: HashMap<String, Kubelet>,
    requests: VecDeque<String>,
    failures: Vec<Failure>,
    late: Vec<Late>,
    /// Bumped by [`MiniKube::break_watches`]: older watches end.
    watch_epoch: u64,
    stopping: bool,
}

/// What the apiserver reads from `DeleteOptions` and the query.
#[derive(Debug, Default, Clone)]
struct DeleteOptions {
    grace: Option<u64>,
    policy: Option<String>,
    uid: Option<String>,
    rv: Option<String>,
    dry_run: bool,
}

/// Main resource or `status` subresource.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sub {
    Main,
    Status,
}

impl State {
    fn new(gpus: u32, notify: watch::Sender<u64>) -> State {
        State {
            rv: 0,
            objects: BTreeMap::new(),
            history: VecDeque::new(),
            floor: 0,
            notify,
            order: HashMap::new(),
            gpus,
            kubelet: HashMap::new(),
            requests: VecDeque::new(),
            failures: Vec::new(),
            late: Vec::new(),
            watch_epoch: 0,
            stopping: false,
        }
    }

    fn record(&mut self, method: &Method, target: &str) {
        if self.requests.len() >= REQUEST_LOG {
            self.requests.pop_front();
        }
        self.requests.push_back(format!("{method} {target}"));
    }

    fn take_failure(&mut self, method: &Method, target: &str) -> Option<u16> {
        let f = self.failures.iter_mut().find(|f| {
            f.remaining > 0 && f.method == method.as_str() && target.starts_with(&f.prefix)
        })?;
        f.remaining -= 1;
        let status = f.status;
        self.failures.retain(|f| f.remaining > 0);
        Some(status)
    }

    /// The delay of a late request, and whether it acts first.
    fn take_late(&mut self, method: &Method, target: &str) -> Option<(Duration, bool)> {
        let l = self.late.iter_mut().find(|l| {
            l.remaining > 0 && l.method == method.as_str() && target.starts_with(&l.prefix)
        })?;
        l.remaining -= 1;
        let late = (l.delay, l.act_first);
        self.late.retain(|l| l.remaining > 0);
        Some(late)
    }

    fn get(&self, kind: Kind, ns: &str, name: &str) -> Option<Arc<Value>> {
        self.objects
            .get(&(kind, ns.to_string(), name.to_string()))
            .cloned()
    }

    /// Stores (or removes) an object under a new resourceVersion and records
    /// the event.
    fn commit(
        &mut self,
        kind: Kind,
        ns: &str,
        name: &str,
        mut obj: Value,
        etype: EventType,
    ) -> Arc<Value> {
        self.rv += 1;
        let rv = self.rv;
        obj["metadata"]["resourceVersion"] = Value::String(rv.to_string());
        let obj = Arc::new(obj);
        let key = (kind, ns.to_string(), name.to_string());
        let prev = if etype == EventType::Deleted {
            self.objects.remove(&key)
        } else {
            self.objects.insert(key, obj.clone())
        };
        self.history.push_back(Event {
            rv,
            kind,
            ns: ns.to_string(),
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
    fn modify(&mut self, key: &Key, f: impl FnOnce(&mut Value)) -> Option<Arc<Value>> {
        let cur = self.objects.get(key)?.clone();
        let mut next = (*cur).clone();
        f(&mut next);
        if next == *cur {
            return Some(cur);
        }
        Some(self.commit(key.0, &key.1, &key.2, next, EventType::Modified))
    }

    fn pod_key(&self, uid: &str) -> Option<Key> {
        self.objects
            .iter()
            .find(|(k, o)| k.0 == Kind::Pod && s(o, "/metadata/uid") == uid)
            .map(|(k, _)| k.clone())
    }

    fn create(
        &mut self,
        kind: Kind,
        ns: &str,
        body: Value,
        dry_run: bool,
    ) -> Result<Arc<Value>, ApiError> {
        let mut obj = kind.decode(body)?;
        let given_ns = s(&obj, "/metadata/namespace");
        if !given_ns.is_empty() && given_ns != ns {
            return Err(ApiError::bad_request(
                "the namespace of the provided object does not match the namespace sent on the \
                 request"
                    .into(),
            ));
        }
        let mut name = s(&obj, "/metadata/name").to_string();
        let generate = s(&obj, "/metadata/generateName").to_string();
        if name.is_empty() && !generate.is_empty() {
            for _ in 0..8 {
                let candidate = generated_name(&generate);
                if self.get(kind, ns, &candidate).is_none() {
                    name = candidate;
                    break;
                }
            }
        }
        if name.is_empty() {
            return Err(ApiError::invalid(
                kind,
                "",
                vec![Cause::required(
                    "metadata.name",
                    "name or generateName is required",
                )],
            ));
        }
        obj["metadata"]["name"] = Value::String(name.clone());
        obj["metadata"]["namespace"] = Value::String(ns.to_string());
        let mut causes = Vec::new();
        if !is_dns_subdomain(&name) {
            causes.push(Cause::invalid("metadata.name", &name, DNS_SUBDOMAIN_MSG));
        }
        causes.extend(validate_meta(&obj));
        match kind {
            Kind::Pod => causes.extend(prepare_pod(&mut obj)),
            Kind::Secret => {
                fold_string_data(&mut obj);
                if s(&obj, "/type").is_empty() {
                    obj["type"] = json!("Opaque");
                }
                causes.extend(validate_secret(&obj));
            }
            Kind::ConfigMap => causes.extend(validate_config_map(&obj)),
            Kind::Node => {}
        }
        if !causes.is_empty() {
            return Err(ApiError::invalid(kind, &name, causes));
        }
        if self.get(kind, ns, &name).is_some() {
            return Err(ApiError::already_exists(kind, &name));
        }
        let meta = obj["metadata"].as_object_mut().expect("metadata");
        for server_owned in [
            "resourceVersion",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "managedFields",
            "selfLink",
            "generation",
        ] {
            meta.remove(server_owned);
        }
        let uid = new_uid();
        meta.insert("uid".into(), Value::String(uid.clone()));
        meta.insert("creationTimestamp".into(), Value::String(now_rfc3339()));
        if dry_run {
            return Ok(Arc::new(obj));
        }
        let obj = self.commit(kind, ns, &name, obj, EventType::Added);
        if kind == Kind::Pod {
            self.order.insert(uid, self.rv);
        }
        Ok(obj)
    }

    /// PUT, or PATCH once the patch is applied: `body` is the whole new
    /// object.
    fn update(
        &mut self,
        kind: Kind,
        ns: &str,
        name: &str,
        body: Value,
        sub: Sub,
        dry_run: bool,
    ) -> Result<Arc<Value>, ApiError> {
        let key = (kind, ns.to_string(), name.to_string());
        let old = self
            .objects
            .get(&key)
            .cloned()
            .ok_or_else(|| ApiError::not_found(kind, name))?;
        let mut new = kind.decode(body)?;
        let given = s(&new, "/metadata/name");
        if !given.is_empty() && given != name {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({given}) does not match the name on the URL ({name})"
            )));
        }
        let given = s(&new, "/metadata/namespace");
        if !given.is_empty() && given != ns {
            return Err(ApiError::bad_request(
                "the namespace of the provided object does not match the namespace sent on the \
                 request"
                    .into(),
            ));
        }
        let want_rv = s(&new, "/metadata/resourceVersion");
        if !want_rv.is_empty() && want_rv != s(&old, "/metadata/resourceVersion") {
            return Err(ApiError::conflict(
                kind,
                name,
                "the object has been modified; please apply your changes to the latest version \
                 and try again",
            ));
        }
        let want_uid = s(&new, "/metadata/uid");
        let old_uid = s(&old, "/metadata/uid");
        if !want_uid.is_empty() && want_uid != old_uid {
            return Err(ApiError::conflict(
                kind,
                name,
                &format!(
                    "Precondition failed: UID in precondition: {want_uid}, UID in object meta: \
                     {old_uid}"
                ),
            ));
        }
        if sub == Sub::Status {
            let status = new["status"].take();
            new = (*old).clone();
            new["status"] = status;
        }
        {
            let meta = new["metadata"].as_object_mut().expect("metadata");
            for server_owned in [
                "name",
                "namespace",
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "resourceVersion",
            ] {
                match old["metadata"].get(server_owned) {
                    Some(v) => meta.insert(server_owned.into(), v.clone()),
                    None => meta.remove(server_owned),
                };
            }
            meta.remove("managedFields");
        }
        let mut causes = validate_meta(&new);
        if old.pointer("/metadata/deletionTimestamp").is_some() {
            let had = arr(&old, "/metadata/finalizers");
            let added: Vec<&str> = arr(&new, "/metadata/finalizers")
                .iter()
                .filter(|f| !had.contains(f))
                .filter_map(Value::as_str)
                .collect();
            if !added.is_empty() {
                causes.push(Cause::forbidden(
                    "metadata.finalizers",
                    &format!(
                        "no new finalizers can be added if the object is being deleted, found \
                         new finalizers {added:?}"
                    ),
                ));
            }
        }
        match kind {
            Kind::Pod if sub == Sub::Main => {
                new["status"] = old["status"].clone();
                default_pod_spec(&mut new["spec"]);
                if new["spec"] != old["spec"] {
                    causes.push(Cause::forbidden("spec", POD_SPEC_IMMUTABLE));
                }
            }
            Kind::Secret => {
                fold_string_data(&mut new);
                if s(&new, "/type").is_empty() {
                    new["type"] = json!("Opaque");
                }
                if new["type"] != old["type"] {
                    causes.push(Cause::invalid(
                        "type",
                        s(&new, "/type"),
                        "field is immutable",
                    ));
                }
                if old["immutable"] == json!(true)
                    && (new["data"] != old["data"] || new["immutable"] != old["immutable"])
                {
                    causes.push(Cause::forbidden(
                        "data",
                        "field is immutable when `immutable` is set",
                    ));
                }
                causes.extend(validate_secret(&new));
            }
            Kind::ConfigMap => {
                if old["immutable"] == json!(true)
                    && (new["data"] != old["data"]
                        || new["binaryData"] != old["binaryData"]
                        || new["immutable"] != old["immutable"])
                {
                    causes.push(Cause::forbidden(
                        "data",
                        "field is immutable when `immutable` is set",
                    ));
                }
                causes.extend(validate_config_map(&new));
            }
            _ => {}
        }
        if !causes.is_empty() {
            return Err(ApiError::invalid(kind, name, causes));
        }
        if new == *old {
            return Ok(old);
        }
        if dry_run {
            return Ok(Arc::new(new));
        }
        let obj = self.commit(kind, ns, name, new, EventType::Modified);
        // the last finalizer gone: a terminating object goes (a pod goes
        // when the kubelet is done with it)
        if kind != Kind::Pod
            && obj.pointer("/metadata/deletionTimestamp").is_some()
            && arr(&obj, "/metadata/finalizers").is_empty()
        {
            self.remove(&key);
        }
        Ok(obj)
    }

    /// DELETE: `(the object as answered, whether it is gone)`.
    fn delete(
        &mut self,
        kind: Kind,
        ns: &str,
        name: &str,
        opts: &DeleteOptions,
    ) -> Result<(Arc<Value>, bool), ApiError> {
        let key = (kind, ns.to_string(), name.to_string());
        let cur = self
            .objects
            .get(&key)
            .cloned()
            .ok_or_else(|| ApiError::not_found(kind, name))?;
        let uid = s(&cur, "/metadata/uid").to_string();
        if let Some(want) = &opts.uid
            && *want != uid
        {
            return Err(ApiError::conflict(
                kind,
                name,
                &format!(
                    "Precondition failed: UID in precondition: {want}, UID in object meta: {uid}"
                ),
            ));
        }
        let rv = s(&cur, "/metadata/resourceVersion");
        if let Some(want) = &opts.rv
            && want != rv
        {
            return Err(ApiError::conflict(
                kind,
                name,
                &format!(
                    "Precondition failed: ResourceVersion in precondition: {want}, \
                     ResourceVersion in object meta: {rv}"
                ),
            ));
        }
        if opts.dry_run {
            return Ok((cur, false));
        }
        if opts.policy.as_deref() == Some("Orphan") {
            self.orphan_dependents(ns, &uid);
        }
        if kind != Kind::Pod {
            return Ok(self.remove(&key));
        }
        let grace = opts.grace.unwrap_or_else(|| {
            cur.pointer("/spec/terminationGracePeriodSeconds")
                .and_then(Value::as_u64)
                .unwrap_or(DEFAULT_GRACE_SECS)
        });
        // the apiserver deletes at once what no kubelet runs
        let immediate = grace == 0 || s(&cur, "/spec/nodeName").is_empty() || is_terminal(&cur);
        let terminating = cur
            .pointer("/metadata/deletionGracePeriodSeconds")
            .and_then(Value::as_u64);
        if immediate {
            return Ok(self.remove(&key));
        }
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

    /// Removes an object, unless finalizers hold it (then it is only marked
    /// for deletion).
    fn remove(&mut self, key: &Key) -> (Arc<Value>, bool) {
        let cur = self.objects.get(key).cloned().expect("an object to remove");
        if !arr(&cur, "/metadata/finalizers").is_empty() {
            let now = now_rfc3339();
            let obj = self
                .modify(key, |o| {
                    if o.pointer("/metadata/deletionTimestamp").is_none() {
                        o["metadata"]["deletionTimestamp"] = Value::String(now);
                        o["metadata"]["deletionGracePeriodSeconds"] = json!(0);
                    }
                })
                .expect("the object");
            return (obj, false);
        }
        let obj = self.commit(key.0, &key.1, &key.2, (*cur).clone(), EventType::Deleted);
        if key.0 == Kind::Pod {
            self.order.remove(s(&obj, "/metadata/uid"));
        }
        (obj, true)
    }

    fn orphan_dependents(&mut self, ns: &str, uid: &str) {
        let dependents: Vec<Key> = self
            .objects
            .iter()
            .filter(|(k, o)| {
                k.1 == ns
                    && arr(o, "/metadata/ownerReferences")
                        .iter()
                        .any(|r| s(r, "/uid") == uid)
            })
            .map(|(k, _)| k.clone())
            .collect();
        for key in dependents {
            self.modify(&key, |o| {
                let meta = o["metadata"].as_object_mut().expect("metadata");
                if let Some(Value::Array(refs)) = meta.get_mut("ownerReferences") {
                    refs.retain(|r| s(r, "/uid") != uid);
                    if refs.is_empty() {
                        meta.remove("ownerReferences");
                    }
                }
            });
        }
    }

    /// The garbage collector: deletes every object none of whose owners
    /// exists any more.
    fn collect_garbage(&mut self) {
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

    fn owner_exists(&self, ns: &str, owner: &Value) -> bool {
        let kind = match (s(owner, "/apiVersion"), s(owner, "/kind")) {
            ("v1", "Pod") => Kind::Pod,
            ("v1", "Secret") => Kind::Secret,
            ("v1", "ConfigMap") => Kind::ConfigMap,
            ("v1", "Node") => Kind::Node,
            // a kind this server does not serve: assume it exists
            _ => return true,
        };
        let ns = if kind.namespaced() { ns } else { "" };
        self.get(kind, ns, s(owner, "/name"))
            .is_some_and(|o| s(&o, "/metadata/uid") == s(owner, "/uid"))
    }

    fn disrupt(&mut self, key: &Key, reason: &str) {
        let message = disruption_message(reason);
        self.modify(key, |p| {
            set_condition(p, "DisruptionTarget", "True", Some(reason), Some(message));
        });
    }

    // -- scheduler and kubelet -------------------------------------------

    /// One pass of the garbage collector, scheduler and kubelet; returns the
    /// process work to do outside the lock.
    fn reconcile(&mut self, dir: &Path) -> Vec<Action> {
        let mut actions = Vec::new();
        if self.stopping {
            return actions;
        }
        self.collect_garbage();
        self.schedule();
        // containers of pods that were force-deleted
        let live: HashSet<String> = self
            .objects
            .iter()
            .filter(|(k, _)| k.0 == Kind::Pod)
            .map(|(_, o)| s(o, "/metadata/uid").to_string())
            .collect();
        for (uid, kl) in &mut self.kubelet {
            if !live.contains(uid)
                && let Some(pid) = kl.running
                && !kl.kill_sent
            {
                kl.kill_sent = true;
                actions.push(Action::Signal(pid, Signal::Kill, true));
            }
        }
        self.kubelet
            .retain(|uid, kl| live.contains(uid) || kl.running.is_some());
        let pods: Vec<(Key, bool)> = self
            .objects
            .iter()
            .filter(|(k, _)| k.0 == Kind::Pod)
            .map(|(k, o)| (k.clone(), s(o, "/spec/nodeName") == NODE))
            .collect();
        for (key, on_node) in pods {
            if on_node {
                self.sync_pod(&key, dir, &mut actions);
            } else if let Some(pod) = self.objects.get(&key)
                && pod.pointer("/metadata/deletionTimestamp").is_some()
                && arr(pod, "/metadata/finalizers").is_empty()
            {
                // unbound and its finalizers gone
                self.remove(&key);
            }
        }
        actions
    }

    /// Binds pending pods that fit, in priority then creation order.
    fn schedule(&mut self) {
        let mut used: u64 = self
            .objects
            .iter()
            .filter(|(k, o)| k.0 == Kind::Pod && s(o, "/spec/nodeName") == NODE && !is_terminal(o))
            .map(|(_, o)| pod_gpus(o))
            .sum();
        let mut pending: Vec<(i64, u64, Key)> = self
            .objects
            .iter()
            .filter(|(k, o)| {
                k.0 == Kind::Pod
                    && s(o, "/spec/nodeName").is_empty()
                    && s(o, "/spec/schedulerName") == "default-scheduler"
                    && o.pointer("/metadata/deletionTimestamp").is_none()
                    && !is_terminal(o)
            })
            .map(|(k, o)| {
                let priority = o.pointer("/spec/priority").and_then(Value::as_i64);
                let seq = self.order.get(s(o, "/metadata/uid")).copied();
                (-priority.unwrap_or(0), seq.unwrap_or(u64::MAX), k.clone())
            })
            .collect();
        pending.sort();
        for (_, _, key) in pending {
            let pod = self.objects[&key].clone();
            if !node_matches(&pod) {
                self.modify(&key, |p| {
                    set_condition(
                        p,
                        "PodScheduled",
                        "False",
                        Some("Unschedulable"),
                        Some(SELECTOR_MISMATCH),
                    );
                });
                continue;
            }
            let need = pod_gpus(&pod);
            if used + need <= u64::from(self.gpus) {
                used += need;
                self.modify(&key, |p| {
                    p["spec"]["nodeName"] = json!(NODE);
                    set_condition(p, "PodScheduled", "True", None, None);
                });
            } else {
                self.modify(&key, |p| {
                    set_condition(
                        p,
                        "PodScheduled",
                        "False",
                        Some("Unschedulable"),
                        Some(INSUFFICIENT_GPU),
                    );
                });
            }
        }
    }

    fn sync_pod(&mut self, key: &Key, dir: &Path, actions: &mut Vec<Action>) {
        let Some(pod) = self.objects.get(key).cloned() else {
            return;
        };
        let uid = s(&pod, "/metadata/uid").to_string();
        let mut kl = self.kubelet.remove(&uid).unwrap_or_default();
        self.sync_pod_with(key, &pod, &mut kl, dir, actions);
        self.kubelet.insert(uid, kl);
    }

    fn sync_pod_with(
        &mut self,
        key: &Key,
        pod: &Value,
        kl: &mut Kubelet,
        dir: &Path,
        actions: &mut Vec<Action>,
    ) {
        let terminal = is_terminal(pod);
        if pod.pointer("/metadata/deletionTimestamp").is_some() {
            match kl.running {
                Some(pid) => {
                    let grace = pod
                        .pointer("/metadata/deletionGracePeriodSeconds")
                        .and_then(Value::as_u64)
                        .unwrap_or(0);
                    let now = Instant::now();
                    let deadline = now + Duration::from_secs(grace);
                    match kl.kill_at {
                        None => {
                            kl.kill_at = Some(deadline);
                            actions.push(Action::Signal(pid, Signal::Term, false));
                        }
                        Some(at) if deadline < at => kl.kill_at = Some(deadline),
                        Some(_) => {}
                    }
                    if kl.kill_at.is_some_and(|at| at <= now) && !kl.kill_sent {
                        kl.kill_sent = true;
                        actions.push(Action::Signal(pid, Signal::Kill, true));
                    }
                }
                None => {
                    // nothing runs: the kubelet gives the pod a terminal
                    // phase and confirms the deletion
                    if !terminal {
                        let now = now_rfc3339();
                        self.modify(key, |p| {
                            let why =
                                "The container could not be located when the pod was terminated";
                            terminate(
                                p,
                                137,
                                "ContainerStatusUnknown",
                                Some(why),
                                "",
                                &now,
                                "",
                                "",
                            );
                        });
                    }
                    self.remove(key);
                }
            }
            return;
        }
        if terminal || kl.started {
            return;
        }
        if !kl.admitted {
            let need = pod_gpus(pod);
            let used: u64 = self
                .objects
                .iter()
                .filter(|(k, o)| {
                    k.0 == Kind::Pod
                        && s(o, "/spec/nodeName") == NODE
                        && !is_terminal(o)
                        && self
                            .kubelet
                            .get(s(o, "/metadata/uid"))
                            .is_some_and(|k| k.admitted)
                })
                .map(|(_, o)| pod_gpus(o))
                .sum();
            let capacity = u64::from(self.gpus);
            if used + need > capacity {
                kl.started = true;
                let message = format!(
                    "Pod was rejected: Node didn't have enough resource: {GPU}, requested: {need}, \
                     used: {used}, capacity: {capacity}"
                );
                self.modify(key, |p| {
                    p["status"]["phase"] = json!("Failed");
                    p["status"]["reason"] = Value::String(format!("OutOf{GPU}"));
                    p["status"]["message"] = Value::String(message);
                });
                return;
            }
            kl.admitted = true;
        }
        let now = now_rfc3339();
        self.modify(key, |p| first_sync(p, &now));
        match self.plan(pod, kl, dir) {
            Ok(launch) => {
                kl.started = true;
                actions.push(Action::Start(Box::new(launch)));
            }
            Err(w) => {
                self.modify(key, |p| set_waiting(p, &w.reason, w.message.as_deref()));
            }
        }
    }

    /// Everything needed to start a pod's container, or why it cannot
    /// start yet — in the kubelet's order: volumes, image, config.
    fn plan(&self, pod: &Value, kl: &mut Kubelet, dir: &Path) -> Result<Launch, Waiting> {
        let ns = s(pod, "/metadata/namespace");
        let name = s(pod, "/metadata/name");
        let uid = s(pod, "/metadata/uid");
        let container = &pod["spec"]["containers"][0];
        let pod_dir = dir.join("pods").join(format!("{ns}_{name}_{uid}"));
        // volumes
        let mut dirs = vec![pod_dir.join("work")];
        let mut files = Vec::new();
        let mut hosts: HashMap<String, PathBuf> = HashMap::new();
        for v in arr(pod, "/spec/volumes") {
            let vname = s(v, "/name");
            let vdir = pod_dir.join("volumes").join(vname);
            let mount_failed = |what: String| Waiting {
                reason: "ContainerCreating".into(),
                message: Some(format!(
                    "MountVolume.SetUp failed for volume \"{vname}\" : {what}"
                )),
            };
            if let Some(hp) = v.pointer("/hostPath/path").and_then(Value::as_str) {
                hosts.insert(vname.into(), PathBuf::from(hp));
                continue;
            }
            dirs.push(vdir.clone());
            hosts.insert(vname.into(), vdir.clone());
            let (source, kind, ref_name) = if let Some(src) = v.get("secret") {
                (src, Kind::Secret, s(src, "/secretName"))
            } else if let Some(src) = v.get("configMap") {
                (src, Kind::ConfigMap, s(src, "/name"))
            } else {
                continue; // emptyDir
            };
            let optional = source.get("optional") == Some(&json!(true));
            let Some(obj) = self.get(kind, ns, ref_name) else {
                if optional {
                    continue;
                }
                return Err(mount_failed(format!(
                    "{} \"{ref_name}\" not found",
                    kind.name().to_lowercase()
                )));
            };
            let mode = source
                .get("defaultMode")
                .and_then(Value::as_u64)
                .unwrap_or(0o644) as u32;
            let entries: Vec<(String, String, u32)> =
                match source.get("items").and_then(Value::as_array) {
                    Some(items) => items
                        .iter()
                        .map(|i| {
                            let m = i
                                .get("mode")
                                .and_then(Value::as_u64)
                                .map_or(mode, |m| m as u32);
                            (s(i, "/key").to_string(), s(i, "/path").to_string(), m)
                        })
                        .collect(),
                    None => object_keys(&obj)
                        .into_iter()
                        .map(|k| (k.clone(), k, mode))
                        .collect(),
                };
            for (k, path, m) in entries {
                match object_value(&obj, &k) {
                    Some(bytes) => files.push((vdir.join(path), bytes, m)),
                    None if optional => {}
                    None => {
                        let what = if kind == Kind::Secret {
                            "secret"
                        } else {
                            "configmap"
                        };
                        return Err(mount_failed(format!(
                            "references non-existent {what} key: {k}"
                        )));
                    }
                }
            }
        }
        let mut mounts: Vec<(String, String)> = Vec::new();
        for m in arr(container, "/volumeMounts") {
            let Some(host) = hosts.get(s(m, "/name")) else {
                continue;
            };
            let mut host = host.clone();
            let sub = s(m, "/subPath");
            if !sub.is_empty() {
                host = host.join(sub);
            }
            let mut path = s(m, "/mountPath").to_string();
            while path.len() > 1 && path.ends_with('/') {
                path.pop();
            }
            mounts.push((path, host.display().to_string()));
        }
        mounts.sort_by_key(|m| std::cmp::Reverse(m.0.len()));
        // image
        let image = s(container, "/image").to_string();
        let Some(image_program) = local_image(&image) else {
            let now = Instant::now();
            let pull = kl.pull.get_or_insert(Pull {
                next: now,
                backoff: Duration::from_secs(10),
                in_backoff: true,
            });
            if now >= pull.next {
                if pull.in_backoff {
                    pull.in_backoff = false;
                    pull.next = now + Duration::from_secs(1);
                } else {
                    pull.in_backoff = true;
                    pull.next = now + pull.backoff;
                    pull.backoff = (pull.backoff * 2).min(Duration::from_secs(300));
                }
            }
            return Err(if pull.in_backoff {
                Waiting {
                    reason: "ImagePullBackOff".into(),
                    message: Some(format!("Back-off pulling image \"{image}\"")),
                }
            } else {
                Waiting {
                    reason: "ErrImagePull".into(),
                    message: Some(format!(
                        "rpc error: code = NotFound desc = failed to pull and unpack image \
                         \"{image}\": not found (the MiniKube test double runs only the images \
                         \"local\" and \"local/<program>\")"
                    )),
                }
            });
        };
        kl.pull = None;
        // config
        let mut env = self.resolve_env(pod, container)?;
        let strings = |p: &str| -> Vec<String> {
            arr(container, p)
                .iter()
                .map(|v| v.as_str().unwrap_or_default().to_string())
                .collect()
        };
        let mut argv: Vec<String> = strings("/command");
        if argv.is_empty() {
            match image_program {
                Some(p) => argv.push(p),
                None => {
                    return Err(Waiting {
                        reason: "CreateContainerError".into(),
                        message: Some(format!(
                            "failed to generate container spec: no command specified (image \
                             \"{image}\" has no entrypoint: give a command, or use \
                             \"local/<program>\")"
                        )),
                    });
                }
            }
        }
        argv.extend(strings("/args"));
        let argv: Vec<String> = argv
            .iter()
            .map(|a| substitute(&expand(a, &env), &mounts))
            .collect();
        for (_, v) in &mut env {
            *v = substitute(v, &mounts);
        }
        let mut full_env: Vec<(String, String)> = Vec::new();
        for var in ["PATH", "HOME"] {
            if let Ok(v) = std::env::var(var) {
                full_env.push((var.into(), v));
            }
        }
        full_env.push(("HOSTNAME".into(), name.into()));
        full_env.extend(env);
        Ok(Launch {
            uid: uid.into(),
            program: argv[0].clone(),
            args: argv[1..].to_vec(),
            env: full_env,
            work: pod_dir.join("work"),
            log: dir.join("logs").join(format!("{ns}_{name}_{uid}.log")),
            dirs,
            files,
            image_id: format!("{image}@sha256:{}", digest(&image)),
            container_id: format!("containerd://{}", random_hex(64)),
        })
    }

    /// A container's environment, as the kubelet builds it: `envFrom` in
    /// order, then `env` in order, each `$(VAR)` expanded against what came
    /// before.
    fn resolve_env(&self, pod: &Value, c: &Value) -> Result<Vec<(String, String)>, Waiting> {
        let ns = s(pod, "/metadata/namespace");
        let mut env: Vec<(String, String)> = Vec::new();
        fn set(env: &mut Vec<(String, String)>, k: String, v: String) {
            match env.iter_mut().find(|e| e.0 == k) {
                Some(e) => e.1 = v,
                None => env.push((k, v)),
            }
        }
        let config_error = |message: String| Waiting {
            reason: "CreateContainerConfigError".into(),
            message: Some(message),
        };
        for from in arr(c, "/envFrom") {
            let prefix = s(from, "/prefix");
            let (kind, source) = match (from.get("secretRef"), from.get("configMapRef")) {
                (Some(r), _) => (Kind::Secret, r),
                (None, Some(r)) => (Kind::ConfigMap, r),
                _ => continue,
            };
            let name = s(source, "/name");
            match self.get(kind, ns, name) {
                Some(obj) => {
                    for k in object_keys(&obj) {
                        let value = object_value(&obj, &k).unwrap_or_default();
                        let var = format!("{prefix}{k}");
                        if is_env_name(&var) {
                            set(&mut env, var, String::from_utf8_lossy(&value).into_owned());
                        }
                    }
                }
                None if source.get("optional") == Some(&json!(true)) => {}
                None => {
                    return Err(config_error(format!(
                        "{} \"{name}\" not found",
                        kind.name().to_lowercase()
                    )));
                }
            }
        }
        for e in arr(c, "/env") {
            let var = s(e, "/name").to_string();
            let Some(from) = e.get("valueFrom") else {
                let v = expand(s(e, "/value"), &env);
                set(&mut env, var, v);
                continue;
            };
            let keyed = match (from.get("secretKeyRef"), from.get("configMapKeyRef")) {
                (Some(r), _) => Some((Kind::Secret, r)),
                (None, Some(r)) => Some((Kind::ConfigMap, r)),
                _ => None,
            };
            if let Some((kind, r)) = keyed {
                let (name, key) = (s(r, "/name"), s(r, "/key"));
                let optional = r.get("optional") == Some(&json!(true));
                let value = match self.get(kind, ns, name) {
                    None if optional => continue,
                    None => {
                        return Err(config_error(format!(
                            "{} \"{name}\" not found",
                            kind.name().to_lowercase()
                        )));
                    }
                    Some(obj) => match object_value(&obj, key) {
                        Some(v) => v,
                        None if optional => continue,
                        None => {
                            return Err(config_error(format!(
                                "couldn't find key {key} in {} {ns}/{name}",
                                kind.name()
                            )));
                        }
                    },
                };
                set(&mut env, var, String::from_utf8_lossy(&value).into_owned());
            } else if let Some(path) = from.pointer("/fieldRef/fieldPath").and_then(Value::as_str) {
                let v = field_ref(pod, path)
                    .ok_or_else(|| config_error(format!("unsupported fieldPath: {path}")))?;
                set(&mut env, var, v);
            }
        }
        Ok(env)
    }

    /// The kubelet saw its container start.
    fn container_started(&mut self, l: &Launch, pid: u32) -> bool {
        let now = now_rfc3339();
        let kl = self.kubelet.entry(l.uid.clone()).or_default();
        kl.running = Some(pid);
        kl.container_id = l.container_id.clone();
        kl.image_id = l.image_id.clone();
        kl.started_at = now.clone();
        if self.stopping {
            return false;
        }
        let Some(key) = self.pod_key(&l.uid) else {
            return false;
        };
        self.modify(&key, |p| run(p, &now, &l.container_id, &l.image_id));
        true
    }

    fn container_failed_to_start(&mut self, l: &Launch, err: &std::io::Error) {
        let Some(key) = self.pod_key(&l.uid) else {
            return;
        };
        let message = if err.kind() == std::io::ErrorKind::NotFound {
            format!(
                "failed to create containerd task: failed to create shim task: OCI runtime \
                 create failed: runc create failed: unable to start container process: exec: \
                 \"{}\": executable file not found in $PATH: unknown",
                l.program
            )
        } else {
            format!(
                "failed to create containerd task: unable to start container process: exec: \
                 \"{}\": {err}",
                l.program
            )
        };
        let now = now_rfc3339();
        self.modify(&key, |p| {
            terminate(
                p,
                128,
                "StartError",
                Some(message.as_str()),
                "1970-01-01T00:00:00Z",
                &now,
                &l.container_id,
                &l.image_id,
            );
        });
    }

    fn container_exited(&mut self, uid: &str, code: i32) {
        let Some(kl) = self.kubelet.get_mut(uid) else {
            return;
        };
        kl.running = None;
        let (started_at, cid, iid) = (
            kl.started_at.clone(),
            kl.container_id.clone(),
            kl.image_id.clone(),
        );
        let Some(key) = self.pod_key(uid) else {
            return;
        };
        let reason = if code == 0 { "Completed" } else { "Error" };
        let now = now_rfc3339();
        self.modify(&key, |p| {
            if !is_terminal(p) {
                terminate(p, code, reason, None, &started_at, &now, &cid, &iid);
            }
        });
    }
}

/// Process work the kubelet does outside the lock.
#[derive(Debug)]
enum Action {
    /// A signal, to the process or (when true) its whole group.
    Signal(u32, Signal, bool),
    Start(Box<Launch>),
}

/// A container, ready to start.
#[derive(Debug)]
struct Launch {
    uid: String,
    program: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    work: PathBuf,
    log: PathBuf,
    dirs: Vec<PathBuf>,
    files: Vec<(PathBuf, Vec<u8>, u32)>,
    image_id: String,
    container_id: String,
}

/// Why a container is not running yet: its `state.waiting`.
#[derive(Debug)]
struct Waiting {
    reason: String,
    message: Option<String>,
}

/// The scheduler, garbage collector and kubelet: a pass after every change,
/// and every [`RESYNC`].
async fn kubelet(sh: Arc<Shared>) {
    let mut changes = sh.lock().notify.subscribe();
    loop {
        let actions = sh.lock().reconcile(&sh.dir);
        for action in actions {
            match action {
                Action::Signal(pid, sig, group) => signal(pid, sig, group),
                Action::Start(launch) => start_container(&sh, *launch).await,
            }
        }
        tokio::select! {
            changed = changes.changed() => if changed.is_err() { return },
            () = tokio::time::sleep(RESYNC) => {}
        }
    }
}

async fn start_container(sh: &Arc<Shared>, l: Launch) {
    let spawned = prepare_files(&l).and_then(|log| {
        let mut cmd = tokio::process::Command::new(&l.program);
        cmd.args(&l.args)
            .env_clear()
            .envs(l.env.iter().map(|(k, v)| (k, v)))
            .current_dir(&l.work)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0)
            .kill_on_drop(true);
        cmd.spawn()
    });
    match spawned {
        Err(e) => sh.lock().container_failed_to_start(&l, &e),
        Ok(child) => {
            let Some(pid) = child.id() else {
                return;
            };
            let keep = sh.lock().container_started(&l, pid);
            if !keep {
                signal(pid, Signal::Kill, true);
            }
            tokio::spawn(wait_container(sh.clone(), l.uid, pid, child));
        }
    }
}

/// The container's folders and volume files; its log file.
fn prepare_files(l: &Launch) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::PermissionsExt;
    for d in &l.dirs {
        std::fs::create_dir_all(d)?;
    }
    for (path, bytes, mode) in &l.files {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(path, bytes)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(*mode))?;
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&l.log)
}

async fn wait_container(sh: Arc<Shared>, uid: String, pid: u32, mut child: tokio::process::Child) {
    let status = child.wait().await;
    // the container is gone with its main process: end the rest of it
    signal(pid, Signal::Kill, true);
    let code = match status {
        Ok(s) => s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(9)),
        Err(_) => 128 + 9,
    };
    sh.lock().container_exited(&uid, code);
}

/// A signal to a process, or to its process group (through `kill(2)`; one
/// already gone is no error).
fn signal(pid: u32, sig: Signal, group: bool) {
    let _ = if group {
        tidegate_kit::signal::send_group(pid, sig)
    } else {
        tidegate_kit::signal::send(pid, sig)
    };
}

/// A signal to whole process groups, from outside the runtime.
fn signal_sync(pids: &[u32], sig: Signal) {
    for &pid in pids {
        let _ = tidegate_kit::signal::send_group(pid, sig);
    }
}

// ---------------------------------------------------------------------------
// Pod status, as the scheduler and kubelet write it

fn is_terminal(pod: &Value) -> bool {
    matches!(s(pod, "/status/phase"), "Succeeded" | "Failed")
}

fn set_condition(
    pod: &mut Value,
    ctype: &str,
    status: &str,
    reason: Option<&str>,
    message: Option<&str>,
) {
    if !pod["status"]["conditions"].is_array() {
        pod["status"]["conditions"] = json!([]);
    }
    let conditions = pod["status"]["conditions"]
        .as_array_mut()
        .expect("conditions");
    let i = match conditions.iter().position(|c| s(c, "/type") == ctype) {
        Some(i) => i,
        None => {
            conditions.push(json!({"type": ctype, "status": "Unknown", "lastProbeTime": null}));
            conditions.len() - 1
        }
    };
    let c = conditions[i].as_object_mut().expect("a condition");
    if c.get("status").and_then(Value::as_str) != Some(status) {
        c.insert("status".into(), json!(status));
        c.insert("lastTransitionTime".into(), Value::String(now_rfc3339()));
    }
    for (field, value) in [("reason", reason), ("message", message)] {
        match value {
            Some(v) => c.insert(field.into(), json!(v)),
            None => c.remove(field),
        };
    }
}

fn container_status(
    pod: &Value,
    state: Value,
    ready: bool,
    started: bool,
    cid: &str,
    iid: &str,
) -> Value {
    let c = &pod["spec"]["containers"][0];
    let mut status = json!({
        "name": s(c, "/name"),
        "state": state,
        "lastState": {},
        "ready": ready,
        "restartCount": 0,
        "image": s(c, "/image"),
        "imageID": iid,
        "started": started,
    });
    if !cid.is_empty() {
        status["containerID"] = json!(cid);
    }
    status
}

/// The kubelet's first status: startTime, hostIP, the container creating.
fn first_sync(pod: &mut Value, now: &str) {
    if pod.pointer("/status/startTime").is_some() {
        return;
    }
    pod["status"]["startTime"] = json!(now);
    pod["status"]["hostIP"] = json!(POD_IP);
    pod["status"]["hostIPs"] = json!([{"ip": POD_IP}]);
    let cname = s(pod, "/spec/containers/0/name").to_string();
    let unready = format!("containers with unready status: [{cname}]");
    set_condition(pod, "PodReadyToStartContainers", "False", None, None);
    set_condition(pod, "Initialized", "True", None, None);
    set_condition(
        pod,
        "Ready",
        "False",
        Some("ContainersNotReady"),
        Some(&unready),
    );
    set_condition(
        pod,
        "ContainersReady",
        "False",
        Some("ContainersNotReady"),
        Some(&unready),
    );
    let status = container_status(
        pod,
        json!({"waiting": {"reason": "ContainerCreating"}}),
        false,
        false,
        "",
        "",
    );
    pod["status"]["containerStatuses"] = json!([status]);
}

fn set_waiting(pod: &mut Value, reason: &str, message: Option<&str>) {
    let mut waiting = json!({"reason": reason});
    if let Some(m) = message {
        waiting["message"] = json!(m);
    }
    let status = container_status(pod, json!({ "waiting": waiting }), false, false, "", "");
    pod["status"]["containerStatuses"] = json!([status]);
}

fn run(pod: &mut Value, now: &str, cid: &str, iid: &str) {
    pod["status"]["phase"] = json!("Running");
    pod["status"]["podIP"] = json!(POD_IP);
    pod["status"]["podIPs"] = json!([{"ip": POD_IP}]);
    set_condition(pod, "PodReadyToStartContainers", "True", None, None);
    set_condition(pod, "Ready", "True", None, None);
    set_condition(pod, "ContainersReady", "True", None, None);
    let status = container_status(
        pod,
        json!({"running": {"startedAt": now}}),
        true,
        true,
        cid,
        iid,
    );
    pod["status"]["containerStatuses"] = json!([status]);
}

/// The container ended (restartPolicy Never): the pod's phase follows its
/// exit code.
#[allow(clippy::too_many_arguments)]
fn terminate(
    pod: &mut Value,
    code: i32,
    reason: &str,
    message: Option<&str>,
    started_at: &str,
    finished_at: &str,
    cid: &str,
    iid: &str,
) {
    pod["status"]["phase"] = json!(if code == 0 { "Succeeded" } else { "Failed" });
    let mut terminated = json!({"exitCode": code, "reason": reason, "finishedAt": finished_at});
    if !started_at.is_empty() {
        terminated["startedAt"] = json!(started_at);
    }
    if let Some(m) = message {
        terminated["message"] = json!(m);
    }
    if !cid.is_empty() {
        terminated["containerID"] = json!(cid);
    }
    let status = container_status(
        pod,
        json!({ "terminated": terminated }),
        false,
        false,
        cid,
        iid,
    );
    pod["status"]["containerStatuses"] = json!([status]);
    set_condition(pod, "PodReadyToStartContainers", "False", None, None);
    set_condition(pod, "Ready", "False", Some("PodCompleted"), None);
    set_condition(pod, "ContainersReady", "False", Some("PodCompleted"), None);
}

fn disruption_message(reason: &str) -> &'static str {
    match reason {
        "DeletionByTaintManager" => "Taint manager: deleting due to NoExecute taint",
        "PreemptionByScheduler" => {
            "default-scheduler: preempting to accommodate a higher priority pod"
        }
        "EvictionByEvictionAPI" => "Eviction API: evicting",
        "DeletionByPodGC" => "PodGC: node no longer exists",
        "TerminationByKubelet" => "Pod was terminated in response to imminent node shutdown.",
        _ => "MiniKube: the test disrupted this pod",
    }
}

/// GPUs the pod asks for (requests, which default to limits).
fn pod_gpus(pod: &Value) -> u64 {
    arr(pod, "/spec/containers")
        .iter()
        .filter_map(|c| map(c, "/resources/requests").and_then(|r| r.get(GPU)))
        .filter_map(int_quantity)
        .sum()
}

fn node_matches(pod: &Value) -> bool {
    let labels: HashMap<&str, &str> = NODE_LABELS.iter().copied().collect();
    if let Some(selector) = map(pod, "/spec/nodeSelector") {
        for (k, v) in selector {
            if labels.get(k.as_str()).copied() != v.as_str() {
                return false;
            }
        }
    }
    let required = "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution";
    if let Some(req) = pod.pointer(required) {
        let terms = arr(req, "/nodeSelectorTerms");
        let term_matches = |t: &Value| {
            let exprs = arr(t, "/matchExpressions");
            let fields = arr(t, "/matchFields");
            (!exprs.is_empty() || !fields.is_empty())
                && exprs
                    .iter()
                    .all(|e| expr_matches(e, labels.get(s(e, "/key")).copied()))
                && fields
                    .iter()
                    .all(|e| expr_matches(e, (s(e, "/key") == "metadata.name").then_some(NODE)))
        };
        if !terms.iter().any(term_matches) {
            return false;
        }
    }
    true
}

fn expr_matches(e: &Value, value: Option<&str>) -> bool {
    let values: Vec<&str> = arr(e, "/values").iter().filter_map(Value::as_str).collect();
    let num = |v: &str| v.parse::<i64>().ok();
    let bound = values.first().and_then(|v| num(v));
    match s(e, "/operator") {
        "In" => value.is_some_and(|v| values.contains(&v)),
        "NotIn" => !value.is_some_and(|v| values.contains(&v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" => {
            matches!((value.and_then(num), bound), (Some(a), Some(b)) if a > b)
        }
        "Lt" => {
            matches!((value.and_then(num), bound), (Some(a), Some(b)) if a < b)
        }
        _ => false,
    }
}

fn field_ref(pod: &Value, path: &str) -> Option<String> {
    let bracket = |prefix: &str| {
        path.strip_prefix(prefix)
            .and_then(|r| r.strip_suffix("']"))
            .map(str::to_string)
    };
    if let Some(k) = bracket("metadata.labels['") {
        return Some(
            map(pod, "/metadata/labels")
                .and_then(|m| m.get(&k))
                .and_then(Value::as_str)
                .unwrap_or_default()
                .into(),
        );
    }
    if let Some(k) = bracket("metadata.annotations['") {
        return Some(
            map(pod, "/metadata/annotations")
                .and_then(|m| m.get(&k))
                .and_then(Value::as_str)
                .unwrap_or_default()
                .into(),
        );
    }
    Some(match path {
        "metadata.name" => s(pod, "/metadata/name").into(),
        "metadata.namespace" => s(pod, "/metadata/namespace").into(),
        "metadata.uid" => s(pod, "/metadata/uid").into(),
        "spec.nodeName" => s(pod, "/spec/nodeName").into(),
        "spec.serviceAccountName" => s(pod, "/spec/serviceAccountName").into(),
        "status.podIP" | "status.podIPs" | "status.hostIP" | "status.hostIPs" => POD_IP.into(),
        _ => return None,
    })
}

/// `local` → `Some(None)`, `local/sh:tag` → `Some(Some("sh"))`, anything
/// else → `None` (not pullable).
fn local_image(image: &str) -> Option<Option<String>> {
    let image = image.split('@').next().unwrap_or_default();
    let (repo, _tag) = match image.rsplit_once(':') {
        Some((r, t)) if !t.contains('/') => (r, t),
        _ => (image, ""),
    };
    if repo == "local" {
        return Some(None);
    }
    repo.strip_prefix("local/")
        .filter(|p| !p.is_empty())
        .map(|p| Some(p.to_string()))
}

/// The keys of a Secret's `data` or a ConfigMap's `data` and `binaryData`.
fn object_keys(obj: &Value) -> Vec<String> {
    let mut keys: Vec<String> = Vec::new();
    for field in ["/data", "/binaryData"] {
        if let Some(m) = map(obj, field) {
            keys.extend(m.keys().cloned());
        }
    }
    keys.sort();
    keys
}

/// One key of a Secret (decoded) or ConfigMap.
fn object_value(obj: &Value, key: &str) -> Option<Vec<u8>> {
    let kind = s(obj, "/kind");
    if let Some(v) = map(obj, "/data")
        .and_then(|m| m.get(key))
        .and_then(Value::as_str)
    {
        return if kind == "Secret" {
            b64_decode(v)
        } else {
            Some(v.as_bytes().to_vec())
        };
    }
    map(obj, "/binaryData")
        .and_then(|m| m.get(key))
        .and_then(Value::as_str)
        .and_then(b64_decode)
}

/// The kubelet's `$(VAR)` expansion: `$$` is a literal `$`, an unknown
/// `$(VAR)` stays as written.
fn expand(input: &str, env: &[(String, String)]) -> String {
    let mut out = String::new();
    let mut rest = input;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(body) = after.strip_prefix('(')
            && let Some(end) = body.find(')')
        {
            let name = &body[..end];
            match env.iter().find(|(k, _)| k == name) {
                Some((_, v)) => out.push_str(v),
                None => {
                    out.push_str("$(");
                    out.push_str(name);
                    out.push(')');
                }
            }
            rest = &body[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// Replaces each mount path (a whole path prefix) by its host folder.
fn substitute(input: &str, mounts: &[(String, String)]) -> String {
    let mut out = String::new();
    let mut i = 0;
    'scan: while i < input.len() {
        for (from, to) in mounts {
            if input[i..].starts_with(from.as_str()) {
                let end = i + from.len();
                let boundary = input[end..]
                    .chars()
                    .next()
                    .is_none_or(|c| !(c.is_ascii_alphanumeric() || "._-".contains(c)));
                if boundary {
                    out.push_str(to);
                    i = end;
                    continue 'scan;
                }
            }
        }
        let ch = input[i..].chars().next().expect("a char");
        out.push(ch);
        i += ch.len_utf8();
    }
    out
}

fn node_object(gpus: u32) -> Value {
    let labels: Map<String, Value> = NODE_LABELS
        .iter()
        .map(|(k, v)| ((*k).to_string(), json!(v)))
        .collect();
    let resources = json!({
        "cpu": "16", "memory": "131072Mi", "pods": "110", "ephemeral-storage": "64Gi",
        GPU: gpus.to_string(),
    });
    let now = now_rfc3339();
    json!({
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {
            "name": NODE,
            "uid": new_uid(),
            "creationTimestamp": now,
            "labels": labels,
        },
        "spec": {},
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [{
                "type": "Ready", "status": "True", "lastHeartbeatTime": now,
                "lastTransitionTime": now, "reason": "KubeletReady",
                "message": "kubelet is posting ready status",
            }],
            "addresses": [
                {"type": "InternalIP", "address": POD_IP},
                {"type": "Hostname", "address": NODE},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "machineID": "minikube-test", "systemUUID": "minikube-test",
                "bootID": "minikube-test", "kernelVersion": "6.8.0",
                "osImage": "MiniKube test double", "containerRuntimeVersion": "local://1.0",
                "kubeletVersion": "v1.33.0", "kubeProxyVersion": "v1.33.0",
                "operatingSystem": "linux", "architecture": "amd64",
            },
        },
    })
}

// ---------------------------------------------------------------------------
// Create-time defaulting and validation

/// Pod defaulting (and the DefaultTolerationSeconds admission plugin),
/// then validation; the status a new pod starts with.
fn prepare_pod(pod: &mut Value) -> Vec<Cause> {
    default_pod_spec(&mut pod["spec"]);
    let causes = validate_pod_spec(&pod["spec"]);
    let qos = qos_class(&pod["spec"]);
    pod["status"] = json!({"phase": "Pending", "qosClass": qos});
    causes
}

fn default_pod_spec(spec: &mut Value) {
    if !spec.is_object() {
        *spec = json!({});
    }
    let m = spec.as_object_mut().expect("spec");
    for (k, v) in [
        ("restartPolicy", json!("Always")),
        ("terminationGracePeriodSeconds", json!(DEFAULT_GRACE_SECS)),
        ("dnsPolicy", json!("ClusterFirst")),
        ("schedulerName", json!("default-scheduler")),
        ("securityContext", json!({})),
        ("serviceAccountName", json!("default")),
        ("serviceAccount", json!("default")),
        ("enableServiceLinks", json!(true)),
        ("preemptionPolicy", json!("PreemptLowerThanOrEqual")),
        ("priority", json!(0)),
    ] {
        m.entry(k).or_insert(v);
    }
    let tolerations = m.entry("tolerations").or_insert(json!([]));
    if let Some(list) = tolerations.as_array_mut() {
        for key in [
            "node.kubernetes.io/not-ready",
            "node.kubernetes.io/unreachable",
        ] {
            if !list.iter().any(|t| s(t, "/key") == key) {
                list.push(json!({
                    "key": key, "operator": "Exists", "effect": "NoExecute",
                    "tolerationSeconds": 300,
                }));
            }
        }
    }
    if let Some(Value::Array(containers)) = m.get_mut("containers") {
        for c in containers.iter_mut().filter(|c| c.is_object()) {
            let image = s(c, "/image").to_string();
            let cm = c.as_object_mut().expect("container");
            let tag = image
                .rsplit_once(':')
                .map(|(_, t)| t)
                .filter(|t| !t.contains('/'));
            let pull = if image.contains('@') || tag.is_some_and(|t| t != "latest") {
                "IfNotPresent"
            } else {
                "Always"
            };
            cm.entry("imagePullPolicy").or_insert(json!(pull));
            cm.entry("terminationMessagePath")
                .or_insert(json!("/dev/termination-log"));
            cm.entry("terminationMessagePolicy")
                .or_insert(json!("File"));
            let resources = cm.entry("resources").or_insert(json!({}));
            if let Some(limits) = resources.get("limits").and_then(Value::as_object).cloned() {
                if !resources["requests"].is_object() {
                    resources["requests"] = json!({});
                }
                let requests = resources["requests"].as_object_mut().expect("requests");
                for (k, v) in limits {
                    requests.entry(k).or_insert(v);
                }
            }
        }
    }
}

fn qos_class(spec: &Value) -> &'static str {
    let (mut any, mut guaranteed) = (false, true);
    for c in arr(spec, "/containers") {
        for r in ["cpu", "memory"] {
            let limit = map(c, "/resources/limits").and_then(|m| m.get(r));
            let request = map(c, "/resources/requests").and_then(|m| m.get(r));
            any |= limit.is_some() || request.is_some();
            guaranteed &= limit.is_some() && request == limit;
        }
    }
    match (any, guaranteed) {
        (false, _) => "BestEffort",
        (true, true) => "Guaranteed",
        (true, false) => "Burstable",
    }
}

fn validate_pod_spec(spec: &Value) -> Vec<Cause> {
    let mut errs = Vec::new();
    let containers = arr(spec, "/containers");
    if containers.is_empty() {
        errs.push(Cause::required("spec.containers", ""));
    }
    if !arr(spec, "/initContainers").is_empty() {
        errs.push(Cause::forbidden(
            "spec.initContainers",
            "init containers are not supported by the MiniKube test double",
        ));
    }
    let policy = s(spec, "/restartPolicy");
    if policy != "Never" {
        errs.push(Cause::unsupported(
            "spec.restartPolicy",
            policy,
            "supported values: \"Never\" (the MiniKube test double runs only restartPolicy Never; \
             the API default is Always, so set it)",
        ));
    }
    if let Some(g) = spec
        .get("terminationGracePeriodSeconds")
        .and_then(Value::as_i64)
        && g < 0
    {
        errs.push(Cause::invalid(
            "spec.terminationGracePeriodSeconds",
            g,
            "must be greater than or equal to 0",
        ));
    }
    if let Some(selector) = map(spec, "/nodeSelector") {
        for (k, v) in selector {
            if !is_qualified_name(k) {
                errs.push(Cause::invalid("spec.nodeSelector", k, QUALIFIED_NAME_MSG));
            }
            let value = v.as_str().unwrap_or_default();
            if !is_label_value(value) {
                errs.push(Cause::invalid("spec.nodeSelector", value, LABEL_VALUE_MSG));
            }
        }
    }
    let mut volumes = HashSet::new();
    for (i, v) in arr(spec, "/volumes").iter().enumerate() {
        let f = format!("spec.volumes[{i}]");
        let name = s(v, "/name");
        if name.is_empty() {
            errs.push(Cause::required(&format!("{f}.name"), ""));
        } else if !is_dns_label(name) {
            errs.push(Cause::invalid(&format!("{f}.name"), name, DNS_LABEL_MSG));
        } else if !volumes.insert(name) {
            errs.push(Cause::duplicate(&format!("{f}.name"), name));
        }
        let sources: Vec<&str> = v
            .as_object()
            .map(|m| {
                m.keys()
                    .filter(|k| *k != "name")
                    .map(String::as_str)
                    .collect()
            })
            .unwrap_or_default();
        match sources.as_slice() {
            [] => errs.push(Cause::required(&f, "must specify a volume type")),
            ["secret"] if s(v, "/secret/secretName").is_empty() => {
                errs.push(Cause::required(&format!("{f}.secret.secretName"), ""));
            }
            ["configMap"] if s(v, "/configMap/name").is_empty() => {
                errs.push(Cause::required(&format!("{f}.configMap.name"), ""));
            }
            ["hostPath"] if s(v, "/hostPath/path").is_empty() => {
                errs.push(Cause::required(&format!("{f}.hostPath.path"), ""));
            }
            ["secret" | "configMap" | "emptyDir" | "hostPath"] => {}
            [other] => errs.push(Cause::forbidden(
                &format!("{f}.{other}"),
                &format!(
                    "volume type {other} is not supported by the MiniKube test double (secret, \
                     configMap, emptyDir and hostPath are)"
                ),
            )),
            _ => errs.push(Cause::forbidden(
                &f,
                "may not specify more than 1 volume type",
            )),
        }
        for source in ["secret", "configMap"] {
            for (j, item) in arr(v, &format!("/{source}/items")).iter().enumerate() {
                let path = s(item, "/path");
                if path.is_empty() || path.starts_with('/') || path.split('/').any(|p| p == "..") {
                    errs.push(Cause::invalid(
                        &format!("{f}.{source}.items[{j}].path"),
                        path,
                        "must be a relative path without '..'",
                    ));
                }
            }
        }
    }
    let mut names = HashSet::new();
    for (i, c) in containers.iter().enumerate() {
        let f = format!("spec.containers[{i}]");
        let name = s(c, "/name");
        if name.is_empty() {
            errs.push(Cause::required(&format!("{f}.name"), ""));
        } else if !is_dns_label(name) {
            errs.push(Cause::invalid(&format!("{f}.name"), name, DNS_LABEL_MSG));
        } else if !names.insert(name) {
            errs.push(Cause::duplicate(&format!("{f}.name"), name));
        }
        if s(c, "/image").is_empty() {
            errs.push(Cause::required(&format!("{f}.image"), ""));
        }
        for (j, e) in arr(c, "/env").iter().enumerate() {
            let fe = format!("{f}.env[{j}]");
            let var = s(e, "/name");
            if var.is_empty() {
                errs.push(Cause::required(&format!("{fe}.name"), ""));
            } else if !is_env_name(var) {
                errs.push(Cause::invalid(&format!("{fe}.name"), var, ENV_NAME_MSG));
            }
            let Some(from) = e.get("valueFrom") else {
                continue;
            };
            if !s(e, "/value").is_empty() {
                errs.push(Cause::invalid(
                    &format!("{fe}.valueFrom"),
                    "",
                    "may not be specified when `value` is not empty",
                ));
            }
            let sources: Vec<&str> = from
                .as_object()
                .map(|m| m.keys().map(String::as_str).collect())
                .unwrap_or_default();
            match sources.as_slice() {
                ["secretKeyRef" | "configMapKeyRef"] => {
                    let r = &from[sources[0]];
                    for field in ["name", "key"] {
                        if s(r, &format!("/{field}")).is_empty() {
                            let at = format!("{fe}.valueFrom.{}.{field}", sources[0]);
                            errs.push(Cause::required(&at, ""));
                        }
                    }
                }
                ["fieldRef"] => {
                    let path = s(from, "/fieldRef/fieldPath");
                    let fake = json!({});
                    if field_ref(&fake, path).is_none() {
                        errs.push(Cause::unsupported(
                            &format!("{fe}.valueFrom.fieldRef.fieldPath"),
                            path,
                            "supported values: \"metadata.annotations\", \"metadata.labels\", \
                             \"metadata.name\", \"metadata.namespace\", \"metadata.uid\", \
                             \"spec.nodeName\", \"spec.serviceAccountName\", \"status.hostIP\", \
                             \"status.hostIPs\", \"status.podIP\", \"status.podIPs\"",
                        ));
                    }
                }
                ["resourceFieldRef"] => errs.push(Cause::forbidden(
                    &format!("{fe}.valueFrom.resourceFieldRef"),
                    "resourceFieldRef is not supported by the MiniKube test double",
                )),
                [] => errs.push(Cause::invalid(
                    &format!("{fe}.valueFrom"),
                    "",
                    "must specify one of: `fieldRef`, `resourceFieldRef`, `configMapKeyRef` or \
                     `secretKeyRef`",
                )),
                _ => errs.push(Cause::invalid(
                    &format!("{fe}.valueFrom"),
                    "",
                    "may not have more than one field specified at a time",
                )),
            }
        }
        let mut paths = HashSet::new();
        for (j, m) in arr(c, "/volumeMounts").iter().enumerate() {
            let fm = format!("{f}.volumeMounts[{j}]");
            let vname = s(m, "/name");
            if !volumes.contains(vname) {
                errs.push(Cause::not_found(&format!("{fm}.name"), vname));
            }
            let path = s(m, "/mountPath");
            if path.is_empty() {
                errs.push(Cause::required(&format!("{fm}.mountPath"), ""));
            } else if !paths.insert(path) {
                errs.push(Cause::invalid(
                    &format!("{fm}.mountPath"),
                    path,
                    "must be unique",
                ));
            }
        }
        let limits = map(c, "/resources/limits");
        let requests = map(c, "/resources/requests");
        let extended: HashSet<&String> = limits
            .into_iter()
            .chain(requests)
            .flat_map(|m| m.keys())
            .filter(|r| is_extended_resource(r))
            .collect();
        for r in extended {
            let limit = limits.and_then(|m| m.get(r));
            let request = requests.and_then(|m| m.get(r));
            for (which, q) in [("limits", limit), ("requests", request)] {
                if let Some(q) = q
                    && int_quantity(q).is_none()
                {
                    let q = q.as_str().map_or_else(|| q.to_string(), str::to_string);
                    errs.push(Cause::invalid(
                        &format!("{f}.resources.{which}[{r}]"),
                        q,
                        "must be an integer",
                    ));
                }
            }
            match (limit, request) {
                (None, Some(_)) => errs.push(Cause::required(
                    &format!("{f}.resources.limits"),
                    "Limit must be set for non overcommitable resources",
                )),
                (Some(l), Some(q)) if l != q => errs.push(Cause::invalid(
                    &format!("{f}.resources.requests"),
                    q.as_str().unwrap_or_default(),
                    &format!(
                        "must be equal to {r} limit of {}",
                        l.as_str().unwrap_or_default()
                    ),
                )),
                _ => {}
            }
        }
    }
    errs
}

fn is_extended_resource(name: &str) -> bool {
    match name.split_once('/') {
        Some((domain, _)) => domain != "kubernetes.io" && !domain.ends_with(".kubernetes.io"),
        None => false,
    }
}

/// A whole-number quantity (`"2"`), as extended resources must be.
fn int_quantity(q: &Value) -> Option<u64> {
    match q {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_u64(),
        _ => None,
    }
}

fn fold_string_data(secret: &mut Value) {
    let Some(string_data) = secret.as_object_mut().and_then(|m| m.remove("stringData")) else {
        return;
    };
    let Some(string_data) = string_data.as_object() else {
        return;
    };
    if !secret["data"].is_object() {
        secret["data"] = json!({});
    }
    for (k, v) in string_data {
        secret["data"][k] = b64_encode(v.as_str().unwrap_or_default().as_bytes());
    }
}

fn validate_secret(secret: &Value) -> Vec<Cause> {
    let mut errs = Vec::new();
    let mut total = 0;
    if let Some(data) = map(secret, "/data") {
        for (k, v) in data {
            if !is_config_key(k) {
                errs.push(Cause::invalid(&format!("data[{k}]"), k, CONFIG_KEY_MSG));
            }
            total += v.as_str().and_then(b64_decode).map_or(0, |b| b.len());
        }
    }
    if total > 1 << 20 {
        errs.push(Cause::too_long("data", 1 << 20));
    }
    errs
}

fn validate_config_map(cm: &Value) -> Vec<Cause> {
    let mut errs = Vec::new();
    let data = map(cm, "/data");
    for (field, m) in [("data", data), ("binaryData", map(cm, "/binaryData"))] {
        for k in m.into_iter().flat_map(|m| m.keys()) {
            if !is_config_key(k) {
                errs.push(Cause::invalid(&format!("{field}[{k}]"), k, CONFIG_KEY_MSG));
            } else if field == "binaryData" && data.is_some_and(|d| d.contains_key(k)) {
                errs.push(Cause::invalid(
                    &format!("{field}[{k}]"),
                    k,
                    "duplicate of key present in data",
                ));
            }
        }
    }
    errs
}

fn validate_meta(obj: &Value) -> Vec<Cause> {
    let mut errs = Vec::new();
    if let Some(labels) = map(obj, "/metadata/labels") {
        for (k, v) in labels {
            if !is_qualified_name(k) {
                errs.push(Cause::invalid("metadata.labels", k, QUALIFIED_NAME_MSG));
            }
            let value = v.as_str().unwrap_or_default();
            if value.len() > 63 {
                errs.push(Cause::invalid(
                    "metadata.labels",
                    value,
                    "must be no more than 63 characters",
                ));
            } else if !is_label_value(value) {
                errs.push(Cause::invalid("metadata.labels", value, LABEL_VALUE_MSG));
            }
        }
    }
    if let Some(annotations) = map(obj, "/metadata/annotations") {
        let mut total = 0;
        for (k, v) in annotations {
            if !is_qualified_name(k) {
                errs.push(Cause::invalid(
                    "metadata.annotations",
                    k,
                    QUALIFIED_NAME_MSG,
                ));
            }
            total += k.len() + v.as_str().map_or(0, str::len);
        }
        if total > 256 * 1024 {
            errs.push(Cause::too_long("metadata.annotations", 256 * 1024));
        }
    }
    let refs = arr(obj, "/metadata/ownerReferences");
    for r in refs {
        for field in ["apiVersion", "kind", "name", "uid"] {
            if s(r, &format!("/{field}")).is_empty() {
                errs.push(Cause::invalid(
                    &format!("metadata.ownerReferences.{field}"),
                    "",
                    &format!("{field} must not be empty"),
                ));
            }
        }
    }
    if refs
        .iter()
        .filter(|r| r.get("controller") == Some(&json!(true)))
        .count()
        > 1
    {
        errs.push(Cause::invalid(
            "metadata.ownerReferences",
            "",
            "Only one reference can have Controller set to true",
        ));
    }
    for f in arr(obj, "/metadata/finalizers") {
        let f = f.as_str().unwrap_or_default();
        if !is_qualified_name(f) {
            errs.push(Cause::invalid("metadata.finalizers", f, QUALIFIED_NAME_MSG));
        }
    }
    errs
}

fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns_label)
}

fn is_name_part(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(c))
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
}

fn is_qualified_name(s: &str) -> bool {
    match s.split_once('/') {
        Some((prefix, name)) => is_dns_subdomain(prefix) && is_name_part(name),
        None => is_name_part(s),
    }
}

fn is_label_value(s: &str) -> bool {
    s.is_empty() || is_name_part(s)
}

fn is_env_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && !b[0].is_ascii_digit()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || b"-._".contains(c))
}

fn is_config_key(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s != "."
        && s != ".."
        && s.bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"-._".contains(&c))
}

// ---------------------------------------------------------------------------
// Errors: `Status` objects

/// One `details.causes` entry of an Invalid status.
#[derive(Debug)]
struct Cause {
    reason: &'static str,
    field: String,
    message: String,
}

impl Cause {
    fn required(field: &str, detail: &str) -> Cause {
        let message = if detail.is_empty() {
            "Required value".to_string()
        } else {
            format!("Required value: {detail}")
        };
        Cause {
            reason: "FieldValueRequired",
            field: field.into(),
            message,
        }
    }

    fn invalid(field: &str, value: impl fmt::Debug, detail: &str) -> Cause {
        Cause {
            reason: "FieldValueInvalid",
            field: field.into(),
            message: format!("Invalid value: {value:?}: {detail}"),
        }
    }

    fn forbidden(field: &str, detail: &str) -> Cause {
        Cause {
            reason: "FieldValueForbidden",
            field: field.into(),
            message: format!("Forbidden: {detail}"),
        }
    }

    fn unsupported(field: &str, value: &str, detail: &str) -> Cause {
        Cause {
            reason: "FieldValueNotSupported",
            field: field.into(),
            message: format!("Unsupported value: {value:?}: {detail}"),
        }
    }

    fn duplicate(field: &str, value: &str) -> Cause {
        Cause {
            reason: "FieldValueDuplicate",
            field: field.into(),
            message: format!("Duplicate value: {value:?}"),
        }
    }

    fn not_found(field: &str, value: &str) -> Cause {
        Cause {
            reason: "FieldValueNotFound",
            field: field.into(),
            message: format!("Not found: {value:?}"),
        }
    }

    fn too_long(field: &str, max: usize) -> Cause {
        Cause {
            reason: "FieldValueTooLong",
            field: field.into(),
            message: format!("Too long: may not be more than {max} bytes"),
        }
    }
}

/// A failed request, answered with a `Status` object.
#[derive(Debug)]
struct ApiError {
    code: u16,
    reason: &'static str,
    message: String,
    details: Option<Value>,
}

impl ApiError {
    fn new(code: u16, reason: &'static str, message: String, details: Option<Value>) -> ApiError {
        ApiError {
            code,
            reason,
            message,
            details,
        }
    }

    fn not_found(kind: Kind, name: &str) -> ApiError {
        ApiError::new(
            404,
            "NotFound",
            format!("{} \"{name}\" not found", kind.plural()),
            Some(json!({"name": name, "kind": kind.plural()})),
        )
    }

    fn no_route() -> ApiError {
        ApiError::new(
            404,
            "NotFound",
            "the server could not find the requested resource".into(),
            Some(json!({})),
        )
    }

    fn already_exists(kind: Kind, name: &str) -> ApiError {
        ApiError::new(
            409,
            "AlreadyExists",
            format!("{} \"{name}\" already exists", kind.plural()),
            Some(json!({"name": name, "kind": kind.plural()})),
        )
    }

    fn conflict(kind: Kind, name: &str, why: &str) -> ApiError {
        ApiError::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} \"{name}\": {why}",
                kind.plural()
            ),
            Some(json!({"name": name, "kind": kind.plural()})),
        )
    }

    fn invalid(kind: Kind, name: &str, causes: Vec<Cause>) -> ApiError {
        let list: Vec<String> = causes
            .iter()
            .map(|c| format!("{}: {}", c.field, c.message))
            .collect();
        let detail = if list.len() == 1 {
            list[0].clone()
        } else {
            format!("[{}]", list.join(", "))
        };
        let causes: Vec<Value> = causes
            .iter()
            .map(|c| json!({"reason": c.reason, "message": c.message, "field": c.field}))
            .collect();
        ApiError::new(
            422,
            "Invalid",
            format!("{} \"{name}\" is invalid: {detail}", kind.name()),
            Some(json!({"name": name, "kind": kind.name(), "causes": causes})),
        )
    }

    fn bad_request(message: String) -> ApiError {
        ApiError::new(400, "BadRequest", message, None)
    }

    fn method_not_allowed() -> ApiError {
        ApiError::new(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource".into(),
            Some(json!({})),
        )
    }

    fn unsupported_media_type(message: String) -> ApiError {
        ApiError::new(415, "UnsupportedMediaType", message, None)
    }

    fn status(&self) -> Value {
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

    fn into_response(self) -> Response {
        let mut r = respond(self.code, &self.status());
        if matches!(self.code, 429 | 503) {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        r
    }
}

/// The error `fail_next` injects for an HTTP status, with the apiserver's
/// reason and message.
fn injected_error(code: u16, method: &Method, path: &str, watch: bool) -> ApiError {
    let note = "(injected by MiniKube::fail_next)";
    let (reason, message) = match code {
        400 => ("BadRequest", format!("the request is invalid {note}")),
        401 => ("Unauthorized", "Unauthorized".to_string()),
        403 => ("Forbidden", forbidden_message(method, path, watch)),
        404 => (
            "NotFound",
            format!("the server could not find the requested resource {note}"),
        ),
        409 => (
            "Conflict",
            format!(
                "Operation cannot be fulfilled: the object has been modified; please apply your \
                 changes to the latest version and try again {note}"
            ),
        ),
        410 => ("Expired", format!("too old resource version {note}")),
        422 => ("Invalid", format!("the object is invalid {note}")),
        429 => (
            "TooManyRequests",
            "Too many requests, please try again later.".to_string(),
        ),
        500 => ("InternalError", format!("Internal error occurred: {note}")),
        503 => (
            "ServiceUnavailable",
            format!("the server is currently unable to handle the request {note}"),
        ),
        504 => (
            "Timeout",
            format!("the server was unable to return a response in the time allotted {note}"),
        ),
        _ => ("", format!("HTTP {code} {note}")),
    };
    ApiError::new(code, reason, message, Some(json!({})))
}

/// RBAC's denial message for a request.
fn forbidden_message(method: &Method, path: &str, watch: bool) -> String {
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let (ns, plural, name) = match segs.as_slice() {
        ["api", "v1", "namespaces", ns, plural, rest @ ..] => {
            (Some(*ns), *plural, rest.first().copied())
        }
        ["api", "v1", plural, rest @ ..] => (None, *plural, rest.first().copied()),
        _ => (None, "", None),
    };
    let verb = match (method.as_str(), name) {
        ("GET", Some(_)) => "get",
        ("GET", None) if watch => "watch",
        ("GET", None) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", Some(_)) => "delete",
        ("DELETE", None) => "deletecollection",
        _ => "get",
    };
    let user = format!("system:serviceaccount:{NAMESPACE}:default");
    let subject = match name {
        Some(n) => format!("{plural} \"{n}\" is forbidden"),
        None => format!("{plural} is forbidden"),
    };
    let scope = match ns {
        Some(ns) => format!(" in the namespace \"{ns}\""),
        None => " at the cluster scope".into(),
    };
    format!(
        "{subject}: User \"{user}\" cannot {verb} resource \"{plural}\" in API group \"\"{scope}"
    )
}

// ---------------------------------------------------------------------------
// HTTP

/// A request, read whole.
#[derive(Debug)]
struct Req {
    method: Method,
    path: String,
    query: HashMap<String, String>,
    content_type: String,
    /// `Accept: application/json;as=PartialObjectMetadata…`: answer with
    /// metadata only (kube's `*_metadata` calls and `metadata_watcher`).
    meta_only: bool,
    body: Bytes,
}

async fn handle(AxState(sh): AxState<Arc<Shared>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let path = parts.uri.path().to_string();
    let target = match parts.uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path.clone(),
    };
    let (injected, late) = {
        let mut st = sh.lock();
        st.record(&parts.method, &target);
        (
            st.take_failure(&parts.method, &target),
            st.take_late(&parts.method, &target),
        )
    };
    let query = match Query::<HashMap<String, String>>::try_from_uri(&parts.uri) {
        Ok(Query(q)) => q,
        Err(e) => return ApiError::bad_request(format!("invalid query: {e}")).into_response(),
    };
    if let Some(code) = injected {
        return injected_error(code, &parts.method, &path, is_watch(&query)).into_response();
    }
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let meta_only = parts
        .headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("as=PartialObjectMetadata"));
    let body = match axum::body::to_bytes(body, MAX_BODY).await {
        Ok(b) => b,
        Err(_) => {
            return ApiError::new(
                413,
                "RequestEntityTooLarge",
                format!("Request entity too large: limit is {MAX_BODY}"),
                None,
            )
            .into_response();
        }
    };
    let req = Req {
        method: parts.method,
        path,
        query,
        content_type,
        meta_only,
        body,
    };
    match late {
        Some((delay, true)) => {
            let answer = route(&sh, &req).unwrap_or_else(ApiError::into_response);
            tokio::time::sleep(delay).await;
            answer
        }
        // a task of its own: it takes effect even if the client has gone
        // and this handler is dropped
        Some((delay, false)) => {
            let acting = tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                route(&sh, &req).unwrap_or_else(ApiError::into_response)
            });
            acting.await.unwrap_or_else(|e| {
                ApiError::new(500, "InternalError", e.to_string(), None).into_response()
            })
        }
        None => route(&sh, &req).unwrap_or_else(ApiError::into_response),
    }
}

fn route(sh: &Arc<Shared>, r: &Req) -> Result<Response, ApiError> {
    let segs: Vec<&str> = r.path.split('/').filter(|s| !s.is_empty()).collect();
    let kind_of = |plural: &str| Kind::from_plural(plural).ok_or_else(ApiError::no_route);
    match segs.as_slice() {
        ["version"] => get_only(r, || respond(200, &version_info())),
        ["healthz" | "livez" | "readyz"] => get_only(r, || text(200, "ok".into())),
        ["api"] => get_only(r, || {
            let address = sh.url.trim_start_matches("http://");
            respond(
                200,
                &json!({
                    "kind": "APIVersions", "versions": ["v1"],
                    "serverAddressByClientCIDRs": [
                        {"clientCIDR": "0.0.0.0/0", "serverAddress": address},
                    ],
                }),
            )
        }),
        ["api", "v1"] => get_only(r, || respond(200, &resource_list())),
        ["apis"] => get_only(r, || {
            respond(
                200,
                &json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": []}),
            )
        }),
        ["api", "v1", plural] => collection(sh, r, kind_of(plural)?, None),
        ["api", "v1", "namespaces", ns, plural] => {
            let kind = kind_of(plural)?;
            if !kind.namespaced() {
                return Err(ApiError::no_route());
            }
            collection(sh, r, kind, Some(ns))
        }
        ["api", "v1", "namespaces", ns, plural, name] => {
            let kind = kind_of(plural)?;
            if !kind.namespaced() {
                return Err(ApiError::no_route());
            }
            item(sh, r, kind, ns, name)
        }
        ["api", "v1", "namespaces", ns, "pods", name, sub] => pod_subresource(sh, r, ns, name, sub),
        ["api", "v1", plural, name] => {
            let kind = kind_of(plural)?;
            if kind.namespaced() {
                return Err(ApiError::no_route());
            }
            item(sh, r, kind, "", name)
        }
        _ => Err(ApiError::no_route()),
    }
}

fn get_only(r: &Req, f: impl FnOnce() -> Response) -> Result<Response, ApiError> {
    if r.method == Method::GET {
        Ok(f())
    } else {
        Err(ApiError::method_not_allowed())
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

fn text(code: u16, body: String) -> Response {
    let mut r = Response::new(Body::from(body));
    *r.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::OK);
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    r
}

fn version_info() -> Value {
    json!({
        "major": "1", "minor": "33", "emulationMajor": "1", "emulationMinor": "33",
        "minCompatibilityMajor": "1", "minCompatibilityMinor": "32",
        "gitVersion": GIT_VERSION, "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean", "buildDate": "2025-04-23T00:00:00Z", "goVersion": "go1.24.2",
        "compiler": "gc", "platform": "linux/amd64",
    })
}

fn resource_list() -> Value {
    let rw = json!([
        "create",
        "delete",
        "deletecollection",
        "get",
        "list",
        "patch",
        "update",
        "watch"
    ]);
    let resource = |name: &str, kind: &str, namespaced: bool, verbs: &Value| {
        let singular = match name.contains('/') {
            true => "",
            false => name.strip_suffix('s').unwrap_or(name),
        };
        json!({
            "name": name, "singularName": singular, "namespaced": namespaced, "kind": kind,
            "verbs": verbs,
        })
    };
    let mut eviction = resource("pods/eviction", "Eviction", true, &json!(["create"]));
    eviction["group"] = json!("policy");
    eviction["version"] = json!("v1");
    json!({
        "kind": "APIResourceList", "groupVersion": "v1",
        "resources": [
            resource("configmaps", "ConfigMap", true, &rw),
            resource("nodes", "Node", false, &json!(["get", "list", "watch"])),
            resource("pods", "Pod", true, &rw),
            eviction,
            resource("pods/log", "Pod", true, &json!(["get"])),
            resource("pods/status", "Pod", true, &json!(["get", "patch", "update"])),
            resource("secrets", "Secret", true, &rw),
        ],
    })
}

fn is_watch(query: &HashMap<String, String>) -> bool {
    matches!(query.get("watch").map(String::as_str), Some("true" | "1"))
}

fn dry_run(r: &Req) -> Result<bool, ApiError> {
    match r.query.get("dryRun").map(String::as_str) {
        None | Some("") => Ok(false),
        Some("All") => Ok(true),
        Some(other) => Err(ApiError::bad_request(format!(
            "dryRun: Unsupported value: \"{other}\": supported values: \"All\""
        ))),
    }
}

fn parse_json(body: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!("couldn't get version/kind; json parse error: {e}"))
    })
}

fn collection(
    sh: &Arc<Shared>,
    r: &Req,
    kind: Kind,
    ns: Option<&str>,
) -> Result<Response, ApiError> {
    let writable = ns.is_some() && kind != Kind::Node;
    match r.method {
        Method::GET if is_watch(&r.query) => watch_collection(sh, r, kind, ns),
        Method::GET => list(sh, r, kind, ns),
        Method::POST if writable => {
            let body = parse_json(&r.body)?;
            let dry = dry_run(r)?;
            let obj = sh.lock().create(kind, ns.unwrap_or_default(), body, dry)?;
            Ok(respond(201, &obj))
        }
        Method::DELETE if writable => {
            let ns = ns.unwrap_or_default();
            let filter = Filter::new(kind, Some(ns), &r.query)?;
            let opts = delete_options(r)?;
            let mut st = sh.lock();
            let names: Vec<String> = st
                .objects
                .iter()
                .filter(|((k, ons, _), o)| *k == kind && filter.accepts(*k, ons, o))
                .map(|((_, _, name), _)| name.clone())
                .collect();
            let mut items = Vec::new();
            for name in names {
                if let Ok((obj, _)) = st.delete(kind, ns, &name, &opts) {
                    items.push(strip_type(&obj));
                }
            }
            let list = json!({
                "kind": format!("{}List", kind.name()), "apiVersion": "v1",
                "metadata": {"resourceVersion": st.rv.to_string()}, "items": items,
            });
            Ok(respond(200, &list))
        }
        _ => Err(ApiError::method_not_allowed()),
    }
}

fn item(sh: &Arc<Shared>, r: &Req, kind: Kind, ns: &str, name: &str) -> Result<Response, ApiError> {
    match r.method {
        Method::GET => {
            let obj = sh
                .lock()
                .get(kind, ns, name)
                .ok_or_else(|| ApiError::not_found(kind, name))?;
            Ok(respond(200, &shape(&obj, r.meta_only)))
        }
        _ if kind == Kind::Node => Err(ApiError::method_not_allowed()),
        Method::PUT => {
            let body = parse_json(&r.body)?;
            let dry = dry_run(r)?;
            let obj = sh.lock().update(kind, ns, name, body, Sub::Main, dry)?;
            Ok(respond(200, &obj))
        }
        Method::PATCH => patch(sh, r, kind, ns, name, Sub::Main),
        Method::DELETE => {
            let opts = delete_options(r)?;
            let (obj, removed) = sh.lock().delete(kind, ns, name, &opts)?;
            if kind == Kind::Pod || !removed {
                return Ok(respond(200, &obj));
            }
            Ok(respond(
                200,
                &json!({
                    "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                    "details": {
                        "name": name, "kind": kind.plural(), "uid": s(&obj, "/metadata/uid"),
                    },
                }),
            ))
        }
        _ => Err(ApiError::method_not_allowed()),
    }
}

fn patch(
    sh: &Arc<Shared>,
    r: &Req,
    kind: Kind,
    ns: &str,
    name: &str,
    sub: Sub,
) -> Result<Response, ApiError> {
    let media = r.content_type.split(';').next().unwrap_or_default().trim();
    let strategic = match media {
        "application/merge-patch+json" => false,
        "application/strategic-merge-patch+json" => true,
        "application/apply-patch+yaml" => {
            return Err(ApiError::unsupported_media_type(
                "the MiniKube test double does not implement server-side apply \
                 (application/apply-patch+yaml); use a merge or strategic merge patch"
                    .into(),
            ));
        }
        "application/json-patch+json" => {
            return Err(ApiError::unsupported_media_type(
                "the MiniKube test double does not implement JSON patch \
                 (application/json-patch+json); use a merge or strategic merge patch"
                    .into(),
            ));
        }
        _ => {
            return Err(ApiError::unsupported_media_type(format!(
                "the body of the request was in an unknown format - accepted media types include: \
                 application/json-patch+json, application/merge-patch+json, \
                 application/apply-patch+yaml, application/strategic-merge-patch+json (got \
                 {media:?})"
            )));
        }
    };
    let patch = parse_json(&r.body)?;
    if !patch.is_object() {
        return Err(ApiError::bad_request(
            "json: cannot unmarshal a patch that is not an object into Go value of type \
             map[string]interface {}"
                .into(),
        ));
    }
    let dry = dry_run(r)?;
    let mut st = sh.lock();
    let cur = st
        .get(kind, ns, name)
        .ok_or_else(|| ApiError::not_found(kind, name))?;
    let mut next = (*cur).clone();
    if strategic {
        strategic_merge(&mut next, &patch, "");
    } else {
        merge_patch(&mut next, &patch);
    }
    let obj = st.update(kind, ns, name, next, sub, dry)?;
    Ok(respond(200, &obj))
}

fn delete_options(r: &Req) -> Result<DeleteOptions, ApiError> {
    let mut o = DeleteOptions::default();
    let grace = |v: i64| -> u64 { if v < 0 { 1 } else { v as u64 } };
    if let Some(g) = r.query.get("gracePeriodSeconds") {
        let g: i64 = g.parse().map_err(|_| {
            ApiError::bad_request(format!("gracePeriodSeconds: invalid value {g:?}"))
        })?;
        o.grace = Some(grace(g));
    }
    o.policy = r.query.get("propagationPolicy").cloned();
    o.dry_run = dry_run(r)?;
    if !r.body.is_empty() {
        let v = parse_json(&r.body)?;
        if let Some(g) = v.get("gracePeriodSeconds").and_then(Value::as_i64) {
            o.grace = Some(grace(g));
        }
        if let Some(p) = v.get("propagationPolicy").and_then(Value::as_str) {
            o.policy = Some(p.to_string());
        }
        if v.get("orphanDependents") == Some(&json!(true)) {
            o.policy = Some("Orphan".into());
        }
        if let Some(uid) = v.pointer("/preconditions/uid").and_then(Value::as_str) {
            o.uid = Some(uid.to_string());
        }
        if let Some(rv) = v
            .pointer("/preconditions/resourceVersion")
            .and_then(Value::as_str)
        {
            o.rv = Some(rv.to_string());
        }
        if arr(&v, "/dryRun").iter().any(|d| d == "All") {
            o.dry_run = true;
        }
    }
    if let Some(p) = &o.policy
        && !matches!(p.as_str(), "Orphan" | "Background" | "Foreground")
    {
        return Err(ApiError::new(
            422,
            "Invalid",
            format!(
                "DeleteOptions.meta.k8s.io \"\" is invalid: propagationPolicy: Unsupported value: \
                 \"{p}\": supported values: \"Foreground\", \"Background\", \"Orphan\""
            ),
            None,
        ));
    }
    Ok(o)
}

fn pod_subresource(
    sh: &Arc<Shared>,
    r: &Req,
    ns: &str,
    name: &str,
    sub: &str,
) -> Result<Response, ApiError> {
    match (sub, &r.method) {
        ("status", &Method::GET) => item(sh, r, Kind::Pod, ns, name),
        ("status", &Method::PATCH) => patch(sh, r, Kind::Pod, ns, name, Sub::Status),
        ("status", &Method::PUT) => {
            let body = parse_json(&r.body)?;
            let dry = dry_run(r)?;
            let obj = sh
                .lock()
                .update(Kind::Pod, ns, name, body, Sub::Status, dry)?;
            Ok(respond(200, &obj))
        }
        ("log", &Method::GET) => pod_log(sh, r, ns, name),
        ("eviction", &Method::POST) => {
            let body = parse_json(&r.body)?;
            let mut st = sh.lock();
            let key = (Kind::Pod, ns.to_string(), name.to_string());
            if !st.objects.contains_key(&key) {
                return Err(ApiError::not_found(Kind::Pod, name));
            }
            let mut opts = DeleteOptions::default();
            if let Some(g) = body
                .pointer("/deleteOptions/gracePeriodSeconds")
                .and_then(Value::as_u64)
            {
                opts.grace = Some(g);
            }
            if let Some(uid) = body
                .pointer("/deleteOptions/preconditions/uid")
                .and_then(Value::as_str)
            {
                opts.uid = Some(uid.to_string());
            }
            let pod = st.get(Kind::Pod, ns, name).expect("the pod");
            if opts
                .uid
                .as_deref()
                .is_some_and(|u| u != s(&pod, "/metadata/uid"))
            {
                return Err(ApiError::conflict(
                    Kind::Pod,
                    name,
                    "Precondition failed: UID in precondition does not match",
                ));
            }
            st.disrupt(&key, "EvictionByEvictionAPI");
            st.delete(Kind::Pod, ns, name, &opts)?;
            Ok(respond(
                201,
                &json!({
                    "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                    "code": 201,
                }),
            ))
        }
        ("status" | "log" | "eviction", _) => Err(ApiError::method_not_allowed()),
        _ => Err(ApiError::no_route()),
    }
}

fn pod_log(sh: &Arc<Shared>, r: &Req, ns: &str, name: &str) -> Result<Response, ApiError> {
    let path = {
        let st = sh.lock();
        let pod = st
            .get(Kind::Pod, ns, name)
            .ok_or_else(|| ApiError::not_found(Kind::Pod, name))?;
        let cname = s(&pod, "/spec/containers/0/name").to_string();
        if let Some(c) = r.query.get("container")
            && !arr(&pod, "/spec/containers")
                .iter()
                .any(|x| s(x, "/name") == c)
        {
            return Err(ApiError::bad_request(format!(
                "container {c} is not valid for pod {name}"
            )));
        }
        if r.query.get("previous").is_some_and(|p| p == "true") {
            return Err(ApiError::bad_request(format!(
                "previous terminated container \"{cname}\" in pod \"{name}\" not found"
            )));
        }
        let uid = s(&pod, "/metadata/uid");
        if !st.kubelet.get(uid).is_some_and(|k| k.started) {
            let reason = s(&pod, "/status/containerStatuses/0/state/waiting/reason");
            let reason = if reason.is_empty() {
                "ContainerCreating"
            } else {
                reason
            };
            return Err(ApiError::bad_request(format!(
                "container \"{cname}\" in pod \"{name}\" is waiting to start: {reason}"
            )));
        }
        sh.dir.join("logs").join(format!("{ns}_{name}_{uid}.log"))
    };
    let mut log = std::fs::read_to_string(path).unwrap_or_default();
    if let Some(n) = r
        .query
        .get("tailLines")
        .and_then(|n| n.parse::<usize>().ok())
    {
        let lines: Vec<&str> = log.lines().collect();
        let start = lines.len().saturating_sub(n);
        log = lines[start..].iter().map(|l| format!("{l}\n")).collect();
    }
    if let Some(n) = r
        .query
        .get("limitBytes")
        .and_then(|n| n.parse::<usize>().ok())
    {
        let mut end = n.min(log.len());
        while !log.is_char_boundary(end) {
            end -= 1;
        }
        log.truncate(end);
    }
    Ok(text(200, log))
}

/// An object as `PartialObjectMetadata` when metadata only was asked for.
fn shape(obj: &Value, meta_only: bool) -> Value {
    if meta_only {
        json!({
            "kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
            "metadata": obj["metadata"],
        })
    } else {
        obj.clone()
    }
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

fn list(sh: &Arc<Shared>, r: &Req, kind: Kind, ns: Option<&str>) -> Result<Response, ApiError> {
    let filter = Filter::new(kind, ns, &r.query)?;
    let limit = match r.query.get("limit") {
        Some(l) => l
            .parse::<usize>()
            .map_err(|_| ApiError::bad_request(format!("limit: invalid value {l:?}")))?,
        None => 0,
    };
    let start: Option<(String, String)> = match r.query.get("continue").filter(|c| !c.is_empty()) {
        Some(token) => {
            let decoded = b64_decode(token)
                .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
                .and_then(|v| {
                    let ns = v.pointer("/start/0")?.as_str()?.to_string();
                    let name = v.pointer("/start/1")?.as_str()?.to_string();
                    Some((ns, name))
                });
            Some(decoded.ok_or_else(|| {
                ApiError::bad_request(
                    "continue key is not valid: incorrect encoded start resourceVersion (version \
                     meta.k8s.io/v1)"
                        .into(),
                )
            })?)
        }
        None => None,
    };
    let st = sh.lock();
    let mut items = Vec::new();
    let mut last: Option<(String, String)> = None;
    let mut remaining = 0;
    for ((k, ons, name), obj) in &st.objects {
        if !filter.accepts(*k, ons, obj) {
            continue;
        }
        if let Some((sns, sname)) = &start
            && (ons.as_str(), name.as_str()) <= (sns.as_str(), sname.as_str())
        {
            continue;
        }
        if limit > 0 && items.len() >= limit {
            remaining += 1;
            continue;
        }
        items.push(if r.meta_only {
            shape(obj, true)
        } else {
            strip_type(obj)
        });
        last = Some((ons.clone(), name.clone()));
    }
    let mut meta = json!({"resourceVersion": st.rv.to_string()});
    if remaining > 0
        && let Some((lns, lname)) = last
    {
        let token = json!({"v": "meta.k8s.io/v1", "rv": st.rv, "start": [lns, lname]});
        meta["continue"] = b64_encode(&serde_json::to_vec(&token).unwrap_or_default());
        if filter.labels.is_empty() && filter.fields.is_empty() {
            meta["remainingItemCount"] = json!(remaining);
        }
    }
    let (list_kind, api_version) = if r.meta_only {
        ("PartialObjectMetadataList".to_string(), "meta.k8s.io/v1")
    } else {
        (format!("{}List", kind.name()), "v1")
    };
    Ok(respond(
        200,
        &json!({
            "kind": list_kind, "apiVersion": api_version, "metadata": meta, "items": items,
        }),
    ))
}

// ---------------------------------------------------------------------------
// Selectors and watches

#[derive(Debug, Clone)]
enum LabelReq {
    Eq(String, String),
    Ne(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
    Gt(String, i64),
    Lt(String, i64),
}

fn parse_label_selector(sel: &str) -> Result<Vec<LabelReq>, String> {
    if sel.trim().is_empty() {
        return Ok(Vec::new());
    }
    let mut terms = Vec::new();
    let (mut depth, mut cur) = (0, String::new());
    for ch in sel.chars() {
        match ch {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                terms.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(ch);
    }
    terms.push(cur);
    terms.iter().map(|t| parse_label_term(t.trim())).collect()
}

fn parse_label_term(t: &str) -> Result<LabelReq, String> {
    let key = |k: &str| -> Result<String, String> {
        let k = k.trim();
        if is_qualified_name(k) {
            Ok(k.to_string())
        } else {
            Err(format!(
                "unable to parse requirement: key: Invalid value: {k:?}: {QUALIFIED_NAME_MSG}"
            ))
        }
    };
    let value = |v: &str| -> Result<String, String> {
        let v = v.trim();
        if v.len() <= 63 && is_label_value(v) {
            Ok(v.to_string())
        } else {
            Err(format!(
                "unable to parse requirement: values[0]: Invalid value: {v:?}: {LABEL_VALUE_MSG}"
            ))
        }
    };
    if t.is_empty() {
        return Err("found '', expected: !, identifier, or 'end of string'".into());
    }
    if let Some(k) = t.strip_prefix('!') {
        return Ok(LabelReq::NotExists(key(k)?));
    }
    if let Some(open) = t.find('(') {
        let close = t
            .strip_suffix(')')
            .ok_or_else(|| format!("found '{t}', expected: ')'"))?;
        let head = t[..open].trim();
        let (k, op) = head
            .rsplit_once(char::is_whitespace)
            .ok_or_else(|| format!("found '{head}', expected: in, notin"))?;
        let values = close[open + 1..]
            .split(',')
            .map(value)
            .collect::<Result<Vec<_>, _>>()?;
        return match op {
            "in" => Ok(LabelReq::In(key(k)?, values)),
            "notin" => Ok(LabelReq::NotIn(key(k)?, values)),
            _ => Err(format!("found '{op}', expected: in, notin")),
        };
    }
    if let Some((k, v)) = t.split_once("!=") {
        return Ok(LabelReq::Ne(key(k)?, value(v)?));
    }
    if let Some((k, v)) = t.split_once("==").or_else(|| t.split_once('=')) {
        return Ok(LabelReq::Eq(key(k)?, value(v)?));
    }
    for (op, gt) in [('>', true), ('<', false)] {
        if let Some((k, v)) = t.split_once(op) {
            let n: i64 = v.trim().parse().map_err(|_| {
                format!(
                    "unable to parse requirement: for 'Gt', 'Lt' operators, the value must \
                         be an integer: {v:?}"
                )
            })?;
            return Ok(if gt {
                LabelReq::Gt(key(k)?, n)
            } else {
                LabelReq::Lt(key(k)?, n)
            });
        }
    }
    if t.contains(char::is_whitespace) {
        return Err(format!(
            "unable to parse requirement: found '{t}', expected: in, notin, =, ==, !=, gt, lt"
        ));
    }
    Ok(LabelReq::Exists(key(t)?))
}

fn labels_match(reqs: &[LabelReq], obj: &Value) -> bool {
    let labels = map(obj, "/metadata/labels");
    let get = |k: &str| labels.and_then(|m| m.get(k)).and_then(Value::as_str);
    reqs.iter().all(|r| match r {
        LabelReq::Eq(k, v) => get(k) == Some(v.as_str()),
        LabelReq::Ne(k, v) => get(k) != Some(v.as_str()),
        LabelReq::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
        LabelReq::NotIn(k, vs) => !get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
        LabelReq::Exists(k) => get(k).is_some(),
        LabelReq::NotExists(k) => get(k).is_none(),
        LabelReq::Gt(k, n) => get(k)
            .and_then(|x| x.parse::<i64>().ok())
            .is_some_and(|x| x > *n),
        LabelReq::Lt(k, n) => get(k)
            .and_then(|x| x.parse::<i64>().ok())
            .is_some_and(|x| x < *n),
    })
}

#[derive(Debug, Clone)]
struct FieldReq {
    field: String,
    equal: bool,
    value: String,
}

/// The field selectors Kubernetes supports per kind.
fn selectable_fields(kind: Kind) -> &'static [&'static str] {
    match kind {
        Kind::Pod => &[
            "metadata.name",
            "metadata.namespace",
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "spec.hostNetwork",
            "status.phase",
            "status.podIP",
            "status.nominatedNodeName",
        ],
        Kind::Secret => &["metadata.name", "metadata.namespace", "type"],
        Kind::ConfigMap => &["metadata.name", "metadata.namespace"],
        Kind::Node => &["metadata.name", "spec.unschedulable"],
    }
}

fn parse_field_selector(kind: Kind, sel: &str) -> Result<Vec<FieldReq>, String> {
    let mut reqs = Vec::new();
    for t in sel.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let (field, equal, value) = if let Some((f, v)) = t.split_once("!=") {
            (f, false, v)
        } else if let Some((f, v)) = t.split_once("==").or_else(|| t.split_once('=')) {
            (f, true, v)
        } else {
            return Err(format!("invalid selector: '{sel}'; can't understand '{t}'"));
        };
        let field = field.trim();
        if !selectable_fields(kind).contains(&field) {
            return Err(format!("field label not supported: {field}"));
        }
        reqs.push(FieldReq {
            field: field.into(),
            equal,
            value: value.trim().into(),
        });
    }
    Ok(reqs)
}

fn field_value(obj: &Value, field: &str) -> String {
    let pointer = format!("/{}", field.replace('.', "/"));
    match obj.pointer(&pointer) {
        Some(Value::String(v)) => v.clone(),
        Some(Value::Bool(b)) => b.to_string(),
        Some(Value::Number(n)) => n.to_string(),
        _ if field == "spec.hostNetwork" || field == "spec.unschedulable" => "false".into(),
        _ => String::new(),
    }
}

/// What a list or watch selects.
#[derive(Debug, Clone)]
struct Filter {
    kind: Kind,
    /// Render objects as `PartialObjectMetadata`.
    meta_only: bool,
    ns: Option<String>,
    labels: Vec<LabelReq>,
    fields: Vec<FieldReq>,
}

impl Filter {
    fn new(
        kind: Kind,
        ns: Option<&str>,
        query: &HashMap<String, String>,
    ) -> Result<Filter, ApiError> {
        let labels = parse_label_selector(
            query
                .get("labelSelector")
                .map(String::as_str)
                .unwrap_or_default(),
        )
        .map_err(ApiError::bad_request)?;
        let fields = parse_field_selector(
            kind,
            query
                .get("fieldSelector")
                .map(String::as_str)
                .unwrap_or_default(),
        )
        .map_err(ApiError::bad_request)?;
        Ok(Filter {
            kind,
            meta_only: false,
            ns: ns.map(str::to_string),
            labels,
            fields,
        })
    }

    fn accepts(&self, kind: Kind, ns: &str, obj: &Value) -> bool {
        kind == self.kind && self.ns.as_deref().is_none_or(|n| n == ns) && self.matches(obj)
    }

    fn matches(&self, obj: &Value) -> bool {
        labels_match(&self.labels, obj)
            && self
                .fields
                .iter()
                .all(|f| (field_value(obj, &f.field) == f.value) == f.equal)
    }

    /// The watch event a change is for this watcher, if any: an object that
    /// stops matching is DELETED for it, one that starts matching ADDED.
    fn render(&self, e: &Event) -> Option<Bytes> {
        if e.kind != self.kind || self.ns.as_deref().is_some_and(|n| n != e.ns) {
            return None;
        }
        let now = self.matches(&e.object);
        let line = |etype: &str, obj: &Value| watch_line(etype, &shape(obj, self.meta_only));
        match e.etype {
            EventType::Added => now.then(|| line("ADDED", &e.object)),
            EventType::Deleted => now.then(|| line("DELETED", &e.object)),
            EventType::Modified => {
                let before = e.prev.as_ref().is_some_and(|p| self.matches(p));
                match (before, now, &e.prev) {
                    (true, true, _) => Some(line("MODIFIED", &e.object)),
                    (false, true, _) => Some(line("ADDED", &e.object)),
                    (true, false, Some(prev)) => {
                        let mut gone = (**prev).clone();
                        gone["metadata"]["resourceVersion"] = Value::String(e.rv.to_string());
                        Some(line("DELETED", &gone))
                    }
                    _ => None,
                }
            }
        }
    }
}

#[derive(serde::Serialize)]
struct WatchLine<'a> {
    #[serde(rename = "type")]
    etype: &'a str,
    object: &'a Value,
}

fn watch_line(etype: &str, object: &Value) -> Bytes {
    let mut line = serde_json::to_vec(&WatchLine { etype, object }).unwrap_or_default();
    line.push(b'\n');
    Bytes::from(line)
}

fn bookmark(kind: Kind, rv: u64, initial_events_end: bool) -> Bytes {
    let mut object = json!({
        "kind": kind.name(), "apiVersion": "v1",
        "metadata": {"resourceVersion": rv.to_string()},
    });
    if initial_events_end {
        object["metadata"]["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    watch_line("BOOKMARK", &object)
}

fn expired(rv: u64, oldest: u64) -> Bytes {
    let status = ApiError::new(
        410,
        "Expired",
        format!("too old resource version: {rv} ({oldest})"),
        None,
    )
    .status();
    watch_line("ERROR", &status)
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
    /// [`MiniKube::break_watches`] ended it.
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

/// Why a waiting watch woke.
#[derive(Debug)]
enum Wake {
    Changed,
    End,
    Bookmark,
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
        let wake = tokio::select! {
            changed = c.changes.changed() => {
                if changed.is_ok() { Wake::Changed } else { Wake::End }
            }
            () = tokio::time::sleep_until(deadline) => Wake::End,
            () = tokio::time::sleep_until(next_bookmark), if c.bookmarks => Wake::Bookmark,
        };
        match wake {
            Wake::Changed => {}
            Wake::End => c.done = true,
            Wake::Bookmark => {
                c.queue.push_back(bookmark(c.filter.kind, c.last, false));
                c.next_bookmark = (tokio::time::Instant::now() + BOOKMARK_EVERY).min(c.deadline);
            }
        }
    }
}

fn watch_collection(
    sh: &Arc<Shared>,
    r: &Req,
    kind: Kind,
    ns: Option<&str>,
) -> Result<Response, ApiError> {
    let mut filter = Filter::new(kind, ns, &r.query)?;
    filter.meta_only = r.meta_only;
    let timeout = match r.query.get("timeoutSeconds") {
        Some(t) => t
            .parse::<u64>()
            .map_err(|_| ApiError::bad_request(format!("timeoutSeconds: invalid value {t:?}")))?,
        None => DEFAULT_WATCH_SECS,
    };
    let flag = |name: &str| r.query.get(name).is_some_and(|v| v == "true" || v == "1");
    let bookmarks = flag("allowWatchBookmarks");
    let send_initial = flag("sendInitialEvents");
    if send_initial && !bookmarks {
        return Err(ApiError::new(
            422,
            "Invalid",
            "ListOptions.meta.k8s.io \"\" is invalid: sendInitialEvents: Forbidden: \
             sendInitialEvents requires setting allowWatchBookmarks to true"
                .into(),
            None,
        ));
    }
    let rv = r
        .query
        .get("resourceVersion")
        .map(String::as_str)
        .unwrap_or_default();
    let mut queue = VecDeque::new();
    let mut done = false;
    let st = sh.lock();
    let last = if rv.is_empty() || rv == "0" || send_initial {
        // the current state first, as ADDED events
        for ((k, ons, _), obj) in &st.objects {
            if filter.accepts(*k, ons, obj) {
                queue.push_back(watch_line("ADDED", &shape(obj, r.meta_only)));
            }
        }
        if send_initial {
            queue.push_back(bookmark(kind, st.rv, true));
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
    let cursor = Cursor {
        shared: sh.clone(),
        changes,
        filter,
        last,
        queue,
        deadline,
        bookmarks,
        next_bookmark: (now + BOOKMARK_EVERY).min(
            deadline
                .checked_sub(Duration::from_secs(1))
                .unwrap_or(deadline),
        ),
        done,
        epoch,
        broken: false,
    };
    let mut response = Response::new(Body::from_stream(futures::stream::unfold(
        cursor, next_chunk,
    )));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Ok(response)
}

// ---------------------------------------------------------------------------
// Patches

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

/// How strategic merge patch merges a list (by the field path, indices
/// left out).
fn list_merge_key(path: &str) -> Option<&'static str> {
    Some(match path {
        "metadata.ownerReferences" => "uid",
        "spec.containers" | "spec.initContainers" | "spec.ephemeralContainers" => "name",
        "spec.containers.env" | "spec.initContainers.env" => "name",
        "spec.containers.ports" | "spec.initContainers.ports" => "containerPort",
        "spec.containers.volumeMounts" | "spec.initContainers.volumeMounts" => "mountPath",
        "spec.volumes" | "spec.imagePullSecrets" => "name",
        "status.conditions" => "type",
        "status.containerStatuses" | "status.initContainerStatuses" => "name",
        // a list of primitives merged as a set
        "metadata.finalizers" => "",
        _ => return None,
    })
}

fn without_directives(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(k, _)| !k.starts_with('$'))
                .map(|(k, v)| (k.clone(), without_directives(v)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(without_directives).collect()),
        other => other.clone(),
    }
}

/// Strategic merge patch, for the lists in [`list_merge_key`].
fn strategic_merge(target: &mut Value, patch: &Value, path: &str) {
    let Value::Object(p) = patch else {
        *target = without_directives(patch);
        return;
    };
    if p.get("$patch").and_then(Value::as_str) == Some("replace") {
        *target = without_directives(patch);
        return;
    }
    if !target.is_object() {
        *target = json!({});
    }
    let t = target.as_object_mut().expect("an object");
    for (k, v) in p {
        if let Some(field) = k.strip_prefix("$deleteFromPrimitiveList/") {
            if let (Some(Value::Array(list)), Value::Array(gone)) = (t.get_mut(field), v) {
                list.retain(|x| !gone.contains(x));
            }
            continue;
        }
        if k.starts_with('$') {
            continue;
        }
        let sub = if path.is_empty() {
            k.clone()
        } else {
            format!("{path}.{k}")
        };
        match v {
            Value::Null => {
                t.remove(k);
            }
            Value::Object(m) if m.get("$patch").and_then(Value::as_str) == Some("delete") => {
                t.remove(k);
            }
            Value::Array(items) => match list_merge_key(&sub) {
                Some("") => {
                    let list = t.entry(k.clone()).or_insert(json!([]));
                    if !list.is_array() {
                        *list = json!([]);
                    }
                    let list = list.as_array_mut().expect("a list");
                    for item in items {
                        if !list.contains(item) {
                            list.push(item.clone());
                        }
                    }
                }
                Some(key) => merge_list(t.entry(k.clone()).or_insert(json!([])), items, key, &sub),
                None => {
                    t.insert(k.clone(), without_directives(v));
                }
            },
            Value::Object(_) => strategic_merge(t.entry(k.clone()).or_insert(Value::Null), v, &sub),
            _ => {
                t.insert(k.clone(), v.clone());
            }
        }
    }
}

fn merge_list(target: &mut Value, items: &[Value], key: &str, path: &str) {
    let directive = |i: &Value| i.get("$patch").and_then(Value::as_str).map(str::to_string);
    if items
        .iter()
        .any(|i| directive(i).as_deref() == Some("replace"))
    {
        *target = Value::Array(
            items
                .iter()
                .filter(|i| directive(i).is_none())
                .map(without_directives)
                .collect(),
        );
        return;
    }
    if !target.is_array() {
        *target = json!([]);
    }
    let list = target.as_array_mut().expect("a list");
    for item in items {
        let id = item.get(key).cloned();
        if directive(item).as_deref() == Some("delete") {
            list.retain(|e| e.get(key).cloned() != id);
            continue;
        }
        match list
            .iter_mut()
            .find(|e| id.is_some() && e.get(key).cloned() == id)
        {
            Some(existing) => strategic_merge(existing, item, path),
            None => list.push(without_directives(item)),
        }
    }
}

// ---------------------------------------------------------------------------
// Small helpers

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

fn random_u64() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    RandomState::new().hash_one((COUNTER.fetch_add(1, Ordering::Relaxed), nanos))
}

fn random_hex(len: usize) -> String {
    let mut out = String::new();
    while out.len() < len {
        out.push_str(&format!("{:016x}", random_u64()));
    }
    out.truncate(len);
    out
}

fn new_uid() -> String {
    let h = random_hex(32);
    format!(
        "{}-{}-4{}-a{}-{}",
        &h[0..8],
        &h[8..12],
        &h[13..16],
        &h[17..20],
        &h[20..32]
    )
}

/// `generateName` plus five characters from the apiserver's alphabet.
fn generated_name(prefix: &str) -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let prefix: String = prefix.chars().take(58).collect();
    let mut r = random_u64();
    let suffix: String = (0..5)
        .map(|_| {
            let c = ALPHABET[(r % ALPHABET.len() as u64) as usize] as char;
            r /= ALPHABET.len() as u64;
            c
        })
        .collect();
    format!("{prefix}{suffix}")
}

/// A stable stand-in for an image digest.
fn digest(image: &str) -> String {
    (0..4u8)
        .map(|i| {
            let mut h = std::hash::DefaultHasher::new();
            h.write(image.as_bytes());
            h.write_u8(i);
            format!("{:016x}", h.finish())
        })
        .collect()
}

fn now_rfc3339() -> String {
    rfc3339(SystemTime::now())
}

/// RFC 3339 UTC with whole seconds, as `metav1.Time` is written.
fn rfc3339(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64;
    let (days, sod) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // civil from days (Howard Hinnant)
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        sod / 3600,
        sod % 3600 / 60,
        sod % 60
    )
}
