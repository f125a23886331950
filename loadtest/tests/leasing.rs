//! GPU leasing through real processes on 127.0.0.1: a gateway with a
//! `[leasing]` section whose process provider spawns real BlazeFace
//! workers, simulated cameras speaking the real QUIC protocol, and the
//! SQLite ledger read back through `/api/v1/leases`.
//!
//! - (a)+(b) load rises: more workers are leased and serve; load falls: the
//!   surplus leases are released at the end of their paid block;
//! - (c) a simulated spot preemption: the worker is drained, a replacement
//!   is leased, and every frame sent gets exactly one result;
//! - (d) the gateway is killed (-9) and restarted on the same ledger: the
//!   live leases are adopted, the ledger is intact, and no worker process
//!   outlives its lease.
//!
//! The test catalog bills per second with a 3 s minimum and starts workers
//! in 2 s, so a whole lease lifecycle fits in seconds. Workers are planned
//! at `worker_fps = 20` (`measure = false`): the machine's cores are shared
//! by every worker, so their standalone profiles would over-state what each
//! delivers here. Every wait is bounded; nothing asserts on speed.

use std::time::{Duration, Instant};

use serde_json::Value;
use tidegate_gateway::api::parse_time;
use tidegate_loadtest::cluster::{Cluster, ClusterOptions, plain};
use tidegate_testkit::leasing::{
    CATALOG, assert_every_frame_answered_once, leases, loadgen_opts, reason, settled_counters,
    spawn_loadgen, state, wait_until,
};

/// One leasing gateway at a time: each spawns several workers.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Minimum of the test catalog's per-second billing, ms.
const BILLING_MINIMUM_MS: u64 = 3000;

fn leasing_cluster(policy: &str, min_fps: f64, extra: &str, process: &str) -> Cluster {
    let leasing = format!(
        "catalog = \"catalog.toml\"\nledger = \"leases.db\"\npolicy = \"{policy}\"\ntick_ms = 500\nheadroom = 0.0\n{extra}\n[[leasing.models]]\nname = \"blazeface\"\ninstance_types = [\"cpu-test\"]\nmin_fps = {min_fps}\nworker_fps = 20\nmeasure = false\n"
    );
    Cluster::start_leasing(
        &ClusterOptions {
            edges: vec!["edge-1".into()],
            workers: Vec::new(),
            ..ClusterOptions::default()
        },
        &leasing,
        process,
        &[("catalog.toml", CATALOG)],
    )
    .expect("leasing gateway starts")
}

fn pid_of(l: &Value) -> Option<u32> {
    l["pid"].as_u64().map(|p| p as u32)
}

/// Alive and not a zombie.
fn pid_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .is_some_and(|(_, rest)| !matches!(rest.trim_start().chars().next(), Some('Z' | 'X')))
    })
}

/// A lease worker's token, read from its environment as the process
/// provider handed it over.
fn lease_token(pid: u32) -> String {
    let env = std::fs::read(format!("/proc/{pid}/environ")).expect("worker environment");
    env.split(|b| *b == 0)
        .find_map(|kv| kv.strip_prefix(b"TIDEGATE_LEASE_TOKEN="))
        .map(|t| String::from_utf8_lossy(t).into_owned())
        .expect("TIDEGATE_LEASE_TOKEN in the worker's environment")
}

/// Says `Hello` as worker `name` with `token`: the gateway's refusal, or
/// `None` when it welcomed us.
fn hello_as_worker(c: &Cluster, name: &str, token: &str) -> Option<String> {
    use tidegate_protocol::quic::{HandshakeError, client_config, dial, handshake};
    use tidegate_protocol::{Hello, Limits, Role};
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(async {
            let client = client_config(&c.ca()).expect("client TLS config");
            let conn = dial(c.quic, "localhost", client).await.expect("dial");
            let hello = Hello {
                role: Role::Worker,
                name: name.into(),
                token: token.into(),
            };
            let r = match handshake(&conn, hello, &Limits::default()).await {
                Ok(_) => None,
                Err(HandshakeError::Refused { message, .. }) => Some(message),
                Err(e) => Some(format!("handshake failed otherwise: {e}")),
            };
            conn.close(0u32.into(), b"test done");
            r
        })
}

fn ready_count(c: &Cluster) -> usize {
    leases(c, true)
        .iter()
        .filter(|l| state(l) == "ready")
        .count()
}

/// Every lease the gateway holds is released on a clean stop, and no
/// worker process outlives it.
fn stop_and_check_no_worker_left(c: &mut Cluster) {
    if std::env::var_os("TIDEGATE_TEST_LOG").is_some() {
        eprintln!("{}", plain(&c.gateway_log()));
    }
    let pids: Vec<u32> = leases(c, false).iter().filter_map(pid_of).collect();
    assert!(!pids.is_empty());
    let status = c
        .stop_gateway(Duration::from_secs(60))
        .expect("gateway stops on SIGTERM");
    assert!(status.success(), "gateway exit: {status}");
    let until = Instant::now() + Duration::from_secs(30);
    while pids.iter().any(|p| pid_alive(*p)) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(100));
    }
    let alive: Vec<&u32> = pids.iter().filter(|p| pid_alive(**p)).collect();
    assert!(alive.is_empty(), "worker processes left running: {alive:?}");
}

#[test]
fn load_rise_leases_more_workers_and_load_fall_releases_them_at_their_block_end() {
    let _g = serial();
    let mut c = leasing_cluster(
        "paid-block-aware",
        5.0,
        "down_window_secs = 4\nrelease_window_secs = 1",
        "",
    );
    // The floor (5 frames/s) needs one worker before any camera can open.
    wait_until(&c, Duration::from_secs(90), "first lease ready", || {
        ready_count(&c) >= 1
    });
    assert_eq!(leases(&c, false).len(), 1, "one worker covers the floor");

    // (a) 30 frames/s needs two workers planned at 20. The load lasts 30
    // s: well past a second worker's start, however slow the machine.
    let sim = spawn_loadgen(loadgen_opts(&c, 2, 15.0, 30.0));
    wait_until(&c, Duration::from_secs(60), "a second lease ready", || {
        ready_count(&c) >= 2
    });
    assert!(
        !sim.is_finished(),
        "the load ended before the second worker was ready; it cannot have served"
    );
    let report = sim.join().expect("sim thread");
    assert_every_frame_answered_once(&report);
    let all = leases(&c, false);
    for l in &all {
        assert_eq!(l["tier"], "spot", "paid-block-aware buys spot: {l}");
        // billed from the provider's answer on
        let answered = state(l) != "requested";
        assert_eq!(l["billing_started_at"].as_str().is_some(), answered, "{l}");
    }

    // (b) the load is gone: the surplus goes at its block end, the floor stays.
    wait_until(&c, Duration::from_secs(90), "surplus released", || {
        leases(&c, true).len() == 1
    });
    let all = leases(&c, false);
    let released: Vec<&Value> = all.iter().filter(|l| state(l) == "ended").collect();
    assert!(!released.is_empty(), "{all:#?}");
    for l in &released {
        assert_eq!(reason(l), "released", "{l}");
        // instants are RFC 3339 UTC with milliseconds
        let at = |k: &str| parse_time(l[k].as_str().unwrap()).unwrap();
        let (start, end) = (at("billing_started_at"), at("ended_at"));
        assert!(
            end >= start + BILLING_MINIMUM_MS,
            "released before its paid block ended: {l}"
        );
        assert!(l["cost"].as_f64().unwrap() > 0.0, "{l}");
        let pid = pid_of(l).unwrap();
        wait_until(
            &c,
            Duration::from_secs(30),
            "released lease's worker exits",
            || !pid_alive(pid),
        );
    }

    // Frames served per lease add up to what workers answered, once the
    // autoscaler's ticks have recorded them in the ledger (polled, bounded).
    let frames = settled_counters(&c);
    let answered = frames["ok"].as_u64().unwrap() + frames["failed"].as_u64().unwrap();
    let by_lease = || -> u64 {
        leases(&c, false)
            .iter()
            .map(|l| l["frames_within_slo"].as_u64().unwrap() + l["frames_late"].as_u64().unwrap())
            .sum()
    };
    let until = Instant::now() + Duration::from_secs(30);
    let recorded = loop {
        let n = by_lease();
        if n == answered || Instant::now() > until {
            break n;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(
        recorded,
        answered,
        "ledger frames vs {frames} after 30 s: {:#?}",
        leases(&c, false)
    );
    // Served at all: within the SLO or late, as this machine allows.
    let serving = leases(&c, false)
        .iter()
        .filter(|l| {
            l["frames_within_slo"].as_u64().unwrap() + l["frames_late"].as_u64().unwrap() > 0
        })
        .count();
    assert!(
        serving >= 2,
        "the added workers served: {:#?}",
        leases(&c, false)
    );

    // Costs and metrics are served.
    let (code, body) = c.get("/api/v1/costs?from=0").expect("GET /api/v1/costs");
    assert_eq!(code, 200, "{body}");
    let costs: Value = serde_json::from_str(&body).unwrap();
    assert!(costs["total"].as_f64().unwrap() > 0.0, "{costs}");
    assert_eq!(
        costs["by_tier"],
        serde_json::json!([{"tier": "spot", "cost": costs["total"]}]),
        "{costs}"
    );
    // The showback: every answered frame is the one edge's and the one
    // model's, and the leases' cost is theirs or idle, to the micro-unit.
    let total = costs["total"].as_f64().unwrap();
    let idle = costs["idle"].as_f64().unwrap();
    for (split, field, key) in [
        ("by_edge", "edge", "edge-1"),
        ("by_model", "model", "blazeface"),
    ] {
        let shares = costs[split].as_array().expect(split);
        assert_eq!(shares.len(), 1, "{split}: {costs}");
        let s = &shares[0];
        assert_eq!(s[field], key, "{split}: {costs}");
        let frames = s["frames_within_slo"].as_u64().unwrap() + s["frames_late"].as_u64().unwrap();
        assert_eq!(frames, answered, "{split}: {costs}");
        assert!(s["busy_s"].as_f64().unwrap() > 0.0, "{costs}");
        let cost = s["cost"].as_f64().unwrap();
        assert!((cost + idle - total).abs() < 1e-6, "{split}: {costs}");
        assert!(cost > 0.0, "{costs}");
    }
    // The same split as CSV, for a spreadsheet.
    let (code, csv) = c
        .get("/api/v1/costs.csv?from=0")
        .expect("GET /api/v1/costs.csv");
    assert_eq!(code, 200, "{csv}");
    let rows: Vec<Vec<&str>> = csv.lines().map(|l| l.split(',').collect()).collect();
    assert_eq!(rows[0][0], "split", "{csv}");
    let row = |split: &str, name: &str| {
        rows.iter()
            .find(|r| r[0] == split && r[1] == name)
            .unwrap_or_else(|| panic!("no {split} row {name:?}: {csv}"))
    };
    for (split, name) in [("edge", "edge-1"), ("model", "blazeface")] {
        let r = row(split, name);
        let frames: u64 = r[4].parse::<u64>().unwrap() + r[5].parse::<u64>().unwrap();
        assert_eq!(frames, answered, "{csv}");
        assert!(r[2].parse::<f64>().unwrap() > 0.0, "{csv}");
    }
    assert!(row("total", "")[2].parse::<f64>().unwrap() > 0.0, "{csv}");
    row("idle", "");
    let (_, metrics) = c.get("/metrics").unwrap();
    for name in [
        "tidegate_leases{",
        "tidegate_cost_per_1k_frames_within_slo",
        "tidegate_gpu_utilization_ratio",
        "tidegate_leased_busy_seconds_total",
        "tidegate_leased_paid_seconds_total",
        "tidegate_lease_frames_total{result=\"within_slo\"}",
    ] {
        assert!(metrics.contains(name), "{name} missing from /metrics");
    }
    // Spot's cost, with the catalog's currency named.
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("tidegate_cost_total{")
                && l.contains("tier=\"spot\"")
                && l.contains("currency=\"")),
        "no spot cost with its currency in /metrics"
    );
    stop_and_check_no_worker_left(&mut c);
}

#[test]
fn spot_preemption_replaces_the_worker_and_every_frame_gets_one_result() {
    let _g = serial();
    // every spot lease is preempted 6 s after it starts, with 1.5 s notice
    let mut c = leasing_cluster(
        "tidal",
        5.0,
        "",
        "notice_period_secs = 1.5\npreempt_spot_after_secs = 6",
    );
    wait_until(&c, Duration::from_secs(60), "spot lease ready", || {
        ready_count(&c) >= 1
    });
    let sim = spawn_loadgen(loadgen_opts(&c, 1, 10.0, 14.0));
    wait_until(&c, Duration::from_secs(40), "spot lease preempted", || {
        leases(&c, false)
            .iter()
            .any(|l| state(l) == "ended" && reason(l) == "preempted")
    });
    wait_until(&c, Duration::from_secs(40), "replacement ready", || {
        leases(&c, true)
            .iter()
            .any(|l| l["tier"] == "on_demand" && state(l) == "ready")
    });
    let report = sim.join().expect("sim thread");
    assert_every_frame_answered_once(&report);
    settled_counters(&c);
    for l in leases(&c, false) {
        if reason(&l) == "preempted" {
            assert_eq!(l["tier"], "spot", "{l}");
            assert!(
                !pid_alive(pid_of(&l).unwrap()),
                "preempted worker runs: {l}"
            );
        }
    }
    assert!(
        c.gateway_log().contains("spot preemption notice"),
        "the notice is logged"
    );
    stop_and_check_no_worker_left(&mut c);
}

#[test]
fn gateway_crash_and_restart_adopts_live_leases_and_leaks_no_worker() {
    let _g = serial();
    // two workers for the 25 frames/s floor
    let mut c = leasing_cluster("tidal", 25.0, "", "");
    wait_until(&c, Duration::from_secs(60), "two leases ready", || {
        ready_count(&c) >= 2
    });
    let before = leases(&c, false);
    let pids: Vec<u32> = before.iter().filter_map(pid_of).collect();
    assert_eq!(pids.len(), 2, "{before:#?}");

    // A lease token is good once, and only for its own lease.
    let (id0, id1) = (&before[0]["id"], &before[1]["id"]);
    let token0 = lease_token(pid_of(&before[0]).unwrap());
    let reused = hello_as_worker(&c, &format!("lease-{id0}"), &token0).expect("refused");
    assert!(reused.contains("already used"), "{reused}");
    let other = hello_as_worker(&c, &format!("lease-{id1}"), &token0).expect("refused");
    assert!(other.contains("does not match"), "{other}");
    let unknown = hello_as_worker(&c, "lease-999", &token0).expect("refused");
    assert!(unknown.contains("not a live lease"), "{unknown}");

    c.kill_gateway();
    // a crash kills no worker
    assert!(
        pids.iter().all(|p| pid_alive(*p)),
        "workers died with the gateway"
    );
    c.restart_gateway()
        .expect("gateway restarts on the same ledger");
    for l in &before {
        let want = format!("lease=lease-{} pid={}", l["id"], pid_of(l).unwrap());
        wait_until(&c, Duration::from_secs(10), "adoption logged", || {
            plain(&c.gateway_log())
                .lines()
                .any(|line| line.contains("adopted worker after restart") && line.contains(&want))
        });
    }
    // The adopted workers redial the restarted gateway and register again
    // with their own (re-armed) tokens: the same processes serve on, and no
    // replacement is leased for them.
    wait_until(
        &c,
        Duration::from_secs(30),
        "adopted workers registered again",
        || {
            let Ok((200, body)) = c.get("/api/v1/workers") else {
                return false;
            };
            before
                .iter()
                .all(|l| body.contains(&format!("\"lease-{}\"", l["id"])))
        },
    );
    assert!(
        pids.iter().all(|p| pid_alive(*p)),
        "adopted workers exited instead of redialling"
    );
    // Their tokens are spent again: a second registration is refused.
    let reused = hello_as_worker(&c, &format!("lease-{id0}"), &token0).expect("refused");
    assert!(reused.contains("already used"), "{reused}");
    // The ledger kept every lease as it was, still live, and its cost.
    let after = leases(&c, false);
    for b in &before {
        let a = after
            .iter()
            .find(|l| l["id"] == b["id"])
            .expect("lease kept in the ledger");
        for k in [
            "requested_at",
            "billing_started_at",
            "ready_at",
            "pid",
            "tier",
        ] {
            assert_eq!(a[k], b[k], "{k} changed: {b} -> {a}");
        }
        assert_eq!(state(a), "ready", "{a}");
        assert!(a["cost"].as_f64().unwrap() >= b["cost"].as_f64().unwrap());
    }
    // An operator releases one lease through the API: it ends released
    // (and the autoscaler leases a replacement for the floor).
    let admin = c.admin_token.clone();
    let (code, body) = c
        .post("/api/v1/leases/999/release", Some(&admin))
        .expect("POST");
    assert_eq!(code, 404, "{body}");
    let release = format!("/api/v1/leases/{id0}/release");
    let (code, body) = c.post(&release, None).expect("POST");
    assert_eq!(code, 401, "{body}");
    let (code, body) = c.post(&release, Some(&admin)).expect("POST");
    assert_eq!(code, 202, "{body}");
    wait_until(
        &c,
        Duration::from_secs(20),
        "the released lease ends",
        || {
            leases(&c, false)
                .iter()
                .any(|l| l["id"] == *id0 && state(l) == "ended" && reason(l) == "released")
        },
    );
    let (code, body) = c.post(&release, Some(&admin)).expect("POST");
    assert_eq!(code, 409, "{body}");
    assert!(body.contains("already ended"), "{body}");
    stop_and_check_no_worker_left(&mut c);
}
