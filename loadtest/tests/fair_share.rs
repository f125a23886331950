//! Fair shares through real processes on 127.0.0.1 (issue 21, hostile
//! edges): a gateway, one BlazeFace worker, and two edges of equal weight
//! speaking the real QUIC protocol. The attacker opens several connections
//! under one edge name, each with many cameras, never obeys a hint, and
//! declares the longest budget a frame can carry (`u32::MAX` µs); the
//! legitimate edge sends 24 cameras beside it, about as many frames as
//! the worker serves, so that both compete.
//!
//! What must hold, whatever the machine's speed:
//! - the legitimate edge gets exactly one result for every frame it sent;
//! - while both compete, it gets at least its weighted share of the frames
//!   served: with equal weights, at least half of what it asked for, or at
//!   least a third of everything served (half, less slack for the frames
//!   its own budget or cameras lose);
//! - when the attacker's connections close, its queued frames are dropped
//!   and counted (`tidegate_frames_dropped_total{reason="edge_gone"}`), and
//!   no more of its frames end after that than were on the worker then.
//!
//! Nothing asserts on latency; the run is bounded in frames and time.

use std::time::{Duration, Instant};

use serde_json::Value;
use tidegate_loadtest::attack::edge::flood_thread;
use tidegate_loadtest::cluster::{Cluster, ClusterOptions, metric_value, plain};
use tidegate_loadtest::loadgen;
use tidegate_protocol::Encoding;
use tokio_util::sync::CancellationToken;

/// Connections the attacker opens under its one edge name.
const ATTACK_CONNECTIONS: usize = 2;
/// Cameras on each of them: together more than the gateway's whole queue
/// (`max_queued`), which a camera fills at most one place of.
const ATTACK_CAMERAS: usize = 64;

/// The gateway's queue is smaller than the attacker's cameras, and its
/// bound per edge name lets one edge fill all of it: only the fair share
/// keeps room for the other. A frame is held to 5 s at most.
const SCHEDULER: &str = "max_queued = 64\nmax_queued_per_edge = 64\nmax_budget_ms = 5000\n";

fn frames(c: &Cluster) -> Value {
    let (code, body) = c
        .get("/api/v1/frames")
        .unwrap_or_else(|e| panic!("GET /api/v1/frames: {e:#}"));
    assert_eq!(code, 200, "GET /api/v1/frames: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("/api/v1/frames: {e}: {body}"))
}

fn count(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no {key} count in {v}"))
}

/// The value of the series `series` (name and labels, as exported) on
/// `/metrics`; 0 when it has no value yet.
fn metric(c: &Cluster, series: &str) -> f64 {
    let (_, body) = c
        .get("/metrics")
        .unwrap_or_else(|e| panic!("GET /metrics: {e:#}"));
    metric_value(&body, series).unwrap_or(0.0)
}

fn wait_until(c: &Cluster, timeout: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let until = Instant::now() + timeout;
    while !check() {
        assert!(
            Instant::now() < until,
            "timed out waiting for {what}\n--- gateway log ---\n{}",
            c.gateway_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A `key=N` field of a log line.
fn field(line: &str, key: &str) -> u64 {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {line}"))
}

#[test]
fn a_flooding_edge_gets_only_its_share_and_its_queued_frames_die_with_its_connections() {
    let mut c = Cluster::start(&ClusterOptions {
        edges: vec!["legit".into(), "attacker".into()],
        workers: vec!["worker-1".into()],
        scheduler: SCHEDULER.into(),
        ..ClusterOptions::default()
    })
    .expect("gateway starts");
    c.spawn_worker("worker-1").expect("worker starts");
    c.wait_for_workers(1, Duration::from_secs(90))
        .expect("worker registers");

    let jpeg = Encoding::Jpeg { quality: 90 };
    let mut attacker = c.load_options("attacker", ATTACK_CAMERAS, 4.0, 120.0);
    attacker.encoding = jpeg;
    let stop = CancellationToken::new();
    // `ATTACK_CONNECTIONS` connections under one edge name, each opening
    // its cameras with the longest budget there is and flooding them,
    // never obeying a hint, until `stop` fires.
    let attack = flood_thread(attacker, ATTACK_CONNECTIONS, stop.clone());
    wait_until(
        &c,
        Duration::from_secs(30),
        "the attack to be served",
        || count(&frames(&c), "ok") >= 20,
    );

    // The legitimate edge, while the attack goes on.
    let mut legit = c.load_options("legit", 24, 10.0, 6.0);
    legit.budget_ms = 2_000;
    legit.in_step = false;
    legit.encoding = jpeg;
    let ok_before = count(&frames(&c), "ok");
    let r = loadgen::run_blocking(&legit).expect("the legitimate edge runs");
    let served = count(&frames(&c), "ok") - ok_before;

    // Then the attacker's connections drop, with its frames queued (it
    // offers several times what one worker serves, so they are).
    let mut before_close = Value::Null;
    wait_until(
        &c,
        Duration::from_secs(30),
        "the attacker's frames queued",
        || {
            before_close = frames(&c);
            count(&before_close, "queued") >= 16
        },
    );
    stop.cancel();
    attack
        .join()
        .expect("the attacker stops")
        .expect("the attacker connects and floods");
    wait_until(&c, Duration::from_secs(30), "every edge gone", || {
        metric(&c, "tidegate_edges_connected") == 0.0
    });
    let mut settled = Value::Null;
    wait_until(&c, Duration::from_secs(30), "frames settle", || {
        settled = frames(&c);
        count(&settled, "queued") == 0 && count(&settled, "dispatched") == 0
    });
    let dropped = metric(&c, "tidegate_frames_dropped_total{reason=\"edge_gone\"}");
    let log = plain(&c.gateway_log());
    let gone = log
        .lines()
        .rfind(|l| l.contains("edge connection gone"))
        .unwrap_or_else(|| panic!("no edge went, says the log:\n{log}"))
        .to_string();
    drop(c);
    eprintln!(
        "legitimate edge: {} ok of {} sent, {} served in all meanwhile; \
         attacker gone: {dropped} queued frames dropped; {gone}",
        r.ok, r.sent, served
    );

    // One result per frame for the legitimate edge.
    assert!(r.sent > 0, "the legitimate edge sent nothing: {r:?}");
    assert_eq!(r.missing, 0, "frames without a result: {r:?}");
    assert_eq!(r.duplicates, 0, "frames with two results: {r:?}");
    assert_eq!(
        r.results() + r.reset + r.refused + r.lost_with_connection,
        r.sent,
        "{r:?}"
    );
    // Its share: with equal weights it is served in turn with the attacker
    // whenever both have frames queued, so it gets half of what it asks
    // for, or half of what is served (a third, for the slack).
    assert!(
        r.ok * 2 >= r.sent || r.ok * 3 >= served,
        "the legitimate edge got {} of its {} frames while {} were served in all: {r:?}",
        r.ok,
        r.sent,
        served
    );
    // The attacker's queued frames died with its connections; of its
    // frames, only those already on the worker could still end.
    assert!(
        dropped > 0.0,
        "no queued frame was dropped when the attacker went (queue then: {before_close})"
    );
    let ended = |v: &Value| count(v, "ok") + count(v, "failed") + count(v, "expired");
    let (ended_then, on_workers) = (field(&gone, "ended"), field(&gone, "on_workers"));
    assert!(
        ended(&settled) - ended_then <= on_workers,
        "{} frames ended after the attacker went, with {} on the worker: {gone}\n{settled}",
        ended(&settled) - ended_then,
        on_workers
    );
    let n = |k: &str| count(&settled, k);
    assert_eq!(
        n("admitted"),
        n("ok") + n("shed") + n("expired") + n("failed"),
        "{settled}"
    );
}
