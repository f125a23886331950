//! A lying worker is demoted: real gateway and worker processes on
//! 127.0.0.1, plus a worker that lies over QUIC
//! (`tidegate_loadtest::attack::worker`, shared with `tidegate-bench
//! hostile`). The liar
//! registers BlazeFace with a profile far faster than the real worker's, so
//! the scheduler prefers it, and then answers only half of each batch, or
//! `shed` for every frame. Every frame sent must still get exactly one
//! result, the gateway must count the liar's demotion, and once demoted the
//! liar must get nothing but probe batches (one frame each, one per
//! back-off), the real worker serving the rest.

use std::time::{Duration, Instant};

use tidegate_loadtest::attack::worker::{
    LiarOptions, Lie, Received, model_as_registered, spawn_liar,
};
use tidegate_loadtest::cluster::{Cluster, ClusterOptions, metric_sum};
use tidegate_loadtest::loadgen;
use tokio_util::sync::CancellationToken;

/// The health settings the gateway runs with: short back-offs, so that a
/// run of a few seconds sees several probes.
const BACKOFF_MS: u64 = 500;
const MAX_BACKOFF_MS: u64 = 2000;
const PROBE_FRAMES: usize = 1;
/// Batches the gateway sends a worker before the previous ones return
/// (`scheduler.pipeline_depth`'s default): those it held when it was
/// demoted may still arrive after the demotion is seen.
const PIPELINE_DEPTH: usize = 2;
/// The liar's largest batch.
const LIAR_MAX_BATCH: u16 = 8;

/// The most probes a worker demoted for `span` can be sent: one per
/// back-off, the back-off doubling from [`BACKOFF_MS`] to
/// [`MAX_BACKOFF_MS`] (every probe of a liar fails).
fn most_probes(span: Duration) -> usize {
    let (mut t, mut backoff, mut n) = (0, BACKOFF_MS, 0);
    while t <= span.as_millis() as u64 {
        t += backoff;
        backoff = (backoff * 2).min(MAX_BACKOFF_MS);
        n += 1;
    }
    n
}

/// One run: a real worker and a liar that lies as `lie` says, 4 cameras
/// at 15 fps for 8 s. Checks the invariants the module docs state.
fn a_lying_worker_is_demoted_and_then_only_probed(lie: Lie) {
    let opts = ClusterOptions {
        workers: vec!["worker-1".into(), "liar".into()],
        scheduler: format!(
            "[scheduler.health]\nbackoff_ms = {BACKOFF_MS}\nmax_backoff_ms = {MAX_BACKOFF_MS}\nprobe_frames = {PROBE_FRAMES}\n"
        ),
        ..ClusterOptions::default()
    };
    let mut c = Cluster::start(&opts).expect("gateway starts");
    c.spawn_worker("worker-1").expect("worker starts");
    c.wait_for_workers(1, Duration::from_secs(45))
        .unwrap_or_else(|e| panic!("{e}\nworker log:\n{}", c.worker_log("worker-1")));

    let received = Received::default();
    let stop_liar = CancellationToken::new();
    let liar_thread = spawn_liar(
        LiarOptions {
            gateway: c.quic,
            ca: c.ca(),
            token: c.worker_token().to_string(),
            name: "liar".into(),
            model: model_as_registered(&c, "blazeface", LIAR_MAX_BATCH)
                .expect("BlazeFace as the real worker registered it"),
            lie,
        },
        received.clone(),
        stop_liar.clone(),
        Duration::from_secs(10),
    )
    .expect("the liar registers");
    c.wait_for_workers(2, Duration::from_secs(10))
        .expect("the gateway lists the liar");

    // The cameras run on a thread of their own; this one watches for the
    // demotion meanwhile.
    let sim = {
        let opts = c.load_options("edge-1", 4, 15.0, 8.0);
        std::thread::spawn(move || loadgen::run_blocking(&opts))
    };
    let demotions = |c: &Cluster| {
        let (_, text) = c.get("/metrics").expect("metrics");
        metric_sum(&text, "tidegate_worker_demotions_total", &[])
    };
    let mut demoted_seen = None;
    while !sim.is_finished() {
        if demoted_seen.is_none() && demotions(&c) > 0.0 {
            demoted_seen = Some(Instant::now());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let report = sim.join().expect("sim thread").expect("simulation runs");
    let end = Instant::now();
    let log = || {
        format!(
            "report outcomes {:?}\ngateway log:\n{}",
            report.outcomes,
            c.gateway_log()
        )
    };

    // Every frame sent got exactly one result.
    assert!(report.sent > 0, "{}", log());
    assert_eq!(report.missing, 0, "frames without a result; {}", log());
    assert_eq!(report.duplicates, 0, "a frame got two results; {}", log());

    // The liar was demoted, counted and shown, and is still (its probes
    // all fail).
    let demoted_at = demoted_seen.unwrap_or_else(|| panic!("no demotion counted; {}", log()));
    assert!(demotions(&c) >= 1.0);
    let (_, workers) = c.get("/api/v1/workers").expect("workers");
    let workers: serde_json::Value = serde_json::from_str(&workers).expect("JSON workers");
    let liar_view = workers
        .as_array()
        .and_then(|a| a.iter().find(|w| w["name"] == "liar"))
        .unwrap_or_else(|| panic!("no liar in {workers}"));
    assert_eq!(liar_view["demoted"], true, "{workers}");
    assert!(
        !c.gateway_log().contains("probe succeeded"),
        "a liar's probe cannot succeed; {}",
        log()
    );

    // After the demotion the liar got only probes: beyond the batches it
    // held when demoted, batches of at most PROBE_FRAMES, one per back-off.
    let received = received.lock().unwrap().clone();
    let after: Vec<usize> = received
        .iter()
        .filter(|(at, _)| *at > demoted_at)
        .map(|(_, n)| *n)
        .collect();
    let total: usize = received.iter().map(|(_, n)| n).sum();
    let probes = most_probes(end - demoted_at);
    eprintln!(
        "{lie:?}: {} frames sent, {total} to the liar in {} batches, after the demotion {after:?} (at most {probes} probes); outcomes {:?}",
        report.sent,
        received.len(),
        report.outcomes
    );
    let big = after.iter().filter(|n| **n > PROBE_FRAMES).count();
    assert!(
        big <= PIPELINE_DEPTH,
        "batches of more than {PROBE_FRAMES} frames after the demotion: {after:?}"
    );
    assert!(
        after.len() <= PIPELINE_DEPTH + probes,
        "{} batches after the demotion, at most {PIPELINE_DEPTH} held + {probes} probes: {after:?}",
        after.len()
    );
    let after_frames: usize = after.iter().sum();
    assert!(
        after_frames <= PIPELINE_DEPTH * usize::from(LIAR_MAX_BATCH) + probes * PROBE_FRAMES,
        "{after_frames} frames to the liar after its demotion: {after:?}"
    );
    // Only the frames the liar got can have failed.
    assert!(
        report.failed <= total as u64,
        "{} failed, the liar got {total}; {}",
        report.failed,
        log()
    );
    // Each frame the liar failed went once to the honest worker, or failed
    // where that could not be (no time left, a newer frame of its camera
    // queued): for a liar that fails every frame, exactly one or the other.
    let (_, text) = c.get("/metrics").expect("metrics");
    let retried = metric_sum(&text, "tidegate_frames_retried_total", &[]);
    if lie == Lie::ShedEverything {
        assert_eq!(
            retried as u64 + report.failed,
            total as u64,
            "retried {retried} + failed {} != the liar's {total} frames; {}",
            report.failed,
            log()
        );
    } else {
        assert!(
            retried as u64 <= total as u64,
            "retried {retried}, the liar got {total}"
        );
    }

    stop_liar.cancel();
    liar_thread
        .join()
        .expect("liar thread")
        .expect("the liar ran");
}

#[test]
fn a_worker_answering_half_of_each_batch_is_demoted_and_then_only_probed() {
    a_lying_worker_is_demoted_and_then_only_probed(Lie::HalfOfEachBatch);
}

#[test]
fn a_worker_shedding_every_frame_is_demoted_and_then_only_probed() {
    a_lying_worker_is_demoted_and_then_only_probed(Lie::ShedEverything);
}
