//! Hand-written sample messages, one or more of every kind, shared by the
//! integration tests (the fuzz seed corpus and the worked examples are made
//! from them).

#![allow(dead_code)]

pub mod corpus;

use bytes::Bytes;
use tidegate_protocol::*;

/// A small u8 NHWC tensor whose bytes count up from `first`.
pub fn tensor_u8(shape: &[u32], first: u8) -> Tensor {
    let len = Tensor::expected_len(DType::U8, shape).unwrap();
    Tensor::raw(
        DType::U8,
        Layout::Nhwc,
        shape.to_vec(),
        (0..len).map(|i| first.wrapping_add(i as u8)).collect(),
    )
}

/// A tensor whose payload is `encoding`'s file of a `[1,h,w,3]` image (the
/// bytes here are a stand-in: the codec does not decode them).
pub fn tensor_encoded(h: u32, w: u32, encoding: Encoding, file: &'static [u8]) -> Tensor {
    Tensor {
        encoding,
        ..Tensor::raw(
            DType::U8,
            Layout::Nhwc,
            vec![1, h, w, 3],
            Bytes::from_static(file),
        )
    }
}

/// A small f32 NCHW tensor (payload little-endian, as on the wire).
pub fn tensor_f32(shape: &[u32]) -> Tensor {
    let n = Tensor::expected_len(DType::U8, shape).unwrap();
    let data: Vec<u8> = (0..n)
        .flat_map(|i| (i as f32 * 0.5).to_le_bytes())
        .collect();
    Tensor::raw(DType::F32, Layout::Nchw, shape.to_vec(), Bytes::from(data))
}

/// A small f32 output tensor named `name`.
pub fn output(name: &str, shape: &[u32]) -> OutputTensor {
    let n = Tensor::expected_len(DType::U8, shape).unwrap();
    let values: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 1.0).collect();
    OutputTensor::from_f32(name, shape.to_vec(), &values).unwrap()
}

pub fn input_spec() -> InputSpec {
    InputSpec {
        width: 128,
        height: 128,
        channels: 3,
        dtype: DType::U8,
        layout: Layout::Nhwc,
        color: ColorOrder::Rgb,
        resize: Resize::Letterbox,
    }
}

pub fn face(score: f32) -> Detection {
    Detection {
        x1: 10.5,
        y1: 20.25,
        x2: 110.0,
        y2: 140.75,
        score,
        class: 0,
        keypoints: vec![[30.0, 50.0], [80.0, 50.0], [55.0, 80.0]],
    }
}

pub fn timings() -> Timings {
    Timings {
        queue_us: 1200,
        decode_us: 150,
        preprocess_us: 300,
        inference_us: 4100,
        postprocess_us: 90,
    }
}

/// Every kind at least once, and the variants of every enum, each named
/// `kind-what`.
pub fn samples() -> Vec<(&'static str, Message)> {
    let geometry = Geometry::letterbox(1920, 1080, 4, 4);
    vec![
        (
            "hello-edge",
            Message::Hello(Hello {
                role: Role::Edge,
                name: "cam-node-1".into(),
                token: "s3cret".into(),
            }),
        ),
        (
            "hello-worker",
            Message::Hello(Hello {
                role: Role::Worker,
                name: "w1".into(),
                token: "lease-7f3a".into(),
            }),
        ),
        (
            "welcome",
            Message::Welcome(Welcome {
                session: 42,
                heartbeat_ms: 1000,
            }),
        ),
        (
            "error-unauthorized",
            Message::Error(ErrorMsg {
                code: ErrorCode::Unauthorized,
                message: "unknown edge 'cam-node-9'; add it to gateway.toml".into(),
            }),
        ),
        (
            "error-overloaded",
            Message::Error(ErrorMsg {
                code: ErrorCode::Overloaded,
                message: "too many cameras".into(),
            }),
        ),
        (
            "camera-open",
            Message::CameraOpen(CameraOpen {
                camera: "door".into(),
                model: "blazeface".into(),
                budget_ms: 80,
                encoding: Encoding::Raw,
                copies: 1,
            }),
        ),
        (
            "camera-open-jpeg",
            Message::CameraOpen(CameraOpen {
                camera: "gate".into(),
                model: "blazeface".into(),
                budget_ms: 80,
                encoding: Encoding::Jpeg { quality: 90 },
                copies: 2,
            }),
        ),
        (
            "camera-accepted",
            Message::CameraAccepted(CameraAccepted {
                camera: "door".into(),
                model: "blazeface".into(),
                input: input_spec(),
                labels: vec!["face".into()],
                encoding: Encoding::Raw,
                copies: 1,
            }),
        ),
        (
            "camera-accepted-png",
            Message::CameraAccepted(CameraAccepted {
                camera: "gate".into(),
                model: "blazeface".into(),
                input: input_spec(),
                labels: vec!["face".into()],
                encoding: Encoding::Png,
                copies: 2,
            }),
        ),
        (
            "frame-u8",
            Message::Frame(Frame {
                camera: "door".into(),
                seq: 7,
                captured_at_us: 1_700_000_000_000_000,
                budget_us: 80_000,
                model: "blazeface".into(),
                geometry,
                tensor: tensor_u8(&[1, 4, 4, 3], 0),
            }),
        ),
        (
            "frame-jpeg",
            Message::Frame(Frame {
                camera: "gate".into(),
                seq: 3,
                captured_at_us: 1_700_000_000_000_000,
                budget_us: 80_000,
                model: "blazeface".into(),
                geometry,
                tensor: tensor_encoded(
                    4,
                    4,
                    Encoding::Jpeg { quality: 90 },
                    b"\xff\xd8jpeg\xff\xd9",
                ),
            }),
        ),
        (
            "frame-f32",
            Message::Frame(Frame {
                camera: "yard".into(),
                seq: 8,
                captured_at_us: 5,
                budget_us: 1,
                model: "m".into(),
                geometry: Geometry::stretch(640, 480, 2, 2),
                tensor: tensor_f32(&[1, 1, 2, 2]),
            }),
        ),
        (
            "frame-empty-tensor",
            Message::Frame(Frame {
                camera: "c".into(),
                seq: 0,
                captured_at_us: 0,
                budget_us: 0,
                model: "m".into(),
                geometry: Geometry::stretch(0, 0, 0, 0),
                tensor: tensor_u8(&[0, 3], 0),
            }),
        ),
        (
            "result-ok",
            Message::Result(FrameResult {
                camera: "door".into(),
                seq: 7,
                captured_at_us: 1_700_000_000_000_000,
                status: Status::Ok,
                detections: vec![face(0.93), face(0.51)],
                timings: timings(),
                outputs: vec![],
            }),
        ),
        (
            "result-shed",
            Message::Result(FrameResult {
                camera: "door".into(),
                seq: 9,
                captured_at_us: 3,
                status: Status::Shed(ShedReason::WouldMissDeadline),
                detections: vec![],
                timings: Timings::default(),
                outputs: vec![],
            }),
        ),
        (
            "result-late-on-arrival",
            Message::Result(FrameResult {
                camera: "gate".into(),
                seq: 4,
                captured_at_us: 3,
                status: Status::Shed(ShedReason::LateOnArrival),
                detections: vec![],
                timings: Timings::default(),
                outputs: vec![],
            }),
        ),
        (
            "result-expired",
            Message::Result(FrameResult {
                camera: "door".into(),
                seq: 10,
                captured_at_us: 4,
                status: Status::Expired,
                detections: vec![],
                timings: timings(),
                outputs: vec![],
            }),
        ),
        (
            "result-failed",
            Message::Result(FrameResult {
                camera: "door".into(),
                seq: 11,
                captured_at_us: 5,
                status: Status::Failed("worker w1 lost".into()),
                detections: vec![],
                timings: Timings::default(),
                outputs: vec![],
            }),
        ),
        (
            "control-hint",
            Message::ControlHint(ControlHint {
                camera: String::new(),
                max_fps: 7.5,
                motion_threshold: 0.02,
            }),
        ),
        (
            "latency-report",
            Message::LatencyReport(LatencyReport {
                camera: "door".into(),
                seq: 7,
                e2e_us: 41_000,
            }),
        ),
        (
            "register",
            Message::Register(Register {
                worker: "w1".into(),
                device: "NVIDIA H200".into(),
                models: vec![
                    ModelInfo {
                        name: "blazeface".into(),
                        version: 1,
                        input: input_spec(),
                        max_batch: 32,
                        labels: vec!["face".into()],
                    },
                    ModelInfo {
                        name: "detr".into(),
                        version: 3,
                        input: InputSpec {
                            width: 640,
                            height: 480,
                            channels: 3,
                            dtype: DType::F32,
                            layout: Layout::Nchw,
                            color: ColorOrder::Bgr,
                            resize: Resize::Stretch,
                        },
                        max_batch: 8,
                        labels: vec![],
                    },
                ],
                profile: vec![
                    ProfilePoint {
                        model: "blazeface".into(),
                        batch: 1,
                        latency_us: 900,
                    },
                    ProfilePoint {
                        model: "blazeface".into(),
                        batch: 8,
                        latency_us: 2100,
                    },
                ],
                codecs: vec![Codec::Raw, Codec::Jpeg, Codec::Png],
            }),
        ),
        (
            "register-empty",
            Message::Register(Register {
                worker: "w2".into(),
                device: "cpu (2 threads)".into(),
                models: vec![],
                profile: vec![],
                codecs: vec![],
            }),
        ),
        (
            "heartbeat",
            Message::Heartbeat(Heartbeat {
                queue_depth: 3,
                utilization: 0.75,
            }),
        ),
        (
            "dispatch",
            Message::Dispatch(Dispatch {
                batch: 99,
                model: "blazeface".into(),
                items: vec![
                    DispatchItem {
                        id: 1,
                        camera: "door".into(),
                        seq: 7,
                        geometry,
                        tensor: tensor_u8(&[1, 2, 2, 3], 10),
                    },
                    DispatchItem {
                        id: 2,
                        camera: "yard".into(),
                        seq: 8,
                        geometry: Geometry::stretch(2, 2, 2, 2),
                        tensor: tensor_u8(&[1, 2, 2, 3], 100),
                    },
                    DispatchItem {
                        id: 3,
                        camera: "gate".into(),
                        seq: 3,
                        geometry,
                        tensor: tensor_encoded(2, 2, Encoding::Png, b"\x89PNG"),
                    },
                ],
            }),
        ),
        (
            "dispatch-empty",
            Message::Dispatch(Dispatch {
                batch: 100,
                model: "blazeface".into(),
                items: vec![],
            }),
        ),
        (
            "batch-result",
            Message::BatchResult(BatchResult {
                batch: 99,
                items: vec![
                    ItemResult {
                        id: 1,
                        status: Status::Ok,
                        detections: vec![face(0.88)],
                        timings: timings(),
                        outputs: vec![],
                    },
                    ItemResult {
                        id: 2,
                        status: Status::Failed("bad input".into()),
                        detections: vec![],
                        timings: Timings::default(),
                        outputs: vec![],
                    },
                ],
            }),
        ),
        (
            "result-outputs",
            Message::Result(FrameResult {
                camera: "door".into(),
                seq: 12,
                captured_at_us: 6,
                status: Status::Ok,
                detections: vec![],
                timings: timings(),
                outputs: vec![output("embedding", &[1, 4]), output("mask", &[1, 1, 2, 2])],
            }),
        ),
        (
            "batch-result-outputs",
            Message::BatchResult(BatchResult {
                batch: 100,
                items: vec![
                    ItemResult {
                        id: 3,
                        status: Status::Ok,
                        detections: vec![],
                        timings: timings(),
                        outputs: vec![output("embedding", &[1, 3])],
                    },
                    ItemResult {
                        id: 4,
                        status: Status::Failed("outputs too large".into()),
                        detections: vec![],
                        timings: Timings::default(),
                        outputs: vec![],
                    },
                    ItemResult {
                        id: 5,
                        status: Status::Ok,
                        detections: vec![],
                        timings: timings(),
                        outputs: vec![output("embedding", &[1, 3]), output("logits", &[1, 2])],
                    },
                ],
            }),
        ),
        (
            "drain",
            Message::Drain(Drain {
                deadline_ms: 30_000,
            }),
        ),
        (
            "clock-probe",
            Message::ClockProbe(ClockProbe {
                gateway_us: 123_456_789,
            }),
        ),
        (
            "clock-echo",
            Message::ClockEcho(ClockEcho {
                gateway_us: 123_456_789,
                edge_us: 1_700_000_000_000_000,
            }),
        ),
    ]
}

/// The encoding of `msg` as one buffer.
pub fn encode(msg: &Message) -> Bytes {
    let mut v = Vec::new();
    msg.encode(&mut v);
    Bytes::from(v)
}
