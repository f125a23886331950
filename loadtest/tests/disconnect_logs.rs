//! An ordinary disconnect is a line or two in the logs, not one per stream,
//! camera or redial: real gateway, worker and `tidegate-edge` processes on
//! 127.0.0.1, an edge of 16 cameras, and a gateway that dies, comes back
//! before its worker, and then serves again; then the edge stops.

use std::time::Duration;

use tidegate_loadtest::cluster::{Cluster, ClusterOptions, plain};
use tidegate_loadtest::edge_harness::{EdgeCamera, EdgeProcess, edge_config};

const CAMERAS: usize = 16;

/// The WARN (and ERROR) lines of `log` past its first `skip` lines.
fn loud(log: &str, skip: usize) -> Vec<String> {
    plain(log)
        .lines()
        .skip(skip)
        .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
        .map(str::to_string)
        .collect()
}

fn lines(log: &str) -> usize {
    plain(log).lines().count()
}

#[test]
fn a_gateway_restart_and_an_edge_leaving_are_a_few_lines_not_one_per_camera() {
    let mut c = Cluster::start(&ClusterOptions::default()).unwrap();
    c.spawn_worker("worker-1").unwrap();
    c.wait_for_workers(1, Duration::from_secs(60)).unwrap();
    let cameras: Vec<EdgeCamera> = (0..CAMERAS)
        .map(|i| {
            EdgeCamera::new(
                &format!("cam-{i}"),
                "test://ball?width=320&height=240",
                "blazeface",
                5.0,
            )
        })
        .collect();
    let cfg = edge_config(&c, "edge-1", &cameras).unwrap();
    let mut edge = EdgeProcess::spawn(&c, &cfg, &[]).unwrap();
    edge.wait_for_results(Duration::from_secs(60), "results before the outage", |r| {
        r.len() >= 2 * CAMERAS
    })
    .unwrap();
    let edge_mark = lines(&edge.log());

    // The gateway dies; it comes back without its worker, so every camera
    // is told to retry later, once a second, until the worker registers.
    // The worker is frozen first: left alone it redials the restarted
    // gateway, and may register before the edge is back.
    c.signal_worker("worker-1", "STOP").unwrap();
    c.kill_gateway();
    std::thread::sleep(Duration::from_secs(2));
    c.restart_gateway().unwrap();
    // The edge notices the loss (its idle timeout), redials and reopens its
    // cameras; with no worker yet, each is told to retry later. Once that
    // has begun, two more seconds of retries, then the worker.
    let until = std::time::Instant::now() + Duration::from_secs(60);
    while !plain(&c.gateway_log()).contains("no worker serves the model yet") {
        assert!(
            std::time::Instant::now() < until,
            "the edge's cameras were never refused for want of a worker:\n{}",
            plain(&c.gateway_log())
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(2));
    // a fresh worker (the frozen one is killed)
    c.respawn_worker("worker-1").unwrap();
    c.wait_for_workers(1, Duration::from_secs(60)).unwrap();
    let before = edge.results().len();
    edge.wait_for_results(Duration::from_secs(60), "results after the outage", |r| {
        r.len() >= before + 2 * CAMERAS
    })
    .unwrap();

    let edge_loud = loud(&edge.log(), edge_mark);
    assert!(
        !edge_loud.is_empty() && edge_loud.len() <= 3,
        "the edge logs the outage once, not per camera or redial: {edge_loud:#?}"
    );
    let gateway = plain(&c.gateway_log());
    let refused = gateway
        .lines()
        .filter(|l| l.contains("camera refused"))
        .count();
    let waiting: Vec<&str> = gateway
        .lines()
        .filter(|l| l.contains("no worker serves the model yet"))
        .collect();
    assert_eq!(
        refused, 0,
        "cameras waiting for a worker are not a WARN each"
    );
    assert!(
        (1..=2).contains(&waiting.len()),
        "one line per connection that waited: {waiting:#?}"
    );

    // The edge stops: the gateway notes it without a line per stream.
    let gateway_mark = lines(&c.gateway_log());
    edge.terminate(Duration::from_secs(30)).unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let gateway_loud = loud(&c.gateway_log(), gateway_mark);
    assert!(
        gateway_loud.len() <= 1,
        "an edge leaving is not a WARN per stream: {gateway_loud:#?}"
    );
}
