//! The real edge on a WAN that goes dark, as real processes on 127.0.0.1:
//! a gateway with one BlazeFace worker, the project's impairment relay
//! (`tidegate_loadtest::impair`) in front of the gateway's QUIC port, and a
//! `tidegate-edge` with two cameras sending JPEG through it. The link goes
//! dark for 15 s, longer than QUIC's 10 s idle timeout, so the connection
//! dies under the edge. The test asserts invariants, not speed: the edge
//! reconnects by itself and serves again, nothing captured in the dark is
//! delivered late, and every frame it handed to the uplink ends exactly
//! once (a result, a reset, refused, lost on the wire, or lost with its
//! connection), the frames that found no connection being counted as not
//! sent. How soon after the link's return it serves again is logged, and is
//! `make bench-wan`'s to measure.
//!
//! A second case puts the edge, with its default `copies = "auto"`, on a
//! link with a 50 ms round trip and 2 % random loss, where a lost packet
//! cannot be resent within an 80 ms budget: the edge must take to sending
//! a second copy of its frames, the gateway must admit one copy of each,
//! and every frame must still end exactly once.

use std::collections::BTreeMap;
use std::time::Duration;

use tidegate_loadtest::cluster::{Cluster, metric_sum, plain};
use tidegate_loadtest::edge_harness::{EdgeCamera, EdgeProcess, edge_config_via, epoch_us};
use tidegate_loadtest::impair::{ImpairConfig, LinkConfig, Relay, RelayOptions};
use tidegate_testkit::astronaut::{astronaut, started_cluster};

/// Longer than QUIC's idle timeout (10 s): the connection dies in the dark.
const BLACKOUT: Duration = Duration::from_secs(15);
/// The cameras, at 5 fps each.
const CAMERAS: [&str; 2] = ["front", "side"];

/// A camera's counter from its last `camera_stats` line.
fn counter(stats: &serde_json::Value, key: &str) -> u64 {
    stats[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no counter {key} in {stats}"))
}

/// Every frame camera `cam` handed to the uplink ended exactly once (a
/// result, a reset, refused, lost on the wire or with its connection),
/// none is still awaited, none was given up on, and the results written
/// are the results counted.
fn assert_every_frame_ends_once(cam: &str, s: &serde_json::Value, results: &[serde_json::Value]) {
    let ended: u64 = [
        "results",
        "reset_superseded",
        "reset_expired",
        "refused",
        "lost",
        "lost_connection",
        "gave_up",
    ]
    .iter()
    .map(|k| counter(s, k))
    .sum();
    assert_eq!(counter(s, "awaiting"), 0, "{cam}: every frame ended: {s}");
    assert_eq!(
        counter(s, "handed"),
        ended,
        "{cam}: every frame handed ends once: {s}"
    );
    assert_eq!(counter(s, "gave_up"), 0, "{s}");
    let written = results.iter().filter(|l| l["camera"] == cam).count();
    assert_eq!(written as u64, counter(s, "results"), "{cam}: {s}");
}

/// The project's relay in front of `c`'s gateway, with `link` each way
/// and its random draws seeded with `seed`, on a runtime of its own (kept
/// as long as the relay).
fn relay_before(c: &Cluster, link: LinkConfig, seed: u64) -> (tokio::runtime::Runtime, Relay) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let relay = rt
        .block_on(Relay::start(RelayOptions::new(
            c.quic,
            ImpairConfig {
                seed,
                ..ImpairConfig::symmetric(link)
            },
        )))
        .expect("relay starts");
    (rt, relay)
}

/// The edge's log lines that contain `needle` (colours stripped), each
/// also printed for the test's output.
fn edge_lines(log: &str, needle: &str) -> Vec<String> {
    let lines: Vec<String> = log
        .lines()
        .map(plain)
        .filter(|l| l.contains(needle))
        .collect();
    for l in &lines {
        eprintln!("edge: {l}");
    }
    lines
}

/// No `(camera, seq)` has two result lines.
fn assert_no_frame_answered_twice(results: &[serde_json::Value]) {
    let mut seen = BTreeMap::new();
    for l in results {
        let key = (
            l["camera"].as_str().unwrap().to_string(),
            l["seq"].as_u64().unwrap(),
        );
        assert!(seen.insert(key, l).is_none(), "two results for {l}");
    }
}

/// The time of a log line (its leading RFC 3339 UTC timestamp, as
/// `2026-12-04T19:35:39.248154Z`) in µs since the UNIX epoch.
fn logged_at_us(line: &str) -> Option<u64> {
    let stamp = line.split_whitespace().next()?.strip_suffix('Z')?;
    let (date, time) = stamp.split_once('T')?;
    let mut ymd = date.split('-').map(|p| p.parse::<i64>().ok());
    let (y, m, d) = (ymd.next()??, ymd.next()??, ymd.next()??);
    let (hms, frac) = time.split_once('.').unwrap_or((time, "0"));
    let mut hms = hms.split(':').map(|p| p.parse::<i64>().ok());
    let (h, min, sec) = (hms.next()??, hms.next()??, hms.next()??);
    let micros: i64 = format!("{frac:0<6}").get(..6)?.parse().ok()?;
    // Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's
    // days_from_civil).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + h * 3600 + min * 60 + sec;
    u64::try_from(secs * 1_000_000 + micros).ok()
}

/// When a result line reached the edge (µs since the UNIX epoch, on the
/// edge's clock).
fn received_at_us(line: &serde_json::Value) -> u64 {
    let captured = line["captured_at_us"].as_u64().unwrap();
    captured + (line["e2e_ms"].as_f64().unwrap() * 1000.0) as u64
}

#[test]
fn after_a_blackout_longer_than_the_idle_timeout_the_edge_reconnects_and_every_frame_is_accounted_for()
 {
    let c = started_cluster();
    // A 20 ms round trip, no loss: the blackout is the only impairment.
    let link = LinkConfig {
        delay_ms: 10.0,
        ..LinkConfig::default()
    };
    let (_rt, relay) = relay_before(&c, link, 23);
    let jpeg = |mut cam: EdgeCamera| {
        cam.fields.push("encoding = \"jpeg\"".into());
        cam.fields.push("budget_ms = 500".into());
        cam
    };
    let cfg = edge_config_via(
        &c,
        "edge-1",
        &[
            jpeg(EdgeCamera::new(
                CAMERAS[0],
                &format!("image://{}", astronaut().display()),
                "blazeface",
                5.0,
            )),
            jpeg(EdgeCamera::new(
                CAMERAS[1],
                "test://ball?width=320&height=240",
                "blazeface",
                5.0,
            )),
        ],
        relay.local_addr(),
    )
    .unwrap();
    let mut edge = EdgeProcess::spawn(&c, &cfg, &[]).unwrap();
    let of = |r: &[serde_json::Value], cam: &str| r.iter().filter(|l| l["camera"] == cam).count();
    edge.wait_for_results(
        Duration::from_secs(30),
        "results before the blackout",
        |r| CAMERAS.iter().all(|cam| of(r, cam) >= 5),
    )
    .unwrap();

    let dark_us = epoch_us();
    relay.blackout(BLACKOUT);
    let back_us = dark_us + BLACKOUT.as_micros() as u64;
    std::thread::sleep(BLACKOUT);

    // Serving again: results of frames captured after the link's return,
    // from every camera.
    let new = |r: &[serde_json::Value], cam: &str| {
        r.iter()
            .filter(|l| l["camera"] == cam && l["captured_at_us"].as_u64() > Some(back_us))
            .count()
    };
    let after = edge
        .wait_for_results(Duration::from_secs(30), "results after the blackout", |r| {
            CAMERAS.iter().all(|cam| new(r, cam) >= 3)
        })
        .unwrap();
    let first_new = after
        .iter()
        .filter(|l| l["captured_at_us"].as_u64() > Some(back_us))
        .map(received_at_us)
        .min()
        .unwrap();
    eprintln!(
        "first result {:.2} s after the link's return ({BLACKOUT:?} dark)",
        first_new.saturating_sub(back_us) as f64 / 1e6
    );

    // SIGTERM: the edge stops, its summary counts every frame.
    let status = edge.terminate(Duration::from_secs(30)).unwrap();
    assert!(status.success(), "edge exit {status}: {}", edge.log());
    let log = edge.log();
    let results = edge.results();
    let stats = edge.camera_stats();
    eprintln!("relay: {:?}", relay.stats().flows);

    let link_lines = edge_lines(&log, "link{");
    // It reconnected by itself: a second connection.
    let connected: Vec<&String> = link_lines
        .iter()
        .filter(|l| l.contains("tidegate_edge::node::link: connected"))
        .collect();
    assert!(
        connected.len() >= 2,
        "{} connections: {log}",
        connected.len()
    );
    if let Some(at) = connected.last().and_then(|l| logged_at_us(l)) {
        eprintln!(
            "reconnected {:.2} s after the link's return",
            (at as f64 - back_us as f64) / 1e6
        );
    }
    assert!(log.contains("connection to the gateway lost"), "{log}");

    // No frame has two results, and none captured in the dark was
    // delivered late (a frame of the dark could only be sent into it).
    assert_no_frame_answered_twice(&results);
    for l in &results {
        let captured = l["captured_at_us"].as_u64().unwrap();
        assert!(
            captured <= dark_us + 1_000_000 || captured >= back_us,
            "a frame captured in the dark was answered: {l}"
        );
    }

    // The adaptation starts afresh on the new connection, and its rate cap
    // with it: the first counters a camera prints once open again show
    // its configured rate, whatever the dark had taken it down to (the
    // rate falls only once the quality is at its floor, four windows of
    // pressure at the least).
    for cam in CAMERAS {
        let reopened = log
            .lines()
            .map(plain)
            .enumerate()
            .filter(|(_, l)| l.contains("camera open") && l.contains(cam))
            .nth(1)
            .map(|(i, _)| i)
            .unwrap_or_else(|| panic!("{cam} never opened on the second connection: {log}"));
        let first_after = log
            .lines()
            .skip(reopened)
            .filter_map(|l| l.strip_prefix("camera_stats "))
            .filter_map(|j| serde_json::from_str::<serde_json::Value>(j).ok())
            .find(|v| v["camera"] == cam)
            .unwrap_or_else(|| panic!("{cam}: no counters after reopening: {log}"));
        assert_eq!(
            first_after["max_fps"].as_f64(),
            Some(5.0),
            "{cam}: the rate cap after reopening: {first_after}"
        );
    }

    for cam in CAMERAS {
        let s = &stats[cam];
        eprintln!("camera_stats {s}");
        let handed = counter(s, "handed");
        assert_every_frame_ends_once(cam, s, &results);
        // Frames sent into the dark before the connection died ended on
        // the wire (reset at their deadline, or cut by the connection's
        // end) or lost with it; those that found no connection were not
        // sent, and are counted apart.
        let into_the_dark = [
            "reset_expired",
            "reset_superseded",
            "lost",
            "lost_connection",
        ]
        .iter()
        .map(|k| counter(s, k))
        .sum::<u64>();
        assert!(into_the_dark > 0, "{cam}: {s}");
        assert!(counter(s, "dropped_outage") > 0, "{cam}: {s}");
        assert!(
            counter(s, "passed") >= handed + counter(s, "dropped_outage"),
            "{cam}: {s}"
        );
    }
}

#[test]
fn on_a_lossy_link_too_long_to_resend_in_an_auto_edge_sends_two_copies_and_each_frame_ends_once() {
    let c = started_cluster();
    // 50 ms round trip and 2 % loss each way: two round trips alone are
    // over the 80 ms budget.
    let link = LinkConfig {
        delay_ms: 25.0,
        loss: 0.02,
        ..LinkConfig::default()
    };
    let (_rt, relay) = relay_before(&c, link, 29);
    let cameras: Vec<EdgeCamera> = CAMERAS
        .iter()
        .map(|name| {
            let mut cam = EdgeCamera::new(
                name,
                &format!("image://{}", astronaut().display()),
                "blazeface",
                10.0,
            );
            // The defaults otherwise: JPEG, copies "auto".
            cam.fields.push("budget_ms = 80".into());
            cam
        })
        .collect();
    let cfg = edge_config_via(&c, "edge-1", &cameras, relay.local_addr()).unwrap();
    let mut edge = EdgeProcess::spawn(&c, &cfg, &[]).unwrap();
    let of = |r: &[serde_json::Value], cam: &str| r.iter().filter(|l| l["camera"] == cam).count();
    // The policy needs a few windows of evidence (400 packets), counted
    // only in windows whose round trip did not swell: on a busy machine
    // that takes longer, so the test waits for the decision, bounded.
    let took_a_copy = |log: &str| {
        log.lines()
            .map(plain)
            .any(|l| l.contains("copies of each frame changed") && l.contains("copies=2"))
    };
    let until = std::time::Instant::now() + Duration::from_secs(90);
    while !took_a_copy(&edge.log()) {
        assert!(
            std::time::Instant::now() < until,
            "no camera took a second copy in 90 s: {}",
            edge.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // Then some frames with their copies.
    let then = edge.results();
    edge.wait_for_results(Duration::from_secs(60), "results with copies", |r| {
        CAMERAS.iter().all(|cam| of(r, cam) >= of(&then, cam) + 20)
    })
    .unwrap();
    let (_, metrics) = c.get("/metrics").expect("gateway metrics");
    let status = edge.terminate(Duration::from_secs(30)).unwrap();
    assert!(status.success(), "edge exit {status}: {}", edge.log());
    let log = edge.log();
    let results = edge.results();
    let stats = edge.camera_stats();

    // The edge took to two copies, and says why.
    edge_lines(&log, "copies of each frame changed");
    // Second copies reached the gateway, which admitted one of each.
    let duplicates = metric_sum(
        &metrics,
        "tidegate_frames_rejected_total",
        &["reason=\"duplicate\""],
    );
    eprintln!("gateway: {duplicates} later copies dropped");
    assert!(duplicates > 0.0, "{metrics}");

    assert_no_frame_answered_twice(&results);
    for cam in CAMERAS {
        let s = &stats[cam];
        eprintln!("camera_stats {s}");
        let copies = counter(s, "copies");
        assert!((1..=2).contains(&copies), "{cam}: {s}");
        assert_every_frame_ends_once(cam, s, &results);
    }
}
