//! The scheduler, the garbage collector's passes and the one node's
//! kubelet: binds pending pods whose GPUs fit, runs each bound pod's first
//! container as a local process (its own process group), and writes pod
//! status as the kubelet does. Decisions are made under the state lock
//! ([`State::reconcile`]); processes are started and signalled outside it.
//! It owns no objects ([`super::store`] does).

use std::collections::{HashMap, HashSet};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tidegate_kit::signal::Signal;

use super::s;
use super::store::{Key, Kind, State};
use super::{GPU, NODE, NODE_LABELS, POD_IP, Shared, arr, b64_decode, map, now_rfc3339};

/// How often the kubelet and scheduler look again without a change (the
/// kubelet's retry of a missing Secret, grace period deadlines).
const RESYNC: Duration = Duration::from_millis(200);
/// How long a pod that cannot pull its image shows `ErrImagePull` before
/// `ImagePullBackOff`.
const PULL_ERROR_FOR: Duration = Duration::from_secs(1);

const INSUFFICIENT_GPU: &str = "0/1 nodes are available: 1 Insufficient nvidia.com/gpu. \
     preemption: 0/1 nodes are available: 1 No preemption victims found for incoming pod.";
const SELECTOR_MISMATCH: &str = "0/1 nodes are available: 1 node(s) didn't match Pod's node \
     affinity/selector. preemption: 0/1 nodes are available: 1 Preemption is not helpful for \
     scheduling.";

/// What the kubelet knows of a pod (by uid).
#[derive(Debug, Default)]
pub(super) struct Kubelet {
    /// Its container was started (or failed to); with `restartPolicy:
    /// Never` it never starts again.
    started: bool,
    /// The live container's pid, which is also its process group.
    pub(super) running: Option<u32>,
    started_at: String,
    /// When SIGKILL follows the SIGTERM of a graceful deletion.
    kill_at: Option<Instant>,
    kill_sent: bool,
    /// Since when its image could not be pulled.
    pull_failed_since: Option<Instant>,
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
}

fn config_error(message: String) -> Waiting {
    let reason = "CreateContainerConfigError";
    Waiting { reason, message }
}

/// Why a container is not running yet: its `state.waiting`.
#[derive(Debug)]
struct Waiting {
    reason: &'static str,
    message: String,
}

impl State {
    /// One pass of the garbage collector, scheduler and kubelet; returns the
    /// process work to do outside the lock.
    fn reconcile(&mut self, dir: &Path) -> Vec<Action> {
        let mut actions = Vec::new();
        if self.stopping {
            return actions;
        }
        self.collect_garbage();
        self.schedule();
        // containers of pods that were deleted at once
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
        let bound: Vec<Key> = self
            .objects
            .iter()
            .filter(|(k, o)| k.0 == Kind::Pod && s(o, "/spec/nodeName") == NODE)
            .map(|(k, _)| k.clone())
            .collect();
        for key in bound {
            let Some(pod) = self.objects.get(&key).cloned() else {
                continue;
            };
            let uid = s(&pod, "/metadata/uid").to_string();
            let mut kl = self.kubelet.remove(&uid).unwrap_or_default();
            self.sync_pod(&key, &pod, &mut kl, dir, &mut actions);
            self.kubelet.insert(uid, kl);
        }
        actions
    }

    /// Binds pending pods that fit, in creation order.
    fn schedule(&mut self) {
        let pods = || self.objects.iter().filter(|(k, _)| k.0 == Kind::Pod);
        let mut used: u64 = pods()
            .filter(|(_, o)| s(o, "/spec/nodeName") == NODE && !is_terminal(o))
            .map(|(_, o)| pod_gpus(o))
            .sum();
        let mut pending: Vec<(u64, Key)> = pods()
            .filter(|(_, o)| s(o, "/spec/nodeName").is_empty() && !is_terminal(o))
            .map(|(k, o)| {
                let seq = self.order.get(s(o, "/metadata/uid")).copied();
                (seq.unwrap_or(u64::MAX), k.clone())
            })
            .collect();
        pending.sort();
        for (_, key) in pending {
            let pod = self.objects[&key].clone();
            let need = pod_gpus(&pod);
            let unschedulable = if !node_matches(&pod) {
                SELECTOR_MISMATCH
            } else if used + need > u64::from(self.gpus) {
                INSUFFICIENT_GPU
            } else {
                used += need;
                self.modify(&key, |p| {
                    p["spec"]["nodeName"] = json!(NODE);
                    set_condition(p, "PodScheduled", "True", None, None);
                });
                continue;
            };
            self.modify(&key, |p| {
                let why = Some(unschedulable);
                set_condition(p, "PodScheduled", "False", Some("Unschedulable"), why);
            });
        }
    }

    fn sync_pod(
        &mut self,
        key: &Key,
        pod: &Value,
        kl: &mut Kubelet,
        dir: &Path,
        actions: &mut Vec<Action>,
    ) {
        if pod.pointer("/metadata/deletionTimestamp").is_some() {
            let Some(pid) = kl.running else {
                // nothing runs: the kubelet gives the pod a terminal phase
                // and confirms the deletion
                if !is_terminal(pod) {
                    let why = "The container could not be located when the pod was terminated";
                    self.modify(key, |p| {
                        terminate(p, 137, "ContainerStatusUnknown", Some(why), None);
                    });
                }
                self.remove(key);
                return;
            };
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
            return;
        }
        if is_terminal(pod) || kl.started {
            return;
        }
        self.modify(key, first_sync);
        match self.plan(pod, kl, dir) {
            Ok(launch) => {
                kl.started = true;
                actions.push(Action::Start(Box::new(launch)));
            }
            Err(w) => {
                self.modify(key, |p| set_waiting(p, w.reason, &w.message));
            }
        }
    }

    /// Everything needed to start a pod's container, or why it cannot
    /// start yet, in the kubelet's order: image, then config.
    fn plan(&self, pod: &Value, kl: &mut Kubelet, dir: &Path) -> Result<Launch, Waiting> {
        let (ns, name) = (s(pod, "/metadata/namespace"), s(pod, "/metadata/name"));
        let uid = s(pod, "/metadata/uid");
        let container = &pod["spec"]["containers"][0];
        let image = s(container, "/image");
        let Some(image_program) = local_image(image) else {
            let since = *kl.pull_failed_since.get_or_insert_with(Instant::now);
            let (reason, message) = match since.elapsed() < PULL_ERROR_FOR {
                true => (
                    "ErrImagePull",
                    format!(
                        "failed to pull image \"{image}\": not found (MiniKube runs only \"local\" and \"local/<program>\")"
                    ),
                ),
                false => (
                    "ImagePullBackOff",
                    format!("Back-off pulling image \"{image}\""),
                ),
            };
            return Err(Waiting { reason, message });
        };
        let env = self.resolve_env(pod, container)?;
        let strings = |p: &str| arr(container, p).iter().map(|v| s(v, "").to_string());
        // no command: the image's entrypoint, `<program>` of `local/<program>`
        let mut argv: Vec<String> = strings("/command").collect();
        if argv.is_empty() {
            argv.push(image_program.to_string());
        }
        argv.extend(strings("/args"));
        let mut full_env: Vec<(String, String)> = ["PATH", "HOME"]
            .into_iter()
            .filter_map(|var| Some((var.to_string(), std::env::var(var).ok()?)))
            .collect();
        full_env.push(("HOSTNAME".into(), name.into()));
        full_env.extend(env);
        Ok(Launch {
            uid: uid.into(),
            program: argv[0].clone(),
            args: argv[1..].to_vec(),
            env: full_env,
            work: dir.join("pods").join(format!("{ns}_{name}_{uid}")),
            log: dir.join("logs").join(format!("{ns}_{name}_{uid}.log")),
        })
    }

    /// A container's `env`, in order; a missing Secret or key is the
    /// kubelet's `CreateContainerConfigError`, retried.
    fn resolve_env(&self, pod: &Value, c: &Value) -> Result<Vec<(String, String)>, Waiting> {
        let ns = s(pod, "/metadata/namespace");
        let mut env: Vec<(String, String)> = Vec::new();
        for e in arr(c, "/env") {
            let value = match e.pointer("/valueFrom/secretKeyRef") {
                None if e.get("valueFrom").is_some() => s(pod, "/metadata/name").to_string(),
                None => s(e, "/value").to_string(),
                Some(r) => {
                    let (name, key) = (s(r, "/name"), s(r, "/key"));
                    let Some(secret) = self.get(Kind::Secret, ns, name) else {
                        return Err(config_error(format!("secret \"{name}\" not found")));
                    };
                    let bytes = map(&secret, "/data")
                        .and_then(|m| m.get(key))
                        .and_then(|v| b64_decode(s(v, "")));
                    let Some(bytes) = bytes else {
                        let msg = format!("couldn't find key {key} in Secret {ns}/{name}");
                        return Err(config_error(msg));
                    };
                    String::from_utf8_lossy(&bytes).into_owned()
                }
            };
            let var = s(e, "/name").to_string();
            match env.iter_mut().find(|(k, _)| *k == var) {
                Some(slot) => slot.1 = value,
                None => env.push((var, value)),
            }
        }
        Ok(env)
    }

    /// The kubelet saw its container start; `false` if it must not run.
    fn container_started(&mut self, l: &Launch, pid: u32) -> bool {
        let now = now_rfc3339();
        let kl = self.kubelet.entry(l.uid.clone()).or_default();
        kl.running = Some(pid);
        kl.started_at = now.clone();
        if self.stopping {
            return false;
        }
        let Some(key) = self.pod_key(&l.uid) else {
            return false;
        };
        self.modify(&key, |p| run(p, &now));
        true
    }

    fn container_failed_to_start(&mut self, l: &Launch, err: &std::io::Error) {
        let Some(key) = self.pod_key(&l.uid) else {
            return;
        };
        let message = format!(
            "failed to create containerd task: unable to start container process: exec: {:?}: {}",
            l.program,
            match err.kind() {
                std::io::ErrorKind::NotFound => "executable file not found in $PATH".to_string(),
                _ => err.to_string(),
            }
        );
        let never = Some("1970-01-01T00:00:00Z");
        self.modify(&key, |p| {
            terminate(p, 128, "StartError", Some(&message), never)
        });
    }

    fn container_exited(&mut self, uid: &str, code: i32) {
        let Some(kl) = self.kubelet.get_mut(uid) else {
            return;
        };
        kl.running = None;
        let started_at = kl.started_at.clone();
        let Some(key) = self.pod_key(uid) else {
            return;
        };
        let reason = if code == 0 { "Completed" } else { "Error" };
        self.modify(&key, |p| {
            if !is_terminal(p) {
                terminate(p, code, reason, None, Some(&started_at));
            }
        });
    }

    /// [`super::MiniKube::kill`]: the container's pid to SIGKILL, or, when
    /// none runs, the pod failed as a dead node's would be.
    pub(super) fn kill(&mut self, key: &Key) -> Option<u32> {
        let pod = self.objects.get(key)?.clone();
        let kl = self
            .kubelet
            .entry(s(&pod, "/metadata/uid").to_string())
            .or_default();
        // a pod that was not running yet never will
        kl.started = true;
        let running = kl.running;
        if running.is_none() && !is_terminal(&pod) {
            self.modify(key, |p| terminate(p, 137, "Error", None, None));
        }
        running
    }
}

/// The scheduler, garbage collector and kubelet: a pass after every change,
/// and every [`RESYNC`].
pub(super) async fn kubelet(sh: Arc<Shared>) {
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
    let spawned = std::fs::create_dir_all(&l.work)
        .and_then(|()| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&l.log)
        })
        .and_then(|log| {
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
        Ok(mut child) => {
            let Some(pid) = child.id() else {
                return;
            };
            if !sh.lock().container_started(&l, pid) {
                signal(pid, Signal::Kill, true);
            }
            let (sh, uid) = (sh.clone(), l.uid);
            tokio::spawn(async move {
                let status = child.wait().await;
                // the container is gone with its main process: end the rest
                signal(pid, Signal::Kill, true);
                let code = match status {
                    Ok(s) => s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(9)),
                    Err(_) => 128 + 9,
                };
                sh.lock().container_exited(&uid, code);
            });
        }
    }
}

/// A signal to a process, or to its process group (through `kill(2)`; one
/// already gone is no error).
pub(super) fn signal(pid: u32, sig: Signal, group: bool) {
    let _ = if group {
        tidegate_kit::signal::send_group(pid, sig)
    } else {
        tidegate_kit::signal::send(pid, sig)
    };
}

// ---------------------------------------------------------------------------
// Pod status, as the scheduler and kubelet write it

pub(super) fn is_terminal(pod: &Value) -> bool {
    matches!(s(pod, "/status/phase"), "Succeeded" | "Failed")
}

pub(super) fn set_condition(
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
    if !conditions.iter().any(|c| s(c, "/type") == ctype) {
        conditions.push(json!({"type": ctype, "status": "Unknown", "lastProbeTime": null}));
    }
    let c = conditions
        .iter_mut()
        .find(|c| s(c, "/type") == ctype)
        .expect("the condition");
    if s(c, "/status") != status {
        c["status"] = json!(status);
        c["lastTransitionTime"] = json!(now_rfc3339());
    }
    let c = c.as_object_mut().expect("a condition");
    for (field, value) in [("reason", reason), ("message", message)] {
        match value {
            Some(v) => c.insert(field.into(), json!(v)),
            None => c.remove(field),
        };
    }
}

/// The pod's one container status, in `state`.
fn set_container_status(pod: &mut Value, state: Value, running: bool) {
    let c = &pod["spec"]["containers"][0];
    let status = json!({
        "name": s(c, "/name"), "state": state, "ready": running, "restartCount": 0,
        "image": s(c, "/image"), "started": running,
    });
    pod["status"]["containerStatuses"] = json!([status]);
}

/// The kubelet's first status: the container creating.
fn first_sync(pod: &mut Value) {
    if pod.pointer("/status/containerStatuses").is_none() {
        let creating = json!({"waiting": {"reason": "ContainerCreating"}});
        set_container_status(pod, creating, false);
    }
}

fn set_waiting(pod: &mut Value, reason: &str, message: &str) {
    let waiting = json!({"waiting": {"reason": reason, "message": message}});
    set_container_status(pod, waiting, false);
}

fn run(pod: &mut Value, now: &str) {
    pod["status"]["phase"] = json!("Running");
    pod["status"]["podIP"] = json!(POD_IP);
    set_condition(pod, "Ready", "True", None, None);
    let running = json!({"running": {"startedAt": now}});
    set_container_status(pod, running, true);
}

/// The container ended (restartPolicy Never): the pod's phase follows its
/// exit code; `started_at` when it had started.
fn terminate(
    pod: &mut Value,
    code: i32,
    reason: &str,
    msg: Option<&str>,
    started_at: Option<&str>,
) {
    pod["status"]["phase"] = json!(if code == 0 { "Succeeded" } else { "Failed" });
    let mut ended = json!({"exitCode": code, "reason": reason, "finishedAt": now_rfc3339()});
    if let Some(m) = msg {
        ended["message"] = json!(m);
    }
    if let Some(at) = started_at {
        ended["startedAt"] = json!(at);
    }
    set_container_status(pod, json!({ "terminated": ended }), false);
    set_condition(pod, "Ready", "False", Some("PodCompleted"), None);
}

/// GPUs the pod asks for (requests, which default to limits).
fn pod_gpus(pod: &Value) -> u64 {
    let count = |c: &Value, field: &str| {
        let q = map(c, field)?.get(GPU)?;
        q.as_str().and_then(|q| q.parse().ok()).or(q.as_u64())
    };
    arr(pod, "/spec/containers")
        .iter()
        .filter_map(|c| count(c, "/resources/requests").or_else(|| count(c, "/resources/limits")))
        .sum()
}

/// The pod's `nodeSelector` matches [`NODE_LABELS`].
fn node_matches(pod: &Value) -> bool {
    let labels: HashMap<&str, &str> = NODE_LABELS.iter().copied().collect();
    map(pod, "/spec/nodeSelector").is_none_or(|selector| {
        selector
            .iter()
            .all(|(k, v)| labels.get(k.as_str()).copied() == v.as_str())
    })
}

/// `local` → `Some("")` (no entrypoint), `local/sh:tag` → `Some("sh")`,
/// anything else → `None` (not pullable).
fn local_image(image: &str) -> Option<&str> {
    let image = image.split('@').next().unwrap_or_default();
    let repo = match image.rsplit_once(':') {
        Some((r, t)) if !t.contains('/') => r,
        _ => image,
    };
    match repo.strip_prefix("local") {
        Some("") => Some(""),
        Some(program) => program.strip_prefix('/').filter(|p| !p.is_empty()),
        None => None,
    }
}
