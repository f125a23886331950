//! The walking skeleton, end to end: real gateway, worker and edge processes
//! on 127.0.0.1, BlazeFace on astronaut.png, and bad input at each hop.

use std::time::Duration;

use bytes::Bytes;
use tidegate_edge::uplink::{Incoming, Uplink, UplinkError};
use tidegate_loadtest::cluster::{Cluster, ClusterOptions, bin, metric_value, workspace_root};
use tidegate_loadtest::edge_harness::{EdgeCamera, edge_config};
use tidegate_loadtest::loadgen::frame_pixels;
use tidegate_protocol::{
    DType, ErrorCode, Frame, FrameResult, Kind, Layout, MAGIC, Status, Tensor, VERSION,
};
use tidegate_testkit::astronaut::{FACE, astronaut, started_cluster};

#[test]
fn astronaut_face_round_trips_through_edge_gateway_and_worker() {
    let c = started_cluster();
    let uri = format!("image://{}", astronaut().display());
    let cfg = edge_config(
        &c,
        "edge-1",
        &[EdgeCamera::new("astronaut", &uri, "blazeface", 10.0)],
    )
    .unwrap();
    let out = c.run_edge(&cfg, &["--max-frames", "12"]).unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "edge failed: {stderr}");
    assert!(
        stderr.contains("summary: sent=12 results=12 ok=12"),
        "every frame sent must get a result: {stderr}"
    );
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("each stdout line is JSON"))
        .collect();
    assert_eq!(lines.len(), 12);
    let mut seqs: Vec<u64> = lines.iter().map(|l| l["seq"].as_u64().unwrap()).collect();
    seqs.sort_unstable();
    seqs.dedup();
    assert_eq!(seqs.len(), 12, "one result per frame");
    for l in &lines {
        assert_eq!(l["status"], "ok", "{l}");
        assert_eq!(l["camera"], "astronaut");
        let e2e = l["e2e_ms"].as_f64().expect("e2e latency reported");
        assert!(e2e > 0.0, "{l}");
        let dets = l["detections"].as_array().unwrap();
        assert_eq!(dets.len(), 1, "exactly one face: {l}");
        let d = &dets[0];
        assert!(d["score"].as_f64().unwrap() > 0.8, "{d}");
        // Named by the model's labels, which travel in CameraAccepted.
        assert_eq!(d["label"], "face", "{d}");
        for (k, want) in ["x1", "y1", "x2", "y2"].iter().zip(FACE) {
            let got = d[*k].as_f64().unwrap();
            assert!((got - want).abs() <= 10.0, "{k}: {got} vs {want}");
        }
        assert_eq!(d["keypoints"].as_array().unwrap().len(), 6);
    }
    // The gateway counted them, and got the edge's latency reports.
    let (status, metrics) = c.get("/metrics").unwrap();
    assert_eq!(status, 200);
    assert!(
        metrics.contains("tidegate_frames_total{model=\"blazeface\",status=\"ok\"} 12"),
        "{metrics}"
    );
    let (_, frames) = c.get("/api/v1/frames").unwrap();
    let f: serde_json::Value = serde_json::from_str(&frames).unwrap();
    assert_eq!(f["admitted"], 12);
    assert_eq!(f["ok"], 12);
}

/// BlazeFace with the `raw` decoder, returning its two score outputs (the
/// logit of a face at each of the 896 anchors) instead of detections.
const RAW_SCORES_TOML: &str = r#"
name = "blazeface-scores"
version = 1
file = "model.onnx"
max_batch = 8
[input]
name = "input:0"
layout = "nhwc"
width = 128
height = 128
channels = 3
color = "rgb"
resize = "letterbox"
model_dtype = "f32"
[input.normalize]
scale = 1.0
mean = [127.5, 127.5, 127.5]
std = [127.5, 127.5, 127.5]
[[outputs]]
name = "Identity:0"
shape = [-1, 512, 1]
[[outputs]]
name = "Identity_1:0"
shape = [-1, 384, 1]
[decoder]
kind = "raw"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_model_outputs_travel_from_the_worker_to_the_edge() {
    let mut c = Cluster::start(&ClusterOptions::default()).expect("gateway starts");
    let repo = tempfile::tempdir().unwrap();
    let model = repo.path().join("blazeface-scores");
    std::fs::create_dir(&model).unwrap();
    std::os::unix::fs::symlink(
        workspace_root().join("models/blazeface/model.onnx"),
        model.join("model.onnx"),
    )
    .unwrap();
    std::fs::write(model.join("model.toml"), RAW_SCORES_TOML).unwrap();
    c.spawn_worker_serving("worker-1", repo.path(), &["blazeface-scores"])
        .expect("worker starts");
    c.wait_for_workers(1, Duration::from_secs(60))
        .expect("worker registers");

    let (up, mut rx) = connect(&c).await;
    let accepted = up
        .open_camera(
            "cam",
            "blazeface-scores",
            80,
            tidegate_protocol::Encoding::Raw,
        )
        .await
        .unwrap();
    assert!(accepted.labels.is_empty(), "a raw model has no labels");
    let input = accepted.input;
    // The astronaut, then a black frame of the same geometry.
    let (pixels, geometry) = frame_pixels(&input, Some(astronaut().as_path())).unwrap();
    let black = Bytes::from(vec![0u8; pixels.len()]);
    let mut best = Vec::new();
    for (seq, data) in [(1, pixels), (2, black)] {
        let mut f = frame(seq, input.frame_shape(), data, geometry);
        f.model = "blazeface-scores".into();
        up.send_frame(f).await.unwrap();
        let r = next_result(&mut rx).await;
        assert_eq!((r.seq, &r.status), (seq, &Status::Ok), "{r:?}");
        assert!(r.detections.is_empty());
        let shapes: Vec<(&str, &[u32])> = r
            .outputs
            .iter()
            .map(|o| (o.name.as_str(), o.shape.as_slice()))
            .collect();
        assert_eq!(
            shapes,
            [
                ("Identity:0", &[1, 512, 1][..]),
                ("Identity_1:0", &[1, 384, 1][..])
            ]
        );
        let logit = r
            .outputs
            .iter()
            .flat_map(|o| o.values())
            .fold(f32::NEG_INFINITY, f32::max);
        best.push(1.0 / (1.0 + (-logit).exp()));
    }
    // Real model outputs: a face scores above the detector's 0.75
    // threshold somewhere on the astronaut, nowhere on black.
    assert!(
        best[0] > 0.75 && best[1] < 0.5,
        "best anchor scores {best:?}"
    );
}

async fn connect(c: &Cluster) -> (Uplink, tidegate_protocol::queue::Receiver<Incoming>) {
    Uplink::connect(
        &c.quic.into(),
        "localhost",
        &c.ca(),
        "edge-1",
        &c.edge_token,
    )
    .await
    .expect("edge connects")
}

async fn next_result(rx: &mut tidegate_protocol::queue::Receiver<Incoming>) -> FrameResult {
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("a result within 10 s")
            .expect("uplink open");
        if let Incoming::Result(r) = msg {
            return r;
        }
    }
}

fn frame(seq: u64, shape: Vec<u32>, data: Bytes, geometry: tidegate_protocol::Geometry) -> Frame {
    Frame {
        camera: "cam".into(),
        seq,
        captured_at_us: tidegate_edge::clock::now_us(),
        budget_us: 5_000_000,
        model: "blazeface".into(),
        geometry,
        tensor: Tensor::raw(DType::U8, Layout::Nhwc, shape, data),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_shape_frame_fails_naming_both_shapes_and_worker_keeps_serving() {
    let c = started_cluster();
    let (up, mut rx) = connect(&c).await;
    let input = up
        .open_camera("cam", "blazeface", 80, tidegate_protocol::Encoding::Raw)
        .await
        .unwrap()
        .input;
    let (pixels, geometry) = frame_pixels(&input, Some(astronaut().as_path())).unwrap();

    up.send_frame(frame(
        1,
        vec![1, 64, 64, 3],
        Bytes::from(vec![0u8; 64 * 64 * 3]),
        geometry,
    ))
    .await
    .unwrap();
    let r = next_result(&mut rx).await;
    let Status::Failed(reason) = &r.status else {
        panic!("expected failed, got {r:?}");
    };
    assert!(
        reason.contains("[1,128,128,3]") && reason.contains("[1,64,64,3]"),
        "{reason}"
    );

    up.send_frame(frame(2, input.frame_shape(), pixels, geometry))
        .await
        .unwrap();
    let r = next_result(&mut rx).await;
    assert_eq!((r.seq, &r.status), (2, &Status::Ok));
    assert_eq!(r.detections.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_and_oversized_streams_close_only_that_stream() {
    let c = started_cluster();
    let (up, mut rx) = connect(&c).await;
    let input = up
        .open_camera("cam", "blazeface", 80, tidegate_protocol::Encoding::Raw)
        .await
        .unwrap()
        .input;
    let (pixels, geometry) = frame_pixels(&input, Some(astronaut().as_path())).unwrap();

    // A Frame whose header promises 1000 body bytes, then only 10.
    let mut truncated = [&MAGIC[..], &[VERSION, Kind::Frame as u8]].concat();
    truncated.extend_from_slice(&1000u32.to_be_bytes());
    truncated.extend_from_slice(&[0u8; 10]);
    up.send_raw(&truncated).await.unwrap();
    // A Frame whose header claims a 4 GB body: refused from the header alone.
    let mut oversized = [&MAGIC[..], &[VERSION, Kind::Frame as u8]].concat();
    oversized.extend_from_slice(&u32::MAX.to_be_bytes());
    up.send_raw(&oversized).await.unwrap();
    // A BatchResult (a worker's kind) promising 60 MiB on a frame stream:
    // refused from its header, before the gateway reads its body.
    let mut wrong_kind = [&MAGIC[..], &[VERSION, Kind::BatchResult as u8]].concat();
    wrong_kind.extend_from_slice(&(60u32 << 20).to_be_bytes());
    up.send_raw(&wrong_kind).await.unwrap();

    // The same connection keeps working.
    up.send_frame(frame(3, input.frame_shape(), pixels, geometry))
        .await
        .unwrap();
    let r = next_result(&mut rx).await;
    assert_eq!((r.seq, &r.status), (3, &Status::Ok));

    let log = c.gateway_log();
    assert!(
        log.contains("bad frame stream closed: stream ended after 18 of 1008 bytes"),
        "truncation is logged clearly: {log}"
    );
    assert!(
        log.contains("exceeds the limit"),
        "oversize is logged clearly: {log}"
    );
    assert!(
        log.contains("bad frame stream closed: expected Frame, got BatchResult"),
        "a wrong kind is refused from its header: {log}"
    );
    let (_, metrics) = c.get("/metrics").unwrap();
    assert!(
        metrics.contains("tidegate_frames_rejected_total{reason=\"malformed\"} 3"),
        "{metrics}"
    );
}

/// Before login the gateway reads a `Hello` and nothing else: a stranger
/// whose first message is a header promising a 60 MiB `BatchResult` is
/// refused as soon as the header is in, not after the body or the Hello
/// timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_message_other_than_hello_is_refused_from_its_header() {
    use tidegate_protocol::Message;
    use tidegate_protocol::quic::{client_config, dial, read_message};
    let c = started_cluster();
    let conn = dial(c.quic, "localhost", client_config(&c.ca()).unwrap())
        .await
        .expect("dial");
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let mut header = [&MAGIC[..], &[VERSION, Kind::BatchResult as u8]].concat();
    header.extend_from_slice(&(60u32 << 20).to_be_bytes());
    send.write_all(&header).await.unwrap();
    // The stream stays open: the gateway has nothing more to wait for.
    let reply = tokio::time::timeout(
        Duration::from_secs(3),
        read_message(&mut recv, &Default::default()),
    )
    .await
    .expect("an answer before the 5 s Hello timeout");
    let Ok(Some(Message::Error(e))) = reply else {
        panic!("expected an Error message, got {reply:?}");
    };
    assert_eq!(e.code, ErrorCode::Malformed);
    assert!(
        e.message.contains("expected Hello, got BatchResult"),
        "{}",
        e.message
    );
    conn.close(0u32.into(), b"test done");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edge_with_wrong_token_is_refused_with_a_reason() {
    let c = started_cluster();
    let err = Uplink::connect(
        &c.quic.into(),
        "localhost",
        &c.ca(),
        "edge-1",
        "not-the-token",
    )
    .await
    .expect_err("a wrong token is refused");
    let UplinkError::Refused { code, message } = &err else {
        panic!("expected a refusal, got {err}");
    };
    assert_eq!(*code, ErrorCode::Unauthorized);
    assert!(message.contains("wrong token"), "{message}");
    // The right token still works.
    let (up, _rx) = connect(&c).await;
    up.open_camera("cam", "blazeface", 80, tidegate_protocol::Encoding::Raw)
        .await
        .unwrap();
}

/// Runs the worker with `args` against a config in `dir`; returns stderr.
fn worker_failure(dir: &std::path::Path, models: &std::path::Path, extra: &[&str]) -> String {
    let cfg = dir.join("w.toml");
    std::fs::write(
        &cfg,
        format!(
            "name = \"w\"\ntoken = \"t\"\n[gateway]\naddr = \"127.0.0.1:9\"\nca = \"ca.pem\"\n[models]\ndir = \"{}\"\n",
            models.display()
        ),
    )
    .unwrap();
    let out = std::process::Command::new(bin("tidegate-worker").unwrap())
        .arg("--config")
        .arg(&cfg)
        .args(extra)
        .env("TIDEGATE_LOG", "off")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert_eq!(out.status.code(), Some(1));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn missing_onnx_runtime_or_model_file_is_a_one_line_error_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let models = workspace_root().join("models");

    let err = worker_failure(
        dir.path(),
        &models,
        &["--ort-lib", "/nonexistent/libonnxruntime.so"],
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.contains("make setup") || err.contains("ORT_DYLIB_PATH"),
        "{err}"
    );

    // A repository whose model.toml points at a file that is not there.
    let repo = dir.path().join("repo");
    std::fs::create_dir_all(repo.join("blazeface")).unwrap();
    std::fs::copy(
        models.join("blazeface/model.toml"),
        repo.join("blazeface/model.toml"),
    )
    .unwrap();
    let err = worker_failure(dir.path(), &repo, &[]);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.contains("blazeface") && err.contains("make setup"),
        "{err}"
    );
}

/// An edge that stops taking its result streams costs the gateway at most
/// 1024 results being written and 1024 queued: what follows is dropped and
/// counted as undeliverable, not held in a task per result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_an_edge_does_not_take_are_dropped_and_counted_not_piled_up() {
    use std::sync::Arc;
    use tidegate_protocol::quic::{client_config, dial, handshake, read_answer, write_message};
    use tidegate_protocol::{CameraOpen, Hello, Limits, Message, Role};
    let c = started_cluster();
    let mut config = client_config(&c.ca()).unwrap();
    let mut transport = quinn::TransportConfig::default();
    // The gateway may open no stream to us: every result write waits.
    transport.max_concurrent_uni_streams(0u32.into());
    transport.keep_alive_interval(Some(Duration::from_secs(2)));
    config.transport_config(Arc::new(transport));
    let conn = dial(c.quic, "localhost", config).await.expect("dial");
    let hello = Hello {
        role: Role::Edge,
        name: "edge-1".into(),
        token: c.edge_token.clone(),
    };
    let (mut ctl_send, mut ctl_recv, _) = handshake(&conn, hello, &Limits::default())
        .await
        .expect("welcome");
    let open = CameraOpen {
        camera: "cam".into(),
        model: "blazeface".into(),
        budget_ms: 80,
        encoding: tidegate_protocol::Encoding::Raw,
        copies: 1,
    };
    write_message(&mut ctl_send, &Message::CameraOpen(open))
        .await
        .unwrap();
    let accepted = read_answer(&mut ctl_recv, &Limits::default()).await;
    let Ok(Some(Message::CameraAccepted(accepted))) = accepted else {
        panic!("expected CameraAccepted, got {accepted:?}");
    };
    let shape = accepted.input.frame_shape();
    let (pixels, geometry) = frame_pixels(&accepted.input, Some(astronaut().as_path())).unwrap();

    // Every frame ends in a result (most are superseded by the next one).
    const SENT: u64 = 2048 + 200;
    for seq in 1..=SENT {
        let mut s = conn.open_uni().await.unwrap();
        let f = frame(seq, shape.clone(), pixels.clone(), geometry);
        write_message(&mut s, &Message::Frame(f)).await.unwrap();
        s.finish().unwrap();
    }
    let undeliverable = || {
        let (_, metrics) = c.get("/metrics").unwrap();
        metric_value(&metrics, "tidegate_results_undeliverable_total").unwrap_or(0.0)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while undeliverable() < 200.0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(undeliverable(), 200.0, "all beyond 2 × 1024 are dropped");
    conn.close(0u32.into(), b"test done");
}

/// A camera must have a name (an empty one in a hint means every camera of
/// the edge), and one edge connection opens at most
/// `MAX_CAMERAS_PER_EDGE`: each refusal is an `Error` answering that
/// `CameraOpen` only, the control stream stays open, and a camera already
/// open may be opened again. A worker may register only under the name it
/// authenticated with, which the API shows and an operator drains by.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nameless_cameras_cameras_past_the_limit_and_workers_under_another_name_are_refused() {
    use tidegate_gateway::server::MAX_CAMERAS_PER_EDGE;
    use tidegate_protocol::quic::{
        client_config, dial, handshake, read_answer, read_message, write_message,
    };
    use tidegate_protocol::{CameraOpen, Hello, Limits, Message, Register, Role};
    let mut c = Cluster::start(&ClusterOptions {
        workers: vec!["worker-1".into(), "worker-2".into()],
        ..ClusterOptions::default()
    })
    .expect("gateway starts");
    c.spawn_worker("worker-1").expect("worker starts");
    c.wait_for_workers(1, Duration::from_secs(60))
        .expect("worker registers");
    let limits = Limits::default();
    let conn = dial(c.quic, "localhost", client_config(&c.ca()).unwrap())
        .await
        .expect("dial");
    let hello = Hello {
        role: Role::Edge,
        name: "edge-1".into(),
        token: c.edge_token.clone(),
    };
    let (mut ctl_send, mut ctl_recv, _) = handshake(&conn, hello, &limits).await.expect("welcome");
    let open = |camera: String| {
        Message::CameraOpen(CameraOpen {
            camera,
            model: "blazeface".into(),
            budget_ms: 80,
            encoding: tidegate_protocol::Encoding::Raw,
            copies: 1,
        })
    };
    write_message(&mut ctl_send, &open(String::new()))
        .await
        .unwrap();
    match read_answer(&mut ctl_recv, &limits).await {
        Ok(Some(Message::Error(e))) => {
            assert_eq!(e.code, ErrorCode::Malformed, "{e:?}");
            assert!(e.message.contains("must not be empty"), "{e:?}");
        }
        other => panic!("expected an Error, got {other:?}"),
    }
    // the limit, pipelined: the gateway answers in order
    for i in 0..MAX_CAMERAS_PER_EDGE {
        write_message(&mut ctl_send, &open(format!("cam-{i}")))
            .await
            .unwrap();
    }
    for i in 0..MAX_CAMERAS_PER_EDGE {
        match read_answer(&mut ctl_recv, &limits).await {
            Ok(Some(Message::CameraAccepted(a))) => assert_eq!(a.camera, format!("cam-{i}")),
            other => panic!("camera {i}: expected CameraAccepted, got {other:?}"),
        }
    }
    write_message(&mut ctl_send, &open("one-too-many".into()))
        .await
        .unwrap();
    match read_answer(&mut ctl_recv, &limits).await {
        Ok(Some(Message::Error(e))) => {
            assert_eq!(e.code, ErrorCode::Overloaded, "{e:?}");
            assert!(e.message.contains("one-too-many"), "{e:?}");
        }
        other => panic!("expected an Error, got {other:?}"),
    }
    write_message(&mut ctl_send, &open("cam-0".into()))
        .await
        .unwrap();
    match read_answer(&mut ctl_recv, &limits).await {
        Ok(Some(Message::CameraAccepted(a))) => assert_eq!(a.camera, "cam-0"),
        other => panic!("re-opening cam-0: expected CameraAccepted, got {other:?}"),
    }
    let (_, cameras) = c.get("/api/v1/cameras").unwrap();
    let listed: serde_json::Value = serde_json::from_str(&cameras).unwrap();
    assert_eq!(
        listed.as_array().map(Vec::len),
        Some(MAX_CAMERAS_PER_EDGE),
        "{cameras:.300}"
    );
    conn.close(0u32.into(), b"test done");

    // worker-2 authenticates, then registers as worker-1
    let conn = dial(c.quic, "localhost", client_config(&c.ca()).unwrap())
        .await
        .expect("dial");
    let hello = Hello {
        role: Role::Worker,
        name: "worker-2".into(),
        token: c.worker_token().to_string(),
    };
    let (mut ctl_send, mut ctl_recv, _) = handshake(&conn, hello, &limits).await.expect("welcome");
    let register = Register {
        worker: "worker-1".into(),
        device: "cpu".into(),
        models: Vec::new(),
        profile: Vec::new(),
        codecs: Vec::new(),
    };
    write_message(&mut ctl_send, &Message::Register(register))
        .await
        .unwrap();
    match read_message(&mut ctl_recv, &limits).await {
        Ok(Some(Message::Error(e))) => {
            assert_eq!(e.code, ErrorCode::Unauthorized, "{e:?}");
            assert!(e.message.contains("registered as 'worker-1'"), "{e:?}");
        }
        other => panic!("expected an Error, got {other:?}"),
    }
    // still one worker, the real worker-1
    let (_, workers) = c.get("/api/v1/workers").unwrap();
    let workers: serde_json::Value = serde_json::from_str(&workers).unwrap();
    assert_eq!(workers.as_array().map(Vec::len), Some(1), "{workers}");
}
