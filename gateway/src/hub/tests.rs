//! The hub's tests: each drives a real hub task through its messages and
//! checks what reaches edges, workers, the metrics and the reports.

use super::*;
use bytes::Bytes;
use tidegate_protocol::{
    ColorOrder, DType, Detection, Geometry, ItemResult, Layout, OutputTensor, ProfilePoint, Resize,
    Status, Tensor, Timings,
};

/// The model of [`register`] and [`frame`].
pub(crate) const MODEL: &str = "m";

/// A worker serving [`MODEL`], batch 1 at 1 ms.
pub(crate) fn register() -> Register {
    Register {
        worker: "lease-7".into(),
        device: "cpu".into(),
        models: vec![ModelInfo {
            name: MODEL.into(),
            version: 1,
            input: InputSpec {
                width: 2,
                height: 2,
                channels: 3,
                dtype: DType::U8,
                layout: Layout::Nhwc,
                color: ColorOrder::Rgb,
                resize: Resize::Stretch,
            },
            max_batch: 1,
            labels: vec!["face".into(), "hand".into()],
        }],
        profile: vec![ProfilePoint {
            model: MODEL.into(),
            batch: 1,
            latency_us: 1000,
        }],
        codecs: vec![Codec::Raw, Codec::Jpeg],
    }
}

/// A 2×2 frame of camera `cam` for [`MODEL`], 80 ms budget.
pub(crate) fn frame(seq: u64) -> Frame {
    Frame {
        camera: "cam".into(),
        seq,
        captured_at_us: 0,
        budget_us: 80_000,
        model: MODEL.into(),
        geometry: Geometry {
            source_width: 2,
            source_height: 2,
            content_x: 0,
            content_y: 0,
            content_width: 2,
            content_height: 2,
        },
        tensor: Tensor::raw(
            DType::U8,
            Layout::Nhwc,
            vec![1, 2, 2, 3],
            Bytes::from(vec![0u8; 12]),
        ),
    }
}

async fn recv<T>(rx: &mut mpsc::Receiver<T>) -> T {
    tokio::time::timeout(Duration::from_secs(2), rx.recv())
        .await
        .expect("in time")
        .expect("open")
}

/// Frame `seq` of edge 1, with 500 ms to go, sent to the hub; the
/// batch worker 1 is given for it.
async fn dispatched(hub: &Hub, batches: &mut mpsc::Receiver<Dispatch>, seq: u64) -> Dispatch {
    hub.send(HubMsg::Frame {
        edge: EdgeId(1),
        frame: frame(seq),
        deadline: Instant::now() + Duration::from_millis(500),
        age: Duration::ZERO,
    })
    .await;
    recv(batches).await
}

/// The next result an edge was sent.
async fn recv_result(rx: &mut queue::Receiver<FrameResult>) -> FrameResult {
    tokio::time::timeout(Duration::from_secs(2), rx.recv())
        .await
        .expect("in time")
        .expect("open")
}

/// A hub with no hints, and the token that stops it.
fn hub() -> (Hub, CancellationToken) {
    hub_with(Metrics::new())
}

/// [`hub`] with `metrics` (a clone shares its series).
fn hub_with(metrics: Metrics) -> (Hub, CancellationToken) {
    let cancel = CancellationToken::new();
    let tracker = tokio_util::task::TaskTracker::new();
    let hub = spawn(Settings::default(), None, metrics, cancel.clone(), &tracker);
    (hub, cancel)
}

/// Registers worker 1 (serving `MODEL`) under `lease`; its batches.
/// What the hub publishes of `model` once it has handled every message
/// sent before (a snapshot's round trip).
async fn model_info(hub: &Hub, model: &str) -> Option<ServedModel> {
    hub.snapshot().await.expect("the hub runs");
    hub.model_info(model)
}

async fn connect_worker(hub: &Hub, lease: Option<LeaseId>) -> mpsc::Receiver<Dispatch> {
    connect_worker_drainable(hub, lease).await.0
}

/// [`connect_worker`], with the token the hub cancels to drain it.
async fn connect_worker_drainable(
    hub: &Hub,
    lease: Option<LeaseId>,
) -> (mpsc::Receiver<Dispatch>, CancellationToken) {
    let (dispatch, batches) = mpsc::channel(8);
    let drain = CancellationToken::new();
    hub.send(HubMsg::WorkerConnected {
        worker: WorkerId(1),
        register: register(),
        dispatch,
        lease,
        static_worker: None,
        drain: drain.clone(),
    })
    .await;
    (batches, drain)
}

/// Connects edge 1; the results it is sent.
async fn connect_edge(hub: &Hub) -> queue::Receiver<FrameResult> {
    connect_edge_with(hub, queue::channel(8, 1 << 20)).await
}

/// [`connect_edge`] with its results queue.
async fn connect_edge_with(
    hub: &Hub,
    (results, answers): (queue::Sender<FrameResult>, queue::Receiver<FrameResult>),
) -> queue::Receiver<FrameResult> {
    hub.send(HubMsg::EdgeConnected {
        edge: EdgeId(1),
        name: "e".into(),
        weight: 1,
        results,
        hints: HintBox::new(),
    })
    .await;
    answers
}

/// Worker 1 answers batch `d`, every item with `item(id)`.
async fn answer(hub: &Hub, d: &Dispatch, item: impl Fn(u64) -> ItemResult) {
    hub.send(HubMsg::BatchDone {
        worker: WorkerId(1),
        result: BatchResult {
            batch: d.batch,
            items: d.items.iter().map(|i| item(i.id)).collect(),
        },
    })
    .await;
}

fn ok_item(id: u64) -> ItemResult {
    ItemResult {
        id,
        status: Status::Ok,
        detections: Vec::new(),
        timings: Timings::default(),
        outputs: Vec::new(),
    }
}

/// Hints wait per camera, the latest winning: a tick with hints for
/// more cameras than any queue would hold loses none, and a waiting
/// writer wakes when one is posted.
#[tokio::test]
async fn a_hint_box_keeps_the_latest_hint_of_every_camera() {
    let hints = HintBox::new();
    let hint = |camera: String, max_fps: f32| ControlHint {
        camera,
        max_fps,
        motion_threshold: 0.0,
    };
    for i in 0..200 {
        hints.post(hint(format!("cam-{i:03}"), 5.0));
    }
    hints.post(hint("cam-007".into(), 0.0));
    let taken = hints.take().await;
    assert_eq!(taken.len(), 200);
    assert_eq!(taken[7].camera, "cam-007");
    assert_eq!(taken[7].max_fps, 0.0, "the latest wins");
    assert!(
        taken
            .iter()
            .filter(|h| h.camera != "cam-007")
            .all(|h| h.max_fps == 5.0)
    );
    // empty now: a writer waits until the next post
    let writer = tokio::spawn({
        let hints = hints.clone();
        async move { hints.take().await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!writer.is_finished(), "nothing to take");
    hints.post(hint("cam-000".into(), 2.0));
    let taken = tokio::time::timeout(Duration::from_secs(2), writer)
        .await
        .expect("woken by the post")
        .unwrap();
    assert_eq!(taken.len(), 1);
    assert_eq!(
        (taken[0].camera.as_str(), taken[0].max_fps),
        ("cam-000", 2.0)
    );
}

/// An edge that reads no hints for a while (a slow control stream)
/// still ends up with the policy's last word for its camera: the cap
/// lifted, not a stale cap that no later hint corrects.
#[tokio::test]
async fn an_edge_that_reads_its_hints_late_gets_the_policys_last_word() {
    let metrics = Metrics::new();
    let cancel = CancellationToken::new();
    let tracker = tokio_util::task::TaskTracker::new();
    // The worker never answers, so a lossy window serves nothing and cuts
    // the cap to `max_cut` (half) of what was sent: one step of 1.5 is
    // still under the rate sent before, so the cap is raised at least once
    // before it is lifted, however the windows split the frames (with a
    // step of 2, ten frames in one late window went from the cut straight
    // to the lift)
    let cfg = BackpressureConfig {
        window_us: 100_000,
        relax_after: 1,
        increase: 1.5,
        ..Default::default()
    };
    let hub = spawn(
        Settings::default(),
        Some(cfg),
        metrics.clone(),
        cancel.clone(),
        &tracker,
    );
    // 50 ms a frame: of 10 frames due within 80 ms, all but the first
    // wait behind it past their deadline and are shed (capacity)
    let mut slow = register();
    slow.profile[0].latency_us = 50_000;
    let (dispatch, _batches) = mpsc::channel(8);
    hub.send(HubMsg::WorkerConnected {
        worker: WorkerId(1),
        register: slow,
        dispatch,
        lease: None,
        static_worker: None,
        drain: CancellationToken::new(),
    })
    .await;
    let (results, _answers) = queue::channel(64, 1 << 20);
    let hints = HintBox::new();
    hub.send(HubMsg::EdgeConnected {
        edge: EdgeId(1),
        name: "e".into(),
        weight: 1,
        results,
        hints: hints.clone(),
    })
    .await;
    hub.send(HubMsg::CameraOpened {
        edge: EdgeId(1),
        camera: "cam".into(),
        model: MODEL.into(),
        budget_ms: 80,
    })
    .await;
    for seq in 0..10 {
        hub.send(HubMsg::Frame {
            edge: EdgeId(1),
            frame: frame(seq),
            deadline: Instant::now() + Duration::from_millis(80),
            age: Duration::ZERO,
        })
        .await;
        tokio::time::sleep(Duration::from_millis(33)).await;
    }
    let first = tokio::time::timeout(Duration::from_secs(2), hints.take())
        .await
        .expect("a hint in time");
    assert!(
        first.iter().all(|h| h.camera == "cam" && h.max_fps > 0.0),
        "{first:?}"
    );
    // the camera obeys (sends nothing): clean windows raise the cap
    // step by step, then lift it, while the edge reads nothing
    let lifted = async {
        loop {
            let snap = hub.snapshot().await.unwrap();
            if snap.cameras[0].load.is_some_and(|l| l.cap_fps.is_none()) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), lifted)
        .await
        .expect("the policy lifts the cap");
    assert!(metrics.hints.with_label_values(&["set"]).get() >= 2);
    assert_eq!(metrics.hints.with_label_values(&["lift"]).get(), 1);
    let last = tokio::time::timeout(Duration::from_secs(2), hints.take())
        .await
        .expect("the lift waits to be taken");
    assert_eq!(last.len(), 1, "{last:?}");
    assert_eq!((last[0].camera.as_str(), last[0].max_fps), ("cam", 0.0));
    cancel.cancel();
}

/// A worker that takes a batch and never answers (a hung GPU) while
/// its connection lives: once the batch is the stall timeout past due,
/// its frame ends `failed: worker stalled`, its dispatch channel is
/// closed (which closes the connection) and the drop is counted. Its
/// lease is reported stalled once, for the lease shell to judge; the
/// same worker registering again (its batch done) serves again.
#[tokio::test]
async fn a_stalled_worker_is_dropped_its_frame_ends_and_its_lease_is_reported() {
    let metrics = Metrics::new();
    let cancel = CancellationToken::new();
    let tracker = tokio_util::task::TaskTracker::new();
    let limits = Settings {
        stall_us: 300_000,
        ..Settings::default()
    };
    let hub = spawn(limits, None, metrics.clone(), cancel.clone(), &tracker);
    let mut batches = connect_worker(&hub, Some(LeaseId(4))).await;
    let mut answers = connect_edge(&hub).await;
    send_frame(&hub, 1, 5_000).await;
    let d = recv(&mut batches).await;
    assert_eq!(d.items.len(), 1);
    let r = recv_result(&mut answers).await;
    assert_eq!(r.status, Status::Failed("worker stalled".into()));
    let closed = tokio::time::timeout(Duration::from_secs(2), batches.recv()).await;
    assert!(
        matches!(closed, Ok(None)),
        "dispatch channel closed: {closed:?}"
    );
    assert_eq!(metrics.workers_stalled.get(), 1);
    // Its late answer changes nothing; the hub goes on.
    answer(&hub, &d, ok_item).await;
    assert!(hub.snapshot().await.unwrap().workers.is_empty());
    let report = hub.load_report(vec![MODEL.into()]).await.unwrap();
    assert_eq!(report.stalled, vec![LeaseId(4)]);
    let report = hub.load_report(vec![MODEL.into()]).await.unwrap();
    assert!(report.stalled.is_empty(), "reported once: {report:?}");

    // The same process registers again once its batch is done: it
    // serves again.
    let (dispatch, mut again) = mpsc::channel(8);
    hub.send(HubMsg::WorkerConnected {
        worker: WorkerId(2),
        register: register(),
        dispatch,
        lease: Some(LeaseId(4)),
        static_worker: None,
        drain: CancellationToken::new(),
    })
    .await;
    send_frame(&hub, 2, 5_000).await;
    let d = recv(&mut again).await;
    hub.send(HubMsg::BatchDone {
        worker: WorkerId(2),
        result: BatchResult {
            batch: d.batch,
            items: d.items.iter().map(|i| ok_item(i.id)).collect(),
        },
    })
    .await;
    assert_eq!(recv_result(&mut answers).await.status, Status::Ok);
    cancel.cancel();
}

/// A frame on a worker when its edge goes still finishes (its result
/// counted undeliverable), and its worker time is its edge's, not an
/// unnamed edge's; a frame that trails the edge's `EdgeGone` (they come
/// from separate tasks) is dropped unserved and counted.
#[tokio::test]
async fn a_running_frame_of_a_gone_edge_finishes_on_its_account_and_a_trailing_one_is_dropped() {
    let metrics = Metrics::new();
    let (hub, cancel) = hub_with(metrics.clone());
    let mut batches = connect_worker(&hub, Some(LeaseId(7))).await;
    let _answers = connect_edge(&hub).await;
    let d = dispatched(&hub, &mut batches, 1).await;
    hub.send(HubMsg::EdgeGone { edge: EdgeId(1) }).await;
    send_frame(&hub, 2, 500).await;
    // The hub takes its messages in order: once it answers, frame 2 was
    // handled.
    hub.snapshot().await.unwrap();
    assert!(
        batches.try_recv().is_err(),
        "a trailing frame was dispatched"
    );
    assert_eq!(
        metrics
            .frames_dropped
            .with_label_values(&["edge_gone"])
            .get(),
        1
    );
    answer(&hub, &d, ok_item).await;
    eventually_counted(&metrics, 1).await;
    let r = hub.load_report(vec![MODEL.into()]).await.unwrap();
    assert_eq!(r.usage.len(), 1, "{r:?}");
    assert_eq!(r.usage[0].edge, "e", "{r:?}");
    assert!(metrics.worker_busy.with_label_values(&["e", MODEL]).get() > 0.0);
    assert_eq!(
        metrics.worker_busy.with_label_values(&["", MODEL]).get(),
        0.0
    );
    cancel.cancel();
}

/// A worker's batches are timed under its name, against its profile,
/// with its frames counted by status; frames waiting are the model's
/// queue depth; and its series go when it does.
#[tokio::test]
async fn a_workers_batches_and_frames_are_labelled_with_its_name_until_it_goes() {
    let metrics = Metrics::new();
    let (hub, cancel) = hub_with(metrics.clone());
    let mut batches = connect_worker(&hub, None).await;
    let mut answers = connect_edge(&hub).await;
    let labels = ["lease-7", MODEL];
    assert_eq!(
        metrics
            .worker_frames
            .with_label_values(&["lease-7", "ok"])
            .get(),
        0,
        "exported at 0 from registration"
    );
    let d = dispatched(&hub, &mut batches, 1).await;
    // the worker holds two batches of one (the pipeline's depth): a
    // third frame waits in the queue
    let d2 = dispatched(&hub, &mut batches, 2).await;
    send_frame(&hub, 3, 500).await;
    hub.snapshot().await.unwrap();
    assert!(batches.try_recv().is_err(), "two batches at a time");
    assert_eq!(metrics.queue_depth.with_label_values(&[MODEL]).get(), 1);
    // 0.5 + 2 + 0.5 ms of the worker's own time: three times the
    // profile's 1 ms for a batch of one, whatever the transfer took
    let timed = |id| ItemResult {
        timings: Timings {
            preprocess_us: 500,
            inference_us: 2000,
            postprocess_us: 500,
            ..Timings::default()
        },
        ..ok_item(id)
    };
    answer(&hub, &d, timed).await;
    recv_result(&mut answers).await;
    let d3 = recv(&mut batches).await;
    hub.snapshot().await.unwrap();
    assert_eq!(metrics.queue_depth.with_label_values(&[MODEL]).get(), 0);
    let failed = |id| ItemResult {
        status: Status::Failed("boom".into()),
        ..timed(id)
    };
    answer(&hub, &d2, failed).await;
    answer(&hub, &d3, timed).await;
    recv_result(&mut answers).await;
    recv_result(&mut answers).await;
    hub.snapshot().await.unwrap();
    let frames = |s: &str| {
        metrics
            .worker_frames
            .with_label_values(&["lease-7", s])
            .get()
    };
    assert_eq!((frames("ok"), frames("failed"), frames("shed")), (2, 1, 0));
    let batch = metrics.worker_batch.with_label_values(&labels);
    assert_eq!(batch.get_sample_count(), 3);
    let ratio = metrics.worker_batch_over_profile.with_label_values(&labels);
    assert_eq!(ratio.get_sample_count(), 3);
    assert!(
        (ratio.get_sample_sum() - 9.0).abs() < 1e-9,
        "three batches at 3x their profile: {}",
        ratio.get_sample_sum()
    );
    hub.send(HubMsg::WorkerGone {
        worker: WorkerId(1),
    })
    .await;
    hub.snapshot().await.unwrap();
    let text = metrics.render();
    assert!(!text.contains("worker=\"lease-7\""), "{text}");
    cancel.cancel();
}

/// With thumbnails on, a frame served `ok` of an open camera gives its
/// thumbnail, with its boxes; the next within the interval gives none;
/// and the thumbnail goes with its edge. Off, nothing is kept.
#[tokio::test]
async fn an_ok_frame_gives_one_thumbnail_per_interval_which_goes_with_its_edge() {
    use crate::thumbnail::{NoThumbnail, ThumbnailConfig};
    let (hub, cancel) = hub();
    let mut batches = connect_worker(&hub, None).await;
    let mut answers = connect_edge(&hub).await;
    hub.send(HubMsg::CameraOpened {
        edge: EdgeId(1),
        camera: "cam".into(),
        model: MODEL.into(),
        budget_ms: 80,
    })
    .await;
    let boxed = |id| ItemResult {
        detections: vec![tidegate_protocol::Detection {
            x1: 0.0,
            y1: 0.0,
            x2: 2.0,
            y2: 2.0,
            score: 0.9,
            class: 0,
            keypoints: Vec::new(),
        }],
        ..ok_item(id)
    };
    let d = dispatched(&hub, &mut batches, 1).await;
    answer(&hub, &d, boxed).await;
    recv_result(&mut answers).await;
    assert_eq!(hub.thumbnails().cameras(), 0, "off: nothing kept");
    assert_eq!(hub.thumbnails().get("e", "cam"), Err(NoThumbnail::Off));

    hub.thumbnails().configure(Some(ThumbnailConfig {
        interval: Duration::from_secs(3600),
        max_px: 32,
    }));
    let d = dispatched(&hub, &mut batches, 2).await;
    answer(&hub, &d, boxed).await;
    recv_result(&mut answers).await;
    // Rendered on a blocking task: wait for it, boundedly.
    let mut made = None;
    for _ in 0..500 {
        if let Ok(t) = hub.thumbnails().get("e", "cam") {
            made = Some(t);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (number, jpeg) = made.expect("a thumbnail within 5 s");
    let img = image::load_from_memory(&jpeg).unwrap().to_rgb8();
    // A 2×2 source drawn at 2×2: the 2 px outline covers it.
    assert_eq!(img.dimensions(), (2, 2));
    assert!(img.pixels().all(|p| p[1] > 150), "{img:?}");
    // The next frame is within the interval: no render starts.
    let d = dispatched(&hub, &mut batches, 3).await;
    answer(&hub, &d, boxed).await;
    recv_result(&mut answers).await;
    assert_eq!(hub.thumbnails().get("e", "cam").unwrap().0, number);
    assert_eq!(hub.thumbnails().numbers().len(), 1);

    hub.send(HubMsg::EdgeGone { edge: EdgeId(1) }).await;
    hub.snapshot().await.unwrap();
    assert_eq!(hub.thumbnails().cameras(), 0);
    assert!(matches!(
        hub.thumbnails().get("e", "cam"),
        Err(NoThumbnail::NoneYet { .. })
    ));
    cancel.cancel();
}

/// The budget reported for a model is the strictest its open cameras
/// declared, whichever frame came last; with no camera open, the latest
/// frame's.
#[tokio::test]
async fn the_reported_budget_is_the_strictest_declared_not_the_last_frames() {
    let (hub, cancel) = hub();
    let _batches = connect_worker(&hub, None).await;
    let _answers = connect_edge(&hub).await;
    for (camera, budget_ms) in [("slow", 200), ("fast", 80)] {
        hub.send(HubMsg::CameraOpened {
            edge: EdgeId(1),
            camera: camera.into(),
            model: MODEL.into(),
            budget_ms,
        })
        .await;
    }
    // the last frame has 190 ms left
    let mut f = frame(1);
    f.camera = "slow".into();
    f.budget_us = 190_000;
    hub.send(HubMsg::Frame {
        edge: EdgeId(1),
        frame: f,
        deadline: Instant::now() + Duration::from_millis(190),
        age: Duration::ZERO,
    })
    .await;
    let r = hub.load_report(vec![MODEL.into()]).await.unwrap();
    assert_eq!(r.models[0].budget_ms, 80.0, "{r:?}");
    // its edge gone, only the frame says
    hub.send(HubMsg::EdgeGone { edge: EdgeId(1) }).await;
    let r = hub.load_report(vec![MODEL.into()]).await.unwrap();
    assert_eq!(r.models[0].budget_ms, 190.0, "{r:?}");
    cancel.cancel();
}

#[tokio::test]
async fn frames_are_counted_per_lease_and_a_drained_lease_gets_no_batch() {
    let metrics = Metrics::new();
    let (hub, cancel) = hub_with(metrics.clone());
    let mut batches = connect_worker(&hub, Some(LeaseId(7))).await;
    let mut answers = connect_edge(&hub).await;
    let deadline = Instant::now() + Duration::from_millis(500);
    hub.send(HubMsg::Frame {
        edge: EdgeId(1),
        frame: frame(1),
        deadline,
        age: Duration::ZERO,
    })
    .await;
    let d = recv(&mut batches).await;
    answer(&hub, &d, ok_item).await;
    assert_eq!(recv_result(&mut answers).await.status, Status::Ok);

    let r = hub.load_report(vec![MODEL.into()]).await.unwrap();
    assert_eq!(r.served.len(), 1, "{r:?}");
    let (lease, s) = r.served[0];
    assert_eq!(lease, LeaseId(7));
    assert_eq!((s.within_slo, s.late), (1, 0));
    assert_eq!(r.workers.len(), 1);
    assert_eq!(r.workers[0].profile, vec![(MODEL.to_string(), 1, 1000)]);
    assert_eq!(r.models[0].budget_ms, 80.0);
    assert!(r.models[0].arrival_fps > 0.0, "{r:?}");
    // the same frame for the showback: lease, edge and model, with the
    // batch's run time
    assert_eq!(r.usage.len(), 1, "{r:?}");
    let u = &r.usage[0];
    assert_eq!(
        (u.lease, u.edge.as_str(), u.model.as_str()),
        (LeaseId(7), "e", MODEL)
    );
    assert_eq!((u.usage.within_slo, u.usage.late), (1, 0));
    assert_eq!(u.usage.busy_us, s.busy_us, "one frame: the whole batch");
    assert!(u.usage.busy_us > 0, "{u:?}");
    let busy = metrics.worker_busy.with_label_values(&["e", MODEL]).get();
    assert!((busy - u.usage.busy_us as f64 / 1e6).abs() < 1e-9, "{busy}");
    // counted once: the next report starts from zero
    let r = hub.load_report(vec![MODEL.into()]).await.unwrap();
    assert!(r.served.is_empty(), "{r:?}");
    assert!(r.usage.is_empty(), "{r:?}");

    // a drained lease's worker gets nothing; the frame still ends
    hub.send(HubMsg::LeaseDraining { lease: LeaseId(7) }).await;
    hub.send(HubMsg::Frame {
        edge: EdgeId(1),
        frame: frame(2),
        deadline: Instant::now() + Duration::from_millis(50),
        age: Duration::ZERO,
    })
    .await;
    let answer = recv_result(&mut answers).await;
    assert_ne!(answer.status, Status::Ok, "{answer:?}");
    assert!(batches.try_recv().is_err(), "no batch to a draining lease");
    let snap = hub.snapshot().await.unwrap();
    assert!(snap.frames.balanced(), "{:?}", snap.frames);
    assert!(snap.workers[0].draining);
    cancel.cancel();
}

#[tokio::test]
async fn an_operator_drain_stops_dispatch_and_asks_the_worker_to_drain() {
    let (hub, cancel) = hub();
    let (mut batches, drain) = connect_worker_drainable(&hub, None).await;
    let mut answers = connect_edge(&hub).await;
    assert_eq!(hub.drain_worker("no-such-worker").await, Some(0));
    assert!(!drain.is_cancelled());
    assert_eq!(hub.drain_worker("lease-7").await, Some(1));
    assert!(drain.is_cancelled(), "the connection is told to send Drain");
    assert!(hub.snapshot().await.unwrap().workers[0].draining);
    // again: still one, still draining
    assert_eq!(hub.drain_worker("lease-7").await, Some(1));
    hub.send(HubMsg::Frame {
        edge: EdgeId(1),
        frame: frame(1),
        deadline: Instant::now() + Duration::from_millis(50),
        age: Duration::ZERO,
    })
    .await;
    let answer = recv_result(&mut answers).await;
    assert_ne!(answer.status, Status::Ok, "{answer:?}");
    assert!(batches.try_recv().is_err(), "no batch to a draining worker");
    assert!(hub.snapshot().await.unwrap().frames.balanced());
    cancel.cancel();
}

#[tokio::test]
async fn a_lease_drained_before_its_worker_registers_is_drained_on_arrival() {
    let (hub, cancel) = hub();
    hub.send(HubMsg::LeaseDraining { lease: LeaseId(3) }).await;
    let _batches = connect_worker(&hub, Some(LeaseId(3))).await;
    let snap = hub.snapshot().await.unwrap();
    assert!(snap.workers[0].draining, "{:?}", snap.workers);
    // and a lease that ended takes its worker with it at once
    hub.send(HubMsg::LeaseEnded { lease: LeaseId(3) }).await;
    assert!(hub.snapshot().await.unwrap().workers.is_empty());
    cancel.cancel();
}

/// Registers worker 1 as the static worker `gpu-a`; its batches.
async fn connect_static_worker(hub: &Hub) -> mpsc::Receiver<Dispatch> {
    let (dispatch, batches) = mpsc::channel(8);
    hub.send(HubMsg::WorkerConnected {
        worker: WorkerId(1),
        register: register(),
        dispatch,
        lease: None,
        static_worker: Some("gpu-a".into()),
        drain: CancellationToken::new(),
    })
    .await;
    batches
}

/// Sends frame `seq` of camera `cam`, due in `ms`.
async fn send_frame(hub: &Hub, seq: u64, ms: u64) {
    hub.send(HubMsg::Frame {
        edge: EdgeId(1),
        frame: frame(seq),
        deadline: Instant::now() + Duration::from_millis(ms),
        age: Duration::ZERO,
    })
    .await;
}

/// Worker 1's lease and whether it is unbound, as the API shows it.
async fn static_view(hub: &Hub) -> (Option<u64>, bool, bool) {
    let snap = hub.snapshot().await.unwrap();
    assert_eq!(snap.workers.len(), 1, "{:?}", snap.workers);
    let w = &snap.workers[0];
    (w.lease, w.unbound, w.draining)
}

#[tokio::test]
async fn an_unbound_static_worker_waits_connected_serves_once_bound_and_keeps_its_link_when_unbound()
 {
    let (hub, cancel) = hub();
    let mut batches = connect_static_worker(&hub).await;
    let mut answers = connect_edge(&hub).await;
    // unbound: registered (a camera may open), but no batch
    assert_eq!(static_view(&hub).await, (None, true, true));
    assert!(model_info(&hub, MODEL).await.is_some());
    assert_eq!(hub.snapshot().await.unwrap().models[0].workers, 0);
    send_frame(&hub, 1, 50).await;
    let r = recv_result(&mut answers).await;
    assert_ne!(r.status, Status::Ok, "{r:?}");
    assert!(batches.try_recv().is_err(), "no batch while unbound");

    // bound: it serves the lease, and its frames count for it
    hub.send(HubMsg::LeaseBound {
        lease: LeaseId(5),
        worker_name: "gpu-a".into(),
    })
    .await;
    assert_eq!(static_view(&hub).await, (Some(5), false, false));
    send_frame(&hub, 2, 500).await;
    let d = recv(&mut batches).await;
    answer(&hub, &d, ok_item).await;
    assert_eq!(recv_result(&mut answers).await.status, Status::Ok);
    let r = hub.load_report(vec![MODEL.into()]).await.unwrap();
    assert_eq!(r.served.len(), 1, "{r:?}");
    assert_eq!(r.served[0].0, LeaseId(5));
    assert_eq!(r.workers.len(), 1);

    // released: drained, then unbound with a batch still out; the link
    // stays, the batch still finishes, and nothing new is sent
    send_frame(&hub, 3, 500).await;
    let held = recv(&mut batches).await;
    hub.send(HubMsg::LeaseDraining { lease: LeaseId(5) }).await;
    hub.send(HubMsg::LeaseUnbound { lease: LeaseId(5) }).await;
    assert_eq!(static_view(&hub).await, (None, true, true));
    assert!(
        matches!(batches.try_recv(), Err(mpsc::error::TryRecvError::Empty)),
        "the dispatch channel is still open"
    );
    answer(&hub, &held, ok_item).await;
    let r = recv_result(&mut answers).await;
    assert_eq!((r.seq, r.status), (3, Status::Ok));
    send_frame(&hub, 4, 50).await;
    let r = recv_result(&mut answers).await;
    assert_ne!(r.status, Status::Ok, "{r:?}");
    assert!(batches.try_recv().is_err(), "no batch once unbound");
    assert!(hub.load_report(vec![]).await.unwrap().workers.is_empty());

    // bound again by a later lease: it serves again
    hub.send(HubMsg::LeaseBound {
        lease: LeaseId(6),
        worker_name: "gpu-a".into(),
    })
    .await;
    assert_eq!(static_view(&hub).await, (Some(6), false, false));
    send_frame(&hub, 5, 500).await;
    let d = recv(&mut batches).await;
    answer(&hub, &d, ok_item).await;
    let r = recv_result(&mut answers).await;
    assert_eq!((r.seq, r.status), (5, Status::Ok));
    let snap = hub.snapshot().await.unwrap();
    assert!(snap.frames.balanced(), "{:?}", snap.frames);
    assert_eq!(snap.frames.admitted, 5, "{:?}", snap.frames);
    cancel.cancel();
}

#[tokio::test]
async fn a_static_worker_rebound_with_a_batch_out_resumes_and_its_answer_ends_the_frame() {
    let (hub, cancel) = hub();
    let bind = |lease| HubMsg::LeaseBound {
        lease: LeaseId(lease),
        worker_name: "gpu-a".into(),
    };
    // bound before it connects: it serves at once when it does
    hub.send(bind(5)).await;
    let mut batches = connect_static_worker(&hub).await;
    let mut answers = connect_edge(&hub).await;
    assert_eq!(static_view(&hub).await, (Some(5), false, false));
    send_frame(&hub, 1, 2000).await;
    let old = recv(&mut batches).await;
    // unbound and bound again before it answers (a batch slower than
    // the release's grace): the worker, still running the batch, resumes
    // in the scheduler with it, so its answer ends the frame, once, for
    // the lease it now serves
    hub.send(HubMsg::LeaseUnbound { lease: LeaseId(5) }).await;
    hub.send(bind(6)).await;
    assert_eq!(static_view(&hub).await, (Some(6), false, false));
    assert!(
        answers.try_recv().is_none(),
        "the frame waits for its answer"
    );
    answer(&hub, &old, ok_item).await;
    let r = recv_result(&mut answers).await;
    assert_eq!((r.seq, r.status), (1, Status::Ok));
    // and it serves the new lease
    send_frame(&hub, 2, 2000).await;
    let new = recv(&mut batches).await;
    assert_ne!(new.batch, old.batch);
    answer(&hub, &new, ok_item).await;
    let r = recv_result(&mut answers).await;
    assert_eq!((r.seq, r.status), (2, Status::Ok));
    // rebound while serving (another lease for its name): it keeps
    // serving, and the batch it holds ends as answered
    send_frame(&hub, 3, 2000).await;
    let held = recv(&mut batches).await;
    hub.send(bind(7)).await;
    assert_eq!(static_view(&hub).await, (Some(7), false, false));
    answer(&hub, &held, ok_item).await;
    let r = recv_result(&mut answers).await;
    assert_eq!((r.seq, r.status), (3, Status::Ok));
    let snap = hub.snapshot().await.unwrap();
    assert!(snap.frames.balanced(), "{:?}", snap.frames);
    assert_eq!(
        (snap.frames.ok, snap.frames.failed),
        (3, 0),
        "{:?}",
        snap.frames
    );
    assert!(answers.try_recv().is_none(), "one result per frame");
    let r = hub.load_report(vec![]).await.unwrap();
    let served: Vec<(LeaseId, u64)> = r.served.iter().map(|(l, s)| (*l, s.within_slo)).collect();
    assert_eq!(served, vec![(LeaseId(6), 2), (LeaseId(7), 1)], "{r:?}");
    // a lease that ends by the worker's loss unbinds the name too
    hub.send(HubMsg::LeaseEnded { lease: LeaseId(7) }).await;
    assert!(hub.snapshot().await.unwrap().workers.is_empty());
    let _batches = connect_static_worker(&hub).await;
    assert_eq!(static_view(&hub).await, (None, true, true));
    cancel.cancel();
}

#[tokio::test]
async fn a_static_worker_that_said_drain_never_serves_again_whatever_lease_binds_it() {
    let (hub, cancel) = hub();
    let bind = |lease| HubMsg::LeaseBound {
        lease: LeaseId(lease),
        worker_name: "gpu-a".into(),
    };
    hub.send(bind(5)).await;
    let mut batches = connect_static_worker(&hub).await;
    let mut answers = connect_edge(&hub).await;
    hub.send(HubMsg::WorkerDraining {
        worker: WorkerId(1),
    })
    .await;
    assert_eq!(static_view(&hub).await, (Some(5), false, true));
    // unbound, bound to a live lease, bound to another: it takes each
    // lease (which ends when it goes) but no batch
    hub.send(HubMsg::LeaseUnbound { lease: LeaseId(5) }).await;
    assert_eq!(static_view(&hub).await, (None, true, true));
    hub.send(bind(6)).await;
    assert_eq!(static_view(&hub).await, (Some(6), false, true));
    hub.send(bind(7)).await;
    assert_eq!(static_view(&hub).await, (Some(7), false, true));
    send_frame(&hub, 1, 50).await;
    let r = recv_result(&mut answers).await;
    assert_ne!(r.status, Status::Ok, "{r:?}");
    assert!(batches.try_recv().is_err(), "no batch to a retiring worker");
    // the lease report still lists it under its lease
    let r = hub.load_report(vec![]).await.unwrap();
    assert_eq!(r.workers.len(), 1, "{r:?}");
    assert_eq!(r.workers[0].lease, LeaseId(7));
    cancel.cancel();
}

#[tokio::test]
async fn a_camera_may_ask_only_for_an_encoding_every_worker_of_its_model_decodes() {
    let (hub, cancel) = hub();
    let _batches = connect_worker(&hub, None).await;
    let served = model_info(&hub, MODEL).await.unwrap();
    assert_eq!(
        served.codecs,
        BTreeSet::from([Codec::Raw, Codec::Jpeg]),
        "as registered"
    );
    served.accepts(Encoding::Raw).unwrap();
    served.accepts(Encoding::Jpeg { quality: 75 }).unwrap();
    let (code, why) = served.accepts(Encoding::Png).unwrap_err();
    assert_eq!(code, ErrorCode::Unavailable);
    assert!(
        why.contains("decodes png") && why.contains("raw, jpeg"),
        "{why}"
    );

    // A second worker of the model that decodes only raw: a JPEG frame
    // could reach it, so JPEG is refused from now on.
    let (dispatch, _more) = mpsc::channel(8);
    hub.send(HubMsg::WorkerConnected {
        worker: WorkerId(2),
        register: Register {
            worker: "raw-only".into(),
            codecs: vec![Codec::Raw],
            ..register()
        },
        dispatch,
        lease: None,
        static_worker: None,
        drain: CancellationToken::new(),
    })
    .await;
    let served = model_info(&hub, MODEL).await.unwrap();
    assert_eq!(served.codecs, BTreeSet::from([Codec::Raw]));
    assert_eq!(
        served
            .accepts(Encoding::Jpeg { quality: 90 })
            .unwrap_err()
            .0,
        ErrorCode::Unavailable
    );

    // A model whose input no image codec carries is refused for good,
    // whatever the workers decode.
    let f32_model = ServedModel {
        info: ModelInfo {
            input: InputSpec {
                dtype: DType::F32,
                layout: Layout::Nchw,
                ..register().models[0].input
            },
            ..register().models[0].clone()
        },
        codecs: BTreeSet::from(Codec::ALL),
    };
    let (code, why) = f32_model.accepts(Encoding::Png).unwrap_err();
    assert_eq!(code, ErrorCode::ShapeMismatch);
    assert!(why.contains("use raw"), "{why}");
    cancel.cancel();
}

/// Camera opens are answered from what the hub publishes: a model is
/// served from its first worker's registration until its last worker goes.
#[tokio::test]
async fn a_model_is_published_while_a_worker_serves_it_and_withdrawn_when_the_last_goes() {
    let (hub, cancel) = hub();
    assert!(model_info(&hub, MODEL).await.is_none(), "no worker yet");
    let _batches = connect_worker(&hub, None).await;
    assert!(model_info(&hub, MODEL).await.is_some());
    assert!(model_info(&hub, "other").await.is_none());
    hub.send(HubMsg::WorkerGone {
        worker: WorkerId(1),
    })
    .await;
    assert!(
        model_info(&hub, MODEL).await.is_none(),
        "its worker has gone"
    );
    cancel.cancel();
}

#[tokio::test]
async fn labels_and_raw_outputs_reach_the_edge_and_failures_carry_none() {
    let (hub, cancel) = hub();
    assert!(model_info(&hub, MODEL).await.is_none(), "no worker yet");
    let mut batches = connect_worker(&hub, None).await;
    // What CameraAccepted is built from: the registered input and labels.
    let info = model_info(&hub, MODEL).await.unwrap().info;
    assert_eq!(info.labels, vec!["face".to_string(), "hand".into()]);
    assert_eq!(info.input.width, 2);
    // and what /api/v1/models shows.
    let snap = hub.snapshot().await.unwrap();
    assert_eq!(snap.models[0].labels, info.labels);

    let mut answers = connect_edge(&hub).await;
    let embedding = OutputTensor::from_f32("embedding", vec![1, 3], &[0.25, -1.0, 4.0]).unwrap();
    for (seq, ok) in [(1, true), (2, false)] {
        let d = dispatched(&hub, &mut batches, seq).await;
        answer(&hub, &d, |id| ItemResult {
            status: if ok {
                Status::Ok
            } else {
                Status::Failed("bad input".into())
            },
            detections: vec![Detection {
                x1: 0.0,
                y1: 0.0,
                x2: 1.0,
                y2: 1.0,
                score: 0.9,
                class: 1,
                keypoints: vec![],
            }],
            outputs: vec![embedding.clone()],
            ..ok_item(id)
        })
        .await;
        let r = recv_result(&mut answers).await;
        assert_eq!(r.seq, seq);
        if ok {
            assert_eq!(r.status, Status::Ok);
            assert_eq!(r.detections.len(), 1);
            assert_eq!(r.outputs, vec![embedding.clone()]);
        } else {
            assert!(matches!(r.status, Status::Failed(_)), "{r:?}");
            assert!(r.detections.is_empty() && r.outputs.is_empty(), "{r:?}");
        }
    }
    cancel.cancel();
}

#[tokio::test]
async fn results_past_an_edges_byte_budget_are_dropped_and_counted() {
    let metrics = Metrics::new();
    // The answer for a frame not in the batch (below) demotes the
    // worker as malformed; with a 1 µs back-off its next batch is the
    // probe that restores it, so the frames that follow are still run.
    let limits = Settings {
        health: crate::health::HealthPolicy {
            backoff_us: 1,
            max_backoff_us: 1,
            ..Default::default()
        },
        ..Settings::default()
    };
    let cancel = CancellationToken::new();
    let tracker = tokio_util::task::TaskTracker::new();
    let hub = spawn(limits, None, metrics.clone(), cancel.clone(), &tracker);
    let mut batches = connect_worker(&hub, None).await;
    // 64 KiB of raw output a frame; the edge's queue has room for the
    // bytes of one such result, though it has slots for eight.
    let big = OutputTensor::from_f32("map", vec![1, 16384], &[0.5; 16384]).unwrap();
    let one = FrameResult {
        camera: "cam".into(),
        seq: 1,
        captured_at_us: 0,
        status: Status::Ok,
        detections: Vec::new(),
        timings: Default::default(),
        outputs: vec![big.clone()],
    }
    .held_bytes();
    let mut answers = connect_edge_with(&hub, queue::channel(8, one + one / 2)).await;
    let mut serve = async |seq: u64, extra: Option<u64>| {
        let d = dispatched(&hub, &mut batches, seq).await;
        let mut items: Vec<ItemResult> = d
            .items
            .iter()
            .map(|i| ItemResult {
                outputs: vec![big.clone()],
                ..ok_item(i.id)
            })
            .collect();
        // An answer for a frame the hub no longer holds shares the
        // batch's buffer, as the frames of a real batch do.
        items.extend(extra.map(|id| ItemResult {
            outputs: vec![big.clone()],
            ..ok_item(id)
        }));
        hub.send(HubMsg::BatchDone {
            worker: WorkerId(1),
            result: BatchResult {
                batch: d.batch,
                items,
            },
        })
        .await;
    };
    serve(1, Some(999)).await;
    serve(2, None).await;
    eventually_counted(&metrics, 1).await;
    let r = recv_result(&mut answers).await;
    assert_eq!((r.seq, r.status), (1, Status::Ok));
    assert_eq!(r.outputs, vec![big.clone()]);
    assert_ne!(
        r.outputs[0].data.as_ptr(),
        big.data.as_ptr(),
        "an output of a batch of many is copied out of the batch's buffer"
    );
    assert!(answers.is_empty(), "the second result did not fit");
    // Taken, its bytes are free again: the next result fits.
    serve(3, None).await;
    let r = recv_result(&mut answers).await;
    assert_eq!(r.seq, 3);
    assert_eq!(
        r.outputs[0].data.as_ptr(),
        big.data.as_ptr(),
        "the output of a batch of one is its buffer's own, not copied"
    );
    assert_eq!(metrics.undeliverable.get(), 1);
    cancel.cancel();
}

/// A worker that leaves a frame of its batch unanswered: the frame fails
/// once, and the worker is demoted at once (even as the only worker),
/// counted, shown in the API, and its lease reported to the lease
/// shell; while it backs off it gets no batch.
#[tokio::test]
async fn a_worker_returning_a_short_batch_is_demoted_counted_shown_and_its_lease_reported() {
    let metrics = Metrics::new();
    let (hub, cancel) = hub_with(metrics.clone());
    let mut batches = connect_worker(&hub, Some(LeaseId(3))).await;
    let mut answers = connect_edge(&hub).await;
    let d = dispatched(&hub, &mut batches, 1).await;
    hub.send(HubMsg::BatchDone {
        worker: WorkerId(1),
        result: BatchResult {
            batch: d.batch,
            items: Vec::new(),
        },
    })
    .await;
    let r = recv_result(&mut answers).await;
    assert_eq!(
        r.status,
        Status::Failed("worker returned no result for this frame".into())
    );
    let snap = hub.snapshot().await.unwrap();
    assert!(snap.workers[0].demoted, "{:?}", snap.workers);
    assert_eq!(
        metrics
            .worker_demotions
            .with_label_values(&[MODEL, "short_result"])
            .get(),
        1
    );
    assert_eq!(metrics.workers_demoted.get(), 1);
    let report = hub.load_report(vec![]).await.unwrap();
    assert_eq!(report.stalled, vec![LeaseId(3)]);
    // Backing off (a second by default), it counts for no capacity: a
    // frame now has no worker.
    send_frame(&hub, 2, 500).await;
    let r = recv_result(&mut answers).await;
    assert_eq!(
        (r.seq, r.status),
        (2, Status::Shed(tidegate_protocol::ShedReason::NoWorker))
    );
    assert!(batches.try_recv().is_err(), "no batch while it backs off");
    assert!(answers.try_recv().is_none(), "one result per frame");
    cancel.cancel();
}

/// An answer for a frame of another batch is not taken: the frame keeps
/// its own worker's answer, and the liar is demoted as malformed.
#[tokio::test]
async fn an_answer_for_a_frame_outside_the_batch_is_ignored_and_demotes_its_worker() {
    let metrics = Metrics::new();
    let (hub, cancel) = hub_with(metrics.clone());
    let mut batches = connect_worker(&hub, None).await;
    let mut answers = connect_edge(&hub).await;
    // Frame 1 goes to worker 1 (batch of one); a second frame queues
    // behind it for the pipeline's second slot.
    let first = dispatched(&hub, &mut batches, 1).await;
    let second = dispatched(&hub, &mut batches, 2).await;
    // Worker 1 answers its first batch, and frame 2 as well (a lie).
    hub.send(HubMsg::BatchDone {
        worker: WorkerId(1),
        result: BatchResult {
            batch: first.batch,
            items: vec![
                ok_item(first.items[0].id),
                ItemResult {
                    status: Status::Failed("made up".into()),
                    ..ok_item(second.items[0].id)
                },
            ],
        },
    })
    .await;
    let r = recv_result(&mut answers).await;
    assert_eq!((r.seq, r.status), (1, Status::Ok));
    assert_eq!(
        metrics
            .worker_demotions
            .with_label_values(&[MODEL, "malformed_result"])
            .get(),
        1
    );
    // Frame 2 still ends once, by its own batch's answer.
    answer(&hub, &second, ok_item).await;
    let r = recv_result(&mut answers).await;
    assert_eq!((r.seq, r.status), (2, Status::Ok));
    let snap = hub.snapshot().await.unwrap();
    assert!(
        snap.frames.balanced() && snap.frames.ok == 2,
        "{:?}",
        snap.frames
    );
    cancel.cancel();
}

/// Waits until `n` results were counted undeliverable.
async fn eventually_counted(metrics: &Metrics, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(2);
    while metrics.undeliverable.get() != n && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(metrics.undeliverable.get(), n);
}
