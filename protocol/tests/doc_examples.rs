//! The worked hex examples in docs/protocol.md are generated here and
//! checked against the document, so the document cannot drift from the
//! code. Each example lists every field's bytes with its meaning; the test
//! proves the fields add up to the real encoding, that the bytes decode back
//! to the message, and that the listing appears verbatim in the document.
//! On a mismatch the failure message prints the listing to paste.

use bytes::Bytes;
use tidegate_protocol::*;

/// Renders `bytes` cut into `fields` (length, meaning): at most 8 bytes of
/// hex per line, the meaning on the field's first line.
fn listing(bytes: &[u8], fields: &[(usize, &str)]) -> String {
    let total: usize = fields.iter().map(|f| f.0).sum();
    assert_eq!(
        total,
        bytes.len(),
        "fields cover {total} of {} bytes",
        bytes.len()
    );
    let mut out = String::new();
    let mut at = 0;
    for &(len, meaning) in fields {
        let field = &bytes[at..at + len];
        for (i, line) in field.chunks(8).enumerate() {
            let hex: Vec<String> = line.iter().map(|b| format!("{b:02x}")).collect();
            let label = if i == 0 { meaning } else { "" };
            out.push_str(format!("{:<24} {label}", hex.join(" ")).trim_end());
            out.push('\n');
        }
        at += len;
    }
    out
}

fn check_example(msg: &Message, fields: &[(usize, &str)]) {
    let mut bytes = Vec::new();
    msg.encode(&mut bytes);
    assert_eq!(
        fields[3].1,
        format!("body length {}", bytes.len() - Header::LEN)
    );
    let text = listing(&bytes, fields);
    let back = Message::decode(&mut Bytes::from(bytes.clone()), &Limits::default()).unwrap();
    assert_eq!(&back, msg);

    let doc_path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/protocol.md");
    let doc = std::fs::read_to_string(doc_path).expect("docs/protocol.md is readable");
    let block = format!("```text\n{text}```\n");
    assert!(
        doc.contains(&block),
        "docs/protocol.md lacks the {:?} example; it should read:\n{block}",
        msg.kind()
    );
    let flat: Vec<String> = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let flat = flat.join("");
    assert!(
        doc.contains(&flat),
        "docs/protocol.md lacks the {:?} example as one hex string:\n{flat}",
        msg.kind()
    );
}

#[test]
fn hello_example_in_the_document_is_exact() {
    let msg = Message::Hello(Hello {
        role: Role::Edge,
        name: "cam-1".into(),
        token: "s3cret".into(),
    });
    check_example(
        &msg,
        &[
            (2, "magic \"TG\""),
            (1, "version 3"),
            (1, "kind 1 = Hello"),
            (4, "body length 16"),
            (1, "role 0 = edge"),
            (2, "name: length 5"),
            (5, "  \"cam-1\""),
            (2, "token: length 6"),
            (6, "  \"s3cret\""),
        ],
    );
}

#[test]
fn frame_example_in_the_document_is_exact() {
    let msg = Message::Frame(Frame {
        camera: "cam-1".into(),
        seq: 1,
        captured_at_us: 1_700_000_000_000_000,
        budget_us: 80_000,
        model: "tiny".into(),
        geometry: Geometry::stretch(640, 480, 2, 2),
        tensor: Tensor::raw(
            DType::U8,
            Layout::Nhwc,
            vec![1, 2, 2, 3],
            Bytes::from_static(&[
                0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18, 0x19, 0x1a, 0x1b,
            ]),
        ),
    });
    check_example(
        &msg,
        &[
            (2, "magic \"TG\""),
            (1, "version 3"),
            (1, "kind 6 = Frame"),
            (4, "body length 94"),
            (2, "camera: length 5"),
            (5, "  \"cam-1\""),
            (8, "seq 1"),
            (8, "captured_at_us 1700000000000000"),
            (4, "budget_us 80000"),
            (2, "model: length 4"),
            (4, "  \"tiny\""),
            (4, "geometry.source_width 640"),
            (4, "geometry.source_height 480"),
            (4, "geometry.content_x 0"),
            (4, "geometry.content_y 0"),
            (4, "geometry.content_width 2"),
            (4, "geometry.content_height 2"),
            (1, "tensor dtype 0 = u8"),
            (1, "tensor layout 0 = nhwc"),
            (1, "tensor codec 0 = raw"),
            (1, "tensor quality 0 (JPEG only)"),
            (1, "tensor ndims 4"),
            (16, "tensor shape [1,2,2,3]"),
            (4, "tensor payload length 12 (= 1*2*2*3 * 1 byte)"),
            (12, "payload: 12 pixel bytes, row-major"),
        ],
    );
}

#[test]
fn result_example_in_the_document_is_exact() {
    let msg = Message::Result(FrameResult {
        camera: "cam-1".into(),
        seq: 1,
        captured_at_us: 1_700_000_000_000_000,
        status: Status::Ok,
        detections: vec![Detection {
            x1: 1.5,
            y1: 2.0,
            x2: 100.0,
            y2: 64.25,
            score: 0.75,
            class: 0,
            keypoints: vec![[50.5, 30.0]],
        }],
        timings: Timings {
            queue_us: 1200,
            decode_us: 0,
            preprocess_us: 300,
            inference_us: 4100,
            postprocess_us: 90,
        },
        outputs: vec![],
    });
    check_example(
        &msg,
        &[
            (2, "magic \"TG\""),
            (1, "version 3"),
            (1, "kind 7 = Result"),
            (4, "body length 81"),
            (2, "camera: length 5"),
            (5, "  \"cam-1\""),
            (8, "seq 1"),
            (8, "captured_at_us 1700000000000000 (echoed)"),
            (1, "status 0 = ok"),
            (2, "detections: count 1"),
            (4, "x1 1.5"),
            (4, "y1 2.0"),
            (4, "x2 100.0"),
            (4, "y2 64.25"),
            (4, "score 0.75"),
            (4, "class 0"),
            (1, "keypoints: count 1"),
            (4, "  x 50.5"),
            (4, "  y 30.0"),
            (4, "timings.queue_us 1200"),
            (4, "timings.decode_us 0"),
            (4, "timings.preprocess_us 300"),
            (4, "timings.inference_us 4100"),
            (4, "timings.postprocess_us 90"),
            (2, "outputs: count 0"),
        ],
    );
}

#[test]
fn result_with_outputs_example_in_the_document_is_exact() {
    let msg = Message::Result(FrameResult {
        camera: "cam-1".into(),
        seq: 2,
        captured_at_us: 1_700_000_000_040_000,
        status: Status::Ok,
        detections: vec![],
        timings: Timings {
            queue_us: 800,
            decode_us: 0,
            preprocess_us: 250,
            inference_us: 3900,
            postprocess_us: 10,
        },
        outputs: vec![OutputTensor::from_f32("logits", vec![1, 2], &[0.5, -1.0]).unwrap()],
    });
    check_example(
        &msg,
        &[
            (2, "magic \"TG\""),
            (1, "version 3"),
            (1, "kind 7 = Result"),
            (4, "body length 78"),
            (2, "camera: length 5"),
            (5, "  \"cam-1\""),
            (8, "seq 2"),
            (8, "captured_at_us 1700000000040000 (echoed)"),
            (1, "status 0 = ok"),
            (2, "detections: count 0"),
            (4, "timings.queue_us 800"),
            (4, "timings.decode_us 0"),
            (4, "timings.preprocess_us 250"),
            (4, "timings.inference_us 3900"),
            (4, "timings.postprocess_us 10"),
            (2, "outputs: count 1"),
            (2, "  name: length 6"),
            (6, "    \"logits\""),
            (1, "  dtype 1 = f32"),
            (1, "  ndims 2"),
            (8, "  shape [1,2]"),
            (4, "  payload length 8 (= 1*2 * 4 bytes)"),
            (4, "payload: 0.5 as f32 little-endian"),
            (4, "payload: -1.0 as f32 little-endian"),
        ],
    );
}
