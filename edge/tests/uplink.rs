//! The uplink and the node against a minimal in-process gateway (real QUIC,
//! real protocol, on 127.0.0.1): stale frames are reset instead of sent,
//! hints change the frame rate live, and a dropped connection is redialled
//! with every camera re-opened. Every wait is bounded.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tidegate_edge::uplink::{LaneStats, Uplink};
use tidegate_protocol::quic::{read_message, write_message};
use tidegate_protocol::{
    CameraAccepted, ColorOrder, ControlHint, DType, Frame, Geometry, InputSpec, Layout, Limits,
    Message, Resize, Tensor, Welcome,
};
use tokio::sync::{Notify, mpsc};

const WAIT: Duration = Duration::from_secs(20);

/// (camera, seq, captured_at_us) of each frame the gateway read whole.
type Frames = Arc<Mutex<Vec<(String, u64, u64)>>>;

/// Just enough gateway: welcomes anyone, accepts every camera at 64×64 RGB,
/// records whole frames, sends hints on demand, and can drop the connection.
struct FakeGateway {
    addr: SocketAddr,
    _dir: tempfile::TempDir,
    ca: std::path::PathBuf,
    frames: Frames,
    opens: Arc<Mutex<Vec<String>>>,
    hints: Arc<Mutex<Option<mpsc::UnboundedSender<ControlHint>>>>,
    kick: Arc<Notify>,
}

impl FakeGateway {
    fn start() -> FakeGateway {
        let dir = tempfile::tempdir().unwrap();
        let key = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let (ca, key_path) = (dir.path().join("ca.pem"), dir.path().join("key.pem"));
        std::fs::write(&ca, key.cert.pem()).unwrap();
        std::fs::write(&key_path, key.signing_key.serialize_pem()).unwrap();
        let config = tidegate_protocol::quic::server_config(&ca, &key_path).unwrap();
        let endpoint = quinn::Endpoint::server(config, "127.0.0.1:0".parse().unwrap()).unwrap();
        let gw = FakeGateway {
            addr: endpoint.local_addr().unwrap(),
            _dir: dir,
            ca,
            frames: Frames::default(),
            opens: Arc::default(),
            hints: Arc::default(),
            kick: Arc::new(Notify::new()),
        };
        let (frames, opens, hints, kick) = (
            gw.frames.clone(),
            gw.opens.clone(),
            gw.hints.clone(),
            gw.kick.clone(),
        );
        tokio::spawn(async move {
            while let Some(incoming) = endpoint.accept().await {
                let Ok(conn) = incoming.await else { continue };
                tokio::spawn(serve(
                    conn,
                    frames.clone(),
                    opens.clone(),
                    hints.clone(),
                    kick.clone(),
                ));
            }
        });
        gw
    }

    fn hint(&self, camera: &str, max_fps: f32) {
        let tx = self
            .hints
            .lock()
            .unwrap()
            .clone()
            .expect("an edge is connected");
        tx.send(ControlHint {
            camera: camera.into(),
            max_fps,
            motion_threshold: 0.0,
        })
        .unwrap();
    }

    fn frames(&self) -> Vec<(String, u64, u64)> {
        self.frames.lock().unwrap().clone()
    }
}

async fn serve(
    conn: quinn::Connection,
    frames: Frames,
    opens: Arc<Mutex<Vec<String>>>,
    hints: Arc<Mutex<Option<mpsc::UnboundedSender<ControlHint>>>>,
    kick: Arc<Notify>,
) {
    let limits = Limits::default();
    let Ok((mut send, mut recv)) = conn.accept_bi().await else {
        return;
    };
    let Ok(Some(Message::Hello(_))) = read_message(&mut recv, &limits).await else {
        return;
    };
    let welcome = Message::Welcome(Welcome {
        session: 1,
        heartbeat_ms: 1000,
    });
    if write_message(&mut send, &welcome).await.is_err() {
        return;
    }
    let (tx, mut hint_rx) = mpsc::unbounded_channel();
    *hints.lock().unwrap() = Some(tx);
    let uni = conn.clone();
    tokio::spawn(async move {
        while let Ok(mut r) = uni.accept_uni().await {
            let frames = frames.clone();
            tokio::spawn(async move {
                if let Ok(Some(Message::Frame(f))) = read_message(&mut r, &Limits::default()).await
                {
                    frames
                        .lock()
                        .unwrap()
                        .push((f.camera, f.seq, f.captured_at_us));
                }
            });
        }
    });
    loop {
        tokio::select! {
            msg = read_message(&mut recv, &limits) => match msg {
                Ok(Some(Message::CameraOpen(o))) => {
                    opens.lock().unwrap().push(o.camera.clone());
                    let accepted = Message::CameraAccepted(CameraAccepted {
                        camera: o.camera,
                        model: o.model,
                        input: InputSpec {
                            width: 64,
                            height: 64,
                            channels: 3,
                            dtype: DType::U8,
                            layout: Layout::Nhwc,
                            color: ColorOrder::Rgb,
                            resize: Resize::Stretch,
                        },
                        labels: vec!["face".into()],
                    });
                    if write_message(&mut send, &accepted).await.is_err() {
                        return;
                    }
                }
                Ok(Some(_)) => {}
                _ => return,
            },
            Some(h) = hint_rx.recv() => {
                if write_message(&mut send, &Message::ControlHint(h)).await.is_err() {
                    return;
                }
            }
            _ = kick.notified() => {
                conn.close(0u32.into(), b"kicked by the test");
                return;
            }
        }
    }
}

fn frame(seq: u64, bytes: usize) -> Frame {
    Frame {
        camera: "cam".into(),
        seq,
        captured_at_us: tidegate_edge::clock::now_us(),
        budget_us: 80_000,
        model: "m".into(),
        geometry: Geometry::stretch(64, 64, 64, 64),
        tensor: Tensor {
            dtype: DType::U8,
            layout: Layout::Nhwc,
            shape: vec![1, 1, (bytes / 3) as u32, 3],
            data: Bytes::from(vec![7u8; bytes / 3 * 3]),
        },
    }
}

/// The seqs the gateway read, once it has read `seq` (bounded), plus a
/// moment for anything that should not arrive to show up.
async fn seqs_once_seen(gw: &FakeGateway, seq: u64) -> Vec<u64> {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !gw.frames().iter().any(|f| f.1 == seq) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the gateway never read frame {seq}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    gw.frames().iter().map(|f| f.1).collect()
}

async fn connect(gw: &FakeGateway) -> Uplink {
    Uplink::connect(gw.addr, "localhost", &gw.ca, "edge-1", "token")
        .await
        .expect("edge connects")
        .0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn newer_frame_supersedes_an_unacknowledged_one_which_is_reset_not_sent() {
    let gw = FakeGateway::start();
    let up = connect(&gw).await;
    let stats = Arc::new(LaneStats::default());
    let lane = up.lane("cam", 1, stats.clone());
    let far = tokio::time::Instant::now() + WAIT;
    // 4 MB cannot be acknowledged before the next frame is handed over: it
    // takes many round trips of congestion window to send.
    lane.send(frame(1, 4_000_000), far).await.unwrap();
    lane.send(frame(2, 12_288), far).await.unwrap();
    lane.settle(WAIT).await;
    let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(load(&stats.superseded), 1);
    assert_eq!(load(&stats.delivered), 1);
    assert_eq!(lane.in_flight(), 0);
    let seqs = seqs_once_seen(&gw, 2).await;
    assert_eq!(seqs, vec![2], "the superseded frame must not arrive");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frame_past_its_deadline_is_reset_and_never_arrives() {
    let gw = FakeGateway::start();
    let up = connect(&gw).await;
    let stats = Arc::new(LaneStats::default());
    let lane = up.lane("cam", 4, stats.clone());
    let now = tokio::time::Instant::now();
    lane.send(frame(1, 12_288), now - Duration::from_millis(1))
        .await
        .unwrap();
    lane.send(frame(2, 12_288), now + WAIT).await.unwrap();
    lane.settle(WAIT).await;
    let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(load(&stats.expired), 1);
    assert_eq!(load(&stats.delivered), 1);
    let seqs = seqs_once_seen(&gw, 2).await;
    assert_eq!(seqs, vec![2], "the expired frame must not arrive");
}

#[cfg(feature = "capture")]
mod node {
    use super::*;
    use tidegate_edge::config::EdgeConfig;
    use tidegate_edge::node::{NodeOptions, run};
    use tidegate_edge::sink::Sinks;

    /// Waits until `pred(frames)` holds.
    async fn until(gw: &FakeGateway, what: &str, pred: impl Fn(&[(String, u64, u64)]) -> bool) {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            if pred(&gw.frames()) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what}: not within {WAIT:?} ({} frames)",
                gw.frames().len()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Gaps between consecutive frames captured after `after_us`.
    fn gaps_after(frames: &[(String, u64, u64)], after_us: u64) -> Vec<u64> {
        let mut t: Vec<u64> = frames
            .iter()
            .map(|f| f.2)
            .filter(|&c| c > after_us)
            .collect();
        t.sort_unstable();
        t.windows(2).map(|w| w[1] - w[0]).collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hints_change_the_rate_live_and_a_reconnect_reopens_the_camera_without_them() {
        let gw = FakeGateway::start();
        let cfg: EdgeConfig = toml::from_str(&format!(
            "name = \"edge-1\"\ntoken = \"t\"\n[gateway]\naddr = \"{}\"\nca = \"{}\"\n\
             [[cameras]]\nname = \"cam\"\nuri = \"test://ball?width=320&height=240\"\nmodel = \"m\"\nmax_fps = 20\n",
            gw.addr,
            gw.ca.display()
        ))
        .unwrap();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let node = tokio::spawn(run(
            cfg,
            Sinks::default(),
            NodeOptions::default(),
            async move {
                let _ = stop_rx.await;
            },
        ));
        until(&gw, "frames at the configured rate", |f| f.len() >= 15).await;
        let start = gw.frames()[0].2;
        assert!(
            gaps_after(&gw.frames(), start).iter().any(|&g| g < 90_000),
            "a 20 fps camera should send frames less than 90 ms apart"
        );

        // The gateway asks every camera for at most 4 fps.
        gw.hint("", 4.0);
        let hinted = tidegate_edge::clock::now_us() + 300_000;
        until(&gw, "frames under the hint", |f| {
            f.iter().filter(|x| x.2 > hinted).count() >= 6
        })
        .await;
        let gaps = gaps_after(&gw.frames(), hinted);
        assert!(
            gaps.iter().all(|&g| g >= 120_000),
            "under a 4 fps cap frames came {gaps:?} µs apart"
        );

        // The connection drops: the edge redials, opens the camera again and
        // forgets the old session's hint.
        let opens_before = gw.opens.lock().unwrap().len();
        gw.kick.notify_one();
        let kicked = tidegate_edge::clock::now_us();
        until(&gw, "frames after the reconnect", |f| {
            f.iter().filter(|x| x.2 > kicked).count() >= 15
        })
        .await;
        assert!(gw.opens.lock().unwrap().len() > opens_before);
        assert!(
            gaps_after(&gw.frames(), kicked).iter().any(|&g| g < 90_000),
            "after the reconnect the old hint still applies"
        );

        stop_tx.send(()).unwrap();
        let summary = tokio::time::timeout(WAIT, node)
            .await
            .expect("node stops")
            .unwrap()
            .unwrap();
        let cam = &summary.cameras[0];
        assert_eq!(cam.max_fps, 20.0);
        assert!(cam.skipped_rate > 0, "{cam:?}");
        // The gateway read at least 36 whole frames; a frame or two around
        // the dropped connection may be read without the edge seeing the ack.
        assert!(cam.delivered >= 30, "{cam:?}");
    }
}
