//! GPU leasing through the Kubernetes provider: a gateway whose
//! `kubernetes` provider creates each lease as a Pod, real BlazeFace
//! workers started from those Pods that dial back over QUIC on 127.0.0.1,
//! simulated cameras, and a spot node reclaimed under a serving worker.
//!
//! The API server is the test double of `testkit/src/mini_kube.rs`
//! (no Kubernetes API server can be installed on this machine): kube's real
//! client talks HTTP to it, and its "kubelet" runs each Pod's container as
//! a local process on one node with 2 GPUs; each lease asks for one. When
//! the spot Pod is evicted the way Kubernetes' taint manager does it
//! (`DisruptionTarget` condition, graceful delete), the worker gets SIGTERM
//! and drains, the gateway gets the notice, stops dispatching to it and
//! leases an on-demand replacement. Every frame sent still gets exactly
//! one result. On a clean stop the gateway deletes its Pods and their token
//! Secrets. Every wait is bounded; nothing asserts on speed.

use std::time::Duration;

use serde_json::Value;
use tidegate_loadtest::cluster::Cluster;
use tidegate_testkit::leasing::{
    CATALOG, assert_every_frame_answered_once, first_spot_lease, leases, loadgen_opts, ok_frames,
    one_edge, one_worker_leasing, settled_counters, spawn_loadgen, spot_taken_and_replaced, state,
    wait_until_explained,
};
use tidegate_testkit::mini_kube::MiniKube;

const NS: &str = "tidegate";

fn pod_of(l: &Value) -> String {
    let data: Value = serde_json::from_str(l["provider_data"].as_str().expect("provider data"))
        .expect("provider data is JSON");
    data["pod"].as_str().expect("a pod name").to_string()
}

/// The Pods and the workers' logs, for a failure message.
fn kube_context(kube: &MiniKube) -> String {
    let pods: Vec<String> = kube
        .pods(NS)
        .iter()
        .map(|p| {
            format!(
                "{} {}",
                p["metadata"]["name"].as_str().unwrap_or("?"),
                p["status"]["phase"].as_str().unwrap_or("?")
            )
        })
        .collect();
    format!("pods: {pods:?}\n{}", kube.logs())
}

/// A leasing gateway whose Kubernetes provider talks to `kube`, with the
/// `extra` `[leasing]` lines and `tiers` (`[leasing.kubernetes.tiers.*]`
/// tables; none: on-demand only).
fn start(kube: &MiniKube, extra: &str, tiers: &str) -> Cluster {
    let section = format!(
        "kubeconfig = {}\nnamespace = \"{NS}\"\ntermination_grace_period_secs = 5\ngpus = {{ cpu-test = 1 }}\n{tiers}",
        serde_json::Value::String(kube.kubeconfig().display().to_string())
    );
    Cluster::start_leasing_kubernetes(
        &one_edge(),
        &one_worker_leasing(extra),
        &section,
        &[("catalog.toml", CATALOG)],
    )
    .expect("leasing gateway starts")
}

#[test]
fn kubernetes_pods_serve_frames_and_a_reclaimed_spot_node_replaces_the_worker() {
    let kube = MiniKube::start(2);
    let mut c = start(
        &kube,
        "",
        "[leasing.kubernetes.tiers.on_demand]\n[leasing.kubernetes.tiers.spot]\nnode_selector = { \"tidegate.test/spot\" = \"true\" }\n",
    );
    let first = first_spot_lease(&c, "kubernetes", || kube_context(&kube));
    let spot_pod = pod_of(&first);
    let pod = kube.pod(NS, &spot_pod).expect("the spot lease's pod");
    assert_eq!(pod["status"]["phase"], "Running", "{pod:#}");
    assert_eq!(pod["spec"]["nodeSelector"]["tidegate.test/spot"], "true");

    // the spot node is reclaimed under the serving worker
    spot_taken_and_replaced(
        &c,
        || kube_context(&kube),
        || kube.evict(NS, &spot_pod, "DeletionByTaintManager", None),
    );
    assert!(kube.pod(NS, &spot_pod).is_none(), "the evicted pod is gone");

    settled_counters(&c);

    // a clean stop deletes every pod the gateway holds, and its secrets
    let status = c
        .stop_gateway(Duration::from_secs(60))
        .expect("gateway stops on SIGTERM");
    assert!(status.success(), "gateway exit: {status}");
    assert!(kube.pods(NS).is_empty(), "{}", kube_context(&kube));
    assert!(kube.secrets(NS).is_empty(), "{:#?}", kube.secrets(NS));
}

#[test]
fn with_on_stop_keep_a_restart_adopts_the_running_pods_and_pays_no_new_lease() {
    let kube = MiniKube::start(2);
    let mut c = start(&kube, "on_stop = \"keep\"\n", "");
    wait_until_explained(
        &c,
        Duration::from_secs(90),
        "a lease ready",
        || kube_context(&kube),
        || leases(&c, false).iter().any(|l| state(l) == "ready"),
    );
    // (no spot tier is configured: the autoscaler's spot try is refused
    // and it falls back to on-demand)
    let before = leases(&c, true);
    assert_eq!(before.len(), 1, "{before:#?}");
    // leases ever billed (a refused spot try never starts billing)
    let billed = |c: &Cluster| {
        leases(c, false)
            .into_iter()
            .filter(|l| !l["billing_started_at"].is_null())
            .count()
    };
    let billed_before = billed(&c);
    let pod = pod_of(&before[0]);
    let uid = kube.pod(NS, &pod).expect("its pod")["metadata"]["uid"].clone();

    // a clean stop keeps the lease: the pod runs on, its token secret stays
    let status = c
        .stop_gateway(Duration::from_secs(60))
        .expect("gateway stops on SIGTERM");
    assert!(status.success(), "gateway exit: {status}");
    let running = kube.pod(NS, &pod).expect("the pod outlives the gateway");
    assert_eq!(running["status"]["phase"], "Running", "{running:#}");
    assert_eq!(running["metadata"]["deletionTimestamp"], Value::Null);
    assert_eq!(kube.secrets(NS).len(), 1, "{:#?}", kube.secrets(NS));
    assert!(
        c.gateway_log()
            .contains("leases kept live for the next start"),
        "the stop says what it kept"
    );

    // the next start adopts it; its worker redials and registers again
    c.restart_gateway()
        .expect("gateway restarts on the same ledger");
    let id = before[0]["id"].clone();
    wait_until_explained(
        &c,
        Duration::from_secs(60),
        "the adopted worker registered again",
        || kube_context(&kube),
        || {
            c.get("/api/v1/workers")
                .is_ok_and(|(code, body)| code == 200 && body.contains(&format!("\"lease-{id}\"")))
        },
    );
    let after = leases(&c, true);
    assert_eq!(after.len(), 1, "{after:#?}");
    assert_eq!(
        billed(&c),
        billed_before,
        "no new lease was paid for: {:#?}",
        leases(&c, false)
    );
    for k in [
        "id",
        "requested_at",
        "billing_started_at",
        "ready_at",
        "tier",
    ] {
        assert_eq!(after[0][k], before[0][k], "{k} changed");
    }
    assert_eq!(state(&after[0]), "ready", "{:#}", after[0]);
    let same = kube.pod(NS, &pod).expect("the same pod");
    assert_eq!(same["metadata"]["uid"], uid);
    assert!(
        c.gateway_log().contains("adopted worker pod after restart"),
        "the adoption is logged"
    );
    // and it serves
    let report = spawn_loadgen(loadgen_opts(&c, 1, 10.0, 3.0))
        .join()
        .expect("sim thread");
    assert_every_frame_answered_once(&report);
    assert!(ok_frames(&c) > 0, "{}", kube_context(&kube));
}
