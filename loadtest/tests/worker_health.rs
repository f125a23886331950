//! A lying worker is demoted: real gateway and worker processes on
//! 127.0.0.1, plus a worker this test plays itself over QUIC. The liar
//! registers BlazeFace with a profile far faster than the real worker's, so
//! the scheduler prefers it, and then answers only half of each batch, or
//! `shed` for every frame. Every frame sent must still get exactly one
//! result, the gateway must count the liar's demotion, and once demoted the
//! liar must get nothing but probe batches (one frame each, one per
//! back-off), the real worker serving the rest.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tidegate_loadtest::cluster::{Cluster, ClusterOptions};
use tidegate_loadtest::sim;
use tidegate_protocol::quic::{client_config, dial, handshake, read_message, write_message};
use tidegate_protocol::{
    BatchResult, Codec, Heartbeat, Hello, InputSpec, ItemResult, Limits, Message, ModelInfo,
    ProfilePoint, Register, Role, ShedReason, Status,
};

/// How the liar answers a batch.
#[derive(Debug, Clone, Copy)]
enum Lie {
    /// Answers the first half of the frames `ok` (rounded down: nothing of
    /// a batch of one, so that its single-frame probes fail too), and
    /// nothing for the rest.
    HalfOfEachBatch,
    /// Answers every frame `shed`, a status only the gateway may assign.
    ShedEverything,
}

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

/// A batch the liar was sent: when, and how many frames.
type Received = Arc<Mutex<Vec<(Instant, usize)>>>;

/// The value of a counter or gauge summed over its label sets.
fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

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

/// BlazeFace as the real worker registered it, from the gateway's API.
fn blazeface(c: &Cluster) -> ModelInfo {
    let (status, body) = c.get("/api/v1/models").expect("gateway answers");
    assert_eq!(status, 200, "{body}");
    let models: serde_json::Value = serde_json::from_str(&body).expect("JSON models");
    let m = models
        .as_array()
        .and_then(|a| a.iter().find(|m| m["name"] == "blazeface"))
        .unwrap_or_else(|| panic!("no blazeface in {body}"));
    ModelInfo {
        name: "blazeface".into(),
        version: m["version"].as_u64().expect("version") as u32,
        input: serde_json::from_value::<InputSpec>(m["input"].clone()).expect("input spec"),
        max_batch: LIAR_MAX_BATCH,
        labels: serde_json::from_value(m["labels"].clone()).expect("labels"),
    }
}

/// Runs the liar until `stop` fires or the gateway closes it: registers
/// `model` as worker `liar`, heartbeats, and answers every batch as `lie`
/// says, noting each batch in `received`. Sends `()` on `registered` once
/// it has registered.
#[allow(clippy::too_many_arguments)]
async fn liar(
    gateway: std::net::SocketAddr,
    ca: std::path::PathBuf,
    token: String,
    model: ModelInfo,
    lie: Lie,
    received: Received,
    registered: std::sync::mpsc::Sender<()>,
    stop: tokio::sync::oneshot::Receiver<()>,
) {
    let limits = Limits::default();
    let conn = dial(gateway, "localhost", client_config(&ca).expect("CA"))
        .await
        .expect("liar dials");
    let hello = Hello {
        role: Role::Worker,
        name: "liar".into(),
        token,
    };
    let (mut ctl_send, _ctl_recv, welcome) =
        handshake(&conn, hello, &limits).await.expect("welcome");
    let register = Register {
        worker: "liar".into(),
        device: "a liar".into(),
        // Far faster than a CPU: the scheduler prefers it.
        profile: vec![
            ProfilePoint {
                model: model.name.clone(),
                batch: 1,
                latency_us: 300,
            },
            ProfilePoint {
                model: model.name.clone(),
                batch: LIAR_MAX_BATCH,
                latency_us: 600,
            },
        ],
        models: vec![model],
        codecs: vec![Codec::Raw],
    };
    write_message(&mut ctl_send, &Message::Register(register))
        .await
        .expect("register");
    let _ = registered.send(());
    let heartbeats = async move {
        let every = Duration::from_millis(u64::from(welcome.heartbeat_ms.max(100)));
        loop {
            let hb = Message::Heartbeat(Heartbeat {
                queue_depth: 0,
                utilization: 0.0,
            });
            if write_message(&mut ctl_send, &hb).await.is_err() {
                break;
            }
            tokio::time::sleep(every).await;
        }
    };
    let batches = async {
        while let Ok(mut recv) = conn.accept_uni().await {
            let Ok(Some(Message::Dispatch(d))) = read_message(&mut recv, &limits).await else {
                continue;
            };
            received
                .lock()
                .unwrap()
                .push((Instant::now(), d.items.len()));
            let answer = |id, status| ItemResult {
                id,
                status,
                detections: Vec::new(),
                timings: Default::default(),
                outputs: Vec::new(),
            };
            let items = match lie {
                Lie::HalfOfEachBatch => d
                    .items
                    .iter()
                    .take(d.items.len() / 2)
                    .map(|i| answer(i.id, Status::Ok))
                    .collect(),
                Lie::ShedEverything => d
                    .items
                    .iter()
                    .map(|i| answer(i.id, Status::Shed(ShedReason::Overloaded)))
                    .collect(),
            };
            let result = Message::BatchResult(BatchResult {
                batch: d.batch,
                items,
            });
            let Ok(mut s) = conn.open_uni().await else {
                break;
            };
            if write_message(&mut s, &result).await.is_ok() {
                let _ = s.finish();
            }
        }
    };
    tokio::select! {
        _ = heartbeats => {},
        _ = batches => {},
        _ = stop => conn.close(0u32.into(), b"test over"),
    }
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

    let received: Received = Arc::default();
    let (registered_tx, registered) = std::sync::mpsc::channel();
    let (stop_liar, stop) = tokio::sync::oneshot::channel();
    let liar_thread = {
        let (quic, ca, token) = (c.quic, c.ca(), c.worker_token().to_string());
        let model = blazeface(&c);
        let received = received.clone();
        std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
                .block_on(liar(
                    quic,
                    ca,
                    token,
                    model,
                    lie,
                    received,
                    registered_tx,
                    stop,
                ))
        })
    };
    registered
        .recv_timeout(Duration::from_secs(10))
        .expect("the liar registers");
    c.wait_for_workers(2, Duration::from_secs(10))
        .expect("the gateway lists the liar");

    // The cameras run on a thread of their own; this one watches for the
    // demotion meanwhile.
    let sim = {
        let opts = c.sim_options("edge-1", 4, 15.0, 8.0);
        std::thread::spawn(move || sim::run_blocking(&opts))
    };
    let demotions = |c: &Cluster| {
        let (_, text) = c.get("/metrics").expect("metrics");
        metric_sum(&text, "tidegate_worker_demotions_total")
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

    let _ = stop_liar.send(());
    liar_thread.join().expect("liar thread");
}

#[test]
fn a_worker_answering_half_of_each_batch_is_demoted_and_then_only_probed() {
    a_lying_worker_is_demoted_and_then_only_probed(Lie::HalfOfEachBatch);
}

#[test]
fn a_worker_shedding_every_frame_is_demoted_and_then_only_probed() {
    a_lying_worker_is_demoted_and_then_only_probed(Lie::ShedEverything);
}
