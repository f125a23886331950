//! Helpers of the load tests' leasing tests (`loadtest/tests/leasing.rs`,
//! `static_leasing.rs`, `slurm_leasing.rs`, `kubernetes_leasing.rs`,
//! `reload.rs`): the per-second test catalog, simulated cameras, and
//! polling the gateway's API with its log on failure. `scheduling.rs` uses
//! the polling and the settled frame counters too (its gateway leases
//! nothing). Feature `leasing`.

use std::time::{Duration, Instant};

use serde_json::Value;
use tidegate_loadtest::cluster::{Cluster, ClusterOptions};
use tidegate_loadtest::loadgen::{self, LoadOptions};
use tidegate_loadtest::report::Report;

/// One instance type, billed per second with a 3 s minimum, started in 2 s.
pub const CATALOG: &str = r#"
currency = "CNY"
[[instance]]
name = "cpu-test"
gpu_model = "none (test worker on this host)"
gpus = 0
gpu_memory_gib = 0.0
fp16_tflops = 1.0
memory_bandwidth_gbs = 10.0
billing = "second"
billing_minimum_secs = 3
spot_interruptions_per_hour = 0.0
startup_secs = 2
price_per_hour = { on_demand = 3.60, spot = 1.20, reserved = 2.40 }
"#;

/// Simulated cameras of `edge-1` (see [`Cluster::load_options`]).
pub fn loadgen_opts(c: &Cluster, cameras: usize, fps: f64, seconds: f64) -> LoadOptions {
    c.load_options("edge-1", cameras, fps, seconds)
}

/// Runs the simulated cameras on their own thread.
pub fn spawn_loadgen(opts: LoadOptions) -> std::thread::JoinHandle<Report> {
    std::thread::spawn(move || loadgen::run_blocking(&opts).expect("simulation runs"))
}

pub fn leases(c: &Cluster, live: bool) -> Vec<Value> {
    let path = if live {
        "/api/v1/leases?live=true"
    } else {
        "/api/v1/leases"
    };
    let (code, body) = c.get(path).expect("GET /api/v1/leases");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str::<Value>(&body)
        .expect("JSON")
        .as_array()
        .expect("an array")
        .clone()
}

pub fn state(l: &Value) -> &str {
    l["state"].as_str().unwrap_or("?")
}

pub fn reason(l: &Value) -> &str {
    l["end_reason"].as_str().unwrap_or("")
}

/// Every frame the cameras sent got exactly one result, and some were ok.
pub fn assert_every_frame_answered_once(report: &Report) {
    assert_eq!(
        report.missing, 0,
        "every sent frame has a result: {report:?}"
    );
    assert_eq!(report.duplicates, 0, "{report:?}");
    assert!(report.ok > 0, "{report:?}");
}

/// Polls `check` until it holds, or fails with the gateway's log.
pub fn wait_until(c: &Cluster, timeout: Duration, what: &str, check: impl FnMut() -> bool) {
    wait_until_explained(c, timeout, what, String::new, check)
}

/// [`wait_until`], adding `context()` (other logs) to the failure.
pub fn wait_until_explained(
    c: &Cluster,
    timeout: Duration,
    what: &str,
    context: impl Fn() -> String,
    mut check: impl FnMut() -> bool,
) {
    let until = Instant::now() + timeout;
    while !check() {
        if Instant::now() > until {
            let log = c.gateway_log();
            let tail: Vec<&str> = log.lines().rev().take(60).collect();
            // As served, without asserting: a gateway without [leasing]
            // answers with an error, which must not hide this failure.
            let leases = match c.get("/api/v1/leases") {
                Ok((code, body)) => format!("{code} {body}"),
                Err(e) => format!("unavailable: {e:#}"),
            };
            panic!(
                "{what}: not within {timeout:?}; leases: {leases}\ngateway log (last lines, newest first):\n{}\n{}",
                tail.join("\n"),
                context()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The gateway's frame counters now.
pub fn frames(c: &Cluster) -> Value {
    let (code, body) = c.get("/api/v1/frames").expect("GET /api/v1/frames");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).expect("JSON")
}

/// Frames the gateway has answered `ok` so far.
pub fn ok_frames(c: &Cluster) -> u64 {
    let v = frames(c);
    v["ok"]
        .as_u64()
        .unwrap_or_else(|| panic!("no ok count in {v}"))
}

/// The gateway's frame counters once nothing is in flight; they balance.
pub fn settled_counters(c: &Cluster) -> Value {
    let mut v = Value::Null;
    wait_until(c, Duration::from_secs(10), "frames settle", || {
        v = frames(c);
        v["queued"] == 0 && v["dispatched"] == 0
    });
    let n = |k: &str| v[k].as_u64().unwrap();
    assert_eq!(
        n("admitted"),
        n("ok") + n("shed") + n("expired") + n("failed"),
        "{v}"
    );
    v
}

/// A spot worker taken away under load, and its replacement: one camera
/// sends 10 fps for 16 s; once the spot worker has served 10 frames,
/// `take` takes it the cluster's own way (its result is returned). Then
/// the spot lease must end `preempted`, an on-demand replacement must
/// become ready, every frame sent must get exactly one result, and the
/// notice must be in the gateway's log. `context` explains a timeout.
pub fn spot_taken_and_replaced<T>(
    c: &Cluster,
    context: impl Fn() -> String,
    take: impl FnOnce() -> T,
) -> T {
    let sim = spawn_loadgen(loadgen_opts(c, 1, 10.0, 16.0));
    wait_until_explained(
        c,
        Duration::from_secs(10),
        "10 frames served ok by the spot worker",
        &context,
        || ok_frames(c) >= 10,
    );
    let taken = take();
    wait_until_explained(
        c,
        Duration::from_secs(60),
        "spot lease preempted",
        &context,
        || {
            leases(c, false)
                .iter()
                .any(|l| state(l) == "ended" && reason(l) == "preempted")
        },
    );
    wait_until_explained(
        c,
        Duration::from_secs(90),
        "on-demand replacement ready",
        &context,
        || {
            leases(c, false)
                .iter()
                .any(|l| l["tier"] == "on_demand" && state(l) == "ready")
        },
    );
    let report = sim.join().expect("sim thread");
    assert_every_frame_answered_once(&report);
    assert!(
        c.gateway_log().contains("spot preemption notice"),
        "the notice is logged"
    );
    taken
}

/// `[leasing]` of the provider tests: one BlazeFace model on the test
/// catalog's `cpu-test`, the tidal policy with a floor of 5 frames/s at 20
/// per worker (one lease); `extra` lines are added to the section.
pub fn one_worker_leasing(extra: &str) -> String {
    format!(
        "catalog = \"catalog.toml\"\nledger = \"leases.db\"\npolicy = \"tidal\"\ntick_ms = 500\nheadroom = 0.0\n{extra}[[leasing.models]]\nname = \"blazeface\"\ninstance_types = [\"cpu-test\"]\nmin_fps = 5\nworker_fps = 20\nmeasure = false\n"
    )
}

/// One edge (`edge-1`), no listed workers.
pub fn one_edge() -> ClusterOptions {
    ClusterOptions {
        edges: vec!["edge-1".into()],
        workers: Vec::new(),
        ..ClusterOptions::default()
    }
}

/// Waits for the first lease, a spot one, to be ready, and returns it:
/// the only lease so far, of `provider`.
pub fn first_spot_lease(c: &Cluster, provider: &str, context: impl Fn() -> String) -> Value {
    wait_until_explained(
        c,
        Duration::from_secs(90),
        "a spot lease ready",
        context,
        || {
            leases(c, false)
                .iter()
                .any(|l| state(l) == "ready" && l["tier"] == "spot")
        },
    );
    let first = leases(c, false);
    assert_eq!(first.len(), 1, "{first:#?}");
    assert_eq!(first[0]["provider"], provider);
    first[0].clone()
}
