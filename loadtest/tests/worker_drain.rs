//! SIGTERM drains a worker without losing a batch: real gateway, worker and
//! edge processes on 127.0.0.1. The edge streams astronaut.png from eight
//! cameras; mid-run, at a moment when the gateway has frames dispatched to
//! the worker, the worker gets SIGTERM. Every frame the edge sent must get
//! exactly one result, every frame in the worker's hands at the signal must
//! come back `ok` (not failed or re-queued as "worker lost"), and the worker
//! must exit 0. And a worker whose gateway crashes redials it.

use std::collections::HashSet;
use std::process::Command;
use std::time::{Duration, Instant};

use tidegate_loadtest::cluster::{Cluster, ClusterOptions, bin, workspace_root};
use tidegate_loadtest::edge_harness::{EdgeCamera, edge_config};
use tidegate_loadtest::loadgen;

/// The gateway's frame counters.
fn frames(c: &Cluster) -> serde_json::Value {
    let (status, body) = c.get("/api/v1/frames").expect("gateway answers");
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).expect("JSON counters")
}

fn count(v: &serde_json::Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("no {key} in {v}"))
}

#[test]
fn sigterm_mid_run_answers_every_dispatched_batch_and_exits_0() {
    let mut c = Cluster::start(&ClusterOptions::default()).expect("gateway starts");
    let spawned = Instant::now();
    c.spawn_worker("worker-1").expect("worker starts");
    c.wait_for_workers(1, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e}\nworker log:\n{}", c.worker_log("worker-1")));
    // Reported, not asserted (docs/benchmarks.md): process start to a
    // registered, warmed worker.
    eprintln!(
        "worker start-up: {} ms from spawn to registered (models warmed and profiled)",
        spawned.elapsed().as_millis()
    );

    let uri = format!(
        "image://{}",
        workspace_root()
            .join("models/testdata/astronaut.png")
            .display()
    );
    let cameras: Vec<EdgeCamera> = (0..8)
        .map(|i| EdgeCamera::new(&format!("cam-{i}"), &uri, "blazeface", 30.0))
        .collect();
    let edge_cfg = edge_config(&c, "edge-1", &cameras).unwrap();
    let edge = {
        let edge_token = c.edge_token.clone();
        let edge_cfg = edge_cfg.clone();
        std::thread::spawn(move || {
            Command::new(bin("tidegate-edge").unwrap())
                .arg("--config")
                .arg(&edge_cfg)
                .args(["--max-frames", "90"])
                .env("TIDEGATE_EDGE_TOKEN", edge_token)
                .env("TIDEGATE_LOG", "warn")
                .output()
                .expect("edge runs")
        })
    };

    // Mid-run: once results flow, wait for a moment when frames are in the
    // worker's hands, and signal it then.
    let until = Instant::now() + Duration::from_secs(30);
    let (ok_before, dispatched_at) = loop {
        let f = frames(&c);
        if count(&f, "ok") >= 40 && count(&f, "dispatched") > 0 {
            c.signal_worker("worker-1", "TERM").expect("SIGTERM");
            break (count(&f, "ok"), count(&f, "dispatched"));
        }
        assert!(
            Instant::now() < until,
            "never saw frames dispatched; counters {f}\nworker log:\n{}",
            c.worker_log("worker-1")
        );
        std::thread::sleep(Duration::from_millis(1));
    };

    // The worker drains and exits 0.
    let until = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = c.worker_exit("worker-1") {
            break s;
        }
        assert!(Instant::now() < until, "worker did not exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    let worker_log = c.worker_log("worker-1");
    assert!(
        status.success(),
        "worker exited with {status}:\n{worker_log}"
    );
    assert!(worker_log.contains("draining"), "{worker_log}");

    // Every frame the edge sent got exactly one result.
    let out = edge.join().expect("edge thread");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "edge failed: {stderr}");
    let summary = stderr
        .lines()
        .find_map(|l| l.split("summary: ").nth(1))
        .unwrap_or_else(|| panic!("no summary in {stderr}"));
    let field = |k: &str| -> u64 {
        summary
            .split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {k} in {summary}"))
    };
    let results = field("results");
    // Every frame the edge handed to its uplink ended once, by its own
    // ledger: a result, or a reset (superseded or expired on the wire),
    // none refused, lost, cut off with the connection or given up on, and
    // none still awaited. (The summary's `sent` counts acknowledgements,
    // and a result can beat its frame's acknowledgement to the edge's
    // books at the very end.)
    // The last counters of each camera: those printed at the edge's stop.
    let last: std::collections::BTreeMap<String, serde_json::Value> = stderr
        .lines()
        .filter_map(|l| l.strip_prefix("camera_stats "))
        .filter_map(|j| serde_json::from_str::<serde_json::Value>(j).ok())
        .map(|v| (v["camera"].as_str().unwrap_or("").to_string(), v))
        .collect();
    assert_eq!(last.len(), 8, "counters of each camera:\n{stderr}");
    let stats: Vec<serde_json::Value> = last.into_values().collect();
    let n =
        |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap_or_else(|| panic!("no {k} in {v}"));
    for v in &stats {
        let ended: u64 = ["results", "reset_superseded", "reset_expired"]
            .iter()
            .map(|k| n(v, k))
            .sum();
        let otherwise: u64 = ["refused", "lost", "lost_connection", "gave_up", "awaiting"]
            .iter()
            .map(|k| n(v, k))
            .sum();
        assert_eq!(
            (n(v, "handed"), otherwise),
            (ended, 0),
            "every frame handed ends once, by a result or a reset: {v}; gateway counters {}\nworker log:\n{}",
            frames(&c),
            c.worker_log("worker-1")
        );
    }
    assert_eq!(
        stats.iter().map(|v| n(v, "results")).sum::<u64>(),
        results,
        "{summary}"
    );
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("each stdout line is JSON"))
        .collect();
    assert_eq!(lines.len() as u64, results, "{summary}");
    let unique: HashSet<(String, u64)> = lines
        .iter()
        .map(|l| {
            (
                l["camera"].as_str().unwrap().to_string(),
                l["seq"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(unique.len(), lines.len(), "a frame got two results");

    // The frames in the worker's hands at the signal came back ok: nothing
    // was failed or re-queued as "worker lost".
    let f = frames(&c);
    assert!(
        count(&f, "ok") >= ok_before + dispatched_at,
        "ok {} < {ok_before} ok + {dispatched_at} dispatched at SIGTERM: a batch was lost; {f}\nworker log:\n{worker_log}",
        count(&f, "ok")
    );
    let failed: Vec<String> = lines
        .iter()
        .filter(|l| l["status"] == "failed")
        .map(|l| l["reason"].as_str().unwrap_or("").to_string())
        .collect();
    assert!(
        !failed.iter().any(|r| r.contains("worker lost")),
        "frames failed as worker lost: {failed:?}"
    );
    eprintln!(
        "gateway counters at the end: {f}; at SIGTERM: ok {ok_before}, dispatched {dispatched_at}; failed: {failed:?}"
    );
    // The books balance, with nothing left in flight.
    assert_eq!(count(&f, "queued") + count(&f, "dispatched"), 0, "{f}");
    assert_eq!(
        count(&f, "admitted"),
        count(&f, "ok") + count(&f, "shed") + count(&f, "expired") + count(&f, "failed"),
        "{f}"
    );
    // Frames refused before admission (no worker left) are answered too,
    // but not admitted.
    let handed: u64 = stats.iter().map(|v| n(v, "handed")).sum();
    assert!(count(&f, "admitted") <= handed, "{f}");
}

/// A gateway crash does not end a worker: it redials the restarted gateway,
/// registers again and serves.
#[test]
fn a_worker_redials_a_restarted_gateway_and_serves_again() {
    let mut c = Cluster::start(&ClusterOptions::default()).expect("gateway starts");
    c.spawn_worker("worker-1").expect("worker starts");
    c.wait_for_workers(1, Duration::from_secs(60))
        .expect("worker registers");
    let pid = c.worker_pid("worker-1").expect("worker pid");
    c.kill_gateway();
    // The outage itself, not a wait for a condition: the worker must notice
    // the dead gateway and keep redialling while it is down.
    std::thread::sleep(Duration::from_secs(2));
    c.restart_gateway()
        .expect("gateway restarts on the same ports");
    // The same process comes back: wait_for_workers fails if it exited.
    c.wait_for_workers(1, Duration::from_secs(30))
        .expect("the worker registers again");
    assert_eq!(c.worker_pid("worker-1"), Some(pid));
    assert!(
        c.worker_log("worker-1").contains("redialling"),
        "no redial in the worker log:\n{}",
        c.worker_log("worker-1")
    );
    // And it serves: a few frames through the restarted gateway.
    let r = loadgen::run_blocking(&c.load_options("edge-1", 2, 5.0, 2.0)).expect("simulation runs");
    // Served, each frame `ok` or shed by the scheduler (on a busy machine
    // it may shed one it cannot make in time; every frame `ok` would be a
    // speed claim), none failed, refused or lost.
    assert!(r.sent > 0 && r.ok > 0, "{:?}", r.outcomes);
    assert_eq!(r.ok + r.shed + r.expired, r.sent, "{:?}", r.outcomes);
}
