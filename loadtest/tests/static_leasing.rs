//! Static leasing through real processes on 127.0.0.1: a gateway with
//! `[leasing] provider = "static"` and one `[[leasing.static_workers]]`
//! entry, a real BlazeFace `tidegate-worker` process started by the test
//! with that worker's own name and provisioned token (no `[[workers]]`
//! entry), and simulated cameras speaking the real QUIC protocol.
//!
//! - the worker connects while bound to no lease and waits, registered but
//!   `unbound` (no batch);
//! - load makes the autoscaler bind it: the lease is ready at once and the
//!   worker serves;
//! - the load goes: the autoscaler releases the lease; the worker is
//!   unbound, not dropped: same process, same connection (its session id),
//!   no redial;
//! - load again binds it under a new lease; an operator releases that lease
//!   under load (`POST /api/v1/leases/{id}/release`): it is unbound on the
//!   same connection and, the load still needing it, bound a third time;
//!   every frame sent gets exactly one result.
//!
//! Every wait is bounded; nothing asserts on speed.

use std::process::{Child, Stdio};
use std::time::Duration;

use serde_json::Value;
use tidegate_loadtest::cluster::{Cluster, ClusterOptions, command, plain, workspace_root};
use tidegate_testkit::leasing::{
    assert_every_frame_answered_once, leases, loadgen_opts, reason, settled_counters,
    spawn_loadgen, state, wait_until,
};

/// The static worker's name and its provisioned token.
const NAME: &str = "gpu-a";
const SECRET: &str = "static-gpu-a-provisioned-token-for-this-test";

/// The `[leasing]` section: one static on-demand `cpu-32` worker (the
/// built-in catalog), nothing kept without load (`min_fps = 0`), and the
/// reactive policy, which binds a worker for any load and releases it one
/// second after the load is gone. The ledger lands next to the config.
fn leasing_section() -> String {
    format!(
        r#"
[leasing]
provider = "static"
ledger = "leases.db"
policy = "reactive-idle-timeout"
tick_ms = 500
headroom = 0.0
idle_timeout_secs = 1
[[leasing.static_workers]]
name = "{NAME}"
instance_type = "cpu-32"
tier = "on_demand"
token_sha256 = "{}"
[[leasing.models]]
name = "blazeface"
instance_types = ["cpu-32"]
worker_fps = 20
measure = false
"#,
        tidegate_gateway::auth::hash_token(SECRET)
    )
}

/// The static worker's process, killed and reaped on drop.
struct StaticWorker(Child);

impl StaticWorker {
    /// Starts `tidegate-worker` as [`NAME`] with its own token, serving
    /// BlazeFace with one intra-op thread; its log is `gpu-a.log`.
    fn spawn(c: &Cluster) -> StaticWorker {
        let cfg = c
            .worker_config(NAME, &workspace_root().join("models"), &["blazeface"])
            .expect("worker config written");
        let log = std::fs::File::create(c.dir().join(format!("{NAME}.log"))).expect("log file");
        let child = command("tidegate-worker")
            .expect("tidegate-worker built")
            .arg("--config")
            .arg(cfg)
            .env("TIDEGATE_WORKER_TOKEN", SECRET)
            .env("TIDEGATE_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("tidegate-worker starts");
        StaticWorker(child)
    }

    /// Still running (it has not exited).
    fn running(&mut self) -> bool {
        matches!(self.0.try_wait(), Ok(None))
    }
}

impl Drop for StaticWorker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The static worker as `/api/v1/workers` shows it, if registered.
fn worker_view(c: &Cluster) -> Option<Value> {
    let Ok((200, body)) = c.get("/api/v1/workers") else {
        return None;
    };
    let all: Value = serde_json::from_str(&body).ok()?;
    all.as_array()?.iter().find(|w| w["name"] == NAME).cloned()
}

/// The ready lease other than `not`, if any.
fn ready_lease(c: &Cluster, not: &[u64]) -> Option<u64> {
    leases(c, true)
        .iter()
        .filter(|l| state(l) == "ready")
        .filter_map(|l| l["id"].as_u64())
        .find(|id| !not.contains(id))
}

/// Waits until the worker, on connection `session`, serves a ready lease
/// other than `not`; that lease.
fn wait_bound(c: &Cluster, session: &Value, not: &[u64], what: &str) -> u64 {
    let mut bound = None;
    wait_until(c, Duration::from_secs(60), what, || {
        bound = ready_lease(c, not).filter(|id| {
            worker_view(c).is_some_and(|w| {
                w["session"] == *session && w["lease"] == *id && w["unbound"] == false
            })
        });
        bound.is_some()
    });
    bound.expect("checked above")
}

/// Waits until lease `id` has ended `released`.
fn wait_released(c: &Cluster, id: u64, what: &str) {
    wait_until(c, Duration::from_secs(60), what, || {
        leases(c, false)
            .iter()
            .any(|l| l["id"] == id && state(l) == "ended" && reason(l) == "released")
    });
}

/// The worker process runs, on the same connection as before, and never
/// lost its link to the gateway.
fn assert_same_link(c: &Cluster, w: &mut StaticWorker, session: &Value) {
    assert!(w.running(), "the static worker exited: {}", worker_log(c));
    let view = worker_view(c).expect("the static worker is registered");
    assert_eq!(view["session"], *session, "a new connection: {view}");
    let log = worker_log(c);
    assert!(
        !log.contains("redialling") && !log.contains("link to the gateway lost"),
        "the worker lost its link: {log}"
    );
}

fn worker_log(c: &Cluster) -> String {
    plain(&std::fs::read_to_string(c.dir().join(format!("{NAME}.log"))).unwrap_or_default())
}

#[test]
fn a_static_worker_keeps_its_connection_unbound_between_leases_and_serves_whenever_bound() {
    let mut c = Cluster::start(&ClusterOptions {
        edges: vec!["edge-1".into()],
        workers: Vec::new(),
        scheduler: leasing_section(),
        ..ClusterOptions::default()
    })
    .expect("static leasing gateway starts");
    let mut w = StaticWorker::spawn(&c);

    // It connects with its own token while bound to nothing, and waits.
    let mut session = Value::Null;
    wait_until(
        &c,
        Duration::from_secs(60),
        "the static worker registered unbound",
        || {
            let Some(v) = worker_view(&c) else {
                return false;
            };
            session = v["session"].clone();
            v["unbound"] == true && v["draining"] == true && v["lease"].is_null()
        },
    );
    assert!(w.running(), "{}", worker_log(&c));
    assert!(leases(&c, true).is_empty(), "no load, no lease");

    // Load: the autoscaler binds it (ready at once: it is registered) and
    // it serves.
    let sim = spawn_loadgen(loadgen_opts(&c, 1, 10.0, 8.0));
    let first = wait_bound(&c, &session, &[], "the worker bound to a first lease");
    let report = sim.join().expect("sim thread");
    assert_every_frame_answered_once(&report);

    // The load is gone: the autoscaler releases the lease. The worker is
    // unbound on the same connection, not dropped, and takes nothing.
    wait_released(&c, first, "the autoscaler released the first lease");
    wait_until(&c, Duration::from_secs(20), "the worker unbound", || {
        worker_view(&c).is_some_and(|v| v["unbound"] == true && v["lease"].is_null())
    });
    assert_same_link(&c, &mut w, &session);
    let settled = settled_counters(&c);
    assert_eq!(settled["dispatched"], 0, "{settled}");
    assert!(leases(&c, true).is_empty(), "{:#?}", leases(&c, true));

    // Load again: bound again under a new lease. An operator releases it
    // under load: it is unbound on the same connection, and the load still
    // needing it, bound a third time. Every frame gets one result.
    let sim = spawn_loadgen(loadgen_opts(&c, 1, 10.0, 16.0));
    let second = wait_bound(&c, &session, &[first], "the worker bound again");
    let admin = c.admin_token.clone();
    let (code, body) = c
        .post(&format!("/api/v1/leases/{second}/release"), Some(&admin))
        .expect("POST release");
    assert_eq!(code, 202, "{body}");
    wait_released(&c, second, "the operator released the second lease");
    let third = wait_bound(
        &c,
        &session,
        &[first, second],
        "the worker bound a third time",
    );
    assert_same_link(&c, &mut w, &session);
    let report = sim.join().expect("sim thread");
    assert_every_frame_answered_once(&report);
    settled_counters(&c);
    assert_same_link(&c, &mut w, &session);

    // Each lease bound this worker, and the first one served frames (the
    // ticks record them in the ledger; polled, bounded).
    let all = leases(&c, false);
    for id in [first, second, third] {
        let l = all.iter().find(|l| l["id"] == id).expect("in the ledger");
        assert_eq!(l["provider"], "static", "{l}");
        assert!(
            l["provider_data"]
                .as_str()
                .is_some_and(|d| d.contains(NAME)),
            "{l}"
        );
    }
    wait_until(
        &c,
        Duration::from_secs(10),
        "the first lease's frames recorded",
        || {
            leases(&c, false).iter().any(|l| {
                l["id"] == first
                    && l["frames_within_slo"].as_u64().unwrap_or(0)
                        + l["frames_late"].as_u64().unwrap_or(0)
                        > 0
            })
        },
    );
    if std::env::var_os("TIDEGATE_TEST_LOG").is_some() {
        eprintln!("{}\n{}", plain(&c.gateway_log()), worker_log(&c));
    }

    // A clean stop ends the live lease released; the worker is not ours to
    // stop (it redials; the test kills it).
    let status = c
        .stop_gateway(Duration::from_secs(20))
        .expect("gateway stops on SIGTERM");
    assert!(status.success(), "gateway exit: {status}");
    assert!(w.running(), "the static worker outlives the gateway");
}
