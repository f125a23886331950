//! The `kubernetes` provider: each lease is a Pod that runs one
//! `tidegate-worker` and requests its GPUs (`nvidia.com/gpu`).
//!
//! * **acquire** creates the lease's token Secret, then the Pod
//!   (`<name_prefix>-<lease>`, `restartPolicy: Never`: a lease is one run of
//!   a worker) on the tier's node pool: node selector, tolerations and
//!   priority class per tier, node selector per instance type. The worker
//!   reads its one-time token from the Secret (`secretKeyRef`), so the
//!   token is in no Pod spec; the Secret is then made the Pod's dependent,
//!   so Kubernetes deletes it with the Pod even while the gateway is down.
//!   Every API call is bounded by `api_timeout_secs`: an acquire past it
//!   fails, and deletes the Pod and Secret it may have made; if the API
//!   server makes the Pod later still (a creation queued behind a slow
//!   server), the watch deletes it when it appears (for 15 minutes; the
//!   next start's adoption after that).
//! * **watching**: one `watch` on the pool's Pods (label
//!   `tidegate.io/pool=<name_prefix>`), re-listed by kube's watcher after
//!   any break. A Pod that Kubernetes starts taking away (a deletion we did
//!   not ask for, a `DisruptionTarget` condition: spot node reclaimed,
//!   priority preemption, eviction, node drain; or `Evicted`) is the spot
//!   notice, with its deletion time as the deadline; the worker gets
//!   SIGTERM at the same moment and drains. When the Pod ends or goes, the
//!   lease ends: `preempted` if it was taken, `failed` if it never ran,
//!   `lost` otherwise; a finished Pod object is deleted. A Pod that cannot
//!   start (unschedulable, image pull back-off) is logged, once per reason,
//!   and ended by the gateway's `start_timeout_secs`; an invalid image
//!   reference fails the lease at once.
//! * **release** deletes the Pod with its grace period (SIGTERM, the worker
//!   drains, then SIGKILL) and waits until it is gone; only then is it
//!   forgotten. If the delete fails, or the Pod outlives
//!   `release_timeout_secs`, the release fails and the Pod stays held: the
//!   caller retries.
//! * **adoption**: the ledger keeps each lease's namespace, Pod name and
//!   uid. After a gateway restart a lease whose Pod still runs is watched
//!   again; any other is ended. Pods and token Secrets of the pool that
//!   belong to no live lease are deleted, so none bills unseen. The start-up
//!   calls are bounded by `api_timeout_secs` too.
//!
//! The Kubernetes client and the watch run on the runtime that called
//! [`KubernetesProvider::connect`] (the gateway's lease shell's), like
//! every other call; dropping the provider stops the watch. Readiness
//! comes from the worker's registration, as with the other providers.
//!
//! Its rooms: [`config`] (the Pod and Secret; pure), [`watch`] (what a
//! Pod's state means; pure), `create` (an acquire's API calls) and
//! `pool_watch` (the watch loop). This module holds [`Kube`], what
//! Kubernetes supplies to the remote-job provider that Slurm shares
//! (`super::remote`): connect, and submit (create), cancel (delete and
//! wait), begin cancel and adoption's survey. The provider itself (held
//! Pods, orders, the release bracket, the Pods an acquire gave up creating,
//! acquire, release, adopt, shutdown) is the skeleton's.

pub mod config;
mod create;
mod pool_watch;
pub mod watch;

use std::collections::HashSet;
use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, Preconditions};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use serde::{Deserialize, Serialize};

pub use self::config::{
    KubernetesConfig, KubernetesTiers, LABEL_LEASE, LABEL_POOL, Mount, Placement,
    REQUIRED_PERMISSIONS, TolerationConfig, WorkerResources,
};
use self::create::PodCreation;
use self::pool_watch::watch_pods;
pub use self::watch::{PodView, PodWatch, Step};
use super::remote::{
    self, Found, JobBackend, RemoteJobs, RemoteProvider, RemoteSystem, Unreleased,
};
use super::{LeaseSpec, ProviderError};
use crate::billing::Millis;
use crate::ledger::LeaseRecord;
use crate::table::LeaseId;

/// Provider name in the ledger.
pub const PROVIDER_NAME: &str = "kubernetes";

/// How often `release` checks whether the deleted Pod is gone.
const RELEASE_POLL: Duration = Duration::from_millis(200);

/// What the ledger keeps of a lease's Pod, for adoption.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KubernetesData {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub pod: String,
    /// Its uid.
    pub uid: String,
}

/// A held lease's Pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRef {
    /// Its name.
    pub name: String,
    /// Its uid: a Pod of the same name made later is another Pod.
    pub uid: String,
}

/// Kubernetes as a remote-job system: its config, namespace and client. A
/// lease's job is its Pod (name and uid), the watch is handed the Pod's
/// [`PodWatch`] and view as last seen, and a Pod an acquire gave up
/// creating is deleted with its token Secret (by the watch, if it appears
/// within [`remote::ABANDONED_WATCH`]; later ones by the next start's
/// adoption).
pub struct Kube {
    cfg: KubernetesConfig,
    namespace: String,
    client: Client,
}

impl std::fmt::Debug for Kube {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kube")
            .field("namespace", &self.namespace)
            .field("pool", &self.cfg.name_prefix)
            .finish_non_exhaustive()
    }
}

/// The Kubernetes provider: the remote-job provider over [`Kube`].
pub type KubernetesProvider = RemoteProvider<Kube>;

impl JobBackend for Kube {
    type Job = PodRef;
    type Watch = Box<(PodWatch, PodView)>;
    /// The watch loop keeps the [`PodWatch`]; the view joins the Pods as
    /// last seen.
    type Watching = PodWatch;
    /// The token Secret's name.
    type Stray = String;
    const ABANDONED_KEPT: usize = 1024;

    fn watched(w: &Self::Watch) -> (LeaseId, PodRef) {
        let (w, _) = &**w;
        let pod = PodRef {
            name: w.pod.clone(),
            uid: w.uid.clone(),
        };
        (w.lease, pod)
    }

    fn stopped(lease: LeaseId) -> ProviderError {
        kube_error(
            Some(lease),
            "watching its pod",
            "the watch has stopped".into(),
        )
    }
}

/// The held Pods, shared with the watch, which drops a lease whose Pod
/// ended (before it sends the end).
type Held = RemoteJobs<Kube>;

/// An order from the provider to the watch.
type Cmd = remote::Cmd<Kube>;

/// An API call that failed.
fn api_error(lease: Option<LeaseId>, what: impl Into<String>, e: &kube::Error) -> ProviderError {
    let detail = match e {
        kube::Error::Api(s) => {
            let mut d = format!("{} {}: {}", s.code, s.reason, s.message);
            if s.is_forbidden() {
                d.push_str(
                    "; does the gateway's service account have the Role of deploy/kubernetes/rbac.yaml?",
                );
            }
            d
        }
        other => other.to_string(),
    };
    ProviderError::Kubernetes {
        lease,
        what: what.into(),
        detail,
    }
}

fn kube_error(lease: Option<LeaseId>, what: impl Into<String>, detail: String) -> ProviderError {
    ProviderError::Kubernetes {
        lease,
        what: what.into(),
        detail,
    }
}

fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

/// `f`, or an error saying the API server did not answer within `limit`
/// (`api_timeout_secs`).
async fn within<T>(
    limit: Duration,
    lease: Option<LeaseId>,
    what: impl Into<String>,
    f: impl Future<Output = Result<T, ProviderError>>,
) -> Result<T, ProviderError> {
    tokio::time::timeout(limit, f).await.unwrap_or_else(|_| {
        Err(kube_error(
            lease,
            what,
            format!(
                "the API server did not answer within {} s (api_timeout_secs)",
                limit.as_secs_f64()
            ),
        ))
    })
}

/// `api_timeout_secs` (validated at connect).
fn api_timeout(cfg: &KubernetesConfig) -> Duration {
    Duration::try_from_secs_f64(cfg.api_timeout_secs).unwrap_or(Duration::from_secs(30))
}

/// Deletes a Pod and its token Secret by name, either of which may not
/// exist, within `limit`.
async fn delete_stray(
    pods: &Api<Pod>,
    secrets: &Api<Secret>,
    pod: &str,
    secret: &str,
    limit: Duration,
) -> Result<(), String> {
    let both = async {
        let dp = DeleteParams::default();
        match pods.delete(pod, &dp).await {
            Err(e) if !is_status(&e, 404) => return Err(e.to_string()),
            _ => {}
        }
        match secrets.delete(secret, &dp).await {
            Err(e) if !is_status(&e, 404) => Err(e.to_string()),
            _ => Ok(()),
        }
    };
    tokio::time::timeout(limit, both)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {} s", limit.as_secs_f64())))
}

impl RemoteProvider<Kube> {
    /// Loads the client configuration, checks that the provider may list
    /// Pods in its namespace (within `api_timeout_secs`), and starts
    /// watching the pool's Pods on the current runtime.
    pub async fn connect(cfg: KubernetesConfig) -> Result<KubernetesProvider, ProviderError> {
        cfg.validate()
            .map_err(|e| kube_error(None, "leasing.kubernetes", e))?;
        let limit = api_timeout(&cfg);
        let config = client_config(&cfg).await?;
        let namespace = cfg
            .namespace
            .clone()
            .unwrap_or_else(|| config.default_namespace.clone());
        let url = config.cluster_url.to_string();
        let client = Client::try_from(config)
            .map_err(|e| api_error(None, format!("building a client for {url}"), &e))?;
        let kube = Kube {
            cfg,
            namespace,
            client,
        };
        let what = format!("listing pods in namespace {:?} at {url}", kube.namespace);
        within(limit, None, what.clone(), async {
            kube.pods()
                .list(&ListParams::default().labels(&kube.cfg.selector()).limit(1))
                .await
                .map_err(|e| api_error(None, what, &e))
        })
        .await?;
        let grace_ms = Millis::from(kube.cfg.termination_grace_period_secs) * 1000;
        let (pods, secrets, watch_cfg) = (kube.pods(), kube.secrets(), kube.cfg.clone());
        tracing::info!(namespace = %kube.namespace, pool = %kube.cfg.name_prefix, "Kubernetes provider connected");
        Ok(RemoteProvider::start(kube, move |rx, events, held| {
            watch_pods(pods, secrets, watch_cfg, grace_ms, rx, events, held)
        }))
    }

    /// The namespace of the worker Pods.
    pub fn namespace(&self) -> &str {
        &self.system().namespace
    }

    /// The Pod of a held lease.
    pub fn pod(&self, lease: LeaseId) -> Option<String> {
        self.job(lease).map(|p| p.name)
    }
}

impl Kube {
    /// `api_timeout_secs` (validated at connect).
    fn api_timeout(&self) -> Duration {
        api_timeout(&self.cfg)
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    fn secrets(&self) -> Api<Secret> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// The graceful delete of a held Pod (its worker gets SIGTERM and
    /// drains), of that Pod only (its uid).
    fn graceful_delete(&self, pod: &PodRef) -> DeleteParams {
        DeleteParams {
            grace_period_seconds: Some(self.cfg.termination_grace_period_secs),
            preconditions: Some(Preconditions {
                uid: Some(pod.uid.clone()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        }
    }
}

/// The client configuration: the given kubeconfig (and context), else
/// in-cluster, else `$KUBECONFIG` / `~/.kube/config`.
async fn client_config(cfg: &KubernetesConfig) -> Result<Config, ProviderError> {
    let opts = KubeConfigOptions {
        context: cfg.context.clone(),
        ..KubeConfigOptions::default()
    };
    let err = |what: String, e: &dyn std::fmt::Display| kube_error(None, what, e.to_string());
    match &cfg.kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .map_err(|e| err(format!("reading kubeconfig {}", path.display()), &e))?;
            Config::from_custom_kubeconfig(kc, &opts)
                .await
                .map_err(|e| err(format!("loading kubeconfig {}", path.display()), &e))
        }
        None if cfg.context.is_some() => Config::from_kubeconfig(&opts)
            .await
            .map_err(|e| err("loading the kubeconfig's context".into(), &e)),
        None => Config::infer().await.map_err(|e| {
            err(
                "finding the cluster (in-cluster service account, $KUBECONFIG, ~/.kube/config)"
                    .into(),
                &e,
            )
        }),
    }
}

impl RemoteSystem for Kube {
    const NAME: &'static str = PROVIDER_NAME;
    type Record = KubernetesData;

    /// Builds the Pod and Secret in the call; the future creates them
    /// (within `api_timeout_secs`).
    fn submit(
        &self,
        spec: LeaseSpec,
        held: &Held,
    ) -> impl Future<Output = Result<(Box<(PodWatch, PodView)>, KubernetesData), ProviderError>>
    + Send
    + 'static {
        let lease = spec.lease;
        let built = self
            .cfg
            .pod(&spec, &self.namespace)
            .map(|pod| (pod, self.cfg.token_secret(&spec, &self.namespace)));
        let (pods, secrets) = (self.pods(), self.secrets());
        let namespace = self.namespace.clone();
        let held = held.clone();
        let (pod_name, secret_name) = (self.cfg.pod_name(lease), self.cfg.secret_name(lease));
        let (limit, limit_secs) = (self.api_timeout(), self.cfg.api_timeout_secs);
        async move {
            let (pod, secret) = built?;
            let (instance, tier) = (spec.instance.name, spec.tier);
            let creation = PodCreation {
                lease,
                instance_type: instance.clone(),
                tier,
                pods,
                secrets,
                pod,
                secret,
                pod_name,
                secret_name,
            };
            let created = match tokio::time::timeout(limit, creation.create()).await {
                Ok(created) => created,
                Err(_) => Err(creation.abandon(&held, limit, limit_secs).await),
            }?;
            let view = PodView::of(&created);
            let data = KubernetesData {
                namespace,
                pod: view.name.clone(),
                uid: view.uid.clone(),
            };
            tracing::info!(%lease, pod = %data.pod, %instance, %tier, "worker pod created");
            let w = PodWatch::new(lease, &view, false);
            Ok((Box::new((w, view)), data))
        }
    }

    /// Deletes the Pod and waits until it is gone (then its token Secret).
    fn cancel(
        &self,
        lease: LeaseId,
        pod: PodRef,
    ) -> impl Future<Output = Result<(), Unreleased>> + Send + 'static {
        let (pods, secrets) = (self.pods(), self.secrets());
        let dp = self.graceful_delete(&pod);
        let timeout = Duration::try_from_secs_f64(self.cfg.release_timeout_secs)
            .unwrap_or(Duration::from_secs(120));
        let timeout_secs = self.cfg.release_timeout_secs;
        let secret_name = self.cfg.secret_name(lease);
        let limit = self.api_timeout();
        async move {
            let what = format!("deleting pod {}", pod.name);
            within(limit, Some(lease), what.clone(), async {
                match pods.delete(&pod.name, &dp).await {
                    // gone already, or the name is another Pod's now
                    Err(e) if is_status(&e, 404) || is_status(&e, 409) => Ok(()),
                    Err(e) => Err(api_error(Some(lease), what, &e)),
                    Ok(_) => Ok(()),
                }
            })
            .await?;
            // not deleted: it runs on, and its end or preemption is news
            let gone: Result<(), ProviderError> = async {
                let give_up = tokio::time::Instant::now() + timeout;
                loop {
                    let what = format!("checking deleted pod {}", pod.name);
                    let current = within(limit, Some(lease), what.clone(), async {
                        pods.get_opt(&pod.name)
                            .await
                            .map_err(|e| api_error(Some(lease), what, &e))
                    })
                    .await?;
                    match current {
                        Some(p) if p.metadata.uid.as_deref() == Some(pod.uid.as_str()) => {
                            if tokio::time::Instant::now() >= give_up {
                                return Err(kube_error(
                                    Some(lease),
                                    format!("waiting for deleted pod {} to go", pod.name),
                                    format!("still there after {timeout_secs} s; it is still held, and its release will be retried"),
                                ));
                            }
                            tokio::time::sleep(RELEASE_POLL).await;
                        }
                        _ => break,
                    }
                }
                // its owner reference would have it collected; not later
                let dp = DeleteParams::default();
                let deleted = tokio::time::timeout(limit, secrets.delete(&secret_name, &dp))
                    .await
                    .unwrap_or_else(|_| {
                        Err(kube::Error::Service(
                            "no answer within api_timeout_secs".into(),
                        ))
                    });
                if let Err(e) = deleted
                    && !is_status(&e, 404)
                {
                    tracing::warn!(%lease, secret = %secret_name, error = %e, "deleting the token secret; the garbage collector removes it with its pod");
                }
                Ok(())
            }
            .await;
            // deleted but not gone yet: still held, and still on its way
            // out (its end is no news)
            gone.map_err(|error| Unreleased {
                error,
                on_its_way_out: true,
            })?;
            tracing::info!(%lease, pod = %pod.name, "worker pod deleted");
            Ok(())
        }
    }

    /// Each Pod's graceful delete at once, each within `api_timeout_secs`.
    async fn begin_cancel(&self, jobs: Vec<(LeaseId, PodRef)>) {
        let api = self.pods();
        let limit = self.api_timeout();
        let deletes = jobs.into_iter().map(|(lease, pod)| {
            let (api, dp) = (api.clone(), self.graceful_delete(&pod));
            async move {
                match tokio::time::timeout(limit, api.delete(&pod.name, &dp)).await {
                    Ok(Err(e)) if !is_status(&e, 404) && !is_status(&e, 409) => {
                        tracing::warn!(%lease, pod = %pod.name, error = %e, "deleting a worker pod; its release tries again");
                    }
                    Err(_) => {
                        tracing::warn!(%lease, pod = %pod.name, "deleting a worker pod: no answer within api_timeout_secs; its release tries again");
                    }
                    Ok(_) => {}
                }
            }
        });
        futures::future::join_all(deletes).await;
    }

    /// Lists the pool's Pods and token Secrets: a recorded Pod (same
    /// namespace, name and uid) neither finished nor disrupted is live;
    /// any other lease ends when its worker stopped, where the Pod still
    /// says, else now (preempted if the Pod was disrupted). Then deletes
    /// the pool's Pods and Secrets that belong to no live lease, so they do
    /// not bill. The listing and the deletes are each bounded by
    /// `api_timeout_secs`.
    async fn survey(
        &self,
        recorded: &[(LeaseRecord, Option<KubernetesData>)],
        now: Millis,
    ) -> Result<Vec<Found<Box<(PodWatch, PodView)>>>, ProviderError> {
        let (pods, secrets, selector) = (self.pods(), self.secrets(), self.cfg.selector());
        let limit = self.api_timeout();
        let (listed, listed_secrets) = within(
            limit,
            None,
            "listing worker pods and token secrets for adoption",
            async move {
                let lp = ListParams::default().labels(&selector);
                let p = pods
                    .list(&lp)
                    .await
                    .map_err(|e| api_error(None, "listing worker pods for adoption", &e))?;
                let s = secrets
                    .list(&lp)
                    .await
                    .map_err(|e| api_error(None, "listing token secrets for adoption", &e))?;
                Ok((p.items, s.items))
            },
        )
        .await?;
        let views: Vec<PodView> = listed.iter().map(PodView::of).collect();
        let mut found = Vec::with_capacity(recorded.len());
        let (mut adopted_pods, mut adopted_ids) = (HashSet::new(), HashSet::new());
        for (r, data) in recorded {
            let data = data.as_ref().filter(|d| d.namespace == self.namespace);
            let view = data.and_then(|d| views.iter().find(|v| v.name == d.pod && v.uid == d.uid));
            match view {
                Some(v) if !v.is_terminal() && !v.is_disrupted() => {
                    tracing::info!(lease = %r.id, pod = %v.name, "adopted worker pod after restart");
                    adopted_pods.insert(v.uid.clone());
                    adopted_ids.insert(r.id.0.to_string());
                    let w = PodWatch::new(r.id, v, v.phase == "Running");
                    found.push(Found::Live(Box::new((w, v.clone()))));
                }
                _ => {
                    let taking = view.is_some_and(|v| v.is_disrupted());
                    // billed to when its worker stopped, where the Pod
                    // still says; a Pod gone says nothing: to now
                    let at = view.map_or(now, |v| v.ended_at(now));
                    tracing::warn!(lease = %r.id, pod = ?data.map(|d| &d.pod), taking, ended_at = at, "worker pod gone, finished or being deleted after restart; lease ended");
                    found.push(Found::Gone { at, taking });
                }
            }
        }
        // everything of the pool that no adopted lease owns goes
        let mut delete_pods = Vec::new();
        for v in &views {
            if !adopted_pods.contains(&v.uid) && v.deleting_at.is_none() {
                tracing::warn!(pod = %v.name, phase = %v.phase, "worker pod of this pool belongs to no live lease; deleting it so it does not bill");
                delete_pods.push(v.name.clone());
            }
        }
        let delete_secrets: Vec<String> = listed_secrets
            .iter()
            .filter(|s| {
                let lease = s.metadata.labels.as_ref().and_then(|l| l.get(LABEL_LEASE));
                !lease.is_some_and(|l| adopted_ids.contains(l))
            })
            .filter_map(|s| s.metadata.name.clone())
            .collect();
        let (pods, secrets) = (self.pods(), self.secrets());
        within(limit, None, "deleting worker pods that belong to no live lease", async move {
            for name in delete_pods {
                match pods.delete(&name, &DeleteParams::default()).await {
                    Ok(_) => {}
                    Err(e) if is_status(&e, 404) => {}
                    Err(e) => {
                        return Err(api_error(None, format!("deleting orphan pod {name}"), &e));
                    }
                }
            }
            for name in delete_secrets {
                if let Err(e) = secrets.delete(&name, &DeleteParams::default()).await
                    && !is_status(&e, 404)
                {
                    tracing::warn!(secret = %name, error = %e, "deleting an orphan token secret");
                }
            }
            Ok(())
        })
        .await?;
        Ok(found)
    }
}
