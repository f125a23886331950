//! Batching, u8 and planar model inputs and the generic decoders on the real
//! ONNX Runtime, with a probe graph written here byte by byte (small enough
//! to say exactly what each frame's outputs must be).
//!
//! The probe takes `pixels` `[batch,16,16,3]` (or `[batch,3,16,16]`), f32 or
//! u8, flattens each frame and returns its first element as `scores`
//! `[batch,1,1]` and the next four as `boxes` `[batch,1,4]`: one BlazeFace
//! anchor at the input centre whose logit and regressors are whatever the
//! frame's first pixel values say. So each frame's detection shows that its
//! own pixels reached its own slot of the batch.

use std::fs;

use tidegate_protocol::{DType, Geometry, Layout, Status, Tensor};
use tidegate_testkit::pb;
use tidegate_worker::backend::{Backend, FrameInput, FrameOutcome, OrtBackend};
use tidegate_worker::model::Repository;
use tidegate_worker::runtime::RuntimeOptions;

const FLOAT: i64 = 1;
const UINT8: i64 = 2;
const INT64: i64 = 7;

/// ValueInfoProto of a tensor whose first dimension is the symbol `batch`.
fn value_info(out: &mut Vec<u8>, field: u64, name: &str, elem: i64, dims: &[i64]) {
    pb::msg(out, field, |v| {
        pb::bytes(v, 1, name.as_bytes());
        pb::msg(v, 2, |t| {
            pb::msg(t, 1, |tt| {
                pb::int(tt, 1, elem);
                pb::msg(tt, 2, |shape| {
                    pb::msg(shape, 1, |d| pb::bytes(d, 2, b"batch"));
                    for &dim in dims {
                        pb::msg(shape, 1, |d| pb::int(d, 1, dim));
                    }
                });
            });
        });
    });
}

fn int64_initializer(out: &mut Vec<u8>, name: &str, values: &[i64]) {
    pb::msg(out, 5, |t| {
        pb::int(t, 1, values.len() as i64);
        pb::int(t, 2, INT64);
        pb::bytes(t, 8, name.as_bytes());
        let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        pb::bytes(t, 9, &raw);
    });
}

fn node(out: &mut Vec<u8>, op: &str, inputs: &[&str], output: &str, cast_to: Option<i64>) {
    pb::msg(out, 1, |n| {
        for i in inputs {
            pb::bytes(n, 1, i.as_bytes());
        }
        pb::bytes(n, 2, output.as_bytes());
        pb::bytes(n, 3, output.as_bytes());
        pb::bytes(n, 4, op.as_bytes());
        if let Some(to) = cast_to {
            pb::msg(n, 5, |a| {
                pb::bytes(a, 1, b"to");
                pb::int(a, 3, to);
                pb::int(a, 20, 2); // AttributeType INT
            });
        }
    });
}

/// The probe graph for a model input of `layout` and `dtype`.
fn probe_onnx(layout: Layout, dtype: DType) -> Vec<u8> {
    let mut graph = Vec::new();
    let mut flat_input = "pixels";
    if dtype == DType::U8 {
        node(&mut graph, "Cast", &["pixels"], "as_f32", Some(FLOAT));
        flat_input = "as_f32";
    }
    node(
        &mut graph,
        "Reshape",
        &[flat_input, "flat_shape"],
        "flat",
        None,
    );
    node(
        &mut graph,
        "Slice",
        &["flat", "s0", "e0", "axis"],
        "scores",
        None,
    );
    node(
        &mut graph,
        "Slice",
        &["flat", "s1", "e1", "axis"],
        "boxes",
        None,
    );
    pb::bytes(&mut graph, 2, b"probe");
    int64_initializer(&mut graph, "flat_shape", &[0, 1, -1]);
    int64_initializer(&mut graph, "s0", &[0]);
    int64_initializer(&mut graph, "e0", &[1]);
    int64_initializer(&mut graph, "s1", &[1]);
    int64_initializer(&mut graph, "e1", &[5]);
    int64_initializer(&mut graph, "axis", &[2]);
    let dims = match layout {
        Layout::Nhwc => [16, 16, 3],
        Layout::Nchw => [3, 16, 16],
    };
    let elem = if dtype == DType::U8 { UINT8 } else { FLOAT };
    value_info(&mut graph, 11, "pixels", elem, &dims);
    value_info(&mut graph, 12, "scores", FLOAT, &[1, 1]);
    value_info(&mut graph, 12, "boxes", FLOAT, &[1, 4]);
    let mut model = Vec::new();
    pb::int(&mut model, 1, 8); // IR version
    pb::bytes(&mut model, 2, b"tidegate-test");
    pb::bytes(&mut model, 7, &graph);
    pb::msg(&mut model, 8, |o| {
        pb::bytes(o, 1, b"");
        pb::int(o, 2, 13);
    });
    model
}

fn probe_toml(layout: Layout, dtype: DType, decoder: &str) -> String {
    format!(
        r#"
name = "probe"
version = 1
file = "probe.onnx"
max_batch = 4

[input]
name = "pixels"
layout = "{layout}"
width = 16
height = 16
channels = 3
color = "rgb"
resize = "stretch"
model_dtype = "{dtype}"

[[outputs]]
name = "scores"
shape = [-1, 1, 1]
[[outputs]]
name = "boxes"
shape = [-1, 1, 4]

{decoder}
"#
    )
}

const BLAZEFACE_DECODER: &str = r#"
[decoder]
kind = "blazeface"
score_threshold = 0.75
iou_threshold = 0.3
max_detections = 4
labels = ["probe"]
[[decoder.layers]]
scores = "scores"
boxes = "boxes"
grid = 1
anchors_per_cell = 1
"#;

fn probe_backend(layout: Layout, dtype: DType, decoder: &str) -> (tempfile::TempDir, OrtBackend) {
    probe_backend_padding(layout, dtype, decoder, None)
}

/// [`probe_backend`] with `runtime.pad_batches` set to `pad`.
fn probe_backend_padding(
    layout: Layout,
    dtype: DType,
    decoder: &str,
    pad: Option<bool>,
) -> (tempfile::TempDir, OrtBackend) {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("probe");
    fs::create_dir(&folder).unwrap();
    fs::write(folder.join("probe.onnx"), probe_onnx(layout, dtype)).unwrap();
    fs::write(
        folder.join("model.toml"),
        probe_toml(layout, dtype, decoder),
    )
    .unwrap();
    let repo = Repository::load(dir.path(), None).unwrap();
    let options = RuntimeOptions {
        intra_threads: 1,
        warmup_runs: 1,
        profile_runs: 3,
        pad_batches: pad,
        ..RuntimeOptions::default()
    };
    let backend = OrtBackend::open(&repo, &options).unwrap_or_else(|e| panic!("{e}"));
    (dir, backend)
}

/// A 16×16 RGB NHWC frame whose model input starts with `values` (logit,
/// dx, dy, w, h) once converted to `model_layout`. The source is 160×160, so
/// one input pixel is ten source pixels.
fn frame(model_layout: Layout, values: [u8; 5]) -> FrameInput {
    let mut data = vec![0u8; 16 * 16 * 3];
    for (k, v) in values.into_iter().enumerate() {
        match model_layout {
            // Model element k is source byte k.
            Layout::Nhwc => data[k] = v,
            // Model element k (< 256) is the red value of pixel k.
            Layout::Nchw => data[3 * k] = v,
        }
    }
    FrameInput {
        tensor: Tensor::raw(DType::U8, Layout::Nhwc, vec![1, 16, 16, 3], data.into()),
        geometry: Geometry::stretch(160, 160, 16, 16),
    }
}

/// Frame `i`: a confident 8×8 box shifted right by 2i input pixels.
fn shifted(layout: Layout, i: u8) -> FrameInput {
    frame(layout, [10, 2 * i, 0, 8, 8])
}

/// Checks that `o` holds frame `i`'s box: x from (4 + 2i)·10 to (12 + 2i)·10,
/// clamped to 160, y from 40 to 120.
fn assert_shifted(o: &FrameOutcome, i: u8) {
    assert_eq!(o.status, Status::Ok, "{o:?}");
    assert_eq!(o.detections.len(), 1, "{o:?}");
    let d = &o.detections[0];
    let x1 = (4.0 + 2.0 * i as f32) * 10.0;
    let x2 = ((12.0 + 2.0 * i as f32) * 10.0).min(160.0);
    let near = |a: f32, b: f32| (a - b).abs() < 1e-3;
    assert!(
        near(d.x1, x1) && near(d.x2, x2) && near(d.y1, 40.0) && near(d.y2, 120.0),
        "frame {i}: {d:?}"
    );
    assert!(d.score > 0.99, "{d:?}");
}

#[test]
fn valid_frames_run_as_one_batch_and_each_gets_its_own_detections() {
    let (_dir, mut backend) = probe_backend(Layout::Nhwc, DType::F32, BLAZEFACE_DECODER);
    let mut bad = shifted(Layout::Nhwc, 0);
    bad.tensor.shape = vec![1, 8, 32, 3];
    let quiet = frame(Layout::Nhwc, [0, 0, 0, 8, 8]); // logit 0: score 0.5
    let frames = [
        shifted(Layout::Nhwc, 0),
        bad,
        shifted(Layout::Nhwc, 1),
        quiet,
        shifted(Layout::Nhwc, 2),
    ];
    let out = backend.run("probe", &frames);
    assert_eq!(out.len(), 5);
    assert_shifted(&out[0], 0);
    assert_eq!(
        out[1].status,
        Status::Failed("model 'probe' expects u8 [1,16,16,3], frame has [1,8,32,3]".into())
    );
    assert_shifted(&out[2], 1);
    assert_eq!(out[3].status, Status::Ok);
    assert!(out[3].detections.is_empty(), "{:?}", out[3]);
    assert_shifted(&out[4], 2);
    // Four valid frames, max_batch 4: one run, whose time they share.
    let runs: Vec<u32> = [0, 2, 3, 4]
        .iter()
        .map(|&i| out[i].timings.inference_us)
        .collect();
    assert!(runs.iter().all(|&t| t == runs[0]), "{runs:?}");
}

#[test]
fn more_frames_than_max_batch_are_split_into_batches() {
    let (_dir, mut backend) = probe_backend(Layout::Nhwc, DType::F32, BLAZEFACE_DECODER);
    let frames: Vec<FrameInput> = (0..6).map(|i| shifted(Layout::Nhwc, i)).collect();
    let out = backend.run("probe", &frames);
    assert_eq!(out.len(), 6);
    for (i, o) in out.iter().enumerate() {
        assert_shifted(o, i as u8);
    }
}

#[test]
fn u8_model_input_is_fed_without_normalisation() {
    let (_dir, mut backend) = probe_backend(Layout::Nhwc, DType::U8, BLAZEFACE_DECODER);
    let out = backend.run(
        "probe",
        &[shifted(Layout::Nhwc, 1), shifted(Layout::Nhwc, 3)],
    );
    assert_shifted(&out[0], 1);
    assert_shifted(&out[1], 3);
}

#[test]
fn planar_model_input_gets_planar_data() {
    let (_dir, mut backend) = probe_backend(Layout::Nchw, DType::F32, BLAZEFACE_DECODER);
    let out = backend.run(
        "probe",
        &[shifted(Layout::Nchw, 2), shifted(Layout::Nchw, 0)],
    );
    assert_shifted(&out[0], 2);
    assert_shifted(&out[1], 0);
}

#[test]
fn raw_decoder_passes_each_frames_outputs_through_without_detections() {
    let (_dir, mut backend) =
        probe_backend(Layout::Nhwc, DType::F32, "[decoder]\nkind = \"raw\"\n");
    let out = backend.run(
        "probe",
        &[
            shifted(Layout::Nhwc, 0),
            shifted(Layout::Nhwc, 1),
            shifted(Layout::Nhwc, 3),
        ],
    );
    for (o, i) in out.iter().zip([0.0f32, 1.0, 3.0]) {
        assert_eq!(o.status, Status::Ok);
        assert!(o.detections.is_empty());
        let names: Vec<&str> = o.outputs.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, vec!["scores", "boxes"]);
        assert_eq!(o.outputs[0].shape, vec![1, 1, 1]);
        assert_eq!(o.outputs[0].values(), vec![10.0]);
        assert_eq!(o.outputs[1].shape, vec![1, 1, 4]);
        assert_eq!(o.outputs[1].values(), vec![2.0 * i, 0.0, 8.0, 8.0]);
    }
}

#[test]
fn classify_decoder_reports_each_frames_top_classes() {
    // The probe's `boxes` output, [batch,1,4], read as four class scores.
    let decoder = "[decoder]\nkind = \"classify\"\noutput = \"boxes\"\nsoftmax = true\ntop_k = 2\nlabels = [\"a\", \"b\", \"c\", \"d\"]\n";
    let (_dir, mut backend) = probe_backend(Layout::Nhwc, DType::F32, decoder);
    // Scores [2i, 0, 8, 8]: frame 0 and 3 tie c/d (c first); frame 5 has a
    // at 10.
    let out = backend.run(
        "probe",
        &[shifted(Layout::Nhwc, 0), shifted(Layout::Nhwc, 5)],
    );
    let classes = |o: &FrameOutcome| o.detections.iter().map(|d| d.class).collect::<Vec<_>>();
    assert_eq!(classes(&out[0]), vec![2, 3]);
    assert_eq!(classes(&out[1]), vec![0, 2]);
    let e = |x: f32| x.exp();
    let p = e(10.0) / (e(10.0) + e(0.0) + 2.0 * e(8.0));
    assert!(
        (out[1].detections[0].score - p).abs() < 1e-5,
        "{:?}",
        out[1]
    );
    // Whole-frame boxes in source pixels.
    let d = &out[1].detections[0];
    assert_eq!((d.x1, d.y1, d.x2, d.y2), (0.0, 0.0, 160.0, 160.0));
}

#[test]
fn boxes_spec_contradicting_the_graph_is_refused_naming_model_field_and_both_shapes() {
    // model.toml says rows of 6; the graph's `boxes` output has rows of 4.
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("probe");
    fs::create_dir(&folder).unwrap();
    fs::write(
        folder.join("probe.onnx"),
        probe_onnx(Layout::Nhwc, DType::F32),
    )
    .unwrap();
    let toml = probe_toml(
        Layout::Nhwc,
        DType::F32,
        "[decoder]\nkind = \"boxes\"\noutput = \"boxes\"\nscore_threshold = 0.5\niou_threshold = 0.5\nmax_detections = 5\nlabels = [\"thing\"]\n",
    )
    .replace("shape = [-1, 1, 4]", "shape = [-1, 1, 6]");
    fs::write(folder.join("model.toml"), toml).unwrap();
    let repo = Repository::load(dir.path(), None).unwrap();
    let options = RuntimeOptions {
        intra_threads: 1,
        ..RuntimeOptions::default()
    };
    let err = OrtBackend::open(&repo, &options).unwrap_err().to_string();
    assert_eq!(
        err,
        "model 'probe': outputs[1].shape (\"boxes\") in model.toml is [-1,1,6], but the ONNX file has [-1,1,4]; fix model.toml so they agree"
    );
}

#[test]
fn profile_covers_batch_sizes_up_to_max_batch() {
    let (_dir, mut backend) = probe_backend(Layout::Nhwc, DType::F32, BLAZEFACE_DECODER);
    let points = backend.profile("probe", &[0, 1, 2, 4, 8]).unwrap();
    let sizes: Vec<u16> = points.iter().map(|p| p.0).collect();
    assert_eq!(sizes, vec![1, 2, 4]);
    assert!(points.iter().all(|p| p.1 > 0), "{points:?}");
}

#[test]
fn padded_batches_run_at_profiled_sizes_and_each_frame_keeps_its_own_result() {
    let (_dir, mut backend) =
        probe_backend_padding(Layout::Nhwc, DType::F32, BLAZEFACE_DECODER, Some(true));
    // max_batch 4: the profiled sizes are 1, 2 and 4, and 3 runs as 4.
    let sizes: Vec<Option<usize>> = (1..=4).map(|n| backend.run_size("probe", n)).collect();
    assert_eq!(sizes, vec![Some(1), Some(2), Some(4), Some(4)]);
    let four: Vec<FrameInput> = (0..4).map(|i| shifted(Layout::Nhwc, i)).collect();
    backend.run("probe", &four);
    // Three frames after four: the padding row still holds the last run's
    // fourth frame, and no frame gets its result.
    let three: Vec<FrameInput> = (4..7).map(|i| shifted(Layout::Nhwc, i)).collect();
    let out = backend.run("probe", &three);
    assert_eq!(backend.last_run_size("probe"), Some(4));
    assert_eq!(out.len(), 3);
    for (o, i) in out.iter().zip(4..7) {
        assert_shifted(o, i);
    }
    backend.run("probe", &[shifted(Layout::Nhwc, 1)]);
    assert_eq!(backend.last_run_size("probe"), Some(1));
    // Registered: a point for every size, at the time of the size it runs as.
    let measured = backend.profile("probe", &[1, 2, 4]).unwrap();
    let registered = backend.registered_profile("probe", &measured);
    let batches: Vec<u16> = registered.iter().map(|p| p.0).collect();
    assert_eq!(batches, vec![1, 2, 3, 4]);
    assert_eq!(registered[0].1, measured[0].1);
    assert_eq!(registered[1].1, measured[1].1);
    assert_eq!(registered[2].1, measured[2].1);
    assert_eq!(registered[3].1, measured[2].1);
}

#[test]
fn on_the_cpu_batches_run_at_their_own_size_by_default() {
    let (_dir, mut backend) = probe_backend(Layout::Nhwc, DType::F32, BLAZEFACE_DECODER);
    assert_eq!(backend.run_size("probe", 3), Some(3));
    let three: Vec<FrameInput> = (0..3).map(|i| shifted(Layout::Nhwc, i)).collect();
    let out = backend.run("probe", &three);
    assert_eq!(backend.last_run_size("probe"), Some(3));
    for (o, i) in out.iter().zip(0..3) {
        assert_shifted(o, i);
    }
    let measured = backend.profile("probe", &[1, 2, 4]).unwrap();
    assert_eq!(backend.registered_profile("probe", &measured), measured);
    assert_eq!(backend.run_size("nope", 1), None);
}
