//! Property tests over random messages of every kind: the codec round-trips,
//! `to_chunks` is the same bytes as `encode`, every strict prefix is
//! `Incomplete` (consuming nothing, naming exactly the missing bytes),
//! messages decode back-to-back, and tensor payloads are not copied.
//! Then targeted tests of the limits and of each named error.

mod common;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use proptest::prelude::*;
use tidegate_protocol::codec::Writer;
use tidegate_protocol::fuzzing::{assert_zero_copy, payloads};
use tidegate_protocol::*;

// ---------------------------------------------------------------- strategies

/// Short strings, ASCII or any printable Unicode (well under the limit).
fn text() -> impl Strategy<Value = String> {
    prop_oneof!["[a-z0-9_-]{0,12}", "\\PC{0,16}"]
}

/// Finite f32s only: the decoder rejects NaN and infinities.
fn finite() -> impl Strategy<Value = f32> {
    prop_oneof![
        -2000.0f32..2000.0,
        Just(0.0f32),
        Just(-0.0f32),
        Just(f32::MAX),
        Just(f32::MIN),
        Just(f32::MIN_POSITIVE / 2.0),
        any::<f32>().prop_filter("finite", |v| v.is_finite()),
    ]
}

fn dtype() -> impl Strategy<Value = DType> {
    prop_oneof![Just(DType::U8), Just(DType::F32)]
}

fn layout() -> impl Strategy<Value = Layout> {
    prop_oneof![Just(Layout::Nhwc), Just(Layout::Nchw)]
}

/// A raw tensor with 1..=4 small dimensions (0 allowed) and exactly the
/// bytes its shape implies, random.
fn raw_tensor() -> impl Strategy<Value = Tensor> {
    (dtype(), layout(), prop::collection::vec(0u32..6, 1..=4)).prop_flat_map(
        |(dtype, layout, shape)| {
            let len = Tensor::expected_len(dtype, &shape).unwrap();
            prop::collection::vec(any::<u8>(), len)
                .prop_map(move |data| Tensor::raw(dtype, layout, shape.clone(), Bytes::from(data)))
        },
    )
}

/// Any encoding a tensor can travel in.
fn encoding() -> impl Strategy<Value = Encoding> {
    prop_oneof![
        Just(Encoding::Raw),
        Just(Encoding::Png),
        (1u8..=100).prop_map(|quality| Encoding::Jpeg { quality }),
    ]
}

/// An encoded image: `[1,H,W,C]` u8 NHWC, C 1 or 3, with 1 to 64 random
/// bytes standing in for the image file (the codec does not decode it).
fn encoded_tensor() -> impl Strategy<Value = Tensor> {
    (
        encoding().prop_filter("encoded", |e| *e != Encoding::Raw),
        1u32..2000,
        1u32..2000,
        prop_oneof![Just(1u32), Just(3u32)],
        prop::collection::vec(any::<u8>(), 1..64),
    )
        .prop_map(|(encoding, h, w, c, file)| Tensor {
            encoding,
            ..Tensor::raw(DType::U8, Layout::Nhwc, vec![1, h, w, c], Bytes::from(file))
        })
}

/// A raw or encoded tensor.
fn tensor() -> impl Strategy<Value = Tensor> {
    prop_oneof![3 => raw_tensor(), 1 => encoded_tensor()]
}

/// A named output tensor, like [`tensor`] but without a layout.
fn output() -> impl Strategy<Value = OutputTensor> {
    (text(), dtype(), prop::collection::vec(0u32..5, 1..=3)).prop_flat_map(
        |(name, dtype, shape)| {
            let len = Tensor::expected_len(dtype, &shape).unwrap();
            prop::collection::vec(any::<u8>(), len).prop_map(move |data| OutputTensor {
                name: name.clone(),
                dtype,
                shape: shape.clone(),
                data: Bytes::from(data),
            })
        },
    )
}

fn labels() -> impl Strategy<Value = Vec<String>> {
    prop::collection::vec(text(), 0..4)
}

fn geometry() -> impl Strategy<Value = Geometry> {
    any::<[u32; 6]>().prop_map(|g| Geometry {
        source_width: g[0],
        source_height: g[1],
        content_x: g[2],
        content_y: g[3],
        content_width: g[4],
        content_height: g[5],
    })
}

fn input_spec() -> impl Strategy<Value = InputSpec> {
    (
        any::<u32>(),
        any::<u32>(),
        any::<u8>(),
        dtype(),
        layout(),
        prop_oneof![Just(ColorOrder::Rgb), Just(ColorOrder::Bgr)],
        prop_oneof![Just(Resize::Stretch), Just(Resize::Letterbox)],
    )
        .prop_map(
            |(width, height, channels, dtype, layout, color, resize)| InputSpec {
                width,
                height,
                channels,
                dtype,
                layout,
                color,
                resize,
            },
        )
}

fn shed_reason() -> impl Strategy<Value = ShedReason> {
    prop_oneof![
        Just(ShedReason::Superseded),
        Just(ShedReason::WouldMissDeadline),
        Just(ShedReason::Overloaded),
        Just(ShedReason::NoWorker),
        Just(ShedReason::LateOnArrival),
        Just(ShedReason::EdgeGone),
    ]
}

fn status() -> impl Strategy<Value = Status> {
    prop_oneof![
        Just(Status::Ok),
        shed_reason().prop_map(Status::Shed),
        Just(Status::Expired),
        text().prop_map(Status::Failed),
    ]
}

/// Every known error code (wire values beyond the last read as `Internal`).
fn error_code() -> impl Strategy<Value = ErrorCode> {
    (0u16..16).prop_map(ErrorCode::from_code)
}

fn detection() -> impl Strategy<Value = Detection> {
    (
        [finite(), finite(), finite(), finite(), finite()],
        any::<u32>(),
        prop::collection::vec([finite(), finite()], 0..8),
    )
        .prop_map(|([x1, y1, x2, y2, score], class, keypoints)| Detection {
            x1,
            y1,
            x2,
            y2,
            score,
            class,
            keypoints,
        })
}

fn timings() -> impl Strategy<Value = Timings> {
    any::<[u32; 5]>().prop_map(|t| Timings {
        queue_us: t[0],
        decode_us: t[4],
        preprocess_us: t[1],
        inference_us: t[2],
        postprocess_us: t[3],
    })
}

type Outcome = (Status, Vec<Detection>, Timings, Vec<OutputTensor>);

fn outcome() -> impl Strategy<Value = Outcome> {
    (
        status(),
        prop::collection::vec(detection(), 0..4),
        timings(),
        prop::collection::vec(output(), 0..3),
    )
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        (
            prop_oneof![Just(Role::Edge), Just(Role::Worker)],
            text(),
            text()
        )
            .prop_map(|(role, name, token)| Message::Hello(Hello { role, name, token })),
        (any::<u64>(), any::<u32>()).prop_map(|(session, heartbeat_ms)| {
            Message::Welcome(Welcome {
                session,
                heartbeat_ms,
            })
        }),
        (error_code(), text())
            .prop_map(|(code, message)| Message::Error(ErrorMsg { code, message })),
        (text(), text(), any::<u32>(), encoding(), 1..=MAX_COPIES).prop_map(
            |(camera, model, budget_ms, encoding, copies)| {
                Message::CameraOpen(CameraOpen {
                    camera,
                    model,
                    budget_ms,
                    encoding,
                    copies,
                })
            }
        ),
        (
            text(),
            text(),
            input_spec(),
            labels(),
            encoding(),
            1..=MAX_COPIES
        )
            .prop_map(|(camera, model, input, labels, encoding, copies)| {
                Message::CameraAccepted(CameraAccepted {
                    camera,
                    model,
                    input,
                    labels,
                    encoding,
                    copies,
                })
            }),
        any::<u64>().prop_map(|gateway_us| Message::ClockProbe(ClockProbe { gateway_us })),
        any::<[u64; 2]>().prop_map(|[gateway_us, edge_us]| {
            Message::ClockEcho(ClockEcho {
                gateway_us,
                edge_us,
            })
        }),
        (
            text(),
            any::<[u64; 2]>(),
            any::<u32>(),
            text(),
            geometry(),
            tensor()
        )
            .prop_map(
                |(camera, [seq, captured_at_us], budget_us, model, geometry, tensor)| {
                    Message::Frame(Frame {
                        camera,
                        seq,
                        captured_at_us,
                        budget_us,
                        model,
                        geometry,
                        tensor,
                    })
                }
            ),
        (text(), any::<[u64; 2]>(), outcome()).prop_map(
            |(camera, [seq, captured_at_us], (status, detections, timings, outputs))| {
                Message::Result(FrameResult {
                    camera,
                    seq,
                    captured_at_us,
                    status,
                    detections,
                    timings,
                    outputs,
                })
            }
        ),
        (text(), finite(), finite()).prop_map(|(camera, max_fps, motion_threshold)| {
            Message::ControlHint(ControlHint {
                camera,
                max_fps,
                motion_threshold,
            })
        }),
        (text(), any::<u64>(), any::<u32>()).prop_map(|(camera, seq, e2e_us)| {
            Message::LatencyReport(LatencyReport {
                camera,
                seq,
                e2e_us,
            })
        }),
        (
            text(),
            text(),
            prop::collection::vec(
                (text(), any::<u32>(), input_spec(), 1u16..=256, labels()).prop_map(
                    |(name, version, input, max_batch, labels)| ModelInfo {
                        name,
                        version,
                        input,
                        max_batch,
                        labels,
                    }
                ),
                0..4
            ),
            prop::collection::vec(
                (text(), any::<u16>(), any::<u32>()).prop_map(|(model, batch, latency_us)| {
                    ProfilePoint {
                        model,
                        batch,
                        latency_us,
                    }
                }),
                0..6
            ),
            proptest::sample::subsequence(Codec::ALL.to_vec(), 0..=Codec::ALL.len()),
        )
            .prop_map(|(worker, device, models, profile, codecs)| {
                Message::Register(Register {
                    worker,
                    device,
                    models,
                    profile,
                    codecs,
                })
            }),
        (any::<u32>(), finite()).prop_map(|(queue_depth, utilization)| {
            Message::Heartbeat(Heartbeat {
                queue_depth,
                utilization,
            })
        }),
        (
            any::<u64>(),
            text(),
            prop::collection::vec(
                (any::<u64>(), text(), any::<u64>(), geometry(), tensor()).prop_map(
                    |(id, camera, seq, geometry, tensor)| DispatchItem {
                        id,
                        camera,
                        seq,
                        geometry,
                        tensor,
                    }
                ),
                0..4
            ),
        )
            .prop_map(|(batch, model, items)| Message::Dispatch(Dispatch {
                batch,
                model,
                items
            })),
        (
            any::<u64>(),
            prop::collection::vec(
                (any::<u64>(), outcome()).prop_map(
                    |(id, (status, detections, timings, outputs))| ItemResult {
                        id,
                        status,
                        detections,
                        timings,
                        outputs,
                    }
                ),
                0..4
            ),
        )
            .prop_map(|(batch, items)| Message::BatchResult(BatchResult { batch, items })),
        any::<u32>().prop_map(|deadline_ms| Message::Drain(Drain { deadline_ms })),
    ]
}

// ---------------------------------------------------------------- properties

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn decode_of_encode_is_identity(msg in message()) {
        let bytes = common::encode(&msg);
        let mut buf = bytes.clone();
        let back = Message::decode(&mut buf, &Limits::default()).unwrap();
        prop_assert_eq!(&back, &msg);
        prop_assert_eq!(buf.remaining(), 0);
        // The shared fuzz check holds too: canonical encoding, decode_body.
        tidegate_protocol::fuzzing::check_roundtrip(&msg, Some(&bytes), &Limits::default());
    }

    #[test]
    fn chunks_concatenated_equal_encode(msg in message()) {
        let chunks = msg.to_chunks();
        prop_assert_eq!(chunks.concat(), common::encode(&msg).to_vec());
        // The first chunk holds the whole header and the payloads are the
        // message's own buffers, not copies.
        prop_assert!(chunks[0].len() >= Header::LEN);
        let own: Vec<&Bytes> = payloads(&msg).into_iter().filter(|p| !p.is_empty()).collect();
        prop_assert_eq!(chunks.len(), 1 + own.len());
        for (chunk, p) in chunks[1..].iter().zip(own) {
            prop_assert_eq!(chunk.as_ptr(), p.as_ptr());
        }
    }

    #[test]
    fn every_strict_prefix_is_incomplete_and_consumes_nothing(msg in message()) {
        let bytes = common::encode(&msg);
        for n in 0..bytes.len() {
            let mut prefix = bytes.slice(..n);
            let err = Message::decode(&mut prefix, &Limits::default()).unwrap_err();
            let needed = if n < Header::LEN { Header::LEN - n } else { bytes.len() - n };
            prop_assert_eq!(err, DecodeError::Incomplete { needed }, "prefix of {} bytes", n);
            prop_assert_eq!(prefix.len(), n, "Incomplete consumed bytes");
        }
    }

    #[test]
    fn messages_back_to_back_decode_in_order(a in message(), b in message()) {
        let mut buf = BytesMut::new();
        a.encode(&mut buf);
        b.encode(&mut buf);
        let limits = Limits::default();
        prop_assert_eq!(Message::decode(&mut buf, &limits).unwrap(), a);
        prop_assert_eq!(Message::decode(&mut buf, &limits).unwrap(), b);
        prop_assert!(buf.is_empty());
        prop_assert!(Message::decode(&mut buf, &limits).unwrap_err().is_incomplete());
    }

    #[test]
    fn decoded_tensor_payloads_are_slices_of_the_source(msg in message()) {
        let src = common::encode(&msg);
        let back = Message::decode(&mut src.clone(), &Limits::default()).unwrap();
        assert_zero_copy(&back, &src);
        // Also from a BytesMut, the form a stream reader accumulates into.
        let mut acc = BytesMut::from(&src[..]);
        let start = acc.as_ptr_range();
        let back = Message::decode(&mut acc, &Limits::default()).unwrap();
        for p in payloads(&back).into_iter().filter(|p| !p.is_empty()) {
            prop_assert!(start.contains(&p.as_ptr()));
        }
    }

    #[test]
    fn shared_fuzz_check_holds_for_valid_and_damaged_encodings(
        msg in message(),
        cut in any::<prop::sample::Index>(),
        flip in any::<(prop::sample::Index, u8)>(),
    ) {
        let bytes = common::encode(&msg).to_vec();
        tidegate_protocol::fuzzing::check(&bytes);
        tidegate_protocol::fuzzing::check(&bytes[..cut.index(bytes.len())]);
        let mut damaged = bytes.clone();
        let i = flip.0.index(damaged.len());
        damaged[i] ^= flip.1 | 1;
        tidegate_protocol::fuzzing::check(&damaged);
    }
}

// ---------------------------------------------------------------- targeted

fn header(kind: u8, len: u32) -> Vec<u8> {
    let mut v = b"TG".to_vec();
    v.push(VERSION);
    v.push(kind);
    v.extend_from_slice(&len.to_be_bytes());
    v
}

fn decode(bytes: &[u8]) -> Result<Message, DecodeError> {
    Message::decode(&mut Bytes::copy_from_slice(bytes), &Limits::default())
}

#[test]
fn nan_and_infinity_are_rejected_as_malformed() {
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let msg = Message::ControlHint(ControlHint {
            camera: "door".into(),
            max_fps: bad,
            motion_threshold: 0.1,
        });
        let err = decode(&common::encode(&msg)).unwrap_err();
        assert!(
            matches!(
                err,
                DecodeError::Invalid {
                    what: "max_fps",
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(!err.is_incomplete());
    }
    let mut d = common::face(0.5);
    d.keypoints[1][0] = f32::NAN;
    let msg = Message::Result(FrameResult {
        camera: "door".into(),
        seq: 1,
        captured_at_us: 1,
        status: Status::Ok,
        detections: vec![d],
        timings: Timings::default(),
        outputs: vec![],
    });
    let err = decode(&common::encode(&msg)).unwrap_err();
    assert!(
        matches!(
            err,
            DecodeError::Invalid {
                what: "keypoint",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("not a finite number"), "{err}");
}

#[test]
fn body_over_the_limit_is_rejected_from_the_header_alone() {
    let limits = Limits::default();
    for kind in tidegate_protocol::fuzzing::all_kinds() {
        let max = kind.max_body(&limits);
        // Only the 8 header bytes exist; the body is never waited for.
        let head = header(kind as u8, (max + 1) as u32);
        let err = decode(&head).unwrap_err();
        assert_eq!(
            err,
            DecodeError::TooLarge {
                what: "message body",
                len: max + 1,
                max
            },
            "{kind:?}"
        );
        assert_eq!(Header::peek(&head, &limits).unwrap_err(), err);
        // At the limit it is merely incomplete.
        let head = header(kind as u8, max as u32);
        assert_eq!(
            decode(&head).unwrap_err(),
            DecodeError::Incomplete { needed: max }
        );
    }
    // Frames may carry a tensor; control messages may not.
    assert_eq!(
        Kind::Frame.max_body(&limits),
        limits.max_header_bytes + limits.max_tensor_bytes
    );
    assert_eq!(Kind::Hello.max_body(&limits), limits.max_header_bytes);
    // Results may carry raw outputs.
    for kind in [Kind::Result, Kind::BatchResult] {
        assert_eq!(
            kind.max_body(&limits),
            limits.max_header_bytes + limits.max_tensor_bytes
        );
    }
}

/// A result whose outputs are `sizes` f32 elements each.
fn result_with_outputs(sizes: &[u32]) -> Message {
    Message::Result(FrameResult {
        camera: "door".into(),
        seq: 1,
        captured_at_us: 1,
        status: Status::Ok,
        detections: vec![],
        timings: Timings::default(),
        outputs: sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                OutputTensor::from_f32(format!("out{i}"), vec![1, n], &vec![0.5; n as usize])
                    .unwrap()
            })
            .collect(),
    })
}

#[test]
fn outputs_of_one_result_are_bounded_by_max_output_bytes() {
    let limits = Limits::default();
    let quarter = (limits.max_output_bytes / 4 / 4) as u32;
    // Four outputs filling the bound exactly decode.
    let msg = result_with_outputs(&[quarter; 4]);
    assert_eq!(decode(&common::encode(&msg)).unwrap(), msg);
    // One element more is too large, named, and allocates nothing.
    let err = decode(&common::encode(&result_with_outputs(&[
        quarter,
        quarter,
        quarter,
        quarter + 1,
    ])))
    .unwrap_err();
    assert_eq!(
        err,
        DecodeError::TooLarge {
            what: "outputs of one result",
            len: limits.max_output_bytes + 4,
            max: limits.max_output_bytes
        }
    );
    assert_eq!(err.code(), ErrorCode::TooLarge);

    // The bound is per outcome: a batch of items each at the bound is fine.
    let item = |id| ItemResult {
        id,
        status: Status::Ok,
        detections: vec![],
        timings: Timings::default(),
        outputs: vec![
            OutputTensor::from_f32(
                "e",
                vec![1, quarter * 4],
                &vec![1.0; (quarter * 4) as usize],
            )
            .unwrap(),
        ],
    };
    let msg = Message::BatchResult(BatchResult {
        batch: 1,
        items: vec![item(1), item(2), item(3)],
    });
    assert_eq!(decode(&common::encode(&msg)).unwrap(), msg);
}

/// The most outputs one message can list: `max_batch` items of `max_list`
/// empty outputs each, 12 bytes apiece on the wire (about 3 MB, well under
/// the body limit). The decoder keeps a running total of the payloads it
/// has seen; summing them again for every output made this one message
/// cost 3.4·10¹⁰ steps, minutes of a gateway thread.
#[test]
fn the_largest_list_of_empty_outputs_decodes() {
    let limits = Limits::default();
    let empty = OutputTensor {
        name: String::new(),
        dtype: DType::U8,
        shape: vec![0],
        data: Bytes::new(),
    };
    let item = |id| ItemResult {
        id,
        status: Status::Ok,
        detections: vec![],
        timings: Timings::default(),
        outputs: vec![empty.clone(); limits.max_list],
    };
    let msg = Message::BatchResult(BatchResult {
        batch: 7,
        items: (0..limits.max_batch as u64).map(item).collect(),
    });
    let bytes = common::encode(&msg);
    assert!(bytes.len() < Kind::BatchResult.max_body(&limits));
    let Message::BatchResult(back) = decode(&bytes).unwrap() else {
        panic!("not a BatchResult");
    };
    assert_eq!(back.items.len(), limits.max_batch);
    assert!(
        back.items
            .iter()
            .all(|i| i.outputs.len() == limits.max_list)
    );
}

#[test]
fn output_metadata_is_checked_like_tensor_metadata() {
    // Result "c", seq 1, t 1, ok, no detections, zero timings, one output.
    let head = |dtype: u8, ndims: u8, dims: &[u32], len: u32| {
        let mut w = Writer::default();
        w.string("c");
        w.u64(1);
        w.u64(1);
        w.u8(0);
        w.u16(0);
        for _ in 0..5 {
            w.u32(0);
        }
        w.u16(1);
        w.string("o");
        w.u8(dtype);
        w.u8(ndims);
        for &d in dims {
            w.u32(d);
        }
        w.u32(len);
        Bytes::from(w.finish(Kind::Result).concat())
    };
    let body = |b: Bytes| b.slice(Header::LEN..);
    let limits = Limits::default();
    let decode_body = |b: Bytes| Message::decode_body(Kind::Result, body(b), &limits);
    assert!(matches!(
        decode_body(head(7, 1, &[2], 2)).unwrap_err(),
        DecodeError::Invalid {
            what: "output dtype",
            ..
        }
    ));
    assert!(matches!(
        decode_body(head(1, 0, &[7], 0)).unwrap_err(),
        DecodeError::Tensor(TensorError::Dims { dims: 0, .. })
    ));
    let err = decode_body(head(1, 2, &[1, 3], 8)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "tensor shape [1,3] of f32 needs 12 bytes, payload has 8"
    );
    // Metadata right, payload missing or too long.
    assert_eq!(
        decode_body(head(1, 2, &[1, 3], 12)).unwrap_err(),
        DecodeError::Truncated {
            what: "tensor payload"
        }
    );
    let mut long = head(0, 1, &[2], 2).to_vec();
    long.extend_from_slice(&[1, 2, 3]);
    assert_eq!(
        Message::decode_body(
            Kind::Result,
            Bytes::from(long).slice(Header::LEN..),
            &limits
        )
        .unwrap_err(),
        DecodeError::TrailingBytes(1)
    );
}

#[test]
fn outputs_serialize_to_json_as_numbers_and_back() {
    let Message::Result(r) = result_with_outputs(&[3]) else {
        unreachable!()
    };
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(
        json["outputs"],
        serde_json::json!([{"name": "out0", "dtype": "f32", "shape": [1, 3], "data": [0.5, 0.5, 0.5]}])
    );
    let back: FrameResult = serde_json::from_value(json).unwrap();
    assert_eq!(back, r);
    // A result without outputs has no "outputs" key at all.
    let mut plain = r.clone();
    plain.outputs.clear();
    assert!(
        serde_json::to_value(&plain)
            .unwrap()
            .get("outputs")
            .is_none()
    );
    // Data that does not fill the shape, or a u8 out of range, is refused.
    for bad in [
        serde_json::json!({"name": "x", "dtype": "f32", "shape": [2], "data": [1.0]}),
        serde_json::json!({"name": "x", "dtype": "u8", "shape": [1], "data": [256.0]}),
        serde_json::json!({"name": "x", "dtype": "u8", "shape": [1], "data": [0.5]}),
    ] {
        let err = serde_json::from_value::<OutputTensor>(bad).unwrap_err();
        assert!(err.to_string().contains("output \"x\""), "{err}");
    }
}

/// A Frame body up to and including tensor metadata, with no payload.
fn frame_with_tensor_meta(dtype: u8, shape: &[u32], len: u32) -> Vec<u8> {
    let mut w = Writer::default();
    w.string("door");
    w.u64(1);
    w.u64(2);
    w.u32(80_000);
    w.string("blazeface");
    w.geometry(&Geometry::stretch(640, 480, 128, 128));
    w.u8(dtype);
    w.u8(0);
    w.encoding(Encoding::Raw);
    w.u8(shape.len() as u8);
    for &d in shape {
        w.u32(d);
    }
    w.u32(len);
    w.finish(Kind::Frame).concat()
}

#[test]
fn tensor_shape_over_max_tensor_bytes_is_rejected_before_its_payload() {
    // 8192 x 8192 x 3 u8 = 192 MiB > 64 MiB, declared but never sent.
    let bytes = frame_with_tensor_meta(0, &[1, 8192, 8192, 3], 201_326_592);
    let err = decode(&bytes).unwrap_err();
    assert_eq!(
        err,
        DecodeError::Tensor(TensorError::TooLarge {
            shape: "[1,8192,8192,3]".into(),
            max: 64 * 1024 * 1024
        })
    );
    assert!(err.to_string().contains("[1,8192,8192,3]"), "{err}");

    // A shape whose product overflows usize is too large, not a panic.
    let huge = [u32::MAX; 8];
    let err = decode(&frame_with_tensor_meta(1, &huge, 0)).unwrap_err();
    assert!(
        matches!(err, DecodeError::Tensor(TensorError::TooLarge { .. })),
        "{err:?}"
    );

    // Too many dimensions, and none.
    let err = decode(&frame_with_tensor_meta(0, &[1; 9], 1)).unwrap_err();
    assert_eq!(
        err,
        DecodeError::Tensor(TensorError::Dims { dims: 9, max: 8 })
    );
    let err = decode(&frame_with_tensor_meta(0, &[], 1)).unwrap_err();
    assert_eq!(
        err,
        DecodeError::Tensor(TensorError::Dims { dims: 0, max: 8 })
    );
}

#[test]
fn shape_and_length_mismatch_names_the_shape() {
    let mut bytes = frame_with_tensor_meta(0, &[1, 64, 64, 3], 10);
    bytes.extend_from_slice(&[0; 10]);
    // Fix up the body length for the 10 payload bytes.
    let len = (bytes.len() - Header::LEN) as u32;
    bytes[4..8].copy_from_slice(&len.to_be_bytes());
    let err = decode(&bytes).unwrap_err();
    assert_eq!(
        err,
        DecodeError::Tensor(TensorError::Length {
            shape: "[1,64,64,3]".into(),
            dtype: DType::U8,
            expected: 12288,
            actual: 10
        })
    );
    let text = err.to_string();
    assert!(
        text.contains("[1,64,64,3]") && text.contains("12288") && text.contains("10"),
        "{text}"
    );
}

#[test]
fn hostile_list_count_is_rejected_before_its_items_are_read() {
    // Register: worker "", device "", then u16::MAX models in a 2-byte rest.
    let mut body = vec![0, 0, 0, 0, 0xff, 0xff, 0, 0];
    let mut bytes = header(Kind::Register as u8, body.len() as u32);
    bytes.append(&mut body);
    assert_eq!(
        decode(&bytes).unwrap_err(),
        DecodeError::TooLarge {
            what: "models",
            len: 65535,
            max: 1024
        }
    );
    // Even where the limit allows the count, the bytes left cannot hold
    // that many items, so nothing is reserved for them.
    let roomy = Limits {
        max_list: usize::from(u16::MAX),
        ..Limits::default()
    };
    let err = Message::decode(&mut bytes.as_slice(), &roomy).unwrap_err();
    assert_eq!(err, DecodeError::Truncated { what: "models" });
    // The counting allocator in tests/alloc_bounds.rs measures the bytes.
}

#[test]
fn trailing_bytes_are_rejected() {
    for msg in [
        Message::Drain(Drain { deadline_ms: 1 }),
        common::samples()
            .into_iter()
            .find(|(n, _)| *n == "frame-u8")
            .unwrap()
            .1,
        common::samples()
            .into_iter()
            .find(|(n, _)| *n == "register")
            .unwrap()
            .1,
    ] {
        let mut bytes = common::encode(&msg).to_vec();
        bytes.extend_from_slice(&[0xAA, 0xBB]);
        let len = (bytes.len() - Header::LEN) as u32;
        bytes[4..8].copy_from_slice(&len.to_be_bytes());
        assert_eq!(
            decode(&bytes).unwrap_err(),
            DecodeError::TrailingBytes(2),
            "{:?}",
            msg.kind()
        );
    }
}

#[test]
fn bad_magic_version_and_kind_are_named() {
    let good = common::encode(&Message::Drain(Drain { deadline_ms: 5 })).to_vec();
    assert!(decode(&good).is_ok());

    let mut bad = good.clone();
    bad[0] = b'X';
    let err = decode(&bad).unwrap_err();
    assert_eq!(err, DecodeError::BadMagic([b'X', b'G']));
    assert!(err.to_string().contains("not a tidegate message"), "{err}");

    // Version 1 (before labels and result outputs) and a future one.
    for v in [1u8, VERSION + 1] {
        let mut bad = good.clone();
        bad[2] = v;
        let err = decode(&bad).unwrap_err();
        assert_eq!(err, DecodeError::UnsupportedVersion(v));
        assert!(err.to_string().contains(&format!("version {v}")), "{err}");
    }

    for kind in [0u8, 17, 255] {
        let mut bad = good.clone();
        bad[3] = kind;
        assert_eq!(decode(&bad).unwrap_err(), DecodeError::UnknownKind(kind));
    }
}

#[test]
fn a_camera_asks_for_one_to_three_copies_and_nothing_else() {
    let open = |copies: u8| {
        let mut w = Writer::default();
        w.string("door");
        w.string("blazeface");
        w.u32(80);
        w.encoding(Encoding::Jpeg { quality: 90 });
        w.u8(copies);
        Bytes::from(w.finish(Kind::CameraOpen).concat())
    };
    for copies in 1..=MAX_COPIES {
        let Message::CameraOpen(o) = decode(&open(copies)).unwrap() else {
            panic!("not a CameraOpen");
        };
        assert_eq!(o.copies, copies);
    }
    for copies in [0, MAX_COPIES + 1, u8::MAX] {
        let err = decode(&open(copies)).unwrap_err();
        assert!(
            matches!(err, DecodeError::Invalid { what: "copies", .. }),
            "{copies}: {err:?}"
        );
        assert!(err.to_string().contains("1 to 3"), "{err}");
    }
}

#[test]
fn unknown_enum_codes_are_invalid_not_guessed() {
    // Hello with role 2.
    let mut bytes = header(Kind::Hello as u8, 5);
    bytes.extend_from_slice(&[2, 0, 0, 0, 0]);
    assert!(matches!(
        decode(&bytes).unwrap_err(),
        DecodeError::Invalid { what: "role", .. }
    ));
    // Result with status 4.
    let mut w = Writer::default();
    w.string("c");
    w.u64(1);
    w.u64(1);
    w.u8(4);
    let bytes = w.finish(Kind::Result).concat();
    assert!(matches!(
        decode(&bytes).unwrap_err(),
        DecodeError::Invalid { what: "status", .. }
    ));
    // Unknown error codes are the one exception: they read as Internal.
    let mut w = Writer::default();
    w.u16(999);
    w.string("from the future");
    let bytes = w.finish(Kind::Error).concat();
    assert_eq!(
        decode(&bytes).unwrap(),
        Message::Error(ErrorMsg {
            code: ErrorCode::Internal,
            message: "from the future".into()
        })
    );
}

#[test]
fn invalid_utf8_and_long_strings_are_rejected() {
    let mut bytes = header(Kind::Hello as u8, 7);
    bytes.extend_from_slice(&[0, 0, 2, 0xC3, 0x28, 0, 0]);
    assert!(matches!(
        decode(&bytes).unwrap_err(),
        DecodeError::Invalid { what: "name", .. }
    ));

    let mut w = Writer::default();
    w.u8(0);
    w.string(&"x".repeat(1025));
    w.string("");
    let bytes = w.finish(Kind::Hello).concat();
    assert_eq!(
        decode(&bytes).unwrap_err(),
        DecodeError::TooLarge {
            what: "name",
            len: 1025,
            max: 1024
        }
    );
}

#[test]
fn header_split_across_buffer_chunks_is_refused_not_misread() {
    let bytes = common::encode(&Message::Drain(Drain { deadline_ms: 5 }));
    let mut chained = bytes.slice(..3).chain(bytes.slice(3..));
    let err = Message::decode(&mut chained, &Limits::default()).unwrap_err();
    assert!(
        matches!(err, DecodeError::Invalid { what: "buffer", .. }),
        "{err:?}"
    );
    // A contiguous header with the body in later chunks is fine.
    let mut chained = bytes.slice(..9).chain(bytes.slice(9..));
    assert!(Message::decode(&mut chained, &Limits::default()).is_ok());
}

#[test]
fn every_sample_round_trips_and_passes_the_fuzz_check() {
    let mut kinds = std::collections::HashSet::new();
    for (name, msg) in common::samples() {
        let bytes = common::encode(&msg);
        assert_eq!(decode(&bytes).unwrap(), msg, "{name}");
        tidegate_protocol::fuzzing::check(&bytes);
        kinds.insert(msg.kind());
    }
    assert_eq!(kinds.len(), tidegate_protocol::fuzzing::all_kinds().len());
}

#[test]
fn incomplete_then_complete_as_bytes_arrive() {
    // A stream reader accumulating into a BytesMut: Incomplete until the
    // last byte, then the message.
    let msg = common::samples()
        .into_iter()
        .find(|(n, _)| *n == "dispatch")
        .unwrap()
        .1;
    let bytes = common::encode(&msg);
    let mut acc = BytesMut::new();
    for (i, b) in bytes.iter().enumerate() {
        acc.put_u8(*b);
        let res = Message::decode(&mut acc, &Limits::default());
        if i + 1 < bytes.len() {
            assert!(res.unwrap_err().is_incomplete(), "at byte {i}");
        } else {
            assert_eq!(res.unwrap(), msg);
            assert!(acc.is_empty());
        }
    }
}

// ---------------------------------------------------------------- frame bounds

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Any frame within the limits (names up to `max_string_bytes`, up to
    /// `max_dims` dimensions) has a body no longer than
    /// `Frame::max_body_len` of its payload, and one with the longest
    /// names and the most dimensions has exactly that body: the bound a
    /// gateway refuses a frame's header by is never below a frame it must
    /// take, and no looser than it says.
    #[test]
    fn a_frames_body_is_within_its_bound_and_the_longest_frame_meets_it(
        camera in 0usize..=1024,
        model in 0usize..=1024,
        dims in 1usize..=8,
        payload in 0usize..4096,
        geometry in geometry(),
    ) {
        let limits = Limits::default();
        let frame = |camera: usize, model: usize, dims: usize| {
            let mut shape = vec![1u32; dims];
            shape[0] = payload as u32;
            Message::Frame(Frame {
                camera: "c".repeat(camera),
                seq: u64::MAX,
                captured_at_us: u64::MAX,
                budget_us: u32::MAX,
                model: "m".repeat(model),
                geometry,
                tensor: Tensor::raw(DType::U8, Layout::Nhwc, shape, Bytes::from(vec![7u8; payload])),
            })
        };
        let body = |m: &Message| common::encode(m).len() - Header::LEN;
        let bound = Frame::max_body_len(payload, &limits);
        prop_assert!(body(&frame(camera, model, dims)) <= bound);
        let longest = frame(limits.max_string_bytes, limits.max_string_bytes, limits.max_dims);
        prop_assert_eq!(body(&longest), bound);
        // and it decodes: the longest frame is one the protocol takes
        let mut bytes = common::encode(&longest);
        prop_assert!(Message::decode(&mut bytes, &limits).is_ok());
    }
}

/// A frame's payload bound is four times its raw pixels plus room for a
/// file's headers, for each element type.
#[test]
fn a_frames_largest_payload_is_four_times_raw_plus_a_files_headers() {
    let mut input = InputSpec {
        width: 128,
        height: 96,
        channels: 3,
        dtype: DType::U8,
        layout: Layout::Nhwc,
        color: ColorOrder::Rgb,
        resize: Resize::Stretch,
    };
    assert_eq!(input.raw_frame_bytes(), 128 * 96 * 3);
    assert_eq!(
        input.max_frame_payload(),
        4 * 128 * 96 * 3 + InputSpec::FILE_OVERHEAD
    );
    input.dtype = DType::F32;
    assert_eq!(input.raw_frame_bytes(), 128 * 96 * 3 * 4);
    input.width = u32::MAX;
    input.height = u32::MAX;
    assert_eq!(input.max_frame_payload(), usize::MAX, "saturates");
}
