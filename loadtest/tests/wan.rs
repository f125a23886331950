//! The edge's link as a WAN: real processes on 127.0.0.1, with the
//! project's impairment relay (`tidegate_loadtest::impair`) between the
//! load generator and the gateway. Each test is bounded in frames and time
//! and asserts invariants — every frame accounted for once, none older than
//! its budget counted ok — never speed: what share arrives within the
//! budget on which link is `make bench-wan`'s to measure.

use std::time::Duration;

use tidegate_edge::uplink::{Incoming, Uplink};
use tidegate_loadtest::cluster::metric_sum;
use tidegate_loadtest::impair::{ImpairConfig, LinkConfig, Relay, RelayOptions};
use tidegate_loadtest::loadgen;
use tidegate_loadtest::report::Report;
use tidegate_protocol::{Encoding, Frame, ShedReason, Status, Tensor};
use tidegate_testkit::astronaut::{astronaut, started_cluster};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Every frame the generator planned is counted once, and every frame it
/// sent ended once: answered, reset by it, refused, lost with its
/// connection, or missing (which must be 0); none got two results.
fn assert_accounted(r: &Report) {
    assert_eq!(
        r.sent + r.send_errors + r.throttled + r.unsent + r.pending,
        r.planned,
        "every planned frame counted once: {r:#?}"
    );
    assert_eq!(
        r.results() + r.reset + r.refused + r.lost_with_connection + r.missing,
        r.sent,
        "every sent frame ends once: {r:#?}"
    );
    assert_eq!(r.missing, 0, "no frame unaccounted for: {r:#?}");
    assert_eq!(r.duplicates, 0, "no frame answered twice: {r:#?}");
}

#[test]
fn through_a_lossy_link_every_frame_is_accounted_for_once() {
    // 20 ms RTT and 1 % random loss each way, seeded; 4 cameras at 10 fps
    // of JPEG for 10 s.
    let c = started_cluster();
    let rt = runtime();
    let link = LinkConfig {
        delay_ms: 10.0,
        loss: 0.01,
        ..LinkConfig::default()
    };
    let relay = rt
        .block_on(Relay::start(RelayOptions::new(
            c.quic,
            ImpairConfig {
                seed: 19,
                ..ImpairConfig::symmetric(link)
            },
        )))
        .expect("relay starts");
    let mut opts = c.load_options("edge-1", 4, 10.0, 10.0);
    opts.gateway = relay.local_addr().into();
    opts.encoding = Encoding::Jpeg { quality: 90 };
    let report = rt
        .block_on(async {
            tokio::time::timeout(Duration::from_secs(120), loadgen::run(&opts)).await
        })
        .expect("the simulation ends")
        .expect("the simulation runs");
    let stats = relay.stats();
    assert_accounted(&report);
    assert!(report.sent >= 100, "{report:#?}");
    // The link did lose packets, and JPEG frames are a fraction of raw.
    let lost: u64 = [&stats.uplink, &stats.downlink]
        .iter()
        .map(|d| d.link.dropped.total().packets)
        .sum();
    assert!(lost > 0, "{stats:#?}");
    assert!(
        report.bytes_per_frame > 0 && report.bytes_per_frame < 128 * 128 * 3 / 2,
        "{report:#?}"
    );
}

#[test]
fn a_frame_older_than_its_budget_on_arrival_is_shed_late_never_ok() {
    let c = started_cluster();
    let rt = runtime();
    rt.block_on(async {
        let (up, mut incoming) = Uplink::connect(
            &c.quic.into(),
            "localhost",
            &c.ca(),
            "edge-1",
            &c.edge_token,
        )
        .await
        .expect("edge connects");
        let accepted = up
            .open_camera("door", "blazeface", 80, Encoding::Raw)
            .await
            .expect("camera opens");
        // The gateway probes the edge's clock as the connection opens and
        // again 0.5 s later; the uplink answers each at once.
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let (pixels, geometry) =
            loadgen::frame_pixels(&accepted.input, Some(&astronaut())).expect("frame");
        let now = tidegate_edge::clock::now_us();
        // Frame 1 was captured 300 ms ago with an 80 ms budget: it waited
        // in the sender's queue far beyond it. Frame 2 is fresh.
        for (seq, captured_at_us) in [(1, now - 300_000), (2, now)] {
            let frame = Frame {
                camera: "door".into(),
                seq,
                captured_at_us,
                budget_us: 80_000,
                model: "blazeface".into(),
                geometry,
                tensor: Tensor::raw(
                    accepted.input.dtype,
                    accepted.input.layout,
                    accepted.input.frame_shape(),
                    pixels.clone(),
                ),
            };
            up.send_frame(frame).await.expect("frame sent");
        }
        let mut statuses = std::collections::BTreeMap::new();
        while statuses.len() < 2 {
            let msg = tokio::time::timeout(Duration::from_secs(30), incoming.recv())
                .await
                .expect("both frames are answered")
                .expect("the connection stays up");
            if let Incoming::Result(r) = msg {
                statuses.insert(r.seq, r.status);
            }
        }
        assert_eq!(
            statuses[&1],
            Status::Shed(ShedReason::LateOnArrival),
            "{statuses:?}"
        );
        // The fresh frame is not late; whether a busy machine serves it
        // within budget is the benchmark's to say.
        assert_ne!(
            statuses[&2],
            Status::Shed(ShedReason::LateOnArrival),
            "{statuses:?}"
        );
    });
    let (_, metrics) = c.get("/metrics").expect("metrics");
    assert!(
        metrics.contains("tidegate_frame_age_on_arrival_seconds_count{model=\"blazeface\"} 2"),
        "both frames' ages were observed"
    );
}

#[test]
fn a_link_blacked_out_past_the_idle_timeout_is_redialled_and_every_frame_accounted_for() {
    // The link goes dark for 12 s, past QUIC's 10 s idle timeout: the
    // connection dies, the generator redials once the link is back, and
    // every frame due in between is counted: not sent (no connection),
    // lost with the connection, reset, or answered. 2 cameras at 5 fps of
    // JPEG for 22 s.
    let c = started_cluster();
    let rt = runtime();
    let link = LinkConfig {
        delay_ms: 5.0,
        ..LinkConfig::default()
    };
    let relay = rt
        .block_on(Relay::start(RelayOptions::new(
            c.quic,
            ImpairConfig::symmetric(link),
        )))
        .expect("relay starts");
    let mut opts = c.load_options("edge-1", 2, 5.0, 22.0);
    opts.gateway = relay.local_addr().into();
    opts.encoding = Encoding::Jpeg { quality: 80 };
    let sim = rt.spawn(async move { loadgen::run(&opts).await });
    rt.block_on(async {
        tokio::time::sleep(Duration::from_secs(3)).await;
        relay.blackout(Duration::from_secs(12));
    });
    let report = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(120), sim).await })
        .expect("the simulation ends")
        .expect("the simulation task")
        .expect("the simulation runs");
    assert_accounted(&report);
    assert!(report.reconnects >= 1, "redialled: {report:#?}");
    assert!(
        report.send_errors > 0,
        "frames due while disconnected are counted, not sent: {report:#?}"
    );
    // Served again after the link came back: results for frames sent on
    // the new connection (the last 7 s of sending).
    assert!(report.results() > 0, "{report:#?}");
    assert!(
        report.lost_with_connection + report.reset > 0,
        "the frames caught in the blackout are accounted: {report:#?}"
    );
}

#[test]
fn with_two_copies_every_frame_is_admitted_once_and_answered_once() {
    // 30 ms RTT and 2 % loss each way; 2 cameras at 10 fps, each frame and
    // each result sent twice, for 8 s.
    let c = started_cluster();
    let rt = runtime();
    let relay = rt
        .block_on(Relay::start(RelayOptions::new(
            c.quic,
            ImpairConfig {
                seed: 7,
                ..ImpairConfig::symmetric(LinkConfig {
                    delay_ms: 15.0,
                    loss: 0.02,
                    ..LinkConfig::default()
                })
            },
        )))
        .expect("relay starts");
    let mut opts = c.load_options("edge-1", 2, 10.0, 8.0);
    opts.gateway = relay.local_addr().into();
    opts.encoding = Encoding::Jpeg { quality: 90 };
    opts.copies = 2;
    let report = rt
        .block_on(async {
            tokio::time::timeout(Duration::from_secs(120), loadgen::run(&opts)).await
        })
        .expect("the simulation ends")
        .expect("the simulation runs");
    assert_accounted(&report);
    assert_eq!(report.copies, 2);
    // The gateway admitted each frame once, however many of its copies
    // arrived, and dropped the others as duplicates.
    let (_, frames) = c.get("/api/v1/frames").expect("frames");
    let frames: serde_json::Value = serde_json::from_str(&frames).expect("JSON");
    let admitted = frames["admitted"].as_u64().expect("admitted");
    assert!(
        admitted <= report.sent,
        "{admitted} > {}: {frames}",
        report.sent
    );
    let (_, metrics) = c.get("/metrics").expect("metrics");
    let duplicates = metric_sum(
        &metrics,
        "tidegate_frames_rejected_total",
        &["reason=\"duplicate\""],
    );
    assert!(duplicates > 0.0, "second copies arrived and were dropped");
}
