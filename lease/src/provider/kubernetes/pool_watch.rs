//! The watch loop: one task that watches the pool's Pods (kube's watcher,
//! re-listed after any break), keeps them as last seen, folds the held
//! leases' Pods into their [`PodWatch`]es and sends what follows as
//! [`ProviderEvent`]s; it deletes finished Pods, and Pods an acquire gave up
//! creating that the API server made after all. The provider talks to it
//! with [`Cmd`]s, which it applies to its [`Watched`] table (the
//! skeleton's: which Pods are being released, so their end is no news),
//! and shares [`Held`] with it, which the loop changes only to drop a lease
//! whose Pod ended. What a Pod's state means is
//! [`PodWatch::observe`]'s to decide, not the loop's.

use std::collections::{HashMap, HashSet, VecDeque};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, DeleteParams, Preconditions};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use tokio::sync::mpsc;

use super::super::remote::{Applied, Watched};
use super::super::{ProviderEvent, wall_clock_ms};
use super::{Cmd, Held, Kube, KubernetesConfig, PodView, Step, is_status};
use crate::billing::Millis;
use crate::table::LeaseId;

/// Uids of gone Pods remembered, so a late creation record cannot bring
/// one back.
const GONE_KEPT: usize = 4096;

/// What the watch loop knows: the pool's Pods as last seen, and the held
/// leases' watches.
pub(super) struct WatchState {
    pods: HashMap<String, PodView>,
    init: Option<HashMap<String, PodView>>,
    gone: HashSet<String>,
    gone_order: VecDeque<String>,
    /// The held leases' watches, and the Pods an acquire gave up creating
    /// (with their token Secret's name), deleted by the watch if they
    /// appear in time.
    watched: Watched<Kube>,
}

impl WatchState {
    fn mark_gone(&mut self, uid: &str) {
        if self.gone.insert(uid.to_string()) {
            self.gone_order.push_back(uid.to_string());
            if self.gone_order.len() > GONE_KEPT
                && let Some(old) = self.gone_order.pop_front()
            {
                self.gone.remove(&old);
            }
        }
    }

    /// Pod `name` and its Secret's name, when it is one an acquire gave
    /// up creating that is there to delete: no lease watches it, and it
    /// is not being deleted yet.
    fn stray(&mut self, name: &str) -> Option<(PodView, String)> {
        let secret = self
            .watched
            .abandoned()
            .get(name, tokio::time::Instant::now())?
            .clone();
        if !self.leases_of(name).is_empty() {
            return None;
        }
        let view = self.pods.get(name).filter(|v| v.deleting_at.is_none())?;
        Some((view.clone(), secret))
    }

    /// The leases watching Pod `name`.
    fn leases_of(&self, name: &str) -> Vec<LeaseId> {
        self.watched
            .watching()
            .filter(|w| w.pod == name)
            .map(|w| w.lease)
            .collect()
    }

    /// Takes an order from the provider; returns the leases whose Pod may
    /// mean news now. Pods an acquire gave up creating go to `maybe_strays`.
    fn on_cmd(&mut self, cmd: Cmd, maybe_strays: &mut Vec<String>) -> Vec<LeaseId> {
        let (pods, gone) = (&mut self.pods, &self.gone);
        let applied = self
            .watched
            .apply(cmd, tokio::time::Instant::now(), |watch| {
                let (w, view) = *watch;
                if !gone.contains(&view.uid) {
                    pods.entry(view.name.clone()).or_insert(view);
                }
                w
            });
        match applied {
            Applied::Watched(lease) | Applied::NewsAgain(lease) => vec![lease],
            Applied::Releasing(_) | Applied::Forgotten(_) => Vec::new(),
            Applied::Abandoned(name) => {
                maybe_strays.push(name);
                Vec::new()
            }
        }
    }

    /// The answer of a check whether Pod `name` (`uid`), missing from a
    /// re-list, `exists`: if not, it is gone, and the leases watching it
    /// are returned.
    fn on_checked(&mut self, name: &str, uid: &str, exists: bool) -> Vec<LeaseId> {
        if exists {
            return Vec::new();
        }
        if self.pods.get(name).is_some_and(|v| v.uid == uid) {
            self.pods.remove(name);
        }
        self.mark_gone(uid);
        self.leases_of(name)
    }

    /// Folds one watch event into the Pods as last seen; returns the
    /// leases whose Pod changed. Pods that may be strays go to
    /// `maybe_strays`.
    fn on_watch_event(
        &mut self,
        ev: Event<Pod>,
        pods: &Api<Pod>,
        checked_tx: &mpsc::UnboundedSender<(String, String, bool)>,
        maybe_strays: &mut Vec<String>,
    ) -> Vec<LeaseId> {
        match ev {
            Event::Apply(p) => {
                let v = PodView::of(&p);
                let name = v.name.clone();
                self.pods.insert(name.clone(), v);
                maybe_strays.push(name.clone());
                self.leases_of(&name)
            }
            Event::Delete(p) => {
                let v = PodView::of(&p);
                self.pods.remove(&v.name);
                self.watched.abandoned().remove(&v.name);
                self.mark_gone(&v.uid);
                self.leases_of(&v.name)
            }
            Event::Init => {
                self.init = Some(HashMap::new());
                Vec::new()
            }
            Event::InitApply(p) => {
                let v = PodView::of(&p);
                if let Some(init) = self.init.as_mut() {
                    init.insert(v.name.clone(), v);
                }
                Vec::new()
            }
            Event::InitDone => self.relisted(pods, checked_tx, maybe_strays),
        }
    }

    /// A re-list is complete: it replaces the Pods as last seen, except
    /// held Pods it did not list, which are kept until a check by name
    /// (answered on `checked_tx`) says whether they are gone. Every lease
    /// is looked at again, and every abandoned Pod may be a stray.
    fn relisted(
        &mut self,
        pods: &Api<Pod>,
        checked_tx: &mpsc::UnboundedSender<(String, String, bool)>,
        maybe_strays: &mut Vec<String>,
    ) -> Vec<LeaseId> {
        let listed = self.init.take().unwrap_or_default();
        for w in self.watched.watching() {
            if !listed.contains_key(&w.pod) {
                spawn_check(pods, &w.pod, &w.uid, checked_tx);
            }
        }
        // keep the unlisted held Pods until checked
        let mut next = listed;
        for w in self.watched.watching() {
            if let Some(v) = self.pods.get(&w.pod)
                && !next.contains_key(&w.pod)
            {
                next.insert(w.pod.clone(), v.clone());
            }
        }
        self.pods = next;
        maybe_strays.extend(self.watched.abandoned().names().map(String::from));
        self.watched.leases()
    }

    /// Deletes the Pods among `maybe_strays` that an acquire gave up
    /// creating and no lease holds (see [`WatchState::stray`]).
    fn delete_strays(&mut self, maybe_strays: Vec<String>, pods: &Api<Pod>, secrets: &Api<Secret>) {
        for name in maybe_strays {
            if let Some((view, secret)) = self.stray(&name) {
                tracing::warn!(pod = %view.name, phase = %view.phase, "the API server made a worker pod after its acquire gave up waiting; no lease holds it, deleting it so it does not bill");
                delete_pod(
                    pods,
                    secrets,
                    &view.name,
                    &view.uid,
                    secret,
                    "a worker pod no lease holds",
                );
            }
        }
    }
}

/// Watches the pool's Pods and turns what happens to held ones into
/// provider events.
pub(super) async fn watch_pods(
    pods: Api<Pod>,
    secrets: Api<Secret>,
    cfg: KubernetesConfig,
    grace_ms: Millis,
    mut cmds: mpsc::UnboundedReceiver<Cmd>,
    events: mpsc::Sender<ProviderEvent>,
    held: Held,
) {
    let stream = watcher::watcher(
        pods.clone(),
        watcher::Config::default().labels(&cfg.selector()),
    )
    .default_backoff();
    let mut stream = std::pin::pin!(stream);
    // a Pod missing from a re-list may have been created after it: its
    // existence is checked by name before it counts as gone
    let (checked_tx, mut checked) = mpsc::unbounded_channel::<(String, String, bool)>();
    let mut st = WatchState {
        pods: HashMap::new(),
        init: None,
        gone: HashSet::new(),
        gone_order: VecDeque::new(),
        watched: Watched::new(),
    };
    let mut failures = 0u32;
    loop {
        // Pods that may be ones an acquire gave up creating
        let mut maybe_strays: Vec<String> = Vec::new();
        let changed: Vec<LeaseId> = tokio::select! {
            cmd = cmds.recv() => match cmd {
                Some(cmd) => st.on_cmd(cmd, &mut maybe_strays),
                None => return,
            },
            Some((name, uid, exists)) = checked.recv() => st.on_checked(&name, &uid, exists),
            ev = stream.next() => match ev {
                None => return,
                Some(Err(e)) => {
                    failures += 1;
                    if failures == 1 || failures.is_multiple_of(30) {
                        tracing::warn!(error = %e, failures, "watching worker pods failed; retrying, leases kept as they were");
                    }
                    Vec::new()
                }
                Some(Ok(ev)) => {
                    failures = 0;
                    st.on_watch_event(ev, &pods, &checked_tx, &mut maybe_strays)
                }
            },
        };
        st.delete_strays(maybe_strays, &pods, &secrets);
        if !observe(
            &mut st, &changed, grace_ms, &pods, &secrets, &cfg, &events, &held,
        )
        .await
        {
            return;
        }
    }
}

/// Deletes Pod `name`, if it is still the one with `uid`, then Secret
/// `secret`, in the background; a failure is logged, saying `what` Pod it
/// was.
fn delete_pod(
    pods: &Api<Pod>,
    secrets: &Api<Secret>,
    name: &str,
    uid: &str,
    secret: String,
    what: &'static str,
) {
    let (pods, secrets) = (pods.clone(), secrets.clone());
    let (name, uid) = (name.to_string(), uid.to_string());
    tokio::spawn(async move {
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(uid),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        if let Err(e) = pods.delete(&name, &dp).await
            && !is_status(&e, 404)
            && !is_status(&e, 409)
        {
            tracing::warn!(pod = %name, error = %e, "deleting {what}");
        }
        if let Err(e) = secrets.delete(&secret, &DeleteParams::default()).await
            && !is_status(&e, 404)
        {
            tracing::warn!(%secret, error = %e, "deleting the token secret of {what}");
        }
    });
}

/// Checks whether Pod `name` (with `uid`) still exists; answers on `tx`.
/// An API server that cannot answer keeps it: the next re-list decides.
fn spawn_check(
    pods: &Api<Pod>,
    name: &str,
    uid: &str,
    tx: &mpsc::UnboundedSender<(String, String, bool)>,
) {
    let (pods, name, uid, tx) = (pods.clone(), name.to_string(), uid.to_string(), tx.clone());
    tokio::spawn(async move {
        let exists = match pods.get_opt(&name).await {
            Ok(Some(p)) => p.metadata.uid.as_deref() == Some(uid.as_str()),
            Ok(None) => false,
            Err(e) => {
                tracing::debug!(pod = %name, error = %e, "checking a pod missing from a re-list");
                true
            }
        };
        let _ = tx.send((name, uid, exists));
    });
}

/// Folds the Pods of `leases` into their watches and sends what follows;
/// a lease whose Pod we are deleting (release) is skipped: the release
/// waits for the Pod to go and forgets it. `false` once the event channel
/// is closed.
#[allow(clippy::too_many_arguments)]
async fn observe(
    st: &mut WatchState,
    leases: &[LeaseId],
    grace_ms: Millis,
    pods: &Api<Pod>,
    secrets: &Api<Secret>,
    cfg: &KubernetesConfig,
    events: &mpsc::Sender<ProviderEvent>,
    held: &Held,
) -> bool {
    let now = wall_clock_ms();
    let mut out = Vec::new();
    for lease in leases {
        let Some(w) = st.watched.news(*lease) else {
            continue;
        };
        let pod = st.pods.get(&w.pod);
        match w.observe(pod, now, grace_ms) {
            Step::Nothing => {}
            Step::Waiting { detail } => {
                tracing::warn!(%lease, pod = %w.pod, %detail, "worker pod cannot start yet");
            }
            Step::Notice { deadline } => {
                let why = pod
                    .and_then(|p| p.disruption.clone())
                    .map(|(r, m)| format!("{r}: {m}"))
                    .unwrap_or_else(|| "deleted".into());
                tracing::info!(%lease, pod = %w.pod, deadline, %why, "Kubernetes is taking the worker pod: spot notice");
                out.push(ProviderEvent::PreemptionNotice {
                    lease: *lease,
                    deadline,
                });
            }
            Step::Ended {
                reason,
                detail,
                late_notice,
                delete,
            } => {
                if let Some(deadline) = late_notice {
                    out.push(ProviderEvent::PreemptionNotice {
                        lease: *lease,
                        deadline,
                    });
                }
                if delete {
                    delete_pod(
                        pods,
                        secrets,
                        &w.pod,
                        &w.uid,
                        cfg.secret_name(*lease),
                        "a finished worker pod",
                    );
                }
                tracing::info!(%lease, ?reason, %detail, "worker pod ended");
                st.watched.ended(*lease);
                held.ended(*lease);
                out.push(ProviderEvent::Ended {
                    lease: *lease,
                    reason,
                    detail,
                });
            }
        }
    }
    for ev in out {
        if events.send(ev).await.is_err() {
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::kubernetes::PodWatch;

    fn state() -> WatchState {
        WatchState {
            pods: HashMap::new(),
            init: None,
            gone: HashSet::new(),
            gone_order: VecDeque::new(),
            watched: Watched::new(),
        }
    }

    fn running(name: &str, uid: &str) -> PodView {
        PodView {
            name: name.into(),
            uid: uid.into(),
            phase: "Running".into(),
            ..PodView::default()
        }
    }

    #[test]
    fn our_own_deletion_is_no_news_until_the_release_fails() {
        let mut st = state();
        let mut strays = Vec::new();
        let (lease, view) = (LeaseId(7), running("tidegate-worker-7", "u-7"));
        let w = PodWatch::new(lease, &view, true);
        let watch = Box::new((w, view.clone()));
        assert_eq!(st.on_cmd(Cmd::Watch(watch), &mut strays), [lease]);
        assert_eq!(st.pods.get("tidegate-worker-7"), Some(&view));
        assert!(
            st.on_cmd(Cmd::Releasing(lease, true), &mut strays)
                .is_empty()
        );
        assert!(st.watched.news(lease).is_none());
        assert_eq!(st.leases_of("tidegate-worker-7"), [lease]);
        assert_eq!(
            st.on_cmd(Cmd::Releasing(lease, false), &mut strays),
            [lease]
        );
        assert!(st.watched.news(lease).is_some());
        assert!(strays.is_empty());
    }

    #[test]
    fn a_watch_keeps_the_pods_view_unless_that_pod_is_gone_and_an_abandoned_pod_may_be_a_stray() {
        let mut st = state();
        let mut strays = Vec::new();
        let view = running("tidegate-worker-8", "u-8");
        st.mark_gone("u-8");
        let watch = Box::new((PodWatch::new(LeaseId(8), &view, false), view));
        assert_eq!(st.on_cmd(Cmd::Watch(watch), &mut strays), [LeaseId(8)]);
        assert!(st.pods.is_empty(), "a gone Pod does not come back");
        let abandoned = Cmd::Abandoned {
            name: "tidegate-worker-9".into(),
            stray: "tidegate-token-9".into(),
        };
        assert!(st.on_cmd(abandoned, &mut strays).is_empty());
        assert_eq!(strays, ["tidegate-worker-9"]);
        // not there yet: nothing to delete
        assert!(st.stray("tidegate-worker-9").is_none());
        st.pods.insert(
            "tidegate-worker-9".into(),
            running("tidegate-worker-9", "u-9"),
        );
        let (v, secret) = st.stray("tidegate-worker-9").unwrap();
        assert_eq!(
            (v.uid.as_str(), secret.as_str()),
            ("u-9", "tidegate-token-9")
        );
    }
}
