//! Configuration reload through real processes on 127.0.0.1: a gateway,
//! two BlazeFace workers and real `tidegate-edge` processes streaming
//! GStreamer test sources. The gateway's file is rewritten and reloaded
//! (`POST /api/v1/reload`, then SIGHUP):
//!
//! - a removed edge and a worker whose token was rotated are disconnected
//!   with the reason, refused when they dial again, and exit; the worker's
//!   frames are re-homed, and every admitted frame still ends once;
//! - the edge that stays keeps its connection and its results;
//! - a section that only a restart applies is named, not applied;
//! - an unusable file changes nothing and says why;
//! - SIGHUP reloads the same way, and an edge added back gets in.
//!
//! Every wait is bounded; nothing asserts on speed.

use std::time::{Duration, Instant};

use serde_json::Value;
use tidegate_gateway::auth::hash_token;
use tidegate_loadtest::cluster::{Cluster, ClusterOptions, metric_value};
use tidegate_loadtest::edge_harness::{EdgeCamera, EdgeProcess, edge_config};
use tidegate_testkit::leasing::{settled_counters, wait_until};

fn entry(kind: &str, name: &str, token: &str) -> String {
    format!(
        "[[{kind}]]\nname = \"{name}\"\ntoken_sha256 = \"{}\"\n",
        hash_token(token)
    )
}

/// The gateway's config file with `from` replaced by `to` (which must be
/// there once).
fn rewrite(c: &Cluster, from: &str, to: &str) -> String {
    let text = std::fs::read_to_string(c.gateway_config()).expect("read gateway.toml");
    assert_eq!(text.matches(from).count(), 1, "{from:?} in\n{text}");
    let new = text.replacen(from, to, 1);
    std::fs::write(c.gateway_config(), &new).expect("write gateway.toml");
    text
}

fn reload(c: &Cluster) -> (u16, Value) {
    let (code, body) = c
        .post("/api/v1/reload", Some(&c.admin_token))
        .expect("POST /api/v1/reload");
    let v = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    (code, v)
}

fn metric(c: &Cluster, series: &str) -> Option<f64> {
    let (_, text) = c.get("/metrics").expect("GET /metrics");
    metric_value(&text, series)
}

fn streaming_edge(c: &Cluster, name: &str) -> EdgeProcess {
    let camera = EdgeCamera::new(&format!("{name}-cam"), "test://ball", "blazeface", 10.0);
    let cfg = edge_config(c, name, &[camera]).expect("edge config");
    let edge = EdgeProcess::spawn(c, &cfg, &[]).expect("edge starts");
    edge.wait_for_results(
        Duration::from_secs(60),
        &format!("{name}'s first results"),
        |r| r.len() >= 3,
    )
    .expect("edge streams");
    edge
}

#[test]
fn a_reload_revokes_what_was_removed_admits_what_was_added_and_keeps_the_rest() {
    let opts = ClusterOptions {
        edges: vec!["edge-1".into(), "edge-2".into()],
        workers: vec!["worker-1".into(), "worker-2".into()],
        ..ClusterOptions::default()
    };
    let mut c = Cluster::start(&opts).expect("gateway starts");
    c.spawn_worker("worker-1").expect("worker-1 starts");
    c.spawn_worker("worker-2").expect("worker-2 starts");
    c.wait_for_workers(2, Duration::from_secs(60))
        .expect("workers register");
    let mut edge1 = streaming_edge(&c, "edge-1");
    let mut edge2 = streaming_edge(&c, "edge-2");

    assert_eq!(c.post("/api/v1/reload", None).unwrap().0, 401);

    // edge-1 removed, edge-3 added, worker-2's token rotated, and a
    // scheduler change that needs a restart.
    let edge_token = c.edge_token.clone();
    let worker_token = c.worker_token().to_string();
    rewrite(
        &c,
        &entry("edges", "edge-1", &edge_token),
        &entry("edges", "edge-3", &edge_token),
    );
    rewrite(
        &c,
        &entry("workers", "worker-2", &worker_token),
        &entry("workers", "worker-2", "a-new-token"),
    );
    rewrite(&c, "[scheduler]\n", "[scheduler]\nmax_queued = 1000\n");
    let (code, report) = reload(&c);
    assert_eq!(code, 200, "{report}");
    assert_eq!(report["edges"]["added"], serde_json::json!(["edge-3"]));
    assert_eq!(report["edges"]["removed"], serde_json::json!(["edge-1"]));
    assert_eq!(
        report["workers"]["rotated"],
        serde_json::json!(["worker-2"])
    );
    assert_eq!(report["admin_token"], "unchanged");
    assert_eq!(report["needs_restart"], serde_json::json!(["scheduler"]));
    let mut revoked: Vec<(String, String)> = report["revoked"]
        .as_array()
        .expect("revoked list")
        .iter()
        .map(|r| (r["role"].to_string(), r["name"].to_string()))
        .collect();
    revoked.sort();
    assert_eq!(
        revoked,
        [
            ("\"edge\"".into(), "\"edge-1\"".into()),
            ("\"worker\"".into(), "\"worker-2\"".into())
        ]
    );

    // edge-1 is told why, is refused when it dials again, and exits.
    let status = edge1
        .wait_exit(Duration::from_secs(30), "its credentials being revoked")
        .expect("edge-1 exits");
    let log = edge1.log();
    assert!(!status.success(), "{status}; log:\n{log}");
    assert!(log.contains("revoked by a configuration reload"), "{log}");
    assert!(log.contains("refused"), "{log}");

    // So is worker-2; its frames went to worker-1.
    let until = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = c.worker_exit("worker-2") {
            break s;
        }
        assert!(
            Instant::now() < until,
            "worker-2 did not exit; its log:\n{}",
            c.worker_log("worker-2")
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(!status.success(), "{status}");
    assert!(c.worker_log("worker-2").contains("refused"));
    wait_until(&c, Duration::from_secs(10), "one worker left", || {
        let (_, body) = c.get("/api/v1/workers").unwrap();
        let v: Value = serde_json::from_str(&body).unwrap();
        v.as_array().map(|a| a.len()) == Some(1) && v[0]["name"] == "worker-1"
    });

    // edge-2 kept its connection and keeps getting results.
    let before = edge2.results().len();
    edge2
        .wait_for_results(Duration::from_secs(30), "edge-2 after the reload", |r| {
            r.len() >= before + 5
        })
        .expect("edge-2 still served");
    assert!(
        !edge2.log().contains("connection to the gateway lost"),
        "edge-2 was not disconnected:\n{}",
        edge2.log()
    );

    // An unusable file changes nothing, and says why.
    let good = std::fs::read_to_string(c.gateway_config()).unwrap();
    std::fs::write(c.gateway_config(), "[[edges]]\nname = \"edge-2\"\n").unwrap();
    let (code, err) = reload(&c);
    assert_eq!(code, 400, "{err}");
    let msg = err["error"].as_str().expect("error text");
    assert!(msg.contains("gateway.toml"), "{msg}");
    assert!(msg.contains("token_sha256"), "{msg}");
    assert!(msg.contains("unchanged"), "{msg}");
    let before = edge2.results().len();
    edge2
        .wait_for_results(Duration::from_secs(30), "edge-2 after a bad reload", |r| {
            r.len() >= before + 3
        })
        .expect("edge-2 still served");

    // SIGHUP: the original edges are back (edge-3 goes, edge-1 returns).
    std::fs::write(c.gateway_config(), &good).unwrap();
    rewrite(
        &c,
        &entry("edges", "edge-3", &edge_token),
        &entry("edges", "edge-1", &edge_token),
    );
    c.signal_gateway("HUP").expect("kill -HUP");
    wait_until(&c, Duration::from_secs(10), "the SIGHUP reload", || {
        metric(&c, "tidegate_config_reloads_total{result=\"ok\"}") == Some(2.0)
    });
    let mut edge1 = streaming_edge(&c, "edge-1");
    assert_eq!(
        metric(&c, "tidegate_config_reloads_total{result=\"error\"}"),
        Some(1.0)
    );
    assert_eq!(
        metric(&c, "tidegate_connections_revoked_total{role=\"edge\"}"),
        Some(1.0)
    );
    assert_eq!(
        metric(&c, "tidegate_connections_revoked_total{role=\"worker\"}"),
        Some(1.0)
    );
    assert!(
        c.gateway_log().contains("configuration reloaded (SIGHUP)"),
        "{}",
        c.gateway_log()
    );

    // Every admitted frame ended exactly once, the revoked ones included.
    edge1
        .terminate(Duration::from_secs(10))
        .expect("edge-1 stops");
    edge2
        .terminate(Duration::from_secs(10))
        .expect("edge-2 stops");
    let v = settled_counters(&c);
    assert!(v["ok"].as_u64().unwrap() > 0, "{v}");
}

/// A worker connection that said `Hello` and was welcomed, and sends
/// nothing more: no `Register`.
async fn welcomed_worker(c: &Cluster, name: &str) -> quinn::Connection {
    use tidegate_protocol::quic::{client_config, dial_addr, handshake};
    let client = client_config(&c.ca()).expect("client config");
    let conn = dial_addr(&c.quic.into(), "localhost", client)
        .await
        .expect("dial the gateway");
    let hello = tidegate_protocol::Hello {
        role: tidegate_protocol::Role::Worker,
        name: name.into(),
        token: c.worker_token().into(),
    };
    let (send, recv, _welcome) = handshake(&conn, hello, &tidegate_protocol::Limits::default())
        .await
        .expect("welcomed");
    // Kept open, unused, for as long as the connection is.
    tokio::spawn({
        let conn = conn.clone();
        async move {
            let _streams = (send, recv);
            conn.closed().await;
        }
    });
    conn
}

/// The error code and reason `conn` was closed with by the gateway,
/// waiting at most `within`.
async fn closed_by_gateway(conn: &quinn::Connection, within: Duration) -> (u64, String) {
    match tokio::time::timeout(within, conn.closed()).await {
        Ok(quinn::ConnectionError::ApplicationClosed(c)) => (
            c.error_code.into_inner(),
            String::from_utf8_lossy(&c.reason).into_owned(),
        ),
        Ok(other) => panic!("closed otherwise: {other}"),
        Err(_) => panic!("still open after {within:?}"),
    }
}

#[test]
fn a_worker_that_has_not_registered_is_closed_when_revoked_or_when_its_register_is_late() {
    let opts = ClusterOptions {
        workers: vec!["worker-1".into(), "worker-2".into()],
        ..ClusterOptions::default()
    };
    let c = Cluster::start(&opts).expect("gateway starts");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let (revoked, late) = rt.block_on(async {
        tokio::join!(
            welcomed_worker(&c, "worker-1"),
            welcomed_worker(&c, "worker-2")
        )
    });
    let token = c.worker_token().to_string();
    rewrite(&c, &entry("workers", "worker-1", &token), "");
    let (code, report) = reload(&c);
    assert_eq!(code, 200, "{report}");
    let unauthorized = u64::from(tidegate_protocol::ErrorCode::Unauthorized.quic_code());
    let (code, reason) = rt.block_on(closed_by_gateway(&revoked, Duration::from_secs(30)));
    assert_eq!(code, unauthorized, "{reason}");
    assert!(reason.contains("revoked"), "{reason}");
    // worker-2 keeps its credentials but never registers: its connection
    // ends when the gateway stops waiting (10 s), not when the peer does.
    let malformed = u64::from(tidegate_protocol::ErrorCode::Malformed.quic_code());
    let (code, reason) = rt.block_on(closed_by_gateway(&late, Duration::from_secs(60)));
    assert_eq!(code, malformed, "{reason}");
    assert!(reason.contains("no Register"), "{reason}");
}
