//! The real `tidegate-edge` with `--metrics-listen 127.0.0.1:0` and a
//! `test://` camera, against a real gateway and BlazeFace worker on
//! 127.0.0.1: its `/metrics`, scraped over HTTP once results flow, shows the
//! configured camera only, the same figures as a `camera_stats` line it
//! printed (the metrics read the node's counters, they do not keep their
//! own), frames that add up, a round trip on the uplink, and an exposition
//! that `promtool check metrics` accepts.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use tidegate_loadtest::cluster::{Cluster, ClusterOptions};
use tidegate_loadtest::edge_harness::EdgeProcess;
use tidegate_testkit::promtool::promtool;

/// Bounds every wait, so that a broken edge fails the test instead of
/// hanging it; no assertion depends on how fast anything runs.
const BOUND: Duration = Duration::from_secs(90);

/// `GET /metrics` over plain HTTP/1.1: the status line and the body.
fn scrape(addr: SocketAddr) -> (String, String) {
    let mut s = TcpStream::connect_timeout(&addr, BOUND).unwrap();
    s.set_read_timeout(Some(BOUND)).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP response");
    (head.lines().next().unwrap_or_default().into(), body.into())
}

/// Every sample of `text` whose series starts with `prefix`: the series
/// (name and labels) to its value.
fn samples(text: &str, prefix: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| {
            let (series, v) = l.rsplit_once(' ')?;
            Some((series.to_string(), v.parse().ok()?))
        })
        .collect()
}

#[test]
fn an_edges_metrics_are_its_camera_counters_and_parse() {
    let mut c = Cluster::start(&ClusterOptions::default()).expect("gateway starts");
    c.spawn_worker("worker-1").expect("worker starts");
    c.wait_for_workers(1, BOUND).expect("worker registers");
    // counters every second (EdgeProcess), which the metrics read
    let edge = EdgeProcess::spawn_ball_with_metrics(&c).unwrap();
    let addr = edge.metrics_addr(BOUND).unwrap();
    edge.wait_for_results(BOUND, "results", |r| r.len() >= 10)
        .unwrap();

    // Results are in: wait (bounded) for a summary that has seen them,
    // and a window of the uplink adaptation that measured its round trip.
    let until = Instant::now() + BOUND;
    let text = loop {
        let (status, text) = scrape(addr);
        assert!(status.contains("200"), "{status}");
        let ok = samples(
            &text,
            "tidegate_edge_results_total{camera=\"ball\",status=\"ok\"}",
        );
        let rtt = samples(&text, "tidegate_edge_uplink_rtt_seconds{camera=\"ball\"}");
        if ok.values().any(|&v| v >= 5.0) && rtt.values().any(|&v| v > 0.0) {
            break text;
        }
        assert!(
            Instant::now() < until,
            "no ok results or no round trip in the metrics:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    let edge_samples = samples(&text, "tidegate_edge_");
    let v = |s: &str| {
        *edge_samples
            .get(s)
            .unwrap_or_else(|| panic!("{s} not in:\n{text}"))
    };
    let seen = v("tidegate_edge_frames_seen_total{camera=\"ball\"}");
    let passed = v("tidegate_edge_frames_passed_total{camera=\"ball\"}");
    let handed = v("tidegate_edge_frames_handed_total{camera=\"ball\"}");
    let delivered = v("tidegate_edge_frames_delivered_total{camera=\"ball\"}");
    let ok = v("tidegate_edge_results_total{camera=\"ball\",status=\"ok\"}");
    // Frames add up: a frame passes the gate or is skipped; it is handed
    // only once it passed; a result or an acknowledgment is for a frame
    // handed.
    let skipped = v("tidegate_edge_frames_skipped_total{camera=\"ball\",reason=\"rate\"}")
        + v("tidegate_edge_frames_skipped_total{camera=\"ball\",reason=\"static\"}");
    assert!(passed + skipped <= seen, "{text}");
    assert!(handed <= passed && delivered <= handed, "{text}");
    assert!(ok <= handed, "{text}");
    assert_eq!(
        v("tidegate_edge_camera_state{camera=\"ball\",state=\"running\"}"),
        1.0,
        "{text}"
    );
    let max_fps = v("tidegate_edge_camera_max_fps{camera=\"ball\"}");
    assert!(max_fps > 0.0 && max_fps <= 10.0, "{max_fps}");
    // the configured camera, and no other, is labelled; the uplink's own
    // series are labelled with the gateway instead
    for series in edge_samples.keys() {
        if series.contains('{')
            && !series.starts_with("tidegate_edge_build_info")
            && !series.contains("gateway=\"")
        {
            assert!(series.contains("camera=\"ball\""), "{series}");
        }
    }
    let uplink = |name: &str| -> f64 {
        edge_samples
            .iter()
            .find(|(s, _)| s.starts_with(&format!("{name}{{gateway=\"")))
            .map(|(_, v)| *v)
            .unwrap_or_else(|| panic!("{name} missing:\n{text}"))
    };
    // the QUIC link carried the frames the gateway acknowledged (each a
    // JPEG of well over 100 bytes)
    assert_eq!(uplink("tidegate_edge_uplink_connected"), 1.0, "{text}");
    assert!(
        uplink("tidegate_edge_uplink_sent_bytes_total") > 100.0 * delivered,
        "{text}"
    );
    assert!(
        uplink("tidegate_edge_uplink_received_bytes_total") > 0.0,
        "{text}"
    );

    // The same figures as one camera_stats line the edge printed: the
    // metrics are that summary, not a count of their own.
    let printed: Vec<serde_json::Value> = edge
        .log()
        .lines()
        .filter_map(|l| l.strip_prefix("camera_stats "))
        .filter_map(|j| serde_json::from_str(j).ok())
        .collect();
    let same = printed.iter().any(|s| {
        s["seen"].as_f64() == Some(seen)
            && s["handed"].as_f64() == Some(handed)
            && s["delivered"].as_f64() == Some(delivered)
            && s["ok"].as_f64() == Some(ok)
    });
    assert!(
        same,
        "no camera_stats line has seen={seen} handed={handed} delivered={delivered} ok={ok}"
    );

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("scrape.prom");
    std::fs::write(&file, &text).unwrap();
    let out = Command::new(promtool())
        .args(["check", "metrics"])
        .stdin(std::fs::File::open(&file).unwrap())
        .output()
        .expect("promtool runs");
    assert!(
        out.status.success(),
        "promtool check metrics:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
