//! Hostile peers against a real gateway process on 127.0.0.1, each bounded
//! by a `[limits]` key, with a legitimate edge's cameras served beside the
//! memory attacks:
//!
//! - partly sent frames larger than their camera can send are refused
//!   from their headers; the others take no more than the edge's budget
//!   for them, the frames past it are refused, and the memory comes back
//!   afterwards;
//! - a frame trickled in is reset once its read timeout has passed;
//! - connections that never log in can open no stream to push into, and
//!   only so many are let in at once;
//! - one edge name gets only so many connections, and only so many
//!   cameras over all of them.
//!
//! Memory is the gateway's resident set (`VmRSS`); the bounds are the
//! configured budgets plus fixed slack, never a speed. Every attack is
//! bounded in streams, bytes and time.

use std::time::{Duration, Instant};

use tidegate_loadtest::attack::edge::{
    ask_camera, camera_open, open_camera, partial_frames, trickle,
};
use tidegate_loadtest::attack::rss::RssWatch;
use tidegate_loadtest::attack::stranger::strangers;
use tidegate_loadtest::attack::{AttackError, LoggedIn, MIB, Target};
use tidegate_loadtest::cluster::{Cluster, ClusterOptions, metric_value};
use tidegate_loadtest::loadgen;
use tidegate_loadtest::report::Report;
use tidegate_protocol::quic::{BEFORE_LOGIN_RECEIVE_WINDOW, HandshakeError, edge_receive_window};
use tidegate_protocol::{
    ColorOrder, DType, ErrorCode, Frame, InputSpec, Layout, Limits, Message, Resize,
};
use tokio_util::sync::CancellationToken;

/// The tests here load the machine on purpose and measure one process's
/// memory: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Bounds each test's async part: far above what it needs on a loaded
/// machine, far below the harness's patience.
const WAIT: Duration = Duration::from_secs(45);

/// Allocator slack on top of a bound: QUIC's per-connection state, packet
/// buffers, the allocator's own caches.
const SLACK: u64 = 48 * MIB;

/// A gateway with edges `edge-1` (the legitimate one) and `edge-hostile`,
/// `[limits]` lines `limits`, and worker `worker-1` serving BlazeFace.
fn cluster(limits: &str) -> Cluster {
    let mut c = Cluster::start(&ClusterOptions {
        edges: vec!["edge-1".into(), "edge-hostile".into(), "edge-2".into()],
        limits: limits.into(),
        ..ClusterOptions::default()
    })
    .expect("gateway starts");
    c.spawn_worker("worker-1").expect("worker starts");
    c.wait_for_workers(1, Duration::from_secs(60))
        .expect("worker registers");
    c
}

/// The gateway's resident set (bytes), from /proc.
fn rss(c: &Cluster) -> u64 {
    tidegate_loadtest::attack::rss::rss(c.gateway_pid()).expect("the gateway's VmRSS in /proc")
}

/// Samples the gateway's resident set every 20 ms until dropped.
fn peak(c: &Cluster) -> RssWatch {
    RssWatch::watch(c.gateway_pid(), Duration::from_millis(20))
}

/// The legitimate edge: 4 cameras × 10 fps for `seconds`, on a thread.
fn legitimate_load(c: &Cluster, seconds: f64) -> std::thread::JoinHandle<Report> {
    let opts = c.load_options("edge-1", 4, 10.0, seconds);
    std::thread::spawn(move || loadgen::run_blocking(&opts).expect("the legitimate load runs"))
}

/// Every frame of the legitimate edge got one result (or was reset by its
/// own lane at the end of its budget, or refused): none missing, none
/// twice, none lost with its connection.
fn assert_served(r: &Report) {
    assert!(r.sent > 0, "the legitimate edge sent nothing: {r:?}");
    assert_eq!(r.missing, 0, "frames without a result: {r:?}");
    assert_eq!(r.duplicates, 0, "frames with two results: {r:?}");
    assert_eq!(r.lost_with_connection, 0, "its connection was lost: {r:?}");
    assert_eq!(
        r.results() + r.reset + r.refused + r.lost_with_connection,
        r.sent,
        "{r:?}"
    );
}

/// `tidegate_frames_rejected_total{reason="<reason>"}` now.
fn rejected(c: &Cluster, reason: &str) -> u64 {
    counter(
        c,
        &format!("tidegate_frames_rejected_total{{reason=\"{reason}\"}}"),
    )
}

/// A counter's value in `/metrics` (0 when absent).
fn counter(c: &Cluster, series: &str) -> u64 {
    let (_, text) = c.get("/metrics").expect("GET /metrics");
    metric_value(&text, series).map_or(0, |v| v as u64)
}

fn runtime() -> tokio::runtime::Runtime {
    tidegate_loadtest::attack::runtime().expect("a tokio runtime")
}

/// Logs in as edge `name`: the connection and its control stream.
async fn login(c: &Cluster, name: &str) -> Result<LoggedIn, AttackError> {
    tidegate_loadtest::attack::login(&Target::of(c), name).await
}

/// Opens a camera on BlazeFace as `edge-hostile` and sends 32 frame
/// streams declaring `declared` bytes each, all but the last byte of each;
/// returns once `done` holds of the gateway's counters (or `WAIT` passes),
/// with the peak of the gateway's memory meanwhile.
fn partial_wave(c: &Cluster, declared: usize, done: impl Fn() -> bool) -> u64 {
    let peak = peak(c);
    let rt = runtime();
    let target = Target::of(c);
    let conn = rt.block_on(async {
        // The control stream stays open with the connection.
        let attack = partial_frames(
            &target,
            "edge-hostile",
            "blazeface",
            32,
            declared,
            declared - 1,
        );
        tokio::time::timeout(WAIT, attack)
            .await
            .expect("in time")
            .expect("welcome, and the camera accepted")
    });
    let until = Instant::now() + WAIT;
    while !done() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(200));
    }
    conn.close(0u32.into(), b"attack over");
    drop(rt);
    peak.max()
}

/// Partly sent frames from one logged-in edge with a camera open, beside a
/// legitimate edge:
///
/// - 32 streams declaring 40 MiB each, far more than a BlazeFace camera's
///   largest frame: every one is refused from its header (`too_large`),
///   and none takes room in the budget;
/// - 32 streams declaring that largest frame (its input, four times over
///   for a worst-case JPEG, plus a file's headers) into an edge budget of
///   four of them: four fit, the others are refused from their headers
///   (`memory_budget`), and each one that fitted is reset when its read
///   timeout passes (`read_timeout`).
///
/// The gateway's memory stays within its baseline plus the edge's budget
/// and the attacker's QUIC connection window (sized to its camera's
/// frames), comes back once the attack is
/// over (within twice its baseline), and the legitimate edge's cameras are
/// served throughout.
#[test]
fn partly_sent_frames_hold_no_more_than_their_cameras_can_send_and_the_edges_budget() {
    let _serial = serial();
    let input = InputSpec {
        width: 128,
        height: 128,
        channels: 3,
        dtype: DType::U8,
        layout: Layout::Nhwc,
        color: ColorOrder::Rgb,
        resize: Resize::Letterbox,
    };
    let largest = Frame::max_body_len(input.max_frame_payload(), &Limits::default());
    let edge_budget = 4 * largest as u64;
    let c = cluster(&format!(
        "edge_inflight_bytes = {edge_budget}\ninflight_bytes_total = {}\nframe_read_timeout_ms = 3000\n",
        2 * edge_budget
    ));
    let served = tidegate_loadtest::attack::worker::model_as_registered(&c, "blazeface", 1)
        .expect("blazeface registered");
    assert_eq!(
        served.input.raw_frame_bytes(),
        input.raw_frame_bytes(),
        "{served:?}"
    );
    let load = legitimate_load(&c, 10.0);
    std::thread::sleep(Duration::from_millis(1500));
    let baseline = rss(&c);

    let huge = 40 * MIB as usize;
    let peak_huge = partial_wave(&c, huge, || rejected(&c, "too_large") >= 32);
    let too_large = rejected(&c, "too_large");
    let (budget, timeout) = (rejected(&c, "memory_budget"), rejected(&c, "read_timeout"));
    assert_eq!(too_large, 32, "every 40 MiB frame refused from its header");
    assert_eq!((budget, timeout), (0, 0), "none took room in the budget");

    let peak_largest = partial_wave(&c, largest, || {
        rejected(&c, "memory_budget") + rejected(&c, "read_timeout") >= 32
    });
    let (budget, timeout) = (rejected(&c, "memory_budget"), rejected(&c, "read_timeout"));
    let report = load.join().expect("the legitimate load's thread");
    eprintln!(
        "baseline {} MiB, peaks {} and {} MiB during the waves; {too_large} too large, {budget} refused, {timeout} timed out",
        baseline / MIB,
        peak_huge / MIB,
        peak_largest / MIB
    );
    // Four fit the budget at a time: the others are refused from their
    // headers, and each one that fitted is reset at its timeout.
    assert_eq!(
        budget + timeout,
        32,
        "{budget} refused, {timeout} timed out"
    );
    assert!(
        (1..=8).contains(&timeout) && budget >= 24,
        "{budget} refused, {timeout} timed out"
    );
    assert_eq!(
        rejected(&c, "too_large"),
        32,
        "a frame its camera can send is not too large"
    );
    // The attacker's connection window: room for its camera's frames.
    let window = u64::from(edge_receive_window(largest));
    let bound = baseline + edge_budget + window + SLACK;
    for peak in [peak_huge, peak_largest] {
        assert!(
            peak <= bound,
            "peak {} MiB over baseline {} MiB + budget {} MiB + window {} MiB + slack {} MiB",
            peak / MIB,
            baseline / MIB,
            edge_budget / MIB,
            window / MIB,
            SLACK / MIB
        );
    }
    assert_served(&report);
    // Given back: within twice the baseline, polled for at most 30 s.
    let until = Instant::now() + Duration::from_secs(30);
    let mut after = rss(&c);
    while after > 2 * baseline && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(250));
        after = rss(&c);
    }
    eprintln!("{} MiB after the attack", after / MIB);
    assert!(
        after <= 2 * baseline,
        "{} MiB after the attack, baseline {} MiB",
        after / MIB,
        baseline / MIB
    );
}

/// A frame sent a byte at a time is reset once `frame_read_timeout_ms`
/// has passed since its stream was accepted, and counted; the gateway does
/// not wait for the QUIC idle timeout, which the trickle keeps from firing.
#[test]
fn a_trickling_frame_stream_is_reset_after_its_read_timeout() {
    let _serial = serial();
    let c = cluster("frame_read_timeout_ms = 1000\n");
    let rt = runtime();
    let stopped = rt.block_on(async {
        let (conn, mut send, mut recv) = login(&c, "edge-hostile").await.expect("welcome");
        open_camera(&mut send, &mut recv, "trickle", "blazeface")
            .await
            .expect("the camera is accepted");
        // One byte every 100 ms of a frame its camera could send, until the
        // gateway stops the stream or `WAIT` passes.
        let every = Duration::from_millis(100);
        let bytes = (WAIT.as_millis() / every.as_millis()) as u64;
        trickle(&conn, 64 * 1024, every, bytes, &CancellationToken::new())
            .await
            .expect("a frame stream opens")
    });
    match stopped.stopped_with {
        Some(code) => assert_eq!(Some(code), Some(ErrorCode::Overloaded.quic_code())),
        None => panic!("the trickling stream was not stopped: {stopped:?}"),
    }
    assert_eq!(rejected(&c, "read_timeout"), 1);
}

/// Ten connections that never log in: they can open no unidirectional
/// stream (no credit before `Hello`), only `max_unauthenticated` = 4 of
/// them are let in at all (the other six refused as they arrive, and
/// counted), the four are closed at their Hello timeout, and the gateway's
/// memory stays within its baseline plus their small pre-login windows. The
/// legitimate edge, logged in before, is served throughout, and a new edge
/// logs in once the four are gone.
#[test]
fn connections_that_never_log_in_can_push_nothing_and_only_so_many_are_let_in() {
    let _serial = serial();
    let c = cluster("max_unauthenticated = 4\nhello_timeout_ms = 4000\n");
    let load = legitimate_load(&c, 8.0);
    std::thread::sleep(Duration::from_millis(1500));
    let baseline = rss(&c);
    let peak = peak(&c);
    let rt = runtime();
    let target = Target::of(&c);
    let got = rt.block_on(async {
        tokio::time::timeout(WAIT, strangers(&target, 10))
            .await
            .expect("the strangers end in time")
            .expect("each stranger is let in or refused")
    });
    let (connected, refused, pushed) = (got.connected, got.refused, got.pushed);
    let peak_rss = peak.max();
    drop(peak);
    eprintln!(
        "baseline {} MiB, peak {} MiB; {connected} let in, {refused} refused",
        baseline / MIB,
        peak_rss / MIB
    );
    assert_eq!((connected, refused), (4, 6));
    assert_eq!(pushed, 0, "no stranger opened a unidirectional stream");
    assert_eq!(
        counter(
            &c,
            "tidegate_quic_connections_refused_total{reason=\"unauthenticated\"}"
        ),
        6
    );
    let bound = baseline + 10 * u64::from(BEFORE_LOGIN_RECEIVE_WINDOW) + SLACK / 4;
    assert!(
        peak_rss <= bound,
        "peak {} MiB over baseline {} MiB + 12 MiB",
        peak_rss / MIB,
        baseline / MIB
    );
    // The strangers have gone: an edge logs in again.
    rt.block_on(async {
        let (conn, _, _) = tokio::time::timeout(WAIT, login(&c, "edge-2"))
            .await
            .expect("in time")
            .expect("welcome once the strangers are gone");
        conn.close(0u32.into(), b"done");
    });
    assert_served(&load.join().expect("the legitimate load's thread"));
}

/// `max_connections_per_edge` = 2: an edge's third connection is refused
/// at login with a reason that names the limit, another edge is not, and
/// once one of the two has gone the edge logs in again.
#[test]
fn an_edge_past_its_connections_is_refused_with_the_limit_named() {
    let _serial = serial();
    let c = cluster("max_connections_per_edge = 2\n");
    let rt = runtime();
    rt.block_on(async {
        tokio::time::timeout(WAIT, async {
            let (first, _s1, _r1) = login(&c, "edge-hostile").await.expect("first");
            let (_second, _s2, _r2) = login(&c, "edge-hostile").await.expect("second");
            match login(&c, "edge-hostile").await {
                Err(AttackError::Login {
                    source: HandshakeError::Refused { code, message },
                    ..
                }) => {
                    assert_eq!(code, ErrorCode::Overloaded, "{message}");
                    assert!(message.contains("max_connections_per_edge"), "{message}");
                    assert!(message.contains("edge-hostile"), "{message}");
                }
                other => panic!("a third connection: {:?}", other.map(|_| "welcome")),
            }
            let (_other, _s, _r) = login(&c, "edge-2").await.expect("another edge");
            first.close(0u32.into(), b"making room");
            // The gateway sees the close within a round trip; poll.
            let until = Instant::now() + Duration::from_secs(10);
            loop {
                match login(&c, "edge-hostile").await {
                    Ok(_) => break,
                    Err(e) if Instant::now() < until => {
                        let _ = e;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(e) => panic!("no room after a connection closed: {e}"),
                }
            }
        })
        .await
        .expect("in time")
    });
    let refused = counter(
        &c,
        "tidegate_quic_connections_refused_total{reason=\"edge_connections\"}",
    );
    assert!(refused >= 1, "{refused} counted");
}

/// `max_cameras_per_edge` = 3 over two connections of one edge: the
/// fourth distinct camera is refused (naming the camera and the limit), a
/// camera open on the other connection is no new camera, and the cameras
/// of a connection that ends are counted out.
#[test]
fn an_edges_cameras_are_capped_over_all_its_connections() {
    let _serial = serial();
    let c = cluster("max_cameras_per_edge = 3\n");
    let rt = runtime();
    rt.block_on(async {
        tokio::time::timeout(WAIT, async {
            let (a, mut a_send, mut a_recv) = login(&c, "edge-hostile").await.expect("a");
            let (_b, mut b_send, mut b_recv) = login(&c, "edge-hostile").await.expect("b");
            let ask =
                async |send: &mut quinn::SendStream, recv: &mut quinn::RecvStream, camera: &str| {
                    ask_camera(send, recv, camera_open(camera, "blazeface"))
                        .await
                        .unwrap()
                };
            for cam in ["cam-0", "cam-1"] {
                let m = ask(&mut a_send, &mut a_recv, cam).await;
                assert!(matches!(m, Message::CameraAccepted(_)), "{cam}: {m:?}");
            }
            let m = ask(&mut b_send, &mut b_recv, "cam-2").await;
            assert!(matches!(m, Message::CameraAccepted(_)), "cam-2: {m:?}");
            match ask(&mut b_send, &mut b_recv, "cam-3").await {
                Message::Error(e) => {
                    assert_eq!(e.code, ErrorCode::Overloaded, "{e:?}");
                    assert!(e.message.contains("cam-3"), "{e:?}");
                    assert!(e.message.contains("max_cameras_per_edge"), "{e:?}");
                }
                other => panic!("a fourth camera: {other:?}"),
            }
            let m = ask(&mut b_send, &mut b_recv, "cam-0").await;
            assert!(
                matches!(m, Message::CameraAccepted(_)),
                "cam-0 again: {m:?}"
            );
            // a's cameras go with it (cam-1; cam-0 stays open on b).
            a.close(0u32.into(), b"making room");
            let until = Instant::now() + Duration::from_secs(10);
            loop {
                match ask(&mut b_send, &mut b_recv, "cam-3").await {
                    Message::CameraAccepted(_) => break,
                    Message::Error(e) if Instant::now() < until => {
                        let _ = e;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    other => panic!("cam-3 after a closed: {other:?}"),
                }
            }
        })
        .await
        .expect("in time")
    });
}
