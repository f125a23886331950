//! GPU leasing through the Kubernetes provider: a gateway whose
//! `kubernetes` provider creates each lease as a Pod, real BlazeFace
//! workers started from those Pods that dial back over QUIC on 127.0.0.1,
//! simulated cameras, and a spot node reclaimed under a serving worker.
//!
//! The API server is the test double of `lease/tests/support/mini_kube.rs`
//! (no Kubernetes API server can be installed on this machine): kube's real
//! client talks HTTP to it, and its "kubelet" runs each Pod's container as
//! a local process on one node with 2 GPUs; each lease asks for one. When
//! the spot Pod is evicted the way Kubernetes' taint manager does it
//! (`DisruptionTarget` condition, graceful delete), the worker gets SIGTERM
//! and drains, the gateway gets the notice, stops dispatching to it and
//! leases an on-demand replacement. Every frame sent still gets exactly
//! one result. On a clean stop the gateway deletes its Pods and their token
//! Secrets. Every wait is bounded; nothing asserts on speed.

#[path = "../../lease/tests/support/mini_kube.rs"]
mod mini_kube;

#[path = "support/leasing.rs"]
mod support;

use std::time::Duration;

use mini_kube::MiniKube;
use serde_json::Value;
use support::{
    CATALOG, leases, settled_counters, spot_taken_and_replaced, state, wait_until_explained,
};
use tidegate_loadtest::cluster::{Cluster, ClusterOptions};

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

#[test]
fn kubernetes_pods_serve_frames_and_a_reclaimed_spot_node_replaces_the_worker() {
    let kube = MiniKube::start(2);
    let leasing = "catalog = \"catalog.toml\"\nledger = \"leases.db\"\npolicy = \"tidal\"\ntick_ms = 500\nheadroom = 0.0\n[[leasing.models]]\nname = \"blazeface\"\ninstance_types = [\"cpu-test\"]\nmin_fps = 5\nworker_fps = 20\nmeasure = false\n";
    let section = format!(
        "kubeconfig = {}\nnamespace = \"{NS}\"\ntermination_grace_period_secs = 5\ngpus = {{ cpu-test = 1 }}\n[leasing.kubernetes.tiers.on_demand]\n[leasing.kubernetes.tiers.spot]\nnode_selector = {{ \"tidegate.test/spot\" = \"true\" }}\n",
        serde_json::Value::String(kube.kubeconfig().display().to_string())
    );
    let mut c = Cluster::start_leasing_kubernetes(
        &ClusterOptions {
            edges: vec!["edge-1".into()],
            workers: Vec::new(),
            scheduler: String::new(),
        },
        leasing,
        &section,
        &[("catalog.toml", CATALOG)],
    )
    .expect("leasing gateway starts");

    wait_until_explained(
        &c,
        Duration::from_secs(90),
        "a spot lease ready",
        || kube_context(&kube),
        || {
            leases(&c, false)
                .iter()
                .any(|l| state(l) == "ready" && l["tier"] == "spot")
        },
    );
    let first = leases(&c, false);
    assert_eq!(first.len(), 1, "{first:#?}");
    assert_eq!(first[0]["provider"], "kubernetes");
    let spot_pod = pod_of(&first[0]);
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
