//! The Kubernetes provider through kube's real client against
//! `testkit/src/mini_kube.rs`: an in-process API server (core v1 Pods and
//! Secrets, list/watch/create/delete/patch, garbage collection) whose
//! "kubelet" runs each Pod's container as a local process on a node with 2
//! GPUs. No Kubernetes API server can be installed on this machine, so this
//! double is what the provider is tested against; see its module docs for
//! what it simplifies. A shell script stands in for `tidegate-worker`: it
//! writes its environment to a file, and on SIGTERM writes a `drained`
//! file and exits 0, as the worker drains. Waits are bounded by timeouts
//! that only guard against a hang; no test asserts how fast anything
//! happens.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use tidegate_lease::catalog::{Catalog, Tier};
use tidegate_lease::ledger::Ledger;
use tidegate_lease::lifecycle::{EndReason, LeaseState};
use tidegate_lease::provider::kubernetes::{
    KubernetesConfig, KubernetesData, KubernetesProvider, Placement, TolerationConfig,
};
use tidegate_lease::provider::{Provider, ProviderError, ProviderEvent, wall_clock_ms};
use tidegate_lease::table::LeaseId;
use tidegate_testkit::mini_kube::MiniKube;
use tidegate_testkit::provider::{
    GUARD, WORKER, acquire_recorded, ended, env_of, next_event, spec, var, wait_for,
};

const NS: &str = "tidegate";

fn config(kube: &MiniKube, out: &Path, script: &str) -> KubernetesConfig {
    let mut cfg = KubernetesConfig::new("local/tidegate-worker");
    cfg.kubeconfig = Some(kube.kubeconfig());
    cfg.namespace = Some(NS.into());
    cfg.command = vec!["sh".into(), "-c".into(), script.into()];
    cfg.env.insert("OUT".into(), out.display().to_string());
    cfg.termination_grace_period_secs = 5;
    cfg.release_timeout_secs = 30.0;
    // the test node is labelled as a spot node with H200s
    cfg.tiers.spot = Some(Placement {
        node_selector: [("tidegate.test/spot".to_string(), "true".to_string())].into(),
        tolerations: vec![TolerationConfig {
            key: Some("tidegate.test/spot".into()),
            operator: Some("Exists".into()),
            value: None,
            effect: Some("NoSchedule".into()),
        }],
        priority_class: None,
    });
    cfg
}

/// A provider on `kube` holding one on-demand lease (1) whose worker runs,
/// and its events.
async fn one_running(
    kube: &MiniKube,
    out: &Path,
) -> (
    KubernetesProvider,
    tokio::sync::mpsc::Receiver<ProviderEvent>,
) {
    let mut p = KubernetesProvider::connect(config(kube, out, WORKER))
        .await
        .unwrap();
    let events = p.take_events().unwrap();
    p.acquire(spec(1, Tier::OnDemand, "h100")).await.unwrap();
    wait_for("the worker", || context(kube), || env_of(out, 1).is_some()).await;
    // The kubelet reports the container running a moment after it has
    // started it: a pod killed before that never ran as far as the API
    // says, and its lease would end `failed`, not `lost`.
    wait_for(
        "the pod running",
        || context(kube),
        || kube.pods(NS).iter().any(|p| phase(p) == "Running"),
    )
    .await;
    (p, events)
}

/// The Pods and the containers' output, for a failure message.
/// A provider of the stand-in worker that waits at most 1 s for any API
/// call (`api_timeout_secs`), for the tests of a server that answers late.
async fn impatient(kube: &MiniKube, out: &std::path::Path) -> KubernetesProvider {
    let mut cfg = config(kube, out, WORKER);
    cfg.api_timeout_secs = 1.0;
    KubernetesProvider::connect(cfg).await.unwrap()
}

/// The names of `objects`.
fn names(objects: &[Value]) -> Vec<String> {
    objects
        .iter()
        .filter_map(|o| o["metadata"]["name"].as_str().map(String::from))
        .collect()
}

fn context(kube: &MiniKube) -> String {
    format!("pods: {:#?}\n{}", kube.pods(NS), kube.logs())
}

fn phase(pod: &Value) -> &str {
    pod["status"]["phase"].as_str().unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_is_a_pod_with_its_gpus_and_token_secret_and_release_drains_it() {
    let kube = MiniKube::start(2);
    let out = tempfile::tempdir().unwrap();
    let mut p = KubernetesProvider::connect(config(&kube, out.path(), WORKER))
        .await
        .unwrap();
    assert_eq!(p.namespace(), NS);
    let mut events = p.take_events().unwrap();
    let s = spec(1, Tier::OnDemand, "h100");
    let token = s.token.expose().to_string();
    let acquired = p.acquire(s).await.unwrap();
    let data: KubernetesData =
        serde_json::from_str(acquired.provider_data.as_deref().unwrap()).unwrap();
    assert_eq!(data.namespace, NS);
    assert_eq!(data.pod, "tidegate-worker-1");
    assert_eq!(p.held(), vec![LeaseId(1)]);
    wait_for(
        "the worker's environment",
        || context(&kube),
        || env_of(out.path(), 1).is_some(),
    )
    .await;
    let env = env_of(out.path(), 1).unwrap();
    assert_eq!(var(&env, "TIDEGATE_LEASE_TOKEN"), Some(token.as_str()));
    assert_eq!(var(&env, "TIDEGATE_LEASE_ID"), Some("1"));
    assert_eq!(var(&env, "TIDEGATE_INSTANCE_TYPE"), Some("h100"));
    assert_eq!(var(&env, "TIDEGATE_LEASE_TIER"), Some("on_demand"));
    assert_eq!(var(&env, "TIDEGATE_POD_NAME"), Some("tidegate-worker-1"));

    let pod = kube.pod(NS, "tidegate-worker-1").unwrap();
    assert_eq!(pod["metadata"]["uid"], data.uid.as_str());
    assert_eq!(
        pod["metadata"]["labels"]["tidegate.io/pool"],
        "tidegate-worker"
    );
    assert_eq!(pod["spec"]["restartPolicy"], "Never");
    let gpus = Catalog::default_catalog().get("h100").unwrap().gpus;
    assert_eq!(
        pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
        gpus.to_string().as_str()
    );
    // the token is in no Pod spec: the worker read it from its Secret,
    // which the Pod owns
    assert!(!pod.to_string().contains(&token), "{pod:#}");
    let secret = kube.secret(NS, "tidegate-worker-1-token").unwrap();
    let owners = &secret["metadata"]["ownerReferences"];
    assert_eq!(owners[0]["kind"], "Pod", "{secret:#}");
    assert_eq!(owners[0]["uid"], data.uid.as_str());

    p.release(LeaseId(1)).await.unwrap();
    // the delete's SIGTERM reached the worker, which drained
    assert!(out.path().join("lease-1.drained").exists());
    assert!(kube.pod(NS, "tidegate-worker-1").is_none());
    assert!(kube.secret(NS, "tidegate-worker-1-token").is_none());
    assert!(p.held().is_empty());
    // our own release is no news
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(events.try_recv().is_err());
    assert!(matches!(
        p.release(LeaseId(1)).await,
        Err(ProviderError::UnknownLease(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubernetes_taking_a_spot_pod_is_the_notice_and_the_worker_drains() {
    let kube = MiniKube::start(2);
    let out = tempfile::tempdir().unwrap();
    let mut p = KubernetesProvider::connect(config(&kube, out.path(), WORKER))
        .await
        .unwrap();
    let mut events = p.take_events().unwrap();
    p.acquire(spec(1, Tier::Spot, "h200")).await.unwrap();
    wait_for(
        "the spot worker",
        || context(&kube),
        || env_of(out.path(), 1).is_some(),
    )
    .await;
    let pod = kube.pod(NS, "tidegate-worker-1").unwrap();
    assert_eq!(
        pod["spec"]["nodeSelector"]["tidegate.test/spot"], "true",
        "{pod:#}"
    );
    assert_eq!(
        pod["spec"]["tolerations"][0]["key"], "tidegate.test/spot",
        "{pod:#}"
    );

    // the spot node is reclaimed: the taint manager marks and deletes it
    let before = wall_clock_ms();
    kube.evict(NS, "tidegate-worker-1", "DeletionByTaintManager", None);
    match next_event(&mut events).await {
        ProviderEvent::PreemptionNotice { lease, deadline } => {
            assert_eq!(lease, LeaseId(1));
            // the deletion time: now + the pod's 5 s grace (whole seconds)
            assert!(deadline + 1000 >= before + 5000, "{deadline} vs {before}");
            assert!(deadline <= wall_clock_ms() + 5000, "{deadline}");
        }
        other => panic!("expected the spot notice, got {other:?}"),
    }
    let (reason, detail) = ended(&mut events, LeaseId(1)).await;
    assert_eq!(reason, EndReason::Preempted, "{detail}");
    // the worker got SIGTERM with the notice and drained
    assert!(out.path().join("lease-1.drained").exists());
    assert!(p.held().is_empty());
    wait_for(
        "the token secret to be collected",
        || context(&kube),
        || kube.secret(NS, "tidegate-worker-1-token").is_none(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_dies_ends_its_lease_lost_and_a_pod_that_never_ran_failed() {
    let kube = MiniKube::start(2);
    let out = tempfile::tempdir().unwrap();
    let (p, mut events) = one_running(&kube, out.path()).await;
    kube.kill(NS, "tidegate-worker-1");
    let (reason, detail) = ended(&mut events, LeaseId(1)).await;
    assert_eq!(reason, EndReason::Lost, "{detail}");
    assert!(detail.contains("exited 137"), "{detail}");
    // the finished Pod object is deleted, and its Secret with it
    wait_for(
        "the finished pod to be deleted",
        || context(&kube),
        || {
            kube.pod(NS, "tidegate-worker-1").is_none()
                && kube.secret(NS, "tidegate-worker-1-token").is_none()
        },
    )
    .await;

    // a worker that exits at once, before anything saw it run
    let mut cfg = config(&kube, out.path(), "exit 3");
    cfg.name_prefix = "quick".into();
    let mut q = KubernetesProvider::connect(cfg).await.unwrap();
    let mut qevents = q.take_events().unwrap();
    q.acquire(spec(2, Tier::OnDemand, "h100")).await.unwrap();
    let (reason, detail) = ended(&mut qevents, LeaseId(2)).await;
    assert!(
        reason == EndReason::Failed || reason == EndReason::Lost,
        "{reason:?} {detail}"
    );
    assert!(detail.contains("exited 3"), "{detail}");
    assert!(p.held().is_empty() && q.held().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_cannot_start_waits_without_events_and_releases_at_once() {
    let kube = MiniKube::start(1);
    let out = tempfile::tempdir().unwrap();
    let mut p = KubernetesProvider::connect(config(&kube, out.path(), WORKER))
        .await
        .unwrap();
    let mut events = p.take_events().unwrap();
    // the node has 1 GPU; an h100 lease asks for the catalog's count
    let mut want_two = spec(1, Tier::OnDemand, "h100");
    want_two.instance.gpus = 2;
    p.acquire(want_two).await.unwrap();
    wait_for(
        "the scheduler to give up on it",
        || context(&kube),
        || {
            kube.pod(NS, "tidegate-worker-1").is_some_and(|pod| {
                pod["status"]["conditions"]
                    .as_array()
                    .is_some_and(|c| c.iter().any(|c| c["reason"] == "Unschedulable"))
            })
        },
    )
    .await;
    // a bad image: the kubelet cannot pull it
    let mut cfg = config(&kube, out.path(), WORKER);
    cfg.image = "registry.invalid/nope:1".into();
    cfg.name_prefix = "badimage".into();
    let mut q = KubernetesProvider::connect(cfg).await.unwrap();
    let _qevents = q.take_events().unwrap();
    let mut small = spec(2, Tier::OnDemand, "cpu-32");
    small.instance.gpus = 0;
    q.acquire(small).await.unwrap();
    wait_for(
        "the image pull to fail",
        || context(&kube),
        || {
            kube.pod(NS, "badimage-2").is_some_and(|pod| {
                pod["status"]["containerStatuses"][0]["state"]["waiting"]["reason"]
                    .as_str()
                    .is_some_and(|r| r.contains("ImagePull"))
            })
        },
    )
    .await;
    // neither is news: the gateway's start timeout decides
    assert!(events.try_recv().is_err());
    assert_eq!(
        phase(&kube.pod(NS, "tidegate-worker-1").unwrap()),
        "Pending"
    );
    p.release(LeaseId(1)).await.unwrap();
    q.release(LeaseId(2)).await.unwrap();
    assert!(kube.pods(NS).is_empty(), "{:#?}", kube.pods(NS));
    assert!(kube.secrets(NS).is_empty(), "{:#?}", kube.secrets(NS));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_gateway_adopts_running_pods_ends_the_gone_and_deletes_orphans() {
    let kube = MiniKube::start(4);
    let out = tempfile::tempdir().unwrap();
    let db = tempfile::tempdir().unwrap();
    let mut ledger = Ledger::open(&db.path().join("leases.db")).unwrap();
    let mut p = KubernetesProvider::connect(config(&kube, out.path(), WORKER))
        .await
        .unwrap();
    let mut pods = Vec::new();
    for _ in 0..2 {
        let data = acquire_recorded(&mut p, &mut ledger, "kubernetes", Some(1)).await;
        let data: KubernetesData = serde_json::from_str(&data).unwrap();
        pods.push(data.pod);
    }
    // a lease whose acquire never recorded its pod (the gateway died in
    // between): its pod is an orphan
    let mut orphan = spec(3, Tier::OnDemand, "h100");
    orphan.instance.gpus = 1;
    p.acquire(orphan).await.unwrap();
    wait_for(
        "three workers",
        || context(&kube),
        || (1..=3).all(|l| env_of(out.path(), l).is_some()),
    )
    .await;
    // the gateway dies; while it is down, pod 2's worker dies
    p.detach_all().await;
    let before_kill = wall_clock_ms();
    kube.kill(NS, &pods[1]);
    wait_for(
        "pod 2 to fail",
        || context(&kube),
        || {
            kube.pod(NS, &pods[1])
                .is_some_and(|p| phase(&p) == "Failed")
        },
    )
    .await;
    let failed_by = wall_clock_ms();
    // the gateway stays down a while longer
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;

    let mut p = KubernetesProvider::connect(config(&kube, out.path(), WORKER))
        .await
        .unwrap();
    let restart = wall_clock_ms();
    let adoption = p.adopt(&mut ledger, restart).await.unwrap();
    assert_eq!(adoption.adopted, vec![LeaseId(1)]);
    assert_eq!(adoption.ended, vec![(LeaseId(2), EndReason::Lost)]);
    let gone = ledger.lease(LeaseId(2)).unwrap().unwrap();
    assert_eq!(gone.state, LeaseState::Ended(EndReason::Lost));
    // billed to its container's finishedAt (whole seconds), not to the
    // restart
    let ended_at = gone.ended_at.unwrap();
    assert!(
        (before_kill.saturating_sub(1000)..=failed_by).contains(&ended_at),
        "ended at {ended_at}, killed in {before_kill}..={failed_by}, restart {restart}"
    );
    assert_eq!(p.held(), vec![LeaseId(1)]);
    // the failed pod and the orphan are deleted, with their secrets
    wait_for(
        "the orphan and the failed pod to go",
        || context(&kube),
        || kube.pods(NS).len() == 1 && kube.secrets(NS).len() == 1,
    )
    .await;
    assert!(out.path().join("lease-3.drained").exists());
    assert_eq!(
        kube.pods(NS)[0]["metadata"]["name"].as_str(),
        Some(pods[0].as_str())
    );
    // the adopted pod is watched: its worker dying ends the lease
    let mut events = p.take_events().unwrap();
    kube.kill(NS, &pods[0]);
    let (reason, detail) = ended(&mut events, LeaseId(1)).await;
    assert_eq!(reason, EndReason::Lost, "{detail}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_errors_are_clear_and_leave_nothing_behind() {
    let kube = MiniKube::start(2);
    let out = tempfile::tempdir().unwrap();
    // RBAC refuses the list: connect says so, and where to look
    kube.fail_next("GET", "/api/v1/namespaces/tidegate/pods", 403, 1);
    let e = KubernetesProvider::connect(config(&kube, out.path(), WORKER))
        .await
        .unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("403") && msg.contains("rbac.yaml"), "{msg}");

    let mut p = KubernetesProvider::connect(config(&kube, out.path(), WORKER))
        .await
        .unwrap();
    // the API server fails the pod's creation: an error, and its token
    // secret is gone again
    kube.fail_next("POST", "/api/v1/namespaces/tidegate/pods", 500, 1);
    let e = p
        .acquire(spec(1, Tier::OnDemand, "h100"))
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            ProviderError::Kubernetes {
                lease: Some(LeaseId(1)),
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("500"), "{e}");
    assert!(kube.secrets(NS).is_empty(), "{:#?}", kube.secrets(NS));
    assert!(p.held().is_empty());
    // a tier with no placement is no capacity, before any API call
    let mut cfg = config(&kube, out.path(), WORKER);
    cfg.tiers.spot = None;
    cfg.name_prefix = "nospot".into();
    let mut q = KubernetesProvider::connect(cfg).await.unwrap();
    assert!(matches!(
        q.acquire(spec(2, Tier::Spot, "h100")).await,
        Err(ProviderError::NoCapacity {
            tier: Tier::Spot,
            ..
        })
    ));
    // the same lease twice
    p.acquire(spec(3, Tier::OnDemand, "cpu-32")).await.unwrap();
    assert!(matches!(
        p.acquire(spec(3, Tier::OnDemand, "cpu-32")).await,
        Err(ProviderError::Duplicate(LeaseId(3)))
    ));
    // an unreachable API server
    let mut cfg = config(&kube, out.path(), WORKER);
    let dir = tempfile::tempdir().unwrap();
    let kc = std::fs::read_to_string(kube.kubeconfig())
        .unwrap()
        .replace(&kube.url(), "http://127.0.0.1:9");
    std::fs::write(dir.path().join("kubeconfig"), kc).unwrap();
    cfg.kubeconfig = Some(dir.path().join("kubeconfig"));
    let e = KubernetesProvider::connect(cfg)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("127.0.0.1:9"), "{e}");
    p.shutdown().await;
    assert!(kube.pods(NS).is_empty(), "{:#?}", kube.pods(NS));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_watch_is_resumed_and_events_still_arrive() {
    let kube = MiniKube::start(2);
    let out = tempfile::tempdir().unwrap();
    let (_p, mut events) = one_running(&kube, out.path()).await;
    // the API server restarts: open watches break and the next requests
    // fail; the watcher backs off and lists again
    kube.fail_next("GET", "/api/v1/namespaces/tidegate/pods", 500, 3);
    kube.break_watches();
    kube.kill(NS, "tidegate-worker-1");
    let (reason, detail) = ended(&mut events, LeaseId(1)).await;
    assert_eq!(reason, EndReason::Lost, "{detail}");
    // it watched: no request polled the pod one by one
    let gets = kube
        .requests()
        .iter()
        .filter(|r| r.starts_with("GET /api/v1/namespaces/tidegate/pods/"))
        .count();
    assert_eq!(gets, 0, "{:#?}", kube.requests());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn begin_release_drains_every_worker_at_once_then_each_release_waits() {
    let kube = MiniKube::start(2);
    let out = tempfile::tempdir().unwrap();
    let mut p = KubernetesProvider::connect(config(&kube, out.path(), WORKER))
        .await
        .unwrap();
    let mut events = p.take_events().unwrap();
    for id in [1, 2] {
        let mut s = spec(id, Tier::OnDemand, "h100");
        s.instance.gpus = 1;
        p.acquire(s).await.unwrap();
    }
    wait_for(
        "both workers",
        || context(&kube),
        || env_of(out.path(), 1).is_some() && env_of(out.path(), 2).is_some(),
    )
    .await;
    p.begin_release(&[LeaseId(1), LeaseId(2)]).await;
    // both workers got SIGTERM and drained before any release waited
    wait_for(
        "both workers to drain",
        || context(&kube),
        || {
            out.path().join("lease-1.drained").exists()
                && out.path().join("lease-2.drained").exists()
        },
    )
    .await;
    p.release(LeaseId(1)).await.unwrap();
    p.release(LeaseId(2)).await.unwrap();
    assert!(p.held().is_empty());
    assert!(kube.pods(NS).is_empty(), "{}", context(&kube));
    // releasing is no news
    assert!(events.try_recv().is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_delete_keeps_the_pod_held_and_its_end_is_news_again() {
    let kube = MiniKube::start(2);
    let out = tempfile::tempdir().unwrap();
    let (mut p, mut events) = one_running(&kube, out.path()).await;
    // the API server refuses the delete: the release fails, the pod (which
    // still runs, and bills) is still held
    kube.fail_next("DELETE", "/api/v1/namespaces/tidegate/pods/", 500, 1);
    let e = p.release(LeaseId(1)).await.unwrap_err();
    assert!(e.to_string().contains("500"), "{e}");
    assert_eq!(p.held(), vec![LeaseId(1)]);
    assert!(events.try_recv().is_err(), "no end while the pod runs");
    // it is still watched: its worker dying ends the lease
    kube.kill(NS, "tidegate-worker-1");
    let (reason, detail) = ended(&mut events, LeaseId(1)).await;
    assert_eq!(reason, EndReason::Lost, "{detail}");
    assert!(p.held().is_empty());
}

/// An API server that takes a Pod's creation and does not answer within
/// `api_timeout_secs` holds the acquire (and so the lease shell) no
/// longer: the acquire fails, and the Pod the server made anyway is
/// deleted with its token Secret, so nothing runs that no lease holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_creation_answered_too_late_fails_the_acquire_and_leaves_nothing_behind() {
    let kube = MiniKube::start(2);
    let out = tempfile::tempdir().unwrap();
    let mut p = impatient(&kube, out.path()).await;
    let an_hour = Duration::from_secs(3600);
    kube.answer_late("POST", "/api/v1/namespaces/tidegate/pods", an_hour, 1);
    let e = tokio::time::timeout(GUARD, p.acquire(spec(1, Tier::OnDemand, "h100")))
        .await
        .expect("the acquire waited for the answer")
        .unwrap_err();
    assert!(
        matches!(
            e,
            ProviderError::Kubernetes {
                lease: Some(LeaseId(1)),
                ..
            }
        ),
        "{e}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("api_timeout_secs") && msg.contains("deleted in case"),
        "{msg}"
    );
    assert!(p.held().is_empty());
    assert_eq!(
        kube.request_count("POST", "/api/v1/namespaces/tidegate/pods"),
        1,
        "the pod was created once"
    );
    wait_for(
        "the pod made without an answer to go",
        || context(&kube),
        || kube.pods(NS).is_empty() && kube.secrets(NS).is_empty(),
    )
    .await;
    // answered in time again: the next acquire holds its Pod
    p.acquire(spec(2, Tier::OnDemand, "h100")).await.unwrap();
    assert_eq!(p.held(), vec![LeaseId(2)]);
    p.shutdown().await;
    assert!(kube.pods(NS).is_empty(), "{:#?}", kube.pods(NS));
}

/// A Pod creation that waits in the API server's queue past
/// `api_timeout_secs` fails the acquire, whose cleanup then finds no Pod;
/// when the server makes the Pod after all, the watch deletes it at once,
/// not at the gateway's next start, and a lease acquired meanwhile is
/// left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_the_api_server_makes_after_its_acquire_gave_up_is_deleted_when_it_appears() {
    let kube = MiniKube::start(2);
    let out = tempfile::tempdir().unwrap();
    let mut p = impatient(&kube, out.path()).await;
    kube.act_late(
        "POST",
        "/api/v1/namespaces/tidegate/pods",
        Duration::from_secs(4),
        1,
    );
    let e = tokio::time::timeout(GUARD, p.acquire(spec(1, Tier::OnDemand, "h100")))
        .await
        .expect("the acquire waited for the answer")
        .unwrap_err()
        .to_string();
    assert!(e.contains("api_timeout_secs"), "{e}");
    // the cleanup came before the Pod: nothing to delete yet
    assert!(kube.pods(NS).is_empty(), "{:#?}", kube.pods(NS));
    assert!(p.held().is_empty());
    let deletes = |kube: &MiniKube| {
        kube.request_count(
            "DELETE",
            "/api/v1/namespaces/tidegate/pods/tidegate-worker-1",
        )
    };
    assert_eq!(deletes(&kube), 1, "the acquire's cleanup");
    // a lease acquired in between is held, and stays so
    p.acquire(spec(2, Tier::OnDemand, "h100")).await.unwrap();
    // once the server makes it, the watch deletes it: a second delete
    wait_for(
        "the pod made after its acquire gave up to be deleted",
        || context(&kube),
        || deletes(&kube) >= 2 && names(&kube.pods(NS)) == ["tidegate-worker-2"],
    )
    .await;
    assert!(
        !names(&kube.secrets(NS)).contains(&"tidegate-worker-1-token".to_string()),
        "{:?}",
        names(&kube.secrets(NS))
    );
    assert_eq!(
        kube.request_count("POST", "/api/v1/namespaces/tidegate/pods"),
        2,
        "each pod was created once"
    );
    assert_eq!(p.held(), vec![LeaseId(2)]);
    p.shutdown().await;
    assert!(kube.pods(NS).is_empty(), "{:#?}", kube.pods(NS));
}

/// A release whose check that the Pod is gone is not answered within
/// `api_timeout_secs` fails, and the Pod stays held; the retry finishes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_the_api_server_does_not_answer_fails_and_is_retried() {
    let kube = MiniKube::start(2);
    let out = tempfile::tempdir().unwrap();
    let mut p = impatient(&kube, out.path()).await;
    p.acquire(spec(1, Tier::OnDemand, "h100")).await.unwrap();
    wait_for(
        "the worker",
        || context(&kube),
        || env_of(out.path(), 1).is_some(),
    )
    .await;
    let an_hour = Duration::from_secs(3600);
    kube.answer_late(
        "GET",
        "/api/v1/namespaces/tidegate/pods/tidegate-worker-1",
        an_hour,
        1,
    );
    let e = tokio::time::timeout(GUARD, p.release(LeaseId(1)))
        .await
        .expect("the release waited for the answer")
        .unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("checking deleted pod") && msg.contains("api_timeout_secs"),
        "{msg}"
    );
    assert_eq!(p.held(), vec![LeaseId(1)]);
    tokio::time::timeout(GUARD, p.release(LeaseId(1)))
        .await
        .expect("the retried release waited too long")
        .unwrap();
    assert!(p.held().is_empty());
    assert!(kube.pods(NS).is_empty(), "{:#?}", kube.pods(NS));
}
